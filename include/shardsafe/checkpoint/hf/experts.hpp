// shardsafe/checkpoint/hf/experts.hpp - stacked expert weights of a mixture-of-experts model
// against a Hugging Face folder's per-expert tensors.
//
// A model with expert parallelism keeps the weights of a layer's E experts as one stacked
// parameter `…experts.NAME` of shape [E, ...] (dimension 0 the expert; placed on an
// ("ep", "ep_fsdp") mesh by [shard(0), shard(1)], shard/mesh.hpp), while a Hugging Face folder
// holds one tensor per expert, `…experts.{i}.NAME` of shape [...]. Expert stacking rules say
// which model keys are stacked and how their experts are named in the folder:
//
//   REGEX=REPL    as a rename rule (format/rename.hpp): REGEX searched in the model key, REPL
//                 in Python re.sub syntax (`\1`..`\9`, `\\`), and REPL must hold `{i}`, which
//                 stands for the expert's index (0 .. E-1) in the names it makes.
//
// e.g. `^(.*\.experts)\.([^.]+\.weight)$=\1.{i}.\2` makes `layers.3.mlp.experts.w1.weight`
// [8, 64, 32] the eight tensors `layers.3.mlp.experts.0.w1.weight` .. `…experts.7.w1.weight`,
// each [64, 32]. The first rule whose REGEX matches a key decides; a key no rule matches is not
// stacked.
//
// unstack_experts() replaces each stacked view by one view per expert the rank holds any of,
// pointing into the stacked view's memory (nothing is copied; for a block spec, expert i's
// slab is contiguous in the block's row-major data; for a flat spec, the ranges meeting
// expert i's flat window are consecutive in local memory):
//
// | stacked view's spec             | expert i's view                                          |
// |---------------------------------|----------------------------------------------------------|
// | none (the whole [E, ...])       | none: the whole [...] tensor, at i * numel([...])         |
// | block [l0, l...] at [o0, o...]  | for o0 <= i < o0 + l0: block [l...] at [o...]             |
// | flat ranges of [E * S)          | the ranges' parts in [i*S, (i+1)*S), shifted by -i*S       |
//
// and a rank holding nothing of expert i gets no view for it. The views keep the stacked view's
// dtype and replica role. Everything after works on the per-expert views as on any others:
// an import (hf_key_options::experts) maps their names through the rename rules, so each rank
// reads only the bytes of its own experts' slices; an export (hf_export_options::experts:
// export_to from views, each rank writing its own slices) writes one Hugging Face tensor per
// expert. export_to, from a saved checkpoint, applies the same rules to its tensors' names and
// reads each expert's tensor from its flat slice of the stacked one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

/// Ordered expert stacking rules (syntax at the top of this header).
class expert_stacking {
 public:
  expert_stacking() = default;
  /// Parses each `REGEX=REPL` in order; see add().
  explicit expert_stacking(const std::vector<std::string>& texts) {
    for (const auto& t : texts) add(t);
  }
  /// Parses one rule. Throws errc::invalid_argument naming the rule: any error of
  /// parse_rename_rule, or a REPL without `{i}`.
  void add(std::string_view text) {
    rename_rule r = parse_rename_rule(text);
    if (r.replacement.find("{i}") == std::string::npos)
      fail(errc::invalid_argument, "expert stacking rule '" + r.text +
                                       "': REPL has no '{i}' (where the expert's index goes in the per-expert names)");
    rules_.push_back(std::move(r));
  }
  bool empty() const noexcept { return rules_.empty(); }
  const std::vector<rename_rule>& rules() const noexcept { return rules_; }

  /// The rule that stacks model key `key` (the first whose REGEX matches), or nullptr.
  const rename_rule* match(std::string_view key) const {
    for (const auto& r : rules_)
      if (r.matches(key)) return &r;
    return nullptr;
  }

  /// The name of expert i of stacked key `key` under rule r.
  static std::string expert_name(const rename_rule& r, std::string_view key, std::uint64_t i) {
    std::string n = r.replace_all(key);
    const std::string idx = std::to_string(i);
    for (std::size_t at = n.find("{i}"); at != std::string::npos; at = n.find("{i}", at + idx.size()))
      n.replace(at, 3, idx);
    return n;
  }

 private:
  std::vector<rename_rule> rules_;
};

/// The most experts one stacked tensor may be split into (mixture-of-experts layers have tens to
/// hundreds): a count read from a file is checked against it before anything is allocated.
inline constexpr std::uint64_t max_experts = std::uint64_t(1) << 16;

/// The per-expert views unstack_experts made, and where each came from.
struct unstacked_views {
  std::vector<flat_view> views;       ///< the given views in order, each stacked one replaced by its experts'
  std::vector<std::size_t> origin;    ///< per view: the index of the given view it is (or is part of)
  std::vector<std::uint64_t> expert;  ///< per view: its expert index (0 for a view not stacked)
  std::uint64_t stacked = 0;          ///< given views that were split into experts
  /// The names of the experts of stacked views that this rank holds nothing of (other ranks
  /// do), sorted: an import does not count their tensors as unexpected.
  std::vector<std::string> elsewhere;
};

namespace detail {

/// Expert i's part of flat spec s over a stacked tensor of E experts of S elements: the ranges
/// shifted into [0, S) and the local offset of the first element (nullopt: s holds none of it).
inline std::optional<std::pair<flat_spec, std::uint64_t>> expert_part(const flat_spec& s, std::uint64_t i,
                                                                      std::uint64_t S) {
  const std::uint64_t lo = i * S, hi = lo + S;
  std::vector<element_range> out;
  std::uint64_t local = 0, first = 0;
  bool any = false;
  for (const auto& r : s.ranges()) {
    const std::uint64_t a = std::max(r.begin, lo), b = std::min(r.end, hi);
    if (a < b) {
      if (!any) first = local + (a - r.begin);
      any = true;
      out.push_back({a - lo, b - lo});
    }
    local += r.end - r.begin;
  }
  if (!any) return std::nullopt;
  return std::pair{flat_spec(std::move(out)), first};
}

}  // namespace detail

/// Splits every view a rule stacks into per-expert views (table at the top). ctx starts every
/// message. Throws errc::invalid_argument for a stacked 0-d view (no expert dimension) or
/// two resulting views of one name, and whatever flat_view::validate throws for a view that
/// does not fit its spec.
SHARDSAFE_DECL unstacked_views unstack_experts(std::span<const flat_view> views, const expert_stacking& rules,
                                               std::string_view ctx);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/hf/impl/experts.ipp"
#endif
