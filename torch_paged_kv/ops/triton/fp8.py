"""FP8 <-> fp32 in Triton, for the kernels that store into and read from FP8 caches.

Exact integer arithmetic on the raw bytes, so the same code runs on every GPU (sm_80 has no FP8
conversion instructions) and in Triton's interpreter (whose FP8 emulation reads NaN codes as
finite numbers): round to nearest even, saturating at the format's largest finite value, the rule
of `ops/quant.py`. Tested bit for bit against torch's own conversion for every byte and for fp32
values of every binade. Attention tiles, which only feed `tl.dot`, use the hardware conversion on
sm_89+ instead (`fp8_bits_to_operand`): the integer decode made the sm_90 decode loops 2.5-3x longer.

A format is described by its mantissa bits, exponent bias and largest finite value:
e4m3fn (`torch.float8_e4m3fn`): 3, 7, 448; e5m2 (`torch.float8_e5m2`): 2, 15, 57344.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import sm_version

FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}
"""FP8 dtype -> (mantissa bits, exponent bias, largest finite value)."""


@triton.jit
def fp8_bits_to_float(byte, MANT: tl.constexpr, BIAS: tl.constexpr, NAN_CODES: tl.constexpr = True):
    """fp32 values of raw FP8 bytes (an int tensor of 0..255): subnormals are `mantissa * 2^(1 -
    BIAS - MANT)`, normals are rebuilt as fp32 bit patterns (exact), the sign is the top bit (never
    a negation: triton < 3.7 builds `-x` as `0 - x`, which turns -0 into +0). With `NAN_CODES`, the
    non-finite codes read as in torch (e4m3fn: S.1111.111 is NaN; e5m2: an all-ones exponent is
    inf or NaN); a reader of caches that never hold them (per-granule scales: see `quantize_granules`)
    may leave them out."""
    b = byte.to(tl.int32) & 0xFF
    exponent = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    mantissa = b & ((1 << MANT) - 1)
    sign = (b >> 7) << 31
    normal = sign | ((exponent - BIAS + 127) << 23) | (mantissa << (23 - MANT))
    if NAN_CODES:
        if MANT == 3:
            special = (b & 0x7F) == 0x7F
        else:
            special = exponent == (1 << (7 - MANT)) - 1
        normal = tl.where(special, normal | (255 << 23), normal)
    subnormal = (mantissa.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))).to(tl.int32, bitcast=True) | sign
    return tl.where(exponent == 0, subnormal, normal).to(tl.float32, bitcast=True)


@triton.jit
def fp8_bits_to_operand(byte, dtype: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, HW: tl.constexpr):
    """The values of raw FP8 bytes (uint8) in `dtype`. `HW` (sm_89+): the hardware conversion,
    FP8 -> fp16 then `dtype` (every FP8 value, NaN, infinities and -0 included, is exact in
    fp16 and bf16); otherwise `fp8_bits_to_float`, then `dtype`."""
    if HW:
        fmt: tl.constexpr = tl.float8e4nv if MANT == 3 else tl.float8e5
        return byte.to(fmt, bitcast=True).to(tl.float16).to(dtype)
    return fp8_bits_to_float(byte, MANT, BIAS).to(dtype)


@triton.jit
def float_to_fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """Raw FP8 bytes (int32 0..255) of fp32 `x`: clamped to ±MAX, rounded to nearest even; a NaN is
    0x7F, whatever its sign (`ops/quant.py`). (The clamp alone would make it ±MAX: `tl.minimum` and
    `tl.maximum` return the operand that is not NaN.)"""
    nan = x != x
    x = tl.minimum(tl.maximum(x, -MAX), MAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    exponent = (magnitude >> 23) - 127
    significand = (magnitude & 0x7FFFFF) | 0x800000  # fp32 subnormals are far below FP8's range
    lowest = 1 - BIAS  # exponent of the smallest FP8 normal
    shift = (23 - MANT) + tl.maximum(lowest - exponent, 0)
    shift = tl.minimum(shift, 25)  # from 25 on everything rounds to 0
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    # a normal's significand keeps its leading 1 (kept in 2^MANT .. 2^(MANT+1), the top one carrying
    # into the exponent); a subnormal's is the mantissa field itself (2^MANT: the smallest normal)
    byte = tl.where(exponent >= lowest, ((exponent + BIAS) << MANT) + kept - (1 << MANT), kept)
    return tl.where(nan, 0x7F, tl.where(magnitude == 0, 0, byte) | sign)


@triton.jit
def quantize_granules(x, N: tl.constexpr, GRAN: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                      MAX: tl.constexpr):  # fmt: skip
    """(FP8 bytes, scales) of fp32 `x` `[N]` quantized per granule of GRAN elements by the rule of
    `ops/quant.py`: scale = granule amax / MAX in IEEE division (`/` compiles to the approximate
    `div.full.f32`), values divided by it; an all-zero granule gets scale 0 and zero bytes, a granule
    holding a NaN or an infinity scale NaN and zero bytes (`tl.max` alone would skip a NaN)."""
    granules = tl.reshape(x, (N // GRAN, GRAN))
    magnitude = tl.abs(granules)
    non_finite = tl.max(tl.where(magnitude <= 3.4028234663852886e38, 0, 1), 1) > 0  # NaN compares false
    scale = tl.where(non_finite, float("nan"), tl.math.div_rn(tl.max(magnitude, 1), MAX))
    q = tl.where(scale[:, None] > 0, tl.math.div_rn(granules, tl.where(scale > 0, scale, 1.0)[:, None]), 0.0)
    return float_to_fp8_bits(tl.reshape(q, (N,)), MANT, BIAS, MAX), scale


def hardware_fp8(device: torch.device) -> bool:
    """Whether kernels on `device` decode FP8 with the hardware conversion (`fp8_bits_to_operand`):
    CUDA sm_89 and later; on "meta", whether `common.META_ARCH` is."""
    return sm_version(device) >= 89


class Quantization(NamedTuple):
    """How a kernel reads or writes one cache's values: what it is launched with."""

    pool: torch.Tensor  # `blocks`, as raw bytes (uint8) for an FP8 cache
    scales: torch.Tensor  # the scales (a dummy pointer, `pool`, when there are none)
    scale_strides: tuple[int, int, int, int]  # (page, plane, layer, token) of per-granule scales
    constexprs: dict[str, int | float]  # QUANT (0 none, 1 per granule, 2 per tensor), GRAN, MANT, BIAS, FMAX


