// args.h: the calling convention of the extern "C" op entries (kernels.cpp): one argument struct per
// entry, and pkv_args_layout(), which reports each struct's size and fields.
//
// kernels.py declares the same structs as ctypes Structures (args.py) and, when the library loads,
// compares them field by field (name, kind, offset, size) and in total size with what
// pkv_args_layout() reports: a struct edited on one side only fails the load with an error naming
// the field, instead of shifting every later argument. Each call packs its values into one bytes
// object laid out as the struct (the format derived from the Structure); the entry copies it into
// the struct (no alignment assumed) and reads fields by name. Pointers are data pointers; strides,
// sizes and counts are in elements unless the name says bytes; `threads` is torch's thread count.
//
// Each struct is written once, as a field list (X-macro): the struct and its layout row are both
// generated from it, so the layout always describes the struct the entries read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

// The pool and the layer a call reads or writes (`blocks`: [num_pages, 2, num_layers, page_size,
// kv_heads, head_dim], contiguous); an FP8 pool's format (1 e4m3fn, 2 e5m2; 0: not FP8) and scales
// ([..., scale_groups] per token and kv head, or the static K/V pair where scale_groups is 0).
#define PKV_POOL_FIELDS(X, BLOCKS, SCALES) \
  X(BLOCKS, blocks)                        \
  X(int64_t, num_pages)                    \
  X(int64_t, num_layers)                   \
  X(int64_t, page_size)                    \
  X(int64_t, kv_heads)                     \
  X(int64_t, head_dim)                     \
  X(int64_t, layer)                        \
  X(int64_t, fp8)                          \
  X(SCALES, scales)                        \
  X(int64_t, scale_groups)

// The step: cache_lengths [batch], lookup_table (row stride; usable columns, 1 for a 1-D table),
// input_row_offsets [batch + 1].
#define PKV_STEP_FIELDS(X)              \
  X(const int32_t*, cache_lengths)      \
  X(const int32_t*, table)              \
  X(int64_t, table_stride)              \
  X(int64_t, table_width)               \
  X(const int32_t*, offsets)            \
  X(int64_t, batch)

// store_kv: new K/V rows [rows, kv_heads, head_dim] (unit element stride) of dtype `src_dtype`
// (that of blocks unless the pool is FP8) into their slots.
#define PKV_STORE_KV_FIELDS(X)                \
  X(int64_t, src_dtype)                       \
  X(const void*, key)                         \
  X(int64_t, key_stride_row)                  \
  X(int64_t, key_stride_head)                 \
  X(const void*, value)                       \
  X(int64_t, value_stride_row)                \
  X(int64_t, value_stride_head)               \
  X(int64_t, rows)                            \
  PKV_POOL_FIELDS(X, void*, float*)           \
  PKV_STEP_FIELDS(X)                          \
  X(int64_t, threads)

// flash_attention: q [q_rows, q_heads, head_dim] of dtype `dtype` into out (same shape and dtype),
// with the attention options and the work split (kernels.py's tuning constants).
#define PKV_FLASH_ATTENTION_FIELDS(X)         \
  X(int64_t, dtype)                           \
  X(const void*, q)                           \
  X(int64_t, q_stride_row)                    \
  X(int64_t, q_stride_head)                   \
  X(int64_t, q_rows)                          \
  X(int64_t, q_heads)                         \
  X(void*, out)                               \
  X(int64_t, out_stride_row)                  \
  X(int64_t, out_stride_head)                 \
  PKV_POOL_FIELDS(X, const void*, const float*) \
  PKV_STEP_FIELDS(X)                          \
  X(double, scale)                            \
  X(double, softcap)                          \
  X(int64_t, causal)                          \
  X(int64_t, window)                          \
  X(int64_t, chunk)                           \
  X(const float*, sinks)                      \
  X(const int64_t*, tree)                     \
  X(int64_t, min_split)                       \
  X(int64_t, want_items)                      \
  X(int64_t, min_work)                        \
  X(int64_t, threads)

// gather_kv: every sequence's first kv_len tokens into key_out / value_out ([batch, max_kv_len,
// kv_heads, head_dim], contiguous; fp32 for an FP8 pool, else `itemsize` bytes like blocks).
#define PKV_GATHER_KV_FIELDS(X)               \
  X(int64_t, itemsize)                        \
  PKV_POOL_FIELDS(X, const void*, const float*) \
  PKV_STEP_FIELDS(X)                          \
  X(int64_t, max_kv_len)                      \
  X(void*, key_out)                           \
  X(void*, value_out)                         \
  X(int64_t, threads)

// copy_pages: whole pages of `pool` (page_bytes each, num_pages of them), src[i] to dst[i].
#define PKV_COPY_PAGES_FIELDS(X) \
  X(void*, pool)                 \
  X(int64_t, page_bytes)         \
  X(int64_t, num_pages)          \
  X(const int32_t*, src)         \
  X(const int32_t*, dst)         \
  X(int64_t, count)              \
  X(int64_t, threads)

