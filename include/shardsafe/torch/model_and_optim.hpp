// shardsafe/torch/model_and_optim.hpp - what a training job calls every N steps:
// the model's state in DIR/model and the optimizer's in DIR/optim (docs/FORMAT.md §2), or, with
// save_options::format = save_format::dcp, both in one torch.distributed.checkpoint folder laid
// out as torch 2.x's get_state_dict does (torch/optim_dcp.hpp). Loading tells the two apart by
// their commit marks (a DCP folder's .metadata).
//
// The optimizer is written first and model/metadata.json last: that file is the commit mark
// of the pair, so a save killed at any point leaves a folder that does not load as complete
// (a DCP folder's .metadata, written last, is its commit mark).
// Saving and loading agree across ranks: if any rank fails, every rank throws the same error,
// with the code the failing rank met (dist/agree.hpp).
#pragma once

#include <torch/nn/module.h>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/torch/module.hpp"
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

struct train_load_options {
  load_options load{};
  bool strict = true;                   ///< missing tensors or parameters are errors (else listed)
  bool restore_hyperparameters = true;  ///< take lr, betas, ... from the checkpoint
};

struct model_and_optim_load_stats {
  load_stats model;
  optim_load_stats optim;
  double seconds = 0;
};

/// Saves `model` (this rank's tensors and how each is sharded) and, if given, the state of
/// `optim`, whose parameters must be tensors of `model`: DIR/optim, then DIR/model, whose
/// metadata.json is the pair's commit mark (save_folder_set of model_and_optim_folders,
/// checkpoint/saver.hpp); with opt.format dcp, one DCP folder. A collective over comm.
template <WritableDirectory D, Comm C>
model_and_optim_save_stats save_model_and_optim_state(const D& dir, const state_dict& model, torch::optim::Optimizer* optim,
                                             C& comm, const save_options& opt = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  model_and_optim_save_stats st;
  if (opt.format == save_format::dcp) {  // one folder, get_state_dict's layout
    dcp_train_state ts;
    every_rank_step(comm, [&] { ts = dcp_train_state_of(model, optim); });
    std::vector<at::Tensor> keep;
    const auto views = detail::save_views(ts.tensors, keep, comm, dir.name());
    st.model = save_dcp(dir, std::span<const flat_view>(views), comm, opt, std::span<const dcp_object>(ts.objects), ts.paths);
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
  }
  state_dict flat;
  if (optim) every_rank_step(comm, [&] { flat = flatten_optimizer_state(*optim, model); });
  detail::state_dict_save_source src;
  const auto optim_views = optim ? src.add(flat, comm, dir.name(), opt) : std::span<const flat_view>();
  const auto model_views = src.add(model, comm, dir.name(), opt);
  const auto folders = model_and_optim_folders(model_views, optim_views, optim != nullptr);
  const auto sts = save_folder_set(dir, std::span<const folder_views>(folders), comm, src.options(opt));
  if (optim) st.optim = sts.front();
  st.model = sts.back();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// The same for a module: its parameters and buffers, sharded as `shards` says.
template <WritableDirectory D, Comm C>
model_and_optim_save_stats save_model_and_optim_state(const D& dir, const torch::nn::Module& module,
                                             torch::optim::Optimizer* optim, C& comm, const save_options& opt = {},
                                             const shard_map& shards = {}) {
  return save_model_and_optim_state(dir, module_state_dict(module, shards), optim, comm, opt);
}

/// Loads DIR/model into `model`'s tensors and DIR/optim into `optim` (if given), in place,
/// under any change of world size or sharding. A collective over comm (for agreement only).
template <ReadableDirectory D, Comm C>
model_and_optim_load_stats load_model_and_optim_state(const D& dir, state_dict& model, torch::optim::Optimizer* optim, C& comm,
                                             const train_load_options& opt = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  const step_scope scope("load " + std::string(dir.name()));
  model_and_optim_load_stats rep;
  every_rank_step(comm, [&] {
    if (!is_complete_checkpoint(dir))
      fail(errc::not_found, std::string(dir.name()) + ": no model/metadata.json (or model/.metadata): not a complete checkpoint");
    load_options lo = opt.load;
    lo.strict = opt.strict;
    optim_load_options oo;
    oo.load = opt.load;
    oo.load.strict = true;
    oo.strict = opt.strict;
    oo.restore_hyperparameters = opt.restore_hyperparameters;
    if (!dir.exists(model_folder_name) && dir.exists(dcp_metadata_file_name)) {  // a DCP folder (torch/optim_dcp.hpp)
      checkpoint_reader<D> r(dir);
      state_dict prefixed;  // the same tensors, under the DCP keys
      for (const auto& [name, t] : model) prefixed.add(std::string(dcp_model_prefix) + name, t);
      rep.model = load_state_dict(r, prefixed, lo);
      std::erase_if(rep.model.unexpected_keys, [](const std::string& k) { return !k.starts_with(dcp_model_prefix); });
      if (optim) rep.optim = load_optimizer_state_dcp(r, *optim, model, oo);
      return;
    }
    checkpoint_reader<D> mr(dir.sub(model_folder_name));
    rep.model = load_state_dict(mr, model, lo);
    if (optim) {
      checkpoint_reader<D> orr(dir.sub(optim_folder_name));
      rep.optim = load_optimizer_state(orr, *optim, model, oo);
    }
  });
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

template <ReadableDirectory D, Comm C>
model_and_optim_load_stats load_model_and_optim_state(const D& dir, torch::nn::Module& module, torch::optim::Optimizer* optim,
                                             C& comm, const train_load_options& opt = {}, const shard_map& shards = {}) {
  state_dict model = module_state_dict(module, shards);
  return load_model_and_optim_state(dir, model, optim, comm, opt);
}

}  // namespace shardsafe
