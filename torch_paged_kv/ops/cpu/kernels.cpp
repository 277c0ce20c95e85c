// The `cpu` backend's kernels: paged attention that reads K/V in place from the pages, store_kv,
// gather_kv and copy_pages.
//
// Built on first use by build.py with the system C++ compiler (-O3 -march=native, OpenMP when the
// compiler has it) into a shared library cached on disk, and called through ctypes: no torch
// headers, so it compiles in about a second and does not depend on torch's C++ ABI. The Python
// side (kernels.py) passes data pointers, sizes and strides (in elements); inputs are validated
// there (torch_paged_kv.ops.validate) before these run. Every kernel still keeps its reads and
// writes inside `blocks`: page ids out of range are clamped on reads and skipped on writes, and
// the null page 0 is never written (the `.unchecked` overloads skip the value checks).
//
// Attention, per work item (one sequence, one kv head, a block of its new tokens, a range of key
// positions): the item's query rows (token x GQA head) are converted to fp32 and pre-scaled; key
// positions are walked in blocks of KEY_BLOCK through the lookup table (row pointers into the
// pages, no copy); per block, scores = Q K^T with fp32 accumulation, softcap, the contract's mask
// (causal / window / lengths), an online softmax, and O += P V. Long key ranges are split across
// items when there are too few items for the threads, and the splits merged after. Storage
// dtypes: fp32, bf16, fp16, converted to fp32 as they are loaded (`load`, `load2`, `load_part`);
// with AVX512-BF16, bf16 rows are multiplied as they lie instead (`bf16_dot`). A kv head with at
// least 2W query rows in an item (W for fp32 with AVX-512; prefill) takes the keys-major tiles
// instead of the dot-product ones: queries and accumulators transposed, rows along the lanes
// (`qk_keys_major`, `pv_keys_major`).
// FP8 caches (e4m3fn, e5m2): the dot-product tiles read the codes as their exact values times their
// scales (FP8_* kinds, below); prefill-shaped items, and granules or head dims those tiles do not
// take, have each key block's rows dequantized (a code's exact value times its scale, the
// reference's fp32 product) into a per-thread fp32 block, which the fp32 path then reads; queries
// and output are fp32 (kernels.py converts).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__unix__)
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
#else
constexpr int W = 8;
#endif
constexpr int KEY_BLOCK = 128;  // most key positions per softmax block (a multiple of W)
constexpr int ROW_TILE = 4;     // query rows per micro-kernel tile
// Ahead's prefetches go to L1 (prefetcht0) where the L1 data cache holds 48 KiB or more, else to
// L2 (prefetcht1). Decode steps, interleaved A/B: on a Zen 5 (48 KiB L1d) prefetcht0 ran 3-8%
// faster than prefetcht1; on a Zen 4 (32 KiB) 1.35-1.41x slower, the read-ahead of a key block
// (up to 64 KiB of K) evicting the rows in use.
#if defined(_SC_LEVEL1_DCACHE_SIZE)
const bool PREFETCH_TO_L1 = sysconf(_SC_LEVEL1_DCACHE_SIZE) >= (48 << 10);
#else
const bool PREFETCH_TO_L1 = false;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef float v8 __attribute__((vector_size(32)));

enum DType : int { F32 = 0, BF16 = 1, F16 = 2, BF16_PAIRS = 3, FP8_E4M3FN = 4, FP8_E5M2 = 5 };
// BF16_PAIRS: bf16 storage read 2W elements at a time as two vectors, the even elements then the
// odd ones (a shift and a mask of one load, where the plain widening costs two per vector). The
// query rows and output accumulators are kept in that order too (row_order / natural_order) and
// put back in place at the end. Used when head_dim is a multiple of 2W.
// FP8_*: FP8 codes read 2W at a time as their exact fp32 values, each times its granule's scale as
// it is read (the reference's dequantized values, in registers; queries and output in fp32). Used
// when head_dim and the granule are multiples of 2W; other FP8 pools run as F32 on dequantized blocks.

template <int DT>
constexpr bool is_fp8() {
  return DT == FP8_E4M3FN || DT == FP8_E5M2;
}

// Whether rows are only read with load2 (head_dim a multiple of 2W: no odd vector, no tail).
template <int DT>
constexpr bool whole_pairs() {
  return DT == BF16_PAIRS || is_fp8<DT>();
}

// The dtype of the queries and the output.
template <int DT>
constexpr int scalar_dtype() {
  return DT == BF16_PAIRS ? BF16 : is_fp8<DT>() ? F32 : DT;
}

// BF16_PAIRS scores through AVX512-BF16's dot product (vdpbf16ps: 32 bf16 products a vector,
// exact, summed in fp32), on the queries' own bf16 values (unscaled; the scale multiplies the
// scores): half the multiply-adds of widening K, and no widening. (P V stays on widened V: P in
// bf16 would cost the output its last bit, measured by test_properties.)
template <int DT>
constexpr bool bf16_dot() {
#if defined(__AVX512BF16__)
  return DT == BF16_PAIRS;
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
  return DT == FP8_E4M3FN ? E4M3FN : E5M2;
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

inline vf splat(float x) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vf)_mm256_set1_ps(x);
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
#endif
}

inline vf load_f32(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_f32(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

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

// dst[0, n) = the values of the FP8 codes src[0, n) times s (the reference's fp32 product). The
// 16- and 8-code paths multiply value / 2^8 by s * 2^8 for e4m3fn: the same real product, so the same
// rounding (s * 2^8 is exact short of overflow, which takes the generic path).
template <int FORMAT>
inline void dequantize(const uint8_t* src, int64_t n, float s, float* dst) {
  int64_t e = 0;
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

// exp(x), about 2 ulp (Cephes' polynomial); 0 below -87.3 (so exp(-inf) = 0), capped above 88.
__attribute__((always_inline)) inline vf vexp(vf x) {
  vi under = x < -87.3f;
  x = (x > 88.0f) ? splat(88.0f) : x;
  x = under ? splat(-87.3f) : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  vf t = x * 1.44269504088896341f + magic;
  vf n = t - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * r * r + r + 1.0f;
  vi e = (vi)t - (vi)splat(magic);
  y = y * (vf)((e + 127) << 23);
  return under ? splat(0.0f) : y;
}

// softcap * tanh(x / softcap), through exp(-2|y|) (no overflow, absolute error ~1e-7 * softcap).
inline vf vsoftcap(vf x, float softcap) {
  vf y = x * (1.0f / softcap);
  vi negative = y < 0.0f;
  vf a = negative ? -y : y;
  vf e = vexp(a * -2.0f);
  vf t = (1.0f - e) / (1.0f + e);
  return (negative ? -t : t) * softcap;
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

inline v8 to8(vf a) {  // (#if: a discarded `if constexpr` branch outside a template must still compile)
#if defined(__AVX512F__)
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a;
#endif
}

// out[i] = sum of a[i]'s lanes, for 8 vectors at once (a transposing add tree).
__attribute__((always_inline)) inline void hsum8(const vf* a, float* out) {
  v8 b[8];
  for (int i = 0; i < 8; ++i) b[i] = to8(a[i]);
  v8 x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 8, 1, 9, 2, 10, 3, 11) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 12, 5, 13, 6, 14, 7, 15);
  }
  v8 y[2];
  for (int i = 0; i < 2; ++i) {
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 8, 9, 2, 3, 10, 11) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 12, 13, 6, 7, 14, 15);
  }
  v8 z = __builtin_shufflevector(y[0], y[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(y[0], y[1], 4, 5, 6, 7, 12, 13, 14, 15);
  std::memcpy(out, &z, sizeof z);
}

// a and b interleaved (a0 b0 a1 b1 ...): lanes 0 .. W/2 - 1 of each into lo, the upper halves into hi.
inline void interleave(vf a, vf b, vf& lo, vf& hi) {
#if defined(__AVX512F__)
  lo = __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  hi = __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
  lo = __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11);
  hi = __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
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

// FP8_*: the scales of a list of keys (each from kv head h0's first granule) and the elements per
// granule (a multiple of 2W dividing head_dim; a static pair: one granule spanning the item's heads).
// Unused by the other kinds.
struct Granules {
  const float* const* scales = nullptr;
  int64_t size = 0;
};

// S[r * ldS + t] = q_r . k_t for RT rows of `q` (fp32, row stride Dp, zero padded) and NT keys (for
// FP8_*: keys of the codes' values times their granules' scales, `gr` from the first key).
template <int DT, int RT, int NT>
inline void qk_tile(const float* q, int64_t Dp, const typename Storage<DT>::T* const* kp, int64_t ofs, int nfull,
                    int tail, float* S, int64_t ldS, Granules gr) {
  using T = typename Storage<DT>::T;
  const T* rows[NT];
  for (int t = 0; t < NT; ++t) rows[t] = kp[t] + ofs;
#if defined(__AVX512BF16__)
  if constexpr (bf16_dot<DT>()) {  // q rows hold bf16 values (row stride Dp floats); nfull is even
    __m512 acc[RT * NT];
    for (int i = 0; i < RT * NT; ++i) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < nfull; j += 2) {
      __m512bh k[NT];
      for (int t = 0; t < NT; ++t) k[t] = (__m512bh)_mm512_loadu_si512(rows[t] + j * W);
      for (int r = 0; r < RT; ++r) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(q + r * Dp) + j * W);
        for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_dpbf16_ps(acc[r * NT + t], qv, k[t]);
      }
    }
    float s[RT * NT];
    if constexpr (RT * NT == 8) {
      hsum8(reinterpret_cast<const vf*>(acc), s);
    } else {
      for (int i = 0; i < RT * NT; ++i) s[i] = _mm512_reduce_add_ps(acc[i]);
    }
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < NT; ++t) S[r * ldS + t] = s[r * NT + t];
    return;
  }
