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
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/torch/module.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

namespace detail {

/// What makes two tensors one memory: storage, offset, sizes, strides, dtype.
using tensor_identity =
    std::tuple<const void*, std::int64_t, std::vector<std::int64_t>, std::vector<std::int64_t>, int>;

inline tensor_identity identity_of(const at::Tensor& t) {
  return {t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.sizes().vec(), t.strides().vec(),
          static_cast<int>(t.scalar_type())};
}

}  // namespace detail

/// Imports the checkpoint in dir into sd's tensors, in place (every rank calls it with its own
/// shards). Undefined tensors are an error on every rank.
template <ReadableDirectory D, Comm C>
hf_import_stats load_hf_state_dict(const D& dir, state_dict& sd, C& comm, const hf_import_options& opt = {}) {
  const step_scope scope("import " + std::string(dir.name()));
  std::vector<flat_view> views;
  std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (the caller's tensor, its CPU staging)
  std::map<detail::tensor_identity, std::size_t> staging_of;
  every_rank_step(comm, [&] {
    for (auto& [key, t] : sd) {
      detail::require_defined(dir.name(), key, t);
      if (is_viewable(t.local)) {
        views.push_back(detail::view_of(key, t, t.local));
        continue;
      }
      auto [it, fresh] = staging_of.emplace(detail::identity_of(t.local), staged.size());
      if (fresh)
        staged.emplace_back(
            t.local,
            at::empty(t.local.sizes(), t.local.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous)));
      views.push_back(detail::view_of(key, t, staged[it->second].second));
    }
  });
  hf_import_stats res = import_hf(dir, std::span<const flat_view>(views), comm, opt);
  // copy back only what was loaded: a staged tensor nothing fed keeps its values
  std::vector<bool> fed(staged.size(), false);
  for (const auto& e : res.keys.loads)
    for (std::size_t s = 0; s < staged.size(); ++s)
      if (views[e.view].data == static_cast<std::byte*>(staged[s].second.data_ptr())) fed[s] = true;
  at::NoGradGuard no_grad;
  for (std::size_t s = 0; s < staged.size(); ++s)
    if (fed[s]) staged[s].first.copy_(staged[s].second);
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
