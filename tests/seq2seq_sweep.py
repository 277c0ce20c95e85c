"""The encoder-decoder sweep: every encoder-decoder model transformers knows, exact through
`PagedCache.for_encoder_decoder` or refused before its first token.

For each model type of `MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES` and
`MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES` whose config is an encoder-decoder one (`is_encoder_decoder`;
the audio LLMs of those lists are decoder-only models, left out), a tiny random model is built from the
type's default config, shrunk as `transformers_sweep` shrinks causal LMs. Its tokens over transformers'
own cache (`EncoderDecoderCache(DynamicCache(), DynamicCache())`; under `eager` for the `paged_kv`
column) are the reference. Both columns (the model's default attention, `attn_implementation="paged_kv"`;
each with `PagedCache.for_encoder_decoder`) run three modes: greedy (2 rows of 7 encoder tokens), batch
(left-padded encoder rows of 5, 9 and 3 tokens; a speech model: 3 rows of features) and beam search
(3 beams). Classes and defects are `transformers_sweep`'s; each model runs in a forked child.

    python tests/seq2seq_sweep.py [--only MODEL_TYPE ...] [--markdown] [--timeout S] [--jobs N]
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's package
import transformers_matrix as matrix
import transformers_sweep as sweep

MODES: dict[str, matrix.Mode] = {
    "greedy": matrix.Mode((7, 7), 8),
    "batch": matrix.Mode((5, 9, 3), 8),
    "beam": matrix.Mode((6, 4), 6, beams=3, args=dict(num_beams=3)),
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "whisper": dict(max_source_positions=16, max_target_positions=64, num_mel_bins=8),
    "speech_to_text": dict(max_source_positions=64, max_target_positions=64),
}
"""Per model type, config kwargs on top of `shrink` (sizes the generic shrinking does not reach)."""


def model_types() -> dict[str, str]:
    """Every seq2seq and speech-seq2seq model type with its class name."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    return {**MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, **MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}


