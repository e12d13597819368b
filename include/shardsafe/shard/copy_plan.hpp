// shardsafe/shard/copy_plan.hpp - which elements move where.
//
// A copy plan is a list of runs {dst, src, len}: copy `len` elements from offset `src` of a
// file's flat shard to offset `dst` of my flat view. Runs are in increasing order of both
// offsets and adjacent runs are coalesced, so a plan has as few runs as the layouts allow.
//
// plan_load resolves a whole tensor against every file that holds part of it: each of my
// elements is taken from exactly one file (a file that holds my whole shard is preferred,
// then files in the order given), and elements no file holds are reported as missing.
//
// A file's block whose bytes hold its dimensions in another order (a DCP chunk torch.save kept
// channels_last or transposed: safetensors_header::stored_order) is read by permuted_copy_plan:
// runs with steps, along the dimension stored innermost (contiguous in the file, `dst_step`
// elements apart in my view) or, where those rows are short, along my innermost one (`src_step`
// apart in the file, side by side in my view), so that a plan holds a run per row, not per element.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/shard/flat_blocks.hpp"
#include "shardsafe/shard/overlap.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

/// Copy len elements from offset src of a file's flat shard to offset dst of my flat view; the
/// k-th from src + k * src_step to dst + k * dst_step (steps of 1 but for a permuted block:
/// permuted_copy_plan).
struct copy_run {
  std::uint64_t dst = 0;
  std::uint64_t src = 0;
  std::uint64_t len = 0;
  std::uint64_t dst_step = 1;
  std::uint64_t src_step = 1;
  friend constexpr bool operator==(const copy_run&, const copy_run&) = default;
};

using copy_plan = std::vector<copy_run>;

/// Appends r to plan, joining it to the last run when both offsets continue it.
inline void append_coalesced(copy_plan& plan, const copy_run& r) {
  if (r.len == 0) return;
  if (!plan.empty()) {
    copy_run& b = plan.back();
    if (b.dst_step == r.dst_step && b.src_step == r.src_step && b.dst + b.len * b.dst_step == r.dst &&
        b.src + b.len * b.src_step == r.src) {
      b.len += r.len;
      return;
    }
  }
  plan.push_back(r);
}

/// The runs that move every element both specs hold from other's flat shard to mine.
template <ShardSpec A, ShardSpec B>
copy_plan compute_copy_plan(const A& mine, const B& other, std::span<const std::uint64_t> full) {
  if constexpr (detail::is_variant_spec<A>) {
    return std::visit([&](const auto& m) { return compute_copy_plan(m, other, full); }, mine.variant());
  } else if constexpr (detail::is_variant_spec<B>) {
    return std::visit([&](const auto& o) { return compute_copy_plan(mine, o, full); }, other.variant());
  } else {
    copy_plan plan;
    if constexpr (std::is_same_v<A, block_spec> && std::is_same_v<B, block_spec>)
      plan.reserve(detail::box_piece_count(mine, other));  // one allocation for all the rows
    for_each_overlap(mine, other, full,
                     [&](const overlap_piece& p) { append_coalesced(plan, copy_run{p.mine, p.other, p.len}); });
    return plan;
  }
}