#endif
  const float* scale[NT];  // FP8_*: each key's scale of the granule at column j
  const int64_t pairs = is_fp8<DT>() ? gr.size / (2 * W) : 0;  // load2 calls per granule
  int64_t left = pairs;
  if constexpr (is_fp8<DT>()) {
    for (int t = 0; t < NT; ++t) scale[t] = gr.scales[t] + ofs / gr.size;
  }
  vf acc[RT * NT];
  for (int i = 0; i < RT * NT; ++i) acc[i] = vf{};
  int j = 0;
  for (; j + 2 <= nfull; j += 2) {
    vf k0[NT], k1[NT];
    for (int t = 0; t < NT; ++t) load2<DT>(rows[t] + j * W, k0[t], k1[t]);
    if constexpr (is_fp8<DT>()) {
      for (int t = 0; t < NT; ++t) {
        const vf s = splat(*scale[t]);
        k0[t] *= s;
        k1[t] *= s;
      }
      if (--left == 0) {
        left = pairs;
        for (int t = 0; t < NT; ++t) ++scale[t];
      }
    }
    for (int r = 0; r < RT; ++r) {
      vf q0 = load_f32(q + r * Dp + j * W), q1 = load_f32(q + r * Dp + (j + 1) * W);
      for (int t = 0; t < NT; ++t) {
        acc[r * NT + t] += q0 * k0[t];
        acc[r * NT + t] += q1 * k1[t];
      }
    }
  }
  if constexpr (!whole_pairs<DT>()) {
    if (j < nfull) {
      vf k[NT];
      for (int t = 0; t < NT; ++t) k[t] = load<DT>(rows[t] + j * W);
      for (int r = 0; r < RT; ++r) {
        vf qv = load_f32(q + r * Dp + j * W);
        for (int t = 0; t < NT; ++t) acc[r * NT + t] += qv * k[t];
      }
    }
  }
  if constexpr (!whole_pairs<DT>()) {
    if (tail) {
      vf k[NT];
      for (int t = 0; t < NT; ++t) k[t] = load_part<scalar_dtype<DT>()>(rows[t] + nfull * W, tail);
      for (int r = 0; r < RT; ++r) {
        vf qv = load_f32(q + r * Dp + nfull * W);
        for (int t = 0; t < NT; ++t) acc[r * NT + t] += qv * k[t];
      }
    }
  }
  if constexpr (RT * NT == 8) {
    float s[8];
    hsum8(acc, s);
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < NT; ++t) S[r * ldS + t] = s[r * NT + t];
  } else {
    for (int r = 0; r < RT; ++r)
      for (int t = 0; t < NT; ++t) S[r * ldS + t] = hsum(acc[r * NT + t]);
  }
}

// Rows the memory is asked for ahead of their use, PIECE bytes at a time, `quota` pieces per call
// of `step`, in address order (row by row, each from its first byte). The item's loops call `step`
// between micro-kernel tiles, so the fetches spread over the work they overlap: a burst of
// thousands of prefetches stalls the core until all are issued. Out of line: inlined into the
// tile loops it cost the tiles their register allocation (12-15% of a decode step with every page
// in cache, measured).
struct Ahead {
  static constexpr int64_t PIECE = 256;
  const void* const* rows = nullptr;
  int n = 0;              // rows to fetch (0: nothing)
  int64_t row_bytes = 0;  // of one row (the item's kv heads)
  int64_t quota = 0;      // pieces per step
  int row = 0;            // the next piece: row and byte in it
  int64_t byte = 0;

  // Fetch `count` rows of `bytes` over `steps` calls of step().
  void start(const void* const* r, int count, int64_t bytes, int64_t steps) {
    rows = r;
    n = count;
    row_bytes = bytes;
    steps = std::max<int64_t>(steps, 1);
    quota = (count * ((bytes + PIECE - 1) / PIECE) + steps - 1) / steps;
  }

  __attribute__((noinline)) void step() {
    for (int64_t left = quota; left > 0 && row < n; --left) {
      const char* p = static_cast<const char*>(rows[row]) + byte;
      if (PREFETCH_TO_L1) {
        for (int64_t c = 0; c < PIECE; c += 64) __builtin_prefetch(p + c, 0, 3);
      } else {
        for (int64_t c = 0; c < PIECE; c += 64) __builtin_prefetch(p + c, 0, 2);
      }
      byte += PIECE;
      if (byte >= row_bytes) {
        byte = 0;
        ++row;
      }
    }
  }
};

// The first L1_AHEAD bytes of `count` key rows (from element `ofs`) into L1: qk_rows asks for the
// next tile's rows while a tile computes, where the hardware's prefetchers miss the jump between
// rows (measured, interleaved A/B: a decode step 2-6% faster in bf16, 1-4% in fp32; fetching all
// of an fp32 row was slower).
constexpr int64_t L1_AHEAD = 256;

template <typename T>
inline void prefetch_rows_l1(const T* const* rows, int count, int64_t ofs) {
  for (int t = 0; t < count; ++t) {
    const char* p = reinterpret_cast<const char*>(rows[t] + ofs);
    for (int64_t c = 0; c < L1_AHEAD; c += 64) __builtin_prefetch(p + c, 0, 3);
  }
}

template <int DT, int RT>
inline void qk_rows(const float* q, int64_t Dp, const void* const* kp, int64_t ofs, int n, int nfull, int tail,
                    float* S, int64_t ldS, Granules gr, Ahead& ahead) {
  using T = typename Storage<DT>::T;
  const T* const* rows = reinterpret_cast<const T* const*>(kp);
  constexpr int NT = 8 / RT > 0 ? 8 / RT : 1;
  int t = 0;
  if constexpr (NT > 1) {
    for (; t + NT <= n; t += NT) {
      if (t + 2 * NT <= n) prefetch_rows_l1(rows + t + NT, NT, ofs);
      qk_tile<DT, RT, NT>(q, Dp, rows + t, ofs, nfull, tail, S + t, ldS, {gr.scales + t, gr.size});
      ahead.step();
    }
  }
  for (; t < n; ++t) {
    qk_tile<DT, RT, 1>(q, Dp, rows + t, ofs, nfull, tail, S + t, ldS, {gr.scales + t, gr.size});
    ahead.step();
  }
}

// O[r] += sum_t P[r * ldS + t] * v_t for RT rows of O (fp32, row stride Dp) over n keys (for
// FP8_*: v_t's codes' values times their granules' scales, `gr` from the first key), a few
// keys at a time: the rows of a block sit kv_heads * head_dim elements apart (a power of two,
// often), so walking one column slice through all of them would evict each from L1 before the
// next slice; a group of PV_GROUP rows stays in L1 while its slices are consumed.
constexpr int PV_GROUP = 16;
constexpr int CHUNK = 16;  // keys per pass through every row tile of an item (see attend_item)

template <int DT, int RT>
inline void pv_rows(const float* P, int64_t ldS, const void* const* vrows, int64_t ofs, int n, int nfull, int tail,
                    float* O, int64_t Dp, Granules gr, Ahead& ahead) {
  using T = typename Storage<DT>::T;
  const T* vp[PV_GROUP];
  for (int t0 = 0; t0 < n; t0 += PV_GROUP) {
    for (int t = t0; t < std::min(n, t0 + PV_GROUP); ++t) vp[t - t0] = static_cast<const T*>(vrows[t]) + ofs;
    const int t1 = std::min(n, t0 + PV_GROUP);
    int j = 0;
    for (; j + 2 <= nfull; j += 2) {
      vf acc[RT][2];
      for (int r = 0; r < RT; ++r) {
        acc[r][0] = load_f32(O + r * Dp + j * W);
        acc[r][1] = load_f32(O + r * Dp + (j + 1) * W);
      }
      const int64_t at = is_fp8<DT>() ? (ofs + j * W) / gr.size : 0;  // FP8_*: the granule of columns j, j + 1
      for (int t = t0; t < t1; ++t) {
        vf v0, v1;
        load2<DT>(vp[t - t0] + j * W, v0, v1);
        if constexpr (is_fp8<DT>()) {
          const vf s = splat(gr.scales[t][at]);
          v0 *= s;
          v1 *= s;
        }
        for (int r = 0; r < RT; ++r) {
          vf p = splat(P[r * ldS + t]);
          acc[r][0] += p * v0;
          acc[r][1] += p * v1;
        }
      }
      for (int r = 0; r < RT; ++r) {
        store_f32(O + r * Dp + j * W, acc[r][0]);
        store_f32(O + r * Dp + (j + 1) * W, acc[r][1]);
      }
      ahead.step();
    }
    if constexpr (!whole_pairs<DT>()) {  // else head_dim is a multiple of 2W
      constexpr int SDT = scalar_dtype<DT>();
      const int last = (j < nfull ? 1 : 0) + (tail ? 1 : 0);  // one full vector left, a partial one, or both
      for (int step = 0; step < last; ++step, ++j) {
        const bool partial = j == nfull;
        vf acc[RT];
        for (int r = 0; r < RT; ++r) acc[r] = load_f32(O + r * Dp + j * W);
        for (int t = t0; t < t1; ++t) {
          vf v = partial ? load_part<SDT>(vp[t - t0] + j * W, tail) : load<SDT>(vp[t - t0] + j * W);
          for (int r = 0; r < RT; ++r) acc[r] += splat(P[r * ldS + t]) * v;
        }
        for (int r = 0; r < RT; ++r) store_f32(O + r * Dp + j * W, acc[r]);
      }
    }
  }
}

// Prefill-shaped items (a kv head with at least W query rows) compute scores keys-major, as outer
// products: the head's query rows are transposed once per item into Qt ([head_dim][rows rounded
// up to W], rows along the lanes), and each key element, broadcast, multiplies a vector of W rows'
// query elements. No horizontal sums, and each key element loaded feeds KM_RV * W rows (the
// dot-product tile above feeds ROW_TILE). P = softmax(S) stays keys-major, St[t][r], for P V.
// P V likewise keeps the accumulators transposed, Ot[d][r]: each V element, broadcast, times a
// vector of W rows' probabilities.
#if defined(__AVX512F__)
constexpr int KM_RV = 4, KM_NT = 6, KM_ND = 6;  // row vectors x keys (x columns): 24 accumulators of 32 registers
#else
constexpr int KM_RV = 2, KM_NT = 6, KM_ND = 6;  // 12 accumulators of 16 registers (2 x 4: 1.5x slower)
#endif

// Element 0 of p as fp32 in every lane.
template <int DT>
inline vf bcast(const typename Storage<DT>::T* p) {
  if constexpr (DT == F32) {
    return splat(*p);
  } else if constexpr (scalar_dtype<DT>() == F16) {
#if defined(__F16C__)
    return splat(_cvtsh_ss(*p));
#else
    return splat(load_scalar<F16>(p));
#endif
  } else {
    return splat(load_scalar<BF16>(p));
  }
}

