"""Encoder-decoder models (T5, BART, Whisper, Marian, ...) with `PagedCache.for_encoder_decoder`: tokens and
logits of transformers' own cache (`EncoderDecoderCache(DynamicCache(), DynamicCache())`; under `eager` for
the `paged_kv` column, as in the matrix) in greedy, padded-batch and beam modes, decoders of another depth
and head count than their encoders; a bare `PagedCache` refused; models refused before anything is stored;
save and resume; the K/V a layer holds read back (`keys` / `values`) against `StaticCache`'s.
tests/seq2seq_sweep.py runs every encoder-decoder model type of transformers."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import transformers_matrix as matrix

transformers = pytest.importorskip("transformers")
from seq2seq_sweep import MODES, generate  # noqa: E402
from transformers import AutoConfig, DynamicCache, EncoderDecoderCache, StaticCache  # noqa: E402

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg  # noqa: E402

TOKENS = dict(
    pad_token_id=matrix.PAD,
    bos_token_id=matrix.BOS,
    eos_token_id=matrix.EOS,
    decoder_start_token_id=matrix.BOS,
    forced_eos_token_id=None,  # (BART forces EOS at the last step: a generation cut in two would differ)
)
CONFIGS: dict[str, dict[str, Any]] = {
    # decoders of another depth and head count than their encoders
    "bart": dict(
        d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2, decoder_attention_heads=8,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    ),
    "t5": dict(d_model=64, d_ff=64, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=3),
    "whisper": dict(
        d_model=64, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=64,
        suppress_tokens=None, begin_suppress_tokens=None,
    ),
    "marian": dict(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    ),
}  # fmt: skip
PAGED_KV = ("bart", "whisper", "marian")  # T5's relative position bias: refused under paged_kv (below)
_models: dict[str, torch.nn.Module] = {}


def _model(model_type: str) -> torch.nn.Module:
    if model_type not in _models:
        config = AutoConfig.for_model(model_type, vocab_size=matrix.VOCAB, **TOKENS, **CONFIGS[model_type])
        model_class = (
            transformers.AutoModelForSpeechSeq2Seq if model_type == "whisper" else transformers.AutoModelForSeq2SeqLM
        )
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _models[model_type] = model_class.from_config(config).float().eval()
    return _models[model_type]


def _own_cache() -> EncoderDecoderCache:
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def _paged(model: torch.nn.Module, mode: matrix.Mode, **options: Any) -> EncoderDecoderCache:
    return PagedCache.for_encoder_decoder(model.config, len(mode.lengths) * mode.beams, 32, page_size=4, **options)


@pytest.mark.parametrize("mode_name", list(MODES))
@pytest.mark.parametrize(
    ("model_type", "column"),
    [(t, c) for t in CONFIGS for c in matrix.COLUMNS if c == "default" or t in PAGED_KV],  # (T5 under paged_kv:
)  # test_refused_before_anything_is_stored)
def test_tokens_and_logits_of_transformers_own_cache(model_type: str, column: str, mode_name: str) -> None:
    model, mode = _model(model_type), MODES[mode_name]
    default = model.config._attn_implementation
    try:
        matrix.set_attention(model, default if column == "default" else "eager")
        expected = generate(model, _own_cache(), mode)
        matrix.set_attention(model, default if column == "default" else "paged_kv")
        cache = _paged(model, mode)
        got = generate(model, cache, mode)
    finally:
        matrix.set_attention(model, default)
    assert matrix.compare(got, expected) == matrix.EXACT
    paged = cache.self_attention_cache
    assert isinstance(paged, PagedCache)
    decoder_layers = CONFIGS[model_type].get("decoder_layers") or CONFIGS[model_type]["num_decoder_layers"]
    assert len(paged.cached_layers) == decoder_layers  # the decoder's, not the encoder's
    assert int(paged.get_seq_length()) == got[0].tokens.shape[1] - 1  # the decoder's tokens (its start too) but
    # the last, whose K/V no step computed


def test_a_bare_cache_is_refused_for_an_encoder_decoder_config() -> None:
    config = _model("bart").config
    with pytest.raises(ValueError, match=r"^config\.is_encoder_decoder: .*PagedCache\.for_encoder_decoder"):
        PagedCache(config, 2, 32)
    with pytest.raises(ValueError, match=r"^encoder_decoder: True, but LlamaConfig"):
        PagedCache(transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2), 2, 32,
                   encoder_decoder=True)  # fmt: skip
    decoder = transformers.BartConfig(
        **CONFIGS["bart"], is_decoder=True, is_encoder_decoder=False, add_cross_attention=True
    )
    with pytest.raises(ValueError, match=r"^config\.add_cross_attention: "):
        PagedCache(decoder, 2, 32)


def test_the_decoder_view_follows_set_attn_implementation() -> None:
    """The cache reads the model's attention from the model's config (transformers' decoder view of a flat
    encoder-decoder config is a copy): `paged_kv` set after the cache is built is used."""
    model, mode = _model("bart"), MODES["greedy"]
    default = model.config._attn_implementation
    cache = _paged(model, mode)
    try:
        matrix.set_attention(model, "eager")
        expected = generate(model, _own_cache(), mode)
        matrix.set_attention(model, "paged_kv")
        got = generate(model, cache, mode)
    finally:
        matrix.set_attention(model, default)
    assert cache.self_attention_cache.attends_from_pages
    assert matrix.compare(got, expected) == matrix.EXACT


@pytest.mark.parametrize(
    ("model_type", "column", "field"),
    [
        # its relative position bias (older transformers: T5 reshapes the K/V the cache returns itself)
        ("t5", "paged_kv", "attn_implementation|config.model_type"),
        ("led", "default", "config.model_type"),  # no mask for one-token steps
        ("fsmt", "default", "config.model_type"),  # its own attention over every returned column
        ("t5gemma2", "paged_kv", "config.model_type"),  # self- and cross-attention keys in one call
    ],
)
def test_refused_before_anything_is_stored(model_type: str, column: str, field: str) -> None:
    import seq2seq_sweep

    model = _model(model_type) if model_type in CONFIGS else seq2seq_sweep.build(model_type)
    default, mode = model.config._attn_implementation, MODES["batch"]
    caches: list[PagedCache] = []
    try:
        matrix.set_attention(model, default if column == "default" else "paged_kv")
        with pytest.raises(ValueError, match=rf"^({field.replace('.', '[.]')}): ") as raised:
            cache = _paged(model, mode)
            caches.append(cache.self_attention_cache)
            generate(model, cache, mode)
    finally:
        matrix.set_attention(model, default)
    assert matrix.refusal(raised.value, caches) in [str(matrix.Refused(f)) for f in field.split("|")]


@pytest.mark.parametrize("column", matrix.COLUMNS)
def test_save_and_resume(tmp_path, column: str) -> None:
    """Generate 4 tokens, save the paged part, load it in a new cache beside a fresh cross-attention cache,
    generate 4 more from the tokens so far: the tokens and logits of transformers' own cache going on from
    the same 4 tokens (not those of one 8-token generation: transformers' second call differs from it)."""
    import seq2seq_sweep

    model, mode = _model("bart"), MODES["batch"]
    default = model.config._attn_implementation
    inputs = seq2seq_sweep.inputs(model, mode)
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=matrix.PAD)
    kwargs.update(max_new_tokens=4, min_new_tokens=4)

    def two_calls(first_cache: Any, second_cache: Any) -> list[matrix.Generated]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            half = model.generate(**inputs, **{cache_kwarg(model): first_cache}, **kwargs)
            second = model.generate(
                **inputs, decoder_input_ids=half.sequences, **{cache_kwarg(model): second_cache()}, **kwargs
            )
        return [matrix.Generated(o.sequences, torch.stack(o.logits, 1)) for o in (half, second)]

    def reloaded() -> EncoderDecoderCache:
        first.self_attention_cache.save(tmp_path / "kv.safetensors")
        loaded = PagedCache.load(tmp_path / "kv.safetensors", model.config, encoder_decoder=True)
        assert loaded.rows == len(mode.lengths)
        return EncoderDecoderCache(loaded, DynamicCache())

    try:
        matrix.set_attention(model, default if column == "default" else "eager")
        own = _own_cache()
        expected = two_calls(own, lambda: own)
        matrix.set_attention(model, default if column == "default" else "paged_kv")
        first = _paged(model, mode)
        got = two_calls(first, reloaded)
    finally:
        matrix.set_attention(model, default)
    assert matrix.compare(got, expected) == matrix.EXACT


