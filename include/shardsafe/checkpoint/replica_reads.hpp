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
// The groups. Every rank sorts the views it loads from the checkpoint (a key the checkpoint
// lacks is left out: each rank lists or refuses it itself) into classes by the fraction of its
// tensor a view covers (coverage_of: 1/1 whole, 1/8 a shard of eight, at most 16 classes), so
// that the views several ranks share apart from their others fall in a class of their own: the
// norms that tensor parallelism replicates under FSDP (1/DP of the tensor, where the matrices
// are 1/(DP x TP)), a tied or replicated tensor loaded whole beside shards, the attention
// weights expert parallelism replicates. Each class is described by a 128-bit XXH3 of its views
// (each view's key, dtype, shape, spec and size, in the caller's order) and its bytes; every
// rank all-gathers its classes' descriptions and its options: 32 + 24 bytes a class. Ranks with
// an equal class form that class's group of R ranks, ordered by rank; views that differ in any
// way (another order included) are in different classes, so a view only one rank loads is read
// by it alone: an FSDP load with no replicas costs the all-gather and nothing more. A class is
// a group's unit of everything below; a rank in several groups reads and exchanges for each.

// The pieces. A class's views are taken as one stream of bytes, in order; member i reads the
// bytes [i x total / R, (i + 1) x total / R), each cut moved back to the start of its element
// (a flat spec, an unsharded view) or of its slice of the block's first dimension longer than 1
// (a block), so that each piece of a view is a view of its own (sub_view) loaded by the plain
// load: dtype conversion, dequantization, checksums and the NaN check apply as always. Then
// each member sends its piece to the other R - 1 in chunks of exchange_chunk_bytes (a
// PeerComm: point to point, chunk by chunk, at most R - 1 chunks in flight a rank), or, over a
// Comm without point to point for bulk data (c10d over NCCL: bulk_peer_to_peer), each rank's piece is broadcast to the world in turn
// and kept by its group's members only (a rank then receives every group's pieces: with one
// group, data parallelism, that costs nothing more). Groups exchange class by class in the
// order of their descriptions, the same on every rank, so a member waits only on members that
// reach the class once the classes before it are done. Sends must not wait for their receive
// (thread_comm's do not).
//
// The choice (automatic): every_rank_reads when no two ranks load the same views, or when every
// rank runs on one host (one page cache: the group's reads after the first are memory copies,
// as HF import's automatic reasons, checkpoint/hf/import.hpp). Else it measures, with bytes the
// load needs anyway: the first R x probe_bytes of each shared class's stream are read as read_once
// reads them, every member its R-th at once with every other rank (the concurrency of either
// mode), then exchanged (timed: its receive rate). Each rank's estimate is, for
// every_rank_reads, total / (its read rate), for read_once, the sum over its classes of
// total / R / (its read rate) + (R - 1) / R x total / (its receive rate). The mode
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
#include "shardsafe/checkpoint/replica_groups.hpp"
#include "shardsafe/checkpoint/view_pieces.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"

