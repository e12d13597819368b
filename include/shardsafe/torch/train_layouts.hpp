// shardsafe/torch/train_layouts.hpp - how a model and its optimizer's state lie on disk
// together: the layouts of a training checkpoint, each a plain type that
// torch/model_and_optim.hpp dispatches to without testing which one it is.
//
// | layout            | save_options::format | on disk                                        | told apart by      |
// |-------------------|----------------------|------------------------------------------------|--------------------|
// | pair_train_layout | shardsafe            | DIR/optim, then DIR/model (docs/FORMAT.md §2); | any other folder   |
// |                   |                      | model/metadata.json last, the pair's commit mark|                   |
// | dcp_train_layout  | dcp                  | one torch.distributed.checkpoint folder, keyed | DIR/.metadata, no  |
// |                   |                      | as torch 2.x's get_state_dict (torch/optim_dcp.hpp) | DIR/model/    |
// | trainer_train_layout | (read only)       | a trainer's checkpoint: DeepSpeed ZeRO or      | a folder layout    |
// |                   |                      | universal, Megatron-Core torch_dist, Megatron-LM | with trainer_state |
// |                   |                      | legacy (docs/FORMAT.md §6-7)                   |                    |
//
// A layout L has: recognise(dir) (by names only) and load(dir, model, optim, opt, stats) (the
// caller runs it as one every-rank step); one that is written also has `format` (the
// save_format that writes it) and save(dir, model, optim, comm, opt). One that can load with
// replicas read once also has load_collective(dir, model, optim, comm, opt, stats), which runs
// its own steps (a collective load cannot run inside one): the caller takes it when
// train_load_options::replica asks for more than every_rank_reads. The lists below are the
// only ones; a training layout is its type here and one entry in train_layouts (and in
// train_writers when it is written).
//
// A trainer's checkpoint is loaded as its layout presents it: the model's tensors under their
// names; each parameter's fp32 master, exp_avg, exp_avg_sq and step as
// optimizer.state.{param}.{field}; the param groups as optimizer.param_groups.{g}.{field} (or,
// where only a wrapped optimizer's are kept, Megatron's distributed optimizer,
// optimizer.optimizer.param_groups.{g}.{field}), with `params` the parameters' names. A model
// tensor of dtype float32 is loaded from its parameter's fp32 master where the checkpoint keeps
// one (the weights a bf16 run trains, which the model's bf16 copy only rounds), any other from
// the model's tensor. A parameter with state and no step of its own takes its group's `step`.
// Groups whose `params` are missing or not names (Megatron's, where its layouts cannot tell the
// groups apart by the grouping rule) cannot be matched to the optimizer's: its state is refused,
// by name (the model loads alone).
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <torch/optim/optimizer.h>

#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/layout.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/torch/optim.hpp"
#include "shardsafe/torch/optim_dcp.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

struct model_and_optim_save_stats {
  save_stats model;
  save_stats optim;
  double seconds = 0;
  std::uint64_t total_bytes() const noexcept { return model.total_bytes + optim.total_bytes; }
};

struct model_and_optim_load_stats {
  load_stats model;
  optim_load_stats optim;
  double seconds = 0;
};

struct train_load_options {
  device_load_options
      load{};          ///< the model's load (its tensors may be on a device); the optimizer's takes its load_options
  bool strict = true;  ///< missing tensors or parameters are errors (else listed)
  bool restore_hyperparameters = true;  ///< take lr, betas, ... from the checkpoint
  /// Replicas read once (checkpoint/replica_reads.hpp): with more than every_rank_reads, the
  /// layout's load_collective (every training layout has one).
  replica_options replica{};
};

namespace detail {
/// The load options of the model's part and the optimizer's, from a training load's.
inline std::pair<device_load_options, optim_load_options> split_train_load_options(const train_load_options& opt) {
  device_load_options lo = opt.load;
  lo.strict = opt.strict;
  optim_load_options oo;
  oo.load = opt.load;
  oo.load.strict = true;
  oo.strict = opt.strict;
  oo.restore_hyperparameters = opt.restore_hyperparameters;
  return {lo, oo};
}

/// The optimizer's state tensors an optimizer load deferred (restore_optimizer's `defer`),
/// loaded collectively with replicas; their reads into `stats` (its key lists are the
/// optimizer load's own).
template <ReadableDirectory D, Comm C>
void load_deferred(checkpoint_reader<D>& r, const std::vector<flat_view>& views, C& comm, const load_options& lo,
                   const replica_options& replica, load_stats& stats) {
  collective_load_options co(lo, replica);
  co.list_unexpected = false;
  const load_stats st = shardsafe::load(r, std::span<const flat_view>(views), comm, co);
  stats.add_reads(st);
  stats.tensors = st.tensors;
  stats.replicas = st.replicas;
  stats.replica_group = st.replica_group;
  stats.bytes_received = st.bytes_received;
  stats.why = st.why;
}
}  // namespace detail

