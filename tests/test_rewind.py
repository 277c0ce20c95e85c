"""`KVCacheManager.rewind` and `accept` (speculative decoding) against independent models.

The randomized workload interleaves claims, steps, tree verify steps with `accept`, rewinds, forks,
releases, offloads and restores, and checks after each operation the pages, refcounts and prefix
keys (test_manager's model: K/V of a token is a function of its token prefix, so a page reused from
the prefix cache must hold what recomputing would). A tree token's K/V is that of its own path, so
after `accept` the sequence must hold exactly the K/V of the accepted path, and no key may name a
page whose contents are not that key's tokens. The oracle test compares `accept`'s pages bit for bit
with a manager that stored only the accepted tokens. With `max_rewind=R`, sliding-window groups keep
what going back R tokens needs: nothing within R is refused, the pages held are exactly those and
stay O(window + R + page), and a linear speculation on a sliding-window model gives plain greedy
decoding's tokens.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from test_manager import (
    PARAMS,
    PS,
    SLIDING,
    a_sliding_of,
    assert_same,
    chained_keys,
    check_contents,
    check_ownership,
    kv_rows,
    make,
    make_groups,
    pages_needed,
    restore_needed,
    run_step,
)
from test_manager import snapshot as manager_snapshot

import torch_paged_kv as tpk
from torch_paged_kv.manager import KVCacheManager, OutOfPagesError
from torch_paged_kv.testing import attention_fp64


def snapshot(m: KVCacheManager) -> dict:
    state = manager_snapshot(m)
    state["step_start"] = m.page_table.step_start.copy()
    state["device"] += [c.scales.clone() for c in m.collections if c.scales is not None]
    return state


def store(m: KVCacheManager, steps, rows: list[torch.Tensor]) -> None:
    """Store `rows[g]` (`[n, 2, layers, heads, head_dim]`, the step's new tokens) into group g."""
    steps = [steps] if isinstance(steps, tpk.StepTensors) else steps
    for c, step, kv in zip(m.collections, steps, rows, strict=True):
        p = c.params
        kv = kv.to(torch.float32 if p.quantized else p.dtype)  # FP8: the ops quantize
        for layer in range(p.num_layers):
            if p.is_mla:  # (an MLA pool: `[n, 1, layers, 1, kv_lora_rank + rope_dim]`)
                latent, rope = kv[:, 0, layer, 0, : p.kv_lora_rank], kv[:, 0, layer, 0, p.kv_lora_rank :]
                tpk.store_latent(latent.contiguous(), rope.contiguous(), c.blocks, *step, layer, scales=c.scales)
            else:
                k, v = (kv[:, plane, layer].contiguous() for plane in (0, 1))
                tpk.store_kv(k, v, c.blocks, *step, layer, scales=c.scales)


def path_of(parents: list[int], node: int) -> list[int]:
    """Tree indices from a root to `node` (increasing: a parent comes before its children)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_step(m: KVCacheManager, seq_id, model: dict, tokens: list[int], parents: list[int], ids: bool) -> None:
    """A verify step of a draft tree: token t at position L + t holds the K/V of its own path."""
    base = model[seq_id]
    steps = m.prepare_step([seq_id], [len(tokens)], [tokens] if ids else None)
    rows = []
    for g, c in enumerate(m.collections):
        per_token = []
        for t in range(len(tokens)):
            prefix = base + [tokens[j] for j in path_of(parents, t)]
            per_token.append(kv_rows(prefix, len(prefix) - 1, len(prefix), c.params, g))
        rows.append(torch.cat(per_token))
    store(m, steps, rows)
    m.commit_step()


def refused_by_window(m: KVCacheManager, peak: int, new: int) -> bool:
    """Whether some sliding-window group already dropped a page a sequence of `new` tokens needs, for a
    sequence whose longest length was `peak`: a group keeps the pages from `first_held_page(peak -
    max_rewind)` on (an empty sequence needs none)."""
    kept = max(peak - m.max_rewind, 0)
    return new > 0 and any(c.params.first_held_page(new) < c.params.first_held_page(kept) for c in m.collections)


def check_ids_and_keys(m: KVCacheManager, model: dict, ids: list) -> None:
    """Known token ids agree with the model; prefix keys are exactly the chained keys of its tokens."""
    for i in ids:
        known = m.token_ids(i)
        if known is not None:
            assert known[: len(model[i])] == model[i][: len(known)], i
        keys = m.prefix_keys(i)
        assert keys == chained_keys(model[i])[: len(keys)], i


def check_cache_keys(m: KVCacheManager, model: dict) -> None:
    """Every cached page of every group holds what its key names: claiming a model sequence's tokens
    hits only pages whose contents equal recomputed K/V (checked by claiming and reading back)."""
    for i in list(model):
        if len(model[i]) < PS + 1:
            continue
        probe = ("probe", i)
        if any(m.num_free_pages(g) == 0 for g in range(len(m.collections))):
            return
        m.claim(probe, model[i])
        probe_model = {probe: model[i][: m.cache_length(probe)]}
        check_contents(m, probe_model, [probe])
        m.release(probe)


# -- randomized workload ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups, max_rewind",
    [
        ("one group", 0),
        ("full + sliding", 0),
        ("two sliding + full", 0),
        ("full + sliding", 7),
        ("two sliding + full", 5),
        ("sliding, another window", 8),
    ],
)
def test_random_speculative_workload_against_model(groups, max_rewind):
    """With `max_rewind=R`, a tree step of at most R tokens is always accepted and a rewind to no fewer
    than (longest length - R) tokens always runs; beyond, what was dropped is refused, unchanged."""
    rng = random.Random(39 + max_rewind)
    m = make_groups(groups, num_pages=40, max_batch=6, max_seq_len=40, max_rewind=max_rewind)
    assert m.max_rewind == max_rewind
    group_range = range(len(m.collections))
    model: dict = {}
    peaks: dict = {}  # the longest each sequence has been (what its sliding groups keep pages for)
    on_device: set = set()
    bases = [[rng.randrange(3) for _ in range(30)] for _ in range(3)]
    next_id, counts = 0, {}

    def refuse(call, error, match):
        before = snapshot(m)
        with pytest.raises(error, match=match):
            call()
        assert_same(before, snapshot(m))

    for op_index in range(1500):
        op = rng.choices(
            ["claim", "step", "tree", "rewind", "fork", "release", "offload", "restore"], [3, 4, 5, 4, 1, 2, 1, 1]
        )[0]
        live = sorted(on_device)
        if op == "claim" and len(model) < 10:
            prompt = [*bases[rng.randrange(3)][: rng.randrange(0, 20)], rng.randrange(3)]
            reused = m.claim(next_id, prompt)
            model[next_id] = prompt[:reused]
            peaks[next_id] = reused
            on_device.add(next_id)
            next_id += 1
            if reused < len(prompt) and pages_needed(model, [next_id - 1], [len(prompt) - reused]) <= min(
                m.num_free_pages(g) for g in group_range
            ):
                run_step(m, [next_id - 1], [prompt[reused:]], model)
                peaks[next_id - 1] = len(prompt)
        elif op == "step" and live:
            i = rng.choice(live)
            news = [rng.randrange(3) for _ in range(rng.randint(1, 3))]
            if len(model[i]) + len(news) > m.max_seq_len or pages_needed(model, [i], [len(news)]) > min(
                m.num_free_pages(g) for g in group_range
            ):
                continue
            run_step(m, [i], [news], model, pass_tokens=rng.random() < 0.8)
            peaks[i] = max(peaks[i], len(model[i]))
        elif op == "tree" and live:
            i = rng.choice(live)
            n = rng.randint(1, 7)
            if len(model[i]) + n > m.max_seq_len or pages_needed(model, [i], [n]) > min(
                m.num_free_pages(g) for g in group_range
            ):
                continue
            parents = [-1] + [rng.randrange(-1, t) for t in range(1, n)]
            tokens = [rng.randrange(3) for _ in range(n)]
            leaf = rng.randrange(-1, n)
            kept = [] if leaf < 0 else path_of(parents, leaf)
            accepted = model[i] + [tokens[j] for j in kept]
            peaks[i] = max(peaks[i], len(model[i]) + n)
            refused = refused_by_window(m, peaks[i], len(accepted))
            assert not (refused and n <= max_rewind)  # the model itself: within R nothing is refused
            # a step with (tree-order) ids keys its full pages: accept takes those keys back; a step
            # whose accept will be refused runs without ids (docs/manager.md), the sequence is dropped
            tree_step(m, i, model, tokens, parents, ids=not refused and rng.random() < 0.7)
            given = [tokens[j] for j in kept] if rng.random() < 0.3 else None
            if refused:
                match = f"^kept:.*dropped.*max_rewind={max_rewind}"
                refuse(lambda i=i, kept=kept, given=given: m.accept(i, kept, given), ValueError, match)
                m.release(i)
                del model[i], peaks[i]
                on_device.discard(i)
                op = "refused"
            else:
                m.accept(i, kept, given)
                model[i] = accepted
                peaks[i] = peaks[i] if accepted else 0
                refuse(lambda i=i: m.accept(i, []), ValueError, "^seq_id:.*no committed step")
        elif op == "rewind" and live:
            i = rng.choice(live)
            n = rng.randint(0, min(len(model[i]), 9))
            new = len(model[i]) - n
            if refused_by_window(m, peaks[i], new):
                assert new < peaks[i] - max_rewind  # the model itself: within R nothing is refused
                match = f"^n:.*already dropped.*max_rewind={max_rewind}"
                refuse(lambda i=i, n=n: m.rewind(i, n), ValueError, match)
                op = "refused"
            else:
                before = snapshot(m)
                try:
                    m.rewind(i, n)
                except OutOfPagesError:
                    assert_same(before, snapshot(m))
                    op = "oom"
                else:
                    model[i] = model[i][:new]
                    peaks[i] = peaks[i] if new else 0
                    if n == 0:
                        assert_same(before, snapshot(m))
        elif op == "fork" and live and len(model) < 10:
            parent = rng.choice(live)
            if len(model[parent]) % PS and any(m.num_free_pages(g) == 0 for g in group_range):
                continue
            m.fork(parent, next_id)
            model[next_id] = list(model[parent])
            peaks[next_id] = peaks[parent]
            on_device.add(next_id)
            next_id += 1
        elif op == "release" and model:
            i = rng.choice(sorted(model))
            m.release(i)
            del model[i], peaks[i]
            on_device.discard(i)
        elif op == "offload" and live:
            i = rng.choice(live)
            m.offload([i])
            on_device.discard(i)
        elif op == "restore" and len(model) > len(on_device):
            i = next(i for i in sorted(model) if i not in on_device)
            if any(restore_needed(m, model, [i], g, peaks) > m.num_free_pages(g) for g in group_range):
                continue
            m.restore([i])
            on_device.add(i)
        else:
            continue
        counts[op] = counts.get(op, 0) + 1
        assert sorted(m.sequences) == sorted(model)
        check_ownership(m, model, on_device, peaks)
        check_ids_and_keys(m, model, sorted(on_device))
        if op_index % 5 == 0:
            check_contents(m, model, sorted(on_device))
            check_cache_keys(m, {i: model[i] for i in on_device})
    check_contents(m, model, sorted(on_device))
    assert all(counts.get(op, 0) >= 15 for op in ("tree", "rewind", "claim", "fork", "offload", "restore")), counts
    if groups != "one group":
        assert counts.get("refused", 0) >= 5, counts


# -- the oracle: only the accepted tokens stored --------------------------------------------------

ORACLE = dataclasses.replace(PARAMS, head_dim=8, page_size=8)
LAYOUTS = {  # window 6: after 20 + 6 tokens the group holds page 2 on, as after 21..26 (not 20)
    "full": lambda p: ([p], [[0, 1]]),
    "full + sliding": lambda p: ([p, dataclasses.replace(p, num_layers=1, sliding_window=6)], [[0, 2], [1]]),
    "full + sliding, max_rewind=6": lambda p: LAYOUTS["full + sliding"](p),  # keeps page 1 on: nothing refused
    "mla": lambda p: ([_mla_like(p)], [[0, 1]]),
}


def _mla_like(p: tpk.KVCacheParams) -> tpk.KVCacheParams:
    """An MLA cache (latent 16, rope 8) of `p`'s dtype and quantization."""
    quant = {"quantization_granularity": p.quantization_granularity} if p.has_scales_tensor else {}
    if p.static_scales is not None:
        quant = {"static_scales": p.static_scales[:1]}
    return tpk.KVCacheParams.mla(p.dtype, 2, p.page_size, kv_lora_rank=16, rope_dim=8, **quant)


def _row_width(p: tpk.KVCacheParams) -> int:
    """Elements of a token's row given to the store op (an MLA row: latent then rope, in float)."""
    return p.kv_lora_rank + p.rope_dim if p.is_mla else p.head_dim


DTYPES = {
    "fp32": {"dtype": torch.float32},
    "bf16": {"dtype": torch.bfloat16},
    "fp8 per granule": {"dtype": torch.float8_e4m3fn, "quantization_granularity": 4},
    "fp8 static": {"dtype": torch.float8_e4m3fn, "static_scales": (0.05, 0.07)},
}


def _positions(m: KVCacheManager, seq_id, g: int, start: int, stop: int) -> list[torch.Tensor]:
    """The rows of positions start..stop-1 of `seq_id` in group g, of every page tensor (raw bytes)."""
    c = m.collections[g]
    ps = c.params.page_size
    pages = m.pages(seq_id, g)
    page = torch.tensor([pages[p // ps] for p in range(start, stop)], dtype=torch.long)
    offset = torch.arange(start, stop) % ps
    return [(t.view(torch.uint8) if t.element_size() == 1 else t)[page, :, :, offset].clone() for t in c.page_tensors()]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accept_holds_bit_for_bit_what_storing_only_the_path_holds(layout, dtype):
    params, layers = LAYOUTS[layout](dataclasses.replace(ORACLE, **DTYPES[dtype]))
    max_rewind = 6 if layout.endswith("max_rewind=6") else 0
    gen = torch.Generator().manual_seed(7)
    prompt_len, tokens = 20, 6
    kv = [
        torch.randn(prompt_len + tokens, p.num_planes, p.num_layers, p.num_kv_heads, _row_width(p), generator=gen)
        for p in params
    ]
    for kept in ([0, 1, 3, 5], [0, 2, 4], [5], [3, 1], [0, 1, 2, 3, 4, 5], []):
        managers = []
        for _ in range(2):
            groups = tpk.LayerGroups.allocate(params, layers, [16] * len(params), 2, 32)
            m = KVCacheManager(groups, max_rewind=max_rewind)
            m.claim("s")
            store(m, m.prepare_step(["s"], [prompt_len]), [x[:prompt_len] for x in kv])
            m.commit_step()
            managers.append(m)
        spec, plain = managers
        store(spec, spec.prepare_step(["s"], [tokens]), [x[prompt_len:] for x in kv])  # tree order
        spec.commit_step()
        if not kept and layout == "full + sliding":  # 20 tokens need page 1 of the sliding group, dropped at 26
            before = snapshot(spec)
            with pytest.raises(ValueError, match="^kept:.*layer group 1"):
                spec.accept("s", kept)
            assert_same(before, snapshot(spec))
            continue
        spec.accept("s", kept)
        rows = torch.tensor([prompt_len + j for j in kept], dtype=torch.long)
        if kept:
            store(plain, plain.prepare_step(["s"], [len(kept)]), [x[rows] for x in kv])
            plain.commit_step()
        length = prompt_len + len(kept)
        assert spec.cache_length("s") == plain.cache_length("s") == length
        for g, p in enumerate(params):
            pages = spec.pages("s", g)  # from the first page held (max_rewind keeps some below the window)
            first = next(j for j, page in enumerate(pages) if page != tpk.NULL_PAGE) * p.page_size
            assert 0 < first <= p.first_held_page(length) * p.page_size or p.sliding_window is None
            got, want = (_positions(x, "s", g, first, length) for x in (spec, plain))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (kept, g)
            assert [x == tpk.NULL_PAGE for x in pages] == [x == tpk.NULL_PAGE for x in plain.pages("s", g)]
        assert [pool.in_use() for pool in spec.page_pools] == [pool.in_use() for pool in plain.page_pools]


# -- rewind rules -------------------------------------------------------------------------------


def test_rewind_gives_back_emptied_pages_and_only_unrefs_shared_ones():
    m = make()
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]], model)  # pages 0..3, page 3 partial
    m.fork("a", "b")
    model["b"] = list(model["a"])
    pages, free = m.pages("a"), m.num_free_pages()
    m.rewind("a", 6)  # 7 tokens: pages 0, 1 (partial, shared with b: copied)
    model["a"] = model["a"][:7]
    assert m.pages("a")[0] == pages[0] and m.pages("a")[1] != pages[1] and len(m.pages("a")) == 2
    assert m.num_free_pages() == free + 1 - 1  # a's private partial page 3 freed, one copy taken
    assert m.page_pool.refcounts[pages[2]] == 1 and m.page_pool.refcounts[pages[1]] == 1  # b's now
    check_ownership(m, model, {"a", "b"})
    check_contents(m, model, ["a", "b"])
    run_step(m, ["a"], [[7, 7, 7]], model)  # writes into a's copy: b never sees it
    check_contents(m, model, ["a", "b"])
    m.rewind("b", 13)
    model["b"] = []
    assert m.pages("b") == [] and m.cache_length("b") == 0 and m.prefix_keys("b") == []
    check_ownership(m, model, {"a", "b"})
    run_step(m, ["b"], [[4, 4, 4, 4, 4]], model)
    check_contents(m, model, ["a", "b"])


def test_rewind_into_a_published_page_unpublishes_it_or_copies_it():
    m = make()
    model = {"a": []}
    prompt = [5, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    m.claim("a", prompt)
    run_step(m, ["a"], [prompt], model)  # pages 0, 1 keyed
    page1 = m.pages("a")[1]
    assert m.num_cached_pages() == 2 and page1 in m.page_pool.key_of
    m.rewind("a", 4)  # 6 tokens: page 1 partial, only a holds it: unpublished, kept in place
    model["a"] = model["a"][:6]
    assert m.pages("a")[1] == page1 and page1 not in m.page_pool.key_of and m.num_cached_pages() == 1
    assert m.prefix_keys("a") == chained_keys(model["a"]) and m.token_ids("a") == model["a"]
    assert m.claim("x", prompt) == 4  # the old prompt hits page 0 only
    m.release("x")
    run_step(m, ["a"], [[0, 0]], model)  # page 1 full again, keyed anew under its new tokens
    assert m.prefix_keys("a") == chained_keys(model["a"]) and page1 in m.page_pool.key_of
    assert m.claim("y", prompt) == 4 and m.claim("z", model["a"] + [1]) == 8
    model["z"] = model["a"][:8]
    m.rewind("a", 3)  # page 1 held by z too: a gets a copy, z's page stays keyed and unchanged
    model["a"] = model["a"][:5]
    assert m.pages("a")[1] != page1 and m.pages("z")[1] == page1 and page1 in m.page_pool.key_of
    run_step(m, ["a"], [[2, 2, 2]], model)
    check_contents(m, model, ["a", "z"])
    check_ownership(m, {**model, "y": [5, 1, 2, 3]}, {"a", "y", "z"})


def test_a_rewind_that_needs_a_copy_and_finds_no_page_changes_nothing():
    m = make(num_pages=3)
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3, 4, 5, 6, 7, 8]], model)  # pages 0, 1, keyed
    assert m.claim("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8  # shares both
    model["b"] = model["a"][:8]
    run_step(m, ["b"], [[0]], model)  # b's own third page: the pool is full
    before = snapshot(m)
    with pytest.raises(OutOfPagesError, match="1 needed, 0 free"):
        m.rewind("a", 2)  # page 1 shared with b: copy-on-write needs a page
    assert_same(before, snapshot(m))
    m.rewind("b", 3)  # b's page 2 goes back first, then its copy of page 1 takes it
    model["b"] = model["b"][:6]
    assert m.pages("b")[1] != m.pages("a")[1] and m.num_free_pages() == 0
    check_ownership(m, model, {"a", "b"})
    check_contents(m, model, ["a", "b"])


def test_a_sliding_group_refuses_to_rewind_past_the_pages_it_dropped():
    m = make_groups("full + sliding", 16, 2, 40)  # window 6, page size 4
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [list(range(14))], model)  # the sliding group holds page 2 on (positions 9..)
    assert m.pages("a", 1)[:2] == [tpk.NULL_PAGE] * 2 and SLIDING.first_held_page(14) == 2
    before = snapshot(m)
    for n in (2, 5, 13):  # 12 tokens need positions 7.. (page 1): dropped
        with pytest.raises(ValueError, match="^n:.*layer group 1 .*already dropped"):
            m.rewind("a", n)
        assert_same(before, snapshot(m))
    m.rewind("a", 1)  # 13 tokens need positions 8..: page 2 on, held
    model["a"] = model["a"][:13]
    check_ownership(m, model, {"a"})
    check_contents(m, model, ["a"])
    m.rewind("a", 13)  # an empty sequence needs no page
    assert m.pages("a", 1) == [] and m.pages("a", 0) == []
    model["a"] = []
    check_ownership(m, model, {"a"})


