// shardsafe/torch/model_and_optim.hpp - what a training job calls every N steps:
// the model's state in DIR/model and the optimizer's in DIR/optim (docs/FORMAT.md §2), or, with
// save_options::format = save_format::dcp, both in one torch.distributed.checkpoint folder laid
// out as torch 2.x's get_state_dict does (torch/optim_dcp.hpp): the training layouts of
// torch/train_layouts.hpp, saved by the one save_options::format names and loaded by the one
// that recognises the folder.
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
#include "shardsafe/torch/train_layouts.hpp"

namespace shardsafe {

/// Saves `model` (this rank's tensors and how each is sharded) and, if given, the state of
/// `optim`, whose parameters must be tensors of `model`: DIR/optim, then DIR/model, whose
/// metadata.json is the pair's commit mark (the save of model_and_optim_folders,
/// checkpoint/saver.hpp); with opt.format dcp, one DCP folder. A collective over comm.
template <WritableDirectory D, Comm C>
model_and_optim_save_stats save_model_and_optim_state(const D& dir, const state_dict& model,
                                                      torch::optim::Optimizer* optim, C& comm,
                                                      const save_options& opt = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  model_and_optim_save_stats st;
  with_format(train_writers{}, opt.format, dir.name(), "training layout (torch/train_layouts.hpp)",
              [&]<class L>() { st = L::save(dir, model, optim, comm, opt); });
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// The same for a module: its parameters and buffers, sharded as `shards` says.
template <WritableDirectory D, Comm C>
model_and_optim_save_stats save_model_and_optim_state(const D& dir, const torch::nn::Module& module,
                                                      torch::optim::Optimizer* optim, C& comm,
                                                      const save_options& opt = {}, const shard_map& shards = {}) {
  return save_model_and_optim_state(dir, module_state_dict(module, shards), optim, comm, opt);
}

/// Loads DIR/model into `model`'s tensors and DIR/optim into `optim` (if given), in place,
/// under any change of world size or sharding; or the DCP folder, or the trainer's checkpoint
/// (DeepSpeed, Megatron-LM) that DIR is (torch/train_layouts.hpp). A collective over comm (for
/// agreement only; with opt.replica, every layout loads collectively: ranks that load the same
/// tensors read each byte once between them, checkpoint/replica_reads.hpp).
template <ReadableDirectory D, Comm C>
model_and_optim_load_stats load_model_and_optim_state(const D& dir, state_dict& model, torch::optim::Optimizer* optim,
                                                      C& comm, const train_load_options& opt = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  const step_scope scope("load " + std::string(dir.name()));
  model_and_optim_load_stats rep;
  if (opt.replica.replicas != replica_reads::every_rank_reads) {
    // a layout that loads collectively runs its own steps (which one: agreed first)
    bool collective = false;
    every_rank_step(comm, [&] {
      any_layout(train_layouts{}, [&]<class L>() {
        if (!L::recognise(dir)) return false;
        collective = requires { L::load_collective(dir, model, optim, comm, opt, rep); };
        return true;
      });
    });
    if (collective) {
      any_layout(train_layouts{}, [&]<class L>() {
        if (!L::recognise(dir)) return false;
        if constexpr (requires { L::load_collective(dir, model, optim, comm, opt, rep); })
          L::load_collective(dir, model, optim, comm, opt, rep);
        return true;
      });
      rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return rep;
    }
  }
  every_rank_step(comm, [&] {
    any_layout(train_layouts{}, [&]<class L>() {
      if (!L::recognise(dir)) return false;
      L::load(dir, model, optim, opt, rep);
      return true;
    });
  });
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

template <ReadableDirectory D, Comm C>
model_and_optim_load_stats load_model_and_optim_state(const D& dir, torch::nn::Module& module,
                                                      torch::optim::Optimizer* optim, C& comm,
                                                      const train_load_options& opt = {},
                                                      const shard_map& shards = {}) {
  state_dict model = module_state_dict(module, shards);
  return load_model_and_optim_state(dir, model, optim, comm, opt);
}

}  // namespace shardsafe
