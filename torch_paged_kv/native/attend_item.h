// attend_item.h: one work item of flash_attention (one sequence, some of its kv heads, a block of
// its new tokens, a range of key positions): its query rows, then per key block the scores, the
// mask, an online softmax and P V, with the next block's rows read ahead.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include <vector>

#include "tiles_keys_major.h"
#include "tiles_rows.h"

namespace {

constexpr int KEY_BLOCK = 128;  // most key positions per softmax block (a multiple of W)

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
  const float* sinks;    // one logit per query head joining each row's softmax denominator, or null
  int64_t chunk;         // chunked local attention: keys in the query's chunk of this many positions (0: off)
  const int64_t* tree;   // a tree step: per query row, bit t set iff it sees its sequence's new token t; or null

  // 1 / the softmax denominator of a row of query head `q_head` whose scores have max m and sum of
  // exp(score - m) l: the head's sink logit joins the sum (0 where the row saw nothing).
  float inverse_denominator(int64_t q_head, float m, float l) const {
    if (sinks != nullptr) l += std::exp(sinks[q_head] - m);  // m = -inf (no key): l = inf, the row is 0
    return l > 0.0f ? 1.0f / l : 0.0f;
  }
};

struct Item {
  int32_t b, h0, h1, q0, nq;  // sequence, kv heads [h0, h1), first new token and count
  int64_t k0, k1;             // key positions [k0, k1) this item covers
  int64_t part;               // slot of its partial result when the key range is split, else -1
  int64_t task;               // then: the task that merges the parts
};

struct Tile {  // query rows [r0, r0 + rt) of an item, of the kv head at column `ofs` of a row
  int64_t r0, ofs;
  int rt;
};