/// model/ and optim/, each a checkpoint in shardsafe's layout.
struct pair_train_layout {
  static constexpr save_format format = save_format::shardsafe;

  /// Any folder a DCP training layout is not (what it lacks, its load names).
  template <ReadableDirectory D>
  static bool recognise(const D&) {
    return true;
  }

  template <WritableDirectory D, Comm C>
  static model_and_optim_save_stats save(const D& dir, const state_dict& model, torch::optim::Optimizer* optim, C& comm,
                                         const save_options& opt) {
    model_and_optim_save_stats st;
    state_dict flat;
    if (optim) every_rank_step(comm, [&] { flat = flatten_optimizer_state(*optim, model); });
    detail::state_dict_save_source src;
    const auto optim_views = optim ? src.add(flat, comm, dir.name(), opt) : std::span<const flat_view>();
    const auto model_views = src.add(model, comm, dir.name(), opt);
    const auto folders = model_and_optim_folders(model_views, optim_views, optim != nullptr);
    const auto sts = shardsafe::save(dir, std::span<const folder_views>(folders), comm, src.options(opt));
    if (optim) st.optim = sts.front();
    st.model = sts.back();
    return st;
  }

  template <ReadableDirectory D>
  static void load(const D& dir, state_dict& model, torch::optim::Optimizer* optim, const train_load_options& opt,
                   model_and_optim_load_stats& rep) {
    if (!is_complete_checkpoint(dir))
      fail(errc::not_found,
           std::string(dir.name()) + ": no model/metadata.json (or model/.metadata): not a complete checkpoint");
    const auto [lo, oo] = detail::split_train_load_options(opt);
    checkpoint_reader<D> mr(dir.sub(model_folder_name));
    rep.model = load_state_dict(mr, model, lo);
    if (optim) {
      checkpoint_reader<D> orr(dir.sub(optim_folder_name));
      rep.optim = load_optimizer_state(orr, *optim, model, oo);
    }
  }

  /// The same with opt.replica: the model's tensors and the optimizer's state tensors each in a
  /// collective load (the optimizer's groups, steps and hyper-parameters read by each rank).
  template <ReadableDirectory D, Comm C>
  static void load_collective(const D& dir, state_dict& model, torch::optim::Optimizer* optim, C& comm,
                              const train_load_options& opt, model_and_optim_load_stats& rep) {
    every_rank_step(comm, [&] {
      if (!is_complete_checkpoint(dir))
        fail(errc::not_found,
             std::string(dir.name()) + ": no model/metadata.json (or model/.metadata): not a complete checkpoint");
    });
    const auto [lo, oo] = detail::split_train_load_options(opt);
    rep.model = load_state_dict(dir.sub(model_folder_name), model, comm, collective_load_options(lo, opt.replica));
    if (!optim) return;
    std::optional<checkpoint_reader<D>> orr;
    std::vector<flat_view> views;
    every_rank_step(comm, [&] {
      orr.emplace(dir.sub(optim_folder_name));
      rep.optim = load_optimizer_state(*orr, *optim, model, oo, &views);
    });
    detail::load_deferred(*orr, views, comm, oo.load, opt.replica, rep.optim.stats);
  }
};

/// One DCP folder in get_state_dict's layout: "model." and "optim." keys (torch/optim_dcp.hpp).
struct dcp_train_layout {
  static constexpr save_format format = save_format::dcp;

  template <ReadableDirectory D>
  static bool recognise(const D& dir) {
    return !dir.exists(model_folder_name) && dir.exists(dcp_metadata_file_name);
  }

  template <WritableDirectory D, Comm C>
  static model_and_optim_save_stats save(const D& dir, const state_dict& model, torch::optim::Optimizer* optim, C& comm,
                                         const save_options& opt) {
    model_and_optim_save_stats st;
    dcp_train_state ts;
    every_rank_step(comm, [&] { ts = dcp_train_state_of(model, optim); });
    std::vector<at::Tensor> keep;
    const auto views = detail::save_views(ts.tensors, keep, comm, dir.name());
    st.model =
        save_dcp(dir, std::span<const flat_view>(views), comm, opt, std::span<const dcp_object>(ts.objects), ts.paths);
    return st;
  }

