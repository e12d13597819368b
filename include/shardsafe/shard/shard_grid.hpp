// shardsafe/shard/shard_grid.hpp - a regular sharding of one tensor, described in O(dims) numbers
// instead of one shard spec per file (the compact metadata.json, docs/FORMAT.md §2).
//
// A grid cuts the tensor (flat: its row-major flattening, one dimension of numel elements;
// block: each dimension d of its shape) into parts[d] pieces of chunks[d] elements, as
// torch.chunk does: piece i of dimension d holds [min(n, c*i), min(n, c*(i+1))) - trailing
// pieces may be shorter or empty. Part (i_0, ..., i_k) is held by rank base + sum(i_d *
// strides[d]). Every part is listed, empty ones too (a save lists every rank's view), in rank
// order. FSDP's even flat split over W ranks is a flat grid {chunks [ceil(n/W)], parts [W],
// strides [1]}; tensor parallelism inside a 3-D mesh is a block grid splitting one dimension,
// with the stride the mesh gives that dimension and the base of the writing stage.
//
// What this header gives: validate (the rules that make a grid's parts well formed and its
// ranks distinct), expand (every part, in rank order), overlapping (the parts that can hold
// elements of a wanted shard, found by division: O(dims + parts returned), not O(parts)), and
// detect (the grid a listed sharding is, if it is one: the guess is expanded and compared).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

struct shard_grid {
  bool flat = false;                   ///< cut the flattened tensor (one dimension) or each dimension
  std::vector<std::uint64_t> chunks;   ///< elements per piece, per dimension
  std::vector<std::uint64_t> parts;    ///< pieces per dimension
  std::uint64_t base = 0;              ///< rank of part (0, ..., 0)
  std::vector<std::uint64_t> strides;  ///< rank step per piece index, per dimension

  friend bool operator==(const shard_grid&, const shard_grid&) = default;

  /// Parts in all.
  std::uint64_t part_count() const noexcept {
    std::uint64_t p = 1;
    for (auto x : parts) p *= x;  // bounded by validate (max_grid_parts)
    return p;
  }
};

/// The most parts one tensor's grid may have (a 16,384-rank world has 16,384): what a reader
/// may have to list for one tensor (verify, unshard; a load lists those its shard meets).
inline constexpr std::uint64_t max_grid_parts = std::uint64_t(1) << 20;
/// The most parts all grids of one metadata.json may have together (a 70B model's 723 tensors
/// over 16,384 ranks: 11.8 million; the listed form's 1 GiB holds about 10 million entries), so
/// a few bytes of grid cannot stand for unbounded work.
inline constexpr std::uint64_t max_grid_parts_total = std::uint64_t(1) << 26;
/// The highest rank a grid may name.
inline constexpr std::uint64_t max_grid_rank = (std::uint64_t(1) << 31) - 1;

namespace detail {

/// The extent along a cut dimension of n elements: piece i of chunk c.
inline std::pair<std::uint64_t, std::uint64_t> grid_piece(std::uint64_t n, std::uint64_t c, std::uint64_t i) noexcept {
  // c * i may pass 2^64 (a grid of many empty trailing pieces): such a piece starts at n, empty
  const auto b = detail::checked_mul(c, i);
  const std::uint64_t begin = b && *b < n ? *b : n;
  const std::uint64_t end = begin == n ? n : std::min(n, begin + c);
  return {begin, end};
}

/// The lengths of the grid's cut dimensions for a tensor of shape `full`.
inline shape_t grid_dims(const shard_grid& g, std::span<const std::uint64_t> full) {
  if (g.flat) return {numel(full)};
  return shape_t(full.begin(), full.end());
}

}  // namespace detail

/// Checks g against a tensor of shape `full`: one chunk, part count and stride per cut
/// dimension (one when flat); chunks positive where a dimension is cut; pieces that reach
/// the end of their dimension; at most max_grid_parts parts; ranks at most max_grid_rank and
/// distinct (each dimension's stride passes everything the dimensions of smaller stride reach,
/// the rule a row-major sub-mesh follows). errc::invalid_metadata naming ctx and the rule.
#if SHARDSAFE_DEFINE
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
#else
SHARDSAFE_DECL void validate(const shard_grid& g, std::span<const std::uint64_t> full, std::string_view ctx);
#endif

