// shardsafe/detail/thread_pool.hpp - a pool of threads that lives across loads and saves,
// and parallel_for on it: run n independent tasks on up to k threads.
//
// The caller of parallel_for works on its own tasks too, and pool threads only help: a
// parallel_for called from inside a task (write_blocks under a save, a backend's read_batch
// under a load) therefore always finishes, on the calling thread alone if every pool thread
// is busy. Pool threads are started when first needed and stay until the pool is destroyed
// (shared_pool(): at exit), so a load issues no thread creation after the first.
//
// fork(): a child has none of its parent's pool threads, yet a copy of the pool's mutex and
// condition variable as they were, the latter with those threads' waits still registered in it,
// so that the child's first parallel_for could block for ever (it did, in about half the forks
// made just after a parallel_for). Every pool therefore takes part in fork (a participant of
// detail/fork_guard.hpp, the process's one pthread_atfork registration): before the fork its
// mutex is taken (no pool thread is then between two of its steps), after it the parent lets
// go, and the child starts the pool afresh (no threads, a new condition variable; its threads
// are started again when needed). A fork from inside a parallel_for task is the exception: the
// child's copy of that parallel_for would wait for helpers it does not have, so such a child may
// only exec or _exit.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardsafe/detail/fork_guard.hpp"

namespace shardsafe::detail {

/// Threads to use when the caller says 0: the hardware's, at most 8 (I/O bound work gains
/// little beyond that and every thread may hold a staging buffer).
inline unsigned default_threads() noexcept {
  unsigned h = std::thread::hardware_concurrency();
  return std::clamp(h, 1u, 8u);
}

class thread_pool {
 public:
  /// The most pool threads one pool starts (a request for more threads gets this many helpers).
  static constexpr unsigned max_workers = 63;

  thread_pool() {
    fork_guard::instance().add({this, [](void* p) noexcept { static_cast<thread_pool*>(p)->m_.lock(); },
                                [](void* p) noexcept { static_cast<thread_pool*>(p)->m_.unlock(); },
                                [](void* p) noexcept { static_cast<thread_pool*>(p)->restart_in_child(); }});
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    fork_guard::instance().remove(this);  // last: a fork until now still finds the mutex free
  }

  /// Pool threads started so far.
  unsigned size() const {
    std::lock_guard lock(m_);
    return static_cast<unsigned>(workers_.size());
  }

  /// Calls f(i) for i in [0, n) on up to `threads` threads (0: default_threads()), the
  /// caller's among them. The first exception thrown stops new tasks from starting and is
  /// rethrown once every task that started has returned.
  template <class F>
  void parallel_for(std::size_t n, unsigned threads, F&& f) {
    if (n == 0) return;
    if (threads == 0) threads = default_threads();
    threads = static_cast<unsigned>(std::min<std::size_t>(threads, n));
    if (threads <= 1) {
      for (std::size_t i = 0; i < n; ++i) f(i);
      return;
    }
    using Fn = std::remove_reference_t<F>;
    job j;
    j.n = n;
    j.ctx = const_cast<void*>(static_cast<const void*>(std::addressof(f)));
    j.call = [](void* ctx, std::size_t i) { (*static_cast<Fn*>(ctx))(i); };
    {
      std::lock_guard lock(m_);
      const unsigned helpers = std::min(threads - 1, max_workers);
      while (workers_.size() < helpers) workers_.emplace_back([this] { worker_loop(); });
      j.wanted = helpers;
      queue_.push_back(&j);
    }
    wake_.notify_all();
    j.work();
    {
      // no helper joins from now on; wait for those that did
      std::unique_lock lock(m_);
      j.wanted = 0;
      std::erase(queue_, &j);
      j.done.wait(lock, [&] { return j.running == 0; });
    }
    if (j.first) std::rethrow_exception(j.first);
  }

 private:
  struct job {
    std::size_t n = 0;
    void* ctx = nullptr;
    void (*call)(void*, std::size_t) = nullptr;
    std::atomic<std::size_t> next{0};
    std::atomic<bool> stop{false};
    std::mutex error_mutex;
    std::exception_ptr first;
    unsigned wanted = 0;   // helpers still welcome (under the pool's mutex)
    unsigned running = 0;  // helpers inside work() (under the pool's mutex)
    std::condition_variable done;

    void work() noexcept {
      while (!stop.load(std::memory_order_relaxed)) {
        const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= n) return;
        try {
          call(ctx, i);
        } catch (...) {
          std::lock_guard lock(error_mutex);
          if (!first) first = std::current_exception();
          stop = true;
        }
      }
    }
  };

  void worker_loop() {
    std::unique_lock lock(m_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job* j = queue_.front();
      if (--j->wanted == 0) queue_.pop_front();
      ++j->running;
      lock.unlock();
      j->work();
      lock.lock();
      if (--j->running == 0) j->done.notify_all();
    }
  }

  /// In the child of a fork (the pool's mutex taken by the forking thread, which is the child's
  /// only thread): the condition variable is overwritten, not destroyed (its destructor would
  /// wait for the parent's threads), and the handles of threads that do not exist here are
  /// dropped without join or detach (their vector's storage is left allocated, a few bytes a
  /// fork). Jobs other parent threads had queued are forgotten: those threads are not in the
  /// child either.
  void restart_in_child() noexcept {
    new (&wake_) std::condition_variable;
    new (&workers_) std::vector<std::thread>;
    queue_.clear();
    m_.unlock();
  }

  mutable std::mutex m_;
  std::condition_variable wake_;
  std::deque<job*> queue_;  // jobs that still want helpers, oldest first
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

/// The pool every load and save of this process shares.
inline thread_pool& shared_pool() {
  static thread_pool pool;
  return pool;
}

/// parallel_for on the shared pool (see thread_pool::parallel_for).
template <class F>
void parallel_for(std::size_t n, unsigned threads, F&& f) {
  shared_pool().parallel_for(n, threads, std::forward<F>(f));
}

/// Spare things (staging buffers) shared by the tasks of one parallel_for: a task takes one (one
/// an earlier task gave back, or T{} when none is spare: the task sizes or allocates it) and
/// gives it back when done, so a loop allocates about as many as it runs tasks at once, not one
/// per task.
template <class T>
class spare_pool {
 public:
  T take() {
    std::lock_guard lock(m_);
    if (free_.empty()) return T{};
    T b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void give(T b) {
    std::lock_guard lock(m_);
    free_.push_back(std::move(b));
  }

 private:
  std::mutex m_;
  std::vector<T> free_;
};

/// Byte buffers, resized by whoever takes one (the loader's reads and checksum checks, verify).
using buffer_pool = spare_pool<std::vector<std::byte>>;

}  // namespace shardsafe::detail
