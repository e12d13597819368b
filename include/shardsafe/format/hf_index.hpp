// shardsafe/format/hf_index.hpp - model.safetensors.index.json of a sharded Hugging Face
// checkpoint (docs/FORMAT.md §3):
//   {"metadata": {"total_parameters": ELEMENTS, "total_size": BYTES},
//    "weight_map": {"tensor.name": "model-00001-of-00002.safetensors"}}
// (total_parameters is what today's transformers adds beside total_size; older files lack it.)
// File names must be plain names in the same folder; every tensor is listed once. The totals
// are advisory, as for transformers, which never reads them: writers count them their own way
// (total_parameters without buffers; total_size with a bool as 1/8 byte, a float then), so a
// total that is not a count is left unread, and none is compared with the files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

inline constexpr std::string_view hf_single_file = "model.safetensors";
inline constexpr std::string_view hf_index_file = "model.safetensors.index.json";
/// The older layout: torch.save files (format/torch_save.hpp), read where a folder has no
/// safetensors weights; the index has the same form.
inline constexpr std::string_view hf_bin_single_file = "pytorch_model.bin";
inline constexpr std::string_view hf_bin_index_file = "pytorch_model.bin.index.json";

struct hf_index {
  std::optional<std::uint64_t> total_size;        ///< metadata.total_size, if given as a count (advisory)
  std::optional<std::uint64_t> total_parameters;  ///< metadata.total_parameters, if given as a count (advisory)
  std::map<std::string, std::string> metadata;    ///< other string entries of "metadata"
  std::map<std::string, std::string> weight_map;  ///< tensor name -> file name

  /// The files named, sorted, each once.
  std::vector<std::string> files() const {
    std::vector<std::string> f;
    for (const auto& [k, v] : weight_map) f.push_back(v);
    std::sort(f.begin(), f.end());
    f.erase(std::unique(f.begin(), f.end()), f.end());
    return f;
  }
};

/// The largest index.json a reader accepts (docs/FORMAT.md §3): parsed whole, its DOM and
/// weight_map cost about 7 times its text (a 139 MB index took 993 MiB); 16 MiB holds some 200,000
/// entries, twice DeepSeek-V3's.
inline constexpr std::uint64_t max_hf_index_size = std::uint64_t(16) << 20;

SHARDSAFE_DECL hf_index parse_hf_index(std::string_view json, std::string_view file);

/// Renders the index as Hugging Face does (indent 2, sorted keys, trailing newline).
SHARDSAFE_DECL std::string write_hf_index(const hf_index& idx);

template <ReadableStorage S>
hf_index read_hf_index(const S& s) {
  return parse_hf_index(read_text(s, max_hf_index_size, text_kind::json), s.name());
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/hf_index.ipp"
#endif
