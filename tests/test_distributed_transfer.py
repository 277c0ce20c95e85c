"""Page transfer between processes over gloo: bit-exact, all or nothing, and loud when it fails.

Every rank can recompute any sequence's K/V from its tokens (`distributed_ranks.kv_rows`), and
builds the sender's state from a seed, so the receiver checks what arrived against its own copy.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_ranks import Ranks, assert_same, check_contents, kv_rows, run_step, snapshot

import torch_paged_kv as pk
from torch_paged_kv.distributed import (
    TransferError,
    TransferRejected,
    channel,
    pipes,
    receive_sequences,
    send_sequences,
    wire,
)
from torch_paged_kv.distributed import receiver as receiver_module
from torch_paged_kv.manager import OutOfPagesError

PARAMS = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
PS = PARAMS.page_size


def make(num_pages: int = 96, params: pk.KVCacheParams = PARAMS, **kw) -> pk.KVCacheManager:
    return pk.KVCacheManager(pk.PagedKVCacheCollection(params, num_pages, 16, 128), **kw)


def sender_state(seed: int, salt: bytes | None = None) -> tuple[pk.KVCacheManager, dict, list, list[int]]:
    """Random ragged sequences (a shared prompt, forks, decode steps), the same on every rank for a seed;
    returns the manager, the tokens, the ids to send and the shared prompt."""
    gen = random.Random(seed)
    m, model = make(hash_salt=salt), {}
    shared = [gen.randrange(50) for _ in range(gen.randrange(4, 13))]
    ids = []
    for j in range(gen.randint(2, 6)):
        prompt = (shared if gen.random() < 0.6 else []) + [gen.randrange(50) for _ in range(gen.randint(1, 20))]
        seq_id = f"s{seed}-{j}"
        reused = m.claim(seq_id, prompt)
        model[seq_id] = prompt[:reused]
        run_step(m, [seq_id], [prompt[reused:]], model)
        ids.append(seq_id)
    for j in range(gen.randint(0, 2)):
        parent, child = gen.choice(ids), f"s{seed}-fork{j}"
        m.fork(parent, child)
        model[child] = list(model[parent])
        ids.append(child)
    for _ in range(gen.randint(0, 6)):
        rows = gen.sample(ids, gen.randint(1, len(ids)))
        run_step(m, rows, [[gen.randrange(50) for _ in range(gen.randint(1, 3))] for _ in rows], model)
    return m, model, gen.sample(ids, gen.randint(1, len(ids))), shared


def receiver_state(seed: int, shared: list[int], salt: bytes | None = None) -> tuple[pk.KVCacheManager, dict]:
    """A receiver already holding a sequence of its own and, released, the shared prompt (cached pages)."""
    m, model = make(hash_salt=salt), {"live": [], "had-prompt": []}
    m.claim("live")
    run_step(m, ["live"], [[seed % 50] * 7], model)
    m.claim("had-prompt", [*shared, 1])
    run_step(m, ["had-prompt"], [[*shared, 1]], model)
    m.release("had-prompt")
    del model["had-prompt"]
    return m, model


def check_refcounts(m: pk.KVCacheManager) -> None:
    held: dict[int, int] = {}
    for i in m.sequences:
        for page in m.pages(i):
            held[page] = held.get(page, 0) + 1
    pool = m.page_pool
    for page in range(1, m.collection.num_pages + 1):
        assert pool.refcounts[page] == held.get(page, 0), page
    assert set(pool.free) | set(pool.evictable) | set(held) == set(range(1, m.collection.num_pages + 1))


def _transfer_random(rank: int, world: int, seeds: list[int]) -> list[dict]:
    out = []
    for seed in seeds:
        sender = seed % 2
        salt_s, salt_r = (b"same", b"same") if seed % 3 else (b"one", b"other")
        src, src_model, ids, shared = sender_state(seed, salt_s)
        chunk_bytes = random.Random(seed).randint(1, 5) * PS * PARAMS.bytes_per_token
        checksum = "sum64" if seed % 4 == 1 else "crc32"
        if rank == sender:
            before = snapshot(src)
            stats = send_sequences(
                src, ids, 1 - rank, metadata={"seed": seed}, chunk_bytes=chunk_bytes, checksum=checksum
            )
            assert_same(before, snapshot(src))  # the sender only reads
            out.append(dict(pages=stats.pages, sent=stats.pages_sent))
            continue
        dst, dst_model = receiver_state(seed, shared, salt_r)
        stats = receive_sequences(dst, 1 - rank, timeout=datetime.timedelta(seconds=20))
        assert stats.seq_ids == ids and stats.metadata == {"seed": seed}
        check_refcounts(dst)
        for i in ids:  # bit-exact whole pages, tokens, lengths
            used = -(-src.cache_length(i) // PS)
            mine = dst.collection.blocks[torch.tensor(dst.pages(i)[:used], dtype=torch.long)]
            theirs = src.collection.blocks[torch.tensor(src.pages(i)[:used], dtype=torch.long)]
            assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), i
            assert dst.token_ids(i) == src_model[i] and dst.cache_length(i) == len(src_model[i])
            assert len(dst.prefix_keys(i)) == len(src_model[i]) // PS  # keyed here, with this salt
            if salt_s == salt_r:
                assert dst.prefix_keys(i) == src.prefix_keys(i)
        model = {**dst_model, **{i: src_model[i] for i in ids}}
        check_contents(dst, model, list(model))
        gen = random.Random(seed + 1000)  # the sequences go on here
        run_step(dst, ids, [[gen.randrange(50)] for _ in ids], model)
        check_contents(dst, model, list(model))
        out.append(dict(pages=stats.pages, sent=stats.pages_sent, shared_salt=salt_s == salt_r))
    return out


def test_random_ragged_transfers_are_bit_exact_both_ways(rank_groups):
    seeds = list(range(8))
    results = rank_groups.get(2).run(_transfer_random, seeds)
    received = [r for seed in seeds for r in [results[1 - seed % 2][seeds.index(seed)]]]
    assert all(r["sent"] <= r["pages"] for r in received)
    # with the same salt, pages of the shared prompt the receiver had cached were not sent
    assert any(r["sent"] < r["pages"] for r in received if r["shared_salt"])
    assert all(r["sent"] == r["pages"] for r in received if not r["shared_salt"])


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Within: `owner.name` is `value` (in a rank's process: no pytest fixtures there)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def direct_counted(force: bool = True) -> Iterator[list[int]]:
    """Within: every transfer this rank receives goes direct (no minimum run size) if `force`; yields a
    count of the direct messages this rank sent or received."""
    count, message = [0], pipes.DirectPipe.message

    def counting(self, first_page, n):
        count[0] += 1
        return message(self, first_page, n)

    minimum = 0 if force else receiver_module.DIRECT_MIN_MESSAGE_BYTES
    with patched(receiver_module, "DIRECT_MIN_MESSAGE_BYTES", minimum), patched(pipes.DirectPipe, "message", counting):
        yield count


def _transfer_random_direct(rank: int, world: int, seeds: list[int]) -> list[dict]:
    with direct_counted() as count:
        out = _transfer_random(rank, world, seeds)
    return [{**r, "direct_messages": count[0]} for r in out]


def test_random_ragged_transfers_go_direct_bit_exact_both_ways(rank_groups):
    """The same random transfers with runs of pool pages as the messages (no packing), sum64 and crc32."""
    seeds = list(range(8, 16))
    results = rank_groups.get(2).run(_transfer_random_direct, seeds)
    assert all(r["direct_messages"] > len(seeds) for rank_results in results for r in rank_results)


def _rejections(rank: int, world: int) -> list[str]:
    """Refusals leave both sides unchanged and the channel usable; then transfers with odd ids work."""
    src, model, _, _ = sender_state(7)
    ids = src.sequences[:2]
    other = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=8, page_size=8)
    messages = []
    cases = [
        ("params", lambda: make(params=other), None),
        ("heads", lambda: make(tp_shard=pk.TPShard(2, 1, 2, 4)), None),  # heads 2..3 of 4, the sender all 2
        ("pages", lambda: make(num_pages=2), None),
        ("clash", lambda: _with_sequence(ids[0]), None),
        ("foreign ids", lambda: make(), None),
    ]
    for name, make_receiver, seq_ids in cases:
        if rank == 0:
            send_ids = ids if name != "foreign ids" else [frozenset({1}), ids[1]]
            if name == "foreign ids":
                src.fork(ids[0], frozenset({1}))
            with pytest.raises(TransferRejected) as info:
                send_sequences(src, send_ids, 1)
            messages.append(str(info.value))
            if name == "foreign ids":
                src.release(frozenset({1}))
        else:
            dst = make_receiver()
            before = snapshot(dst)
            with pytest.raises(TransferRejected) as info:
                receive_sequences(dst, 0, seq_ids=seq_ids)
            assert_same(before, snapshot(dst))
            if name == "pages":
                assert isinstance(info.value.__cause__, OutOfPagesError)
    # the channel is clean after refusals: ids that are tuples come back as tuples, others are renamed
    src.fork(ids[0], ("req", 1))
    src.fork(ids[0], frozenset({2}))
    if rank == 0:
        send_sequences(src, [("req", 1)], 1, metadata={"first_tokens": [3]})
        send_sequences(src, [frozenset({2})], 1)
        return messages
    dst = make()
    stats = receive_sequences(dst, 0)
    assert stats.seq_ids == [("req", 1)] and stats.metadata == {"first_tokens": [3]}
    stats = receive_sequences(dst, 0, seq_ids=["renamed"])
    assert dst.sequences == [("req", 1), "renamed"]
    check_contents(dst, {("req", 1): model[ids[0]], "renamed": model[ids[0]]}, dst.sequences)
    return []


def _with_sequence(seq_id) -> pk.KVCacheManager:
    m = make()
    m.claim(seq_id)
    return m


def test_refusals_leave_both_sides_unchanged_and_say_why(rank_groups):
    messages = rank_groups.get(2).run(_rejections)[0]
    assert "the sender's cache is" in messages[0] and "page_size=4" in messages[0]
    assert "the sender's cache holds every KV head (2), this one KV heads 2..3 of 4 (tensor-parallel" in messages[1]
    assert "OutOfPagesError: out of KV pages" in messages[2]
    assert "already exists" in messages[3]
    assert "pass seq_ids" in messages[4]


# -- a sender that dies or goes silent mid-transfer ---------------------------------------------------


def _failing_sender(rank: int, world: int) -> list[str]:
    """Rank 0 sends to rank 1 twice, each time on a fresh group: first it stalls past the receiver's
    timeout, then it is killed after two chunks. The receiver must raise a clear error each time,
    with its manager as before."""
    out = []
    for case in ("silent", "killed"):
        group = dist.new_group([0, 1])  # a timed-out gloo pair is closed for good: a new pair per case
        if rank == 0:
            src, _, _, _ = sender_state(3)
            calls = [0]
            gather = pipes.PackedPipe.gather

            def failing_gather(self, message, pages, kind, case=case, calls=calls, gather=gather):
                calls[0] += 1
                if calls[0] == 3:
                    time.sleep(0.5)  # chunks 1 and 2 are out
                    if case == "killed":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(2.5)
                gather(self, message, pages, kind)

            pipes.PackedPipe.gather = failing_gather
            one_page = PS * PARAMS.bytes_per_token
            try:
                send_sequences(
                    src, src.sequences, 1, group=group, chunk_bytes=one_page, timeout=datetime.timedelta(seconds=2)
                )
            except TransferError as exc:
                out.append(f"sender: {exc}")
            pipes.PackedPipe.gather = gather
            continue
        dst, model = receiver_state(3, [1, 2, 3, 4])
        free_pages = list(dst.page_pool.free)
        before = snapshot(dst)
        with pytest.raises(TransferError) as info:
            receive_sequences(dst, 0, group=group, timeout=datetime.timedelta(seconds=1))
        assert_same(before, snapshot(dst))
        assert list(dst.page_pool.free) == free_pages  # every page it took is back, in order
        assert info.value.pages_written == 2  # two verified one-page chunks were written, then given back
        run_step(dst, ["live"], [[5, 6]], model)  # the manager works as before
        check_contents(dst, model, ["live"])
        out.append(str(info.value))
    return out


def test_a_sender_silent_or_killed_mid_transfer_leaves_the_receiver_unchanged():
    ranks = Ranks(2)
    try:
        silent, killed = ranks.run(_failing_sender, expect_exit=(0,), timeout=90)[1]
    finally:
        ranks.close()
    assert "receiving chunk 3 of" in silent and "Timed out" in silent, silent
    assert "receiving chunk 3 of" in killed and "Connection closed by peer" in killed, killed


# -- tensor-parallel receivers agree: all of them register the sequences, or none ---------------------


def _consensus(rank: int, world: int) -> str:
    """Prefill ranks 0, 1 (TP=2) send their head shards to decode ranks 2, 3 (TP=2): first all works,
    then rank 3 has too few pages and rank 2, whose own transfer went through, must give it up too."""
    full = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=4, head_dim=8, page_size=4)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    from torch_paged_kv.distributed.tensor_parallel import shard_params, tp_shard

    params, shard = shard_params(full, 2, rank % 2), tp_shard(full, 2, rank % 2)
    tokens = list(range(23))
    if rank < 2:
        src, model = make(params=params, tp_shard=shard), {"a": []}
        src.claim("a", tokens)
        run_step(src, ["a"], [tokens], model)
        send_sequences(src, ["a"], rank + 2)
        with pytest.raises(TransferError) as info:
            send_sequences(src, ["a"], rank + 2)
        return str(info.value)
    dst, model = make(params=params, tp_shard=shard), {"a": tokens}
    receive_sequences(dst, rank - 2, consensus_group=groups[1])
    check_contents(dst, model, ["a"])
    small = make(num_pages=3 if rank == 3 else 96, params=params, tp_shard=shard)
    before = snapshot(small)
    with pytest.raises(TransferError) as info:
        receive_sequences(small, rank - 2, seq_ids=["b"], consensus_group=groups[1])
    assert_same(before, snapshot(small))
    return str(info.value)


def test_tensor_parallel_receivers_register_all_or_nothing(rank_groups):
    results = rank_groups.get(4).run(_consensus)
    assert "did not take the sequences" in results[0] and "another rank" in results[0]
    assert "refused the transfer" in results[1] and "OutOfPagesError" in results[1]
    assert "another rank of the consensus group" in results[2]
    assert "OutOfPagesError" in results[3]


def test_kv_rows_is_a_function_of_the_prefix():
    a = kv_rows(PARAMS, [1, 2, 3, 4], 0, 4)
    assert torch.equal(kv_rows(PARAMS, [1, 2, 3, 9], 0, 3), a[:3]) and not torch.equal(
        a[3], kv_rows(PARAMS, [1, 2, 3, 9], 3, 4)[0]
    )


# -- FP8 caches: per-page scales travel with the pages ----------------------------------------------

FP8 = pk.KVCacheParams(
    torch.float8_e4m3fn, num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, quantization_granularity=4
)


def fp8_sender(seed: int) -> tuple[pk.KVCacheManager, list]:
    """Random ragged FP8 sequences (K/V quantized by store_kv, scales per token, head and granule)."""
    gen = random.Random(seed)
    m, model = make(params=FP8), {}
    for j in range(4):
        seq_id = f"q{j}"
        m.claim(seq_id)
        model[seq_id] = []
        run_step(m, [seq_id], [[gen.randrange(50) for _ in range(gen.randint(1, 14))]], model)
    m.fork("q0", "q0-fork")
    return m, m.sequences


def _fp8(rank: int, world: int) -> None:
    src, ids = fp8_sender(11)
    if rank == 0:
        for _ in range(2):  # refused by a bf16 cache and by a coarser granularity
            with pytest.raises(TransferRejected, match="sender's cache is"):
                send_sequences(src, ids, 1)
        send_sequences(src, ids, 1, chunk_bytes=3 * PS * (FP8.bytes_per_token + FP8.scale_bytes_per_token))
        return None
    coarse = pk.KVCacheParams(torch.float8_e4m3fn, 2, 2, 8, 4, quantization_granularity=8)
    for other in (make(), make(params=coarse)):
        with pytest.raises(TransferRejected):
            receive_sequences(other, 0)
    dst = make(params=FP8)
    stats = receive_sequences(dst, 0)
    assert stats.pages_sent == stats.pages
    for i in ids:
        used = -(-src.cache_length(i) // PS)
        mine, theirs = torch.tensor(dst.pages(i)[:used]), torch.tensor(src.pages(i)[:used])
        assert torch.equal(
            dst.collection.blocks[mine].view(torch.uint8), src.collection.blocks[theirs].view(torch.uint8)
        )
        assert torch.equal(dst.collection.scales[mine], src.collection.scales[theirs]), i
        assert bool(dst.collection.scales[mine].ne(0).any())
    return None


def _fp8_sums(rank: int, world: int, on_device: bool) -> int:
    """`_fp8`, with the sums kept as tensors if `on_device`; returns how many were."""
    with sums_on_device() if on_device else contextlib.nullcontext([0]) as count:
        _fp8(rank, world)
    return count[0]


@pytest.mark.parametrize("on_device", [False, True])
def test_fp8_pages_travel_with_their_scales(rank_groups, on_device):
    sums = rank_groups.get(2).run(_fp8_sums, on_device)
    assert all(n > 1 for n in sums) if on_device else sums == [0, 0]


@contextlib.contextmanager
def corrupted_chunk(chunk: int, byte: int, bit: int) -> Iterator[None]:
    """Within: the sender's `chunk`-th message (1-based) gets `bit` flipped in `byte` after its checksum."""
    gather, calls = pipes.PackedPipe.gather, [0]

    def corrupting_gather(self, message, pages, kind):
        gather(self, message, pages, kind)
        calls[0] += 1
        if calls[0] == chunk:
            message[byte] ^= bit

    pipes.PackedPipe.gather = corrupting_gather
    try:
        yield
    finally:
        pipes.PackedPipe.gather = gather


