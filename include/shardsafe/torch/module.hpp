// shardsafe/torch/module.hpp - a torch::nn::Module's parameters and buffers as a state dict.
//
// For a sharded model the module's parameters are this rank's local data; `shards` says,
// by name, which shard each sharded one holds and the full shape (mesh_shard: from a device
// mesh and placements). Names are the module's dotted names ("layers.0.weight").
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "shardsafe/shard/mesh.hpp"
#include "shardsafe/torch/state_dict.hpp"

namespace shardsafe {

/// How one named tensor is sharded: this rank's spec, the full shape, and its replica role.
struct shard_info {
  shard_spec spec;
  shape_t full_shape;
  replica_role replica = replica_role::none;
};
using shard_map = std::map<std::string, shard_info>;

/// How this rank holds a tensor of shape full laid out on mesh by placements (shard/mesh.hpp):
/// its block, and its replica role (writer or copy where a mesh dimension replicates it; salt
/// spreads the writers of unsharded tensors, e.g. the tensor's position in the model).
inline shard_info mesh_shard(std::span<const std::uint64_t> full, const device_mesh& mesh,
                             std::span<const placement> placements, std::string_view key, std::uint64_t salt = 0) {
  return {mesh_block(full, mesh, placements, "tensor '" + std::string(key) + "'"), shape_t(full.begin(), full.end()),
          mesh_replica_role(mesh, placements, salt)};
}

/// The elements of block b of a full tensor, as a new contiguous tensor (b fits full's shape):
/// what a rank of a mesh holds when it starts from the whole tensor.
inline at::Tensor block_of(const at::Tensor& full, const block_spec& b) {
  at::Tensor t = full;
  for (std::size_t d = 0; d < b.local_shape().size(); ++d)
    t = t.narrow(static_cast<std::int64_t>(d), static_cast<std::int64_t>(b.global_offset()[d]),
                 static_cast<std::int64_t>(b.local_shape()[d]));  // an empty block starts at the extent: allowed
  return t.contiguous().clone();
}

/// Parameters then buffers of m (recursively), sharded as `shards` says. The tensors are the
/// module's own (loading writes into the module in place).
inline state_dict module_state_dict(const torch::nn::Module& m, const shard_map& shards = {}) {
  state_dict sd;
  auto add = [&](const std::string& key, const at::Tensor& t) {
    if (!t.defined()) return;
    if (auto it = shards.find(key); it != shards.end())
      sd.add(key, t, it->second.spec, it->second.full_shape, it->second.replica);
    else
      sd.add(key, t);
  };
  for (const auto& p : m.named_parameters(/*recurse=*/true)) add(p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/true)) add(b.key(), b.value());
  for (const auto& [k, s] : shards)
    if (!sd.find(k))
      fail(errc::invalid_argument, "module_state_dict: shard given for '" + k + "', which the module lacks");
  return sd;
}

}  // namespace shardsafe
