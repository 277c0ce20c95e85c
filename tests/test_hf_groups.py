"""`PagedCache` over layer groups: a Gemma3-style model (sliding-window and full layers), pages taken
as rows grow and given back as they leave a window, against transformers' `DynamicCache` token for
token; and `DevicePages`, the on-device allocator, whose numpy and tensor paths must agree."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.generation.configuration_utils import CompileConfig

import torch_paged_kv as pk
from torch_paged_kv.integrations.hf_pages import DevicePages
from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

WINDOW, PAGE = 8, 4
GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model() -> Gemma3ForCausalLM:
    """Layers 0, 1, 3, 4 slide (window 8), 2 and 5 attend fully (Gemma3's pattern, every third here)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=3,
        max_position_embeddings=256, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Gemma3ForCausalLM(config).eval()


def prompts(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    mask = (torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]).long()
    return torch.randint(3, 256, (len(lengths), width), generator=torch.Generator().manual_seed(seed)) * mask, mask


def generate(model, cache, ids, mask, attn: str, **kwargs) -> torch.Tensor:
    model.set_attn_implementation(attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, **{cache_kwarg(model): cache}, **GREEDY, **kwargs)


def held_pages(collection: pk.PagedKVCacheCollection, rows: int) -> list[int]:
    return (collection.lookup_table[:rows] != pk.NULL_PAGE).sum(1).tolist()


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_sliding_group_holds_its_window_and_tokens_stay_exact(model, attn):
    ids, mask = prompts([5, 19, 11])
    expected = generate(model, DynamicCache(config=model.config), ids, mask, "sdpa", max_new_tokens=30)
    cache = PagedCache(model.config, 3, 64, page_size=PAGE)
    assert torch.equal(generate(model, cache, ids, mask, attn, max_new_tokens=30), expected)
    sliding, full = cache.groups.collections
    assert (sliding.params.sliding_window, sliding.params.num_layers, full.params.num_layers) == (WINDOW, 4, 2)
    assert cache.groups.layers == ((0, 1, 3, 4), (2, 5))
    lengths = full.cache_lengths[:3].tolist()  # the last token's K/V is never stored
    assert lengths == ([n + 29 for n in (5, 19, 11)] if attn == "paged_kv" else [19 + 29] * 3)
    first = [max(0, n - WINDOW + 1) // PAGE for n in lengths]
    assert held_pages(sliding, 3) == [-(-n // PAGE) - f for n, f in zip(lengths, first, strict=True)]
    assert held_pages(full, 3) == [-(-n // PAGE) for n in lengths]  # taken as the rows grew, no more
    assert max(held_pages(sliding, 3)) <= -(-(WINDOW - 1) // PAGE) + 1
    in_use = sum(held_pages(sliding, 3)) * sliding.params.page_bytes + sum(held_pages(full, 3)) * full.params.page_bytes
    assert cache.kv_bytes_in_use() == in_use
    cache.reset()
    assert cache.kv_bytes_in_use() == 0 and not sliding.lookup_table.any()


def test_compiled_decode_drops_pages_in_graph_and_does_not_recompile(model):
    """The tensor path of `DevicePages` (grow, leave_window) in a compiled decode step: same tokens as
    DynamicCache, no recompile for a new generate, and the sliding group still holds only its window."""
    ids, mask = prompts([7, 12], seed=3)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, "sdpa", max_new_tokens=20)
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    for stance in ("default", "fail_on_recompile"):
        cache = PagedCache(model.config, 2, 40, page_size=PAGE)
        with torch.compiler.set_stance(stance):
            got = generate(model, cache, ids, mask, "paged_kv", max_new_tokens=20, compile_config=compile_config)
        assert torch.equal(got, expected)
        sliding = cache.groups.collections[0]
        assert max(held_pages(sliding, 2)) <= -(-(WINDOW - 1) // PAGE) + 1


def test_max_step_tokens_shrinks_the_sliding_pool_and_chunked_prefill_stays_exact(model):
    ids, mask = prompts([21, 30], seed=4)
    expected = generate(model, DynamicCache(config=model.config), ids, mask, "sdpa", max_new_tokens=12)
    roomy = PagedCache(model.config, 2, 48, page_size=PAGE, device="cpu", dtype=torch.float32)
    tight = PagedCache(model.config, 2, 48, page_size=PAGE, device="cpu", dtype=torch.float32, max_step_tokens=8)
    assert [c.num_pages for c in roomy.groups.collections] == [2 * 12, 2 * 12]
    assert [c.num_pages for c in tight.groups.collections] == [2 * (-(-(8 + WINDOW - 1) // PAGE) + 1), 2 * 12]
    got = generate(model, tight, ids, mask, "paged_kv", max_new_tokens=12, prefill_chunk_size=8)
    assert torch.equal(got, expected)
    tight.reset()
    with pytest.raises(ValueError, match="^max_step_tokens: a row takes 30 new tokens in one step, more than 8"):
        generate(model, tight, ids, mask, "paged_kv", max_new_tokens=2)
    assert tight.kv_bytes_in_use() == 0  # refused before anything was taken


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_crop_past_a_dropped_window_is_refused_unless_the_past_was_recorded(model, attn):
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    dynamic = DynamicCache(config=model.config)  # the oracle: a cache that saw only the 14 kept tokens
    cache = PagedCache(model.config, 2, 32, page_size=PAGE)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    before = [t.clone() for c in cache.groups.collections for t in (c.lookup_table, c.cache_lengths)]
    with pytest.raises(ValueError, match="^tokens_to_remove: row 0 would need tokens its sliding window of 8"):
        cache.crop(-6)  # 14 tokens: the window 7..13 starts in page 1, which went at 20 tokens
    after = [t for c in cache.groups.collections for t in (c.lookup_table, c.cache_lengths)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    cache.crop(-1)  # 19 tokens: the window 12..18 is still held (pages 3 and 4)
    recorded = PagedCache(model.config, 2, 32, page_size=PAGE)
    recorded.activate_past_recording()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model(ids[:, :14], **{cache_kwarg(model): dynamic})
        expected = model(ids[:, 14:17], **{cache_kwarg(model): dynamic}).logits
    model.set_attn_implementation(attn)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): recorded})
        recorded.crop(-6)  # every page kept: the crop gives back what is out of the new window only
        sliding = recorded.groups.collections[0]
        assert held_pages(sliding, 2) == [-(-14 // PAGE) - (14 - WINDOW + 1) // PAGE] * 2
        got = model(ids[:, 14:17], **{cache_kwarg(model): recorded}).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- DevicePages ----------------------------------------------------------------------------------


def pool(window: int | None, pages: int = 40, rows: int = 4) -> DevicePages:
    params = pk.KVCacheParams(torch.float32, 1, 1, 4, PAGE, sliding_window=window)
    return DevicePages(pk.PagedKVCacheCollection(params, pages, rows, 64))


def state(p: DevicePages) -> tuple:
    return p.collection.lookup_table.clone(), p.free[: int(p.count)].clone()


def same(a: DevicePages, b: DevicePages) -> bool:
    return all(torch.equal(x, y) for x, y in zip(state(a), state(b), strict=True))


@pytest.mark.parametrize("window", [None, 1, 6, 13])
def test_host_and_tensor_paths_agree(window, monkeypatch):
    """Random steps through both paths of `grow` / `leave_window` (numpy views, eager CPU; tensors,
    what a compiled step or a GPU runs) leave identical tables and free stacks; pages are never lost
    or held twice; a step past the free pages leaves the null page where none was left."""
    rng = random.Random(window or 0)
    host, tensor = pool(window), pool(window)
    monkeypatch.setattr(tensor, "_on_host", lambda: False)
    lengths = torch.zeros(4, dtype=torch.int32)
    for _ in range(60):
        new = torch.tensor([rng.choice([0, 1, 1, 2, 5, 9]) for _ in range(4)], dtype=torch.int32)
        new = torch.minimum(new, 60 - lengths)
        columns = int(new.max())
        for p in (host, tensor):
            p.grow(lengths, new, columns)
        assert same(host, tensor)
        grown = lengths + new
        if window is not None:
            for p in (host, tensor):
                p.leave_window(lengths, grown, columns)
            assert same(host, tensor)
        lengths = grown
        table, free = state(host)
        held = table[table != pk.NULL_PAGE].tolist()
        assert sorted(held + free.tolist()) == list(range(1, 41)), "a page lost or held twice"
        first = [0 if window is None else max(0, n - window + 1) // PAGE for n in lengths.tolist()]
        needed = [-(-n // PAGE) - f for n, f in zip(lengths.tolist(), first, strict=True)]
        if sum(needed) <= 40:
            assert (table != pk.NULL_PAGE).sum(1).tolist() == needed
        if int(lengths.max()) >= 60:
            lengths.zero_()
            for p in (host, tensor):
                p.keep(np.zeros(4, dtype=np.int64))
    assert host.in_use() == tensor.in_use()


def test_select_rows_moves_pages_and_copies_duplicates():
    p = pool(None, pages=12)
    c = p.collection
    lengths = torch.tensor([5, 2, 7, 0], dtype=torch.int32)
    p.grow(torch.zeros(4, dtype=torch.int32), lengths, 7)
    c.blocks.copy_(torch.randn(c.blocks.shape))
    rows = {b: c.blocks[c.lookup_table[b, : -(-n // PAGE)].long()].clone() for b, n in enumerate(lengths.tolist())}
    before = c.lookup_table.clone()
    p.select_rows([2, 0, 2])  # row 1 is dropped (its page goes back), row 2 doubled (copied)
    table = c.lookup_table
    assert torch.equal(table[0], before[2]) and torch.equal(table[1], before[0])  # moved, not copied
    assert torch.equal(c.blocks[table[2, :2].long()], rows[2]) and set(table[2, :2].tolist()).isdisjoint(
        before[2].tolist()
    )
    assert not table[3].any() and p.in_use() == 2 + 2 + 2
