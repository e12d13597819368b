// shardsafe/checkpoint/loader.hpp - load a sharded checkpoint into caller memory, in place,
// under any sharding.
//
// A load is planned, then executed. plan() checks each flat view against the checkpoint
// (shape, dtype, coverage), opens the rank files it needs (all at once, each in one round
// trip: open, then one speculative read of the header), resolves my shard against every
// file's shard (plan_load: each element from exactly one file, gaps reported as missing
// coverage) and turns the copy runs into reads of byte ranges (make_read_plan): a
// load_schedule that lists, per file, each read and the copies out of it. execute() runs
// the schedule on the shared thread pool (detail/thread_pool.hpp):
// - a MappableStorage (mmap, memory) is copied from straight out of bytes(): no read call,
//   no staging buffer, and the gaps of a merged read are never touched;
// - a BatchReadableStorage gets each file's reads as one read_batch (split only to bound the
//   staging memory of merged reads);
// - any other ReadableStorage gets one read_into per read.
// A read with one piece lands straight in the view's memory; a merged read lands in a bounded
// staging buffer that is scattered at once. With load_options::convert_dtypes, a floating
// tensor stored as another floating dtype (an HF file's BF16 into F32 parameters) is
// converted as its pieces are scattered: its reads always go through staging. Nothing the
// size of a tensor or a file is allocated.
//
// No loaded value depends on an arbitrary choice: where several files hold the same elements
// of a tensor (replicas saved by each holder, or a damaged or hostile checkpoint), the plan
// takes each element from one file and also reads it from the others, and execute() refuses
// the load if the bytes differ (load_schedule::compares); identical shards whose recorded
// checksums are equal were written with the same bytes and are not read twice. With
// load_options::verify_checksums, every checksum block the reads touch is checked
// (checkpoint/checksums.hpp).
//
// The checkpoint may be any layout checkpoint/source.hpp reads (a sharded checkpoint, a
// Hugging Face folder, a torch DCP folder, torch's sharded HF files): each is a list of tensors
// with the shard each file holds, and everything below is the same for all of them (a DCP data
// file's index is made from its archives' zip headers when it is opened: format/dcp_data.hpp).
//
// Read settings, each taken from the first place that sets it: load_options (reads.*,
// threads), then the backend's hint (read_defaults(), storage/concepts.hpp), then the
// library's defaults (read_options in shard/read_plan.hpp, detail::default_threads()).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "shardsafe/checkpoint/checksums.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/detail/copy.hpp"
#include "shardsafe/detail/nan.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/format/dcp_data.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/overlap.hpp"
#include "shardsafe/shard/read_plan.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Read settings a load may set; each one left empty comes from the backend's hint
/// (read_defaults()) or else from read_options' defaults.
struct read_overrides {
  std::optional<std::uint64_t> max_gap_bytes;   ///< merge reads separated by at most this
  std::optional<double> max_over_read;          ///< wasted bytes / needed bytes, per read
  std::optional<std::uint64_t> max_read_bytes;  ///< split reads longer than this
};

struct load_options {
  unsigned threads = 0;         ///< reads in flight; 0: the backend's hint, else detail::default_threads()
  read_overrides reads{};       ///< gap merging and read sizes (unset: the backend's, else the defaults)
  bool strict = true;           ///< a view whose key the checkpoint lacks is an error (else listed)
  bool validate_nan = false;    ///< fill floating views with NaN first, fail if any remain (OLMo-core's check)
  /// Load a floating tensor stored as another floating dtype (F16, BF16, F32, F64), converting
  /// each element while copying, rounded to nearest even (core/convert.hpp); converted reads
  /// go through a staging buffer of at most one read (reads.max_read_bytes), never a
  /// tensor-sized one. Off: a dtype that differs is errc::dtype_mismatch.
  bool convert_dtypes = false;
  /// Check the bytes the load reads against the checksums metadata.json records (docs/FORMAT.md
  /// §2, "Checksums"): every checksum block a read touches is hashed, from the tensor's memory
  /// where one read landed the whole block there, else read again, and a mismatch is
  /// errc::checksum_mismatch naming file, tensor and element range. A checkpoint without
  /// checksums (saved before them, or by another writer) loads unchecked: load_stats says
  /// how many blocks were checked.
  bool verify_checksums = false;
  /// Loads into memory the reader cannot write itself (GPU tensors) go through a ring of this
  /// many host buffers (pinned for a GPU) of this size: host memory stays at slots x
  /// slot_bytes whatever the model's size (checkpoint/staged_load.hpp).
  struct staging_ring {
    std::size_t slots = 4;
    std::uint64_t slot_bytes = std::uint64_t(64) << 20;
  } staging{};
  /// With convert_dtypes, a GPU tensor stored as another floating dtype is loaded as stored and
  /// converted on the GPU (torch/state_dict.hpp; bench/bench_device measures both); false:
  /// converted on the host as the bytes land in the staging ring.
  bool convert_on_device = true;
};

