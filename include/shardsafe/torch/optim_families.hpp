// shardsafe/torch/optim_families.hpp - the optimizer families shardsafe saves, each described once.
//
// A family is one list of its hyper-parameters (the keys of its pickled param group, in the
// order they are written) and one list of its per-parameter state tensors; saving and restoring
// both walk those lists, so a field is never named twice. Supported: Adam, AdamW, SGD (momentum),
// Adagrad, RMSprop.
//
// A family type F (in shardsafe::detail: adam_family, adamw_family, sgd_family, adagrad_family,
// rmsprop_family) provides:
//
// | member                          | meaning                                                          |
// |---------------------------------|------------------------------------------------------------------|
// | `F::options`, `F::state`        | LibTorch's options and per-parameter state types (AdamOptions,  |
// |                                 | AdamParamState, ...)                                             |
// | `F::kind`                       | its optimizer_kind                                               |
// | `F::hyper`                      | a tuple of option_field: key and accessor of each hyper-parameter|
// |                                 | (double, bool, or a pair of doubles as std::tuple), saved as a   |
// |                                 | float, a bool or a tuple of two floats, in this order            |
// | `F::tensors`                    | a tuple of option_field over F::state: each state tensor's key   |
// |                                 | (`state.{param}.__{key}`) and accessor                           |
// | `F::has_step`                   | whether the state keeps a step count (`step()`)                  |
// | `F::initial_state(p, o)`        | the state LibTorch creates on the first step for parameter p     |
// |                                 | with options o, or nullptr where it starts from a gradient       |
#pragma once

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/format/pickle_value.hpp"

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

