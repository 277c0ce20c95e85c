"""Triton backend under TRITON_INTERPRET=1 on CPU tensors, against the reference backend and,
for attention, an fp64 softmax over contiguous K/V built token by token from the pages."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU is visible: tests/gpu covers the Triton kernels (TRITON_INTERPRET=1 would put every "
                "Triton kernel in this process in the interpreter)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the mode is fixed per process

import torch_paged_kv.ops as ops
from torch_paged_kv.ops import BackendUnavailableError, reference

pytest.importorskip("triton")
from torch_paged_kv.ops.triton import flash_attention as triton_attention  # noqa: E402
from torch_paged_kv.ops.triton import unavailable_reason  # noqa: E402

if unavailable_reason(torch.device("cpu")) is not None:  # triton was imported earlier, compiled mode
    pytest.skip(unavailable_reason(torch.device("cpu")), allow_module_level=True)


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCH_PAGED_KV_BACKEND", "triton")


@dataclasses.dataclass
class Step:
    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


def make_step(cached: list[int], new: list[int], page_size: int, *, kv_heads: int = 2, head_dim: int = 16,
              dtype: torch.dtype = torch.float32, slots: bool = False, layers: int = 2, seed: int = 0) -> Step:
    """Random pages (never zeros) behind a shuffled lookup table; `slots` makes a 1-D table."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [1 if slots else -(-(c + n) // page_size) for c, n in zip(cached, new)]
    width = 1 if slots else max(pages_per_seq) + 3
    num_pages = 1 + sum(pages_per_seq) + 2  # null page 0 and two spare pages
    ids = (torch.randperm(num_pages - 1, generator=gen) + 1).int()
    table = torch.zeros(len(cached), width, dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = ids[used:used + count]
        used += count
    shape = (num_pages, 2, layers, page_size, kv_heads, head_dim)
    blocks = torch.randn(shape, generator=gen).to(dtype)
    total = sum(new)
    return Step(
        blocks=blocks,
        cache_lengths=torch.tensor(cached, dtype=torch.int32),
        lookup_table=table[:, 0].contiguous() if slots else table,
        input_row_offsets=torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32),
        key=torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype),
        value=torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype),
    )


def contiguous_kv(step: Step, layer: int, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of sequence b, token by token from its pages, as fp64 `[length, kv_heads, head_dim]`."""
    page_size = step.blocks.shape[3]
    table = step.lookup_table.view(step.cache_lengths.shape[0], -1)
    rows = [step.blocks[int(table[b, pos // page_size]), :, layer, pos % page_size] for pos in range(length)]
    kv = torch.stack(rows).double()
    return kv[:, 0], kv[:, 1]


def math_attention(step: Step, q: torch.Tensor, layer: int, scale: float, causal: bool, window: int,
                   softcap: float) -> torch.Tensor:
    """Attention in fp64, one sequence at a time, straight from the contract's mask definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    offsets = step.input_row_offsets.tolist()
    group = q.shape[1] // step.blocks.shape[4]
    for b, cached in enumerate(step.cache_lengths.tolist()):
        rows = slice(offsets[b], offsets[b + 1])
        new = offsets[b + 1] - offsets[b]
        if new == 0:
            continue
        key, value = contiguous_kv(step, layer, b, cached + new)
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), key) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(cached, cached + new)[:, None]
        k_pos = torch.arange(cached + new)[None]
        allowed = torch.ones(new, cached + new, dtype=torch.bool)
        if causal:
            allowed &= k_pos <= q_pos
        if window > 0:
            allowed &= q_pos - k_pos < window
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, value)
    return out


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1.6e-2}


# -- store_kv, gather_kv, copy_pages ------------------------------------------------------------

@pytest.mark.parametrize("page_size, slots, dtype", [
    (1, False, torch.float32), (3, False, torch.bfloat16), (16, False, torch.float16), (40, True, torch.bfloat16),
])
def test_store_kv_writes_exactly_the_reference_slots(page_size, slots, dtype):
    step = make_step([5, 0, 17, 2], [3, 4, 1, 0], page_size, dtype=dtype, slots=slots)
    args = (step.cache_lengths, step.lookup_table, step.input_row_offsets, 1)
    expected = step.blocks.clone()
    reference.store_kv(step.key, step.value, expected, *args)
    ops.store_kv(step.key, step.value, step.blocks, *args)
    assert torch.equal(step.blocks, expected)


