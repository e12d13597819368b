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
SHARDSAFE_DECL std::string write_checkpoint_metadata(const checkpoint_metadata& md);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/metadata_writer.ipp"
#endif
