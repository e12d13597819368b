// shardsafe/checkpoint/description_tree.hpp - the ranks' descriptions of their views, merged up
// the binomial tree of ranks (dist/tree.hpp) instead of all-gathered (issue 56): what a rank
// sends, receives and holds to agree on a save grows with the tensors, not with the world.
//
// A partial description is the merge of the descriptions of a run of consecutive ranks
// [first, end): the tensors in the order they first appear, each with its shape, dtype,
// sharded-ness and lowest holder, and (sharded) every holder's entry (rank, replica role,
// shard spec) in rank order. The entries are kept as boxes: a box is a start vector [rank,
// offsets] plus levels (count, step), and holds start + k_0 step_0 + k_1 step_1 + ... for every
// k_l < count_l, in lexicographic order, each a shard of the same extents and role. A regular
// sharding's parts in rank order are a few such boxes (FSDP's flat split: the full pieces, the
// short one, the empty ones; a block grid's rows of rows), so a run of ranks of a grid is O(dims)
// numbers whatever its length. Appending an entry or a box extends the last box when it
// continues it (one more slice, a longer run, or two equal boxes side by side), then the box
// before that, and so on; where a run cut a group of ranks saving one shard (replicas without
// roles) in two, the halves are made one group again first (append_box). Nothing is lost: a
// partial expands to exactly the entries merged, and merging partials of consecutive runs in rank
// order gives what merging every rank's entries in rank order gives (merge_descriptions), so rank
// 0 rebuilds today's metadata.json byte for byte.
// Irregular shardings (several ranges in one flat spec, uneven cuts of a fast dimension) stay
// boxes of one entry: their partials cost what the listed form costs anyway.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/checkpoint/description_message.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/format/checkpoint_metadata.hpp"
#include "shardsafe/shard/shard_grid.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {
namespace detail {

/// Entries of one tensor held by consecutive ranks, compressed (see above). kind 0: a flat spec
/// of one range (extents {length}, start {rank, begin}); 1: a block (extents its local shape,
/// start {rank, offsets}); 2: one entry of any spec (`literal`, start {rank}, no levels).
/// Arithmetic is modulo 2^64: steps that go down are large numbers, and every entry is exact.
struct entry_box {
  replica_role role = replica_role::none;
  std::uint64_t kind = 0;
  shape_t extents;
  std::vector<std::uint64_t> start;
  std::vector<std::pair<std::uint64_t, std::vector<std::uint64_t>>> levels;  ///< (count >= 2, step), outermost first
  std::optional<shard_spec> literal;

  /// Entries in the box.
  std::uint64_t count() const noexcept {
    std::uint64_t n = 1;
    for (const auto& l : levels) n *= l.first;  // bounded: at most the ranks of the run (decode_partial)
    return n;
  }

  /// The box of one entry.
  static entry_box of(std::uint64_t rank, replica_role role, const shard_spec& s) {
    entry_box b;
    b.role = role;
    b.start.push_back(rank);
    if (s.is_flat() && s.flat().ranges().size() == 1) {
      b.kind = 0;
      b.extents = {s.flat().ranges()[0].size()};
      b.start.push_back(s.flat().ranges()[0].begin);
    } else if (s.is_block()) {
      b.kind = 1;
      b.extents = s.block().local_shape();
      b.start.insert(b.start.end(), s.block().global_offset().begin(), s.block().global_offset().end());
    } else {
      b.kind = 2;
      b.literal = s;
    }
    return b;
  }

