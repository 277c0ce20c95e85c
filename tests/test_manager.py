"""KVCacheManager against independent models of sequences, page ownership and cache contents.

K/V written for a token is a pure function of the token prefix up to it (`kv_rows`), so a page
reused from the prefix cache must hold exactly what recomputing would write.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
import struct

import numpy as np
import pytest
import torch

import torch_paged_kv as tpk
from torch_paged_kv import checkpoint as pk_checkpoint
from torch_paged_kv.manager import KVCacheManager, OutOfPagesError, Reservation
from torch_paged_kv.page_pool import page_key, root_key
from torch_paged_kv.testing import attention_fp64

PARAMS = tpk.KVCacheParams(torch.float32, num_layers=2, num_kv_heads=2, head_dim=4, page_size=4)
PS = PARAMS.page_size
SLIDING = tpk.KVCacheParams(torch.float32, num_layers=1, num_kv_heads=1, head_dim=8, page_size=PS, sliding_window=6)
GROUPS = {  # layer groups of the randomized workload: params and model layers of each
    "one group": ([PARAMS], [[0, 1]]),
    "full + sliding": ([PARAMS, SLIDING], [[0, 2], [1]]),
    "sliding, another window": ([dataclasses.replace(PARAMS, sliding_window=9)], [[0, 1]]),
    "two sliding + full": (
        [SLIDING, dataclasses.replace(SLIDING, sliding_window=13, head_dim=4), PARAMS],
        [[3], [1], [0, 2]],
    ),
}


def make(num_pages: int = 32, max_batch: int = 8, max_seq_len: int = 64, **kw) -> KVCacheManager:
    return KVCacheManager(tpk.PagedKVCacheCollection(PARAMS, num_pages, max_batch, max_seq_len), **kw)


def make_groups(groups: str, num_pages: int, max_batch: int, max_seq_len: int, **kw) -> KVCacheManager:
    params, layers = GROUPS[groups]
    counts = [num_pages if p.sliding_window is None else num_pages * 2 // 3 for p in params]
    return KVCacheManager(tpk.LayerGroups.allocate(params, layers, counts, max_batch, max_seq_len), **kw)


def kv_rows(
    tokens: list[int], start: int, stop: int, params: tpk.KVCacheParams = PARAMS, group: int = 0
) -> torch.Tensor:
    """K/V of positions start..stop-1: `[n, 2, layers, heads, head_dim]`, a function of the prefix (and group)."""
    h, hashes = 7 + group, []
    for tok in tokens[:stop]:
        h = (h * 1_000_003 + tok + 1) % 2_147_483_647
        hashes.append(h)
    n_vals = 2 * params.num_layers * params.num_kv_heads * params.head_dim
    mult = torch.arange(1, n_vals + 1, dtype=torch.int64) * 7919
    vals = (torch.tensor(hashes[start:], dtype=torch.int64)[:, None] * mult[None]) % 997
    return (vals.float() / 997).view(-1, 2, params.num_layers, params.num_kv_heads, params.head_dim)


def run_step(
    m: KVCacheManager, ids: list, news: list[list[int]], model: dict, pass_tokens: bool = True
) -> tpk.StepTensors | tuple[tpk.StepTensors, ...]:
    """One step: prepare, store each row's K/V in every group (a function of its model tokens), commit."""
    steps = m.prepare_step(ids, [len(t) for t in news], news if pass_tokens else None)
    for g, (c, step) in enumerate(
        zip(m.collections, [steps] if isinstance(steps, tpk.StepTensors) else steps, strict=True)
    ):
        rows = [
            kv_rows(model[i] + t, len(model[i]), len(model[i]) + len(t), c.params, g)
            for i, t in zip(ids, news, strict=True)
        ]
        kv = torch.cat(rows)
        for layer in range(c.params.num_layers):
            tpk.store_kv(kv[:, 0, layer].contiguous(), kv[:, 1, layer].contiguous(), c.blocks, *step, layer)
    m.commit_step()
    for i, t in zip(ids, news, strict=True):
        model[i] = model[i] + t
    return steps


def check_contents(m: KVCacheManager, model: dict, ids: list) -> None:
    """Every page a sequence holds, read straight from each group's pool, equals K/V recomputed from its
    tokens (a sliding-window group: the pages from the first one it holds, at most the first one its
    length needs: those a rewind may need too)."""
    for g, c in enumerate(m.collections):
        p = c.params
        for i in ids:
            length = len(model[i])
            assert m.cache_length(i) == length
            entries = m.pages(i, g)
            first = next((j for j, page in enumerate(entries) if page != tpk.NULL_PAGE), len(entries))
            assert first <= p.first_held_page(length) or length == 0, (i, g)
            pages = entries[first : -(-length // PS)]
            if not pages:
                continue
            held = c.blocks[torch.tensor(pages)]  # [n, 2, layers, page_size, heads, head_dim]
            got = held.permute(0, 3, 1, 2, 4, 5).reshape(-1, 2, p.num_layers, p.num_kv_heads, p.head_dim)
            want = kv_rows(model[i], first * PS, length, p, g)
            assert torch.equal(got[: len(want)], want), (i, g)


def check_ownership(m: KVCacheManager, model: dict, on_device: set, peaks: dict | None = None) -> None:
    """Per group: refcounts equal holders; free/evictable/held partition the pages; shared pages are
    full; the host table holds exactly the sequences' pages; a sliding-window group holds exactly the
    pages from `first_held_page` of each length on (the null page before: O(window) per sequence),
    or with `peaks` (the longest each sequence has been) from `first_held_page(peak - max_rewind)` on,
    at most `(window - 1 + max_rewind) // page_size + 2` pages (O(window + max_rewind + page))."""
    for g, (c, pool) in enumerate(zip(m.collections, m.page_pools, strict=True)):
        n = c.num_pages
        holders: dict[int, list[tuple]] = {}
        for i in model:
            pages = m.pages(i, g)
            assert m.is_offloaded(i) == (i not in on_device)
            if i not in on_device:
                assert pages == []
                continue
            first = c.params.first_held_page(len(model[i]))
            if peaks is not None and model[i]:
                first = c.params.first_held_page(max(peaks[i] - m.max_rewind, 0))
            assert len(pages) == -(-len(model[i]) // PS)
            assert pages[:first] == [tpk.NULL_PAGE] * first, (g, i)
            held = pages[first:]
            assert len(set(held)) == len(held) and tpk.NULL_PAGE not in held, (g, i)
            if c.params.sliding_window is not None:
                assert len(held) <= (c.params.sliding_window - 1 + m.max_rewind) // PS + 2, (g, i)
            for idx, page in enumerate(held, first):
                holders.setdefault(page, []).append((i, idx))
        rows = m.page_table.groups[g].rows
        assert (rows != tpk.NULL_PAGE).sum() == sum(len(h) for h in holders.values())  # no stale table entries
        for page in range(1, n + 1):
            assert pool.refcounts[page] == len(holders.get(page, [])), page
            shared_or_cached = len(holders.get(page, [])) > 1 or page in pool.key_of
            for i, idx in holders.get(page, []):
                if shared_or_cached:  # never written again: full and behind the sequence's length
                    assert (idx + 1) * PS <= len(model[i]), (page, i, idx)
        free, evictable = set(pool.free), set(pool.evictable)
        assert len(free) == len(pool.free) and not free & evictable and not free & set(holders)
        assert evictable == {p for p in pool.key_of if p not in holders}
        assert len(free) + len(evictable) + len(holders) == n
        assert {pool.page_of[k]: k for k in pool.page_of} == pool.key_of
    in_use = sum(
        len({p for i in model for p in m.pages(i, g) if p != tpk.NULL_PAGE}) * c.params.page_bytes
        for g, c in enumerate(m.collections)
    )
    assert m.kv_bytes_in_use() == in_use


def snapshot(m: KVCacheManager) -> dict:
    """Everything an all-or-nothing operation must leave unchanged, as the public surface shows it."""
    table = m.page_table
    state = {name: getattr(table, name).copy() for name in ("lengths", "known", "tokens")}
    for g, group in enumerate(table.groups):
        state[f"rows{g}"], state[f"num_pages{g}"] = group.rows.copy(), group.num_pages.copy()
    state["pools"] = [copy.deepcopy(vars(pool)) for pool in m.page_pools]
    groups = range(len(m.collections))
    state["counters"] = (
        m.prefix_cache_hits, m.prefix_cache_misses, [(m.num_free_pages(g), m.num_cached_pages(g)) for g in groups]
    )  # fmt: skip
    state["seqs"] = {
        i: (m.cache_length(i), [m.pages(i, g) for g in groups], m.token_ids(i), m.prefix_keys(i), m.is_offloaded(i))
        for i in m.sequences
    }
    state["prepared"] = m.prepared_sequences
    state["device"] = [
        t.clone() for c in m.collections for t in (c.cache_lengths, c.lookup_table, c.input_row_offsets, c.blocks)
    ]
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), k
        elif k == "device":
            assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True)), k
        else:
            assert x == y, k


