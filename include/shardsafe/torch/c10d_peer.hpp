// shardsafe/torch/c10d_peer.hpp - point to point for c10d_comm over a Gloo process group (what
// makes it a PeerComm, dist/concepts.hpp), and the world-wide abort that turns a failure two
// ranks of a tree see into one every rank sees within moments.
//
// A message is one Gloo send of peer_head_bytes (its length, 8 bytes little-endian, then its
// first bytes), and, when longer, one more of the rest; each side posts its half, and the
// receiver learns the length from the head. Sends are posted and return (the PeerComm contract:
// buffered); a thread of the comm waits for them in order and keeps their bytes until then, so
// the comm's last copy waits for every send it posted before it goes (a rank that left with a
// message unsent would leave its peer waiting).
//
// The abort: in a tree (dist/agree.hpp) only a lost rank's neighbours see it go; the ranks below
// them wait on a parent that is alive but has given up. So every failed operation of the comm
// (c10d_comm::roll_call) first sets the world's abort key in the store the ranks met through
// ("shardsafe/abort": the failing rank and why). While a rank waits for a message (or for a
// send to be taken), a thread of its comm looks for that key every `poll`; once set, it aborts
// the rank's pending operations (Gloo's Work::abort), and they and every later one throw
// errc::comm_error quoting it. So each rank fails within one poll of the first failure it did
// not see itself, and answers the roll call: the roll call names the lost ranks only, as it
// does for a failed all-gather. The world is of no further use after an abort; an operation
// aborted is kept (never freed) since Gloo may still hold its buffer.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/error.hpp"

