// mla_attention.h: absorbed MLA attention over a latent pool: multi-query attention with one KV row
// per key, the key the whole row [latent; rope], the value its latent; dense (causal or not) or
// sparse (the positions key_positions lists), sinks.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
//
// Work items: (sequence, a block of its new tokens, a block of heads, a range of key positions, or
// of key_positions entries); every query row (token x head) of an item reads each key row once. Per
// block of MLA_KEYS keys the rows are converted once to fp32 (FP8 latent: code value times its
// scale, the reference's product; rope from bf16) into a staged block, then scores = Q K^T (rows x
// keys tiles accumulated along the row, fp32), mask, online softmax, O += P V (rows x latent-column
// tiles): small GEMMs whose M is the item's rows (padded to whole 4-row tiles). With AVX512-BF16,
// bf16 queries over bf16 rows or FP8 latents of one scale per token take the scores as bf16 dot
// products instead (mla_scores_dot: the rows also staged as bf16 values). Key ranges are split over
// items when there are too few items for the threads (decode), and the parts merged (work_split.h).
#pragma once

#include <algorithm>
#include <vector>

#include "args.h"
#include "attention.h"
#include "parallel.h"
#include "work_split.h"

namespace {

constexpr int MLA_KEYS = 32;        // keys per staged block
constexpr int64_t MLA_ROWS = 64;    // query rows (token x head) an item aims for
constexpr int MLA_SCORE_KEYS = W == 16 ? 4 : 2;  // keys per score tile (registers: 4 x this + this + 1)
constexpr int MLA_VALUE_VECS = W == 16 ? 4 : 2;  // latent vectors per P V tile
constexpr int MLA_LDS = (MLA_KEYS + W - 1) / W * W;  // stride of a row of scores

struct MlaItem {
  int32_t b, t0, nt, h0, nh;  // sequence, its new tokens [t0, t0 + nt), heads [h0, h0 + nh)
  int64_t k0, k1;             // key positions [k0, k1) (sparse: entries of the query's key_positions row)
  int64_t part, task;         // a split: the slot of its partial rows and its task, else -1
};

struct MlaCall {  // one call's arguments, as the items read them
  const PkvMlaAttentionArgs* in;
  int64_t rank, rope, Rp, Dp;  // row widths: latent, rope, the latent padded to whole P V tiles, Rp + rope padded to W
  int64_t width, itemsize;     // of a pool row, in elements of blocks
  int64_t gran;                // FP8: latent elements per scale
  float scale;
  // a pool row (its element offset slot * width) as fp32 into dst[0, Dp): latent, zeros to Rp, rope, zeros
  void (*stage)(const MlaCall&, const char* row, int64_t slot, float* dst);
  // bf16 dot-product scores (mla_scores_dot): rows of Db bf16 values, the latent's padded to Rb; a pool row as
  // such values (FP8: the codes', exact) into dst, and *scale the latent's scale (1 for a bf16 pool)
  bool dot;
  int64_t Rb, Db;
  void (*stage_dot)(const MlaCall&, const char* row, int64_t slot, uint16_t* dst, float* scale);

