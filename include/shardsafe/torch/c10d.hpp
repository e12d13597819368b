// shardsafe/torch/c10d.hpp - Comm over a LibTorch c10d::ProcessGroup (Gloo on CPU; NCCL on
// GPUs, with the byte collectives on a CUDA device), and the world built from the variables
// torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
//
// Define USE_C10D_GLOO (the Meson dependency shardsafe-torch does) for init_world_from_env,
// which needs ProcessGroupGloo.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/torch/compat.hpp"

namespace shardsafe {

namespace detail {
/// The roll call's record of rank r in the store (c10d_comm, below).
inline std::string roll_call_key(int r) { return "shardsafe/roll_call/" + std::to_string(r); }
/// The ranks of a world of n whose answer to the roll call is not in the store (yet).
inline std::vector<int> roll_call_silent(c10d::Store& store, int n) {
  std::vector<int> silent;
  for (int r = 0; r < n; ++r)
    if (!store.check({roll_call_key(r)})) silent.push_back(r);
  return silent;
}
/// The first line of an exception's text (c10's carry a backtrace after it).
inline std::string first_line(std::string s) {
  if (const auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  return s;
}
}  // namespace detail

/// A Comm over a c10d process group. Byte collectives travel as uint8 tensors on `device`
/// (CPU for Gloo; the rank's CUDA device for NCCL).
///
/// A collective that fails (a peer died, a link is cut, the group's timeout passed) throws
/// errc::comm_error naming the operation, this rank and the transport's reason. Given the store
/// the world met through, the rank then calls a roll call there, at most `roll_call` long:
/// every rank whose collective fails answers it, and the message names the ranks that did not
/// answer (lost, or still blocked in another collective), or says that the store did not answer
/// (its host, rank 0's, is the one lost or cut off). The rank that hosts the store keeps it up
/// after its own roll call (`store_host_wait`, the group's timeout, for init_world_from_env's
/// rank 0) until every rank has answered or that long has passed, and then one roll call more:
/// a rank blocked in a collective that waits on the lost rank only through others fails by the
/// group's timeout, and still finds the store to answer and read. So a rank ends at most the
/// group's timeout plus `roll_call` after the failure, the store's host at most twice the
/// timeout plus twice `roll_call`.
class c10d_comm {
 public:
  explicit c10d_comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device = at::kCPU,
                     c10::intrusive_ptr<c10d::Store> store = {},
                     std::chrono::milliseconds roll_call = std::chrono::seconds(5),
                     std::chrono::milliseconds store_host_wait = std::chrono::milliseconds(0))
      : pg_(std::move(pg)), device_(device), store_(std::move(store)), roll_call_(roll_call),
        store_host_wait_(store_host_wait) {}

  int rank() const { return pg_->getRank(); }
  int world_size() const { return pg_->getSize(); }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const noexcept { return pg_; }

  void barrier() {
    guard("barrier", [&] { pg_->barrier()->wait(); });
  }

  std::vector<std::string> all_gather_bytes(std::string_view s) {
    std::vector<std::string> out;
    guard("all_gather_bytes", [&] {
      const int n = world_size();
      // lengths first, then the bytes padded to the longest
      std::vector<at::Tensor> len_in{at::full({1}, static_cast<std::int64_t>(s.size()), opts(at::kLong))};
      std::vector<std::vector<at::Tensor>> len_out(1);
      for (int r = 0; r < n; ++r) len_out[0].push_back(at::empty({1}, opts(at::kLong)));
      pg_->allgather(len_out, len_in)->wait();
      std::vector<std::int64_t> lens(n);
      std::int64_t longest = 0;
      for (int r = 0; r < n; ++r) {
        lens[r] = len_out[0][r].cpu().item<std::int64_t>();
        longest = std::max(longest, lens[r]);
      }
      at::Tensor mine = at::zeros({std::max<std::int64_t>(longest, 1)}, at::kByte);
      std::memcpy(mine.data_ptr(), s.data(), s.size());
      std::vector<at::Tensor> in{mine.to(device_)};
      std::vector<std::vector<at::Tensor>> all(1);
      for (int r = 0; r < n; ++r) all[0].push_back(at::empty({std::max<std::int64_t>(longest, 1)}, opts(at::kByte)));
      pg_->allgather(all, in)->wait();
      out.resize(n);
      for (int r = 0; r < n; ++r) {
        at::Tensor c = all[0][r].cpu();
        out[r].assign(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(lens[r]));
      }
    });
    return out;
  }

  void broadcast_bytes(std::string& s, int root) {
    guard("broadcast_bytes", [&] {
      std::vector<at::Tensor> len{at::full({1}, static_cast<std::int64_t>(s.size()), opts(at::kLong))};
      bcast(len, root);
      const std::int64_t n = len[0].cpu().item<std::int64_t>();
      if (n == 0) {
        s.clear();
        return;
      }
      at::Tensor buf = at::empty({n}, at::kByte);
      if (rank() == root) std::memcpy(buf.data_ptr(), s.data(), static_cast<std::size_t>(n));
      std::vector<at::Tensor> t{buf.to(device_)};
      bcast(t, root);
      at::Tensor c = t[0].cpu();
      s.assign(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(n));
    });
  }

