"""Decode attention bandwidth of the CuTe kernels beside Triton, SDPA on contiguous K/V and
FlashAttention-4's paged decode (`flash_attn.cute`, when importable).

bf16, 32 query / 8 KV heads, head_dim 128, batch 64 x 8192 context, page sizes 16, 64, 128, pages
shuffled; every row is checked against SDPA on the same K/V before it is timed. GB/s:
`harness.decode_bytes`; "of_copy" divides by a measured device-to-device copy (read + write); the
target for the CuTe kernels is >= 0.85 of it. Needs the CuTe DSL kit for CuTe and FA4:

    . /tmp/kit/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python benchmarks/bench_cute_decode.py

Prints a markdown table, writes benchmarks/results/bench_cute_decode.{md,json}; exits 0 without CUDA.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from harness import DecodeBench, DecodeInputs, gpu_main, matches

BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 8192, 32, 8, 128
PAGE_SIZES = (16, 64, 128)
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
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


def measure() -> tuple[list[dict], dict]:
    """All rows, and the setup they were measured in."""
    bench = DecodeBench(BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE)
    rows = []
    for page in PAGE_SIZES:
        x = bench.inputs(page, seed=page)
        key, value, expected = x.sdpa_reference()
        rows.append(bench.row("cute paged", page, lambda: x.paged_attention("cute"), matches(expected, "cute")))
        rows.append(bench.row("triton paged", page, lambda: x.paged_attention("triton"), matches(expected, "triton")))
        if page == PAGE_SIZES[0]:
            rows.append(bench.sdpa_row(x, key, value, expected))
        rows.append(bench.row("FA4 paged", page, lambda: fa4_paged(x), matches(expected, "fa4")))
    rows.sort(key=lambda r: KERNELS.index(r["kernel"]))
    for row in rows:
        if row["kernel"] == "cute paged" and row["of_copy"] is not None:
            row[f"meets {TARGET}"] = row["of_copy"] >= TARGET
    return rows, bench.setup()


if __name__ == "__main__":
    sys.exit(gpu_main("bench_cute_decode", measure))
