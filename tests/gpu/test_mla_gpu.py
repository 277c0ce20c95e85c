"""Triton MLA kernels on CUDA at DeepSeek sizes (kv_lora_rank 512, rope 64), against the reference backend
and the fp64 oracle (`torch_paged_kv.testing`), bf16 and FP8 rope-aware rows; a decode step under
CUDA-graph capture; sparse attention (`key_positions`, DeepSeek-V3.2's 2048 keys per query)."""

from __future__ import annotations

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.ops import reference_mla
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import (
    ATTENTION_TOLERANCE,
    assert_attention_within_rounding,
    attention_fp64_and_spread,
    make_mla_batch,
    mla_as_attention,
    mla_attention_fp64,
)
from torch_paged_kv.testing.mla import random_key_positions, sparse_mla_attention_fp64

CUDA = torch.device("cuda")
if torch.cuda.is_available() and unavailable_reason(CUDA) is not None:
    pytest.skip(unavailable_reason(CUDA), allow_module_level=True)

KINDS = {
    "bf16": (torch.bfloat16, {}),
    "fp8-per-token": (torch.float8_e4m3fn, {}),
    "fp8-granule128": (torch.float8_e4m3fn, dict(quantization_granularity=128)),
    "e5m2-static": (torch.float8_e5m2, dict(static_scales=(0.01,))),
}


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


def _batch(cached, new, page_size, heads, kind, seed=0):
    dtype, quantization = KINDS[kind]
    return make_mla_batch(cached, new, page_size=page_size, num_heads=heads, kv_lora_rank=512, rope_dim=64,
                          dtype=dtype, q_dtype=torch.bfloat16, seed=seed, device=CUDA, **quantization)  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 64])
def test_store_latent_bit_exact(kind, page_size):
    b = _batch([5, 0, 200], [3, 70, 1], page_size, 16, kind)
    expected = [t.clone() for t in (b.blocks, b.scales) if t is not None]
    reference_mla.store_latent(b.new_latent, b.new_rope, expected[0], *b.step, b.layer_idx, *expected[1:])
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    torch.cuda.synchronize()
    assert torch.equal(b.blocks.view(torch.uint8), expected[0].view(torch.uint8))
    assert b.scales is None or torch.equal(b.scales, expected[1])


CASES = {  # (cached, new, page_size, heads)
    "decode-page1-h128": ([300, 17, 1000], [1, 1, 1], 1, 128),
    "decode-split-page64-h16": ([5000, 3], [1, 1], 64, 16),
    "prefill-page64-h16": ([0, 100], [150, 37], 64, 16),
    "chunked-page1-h128": ([40, 0], [20, 9], 1, 128),
    "decode-split-page64-h96": ([7000, 64, 1], [1, 1, 1], 64, 96),  # (sm_90: two 64-head tiles, one partial)
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", CASES)
def test_mla_attention_matches_reference_and_fp64(kind, name):
    cached, new, page_size, heads = CASES[name]
    b = _batch(cached, new, page_size, heads, kind, seed=len(name))
    reference_mla.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 192**-0.5, True, b.scales)
    got = pk.mla_attention(*args)
    # per-granule scales are applied to the latent tile, which the kernel then rounds to the query's
    # dtype for the tensor cores: the oracle reads those values
    latents = [t.to(b.q_nope.dtype) for t in b.latents] if kind == "fp8-granule128" else b.latents
    exact, spread = attention_fp64_and_spread(
        *mla_as_attention(b.q_nope, b.q_rope, latents, b.ropes), cached, 192**-0.5
    )
    assert_attention_within_rounding(got, exact, spread)
    if kind != "fp8-granule128":  # (the reference reads the unrounded latents)
        assert_attention_within_rounding(got, reference_mla.mla_attention(*args).double(), spread)


@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
def test_decode_step_replays_from_a_cuda_graph(kind):
    b = _batch([33, 700], [1, 1], 64, 16, kind)
    out = torch.empty_like(b.q_nope)

    def step():
        pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
        out.copy_(pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.1, True, b.scales))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = mla_attention_fp64(b.q_nope, b.q_rope, b.latents, b.ropes, [33, 700], 0.1)
    torch.testing.assert_close(out, expected.to(out.dtype), **ATTENTION_TOLERANCE[out.dtype])


SPARSE_CASES = {  # (cached, new, page_size, heads); each query lists DeepSeek-V3.2's index_topk = 2048 keys
    "decode-split-page64-h128": ([5000, 3000, 40], [1, 1, 1], 64, 128),  # (the short one: k past its length)
    "decode-page1-h16": ([3000, 2100], [1, 1], 1, 16),
    "chunked-page64-h16": ([2500, 0], [30, 40], 64, 16),
}


@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
@pytest.mark.parametrize("name", SPARSE_CASES)
def test_sparse_mla_attention_matches_reference_and_fp64(kind, name):
    cached, new, page_size, heads = SPARSE_CASES[name]
    b = _batch(cached, new, page_size, heads, kind, seed=len(name))
    reference_mla.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    positions = random_key_positions(b, 2048, seed=len(name), none_share=0.05).to(CUDA)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 192**-0.5, True, b.scales, positions)
    got = pk.mla_attention(*args)
    spread = sparse_mla_attention_fp64(b, positions, 192**-0.5, spread=True)
    assert_attention_within_rounding(got, sparse_mla_attention_fp64(b, positions, 192**-0.5), spread)
    assert_attention_within_rounding(got, reference_mla.mla_attention(*args).double(), spread)


def test_unchecked_sparse_mla_attention_skips_wild_entries():
    """Entries past the query's position or the table, or below -1, read nothing (no fault): the result
    is bit for bit that of the same call with them as -1."""
    b = _batch([3000, 100], [1, 1], 64, 128, "bf16", seed=1)
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx)
    positions = random_key_positions(b, 2048, seed=1).to(CUDA)
    wild, skipped = positions.clone(), positions.clone()
    wild[:, -3:] = torch.tensor([[3001, 2**31 - 1, -(2**31)], [101, 5000, -2]], dtype=torch.int32, device=CUDA)
    skipped[:, -3:] = -1
    step = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.1, True, None)
    got = torch.ops.paged_kv.mla_attention.unchecked(*step, wild)
    assert torch.equal(got, torch.ops.paged_kv.mla_attention.unchecked(*step, skipped))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
def test_mla_attention_with_sinks_matches_the_reference(kind, sparse):
    """HY-V4's attention sinks at DeepSeek sizes, split decode and a chunk: Triton against the reference."""
    b = _batch([3000, 40], [1, 5], 64, 16, kind, seed=2)
    reference_mla.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    positions = random_key_positions(b, 2048, seed=2).to(CUDA) if sparse else None
    sinks = torch.randn(16, generator=torch.Generator().manual_seed(3)).add_(3).to(CUDA)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 192**-0.5, True, b.scales, positions, sinks)
    got = pk.mla_attention(*args)
    expected = reference_mla.mla_attention(*args)
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[got.dtype])
