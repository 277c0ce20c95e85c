"""`PagedCache` on sparse-attention models (transformers' "indexed_attention" layers: DeepSeek-V3.2,
GLM-MoE-DSA), whose indexer keeps a key per token beside the MLA latent and picks each query's top-k
keys (`hf_indexed.PagedIndexedLayer`), under the model's attention (sdpa) and under `paged_kv` (absorbed
MLA over each query's top-k latent rows). `index_topk` is 3, below every prompt's length, so a wrong
indexer key or a wrong pick changes which keys a query reads. Every oracle is transformers' own
`StaticCache` of the same `max_cache_len` under sdpa: top-k flips where fp32 rounding reorders a
near-tie, and caches of static shapes round differently from `DynamicCache`
(tests/transformers_matrix.py, `Family.reference`)."""

from __future__ import annotations

import contextlib
import json
import re
import warnings

import crafted_files
import pytest
import torch

pytest.importorskip("transformers")
import transformers
import transformers_matrix as matrix
from test_hf_states import assert_compiled_decode_does_not_recompile, generate, go_on
from transformers import StaticCache

from torch_paged_kv.checkpoint import CheckpointError, read_info
from torch_paged_kv.integrations import hf_indexed, hf_support
from torch_paged_kv.integrations.hf_checkpoint import METADATA_KEY
from torch_paged_kv.integrations.transformers import PagedCache

MODELS = [("DeepseekV32Config", "DeepseekV32ForCausalLM"), ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")]
pytestmark = [
    pytest.mark.skipif(
        not hasattr(transformers, MODELS[0][0]), reason="this transformers has no sparse-attention (DSA) models"
    ),
    pytest.mark.skipif(
        hf_support._older_than(hf_support.INDEXED_LAYERS_SINCE),
        reason=f"indexed layers are refused before transformers {hf_support.INDEXED_LAYERS_SINCE}",
    ),
]
DSA = next(f for f in matrix.FAMILIES if f.config == MODELS[0][0])


def dsa_model(config_name: str, model_name: str, attention: str = "sdpa", **overrides) -> torch.nn.Module:
    """A tiny random model of the type (the matrix's DeepSeek-V3.2 config) under `attention`, its indexer
    keeping the top 3 keys per query."""
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {**matrix.TINY, **DSA.overrides, **overrides}
        config = config_class(**{k: v for k, v in kwargs.items() if v is not None})
        torch.manual_seed(0)
        model = model_class(config).float().eval()
    model.set_attn_implementation(attention)
    return model


@pytest.fixture(scope="module", params=MODELS, ids=[m for _, m in MODELS])
def model(request) -> torch.nn.Module:
    return dsa_model(*request.param)


MAX_CACHE_LEN = 40
ATTENTIONS = ["sdpa", "paged_kv"]
PAGED_KV_SINCE = "5.24"  # MLA under paged_kv: `Cache.update(kwargs=)` (tests/transformers_matrix.py MLA_BEFORE_5_24)


@contextlib.contextmanager
def attending(model, attention: str):
    """`model` under `attention` inside the block (skipped where paged_kv does not serve MLA yet)."""
    if attention == "paged_kv" and hf_support._older_than(PAGED_KV_SINCE):
        pytest.skip(f"paged_kv serves MLA from transformers {PAGED_KV_SINCE} (test_paged_kv_refusals covers before)")
    before = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def paged(model, rows: int = 3) -> PagedCache:
    return PagedCache(model.config, max_batch_size=rows, max_cache_len=MAX_CACHE_LEN, page_size=4)


def static(model) -> StaticCache:
    """The oracle's cache: the same key columns as `paged`'s."""
    return StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)


@pytest.mark.parametrize(
    "lengths, options",
    [
        ((5, 9, 3), {}),
        ((6, 4), {"num_beams": 2, "num_return_sequences": 2}),
        ((7,), {"prompt_lookup_num_tokens": 3}),
    ],
    ids=["padded batch", "beam search", "prompt lookup"],
)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_sparse_attention_gives_static_cache_tokens(model, lengths, options, attention):
    """Greedy over left-padded prompts, beam search (rows reordered) and speculative decoding (drafts
    cropped): the tokens of StaticCache."""
    rows = len(lengths) * options.get("num_beams", 1)
    if "prompt_lookup_num_tokens" in options and not hf_support.serves_indexed_speculative():
        with pytest.raises(ValueError, match="^cache: layers \\[[0-9, ]+\\] attend to the top-k keys"):
            generate(model, paged(model, rows), lengths, 10, **options)  # (StaticCache refuses it there too)
        return
    expected = generate(model, static(model), lengths, 10, **options)
    with attending(model, attention):
        assert torch.equal(generate(model, paged(model, rows), lengths, 10, **options), expected)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_reset_cache_takes_another_batch(model, attention):
    """The indexer keys start again at column 0 after `reset`, for a batch of another size too."""
    cache = paged(model)
    for lengths in [(5, 9), (4, 6, 8), (7, 3)]:
        cache.reset()
        expected = generate(model, static(model), lengths, 6)
        with attending(model, attention):
            assert torch.equal(generate(model, cache, lengths, 6), expected), lengths


