"""MLA decode tiles on the GPU: the Triton `mla_attention` plan against candidate tiles, at the shapes of
`bench_mla_gpu.py` (batch 64 x 4096, kv_lora_rank 512 + rope 64, pages shuffled).

Each row plans the launches once (the kernel and the split merge; no op dispatch is timed) with one
(BLOCK_H, BLOCK_N, num_warps) tile forced, or the plan's own ("plan"), and for FP8 rows one read path
(the hardware conversion of sm_89+, or the integer decode the plan used before); it is checked against
the reference backend, then timed and printed at once (`ROW <json>`). The candidates test the
hypotheses of docs/mla.md ("Tiles"): 64 heads per key tile for 128 heads (wgmma; 4.6 warp instructions
per key and head on sm_90 against 10.3 at 16 heads, and the latent read 2 times instead of 8).
Then sparse attention (`key_positions`, `mla_sparse.py`): each query's top 2048 of its 4096 keys
(DeepSeek-V3.2's index_topk), the plan's tile and the 16-head one at 128 heads; bytes are the listed
rows, their positions, q and out.

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
from torch_paged_kv.ops.triton import mla_sparse as triton_sparse

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
SPARSE_KEYS = 2048  # DeepSeek-V3.2's index_topk
# (cache, heads, page, tile (BLOCK_H, BLOCK_N, num_warps) or None for the plan's)
SPARSE_ROWS = [
    ("bf16", 16, 64, None),
    ("bf16", 128, 64, None),
    ("bf16", 128, 64, (16, 32, 4)),
    ("bf16", 128, 1, None),
    ("e4m3 per token, rope bf16", 16, 64, None),
    ("e4m3 per token, rope bf16", 128, 64, None),
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
    for cache, heads, page, tile in SPARSE_ROWS:
        try:
            row = sparse_row(cache, heads, page, tile, copy_gbps)
        except Exception as exc:  # building the inputs failed: reported, not fatal
            row = dict(cache=cache, heads=heads, page_size=page, us=f"unavailable: {type(exc).__name__}: {exc}"[:200])
        stream("ROW", row)
        rows.append(row)
    return rows, dict(batch=64, context=4096, kv_lora_rank=512, rope_dim=64, copy_GBps=copy_gbps)


def sparse_row(cache: str, heads: int, page: int, tile: tuple[int, int, int] | None, copy_gbps: float) -> dict:
    """One sparse decode row: each query lists `SPARSE_KEYS` random distinct keys of its sequence."""
    plan, q_nope, q_rope, _ = decode_inputs(cache, page, heads)
    batch, context = q_nope.shape[0], int(plan.step[0][0]) + 1
    gen = torch.Generator().manual_seed(heads + page)
    keys = min(SPARSE_KEYS, context)
    positions = torch.stack([torch.randperm(context, generator=gen)[:keys] for _ in range(batch)]).int()
    positions = positions.to(q_nope.device)
    a = MLAAttentionArgs(q_nope, q_rope, plan.blocks, *plan.step, 0, 192**-0.5, True, plan.scales, positions)
    expected = reference_mla.mla_attention(*a)
    row_bytes = plan.blocks.shape[-1] * plan.blocks.element_size() + (4 if plan.scales is not None else 0)
    moved = batch * keys * (row_bytes + 4) + 2 * (2 * q_nope.numel() + q_rope.numel())

    def planned() -> Callable[[], torch.Tensor]:
        with contextlib.ExitStack() as patches:
            if tile is not None:
                blocks_for = lambda *_, h=tile[0], n=tile[1], w=tile[2]: (h, 1, n, w)
                patches.enter_context(mock.patch.object(triton_mla, "_blocks_for", blocks_for))  # (mla_tiles)
            out, launches = triton_sparse.plan_mla_sparse(a)

        def run() -> torch.Tensor:
            for launch in launches:
                launch()
            return out

        return run

    result = _measure(planned, lambda out: check_close(out, expected, f"triton sparse {cache}"))
    us = result[0] if isinstance(result, tuple) else result
    gbps = moved / us / 1e3 if isinstance(us, float) else None
    return dict(cache=f"{cache}, top {keys} keys", heads=heads, page_size=page,
                tile="plan" if tile is None else str(tile), us=us,
                **{"GB/s": gbps, "of_copy": gbps / copy_gbps if gbps else None})  # fmt: skip


if __name__ == "__main__":
    sys.exit(gpu_main("bench_mla_tiles_gpu", measure))
