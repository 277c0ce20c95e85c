// cache_ops.h: store_kv, gather_kv, copy_pages, and the one-pass value check of a step's index
// tensors.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include "args.h"
#include "fp8_quantize.h"
#include "parallel.h"

namespace {

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
void run_store_kv(const PkvStoreKvArgs& a) {
  const int64_t itemsize = a.src_dtype == F32 ? 4 : 2;
  const int64_t row_bytes = a.head_dim * itemsize, kv_heads = a.kv_heads, page_size = a.page_size;
  const int64_t plane = a.num_layers * page_size * kv_heads * a.head_dim * itemsize;
  const int32_t* offsets = a.offsets;
  const int64_t total = offsets[a.batch] - offsets[0];
  const int threads = thread_count(static_cast<int>(a.threads), static_cast<double>(total) * kv_heads * row_bytes, 1 << 18);
  char* base = static_cast<char*>(a.blocks);
  parallel_for<false>(a.batch, threads, [&](int64_t b) {
    for (int64_t row = offsets[b]; row < offsets[b + 1]; ++row) {
      const int64_t pos = a.cache_lengths[b] + (row - offsets[b]);
      const int64_t page = page_of(a.table, a.table_stride, a.table_width, a.num_pages, page_size, b, pos);
      if (page <= 0) continue;
      char* dst = base + (((page * 2 * a.num_layers + a.layer) * page_size + pos % page_size) * kv_heads) * row_bytes;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(dst + h * row_bytes,
                    static_cast<const char*>(a.key) + (row * a.key_stride_row + h * a.key_stride_head) * itemsize,
                    row_bytes);
        std::memcpy(dst + plane + h * row_bytes,
                    static_cast<const char*>(a.value) + (row * a.value_stride_row + h * a.value_stride_head) * itemsize,
                    row_bytes);
      }
    }
  });
}

// New rows of K and V (fp32, bf16 or fp16, strides as run_store_kv) into an FP8 pool, quantized by
// the reference's rule (quant.py), bit for bit: per granule of head_dim / groups elements, scale =
// amax / the format's largest value in fp32 (NaN if an element is), codes = x / scale clamped to
// that value and rounded (all zero, with that scale stored, where the scale is not > 0); with
// groups == 0 the static pair scales[plane] instead (no amax, nothing stored but codes). Rows
// whose page is out of range or the null page are skipped.
template <int SRC, int FORMAT>
void store_fp8(const PkvStoreKvArgs& a, int threads) {
  using T = typename Storage<SRC>::T;
  const int64_t head_dim = a.head_dim, kv_heads = a.kv_heads, page_size = a.page_size, groups = a.scale_groups;
  const int64_t plane = a.num_layers * page_size * kv_heads * head_dim, gran = groups ? head_dim / groups : head_dim;
  const int32_t* offsets = a.offsets;
  uint8_t* blocks = static_cast<uint8_t*>(a.blocks);
  float* scales = a.scales;
  parallel_for<false>(offsets[a.batch] - offsets[0], threads, [&](int64_t i) {  // row by row: a prefill is one sequence
    const int64_t row = offsets[0] + i;
    const int64_t b = std::upper_bound(offsets, offsets + a.batch + 1, row) - offsets - 1;
    thread_local std::vector<float> x;
    x.resize(head_dim);
    const int64_t pos = a.cache_lengths[b] + (row - offsets[b]);
    const int64_t page = page_of(a.table, a.table_stride, a.table_width, a.num_pages, page_size, b, pos);
    if (page <= 0) return;
    const int64_t slot = ((page * 2 * a.num_layers + a.layer) * page_size + pos % page_size) * kv_heads;
    for (int p = 0; p < 2; ++p) {
      const T* src = static_cast<const T*>(p ? a.value : a.key) + row * (p ? a.value_stride_row : a.key_stride_row);
      const int64_t head_stride = p ? a.value_stride_head : a.key_stride_head;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* head = src + h * head_stride;
        widen<SRC>(head, head_dim, x.data());
        const int64_t at = (slot + h) * head_dim + p * plane;  // the row's first code
        quantize_row<FORMAT>(x.data(), head_dim, gran, groups, groups ? 0.0f : scales[p],
                             groups ? scales + at / head_dim * groups : nullptr, blocks + at);
      }
    }
  });
}

