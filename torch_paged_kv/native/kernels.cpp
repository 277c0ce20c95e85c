// The `cpu` backend's kernels: paged attention that reads K/V in place from the pages, store_kv,
// gather_kv and copy_pages, and the MLA latent ops store_latent and mla_attention (mla_*.h).
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
//   args.h              the calling convention: one argument struct per entry, and their layout
//   vec.h               vector width and types, exp / softcap / horizontal sums
//   kinds.h             storage kinds (fp32, bf16, fp16, FP8 codes): loads, conversions, stores
//   read_ahead.h        software prefetch of the rows an item reads next
//   tiles_rows.h        dot-product micro-kernels (decode-shaped items)
//   tiles_keys_major.h  keys-major micro-kernels and their softmax (prefill-shaped items)
//   parallel.h          thread count and the parallel loop
//   work_split.h        the attention kernels' work split: key ranges split into parts where there
//                       are too few items, the items run on the threads, the parts merged
//   attend_item.h       one work item: its query rows, then per key block scores, mask, online
//                       softmax and P V
//   attention.h         flash_attention: the work items on the threads, the merge of split ranges
//   fp8_quantize.h      fp32 to FP8 codes, per-granule amax
//   cache_ops.h         store_kv, gather_kv, copy_pages, the value check of a step
//   mla_store.h         store_latent: MLA rows [latent; rope] into a latent pool (FP8: quantize_row)
//   mla_attention.h     mla_attention: absorbed MLA attention, dense or sparse, its items and merge
// This file: the extern "C" entries kernels.py calls.
#include <cstdint>
#include <cstring>

#include "args.h"
#include "attention.h"
#include "cache_ops.h"
#include "mla_attention.h"
#include "mla_store.h"

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

// The calling convention: each op entry takes its argument struct (args.h) as the bytes kernels.py
// packed; pkv_args_layout() describes those structs, for kernels.py to check its side against.
const char* pkv_args_layout() {
  static const std::string layout = args_layout();
  return layout.c_str();
}

// The op entries return 0, or step_bounds' code (1: offsets, 2: lengths) for a step whose values
// would take the kernel outside its tensors (nothing is then read or written); flash_attention
// also 3 where it declines the queries (see run_flash_attention).
int pkv_flash_attention(const void* packed) {
  const auto a = unpack_args<PkvFlashAttentionArgs>(packed);
  if (const int bad = step_bounds(a.cache_lengths, a.offsets, a.batch, a.q_rows, a.page_size * a.table_width)) {
    return bad;
  }
  return run_flash_attention(a) ? 3 : 0;
}

int pkv_store_kv(const void* packed) {
  const auto a = unpack_args<PkvStoreKvArgs>(packed);
  if (const int bad = step_bounds(a.cache_lengths, a.offsets, a.batch, a.rows, a.page_size * a.table_width)) {
    return bad;
  }
  if (a.fp8) {
    run_store_kv_fp8(a);
  } else {
    run_store_kv(a);
  }
  return 0;
}

void pkv_gather_kv(const void* packed) {
  const auto a = unpack_args<PkvGatherKvArgs>(packed);
  if (a.fp8) {
    run_gather_kv_fp8(a);
  } else {
    run_gather_kv(a);
  }
}

void pkv_copy_pages(const void* packed) { run_copy_pages(unpack_args<PkvCopyPagesArgs>(packed)); }

int pkv_store_latent(const void* packed) {
  const auto a = unpack_args<PkvStoreLatentArgs>(packed);
  if (const int bad = step_bounds(a.cache_lengths, a.offsets, a.batch, a.rows, a.page_size * a.table_width)) {
    return bad;
  }
  run_store_latent(a);
  return 0;
}

int pkv_mla_attention(const void* packed) {
  const auto a = unpack_args<PkvMlaAttentionArgs>(packed);
  if (const int bad = step_bounds(a.cache_lengths, a.offsets, a.batch, a.q_rows, a.page_size * a.table_width)) {
    return bad;
  }
  run_mla_attention(a);
  return 0;
}

int pkv_step_ok(const void* packed) { return run_step_ok(unpack_args<PkvStepOkArgs>(packed)); }

}  // extern "C"
