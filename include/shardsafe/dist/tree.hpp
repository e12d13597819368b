// shardsafe/dist/tree.hpp - ranks as a binomial tree rooted at rank 0: how a step's agreement
// costs a rank O(log world) messages of O(1) bytes instead of an all-gather's world of them
// (issue 56; dist/agree.hpp's every_rank_step over a PeerComm, dist/concepts.hpp).
//
// Rank r's parent is r minus its lowest set bit; its children are r + 1, r + 2, r + 4, ... below
// that bit (rank 0: every power of two below the world). The subtree of child c holds the ranks
// [c, c + lowbit(c)) of the world, so the children of r, nearest first, hold consecutive runs of
// ranks after r: a reduction that combines r's value with each child's in that order combines
// every rank's value in rank order, as a left fold over the ranks would. Up the tree a rank
// receives from at most log2(world) children and sends once; down it, the reverse.
#pragma once

#include <vector>

namespace shardsafe {
namespace detail {

/// The lowest set bit of rank r > 0 (the size of its subtree).
constexpr int tree_lowbit(int r) noexcept { return r & -r; }

/// Rank r's parent (r > 0).
constexpr int tree_parent(int r) noexcept { return r - tree_lowbit(r); }

/// Rank r's children in a world of n, nearest first.
inline std::vector<int> tree_children(int r, int n) {
  std::vector<int> out;
  for (long long step = 1; r + step < n && (r == 0 || step < tree_lowbit(r)); step <<= 1)
    out.push_back(static_cast<int>(r + step));
  return out;
}

}  // namespace detail
}  // namespace shardsafe
