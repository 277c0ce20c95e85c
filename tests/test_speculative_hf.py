"""transformers' speculative decoding with `PagedCache`: assisted generation (`assistant_model=`) and
prompt-lookup decoding verify several draft tokens per step and `crop` the rejected ones. Greedy
speculative decoding is lossless, so its tokens must be plain greedy decoding's: with `DynamicCache`
and with `PagedCache` under both attention modes, for a full-attention model, a sliding-window one
and one of sliding-window and full layers (two layer groups; windows crossed, and the pages that
left them given back) and an FP8 cache (against greedy decoding over the same FP8 cache)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import transformers
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    initializer_range=0.2,
)
NEW_TOKENS = 24
WINDOW = 6


def _model(config_class, model_class, layers: int, seed: int, **overrides):
    torch.manual_seed(seed)
    return model_class(config_class(num_hidden_layers=layers, **{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def models():
    """name -> (target, draft): a full-attention Llama, a Mistral whose window the rows cross (every
    layer slides: one group), a Gemma3 whose layer 0 slides and layer 1 attends fully (two groups)."""
    torch.set_num_threads(1)
    hybrid = dict(sliding_window=WINDOW, sliding_window_pattern=2, head_dim=16, initializer_range=0.05)  # (at 0.2,
    # this Gemma3 repeats one token, which every draft guesses)
    return {
        "llama": (_model(LlamaConfig, LlamaForCausalLM, 2, 0), _model(LlamaConfig, LlamaForCausalLM, 1, 1)),
        "sliding": (
            _model(MistralConfig, MistralForCausalLM, 2, 2, sliding_window=WINDOW),
            _model(MistralConfig, MistralForCausalLM, 1, 3, sliding_window=WINDOW),
        ),
        "hybrid": (
            _model(Gemma3TextConfig, Gemma3ForCausalLM, 2, 4, **hybrid),
            _model(Gemma3TextConfig, Gemma3ForCausalLM, 1, 5, **hybrid),
        ),
    }


def _prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    body = torch.randint(3, VOCAB, (1, 6), generator=g)
    return torch.cat((body, body, body[:, :3]), dim=1)  # repeats: prompt lookup finds drafts


def _generate(model, cache, **kwargs) -> torch.Tensor:
    ids = _prompt()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
            **{cache_kwarg(model): cache},
            **kwargs,
        )
    return out[0, ids.shape[1] :]


def _paged(model, attn: str, **options) -> PagedCache:
    model.set_attn_implementation(attn)
    return PagedCache(model.config, max_batch_size=1, max_cache_len=64, page_size=4, **options)


SPECULATION = {
    "assisted": lambda draft: dict(assistant_model=draft),
    "prompt-lookup": lambda draft: dict(prompt_lookup_num_tokens=3),
}


@pytest.mark.parametrize("kind", SPECULATION)
@pytest.mark.parametrize("attn", ["sdpa", "paged_kv"])
@pytest.mark.parametrize("name", ["llama", "sliding", "hybrid"])
def test_speculative_decoding_gives_greedy_tokens(models, name, attn, kind, monkeypatch):
    dropped: list[int] = []  # columns each crop dropped (transformers passes a count, or before 5.24 a length)
    crop = PagedCache.crop

    def recording_crop(self, n: int) -> None:
        before = int(self.get_seq_length())
        crop(self, n)
        dropped.append(before - int(self.get_seq_length()))

    monkeypatch.setattr(PagedCache, "crop", recording_crop)
    target, draft = models[name]
    target.set_attn_implementation("sdpa")
    expected = _generate(target, DynamicCache(config=target.config))
    oracle_error = None  # transformers' own sliding DynamicCache cannot crop before 5.23 (5.5, 5.17 raise)
    try:
        speculated = _generate(target, DynamicCache(config=target.config), **SPECULATION[kind](draft))
    except (RuntimeError, ValueError) as e:
        oracle_error = e
    else:
        assert torch.equal(speculated, expected)
    cache = _paged(target, attn)
    try:
        got = _generate(target, cache, **SPECULATION[kind](draft))
    except (RuntimeError, ValueError) as e:
        if oracle_error is None:
            raise
        if str(e) == str(oracle_error):
            pytest.skip(f"transformers {transformers.__version__}: the draft's own DynamicCache fails: {e}")
        # that transformers does not call `activate_past_recording()` before speculating: a loud refusal,
        # and with the past recorded by hand the tokens are greedy's
        assert str(e).startswith("tokens_to_remove: ") and "activate_past_recording()" in str(e), str(e)
        cache = _paged(target, attn)
        cache.activate_past_recording()
        got = _generate(target, cache, **SPECULATION[kind](draft))
    finally:
        target.set_attn_implementation("sdpa")
    assert torch.equal(got, expected)
    assert int(cache.get_seq_length()) == _prompt().shape[1] + NEW_TOKENS - 1  # the rejected drafts cropped
    assert any(n > 0 for n in dropped), "no draft was ever rejected: the test checks nothing"
    windows = [p.sliding_window for p in cache.groups.params]
    assert windows == {"llama": [None], "sliding": [WINDOW], "hybrid": [WINDOW, None]}[name]
    length = int(cache.groups.collections[0].cache_lengths[0])
    held = sum((-(-length // 4) - p.first_held_page(length)) * p.page_bytes for p in cache.groups.params)
    every_layer_full = -(-length // 4) * sum(p.page_bytes for p in cache.groups.params)
    assert cache.kv_bytes_in_use() == held  # a sliding group holds only its window's pages
    assert (held < every_layer_full) == (name != "llama")


@pytest.mark.parametrize("attn", ["sdpa", "paged_kv"])
def test_speculative_decoding_over_an_fp8_cache_gives_its_greedy_tokens(models, attn):
    target, draft = models["llama"]
    plain = _generate_paged(target, attn)
    for kind in SPECULATION:
        assert torch.equal(_generate_paged(target, attn, **SPECULATION[kind](draft)), plain), kind


def _generate_paged(target, attn: str, **kwargs) -> torch.Tensor:
    cache = _paged(target, attn, kv_dtype=torch.float8_e4m3fn)
    try:
        return _generate(target, cache, **kwargs)
    finally:
        target.set_attn_implementation("sdpa")
