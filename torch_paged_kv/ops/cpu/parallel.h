// parallel.h: how many threads a call uses, and the loop that runs on them.
// Part of kernels.cpp's one translation unit (see there); everything is in its anonymous namespace.
#pragma once

#include <algorithm>
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

int thread_count(int requested, double work, double min_work_per_thread) {
  if (requested <= 1) return 1;
  int n = static_cast<int>(std::min<double>(requested, work / min_work_per_thread));
  return std::max(n, 1);
}

// f(0) .. f(n - 1) on `threads` threads (OpenMP's), or a plain loop: one thread never enters OpenMP.
template <bool DYNAMIC, class F>
void parallel_for(int64_t n, int threads, const F& f) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  if constexpr (DYNAMIC) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

}  // namespace
