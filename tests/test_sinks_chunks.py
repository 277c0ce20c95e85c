"""`flash_attention`'s attention sinks (GPT-OSS) and chunked local attention (Llama 4), on every
backend that runs on CPU (`reference`, `cpu`, `triton` under the interpreter), against the fp64
oracle on contiguous K/V (`testing.attention_fp64`, written from the op contract alone)."""

from __future__ import annotations

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv import ops
from torch_paged_kv.ops.cpu import kernels as cpu_kernels
from torch_paged_kv.testing import ATTENTION_TOLERANCE, attention_fp64, make_fp8_batch, make_paged_batch

BACKENDS = ["reference", "cpu", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """Random sink logits, some above every score (they then take most of the weight), some below."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, generator=gen) * 3.0


def _check(b, out, sinks=None, chunk=-1, **options):
    expected = attention_fp64(
        b.q, b.keys, b.values, b.cache_lengths.tolist(), 0.3, sinks=sinks, attention_chunk_size=chunk, **options
    )
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[b.q.dtype])


def _store_and_attend(b, **options):
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    return pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "cached, new", [([5, 0, 17], [3, 12, 1]), ([30, 9, 41, 2], [1, 1, 1, 1])], ids=["ragged", "decode"]
)
def test_sinks_match_fp64(backend, dtype, cached, new):
    b = make_paged_batch(cached, new, page_size=4, group=4, head_dim=32, dtype=dtype, seed=len(cached))
    sinks = _sinks(b.q.shape[1], 3)
    _check(b, _store_and_attend(b, sinks=sinks), sinks=sinks)


@pytest.mark.parametrize("chunk", [1, 4, 7, 16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_chunked_attention_matches_fp64(backend, chunk, causal):
    b = make_paged_batch([5, 0, 17, 30], [3, 12, 1, 1], page_size=4, group=2, head_dim=32, seed=chunk)
    _check(b, _store_and_attend(b, causal=causal, attention_chunk_size=chunk), chunk=chunk, causal=causal)


def test_sinks_chunks_window_and_softcap_together(backend):
    b = make_paged_batch([5, 0, 17, 30], [3, 12, 1, 1], page_size=4, group=2, head_dim=32, seed=9)
    sinks = _sinks(b.q.shape[1], 4)
    out = _store_and_attend(b, sliding_window=5, softcap=1.5, sinks=sinks, attention_chunk_size=8)
    _check(b, out, sinks=sinks, chunk=8, sliding_window=5, softcap=1.5)


def test_sinks_in_split_key_ranges(backend, monkeypatch):
    """Long decode rows whose key ranges are split (the Triton interpreter plans splits past 256 keys;
    the cpu kernels are told to split at 16): the sink joins the merged denominator once."""
    monkeypatch.setattr(cpu_kernels, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu_kernels, "WANT_ITEMS", 64)
    b = make_paged_batch([700, 300], [1, 1], page_size=16, group=4, head_dim=32, seed=5)
    sinks = _sinks(b.q.shape[1], 6)
    _check(b, _store_and_attend(b, sinks=sinks), sinks=sinks)


def test_sinks_over_an_fp8_cache(backend):
    b, new_keys, new_values = make_fp8_batch([20, 3], [1, 5], page_size=8, head_dim=64, group=2, seed=2)
    sinks = _sinks(b.q.shape[1], 7)
    pk.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, b.scales)
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, scales=b.scales, sinks=sinks)
    _check(b, out, sinks=sinks)


def test_a_row_that_sees_no_key_is_zero_with_a_sink(backend):
    """Rows of an empty sequence do not exist; but a sink must not make a padded/empty row NaN: a
    query of a sequence whose window is 1 still sees itself, and an enormous sink takes all weight."""
    b = make_paged_batch([6], [2], page_size=4, group=1, head_dim=32, seed=1)
    sinks = torch.full((b.q.shape[1],), 80.0)
    out = _store_and_attend(b, sinks=sinks)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-20


@pytest.mark.parametrize(
    "sinks, message",
    [
        (torch.zeros(4, dtype=torch.float64), "1-D float32"),
        (torch.zeros(2, 2), "1-D float32"),
        (torch.zeros(3), "expected 4 entries"),
    ],
)
def test_bad_sinks_are_rejected(force_backend, sinks, message):
    force_backend("reference")
    b = make_paged_batch([5], [1], page_size=4, group=2, head_dim=32)
    before = b.blocks.clone()
    with pytest.raises(ValueError, match=f"^sinks: .*{message}"):
        pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, sinks=sinks)
    with pytest.raises(ValueError, match="^sinks: "):
        ops.flash_attention_unchecked(b.q, b.blocks, *b.step, b.layer_idx, 0.3, sinks=sinks)
    assert torch.equal(b.blocks, before)


def test_step_plan_keeps_one_kernel_per_variant(backend):
    """Llama 4 alternates chunked and full layers, GPT-OSS sliding and full: a plan keeps the kernel a
    variant's first eager call chose, so a chunked layer after a full one gets the chunked answer."""
    b = make_paged_batch([5, 17], [3, 1], page_size=4, group=2, head_dim=32, seed=3)
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    plan = pk.StepPlan(b.blocks, pk.StepTensors(*b.step), first_layer=0)
    sinks = _sinks(b.q.shape[1], 8)
    plan.flash_attention(b.q, 0, 0.3)
    for _ in range(2):  # the second round uses the kept kernels
        _check(b, plan.flash_attention(b.q, b.layer_idx, 0.3, attention_chunk_size=4), chunk=4)
        _check(b, plan.flash_attention(b.q, b.layer_idx, 0.3, sinks=sinks), sinks=sinks)
        _check(b, plan.flash_attention(b.q, b.layer_idx, 0.3))
    assert len(plan.kernels) == 3


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"sinks": True}, "attention sinks"),
        ({"attention_chunk_size": 4}, "chunked attention"),
        ({"tree_mask": True}, "tree masks"),
        ({"softcap": 30.0}, "softcap"),
        ({}, "need CUDA tensors"),
    ],
)
def test_a_forced_cute_backend_names_the_option_its_kernels_lack(monkeypatch, force_backend, options, named):
    """CuTe declines sinks, chunks, trees and softcap (Triton runs them); forced, its refusal names the
    option (the backend made available here so that the option check, not the device, refuses)."""
    from torch_paged_kv.ops import dispatch
    from torch_paged_kv.ops.records import FlashAttentionArgs

    b = make_paged_batch([5, 3], [1, 1], page_size=4, num_kv_heads=2, head_dim=8, group=2, seed=3)
    sinks = _sinks(4, 1) if options.pop("sinks", False) else None
    tree = torch.ones(2, dtype=torch.int64) if options.pop("tree_mask", False) else None
    a = FlashAttentionArgs(b.q, b.blocks, *b.step, b.layer_idx, 0.1, sinks=sinks, tree_mask=tree, **options)
    monkeypatch.setitem(dispatch._availability, "cute", lambda device: None)
    force_backend("cute")
    with pytest.raises(pk.BackendUnavailableError, match=f"does not cover this flash_attention call: .*{named}"):
        dispatch.select("flash_attention", b.q.device, a)
