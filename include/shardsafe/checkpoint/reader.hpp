// shardsafe/checkpoint/reader.hpp - a checkpoint opened for reading: its description and its
// files, opened and indexed as the description says (checkpoint/source.hpp), kept open.
//
// checkpoint_files<D> is what every reader of a checkpoint shares (the loader's
// checkpoint_reader, verify, unshard, export, the tool): the description (metadata.json, an HF
// folder's index and headers, torch DCP's .metadata or DCP_SHARDING_INFO) read once, each file
// opened once on first use (many at once, each in one round trip: open, then one speculative
// read of its header), a DCP folder's non-tensor items, and the checksums of the files read.
// Which layout the folder has never matters past here: a file is opened and indexed, and a
// non-tensor item read, by its layout (checkpoint/layouts/registry.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/checksums.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/config.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// A checkpoint directory opened for reading: its description validated, its files opened (and
/// their headers validated) on first use and kept open.
template <ReadableDirectory D>
class checkpoint_files {
 public:
  using reader_type = typename D::reader_type;
  /// An opened file: its storage and validated header (or a DCP data file's index).
  using open_file = opened_file<reader_type>;

  /// Opens the checkpoint in dir, whichever layout it has (checkpoint/source.hpp).
  explicit checkpoint_files(D dir) : checkpoint_files(dir, open_checkpoint_source(dir)) {}
  /// Reads a checkpoint described by src (made by open_checkpoint_source or by the caller); its
  /// files in src.folder where the description names one (a DeepSpeed tag folder), else in dir.
  checkpoint_files(D dir, checkpoint_source<D> src) : dir_(src.folder ? std::move(*src.folder) : std::move(dir)) {
    src.folder.reset();
    adopt(std::move(src));
  }

