"""Triton backend under TRITON_INTERPRET=1 on CPU tensors, against the reference backend and,
for attention, the fp64 oracle on contiguous K/V (`torch_paged_kv.testing`)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "a GPU is visible: tests/gpu covers the Triton kernels (TRITON_INTERPRET=1 would put every "
        "Triton kernel in this process in the interpreter)",
        allow_module_level=True,
    )

import torch_paged_kv.ops as ops
from torch_paged_kv import NULL_PAGE
from torch_paged_kv.ops import BackendUnavailableError, reference
from torch_paged_kv.ops import splits as split_rule
from torch_paged_kv.ops.records import CopyPagesArgs, FlashAttentionArgs, GatherKVArgs, StoreKVArgs
from torch_paged_kv.ops.triton import flash_attention as triton_attention
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import ATTENTION_TOLERANCE, PagedBatch, attention_fp64, make_fp8_batch, make_paged_batch

# Without a GPU these are the only Triton tests that run: if the interpreter cannot run, fail.
# (tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.)
if unavailable_reason(torch.device("cpu")) is not None:
    pytest.fail(
        f"Triton kernels cannot run on CPU tensors here: {unavailable_reason(torch.device('cpu'))}", pytrace=False
    )


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


# -- store_kv, gather_kv, copy_pages ------------------------------------------------------------


@pytest.mark.parametrize(
    "page_size, slots, dtype",
    [
        (1, False, torch.float32),
        (3, False, torch.bfloat16),
        (16, False, torch.float16),
        (40, True, torch.bfloat16),
    ],
)
def test_store_kv_writes_exactly_the_reference_slots(page_size, slots, dtype):
    batch = make_paged_batch(
        [5, 0, 17, 2], [3, 4, 1, 0], page_size=page_size, head_dim=16, dtype=dtype, continuous=slots
    )
    args = (*batch.step, batch.layer_idx)
    expected = batch.blocks.clone()
    reference.store_kv(batch.new_keys, batch.new_values, expected, *args)
    ops.store_kv(batch.new_keys, batch.new_values, batch.blocks, *args)
    assert torch.equal(batch.blocks, expected)


def test_store_kv_skips_out_of_range_and_null_pages_when_checks_are_off(monkeypatch):
    monkeypatch.setenv("TORCH_PAGED_KV_VALIDATE", "shapes")
    batch = make_paged_batch([2, 6], [5, 2], page_size=3, head_dim=16, layer_idx=0)
    key, value = batch.new_keys, batch.new_values
    before = batch.blocks.clone()
    bad_table = batch.lookup_table.clone()
    bad_table[0, :3] = torch.tensor([-1, batch.blocks.shape[0], NULL_PAGE])  # tokens 2..6 of sequence 0
    ops.store_kv(key, value, batch.blocks, batch.cache_lengths, bad_table, batch.input_row_offsets, 0)
    # Only sequence 1 is written: the same as storing it alone.
    reference.store_kv(
        key[5:], value[5:], before, batch.cache_lengths[1:], batch.lookup_table[1:], batch.input_row_offsets[1:] - 5, 0
    )
    assert torch.equal(batch.blocks, before)


def test_copy_pages_never_writes_the_null_page_or_outside_when_checks_are_off():
    batch = make_paged_batch([4], [1], page_size=4, head_dim=16, layer_idx=0)
    before = batch.blocks.clone()
    src = torch.tensor([1, 2], dtype=torch.int32)
    ops.copy_pages_unchecked(batch.blocks, src, torch.tensor([NULL_PAGE, batch.blocks.shape[0]], dtype=torch.int32))
    assert torch.equal(batch.blocks, before)


@pytest.mark.parametrize("page_size, slots", [(3, False), (16, False), (40, True)])
def test_gather_kv_matches_reference(page_size, slots):
    batch = make_paged_batch(
        [5, 0, 17], [3, 4, 1], page_size=page_size, head_dim=16, dtype=torch.bfloat16, continuous=slots
    )
    args = (batch.blocks, *batch.step, 1, 23)
    for got, want in zip(ops.gather_kv(*args), reference.gather_kv(*args), strict=True):
        assert torch.equal(got, want)
        assert got[:, 18:].abs().sum() == 0 and got[0, 7].abs().sum() > 0


@pytest.mark.parametrize("src, dst", [([1, 2, 3], [2, 3, 4]), ([1, 2, 3], [3, 1, 2]), ([4, 4], [1, 5])])
def test_copy_pages_reads_every_source_first(src, dst):
    blocks = make_paged_batch([5, 9], [0, 0], page_size=3, head_dim=16).blocks
    original, expected = blocks.clone(), blocks.clone()
    reference.copy_pages(expected, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
    ops.copy_pages(blocks, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
    assert torch.equal(blocks, expected)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(blocks[d], original[s])


@pytest.mark.parametrize("op", ["gather_kv", "copy_pages"])
def test_programs_loop_over_what_grid_y_cannot_hold(monkeypatch, op):
    """Sequences (gather_kv) and pages (copy_pages) past grid y's 65,535 are taken by the programs
    in a grid-stride loop; here grid y is capped at 2 so that every program loops."""
    from torch_paged_kv.ops.triton import copy_pages, gather_kv

    monkeypatch.setattr(gather_kv if op == "gather_kv" else copy_pages, "MAX_GRID", (2**31 - 1, 2, 65535))
    batch = make_paged_batch([5, 0, 17, 2, 9], [3, 4, 1, 1, 2], page_size=4, head_dim=16, seed=11)
    if op == "gather_kv":
        args = (batch.blocks, *batch.step, 1, 19)
        _, _, launches = gather_kv.plan_gather_kv(GatherKVArgs(*args))
        assert launches[0].grid[1] == 2
        for got, want in zip(ops.gather_kv(*args), reference.gather_kv(*args), strict=True):
            assert torch.equal(got, want)
        return
    src, dst = (torch.tensor(pages, dtype=torch.int32) for pages in ([1, 2, 3, 4, 5], [6, 7, 8, 9, 2]))
    assert copy_pages.plan_copy_pages(CopyPagesArgs(batch.blocks, src, dst))[0].grid[1] == 2
    expected = batch.blocks.clone()
    reference.copy_pages(expected, src, dst)
    ops.copy_pages(batch.blocks, src, dst)
    assert torch.equal(batch.blocks, expected)


# -- int64 offsets ---------------------------------------------------------------------------------

SLOT = 2**26 + 2  # tokens in a slot whose last token sits 2**31 + 32 elements into it (token stride 32)
WIDE_POOLS = {
    # name: (shape, strides, layer_idx, position of the first of the 4 tokens used)
    # layer 3 starts at 3 * ceil(2**32 / 3) = 2**32 + 2 elements: an i32 `layer_idx * stride_layer`
    # (the stride is below 2**31, so Triton passes it as i32) wraps to 2, into page 0.
    "layer": ((2, 2, 4, 4, 1, 16), (128, 64, -(-(2**32) // 3), 16, 16, 1), 3, 0),
    # one layer of slots of 2**26 + 2 tokens, K and V interleaved per token: an i32
    # `(pos % page_size) * stride_token` wraps for the last tokens, into page 0.
    "token": ((2, 2, 1, SLOT, 1, 16), (SLOT * 32, 16, SLOT * 32, 32, 16, 1), 0, SLOT - 4),
}


def make_wide_pool(name: str, tmp_path) -> tuple[torch.Tensor, int, int]:
    """(blocks, layer_idx, first position) of `WIDE_POOLS[name]`: float16 blocks whose sequence in page 1 lies more than
    2**31 elements into the page, where an int32 offset wraps into page 0.

    Such a pool would take 8 GB; here the view's storage is a sparse file (`torch.from_file(shared=True)`):
    address space only, and only the few pages the kernels touch take memory or disk. The kernels take
    `blocks`' strides, so they address it as they would a continuous-batching pool whose page spans
    gigabytes; the ops' validation wants a contiguous pool, so the tests call the Triton kernels."""
    shape, strides, layer, first = WIDE_POOLS[name]
    numel = 1 + sum(stride * (size - 1) for stride, size in zip(strides, shape, strict=True))
    storage = torch.from_file(str(tmp_path / "pool.bin"), shared=True, size=numel, dtype=torch.float16)
    return storage.as_strided(shape, strides), layer, first


