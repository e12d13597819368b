// shardsafe/torch/c10d_comm.hpp - c10d_comm: the Comm over LibTorch's c10d, a process group
// (Gloo on CPU; NCCL on GPUs, with the byte collectives on a CUDA device) or the TCPStore the
// ranks met through (c10d_transport::store), with the roll call that names lost ranks. The
// world built from torchrun's variables over it: torch/c10d.hpp. Nothing here depends on
// USE_C10D_GLOO.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
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

#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/torch/c10d_peer.hpp"
#include "shardsafe/torch/c10d_store_peer.hpp"
#include "shardsafe/torch/compat.hpp"

namespace shardsafe {

namespace detail {

/// The TCPStore at addr:port, `timeout` for its operations, served by this process where
/// `serve`. With `world` > 0 it is a world's rendezvous: every rank counts itself in and the
/// server waits until all `world` have; with 0, one more connection to a store already met at.
inline c10::intrusive_ptr<c10d::TCPStore> open_tcp_store(const std::string& addr, std::uint16_t port,
                                                         std::chrono::milliseconds timeout, bool serve, int world) {
  c10d::TCPStoreOptions so;
  so.port = port;
  so.isServer = serve;
  if (world > 0) so.numWorkers = static_cast<std::size_t>(world);
  so.waitWorkers = world > 0;
  so.timeout = timeout;
  compat::tcp_store_options(so);
  return c10::make_intrusive<c10d::TCPStore>(addr, so);
}

/// A group whose collectives travel through a c10d store (c10d_transport::store): the store
/// (the world's, or a PrefixStore of it for a group of its own) and the number of collectives
/// the group has begun. Every c10d_comm of the group shares it, as the comms of a process group
/// share the group: collective k of every rank uses the keys "shardsafe/c/k/...".
struct store_channel {
  c10::intrusive_ptr<c10d::Store> store;
  /// the rank whose process serves the store: it leaves a collective only once every rank has
  /// read its keys, so that it never takes the store away (by exiting) from a rank still reading
  int host = 0;
  std::atomic<std::uint64_t> begun{0};
  /// the group's point to point through the store (torch/c10d_store_peer.hpp): one sequence of
  /// messages for every comm of the group, made by the first
  std::once_flag peers_made;
  std::shared_ptr<c10d_store_peers> peers;
};
}  // namespace detail

/// How a world's ranks move the bytes of their collectives (init_world_from_env).
enum class c10d_transport {
  /// SHARDSAFE_C10D_TRANSPORT ("gloo" or "store") where set; else Gloo where this build has it
  /// (USE_C10D_GLOO), else the store
  automatic,
  gloo,  ///< a ProcessGroupGloo (needs USE_C10D_GLOO)
  /// the TCPStore the ranks met through: each collective is a few keys set and read there and
  /// removed by the last rank to read them. Needs nothing beyond c10d's store, so it works with
  /// a LibTorch that ships no Gloo headers; every byte passes through rank 0's store, so it
  /// suits the checkpoint's own traffic (plans, metadata), not large broadcasts on many ranks.
  store,
};

/// A Comm over a c10d process group, or over a store (c10d_transport::store). Over a group, byte
/// collectives travel as uint8 tensors on `device` (CPU for Gloo; the rank's CUDA device for
/// NCCL); over a store, as keys of the store (every rank's bytes pass through the store's host)
/// and process_group() is null.
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
///
/// Over a Gloo group given that store, it is also a PeerComm (send_bytes, recv_bytes: Gloo's
/// point to point, torch/c10d_peer.hpp), so saves and loads agree up and down trees of ranks
/// (dist/agree.hpp, checkpoint/save_agree.hpp) and replicas exchange their pieces pair by pair.
/// Over the store transport, and a device group (NCCL) given the store, it goes through the
/// store (torch/c10d_store_peer.hpp; a device group's comm and its copies under `peer_keys`: two
/// device comms over one store need their own), the trees' messages only on a device group
/// (bulk_peer_to_peer(): replicas' pieces go as its broadcasts).
/// A failed operation first sets the world's abort key in the store, and every rank waiting for
/// a message throws within moments (`roll_call` / 10, 20 to 250 ms), then answers the roll call,
/// as for a failed collective: ranks waiting on a lost rank only through others do not wait for
/// the group's timeout.
class c10d_comm {
 public:
  explicit c10d_comm(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device = at::kCPU,
                     c10::intrusive_ptr<c10d::Store> store = {},
                     std::chrono::milliseconds roll_call = std::chrono::seconds(5),
                     std::chrono::milliseconds store_host_wait = std::chrono::milliseconds(0),
                     const std::string& peer_keys = "shardsafe/p2p")
      : pg_(std::move(pg)),
        device_(device),
        store_(std::move(store)),
        roll_call_(roll_call),
        store_host_wait_(store_host_wait) {
    // point to point over Gloo (a CPU group) where the store can carry the abort; through the
    // store for a device group
    if (pg_ && store_ && device_.is_cpu())
      peers_ = std::make_shared<detail::c10d_peers>(pg_, store_, detail::abort_poll(roll_call_));
    else if (pg_ && store_)
      store_peers_ = std::make_shared<detail::c10d_store_peers>(
          c10::make_intrusive<c10d::PrefixStore>(peer_keys, store_), store_, pg_->getRank(), pg_->getSize(),
          pg_->getRank() == 0, store_->getTimeout(), detail::abort_poll(roll_call_));
  }
  /// Over a store: rank `rank` of `size`, its collectives as keys of channel->store, the roll call
  /// (as above) in `store`, the world's.
  c10d_comm(std::shared_ptr<detail::store_channel> channel, int rank, int size, c10::intrusive_ptr<c10d::Store> store,
            std::chrono::milliseconds roll_call = std::chrono::seconds(5),
            std::chrono::milliseconds store_host_wait = std::chrono::milliseconds(0))
      : device_(at::kCPU),
        channel_(std::move(channel)),
        rank_(rank),
        size_(size),
        store_(std::move(store)),
        roll_call_(roll_call),
        store_host_wait_(store_host_wait) {
    std::call_once(channel_->peers_made, [&] {
      const auto& world = store_ ? store_ : channel_->store;
      channel_->peers = std::make_shared<detail::c10d_store_peers>(
          c10::make_intrusive<c10d::PrefixStore>("shardsafe/p2p", channel_->store), world, rank, size,
          rank == channel_->host, world->getTimeout(), detail::abort_poll(roll_call_));
    });
    store_peers_ = channel_->peers;
  }