/// The runs that move every element of `mine` that block `chunk` holds, out of the chunk's bytes
/// stored with its dimensions in `order` (outermost first, a permutation of the dimensions):
/// in each box of mine, one run per row along the dimension stored innermost (contiguous in the
/// chunk, dst_step apart in my flat view) or along my innermost dimension (src_step apart in
/// the chunk, contiguous in my view; `gathers` below says where): a view that cuts the dimension
/// stored innermost to one index still gets a run per row, not per element. Sorted by src,
/// coalesced where both continue. tile_elements: how many of the chunk's elements the gathering
/// runs of a tile span (below; tests make it small to cut small blocks).
template <ShardSpec A>
copy_plan permuted_copy_plan(const A& mine, const block_spec& chunk, std::span<const std::size_t> order,
                             std::span<const std::uint64_t> full,
                             std::uint64_t tile_elements = std::uint64_t(1) << 16) {
  const std::size_t nd = full.size();
  std::vector<bool> seen(nd, false);
  bool permutation = order.size() == nd && nd != 0 && chunk.local_shape().size() == nd;
  for (std::size_t i = 0; permutation && i < nd; ++i) {
    permutation = order[i] < nd && !seen[order[i]];
    if (permutation) seen[order[i]] = true;
  }
  if (!permutation)
    fail(errc::invalid_argument, "permuted_copy_plan: order " + to_string(shape_t(order.begin(), order.end())) +
                                     " is not a permutation of the " + std::to_string(nd) + " dimensions");
  const shape_t stored = dense_strides(chunk.local_shape(), order);  // the chunk's strides as stored
  // whether a box's runs go along my innermost dimension (`last`), gathering from the chunk,
  // rather than along the dimension stored innermost: only where the stored rows in the box are
  // short (under 16 elements: a run per few elements otherwise) and mine longer, and the
  // gathered elements lie at most 512 apart in the chunk (the holes between them, 4088 bytes of
  // 8-byte elements at most, then pass for a gap under the default read_options, whatever other
  // runs fill them; longer stored rows read as well as they are)
  const std::size_t inner = order[nd - 1], last = nd - 1;  // the dimension stored innermost; mine
  auto gathers = [&](const detail::box& bx) {
    return bx.extent[inner] < 16 && bx.extent[last] > bx.extent[inner] && stored[last] <= 512;
  };
  copy_plan runs;
  // a gathering run is kept to its tile (not joined to the next tile's): sorted by where they
  // start, the tiles of all boxes then interleave as their elements do in the file
  auto add = [](copy_plan& plan, const copy_run& r) {
    if (r.src_step == 1)
      append_coalesced(plan, r);
    else if (r.len != 0)
      plan.push_back(r);
  };
  std::vector<std::size_t> outer;  // the dimensions a box's odometer turns, in stored order
  // the part of the chunk inside `piece`, where my offset of global index x is base + sum x_d * step_d
  // (mod 2^64), in stored order; my innermost dimension has step 1
  auto add_box = [&](const block_spec& piece, std::uint64_t base, const shape_t& step) {
    const auto bx = detail::intersect(piece, chunk);
    if (!bx) return;
    const std::size_t along = gathers(*bx) ? last : inner;
    outer.clear();
    for (const std::size_t d : order)
      if (d != along) outer.push_back(d);
    std::uint64_t src = 0, dst = base;
    for (std::size_t d = 0; d < nd; ++d) {
      src += (bx->offset[d] - chunk.global_offset()[d]) * stored[d];
      dst += bx->offset[d] * step[d];
    }
    // runs that gather from the chunk are cut into tiles spanning about 2^16 of its elements
    // (tile_elements),
    // the runs of each tile taken together: rows whose elements interleave in the file then
    // interleave in the plan too, and its reads go through the file once
    const std::uint64_t extent = bx->extent[along];
    const std::uint64_t tile = along == inner ? extent : std::max<std::uint64_t>(1, tile_elements / stored[along]);
    shape_t j(outer.size(), 0);
    for (std::uint64_t t = 0; t < extent; t += tile) {
      const std::uint64_t len = std::min(tile, extent - t);
      while (true) {
        add(runs, copy_run{dst, src, len, step[along], stored[along]});
        std::size_t i = outer.size();
        while (i-- > 0) {
          const std::size_t d = outer[i];
          src += stored[d];
          dst += step[d];
          if (++j[i] < bx->extent[d]) break;
          src -= bx->extent[d] * stored[d];
          dst -= bx->extent[d] * step[d];
          j[i] = 0;
        }
        if (i == static_cast<std::size_t>(-1)) break;
      }
      src += len * stored[along];
      dst += len * step[along];
    }
  };
  auto of_spec = [&](const auto& m) {
    using M = std::remove_cvref_t<decltype(m)>;
    if constexpr (std::is_same_v<M, block_spec>) {
      const shape_t step = dense_strides(m.local_shape());
      std::uint64_t base = 0;
      for (std::size_t d = 0; d < nd; ++d) base -= m.global_offset()[d] * step[d];
      add_box(m, base, step);
    } else {  // a flat range is linear in the global index: the blocks that tile it
      const shape_t step = dense_strides(full);
      std::uint64_t local = 0;
      for (const element_range& r : m.ranges()) {
        for (const tensor_block& b : blocks_of_range(full, r))
          add_box(block_spec(b.sizes, b.offsets), local - r.begin, step);
        local += r.size();
      }
    }
  };
  if constexpr (detail::is_variant_spec<A>)
    std::visit(of_spec, mine.variant());
  else
    of_spec(mine);
  if (std::is_sorted(runs.begin(), runs.end(), [](const copy_run& a, const copy_run& b) { return a.src < b.src; }))
    return runs;
  std::sort(runs.begin(), runs.end(), [](const copy_run& a, const copy_run& b) { return a.src < b.src; });
  copy_plan out;
  out.reserve(runs.size());
  for (const copy_run& r : runs) add(out, r);
  return out;
}

