// shardsafe/torch/optim_load.hpp - loads an optim/ checkpoint into a LibTorch optimizer, in
// place (the layout is in torch/optim.hpp).
//
// The checkpoint's param groups are matched to the optimizer's by their parameters' names,
// never by position, so a model built in another order or sharded over another world size
// still gets its own state back.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/torch/compat.hpp"
#include "shardsafe/torch/optim_families.hpp"
#include "shardsafe/torch/optim_flatten.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

struct optim_load_options {
  load_options load{};
  bool strict = true;                   ///< an optimizer parameter absent from the checkpoint is an error
  bool restore_hyperparameters = true;  ///< set lr, betas, ... of each group from the checkpoint
};

struct optim_load_stats {
  load_stats stats;
  std::vector<std::string> missing_params;   ///< parameters the checkpoint has no state for (strict = false)
  std::vector<std::string> unexpected_keys;  ///< checkpoint entries this optimizer has no use for
};

namespace detail {
/// Reads a whole small tensor of the checkpoint into a new CPU tensor.
template <ReadableDirectory D>
at::Tensor read_whole(checkpoint_reader<D>& r, const std::string& key, const load_options& opt) {
  const tensor_metadata* tm = r.find(key);
  if (!tm) fail(errc::not_found, std::string(r.directory().name()) + ": tensor '" + key + "' is not in the checkpoint");
  at::Tensor t = at::empty(to_sizes(tm->shape),
                           require_scalar_type(tm->type, std::string(r.directory().name()) + ": '" + key + "'"));
  flat_view v = make_flat_view(key, t);
  load_options lo = opt;
  lo.list_unexpected = false;  // one small tensor of many
  shardsafe::load(r, std::span<const flat_view>(&v, 1), lo);
  return t;
}

template <ReadableDirectory D>
pickle_value read_pickle(checkpoint_reader<D>& r, const std::string& key, const load_options& opt) {
  at::Tensor b = read_whole(r, key, opt);
  if (b.scalar_type() != at::kByte)
    fail(errc::invalid_metadata, std::string(r.directory().name()) + ": '" + key + "' is not a U8 byte tensor");
  return pickle_loads(std::string_view(static_cast<const char*>(b.data_ptr()), b.nbytes()),
                      std::string(r.directory().name()) + ": '" + key + "'");
}

inline std::vector<std::string> names_of(const pickle_value& group, const std::string& ctx) {
  std::vector<std::string> names;
  for (const auto& v : group.at("_param_names", ctx).as_sequence(ctx + ": _param_names"))
    names.push_back(v.as_string(ctx + ": _param_names"));
  return names;
}
}  // namespace detail

