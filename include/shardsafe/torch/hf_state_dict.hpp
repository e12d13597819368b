// shardsafe/torch/hf_state_dict.hpp - a Hugging Face folder imported into a LibTorch state dict or
// torch::nn::Module, sharded as the caller says, collectively over a Comm
// (checkpoint/hf/import.hpp does the work: key mapping, every-rank-read or rank-0-broadcast,
// dtype conversion, errors every rank agrees on).
//
// Tied tensors are found by storage identity: entries whose tensors share storage, offset,
// sizes, strides and dtype (an output projection registered as the input embedding's
// parameter) are one memory, loaded once and still shared afterwards. Tensors that are not CPU
// and contiguous (CUDA parameters, a transposed view) are loaded into a CPU tensor of their own
// size and copied back, one staging tensor per distinct storage (tied ones share it), as
// load_state_dict does; those stage all at once, so their total size is the staging memory.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/torch/host_staging.hpp"
#include "shardsafe/torch/module.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

/// Imports the checkpoint in dir into sd's tensors, in place (every rank calls it with its own
/// shards). Undefined tensors are an error on every rank.
template <ReadableDirectory D, Comm C>
hf_import_stats load_hf_state_dict(const D& dir, state_dict& sd, C& comm, const hf_import_options& opt = {}) {
  const step_scope scope("import " + std::string(dir.name()));
  std::vector<flat_view> views;
  detail::host_staging staging;
  every_rank_step(comm, [&] {
    for (auto& [key, t] : sd) {
      detail::require_defined(dir.name(), key, t);
      views.push_back(detail::view_of(key, t, is_viewable(t.local) ? t.local : staging.memory_for(t.local)));
    }
  });
  hf_import_stats res = import_hf(dir, std::span<const flat_view>(views), comm, opt);
  // copy back only what was loaded: a staged tensor nothing fed keeps its values
  std::set<const std::byte*> fed;
  for (const auto& e : res.keys.loads) fed.insert(views[e.view].data);
  staging.copy_back([&](const std::byte* p) { return fed.count(p) > 0; });
  return res;
}

/// Imports the checkpoint in dir into m's parameters and buffers (named as named_parameters()
/// and named_buffers() name them), sharded as `shards` says (a name not in it: the whole
/// tensor). Tied parameters (two names, one tensor) are loaded once and stay tied.
template <ReadableDirectory D, Comm C>
hf_import_stats load_hf_module(const D& dir, torch::nn::Module& m, C& comm, const shard_map& shards = {},
                               const hf_import_options& opt = {}) {
  const step_scope scope("import " + std::string(dir.name()));
  state_dict sd;
  every_rank_step(comm, [&] { sd = module_state_dict(m, shards); });
  return load_hf_state_dict(dir, sd, comm, opt);
}

}  // namespace shardsafe
