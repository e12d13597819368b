// shardsafe/format/hf_export.hpp - the plan of a Hugging Face export, made from metadata alone
// (docs/FORMAT.md §3 and §4, `to-hf --max-shard-size`): which tensors go to which file, the
// files' names, and the text of model.safetensors.index.json. No data is read here.
//
// Packing rule, the loop of transformers' `shard_checkpoint` (modeling_utils.py; the versions
// that check the current block is non-empty before splitting, so a large first tensor does not
// leave an empty first file): a tensor goes to the current file unless the file already holds
// a tensor and the tensor's bytes would take the file past the limit, in which case a new file
// starts. Python walks the state dict in its own order; here tensors are taken in name order.
// So a tensor larger than the limit gets a file of its own, and files keep name order. The limit
// counts tensor bytes only (not headers), as both Python writers do. (huggingface_hub's
// `split_state_dict_into_shards_factory` differs in one point: it appends a larger-than-limit
// tensor as its own shard at once and keeps filling the current one, so its files need not be
// in name order; here they always are.)
//
// File names: `model.safetensors` for one file, otherwise `model-00001-of-00003.safetensors`,
// numbers 1-based and 5 digits wide (`{idx:05d}-of-{n:05d}`, as both Python writers format them).
// The index is written only for more than one file, as the Python writers do.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
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
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/hf_index.hpp"

namespace shardsafe {

/// The default `--max-shard-size`: 5 GB (5 * 10^9 bytes), the Python writers' default.
inline constexpr std::uint64_t hf_default_max_shard_size = 5'000'000'000;

/// A size as `to-hf --max-shard-size` takes it: decimal digits, optionally followed by one of
/// KB, MB, GB (powers of 1000, as the Hugging Face writers count) or KiB, MiB, GiB (powers of
/// 1024); no sign, space or fraction. Throws errc::invalid_argument naming the input for
/// anything else, and for a size past 2^64 - 1.
SHARDSAFE_DECL std::uint64_t parse_size(std::string_view text);

/// What the plan needs to know of a tensor.
struct hf_tensor_info {
  std::string name;
  dtype type;
  shape_t shape;
};

/// One output file of the plan.
struct hf_export_file {
  std::string name;                  ///< `model.safetensors` or `model-0000i-of-0000N.safetensors`
  std::vector<std::size_t> tensors;  ///< indices into hf_export_plan::tensors, in name order
  std::uint64_t bytes = 0;           ///< sum of the tensors' bytes (headers not counted)
};

/// The whole export: files in order, and the index.
struct hf_export_plan {
  std::vector<hf_tensor_info> tensors;  ///< every tensor, sorted by name
  std::vector<std::uint64_t> bytes;     ///< bytes of each tensor (numel * item size)
  std::vector<hf_export_file> files;
  std::uint64_t total_size = 0;  ///< sum of all tensor bytes (the index's metadata.total_size)
  /// sum of all tensors' elements (the index's metadata.total_parameters, as today's transformers writes)
  std::uint64_t total_parameters = 0;

  /// True when the export writes model.safetensors.index.json (more than one file).
  bool indexed() const noexcept { return files.size() > 1; }

  /// tensor name -> file name, for every tensor.
  std::map<std::string, std::string> weight_map() const {
    std::map<std::string, std::string> m;
    for (const auto& f : files)
      for (std::size_t t : f.tensors) m.emplace(tensors[t].name, f.name);
    return m;
  }

  /// The text of model.safetensors.index.json, byte for byte what Python writes with
  /// `json.dumps({"metadata": {"total_parameters": P, "total_size": N}, "weight_map": {...}}, indent=2, sort_keys=True)
  /// + "\n"` (transformers and huggingface_hub both add the newline): 2-space indent, keys
  /// sorted by code point, non-ASCII characters as \uXXXX escapes.
  std::string index_json() const {
    std::string out = "{\n  \"metadata\": {\n    \"total_parameters\": " + std::to_string(total_parameters) +
                      ",\n    \"total_size\": " + std::to_string(total_size) + "\n  },\n";
    const auto wm = weight_map();
    out += "  \"weight_map\": {";
    bool first = true;
    for (const auto& [k, v] : wm) {  // std::map orders UTF-8 bytes, which is code point order
      out += first ? "\n    " : ",\n    ";
      first = false;
      detail::append_json_string(out, k, true);
      out += ": ";
      detail::append_json_string(out, v, true);
    }
    out += wm.empty() ? "}\n}\n" : "\n  }\n}\n";
    return out;
  }
};

/// The name of file `index` (0-based) of `count` files, as the Python writers name them.
inline std::string hf_shard_file_name(std::size_t index, std::size_t count) {
  if (count == 1) return std::string(hf_single_file);
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

/// Plans the export of `tensors` into files of at most `max_shard_size` tensor bytes (packing
/// rule at the top of this header). Throws errc::invalid_argument for an empty or repeated
/// name, and errc::invalid_shape for a size past 2^64 - 1; errc::unsupported_dtype for a
/// sub-byte dtype (their files are not split by element here). No tensors give one empty
/// model.safetensors.
SHARDSAFE_DECL hf_export_plan plan_hf_export(std::vector<hf_tensor_info> tensors, std::uint64_t max_shard_size);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/hf_export.ipp"
#endif
