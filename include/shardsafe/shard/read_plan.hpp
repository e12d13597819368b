// shardsafe/shard/read_plan.hpp - turn a copy plan into reads of byte ranges.
//
// Each copy run is a contiguous byte range in the file and in my memory, so it can be read
// straight into place (a run of a permuted block is contiguous in the file only: its elements
// are scattered, dst_step apart, and its runs merge on max_gap_bytes alone). Runs close together in the file are merged into one read when the
// gap is small (max_gap_bytes) and the bytes read for nothing stay a bounded fraction of
// the bytes needed (max_over_read): a remote or cold read then issues few large requests.
// A merged read lands in a staging buffer and is scattered; a single-run read needs none.
// Reads are also split at max_read_bytes so that one huge run can go to several threads
// and a staging buffer stays bounded.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/shard/copy_plan.hpp"

namespace shardsafe {

struct read_options {
  std::uint64_t max_gap_bytes = 4096;               ///< merge reads separated by at most this
  double max_over_read = 0.02;                      ///< wasted bytes / needed bytes, per read
  std::uint64_t max_read_bytes = std::uint64_t(64) << 20;  ///< split reads longer than this
};

/// A piece of a read: bytes [offset, offset + len) of the read go to dst (a byte offset in
/// my flat view), contiguous; or, with dst_step, element k of them to dst + k * dst_step (a
/// run of a permuted block: shard/copy_plan.hpp's permuted_copy_plan).
struct read_piece {
  std::uint64_t dst = 0;
  std::uint64_t offset = 0;
  std::uint64_t len = 0;
  std::uint64_t dst_step = 0;  ///< bytes between the places of consecutive elements; 0: contiguous
};

/// Calls f(dst, offset, len) for each contiguous part of piece p (whose elements are `item`
/// bytes): the whole piece, or each element of a stepped one.
template <class F>
void for_each_contiguous(const read_piece& p, std::uint64_t item, F&& f) {
  if (p.dst_step == 0) {
    f(p.dst, p.offset, p.len);
    return;
  }
  for (std::uint64_t k = 0, n = p.len / item; k < n; ++k) f(p.dst + k * p.dst_step, p.offset + k * item, item);
}

/// One read of the file: bytes [file_offset, file_offset + len).
struct read_op {
  std::uint64_t file_offset = 0;
  std::uint64_t len = 0;
  std::vector<read_piece> pieces;
  /// True when the read can land straight in my memory (one contiguous piece, the whole read).
  bool direct() const noexcept {
    return pieces.size() == 1 && pieces[0].offset == 0 && pieces[0].len == len && pieces[0].dst_step == 0;
  }
  std::uint64_t needed() const noexcept {
    std::uint64_t n = 0;
    for (const auto& p : pieces) n += p.len;
    return n;
  }
};

struct read_plan {
  std::vector<read_op> ops;
  std::uint64_t bytes_needed = 0;  ///< bytes my memory receives
  std::uint64_t bytes_read = 0;    ///< bytes the reads fetch (needed + gaps)
};

/// Reads for one file's copy runs. `data_offset` is the file offset of element 0 of the
/// file's flat shard; `item` the element size in bytes.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL read_plan make_read_plan(const copy_plan& runs, std::uint64_t data_offset, std::uint64_t item,
                                        const read_options& opt = {}) {
  read_plan plan;
  // runs are sorted by src when they come from compute_copy_plan or plan_load; sort a copy
  // of the indices otherwise
  std::vector<std::size_t> order(runs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (!std::is_sorted(runs.begin(), runs.end(), [](const copy_run& a, const copy_run& b) { return a.src < b.src; }))
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return runs[a].src < runs[b].src; });

  const std::uint64_t max_read = std::max<std::uint64_t>(opt.max_read_bytes, item);
  read_op cur;
  std::uint64_t cur_needed = 0;
  auto flush = [&] {
    if (cur.pieces.empty()) return;
    plan.bytes_read += cur.len;
    plan.ops.push_back(std::move(cur));
    cur = read_op{};
    cur_needed = 0;
  };
  for (std::size_t k : order) {
    const copy_run& r = runs[k];
    std::uint64_t src = data_offset + r.src * item;
    std::uint64_t dst = r.dst * item;
    std::uint64_t left = r.len * item;
    const std::uint64_t step = r.dst_step == 1 || r.len == 1 ? 0 : r.dst_step * item;  // a stepped run is cut at whole elements
    plan.bytes_needed += left;
    while (left > 0) {
      if (!cur.pieces.empty()) {
        const std::uint64_t cur_end = cur.file_offset + cur.len;
        const std::uint64_t gap = src >= cur_end ? src - cur_end : UINT64_MAX;
        const std::uint64_t wasted = cur.len - cur_needed + gap;
        // judge the over-read by what this read would actually take of the run: a read
        // near max_read takes only a piece of it, and the rest goes to the next read
        const std::uint64_t takes = gap < max_read - cur.len ? std::min(left, max_read - cur.len - gap) : 0;
        // a permuted block's runs (dst_step) merge on the gap alone: its elements are spread by
        // the order they are stored in, and one read per run would be a read per element where a
        // view cuts the dimension stored innermost
        const bool merge = gap <= opt.max_gap_bytes && takes > 0 &&
                           (r.dst_step != 1 || double(wasted) <= opt.max_over_read * double(cur_needed + takes));
        if (!merge) flush();
      }
      if (cur.pieces.empty()) cur.file_offset = src;
      const std::uint64_t at = src - cur.file_offset;
      std::uint64_t take = std::min(left, max_read - std::min(max_read, at));
      if (step != 0) take -= take % item;
      if (take == 0) {
        flush();
        continue;
      }
      cur.pieces.push_back({dst, at, take, take > item ? step : 0});
      cur.len = at + take;
      cur_needed += take;
      src += take;
      dst += step != 0 ? take / item * step : take;
      left -= take;
      if (cur.len >= max_read) flush();
    }
  }
  flush();
  return plan;
}
#else
SHARDSAFE_DECL read_plan make_read_plan(const copy_plan& runs, std::uint64_t data_offset, std::uint64_t item,
                                        const read_options& opt = {});
#endif

}  // namespace shardsafe
