// shardsafe/checkpoint/saver.hpp - save flat views from every rank as one sharded checkpoint.
//
// The protocol (every step agreed by all ranks, so a failure anywhere is thrown everywhere
// and nobody is left waiting in a collective):
//   1. each rank validates its views and describes them (its part of metadata.json);
//      the descriptions are all-gathered and merged; every rank checks the same things:
//      one key has one shape, dtype and sharded-ness on all ranks, the shards of every
//      sharded tensor together cover it, and no two different shards overlap (identical
//      shards are replicas: declared in flat_view::replica, one writer and the others copies,
//      they are written once; undeclared, each holder writes its own);
//   2. rank 0 prepares the directory: refuses a non-empty one unless overwrite was asked,
//      and otherwise removes metadata.json first (so the old checkpoint stops loading as
//      complete), then the rest;
//   3. every rank streams rank_R.safetensors (under a temporary name, fsynced, renamed):
//      its shards (but those it holds as a replica copy: the writer replica writes them), and
//      each replicated tensor it is the lowest rank to hold;
//   4. the outcomes are all-gathered; then rank 0 writes metadata.json, last, by rename: the
//      commit mark. A save killed at any point leaves no directory that loads as complete.
// Each step runs under dist/agree.hpp: a failure on any rank is thrown, with its own code,
// on every rank. save_flat_views reads as these four steps (detail::agree_on_metadata, then
// detail::write_and_commit: prepare_directory, write_rank_files, commit_metadata); an
// asynchronous save (checkpoint/async_save.hpp) runs step 1 on the caller's thread and the
// others in the background.
#pragma once

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"
#include "shardsafe/version.hpp"

