// kinds.h: the storage kinds the kernels read (fp32, bf16, fp16, FP8 codes) and their loads,
// conversions and stores.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include "vec.h"

namespace {

enum DType : int {
  F32 = 0,
  BF16 = 1,
  F16 = 2,
  BF16_PAIRS = 3,
  FP8_E4M3FN = 4,
  FP8_E5M2 = 5,
  FP8_E4M3FN_DOT = 6,
  FP8_E5M2_DOT = 7
};
// BF16_PAIRS: bf16 storage read 2W elements at a time as two vectors, the even elements then the
// odd ones (a shift and a mask of one load, where the plain widening costs two per vector). The
// query rows and output accumulators are kept in that order too (row_slot), the accumulators put
// back in place at the end (interleave). Used when head_dim is a multiple of 2W.
// FP8_*: FP8 codes read 2W at a time as their exact fp32 values, each times its granule's scale as
// it is read (the reference's dequantized values, in registers; queries and output in fp32). Used
// when head_dim and the granule are multiples of 2W; other FP8 pools run as F32 on dequantized blocks.
// FP8_*_DOT: codes read the same way, with bf16 queries and output, the scores as bf16 dot products
// (bf16_dot) of the queries' values and the codes' (exact in bf16), each score then times its key's
// K scale and each probability its V scale (V read unscaled): for one scale per token and kv head or
// a static pair, with AVX512-BF16 and AVX512-VBMI.

template <int DT>
constexpr bool is_fp8() {
  return DT == FP8_E4M3FN || DT == FP8_E5M2 || DT == FP8_E4M3FN_DOT || DT == FP8_E5M2_DOT;
}

// Whether this build has the FP8_*_DOT kinds.
constexpr bool fp8_dot_kinds() {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  return true;
#else
  return false;
#endif
}

// Whether rows are only read with load2 (head_dim a multiple of 2W: no odd vector, no tail).
template <int DT>
constexpr bool whole_pairs() {
  return DT == BF16_PAIRS || is_fp8<DT>();
}

// The dtype of the queries and the output.
template <int DT>
constexpr int scalar_dtype() {
  return DT == BF16_PAIRS || DT == FP8_E4M3FN_DOT || DT == FP8_E5M2_DOT ? BF16 : is_fp8<DT>() ? F32 : DT;
}

// BF16_PAIRS and FP8_*_DOT score through AVX512-BF16's dot product (vdpbf16ps: 32 bf16 products a
// vector, exact, summed in fp32), on the queries' own bf16 values (unscaled; the scale multiplies
// the scores): half the multiply-adds of widening K, and no widening. (P V stays on widened V: P in
// bf16 would cost the output its last bit, measured by test_properties.)
template <int DT>
constexpr bool bf16_dot() {
#if defined(__AVX512BF16__)
  return DT == BF16_PAIRS || (fp8_dot_kinds() && (DT == FP8_E4M3FN_DOT || DT == FP8_E5M2_DOT));
#else
  return false;
#endif
}

template <int DT>
struct Storage {
  using T = std::conditional_t<DT == F32, float, std::conditional_t<is_fp8<DT>(), uint8_t, uint16_t>>;
};

enum Fp8 : int { NOT_FP8 = 0, E4M3FN = 1, E5M2 = 2 };

template <int DT>
constexpr int fp8_format() {
  return DT == FP8_E4M3FN || DT == FP8_E4M3FN_DOT ? E4M3FN : E5M2;
}

// The exact fp32 value of every FP8 code of one format (NaN codes give NaN, e5m2's inf codes inf).
struct Fp8Values {
  float value[256];
  Fp8Values(int mant, int bias, bool finite_only) {
    const int exp_mask = (1 << (7 - mant)) - 1, mant_mask = (1 << mant) - 1;
    for (int code = 0; code < 256; ++code) {
      const int e = (code >> mant) & exp_mask, m = code & mant_mask;
      float v;
      if (finite_only && e == exp_mask && m == mant_mask) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (!finite_only && e == exp_mask) {
        v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      } else if (e == 0) {
        v = std::ldexp(static_cast<float>(m), 1 - bias - mant);
      } else {
        v = std::ldexp(static_cast<float>(m + (1 << mant)), e - bias - mant);
      }
      value[code] = code & 0x80 ? -v : v;
    }
  }
};

inline const float* fp8_values(int format) {
  static const Fp8Values e4m3fn(3, 7, true), e5m2(2, 15, false);
  return format == E4M3FN ? e4m3fn.value : e5m2.value;
}

inline vf f16_bits_to_f32(vu h) {
  // fp16 -> fp32 for any value: shift exponent and mantissa into place, rebias by multiplying with
  // 2^112 (which also normalises subnormals), then restore inf/nan and the sign.
  vu em = h & 0x7fffu;
  vu shifted = em << 13;
  vf scaled = (vf)shifted * 0x1p112f;
  vu bits = (vu)scaled;
  bits = (em >= 0x7c00u) ? (shifted | 0x7f800000u) : bits;
  return (vf)(bits | ((h & 0x8000u) << 16));
}

typedef uint8_t vb __attribute__((vector_size(W)));

// fp16 bit patterns (W lanes) to fp32: exact for every value.
inline vf f16_to_f32(vh h) {
#if defined(__AVX512F__)
  __m256i bits;
  std::memcpy(&bits, &h, sizeof bits);
  return (vf)_mm512_cvtph_ps(bits);
#elif defined(__F16C__)
  __m128i bits;
  std::memcpy(&bits, &h, sizeof bits);
  return (vf)_mm256_cvtph_ps(bits);
#else
  return f16_bits_to_f32(__builtin_convertvector(h, vu));
#endif
}

// The exact fp32 values of the W FP8 codes at p, through fp16 (as fp8_values gives them one at a
// time): an e5m2 code is the top byte of the fp16 of the same value; an e4m3fn code's exponent and
// mantissa fit fp16's (its value / 2^8, subnormals included), its NaN code becoming an fp16 NaN.
template <int FORMAT>
inline vf fp8_to_f32(const uint8_t* p) {
  vb raw;
  std::memcpy(&raw, p, sizeof raw);
  const vh x = __builtin_convertvector(raw, vh);
  if constexpr (FORMAT == E5M2) {
    return f16_to_f32(x << 8);
  } else {
    const vh rest = x & 0x7F;
    vh h = ((x & 0x80) << 8) | (rest << 7);
    h = rest == 0x7F ? (h | 0x7E00) : h;
    return f16_to_f32(h) * 256.0f;  // exact: a power of two, far from overflow
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// FP8 codes (zero-extended to the 16-bit lanes of an __m256i or __m512i) as fp16 bit patterns: of
// the same value for e5m2 (its code is the fp16's top byte), of the value / 2^8 for e4m3fn (sign
// kept, exponent and mantissa one bit lower: they then fit fp16's, subnormals included; the NaN
// codes become fp16 NaNs). Three to five integer ops per vector, where fp8_to_f32's generic byte
// vectors compile to about fifteen per 8 codes.
template <int FORMAT, typename V>
inline V fp8_to_f16_bits(V x) {
  typedef int16_t lanes __attribute__((vector_size(sizeof(V))));
  const lanes top = (lanes)x << 8;
  if constexpr (FORMAT == E5M2) return (V)top;
  const lanes h = (top >> 1) & static_cast<int16_t>(0xBFFF);  // (arithmetic shift: the sign stays)
  return (V)((h << 1) == 0x7F00 ? (h | 0x7E00) : h);
}
#endif

#if defined(__AVX512VBMI__)
// The bf16 bit pattern of the value of FP8 magnitude c (codes 0-127), exact for both formats: their
// 3 or 2 mantissa bits fit bf16's 7 and their exponents (2^-9..448, 2^-16..57344) bf16's; NaN codes
// a NaN, e5m2's infinity inf.
constexpr uint16_t fp8_bf16_bits(int format, int c) {
  const int mant = format == E4M3FN ? 3 : 2, bias = format == E4M3FN ? 7 : 15;
  const int e = c >> mant, m = c & ((1 << mant) - 1);
  if (format == E4M3FN ? c == 127 : (e == 31 && m)) return 0x7FC0;
  if (format == E5M2 && e == 31) return 0x7F80;
  if (e > 0) return static_cast<uint16_t>(((e - bias + 127) << 7) | (m << (7 - mant)));
  if (m == 0) return 0;
  // a subnormal: m * 2^(1 - bias - mant) = (m / 2^top) * 2^(top + 1 - bias - mant), m / 2^top in [1, 2)
  const int top = m >= 4 ? 2 : m >= 2 ? 1 : 0;
  return static_cast<uint16_t>(((top + 1 - bias - mant + 127) << 7) | ((m - (1 << top)) << (7 - top)));
}

// Those patterns' high and low bytes: 128-byte tables for two-register byte permutes.
struct Fp8Bf16Bytes {
  alignas(64) uint8_t high[128] = {};
  alignas(64) uint8_t low[128] = {};
  constexpr explicit Fp8Bf16Bytes(int format) {
    for (int c = 0; c < 128; ++c) {
      high[c] = static_cast<uint8_t>(fp8_bf16_bits(format, c) >> 8);
      low[c] = static_cast<uint8_t>(fp8_bf16_bits(format, c));
    }
  }
};
constexpr Fp8Bf16Bytes E4M3FN_BF16{E4M3FN}, E5M2_BF16{E5M2};

// The bf16 patterns of the values of the 2W FP8 codes at p, one per 16-bit lane: code spread[2i] (the
// byte index of lane i's low byte; its high byte's index must be the same) in lane i. One byte
// permute spreads the codes, two table permutes give each lane its pattern's high, then low byte,
// and a ternary op restores the signs.
template <int FORMAT>
inline __m512i fp8_bf16_lanes(const uint8_t* p, __m512i spread) {
  const Fp8Bf16Bytes& t = FORMAT == E4M3FN ? E4M3FN_BF16 : E5M2_BF16;
  const __m512i codes = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i x = _mm512_permutexvar_epi8(spread, codes);
  const __m512i high = _mm512_mask2_permutex2var_epi8(_mm512_load_si512(t.high), x, 0xAAAAAAAAAAAAAAAAull,
                                                       _mm512_load_si512(t.high + 64));  // odd bytes
  const __m512i both = _mm512_mask2_permutex2var_epi8(_mm512_load_si512(t.low), high, 0x5555555555555555ull,
                                                       _mm512_load_si512(t.low + 64));  // even bytes
  return _mm512_ternarylogic_epi32(both, x, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
}

// Byte indices for fp8_bf16_lanes: codes in order (for bf16 dot products).
inline __m512i fp8_spread_in_order() {
  return _mm512_set_epi32(0x1F1F1E1E, 0x1D1D1C1C, 0x1B1B1A1A, 0x19191818, 0x17171616, 0x15151414, 0x13131212,
                          0x11111010, 0x0F0F0E0E, 0x0D0D0C0C, 0x0B0B0A0A, 0x09090808, 0x07070606, 0x05050404,
                          0x03030202, 0x01010000);
}

// The exact fp32 values of the 2W FP8 codes at p, in order: code i and code i + W in the low and high
// halves of 32-bit lane i as bf16 patterns, widened by a shift and a mask.
template <int FORMAT>
inline void fp8_load2_vbmi(const uint8_t* p, vf& a, vf& b) {
  const __m512i spread = _mm512_set_epi32(0x1F1F0F0F, 0x1E1E0E0E, 0x1D1D0D0D, 0x1C1C0C0C, 0x1B1B0B0B, 0x1A1A0A0A,
                                          0x19190909, 0x18180808, 0x17170707, 0x16160606, 0x15150505, 0x14140404,
                                          0x13130303, 0x12120202, 0x11110101, 0x10100000);
  const __m512i bits = fp8_bf16_lanes<FORMAT>(p, spread);
  a = (vf)_mm512_slli_epi32(bits, 16);
  b = (vf)_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
#endif

// dst[0, n) = the bf16 patterns of the values of the FP8 codes src[0, n) (exact; n a multiple of
// 2W). Only FP8_*_DOT's staged blocks call it, which need AVX512-VBMI.
template <int FORMAT>
inline void fp8_to_bf16(const uint8_t* src, int64_t n, uint16_t* dst) {
#if defined(__AVX512VBMI__)
  for (int64_t e = 0; e < n; e += 2 * W) {
    _mm512_storeu_si512(dst + e, fp8_bf16_lanes<FORMAT>(src + e, fp8_spread_in_order()));
  }
#else
  static_assert(FORMAT < 0, "FP8_*_DOT needs AVX512-VBMI");
#endif
}

// dst[0, n) = the values of the FP8 codes src[0, n) times s (the reference's fp32 product). With
// AVX512-VBMI e4m3fn takes 2W codes at a time as fp8_load2 reads them; otherwise the
// 16- and 8-code paths multiply value / 2^8 by s * 2^8 for e4m3fn: the same real product, so the same
// rounding (s * 2^8 is exact short of overflow, which takes the generic path).
template <int FORMAT>
inline void dequantize(const uint8_t* src, int64_t n, float s, float* dst) {
  int64_t e = 0;
#if defined(__AVX512VBMI__)
  if constexpr (FORMAT == E4M3FN) {
    for (; e + 2 * W <= n; e += 2 * W) {
      vf a, b;
      fp8_load2_vbmi<E4M3FN>(src + e, a, b);
      store_f32(dst + e, a * splat(s));
      store_f32(dst + e + W, b * splat(s));
    }
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  const float mul = FORMAT == E4M3FN ? s * 256.0f : s;
  if (std::isfinite(mul) || !std::isfinite(s)) {
    for (; e + 16 <= n; e += 16) {
      const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)));
      const __m256i h = fp8_to_f16_bits<FORMAT>(codes);
#if defined(__AVX512F__)
      store_f32(dst + e, (vf)_mm512_cvtph_ps(h) * splat(mul));
#else
      store_f32(dst + e, (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(h)) * splat(mul));
      store_f32(dst + e + 8, (vf)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)) * splat(mul));
#endif
    }
    for (; e + 8 <= n; e += 8) {  // (granules of 8)
      const __m128i codes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + e)));
      _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_cvtph_ps(fp8_to_f16_bits<FORMAT>(codes)), _mm256_set1_ps(mul)));
    }
  }
