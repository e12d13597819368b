// shardsafe/checkpoint/layouts/dcp_sharded_hf.hpp - torch's DCP-sharded Hugging Face files
// (torch.distributed.checkpoint's HuggingFaceStorageWriter with save_distributed): a folder of
// safetensors files whose __metadata__ holds DCP_SHARDING_INFO (format/dcp_sharding.hpp), each
// file one block of every tensor it holds, at saved_offsets.
//
// A folder is in this layout when one of its safetensors files has DCP_SHARDING_INFO (rank files
// without metadata.json, a save that did not finish, stay "no metadata.json"). Its checks
// (errc::invalid_metadata, naming file and tensor): every safetensors file of the folder has it;
// a tensor has the same dtype and number of dimensions in every file. Coverage (every element in
// some file) is checked where it is needed: by the loader for what it loads, by verify for
// everything.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/source.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/dcp_sharding.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct dcp_sharded_hf_layout {
  static constexpr layout_info info{
      .id = "dcp_sharded_hf", .name = "torch sharded Hugging Face files", .commit_mark = ""};

  /// A folder that lists safetensors files (which of them has DCP_SHARDING_INFO, open says).
  template <ReadableDirectory D>
  static bool recognise(const D&, folder_listing<D>& ls) {
    return ls.any_ends_with(".safetensors");
  }

  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open(const D& dir, folder_listing<D>& ls) {
    std::vector<std::string> names;
    for (const auto& n : ls.names())
      if (n.ends_with(".safetensors")) names.push_back(n);
    if (names.empty()) return std::nullopt;
    return open_files(dir, names);
  }

  /// The description of the safetensors files `names` of dir (rules at the top), or
  /// nothing when none of them has DCP_SHARDING_INFO (rank files of a save that did not finish,
  /// for instance).
  template <ReadableDirectory D>
  static std::optional<checkpoint_source<D>> open_files(const D& dir, const std::vector<std::string>& names) {
    using R = typename D::reader_type;
    std::vector<opened_file<R>> opened;
    bool any = false;
    for (const auto& n : names) {
      R st = dir.open(n);
      safetensors_header h = read_safetensors_header(st);
      any = any || is_dcp_sharded_header(h);
      opened.push_back({std::move(st), std::move(h)});
    }
    if (!any) return std::nullopt;
    checkpoint_source<D> s;
    s.layout = &info;
    s.described_by = std::string(dcp_sharding_info_key);
    std::map<std::string, std::size_t> where;  // tensor -> index in s.metadata.tensors
    for (std::size_t fi = 0; fi < names.size(); ++fi) {
      const std::string& n = names[fi];
      R& st = opened[fi].storage;
      safetensors_header& h = opened[fi].header;
      if (!is_dcp_sharded_header(h))
        fail(errc::invalid_metadata, h.file + ": no " + std::string(dcp_sharding_info_key) +
                                         " in __metadata__, but other safetensors files of the folder have one "
                                         "(a folder of torch's sharded Hugging Face files holds only those)");
      const dcp_block_offsets offs = parse_dcp_sharding_info(h);
      // in data order is the writer's order; the table is sorted by name below
      for (const auto& e : h.tensors) {
        const shape_t& at = offs.at(e.name);
        auto [it, fresh] = where.emplace(e.name, s.metadata.tensors.size());
        if (fresh) {
          tensor_metadata tm;
          tm.type = e.type;
          tm.is_sharded = true;
          tm.shape.assign(e.shape.size(), 0);
          s.metadata.tensors.emplace_back(e.name, std::move(tm));
        }
        tensor_metadata& tm = s.metadata.tensors[it->second].second;
        const std::string ctx = h.file + ": tensor '" + e.name + "'";
        if (e.type != tm.type)
          fail(errc::invalid_metadata, ctx + ": dtype " + std::string(to_string(e.type)) + " but " +
                                           tm.files.front().first + " holds it as " + std::string(to_string(tm.type)));
        if (e.shape.size() != tm.shape.size())
          fail(errc::invalid_metadata, ctx + ": " + std::to_string(e.shape.size()) + " dimensions but " +
                                           tm.files.front().first + " gives it " + std::to_string(tm.shape.size()));
        for (std::size_t d = 0; d < at.size(); ++d) tm.shape[d] = std::max(tm.shape[d], at[d] + e.shape[d]);
        tm.files.emplace_back(n, shard_spec(block_spec(e.shape, at)));
      }
      s.metadata.extras.file_sizes.emplace(n, h.file_size());
      s.files.emplace_back(n, std::make_unique<opened_file<R>>(opened_file<R>{std::move(st), std::move(h)}));
    }
    std::sort(s.metadata.tensors.begin(), s.metadata.tensors.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [key, tm] : s.metadata.tensors) {
      if (!detail::checked_numel(tm.shape))
        fail(errc::invalid_metadata, std::string(dir.name()) + ": tensor '" + key + "': full shape " +
                                         to_string(tm.shape) + " has more than 2^64 elements");
      for (auto& [fname, spec] : tm.files) spec.validate(tm.shape, std::string(dir.name()) + "/" + fname);
    }
    return s;
  }

  /// The source of the torch DCP folder dir: `.metadata` read (rules in format/dcp_metadata.hpp),
  /// no data file opened (rules at the top).
};

}  // namespace shardsafe