// St[t * ldS + v * W + lane] = sum_d Qt[d][v * W + lane] * k_t[d] for RV row vectors of Qt (ldq
// lanes per d) and NT keys (rows kp[t] + ofs). bf16_dot kinds: Qt holds bf16 pairs (d, d + 1), ldq
// pairs per pair of d.
template <int DT, int RV, int NT>
inline void qk_tile_km(const float* qt, int64_t ldq, const typename Storage<DT>::T* const* kp, int64_t ofs,
                       int64_t D, float* St, int64_t ldS) {
  using T = typename Storage<DT>::T;
  const T* rows[NT];
  for (int t = 0; t < NT; ++t) rows[t] = kp[t] + ofs;
#if defined(__AVX512BF16__)
  if constexpr (bf16_dot<DT>()) {
    const uint32_t* q2 = reinterpret_cast<const uint32_t*>(qt);
    __m512 acc[NT][RV];
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
      __m512bh q[RV];
      for (int v = 0; v < RV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(q2 + (d / 2) * ldq + v * W);
      for (int t = 0; t < NT; ++t) {
        uint32_t pair;
        std::memcpy(&pair, rows[t] + d, sizeof pair);
        const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], q[v], k);
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(St + t * ldS + v * W, acc[t][v]);
    return;
  }
#endif
  vf acc[NT][RV];
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf q[RV];
    for (int v = 0; v < RV; ++v) q[v] = load_f32(qt + d * ldq + v * W);
    for (int t = 0; t < NT; ++t) {
      const vf k = bcast<DT>(rows[t] + d);
      for (int v = 0; v < RV; ++v) acc[t][v] += k * q[v];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < RV; ++v) store_f32(St + t * ldS + v * W, acc[t][v]);
}

template <int DT, int NT>
inline void qk_tile_km_rv(int rv, const float* qt, int64_t ldq, const typename Storage<DT>::T* const* kp,
                          int64_t ofs, int64_t D, float* St, int64_t ldS) {
  switch (rv) {
    case 1: qk_tile_km<DT, 1, NT>(qt, ldq, kp, ofs, D, St, ldS); break;
    case 2: qk_tile_km<DT, 2, NT>(qt, ldq, kp, ofs, D, St, ldS); break;
    case 3: qk_tile_km<DT, 3, NT>(qt, ldq, kp, ofs, D, St, ldS); break;
    default: qk_tile_km<DT, KM_RV, NT>(qt, ldq, kp, ofs, D, St, ldS); break;
  }
}

// St[t * ldS + r] = q_r . k_t for the nv row vectors of Qt and n keys, keys-major.
template <int DT>
inline void qk_keys_major(const float* qt, int64_t ldq, int nv, const void* const* kp, int64_t ofs, int n, int64_t D,
                          float* St, int64_t ldS, Ahead& ahead) {
  using T = typename Storage<DT>::T;
  const T* const* rows = reinterpret_cast<const T* const*>(kp);
  for (int v0 = 0; v0 < nv; v0 += KM_RV) {
    const int rv = std::min(KM_RV, nv - v0);
    const float* q = qt + v0 * W;  // (bf16 pairs: W pairs per vector, the same offset)
    float* st = St + v0 * W;
    int t = 0;
    for (; t + KM_NT <= n; t += KM_NT) {
      qk_tile_km_rv<DT, KM_NT>(rv, q, ldq, rows + t, ofs, D, st + t * ldS, ldS);
      ahead.step();
    }
    for (; t + 2 <= n; t += 2) qk_tile_km_rv<DT, 2>(rv, q, ldq, rows + t, ofs, D, st + t * ldS, ldS);
    for (; t < n; ++t) qk_tile_km_rv<DT, 1>(rv, q, ldq, rows + t, ofs, D, st + t * ldS, ldS);
  }
}

// Ot[j * ldo + v * W + lane] = Ot[...] * alpha[v * W + lane] + sum_t Pt[t * ldp + v * W + lane] * v_t[j]
// for RV row vectors, ND columns j of n V rows (vrows[t] + ofs).
template <int DT, int RV, int ND>
inline void pv_tile_km(const float* pt, int64_t ldp, const typename Storage<DT>::T* const* vrows, int64_t ofs, int n,
                       const float* alpha, float* ot, int64_t ldo) {
  vf acc[ND][RV];
  for (int j = 0; j < ND; ++j)
    for (int v = 0; v < RV; ++v) acc[j][v] = load_f32(ot + j * ldo + v * W) * load_f32(alpha + v * W);
  for (int t = 0; t < n; ++t) {
    vf p[RV];
    for (int v = 0; v < RV; ++v) p[v] = load_f32(pt + t * ldp + v * W);
    const typename Storage<DT>::T* row = vrows[t] + ofs;
    for (int j = 0; j < ND; ++j) {
      const vf x = bcast<DT>(row + j);
      for (int v = 0; v < RV; ++v) acc[j][v] += x * p[v];
    }
  }
  for (int j = 0; j < ND; ++j)
    for (int v = 0; v < RV; ++v) store_f32(ot + j * ldo + v * W, acc[j][v]);
}

template <int DT, int ND>
inline void pv_tile_km_rv(int rv, const float* pt, int64_t ldp, const typename Storage<DT>::T* const* vrows,
                          int64_t ofs, int n, const float* alpha, float* ot, int64_t ldo) {
  switch (rv) {
    case 1: pv_tile_km<DT, 1, ND>(pt, ldp, vrows, ofs, n, alpha, ot, ldo); break;
    case 2: pv_tile_km<DT, 2, ND>(pt, ldp, vrows, ofs, n, alpha, ot, ldo); break;
    case 3: pv_tile_km<DT, 3, ND>(pt, ldp, vrows, ofs, n, alpha, ot, ldo); break;
    default: pv_tile_km<DT, KM_RV, ND>(pt, ldp, vrows, ofs, n, alpha, ot, ldo); break;
  }
}

// Ot[d * ldo + r] = Ot[d * ldo + r] * alpha[r] + sum_t Pt[t * ldp + r] * v_t[d] for the nv row
// vectors of Pt and Ot, n keys (all of a block: each accumulator is loaded and stored once).
template <int DT>
inline void pv_keys_major(const float* Pt, int64_t ldp, int nv, const void* const* vp, int64_t ofs, int n, int64_t D,
                          const float* alpha, float* Ot, int64_t ldo, Ahead& ahead) {
  using T = typename Storage<DT>::T;
  const T* const* rows = reinterpret_cast<const T* const*>(vp);
  for (int v0 = 0; v0 < nv; v0 += KM_RV) {
    const int rv = std::min(KM_RV, nv - v0);
    const float *pt = Pt + v0 * W, *al = alpha + v0 * W;
    float* ot = Ot + v0 * W;
    int64_t d = 0;
    for (; d + KM_ND <= D; d += KM_ND) {
      pv_tile_km_rv<DT, KM_ND>(rv, pt, ldp, rows, ofs + d, n, al, ot + d * ldo, ldo);
      ahead.step();
    }
    for (; d + 2 <= D; d += 2) pv_tile_km_rv<DT, 2>(rv, pt, ldp, rows, ofs + d, n, al, ot + d * ldo, ldo);
    for (; d < D; ++d) pv_tile_km_rv<DT, 1>(rv, pt, ldp, rows, ofs + d, n, al, ot + d * ldo, ldo);
  }
}

// The online softmax step of one row vector over its keys-major scores St[t * ldS] (t < n, key
// positions k0 + t): scale (`scale` != 1), softcap, the rows' masks [lo, hi), then P in place; m
// and l are the rows' running max and sum, alpha gets the factor for their accumulators.
inline void softmax_keys_major(float* st, int64_t ldS, int n, int64_t k0, const int32_t* lo, const int32_t* hi,
                               float* m, float* l, float* alpha, float scale, float softcap) {
  const float ninf = -std::numeric_limits<float>::infinity();
  vi vlo, vhi;
  std::memcpy(&vlo, lo, sizeof vlo);
  std::memcpy(&vhi, hi, sizeof vhi);
  const vf m_old = load_f32(m);
  vf mx = m_old;
  for (int t = 0; t < n; ++t) {
    vf x = load_f32(st + t * ldS);
    if (scale != 1.0f) x *= scale;
    if (softcap > 0.0f) x = vsoftcap(x, softcap);
    const vi pos = vi{} + static_cast<int32_t>(k0 + t);
    x = (pos >= vlo) & (pos < vhi) ? x : splat(ninf);
    store_f32(st + t * ldS, x);
    mx = x > mx ? x : mx;
  }
  const vf base = mx == splat(ninf) ? splat(0.0f) : mx;  // rows with nothing to see yet: p = 0
  vf sum = vf{};
  for (int t = 0; t < n; ++t) {
    const vf p = vexp(load_f32(st + t * ldS) - base);
    store_f32(st + t * ldS, p);
    sum += p;
  }
  const vf a = vexp(m_old - base);
  store_f32(l, load_f32(l) * a + sum);
  store_f32(m, mx);
  store_f32(alpha, a);
}

struct Geometry {  // the pool and one layer of it
  int64_t num_pages, num_layers, page_size, kv_heads, head_dim;
  int64_t layer;
  const int32_t* table;
  int64_t table_stride, table_width;  // row stride and usable columns (1 for a 1-D table)

  int64_t plane_stride() const { return num_layers * page_size * kv_heads * head_dim; }
  // element offset of (position pos of sequence b, kv head h) in plane 0 of the layer
  int64_t offset(int64_t b, int64_t pos, int64_t h) const {
    int64_t col = std::min(pos / page_size, table_width - 1);
    int64_t page = table[b * table_stride + col];
    page = std::min(std::max<int64_t>(page, 0), num_pages - 1);  // in bounds even unchecked
    return (((page * 2 * num_layers + layer) * page_size + pos % page_size) * kv_heads + h) * head_dim;
  }
};

struct AttnArgs {
  int dtype;
  const void* q;
  int64_t q_stride_row, q_stride_head;
  const void* blocks;
  Geometry geo;
  const int32_t* cache_lengths;
  const int32_t* offsets;
  int64_t batch, q_heads;
  float scale;
  int causal;
  int64_t window;
  float softcap;
  void* out;
  int64_t out_stride_row, out_stride_head;
  int fp8;               // an FP8 pool (Fp8): read as FP8_* codes, or as F32 on dequantized blocks
  const float* scales;   // its scales: [pages, 2, layers, page_size, kv_heads, groups], or a static K/V pair
  int64_t scale_groups;  // scales per token and kv head (0: the static pair)
};

