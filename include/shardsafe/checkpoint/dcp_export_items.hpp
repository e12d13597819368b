// shardsafe/checkpoint/dcp_export_items.hpp - the keys an export to DCP writes (checkpoint/
// dcp_export.hpp): one item per key (a tensor or item of a source, a value, or a tensor the export
// makes), and a trainer's names placed as torch's get_state_dict places a model and its
// optimizer (docs/FORMAT.md §6): trainer_state_place, and the step a trainer keeps per param group
// made each parameter's (spread_group_steps).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_repr.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {
namespace detail {

/// Where a trainer layout's name goes in the state dict get_state_dict makes (the table above):
/// its key and path, nullopt for an item kept under its name, or an empty key for one left out
/// (a rank's RNG state: Megatron's rng_state/shard_... items, whose archives hold tensors).
inline std::optional<std::pair<std::string, pickle_value>> trainer_state_place(const std::string& name, bool item) {
  auto str = [](std::string s) { return pickle_value::string(std::move(s)); };
  static constexpr std::string_view state = "optimizer.state.";
  // the groups of the torch optimizer inside a trainer's wrapper (Megatron's distributed
  // optimizer and bf16/fp16 wrapper keep only those) are the optimizer's groups
  const std::string_view groups = name.starts_with("optimizer.optimizer.param_groups.")
                                      ? "optimizer.optimizer.param_groups."
                                      : "optimizer.param_groups.";
  if (!item) {
    const auto dot = name.rfind('.');
    if (name.starts_with(state) && dot != std::string::npos && dot > state.size()) {
      const std::string param = name.substr(state.size(), dot - state.size()), field = name.substr(dot + 1);
      return std::pair{"optim.state." + param + "." + field,
                       pickle_value::tuple({str("optim"), str("state"), str(param), str(field)})};
    }
    return std::pair{"model." + name, pickle_value::tuple({str("model"), str(name)})};
  }
  if (name.starts_with("rng_state")) return std::pair{std::string(), pickle_value::none()};
  if (!name.starts_with(groups)) return std::nullopt;
  const std::string rest = name.substr(groups.size());
  const auto dot = rest.find('.');
  if (dot == std::string::npos || dot == 0 || dot > 9 || rest.find('.', dot + 1) != std::string::npos ||
      rest.substr(0, dot).find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  const std::string field = rest.substr(dot + 1);
  return std::pair{"optim.param_groups." + rest,
                   pickle_value::tuple({str("optim"), str("param_groups"),
                                        pickle_value::integer(std::stoll(rest.substr(0, dot))), str(field)})};
}

/// One key to export: a tensor of a source, a DCP source's non-tensor item, or a value.
template <ReadableDirectory S>
struct dcp_export_item {
  std::string key;    ///< before renaming
  pickle_value path;  ///< its path in the nested state dict; None for (key,), what .metadata gives a key without one
  checkpoint_reader<S>* reader = nullptr;  ///< a tensor or an item: where it is
  std::string source_key;
  pickle_value value;   ///< a value (reader == nullptr)
  bool object = false;  ///< source_key is a non-tensor item of reader: its archive is copied as it is
  std::string made;     ///< a tensor the export makes (reader == nullptr): an F32 scalar's 4 bytes
  bool tensor() const noexcept { return (reader && !object) || !made.empty(); }
};

/// A trainer's step kept per param group (Megatron's distributed optimizer) made each named
/// parameter's, for the parameters with optimizer state and no step of their own: torch's AdamW
/// keeps one per parameter (an F32 scalar tensor), and get_state_dict's optimizer asks for it.
template <ReadableDirectory S>
void spread_group_steps(checkpoint_reader<S>& r, std::vector<dcp_export_item<S>>& items) {
  std::set<std::string> keys;
  for (const auto& it : items)
    if (it.reader == &r) keys.insert(it.key);
  const std::string where(r.directory().name());
  std::vector<dcp_export_item<S>> made;
  for (const auto& it : items) {
    if (it.reader != &r || !it.object || !it.key.starts_with("optim.param_groups.") || !it.key.ends_with(".step"))
      continue;
    const std::string group = it.key.substr(0, it.key.size() - 5);
    const auto p = std::find_if(items.begin(), items.end(), [&](const auto& x) {
      return x.reader == &r && x.object && x.key == group + ".params";
    });
    if (p == items.end()) continue;  // no names: torch cannot match the group (the layout says why)
    const pickle_value step = r.read_object(it.source_key), params = r.read_object(p->source_key);
    float f = 0;
    if (step.type() == pickle_value::kind::integer && step.as_int("") >= 0 && step.as_int("") < (std::int64_t(1) << 24))
      f = static_cast<float>(step.as_int(""));
    else if (step.type() == pickle_value::kind::real && step.as_real("") >= 0 && step.as_real("") < 16777216.0 &&
             step.as_real("") == static_cast<double>(static_cast<std::int64_t>(step.as_real(""))))
      f = static_cast<float>(step.as_real(""));
    else
      fail(errc::invalid_metadata, where + ": item '" + it.source_key + "' is " + pickle_repr(step, 40) +
                                       ", not a step count (an integer below 2^24, which F32 holds exactly)");
    if (params.type() != pickle_value::kind::list) continue;
    std::string bytes(4, '\0');
    std::memcpy(bytes.data(), &f, 4);
    auto str = [](std::string s) { return pickle_value::string(std::move(s)); };
    for (const auto& n : params.as_sequence("")) {
      if (n.type() != pickle_value::kind::string) continue;
      const std::string param = n.as_string(""), key = "optim.state." + param + ".step";
      if (!keys.count("optim.state." + param + ".exp_avg") || keys.count(key)) continue;
      dcp_export_item<S> m{key, pickle_value::tuple({str("optim"), str("state"), str(param), str("step")})};
      m.made = bytes;
      made.push_back(std::move(m));
      keys.insert(key);
    }
  }
  for (auto& m : made) items.push_back(std::move(m));
}

}  // namespace detail
}  // namespace shardsafe
