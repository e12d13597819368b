// shardsafe/checkpoint/load_plan.hpp - what a load will do, planned before any tensor byte
// moves: the planner (its settings and results: checkpoint/load_options.hpp).
//
// The planner is pure: it reads a checkpoint's description (checkpoint_metadata) and the
// headers of the files it names, never storage, so it is tested and benchmarked without any
// (tests/checkpoint/test_sources.cpp, bench/bench_scale.cpp). It runs in two steps around the opening of
// files, which is the reader's (checkpoint/reader.hpp):
// 1. plan_views: each view checked against the description (shape, dtype, coverage) and
//    resolved against every file's shard (shard/copy_plan.hpp's plan_load: each element from
//    exactly one file, gaps reported as missing coverage); a grid tensor (the compact form) is
//    resolved by division, keeping only the parts it reads. It says which files are needed.
// 2. schedule_reads: with those files' headers, the copy runs become reads of byte ranges
//    (shard/read_plan.hpp's make_read_plan): a load_schedule listing, per file, each read and
//    the copies out of it, and the reads that compare replicas.
//
// No loaded value depends on an arbitrary choice: where several files hold the same elements
// of a tensor (replicas saved by each holder, or a damaged or hostile checkpoint), the plan
// takes each element from one file and also reads it from the others (load_schedule::compares);
// identical shards whose recorded checksums are equal were written with the same bytes and are
// not read twice.
//
// The load's settings and results: checkpoint/load_options.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_options.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/detail/nan.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/overlap.hpp"
#include "shardsafe/shard/read_plan.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// What a load will do, made by checkpoint_reader::plan() before any tensor byte moves:
/// which files, which byte ranges of each, and which copies out of each range.
struct load_schedule {
  /// One read of a file: bytes [op.file_offset, op.file_offset + op.len); op.pieces are the
  /// copies out of it into view `view` (pieces[i].dst: a byte offset in that view's memory).
  struct file_read {
    std::size_t view = 0;  ///< index into the views handed to plan()
    read_op op;
  };
  /// The reads of one file, sorted by file offset.
  struct file_reads {
    std::string name;       ///< the file, as metadata.json names it
    read_options settings;  ///< the merging settings its reads were planned with
    std::vector<file_read> reads;
  };
  std::vector<file_reads> files;  ///< in the order the views first need them
  /// Reads of elements that several files hold (replicas, or a damaged or hostile checkpoint)
  /// from the files the load did not take them from: after the load, each piece's bytes must
  /// equal what landed in the view (so no element's value depends on which file the plan
  /// picked). (index into files, read). Replicas whose recorded checksums are equal need none.
  std::vector<std::pair<std::size_t, file_read>> compares;
  std::vector<std::size_t> nan_checked;  ///< views execute() fills with NaN and checks afterwards
  /// The stored dtype of each view's data, where it differs from the view's (converted while
  /// copying; read pieces then count bytes as stored); empty when nothing is converted.
  std::vector<std::pair<std::size_t, dtype>> converted;
  std::size_t views = 0;          ///< how many views plan() was given
  unsigned threads = 1;           ///< reads in flight
  read_settings hint;             ///< the storage's read hint (its first file's) the plan took
  bool verify_checksums = false;  ///< check the blocks read (load_options::verify_checksums)
  load_stats stats;               ///< all but seconds, known from the plan
};

/// Staging memory one batch of reads may hold for merged reads (a batch is split past it;
/// checkpoint/read_executor.hpp), and so the most a compared read spans.
inline constexpr std::uint64_t batch_staging_bytes = std::uint64_t(64) << 20;

/// Step 1's result: each view resolved against its tensor's files, and the files needed.
struct view_plans {
  struct one {
    std::size_t view = 0;
    const tensor_metadata* tm = nullptr;
    load_plan lp;
    std::vector<std::size_t> compare;  ///< files (indices into files()) whose shared elements are compared
    std::vector<std::pair<std::string, shard_spec>> grid_parts;  ///< a grid's parts the view reads
    /// The tensor's files lp and compare index: its listed files, or a grid's parts kept.
    const std::vector<std::pair<std::string, shard_spec>>& files() const { return tm->grid ? grid_parts : tm->files; }
  };
  std::vector<one> views;          ///< the views found in the checkpoint, in the order given
  std::vector<std::string> files;  ///< file names, in the order first needed
  std::map<std::string, std::size_t, std::less<>> file_index;  ///< name -> index in files
  load_schedule partial;  ///< views, nan_checked, converted, stats.tensors / missing / unexpected
};