struct Item {
  int32_t b, h0, h1, q0, nq;  // sequence, kv heads [h0, h1), first new token and count
  int64_t k0, k1;             // key positions [k0, k1) this item covers
  int64_t part;               // slot of its partial result when the key range is split, else -1
  int64_t task;               // then: the task that merges the parts
};

struct Task {  // the rows of an Item whose key range is split over `parts` items, from slot `first_part`
  int32_t b, h0, h1, q0, nq;
  int64_t first_part, parts;
};

struct Tile {  // query rows [r0, r0 + rt) of an item, of the kv head at column `ofs` of a row
  int64_t r0, ofs;
  int rt;
};

struct Scratch {
  std::vector<Tile> tiles;
  std::vector<float> q, o, s, m, l;
  std::vector<int64_t> lo, hi;
  std::vector<const void*> kp, vp;
  std::vector<const float*> ks, vs;  // FP8_*: the K and V scales of each key (at kv head h0)
  std::vector<float> deq;  // FP8 pools run as F32: K and V of the current and the next key block, dequantized
  // Keys-major items: Qt per head, and per head and row (rows padded to W): running max and sum,
  // key range, and the last block's accumulator factors.
  std::vector<float> qt, ot, km_m, km_l, km_alpha;
  std::vector<int32_t> km_lo, km_hi;
  void reserve(int64_t rows, int64_t Dp) {
    if (static_cast<int64_t>(m.size()) < rows) {
      m.resize(rows);
      l.resize(rows);
      lo.resize(rows);
      hi.resize(rows);
      s.resize(rows * KEY_BLOCK);
    }
    if (static_cast<int64_t>(q.size()) < rows * Dp) {
      q.resize(rows * Dp);
      o.resize(rows * Dp);
    }
    if (kp.size() < static_cast<size_t>(2 * KEY_BLOCK)) {  // two blocks: the current one and the next
      kp.resize(2 * KEY_BLOCK);
      vp.resize(2 * KEY_BLOCK);
      ks.resize(2 * KEY_BLOCK);
      vs.resize(2 * KEY_BLOCK);
    }
  }
};

thread_local Scratch tls_scratch;
thread_local std::vector<float> tls_partials;
thread_local std::vector<Item> tls_spans, tls_items;
thread_local std::vector<Task> tls_tasks;
thread_local std::vector<std::atomic<int64_t>> tls_remaining;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The key positions [lo, hi) that new token i of sequence b may see.
inline void key_range(const AttnArgs& a, int64_t b, int64_t i, int64_t* lo, int64_t* hi) {
  int64_t cached = a.cache_lengths[b];
  int64_t kv_len = cached + (a.offsets[b + 1] - a.offsets[b]);
  int64_t pos = cached + i;
  *hi = a.causal ? pos + 1 : kv_len;
  *lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
}

constexpr int64_t ROWS_PER_ITEM = 64;       // query rows (token x q head) an item aims for
constexpr int64_t BLOCK_BYTES = 128 << 10;  // K + V bytes of one key block of an item (L2-sized)

// Row r of an item: kv head h0 + r / per_head; within the head, new token q0 + (r % per_head) / group
// and q head (kv head) * group + r % group. A head's rows are contiguous, so a row tile never
// straddles two heads (two different K/V row sets).
struct RowMap {
  int64_t group, per_head;
  int64_t head(const Item& it, int64_t r) const { return it.h0 + r / per_head; }
  int64_t token(int64_t r) const { return (r % per_head) / group; }
  int64_t q_head(const Item& it, int64_t r) const { return head(it, r) * group + r % group; }
};

// The fewest query rows per kv head for which an item takes the keys-major tiles (qk_keys_major):
// two vectors' worth (one for fp32 with AVX-512, whose broadcasts are free memory operands: 16-bit
// kinds convert each one, AVX2 tiles are narrower). Interleaved A/B (Zen 4, 8 x 2048 context, 1 to
// 6 new tokens): at one vector of rows the dot-product tiles took 0.87-0.98x the time for bf16 and
// fp16 (AVX-512) and 0.67-0.83x for every kind on AVX2; fp32 with AVX-512 1.12-1.25x. FP8 codes
// have no keys-major tiles: such items run on dequantized blocks instead (flash_attention).
template <int DT>
constexpr int64_t keys_major_rows() {
  return DT == F32 && W == 16 ? W : 2 * W;
}