@pytest.fixture(params=list(WIDE_POOLS))
def wide_pool(request, tmp_path) -> tuple[torch.Tensor, int, int]:
    return make_wide_pool(request.param, tmp_path)


def _one_sequence(first: int, new: int) -> tuple[torch.Tensor, ...]:
    """cache_lengths, lookup_table (page 1), input_row_offsets of one sequence whose step ends at first + 4."""
    return (
        torch.tensor([first + 4 - new], dtype=torch.int32),
        torch.full((1, 8), 1, dtype=torch.int32),
        torch.tensor([0, new], dtype=torch.int32),
    )


def test_offsets_past_int32_store_kv(wide_pool):
    """With an i32 layer or in-page offset the keys land in page 0 instead."""
    from torch_paged_kv.ops.triton.store_kv import store_kv

    blocks, layer, first = wide_pool
    key, value = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    store_kv(StoreKVArgs(key, value, blocks, *_one_sequence(first, 4), layer))
    assert torch.equal(blocks[1, 0, layer, first:], key) and torch.equal(blocks[1, 1, layer, first:], value)
    assert not blocks[:, :, :layer].any() and not blocks[0, :, :, :4].any()  # where the wrapped offsets point


def test_offsets_past_int32_flash_attention(wide_pool):
    """With an i32 layer or in-page offset the kernel reads page 0 (zeros) instead. The sliding
    window keeps the interpreter to the last key tile of the 2**26-token slot."""
    from torch_paged_kv.ops.triton.flash_attention import flash_attention, wide_page

    blocks, layer, first = wide_pool
    assert wide_page(blocks) == (first > 0)  # in-page offsets past int32 take the kernel's int64 variant
    generator = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 4, 1, 16, generator=generator).to(torch.float16)
    blocks[1, 0, layer, first:], blocks[1, 1, layer, first:] = key, value
    q = torch.randn(1, 4, 16, generator=generator).to(torch.float16)  # decode: the 4th token is new
    out = flash_attention(FlashAttentionArgs(q, blocks, *_one_sequence(first, 1), layer, 0.25, True, 4))
    expected = attention_fp64(q, [key], [value], [3], 0.25)
    torch.testing.assert_close(out, expected.to(out.dtype), **ATTENTION_TOLERANCE[out.dtype])