@contextlib.contextmanager
def wrong_checksum(message: int) -> Iterator[None]:
    """Within: the checksum the sender gives its `message`-th direct message (1-based) is off by one."""
    checksum, calls = wire.checksum, [0]

    def off_by_one(payload, kind):
        calls[0] += 1
        return (checksum(payload, kind) + (calls[0] == message)) % 2**64

    with patched(wire, "checksum", off_by_one):
        yield


def _corrupted(rank: int, world: int, on_device: bool) -> tuple[str, int]:
    """A byte flipped in chunk 2 after its checksum: the receiver drains the rest, says why, and is
    unchanged; the sender hears the reason; the next transfer on the same channel works. `on_device`:
    the sums computed, written and compared as tensors (the route of GPU wires). Returns the error and
    the number of sums taken as tensors."""
    src, model, ids, _ = sender_state(5)
    one_page = PS * PARAMS.bytes_per_token
    with sums_on_device() if on_device else contextlib.nullcontext([0]) as count:
        if rank == 0:
            with corrupted_chunk(2, byte=3, bit=0x40), pytest.raises(TransferError) as info:
                send_sequences(src, ids, 1, chunk_bytes=one_page)
            send_sequences(src, ids, 1, chunk_bytes=one_page)
            return str(info.value), count[0]
        dst, dst_model = receiver_state(5, [1, 2, 3, 4])
        before = snapshot(dst)
        with pytest.raises(TransferError, match="checksum") as info:
            receive_sequences(dst, 0)
        assert_same(before, snapshot(dst))
        # chunk 1 went in; chunk 2 too where it is checked while copied (the fused CPU path); every
        # chunk where the verdicts are read back at the end (on the device); all given back
        written = used_pages(src, ids) if on_device else (2 if wire.has_copy_sum64() else 1)
        assert info.value.pages_written == written
        receive_sequences(dst, 0)
    check_contents(dst, {**dst_model, **{i: model[i] for i in ids}}, [*dst_model, *ids])
    return str(info.value), count[0]