# -- max_rewind: a sliding group keeps what a rewind needs ---------------------------------------


def random_tree(rng: random.Random, n: int) -> tuple[list[int], list[int], list[int]]:
    """Tokens, parents (tree order) and a random root-to-node path (possibly empty) of n nodes."""
    parents = [-1] + [rng.randrange(-1, t) for t in range(1, n)]
    leaf = rng.randrange(-1, n)
    return [rng.randrange(3) for _ in range(n)], parents, [] if leaf < 0 else path_of(parents, leaf)


@pytest.mark.parametrize("max_rewind", [3, 8])
def test_verify_steps_on_a_sliding_group_are_accepted_within_max_rewind(max_rewind):
    """#39's defect: a verify step of k drafts moves a sliding window past a page boundary, the page
    went back at commit, and accept of fewer tokens was refused. With `max_rewind >= k` every accept
    and every rewind back to (longest length - max_rewind) runs, the contents are those of the kept
    tokens, and the group holds O(window + max_rewind + page) pages; beyond, the refusal is unchanged."""
    rng = random.Random(max_rewind)
    m = make_groups("full + sliding", 40, 2, 64, max_rewind=max_rewind)  # window 6, page 4
    model, peaks = {"a": []}, {"a": 0}
    m.claim("a")
    run_step(m, ["a"], [[rng.randrange(3) for _ in range(9)]], model)
    peaks["a"] = 9
    steps = rewinds = crossed = 0
    while len(model["a"]) + max_rewind <= 56:
        tokens, parents, kept = random_tree(rng, rng.randint(1, max_rewind))
        length = len(model["a"])
        tree_step(m, "a", model, tokens, parents, ids=False)
        peaks["a"] = max(peaks["a"], length + len(tokens))
        crossed += SLIDING.first_held_page(length + len(tokens)) > SLIDING.first_held_page(length + len(kept))
        m.accept("a", kept, [tokens[j] for j in kept])
        model["a"] += [tokens[j] for j in kept]
        steps += 1
        if rng.random() < 0.3:  # a rewind back to no fewer than (longest - max_rewind) tokens
            n = rng.randint(0, len(model["a"]) - max(peaks["a"] - max_rewind, 1))
            m.rewind("a", n)
            model["a"] = model["a"][: len(model["a"]) - n]
            rewinds += 1
        check_contents(m, model, ["a"])
        check_ownership(m, model, {"a"}, peaks)
    assert steps >= 15 and rewinds >= 3 and crossed >= 5, (steps, rewinds, crossed)  # R = 0 refuses `crossed`
    low = peaks["a"] - max_rewind  # beyond: the pages of shorter lengths went back to the pool
    new = max(x for x in range(1, low) if SLIDING.first_held_page(x) < SLIDING.first_held_page(low))
    before = snapshot(m)
    with pytest.raises(ValueError, match=f"^n:.*layer group 1 .*already dropped.*max_rewind={max_rewind}"):
        m.rewind("a", len(model["a"]) - new)
    assert_same(before, snapshot(m))
    m.rewind("a", len(model["a"]) - low)
    model["a"] = model["a"][:low]
    check_contents(m, model, ["a"])
    check_ownership(m, model, {"a"}, peaks)


