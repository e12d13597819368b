// shardsafe/torch/optim_flatten.hpp - an optimizer's state as named tensors, for saving
// (the layout is in torch/optim.hpp).
//
// The optimizer's parameters are named by the model's state dict (the tensors are the same
// objects); state LibTorch creates lazily on the first step is created first, so every rank
// saves the same keys.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/torch/compat.hpp"
#include "shardsafe/torch/optim_families.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

/// One parameter the optimizer holds, named by the model's state dict.
struct optimizer_param {
  std::string name;
  at::Tensor param;
  std::optional<shard_spec> spec;
  shape_t full_shape;
  replica_role replica = replica_role::none;  ///< the parameter's: its state is written by the same replica
};

namespace detail {

inline std::string state_entry(const std::string& param, std::string_view key) {
  return "state." + param + ".__" + std::string(key);
}

inline at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

inline at::Tensor step_tensor(std::int64_t step) {
  // PyTorch keeps step as a float32 scalar; float32 holds every integer up to 2^24 exactly
  if (step >= 0 && step <= (std::int64_t(1) << 24)) return at::scalar_tensor(static_cast<double>(step), at::kFloat);
  return at::scalar_tensor(static_cast<double>(step), at::kDouble);
}

}  // namespace detail

/// The optimizer's parameters, group by group, named through the model's state dict (the
/// optimizer's tensors must be the state dict's own tensors).
inline std::vector<std::vector<optimizer_param>> name_optimizer_params(const torch::optim::Optimizer& opt,
                                                                       const state_dict& model) {
  std::map<const void*, const std::pair<std::string, sharded_tensor>*> by_impl;
  for (const auto& e : model) by_impl.emplace(e.second.local.unsafeGetTensorImpl(), &e);
  std::vector<std::vector<optimizer_param>> groups;
  std::set<std::string> seen;
  for (std::size_t g = 0; g < opt.param_groups().size(); ++g) {
    auto& out = groups.emplace_back();
    const auto& params = opt.param_groups()[g].params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto it = by_impl.find(params[i].unsafeGetTensorImpl());
      if (it == by_impl.end())
        fail(errc::invalid_argument, "optimizer: parameter " + std::to_string(i) + " of param group " +
                                         std::to_string(g) +
                                         " is not a tensor of the model's state dict, so it has no name");
      const auto& [name, st] = *it->second;
      if (!seen.insert(name).second)
        fail(errc::invalid_argument, "optimizer: parameter '" + name + "' is in two groups");
      out.push_back({name, params[i], st.spec, st.full_shape, st.replica});
    }
  }
  return groups;
}

/// Creates the state LibTorch would create lazily on the first step (see the header comment).
inline void init_optimizer_state(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    const auto& tr = detail::traits_of(group.options());
    for (const auto& p : group.params()) {
      if (optimizer_state_of(opt, p)) continue;
      if (auto s = tr.initial_state(p, group.options())) optimizer_state_slot(opt, p) = std::move(s);
    }
  }
}

/// The optimizer's state as named tensors for save_state_dict (state tensors are the
/// optimizer's own; nothing is copied). Initializes missing state first.
inline state_dict flatten_optimizer_state(torch::optim::Optimizer& opt, const state_dict& model) {
  init_optimizer_state(opt);
  auto groups = name_optimizer_params(opt, model);
  state_dict sd;
  sd.add("num_param_groups", at::scalar_tensor(static_cast<std::int64_t>(groups.size()), at::kLong));
  std::set<std::string> keys;
  std::int64_t id = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& options = opt.param_groups()[g].options();
    const auto& tr = detail::traits_of(options);
    pickle_value group = tr.hyper(options);
    std::vector<pickle_value> ids, names;
    for (const auto& p : groups[g]) {
      ids.push_back(pickle_value::integer(id++));
      names.push_back(pickle_value::string(p.name));
      auto* found = optimizer_state_of(opt, p.param);
      if (!found) continue;
      auto& state = *found;
      for (const auto& k : tr.tensor_keys) {
        at::Tensor* t = tr.tensor(state, k);
        if (!t || !t->defined()) continue;
        keys.insert(k);
        const std::string entry = detail::state_entry(p.name, k);
        if (p.spec && t->sizes() == p.param.sizes())
          sd.add(entry, *t, *p.spec, p.full_shape, p.replica);  // sharded (and replicated) like its parameter
        else
          sd.add(entry, *t);
      }
      if (tr.has_step) {
        keys.insert("step");
        sd.add(detail::state_entry(p.name, "step"), detail::step_tensor(*tr.step(state)));
      }
    }
    group.set("params", pickle_value::list(std::move(ids)));
    group.set("_param_names", pickle_value::list(std::move(names)));
    sd.add("param_group" + std::to_string(g), detail::bytes_tensor(pickle_dumps(group)));
  }
  std::vector<pickle_value> key_list;
  for (const auto& k : keys) key_list.push_back(pickle_value::string(k));
  sd.add("state_keys", detail::bytes_tensor(pickle_dumps(pickle_value::list(std::move(key_list)))));
  return sd;
}

}  // namespace shardsafe