  /// Calls f(rank, spec) for every entry, in order.
  template <class F>
  void for_each(F&& f) const {
    std::vector<std::uint64_t> k(levels.size(), 0);
    while (true) {
      std::vector<std::uint64_t> v = start;
      for (std::size_t l = 0; l < levels.size(); ++l)
        for (std::size_t i = 0; i < v.size(); ++i) v[i] += k[l] * levels[l].second[i];
      if (kind == 2)
        f(v[0], *literal);
      else if (kind == 0)
        f(v[0], shard_spec(flat_spec{{v[1], v[1] + extents[0]}}));
      else
        f(v[0], shard_spec(block_spec(extents, shape_t(v.begin() + 1, v.end()))));
      std::size_t l = levels.size();
      while (true) {
        if (l == 0) return;
        --l;
        if (++k[l] < levels[l].first) break;
        k[l] = 0;
      }
    }
  }
};

/// Joins x onto the box before it, when the two are one box; false when they are not.
inline bool join_boxes(entry_box& a, const entry_box& x) {
  if (a.kind == 2 || x.kind != a.kind || x.role != a.role || x.extents != a.extents) return false;
  auto at = [](const std::vector<std::uint64_t>& s, std::uint64_t k, const std::vector<std::uint64_t>& step) {
    std::vector<std::uint64_t> v = s;
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += k * step[i];
    return v;
  };
  const auto& la = a.levels;
  const auto& lx = x.levels;
  auto tail_equal = [](const auto& longer, std::size_t from, const auto& other, std::size_t ofrom) {
    return longer.size() - from == other.size() - ofrom &&
           std::equal(longer.begin() + static_cast<std::ptrdiff_t>(from), longer.end(),
                      other.begin() + static_cast<std::ptrdiff_t>(ofrom));
  };
  // x is the next slice of a's outermost level
  if (la.size() == lx.size() + 1 && tail_equal(la, 1, lx, 0) && x.start == at(a.start, la[0].first, la[0].second)) {
    ++a.levels[0].first;
    return true;
  }
  // x continues a's outermost level by slices of the same step
  if (!la.empty() && la.size() == lx.size() && la[0].second == lx[0].second && tail_equal(la, 1, lx, 1) &&
      x.start == at(a.start, la[0].first, la[0].second)) {
    a.levels[0].first += lx[0].first;
    return true;
  }
  // a is the slice before x's first
  if (lx.size() == la.size() + 1 && tail_equal(lx, 1, la, 0) && x.start == at(a.start, 1, lx[0].second)) {
    std::uint64_t n = lx[0].first + 1;
    a.levels = lx;
    a.levels[0].first = n;
    return true;
  }
  // two equal boxes side by side, one step forward along one dimension apart (or none: replicas
  // of one shard), as a grid's parts in rank order are: a step that moves two offsets, or one
  // backwards, crosses the end of a row, and would pair the last piece of one row with the first
  // of the next, or parts of two rows that are not aligned
  if (la == lx) {
    std::vector<std::uint64_t> step(a.start.size());
    std::size_t moved = 0;
    for (std::size_t i = 0; i < step.size(); ++i) {
      step[i] = x.start[i] - a.start[i];
      if (i > 0 && step[i] != 0) ++moved;
      if (i > 0 && x.start[i] < a.start[i]) return false;
    }
    if (moved > 1) return false;
    a.levels.insert(a.levels.begin(), {2, std::move(step)});
    return true;
  }
  return false;
}

/// A group is one shard held by consecutive ranks (replicas without roles: a norm that tensor
/// parallelism replicates, HSDP's replicas undeclared): a box's innermost level when it steps one
/// rank and no offset, else each entry alone. The levels of b that make its groups: 1 or 0.
inline std::size_t group_levels(const entry_box& b) {
  if (b.levels.empty()) return 0;
  const auto& step = b.levels.back().second;
  return step[0] == 1 && std::all_of(step.begin() + 1, step.end(), [](std::uint64_t v) { return v == 0; }) ? 1 : 0;
}

/// The box of b's kind, role and extents from `start` with `levels`.
inline entry_box box_like(const entry_box& b, std::vector<std::uint64_t> start,
                          std::vector<std::pair<std::uint64_t, std::vector<std::uint64_t>>> levels) {
  entry_box out;
  out.role = b.role;
  out.kind = b.kind;
  out.extents = b.extents;
  out.literal = b.literal;
  out.start = std::move(start);
  out.levels = std::move(levels);
  return out;
}

/// The box of the slices of b's level l but one, from `at`: the levels from l on, level l one
/// slice shorter (and gone where one slice is left).
inline entry_box slices_but_one(const entry_box& b, std::size_t l, std::vector<std::uint64_t> at) {
  std::vector<std::pair<std::uint64_t, std::vector<std::uint64_t>>> levels(b.levels.begin() + std::ptrdiff_t(l),
                                                                           b.levels.end());
  if (--levels.front().first == 1) levels.erase(levels.begin());
  return box_like(b, std::move(at), std::move(levels));
}

/// The groups of b before its last, in order (at most one box a level), then its last group.
inline std::pair<std::vector<entry_box>, entry_box> split_last_group(const entry_box& b) {
  const std::size_t outer = b.levels.size() - group_levels(b);
  std::vector<entry_box> before;
  std::vector<std::uint64_t> at = b.start;  // the first group of the slices still to split
  for (std::size_t l = 0; l < outer; ++l) {
    const auto& [count, step] = b.levels[l];
    before.push_back(slices_but_one(b, l, at));  // every slice of level l but its last
    for (std::size_t i = 0; i < at.size(); ++i) at[i] += (count - 1) * step[i];
  }
  return {std::move(before), box_like(b, at, {b.levels.begin() + std::ptrdiff_t(outer), b.levels.end()})};
}

/// b's first group, then the groups after it, in order (at most one box a level).
inline std::pair<entry_box, std::vector<entry_box>> split_first_group(const entry_box& b) {
  const std::size_t outer = b.levels.size() - group_levels(b);
  std::vector<entry_box> after;
  for (std::size_t l = outer; l-- > 0;) {  // the innermost level's other slices first
    std::vector<std::uint64_t> at = b.start;
    for (std::size_t i = 0; i < at.size(); ++i) at[i] += b.levels[l].second[i];
    after.push_back(slices_but_one(b, l, std::move(at)));  // every slice of level l but its first
  }
  return {box_like(b, b.start, {b.levels.begin() + std::ptrdiff_t(outer), b.levels.end()}), std::move(after)};
}

/// Joins the last two boxes while they join.
inline void join_tail(std::vector<entry_box>& boxes) {
  while (boxes.size() >= 2 && join_boxes(boxes[boxes.size() - 2], boxes.back())) boxes.pop_back();
}

/// Pushes x onto boxes, then joins the last two boxes while they join.
inline void push_joined(std::vector<entry_box>& boxes, entry_box x) {
  boxes.push_back(std::move(x));
  join_tail(boxes);
}

/// Appends x to boxes, joining what joins (the last box with x, then the box before it with
/// that, and so on). Where they do not join but the last box's last group and x's first are
/// one shard on consecutive ranks, the two are split there and the group made whole: a run of
/// ranks cut inside a group (as the tree cuts runs) leaves a group in two, and an early join of
/// its half with the entry before it (one rank and one piece on, as FSDP's pieces go) would
/// keep every later box from joining.
inline void append_box(std::vector<entry_box>& boxes, entry_box x) {
  if (!boxes.empty() && boxes.back().kind != 2 && x.kind == boxes.back().kind && x.role == boxes.back().role &&
      x.extents == boxes.back().extents) {
    if (join_boxes(boxes.back(), x)) {  // (a box that does not join is left as it was)
      join_tail(boxes);
      return;
    }
    auto ranks = [](const entry_box& group) { return group.levels.empty() ? 1 : group.levels.back().first; };
    auto [before, last] = split_last_group(boxes.back());
    auto [first, after] = split_first_group(x);
    if (first.start[0] == last.start[0] + ranks(last) &&
        std::equal(first.start.begin() + 1, first.start.end(), last.start.begin() + 1)) {
      std::vector<std::uint64_t> step(last.start.size(), 0);
      step[0] = 1;
      last.levels = {{ranks(last) + ranks(first), std::move(step)}};
      boxes.pop_back();
      for (auto& b : before) push_joined(boxes, std::move(b));
      push_joined(boxes, std::move(last));
      for (auto& b : after) push_joined(boxes, std::move(b));
      return;
    }
  }
  push_joined(boxes, std::move(x));
}

/// One tensor of a partial description.
struct partial_tensor {
  std::string key;
  shape_t shape;
  dtype type = dtype::F32;
  bool sharded = false;
  std::uint64_t first_rank = 0;  ///< the lowest rank holding it
  /// sharded: every holder's entry, in rank order (copies too); not sharded: the lowest holder's
  std::vector<entry_box> boxes;
};

/// The merged descriptions of the ranks [first, end).
struct partial_description {
  std::uint64_t first = 0, end = 0;
  std::vector<partial_tensor> tensors;  ///< in the order they first appear
  /// Some rank saves a tensor with another shape, dtype or sharded-ness than its lowest holder
  /// (merge_descriptions says which, on the all-gather path)
  bool disagrees = false;
  std::unordered_map<std::string, std::size_t> where;  ///< key -> index in tensors

