// tiles_rows.h: the dot-product micro-kernels: scores and P V for a few query rows at a time, each
// row a vector along head_dim (decode-shaped items).
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include "kinds.h"
#include "read_ahead.h"

namespace {

constexpr int ROW_TILE = 4;  // query rows per micro-kernel tile

// FP8_*: the scales of a list of keys (each from kv head h0's first granule) and the elements per
// granule (a multiple of 2W dividing head_dim; a static pair: one granule spanning the item's heads).
// Unused by the other kinds.
struct Granules {
  const float* const* scales = nullptr;
  int64_t size = 0;
};

// S[r * ldS + t] = q_r . k_t for RT rows of `q` (fp32, row stride Dp, zero padded) and NT keys (for
// FP8_*: keys of the codes' values times their granules' scales, `gr` from the first key; FP8_*_DOT:
// the codes' values alone, the softmax applying the scales).
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
      for (int t = 0; t < NT; ++t) k[t] = (__m512bh)bf16_lanes<DT>(rows[t] + j * W);
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
      in_register(q0);
      in_register(q1);
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
// FP8_*: v_t's codes' values times their granules' scales, `gr` from the first key; FP8_*_DOT: the
// values alone, P holding the scales), a few
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
      // FP8_* (not _DOT): the granule of columns j, j + 1
      const int64_t at = is_fp8<DT>() && !bf16_dot<DT>() ? (ofs + j * W) / gr.size : 0;
      for (int t = t0; t < t1; ++t) {
        vf v0, v1;
        load2<DT>(vp[t - t0] + j * W, v0, v1);
        if constexpr (is_fp8<DT>() && !bf16_dot<DT>()) {
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

}  // namespace
