"""Audio models whose audio is added at every text position rather than held by placeholder tokens (so not
in tests/audio_matrix.py): Kyutai speech-to-text under `paged_kv` past its `config.sliding_window` (its
attention passes no window; generate's mask applies the config's) and Voxtral-Realtime (a streaming encoder
with a `DynamicCache` of its own: `paged_kv` refused on the whole model before anything is stored, exact on
the text model only). Oracle: transformers' `DynamicCache` under `eager`."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import torch_paged_kv.integrations.transformers as paged  # noqa: E402

for _name in ("KyutaiSpeechToTextConfig", "VoxtralRealtimeConfig"):
    if not hasattr(transformers, _name):
        pytest.skip(f"transformers {transformers.__version__} has no {_name}", allow_module_level=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models


def _kyutai() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    codec = dict(
        hidden_size=16, num_filters=4, upsampling_ratios=[2, 2], kernel_size=3, last_kernel_size=3,
        residual_kernel_size=3, codebook_size=16, codebook_dim=8, num_quantizers=2,
        vector_quantization_hidden_dimension=8, upsample_groups=16, num_hidden_layers=1, intermediate_size=32,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, sliding_window=16, sampling_rate=64,
        model_type="mimi",  # (transformers < 5.24 builds the codec config from the dict by it)
    )  # fmt: skip
    config = transformers.KyutaiSpeechToTextConfig(
        codebook_vocab_size=17, vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, ffn_dim=128, num_codebooks=2,
        audio_bos_token_id=16, audio_pad_token_id=60, pad_token_id=3, bos_token_id=1, initializer_range=0.2,
        sliding_window=8, codec_config=codec,  # a window of 8, crossed by the 21 tokens generated
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.KyutaiSpeechToTextForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # random codebooks (transformers leaves them zero: every frame the same code)
        for name, buffer in model.named_buffers():
            if name.endswith("embed_sum"):
                buffer.normal_(generator=torch.Generator().manual_seed(5))
    waveform = torch.randn(2, 1, config.frame_size * 24, generator=torch.Generator().manual_seed(0))
    return model, dict(input_ids=torch.tensor([[1], [1]]), input_values=waveform)


def _voxtral_realtime() -> tuple[torch.nn.Module, dict[str, Any]]:
    text = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, sliding_window=64,
    )  # fmt: skip
    audio = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
        num_mel_bins=8, sliding_window=16, max_position_embeddings=128, initializer_range=0.2,
    )  # fmt: skip
    config = transformers.VoxtralRealtimeConfig(text_config=text, audio_config=audio, downsample_factor=4)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.VoxtralRealtimeForConditionalGeneration(config).float().eval()
    inputs = dict(  # 4 prompt tokens + 10 new, 8 mel frames per position
        input_ids=torch.randint(3, 240, (2, 4), generator=torch.Generator().manual_seed(9)),
        input_features=torch.randn(2, 8, 8 * 14, generator=torch.Generator().manual_seed(0)),
        num_delay_tokens=2,
    )
    return model, inputs


def _generate(model: torch.nn.Module, inputs: dict[str, Any], cache: Any, new: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            **inputs, **{paged.cache_kwarg(model): cache}, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return torch.cat([out.sequences.flatten().float(), torch.stack(out.logits, 1).flatten()])


@pytest.mark.parametrize("page_size", [16, 4])
def test_kyutai_past_its_window_under_paged_kv(page_size: int) -> None:
    """Its attention passes no window, generate's mask applies `config.sliding_window`, the cache group gives
    back the pages outside it: `paged_kv` attends within the group's window (before: other tokens at page 16,
    a read of a page given back at page 4)."""
    model, inputs = _kyutai()
    model.set_attn_implementation("eager")
    expected = _generate(model, inputs, DynamicCache(config=model.config), 20)
    model.set_attn_implementation("paged_kv")
    cache = paged.PagedCache(model.config, 2, 64, page_size=page_size)
    got = _generate(model, inputs, cache, 20)
    assert [cache.layer_window(j) for j in range(2)] == [8, 8]
    assert (got - expected).abs().max().item() <= 1e-4


def test_voxtral_realtime_paged_kv_on_the_whole_model_is_refused_before_anything_is_stored() -> None:
    model, inputs = _voxtral_realtime()
    model.set_attn_implementation("paged_kv")
    cache = paged.PagedCache(model.config, 2, 64, page_size=4)
    with pytest.raises(ValueError, match=r"^config\.model_type: 'voxtral_realtime_encoder' .*text_config"):
        _generate(model, inputs, cache, 10)
    assert cache.groups is None or int(cache.get_seq_length()) == 0


def test_voxtral_realtime_paged_kv_on_the_text_model_is_exact() -> None:
    model, inputs = _voxtral_realtime()
    model.set_attn_implementation({"text_config": "eager", "audio_config": "sdpa"})
    expected = _generate(model, inputs, DynamicCache(config=model.config), 10)
    model.set_attn_implementation({"text_config": "paged_kv", "audio_config": "sdpa"})
    got = _generate(model, inputs, paged.PagedCache(model.config, 2, 64, page_size=4), 10)
    assert (got - expected).abs().max().item() <= 1e-4
