// tiles_keys_major.h: the keys-major micro-kernels and their softmax: query rows along the lanes
// (prefill-shaped items).
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include <type_traits>

#include "kinds.h"
#include "read_ahead.h"

namespace {

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

// Qt of one head from its `count` query rows (rows[slot]): qt[d * rp + slot] = rows[slot][d] * scale,
// or for bf16_dot kinds each row's bf16 pair (d, d + 1) as it is, at 32-bit word (d / 2) * rp + slot.
// Blocks of W rows by W columns (elements or pairs) go through register transposes (F32 and
// bf16_dot kinds), the rest one element at a time.
template <int DT>
void queries_keys_major(const typename Storage<scalar_dtype<DT>()>::T* const* rows, int64_t count, int64_t D,
                        float scale, int64_t rp, float* qt) {
  constexpr bool pairs = bf16_dot<DT>();
  const int64_t cols = pairs ? D / 2 : D;  // 32-bit columns: fp32 elements or bf16 pairs
  const int64_t full_rows = DT == F32 || pairs ? count / W * W : 0, full_cols = cols / W * W;
  for (int64_t s0 = 0; s0 < full_rows; s0 += W) {
    for (int64_t c0 = 0; c0 < full_cols; c0 += W) {
      vf v[W];
      for (int i = 0; i < W; ++i) {
        std::memcpy(&v[i], reinterpret_cast<const char*>(rows[s0 + i]) + c0 * 4, sizeof v[i]);
        if constexpr (!pairs) v[i] *= scale;
      }
      transpose(v);
      for (int i = 0; i < W; ++i) store_f32(qt + (c0 + i) * rp + s0, v[i]);
    }
  }
  for (int64_t slot = 0; slot < count; ++slot) {
    for (int64_t c = slot < full_rows ? full_cols : 0; c < cols; ++c) {
      if constexpr (pairs) {
        std::memcpy(qt + c * rp + slot, rows[slot] + 2 * c, 4);
      } else {
        qt[c * rp + slot] = load_scalar<scalar_dtype<DT>()>(rows[slot] + c) * scale;
      }
    }
  }
}

// The reverse for one head's accumulators: o[slot * ldo + d] = ot[d * rp + slot] for its `count`
// rows.
inline void rows_from_keys_major(const float* ot, int64_t rp, int64_t count, int64_t D, float* o, int64_t ldo) {
  const int64_t full_rows = count / W * W, full_cols = D / W * W;
  for (int64_t s0 = 0; s0 < full_rows; s0 += W) {
    for (int64_t d0 = 0; d0 < full_cols; d0 += W) {
      vf v[W];
      for (int i = 0; i < W; ++i) v[i] = load_f32(ot + (d0 + i) * rp + s0);
      transpose(v);
      for (int i = 0; i < W; ++i) store_f32(o + (s0 + i) * ldo + d0, v[i]);
    }
  }
  for (int64_t slot = 0; slot < count; ++slot) {
    for (int64_t d = slot < full_rows ? full_cols : 0; d < D; ++d) o[slot * ldo + d] = ot[d * rp + slot];
  }
}

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

// acc[v] += x * y[v] for RV row vectors, x element 0 of p broadcast: one row of a tile's outer product.
template <int DT, int RV>
inline void fma_broadcast(vf (&acc)[RV], const typename Storage<DT>::T* p, const vf (&y)[RV]) {
  const vf x = bcast<DT>(p);
  UNROLLED
  for (int v = 0; v < RV; ++v) acc[v] += x * y[v];
}

// out[i * ld + v * W + lane] = acc[i][v]: a tile's accumulators, N rows of RV vectors, to memory.
template <int N, int RV>
inline void store_tile(const vf (&acc)[N][RV], float* out, int64_t ld) {
  UNROLLED
  for (int i = 0; i < N; ++i)
    UNROLLED
    for (int v = 0; v < RV; ++v) store_f32(out + i * ld + v * W, acc[i][v]);
}

// f(std::integral_constant<int, RV>()) for RV = rv, 1 <= rv <= KM_RV: a tile's count of row
// vectors as the template argument the tiles take (the last group of a head's rows may be short).
template <class F>
inline void with_row_vectors(int rv, const F& f) {
  switch (rv) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    default: f(std::integral_constant<int, KM_RV>()); break;
  }
}

// St[t * ldS + v * W + lane] = sum_d Qt[d][v * W + lane] * k_t[d] for RV row vectors of Qt (ldq
// lanes per d) and NT keys (rows kp[t] + ofs). bf16_dot kinds: Qt holds bf16 pairs (d, d + 1), ldq
// pairs per pair of d. One line of `share` issued per step of d.
template <int DT, int RV, int NT>
inline void qk_tile_km(const float* qt, int64_t ldq, const typename Storage<DT>::T* const* kp, int64_t ofs,
                       int64_t D, float* St, int64_t ldS, AheadShare share = {}) {
  using T = typename Storage<DT>::T;
  const T* rows[NT];
  UNROLLED
  for (int t = 0; t < NT; ++t) rows[t] = kp[t] + ofs;
#if defined(__AVX512BF16__)
  if constexpr (bf16_dot<DT>()) {
    const uint32_t* q2 = reinterpret_cast<const uint32_t*>(qt);
    __m512 acc[NT][RV];
    UNROLLED
    for (int t = 0; t < NT; ++t)
      UNROLLED
      for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
      __m512bh q[RV];
      UNROLLED
      for (int v = 0; v < RV; ++v) q[v] = (__m512bh)_mm512_loadu_si512(q2 + (d / 2) * ldq + v * W);
      UNROLLED
      for (int t = 0; t < NT; ++t) {
        uint32_t pair;
        std::memcpy(&pair, rows[t] + d, sizeof pair);
        const __m512bh k = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        UNROLLED
        for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], q[v], k);
      }
      share.issue(d / 2);
    }
    share.issue_from(D / 2);
    UNROLLED
    for (int t = 0; t < NT; ++t)
      UNROLLED
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(St + t * ldS + v * W, acc[t][v]);
    return;
  }
