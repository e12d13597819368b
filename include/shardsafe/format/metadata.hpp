// shardsafe/format/metadata.hpp - a sharded checkpoint's metadata.json (docs/FORMAT.md §2).
//
// The schema is OLMo-core's:
//   {"tensors": {KEY: {"shape": [...], "is_sharded": bool, "dtype": "F32",
//                      "shard_spec_per_file": {"rank_R.safetensors":
//                          {"flattened_offsets": [[s, e], ...] | null,
//                           "local_shape": [...] | null, "global_offset": [...] | null}}}}}
// plus the older "flattened_offsets_per_file": {file: [s, e] | [[s, e], ...]}, which is read
// and converted, and shardsafe's compact form of a regular sharding (shard/shard_grid.hpp), which
// stands in for shard_spec_per_file:
//   "shardsafe_grid": {"flat": bool, "chunks": [...], "parts": [...], "base": R, "strides": [...]}
// (files rank_R.safetensors; readers that do not know it refuse the tensor, as they should).
// shardsafe's own additions live under a top-level "shardsafe" object that other readers ignore. We write in Python's json.dumps layout (separators, ASCII escapes) so
// files diff cleanly with OLMo-core's.
//
// This header reads metadata.json (parse_checkpoint_metadata, read_checkpoint_metadata) and
// includes the rest:
//   checkpoint_metadata.hpp  the metadata in memory (tensor_metadata, checkpoint_metadata, ...)
//   metadata_parts.hpp       readers of its parts (shard specs, grids, checksum tables)
//   metadata_writer.hpp      write_checkpoint_metadata
#pragma once

#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/checkpoint_metadata.hpp"
#include "shardsafe/format/metadata_parts.hpp"
#include "shardsafe/format/metadata_writer.hpp"
#include "shardsafe/shard/shard_grid.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// Parses and validates metadata.json text. `file` names it in messages. Every shard spec is
/// validated against its tensor's shape, and file names must be plain names. The text is read
/// On-Demand (no DOM), twice: checked whole, then read; memory stays near the text's size plus
/// what is returned. `owner`: the string holding `json` when it has 64 spare bytes of capacity
/// (read in place; else the text is copied once).
SHARDSAFE_DECL checkpoint_metadata parse_checkpoint_metadata(std::string_view json, std::string_view file,
                                                             const std::string* owner = nullptr);

/// The same, reading `json` in place (read_text leaves the spare capacity simdjson needs).
template <class S>
  requires std::same_as<S, std::string>
checkpoint_metadata parse_checkpoint_metadata(const S& json, std::string_view file) {
  return parse_checkpoint_metadata(std::string_view(json), file, &json);
}

/// Reads and validates metadata.json from a storage.
template <ReadableStorage S>
checkpoint_metadata read_checkpoint_metadata(const S& s) {
  return parse_checkpoint_metadata(read_text(s, max_metadata_size, text_kind::json), s.name());
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/metadata.ipp"
#endif
