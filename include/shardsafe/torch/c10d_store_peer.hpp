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

/// A value as keys of a store (the store collectives' and these messages' one encoding): NAME
/// holds its length (8 bytes, little-endian) and its first bytes, NAME.1, NAME.2, ... the rest,
/// store_piece_bytes each. The pieces are set first, so a reader that finds NAME finds them.
/// Adds the keys it set to `keys`.
inline void store_put(c10d::Store& st, const std::string& name, std::string_view s, std::vector<std::string>& keys) {
  const std::size_t first = std::min(s.size(), store_piece_bytes - 8);
  keys.push_back(name);
  for (std::size_t at = first, piece = 1; at < s.size(); at += store_piece_bytes, ++piece) {
    const std::string_view p = s.substr(at, store_piece_bytes);
    keys.push_back(name + "." + std::to_string(piece));
    st.set(keys.back(), std::vector<std::uint8_t>(p.begin(), p.end()));
  }
  std::vector<std::uint8_t> head(8 + first);
  store_le(reinterpret_cast<std::byte*>(head.data()), 8, s.size());
  std::memcpy(head.data() + 8, s.data(), first);
  st.set(name, head);
}

/// The value store_put set under `name` (there: the caller waited for it), checked: a length of
/// at most 1 TiB, a first piece and pieces that add up to it, else comm_error naming `what`.
/// Adds its keys to `keys`; with `erase`, removes each key once read.
inline std::string store_take(c10d::Store& st, const std::string& name, const std::string& what, bool erase,
                              std::vector<std::string>& keys) {
  const std::vector<std::uint8_t> head = st.get(name);
  const std::uint64_t len = head.size() >= 8 ? load_le(reinterpret_cast<const std::byte*>(head.data()), 8) : 0;
  if (head.size() < 8 || len > (std::uint64_t(1) << 40) ||
      head.size() - 8 != std::min<std::uint64_t>(len, store_piece_bytes - 8))
    fail(errc::comm_error, what + " '" + name + "' in the store is malformed (" + std::to_string(head.size()) +
                               " bytes" + (head.size() >= 8 ? ", length " + std::to_string(len) : "") + ")");
  keys.push_back(name);
  if (erase) st.deleteKey(name);
  std::string out(reinterpret_cast<const char*>(head.data()) + 8, head.size() - 8);
  for (std::size_t piece = 1; out.size() < len; ++piece) {
    keys.push_back(name + "." + std::to_string(piece));
    const std::vector<std::uint8_t> p = st.get(keys.back());
    if (p.empty() || p.size() > len - out.size())
      fail(errc::comm_error, what + " '" + name + "': piece " + std::to_string(piece) + " holds " +
                                 std::to_string(p.size()) + " bytes, " + std::to_string(len - out.size()) +
                                 " were left");
    out.append(reinterpret_cast<const char*>(p.data()), p.size());
    if (erase) st.deleteKey(keys.back());
  }
  return out;
}

/// A c10d_comm's point to point through a store (held by a shared_ptr its copies share).
class c10d_store_peers {
 public:
  /// Messages as keys of `keys`; the abort key in `world` (the store the world met through);
  /// this rank `rank` of `size`, `host` where its process serves the store; a receive waits at
  /// most `timeout`.
  c10d_store_peers(c10::intrusive_ptr<c10d::Store> keys, c10::intrusive_ptr<c10d::Store> world, int rank, int size,
                   bool host, std::chrono::milliseconds timeout, std::chrono::milliseconds poll)
      : keys_(std::move(keys)),
        world_(std::move(world)),
        rank_(rank),
        size_(size),
        host_(host),
        timeout_(timeout),
        poll_(std::max(poll, std::chrono::milliseconds(1))),
        sent_(static_cast<std::size_t>(size), 0),
        received_(static_cast<std::size_t>(size), 0) {}

  c10d_store_peers(const c10d_store_peers&) = delete;
  c10d_store_peers& operator=(const c10d_store_peers&) = delete;
  /// Counts this rank out; the host waits for every rank's count (the top of this header).
  ~c10d_store_peers() {
    try {
      const std::int64_t left = keys_->add("left", 1);
      {
        std::lock_guard<std::mutex> lk(m_);
        if (!host_ || aborted_) return;
      }
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      for (std::int64_t n = left; n < size_ && std::chrono::steady_clock::now() < deadline; n = keys_->add("left", 0))
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } catch (const std::exception&) {  // the store is gone: nothing to keep up
    }
  }

  /// Sets s as this rank's next message to `peer`.
  void send(std::string_view s, int peer) {
    std::uint64_t k = 0;
    {
      std::lock_guard<std::mutex> lk(m_);
      throw_if_aborted();
      k = sent_[static_cast<std::size_t>(peer)]++;
    }
    std::vector<std::string> keys;
    store_put(*keys_, key(rank_, peer, k), s, keys);
  }

  /// The next message from `peer`.
  std::string recv(int peer) {
    std::uint64_t k = 0;
    {
      std::lock_guard<std::mutex> lk(m_);
      throw_if_aborted();
      k = received_[static_cast<std::size_t>(peer)]++;
    }
    const std::string name = key(peer, rank_, k);
    c10d::Store& st = *keys_;
    const auto t0 = std::chrono::steady_clock::now();
    auto next_abort_look = t0 + poll_;
    auto pause = std::chrono::microseconds(200);
    while (!st.check({name})) {
      const auto now = std::chrono::steady_clock::now();
      if (now - t0 > timeout_)
        fail(errc::comm_error, "no message from rank " + std::to_string(peer) + " within " +
                                   std::to_string(timeout_.count()) + " ms (the store's timeout)");
      if (now >= next_abort_look) {
        next_abort_look = now + poll_;
        if (world_->check({c10d_abort_key()})) {
          const std::vector<std::uint8_t> v = world_->get(c10d_abort_key());
          break_world("the world was aborted: " + std::string(v.begin(), v.end()));
          std::lock_guard<std::mutex> lk(m_);
          throw_if_aborted();
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, poll_);
    }
    std::vector<std::string> keys;
    return store_take(st, name, "rank " + std::to_string(peer) + "'s message", true, keys);
  }

  /// The world is broken (an operation failed for `why`): every later operation throws it.
  void break_world(const std::string& why) {
    std::lock_guard<std::mutex> lk(m_);
    if (!aborted_) {
      aborted_ = true;
      why_ = why;
    }
  }

 private:
  const c10::intrusive_ptr<c10d::Store> keys_, world_;
  const int rank_, size_;
  const bool host_;
  const std::chrono::milliseconds timeout_, poll_;
  std::mutex m_;
  std::vector<std::uint64_t> sent_, received_;  // messages so far, by peer
  bool aborted_ = false;
  std::string why_;

  static std::string key(int from, int to, std::uint64_t k) {
    return std::to_string(from) + "/" + std::to_string(to) + "/" + std::to_string(k);
  }
  /// With m_ held.
  void throw_if_aborted() const {
    if (aborted_) fail(errc::comm_error, why_);
  }
};

}  // namespace shardsafe::detail