  template <ReadableDirectory D>
  static void load(const D& dir, state_dict& model, torch::optim::Optimizer* optim, const train_load_options& opt,
                   model_and_optim_load_stats& rep) {
    const auto [lo, oo] = detail::split_train_load_options(opt);
    checkpoint_reader<D> r(dir);
    state_dict prefixed;  // the same tensors, under the DCP keys
    for (const auto& [name, t] : model) prefixed.add(std::string(dcp_model_prefix) + name, t);
    rep.model = load_state_dict(r, prefixed, lo);
    std::erase_if(rep.model.unexpected_keys, [](const std::string& k) { return !k.starts_with(dcp_model_prefix); });
    if (optim) rep.optim = load_optimizer_state_dcp(r, *optim, model, oo);
  }

  /// The same with opt.replica (as pair_train_layout::load_collective).
  template <ReadableDirectory D, Comm C>
  static void load_collective(const D& dir, state_dict& model, torch::optim::Optimizer* optim, C& comm,
                              const train_load_options& opt, model_and_optim_load_stats& rep) {
    const auto [lo, oo] = detail::split_train_load_options(opt);
    state_dict prefixed;
    for (const auto& [name, t] : model) prefixed.add(std::string(dcp_model_prefix) + name, t);
    rep.model = load_state_dict(dir, prefixed, comm, collective_load_options(lo, opt.replica));
    std::erase_if(rep.model.unexpected_keys, [](const std::string& k) { return !k.starts_with(dcp_model_prefix); });
    if (!optim) return;
    std::optional<checkpoint_reader<D>> r;
    std::vector<flat_view> views;
    every_rank_step(comm, [&] {
      r.emplace(dir);
      rep.optim = load_optimizer_state_dcp(*r, *optim, model, oo, &views);
    });
    detail::load_deferred(*r, views, comm, oo.load, opt.replica, rep.optim.stats);
  }
};

/// A trainer's checkpoint, read only (table at the top): a folder whose layout has
/// layout_info::trainer_state.
struct trainer_train_layout {
  static constexpr std::string_view state_prefix = "optimizer.state.", master_field = ".fp32";

  template <ReadableDirectory D>
  static bool recognise(const D& dir) {
    const layout_info* info = recognise_folder(dir);
    return info && info->trainer_state;
  }

  template <ReadableDirectory D>
  static void load(const D& dir, state_dict& model, torch::optim::Optimizer* optim, const train_load_options& opt,
                   model_and_optim_load_stats& rep) {
    const auto [lo, oo] = detail::split_train_load_options(opt);
    checkpoint_reader<D> r(dir);
    model_entries m = prepare(r, model, optim);
    rep.model = load_state_dict(r, m.named, lo);
    m.drop_expected(rep.model.unexpected_keys);
    if (optim) restore(r, *optim, model, oo, m, rep.optim, nullptr);
  }

  /// The same with opt.replica (as pair_train_layout::load_collective): the model's tensors (or
  /// their masters) and the optimizer's state tensors each in a collective load.
  template <ReadableDirectory D, Comm C>
  static void load_collective(const D& dir, state_dict& model, torch::optim::Optimizer* optim, C& comm,
                              const train_load_options& opt, model_and_optim_load_stats& rep) {
    const auto [lo, oo] = detail::split_train_load_options(opt);
    std::optional<checkpoint_reader<D>> r;
    model_entries m;
    every_rank_step(comm, [&] {
      r.emplace(dir);
      m = prepare(*r, model, optim);
    });
    rep.model = load_state_dict(*r, m.named, comm, collective_load_options(lo, opt.replica));
    m.drop_expected(rep.model.unexpected_keys);
    if (!optim) return;
    std::vector<flat_view> views;
    every_rank_step(comm, [&] { restore(*r, *optim, model, oo, m, rep.optim, &views); });
    detail::load_deferred(*r, views, comm, oo.load, opt.replica, rep.optim.stats);
  }

 private:
  /// What a load reads the model from: its tensors under the checkpoint's names (an F32 one
  /// under its parameter's fp32 master where there is one), and where the groups are.
  struct model_entries {
    state_dict named;
    std::set<std::string> from_master;
    std::string optim_prefix;
    /// The optimizer's entries, and the model tensors whose master was loaded instead, are not
    /// unexpected.
    void drop_expected(std::vector<std::string>& unexpected) const {
      std::erase_if(unexpected,
                    [&](const std::string& k) { return k.starts_with(state_prefix) || from_master.count(k); });
    }
  };

