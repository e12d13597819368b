// shardsafe/format/rename.hpp - tensor key renaming between a model and a Hugging Face folder
// (docs/FORMAT.md §4, `to-hf --rename REGEX=REPL`): ordered regex rules, and LoRA base-layer
// names.
//
// Rules are tried in order on each key; the first rule whose regex matches anywhere in the key
// rewrites it (every match in the key replaced, as Python's re.subn does) and no later rule is
// tried. This is how transformers applies a model's `_checkpoint_conversion_mapping`. A key that
// no rule matches keeps its name; a key rewritten to the empty name is dropped.
//
// Rule text is `REGEX=REPL`:
// - the text is split at its first `=` that is not written `\=`; a `\=` in REGEX stands for `=`;
//   REPL is everything after the split and may hold `=`;
// - REGEX is an RE2 regex (Google's RE2: the syntax of Python's re and ECMAScript without
//   backreferences and lookarounds), searched anywhere in the key: anchor it with `^` and `$` to
//   match whole keys. RE2 matches in time linear in the key's length, whatever the pattern: a
//   hostile rule (`^(a+)+$`) or a key of 30,000 characters costs what its length costs, where a
//   backtracking engine recurses per character or backtracks exponentially;
// - REPL is written as for Python's re.sub: `\1`..`\9` insert a group, `\\` a backslash; every
//   other character is literal (`$` included).
#pragma once

#include <re2/re2.h>

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"

namespace shardsafe {

/// One rename rule: a compiled regex and its replacement.
struct rename_rule {
  std::string text;         ///< the rule as written, `REGEX=REPL`, for messages
  std::string pattern;      ///< REGEX, with `\=` unescaped
  std::string replacement;  ///< REPL as written (Python re.sub syntax, which is also RE2's rewrite syntax)
  std::shared_ptr<const re2::RE2> regex;  ///< pattern, compiled (shared: RE2 is immutable and thread-safe)

  /// Whether the regex matches anywhere in key.
  bool matches(std::string_view key) const {
    // (ptr, size): RE2's text type is re2::StringPiece before 2023, absl::string_view after
    return re2::RE2::PartialMatch({key.data(), key.size()}, *regex);
  }
  /// key with every match of the regex replaced by REPL (Python's re.sub).
  std::string replace_all(std::string_view key) const {
    std::string out(key);
    re2::RE2::GlobalReplace(&out, *regex, replacement);
    return out;
  }
  /// A rule of a preset may pass its result on to the rules after it instead of deciding the
  /// name (rules a user writes never do).
  bool then_continue = false;
  /// A rule of a preset may come with a warning for the names it decides (the tool prints it).
  std::string warning;
};

/// Parses `REGEX=REPL` (syntax at the top of this header). Throws errc::invalid_argument naming
/// the rule: no `=`, an empty REGEX, a REGEX RE2 refuses (its message included: a backreference,
/// a lookaround, a program larger than RE2's memory budget), or a REPL with a bad escape.
SHARDSAFE_DECL rename_rule parse_rename_rule(std::string_view text);

/// Ordered rename rules; see the top of this header.
class rename_rules {
 public:
  rename_rules() = default;
  /// Parses each `REGEX=REPL` in order (parse_rename_rule).
  explicit rename_rules(const std::vector<std::string>& texts) {
    for (const auto& t : texts) rules_.push_back(parse_rename_rule(t));
  }
  void add(std::string_view text) { rules_.push_back(parse_rename_rule(text)); }
  bool empty() const noexcept { return rules_.empty(); }
  const std::vector<rename_rule>& rules() const noexcept { return rules_; }

  void add(rename_rule r) { rules_.push_back(std::move(r)); }
  /// The new name of `key`: rewritten by the first rule that matches, or `key` itself when none
  /// does (a then_continue rule rewrites it and lets the next rules try the result). Empty means
  /// the key is dropped. `decided`, when given, is set to the rule that decided (nullptr: none).
  std::string apply(std::string_view key, const rename_rule** decided = nullptr) const {
    std::string k(key);
    if (decided) *decided = nullptr;
    for (const auto& r : rules_)
      if (r.matches(k)) {
        k = r.replace_all(k);
        if (r.then_continue) continue;
        if (decided) *decided = &r;
        return k;
      }
    return k;
  }

