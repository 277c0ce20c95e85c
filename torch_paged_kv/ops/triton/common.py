"""Helpers shared by the Triton kernels: interpreter mode, sequence lookup, launch sizes.

Triton decides at decoration time whether a kernel is compiled or interpreted, so the mode is
fixed when this module is first imported (the kernel modules are imported lazily, on first call).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether the kernels in this process were built for Triton's interpreter (CPU tensors)."""


def search_steps(batch: int) -> int:
    """Binary-search steps that find one of `batch` sequences (a compile-time constant)."""
    return max(1, (batch - 1).bit_length())


def blocks_strides(blocks: torch.Tensor) -> tuple[int, int, int, int]:
    """(page, plane, layer, token) strides of `blocks` in elements; heads x head_dim are dense."""
    return blocks.stride(0), blocks.stride(1), blocks.stride(2), blocks.stride(3)


@triton.jit
def find_sequence(input_row_offsets, key, batch, TILE: tl.constexpr, PAD: tl.constexpr,
                  STEPS: tl.constexpr):
    """Largest b in [0, batch) with `input_row_offsets[b] // TILE + b * PAD <= key`.

    With TILE=1, PAD=0 this is the sequence owning new row `key`; with PAD=1 it is the sequence
    owning query tile `key` when sequence b's tiles start at `offsets[b] // TILE + b`.
    """
    lo = 0
    hi = batch - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        start = tl.load(input_row_offsets + mid) // TILE + mid * PAD
        take = start <= key
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo
