"""The receiving side of a page transfer: `receive_sequences`, a `_Receiver` in named phases around a
`KVCacheManager.reserve`: negotiate, reply, receive, vote, commit (the messages are in wire.py)."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Hashable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..manager import KVCacheManager
from ..params import describe_heads, params_from_dict
from ..reservation import Reservation
from . import channel, wire
from .channel import TransferError, TransferRejected, TransferStats, wire_device
from .pipes import PIPELINE_DEPTH, DirectPipe, PackedPipe, byte_pages, free_buffers

DIRECT_MIN_MESSAGE_BYTES = 1 << 20
"""A transfer goes direct (runs of pool pages are the messages) when its runs average at least this
many bytes; below it the extra messages cost more than packing saves (gloo, loopback, 2-core EPYC)."""


def receive_sequences(
    manager: KVCacheManager,
    src: int,
    *,
    group: dist.ProcessGroup | None = None,
    seq_ids: Sequence[Hashable] | None = None,
    timeout: datetime.timedelta = channel.DEFAULT_TIMEOUT,
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
            receiver.commit(reservation, written)
        except BaseException as exc:
            if reservation.open:
                pages_written = getattr(exc, "pages_written", None)
                reservation.abort(pages_written if isinstance(pages_written, int) else None)
            raise
    except BaseException:
        receiver.vote_no()
        raise
    return receiver.stats(ids, len(reservation.pages))


class _Receiver:
    """The receiving side of one transfer, in its phases: `negotiate` (preamble, metadata, checks,
    pages reserved), `reply` (which pages to send, and how), `receive` (every message, checked),
    `vote` (with the consensus group), `commit` (tell the sender, register the sequences). On a
    failure after `negotiate` the caller aborts the reservation. A refusal is answered before
    `TransferRejected` goes up; a failure after the reply gets a best-effort FAILED answer."""

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
        channel.exchange(op, tensor, self.src, self.group, self.timeout, what)

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
                pipe = DirectPipe(self.manager.collection.blocks, channel.pool_scales(self.manager))
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

    def commit(self, reservation: Reservation, written: int) -> None:
        """Tell the sender every page arrived (failing that, `written` pages count as written), then
        commit the reservation: the sequences are registered."""
        try:
            self._exchange(dist.isend, wire.pack_reply(wire.ACCEPTED, "", None, self.dev), "confirming")
        except TransferError as exc:
            exc.pages_written = written
            raise
        reservation.commit()

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
    """Receive each run of `messages` straight into pool pages `pages[a : a + n]` (`channel.DIRECT_IN_FLIGHT`
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
            works[posted] = channel.post(dist.irecv, payloads[posted], src, group, what.format(posted + 1), written)
            posted += 1

    try:
        post_before(channel.DIRECT_IN_FLIGHT)
        for k, payload in enumerate(payloads):
            channel.wait(works.pop(k), timeout, what.format(k + 1), src, written)
            post_before(k + 1 + channel.DIRECT_IN_FLIGHT)
            sums.append(wire.message_checksum(payload, preamble.checksum))
        checksums_work = channel.post(dist.irecv, expected, src, group, "receiving the checksums", written)
        channel.wait(checksums_work, timeout, "receiving the checksums", src, written)
    except BaseException:
        for k in [*works, *range(posted, len(payloads) + 1)]:
            with contextlib.suppress(Exception):
                tensor = payloads[k] if k < len(payloads) else expected
                work = works.pop(k, None) or dist.irecv(tensor, src, group=group)
                if work is not None:
                    work.wait(timeout)
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
    pipe = PackedPipe(manager.collection.blocks, channel.pool_scales(manager), dev, max(sizes, default=1))
    what = f"receiving chunk {{}} of {len(sizes)}"
    works: dict[int, Any] = {}

    def post(k: int) -> None:  # chunk k into buffer k % PIPELINE_DEPTH, whose previous chunk is done with
        if k < len(sizes):
            works[k] = channel.post(dist.irecv, pipe.message(k, sizes[k]), src, group, what.format(k + 1), written)

    written, bad, verdicts = 0, None, []  # verdicts: on-device checks, read back once at the end
    for k in range(PIPELINE_DEPTH - 1):
        post(k)
    for k, n in enumerate(sizes):
        channel.wait(works.pop(k), timeout, what.format(k + 1), src, written)
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
    scales = channel.pool_scales(manager)
    if meta["scales"] != channel.scales_spec(scales):
        return f"the sender's scales are {meta['scales']}, this cache's are {channel.scales_spec(scales)}"
    blocks_bytes = byte_pages(manager.collection.blocks).shape[1]
    scale_bytes = 0 if scales is None else byte_pages(scales).shape[1]
    if (preamble.page_bytes, preamble.scale_bytes) != (blocks_bytes, scale_bytes):
        return (
            f"pages of {preamble.page_bytes}+{preamble.scale_bytes} bytes (blocks+scales), this cache's are "
            f"{blocks_bytes}+{scale_bytes}"
        )
    return None


def _vote(group: Any, ok: bool, device: torch.device) -> bool:
    """True iff every rank of `group` votes ok (an all-reduce of one flag)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
