"""Triton backend on CUDA at real sizes, against the reference backend and the fp64 oracle on
contiguous K/V (`torch_paged_kv.testing`); plus a decode step under CUDA-graph capture and under
torch.compile."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import torch_paged_kv.ops as ops
from torch_paged_kv.ops import reference
from torch_paged_kv.ops.records import FlashAttentionArgs
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.ops.triton.fp8 import FORMATS, fp8_bits_to_operand, hardware_fp8
from torch_paged_kv.testing import ATTENTION_TOLERANCE as TOLERANCE
from torch_paged_kv.testing import (
    PagedBatch,
    assert_attention_within_rounding,
    attention_fp64_and_spread,
    make_fp8_batch,
    make_paged_batch,
)

CUDA = torch.device("cuda")
if torch.cuda.is_available() and unavailable_reason(CUDA) is not None:
    pytest.skip(unavailable_reason(CUDA), allow_module_level=True)


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


def make_batch(
    cached: list[int],
    new: list[int],
    page_size: int,
    *,
    kv_heads: int = 8,
    head_dim: int = 128,
    group: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    slots: bool = False,
    layers: int = 2,
    seed: int = 0,
) -> PagedBatch:
    """`make_paged_batch` on CUDA at this file's sizes, in the last layer (1-D slot table when `slots`)."""
    return make_paged_batch(
        cached,
        new,
        page_size=page_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        group=group,
        num_layers=layers,
        layer_idx=layers - 1,
        dtype=dtype,
        device=CUDA,
        continuous=slots,
        seed=seed,
    )


# -- store_kv, gather_kv, copy_pages -------------------------------------------------------


@pytest.mark.parametrize("page_size, slots", [(1, False), (16, False), (128, False), (4096, True)])
def test_store_gather_copy_bit_exact(page_size, slots):
    cached, new = [100, 0, 3000, 7] + [64] * 60, [1, 300, 17, 0] + [1] * 60
    batch = make_batch(cached, new, page_size, slots=slots)
    args = (*batch.step, batch.layer_idx)
    expected = batch.blocks.clone()
    reference.store_kv(batch.new_keys, batch.new_values, expected, *args)
    ops.store_kv(batch.new_keys, batch.new_values, batch.blocks, *args)
    assert torch.equal(batch.blocks, expected)

    gather_args = (batch.blocks, *args, 3100)
    for got, want in zip(ops.gather_kv(*gather_args), reference.gather_kv(*gather_args), strict=True):
        assert torch.equal(got, want)

    src = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=CUDA)
    dst = torch.tensor([2, 3, 4, 5], dtype=torch.int32, device=CUDA)
    expected = batch.blocks.clone()
    reference.copy_pages(expected, src, dst)
    ops.copy_pages(batch.blocks, src, dst)
    assert torch.equal(batch.blocks, expected)


def test_one_sequence_continuous_batching_pool_of_65536_slots():
    """Issue 14 at full size: a continuous-batching pool of 65,536-token slots x 33 layers x 8 x 128
    (bf16: 8.9 GB per slot, 3 slots with the null one, plus a slot of copy scratch). Layer 32 starts
    2**31 elements into its slot, where an int32 `layer_idx * stride_layer` wrapped (store_kv wrote
    into layer 0); a slot is 4.4e9 elements, 4.3 million copy_pages chunks, which were on grid y
    (limit 65,535). One sequence decodes its last token at layer 32."""
    import torch_paged_kv as pk

    slot, layers, layer = 65536, 33, 32
    if torch.cuda.mem_get_info()[0] < 48 * 2**30:
        pytest.skip("needs 48 GB of free GPU memory")
    params = pk.KVCacheParams(torch.bfloat16, num_layers=layers, num_kv_heads=8, head_dim=128, page_size=slot)
    pool = pk.ContinuousBatchingKVCacheCollection(params, max_batch_size=2, max_seq_len=slot, device=CUDA)
    blocks = pool.blocks
    assert layer * blocks.stride(2) >= 2**31 and blocks[0].numel() // 1024 > 65535
    gen = torch.Generator(device=CUDA).manual_seed(14)
    blocks[1, :, layer] = torch.randn(2, slot, 8, 128, generator=gen, device=CUDA).to(torch.bfloat16)
    blocks[1, :, layer, -1] = 0  # the new token's slot
    q, key, value = (torch.randn(1, h, 128, generator=gen, device=CUDA).to(torch.bfloat16) for h in (32, 8, 8))
    cache_lengths = torch.tensor([slot - 1], dtype=torch.int32, device=CUDA)
    table = pool.lookup_table[:1]  # slot 1
    offsets = torch.tensor([0, 1], dtype=torch.int32, device=CUDA)
    step = (cache_lengths, table, offsets, layer)

    ops.store_kv(key, value, blocks, *step)
    assert torch.equal(blocks[1, 0, layer, -1], key[0]) and torch.equal(blocks[1, 1, layer, -1], value[0])
    assert not blocks[1, :, :layer].any() and not blocks[2].any()

    args = (q, blocks, *step, 128**-0.5)
    torch.testing.assert_close(ops.flash_attention(*args), reference.flash_attention(*args), **TOLERANCE[q.dtype])
    for got, want in zip(ops.gather_kv(blocks, *step, slot), reference.gather_kv(blocks, *step, slot), strict=True):
        assert torch.equal(got, want)

    pages = (torch.tensor([page], dtype=torch.int32, device=CUDA) for page in (1, 2))
    ops.copy_pages(blocks, *pages)
    assert torch.equal(blocks[2, :, layer], blocks[1, :, layer]) and not blocks[2, :, :layer].any()


