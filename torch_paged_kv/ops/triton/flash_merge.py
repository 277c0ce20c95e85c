"""Merge of flash-decoding splits: out = sum_s 2^(lse_s - max) o_s / (sum_s 2^(lse_s - max) + 2^(sink - max)),
the sink term only with attention sinks (one logit per query head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["total"])
def _merge_kernel(
    part_out,
    part_lse,
    out,
    total,
    num_q_heads,
    out_stride_row,
    out_stride_head,
    sinks,
    SINK: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    dim = tl.arange(0, HEAD_DIM)
    part_row = (s * total + row).to(tl.int64) * num_q_heads + head
    lse = tl.load(part_lse + part_row, mask=s < SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    base = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - base)  # empty splits weigh 0
    o = tl.load(part_out + part_row[:, None] * HEAD_DIM + dim[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    norm = tl.sum(weight, 0)
    if SINK:  # the head's sink logit (log2 units) joins the denominator
        norm += tl.exp2(tl.load(sinks + head) * 1.4426950408889634 - base)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(norm > 0, norm, 1.0)
    tl.store(out + row.to(tl.int64) * out_stride_row + head * out_stride_head + dim, merged.to(out.dtype.element_ty))


def plan_merge(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None = None
) -> Launch:
    """Combine `part_out [splits, total, heads, head_dim]` (normalized, fp32) with log2-sum-exp
    `part_lse [splits, total, heads]` (and `sinks [heads]`, fp32) into `out [total, heads, head_dim]`."""
    splits, total, num_q_heads, head_dim = part_out.shape
    return Launch(
        _merge_kernel,
        (total, num_q_heads),
        (part_out, part_lse, out, total, num_q_heads, out.stride(0), out.stride(1), out if sinks is None else sinks),
        dict(SINK=sinks is not None, SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits), HEAD_DIM=head_dim),
    )