  const D& directory() const noexcept { return dir_; }
  const checkpoint_metadata& metadata() const noexcept { return src_.metadata; }
  /// The layout the checkpoint has (checkpoint/layouts/): what it is and what it can do.
  const layout_info& layout() const noexcept { return src_.layout ? *src_.layout : shardsafe_layout::info; }
  /// Deprecated (one release): layout() as the old enum.
  [[deprecated("use layout() (checkpoint/layouts/) and its traits")]] checkpoint_format format() const noexcept {
    const std::string_view id = layout().id;
    return id == "dcp"              ? checkpoint_format::dcp
           : id == "dcp_sharded_hf" ? checkpoint_format::dcp_sharded_hf
           : id == "shardsafe"      ? checkpoint_format::sharded
                                    : checkpoint_format::hf;
  }
  /// What holds the description ("metadata.json", "model.safetensors.index.json", ...).
  const std::string& described_by() const noexcept { return src_.described_by; }
  /// The file a name of metadata().tensors[...].files is in: itself, or for a DCP data file's
  /// second chunk of a key (`FILE#1`, checkpoint/source.hpp) the file it names.
  const std::string& path_of(const std::string& name) const { return shardsafe::path_of(src_, name); }
  /// Items of the checkpoint that are not tensors (a DCP folder's non-tensor values), by key.
  const std::vector<non_tensor_item>& non_tensors() const noexcept { return src_.non_tensors; }
  /// Where `key` sits in the nested state dict a DCP folder was flattened from (its planner_data:
  /// ('model', 'layers.0.weight')), or nullptr when the checkpoint does not say.
  const pickle_value* path_in_state_dict(const std::string& key) const {
    auto it = src_.paths.find(key);
    return it == src_.paths.end() ? nullptr : &it->second;
  }
  /// The item `key` of non_tensors(), or nullptr.
  const non_tensor_item* find_object(std::string_view key) const {
    const auto& items = src_.non_tensors;
    auto it = std::lower_bound(items.begin(), items.end(), key, [](const non_tensor_item& i, std::string_view k) {
      return std::string_view(i.key) < k;
    });
    return it != items.end() && it->key == key ? &*it : nullptr;
  }
  /// The value of the non-tensor item `key`, as its layout reads it (a DCP folder's from its data
  /// file, a torch.save file's as its pickle held it); errc::not_found when there is none.
  pickle_value read_object(std::string_view key) const {
    const non_tensor_item& it = object(key);
    pickle_value v;
    with_layout(layout(), [&]<class L>() {
      if constexpr (requires { L::read_object(dir_, it); })
        v = L::read_object(dir_, it);
      else
        fail(errc::invalid_argument,
             std::string(dir_.name()) + ": a " + std::string(L::info.name) + " has no non-tensor items");
    });
    return v;
  }
  /// The item's torch.save archive, what an export copies whatever the value pickles: a DCP
  /// folder's as its data file holds it, not decoded; a torch.save file's value pickled again,
  /// refused (errc::invalid_metadata, naming it) when it cannot be.
  std::string read_object_archive(std::string_view key) const {
    const non_tensor_item& it = object(key);
    std::string a;
    with_layout(layout(), [&]<class L>() {
      if constexpr (requires { L::read_object_archive(dir_, it); })
        a = L::read_object_archive(dir_, it);
      else
        fail(errc::invalid_argument,
             std::string(dir_.name()) + ": a " + std::string(L::info.name) + " has no non-tensor items");
    });
    return a;
  }
  /// Reads every DCP item's archive by read_object_archive's rules: one whose value holds
  /// tensors (as torch 1.13 saves a nested dict), which no reader here loads, is refused naming
  /// it. (A torch.save file's values hold no tensors: its tensors are read by name wherever they
  /// stand.)
  void check_objects() const {
    for (const auto& item : src_.non_tensors)
      if (!item.value) read_object_archive(item.key);
  }
  /// Tensors of a torch dtype shardsafe has no type for (a DCP folder's complex128 or quantized
  /// tensors: checkpoint/source.hpp), or a torch.save file's views that are not dense, by key:
  /// not in metadata(), never read.
  const std::vector<foreign_tensor>& foreign_tensors() const noexcept { return src_.foreign_tensors; }
  /// The tensors of the checkpoint for which asked(key) is false, those it describes first (in
  /// its order), then its foreign ones: what checkpoint_reader::plan lists with load_options::list_unexpected.
  template <class Asked>
  std::vector<std::string> unexpected_keys(Asked&& asked) const {
    std::vector<std::string> out;
    for (const auto& [k, t] : this->metadata().tensors)
      if (!asked(k)) out.push_back(k);
    for (const auto& f : this->foreign_tensors())
      if (!asked(f.key)) out.push_back(f.key);
    return out;
  }
  /// Refuses (errc::unsupported_dtype, naming it) the first foreign tensor whose key keep(key)
  /// accepts: what would read it, or vouch for it, stops there, not leave it out unsaid. remedy,
  /// when given, ends the message in parentheses.
  template <class Keep>
  void refuse_foreign(Keep&& keep, std::string_view remedy = {}) const {
    for (const auto& t : src_.foreign_tensors)
      if (keep(t.key))
        fail(t.why.empty() ? errc::unsupported_dtype : errc::invalid_metadata,
             std::string(dir_.name()) + "/" + src_.described_by + ": tensor '" + t.key + "' " + to_string(t.shape) +
                 (t.why.empty() ? " has dtype " + t.dtype + ", which shardsafe has no type for: it is not read"
                                : " " + t.why) +
                 (remedy.empty() ? "" : " (" + std::string(remedy) + ")"));
  }
  /// What an export gives refuse_foreign: how to export the rest.
  static constexpr std::string_view foreign_export_remedy = "a rename rule that drops it exports the rest";
  void refuse_foreign() const {
    refuse_foreign([](const std::string&) { return true; });
  }
  /// What reads or vouches for every tensor and item (verify, digest, unshard) first checks that
  /// nothing would be left out: check_objects, then refuse_foreign.
  void check_all_readable() const {
    check_objects();
    refuse_foreign();
  }
  const tensor_metadata* find(std::string_view key) const {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &src_.metadata.tensors[it->second].second;
  }
  /// find(key), where a foreign tensor of that key is refused (refuse_foreign), not absent.
  const tensor_metadata* find_readable(std::string_view key) const {
    if (const tensor_metadata* t = find(key)) return t;
    refuse_foreign([&](const std::string& k) { return k == key; });
    return nullptr;
  }

