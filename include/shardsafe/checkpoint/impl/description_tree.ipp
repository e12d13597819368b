// shardsafe/checkpoint/impl/description_tree.ipp - description_tree.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/description_tree.hpp"

namespace shardsafe {
namespace detail {

// A partial, as a message:
//   count(first) count(end) flag(disagrees) items(tensors), then per tensor:
//     text(key) counts(shape) count(dtype) flag(sharded) count(first_rank) items(boxes), per box:
//       count(role: 0 none, 1 writer, 2 copy) count(kind) counts(start), then
//       kind 2: its shard spec (description_message.hpp); else counts(extents) items(levels),
//       per level count(count) counts(step)

SHARDSAFE_DECL void encode_partial(message_writer& m, const partial_description& p) {
  m.count(p.first).count(p.end).flag(p.disagrees).count(p.tensors.size());
  for (const auto& t : p.tensors) {
    m.text(t.key).counts(t.shape).count(static_cast<std::uint64_t>(t.type)).flag(t.sharded).count(t.first_rank);
    m.count(t.boxes.size());
    for (const auto& b : t.boxes) {
      m.count(static_cast<std::uint64_t>(b.role)).count(b.kind).counts(b.start);
      if (b.kind == 2) {
        encode_shard_spec(m, *b.literal);
        continue;
      }
      m.counts(b.extents).count(b.levels.size());
      for (const auto& [n, step] : b.levels) m.count(n).counts(step);
    }
  }
}

SHARDSAFE_DECL partial_description decode_partial(message_reader& m, std::uint64_t first, std::uint64_t end) {
  partial_description p;
  p.first = m.count();
  p.end = m.count();
  if (p.first != first || p.end != end)
    m.malformed("it describes ranks [" + std::to_string(p.first) + ", " + std::to_string(p.end) + "), not [" +
                std::to_string(first) + ", " + std::to_string(end) + ")");
  const std::uint64_t span = end - first;
  p.disagrees = m.flag("the disagreement flag");
  const std::uint64_t n = m.items(min_described_tensor_bytes, "tensors");
  p.tensors.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t i = 0; i < n; ++i) {
    partial_tensor t;
    t.key = m.text();
    const std::string c = "tensor '" + t.key + "'";
    t.shape = m.counts();
    const auto elements = checked_numel(t.shape);
    t.type = static_cast<dtype>(m.count(all_dtypes.size() - 1, c + "'s dtype"));
    if (!elements || !checked_mul(*elements, std::uint64_t(bit_size(t.type))))
      m.malformed(c + ": shape " + to_string(t.shape) + " has more than 2^64 bits of data");
    t.sharded = m.flag(c + "'s sharded flag");
    t.first_rank = m.count();
    if (t.first_rank < first || t.first_rank >= end) m.malformed(c + "'s first holder is outside the ranks");
    const std::uint64_t nb = m.items(24, "boxes of " + c);
    if (nb == 0 || (!t.sharded && nb != 1)) m.malformed(c + " has " + std::to_string(nb) + " boxes");
    std::uint64_t entries = 0, next_rank = first;  // the lowest rank the next box may start at
    const std::size_t dims = t.shape.size();
    for (std::uint64_t k = 0; k < nb; ++k) {
      entry_box b;
      b.role = static_cast<replica_role>(m.count(2, c + "'s replica role"));
      b.kind = m.count(2, c + "'s entry kind");
      b.start = m.counts();
      const std::size_t len = b.kind == 2 ? 1 : b.kind == 0 ? 2 : 1 + dims;
      if (b.start.size() != len) m.malformed(c + ": a box starts with " + std::to_string(b.start.size()) + " numbers");
      if (b.kind == 2) {
        b.literal = decode_shard_spec(m, c + "'s shard spec");
      } else {
        b.extents = m.counts();
        if (b.extents.size() != len - 1)
          m.malformed(c + ": a box has " + std::to_string(b.extents.size()) + " extents");
        const std::uint64_t nl = m.items(16, "levels of a box of " + c);
        std::uint64_t count = 1;
        for (std::uint64_t l = 0; l < nl; ++l) {
          const std::uint64_t cnt = m.count(span, c + "'s box level count");
          if (cnt < 2) m.malformed(c + ": a box level of " + std::to_string(cnt) + " entries");
          count = cnt > span / count ? span + 1 : count * cnt;
          if (count > span) m.malformed(c + ": a box holds more entries than the ranks");
          std::vector<std::uint64_t> step = m.counts();
          if (step.size() != len) m.malformed(c + ": a box level steps " + std::to_string(step.size()) + " numbers");
          b.levels.emplace_back(cnt, std::move(step));
        }
      }
      entries += b.count();
      if (entries > span) m.malformed(c + " has more entries than the ranks " + std::to_string(span));
      // its ranks increase inside the run, after the box before: each level's rank step passes
      // all the levels inside it reach
      std::uint64_t reach = 0;
      for (std::size_t l = b.levels.size(); l-- > 0;) {
        const std::uint64_t step = b.levels[l].second[0];
        if (step <= reach || step > span) m.malformed(c + ": a box's ranks do not increase");
        reach += (b.levels[l].first - 1) * step;  // at most span * span: no overflow past 2^62 ranks
        if (reach >= span) m.malformed(c + ": a box's ranks run past the run");
      }
      if (b.start[0] < next_rank || b.start[0] >= end || end - b.start[0] <= reach)
        m.malformed(c + ": a box's ranks are outside [" + std::to_string(first) + ", " + std::to_string(end) +
                    ") or before the box ahead of it");
      next_rank = b.start[0] + reach + 1;
      t.boxes.push_back(std::move(b));
    }
    if (t.boxes.front().start[0] != t.first_rank) m.malformed(c + "'s first holder is not its first entry");
    if (!t.sharded && (entries != 1 || t.boxes.front().role != replica_role::none))
      m.malformed(c + " is not sharded but has " + std::to_string(entries) + " entries or a replica role");
    if (!p.where.emplace(t.key, p.tensors.size()).second) m.malformed(c + " is described twice");
    p.tensors.push_back(std::move(t));
  }
  return p;
}

SHARDSAFE_DECL void expand_entries(const partial_tensor& t, std::uint64_t world, std::string_view from,
                                   std::vector<std::pair<std::string, shard_spec>>& files, std::vector<int>& ranks,
                                   std::vector<replica_role>& roles) {
  const std::string c = std::string(from) + ": tensor '" + t.key + "'";
  for (const auto& b : t.boxes)
    b.for_each([&](std::uint64_t rank, const shard_spec& s) {
      if (rank >= world || (!ranks.empty() && rank <= static_cast<std::uint64_t>(ranks.back())))
        fail(errc::comm_error, c + ": an entry of rank " + std::to_string(rank) + " is out of rank order");
      try {
        s.validate(t.shape, c);
      } catch (const error& e) {
        fail(errc::comm_error, e.what());
      }
      files.emplace_back(rank_file_name(rank), s);
      ranks.push_back(static_cast<int>(rank));
      roles.push_back(b.role);
    });
}

// grid_of_boxes. The entries the files list are a grid's parts exactly when (a) there are as
// many as the grid has parts, (b) each is the part its rank names, and (c) their ranks increase:
// then they are distinct parts, all of them, in rank order - the list detect_grid compares. The
// guess is made as detect_grid makes it (chunks from the first entry, strides from the entries
// one step along each dimension, found by position), and (b) is checked a box at a time: a box's
// ranks and offsets are affine in its level indices, and so are a grid part's rank and offsets
// in the part's piece indices, so two affine maps that agree on the box's start and on each
// level's step agree on every entry. Piece extents only shrink along a dimension, so a box of one
// extent has it at its lowest and highest piece index or not at all.
SHARDSAFE_DECL std::optional<shard_grid> grid_of_boxes(const partial_tensor& t, std::uint64_t world) {
  using u64 = std::uint64_t;
  if (!t.sharded || t.boxes.empty() || t.boxes.front().kind == 2 || !is_byte_sized(t.type)) return std::nullopt;
  const u64 kind = t.boxes.front().kind;
  const bool flat = kind == 0;
  // (c), and which boxes the files list
  std::vector<const entry_box*> listed;
  u64 count = 0, next_rank = 0;
  bool copies = false, writers_only = true;
  for (const auto& b : t.boxes) {
    if (b.kind != kind) return std::nullopt;
    u64 reach = 0;  // the last entry's rank past the first
    for (std::size_t l = b.levels.size(); l-- > 0;) {
      const u64 step = b.levels[l].second[0];
      const auto more = checked_mul(b.levels[l].first - 1, step);
      if (step <= reach || !more || *more >= world - reach) return std::nullopt;
      reach += *more;
    }
    if (b.start[0] < next_rank || b.start[0] >= world || world - b.start[0] <= reach) return std::nullopt;
    next_rank = b.start[0] + reach + 1;
    if (b.role == replica_role::copy) {
      copies = true;
      continue;
    }
    if (b.role != replica_role::writer) writers_only = false;
    count += b.count();  // at most world: its ranks increase below it
    listed.push_back(&b);
  }
  if ((copies && !writers_only) || count < 2) return std::nullopt;
  const shape_t dims = flat ? shape_t{numel(t.shape)} : t.shape;
  const std::size_t nd = dims.size();
  if (nd == 0) return std::nullopt;
  // the entry at position p of the listed ones: its start vector (rank, offsets) and extents
  auto entry_at = [&](u64 p) -> std::pair<std::vector<u64>, const shape_t*> {
    for (const entry_box* b : listed) {
      if (p >= b->count()) {
        p -= b->count();
        continue;
      }
      std::vector<u64> v = b->start;
      for (std::size_t l = b->levels.size(); l-- > 0;) {
        const u64 k = p % b->levels[l].first;
        p /= b->levels[l].first;
        for (std::size_t i = 0; i < v.size(); ++i) v[i] += k * b->levels[l].second[i];
      }
      return {std::move(v), &b->extents};
    }
    return {};
  };
  shard_grid g;
  g.flat = flat;
  const auto [first, first_ext] = entry_at(0);
  g.base = first[0];
  g.chunks = *first_ext;
  g.strides.assign(nd, 0);
  for (std::size_t d = 0; d < nd; ++d) {
    if (first[1 + d] != 0 || g.chunks[d] == 0) return std::nullopt;
    g.parts.push_back(flat ? count : (dims[d] - 1) / g.chunks[d] + 1);
  }
  // strides: position 1 is one step along the dimension of smallest stride, position parts of
  // that one step along the next, and so on (the parts in rank order are their indices in
  // lexicographic order, dimensions by descending stride)
  std::vector<bool> found(nd);
  for (std::size_t d = 0; d < nd; ++d) found[d] = g.parts[d] == 1;
  for (u64 pos = 1; pos < count && std::find(found.begin(), found.end(), false) != found.end();) {
    const auto [v, ext] = entry_at(pos);
    if (numel(*ext) == 0) return std::nullopt;  // detect_grid takes a stride from a piece holding elements
    std::size_t at = flat ? 0 : nd;             // flat: the second entry
    for (std::size_t d = 0; d < nd && !flat; ++d) {
      if (v[1 + d] == 0) continue;
      if (at != nd || found[d] || v[1 + d] != g.chunks[d]) return std::nullopt;
      at = d;
    }
    if (at == nd || v[0] <= g.base) return std::nullopt;
    g.strides[at] = v[0] - g.base;
    found[at] = true;
    const auto next = checked_mul(pos, g.parts[at]);
    if (!next) return std::nullopt;
    pos = *next;
  }
  if (std::find(found.begin(), found.end(), false) != found.end()) return std::nullopt;
  try {
    validate(g, t.shape, "");
  } catch (const error&) {
    return std::nullopt;
  }
  if (g.part_count() != count) return std::nullopt;
  // the extent along dimension d of piece i
  auto extent = [&](std::size_t d, u64 i) {
    const auto [b, e] = grid_piece(dims[d], g.chunks[d], i);
    return e - b;
  };
  // A box whose entries are grid parts by their offsets: the piece indices of its start and the
  // index step of each level, per dimension (nullopt when an offset is not a piece's start or a
  // piece index passes the grid's; a piece empty along a dimension has no index: refused).
  struct index_map {
    std::vector<u64> start;
    std::vector<std::vector<u64>> steps;  // per level, per dimension
  };
  auto indices = [&](const entry_box& b) -> std::optional<index_map> {
    index_map m;
    m.steps.resize(b.levels.size());
    for (std::size_t d = 0; d < nd; ++d) {
      const u64 c = g.chunks[d], o = b.start[1 + d];
      if (b.extents[d] == 0 || o % c != 0) return std::nullopt;
      u64 lo = o / c, hi = lo;
      for (std::size_t l = 0; l < b.levels.size(); ++l) {
        const u64 s = b.levels[l].second[1 + d];
        const auto more = checked_mul(b.levels[l].first - 1, s / c);
        if (s % c != 0 || !more || *more >= g.parts[d] || hi + *more >= g.parts[d]) return std::nullopt;
        hi += *more;
        m.steps[l].push_back(s / c);
      }
      if (hi >= g.parts[d] || extent(d, lo) != b.extents[d] || extent(d, hi) != b.extents[d]) return std::nullopt;
      m.start.push_back(lo);
    }
    return m;
  };
  // (b) for a listed box
  auto rank_of = [&](const std::vector<u64>& index) {
    u64 r = g.base;  // bounded: validate keeps every part's rank below 2^31
    for (std::size_t d = 0; d < nd; ++d) r += index[d] * g.strides[d];
    return r;
  };
  u64 position = 0;  // of the box's first entry among the listed ones
  for (const entry_box* b : listed) {
    if (b->role == replica_role::writer && numel(b->extents) == 0) return std::nullopt;  // two writers of [n, n)
    if (flat) {  // by position: the flat grid's parts in rank order are its pieces in order
      const u64 n = dims[0], c = g.chunks[0], e = b->extents[0], s = g.strides[0];
      auto at = [&](u64 p) { return checked_mul(c, p).value_or(n); };  // a piece's start, n once past the end
      if (b->start[0] != g.base + position * s) return std::nullopt;
      u64 inner = 1;  // entries a step of level l passes
      for (std::size_t l = b->levels.size(); l-- > 0;) {
        const u64 rs = b->levels[l].second[0], os = b->levels[l].second[1];
        if (rs != inner * s || os != (e == 0 ? 0 : inner * c)) return std::nullopt;
        inner *= b->levels[l].first;
      }
      const u64 last = position + b->count() - 1;
      if (e == 0 ? (at(position) < n || b->start[1] != n)
                 : (b->start[1] != c * position || extent(0, position) != e || extent(0, last) != e))
        return std::nullopt;
    } else {
      const auto m = indices(*b);
      if (!m || rank_of(m->start) != b->start[0]) return std::nullopt;
      for (std::size_t l = 0; l < b->levels.size(); ++l) {
        u64 step = 0;
        for (std::size_t d = 0; d < nd; ++d) step += m->steps[l][d] * g.strides[d];
        if (step != b->levels[l].second[0]) return std::nullopt;
      }
    }
    position += b->count();
  }
  // every copy is a copy of a part, whose writer is listed (with copies, every listed box is a
  // writer's; none is empty, so an empty copy has no writer: indices refuses it)
  for (const auto& b : t.boxes)
    if (b.role == replica_role::copy && !indices(b)) return std::nullopt;
  return g;
}

}  // namespace detail
}  // namespace shardsafe
