// shardsafe/checkpoint/loader.hpp - load a sharded checkpoint into caller memory, in place,
// under any sharding.
//
// For each flat view: the checkpoint's shape and dtype must match; my shard is resolved
// against every file's shard (plan_load: each element from exactly one file, gaps reported
// as missing coverage); the copy runs become reads of byte ranges (make_read_plan) that land
// straight in the view's memory, or, when several runs share one read, in a bounded staging
// buffer that is scattered at once. Reads of all views run on a thread pool. Nothing the
// size of a tensor or a file is allocated.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/detail/nan.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/read_plan.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct load_options {
  unsigned threads = 0;         ///< 0: detail::default_threads()
  read_options reads{};         ///< gap merging and read sizes
  bool strict = true;           ///< a view whose key the checkpoint lacks is an error (else listed)
  bool validate_nan = false;    ///< fill floating views with NaN first, fail if any remain (OLMo-core's check)
};

struct load_stats {
  std::uint64_t tensors = 0;        ///< views loaded
  std::uint64_t bytes_needed = 0;   ///< bytes that landed in views
  std::uint64_t bytes_read = 0;     ///< bytes read from files (needed + merged gaps)
  std::uint64_t read_ops = 0;       ///< reads issued
  std::vector<std::string> missing_keys;     ///< views the checkpoint lacks (strict = false)
  std::vector<std::string> unexpected_keys;  ///< checkpoint tensors no view asked for
  double seconds = 0;
};

/// A checkpoint directory opened for reading: metadata.json validated, rank files opened
/// (and their headers validated) on first use and kept open.
template <ReadableDirectory D>
class checkpoint_reader {
 public:
  using reader_type = typename D::reader_type;

  explicit checkpoint_reader(D dir) : dir_(std::move(dir)) {
    if (!dir_.exists(metadata_file_name))
      fail(errc::not_found, std::string(dir_.name()) + ": no metadata.json: not a complete checkpoint (a save that "
                                                       "did not finish, or not a checkpoint directory)");
    md_ = read_checkpoint_metadata(dir_.open(metadata_file_name));
    for (std::size_t i = 0; i < md_.tensors.size(); ++i) index_.emplace(md_.tensors[i].first, i);
  }

  const D& directory() const noexcept { return dir_; }
  const checkpoint_metadata& metadata() const noexcept { return md_; }
  const tensor_metadata* find(std::string_view key) const {
    auto it = index_.find(std::string(key));
    return it == index_.end() ? nullptr : &md_.tensors[it->second].second;
  }

  /// An opened rank file: its storage and validated header.
  struct open_file {
    reader_type storage;
    safetensors_header header;
  };
  /// Opens (once) a file the metadata names.
  const open_file& file(const std::string& name) {
    std::lock_guard lock(files_mutex_);
    auto it = files_.find(name);
    if (it != files_.end()) return *it->second;
    if (!dir_.exists(name))
      fail(errc::not_found, std::string(dir_.name()) + "/" + name + ": missing: metadata.json lists it but it does not exist");
    reader_type s = dir_.open(name);
    safetensors_header h = read_safetensors_header(s);
    auto size_it = md_.extras.file_sizes.find(name);
    if (size_it != md_.extras.file_sizes.end() && size_it->second != s.size())
      fail(errc::truncated, std::string(s.name()) + ": file is " + std::to_string(s.size()) +
                                " bytes but metadata.json recorded " + std::to_string(size_it->second));
    auto f = std::make_unique<open_file>(open_file{std::move(s), std::move(h)});
    return *files_.emplace(name, std::move(f)).first->second;
  }

  /// The entry of `key` in file `name`, checked against the metadata and the file's shard.
  const tensor_entry& entry_in(const open_file& f, const std::string& key, const tensor_metadata& tm,
                               const shard_spec& spec) const {
    const std::string ctx = std::string(f.storage.name()) + ": tensor '" + key + "'";
    const tensor_entry* e = f.header.find(key);
    if (!e) fail(errc::not_found, ctx + ": listed in metadata.json but absent from the file");
    if (e->type != tm.type)
      fail(errc::dtype_mismatch, ctx + ": file has dtype " + std::string(name(e->type)) + ", metadata.json says " +
                                     std::string(name(tm.type)));
    if (e->numel() != spec.local_numel())
      fail(errc::shape_mismatch, ctx + ": file holds " + std::to_string(e->numel()) + " elements (shape " +
                                     to_string(e->shape) + ") but its shard spec (" + to_string(spec) + ") holds " +
                                     std::to_string(spec.local_numel()));
    return *e;
  }

