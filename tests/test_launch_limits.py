"""Every planned launch fits CUDA's grid limits (x < 2**31, y and z <= 65,535) at the largest shapes
the collections allow, checked on CPU from the launches the wrappers plan on meta tensors; and each
backend's `supports` refuses what its kernels could not launch.

The largest shapes: index tensors are int32, so up to 2**31 - 1 new rows, tokens per sequence and
pages; a continuous-batching slot (page_size = max_seq_len) of a million tokens spans hundreds of
gigabytes of K/V over a model's layers. Before the grids were rearranged, `copy_pages` put a page's
chunks on grid y (a 65,536-slot page of 32 layers x 8 x 128 is 4.3e9 elements, 4.2 million chunks)
and `gather_kv` its token tiles (past 262,140 tokens); the CuTe decode kernel put query rows on z
and the split merge on y.
"""

from __future__ import annotations

import pytest
import torch

import torch_paged_kv

pytest.importorskip("triton")

from torch_paged_kv.ops import splits as split_rule
from torch_paged_kv.ops.records import CopyPagesArgs, FlashAttentionArgs, GatherKVArgs, StoreKVArgs
from torch_paged_kv.ops.triton import copy_pages, flash_attention, gather_kv, store_kv
from torch_paged_kv.ops.triton.common import MAX_GRID

INT32_MAX = 2**31 - 1
MANY = 100_000  # sequences or pages past grid y's 65,535


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def index(*shape: int) -> torch.Tensor:
    return meta(*shape, dtype=torch.int32)


def pool(pages: int, layers: int, page_size: int, kv_heads: int = 8, head_dim: int = 128) -> torch.Tensor:
    return meta(pages, 2, layers, page_size, kv_heads, head_dim)


def assert_fits(launches) -> None:
    for launch in launches:
        assert len(launch.grid) <= 3 and all(0 < n <= limit for n, limit in zip(launch.grid, MAX_GRID, strict=False)), (
            launch.kernel.__name__,
            launch.grid,
        )


def slot_step(batch: int, slot: int, layers: int = 32, kv_heads: int = 8, head_dim: int = 128) -> tuple:
    """A continuous-batching pool of `batch` slots of `slot` tokens, its 1-D table and step tensors."""
    return pool(batch + 1, layers, slot, kv_heads, head_dim), index(batch), index(batch), index(batch + 1)


@pytest.mark.parametrize(
    "total, batch, kv_heads, head_dim",
    [(INT32_MAX - MANY, MANY, 8, 128), (MANY, 1, 64, 256), (7, 7, 65535, 16)],
)
def test_store_kv_grid(total, batch, kv_heads, head_dim):
    blocks, lengths, table, offsets = slot_step(batch, 16, 2, kv_heads, head_dim)
    rows = meta(total, kv_heads, head_dim)
    args = StoreKVArgs(rows, rows, blocks, lengths, table, offsets, 1)
    assert store_kv.supports(args)
    assert_fits(store_kv.plan_store_kv(args))


@pytest.mark.parametrize(
    "batch, slot, max_kv_len, kv_heads",
    [
        (1, 65536, 65536, 1),  # 16,384 token tiles: within y, but only just
        (1, 2**20, 2**20, 8),  # a million-token slot: 262,144 tiles (on y they did not fit)
        (MANY, 2**20, 300_000, 8),  # sequences past y as well
        (2, INT32_MAX, INT32_MAX, 8),  # the longest sequence int32 positions allow
    ],
)
def test_gather_kv_grid(batch, slot, max_kv_len, kv_heads):
    blocks, lengths, table, offsets = slot_step(batch, slot, 4, kv_heads)
    args = GatherKVArgs(blocks, lengths, table, offsets, 3, max_kv_len)
    assert gather_kv.supports(args)
    assert_fits(gather_kv.plan_gather_kv(args)[2])


@pytest.mark.parametrize(
    "count, layers, slot",
    [
        (1, 32, 65536),  # one 65,536-slot page of 32 layers: 4.3e9 elements, 4.2 million chunks
        (MANY, 128, 2**20),  # pages past y, each 2.7e11 elements (a 1M-token slot of 128 layers)
        (MANY, 2, 16),  # many small pages
    ],
)
def test_copy_pages_grid(count, layers, slot):
    blocks = pool(count + 1, layers, slot)
    args = CopyPagesArgs(blocks, index(count), index(count))
    assert copy_pages.supports(args)
    assert_fits(copy_pages.plan_copy_pages(args))