  /// Opens (once) a file the metadata names.
  const open_file& file(const std::string& name) {
    open_files(std::span<const std::string>(&name, 1));
    std::lock_guard lock(files_mutex_);
    return *files_.at(name);
  }
  /// Opens (once) every file named, those not open yet all at once, on up to `threads`
  /// threads (0: the default). The first failure is thrown once all attempts have returned.
  void open_files(std::span<const std::string> names, unsigned threads = 0) {
    const std::vector<std::string> todo = not_yet(names, [&](const std::string& n) { return files_.count(n) != 0; });
    std::vector<std::unique_ptr<open_file>> opened(todo.size());
    std::call_once(listed_once_, [&] { index_listed(); });
    detail::parallel_for(todo.size(), threads,
                         [&](std::size_t i) { opened[i] = open_source_file(dir_, src_, todo[i], keep_of(todo[i])); });
    std::lock_guard lock(files_mutex_);
    for (std::size_t i = 0; i < todo.size(); ++i) files_.try_emplace(todo[i], std::move(opened[i]));
  }
  /// The open files named (each opened by open_files or file() before), in that order.
  std::vector<const open_file*> opened(std::span<const std::string> names) {
    std::vector<const open_file*> out;
    out.reserve(names.size());
    std::lock_guard lock(files_mutex_);
    for (const auto& n : names) {
      const auto it = files_.find(n);
      if (it == files_.end())
        fail(errc::invalid_argument, std::string(dir_.name()) + "/" + n + ": used before this reader opened it");
      out.push_back(it->second.get());
    }
    return out;
  }

  /// The recorded checksums (nullptr: none): metadata.json's, with the tables of the files
  /// `names` read from their sidecars first (once) when the checkpoint keeps them there
  /// (checkpoint_checksums::sidecars, the compact form's), on up to `threads` threads.
  const checkpoint_checksums* checksums_for(std::span<const std::string> names, unsigned threads = 0) {
    auto& checksums = src_.metadata.extras.checksums;
    if (!checksums) return nullptr;
    checkpoint_checksums& cs = *checksums;
    if (!cs.sidecars) return &cs;
    const std::vector<std::string> todo = not_yet(names, [&](const std::string& n) { return cs.files.count(n) != 0; });
    using table = std::map<std::string, std::vector<std::uint64_t>>;
    std::vector<table> got(todo.size());
    open_files(todo, threads);  // each sidecar is bounded by what its file's tensors can need
    const std::vector<const open_file*> of = opened(todo);
    // the hashes the tables will hold, by the files' headers, before a sidecar is read
    std::uint64_t blocks = sidecar_hashes_;
    for (std::size_t i = 0; i < todo.size() && blocks <= max_checksum_hashes; ++i)
      for (const tensor_entry& e : of[i]->header.tensors)
        if ((blocks += detail::checksum_block_count(e.nbytes(), cs.block_bytes)) > max_checksum_hashes) {
          const std::string side = std::string(dir_.name()) + "/" + checksum_sidecar_name(todo[i]);
          fail(errc::invalid_metadata, side + ": with it, the checksum tables of " + described_by() +
                                           " would hold more than the " + std::to_string(max_checksum_hashes) +
                                           " hashes a checkpoint's tables may hold (its files' tensors in blocks of " +
                                           std::to_string(cs.block_bytes) + " bytes; docs/FORMAT.md §2)");
        }
    sidecar_hashes_ = blocks;
    detail::parallel_for(todo.size(), threads, [&](std::size_t i) {
      const std::string side = checksum_sidecar_name(todo[i]);
      reader_type st = detail::open_or(dir_, side, [&] {
        return std::string(dir_.name()) + "/" + side + ": missing: " + described_by() + " says the checksums of " +
               todo[i] + " are kept beside it, in this file";
      });
      const std::uint64_t most =
          std::min(max_metadata_size, detail::checksum_table_bound(of[i]->header, cs.block_bytes));
      if (st.size() > most)
        fail(errc::invalid_metadata, std::string(st.name()) + ": " + std::to_string(st.size()) +
                                         " bytes, more than the checksums of " + todo[i] + " can need (" +
                                         std::to_string(of[i]->header.tensors.size()) + " tensors in blocks of " +
                                         std::to_string(cs.block_bytes) + " bytes: at most " + std::to_string(most) +
                                         " bytes, 64 a hash; docs/FORMAT.md §2)");
      const std::string text = read_text(st, most, text_kind::json);
      detail::json_document doc(text, std::string(st.name()), &text);
      got[i] = detail::parse_checksum_table(doc.root("not an object of tensors"), std::string(st.name()));
      doc.require_unique_keys();
    });
    std::lock_guard lock(files_mutex_);
    for (std::size_t i = 0; i < todo.size(); ++i) cs.files.try_emplace(todo[i], std::move(got[i]));
    return &cs;
  }

