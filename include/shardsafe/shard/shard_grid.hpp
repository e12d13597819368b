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
// ranks distinct, by arithmetic on the strides), for_each_part (every part in rank order, one at
// a time, found by counting: nothing listed or sorted), expand (every part, in rank order), overlapping (the parts that can hold
// elements of a wanted shard, found by division: O(dims + parts returned), not O(parts)), and
// detect (the grid a listed sharding is, if it is one: the guess is expanded and compared).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
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
SHARDSAFE_DECL void validate(const shard_grid& g, std::span<const std::uint64_t> full, std::string_view ctx);

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

/// The cut dimensions of a (validated) grid that have more than one part, by descending stride:
/// the order in which their indices make the rank grow (each stride passes all that the
/// dimensions of smaller strides reach), so the grid's parts in rank order are its indices in
/// lexicographic order over these dimensions.
inline std::vector<std::size_t> grid_rank_order(const shard_grid& g) {
  std::vector<std::size_t> order;
  for (std::size_t d = 0; d < g.parts.size(); ++d)
    if (g.parts[d] > 1) order.push_back(d);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return g.strides[a] > g.strides[b]; });
  return order;
}

/// Calls f(index) for every index of the box [lo[d], hi[d]] (inclusive) of a (validated) grid,
/// in rank order, without listing or sorting them: O(1) memory past the index. Stops early
/// when f returns false (f may return void).
template <class F>
void for_each_grid_index(const shard_grid& g, std::span<const std::uint64_t> lo, std::span<const std::uint64_t> hi,
                         F&& f) {
  for (std::size_t d = 0; d < lo.size(); ++d)
    if (lo[d] > hi[d]) return;
  std::vector<std::uint64_t> at(lo.begin(), lo.end());
  const std::vector<std::size_t> order = grid_rank_order(g);  // a dimension of one part stays at its one index
  while (true) {
    if constexpr (std::is_same_v<decltype(f(std::span<const std::uint64_t>(at))), bool>) {
      if (!f(std::span<const std::uint64_t>(at))) return;
    } else {
      f(std::span<const std::uint64_t>(at));
    }
    std::size_t k = order.size();  // the last of order (smallest stride) fastest
    while (true) {
      if (k == 0) return;
      const std::size_t d = order[--k];
      if (at[d] < hi[d]) {
        ++at[d];
        break;
      }
      at[d] = lo[d];
    }
  }
}

/// The parts of the box, in rank order.
inline std::vector<std::pair<std::uint64_t, shard_spec>> grid_box(const shard_grid& g,
                                                                  std::span<const std::uint64_t> full,
                                                                  std::span<const std::uint64_t> lo,
                                                                  std::span<const std::uint64_t> hi) {
  std::vector<std::pair<std::uint64_t, shard_spec>> out;
  const shape_t dims = grid_dims(g, full);
  for_each_grid_index(g, lo, hi, [&](std::span<const std::uint64_t> i) { out.push_back(grid_part_of(g, dims, i)); });
  return out;
}

}  // namespace detail

/// Calls f(rank, spec) for every part of a (validated) grid, in rank order, one part at a time
/// (nothing is listed: O(dims) memory whatever the part count). Stops early when f returns false
/// (f may return void).
template <class F>
void for_each_part(const shard_grid& g, std::span<const std::uint64_t> full, F&& f) {
  const shape_t dims = detail::grid_dims(g, full);
  std::vector<std::uint64_t> lo(g.parts.size(), 0), hi(g.parts.size());
  for (std::size_t d = 0; d < g.parts.size(); ++d) hi[d] = g.parts[d] - 1;
  detail::for_each_grid_index(g, lo, hi, [&](std::span<const std::uint64_t> i) {
    auto [rank, spec] = detail::grid_part_of(g, dims, i);
    if constexpr (std::is_same_v<decltype(f(rank, spec)), bool>)
      return f(rank, spec);
    else {
      f(rank, spec);
      return true;
    }
  });
}

/// Every part of a (validated) grid, in rank order: the listed sharding it stands for (O(parts)
/// memory: for_each_part visits them one at a time).
inline std::vector<std::pair<std::uint64_t, shard_spec>> expand(const shard_grid& g,
                                                                std::span<const std::uint64_t> full) {
  std::vector<std::pair<std::uint64_t, shard_spec>> out;
  out.reserve(static_cast<std::size_t>(g.part_count()));
  for_each_part(g, full, [&](std::uint64_t r, shard_spec& s) { out.emplace_back(r, std::move(s)); });
  return out;
}

/// The parts of a (validated) grid that may hold elements of `want` (a superset: the parts its
/// bounding box, or bounding flat range, meets; never an empty part), in rank order. Costs the
/// dimensions plus the parts returned.
SHARDSAFE_DECL std::vector<std::pair<std::uint64_t, shard_spec>> overlapping(const shard_grid& g,
                                                                             std::span<const std::uint64_t> full,
                                                                             const shard_spec& want);

/// The grid that `listed` (rank, spec) in rank order is, if it is one: every part listed once,
/// each as grid_part gives it. The guess (chunks from the parts at offset 0, strides from the
/// parts one step along each dimension) is validated and expanded, and must equal `listed`.
SHARDSAFE_DECL std::optional<shard_grid> detect_grid(std::span<const std::pair<std::uint64_t, shard_spec>> listed,
                                                     std::span<const std::uint64_t> full);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/shard/impl/shard_grid.ipp"
#endif
