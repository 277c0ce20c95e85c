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

// A prefetch of the line at p, to L1 or L2 (PREFETCH_TO_L1).
__attribute__((always_inline)) inline void prefetch_line(const char* p) {
  if (PREFETCH_TO_L1) {
    __builtin_prefetch(p, 0, 3);
  } else {
    __builtin_prefetch(p, 0, 2);
  }
}

// Rows the memory is asked for ahead of their use, PIECE bytes at a time, `quota` pieces per
// share, in address order (row by row, each from its first byte), so the fetches spread over the
// work they overlap: a burst of thousands of prefetches stalls the core until all are issued.
// The dot-product tiles call `step` between tiles, which issues a share; the keys-major tiles
// take theirs from `next_lines` as line addresses and issue one per iteration of their loop
// (`AheadShare`). Issued between those tiles, a share of about 50 lines held the core
// (`step` had 3.4% of a prefill's samples); spread, a 2048-token prefill took 0.98-0.99x the time
// and 16-token steps at 8 x 2048 0.97x (fp32; interleaved A/B, Zen 4). Both out of line: inlined
// into the tile loops, `step` cost the tiles their register allocation (12-15% of a decode step
// with every page in cache, measured).
struct Ahead {
  static constexpr int64_t PIECE = 256;
  static constexpr int MAX_LINES = 128;  // of one share from next_lines
  const void* const* rows = nullptr;
  int n = 0;              // rows to fetch (0: nothing)
  int64_t row_bytes = 0;  // of one row (the item's kv heads)
  int64_t quota = 0;      // pieces per share
  int row = 0;            // the next piece: row and byte in it
  int64_t byte = 0;

  // Fetch `count` rows of `bytes` in `steps` shares.
  void start(const void* const* r, int count, int64_t bytes, int64_t steps) {
    rows = r;
    n = count;
    row_bytes = bytes;
    steps = std::max<int64_t>(steps, 1);
    quota = (count * ((bytes + PIECE - 1) / PIECE) + steps - 1) / steps;
  }

  // Issue the next share.
  __attribute__((noinline)) void step() {
    take(quota, [](const char* piece) {
      for (int64_t c = 0; c < PIECE; c += 64) prefetch_line(piece + c);
    });
  }

  // The next share's line addresses into `lines` (at most MAX_LINES: the rest waits for the next
  // share); returns how many.
  __attribute__((noinline)) int next_lines(const char** lines) {
    int count = 0;
    take(std::min<int64_t>(quota, MAX_LINES / (PIECE / 64)), [&](const char* piece) {
      for (int64_t c = 0; c < PIECE; c += 64) lines[count++] = piece + c;
    });
    return count;
  }

 private:
  template <class F>
  void take(int64_t pieces, const F& f) {
    for (; pieces > 0 && row < n; --pieces) {
      f(static_cast<const char*>(rows[row]) + byte);
      byte += PIECE;
      if (byte >= row_bytes) {
        byte = 0;
        ++row;
      }
    }
  }
};

// A tile's share of the read-ahead: the line addresses from Ahead::next_lines, one issued per
// iteration of the tile's loop.
struct AheadShare {
  const char* const* lines = nullptr;
  int count = 0;
  __attribute__((always_inline)) void issue(int64_t i) const {
    if (i < count) prefetch_line(lines[i]);
  }
  void issue_from(int64_t i) const {  // those the loop had no iteration for
    for (; i < count; ++i) prefetch_line(lines[i]);
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
