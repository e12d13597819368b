// shardsafe/shard/read_plan.hpp - turn a copy plan into reads of byte ranges.
//
// Each copy run is a contiguous byte range in the file and in my memory, so it can be read
// straight into place. Runs close together in the file are merged into one read when the
// gap is small (max_gap_bytes) and the bytes read for nothing stay a bounded fraction of
// the bytes needed (max_over_read): a remote or cold read then issues few large requests.
// A merged read lands in a staging buffer and is scattered; a single-run read needs none.
// Reads are also split at max_read_bytes so that one huge run can go to several threads
// and a staging buffer stays bounded.
//
// A run of a permuted block (shard/copy_plan.hpp's permuted_copy_plan) has steps: its elements
// lie src_step apart in the file or land dst_step apart in my memory. Its reads are cut at whole
// elements and merge on max_gap_bytes alone (the elements a view needs are spread by the order
// they are stored in). Gathering runs of one stride and length that start within one stride of
// each other (the rows of a tile) fill each other's holes: they are read together in the file's
// order, K elements of each a read, or element by element where the holes left between them all
// would pass max_gap_bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/shard/copy_plan.hpp"

namespace shardsafe {

struct read_options {
  std::uint64_t max_gap_bytes = 4096;                      ///< merge reads separated by at most this
  double max_over_read = 0.02;                             ///< wasted bytes / needed bytes, per read
  std::uint64_t max_read_bytes = std::uint64_t(64) << 20;  ///< split reads longer than this
};

/// A piece of a read: bytes [offset, offset + len) of the read go to dst (a byte offset in
/// my flat view), contiguous; or, with a step (a run of a permuted block: shard/copy_plan.hpp's
/// permuted_copy_plan), element k (`item` bytes) from offset + k * src_step to dst + k * dst_step,
/// len bytes in all.
struct read_piece {
  std::uint64_t dst = 0;
  std::uint64_t offset = 0;
  std::uint64_t len = 0;       ///< bytes delivered
  std::uint64_t dst_step = 0;  ///< bytes between the places of consecutive elements; 0: side by side
  std::uint64_t src_step = 0;  ///< bytes between consecutive elements in the read; 0: side by side
  bool stepped() const noexcept { return dst_step != 0 || src_step != 0; }
  /// Bytes between consecutive elements of `item` bytes in my memory, and in the read.
  std::uint64_t dst_stride(std::uint64_t item) const noexcept { return dst_step != 0 ? dst_step : item; }
  std::uint64_t src_stride(std::uint64_t item) const noexcept { return src_step != 0 ? src_step : item; }
  /// Bytes of the read the piece spans, from offset: len, or to the end of its last element.
  std::uint64_t span(std::uint64_t item) const noexcept {
    return src_step == 0 || len <= item ? len : (len / item - 1) * src_step + item;
  }
};

/// Calls f(dst, offset, len) for each contiguous part of piece p (whose elements are `item`
/// bytes): the whole piece, or each element of a stepped one.
template <class F>
void for_each_contiguous(const read_piece& p, std::uint64_t item, F&& f) {
  if (!p.stepped()) {
    f(p.dst, p.offset, p.len);
    return;
  }
  const std::uint64_t ds = p.dst_stride(item), ss = p.src_stride(item);
  for (std::uint64_t k = 0, n = p.len / item; k < n; ++k) f(p.dst + k * ds, p.offset + k * ss, item);
}

/// One read of the file: bytes [file_offset, file_offset + len).
struct read_op {
  std::uint64_t file_offset = 0;
  std::uint64_t len = 0;
  std::vector<read_piece> pieces;
  /// True when the read can land straight in my memory (one contiguous piece, the whole read).
  bool direct() const noexcept {
    return pieces.size() == 1 && pieces[0].offset == 0 && pieces[0].len == len && !pieces[0].stepped();
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
SHARDSAFE_DECL read_plan make_read_plan(const copy_plan& runs, std::uint64_t data_offset, std::uint64_t item,
                                        const read_options& opt = {});

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/shard/impl/read_plan.ipp"
#endif