@pytest.mark.parametrize("on_device", [False, True])
def test_a_corrupted_chunk_is_refused_and_the_channel_stays_usable(rank_groups, on_device):
    (sender, sender_sums), (receiver, receiver_sums) = rank_groups.get(2).run(_corrupted, on_device)
    assert receiver.startswith("checksum (sum64) mismatch in chunk 2 of")
    assert "did not take the sequences: checksum (sum64) mismatch in chunk 2" in sender
    assert (sender_sums > 4 and receiver_sums > 4) if on_device else sender_sums == receiver_sums == 0


def _corrupted_into_cached_pages(rank: int, world: int, direct: bool) -> int:
    """The receiver fills its 4 free pages, then 2 cached pages it evicts; chunk 6 (one page each) is
    corrupted. Written cached pages lose their cache entries; every page the cache keeps is intact."""
    with direct_counted() if direct else contextlib.nullcontext():
        one_page, prompt = PS * PARAMS.bytes_per_token, list(range(100, 132))
        if rank == 0:
            src, model = make(), {"s": []}
            src.claim("s")
            run_step(src, ["s"], [list(range(24))], model)
            corrupt = wrong_checksum(6) if direct else corrupted_chunk(6, byte=5, bit=0x01)
            with corrupt, pytest.raises(TransferError, match="mismatch in chunk 6"):
                send_sequences(src, ["s"], 1, chunk_bytes=one_page)
            return 0
        dst, model = make(num_pages=12), {"c": []}
        dst.claim("c", prompt)
        run_step(dst, ["c"], [prompt], model)
        dst.release("c")
        pool, blocks = dst.page_pool, dst.collection.blocks
        assert (len(pool.free), len(pool.evictable)) == (4, 8)
        cached = {page: blocks[page].clone() for page in pool.key_of}
        with pytest.raises(TransferError, match="mismatch in chunk 6") as info:
            receive_sequences(dst, 0)
        written = info.value.pages_written
        # the fused and the direct paths wrote chunk 6 too (while checking it; before its checksum came)
        assert written == (6 if direct or wire.has_copy_sum64() else 5)
        assert len(cached) - len(pool.key_of) == written - 4 and not dst.sequences
        assert all(torch.equal(blocks[page], cached[page]) for page in pool.key_of)
        model = {"again": prompt[: dst.claim("again", prompt)]}
        check_contents(dst, model, ["again"])  # what the cache still serves is right
        return written


