"""PagedCache against transformers' own DynamicCache: exact token equality on a tiny random Llama."""

from __future__ import annotations

import copy
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import tiny_llama
from transformers import DynamicCache, LlamaForCausalLM
from transformers.generation.configuration_utils import CompileConfig

from torch_paged_kv.integrations.hf_support import attention_layers
from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg, paged_kv_mask
from torch_paged_kv.ops import validate

# transformers 5.24 deprecates `past_key_values` for `cache`: every call here must use the current name.
pytestmark = pytest.mark.filterwarnings("error:.*past_key_values.*")

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [5, 9, 3, 7]  # uneven prompts, left-padded to 9
GREEDY_ARGS = dict(do_sample=False, pad_token_id=0)
GREEDY = dict(max_new_tokens=12, min_new_tokens=12, **GREEDY_ARGS)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None] >= width - torch.tensor(LENGTHS)[:, None]).long()
    return torch.randint(1, 512, (len(LENGTHS), width), generator=g) * mask, mask


def reference(model: LlamaForCausalLM, prompts, **kwargs) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    ids, mask = prompts
    return model.generate(ids, attention_mask=mask, **{cache_kwarg(model): DynamicCache(config=model.config)}, **kwargs)


def paged(model: LlamaForCausalLM, attn: str, max_batch_size: int = 4, page_size: int = 4) -> PagedCache:
    model.set_attn_implementation(attn)
    return PagedCache(model.config, max_batch_size=max_batch_size, max_cache_len=24, page_size=page_size)


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_greedy_matches_dynamic_cache(model, prompts, attn):
    expected = reference(model, prompts, **GREEDY)
    cache = paged(model, attn)
    out = model.generate(prompts[0], attention_mask=prompts[1], **{cache_kwarg(model): cache}, **GREEDY)
    assert torch.equal(out, expected)
    lengths = cache.collection.cache_lengths.tolist()
    stored = [n + 11 for n in LENGTHS] if attn == "paged_kv" else [9 + 11] * 4  # paged_kv never stores padding
    assert lengths == stored and int(cache.get_seq_length()) == 9 + 11


def test_cache_kwarg_is_the_current_name(model):
    """`cache_kwarg` names the installed transformers' cache parameter, also through `torch.compile`
    (every `generate` here passes the cache through it, with the deprecated name's warning an error)."""
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters
    assert cache_kwarg(torch.compile(model)) == cache_kwarg(model)  # (compiles nothing until called)


def test_kv_sharing_before_transformers_5_23_is_refused():
    """A config that shares K/V by `num_kv_shared_layers` without `kv_sharing_modes` (Gemma3n before
    transformers 5.23, which reads the shared K/V off the cache) is refused, not served wrong tokens."""
    config = SimpleNamespace(num_hidden_layers=6, num_kv_shared_layers=2)
    with pytest.raises(ValueError, match="^config: its last 2 layers reuse other layers' K/V"):
        attention_layers(config)
    assert attention_layers(SimpleNamespace(num_hidden_layers=3)) == ([0, 1, 2], [0, 1, 2])


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_beam_search_matches_dynamic_cache(model, prompts, attn):
    expected = reference(model, prompts, num_beams=3, **GREEDY)
    cache = paged(model, attn, max_batch_size=12)
    out = model.generate(prompts[0], attention_mask=prompts[1], **{cache_kwarg(model): cache}, num_beams=3, **GREEDY)
    assert torch.equal(out, expected)


def test_compiled_decode_matches_dynamic_cache(model, prompts, monkeypatch):
    expected = reference(model, prompts, **GREEDY)
    cache = paged(model, "paged_kv")
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    compile_config._compile_all_devices = True  # generate compiles the decode step off-GPU only when told
    kwargs = dict(attention_mask=prompts[1], **{cache_kwarg(model): cache}, compile_config=compile_config, **GREEDY)
    torch._dynamo.reset()
    assert torch.equal(model.generate(prompts[0], **kwargs), expected)
    cache.reset()
    checked = []  # the compiled step, too, checks its step tensors once (layer 0), not per layer
    real = validate.check_read_data
    monkeypatch.setattr(validate, "check_read_data", lambda *a: checked.append(a) or real(*a))
    with torch.compiler.set_stance("fail_on_recompile"):  # a new generate, new lengths: same graph
        assert torch.equal(model.generate(prompts[0], **kwargs), expected)
    assert len(checked) == GREEDY["max_new_tokens"]  # prefill + 11 decode steps


