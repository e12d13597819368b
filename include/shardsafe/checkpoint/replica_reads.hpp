// shardsafe/checkpoint/replica_reads.hpp - replicas read once: a collective load in which ranks
// that load the same views (HSDP's replicas, data-parallel copies, servers of one model) read
// each byte from storage once between them and share it over the Comm (issue 56).
//
// | replica_reads    | who reads a byte of a group's views | storage traffic      | Comm traffic a rank    |
// |------------------|-------------------------------------|----------------------|------------------------|
// | every_rank_reads | every rank of the group             | R x the views        | none                   |
// | read_once        | one rank of the group: member i     | 1 x the views        | receives (R-1)/R of    |
// |                  | reads the i-th of R pieces          |                      | its views              |
// | automatic        | read_once where it measures faster  |                      |                        |
//
// The groups. Every rank describes the views it loads from the checkpoint (each view's key,
// dtype, shape, spec and size, in the caller's order; a key the checkpoint lacks is left out:
// each rank lists or refuses it itself) and all-gathers a 128-bit XXH3 of that description, its
// byte count and its options: 48 bytes a rank. Ranks with equal digests form a group of R ranks, ordered by
// rank. Ranks whose views differ in any way (another order included) are in different groups,
// so a rank that loads alone reads alone: an FSDP load with no replicas costs the 48-byte
// all-gather and nothing more.
//
// The pieces. A group's views are taken as one stream of bytes, in order; member i reads the
// bytes [i x total / R, (i + 1) x total / R), each cut moved back to the start of its element
// (a flat spec, an unsharded view) or of its slice of the block's first dimension longer than 1
// (a block), so that each piece of a view is a view of its own (sub_view) loaded by the plain
// load: dtype conversion, dequantization, checksums and the NaN check apply as always. Then
// each member sends its piece to the other R - 1 in chunks of exchange_chunk_bytes (a
// PeerComm: point to point, chunk by chunk, at most R - 1 chunks in flight a rank), or, over a
// Comm without point to point (c10d over NCCL or the store), each rank's piece is broadcast to the world in turn
// and kept by its group's members only (a rank then receives every group's pieces: with one
// group, data parallelism, that costs nothing more). Sends must not wait for their receive
// (thread_comm's do not).
//
// The choice (automatic): every_rank_reads when no two ranks load the same views, or when every
// rank runs on one host (one page cache: the group's reads after the first are memory copies,
// as HF import's automatic reasons, checkpoint/hf/import.hpp). Else it measures, with bytes the
// load needs anyway: the first R x probe_bytes of each group's stream are read as read_once
// reads them, every member its R-th at once with every other rank (the concurrency of either
// mode), then exchanged (timed: its receive rate). Each rank's estimate is, for
// every_rank_reads, total / (its read rate), for read_once, total / R / (its read rate) +
// (R - 1) / R x total / (its receive rate). The mode
// whose slowest rank is faster wins; every rank decides from the same all-gathered figures.
//
// Failures. The describing, the reads of the pieces (and any rank's refusal of a view) are
// steps every rank agrees on (dist/agree.hpp): a failure on one rank is thrown on every rank.
// A chunk that arrives with the wrong size is a failure agreed after the exchange. A peer that
// dies during the exchange is the Comm's errc::comm_error, naming it, within its timeout.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_options.hpp"
#include "shardsafe/checkpoint/view_pieces.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"

