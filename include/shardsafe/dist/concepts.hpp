// shardsafe/dist/concepts.hpp - who talks to whom during a save or load.
//
// Comm C, for `C c`, `std::string_view s`, `std::string str`, `int root`:
//
// | expression                  | type                      | requirement                                  |
// |-----------------------------|---------------------------|----------------------------------------------|
// | c.rank()                    | int                       | this process's rank, 0 <= rank < world_size  |
// | c.world_size()              | int                       | number of ranks, >= 1                        |
// | c.barrier()                 | void                      | returns once every rank has called it        |
// | c.all_gather_bytes(s)       | std::vector<std::string>  | every rank's s, indexed by rank, on every    |
// |                             |                           | rank (lengths may differ)                    |
// | c.broadcast_bytes(str, root)| void                      | str becomes root's str on every rank         |
//
// All are collectives: every rank calls them in the same order. Failures throw
// shardsafe::error with errc::comm_error. The table is what the algorithms use; a backend may
// offer more (c10d_comm also broadcasts buffers and tensors). The algorithms that take a Comm
// agree on errors across ranks through dist/agree.hpp (a failure on one rank is exchanged and
// thrown, with its code, on all), so one rank's bad input never leaves the others waiting in a
// collective.
#pragma once

#include <concepts>
#include <string>
#include <string_view>
#include <vector>

namespace shardsafe {

template <class C>
concept Comm = requires(C& c, std::string_view s, std::string& str, int root) {
  { c.rank() } -> std::convertible_to<int>;
  { c.world_size() } -> std::convertible_to<int>;
  c.barrier();
  { c.all_gather_bytes(s) } -> std::same_as<std::vector<std::string>>;
  c.broadcast_bytes(str, root);
};

/// A Comm whose ranks can also send bytes to one rank and receive them from one, which a tree
/// of ranks needs (dist/tree.hpp: O(log world) messages a rank where an all-gather takes world):
///
/// | expression             | type        | requirement                                         |
/// |------------------------|-------------|-----------------------------------------------------|
/// | c.peer_to_peer()       | bool        | whether the two below work (a backend may offer     |
/// |                        |             | them over one transport only); alike on every rank  |
/// | c.send_bytes(s, peer)  | void        | s to rank `peer`, which receives it with recv_bytes;|
/// |                        |             | returns without waiting for that receive (buffered) |
/// | c.recv_bytes(peer)     | std::string | the next bytes `peer` sent this rank, in the order  |
/// |                        |             | sent; errc::comm_error naming `peer` past the       |
/// |                        |             | timeout                                             |
///
/// Not collectives: only the two ranks take part. The algorithms ask peer_to_peer() and use
/// the Comm's collectives where it says no. A PeerComm whose point to point suits small
/// messages only (c10d_comm through a store beside a device group's collectives) also has
/// `bool c.bulk_peer_to_peer()`, which the exchange of bulk data (replicas' pieces) asks.
template <class C>
concept PeerComm = Comm<C> && requires(C& c, std::string_view s, int peer) {
  { c.peer_to_peer() } -> std::convertible_to<bool>;
  c.send_bytes(s, peer);
  { c.recv_bytes(peer) } -> std::same_as<std::string>;
};

}  // namespace shardsafe