def quantization(blocks: torch.Tensor, scales: torch.Tensor | None) -> Quantization:
    """The launch arguments for `blocks` and its `scales` (see `ops/quant.py` for the layouts)."""
    if scales is None:
        return Quantization(blocks, blocks, (0, 0, 0, 0), dict(QUANT=0, GRAN=1, MANT=0, BIAS=0, FMAX=0.0))
    mant, bias, top = FORMATS[blocks.dtype]
    pool = blocks.view(torch.uint8)
    if scales.dim() == 1:
        return Quantization(pool, scales, (0, 0, 0, 0), dict(QUANT=2, GRAN=1, MANT=mant, BIAS=bias, FMAX=top))
    granularity = blocks.shape[5] // scales.shape[5]
    strides = (scales.stride(0), scales.stride(1), scales.stride(2), scales.stride(3))
    return Quantization(pool, scales, strides, dict(QUANT=1, GRAN=granularity, MANT=mant, BIAS=bias, FMAX=top))


def covered(blocks: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether the Triton kernels handle this cache's quantization: per-granule granules must be a
    power of two (they are reshaped as tiles); unquantized and per-tensor caches always are."""
    if scales is None or scales.dim() == 1:
        return True
    granularity = blocks.shape[5] // scales.shape[5]
    return granularity & (granularity - 1) == 0