  void broadcast_buffer(std::span<std::byte> b, int root) {
    if (b.empty()) return;
    guard("broadcast_buffer", [&] {
      at::Tensor t = at::from_blob(b.data(), {static_cast<std::int64_t>(b.size())}, at::kByte);
      if (device_.is_cpu()) {
        std::vector<at::Tensor> v{t};
        bcast(v, root);
      } else {
        std::vector<at::Tensor> v{t.to(device_)};
        bcast(v, root);
        t.copy_(v[0]);
      }
    });
  }

  /// Broadcasts a (contiguous) tensor in place, on whatever device it lives.
  void broadcast_tensor(at::Tensor& t, int root) {
    guard("broadcast_tensor", [&] {
      std::vector<at::Tensor> v{t};
      bcast(v, root);
    });
  }

 private:
  at::TensorOptions opts(at::ScalarType st) const { return at::TensorOptions().dtype(st).device(device_); }
  void bcast(std::vector<at::Tensor>& v, int root) {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    pg_->broadcast(v, o)->wait();
  }
  template <class F>
  void guard(const char* what, F&& f) {
    std::string why;
    try {
      f();
      return;
    } catch (const c10::Error& e) {
      why = e.what_without_backtrace();
    } catch (const std::exception& e) {  // Gloo's transport errors (gloo::IoException) come as they are
      why = e.what();
    }
    throw error(errc::comm_error, std::string("c10d ") + what + " on rank " + std::to_string(rank()) + " of " +
                                      std::to_string(world_size()) + " failed: " + detail::first_line(why) + roll_call());
  }