/// Total elements a plan moves.
inline std::uint64_t plan_numel(const copy_plan& plan) noexcept {
  std::uint64_t n = 0;
  for (const auto& r : plan) n += r.len;
  return n;
}

/// The part of a load that comes from one file.
struct file_plan {
  std::size_t file = 0;     ///< index into the file specs given to plan_load
  overlap_type overlap{};   ///< how my shard overlaps this file's
  copy_plan runs;           ///< what to copy (each of my elements appears in one file only)
  std::uint64_t numel = 0;  ///< elements moved (sum of runs' len)
};

/// Every file's part of loading my shard, and what no file holds.
struct load_plan {
  std::vector<file_plan> files;        ///< files with something to copy, in the order given
  std::vector<element_range> missing;  ///< ranges of my flat view that no file holds
  std::uint64_t covered = 0;           ///< elements of my flat view some file provides
};

namespace detail {

inline const block_spec* as_block(const block_spec& s) noexcept { return &s; }
inline const block_spec* as_block(const shard_spec& s) noexcept { return s.is_block() ? &s.block() : nullptr; }
template <class S>
const block_spec* as_block(const S&) noexcept {
  return nullptr;
}

/// Whether the candidate files are all blocks and no two of them share an element: a
/// pairwise test, so only for a few dozen files (more go through the merge).
template <class B, class Cands>
bool disjoint_blocks(std::span<const B> files, const Cands& cands) {
  if (cands.size() > 64) return false;
  std::vector<const block_spec*> blocks;
  blocks.reserve(cands.size());
  for (const auto& c : cands) {
    const block_spec* b = as_block(files[c.file]);
    if (!b) return false;
    blocks.push_back(b);
  }
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::size_t j = i + 1; j < blocks.size(); ++j) {
      const block_spec &a = *blocks[i], &b = *blocks[j];
      bool apart = false;  // some dimension where they do not meet (never, for 0-d)
      for (std::size_t d = 0; d < a.local_shape().size() && !apart; ++d)
        apart = std::max(a.global_offset()[d], b.global_offset()[d]) >=
                std::min(a.global_offset()[d] + a.local_shape()[d], b.global_offset()[d] + b.local_shape()[d]);
      if (!apart) return false;
    }
  return true;
}

}  // namespace detail

