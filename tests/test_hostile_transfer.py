"""A misbehaving or hostile sender: crafted transfer metadata and preambles, stray messages.

The receiver refuses (`TransferRejected`, after telling the sender why, whenever the sender's message
sizes let it reply) or gives up (`TransferError`), its manager unchanged, without allocating what a
message merely declares; the channel stays usable for the next transfer. The one limit: gloo aborts
the receiving process when a message is longer than the receive posted for it (tested below, in a
group of its own).
"""

from __future__ import annotations

import datetime
import json
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from distributed_ranks import Ranks, assert_same, check_contents, snapshot
from test_distributed_transfer import make, patched, sender_state

from torch_paged_kv.distributed import TransferError, TransferRejected, receive_sequences, send_sequences, wire

TIMEOUT = datetime.timedelta(seconds=15)


def _sequence(meta: dict) -> dict:
    return meta["sequences"][0]


CRAFTED_META = {
    "no length": lambda m: _sequence(m).pop("length"),
    "no pages": lambda m: _sequence(m).pop("pages"),
    "nested pages": lambda m: _sequence(m).update(pages=[[0]]),
    "a page past num_pages": lambda m: _sequence(m)["pages"].append(10**6),
    "a page left out": lambda m: [s.update(pages=[]) for s in m["sequences"][1:]],
    "length not an int": lambda m: _sequence(m).update(length="7"),
    "token ids not ints": lambda m: _sequence(m).update(token_ids=["a"]),
    "a token id past int64": lambda m: _sequence(m).update(token_ids=[2**64]),
    "a key not hex": lambda m: _sequence(m).update(keys=["zz"]),
    "an id that is an object": lambda m: _sequence(m).update(id={"a": 1}),
    "sequences an object": lambda m: m.update(sequences={}),
    "params a list": lambda m: m.update(params=[1]),
    "params absurd": lambda m: m["params"].update(num_layers=10**12, static_scales=[10**400, 1]),
    "source pages negative": lambda m: m.update(source_pages=[-1]),
    "source pages too few": lambda m: m.update(source_pages=[1]),
    "not an object": lambda m: m.clear(),
}


def _crafted_meta(rank: int, world: int, names: list[str]) -> list[str]:
    """Rank 0 sends with its metadata crafted (`CRAFTED_META[name]`), rank 1 receives; then one honest
    transfer shows the channel is still usable."""
    src, model, ids, _shared = sender_state(3)
    ids = src.sequences[:3]
    out = []
    for name in names:
        real = wire.encode_meta

        def crafted(*args: Any, name: str = name, real: Any = real) -> bytes:
            meta = json.loads(real(*args))
            CRAFTED_META[name](meta)
            return json.dumps([] if name == "not an object" else meta).encode()

        if rank == 0:
            with patched(wire, "encode_meta", crafted):
                try:
                    send_sequences(src, ids, 1, timeout=TIMEOUT)
                except TransferRejected as exc:
                    out.append(str(exc))
                else:
                    out.append("accepted")
            continue
        dst = make()
        before = snapshot(dst)
        try:
            receive_sequences(dst, 0, timeout=TIMEOUT)
        except TransferRejected as exc:
            out.append(str(exc))
        else:
            out.append("accepted")
        assert_same(before, snapshot(dst))
    if rank == 0:
        send_sequences(src, ids, 1, timeout=TIMEOUT)
    else:
        dst = make()
        receive_sequences(dst, 0, timeout=TIMEOUT)
        check_contents(dst, {i: model[i] for i in ids}, ids)
    return out


def test_crafted_transfer_entries_are_refused_and_the_sender_hears_why(rank_groups):
    names = list(CRAFTED_META)
    sent, received = rank_groups.get(2).run(_crafted_meta, names, timeout=240)
    for name, s, r in zip(names, sent, received, strict=True):
        assert s.startswith("rank 1 refused the transfer: ") and r.startswith("refused the transfer from rank 0"), (
            name,
            s,
            r,
        )
        reason = s.removeprefix("rank 1 refused the transfer: ")
        assert reason[:200] in r, (name, s, r)  # the sender heard the receiver's reason
    assert "sequence 0: expected an object of" in received[names.index("no length")]
    assert "sequence 0: bad pages" in received[names.index("nested pages")]
    assert "up to index 1000000" in received[names.index("a page past num_pages")]
    assert "unreadable sender params" in received[names.index("params absurd")]


def _send_raw(tensor: torch.Tensor, dst: int) -> None:
    dist.isend(tensor, dst).wait(TIMEOUT)