template <int DT>
void attend_item(const AttnArgs& a, const Item& it, float* partials, int64_t part_stride) {
  using T = typename Storage<DT>::T;
  using QT = typename Storage<scalar_dtype<DT>()>::T;
  const bool staged = DT == F32 && a.fp8;  // an FP8 pool read through dequantized blocks
  const Geometry& g = a.geo;
  const int64_t D = g.head_dim, Dp = round_up(D, W), group = a.q_heads / g.kv_heads;
  const int nfull = static_cast<int>(D / W), tail = static_cast<int>(D % W);
  const int64_t heads = it.h1 - it.h0, per_head = static_cast<int64_t>(it.nq) * group, rows = heads * per_head;
  const RowMap map{group, per_head};
  Scratch& sc = tls_scratch;
  sc.reserve(rows, Dp);
  const bool keys_major = !is_fp8<DT>() && per_head >= keys_major_rows<DT>();
  const int64_t rp = round_up(per_head, W);  // keys-major: rows per head, padded
  if (keys_major) {
    const int64_t padded = heads * rp;
    if (static_cast<int64_t>(sc.s.size()) < padded * KEY_BLOCK) sc.s.resize(padded * KEY_BLOCK);
    if (static_cast<int64_t>(sc.qt.size()) < padded * D) {
      sc.qt.resize(padded * D);
      sc.ot.resize(padded * D);
    }
    if (static_cast<int64_t>(sc.km_m.size()) < padded) {
      sc.km_m.resize(padded);
      sc.km_l.resize(padded);
      sc.km_alpha.resize(padded);
      sc.km_lo.resize(padded);
      sc.km_hi.resize(padded);
    }
    std::fill(sc.qt.begin(), sc.qt.begin() + padded * D, 0.0f);
    std::fill(sc.ot.begin(), sc.ot.begin() + padded * D, 0.0f);
    std::fill(sc.km_m.begin(), sc.km_m.begin() + padded, -std::numeric_limits<float>::infinity());
    std::fill(sc.km_l.begin(), sc.km_l.begin() + padded, 0.0f);
    std::fill(sc.km_lo.begin(), sc.km_lo.begin() + padded, 0);
    std::fill(sc.km_hi.begin(), sc.km_hi.begin() + padded, 0);
  }
  float *Q = sc.q.data(), *O = sc.o.data(), *S = sc.s.data(), *M = sc.m.data(), *L = sc.l.data();
  const QT* qbase = static_cast<const QT*>(a.q);
  const int64_t row0 = a.offsets[it.b] + it.q0;
  int64_t klo = it.k1, khi = it.k0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = map.token(r);
    const QT* src = qbase + (row0 + i) * a.q_stride_row + map.q_head(it, r) * a.q_stride_head;
    float* dst = Q + r * Dp;
    const int64_t hh = r / per_head, slot = r % per_head, lane = hh * rp + slot;  // keys-major: its lane
    if (keys_major) {  // Qt of head hh: [D][rp] scaled fp32, or for bf16_dot kinds [D / 2][rp] bf16 pairs
      float* qt = sc.qt.data() + hh * rp * D;
      if constexpr (bf16_dot<DT>()) {  // the bf16 values as they are
        uint16_t* pairs = reinterpret_cast<uint16_t*>(qt);
        for (int64_t d = 0; d < D; ++d) pairs[((d / 2) * rp + slot) * 2 + d % 2] = src[d];
      } else {
        for (int64_t d = 0; d < D; ++d) qt[d * rp + slot] = load_scalar<scalar_dtype<DT>()>(src + d) * a.scale;
      }
    } else if constexpr (bf16_dot<DT>()) {  // the bf16 values as they are (D is a multiple of 2W: no padding)
      std::memcpy(dst, src, D * sizeof(QT));
    } else {
      for (int64_t d = 0; d < D; ++d) dst[row_slot<DT>(d)] = load_scalar<scalar_dtype<DT>()>(src + d) * a.scale;
      std::fill(dst + D, dst + Dp, 0.0f);
    }
    if (!keys_major) {  // (keys-major: Ot, km_m and km_l, put into O, M and L at the end)
      std::fill(O + r * Dp, O + (r + 1) * Dp, 0.0f);
      M[r] = -std::numeric_limits<float>::infinity();
      L[r] = 0.0f;
    }
    int64_t lo, hi;
    key_range(a, it.b, it.q0 + i, &lo, &hi);
    sc.lo[r] = std::max(lo, it.k0);
    sc.hi[r] = std::min(hi, it.k1);
    if (keys_major) {
      sc.km_lo[lane] = static_cast<int32_t>(sc.lo[r]);
      sc.km_hi[lane] = static_cast<int32_t>(sc.hi[r]);
    }
    if (sc.lo[r] < sc.hi[r]) {
      klo = std::min(klo, sc.lo[r]);
      khi = std::max(khi, sc.hi[r]);
    }
  }
  const T* blocks = static_cast<const T*>(a.blocks);
  const int64_t vshift = g.plane_stride(), token_stride = g.kv_heads * D;
  const int64_t span_bytes = heads * D * static_cast<int64_t>(sizeof(T));  // of one token, heads h0..h1
  const int kb = static_cast<int>(std::clamp<int64_t>(BLOCK_BYTES / (2 * span_bytes), 16, KEY_BLOCK));
  const int64_t span = heads * D;  // elements of one key's rows of heads h0..h1
  if (staged && static_cast<int64_t>(sc.deq.size()) < 4 * KEY_BLOCK * span) sc.deq.resize(4 * KEY_BLOCK * span);
  const int64_t scale_heads = a.scale_groups;  // FP8_*: scales per token and kv head (0: the static pair)
  const int64_t granule = scale_heads ? D / scale_heads : span;  // FP8_*: elements per scale
  // Row pointers (at kv head h0) of key positions [k0, k0 + n) into key block buffer `buf`, a page
  // at a time (FP8_*: and their scales); for a staged FP8 pool, pointers to the rows dequantized
  // into sc.deq.
  auto fill = [&](int64_t k0, int n, int buf) {
    const void** kp = sc.kp.data() + buf * KEY_BLOCK;
    const void** vp = sc.vp.data() + buf * KEY_BLOCK;
    if (staged) {
      const uint8_t* codes = static_cast<const uint8_t*>(a.blocks);
      for (int t = 0; t < n; ++t) {
        const int64_t off = g.offset(it.b, k0 + t, it.h0);
        float* kd = sc.deq.data() + ((2 * buf) * KEY_BLOCK + t) * span;
        float* vd = sc.deq.data() + ((2 * buf + 1) * KEY_BLOCK + t) * span;
        for (int plane = 0; plane < 2; ++plane) {
          const uint8_t* src = codes + off + plane * vshift;
          float* dst = plane ? vd : kd;
          const float* scale = scale_heads ? a.scales + (off + plane * vshift) / granule : a.scales + plane;
          for (int64_t j = 0; j < span; j += granule) {
            const float s = scale_heads ? scale[j / granule] : *scale;
            if (a.fp8 == E4M3FN) {
              dequantize<E4M3FN>(src + j, granule, s, dst + j);
            } else {
              dequantize<E5M2>(src + j, granule, s, dst + j);
            }
          }
        }
        kp[t] = kd;
        vp[t] = vd;
      }
      return;
    }
    for (int t = 0; t < n;) {
      const int64_t pos = k0 + t;
      const T* row = blocks + g.offset(it.b, pos, it.h0);
      const int run = static_cast<int>(std::min<int64_t>(n - t, g.page_size - pos % g.page_size));
      for (int u = 0; u < run; ++u, ++t) {
        kp[t] = row + u * token_stride;
        vp[t] = row + u * token_stride + vshift;
      }
    }
    if constexpr (is_fp8<DT>()) {  // a row's scales sit at its element offset / granule (or the static pair)
      const float** ks = sc.ks.data() + buf * KEY_BLOCK;
      const float** vs = sc.vs.data() + buf * KEY_BLOCK;
      for (int t = 0; t < n; ++t) {
        ks[t] = scale_heads ? a.scales + (static_cast<const T*>(kp[t]) - blocks) / granule : a.scales;
        vs[t] = scale_heads ? a.scales + (static_cast<const T*>(vp[t]) - blocks) / granule : a.scales + 1;
      }
    }
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  auto live = [&](int64_t r0, int rt, int64_t k0, int n) {
    for (int r = 0; r < rt; ++r)
      if (sc.lo[r0 + r] < k0 + n && sc.hi[r0 + r] > k0) return true;
    return false;
  };
  if (klo < khi) fill(klo, static_cast<int>(std::min<int64_t>(kb, khi - klo)), 0);
  for (int64_t k0 = klo, block = 0; k0 < khi; k0 += kb, ++block) {
    const int n = static_cast<int>(std::min<int64_t>(kb, khi - k0));
    const void** kp = sc.kp.data() + (block & 1) * KEY_BLOCK;  // filled by the previous block
    const void** vp = sc.vp.data() + (block & 1) * KEY_BLOCK;
    const float* const* ks = sc.ks.data() + (block & 1) * KEY_BLOCK;  // FP8_*: their scales
    const float* const* vs = sc.vs.data() + (block & 1) * KEY_BLOCK;
    // The row tiles with a key of this block to see (per kv head, ROW_TILE rows at a time; none
    // keys-major).
    std::vector<Tile>& tiles = sc.tiles;
    tiles.clear();
    for (int64_t hh = 0; !keys_major && hh < heads; ++hh) {
      for (int64_t r0 = hh * per_head; r0 < (hh + 1) * per_head; r0 += ROW_TILE) {
        const int rt = static_cast<int>(std::min<int64_t>(ROW_TILE, (hh + 1) * per_head - r0));
        if (live(r0, rt, k0, n)) tiles.push_back({r0, hh * D, rt});
      }
    }
    // Memory traffic spread over the block's work: this block's V rows while the scores compute,
    // the next block's K rows while P V does (each phase reads what the other fetched).
    const int64_t tile_steps = static_cast<int64_t>(tiles.size()) * ((n + CHUNK - 1) / CHUNK);
    const int keys_per_tile = static_cast<int>(8 / std::min<int64_t>(ROW_TILE, per_head));  // qk_rows' NT
    const int64_t km_steps = heads * ((rp / W + KM_RV - 1) / KM_RV) * (n / KM_NT);  // qk_keys_major's step() calls
    Ahead v_now, k_next;
    if (!staged) {
      v_now.start(vp, n, span_bytes,
                  keys_major ? km_steps : tile_steps * ((CHUNK + keys_per_tile - 1) / keys_per_tile));
    }
    if (k0 + kb < khi) {
      const int n_next = static_cast<int>(std::min<int64_t>(kb, khi - k0 - kb));
      fill(k0 + kb, n_next, (block + 1) & 1);
      const void* const* next_kp = sc.kp.data() + ((block + 1) & 1) * KEY_BLOCK;
      if (!staged) {  // staged: in cache
        k_next.start(next_kp, n_next, span_bytes,
                     keys_major ? heads * ((rp / W + KM_RV - 1) / KM_RV) * (D / KM_ND)
                                : tile_steps * (nfull / 2));
      }
    }
    if (keys_major) {  // scores and softmax per head, keys-major
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* st = S + hh * rp * KEY_BLOCK;
        const int64_t lane0 = hh * rp;
        if constexpr (!is_fp8<DT>()) {
          qk_keys_major<DT>(sc.qt.data() + lane0 * D, rp, static_cast<int>(rp / W), kp, hh * D, n, D, st, rp, v_now);
        }
        for (int64_t v = 0; v < rp; v += W) {
          softmax_keys_major(st + v, rp, n, k0, sc.km_lo.data() + lane0 + v, sc.km_hi.data() + lane0 + v,
                             sc.km_m.data() + lane0 + v, sc.km_l.data() + lane0 + v, sc.km_alpha.data() + lane0 + v,
                             bf16_dot<DT>() ? a.scale : 1.0f, a.softcap);
        }
        if constexpr (!is_fp8<DT>()) {
          pv_keys_major<DT>(st, rp, static_cast<int>(rp / W), vp, hh * D, n, D, sc.km_alpha.data() + lane0,
                            sc.ot.data() + lane0 * D, rp, k_next);
        }
      }
      continue;
    }
    // Scores, CHUNK keys at a time through every row tile.
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
      const int nt = std::min(n - c0, CHUNK);
      const void* const* kc = kp + c0;
      const Granules kg{ks + c0, granule};
      for (const Tile& tile : tiles) {
        const float* q = Q + tile.r0 * Dp;
        float* sp = S + tile.r0 * KEY_BLOCK + c0;
        switch (tile.rt) {
          case 4: qk_rows<DT, 4>(q, Dp, kc, tile.ofs, nt, nfull, tail, sp, KEY_BLOCK, kg, v_now); break;
          case 3: qk_rows<DT, 3>(q, Dp, kc, tile.ofs, nt, nfull, tail, sp, KEY_BLOCK, kg, v_now); break;
          case 2: qk_rows<DT, 2>(q, Dp, kc, tile.ofs, nt, nfull, tail, sp, KEY_BLOCK, kg, v_now); break;
          default: qk_rows<DT, 1>(q, Dp, kc, tile.ofs, nt, nfull, tail, sp, KEY_BLOCK, kg, v_now); break;
        }
      }
    }
    const int nv = static_cast<int>(round_up(n, W));
    for (int64_t r = 0; r < rows; ++r) {  // softcap, mask, online softmax
      float* s = S + r * KEY_BLOCK;
      const int64_t a0 = std::max<int64_t>(sc.lo[r] - k0, 0), a1 = std::min<int64_t>(sc.hi[r] - k0, n);
      if (a0 >= a1) {
        std::fill(s, s + nv, 0.0f);
        continue;
      }
      if constexpr (bf16_dot<DT>()) {  // the scores came from unscaled queries
        for (int t = 0; t < nv; t += W) store_f32(s + t, load_f32(s + t) * a.scale);
      }
      if (a.softcap > 0.0f) {
        for (int t = 0; t < nv; t += W) store_f32(s + t, vsoftcap(load_f32(s + t), a.softcap));
      }
      std::fill(s, s + a0, ninf);
      std::fill(s + a1, s + nv, ninf);
      vf vmax = splat(ninf);
      for (int t = 0; t < nv; t += W) {
        vf x = load_f32(s + t);
        vmax = x > vmax ? x : vmax;
      }
      const float m_new = std::max(M[r], hmax(vmax));
      const float alpha = std::exp(M[r] - m_new);
      vf sum = vf{};
      for (int t = 0; t < nv; t += W) {
        vf p = vexp(load_f32(s + t) - m_new);
        store_f32(s + t, p);
        sum += p;
      }
      L[r] = L[r] * alpha + hsum(sum);
      M[r] = m_new;
      if (alpha != 1.0f) {
        float* o = O + r * Dp;
        for (int64_t d = 0; d < Dp; d += W) store_f32(o + d, load_f32(o + d) * alpha);
      }
    }
    for (int c0 = 0; c0 < n; c0 += CHUNK) {  // O += P V, CHUNK keys at a time through every row tile
      const int nt = std::min(n - c0, CHUNK);
      const void* const* vc = vp + c0;
      const Granules vg{vs + c0, granule};
      for (const Tile& tile : tiles) {
        const float* p = S + tile.r0 * KEY_BLOCK + c0;
        float* o = O + tile.r0 * Dp;
        switch (tile.rt) {
          case 4: pv_rows<DT, 4>(p, KEY_BLOCK, vc, tile.ofs, nt, nfull, tail, o, Dp, vg, k_next); break;
          case 3: pv_rows<DT, 3>(p, KEY_BLOCK, vc, tile.ofs, nt, nfull, tail, o, Dp, vg, k_next); break;
          case 2: pv_rows<DT, 2>(p, KEY_BLOCK, vc, tile.ofs, nt, nfull, tail, o, Dp, vg, k_next); break;
          default: pv_rows<DT, 1>(p, KEY_BLOCK, vc, tile.ofs, nt, nfull, tail, o, Dp, vg, k_next); break;
        }
      }
    }
  }
  if (keys_major) {  // accumulators back in rows
    for (int64_t r = 0; r < rows; ++r) {
      const float* ot = sc.ot.data() + (r / per_head) * rp * D + r % per_head;
      for (int64_t d = 0; d < D; ++d) O[r * Dp + d] = ot[d * rp];
    }
  } else if constexpr (DT == BF16_PAIRS) {  // accumulator columns back in order: evens and odds interleaved
    for (int64_t r = 0; r < rows; ++r) {
      float* o = O + r * Dp;
      for (int64_t d = 0; d < D; d += 2 * W) {
        vf lo, hi;
        interleave(load_f32(o + d), load_f32(o + d + W), lo, hi);  // the even columns, then the odd
        store_f32(o + d, lo);
        store_f32(o + d + W, hi);
      }
    }
  }
  if (keys_major) {  // the rows' max and sum from their lanes
    for (int64_t r = 0; r < rows; ++r) {
      M[r] = sc.km_m[r / per_head * rp + r % per_head];
      L[r] = sc.km_l[r / per_head * rp + r % per_head];
    }
  }
  if (it.part >= 0) {  // a split: keep the unnormalised rows with their max and sum
    float* dst = partials + it.part * part_stride;
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(dst + r * D, O + r * Dp, D * sizeof(float));
      dst[rows * D + r] = M[r];
      dst[rows * D + rows + r] = L[r];
    }
    return;
  }
  QT* obase = static_cast<QT*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    QT* dst = obase + (row0 + map.token(r)) * a.out_stride_row + map.q_head(it, r) * a.out_stride_head;
    store_out<scalar_dtype<DT>()>(dst, O + r * Dp, static_cast<int>(D), L[r] > 0.0f ? 1.0f / L[r] : 0.0f);
  }
}

