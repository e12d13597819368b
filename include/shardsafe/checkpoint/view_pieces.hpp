// shardsafe/checkpoint/view_pieces.hpp - a rank's views taken as one stream of bytes, cut into
// pieces that are views of their own: what replicas read once (checkpoint/replica_reads.hpp)
// splits a group's views with, member i reading piece i.
//
// The stream is the views' local bytes one after another, in order. A cut inside a view moves
// back to the start of its element (a flat spec, an unsharded view) or of its slice of the
// block's first dimension longer than 1 (a block), so that the bytes [x, y) of a view between
// two cuts are the local memory of sub_view(v, x, y): the same tensor, a flat spec (or a block)
// of exactly the elements those bytes hold. Cuts are monotone in the stream position, so the
// pieces between consecutive positions partition every view.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"

namespace shardsafe::detail {

/// The bytes a piece boundary inside v may fall on: an element (a flat spec, an unsharded
/// view), else a slice of the block's first dimension longer than 1.
inline std::uint64_t cut_unit(const flat_view& v) {
  const std::uint64_t item = item_size(v.type);
  if (!v.spec || v.spec->is_flat()) return item;
  const shape_t& ls = v.spec->block().local_shape();
  std::size_t d = 0;
  while (d + 1 < ls.size() && ls[d] == 1) ++d;
  std::uint64_t inner = 1;
  for (std::size_t k = d + 1; k < ls.size(); ++k) inner *= ls[k];
  return item * inner;
}

/// Bytes [x, y) of v's local memory as a view of its own: the same tensor, the elements those
/// bytes hold (x and y multiples of cut_unit(v)).
inline flat_view sub_view(const flat_view& v, std::uint64_t x, std::uint64_t y) {
  flat_view s = v;
  s.data = v.data + x;
  s.nbytes = y - x;
  s.replica = replica_role::none;
  const std::uint64_t item = item_size(v.type), a = x / item, b = y / item;
  if (!v.spec) {
    s.spec = flat_spec{{a, b}};
  } else if (v.spec->is_flat()) {
    std::vector<element_range> out;
    std::uint64_t at = 0;  // local offset of the range
    for (const element_range& r : v.spec->flat().ranges()) {
      const std::uint64_t lo = std::max(a, at), hi = std::min(b, at + r.size());
      if (lo < hi) out.push_back({r.begin + (lo - at), r.begin + (hi - at)});
      at += r.size();
    }
    s.spec = flat_spec(std::move(out));
  } else {
    const block_spec& bs = v.spec->block();
    shape_t shape = bs.local_shape(), off = bs.global_offset();
    std::size_t d = 0;
    while (d + 1 < shape.size() && shape[d] == 1) ++d;
    const std::uint64_t inner = cut_unit(v) / item;
    if (!shape.empty()) {
      off[d] += a / inner;
      shape[d] = (b - a) / inner;
    }
    s.spec = block_spec(std::move(shape), std::move(off));
  }
  return s;
}

/// One view's part of a piece: bytes [x, y) of views[view].
struct piece_segment {
  std::size_t view = 0;
  std::uint64_t x = 0, y = 0;
};

/// Stream byte k x total / n (k <= n), without overflow.
inline std::uint64_t piece_boundary(std::uint64_t total, std::uint64_t k, std::uint64_t n) {
  return static_cast<std::uint64_t>((static_cast<unsigned __int128>(total) * k) / n);
}

/// The n pieces of the stream bytes [p, q) of views (concatenated in order): piece k is
/// [p + k (q - p) / n, p + (k + 1) (q - p) / n), each end moved back to its view's cut_unit, so
/// that the pieces partition every view. One sweep: O(views + n), each view visited by the
/// pieces that meet it.
inline std::vector<std::vector<piece_segment>> all_pieces(std::span<const flat_view> views, std::uint64_t p,
                                                          std::uint64_t q, std::uint64_t n) {
  std::vector<std::vector<piece_segment>> out(static_cast<std::size_t>(n));
  std::size_t first = 0;  // the first view that ends past the piece's start
  std::uint64_t first_base = 0;
  for (std::uint64_t k = 0; k < n; ++k) {
    const std::uint64_t lo = p + piece_boundary(q - p, k, n), hi = p + piece_boundary(q - p, k + 1, n);
    while (first < views.size() && first_base + views[first].nbytes <= lo) first_base += views[first++].nbytes;
    std::uint64_t base = first_base;
    for (std::size_t i = first; i < views.size() && base < hi; base += views[i++].nbytes) {
      const std::uint64_t len = views[i].nbytes, unit = std::max<std::uint64_t>(1, cut_unit(views[i]));
      auto cut = [&](std::uint64_t at) {
        const std::uint64_t in = at <= base ? 0 : std::min(len, at - base);
        return in - in % unit;
      };
      const std::uint64_t x = cut(lo), y = cut(hi);
      if (x < y) out[static_cast<std::size_t>(k)].push_back({i, x, y});
    }
  }
  return out;
}

/// The segments of the stream bytes [p, q): all_pieces' one piece.
inline std::vector<piece_segment> stream_segments(std::span<const flat_view> views, std::uint64_t p, std::uint64_t q) {
  return std::move(all_pieces(views, p, q, 1).front());
}

/// Piece k of n of the stream bytes [p, q) (all_pieces' k-th, for one member).
inline std::vector<piece_segment> piece_of(std::span<const flat_view> views, std::uint64_t p, std::uint64_t q,
                                           std::uint64_t k, std::uint64_t n) {
  return stream_segments(views, p + piece_boundary(q - p, k, n), p + piece_boundary(q - p, k + 1, n));
}

/// The bytes the segments hold.
inline std::uint64_t segments_bytes(const std::vector<piece_segment>& s) {
  std::uint64_t n = 0;
  for (const auto& g : s) n += g.y - g.x;
  return n;
}

/// Calls f(pointer, length) for the segments' bytes [a, b) (offsets into their concatenation).
template <class F>
void for_segment_bytes(std::span<const flat_view> views, const std::vector<piece_segment>& segs, std::uint64_t a,
                       std::uint64_t b, F&& f) {
  std::uint64_t at = 0;
  for (const auto& g : segs) {
    const std::uint64_t len = g.y - g.x, lo = std::max(a, at), hi = std::min(b, at + len);
    if (lo < hi) f(views[g.view].data + g.x + (lo - at), hi - lo);
    at += len;
    if (at >= b) break;
  }
}

}  // namespace shardsafe::detail