namespace shardsafe {

namespace detail {

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
  std::vector<detail::replica_class> classes;
  load_stats st;
  const std::vector<std::string> described = every_rank_step(comm, [&] {
    for (const flat_view& v : views) v.validate(where);
    const std::vector<char> held = has();
    for (std::size_t i = 0; i < views.size(); ++i) (held[i] ? shared : own).push_back(views[i]);
    classes = detail::classes_of(shared);
    return detail::describe_classes(classes, opt);
  });
  detail::replica_plan plan;
  every_rank_step(comm, [&] { plan = detail::plan_of(described, comm.rank(), classes, where); });
  std::size_t R = 1;  // the largest group this rank is in
  for (const auto& c : classes) R = std::max(R, c.size());
  replica_reads mode = opt.replicas;
  std::exception_ptr deferred;
  load_stats own_st, piece_st;
  load_options o = opt;
  o.list_unexpected = false;
  // loads each class's segments from whole_piece (every member the whole region) or its own
  // piece, of the stream region [0, from) (probe) or [from, total), as sub-views in one load;
  // with zero, the views of no bytes too (in no segment: each rank checks them, reading nothing)
  auto load_pieces = [&](bool probe, bool whole_piece, bool zero) {
    std::vector<flat_view> sub;
    std::uint64_t bytes = 0;
    for (const auto& c : classes) {
      const std::uint64_t p = probe ? 0 : c.from, q = probe ? c.from : c.key.total;
      const auto segs = whole_piece || c.size() < 2 ? detail::piece_of(c.views, p, q, 0, 1)
                                                    : detail::piece_of(c.views, p, q, c.index, c.size());
      for (const auto& g_ : segs) sub.push_back(detail::sub_view(c.views[g_.view], g_.x, g_.y));
      bytes += detail::segments_bytes(segs);
    }
    if (zero)
      for (const flat_view& v : shared)
        if (v.nbytes == 0) sub.push_back(v);
    if (!sub.empty()) piece_st.add_reads(load_views(std::span<const flat_view>(sub), o));
    return bytes;
  };
  const std::string ctx = "load " + std::string(where) + ": replicas";
  bool probed = false;
  if (mode == replica_reads::automatic) {
    const step_scope step("choosing how replicas read");
    if (!plan.any_group) {
      mode = replica_reads::every_rank_reads;
      st.why = "no two ranks load the same views";
    } else if (detail::every_rank_on_one_host(comm)) {
      mode = replica_reads::every_rank_reads;
      st.why = "every rank runs on one host";
    } else {
      // the probe, a part of the load: the first R x probe_bytes of each shared class's stream,
      // each member reading its R-th at once with every other rank, then exchanged
      probed = true;
      double every_bytes = 0, once_read = 0, once_recv = 0;  // this rank's, by mode
      for (auto& c : classes) {
        const double n = double(c.size()), total = double(c.key.total);
        if (c.size() > 1) c.from = std::min(c.key.total, std::max<std::uint64_t>(1, opt.probe_bytes) * c.size());
        every_bytes += total;
        once_read += total / n;
        once_recv += (n - 1) / n * total;
      }
      std::uint64_t read_ns = 0, read_bytes = 0;
      comm.barrier();
      every_rank_step(comm, [&] {
        const auto r0 = std::chrono::steady_clock::now();
        read_bytes = load_pieces(true, false, false);
        read_ns = detail::elapsed_ns(r0);
      });
      std::uint64_t got = 0, got_ns = 0;
      {
        const step_scope ex("exchanging the probe");
        comm.barrier();
        const auto x0 = std::chrono::steady_clock::now();
        got = detail::exchange_pieces(comm, classes, plan, true, opt.exchange_chunk_bytes, deferred, ctx);
        got_ns = detail::elapsed_ns(x0);
        st.bytes_received += got;
      }
      const auto figures = every_rank_step(comm, [&] {
        if (deferred) std::rethrow_exception(deferred);
        return message_writer()
            .count(static_cast<std::uint64_t>(every_bytes))
            .count(static_cast<std::uint64_t>(once_read))
            .count(static_cast<std::uint64_t>(once_recv))
            .count(read_bytes)
            .count(read_ns)
            .count(got)
            .count(got_ns)
            .str();
      });
      double every = 0, once = 0;
      for (std::size_t r = 0; r < figures.size(); ++r) {
        message_reader m(figures[r], "rank " + std::to_string(r) + "'s probe");
        const double all = double(m.count()), own_part = double(m.count()), recv_part = double(m.count()),
                     rb = double(m.count()), rns = double(m.count()), xb = double(m.count()), xns = double(m.count());
        m.finish();
        const double read_rate = rns > 0 && rb > 0 ? rb * 1e9 / rns : 0,
                     recv_rate = xns > 0 && xb > 0 ? xb * 1e9 / xns : 0;
        every = std::max(every, read_rate > 0 ? all / read_rate : 0);
        once = std::max(once, (read_rate > 0 ? own_part / read_rate : 0) +
                                  (recv_part > 0 && recv_rate > 0 ? recv_part / recv_rate : 0));
      }
      mode = once < every ? replica_reads::read_once : replica_reads::every_rank_reads;
      std::ostringstream why;
      why.precision(3);
      why << "estimated every_rank_reads " << every << " s, read_once " << once << " s (the slowest rank)";
      st.why = why.str();
    }
  }
  const bool once = mode == replica_reads::read_once && plan.any_group;  // this rank takes part in the exchange
  const bool piece = once && R > 1;                                      // and reads a piece of some class
  every_rank_step(comm, [&] {
    if (!own.empty()) own_st = load_views(std::span<const flat_view>(own), o);  // missing: refused or listed
    if (opt.list_unexpected) st.unexpected_keys = unexpected();
    if (once || probed)
      load_pieces(false, !once, true);
    else if (!shared.empty())
      piece_st.add_reads(load_views(std::span<const flat_view>(shared), o));
  });
  if (once) {
    const step_scope step("exchanging the pieces");
    st.bytes_received += detail::exchange_pieces(comm, classes, plan, false, opt.exchange_chunk_bytes, deferred, ctx);
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
