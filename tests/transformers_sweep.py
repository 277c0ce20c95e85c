"""The transformers sweep: every causal LM transformers knows, exact through `PagedCache` or refused
before its first token.

For each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a tiny random model is built from the
type's default config, shrunk generically (`shrink`: hidden size 64, 2-4 layers keeping the
`layer_types` pattern, 4 heads, vocab 256, 4 experts; fp32 on CPU; the families of
tests/transformers_matrix.py take the matrix's config). Its tokens over its own default cache
(`generate` without a cache; under `eager` for the `paged_kv` column, as in the matrix) are the
reference (a matrix family whose oracle is `StaticCache`, top-k sparse attention: that cache's).
Then both columns of the matrix (the model's default attention + `PagedCache`,
`attn_implementation="paged_kv"` + `PagedCache`) run the matrix's greedy and batch (left-padded rows
of 5, 9 and 3 tokens) modes, and the model is classed:

- EXACT: every cell's tokens equal the reference's (logits within the matrix's tolerance);
- REFUSED: some cell raised a `ValueError` naming a config field before anything was stored, the
  others are exact;
- SKIPPED-UNBUILDABLE: the tiny model cannot be built or cannot generate from token ids alone with
  its own cache (the reason is printed);
- the defects: WRONG (other tokens or logits), CRASHED-AFTER-START (an exception once the cache
  stored something), CRASHED (another exception before, not a clear refusal).

Each model runs in a forked child with a timeout, so a hang or crash stops only its own line.

    python tests/transformers_sweep.py [--only MODEL_TYPE ...] [--markdown] [--timeout S] [--jobs N]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's package
import transformers_matrix as matrix

MODES = ("greedy", "batch")
CLASSES = ("EXACT", "REFUSED", "SKIPPED-UNBUILDABLE", "WRONG", "CRASHED-AFTER-START", "CRASHED")
MAX_PARAMETERS = 20_000_000
"""A shrunk model larger than this was not shrunk (a field this sweep does not know): skipped."""
LAYERS = 3
"""Layers of a model without a pattern of layer types (enough for a first dense layer, then MoE)."""

# Config fields and their tiny values; a field is set only where the type's default config has it
# (and, for the optional ones, not None).
SIZES: dict[str, int] = dict(
    vocab_size=matrix.VOCAB,
    hidden_size=64,
    n_embd=64,
    d_model=64,
    embed_dim=64,
    intermediate_size=128,
    ffn_dim=128,
    decoder_ffn_dim=128,
    encoder_ffn_dim=128,
    ffn_hidden_size=128,
    intermediate_size_mlp=128,
    n_inner=128,
    num_attention_heads=4,
    n_head=4,
    num_heads=4,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    head_dim=16,
    attention_head_dim=16,
    global_head_dim=16,
    kv_channels=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_k=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    n_shared_experts=1,
    num_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_expert_group=1,
    num_experts_per_token=2,
    expert_ffn_hidden_size=32,
    zero_expert_num=2,
    linear_num_heads=4,
    linear_head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    sliding_window=8,
    attention_chunk_size=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    mamba_n_heads=4,
    mamba_num_heads=4,
    mamba_d_head=16,
    mamba_head_dim=16,
    mamba_d_ssm=64,
    mamba_d_state=8,
    ssm_state_size=8,
    state_size=8,
    mamba_dt_rank=8,
    time_step_rank=8,
    n_groups=1,
    mamba_n_groups=1,
    num_kv_shared_layers=1,
    vocab_size_per_layer_input=matrix.VOCAB,
    hidden_size_per_layer_input=8,
    laurel_rank=4,
    first_k_dense_replace=1,
    initializer_range=0.1,
)
OVERRIDES: dict[str, dict[str, Any]] = {
    "codegen": dict(rotary_dim=8),
    "hunyuan_v1_dense": dict(head_dim=16),
    "hunyuan_v1_moe": dict(head_dim=16),
    "nemotron": dict(num_key_value_heads=2),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "bamba": dict(mamba_d_head=32, attn_layer_indices=[1, 3], num_hidden_layers=4),
    "granitemoehybrid": dict(mamba_d_head=32, layer_types=["mamba", "attention"] * 2, num_hidden_layers=4),
    "falcon_h1": dict(mamba_d_head=32, mamba_d_ssm=128),
    "mamba2": dict(num_heads=4, head_dim=32),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2, num_hidden_layers=4),  # its default: no conv layers
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_hidden_layers=4, num_dense_layers=1),
    "dory": dict(
        num_hidden_layers=6,
        n_input_layers=2,
        n_recurrent_layers=2,
        n_output_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 3,
    ),
    "inkling2_text": dict(
        unpadded_vocab_size=matrix.VOCAB,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=8,
    ),
}
OVERRIDES["inkling2_loop_text"] = OVERRIDES["inkling2_text"]
"""Per model type, config kwargs on top of `shrink` where the generic sizes do not build (or, for lfm2,
do not keep what makes the family itself)."""
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
TOKENS = dict(pad_token_id=matrix.PAD, bos_token_id=matrix.BOS, eos_token_id=matrix.EOS)


def shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    """The config kwargs that make a default config (`to_dict()`) tiny; sub-configs (text, vision, ...)
    shrunk the same way."""
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config: its per-layer entries go
            out[key] = {**{k: v for k, v in value.items() if k != "per_layer_config"}, **shrink(value)}
        elif key in SIZES and value is not None and not isinstance(value, (list, dict, bool)):
            out[key] = min(value, SIZES[key]) if key != "initializer_range" else SIZES[key]
        elif key in TOKENS:
            out[key] = TOKENS[key]
        elif key.endswith("_period") and isinstance(value, int) and value > 2:
            out[key] = 2
        elif key.endswith("_offset") and isinstance(value, int) and value > 1:
            out[key] = 1
        elif key == "is_decoder":
            out[key] = True
    if "num_key_value_heads" in defaults and defaults["num_key_value_heads"] is not None:
        heads = defaults.get("num_attention_heads") or 0
        kv = defaults["num_key_value_heads"]
        out["num_key_value_heads"] = 1 if kv == 1 else (4 if kv == heads else 2)
    if "n_shared_experts" in out and defaults.get("n_shared_experts") == 0:
        out["n_shared_experts"] = 0
    if "first_k_dense_replace" in out and defaults.get("first_k_dense_replace") == 0:
        out["first_k_dense_replace"] = 0
    if "num_kv_shared_layers" in out and not defaults.get("num_kv_shared_layers"):
        out["num_kv_shared_layers"] = 0
    if defaults.get("kv_lora_rank") and defaults.get("qk_rope_head_dim"):  # MLA: derived head dims follow
        if "head_dim" in defaults:
            out["head_dim"] = SIZES["qk_rope_head_dim"]
        if "qk_head_dim" in defaults:
            out["qk_head_dim"] = SIZES["qk_rope_head_dim"] + SIZES["qk_nope_head_dim"]
    out.update(_layers(defaults, out))
    return out


def _layers(defaults: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Layer counts, and per-layer lists cut to the same layers: with a pattern (`layer_types` or
    another list of one string per layer), its distinct kinds in order of first use, cycled to 4
    layers (2 per kind, or 2*kinds); else `LAYERS` layers."""
    counts = {k: defaults[k] for k in LAYER_COUNTS if isinstance(defaults.get(k), int)}
    if not counts:
        return {}
    total = max(counts.values())
    per_layer = {
        k: v
        for k, v in defaults.items()
        if isinstance(v, (list, str)) and len(v) == total and total > 1 and k not in ("model_type", "_name_or_path")
    }
    pattern = next(
        (per_layer[k] for k in ("layer_types", *per_layer) if k in per_layer and isinstance(per_layer[k], list)),
        None,
    )
    if pattern is not None and all(isinstance(t, str) for t in pattern) and len(set(pattern)) > 1:
        firsts = sorted({t: i for i, t in reversed(list(enumerate(pattern)))}.values())
        shared = defaults.get("num_kv_shared_layers") or 0
        picked = (firsts * 4)[: max(4, 2 * len(firsts))]
        if shared:  # the last layers share: keep the pattern twice, then one sharing layer per kind
            picked = picked + firsts
            out["num_kv_shared_layers"] = len(firsts)
    else:
        picked = list(range(min(LAYERS, total)))
    result: dict[str, Any] = {k: len(picked) for k in counts}
    for key, value in per_layer.items():
        if isinstance(value, list):
            result[key] = [value[i] for i in picked]
        elif isinstance(value, str) and all(c in "M*-E" for c in value):  # a pattern string (Nemotron-H)
            result[key] = "".join(value[i] for i in picked)
    return result