/// Resolves my shard against every file's shard. Specs must be validated against full.
template <ShardSpec A, ShardSpec B>
load_plan plan_load(const A& mine, std::span<const B> files, std::span<const std::uint64_t> full) {
  load_plan out;
  const std::uint64_t n = mine.local_numel();
  if (n == 0) return out;

  // A file holding all of my shard settles it in one piece (the EQUAL/SUPERSET fast path).
  struct candidate {
    std::size_t file;
    overlap_type overlap;
    std::uint64_t both;
  };
  std::vector<candidate> cands;
  for (std::size_t i = 0; i < files.size(); ++i) {
    const std::uint64_t both = overlap_numel(mine, files[i], full);
    auto ov = classify_overlap(both, n, files[i].local_numel());
    if (!ov) continue;
    if (both == n) {  // EQUAL or SUBSET: this file alone provides everything
      file_plan fp{i, *ov, compute_copy_plan(mine, files[i], full), n};
      out.files.push_back(std::move(fp));
      out.covered = n;
      return out;
    }
    cands.push_back({i, *ov, both});
  }

  // Blocks that share no element with each other (one file per rank of a tensor-parallel
  // save) and together hold all of my shard need no merge: each file's plan stands whole.
  std::uint64_t sum_both = 0;
  for (const auto& c : cands) sum_both += c.both;
  if (sum_both == n && detail::disjoint_blocks(files, cands)) {
    for (const auto& c : cands)
      out.files.push_back(file_plan{c.file, c.overlap, compute_copy_plan(mine, files[c.file], full), c.both});
    out.covered = n;
    return out;
  }

  // Otherwise merge the files' runs in order of my offsets (a k-way merge over files whose
  // plans are already sorted), taking each element from the first file that has it. Each
  // plan is trimmed in place: kept[c] runs of plans[c] survive.
  const std::size_t k = cands.size();
  std::vector<copy_plan> plans;
  plans.reserve(k);
  for (const auto& c : cands) plans.push_back(compute_copy_plan(mine, files[c.file], full));
  std::vector<std::size_t> kept(k, 0);

  // a binary min-heap of each plan's next run, ordered by (dst, candidate); the top is
  // replaced in place by its successor (one sift-down per run)
  struct head {
    std::uint64_t dst;
    std::size_t cand;
    std::size_t idx;
    bool before(const head& o) const { return dst != o.dst ? dst < o.dst : cand < o.cand; }
  };
  std::vector<head> heap;
  heap.reserve(k);
  for (std::size_t c = 0; c < k; ++c)
    if (!plans[c].empty()) heap.push_back({plans[c][0].dst, c, 0});
  auto sift_down = [&](std::size_t i) {
    const head h = heap[i];
    for (std::size_t child; (child = 2 * i + 1) < heap.size(); i = child) {
      if (child + 1 < heap.size() && heap[child + 1].before(heap[child])) ++child;
      if (!heap[child].before(h)) break;
      heap[i] = heap[child];
    }
    heap[i] = h;
  };
  for (std::size_t i = heap.size() / 2; i-- > 0;) sift_down(i);

  std::uint64_t upto = 0;  // my elements [0, upto) are settled
  while (!heap.empty()) {
    head& top = heap.front();
    const std::size_t c = top.cand;
    copy_plan& plan = plans[c];
    copy_run r = plan[top.idx];
    if (++top.idx < plan.size()) {
      top.dst = plan[top.idx].dst;
    } else {
      top = heap.back();
      heap.pop_back();
    }
    if (!heap.empty()) sift_down(0);
    if (r.dst + r.len <= upto) continue;  // somebody already provided all of it
    if (r.dst < upto) {                   // provided in part: keep the rest
      const std::uint64_t skip = upto - r.dst;
      r.dst += skip;
      r.src += skip;
      r.len -= skip;
    } else if (r.dst > upto) {
      out.missing.push_back({upto, r.dst});
    }
    upto = r.dst + r.len;
    // keep r (coalesced with the run kept before it); the write index never passes the read
    if (kept[c] > 0) {
      copy_run& b = plan[kept[c] - 1];
      if (b.dst + b.len == r.dst && b.src + b.len == r.src) {
        b.len += r.len;
        continue;
      }
    }
    plan[kept[c]++] = r;
  }
  if (upto < n) out.missing.push_back({upto, n});

  for (std::size_t c = 0; c < k; ++c) {
    if (kept[c] == 0) continue;
    plans[c].resize(kept[c]);
    const std::uint64_t moved = plan_numel(plans[c]);
    out.covered += moved;
    out.files.push_back(file_plan{cands[c].file, cands[c].overlap, std::move(plans[c]), moved});
  }
  return out;
}

template <ShardSpec A, ShardSpec B>
load_plan plan_load(const A& mine, const std::vector<B>& files, std::span<const std::uint64_t> full) {
  return plan_load(mine, std::span<const B>(files), full);
}

/// The global flat index of element `local` of my flat view (for messages).
template <ShardSpec A>
std::optional<std::uint64_t> global_index_of(const A& mine, std::span<const std::uint64_t> full, std::uint64_t local) {
  for (auto c = mine.cursor(full); !c.done(); c.next()) {
    const spec_run r = c.run();
    if (local < r.local + (r.end - r.begin))
      return local >= r.local ? std::optional(r.begin + (local - r.local)) : std::nullopt;
  }
  return std::nullopt;
}

/// The multi-index of flat element i of a tensor of shape full, as "[2,5]".
inline std::string multi_index_string(std::span<const std::uint64_t> full, std::uint64_t i) {
  shape_t idx(full.size());
  for (std::size_t d = full.size(); d-- > 0;) {
    if (full[d] == 0) break;
    idx[d] = i % full[d];
    i /= full[d];
  }
  return to_string(idx);
}

}  // namespace shardsafe