@pytest.mark.parametrize("direct", [False, True])
def test_a_corrupted_chunk_in_evicted_cached_pages_drops_their_cache_entries(rank_groups, direct):
    rank_groups.get(2).run(_corrupted_into_cached_pages, direct)


def _confirmation_lost_after_evicting(rank: int, world: int) -> int:
    """The receiver fills its 4 free pages and 2 cached pages it evicts, then its confirmation fails:
    the sequences are not registered and the cached pages it overwrote lose their cache entries."""
    one_page, prompt = PS * PARAMS.bytes_per_token, list(range(100, 132))
    if rank == 0:
        src, model = make(), {"s": []}
        src.claim("s")
        run_step(src, ["s"], [list(range(24))], model)
        send_sequences(src, ["s"], 1, chunk_bytes=one_page)  # (its confirmation went out)
        return 0
    dst, model = make(num_pages=12), {"c": []}
    dst.claim("c", prompt)
    run_step(dst, ["c"], [prompt], model)
    dst.release("c")
    pool, blocks = dst.page_pool, dst.collection.blocks
    cached = {page: blocks[page].clone() for page in pool.key_of}
    post = channel.post

    def lost(op, tensor, peer, group, what, *args):
        work = post(op, tensor, peer, group, what, *args)
        if what == "confirming":
            work.wait()
            raise TransferError("confirmation lost")
        return work

    with patched(channel, "post", lost), pytest.raises(TransferError, match="confirmation lost"):
        receive_sequences(dst, 0)
    assert len(cached) - len(pool.key_of) == 2 and not dst.sequences
    assert all(torch.equal(blocks[page], cached[page]) for page in pool.key_of)
    return len(pool.free)