# -- flash_attention -------------------------------------------------------------------------

CASES = {
    # name: (cached, new, page_size, slots, gqa, kv_heads, head_dim, dtype, causal, window, softcap)
    "decode-b1-32k-page16": ([32767], [1], 16, False, 4, 8, 128, torch.bfloat16, True, -1, 0.0),
    "decode-b64-4k-page1": (
        [4095 - 37 * i for i in range(64)],
        [1] * 64,
        1,
        False,
        4,
        8,
        128,
        torch.bfloat16,
        True,
        -1,
        0.0,
    ),
    "decode-b64-4k-page128": (
        [4095 - 11 * i for i in range(64)],
        [1] * 64,
        128,
        False,
        4,
        8,
        128,
        torch.float16,
        True,
        -1,
        0.0,
    ),
    "decode-window-softcap-d256": ([9000, 17, 4000], [1, 1, 1], 16, False, 2, 4, 256, torch.bfloat16, True, 1024, 30.0),
    "decode-slots-d64": ([2000, 5, 4094, 0], [1, 1, 1, 1], 4096, True, 8, 2, 64, torch.bfloat16, True, -1, 0.0),
    "prefill-ragged-page16-d128": (
        [0, 0, 0, 0],
        [300, 1, 129, 512],
        16,
        False,
        4,
        8,
        128,
        torch.bfloat16,
        True,
        -1,
        0.0,
    ),
    "prefill-ragged-page128-d256": ([0, 0], [700, 65], 128, False, 1, 4, 256, torch.float16, True, -1, 0.0),
    "chunked-page1-window-d64": ([1000, 37, 0], [256, 100, 64], 1, False, 4, 2, 64, torch.bfloat16, True, 200, 0.0),
    "chunked-noncausal-page16-fp32": ([300, 0], [40, 90], 16, False, 2, 2, 64, torch.float32, False, -1, 0.0),
    "mixed-slots-softcap": ([1500, 0, 700], [1, 333, 64], 2048, True, 4, 2, 128, torch.bfloat16, True, -1, 50.0),
}


@pytest.mark.parametrize("name", CASES)
def test_flash_attention(name):
    cached, new, page_size, slots, gqa, kv_heads, head_dim, dtype, causal, window, softcap = CASES[name]
    batch = make_batch(
        cached,
        new,
        page_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        group=gqa,
        dtype=dtype,
        slots=slots,
        layers=1,
        seed=len(name),
    )
    ops.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    args = (batch.q, batch.blocks, *batch.step, batch.layer_idx, head_dim**-0.5, causal, window, softcap)
    got = ops.flash_attention(*args)
    assert got.shape == batch.q.shape and got.dtype == dtype
    exact, spread = attention_fp64_and_spread(
        batch.q, batch.keys, batch.values, cached, head_dim**-0.5, causal=causal, sliding_window=window, softcap=softcap
    )
    assert_attention_within_rounding(got, exact, spread)
    assert_attention_within_rounding(got, reference.flash_attention(*args).double(), spread)


def test_decode_batch_one_long_context_is_split():
    """Batch 1 x 32k must spread over the GPU (flash-decoding), from shapes alone: the plan launches."""
    from torch_paged_kv.ops.triton import flash_attention as triton_attention

    batch = make_batch([32767], [1], 16, layers=1)
    launches = triton_attention.plan_flash_attention(FlashAttentionArgs(batch.q, batch.blocks, *batch.step, 0, 0.1))[1]
    assert len(launches) == 2 and launches[0].grid[2] >= 16  # split attention, then the merge


# -- a decode step under CUDA graphs and torch.compile --------------------------------------------


def decode_step(q, key, value, blocks, cache_lengths, lookup_table, input_row_offsets):
    ops.store_kv(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, 0)
    return ops.flash_attention(q, blocks, cache_lengths, lookup_table, input_row_offsets, 0, 128**-0.5)


