"""The Triton FP8 conversions (integer path, under the interpreter) against torch's own, bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from torch_paged_kv.ops.triton.fp8 import FORMATS, float_to_fp8_bits, fp8_bits_to_float


@triton.jit
def _decode_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, fp8_bits_to_float(tl.load(src + i, mask=i < n, other=0), MANT, BIAS), mask=i < n)


@triton.jit
def _encode_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, float_to_fp8_bits(tl.load(src + i, mask=i < n, other=0.0), MANT, BIAS, MAX), mask=i < n)


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_every_fp8_byte_decodes_like_torch(dtype):
    mant, bias, _ = FORMATS[dtype]
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = raw.view(dtype).float().isfinite()  # NaN and inf patterns never reach a cache (saturated)
    out = torch.empty(256)
    _decode_kernel[(2,)](raw.to(torch.int32), out, 256, MANT=mant, BIAS=bias, BLOCK=128)
    assert torch.equal(out[finite].view(torch.int32), raw.view(dtype).float()[finite].view(torch.int32))  # -0 too


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_fp32_encodes_like_torch_round_to_nearest_even_saturating(dtype):
    mant, bias, top = FORMATS[dtype]
    gen = torch.Generator().manual_seed(0)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    ordered = values[values.isfinite()].unique()  # sorted
    x = torch.cat([
        ordered,  # exact values
        (ordered[:-1] + ordered[1:]) / 2,  # ties: round to the even pattern
        torch.randn(20000, generator=gen) * torch.logspace(-12, 6, 20000),  # every binade, both signs
        torch.tensor([0.0, -0.0, top, -top, top * 1.02, -top * 3, 1e38, -1e38, 1e-42, -1e-45]),
    ])  # fmt: skip
    out = torch.empty(x.numel(), dtype=torch.int32)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), MANT=mant, BIAS=bias, MAX=top, BLOCK=1024)
    want = x.clamp(-top, top).to(dtype).view(torch.uint8).to(torch.int32)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad[:5]]
