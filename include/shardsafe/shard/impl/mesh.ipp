// shardsafe/shard/impl/mesh.ipp - mesh.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/shard/mesh.hpp"

namespace shardsafe {

SHARDSAFE_DECL std::vector<block_spec> mesh_blocks(std::span<const std::uint64_t> full,
                                                   std::span<const std::uint64_t> mesh_shape,
                                                   std::span<const placement> placements, std::string_view ctx) {
  validate_placements(full, mesh_shape, placements, ctx);
  const std::uint64_t n = numel(mesh_shape);
  std::vector<block_spec> out;
  out.reserve(static_cast<std::size_t>(n));
  shape_t c(mesh_shape.size(), 0);
  for (std::uint64_t r = 0; r < n; ++r) {
    out.push_back(mesh_block_at(full, mesh_shape, c, placements, ctx));
    for (std::size_t d = c.size(); d-- > 0;) {  // row-major odometer
      if (++c[d] < mesh_shape[d]) break;
      c[d] = 0;
    }
  }
  return out;
}

}  // namespace shardsafe
