// shardsafe/shard/overlap.hpp - how my shard overlaps a file's shard.
//
// compute_overlap(mine, other, full) classifies by the sets of elements held:
//   EQUAL     mine and other hold the same elements
//   SUPERSET  mine holds every element of other, and more
//   SUBSET    other holds every element of mine, and more
//   MIXED     they share some elements, and each holds some the other lacks
//   nullopt   they share nothing
// "mine" is the loader's shard and "other" the file's, as in OLMo-core. On every case of
// OLMo-core's own table the answers agree; where OLMo-core compares ranges pairwise and
// ignores ranges with no partner (mine [[0,3),[6,9)] vs other [[0,3)] is EQUAL there), the
// set answer (SUPERSET) is the one a loader can act on.
//
// Both specs must have been validated against `full`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <variant>

#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

enum class overlap_type { equal, superset, subset, mixed };

constexpr std::string_view to_string(overlap_type t) noexcept {
  switch (t) {
    case overlap_type::equal: return "EQUAL";
    case overlap_type::superset: return "SUPERSET";
    case overlap_type::subset: return "SUBSET";
    case overlap_type::mixed: return "MIXED";
  }
  return "?";
}

/// One piece both shards hold: global elements [global, global + len), at local offset
/// `mine` in my flat view and `other` in the other's.
struct overlap_piece {
  std::uint64_t global = 0;
  std::uint64_t len = 0;
  std::uint64_t mine = 0;
  std::uint64_t other = 0;
};

namespace detail {

/// The intersection of two blocks, if not empty: its offset and extent per dimension.
struct box {
  shape_t offset;
  shape_t extent;
};

inline std::optional<box> intersect(const block_spec& a, const block_spec& b) {
  const std::size_t nd = a.local_shape().size();
  box r{shape_t(nd), shape_t(nd)};
  for (std::size_t d = 0; d < nd; ++d) {
    const std::uint64_t lo = std::max(a.global_offset()[d], b.global_offset()[d]);
    const std::uint64_t hi =
        std::min(a.global_offset()[d] + a.local_shape()[d], b.global_offset()[d] + b.local_shape()[d]);
    if (hi <= lo) return std::nullopt;
    r.offset[d] = lo;
    r.extent[d] = hi - lo;
  }
  return r;
}

/// The number of elements two blocks share (the intersection's volume), without building it:
/// plan_load asks this of every file of a tensor, so it allocates nothing.
inline std::uint64_t intersect_numel(const block_spec& a, const block_spec& b) noexcept {
  const std::size_t nd = a.local_shape().size();
  std::uint64_t n = 1;
  for (std::size_t d = 0; d < nd; ++d) {
    const std::uint64_t lo = std::max(a.global_offset()[d], b.global_offset()[d]);
    const std::uint64_t hi =
        std::min(a.global_offset()[d] + a.local_shape()[d], b.global_offset()[d] + b.local_shape()[d]);
    if (hi <= lo) return 0;
    n *= hi - lo;
  }
  return n;
}

/// The first dimension of a box piece: the dimensions after it span both blocks whole, so
/// one piece is contiguous in both local views.
inline std::size_t box_fuse_dim(const box& bx, const block_spec& a, const block_spec& b) noexcept {
  std::size_t k = bx.extent.size() - 1;
  while (k > 0 && bx.extent[k] == a.local_shape()[k] && bx.extent[k] == b.local_shape()[k]) --k;
  return k;
}

/// How many pieces for_each_box_piece produces.
inline std::uint64_t box_piece_count(const block_spec& a, const block_spec& b) {
  auto bx = intersect(a, b);
  if (!bx) return 0;
  if (bx->extent.empty()) return 1;  // 0-d
  std::uint64_t n = 1;
  for (std::size_t d = 0, k = box_fuse_dim(*bx, a, b); d < k; ++d) n *= bx->extent[d];
  return n;
}

/// Rows of the intersection box, fused along trailing dimensions wherever the box spans
/// both blocks whole, in increasing global order.
template <class F>
void for_each_box_piece(const block_spec& a, const block_spec& b, std::span<const std::uint64_t> full, F&& f) {
  auto bx = intersect(a, b);
  if (!bx) return;
  const std::size_t nd = full.size();
  if (nd == 0) {  // 0-d: one element
    f(overlap_piece{0, 1, 0, 0});
    return;
  }
  // strides of the full tensor and of each block's local row-major layout
  shape_t sf(nd, 1), sa(nd, 1), sb(nd, 1);
  for (std::size_t d = nd; d-- > 1;) {
    sf[d - 1] = sf[d] * full[d];
    sa[d - 1] = sa[d] * a.local_shape()[d];
    sb[d - 1] = sb[d] * b.local_shape()[d];
  }
  // fuse: k is the first dimension of the contiguous piece; dims after k span both blocks
  const std::size_t k = box_fuse_dim(*bx, a, b);
  std::uint64_t len = bx->extent[k] * sa[k];  // == extent[k] * prod(extent[k+1..])
  std::uint64_t g = 0, pa = 0, pb = 0;
  for (std::size_t d = 0; d < nd; ++d) {
    g += bx->offset[d] * sf[d];
    pa += (bx->offset[d] - a.global_offset()[d]) * sa[d];
    pb += (bx->offset[d] - b.global_offset()[d]) * sb[d];
  }
  // odometer over dims [0, k)
  shape_t j(k, 0);
  while (true) {
    f(overlap_piece{g, len, pa, pb});
    std::size_t d = k;
    while (d-- > 0) {
      g += sf[d];
      pa += sa[d];
      pb += sb[d];
      if (++j[d] < bx->extent[d]) break;
      g -= bx->extent[d] * sf[d];
      pa -= bx->extent[d] * sa[d];
      pb -= bx->extent[d] * sb[d];
      j[d] = 0;
    }
    if (d == static_cast<std::size_t>(-1)) return;
  }
}

/// The linear merge of two cursors: each cursor seeks past the other's gaps.
template <SpecCursor CA, SpecCursor CB, class F>
void merge_cursors(CA ca, CB cb, F&& f) {
  while (!ca.done() && !cb.done()) {
    const spec_run ra = ca.run(), rb = cb.run();
    if (ra.end <= rb.begin) {
      ca.seek(rb.begin);
      continue;
    }
    if (rb.end <= ra.begin) {
      cb.seek(ra.begin);
      continue;
    }
    const std::uint64_t lo = std::max(ra.begin, rb.begin), hi = std::min(ra.end, rb.end);
    f(overlap_piece{lo, hi - lo, ra.local + (lo - ra.begin), rb.local + (lo - rb.begin)});
    if (ra.end == hi) ca.next();
    if (rb.end == hi) cb.next();
  }
}

template <class S>
inline constexpr bool is_variant_spec = std::is_same_v<std::remove_cvref_t<S>, shard_spec>;

}  // namespace detail

