"""MLA decode bandwidth of the Triton backend (`mla_attention`) on DeepSeek shapes, bf16 and FP8 rope-aware
latent rows, plus `store_latent` of one decode step under a CUDA graph.

kv_lora_rank 512, rope 64, 16 heads (DeepSeek-V2/V3 at tensor parallel 8) and 128 heads (one GPU),
batch 64 x 4096 context, page sizes 1 and 64, pages shuffled. Every row is checked against the
reference backend on the same rows before it is timed. Bytes: every cached row (and its scale)
once, q read and out written once; "of_copy" divides GB/s by a measured device-to-device copy.
FlashMLA (DeepSeek's kernel) is the anchor to compare against when it is installed: not here.

    PYTHONPATH=. python benchmarks/bench_mla_gpu.py

Prints a markdown table, writes benchmarks/results/bench_mla_gpu.{md,json}; exits 0 without CUDA.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from harness import WrongOutputError, check_close, copy_bandwidth_gbps, forced_backend, gpu_main, median_us

import torch_paged_kv as pk
from torch_paged_kv.ops import reference_mla

BATCH, CONTEXT, RANK, ROPE = 64, 4096, 512, 64
HEADS = (16, 128)
PAGE_SIZES = (1, 64)
CACHES = {"bf16": torch.bfloat16, "e4m3 per token, rope bf16": torch.float8_e4m3fn}
DEVICE = torch.device("cuda")


def decode_inputs(cache: str, page_size: int, heads: int) -> tuple[pk.StepPlan, torch.Tensor, torch.Tensor, int]:
    """A decode step over a filled MLA pool with shuffled pages: (plan, q_nope, q_rope, bytes moved)."""
    gen = torch.Generator().manual_seed(page_size)
    params = pk.KVCacheParams.mla(CACHES[cache], 1, page_size, RANK, ROPE)
    pages = BATCH * (-(-CONTEXT // page_size))
    c = pk.PagedKVCacheCollection(params, num_pages=pages, max_batch_size=BATCH, max_seq_len=CONTEXT, device=DEVICE)
    c.lookup_table[:, : pages // BATCH] = (torch.randperm(pages, generator=gen) + 1).view(BATCH, -1).int().to(DEVICE)
    plan = pk.StepPlan.of(c, c.step_tensors(BATCH))
    c.input_row_offsets.copy_(torch.arange(BATCH + 1, dtype=torch.int32) * CONTEXT)
    latent, rope = (torch.randn(BATCH * CONTEXT, n, generator=gen).bfloat16().to(DEVICE) for n in (RANK, ROPE))
    plan.store_latent(latent, rope, 0)
    c.cache_lengths.fill_(CONTEXT - 1)
    c.input_row_offsets.copy_(torch.arange(BATCH + 1, dtype=torch.int32))
    q_nope = torch.randn(BATCH, heads, RANK, generator=gen).bfloat16().to(DEVICE)
    q_rope = torch.randn(BATCH, heads, ROPE, generator=gen).bfloat16().to(DEVICE)
    row_bytes = params.head_dim * c.blocks.element_size() + 4 * params.scales_per_head
    moved = BATCH * CONTEXT * row_bytes + 2 * (2 * q_nope.numel() + q_rope.numel())
    return plan, q_nope, q_rope, moved


def _measure(make: Callable[[], Callable[[], Any]], check: Callable[[Any], None]) -> tuple[float, None] | str:
    try:
        fn = make()
        check(fn())
        return median_us(fn, DEVICE), None
    except WrongOutputError as exc:
        return f"WRONG: {str(exc)[:200]}"
    except Exception as exc:  # an unavailable row is reported, not fatal
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def measure() -> tuple[list[dict], dict]:
    copy_gbps = copy_bandwidth_gbps(DEVICE)
    rows = []
    for cache in CACHES:
        for heads in HEADS:
            for page in PAGE_SIZES:
                plan, q_nope, q_rope, moved = decode_inputs(cache, page, heads)
                expected = reference_mla.mla_attention(
                    q_nope, q_rope, plan.blocks, *plan.step, 0, 192**-0.5, True, plan.scales
                )

                def attend(plan=plan, q_nope=q_nope, q_rope=q_rope) -> Callable[[], torch.Tensor]:
                    def run() -> torch.Tensor:
                        with forced_backend("triton"):
                            return pk.mla_attention(q_nope, q_rope, plan.blocks, *plan.step, 0, 192**-0.5, True,
                                                    plan.scales)  # fmt: skip

                    return run

                result = _measure(attend, lambda out, e=expected, c=cache: check_close(out, e, f"triton {c}"))
                us = result[0] if isinstance(result, tuple) else result
                gbps = moved / us / 1e3 if isinstance(us, float) else None
                rows.append(dict(kernel="triton mla_attention", cache=cache, heads=heads, page_size=page, us=us,
                                 **{"GB/s": gbps, "of_copy": gbps / copy_gbps if gbps else None}))  # fmt: skip
        rows.append(store_row(cache))
    setup = dict(batch=BATCH, context=CONTEXT, kv_lora_rank=RANK, rope_dim=ROPE, copy_GBps=copy_gbps)
    return rows, setup


def store_row(cache: str) -> dict:
    """`store_latent` of one new row per sequence, replayed from a CUDA graph."""
    plan, *_ = decode_inputs(cache, 64, 16)
    latent = torch.randn(BATCH, RANK, device=DEVICE).bfloat16()
    rope = torch.randn(BATCH, ROPE, device=DEVICE).bfloat16()

    def make() -> Callable[[], None]:
        def store() -> None:
            with forced_backend("triton"):
                pk.store_latent(latent, rope, plan.blocks, *plan.step, 0, plan.scales)

        store()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            store()
        for t in plan.blocks, plan.scales:  # so the checked first replay must write the row itself
            if t is not None:
                t.view(torch.uint8).zero_()
        return graph.replay

    def check(_: object) -> None:
        view = pk.PagedKVCache(plan.blocks, *plan.step[:2], 0, 0, None, plan.scales, rope_dim=ROPE)
        if not torch.equal(view.load_rope(0, CONTEXT - 1), rope[0]):
            raise WrongOutputError("store_latent: the replayed graph did not write this step's rope key")

    result = _measure(make, check)
    return dict(kernel="store_latent, 64 rows, CUDA graph", cache=cache, page_size=64,
                us=result[0] if isinstance(result, tuple) else result)  # fmt: skip


if __name__ == "__main__":
    sys.exit(gpu_main("bench_mla_gpu", measure))