  int rank() const { return pg_ ? pg_->getRank() : rank_; }
  int world_size() const { return pg_ ? pg_->getSize() : size_; }
  /// The process group; null over a store.
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const noexcept { return pg_; }

  /// Whether send_bytes and recv_bytes work (a PeerComm): over a Gloo group given the world's
  /// store, over the store transport, over a device group given the store; unless turned off.
  /// The tree algorithms then use them (dist/tree.hpp).
  bool peer_to_peer() const noexcept { return (peers_ || store_peers_) && peer_on_; }
  /// Whether they suit bulk data too (replicas' pieces): not through the store beside a device
  /// group's own collectives.
  bool bulk_peer_to_peer() const noexcept { return peer_to_peer() && (peers_ || !pg_); }
  /// Turns point to point off (the algorithms use the collectives) or back on; alike on every rank.
  void set_peer_to_peer(bool on) noexcept { peer_on_ = on; }
  /// s to rank `peer`, posted: returns without waiting for its receive (dist/concepts.hpp).
  void send_bytes(std::string_view s, int peer) {
    guard(("send_bytes to rank " + std::to_string(checked_peer(peer))).c_str(),
          [&] { peers_ ? peers_->send(s, peer) : store_peers_->send(s, peer); });
  }
  /// The next bytes `peer` sent this rank; errc::comm_error past the group's timeout, or at once
  /// when any rank's operation failed (the abort, torch/c10d_peer.hpp).
  std::string recv_bytes(int peer) {
    std::string out;
    guard(("recv_bytes from rank " + std::to_string(checked_peer(peer))).c_str(),
          [&] { out = peers_ ? peers_->recv(peer) : store_peers_->recv(peer); });
    return out;
  }

  void barrier() {
    guard("barrier", [&] {
      if (pg_)
        pg_->barrier()->wait();
      else
        store_all_gather({});
    });
  }

