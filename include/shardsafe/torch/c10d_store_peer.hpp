// shardsafe/torch/c10d_store_peer.hpp - point to point through a c10d store, for the c10d_comms
// that have no Gloo point to point (torch/c10d_peer.hpp): a world over the store transport, and a
// group on a device (NCCL) given the world's store. It makes them PeerComms (dist/concepts.hpp),
// so that a save agrees up a tree of ranks (O(log world) messages of O(tensors) bytes a rank,
// checkpoint/save_agree.hpp) where the collectives would hand every rank every rank's entries.
//
// Message k from rank a to rank b is the key "a/b/k" of the store it is given (a PrefixStore of
// the comm's own: its length, 8 bytes, then its first bytes) and "a/b/k.1", "a/b/k.2", ... (the
// rest, detail::store_piece_bytes each: libuv's store refuses values over 8 MiB); the sender
// sets the pieces, then the first key; the receiver waits for the first key, reads them all and
// removes them, so the store holds the messages not yet received only. A send returns once the
// store has it (buffered, as the concept asks).
//
// Leaving: the keys live in the store's host (rank 0's process), so a message that rank sends
// last (the tree's agreement, down) would go with it if it left at once. Each rank's comm, when
// it goes, counts itself in "left"; the host's waits until every rank has (at most the timeout;
// not after an abort, whose roll call keeps the store up already).
//
// Waiting: the receiver looks for its key with check (never a blocking wait: a TCPStore client
// whose wait timed out may read the server's late answer as the next reply), at first every
// 0.2 ms and backing off to `poll`; every `poll` it also looks for the world's abort key
// (torch/c10d_peer.hpp), so a failure anywhere ends the wait within a poll; past the store's
// timeout it fails naming the peer. Every byte passes through the store's host (rank 0's), so
// this carries the checkpoint's plans and agreements, not bulk data: c10d_comm says which
// (bulk_peer_to_peer).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/torch/c10d_peer.hpp"

namespace shardsafe::detail {

/// The most bytes one key of a store value holds: a value is split into pieces of this size
/// (libuv's TCPStore server, the default of torch 2.4 and newer, refuses values over 8 MiB). The
/// store transport's collectives (c10d_comm.hpp) and these messages both cut by it.
inline constexpr std::size_t store_piece_bytes = std::size_t(4) << 20;

/// A c10d_comm's point to point through a store, shared by its copies.
class c10d_store_peers {
 public:
  /// Messages as keys of `keys`; the abort key in `world` (the store the world met through);
  /// this rank `rank` of `size`, `host` where its process serves the store; a receive waits at
  /// most `timeout`.
  c10d_store_peers(c10::intrusive_ptr<c10d::Store> keys, c10::intrusive_ptr<c10d::Store> world, int rank, int size,
                   bool host, std::chrono::milliseconds timeout, std::chrono::milliseconds poll)
      : s_(std::make_shared<shared>()) {
    s_->keys = std::move(keys);
    s_->world = std::move(world);
    s_->rank = rank;
    s_->size = size;
    s_->host = host;
    s_->timeout = timeout;
    s_->poll = std::max(poll, std::chrono::milliseconds(1));
    s_->sent.assign(static_cast<std::size_t>(size), 0);
    s_->received.assign(static_cast<std::size_t>(size), 0);
  }

  c10d_store_peers(const c10d_store_peers&) = delete;
  c10d_store_peers& operator=(const c10d_store_peers&) = delete;
  /// Counts this rank out; the host waits for every rank's count (the top of this header).
  ~c10d_store_peers() {
    try {
      const std::int64_t left = s_->keys->add("left", 1);
      {
        std::lock_guard<std::mutex> lk(s_->m);
        if (!s_->host || s_->aborted) return;
      }
      const auto deadline = std::chrono::steady_clock::now() + s_->timeout;
      for (std::int64_t n = left; n < s_->size && std::chrono::steady_clock::now() < deadline;
           n = s_->keys->add("left", 0))
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } catch (const std::exception&) {  // the store is gone: nothing to keep up
    }
  }

