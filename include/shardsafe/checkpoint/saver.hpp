// shardsafe/checkpoint/saver.hpp - save flat views from every rank as one sharded checkpoint.
//
// The protocol (every step agreed by all ranks, so a failure anywhere is thrown everywhere
// and nobody is left waiting in a collective):
//   1. each rank validates its views and describes them (its part of metadata.json);
//      the descriptions are all-gathered and merged; every rank checks the same things:
//      one key has one shape, dtype and sharded-ness on all ranks, and the shards of every
//      sharded tensor together cover it;
//   2. rank 0 prepares the directory: refuses a non-empty one unless overwrite was asked,
//      and otherwise removes metadata.json first (so the old checkpoint stops loading as
//      complete), then the rest;
//   3. every rank streams rank_R.safetensors (under a temporary name, fsynced, renamed):
//      its shards, and each replicated tensor it is the lowest rank to hold;
//   4. the outcomes are all-gathered; then rank 0 writes metadata.json, last, by rename: the
//      commit mark. A save killed at any point leaves no directory that loads as complete.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/version.hpp"

namespace shardsafe {

struct save_options {
  bool overwrite = false;   ///< replace an existing non-empty directory
  unsigned threads = 0;     ///< writer threads per rank (0: default)
  std::uint64_t write_chunk_bytes = std::uint64_t(64) << 20;  ///< tensors are written in chunks of this
  /// Rank files go out through O_DIRECT (storages with write_blocks: file_directory), in
  /// aligned blocks (of write_chunk_bytes, at most 16 MiB; one per writer thread) assembled in
  /// memory, bypassing the page cache: a durable save then runs at the device's speed, not at
  /// the speed of filling page-cache pages (2-3x faster in bench/bench_checkpoint), and leaves
  /// the checkpoint uncached. Where the file system refuses O_DIRECT, buffered writes are used.
  /// false: buffered writes (e.g. to reload at once from the page cache).
  bool direct_io = true;
};

struct save_stats {
  std::uint64_t bytes_written = 0;   ///< this rank's file
  std::uint64_t total_bytes = 0;     ///< all rank files
  std::uint64_t tensors_written = 0; ///< entries in this rank's file
  double seconds = 0;
};

namespace detail {

/// A fill callback that writes nothing: for asking whether a writer has write_blocks.
struct no_fill {
  void operator()(std::uint64_t, std::span<std::byte>) const noexcept {}
};

inline constexpr std::string_view error_marker = "\x01shardsafe-error\x01";

/// Runs f; returns "" or the error marker and message, for all-gathering outcomes.
template <class F>
std::string outcome_of(F&& f) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    return std::string(error_marker) + e.what();
  }
}

/// Throws on every rank if any rank's outcome is an error (the lowest rank's message, with
/// how many ranks failed).
inline void agree_on_outcomes(const std::vector<std::string>& outcomes, errc code) {
  int failed = 0, first = -1;
  for (std::size_t r = 0; r < outcomes.size(); ++r)
    if (outcomes[r].rfind(error_marker, 0) == 0) {
      ++failed;
      if (first < 0) first = static_cast<int>(r);
    }
  if (failed == 0) return;
  std::string msg = "rank " + std::to_string(first) + ": " + outcomes[first].substr(error_marker.size());
  if (failed > 1) msg += " (and " + std::to_string(failed - 1) + " more rank(s) failed)";
  throw error(code, msg);
}

template <Comm C, class F>
void collective_step(C& comm, errc code, F&& f) {
  agree_on_outcomes(comm.all_gather_bytes(outcome_of(f)), code);
}

/// This rank's part of the metadata: every view with this rank's file as its only file.
inline checkpoint_metadata describe_views(std::span<const flat_view> views, int rank, std::string_view dir) {
  checkpoint_metadata md;
  std::map<std::string_view, bool> seen;
  for (const auto& v : views) {
    v.validate(dir);
    if (!seen.emplace(v.key, true).second)
      fail(errc::invalid_argument, std::string(dir) + ": tensor '" + v.key + "' is given twice");
    tensor_metadata tm;
    tm.shape = v.full_shape;
    tm.type = v.type;
    tm.is_sharded = v.is_sharded();
    tm.files.emplace_back(rank_file_name(rank), v.effective_spec());
    md.tensors.emplace_back(v.key, std::move(tm));
  }
  return md;
}

