"""MLA decode tiles on the GPU: the Triton `mla_attention` plan against candidate tiles, at the shapes of
`bench_mla_gpu.py` (batch 64 x 4096, kv_lora_rank 512 + rope 64, pages shuffled).

Each row plans the launches once (the kernel and the split merge; no op dispatch is timed) with one
(BLOCK_H, BLOCK_N, num_warps) tile forced, or the plan's own ("plan"), and for FP8 rows one read path
(the hardware conversion of sm_89+, or the integer decode the plan used before); it is checked against
the reference backend, then timed and printed at once (`ROW <json>`). The candidates test the
hypotheses of docs/mla.md ("Tiles"): 64 heads per key tile for 128 heads (wgmma; 4.6 warp instructions
per key and head on sm_90 against 10.3 at 16 heads, and the latent read 2 times instead of 8).

    PYTHONPATH=. python benchmarks/bench_mla_tiles_gpu.py

Prints a markdown table, writes benchmarks/results/bench_mla_tiles_gpu.{md,json}; exits 0 without CUDA.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from unittest import mock

import torch
from bench_mla_gpu import DEVICE, _measure, decode_inputs
from harness import check_close, copy_bandwidth_gbps, gpu_main, stream

from torch_paged_kv.ops import reference_mla
from torch_paged_kv.ops.records import MLAAttentionArgs
from torch_paged_kv.ops.triton import mla_attention as triton_mla

# (cache, heads, page, tile (BLOCK_H, BLOCK_N, num_warps) or None for the plan's, FP8 read in hardware)
ROWS = [
    ("bf16", 16, 64, None, True),
    ("bf16", 128, 64, None, True),
    ("bf16", 128, 64, (32, 32, 8), True),
    ("bf16", 128, 64, (64, 32, 8), True),
    ("bf16", 128, 64, (64, 16, 8), True),
    ("bf16", 128, 1, None, True),
    ("bf16", 128, 1, (64, 32, 8), True),
    ("e4m3 per token, rope bf16", 16, 64, None, False),  # the plan before the hardware conversion
    ("e4m3 per token, rope bf16", 16, 64, None, True),
    ("e4m3 per token, rope bf16", 16, 64, (16, 16, 8), True),
    ("e4m3 per token, rope bf16", 128, 64, None, True),
    ("e4m3 per token, rope bf16", 128, 64, (64, 32, 8), True),
]


def measure() -> tuple[list[dict], dict]:
    copy_gbps = copy_bandwidth_gbps(DEVICE)
    stream("COPY", copy_gbps)
    rows = []
    for cache, heads, page, tile, hardware in ROWS:
        plan, q_nope, q_rope, moved = decode_inputs(cache, page, heads)
        a = MLAAttentionArgs(q_nope, q_rope, plan.blocks, *plan.step, 0, 192**-0.5, True, plan.scales)
        expected = reference_mla.mla_attention(*a)

        def planned(a=a, tile=tile, hardware=hardware) -> Callable[[], torch.Tensor]:
            with contextlib.ExitStack() as patches:
                patches.enter_context(mock.patch.object(triton_mla, "hardware_fp8", lambda device: hardware))
                if tile is not None:
                    block_h, block_n, warps = tile
                    blocks_for = lambda *_, h=block_h, n=block_n, w=warps: (h, 1, n, w)
                    patches.enter_context(mock.patch.object(triton_mla, "_blocks_for", blocks_for))
                out, launches = triton_mla.plan_mla_attention(a)

            def run() -> torch.Tensor:
                for launch in launches:
                    launch()
                return out

            return run

        result = _measure(planned, lambda out, e=expected, c=cache: check_close(out, e, f"triton {c}"))
        us = result[0] if isinstance(result, tuple) else result
        gbps = moved / us / 1e3 if isinstance(us, float) else None
        read = "" if cache == "bf16" else ", hardware cvt" if hardware else ", integer decode"
        row = dict(cache=cache + read, heads=heads, page_size=page, tile="plan" if tile is None else str(tile), us=us,
                   **{"GB/s": gbps, "of_copy": gbps / copy_gbps if gbps else None})  # fmt: skip
        stream("ROW", row)
        rows.append(row)
    return rows, dict(batch=64, context=4096, kv_lora_rank=512, rope_dim=64, copy_GBps=copy_gbps)


if __name__ == "__main__":
    sys.exit(gpu_main("bench_mla_tiles_gpu", measure))
