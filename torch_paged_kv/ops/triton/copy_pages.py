"""`copy_pages`: whole pages through a scratch buffer, so overlapping src/dst lists are safe.

Pass 1 reads every source page into scratch, pass 2 writes every destination; kernels on one
stream run in order, so no destination is written before all sources are read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch

BLOCK = 1024


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["num_pages"])
def _copy_kernel(src, src_pages, dst, dst_pages, num_pages, page_numel, FROM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    idx = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # Only the blocks side is indexed by page id; ids outside blocks are skipped, never clamped.
    if FROM_BLOCKS:
        page = tl.load(src_pages + i)
        ok = (page >= 0) & (page < num_pages)
        src_off = page.to(tl.int64) * page_numel
        dst_off = i.to(tl.int64) * page_numel
    else:
        page = tl.load(dst_pages + i)
        ok = (page > 0) & (page < num_pages)  # the null page (0) is never written
        src_off = i.to(tl.int64) * page_numel
        dst_off = page.to(tl.int64) * page_numel
    mask = idx < tl.where(ok, page_numel, 0)  # (scalar & block masks break the interpreter)
    tl.store(dst + dst_off + idx, tl.load(src + src_off + idx, mask=mask), mask=mask)


def plan_copy_pages(blocks: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> list[Launch]:
    """Two launches (sources to scratch, scratch to destinations); allocates the scratch."""
    count = src_pages.shape[0]
    if count == 0:
        return []
    page_numel = blocks[0].numel()
    scratch = torch.empty((count, page_numel), dtype=blocks.dtype, device=blocks.device)
    grid = (count, triton.cdiv(page_numel, BLOCK))
    num_pages = blocks.shape[0]
    return [
        Launch(
            _copy_kernel,
            grid,
            (blocks, src_pages, scratch, dst_pages, num_pages, page_numel),
            dict(FROM_BLOCKS=True, BLOCK=BLOCK),
        ),
        Launch(
            _copy_kernel,
            grid,
            (scratch, src_pages, blocks, dst_pages, num_pages, page_numel),
            dict(FROM_BLOCKS=False, BLOCK=BLOCK),
        ),
    ]


def copy_pages(blocks: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    for launch in plan_copy_pages(blocks, src_pages, dst_pages):
        launch()