  // The key limit [0, hi) of new token t of sequence b.
  int64_t key_end(int64_t b, int64_t t) const {
    const int64_t cached = in->cache_lengths[b];
    return in->causal ? cached + t + 1 : cached + in->offsets[b + 1] - in->offsets[b];
  }
  // The element offset / width of position pos of sequence b (page ids clamped into the pool).
  int64_t slot(int64_t b, int64_t pos) const {
    const int64_t col = std::min(pos / in->page_size, in->table_width - 1);
    const int64_t page = std::clamp<int64_t>(in->table[b * in->table_stride + col], 0, in->num_pages - 1);
    return (page * in->num_layers + in->layer) * in->page_size + pos % in->page_size;
  }
};

template <int KIND>
void stage_row(const MlaCall& c, const char* row, int64_t slot, float* dst) {
  if constexpr (is_fp8<KIND>()) {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(row);
    const int64_t groups = c.in->scale_groups;
    for (int64_t g0 = 0; g0 < c.rank; g0 += c.gran) {
      const float s = groups ? c.in->scales[slot * groups + g0 / c.gran] : c.in->scales[0];
      dequantize<fp8_format<KIND>()>(codes + g0, c.gran, s, dst + g0);
    }
    widen<BF16>(reinterpret_cast<const uint16_t*>(codes + c.rank), c.rope, dst + c.Rp);
  } else {
    const auto* x = reinterpret_cast<const typename Storage<KIND>::T*>(row);
    widen<KIND>(x, c.rank, dst);
    widen<KIND>(x + c.rank, c.rope, dst + c.Rp);
  }
  std::fill(dst + c.rank, dst + c.Rp, 0.0f);
  std::fill(dst + c.Rp + c.rope, dst + c.Dp, 0.0f);
}

#if defined(__AVX512BF16__)
// Scores as bf16 dot products (vdpbf16ps: 32 exact products per instruction, summed in fp32): bf16
// queries over a bf16 pool, or over FP8 latents of one scale per token or a static one, whose codes
// are exact in bf16 and whose scale multiplies the latent's part of each score. Half the multiply-adds
// of the fp32 tiles for Q K^T; P V stays fp32 on the fp32 block.
constexpr int64_t DOT = 2 * W;  // bf16 values per vector

template <int KIND>
void stage_dot(const MlaCall& c, const char* row, int64_t slot, uint16_t* dst, float* scale) {
  const uint16_t* rope;
  if constexpr (is_fp8<KIND>()) {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(row);
    fp8_to_bf16<fp8_format<KIND>()>(codes, c.rank, dst);  // (rank a multiple of DOT)
    *scale = c.in->scale_groups ? c.in->scales[slot] : c.in->scales[0];
    rope = reinterpret_cast<const uint16_t*>(codes + c.rank);
  } else {
    std::memcpy(dst, row, c.rank * 2);
    *scale = 1.0f;
    rope = reinterpret_cast<const uint16_t*>(row) + c.rank;
  }
  std::fill(dst + c.rank, dst + c.Rb, uint16_t{0});
  std::memcpy(dst + c.Rb, rope, c.rope * 2);
  std::fill(dst + c.Rb + c.rope, dst + c.Db, uint16_t{0});
}

// S[r][n] = scale * (ks[n] * Q[r][0, Rb) . K[n][0, Rb) + Q[r][Rb, Db) . K[n][Rb, Db)) for R rows and N
// keys of bf16 values (rows Db apart; ks null: 1).
template <int R, int N>
__attribute__((noinline)) void mla_scores_dot(const uint16_t* Q, const uint16_t* K, int64_t Rb, int64_t Db,
                                               const float* ks, float scale, float* S) {
  __m512 acc[R * N];
  UNROLLED for (int i = 0; i < R * N; ++i) acc[i] = _mm512_setzero_ps();
  auto span = [&](int64_t d0, int64_t d1) {
    for (int64_t d = d0; d < d1; d += DOT) {
      __m512bh k[N];
      UNROLLED for (int n = 0; n < N; ++n) k[n] = (__m512bh)_mm512_loadu_si512(K + n * Db + d);
      UNROLLED for (int r = 0; r < R; ++r) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(Q + r * Db + d);
        UNROLLED for (int n = 0; n < N; ++n) acc[r * N + n] = _mm512_dpbf16_ps(acc[r * N + n], q, k[n]);
      }
    }
  };
  span(0, Rb);
  if (ks != nullptr) {
    UNROLLED for (int r = 0; r < R; ++r) {
      UNROLLED for (int n = 0; n < N; ++n) acc[r * N + n] = _mm512_mul_ps(acc[r * N + n], _mm512_set1_ps(ks[n]));
    }
  }
  span(Rb, Db);
  static_assert(R * N % 8 == 0, "the sums go 8 at a time");
  for (int i = 0; i < R * N; i += 8) {
    float sums[8];
    hsum8(reinterpret_cast<const vf*>(acc + i), sums);
    for (int j = 0; j < 8; ++j) S[(i + j) / N * MLA_LDS + (i + j) % N] = sums[j] * scale;
  }
}
#endif