template <int DT>
void merge_task(const AttnArgs& a, const Task& task, const float* partials, int64_t part_stride) {
  using T = typename Storage<scalar_dtype<DT>()>::T;  // of the output
  const int64_t D = a.geo.head_dim, group = a.q_heads / a.geo.kv_heads;
  const int64_t per_head = static_cast<int64_t>(task.nq) * group, rows = (task.h1 - task.h0) * per_head;
  const RowMap map{group, per_head};
  const Item it{task.b, task.h0, task.h1, task.q0, task.nq, 0, 0, -1, -1};
  std::vector<float> acc(D);
  T* obase = static_cast<T*>(a.out);
  const int64_t row0 = a.offsets[task.b] + task.q0;
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < task.parts; ++s) {
      m = std::max(m, partials[(task.first_part + s) * part_stride + rows * D + r]);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    float l = 0.0f;
    for (int64_t s = 0; s < task.parts; ++s) {
      const float* src = partials + (task.first_part + s) * part_stride;
      const float ls = src[rows * D + rows + r];
      if (ls == 0.0f) continue;
      const float w = std::exp(src[rows * D + r] - m);
      l += ls * w;
      for (int64_t d = 0; d < D; ++d) acc[d] += src[r * D + d] * w;
    }
    T* dst = obase + (row0 + map.token(r)) * a.out_stride_row + map.q_head(it, r) * a.out_stride_head;
    store_out<scalar_dtype<DT>()>(dst, acc.data(), static_cast<int>(D), l > 0.0f ? 1.0f / l : 0.0f);
  }
}

int thread_count(int requested, double work, double min_work_per_thread) {
  if (requested <= 1) return 1;
  int n = static_cast<int>(std::min<double>(requested, work / min_work_per_thread));
  return std::max(n, 1);
}

// f(0) .. f(n - 1) on `threads` threads (OpenMP's), or a plain loop: one thread never enters OpenMP.
template <bool DYNAMIC, class F>
void parallel_for(int64_t n, int threads, const F& f) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  if constexpr (DYNAMIC) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

struct Tuning {        // set by kernels.py (module constants, so tests can force each path)
  int64_t min_split;   // fewest key positions in one split of a key range
  int64_t want_items;  // split key ranges until there are this many items (0: 8 per thread)
  int64_t min_work;    // fewest multiply-adds per thread before a call uses more threads
};

template <int DT>
void flash_attention(const AttnArgs& a, const Tuning& tune, int nthreads) {
  const int64_t H = a.geo.kv_heads, group = a.q_heads / H;
  // An item: about ROWS_PER_ITEM query rows. A decode row block (one token) spans every kv head,
  // so one item reads whole token rows of the pages (contiguous); prefill blocks take one head.
  const int64_t tokens_per_item = std::max<int64_t>(1, ROWS_PER_ITEM / group);
  std::vector<Item>& spans = tls_spans;  // reused: no allocation per call
  spans.clear();
  double work = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t new_b = a.offsets[b + 1] - a.offsets[b];
    for (int64_t q0 = 0; q0 < new_b; q0 += tokens_per_item) {
      const int64_t nq = std::min(tokens_per_item, new_b - q0);
      const int64_t heads_per_item = std::clamp<int64_t>(ROWS_PER_ITEM / (nq * group), 1, H);
      int64_t lo_first, hi_first, lo_last, hi_last;
      key_range(a, b, q0, &lo_first, &hi_first);
      key_range(a, b, q0 + nq - 1, &lo_last, &hi_last);
      work += static_cast<double>(std::max<int64_t>(hi_last - lo_first, 0)) * nq * a.q_heads;
      for (int64_t h = 0; h < H; h += heads_per_item) {
        spans.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(std::min(H, h + heads_per_item)), static_cast<int32_t>(q0),
                         static_cast<int32_t>(nq), lo_first, hi_last, -1, -1});
      }
    }
  }
  const int threads = thread_count(nthreads, work * a.geo.head_dim, static_cast<double>(tune.min_work));
  // Split long key ranges when there are too few items to keep every thread busy.
  const int64_t min_split = std::max<int64_t>(tune.min_split, 1);
  // Several items per thread: a thread the OS takes away mid-call (other work on the machine) then
  // holds up only a small share, which the others pick up (dynamic schedule).
  const int64_t want = tune.want_items > 0 ? tune.want_items : threads > 1 ? 8 * threads : 1;
  const int64_t n_spans = static_cast<int64_t>(spans.size());
  std::vector<Item>& items = tls_items;
  std::vector<Task>& tasks = tls_tasks;
  items.clear();
  tasks.clear();
  int64_t parts = 0, max_rows = 0;
  for (const Item& sp : spans) {
    const int64_t keys = std::max<int64_t>(sp.k1 - sp.k0, 0);
    int64_t splits = 1;
    if (n_spans < want && keys >= 2 * min_split) {
      splits = std::min<int64_t>((want + n_spans - 1) / n_spans, keys / min_split);
    }
    max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(sp.h1 - sp.h0) * sp.nq * group);
    if (splits <= 1) {
      items.push_back(sp);
      continue;
    }
    const int64_t chunk = round_up((keys + splits - 1) / splits, 16);
    Task task{sp.b, sp.h0, sp.h1, sp.q0, sp.nq, parts, 0};
    const int64_t task_index = static_cast<int64_t>(tasks.size());
    for (int64_t k = sp.k0; k < sp.k1; k += chunk) {
      items.push_back({sp.b, sp.h0, sp.h1, sp.q0, sp.nq, k, std::min(sp.k1, k + chunk), parts++, task_index});
      task.parts++;
    }
    tasks.push_back(task);
  }
  const int64_t part_stride = max_rows * (a.geo.head_dim + 2);
  std::vector<float>& partials = tls_partials;
  if (parts > 0 && static_cast<int64_t>(partials.size()) < parts * part_stride) partials.resize(parts * part_stride);
  float* pp = partials.data();
  const int64_t n_items = static_cast<int64_t>(items.size());
  // A split task is merged by the thread that finishes its last part: one parallel loop, no
  // barrier between the parts and the merges (each barrier waits for the slowest thread).
  std::vector<std::atomic<int64_t>>& remaining = tls_remaining;
  if (remaining.size() < tasks.size()) remaining = std::vector<std::atomic<int64_t>>(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) remaining[t].store(tasks[t].parts, std::memory_order_relaxed);
  parallel_for<true>(n_items, threads, [&](int64_t i) {
    const Item& it = items[i];
    if constexpr (is_fp8<DT>()) {  // prefill-shaped: codes dequantized once per key block, keys-major fp32 tiles
      if (static_cast<int64_t>(it.nq) * group >= keys_major_rows<F32>()) {
        attend_item<F32>(a, it, pp, part_stride);
      } else {
        attend_item<DT>(a, it, pp, part_stride);
      }
    } else {
      attend_item<DT>(a, it, pp, part_stride);
    }
    if (it.part >= 0 && remaining[it.task].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      merge_task<DT>(a, tasks[it.task], pp, part_stride);
    }
  });
}

}  // namespace

