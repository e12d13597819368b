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

/// Largest metadata.json a reader accepts (docs/FORMAT.md §2, "Size"): a reader holds its text,
/// simdjson's index of it and what it lists at once, about 4 times its size at the peak (5 for the
/// tool's commands with every rank file's header open): 32 MiB keeps each within 256 MiB. Larger
/// worlds use the compact form, which a save switches to past compact_metadata_entries.
inline constexpr std::uint64_t max_checkpoint_metadata_size = std::uint64_t(32) << 20;

/// Most shard entries (a tensor's files, summed over its tensors) a metadata.json may list
/// (docs/FORMAT.md §2, "Size"): what a reader builds is ~180 bytes an entry, and the tool's
/// commands hold as much again of the rank files' headers, whatever the bytes of an entry. A
/// save lists at most half (compact_metadata_entries).
inline constexpr std::uint64_t max_listed_metadata_entries = std::uint64_t(1) << 18;

namespace detail {
/// The refusal of a metadata.json of `bytes` bytes, past max_checkpoint_metadata_size.
[[noreturn]] inline void metadata_too_large(std::string_view file, std::uint64_t bytes) {
  fail(errc::invalid_metadata,
       std::string(file) + ": " + std::to_string(bytes) + " bytes, more than the " +
           std::to_string(max_checkpoint_metadata_size) +
           " (32 MiB) a metadata.json may hold (docs/FORMAT.md §2): a checkpoint of this many shard entries "
           "is saved in the compact form (save_options::metadata, metadata_form::compact)");
}
}  // namespace detail

/// Parses and validates metadata.json text (at most max_checkpoint_metadata_size bytes). `file`
/// names it in messages. Every shard spec is
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
  // by the size the storage claims, before reading (read_text holds it to that size too)
  if (const std::uint64_t n = s.size(); n > max_checkpoint_metadata_size) detail::metadata_too_large(s.name(), n);
  return parse_checkpoint_metadata(read_text(s, max_checkpoint_metadata_size, text_kind::json), s.name());
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/metadata.ipp"
#endif