/// The read settings a load uses with a storage whose hint is `hint`: load_options first,
/// then the hint, then read_options' defaults.
inline read_options resolve_read_options(const read_overrides& o, const read_hints& hint) {
  read_options r;
  if (hint.max_gap_bytes) r.max_gap_bytes = *hint.max_gap_bytes;
  if (hint.max_read_bytes) r.max_read_bytes = *hint.max_read_bytes;
  if (o.max_gap_bytes) r.max_gap_bytes = *o.max_gap_bytes;
  if (o.max_over_read) r.max_over_read = *o.max_over_read;
  if (o.max_read_bytes) r.max_read_bytes = *o.max_read_bytes;
  return r;
}

/// The reads in flight a load uses: load_options.threads, then the hint, then the default.
inline unsigned resolve_threads(unsigned threads, const read_hints& hint) {
  if (threads != 0) return threads;
  if (hint.requests_in_flight && *hint.requests_in_flight != 0) return *hint.requests_in_flight;
  return detail::default_threads();
}

struct load_stats {
  std::uint64_t tensors = 0;        ///< views loaded
  std::uint64_t bytes_needed = 0;   ///< bytes of stored data the views needed (as stored: before conversion)
  std::uint64_t bytes_read = 0;     ///< bytes read from files (needed + merged gaps)
  std::uint64_t read_ops = 0;       ///< reads issued
  std::uint64_t checksum_blocks = 0;  ///< checksum blocks checked (load_options::verify_checksums)
  std::vector<std::string> missing_keys;     ///< views the checkpoint lacks (strict = false)
  std::vector<std::string> unexpected_keys;  ///< checkpoint tensors no view asked for
  double seconds = 0;
};

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
    std::string name;        ///< the file, as metadata.json names it
    read_options settings;   ///< the merging settings its reads were planned with
    std::vector<file_read> reads;
  };
  std::vector<file_reads> files;         ///< in the order the views first need them
  /// Reads of elements that several files hold (replicas, or a damaged or hostile checkpoint)
  /// from the files the load did not take them from: after the load, each piece's bytes must
  /// equal what landed in the view (so no element's value depends on which file the plan
  /// picked). (index into files, read). Replicas whose recorded checksums are equal need none.
  std::vector<std::pair<std::size_t, file_read>> compares;
  std::vector<std::size_t> nan_checked;  ///< views execute() fills with NaN and checks afterwards
  /// The stored dtype of each view's data, where it differs from the view's (converted while
  /// copying; read pieces then count bytes as stored); empty when nothing is converted.
  std::vector<std::pair<std::size_t, dtype>> converted;
  std::size_t views = 0;                 ///< how many views plan() was given
  unsigned threads = 1;                  ///< reads in flight
  bool verify_checksums = false;         ///< check the blocks read (load_options::verify_checksums)
  load_stats stats;                      ///< all but seconds, known from the plan
};

/// A checkpoint directory opened for reading: its description validated (metadata.json, an
/// HF folder's index and headers, or torch's DCP_SHARDING_INFO: checkpoint/source.hpp), rank
/// files opened (and their headers validated) on first use and kept open.
template <ReadableDirectory D>
class checkpoint_reader {
 public:
  using reader_type = typename D::reader_type;

  /// Opens the checkpoint in dir, whichever layout it has (checkpoint/source.hpp).
  explicit checkpoint_reader(D dir) : dir_(std::move(dir)) { adopt(open_checkpoint_source(dir_)); }
  /// Reads a checkpoint described by src (made by open_checkpoint_source or by the caller).
  checkpoint_reader(D dir, checkpoint_source<D> src) : dir_(std::move(dir)) { adopt(std::move(src)); }

  const D& directory() const noexcept { return dir_; }
  const checkpoint_metadata& metadata() const noexcept { return md_; }
  /// Which layout the checkpoint has.
  checkpoint_format format() const noexcept { return format_; }
  /// What holds the description ("metadata.json", "model.safetensors.index.json", ...).
  const std::string& described_by() const noexcept { return described_by_; }
  /// The file a name of metadata().tensors[...].files is in: itself, or for a DCP data file's
  /// second chunk of a key (`FILE#1`, checkpoint/source.hpp) the file it names.
  const std::string& path_of(const std::string& name) const {
    const auto it = data_files_.find(name);
    return it == data_files_.end() ? name : it->second.path;
  }
  /// Items of the checkpoint that are not tensors (a DCP folder's non-tensor values), by key.
  const std::vector<non_tensor_item>& non_tensors() const noexcept { return non_tensors_; }
  /// Where `key` sits in the nested state dict a DCP folder was flattened from (its planner_data:
  /// ('model', 'layers.0.weight')), or nullptr when the checkpoint does not say.
  const pickle_value* path_in_state_dict(const std::string& key) const {
    auto it = paths_.find(key);
    return it == paths_.end() ? nullptr : &it->second;
  }
  /// The item `key` of non_tensors(), or nullptr.
  const non_tensor_item* find_object(std::string_view key) const {
    auto it = std::lower_bound(non_tensors_.begin(), non_tensors_.end(), key,
                               [](const non_tensor_item& i, std::string_view k) { return i.key < k; });
    return it != non_tensors_.end() && it->key == key ? &*it : nullptr;
  }
  /// The value of the non-tensor item `key` (a DCP folder's: format/dcp_data.hpp's
  /// read_dcp_object), read from its data file; errc::not_found when there is none.
  pickle_value read_object(std::string_view key) const {
    const non_tensor_item* it = find_object(key);
    if (!it)
      fail(errc::not_found, std::string(dir_.name()) + ": '" + std::string(key) + "' is not a non-tensor item of " + described_by_);
    reader_type s = open_or(it->file, [&] {
      return std::string(dir_.name()) + "/" + it->file + ": missing: " + described_by_ + " lists it but it does not exist";
    });
    return read_dcp_object(s, dcp_storage_info{it->file, it->offset, it->bytes}, "'" + it->key + "'");
  }
  const tensor_metadata* find(std::string_view key) const {
    auto it = index_.find(std::string(key));
    return it == index_.end() ? nullptr : &md_.tensors[it->second].second;
  }

