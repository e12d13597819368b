// shardsafe/torch/optim_dcp.hpp - a model and its optimizer in a torch.distributed.checkpoint
// folder, laid out as torch 2.x's get_state_dict(model, optim) and dcp.save({"model": ..., "optim":
// ...}) lay them out (docs/FORMAT.md §5), so that Python's dcp.load + set_state_dict resume from a
// C++ checkpoint and the other way round:
//
// | key                                   | holds                                                  |
// |---------------------------------------|--------------------------------------------------------|
// | model.{fqn}                           | each model tensor, sharded as the job holds it          |
// | optim.state.{fqn}.{key}               | each per-parameter state tensor (exp_avg, exp_avg_sq,  |
// |                                       | max_exp_avg_sq, momentum_buffer, sum, square_avg,      |
// |                                       | grad_avg), sharded like its parameter                  |
// | optim.state.{fqn}.step                | the step count, a 0-d F32 tensor (as torch 2.x keeps it)|
// | optim.param_groups.{i}.{field}        | each hyper-parameter of group i (a non-tensor item:    |
// |                                       | lr, betas, ...; Python's own fields too: maximize,     |
// |                                       | foreach, capturable, differentiable, fused and, for    |
// |                                       | Adam(W), torch 2.7+'s decoupled_weight_decay, with     |
// |                                       | torch's defaults), and `params`: the list of the       |
// |                                       | group's parameter names                                |
//
// Read also: torch 2.0-2.3's layout (`optim.param_groups` one item: the list of group dicts) and
// that of get_state_dict's flatten_optimizer_state_dict=True (`optim.param_groups.{fqn}.{field}`
// per parameter, no `params`). Parameters are matched by name, never by position; the step may
// be stored as any numeric dtype holding a whole number. Python-only options that are on
// (maximize, capturable, differentiable) are refused, as for OLMo-core's layout, and so is an
// Adam(W) group whose decoupled_weight_decay is not the optimizer's rule.
//
// Not written: `initial_lr`, which a torch LR scheduler adds to each group it is made on, and
// `param_names`, which an optimizer made from named_parameters() keeps. torch's dcp.load asks
// for every key of the groups it is given, so a Python resume from a C++ checkpoint loads the
// optimizer before making its scheduler (which then sets initial_lr from the loaded lr).
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cctype>
#include <charconv>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/dcp_save.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/torch/optim_families.hpp"
#include "shardsafe/torch/optim_flatten.hpp"
#include "shardsafe/torch/optim_load.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

/// The key prefixes of the model and the optimizer in a DCP folder (table at the top).
inline constexpr std::string_view dcp_model_prefix = "model.";
inline constexpr std::string_view dcp_optim_prefix = "optim.";

namespace detail {

/// The fields torch's optimizers keep in a param group that LibTorch's do not, with their
/// defaults: written so that Python's dcp.load + set_state_dict finds every key it expects.
/// `decoupled_weight_decay` is torch 2.7's and later (Adam's rule switch; AdamW's is true there):
/// without it torch 2.11's dcp.load refused a C++ AdamW checkpoint ("Missing key in checkpoint
/// state_dict: optim.param_groups.0.decoupled_weight_decay"); torch 2.6 loads only the keys its
/// optimizer has and passes over it.
inline std::vector<std::pair<std::string, pickle_value>> python_only_fields(optimizer_kind k) {
  const pickle_value f = pickle_value::boolean(false), none = pickle_value::none();
  switch (k) {
    case optimizer_kind::adam:
    case optimizer_kind::adamw:
      return {{"foreach", none}, {"maximize", f},
              {"capturable", f}, {"differentiable", f},
              {"fused", none},   {"decoupled_weight_decay", pickle_value::boolean(k == optimizer_kind::adamw)}};
    case optimizer_kind::sgd:
    case optimizer_kind::adagrad: return {{"maximize", f}, {"foreach", none}, {"differentiable", f}, {"fused", none}};
    case optimizer_kind::rmsprop: return {{"capturable", f}, {"foreach", none}, {"maximize", f}, {"differentiable", f}};
  }
  return {};
}

inline pickle_value dcp_path(std::initializer_list<pickle_value> parts) {
  return pickle_value::tuple(std::vector<pickle_value>(parts));
}

/// Whether s is a decimal index ("0", "12").
inline bool is_index(std::string_view s) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace detail

/// A model + optimizer as the entries of one DCP save (table at the top): the tensors (the
/// model's and the optimizer's own, nothing copied but the steps), the non-tensor items and the
/// keys' paths for planner_data. Missing optimizer state is created first, as for OLMo-core's layout.
struct dcp_train_state {
  state_dict tensors;
  std::vector<dcp_object> objects;
  std::map<std::string, pickle_value> paths;
};

inline dcp_train_state dcp_train_state_of(const state_dict& model, torch::optim::Optimizer* opt) {
  using detail::dcp_path;
  dcp_train_state out;
  auto str = [](std::string s) { return pickle_value::string(std::move(s)); };
  for (const auto& [name, t] : model) {
    const std::string key = std::string(dcp_model_prefix) + name;
    out.tensors.add(key, t);
    out.paths[key] = dcp_path({str("model"), str(name)});
  }
  if (!opt) return out;
  init_optimizer_state(*opt);
  const auto groups = name_optimizer_params(*opt, model);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& options = opt->param_groups()[g].options();
    const auto& tr = detail::traits_of(options);
    std::vector<pickle_value> names;
    for (const auto& p : groups[g]) {
      names.push_back(str(p.name));
      auto* found = optimizer_state_of(*opt, p.param);
      if (!found) continue;
      auto state_key = [&](std::string_view k) { return "optim.state." + p.name + "." + std::string(k); };
      auto state_path = [&](std::string_view k) {
        return dcp_path({str("optim"), str("state"), str(p.name), str(std::string(k))});
      };
      for (const auto& k : tr.tensor_keys) {
        at::Tensor* t = tr.tensor(*found, k);
        if (!t || !t->defined()) continue;
        if (p.spec && t->sizes() == p.param.sizes())
          out.tensors.add(state_key(k), *t, *p.spec, p.full_shape, p.replica);
        else
          out.tensors.add(state_key(k), *t);
        out.paths[state_key(k)] = state_path(k);
      }
      if (tr.has_step) {
        // torch 2.x keeps the step as a 0-d float32 tensor (exact up to 2^24), float64 past it
        out.tensors.add(state_key("step"), detail::step_tensor(*tr.step(*found)));
        out.paths[state_key("step")] = state_path("step");
      }
    }
    const std::string gi = std::to_string(g);
    auto field = [&](std::string f, pickle_value v) {
      const std::string key = "optim.param_groups." + gi + "." + f;
      out.paths[key] =
          dcp_path({str("optim"), str("param_groups"), pickle_value::integer(static_cast<std::int64_t>(g)), str(f)});
      out.objects.push_back({key, std::move(v)});
    };
    const pickle_value hyper = tr.hyper(options);
    for (std::size_t i = 0; i < hyper.dict_size(); ++i) field(hyper.dict_key(i).as_string(""), hyper.dict_value(i));
    for (auto& [f, v] : detail::python_only_fields(tr.kind)) field(f, v);
    field("params", pickle_value::list(std::move(names)));
  }
  return out;
}

