// vec.h: the vector width, GCC vector types, and the math on them (exp, softcap, horizontal
// sums, interleaving).
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Before a micro-kernel's loops over its accumulator array (constant trip counts): unrolled early,
// so that GCC keeps the accumulators in registers only. Without it GCC 12 zeroed a copy of the array
// on the stack, stored the registers back after the main loop and copied that to the output: three
// extra vector moves per accumulator and tile.
#define UNROLLED _Pragma("GCC unroll 32")

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
#else
constexpr int W = 8;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// Keeps x in a register for its uses that follow (AVX-512). GCC folds a vector loaded once and used
// by two FMAs into each as a memory operand: the fp32 score tile then loaded every query vector twice
// (20 loads per 16 FMAs instead of 12) and took 1.12-1.13x the time with its rows in cache. (An AVX2
// build on the same Zen 4: 1.00-1.03x, so there GCC keeps its choice.)
__attribute__((always_inline)) inline void in_register([[maybe_unused]] vf& x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#endif
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

// Scratch buffers start on cache lines, and with them every row whose stride is a multiple of 16
// floats (Dp with AVX-512, KEY_BLOCK): from a malloc'd buffer (16-byte aligned) each vector load of
// such a row straddled two lines (interleaved A/B, Zen 4, decode: 0.94-0.99x the time).
template <typename T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t LINE{64};
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), LINE)); }
  void deallocate(T* p, size_t) { ::operator delete(p, LINE); }
  friend bool operator==(const LineAligned&, const LineAligned&) { return true; }
  friend bool operator!=(const LineAligned&, const LineAligned&) { return false; }
};
using Floats = std::vector<float, LineAligned<float>>;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp(x) for x <= 0 (its callers': scores minus their max), about 2 ulp (Cephes' polynomial); 0
// below -87.3, so exp(-inf) = 0 and no subnormal comes out (FMAs that take one run far slower);
// NaN stays NaN. With AVX-512, `vscalefps` applies the power of two instead of the integer steps
// (fp32 prefill 0.99x the time, decode unchanged; identical outputs).
__attribute__((always_inline)) inline vf vexp(vf x) {
  const vi under = x < -87.3f;
  x = under ? splat(-87.3f) : x;
#if defined(__AVX512F__)
  const vf n = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
#endif
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * r * r + r + 1.0f;
#if defined(__AVX512F__)
  y = (vf)_mm512_scalef_ps((__m512)y, (__m512)n);
#else
  const vi e = (vi)t - (vi)splat(magic);
  y = y * (vf)((e + 127) << 23);
#endif
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

// The sum and the max of v's lanes, as trees of halves (GCC writes the loops as serial scalar chains:
// hsum is on the softmax's critical path, once per row and key block).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  const v4 q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}

inline float hmax(vf v) {  // (v holds no NaN)
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  const v4 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3), hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const v4 q = hi > lo ? hi : lo;
  return std::max(std::max(q[0], q[2]), std::max(q[1], q[3]));
#endif
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

// v[i][j] <-> v[j][i]: W vectors of W lanes transposed in registers (log2(W) rounds of pairing
// vector i with vector i + W/2 through `interleave`: the perfect shuffle).
__attribute__((always_inline)) inline void transpose(vf* v) {
#pragma GCC unroll 4
  for (int round = 1; round < W; round *= 2) {
    vf t[W];
#pragma GCC unroll 8
    for (int i = 0; i < W / 2; ++i) interleave(v[i], v[i + W / 2], t[2 * i], t[2 * i + 1]);
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) v[i] = t[i];
  }
}

}  // namespace
