// attention.h: flash_attention: the work items (sequences, kv heads, token blocks, their key ranges),
// split and run on the threads by work_split.h, and the merge of split ranges.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include <algorithm>
#include <vector>

#include "args.h"
#include "attend_item.h"
#include "parallel.h"
#include "work_split.h"

namespace {

thread_local Floats tls_merged_row;  // the merges' accumulator (merge_task, mla_merge)

template <int DT>
void merge_task(const AttnArgs& a, const SplitTask<Item>& task, const float* partials, int64_t part_stride) {
  using T = typename Storage<scalar_dtype<DT>()>::T;  // of the output
  const int64_t D = a.geo.head_dim, group = a.q_heads / a.geo.kv_heads;
  const Item& it = task.span;
  const int64_t per_head = static_cast<int64_t>(it.nq) * group, rows = (it.h1 - it.h0) * per_head;
  const RowMap map{group, per_head};
  Floats& acc = tls_merged_row;
  if (static_cast<int64_t>(acc.size()) < D) acc.resize(D);
  T* obase = static_cast<T*>(a.out);
  const int64_t row0 = a.offsets[it.b] + it.q0;
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < task.parts; ++s) {
      m = std::max(m, partials[(task.first + s) * part_stride + rows * D + r]);
    }
    std::fill(acc.begin(), acc.begin() + D, 0.0f);
    float l = 0.0f;
    for (int64_t s = 0; s < task.parts; ++s) {
      const float* src = partials + (task.first + s) * part_stride;
      const float ls = src[rows * D + rows + r];
      if (ls == 0.0f) continue;
      const float w = std::exp(src[rows * D + r] - m);
      l += ls * w;
      for (int64_t d = 0; d < D; ++d) acc[d] += src[r * D + d] * w;
    }
    T* dst = obase + (row0 + map.token(r)) * a.out_stride_row + map.q_head(it, r) * a.out_stride_head;
    store_out<scalar_dtype<DT>()>(dst, acc.data(), static_cast<int>(D), a.inverse_denominator(map.q_head(it, r), m, l));
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
  WorkSplit<Item>& w = thread_work_split<Item>();
  std::vector<Item>& spans = w.spans;
  spans.clear();
  // Items in the order sequence, kv head, token block: two threads then write different pages of
  // the output. Ordered by token block, both wrote the same 4 KiB pages (a token's row holds every
  // head) and met in the kernel's page faults on a fresh output: a 2048-token fp32 prefill (32 MiB
  // out) takes 0.98x the time in this order; into an output whose pages are already mapped the
  // order makes no difference. A token block of nq tokens takes heads_per_item(nq) heads per item,
  // so its items start at the heads that are multiples of that.
  auto heads_per_item = [&](int64_t nq) { return std::clamp<int64_t>(ROWS_PER_ITEM / (nq * group), 1, H); };
  double work = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t new_b = a.offsets[b + 1] - a.offsets[b];
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t q0 = 0; q0 < new_b; q0 += tokens_per_item) {
        const int64_t nq = std::min(tokens_per_item, new_b - q0), per_item = heads_per_item(nq);
        if (h % per_item != 0) continue;
        int64_t lo_first, hi_first, lo_last, hi_last;
        key_range(a, b, q0, &lo_first, &hi_first);
        key_range(a, b, q0 + nq - 1, &lo_last, &hi_last);
        // a tree's windows and chunks start by depth (key_range: never before the step's first token's)
        for (int64_t i = q0 + 1; a.tree != nullptr && i < q0 + nq; ++i) {
          int64_t lo, hi;
          key_range(a, b, i, &lo, &hi);
          lo_first = std::min(lo_first, lo);
        }
        if (h == 0) work += static_cast<double>(std::max<int64_t>(hi_last - lo_first, 0)) * nq * a.q_heads;
        spans.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h),
                         static_cast<int32_t>(std::min(H, h + per_item)), static_cast<int32_t>(q0),
                         static_cast<int32_t>(nq), lo_first, hi_last, -1, -1});
      }
    }
  }
  const int threads = thread_count(nthreads, work * a.geo.head_dim, static_cast<double>(tune.min_work));
  split_spans(w, tune.min_split, tune.want_items, threads, 16, a.geo.head_dim,
              [&](const Item& sp) { return static_cast<int64_t>(sp.h1 - sp.h0) * sp.nq * group; });
  auto attend = [&](const Item& it, float* pp, int64_t part_stride) {
    if constexpr (bf16_dot<DT>() && is_fp8<DT>()) {  // prefill-shaped: codes staged as bf16, keys-major bf16 tiles
      if (static_cast<int64_t>(it.nq) * group >= keys_major_rows<BF16_PAIRS>()) {
        attend_item<BF16_PAIRS>(a, it, pp, part_stride);
      } else {
        attend_item<DT>(a, it, pp, part_stride);
      }
    } else if constexpr (is_fp8<DT>()) {  // prefill-shaped: codes dequantized once per key block, keys-major fp32 tiles
      if (static_cast<int64_t>(it.nq) * group >= keys_major_rows<F32>()) {
        attend_item<F32>(a, it, pp, part_stride);
      } else {
        attend_item<DT>(a, it, pp, part_stride);
      }
    } else {
      attend_item<DT>(a, it, pp, part_stride);
    }
  };
  run_items(w, threads, attend, [&](const SplitTask<Item>& task, const float* pp, int64_t part_stride) {
    merge_task<DT>(a, task, pp, part_stride);
  });
}