#endif
  for (; e + W <= n; e += W) store_f32(dst + e, fp8_to_f32<FORMAT>(src + e) * splat(s));
  const float* values = fp8_values(FORMAT);
  for (; e < n; ++e) dst[e] = values[src[e]] * s;
}

template <int DT>
inline vf load(const typename Storage<DT>::T* p) {
  static_assert(DT != BF16_PAIRS, "BF16_PAIRS is read with load2");
  if constexpr (DT == F32) {
    return load_f32(p);
  } else if constexpr (DT == BF16) {
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
    vh h;
    std::memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
  } else {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    vh h;
    std::memcpy(&h, p, sizeof h);
    return f16_bits_to_f32(__builtin_convertvector(h, vu));
#endif
  }
}

// The exact fp32 values of the 2W FP8 codes at p (unscaled), as two vectors in order.
template <int FORMAT>
inline void fp8_load2(const uint8_t* p, vf& a, vf& b) {
#if defined(__AVX512VBMI__)
  if constexpr (FORMAT == E4M3FN) {  // (e5m2's fp16 route below takes fewer steps)
    fp8_load2_vbmi<E4M3FN>(p, a, b);
    return;
  }
#endif
#if defined(__AVX512BW__)
  const __m512i h = fp8_to_f16_bits<FORMAT>(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  a = (vf)_mm512_cvtph_ps(_mm512_castsi512_si256(h));
  b = (vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
  const __m256i h = fp8_to_f16_bits<FORMAT>(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  a = (vf)_mm256_cvtph_ps(_mm256_castsi256_si128(h));
  b = (vf)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#else
  a = fp8_to_f32<FORMAT>(p);  // (exact values already)
  b = fp8_to_f32<FORMAT>(p + W);
  return;
#endif
  if constexpr (FORMAT == E4M3FN) {  // the codes' values / 2^8: times 2^8, exact
    a *= 256.0f;
    b *= 256.0f;
  }
}

// 2W consecutive elements at p as two vectors: in order, or for BF16_PAIRS the even then the odd ones.
template <int DT>
inline void load2(const typename Storage<DT>::T* p, vf& a, vf& b) {
  if constexpr (DT == BF16_PAIRS) {
    vu x;
    std::memcpy(&x, p, sizeof x);  // W little-endian pairs: element 2i in the low half of lane i
    a = (vf)(x << 16);
    b = (vf)(x & 0xffff0000u);
  } else if constexpr (is_fp8<DT>()) {
    fp8_load2<fp8_format<DT>()>(p, a, b);
  } else {
    a = load<DT>(p);
    b = load<DT>(p + W);
  }
}

#if defined(__AVX512BF16__)
// bf16_dot kinds: the 2W elements at p as bf16 patterns, in order (FP8_*_DOT: the codes' values).
template <int DT>
inline __m512i bf16_lanes(const typename Storage<DT>::T* p) {
  if constexpr (DT == BF16_PAIRS) {
    return _mm512_loadu_si512(p);
  } else {
#if defined(__AVX512VBMI__)
    return fp8_bf16_lanes<fp8_format<DT>()>(p, fp8_spread_in_order());
#else
    static_assert(DT == BF16_PAIRS, "FP8_*_DOT needs AVX512-VBMI");
#endif
  }
}
#endif

// The first n < W elements at p, zeros after (never reads past p + n).
template <int DT>
inline vf load_part(const typename Storage<DT>::T* p, int n) {
  typename Storage<DT>::T tmp[W] = {};
  std::memcpy(tmp, p, n * sizeof(*p));
  return load<DT>(tmp);
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);  // inf, nan
  if (ax >= 0x477ff000u) return sign | 0x7c00u;                                      // rounds to inf
  if (ax < 0x38800000u) {  // fp16 subnormal or zero: adding 0.5 rounds to a multiple of 2^-24
    float v;
    std::memcpy(&v, &ax, 4);
    v += 0.5f;
    uint32_t r;
    std::memcpy(&r, &v, 4);
    return static_cast<uint16_t>(sign | (r - 0x3f000000u));
  }
  ax += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((ax >> 13) & 1u);  // rebias, round to nearest even
  return static_cast<uint16_t>(sign | (ax >> 13));
#endif
}

template <int DT>
inline void store_out(typename Storage<DT>::T* p, const float* x, int n, float mul) {
  for (int i = 0; i < n; ++i) {
    float v = x[i] * mul;
    if constexpr (DT == F32) {
      p[i] = v;
    } else if constexpr (DT == BF16) {
      p[i] = f32_to_bf16(v);
    } else {
      p[i] = f32_to_f16(v);
    }
  }
}

template <int DT>
inline float load_scalar(const typename Storage<DT>::T* p) {
  if constexpr (DT == F32) {
    return *p;
  } else if constexpr (DT == BF16) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    vu h = vu{} + static_cast<uint32_t>(*p);
    return f16_bits_to_f32(h)[0];
  }
}

// dst[0, n) = the fp32 values of the n elements at p (fp32, bf16 or fp16), exactly.
template <int DT>
inline void widen(const typename Storage<DT>::T* p, int64_t n, float* dst) {
  int64_t d = 0;
  for (; d + W <= n; d += W) store_f32(dst + d, load<DT>(p + d));
  for (; d < n; ++d) dst[d] = load_scalar<DT>(p + d);
}

// Where column d of a query row or accumulator lives: d itself, or for BF16_PAIRS the slot that
// load2 gives element d of its 2W-element group.
template <int DT>
inline int64_t row_slot(int64_t d) {
  if constexpr (DT == BF16_PAIRS) {
    const int64_t base = d / (2 * W) * (2 * W), i = d % (2 * W);
    return base + (i % 2) * W + i / 2;
  } else {
    return d;
  }
}

}  // namespace
