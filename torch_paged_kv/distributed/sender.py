"""The sending side of a page transfer: `send_sequences` (the messages are in wire.py)."""

from __future__ import annotations

import collections
import datetime
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..manager import KVCacheManager
from ..params import params_to_dict
from . import channel, wire
from .channel import TransferError, TransferRejected, TransferStats, wire_device
from .pipes import PIPELINE_DEPTH, DirectPipe, PackedPipe, byte_pages, free_buffers

DEFAULT_CHUNK_BYTES = 32 << 20
"""Page bytes per chunk message (at least one page per chunk)."""


def _used_pages(manager: KVCacheManager, seq_ids: list) -> tuple[list[int], list[list[int]], list[int]]:
    """Lengths, rows (indices into the distinct used pages, first use first) and those pages."""
    lengths, table = manager.committed_rows(seq_ids)  # on device, committed: else ValueError
    source: dict[int, int] = {}
    rows = []
    for length, row in zip(lengths.tolist(), table, strict=True):
        used = row[: -(-length // manager.page_size)].tolist()
        rows.append([source.setdefault(page, len(source)) for page in used])
    return lengths.tolist(), rows, list(source)


def send_sequences(
    manager: KVCacheManager,
    seq_ids: Sequence[Hashable],
    dst: int,
    *,
    group: dist.ProcessGroup | None = None,
    metadata: dict[str, Any] | None = None,
    timeout: datetime.timedelta = channel.DEFAULT_TIMEOUT,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum: str | None = None,
) -> TransferStats:
    """Send sequences (committed, on device) of `manager`'s pool to the receiver at rank `dst`.

    Returns once the receiver confirmed that every page arrived and checked out; the sender's
    manager is never changed (release the sequences afterwards if they moved for good).
    `metadata` (JSON-able) travels along (`TransferStats.metadata` on the receiver). Ids that are
    str, int or tuples of them travel too; other ids need `seq_ids` on the receiver. `checksum`:
    "sum64" (the default, fast on CPU and GPU) or "crc32" (zlib, on the host; see `wire`). Raises `TransferRejected`
    with the receiver's reason if it refused, `TransferError` on a lost or silent peer.
    """
    start = time.perf_counter()
    ids = list(seq_ids)
    if not ids:
        raise ValueError("seq_ids: nothing to send (empty)")
    if len(set(ids)) != len(ids):
        raise ValueError("seq_ids: lists a sequence more than once")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes}")
    lengths, rows, source_pages = _used_pages(manager, ids)
    blocks, scales = manager.collection.blocks, channel.pool_scales(manager)
    dev = wire_device(group, blocks.device)
    kind = {"crc32": wire.CRC32, "sum64": wire.SUM64, None: wire.SUM64}.get(checksum)
    if kind is None:
        raise ValueError(f"checksum: expected 'crc32', 'sum64' or None, got {checksum!r}")
    blocks_bytes, scale_bytes = byte_pages(blocks).shape[1], 0 if scales is None else byte_pages(scales).shape[1]
    chunk_pages = max(1, min(chunk_bytes // (blocks_bytes + scale_bytes), len(source_pages)))
    tokens = [manager.token_ids(i) for i in ids]
    tokens = [None if t is None else t[:n] for t, n in zip(tokens, lengths, strict=True)]  # what ran, not a prompt
    meta = wire.encode_meta(
        params_to_dict(manager.collection.params, manager.tp_shard),
        channel.scales_spec(scales),
        ids,
        lengths,
        rows,
        tokens,
        [manager.prefix_keys(i) for i in ids],
        manager.prefix_root,
        source_pages if blocks.device == dev else None,
        metadata,
    )
    if len(meta) > wire.MAX_META_BYTES:
        raise ValueError(f"seq_ids: their token ids and keys take {len(meta)} bytes, more than a transfer carries")
    preamble = wire.Preamble(len(meta), len(source_pages), blocks_bytes, scale_bytes, chunk_pages, kind)
    channel.exchange(dist.isend, preamble.pack(dev), dst, group, timeout, "sending the preamble")
    meta_tensor = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev)
    channel.exchange(dist.isend, meta_tensor, dst, group, timeout, "sending the metadata")
    reply = torch.zeros(wire.REPLY_BYTES + len(source_pages), dtype=torch.uint8, device=dev)  # a refusal: shorter
    channel.exchange(dist.irecv, reply, dst, group, timeout, "waiting for the receiver's answer")
    status, reason, flags = wire.unpack_reply(reply)
    if status != wire.ACCEPTED:
        raise TransferRejected(f"rank {dst} refused the transfer: {reason}")
    if not set(flags) <= {0, wire.SEND, wire.STARTS}:
        raise TransferError(f"rank {dst} answered with page flags {sorted(set(flags))[:8]} (0, 1 or 2 expected)")
    send = [page for page, f in zip(source_pages, flags, strict=True) if f]
    wanted_flags = [f for f in flags if f]
    if wire.STARTS in wanted_flags:
        messages = wire.direct_messages(wanted_flags) if wanted_flags[0] == wire.STARTS else []
        if (
            not messages
            or blocks.device != dev
            or any(send[a : a + n] != list(range(send[a], send[a] + n)) for a, n in messages)
        ):
            raise TransferError(f"rank {dst} asked for direct messages this pool cannot send as such")
        _send_direct(DirectPipe(blocks, scales), send, messages, kind, dst, group, timeout)
    else:
        _send_packed(PackedPipe(blocks, scales, dev, chunk_pages), preamble, send, kind, dst, group, timeout)
    done = torch.empty(wire.REPLY_BYTES, dtype=torch.uint8, device=dev)
    channel.exchange(dist.irecv, done, dst, group, timeout, "waiting for the receiver's confirmation")
    status, reason, _ = wire.unpack_reply(done)
    if status != wire.ACCEPTED:
        raise TransferError(f"rank {dst} did not take the sequences: {reason}")
    seconds, nbytes = time.perf_counter() - start, len(send) * preamble.bytes_per_page
    return TransferStats(ids, len(source_pages), len(send), nbytes, seconds, metadata or {})


def _send_packed(
    pipe: PackedPipe, preamble: wire.Preamble, send: list[int], kind: int, dst: int, group: Any, timeout: Any
) -> None:
    """Pages `send` in chunks packed into `PIPELINE_DEPTH` reused wire buffers, each with its checksum."""
    pending: list[Any] = [None] * PIPELINE_DEPTH
    first = 0
    try:
        for k, n in enumerate(preamble.chunk_sizes(len(send))):
            if pending[k % PIPELINE_DEPTH] is not None:  # the buffer's previous chunk must be out first
                channel.wait(pending[k % PIPELINE_DEPTH], timeout, f"sending chunk {k + 1 - PIPELINE_DEPTH}", dst)
            message = pipe.message(k, n)
            pipe.gather(message, send[first : first + n], kind)
            pending[k % PIPELINE_DEPTH] = channel.post(dist.isend, message, dst, group, f"sending chunk {k + 1}")
            first += n
        for work in pending:
            if work is not None:
                channel.wait(work, timeout, "sending the last chunks", dst)
    except BaseException:
        free_buffers()  # a send may still hold one: the next transfer gets fresh buffers
        raise


def _send_direct(
    pipe: DirectPipe,
    send: list[int],
    messages: list[tuple[int, int]],
    kind: int,
    dst: int,
    group: Any,
    timeout: Any,
) -> None:
    """Each run of pages `send[a : a + n]` straight from the pool, then the packed scales, then every
    message's checksum. A message is summed once its send completed, while the next ones go out (a
    page changed meanwhile shows up as a mismatch); off the CPU the sums stay on the device
    (`wire.message_checksum`) and go out as they are."""
    payloads = [pipe.message(send[a], n) for a, n in messages]
    if pipe.scales is not None:
        payloads.append(pipe.pack_scales(send))
    pending: collections.deque[tuple[int, Any]] = collections.deque()
    sums: list[int | torch.Tensor] = []

    def finish() -> None:
        k, work = pending.popleft()
        channel.wait(work, timeout, f"sending chunk {k + 1}", dst)
        sums.append(wire.message_checksum(payloads[k], kind))

    for k, payload in enumerate(payloads):
        if len(pending) == channel.DIRECT_IN_FLIGHT:
            finish()
        pending.append((k, channel.post(dist.isend, payload, dst, group, f"sending chunk {k + 1}")))
    while pending:
        finish()
    channel.exchange(
        dist.isend, wire.checksums_tensor(sums, payloads[0].device), dst, group, timeout, "sending the checksums"
    )