namespace shardsafe {

/// Which layout a save writes.
enum class save_format {
  shardsafe,  ///< metadata.json + rank_R.safetensors (docs/FORMAT.md §2; OLMo-core's pre-1.0 layout)
  dcp,        ///< torch.distributed.checkpoint: .metadata + __R_0.distcp (checkpoint/dcp_save.hpp)
};

/// How metadata.json describes sharded tensors (docs/FORMAT.md §2).
enum class metadata_form {
  /// compact when the listed form would hold more than compact_metadata_entries shard entries
  /// (tensors x files each): past there a rank spends over a second reading the listed form
  automatic,
  listed,   ///< one entry per file per tensor, as OLMo-core writes and reads it
  /// a regular sharding as a grid of O(dims) numbers ("shardsafe_grid", shard/shard_grid.hpp),
  /// other tensors listed; checksums beside the rank files (rank_R.checksums.json). Readers
  /// other than shardsafe (OLMo-core) cannot read it.
  compact,
};

/// metadata_form::automatic's threshold: shard entries of the listed form.
inline constexpr std::uint64_t compact_metadata_entries = std::uint64_t(1) << 18;

struct save_options {
  save_format format = save_format::shardsafe;
  metadata_form metadata = metadata_form::automatic;  ///< save_format::shardsafe only
  bool overwrite = false;   ///< replace an existing non-empty directory
  unsigned threads = 0;     ///< writer threads per rank (0: default)
  std::uint64_t write_chunk_bytes = std::uint64_t(64) << 20;  ///< tensors are written in chunks of this
  /// Rank files go out through O_DIRECT (BlockWritableStorage writers: file_directory's), in
  /// aligned blocks (of write_chunk_bytes, at most 16 MiB; one per writer thread) assembled in
  /// memory, bypassing the page cache: a durable save then runs at the device's speed, not at
  /// the speed of filling page-cache pages (2-3x faster in bench/bench_checkpoint), and leaves
  /// the checkpoint uncached. Where the file system refuses O_DIRECT, buffered writes are used.
  /// false: buffered writes (e.g. to reload at once from the page cache).
  bool direct_io = true;
  /// Record an XXH3-64 checksum of every block of checksum_block_bytes of every tensor in
  /// metadata.json (docs/FORMAT.md §2, "Checksums"), computed while the bytes are written; what
  /// verify checks, and a load checks with load_options::verify_checksums.
  bool checksums = true;
  std::uint64_t checksum_block_bytes = default_checksum_block_bytes;  ///< recorded in metadata.json
  /// The bytes of views given without memory (data == nullptr), copied while the rank file is
  /// written: fetch(view, offset, dst) puts the view's bytes [offset, offset + dst.size()) into
  /// dst, called from several writer threads at once for disjoint parts, so host memory stays at
  /// the writer's blocks (save_state_dict sets it for CUDA tensors: device-to-host copies
  /// overlapped with the writes). Empty: every view must have memory. save_format::shardsafe only.
  std::function<void(const flat_view&, std::uint64_t, std::span<std::byte>)> fetch{};
};

struct save_stats {
  std::uint64_t bytes_written = 0;   ///< this rank's file
  std::uint64_t total_bytes = 0;     ///< all rank files
  std::uint64_t tensors_written = 0; ///< entries in this rank's file
  double seconds = 0;
};

namespace detail {

/// This rank's part of the metadata: every view with this rank's file as its only file.
inline checkpoint_metadata describe_views(std::span<const flat_view> views, int rank, std::string_view dir,
                                          bool memory_later = false) {
  checkpoint_metadata md;
  std::map<std::string_view, bool> seen;
  for (const auto& v : views) {
    v.validate(dir, memory_later);
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

/// The replica roles of a rank's views, sent ahead of its description: a line with the count,
/// then "INDEX w" or "INDEX c" per view declared a replica (INDEX: its place among the views).
/// A view without a spec cannot be a replica (unsharded tensors are written once already).
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::string encode_replica_roles(std::span<const flat_view> views, std::string_view dir) {
  std::string lines;
  std::size_t n = 0;
  for (std::size_t i = 0; i < views.size(); ++i) {
    const flat_view& v = views[i];
    if (v.replica == replica_role::none) continue;
    if (!v.is_sharded())
      fail(errc::invalid_argument, std::string(dir) + ": tensor '" + v.key + "' is declared a replica " +
                                       std::string(to_string(v.replica)) +
                                       " but has no shard spec; a tensor that is not sharded is written once, by the lowest rank");
    lines += std::to_string(i) + (v.replica == replica_role::writer ? " w\n" : " c\n");
    ++n;
  }
  return std::to_string(n) + "\n" + lines;
}
#else
SHARDSAFE_DECL std::string encode_replica_roles(std::span<const flat_view> views, std::string_view dir);
#endif

/// Reads what encode_replica_roles wrote from the front of text (which is left holding the
/// rest): the role of each view, by index (views past the end: none).
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::vector<replica_role> decode_replica_roles(std::string_view& text, std::string_view from) {
  auto malformed = [&] { fail(errc::comm_error, "the replica roles received from " + std::string(from) + " are malformed"); };
  auto line = [&] {
    const auto nl = text.find('\n');
    if (nl == std::string_view::npos) malformed();
    std::string_view l = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    return l;
  };
  auto number = [&](std::string_view l) {
    std::uint64_t v = 0;
    auto [p, ec] = std::from_chars(l.data(), l.data() + l.size(), v);
    if (ec != std::errc() || p != l.data() + l.size()) malformed();
    return v;
  };
  const std::uint64_t n = number(line());
  std::vector<std::pair<std::uint64_t, replica_role>> got;
  for (std::uint64_t k = 0; k < n; ++k) {
    const std::string_view l = line();
    if (l.size() < 3 || l[l.size() - 2] != ' ' || (l.back() != 'w' && l.back() != 'c')) malformed();
    got.emplace_back(number(l.substr(0, l.size() - 2)), l.back() == 'w' ? replica_role::writer : replica_role::copy);
  }
  std::vector<replica_role> roles;
  for (const auto& [i, role] : got) {
    if (i >= (std::uint64_t(1) << 32)) malformed();
    if (roles.size() <= i) roles.resize(static_cast<std::size_t>(i) + 1, replica_role::none);
    roles[static_cast<std::size_t>(i)] = role;
  }
  return roles;
}
#else
SHARDSAFE_DECL std::vector<replica_role> decode_replica_roles(std::string_view& text, std::string_view from);
#endif

/// The shards of one sharded tensor, checked: every copy replica has a writer with its spec,
/// no shard has two writers, and no two shards overlap unless they are identical (the distinct
/// shards hold, together, no more elements than the tensor; with the coverage check after,
/// each element is held by exactly one distinct shard). Identical shards that are not declared
/// replicas (a replicated DTensor saved by every rank) stay accepted and are each written, as
/// before roles existed. Returns the files to list: the shards written, in rank order.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> check_shards(const std::string& key, const tensor_metadata& tm,
                                                                            const std::vector<int>& ranks,
                                                                            const std::vector<replica_role>& roles,
                                                                            std::string_view dir) {
  const std::string c = std::string(dir) + ": tensor '" + key + "' " + to_string(tm.shape);
  std::map<std::string, std::size_t> writer_of;  // spec text -> index of its writer
  for (std::size_t i = 0; i < tm.files.size(); ++i) {
    if (roles[i] != replica_role::writer) continue;
    auto [it, fresh] = writer_of.emplace(to_string(tm.files[i].second), i);
    if (!fresh)
      fail(errc::invalid_argument, c + ": ranks " + std::to_string(ranks[it->second]) + " and " + std::to_string(ranks[i]) +
                                       " are both the writer of the replicated shard " + it->first +
                                       "; one replica writes it, the others are copies");
  }
  std::vector<std::pair<std::string, shard_spec>> files;
  std::vector<int> file_rank;
  std::map<std::string, bool> distinct;  // spec texts counted in held
  std::uint64_t held = 0;
  for (std::size_t i = 0; i < tm.files.size(); ++i) {
    if (roles[i] == replica_role::copy) {
      if (!writer_of.count(to_string(tm.files[i].second)))
        fail(errc::invalid_argument, c + ": rank " + std::to_string(ranks[i]) + " holds " + to_string(tm.files[i].second) +
                                         " as a replica copy, but no rank is the writer of that shard");
      continue;
    }
    files.push_back(tm.files[i]);
    file_rank.push_back(ranks[i]);
    if (distinct.emplace(to_string(tm.files[i].second), true).second) held += tm.files[i].second.local_numel();
  }
  if (held > tm.numel()) {  // some shards overlap: name two (only on this error path: pairwise)
    const std::span<const std::uint64_t> full(tm.shape);
    for (std::size_t a = 0; a < files.size(); ++a)
      for (std::size_t b = a + 1; b < files.size(); ++b) {
        if (files[a].second == files[b].second) continue;  // identical: replicas
        const std::uint64_t both = overlap_numel(files[a].second, files[b].second, full);
        if (both == 0) continue;
        std::string first;
        for_each_overlap(files[a].second, files[b].second, full, [&](const overlap_piece& p) {
          if (first.empty()) first = multi_index_string(full, p.global);
        });
        fail(errc::invalid_argument,
             c + ": rank " + std::to_string(file_rank[a]) + "'s shard " + to_string(files[a].second) + " and rank " +
                 std::to_string(file_rank[b]) + "'s shard " + to_string(files[b].second) + " share " +
                 std::to_string(both) + " elements (the first at index " + first +
                 "); shards must not overlap unless they are identical and declared replicas (flat_view::replica)");
      }
  }
  return files;
}
#else
SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> check_shards(const std::string& key, const tensor_metadata& tm,
                                                                            const std::vector<int>& ranks,
                                                                            const std::vector<replica_role>& roles,
                                                                            std::string_view dir);
#endif

/// Merges the ranks' descriptions into the checkpoint's metadata, checking they agree, that
/// every sharded tensor is covered, and that its shards do not overlap (but as replicas).
/// roles[r][i]: rank r's role for its i-th tensor (missing: none).
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts, std::string_view dir,
                                                      const std::vector<std::vector<replica_role>>& roles = {}) {
  checkpoint_metadata out;
  std::map<std::string, std::size_t> where;   // key -> index in out.tensors
  std::map<std::string, int> first_rank;      // key -> lowest rank holding it
  // per sharded tensor (index in out.tensors): the rank and role of each entry of its files
  std::vector<std::vector<int>> file_ranks;
  std::vector<std::vector<replica_role>> file_roles;
  for (std::size_t r = 0; r < parts.size(); ++r) {
    for (std::size_t i = 0; i < parts[r].tensors.size(); ++i) {
      const std::string& key = parts[r].tensors[i].first;  // named, not bound: `disagree` captures it
      const tensor_metadata& tm = parts[r].tensors[i].second;
      const replica_role role = r < roles.size() && i < roles[r].size() ? roles[r][i] : replica_role::none;
      auto it = where.find(key);
      if (it == where.end()) {
        where.emplace(key, out.tensors.size());
        first_rank.emplace(key, static_cast<int>(r));
        out.tensors.emplace_back(key, tm);
        file_ranks.push_back({static_cast<int>(r)});
        file_roles.push_back({role});
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
      if (have.is_sharded) {  // replicated: the lowest rank's copy only
        have.files.push_back(tm.files.front());
        file_ranks[it->second].push_back(static_cast<int>(r));
        file_roles[it->second].push_back(role);
      }
    }
  }
  for (std::size_t t = 0; t < out.tensors.size(); ++t) {
    auto& [key, tm] = out.tensors[t];
    if (!tm.is_sharded) continue;
    tm.files = check_shards(key, tm, file_ranks[t], file_roles[t], dir);
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
#else
SHARDSAFE_DECL checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts, std::string_view dir,
                                                      const std::vector<std::vector<replica_role>>& roles = {});
#endif

/// Step 1: every rank describes its views; the descriptions are all-gathered, merged and
/// checked on every rank alike. Returns the checkpoint's metadata (without its extras).
template <Comm C>
checkpoint_metadata agree_on_metadata(std::span<const flat_view> views, C& comm, const std::string& dname,
                                      bool memory_later = false) {
  const int rank = comm.rank();
  const step_scope step("agreeing on the metadata");
  const auto texts = every_rank_step(comm, [&] {
    return encode_replica_roles(views, dname) +
           write_checkpoint_metadata(describe_views(views, rank, dname, memory_later));
  });
  std::vector<checkpoint_metadata> parts;
  std::vector<std::vector<replica_role>> roles;
  parts.reserve(texts.size());
  for (std::size_t r = 0; r < texts.size(); ++r) {
    std::string_view text = texts[r];
    const std::string from = dname + " (rank " + std::to_string(r) + "'s plan)";
    roles.push_back(decode_replica_roles(text, from));
    parts.push_back(parse_checkpoint_metadata(text, from));
  }
  return merge_descriptions(parts, dname, roles);
}

/// On rank 0: refuses a non-empty dir unless overwrite; otherwise empties it, commit marks
/// first (remove_mark(dir), the new layout's, then those of any layout: remove_commit_marks),
/// so the old checkpoint stops loading as complete whatever its layout; then makes it.
template <WritableDirectory D, Comm C, class RemoveMark>
void prepare_emptied(const D& dir, bool overwrite, C& comm, RemoveMark&& remove_mark) {
  const step_scope step("preparing the folder");
  rank0_step(comm, [&] {
    if (!dir.list().empty()) {
      if (!overwrite)
        fail(errc::already_exists,
             std::string(dir.name()) + ": not empty; refusing to save over it (pass overwrite to replace it)");
      remove_mark(dir);
      remove_commit_marks(dir);
      for (const auto& n : dir.list()) dir.remove(n);
    }
    dir.make();
  });
}

/// Step 2: dir prepared (prepare_emptied), its commit mark metadata.json (a DCP folder's .metadata).
template <WritableDirectory D, Comm C>
void prepare_directory(const D& dir, bool overwrite, C& comm, std::string_view commit_mark = metadata_file_name) {
  prepare_emptied(dir, overwrite, comm, [&](const D& d) { d.remove(commit_mark); });
}

/// The parent of a multi-folder save (save_folder_set) prepared: its commit mark is the commit
/// folder's metadata.json or DCP .metadata (removing a name that is not there is no error; an
/// object store has no folder to ask about).
template <WritableDirectory D, Comm C>
void prepare_folder_set(const D& parent, std::string_view commit_folder, bool overwrite, C& comm) {
  prepare_emptied(parent, overwrite, comm, [&](const D& d) {
    const D last = d.sub(commit_folder);
    for (std::string_view mark : commit_mark_names) last.remove(mark);
  });
}

/// The views `rank` writes: its shards (not those it holds as a replica copy), and each
/// replicated tensor it is the lowest rank to hold.
inline std::vector<const flat_view*> views_to_write(std::span<const flat_view> views, const checkpoint_metadata& md,
                                                    int rank) {
  const std::string fname = rank_file_name(rank);
  std::vector<const flat_view*> out;
  for (const auto& v : views) {
    const tensor_metadata* tm = md.find(v.key);
    if (tm->is_sharded ? v.replica != replica_role::copy : tm->files.front().first == fname) out.push_back(&v);
  }
  return out;
}

/// Whether a save writes metadata.json in the compact form (metadata_form).
inline bool use_compact_form(const checkpoint_metadata& md, metadata_form form) {
  if (form != metadata_form::automatic) return form == metadata_form::compact;
  std::uint64_t entries = 0;
  for (const auto& [key, tm] : md.tensors) entries += tm.file_count();
  return entries > compact_metadata_entries;
}

/// A rank file written: its size, and (when asked) its checksum table (tensor -> block hashes).
struct written_rank_file {
  std::uint64_t size = 0;
  std::map<std::string, std::vector<std::uint64_t>> checksums;
};

/// Writes `views` as the safetensors file `fname` in dir (temporary name, synced, committed):
/// in aligned blocks where the writer is a BlockWritableStorage, else in chunks through write_at;
/// the writer is aborted when anything fails. With opt.checksums, each part written is hashed
/// right after it is produced (safetensors_checksummer).
template <WritableDirectory D>
written_rank_file write_rank_file(const D& dir, const std::string& fname, std::span<const flat_view* const> views,
                                  const save_options& opt) {
  std::vector<tensor_entry> entries;
  for (const flat_view* v : views) entries.push_back({v->key, v->type, shape_t{v->local_numel()}, 0, 0});
  auto w = dir.create(fname);
  written_rank_file out;
  abort_on_failure(w, [&] {  // a failed save leaves no temporary, no open upload
    auto layout = plan_safetensors(std::move(entries), {}, w.name());
    if constexpr (requires { w.reserve(std::uint64_t{}); }) w.reserve(layout.file_size());
    std::vector<const std::byte*> data(layout.tensors.size(), nullptr);
    std::vector<const flat_view*> by_index(layout.tensors.size(), nullptr);
    for (const flat_view* v : views) {
      const std::size_t i = layout.index_of(v->key);
      by_index[i] = v;
      data[i] = v->data;
    }
    // the bytes of views without memory (opt.fetch), by layout index
    auto fetch = [&](std::size_t i, std::uint64_t off, std::span<std::byte> dst) {
      if (!opt.fetch) no_fetch{}(i, off, dst);
      opt.fetch(*by_index[i], off, dst);
    };
    std::optional<safetensors_checksummer> sums;
    if (opt.checksums) sums.emplace(layout, data, opt.checksum_block_bytes);
    if constexpr (BlockWritableStorage<typename D::writer_type>) {
      // the whole file in aligned blocks: header and tensors gathered into each block
      block_write_options bo;
      bo.threads = opt.threads;
      bo.direct = opt.direct_io;
      bo.block_bytes = std::clamp<std::uint64_t>(opt.write_chunk_bytes, 1, std::uint64_t(16) << 20);
      w.write_blocks(layout.file_size(), [&](std::uint64_t off, std::span<std::byte> dst) {
        if (!sums) return render_safetensors_bytes(layout, data, off, dst, fetch);
        // in steps of 1 MiB, each hashed (the blocks ending in it) while still in the cache
        constexpr std::uint64_t step = std::uint64_t(1) << 20;
        for (std::uint64_t p = 0; p < dst.size(); p += step) {
          const std::uint64_t n = std::min<std::uint64_t>(step, dst.size() - p);
          render_safetensors_bytes(layout, data, off + p, dst.subspan(static_cast<std::size_t>(p), static_cast<std::size_t>(n)), fetch);
          sums->hash_range(off + p, off + p + n, dst.first(static_cast<std::size_t>(p + n)), off, fetch);
        }
      }, bo);
      w.sync();
      w.commit();
    } else {
      safetensors_writer<typename D::writer_type> sw(w, layout);
      struct piece {
        std::size_t index;
        std::uint64_t offset, len;
        const std::byte* src;  // null: fetched
      };
      std::vector<piece> pieces;
      const std::uint64_t chunk = std::max<std::uint64_t>(opt.write_chunk_bytes, 1);
      for (const flat_view* v : views) {
        const std::size_t idx = layout.index_of(v->key);
        if (v->nbytes == 0) pieces.push_back({idx, 0, 0, v->data});
        for (std::uint64_t off = 0; off < v->nbytes; off += chunk)
          pieces.push_back({idx, off, std::min(chunk, v->nbytes - off), v->data ? v->data + off : nullptr});
      }
      parallel_for(pieces.size(), opt.threads, [&](std::size_t i) {
        const piece& p = pieces[i];
        std::vector<std::byte> fetched;  // a chunk of a view without memory
        std::span<const std::byte> bytes(p.src, static_cast<std::size_t>(p.len));
        if (!p.src && p.len) {
          fetched.resize(static_cast<std::size_t>(p.len));
          fetch(p.index, p.offset, std::span<std::byte>(fetched));
          bytes = fetched;
        }
        sw.write_part(p.index, p.offset, bytes);
        if (sums) {
          const std::uint64_t at = layout.data_start() + layout.tensors[p.index].begin + p.offset;
          sums->hash_range(at, at + p.len, bytes, at, fetch);
        }
      });
      sw.finish();
    }
    out.size = layout.file_size();
    if (sums) out.checksums = sums->table();
  });
  return out;
}

/// What a rank sends after writing its file: its size on the first line, then (with
/// checksums sent) its checksum table as JSON (format/metadata.hpp).
inline std::string encode_written(const written_rank_file& w, bool checksums) {
  std::string t = std::to_string(w.size) + "\n";
  if (checksums) append_checksum_table(t, w.checksums);
  return t;
}

/// Step 3: every rank writes rank_R.safetensors; returns every rank's file (size and
/// checksums), by rank. sidecars: each rank writes its checksum table beside its file
/// (checksum_sidecar_name) and sends only the size.
template <WritableDirectory D, Comm C>
std::vector<written_rank_file> write_rank_files(const D& dir, std::span<const flat_view* const> mine, C& comm,
                                                const save_options& opt, bool sidecars = false) {
  const std::string fname = rank_file_name(comm.rank());
  const step_scope step("writing the rank files");
  const bool send_sums = opt.checksums && !sidecars;
  const auto texts = every_rank_step(comm, [&] {
    const written_rank_file w = write_rank_file(dir, fname, mine, opt);
    if (opt.checksums && sidecars) {
      std::string table;
      append_checksum_table(table, w.checksums);
      write_text(dir, checksum_sidecar_name(fname), table);
    }
    return encode_written(w, send_sums);
  });
  std::vector<written_rank_file> files;
  for (std::size_t r = 0; r < texts.size(); ++r) {
    const std::string from = std::string(dir.name()) + " (rank " + std::to_string(r) + "'s file)";
    const std::string_view t = texts[r];
    const auto nl = t.find('\n');
    written_rank_file w;
    if (nl == std::string_view::npos || std::from_chars(t.data(), t.data() + nl, w.size).ptr != t.data() + nl)
      fail(errc::comm_error, from + ": the size received is malformed");
    if (send_sums) {
      json_document doc(t.substr(nl + 1), from);
      w.checksums = parse_checksum_table(doc.root("the checksums received are not an object"), from + ": checksums");
      doc.require_unique_keys();
    }
    files.push_back(std::move(w));
  }
  return files;
}

/// Step 4, on rank 0, once every rank file is written: metadata.json, by rename (the commit mark).
template <WritableDirectory D, Comm C>
void commit_metadata(const D& dir, const checkpoint_metadata& md, C& comm) {
  const step_scope step("committing metadata.json");
  rank0_step(comm, [&] {
    write_text(dir, metadata_file_name, write_checkpoint_metadata(md));
  });
}

/// Steps 2-4 of a save whose plan (step 1, md) every rank has agreed on: prepare the
/// directory, write the rank files, commit metadata.json. t0: when the save began. The
/// asynchronous save (checkpoint/async_save.hpp) runs this on its background thread.
template <WritableDirectory D, Comm C>
save_stats write_and_commit(const D& dir, std::span<const flat_view> views, checkpoint_metadata md, C& comm,
                            const save_options& opt, std::chrono::steady_clock::time_point t0) {
  const int rank = comm.rank(), world = comm.world_size();
  const bool compact = use_compact_form(md, opt.metadata);  // alike on every rank: md is agreed
  prepare_directory(dir, opt.overwrite, comm);                                                // 2
  const auto mine = views_to_write(views, md, rank);
  auto written = write_rank_files(dir, std::span<const flat_view* const>(mine), comm, opt, compact);  // 3

  save_stats st;
  st.tensors_written = mine.size();
  st.bytes_written = written[static_cast<std::size_t>(rank)].size;
  md.extras.writer = "shardsafe " + std::string(library_version);
  md.extras.world_size = static_cast<std::uint64_t>(world);
  if (opt.checksums) {
    md.extras.checksums.emplace();
    md.extras.checksums->block_bytes = opt.checksum_block_bytes;
    md.extras.checksums->sidecars = compact;
  }
  for (int r = 0; r < world; ++r) {
    auto& w = written[static_cast<std::size_t>(r)];
    md.extras.file_sizes[rank_file_name(r)] = w.size;
    st.total_bytes += w.size;
    if (opt.checksums && !compact) md.extras.checksums->files.emplace(rank_file_name(r), std::move(w.checksums));
  }
  if (compact)
    for (auto& [key, tm] : md.tensors)
      if (auto g = detect_grid(tm)) {
        tm.grid = std::move(g);
        tm.files.clear();
      }
  commit_metadata(dir, md, comm);  // 4
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace detail

struct dcp_object;
/// Saves views as a torch DCP folder (defined in checkpoint/dcp_save.hpp, included below).
template <WritableDirectory D, Comm C>
save_stats save_dcp(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt,
                    std::span<const dcp_object> objects, const std::map<std::string, pickle_value>& paths);

/// One folder of a multi-folder save (save_folder_set): its name under the parent and this
/// rank's views of it.
struct folder_views {
  std::string name;
  std::span<const flat_view> views;
};

/// The folders of a model + optimizer pair (docs/FORMAT.md §2) in their commit order: optim/
/// (when with_optim), then model/, whose metadata.json is the pair's commit mark.
inline std::vector<folder_views> model_and_optim_folders(std::span<const flat_view> model,
                                                         std::span<const flat_view> optim, bool with_optim) {
  std::vector<folder_views> f;
  if (with_optim) f.push_back({std::string(optim_folder_name), optim});
  f.push_back({std::string(model_folder_name), model});
  return f;
}

/// Saves every rank's views into dir as one checkpoint, in opt.format's layout. A collective:
/// every rank calls it.
template <WritableDirectory D, Comm C>
save_stats save_flat_views(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt = {}) {
  if (opt.format == save_format::dcp) return save_dcp(dir, views, comm, opt, {}, {});
  const step_scope scope("save " + std::string(dir.name()));
  const auto t0 = std::chrono::steady_clock::now();
  checkpoint_metadata md = detail::agree_on_metadata(views, comm, std::string(dir.name()), bool(opt.fetch));  // 1
  return detail::write_and_commit(dir, views, std::move(md), comm, opt, t0);                 // 2-4
}

/// Saves several folders under `parent` as one checkpoint (a model + optimizer pair:
/// model_and_optim_folders), each as save_flat_views does, in the order given: the last
/// folder's commit mark is the commit mark of them all, so a save killed at any point leaves a
/// parent that does not load as complete. The parent is prepared first (prepare_folder_set:
/// refused when not empty unless opt.overwrite). A collective; the stats in folder order. The
/// asynchronous counterpart is async_saver::save_folder_set (checkpoint/async_save.hpp).
template <WritableDirectory D, Comm C>
std::vector<save_stats> save_folder_set(const D& parent, std::span<const folder_views> folders, C& comm,
                                        const save_options& opt = {}) {
  if (folders.empty()) fail(errc::invalid_argument, std::string(parent.name()) + ": a folder set to save has no folder");
  detail::prepare_folder_set(parent, folders.back().name, opt.overwrite, comm);
  save_options each = opt;
  each.overwrite = false;  // (the parent is prepared as a whole)
  std::vector<save_stats> st;
  for (const folder_views& f : folders) st.push_back(save_flat_views(parent.sub(f.name), f.views, comm, each));
  return st;
}

}  // namespace shardsafe

// the DCP layout's writer, which builds on the steps above (as Asio includes its impl/ headers)
#include "shardsafe/checkpoint/dcp_save.hpp"

// the saves most programs make (local folders or memory; one process, or ranks as threads),
// compiled once in separate compilation (core/config.hpp)
#if defined(SHARDSAFE_SEPARATE_COMPILATION)
#include "shardsafe/dist/single.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
namespace shardsafe {
SHARDSAFE_EXTERN_TEMPLATE(save_stats save_flat_views(const file_directory&, std::span<const flat_view>, single_process&, const save_options&))
SHARDSAFE_EXTERN_TEMPLATE(save_stats save_flat_views(const file_directory&, std::span<const flat_view>, thread_comm&, const save_options&))
SHARDSAFE_EXTERN_TEMPLATE(save_stats save_flat_views(const memory_directory&, std::span<const flat_view>, single_process&, const save_options&))
SHARDSAFE_EXTERN_TEMPLATE(save_stats save_flat_views(const memory_directory&, std::span<const flat_view>, thread_comm&, const save_options&))
}  // namespace shardsafe
#endif
