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

#include <algorithm>
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

/// A rank's place in the binary tree of runs: rank a heads the run [a, b) of ranks; its children
/// head [a + 1, m) and [m, b), the first ceil((b - a - 1) / 2) ranks after it and the rest (a run
/// of one rank has none). Every subtree is a consecutive run of ranks led by its root, so a
/// reduction that combines a rank's value with its children's in order is a left fold over the
/// ranks, as in the binomial tree; but a rank has at most two children (the binomial tree's rank 0
/// has log2(world)), so what a rank receives stays the same as the world grows, at depth
/// ceil(log2(world + 1)) - 1. What the save's partial descriptions go up (checkpoint/save_agree.hpp).
struct run_node {
  int parent = -1;  ///< -1 for rank 0
  int end = 0;      ///< the run this rank heads is [rank, end)
  int children[2] = {-1, -1};
  int child_end[2] = {0, 0};  ///< the run each child heads ends there
};

/// Rank r's node in a world of n (found from the root down: O(log n)).
inline run_node run_tree_node(int r, int n) {
  run_node node;
  int a = 0, b = n;
  while (true) {
    const int m = a + 1 + (b - a) / 2;  // a + 1 + ceil((b - a - 1) / 2)
    if (a == r) {
      node.end = b;
      if (a + 1 < b) node.children[0] = a + 1, node.child_end[0] = std::min(m, b);
      if (m < b) node.children[1] = m, node.child_end[1] = b;
      return node;
    }
    node.parent = a;
    if (r < m) {
      a = a + 1;
      b = std::min(m, b);
    } else {
      a = m;
    }
  }
}

}  // namespace detail
}  // namespace shardsafe
