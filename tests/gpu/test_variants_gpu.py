"""The Triton attention variants newer than the first GPU plan, on CUDA at real sizes against the fp64
oracle on contiguous K/V: attention sinks, chunked attention, tree masks (with windows and chunks
measured between depths, and sinks), and sliding windows over tables whose pages below the window
are the null page (a layer group's). The `cpu` variant runs the same bodies at small sizes in the
Triton interpreter."""

from __future__ import annotations

import random

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import (
    PagedBatch,
    assert_attention_within_rounding,
    attention_fp64_and_spread,
    make_paged_batch,
)

if torch.cuda.is_available() and unavailable_reason(torch.device("cuda")) is not None:
    pytest.skip(unavailable_reason(torch.device("cuda")), allow_module_level=True)

DEVICES = ["cuda", "cpu"]
# device: (page size, kv heads, q heads per kv head, head_dim, long cached length)
SIZES = {"cuda": (16, 8, 4, 128, 20000), "cpu": (4, 2, 2, 32, 300)}
SCALE = 0.09


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


def batch(device: str, cached: list[int], new: list[int], seed: int) -> PagedBatch:
    page, kv_heads, group, head_dim, _ = SIZES[device]
    return make_paged_batch(
        cached,
        new,
        page_size=page,
        num_kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device=device,
        seed=seed,
    )


def attend(b: PagedBatch, **options) -> torch.Tensor:
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    return pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, SCALE, **options)


def check(b: PagedBatch, out: torch.Tensor, **options) -> None:
    exact, spread = attention_fp64_and_spread(b.q, b.keys, b.values, b.cache_lengths.tolist(), SCALE, **options)
    assert_attention_within_rounding(out, exact, spread)


def sinks(b: PagedBatch, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b.q.shape[1], generator=gen) * 3.0).to(b.q.device)


def tree_masks(new: list[int], seed: int, deep: bool = False) -> torch.Tensor:
    """Random trees, one per sequence: each draft's mask holds itself and its ancestors (`deep`: each
    draft's parent among the 3 before it, so depths reach about n / 2)."""
    rng, masks = random.Random(seed), []
    for n in new:
        bits: list[int] = []
        for i in range(n):
            parent = rng.randrange(max(i - 3, -1) if deep else -1, i) if i else -1
            bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
        masks += [b - (1 << 64) if b >= 1 << 63 else b for b in bits]
    return torch.tensor(masks, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_sinks_in_split_decode_and_prefill(device):
    long = SIZES[device][4]
    b = batch(device, [long, 3000 % long, 17, 0, 500 % long], [1, 1, 1, 300, 129], seed=1)
    s = sinks(b, 2)
    check(b, attend(b, sinks=s), sinks=s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [8, 128])
def test_chunked_attention(device, chunk):
    long = SIZES[device][4]
    b = batch(device, [long, 0, 300 % long, 40], [1, 200, 64, 1], seed=chunk)
    check(b, attend(b, attention_chunk_size=chunk), attention_chunk_size=chunk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [-1, 65, 1024], ids=["full", "window65", "window1024"])
def test_trees_with_sinks(device, window):
    """Ragged trees (one of 64 drafts, whose last mask is the sign bit; a plain decode row) over long
    and empty prefixes, with sinks; windows measured from each draft's depth."""
    long = SIZES[device][4]
    new = [11, 64, 1, 24]
    b = batch(device, [long, 0, 700 % long, 33], new, seed=window + 5)
    mask, s = tree_masks(new, seed=window).to(device), sinks(b, 3)
    out = attend(b, tree_mask=mask, sinks=s, sliding_window=window)
    check(b, out, tree_mask=mask, sinks=s, sliding_window=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "option",
    [
        {"sliding_window": 3},
        {"sliding_window": 64},
        {"attention_chunk_size": 16},
        {"sliding_window": 17, "attention_chunk_size": 128},
    ],
    ids=["window3", "window64", "chunk16", "window17+chunk128"],
)
def test_trees_with_narrow_windows_and_chunks(device, option):
    """Deep ragged trees whose windows (64 or less) and chunks are measured between depths, ancestors
    included, with sinks, over long and empty prefixes."""
    long = SIZES[device][4]
    new = [40, 64, 1, 24]
    b = batch(device, [long, 0, 700 % long, 120], new, seed=7)
    mask, s = tree_masks(new, seed=11, deep=True).to(device), sinks(b, 4)
    out = attend(b, tree_mask=mask, sinks=s, **option)
    check(b, out, tree_mask=mask, sinks=s, **option)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wide", [False, True], ids=["window7", "window-long/20"])
def test_window_over_null_pages(device, wide):
    """A layer group's table: each row's pages wholly below the window are the null page and what they
    held is NaN (given back; another sequence may write them)."""
    page, long = SIZES[device][0], SIZES[device][4]
    window = long // 20 if wide else 7
    cached = [long, 17, 4000 % long, 300 % long]
    b = batch(device, cached, [1, 1, 1, 64], seed=window)
    params = pk.KVCacheParams(torch.bfloat16, 1, 1, 1, page, sliding_window=window)
    dropped = 0
    for row, length in enumerate(cached):
        first = params.first_held_page(length)
        b.blocks[b.lookup_table[row, :first].long()] = float("nan")
        b.lookup_table[row, :first] = pk.NULL_PAGE
        dropped += first
    assert dropped > 0
    check(b, attend(b, sliding_window=window), sliding_window=window)