def test_without_max_rewind_the_verify_step_that_crosses_a_page_is_refused():
    """The same kind of step with the default `max_rewind=0`: the window's page is gone."""
    m = make_groups("full + sliding", 40, 2, 64)
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1] * 13], model)  # 13 - 6 + 1 = 8: the sliding group holds page 2 on
    tree_step(m, "a", model, [2, 2, 2, 2], [-1, 0, 1, 2], ids=False)  # 17 tokens: page 2 leaves (12..)
    before = snapshot(m)
    with pytest.raises(ValueError, match="^kept:.*layer group 1 .*already dropped.*max_rewind=0"):
        m.accept("a", [0])  # 14 tokens need positions 9.. (page 2)
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("max_rewind", [0, 5])
def test_a_prefix_hit_keeps_the_pages_a_rewind_of_max_rewind_needs(max_rewind):
    """A hit of h pages needs, in a sliding group, the pages from `first_held_page(h * page_size -
    max_rewind)` on, as a commit keeps them; one of them evicted, the hit shrinks."""
    groups = tpk.LayerGroups.allocate([PARAMS, SLIDING], [[0, 2], [1]], [30, 8], 4, 40)
    m = KVCacheManager(groups, max_rewind=max_rewind)
    prompt = list(range(1, 25))  # 24 tokens: 6 pages, all keyed in both groups
    model = {"a": []}
    m.claim("a", prompt)
    run_step(m, ["a"], [prompt], model)
    m.release("a")
    del model["a"]
    model["c"] = []  # the sliding group's LRU order: prompt pages 0, 1, 2 (dropped at commit), 5, 4, 3
    m.claim("c")
    run_step(m, ["c"], [[7] * 16], model)  # 4 sliding pages: the 2 free ones, then prompt pages 0 and 1
    assert a_sliding_of(m, prompt, range(6)) == [None, None, *a_sliding_of(m, prompt, range(2, 6))]
    assert None not in a_sliding_of(m, prompt, range(2, 6))
    # 16 tokens: pages 2, 3 (positions 11..15); with max_rewind 5 also page 1 (what 11 tokens need): gone
    assert m.claim("b", prompt[:17]) == (16 if max_rewind == 0 else 0)
    m.release("b")
    assert m.claim("d", prompt[:21]) == 20  # pages 3, 4 (15..19); with max_rewind also page 2 (10..)
    first = SLIDING.first_held_page(20 - max_rewind)
    assert m.pages("d", 1) == [tpk.NULL_PAGE] * first + a_sliding_of(m, prompt, range(first, 5))
    model["d"] = prompt[:20]
    peaks = {"c": 16, "d": 21}
    run_step(m, ["d"], [prompt[20:21]], model)
    check_contents(m, model, ["c", "d"])
    check_ownership(m, model, {"c", "d"}, peaks)
    if max_rewind:
        m.rewind("d", max_rewind)  # 16 tokens: positions 11.. (page 2), kept with the hit
        model["d"] = model["d"][:16]
        check_contents(m, model, ["c", "d"])
        check_ownership(m, model, {"c", "d"}, peaks)