namespace detail {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamState;

/// A named field of an options or state object: `access(o)` is a reference to it (const for a
/// const object), so the one accessor serves saving and restoring.
template <class Access>
struct option_field {
  std::string_view key;
  Access access;
};

// --- a hyper-parameter to and from its pickled value --------------------------------------

inline pickle_value hyper_to_pickle(double v) { return pickle_value::real(v); }
inline pickle_value hyper_to_pickle(bool v) { return pickle_value::boolean(v); }
inline pickle_value hyper_to_pickle(const std::tuple<double, double>& v) {
  return pickle_value::tuple({pickle_value::real(std::get<0>(v)), pickle_value::real(std::get<1>(v))});
}

inline void hyper_from_pickle(const pickle_value& v, double& out, const std::string& ctx) { out = v.as_real(ctx); }
inline void hyper_from_pickle(const pickle_value& v, bool& out, const std::string& ctx) { out = v.as_bool(ctx); }
inline void hyper_from_pickle(const pickle_value& v, std::tuple<double, double>& out, const std::string& ctx) {
  const auto& items = v.as_sequence(ctx);
  if (items.size() != 2) fail(errc::invalid_metadata, ctx + " must have two values");
  out = std::make_tuple(items[0].as_real(ctx + "[0]"), items[1].as_real(ctx + "[1]"));
}

/// Python's options LibTorch lacks: a group that turns one on cannot be restored faithfully.
inline void refuse_python_only(const pickle_value& d, const std::string& ctx) {
  for (const char* k : {"maximize", "capturable", "differentiable"})
    if (const pickle_value* v = d.find(k); v && v->type() == pickle_value::kind::boolean && v->as_bool(k))
      fail(errc::invalid_argument, ctx + ": '" + k + "' is true, which LibTorch's optimizers do not support");
}

/// The family's hyper-parameters of `o` as a dict, in the family's order.
template <class F>
pickle_value hyper_dict(const typename F::options& o) {
  std::vector<std::pair<pickle_value, pickle_value>> entries;
  std::apply(
      [&](const auto&... f) {
        (entries.emplace_back(pickle_value::string(std::string(f.key)), hyper_to_pickle(f.access(o))), ...);
      },
      F::hyper);
  return pickle_value::dict(std::move(entries));
}

/// torch 2.7 and later keep `decoupled_weight_decay` in Adam's and AdamW's groups (AdamW's true:
/// the decay applied to the weights, not added to the gradient). A group whose rule is not the
/// optimizer's would go on training by the other rule: refused, naming the optimizer to use.
template <class F>
void refuse_other_decay_rule(const pickle_value& d, const std::string& ctx) {
  if constexpr (F::kind == optimizer_kind::adam || F::kind == optimizer_kind::adamw) {
    const pickle_value* v = d.find("decoupled_weight_decay");
    if (!v) return;  // torch before 2.7: the optimizer's class says the rule
    const bool decoupled = v->as_bool(ctx + ": decoupled_weight_decay");
    if (decoupled != (F::kind == optimizer_kind::adamw))
      fail(errc::invalid_argument, ctx + ": 'decoupled_weight_decay' is " + (decoupled ? "true" : "false") +
                                       ", the rule of torch::optim::" + (decoupled ? "AdamW" : "Adam") +
                                       "; this optimizer is " + (decoupled ? "Adam" : "AdamW"));
  }
}

/// Sets the hyper-parameters the dict `d` has; the others keep their values.
template <class F>
void set_hyper(typename F::options& o, const pickle_value& d, const std::string& ctx) {
  refuse_python_only(d, ctx);
  refuse_other_decay_rule<F>(d, ctx);
  std::apply(
      [&](const auto&... f) {
        (
            (void)[&] {
              if (const pickle_value* v = d.find(f.key))
                hyper_from_pickle(*v, f.access(o), ctx + ": " + std::string(f.key));
            }(),
            ...);
      },
      F::hyper);
}

// --- the families --------------------------------------------------------------------------

template <class Options, class State, optimizer_kind Kind>
struct adam_like_family {
  using options = Options;
  using state = State;
  static constexpr optimizer_kind kind = Kind;
  static constexpr auto hyper = std::tuple{
      option_field{"lr", [](auto& o) -> auto& { return o.lr(); }},
      option_field{"betas", [](auto& o) -> auto& { return o.betas(); }},
      option_field{"eps", [](auto& o) -> auto& { return o.eps(); }},
      option_field{"weight_decay", [](auto& o) -> auto& { return o.weight_decay(); }},
      option_field{"amsgrad", [](auto& o) -> auto& { return o.amsgrad(); }},
  };
  static constexpr auto tensors = std::tuple{
      option_field{"exp_avg", [](auto& s) -> auto& { return s.exp_avg(); }},
      option_field{"exp_avg_sq", [](auto& s) -> auto& { return s.exp_avg_sq(); }},
      option_field{"max_exp_avg_sq", [](auto& s) -> auto& { return s.max_exp_avg_sq(); }},
  };
  static constexpr bool has_step = true;
  static std::unique_ptr<state> initial_state(const at::Tensor& p, const options& o) {
    auto s = std::make_unique<state>();
    s->step(0);
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    return s;
  }
};

using adam_family = adam_like_family<torch::optim::AdamOptions, torch::optim::AdamParamState, optimizer_kind::adam>;
using adamw_family = adam_like_family<torch::optim::AdamWOptions, torch::optim::AdamWParamState, optimizer_kind::adamw>;

struct sgd_family {
  using options = torch::optim::SGDOptions;
  using state = torch::optim::SGDParamState;
  static constexpr optimizer_kind kind = optimizer_kind::sgd;
  static constexpr auto hyper = std::tuple{
      option_field{"lr", [](auto& o) -> auto& { return o.lr(); }},
      option_field{"momentum", [](auto& o) -> auto& { return o.momentum(); }},
      option_field{"dampening", [](auto& o) -> auto& { return o.dampening(); }},
      option_field{"weight_decay", [](auto& o) -> auto& { return o.weight_decay(); }},
      option_field{"nesterov", [](auto& o) -> auto& { return o.nesterov(); }},
  };
  static constexpr auto tensors = std::tuple{
      option_field{"momentum_buffer", [](auto& s) -> auto& { return s.momentum_buffer(); }},
  };
  static constexpr bool has_step = false;
  static std::unique_ptr<state> initial_state(const at::Tensor&, const options&) {
    return nullptr;  // LibTorch starts the buffer from the first gradient
  }
};

struct adagrad_family {
  using options = torch::optim::AdagradOptions;
  using state = torch::optim::AdagradParamState;
  static constexpr optimizer_kind kind = optimizer_kind::adagrad;
  static constexpr auto hyper = std::tuple{
      option_field{"lr", [](auto& o) -> auto& { return o.lr(); }},
      option_field{"lr_decay", [](auto& o) -> auto& { return o.lr_decay(); }},
      option_field{"weight_decay", [](auto& o) -> auto& { return o.weight_decay(); }},
      option_field{"initial_accumulator_value", [](auto& o) -> auto& { return o.initial_accumulator_value(); }},
      option_field{"eps", [](auto& o) -> auto& { return o.eps(); }},
  };
  static constexpr auto tensors = std::tuple{
      option_field{"sum", [](auto& s) -> auto& { return s.sum(); }},
  };
  static constexpr bool has_step = true;
  static std::unique_ptr<state> initial_state(const at::Tensor& p, const options& o) {
    auto s = std::make_unique<state>();  // as Adagrad's constructor makes it
    s->step(0);
    s->sum(at::full_like(p, o.initial_accumulator_value(), at::MemoryFormat::Preserve));
    return s;
  }
};

struct rmsprop_family {
  using options = torch::optim::RMSpropOptions;
  using state = torch::optim::RMSpropParamState;
  static constexpr optimizer_kind kind = optimizer_kind::rmsprop;
  static constexpr auto hyper = std::tuple{
      option_field{"lr", [](auto& o) -> auto& { return o.lr(); }},
      option_field{"alpha", [](auto& o) -> auto& { return o.alpha(); }},
      option_field{"eps", [](auto& o) -> auto& { return o.eps(); }},
      option_field{"weight_decay", [](auto& o) -> auto& { return o.weight_decay(); }},
      option_field{"momentum", [](auto& o) -> auto& { return o.momentum(); }},
      option_field{"centered", [](auto& o) -> auto& { return o.centered(); }},
  };
  static constexpr auto tensors = std::tuple{
      option_field{"square_avg", [](auto& s) -> auto& { return s.square_avg(); }},
      option_field{"momentum_buffer", [](auto& s) -> auto& { return s.momentum_buffer(); }},
      option_field{"grad_avg", [](auto& s) -> auto& { return s.grad_avg(); }},
  };
  static constexpr bool has_step = true;
  static std::unique_ptr<state> initial_state(const at::Tensor& p, const options& o) {
    auto s = std::make_unique<state>();
    s->step(0);
    s->square_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.momentum() > 0) s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.centered()) s->grad_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    return s;
  }
};

