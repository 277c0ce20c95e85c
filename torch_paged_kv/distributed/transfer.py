"""Page transfer between processes: `send_sequences` and `receive_sequences` over `torch.distributed`.

The sender ships the pages of one or more sequences (each shared page once), with their lengths,
token ids and prefix-cache keys (and `scales` for a quantized cache); the receiver allocates
through its `KVCacheManager.adopt`, skips pages it already has cached, receives the rest in
chunks of many pages per message, checks every chunk's checksum, and registers the sequences only
once every byte has arrived. On any failure (a rejected request, a dead or silent peer, a bad
checksum) the receiver's manager is as before and a `TransferError` says what happened. The
messages and their order are in `wire.py`; docs/distributed.md has the failure semantics.

Both calls block until the transfer is over. Ranks are global ranks (as in `torch.distributed.send`);
one transfer at a time per pair of ranks and direction on a group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..manager import KVCacheManager
from ..params import KVCacheParams
from . import wire

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
"""Longest wait for any one message of a transfer."""
DEFAULT_CHUNK_BYTES = 32 << 20
"""Page bytes per chunk message (at least one page per chunk)."""


class TransferError(RuntimeError):
    """A transfer that did not complete. On the receiver its manager is as before; `pages_written`
    counts the (free) pages it had filled before giving up."""

    def __init__(self, message: str, pages_written: int = 0) -> None:
        super().__init__(message)
        self.pages_written = pages_written


class TransferRejected(TransferError):
    """The receiver refused the transfer before any page moved (incompatible cache, out of pages,
    bad ids); the message carries its reason."""


@dataclasses.dataclass
class TransferStats:
    """What one transfer moved (the same on both sides, but `seq_ids` are each side's own ids)."""

    seq_ids: list
    pages: int  # distinct pages the sequences use
    pages_sent: int  # pages that went over the wire (the rest the receiver had cached)
    bytes_sent: int  # page (and scale) bytes over the wire, checksums excluded
    seconds: float
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_sent / max(self.seconds, 1e-12) / 1e9


def wire_device(group: dist.ProcessGroup | None, pool_device: torch.device) -> torch.device:
    """Where a group's messages live: the current CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        if pool_device.type != "cuda":
            raise ValueError(f"group: an NCCL group moves CUDA tensors, the pool is on {pool_device}")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _scales(manager: KVCacheManager) -> torch.Tensor | None:
    """The collection's per-page scales (a per-granule FP8 cache), if it has them; static per-tensor
    scales are part of the params, which both sides compare."""
    c = manager.collection
    return c.scales if c.params.has_scales_tensor else None


def _byte_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, pages first) as uint8 `[pages, bytes per page]`, no copy."""
    return tensor.view(torch.uint8).view(tensor.shape[0], -1)


def _scales_spec(scales: torch.Tensor | None) -> dict[str, Any] | None:
    if scales is None:
        return None
    return {"dtype": str(scales.dtype).removeprefix("torch."), "shape": list(scales.shape[1:])}


def _wait(work: Any, timeout: datetime.timedelta, what: str, peer: int, written: int = 0) -> None:
    try:
        work.wait(timeout)
    except Exception as exc:  # gloo raises RuntimeError for a closed connection and for a timeout
        raise TransferError(f"{what} (rank {peer}): {type(exc).__name__}: {exc}", written) from exc


def _post(op: Any, tensor: torch.Tensor, peer: int, group: Any, what: str, written: int = 0) -> Any:
    """`op(tensor, peer)` (isend/irecv); gloo raises right here when the pair is already closed."""
    try:
        return op(tensor, peer, group=group)
    except Exception as exc:
        raise TransferError(f"{what} (rank {peer}): {type(exc).__name__}: {exc}", written) from exc


def _exchange(op: Any, tensor: torch.Tensor, peer: int, group: Any, timeout: datetime.timedelta, what: str) -> None:
    _wait(_post(op, tensor, peer, group, what), timeout, what, peer)


_buffers = threading.local()


def _wire_buffers(device: torch.device, pin: bool, size: int) -> list[torch.Tensor]:
    """Two wire buffers of at least `size` bytes, kept for the next transfer of this thread (a fresh
    large allocation page-faults on first touch: 3-10x slower copies on the CPU)."""
    cache = _buffers.__dict__.setdefault("by_device", {})
    held = cache.get((device, pin))
    if held is None or held[0].numel() < size:
        held = [torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin) for _ in range(PIPELINE_DEPTH)]
        cache[(device, pin)] = held
    return held


