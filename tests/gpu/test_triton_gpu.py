"""Triton backend on CUDA at real sizes, against the reference backend and an fp64 softmax over
contiguous K/V; plus a decode step under CUDA-graph capture and under torch.compile."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import torch_paged_kv.ops as ops
from torch_paged_kv.ops import reference
from torch_paged_kv.ops.triton import unavailable_reason

CUDA = torch.device("cuda")
if torch.cuda.is_available() and unavailable_reason(CUDA) is not None:
    pytest.skip(unavailable_reason(CUDA), allow_module_level=True)


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("TORCH_PAGED_KV_BACKEND", "triton")


@dataclasses.dataclass
class Step:
    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor

    def args(self, layer: int) -> tuple:
        return self.cache_lengths, self.lookup_table, self.input_row_offsets, layer


def make_step(cached: list[int], new: list[int], page_size: int, *, kv_heads: int = 8, head_dim: int = 128,
              dtype: torch.dtype = torch.bfloat16, slots: bool = False, layers: int = 2, seed: int = 0) -> Step:
    """Random pages behind a shuffled lookup table (1-D, one slot per row, when `slots`)."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    pages_per_seq = [1 if slots else -(-(c + n) // page_size) for c, n in zip(cached, new)]
    width = 1 if slots else -(-(max(pages_per_seq) + 8) // 8) * 8
    num_pages = 1 + sum(pages_per_seq) + 2
    ids = (torch.randperm(num_pages - 1, generator=gen, device=CUDA) + 1).int()
    table = torch.zeros(len(cached), width, dtype=torch.int32, device=CUDA)
    starts = [0] + torch.tensor(pages_per_seq).cumsum(0).tolist()
    for b, count in enumerate(pages_per_seq):
        table[b, :count] = ids[starts[b]:starts[b] + count]
    blocks = torch.randn(num_pages, 2, layers, page_size, kv_heads, head_dim, generator=gen, device=CUDA).to(dtype)
    total = sum(new)
    offsets = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=CUDA)
    return Step(blocks, torch.tensor(cached, dtype=torch.int32, device=CUDA),
                table[:, 0].contiguous() if slots else table, offsets,
                torch.randn(total, kv_heads, head_dim, generator=gen, device=CUDA).to(dtype),
                torch.randn(total, kv_heads, head_dim, generator=gen, device=CUDA).to(dtype))