/// Calls f(overlap_piece) for every maximal piece of elements both specs hold, in increasing
/// global order (pieces from block x block are whole rows of the intersection, fused).
template <ShardSpec A, ShardSpec B, class F>
void for_each_overlap(const A& mine, const B& other, std::span<const std::uint64_t> full, F&& f) {
  if constexpr (detail::is_variant_spec<A>) {
    std::visit([&](const auto& m) { for_each_overlap(m, other, full, f); }, mine.variant());
  } else if constexpr (detail::is_variant_spec<B>) {
    std::visit([&](const auto& o) { for_each_overlap(mine, o, full, f); }, other.variant());
  } else if constexpr (std::is_same_v<A, block_spec> && std::is_same_v<B, block_spec>) {
    detail::for_each_box_piece(mine, other, full, f);
  } else {
    detail::merge_cursors(mine.cursor(full), other.cursor(full), f);
  }
}

/// How many elements both specs hold.
template <ShardSpec A, ShardSpec B>
std::uint64_t overlap_numel(const A& mine, const B& other, std::span<const std::uint64_t> full) {
  if constexpr (detail::is_variant_spec<A>) {
    return std::visit([&](const auto& m) { return overlap_numel(m, other, full); }, mine.variant());
  } else if constexpr (detail::is_variant_spec<B>) {
    return std::visit([&](const auto& o) { return overlap_numel(mine, o, full); }, other.variant());
  } else if constexpr (std::is_same_v<A, block_spec> && std::is_same_v<B, block_spec>) {
    if (full.empty()) return mine.local_numel() && other.local_numel() ? 1 : 0;
    return detail::intersect_numel(mine, other);
  } else {
    std::uint64_t n = 0;
    detail::merge_cursors(mine.cursor(full), other.cursor(full), [&](const overlap_piece& p) { n += p.len; });
    return n;
  }
}

/// Classifies from the three counts: what both hold, what mine holds, what other holds.
constexpr std::optional<overlap_type> classify_overlap(std::uint64_t both, std::uint64_t mine,
                                                       std::uint64_t other) noexcept {
  if (both == 0) return std::nullopt;
  const bool all_mine = both == mine, all_other = both == other;
  if (all_mine && all_other) return overlap_type::equal;
  if (all_other) return overlap_type::superset;
  if (all_mine) return overlap_type::subset;
  return overlap_type::mixed;
}

/// How mine (the loader's shard) overlaps other (a file's shard) in a tensor of shape full.
template <ShardSpec A, ShardSpec B>
std::optional<overlap_type> compute_overlap(const A& mine, const B& other, std::span<const std::uint64_t> full) {
  if constexpr (std::is_same_v<A, B>) {
    if (mine == other && mine.local_numel() > 0) return overlap_type::equal;
  }
  return classify_overlap(overlap_numel(mine, other, full), mine.local_numel(), other.local_numel());
}

}  // namespace shardsafe