def matrix_families() -> dict[str, matrix.Family]:
    """The matrix's family of each model type it covers (its config is known to build)."""
    import transformers

    return {getattr(transformers, f.config).model_type: f for f in matrix.FAMILIES if f.available()}


def build(model_type: str) -> torch.nn.Module:
    """The type's tiny random model (the matrix's where it has the family)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = matrix_families().get(model_type)
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    if family is not None and model_class.__name__ == family.model:
        return family.build()
    config_class = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**{**shrink(config_class().to_dict()), **OVERRIDES.get(model_type, {})})
        if not isinstance(config, model_class.config_class):  # a causal LM of the text model (Llama4, Qwen3.5)
            config = config.get_text_config(decoder=True)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in model_class(config).parameters())
        if parameters > MAX_PARAMETERS:
            raise Unbuildable(f"not shrunk: {parameters / 1e6:.0f}M parameters")
        torch.manual_seed(0)
        model = model_class(config)
    return model.float().eval()


class Unbuildable(Exception):
    """The tiny model cannot be built or cannot generate with its own cache."""


def judge(run_paged: Callable[[list], list[matrix.Generated]], reference: list[matrix.Generated]) -> str:
    """One cell's outcome: "exact", "refused (config.x)", or the defect ("WRONG: ...", "CRASHED..."), of
    `run_paged(caches)` (which appends each `PagedCache` it builds to `caches`) against `reference`."""
    caches: list[Any] = []
    try:
        got = run_paged(caches)
    except Exception as e:
        where = _origin(e)
        if matrix.stored(caches):
            return f"CRASHED-AFTER-START: {type(e).__name__}: {e} [{where}]"[:400]
        if isinstance(e, ValueError) and matrix.refusal(e, caches).startswith("refused"):
            return matrix.refusal(e, caches)
        return f"CRASHED: {type(e).__name__}: {e} [{where}]"[:400]
    outcome = matrix.compare(got, reference)
    return outcome if outcome == matrix.EXACT else f"WRONG: {outcome}"


def run_cells(
    model: torch.nn.Module,
    modes: Sequence[str],
    run_reference: Callable[[str], list[matrix.Generated]],
    run_paged: Callable[[str, str, list], list[matrix.Generated]],
    start: float,
) -> dict[str, Any]:
    """The model's class and every cell's outcome: `run_reference(mode)` under the model's default attention
    and under `eager` (the paged_kv column's oracle, as in the matrix), then `run_paged(column, mode, caches)`
    judged against the column's reference. SKIPPED-UNBUILDABLE where a reference fails."""
    default_attn = model.config._attn_implementation
    references = {}
    for attn in dict.fromkeys((default_attn, "eager")):
        for mode in modes:
            try:
                matrix.set_attention(model, attn)
                references[attn, mode] = run_reference(mode)
            except Exception as e:
                why = f"own cache, {attn}, {mode}: {type(e).__name__}: {e} [{_origin(e)}]"
                return dict(cls="SKIPPED-UNBUILDABLE", why=why[:300])
            finally:
                matrix.set_attention(model, default_attn)
    reference_attn = {"default": default_attn, "paged_kv": "eager"}
    cells = {
        (column, mode): judge(functools.partial(run_paged, column, mode), references[reference_attn[column], mode])
        for column in matrix.COLUMNS
        for mode in modes
    }
    return dict(cls=classify(cells.values()), cells=cells, attn=default_attn, seconds=time.perf_counter() - start)


def _origin(error: Exception) -> str:
    """The innermost frame of `error`'s traceback (file:line)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{'/'.join(last.filename.split('/')[-2:])}:{last.lineno}"


def sweep_one(model_type: str) -> dict[str, Any]:
    """Builds and runs one model type; its class and every cell's outcome."""
    torch.set_num_threads(1)
    import torch_paged_kv.integrations.transformers  # noqa: F401  (registers paged_kv)

    start = time.perf_counter()
    try:
        model = build(model_type)
    except Exception as e:
        return dict(cls="SKIPPED-UNBUILDABLE", why=f"build: {type(e).__name__}: {e}"[:300])
    family = matrix_families().get(model_type)
    static = family is not None and family.reference == "StaticCache"  # (top-k sparse attention: the matrix's)

    def run_reference(mode: str) -> list[matrix.Generated]:  # over the model's own cache (or StaticCache)
        spec = matrix.MODE_SPECS[mode]
        own_cache = functools.partial(matrix.reference_cache, family, model, spec) if static else lambda: None
        return matrix.run(model, own_cache, spec)

    def run_paged(column: str, mode: str, caches: list) -> list[matrix.Generated]:
        return matrix.run_paged(model, column, matrix.MODE_SPECS[mode], caches)

    return run_cells(model, MODES, run_reference, run_paged, start)


def classify(outcomes) -> str:
    """The model's class: its worst cell."""
    outcomes = list(outcomes)
    for defect in ("WRONG", "CRASHED-AFTER-START", "CRASHED"):
        if any(o.startswith(defect + ":") for o in outcomes):
            return defect
    return "REFUSED" if any(o.startswith("refused") for o in outcomes) else "EXACT"


def _child(sweep_fn, model_type: str, queue) -> None:
    try:
        queue.put(sweep_fn(model_type))
    except BaseException as e:  # the sweep's own failure: report it as the line
        queue.put(dict(cls="CRASHED", why=f"sweep: {type(e).__name__}: {e}"[:300]))


def column_summary(result: dict[str, Any], column: str) -> str:
    """A column's outcome over the modes: one word if the modes agree."""
    cells = {m: o for (c, m), o in result["cells"].items() if c == column}
    if len(set(cells.values())) == 1:
        return next(iter(cells.values()))
    return "; ".join(f"{m}: {o}" for m, o in cells.items())


def line(model_type: str, result: dict[str, Any], markdown: bool) -> str:
    """The model's table line (one line: messages' whitespace collapsed)."""
    if "cells" in result:
        columns = [" ".join(column_summary(result, c).split()) for c in matrix.COLUMNS]
        detail = f"default ({result['attn']}): {columns[0]} | paged_kv: {columns[1]}"
    else:
        columns = [" ".join(result["why"].split()), ""]
        detail = columns[0]
    if markdown:
        return f"| {model_type} | {result['cls']} | {columns[0].replace('|', '/')} | {columns[1].replace('|', '/')} |"
    return f"{model_type:26} {result['cls']:20} {detail}"


def run_all(types: list[str], sweep_fn, timeout: float, jobs: int, markdown: bool) -> Counter:
    """`sweep_fn(model_type)` for each type in a forked child (`jobs` at once, `timeout` seconds each),
    printing each type's line as it ends; the count of each class."""
    context = multiprocessing.get_context("fork")
    pending, running, counts = list(types), [], Counter()
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            queue = context.Queue()
            process = context.Process(target=_child, args=(sweep_fn, model_type, queue), daemon=True)
            process.start()
            running.append((model_type, process, queue, time.monotonic()))
        time.sleep(0.2)
        for entry in list(running):
            model_type, process, queue, started = entry
            result = None
            alive = process.is_alive()
            try:
                result = queue.get(timeout=0 if alive else 2)
            except Exception:  # queue.Empty: nothing yet
                if not alive:
                    result = dict(cls="CRASHED", why=f"process died (exit code {process.exitcode})")
                elif time.monotonic() - started > timeout:
                    result = dict(cls="CRASHED", why=f"timeout after {timeout:.0f}s")
            if result is None:
                continue
            process.kill()
            process.join()
            running.remove(entry)
            counts[result["cls"]] += 1
            print(line(model_type, result, markdown), flush=True)
    return counts


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A sweep's command line: `--only`, `--markdown`, `--timeout`, `--jobs`."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="MODEL_TYPE", help="these model types only")
    parser.add_argument("--markdown", action="store_true", help="one markdown table row per model")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model (default 300)")
    parser.add_argument("--jobs", type=int, default=1, help="models run at once (default 1)")
    return parser


def main() -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argument_parser(__doc__)
    args = parser.parse_args()
    types = args.only or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = [t for t in types if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        parser.error(f"--only: not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: {unknown}")
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    import torch_paged_kv.integrations.transformers  # noqa: F401  (imported once, before the forks)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {len(types)} model types")
    if args.markdown:
        print("| model type | class | default attention + `PagedCache` | `paged_kv` + `PagedCache` |")
        print("|---|---|---|---|")
    counts = run_all(types, sweep_one, args.timeout, args.jobs, args.markdown)
    print("counts: " + ", ".join(f"{c} {counts[c]}" for c in CLASSES))
    return 1 if any(counts[c] for c in ("WRONG", "CRASHED-AFTER-START", "CRASHED")) else 0


if __name__ == "__main__":
    sys.exit(main())