def _preamble_words(**fields: int) -> list[int]:
    pre = dict(meta_bytes=10, num_pages=1, page_bytes=0, scale_bytes=0, chunk_pages=1, checksum=wire.SUM64)
    pre.update(fields)
    return wire.Preamble(**pre).pack().tolist()


CRAFTED_FIRST_MESSAGES = {
    "2**40 bytes of metadata": (torch.tensor(_preamble_words(meta_bytes=2**40)), "bytes of metadata"),
    "a stray message filling the buffer": (
        torch.randint(
            0, 256, (wire.FIRST_MESSAGE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        ),
        "not a torch_paged_kv page transfer",
    ),
    "a stray 3-byte message": (torch.tensor([1, 2, 3], dtype=torch.uint8), "bad magic number"),
    "a preamble with a ninth word": (
        torch.tensor([*_preamble_words(), 5]),
        "a first message of other than 64 bytes",
    ),
    "a negative size": (torch.tensor(_preamble_words(num_pages=-1)), "malformed preamble"),
}


def _crafted_first_messages(rank: int, world: int, names: list[str]) -> list[tuple[str, float, int]]:
    out = []
    for name in names:
        message, _ = CRAFTED_FIRST_MESSAGES[name]
        if rank == 0:
            _send_raw(message, 1)
            continue
        dst = make()
        before = snapshot(dst)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        try:
            receive_sequences(dst, 0, timeout=TIMEOUT)
        except TransferRejected:
            raise
        except TransferError as exc:
            growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
            out.append((str(exc), time.perf_counter() - start, growth))
        assert_same(before, snapshot(dst))
    # num_pages = 2**31 with a small, consistent meta: taken, refused with a reply, no 2**31 flags built
    src, _, _, _ = sender_state(3)
    meta = wire.encode_meta(src.collection.params.to_dict(), None, ["x"], [1], [[0]], [[7]], [[]], b"", None, None)
    if rank == 0:
        _send_raw(torch.tensor(_preamble_words(meta_bytes=len(meta), num_pages=2**31)), 1)
        _send_raw(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1)
        reply = torch.zeros(wire.REPLY_BYTES, dtype=torch.uint8)
        dist.irecv(reply, 1).wait(TIMEOUT)
        status, reason, _ = wire.unpack_reply(reply)
        assert status == wire.REJECTED, (status, reason)
        out.append((reason, 0.0, 0))
    else:
        dst = make()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            receive_sequences(dst, 0, timeout=TIMEOUT)
        except TransferRejected as exc:
            out.append((str(exc), 0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss))
    # and an honest transfer still goes through
    src, model, ids, _ = sender_state(4)
    if rank == 0:
        send_sequences(src, ids, 1, timeout=TIMEOUT)
    else:
        dst = make()
        receive_sequences(dst, 0, timeout=TIMEOUT)
        check_contents(dst, {i: model[i] for i in ids}, ids)
    return out


def test_crafted_preambles_and_stray_first_messages_are_refused_without_allocating(rank_groups):
    names = list(CRAFTED_FIRST_MESSAGES)
    sent, received = rank_groups.get(2).run(_crafted_first_messages, names, timeout=240)
    for name, (message, seconds, growth) in zip(names, received[:-1], strict=True):
        assert message.startswith("rank 0 sent ") and CRAFTED_FIRST_MESSAGES[name][1] in message, (name, message)
        assert seconds < 5 and growth < 64 << 10, (name, seconds, growth)  # KiB: nothing large allocated
    reason, _, growth = received[-1]
    assert "preamble says 2147483648" in reason and growth < 64 << 10
    assert "preamble says 2147483648" in sent[-1][0]


def _longer_than_the_first_receive(rank: int, world: int) -> str:
    if rank == 0:
        _send_raw(torch.zeros(wire.FIRST_MESSAGE_BYTES + 1, dtype=torch.uint8), 1)
        return "sent"
    receive_sequences(make(), 0, timeout=TIMEOUT)
    return "survived"


def test_the_limit_a_first_message_longer_than_its_buffer_aborts_the_receiver():
    """gloo aborts (SIGABRT, in its own thread) when a message is longer than the receive posted for
    it; the receiver's first receive takes `FIRST_MESSAGE_BYTES`. This test documents the limit."""
    ranks = Ranks(2)
    try:
        sender, receiver = ranks.run(_longer_than_the_first_receive, expect_exit=(1,), timeout=60)
    finally:
        ranks.close()
    assert sender == "sent" and receiver is None  # the receiving process died
