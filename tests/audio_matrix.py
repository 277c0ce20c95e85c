"""The audio-language matrix: `PagedCache` on decoder-only audio-language models fed audio, in both columns.

The vision-language matrix (tests/vlm_matrix.py) for audio-conditioned generation, run by its code: each
family is a tiny random `...ForConditionalGeneration` built in code (no downloads), fp32 on CPU, whose
prompts hold a synthetic audio (log-mel features, or a waveform) that goes through the audio encoder
and projector into the text model. Each cell is (family, column, mode): `generate` over a `PagedCache`
under the model's default attention ("default") or under `attn_implementation="paged_kv"`, against the
same `generate` over transformers' `DynamicCache` (under the default attention, resp. `eager`), judged as
there: the same tokens, every logit within `LOGIT_TOLERANCE`; or a declared refusal (a `ValueError`
naming a config field or `attn_implementation` before anything is stored). Any other outcome fails, and
the script exits non-zero.

Modes (the VLM matrix's): `greedy` (one prompt with an audio), `batch` (two left-padded prompts with an
audio each, other text lengths; where the family takes a feature mask, the second audio is shorter, so
its encoder masks padded frames and it takes fewer tokens), `text` (two prompts without audio), `beam`
(2 beams), `continue` (a second `generate` from the first one's tokens and cache). Each family is also
checked to see its audio (`vlm_matrix.image_reaches`: the logits after the audio change with the
features), else every cell of it fails. A family's `images` are its audio: `block`, the placeholder
tokens one audio takes; `pixels(rows, generator)`, the processor's tensors for one audio per row.

    python tests/audio_matrix.py [--family NAME ...] [--mode MODE ...] [--column COLUMN ...]
    python tests/audio_matrix.py --markdown   # the docs table
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import vlm_matrix as vm
from vlm_matrix import TEXT, Images, VisionFamily

AUDIO, BOA, EOA = vm.IMAGE, vm.BOI, vm.EOI  # (ids >= vm.TEXT_IDS: never generated)
SINCE = "5.24"
"""The oldest transformers the families' outcomes are declared (and checked) for."""

Features = Callable[[int, torch.Generator], dict[str, Any]]


def mel(bins: int, frames: int, short: int | None = None, mask: str | None = None) -> Features:
    """Log-mel-like `input_features` `[rows, bins, frames]`; with `mask`, a feature mask of that name in which
    odd rows have only `short` real frames (a shorter audio, padded)."""

    def features(rows: int, g: torch.Generator) -> dict[str, Any]:
        out: dict[str, Any] = {"input_features": torch.randn(rows, bins, frames, generator=g)}
        if mask is not None:
            real = torch.ones(rows, frames, dtype=torch.long)
            real[1::2, frames if short is None else short :] = 0
            out[mask] = real
        return out

    return features


def waveform(samples: int, short: int, mask: str, **more: Any) -> Features:
    """Raw audio `input_values` `[rows, 1, samples]` and a padding mask named `mask` (odd rows: `short`
    real samples); `more`: further `generate` arguments."""

    def features(rows: int, g: torch.Generator) -> dict[str, Any]:
        real = torch.ones(rows, samples, dtype=torch.long)
        real[1::2, short:] = 0
        return {"input_values": torch.randn(rows, 1, samples, generator=g), mask: real, **more}

    return features


def blocks(tokens: int, odd: int | None = None, bounds: bool = False) -> dict[str, Any]:
    """`Images` keywords: `tokens` audio placeholders per audio (`odd`: in odd rows), between BOA and EOA
    where `bounds`."""
    wrap = (lambda n: (BOA,) + (AUDIO,) * n + (EOA,)) if bounds else (lambda n: (AUDIO,) * n)
    return dict(block=wrap(tokens), odd_block=None if odd is None else wrap(odd))


