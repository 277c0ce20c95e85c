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

import collections
import contextlib
import dataclasses
import datetime
import time
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..manager import KVCacheManager
from ..params import describe_heads, params_from_dict, params_to_dict
from ..reservation import Reservation
from . import wire
from .pipes import PIPELINE_DEPTH, DirectPipe, PackedPipe, byte_pages, free_buffers

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
"""Longest wait for any one message of a transfer."""
DEFAULT_CHUNK_BYTES = 32 << 20
"""Page bytes per chunk message (at least one page per chunk)."""
DIRECT_MIN_MESSAGE_BYTES = 1 << 20
"""A transfer goes direct (runs of pool pages are the messages) when its runs average at least this
many bytes; below it the extra messages cost more than packing saves (gloo, loopback, 2-core EPYC)."""
DIRECT_IN_FLIGHT = 256
"""Direct messages posted ahead on each side (gloo moves a message once its receive is posted)."""


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
    blocks_bytes, scale_bytes = byte_pages(blocks).shape[1], 0 if scales is None else byte_pages(scales).shape[1]
    chunk_pages = max(1, min(chunk_bytes // (blocks_bytes + scale_bytes), len(source_pages)))
    tokens = [manager.token_ids(i) for i in ids]
    tokens = [None if t is None else t[:n] for t, n in zip(tokens, lengths, strict=True)]  # what ran, not a prompt
    meta = wire.encode_meta(
        params_to_dict(manager.collection.params, manager.tp_shard),
        _scales_spec(scales),
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
    _exchange(dist.isend, preamble.pack(dev), dst, group, timeout, "sending the preamble")
    meta_tensor = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev)
    _exchange(dist.isend, meta_tensor, dst, group, timeout, "sending the metadata")
    reply = torch.zeros(wire.REPLY_BYTES + len(source_pages), dtype=torch.uint8, device=dev)  # a refusal: shorter
    _exchange(dist.irecv, reply, dst, group, timeout, "waiting for the receiver's answer")
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
    _exchange(dist.irecv, done, dst, group, timeout, "waiting for the receiver's confirmation")
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
        _wait(work, timeout, f"sending chunk {k + 1}", dst)
        sums.append(wire.message_checksum(payloads[k], kind))

    for k, payload in enumerate(payloads):
        if len(pending) == DIRECT_IN_FLIGHT:
            finish()
        pending.append((k, _post(dist.isend, payload, dst, group, f"sending chunk {k + 1}")))
    while pending:
        finish()
    _exchange(dist.isend, wire.checksums_tensor(sums, payloads[0].device), dst, group, timeout, "sending the checksums")


def _check_compatible(manager: KVCacheManager, meta: dict[str, Any], preamble: wire.Preamble) -> str | None:
    """Why the receiver cannot take this transfer (None: it can)."""
    params, shard = manager.collection.params, manager.tp_shard
    try:
        theirs, their_shard = params_from_dict(meta["params"])
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        return f"unreadable sender params ({type(exc).__name__}: {exc})"
    if theirs != params:
        return f"the sender's cache is {theirs}, this one is {params}"
    if their_shard != shard:
        return (
            f"the sender's cache holds {describe_heads(theirs, their_shard)}, this one {describe_heads(params, shard)}"
        )
    scales = _scales(manager)
    if meta["scales"] != _scales_spec(scales):
        return f"the sender's scales are {meta['scales']}, this cache's are {_scales_spec(scales)}"
    blocks_bytes = byte_pages(manager.collection.blocks).shape[1]
    scale_bytes = 0 if scales is None else byte_pages(scales).shape[1]
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

    Ids are `seq_ids` if given, else the sender's. The sequences are registered (a
    `KVCacheManager.reserve` committed) only after every chunk arrived and its checksum matched;
    pages the receiver already holds in its prefix cache (same keys, same salt) are shared instead
    of sent. With `consensus_group` (e.g. the tensor-parallel ranks, each receiving its head shard),
    every rank of that group must get all its pages before any registers them: the ranks vote once
    per call.

    Errors: `TransferRejected` (after telling the sender why) when this cache cannot take the
    transfer, with `OutOfPagesError` or `ValueError` as its cause; `TransferError` when the sender
    disappears, stays silent for `timeout`, or a checksum fails. The manager is then as before
    (see `Reservation.abort`; only free pages were written).
    """
    receiver = _Receiver(manager, src, group, timeout, consensus_group)
    try:
        reservation, ids = receiver.negotiate(seq_ids)
        try:
            direct = receiver.reply(reservation)
            written, error = receiver.receive(reservation, direct)
            receiver.vote(error, written)
            receiver.confirm(written)
        except BaseException as exc:
            written = getattr(exc, "pages_written", None)
            reservation.abort(written if isinstance(written, int) else None)
            raise
        reservation.commit()
    except BaseException:
        receiver.vote_no()
        raise
    return receiver.stats(ids, len(reservation.pages))


class _Receiver:
    """The receiving side of one transfer, in its phases: `negotiate` (preamble, metadata, checks,
    pages reserved), `reply` (which pages to send, and how), `receive` (every message, checked),
    `vote` (with the consensus group), `confirm` (tell the sender). The caller commits or aborts the
    reservation. A refusal is answered before `TransferRejected` goes up; a failure after the reply
    gets a best-effort FAILED answer."""

    def __init__(
        self,
        manager: KVCacheManager,
        src: int,
        group: Any,
        timeout: datetime.timedelta,
        consensus_group: Any,
    ) -> None:
        self.start = time.perf_counter()
        self.manager, self.src, self.group, self.timeout = manager, src, group, timeout
        self.consensus_group = consensus_group
        pool_device = manager.collection.blocks.device
        self.dev = wire_device(group, pool_device)
        self.vote_device = wire_device(consensus_group, pool_device) if consensus_group else self.dev
        self.voted = False
        self.preamble: wire.Preamble | None = None
        self.meta: dict[str, Any] = {}
        if self.dev.type == pool_device.type == "cpu":
            wire.has_copy_sum64()  # a machine's first call builds the library: now, not while the sender waits

    def _exchange(self, op: Any, tensor: torch.Tensor, what: str) -> None:
        _exchange(op, tensor, self.src, self.group, self.timeout, what)

    def negotiate(self, seq_ids: Sequence[Hashable] | None) -> tuple[Reservation, list]:
        """Take the preamble and metadata, check them against this cache and reserve the pages;
        `TransferRejected` (the sender told) or `TransferError` if that fails."""
        preamble_tensor = wire.empty_preamble(self.dev)
        self._exchange(dist.irecv, preamble_tensor, "waiting for a transfer")
        try:
            preamble = self.preamble = wire.Preamble.unpack(preamble_tensor)
        except ValueError as exc:
            raise TransferError(f"rank {self.src} sent {exc}") from None
        meta_tensor = torch.empty(preamble.meta_bytes, dtype=torch.uint8, device=self.dev)  # <= MAX_META_BYTES
        self._exchange(dist.irecv, meta_tensor, "receiving the transfer metadata")
        try:
            meta = self.meta = wire.decode_meta(bytes(meta_tensor.cpu().numpy()))
            wire.check_pages(meta, preamble.num_pages)
        except ValueError as exc:
            self._reject(str(exc))
        why = _check_compatible(self.manager, meta, preamble)
        seqs = meta["sequences"]
        ids = list(seq_ids) if seq_ids is not None else [s["id"] for s in seqs]
        if why is None and len(ids) != len(seqs):
            why = f"seq_ids: the sender sends {len(seqs)} sequences, got {len(ids)} ids"
        if why is None and any(i is None for i in ids):
            why = "seq_ids: the sender's ids do not travel (not str, int or tuples of them); pass seq_ids"
        if why is not None:
            self._reject(why)
        same_root = meta["root"] == wire.root_fingerprint(self.manager.prefix_root)
        try:
            reservation = self.manager.reserve(
                ids,
                [s["length"] for s in seqs],
                [s["pages"] for s in seqs],
                token_ids=[s["token_ids"] for s in seqs],
                prefix_keys=[s["keys"] for s in seqs] if same_root else None,
            )
        except Exception as exc:  # out of pages, ids in use, rows that do not fit
            self._reject(f"{type(exc).__name__}: {exc}", exc)
        return reservation, ids

    def _reject(self, reason: str, cause: BaseException | None = None) -> NoReturn:
        """Tell the sender why, then raise `TransferRejected`."""
        preamble = self.preamble
        assert preamble is not None
        # gloo takes a shorter reply than the sender posted; NCCL needs the exact size, which a
        # consistent sender's num_pages bounds (each incoming page is listed in the meta)
        exact = self.dev.type != "cpu" and preamble.num_pages <= preamble.meta_bytes
        reply = wire.pack_reply(wire.REJECTED, reason, [0] * preamble.num_pages if exact else None, self.dev)
        self._exchange(dist.isend, reply, "refusing the transfer")
        raise TransferRejected(f"refused the transfer from rank {self.src}: {reason}") from cause

    def reply(self, reservation: Reservation) -> list[int] | None:
        """Accept, naming the pages to send (those not shared from the prefix cache) and whether they
        come direct; returns the direct flags of the wanted pages, or None for packed chunks."""
        preamble = self.preamble
        assert preamble is not None
        incoming, pages = reservation.incoming, reservation.pages
        direct = _direct_flags(self.manager, self.meta, preamble, incoming, pages, self.dev)
        flags = [0] * preamble.num_pages
        for j, i in enumerate(incoming):
            flags[i] = wire.SEND if direct is None else direct[j]
        self._exchange(dist.isend, wire.pack_reply(wire.ACCEPTED, "", flags, self.dev), "accepting the transfer")
        return direct

    def receive(self, reservation: Reservation, direct: list[int] | None) -> tuple[int, BaseException | None]:
        """Every page message into the reserved pages; returns the pages written and the error that
        stopped it (None: everything arrived and checked out)."""
        preamble, pages = self.preamble, reservation.pages
        assert preamble is not None
        try:
            if direct is None:
                written = _receive_packed(self.manager, preamble, self.src, self.group, self.timeout, pages, self.dev)
            else:
                pipe = DirectPipe(self.manager.collection.blocks, _scales(self.manager))
                messages = wire.direct_messages(direct)
                written = _receive_direct(pipe, preamble, messages, pages, self.src, self.group, self.timeout)
        except BaseException as exc:
            free_buffers()  # a receive may still hold one: the next transfer gets fresh buffers
            written = exc.pages_written if isinstance(exc, TransferError) else len(pages)
            return written, exc
        return written, None

    def vote(self, error: BaseException | None, written: int) -> None:
        """With a consensus group, every rank says whether it got its pages; then raise this rank's
        error, or a `TransferError` if another rank failed, after telling the sender (best effort)."""
        if self.consensus_group is not None:
            self.voted = True
            if not _vote(self.consensus_group, error is None, self.vote_device) and error is None:
                error = TransferError("another rank of the consensus group did not get its pages", written)
        if error is not None:
            reason = str(error)[: wire.REPLY_BYTES - 1]
            with contextlib.suppress(TransferError):  # the sender may be gone
                self._exchange(dist.isend, wire.pack_reply(wire.FAILED, reason, None, self.dev), "")
            raise error

    def vote_no(self) -> None:
        """On a failure before `vote`: the consensus group still hears this rank, once."""
        if self.consensus_group is not None and not self.voted:
            self.voted = True
            _vote(self.consensus_group, False, self.vote_device)

    def confirm(self, written: int) -> None:
        """Tell the sender every page arrived (a failure here counts `written` pages as written)."""
        try:
            self._exchange(dist.isend, wire.pack_reply(wire.ACCEPTED, "", None, self.dev), "confirming")
        except TransferError as exc:
            exc.pages_written = written
            raise

    def stats(self, ids: list, pages_sent: int) -> TransferStats:
        preamble = self.preamble
        assert preamble is not None
        nbytes = pages_sent * preamble.bytes_per_page
        seconds = time.perf_counter() - self.start
        return TransferStats(ids, preamble.num_pages, pages_sent, nbytes, seconds, self.meta["metadata"])


def _direct_flags(
    manager: KVCacheManager,
    meta: dict[str, Any],
    preamble: wire.Preamble,
    incoming: list[int],
    pages: list[int],
    dev: torch.device,
) -> list[int] | None:
    """The reply flags of a direct transfer of `incoming` into `pages`, or None to go packed: when
    either pool is not where the messages live, or the runs consecutive on both sides are too short."""
    source = meta["source_pages"]
    if source is None or manager.collection.blocks.device != dev or not pages or len(source) != preamble.num_pages:
        return None
    flags = wire.direct_flags([source[i] for i in incoming], pages, preamble.chunk_pages)
    if len(pages) * preamble.page_bytes < DIRECT_MIN_MESSAGE_BYTES * flags.count(wire.STARTS):
        return None
    return flags


def _receive_direct(
    pipe: DirectPipe,
    preamble: wire.Preamble,
    messages: list[tuple[int, int]],
    pages: list[int],
    src: int,
    group: Any,
    timeout: Any,
) -> int:
    """Receive each run of `messages` straight into pool pages `pages[a : a + n]` (`DIRECT_IN_FLIGHT`
    posted ahead), summing each as it lands (on the device off the CPU, compared once at the end),
    then the scales and the sender's checksums; the scales are written only if everything matched.
    Returns the pages written: all of them, also in a TransferError's `pages_written` (a posted
    receive may have written its pages). Raises TransferError.

    On any failure every remaining message is still taken (or fails at once on a closed pair, or
    times out, which closes it) before the error goes up: no message may land later in pages that
    are free again, and a live sender is not left waiting."""
    payloads = [pipe.message(pages[a], n) for a, n in messages]
    if pipe.scales is not None:
        payloads.append(pipe.scales_message(len(pages)))
    expected = torch.empty(len(payloads), dtype=torch.int64, device=payloads[0].device)
    what = f"receiving chunk {{}} of {len(payloads)}"
    works: dict[int, Any] = {}
    posted, written, sums = 0, len(pages), []  # a failure counts every page as written

    def post_before(end: int) -> None:  # post the receives of messages posted .. end - 1
        nonlocal posted
        while posted < min(end, len(payloads)):
            works[posted] = _post(dist.irecv, payloads[posted], src, group, what.format(posted + 1), written)
            posted += 1

    try:
        post_before(DIRECT_IN_FLIGHT)
        for k, payload in enumerate(payloads):
            _wait(works.pop(k), timeout, what.format(k + 1), src, written)
            post_before(k + 1 + DIRECT_IN_FLIGHT)
            sums.append(wire.message_checksum(payload, preamble.checksum))
        checksums_work = _post(dist.irecv, expected, src, group, "receiving the checksums", written)
        _wait(checksums_work, timeout, "receiving the checksums", src, written)
    except BaseException:
        for k in [*works, *range(posted, len(payloads) + 1)]:
            with contextlib.suppress(Exception):
                work = works.pop(k, None)
                tensor = payloads[k] if k < len(payloads) else expected
                (work or dist.irecv(tensor, src, group=group)).wait(timeout)
        raise
    mismatched = (wire.checksums_tensor(sums, expected.device) != expected).nonzero().cpu()  # one wait, at the end
    if mismatched.numel():
        name, k = wire.CHECKSUM_NAMES[preamble.checksum], int(mismatched[0])
        where = f"chunk {k + 1} of {len(payloads)} from rank {src}"
        raise TransferError(f"checksum ({name}) mismatch in {where}", written)
    if pipe.scales is not None:
        pipe.unpack_scales(payloads[-1], pages)
    return written


def _receive_packed(
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
    pipe = PackedPipe(manager.collection.blocks, _scales(manager), dev, max(sizes, default=1))
    what = f"receiving chunk {{}} of {len(sizes)}"
    works: dict[int, Any] = {}

    def post(k: int) -> None:  # chunk k into buffer k % PIPELINE_DEPTH, whose previous chunk is done with
        if k < len(sizes):
            works[k] = _post(dist.irecv, pipe.message(k, sizes[k]), src, group, what.format(k + 1), written)

    written, bad, verdicts = 0, None, []  # verdicts: on-device checks, read back once at the end
    for k in range(PIPELINE_DEPTH - 1):
        post(k)
    for k, n in enumerate(sizes):
        _wait(works.pop(k), timeout, what.format(k + 1), src, written)
        post(k + PIPELINE_DEPTH - 1)
        if bad is not None:  # drain the rest, so the sender hears why and the channel stays usable
            continue
        matched, filled = pipe.scatter(pipe.message(k, n), pages[written : written + n], preamble.checksum)
        written += filled  # with a mismatch too: the abort must forget cached pages that were written
        if isinstance(matched, torch.Tensor):
            verdicts.append(matched)
        elif not matched:
            bad = k
    if verdicts:  # (then every chunk was checked on the device)
        failed = torch.stack(verdicts).logical_not().nonzero().cpu()
        bad = int(failed[0]) if failed.numel() else None
    if bad is not None:
        name = wire.CHECKSUM_NAMES[preamble.checksum]
        raise TransferError(f"checksum ({name}) mismatch in chunk {bad + 1} of {len(sizes)} from rank {src}", written)
    return written