 private:
  std::vector<rename_rule> rules_;
};

/// The rename presets a user may name (`to-hf --preset NAME`, docs/FORMAT.md §4).
inline constexpr std::string_view rename_presets[] = {"dcp-to-hf"};

/// Adds the rules of preset `name` after those rules already has. errc::invalid_argument for a
/// name not in rename_presets.
///
/// `dcp-to-hf`: the keys of a model saved through torch.distributed.checkpoint as
/// {"model": model.state_dict(), "optim": ...}, as Hugging Face names them:
///   1. the wrapper names torch.compile, FSDP1 and activation checkpointing put into keys are
///      removed (`_orig_mod.`, `_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`), and the
///      rules below see the result;
///   2. `model.model.X` -> `model.X`;
///   3. `model.lm_head.weight` -> `lm_head.weight`;
///   4. any other `model.X` -> `X`, with a warning;
///   5. every other key (optimizer state, extra state) is dropped.
inline void add_preset(rename_rules& rules, std::string_view name) {
  if (name != "dcp-to-hf")
    fail(errc::invalid_argument, "rename preset '" + std::string(name) + "': unknown (known: dcp-to-hf)");
  rename_rule wrappers = parse_rename_rule("\\b(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\\.=");
  wrappers.then_continue = true;
  rules.add(std::move(wrappers));
  rules.add("^model\\.model\\.=model.");
  rules.add("^model\\.lm_head\\.weight$=lm_head.weight");
  rename_rule other = parse_rename_rule("^model\\.=");
  other.warning =
      "a 'model.' key that is neither 'model.model.*' nor 'model.lm_head.weight': its 'model.' prefix removed";
  rules.add(std::move(other));
  rename_rule rest = parse_rename_rule("^[\\s\\S]*$=");
  rest.warning = "not a 'model.' key (optimizer or extra state): dropped";
  rules.add(std::move(rest));
}

/// Renames every key: returns new name -> old name, sorted by new name, keys renamed to the
/// empty name left out. Throws errc::invalid_argument, naming `context`, both old keys and the
/// new name, when two keys get the same new name.
inline std::map<std::string, std::string> rename_keys(const std::vector<std::string>& keys, const rename_rules& rules,
                                                      std::string_view context) {
  std::map<std::string, std::string> out;
  for (const auto& k : keys) {
    std::string n = rules.apply(k);
    if (n.empty()) continue;
    auto [it, fresh] = out.emplace(n, k);
    if (!fresh)
      fail(errc::invalid_argument, std::string(context) + ": tensors '" + it->second + "' and '" + k +
                                       "' are both renamed to '" + n + "'; rename rules must keep names distinct");
  }
  return out;
}

// LoRA base layers. PEFT wraps an adapted module: its original weight becomes
// `x.base_layer.weight` in the model, next to the adapter's `x.lora_A.weight`, `x.lora_B.weight`
// (and `lora_embedding_A/B`, `lora_magnitude_vector`), while the base model's file holds
// `x.weight`. These helpers map one name to the other.

/// The file name of a model name: every `base_layer` component removed
/// (`a.q.base_layer.weight` -> `a.q.weight`); a name without one is returned as it is.
inline std::string strip_base_layer(std::string_view model_name) {
  std::string out;
  std::size_t start = 0;
  while (start <= model_name.size()) {
    std::size_t dot = model_name.find('.', start);
    if (dot == std::string_view::npos) dot = model_name.size();
    const std::string_view part = model_name.substr(start, dot - start);
    if (part != "base_layer") {
      if (!out.empty()) out += '.';
      out += part;
    }
    start = dot + 1;
  }
  return out;
}

/// The model name of a file name in a LoRA-wrapped module: `base_layer` inserted before the last
/// component (`a.q.weight` -> `a.q.base_layer.weight`; `bias` -> `base_layer.bias`).
inline std::string insert_base_layer(std::string_view file_name) {
  const std::size_t dot = file_name.rfind('.');
  if (dot == std::string_view::npos) return "base_layer." + std::string(file_name);
  return std::string(file_name.substr(0, dot)) + ".base_layer" + std::string(file_name.substr(dot));
}

/// True for a name with a `base_layer` component.
inline bool has_base_layer(std::string_view name) { return strip_base_layer(name).size() != name.size(); }

/// True for the name of a LoRA adapter tensor: a component that starts with `lora_`
/// (`lora_A`, `lora_B`, `lora_embedding_A`, `lora_magnitude_vector`, ...). A base model's file
/// does not hold these, so a strict load does not count them missing (as PEFT's loader does).
inline bool is_lora_adapter_name(std::string_view name) {
  std::size_t start = 0;
  while (start <= name.size()) {
    std::size_t dot = name.find('.', start);
    if (dot == std::string_view::npos) dot = name.size();
    if (name.substr(start, dot - start).starts_with("lora_")) return true;
    start = dot + 1;
  }
  return false;
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/rename.ipp"
#endif