def test_a_failed_confirmation_drops_the_cache_entries_of_the_pages_it_wrote(rank_groups):
    assert rank_groups.get(2).run(_confirmation_lost_after_evicting) == [0, 6]


WIDE = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=3, head_dim=40, page_size=16)
"""15 KiB pages: not whole 4 KiB rows; a chunk of 12 crosses the fused copy's 128 KiB slabs."""


def _fused(rank: int, world: int) -> None:
    """sum64 transfers between CPU pools take the fused copy-and-checksum path and are bit-exact
    (interleaved sequences: runs of consecutive pages and gaps), also when one side takes the numpy
    path instead (same wire format)."""
    gen, ids = random.Random(17), ["a", "b", "c", "d"]
    steps = [[[gen.randrange(50) for _ in range(gen.randint(5, 30))] for _ in ids] for _ in range(4)]
    model = {i: [] for i in ids}
    src = make(params=WIDE)
    for i in ids:
        src.claim(i)
    for news in steps:
        run_step(src, ids, news, model)
    copy_sum64, has_copy_sum64 = wire.copy_sum64, wire.has_copy_sum64
    for fused in [(True, True), (True, False), (False, True)]:  # (sender, receiver)
        calls = [0]

        def counting(*args, calls=calls, **kwargs):
            calls[0] += 1
            return copy_sum64(*args, **kwargs)

        wire.copy_sum64, wire.has_copy_sum64 = counting, (has_copy_sum64 if fused[rank] else lambda: False)
        try:
            if rank == 0:
                stats = send_sequences(src, ids, 1, chunk_bytes=12 * WIDE.page_size * WIDE.bytes_per_token)
            else:
                dst, mine = make(params=WIDE), {"live": []}
                dst.claim("live")
                run_step(dst, ["live"], [[1] * 37], mine)
                stats = receive_sequences(dst, 0)
        finally:
            wire.copy_sum64, wire.has_copy_sum64 = copy_sum64, has_copy_sum64
        assert calls[0] == (-(-stats.pages_sent // 12) if fused[rank] else 0) and stats.pages_sent > 12, fused
        if rank == 1:
            check_contents(dst, {**model, **mine}, [*ids, "live"])


def test_sum64_transfers_between_cpu_pools_are_fused_and_bit_exact(rank_groups):
    if not wire.has_copy_sum64():
        pytest.skip("no C++ compiler: transfers take the numpy path")
    rank_groups.get(2).run(_fused)


# -- direct transfers: failures leave the receiver as before ------------------------------------------


def _fp8_direct(rank: int, world: int) -> int:
    """FP8 pages go direct, their scales packed in one message after them."""
    with direct_counted() as count:
        _fp8(rank, world)
    return count[0]


def test_fp8_pages_go_direct_with_their_scales(rank_groups):
    sender, receiver = rank_groups.get(2).run(_fp8_direct)
    assert sender == receiver > 1


@contextlib.contextmanager
def sums_on_device(wrong: int = 0) -> Iterator[list[int]]:
    """Within: SUM64 sums of CPU messages take the route of GPU messages (`wire.sum64_tensor`, kept as
    tensors, compared at the end); the `wrong`-th (1-based, 0: none) is off by one. Yields a count of
    the sums taken that way."""
    count, sum64_tensor = [0], wire.sum64_tensor

    def counting(payload):
        count[0] += 1
        return sum64_tensor(payload) + (count[0] == wrong)

    with patched(wire, "sums_stay_on", lambda device: True), patched(wire, "sum64_tensor", counting):
        yield count


def _corrupted_direct(rank: int, world: int, on_device: bool) -> tuple[str, int]:
    """The sender's checksum of direct message 2 is off by one: the receiver takes every message, then
    refuses; its manager is as before (every page it wrote is free again); the channel stays usable.
    `on_device`: the sums kept as tensors (the route of GPU messages). Returns the error and the
    number of sums taken as tensors."""
    src, model, ids, _ = sender_state(5)
    one_page = PS * PARAMS.bytes_per_token
    sums = sums_on_device(wrong=2 if rank == 0 else 0) if on_device else contextlib.nullcontext([0])
    with direct_counted(), sums as count:
        if rank == 0:
            with contextlib.nullcontext() if on_device else wrong_checksum(2), pytest.raises(TransferError) as info:
                send_sequences(src, ids, 1, chunk_bytes=one_page)
            send_sequences(src, ids, 1, chunk_bytes=one_page)
            return str(info.value), count[0]
        dst, dst_model = receiver_state(5, [1, 2, 3, 4])
        before, free_pages = snapshot(dst), list(dst.page_pool.free)
        with pytest.raises(TransferError, match="checksum") as info:
            receive_sequences(dst, 0)
        assert_same(before, snapshot(dst))
        assert list(dst.page_pool.free) == free_pages
        assert info.value.pages_written == used_pages(src, ids)  # every posted receive may have written
        receive_sequences(dst, 0)
    check_contents(dst, {**dst_model, **{i: model[i] for i in ids}}, [*dst_model, *ids])
    return str(info.value), count[0]


def used_pages(manager: pk.KVCacheManager, ids: list) -> int:
    """Distinct pages the sequences `ids` use (what a transfer with nothing cached sends)."""
    return len({p for i in ids for p in manager.pages(i)[: -(-manager.cache_length(i) // PS)]})


@pytest.mark.parametrize("on_device", [False, True])
def test_a_corrupted_direct_message_is_refused_and_the_channel_stays_usable(rank_groups, on_device):
    (sender, sender_sums), (receiver, receiver_sums) = rank_groups.get(2).run(_corrupted_direct, on_device)
    assert receiver.startswith("checksum (sum64) mismatch in chunk 2 of")
    assert "did not take the sequences: checksum (sum64) mismatch in chunk 2" in sender
    assert (sender_sums > 4 and receiver_sums > 4) if on_device else sender_sums == receiver_sums == 0


def _transfer_random_device_sums(rank: int, world: int, seeds: list[int], direct: bool) -> tuple[int, int]:
    """`_transfer_random` with the sums kept as tensors, forced direct or left packed (these pages are
    too small for direct by default); returns the sums taken as tensors and the direct messages."""
    with direct_counted(force=direct) as messages, sums_on_device() as sums:
        _transfer_random(rank, world, seeds)
    return sums[0], messages[0]


@pytest.mark.parametrize("direct", [False, True])
def test_transfers_with_sums_kept_on_the_device_are_bit_exact(rank_groups, direct):
    """Random ragged transfers (sum64) with the sums kept as tensors, the route of GPU wires, run on
    CPU tensors: direct messages' sums compared with the sender's at the end; packed chunks' sums
    written into their trailers on the device and the verdicts read back once. Bit-exact (and a wrong
    sum or a flipped byte is refused, above)."""
    seeds = [1, 5, 9, 13]  # seed % 4 == 1: sum64; rank 1 sends, rank 0 receives
    for sums, messages in rank_groups.get(2).run(_transfer_random_device_sums, seeds, direct):
        assert sums > len(seeds) and (messages > len(seeds) if direct else messages == 0)


def _receiver_fails_mid_direct_transfer(rank: int, world: int) -> str:
    """The receiver's own code raises at message 2 while a slow sender is still sending: before the
    error goes up, every remaining message is taken, so none lands later in pages that are free
    again; the sender hears why, and the channel stays usable."""
    src, model, ids, _ = sender_state(5)
    one_page = PS * PARAMS.bytes_per_token
    with direct_counted():
        if rank == 0:
            post = channel.post

            def slow(*args):
                time.sleep(0.02)
                return post(*args)

            with patched(channel, "post", slow), pytest.raises(TransferError) as info:
                send_sequences(src, ids, 1, chunk_bytes=one_page)
            send_sequences(src, ids, 1, chunk_bytes=one_page)
            return str(info.value)
        dst, dst_model = receiver_state(5, [1, 2, 3, 4])
        before, checksum, calls = snapshot(dst), wire.checksum, [0]

        def failing(payload, kind):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("the receiver's own failure")
            return checksum(payload, kind)

        with patched(wire, "checksum", failing), pytest.raises(RuntimeError, match="own failure"):
            receive_sequences(dst, 0)
        pool = dst.collection.blocks.clone()
        time.sleep(0.5)
        assert torch.equal(dst.collection.blocks.view(torch.int16), pool.view(torch.int16))  # nothing came late
        assert_same(before, snapshot(dst))
        receive_sequences(dst, 0)
    check_contents(dst, {**dst_model, **{i: model[i] for i in ids}}, [*dst_model, *ids])
    return "ok"


def test_a_receiver_failing_mid_direct_transfer_takes_every_message_before_raising(rank_groups):
    sender, _ = rank_groups.get(2).run(_receiver_fails_mid_direct_transfer)
    assert "did not take the sequences: the receiver's own failure" in sender


def _killed_direct_sender(rank: int, world: int) -> str:
    """The sender dies after two direct messages: the receiver raises, naming the message it waited
    for, with its manager and free list as before."""
    with direct_counted():
        if rank == 0:
            src, _, _, _ = sender_state(3)
            post = channel.post

            def dying(op, tensor, peer, group, what, *args):
                if what == "sending chunk 3":
                    time.sleep(0.5)  # messages 1 and 2 are out
                    os.kill(os.getpid(), signal.SIGKILL)
                return post(op, tensor, peer, group, what, *args)

            with patched(channel, "post", dying):
                send_sequences(src, src.sequences, 1, chunk_bytes=PS * PARAMS.bytes_per_token)
            return "not killed"
        dst, model = receiver_state(3, [1, 2, 3, 4])
        free_pages, before = list(dst.page_pool.free), snapshot(dst)
        with pytest.raises(TransferError) as info:
            receive_sequences(dst, 0, timeout=datetime.timedelta(seconds=5))
    assert_same(before, snapshot(dst))
    assert list(dst.page_pool.free) == free_pages
    run_step(dst, ["live"], [[5, 6]], model)
    check_contents(dst, model, ["live"])
    return str(info.value)


def test_a_sender_killed_mid_direct_transfer_leaves_the_receiver_unchanged():
    ranks = Ranks(2)
    try:
        killed = ranks.run(_killed_direct_sender, expect_exit=(0,), timeout=90)[1]
    finally:
        ranks.close()
    assert "receiving chunk 3 of" in killed and "Connection closed by peer" in killed, killed


def test_transfers_go_direct_only_where_runs_of_pages_are_long_enough():
    """The receiver's choice: runs consecutive on both sides, averaging DIRECT_MIN_MESSAGE_BYTES."""
    big = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=8, head_dim=128, page_size=16)  # 128 KiB
    manager = make(num_pages=64, params=big)
    page_bytes = pipes.byte_pages(manager.collection.blocks).shape[1]
    preamble = wire.Preamble(0, 32, page_bytes, 0, 16, wire.SUM64)
    meta, cpu = {"source_pages": list(range(10, 42))}, torch.device("cpu")

    def choose(meta: dict, dest: list[int]) -> list[int] | None:
        return receiver_module._direct_flags(manager, meta, preamble, list(range(len(dest))), dest, cpu)

    flags = choose(meta, list(range(1, 33)))
    assert flags is not None and wire.direct_messages(flags) == [(0, 16), (16, 16)]  # chunk_pages caps a run
    assert choose(meta, random.Random(0).sample(range(1, 33), 32)) is None  # runs of one 128 KiB page
    assert choose({"source_pages": None}, list(range(1, 33))) is None  # the sender cannot send in place
