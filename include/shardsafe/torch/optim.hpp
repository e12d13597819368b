// shardsafe/torch/optim.hpp - LibTorch optimizer state as named tensors (docs/FORMAT.md §2, optim/).
//
// Flattened as OLMo-core does, so Python reads what C++ writes and the other way round:
//   num_param_groups           I64 scalar
//   param_group{i}             U8: pickle of the group's hyper-parameters, "params" (ids) and
//                              "_param_names" (the parameters' names, in group order)
//   state_keys                 U8: pickle of the sorted list of state keys
//   state.{name}.__{key}       each per-parameter state tensor, sharded like its parameter
//                              when it has the parameter's shape; "step" is a scalar of its own
//                              per parameter (F32, as PyTorch keeps it; F64 past 2^24)
// Parameters are matched by name, never by position: the optimizer's parameters are named
// by the model's state dict (the tensors are the same objects), so a model built in another
// order or sharded over another world size still gets its own state back.
//
// Supported: Adam, AdamW, SGD (momentum), Adagrad, RMSprop. Before saving, state LibTorch
// creates lazily on the first step (Adam's, AdamW's and RMSprop's zero moments) is created
// now with the same values, so every rank saves the same keys; SGD's momentum buffer is left
// absent until the first step, since LibTorch starts it from the first gradient, not zeros.
#pragma once

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shardsafe/format/pickle.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

enum class optimizer_kind { adam, adamw, sgd, adagrad, rmsprop };

constexpr std::string_view to_string(optimizer_kind k) noexcept {
  switch (k) {
    case optimizer_kind::adam: return "Adam";
    case optimizer_kind::adamw: return "AdamW";
    case optimizer_kind::sgd: return "SGD";
    case optimizer_kind::adagrad: return "Adagrad";
    case optimizer_kind::rmsprop: return "RMSprop";
  }
  return "?";
}

/// One parameter the optimizer holds, named by the model's state dict.
struct optimizer_param {
  std::string name;
  at::Tensor param;
  std::optional<shard_spec> spec;
  shape_t full_shape;
};

struct optim_load_options {
  load_options load{};
  bool strict = true;                   ///< an optimizer parameter absent from the checkpoint is an error
  bool restore_hyperparameters = true;  ///< set lr, betas, ... of each group from the checkpoint
};

struct optim_load_report {
  load_stats stats;
  std::vector<std::string> missing_params;   ///< parameters the checkpoint has no state for (strict = false)
  std::vector<std::string> unexpected_keys;  ///< checkpoint entries this optimizer has no use for
};

