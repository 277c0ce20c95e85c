// The read side of a paged decode and nothing else, for bench_cpu.py's "bound" row: every
// sequence's pages of one layer, K then V of each page, summed as 64-bit words in table order on
// `threads` threads (each a contiguous share of the sequences' pages, as the kernel's items are),
// the next page's K and V prefetched into L2 one line per line summed (as the kernel reads ahead:
// scattered 32 KiB pages read without it reached 0.58-0.68 of a contiguous read on the Zen 4 VM,
// with it 0.86-0.98). What a paged kernel could reach on this machine if its arithmetic were free.
// `stream_read`: the same sums over one contiguous buffer: bench_cpu.py's read probes.
// `overlap`: synthetic compute and a chunk stream, alone and together (bench_overlap.py).
#include <cstdint>

// The sum of n 64-bit words (n a multiple of 8), four chains at a time; with `ahead`, the line at
// the same offset of `ahead` is prefetched into L2 for each line summed.
static uint64_t sum_words(const uint64_t* w, int64_t n, const char* ahead = nullptr) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (int64_t k = 0; k < n; k += 8) {
    if (ahead) __builtin_prefetch(ahead + k * 8, 0, 2);
    a += w[k] + w[k + 4];
    b += w[k + 1] + w[k + 5];
    c += w[k + 2] + w[k + 6];
    d += w[k + 3] + w[k + 7];
  }
  return a + b + c + d;
}

extern "C" uint64_t page_stream(const char* blocks, const int32_t* table, int64_t table_stride, int64_t batch,
                                int64_t pages_per_seq, int64_t page_bytes, int64_t plane_bytes, int64_t read_bytes,
                                int threads) {
  const int64_t pages = batch * pages_per_seq;
  auto page_at = [&](int64_t i) {
    return blocks + table[(i / pages_per_seq) * table_stride + i % pages_per_seq] * page_bytes;
  };
  uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
  for (int64_t i = 0; i < pages; ++i) {
    const char* page = page_at(i);
    const char* next = i + 1 < pages ? page_at(i + 1) : nullptr;
    for (int plane = 0; plane < 2; ++plane) {
      total += sum_words(reinterpret_cast<const uint64_t*>(page + plane * plane_bytes), read_bytes / 8,
                         next ? next + plane * plane_bytes : nullptr);
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

// Synthetic compute (eight chains of vector FMAs on registers, `fmas` vector FMAs per chunk) over
// `chunks` chunks of `chunk_bytes` at byte offsets `offsets`, split over `threads` threads, one of
// three ways. 0: the compute alone; 1: the chunks' word sums alone; 2: both, overlapped the way the
// kernels overlap them: while chunk i's compute runs, chunk i + 1 is prefetched into L2 in 16
// slices spread between its parts, then chunk i is summed. How much of a core's streaming survives
// its arithmetic (bench_overlap.py). Returns a value depending on all the work.
// One register's worth: a 64-byte vector without AVX-512 is two registers GCC kept on the stack,
// each FMA then a load and a store (the AVX2 figures before 2026-11-26 measured that loop).
#if defined(__AVX512F__)
typedef float vreg __attribute__((vector_size(64)));
#else
typedef float vreg __attribute__((vector_size(32)));
#endif
constexpr int LANES = sizeof(vreg) / sizeof(float);

static vreg fma_chains(vreg x, int64_t fmas) {
  vreg c[8];
  for (int j = 0; j < 8; ++j) c[j] = x + static_cast<float>(j);
  for (int64_t k = 0; k < fmas; k += 8) {
    for (int j = 0; j < 8; ++j) c[j] = c[j] * 0.999f + 0.001f;
  }
  vreg s = c[0];
  for (int j = 1; j < 8; ++j) s += c[j];
  return s;
}

extern "C" double overlap(const char* data, const int64_t* offsets, int64_t chunks, int64_t chunk_bytes, int64_t fmas,
                          int mode, int threads) {
  constexpr int SLICES = 16;
  double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const int64_t first = chunks * t / threads, last = chunks * (t + 1) / threads;
    vreg x = {};
    uint64_t sum = 0;
    for (int64_t i = first; i < last; ++i) {
      const char* chunk = data + offsets[i];
      if (mode == 1) {
        sum += sum_words(reinterpret_cast<const uint64_t*>(chunk), chunk_bytes / 8);
        continue;
      }
      if (mode == 0) {
        x = fma_chains(x, fmas);
        continue;
      }
      const char* next = data + offsets[i + 1 < last ? i + 1 : first];
      const int64_t slice = chunk_bytes / SLICES;
      for (int s = 0; s < SLICES; ++s) {
        for (int64_t b = s * slice; b < (s + 1) * slice; b += 64) __builtin_prefetch(next + b, 0, 2);
        x = fma_chains(x, fmas / SLICES);
      }
      sum += sum_words(reinterpret_cast<const uint64_t*>(chunk), chunk_bytes / 8);
    }
    for (int j = 0; j < LANES; ++j) total += x[j];
    total += static_cast<double>(sum);
  }
  return total;
}