def pages_needed(model: dict, ids: list, counts: list[int]) -> int:
    """New pages a step takes in each group (the same count in every group: table entries grow alike)."""
    return sum(-(-(len(model[i]) + n) // PS) - -(-len(model[i]) // PS) for i, n in zip(ids, counts, strict=True))


def restore_needed(m: KVCacheManager, model: dict, ids: list, g: int, peaks: dict | None = None) -> int:
    """Pages restoring `ids` takes in group g when nothing is shared (`peaks`: as in `check_ownership`)."""
    p = m.collections[g].params
    kept = {i: len(model[i]) if peaks is None or not model[i] else max(peaks[i] - m.max_rewind, 0) for i in ids}
    return sum(-(-len(model[i]) // PS) - p.first_held_page(kept[i]) for i in ids)


# -- randomized workload ------------------------------------------------------------------------


@pytest.mark.parametrize("groups", list(GROUPS))
def test_random_workload_against_model(groups):
    rng = random.Random(1234)
    m = make_groups(groups, num_pages=40, max_batch=6, max_seq_len=40)
    groups_range = range(len(m.collections))
    model: dict = {}  # seq id -> committed token ids
    prompt_left: dict = {}  # seq id -> prompt tokens still to compute
    on_device: set = set()
    bases = [[rng.randrange(3) for _ in range(30)] for _ in range(3)]
    next_id, counts, last_ids = 0, {}, []

    for op_index in range(4000):
        op = rng.choices(["claim", "step", "fork", "release", "offload", "restore"], [3, 8, 1, 2, 1, 1])[0]
        live = sorted(on_device)
        if op == "claim" and len(model) < 10:
            prompt = bases[rng.randrange(3)][: rng.randrange(0, 20)] + [
                rng.randrange(3) for _ in range(rng.randrange(1, 6))
            ]
            reused = m.claim(next_id, prompt)
            assert reused % PS == 0 and reused < len(prompt)
            model[next_id], prompt_left[next_id] = prompt[:reused], prompt[reused:]
            on_device.add(next_id)
            next_id += 1
        elif op == "step" and live:
            ids = rng.sample(live, rng.randint(1, min(len(live), m.groups.max_batch_size)))
            if last_ids and rng.random() < 0.4 and set(last_ids) <= on_device:  # same rows again: the fast path
                ids = last_ids
            news = []
            for i in ids:
                room = m.max_seq_len - len(model[i])
                n = min(room, 1 if rng.random() < 0.5 else rng.randint(1, 3), len(prompt_left[i]) or 3)
                news.append(prompt_left[i][:n] if prompt_left[i] else [rng.randrange(3) for _ in range(n)])
            if not all(news):
                continue
            last_ids = ids
            pass_tokens = not all(prompt_left[i] for i in ids) or rng.random() < 0.5
            needed = pages_needed(model, ids, [len(t) for t in news])
            if any(needed > m.num_free_pages(g) for g in groups_range):
                before = snapshot(m)
                with pytest.raises(OutOfPagesError):
                    m.prepare_step(ids, [len(t) for t in news], news)
                assert_same(before, snapshot(m))
                op = "oom"
            else:
                steps = run_step(m, ids, news, model, pass_tokens)
                for g, step in enumerate([steps] if isinstance(steps, tpk.StepTensors) else steps):
                    for b, i in enumerate(ids):  # the step tensors the model saw (before window drops)
                        pages = m.pages(i, g)
                        assert step.cache_lengths[b] == len(model[i]) - len(news[b])
                        seen = step.lookup_table[b, : len(pages)].tolist()
                        assert all(p in (q, tpk.NULL_PAGE) for p, q in zip(pages, seen, strict=True))
                        first = m.collections[g].params.first_held_page(len(model[i]) - len(news[b]))
                        assert tpk.NULL_PAGE not in seen[first:] and set(seen[:first]) <= {tpk.NULL_PAGE}
                        assert (step.lookup_table[b, len(pages) :] == tpk.NULL_PAGE).all()
                    assert step.input_row_offsets.tolist() == [0, *np.cumsum([len(t) for t in news])]
                for i, t in zip(ids, news, strict=True):
                    prompt_left[i] = prompt_left[i][len(t) :] if prompt_left[i][: len(t)] == t else []
        elif op == "fork" and live and len(model) < 10:
            parent = rng.choice(live)
            if len(model[parent]) % PS and any(m.num_free_pages(g) == 0 for g in groups_range):
                before = snapshot(m)
                with pytest.raises(OutOfPagesError):
                    m.fork(parent, next_id)
                assert_same(before, snapshot(m))
            else:
                m.fork(parent, next_id)
                model[next_id], prompt_left[next_id] = list(model[parent]), []
                on_device.add(next_id)
            next_id += 1
        elif op == "release" and model:
            i = rng.choice(sorted(model))
            m.release(i)
            del model[i], prompt_left[i]
            on_device.discard(i)
        elif op == "offload" and live:
            ids = rng.sample(live, rng.randint(1, min(2, len(live))))
            m.offload(ids)
            on_device -= set(ids)
        elif op == "restore" and len(model) > len(on_device):
            ids = [i for i in sorted(model) if i not in on_device][:2]
            before = snapshot(m)
            try:
                m.restore(ids)  # full pages still cached are shared again: it may fit where copies would not
            except OutOfPagesError:
                assert any(restore_needed(m, model, ids, g) > m.num_free_pages(g) for g in groups_range)
                assert_same(before, snapshot(m))
                op = "oom"
            else:
                on_device |= set(ids)
        else:
            continue
        counts[op] = counts.get(op, 0) + 1
        assert sorted(m.sequences) == sorted(model)
        check_ownership(m, model, on_device)
        if op_index % 7 == 0:
            check_contents(m, model, sorted(on_device))
    check_contents(m, model, sorted(on_device))
    assert all(counts.get(op, 0) >= 20 for op in ("claim", "step", "fork", "release", "offload", "restore", "oom")), (
        counts
    )
    assert m.prefix_cache_hits > 100 and m.prefix_cache_misses > 100


# -- prefix caching -----------------------------------------------------------------------------


def attention_of_last(m: KVCacheManager, seq_id, prompt: list[int], start: int | None = None) -> torch.Tensor:
    """Claim `prompt`, compute what the cache lacks (or from `start`), return attention of the computed rows."""
    reused = m.claim(seq_id, prompt)
    if start is None:
        start = reused
    else:  # compute prompt[reused:start] first, as its own step
        run_step(m, [seq_id], [prompt[reused:start]], {seq_id: prompt[:reused]})
    step = m.prepare_step([seq_id], [len(prompt) - start])
    kv = kv_rows(prompt, start, len(prompt))
    q = kv_rows(prompt, start, len(prompt))[:, 0, 0].repeat(1, 2, 1)  # 4 query heads (GQA 2:1)
    for layer in range(PARAMS.num_layers):
        tpk.store_kv(kv[:, 0, layer].contiguous(), kv[:, 1, layer].contiguous(), m.collection.blocks, *step, layer)
    out = tpk.flash_attention(q, m.collection.blocks, *step, 1, 0.5)
    m.commit_step()
    return out


def test_prefix_reuse_matches_recompute_and_counts_tokens():
    prompt = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    fresh = attention_of_last(make(), "x", prompt, start=8)  # same step shapes, its own pages
    one_step = attention_of_last(make(), "y", prompt)
    m = make()
    attention_of_last(m, "a", prompt)
    assert (m.prefix_cache_hits, m.prefix_cache_misses) == (0, 11)
    reused_out = attention_of_last(m, "b", prompt)
    assert m.cache_length("b") == 11 and (m.prefix_cache_hits, m.prefix_cache_misses) == (8, 14)
    assert m.pages("b")[:2] == m.pages("a")[:2]
    assert m.pages("b")[2] != m.pages("a")[2]
    assert torch.equal(reused_out, fresh)
    torch.testing.assert_close(reused_out, one_step[8:])  # a different query count: rounding may differ
    # a prompt of exactly two cached pages reuses one: at least one token is left to compute
    assert m.claim("c", prompt[:8]) == 4
    assert m.claim("d", prompt[:3] + [0] * 8) == 0
    assert m.claim("e") == 0 and m.claim("f", []) == 0
    assert (m.prefix_cache_hits, m.prefix_cache_misses) == (12, 14 + 4 + 11)


def test_prefix_cache_disabled_reuses_nothing():
    m = make(enable_prefix_caching=False)
    attention_of_last(m, "a", list(range(9)))
    assert m.claim("b", list(range(9))) == 0
    assert m.num_cached_pages() == 0 and (m.prefix_cache_hits, m.prefix_cache_misses) == (0, 0)


def test_lru_evicts_least_recently_released_tail_first():
    m = make(num_pages=6)
    model: dict = {}
    pa, pb = [1] * 9, [2] * 9
    for i, p in (("a", pa), ("b", pb)):
        m.claim(i, p)
        model[i] = []
        run_step(m, [i], [p], model)
    a_pages, b_pages = m.pages("a"), m.pages("b")
    m.release("a")
    m.release("b")
    assert m.num_free_pages() == 6 and m.num_cached_pages() == 4
    assert list(m.page_pool.evictable) == [a_pages[1], a_pages[0], b_pages[1], b_pages[0]]
    # touching b's head makes it most recent: reuse then release
    assert m.claim("b2", pb[:5]) == 4
    m.release("b2")
    assert list(m.page_pool.evictable) == [*[a_pages[1], a_pages[0], b_pages[1], b_pages[0]][:3], b_pages[0]]
    m.claim("c", [3] * 12)
    model["c"] = []
    run_step(m, ["c"], [[3] * 12], model)  # 3 pages: 2 free (the partial ones), then a's tail
    assert a_pages[1] in m.pages("c")
    assert m.claim("a2", pa) == 4 and m.claim("b3", pb) == 8


def test_salt_separates_caches():
    prompt = list(range(9))
    keys = {}
    for salt in (None, b"tenant-1", b"tenant-2"):
        m = make(hash_salt=salt)
        attention_of_last(m, "a", prompt)
        keys[salt] = m.prefix_keys("a")
        assert keys[salt][0] == page_key(root_key(salt), prompt[:4])
        assert keys[salt][1] == page_key(keys[salt][0], prompt[4:8])
    assert len({k[0] for k in keys.values()}) == 3
    with pytest.raises(ValueError, match="hash_salt"):
        make(hash_salt="text")


def test_decode_pages_cached_only_with_token_ids():
    m = make()
    model = {"a": [], "b": []}
    m.claim("a", [1, 2, 3])
    m.claim("b")
    run_step(m, ["a", "b"], [[1, 2, 3], [1, 2, 3]], model, pass_tokens=False)  # a: from its prompt; b: unknown
    for tok in (4, 5):
        run_step(m, ["a", "b"], [[tok], [tok]], model, pass_tokens=False)
    assert len(m.prefix_keys("a")) == 0 and m.num_cached_pages() == 0  # position 3 of a was not in the prompt
    m.claim("c", [7, 7])
    model["c"] = []
    run_step(m, ["c"], [[7, 7]], model, pass_tokens=False)
    run_step(m, ["c"], [[8, 9]], model)
    assert m.num_cached_pages() == 1 and m.claim("d", [7, 7, 8, 9, 1]) == 4
    run_step(m, ["b"], [[6]], model)  # ids of b's first tokens were never given: b caches nothing
    assert m.token_ids("b") is None and m.num_cached_pages() == 1


def chained_keys(tokens: list[int], salt: bytes | None = None) -> list[bytes]:
    """Prefix-cache keys of the full pages of `tokens`, recomputed from scratch."""
    keys, parent = [], root_key(salt)
    for i in range(len(tokens) // PS):
        parent = page_key(parent, tokens[i * PS : (i + 1) * PS])
        keys.append(parent)
    return keys


def test_page_key_bytes_are_little_endian_int64():
    root = root_key(None)
    want = hashlib.sha256(root + struct.pack("<4q", 1, -2, 70_000, 3)).digest()
    assert page_key(root, [1, -2, 70_000, 3]) == page_key(root, np.array([1, -2, 70_000, 3], dtype=np.int32)) == want


def test_token_storage_grows_forks_and_tracks_partly_known_ids(tmp_path):
    m = make(num_pages=64, max_batch=2, max_seq_len=48)
    model = {"a": [], "c": []}
    m.claim("a", [1, 2, 3, 4, 5, 6, 9, 9])  # the remembered prompt runs past the first step
    m.claim("c")
    run_step(m, ["a", "c"], [[1, 2, 3, 4, 5, 6], [7] * 5], model, pass_tokens=False)  # c: ids unknown
    assert m.token_ids("a") == [1, 2, 3, 4, 5, 6, 9, 9] and m.page_table.tokens.shape[1] == 8
    assert m.prefix_keys("a") == chained_keys(model["a"]) and m.prefix_keys("c") == []
    for t in range(20):  # decode with ids, a past its capacity (8 -> 16 -> 32 -> 48); c stops caching for good
        run_step(m, ["a", "c"], [[t % 3, 7] if t % 4 else [t], [t]], model)
        assert m.prefix_keys("a") == chained_keys(model["a"]), t
        assert m.token_ids("a") == model["a"] and m.token_ids("c") is None
    assert m.page_table.tokens.shape[1] == 48 and m.cache_length("a") == 41  # doubling stops at max_seq_len
    m.fork("a", "b")  # a long, partial-page parent: the child has all its ids and keys
    model["b"] = list(model["a"])
    m.prepare_step(["b", "c"], [2, 1], [[5, 5], [5]])  # (no K/V stored: b's contents are not checked)
    m.release("c")  # dropped from the pending step along with its ids
    m.commit_step()
    model["b"] += [5, 5]
    del model["c"]
    for t in range(3):
        run_step(m, ["a", "b"], [[t], [t + 1]], model)
    for i in ("a", "b"):
        assert m.token_ids(i) == model[i] and m.prefix_keys(i) == chained_keys(model[i])
    check_contents(m, model, ["a"])
    assert m.claim("d", model["b"] + [0]) == len(model["b"]) // PS * PS
    m.release("d")
    tpk.save_sequences(m, tmp_path / "kv.safetensors", ["a", "b"])
    for caching in (True, False):
        dst = make(enable_prefix_caching=caching)
        ids = tpk.load_sequences(dst, tmp_path / "kv.safetensors")
        for new, old in zip(ids, ["a", "b"], strict=True):
            assert dst.token_ids(new) == (model[old] if caching else None)
            assert dst.prefix_keys(new) == (chained_keys(model[old]) if caching else [])


# -- layer groups -------------------------------------------------------------------------------


def test_group_step_plan_attends_like_fp64_while_the_sliding_group_holds_only_its_window():
    """Model layers 0 and 2 in a full group, 1 in a sliding-window group of another geometry: every
    step's attention through a `GroupStepPlan` equals fp64 attention on the sequences' contiguous K/V
    (the window's for layer 1), while the sliding group holds at most ceil((W - 1) / page) + 1 pages
    per sequence after each step and the dropped pages go back to its pool."""
    window = SLIDING.sliding_window
    m = make_groups("full + sliding", num_pages=40, max_batch=3, max_seq_len=40)
    full, sliding = m.collections
    gen = torch.Generator().manual_seed(0)
    kv = {i: [[[], []] for _ in range(3)] for i in "abc"}  # seq -> model layer -> [keys, values]
    for i in "abc":
        m.claim(i)
    counts_per_step = [[7, 1, 12], [1, 1, 1], [5, 3, 1]] + [[1, 1, 1]] * 10
    for step_counts in counts_per_step:
        steps = m.prepare_step(list("abc"), step_counts)
        plan = tpk.GroupStepPlan.of(m.groups, steps)
        for layer, params in ((0, PARAMS), (1, SLIDING), (2, PARAMS)):
            new = [torch.randn(n, 2, params.num_kv_heads, params.head_dim, generator=gen) for n in step_counts]
            for i, rows in zip("abc", new, strict=True):
                kv[i][layer][0].append(rows[:, 0])
                kv[i][layer][1].append(rows[:, 1])
            rows = torch.cat(new)
            plan.store_kv(rows[:, 0].contiguous(), rows[:, 1].contiguous(), layer)
            q = torch.randn(rows.shape[0], 2 * params.num_kv_heads, params.head_dim, generator=gen)
            w = window if layer == 1 else -1
            out = plan.flash_attention(q, layer, 0.5, sliding_window=w)
            keys = [torch.cat(kv[i][layer][0]) for i in "abc"]
            values = [torch.cat(kv[i][layer][1]) for i in "abc"]
            cached = [k.shape[0] - n for k, n in zip(keys, step_counts, strict=True)]
            want = attention_fp64(q, keys, values, cached, 0.5, sliding_window=w)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        m.commit_step()
        for i in "abc":
            held = [p for p in m.pages(i, 1) if p != tpk.NULL_PAGE]
            assert len(held) <= -(-(window - 1) // PS) + 1, (i, m.pages(i, 1))
            assert len(m.pages(i, 0)) == -(-m.cache_length(i) // PS)  # the full group holds everything
    lengths = [m.cache_length(i) for i in "abc"]
    assert lengths == [23, 15, 24]
    assert m.page_pools[1].in_use() <= 3 * 3 < m.page_pools[0].in_use() == sum(-(-n // PS) for n in lengths)
    assert m.kv_bytes_in_use() == sum(
        pool.in_use() * c.params.page_bytes for pool, c in zip(m.page_pools, (full, sliding), strict=True)
    )
    plan = tpk.GroupStepPlan.of(m.groups, m.prepare_step(list("abc"), [1, 1, 1]))
    q = torch.randn(3, 2, SLIDING.head_dim, generator=gen)
    with pytest.raises(ValueError, match="^lookup_table: .* null page"):  # full attention over the window group
        plan.flash_attention(q, 1, 0.5)
    plan.flash_attention(q, 1, 0.5, sliding_window=window)


def test_a_group_that_runs_out_changes_no_group():
    """A step (or fork) that one group cannot serve takes pages in no group; the error names it."""
    groups = tpk.LayerGroups.allocate([PARAMS, SLIDING], [[0, 2], [1]], [30, 6], 2, 40)
    m = KVCacheManager(groups)
    model = {"a": [], "b": []}
    m.claim("a")
    m.claim("b")
    run_step(m, ["a"], [[1] * 24], model)  # 6 pages in each group; the sliding group drops 4 (cached: evictable)
    assert (m.num_free_pages(0), m.num_free_pages(1)) == (24, 4)
    before = snapshot(m)
    with pytest.raises(OutOfPagesError, match="^out of KV pages in layer group 1: 6 needed, 0 free, 4 evictable"):
        m.prepare_step(["b", "a"], [20, 1])  # room in group 0, not in group 1
    assert_same(before, snapshot(m))
    run_step(m, ["b"], [[2] * 16], model)  # 4 pages; 16 - 6 + 1 = 11: pages 0 and 1 go at once
    assert (m.num_free_pages(0), m.num_free_pages(1)) == (20, 2)
    run_step(m, ["a", "b"], [[3, 3], [4, 4, 4]], model)  # b crosses into its fifth page
    check_contents(m, model, ["a", "b"])
    check_ownership(m, model, {"a", "b"})
    with pytest.raises(ValueError, match="^collection: this cache has 2 layer groups"):
        m.collection  # noqa: B018
    with pytest.raises(ValueError, match="^group: expected a layer group 0..1"):
        m.pages("a", 2)


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group():
    """vLLM's hybrid rule: a hit of h pages needs pages 0..h-1 in a full group, but only the pages from
    `first_held_page(h * page_size)` on in a sliding-window group (window 6, page 4: the last two, then
    the window of a shorter hit). Dropped pages stay cached (evictable), oldest first in LRU order."""
    groups = tpk.LayerGroups.allocate([PARAMS, SLIDING], [[0, 2], [1]], [30, 8], 4, 40)
    m = KVCacheManager(groups)
    prompt = list(range(1, 25))  # 24 tokens: 6 pages
    model = {"a": []}
    m.claim("a", prompt)
    run_step(m, ["a"], [prompt], model)
    a_sliding = m.pages("a", 1)
    assert a_sliding[:4] == [tpk.NULL_PAGE] * 4 and m.num_cached_pages(1) == 6  # dropped, still cached
    m.release("a")
    del model["a"]
    assert m.claim("e", prompt[:17]) == 16  # 4 pages: the sliding group needs pages 2 and 3 (tokens 11..15)
    assert m.pages("e", 1) == [tpk.NULL_PAGE, tpk.NULL_PAGE, *a_sliding_of(m, prompt, [2, 3])]
    m.release("e")  # the sliding group's LRU order: pages 0, 1, 5, 4, 3, 2 of the prompt
    model["c"] = []
    m.claim("c")
    run_step(m, ["c"], [[7] * 20], model)  # 5 sliding pages: the 2 free ones, then prompt pages 0, 1 and 5
    assert a_sliding_of(m, prompt, [0, 1, 5]) == [None] * 3
    model["b"] = prompt[:20]
    assert m.claim("b", [*prompt, 9]) == 20  # page 5 is gone: 20 tokens, whose window is in pages 3 and 4
    assert m.pages("b", 0)[:5] == a_full_of(m, prompt, range(5))
    assert (m.prefix_cache_hits, m.pages("b", 1)[:3]) == (16 + 20, [tpk.NULL_PAGE] * 3)
    run_step(m, ["b"], [[*prompt[20:], 9]], model)
    check_contents(m, model, ["b", "c"])
    check_ownership(m, model, {"b", "c"})


def a_sliding_of(m: KVCacheManager, prompt: list[int], pages: list[int]) -> list[int | None]:
    """The pages the sliding group (1) caches for pages `pages` of `prompt` (None: not cached)."""
    keys = chained_keys(prompt)
    return [m.page_pools[1].lookup(keys[i]) for i in pages]


def a_full_of(m: KVCacheManager, prompt: list[int], pages) -> list[int | None]:
    keys = chained_keys(prompt)
    return [m.page_pools[0].lookup(keys[i]) for i in pages]


def test_a_sliding_only_cache_hits_with_its_early_pages_evicted():
    m = make_groups("sliding, another window", num_pages=12, max_batch=2, max_seq_len=40)  # window 9, 8 pages
    prompt, model = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], {"a": [], "x": []}
    m.claim("a", prompt)
    run_step(m, ["a"], [prompt], model)  # 5 pages; 20 - 9 + 1 = 12: pages 0..2 dropped (cached)
    m.release("a")
    del model["a"]
    m.claim("x")
    run_step(m, ["x"], [[0] * 16], model)  # 4 pages: 3 free, then the oldest cached (prompt page 0)
    assert m.claim("b", [*prompt, 1]) == 20  # the window of 20 tokens (12..19) is still cached
    model["b"] = list(prompt)
    run_step(m, ["b"], [[1, 2]], model)
    check_contents(m, model, ["b", "x"])
    check_ownership(m, model, {"b", "x"})


# -- fork / copy-on-write -----------------------------------------------------------------------


def test_fork_shares_full_pages_and_copies_the_partial_one():
    m = make()
    model = {"p": []}
    m.claim("p")
    run_step(m, ["p"], [[1, 2, 3, 4, 5, 6]], model)
    m.fork("p", "c")
    model["c"] = list(model["p"])
    pp, cp = m.pages("p"), m.pages("c")
    assert pp[0] == cp[0] and pp[1] != cp[1] and m.page_pool.refcounts[pp[0]] == 2
    check_contents(m, model, ["p", "c"])
    for step in range(5):  # diverge: both write into the copied page and beyond
        run_step(m, ["p", "c"], [[10 + step], [20 + step, 30]], model)
    check_contents(m, model, ["p", "c"])
    assert m.pages("p")[0] == m.pages("c")[0]
    m.release("p")
    check_contents(m, model, ["c"])
    assert m.page_pool.refcounts[pp[0]] == 1
    m.fork("c", "g")  # length 16: page aligned, nothing copied
    assert m.pages("g") == m.pages("c")


# -- all or nothing -----------------------------------------------------------------------------


def test_out_of_pages_leaves_manager_unchanged():
    m = make(num_pages=5)
    model = {"a": [], "b": []}
    m.claim("a", [1] * 9)
    m.claim("b")
    run_step(m, ["a", "b"], [[1] * 9, [2] * 6], model)  # 3 + 2 pages: all used
    assert m.claim("c", [1] * 9) == 8  # shares a's two full pages
    model["c"] = [1] * 8
    m.prepare_step(["a"], [1])  # a pending step is part of the state too
    before = snapshot(m)
    with pytest.raises(OutOfPagesError, match="2 needed, 0 free, 0 evictable"):
        m.prepare_step(["c", "a"], [1, 6])
    with pytest.raises(OutOfPagesError):
        m.prepare_step(["c"], [1])
    with pytest.raises(OutOfPagesError):
        m.fork("b", "d")  # b's partial page needs a copy
    assert_same(before, snapshot(m))
    run_step(m, ["a"], [[1]], model)  # re-prepares the pending step, with K/V this time
    m.offload(["b"])
    run_step(m, ["c"], [[1]], model)
    before = snapshot(m)
    with pytest.raises(OutOfPagesError, match="2 needed, 0 free, 1 evictable"):
        m.restore(["b"])
    assert_same(before, snapshot(m))
    m.release("c")  # its partial page is freed, its cached pages stay a's
    m.restore(["b"])
    check_contents(m, model, ["a", "b"])


def test_restore_shares_full_pages_still_cached():
    m = make()
    prompt = list(range(9))  # two full pages and one partial at page size 4
    for s in ("a", "b"):
        n = m.claim(s, prompt)
        m.prepare_step([s], [9 - n], token_ids=[prompt[n:]])
        m.commit_step()
    shared = m.pages("a")[:2]
    assert m.pages("b")[:2] == shared
    free = m.num_free_pages()
    m.offload(["b"])
    m.restore(["b"])
    assert m.pages("b")[:2] == shared and m.num_free_pages() == free  # no private copies


def test_errors_name_the_argument_and_change_nothing():
    m = make(max_batch=2, max_seq_len=12)
    model = {"a": [], "b": []}
    m.claim("a", [1, 2])
    m.claim("b")
    run_step(m, ["a", "b"], [[1, 2], [3]], model)
    before = snapshot(m)
    bad = [
        (lambda: m.claim("a"), "seq_id"),
        (lambda: m.claim([1]), "seq_id"),
        (lambda: m.claim("z", [1.5]), "prompt_tokens"),
        (lambda: m.claim("z", list(range(13))), "prompt_tokens"),
        (lambda: m.prepare_step(["a", "x"], [1, 1]), "seq_ids"),
        (lambda: m.prepare_step(["a", "a"], [1, 1]), "seq_ids"),
        (lambda: m.prepare_step([], []), "seq_ids"),
        (lambda: m.prepare_step(["a", "b", "c"], [1, 1, 1]), "seq_ids"),
        (lambda: m.prepare_step(["a", "b"], [1]), "num_new_tokens"),
        (lambda: m.prepare_step(["a", "b"], [1, 0]), "num_new_tokens"),
        (lambda: m.prepare_step(["a", "b"], [1.0, 1.0]), "num_new_tokens"),
        (lambda: m.prepare_step(["a", "b"], [1, 12]), "num_new_tokens"),
        (lambda: m.prepare_step(["a", "b"], [1, 1], [[1], [2, 3]]), "token_ids"),
        (lambda: m.prepare_step(["a", "b"], [1, 1], [[1], ["x"]]), "token_ids"),
        (lambda: m.release("x"), "seq_id"),
        (lambda: m.cache_length("x"), "seq_id"),
        (lambda: m.fork("x", "y"), "parent"),
        (lambda: m.fork("a", "b"), "child"),
        (lambda: m.offload(["a", "x"]), "seq_ids"),
        (lambda: m.restore(["a"]), "seq_ids"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=f"^{name}:"):
            call()
        assert_same(before, snapshot(m))
    with pytest.raises(RuntimeError, match="commit_step"):
        m.commit_step()
    m.prepare_step(["a"], [1])
    for call, name in [(lambda: m.fork("a", "y"), "parent"), (lambda: m.offload(["a"]), "seq_ids")]:
        with pytest.raises(ValueError, match=f"^{name}:.*prepared step"):
            call()


def test_counts_equal_to_the_last_steps_must_still_be_ints():
    """The fast path for counts the last step had (compared with ==) takes no floats or bools."""
    m = make()
    m.claim("a")
    m.claim("b")
    m.prepare_step(["a", "b"], [1, 1])
    m.commit_step()
    before = snapshot(m)
    for counts in ([1.0, 1.0], [True, True], [np.float64(1), np.float64(1)], [1, True], (True, 1)):
        with pytest.raises(ValueError, match="^num_new_tokens:"):
            m.prepare_step(["a", "b"], counts)
        assert_same(before, snapshot(m))
    m.prepare_step(["a", "b"], [np.int64(1), 1])  # ints of any width are counts
    m.prepare_step(["a", "b"], [1, 1])


def test_a_counts_list_changed_in_place_between_steps_is_read_again():
    """The step's counts are compared with a copy of the last ones, never with the caller's list."""
    m = make()
    m.claim("a")
    m.claim("b")
    counts = [1, 1]
    for k in range(3):
        step = m.prepare_step(["a", "b"], counts)
        assert step.input_row_offsets.tolist() == [0, counts[0], sum(counts)]
        m.commit_step()
        if k == 1:  # after a step that repeated the counts
            counts[0] = 3  # the caller reuses its list
    assert (m.cache_length("a"), m.cache_length("b")) == (5, 3)


def test_abandoned_and_released_steps():
    m = make()
    model = {"a": [], "b": []}
    m.claim("a")
    m.claim("b")
    m.prepare_step(["a"], [9])  # abandoned: its three pages stay reserved for a
    assert m.num_free_pages() == 29
    run_step(m, ["a", "b"], [[1, 2], [3]], model)
    assert m.num_free_pages() == 28 and m.cache_length("a") == 2
    m.prepare_step(["a", "b"], [1, 1], [[4], [5]])
    m.release("b")  # dropped from the pending step
    m.commit_step()
    assert m.cache_length("a") == 3 and m.sequences == ["a"]
    m.release("a")
    assert m.num_free_pages() == 32


# -- save / load --------------------------------------------------------------------------------


def test_save_load_into_a_live_manager(tmp_path):
    src = make()
    model = {"a": [], "b": [], "c": []}
    src.claim("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    src.claim("b")
    run_step(src, ["a", "b"], [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 4, 4]], model)
    src.fork("a", "c")  # shares a's two full pages
    model["c"] = list(model["a"])
    run_step(src, ["c"], [[0, 0]], model)
    tpk.save_sequences(src, tmp_path / "kv.safetensors", ["c", "b", "a"])

    dst = make(num_pages=20)
    live = {"x": []}
    dst.claim("x")
    run_step(dst, ["x"], [[9] * 5], live)
    free_before = dst.num_free_pages()
    ids = tpk.load_sequences(dst, tmp_path / "kv.safetensors")
    assert ids == [("loaded", 0), ("loaded", 1), ("loaded", 2)]
    assert dst.num_free_pages() == free_before - 5  # 2 shared by a and c, 1 of each own, 1 of b
    loaded_model = {new: model[old] for new, old in zip(ids, ["c", "b", "a"], strict=True)}
    check_contents(dst, {**loaded_model, **live}, [*ids, "x"])
    check_ownership(dst, {**loaded_model, **live}, {*ids, "x"})
    # token ids came along: the loaded prefix is in dst's prefix cache
    assert dst.claim("y", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert tpk.load_sequences(dst, tmp_path / "kv.safetensors", ["p", "q", "r"]) == ["p", "q", "r"]
    assert tpk.load_sequences(dst, tmp_path / "kv.safetensors")[0] == ("loaded", 3)


@pytest.mark.parametrize("groups", ["full + sliding", "two sliding + full", "sliding, another window"])
def test_save_load_of_layer_groups(tmp_path, groups):
    """A cache of layer groups saves each group's pages (a sliding group only those its window holds)
    and loads into a live manager of the same groups; the sequences go on from there. Another layout,
    or a cache of one group, refuses the file before taking a page."""
    src = make_groups(groups, num_pages=40, max_batch=4, max_seq_len=40)
    model = {"a": [], "b": []}
    src.claim("a", list(range(1, 24)))
    src.claim("b")
    run_step(src, ["a", "b"], [list(range(1, 24)), [4] * 10], model)
    src.fork("a", "c")
    model["c"] = list(model["a"])
    run_step(src, ["c", "b"], [[0, 0, 5], [6]], model)
    tpk.save_sequences(src, tmp_path / "kv.safetensors", ["c", "b", "a"])
    info = pk_checkpoint.read_info(tmp_path / "kv.safetensors")
    held = [len({p for i in "abc" for p in src.pages(i, g)} - {tpk.NULL_PAGE}) for g in range(len(src.collections))]
    assert [g.num_pages for g in info.groups] == held and info.metadata["format_version"] == "4"

    dst = make_groups(groups, num_pages=40, max_batch=4, max_seq_len=40)
    live = {"x": []}
    dst.claim("x")
    run_step(dst, ["x"], [[9] * 5], live)
    ids = tpk.load_sequences(dst, tmp_path / "kv.safetensors")
    loaded = {new: model[old] for new, old in zip(ids, ["c", "b", "a"], strict=True)}
    check_contents(dst, {**loaded, **live}, [*ids, "x"])
    check_ownership(dst, {**loaded, **live}, {*ids, "x"})
    run_step(dst, [ids[0], "x"], [[7, 7], [8]], {**loaded, **live})
    for other in [g for g in GROUPS if g != groups][:2]:
        refusing = make_groups(other, num_pages=40, max_batch=4, max_seq_len=40)
        before = snapshot(refusing)
        with pytest.raises(pk_checkpoint.CheckpointError, match="does not fit this"):
            tpk.load_sequences(refusing, tmp_path / "kv.safetensors")
        assert_same(before, snapshot(refusing))


def test_save_cache_refuses_the_rows_of_a_collection_a_manager_drives(tmp_path):
    """The collection's rows are the last prepared step (lengths before it): right after a prefill a
    file of them would hold nothing. save_cache refuses and points to save_sequences."""
    m = make()
    m.claim("a")
    run_step(m, ["a"], [[1] * 6], {"a": []})
    assert m.collection.cache_lengths[0] == 0  # lags: commit_step advanced the manager only
    for batch_indices in (None, [0]):
        message = r"save with torch_paged_kv.save_sequences\(manager, path, seq_ids\)"
        with pytest.raises(tpk.CheckpointError, match=message):
            tpk.save_cache(m.collection, tmp_path / "kv.safetensors", batch_indices=batch_indices)
    assert not (tmp_path / "kv.safetensors").exists()
    tpk.save_sequences(m, tmp_path / "kv.safetensors", ["a"])
    assert tpk.checkpoint.read_info(tmp_path / "kv.safetensors").cache_lengths == [6]


def test_failed_load_leaves_the_live_cache_untouched(tmp_path):
    src = make()
    src.claim("a")
    run_step(src, ["a"], [[1] * 6], {"a": []})
    tpk.save_sequences(src, tmp_path / "kv.safetensors", ["a"])
    other = tpk.KVCacheParams(torch.float32, num_layers=2, num_kv_heads=2, head_dim=4, page_size=8)
    mismatched = KVCacheManager(tpk.PagedKVCacheCollection(other, 8, 2, 64))
    small = make(num_pages=1)
    for m, error in ((mismatched, tpk.CheckpointError), (small, OutOfPagesError)):
        m.claim("x")
        before = snapshot(m)
        with pytest.raises(error):
            tpk.load_sequences(m, tmp_path / "kv.safetensors")
        assert_same(before, snapshot(m))
    before = snapshot(small)
    for bad_ids in (["x"], ["y", "z"]):
        with pytest.raises(ValueError, match="^seq_ids:"):
            tpk.load_sequences(small, tmp_path / "kv.safetensors", bad_ids)
        assert_same(before, snapshot(small))
    with pytest.raises(ValueError, match="^seq_ids:"):
        tpk.save_sequences(src, tmp_path / "x.safetensors", ["nope"])


def test_load_failing_its_checksums_frees_its_pages(tmp_path):
    src = make()
    src.claim("a")
    run_step(src, ["a"], [[1] * 6], {"a": []})
    tpk.save_sequences(src, tmp_path / "kv.safetensors", ["a"])
    raw = bytearray((tmp_path / "kv.safetensors").read_bytes())
    raw[-3] ^= 0x10  # inside the stored pages: only the streaming load notices
    (tmp_path / "kv.safetensors").write_bytes(bytes(raw))
    m = make()
    m.claim("x")
    run_step(m, ["x"], [[2] * 5], {"x": []})
    live = m.pages("x")
    before = snapshot(m)
    with pytest.raises(tpk.CheckpointError, match="checksum mismatch"):
        tpk.load_sequences(m, tmp_path / "kv.safetensors")
    after = snapshot(m)
    for state in (before, after):  # pages no sequence holds may have been written: compare the rest
        state["device"][3] = state["device"][3][live]
    assert_same(before, after)


def test_fp8_scales_move_with_their_pages_through_fork_offload_restore_and_save_load(tmp_path):
    """Per-granule scales are page contents: forking copies a partial page's scales, offload/restore
    and save/load bring them back bit for bit, so attention over the sequence is unchanged."""
    params = tpk.KVCacheParams(
        torch.float8_e4m3fn, num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, quantization_granularity=4
    )
    m = KVCacheManager(tpk.PagedKVCacheCollection(params, num_pages=24, max_batch_size=4, max_seq_len=40))
    c = m.collection
    gen = torch.Generator().manual_seed(3)

    def step(ids, counts):
        plan = tpk.StepPlan.of(c, m.prepare_step(ids, counts))
        for layer in range(params.num_layers):
            rows = torch.randn(2, sum(counts), 2, 8, generator=gen) * 10 ** torch.randn(1, generator=gen)
            plan.store_kv(rows[0], rows[1], layer)
        m.commit_step()

    def attention(seq_id):
        lengths = torch.tensor([m.cache_length(seq_id)], dtype=torch.int32)
        table = torch.zeros(1, c.lookup_table.shape[1], dtype=torch.int32)
        table[0, : len(m.pages(seq_id))] = torch.tensor(m.pages(seq_id), dtype=torch.int32)
        q = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(0))
        offsets = torch.tensor([0, 1], dtype=torch.int32)
        return torch.cat([tpk.flash_attention(q, c.blocks, lengths - 1, table, offsets, layer, 0.4, scales=c.scales)
                          for layer in range(params.num_layers)])  # fmt: skip

    m.claim("a", list(range(10)))
    step(["a"], [10])
    m.fork("a", "b")  # 10 tokens: two full pages shared, the third (2 tokens) copied with its scales
    assert m.pages("a")[:2] == m.pages("b")[:2] and m.pages("a")[2] != m.pages("b")[2]
    assert torch.equal(c.scales[m.pages("a")[2]], c.scales[m.pages("b")[2]])
    step(["a", "b"], [3, 1])
    before = {i: attention(i) for i in ("a", "b")}
    private = m.pages("a")[2:]  # not in the prefix cache: freed by offload
    m.offload(["a"])
    m.release("b")
    m.claim("x", [9] * 30)
    step(["x"], [30])  # takes free pages and writes new values and scales there
    assert set(private) <= set(m.pages("x"))
    m.restore(["a"])
    assert torch.equal(attention("a"), before["a"])
    tpk.save_sequences(m, tmp_path / "a.safetensors", ["a"])
    other = KVCacheManager(tpk.PagedKVCacheCollection(params, num_pages=24, max_batch_size=4, max_seq_len=40))
    other.collection.scales.fill_(7.0)
    (loaded,) = tpk.load_sequences(other, tmp_path / "a.safetensors")
    c_a = attention("a")
    m, c = other, other.collection
    assert torch.equal(attention(loaded), c_a)


# -- reserve: sequences whose pages were filled from elsewhere -----------------------------------


def export(m: KVCacheManager, ids: list) -> tuple[list[int], list[list[int]], list, list, list[int]]:
    """What a sender ships: lengths, rows as indices into its distinct used pages, token ids, keys, the pages."""
    source: dict[int, int] = {}
    rows = []
    for i in ids:
        used = m.pages(i)[: -(-m.cache_length(i) // PS)]
        rows.append([source.setdefault(page, len(source)) for page in used])
    lengths = [m.cache_length(i) for i in ids]
    return lengths, rows, [m.token_ids(i) for i in ids], [m.prefix_keys(i) for i in ids], list(source)


def fill(src: KVCacheManager, source_pages: list[int], dst: KVCacheManager, reservation: Reservation) -> None:
    """Write the reserved pages: incoming page i is the sender's page `source_pages[i]`."""
    from_pages = torch.tensor([source_pages[i] for i in reservation.incoming], dtype=torch.long)
    dst.collection.blocks[torch.tensor(reservation.pages, dtype=torch.long)] = src.collection.blocks[from_pages]


def forked_source() -> tuple[KVCacheManager, dict]:
    src = make()
    model = {"a": [], "b": []}
    src.claim("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    src.claim("b")
    run_step(src, ["a", "b"], [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 4, 4]], model)
    src.fork("a", "c")  # shares a's two full pages
    model["c"] = list(model["a"])
    run_step(src, ["c"], [[0, 0]], model)
    return src, model


def test_reserve_then_commit_registers_filled_sequences_with_sharing_and_prefix_keys():
    src, model = forked_source()
    dst = make(num_pages=20)
    live = {"x": []}
    dst.claim("x")
    run_step(dst, ["x"], [[9] * 5], live)
    lengths, rows, tokens, keys, source_pages = export(src, ["c", "b", "a"])
    assert len(source_pages) == 5 and rows[0][:2] == rows[2][:2]  # a and c share two pages
    before = snapshot(dst)
    reservation = dst.reserve(["C", "B", "A"], lengths, rows, token_ids=tokens, prefix_keys=keys)
    assert_same(before, snapshot(dst))  # reserving takes nothing
    assert reservation.incoming == [0, 1, 2, 3, 4]
    assert reservation.pages == sorted(reservation.pages) and not set(reservation.pages) & set(dst.pages("x"))
    fill(src, source_pages, dst, reservation)
    reservation.commit()
    adopted = {"C": model["c"], "B": model["b"], "A": model["a"], **live}
    check_contents(dst, adopted, list(adopted))
    check_ownership(dst, adopted, set(adopted))
    assert dst.prefix_keys("A") == src.prefix_keys("a")
    assert dst.claim("y", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8  # the reserved prefix is in the cache
    run_step(dst, ["A", "C"], [[5], [6, 7]], adopted)  # and the sequences go on
    check_contents(dst, adopted, ["A", "C", "B"])


def test_reserve_shares_pages_already_cached_instead_of_filling_them():
    src, model = forked_source()
    dst = make(num_pages=20)
    dst.claim("p", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_step(dst, ["p"], [[1, 2, 3, 4, 5, 6, 7, 8, 9]], {"p": []})
    dst.release("p")  # its two full pages stay cached, evictable
    cached = dst.page_pool.page_of.copy()
    lengths, rows, tokens, keys, source_pages = export(src, ["a", "c"])
    with dst.reserve(["A", "C"], lengths, rows, token_ids=tokens, prefix_keys=keys) as reservation:
        assert reservation.incoming == [2, 3]  # the two shared prompt pages come from the cache
        fill(src, source_pages, dst, reservation)
        reservation.commit()
    assert dst.pages("A")[:2] == [cached[k] for k in keys[0]] == dst.pages("C")[:2]
    adopted = {"A": model["a"], "C": model["c"]}
    check_contents(dst, adopted, ["A", "C"])
    check_ownership(dst, adopted, {"A", "C"})
    # without keys (or with prefix caching off) nothing is shared, and nothing is cached
    other = make(num_pages=20, enable_prefix_caching=False)
    reservation = other.reserve(["A"], lengths[:1], rows[:1], prefix_keys=keys[:1])
    assert reservation.incoming == [0, 1, 2]
    fill(src, source_pages, other, reservation)
    reservation.commit()
    assert other.prefix_keys("A") == [] and other.num_cached_pages() == 0
    check_contents(other, {"A": model["a"]}, ["A"])


def test_an_open_reservation_locks_the_manager_until_commit_or_abort():
    src, model = forked_source()
    lengths, rows, tokens, keys, source_pages = export(src, ["a"])
    dst = make(num_pages=20)
    live = {"x": []}
    dst.claim("x")
    run_step(dst, ["x"], [[9] * 5], live)
    reservation = dst.reserve(["A"], lengths, rows, token_ids=tokens, prefix_keys=keys)
    before = snapshot(dst)
    for call in (
        lambda: dst.claim("y"),
        lambda: dst.release("x"),
        lambda: dst.fork("x", "y"),
        lambda: dst.prepare_step(["x"], [1]),
        lambda: dst.offload(["x"]),
        lambda: dst.reserve(["B"], lengths, rows),
    ):
        with pytest.raises(RuntimeError, match="reservation is open"):
            call()
        assert_same(before, snapshot(dst))
    assert dst.pages("x") and dst.cache_length("x") == 5  # queries still answer
    fill(src, source_pages, dst, reservation)
    reservation.commit()
    for again in (reservation.commit, reservation.abort):
        with pytest.raises(RuntimeError, match="already committed or aborted"):
            again()
    run_step(dst, ["x", "A"], [[1], [2]], {**live, "A": model["a"]})  # unlocked
    with dst.reserve(["B"], lengths, rows) as reservation:  # a block left without commit aborts
        pass
    assert not reservation.open and "B" not in dst.sequences
    dst.claim("y")
    with pytest.raises(ValueError, match="^page_rows:"):
        dst.reserve(["B"], lengths, [[0]])  # a refused reservation leaves nothing open
    dst.claim("z")


def test_aborted_reservations_leave_the_manager_unchanged():
    src, _ = forked_source()
    lengths, rows, tokens, keys, source_pages = export(src, ["c", "b", "a"])
    dst = make(num_pages=8)
    live = {"x": []}
    dst.claim("x", [7] * 9)
    run_step(dst, ["x"], [[7] * 9], live)  # 3 pages, 2 cached
    held = dst.pages("x")

    def failed(state):  # pages nobody holds or caches may have been written: compare the rest
        c_lengths, c_table, c_offsets, blocks = state["device"]
        return {**state, "device": [c_lengths, c_table, c_offsets, blocks[held]]}

    before = snapshot(dst)
    reservation = dst.reserve(["C", "B", "A"], lengths, rows, token_ids=tokens, prefix_keys=keys)
    with pytest.raises(RuntimeError, match="connection lost"), reservation:
        fill(src, source_pages, dst, reservation)
        raise RuntimeError("connection lost")
    assert_same(failed(before), failed(snapshot(dst)))
    with pytest.raises(OutOfPagesError, match="6 needed, 5 free, 0 evictable"):
        dst.reserve(["C", "B", "A", "D"], [*lengths, 1], [*rows, [5]])
    for bad, name in [
        (dict(seq_ids=["x", "B", "A"]), "seq_ids"),
        (dict(seq_ids=["C", "C", "A"]), "seq_ids"),
        (dict(cache_lengths=lengths[:2]), "cache_lengths"),
        (dict(cache_lengths=[9999, *lengths[1:]]), "cache_lengths"),
        (dict(page_rows=[rows[0], rows[1], rows[2][:-1]]), "page_rows"),
        (dict(page_rows=[[r + 1 for r in row] for row in rows]), "page_rows"),
        (dict(page_rows=[rows[0], rows[1], [*rows[2][:-1], rows[1][-1]]]), "page_rows"),  # partial page shared
        (dict(token_ids=tokens[:1]), "token_ids"),
        (dict(prefix_keys=[[b"short"], [], []]), "prefix_keys"),
        (dict(prefix_keys=[keys[0], [], keys[0][::-1]]), "prefix_keys"),  # one page, two keys
    ]:
        args = dict(seq_ids=["C", "B", "A"], cache_lengths=lengths, page_rows=rows, token_ids=tokens, prefix_keys=keys)
        with pytest.raises(ValueError, match=f"^{name}:"):
            dst.reserve(**{**args, **bad})
    assert_same(failed(before), failed(snapshot(dst)))


def test_an_abort_that_had_to_evict_drops_only_the_cache_entries_it_overwrote():
    src, model = forked_source()
    lengths, rows, tokens, keys, source_pages = export(src, ["a"])  # 3 pages
    dst = make(num_pages=5)
    dst.claim("x", [7] * 9)
    run_step(dst, ["x"], [[7] * 9], {"x": []})
    dst.release("x")  # 2 cached pages (evictable) + 3 free
    dst.claim("y")
    run_step(dst, ["y"], [[5] * 8], {"y": []})  # takes 2 free pages: 1 free, 2 evictable left

    before = snapshot(dst)
    dst.reserve(["A"], lengths, rows, token_ids=tokens, prefix_keys=keys).abort(0)  # nothing written yet
    assert_same(before, snapshot(dst))
    oldest = next(iter(dst.page_pool.evictable))
    dst.reserve(["A"], lengths, rows, token_ids=tokens, prefix_keys=keys).abort(2)  # the free page, the oldest cached
    assert oldest not in dst.page_pool.key_of and oldest in dst.page_pool.free
    assert dst.num_cached_pages() == 3 and dst.num_free_pages() == 3  # y holds two cached pages
    check_ownership(dst, {"y": [5] * 8}, {"y"})
    dst.reserve(["A"], lengths, rows, token_ids=tokens, prefix_keys=keys).abort()  # unknown: all it would evict
    assert dst.num_cached_pages() == 2 and dst.num_free_pages() == 3
    reservation = dst.reserve(["A"], lengths, rows, token_ids=tokens, prefix_keys=keys)
    fill(src, source_pages, dst, reservation)
    reservation.commit()
    check_contents(dst, {"A": model["a"], "y": [5] * 8}, ["A", "y"])
