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
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL hf_key_mapping map_hf_keys(std::span<const flat_view> views, std::span<const hf_tensor_info> table,
                                          const hf_key_options& opt, std::string_view ctx) {
  hf_key_mapping m;
  struct fed {
    std::size_t tensor;
    std::string rule;
  };
  std::map<std::string, fed, std::less<>> by_model_name;
  for (std::size_t t = 0; t < table.size(); ++t) {
    const std::string& fk = table[t].name;
    std::string rule;
    std::string mk = fk;
    for (const auto& r : opt.rename.rules())
      if (r.matches(fk)) {
        mk = r.replace_all(fk);
        rule = "rename rule '" + r.text + "'";
        break;
      }
    if (mk.empty()) {
      m.dropped_keys.push_back(fk);
      continue;
    }
    auto [it, fresh] = by_model_name.emplace(mk, fed{t, rule});
    if (!fresh)
      fail(errc::invalid_argument, std::string(ctx) + ": tensors '" + table[it->second.tensor].name + "' and '" + fk +
                                       "' are both renamed to '" + mk + "' (" +
                                       (rule.empty() ? it->second.rule : rule) +
                                       "); rename rules must keep names distinct");
  }
  auto feed = [&](const std::string& key) -> const fed* {
    if (auto it = by_model_name.find(key); it != by_model_name.end()) return &it->second;
    if (opt.lora_base_layer && has_base_layer(key))
      if (auto it = by_model_name.find(strip_base_layer(key)); it != by_model_name.end()) return &it->second;
    return nullptr;
  };

  std::vector<bool> used(table.size(), false);
  std::vector<bool> grouped(views.size(), false);
  std::multimap<const std::byte*, std::size_t> by_data;  // for tie lookup
  for (std::size_t i = 0; i < views.size(); ++i) by_data.emplace(views[i].data, i);
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (grouped[i]) continue;
    std::vector<std::size_t> group{i};  // i and the later views tied to it
    auto [lo, hi] = by_data.equal_range(views[i].data);
    for (auto it = lo; it != hi; ++it)
      if (it->second > i && !grouped[it->second] && detail::same_memory(views[i], views[it->second]))
        group.push_back(it->second);
    std::sort(group.begin(), group.end());
    std::optional<hf_import_entry> leader;
    for (std::size_t v : group) {
      grouped[v] = true;
      const fed* f = feed(views[v].key);
      if (!f) continue;
      used[f->tensor] = true;
      if (leader) continue;
      std::string how = f->rule;
      if (by_model_name.find(views[v].key) == by_model_name.end())
        how += std::string(how.empty() ? "" : ", ") + "LoRA base layer";
      leader = hf_import_entry{v, f->tensor, std::move(how)};
    }
    if (leader) {
      m.loads.push_back(std::move(*leader));
      m.loaded_views += group.size();
      m.tied_views += group.size() - 1;
    } else {
      for (std::size_t v : group) m.missing_keys.push_back(views[v].key);
    }
  }
  for (std::size_t t = 0; t < table.size(); ++t)
    if (!used[t] && std::find(m.dropped_keys.begin(), m.dropped_keys.end(), table[t].name) == m.dropped_keys.end())
      m.unexpected_keys.push_back(table[t].name);
  std::sort(m.missing_keys.begin(), m.missing_keys.end());
  std::sort(m.unexpected_keys.begin(), m.unexpected_keys.end());
  std::sort(m.dropped_keys.begin(), m.dropped_keys.end());
  if (opt.strict) {
    std::vector<std::string> strict_missing;
    for (const auto& k : m.missing_keys)
      if (!is_lora_adapter_name(k)) strict_missing.push_back(k);
    if (!strict_missing.empty())
      fail(errc::not_found,
           std::string(ctx) + ": strict import: " + std::to_string(strict_missing.size()) +
               " model tensor(s) fed by no tensor of the checkpoint (LoRA adapter weights excepted): " +
               key_examples(strict_missing, opt.examples));
  }
  return m;
}
#else
SHARDSAFE_DECL hf_key_mapping map_hf_keys(std::span<const flat_view> views, std::span<const hf_tensor_info> table,
                                          const hf_key_options& opt, std::string_view ctx);
#endif

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
