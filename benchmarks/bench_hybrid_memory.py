"""KV memory and decode time of a sliding-window model: PagedCache's layer groups vs every layer full.

    python benchmarks/bench_hybrid_memory.py [--contexts 4096,32768] [--layers 6] [--steps 48]

Memory: a Gemma3-style cache (gemma-3-4b's geometry: 5 of every 6 layers with a 1,024-token window,
4 kv heads of 256, bf16), of `--layers` layers (default 6, one full: gemma-3-4b has 34, five full;
`--layers 34` takes about 3 minutes here, as PagedCache's `update` gathers every column of a layer
for the model's own attention at every prefill chunk), one row of `context` tokens per cache, filled through each
cache's own `update()` with random K/V: a prefill of `context - 1` tokens in chunks of `--chunk`
(`PagedCache(max_step_tokens=chunk)`), then one decode token. Rows: the bytes of K/V each cache holds
then: `PagedCache.kv_bytes_in_use()` (groups, and every layer full: what it held before layer
groups), transformers' `DynamicCache` and `StaticCache` (their tensors' `nbytes`), and what the next
query needs (full layers every token, sliding ones `window - 1`). "allocated" is what the cache's
tensors occupy: PagedCache's pools (`LayerGroups.memory_footprint()`), DynamicCache's storages (a
view of a larger tensor holds all of it), StaticCache's tensors.

Decode: a tiny random Gemma3 (`--decode-layers` layers, window `--window`) and `--batch` rows past the
window, decoding greedily; each step runs once per cache, in turn (the order rotating), so that load
drifts hit all alike: `PagedCache` with its groups, `PagedCache` of the same model with every layer
full (built from a copy of its config without `sliding_window`), and a second every-layer-full cache
as a control whose ratio shows the noise. Both attention modes (`paged_kv` and `sdpa`). Reported, in
wall time and in the process's CPU time (steadier on a shared machine): the median step, and the
median over steps of each step's time over the every-layer-full cache's in the same round, with its
interquartile range; the caches must generate the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from harness import report, stream
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, StaticCache

from torch_paged_kv.integrations.transformers import PagedCache, cache_kwarg

GEMMA3_4B = dict(num_key_value_heads=4, head_dim=256, num_attention_heads=8, hidden_size=2560, sliding_window=1024)
GEMMA3_4B_LAYERS = 34
PATTERN = 6  # every 6th layer attends fully


def memory_config(layers: int) -> Gemma3TextConfig:
    """gemma-3-4b's cache geometry (no weights are made from it)."""
    return Gemma3TextConfig(num_hidden_layers=layers, sliding_window_pattern=PATTERN, **GEMMA3_4B)


def every_layer_full(config: Gemma3TextConfig) -> Gemma3TextConfig:
    """The same model's config as `PagedCache` would read it if no layer had a window."""
    full = copy.deepcopy(config)
    full.sliding_window = None
    return full