namespace {

void run_flash_attention(int dtype, const void* q, int64_t q_stride_row, int64_t q_stride_head, const void* blocks,
                         int64_t num_pages, int64_t num_layers, int64_t page_size, int64_t kv_heads,
                         int64_t head_dim, const int32_t* cache_lengths, const int32_t* table, int64_t table_stride,
                         int64_t table_width, const int32_t* offsets, int64_t batch, int64_t layer, int64_t q_heads,
                         double scale, int causal, int64_t window, double softcap, void* out, int64_t out_stride_row,
                         int64_t out_stride_head, int64_t min_split, int64_t want_items, int64_t min_work,
                         int nthreads, int fp8, const float* scales, int64_t scale_groups) {
  AttnArgs a;
  a.dtype = dtype;
  a.q = q;
  a.q_stride_row = q_stride_row;
  a.q_stride_head = q_stride_head;
  a.blocks = blocks;
  a.geo = Geometry{num_pages, num_layers, page_size, kv_heads, head_dim, layer, table, table_stride, table_width};
  a.cache_lengths = cache_lengths;
  a.offsets = offsets;
  a.batch = batch;
  a.q_heads = q_heads;
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.window = window;
  a.softcap = static_cast<float>(softcap);
  a.out = out;
  a.out_stride_row = out_stride_row;
  a.out_stride_head = out_stride_head;
  a.fp8 = fp8;
  a.scales = scales;
  a.scale_groups = scale_groups;
  const Tuning tune{min_split, want_items, min_work};
  const int64_t granule = scale_groups ? head_dim / scale_groups : head_dim;  // (static: one scale per row)
  const bool fp8_codes = fp8 && head_dim % (2 * W) == 0 && granule % (2 * W) == 0;
  switch (dtype) {
    case F32:
      if (fp8_codes && fp8 == E4M3FN) {
        flash_attention<FP8_E4M3FN>(a, tune, nthreads);
      } else if (fp8_codes) {
        flash_attention<FP8_E5M2>(a, tune, nthreads);
      } else {
        flash_attention<F32>(a, tune, nthreads);
      }
      break;
    case BF16:
      if (head_dim % (2 * W) == 0) {
        flash_attention<BF16_PAIRS>(a, tune, nthreads);
      } else {
        flash_attention<BF16>(a, tune, nthreads);
      }
      break;
    default: flash_attention<F16>(a, tune, nthreads); break;
  }
}

// The page holding position `pos` of sequence b, or -1 where there is none: a position before 0 or
// past the table, or an id outside the pool (store and gather skip such rows; store also the null page).
inline int64_t page_of(const int32_t* table, int64_t table_stride, int64_t table_width, int64_t num_pages,
                       int64_t page_size, int64_t b, int64_t pos) {
  const int64_t col = pos / page_size;
  if (pos < 0 || col >= table_width) return -1;
  const int64_t page = table[b * table_stride + col];
  return page < num_pages ? page : -1;
}

// New rows of K and V ([total_new, kv_heads, head_dim], any row / head stride, unit element
// stride) into their slots; rows whose page is out of range or the null page are skipped.
void run_store_kv(int64_t itemsize, const void* key, int64_t k_stride_row, int64_t k_stride_head, const void* value,
                  int64_t v_stride_row, int64_t v_stride_head, void* blocks, int64_t num_pages, int64_t num_layers,
                  int64_t page_size, int64_t kv_heads, int64_t head_dim, const int32_t* cache_lengths,
                  const int32_t* table, int64_t table_stride, int64_t table_width, const int32_t* offsets,
                  int64_t batch, int64_t layer, int nthreads) {
  const int64_t row_bytes = head_dim * itemsize;
  const int64_t plane = num_layers * page_size * kv_heads * head_dim * itemsize;
  const int64_t total = offsets[batch] - offsets[0];
  const int threads = thread_count(nthreads, static_cast<double>(total) * kv_heads * row_bytes, 1 << 18);
  char* base = static_cast<char*>(blocks);
  parallel_for<false>(batch, threads, [&](int64_t b) {
    for (int64_t row = offsets[b]; row < offsets[b + 1]; ++row) {
      const int64_t pos = cache_lengths[b] + (row - offsets[b]);
      const int64_t page = page_of(table, table_stride, table_width, num_pages, page_size, b, pos);
      if (page <= 0) continue;
      char* dst = base + (((page * 2 * num_layers + layer) * page_size + pos % page_size) * kv_heads) * row_bytes;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(dst + h * row_bytes, static_cast<const char*>(key) + (row * k_stride_row + h * k_stride_head) * itemsize,
                    row_bytes);
        std::memcpy(dst + plane + h * row_bytes,
                    static_cast<const char*>(value) + (row * v_stride_row + h * v_stride_head) * itemsize, row_bytes);
      }
    }
  });
}

// fp32 -> the FP8 code of its round-to-nearest-even value, as torch converts (c10's rule): NaN
// keeps its sign (e4m3fn's NaN code, e5m2's); callers clamp finite values to the format's range
// first. Normal results: round the mantissa in the fp32 bits, then rebias; subnormal ones: adding
// 2^(bias + mantissa bits - 1) (a power of two) rounds the value to the subnormal step in the add.
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
    code = 0x7f;  // NaN, in either format
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
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), is_nan);
  return _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
}
#endif

// dst[0, n) = the FP8 codes of x[0, n) / s clamped to the format's largest value (NaN stays NaN).
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

// The largest |x[d]| over d < n, NaNs left out; *nan says whether there was one (the reference's
// amax: NaN makes the scale NaN, so the amax itself then does not matter).
inline float abs_max(const float* x, int64_t n, bool* nan) {
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
  *nan = any_nan;
  return amax;
}

// New rows of K and V (fp32, bf16 or fp16, strides as run_store_kv) into an FP8 pool, quantized by
// the reference's rule (quant.py), bit for bit: per granule of head_dim / groups elements, scale =
// amax / the format's largest value in fp32 (NaN if an element is), codes = x / scale clamped to
// that value and rounded (all zero, with that scale stored, where the scale is not > 0); with
// groups == 0 the static pair scales[plane] instead (no amax, nothing stored but codes). Rows
// whose page is out of range or the null page are skipped.
template <int SRC, int FORMAT>
void store_fp8(const void* key, int64_t k_stride_row, int64_t k_stride_head, const void* value, int64_t v_stride_row,
               int64_t v_stride_head, uint8_t* blocks, float* scales, int64_t groups, int64_t num_pages,
               int64_t num_layers, int64_t page_size, int64_t kv_heads, int64_t head_dim, const int32_t* cache_lengths,
               const int32_t* table, int64_t table_stride, int64_t table_width, const int32_t* offsets, int64_t batch,
               int64_t layer, int threads) {
  using T = typename Storage<SRC>::T;
  constexpr float top = fp8_largest(FORMAT);
  const int64_t plane = num_layers * page_size * kv_heads * head_dim, gran = groups ? head_dim / groups : head_dim;
  parallel_for<false>(offsets[batch] - offsets[0], threads, [&](int64_t i) {  // row by row: a prefill is one sequence
    const int64_t row = offsets[0] + i;
    const int64_t b = std::upper_bound(offsets, offsets + batch + 1, row) - offsets - 1;
    thread_local std::vector<float> x;
    x.resize(head_dim);
    const int64_t pos = cache_lengths[b] + (row - offsets[b]);
    const int64_t page = page_of(table, table_stride, table_width, num_pages, page_size, b, pos);
    if (page <= 0) return;
    const int64_t slot = ((page * 2 * num_layers + layer) * page_size + pos % page_size) * kv_heads;
    for (int p = 0; p < 2; ++p) {
      const T* src = static_cast<const T*>(p ? value : key) + row * (p ? v_stride_row : k_stride_row);
      const int64_t head_stride = p ? v_stride_head : k_stride_head;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* head = src + h * head_stride;
        int64_t d = 0;
        for (; d + W <= head_dim; d += W) store_f32(x.data() + d, load<SRC>(head + d));
        for (; d < head_dim; ++d) x[d] = load_scalar<SRC>(head + d);
        const int64_t at = (slot + h) * head_dim + p * plane;  // the row's first code
        for (int64_t g0 = 0; g0 < head_dim; g0 += gran) {
          float s;
          if (groups) {
            bool nan;
            const float amax = abs_max(x.data() + g0, gran, &nan);
            s = nan ? std::numeric_limits<float>::quiet_NaN() : amax / top;
            scales[at / head_dim * groups + g0 / gran] = s;
          } else {
            s = scales[p];
          }
          if (groups && !(s > 0.0f)) {
            std::memset(blocks + at + g0, 0, gran);
          } else {
            quantize<FORMAT>(x.data() + g0, gran, s, blocks + at + g0);
          }
        }
      }
    }
  });
}

void run_store_kv_fp8(int src, const void* key, int64_t k_stride_row, int64_t k_stride_head, const void* value,
                      int64_t v_stride_row, int64_t v_stride_head, void* blocks, int fp8, float* scales,
                      int64_t groups, int64_t num_pages, int64_t num_layers, int64_t page_size, int64_t kv_heads,
                      int64_t head_dim, const int32_t* cache_lengths, const int32_t* table, int64_t table_stride,
                      int64_t table_width, const int32_t* offsets, int64_t batch, int64_t layer, int nthreads) {
  const double work = static_cast<double>(offsets[batch] - offsets[0]) * kv_heads * head_dim * 2;
  const int threads = thread_count(nthreads, work, 1 << 16);
  auto run = [&](auto src_tag, auto fp8_tag) {
    store_fp8<decltype(src_tag)::value, decltype(fp8_tag)::value>(
        key, k_stride_row, k_stride_head, value, v_stride_row, v_stride_head, static_cast<uint8_t*>(blocks), scales,
        groups, num_pages, num_layers, page_size, kv_heads, head_dim, cache_lengths, table, table_stride, table_width,
        offsets, batch, layer, threads);
  };
  using e4m3 = std::integral_constant<int, E4M3FN>;
  using e5m2 = std::integral_constant<int, E5M2>;
  auto with_src = [&](auto fp8_tag) {
    switch (src) {
      case F32: run(std::integral_constant<int, F32>{}, fp8_tag); break;
      case BF16: run(std::integral_constant<int, BF16>{}, fp8_tag); break;
      default: run(std::integral_constant<int, F16>{}, fp8_tag); break;
    }
  };
  if (fp8 == E4M3FN) {
    with_src(e4m3{});
  } else {
    with_src(e5m2{});
  }
}

// K and V of every sequence's first kv_len tokens into key_out / value_out ([batch, max_kv_len,
// kv_heads, head_dim], contiguous), zeros after.
void run_gather_kv(int64_t itemsize, const void* blocks, int64_t num_pages, int64_t num_layers, int64_t page_size,
                   int64_t kv_heads, int64_t head_dim, const int32_t* cache_lengths, const int32_t* table,
                   int64_t table_stride, int64_t table_width, const int32_t* offsets, int64_t batch, int64_t layer,
                   int64_t max_kv_len, void* key_out, void* value_out, int nthreads) {
  const int64_t token_bytes = kv_heads * head_dim * itemsize;
  const int64_t plane = num_layers * page_size * kv_heads * head_dim * itemsize;
  const int threads =
      thread_count(nthreads, static_cast<double>(batch) * max_kv_len * token_bytes * 2, 1 << 18);
  const char* base = static_cast<const char*>(blocks);
  parallel_for<false>(batch * max_kv_len, threads, [&](int64_t bt) {
    const int64_t b = bt / max_kv_len, pos = bt % max_kv_len;
    char* kd = static_cast<char*>(key_out) + bt * token_bytes;
    char* vd = static_cast<char*>(value_out) + bt * token_bytes;
    const int64_t kv_len = cache_lengths[b] + offsets[b + 1] - offsets[b];
    const int64_t page = pos < kv_len ? page_of(table, table_stride, table_width, num_pages, page_size, b, pos) : -1;
    if (page < 0) {
      std::memset(kd, 0, token_bytes);
      std::memset(vd, 0, token_bytes);
      return;
    }
    const char* src = base + (((page * 2 * num_layers + layer) * page_size + pos % page_size) * kv_heads) * (head_dim * itemsize);
    std::memcpy(kd, src, token_bytes);
    std::memcpy(vd, src + plane, token_bytes);
  });
}

