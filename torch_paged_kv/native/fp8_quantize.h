// fp8_quantize.h: fp32 to FP8 codes by torch's rounding, and the per-granule amax (store_kv into
// an FP8 pool).
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include "kinds.h"

namespace {

// fp32 -> the FP8 code of its round-to-nearest-even value, as torch converts (c10's rule), except
// that a NaN is 0x7f whatever its sign (ops/quant.py: e4m3fn's and e5m2's positive NaN); callers
// clamp finite values to the format's range first. Normal results: round the mantissa in the fp32
// bits, then rebias; subnormal ones: adding 2^(bias + mantissa bits - 1) (a power of two) rounds
// the value to the subnormal step in the add.
template <int FORMAT>
inline uint8_t f32_to_fp8(float f) {
  constexpr int MANT = FORMAT == E4M3FN ? 3 : 2, BIAS = FORMAT == E4M3FN ? 7 : 15;
  constexpr int SHIFT = 23 - MANT;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t code;
  if (bits > 0x7f800000u) {
    return 0x7f;  // NaN, in either format, its sign dropped
  } else if (bits < static_cast<uint32_t>(127 - BIAS + 1) << 23) {  // below the smallest normal
    const uint32_t magic_bits = static_cast<uint32_t>(127 + 24 - BIAS - MANT) << 23;  // its ulp: the step
    float magic, x;
    std::memcpy(&magic, &magic_bits, 4);
    std::memcpy(&x, &bits, 4);
    x += magic;
    uint32_t sum;
    std::memcpy(&sum, &x, 4);
    code = sum - magic_bits;
  } else {
    bits += (static_cast<uint32_t>(BIAS - 127) << 23) + ((1u << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1u);
    code = bits >> SHIFT;
  }
  return static_cast<uint8_t>(code | (sign >> 24));
}

// The largest finite value of an FP8 format (what quantization clamps to).
constexpr float fp8_largest(int format) { return format == E4M3FN ? 448.0f : 57344.0f; }

#if defined(__AVX2__)
// f32_to_fp8 for 8 values at once, each lane's code in its low byte (the same integer steps).
template <int FORMAT>
inline __m256i f32_to_fp8_x8(__m256 f) {
  constexpr int MANT = FORMAT == E4M3FN ? 3 : 2, BIAS = FORMAT == E4M3FN ? 7 : 15, SHIFT = 23 - MANT;
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i mag = _mm256_xor_si256(bits, sign);
  const __m256i magic = _mm256_set1_epi32((127 + 24 - BIAS - MANT) << 23);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(magic))), magic);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, SHIFT), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_set1_epi32(static_cast<int>((static_cast<uint32_t>(BIAS - 127) << 23) + (1u << (SHIFT - 1)) - 1));
  const __m256i norm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, bias), odd), SHIFT);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((127 - BIAS + 1) << 23), mag);
  const __m256i is_nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
  __m256i code = _mm256_blendv_epi8(norm, sub, is_sub);
  code = _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), is_nan);  // NaN: 0x7f, its sign dropped
}
#endif

// dst[0, n) = the FP8 codes of x[0, n) / s clamped to the format's largest value (NaN: code 0x7f).
template <int FORMAT>
inline void quantize(const float* x, int64_t n, float s, uint8_t* dst) {
  constexpr float top = fp8_largest(FORMAT);
  int64_t d = 0;
#if defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
  for (; d + 8 <= n; d += 8) {
    const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + d), vs);
    const __m256 clamped = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    const __m256 kept = _mm256_blendv_ps(clamped, q, _mm256_cmp_ps(q, q, _CMP_UNORD_Q));  // NaN stays NaN
    const __m256i code = f32_to_fp8_x8<FORMAT>(kept);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packus_epi16(words, words));
  }
#endif
  for (; d < n; ++d) {
    const float q = x[d] / s;
    dst[d] = f32_to_fp8<FORMAT>(std::isnan(q) ? q : std::clamp(q, -top, top));
  }
}

// The largest |x[d]| over d < n, NaNs left out; *non_finite says whether there was a NaN or an
// infinity (ops/quant.py: the granule's scale is then NaN, so the amax itself does not matter).
inline float abs_max(const float* x, int64_t n, bool* non_finite) {
  float amax = 0.0f;
  bool any_nan = false;
  int64_t d = 0;
#if defined(__AVX2__)
  __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (; d + 8 <= n; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(_mm256_and_ps(v, magnitude), vmax);  // a NaN lane keeps vmax (the 2nd operand)
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float lane : lanes) amax = std::max(amax, lane);
  any_nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; d < n; ++d) {
    any_nan |= std::isnan(x[d]);
    amax = std::max(amax, std::fabs(x[d]));
  }
  *non_finite = any_nan || std::isinf(amax);
  return amax;
}

// One row of n elements quantized by the reference's rule (ops/quant.py), bit for bit: per granule of
// `gran` elements, scale = amax / the format's largest value in fp32 (NaN if an element is not
// finite), stored at scales_out[granule], codes = x / scale clamped and rounded (all zero where the
// scale is not > 0); with groups == 0 the one static scale `static_scale` instead (nothing stored
// but codes, and no zero rule).
template <int FORMAT>
inline void quantize_row(const float* x, int64_t n, int64_t gran, int64_t groups, float static_scale,
                         float* scales_out, uint8_t* dst) {
  constexpr float top = fp8_largest(FORMAT);
  for (int64_t g0 = 0; g0 < n; g0 += gran) {
    float s = static_scale;
    if (groups) {
      bool non_finite;
      const float amax = abs_max(x + g0, gran, &non_finite);
      s = non_finite ? std::numeric_limits<float>::quiet_NaN() : amax / top;
      scales_out[g0 / gran] = s;
    }
    if (groups && !(s > 0.0f)) {
      std::memset(dst + g0, 0, gran);
    } else {
      quantize<FORMAT>(x + g0, gran, s, dst + g0);
    }
  }
}

}  // namespace