namespace detail {

/// The param groups of a DCP checkpoint's optimizer (any of the layouts at the top), whose keys
/// begin with optim_prefix ("optimizer." for a trainer's checkpoint: torch/train_layouts.hpp).
template <ReadableDirectory D>
std::vector<checkpoint_param_group> dcp_param_groups(const checkpoint_reader<D>& r, std::set<std::string>& used,
                                                     std::string_view optim_prefix = dcp_optim_prefix) {
  const std::string dname(r.directory().name());
  const std::string whole = std::string(optim_prefix) + "param_groups";
  std::vector<checkpoint_param_group> out;
  auto names_in = [&](const pickle_value& v, const std::string& ctx) {
    std::vector<std::string> names;
    for (const auto& n : v.as_sequence(ctx + ": params")) names.push_back(n.as_string(ctx + ": params"));
    return names;
  };
  if (r.find_object(whole)) {  // torch 2.0-2.3: one item, the list of group dicts
    used.insert(whole);
    const pickle_value groups = r.read_object(whole);
    const std::string ctx = dname + ": '" + whole + "'";
    std::size_t i = 0;
    for (const auto& g : groups.as_sequence(ctx)) {
      const std::string gctx = ctx + "[" + std::to_string(i++) + "]";
      out.push_back({names_in(g.at("params", gctx), gctx), g, gctx});
    }
    return out;
  }
  // torch 2.4+: one item per field; or per parameter (flatten_optimizer_state_dict)
  const std::string prefix = whole + ".";
  std::map<std::size_t, std::vector<std::pair<pickle_value, pickle_value>>> by_index;
  std::map<std::string, std::vector<std::pair<pickle_value, pickle_value>>> by_param;
  for (const auto& item : r.non_tensors()) {
    if (!item.key.starts_with(prefix)) continue;
    const std::string rest = item.key.substr(prefix.size());
    const auto dot = rest.rfind('.');
    if (dot == std::string::npos || dot == 0 || dot + 1 == rest.size()) continue;
    used.insert(item.key);
    const std::string owner = rest.substr(0, dot), field = rest.substr(dot + 1);
    pickle_value v = r.read_object(item.key);
    if (is_index(owner))
      by_index[std::stoul(owner)].emplace_back(pickle_value::string(field), std::move(v));
    else
      by_param[owner].emplace_back(pickle_value::string(field), std::move(v));
  }
  for (auto& [i, fields] : by_index) {
    const std::string ctx = dname + ": '" + prefix + std::to_string(i) + ".*'";
    pickle_value g = pickle_value::dict(std::move(fields));
    const pickle_value* params = g.find("params");
    if (!params)
      fail(errc::invalid_metadata,
           ctx + ": param group " + std::to_string(i) + " has no 'params' (its parameters' names)");
    out.push_back({names_in(*params, ctx), g, ctx});
  }
  for (auto& [fqn, fields] : by_param)
    out.push_back({{fqn}, pickle_value::dict(std::move(fields)), dname + ": '" + prefix + fqn + ".*'"});
  return out;
}

}  // namespace detail

/// Loads the optimizer state of a DCP checkpoint laid out as get_state_dict lays it out (table at
/// the top) into `opt`, in place, sharded as `model` is.
template <ReadableDirectory D>
optim_load_stats load_optimizer_state_dcp(checkpoint_reader<D>& r, torch::optim::Optimizer& opt,
                                          const state_dict& model, const optim_load_options& o = {},
                                          std::vector<flat_view>* defer = nullptr) {
  std::set<std::string> used;
  auto groups = detail::dcp_param_groups(r, used);
  if (groups.empty())
    fail(errc::not_found, std::string(r.directory().name()) +
                              ": no optimizer param groups (optim.param_groups...) in " + r.described_by());
  return detail::restore_optimizer(r, opt, model, o, groups, {"optim.state.", "."}, std::move(used), defer);
}

}  // namespace shardsafe