def test_offload_restore_and_save_load_of_a_sequence_with_a_rewind_margin(tmp_path):
    """Offload keeps the margin pages, restore puts them back (a rewind into them still runs); a
    checkpoint stores only the window, and the loaded sequence (null below it) steps and accepts."""
    m = make_groups("full + sliding", 40, 2, 64, max_rewind=6)
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 0, 1, 2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2, 2, 0, 1, 2, 0, 1]], model)  # 21 tokens
    first = SLIDING.first_held_page(21 - 6)  # page 2 (positions 10..): 15 tokens need it
    held = m.pages("a", 1)
    assert held[:first] == [tpk.NULL_PAGE] * first and tpk.NULL_PAGE not in held[first:]
    m.offload(["a"])
    m.restore(["a"])
    assert [p == tpk.NULL_PAGE for p in m.pages("a", 1)] == [p == tpk.NULL_PAGE for p in held]
    check_contents(m, model, ["a"])
    check_ownership(m, model, {"a"}, {"a": 21})
    tpk.save_sequences(m, tmp_path / "a.safetensors", ["a"])
    m.rewind("a", 6)
    model["a"] = model["a"][:15]
    check_contents(m, model, ["a"])
    groups = m.groups
    loaded = KVCacheManager(tpk.LayerGroups.allocate(groups.params, groups.layers, [40, 26], 2, 64), max_rewind=6)
    (b,) = tpk.load_sequences(loaded, tmp_path / "a.safetensors", ["b"])
    window = SLIDING.first_held_page(21)
    pages = loaded.pages(b, 1)
    assert pages[:window] == [tpk.NULL_PAGE] * window and tpk.NULL_PAGE not in pages[window:]
    loaded_model = {"b": [1, 2, 0, 1, 2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2, 2, 0, 1, 2, 0, 1]}
    tree_step(loaded, "b", loaded_model, [2, 0, 1, 1], [-1, 0, -1, 2], ids=False)  # back to 21: held
    loaded.accept("b", [2, 3], [1, 1])
    loaded_model["b"] += [1, 1]
    check_contents(loaded, loaded_model, ["b"])


