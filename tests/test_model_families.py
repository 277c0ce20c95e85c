"""transformers model families through `PagedCache`: the family matrix (tests/transformers_matrix.py)
and focused tests of what it relies on (MLA pools, trimmed K/V-sharing layers, refusals).

By default a subset of the matrix runs: every family in greedy in both columns, and every mode for a
plain model (Llama), a K/V-sharing one (Gemma4) and an MLA one (DeepSeek-V3). The whole matrix:
`TORCH_PAGED_KV_FULL_MATRIX=1 pytest tests/test_model_families.py` (or `python tests/transformers_matrix.py`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
import transformers_matrix as matrix
from transformers import DynamicCache

from torch_paged_kv.integrations import hf_mla, hf_support
from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg, paged_kv_attention
from torch_paged_kv.step import StepPlan

ROOT = Path(__file__).resolve().parents[1]
FULL = os.environ.get("TORCH_PAGED_KV_FULL_MATRIX") == "1"
TABLE_START, TABLE_END = "<!-- supported-models: start -->\n", "<!-- supported-models: end -->"


CELLS = matrix.all_cells() if FULL else matrix.ci_cells()
SHARING_LANDED = matrix.Before("5.23")  # kv_sharing_modes: K/V sharing refused before (the matrix checks that)
MLA_KWARGS_LANDED = matrix.Before("5.24")  # Cache.update(kwargs=...): paged_kv on MLA refused before
needs_sharing = pytest.mark.skipif(SHARING_LANDED.applies(), reason="K/V sharing is refused before transformers 5.23")
needs_mla_latent = pytest.mark.skipif(
    hf_support._mla_update_gets_decompressed_kv(),
    reason=f"MLA models are refused before transformers {hf_support.MLA_LATENT_UPDATE}",
)
needs_mla_kwargs = pytest.mark.skipif(
    MLA_KWARGS_LANDED.applies(), reason="paged_kv on MLA models is refused before transformers 5.24"
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models


@pytest.mark.parametrize(
    "family, column, mode", CELLS, ids=[f"{f.name.replace(' ', '_')}-{c}-{m}" for f, c, m in CELLS]
)
def test_matrix_cell(family, column, mode):
    """Exact tokens against DynamicCache, or the declared refusal before the first token."""
    if not family.available():
        pytest.skip(f"this transformers has no {family.config}")
    result = matrix.run_cell(family, column, mode)
    assert result.ok, f"expected {result.expected}, got {result.got}"


def test_docs_table_is_the_matrix_declarations():
    """docs/transformers.md's "Supported models" table is `python tests/transformers_matrix.py --markdown`."""
    docs = (ROOT / "docs" / "transformers.md").read_text()
    start, end = docs.index(TABLE_START) + len(TABLE_START), docs.index(TABLE_END)
    assert docs[start:end] == matrix.markdown_table(), "regenerate it: python tests/transformers_matrix.py --markdown"


def test_families_cover_the_issue():
    """At least 20 families, and both kinds of outcome in both columns."""
    assert len(matrix.FAMILIES) >= 20 and len({f.config for f in matrix.FAMILIES}) >= 20
    for column in matrix.COLUMNS:
        outcomes = {type(f.expected(column)) for f in matrix.FAMILIES}
        assert outcomes == {str, matrix.Refused}


def family(name: str):
    return next(f for f in matrix.FAMILIES if f.name == name)


def generate(model, attn: str, cache, mode: str = "batch") -> torch.Tensor:
    matrix.set_attention(model, attn)
    return matrix.run(model, lambda: cache, matrix.MODE_SPECS[mode])[0].tokens


def reference(model, default_attn: str, mode: str = "batch") -> torch.Tensor:
    return generate(model, default_attn, DynamicCache(config=model.config), mode)


# -- K/V sharing with trimmed shared layers (Gemma4) ----------------------------------------------
@needs_sharing
def test_gemma4_trimmed_shared_layers_attend_as_the_last_positions(monkeypatch):
    """Gemma4 feeds its K/V-sharing layers only the last `logits_to_keep` positions of a prefill (and
    slices the 4-D mask's query dimension): under `paged_kv` they attend from a trailing plan (the
    last query of each row), and the tokens equal DynamicCache's for a left-padded batch."""
    model, default_attn = matrix.model_of(family("Gemma4 (text, K/V sharing)"))
    expected = reference(model, default_attn)
    mode = matrix.MODE_SPECS["batch"]
    cache = PagedCache(model.config, len(mode.lengths), matrix.max_cache_len(mode), page_size=4)
    trailing = []
    real = PagedCache.trailing_plan
    monkeypatch.setattr(
        PagedCache,
        "trailing_plan",
        lambda self, batch, counts, layer: trailing.append(counts.tolist()) or real(self, batch, counts, layer),
    )
    assert torch.equal(generate(model, "paged_kv", cache), expected)
    assert trailing == [[1, 1, 1], [1, 1, 1]]  # the two sharing layers of the prefill, one query per row
    assert [c.params.num_layers for c in cache.groups.collections] == [2, 2]  # only the layers that keep K/V
    assert [c.params.sliding_window for c in cache.groups.collections] == [8, None]


