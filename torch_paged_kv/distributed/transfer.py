"""Page transfer between processes: `send_sequences` and `receive_sequences` over `torch.distributed`.

The sender ships the pages of one or more sequences (each shared page once), with their lengths,
token ids and prefix-cache keys (and `scales` for a quantized cache); the receiver allocates
through `KVCacheManager.reserve`, skips pages it already has cached, receives the rest in
chunks of many pages per message, checks every chunk's checksum, and registers the sequences only
once every byte has arrived. On any failure (a rejected request, a dead or silent peer, a bad
checksum) the receiver's manager is as before and a `TransferError` says what happened. The
messages and their order are in `wire.py`; docs/distributed.md has the failure semantics.

Both calls block until the transfer is over. Ranks are global ranks (as in `torch.distributed.send`);
one transfer at a time per pair of ranks and direction on a group.
"""

from __future__ import annotations

from .channel import DEFAULT_TIMEOUT, TransferError, TransferRejected, TransferStats, wire_device
from .receiver import DIRECT_MIN_MESSAGE_BYTES, receive_sequences
from .sender import DEFAULT_CHUNK_BYTES, send_sequences

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TIMEOUT",
    "DIRECT_MIN_MESSAGE_BYTES",
    "TransferError",
    "TransferRejected",
    "TransferStats",
    "receive_sequences",
    "send_sequences",
    "wire_device",
]
