// shardsafe/dist/threads.hpp - a world of threads in one process, each thread a rank: a Comm
// for trying collective code (import, save, load, resharding) on several ranks without LibTorch
// or processes, and for programs that shard work over threads.
//
//   std::vector<std::exception_ptr> thrown = run_ranks(4, [&](thread_comm& comm) {
//     save(dir, views_of(comm.rank()), comm);
//   });
//
// The collectives rendezvous in a shared thread_world: every rank's contribution is collected
// and handed to all once the last rank arrives (all_gather_bytes; broadcast_bytes keeps the
// root's; barrier sends nothing). A rank that times out breaks the world: it and every rank
// waiting in it, or coming to it later, throw errc::comm_error naming the rank that timed out
// (a round never completes with a stale contribution of a rank that gave up).
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

namespace shardsafe {

/// The rendezvous the ranks of one world share.
class thread_world {
 public:
  explicit thread_world(int n, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : n_(n), timeout_(timeout), slots_(static_cast<std::size_t>(n)) {}

  int size() const noexcept { return n_; }

  /// Every rank's contribution, indexed by rank, once all n ranks have called it. Throws
  /// errc::comm_error when this rank waits longer than the timeout, and from then on in every
  /// rank that waits or calls (the world is broken: the rank that timed out left its slot).
  std::vector<std::string> exchange(int rank, std::string mine) {
    std::unique_lock lock(m_);
    if (broken_by_ >= 0) throw broken(rank);
    slots_[static_cast<std::size_t>(rank)] = std::move(mine);
    const std::uint64_t gen = generation_;
    if (++arrived_ == n_) {
      result_ = slots_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || broken_by_ >= 0; })) {
      broken_by_ = rank;  // this rank gives up: no round may complete without it
      cv_.notify_all();
      throw broken(rank);
    } else if (generation_ == gen) {
      throw broken(rank);  // another rank timed out while this one waited
    }
    return result_;  // replaced only when all ranks, this one included, arrive again
  }

 private:
  error broken(int rank) const {
    const std::string why =
        "rank " + std::to_string(broken_by_) + " timed out waiting in a collective; the world is of no further use";
    if (rank == broken_by_) return error(errc::comm_error, "thread_world: " + why);
    return error(errc::comm_error,
                 "thread_world: rank " + std::to_string(rank) + " cannot complete a collective: " + why);
  }

  int n_;
  std::chrono::milliseconds timeout_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int broken_by_ = -1;  // the rank that timed out; -1 while the world is whole
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

static_assert(Comm<thread_comm>);

/// Runs body(comm) on n threads, one per rank, and waits for all; returns what each rank threw
/// (nullptr: nothing). A rank that waits in a collective longer than `timeout` (another rank
/// never came) throws errc::comm_error instead of hanging; the world is of no further use then:
/// every other rank's collective, waiting or later, throws errc::comm_error naming that rank.
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

}  // namespace shardsafe
