// shardsafe/shard/impl/shard_grid.ipp - shard_grid.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/shard/shard_grid.hpp"

namespace shardsafe {

SHARDSAFE_DECL void validate(const shard_grid& g, std::span<const std::uint64_t> full, std::string_view ctx) {
  const std::string c(ctx);
  const shape_t dims = detail::grid_dims(g, full);
  if (g.chunks.size() != dims.size() || g.parts.size() != dims.size() || g.strides.size() != dims.size())
    fail(errc::invalid_metadata, c + ": the grid gives " + std::to_string(g.chunks.size()) + " chunks, " +
                                     std::to_string(g.parts.size()) + " part counts and " +
                                     std::to_string(g.strides.size()) + " strides for " + std::to_string(dims.size()) +
                                     (g.flat ? " flattened dimension" : " dimensions"));
  std::uint64_t total = 1;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const std::string at = c + ": grid dimension " + std::to_string(d);
    if (g.parts[d] == 0) fail(errc::invalid_metadata, at + ": 0 parts");
    if (g.chunks[d] == 0 && dims[d] > 0)
      fail(errc::invalid_metadata, at + ": chunks of 0 elements cut " + std::to_string(dims[d]));
    // the pieces must reach the end of the dimension: c * parts >= n
    const auto reach = detail::checked_mul(g.chunks[d], g.parts[d]);
    if (reach && *reach < dims[d])
      fail(errc::invalid_metadata, at + ": " + std::to_string(g.parts[d]) + " pieces of " +
                                       std::to_string(g.chunks[d]) + " elements do not cover its " +
                                       std::to_string(dims[d]));
    const auto t = detail::checked_mul(total, g.parts[d]);
    if (!t || *t > max_grid_parts)
      fail(errc::invalid_metadata, c + ": the grid has more than " + std::to_string(max_grid_parts) + " parts");
    total = *t;
    if (g.parts[d] == 1 && g.strides[d] != 0)
      fail(errc::invalid_metadata, at + ": is not cut but has stride " + std::to_string(g.strides[d]) + " (not 0)");
  }
  // distinct ranks: ordered by stride, each stride passes the highest rank offset below it
  std::vector<std::size_t> order;
  for (std::size_t d = 0; d < dims.size(); ++d)
    if (g.parts[d] > 1) order.push_back(d);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return g.strides[a] < g.strides[b]; });
  std::uint64_t reach = 0;  // the highest rank offset the dimensions so far reach
  for (std::size_t d : order) {
    if (g.strides[d] <= reach)
      fail(errc::invalid_metadata, c + ": grid dimension " + std::to_string(d) + "'s stride " +
                                       std::to_string(g.strides[d]) + " gives two parts the same rank");
    const auto r = detail::checked_mul(g.strides[d], g.parts[d] - 1);
    if (!r || *r > max_grid_rank)
      fail(errc::invalid_metadata, c + ": the grid names ranks past " + std::to_string(max_grid_rank));
    reach += *r;
  }
  if (g.base > max_grid_rank || g.base + reach > max_grid_rank)
    fail(errc::invalid_metadata, c + ": the grid names ranks past " + std::to_string(max_grid_rank));
}

SHARDSAFE_DECL std::vector<std::pair<std::uint64_t, shard_spec>> overlapping(const shard_grid& g,
                                                                             std::span<const std::uint64_t> full,
                                                                             const shard_spec& want) {
  const shape_t dims = detail::grid_dims(g, full);
  const std::size_t nd = dims.size();
  if (want.local_numel() == 0) return {};
  // the wanted bounding box in the grid's dimensions, inclusive: first and last element index
  std::vector<std::uint64_t> first(nd), last(nd);
  auto flat_bounds = [&](std::uint64_t& a, std::uint64_t& b) {  // [a, b] of the wanted elements, flattened
    if (want.is_flat()) {
      const auto& rs = want.flat().ranges();
      a = ~std::uint64_t(0);
      b = 0;
      for (const auto& r : rs)
        if (r.end > r.begin) {
          a = std::min(a, r.begin);
          b = std::max(b, r.end - 1);
        }
    } else {  // the block's first and last element
      const auto& bl = want.block();
      a = b = 0;
      for (std::size_t d = 0; d < full.size(); ++d) {
        a = a * full[d] + bl.global_offset()[d];
        b = b * full[d] + bl.global_offset()[d] + bl.local_shape()[d] - 1;
      }
    }
  };
  if (g.flat) {
    flat_bounds(first[0], last[0]);
  } else if (want.is_block()) {
    const auto& bl = want.block();
    for (std::size_t d = 0; d < nd; ++d) {
      first[d] = bl.global_offset()[d];
      last[d] = bl.global_offset()[d] + bl.local_shape()[d] - 1;
    }
  } else {  // a flat range in a block grid: its bounding box. The leading dimensions where its
    // first and last element agree are fixed, the next spans their indices, the rest whole
    std::uint64_t a = 0, b = 0;
    flat_bounds(a, b);
    for (std::size_t d = nd; d-- > 0;) {  // multi-indices, last dimension first
      first[d] = a % dims[d];
      last[d] = b % dims[d];
      a /= dims[d];
      b /= dims[d];
    }
    std::size_t k = 0;
    while (k < nd && first[k] == last[k]) ++k;
    for (std::size_t d = k + 1; d < nd; ++d) {
      first[d] = 0;
      last[d] = dims[d] - 1;
    }
  }
  std::vector<std::uint64_t> lo(nd), hi(nd);
  for (std::size_t d = 0; d < nd; ++d) {
    const std::uint64_t c = g.chunks[d];
    lo[d] = first[d] / c;
    hi[d] = std::min(g.parts[d] - 1, last[d] / c);
  }
  return detail::grid_box(g, full, lo, hi);
}