  /// An opened rank file: its storage and validated header.
  using open_file = opened_file<reader_type>;
  /// Opens (once) a file the metadata names.
  const open_file& file(const std::string& name) {
    open_files(std::span<const std::string>(&name, 1));
    std::lock_guard lock(files_mutex_);
    return *files_.at(name);
  }
  /// Opens (once) every file named, those not open yet all at once, on up to `threads`
  /// threads (0: the default). The first failure is thrown once all attempts have returned.
  void open_files(std::span<const std::string> names, unsigned threads = 0) {
    std::vector<std::string> todo;
    {
      std::set<std::string_view> queued;
      std::lock_guard lock(files_mutex_);
      for (const auto& n : names)
        if (!files_.count(n) && queued.insert(n).second) todo.push_back(n);
    }
    std::vector<std::unique_ptr<open_file>> opened(todo.size());
    detail::parallel_for(todo.size(), threads, [&](std::size_t i) { opened[i] = open_one(todo[i]); });
    std::lock_guard lock(files_mutex_);
    for (std::size_t i = 0; i < todo.size(); ++i) files_.try_emplace(todo[i], std::move(opened[i]));
  }

  /// The recorded checksums (nullptr: none): metadata.json's, with the tables of the files
  /// `names` read from their sidecars first (once) when the checkpoint keeps them there
  /// (checkpoint_checksums::sidecars, the compact form's), on up to `threads` threads.
  const checkpoint_checksums* checksums_for(std::span<const std::string> names, unsigned threads = 0) {
    if (!md_.extras.checksums) return nullptr;
    checkpoint_checksums& cs = *md_.extras.checksums;
    if (!cs.sidecars) return &cs;
    std::vector<std::string> todo;
    {
      std::lock_guard lock(files_mutex_);
      std::set<std::string_view> queued;
      for (const auto& n : names)
        if (!cs.files.count(n) && queued.insert(n).second) todo.push_back(n);
    }
    using table = std::map<std::string, std::vector<std::uint64_t>>;
    std::vector<table> got(todo.size());
    detail::parallel_for(todo.size(), threads, [&](std::size_t i) {
      const std::string side = checksum_sidecar_name(todo[i]);
      reader_type st = open_or(side, [&] {
        return std::string(dir_.name()) + "/" + side + ": missing: " + described_by_ +
               " says the checksums of " + todo[i] + " are kept beside it, in this file";
      });
      const std::string text = read_text(st, max_metadata_size, text_kind::json);
      detail::json_document doc(text, std::string(st.name()), &text);
      got[i] = detail::parse_checksum_table(doc.root("not an object of tensors"), std::string(st.name()));
      doc.require_unique_keys();
    });
    std::lock_guard lock(files_mutex_);
    for (std::size_t i = 0; i < todo.size(); ++i) cs.files.try_emplace(todo[i], std::move(got[i]));
    return &cs;
  }

  /// The entry of `key` in file `name`, checked against the metadata and the file's shard.
  const tensor_entry& entry_in(const open_file& f, const std::string& key, const tensor_metadata& tm,
                               const shard_spec& spec) const {
    const std::string ctx = std::string(f.storage.name()) + ": tensor '" + key + "'";
    const tensor_entry* e = f.header.find(key);
    if (!e) fail(errc::not_found, ctx + ": listed in " + described_by_ + " but absent from the file");
    if (e->type != tm.type)
      fail(errc::dtype_mismatch, ctx + ": file has dtype " + std::string(name(e->type)) + ", " + described_by_ +
                                     " says " + std::string(name(tm.type)));
    if (e->numel() != spec.local_numel())
      fail(errc::shape_mismatch, ctx + ": file holds " + std::to_string(e->numel()) + " elements (shape " +
                                     to_string(e->shape) + ") but its shard spec (" + to_string(spec) + ") holds " +
                                     std::to_string(spec.local_numel()));
    return *e;
  }