def test_indexer_bytes_count_the_key_buffers(model):
    """`indexer_bytes()`: nothing before a step, then one `max_batch_size` x `max_cache_len` x
    `index_head_dim` buffer per indexed layer that writes keys; `kv_bytes_in_use()` leaves them out."""
    cache = paged(model)
    assert cache.indexer_bytes() == 0
    generate(model, cache, (5, 9), 2)
    config = model.config
    types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers  # "shared": no keys
    writers = [i for i in cache.indexed_layers if types[i] != "shared"]
    one = 3 * MAX_CACHE_LEN * config.index_head_dim * 4  # (rows, columns, width, fp32)
    assert cache.indexer_bytes() == len(writers) * one > 0


def test_paged_kv_refusals(model, monkeypatch):
    """`paged_kv` is refused before anything is stored: before transformers 5.24 naming
    `attn_implementation` (MLA needs `Cache.update(kwargs=)`), and for a sparse-attention model type it
    was not checked on naming `config.layer_types`."""
    cache = paged(model)
    if hf_support._older_than(PAGED_KV_SINCE):
        message = "^attn_implementation: 'paged_kv' on an MLA model needs"
    else:
        monkeypatch.setattr(hf_support, "SPARSE_MLA_MODEL_TYPES", ())
        message = (
            "^config.layer_types: layers \\[[0-9, ]+\\] are 'indexed_attention' .* paged_kv applies only for \\[\\]"
        )
    model.set_attn_implementation("paged_kv")
    try:
        with pytest.raises(ValueError, match=message):
            generate(model, cache, (5, 7), 4)
    finally:
        model.set_attn_implementation("sdpa")
    assert cache.pool is None or not cache.pool.lengths.any()


@pytest.mark.skipif(not hasattr(transformers, "HYV4Config"), reason="this transformers has no HY-V4")
def test_mla_with_sinks_under_paged_kv_gives_static_cache_tokens():
    """HY-V4's MLA attention adds sinks (`s_aux`): under `paged_kv` they reach `mla_attention`'s `sinks`,
    over padded prompts too, and the tokens are StaticCache's (under its eager attention)."""
    model = dsa_model("HYV4Config", "HYV4ForCausalLM", "eager")  # (no sdpa)
    expected = generate(model, static(model), (5, 9, 3), 8)
    with attending(model, "paged_kv"):
        assert torch.equal(generate(model, paged(model), (5, 9, 3), 8), expected)


def test_key_positions_are_the_real_tokens_before_each_pick():
    """A visible pick at column j is the row's page position j' = the count of real (unpadded) columns
    before j, as the pages hold only real tokens; picks the query may not see (future, padding, a
    padded query's) are -1. Rows padded at the start and in the middle, a step of 4 new columns."""
    gen = torch.Generator().manual_seed(0)
    batch, new, past, k = 3, 4, 8, 5
    columns = past + new + 3  # (unfilled columns at the end, as in a static layout)
    padding = torch.ones(batch, past + new, dtype=torch.bool)
    padding[0, :3] = False  # left padding
    padding[1, 4:6] = False  # padding in the middle (a second prompt after the first generate)
    padding[2, past + 1] = False  # a padded new token
    causal = torch.arange(columns)[None, :] <= torch.arange(past, past + new)[:, None]  # [new, columns]
    real_columns = torch.cat((padding, torch.zeros(batch, columns - past - new, dtype=torch.bool)), dim=1)
    mask = causal[None] & real_columns[:, None, :] & padding[:, past:, None]  # padded queries see nothing
    indices = torch.randint(0, columns, (batch, new, k), generator=gen, dtype=torch.int32)
    expected = torch.full((batch * new, k), -1, dtype=torch.int32)
    for b in range(batch):
        for s in range(new):
            for i, j in enumerate(indices[b, s].tolist()):
                if mask[b, s, j]:
                    expected[b * new + s, i] = int(padding[b, :j].sum())
    assert (expected >= 0).any() and (expected == -1).any()
    assert torch.equal(hf_indexed.key_positions(indices, mask[:, None]), expected)


