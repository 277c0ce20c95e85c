// mla_store.h: store_latent: new MLA rows ([latent; rope]) into their slots of a latent pool.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include "args.h"
#include "cache_ops.h"
#include "fp8_quantize.h"
#include "parallel.h"

namespace {

// Rows of an FP8 pool: the latent quantized by the reference's rule bit for bit (quantize_row:
// `scale_groups` scales per token, or the static scale), then the rope's bf16 bytes as they are.
template <int SRC, int FORMAT>
__attribute__((noinline)) void store_latent_fp8(const PkvStoreLatentArgs& a, int64_t row, int64_t slot, uint8_t* dst) {
  thread_local std::vector<float> x;
  x.resize(a.rank);
  widen<SRC>(static_cast<const typename Storage<SRC>::T*>(a.latent) + row * a.latent_stride_row, a.rank, x.data());
  const int64_t groups = a.scale_groups;
  quantize_row<FORMAT>(x.data(), a.rank, groups ? a.rank / groups : a.rank, groups, groups ? 0.0f : a.scales[0],
                       groups ? a.scales + slot * groups : nullptr, dst);
  if (a.rope_dim) {  // (an empty rope tensor may have no data pointer)
    std::memcpy(dst + a.rank, static_cast<const uint16_t*>(a.rope) + row * a.rope_stride_row, a.rope_dim * 2);
  }
}

// Every new row into its slot (position cache_lengths[b] + t of its sequence); rows whose page is
// out of range or the null page are skipped. A plain pool copies the latent and the rope (the
// pool's dtype).
void run_store_latent(const PkvStoreLatentArgs& a) {
  const int32_t* offsets = a.offsets;
  const int64_t total = offsets[a.batch] - offsets[0], width = a.head_dim;
  const int64_t itemsize = a.fp8 ? 1 : a.src_dtype == F32 ? 4 : 2;
  const int threads = thread_count(static_cast<int>(a.threads), static_cast<double>(total) * width * (a.fp8 ? 8 : 1),
                                   1 << 16);
  char* base = static_cast<char*>(a.blocks);
  parallel_for<false>(total, threads, [&](int64_t i) {  // row by row: a prefill is one sequence
    const int64_t row = offsets[0] + i;
    const int64_t b = std::upper_bound(offsets, offsets + a.batch + 1, row) - offsets - 1;
    const int64_t pos = a.cache_lengths[b] + (row - offsets[b]);
    const int64_t page = page_of(a.table, a.table_stride, a.table_width, a.num_pages, a.page_size, b, pos);
    if (page <= 0) return;
    const int64_t slot = (page * a.num_layers + a.layer) * a.page_size + pos % a.page_size;  // (one plane, one head)
    char* dst = base + slot * width * itemsize;
    if (!a.fp8) {
      std::memcpy(dst, static_cast<const char*>(a.latent) + row * a.latent_stride_row * itemsize, a.rank * itemsize);
      if (a.rope_dim) {  // (an empty rope tensor may have no data pointer)
        std::memcpy(dst + a.rank * itemsize, static_cast<const char*>(a.rope) + row * a.rope_stride_row * itemsize,
                    a.rope_dim * itemsize);
      }
      return;
    }
    uint8_t* codes = reinterpret_cast<uint8_t*>(dst);
    const bool e4m3 = a.fp8 == E4M3FN;
    switch (a.src_dtype) {
      case F32:
        e4m3 ? store_latent_fp8<F32, E4M3FN>(a, row, slot, codes) : store_latent_fp8<F32, E5M2>(a, row, slot, codes);
        break;
      case BF16:
        e4m3 ? store_latent_fp8<BF16, E4M3FN>(a, row, slot, codes) : store_latent_fp8<BF16, E5M2>(a, row, slot, codes);
        break;
      default:
        e4m3 ? store_latent_fp8<F16, E4M3FN>(a, row, slot, codes) : store_latent_fp8<F16, E5M2>(a, row, slot, codes);
        break;
    }
  });
}

}  // namespace
