"""FP8 <-> fp32 by bit arithmetic, for the MLA kernels' FP8 rows (e4m3fn and e5m2, as torch stores them).

Triton has no `float8e4nv` on sm_80 (its conversions need sm_89+), so the MLA kernels move FP8 rows
as uint8 codes and convert with integer arithmetic, the same on every arch and in the interpreter:

- decode (to fp16): an e5m2 code is the high byte of an fp16; an e4m3fn code, its 7 magnitude bits shifted
  into an fp16's exponent and mantissa, is that fp16 times 2**8 (the bias difference, 15 - 7),
  subnormals included. Exact (every FP8 value is an fp16 value).
- encode (round to nearest even, `|x|` already clamped to the dtype's max, as `ops/quant.py` does):
  normal values round the fp32 bit pattern's mantissa to M bits (the carry moves into the
  exponent), subnormal ones round `|x| * 2**(bias - 1 + M)` to an integer with the fp32 magic-number
  addition. Bit-identical to torch's `.to(float8_*)` (tested on every code and on ties).
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3 = 1
E5M2 = 2
"""Values of the kernels' `FP8` constexpr (0: the rows are not FP8)."""


@triton.jit
def fp8_decode(code, FP8: tl.constexpr):
    """uint8 FP8 codes -> fp16 values (exact; half the registers of fp32 for a key tile)."""
    c = code.to(tl.uint16)
    if FP8 == 1:  # e4m3fn: at most 448 / 256 before the (exact, power-of-two) scaling
        half = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
        return half.to(tl.float16, bitcast=True) * 256.0
    else:  # e5m2
        return (c << 8).to(tl.float16, bitcast=True)


@triton.jit
def fp8_encode(x, FP8: tl.constexpr):
    """fp32 values within the dtype's range -> uint8 FP8 codes (round to nearest even)."""
    if FP8 == 1:  # e4m3fn: 3 mantissa bits, bias 7
        M: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        SUBNORMAL_SCALE: tl.constexpr = 512.0  # 2**(bias - 1 + M)
    else:  # e5m2: 2 mantissa bits, bias 15
        M: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        SUBNORMAL_SCALE: tl.constexpr = 65536.0
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - M
    rounded = (magnitude + ((1 << (SHIFT - 1)) - 1) + ((magnitude >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - BIAS) << M)
    tiny = tl.abs(x) * SUBNORMAL_SCALE  # exact: a power-of-two scaling
    subnormal = ((tiny + 8388608.0) - 8388608.0).to(tl.uint32)  # fp32 adds round to nearest even
    is_normal = magnitude >= ((127 + 1 - BIAS) << 23)  # |x| >= 2**(1 - bias)
    return (tl.where(is_normal, normal, subnormal) | sign).to(tl.uint8)
