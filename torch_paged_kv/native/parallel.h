// parallel.h: how many threads a call uses, and the loop that runs on them.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
//
// Fanning out pays only while the other threads get a core at once. Where other processes hold
// the cores, a thread the OS runs late holds up the whole call at the end of the parallel loop
// (the caller waits there for every thread of the team): a decode call of 0.5 ms on one thread
// took 19 ms on two on a 2-core machine at load average 6. So every parallel loop is measured: if
// it took longer (wall time) than the CPU time its threads spent on the items, one thread alone
// would have been faster, and the calls of the next `backoff` stay on one thread. The backoff
// starts at 10 ms and doubles while loops keep losing, up to 1 s; the first loop that gains ends it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t FIRST_BACKOFF_NS = 10'000'000, LAST_BACKOFF_NS = 1'000'000'000;

struct FanOut {
  std::atomic<int64_t> serial_until_ns{0};  // steady clock: no fanning out before this
  std::atomic<int64_t> backoff_ns{0};       // the last backoff (0: the last loop gained)
  std::atomic<int64_t> losses{0};           // loops that lost, for the tests (pkv_parallel_losses)
};
FanOut fan_out;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t thread_cpu_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

int thread_count(int requested, double work, double min_work_per_thread) {
  if (requested <= 1) return 1;
  int n = static_cast<int>(std::min<double>(requested, work / min_work_per_thread));
  if (n > 1 && now_ns() < fan_out.serial_until_ns.load(std::memory_order_relaxed)) return 1;
  return std::max(n, 1);
}

// A parallel loop took `wall_ns`; its threads spent `busy_ns` of CPU time on the items.
void record_fan_out(int64_t wall_ns, int64_t busy_ns) {
  if (wall_ns <= busy_ns) {
    fan_out.backoff_ns.store(0, std::memory_order_relaxed);
    return;
  }
  const int64_t last = fan_out.backoff_ns.load(std::memory_order_relaxed);
  const int64_t backoff = std::clamp<int64_t>(2 * last, FIRST_BACKOFF_NS, LAST_BACKOFF_NS);
  fan_out.backoff_ns.store(backoff, std::memory_order_relaxed);
  fan_out.serial_until_ns.store(now_ns() + backoff, std::memory_order_relaxed);
  fan_out.losses.fetch_add(1, std::memory_order_relaxed);
}

// f(0) .. f(n - 1) on `threads` threads (OpenMP's), or a plain loop: one thread never enters OpenMP.
template <bool DYNAMIC, class F>
void parallel_for(int64_t n, int threads, const F& f) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  const int64_t start = now_ns();
  std::atomic<int64_t> busy{0};
#pragma omp parallel num_threads(threads)
  {
    const int64_t cpu = thread_cpu_ns();
    if constexpr (DYNAMIC) {
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t i = 0; i < n; ++i) f(i);
    } else {
#pragma omp for schedule(static) nowait
      for (int64_t i = 0; i < n; ++i) f(i);
    }
    busy.fetch_add(thread_cpu_ns() - cpu, std::memory_order_relaxed);
  }
  record_fan_out(now_ns() - start, busy.load(std::memory_order_relaxed));
}

}  // namespace