  /// Sets s as this rank's next message to `peer`.
  void send(std::string_view s, int peer) {
    std::uint64_t k = 0;
    {
      std::lock_guard<std::mutex> lk(s_->m);
      throw_if_aborted();
      k = s_->sent[static_cast<std::size_t>(peer)]++;
    }
    const std::string name = key(s_->rank, peer, k);
    c10d::Store& st = *s_->keys;
    const std::size_t first = std::min(s.size(), store_piece_bytes - 8);
    std::size_t piece = 1;
    for (std::size_t at = first; at < s.size(); at += store_piece_bytes, ++piece) {
      const std::string_view p = s.substr(at, store_piece_bytes);
      st.set(name + "." + std::to_string(piece), std::vector<std::uint8_t>(p.begin(), p.end()));
    }
    std::vector<std::uint8_t> head(8 + first);
    store_le(reinterpret_cast<std::byte*>(head.data()), 8, s.size());
    std::memcpy(head.data() + 8, s.data(), first);
    st.set(name, head);
  }

  /// The next message from `peer`.
  std::string recv(int peer) {
    std::uint64_t k = 0;
    {
      std::lock_guard<std::mutex> lk(s_->m);
      throw_if_aborted();
      k = s_->received[static_cast<std::size_t>(peer)]++;
    }
    const std::string name = key(peer, s_->rank, k);
    c10d::Store& st = *s_->keys;
    const auto t0 = std::chrono::steady_clock::now();
    auto next_abort_look = t0 + s_->poll;
    auto pause = std::chrono::microseconds(200);
    while (!st.check({name})) {
      const auto now = std::chrono::steady_clock::now();
      if (now - t0 > s_->timeout)
        fail(errc::comm_error, "no message from rank " + std::to_string(peer) + " within " +
                                   std::to_string(s_->timeout.count()) + " ms (the store's timeout)");
      if (now >= next_abort_look) {
        next_abort_look = now + s_->poll;
        if (s_->world->check({c10d_abort_key()})) {
          const std::vector<std::uint8_t> v = s_->world->get(c10d_abort_key());
          break_world("the world was aborted: " + std::string(v.begin(), v.end()));
          std::lock_guard<std::mutex> lk(s_->m);
          throw_if_aborted();
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, s_->poll);
    }
    const std::vector<std::uint8_t> head = st.get(name);
    const std::uint64_t len = head.size() >= 8 ? load_le(reinterpret_cast<const std::byte*>(head.data()), 8) : 0;
    if (head.size() < 8 || len > (std::uint64_t(1) << 40) ||
        head.size() - 8 != std::min<std::uint64_t>(len, store_piece_bytes - 8))
      fail(errc::comm_error, "rank " + std::to_string(peer) + "'s message '" + name + "' in the store is malformed (" +
                                 std::to_string(head.size()) + " bytes)");
    std::string out(reinterpret_cast<const char*>(head.data()) + 8, head.size() - 8);
    st.deleteKey(name);
    for (std::size_t piece = 1; out.size() < len; ++piece) {
      const std::string pk = name + "." + std::to_string(piece);
      const std::vector<std::uint8_t> p = st.get(pk);
      if (p.empty() || p.size() > len - out.size())
        fail(errc::comm_error, "rank " + std::to_string(peer) + "'s message '" + name + "': piece " +
                                   std::to_string(piece) + " holds " + std::to_string(p.size()) + " bytes");
      out.append(reinterpret_cast<const char*>(p.data()), p.size());
      st.deleteKey(pk);
    }
    return out;
  }

  /// The world is broken (an operation failed for `why`): every later operation throws it.
  void break_world(const std::string& why) {
    std::lock_guard<std::mutex> lk(s_->m);
    if (!s_->aborted) {
      s_->aborted = true;
      s_->why = why;
    }
  }

 private:
  struct shared {
    c10::intrusive_ptr<c10d::Store> keys, world;
    int rank = 0, size = 1;
    bool host = false;
    std::chrono::milliseconds timeout{0}, poll{100};
    std::mutex m;
    std::vector<std::uint64_t> sent, received;  // messages so far, by peer
    bool aborted = false;
    std::string why;
  };
  static std::string key(int from, int to, std::uint64_t k) {
    return std::to_string(from) + "/" + std::to_string(to) + "/" + std::to_string(k);
  }
  /// With s_->m held.
  void throw_if_aborted() const {
    if (s_->aborted) fail(errc::comm_error, s_->why);
  }

  std::shared_ptr<shared> s_;
};

}  // namespace shardsafe::detail
