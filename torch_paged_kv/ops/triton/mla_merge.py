"""Merge of MLA decode splits: out = sum_s 2^(lse_s - max) o_s / (sum_s 2^(lse_s - max) + 2^(sink - max)),
the sink term only with attention sinks (one logit per head). One program per (row, head), looping
over the splits (a `[splits, kv_lora_rank]` tile, as `flash_merge` holds for head_dim, would take
64 x 512 fp32 values per program at 64 splits: spills)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch


# per-call sizes: no specialisation on ==1 or %16, so a new total compiles nothing
@triton.jit(do_not_specialize=["total"])
def _mla_merge_kernel(
    part_out,
    part_lse,
    out,
    total,
    num_heads,
    num_splits,
    out_stride_row,
    out_stride_head,
    sinks,
    SINK: tl.constexpr,
    RANK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dim = tl.arange(0, RANK)
    top = tl.full([], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        top = tl.maximum(top, tl.load(part_lse + (s * total + row).to(tl.int64) * num_heads + head))
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights 0, output 0
    norm = tl.zeros([], tl.float32)
    acc = tl.zeros([RANK], tl.float32)
    for s in range(0, num_splits):
        part_row = (s * total + row).to(tl.int64) * num_heads + head
        weight = tl.exp2(tl.load(part_lse + part_row) - top)
        norm += weight
        acc += weight * tl.load(part_out + part_row * RANK + dim)
    if SINK:  # the head's sink logit (log2 units) joins the denominator once
        norm += tl.exp2(tl.load(sinks + head) * 1.4426950408889634 - top)
    merged = acc / tl.where(norm > 0, norm, 1.0)
    tl.store(out + row.to(tl.int64) * out_stride_row + head * out_stride_head + dim, merged.to(out.dtype.element_ty))


def plan_mla_merge(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None = None
) -> Launch:
    """Combine `part_out [splits, total, heads, kv_lora_rank]` (normalized, fp32) with log2-sum-exp
    `part_lse [splits, total, heads]` (and `sinks [heads]`, fp32) into `out [total, heads, kv_lora_rank]`."""
    splits, total, num_heads, rank = part_out.shape
    return Launch(
        _mla_merge_kernel,
        (total, num_heads),
        (
            part_out,
            part_lse,
            out,
            total,
            num_heads,
            splits,
            out.stride(0),
            out.stride(1),
            out if sinks is None else sinks,  # (not read without sinks)
        ),
        dict(SINK=sinks is not None, RANK=rank),
    )
