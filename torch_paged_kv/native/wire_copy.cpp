// Page transfer on the CPU: copy pool pages into a wire message (or back) and take the message's
// sum64 checksum (torch_paged_kv/distributed/wire.py) in the same pass over the bytes; or take the
// sum64 of bytes in place (a message that is a run of pool pages itself).
//
// The message goes by in 4 KiB rows, the checksum's rows. A row inside one segment is copied and
// summed word by word in one loop (one read and one write of each byte; the 4 KiB of column sums
// stay in L1). A row that spans segments, or the last partial one, is assembled with memcpy and
// summed in cache. One thread: on the machines this serves, the other cores move the sockets.

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "sum64 reads little-endian words");

namespace {

constexpr int64_t kRowBytes = 4096;
constexpr int64_t kRowWords = kRowBytes / 8;
constexpr uint64_t kColumnFactor = 0x9E3779B97F4A7C15ull;

struct Segment {
  int64_t message_offset;
  int64_t pool_address;
  int64_t nbytes;
};

// Row and column sums of the rows seen so far; the checksum is a function of them and the length.
struct Sum64 {
  uint64_t weighted_rows = 0;  // sum_r s_r (2r + 1), s_r the sum of row r's words
  alignas(32) uint64_t columns[kRowWords] = {};

#if defined(__AVX2__)
  // Add the whole row at `src` as row r; with `stream_to` (32-byte aligned), copy it there too, with
  // non-temporal stores: the destination is not read again soon (the socket or the next decode step
  // takes it from memory), and streaming skips reading each destination line before writing it:
  // 5-6 -> 8 GB/s for a 32 MiB chunk here.
  void add_row_avx2(const uint8_t* src, uint8_t* stream_to, int64_t r) {
    __m256i s = _mm256_setzero_si256();
    for (int64_t c = 0; c < kRowWords; c += 4) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 8 * c));
      if (stream_to) _mm256_stream_si256(reinterpret_cast<__m256i*>(stream_to + 8 * c), w);
      __m256i* col = reinterpret_cast<__m256i*>(columns + c);
      _mm256_store_si256(col, _mm256_add_epi64(_mm256_load_si256(col), w));
      s = _mm256_add_epi64(s, w);
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
    weighted_rows += (lanes[0] + lanes[1] + lanes[2] + lanes[3]) * static_cast<uint64_t>(2 * r + 1);
  }
#endif

  void add_row(const uint8_t* row, int64_t r) {
#if defined(__AVX2__)
    add_row_avx2(row, nullptr, r);
#else
    uint64_t s = 0;
    for (int64_t c = 0; c < kRowWords; ++c) {
      uint64_t w;
      std::memcpy(&w, row + 8 * c, 8);
      columns[c] += w;
      s += w;
    }
    weighted_rows += s * static_cast<uint64_t>(2 * r + 1);
#endif
  }

  // Copy a whole row and add it as row r. GCC would split the loop into a memmove and a sum (two
  // passes; glibc's memmove of 4 KiB can also take a rep-movsb path that runs at 2 GB/s on AMD EPYC
  // when dst - src is just past a multiple of 4 KiB): keep it one loop.
#if defined(__GNUC__) && !defined(__clang__)
  __attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
  void copy_row(uint8_t* __restrict dst, const uint8_t* __restrict src, int64_t r) {
    uint64_t s = 0;
    for (int64_t c = 0; c < kRowWords; ++c) {
      uint64_t w;
      std::memcpy(&w, src + 8 * c, 8);
      std::memcpy(dst + 8 * c, &w, 8);
      columns[c] += w;
      s += w;
    }
    weighted_rows += s * static_cast<uint64_t>(2 * r + 1);
  }

  // Add the row of `nbytes` < 4096 bytes at `row`, zero-padded to a whole row.
  void add_partial_row(const uint8_t* row, int64_t nbytes, int64_t r) {
    uint8_t padded[kRowBytes] = {};
    std::memcpy(padded, row, static_cast<size_t>(nbytes));
    add_row(padded, r);
  }

  uint64_t value(int64_t nbytes) const {
    uint64_t weighted_columns = 0;
    for (int64_t c = 0; c < kRowWords; ++c) weighted_columns += columns[c] * static_cast<uint64_t>(2 * c + 1);
    return weighted_rows + kColumnFactor * weighted_columns + static_cast<uint64_t>(nbytes);
  }
};

// Copy the parts of segments[first..] that fall in message bytes [lo, hi) into the message or out.
void copy_pieces(const Segment* segments, int64_t count, int64_t first, uint8_t* message, int64_t lo, int64_t hi,
                 bool to_message) {
  for (int64_t i = first; i < count && segments[i].message_offset < hi; ++i) {
    const Segment& s = segments[i];
    const int64_t a = std::max(lo, s.message_offset), b = std::min(hi, s.message_offset + s.nbytes);
    if (b <= a) continue;
    uint8_t* pool = reinterpret_cast<uint8_t*>(s.pool_address) + (a - s.message_offset);
    if (to_message)
      std::memcpy(message + a, pool, static_cast<size_t>(b - a));
    else
      std::memcpy(pool, message + a, static_cast<size_t>(b - a));
  }
}

}  // namespace

// Copy `count` segments (message offset, pool address, bytes; in message order, covering message
// bytes [0, payload_len) without gaps) into the message (`to_message`) or out of it, and return the
// sum64 checksum of message bytes [0, payload_len): the bytes written when packing, the bytes read
// when unpacking.
extern "C" uint64_t pkv_wire_copy(const int64_t* segments, int64_t count, uint8_t* message, int64_t payload_len,
                                  int to_message) {
  const Segment* segs = reinterpret_cast<const Segment*>(segments);
  Sum64 sum;
  int64_t first = 0;  // the first segment that ends past the row's start
  for (int64_t lo = 0, r = 0; lo < payload_len; lo += kRowBytes, ++r) {
    const int64_t hi = std::min(payload_len, lo + kRowBytes);
    while (first < count && segs[first].message_offset + segs[first].nbytes <= lo) ++first;
    const Segment* s = first < count ? &segs[first] : nullptr;
    if (s && hi - lo == kRowBytes && s->message_offset <= lo && hi <= s->message_offset + s->nbytes) {
      uint8_t* pool = reinterpret_cast<uint8_t*>(s->pool_address) + (lo - s->message_offset);
      uint8_t* dst = to_message ? message + lo : pool;
      const uint8_t* src = to_message ? pool : message + lo;
#if defined(__AVX2__)
      if (reinterpret_cast<uintptr_t>(dst) % 32 == 0) {
        sum.add_row_avx2(src, dst, r);
        continue;
      }
#endif
      sum.copy_row(dst, src, r);
      continue;
    }
    if (to_message) copy_pieces(segs, count, first, message, lo, hi, true);
    if (hi - lo == kRowBytes)
      sum.add_row(message + lo, r);
    else
      sum.add_partial_row(message + lo, hi - lo, r);
    if (!to_message) copy_pieces(segs, count, first, message, lo, hi, false);
  }
#if defined(__AVX2__)
  _mm_sfence();
#endif
  return sum.value(payload_len);
}

// The sum64 checksum of `nbytes` bytes at `data`, read in place.
extern "C" uint64_t pkv_wire_sum(const uint8_t* data, int64_t nbytes) {
  Sum64 sum;
  int64_t lo = 0, r = 0;
  for (; lo + kRowBytes <= nbytes; lo += kRowBytes, ++r) sum.add_row(data + lo, r);
  if (lo < nbytes) sum.add_partial_row(data + lo, nbytes - lo, r);
  return sum.value(nbytes);
}
