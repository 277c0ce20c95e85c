"""`PagedCache` on hybrid models, whose linear-attention, Mamba or short-convolution layers keep
conv and recurrent states per row beside the attention layers' pages (`hf_state.StateLayer`): what
the family matrix (tests/transformers_matrix.py: Qwen3-Next, Jamba, LFM2, Falcon-H1 in every mode)
does not run. Every oracle is transformers' own `DynamicCache`."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
import transformers_matrix as matrix
from transformers import DynamicCache, MambaConfig
from transformers.generation.configuration_utils import CompileConfig

from torch_paged_kv.integrations import hf_support
from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

pytestmark = pytest.mark.skipif(
    hf_support._older_than(hf_support.STATE_LAYERS_SINCE),
    reason=f"state layers are refused before transformers {hf_support.STATE_LAYERS_SINCE} (test_model_families)",
)
GREEDY = dict(do_sample=False, pad_token_id=matrix.PAD)
QWEN3_NEXT, LFM2, FALCON_H1 = "Qwen3-Next (hybrid)", "LFM2 (hybrid)", "Falcon-H1 (hybrid)"


def family_model(name: str, attn: str) -> torch.nn.Module:
    model = next(f for f in matrix.FAMILIES if f.name == name).build()
    model.set_attn_implementation(attn)
    return model


def generate(model, cache, lengths: tuple[int, ...], new_tokens: int, **kwargs) -> torch.Tensor:
    """Greedy `generate` of `new_tokens` over the matrix's left-padded prompts of `lengths`."""
    ids, mask = matrix.prompts(matrix.Mode(lengths, new_tokens))
    return generate_from(model, cache, ids, mask, new_tokens, **kwargs)