def teacher_forced_agreement(model, cache, reference: torch.Tensor, prompt: int) -> float:
    """Fraction of positions where the model with `cache` predicts `reference`'s next token, fed the
    reference tokens (greedy decoding diverges after one flip; this counts each position once)."""
    with torch.no_grad():
        logits = [model(reference[:, :prompt], **{cache_kwarg(model): cache}).logits[:, -1]]
        for t in range(prompt, reference.shape[1] - 1):
            logits.append(model(reference[:, t : t + 1], **{cache_kwarg(model): cache}).logits[:, -1])
    return (torch.stack(logits, 1).argmax(-1) == reference[:, prompt:]).float().mean().item()


@pytest.fixture(scope="module")
def bf16_tiny_llama():
    """The README example's tiny Llama, in bf16, and greedy tokens from a bf16 `PagedCache`."""
    sys.path.insert(0, str(ROOT / "examples"))
    from hf_generate import tiny_llama

    model = tiny_llama(0).to(torch.bfloat16).eval()
    model.set_attn_implementation("paged_kv")
    ids = torch.randint(3, 1024, (4, 16), generator=torch.Generator().manual_seed(1))
    tokens = model.generate(
        ids, **{cache_kwarg(model): PagedCache(model.config, 4, 64, 16)}, max_new_tokens=40, **GREEDY_ARGS
    )
    return model, tokens


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_fp8_cache_agrees_with_the_bf16_cache(bf16_tiny_llama, attn):
    """An FP8 e4m3 cache (one scale per token and head) predicts the bf16 cache's greedy tokens at
    >= 80% of the positions (measured 86%; e5m2: 76%; docs/fp8.md), both attention paths."""
    model, tokens = bf16_tiny_llama
    model.set_attn_implementation(attn)
    fp8 = PagedCache(model.config, 4, 64, 16, kv_dtype=torch.float8_e4m3fn)
    agreement = teacher_forced_agreement(model, fp8, tokens, 16)
    assert fp8.collection.blocks.dtype == torch.float8_e4m3fn and 0.8 <= agreement < 1.0, agreement
    model.set_attn_implementation("paged_kv")


def test_compiled_fp8_decode_does_not_recompile(bf16_tiny_llama):
    model, tokens = bf16_tiny_llama
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    for first in (True, False):  # a new generate with other prompts: the same graph
        cache = PagedCache(model.config, 4, 64, 16, kv_dtype=torch.float8_e4m3fn, quantization_granularity=8)
        prompts = tokens[:, :16] if first else tokens[:, 10:26]
        kwargs = dict(
            attention_mask=torch.ones_like(prompts), **{cache_kwarg(model): cache}, compile_config=compile_config
        )
        with torch.compiler.set_stance("default" if first else "fail_on_recompile"):
            model.generate(prompts, max_new_tokens=4, **kwargs, **GREEDY_ARGS)


