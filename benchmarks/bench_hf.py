"""Greedy `generate` tokens/s with PagedCache vs transformers' DynamicCache and StaticCache.

    python benchmarks/bench_hf.py [--batch 4] [--new-tokens 64] [--repeats 5] [--threads 1] [--compile]

One random Llama (seeded, no download), one left-padded batch of uneven prompts, the same run for
every cache. Each case runs one untimed `generate` (warm-up; compilation with --compile), then
`--repeats` timed ones, round-robin over the cases so that load drifts hit all alike; reported, as
medians over the repeats: tokens/s (new tokens of all rows / wall time, prefill included), the
prefill (until the first new token) and the median decode step, timed by a streamer that
`generate` calls after every step; "decode vs StaticCache" is the median over repeats of
StaticCache's decode step over the case's in the same round. PagedCache runs with the paged_kv
attention (from the pages) and with sdpa (gathered K/V), and with the ops' value checks off
(`TORCH_PAGED_KV_VALIDATE=shapes`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import NamedTuple

import torch
from harness import report
from transformers import Cache, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.generation.configuration_utils import CompileConfig
from transformers.generation.streamers import BaseStreamer

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg


def build_model(layers: int, hidden: int, device: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        initializer_range=0.1,
    )
    return LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)


def prompts(batch: int, longest: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(longest // 2, longest, batch).long()
    mask = (torch.arange(longest)[None] >= longest - lengths[:, None]).long()
    return (torch.randint(1, 2048, (batch, longest), generator=g) * mask).to(device), mask.to(device)


class StepClock(BaseStreamer):
    """When `generate` hands over tokens: the prompt first, then after each step (it copies them to
    the host first, so on a GPU each stamp follows that step's work)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class Timing(NamedTuple):
    seconds: float  # the whole call
    prefill: float  # until the first new token
    decode_step: float  # median of the later steps


def timed_generate(model, cache: Cache, ids: torch.Tensor, kwargs: dict) -> tuple[Timing, torch.Tensor]:
    """Timing of one `generate` call, and its output."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    clock = StepClock()
    start = time.perf_counter()
    out = model.generate(ids, streamer=clock, **kwargs, **{cache_kwarg(model): cache})
    if ids.is_cuda:
        torch.cuda.synchronize()
    steps = [b - a for a, b in itertools.pairwise(clock.stamps[1:])]
    decode_step = statistics.median(steps) if steps else float("nan")  # --new-tokens 1: no decode step
    return Timing(time.perf_counter() - start, clock.stamps[1] - start, decode_step), out


def _rounded(x: float) -> float:
    """One decimal below 100, none above."""
    return round(x, 1) if x < 100 else round(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32, help="longest prompt (others are shorter, left-padded)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (fullgraph; CUDA graphs on a GPU) where possible",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: on a shared machine more threads oversubscribe and swamp results)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.hidden, device, getattr(torch, args.dtype))
    ids, mask = prompts(args.batch, args.prompt, device)
    max_len = args.prompt + args.new_tokens
    compile_config = None
    if args.compile:
        mode = "reduce-overhead" if device == "cuda" else "default"
        compile_config = CompileConfig(fullgraph=True, mode=mode, dynamic=False)
        compile_config._compile_all_devices = True

    def paged() -> PagedCache:
        return PagedCache(model.config, args.batch, max_len, args.page_size, device=device)

    cases = [  # (cache, attention, validate, factory, compiles)
        ("DynamicCache", "sdpa", "-", lambda: DynamicCache(config=model.config), False),
        ("StaticCache", "sdpa", "-", lambda: StaticCache(config=model.config, max_cache_len=max_len), True),
        ("PagedCache", "sdpa", "full", paged, True),
        ("PagedCache", "paged_kv", "full", paged, True),
        ("PagedCache", "paged_kv", "shapes", paged, True),
    ]
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    torch._dynamo.config.cache_size_limit = 64  # one graph per case, all kept
    timings: list[list[Timing]] = [[] for _ in cases]
    outputs = []
    for repeat in range(args.repeats + 1):  # round-robin over the cases, so load drifts hit all alike
        for i, (_, attn, validate, factory, compiles) in enumerate(cases):
            model.set_attn_implementation(attn)
            os.environ["TORCH_PAGED_KV_VALIDATE"] = validate if validate != "-" else "full"
            compiled = compile_config is not None and compiles  # else eager, also where generate would auto-compile
            run_kwargs = {
                **kwargs,
                "compile_config": compile_config if compiled else None,
                "disable_compile": not compiled,
            }
            timing, out = timed_generate(model, factory(), ids, run_kwargs)
            if repeat == 0:  # warm-up (and compilation)
                outputs.append(out)
            else:
                timings[i].append(timing)
    rows = []
    for (cache_name, attn, validate, _, compiles), runs, out in zip(cases, timings, outputs, strict=True):
        tokens_per_s = args.batch * args.new_tokens / statistics.median(t.seconds for t in runs)
        rows.append(
            {
                "cache": cache_name,
                "attention": attn,
                "op checks": validate,
                "compiled": bool(compile_config and compiles),
                "tokens/s": _rounded(tokens_per_s),
                "prefill ms": _rounded(1e3 * statistics.median(t.prefill for t in runs)),
                "decode step ms": round(1e3 * statistics.median(t.decode_step for t in runs), 2),
                "same tokens as DynamicCache": bool(torch.equal(out, outputs[0])),
            }
        )
    static_index = next(i for i, r in enumerate(rows) if r["cache"] == "StaticCache")
    static, static_runs = rows[static_index], timings[static_index]
    for row, runs in zip(rows, timings, strict=True):
        row["vs StaticCache"] = round(row["tokens/s"] / static["tokens/s"], 2)
        # paired by round: the machine's speed drifts between rounds more than within one
        paired = [a.decode_step / b.decode_step for a, b in zip(static_runs, runs, strict=True)]
        row["decode vs StaticCache"] = round(statistics.median(paired), 2)
    setup = {
        "batch": args.batch,
        "prompts": f"{args.prompt // 2}..{args.prompt} left-padded",
        "new tokens": args.new_tokens,
        "model": f"Llama {args.layers} layers x {args.hidden} hidden",
        "page_size": args.page_size,
        "dtype": args.dtype,
        "device": device,
    }
    print(report("bench_hf_compiled" if args.compile else "bench_hf", rows, setup))
    wrong = [f"{r['cache']}/{r['attention']}" for r in rows if not r["same tokens as DynamicCache"]]
    if wrong and args.dtype == "float32":  # in 16-bit, rounding may legitimately flip a greedy choice
        print(f"WRONG: {', '.join(wrong)} generated other tokens than DynamicCache in float32")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