  /// The roll call after a failed collective (see the class comment); runs on a thread of its
  /// own so that a store that does not answer (a cut link) costs at most roll_call_.
  std::string roll_call() const {
    if (!store_ || roll_call_.count() <= 0) return {};
    struct result {
      std::mutex m;
      std::condition_variable cv;
      bool done = false;
      std::string text;
    };
    auto res = std::make_shared<result>();
    const double secs = std::chrono::duration<double>(roll_call_).count();
    char budget[32];
    std::snprintf(budget, sizeof budget, "%.1f s", secs);
    std::thread([res, store = store_, me = rank(), n = world_size(), limit = roll_call_, budget = std::string(budget)] {
      std::string text;
      try {
        store->set(detail::roll_call_key(me), std::vector<std::uint8_t>{1});
        const auto deadline = std::chrono::steady_clock::now() + limit;
        std::vector<int> silent;
        while (!(silent = detail::roll_call_silent(*store, n)).empty() && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (silent.empty()) {
          text = "; every rank answered the roll call in the store (each saw a collective fail)";
        } else {
          text = "; rank" + std::string(silent.size() > 1 ? "s " : " ");
          for (std::size_t i = 0; i < silent.size(); ++i) text += (i ? ", " : "") + std::to_string(silent[i]);
          text += " did not answer the roll call in the store within " + budget + " (lost, or still blocked)";
        }
      } catch (const std::exception& e) {
        text = "; the store (rank 0's, where the world met) did not answer the roll call: " + detail::first_line(e.what());
      }
      std::lock_guard<std::mutex> lk(res->m);
      res->text = std::move(text);
      res->done = true;
      res->cv.notify_all();
    }).detach();
    std::unique_lock<std::mutex> lk(res->m);
    if (!res->cv.wait_for(lk, roll_call_ + std::chrono::milliseconds(500), [&] { return res->done; }))
      return "; the store (rank 0's, where the world met) did not answer the roll call within " + std::string(budget) +
             " (rank 0's host lost, or this rank cut off)";
    if (store_host_wait_.count() > 0) keep_store_up();
    return res->text;
  }

  /// On the store's host, after its roll call: until every rank has answered (at most
  /// store_host_wait_), then one roll call more for the last to read the answers.
  void keep_store_up() const {
    const auto deadline = std::chrono::steady_clock::now() + store_host_wait_;
    try {
      while (!detail::roll_call_silent(*store_, world_size()).empty() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } catch (const std::exception&) {  // the store is this process's own: nothing more to keep up
      return;
    }
    std::this_thread::sleep_for(roll_call_);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  at::Device device_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds roll_call_;
  std::chrono::milliseconds store_host_wait_{0};
};

static_assert(Comm<c10d_comm>);

/// A process's place in a world: the store it rendezvoused through and its process group.
struct c10d_world {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int rank = 0;
  int world_size = 1;
#ifdef USE_C10D_GLOO
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options;  ///< those pg was made with
#endif
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< the store's and the group's
  /// A Comm over pg whose failures call a roll call in the store (c10d_comm), a tenth of the
  /// timeout long (1 to 10 s).
  c10d_comm comm() const { return c10d_comm(pg, at::kCPU, store, roll_call(), store_host_wait()); }
  std::chrono::milliseconds roll_call() const {
    return std::clamp<std::chrono::milliseconds>(timeout / 10, std::chrono::seconds(1), std::chrono::seconds(10));
  }
  /// Rank 0 serves the store (init_world_from_env): it keeps it up for the others' roll calls.
  std::chrono::milliseconds store_host_wait() const { return rank == 0 ? timeout : std::chrono::milliseconds(0); }

#ifdef USE_C10D_GLOO
  /// A second Gloo process group over the same ranks, through the same store under a prefix of
  /// its own ("shardsafe/group/N", N counting the groups this world made): its collectives never
  /// interleave with pg's. For checkpoint traffic of asynchronous saves (torch/async_checkpointer.hpp),
  /// as torch's async checkpointing uses a group of its own. A collective: every rank calls it,
  /// in the same order.
  c10d_comm new_group() {
    if (!store || !gloo_options)
      fail(errc::invalid_argument, "c10d_world::new_group: this world was not made by init_world_from_env");
    const std::string prefix = "shardsafe/group/" + std::to_string(++groups_made_);
    try {
      auto ps = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
      auto group = compat::make_gloo_process_group(ps, rank, world_size, gloo_options);
      group->barrier()->wait();  // every rank's side of every connection set up (init_world_from_env)
      return c10d_comm(std::move(group), at::kCPU, store, roll_call(), store_host_wait());
    } catch (const c10::Error& e) {
      throw error(errc::comm_error, "c10d_world::new_group: rank " + std::to_string(rank) + " could not make " + prefix +
                                        ": " + e.what_without_backtrace());
    }
  }

 private:
  int groups_made_ = 0;
#endif
};

namespace detail {
inline std::string required_env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v)
    fail(errc::invalid_argument, std::string("world from environment: ") + name +
                                     " is not set (set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun does)");
  return v;
}
inline long env_number(const char* name, long lo, long hi) {
  const std::string v = required_env(name);
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(v.c_str(), &end, 10);
  if (errno || end == v.c_str() || *end || n < lo || n > hi)
    fail(errc::invalid_argument, std::string("world from environment: ") + name + "='" + v + "' is not a number in [" +
                                     std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return n;
}
}  // namespace detail

#ifdef USE_C10D_GLOO
/// Joins the world described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: rank 0 serves
/// a TCPStore at MASTER_ADDR:MASTER_PORT, every rank connects, and a Gloo process group is
/// built on it. Gloo's interface: GLOO_SOCKET_IFNAME if set, loopback when MASTER_ADDR is a
/// loopback address, else the interface of this host's name.
/// `timeout` bounds the store's operations and every collective of the group: a rank whose
/// peer died or whose link was cut ends with errc::comm_error at most `timeout` plus the roll
/// call (c10d_world::roll_call(), a tenth of it) after the failure, naming the ranks it lost;
/// rank 0, which serves the store, keeps it up for the others' roll calls: at most twice that.
inline c10d_world init_world_from_env(std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  c10d_world w;
  const int world = static_cast<int>(detail::env_number("WORLD_SIZE", 1, 1 << 20));
  const int rank = static_cast<int>(detail::env_number("RANK", 0, world - 1));
  const std::string addr = detail::required_env("MASTER_ADDR");
  const auto port = static_cast<std::uint16_t>(detail::env_number("MASTER_PORT", 1, 65535));
  try {
    c10d::TCPStoreOptions so;
    so.port = port;
    so.isServer = rank == 0;
    so.numWorkers = static_cast<std::size_t>(world);
    so.waitWorkers = true;
    so.timeout = timeout;
    compat::tcp_store_options(so);
    w.store = c10::make_intrusive<c10d::TCPStore>(addr, so);
    auto go = c10d::ProcessGroupGloo::Options::create(timeout);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
      go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1")
      go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    else
      go->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    w.pg = compat::make_gloo_process_group(w.store, rank, world, go);
    // A rank's ProcessGroupGloo is ready once its own side of each connection is; a peer may
    // still be reading its handshake. Without this barrier a rank that needs no collective
    // afterwards could exit first and break the peer's join ("Connection closed by peer"),
    // as torch's init_process_group waits on a barrier for the same reason.
    w.pg->barrier()->wait();
    w.gloo_options = go;
  } catch (const c10::Error& e) {
    throw error(errc::comm_error, "world from environment: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                                      " could not join " + addr + ":" + std::to_string(port) + ": " +
                                      e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw error(errc::comm_error, "world from environment: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                                      " could not join " + addr + ":" + std::to_string(port) + ": " + e.what());
  }
  w.rank = rank;
  w.world_size = world;
  w.timeout = timeout;
  return w;
}
#endif

}  // namespace shardsafe