def test_offsets_past_int32_gather_kv(tmp_path):
    """With an i32 layer offset the kernel reads layer 0 (zeros) instead. (The in-page case would
    gather all 2**26 tokens, too many for the interpreter; the kernel widens it the same way.)"""
    from torch_paged_kv.ops.triton.gather_kv import gather_kv

    blocks, layer, _ = make_wide_pool("layer", tmp_path)
    key, value = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    blocks[1, 0, layer], blocks[1, 1, layer] = key, value
    got_key, got_value = gather_kv(GatherKVArgs(blocks, *_one_sequence(0, 4), layer, 4))
    assert torch.equal(got_key[0], key) and torch.equal(got_value[0], value)


# -- flash_attention -------------------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (cached, new, page_size, slots, gqa, head_dim, dtype, causal, window, softcap)
    "prefill-page1-gqa4": ([0, 0, 0], [5, 1, 9], 1, False, 4, 16, torch.float32, True, -1, 0.0),
    "chunked-page3-window": ([7, 0, 12], [6, 3, 5], 3, False, 1, 32, torch.bfloat16, True, 4, 0.0),
    "chunked-page16-softcap": ([20, 33], [17, 2], 16, False, 4, 16, torch.float32, True, -1, 5.0),
    "noncausal-page3-window": ([4, 0], [5, 7], 3, False, 4, 16, torch.float32, False, 3, 0.0),
    "slots-mixed": ([10, 0, 31], [1, 6, 1], 40, True, 4, 32, torch.bfloat16, True, -1, 8.0),
    "decode-page16-gqa1": ([45, 3, 60, 0], [1, 1, 1, 1], 16, False, 1, 16, torch.float16, True, -1, 0.0),
}