void run_store_kv_fp8(const PkvStoreKvArgs& a) {
  const double work = static_cast<double>(a.offsets[a.batch] - a.offsets[0]) * a.kv_heads * a.head_dim * 2;
  const int threads = thread_count(static_cast<int>(a.threads), work, 1 << 16);
  auto run = [&](auto src_tag, auto fp8_tag) {
    store_fp8<decltype(src_tag)::value, decltype(fp8_tag)::value>(a, threads);
  };
  using e4m3 = std::integral_constant<int, E4M3FN>;
  using e5m2 = std::integral_constant<int, E5M2>;
  auto with_src = [&](auto fp8_tag) {
    switch (a.src_dtype) {
      case F32: run(std::integral_constant<int, F32>{}, fp8_tag); break;
      case BF16: run(std::integral_constant<int, BF16>{}, fp8_tag); break;
      default: run(std::integral_constant<int, F16>{}, fp8_tag); break;
    }
  };
  if (a.fp8 == E4M3FN) {
    with_src(e4m3{});
  } else {
    with_src(e5m2{});
  }
}

// K and V of every sequence's first kv_len tokens into key_out / value_out ([batch, max_kv_len,
// kv_heads, head_dim], contiguous), zeros after. No step_bounds here: an unchecked call's lengths
// and offsets may be any ints (kv_len is summed in int64), a position past the table reads zeros.
void run_gather_kv(const PkvGatherKvArgs& a) {
  const int64_t max_kv_len = a.max_kv_len, page_size = a.page_size;
  const int64_t token_bytes = a.kv_heads * a.head_dim * a.itemsize;
  const int64_t plane = a.num_layers * page_size * a.kv_heads * a.head_dim * a.itemsize;
  const int threads = thread_count(static_cast<int>(a.threads),
                                   static_cast<double>(a.batch) * max_kv_len * token_bytes * 2, 1 << 18);
  const char* base = static_cast<const char*>(a.blocks);
  parallel_for<false>(a.batch * max_kv_len, threads, [&](int64_t bt) {
    const int64_t b = bt / max_kv_len, pos = bt % max_kv_len;
    char* kd = static_cast<char*>(a.key_out) + bt * token_bytes;
    char* vd = static_cast<char*>(a.value_out) + bt * token_bytes;
    const int64_t kv_len = static_cast<int64_t>(a.cache_lengths[b]) + a.offsets[b + 1] - a.offsets[b];
    const int64_t page =
        pos < kv_len ? page_of(a.table, a.table_stride, a.table_width, a.num_pages, page_size, b, pos) : -1;
    if (page < 0) {
      std::memset(kd, 0, token_bytes);
      std::memset(vd, 0, token_bytes);
      return;
    }
    const char* src = base + (((page * 2 * a.num_layers + a.layer) * page_size + pos % page_size) * a.kv_heads) *
                                 (a.head_dim * a.itemsize);
    std::memcpy(kd, src, token_bytes);
    std::memcpy(vd, src + plane, token_bytes);
  });
}

// gather_kv of an FP8 pool: as run_gather_kv, into fp32 key_out / value_out, each row dequantized
// (code value times its scale: the reference's values bit for bit).
void run_gather_kv_fp8(const PkvGatherKvArgs& a) {
  const int64_t max_kv_len = a.max_kv_len, page_size = a.page_size, groups = a.scale_groups;
  const int64_t span = a.kv_heads * a.head_dim, plane = a.num_layers * page_size * span;
  const int64_t gran = groups ? a.head_dim / groups : a.head_dim;
  const int threads =
      thread_count(static_cast<int>(a.threads), static_cast<double>(a.batch) * max_kv_len * span * 8, 1 << 18);
  const uint8_t* blocks = static_cast<const uint8_t*>(a.blocks);
  const float* scales = a.scales;
  parallel_for<false>(a.batch * max_kv_len, threads, [&](int64_t bt) {
    const int64_t b = bt / max_kv_len, pos = bt % max_kv_len;
    const int64_t kv_len = static_cast<int64_t>(a.cache_lengths[b]) + a.offsets[b + 1] - a.offsets[b];
    const int64_t page =
        pos < kv_len ? page_of(a.table, a.table_stride, a.table_width, a.num_pages, page_size, b, pos) : -1;
    for (int p = 0; p < 2; ++p) {
      float* dst = static_cast<float*>(p ? a.value_out : a.key_out) + bt * span;
      if (page < 0) {
        std::fill(dst, dst + span, 0.0f);
        continue;
      }
      const int64_t at = ((page * 2 * a.num_layers + a.layer) * page_size + pos % page_size) * span + p * plane;
      for (int64_t e = 0; e < span; e += gran) {
        const float s = groups ? scales[(at + e) / gran] : scales[p];
        if (a.fp8 == E4M3FN) {
          dequantize<E4M3FN>(blocks + at + e, gran, s, dst + e);
        } else {
          dequantize<E5M2>(blocks + at + e, gran, s, dst + e);
        }
      }
    }
  });
}