def math_attention(step: Step, q: torch.Tensor, layer: int, scale: float, causal: bool, window: int,
                   softcap: float) -> torch.Tensor:
    """fp64 attention, one sequence at a time, on K/V made contiguous from its pages."""
    page_size = step.blocks.shape[3]
    table = step.lookup_table.view(step.cache_lengths.shape[0], -1).long()
    offsets = step.input_row_offsets.tolist()
    group = q.shape[1] // step.blocks.shape[4]
    out = torch.zeros(q.shape, dtype=torch.float64, device=CUDA)
    for b, cached in enumerate(step.cache_lengths.tolist()):
        new = offsets[b + 1] - offsets[b]
        if new == 0:
            continue
        kv_len = cached + new
        pages = step.blocks[table[b, :-(-kv_len // page_size)], :, layer]  # [pages, 2, page_size, H, D]
        kv = pages.transpose(0, 1).flatten(1, 2)[:, :kv_len].double().repeat_interleave(group, 2)
        scores = torch.einsum("qhd,khd->hqk", q[offsets[b]:offsets[b + 1]].double(), kv[0]) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(cached, kv_len, device=CUDA)[:, None]
        k_pos = torch.arange(kv_len, device=CUDA)[None]
        allowed = torch.ones(new, kv_len, dtype=torch.bool, device=CUDA)
        if causal:
            allowed &= k_pos <= q_pos
        if window > 0:
            allowed &= q_pos - k_pos < window
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        out[offsets[b]:offsets[b + 1]] = torch.einsum("hqk,khd->qhd", probs, kv[1])
    return out


TOLERANCE = {torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
             torch.float32: {"atol": 2e-5, "rtol": 2e-5}}


# -- store_kv, gather_kv, copy_pages -------------------------------------------------------

@pytest.mark.parametrize("page_size, slots", [(1, False), (16, False), (128, False), (4096, True)])
def test_store_gather_copy_bit_exact(page_size, slots):
    cached, new = [100, 0, 3000, 7] + [64] * 60, [1, 300, 17, 0] + [1] * 60
    step = make_step(cached, new, page_size, slots=slots)
    expected = step.blocks.clone()
    reference.store_kv(step.key, step.value, expected, *step.args(1))
    ops.store_kv(step.key, step.value, step.blocks, *step.args(1))
    assert torch.equal(step.blocks, expected)

    gather_args = (step.blocks, *step.args(1)[:3], 1, 3100)
    for got, want in zip(ops.gather_kv(*gather_args), reference.gather_kv(*gather_args)):
        assert torch.equal(got, want)

    src = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=CUDA)
    dst = torch.tensor([2, 3, 4, 5], dtype=torch.int32, device=CUDA)
    expected = step.blocks.clone()
    reference.copy_pages(expected, src, dst)
    ops.copy_pages(step.blocks, src, dst)
    assert torch.equal(step.blocks, expected)


# -- flash_attention -------------------------------------------------------------------------

CASES = {
    # name: (cached, new, page_size, slots, gqa, kv_heads, head_dim, dtype, causal, window, softcap)
    "decode-b1-32k-page16": ([32767], [1], 16, False, 4, 8, 128, torch.bfloat16, True, -1, 0.0),
    "decode-b64-4k-page1": ([4095 - 37 * i for i in range(64)], [1] * 64, 1, False, 4, 8, 128, torch.bfloat16,
                            True, -1, 0.0),
    "decode-b64-4k-page128": ([4095 - 11 * i for i in range(64)], [1] * 64, 128, False, 4, 8, 128, torch.float16,
                              True, -1, 0.0),
    "decode-window-softcap-d256": ([9000, 17, 4000], [1, 1, 1], 16, False, 2, 4, 256, torch.bfloat16, True, 1024,
                                   30.0),
    "decode-slots-d64": ([2000, 5, 4094, 0], [1, 1, 1, 1], 4096, True, 8, 2, 64, torch.bfloat16, True, -1, 0.0),
    "prefill-ragged-page16-d128": ([0, 0, 0, 0], [300, 1, 129, 512], 16, False, 4, 8, 128, torch.bfloat16, True,
                                   -1, 0.0),
    "prefill-ragged-page128-d256": ([0, 0], [700, 65], 128, False, 1, 4, 256, torch.float16, True, -1, 0.0),
    "chunked-page1-window-d64": ([1000, 37, 0], [256, 100, 64], 1, False, 4, 2, 64, torch.bfloat16, True, 200,
                                 0.0),
    "chunked-noncausal-page16-fp32": ([300, 0], [40, 90], 16, False, 2, 2, 64, torch.float32, False, -1, 0.0),
    "mixed-slots-softcap": ([1500, 0, 700], [1, 333, 64], 2048, True, 4, 2, 128, torch.bfloat16, True, -1, 50.0),
}


@pytest.mark.parametrize("name", CASES)
def test_flash_attention(name):
    cached, new, page_size, slots, gqa, kv_heads, head_dim, dtype, causal, window, softcap = CASES[name]
    step = make_step(cached, new, page_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, slots=slots,
                     layers=1, seed=len(name))
    ops.store_kv(step.key, step.value, step.blocks, *step.args(0))
    gen = torch.Generator(device=CUDA).manual_seed(1)
    q = torch.randn(sum(new), kv_heads * gqa, head_dim, generator=gen, device=CUDA).to(dtype)
    args = (q, step.blocks, *step.args(0), head_dim ** -0.5, causal, window, softcap)
    got = ops.flash_attention(*args)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got, reference.flash_attention(*args), **TOLERANCE[dtype])
    expected = math_attention(step, q, 0, head_dim ** -0.5, causal, window, softcap)
    torch.testing.assert_close(got, expected.to(dtype), **TOLERANCE[dtype])


def test_decode_batch_one_long_context_is_split():
    """Batch 1 x 32k must spread over the GPU (flash-decoding), from shapes alone."""
    from torch_paged_kv.ops.triton import flash_attention as triton_attention
    width = 32768 // 16 + 8
    assert triton_attention.num_splits(1, 8, width * 16, 64, CUDA) >= 16


# -- a decode step under CUDA graphs and torch.compile --------------------------------------------

def decode_step(q, key, value, blocks, cache_lengths, lookup_table, input_row_offsets):
    ops.store_kv(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, 0)
    return ops.flash_attention(q, blocks, cache_lengths, lookup_table, input_row_offsets, 0, 128 ** -0.5)


def fresh_tokens(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return tuple(torch.randn(batch, heads, 128, generator=gen, device=CUDA).to(torch.bfloat16)
                 for heads in (32, 8, 8))


def expected_step(blocks, q, key, value, cache_lengths, lookup_table, input_row_offsets):
    blocks = blocks.clone()
    reference.store_kv(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, 0)
    out = reference.flash_attention(q, blocks, cache_lengths, lookup_table, input_row_offsets, 0, 128 ** -0.5)
    return out, blocks


def test_decode_step_cuda_graph_replay():
    batch = 8
    step = make_step([500 + 300 * i for i in range(batch)], [1] * batch, 16, layers=1)
    q, key, value = fresh_tokens(batch, 0)
    static = (q, key, value, step.blocks, step.cache_lengths, step.lookup_table, step.input_row_offsets)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        decode_step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(*static)
    for seed in (1, 2):
        step.cache_lengths.add_(1)
        for dst, src in zip((q, key, value), fresh_tokens(batch, seed)):
            dst.copy_(src)
        want, want_blocks = expected_step(step.blocks, q, key, value, *step.args(0)[:3])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(step.blocks, want_blocks)
        torch.testing.assert_close(out, want, **TOLERANCE[torch.bfloat16])


def test_decode_step_compiled_reduce_overhead():
    batch = 4
    step = make_step([100, 2000, 7, 1000], [1] * batch, 16, layers=1)
    torch._dynamo.mark_static_address(step.blocks)
    compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    for seed in range(3):
        q, key, value = fresh_tokens(batch, seed)
        want, want_blocks = expected_step(step.blocks, q, key, value, *step.args(0)[:3])
        got = compiled(q, key, value, step.blocks, *step.args(0)[:3]).clone()
        assert torch.equal(step.blocks, want_blocks)
        torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])
        step.cache_lengths.add_(1)
