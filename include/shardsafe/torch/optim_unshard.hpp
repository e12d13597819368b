// shardsafe/torch/optim_unshard.hpp - a checkpoint's whole optimizer state in one process:
// the param groups and each parameter's full state tensors, whatever world size saved them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/torch/optim_load.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

/// A checkpoint's optimizer state, whole: the param groups and each parameter's full state.
struct full_optimizer_state {
  std::vector<pickle_value> param_groups;
  std::map<std::string, std::map<std::string, at::Tensor>> state;  ///< parameter name -> key -> full tensor
};

/// Reads the whole optimizer state of an optim/ checkpoint in one process.
template <ReadableDirectory D>
full_optimizer_state unshard_optim_state(checkpoint_reader<D>& r, const load_options& opt = {}) {
  full_optimizer_state out;
  const std::string dname(r.directory().name());
  const std::int64_t n = detail::read_whole(r, "num_param_groups", opt).reshape({-1}).template item<std::int64_t>();
  if (n < 0 || n > 1'000'000) fail(errc::invalid_metadata, dname + ": num_param_groups is " + std::to_string(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::string key = "param_group" + std::to_string(i);
    out.param_groups.push_back(detail::read_pickle(r, key, opt));
    detail::names_of(out.param_groups.back(), dname + ": " + key);  // checks the group names its parameters
  }
  auto tensors = unshard_state(r, opt);
  for (auto& [key, t] : tensors) {
    if (key.rfind("state.", 0) != 0) continue;
    const auto sep = key.rfind(".__");
    if (sep == std::string::npos || sep < 6) continue;
    out.state[key.substr(6, sep - 6)][key.substr(sep + 3)] = std::move(t);
  }
  return out;
}

template <ReadableDirectory D>
full_optimizer_state unshard_optim_state(const D& dir, const load_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return unshard_optim_state(r, opt);
}

}  // namespace shardsafe