  /// Loads every view in place. Throws on the first problem, naming file, tensor and rule.
  load_stats load(std::span<const flat_view> views, const load_options& opt = {}) {
    const auto t0 = std::chrono::steady_clock::now();
    load_stats st;
    struct task {
      const open_file* file;
      read_op op;
      std::byte* base;
    };
    std::vector<task> tasks;
    std::vector<const flat_view*> nan_checked;
    std::map<std::string_view, bool> asked;

    for (const flat_view& v : views) {
      const std::string ctx = std::string(dir_.name()) + ": tensor '" + v.key + "'";
      v.validate(dir_.name());
      asked[v.key] = true;
      const tensor_metadata* tm = find(v.key);
      if (!tm) {
        if (opt.strict) fail(errc::not_found, ctx + ": not in the checkpoint");
        st.missing_keys.push_back(v.key);
        continue;
      }
      if (tm->shape != v.full_shape)
        fail(errc::shape_mismatch, ctx + ": checkpoint has shape " + to_string(tm->shape) + ", the tensor to load has " +
                                       to_string(v.full_shape));
      if (tm->type != v.type)
        fail(errc::dtype_mismatch, ctx + ": checkpoint has dtype " + std::string(name(tm->type)) +
                                       ", the tensor to load has " + std::string(name(v.type)));
      const shard_spec mine = v.effective_spec();
      std::vector<shard_spec> specs;
      specs.reserve(tm->files.size());
      for (const auto& f : tm->files) specs.push_back(f.second);
      load_plan lp = plan_load(mine, std::span<const shard_spec>(specs), tm->shape);
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
      ++st.tensors;
      if (opt.validate_nan && has_nan(v.type)) {
        detail::fill_nan(v.type, v.bytes());
        nan_checked.push_back(&v);
      }
      const std::uint64_t item = item_size(v.type);
      for (auto& fp : lp.files) {
        const auto& [fname, fspec] = tm->files[fp.file];
        const open_file& f = file(fname);
        const tensor_entry& e = entry_in(f, v.key, *tm, fspec);
        read_plan rp = make_read_plan(fp.runs, f.header.offset_of(e), item, opt.reads);
        st.bytes_needed += rp.bytes_needed;
        st.bytes_read += rp.bytes_read;
        st.read_ops += rp.ops.size();
        for (auto& op : rp.ops) tasks.push_back(task{&f, std::move(op), v.data});
      }
    }
    for (const auto& [k, t] : md_.tensors)
      if (!asked.count(k)) st.unexpected_keys.push_back(k);

    detail::parallel_for(tasks.size(), opt.threads, [&](std::size_t i) {
      const task& t = tasks[i];
      if (t.op.direct()) {
        t.file->storage.read_into(t.op.file_offset, {t.base + t.op.pieces[0].dst, static_cast<std::size_t>(t.op.len)});
        return;
      }
      thread_local std::vector<std::byte> staging;
      staging.resize(t.op.len);
      t.file->storage.read_into(t.op.file_offset, staging);
      for (const auto& p : t.op.pieces) std::memcpy(t.base + p.dst, staging.data() + p.offset, p.len);
      if (staging.capacity() > (std::size_t(64) << 20)) std::vector<std::byte>().swap(staging);
    });

    for (const flat_view* v : nan_checked) {
      const std::int64_t at = detail::first_nan(v->type, v->bytes());
      if (at >= 0) {
        auto g = global_index_of(v->effective_spec(), v->full_shape, static_cast<std::uint64_t>(at));
        fail(errc::missing_coverage, std::string(dir_.name()) + ": tensor '" + v->key +
                                         "': NaN after loading at local element " + std::to_string(at) +
                                         (g ? " (index " + multi_index_string(v->full_shape, *g) + ")" : std::string()) +
                                         ": not loaded, or NaN in the checkpoint");
      }
    }
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
  }

 private:
  D dir_;
  checkpoint_metadata md_;
  std::unordered_map<std::string, std::size_t> index_;
  std::mutex files_mutex_;
  std::map<std::string, std::unique_ptr<open_file>> files_;
};

/// Loads views from the checkpoint in dir (a folder holding metadata.json).
template <ReadableDirectory D>
load_stats load_flat_views(const D& dir, std::span<const flat_view> views, const load_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return r.load(views, opt);
}

}  // namespace shardsafe