namespace detail {

/// A param group as the checkpoint records it: its parameters' names and its hyper-parameters.
struct checkpoint_param_group {
  std::vector<std::string> names;
  pickle_value hyper;  ///< a dict
  std::string ctx;     ///< names it in messages
};

/// An optimizer step count read as a number: a whole non-negative one, else refused naming `where`.
inline std::int64_t step_count(double s, const std::string& where) {
  if (!(s >= 0) || s != static_cast<double>(static_cast<std::int64_t>(s)))
    fail(errc::invalid_metadata, where + ": a step value " + std::to_string(s) + " is not a whole non-negative number");
  return static_cast<std::int64_t>(s);
}

/// Where a layout keeps parameter p's state k: STATE_PREFIX + p + SEPARATOR + k.
struct optim_state_keys {
  std::string prefix;     ///< "state." (OLMo-core), "optim.state." (torch DCP)
  std::string separator;  ///< ".__" (OLMo-core), "." (torch DCP)
};

/// Restores `opt` from the checkpoint's groups and state tensors (either layout), in place:
/// groups matched by their parameters' names, hyper-parameters set (o.restore_hyperparameters),
/// state tensors read in one batch; `used` names entries already accounted for. With `defer`,
/// the batch's views (into the state tensors, made) are appended there for the caller to load
/// (a collective load), and the stats' reads are left empty: nothing after the batch reads it.
template <ReadableDirectory D>
optim_load_stats restore_optimizer(checkpoint_reader<D>& r, torch::optim::Optimizer& opt, const state_dict& model,
                                   const optim_load_options& o, const std::vector<checkpoint_param_group>& ckpt_groups,
                                   const optim_state_keys& layout, std::set<std::string> used,
                                   std::vector<flat_view>* defer = nullptr) {
  optim_load_stats rep;
  const std::string dname(r.directory().name());
  auto groups = name_optimizer_params(opt, model);
  // match the checkpoint's groups to the optimizer's by parameter names
  std::map<std::string, std::size_t> group_of;  // name -> optimizer group
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g]) group_of[p.name] = g;
  std::set<std::string> in_checkpoint;
  for (const auto& group : ckpt_groups) {
    std::optional<std::size_t> target;
    for (const auto& nm : group.names) {
      in_checkpoint.insert(nm);
      auto it = group_of.find(nm);
      if (it == group_of.end()) continue;
      if (target && *target != it->second)
        fail(errc::invalid_argument, group.ctx + ": its parameters are spread over the optimizer's groups " +
                                         std::to_string(*target) + " and " + std::to_string(it->second));
      target = it->second;
    }
    if (target && o.restore_hyperparameters) {
      auto& options = opt.param_groups()[*target].options();
      traits_of(options).set_hyper(options, group.hyper, group.ctx);
    }
  }

  // state tensors, in place
  std::vector<flat_view> views;
  std::set<std::string> ckpt_keys;
  for (const auto& [k, tm] : r.metadata().tensors) ckpt_keys.insert(k);
  std::vector<std::pair<std::int64_t*, at::Tensor>> step_targets;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& options = opt.param_groups()[g].options();
    const auto& tr = traits_of(options);
    for (const auto& p : groups[g]) {
      if (!in_checkpoint.count(p.name)) {
        if (o.strict)
          fail(errc::not_found, dname + ": parameter '" + p.name + "' is in no param group of the checkpoint");
        rep.missing_params.push_back(p.name);
        continue;
      }
      const std::string prefix = layout.prefix + p.name + layout.separator;
      std::vector<std::string> present;
      for (auto it = ckpt_keys.lower_bound(prefix); it != ckpt_keys.end() && it->rfind(prefix, 0) == 0; ++it)
        present.push_back(it->substr(prefix.size()));
      if (present.empty()) continue;  // no state yet (e.g. SGD before its first step)
      auto& slot = optimizer_state_slot(opt, p.param);
      if (!slot) slot = tr.empty_state();
      for (const auto& k : present) {
        const std::string entry = prefix + k;
        // a key with a separator belongs to a parameter named "<p.name><separator>..."
        if (k.find(layout.separator) != std::string::npos) continue;
        used.insert(entry);
        const tensor_metadata* tm = r.find(entry);
        if (k == "step" && tr.has_step) {
          step_targets.emplace_back(tr.step(*slot), read_whole(r, entry, o.load));
          continue;
        }
        at::Tensor* t = tr.tensor(*slot, k);
        if (!t) {
          rep.unexpected_keys.push_back(entry);
          continue;
        }
        const bool like_param = tm->shape == p.full_shape;
        if (like_param) {
          if (!t->defined() || t->sizes() != p.param.sizes() || t->scalar_type() != p.param.scalar_type())
            *t = at::empty_like(p.param, at::MemoryFormat::Contiguous);
          views.push_back(make_flat_view(entry, *t, p.spec, p.full_shape));
        } else {
          *t = at::empty(to_sizes(tm->shape), require_scalar_type(tm->type, dname + ": '" + entry + "'"));
          views.push_back(make_flat_view(entry, *t));
        }
      }
    }
  }
  if (defer)
    defer->insert(defer->end(), views.begin(), views.end());
  else
    rep.stats = shardsafe::load(r, std::span<const flat_view>(views), o.load);
  for (auto& [target, value] : step_targets)
    *target = step_count(value.reshape({-1}).to(at::kDouble).template item<double>(), dname);
  // state of parameters this optimizer does not hold
  for (const auto& k : ckpt_keys)
    if (!used.count(k) && k.rfind(layout.prefix, 0) == 0) rep.unexpected_keys.push_back(k);
  return rep;
}

}  // namespace detail

/// Loads optimizer state from an optim/ checkpoint (OLMo-core's layout, torch/optim.hpp) into
/// `opt`, in place: state tensors are the optimizer's own (created with the parameter's shape
/// where missing), read in one batch (with `defer`, left to the caller: restore_optimizer).
template <ReadableDirectory D>
optim_load_stats load_optimizer_state(checkpoint_reader<D>& r, torch::optim::Optimizer& opt, const state_dict& model,
                                      const optim_load_options& o = {}, std::vector<flat_view>* defer = nullptr) {
  const std::string dname(r.directory().name());
  const std::int64_t n = detail::read_whole(r, "num_param_groups", o.load).reshape({-1}).template item<std::int64_t>();
  if (n < 0 || n > 1'000'000) fail(errc::invalid_metadata, dname + ": num_param_groups is " + std::to_string(n));
  std::vector<detail::checkpoint_param_group> groups;
  std::set<std::string> used{"num_param_groups", "state_keys"};
  for (std::int64_t i = 0; i < n; ++i) {
    const std::string key = "param_group" + std::to_string(i);
    used.insert(key);
    const std::string ctx = dname + ": " + key;
    pickle_value group = detail::read_pickle(r, key, o.load);
    std::vector<std::string> names = detail::names_of(group, ctx);
    groups.push_back({std::move(names), std::move(group), ctx});
  }
  return detail::restore_optimizer(r, opt, model, o, groups, {"state.", ".__"}, std::move(used), defer);
}

}  // namespace shardsafe