def test_max_rewind_must_be_an_int_of_at_least_zero():
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="^max_rewind:"):
            make(max_rewind=bad)
    assert make(max_rewind=np.int64(3)).max_rewind == 3


class WindowModel:
    """A tiny two-layer attention model whose layer 1 attends over a window of 5 (layer 0: every key):
    `logits(tokens)` without a cache (fp64 attention on contiguous K/V, the oracle), `step(...)` over a
    manager's groups (paged `store_kv` / `flash_attention`)."""

    WINDOW, VOCAB, DIM, HEADS, HEAD_DIM = 5, 24, 16, 2, 8
    CHUNK = -1  # layer 0's attention_chunk_size

    def masks(self, layer: int) -> dict:
        """Layer `layer`'s window or chunk options."""
        return {"sliding_window": self.WINDOW} if layer == 1 else {"attention_chunk_size": self.CHUNK}

    def __init__(self, seed: int, noise: float = 0.0, base: WindowModel | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        d, hd = self.DIM, self.HEADS * self.HEAD_DIM

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / shape[0] ** 0.5

        self.emb, self.pos, self.out = rand(self.VOCAB, d) * 4, rand(64, d) * 4, rand(d, self.VOCAB)
        self.qkv, self.o = [rand(d, 3 * hd) for _ in range(2)], [rand(hd, d) for _ in range(2)]
        if base is not None:  # a draft: the base model, perturbed
            for name in ("emb", "pos", "out", "qkv", "o"):
                mine, theirs = getattr(self, name), getattr(base, name)
                if isinstance(mine, list):
                    setattr(self, name, [t + noise * m for t, m in zip(theirs, mine, strict=True)])
                else:
                    setattr(self, name, theirs + noise * mine)

    def _layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        for layer in range(2):
            q, k, v = (t.unflatten(-1, (self.HEADS, self.HEAD_DIM)) for t in (x @ self.qkv[layer]).chunk(3, -1))
            x = x + attend(layer, q, k, v).flatten(1) @ self.o[layer]
        return x @ self.out

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Every position's logits, no cache: fp64 attention on the whole sequence (the oracle)."""
        x = self.emb[tokens] + self.pos[: len(tokens)]

        def attend(layer, q, k, v):
            return attention_fp64(q, [k], [v], [0], self.HEAD_DIM**-0.5, **self.masks(layer)).float()

        return self._layers(x, attend)

    def step(self, m: KVCacheManager, seq_id, tokens: list[int]) -> torch.Tensor:
        """The logits of a step of `tokens` after `seq_id`'s cached ones, through the manager's pages."""
        start = m.cache_length(seq_id)
        steps = m.prepare_step([seq_id], [len(tokens)], [tokens])
        x = self.emb[tokens] + self.pos[start : start + len(tokens)]

        return self._paged(m, steps, x)

    def tree_step(self, m: KVCacheManager, seq_id, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """The logits of a tree verify step (`tokens` in tree order, `parents` -1 for a root) after
        `seq_id`'s cached ones: each node at the position of its depth, seeing its ancestors."""
        start = m.cache_length(seq_id)
        paths = [path_of(parents, t) for t in range(len(tokens))]
        bits = [sum(1 << i for i in path) for path in paths]
        x = self.emb[tokens] + self.pos[[start + len(path) - 1 for path in paths]]
        steps = m.prepare_step([seq_id], [len(tokens)])  # no ids: a tree's pages are no causal prefix
        return self._paged(m, steps, x, torch.tensor(bits, dtype=torch.int64))

    def _paged(self, m: KVCacheManager, steps, x: torch.Tensor, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        def attend(layer, q, k, v):
            c, step = m.collections[layer], steps[layer]
            tpk.store_kv(k.contiguous(), v.contiguous(), c.blocks, *step, 0)
            return tpk.flash_attention(
                q.contiguous(), c.blocks, *step, 0, self.HEAD_DIM**-0.5, tree_mask=tree_mask, **self.masks(layer)
            )

        out = self._layers(x, attend)
        m.commit_step()
        return out


def test_linear_speculation_on_a_sliding_window_model_gives_plain_greedy_tokens():
    """Draft k tokens, verify them in one step, rewind the rejected ones: with `max_rewind=k` on a cache
    whose layer 1 is a sliding-window group (window 5, page 4), the tokens are plain greedy decoding's
    (recomputed without a cache), and rewinds run where the window's page already moved on."""
    k = 3
    target = WindowModel(0)
    draft = WindowModel(1, noise=0.6, base=target)
    full = tpk.KVCacheParams(torch.float32, 1, WindowModel.HEADS, WindowModel.HEAD_DIM, page_size=4)
    sliding = dataclasses.replace(full, sliding_window=WindowModel.WINDOW)
    m = KVCacheManager(tpk.LayerGroups.allocate([full, sliding], [[0], [1]], [24, 8], 1, 64), max_rewind=k)
    prompt = [3, 17, 5, 9, 21, 2, 11]
    m.claim("s", prompt)
    out = [int(target.step(m, "s", prompt)[-1].argmax())]
    kept = crossed = 0
    while len(out) < 30:
        context = prompt + out
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(int(draft.logits(context + drafts)[-1].argmax()))
        length = m.cache_length("s")
        greedy = target.step(m, "s", [out[-1], *drafts]).argmax(-1).tolist()
        j = next((i for i in range(k) if drafts[i] != greedy[i]), k)
        m.rewind("s", k - j)
        crossed += sliding.first_held_page(length + 1 + k) > sliding.first_held_page(length + 1 + j)
        out += [*drafts[:j], greedy[j]]
        kept += j
        assert len(m.pages("s", 1)) - m.pages("s", 1).count(tpk.NULL_PAGE) <= (WindowModel.WINDOW - 1 + k) // 4 + 2
    expected: list[int] = []
    for _ in range(len(out)):
        expected.append(int(target.logits(prompt + expected)[-1].argmax()))
    assert out == expected
    assert 0 < kept < k * len(out) and crossed >= 2, (kept, crossed)  # max_rewind=0 refuses `crossed` rewinds


class NarrowModel(WindowModel):
    """WindowModel with a window of 2 (layer 1) and chunks of 4 (layer 0): a tree's paths of 3 or 4
    nodes cross both."""

    WINDOW, CHUNK = 2, 4


def draft_tree(draft: WindowModel, context: list[int]) -> tuple[list[int], list[int]]:
    """Tokens and parents of a tree rooted at `context[-1]`: the draft's top 2, top 2, then top 1 at
    each level below (11 nodes, depth 4)."""
    tokens, parents, level = [context[-1]], [-1], [0]
    for width in (2, 2, 1):
        below = []
        for node in level:
            logits = draft.logits(context + [tokens[i] for i in path_of(parents, node)[1:]])[-1]
            for token in logits.topk(width).indices.tolist():
                tokens.append(token)
                parents.append(node)
                below.append(len(tokens) - 1)
        level = below
    return tokens, parents


@pytest.mark.parametrize("backend", ["reference", "cpu"])  # (Triton: head_dim >= 16)
def test_tree_speculation_on_window_and_chunked_layers_gives_plain_greedy_tokens(force_backend, backend):
    """Verify a draft tree in one step and `accept` the path the target agrees with, on a cache whose
    layer 1 is a sliding-window group (window 2, page 4) and layer 0 attends in chunks of 4: every
    node's logits are those of its path recomputed without a cache (so its window and chunk were
    measured from its depth), and the tokens are plain greedy decoding's."""
    force_backend(backend)
    target = NarrowModel(0)
    draft = NarrowModel(1, noise=0.6, base=target)
    full = tpk.KVCacheParams(torch.float32, 1, WindowModel.HEADS, WindowModel.HEAD_DIM, page_size=4)
    sliding = dataclasses.replace(full, sliding_window=NarrowModel.WINDOW)
    m = KVCacheManager(tpk.LayerGroups.allocate([full, sliding], [[0], [1]], [24, 12], 1, 64), max_rewind=10)
    prompt = [3, 17, 5, 9, 21, 2, 11]
    m.claim("s", prompt)
    out = [int(target.step(m, "s", prompt)[-1].argmax())]
    kept = 0
    while len(out) < 24:
        context = prompt + out
        tokens, parents = draft_tree(draft, context)
        logits = target.tree_step(m, "s", tokens, parents)
        for node in range(len(tokens)):  # each node: its path's logits
            path = context[:-1] + [tokens[i] for i in path_of(parents, node)]
            torch.testing.assert_close(logits[node], target.logits(path)[-1], atol=1e-4, rtol=1e-4)
        greedy = logits.argmax(-1).tolist()
        path = [0]
        while child := [c for c in range(len(tokens)) if parents[c] == path[-1] and tokens[c] == greedy[path[-1]]]:
            path.append(child[0])
        m.accept("s", path, [tokens[i] for i in path])
        out += [*(tokens[i] for i in path[1:]), greedy[path[-1]]]
        kept += len(path) - 1
    expected: list[int] = []
    for _ in range(len(out)):
        expected.append(int(target.logits(prompt + expected)[-1].argmax()))
    assert out == expected
    assert kept > 0


# -- errors ---------------------------------------------------------------------------------------


def test_errors_name_the_argument_and_change_nothing():
    m = make(max_batch=2)
    model = {"a": [], "b": [], "off": []}
    m.claim("a")
    m.claim("b")
    run_step(m, ["a", "b"], [[1, 2, 3, 4, 5], [6]], model)
    m.claim("off")
    run_step(m, ["off"], [[1]], model)
    m.offload(["off"])
    before = snapshot(m)
    bad = [
        (lambda: m.rewind("a", 6), "n"),
        (lambda: m.rewind("a", -1), "n"),
        (lambda: m.rewind("a", 1.0), "n"),
        (lambda: m.rewind("a", True), "n"),
        (lambda: m.rewind("a", None), "n"),
        (lambda: m.rewind("x", 1), "seq_id"),
        (lambda: m.rewind(["a"], 1), "seq_id"),
        (lambda: m.rewind("off", 1), "seq_id"),
        (lambda: m.accept("a", [5]), "kept"),
        (lambda: m.accept("a", [-1]), "kept"),
        (lambda: m.accept("a", [0, 0]), "kept"),
        (lambda: m.accept("a", [0.0]), "kept"),
        (lambda: m.accept("a", [True]), "kept"),
        (lambda: m.accept("a", 3), "kept"),
        (lambda: m.accept("a", [0, 1], [1]), "token_ids"),
        (lambda: m.accept("a", [0], ["x"]), "token_ids"),
        (lambda: m.accept("x", [0]), "seq_id"),
        (lambda: m.accept("off", [0]), "seq_id"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=f"^{name}:"):
            call()
        assert_same(before, snapshot(m))
    m.rewind("b", 0)  # nothing to do: nothing changes, the step can still be accepted
    assert_same(before, snapshot(m))
    m.prepare_step(["a"], [1])
    before = snapshot(m)
    for call in (lambda: m.rewind("a", 1), lambda: m.accept("a", [0])):
        with pytest.raises(ValueError, match="^seq_id:.*prepared step"):
            call()
        assert_same(before, snapshot(m))
    m.commit_step()
    m.rewind("a", 1)
    before = snapshot(m)
    with pytest.raises(ValueError, match="^seq_id:.*no committed step"):
        m.accept("a", [])  # a rewind ends what accept may reorder
    assert_same(before, snapshot(m))
    m.claim("c")
    with pytest.raises(ValueError, match="^seq_id:.*no committed step"):
        m.accept("c", [])
    reservation = m.reserve(["r"], [1], [[0]])
    before = snapshot(m)
    for call in (lambda: m.rewind("b", 1), lambda: m.accept("b", [0])):
        with pytest.raises(RuntimeError, match="reservation is open"):
            call()
    assert_same(before, snapshot(m))
    reservation.abort()


def test_accept_of_a_chain_keeps_pages_and_keys_in_place():
    """A linear draft (kept = 0..k-1) moves nothing: accept is a rewind of the rest, keys intact."""
    m = make()
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3]], model)
    run_step(m, ["a"], [[4, 5, 6, 7, 8, 9, 1]], model)  # drafts 4..1: page 1 keyed
    pages, keys = m.pages("a"), m.prefix_keys("a")
    m.accept("a", [0, 1, 2, 3, 4, 5])  # 9 tokens
    model["a"] = model["a"][:9]
    assert m.pages("a") == pages[:3] and m.prefix_keys("a") == keys[:2] == chained_keys(model["a"])
    check_contents(m, model, ["a"])
    check_ownership(m, model, {"a"})


def test_accept_records_given_ids_and_keys_the_pages_it_fills():
    m = make()
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3]], model)
    parents = [-1, -1, 0, 1, 2, 3]
    tokens = [7, 8, 9, 9, 1, 2]
    tree_step(m, "a", model, tokens, parents, ids=False)  # no ids: nothing keyed past the prompt
    assert m.prefix_keys("a") == []
    m.accept("a", [1, 3, 5], [8, 9, 2])  # positions 3..5: page 0 full: keyed with the accepted ids
    model["a"] = [1, 2, 3, 8, 9, 2]
    assert m.token_ids("a") == model["a"] and m.prefix_keys("a") == chained_keys(model["a"])
    check_contents(m, model, ["a"])
    assert m.claim("b", [1, 2, 3, 8, 0]) == 4
    check_contents(m, {"b": model["a"][:4]}, ["b"])