/// Merges the ranks' descriptions into the checkpoint's metadata, checking they agree and
/// that every sharded tensor is covered.
inline checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts, std::string_view dir) {
  checkpoint_metadata out;
  std::map<std::string, std::size_t> where;   // key -> index in out.tensors
  std::map<std::string, int> first_rank;      // key -> lowest rank holding it
  for (std::size_t r = 0; r < parts.size(); ++r) {
    for (const auto& [key, tm] : parts[r].tensors) {
      auto it = where.find(key);
      if (it == where.end()) {
        where.emplace(key, out.tensors.size());
        first_rank.emplace(key, static_cast<int>(r));
        out.tensors.emplace_back(key, tm);
        continue;
      }
      tensor_metadata& have = out.tensors[it->second].second;
      const int r0 = first_rank[key];
      auto disagree = [&](const std::string& what, const std::string& a, const std::string& b) {
        fail(errc::invalid_argument, std::string(dir) + ": tensor '" + key + "': rank " + std::to_string(r0) + " saves " +
                                         what + " " + a + " but rank " + std::to_string(r) + " saves " + b);
      };
      if (have.shape != tm.shape) disagree("shape", to_string(have.shape), to_string(tm.shape));
      if (have.type != tm.type) disagree("dtype", std::string(name(have.type)), std::string(name(tm.type)));
      if (have.is_sharded != tm.is_sharded)
        disagree("it", have.is_sharded ? "sharded" : "not sharded", tm.is_sharded ? "sharded" : "not sharded");
      if (have.is_sharded) have.files.push_back(tm.files.front());  // replicated: the lowest rank's copy only
    }
  }
  for (const auto& [key, tm] : out.tensors) {
    if (!tm.is_sharded) continue;
    std::vector<shard_spec> specs;
    for (const auto& f : tm.files) specs.push_back(f.second);
    const shard_spec whole = flat_spec{{0, tm.numel()}};
    auto missing = missing_elements(whole, std::span<const shard_spec>(specs), tm.shape);
    if (!missing.empty())
      fail(errc::missing_coverage, std::string(dir) + ": tensor '" + key + "' " + to_string(tm.shape) +
                                       ": no rank holds elements " + to_string(missing.front()) + " (index " +
                                       multi_index_string(tm.shape, missing.front().begin) +
                                       "); the shards of all ranks must cover the tensor");
  }
  return out;
}

}  // namespace detail

