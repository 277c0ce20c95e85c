"""Scale-out on `torch.distributed`: tensor-parallel caches and page transfer between processes.

- `tensor_parallel`: KV heads sharded over the ranks of a group (`shard_params`, `head_shard`) and
  `TensorParallelKVCacheManager`, identical page decisions on every rank, checked each step.
- `transfer`: `send_sequences` / `receive_sequences`, the pages of whole sequences from one
  process's pool to another's (disaggregated prefill and decode), all or nothing.
- `wire`: the transfer's messages, byte for byte.
- `reshard`: KV-state checkpoints saved at one tensor-parallel size loaded at another.

See docs/distributed.md.
"""

from __future__ import annotations

from .transfer import (
    TransferError,
    TransferRejected,
    TransferStats,
    receive_sequences,
    send_sequences,
)

__all__ = [
    "TransferError",
    "TransferRejected",
    "TransferStats",
    "receive_sequences",
    "send_sequences",
]
