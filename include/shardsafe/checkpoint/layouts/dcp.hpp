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

#include <algorithm>
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

/// How a layout built on DCP presents a chunk of a tensor (dcp_layout::describe's `names`).
struct dcp_chunk_name {
  std::string name;              ///< the tensor it is a chunk of
  std::size_t dropped_axes = 0;  ///< leading axes of size 1 in the chunk, not in that tensor
};
/// Every chunk under its key: DCP's own names.
struct dcp_same_names {
  std::optional<dcp_chunk_name> operator()(const std::string&, const shape_t&, const shape_t&) const {
    return std::nullopt;
  }
};

struct dcp_layout {
  static constexpr layout_info info{.id = "dcp",
                                    .name = "torch.distributed.checkpoint folder",
                                    .commit_mark = dcp_metadata_file_name,
                                    .permuted_files = true};  // a torch.save'd chunk

  template <ReadableDirectory D>
  static bool recognise(const D&, folder_listing<D>& ls) {
    return ls.has(dcp_metadata_file_name);
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
  /// The item's torch.save archive as its data file holds it, not decoded. `opaque`: whatever
  /// it holds (a layout built on DCP whose items hold tensors: Megatron-Core's RNG states).
  template <ReadableDirectory D>
  static std::string read_object_archive(const D& dir, const non_tensor_item& it, bool opaque = false) {
    return with_object(dir, it, [opaque](const auto& s, const dcp_storage_info& where, const std::string& what) {
      return read_dcp_object_archive(s, where, what, opaque);
    });
  }

  /// The description `.metadata` gives (rules in format/dcp_metadata.hpp), no data file opened.
  /// `names`, for a layout built on DCP (Megatron-Core's): names(key, offsets, sizes) of each
  /// chunk of a tensor, an optional dcp_chunk_name (another name, leading axes of size 1
  /// dropped); nullopt keeps the key.
  template <ReadableDirectory D, class Names = dcp_same_names>
  static checkpoint_source<D> describe(const D& dir, Names&& names = {}) {
    const std::string folder(dir.name());
    const dcp_metadata md = parse_dcp_metadata(
        read_pickle_bytes(dir.open(dcp_metadata_file_name), max_dcp_metadata_size), folder + "/.metadata");
    checkpoint_source<D> s;
    s.layout = &info;
    s.described_by = std::string(dcp_metadata_file_name);
    s.paths = md.planner_data;
    std::map<std::pair<std::string, std::string>, std::size_t> chunks_of;  // (file, name) -> chunks so far
    std::map<std::string, std::pair<std::string, tensor_metadata>> made;   // name -> (key, tensor)
    for (const auto& [key, item] : md.items) {
      if (item.is_bytes) {
        s.non_tensors.push_back({key, item.bytes.relative_path, item.bytes.offset, item.bytes.length, std::nullopt});
        continue;
      }
      if (!item.foreign_dtype.empty()) {
        s.foreign_tensors.push_back({key, item.foreign_dtype, item.size, item.chunks.size(), {}});
        continue;
      }
      if (std::find(md.reformulated.begin(), md.reformulated.end(), key) != md.reformulated.end()) {
        s.foreign_tensors.push_back(
            {key, std::string(to_string(item.type)), item.size, item.chunks.size(),
             "is not read: Megatron-Core stored it as reformulated flattened ranges (mcore_data's "
             "nd_reformulated_orig_global_shape), in another shape than the tensor's; re-save it with "
             "Megatron-Core 0.16 or later, which writes none"});
        continue;
      }
      if (item.chunks.empty()) {  // listed with no chunk: kept, for the coverage rules to refuse
        auto& tm = made.try_emplace(key, key, tensor_metadata{}).first->second.second;
        tm.shape = item.size;
        tm.type = item.type;
      }
      for (const auto& c : item.chunks) {
        const std::optional<dcp_chunk_name> as = names(key, c.offsets, c.sizes);
        const std::string& name = as ? as->name : key;
        const std::size_t d = as ? as->dropped_axes : 0;
        for (std::size_t a = 0; a < d; ++a)
          if (a >= c.sizes.size() || c.sizes[a] != 1)
            fail(errc::invalid_metadata, folder + "/.metadata: tensor '" + key + "': the chunk at " +
                                             to_string(c.offsets) + " of " + to_string(c.sizes) + " is presented as '" +
                                             name + "' without its first " + std::to_string(d) +
                                             " axes, which it does not hold once each");
        auto [it, fresh] = made.try_emplace(name, key, tensor_metadata{});
        tensor_metadata& tm = it->second.second;
        if (fresh) {
          tm.shape.assign(item.size.begin() + static_cast<std::ptrdiff_t>(d), item.size.end());
          tm.type = item.type;
        } else if (it->second.first != key) {
          fail(errc::invalid_metadata, folder + "/.metadata: tensors '" + it->second.first + "' and '" + key +
                                           "' are both presented as '" + name + "'");
        }
        const std::string& path = c.storage.relative_path;
        const std::size_t k = chunks_of[{path, name}]++;
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
        df.chunks.push_back(
            {{key, item.type, c.offsets, c.sizes}, c.storage.offset, c.storage.length, as ? name : std::string(), d});
        const shape_t offsets(c.offsets.begin() + static_cast<std::ptrdiff_t>(d), c.offsets.end()),
            sizes(c.sizes.begin() + static_cast<std::ptrdiff_t>(d), c.sizes.end());
        // a 0-d tensor's one chunk is its one element
        tm.files.emplace_back(
            fname, tm.shape.empty() ? shard_spec(flat_spec{{0, 1}}) : shard_spec(block_spec(sizes, offsets)));
        tm.is_sharded = tm.files.size() > 1 || sizes != tm.shape;
      }
    }
    for (auto& [name, kt] : made) {
      tensor_metadata& tm = kt.second;
      for (auto& [fname, spec] : tm.files) spec.validate(tm.shape, folder + "/" + fname);
      s.metadata.tensors.emplace_back(name, std::move(tm));
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