namespace shardsafe {

namespace detail {

/// Ranks that load the same views as this one (itself included, by rank) and this rank's index
/// among them, from every rank's description (digest and bytes).
struct replica_group {
  std::vector<int> ranks;
  std::size_t index = 0;
  std::uint64_t total = 0;                   ///< bytes of the views the group shares
  std::vector<std::uint64_t> group_size_of;  ///< by rank: the size of that rank's group
};

/// This rank's description of the views it shares: 128-bit XXH3 of each view's key, dtype,
/// shape, spec and size, and the bytes.
inline std::string describe_shared_views(std::span<const flat_view> views) {
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
  return message_writer().count(h.high64).count(h.low64).count(total).str();
}

/// The options every rank must share, as describe_shared_views' message goes on.
inline std::string describe_options(const collective_load_options& o) {
  return message_writer()
      .count(static_cast<std::uint64_t>(o.replicas))
      .count(o.exchange_chunk_bytes)
      .count(o.probe_bytes)
      .str();
}

/// This rank's group, from every rank's description; ranks that differ in their options are
/// refused (errc::invalid_argument, the same words on every rank).
inline replica_group group_of(const std::vector<std::string>& described, int rank, std::string_view where) {
  struct key {
    std::uint64_t hi, lo, total;
    auto operator<=>(const key&) const = default;
  };
  std::vector<key> keys;
  keys.reserve(described.size());
  std::uint64_t first[3] = {0, 0, 0};
  for (std::size_t r = 0; r < described.size(); ++r) {
    message_reader m(described[r], "rank " + std::to_string(r) + "'s description of its views");
    key k{m.count(), m.count(), m.count()};
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
    keys.push_back(k);
  }
  std::map<key, std::uint64_t> sizes;
  for (const key& k : keys) ++sizes[k];
  replica_group g;
  g.total = keys[static_cast<std::size_t>(rank)].total;
  g.group_size_of.reserve(keys.size());
  for (std::size_t r = 0; r < keys.size(); ++r) {
    const bool shares = keys[r].total > 0;  // empty views: nothing to read or share
    g.group_size_of.push_back(shares ? sizes[keys[r]] : 1);
    if (keys[r] == keys[static_cast<std::size_t>(rank)] && (shares || static_cast<int>(r) == rank)) {
      if (static_cast<int>(r) == rank) g.index = g.ranks.size();
      g.ranks.push_back(static_cast<int>(r));
    }
  }
  return g;
}

/// Sends this member's piece of the stream region [p, q) to the other members and receives
/// theirs (the region split group.ranks.size() ways, as stream_segments cuts it), in chunks.
/// Returns the bytes received. A chunk of the wrong size is kept in `deferred` (agreed later).
template <Comm C>
std::uint64_t exchange_pieces(C& comm, std::span<const flat_view> views, const replica_group& g, std::uint64_t p,
                              std::uint64_t q, std::uint64_t chunk_bytes, std::exception_ptr& deferred,
                              std::string_view ctx) {
  const std::size_t n = g.ranks.size();
  const std::vector<std::vector<piece_segment>> segs = all_pieces(views, p, q, n);
  std::vector<std::uint64_t> bytes(n);
  for (std::size_t k = 0; k < n; ++k) bytes[k] = segments_bytes(segs[k]);
  const std::uint64_t chunk = std::max<std::uint64_t>(1, chunk_bytes);
  auto pack = [&](std::size_t k, std::uint64_t a, std::uint64_t b) {
    std::string s;
    s.reserve(static_cast<std::size_t>(b - a));
    for_segment_bytes(views, segs[k], a, b,
                      [&](const std::byte* d, std::uint64_t len) { s.append(reinterpret_cast<const char*>(d), len); });
    return s;
  };
  auto unpack = [&](std::size_t k, std::uint64_t a, std::uint64_t b, const std::string& s, int from) {
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
    for_segment_bytes(views, segs[k], a, b, [&](std::byte* d, std::uint64_t len) {
      std::memcpy(d, s.data() + at, static_cast<std::size_t>(len));
      at += len;
    });
  };
  std::uint64_t received = 0;
  bool p2p = false;
  if constexpr (PeerComm<C>) p2p = comm.peer_to_peer();
  if (p2p) {
    if constexpr (PeerComm<C>) {
      if (n < 2) return 0;
      std::uint64_t rounds = 0;
      for (std::uint64_t b : bytes) rounds = std::max(rounds, (b + chunk - 1) / chunk);
      const std::size_t me = g.index;
      for (std::uint64_t c = 0; c < rounds; ++c) {
        const std::uint64_t a = c * chunk;
        if (a < bytes[me]) {
          const std::string s = pack(me, a, std::min(bytes[me], a + chunk));
          for (std::size_t s_ = 1; s_ < n; ++s_) exchange_in_scope([&] { comm.send_bytes(s, g.ranks[(me + s_) % n]); });
        }
        for (std::size_t s_ = 1; s_ < n; ++s_) {
          const std::size_t k = (me + n - s_) % n;
          if (a >= bytes[k]) continue;
          const std::string s = exchange_in_scope([&] { return comm.recv_bytes(g.ranks[k]); });
          received += s.size();
          unpack(k, a, std::min(bytes[k], a + chunk), s, g.ranks[k]);
        }
      }
      return received;
    }
  }
  // no point to point: rank by rank, its piece broadcast to the world in chunks, then an empty
  // one (the others do not know its size); kept by its group's members
  const int me = comm.rank();
  std::vector<int> member_of(static_cast<std::size_t>(comm.world_size()), -1);
  for (std::size_t k = 0; k < n; ++k) member_of[static_cast<std::size_t>(g.ranks[k])] = static_cast<int>(k);
  for (int r = 0; r < comm.world_size(); ++r) {
    if (g.group_size_of[static_cast<std::size_t>(r)] < 2) continue;  // its views are its own
    const int k = member_of[static_cast<std::size_t>(r)];
    for (std::uint64_t a = 0;; a += chunk) {
      std::string s;
      if (r == me && a < bytes[g.index]) s = pack(g.index, a, std::min(bytes[g.index], a + chunk));
      exchange_in_scope([&] { comm.broadcast_bytes(s, r); });
      if (r != me && k >= 0) {
        const auto kk = static_cast<std::size_t>(k);
        received += s.size();
        unpack(kk, a, a < bytes[kk] ? std::min(bytes[kk], a + chunk) : a, s, r);
      }
      if (s.empty()) break;
    }
  }
  return received;
}

/// Nanoseconds since t0.
inline std::uint64_t elapsed_ns(std::chrono::steady_clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
}

/// A host name a thread declares for itself, in place of its process's: what a world of
/// threads that simulates several hosts (the tests of replica_reads' measured choice) sets in
/// each rank's thread. Empty: the process's own.
inline thread_local std::string simulated_host;

/// Where this process runs: its host name and network namespace (ranks in network namespaces
/// of one machine - a simulated cluster - count as hosts of their own).
inline std::string host_identity() {
  if (!simulated_host.empty()) return simulated_host;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::error_code ec;
  const auto ns = std::filesystem::read_symlink("/proc/self/ns/net", ec);
  return std::string(host) + " " + (ec ? std::string() : ns.string());
}

/// Whether every rank runs on one host (host_identity): a collective.
template <Comm C>
bool every_rank_on_one_host(C& comm) {
  const auto hosts = every_rank_step(comm, [&] { return host_identity(); });
  return std::all_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h == hosts.front(); });
}

}  // namespace detail

