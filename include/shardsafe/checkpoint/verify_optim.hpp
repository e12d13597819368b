// shardsafe/checkpoint/verify_optim.hpp - the rules of an optim/ folder's optimizer layout
// (docs/FORMAT.md §2, torch/optim.hpp), checked without LibTorch, as the loader reads it: what
// `shardsafe verify` adds for the optim/ part of a model + optimizer pair.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The largest param group pickle or state_keys list verify reads (a group names its parameters).
inline constexpr std::uint64_t max_optimizer_pickle_bytes = std::uint64_t(64) << 20;

/// Checks the optimizer layout of an optim/ checkpoint (docs/FORMAT.md §2, torch/optim.hpp), as the
/// loader reads it, without LibTorch: `num_param_groups` an I64 (or I32) scalar in [0, 1,000,000];
/// `param_group{i}` for every i below it a U8 tensor whose bytes unpickle through the plain-data
/// reader (no global, no call: what the loader runs them through) to a dict whose `_param_names`
/// is a list of str; no `param_group{j}` past the count; `state_keys`, where present, a pickled
/// list of str; every other tensor named `state.{param}.__{key}`. errc::invalid_metadata naming
/// the file, the tensor and the rule. A folder holding none of num_param_groups, state_keys or a
/// param_group{i} is not in this layout (a pair saved by other means): nothing is checked, and
/// nullopt is returned; otherwise the number of param groups.
template <ReadableDirectory D>
std::optional<std::uint64_t> verify_optimizer_layout(checkpoint_reader<D>& r) {
  const std::string dname(r.directory().name());
  bool layout = false;
  for (const auto& [key, tm] : r.metadata().tensors)
    layout = layout || key == "num_param_groups" || key == "state_keys" || key.starts_with("param_group");
  if (!layout) return std::nullopt;
  auto bad = [&](const std::string& key, const std::string& rule) {
    fail(errc::invalid_metadata,
         dname + ": tensor '" + key + "': " + rule + " (the optimizer layout of docs/FORMAT.md §2)");
  };
  auto whole = [&](const std::string& key) {
    const tensor_metadata* tm = r.find(key);
    if (!tm) bad(key, "missing");
    const std::uint64_t bytes = tm->numel() * bit_size(tm->type) / 8;
    if (bytes > max_optimizer_pickle_bytes)
      bad(key, std::to_string(bytes) + " bytes pass the limit of " + std::to_string(max_optimizer_pickle_bytes));
    std::string b(static_cast<std::size_t>(bytes), '\0');
    unshard_tensor(r, key, std::as_writable_bytes(std::span(b)));
    return std::pair{tm, b};
  };
  const auto [ntm, nbytes] = whole("num_param_groups");
  if (!ntm->shape.empty() && !(ntm->shape.size() == 1 && ntm->shape[0] == 1))
    bad("num_param_groups", "shape " + to_string(ntm->shape) + " is not a scalar");
  std::int64_t n = 0;
  if (ntm->type == dtype::I64) {
    std::memcpy(&n, nbytes.data(), 8);
  } else if (ntm->type == dtype::I32) {
    std::int32_t v = 0;
    std::memcpy(&v, nbytes.data(), 4);
    n = v;
  } else {
    bad("num_param_groups", "dtype " + std::string(to_string(ntm->type)) + " is not an integer (I64)");
  }
  if (n < 0 || n > 1'000'000) bad("num_param_groups", "is " + std::to_string(n) + ", not a count in [0, 1000000]");
  for (std::int64_t i = 0; i < n; ++i) {
    const std::string key = "param_group" + std::to_string(i);
    const auto [tm, bytes] = whole(key);
    if (tm->type != dtype::U8) bad(key, "dtype " + std::string(to_string(tm->type)) + " is not U8 (pickled bytes)");
    const pickle_value g = pickle_loads(bytes, dname + ": tensor '" + key + "'");
    if (g.type() != pickle_value::kind::dict) bad(key, "does not unpickle to a dict");
    const pickle_value* names = g.find("_param_names");
    if (!names || (names->type() != pickle_value::kind::list && names->type() != pickle_value::kind::tuple))
      bad(key, "has no list _param_names");
    for (const auto& nm : names->as_sequence(key))
      if (nm.type() != pickle_value::kind::string) bad(key, "_param_names holds a value that is not a str");
  }
  for (const auto& [key, tm] : r.metadata().tensors) {
    if (key == "num_param_groups") continue;
    if (key.starts_with("param_group")) {
      const std::string digits = key.substr(11);
      const bool index =
          !digits.empty() && digits.size() <= 9 && digits.find_first_not_of("0123456789") == std::string::npos;
      if (!index || std::stoll(digits) >= n) bad(key, "is past num_param_groups (" + std::to_string(n) + ")");
      continue;
    }
    if (key == "state_keys") {
      const auto [stm, bytes] = whole(key);
      if (stm->type != dtype::U8) bad(key, "dtype " + std::string(to_string(stm->type)) + " is not U8 (pickled bytes)");
      const pickle_value keys = pickle_loads(bytes, dname + ": tensor '" + key + "'");
      if (keys.type() != pickle_value::kind::list) bad(key, "does not unpickle to a list");
      for (const auto& k : keys.as_sequence(key))
        if (k.type() != pickle_value::kind::string) bad(key, "holds a value that is not a str");
      continue;
    }
    if (!key.starts_with("state.") || key.find(".__") == std::string::npos)
      bad(key, "is neither num_param_groups, param_group{i}, state_keys nor state.{param}.__{key}");
  }
  return static_cast<std::uint64_t>(n);
}

}  // namespace shardsafe