/// Saves every rank's views into dir as one checkpoint. A collective: every rank calls it.
template <WritableDirectory D, Comm C>
save_stats save_flat_views(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  const int rank = comm.rank(), world = comm.world_size();
  const std::string dname(dir.name());

  // 1. describe, gather, merge, check
  std::string mine;
  std::string local_error = detail::outcome_of([&] { mine = write_checkpoint_metadata(detail::describe_views(views, rank, dname)); });
  auto gathered = comm.all_gather_bytes(local_error.empty() ? mine : local_error);
  detail::agree_on_outcomes(gathered, errc::invalid_argument);
  std::vector<checkpoint_metadata> parts;
  parts.reserve(gathered.size());
  for (std::size_t r = 0; r < gathered.size(); ++r)
    parts.push_back(parse_checkpoint_metadata(gathered[r], dname + " (rank " + std::to_string(r) + "'s plan)"));
  checkpoint_metadata md = detail::merge_descriptions(parts, dname);

  // 2. prepare the directory
  std::string prep = rank == 0 ? detail::outcome_of([&] {
    if (!dir.list().empty()) {
      if (!opt.overwrite)
        fail(errc::already_exists, dname + ": not empty; refusing to save over it (pass overwrite to replace it)");
      dir.remove(metadata_file_name);  // first: the old checkpoint no longer loads as complete
      for (const auto& n : dir.list()) dir.remove(n);
    }
    dir.make();
  }) : std::string();
  comm.broadcast_bytes(prep, 0);
  detail::agree_on_outcomes({prep}, errc::already_exists);

  // 3. write this rank's file
  save_stats st;
  const std::string fname = rank_file_name(rank);
  std::uint64_t size = 0;
  std::string write_error = detail::outcome_of([&] {
    std::vector<const flat_view*> mine_to_write;
    for (const auto& v : views) {
      const tensor_metadata* tm = md.find(v.key);
      const auto& owner = tm->files.front().first;
      if (tm->is_sharded || owner == fname) mine_to_write.push_back(&v);
    }
    std::vector<tensor_entry> entries;
    for (const flat_view* v : mine_to_write) entries.push_back({v->key, v->type, shape_t{v->local_numel()}, 0, 0});
    auto w = dir.create(fname);
    auto layout = plan_safetensors(std::move(entries), {}, w.name());
    if constexpr (requires { w.reserve(std::uint64_t{}); }) w.reserve(layout.file_size());
    if constexpr (requires { w.write_blocks(std::uint64_t{}, detail::no_fill{}, block_write_options{}); }) {
      // the whole file in aligned blocks: header and tensors gathered into each block
      std::vector<const std::byte*> data(layout.tensors.size(), nullptr);
      for (const flat_view* v : mine_to_write) data[layout.index_of(v->key)] = v->data;
      block_write_options bo;
      bo.threads = opt.threads;
      bo.direct = opt.direct_io;
      bo.block_bytes = std::clamp<std::uint64_t>(opt.write_chunk_bytes, 1, std::uint64_t(16) << 20);
      w.write_blocks(layout.file_size(), [&](std::uint64_t off, std::span<std::byte> dst) {
        render_safetensors_bytes(layout, data, off, dst);
      }, bo);
      w.sync();
      w.commit();
      size = layout.file_size();
      st.tensors_written = mine_to_write.size();
      return;
    }
    safetensors_writer<typename D::writer_type> sw(w, layout);
    struct piece {
      std::size_t index;
      std::uint64_t offset, len;
      const std::byte* src;
    };
    std::vector<piece> pieces;
    const std::uint64_t chunk = std::max<std::uint64_t>(opt.write_chunk_bytes, 1);
    for (const flat_view* v : mine_to_write) {
      const std::size_t idx = layout.index_of(v->key);
      if (v->nbytes == 0) pieces.push_back({idx, 0, 0, v->data});
      for (std::uint64_t off = 0; off < v->nbytes; off += chunk)
        pieces.push_back({idx, off, std::min(chunk, v->nbytes - off), v->data + off});
    }
    detail::parallel_for(pieces.size(), opt.threads, [&](std::size_t i) {
      const piece& p = pieces[i];
      sw.write_part(p.index, p.offset, {p.src, static_cast<std::size_t>(p.len)});
    });
    sw.finish();
    size = layout.file_size();
    st.tensors_written = mine_to_write.size();
  });

  // 4. agree, then commit metadata.json on rank 0
  auto outcomes = comm.all_gather_bytes(write_error.empty() ? std::to_string(size) : write_error);
  detail::agree_on_outcomes(outcomes, errc::io_error);
  md.extras.writer = "shardsafe " + std::string(library_version);
  md.extras.world_size = static_cast<std::uint64_t>(world);
  for (int r = 0; r < world; ++r) {
    const std::uint64_t s = std::stoull(outcomes[r]);
    md.extras.file_sizes[rank_file_name(r)] = s;
    st.total_bytes += s;
  }
  st.bytes_written = size;
  std::string commit = rank == 0 ? detail::outcome_of([&] {
    const std::string text = write_checkpoint_metadata(md);
    auto w = dir.create(metadata_file_name);
    w.write_at(0, std::as_bytes(std::span(text)));
    w.sync();
    w.commit();
  }) : std::string();
  comm.broadcast_bytes(commit, 0);
  detail::agree_on_outcomes({commit}, errc::io_error);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace shardsafe
