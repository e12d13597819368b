// shardsafe/checkpoint/impl/dcp_save.ipp - dcp_save.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/dcp_save.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL std::vector<dcp_chunk_data> dcp_chunks_to_write(std::span<const flat_view> views,
                                                               const checkpoint_metadata& md, int rank, bool tree) {
  std::vector<dcp_chunk_data> out;
  for (const auto& v : views) {
    const tensor_metadata* tm = md.find(v.key);
    if (!dcp_writes(v, *tm, rank, tree)) continue;
    const std::uint64_t item = item_size(v.type);
    auto add = [&](shape_t offsets, shape_t sizes, std::uint64_t local) {
      out.push_back({{v.key, v.type, std::move(offsets), std::move(sizes)}, v.data + local * item, 0});
    };
    if (tm->numel() == 0) {  // an empty tensor: one empty chunk, written by its first file
      // (over the tree, tensors of no elements are not sharded: dcp_shards_distinct)
      if (&tm->files.front().first == dcp_writer_of(v, *tm)) add(shape_t(v.full_shape.size(), 0), v.full_shape, 0);
      continue;
    }
    if (!v.spec) {
      add(shape_t(v.full_shape.size(), 0), v.full_shape, 0);
    } else if (v.spec->is_block()) {
      const block_spec& b = v.spec->block();
      if (b.local_numel() > 0) add(b.global_offset(), b.local_shape(), 0);
    } else {
      std::uint64_t local = 0;
      for (const auto& r : v.spec->flat().ranges())
        for (auto& blk : blocks_of_range(v.full_shape, r)) {
          const std::uint64_t n = numel(blk.sizes);
          add(std::move(blk.offsets), std::move(blk.sizes), local);
          local += n;
        }
    }
  }
  return out;
}

SHARDSAFE_DECL bool dcp_shards_distinct(const checkpoint_metadata& md) {
  for (const auto& [key, tm] : md.tensors) {
    if (!tm.is_sharded) continue;
    if (tm.numel() == 0) return false;
    std::set<std::string> seen;
    for (const auto& [fname, spec] : tm.files)
      if (spec.local_numel() > 0 && !seen.insert(to_string(spec)).second) return false;
  }
  return true;
}

}  // namespace detail
}  // namespace shardsafe