def check_attention(batch: PagedBatch, scale: float, causal: bool, window: int, softcap: float) -> None:
    """Store the step's K/V, then attend: against the reference backend and the fp64 oracle."""
    reference.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    args = (batch.q, batch.blocks, *batch.step, batch.layer_idx, scale, causal, window, softcap)
    got = ops.flash_attention(*args)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    torch.testing.assert_close(got, reference.flash_attention(*args), **ATTENTION_TOLERANCE[got.dtype])
    expected = attention_fp64(
        batch.q, batch.keys, batch.values, batch.cache_lengths.tolist(), scale, causal, window, softcap
    )
    torch.testing.assert_close(got, expected.to(got.dtype), **ATTENTION_TOLERANCE[got.dtype])


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_flash_attention_matches_reference_and_fp64(name):
    cached, new, page_size, slots, gqa, head_dim, dtype, causal, window, softcap = ATTENTION_CASES[name]
    batch = make_paged_batch(
        cached, new, page_size=page_size, head_dim=head_dim, group=gqa, dtype=dtype, continuous=slots, seed=len(name)
    )
    check_attention(batch, head_dim**-0.5, causal, window, softcap)


@pytest.mark.parametrize("window, softcap, dtype", [(-1, 0.0, torch.float32), (21, 4.0, torch.bfloat16)])
def test_split_kv_decode_matches_fp64(monkeypatch, window, softcap, dtype):
    monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)
    batch = make_paged_batch(
        [70, 5, 33], [1, 1, 1], page_size=8, num_kv_heads=1, head_dim=16, group=4, layer_idx=0, dtype=dtype, seed=3
    )
    args = FlashAttentionArgs(batch.q, batch.blocks, *batch.step, 0, 0.3, True, window, softcap)
    launches = triton_attention.plan_flash_attention(args)[1]
    assert len(launches) == 2 and launches[0].grid[2] > 1  # split attention, then the merge
    check_attention(batch, 0.3, True, window, softcap)


# -- dispatch ----------------------------------------------------------------------------------


def test_forced_triton_explains_why_it_cannot_run(monkeypatch):
    batch = make_paged_batch([2], [1], page_size=4, head_dim=24, layer_idx=0)
    with pytest.raises(BackendUnavailableError, match="does not cover"):
        ops.flash_attention(batch.q, batch.blocks, *batch.step, 0, 0.2)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        ops.gather_kv(batch.blocks, *batch.step, 0, 3)


# -- FP8 caches ---------------------------------------------------------------------------------

FP8_CASES = [
    (torch.float8_e4m3fn, 32, False),
    (torch.float8_e4m3fn, 8, True),
    (torch.float8_e5m2, 16, False),
    (torch.float8_e5m2, None, False),  # a static pair of scales
]