def test_copy_pages_refuses_a_page_whose_chunks_overflow_grid_x():
    blocks = pool(2, 2**12, 2**20, 8, 128)  # 2**43 elements per page: 2**33 chunks
    assert not copy_pages.supports(CopyPagesArgs(blocks, index(1), index(1)))


@pytest.mark.parametrize(
    "total, batch, kv_heads, group, slot",
    [
        (MANY, MANY, 8, 4, 65536),  # decode, batch past y
        (1, 1, 8, 16, 2**20),  # decode, one million-token slot: 64 splits
        (2**24, 16, 8, 8, 2**20),  # prefill, 16M new rows
        (4096, 4096, 65535 // 4, 4, 16),  # as many KV heads as y holds
    ],
)
def test_flash_attention_grid(total, batch, kv_heads, group, slot):
    blocks, lengths, table, offsets = slot_step(batch, slot, 2, kv_heads, 64)
    q = meta(total, kv_heads * group, 64)
    args = FlashAttentionArgs(q, blocks, lengths, table, offsets, 1, 0.125)
    assert flash_attention.supports(args)
    assert_fits(flash_attention.plan_flash_attention(args)[1])


def test_flash_attention_refuses_what_it_cannot_launch():
    blocks, lengths, table, offsets = slot_step(4, 16, 2, 65536, 16)  # more KV heads than grid y holds
    assert not flash_attention.supports(FlashAttentionArgs(meta(4, 65536, 16), blocks, lengths, table, offsets, 1, 0.1))
    blocks, lengths, table, offsets = slot_step(4, 16, 2, 1, 16)
    q = meta(4, 65536, 16)  # the split merge puts query heads on y
    assert not flash_attention.supports(FlashAttentionArgs(q, blocks, lengths, table, offsets, 1, 0.1))
    odd_head_dim = FlashAttentionArgs(meta(4, 1, 24), meta(5, 2, 1, 16, 1, 24), lengths, table, offsets, 1, 0.1)
    assert not flash_attention.supports(odd_head_dim)


# -- CuTe ----------------------------------------------------------------------------------------


def test_cute_launch_grids_fit_at_the_largest_decode_batch():
    """The CuTe decode kernel's grid (query rows, KV heads, splits) and the merge's (rows, query heads)
    are built by `grids.decode_grid` / `combine_grid`, which the kernels' launches call (pinned
    in test_cute_compile.py); `attention.covers` is `supports` without the device."""
    from torch_paged_kv.ops.cute import attention, grids

    assert grids.MAX_GRID == MAX_GRID
    blocks = meta(1025, 2, 1, 64, 8, 128)  # rows may share pages; the row view stays below 2**31 (TMA)
    for rows in (MANY, INT32_MAX):
        q = meta(rows, 32, 128)
        assert attention.covers("sm_90a", q, blocks, rows)
        assert grids.grid_fits(grids.decode_grid(rows, 8, split_rule.MAX_SPLITS))
        assert grids.grid_fits(grids.combine_grid(rows, 32))
    blocks = meta(2, 2, 1, 64, 65536, 64)
    assert not attention.covers("sm_90a", meta(1, 65536, 64), blocks, 1)  # KV heads past grid y


def test_cute_refuses_sm100_until_a_blackwell_run(monkeypatch, force_backend):
    """The sm_100a kernels compile and pass the PTX/SASS checks, but have never run: both
    `supports` and the backend's availability (what `backend_info` and a forced call report) say so."""
    from torch_paged_kv.ops import cute
    from torch_paged_kv.ops.cute import attention

    monkeypatch.delenv(cute.UNVERIFIED_ARCH_ENV, raising=False)
    q, blocks = meta(4, 32, 128), meta(5, 2, 1, 64, 8, 128)
    assert attention.covers("sm_90a", q, blocks, 4)
    assert not attention.covers("sm_100a", q, blocks, 4)
    assert "never run on a Blackwell GPU" in cute.unverified_reason("sm_100a")
    assert cute.unverified_reason("sm_90a") is None
    monkeypatch.setattr(cute.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cute, "device_arch", lambda index: "sm_100a")
    assert "never run on a Blackwell GPU" in cute.unavailable_reason(torch.device("cuda", 0))
    force_backend("cute")  # what a forced call reports (BackendUnavailableError) and backend_info says
    assert "never run on a Blackwell GPU" in torch_paged_kv.backend_info("cuda:0")["flash_attention"]
    monkeypatch.setenv(cute.UNVERIFIED_ARCH_ENV, "1")  # the Blackwell session that verifies them
    assert attention.covers("sm_100a", q, blocks, 4)