  /// Plans loading every view: checks each against the checkpoint, opens the files needed
  /// and computes the reads. Touches no view's memory. Throws on the first problem, naming
  /// file, tensor and rule.
  load_schedule plan(std::span<const flat_view> views, const load_options& opt = {}) {
    load_schedule s;
    s.views = views.size();
    std::map<std::string_view, bool> asked;
    struct planned {
      std::size_t view;
      const tensor_metadata* tm;
      load_plan lp;
      std::vector<std::size_t> compare;  // files (indices into list()) whose shared elements are compared
      std::vector<std::pair<std::string, shard_spec>> grid_files;  // a grid's parts that meet the view
      const std::vector<std::pair<std::string, shard_spec>>& list() const { return tm->grid ? grid_files : tm->files; }
    };
    std::vector<planned> todo;
    std::vector<std::string> needed;  // file names, in the order first needed
    std::map<std::string, std::size_t> file_index;

    for (std::size_t vi = 0; vi < views.size(); ++vi) {
      const flat_view& v = views[vi];
      const std::string ctx = std::string(dir_.name()) + ": tensor '" + v.key + "'";
      v.validate(dir_.name());
      asked[v.key] = true;
      const tensor_metadata* tm = find(v.key);
      if (!tm) {
        if (opt.strict) fail(errc::not_found, ctx + ": not in the checkpoint");
        s.stats.missing_keys.push_back(v.key);
        continue;
      }
      if (tm->shape != v.full_shape)
        fail(errc::shape_mismatch, ctx + ": checkpoint has shape " + to_string(tm->shape) + ", the tensor to load has " +
                                       to_string(v.full_shape));
      if (tm->type != v.type) {
        if (!opt.convert_dtypes || !is_convertible_float(tm->type) || !is_convertible_float(v.type))
          fail(errc::dtype_mismatch, ctx + ": checkpoint has dtype " + std::string(name(tm->type)) +
                                         ", the tensor to load has " + std::string(name(v.type)) +
                                         (opt.convert_dtypes ? " (only F16, BF16, F32 and F64 convert)"
                                                             : " (load_options::convert_dtypes is off)"));
        s.converted.emplace_back(vi, tm->type);
      }
      const shard_spec mine = v.effective_spec();
      planned p{vi, tm, {}, {}, {}};
      if (tm->grid) p.grid_files = tm->overlapping_files(mine);  // by division, not a walk of every file
      const auto& list = p.list();
      std::vector<shard_spec> specs;
      specs.reserve(list.size());
      for (const auto& f : list) specs.push_back(f.second);
      p.lp = plan_load(mine, std::span<const shard_spec>(specs), tm->shape);
      if (tm->grid) {  // keep only the parts it reads from (the rest met the bounding box only)
        std::vector<std::pair<std::string, shard_spec>> kept;
        kept.reserve(p.lp.files.size());
        for (auto& fp : p.lp.files) {
          kept.push_back(std::move(p.grid_files[fp.file]));
          fp.file = kept.size() - 1;
        }
        p.grid_files = std::move(kept);
      }
      const load_plan& lp = p.lp;
      if (!lp.missing.empty()) {
        const element_range m = lp.missing.front();
        auto g = global_index_of(mine, tm->shape, m.begin);
        std::uint64_t total = 0;
        for (const auto& r : lp.missing) total += r.size();
        fail(errc::missing_coverage,
             ctx + ": " + std::to_string(total) + " of this shard's " + std::to_string(mine.local_numel()) +
                 " elements are in no file; the first gap is local elements " + to_string(m) +
                 (g ? " (global element " + std::to_string(*g) + ", index " + multi_index_string(tm->shape, *g) + ")"
                    : std::string()));
      }
      ++s.stats.tensors;
      if (opt.validate_nan && has_nan(v.type)) s.nan_checked.push_back(vi);
      for (const auto& fp : lp.files) {
        const std::string& fname = list[fp.file].first;
        if (file_index.emplace(fname, needed.size()).second) needed.push_back(fname);
      }
      if (!tm->grid) p.compare = files_to_compare(v.key, *tm, mine, lp);  // a grid's parts never overlap
      for (const std::size_t j : p.compare)
        if (file_index.emplace(list[j].first, needed.size()).second) needed.push_back(list[j].first);
      todo.push_back(std::move(p));
    }
    for (const auto& [k, t] : md_.tensors)
      if (!asked.count(k)) s.stats.unexpected_keys.push_back(k);

    open_files(needed, opt.threads);
    std::vector<const open_file*> files;
    {
      std::lock_guard lock(files_mutex_);
      for (const auto& n : needed) files.push_back(files_.at(n).get());
    }
    read_hints hint;
    if (!files.empty()) hint = read_defaults_of(files.front()->storage);
    s.threads = resolve_threads(opt.threads, hint);
    s.verify_checksums = opt.verify_checksums;
    if (opt.verify_checksums && md_.extras.checksums) {
      detail::require_known_checksums(*md_.extras.checksums, std::string(dir_.name()) + "/" + described_by_);
      checksums_for(needed, opt.threads);
    }
    s.files.resize(needed.size());
    for (std::size_t i = 0; i < needed.size(); ++i) {
      s.files[i].name = needed[i];
      s.files[i].settings = resolve_read_options(opt.reads, read_defaults_of(files[i]->storage));
    }
    for (auto& p : todo) {
      const flat_view& v = views[p.view];
      // stored elements: a converted view's pieces count bytes as stored, and its reads are
      // cut at whole elements
      const std::uint64_t item = item_size(p.tm->type);
      const bool convert = p.tm->type != v.type;
      for (auto& fp : p.lp.files) {
        const auto& [fname, fspec] = p.list()[fp.file];
        const std::size_t fi = file_index.at(fname);
        const open_file& f = *files[fi];
        const tensor_entry& e = entry_in(f, v.key, *p.tm, fspec);
        read_options ro = s.files[fi].settings;
        if (convert) ro.max_read_bytes = std::max(item, ro.max_read_bytes / item * item);
        read_plan rp = make_read_plan(fp.runs, f.header.offset_of(e), item, ro);
        s.stats.bytes_needed += rp.bytes_needed;
        s.stats.bytes_read += rp.bytes_read;
        s.stats.read_ops += rp.ops.size();
        for (auto& op : rp.ops) s.files[fi].reads.push_back({p.view, std::move(op)});
      }
      const shard_spec mine = v.effective_spec();
      for (const std::size_t j : p.compare) {
        const auto& [fname, fspec] = p.list()[j];
        const std::size_t fi = file_index.at(fname);
        const open_file& f = *files[fi];
        const tensor_entry& e = entry_in(f, v.key, *p.tm, fspec);
        const load_plan lj = plan_load(mine, std::span<const shard_spec>(&fspec, 1), p.tm->shape);
        read_options ro = s.files[fi].settings;
        ro.max_read_bytes = std::max(item, std::min<std::uint64_t>(ro.max_read_bytes, batch_staging_bytes) / item * item);
        for (const auto& fp : lj.files) {
          read_plan rp = make_read_plan(fp.runs, f.header.offset_of(e), item, ro);
          s.stats.bytes_read += rp.bytes_read;
          s.stats.read_ops += rp.ops.size();
          for (auto& op : rp.ops) s.compares.push_back({fi, {p.view, std::move(op)}});
        }
      }
    }
    for (auto& f : s.files)
      std::stable_sort(f.reads.begin(), f.reads.end(),
                       [](const load_schedule::file_read& a, const load_schedule::file_read& b) {
                         return a.op.file_offset < b.op.file_offset;
                       });
    return s;
  }

