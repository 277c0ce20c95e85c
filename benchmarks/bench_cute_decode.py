"""Decode attention bandwidth of the CuTe kernels beside Triton, SDPA on contiguous K/V and
FlashAttention-4's paged decode (`flash_attn.cute`, when importable).

bf16, 32 query / 8 KV heads, head_dim 128, batch 64 x 8192 context, page sizes 16, 64, 128, pages
shuffled; every row is checked against SDPA on the same K/V before it is timed. GB/s:
`harness.decode_bytes`; "of_copy" divides by a measured device-to-device copy (read + write); the
target for the CuTe kernels is >= 0.85 of it. Needs the CuTe DSL kit for CuTe and FA4:

    . /tmp/kit/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_cute_decode.py [--page-sizes 16,64,128]
    PYTHONPATH=. python3 benchmarks/bench_cute_decode.py --dry-run     # tiny, on CPU: the CuTe rows say why not

The copy bandwidth and every row are printed as they are measured (`COPY`, `ROW` lines), then a
markdown table; writes benchmarks/results/bench_cute_decode.{md,json}; exits 0 without CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
from harness import DecodeBench, DecodeInputs, gpu_main, matches

SHAPE = dict(batch=64, context=8192, q_heads=32, kv_heads=8, head_dim=128)
DRY_SHAPE = dict(batch=2, context=48, q_heads=4, kv_heads=2, head_dim=32)
PAGE_SIZES = (16, 64, 128)
DTYPE = torch.bfloat16
TARGET = 0.85  # of copy bandwidth, for the CuTe kernels
KERNELS = ("cute paged", "triton paged", "SDPA contiguous", "FA4 paged")


def fa4_paged(x: DecodeInputs) -> Callable[[], torch.Tensor]:
    """FlashAttention-4 (CuTe DSL) paged decode over the same pages: K/V as `[pages, page_size, kv_heads, d]`."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    key, value = (x.collection.blocks[1:, plane, 0].contiguous() for plane in (0, 1))  # drop the null page
    table = (x.page_table() - 1).contiguous()
    seqused_k = torch.full((x.q.shape[0],), x.context, dtype=torch.int32, device=x.q.device)
    q = x.q[:, None]  # [batch, 1, q_heads, head_dim]

    def run() -> torch.Tensor:
        out = flash_attn_varlen_func(
            q, key, value, seqused_k=seqused_k, page_table=table, softmax_scale=x.scale, causal=True, num_splits=0
        )
        return (out[0] if isinstance(out, tuple) else out)[:, 0]

    return run


def measure(shape: dict[str, int], device: torch.device, page_sizes: list[int]) -> tuple[list[dict], dict]:
    """All rows at each page size, and the setup they were measured in."""
    bench = DecodeBench(**shape, dtype=DTYPE, device=device, streaming=True, repeats=20 if device.type == "cuda" else 2)
    target = (f">= {TARGET} of copy", lambda row: row["of_copy"] >= TARGET)
    rows = []
    for page in page_sizes:
        x = bench.inputs(page, seed=page)
        key, value, expected = x.sdpa_reference()
        run = lambda: x.paged_attention("cute")
        rows.append(bench.row("cute paged", page, run, matches(expected, "cute"), target=target))
        rows.append(bench.row("triton paged", page, lambda: x.paged_attention("triton"), matches(expected, "triton")))
        if page == page_sizes[0]:
            rows.append(bench.sdpa_row(x, key, value, expected))
        rows.append(bench.row("FA4 paged", page, lambda: fa4_paged(x), matches(expected, "fa4")))
    rows.sort(key=lambda r: KERNELS.index(r["kernel"]))
    return rows, bench.setup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton in its interpreter)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    device = torch.device("cpu" if args.dry_run else "cuda")
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    return gpu_main(
        "bench_cute_decode", lambda: measure(DRY_SHAPE if args.dry_run else SHAPE, device, page_sizes), device
    )


if __name__ == "__main__":
    sys.exit(main())
