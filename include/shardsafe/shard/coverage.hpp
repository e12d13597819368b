// shardsafe/shard/coverage.hpp - which elements of a tensor no file holds.
//
// A sharded tensor is whole when its files' shards cover every element. The check merges the
// shards' runs in order (memory O(files)) and names the first element none holds. Its walk is
// bounded by construction: where the shards hold fewer elements than the tensor (some are surely
// missing), it merges at most coverage_walk_runs runs before it says so by count, so a hostile
// description of long column blocks past a gap costs a bounded time (first_gap_in_whole: a save's
// agreement, verify and unshard). Where they hold as many or more, every element may be held and
// the walk is bounded by the runs of the shards the files list.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <queue>
#include <span>
#include <utility>
#include <vector>

#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

/// The elements of the whole tensor that none of the files hold, as global ranges (at most
/// max_gaps of them, the first ones): the files' runs merged in order by a heap of their cursors,
/// so memory is O(files) whatever the runs (a column block of 2^24 rows is 2^24 runs), and time
/// O(R log files) for R runs before the max_gaps-th gap. With `max_runs`, it stops after merging
/// that many runs, and sets *stopped (the gaps then are those before the stop).
template <ShardSpec B>
std::vector<element_range> missing_in_whole(std::span<const B> files, std::span<const std::uint64_t> full,
                                            std::size_t max_gaps = 1024,
                                            std::uint64_t max_runs = std::numeric_limits<std::uint64_t>::max(),
                                            bool* stopped = nullptr) {
  const std::uint64_t n = numel(full);
  std::vector<element_range> gaps;
  if (stopped) *stopped = false;
  if (max_gaps == 0) return gaps;
  using cursor_t = decltype(files[0].cursor(full));
  std::vector<cursor_t> cursors;
  cursors.reserve(files.size());
  using item = std::pair<std::uint64_t, std::size_t>;  // run begin, file
  std::priority_queue<item, std::vector<item>, std::greater<>> heap;
  for (std::size_t f = 0; f < files.size(); ++f) {
    cursors.push_back(files[f].cursor(full));
    if (!cursors.back().done()) heap.emplace(cursors.back().run().begin, f);
  }
  std::uint64_t upto = 0, runs = 0;
  while (!heap.empty() && upto < n) {
    if (runs++ == max_runs) {
      if (stopped) *stopped = true;
      return gaps;
    }
    const std::size_t f = heap.top().second;
    heap.pop();
    auto& c = cursors[f];
    const spec_run r = c.run();
    if (r.begin > upto) {
      gaps.push_back({upto, r.begin});
      if (gaps.size() == max_gaps) return gaps;  // the first max_gaps found: no more runs walked
    }
    upto = std::max(upto, r.end);
    c.seek(upto);  // runs this file holds below upto add nothing: skipped in O(log n) or O(ndim)
    if (!c.done()) heap.emplace(c.run().begin, f);
  }
  if (upto < n && gaps.size() < max_gaps) gaps.push_back({upto, n});
  return gaps;
}

/// Ranges of my flat view that none of the files hold. When mine is the whole tensor (verify,
/// unshard and a save's agreement ask that), the files' runs are merged without a copy plan
/// (missing_in_whole: memory O(files); it stops at the max_gaps-th gap: naming the first missing
/// element walks the runs before it alone); otherwise from plan_load.
template <ShardSpec A, ShardSpec B>
std::vector<element_range> missing_elements(const A& mine, std::span<const B> files,
                                            std::span<const std::uint64_t> full, std::size_t max_gaps = 1024) {
  if (auto c = mine.cursor(full); mine.local_numel() == numel(full) &&
                                  (numel(full) == 0 || (!c.done() && c.run().begin == 0 && c.run().end == numel(full))))
    return missing_in_whole(files, full, max_gaps);
  return plan_load(mine, files, full).missing;
}

/// The runs a coverage walk merges at most where the shards hold fewer elements than the tensor
/// (first_gap_in_whole): past them, the gap is named by count.
inline constexpr std::uint64_t coverage_walk_runs = std::uint64_t(1) << 22;

/// What first_gap_in_whole found: the first elements no shard holds, or that the shards hold
/// fewer elements than the tensor (by_count: the walk stopped before a gap), or neither (whole).
struct coverage_gap {
  std::optional<element_range> first;  // global flat range
  std::uint64_t held = 0;              // elements of all shards, a copy counted again (saturating)
  bool by_count = false;
  bool whole() const { return !first && !by_count; }
};

/// The first gap in the files' cover of the whole tensor, in a walk bounded as the header says.
template <ShardSpec B>
coverage_gap first_gap_in_whole(std::span<const B> files, std::span<const std::uint64_t> full) {
  const std::uint64_t n = numel(full);
  coverage_gap out;
  for (const auto& f : files) out.held = std::min(out.held + f.local_numel(), ~std::uint64_t(0) - n);
  bool stopped = false;
  auto gaps = missing_in_whole(files, full, 1, out.held < n ? coverage_walk_runs : ~std::uint64_t(0), &stopped);
  if (!gaps.empty()) out.first = gaps.front();
  out.by_count = stopped;
  return out;
}

}  // namespace shardsafe
