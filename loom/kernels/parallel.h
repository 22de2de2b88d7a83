// Tasks shared out over torch's threads, with stealing.
//
// Each thread streams its own contiguous share of the tasks front to back, as a static split
// would; a thread that runs out of work then takes tasks from the back of the share with the most
// left. On a shared machine one core is often slower than the other (measured: a 2x gap in whole
// decode steps), and tasks may differ in cost (decode attention's, by their sequences' contexts):
// with a static split every call would wait for the slower core or the dearer share.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// A task to run, and the end (exclusive) of the run of tasks the same thread will probably take
// next (task + 1 on, unless stolen meanwhile); task -1: none left.
struct TaskClaim {
  int64_t task, end;
};

// Calls work(next) once in each of torch's threads (in one, in a parallel region or for a single
// task), where next() claims the thread's next task of [0, n); per-thread buffers live in work.
template <typename Work>
void for_each_task(int64_t n, Work work) {
  const int64_t T = std::min<int64_t>(at::get_num_threads(), n);
  if (T <= 1 || at::in_parallel_region()) {
    int64_t task = 0;
    work([&]() -> TaskClaim { return task < n ? TaskClaim{task++, n} : TaskClaim{-1, -1}; });
    return;
  }
  // Share t is [front, back) packed in one word, so that the owner (front) and thieves (back)
  // claim tasks with one compare-and-swap each.
  struct alignas(64) Share { std::atomic<uint64_t> range; };
  std::vector<Share> shares(T);
  for (int64_t t = 0; t < T; ++t)
    shares[t].range = (static_cast<uint64_t>(n * t / T) << 32) | static_cast<uint64_t>(n * (t + 1) / T);
  auto claim = [](Share& share, bool from_front) -> TaskClaim {
    uint64_t r = share.range.load(std::memory_order_relaxed);
    while (true) {
      const int64_t front = static_cast<int64_t>(r >> 32), back = static_cast<int64_t>(r & 0xFFFFFFFFu);
      if (front >= back) return {-1, -1};
      const uint64_t next = from_front ? static_cast<uint64_t>(front + 1) << 32 | static_cast<uint64_t>(back)
                                       : static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back - 1);
      if (share.range.compare_exchange_weak(r, next, std::memory_order_relaxed))
        return from_front ? TaskClaim{front, back} : TaskClaim{back - 1, back};
    }
  };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      bool own = true;  // still on this thread's share
      work([&]() -> TaskClaim {
        if (own) {
          if (const TaskClaim c = claim(shares[t], true); c.task >= 0) return c;
          own = false;
        }
        while (true) {  // help the share with the most tasks left
          int64_t victim = -1, most = 0;
          for (int64_t v = 0; v < T; ++v) {
            const uint64_t r = shares[v].range.load(std::memory_order_relaxed);
            const int64_t left = static_cast<int64_t>(r & 0xFFFFFFFFu) - static_cast<int64_t>(r >> 32);
            if (left > most) most = left, victim = v;
          }
          if (victim < 0) return {-1, -1};
          if (const TaskClaim c = claim(shares[victim], false); c.task >= 0) return c;
        }
      });
    }
  });
}