def test_store_kv_skips_out_of_range_pages_when_checks_are_off(monkeypatch):
    monkeypatch.setenv("TORCH_PAGED_KV_VALIDATE", "shapes")
    step = make_step([2, 6], [3, 2], 3)
    before = step.blocks.clone()
    bad_table = step.lookup_table.clone()
    bad_table[0] = torch.tensor([-1, step.blocks.shape[0], 10**6], dtype=torch.int32).repeat(3)[:bad_table.shape[1]]
    ops.store_kv(step.key, step.value, step.blocks, step.cache_lengths, bad_table, step.input_row_offsets, 0)
    # Only sequence 1 is written: the same as storing it alone.
    reference.store_kv(step.key[3:], step.value[3:], before, step.cache_lengths[1:], step.lookup_table[1:],
                       step.input_row_offsets[1:] - 3, 0)
    assert torch.equal(step.blocks, before)


@pytest.mark.parametrize("page_size, slots", [(3, False), (16, False), (40, True)])
def test_gather_kv_matches_reference(page_size, slots):
    step = make_step([5, 0, 17], [3, 4, 1], page_size, dtype=torch.bfloat16, slots=slots)
    args = (step.blocks, step.cache_lengths, step.lookup_table, step.input_row_offsets, 1, 23)
    for got, want in zip(ops.gather_kv(*args), reference.gather_kv(*args)):
        assert torch.equal(got, want)
        assert got[:, 18:].abs().sum() == 0 and got[0, 7].abs().sum() > 0


@pytest.mark.parametrize("src, dst", [([1, 2, 3], [2, 3, 4]), ([1, 2, 3], [3, 1, 2]), ([4, 4], [1, 5])])
def test_copy_pages_reads_every_source_first(src, dst):
    blocks = make_step([5, 9], [0, 0], 3).blocks
    original, expected = blocks.clone(), blocks.clone()
    reference.copy_pages(expected, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
    ops.copy_pages(blocks, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
    assert torch.equal(blocks, expected)
    for s, d in zip(src, dst):
        assert torch.equal(blocks[d], original[s])


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


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_flash_attention_matches_reference_and_fp64(name):
    cached, new, page_size, slots, gqa, head_dim, dtype, causal, window, softcap = ATTENTION_CASES[name]
    step = make_step(cached, new, page_size, head_dim=head_dim, dtype=dtype, slots=slots, seed=len(name))
    reference.store_kv(step.key, step.value, step.blocks, step.cache_lengths, step.lookup_table,
                       step.input_row_offsets, 1)
    q = torch.randn(sum(new), 2 * gqa, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (q, step.blocks, step.cache_lengths, step.lookup_table, step.input_row_offsets, 1,
            head_dim ** -0.5, causal, window, softcap)
    got = ops.flash_attention(*args)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, reference.flash_attention(*args), **tolerances(dtype))
    expected = math_attention(step, q, 1, head_dim ** -0.5, causal, window, softcap)
    torch.testing.assert_close(got, expected.to(dtype), **tolerances(dtype))


@pytest.mark.parametrize("window, softcap, dtype", [(-1, 0.0, torch.float32), (21, 4.0, torch.bfloat16)])
def test_split_kv_decode_matches_fp64(monkeypatch, window, softcap, dtype):
    monkeypatch.setattr(triton_attention, "MIN_SPLIT_TOKENS", 16)
    step = make_step([70, 5, 33], [1, 1, 1], 8, kv_heads=1, head_dim=16, dtype=dtype, seed=3)
    reference.store_kv(step.key, step.value, step.blocks, step.cache_lengths, step.lookup_table,
                       step.input_row_offsets, 0)
    assert triton_attention.num_splits(3, 1, step.lookup_table.shape[1] * 8, 16, torch.device("cpu")) > 1
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = (q, step.blocks, step.cache_lengths, step.lookup_table, step.input_row_offsets, 0, 0.3, True,
            window, softcap)
    got = ops.flash_attention(*args)
    torch.testing.assert_close(got, reference.flash_attention(*args), **tolerances(dtype))
    expected = math_attention(step, q, 0, 0.3, True, window, softcap)
    torch.testing.assert_close(got, expected.to(dtype), **tolerances(dtype))


# -- dispatch ----------------------------------------------------------------------------------

def test_forced_triton_explains_why_it_cannot_run(monkeypatch):
    step = make_step([2], [1], 4, head_dim=24)
    q = torch.randn(1, 2, 24)
    with pytest.raises(BackendUnavailableError, match="does not cover"):
        ops.flash_attention(q, step.blocks, step.cache_lengths, step.lookup_table, step.input_row_offsets, 0, 0.2)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        ops.gather_kv(step.blocks, step.cache_lengths, step.lookup_table, step.input_row_offsets, 0, 3)