def test_accept_unpublishes_the_tree_pages_a_step_with_ids_keyed():
    """A tree step committed with its (tree-order) ids keys its full pages; their K/V are not the
    causal prefix of those ids, so accept leaves no such key behind."""
    m = make()
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3]], model)
    parents = [-1, -1, 0, 1, 2, 3, 4, 5, 6]
    tokens = [7, 8, 9, 9, 1, 2, 0, 0, 1]
    tree_order = [1, 2, 3, *tokens]
    tree_step(m, "a", model, tokens, parents, ids=True)
    assert m.prefix_keys("a") == chained_keys(tree_order)  # pages 0..2 keyed, tree order
    m.accept("a", [0, 2, 4, 6, 8])
    model["a"] = [1, 2, 3, 7, 9, 1, 0, 1]
    assert m.token_ids("a") == model["a"] and m.prefix_keys("a") == chained_keys(model["a"])
    keyed = set(m.page_pool.page_of)
    assert keyed.isdisjoint(chained_keys(tree_order)[1:])  # no tree-order key of pages 1, 2 left
    assert m.claim("b", [*tree_order, 0]) == 4  # page 0 only: its token 7 is a root, its K/V causal
    check_contents(m, {**model, "b": model["a"][:4]}, ["a", "b"])
    check_ownership(m, {**model, "b": model["a"][:4]}, {"a", "b"})