def forward(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of `ids` (no padding) placed at positions `start..`."""
    positions = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():  # the paged ops are inference-only
        return model(ids, position_ids=positions, **{cache_kwarg(model): cache}, use_cache=True).logits


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_crop_then_refeed_matches_dynamic_cache(model, attn):
    ids = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    cache = paged(model, attn)
    dynamic = DynamicCache(config=model.config)
    for c in (cache, dynamic):
        forward(model, c, ids, 0)
        c.crop(-4)
    assert int(cache.get_seq_length()) == dynamic.get_seq_length() == 6
    assert cache.collection.cache_lengths[:2].tolist() == [6, 6]
    model.set_attn_implementation("sdpa")
    expected = forward(model, dynamic, ids[:, 6:], 6)
    model.set_attn_implementation(attn)
    got = forward(model, cache, ids[:, 6:], 6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    cache.crop(8)  # a positive count: the columns to keep (transformers before 5.24 crops so)
    assert int(cache.get_seq_length()) == 8 and cache.collection.cache_lengths[:2].tolist() == [8, 8]
    cache.crop(20)  # more than there are: no change
    assert int(cache.get_seq_length()) == 8 and cache.collection.cache_lengths[:2].tolist() == [8, 8]


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_batch_select_and_repeat_match_dynamic_cache(model, attn):
    ids = torch.randint(1, 512, (3, 7), generator=torch.Generator().manual_seed(3))
    cache = paged(model, attn, page_size=2)
    dynamic = DynamicCache(config=model.config)
    select = torch.tensor([2, 0])
    for c in (cache, dynamic):
        forward(model, c, ids, 0)
        c.batch_select_indices(select)
    step = torch.tensor([[11], [12]])
    model.set_attn_implementation("sdpa")
    expected = forward(model, dynamic, step, 7)
    model.set_attn_implementation(attn)
    got = forward(model, cache, step, 7)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert cache.rows == 2 and cache.collection.cache_lengths.tolist() == [8, 8, 0, 0]
    for c in (cache, dynamic):
        c.batch_repeat_interleave(2)
    step = torch.tensor([[13], [14], [15], [16]])
    model.set_attn_implementation("sdpa")
    expected = forward(model, dynamic, step, 8)
    model.set_attn_implementation(attn)
    torch.testing.assert_close(forward(model, cache, step, 8), expected, rtol=1e-5, atol=1e-5)


def test_reset_gives_a_fresh_cache(model, prompts):
    cache = paged(model, "paged_kv")
    first = model.generate(prompts[0], attention_mask=prompts[1], **{cache_kwarg(model): cache}, **GREEDY)
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and not cache.collection.cache_lengths.any() and cache.rows == 0
    again = model.generate(prompts[0], attention_mask=prompts[1], **{cache_kwarg(model): cache}, **GREEDY)
    assert torch.equal(first, again)


def test_overflow_is_rejected(model):
    cache = paged(model, "paged_kv")
    with pytest.raises(ValueError, match="max_cache_len"):
        forward(model, cache, torch.ones(1, 25, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        forward(model, cache, torch.ones(5, 3, dtype=torch.long), 0)
    ids = torch.ones(2, 3, dtype=torch.long)  # 2 prompts x 3 beams: 6 rows for a cache of 4
    with pytest.raises(ValueError, match=r"^batch: 6 rows, more than max_batch_size=4 \(rows are batch x num_beams"):
        model.generate(ids, **{cache_kwarg(model): paged(model, "paged_kv")}, num_beams=3, **GREEDY)


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_step_tensors_are_checked_once_per_step(model, monkeypatch, attn):
    """Layer 0 runs the ops' value checks; the later layers of the same step skip them."""
    cache = paged(model, attn)
    checked = []
    real = validate.check_store_kv_data
    monkeypatch.setattr(validate, "check_store_kv_data", lambda *a: checked.append(a) or real(*a))
    forward(model, cache, torch.ones(2, 3, dtype=torch.long), 0)
    forward(model, cache, torch.ones(2, 1, dtype=torch.long), 3)
    assert len(checked) == 2 and model.config.num_hidden_layers > 1
    cache.collection.lookup_table[1, 0] = 0  # row 1 loses its first page: layer 0 must notice
    with pytest.raises(ValueError, match="^lookup_table:.*null page"):
        forward(model, cache, torch.ones(2, 1, dtype=torch.long), 4)


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_shared_kv_layers_match_dynamic_cache(attn):
    """A model whose last layers reuse earlier layers' K/V (Gemma3n's `kv_sharing_modes`): only the
    layers that keep K/V get pool layers, and under `paged_kv` the sharing layers, which come after
    the last cached layer, read the pages before the step's lengths advance. Sliding and full layers."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    config = Gemma3nTextConfig(
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size=64,
        hidden_size_per_layer_input=8,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 3,
        sliding_window=8,
        max_position_embeddings=128,
        laurel_rank=4,
        activation_sparsity_pattern=[0.0] * 6,
    )
    model = Gemma3nForCausalLM(config).eval()
    if not hasattr(config, "kv_sharing_modes"):  # transformers < 5.23 shares K/V another way: refused
        with pytest.raises(ValueError, match="^config: its last 2 layers reuse other layers' K/V"):
            PagedCache(model.config, max_batch_size=2, max_cache_len=32, page_size=4)
        return
    assert model.config.kv_sharing_modes[-2:] == ["reuse", "reuse"]
    ids = torch.randint(1, 256, (2, 11), generator=torch.Generator().manual_seed(5))
    expected = reference(model, (ids, torch.ones_like(ids)), max_new_tokens=10, do_sample=False)
    model.set_attn_implementation(attn)
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=32, page_size=4)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache}, max_new_tokens=10, do_sample=False
    )
    assert torch.equal(out, expected)
    sliding, full = cache.groups.collections  # layer types alternate: two groups of two pool layers
    assert (sliding.params.num_layers, full.params.num_layers, sliding.params.sliding_window) == (2, 2, 8)
    assert sliding.cache_lengths.tolist() == [20, 20] and full.cache_lengths is sliding.cache_lengths
    held = (sliding.lookup_table != 0).sum(1).tolist()  # 20 tokens: the window (13..19) spans pages 3 and 4
    assert held == [2, 2] and (full.lookup_table != 0).sum(1).tolist() == [5, 5]
    assert cache.kv_bytes_in_use() == 4 * sliding.params.page_bytes + 10 * full.params.page_bytes


def test_mask_of_new_tokens_is_contiguous_and_4d():
    """A compiled decode step guards on the mask's strides: a slice of the growing 2D mask would recompile.
    The mask is 4-D over the query rows (`[batch, 1, new, 1]`), so model code slicing a 4-D mask's query
    dimension (Gemma4's trimmed K/V-sharing layers) keeps the rows it keeps."""
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = paged_kv_mask(2, 3, 5, attention_mask=padding)
    assert mask.shape == (2, 1, 3, 1) and mask.is_contiguous() and mask.dtype == torch.bool
    assert mask[:, 0, :, 0].tolist() == [[True, True, True], [True, True, True]]
    assert paged_kv_mask(2, 4, 5, attention_mask=padding)[:, 0, :, 0].tolist()[0] == [False, True, True, True]
    assert mask[:, :, -1:, :].shape == (2, 1, 1, 1)


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_pool_follows_the_model_dtype_unless_given(model, attn):
    """No dtype given: the pool is allocated at the first step in the keys' dtype (a model cast with
    `.to(bfloat16)` keeps `config.dtype` as it was). A given dtype the model does not match is refused."""
    ids = torch.randint(1, 512, (2, 6), generator=torch.Generator().manual_seed(3))
    bf16, bf16_sdpa = copy.deepcopy(model).to(torch.bfloat16), copy.deepcopy(model).to(torch.bfloat16)
    bf16_sdpa.set_attn_implementation("sdpa")
    cache = paged(bf16, attn)
    assert cache.collection is None and "not allocated yet" in repr(cache) and cache.get_seq_length() == 0
    dynamic = DynamicCache(config=bf16_sdpa.config)
    got, expected = forward(bf16, cache, ids, 0), forward(bf16_sdpa, dynamic, ids, 0)
    for step in range(3):
        nxt = got[:, -1:].argmax(-1)
        got, expected = forward(bf16, cache, nxt, 6 + step), forward(bf16_sdpa, dynamic, nxt, 6 + step)
        two_ulps = 2 * 2.0**-7 * expected.abs().max().item()  # of the largest logit, in bf16
        torch.testing.assert_close(got, expected, atol=two_ulps, rtol=0)  # paged attends in fp32, SDPA in bf16
    assert cache.collection.blocks.dtype == torch.bfloat16
    fixed = PagedCache(bf16.config, max_batch_size=2, max_cache_len=24, page_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="^dtype: the pool holds torch.float32 but the model's keys are torch.bf"):
        forward(bf16, fixed, ids, 0)
    assert fixed.collection is None  # refused before allocating: the cache is still usable
    elsewhere = PagedCache(bf16.config, max_batch_size=2, max_cache_len=24, page_size=4, device="meta")
    with pytest.raises(ValueError, match="^device: the pool is on meta but the model's keys are on cpu"):
        forward(bf16, elsewhere, ids, 0)


@pytest.mark.parametrize("attn", ["paged_kv", "sdpa"])
def test_pool_allocated_by_a_compiled_first_step(model, attn):
    """`torch.compile(model, fullgraph=True)` on a fresh cache: the first step allocates the pool inside
    the compiled region (no static-address marking there); the next eager step marks it."""
    ids = torch.randint(1, 512, (2, 5), generator=torch.Generator().manual_seed(4))
    cache, dynamic = paged(model, attn), DynamicCache(config=model.config)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    got = forward(compiled, cache, ids, 0)
    assert cache.collection is not None and not cache.static_addresses_marked
    got = torch.cat([got, forward(model, cache, ids[:, :1], 5)], 1)
    assert cache.static_addresses_marked
    model.set_attn_implementation("sdpa")
    expected = torch.cat([forward(model, dynamic, ids, 0), forward(model, dynamic, ids[:, :1], 5)], 1)
    torch.testing.assert_close(got, expected)


def test_forward_without_cache(model, prompts):
    """attn_implementation="paged_kv" with no cache at all: plain masked attention, same logits as SDPA."""
    ids, mask = prompts
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("paged_kv")
        got = model(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