WHISPER = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    hidden_size=32,
    intermediate_size=64,
    num_mel_bins=8,
    max_source_positions=8,
)
CONFORMER = dict(
    text_config=dict(TEXT, model_type="granite"),
    encoder_config=dict(
        input_dim=8,
        num_layers=2,
        hidden_dim=32,
        num_heads=2,
        dim_head=16,
        output_dim=8,
        context_size=4,
        max_pos_emb=8,
        dropout=0.0,
        conv_kernel_size=3,
    ),
    projector_config=dict(
        model_type="blip_2_qformer",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        encoder_hidden_size=32,
        cross_attention_frequency=1,
    ),
    window_size=4,
    downsample_rate=2,
    has_lora_adapter=False,
    audio_token_index=AUDIO,
    tie_word_embeddings=False,
)
CONFORMER_AUDIO = Images(pixels=lambda rows, g: {"input_features": torch.randn(rows, 8, 8, generator=g)}, **blocks(4))
CONFORMER_NOTE = (
    "Conformer encoder with its own attention code (Shaw's relative positions; off the attention interface, so "
    "`set_attn_implementation` declines `paged_kv` on a loaded model: set at load time, or on the config), Q-Former "
    "projector over windows of 4 frames"
)
VIBEVOICE_TOKENIZER = dict(
    hidden_size=8, num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1], kernel_size=3, initializer_range=0.2
)
SHORTER = "the second row's audio shorter (padded frames masked in the encoder, fewer tokens)"
NEMOTRON_AUDIO = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
)
NEMOTRON_ASR = dict(NEMOTRON_AUDIO, num_mel_bins=8, subsampling_factor=4)


def frames_last(rows: int, g: torch.Generator) -> dict[str, Any]:
    """`mel(8, 16, 12, "input_features_mask")` with the frames before the mel bins (`[rows, 16, 8]`)."""
    features = mel(8, 16, 12, "input_features_mask")(rows, g)
    return {**features, "input_features": features["input_features"].transpose(1, 2)}


def family(name: str, config: str, model: str, kwargs: dict[str, Any], audio: Images, **more: Any) -> VisionFamily:
    return VisionFamily(name, config, model, kwargs, audio, modality="audio", **more)