@pytest.mark.parametrize("dtype, granularity, continuous", FP8_CASES)
def test_fp8_store_and_gather_match_the_reference_bit_for_bit(force_backend, dtype, granularity, continuous):
    """Quantized values and scales (IEEE division, round to nearest even: the reference's rule) and
    dequantized reads, bit for bit; every unused slot of the pool keeps its random bytes."""
    results = []
    for backend in ("reference", "triton"):
        force_backend(backend)
        b, new_keys, new_values = make_fp8_batch(
            [0, 21, 40, 7], [9, 5, 1, 1], dtype=dtype, granularity=granularity, continuous=continuous,
            page_size=64 if continuous else 8,
        )  # fmt: skip
        ops.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, b.scales)
        # float32 out: Triton's interpreter rounds to bf16 by truncation (see docs/design.md), a GPU does not
        gathered = ops.gather_kv(b.blocks, *b.step, b.layer_idx, 45, b.scales, torch.float32)
        results.append((b.blocks.view(torch.uint8), b.scales, *gathered))
    for ref, got in zip(*results, strict=True):
        assert torch.equal(ref, got)


@pytest.mark.parametrize("hardware", [False, True], ids=["integer-decode", "hardware-cvt"])
@pytest.mark.parametrize("dtype, granularity, continuous", FP8_CASES)
def test_fp8_attention_matches_fp64(dtype, granularity, continuous, hardware, monkeypatch):
    """Ragged prefill / chunked prefill / decode rows over FP8 pages against fp64 attention on the
    dequantized K/V (what the cache holds), causal and windowed. Both read paths: the integer decode
    (sm_80, the interpreter) and the FP8 -> fp16 conversion of sm_89+ (`hardware_fp8`), which the
    interpreter emulates exactly for finite codes (these pages hold no NaN)."""
    monkeypatch.setattr(triton_attention, "hardware_fp8", lambda device: hardware)
    b, new_keys, new_values = make_fp8_batch(
        [0, 21, 40, 7], [9, 5, 1, 1], dtype=dtype, granularity=granularity, continuous=continuous,
        page_size=64 if continuous else 8, seed=3,
    )  # fmt: skip
    ops.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, b.scales)
    launch = triton_attention.plan_flash_attention(FlashAttentionArgs(b.q, b.blocks, *b.step, b.layer_idx, 0.3,
                                                                      scales=b.scales))[1][0]  # fmt: skip
    assert launch.kwargs["HW_FP8"] is hardware
    for window in (-1, 6):
        out = ops.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, True, window, 0.0, b.scales)
        want = attention_fp64(b.q, b.keys, b.values, [0, 21, 40, 7], 0.3, True, window)
        torch.testing.assert_close(out.double(), want, **ATTENTION_TOLERANCE[out.dtype])


def test_fp8_split_decode_and_copy_pages_move_scales(monkeypatch):

    monkeypatch.setattr(split_rule, "sm_count", lambda device: 16)  # force several splits
    b, new_keys, new_values = make_fp8_batch([300, 97], [1, 1], granularity=16, page_size=16, seed=4)
    args = FlashAttentionArgs(b.q, b.blocks, *b.step, b.layer_idx, 0.3, scales=b.scales)
    _, launches = triton_attention.plan_flash_attention(args)
    assert len(launches) == 2  # split attention, then the merge
    ops.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, b.scales)
    out = ops.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, scales=b.scales)
    torch.testing.assert_close(out.double(), attention_fp64(b.q, b.keys, b.values, [300, 97], 0.3),
                               **ATTENTION_TOLERANCE[out.dtype])  # fmt: skip
    src, dst = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([3, 1, 4], dtype=torch.int32)
    blocks, scales = b.blocks.view(torch.uint8).clone(), b.scales.clone()
    ops.copy_pages(b.blocks, src, dst, b.scales)
    assert torch.equal(b.blocks.view(torch.uint8)[[3, 1, 4]], blocks[[1, 2, 3]]) and torch.equal(
        b.scales[[3, 1, 4]], scales[[1, 2, 3]]
    )
    assert torch.equal(b.blocks.view(torch.uint8)[2], blocks[2]) and torch.equal(b.scales[2], scales[2])