struct Scratch {
  std::vector<Tile> tiles;
  Floats q, o, s, m, l;
  std::vector<int64_t> lo, hi;
  std::vector<const void*> kp, vp;
  std::vector<const void*> q_rows;  // keys-major items: each row's query
  std::vector<const float*> ks, vs;  // FP8_*: the K and V scales of each key (at kv head h0)
  Floats deq;  // staged FP8 pools: K and V of the current and the next key block, dequantized (F32)
               // or as bf16 codes (BF16_PAIRS)
  Floats block_scales;  // scales on scores and probabilities: per kv head, the K then the V scale of
                        // each key of the block (zeros after)
  // Keys-major items: Qt per head, and per head and row (rows padded to W): running max and sum,
  // key range, and the last block's accumulator factors.
  Floats qt, ot, km_m, km_l, km_alpha;
  std::vector<int32_t> km_lo, km_hi;
  void reserve(int64_t rows, int64_t Dp) {
    if (static_cast<int64_t>(m.size()) < rows) {
      m.resize(rows);
      l.resize(rows);
      lo.resize(rows);
      hi.resize(rows);
      s.resize(rows * KEY_BLOCK);
      q_rows.resize(rows);
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

// A tree step's position of new token t of sequence b, as a query and as a key: cached + its depth - 1
// (depth: the bits of its mask, itself and its ancestors; a mask that also names later tokens, which
// the checks take, puts it past its place in the step, cached + t).
inline int64_t tree_position(const AttnArgs& a, int64_t b, int64_t t) {
  const int64_t depth = __builtin_popcountll(static_cast<uint64_t>(a.tree[a.offsets[b] + t]));
  return a.cache_lengths[b] + depth - 1;
}

// The first key index a query at position `pos` may see: by its window, then its chunk.
inline int64_t first_key(const AttnArgs& a, int64_t pos) {
  int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  if (a.chunk > 0) lo = std::max(lo, pos / a.chunk * a.chunk);
  return lo;
}

// The key indices [lo, hi) that new token i of sequence b may see. In a tree step windows and chunks
// are measured from the node's position p (tree_position) and cover the cached keys in
// [p - window + 1, p] and p's chunk; every new key stays in the range (a new key's position need not
// be at most its index), masked by mask_tree. lo is never below the step's first token's (position
// cached): no page before what that token needs (which a sliding group's manager may have released)
// is read, even where an unchecked mask lacks a row's own bit (depth 0: p = cached - 1).
inline void key_range(const AttnArgs& a, int64_t b, int64_t i, int64_t* lo, int64_t* hi) {
  int64_t cached = a.cache_lengths[b];
  int64_t kv_len = cached + (a.offsets[b + 1] - a.offsets[b]);
  int64_t pos = cached + i;
  *hi = a.causal ? pos + 1 : kv_len;
  if (a.tree == nullptr) {
    *lo = first_key(a, pos);
    if (a.chunk > 0) *hi = std::min(*hi, pos / a.chunk * a.chunk + a.chunk);  // the query's chunk only
    return;
  }
  // (a tree's new keys: positions up to the chunk's end at any index, left to mask_tree)
  *lo = std::clamp(first_key(a, tree_position(a, b, i)), first_key(a, cached), cached);
}

constexpr int64_t ROWS_PER_ITEM = 64;       // query rows (token x q head) an item aims for
constexpr int64_t BLOCK_BYTES = 128 << 10;  // K + V bytes of one key block of an item (L2-sized)

// A tree step: row `token` of item `it` sees its sequence's new token t (key index cached + t) only
// where bit t of its tree mask is set (t < 64) and, by positions (tree_position), t is inside the
// row's window and chunk; scores s[a0, a1) are those of keys k0 + a0 ... (cached keys in the row's
// key_range all pass its window and chunk: no mask on them).
inline void mask_tree(const AttnArgs& a, const Item& it, int64_t token, int64_t k0, int64_t a0, int64_t a1, float* s) {
  const int64_t cached = a.cache_lengths[it.b];
  const uint64_t bits = static_cast<uint64_t>(a.tree[a.offsets[it.b] + it.q0 + token]);
  const bool by_position = a.window > 0 || a.chunk > 0;
  const int64_t p = by_position ? tree_position(a, it.b, it.q0 + token) : 0;
  for (int64_t t = std::max(a0, cached - k0); t < a1; ++t) {
    const int64_t j = k0 + t - cached;  // the key's index among the new tokens
    bool seen = j < 64 && ((bits >> j) & 1u);
    if (seen && by_position) {
      const int64_t pj = tree_position(a, it.b, j);
      seen = (a.window <= 0 || p - pj < a.window) && (a.chunk <= 0 || p / a.chunk == pj / a.chunk);
    }
    if (!seen) s[t] = -std::numeric_limits<float>::infinity();
  }
}

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
  // An FP8 pool read through staged blocks: dequantized (F32), or the codes' bf16 values
  // (BF16_PAIRS, for FP8_*_DOT's keys-major items).
  constexpr bool bf16_codes = DT == BF16_PAIRS && fp8_dot_kinds();
  const bool staged = (DT == F32 || bf16_codes) && a.fp8;
  // One scale per token and kv head (or a static pair) applied to scores and probabilities instead of
  // to each element of K and V: FP8_*_DOT and its staged bf16 codes.
  const bool scales_in_softmax = (is_fp8<DT>() && bf16_dot<DT>()) || (bf16_codes && a.fp8);
  const Geometry& g = a.geo;
  const int64_t D = g.head_dim, Dp = round_up(D, W), group = a.q_heads / g.kv_heads;
  const int nfull = static_cast<int>(D / W), tail = static_cast<int>(D % W);
  const int64_t heads = it.h1 - it.h0, per_head = static_cast<int64_t>(it.nq) * group, rows = heads * per_head;
  const RowMap map{group, per_head};
  Scratch& sc = tls_scratch;
  sc.reserve(rows, Dp);
  // (a tree step's masks are per key: the dot-product tiles, whose scores are masked row by row)
  const bool keys_major = !is_fp8<DT>() && per_head >= keys_major_rows<DT>() && a.tree == nullptr;
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
    const int64_t lane = r / per_head * rp + r % per_head;  // keys-major: its lane
    if (keys_major) {  // Qt, after the loop
      sc.q_rows[r] = src;
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
  for (int64_t hh = 0; keys_major && hh < heads; ++hh) {  // Qt per head: [D][rp] scaled fp32, or
                                                          // for bf16_dot kinds [D / 2][rp] bf16 pairs
    queries_keys_major<DT>(reinterpret_cast<const QT* const*>(sc.q_rows.data()) + hh * per_head, per_head, D,
                           a.scale, rp, sc.qt.data() + hh * rp * D);
  }
  const T* blocks = static_cast<const T*>(a.blocks);
  const int64_t vshift = g.plane_stride(), token_stride = g.kv_heads * D;
  const int64_t span_bytes = heads * D * static_cast<int64_t>(sizeof(T));  // of one token, heads h0..h1
  const int kb = static_cast<int>(std::clamp<int64_t>(BLOCK_BYTES / (2 * span_bytes), 16, KEY_BLOCK));
  const int64_t span = heads * D;  // elements of one key's rows of heads h0..h1
  if (staged && static_cast<int64_t>(sc.deq.size()) < 4 * KEY_BLOCK * span) sc.deq.resize(4 * KEY_BLOCK * span);
  if (scales_in_softmax && static_cast<int64_t>(sc.block_scales.size()) < heads * 2 * KEY_BLOCK) {
    sc.block_scales.resize(heads * 2 * KEY_BLOCK);
  }
  const int64_t scale_heads = a.scale_groups;  // FP8_*: scales per token and kv head (0: the static pair)
  const int64_t granule = scale_heads ? D / scale_heads : span;  // FP8_*: elements per scale
  // The scales of the row at element offset `off` of K (plane 0) or V (plane 1): at its offset /
  // granule, or the static pair's.
  auto row_scales = [&](int64_t off, int plane) {
    return scale_heads ? a.scales + (off + plane * vshift) / granule : a.scales + plane;
  };
  // Row pointers (at kv head h0) of key positions [k0, k0 + n) into key block buffer `buf`, a page
  // at a time (FP8_*: and their scales); for a staged FP8 pool, pointers to the rows dequantized
  // into sc.deq.
  auto fill = [&](int64_t k0, int n, int buf) {
    const void** kp = sc.kp.data() + buf * KEY_BLOCK;
    const void** vp = sc.vp.data() + buf * KEY_BLOCK;
    if (staged) {  // bf16_codes: the codes as bf16, and each row's scales; else dequantized
      const uint8_t* codes = static_cast<const uint8_t*>(a.blocks);
      for (int t = 0; t < n; ++t) {
        const int64_t off = g.offset(it.b, k0 + t, it.h0);
        for (int plane = 0; plane < 2; ++plane) {
          const uint8_t* src = codes + off + plane * vshift;
          const int64_t at = ((2 * buf + plane) * KEY_BLOCK + t) * span;  // in sc.deq, as elements
          const float* scale = row_scales(off, plane);
          if constexpr (bf16_codes) {
            uint16_t* dst = reinterpret_cast<uint16_t*>(sc.deq.data()) + at;
            if (a.fp8 == E4M3FN) {
              fp8_to_bf16<E4M3FN>(src, span, dst);
            } else {
              fp8_to_bf16<E5M2>(src, span, dst);
            }
            (plane ? vp : kp)[t] = dst;
            (plane ? sc.vs : sc.ks)[buf * KEY_BLOCK + t] = scale;
          } else {
            float* dst = sc.deq.data() + at;
            for (int64_t j = 0; j < span; j += granule) {
              const float sj = scale_heads ? scale[j / granule] : *scale;
              if (a.fp8 == E4M3FN) {
                dequantize<E4M3FN>(src + j, granule, sj, dst + j);
              } else {
                dequantize<E5M2>(src + j, granule, sj, dst + j);
              }
            }
            (plane ? vp : kp)[t] = dst;
          }
        }
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
        const int64_t off = static_cast<const T*>(kp[t]) - blocks;
        ks[t] = row_scales(off, 0);
        vs[t] = row_scales(off, 1);
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
    const int nv = static_cast<int>(round_up(n, W));
    if (scales_in_softmax) {  // per kv head: the block's K scales, then its V scales
      for (int64_t hh = 0; hh < heads; ++hh) {
        float* dst = sc.block_scales.data() + hh * 2 * KEY_BLOCK;
        const int64_t at = hh * D / granule;
        for (int t = 0; t < n; ++t) {
          dst[t] = ks[t][at];
          dst[KEY_BLOCK + t] = vs[t][at];
        }
        std::fill(dst + n, dst + nv, 0.0f);
        std::fill(dst + KEY_BLOCK + n, dst + KEY_BLOCK + nv, 0.0f);
      }
    }
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
        const float* k_scale = scales_in_softmax ? sc.block_scales.data() + hh * 2 * KEY_BLOCK : nullptr;
        const float* v_scale = scales_in_softmax ? k_scale + KEY_BLOCK : nullptr;
        for (int64_t v = 0; v < rp; v += W) {
          softmax_keys_major(st + v, rp, n, k0, sc.km_lo.data() + lane0 + v, sc.km_hi.data() + lane0 + v,
                             sc.km_m.data() + lane0 + v, sc.km_l.data() + lane0 + v, sc.km_alpha.data() + lane0 + v,
                             bf16_dot<DT>() ? a.scale : 1.0f, a.softcap, k_scale, v_scale);
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
    for (int64_t r = 0; r < rows; ++r) {  // softcap, mask, online softmax
      float* s = S + r * KEY_BLOCK;
      // (scales_in_softmax: the K scales, then the V scales of this row's kv head)
      const float* head_scales = scales_in_softmax ? sc.block_scales.data() + r / per_head * 2 * KEY_BLOCK : nullptr;
      const int64_t a0 = std::max<int64_t>(sc.lo[r] - k0, 0), a1 = std::min<int64_t>(sc.hi[r] - k0, n);
      if (a0 >= a1) {
        std::fill(s, s + nv, 0.0f);
        continue;
      }
      if constexpr (is_fp8<DT>() && bf16_dot<DT>()) {  // unscaled queries and keys
        for (int t = 0; t < nv; t += W) store_f32(s + t, load_f32(s + t) * load_f32(head_scales + t) * a.scale);
      } else if constexpr (bf16_dot<DT>()) {  // the scores came from unscaled queries
        for (int t = 0; t < nv; t += W) store_f32(s + t, load_f32(s + t) * a.scale);
      }
      if (a.softcap > 0.0f) {
        for (int t = 0; t < nv; t += W) store_f32(s + t, vsoftcap(load_f32(s + t), a.softcap));
      }
      std::fill(s, s + a0, ninf);
      std::fill(s + a1, s + nv, ninf);
      if (a.tree != nullptr) mask_tree(a, it, map.token(r), k0, a0, a1, s);
      vf vmax = splat(ninf);
      for (int t = 0; t < nv; t += W) {
        vf x = load_f32(s + t);
        vmax = x > vmax ? x : vmax;
      }
      const float m_new = std::max(M[r], hmax(vmax));
      if (m_new == ninf) {  // no key yet: a tree row whose block (of a split) holds only drafts it does not see
        std::fill(s, s + nv, 0.0f);
        continue;
      }
      // exp(0) = 1 without the libm call where the row's max stays (most blocks): the call spilled
      // every vector register the softmax holds, and back, for each row.
      const float alpha = m_new == M[r] && std::isfinite(m_new) ? 1.0f : std::exp(M[r] - m_new);
      vf sum = vf{};
      for (int t = 0; t < nv; t += W) {
        vf p = vexp(load_f32(s + t) - m_new);
        sum += p;
        if constexpr (is_fp8<DT>() && bf16_dot<DT>()) p *= load_f32(head_scales + KEY_BLOCK + t);
        store_f32(s + t, p);
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
    for (int64_t hh = 0; hh < heads; ++hh) {
      rows_from_keys_major(sc.ot.data() + hh * rp * D, rp, per_head, D, O + hh * per_head * Dp, Dp);
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
    store_out<scalar_dtype<DT>()>(dst, O + r * Dp, static_cast<int>(D), a.inverse_denominator(map.q_head(it, r), M[r], L[r]));
  }
}

}  // namespace
