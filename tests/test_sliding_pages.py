"""Sliding-window attention over tables whose pages below the window are gone (the null page), as a
sliding-window layer group's manager leaves them: every backend that runs on CPU (`reference`, `cpu`,
`triton` under the interpreter) gives the fp64 oracle's answer on contiguous K/V, and the value checks
accept exactly the tables whose pages cover what the window shows (the C++ one-pass check agreeing)."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.ops import validate
from torch_paged_kv.ops.cpu import kernels as cpu_kernels
from torch_paged_kv.ops.triton import flash_attention as triton_attention
from torch_paged_kv.testing import ATTENTION_TOLERANCE, attention_fp64, make_fp8_batch, make_paged_batch

CACHED, NEW, PAGE = [5, 0, 17, 30, 41], [3, 12, 1, 1, 2], 4


@pytest.fixture(params=["reference", "cpu", "triton"])
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def first_held(cached: int, window: int) -> int:
    """The first page a sequence of `cached` tokens still holds in a window-`window` group."""
    return pk.KVCacheParams(torch.float32, 1, 1, 1, PAGE, sliding_window=window).first_held_page(cached)


def drop_pages(b, window: int, poison: float = float("nan")) -> int:
    """Point each row's pages below the window at the null page (as the manager does) and poison what
    they held; returns how many entries were dropped."""
    dropped = 0
    for row, cached in enumerate(b.cache_lengths.tolist()):
        first = first_held(cached, window)
        gone = b.lookup_table[row, :first].long()
        b.blocks[gone] = poison  # given back: another sequence may write them now
        b.lookup_table[row, :first] = pk.NULL_PAGE
        dropped += first
    return dropped


@pytest.mark.parametrize("window", [1, 3, 7, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_attention_reads_only_held_pages(backend, window, dtype):
    b = make_paged_batch(CACHED, NEW, page_size=PAGE, group=2, head_dim=32, dtype=dtype, seed=window, fill=300.0)
    assert drop_pages(b, window) > 0
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, sliding_window=window)
    expected = attention_fp64(b.q, b.keys, b.values, CACHED, 0.3, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[dtype])


LIMITS = [dict(sliding_window=w) for w in (1, 3, 13)] + [dict(attention_chunk_size=c) for c in (4, 8, 16)]


def poison_before_first_visible(b, limit: dict, junk: float) -> None:
    """Fill the pages wholly before each row's first visible key (below the window, or before the
    first query's chunk) that its table still names with `junk`, as another sequence may have."""
    window, chunk = limit.get("sliding_window", -1), limit.get("attention_chunk_size", -1)
    poisoned = 0
    for row, cached in enumerate(b.cache_lengths.tolist()):
        first = first_held(cached, window) if window > 0 else cached // chunk * chunk // PAGE
        b.blocks[b.lookup_table[row, :first].long()] = junk
        poisoned += first
    assert poisoned > 0


@pytest.mark.parametrize("limit", LIMITS, ids=str)
def test_pages_before_the_first_visible_key_that_the_table_still_names_are_not_read(backend, limit):
    """A table that still names the pages wholly before the step's first visible key (a caller's own
    table, no manager), whose pages another sequence has since filled: the window's (chunk's) answer.
    `reference` and `cpu` read none of those keys (NaN there changes nothing); Triton reads the keys
    of its first key tile below the first visible key and masks them, so there the pages must hold
    finite values (docs/triton.md) unless `MASK_FIRST_TILE` is on (the next test)."""
    b = make_paged_batch(CACHED, NEW, page_size=PAGE, group=2, head_dim=32, seed=sum(limit.values()), fill=300.0)
    poison_before_first_visible(b, limit, float("nan") if backend != "triton" else -3.0e4)
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, **limit)
    expected = attention_fp64(b.q, b.keys, b.values, CACHED, 0.3, **limit)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("limit", LIMITS, ids=str)
def test_triton_with_its_first_tile_masked_reads_no_key_before_the_first_visible_one(force_backend, monkeypatch, limit):
    """`MASK_FIRST_TILE` on: NaN in the pages before the first visible key changes nothing in Triton."""
    force_backend("triton")
    monkeypatch.setattr(triton_attention, "MASK_FIRST_TILE", True)
    b = make_paged_batch(CACHED, NEW, page_size=PAGE, group=2, head_dim=32, seed=sum(limit.values()), fill=300.0)
    poison_before_first_visible(b, limit, float("nan"))
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, **limit)
    expected = attention_fp64(b.q, b.keys, b.values, CACHED, 0.3, **limit)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [2, 9])
def test_fp8_window_attention_reads_only_held_pages(backend, window):
    b, new_k, new_v = make_fp8_batch(CACHED, NEW, page_size=PAGE, seed=window)
    assert drop_pages(b, window, poison=448.0) > 0  # (FP8 has no NaN in e4m3fn's finite range: its max)
    pk.store_kv(new_k, new_v, b.blocks, *b.step, b.layer_idx, b.scales)
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, sliding_window=window, scales=b.scales)
    expected = attention_fp64(b.q.float(), b.keys, b.values, CACHED, 0.3, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("backend_name", ["reference", "cpu"])
def test_reads_past_the_held_pages_are_refused(force_backend, backend_name):
    """A wider window, full attention or gather_kv would read a dropped page: ValueError naming the
    table, nothing written."""
    force_backend(backend_name)
    window = 7
    b = make_paged_batch(CACHED, NEW, page_size=PAGE, group=2, seed=3)
    drop_pages(b, window, poison=1.0)
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    before = b.blocks.clone()
    for call in (
        lambda: pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, sliding_window=window + PAGE),
        lambda: pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3),
        lambda: pk.gather_kv(b.blocks, *b.step, b.layer_idx, 64),
    ):
        with pytest.raises(ValueError, match="^lookup_table: sequence .* null page"):
            call()
        assert torch.equal(b.blocks, before)


def test_the_one_pass_check_agrees_with_the_numpy_check(monkeypatch):
    """cache_ops.h's step_ok never says yes where validate's numpy checks raise, and says yes for the
    tables a window reads within (so the fast path keeps serving sliding-window groups)."""
    assert cpu_kernels.loaded() or cpu_kernels.load()
    monkeypatch.setattr(validate, "_fast_yes", lambda *args: False)  # validate's own checks only
    agreed = 0
    for window, drop_extra, seed in itertools.product([1, 4, 5, 8, 30], [0, 1], range(3)):
        b = make_paged_batch(CACHED, NEW, page_size=PAGE, seed=seed)
        drop_pages(b, window + drop_extra * PAGE, poison=0.0)  # drop_extra: one page too many for some rows
        lengths, table, offsets = b.step
        for reads in (window, -1):
            fast = cpu_kernels.step_ok(b.blocks, lengths, table, offsets, b.q.shape[0], window + 1 if reads > 0 else 1)
            try:
                validate.check_read_data(b.blocks, lengths, table, offsets, b.q.shape[0], sliding_window=reads)
                slow = True
            except ValueError:
                slow = False
            assert fast == slow, (window, drop_extra, seed, reads)
            agreed += slow
    assert agreed >= 10  # both answers occurred
