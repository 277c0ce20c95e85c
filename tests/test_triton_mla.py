"""Triton MLA kernels under TRITON_INTERPRET=1 on CPU tensors: `store_latent` bit for bit against the
reference backend, `mla_attention` against the reference and the fp64 oracle (`torch_paged_kv.testing`);
FP8 rope-aware rows included. Tiny shapes: the interpreter runs every program in Python."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU is visible: tests/gpu covers the Triton kernels", allow_module_level=True)

import torch_paged_kv as pk
from torch_paged_kv import NULL_PAGE
from torch_paged_kv.ops import reference_mla
from torch_paged_kv.ops import splits as split_rule
from torch_paged_kv.ops.triton import mla_attention as triton_mla
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import ATTENTION_TOLERANCE, make_mla_batch, mla_attention_fp64

if unavailable_reason(torch.device("cpu")) is not None:
    pytest.fail(f"Triton kernels cannot run on CPU tensors here: {unavailable_reason(torch.device('cpu'))}")

QUANT = {
    "bf16": (torch.bfloat16, {}),
    "fp32": (torch.float32, {}),
    "fp16": (torch.float16, {}),
    "fp8-per-token": (torch.float8_e4m3fn, {}),
    "fp8-granule8": (torch.float8_e4m3fn, dict(quantization_granularity=8)),
    "e5m2-static": (torch.float8_e5m2, dict(static_scales=(0.01,))),
}


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


def _raw(t):
    return None if t is None else t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("kind", QUANT)
@pytest.mark.parametrize("page_size, continuous", [(1, False), (5, False), (24, True)])
def test_store_latent_writes_exactly_the_reference_rows(kind, page_size, continuous):
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([3, 0, 9], [2, 4, 1], page_size=page_size, dtype=dtype, continuous=continuous, **quantization)
    latent, rope = b.new_latent, b.new_rope
    if kind == "fp8-per-token":  # fp32 rows, some big, one all zero: the rule's corners
        latent, rope = latent.float() * torch.logspace(-3, 3, latent.shape[0])[:, None], rope.float()
        latent[1] = 0.0
    expected_blocks, expected_scales = b.blocks.clone(), None if b.scales is None else b.scales.clone()
    reference_mla.store_latent(latent, rope, expected_blocks, *b.step, b.layer_idx, expected_scales)
    pk.store_latent(latent, rope, b.blocks, *b.step, b.layer_idx, b.scales)
    assert torch.equal(_raw(b.blocks), _raw(expected_blocks))
    assert b.scales is None or torch.equal(b.scales, expected_scales)


def test_store_latent_skips_out_of_range_and_null_pages_when_checks_are_off(monkeypatch):
    monkeypatch.setenv("TORCH_PAGED_KV_VALIDATE", "shapes")
    b = make_mla_batch([2, 6], [5, 2], page_size=3, layer_idx=0, dtype=torch.float8_e4m3fn)
    expected_blocks, expected_scales = b.blocks.clone(), b.scales.clone()
    bad_table = b.lookup_table.clone()
    bad_table[0, :3] = torch.tensor([-1, b.blocks.shape[0], NULL_PAGE])  # tokens 2..6 of sequence 0
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, b.cache_lengths, bad_table, b.input_row_offsets, 0, b.scales)
    # Only sequence 1 is written: the same as storing it alone.
    reference_mla.store_latent(
        b.new_latent[5:],
        b.new_rope[5:],
        expected_blocks,
        b.cache_lengths[1:],
        b.lookup_table[1:],
        b.input_row_offsets[1:] - 5,
        0,
        expected_scales,
    )
    assert torch.equal(_raw(b.blocks), _raw(expected_blocks)) and torch.equal(b.scales, expected_scales)


ATTENTION_CASES = {
    # name: (cached, new, page_size, continuous, heads, rank, rope, kind, causal)
    "prefill-page1": ([0, 0], [5, 3], 1, False, 4, 32, 16, "fp32", True),
    "chunked-page3-bf16": ([7, 0, 12], [6, 3, 5], 3, False, 2, 32, 16, "bf16", True),
    "noncausal-page16-h20": ([20, 3], [5, 2], 16, False, 20, 16, 8, "fp16", False),
    "decode-ragged": ([45, 3, 0], [1, 1, 1], 4, False, 8, 32, 16, "bf16", True),
    "slots-no-rope": ([10, 0, 21], [1, 6, 1], 24, True, 4, 32, 0, "fp32", True),
    "fp8-per-token-mixed": ([12, 0, 30], [1, 5, 2], 8, False, 4, 32, 16, "fp8-per-token", True),
    "fp8-granule8-decode": ([40, 7], [1, 1], 8, False, 4, 32, 16, "fp8-granule8", True),
    "e5m2-static-prefill": ([5, 0], [4, 6], 4, False, 4, 32, 16, "e5m2-static", True),
}


def _check(b, scale: float, causal: bool = True) -> None:
    reference_mla.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales)
    got = pk.mla_attention(*args)
    assert got.shape == b.q_nope.shape and got.dtype == b.q_nope.dtype
    tolerance = ATTENTION_TOLERANCE[got.dtype]
    torch.testing.assert_close(got, reference_mla.mla_attention(*args), **tolerance)
    expected = mla_attention_fp64(b.q_nope, b.q_rope, b.latents, b.ropes, b.cache_lengths.tolist(), scale, causal)
    torch.testing.assert_close(got, expected.to(got.dtype), **tolerance)


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_mla_attention_matches_reference_and_fp64(name):
    cached, new, page_size, continuous, heads, rank, rope, kind, causal = ATTENTION_CASES[name]
    dtype, quantization = QUANT[kind]
    b = make_mla_batch(
        cached,
        new,
        page_size=page_size,
        continuous=continuous,
        num_heads=heads,
        kv_lora_rank=rank,
        rope_dim=rope,
        dtype=dtype,
        seed=len(name),
        **quantization,
    )
    _check(b, (rank + rope) ** -0.5, causal)


@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
def test_split_kv_decode_matches_fp64(monkeypatch, kind):
    monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([70, 5, 33], [1, 1, 1], page_size=8, num_heads=4, dtype=dtype, seed=3, **quantization)
    launches = triton_mla.plan_mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales)[1]
    assert len(launches) == 2 and launches[0].grid[2] > 1  # split attention, then the merge
    _check(b, 0.2)


def test_deepseek_shape_decode_matches_fp64():
    """kv_lora_rank 512, rope 64, 16 heads: one latent row per token serves every head."""
    b = make_mla_batch([21, 3], [1, 1], page_size=16, num_heads=16, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    _check(b, 192**-0.5)


def test_triton_declines_ranks_it_does_not_cover(force_backend):
    b = make_mla_batch([2], [1], page_size=4, kv_lora_rank=24, rope_dim=8)
    with pytest.raises(pk.BackendUnavailableError, match="does not cover"):
        pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2)
    force_backend(None)
    pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2)  # the reference runs it on CPU


def test_triton_leaves_fp32_queries_over_fp8_rows_to_the_reference(force_backend):
    b = make_mla_batch([2], [1], page_size=4, dtype=torch.float8_e4m3fn, q_dtype=torch.float32)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales)
    with pytest.raises(pk.BackendUnavailableError, match="does not cover"):
        pk.mla_attention(*args)
    force_backend(None)
    torch.testing.assert_close(pk.mla_attention(*args), reference_mla.mla_attention(*args))