// pool[dst[i]] = pool[src[i]] (whole pages), every source read before any write; destinations
// that are the null page or out of range, and sources out of range, are skipped.
void run_copy_pages(const PkvCopyPagesArgs& a) {
  const int64_t num_pages = a.num_pages, page_bytes = a.page_bytes, n = a.count;
  const int32_t* src = a.src;
  const int32_t* dst = a.dst;
  char* base = static_cast<char*>(a.pool);
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
  const int threads = thread_count(static_cast<int>(a.threads), static_cast<double>(n) * page_bytes, 1 << 20);
  parallel_for<false>(n, threads, [&](int64_t i) {
    if (dst[i] <= 0 || dst[i] >= num_pages || src[i] < 0 || src[i] >= num_pages) return;
    const char* s = from_stride ? from + i * from_stride : base + src[i] * page_bytes;
    std::memcpy(base + dst[i] * page_bytes, s, page_bytes);
  });
}

// Why a step's offsets and lengths would take a kernel outside its tensors, or 0 where they do not:
// 1 when `offsets` do not start at 0, go down or do not end at `rows` (the rows of the new K/V or of
// q and its output), 2 when a length is negative or a sequence would pass the `capacity` tokens its
// table row addresses. The entries run it on every call, checked or `.unchecked` (it reads batch + 1
// ints): with it, no value an unchecked call passes makes a kernel read or write outside its
// tensors (page ids are clamped or skipped where they are read).
int step_bounds(const int32_t* cache_lengths, const int32_t* offsets, int64_t batch, int64_t rows, int64_t capacity) {
  if (offsets[0] != 0 || offsets[batch] != rows) return 1;
  for (int64_t b = 0; b < batch; ++b) {
    if (offsets[b + 1] < offsets[b]) return 1;
    const int64_t cached = cache_lengths[b];
    if (cached < 0 || cached + (offsets[b + 1] - offsets[b]) > capacity) return 2;
  }
  return 0;
}

// Whether a step's index tensors pass every value check of validate.py (`check_store_kv_data` with
// `reads_all` = 0, `check_read_data` with 1, or W + 1 for a sliding window of W: the pages from
// position cache_length - W + 1 on): offsets start at 0 and never decrease, lengths are
// >= 0, every sequence fits its table row, the offsets end at `total_rows` (if >= 0), no sequence
// is longer than `max_kv_len` (if >= 0), and every page holding a token the call touches is a real
// page (1 .. num_pages - 1). A fast yes for the common case; on a no, validate.py runs its own
// checks, which say what is wrong (so this must never say yes where they would raise).
int run_step_ok(const PkvStepOkArgs& a) {
  const int32_t* offsets = a.offsets;
  const int64_t batch = a.batch, page_size = a.page_size;
  if (offsets[0] != 0) return 0;
  if (a.total_rows >= 0 && offsets[batch] != a.total_rows) return 0;
  const int64_t capacity = page_size * (a.table_2d ? a.table_width : 1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t cached = a.cache_lengths[b], added = static_cast<int64_t>(offsets[b + 1]) - offsets[b];
    const int64_t kv_len = cached + added;
    if (added < 0 || cached < 0 || kv_len > capacity) return 0;
    if (a.max_kv_len >= 0 && kv_len > a.max_kv_len) return 0;
    // reads_all: 0, the stored tokens; 1, every token; W + 1, the keys a sliding window of W shows
    const int64_t window = a.reads_all - 1;
    const int64_t first = a.reads_all == 0 ? cached : window > 0 ? std::max<int64_t>(0, cached - window + 1) : 0;
    if (kv_len <= first) continue;
    const int32_t* row = a.table + b * a.table_stride;
    const int64_t c0 = a.table_2d ? first / page_size : 0, c1 = a.table_2d ? (kv_len + page_size - 1) / page_size : 1;
    for (int64_t c = c0; c < c1; ++c) {
      if (row[c] <= 0 || row[c] >= a.num_pages) return 0;
    }
  }
  return 1;
}

}  // namespace