// S[r][n] = Q[r] . K[n] for R rows and N keys (rows Dp floats apart), accumulated along the row.
template <int R, int N>
__attribute__((noinline)) void mla_scores(const float* Q, const float* K, int64_t Dp, float* S) {
  vf acc[R * N] = {};
  for (int64_t d = 0; d < Dp; d += W) {
    vf k[N];
    UNROLLED for (int n = 0; n < N; ++n) k[n] = load_f32(K + n * Dp + d);
    UNROLLED for (int r = 0; r < R; ++r) {
      const vf q = load_f32(Q + r * Dp + d);
      UNROLLED for (int n = 0; n < N; ++n) acc[r * N + n] += q * k[n];
    }
  }
  static_assert(R * N % 8 == 0, "the sums go 8 at a time");
  for (int i = 0; i < R * N; i += 8) {
    float sums[8];
    hsum8(acc + i, sums);
    for (int j = 0; j < 8; ++j) S[(i + j) / N * MLA_LDS + (i + j) % N] = sums[j];
  }
}

// O[r][0, C W) += sum over keys j < n of P[r][j] V[j][0, C W), for R rows (O rows ldO apart, V rows Dp).
template <int R, int C>
__attribute__((noinline)) void mla_values(const float* P, const float* V, int64_t Dp, int n, float* O, int64_t ldO) {
  vf acc[R * C];
  UNROLLED for (int r = 0; r < R; ++r) {
    UNROLLED for (int c = 0; c < C; ++c) acc[r * C + c] = load_f32(O + r * ldO + c * W);
  }
  for (int j = 0; j < n; ++j) {
    vf v[C];
    UNROLLED for (int c = 0; c < C; ++c) v[c] = load_f32(V + j * Dp + c * W);
    UNROLLED for (int r = 0; r < R; ++r) {
      const vf p = splat(P[r * MLA_LDS + j]);
      UNROLLED for (int c = 0; c < C; ++c) acc[r * C + c] += p * v[c];
    }
  }
  UNROLLED for (int r = 0; r < R; ++r) {
    UNROLLED for (int c = 0; c < C; ++c) store_f32(O + r * ldO + c * W, acc[r * C + c]);
  }
}

// mla_values over an item's rows (a multiple of 4), MLA_VALUE_VECS latent vectors at a time.
inline void mla_values_rows(int64_t rows, const float* S, const float* V, int64_t Dp, int n, float* O, int64_t ldO) {
  for (int64_t r = 0; r < rows; r += 4) mla_values<4, MLA_VALUE_VECS>(S + r * MLA_LDS, V, Dp, n, O + r * ldO, ldO);
}

struct MlaScratch {
  Floats q, o, s, k, m, l, ks;
  std::vector<int64_t> hi, positions;
  std::vector<uint16_t, LineAligned<uint16_t>> qb, kb;  // mla_dot: the queries and keys as bf16 values
};
thread_local MlaScratch tls_mla;