  /// Runs a schedule that plan() made for these views (the same views, in the same order):
  /// the reads, the copies, and the NaN check. Throws on the first problem.
  load_stats execute(std::span<const flat_view> views, const load_schedule& s) {
    const auto t0 = std::chrono::steady_clock::now();
    if (views.size() != s.views)
      fail(errc::invalid_argument, std::string(dir_.name()) + ": a load schedule planned for " +
                                       std::to_string(s.views) + " views executed with " +
                                       std::to_string(views.size()));
    for (std::size_t vi : s.nan_checked) detail::fill_nan(views[vi].type, views[vi].bytes());
    std::vector<const open_file*> files;
    {
      std::lock_guard lock(files_mutex_);
      for (const auto& f : s.files) {
        auto it = files_.find(f.name);
        if (it == files_.end())
          fail(errc::invalid_argument, std::string(dir_.name()) + "/" + f.name +
                                           ": in the load schedule but not opened by this reader's plan()");
        files.push_back(it->second.get());
      }
    }
    std::vector<std::optional<dtype>> stored(views.size());
    for (const auto& [vi, t] : s.converted) {
      if (vi >= views.size()) fail(errc::invalid_argument, std::string(dir_.name()) + ": a load schedule converts a view it does not have");
      stored[vi] = t;
    }
    run_reads(views, s, files, stored);
    compare_replicas(views, s, files, stored);
    std::uint64_t checked = 0;
    if (s.verify_checksums && md_.extras.checksums) checked = check_blocks_read(views, s, files, stored);
    for (std::size_t vi : s.nan_checked) {
      const flat_view* v = &views[vi];
      const std::int64_t at = detail::first_nan(v->type, v->bytes());
      if (at >= 0) {
        auto g = global_index_of(v->effective_spec(), v->full_shape, static_cast<std::uint64_t>(at));
        fail(errc::missing_coverage, std::string(dir_.name()) + ": tensor '" + v->key +
                                         "': NaN after loading at local element " + std::to_string(at) +
                                         (g ? " (index " + multi_index_string(v->full_shape, *g) + ")" : std::string()) +
                                         ": not loaded, or NaN in the checkpoint");
      }
    }
    load_stats st = s.stats;
    st.checksum_blocks = checked;
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
  }

  /// Loads every view in place: plan(), then execute(). Throws on the first problem, naming
  /// file, tensor and rule.
  load_stats load(std::span<const flat_view> views, const load_options& opt = {}) {
    const auto t0 = std::chrono::steady_clock::now();
    const load_schedule s = plan(views, opt);
    load_stats st = execute(views, s);
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
  }

 private:
  /// Staging memory one read_batch may hold for merged reads (a batch is split past it).
  static constexpr std::uint64_t batch_staging_bytes = std::uint64_t(64) << 20;

  /// dir_.open(n), with not_found reported as `missing()` says (there is no exists() check
  /// first: the open is the check, in one round trip).
  template <class Message>
  reader_type open_or(std::string_view n, Message&& missing) const {
    try {
      return dir_.open(n);
    } catch (const error& e) {
      if (e.code() == errc::not_found) fail(errc::not_found, missing());
      throw;
    }
  }

