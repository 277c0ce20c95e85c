"""FP8 caches: what they cost in accuracy, and decode time and bytes against a bf16 cache.

    PYTHONPATH=. python benchmarks/bench_fp8.py [--device cpu] [--batch 8] [--context 2048]

Accuracy: decode attention error of an FP8 cache against the same K/V in a bf16 cache (one query
row per KV head group, 2048 keys), on random data and on outlier-heavy data (a few channels 100x),
for one scale per token and head (granularity head_dim), per 64 and 32 elements, and one static
scale per tensor. Speed: paged decode over the default backend of the device, FP8 (e4m3 per token
and head, per 32 elements, per tensor; e5m2 per token) vs bf16, bf16 queries, with the bytes each
must read (K/V of every cached token once, plus scales, q and out). On CPU the caches are timed in
turn, each call after the CPU caches are evicted (harness.round_robin_ms).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from harness import median_us, report, round_robin_ms

import torch_paged_kv as pk
from torch_paged_kv.testing import outlier_kv, quantized_attention_error

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def accuracy_rows(head_dim: int, tokens: int) -> list[dict]:
    rows = []
    q = torch.randn(16, head_dim, generator=torch.Generator().manual_seed(7))
    for data in ("random", "outliers"):
        k, v = outlier_kv(tokens, 4, head_dim, outliers=data == "outliers", seed=3)
        for name, dtype in FP8.items():
            for granularity in (*dict.fromkeys((head_dim, 64, 32)), None):
                max_err, rel_rms = quantized_attention_error(k, v, q, dtype, granularity)
                scales = {None: "per tensor", head_dim: "per token and head"}.get(granularity, f"per {granularity}")
                rows.append(dict(data=data, fp8=name, scales=scales, max_abs_err=max_err, rel_rms_err=rel_rms))
    return rows


def decode_rows(device: torch.device, batch: int, context: int, heads: tuple[int, int], head_dim: int) -> list[dict]:
    q_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(0)
    pages = batch * (-(-context // 16))
    table = (torch.randperm(pages, generator=gen) + 1).view(batch, -1).int()
    k, v = torch.randn(2, batch * context, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    q = torch.randn(batch, q_heads, head_dim, generator=gen).bfloat16().to(device)
    rows, outputs, calls = [], [], []
    caches = [  # name, dtype, KVCacheParams options
        ("bf16", torch.bfloat16, {}),
        ("e4m3 per token", torch.float8_e4m3fn, {}),
        ("e4m3 per 32", torch.float8_e4m3fn, {"quantization_granularity": 32}),
        ("e4m3 per tensor", torch.float8_e4m3fn, {"static_scales": (0.02, 0.02)}),
        ("e5m2 per token", torch.float8_e5m2, {}),
    ]
    for name, dtype, options in caches:
        params = pk.KVCacheParams(dtype, 1, kv_heads, head_dim, page_size=16, **options)
        c = pk.PagedKVCacheCollection(params, num_pages=pages, max_batch_size=batch, max_seq_len=context, device=device)
        c.lookup_table[:, : pages // batch] = table
        plan = pk.StepPlan.of(c, c.step_tensors(batch))
        c.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32) * context)
        plan.store_kv(k, v, 0)
        c.cache_lengths.fill_(context - 1)
        c.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
        outputs.append(plan.flash_attention(q, 0, head_dim**-0.5).double())
        calls.append(lambda plan=plan, q=q: plan.flash_attention(q, 0, head_dim**-0.5))
        kv_bytes = 2 * batch * context * kv_heads * (head_dim * c.blocks.element_size() + 4 * params.scales_per_head)
        nbytes = kv_bytes + 2 * q.numel() * q.element_size()
        rows.append(dict(cache=name, backend=pk.backend_info(device)["flash_attention"], MB_read=nbytes / 1e6))
    if device.type == "cpu":  # cold caches, in turn (an FP8 pool half the size would stay in L3 otherwise)
        samples = round_robin_ms(dict(enumerate(calls)), repeats=20)
        times = [statistics.median(ms) * 1e3 for ms in samples.values()]
    else:
        times = [median_us(call, device) for call in calls]
    for row, out, us in zip(rows, outputs, times, strict=True):  # against the bf16 cache, the first
        row.update(us=us, GB_per_s=row["MB_read"] / us * 1e3)
        row["time_vs_bf16"] = us / times[0]
        row["max_abs_err_vs_bf16"] = (out - outputs[0]).abs().max().item()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", default="32,8", help="q heads, kv heads")
    parser.add_argument("--accuracy-tokens", type=int, default=2048)
    args = parser.parse_args()
    heads = tuple(int(h) for h in args.heads.split(","))
    if torch.device(args.device).type == "cuda":  # as harness.gpu_main: no per-call sync of the index checks
        os.environ.setdefault("TORCH_PAGED_KV_VALIDATE", "shapes")  # (on an H100 they took 0.66 ms a call)
    with torch.no_grad():
        print(report("fp8_accuracy", accuracy_rows(args.head_dim, args.accuracy_tokens)))
        print()
        setup = dict(batch=args.batch, context=args.context, heads=args.heads, head_dim=args.head_dim)
        print(report("fp8_decode", decode_rows(torch.device(args.device), args.batch, args.context, heads,
                                               args.head_dim), setup))  # fmt: skip


if __name__ == "__main__":
    main()