// One item: its rows' queries (scaled, fp32), then per block of keys: stage, scores, mask, online
// softmax, P V; the rows normalised into out, or (a split) kept unnormalised with their max and sum.
void mla_item(const MlaCall& c, const MlaItem& it, float* partials, int64_t part_stride) {
  const PkvMlaAttentionArgs& a = *c.in;
  const int64_t rows = static_cast<int64_t>(it.nt) * it.nh, Dp = c.Dp, Rp = c.Rp;
  const int64_t tiled = round_up(rows, 4);  // the tiles' rows: the queries of rows past `rows` are zeros
  MlaScratch& sc = tls_mla;
  if (static_cast<int64_t>(sc.q.size()) < tiled * Dp) sc.q.resize(tiled * Dp);
  if (static_cast<int64_t>(sc.o.size()) < tiled * Rp) sc.o.resize(tiled * Rp);
  if (static_cast<int64_t>(sc.s.size()) < tiled * MLA_LDS) sc.s.resize(tiled * MLA_LDS);
  if (static_cast<int64_t>(sc.k.size()) < MLA_KEYS * Dp) sc.k.resize(MLA_KEYS * Dp);
  sc.m.resize(rows);
  sc.l.resize(rows);
  sc.hi.resize(rows);
  if (c.dot) {
    if (static_cast<int64_t>(sc.qb.size()) < tiled * c.Db) sc.qb.resize(tiled * c.Db);
    std::fill(sc.qb.data() + rows * c.Db, sc.qb.data() + tiled * c.Db, uint16_t{0});
    if (static_cast<int64_t>(sc.kb.size()) < MLA_KEYS * c.Db) sc.kb.resize(MLA_KEYS * c.Db);
    sc.ks.resize(MLA_KEYS);
  }
  float *Q = sc.q.data(), *O = sc.o.data(), *S = sc.s.data(), *K = sc.k.data(), *M = sc.m.data(), *L = sc.l.data();
  std::fill(Q + rows * Dp, Q + tiled * Dp, 0.0f);
  std::fill(O + rows * Rp, O + tiled * Rp, 0.0f);
  const int64_t row0 = a.offsets[it.b] + it.t0;  // the item's first query row
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q_row = row0 + r / it.nh, head = it.h0 + r % it.nh;
    float* q = Q + r * Dp;
    const int64_t at = q_row * a.q_nope_stride_row + head * a.q_nope_stride_head;
    const int64_t at_rope = q_row * a.q_rope_stride_row + head * a.q_rope_stride_head;
    if (c.dot) {  // the bf16 values as they are (unscaled), zero padded
      uint16_t* qb = sc.qb.data() + r * c.Db;
      std::memcpy(qb, static_cast<const uint16_t*>(a.q_nope) + at, c.rank * 2);
      std::fill(qb + c.rank, qb + c.Rb, uint16_t{0});
      if (c.rope) std::memcpy(qb + c.Rb, static_cast<const uint16_t*>(a.q_rope) + at_rope, c.rope * 2);
      std::fill(qb + c.Rb + c.rope, qb + c.Db, uint16_t{0});
    }
    switch (c.dot ? -1 : a.dtype) {
      case -1: break;
      case F32:
        widen<F32>(static_cast<const float*>(a.q_nope) + at, c.rank, q);
        if (c.rope) widen<F32>(static_cast<const float*>(a.q_rope) + at_rope, c.rope, q + Rp);
        break;
      case BF16:
        widen<BF16>(static_cast<const uint16_t*>(a.q_nope) + at, c.rank, q);
        if (c.rope) widen<BF16>(static_cast<const uint16_t*>(a.q_rope) + at_rope, c.rope, q + Rp);
        break;
      default:
        widen<F16>(static_cast<const uint16_t*>(a.q_nope) + at, c.rank, q);
        if (c.rope) widen<F16>(static_cast<const uint16_t*>(a.q_rope) + at_rope, c.rope, q + Rp);
        break;
    }
    if (!c.dot) {
      std::fill(q + c.rank, q + Rp, 0.0f);
      std::fill(q + Rp + c.rope, q + Dp, 0.0f);
      for (int64_t d = 0; d < Dp; d += W) store_f32(q + d, load_f32(q + d) * splat(c.scale));
    }
    std::fill(O + r * Rp, O + (r + 1) * Rp, 0.0f);
    M[r] = -std::numeric_limits<float>::infinity();
    L[r] = 0.0f;
    sc.hi[r] = c.key_end(it.b, it.t0 + r / it.nh);
  }
  // The keys: dense, positions [k0, k1) (rows mask past their end); sparse, the listed positions of
  // entries [k0, k1) that the query may see (-1 and anything past its end left out: never read).
  const bool sparse = a.key_positions != nullptr;
  std::vector<int64_t>& positions = sc.positions;
  int64_t keys = it.k1 - it.k0;
  if (sparse) {
    positions.clear();
    const int32_t* listed = a.key_positions + row0 * a.top_k;
    for (int64_t e = it.k0; e < it.k1; ++e) {
      if (listed[e] >= 0 && listed[e] < sc.hi[0]) positions.push_back(listed[e]);
    }
    keys = static_cast<int64_t>(positions.size());
  }
  const char* base = static_cast<const char*>(a.blocks);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j0 = 0; j0 < keys; j0 += MLA_KEYS) {
    const int n = static_cast<int>(std::min<int64_t>(MLA_KEYS, keys - j0));
    const int n_pad = static_cast<int>(round_up(n, MLA_SCORE_KEYS));
    for (int j = 0; j < n; ++j) {
      const int64_t slot = c.slot(it.b, sparse ? positions[j0 + j] : it.k0 + j0 + j);
      const char* row = base + slot * c.width * c.itemsize;
      c.stage(c, row, slot, K + j * Dp);
      if (c.dot) c.stage_dot(c, row, slot, sc.kb.data() + j * c.Db, sc.ks.data() + j);
    }
    std::fill(K + n * Dp, K + n_pad * Dp, 0.0f);
    if (c.dot) {
      std::fill(sc.kb.data() + n * c.Db, sc.kb.data() + n_pad * c.Db, uint16_t{0});
      std::fill(sc.ks.data() + n, sc.ks.data() + n_pad, 0.0f);
    }
    // scores
#if defined(__AVX512BF16__)
    // (keys outer: a tile's keys stay in L1 while every row group reads them)
    for (int j = 0; c.dot && j < n_pad; j += MLA_SCORE_KEYS) {
      const uint16_t* k = sc.kb.data() + j * c.Db;
      const float* ks = a.fp8 ? sc.ks.data() + j : nullptr;
      for (int64_t r = 0; r < tiled; r += 4) {
        mla_scores_dot<4, MLA_SCORE_KEYS>(sc.qb.data() + r * c.Db, k, c.Rb, c.Db, ks, c.scale, S + r * MLA_LDS + j);
      }
    }
#endif
    for (int j = 0; !c.dot && j < n_pad; j += MLA_SCORE_KEYS) {
      for (int64_t r = 0; r < tiled; r += 4) {
        mla_scores<4, MLA_SCORE_KEYS>(Q + r * Dp, K + j * Dp, Dp, S + r * MLA_LDS + j);
      }
    }
    // mask, online softmax
    const int nv = static_cast<int>(round_up(n, W));
    for (int64_t r = 0; r < rows; ++r) {
      float* s = S + r * MLA_LDS;
      const int seen = sparse ? n : static_cast<int>(std::clamp<int64_t>(sc.hi[r] - (it.k0 + j0), 0, n));
      std::fill(s + seen, s + nv, ninf);
      vf vmax = splat(ninf);
      for (int t = 0; t < nv; t += W) {
        const vf x = load_f32(s + t);
        vmax = x > vmax ? x : vmax;
      }
      const float m_new = std::max(M[r], hmax(vmax));
      if (m_new == ninf) {  // no key yet
        std::fill(s, s + nv, 0.0f);
        continue;
      }
      const float alpha = m_new == M[r] ? 1.0f : std::exp(M[r] - m_new);
      vf sum = vf{};
      for (int t = 0; t < nv; t += W) {
        const vf p = vexp(load_f32(s + t) - m_new);
        sum += p;
        store_f32(s + t, p);
      }
      L[r] = L[r] * alpha + hsum(sum);
      M[r] = m_new;
      if (alpha != 1.0f) {
        float* o = O + r * Rp;
        for (int64_t d = 0; d < Rp; d += W) store_f32(o + d, load_f32(o + d) * splat(alpha));
      }
    }
    // O += P V, the value being each key's latent
    for (int64_t d = 0; d < Rp; d += MLA_VALUE_VECS * W) mla_values_rows(tiled, S, K + d, Dp, n, O + d, Rp);
  }
  if (it.part >= 0) {  // a split: the unnormalised rows, their max and sum
    float* dst = partials + it.part * part_stride;
    std::memcpy(dst, O, rows * Rp * sizeof(float));
    std::memcpy(dst + rows * Rp, M, rows * sizeof(float));
    std::memcpy(dst + rows * Rp + rows, L, rows * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = it.h0 + r % it.nh;
    float l = L[r];
    if (a.sinks != nullptr) l += std::exp(a.sinks[head] - M[r]);  // (no key: M = -inf, l = inf, the row 0)
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    void* out = static_cast<char*>(a.out) + ((row0 + r / it.nh) * a.q_heads + head) * c.rank * (a.dtype == F32 ? 4 : 2);
    switch (a.dtype) {
      case F32: store_out<F32>(static_cast<float*>(out), O + r * Rp, static_cast<int>(c.rank), inv); break;
      case BF16: store_out<BF16>(static_cast<uint16_t*>(out), O + r * Rp, static_cast<int>(c.rank), inv); break;
      default: store_out<F16>(static_cast<uint16_t*>(out), O + r * Rp, static_cast<int>(c.rank), inv); break;
    }
  }
}

