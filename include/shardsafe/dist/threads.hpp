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
// root's; barrier sends nothing). Ranks also send bytes to one rank (send_bytes, recv_bytes: a
// PeerComm, a mailbox per pair of ranks). A rank that times out breaks the world: it and every
// rank waiting in it, or coming to it later, throw errc::comm_error naming the rank that timed
// out and the ranks it waited for (those that never came to the collective, or the peer that
// never sent); a round never completes with a stale contribution of a rank that gave up.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
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
      : n_(n),
        timeout_(timeout),
        slots_(static_cast<std::size_t>(n)),
        came_(static_cast<std::size_t>(n), 0),
        waiting_(static_cast<std::size_t>(n), 0),
        wake_(std::make_unique<std::condition_variable[]>(static_cast<std::size_t>(n))) {}

  int size() const noexcept { return n_; }

  /// Every rank's contribution, indexed by rank, once all n ranks have called it. Throws
  /// errc::comm_error when this rank waits longer than the timeout, naming the ranks that did not
  /// come, and from then on in every rank that waits or calls (the world is broken: the rank that
  /// timed out left its slot).
  std::vector<std::string> exchange(int rank, std::string mine) {
    std::unique_lock lock(m_);
    if (broken_by_ >= 0) throw broken(rank);
    slots_[static_cast<std::size_t>(rank)] = std::move(mine);
    came_[static_cast<std::size_t>(rank)] = 1;
    const std::uint64_t gen = generation_;
    waiting_[static_cast<std::size_t>(rank)] = 1;
    struct not_waiting {
      char& w;
      ~not_waiting() { w = 0; }
    } left{waiting_[static_cast<std::size_t>(rank)]};
    if (++arrived_ == n_) {
      result_ = slots_;
      arrived_ = 0;
      std::fill(came_.begin(), came_.end(), 0);
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || broken_by_ >= 0; })) {
      break_world(rank, "timed out waiting in a collective that rank(s) " + ranks_where([&](int r) {
                          return !came_[static_cast<std::size_t>(r)];
                        }) + " did not come to");
      throw broken(rank);
    } else if (generation_ == gen) {
      throw broken(rank);  // another rank timed out while this one waited
    }
    return result_;  // replaced only when all ranks, this one included, arrive again
  }

  /// Puts s in the mailbox from rank `from` to rank `to` (it waits there for to's receive).
  void send(int from, int to, std::string s) {
    std::unique_lock lock(m_);
    if (broken_by_ >= 0) throw broken(from);
    mail_[{from, to}].push_back(std::move(s));
    wake_[static_cast<std::size_t>(to)].notify_one();
  }

  /// The first bytes in the mailbox from `from` to `me`, waiting for them at most the timeout
  /// (then the world is broken, naming `from`).
  std::string receive(int me, int from) {
    std::unique_lock lock(m_);
    auto& box = mail_[{from, me}];
    waiting_[static_cast<std::size_t>(me)] = 1;
    const bool got =
        wake_[static_cast<std::size_t>(me)].wait_for(lock, timeout_, [&] { return !box.empty() || broken_by_ >= 0; });
    waiting_[static_cast<std::size_t>(me)] = 0;
    if (!got) {
      // the ranks in no call of the world: the one that never came is among them
      const std::string away = ranks_where([&](int r) { return r != me && !waiting_[static_cast<std::size_t>(r)]; });
      break_world(me, "timed out waiting for rank " + std::to_string(from) + "'s message (rank(s) " +
                          (away.empty() ? std::string("none") : away) +
                          " in no call of the world: never came, or busy elsewhere)");
      throw broken(me);
    }
    if (box.empty()) throw broken(me);
    std::string s = std::move(box.front());
    box.pop_front();
    return s;
  }

 private:
  /// The ranks for which pred holds, as "1, 5, 7".
  template <class Pred>
  std::string ranks_where(Pred pred) const {
    std::string s;
    for (int r = 0; r < n_; ++r)
      if (pred(r)) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  }

  /// Called with m_ held: the world is broken by `rank`, for `why`; every waiting rank is woken.
  void break_world(int rank, std::string why) {
    broken_by_ = rank;
    broken_why_ = std::move(why);
    cv_.notify_all();
    for (int r = 0; r < n_; ++r) wake_[static_cast<std::size_t>(r)].notify_all();
  }

  error broken(int rank) const {
    const std::string why =
        "rank " + std::to_string(broken_by_) + " " + broken_why_ + "; the world is of no further use";
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
  std::string broken_why_;
  std::uint64_t generation_ = 0;
  std::vector<std::string> slots_;
  std::vector<char> came_;     // whether each rank is in the round under way
  std::vector<char> waiting_;  // whether each rank waits in a call of the world now
  std::vector<std::string> result_;
  std::map<std::pair<int, int>, std::deque<std::string>> mail_;  // (from, to) -> bytes in order
  std::unique_ptr<std::condition_variable[]> wake_;              // a rank's, for its mail
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
  bool peer_to_peer() const noexcept { return true; }
  void send_bytes(std::string_view s, int peer) { w_->send(rank_, checked(peer), std::string(s)); }
  std::string recv_bytes(int peer) { return w_->receive(rank_, checked(peer)); }

 private:
  int checked(int peer) const {
    if (peer < 0 || peer >= w_->size() || peer == rank_)
      fail(errc::invalid_argument, "thread_comm: rank " + std::to_string(rank_) +
                                       " cannot send to or receive from rank " + std::to_string(peer) +
                                       " (a world of " + std::to_string(w_->size()) + ")");
    return peer;
  }

  thread_world* w_;
  int rank_;
};

static_assert(PeerComm<thread_comm>);

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