/// The collective load with replicas: `load_views(views, opt)` is the plain load on this rank
/// (checkpoint/load.hpp passes its reader's), `has()` whether the checkpoint holds each view
/// (by index; called once, in the first step), `unexpected()` the checkpoint's tensors no view
/// asks for. Every rank must pass the same
/// replicas, exchange_chunk_bytes and probe_bytes (checked: refused alike on every rank).
/// The top of this header says what it does; load_stats::replicas, ::replica_group,
/// ::bytes_received and ::why say what it did.
template <Comm C, class LoadViews, class Has, class Unexpected>
load_stats load_replicated(std::span<const flat_view> views, C& comm, const collective_load_options& opt,
                           LoadViews&& load_views, Has&& has, Unexpected&& unexpected, std::string_view where) {
  const auto t0 = std::chrono::steady_clock::now();
  const step_scope scope("load " + std::string(where) + " (replicas: " + std::string(to_string(opt.replicas)) + ")");
  std::vector<flat_view> shared;  // the views the checkpoint has, which a group may share
  std::vector<flat_view> own;     // the others: each rank lists or refuses them itself
  load_stats st;
  const std::vector<std::string> described = every_rank_step(comm, [&] {
    for (const flat_view& v : views) v.validate(where);
    const std::vector<char> held = has();
    for (std::size_t i = 0; i < views.size(); ++i) (held[i] ? shared : own).push_back(views[i]);
    return detail::describe_shared_views(shared) + detail::describe_options(opt);
  });
  detail::replica_group g;
  every_rank_step(comm, [&] { g = detail::group_of(described, comm.rank(), where); });
  const std::size_t R = g.ranks.size();
  bool any_group = false;
  for (std::uint64_t s : g.group_size_of) any_group = any_group || s > 1;
  replica_reads mode = opt.replicas;
  std::exception_ptr deferred;
  load_stats own_st, piece_st;
  load_options o = opt;
  o.list_unexpected = false;
  std::uint64_t from = 0;  // the stream bytes before it are loaded already (automatic's probe)
  // loads the segments' sub-views (and, with zero, the views of no bytes, in no segment: each
  // rank checks them, reading nothing)
  auto load_pieces = [&](const std::vector<detail::piece_segment>& segs, bool zero) {
    std::vector<flat_view> sub;
    sub.reserve(segs.size());
    for (const auto& g_ : segs) sub.push_back(detail::sub_view(shared[g_.view], g_.x, g_.y));
    if (zero)
      for (const flat_view& v : shared)
        if (v.nbytes == 0) sub.push_back(v);
    if (!sub.empty()) piece_st.add_reads(load_views(std::span<const flat_view>(sub), o));
  };
  const std::string ctx = "load " + std::string(where) + ": replicas";
  if (mode == replica_reads::automatic) {
    const step_scope step("choosing how replicas read");
    if (!any_group) {
      mode = replica_reads::every_rank_reads;
      st.why = "no two ranks load the same views";
    } else if (detail::every_rank_on_one_host(comm)) {
      mode = replica_reads::every_rank_reads;
      st.why = "every rank runs on one host";
    } else {
      // the probe, a part of the load: the first R x probe_bytes of the group's stream, each
      // member reading its R-th at once with every other rank, then exchanged
      from = std::min(g.total, std::max<std::uint64_t>(1, opt.probe_bytes) * R);
      std::uint64_t read_ns = 0, read_bytes = 0;
      comm.barrier();
      every_rank_step(comm, [&] {
        const auto r0 = std::chrono::steady_clock::now();
        const auto segs = detail::piece_of(shared, 0, from, g.index, R);
        read_bytes = detail::segments_bytes(segs);
        load_pieces(segs, false);
        read_ns = detail::elapsed_ns(r0);
      });
      std::uint64_t got = 0, got_ns = 0;
      {
        const step_scope ex("exchanging the probe");
        comm.barrier();
        const auto x0 = std::chrono::steady_clock::now();
        got = detail::exchange_pieces(comm, shared, g, 0, from, opt.exchange_chunk_bytes, deferred, ctx);
        got_ns = detail::elapsed_ns(x0);
        st.bytes_received += got;
      }
      const auto figures = every_rank_step(comm, [&] {
        if (deferred) std::rethrow_exception(deferred);
        return message_writer().count(g.total).count(R).count(read_bytes).count(read_ns).count(got).count(got_ns).str();
      });
      double every = 0, once = 0;
      for (std::size_t r = 0; r < figures.size(); ++r) {
        message_reader m(figures[r], "rank " + std::to_string(r) + "'s probe");
        const double total = double(m.count()), n = double(m.count()), rb = double(m.count()), rns = double(m.count()),
                     xb = double(m.count()), xns = double(m.count());
        m.finish();
        const double read_rate = rns > 0 && rb > 0 ? rb * 1e9 / rns : 0,
                     recv_rate = xns > 0 && xb > 0 ? xb * 1e9 / xns : 0;
        const double read_all = read_rate > 0 ? total / read_rate : 0;
        every = std::max(every, read_all);
        once = std::max(once, read_all / n + (n > 1 && recv_rate > 0 ? (n - 1) / n * total / recv_rate : 0));
      }
      mode = once < every ? replica_reads::read_once : replica_reads::every_rank_reads;
      std::ostringstream why;
      why.precision(3);
      why << "estimated every_rank_reads " << every << " s, read_once " << once << " s (the slowest rank)";
      st.why = why.str();
    }
  }
  const bool once = mode == replica_reads::read_once && any_group;  // this rank takes part in the exchange
  const bool piece = once && R > 1;                                 // and reads a piece, not all
  every_rank_step(comm, [&] {
    if (!own.empty()) own_st = load_views(std::span<const flat_view>(own), o);  // missing: refused or listed
    if (opt.list_unexpected) st.unexpected_keys = unexpected();
    if (piece)
      load_pieces(detail::piece_of(shared, from, g.total, g.index, R), true);
    else if (from > 0)  // past the probe
      load_pieces(detail::piece_of(shared, from, g.total, 0, 1), true);
    else if (!shared.empty())
      piece_st.add_reads(load_views(std::span<const flat_view>(shared), o));
  });
  if (once) {
    const step_scope step("exchanging the pieces");
    st.bytes_received +=
        detail::exchange_pieces(comm, shared, g, from, g.total, opt.exchange_chunk_bytes, deferred, ctx);
    every_rank_step(comm, [&] {
      if (deferred) std::rethrow_exception(deferred);
    });
  }
  st.add_reads(own_st).add_reads(piece_st);
  st.tensors = views.size() - own_st.missing_keys.size();
  st.missing_keys = std::move(own_st.missing_keys);
  st.replicas = piece ? replica_reads::read_once : replica_reads::every_rank_reads;
  st.replica_group = piece ? static_cast<std::uint32_t>(R) : 1;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace shardsafe