// The parts of a split item merged into out.
void mla_merge(const MlaCall& c, const SplitTask<MlaItem>& task, const float* partials, int64_t part_stride) {
  const PkvMlaAttentionArgs& a = *c.in;
  const MlaItem& span = task.span;
  const int64_t first = task.first, parts = task.parts;
  const int64_t rows = static_cast<int64_t>(span.nt) * span.nh, Rp = c.Rp;
  Floats& acc = tls_merged_row;
  if (static_cast<int64_t>(acc.size()) < Rp) acc.resize(Rp);
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < parts; ++s) m = std::max(m, partials[(first + s) * part_stride + rows * Rp + r]);
    std::fill(acc.begin(), acc.begin() + Rp, 0.0f);
    float l = 0.0f;
    for (int64_t s = 0; s < parts; ++s) {
      const float* src = partials + (first + s) * part_stride;
      const float ls = src[rows * Rp + rows + r];
      if (ls == 0.0f) continue;
      const float w = std::exp(src[rows * Rp + r] - m);
      l += ls * w;
      for (int64_t d = 0; d < Rp; d += W) {
        store_f32(acc.data() + d, load_f32(acc.data() + d) + load_f32(src + r * Rp + d) * splat(w));
      }
    }
    const int64_t head = span.h0 + r % span.nh;
    if (a.sinks != nullptr) l += std::exp(a.sinks[head] - m);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t q_row = a.offsets[span.b] + span.t0 + r / span.nh;
    void* out = static_cast<char*>(a.out) + (q_row * a.q_heads + head) * c.rank * (a.dtype == F32 ? 4 : 2);
    switch (a.dtype) {
      case F32: store_out<F32>(static_cast<float*>(out), acc.data(), static_cast<int>(c.rank), inv); break;
      case BF16: store_out<BF16>(static_cast<uint16_t*>(out), acc.data(), static_cast<int>(c.rank), inv); break;
      default: store_out<F16>(static_cast<uint16_t*>(out), acc.data(), static_cast<int>(c.rank), inv); break;
    }
  }
}