def fill(cache: Any, layers: int, context: int, chunk: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`update()` every layer with a prefill of `context - 1` tokens in chunks of `chunk`, then one token."""
    steps = [chunk] * ((context - 1) // chunk) + ([(context - 1) % chunk] if (context - 1) % chunk else []) + [1]
    for new in steps:
        for layer in range(layers):
            cache.layers[layer].update(kv[0][:, :, :new], kv[1][:, :, :new])


def tensor_bytes(cache: Any) -> tuple[int, int]:
    """(the `nbytes` of every layer's keys and values, the bytes of the distinct storages behind them)."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(t.nbytes for t in tensors), sum(storages.values())


def needed_bytes(config: Gemma3TextConfig, context: int, dtype: torch.dtype) -> int:
    """K/V bytes of the keys the next query reads: every token of a full layer, `window - 1` of a sliding one."""
    per_token = 2 * config.num_key_value_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()
    window = config.sliding_window
    kept = [context if kind == "full_attention" else min(context, window - 1) for kind in config.layer_types]
    return per_token * sum(kept)


def measure_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    config, dtype, layers = memory_config(args.layers), torch.bfloat16, args.layers
    rows = []
    for context in args.contexts:
        chunk = min(args.chunk, context - 1)
        g = torch.Generator().manual_seed(context)
        shape = (1, config.num_key_value_heads, chunk, config.head_dim)
        kv = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(2))

        def paged(cfg: Gemma3TextConfig) -> Callable[[], tuple[int, int]]:
            def run() -> tuple[int, int]:
                cache = PagedCache(cfg, 1, context, args.page_size, "cpu", dtype, max_step_tokens=chunk)
                fill(cache, layers, context, chunk, kv)
                assert int(cache.get_seq_length()) == context
                return cache.kv_bytes_in_use(), cache.groups.memory_footprint()

            return run

        def hf(make: Callable[[], Any]) -> Callable[[], tuple[int, int]]:
            def run() -> tuple[int, int]:
                cache = make()
                fill(cache, layers, context, chunk, kv)
                assert int(cache.get_seq_length()) == context
                return tensor_bytes(cache)

            return run

        cases = {
            "PagedCache, layer groups": paged(config),
            "PagedCache, every layer full": paged(every_layer_full(config)),
            "DynamicCache": hf(lambda: DynamicCache(config=config)),
            "StaticCache": hf(lambda: StaticCache(config=config, max_cache_len=context)),
        }
        measured = {}
        for name, run in cases.items():
            start = time.perf_counter()
            held, allocated = run()
            measured[name] = held
            row = {
                "context": context,
                "cache": name,
                "KV held MB": held / 1e6,
                "vs groups": held / measured["PagedCache, layer groups"],
                "allocated MB": allocated / 1e6,
                "fill s": time.perf_counter() - start,
            }
            stream("ROW", row)
            rows.append(row)
        need = needed_bytes(config, context, dtype)
        row = {"context": context, "cache": "needed by the next query", "KV held MB": need / 1e6}
        row["vs groups"] = need / measured["PagedCache, layer groups"]
        stream("ROW", row)
        rows.append(row)
    return rows


def decode_model(layers: int, window: int) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=window, sliding_window_pattern=PATTERN,
        max_position_embeddings=4096, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Gemma3ForCausalLM(config).eval()


def measure_decode(args: argparse.Namespace) -> list[dict[str, Any]]:
    model = decode_model(args.decode_layers, args.window)
    key = cache_kwarg(model)
    prompt = torch.randint(3, 1024, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    max_len = args.prompt + args.steps + 1
    rows = []
    for attn in ("paged_kv", "sdpa"):
        model.set_attn_implementation(attn)
        full = every_layer_full(model.config)
        caches = {
            "groups": PagedCache(model.config, args.batch, max_len, args.page_size),
            "every layer full": PagedCache(full, args.batch, max_len, args.page_size),
            "every layer full (control)": PagedCache(full, args.batch, max_len, args.page_size),
        }
        tokens: dict[str, list[torch.Tensor]] = {name: [] for name in caches}
        last = {}
        with torch.no_grad():
            for name, cache in caches.items():
                last[name] = model(prompt, **{key: cache}).logits[:, -1].argmax(-1, keepdim=True)
            wall: dict[str, list[float]] = {name: [] for name in caches}
            cpu: dict[str, list[float]] = {name: [] for name in caches}
            names = list(caches)
            for step in range(args.steps):
                shift = step % len(names)
                for name in names[shift:] + names[:shift]:
                    start, cpu_start = time.perf_counter(), time.process_time()
                    logits = model(last[name], **{key: caches[name]}).logits
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - cpu_start)
                    last[name] = logits[:, -1].argmax(-1, keepdim=True)
                    tokens[name].append(last[name])
        same = {
            name: torch.equal(torch.cat(t, 1), torch.cat(tokens["every layer full"], 1)) for name, t in tokens.items()
        }
        held = {name: cache.kv_bytes_in_use() for name, cache in caches.items()}
        for name in names:
            row = {"attention": attn, "cache": name}
            for clock, times in (("wall", wall), ("CPU", cpu)):
                ratios = [a / b for a, b in zip(times[name], times["every layer full"], strict=True)]
                quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                row[f"{clock} ms"] = 1e3 * statistics.median(times[name])
                row[f"{clock} vs every layer full"] = statistics.median(ratios)
                row[f"{clock} ratio p25-p75"] = f"{quartiles[0]:.3f}-{quartiles[2]:.3f}"
            row |= {"KV held KB": round(held[name] / 1e3), "same tokens": same[name]}
            stream("ROW", row)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", default="4096,32768", help="comma-separated context lengths (memory; empty: none)"
    )
    parser.add_argument(
        "--layers", type=int, default=6, help=f"layers of the memory config (gemma-3-4b: {GEMMA3_4B_LAYERS})"
    )
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (memory)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--decode-layers", type=int, default=6)
    parser.add_argument("--window", type=int, default=64, help="sliding window of the decode model")
    parser.add_argument("--batch", type=int, default=4, help="rows of the decode model")
    parser.add_argument("--prompt", type=int, default=192, help="prompt tokens of the decode model")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per cache")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    torch.set_num_threads(args.threads)
    full = memory_config(args.layers).layer_types.count("full_attention")
    layers = f"{args.layers} ({full} full; gemma-3-4b: {GEMMA3_4B_LAYERS}, 5 full)"
    if args.contexts:
        print(f"memory: gemma-3-4b's geometry, layers: {layers}", flush=True)
        setup = {"layers": layers, "kv heads x head_dim": "4 x 256", "window": 1024, "dtype": "bfloat16"}
        setup |= {"prefill chunk": args.chunk, "page_size": args.page_size}
        print(report("bench_hybrid_memory", measure_memory(args), setup))
    decode = measure_decode(args)
    setup = {
        "model": f"Gemma3 {args.decode_layers} layers x 256 hidden, window {args.window}",
        "batch": args.batch,
        "prompt": args.prompt,
        "steps": args.steps,
        "threads": args.threads,
    }
    print(report("bench_hybrid_decode", decode, setup))
    wrong = [f"{r['attention']}/{r['cache']}" for r in decode if not r["same tokens"]]
    if wrong:
        print(f"WRONG: {', '.join(wrong)} generated other tokens than the every-layer-full cache")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
