// shardsafe/checkpoint/layouts/dcp.hpp - torch.distributed.checkpoint folders: `.metadata` (a
// pickle, format/dcp_metadata.hpp) written last as the commit mark, data files `__R_N.distcp`
// (torch.save archives one after another, format/dcp_data.hpp) or safetensors files.
//
// A DCP folder is described by `.metadata` alone: opening it reads that one file. Its data files
// are indexed when the reader first opens them (index_file: the zip headers of each chunk's
// torch.save archive, never the chunk's data), so a load opens and indexes only the files it
// reads from. A data file holding two chunks of one key (a rank with two shards of a tensor) is
// listed as `FILE`, `FILE#1`, ...: one name per chunk of that key, the same file. Non-tensor items
// (BytesStorageMetadata) are listed, their values read only on request (read_object). Tensors of
// a torch dtype shardsafe has no type for (complex128, quantized: dcp_item::foreign_dtype) are
// listed as foreign tensors. Written by checkpoint/dcp_save.hpp.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/dcp_data.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/pickle_extent.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

struct dcp_layout {
  static constexpr layout_info info{.id = "dcp",
                                    .name = "torch.distributed.checkpoint folder",
                                    .commit_mark = dcp_metadata_file_name,
                                    .permuted_files = true};  // a torch.save'd chunk

  template <ReadableDirectory D>
  static bool recognise(const D& dir, folder_listing<D>&) {
    return dir.exists(dcp_metadata_file_name);
  }

  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>& ls) {
    if (!recognise(dir, ls)) return std::nullopt;
    return describe(dir);
  }

  /// A folder of .distcp files without .metadata: a save that did not finish.
  template <ReadableDirectory D>
  static std::optional<std::string> incomplete(const D& dir, folder_listing<D>& ls) {
    if (!ls.any_ends_with(".distcp")) return std::nullopt;
    return std::string(dir.name()) +
           ": .distcp files but no .metadata: not a complete "
           "torch.distributed.checkpoint folder (a save that did not finish?)";
  }

  /// A file of the folder indexed: a .distcp file by its archives' zip headers, a safetensors
  /// data file by its header.
  template <ReadableStorage S, class Source>
  static safetensors_header index_file(const S& s, const Source& src, const std::string& name) {
    const auto df = src.data_files.find(name);
    return df == src.data_files.end() ? read_safetensors_header(s) : index_dcp_data_file(s, df->second);
  }

  /// A non-tensor item's value, from the torch.save archive in its data file.
  template <ReadableDirectory D>
  static pickle_value read_object(const D& dir, const non_tensor_item& it) {
    return with_object(dir, it, [](const auto& s, const dcp_storage_info& where, const std::string& what) {
      return read_dcp_object(s, where, what);
    });
  }
  /// The item's torch.save archive as its data file holds it, not decoded.
  template <ReadableDirectory D>
  static std::string read_object_archive(const D& dir, const non_tensor_item& it) {
    return with_object(dir, it, [](const auto& s, const dcp_storage_info& where, const std::string& what) {
      return read_dcp_object_archive(s, where, what);
    });
  }

  /// The description `.metadata` gives (rules in format/dcp_metadata.hpp), no data file opened.
  template <ReadableDirectory D>
  static checkpoint_source<D> describe(const D& dir) {
    const std::string folder(dir.name());
    const dcp_metadata md = parse_dcp_metadata(
        read_pickle_bytes(dir.open(dcp_metadata_file_name), max_dcp_metadata_size), folder + "/.metadata");
    checkpoint_source<D> s;
    s.layout = &info;
    s.described_by = std::string(dcp_metadata_file_name);
    s.paths = md.planner_data;
    std::map<std::pair<std::string, std::string>, std::size_t> chunks_of;  // (file, key) -> chunks so far
    for (const auto& [key, item] : md.items) {
      if (item.is_bytes) {
        s.non_tensors.push_back({key, item.bytes.relative_path, item.bytes.offset, item.bytes.length, std::nullopt});
        continue;
      }
      if (!item.foreign_dtype.empty()) {
        s.foreign_tensors.push_back({key, item.foreign_dtype, item.size, item.chunks.size(), {}});
        continue;
      }
      tensor_metadata tm;
      tm.shape = item.size;
      tm.type = item.type;
      tm.is_sharded = item.chunks.size() > 1 || (item.chunks.size() == 1 && item.chunks.front().sizes != item.size);
      for (const auto& c : item.chunks) {
        const std::string& path = c.storage.relative_path;
        const std::size_t k = chunks_of[{path, key}]++;
        const std::string fname = k == 0 ? path : path + "#" + std::to_string(k);
        if (k > 0 && path.ends_with(".safetensors"))
          fail(errc::invalid_metadata, folder + "/.metadata: tensor '" + key + "': a second chunk (at " +
                                           to_string(c.offsets) + ") placed in '" + path +
                                           "', a safetensors file, which holds each key once");
        dcp_data_file& df = s.data_files[fname];
        if (!df.chunks.empty() && df.path != path)
          fail(errc::invalid_metadata, folder + "/.metadata: tensor '" + key + "': '" + fname +
                                           "' names both the data file '" + df.path + "' and chunk " +
                                           std::to_string(k) + " of '" + path + "' in it");
        df.path = path;
        df.safetensors = path.ends_with(".safetensors");
        df.chunks.push_back({{key, item.type, c.offsets, c.sizes}, c.storage.offset, c.storage.length});
        // a 0-d tensor's one chunk is its one element
        tm.files.emplace_back(
            fname, item.size.empty() ? shard_spec(flat_spec{{0, 1}}) : shard_spec(block_spec(c.sizes, c.offsets)));
      }
      for (auto& [fname, spec] : tm.files) spec.validate(tm.shape, folder + "/" + fname);
      s.metadata.tensors.emplace_back(key, std::move(tm));
    }
    return s;
  }

 private:
  /// f(storage, where, what) on the data file of item `it` (errc::not_found when it is missing).
  template <ReadableDirectory D, class F>
  static decltype(auto) with_object(const D& dir, const non_tensor_item& it, F&& f) {
    typename D::reader_type s = detail::open_or(dir, it.file, [&] {
      return std::string(dir.name()) + "/" + it.file + ": missing: " + std::string(dcp_metadata_file_name) +
             " lists it but it does not exist";
    });
    return std::forward<F>(f)(s, dcp_storage_info{it.file, it.offset, it.bytes}, "'" + it.key + "'");
  }
};

}  // namespace shardsafe