def fresh_tokens(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return tuple(torch.randn(batch, heads, 128, generator=gen, device=CUDA).to(torch.bfloat16) for heads in (32, 8, 8))


def expected_step(blocks, q, key, value, cache_lengths, lookup_table, input_row_offsets):
    blocks = blocks.clone()
    reference.store_kv(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, 0)
    out = reference.flash_attention(q, blocks, cache_lengths, lookup_table, input_row_offsets, 0, 128**-0.5)
    return out, blocks


def test_decode_step_cuda_graph_replay():
    rows = 8
    batch = make_batch([500 + 300 * i for i in range(rows)], [1] * rows, 16, layers=1)
    q, key, value = fresh_tokens(rows, 0)
    static = (q, key, value, batch.blocks, *batch.step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        decode_step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(*static)
    for seed in (1, 2):
        batch.cache_lengths.add_(1)
        for dst, src in zip((q, key, value), fresh_tokens(rows, seed), strict=True):
            dst.copy_(src)
        want, want_blocks = expected_step(batch.blocks, q, key, value, *batch.step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(batch.blocks, want_blocks)
        torch.testing.assert_close(out, want, **TOLERANCE[torch.bfloat16])


def test_decode_step_compiled_reduce_overhead():
    rows = 4
    batch = make_batch([100, 2000, 7, 1000], [1] * rows, 16, layers=1)
    torch._dynamo.mark_static_address(batch.blocks)
    compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    for seed in range(3):
        q, key, value = fresh_tokens(rows, seed)
        want, want_blocks = expected_step(batch.blocks, q, key, value, *batch.step)
        got = compiled(q, key, value, batch.blocks, *batch.step).clone()
        assert torch.equal(batch.blocks, want_blocks)
        torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])
        batch.cache_lengths.add_(1)


@triton.jit
def _operand_kernel(src, dst, MANT: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(dst + i, fp8_bits_to_operand(tl.load(src + i), dst.dtype.element_ty, MANT, BIAS, HW))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", list(FORMATS))
def test_every_fp8_code_converts_in_hardware_like_torch(fp8, out_dtype):
    """The attention kernels' sm_89+ read path (`cvt` to fp16, then the query's dtype) and the integer
    decode of sm_80 give torch's value for every code, bit for bit (-0 and e5m2's infinities too),
    NaN codes as NaN."""
    mant, bias, _ = FORMATS[fp8]
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(CUDA)
    want = raw.view(fp8).to(out_dtype)
    nan, bits = want.isnan(), torch.int16 if out_dtype.itemsize == 2 else torch.int32
    for hardware in (hardware_fp8(CUDA), False):
        got = torch.empty(256, dtype=out_dtype, device=CUDA)
        _operand_kernel[(1,)](raw, got, MANT=mant, BIAS=bias, HW=hardware)
        assert torch.equal(got.isnan(), nan), hardware
        assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), hardware


@pytest.mark.parametrize(
    "dtype, granularity", [(torch.float8_e4m3fn, 128), (torch.float8_e4m3fn, 32), (torch.float8_e5m2, None)]
)
def test_fp8_cache_store_gather_bit_exact_and_attention(dtype, granularity):
    """FP8 pages on the GPU: quantized bytes and scales equal the reference backend's on the CPU (IEEE
    division, round to nearest even), dequantized reads too; attention (prefill, chunked, decode)
    against fp64 on the dequantized K/V."""
    cached, new = [0, 1000, 4000, 37], [300, 1, 1, 64]
    b, new_keys, new_values = make_fp8_batch(
        cached, new, dtype=dtype, granularity=granularity, page_size=16, num_kv_heads=8, head_dim=128, group=4
    )
    cpu = [t.clone() for t in (b.blocks, b.scales)]
    reference.store_kv(new_keys, new_values, cpu[0], *b.step, b.layer_idx, cpu[1])
    step = [t.to(CUDA) for t in b.step]
    blocks, scales = b.blocks.to(CUDA), b.scales.to(CUDA)
    ops.store_kv(new_keys.to(CUDA), new_values.to(CUDA), blocks, *step, b.layer_idx, scales)
    assert torch.equal(blocks.view(torch.uint8).cpu(), cpu[0].view(torch.uint8)) and torch.equal(scales.cpu(), cpu[1])
    got = ops.gather_kv(blocks, *step, b.layer_idx, 4001, scales, torch.float32)
    want = reference.gather_kv(cpu[0], *b.step, b.layer_idx, 4001, cpu[1], torch.float32)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    out = ops.flash_attention(b.q.to(CUDA), blocks, *step, b.layer_idx, 128**-0.5, scales=scales)
    # per-granule scales (granules narrower than a head) are applied to the K/V tiles, which the kernel
    # then rounds to the query's dtype for the tensor cores: the oracle reads those values
    read = (lambda t: t.to(b.q.dtype)) if granularity is not None and granularity < 128 else (lambda t: t)
    exact, spread = attention_fp64_and_spread(
        b.q, [read(k) for k in b.keys], [read(v) for v in b.values], cached, 128**-0.5
    )
    assert_attention_within_rounding(out.cpu(), exact, spread)