// --- one family behind one interface -------------------------------------------------------

/// What shardsafe needs to know about one optimizer family, made from its description.
struct optim_traits {
  optimizer_kind kind;
  std::vector<std::string> tensor_keys;  ///< per-parameter state tensors
  bool has_step;
  std::function<at::Tensor*(OptimizerParamState&, std::string_view)> tensor;  ///< field by key
  std::function<std::int64_t*(OptimizerParamState&)> step;                    ///< nullptr without has_step
  std::function<std::unique_ptr<OptimizerParamState>()> empty_state;
  /// The state LibTorch would create on the first step (nullptr where it starts from a gradient).
  std::function<std::unique_ptr<OptimizerParamState>(const at::Tensor&, const OptimizerOptions&)> initial_state;
  std::function<pickle_value(const OptimizerOptions&)> hyper;  ///< group options as a pickled dict
  std::function<void(OptimizerOptions&, const pickle_value&, const std::string&)> set_hyper;
};

template <class F>
optim_traits traits_for() {
  using O = typename F::options;
  using S = typename F::state;
  optim_traits t;
  t.kind = F::kind;
  std::apply([&](const auto&... f) { (t.tensor_keys.emplace_back(f.key), ...); }, F::tensors);
  t.has_step = F::has_step;
  t.tensor = [](OptimizerParamState& s, std::string_view k) -> at::Tensor* {
    at::Tensor* found = nullptr;
    std::apply([&](const auto&... f) { ((found = !found && f.key == k ? &f.access(static_cast<S&>(s)) : found), ...); },
               F::tensors);
    return found;
  };
  t.step = [](OptimizerParamState& s) -> std::int64_t* {
    if constexpr (F::has_step)
      return &static_cast<S&>(s).step();
    else
      return nullptr;
  };
  t.empty_state = [] { return std::make_unique<S>(); };
  t.initial_state = [](const at::Tensor& p, const OptimizerOptions& o) -> std::unique_ptr<OptimizerParamState> {
    return F::initial_state(p, static_cast<const O&>(o));
  };
  t.hyper = [](const OptimizerOptions& o) { return hyper_dict<F>(static_cast<const O&>(o)); };
  t.set_hyper = [](OptimizerOptions& o, const pickle_value& d, const std::string& ctx) {
    set_hyper<F>(static_cast<O&>(o), d, ctx);
  };
  return t;
}

/// The traits of the optimizer whose groups have these options.
inline const optim_traits& traits_of(const OptimizerOptions& o) {
  static const optim_traits adam = traits_for<adam_family>();
  static const optim_traits adamw = traits_for<adamw_family>();
  static const optim_traits sgd = traits_for<sgd_family>();
  static const optim_traits adagrad = traits_for<adagrad_family>();
  static const optim_traits rmsprop = traits_for<rmsprop_family>();
  if (dynamic_cast<const torch::optim::AdamOptions*>(&o)) return adam;
  if (dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return adamw;
  if (dynamic_cast<const torch::optim::SGDOptions*>(&o)) return sgd;
  if (dynamic_cast<const torch::optim::AdagradOptions*>(&o)) return adagrad;
  if (dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) return rmsprop;
  fail(errc::invalid_argument, "optimizer: only Adam, AdamW, SGD, Adagrad and RMSprop are supported");
}

}  // namespace detail
}  // namespace shardsafe