  /// Adds a tensor that `rank` holds (a rank's own partial is built so, one tensor at a time).
  void add(std::string key, shape_t shape, dtype type, bool sharded, std::uint64_t rank, const shard_spec& spec,
           replica_role role) {
    where.emplace(key, tensors.size());
    partial_tensor t{std::move(key), std::move(shape), type, sharded, rank, {}};
    t.boxes.push_back(entry_box::of(rank, role, spec));
    tensors.push_back(std::move(t));
  }

  /// Appends the partial of the ranks right after these (right.first == end).
  void merge(partial_description&& right) {
    disagrees = disagrees || right.disagrees;
    end = right.end;
    for (auto& t : right.tensors) {
      auto [it, fresh] = where.emplace(t.key, tensors.size());
      if (fresh) {
        tensors.push_back(std::move(t));
        continue;
      }
      partial_tensor& have = tensors[it->second];
      if (have.shape != t.shape || have.type != t.type || have.sharded != t.sharded) {
        disagrees = true;
        continue;
      }
      if (have.sharded)
        for (auto& b : t.boxes) append_box(have.boxes, std::move(b));
    }
  }
};

/// Rank `rank`'s own partial: its description (describe_views) and its views' replica roles.
inline partial_description partial_of(const checkpoint_metadata& described, std::span<const flat_view> views,
                                      std::uint64_t rank) {
  partial_description p;
  p.first = rank;
  p.end = rank + 1;
  for (std::size_t i = 0; i < described.tensors.size(); ++i) {
    const auto& [key, tm] = described.tensors[i];
    p.add(key, tm.shape, tm.type, tm.is_sharded, rank, tm.files.front().second, views[i].replica);
  }
  return p;
}

/// Appends p to m, a message (dist/message.hpp).
SHARDSAFE_DECL void encode_partial(message_writer& m, const partial_description& p);

/// Reads what encode_partial wrote, checking what bounds the work it stands for: the ranks of
/// the run inside [first, end) as the tree says (`first`, `end`), at most end - first entries per
/// tensor, vectors of the tensor's dimensions; errc::comm_error naming the sender.
SHARDSAFE_DECL partial_description decode_partial(message_reader& m, std::uint64_t first, std::uint64_t end);

/// The entries of a partial tensor, expanded: files (rank file, spec), their ranks and roles, in
/// rank order; each spec checked inside the tensor and the ranks increasing below `world`
/// (errc::comm_error naming `from` otherwise).
SHARDSAFE_DECL void expand_entries(const partial_tensor& t, std::uint64_t world, std::string_view from,
                                   std::vector<std::pair<std::string, shard_spec>>& files, std::vector<int>& ranks,
                                   std::vector<replica_role>& roles);

/// The grid the entries of a sharded partial tensor are, found from its boxes without expanding
/// them: O(boxes x levels x dimensions) work, whatever the ranks (issue 56). It is what
/// detect_grid finds in the entries the tensor's files list (all but the replica copies), and
/// it is returned only when those entries also pass what merge_descriptions checks: ranks
/// increasing below `world`, no two writers of one shard, every copy a copy of a written shard,
/// shards that neither overlap nor leave an element out. nullopt where the boxes do not show
/// that (an irregular sharding, a piece empty along a block dimension, an empty piece with a
/// writer, copies beside shards without roles, a dtype smaller than a byte, whose tensors
/// detect_grid leaves listed): the caller then expands the entries, checks them
/// and looks for a grid as before, and gets the same answer the long way.
SHARDSAFE_DECL std::optional<shard_grid> grid_of_boxes(const partial_tensor& t, std::uint64_t world);

}  // namespace detail
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/description_tree.ipp"
#endif