// gather_kv of an FP8 pool: as run_gather_kv, into fp32 key_out / value_out, each row dequantized
// (code value times its scale: the reference's values bit for bit).
void run_gather_kv_fp8(const uint8_t* blocks, int fp8, const float* scales, int64_t groups, int64_t num_pages,
                       int64_t num_layers, int64_t page_size, int64_t kv_heads, int64_t head_dim,
                       const int32_t* cache_lengths, const int32_t* table, int64_t table_stride, int64_t table_width,
                       const int32_t* offsets, int64_t batch, int64_t layer, int64_t max_kv_len, float* key_out,
                       float* value_out, int nthreads) {
  const int64_t span = kv_heads * head_dim, plane = num_layers * page_size * span;
  const int64_t gran = groups ? head_dim / groups : head_dim;
  const int threads = thread_count(nthreads, static_cast<double>(batch) * max_kv_len * span * 8, 1 << 18);
  parallel_for<false>(batch * max_kv_len, threads, [&](int64_t bt) {
    const int64_t b = bt / max_kv_len, pos = bt % max_kv_len;
    const int64_t kv_len = cache_lengths[b] + offsets[b + 1] - offsets[b];
    const int64_t page = pos < kv_len ? page_of(table, table_stride, table_width, num_pages, page_size, b, pos) : -1;
    for (int p = 0; p < 2; ++p) {
      float* dst = (p ? value_out : key_out) + bt * span;
      if (page < 0) {
        std::fill(dst, dst + span, 0.0f);
        continue;
      }
      const int64_t at = ((page * 2 * num_layers + layer) * page_size + pos % page_size) * span + p * plane;
      for (int64_t e = 0; e < span; e += gran) {
        const float s = groups ? scales[(at + e) / gran] : scales[p];
        if (fp8 == E4M3FN) {
          dequantize<E4M3FN>(blocks + at + e, gran, s, dst + e);
        } else {
          dequantize<E5M2>(blocks + at + e, gran, s, dst + e);
        }
      }
    }
  });
}

// blocks[dst[i]] = blocks[src[i]] (whole pages), every source read before any write; destinations
// that are the null page or out of range, and sources out of range, are skipped.
void run_copy_pages(void* blocks, int64_t page_bytes, int64_t num_pages, const int32_t* src, const int32_t* dst,
                    int64_t n, int nthreads) {
  char* base = static_cast<char*>(blocks);
  std::vector<char> is_source(num_pages, 0);
  for (int64_t i = 0; i < n; ++i)
    if (src[i] >= 0 && src[i] < num_pages) is_source[src[i]] = 1;
  bool overlap = false;
  for (int64_t i = 0; i < n && !overlap; ++i) overlap = dst[i] > 0 && dst[i] < num_pages && is_source[dst[i]];
  std::vector<char> staged;
  const char* from = base;
  int64_t from_stride = 0;  // 0: read each source page in place
  if (overlap) {
    staged.resize(n * page_bytes);
    for (int64_t i = 0; i < n; ++i)
      if (src[i] >= 0 && src[i] < num_pages) std::memcpy(staged.data() + i * page_bytes, base + src[i] * page_bytes, page_bytes);
    from = staged.data();
    from_stride = page_bytes;
  }
  const int threads = thread_count(nthreads, static_cast<double>(n) * page_bytes, 1 << 20);
  parallel_for<false>(n, threads, [&](int64_t i) {
    if (dst[i] <= 0 || dst[i] >= num_pages || src[i] < 0 || src[i] >= num_pages) return;
    const char* s = from_stride ? from + i * from_stride : base + src[i] * page_bytes;
    std::memcpy(base + dst[i] * page_bytes, s, page_bytes);
  });
}

// Whether a step's index tensors pass every value check of validate.py (`check_store_kv_data` with
// `reads_all` = 0, `check_read_data` with 1): offsets start at 0 and never decrease, lengths are
// >= 0, every sequence fits its table row, the offsets end at `total_rows` (if >= 0), no sequence
// is longer than `max_kv_len` (if >= 0), and every page holding a token the call touches is a real
// page (1 .. num_pages - 1). A fast yes for the common case; on a no, validate.py runs its own
// checks, which say what is wrong (so this must never say yes where they would raise).
int run_step_ok(const int32_t* cache_lengths, const int32_t* table, int64_t table_stride, int64_t table_2d,
                int64_t table_width, const int32_t* offsets, int64_t batch, int64_t total_rows, int64_t page_size,
                int64_t num_pages, int reads_all, int64_t max_kv_len) {
  if (offsets[0] != 0) return 0;
  if (total_rows >= 0 && offsets[batch] != total_rows) return 0;
  const int64_t capacity = page_size * (table_2d ? table_width : 1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t cached = cache_lengths[b], added = static_cast<int64_t>(offsets[b + 1]) - offsets[b];
    const int64_t kv_len = cached + added;
    if (added < 0 || cached < 0 || kv_len > capacity) return 0;
    if (max_kv_len >= 0 && kv_len > max_kv_len) return 0;
    const int64_t first = reads_all ? 0 : cached;
    if (kv_len <= first) continue;
    const int32_t* row = table + b * table_stride;
    const int64_t c0 = table_2d ? first / page_size : 0, c1 = table_2d ? (kv_len + page_size - 1) / page_size : 1;
    for (int64_t c = c0; c < c1; ++c) {
      if (row[c] <= 0 || row[c] >= num_pages) return 0;
    }
  }
  return 1;
}

// One call's arguments as kernels.py packs them (struct "@...q...d"): int64 values (pointers as
// integers) then doubles, 8 bytes each, in the order of the run_* parameters. ctypes then converts
// one argument per call instead of twenty-odd (a few microseconds a call).
struct Packed {
  const unsigned char* p;
  int64_t i(int k) const {
    int64_t v;
    std::memcpy(&v, p + 8 * k, 8);
    return v;
  }
  double d(int k) const {
    double v;
    std::memcpy(&v, p + 8 * k, 8);
    return v;
  }
  template <class T>
  T* ptr(int k) const {
    return reinterpret_cast<T*>(static_cast<intptr_t>(i(k)));
  }
};

}  // namespace

extern "C" {

int pkv_vector_width() { return W; }

int pkv_bf16_dot() { return bf16_dot<BF16_PAIRS>() ? 1 : 0; }

int pkv_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

void pkv_flash_attention(const unsigned char* packed) {
  const Packed a{packed};
  run_flash_attention(static_cast<int>(a.i(0)), a.ptr<const void>(1), a.i(2), a.i(3), a.ptr<const void>(4), a.i(5),
                      a.i(6), a.i(7), a.i(8), a.i(9), a.ptr<const int32_t>(10), a.ptr<const int32_t>(11), a.i(12),
                      a.i(13), a.ptr<const int32_t>(14), a.i(15), a.i(16), a.i(17), a.d(27), static_cast<int>(a.i(18)),
                      a.i(19), a.d(28), a.ptr<void>(20), a.i(21), a.i(22), a.i(23), a.i(24), a.i(25),
                      static_cast<int>(a.i(26)), static_cast<int>(a.i(29)), a.ptr<const float>(30), a.i(31));
}

void pkv_store_kv(const unsigned char* packed) {
  const Packed a{packed};
  run_store_kv(a.i(0), a.ptr<const void>(1), a.i(2), a.i(3), a.ptr<const void>(4), a.i(5), a.i(6), a.ptr<void>(7),
               a.i(8), a.i(9), a.i(10), a.i(11), a.i(12), a.ptr<const int32_t>(13), a.ptr<const int32_t>(14), a.i(15),
               a.i(16), a.ptr<const int32_t>(17), a.i(18), a.i(19), static_cast<int>(a.i(20)));
}

void pkv_store_kv_fp8(const unsigned char* packed) {
  const Packed a{packed};
  run_store_kv_fp8(static_cast<int>(a.i(0)), a.ptr<const void>(1), a.i(2), a.i(3), a.ptr<const void>(4), a.i(5),
                   a.i(6), a.ptr<void>(7), static_cast<int>(a.i(8)), a.ptr<float>(9), a.i(10), a.i(11), a.i(12),
                   a.i(13), a.i(14), a.i(15), a.ptr<const int32_t>(16), a.ptr<const int32_t>(17), a.i(18), a.i(19),
                   a.ptr<const int32_t>(20), a.i(21), a.i(22), static_cast<int>(a.i(23)));
}

void pkv_gather_kv(const unsigned char* packed) {
  const Packed a{packed};
  run_gather_kv(a.i(0), a.ptr<const void>(1), a.i(2), a.i(3), a.i(4), a.i(5), a.i(6), a.ptr<const int32_t>(7),
                a.ptr<const int32_t>(8), a.i(9), a.i(10), a.ptr<const int32_t>(11), a.i(12), a.i(13), a.i(14),
                a.ptr<void>(15), a.ptr<void>(16), static_cast<int>(a.i(17)));
}

void pkv_gather_kv_fp8(const unsigned char* packed) {
  const Packed a{packed};
  run_gather_kv_fp8(a.ptr<const uint8_t>(0), static_cast<int>(a.i(1)), a.ptr<const float>(2), a.i(3), a.i(4), a.i(5),
                    a.i(6), a.i(7), a.i(8), a.ptr<const int32_t>(9), a.ptr<const int32_t>(10), a.i(11), a.i(12),
                    a.ptr<const int32_t>(13), a.i(14), a.i(15), a.i(16), a.ptr<float>(17), a.ptr<float>(18),
                    static_cast<int>(a.i(19)));
}

void pkv_copy_pages(const unsigned char* packed) {
  const Packed a{packed};
  run_copy_pages(a.ptr<void>(0), a.i(1), a.i(2), a.ptr<const int32_t>(3), a.ptr<const int32_t>(4), a.i(5),
                 static_cast<int>(a.i(6)));
}

int pkv_step_ok(const unsigned char* packed) {
  const Packed a{packed};
  return run_step_ok(a.ptr<const int32_t>(0), a.ptr<const int32_t>(1), a.i(2), a.i(3), a.i(4), a.ptr<const int32_t>(5),
                     a.i(6), a.i(7), a.i(8), a.i(9), static_cast<int>(a.i(10)), a.i(11));
}

}  // extern "C"