namespace detail {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamState;

inline std::string state_key_of(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

/// What shardsafe needs to know about one optimizer family.
struct optim_traits {
  optimizer_kind kind;
  std::vector<std::string> tensor_keys;                                      ///< per-parameter state tensors
  bool has_step;
  std::function<at::Tensor*(OptimizerParamState&, std::string_view)> tensor;  ///< field by key
  std::function<std::int64_t*(OptimizerParamState&)> step;
  std::function<std::unique_ptr<OptimizerParamState>()> empty_state;
  /// The state LibTorch would create on the first step (nullptr where it starts from a gradient).
  std::function<std::unique_ptr<OptimizerParamState>(const at::Tensor&, const OptimizerOptions&)> initial_state;
  std::function<pickle_value(const OptimizerOptions&)> hyper;            ///< group options as a pickled dict
  std::function<void(OptimizerOptions&, const pickle_value&, const std::string&)> set_hyper;
};

template <class S>
S& as(OptimizerParamState& s) {
  return static_cast<S&>(s);
}

inline double real_of(const pickle_value& d, std::string_view key, const std::string& ctx, double fallback) {
  const pickle_value* v = d.find(key);
  return v ? v->as_real(ctx + ": " + std::string(key)) : fallback;
}
inline bool bool_of(const pickle_value& d, std::string_view key, const std::string& ctx, bool fallback) {
  const pickle_value* v = d.find(key);
  return v ? v->as_bool(ctx + ": " + std::string(key)) : fallback;
}
inline void refuse_python_only(const pickle_value& d, const std::string& ctx) {
  for (const char* k : {"maximize", "capturable", "differentiable"})
    if (const pickle_value* v = d.find(k); v && v->type() == pickle_value::kind::boolean && v->as_bool(k))
      fail(errc::invalid_argument, ctx + ": '" + k + "' is true, which LibTorch's optimizers do not support");
}

template <class Opt, class State>
optim_traits adam_like(optimizer_kind kind) {
  optim_traits t;
  t.kind = kind;
  t.tensor_keys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  t.has_step = true;
  t.tensor = [](OptimizerParamState& s, std::string_view k) -> at::Tensor* {
    auto& x = as<State>(s);
    if (k == "exp_avg") return &x.exp_avg();
    if (k == "exp_avg_sq") return &x.exp_avg_sq();
    if (k == "max_exp_avg_sq") return &x.max_exp_avg_sq();
    return nullptr;
  };
  t.step = [](OptimizerParamState& s) { return &as<State>(s).step(); };
  t.empty_state = [] { return std::make_unique<State>(); };
  t.initial_state = [](const at::Tensor& p, const OptimizerOptions& o) -> std::unique_ptr<OptimizerParamState> {
    auto s = std::make_unique<State>();
    s->step(0);
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (static_cast<const Opt&>(o).amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    return s;
  };
  t.hyper = [](const OptimizerOptions& oo) {
    const auto& o = static_cast<const Opt&>(oo);
    return pickle_value::dict({{pickle_value::string("lr"), pickle_value::real(o.lr())},
                               {pickle_value::string("betas"),
                                pickle_value::tuple({pickle_value::real(std::get<0>(o.betas())),
                                                     pickle_value::real(std::get<1>(o.betas()))})},
                               {pickle_value::string("eps"), pickle_value::real(o.eps())},
                               {pickle_value::string("weight_decay"), pickle_value::real(o.weight_decay())},
                               {pickle_value::string("amsgrad"), pickle_value::boolean(o.amsgrad())}});
  };
  t.set_hyper = [](OptimizerOptions& oo, const pickle_value& d, const std::string& ctx) {
    auto& o = static_cast<Opt&>(oo);
    refuse_python_only(d, ctx);
    o.lr(real_of(d, "lr", ctx, o.lr()));
    if (const pickle_value* b = d.find("betas")) {
      const auto& items = b->as_sequence(ctx + ": betas");
      if (items.size() != 2) fail(errc::invalid_metadata, ctx + ": betas must have two values");
      o.betas(std::make_tuple(items[0].as_real(ctx + ": betas[0]"), items[1].as_real(ctx + ": betas[1]")));
    }
    o.eps(real_of(d, "eps", ctx, o.eps()));
    o.weight_decay(real_of(d, "weight_decay", ctx, o.weight_decay()));
    o.amsgrad(bool_of(d, "amsgrad", ctx, o.amsgrad()));
  };
  return t;
}

inline optim_traits sgd_traits() {
  using torch::optim::SGDOptions;
  using torch::optim::SGDParamState;
  optim_traits t;
  t.kind = optimizer_kind::sgd;
  t.tensor_keys = {"momentum_buffer"};
  t.has_step = false;
  t.tensor = [](OptimizerParamState& s, std::string_view k) -> at::Tensor* {
    return k == "momentum_buffer" ? &as<SGDParamState>(s).momentum_buffer() : nullptr;
  };
  t.step = [](OptimizerParamState&) -> std::int64_t* { return nullptr; };
  t.empty_state = [] { return std::make_unique<SGDParamState>(); };
  t.initial_state = [](const at::Tensor&, const OptimizerOptions&) -> std::unique_ptr<OptimizerParamState> {
    return nullptr;  // LibTorch starts the buffer from the first gradient
  };
  t.hyper = [](const OptimizerOptions& oo) {
    const auto& o = static_cast<const SGDOptions&>(oo);
    return pickle_value::dict({{pickle_value::string("lr"), pickle_value::real(o.lr())},
                               {pickle_value::string("momentum"), pickle_value::real(o.momentum())},
                               {pickle_value::string("dampening"), pickle_value::real(o.dampening())},
                               {pickle_value::string("weight_decay"), pickle_value::real(o.weight_decay())},
                               {pickle_value::string("nesterov"), pickle_value::boolean(o.nesterov())}});
  };
  t.set_hyper = [](OptimizerOptions& oo, const pickle_value& d, const std::string& ctx) {
    auto& o = static_cast<SGDOptions&>(oo);
    refuse_python_only(d, ctx);
    o.lr(real_of(d, "lr", ctx, o.lr()));
    o.momentum(real_of(d, "momentum", ctx, o.momentum()));
    o.dampening(real_of(d, "dampening", ctx, o.dampening()));
    o.weight_decay(real_of(d, "weight_decay", ctx, o.weight_decay()));
    o.nesterov(bool_of(d, "nesterov", ctx, o.nesterov()));
  };
  return t;
}

inline optim_traits adagrad_traits() {
  using torch::optim::AdagradOptions;
  using torch::optim::AdagradParamState;
  optim_traits t;
  t.kind = optimizer_kind::adagrad;
  t.tensor_keys = {"sum"};
  t.has_step = true;
  t.tensor = [](OptimizerParamState& s, std::string_view k) -> at::Tensor* {
    return k == "sum" ? &as<AdagradParamState>(s).sum() : nullptr;
  };
  t.step = [](OptimizerParamState& s) { return &as<AdagradParamState>(s).step(); };
  t.empty_state = [] { return std::make_unique<AdagradParamState>(); };
  t.initial_state = [](const at::Tensor& p, const OptimizerOptions& oo) -> std::unique_ptr<OptimizerParamState> {
    auto s = std::make_unique<AdagradParamState>();  // as Adagrad's constructor makes it
    s->step(0);
    s->sum(at::full_like(p, static_cast<const AdagradOptions&>(oo).initial_accumulator_value(), at::MemoryFormat::Preserve));
    return s;
  };
  t.hyper = [](const OptimizerOptions& oo) {
    const auto& o = static_cast<const AdagradOptions&>(oo);
    return pickle_value::dict(
        {{pickle_value::string("lr"), pickle_value::real(o.lr())},
         {pickle_value::string("lr_decay"), pickle_value::real(o.lr_decay())},
         {pickle_value::string("weight_decay"), pickle_value::real(o.weight_decay())},
         {pickle_value::string("initial_accumulator_value"), pickle_value::real(o.initial_accumulator_value())},
         {pickle_value::string("eps"), pickle_value::real(o.eps())}});
  };
  t.set_hyper = [](OptimizerOptions& oo, const pickle_value& d, const std::string& ctx) {
    auto& o = static_cast<AdagradOptions&>(oo);
    refuse_python_only(d, ctx);
    o.lr(real_of(d, "lr", ctx, o.lr()));
    o.lr_decay(real_of(d, "lr_decay", ctx, o.lr_decay()));
    o.weight_decay(real_of(d, "weight_decay", ctx, o.weight_decay()));
    o.initial_accumulator_value(real_of(d, "initial_accumulator_value", ctx, o.initial_accumulator_value()));
    o.eps(real_of(d, "eps", ctx, o.eps()));
  };
  return t;
}

inline optim_traits rmsprop_traits() {
  using torch::optim::RMSpropOptions;
  using torch::optim::RMSpropParamState;
  optim_traits t;
  t.kind = optimizer_kind::rmsprop;
  t.tensor_keys = {"square_avg", "momentum_buffer", "grad_avg"};
  t.has_step = true;
  t.tensor = [](OptimizerParamState& s, std::string_view k) -> at::Tensor* {
    auto& x = as<RMSpropParamState>(s);
    if (k == "square_avg") return &x.square_avg();
    if (k == "momentum_buffer") return &x.momentum_buffer();
    if (k == "grad_avg") return &x.grad_avg();
    return nullptr;
  };
  t.step = [](OptimizerParamState& s) { return &as<RMSpropParamState>(s).step(); };
  t.empty_state = [] { return std::make_unique<RMSpropParamState>(); };
  t.initial_state = [](const at::Tensor& p, const OptimizerOptions& oo) -> std::unique_ptr<OptimizerParamState> {
    const auto& o = static_cast<const RMSpropOptions&>(oo);
    auto s = std::make_unique<RMSpropParamState>();
    s->step(0);
    s->square_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.momentum() > 0) s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.centered()) s->grad_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    return s;
  };
  t.hyper = [](const OptimizerOptions& oo) {
    const auto& o = static_cast<const RMSpropOptions&>(oo);
    return pickle_value::dict({{pickle_value::string("lr"), pickle_value::real(o.lr())},
                               {pickle_value::string("alpha"), pickle_value::real(o.alpha())},
                               {pickle_value::string("eps"), pickle_value::real(o.eps())},
                               {pickle_value::string("weight_decay"), pickle_value::real(o.weight_decay())},
                               {pickle_value::string("momentum"), pickle_value::real(o.momentum())},
                               {pickle_value::string("centered"), pickle_value::boolean(o.centered())}});
  };
  t.set_hyper = [](OptimizerOptions& oo, const pickle_value& d, const std::string& ctx) {
    auto& o = static_cast<RMSpropOptions&>(oo);
    refuse_python_only(d, ctx);
    o.lr(real_of(d, "lr", ctx, o.lr()));
    o.alpha(real_of(d, "alpha", ctx, o.alpha()));
    o.eps(real_of(d, "eps", ctx, o.eps()));
    o.weight_decay(real_of(d, "weight_decay", ctx, o.weight_decay()));
    o.momentum(real_of(d, "momentum", ctx, o.momentum()));
    o.centered(bool_of(d, "centered", ctx, o.centered()));
  };
  return t;
}

/// The traits of the optimizer whose groups have these options.
inline const optim_traits& traits_of(const OptimizerOptions& o) {
  static const optim_traits adam = adam_like<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer_kind::adam);
  static const optim_traits adamw =
      adam_like<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer_kind::adamw);
  static const optim_traits sgd = sgd_traits();
  static const optim_traits adagrad = adagrad_traits();
  static const optim_traits rmsprop = rmsprop_traits();
  if (dynamic_cast<const torch::optim::AdamOptions*>(&o)) return adam;
  if (dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return adamw;
  if (dynamic_cast<const torch::optim::SGDOptions*>(&o)) return sgd;
  if (dynamic_cast<const torch::optim::AdagradOptions*>(&o)) return adagrad;
  if (dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) return rmsprop;
  fail(errc::invalid_argument, "optimizer: only Adam, AdamW, SGD, Adagrad and RMSprop are supported");
}

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
        fail(errc::invalid_argument, "optimizer: parameter " + std::to_string(i) + " of param group " + std::to_string(g) +
                                         " is not a tensor of the model's state dict, so it has no name");
      const auto& [name, st] = *it->second;
      if (!seen.insert(name).second) fail(errc::invalid_argument, "optimizer: parameter '" + name + "' is in two groups");
      out.push_back({name, params[i], st.spec, st.full_shape});
    }
  }
  return groups;
}