  /// The entry of `key` in file `f`, checked against the metadata and the file's shard.
  const tensor_entry& entry_in(const open_file& f, const std::string& key, const tensor_metadata& tm,
                               const shard_spec& spec) const {
    return detail::checked_entry(f.header, f.storage.name(), key, tm, spec, described_by());
  }

 private:
  /// The non-tensor item `key` (errc::not_found when there is none).
  const non_tensor_item& object(std::string_view key) const {
    const non_tensor_item* it = find_object(key);
    if (!it)
      fail(errc::not_found,
           std::string(dir_.name()) + ": '" + std::string(key) + "' is not a non-tensor item of " + described_by());
    return *it;
  }
  /// The names not yet done (by done(name), under the lock), each once.
  template <class Done>
  std::vector<std::string> not_yet(std::span<const std::string> names, Done&& done) {
    std::vector<std::string> todo;
    std::set<std::string_view> queued;
    std::lock_guard lock(files_mutex_);
    for (const auto& n : names)
      if (!done(n) && queued.insert(n).second) todo.push_back(n);
    return todo;
  }

  void adopt(checkpoint_source<D> src) {
    src_ = std::move(src);
    for (auto& [n, f] : src_.files) files_.try_emplace(n, std::move(f));
    src_.files.clear();
    for (std::size_t i = 0; i < src_.metadata.tensors.size(); ++i) index_.emplace(src_.metadata.tensors[i].first, i);
  }

  /// Which tensors the description lists in which file (keep_of), made once, on the first open.
  void index_listed() {
    for (const auto& [key, tm] : src_.metadata.tensors) {
      if (tm.grid)
        grid_parts_.emplace(key, tm.grid->part_count());
      else
        for (const auto& f : tm.files) listed_[f.first].push_back(key);
    }
    for (auto& [f, keys] : listed_) std::sort(keys.begin(), keys.end());
  }
  /// What a reader keeps of file `name`'s header: the tensors the description lists there
  /// (a grid's for rank files within it), and no __metadata__, which nothing past the
  /// description reads (header_keep: a checkpoint of many files holds what its description names).
  header_keep keep_of(const std::string& name) const {
    const auto it = listed_.find(name);
    const std::vector<std::string_view>* keys = it == listed_.end() ? nullptr : &it->second;
    const std::optional<std::uint64_t> rank = grid_parts_.empty() ? std::nullopt : rank_of_file_name(name);
    return {[this, keys, rank](std::string_view t) {
              if (keys && std::binary_search(keys->begin(), keys->end(), t)) return true;
              if (!rank) return false;
              const auto g = grid_parts_.find(t);
              return g != grid_parts_.end() && *rank < g->second;
            },
            false};
  }

  struct key_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view k) const noexcept { return std::hash<std::string_view>{}(k); }
  };

  D dir_;
  checkpoint_source<D> src_;  // its files moved into files_
  std::unordered_map<std::string, std::size_t, key_hash, std::equal_to<>> index_;
  std::once_flag listed_once_;
  std::unordered_map<std::string_view, std::vector<std::string_view>> listed_;  // file -> keys listed there, sorted
  std::unordered_map<std::string_view, std::uint64_t> grid_parts_;              // a grid's key -> its parts
  std::mutex files_mutex_;
  std::uint64_t sidecar_hashes_ = 0;  // of the sidecars read so far (max_checksum_hashes)
  std::map<std::string, std::unique_ptr<open_file>, std::less<>> files_;
};

}  // namespace shardsafe