#endif
  vf acc[NT][RV];
  UNROLLED
  for (int t = 0; t < NT; ++t)
    UNROLLED
    for (int v = 0; v < RV; ++v) acc[t][v] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf q[RV];
    UNROLLED
    for (int v = 0; v < RV; ++v) q[v] = load_f32(qt + d * ldq + v * W);
    UNROLLED
    for (int t = 0; t < NT; ++t) fma_broadcast<DT>(acc[t], rows[t] + d, q);
    share.issue(d);
  }
  share.issue_from(D);
  store_tile(acc, St, ldS);
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
    with_row_vectors(rv, [&](auto rv_c) {
      constexpr int RV = decltype(rv_c)::value;
      int t = 0;
      for (; t + KM_NT <= n; t += KM_NT) {
        const char* lines[Ahead::MAX_LINES];
        qk_tile_km<DT, RV, KM_NT>(q, ldq, rows + t, ofs, D, st + t * ldS, ldS, {lines, ahead.next_lines(lines)});
      }
      for (; t + 2 <= n; t += 2) qk_tile_km<DT, RV, 2>(q, ldq, rows + t, ofs, D, st + t * ldS, ldS);
      for (; t < n; ++t) qk_tile_km<DT, RV, 1>(q, ldq, rows + t, ofs, D, st + t * ldS, ldS);
    });
  }
}

// Ot[j * ldo + v * W + lane] = Ot[...] * alpha[v * W + lane] + sum_t Pt[t * ldp + v * W + lane] * v_t[j]
// for RV row vectors, ND columns j of n V rows (vrows[t] + ofs). One line of `share` issued per key.
template <int DT, int RV, int ND>
inline void pv_tile_km(const float* pt, int64_t ldp, const typename Storage<DT>::T* const* vrows, int64_t ofs, int n,
                       const float* alpha, float* ot, int64_t ldo, AheadShare share = {}) {
  vf acc[ND][RV];
  UNROLLED
  for (int j = 0; j < ND; ++j)
    UNROLLED
    for (int v = 0; v < RV; ++v) acc[j][v] = load_f32(ot + j * ldo + v * W) * load_f32(alpha + v * W);
  for (int t = 0; t < n; ++t) {
    vf p[RV];
    UNROLLED
    for (int v = 0; v < RV; ++v) p[v] = load_f32(pt + t * ldp + v * W);
    const typename Storage<DT>::T* row = vrows[t] + ofs;
    UNROLLED
    for (int j = 0; j < ND; ++j) fma_broadcast<DT>(acc[j], row + j, p);
    share.issue(t);
  }
  share.issue_from(n);
  store_tile(acc, ot, ldo);
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
    with_row_vectors(rv, [&](auto rv_c) {
      constexpr int RV = decltype(rv_c)::value;
      int64_t d = 0;
      for (; d + KM_ND <= D; d += KM_ND) {
        const char* lines[Ahead::MAX_LINES];
        pv_tile_km<DT, RV, KM_ND>(pt, ldp, rows, ofs + d, n, al, ot + d * ldo, ldo, {lines, ahead.next_lines(lines)});
      }
      for (; d + 2 <= D; d += 2) pv_tile_km<DT, RV, 2>(pt, ldp, rows, ofs + d, n, al, ot + d * ldo, ldo);
      for (; d < D; ++d) pv_tile_km<DT, RV, 1>(pt, ldp, rows, ofs + d, n, al, ot + d * ldo, ldo);
    });
  }
}

// The online softmax step of one row vector over its keys-major scores St[t * ldS] (t < n, key
// positions k0 + t): key t's scale k_scale[t] (if given), scale (`scale` != 1), softcap, the rows'
// masks [lo, hi), then P in place, times v_scale[t] (if given) after the sum; m and l are the rows'
// running max and sum, alpha gets the factor for their accumulators. (k_scale, v_scale: FP8 codes
// staged as bf16 values, one scale per key and kv head.)
inline void softmax_keys_major(float* st, int64_t ldS, int n, int64_t k0, const int32_t* lo, const int32_t* hi,
                               float* m, float* l, float* alpha, float scale, float softcap,
                               const float* k_scale = nullptr, const float* v_scale = nullptr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  vi vlo, vhi;
  std::memcpy(&vlo, lo, sizeof vlo);
  std::memcpy(&vhi, hi, sizeof vhi);
  const vf m_old = load_f32(m);
  vf mx = m_old;
  for (int t = 0; t < n; ++t) {
    vf x = load_f32(st + t * ldS);
    if (k_scale) x *= k_scale[t];
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
    sum += p;
    store_f32(st + t * ldS, v_scale ? p * v_scale[t] : p);
  }
  const vf a = vexp(m_old - base);
  store_f32(l, load_f32(l) * a + sum);
  store_f32(m, mx);
  store_f32(alpha, a);
}

}  // namespace