  std::vector<std::string> all_gather_bytes(std::string_view s) {
    std::vector<std::string> out;
    guard("all_gather_bytes", [&] {
      if (!pg_) {
        out = store_all_gather(s);
        return;
      }
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
      if (!pg_) {
        s = store_broadcast(s, root);
        return;
      }
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
    if (!pg_) return store_broadcast_into("broadcast_buffer", b, root);
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
    if (!t.is_contiguous()) fail(errc::invalid_argument, "c10d broadcast_tensor: the tensor is not contiguous");
    if (!pg_) {  // through host bytes
      at::Tensor host = t.is_cpu() ? t : t.cpu();
      store_broadcast_into("broadcast_tensor", {static_cast<std::byte*>(host.data_ptr()), host.nbytes()}, root);
      if (!t.is_cpu()) t.copy_(host);
      return;
    }
    guard("broadcast_tensor", [&] {
      std::vector<at::Tensor> v{t};
      bcast(v, root);
    });
  }

 private:
  int checked_peer(int peer) const {
    if (!peer_to_peer())
      fail(errc::invalid_argument, "c10d_comm: point to point needs the world's store (and is not turned off)");
    if (peer < 0 || peer >= world_size() || peer == rank())
      fail(errc::invalid_argument, "c10d_comm: rank " + std::to_string(rank()) +
                                       " cannot send to or receive from rank " + std::to_string(peer) +
                                       " (a world of " + std::to_string(world_size()) + ")");
    return peer;
  }
  at::TensorOptions opts(at::ScalarType st) const { return at::TensorOptions().dtype(st).device(device_); }

  // --- over a store: collective k's keys are "shardsafe/c/k/..."; a rank's bytes are the key
  // NAME (their length, 8 bytes, then the first piece) and NAME.1, NAME.2, ... (the other
  // pieces, detail::store_piece_bytes each). Each rank, once it has read what it needs, adds 1 to
  // ".../read", and the rank that makes it world_size() removes the keys (so the store holds the
  // keys of the collectives under way only). The store's host waits for that (".../done")
  // before it leaves.
  std::string begin_collective() { return "shardsafe/c/" + std::to_string(channel_->begun++) + "/"; }
  /// Sets s under `name` (detail::store_put); adds the keys it took to `keys`.
  void put(const std::string& name, std::string_view s, std::vector<std::string>& keys) {
    detail::store_put(*channel_->store, name, s, keys);
  }
  /// The bytes under `name`; adds the keys they took to `keys`.
  std::string take(const std::string& name, std::vector<std::string>& keys) {
    return detail::store_take(*channel_->store, name, "c10d store collective: key", false, keys);
  }
  void end_collective(const std::string& base, const std::vector<std::string>& keys) {
    c10d::Store& st = *channel_->store;
    const bool host = rank() == channel_->host;
    if (st.add(base + "read", 1) < world_size()) {
      if (host) {
        st.wait({base + "done"});
        st.deleteKey(base + "done");
      }
      return;
    }
    for (const auto& k : keys) st.deleteKey(k);
    st.deleteKey(base + "read");
    if (!host) st.set(base + "done", std::vector<std::uint8_t>{});
  }
  std::vector<std::string> store_all_gather(std::string_view s) {
    const std::string base = begin_collective();
    const int n = world_size();
    std::vector<std::string> out(static_cast<std::size_t>(n)), keys;
    put(base + std::to_string(rank()), s, keys);
    for (int r = 0; r < n; ++r) out[r] = r == rank() ? std::string(s) : take(base + std::to_string(r), keys);
    end_collective(base, keys);
    return out;
  }
  /// root's bytes (s on root) on every rank.
  std::string store_broadcast(std::string_view s, int root) {
    const std::string base = begin_collective(), name = base + "v";
    std::vector<std::string> keys;
    std::string v;
    if (rank() == root) {
      put(name, s, keys);
      v = std::string(s);
    } else {
      v = take(name, keys);
    }
    end_collective(base, keys);
    return v;
  }
  /// A broadcast into b (root's b on every rank); a rank whose b has another size than root's
  /// fails alone, without a roll call (the others succeeded).
  void store_broadcast_into(const char* what, std::span<std::byte> b, int root) {
    std::string v;
    guard(what, [&] {
      v = store_broadcast(
          rank() == root ? std::string_view(reinterpret_cast<const char*>(b.data()), b.size()) : std::string_view{},
          root);
    });
    if (v.size() != b.size())
      fail(errc::comm_error, std::string("c10d ") + what + " on rank " + std::to_string(rank()) + ": " +
                                 std::to_string(b.size()) + " bytes expected, rank " + std::to_string(root) + " sent " +
                                 std::to_string(v.size()));
    if (rank() != root) std::memcpy(b.data(), v.data(), v.size());
  }
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
    if (peers_) peers_->break_world(std::string("c10d ") + what + ": " + detail::first_line(why));
    if (store_peers_) store_peers_->break_world(std::string("c10d ") + what + ": " + detail::first_line(why));
    throw error(errc::comm_error, std::string("c10d ") + what + " on rank " + std::to_string(rank()) + " of " +
                                      std::to_string(world_size()) + " failed: " + detail::first_line(why) +
                                      roll_call(std::string("c10d ") + what + ": " + detail::first_line(why)));
  }

  /// The roll call (torch/c10d_peer.hpp) after the first failure; a later one (the world is
  /// broken: the abort fails every operation that follows) says what the first found.
  std::string roll_call(const std::string& why) const {
    if (rolled_->empty()) *rolled_ = detail::roll_call(store_, rank(), world_size(), roll_call_, store_host_wait_, why);
    return *rolled_;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  at::Device device_;
  std::shared_ptr<detail::store_channel> channel_;  ///< over a store only
  int rank_ = 0, size_ = 1;                         ///< over a store only
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds roll_call_;
  std::chrono::milliseconds store_host_wait_{0};
  std::shared_ptr<detail::c10d_peers> peers_;              ///< point to point (a Gloo group and a store)
  std::shared_ptr<detail::c10d_store_peers> store_peers_;  ///< point to point through the store
  bool peer_on_ = true;
  std::shared_ptr<std::string> rolled_ = std::make_shared<std::string>();  ///< the first roll call's words
};

static_assert(PeerComm<c10d_comm>);

}  // namespace shardsafe