def is_encoder_decoder(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return bool(CONFIG_MAPPING[model_type]().is_encoder_decoder)
        except Exception:  # a config that needs arguments (encoder-decoder wrappers of two models)
            return True


def build(model_type: str) -> torch.nn.Module:
    """The type's tiny random model."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    model_class = getattr(transformers, model_types()[model_type])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**{**sweep.shrink(config_class().to_dict()), **OVERRIDES.get(model_type, {})})
        config.decoder_start_token_id = matrix.BOS
        with torch.device("meta"):
            parameters = sum(p.numel() for p in model_class(config).parameters())
        if parameters > sweep.MAX_PARAMETERS:
            raise sweep.Unbuildable(f"not shrunk: {parameters / 1e6:.0f}M parameters")
        torch.manual_seed(0)
        model = model_class(config)
    return model.float().eval()


def inputs(model: torch.nn.Module, mode: matrix.Mode) -> dict[str, torch.Tensor]:
    """The encoder's inputs for the mode: left-padded token ids and their mask, or random speech
    features of the shape the model's encoder takes (one row per prompt)."""
    name, config, rows = model.main_input_name, model.config, len(mode.lengths)
    if name == "input_ids":
        ids, mask = matrix.prompts(mode)
        return dict(input_ids=ids, attention_mask=mask)
    g = torch.Generator().manual_seed(rows)
    if name == "input_features" and hasattr(config, "num_mel_bins"):  # Whisper: mel bins x 2 frames per position
        return dict(input_features=torch.randn(rows, config.num_mel_bins, 2 * config.max_source_positions, generator=g))
    if name == "input_features" and hasattr(config, "input_feat_per_channel"):  # Speech2Text: frames x features
        features = config.input_feat_per_channel * config.input_channels
        return dict(input_features=torch.randn(rows, 16, features, generator=g))
    encoder = getattr(config, "encoder_config", None)
    if name == "input_features" and hasattr(encoder, "num_mel_bins"):  # Parakeet encoders: frames x mel bins
        return dict(input_features=torch.randn(rows, 64, encoder.num_mel_bins, generator=g))
    if name == "input_values":  # a waveform (Moonshine, SpeechT5): 3200 samples
        return dict(input_values=torch.randn(rows, 3200, generator=g))
    raise sweep.Unbuildable(f"inputs: {name!r} of a shape this sweep does not make")


def generate(model: torch.nn.Module, cache: Any, mode: matrix.Mode) -> list[matrix.Generated]:
    from torch_paged_kv.integrations.transformers import cache_kwarg

    kwargs = dict(do_sample=False, max_new_tokens=mode.new_tokens, min_new_tokens=mode.new_tokens)
    kwargs.update(return_dict_in_generate=True, output_logits=True, pad_token_id=matrix.PAD, **mode.args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(**inputs(model, mode), **{cache_kwarg(model): cache}, **kwargs)
    return [matrix.Generated(out.sequences, torch.stack(out.logits, 1))]


def own_cache() -> Any:
    from transformers import DynamicCache, EncoderDecoderCache

    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def run_paged(model: torch.nn.Module, column: str, mode: matrix.Mode, caches: list) -> list[matrix.Generated]:
    """The mode's `generate` over `PagedCache.for_encoder_decoder` (its paged part appended to `caches`) under
    the column's attention; the model's attention restored afterwards."""
    from torch_paged_kv.integrations.transformers import PagedCache

    default_attn = model.config._attn_implementation
    rows = len(mode.lengths) * max(mode.beams, model.generation_config.num_beams or 1)  # (FSMT: 5 beams)
    try:
        matrix.set_attention(model, default_attn if column == "default" else "paged_kv")
        cache = PagedCache.for_encoder_decoder(model.config, rows, 32, page_size=mode.page_size)
        caches.append(cache.self_attention_cache)
        return generate(model, cache, mode)
    finally:
        matrix.set_attention(model, default_attn)


def sweep_one(model_type: str) -> dict[str, Any]:
    """Builds and runs one model type; its class and every cell's outcome."""
    torch.set_num_threads(1)
    import torch_paged_kv.integrations.transformers  # noqa: F401  (registers paged_kv)

    start = time.perf_counter()
    try:
        model = build(model_type)
        inputs(model, MODES["greedy"])
    except Exception as e:
        return dict(cls="SKIPPED-UNBUILDABLE", why=f"build: {type(e).__name__}: {e}"[:300])
    return sweep.run_cells(
        model,
        list(MODES),
        lambda mode: generate(model, own_cache(), MODES[mode]),
        lambda column, mode, caches: run_paged(model, column, MODES[mode], caches),
        start,
    )


def main() -> int:
    parser = sweep.argument_parser(__doc__)
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    import torch_paged_kv.integrations.transformers  # noqa: F401  (imported once, before the forks)

    known = model_types()
    unknown = [t for t in args.only or () if t not in known]
    if unknown:
        parser.error(f"--only: not a seq2seq or speech-seq2seq model type: {unknown}")
    types = [t for t in args.only or known if is_encoder_decoder(t)]
    left_out = [t for t in args.only or known if t not in types]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {len(types)} model types")
    if left_out:
        print(f"not encoder-decoder (decoder-only audio LLMs), left out: {', '.join(left_out)}")
    if args.markdown:
        print("| model type | class | default attention + `PagedCache` | `paged_kv` + `PagedCache` |")
        print("|---|---|---|---|")
    counts = sweep.run_all(types, sweep_one, args.timeout, args.jobs, args.markdown)
    print("counts: " + ", ".join(f"{c} {counts[c]}" for c in sweep.CLASSES))
    return 1 if any(counts[c] for c in ("WRONG", "CRASHED-AFTER-START", "CRASHED")) else 0


if __name__ == "__main__":
    sys.exit(main())
