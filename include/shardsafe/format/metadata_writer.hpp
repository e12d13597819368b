// shardsafe/format/metadata_writer.hpp - renders a checkpoint's metadata.json
// (docs/FORMAT.md §2) in Python's json.dumps layout (separators, ASCII escapes), so files diff
// cleanly with OLMo-core's: write_checkpoint_metadata, and the checksum table of one file
// (append_checksum_table, also written alone beside a rank file).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/checkpoint_metadata.hpp"
#include "shardsafe/shard/shard_grid.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

namespace detail {

inline void append_counts(std::string& out, std::span<const std::uint64_t> v) {
  out += '[';
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(v[i]);
  }
  out += ']';
}

/// Renders one file's checksum table: {"TENSOR": ["HEX16", ...], ...} (tensors by name).
inline void append_checksum_table(std::string& out, const std::map<std::string, std::vector<std::uint64_t>>& table) {
  out += '{';
  bool first = true;
  for (const auto& [key, hashes] : table) {
    if (!first) out += ", ";
    first = false;
    append_json_string(out, key, /*ascii_only=*/true);
    out += ": [";
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      if (i) out += ", ";
      out += '"' + hex64(hashes[i]) + '"';
    }
    out += ']';
  }
  out += '}';
}

}  // namespace detail

/// Renders metadata.json in Python's json.dumps layout.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::string write_checkpoint_metadata(const checkpoint_metadata& md) {
  std::string out = "{\"tensors\": {";
  bool first = true;
  for (const auto& [key, t] : md.tensors) {
    if (!first) out += ", ";
    first = false;
    detail::append_json_string(out, key, /*ascii_only=*/true);
    out += ": {\"shape\": ";
    detail::append_counts(out, t.shape);
    out += ", \"is_sharded\": ";
    out += t.is_sharded ? "true" : "false";
    out += ", \"dtype\": \"";
    out += to_string(t.type);
    if (t.grid) {
      const shard_grid& g = *t.grid;
      out += "\", \"shardsafe_grid\": {\"flat\": ";
      out += g.flat ? "true" : "false";
      out += ", \"chunks\": ";
      detail::append_counts(out, g.chunks);
      out += ", \"parts\": ";
      detail::append_counts(out, g.parts);
      out += ", \"base\": " + std::to_string(g.base) + ", \"strides\": ";
      detail::append_counts(out, g.strides);
      out += "}}";
      continue;
    }
    out += "\", \"shard_spec_per_file\": {";
    bool ff = true;
    for (const auto& [fname, spec] : t.files) {
      if (!ff) out += ", ";
      ff = false;
      detail::append_json_string(out, fname, /*ascii_only=*/true);
      out += ": {\"flattened_offsets\": ";
      if (spec.is_flat()) {
        out += '[';
        const auto& rs = spec.flat().ranges();
        for (std::size_t i = 0; i < rs.size(); ++i) {
          if (i) out += ", ";
          out += '[' + std::to_string(rs[i].begin) + ", " + std::to_string(rs[i].end) + ']';
        }
        out += "], \"local_shape\": null, \"global_offset\": null}";
      } else {
        out += "null, \"local_shape\": ";
        detail::append_counts(out, spec.block().local_shape());
        out += ", \"global_offset\": ";
        detail::append_counts(out, spec.block().global_offset());
        out += '}';
      }
    }
    out += "}}";
  }
  out += '}';
  const auto& x = md.extras;
  if (!x.writer.empty() || x.world_size || !x.file_sizes.empty() || x.checksums) {
    out += ", \"shardsafe\": {";
    bool xf = true;
    auto sep = [&] {
      if (!xf) out += ", ";
      xf = false;
    };
    if (!x.writer.empty()) {
      sep();
      out += "\"writer\": ";
      detail::append_json_string(out, x.writer, /*ascii_only=*/true);
    }
    if (x.world_size) {
      sep();
      out += "\"world_size\": " + std::to_string(*x.world_size);
    }
    if (!x.file_sizes.empty()) {
      sep();
      out += "\"file_sizes\": {";
      bool sf = true;
      for (const auto& [fname, size] : x.file_sizes) {
        if (!sf) out += ", ";
        sf = false;
        detail::append_json_string(out, fname, /*ascii_only=*/true);
        out += ": " + std::to_string(size);
      }
      out += '}';
    }
    if (x.checksums) {
      sep();
      out += "\"checksums\": {\"algorithm\": ";
      detail::append_json_string(out, x.checksums->algorithm, /*ascii_only=*/true);
      out += ", \"block_bytes\": " + std::to_string(x.checksums->block_bytes);
      if (x.checksums->sidecars) out += ", \"sidecars\": true";
      out += ", \"files\": {";
      bool cf = true;
      for (const auto& [fname, table] : x.checksums->files) {
        if (!cf) out += ", ";
        cf = false;
        detail::append_json_string(out, fname, /*ascii_only=*/true);
        out += ": ";
        detail::append_checksum_table(out, table);
      }
      out += "}}";
    }
    out += '}';
  }
  out += '}';
  return out;
}
#else
SHARDSAFE_DECL std::string write_checkpoint_metadata(const checkpoint_metadata& md);
#endif

}  // namespace shardsafe