  template <ReadableDirectory D>
  static model_entries prepare(checkpoint_reader<D>& r, state_dict& model, torch::optim::Optimizer* optim) {
    model_entries m;
    const std::string dname(r.directory().name());
    // the groups: the optimizer's, or a wrapper's inner optimizer's (Megatron's distributed optimizer)
    m.optim_prefix =
        r.find_object("optimizer.param_groups.0.lr") || !r.find_object("optimizer.optimizer.param_groups.0.lr")
            ? "optimizer."
            : "optimizer.optimizer.";
    // groups that do not name their parameters cannot be matched
    if (optim && r.find_object(m.optim_prefix + "param_groups.0.lr")) {
      const std::string key = m.optim_prefix + "param_groups.0.params";
      bool named = r.find_object(key) != nullptr;
      if (named) {
        const pickle_value params = r.read_object(key);  // kept: the loop walks its sequence
        for (const auto& v : params.as_sequence(dname + ": '" + key + "'"))
          named = named && v.type() == pickle_value::kind::string;
      }
      if (!named)
        fail(errc::invalid_argument,
             dname + ": '" + key + "' (" + std::string(r.layout().name) +
                 ") does not list its parameters by name (Megatron's groups keep none, or indices; its layout "
                 "names them by Megatron's grouping rule where it can tell the groups apart, and its description, "
                 "megatron.layout, says why not), so its optimizer state cannot be matched to this optimizer's "
                 "parameters: load the model alone (no optimizer)");
    }
    for (const auto& [name, t] : model) {
      const std::string master = std::string(state_prefix) + name + std::string(master_field);
      if (t.local.scalar_type() == at::kFloat && r.find(master)) {
        m.from_master.insert(name);
        m.named.add(master, t);
      } else {
        m.named.add(name, t);
      }
    }
    return m;
  }

  /// The optimizer's groups, hyper-parameters and steps, and its state tensors (with `defer`,
  /// their views left to the caller's collective load: restore_optimizer).
  template <ReadableDirectory D>
  static void restore(checkpoint_reader<D>& r, torch::optim::Optimizer& optim, const state_dict& model,
                      const optim_load_options& oo, const model_entries& m, optim_load_stats& out,
                      std::vector<flat_view>* defer) {
    std::set<std::string> used;
    auto groups = detail::dcp_param_groups(r, used, m.optim_prefix);
    if (groups.empty())
      fail(errc::not_found, std::string(r.directory().name()) +
                                ": no optimizer param groups (optimizer.param_groups...) in " + r.described_by());
    out = detail::restore_optimizer(r, optim, model, oo, groups, {std::string(state_prefix), "."}, std::move(used),
                                    defer);
    group_steps(r, optim, model, groups);
    std::erase_if(out.unexpected_keys, [&](const std::string& k) {
      if (!k.ends_with(master_field)) return false;
      const std::string param = k.substr(state_prefix.size(), k.size() - state_prefix.size() - master_field.size());
      return m.from_master.count(param) > 0;
    });
  }

  /// A parameter with state but no step of its own takes its group's `step` (Megatron's
  /// distributed optimizer keeps one per group); with neither, the load is refused (a step of 0
  /// would resume with the wrong bias correction).
  template <ReadableDirectory D>
  static void group_steps(checkpoint_reader<D>& r, torch::optim::Optimizer& optim, const state_dict& model,
                          const std::vector<detail::checkpoint_param_group>& groups) {
    std::map<std::string, at::Tensor> params;
    for (const auto& g : name_optimizer_params(optim, model))
      for (const auto& p : g) params.emplace(p.name, p.param);
    for (const auto& g : groups) {
      const pickle_value* step = g.hyper.find("step");
      for (const auto& name : g.names) {
        const std::string prefix = std::string(state_prefix) + name + ".";
        auto it = params.find(name);
        if (it == params.end() || !r.find(prefix + "exp_avg") || r.find(prefix + "step")) continue;
        auto* state = optimizer_state_of(optim, it->second);
        std::int64_t* target = state ? detail::traits_of(optim.param_groups().front().options()).step(*state) : nullptr;
        if (!target) continue;
        if (!step || (step->type() != pickle_value::kind::integer && step->type() != pickle_value::kind::real))
          fail(errc::invalid_metadata, g.ctx + ": parameter '" + name +
                                           "' has optimizer state but no step, neither its own (" + prefix +
                                           "step) nor a number 'step' of its group");
        *target = detail::step_count(
            step->type() == pickle_value::kind::integer ? double(step->as_int("")) : step->as_real(""), g.ctx);
      }
    }
  }
};

/// The training layouts, in the order a load tries them (a trainer's first: Megatron-Core's
/// torch_dist folder has a .metadata; the pair last: it takes any folder).
using train_layouts = layout_list<trainer_train_layout, dcp_train_layout, pair_train_layout>;
/// The training layouts a save writes, each of its save_options::format.
using train_writers = layout_list<dcp_train_layout, pair_train_layout>;

}  // namespace shardsafe