/// Creates the state LibTorch would create lazily on the first step (see the header comment).
inline void init_optimizer_state(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    const auto& tr = detail::traits_of(group.options());
    for (const auto& p : group.params()) {
      const std::string key = detail::state_key_of(p);
      if (opt.state().count(key)) continue;
      if (auto s = tr.initial_state(p, group.options())) opt.state()[key] = std::move(s);
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
      auto it = opt.state().find(detail::state_key_of(p.param));
      if (it == opt.state().end()) continue;
      auto& state = *it->second;
      for (const auto& k : tr.tensor_keys) {
        at::Tensor* t = tr.tensor(state, k);
        if (!t || !t->defined()) continue;
        keys.insert(k);
        const std::string entry = detail::state_entry(p.name, k);
        if (p.spec && t->sizes() == p.param.sizes())
          sd.add(entry, *t, *p.spec, p.full_shape);  // sharded like its parameter
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

namespace detail {
/// Reads a whole small tensor of the checkpoint into a new CPU tensor.
template <ReadableDirectory D>
at::Tensor read_whole(checkpoint_reader<D>& r, const std::string& key, const load_options& opt) {
  const tensor_metadata* tm = r.find(key);
  if (!tm) fail(errc::not_found, std::string(r.directory().name()) + ": tensor '" + key + "' is not in the checkpoint");
  at::Tensor t = at::empty(to_sizes(tm->shape), require_scalar_type(tm->type, std::string(r.directory().name()) + ": '" + key + "'"));
  flat_view v = make_flat_view(key, t);
  r.load(std::span<const flat_view>(&v, 1), opt);
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

/// Loads optimizer state from an optim/ checkpoint into `opt`, in place: state tensors are the
/// optimizer's own (created with the parameter's shape where missing), read in one batch.
template <ReadableDirectory D>
optim_load_report load_optimizer_state(checkpoint_reader<D>& r, torch::optim::Optimizer& opt, const state_dict& model,
                                       const optim_load_options& o = {}) {
  optim_load_report rep;
  const std::string dname(r.directory().name());
  auto groups = name_optimizer_params(opt, model);
  const std::int64_t n = detail::read_whole(r, "num_param_groups", o.load).reshape({-1}).template item<std::int64_t>();
  if (n < 0 || n > 1'000'000) fail(errc::invalid_metadata, dname + ": num_param_groups is " + std::to_string(n));

  // match the checkpoint's groups to the optimizer's by parameter names
  std::map<std::string, std::size_t> group_of;  // name -> optimizer group
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g]) group_of[p.name] = g;
  std::set<std::string> in_checkpoint;
  std::set<std::string> used_entries{"num_param_groups", "state_keys"};
  for (std::int64_t i = 0; i < n; ++i) {
    const std::string key = "param_group" + std::to_string(i);
    used_entries.insert(key);
    const std::string ctx = dname + ": " + key;
    pickle_value group = detail::read_pickle(r, key, o.load);
    std::vector<std::string> names = detail::names_of(group, ctx);
    std::optional<std::size_t> target;
    for (const auto& nm : names) {
      in_checkpoint.insert(nm);
      auto it = group_of.find(nm);
      if (it == group_of.end()) continue;
      if (target && *target != it->second)
        fail(errc::invalid_argument, ctx + ": its parameters are spread over the optimizer's groups " +
                                         std::to_string(*target) + " and " + std::to_string(it->second));
      target = it->second;
    }
    if (target && o.restore_hyperparameters) {
      auto& options = opt.param_groups()[*target].options();
      detail::traits_of(options).set_hyper(options, group, ctx);
    }
  }

  // state tensors, in place
  std::vector<flat_view> views;
  std::set<std::string> ckpt_keys;
  for (const auto& [k, tm] : r.metadata().tensors) ckpt_keys.insert(k);
  std::vector<std::pair<std::int64_t*, at::Tensor>> step_targets;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& options = opt.param_groups()[g].options();
    const auto& tr = detail::traits_of(options);
    for (const auto& p : groups[g]) {
      if (!in_checkpoint.count(p.name)) {
        if (o.strict)
          fail(errc::not_found, dname + ": parameter '" + p.name + "' is in no param group of the checkpoint");
        rep.missing_params.push_back(p.name);
        continue;
      }
      const std::string prefix = "state." + p.name + ".__";
      std::vector<std::string> present;
      for (auto it = ckpt_keys.lower_bound(prefix); it != ckpt_keys.end() && it->rfind(prefix, 0) == 0; ++it)
        present.push_back(it->substr(prefix.size()));
      if (present.empty()) continue;  // no state yet (e.g. SGD before its first step)
      const std::string skey = detail::state_key_of(p.param);
      auto& slot = opt.state()[skey];
      if (!slot) slot = tr.empty_state();
      for (const auto& k : present) {
        const std::string entry = prefix + k;
        if (k.find(".__") != std::string::npos) continue;  // belongs to a parameter named "<p.name>.__..."
        used_entries.insert(entry);
        const tensor_metadata* tm = r.find(entry);
        if (k == "step" && tr.has_step) {
          step_targets.emplace_back(tr.step(*slot), detail::read_whole(r, entry, o.load));
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
  rep.stats = r.load(std::span<const flat_view>(views), o.load);
  for (auto& [target, value] : step_targets) {
    const double s = value.reshape({-1}).to(at::kDouble).template item<double>();
    if (!(s >= 0) || s != static_cast<double>(static_cast<std::int64_t>(s)))
      fail(errc::invalid_metadata, dname + ": a step value " + std::to_string(s) + " is not a whole non-negative number");
    *target = static_cast<std::int64_t>(s);
  }
  for (const auto& k : ckpt_keys)
    if (!used_entries.count(k) && !(k.rfind("param_group", 0) == 0)) {
      // state of parameters this optimizer does not hold
      if (k.rfind("state.", 0) == 0) rep.unexpected_keys.push_back(k);
    }
  return rep;
}

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
