// work_split.h: the work-split policy of the attention kernels (flash_attention, mla_attention). A
// kernel lists its spans (items over their whole key range); where there are fewer spans than wanted
// items, long key ranges are split into parts, each an item whose unnormalised rows go to a partial
// buffer; the items run on the threads, and the thread that finishes a split span's last part merges
// its parts. Part of kernels.cpp's one translation unit (see there); everything is in its anonymous
// namespace.
#pragma once

#include <algorithm>
#include <atomic>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace {

template <class ItemT>
struct SplitTask {  // a split span, whose parts are the items of part first .. first + parts - 1
  ItemT span;
  int64_t first, parts;
};

// One call's work, in buffers each thread keeps (no allocation per call). An ItemT has the key range
// [k0, k1) and, where split, its part and task (spans come with -1, -1).
template <class ItemT>
struct WorkSplit {
  std::vector<ItemT> spans;  // listed by the kernel
  std::vector<ItemT> items;  // the spans in order, a split span as its parts in key order
  std::vector<SplitTask<ItemT>> tasks;
  std::vector<std::atomic<int64_t>> remaining;  // per task: its parts not yet done
  Floats partials;  // per part: its rows' unnormalised outputs (rows x width), then their max, then their sum
  int64_t part_stride = 0;
};

// This thread's WorkSplit for ItemT. (A thread_local variable template is not initialised by GCC 12.)
template <class ItemT>
WorkSplit<ItemT>& thread_work_split() {
  thread_local WorkSplit<ItemT> w;
  return w;
}

// Splits w.spans into w.items: with fewer spans than wanted items, a span of at least 2 min_split
// keys becomes up to ceil(want / spans) parts of at least min_split keys, each part's key count
// rounded up to `granule`. rows(span): its query rows; width: floats per row of a part's output.
template <class ItemT, class Rows>
void split_spans(WorkSplit<ItemT>& w, int64_t min_split_keys, int64_t want_items, int threads, int64_t granule,
                 int64_t width, const Rows& rows) {
  const int64_t min_split = std::max<int64_t>(min_split_keys, 1);
  // Several items per thread: a thread the OS takes away mid-call (other work on the machine) then
  // holds up only a small share, which the others pick up (dynamic schedule).
  const int64_t want = want_items > 0 ? want_items : threads > 1 ? 8 * threads : 1;
  const int64_t n_spans = static_cast<int64_t>(w.spans.size());
  w.items.clear();
  w.tasks.clear();
  int64_t parts = 0, max_rows = 0;
  for (const ItemT& sp : w.spans) {
    const int64_t keys = std::max<int64_t>(sp.k1 - sp.k0, 0);
    int64_t splits = 1;
    if (n_spans < want && keys >= 2 * min_split) {
      splits = std::min<int64_t>((want + n_spans - 1) / n_spans, keys / min_split);
    }
    if (splits <= 1) {
      w.items.push_back(sp);
      continue;
    }
    max_rows = std::max<int64_t>(max_rows, rows(sp));
    const int64_t chunk = round_up((keys + splits - 1) / splits, granule);
    SplitTask<ItemT> task{sp, parts, 0};
    for (int64_t k = sp.k0; k < sp.k1; k += chunk) {
      ItemT part = sp;
      part.k0 = k;
      part.k1 = std::min(sp.k1, k + chunk);
      part.part = parts++;
      part.task = static_cast<int64_t>(w.tasks.size());
      w.items.push_back(part);
      task.parts++;
    }
    w.tasks.push_back(task);
  }
  w.part_stride = max_rows * (width + 2);
  if (parts > 0 && static_cast<int64_t>(w.partials.size()) < parts * w.part_stride) {
    w.partials.resize(parts * w.part_stride);
  }
}

// attend(item, partials, part_stride) for every item on `threads` threads (dynamic schedule); the
// thread that finishes a task's last part then runs merge(task, partials, part_stride): one parallel
// loop, no barrier between the parts and the merges (each barrier waits for the slowest thread).
template <class ItemT, class Attend, class Merge>
void run_items(WorkSplit<ItemT>& w, int threads, const Attend& attend, const Merge& merge) {
  if (w.remaining.size() < w.tasks.size()) w.remaining = std::vector<std::atomic<int64_t>>(w.tasks.size());
  for (size_t t = 0; t < w.tasks.size(); ++t) w.remaining[t].store(w.tasks[t].parts, std::memory_order_relaxed);
  float* partials = w.partials.data();
  const int64_t part_stride = w.part_stride;
  parallel_for<true>(static_cast<int64_t>(w.items.size()), threads, [&](int64_t i) {
    const ItemT& it = w.items[i];
    attend(it, partials, part_stride);
    if (it.part >= 0 && w.remaining[it.task].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      merge(w.tasks[it.task], partials, part_stride);
    }
  });
}

}  // namespace
