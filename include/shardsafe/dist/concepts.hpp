// shardsafe/dist/concepts.hpp - who talks to whom during a save or load.
//
// Comm C, for `C c`, `std::string_view s`, `std::string str`, `std::span<std::byte> buf`, `int root`:
//
// | expression                  | type                      | requirement                                  |
// |-----------------------------|---------------------------|----------------------------------------------|
// | c.rank()                    | int                       | this process's rank, 0 <= rank < world_size  |
// | c.world_size()              | int                       | number of ranks, >= 1                        |
// | c.barrier()                 | void                      | returns once every rank has called it        |
// | c.all_gather_bytes(s)       | std::vector<std::string>  | every rank's s, indexed by rank, on every    |
// |                             |                           | rank (lengths may differ)                    |
// | c.broadcast_bytes(str, root)| void                      | str becomes root's str on every rank         |
// | c.broadcast_buffer(buf,root)| void                      | buf (same size on every rank) becomes root's |
//
// All are collectives: every rank calls them in the same order. Failures throw
// shardsafe::error with errc::comm_error. The algorithms that take a Comm agree on errors
// across ranks (a failure on one rank is all-gathered and thrown on all), so one rank's bad
// input never leaves the others waiting in a collective.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace shardsafe {

template <class C>
concept Comm = requires(C& c, std::string_view s, std::string& str, std::span<std::byte> buf, int root) {
  { c.rank() } -> std::convertible_to<int>;
  { c.world_size() } -> std::convertible_to<int>;
  c.barrier();
  { c.all_gather_bytes(s) } -> std::same_as<std::vector<std::string>>;
  c.broadcast_bytes(str, root);
  c.broadcast_buffer(buf, root);
};

}  // namespace shardsafe