def test_a_forward_without_cache_applies_the_top_k():
    """`paged_kv` with no cache at all (one forward): the logits of sdpa's, which masks unpicked keys."""
    model = dsa_model(*MODELS[0])
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
        with attending(model, "paged_kv"):
            got = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_generation_resumes_exactly_after_save_and_load(model, tmp_path, attention):
    """Generate, save, load into a fresh cache, generate on: the tokens of one uninterrupted `generate`
    over StaticCache; the indexer keys travel as extra tensors, bit for bit."""
    lengths, first, more = (5, 9), 4, 5
    expected = generate(model, static(model), lengths, first + more)
    cache = paged(model, rows=2)
    with attending(model, attention):
        so_far = generate(model, cache, lengths, first)
    cache.save(tmp_path / "kv.safetensors")
    info = read_info(tmp_path / "kv.safetensors")
    columns = int(cache.get_seq_length())
    assert set(info.extra_tensors) == {f"extra.indexer.{i}" for i in cache.indexer_keys(columns)}
    with attending(model, attention):  # (a file remembers whether it holds padding: the attention must match)
        loaded = PagedCache.load(tmp_path / "kv.safetensors", model.config, max_cache_len=MAX_CACHE_LEN)
        for i, keys in cache.indexer_keys(columns).items():
            assert keys.shape[:2] == (2, columns) and torch.equal(loaded.indexer_keys(columns)[i], keys), i
        assert torch.equal(go_on(model, loaded, so_far, lengths, more), expected)


@pytest.mark.parametrize("damage", ["unlisted", "missing", "other layer"])
def test_files_whose_indexer_keys_do_not_fit_are_refused(model, tmp_path, monkeypatch, damage):
    """Keys the metadata does not list, a file without keys for a model that has indexed layers, keys
    of a layer that the config does not index: `CheckpointError` naming the file."""
    cache = paged(model, rows=2)
    generate(model, cache, (5, 9), 3)
    path = tmp_path / "kv.safetensors"
    layers = sorted(cache.indexer_keys(int(cache.get_seq_length())))
    if damage == "missing":  # a consistent file of the same pool without them
        monkeypatch.setattr(PagedCache, "indexer_keys", lambda self, columns: {})
    cache.save(path)
    if damage == "unlisted":
        crafted_files.rewrite(path, _edited_state(lambda state: state.update(indexer_layers=[])))
        message = "lists the extra tensors \\[\\], the file holds \\['extra.indexer"
    elif damage == "missing":
        message = "holds indexer keys of layers \\[\\], but this config's indexed layers are \\[0"
    config = model.config
    if damage == "other layer":  # the same pool, the last layer plain full attention
        config = config.__class__.from_dict(
            {**config.to_dict(), "layer_types": [*config.layer_types[:-1], "full_attention"]}
        )
        message = f"holds indexer keys of layers {re.escape(str(layers))}, but this config's indexed layers are \\[0"
    with pytest.raises(CheckpointError, match=message) as error:
        PagedCache.load(path, config)
    assert str(path) in str(error.value)


def _edited_state(change):
    """An edit applying `change` to the cache's own metadata (a dict)."""

    def edit(header):
        meta = header["__metadata__"]
        state = json.loads(json.loads(meta["user_metadata"])[METADATA_KEY])
        change(state)
        meta["user_metadata"] = json.dumps({METADATA_KEY: json.dumps(state)})

    return edit


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_shared_indexer_layers_keep_no_keys(tmp_path, attention):
    """GLM-MoE-DSA's "shared" layers reuse the previous layer's top-k and write no indexer keys: the
    tokens are StaticCache's, the file holds the other layers' keys only, and resume is exact."""
    model = dsa_model(*MODELS[1], indexer_types=["full", "shared", "full"])
    lengths, first, more = (5, 9), 4, 5
    expected = generate(model, static(model), lengths, first + more)
    cache = paged(model, rows=2)
    with attending(model, attention):
        so_far = generate(model, cache, lengths, first)
    assert sorted(cache.indexer_keys(int(cache.get_seq_length()))) == [0, 2]
    cache.save(tmp_path / "kv.safetensors")
    assert set(read_info(tmp_path / "kv.safetensors").extra_tensors) == {"extra.indexer.0", "extra.indexer.2"}
    with attending(model, attention):
        loaded = PagedCache.load(tmp_path / "kv.safetensors", model.config, max_cache_len=MAX_CACHE_LEN)
        assert torch.equal(go_on(model, loaded, so_far, lengths, more), expected)


def test_indexed_layers_are_refused_where_unchecked(model, monkeypatch):
    """Before transformers `INDEXED_LAYERS_SINCE` indexed layers are refused naming `config.layer_types`."""
    monkeypatch.setattr(hf_support, "_transformers_version", lambda: "5.17.0")
    with pytest.raises(ValueError, match="^config.layer_types: layers \\[[0-9, ]+\\] are \\['indexed_attention'\\]"):
        paged(model)


@pytest.mark.slow  # (about 30 s each on a cold inductor cache)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_compiled_decode_with_indexed_layers_does_not_recompile(attention):
    """`generate` with a compiled decode step (fullgraph) over the latent pages and the indexer keys:
    greedy tokens equal StaticCache's, and a second `generate` after `reset` reuses the graph."""
    model = dsa_model(*MODELS[0])
    expected = generate(model, static(model), (5, 7), 8)
    with attending(model, attention):
        assert_compiled_decode_does_not_recompile(model, paged(model, rows=2), expected)
