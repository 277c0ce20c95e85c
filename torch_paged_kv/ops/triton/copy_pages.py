"""`copy_pages`: whole pages through a scratch buffer, so overlapping src/dst lists are safe.

Pass 1 reads every source page into scratch, pass 2 writes every destination; kernels on one
stream run in order, so no destination is written before all sources are read. Grid: (chunks of
a page, pages): a continuous-batching page has millions of chunks, so they go on x (up to
2**31 - 1; grid y stops at 65535) and a program takes every `num_programs(1)`-th page past 65535.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..records import CopyPagesArgs
from .common import MAX_GRID, Launch, grid_fits, real_page

BLOCK = 1024


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["count", "num_pages"])
def _copy_kernel(
    src, src_pages, dst, dst_pages, count, num_pages, page_numel, FROM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    for i in range(tl.program_id(1), count, tl.num_programs(1)):
        # Only the blocks side is indexed by page id; ids outside blocks are skipped, never clamped,
        # and the null page (0) is never written.
        if FROM_BLOCKS:
            page = tl.load(src_pages + i)
            ok = real_page(page, num_pages, False)
            src_off = page.to(tl.int64) * page_numel
            dst_off = tl.cast(i, tl.int64) * page_numel
        else:
            page = tl.load(dst_pages + i)
            ok = real_page(page, num_pages, True)
            src_off = tl.cast(i, tl.int64) * page_numel
            dst_off = page.to(tl.int64) * page_numel
        mask = idx < tl.where(ok, page_numel, 0)  # (scalar & block masks break the interpreter)
        tl.store(dst + dst_off + idx, tl.load(src + src_off + idx, mask=mask), mask=mask)


def _grid(count: int, page_numel: int) -> tuple[int, int]:
    """Chunks of a page on x, pages on y (capped: a program loops over every 65535th page)."""
    return triton.cdiv(page_numel, BLOCK), min(count, MAX_GRID[1])


def supports(a: CopyPagesArgs) -> bool:
    """Calls whose grid CUDA can launch (shapes only): pages below 2**41 elements."""
    page_numel = math.prod(a.blocks.shape[1:])
    return a.src_pages.shape[0] == 0 or page_numel == 0 or grid_fits(_grid(a.src_pages.shape[0], page_numel))


def plan_copy_pages(a: CopyPagesArgs) -> list[Launch]:
    """Two launches per page tensor (sources to scratch, scratch to destinations): `blocks`, as raw
    bytes for an FP8 cache, and per-granule `scales`, which move with their pages. Allocates the scratch."""
    blocks, scales = a.blocks, a.scales
    pools = [blocks.view(torch.uint8) if scales is not None else blocks]
    if scales is not None and scales.dim() == 6:
        pools.append(scales)
    return [launch for pool in pools for launch in _plan_pool(pool, a.src_pages, a.dst_pages)]


def _plan_pool(pool: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> list[Launch]:
    count = src_pages.shape[0]
    if count == 0:
        return []
    page_numel = pool[0].numel()
    scratch = torch.empty((count, page_numel), dtype=pool.dtype, device=pool.device)
    grid = _grid(count, page_numel)
    num_pages = pool.shape[0]
    return [
        Launch(
            _copy_kernel,
            grid,
            (pool, src_pages, scratch, dst_pages, count, num_pages, page_numel),
            dict(FROM_BLOCKS=True, BLOCK=BLOCK),
        ),
        Launch(
            _copy_kernel,
            grid,
            (scratch, src_pages, pool, dst_pages, count, num_pages, page_numel),
            dict(FROM_BLOCKS=False, BLOCK=BLOCK),
        ),
    ]


def copy_pages(a: CopyPagesArgs) -> None:
    for launch in plan_copy_pages(a):
        launch()
