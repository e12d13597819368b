// shardsafe/checkpoint/impl/dcp_save.ipp - dcp_save.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/dcp_save.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL std::vector<dcp_chunk_data> dcp_chunks_to_write(std::span<const flat_view> views,
                                                               const agreed_description& agreed, int rank) {
  const checkpoint_metadata& md = agreed.md;
  std::vector<dcp_chunk_data> out;
  for (const auto& v : views) {
    const tensor_metadata* tm = md.find(v.key);
    if (!dcp_writes(v, *tm, rank, agreed)) continue;
    const std::uint64_t item = item_size(v.type);
    auto add = [&](shape_t offsets, shape_t sizes, std::uint64_t local) {
      out.push_back({{v.key, v.type, std::move(offsets), std::move(sizes)}, v.data + local * item, 0});
    };
    if (tm->numel() == 0) {  // an empty tensor: one empty chunk, written by its first file
      // (over the tree a sharded one's other holders have it in saved_lower: dcp_writes said no)
      if ((agreed.tree && tm->is_sharded) || &tm->files.front().first == dcp_writer_of(v, *tm))
        add(shape_t(v.full_shape.size(), 0), v.full_shape, 0);
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

SHARDSAFE_DECL std::string dcp_writers_of_repeats(const checkpoint_metadata& md, int world,
                                                  std::vector<std::string>& lower) {
  std::map<std::string, int> rank_of;  // file name -> rank
  for (int r = 0; r < world; ++r) rank_of.emplace(rank_file_name(r), r);
  std::vector<std::vector<std::pair<const std::string*, std::string>>> saved(static_cast<std::size_t>(world));
  bool repeats = false;
  for (const auto& [key, tm] : md.tensors) {
    if (!tm.is_sharded) continue;
    if (tm.numel() == 0) {  // one empty chunk, written by its first file: every other holder is told
      for (std::size_t i = 1; i < tm.files.size(); ++i) {
        saved[static_cast<std::size_t>(rank_of.at(tm.files[i].first))].emplace_back(&key,
                                                                                    to_string(tm.files[i].second));
        repeats = true;
      }
      continue;
    }
    std::map<std::string, int> lowest;  // a shard (to_string) -> the lowest rank saving it (files in rank order)
    for (const auto& [fname, spec] : tm.files) {
      if (spec.local_numel() == 0) continue;
      const int r = rank_of.at(fname);
      const auto [it, fresh] = lowest.emplace(to_string(spec), r);
      if (!fresh && it->second < r) {
        saved[static_cast<std::size_t>(r)].emplace_back(&key, it->first);
        repeats = true;
      }
    }
  }
  if (!repeats) return "distinct";
  lower.clear();
  for (const auto& mine : saved) {
    message_writer m;
    m.count(mine.size());
    for (const auto& [key, spec] : mine) m.text(*key).text(spec);
    lower.push_back(std::move(m).str());
  }
  return "lower";
}

SHARDSAFE_DECL std::set<std::pair<std::string, std::string>> read_saved_lower(const std::string& bytes) {
  message_reader m(bytes, "rank 0 (the shards a lower rank writes)");
  std::set<std::pair<std::string, std::string>> out;
  for (std::uint64_t i = 0, n = m.items(16, "shards"); i < n; ++i) {
    std::string key = m.text();
    out.emplace(std::move(key), m.text());
  }
  m.finish();
  return out;
}

}  // namespace detail
}  // namespace shardsafe