  void adopt(checkpoint_source<D> src) {
    format_ = src.format;
    described_by_ = std::move(src.described_by);
    md_ = std::move(src.metadata);
    for (auto& [n, f] : src.files) files_.try_emplace(n, std::move(f));
    data_files_ = std::move(src.data_files);
    non_tensors_ = std::move(src.non_tensors);
    paths_ = std::move(src.paths);
    for (std::size_t i = 0; i < md_.tensors.size(); ++i) index_.emplace(md_.tensors[i].first, i);
  }

  std::unique_ptr<open_file> open_one(const std::string& name) const {
    const auto df = data_files_.find(name);
    const std::string& path = df == data_files_.end() ? name : df->second.path;
    reader_type s = open_or(path, [&] {
      return std::string(dir_.name()) + "/" + path + ": missing: " + described_by_ + " lists it but it does not exist";
    });
    safetensors_header h = df == data_files_.end() ? read_safetensors_header(s) : index_dcp_data_file(s, df->second);
    auto size_it = md_.extras.file_sizes.find(name);
    if (size_it != md_.extras.file_sizes.end() && size_it->second != s.size())
      fail(errc::truncated, std::string(s.name()) + ": file is " + std::to_string(s.size()) +
                                " bytes but " + described_by_ + " recorded " + std::to_string(size_it->second));
    return std::make_unique<open_file>(open_file{std::move(s), std::move(h)});
  }

  /// Copies the pieces of a read out of src (the read's bytes) into base; `from` set: the
  /// pieces hold `from` elements (offsets count stored bytes), converted to `to`.
  static void scatter(const read_op& op, const std::byte* src, std::byte* base, std::optional<dtype> from = {},
                      dtype to = dtype::U8) {
    if (!from) {
      for (const auto& p : op.pieces)
        detail::stream_copy(base + p.dst, src + p.offset, static_cast<std::size_t>(p.len));
      return;
    }
    const std::uint64_t si = item_size(*from), di = item_size(to);
    for (const auto& p : op.pieces)
      convert_elements(*from, {src + p.offset, static_cast<std::size_t>(p.len)}, to,
                       {base + p.dst / si * di, static_cast<std::size_t>(p.len / si * di)});
  }

  void run_reads(std::span<const flat_view> views, const load_schedule& s, const std::vector<const open_file*>& files,
                 const std::vector<std::optional<dtype>>& stored) {
    // a read lands straight in a view only when it is one whole piece and needs no conversion
    auto direct = [&](const load_schedule::file_read& rd) { return rd.op.direct() && !stored[rd.view]; };
    if constexpr (MappableStorage<reader_type>) {
      // straight out of the mapping: only the pieces are copied, gaps are never touched
      std::vector<std::pair<std::size_t, std::size_t>> all;  // (file, read)
      for (std::size_t f = 0; f < s.files.size(); ++f)
        for (std::size_t r = 0; r < s.files[f].reads.size(); ++r) all.emplace_back(f, r);
      detail::parallel_for(all.size(), s.threads, [&](std::size_t i) {
        const auto& [f, r] = all[i];
        const reader_type& st = files[f]->storage;
        const load_schedule::file_read& rd = s.files[f].reads[r];
        detail::check_read_range(st.name(), rd.op.file_offset, rd.op.len, st.size());
        scatter(rd.op, st.bytes().data() + rd.op.file_offset, views[rd.view].data, stored[rd.view], views[rd.view].type);
      });
    } else if constexpr (BatchReadableStorage<reader_type>) {
      // one read_batch per file (more only where merged reads need too much staging)
      struct batch {
        std::size_t file, first, last;  // reads [first, last) of s.files[file]
        std::uint64_t staging;
      };
      std::vector<batch> batches;
      for (std::size_t f = 0; f < s.files.size(); ++f) {
        const auto& reads = s.files[f].reads;
        batch b{f, 0, 0, 0};
        for (std::size_t r = 0; r < reads.size(); ++r) {
          const std::uint64_t need = direct(reads[r]) ? 0 : reads[r].op.len;
          if (b.last > b.first && need > 0 && b.staging + need > batch_staging_bytes) {
            batches.push_back(b);
            b = batch{f, r, r, 0};
          }
          b.last = r + 1;
          b.staging += need;
        }
        if (b.last > b.first) batches.push_back(b);
      }
      detail::parallel_for(batches.size(), s.threads, [&](std::size_t i) {
        const batch& b = batches[i];
        const auto& reads = s.files[b.file].reads;
        std::vector<std::byte> staging(static_cast<std::size_t>(b.staging));
        std::vector<read_request> rq;
        rq.reserve(b.last - b.first);
        std::uint64_t at = 0;
        for (std::size_t r = b.first; r < b.last; ++r) {
          const read_op& op = reads[r].op;
          if (direct(reads[r])) {
            rq.push_back({op.file_offset, {views[reads[r].view].data + op.pieces[0].dst, static_cast<std::size_t>(op.len)}});
          } else {
            rq.push_back({op.file_offset, {staging.data() + at, static_cast<std::size_t>(op.len)}});
            at += op.len;
          }
        }
        files[b.file]->storage.read_batch(std::span<const read_request>(rq));
        at = 0;
        for (std::size_t r = b.first; r < b.last; ++r) {
          const read_op& op = reads[r].op;
          if (direct(reads[r])) continue;
          scatter(op, staging.data() + at, views[reads[r].view].data, stored[reads[r].view], views[reads[r].view].type);
          at += op.len;
        }
      });
    } else {
      // one read_into per read; merged reads land in staging buffers reused within this
      // load (pool threads outlive it, so buffers are not kept per thread)
      std::vector<std::pair<std::size_t, std::size_t>> all;  // (file, read)
      for (std::size_t f = 0; f < s.files.size(); ++f)
        for (std::size_t r = 0; r < s.files[f].reads.size(); ++r) all.emplace_back(f, r);
      detail::buffer_pool spare;
      detail::parallel_for(all.size(), s.threads, [&](std::size_t i) {
        const auto& [f, r] = all[i];
        const load_schedule::file_read& rd = s.files[f].reads[r];
        std::byte* base = views[rd.view].data;
        if (direct(rd)) {
          files[f]->storage.read_into(rd.op.file_offset, {base + rd.op.pieces[0].dst, static_cast<std::size_t>(rd.op.len)});
          return;
        }
        std::vector<std::byte> staging = spare.take();
        staging.resize(rd.op.len);
        files[f]->storage.read_into(rd.op.file_offset, staging);
        if (stored[rd.view])
          scatter(rd.op, staging.data(), base, stored[rd.view], views[rd.view].type);
        else
          for (const auto& p : rd.op.pieces) std::memcpy(base + p.dst, staging.data() + p.offset, p.len);
        spare.give(std::move(staging));
      });
    }
  }

