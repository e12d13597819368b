// shardsafe/checkpoint/replica_groups.hpp - the groups of replica_reads.hpp (issue 56): a rank's
// views sorted into classes by the fraction of their tensor they cover, each class described by
// a digest, the ranks with an equal class found from every rank's descriptions (replica_plan),
// and the exchange of each member's piece of a class's bytes with the other members, class by
// class (point to point over a PeerComm, else world broadcasts). replica_reads.hpp's top says
// why and how the load uses them.
#pragma once

#include <algorithm>
#include <compare>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_options.hpp"
#include "shardsafe/checkpoint/view_pieces.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"

namespace shardsafe::detail {

/// The fraction of its tensor a view covers (local over full elements, reduced; 1/1 for a whole
/// view or a tensor of no elements): what sorts a rank's views into classes. A view one rank
/// loads is in the same class on every rank that loads it.
inline std::pair<std::uint64_t, std::uint64_t> coverage_of(const flat_view& v) {
  const std::uint64_t n = numel(v.full_shape), k = v.local_numel();
  if (n == 0) return {1, 1};
  const std::uint64_t g = std::gcd(n, k);
  return {k / g, n / g};
}

/// At most this many classes a rank: the views of any further fraction join the last class.
inline constexpr std::size_t max_replica_classes = 16;

/// A class's identity: 128-bit XXH3 of its views' description and their bytes.
struct class_key {
  std::uint64_t hi = 0, lo = 0, total = 0;
  auto operator<=>(const class_key&) const = default;
};

/// One class of the views a rank shares, and the ranks whose class is the same (a replica group).
struct replica_class {
  std::vector<flat_view> views;  ///< in the caller's order
  class_key key;
  std::vector<int> ranks;  ///< the group, by rank (this one included)
  std::size_t index = 0;   ///< this rank's among them
  std::uint64_t from = 0;  ///< the stream bytes before it are loaded already (automatic's probe)
  std::size_t size() const noexcept { return ranks.size(); }
};

/// The views' description: 128-bit XXH3 of each view's key, dtype, shape, spec and size, and the bytes.
inline class_key describe_views(std::span<const flat_view> views) {
  std::string d;
  std::uint64_t total = 0;
  for (const flat_view& v : views) {
    message_writer m;
    m.text(v.key).count(static_cast<std::uint64_t>(v.type)).counts(v.full_shape);
    m.text(v.spec ? to_string(*v.spec) : std::string("whole")).count(v.nbytes);
    d += m.str();
    total += v.nbytes;
  }
  const XXH128_hash_t h = XXH3_128bits(d.data(), d.size());
  return {h.high64, h.low64, total};
}

/// The views a rank shares, in classes by coverage_of, ordered by their keys (one order on every
/// rank: the order in which groups exchange).
inline std::vector<replica_class> classes_of(std::span<const flat_view> shared) {
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::vector<flat_view>> by;
  for (const flat_view& v : shared) by[coverage_of(v)].push_back(v);
  std::vector<replica_class> out;
  for (auto& [f, vs] : by) {
    if (out.size() == max_replica_classes)
      out.back().views.insert(out.back().views.end(), vs.begin(), vs.end());
    else
      out.push_back({std::move(vs), {}, {}, 0, 0});
  }
  for (replica_class& c : out) c.key = describe_views(c.views);
  std::sort(out.begin(), out.end(), [](const replica_class& a, const replica_class& b) { return a.key < b.key; });
  return out;
}

/// This rank's message: its classes' keys, then the options every rank must share.
inline std::string describe_classes(const std::vector<replica_class>& classes, const collective_load_options& o) {
  message_writer m;
  m.count(classes.size());
  for (const replica_class& c : classes) m.count(c.key.hi).count(c.key.lo).count(c.key.total);
  return m.count(static_cast<std::uint64_t>(o.replicas)).count(o.exchange_chunk_bytes).count(o.probe_bytes).str();
}

/// Every rank's classes (by rank, in key order) and the ranks of each class shared (a class of
/// no bytes is nobody's to share).
struct replica_plan {
  std::vector<std::vector<class_key>> keys_of;
  std::map<class_key, std::vector<int>> members;
  bool any_group = false;  ///< some class of some rank has two members
  std::size_t group_size(const class_key& k) const {
    const auto it = members.find(k);
    return it == members.end() ? 1 : it->second.size();
  }
};

/// The plan from every rank's description, filling in this rank's classes' groups; ranks that
/// differ in their options are refused (errc::invalid_argument, the same words on every rank).
inline replica_plan plan_of(const std::vector<std::string>& described, int rank, std::vector<replica_class>& mine,
                            std::string_view where) {
  replica_plan p;
  std::uint64_t first[3] = {0, 0, 0};
  for (std::size_t r = 0; r < described.size(); ++r) {
    message_reader m(described[r], "rank " + std::to_string(r) + "'s description of its views");
    std::vector<class_key> keys(static_cast<std::size_t>(m.count(max_replica_classes)));
    for (class_key& k : keys) k = {m.count(), m.count(), m.count()};
    const std::uint64_t o[3] = {m.count(), m.count(), m.count()};
    m.finish();
    if (r == 0) std::copy(o, o + 3, first);
    if (!std::equal(o, o + 3, first))
      fail(errc::invalid_argument, "load " + std::string(where) + ": rank " + std::to_string(r) +
                                       "'s collective_load_options differ from rank 0's (replicas " +
                                       std::to_string(o[0]) + " / " + std::to_string(first[0]) +
                                       ", exchange_chunk_bytes " + std::to_string(o[1]) + " / " +
                                       std::to_string(first[1]) + ", probe_bytes " + std::to_string(o[2]) + " / " +
                                       std::to_string(first[2]) + "): every rank passes the same");
    for (const class_key& k : keys)
      if (k.total > 0) {
        auto& ranks = p.members[k];
        if (ranks.empty() || ranks.back() != static_cast<int>(r)) ranks.push_back(static_cast<int>(r));
        p.any_group = p.any_group || ranks.size() > 1;
      }
    p.keys_of.push_back(std::move(keys));
  }
  for (replica_class& c : mine) {
    const auto it = p.members.find(c.key);
    c.ranks = it == p.members.end() ? std::vector<int>{rank} : it->second;
    c.index = static_cast<std::size_t>(std::find(c.ranks.begin(), c.ranks.end(), rank) - c.ranks.begin());
  }
  return p;
}

/// Sends this member's piece of each class's stream region (the probe's [0, from) or the rest,
/// [from, total)) to the other members and receives theirs (the region split size() ways, as
/// all_pieces cuts it), in chunks, class by class in key order. Returns the bytes received. A
/// chunk of the wrong size is kept in `deferred` (agreed later).
template <Comm C>
std::uint64_t exchange_pieces(C& comm, const std::vector<replica_class>& mine, const replica_plan& plan, bool probe,
                              std::uint64_t chunk_bytes, std::exception_ptr& deferred, std::string_view ctx) {
  const std::uint64_t chunk = std::max<std::uint64_t>(1, chunk_bytes);
  struct cut {
    std::vector<std::vector<piece_segment>> segs;
    std::vector<std::uint64_t> bytes;
  };
  auto cut_of = [&](const replica_class& c) {
    cut x;
    x.segs = probe ? all_pieces(c.views, 0, c.from, c.size()) : all_pieces(c.views, c.from, c.key.total, c.size());
    for (const auto& s : x.segs) x.bytes.push_back(segments_bytes(s));
    return x;
  };
  auto pack = [&](const replica_class& c, const cut& x, std::uint64_t a, std::uint64_t b) {
    std::string s;
    s.reserve(static_cast<std::size_t>(b - a));
    for_segment_bytes(c.views, x.segs[c.index], a, b,
                      [&](const std::byte* d, std::uint64_t len) { s.append(reinterpret_cast<const char*>(d), len); });
    return s;
  };
  auto unpack = [&](const replica_class& c, const cut& x, std::size_t k, std::uint64_t a, std::uint64_t b,
                    const std::string& s, int from) {
    if (deferred || (a == b && s.empty())) return;
    if (s.size() != b - a) {
      try {
        fail(errc::comm_error, std::string(ctx) + ": rank " + std::to_string(from) + "'s piece: bytes [" +
                                   std::to_string(a) + ", " + std::to_string(b) + ") arrived as " +
                                   std::to_string(s.size()) + " bytes");
      } catch (...) {
        deferred = std::current_exception();
      }
      return;
    }
    std::uint64_t at = 0;
    for_segment_bytes(c.views, x.segs[k], a, b, [&](std::byte* d, std::uint64_t len) {
      std::memcpy(d, s.data() + at, static_cast<std::size_t>(len));
      at += len;
    });
  };
  std::uint64_t received = 0;
  bool p2p = false;
  if constexpr (PeerComm<C>) p2p = comm.peer_to_peer();
  if constexpr (requires { comm.bulk_peer_to_peer(); }) p2p = p2p && comm.bulk_peer_to_peer();
  if (p2p) {
    if constexpr (PeerComm<C>) {
      // class by class in key order: a member waits only on members of its class, who reach it
      // after the classes of smaller keys, which end first
      for (const replica_class& c : mine) {
        const std::size_t n = c.size(), me = c.index;
        if (n < 2) continue;
        const cut x = cut_of(c);
        std::uint64_t rounds = 0;
        for (std::uint64_t b : x.bytes) rounds = std::max(rounds, (b + chunk - 1) / chunk);
        for (std::uint64_t r = 0; r < rounds; ++r) {
          const std::uint64_t a = r * chunk;
          if (a < x.bytes[me]) {
            const std::string s = pack(c, x, a, std::min(x.bytes[me], a + chunk));
            for (std::size_t s_ = 1; s_ < n; ++s_)
              exchange_in_scope([&] { comm.send_bytes(s, c.ranks[(me + s_) % n]); });
          }
          for (std::size_t s_ = 1; s_ < n; ++s_) {
            const std::size_t k = (me + n - s_) % n;
            if (a >= x.bytes[k]) continue;
            const std::string s = exchange_in_scope([&] { return comm.recv_bytes(c.ranks[k]); });
            received += s.size();
            unpack(c, x, k, a, std::min(x.bytes[k], a + chunk), s, c.ranks[k]);
          }
        }
      }
      return received;
    }
  }
  // no point to point: rank by rank, class by class, its piece broadcast to the world in chunks,
  // then an empty one (the others do not know its size); kept by the class's members
  const int me = comm.rank();
  std::map<class_key, std::pair<const replica_class*, cut>> held;
  for (const replica_class& c : mine)
    if (c.size() > 1) held.emplace(c.key, std::make_pair(&c, cut_of(c)));
  for (int r = 0; r < comm.world_size(); ++r)
    for (const class_key& key : plan.keys_of[static_cast<std::size_t>(r)]) {
      if (plan.group_size(key) < 2) continue;  // its views are its own
      const auto it = held.find(key);
      const replica_class* c = it == held.end() ? nullptr : it->second.first;
      const cut* x = c ? &it->second.second : nullptr;
      const std::size_t k =
          c ? static_cast<std::size_t>(std::find(c->ranks.begin(), c->ranks.end(), r) - c->ranks.begin()) : 0;
      for (std::uint64_t a = 0;; a += chunk) {
        std::string s;
        if (r == me && a < x->bytes[c->index]) s = pack(*c, *x, a, std::min(x->bytes[c->index], a + chunk));
        exchange_in_scope([&] { comm.broadcast_bytes(s, r); });
        if (r != me && c) {
          received += s.size();
          unpack(*c, *x, k, a, a < x->bytes[k] ? std::min(x->bytes[k], a + chunk) : a, s, r);
        }
        if (s.empty()) break;
      }
    }
  return received;
}

}  // namespace shardsafe::detail
