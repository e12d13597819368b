// tests/thread_world.hpp - a world of N threads acting as ranks, for testing collective
// algorithms without LibTorch or processes.
//
// run_ranks(n, body) starts n threads; thread r calls body(comm) with a thread_comm of rank r
// (a Comm: all_gather_bytes, broadcast_bytes and barrier rendezvous through a shared
// thread_world), and returns what each rank threw (or nullptr), indexed by rank. A rank that
// waits in a collective longer than the timeout (because another rank never arrives) throws
// errc::comm_error instead of hanging the test (the world is of no further use then).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/concepts.hpp"

namespace testing {

/// The rendezvous the ranks of one world share.
class thread_world {
 public:
  explicit thread_world(int n, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : n_(n), timeout_(timeout), slots_(static_cast<std::size_t>(n)) {}

  int size() const noexcept { return n_; }

  /// Every rank's contribution, indexed by rank, once all n ranks have called it.
  std::vector<std::string> exchange(int rank, std::string mine) {
    std::unique_lock lock(m_);
    slots_[static_cast<std::size_t>(rank)] = std::move(mine);
    const std::uint64_t gen = generation_;
    if (++arrived_ == n_) {
      result_ = slots_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen; })) {
      throw shardsafe::error(shardsafe::errc::comm_error,
                             "thread_world: rank " + std::to_string(rank) + " waited in vain for the other ranks");
    }
    return result_;  // replaced only when all ranks, this one included, arrive again
  }

 private:
  int n_;
  std::chrono::milliseconds timeout_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::vector<std::string> slots_;
  std::vector<std::string> result_;
};

/// One rank's view of a thread_world: a Comm.
class thread_comm {
 public:
  thread_comm(thread_world& w, int rank) : w_(&w), rank_(rank) {}
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return w_->size(); }
  void barrier() { w_->exchange(rank_, {}); }
  std::vector<std::string> all_gather_bytes(std::string_view s) { return w_->exchange(rank_, std::string(s)); }
  void broadcast_bytes(std::string& s, int root) {
    auto all = w_->exchange(rank_, rank_ == root ? s : std::string());
    s = std::move(all.at(static_cast<std::size_t>(root)));
  }

 private:
  thread_world* w_;
  int rank_;
};

static_assert(shardsafe::Comm<thread_comm>);

/// Runs body(comm) on n threads, one per rank; returns what each rank threw (nullptr: nothing).
inline std::vector<std::exception_ptr> run_ranks(int n, const std::function<void(thread_comm&)>& body,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  thread_world world(n, timeout);
  std::vector<std::exception_ptr> thrown(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      thread_comm comm(world, r);
      try {
        body(comm);
      } catch (...) {
        thrown[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return thrown;
}

/// What an exception a rank threw says: its message, and its code (errc::io_error for one that is
/// not a shardsafe::error); "" and ok for no exception.
inline std::string error_message_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "(not a std::exception)";
  }
}
inline std::error_code error_code_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const shardsafe::error& x) {
    return x.code();
  } catch (...) {
    return shardsafe::make_error_code(shardsafe::errc::io_error);
  }
}

}  // namespace testing