// 0, or 1 where the call is not one these kernels take: FP8 codes under fp16 queries, or under bf16
// queries outside FP8_*_DOT (one scale per token and kv head or a static pair, head_dim a multiple
// of 2W, a build with both the bf16 dot products and the FP8 byte tables). kernels.py then calls
// again with the queries in fp32: this dispatch alone decides which queries stay narrow.
int run_flash_attention(const PkvFlashAttentionArgs& in) {
  AttnArgs a;
  a.dtype = static_cast<int>(in.dtype);
  a.q = in.q;
  a.q_stride_row = in.q_stride_row;
  a.q_stride_head = in.q_stride_head;
  a.blocks = in.blocks;
  a.geo = Geometry{in.num_pages, in.num_layers, in.page_size, in.kv_heads, in.head_dim,
                   in.layer,     in.table,      in.table_stride, in.table_width};
  a.cache_lengths = in.cache_lengths;
  a.offsets = in.offsets;
  a.batch = in.batch;
  a.q_heads = in.q_heads;
  a.scale = static_cast<float>(in.scale);
  a.causal = static_cast<int>(in.causal);
  a.window = in.window;
  a.softcap = static_cast<float>(in.softcap);
  a.out = in.out;
  a.out_stride_row = in.out_stride_row;
  a.out_stride_head = in.out_stride_head;
  a.fp8 = static_cast<int>(in.fp8);
  a.scales = in.scales;
  a.scale_groups = in.scale_groups;
  a.sinks = in.sinks;
  a.tree = in.tree;
  a.chunk = std::max<int64_t>(in.chunk, 0);
  const Tuning tune{in.min_split, in.want_items, in.min_work};
  const int nthreads = static_cast<int>(in.threads), dtype = a.dtype, fp8 = a.fp8;
  const int64_t head_dim = in.head_dim, scale_groups = in.scale_groups;
  const int64_t granule = scale_groups ? head_dim / scale_groups : head_dim;  // (static: one scale per row)
  const bool fp8_codes = fp8 && head_dim % (2 * W) == 0 && granule % (2 * W) == 0;
  if (fp8 && dtype == BF16) {  // FP8_*_DOT: one scale per token and kv head, or a static pair
    if constexpr (fp8_dot_kinds()) {
      if (fp8_codes && scale_groups <= 1) {
        if (fp8 == E4M3FN) {
          flash_attention<FP8_E4M3FN_DOT>(a, tune, nthreads);
        } else {
          flash_attention<FP8_E5M2_DOT>(a, tune, nthreads);
        }
        return 0;
      }
    }
    return 1;
  }
  if (fp8 && dtype == F16) return 1;
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
  return 0;
}

}  // namespace
