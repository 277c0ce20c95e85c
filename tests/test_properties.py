"""Property tests: random ragged batches through store_kv + flash_attention / gather_kv.

Hypothesis draws the batch shape, page size, layout, heads, dtype and mask; the CPU backends
(`reference` and `cpu`) must match the fp64 oracle (and gather_kv the stored tokens exactly), and
the Triton kernels under the interpreter must match the reference.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_paged_kv as pk
from torch_paged_kv.testing import attention_fp64, make_fp8_batch, make_paged_batch

# Output rounding of the dtype (half an ulp is 2^-24 / 2^-11 / 2^-8 relative) plus fp32 accumulation.
RTOL = {torch.float32: 1e-5, torch.float16: 2 * 2**-11, torch.bfloat16: 2 * 2**-8}


@st.composite
def batches(draw, max_batch=4, max_cached=40, max_new=6):
    batch = draw(st.integers(1, max_batch))
    cached = draw(st.lists(st.integers(0, max_cached), min_size=batch, max_size=batch))
    new = draw(st.lists(st.integers(0, max_new), min_size=batch, max_size=batch))
    if sum(new) == 0:
        new[draw(st.integers(0, batch - 1))] = 1
    continuous = draw(st.booleans())
    longest = max(c + n for c, n in zip(cached, new, strict=True))
    page_size = longest + draw(st.integers(0, 5)) if continuous else draw(st.sampled_from([1, 2, 3, 5, 8, 16]))
    return dict(
        cache_lengths=cached,
        new_lengths=new,
        page_size=page_size,
        continuous=continuous,
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([16, 32])),
        seed=draw(st.integers(0, 2**16)),
    )


masks = st.fixed_dictionaries(
    dict(causal=st.booleans(), sliding_window=st.sampled_from([-1, 1, 3, 17]), softcap=st.sampled_from([0.0, 2.5]))
)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    err = (out.double() - ref).abs()
    return bool((err <= 1e-5 + RTOL[dtype] * ref.abs()).all())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=batches(), mask=masks, dtype=st.sampled_from(list(RTOL)))
def test_attention_matches_fp64(force_backend, backend, shape, mask, dtype):
    force_backend(backend)
    b = make_paged_batch(dtype=dtype, **shape)
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, **mask)
    ref = attention_fp64(b.q, b.keys, b.values, shape["cache_lengths"], 0.3, **mask)
    assert _close(out, ref, dtype)
    key, value = pk.gather_kv(b.blocks, *b.step, b.layer_idx, max(k.shape[0] for k in b.keys))
    for i, (k, v) in enumerate(zip(b.keys, b.values, strict=True)):
        assert torch.equal(key[i, : k.shape[0]], k) and torch.equal(value[i, : v.shape[0]], v)
        assert not key[i, k.shape[0] :].any() and not value[i, v.shape[0] :].any()


@st.composite
def fp8_batches(draw):
    """A batch shape for an FP8 cache: head_dim 16, 32 or 64 and scales per granule of 8 to 64
    elements dividing it, per token and head, or a static pair (None)."""
    shape = draw(batches())
    head_dim = draw(st.sampled_from([16, 32, 64]))
    granules = [None, *(g for g in (8, 16, 32, 64) if head_dim % g == 0)]
    return {**shape, "head_dim": head_dim, "granularity": draw(st.sampled_from(granules))}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=fp8_batches(),
    mask=masks,
    fp8=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]),
    q_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_fp8_attention_matches_fp64_on_the_dequantized_cache(force_backend, backend, shape, mask, fp8, q_dtype):
    """store_kv quantizes this step's rows and flash_attention reads the FP8 pages (random codes and
    scales in every unused slot) as fp64 attention over what the cache holds."""
    force_backend(backend)
    b, new_keys, new_values = make_fp8_batch(dtype=fp8, **shape)
    pk.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, b.scales)
    q = b.q.to(q_dtype)
    out = pk.flash_attention(q, b.blocks, *b.step, b.layer_idx, 0.3, **mask, scales=b.scales)
    ref = attention_fp64(q, b.keys, b.values, shape["cache_lengths"], 0.3, **mask)
    assert out.dtype == q_dtype and _close(out, ref, q_dtype)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 "
    "(tests/conftest.py sets it when no GPU is visible; tests/gpu covers the kernels on a GPU)",
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=batches(max_batch=3, max_cached=24, max_new=4),
    mask=masks,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_triton_matches_reference(force_backend, shape, mask, dtype):
    results = []
    for backend in ("reference", "triton"):
        b = make_paged_batch(dtype=dtype, **shape)
        force_backend(backend)
        pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
        out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, **mask)
        results.append((b.blocks, out))
    (ref_blocks, ref_out), (blocks, out) = results
    assert torch.equal(blocks, ref_blocks)  # store_kv writes the same slots, bit for bit
    assert _close(out, ref_out.double(), dtype)