void run_mla_attention(const PkvMlaAttentionArgs& a) {
  MlaCall c;
  c.in = &a;
  c.rank = a.rank;
  c.rope = a.rope_dim;
  c.Rp = round_up(a.rank, MLA_VALUE_VECS * W);  // (whole P V tiles)
  c.Dp = c.Rp + round_up(a.rope_dim, W);
  c.width = a.head_dim;
  c.itemsize = a.fp8 ? 1 : a.dtype == F32 ? 4 : 2;  // (a plain pool has the queries' dtype)
  c.gran = a.scale_groups ? a.rank / a.scale_groups : a.rank;
  c.scale = static_cast<float>(a.scale);
  c.stage = nullptr;
  c.dot = false;
  c.Rb = round_up(a.rank, 2 * W);
  c.Db = c.Rb + round_up(a.rope_dim, 2 * W);
  c.stage_dot = nullptr;
#if defined(__AVX512BF16__)
  if (a.dtype == BF16 && !a.fp8) {
    c.dot = true;
    c.stage_dot = stage_dot<BF16>;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)  // (fp8_to_bf16's byte tables)
  if (a.dtype == BF16 && a.fp8 && a.scale_groups <= 1 && a.rank % DOT == 0) {
    c.dot = true;
    c.stage_dot = a.fp8 == E4M3FN ? stage_dot<FP8_E4M3FN> : stage_dot<FP8_E5M2>;
  }
#endif
  const int64_t H = a.q_heads;
  const bool sparse = a.key_positions != nullptr;
  // Items of about MLA_ROWS rows: every head of a few tokens, or (many heads) blocks of heads of one token.
  const int64_t head_blocks = (H + MLA_ROWS - 1) / MLA_ROWS, per_block = (H + head_blocks - 1) / head_blocks;
  const int64_t tokens = sparse ? 1 : std::max<int64_t>(1, MLA_ROWS / H);
  WorkSplit<MlaItem>& w = thread_work_split<MlaItem>();
  std::vector<MlaItem>& spans = w.spans;
  spans.clear();
  double work = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t new_b = a.offsets[b + 1] - a.offsets[b];
    for (int64_t t0 = 0; t0 < new_b; t0 += tokens) {
      const int64_t nt = std::min(tokens, new_b - t0);
      const int64_t k1 = sparse ? a.top_k : c.key_end(b, t0 + nt - 1);
      work += static_cast<double>(k1) * nt * H * (c.Dp + c.Rp);
      for (int64_t h0 = 0; h0 < H; h0 += per_block) {
        spans.push_back({static_cast<int32_t>(b), static_cast<int32_t>(t0), static_cast<int32_t>(nt),
                         static_cast<int32_t>(h0), static_cast<int32_t>(std::min(per_block, H - h0)), 0, k1, -1, -1});
      }
    }
  }
  const int threads = thread_count(static_cast<int>(a.threads), work, static_cast<double>(a.min_work));
  split_spans(w, a.min_split, a.want_items, threads, MLA_KEYS, c.Rp,
              [](const MlaItem& sp) { return static_cast<int64_t>(sp.nt) * sp.nh; });
  switch (a.fp8 ? (a.fp8 == E4M3FN ? FP8_E4M3FN : FP8_E5M2) : static_cast<int>(a.dtype)) {
    case FP8_E4M3FN: c.stage = stage_row<FP8_E4M3FN>; break;
    case FP8_E5M2: c.stage = stage_row<FP8_E5M2>; break;
    case F32: c.stage = stage_row<F32>; break;
    case BF16: c.stage = stage_row<BF16>; break;
    default: c.stage = stage_row<F16>; break;
  }
  run_items(
      w, threads, [&](const MlaItem& it, float* pp, int64_t part_stride) { mla_item(c, it, pp, part_stride); },
      [&](const SplitTask<MlaItem>& task, const float* pp, int64_t part_stride) {
        mla_merge(c, task, pp, part_stride);
      });
}

}  // namespace