  /// The files of tm whose elements a load of `mine` (planned as lp) must compare
  /// (load_schedule::compares): where files overlap (the shards hold more elements than the
  /// tensor), each file that shares elements with another and holds elements of mine that the
  /// plan took from another file. (A file the plan took all its elements of mine from holds
  /// the loaded bytes; every other holder of those elements is compared with them.) A pair of
  /// identical shards whose recorded checksums are equal (the same bytes were written) needs
  /// no comparing.
  std::vector<std::size_t> files_to_compare(const std::string& key, const tensor_metadata& tm, const shard_spec& mine,
                                            const load_plan& lp) const {
    std::uint64_t held = 0;
    for (const auto& [n, spec] : tm.files) held += spec.local_numel();
    if (held <= tm.numel()) return {};
    const std::span<const std::uint64_t> full(tm.shape);
    auto same_checksums = [&](const std::string& a, const std::string& b) {
      const auto& cs = md_.extras.checksums;
      if (!cs) return false;
      const auto fa = cs->files.find(a), fb = cs->files.find(b);
      if (fa == cs->files.end() || fb == cs->files.end()) return false;
      const auto ta = fa->second.find(key), tb = fb->second.find(key);
      return ta != fa->second.end() && tb != fb->second.end() && ta->second == tb->second;
    };
    std::vector<bool> involved(tm.files.size(), false);
    for (std::size_t a = 0; a < tm.files.size(); ++a)
      for (std::size_t b = a + 1; b < tm.files.size(); ++b) {
        if (overlap_numel(tm.files[a].second, tm.files[b].second, full) == 0) continue;
        if (tm.files[a].second == tm.files[b].second && same_checksums(tm.files[a].first, tm.files[b].first)) continue;
        involved[a] = involved[b] = true;
      }
    std::vector<std::uint64_t> supplied(tm.files.size(), 0);
    for (const auto& fp : lp.files) supplied[fp.file] += fp.numel;
    std::vector<std::size_t> out;
    for (std::size_t j = 0; j < tm.files.size(); ++j)
      if (involved[j] && overlap_numel(mine, tm.files[j].second, full) > supplied[j]) out.push_back(j);
    return out;
  }

  /// Runs the schedule's compares (after the reads): each piece's bytes, as stored (converted
  /// where the view's dtype differs), must equal the view's; errc::invalid_metadata otherwise.
  void compare_replicas(std::span<const flat_view> views, const load_schedule& s,
                        const std::vector<const open_file*>& files, const std::vector<std::optional<dtype>>& stored) const {
    detail::parallel_for(s.compares.size(), s.threads, [&](std::size_t i) {
      const auto& [f, rd] = s.compares[i];
      const reader_type& st = files[f]->storage;
      std::vector<std::byte> staging, conv;
      const std::byte* src;
      if constexpr (MappableStorage<reader_type>) {
        detail::check_read_range(st.name(), rd.op.file_offset, rd.op.len, st.size());
        src = st.bytes().data() + rd.op.file_offset;
      } else {
        staging.resize(static_cast<std::size_t>(rd.op.len));
        st.read_into(rd.op.file_offset, staging);
        src = staging.data();
      }
      const flat_view& v = views[rd.view];
      const std::uint64_t si = stored[rd.view] ? item_size(*stored[rd.view]) : item_size(v.type), di = item_size(v.type);
      for (const auto& p : rd.op.pieces) {
        const std::byte* have = src + p.offset;
        if (stored[rd.view]) {
          conv.resize(static_cast<std::size_t>(p.len / si * di));
          convert_elements(*stored[rd.view], {have, static_cast<std::size_t>(p.len)}, v.type, conv);
          have = conv.data();
        }
        const std::byte* loaded = v.data + p.dst / si * di;
        const std::size_t n = static_cast<std::size_t>(p.len / si * di);
        if (std::memcmp(have, loaded, n) == 0) continue;
        std::uint64_t at = 0;
        while (std::memcmp(have + at * di, loaded + at * di, static_cast<std::size_t>(di)) == 0) ++at;
        const std::uint64_t local = p.dst / si + at;
        auto g = global_index_of(v.effective_spec(), v.full_shape, local);
        fail(errc::invalid_metadata,
             std::string(st.name()) + ": tensor '" + v.key + "': holds other bytes for element " +
                 (g ? "index " + multi_index_string(v.full_shape, *g) : "local " + std::to_string(local)) +
                 " than the file it was loaded from: two files claim the same elements with different values, and a "
                 "load cannot choose between them (shardsafe verify names both files)");
      }
    });
  }

