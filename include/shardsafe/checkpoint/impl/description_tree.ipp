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

}  // namespace detail
}  // namespace shardsafe
