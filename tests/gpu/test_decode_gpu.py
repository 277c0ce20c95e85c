"""Decode steps the way a serving loop runs them on the GPU: FP8 split-KV decode, a step captured in
a CUDA graph and replayed as the lengths change, and a `torch.compile(fullgraph=True)` step that does
not recompile as the batch size changes; Triton kernels, against the fp64 oracle or the reference
backend. Each body takes the device: the `cpu` variants run it at small sizes (Triton in its
interpreter, the graph's replays as eager calls), see conftest.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torch_paged_kv as pk
import torch_paged_kv.ops as ops
from torch_paged_kv.ops import reference
from torch_paged_kv.ops import splits as split_rule
from torch_paged_kv.ops.records import FlashAttentionArgs
from torch_paged_kv.ops.triton import flash_attention as triton_attention
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import ATTENTION_TOLERANCE as TOLERANCE
from torch_paged_kv.testing import attention_fp64, make_fp8_batch, make_paged_batch

DEVICES = ["cuda", "cpu"]
# device: (kv_heads, head_dim, GQA group, page_size)
HEADS = {"cuda": (8, 128, 4, 16), "cpu": (2, 16, 2, 4)}


@pytest.fixture(autouse=True)
def triton_backend(force_backend, device):
    reason = unavailable_reason(torch.device(device))
    if reason is not None:
        pytest.skip(reason)
    force_backend("triton")


# -- FP8 split-KV decode -------------------------------------------------------------------------

FP8_KINDS = {  # name: (dtype, scales per token and head (None: a static pair))
    "e4m3-per-token": (torch.float8_e4m3fn, 1),
    "e4m3-4-granules": (torch.float8_e4m3fn, 4),
    "e5m2-static": (torch.float8_e5m2, None),
}


@pytest.mark.parametrize("kind", FP8_KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_split_kv_decode_matches_fp64(device, kind, monkeypatch):
    """Long contexts at a small batch split the keys over programs, then merge: over FP8 pages too."""
    kv_heads, head_dim, group, page = HEADS[device]
    cached = [32767, 9000, 4095, 300] if device == "cuda" else [70, 5, 33]
    if device == "cpu":
        monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)  # splits at interpreter sizes
    dtype, groups = FP8_KINDS[kind]
    b, new_keys, new_values = make_fp8_batch(
        cached,
        [1] * len(cached),
        dtype=dtype,
        granularity=None if groups is None else head_dim // groups,
        page_size=page,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        group=group,
        seed=len(kind),
    )
    step = [t.to(device) for t in b.step]
    blocks, scales = b.blocks.to(device), b.scales.to(device)
    ops.store_kv(new_keys.to(device), new_values.to(device), blocks, *step, b.layer_idx, scales)
    args = (b.q.to(device), blocks, *step, b.layer_idx, head_dim**-0.5)
    launches = triton_attention.plan_flash_attention(FlashAttentionArgs(*args, scales=scales))[1]
    assert len(launches) == 2 and launches[0].grid[2] > 1  # split attention, then the merge
    out = ops.flash_attention(*args, scales=scales)
    expected = attention_fp64(b.q, b.keys, b.values, cached, head_dim**-0.5)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[out.dtype])


# -- a decode step captured once, replayed as the lengths change -----------------------------------


def captured(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """`step` captured in a CUDA graph (its replay), or on CPU `step` itself: the same static tensors,
    updated in place between calls."""
    if device.type != "cuda":
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_graph_replays_over_changing_lengths(device):
    """One capture; each replay gets new lengths (0, page boundaries, the last slot, random; ragged,
    growing and shrinking) and new q/K/V through the same tensors: every replay stores this step's
    K/V where the reference backend does and attends like it."""
    kv_heads, head_dim, group, page = HEADS[device]
    rows, context = (8, 4096) if device == "cuda" else (3, 40)
    b = make_paged_batch([context - 1] * rows, [1] * rows, page_size=page, num_kv_heads=kv_heads,
                         head_dim=head_dim, group=group, num_layers=1, layer_idx=0, dtype=torch.bfloat16,
                         device=device, seed=7)  # fmt: skip
    q, key, value = torch.zeros_like(b.q), torch.zeros_like(b.new_keys), torch.zeros_like(b.new_values)
    out = torch.zeros_like(q)

    def step() -> None:
        ops.store_kv(key, value, b.blocks, *b.step, 0)
        out.copy_(ops.flash_attention(q, b.blocks, *b.step, 0, head_dim**-0.5))

    replay = captured(step, torch.device(device))
    gen = torch.Generator().manual_seed(8)
    schedule = [[0] * rows, [page - 1, page, 2 * page - 1][:rows] + [0] * (rows - 3), [context - 1] * rows]
    schedule += [torch.randint(0, context, (rows,), generator=gen).tolist() for _ in range(3)]
    for lengths in schedule:
        b.cache_lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
        for t in (q, key, value):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        want_blocks = b.blocks.clone()
        reference.store_kv(key, value, want_blocks, *b.step, 0)
        want = reference.flash_attention(q, want_blocks, *b.step, 0, head_dim**-0.5)
        replay()
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(b.blocks, want_blocks), lengths
        torch.testing.assert_close(out, want, **TOLERANCE[out.dtype], msg=lambda m, lengths=lengths: f"{lengths}: {m}")


# -- torch.compile(fullgraph=True) without recompiles ------------------------------------------------

LAYERS = 2


def decode_step(q, k, v, blocks, cache_lengths, lookup_table, input_row_offsets, scales=None):
    out = q
    for layer in range(LAYERS):
        pk.store_kv(k, v, blocks, cache_lengths, lookup_table, input_row_offsets, layer, scales)
        out = pk.flash_attention(out, blocks, cache_lengths, lookup_table, input_row_offsets, layer,
                                 out.shape[-1] ** -0.5, scales=scales)  # fmt: skip
    return out * 2


@pytest.mark.parametrize(
    "device, dtype, quant",
    [
        ("cuda", torch.bfloat16, {}),
        ("cuda", torch.float8_e4m3fn, {}),
        ("cuda", torch.float8_e5m2, dict(quantization_granularity=32)),
        ("cpu", torch.bfloat16, {}),
    ],
    ids=["cuda-bf16", "cuda-e4m3-per-token", "cuda-e5m2-granule32", "cpu-bf16"],
)
def test_compiled_decode_step_does_not_recompile_across_batch_sizes(device, dtype, quant):
    """Compiled once (batch 1 first), the step runs batches 3, 5, 8, 2, 1 from one preallocated pool
    under `fail_on_recompile`, bit for bit like the eager step."""
    kv_heads, head_dim, group, page = HEADS[device]
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = pk.KVCacheParams(dtype, LAYERS, kv_heads, head_dim, page, **quant)
    pool = pk.PagedKVCacheCollection(params, num_pages=64, max_batch_size=8, max_seq_len=6 * page, device=device)
    pool.blocks.copy_(torch.randn(pool.blocks.shape, generator=gen).to(dtype))
    if pool.scales is not None:
        pool.scales.uniform_(0.01, 0.02)
    pool.lookup_table[:, :6] = (torch.randperm(64, generator=gen)[:48] + 1).view(8, 6).int()
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=True)
    q_dtype = dtype if dtype.itemsize > 1 else torch.bfloat16
    for i, batch in enumerate([1, 3, 5, 8, 2, 1]):
        step = pool.step_tensors(batch)
        step.cache_lengths.copy_(torch.randint(0, 5 * page, (batch,), generator=gen, dtype=torch.int32))
        step.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
        q, k, v = (torch.randn(batch, h, head_dim, generator=gen).to(q_dtype).to(device)
                   for h in (kv_heads * group, kv_heads, kv_heads))  # fmt: skip
        pk.mark_step_dynamic(step, q, k, v)
        eager = [t.clone() for t in (pool.blocks, pool.scales) if t is not None]
        expected = decode_step(q, k, v, eager[0], *step, *eager[1:])
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = compiled(q, k, v, pool.blocks, *step, pool.scales)
        assert torch.equal(got, expected), batch
        assert torch.equal(pool.blocks.view(torch.uint8), eager[0].view(torch.uint8)), batch
        assert pool.scales is None or torch.equal(pool.scales, eager[1]), batch
