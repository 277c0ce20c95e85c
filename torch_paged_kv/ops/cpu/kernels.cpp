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
// scales (FP8_* kinds, kinds.h); prefill-shaped items, and granules or head dims those tiles do not
// take, have each key block's rows dequantized (a code's exact value times its scale, the
// reference's fp32 product) into a per-thread fp32 block, which the fp32 path then reads; queries
// and output are fp32 (kernels.py converts). With AVX512-BF16 and AVX512-VBMI, bf16 queries over one
// scale per token and kv head (or a static pair) stay bf16 and take FP8_*_DOT: codes turned into
// bf16 values by byte-table permutes, scores as bf16 dot products times their key's K scale,
// probabilities times their key's V scale; prefill-shaped items stage each key block's codes as
// bf16 for the keys-major bf16 tiles.
//
// One translation unit, in parts (each a header included once, in this order of dependence):
//   vec.h               vector width and types, exp / softcap / horizontal sums
//   kinds.h             storage kinds (fp32, bf16, fp16, FP8 codes): loads, conversions, stores
//   read_ahead.h        software prefetch of the rows an item reads next
//   tiles_rows.h        dot-product micro-kernels (decode-shaped items)
//   tiles_keys_major.h  keys-major micro-kernels and their softmax (prefill-shaped items)
//   parallel.h          thread count and the parallel loop
//   attend_item.h       one work item: its query rows, then per key block scores, mask, online
//                       softmax and P V
//   attention.h         flash_attention: the work items on the threads, the merge of split ranges
//   fp8_quantize.h      fp32 to FP8 codes, per-granule amax
//   cache_ops.h         store_kv, gather_kv, copy_pages, the value check of a step
// This file: the packed argument blocks and the extern "C" entries kernels.py calls.
#include <cstdint>
#include <cstring>

#include "attention.h"
#include "cache_ops.h"

namespace {

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

int pkv_fp8_byte_tables() {
#if defined(__AVX512VBMI__)
  return 1;
#else
  return 0;
#endif
}

int pkv_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

int64_t pkv_parallel_losses() { return fan_out.losses.load(); }  // parallel.h: loops slower than one thread

int pkv_flash_attention(const unsigned char* packed) {
  const Packed a{packed};
  return run_flash_attention(static_cast<int>(a.i(0)), a.ptr<const void>(1), a.i(2), a.i(3), a.ptr<const void>(4), a.i(5),
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