@pytest.mark.parametrize("model_type", ["whisper", "llama"])
def test_layer_keys_and_values_read_back_as_static_caches(model_type: str) -> None:
    """After a generation under the model's default attention, each layer's `keys` / `values` equal transformers'
    `StaticCache` layers' (the same `max_cache_len` columns, padding included); a tensor set there is refused.
    Whisper's `generate` reads them to return the cache per row."""
    if model_type == "whisper":
        model, mode = _model("whisper"), MODES["greedy"]
        decoder = model.config.get_text_config(decoder=True)
        static = EncoderDecoderCache(StaticCache(config=decoder, max_cache_len=32), DynamicCache())
        paged = _paged(model, mode)
        generate(model, static, mode)
        generate(model, paged, mode)
        static_layers, paged_layers = static.self_attention_cache.layers, paged.self_attention_cache.layers
    else:
        family = next(f for f in matrix.FAMILIES if f.name == "Llama")
        model, _ = matrix.model_of(family)
        mode = matrix.MODE_SPECS["batch"]
        static_cache = StaticCache(config=model.config, max_cache_len=32)
        paged_cache = PagedCache(model.config, len(mode.lengths), 32, page_size=4)
        matrix.run(model, lambda: static_cache, mode)
        matrix.run(model, lambda: paged_cache, mode)
        static_layers, paged_layers = static_cache.layers, paged_cache.layers
    for s, p in zip(static_layers, paged_layers, strict=True):
        assert torch.equal(p.keys, s.keys) and torch.equal(p.values, s.values)
    with pytest.raises(ValueError, match=r"^keys: "):
        paged_layers[0].keys = torch.zeros(1)
    assert PagedCache(_model("whisper").config, 1, 8, encoder_decoder=True).layers[0].keys is None  # no step yet


def test_a_causal_layer_passing_is_causal_false_with_its_mask_stays_causal() -> None:
    """Moonshine's decoder passes `is_causal=False` whenever it has a mask (SDPA then reads causality from the
    mask); `paged_kv`'s causal mask leaves causality to the attention, so the call stays causal: a decoder
    forward with a left-padded decoder mask and no cache gives eager's logits on the real rows."""
    import seq2seq_sweep

    model = seq2seq_sweep.build("moonshine")
    default = model.config._attn_implementation
    inputs = seq2seq_sweep.inputs(model, matrix.Mode((6, 6), 1))
    ids, mask = matrix.prompts(matrix.Mode((6, 4), 1))
    logits = {}
    try:
        for attn in ("eager", "paged_kv"):
            matrix.set_attention(model, attn)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = model(**inputs, decoder_input_ids=ids, decoder_attention_mask=mask, use_cache=False)
            logits[attn] = out.logits * mask[..., None]
    finally:
        matrix.set_attention(model, default)
    assert (logits["paged_kv"] - logits["eager"]).abs().max().item() <= matrix.LOGIT_TOLERANCE * 10
