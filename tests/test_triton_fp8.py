"""The Triton FP8 conversions (integer path, under the interpreter) against torch's own, bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from torch_paged_kv.ops.triton.common import META_ARCH
from torch_paged_kv.ops.triton.fp8 import FORMATS, float_to_fp8_bits, fp8_bits_to_float, hardware_fp8


@triton.jit
def _decode_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, fp8_bits_to_float(tl.load(src + i, mask=i < n, other=0), MANT, BIAS), mask=i < n)


@triton.jit
def _encode_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, float_to_fp8_bits(tl.load(src + i, mask=i < n, other=0.0), MANT, BIAS, MAX), mask=i < n)


@triton.jit
def _decode_finite_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(src + i, mask=i < n, other=0)
    tl.store(dst + i, fp8_bits_to_float(byte, MANT, BIAS, NAN_CODES=False), mask=i < n)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_every_fp8_byte_decodes_like_torch(dtype):
    """Every code, bit for bit (-0 and e5m2's infinities too; NaN codes as NaN): static-scale caches
    hold the NaN code 0x7F for a NaN (`ops/quant.py`). Without `NAN_CODES` the finite codes still
    decode exactly."""
    mant, bias, _ = FORMATS[dtype]
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = raw.view(dtype).float()
    out, finite_only = torch.empty(256), torch.empty(256)
    _decode_kernel[(2,)](raw.to(torch.int32), out, 256, MANT=mant, BIAS=bias, BLOCK=128)
    _decode_finite_kernel[(2,)](raw.to(torch.int32), finite_only, 256, MANT=mant, BIAS=bias, BLOCK=128)
    nan = want.isnan()
    assert nan.any() and torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))
    finite = want.isfinite()
    assert torch.equal(finite_only[finite].view(torch.int32), want[finite].view(torch.int32))


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_fp32_encodes_like_torch_round_to_nearest_even_saturating(dtype):
    """Bit for bit as torch converts, after the clamp of `ops/quant.py`; a NaN of either sign is 0x7F."""
    mant, bias, top = FORMATS[dtype]
    gen = torch.Generator().manual_seed(0)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    ordered = values[values.isfinite()].unique()  # sorted
    x = torch.cat([
        ordered,  # exact values
        (ordered[:-1] + ordered[1:]) / 2,  # ties: round to the even pattern
        torch.randn(20000, generator=gen) * torch.logspace(-12, 6, 20000),  # every binade, both signs
        torch.tensor([0.0, -0.0, top, -top, top * 1.02, -top * 3, 1e38, -1e38, 1e-42, -1e-45]),
        torch.tensor([float("inf"), -float("inf"), float("nan")]), -torch.tensor([float("nan")]),  # -NaN too
    ])  # fmt: skip
    out = torch.empty(x.numel(), dtype=torch.int32)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), MANT=mant, BIAS=bias, MAX=top, BLOCK=1024)
    want = x.clamp(-top, top).to(dtype).view(torch.uint8).to(torch.int32)
    want[x.isnan()] = 0x7F  # a NaN is the positive NaN code, its sign dropped (ops/quant.py)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad[:5]]


def _minus_before_triton_3_7(self, input):
    """Unary minus as triton < 3.7 builds it (3.6 is the GPU machine's): `0 - x` for every type, so
    `-(+0.0)` is +0.0. (3.7 emits a float negation, which flips the sign bit.)"""
    scalar = input.type.scalar
    make = getattr(self, "make_tensor", None) or self.tensor
    return self.sub(make(self.builder.get_null_value(scalar.to_ir(self.builder)), scalar), input, True)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_negative_zero_decodes_under_triton_3_6s_unary_minus(dtype, monkeypatch):
    """The decode must not lean on `-x` for a sign: under triton 3.6 the byte 0x80 decoded to +0."""
    from triton.language.semantic import TritonSemantic

    monkeypatch.setattr(TritonSemantic, "minus", _minus_before_triton_3_7)
    test_every_fp8_byte_decodes_like_torch(dtype)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp32_queries_over_fp8_pages_at_head_dim_256_are_left_to_the_reference(head_dim, force_backend):
    """Their smallest tile spills ~300 bytes a thread on sm_80 and sm_90 (`aot`): Triton declines
    them by shape and the next backend in the default order runs them (the reference on a GPU);
    head_dim 128 takes 16 x 16 tiles."""
    import torch_paged_kv as pk
    from torch_paged_kv.ops import reference
    from torch_paged_kv.testing import make_fp8_batch

    b, _, _ = make_fp8_batch([5], [1], head_dim=head_dim, num_kv_heads=1)
    args = (b.q.float(), b.blocks, *b.step, b.layer_idx, head_dim**-0.5)
    force_backend("triton")
    if head_dim == 256:
        with pytest.raises(pk.BackendUnavailableError, match="does not cover"):
            pk.flash_attention(*args, scales=b.scales)
        force_backend(None)
    got = pk.flash_attention(*args, scales=b.scales)
    torch.testing.assert_close(got, reference.flash_attention(*args, scales=b.scales))


def test_the_hardware_conversion_is_planned_for_sm_89_and_later_only():
    """CPU tensors (the interpreter, whose FP8 emulation reads NaN codes as numbers) take the integer
    decode; "meta" launches (`aot`) follow the architecture they are planned for."""
    assert hardware_fp8(torch.device("cpu")) is False
    for arch, hardware in ((80, False), (86, False), (89, True), (90, True), (100, True)):
        token = META_ARCH.set(arch)
        try:
            assert hardware_fp8(torch.device("meta")) is hardware, arch
        finally:
            META_ARCH.reset(token)