  /// Checks every checksum block the schedule's reads touch (load_options::verify_checksums);
  /// returns how many. A block that one direct read landed whole in a view is hashed there;
  /// any other is read again (or taken from the mapping).
  std::uint64_t check_blocks_read(std::span<const flat_view> views, const load_schedule& s,
                                  const std::vector<const open_file*>& files,
                                  const std::vector<std::optional<dtype>>& stored) const {
    const checkpoint_checksums& cs = *md_.extras.checksums;
    struct block {
      std::size_t file;
      const tensor_entry* e;
      const std::vector<std::uint64_t>* hashes;
      std::uint64_t k;
      const std::byte* in_view = nullptr;  // the block's bytes, where a read landed them whole
    };
    std::map<std::tuple<std::size_t, const tensor_entry*, std::uint64_t>, block> todo;
    for (std::size_t f = 0; f < s.files.size(); ++f) {
      const open_file& of = *files[f];
      for (const auto& rd : s.files[f].reads) {
        const tensor_entry* e = of.header.find(views[rd.view].key);
        if (!e || e->nbytes() == 0) continue;
        const std::vector<std::uint64_t>& hashes = detail::recorded_hashes(cs, s.files[f].name, of.storage.name(), *e);
        const std::uint64_t b = of.header.offset_of(*e);
        const std::uint64_t lo = std::max(rd.op.file_offset, b) - b;
        const std::uint64_t hi = std::min(rd.op.file_offset + rd.op.len, b + e->nbytes()) - b;
        if (hi <= lo) continue;
        const bool whole = rd.op.direct() && !stored[rd.view];
        for (std::uint64_t k = lo / cs.block_bytes; k * cs.block_bytes < hi; ++k) {
          const std::tuple<std::size_t, const tensor_entry*, std::uint64_t> id{f, e, k};
          const auto it = todo.try_emplace(id, block{f, e, &hashes, k}).first;
          const auto sp = detail::block_span(k, cs.block_bytes, e->nbytes());
          if (whole && !it->second.in_view && b + sp.from >= rd.op.file_offset &&
              b + sp.to <= rd.op.file_offset + rd.op.len)
            it->second.in_view = views[rd.view].data + rd.op.pieces[0].dst + (b + sp.from - rd.op.file_offset);
        }
      }
    }
    std::vector<block> blocks;
    blocks.reserve(todo.size());
    for (auto& [id, bl] : todo) blocks.push_back(bl);
    std::vector<std::uint64_t> got(blocks.size());
    detail::buffer_pool spare;
    detail::parallel_for(blocks.size(), s.threads, [&](std::size_t i) {
      const block& bl = blocks[i];
      const auto sp = detail::block_span(bl.k, cs.block_bytes, bl.e->nbytes());
      if (bl.in_view) {
        got[i] = detail::xxh3_64(bl.in_view, static_cast<std::size_t>(sp.to - sp.from));
        return;
      }
      std::vector<std::byte> buf = spare.take();
      const open_file& of = *files[bl.file];
      got[i] = detail::hash_stored(of.storage, of.header.offset_of(*bl.e) + sp.from, sp.to - sp.from, buf);
      spare.give(std::move(buf));
    });
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const block& bl = blocks[i];
      const std::uint64_t want = (*bl.hashes)[static_cast<std::size_t>(bl.k)];
      if (got[i] != want) {
        const std::string& fname = s.files[bl.file].name;
        const tensor_metadata* tm = find(bl.e->name);
        fail(errc::checksum_mismatch,
             detail::checksum_mismatch_message(files[bl.file]->storage.name(), *bl.e, bl.k, cs.block_bytes, want, got[i],
                                               tm, detail::spec_in(tm, fname)));
      }
    }
    return blocks.size();
  }

  D dir_;
  checkpoint_format format_ = checkpoint_format::sharded;
  std::string described_by_;
  checkpoint_metadata md_;
  std::unordered_map<std::string, std::size_t> index_;
  std::mutex files_mutex_;
  std::map<std::string, std::unique_ptr<open_file>> files_;
  std::map<std::string, dcp_data_file> data_files_;  // names indexed by index_dcp_data_file
  std::vector<non_tensor_item> non_tensors_;
  std::map<std::string, pickle_value> paths_;
};

/// Loads views from the checkpoint in dir (a folder holding metadata.json).
template <ReadableDirectory D>
load_stats load_flat_views(const D& dir, std::span<const flat_view> views, const load_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return r.load(views, opt);
}

}  // namespace shardsafe