SHARDSAFE_DECL std::optional<shard_grid> detect_grid(std::span<const std::pair<std::uint64_t, shard_spec>> listed,
                                                     std::span<const std::uint64_t> full) {
  if (listed.size() < 2) return std::nullopt;
  shard_grid g;
  g.flat = listed.front().second.is_flat();
  for (const auto& [r, s] : listed)
    if (s.is_flat() != g.flat || (g.flat && s.flat().ranges().size() != 1)) return std::nullopt;
  const shape_t dims = detail::grid_dims(g, full);
  const std::size_t nd = dims.size();
  if (nd == 0) return std::nullopt;
  auto offset = [&](const shard_spec& s, std::size_t d) {
    return g.flat ? s.flat().ranges()[0].begin : s.block().global_offset()[d];
  };
  auto extent = [&](const shard_spec& s, std::size_t d) {
    return g.flat ? s.flat().ranges()[0].size() : s.block().local_shape()[d];
  };
  // chunks: the largest piece starting at 0 along each dimension; parts: distinct offsets
  g.chunks.assign(nd, 0);
  g.parts.assign(nd, 0);
  g.strides.assign(nd, 0);
  for (std::size_t d = 0; d < nd; ++d) {
    std::vector<std::uint64_t> offs;
    for (const auto& [r, s] : listed) {
      offs.push_back(offset(s, d));
      if (offset(s, d) == 0) g.chunks[d] = std::max(g.chunks[d], extent(s, d));
    }
    std::sort(offs.begin(), offs.end());
    g.parts[d] = static_cast<std::uint64_t>(std::unique(offs.begin(), offs.end()) - offs.begin());
    if (g.chunks[d] == 0) return std::nullopt;
  }
  if (g.flat) g.parts[0] = listed.size();  // empty trailing pieces share the offset n
  // ranks: the base is part 0's; a stride is the rank of the part one piece along
  auto index_of = [&](const shard_spec& s, std::size_t d) { return offset(s, d) / g.chunks[d]; };
  g.base = listed.front().first;
  bool have_base = false;
  for (const auto& [r, s] : listed) {
    std::size_t ones = 0, at = 0;
    bool zero = true;
    for (std::size_t d = 0; d < nd; ++d) {
      const std::uint64_t i = index_of(s, d);
      if (i != 0) zero = false;
      if (i == 1)
        ++ones, at = d;
      else if (i != 0)
        ones = nd + 1;
    }
    if (zero && extent(s, 0) > 0 && !have_base) g.base = r, have_base = true;
    if (ones == 1 && s.local_numel() > 0) g.strides[at] = r;  // made relative below
  }
  if (!have_base) return std::nullopt;
  for (std::size_t d = 0; d < nd; ++d) {
    if (g.parts[d] == 1) {
      g.strides[d] = 0;
      continue;
    }
    if (g.strides[d] <= g.base) return std::nullopt;
    g.strides[d] -= g.base;
  }
  if (g.flat) {  // parts by list order (equal offsets at the end): the stride of consecutive ranks
    if (listed[1].first <= listed[0].first) return std::nullopt;
    g.strides[0] = listed[1].first - listed[0].first;
  }
  try {
    validate(g, full, "");
  } catch (const error&) {
    return std::nullopt;
  }
  if (g.part_count() != listed.size()) return std::nullopt;
  const auto parts = expand(g, full);
  if (!std::equal(parts.begin(), parts.end(), listed.begin(), listed.end())) return std::nullopt;
  return g;
}

}  // namespace shardsafe
