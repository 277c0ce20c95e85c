// The read side of a paged decode and nothing else, for bench_cpu.py's "bound" row: every
// sequence's pages of one layer, K then V of each page, summed as 64-bit words in table order on
// `threads` threads (each a contiguous share of the sequences' pages, as the kernel's items are).
// What a paged kernel could reach on this machine if its arithmetic were free.
// `stream_read`: the same sums over one contiguous buffer, the read bandwidth probe's second reader.
#include <cstdint>

// The sum of n 64-bit words (n a multiple of 4), four chains at a time.
static uint64_t sum_words(const uint64_t* w, int64_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (int64_t k = 0; k < n; k += 4) {
    a += w[k];
    b += w[k + 1];
    c += w[k + 2];
    d += w[k + 3];
  }
  return a + b + c + d;
}

extern "C" uint64_t page_stream(const char* blocks, const int32_t* table, int64_t table_stride, int64_t batch,
                                int64_t pages_per_seq, int64_t page_bytes, int64_t plane_bytes, int64_t read_bytes,
                                int threads) {
  uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
  for (int64_t i = 0; i < batch * pages_per_seq; ++i) {
    const char* page = blocks + table[(i / pages_per_seq) * table_stride + i % pages_per_seq] * page_bytes;
    for (int plane = 0; plane < 2; ++plane) {
      total += sum_words(reinterpret_cast<const uint64_t*>(page + plane * plane_bytes), read_bytes / 8);
    }
  }
  return total;
}

extern "C" uint64_t stream_read(const char* data, int64_t nbytes, int threads) {
  const int64_t chunk = 1 << 16;
  uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
  for (int64_t i = 0; i < nbytes / chunk; ++i) {
    total += sum_words(reinterpret_cast<const uint64_t*>(data + i * chunk), chunk / 8);
  }
  return total;
}
