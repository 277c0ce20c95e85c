"""Fuzzing `receive_sequences` with crafted and damaged transfer messages, over gloo.

Each case, the sender (rank 0) either sends its real pages with the metadata message crafted (a random
JSON edit) or damaged (flipped bytes, cut short, extended), through the real `send_sequences`; or
sends a raw preamble the receiver must refuse (bad magic, version, sizes, stray bytes), with the real
metadata after it where the receiver will read it. The receiver (rank 1) may take the sequences or
raise `TransferRejected` / `TransferError`, nothing else, its manager unchanged when it does not take
them; a sender whose message could be answered hears the refusal. Transfers go packed (a crafted
`source_pages` would otherwise ask for direct messages the real sender cannot send).
"""

from __future__ import annotations

import datetime
import json
import random
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from distributed_ranks import assert_same, snapshot
from fuzz_mutations import damage_bytes, mutate_json
from test_distributed_transfer import PARAMS, check_refcounts, patched, receiver_state, sender_state

from torch_paged_kv.distributed import TransferError, TransferRejected, receive_sequences, send_sequences, wire
from torch_paged_kv.distributed import receiver as receiver_module

TIMEOUT = datetime.timedelta(seconds=20)


def _raw_preamble(rng: random.Random, meta: bytes, num_pages: int, page_bytes: int) -> tuple[torch.Tensor, bool]:
    """A first message the receiver must refuse, and whether it reads the metadata after it (then it
    replies)."""
    words = wire.Preamble(len(meta), num_pages, page_bytes, 0, 4, wire.SUM64).pack()
    field = rng.randrange(10)
    if field == 0:
        words[0] = rng.randrange(-(2**63), 2**63)  # magic
    elif field == 1:
        words[1] = rng.choice([0, 1, 3, -1, 2**40])  # version
    elif field == 2:
        words[2] = rng.choice([-1, wire.MAX_META_BYTES + 1, 2**62])  # meta bytes
    elif field == 3:
        words[rng.randrange(3, 8)] = -rng.randrange(1, 2**40)  # a negative size
    elif field == 4:
        words[6] = 0  # chunk_pages
    elif field == 5:
        words[7] = rng.choice([0, 3, 99])  # an unknown checksum
    elif field == 6:  # stray bytes after a good preamble, or a stray message
        extra = bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 64)))
        return torch.frombuffer(bytearray(words.view(torch.uint8).numpy().tobytes() + extra), dtype=torch.uint8), False
    elif field == 7:
        size = rng.choice([1, 7, 63, wire.FIRST_MESSAGE_BYTES])
        return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)), False
    elif field == 8:  # a good preamble whose sizes do not fit: the metadata is read, then refused
        words[3] = num_pages + rng.choice([-num_pages, -1, 1, 2**31])
        return words, True
    else:
        words[4 + rng.randrange(2)] += rng.choice([1, 4096])  # page or scale bytes not this cache's
        return words, True
    return words, False


def _fuzz(rank: int, world: int, cases: list[int]) -> Counter:
    outcomes: Counter = Counter()
    src, _, ids, shared = sender_state(5, b"salt")
    with patched(receiver_module, "_direct_flags", lambda *args: None):
        for case in cases:
            rng = random.Random(case)
            strategy = rng.choice(["json", "json", "bytes", "preamble"])
            try:
                if rank == 0:
                    _send(src, ids, strategy, rng, outcomes)
                else:
                    _receive(shared, outcomes)
            except AssertionError as exc:
                raise AssertionError(f"case {case} ({strategy}): {exc}") from exc
            except Exception as exc:
                raise AssertionError(f"case {case} ({strategy}): {type(exc).__name__}: {exc}") from exc
    return outcomes


def _send(src: Any, ids: list, strategy: str, rng: random.Random, outcomes: Counter) -> None:
    real = wire.encode_meta
    if strategy == "preamble":
        meta = real(src.collection.params.to_dict(), None, ["x"], [1], [[0]], [[1]], [[]], b"", None, None)
        first, replies = _raw_preamble(rng, meta, 1, src.collection.blocks[0].numel() * 2)
        dist.isend(first, 1).wait(TIMEOUT)
        if replies:
            dist.isend(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1).wait(TIMEOUT)
            reply = torch.zeros(wire.REPLY_BYTES + 1, dtype=torch.uint8)
            dist.irecv(reply, 1).wait(TIMEOUT)
            assert wire.unpack_reply(reply)[0] == wire.REJECTED
        outcomes["preamble: refused"] += 1
        return

    def crafted(*args: Any) -> bytes:
        data = real(*args)
        if strategy == "bytes":
            return damage_bytes(data, rng) or b" "
        return json.dumps(mutate_json(json.loads(data), rng)).encode()

    with patched(wire, "encode_meta", crafted):
        try:
            send_sequences(src, ids, 1, timeout=TIMEOUT)
            outcomes[f"{strategy}: taken"] += 1
        except TransferRejected:
            outcomes[f"{strategy}: refused"] += 1


def _receive(shared: list[int], outcomes: Counter) -> None:
    dst, _ = receiver_state(5, shared, b"salt")
    before = snapshot(dst)
    try:
        stats = receive_sequences(dst, 0, timeout=TIMEOUT)
    except (TransferRejected, TransferError) as exc:
        outcomes[type(exc).__name__] += 1
        assert_same(before, snapshot(dst))
        return
    outcomes["taken"] += 1
    check_refcounts(dst)
    for seq_id in stats.seq_ids:
        assert dst.cache_length(seq_id) <= dst.collection.max_seq_len
        dst.release(seq_id)
    check_refcounts(dst)


def test_receive_sequences_refuses_crafted_and_damaged_messages_cleanly(rank_groups, fuzz_cases):
    cases = list(fuzz_cases(60))
    sent, received = rank_groups.get(2).run(_fuzz, cases, timeout=60 + 3 * len(cases))
    assert received["TransferRejected"] and received["taken"], received
    assert sent["preamble: refused"] and sent["json: refused"] and sent["json: taken"], sent
    assert PARAMS.page_size == 4  # the pages the raw preambles describe