/// A file step 2 reads: its validated header, its name in messages (its storage's) and the
/// read settings for its backend (resolve_read_options).
struct planned_file {
  const safetensors_header* header = nullptr;
  std::string_view name;
  read_options settings;
};

namespace detail {

/// The entry of `key` in a file's header (named `file` in messages), checked against the
/// description (described_by: "metadata.json", ...) and the file's shard.
SHARDSAFE_DECL const tensor_entry& checked_entry(const safetensors_header& h, std::string_view file,
                                                 const std::string& key, const tensor_metadata& tm,
                                                 const shard_spec& spec, std::string_view described_by);

/// The runs out of file `file`'s chunk `fspec` of tensor `key`, whose bytes hold its dimensions
/// in `order` (a DCP chunk torch.save kept channels_last or transposed): every element of
/// `mine` the chunk holds, which must be the `planned` elements plan_load took from it (a chunk
/// sharing elements with another file's is refused: its elements are not read in part).
SHARDSAFE_DECL copy_plan permuted_runs(std::string_view file, const std::string& key, const shard_spec& mine,
                                       const shard_spec& fspec, std::span<const std::size_t> order,
                                       std::span<const std::uint64_t> full, std::uint64_t planned);

/// The files of tm whose elements a load of `mine` (planned as lp) must compare
/// (load_schedule::compares): where files overlap (the shards hold more elements than the
/// tensor), each file that shares elements with another and holds elements of mine that the
/// plan took from another file. (A file the plan took all its elements of mine from holds
/// the loaded bytes; every other holder of those elements is compared with them.) A pair of
/// identical shards whose recorded checksums (cs, may be null) are equal needs no comparing.
SHARDSAFE_DECL std::vector<std::size_t> files_to_compare(const std::string& key, const tensor_metadata& tm,
                                                         const shard_spec& mine, const load_plan& lp,
                                                         const checkpoint_checksums* cs);

}  // namespace detail

/// Step 1: checks every view against the checkpoint described by md (find: a tensor by key,
/// nullptr when absent; where: the folder, for messages) and resolves it against the files
/// holding its tensor. memory_later: the views may have no memory yet (a plan made for
/// describing, executed with other views: checkpoint/staged_load.hpp). Throws on the first
/// problem, naming tensor and rule.
namespace detail {
/// Refuses (errc::dtype_mismatch) a view whose dtype is not load_options::view_dtype, when set.
inline void require_view_dtype(const flat_view& v, const load_options& opt, std::string_view where) {
  if (opt.view_dtype && v.type != *opt.view_dtype)
    fail(errc::dtype_mismatch, std::string(where) + ": tensor '" + v.key + "': the view has dtype " +
                                   std::string(to_string(v.type)) + " but this loader's policy takes only " +
                                   std::string(to_string(*opt.view_dtype)) + " views (load_options::view_dtype)");
}
}  // namespace detail

SHARDSAFE_DECL view_plans plan_views(const checkpoint_metadata& md,
                                     const std::function<const tensor_metadata*(std::string_view)>& find,
                                     std::span<const flat_view> views, const load_options& opt, std::string_view where,
                                     bool memory_later = false);

/// Step 2: the reads of every view planned in vp, out of the files vp.files names (files[i]:
/// vp.files[i]'s header, name and settings; described_by: for messages). threads: the reads
/// in flight the schedule records.
SHARDSAFE_DECL load_schedule schedule_reads(view_plans vp, std::span<const flat_view> views,
                                            std::span<const planned_file> files, const load_options& opt,
                                            unsigned threads, std::string_view described_by);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/load_plan.ipp"
#endif
