// shardsafe/format/impl/metadata_writer.ipp - metadata_writer.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/metadata_writer.hpp"

namespace shardsafe {

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

}  // namespace shardsafe