def generate_from(model, cache, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    """Greedy `generate` of `new_tokens` after `ids` (`mask`: which are real) with `cache`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **{cache_kwarg(model): cache},
            **GREEDY,
            **kwargs,
        )


def go_on(model, cache, so_far: torch.Tensor, lengths: tuple[int, ...], more: int) -> torch.Tensor:
    """`more` greedy tokens after `so_far`: the prompts of `lengths` (their mask), then generated tokens."""
    first = so_far.shape[1] - max(lengths)
    _, mask = matrix.prompts(matrix.Mode(lengths, first))
    mask = torch.cat([mask, torch.ones(len(lengths), first, dtype=mask.dtype)], dim=1)
    return generate_from(model, cache, so_far, mask, more)


def assert_compiled_decode_does_not_recompile(model, cache, expected: torch.Tensor) -> None:
    """`generate` of (5, 7)-token prompts with a compiled decode step (fullgraph) gives `expected`, and
    a second one after `reset` reuses the graph."""
    new_tokens = expected.shape[1] - 7
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    compile_config._compile_all_devices = True  # generate compiles the decode step off-GPU only when told
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert torch.equal(generate(model, cache, (5, 7), new_tokens, compile_config=compile_config), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the decode step was compiled
    cache.reset()
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(generate(model, cache, (5, 7), new_tokens, compile_config=compile_config), expected)


def dynamic(model, lengths: tuple[int, ...], new_tokens: int, **kwargs) -> torch.Tensor:
    """The tokens over `DynamicCache`, under `eager` where the model runs `paged_kv` (as in the matrix)."""
    attn = model.config._attn_implementation
    model.set_attn_implementation("eager" if attn == "paged_kv" else attn)
    try:
        return generate(model, DynamicCache(config=model.config), lengths, new_tokens, **kwargs)
    finally:
        model.set_attn_implementation(attn)


@pytest.mark.parametrize("attn", ["sdpa", "paged_kv"])
def test_a_reset_cache_takes_another_batch_size(attn):
    """A `PagedCache` reused after `reset` for a batch of another size: its state layers are made
    again for it (transformers' own layer would fail copying into the old states), and a batch of
    the first size again keeps working."""
    model = family_model(QWEN3_NEXT, attn)
    cache = PagedCache(model.config, max_batch_size=3, max_cache_len=24, page_size=4)
    for lengths in [(5, 7), (6, 3, 8), (4, 9)]:
        cache.reset()
        assert torch.equal(generate(model, cache, lengths, 6), dynamic(model, lengths, 6)), lengths


@pytest.mark.parametrize("attn", ["sdpa", "paged_kv"])
def test_speculative_decoding_is_refused_before_its_first_token(attn):
    """Speculative decoding needs states that go back to an earlier token: recurrent states cannot
    (transformers refuses such models itself), and over conv states alone (LFM2) transformers' path
    for a compileable cache gives other tokens than DynamicCache's (its StaticCache's too). Refused
    when transformers asks to record the past, before the prefill: nothing stored."""
    model = family_model(LFM2, attn)
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=48, page_size=4)
    with pytest.raises(ValueError, match="^cache: layers \\[.*\\] keep conv or recurrent states"):
        generate(model, cache, (5, 7), 8, prompt_lookup_num_tokens=3)
    assert cache.groups is None or not any(c.cache_lengths.any() for c in cache.groups.collections)


def test_a_crop_of_state_layers_is_refused():
    """`crop` itself (a user's rewind) refuses to drop tokens of a cache with state layers, changing
    nothing, and transformers is told it cannot go back (`is_croppable`)."""
    model = family_model(QWEN3_NEXT, "sdpa")
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=24, page_size=4)
    generate(model, cache, (5, 7), 4)
    assert not cache.is_croppable
    columns, lengths = int(cache.get_seq_length()), cache.collection.cache_lengths.clone()
    with pytest.raises(ValueError, match="^tokens_to_remove: layers \\[0, 1, 2\\] keep conv or recurrent states"):
        cache.crop(-2)
    assert int(cache.get_seq_length()) == columns and torch.equal(cache.collection.cache_lengths, lengths)


@pytest.mark.parametrize("name", [QWEN3_NEXT, FALCON_H1])
def test_state_bytes_in_use_are_the_bytes_dynamic_cache_holds(name):
    """`state_bytes_in_use()` counts the bytes of the states that DynamicCache's own state layers hold
    after the same `generate` (0 before the first step)."""
    model = family_model(name, "sdpa")
    cache = PagedCache(model.config, max_batch_size=3, max_cache_len=24, page_size=4)
    assert cache.state_bytes_in_use() == 0
    generate(model, cache, (5, 7, 2), 4)
    dynamic_cache = DynamicCache(config=model.config)
    generate(model, dynamic_cache, (5, 7, 2), 4)
    states = [
        t
        for i in cache.state_layers
        for held in (dynamic_cache.layers[i].conv_states, dynamic_cache.layers[i].recurrent_states)
        for t in held.values()
        if t is not None
    ]
    assert states and cache.state_bytes_in_use() == sum(t.numel() * t.element_size() for t in states)


def test_saving_states_that_cannot_resume_is_refused(tmp_path):
    """`save` stores the states (tests/test_hf_state_checkpoint.py), but refuses, writing nothing, states
    of another number of rows than the rows in use (a file of them could not resume exactly)."""
    model = family_model(FALCON_H1, "paged_kv")
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=24, page_size=4)
    generate(model, cache, (5, 7), 3)
    cache.layers[2].recurrent_states[0] = cache.layers[2].recurrent_states[0][:1]
    with pytest.raises(ValueError, match="^cache: layer 2 keeps recurrent states 0 of 1 rows, but 2 rows are in use"):
        cache.save(tmp_path / "kv.safetensors")
    assert not list(tmp_path.iterdir())


def test_a_model_without_attention_layers_is_refused():
    """Mamba keeps states only: nothing to page, refused at construction naming the field."""
    config = MambaConfig(vocab_size=matrix.VOCAB, hidden_size=64, num_hidden_layers=2, state_size=8)
    with pytest.raises(ValueError, match="^config.layer_types: no layer keeps K/V"):
        PagedCache(config, max_batch_size=1, max_cache_len=16)


@pytest.mark.slow  # (35 s on a cold inductor cache)
def test_compiled_decode_with_state_layers_does_not_recompile():
    """`generate` with a compiled decode step (fullgraph) over pages and recurrent states: greedy
    tokens equal DynamicCache's, and a second `generate` after `reset` (new lengths, same batch)
    reuses the graph."""
    model = family_model(FALCON_H1, "paged_kv")
    cache = PagedCache(model.config, max_batch_size=2, max_cache_len=24, page_size=4)
    assert_compiled_decode_does_not_recompile(model, cache, dynamic(model, (5, 7), 8))


def test_state_layers_are_refused_where_unchecked(monkeypatch):
    """Before transformers `STATE_LAYERS_SINCE` state layers are refused naming `config.layer_types`."""
    config = family_model(QWEN3_NEXT, "sdpa").config
    PagedCache(config, max_batch_size=1, max_cache_len=16)
    monkeypatch.setattr(hf_support, "_transformers_version", lambda: "5.14.1")
    with pytest.raises(ValueError, match="^config.layer_types: layers \\[0, 1, 2\\] are \\['linear_attention'\\]"):
        PagedCache(config, max_batch_size=1, max_cache_len=16)


def test_attention_free_layers_beside_state_layers_hold_transformers_placeholder():
    """Nemotron-H's "mlp" and "moe" layers keep nothing: the cache holds transformers' placeholder for
    them (its `DummyLayer`; before 5.23, which has none, the empty `LinearAttentionLayer` its own caches
    hold there), and the tokens are DynamicCache's in every sweep cell."""
    import transformers_sweep as sweep

    result = sweep.sweep_one("nemotron_h")
    assert result["cls"] == "EXACT", result["cells"]
