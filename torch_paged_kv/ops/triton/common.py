"""Helpers shared by the Triton kernels.

Triton fixes interpreter or compiled mode per process: `triton.jit` (its own library included)
reads `TRITON_INTERPRET` when it decorates. Kernels on CPU tensors therefore need the variable
set before triton is first imported; kernels on CUDA tensors need it unset.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

MAX_GRID = (2**31 - 1, 65535, 65535)
"""CUDA's launch limits on grid x, y and z: a dimension that grows with the cache goes on x."""


def grid_fits(grid: tuple[int, ...]) -> bool:
    """Whether CUDA can launch `grid`."""
    return all(0 < n <= limit for n, limit in zip(grid, MAX_GRID, strict=False))


class Launch(NamedTuple):
    """One kernel launch planned from shapes: what a wrapper runs, and what `aot` compiles."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps)

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def is_interpreted(t: torch.Tensor) -> bool:
    """Whether kernels on `t` run in the interpreter (which needs fp32 math: its bf16 is wrong)."""
    return t.device.type == "cpu"


MIN_SEARCH_STEPS = 16


def search_steps(batch: int) -> int:
    """Binary-search steps that find one of `batch` sequences (a compile-time constant). The same
    for every batch up to 2**16, so one compiled kernel serves a growing serving batch (a search
    that has converged stays put: extra steps cost a few cached loads, never a recompile)."""
    return max(MIN_SEARCH_STEPS, (batch - 1).bit_length())


@triton.jit
def owning_sequence(input_row_offsets, batch, target, TILE: tl.constexpr, PAD: tl.constexpr, STEPS: tl.constexpr):
    """The largest b < batch with `input_row_offsets[b] // TILE + PAD * b <= target`, in STEPS
    binary-search steps: the sequence owning new row `target` (TILE=1, PAD=0), or query tile
    `target` when every sequence starts a tile of its own (TILE=BLOCK_Q, PAD=1)."""
    seq = 0
    last = batch - 1
    for _ in tl.static_range(STEPS):
        mid = (seq + last + 1) // 2
        take = tl.load(input_row_offsets + mid) // TILE + PAD * mid <= target
        seq = tl.where(take, mid, seq)
        last = tl.where(take, last, mid - 1)
    return seq


@triton.jit
def real_page(page, num_pages, WRITE: tl.constexpr):
    """Whether page id `page` names one of the pool's `num_pages` pages that a kernel may read, or
    write (`WRITE`: never the null page 0). Every K/V kernel guards its page reads and writes with it
    (through `page_at` where a table is read), so that no step value, an `.unchecked` call's, makes
    one leave `blocks`."""
    return (page >= (1 if WRITE else 0)) & (page < num_pages)


@triton.jit
def page_at(table_row, pos, end, page_size, table_width, num_pages, WRITE: tl.constexpr):
    """The page holding position `pos` of a sequence whose lookup-table row starts at `table_row`,
    and whether a kernel may touch it there: `pos` below `end` and inside the table, and the page a
    `real_page`. A write's position also must not be negative (it comes from `cache_lengths`, which
    an `.unchecked` call may make so; reads walk positions from 0). The table is read only where
    that holds (the page is 0 elsewhere). Scalars or blocks."""
    col = pos // page_size
    ok = (pos < end) & (col < table_width)
    if WRITE:
        ok = ok & (pos >= 0)
    page = tl.load(table_row + col, mask=ok, other=0)
    return page, ok & (page >= (1 if WRITE else 0)) & (page < num_pages)  # real_page, as (ok & lo) & hi


@triton.jit
def new_row_page(
    row, cache_lengths, lookup_table, input_row_offsets, batch, num_pages, table_width, table_stride, page_size,
    STEPS: tl.constexpr,
):  # fmt: skip
    """Where new row `row` of a step is written: (its position in its sequence, the page holding that
    position, whether a kernel may write there: `page_at` for a write). Its sequence is found in
    `STEPS` binary-search steps (`owning_sequence`)."""
    seq = owning_sequence(input_row_offsets, batch, row, 1, 0, STEPS)
    pos = tl.load(cache_lengths + seq) + row - tl.load(input_row_offsets + seq)
    table_row = lookup_table + seq.to(tl.int64) * table_stride
    page, ok = page_at(table_row, pos, table_width * page_size, page_size, table_width, num_pages, True)
    return pos, page, ok


def blocks_strides(blocks: torch.Tensor) -> tuple[int, int, int, int]:
    """(page, plane, layer, token) strides of `blocks` in elements; heads x head_dim are dense."""
    return blocks.stride(0), blocks.stride(1), blocks.stride(2), blocks.stride(3)