# -- MLA ------------------------------------------------------------------------------------------
@needs_mla_latent
def test_mla_pool_holds_the_models_latent_and_rope_rows():
    """DeepSeek-V3: one latent + rope row per token and layer (an MLA pool), under the default
    attention the rows DynamicCache holds (padding columns included, as StaticCache would)."""
    model, default_attn = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    cfg = model.config
    mode = matrix.MODE_SPECS["batch"]
    dynamic = DynamicCache(config=cfg)
    expected = generate(model, default_attn, dynamic)
    cache = PagedCache(cfg, len(mode.lengths), matrix.max_cache_len(mode), page_size=4)
    assert torch.equal(generate(model, default_attn, cache), expected)
    params = cache.collection.params
    assert params.is_mla and (params.kv_lora_rank, params.rope_dim) == (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    assert cache.collection.blocks.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    tokens = expected.shape[1] - 1  # the last token is never fed back
    for pool_layer, layer in enumerate(dynamic.layers):
        for b in range(len(mode.lengths)):
            stored = torch.stack([cache.collection.get_latent_cache(pool_layer).load(b, 0, t) for t in range(tokens)])
            expected_rows = torch.cat([layer.keys[b, 0, :tokens], layer.values[b, 0, :tokens]], -1)
            if pool_layer == 0:  # computed from the embeddings alone: bit for bit
                assert torch.equal(stored, expected_rows)
            else:  # after attention over max_cache_len (masked) columns instead of the used ones: rounding
                torch.testing.assert_close(stored, expected_rows, rtol=1e-5, atol=1e-5)


@needs_mla_kwargs
def test_mla_under_paged_kv_runs_absorbed_attention_over_the_pages(monkeypatch):
    """Under `paged_kv` every MLA layer stores its real tokens' rows and attends with `mla_attention`
    (the model's own attention is never called), and the tokens equal DynamicCache's."""
    model, default_attn = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    expected = reference(model, default_attn)
    mode = matrix.MODE_SPECS["batch"]
    cache = PagedCache(model.config, len(mode.lengths), matrix.max_cache_len(mode), page_size=4)
    calls = []
    real = StepPlan.mla_attention
    spy = lambda self, *a, **k: calls.append(a[0].shape) or real(self, *a, **k)
    monkeypatch.setattr(StepPlan, "mla_attention", spy)
    assert torch.equal(generate(model, "paged_kv", cache), expected)
    layers, steps = model.config.num_hidden_layers, mode.new_tokens
    assert len(calls) == layers * steps and calls[0] == (sum(mode.lengths), 4, model.config.kv_lora_rank)
    assert cache.collection.cache_lengths.tolist() == [n + steps - 1 for n in mode.lengths]  # no padding stored


@needs_mla_latent
def test_mla_rows_past_each_length_never_reach_the_model():
    """Under the default attention the model gets `max_cache_len` rows per sequence; the rows past a
    sequence's length (stale after `reset` or `crop`, here NaN) are returned as zeros, as `gather_kv`
    does for K/V: masked, but a NaN value times a zero weight would still be NaN."""
    model, default_attn = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    matrix.set_attention(model, default_attn)
    cache, dynamic = PagedCache(model.config, 2, 16, page_size=4), DynamicCache(config=model.config)
    ids = torch.randint(3, matrix.VOCAB, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for c in (cache, dynamic):
            model(ids, **{cache_kwarg(model): c})
        table = cache.collection.lookup_table
        for b in range(2):
            for position in range(5, 16):  # every slot past the 5 stored tokens, in every layer
                cache.collection.blocks[table[b, position // 4], :, :, position % 4] = float("nan")
        got = model(ids[:, :1], **{cache_kwarg(model): cache}).logits
        expected = model(ids[:, :1], **{cache_kwarg(model): dynamic}).logits
    assert got.isfinite().all()
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)


@needs_mla_kwargs
def test_fp8_mla_pool_only_under_paged_kv():
    """An FP8 MLA pool is read by absorbed attention only: the default attention is refused, naming
    `kv_dtype`, before anything is stored; under `paged_kv` the pool stores FP8 latent rows."""
    model, default_attn = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    mode = matrix.MODE_SPECS["greedy"]
    cache = PagedCache(model.config, 2, matrix.max_cache_len(mode), page_size=4, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^kv_dtype: an FP8 MLA PagedCache"):
        generate(model, default_attn, cache, "greedy")
    assert not cache.collection.cache_lengths.any() and int(cache.get_seq_length()) == 0
    out = generate(model, "paged_kv", cache, "greedy")
    assert out.shape == (2, 7 + mode.new_tokens) and cache.collection.blocks.dtype == torch.float8_e4m3fn


@needs_mla_latent
def test_mla_update_refuses_decompressed_keys():
    """A transformers whose MLA attention hands `update` per-head K/V (not the latent) is refused."""
    model, _ = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    cfg = model.config
    cache = PagedCache(cfg, 1, 16, page_size=4, device="cpu", dtype=torch.float32)
    heads = torch.randn(1, cfg.num_attention_heads, 3, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    with pytest.raises(ValueError, match="^key_states: an MLA PagedCache expects the compressed latent"):
        cache.update(heads, heads, 0)
    assert int(cache.get_seq_length()) == 0


def test_mla_refused_where_transformers_decompresses_before_update(monkeypatch):
    """transformers 5.14 hands an MLA cache's `update` per-head K/V, 5.15 the latent and the rope key
    (read in their DeepSeek-V3 code; the matrix exact on 5.15.1 and 5.16.1): refused up to 5.14,
    naming `config.kv_lora_rank`, before anything is stored."""
    config = matrix.model_of(family("DeepSeek-V3 (MLA)"))[0].config
    import transformers  # (after the first model: building one replaces transformers' module object)

    monkeypatch.setattr(transformers, "__version__", "5.14.1")
    with pytest.raises(ValueError, match=r"^config.kv_lora_rank: transformers 5\.14\.1's MLA attention hands"):
        PagedCache(config, 1, 16, page_size=4, device="cpu", dtype=torch.float32)
    monkeypatch.setattr(transformers, "__version__", "5.15.0")
    PagedCache(config, 1, 16, page_size=4, device="cpu", dtype=torch.float32)


@needs_mla_latent
def test_mla_paged_kv_needs_the_attention_kwargs_in_update():
    """Under `paged_kv` the latents reach the attention through the layer's kwargs: an `update` without
    them (another transformers) is refused, naming `attn_implementation`."""
    model, _ = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    cfg = model.config
    matrix.set_attention(model, "paged_kv")
    try:
        cache = PagedCache(cfg, 1, 16, page_size=4)
        latent, rope = torch.randn(1, 1, 3, cfg.kv_lora_rank), torch.randn(1, 1, 3, cfg.qk_rope_head_dim)
        with pytest.raises(ValueError, match="^attn_implementation: 'paged_kv' on an MLA model needs"):
            cache.update(latent, rope, 0)
        layer_kwargs = {}
        assert cache.update(latent, rope, 0, kwargs=layer_kwargs) == (latent, rope)
        assert isinstance(layer_kwargs[hf_mla.PENDING_KWARG], hf_mla.PendingLatent)
    finally:
        matrix.set_attention(model, "sdpa")


# -- refusals ---------------------------------------------------------------------------------------
@pytest.fixture
def llama_pending():
    """A Llama under `paged_kv` and a `PagedCache` whose layer 0 got a 3-token `update`:
    (model, cache, the keys given, the `PendingKV` it returned); the model's attention restored after."""
    model, default_attn = matrix.model_of(family("Llama"))
    matrix.set_attention(model, "paged_kv")
    try:
        cache = PagedCache(model.config, 1, 16, page_size=4)
        key = torch.randn(1, 2, 3, 16)
        pending, _ = cache.update(key, key, 0)
        yield model, cache, key, pending
    finally:
        matrix.set_attention(model, default_attn)


def nothing_stored(cache: PagedCache) -> bool:
    return not cache.collection.cache_lengths.any() and not cache.collection.input_row_offsets.any()


def test_paged_kv_call_refuses_non_causal_layers_before_storing(llama_pending):
    """What only the attention call shows (a non-causal layer) is refused at the call, before the step
    begins."""
    model, cache, _, pending = llama_pending
    attn = model.model.layers[0].self_attn
    query = torch.randn(1, 4, 3, 16)
    non_causal = SimpleNamespace(config=model.config, layer_idx=0, is_causal=False)
    with pytest.raises(ValueError, match="^config.model_type: 'llama' layer 0 attends non-causally"):
        paged_kv_attention(non_causal, query, pending, pending, None)
    assert nothing_stored(cache)
    out, _ = paged_kv_attention(attn, query, pending, pending, None)  # the same call without it runs
    assert out.shape == (1, 3, 4, 16) and cache.collection.input_row_offsets[:2].tolist() == [0, 3]


def test_check_config_refusals_name_the_field():
    """Each refusal of `check_config` names its field; the paged-only ones only under `paged_kv`."""
    llama = matrix.model_of(family("Llama"))[0].config
    cases = [
        (dict(layer_types=["full_attention", "compressed_sparse_attention"]), "config.layer_types", False),
        (dict(layer_types=["full_attention", "indexed_attention"]), "config.layer_types", True),  # top-k keys
        (dict(layer_types=["linear_attention", "conv"]), "config.layer_types", False),  # nothing to page
        (dict(model_type="minimax"), "config.model_type", False),  # refuses any cache but its own
        (dict(attention_chunk_size=8), "config.layer_types", True),  # which layers are chunked?
        (dict(use_bidirectional_attention=True), "config.use_bidirectional_attention", True),
        (dict(model_type="falcon"), "config.model_type", True),
        (dict(kv_lora_rank=8, qk_rope_head_dim=4, model_type="unchecked_mla"), "config.model_type", True),
        (dict(use_cache=False), "config.use_cache", False),  # generate would feed every token again (MPT)
        (dict(model_type="openai-gpt"), "config.model_type", False),  # its forward takes no cache
        (dict(model_type="cpmant"), "config.model_type", False),  # masks by the keys' count
        (dict(model_type="dory"), "config.model_type", False),  # copies the cache's layers per loop
        (dict(cross_attention_layers=[1]), "config.cross_attention_layers", False),  # Mllama's text model
        (dict(v_head_dim=8), "config.v_head_dim", False),  # values narrower than keys (MiMo-V2-Flash)
        (dict(block_types=["recurrent", "attention"]), "config.block_types", False),  # RecurrentGemma, 5.17
    ]
    if hf_support._older_than(hf_support.INDEXED_LAYERS_SINCE):  # indexed layers, in both columns
        cases[1] = (cases[1][0], "config.layer_types", False)
    if hf_support._mla_update_gets_decompressed_kv():  # every MLA model, in both columns
        cases[7] = (cases[7][0], "config.kv_lora_rank", False)
    for fields, name, paged_only in cases:
        config = SimpleNamespace(**{**vars(llama), "layer_types": None, **fields})
        for paged in (False, True):
            if paged_only and not paged:
                hf_support.check_config(config, paged)
                continue
            with pytest.raises(ValueError, match=f"^{name}: "):
                hf_support.check_config(config, paged)
    hf_support.check_config(SimpleNamespace(**{**vars(llama), "use_bidirectional_attention": "vision"}), True)
    chunked = dict(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=8, model_type="gpt_oss")
    if not hf_support._generate_breaks_chunked_masks():  # (see the next test)
        hf_support.check_config(SimpleNamespace(**{**vars(llama), **chunked}), True)  # sinks and chunks: served
    if not hf_support._mla_update_gets_decompressed_kv():
        sarvam = dict(kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=16, model_type="sarvam_mla")  # DeepSeek-V3's
        hf_support.check_config(SimpleNamespace(**{**vars(llama), **sarvam}), True)


def test_models_an_older_transformers_builds_masks_for_are_refused_there(monkeypatch):
    """The model types whose code in older transformers ignores the cache's key columns (the sweep on
    5.5.4, 5.17 to 5.20.2) are refused there in both columns, naming `config.model_type`, and served from the
    version named."""
    llama = matrix.model_of(family("Llama"))[0].config
    import transformers  # (after the first model: building one replaces transformers' module object)

    for model_type, (since, _) in hf_support.OLD_MASK_MODEL_TYPES.items():
        config = SimpleNamespace(**{**vars(llama), "model_type": model_type})
        monkeypatch.setattr(transformers, "__version__", since)
        hf_support.check_config(config, False)
        monkeypatch.setattr(transformers, "__version__", "5.5.4")
        for paged in (False, True):
            with pytest.raises(ValueError, match=f"^config.model_type: '{model_type}' in transformers 5.5.4 "):
                hf_support.check_config(config, paged)


def test_chunked_layers_refused_where_transformers_generate_breaks_their_masks(monkeypatch):
    """transformers 5.9 to 5.19's `generate` hands `create_chunked_causal_mask` a `block_sequence_ids` it
    does not take (every compileable cache, StaticCache too): chunked models are refused there, in
    both columns, naming `config.layer_types`; where the mask function takes it they are served."""
    from transformers import masking_utils

    config = matrix.model_of(family("Llama4 (text)"))[0].config
    if not hf_support._generate_breaks_chunked_masks():
        for paged in (False, True):
            hf_support.check_config(config, paged)  # this transformers: served
    taken = masking_utils.create_chunked_causal_mask

    def without_block_ids(config, inputs_embeds, attention_mask, past_key_values, position_ids=None):
        return taken(config, inputs_embeds, attention_mask, past_key_values, position_ids)

    monkeypatch.setattr(masking_utils, "create_chunked_causal_mask", without_block_ids)
    if "block_sequence_ids" not in inspect.signature(masking_utils.create_masks_for_generate).parameters:
        pytest.skip("this transformers' create_masks_for_generate passes no block_sequence_ids")
    for paged in (False, True):
        with pytest.raises(ValueError, match="^config.layer_types: chunked_attention layers: transformers "):
            hf_support.check_config(config, paged)
    with pytest.raises(ValueError, match="^config.layer_types: chunked_attention"):
        PagedCache(config, 1, 16, page_size=4)
    hf_support.check_config(matrix.model_of(family("Llama"))[0].config, True)  # no chunked layers: served


def test_a_window_the_attention_does_not_apply_is_refused_once_crossed():
    """Moshi names a `sliding_window` that its attention does not apply (a full causal mask) while
    transformers' caches drop the keys outside it: served where no row outgrows the window, else refused."""
    llama = matrix.model_of(family("Llama"))[0].config
    moshi = SimpleNamespace(**{**vars(llama), "layer_types": None, "model_type": "moshi", "sliding_window": 8})
    assert hf_support.cache_groups(moshi, [0, 1, 2], 8)[0][0].sliding_window is None
    with pytest.raises(ValueError, match="^config.sliding_window: 'moshi' attends to every earlier token"):
        hf_support.cache_groups(moshi, [0, 1, 2], 9)
    mistral = SimpleNamespace(**{**vars(moshi), "model_type": "mistral"})  # a window its attention applies
    assert hf_support.cache_groups(mistral, [0, 1, 2], 9)[0][0].sliding_window == 8


def test_pending_kv_used_as_a_tensor_is_refused_before_storing(llama_pending):
    """Under `paged_kv`, model code that uses the K/V `update` returns as tensors (DiffLlama splits the
    values, Doge projects them, JetMoE repeats them) gets a `ValueError` naming `config.model_type`,
    whether by a method or a torch function, before the step begins."""
    _, cache, key, pending = llama_pending
    refused = "^config.model_type: 'llama' layer 0 uses the K/V the cache returns itself"
    with pytest.raises(ValueError, match=refused + r" \(\.transpose\)"):
        pending.transpose(1, 2)
    with pytest.raises(ValueError, match=refused + r" \(chunk\)"):
        torch.chunk(pending, 2, dim=1)
    with pytest.raises(ValueError, match=refused + r" \(cat\)"):
        torch.cat([key, pending], dim=2)
    assert nothing_stored(cache)
    assert pending.key is key and pending._replace(key=key).value is key  # its own fields still work


def test_default_attention_gets_contiguous_kv():
    """Under the default attention `update` returns contiguous K/V, as DynamicCache's are (GPT-NeoX-Japanese
    `view`s them), holding the step's keys at their columns."""
    model, default_attn = matrix.model_of(family("Llama"))
    matrix.set_attention(model, default_attn)
    cache = PagedCache(model.config, 2, 16, page_size=4)
    key, value = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16)
    keys, values = cache.update(key, value, 0)
    assert keys.shape == (2, 2, 16, 16) and keys.is_contiguous() and values.is_contiguous()
    assert torch.equal(keys[:, :, :3], key) and torch.equal(values[:, :, :3], value)


def test_switching_to_paged_kv_is_checked_at_the_next_step():
    """A cache built under the default attention checks the paged-only refusals when the model
    switches to `paged_kv`, at the next step, before its first layer stores anything (here when the
    step's mask is made, before the pool exists)."""
    bidirectional = dataclasses.replace(
        family("Gemma3 (text)"), name="Gemma3 (text, bidirectional)", overrides={"use_bidirectional_attention": True}
    )
    model, default_attn = matrix.model_of(bidirectional)
    matrix.set_attention(model, default_attn)
    cache = PagedCache(model.config, 2, 24, page_size=4)
    matrix.set_attention(model, "paged_kv")
    try:
        ids = torch.randint(3, matrix.VOCAB, (2, 5))
        refused = pytest.raises(ValueError, match="^config.use_bidirectional_attention: True makes the attention")
        with refused, torch.no_grad():
            model(ids, **{cache_kwarg(model): cache})
        assert not matrix.stored([cache])
    finally:
        matrix.set_attention(model, default_attn)


def test_pool_follows_the_keys_unless_allocated_from_the_config():
    """Falcon (multi_query) caches 1 K/V head where its config counts 4: a lazily allocated pool takes
    the keys' shape; one allocated at construction from the config refuses the keys, naming `config`."""
    model, default_attn = matrix.model_of(family("Falcon"))
    matrix.set_attention(model, default_attn)
    lazy = PagedCache(model.config, 2, 24, page_size=4)
    ids = torch.randint(3, matrix.VOCAB, (2, 5))
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): lazy})
    assert lazy.collection.params.num_kv_heads == 1 and lazy.num_kv_heads == 1
    eager = PagedCache(model.config, 2, 24, page_size=4, device="cpu", dtype=torch.float32)
    refused = pytest.raises(ValueError, match="^config: the model's keys have 1 heads of 16, but the pool")
    with refused, torch.no_grad():
        model(ids, **{cache_kwarg(model): eager})
    assert not eager.collection.cache_lengths.any()


@needs_mla_kwargs
def test_compiled_mla_decode_matches_and_does_not_recompile():
    """DeepSeek-V3's decode step under `paged_kv` compiled with `fullgraph=True` (the latents reach the
    attention through the layer's kwargs, inside the graph): DynamicCache's tokens, and a second
    `generate` on the reset cache reuses the graph. (The default-attention path compiles too: run by hand.)"""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model, default_attn = matrix.model_of(family("DeepSeek-V3 (MLA)"))
    expected = reference(model, default_attn)
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    compile_config._compile_all_devices = True  # generate compiles the decode step off-GPU only when told
    mode = matrix.dataclasses.replace(matrix.MODE_SPECS["batch"], args=dict(compile_config=compile_config))
    cache = PagedCache(model.config, len(mode.lengths), matrix.max_cache_len(mode), page_size=4)
    matrix.set_attention(model, "paged_kv")
    torch._dynamo.reset()
    counters.clear()
    try:
        assert torch.equal(matrix.run(model, lambda: cache, mode)[0].tokens, expected)
        assert counters["stats"]["unique_graphs"] >= 1
        cache.reset()
        with torch.compiler.set_stance("fail_on_recompile"):
            assert torch.equal(matrix.run(model, lambda: cache, mode)[0].tokens, expected)
    finally:
        matrix.set_attention(model, default_attn)


# -- the sweep over every causal LM (tests/transformers_sweep.py) -------------------------------------
def test_sweep_shrinks_configs_and_classes_models():
    """The sweep keeps a layer-type pattern in fewer layers (cutting the other per-layer lists alike),
    runs one model type in both columns, and classes a model by its worst cell."""
    import transformers_sweep as sweep

    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    tiny = sweep.shrink(dict(num_hidden_layers=6, layer_types=kinds, mlp_types=list(range(6)), hidden_size=512))
    assert tiny["layer_types"] == ["sliding_attention", "full_attention"] * 2 and tiny["num_hidden_layers"] == 4
    assert tiny["mlp_types"] == [0, 5, 0, 5] and tiny["hidden_size"] == 64
    result = sweep.sweep_one("qwen2")
    assert result["cls"] == "EXACT" and set(result["cells"].values()) == {"exact"}
    assert len(result["cells"]) == len(matrix.COLUMNS) * len(sweep.MODES)
    assert sweep.classify(["exact", "refused (config.model_type)"]) == "REFUSED"
    assert sweep.classify(["refused (config.model_type)", "WRONG: wrong tokens", "CRASHED: x"]) == "WRONG"