namespace detail {

/// grid_part with the grid's cut dimensions (grid_dims) given.
inline std::pair<std::uint64_t, shard_spec> grid_part_of(const shard_grid& g, std::span<const std::uint64_t> dims,
                                                         std::span<const std::uint64_t> index) {
  std::uint64_t rank = g.base;
  for (std::size_t d = 0; d < dims.size(); ++d) rank += index[d] * g.strides[d];
  if (g.flat) {
    const auto [b, e] = detail::grid_piece(dims[0], g.chunks[0], index[0]);
    return {rank, shard_spec(flat_spec{{b, e}})};
  }
  shape_t ext(dims.size()), off(dims.size());
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const auto [b, e] = detail::grid_piece(dims[d], g.chunks[d], index[d]);
    off[d] = b;
    ext[d] = e - b;
  }
  return {rank, shard_spec(block_spec(std::move(ext), std::move(off)))};
}

}  // namespace detail

/// Part `index` (one piece index per cut dimension) as a rank and a shard spec.
inline std::pair<std::uint64_t, shard_spec> grid_part(const shard_grid& g, std::span<const std::uint64_t> full,
                                                      std::span<const std::uint64_t> index) {
  return detail::grid_part_of(g, detail::grid_dims(g, full), index);
}

namespace detail {

/// Calls f(index) for every index of the box [lo[d], hi[d]] (inclusive), last dimension fastest.
template <class F>
void for_each_grid_index(std::span<const std::uint64_t> lo, std::span<const std::uint64_t> hi, F&& f) {
  std::vector<std::uint64_t> at(lo.begin(), lo.end());
  for (std::size_t d = 0; d < lo.size(); ++d)
    if (lo[d] > hi[d]) return;
  while (true) {
    f(std::span<const std::uint64_t>(at));
    std::size_t d = at.size();
    while (d > 0) {
      --d;
      if (at[d] < hi[d]) {
        ++at[d];
        break;
      }
      at[d] = lo[d];
      if (d == 0) return;
    }
    if (at.empty()) return;
  }
}

/// The parts of the box, by rank.
inline std::vector<std::pair<std::uint64_t, shard_spec>> grid_box(const shard_grid& g,
                                                                  std::span<const std::uint64_t> full,
                                                                  std::span<const std::uint64_t> lo,
                                                                  std::span<const std::uint64_t> hi) {
  std::vector<std::pair<std::uint64_t, shard_spec>> out;
  const shape_t dims = grid_dims(g, full);
  for_each_grid_index(lo, hi, [&](std::span<const std::uint64_t> i) { out.push_back(grid_part_of(g, dims, i)); });
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

}  // namespace detail

/// Every part of a (validated) grid, in rank order: the listed sharding it stands for.
inline std::vector<std::pair<std::uint64_t, shard_spec>> expand(const shard_grid& g,
                                                                std::span<const std::uint64_t> full) {
  std::vector<std::uint64_t> lo(g.parts.size(), 0), hi(g.parts.size());
  for (std::size_t d = 0; d < g.parts.size(); ++d) hi[d] = g.parts[d] - 1;
  return detail::grid_box(g, full, lo, hi);
}

/// The parts of a (validated) grid that may hold elements of `want` (a superset: the parts its
/// bounding box, or bounding flat range, meets; never an empty part), in rank order. Costs the
/// dimensions plus the parts returned.
#if SHARDSAFE_DEFINE
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
  } else {  // a flat range in a block grid: its rows in the outermost dimension, the rest whole
    std::uint64_t a = 0, b = 0;
    flat_bounds(a, b);
    std::uint64_t inner = 1;
    for (std::size_t d = 1; d < nd; ++d) inner *= dims[d];
    for (std::size_t d = 0; d < nd; ++d) {
      first[d] = 0;
      last[d] = dims[d] - 1;
    }
    if (nd > 0) {
      first[0] = a / inner;
      last[0] = b / inner;
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
#else
SHARDSAFE_DECL std::vector<std::pair<std::uint64_t, shard_spec>> overlapping(const shard_grid& g,
                                                                             std::span<const std::uint64_t> full,
                                                                             const shard_spec& want);
#endif

/// The grid that `listed` (rank, spec) in rank order is, if it is one: every part listed once,
/// each as grid_part gives it. The guess (chunks from the parts at offset 0, strides from the
/// parts one step along each dimension) is validated and expanded, and must equal `listed`.
#if SHARDSAFE_DEFINE
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
#else
SHARDSAFE_DECL std::optional<shard_grid> detect_grid(std::span<const std::pair<std::uint64_t, shard_spec>> listed,
                                                     std::span<const std::uint64_t> full);
#endif

}  // namespace shardsafe
