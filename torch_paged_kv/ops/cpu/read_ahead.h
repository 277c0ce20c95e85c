// read_ahead.h: software prefetch of the rows an item reads next (`Ahead`, `prefetch_rows_l1`).
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include "vec.h"
#if defined(__unix__)
#include <unistd.h>
#endif

namespace {

// Ahead's prefetches go to L1 (prefetcht0) where the L1 data cache holds 48 KiB or more, else to
// L2 (prefetcht1). Decode steps, interleaved A/B: on a Zen 5 (48 KiB L1d) prefetcht0 ran 3-8%
// faster than prefetcht1; on a Zen 4 (32 KiB) 1.35-1.41x slower, the read-ahead of a key block
// (up to 64 KiB of K) evicting the rows in use.
#if defined(_SC_LEVEL1_DCACHE_SIZE)
const bool PREFETCH_TO_L1 = sysconf(_SC_LEVEL1_DCACHE_SIZE) >= (48 << 10);
#else
const bool PREFETCH_TO_L1 = false;
#endif

// Rows the memory is asked for ahead of their use, PIECE bytes at a time, `quota` pieces per call
// of `step`, in address order (row by row, each from its first byte). The item's loops call `step`
// between micro-kernel tiles, so the fetches spread over the work they overlap: a burst of
// thousands of prefetches stalls the core until all are issued. Out of line: inlined into the
// tile loops it cost the tiles their register allocation (12-15% of a decode step with every page
// in cache, measured).
struct Ahead {
  static constexpr int64_t PIECE = 256;
  const void* const* rows = nullptr;
  int n = 0;              // rows to fetch (0: nothing)
  int64_t row_bytes = 0;  // of one row (the item's kv heads)
  int64_t quota = 0;      // pieces per step
  int row = 0;            // the next piece: row and byte in it
  int64_t byte = 0;

  // Fetch `count` rows of `bytes` over `steps` calls of step().
  void start(const void* const* r, int count, int64_t bytes, int64_t steps) {
    rows = r;
    n = count;
    row_bytes = bytes;
    steps = std::max<int64_t>(steps, 1);
    quota = (count * ((bytes + PIECE - 1) / PIECE) + steps - 1) / steps;
  }

  __attribute__((noinline)) void step() {
    for (int64_t left = quota; left > 0 && row < n; --left) {
      const char* p = static_cast<const char*>(rows[row]) + byte;
      if (PREFETCH_TO_L1) {
        for (int64_t c = 0; c < PIECE; c += 64) __builtin_prefetch(p + c, 0, 3);
      } else {
        for (int64_t c = 0; c < PIECE; c += 64) __builtin_prefetch(p + c, 0, 2);
      }
      byte += PIECE;
      if (byte >= row_bytes) {
        byte = 0;
        ++row;
      }
    }
  }
};

// The first L1_AHEAD bytes of `count` key rows (from element `ofs`) into L1: qk_rows asks for the
// next tile's rows while a tile computes, where the hardware's prefetchers miss the jump between
// rows (measured, interleaved A/B: a decode step 2-6% faster in bf16, 1-4% in fp32; fetching all
// of an fp32 row was slower).
constexpr int64_t L1_AHEAD = 256;

template <typename T>
inline void prefetch_rows_l1(const T* const* rows, int count, int64_t ofs) {
  for (int t = 0; t < count; ++t) {
    const char* p = reinterpret_cast<const char*>(rows[t] + ofs);
    for (int64_t c = 0; c < L1_AHEAD; c += 64) __builtin_prefetch(p + c, 0, 3);
  }
}

}  // namespace