FAMILIES: tuple[VisionFamily, ...] = (
    family(
        "Qwen2-Audio",
        "Qwen2AudioConfig",
        "Qwen2AudioForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="qwen2"),
            audio_config=dict(
                d_model=32,
                encoder_layers=2,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                num_mel_bins=8,
                max_source_positions=8,
            ),
            audio_token_index=AUDIO,
        ),
        Images(pixels=mel(8, 16, 12, "feature_attention_mask"), **blocks(4, 3)),
        notes="Whisper encoder (bidirectional, under its padding mask), pooled 2x; " + SHORTER,
    ),
    family(
        "Voxtral",
        "VoxtralConfig",
        "VoxtralForConditionalGeneration",
        dict(
            text_config=dict(TEXT),
            audio_config=dict(WHISPER, intermediate_size=128, max_source_positions=16),
            audio_token_id=AUDIO,
        ),
        Images(pixels=mel(8, 32), **blocks(4)),
        notes="Whisper encoder, 4 frames merged per audio token; Llama text model",
    ),
    family(
        "Granite-Speech",
        "GraniteSpeechConfig",
        "GraniteSpeechForConditionalGeneration",
        CONFORMER,
        CONFORMER_AUDIO,
        notes=CONFORMER_NOTE,
    ),
    family(
        "AudioFlamingo3",
        "AudioFlamingo3Config",
        "AudioFlamingo3ForConditionalGeneration",
        dict(text_config=dict(TEXT, model_type="qwen2"), audio_config=WHISPER, audio_token_id=AUDIO),
        Images(pixels=mel(8, 16, 12, "input_features_mask"), **blocks(4, 3)),
        notes="Whisper-style encoder under its padding mask, pooled 2x; " + SHORTER,
    ),
    family(
        "GLM-ASR",
        "GlmAsrConfig",
        "GlmAsrForConditionalGeneration",
        dict(
            text_config=dict(TEXT),
            audio_config=dict(
                hidden_size=32,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_mel_bins=8,
                max_position_embeddings=64,
            ),
            audio_token_id=AUDIO,
            tie_word_embeddings=False,
        ),
        Images(pixels=mel(8, 32, 24, "input_features_mask"), **blocks(4, 3)),
        notes="encoder with rotary positions, 4 frames merged per token; the second row's audio shorter (fewer tokens)",
    ),
    family(
        "Qwen3-ASR",
        "Qwen3ASRConfig",
        "Qwen3ASRForConditionalGeneration",
        dict(
            text_config=dict(TEXT),
            audio_config=dict(
                num_mel_bins=8,
                encoder_layers=2,
                encoder_attention_heads=2,
                encoder_ffn_dim=64,
                d_model=32,
                n_window=50,
                output_dim=64,
                n_window_infer=100,
                downsample_hidden_size=8,
                max_position_embeddings=16,
                initializer_range=0.2,
            ),
            audio_token_id=AUDIO,
            pad_token_id=vm.PAD,
            eos_token_id=2,
            tie_word_embeddings=False,
            initializer_range=0.2,
        ),
        Images(pixels=mel(8, 100, 60, "input_features_mask"), **blocks(13, 8)),
        notes="encoder over chunks of 100 frames (13 tokens each), packed and attending within windows "
        "(attention called per window, no mask); the second row's audio shorter (8 tokens)",
    ),
    family(
        "MusicFlamingo",
        "MusicFlamingoConfig",
        "MusicFlamingoForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="qwen2"),
            audio_config=dict(WHISPER, model_type="audioflamingo3_encoder"),
            audio_token_id=AUDIO,
            audio_bos_token_id=BOA,
            audio_eos_token_id=EOA,
        ),
        Images(pixels=mel(8, 16, 12, "input_features_mask"), **blocks(4, 3, bounds=True)),
        notes="AudioFlamingo3's encoder; rotary time embeddings of the audio frames, read off the prompt's audio "
        "tokens; " + SHORTER,
    ),
    family(
        "MOSS-Transcribe-Diarize",
        "MossTranscribeDiarizeConfig",
        "MossTranscribeDiarizeForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="qwen3"),
            audio_config=dict(WHISPER, max_source_positions=16),
            audio_token_id=AUDIO,
            audio_chunk_size=1000,
            tie_word_embeddings=False,
        ),
        Images(
            pixels=lambda rows, g: {
                **mel(8, 32, None, "input_features_mask")(rows, g),
                "padding_mask": torch.ones(rows, 10, dtype=torch.long),
            },
            **blocks(4),
        ),
        notes="Whisper encoder per audio chunk, 4 frames merged per token; Qwen3 text model",
    ),
    family(
        "Fun-ASR-Nano",
        "FunAsrNanoConfig",
        "FunAsrNanoForConditionalGeneration",
        dict(
            text_config=dict(TEXT),
            audio_config=dict(
                num_mel_bins=8,
                num_stacked_frames=1,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                num_hidden_layers=3,
                num_timestamp_prediction_layers=1,
                fsmn_kernel_size=3,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                max_position_embeddings=64,
                initializer_range=0.2,
            ),
            adaptor_config=dict(
                hidden_size=64,
                num_attention_heads=2,
                intermediate_size=16,
                num_hidden_layers=1,
                projector_hidden_size=64,
            ),
            audio_token_id=AUDIO,
            tie_word_embeddings=False,
            initializer_range=0.2,
        ),
        Images(
            pixels=lambda rows, g: {
                "input_features": torch.randn(rows, 4, 8, generator=g),
                "input_features_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]] * rows)[:rows],
            },
            **blocks(4, 3),
        ),
        notes="SAN-M encoder (attention with an FSMN memory block) and a Transformer adaptor, each under its padding "
        "mask; " + SHORTER,
    ),
    family(
        "Granite-Speech-Plus",
        "GraniteSpeechPlusConfig",
        "GraniteSpeechPlusForConditionalGeneration",
        CONFORMER,
        CONFORMER_AUDIO,
        notes=CONFORMER_NOTE,
    ),
    family(
        "OmniASR",
        "OmniASRConfig",
        "OmniASRForConditionalGeneration",
        dict(
            text_config=dict(TEXT),
            audio_config=dict(
                hidden_size=32,
                conv_dim=(16, 16),
                conv_kernel=(4, 2),
                conv_stride=(4, 2),
                num_attention_heads=2,
                num_hidden_layers=2,
                num_conv_pos_embeddings=4,
                num_conv_pos_embedding_groups=2,
                intermediate_size=64,
                hidden_dropout=0.0,
                layerdrop=0.0,
                activation_dropout=0.0,
                initializer_range=0.2,
            ),
            audio_token_id=AUDIO,
            bos_token_id=1,
            pad_token_id=vm.PAD,
            eos_token_id=2,
            initializer_range=0.2,
        ),
        Images(pixels=waveform(32, 24, "padding_mask"), **blocks(4, 3)),
        notes="wav2vec2-style encoder of the waveform (convolutions, then attention under its padding mask); "
        + SHORTER,
    ),
    family(
        "VibeVoice-ASR",
        "VibeVoiceAsrConfig",
        "VibeVoiceAsrForConditionalGeneration",
        dict(
            text_config=dict(TEXT, model_type="qwen2"),
            acoustic_tokenizer_encoder_config=VIBEVOICE_TOKENIZER,
            semantic_tokenizer_encoder_config=VIBEVOICE_TOKENIZER,
            audio_token_id=AUDIO,
            audio_bos_token_id=BOA,
            audio_eos_token_id=EOA,
            initializer_range=0.2,
            attn_implementation="eager",
        ),
        Images(pixels=waveform(16, 12, "padding_mask", sample=False), **blocks(4, 3, bounds=True)),
        notes="convolutional acoustic and semantic tokenizers of the waveform (`sample=False`: no noise); default "
        "attention `eager` (transformers cannot set `sdpa` on the whole model: its tokenizers have none); the second "
        "row's audio shorter (fewer tokens)",
    ),
    family(
        "Nemotron-3.5-Transcribe",
        "Nemotron3_5TranscribeConfig",
        "Nemotron3_5TranscribeForConditionalGeneration",
        dict(
            text_config=dict(
                TEXT,
                model_type="nemotron_h",
                num_hidden_layers=4,
                layer_types=["linear_attention", "full_attention", "moe", "full_attention"],
                mamba_num_heads=4,
                mamba_head_dim=16,
                ssm_state_size=8,
                n_groups=1,
                conv_kernel=4,
                expand=1,
                chunk_size=8,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32,
                use_mamba_kernels=False,
            ),
            audio_config=dict(
                asr_config=NEMOTRON_ASR,
                diarization_config=dict(
                    audio_config=NEMOTRON_ASR,
                    head_config=dict(hidden_size=16, num_speakers=2, audio_hidden_size=32, subsampling_factor=4),
                    streaming_config=dict(num_speakers=2, subsampling_factor=4),
                    chunk_length=8,
                    chunk_right_context=2,
                    chunk_left_context=2,
                ),
            ),
            word_timestamp_config=dict(NEMOTRON_AUDIO, vocab_size=16, blank_token_id=15),
            audio_token_id=AUDIO,
        ),
        Images(pixels=frames_last, **blocks(4, 3)),
        notes="speech encoder (rotary positions, 4 frames stacked per token) beside a diarization model whose "
        "speaker activities are added to its outputs; hybrid Nemotron-H text model (a Mamba layer's states "
        "beside the pages, an MoE layer); " + SHORTER,
    ),
)


if __name__ == "__main__":
    sys.exit(vm.main(FAMILIES, __doc__))