def free_buffers() -> None:
    """Drop this thread's cached wire buffers (two chunks per device; they are kept between transfers)."""
    _buffers.__dict__.pop("by_device", None)


PIPELINE_DEPTH = 3
"""Wire buffers per side: the receiver keeps two chunks in flight while it checks and places a third,
the sender fills one while two are being sent (gloo moves a message only once its receive is posted)."""
LOOP_MIN_PAGE_BYTES = 64 << 10
"""CPU pages at least this large move as one memcpy per run of consecutive pages (about 4x faster here
than `index_select`/`index_copy_` on 2 MiB pages); smaller ones with one indexed copy per chunk."""


def _widest(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two uint8 `[rows, bytes]` arrays viewed as the widest integer type their rows allow (fewer
    elements for the indexed copies)."""
    for dtype in (np.int64, np.int32, np.int16):
        if a.shape[1] % np.dtype(dtype).itemsize == 0:
            return a.view(dtype), b.view(dtype)
    return a, b


def _runs(pages: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions in `pages`, first pages and counts of its runs of consecutive ids (int64 arrays)."""
    index = np.asarray(pages, dtype=np.int64)
    starts = np.flatnonzero(np.diff(index, prepend=-2) != 1)  # -2: a page id is never -1
    return starts, index[starts], np.diff(starts, append=len(index))


class _PagePipe:
    """Moves pages between a pool (`blocks`, plus `scales` if any) and the reused wire buffers. A CPU
    pool and wire with the SUM64 checksum copy and checksum in one pass (`wire.copy_sum64`)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor | None, wire_dev: torch.device, chunk_pages: int):
        self.blocks = _byte_pages(blocks)
        self.scales = None if scales is None else _byte_pages(scales)
        self.page_bytes = self.blocks.shape[1]
        self.scale_bytes = 0 if self.scales is None else self.scales.shape[1]
        self.pool_device = blocks.device
        self.wire_device = wire_dev
        size = chunk_pages * (self.page_bytes + self.scale_bytes) + wire.TRAILER_BYTES
        pin = wire_dev.type == "cpu" and self.pool_device.type == "cuda"
        self.buffers = _wire_buffers(wire_dev, pin, size)
        self.fusable = self.pool_device.type == wire_dev.type == "cpu" and wire.has_copy_sum64()

    def _fuses(self, kind: int) -> bool:
        """Whether messages with checksum `kind` are copied and checked in one pass."""
        return self.fusable and kind == wire.SUM64

    def message(self, k: int, n: int) -> torch.Tensor:
        """Buffer `k % PIPELINE_DEPTH` cut to a chunk of `n` pages (with its trailer)."""
        return self.buffers[k % PIPELINE_DEPTH][: n * (self.page_bytes + self.scale_bytes) + wire.TRAILER_BYTES]

    def _parts(self, message: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(pool pages, the message's part for them): blocks, then scales if any."""
        parts = [(self.blocks, message[: n * self.page_bytes].view(n, self.page_bytes))]
        if self.scales is not None:
            end = n * (self.page_bytes + self.scale_bytes)
            parts.append((self.scales, message[n * self.page_bytes : end].view(n, self.scale_bytes)))
        return parts

    def _move(self, pool: torch.Tensor, data: torch.Tensor, pages: list[int], to_wire: bool) -> None:
        """Pool pages `pages` into the message part `data` (`to_wire`) or back. On the CPU in numpy:
        one thread (torch's copies split over busy cores can run 10x slower), one memcpy per run of
        consecutive large pages, else one indexed copy."""
        if self.pool_device.type == self.wire_device.type == "cpu":
            pool_np, data_np = pool.numpy(), data.numpy()
            if pool.shape[1] >= LOOP_MIN_PAGE_BYTES:
                for position, first, count in zip(*_runs(pages), strict=True):
                    a, b = data_np[position : position + count], pool_np[first : first + count]
                    np.copyto(a, b) if to_wire else np.copyto(b, a)
                return
            pool_np, data_np = _widest(pool_np, data_np)
            index = np.asarray(pages, dtype=np.int64)
            if to_wire:
                np.take(pool_np, index, axis=0, out=data_np)
            else:
                pool_np[index] = data_np
            return
        index = torch.tensor(pages, dtype=torch.long, device=self.pool_device)
        if not to_wire:  # blocking copy to the pool's device: the buffer is reused for the next chunk
            pool.index_copy_(0, index, data.to(self.pool_device))
        elif self.pool_device == self.wire_device:
            torch.index_select(pool, 0, index, out=data)
        else:
            data.copy_(pool.index_select(0, index))

    def _segments(self, pages: list[int]) -> np.ndarray:
        """`wire.copy_sum64` segments of a message of `pages`: one per run of consecutive pages,
        blocks then scales (message order)."""
        positions, firsts, counts = _runs(pages)
        pools = [self.blocks] if self.scales is None else [self.blocks, self.scales]
        parts, offset = [], 0
        for pool in pools:
            width = pool.shape[1]
            parts.append(np.stack([offset + positions * width, pool.data_ptr() + firsts * width, counts * width], 1))
            offset += len(pages) * width
        return np.concatenate(parts)

    def gather(self, message: torch.Tensor, pages: list[int], kind: int) -> None:
        """Pages `pages` of the pool into `message`, and the checksum into its trailer."""
        payload = message[: -wire.TRAILER_BYTES]
        if self._fuses(kind):
            wire.put_trailer(message, wire.copy_sum64(self._segments(pages), payload, to_payload=True))
            return
        for pool, data in self._parts(message, len(pages)):
            self._move(pool, data, pages, to_wire=True)
        wire.put_trailer(message, wire.checksum(payload, kind))

    def scatter(self, message: torch.Tensor, pages: list[int], kind: int) -> tuple[bool, int]:
        """The pages of `message` into pool pages `pages` if its checksum matches; returns whether it
        matched and how many pages were written. The fused path writes the pages while it checks
        them: all of them, match or not (the caller's own fresh pages, dropped on a mismatch)."""
        payload, expected = message[: -wire.TRAILER_BYTES], wire.get_trailer(message)
        if self._fuses(kind):
            return wire.copy_sum64(self._segments(pages), payload, to_payload=False) == expected, len(pages)
        if wire.checksum(payload, kind) != expected:
            return False, 0
        for pool, data in self._parts(message, len(pages)):
            self._move(pool, data, pages, to_wire=False)
        return True, len(pages)


def _used_pages(manager: KVCacheManager, seq_ids: list) -> tuple[list[int], list[list[int]], list[int]]:
    """Lengths, rows (indices into the distinct used pages, first use first) and those pages."""
    prepared = set(manager.prepared_sequences)
    source: dict[int, int] = {}
    lengths, rows = [], []
    for seq_id in seq_ids:
        if manager.is_offloaded(seq_id):  # raises ValueError for an unknown id
            raise ValueError(f"seq_ids: sequence {seq_id!r} is offloaded; restore it first")
        if seq_id in prepared:
            raise ValueError(f"seq_ids: sequence {seq_id!r} is in the prepared step; commit_step first")
        length = manager.cache_length(seq_id)
        used = manager.pages(seq_id)[: -(-length // manager.page_size)]
        lengths.append(length)
        rows.append([source.setdefault(page, len(source)) for page in used])
    return lengths, rows, list(source)


def send_sequences(
    manager: KVCacheManager,
    seq_ids: Sequence[Hashable],
    dst: int,
    *,
    group: dist.ProcessGroup | None = None,
    metadata: dict[str, Any] | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
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
    blocks, scales = manager.collection.blocks, _scales(manager)
    dev = wire_device(group, blocks.device)
    kind = {"crc32": wire.CRC32, "sum64": wire.SUM64, None: wire.SUM64}.get(checksum)
    if kind is None:
        raise ValueError(f"checksum: expected 'crc32', 'sum64' or None, got {checksum!r}")
    page_bytes = _byte_pages(blocks).shape[1] + (0 if scales is None else _byte_pages(scales).shape[1])
    chunk_pages = max(1, min(chunk_bytes // page_bytes, len(source_pages)))
    tokens = [manager.token_ids(i) for i in ids]
    tokens = [None if t is None else t[:n] for t, n in zip(tokens, lengths, strict=True)]  # what ran, not a prompt
    meta = wire.encode_meta(
        manager.collection.params.to_dict(),
        _scales_spec(scales),
        ids,
        lengths,
        rows,
        tokens,
        [manager.prefix_keys(i) for i in ids],
        manager.prefix_root,
        metadata,
    )
    pipe = _PagePipe(blocks, scales, dev, chunk_pages)
    preamble = wire.Preamble(len(meta), len(source_pages), pipe.page_bytes, pipe.scale_bytes, chunk_pages, kind)
    _exchange(dist.isend, preamble.pack(dev), dst, group, timeout, "sending the preamble")
    meta_tensor = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev)
    _exchange(dist.isend, meta_tensor, dst, group, timeout, "sending the metadata")
    reply = torch.empty(wire.REPLY_BYTES + len(source_pages), dtype=torch.uint8, device=dev)
    _exchange(dist.irecv, reply, dst, group, timeout, "waiting for the receiver's answer")
    status, reason, wanted = wire.unpack_reply(reply)
    if status != wire.ACCEPTED:
        raise TransferRejected(f"rank {dst} refused the transfer: {reason}")
    send = [page for page, w in zip(source_pages, wanted, strict=True) if w]
    pending: list[Any] = [None] * PIPELINE_DEPTH
    first = 0
    try:
        for k, n in enumerate(preamble.chunk_sizes(len(send))):
            if pending[k % PIPELINE_DEPTH] is not None:  # the buffer's previous chunk must be out first
                _wait(pending[k % PIPELINE_DEPTH], timeout, f"sending chunk {k + 1 - PIPELINE_DEPTH}", dst)
            message = pipe.message(k, n)
            pipe.gather(message, send[first : first + n], kind)
            pending[k % PIPELINE_DEPTH] = _post(dist.isend, message, dst, group, f"sending chunk {k + 1}")
            first += n
        for work in pending:
            if work is not None:
                _wait(work, timeout, "sending the last chunks", dst)
    except BaseException:
        free_buffers()  # a send may still hold one: the next transfer gets fresh buffers
        raise
    done = torch.empty(wire.REPLY_BYTES, dtype=torch.uint8, device=dev)
    _exchange(dist.irecv, done, dst, group, timeout, "waiting for the receiver's confirmation")
    status, reason, _ = wire.unpack_reply(done)
    if status != wire.ACCEPTED:
        raise TransferError(f"rank {dst} did not take the sequences: {reason}")
    seconds, nbytes = time.perf_counter() - start, len(send) * preamble.bytes_per_page
    return TransferStats(ids, len(source_pages), len(send), nbytes, seconds, metadata or {})


def _check_compatible(manager: KVCacheManager, meta: dict[str, Any], preamble: wire.Preamble) -> str | None:
    """Why the receiver cannot take this transfer (None: it can)."""
    params = manager.collection.params
    try:
        theirs = KVCacheParams.from_dict(meta["params"])
    except (ValueError, TypeError) as exc:
        return f"unreadable sender params ({exc})"
    if theirs != params:
        return f"the sender's cache is {theirs}, this one is {params}"
    scales = _scales(manager)
    if meta["scales"] != _scales_spec(scales):
        return f"the sender's scales are {meta['scales']}, this cache's are {_scales_spec(scales)}"
    blocks_bytes = _byte_pages(manager.collection.blocks).shape[1]
    scale_bytes = 0 if scales is None else _byte_pages(scales).shape[1]
    if (preamble.page_bytes, preamble.scale_bytes) != (blocks_bytes, scale_bytes):
        theirs, ours = (preamble.page_bytes, preamble.scale_bytes), (blocks_bytes, scale_bytes)
        return f"pages of {theirs[0]}+{theirs[1]} bytes (blocks+scales), this cache's are {ours[0]}+{ours[1]}"
    return None


def _vote(group: Any, ok: bool, device: torch.device) -> bool:
    """True iff every rank of `group` votes ok (an all-reduce of one flag)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def receive_sequences(
    manager: KVCacheManager,
    src: int,
    *,
    group: dist.ProcessGroup | None = None,
    seq_ids: Sequence[Hashable] | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    consensus_group: dist.ProcessGroup | None = None,
) -> TransferStats:
    """Receive the sequences the rank `src` sends with `send_sequences` into `manager`'s pool.

    Ids are `seq_ids` if given, else the sender's. The sequences are registered (through
    `manager.adopt`) only after every chunk arrived and its checksum matched; pages the receiver
    already holds in its prefix cache (same keys, same salt) are shared instead of sent. With
    `consensus_group` (e.g. the tensor-parallel ranks, each receiving its head shard), every rank
    of that group must get all its pages before any registers them: the ranks vote once per call.

    Errors: `TransferRejected` (after telling the sender why) when this cache cannot take the
    transfer, with `OutOfPagesError` or `ValueError` as its cause; `TransferError` when the sender
    disappears, stays silent for `timeout`, or a checksum fails. The manager is then as before
    (see `KVCacheManager.adopt`; only free pages were written).
    """
    start = time.perf_counter()
    dev = wire_device(group, manager.collection.blocks.device)
    vote_device = wire_device(consensus_group, manager.collection.blocks.device) if consensus_group else dev
    if dev.type == manager.collection.blocks.device.type == "cpu":
        wire.has_copy_sum64()  # a machine's first call builds the library: now, not while the sender waits
    state = {"replied": False, "voted": False}
    preamble_tensor = wire.empty_preamble(dev)
    try:
        _exchange(dist.irecv, preamble_tensor, src, group, timeout, "waiting for a transfer")
        try:
            preamble = wire.Preamble.unpack(preamble_tensor)
        except ValueError as exc:
            raise TransferError(f"rank {src} sent {exc}") from None
        meta_tensor = torch.empty(preamble.meta_bytes, dtype=torch.uint8, device=dev)
        _exchange(dist.irecv, meta_tensor, src, group, timeout, "receiving the transfer metadata")

        def reject(reason: str) -> None:
            state["replied"] = True
            reply = wire.pack_reply(wire.REJECTED, reason, [False] * preamble.num_pages, dev)
            _exchange(dist.isend, reply, src, group, timeout, "refusing the transfer")

        try:
            meta = wire.decode_meta(bytes(meta_tensor.cpu().numpy()))
        except ValueError as exc:
            reject(str(exc))
            raise TransferRejected(str(exc)) from None
        why = _check_compatible(manager, meta, preamble)
        seqs = meta["sequences"]
        ids = list(seq_ids) if seq_ids is not None else [s["id"] for s in seqs]
        if why is None and len(ids) != len(seqs):
            why = f"seq_ids: the sender sends {len(seqs)} sequences, got {len(ids)} ids"
        if why is None and any(i is None for i in ids):
            why = "seq_ids: the sender's ids do not travel (not str, int or tuples of them); pass seq_ids"
        if why is not None:
            reject(why)
            raise TransferRejected(f"refused the transfer from rank {src}: {why}")
        same_root = meta["root"] == wire.root_fingerprint(manager.prefix_root)
        stats = TransferStats(ids, preamble.num_pages, 0, 0, 0.0, meta["metadata"])

        def fill(incoming: list[int], pages: list[int]) -> None:
            wanted = [False] * preamble.num_pages
            for i in incoming:
                wanted[i] = True
            state["replied"] = True
            reply = wire.pack_reply(wire.ACCEPTED, "", wanted, dev)
            _exchange(dist.isend, reply, src, group, timeout, "accepting the transfer")
            error: BaseException | None = None
            written = 0
            try:
                written = _receive_chunks(manager, preamble, src, group, timeout, pages, dev)
            except BaseException as exc:
                error = exc
                free_buffers()  # a receive may still hold one: the next transfer gets fresh buffers
            if consensus_group is not None:
                state["voted"] = True
                if not _vote(consensus_group, error is None, vote_device) and error is None:
                    error = TransferError("another rank of the consensus group did not get its pages", written)
            if error is not None:
                reason = str(error)[: wire.REPLY_BYTES - 1]
                with contextlib.suppress(TransferError):  # best effort: the sender may be gone
                    _exchange(dist.isend, wire.pack_reply(wire.FAILED, reason, None, dev), src, group, timeout, "")
                raise error
            _exchange(dist.isend, wire.pack_reply(wire.ACCEPTED, "", None, dev), src, group, timeout, "confirming")
            stats.pages_sent, stats.bytes_sent = len(pages), len(pages) * preamble.bytes_per_page

        try:
            manager.adopt(
                ids,
                [s["length"] for s in seqs],
                [s["pages"] for s in seqs],
                fill,
                token_ids=[s["token_ids"] for s in seqs],
                prefix_keys=[s["keys"] for s in seqs] if same_root else None,
            )
        except (ValueError, RuntimeError) as exc:
            if state["replied"]:
                raise
            reject(f"{type(exc).__name__}: {exc}")  # before any page moved: out of pages, bad ids
            raise TransferRejected(f"refused the transfer from rank {src}: {type(exc).__name__}: {exc}") from exc
    except BaseException:
        if consensus_group is not None and not state["voted"]:
            state["voted"] = True
            _vote(consensus_group, False, vote_device)
        raise
    stats.seconds = time.perf_counter() - start
    return stats


def _receive_chunks(
    manager: KVCacheManager,
    preamble: wire.Preamble,
    src: int,
    group: Any,
    timeout: datetime.timedelta,
    pages: list[int],
    dev: torch.device,
) -> int:
    """Receive the chunks of `pages` (`PIPELINE_DEPTH` buffers: the next chunks arrive while this one
    is checked and copied into the pool); returns the pages written. Raises TransferError."""
    sizes = preamble.chunk_sizes(len(pages))
    pipe = _PagePipe(manager.collection.blocks, _scales(manager), dev, max(sizes, default=1))
    what = f"receiving chunk {{}} of {len(sizes)}"
    works: dict[int, Any] = {}

    def post(k: int) -> None:  # chunk k into buffer k % PIPELINE_DEPTH, whose previous chunk is done with
        if k < len(sizes):
            works[k] = _post(dist.irecv, pipe.message(k, sizes[k]), src, group, what.format(k + 1), written)

    written, bad = 0, None
    for k in range(PIPELINE_DEPTH - 1):
        post(k)
    for k, n in enumerate(sizes):
        _wait(works.pop(k), timeout, what.format(k + 1), src, written)
        post(k + PIPELINE_DEPTH - 1)
        if bad is not None:  # drain the rest, so the sender hears why and the channel stays usable
            continue
        matched, filled = pipe.scatter(pipe.message(k, n), pages[written : written + n], preamble.checksum)
        written += filled  # with a mismatch too: `adopt` must forget cached pages that were written
        if not matched:
            bad = f"checksum ({wire.CHECKSUM_NAMES[preamble.checksum]}) mismatch in chunk {k + 1} of {len(sizes)}"
    if bad is not None:
        raise TransferError(f"{bad} from rank {src}", written)
    return written