namespace shardsafe::detail {

/// The first line of an exception's text (c10's carry a backtrace after it).
inline std::string first_line(std::string s) {
  if (const auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return s;
}

/// How often a rank waiting for a message looks for the world's abort key: a tenth of the roll
/// call, 20 to 250 ms.
inline std::chrono::milliseconds abort_poll(std::chrono::milliseconds roll_call) {
  return std::clamp<std::chrono::milliseconds>(roll_call / 10, std::chrono::milliseconds(20),
                                               std::chrono::milliseconds(250));
}

/// The roll call's record of rank r in the store.
inline std::string roll_call_key(int r) { return "shardsafe/roll_call/" + std::to_string(r); }

/// The store key a failing operation sets (its value: "rank R: why").
inline const char* c10d_abort_key() { return "shardsafe/abort"; }
/// A message's first Gloo send: its length (8 bytes) and up to peer_head_bytes - 8 of its bytes.
inline constexpr std::int64_t peer_head_bytes = 4096;
/// The Gloo tags of a message's head and rest (c10d's own point-to-point calls use 0 by default).
inline constexpr int peer_tag_head = 0x5afe0, peer_tag_rest = 0x5afe1;

/// Sets the abort key unless set (the first failure's text stays); the store's errors are
/// ignored (a store that does not answer is reported by the roll call).
inline void set_c10d_abort(c10d::Store& store, int rank, const std::string& why) {
  try {
    if (!store.check({c10d_abort_key()})) {
      const std::string v = "rank " + std::to_string(rank) + ": " + why;
      store.set(c10d_abort_key(), std::vector<std::uint8_t>(v.begin(), v.end()));
    }
  } catch (const std::exception&) {
  }
}

/// The ranks of a world of n whose answer to the roll call is not in the store (yet).
inline std::vector<int> roll_call_silent(c10d::Store& store, int n) {
  std::vector<int> silent;
  for (int r = 0; r < n; ++r)
    if (!store.check({roll_call_key(r)})) silent.push_back(r);
  return silent;
}

/// The roll call after rank `me` of `n` saw an operation fail for `why` (c10d_comm's class
/// comment): it sets the abort key, answers, and waits at most `limit` for every rank's answer;
/// returns what to add to the error. On a thread of its own, so that a store that does not
/// answer (a cut link) costs at most `limit`. The store's host (`host_wait` > 0) then keeps the
/// store up until every rank has answered (at most host_wait), and one roll call more, for the
/// last to read the answers.
inline std::string roll_call(const c10::intrusive_ptr<c10d::Store>& store, int me, int n,
                             std::chrono::milliseconds limit, std::chrono::milliseconds host_wait,
                             const std::string& why) {
  if (!store || limit.count() <= 0) return {};
  struct result {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::string text;
  };
  auto res = std::make_shared<result>();
  char budget[32];
  std::snprintf(budget, sizeof budget, "%.1f s", std::chrono::duration<double>(limit).count());
  std::thread([res, store, me, n, limit, why, budget = std::string(budget)] {
    std::string text;
    try {
      set_c10d_abort(*store, me, why);
      store->set(roll_call_key(me), std::vector<std::uint8_t>{1});
      const auto deadline = std::chrono::steady_clock::now() + limit;
      std::vector<int> silent;
      while (!(silent = roll_call_silent(*store, n)).empty() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (silent.empty()) {
        text = "; every rank answered the roll call in the store (each saw a collective fail)";
      } else {
        text = "; rank" + std::string(silent.size() > 1 ? "s " : " ");
        for (std::size_t i = 0; i < silent.size(); ++i) text += (i ? ", " : "") + std::to_string(silent[i]);
        text += " did not answer the roll call in the store within " + budget + " (lost, or still blocked)";
      }
    } catch (const std::exception& e) {
      text = "; the store (rank 0's, where the world met) did not answer the roll call: " + first_line(e.what());
    }
    std::lock_guard<std::mutex> lk(res->m);
    res->text = std::move(text);
    res->done = true;
    res->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lk(res->m);
  if (!res->cv.wait_for(lk, limit + std::chrono::milliseconds(500), [&] { return res->done; }))
    return "; the store (rank 0's, where the world met) did not answer the roll call within " + std::string(budget) +
           " (rank 0's host lost, or this rank cut off)";
  if (host_wait.count() > 0) {
    const auto deadline = std::chrono::steady_clock::now() + host_wait;
    try {
      while (!roll_call_silent(*store, n).empty() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::this_thread::sleep_for(limit);
    } catch (const std::exception&) {  // the store is this process's own: nothing more to keep up
    }
  }
  return res->text;
}

/// Gloo operations abandoned by an abort: kept for the process's life.
inline void keep_forever(c10::intrusive_ptr<c10d::Work> w) {
  static std::mutex m;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  std::lock_guard<std::mutex> lk(m);
  kept->push_back(std::move(w));
}

/// A c10d_comm's point-to-point state, shared by its copies.
class c10d_peers {
 public:
  c10d_peers(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::Store> store,
             std::chrono::milliseconds poll)
      : s_(std::make_shared<shared>()) {
    s_->pg = std::move(pg);
    s_->store = std::move(store);
    s_->poll = poll;
  }
  c10d_peers(const c10d_peers&) = delete;
  c10d_peers& operator=(const c10d_peers&) = delete;
  /// Waits for every send posted (each bounded by the group's timeout), then lets the threads go.
  ~c10d_peers() {
    std::unique_lock<std::mutex> lk(s_->m);
    s_->cv.wait(lk, [&] { return s_->sending.empty() || s_->aborted || !s_->reaper_running; });
    s_->stop = true;
    s_->cv.notify_all();
  }

  /// Posts s to `peer`; returns at once. Throws the abort, or a failed earlier send, if any.
  void send(std::string_view s, int peer) {
    throw_if_aborted();
    at::Tensor head = at::zeros({peer_head_bytes}, at::kByte);
    auto* h = static_cast<std::byte*>(head.data_ptr());
    store_le(h, 8, s.size());
    const std::size_t first = std::min<std::size_t>(s.size(), peer_head_bytes - 8);
    std::memcpy(h + 8, s.data(), first);
    std::vector<c10::intrusive_ptr<c10d::Work>> posted;
    std::vector<at::Tensor> hv{head};
    posted.push_back(s_->pg->send(hv, peer, peer_tag_head));
    if (s.size() > first) {
      at::Tensor rest = at::empty({static_cast<std::int64_t>(s.size() - first)}, at::kByte);
      std::memcpy(rest.data_ptr(), s.data() + first, s.size() - first);
      std::vector<at::Tensor> rv{rest};
      posted.push_back(s_->pg->send(rv, peer, peer_tag_rest));
    }
    std::lock_guard<std::mutex> lk(s_->m);
    for (auto& w : posted) s_->sending.push_back({std::move(w), peer});
    start_threads();
    s_->cv.notify_all();
  }

  /// The world is broken (an operation of this rank failed for `why`): what waits is aborted,
  /// and every later operation throws at once (it would wait for the group's timeout again), and
  /// the comm's last copy no longer waits for its sends.
  void break_world(const std::string& why) {
    std::lock_guard<std::mutex> lk(s_->m);
    abort_all(*s_, "an earlier operation of this rank failed: " + why);
  }

  /// The next message from `peer`.
  std::string recv(int peer) {
    at::Tensor head = at::empty({peer_head_bytes}, at::kByte);
    wait_recv(head, peer, peer_tag_head);
    const auto* h = static_cast<const std::byte*>(head.data_ptr());
    const std::uint64_t len = load_le(h, 8);
    if (len > (std::uint64_t(1) << 40))
      fail(errc::comm_error, "rank " + std::to_string(peer) + "'s message says " + std::to_string(len) +
                                 " bytes, more than 1 TiB: not a shardsafe message");
    const std::size_t first = std::min<std::size_t>(len, peer_head_bytes - 8);
    std::string out(reinterpret_cast<const char*>(h) + 8, first);
    if (len > first) {
      at::Tensor rest = at::empty({static_cast<std::int64_t>(len - first)}, at::kByte);
      wait_recv(rest, peer, peer_tag_rest);
      out.append(static_cast<const char*>(rest.data_ptr()), len - first);
    }
    return out;
  }

 private:
  struct pending_send {
    c10::intrusive_ptr<c10d::Work> work;
    int peer = 0;
  };
  struct shared {
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    c10::intrusive_ptr<c10d::Store> store;
    std::chrono::milliseconds poll{100};
    std::mutex m;
    std::condition_variable cv;
    std::vector<c10::intrusive_ptr<c10d::Work>> receiving;  // receives waited for now
    std::deque<pending_send> sending;                       // sends posted, in order, not yet taken
    bool stop = false, aborted = false, threads = false, reaper_running = false;
    std::string why;  // the abort's text, or the first failed send's
  };

  /// With s.m held: marks the comm aborted for `why` (the first reason stays) and aborts every
  /// operation waited for.
  static void abort_all(shared& s, std::string why) {
    if (!s.aborted) {
      s.aborted = true;
      s.why = std::move(why);
    }
    for (auto& w : s.receiving) w->abort();
    for (auto& p : s.sending) p.work->abort();
    s.cv.notify_all();
  }

  void throw_if_aborted() {
    std::lock_guard<std::mutex> lk(s_->m);
    if (s_->aborted) fail(errc::comm_error, s_->why);
  }

  void wait_recv(at::Tensor& t, int peer, int tag) {
    std::vector<at::Tensor> v{t};
    c10::intrusive_ptr<c10d::Work> w;
    {
      std::lock_guard<std::mutex> lk(s_->m);
      if (s_->aborted) fail(errc::comm_error, s_->why);
      w = s_->pg->recv(v, peer, tag);
      s_->receiving.push_back(w);
      start_threads();
      s_->cv.notify_all();
    }
    struct unlist {
      shared& s;
      const c10::intrusive_ptr<c10d::Work>& w;
      ~unlist() {
        std::lock_guard<std::mutex> lk(s.m);
        std::erase(s.receiving, w);
      }
    };
    bool done = false;
    {
      unlist u{*s_, w};
      done = w->wait();  // Gloo's error (a peer gone, the group's timeout) propagates
    }
    if (!done) {
      keep_forever(w);
      std::lock_guard<std::mutex> lk(s_->m);
      fail(errc::comm_error, s_->why);
    }
  }

  /// With s_->m held: the watcher and the reaper, once.
  void start_threads() {
    if (s_->threads) return;
    s_->threads = s_->reaper_running = true;
    std::thread(watch, s_).detach();
    std::thread(reap, s_).detach();
  }

  /// Looks for the abort key while anything waits; aborts what waits when it is set.
  static void watch(std::shared_ptr<shared> s) {
    std::unique_lock<std::mutex> lk(s->m);
    while (!s->stop && !s->aborted) {
      s->cv.wait(lk, [&] { return s->stop || !s->receiving.empty() || !s->sending.empty(); });
      if (s->stop) break;
      lk.unlock();
      std::string why;
      bool set = false;
      try {
        if (s->store->check({c10d_abort_key()})) {
          const std::vector<std::uint8_t> v = s->store->get(c10d_abort_key());
          why.assign(v.begin(), v.end());
          set = true;
        }
      } catch (const std::exception&) {  // the store is gone or cut off: nothing learned
      }
      lk.lock();
      if (set) {
        abort_all(*s, "the world was aborted: " + why);
        break;
      }
      s->cv.wait_for(lk, s->poll, [&] { return s->stop; });
    }
  }

  /// Waits for the sends in the order posted; a failed one aborts the world.
  static void reap(std::shared_ptr<shared> s) {
    std::unique_lock<std::mutex> lk(s->m);
    for (;;) {
      s->cv.wait(lk, [&] { return s->stop || !s->sending.empty(); });
      if (s->sending.empty()) break;
      pending_send p = s->sending.front();
      lk.unlock();
      std::string err;
      bool done = false;
      try {
        done = p.work->wait();
      } catch (const std::exception& e) {
        err = first_line(e.what());
      }
      const std::string why = "a send to rank " + std::to_string(p.peer) + " failed: " + err;
      lk.lock();
      s->sending.pop_front();
      if (!done) keep_forever(p.work);
      if (!err.empty()) abort_all(*s, why);  // before the store, which may not answer (a cut link)
      s->cv.notify_all();
      if (!err.empty()) {
        lk.unlock();
        set_c10d_abort(*s->store, s->pg->getRank(), why);
        lk.lock();
      }
    }
    s->reaper_running = false;
    s->cv.notify_all();
  }

  std::shared_ptr<shared> s_;
};

}  // namespace shardsafe::detail
