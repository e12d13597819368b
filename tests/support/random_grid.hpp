// tests/support/random_grid.hpp - random shard grids (shard/shard_grid.hpp) for the tests of the
// description tree and of rank 0's grids found from boxes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "shardsafe/shard/shard_grid.hpp"

namespace testing {

/// A random grid of a random shape, not always valid (validate says): 1 to 3 dimensions, uneven
/// cuts, rank strides of a row-major sub-mesh with a base.
inline std::pair<shardsafe::shard_grid, shardsafe::shape_t> random_grid(std::mt19937_64& rng) {
  using namespace shardsafe;
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
  };
  shard_grid g;
  g.flat = pick(0, 2) == 0;
  shape_t full;
  const std::size_t nd = static_cast<std::size_t>(pick(1, 3));
  for (std::size_t d = 0; d < nd; ++d) full.push_back(pick(1, 14));
  const shape_t dims = detail::grid_dims(g, full);
  for (std::uint64_t n : dims) {
    const std::uint64_t parts = pick(1, 5);
    g.parts.push_back(parts);
    g.chunks.push_back(std::max<std::uint64_t>(1, (n + parts - 1) / parts + (pick(0, 3) == 0 ? pick(0, 2) : 0)));
  }
  // strides: a row-major sub-mesh in a random order of the dimensions, with a gap factor
  std::vector<std::size_t> order(dims.size());
  std::iota(order.begin(), order.end(), std::size_t(0));
  std::shuffle(order.begin(), order.end(), rng);
  std::uint64_t step = pick(1, 2);
  g.strides.assign(dims.size(), 0);
  for (std::size_t d : order) {
    if (g.parts[d] == 1) continue;
    g.strides[d] = step;
    step *= g.parts[d] * pick(1, 2);
  }
  g.base = pick(0, 3);
  return {g, full};
}

}  // namespace testing
