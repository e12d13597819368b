// shardsafe/checkpoint/hf/import_keys.hpp - which tensor of a Hugging Face folder feeds which
// of the caller's flat views, decided from names and memory alone (no I/O, no communication).
//
// A file key is renamed by the rules (format/rename.hpp: first match wins, as transformers'
// `_checkpoint_conversion_mapping` maps file keys to model keys); a key renamed to "" is
// dropped. A view (a model key) is then fed by:
//   1. the file key renamed to its name, or else
//   2. with lora_base_layer, for a model key with a `base_layer` component
//      (`x.q.base_layer.weight`, PEFT's wrapped module), the file key renamed to the name
//      without it (`x.q.weight`).
// Views that share memory (same data pointer, byte count, dtype, full shape and spec: tied
// weights such as an input embedding and the output projection; a rank's empty shards of a
// tied pair too, whose data pointers may both be null) are loaded once, from the
// first of them (in the caller's order) that some file key feeds; the others count as loaded
// and tied, and every file key that feeds one of them counts as used. When none is fed, each
// is missing.
//
// Reported: missing keys (views nothing feeds), unexpected keys (file keys no view uses),
// dropped keys (renamed to ""), each sorted. A strict import fails with errc::not_found on a
// missing key that is not a LoRA adapter weight (`is_lora_adapter_name`: a base model's file
// has none, and PEFT's loader does not ask for them).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/hf/experts.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/hf_export.hpp"  // hf_tensor_info: name, dtype, full shape of a tensor
#include "shardsafe/format/rename.hpp"

namespace shardsafe {

/// How an import maps names; see the top of this header.
struct hf_key_options {
  rename_rules rename;           ///< file key -> model key, first match wins; "" drops the key
  bool lora_base_layer = false;  ///< feed `x.base_layer.w` from file key `x.w`
  bool strict = true;  ///< missing keys (LoRA adapter weights excepted) are errc::not_found (as load_options::strict)
  bool convert_dtypes = true;  ///< F16/BF16/F32/F64 files load into views of another of them
  std::size_t examples = 5;    ///< keys named in messages, per list
  /// Stacked expert weights (checkpoint/hf/experts.hpp): a view these rules match is fed by
  /// the file's per-expert tensors, each rank reading only its own experts' slices. The
  /// mapping (and its missing / unexpected keys) is then in per-expert names.
  expert_stacking experts;
};

/// One load an import does: view `view` from checkpoint tensor `tensor` (an index into the
/// table given to map_hf_keys); `how` says why, for messages.
struct hf_import_entry {
  std::size_t view = 0;
  std::size_t tensor = 0;
  std::string how;  ///< "", "rename rule 'R'", "LoRA base layer", or both joined by ", "
};

/// What map_hf_keys decided.
struct hf_key_mapping {
  std::vector<hf_import_entry> loads;  ///< one per distinct memory fed, in view order
  std::uint64_t loaded_views = 0;      ///< views that get data (tied ones included)
  std::uint64_t tied_views = 0;        ///< of those, views fed through another view's memory
  std::vector<std::string> missing_keys, unexpected_keys, dropped_keys;  ///< sorted
};

/// "a, b, c" or "a, b, c, d, e, ...": the first `examples` keys.
inline std::string key_examples(const std::vector<std::string>& keys, std::size_t examples) {
  std::string s;
  for (std::size_t i = 0; i < keys.size() && i < examples; ++i) s += (i ? ", " : "") + keys[i];
  if (keys.size() > examples) s += ", ...";
  return s;
}

/// "0", "3 (a, b, c)" or "12 (a, b, c, d, e, ...)": a count and the first `examples` keys.
inline std::string count_with_examples(const std::vector<std::string>& keys, std::size_t examples) {
  if (keys.empty()) return "0";
  return std::to_string(keys.size()) + " (" + key_examples(keys, examples) + ")";
}

namespace detail {

/// Two views name the same memory the same way (tied weights).
inline bool same_memory(const flat_view& a, const flat_view& b) {
  return a.data == b.data && a.nbytes == b.nbytes && a.type == b.type && a.full_shape == b.full_shape &&
         a.spec == b.spec;
}

}  // namespace detail

/// Maps views to the checkpoint's tensors (rules at the top). `ctx` (the folder) starts every
/// message. Throws errc::invalid_argument when two file keys are renamed to one name, and
/// errc::not_found for a strict import with missing keys.
SHARDSAFE_DECL hf_key_mapping map_hf_keys(std::span<const flat_view> views, std::span<const hf_tensor_info> table,
                                          const hf_key_options& opt, std::string_view ctx);

/// Checks one load of a mapping: the view against its spec and memory, and against the
/// checkpoint tensor's shape and dtype. Messages name the folder, both keys and the rule.
inline void check_hf_import_entry(const flat_view& v, const hf_tensor_info& t, const hf_import_entry& e,
                                  bool convert_dtypes, std::string_view ctx) {
  v.validate(ctx);
  std::string c = std::string(ctx) + ": tensor '" + t.name + "'";
  if (t.name != v.key) c += " (model tensor '" + v.key + "'" + (e.how.empty() ? "" : ", by " + e.how) + ")";
  if (t.shape != v.full_shape)
    fail(errc::shape_mismatch,
         c + ": the checkpoint has shape " + to_string(t.shape) + ", the model's tensor " + to_string(v.full_shape));
  if (t.type != v.type && !(convert_dtypes && is_convertible_float(t.type) && is_convertible_float(v.type)))
    fail(errc::dtype_mismatch,
         c + ": the checkpoint has dtype " + std::string(to_string(t.type)) + ", the model's tensor " +
             std::string(to_string(v.type)) +
             (convert_dtypes ? " (only F16, BF16, F32 and F64 convert)" : " (conversion is off)"));
}

/// "loaded 7 tensors (1 tied); missing 2 (a, b); unexpected 1 (c); dropped 0".
inline std::string describe(const hf_key_mapping& m, std::size_t examples) {
  return "loaded " + std::to_string(m.loaded_views) + " tensor(s) (" + std::to_string(m.tied_views) +
         " tied); missing " + count_with_examples(m.missing_keys, examples) + "; unexpected " +
         count_with_examples(m.unexpected_keys, examples) + "; dropped by rename rules " +
         count_with_examples(m.dropped_keys, examples);
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/hf/impl/import_keys.ipp"
#endif
