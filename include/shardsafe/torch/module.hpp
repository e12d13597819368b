// shardsafe/torch/module.hpp - a torch::nn::Module's parameters and buffers as a state dict.
//
// For a sharded model the module's parameters are this rank's local data; `shards` says,
// by name, which shard each sharded one holds and the full shape. Names are the module's
// dotted names ("layers.0.weight").
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

/// How one named tensor is sharded: this rank's spec and the full shape.
struct shard_info {
  shard_spec spec;
  shape_t full_shape;
};
using shard_map = std::map<std::string, shard_info>;

/// Parameters then buffers of m (recursively), sharded as `shards` says. The tensors are the
/// module's own (loading writes into the module in place).
inline state_dict module_state_dict(const torch::nn::Module& m, const shard_map& shards = {}) {
  state_dict sd;
  auto add = [&](const std::string& key, const at::Tensor& t) {
    if (!t.defined()) return;
    if (auto it = shards.find(key); it != shards.end())
      sd.add(key, t, it->second.spec, it->second.full_shape);
    else
      sd.add(key, t);
  };
  for (const auto& p : m.named_parameters(/*recurse=*/true)) add(p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/true)) add(b.key(), b.value());
  for (const auto& [k, s] : shards)
    if (!sd.find(k)) fail(errc::invalid_argument, "module_state_dict: shard given for '" + k + "', which the module lacks");
  return sd;
}

}  // namespace shardsafe
