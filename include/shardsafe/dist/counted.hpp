// shardsafe/dist/counted.hpp - a Comm that counts what its rank exchanges: messages, bytes in and
// out, collectives, the longest message received. What the tests and bench_save_scale measure a
// save's coordination with (issue 56); a program may wrap its own Comm the same way.
//
//   thread_comm tc(world, rank);
//   counted_comm<thread_comm> c(tc);          // a PeerComm where thread_comm is one
//   counted_comm<thread_comm, false> flat(tc);  // a plain Comm: steps all-gather
//   save(dir, views, c, opt);
//   c.bytes_in, c.messages, ...
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/dist/concepts.hpp"

namespace shardsafe {

/// Comm C, counted. With peer (the default where C is a PeerComm), it offers C's sends and
/// receives; without, it is a plain Comm (collective steps then all-gather).
template <Comm C, bool peer = PeerComm<C>>
class counted_comm {
 public:
  explicit counted_comm(C& c) : c_(&c) {}

  std::uint64_t messages = 0;    ///< sent and received (an all-gather: one in from each rank)
  std::uint64_t bytes_in = 0;    ///< received
  std::uint64_t bytes_out = 0;   ///< sent (an all-gather or broadcast: this rank's part once)
  std::uint64_t largest_in = 0;  ///< the longest message received
  std::uint64_t gathers = 0, broadcasts = 0;

  int rank() const { return c_->rank(); }
  int world_size() const { return c_->world_size(); }
  void barrier() { c_->barrier(); }
  std::vector<std::string> all_gather_bytes(std::string_view s) {
    ++gathers;
    bytes_out += s.size();
    auto all = c_->all_gather_bytes(s);
    for (const auto& x : all) received(x.size());
    return all;
  }
  void broadcast_bytes(std::string& s, int root) {
    ++broadcasts;
    if (rank() == root) bytes_out += s.size();
    c_->broadcast_bytes(s, root);
    if (rank() != root) received(s.size());
  }
  bool peer_to_peer() const
    requires peer
  {
    return c_->peer_to_peer();
  }
  bool bulk_peer_to_peer() const
    requires requires(const C& c) { c.bulk_peer_to_peer(); }
  {
    return c_->bulk_peer_to_peer();
  }
  void send_bytes(std::string_view s, int to)
    requires peer
  {
    ++messages;
    bytes_out += s.size();
    c_->send_bytes(s, to);
  }
  std::string recv_bytes(int from)
    requires peer
  {
    std::string s = c_->recv_bytes(from);
    received(s.size());
    return s;
  }

 private:
  void received(std::uint64_t n) {
    ++messages;
    bytes_in += n;
    largest_in = std::max(largest_in, n);
  }
  C* c_;
};

}  // namespace shardsafe