// step_ok: the step's value checks in one pass (run_step_ok); total_rows and max_kv_len -1 when
// not checked.
#define PKV_STEP_OK_FIELDS(X) \
  PKV_STEP_FIELDS(X)          \
  X(int64_t, table_2d)        \
  X(int64_t, total_rows)      \
  X(int64_t, page_size)       \
  X(int64_t, num_pages)       \
  X(int64_t, reads_all)       \
  X(int64_t, max_kv_len)

// store_latent: new MLA rows, latent [rows, rank] and k_rope [rows, rope_dim] (unit element stride),
// of dtype `src_dtype` (that of blocks, unless the pool is FP8: then k_rope is bf16), into their
// slots (kv_heads 1, head_dim the row's width in elements of blocks).
#define PKV_STORE_LATENT_FIELDS(X)  \
  X(int64_t, src_dtype)             \
  X(const void*, latent)            \
  X(int64_t, latent_stride_row)     \
  X(const void*, rope)              \
  X(int64_t, rope_stride_row)       \
  X(int64_t, rows)                  \
  X(int64_t, rank)                  \
  X(int64_t, rope_dim)              \
  PKV_POOL_FIELDS(X, void*, float*) \
  PKV_STEP_FIELDS(X)                \
  X(int64_t, threads)

// mla_attention: queries q_nope [q_rows, q_heads, rank] and q_rope [.., rope_dim] (unit element
// stride) of dtype `dtype` into out ([q_rows, q_heads, rank], contiguous, same dtype); sparse
// attention reads the `top_k` key positions per query row of key_positions (contiguous rows; null:
// dense); sinks: one logit per query head, or null.
#define PKV_MLA_ATTENTION_FIELDS(X)             \
  X(int64_t, dtype)                             \
  X(const void*, q_nope)                        \
  X(int64_t, q_nope_stride_row)                 \
  X(int64_t, q_nope_stride_head)                \
  X(const void*, q_rope)                        \
  X(int64_t, q_rope_stride_row)                 \
  X(int64_t, q_rope_stride_head)                \
  X(int64_t, q_rows)                            \
  X(int64_t, q_heads)                           \
  X(int64_t, rank)                              \
  X(int64_t, rope_dim)                          \
  X(void*, out)                                 \
  PKV_POOL_FIELDS(X, const void*, const float*) \
  PKV_STEP_FIELDS(X)                            \
  X(double, scale)                              \
  X(int64_t, causal)                            \
  X(const int32_t*, key_positions)              \
  X(int64_t, top_k)                             \
  X(const float*, sinks)                        \
  X(int64_t, min_split)                         \
  X(int64_t, want_items)                        \
  X(int64_t, min_work)                          \
  X(int64_t, threads)

// (struct name, the name kernels.py knows it by, its field list)
#define PKV_ARG_STRUCTS(S)                                         \
  S(PkvStoreKvArgs, store_kv, PKV_STORE_KV_FIELDS)                 \
  S(PkvFlashAttentionArgs, flash_attention, PKV_FLASH_ATTENTION_FIELDS) \
  S(PkvGatherKvArgs, gather_kv, PKV_GATHER_KV_FIELDS)              \
  S(PkvCopyPagesArgs, copy_pages, PKV_COPY_PAGES_FIELDS)           \
  S(PkvStepOkArgs, step_ok, PKV_STEP_OK_FIELDS)                    \
  S(PkvStoreLatentArgs, store_latent, PKV_STORE_LATENT_FIELDS)     \
  S(PkvMlaAttentionArgs, mla_attention, PKV_MLA_ATTENTION_FIELDS)

#define PKV_DECLARE_FIELD(type, name) type name;
#define PKV_DECLARE_STRUCT(Struct, key, FIELDS) \
  struct Struct {                               \
    FIELDS(PKV_DECLARE_FIELD)                   \
  };

extern "C" {
PKV_ARG_STRUCTS(PKV_DECLARE_STRUCT)
}

namespace {

// A field's kind as the layout reports it: p(ointer), f(loat) or i(nteger).
template <class T>
constexpr char field_kind() {
  return std::is_pointer<T>::value ? 'p' : std::is_floating_point<T>::value ? 'f' : 'i';
}

// One line per struct: "key size name:kind:offset:size ...".
inline std::string args_layout() {
  std::string out;
#define PKV_LAYOUT_FIELD(type, name)                                                                  \
  out += std::string(" ") + #name + ":" + field_kind<type>() + ":" + std::to_string(offsetof(S, name)) + \
         ":" + std::to_string(sizeof(type));
#define PKV_LAYOUT_STRUCT(Struct, key, FIELDS)                  \
  {                                                             \
    using S = Struct;                                           \
    out += std::string(#key) + " " + std::to_string(sizeof(S)); \
    FIELDS(PKV_LAYOUT_FIELD)                                    \
    out += "\n";                                                \
  }
  PKV_ARG_STRUCTS(PKV_LAYOUT_STRUCT)
#undef PKV_LAYOUT_STRUCT
#undef PKV_LAYOUT_FIELD
  return out;
}

// The arguments of entry `Struct`, copied out of the caller's bytes (which need no alignment).
template <class Struct>
Struct unpack_args(const void* packed) {
  Struct a;
  std::memcpy(&a, packed, sizeof a);
  return a;
}

}  // namespace
