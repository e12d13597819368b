// shardsafe/detail/thread_pool.hpp - run n independent tasks on up to k threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace shardsafe::detail {

/// Threads to use when the caller says 0: the hardware's, at most 8 (I/O bound work gains
/// little beyond that and every thread may hold a staging buffer).
inline unsigned default_threads() noexcept {
  unsigned h = std::thread::hardware_concurrency();
  return std::clamp(h, 1u, 8u);
}

/// Calls f(i) for i in [0, n) on up to `threads` threads (the caller's among them). The
/// first exception thrown stops new tasks from starting and is rethrown after all joined.
template <class F>
void parallel_for(std::size_t n, unsigned threads, F&& f) {
  if (n == 0) return;
  if (threads == 0) threads = default_threads();
  threads = static_cast<unsigned>(std::min<std::size_t>(threads, n));
  if (threads <= 1) {
    for (std::size_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr first;
  std::mutex m;
  auto work = [&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      try {
        f(i);
      } catch (...) {
        std::lock_guard lock(m);
        if (!first) first = std::current_exception();
        stop = true;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace shardsafe::detail
