"""Helpers shared by the Triton kernels.

Triton fixes interpreter or compiled mode per process: `triton.jit` (its own library included)
reads `TRITON_INTERPRET` when it decorates. Kernels on CPU tensors therefore need the variable
set before triton is first imported; kernels on CUDA tensors need it unset.
"""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

MAX_GRID = (2**31 - 1, 65535, 65535)
"""CUDA's launch limits on grid x, y and z: a dimension that grows with the cache goes on x."""


META_ARCH: ContextVar[int] = ContextVar("META_ARCH", default=90)
"""The SM version that launches planned on "meta" tensors target (`aot` sets it per architecture)."""


def sm_version(device: torch.device) -> int:
    """The SM version kernels on `device` compile for (90 for sm_90); `META_ARCH` on "meta"; 0 off CUDA."""
    if device.type == "meta":
        return META_ARCH.get()
    if device.type != "cuda":
        return 0
    major, minor = _capability(device)
    return 10 * major + minor


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


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
def query_tile(input_row_offsets, batch, tile, BLOCK_Q: tl.constexpr, STEPS: tl.constexpr):
    """Query tile `tile` of an attention grid in which every sequence starts a tile of its own (the
    tile count is bounded by `total // BLOCK_Q + batch`): (its sequence, the sequence's first new
    row, its new-token count, the tile's first new token). A tile whose first token is at or past
    the count holds no query."""
    seq = owning_sequence(input_row_offsets, batch, tile, BLOCK_Q, 1, STEPS)
    row0 = tl.load(input_row_offsets + seq)
    new = tl.load(input_row_offsets + seq + 1) - row0
    q_start = (tile - (row0 // BLOCK_Q + seq)) * BLOCK_Q
    return seq, row0, new, q_start


@triton.jit
def tile_rows(q_start, row0, new, total, first_head, head_end, HEADS_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The `BLOCK_M` rows of a query tile: row m is new token `q_start + m // HEADS_P` and head
    `first_head + m % HEADS_P`. Returns (token, head, row of q, whether the row is real: a new token,
    a head below `head_end`, and a row inside q whatever the offsets say, since an `.unchecked`
    call's need not match q)."""
    m = tl.arange(0, BLOCK_M)
    tok = q_start + m // HEADS_P
    head = first_head + m % HEADS_P
    q_rows = (row0 + tok).to(tl.int64)
    row_ok = (tok < new) & (head < head_end) & (q_rows >= 0) & (q_rows < total)
    return tok, head, q_rows, row_ok


@triton.jit
def popcount64(x):
    """The set bits of each int64 in `x` (all 64, the sign bit too), by SWAR arithmetic: `>>` is
    arithmetic, so every shifted value is masked to drop the copies of the sign bit."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F  # a count per byte; bit 63 is clear from here on
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


@triton.jit
def popcount32(x):
    """The set bits of each int32 in `x` (all 32), by SWAR arithmetic (as `popcount64`)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def online_softmax(s, m_i, l_i):
    """One key tile of the online softmax, in base 2: `s` the tile's scores times log2(e), -inf where
    masked; `m_i` and `l_i` each row's running max and sum. Returns (the tile's probabilities against
    the new max, the factor that rescales what was accumulated, the new max, the new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def store_rows(
    o, m_i, l_i, out, out_stride_row, out_stride_head, part_out, part_lse, split, total, num_heads,
    row0, tok, q_rows, head, row_ok, DIM: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """Write a query tile's normalised output `o` ([rows, DIM] fp32): to `out` in its dtype, or, for
    split `split` of a split-KV launch, to the fp32 partials `part_out` with each row's log2-sum-exp
    in `part_lse` (-inf for a row that saw no key) for the merge kernel."""
    dim = tl.arange(0, DIM)
    if SPLIT:
        seen = l_i > 0
        part_row = (split * total + row0 + tok).to(tl.int64) * num_heads + head
        tl.store(part_out + part_row[:, None] * DIM + dim[None, :], o, mask=row_ok[:, None])
        tl.store(
            part_lse + part_row, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=row_ok
        )
    else:
        out_off = (q_rows * out_stride_row + head * out_stride_head)[:, None] + dim[None, :]
        tl.store(out + out_off, o.to(out.dtype.element_ty), mask=row_ok[:, None])


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
def key_pages(table_row, j, end, page_size, table_width, num_pages, WIDE_PAGE: tl.constexpr):
    """The pages holding keys `j` (a block of positions) of a sequence whose lookup-table row starts at
    `table_row`, for a read: (the pages, the keys' offsets in them, whether each key may be read:
    `page_at`). `WIDE_PAGE`: offsets inside one page pass 2**31 (a slot of millions of tokens), so
    they are int64."""
    page, key_ok = page_at(table_row, j, end, page_size, table_width, num_pages, False)
    in_page = j % page_size
    if WIDE_PAGE:
        in_page = in_page.to(tl.int64)
    return page, in_page, key_ok


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
