// shardsafe/shard/impl/read_plan.ipp - read_plan.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/shard/read_plan.hpp"

namespace shardsafe {

SHARDSAFE_DECL read_plan make_read_plan(const copy_plan& runs, std::uint64_t data_offset, std::uint64_t item,
                                        const read_options& opt) {
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
  // whether a piece from file offset src may join the current read, and if so where: src may
  // lie inside it (the holes of a stepped piece hold other runs' elements), not before it (runs
  // are sorted by where they start; a stepped run cut at max_read continues further on)
  auto joins = [&](std::uint64_t src, std::uint64_t& gap) {
    if (cur.pieces.empty() || src < cur.file_offset) return false;
    const std::uint64_t cur_end = cur.file_offset + cur.len;
    gap = src >= cur_end ? src - cur_end : 0;
    return gap <= opt.max_gap_bytes;
  };
  // the piece of n elements at `at` of the current read, ss bytes apart there, landing at dst, ds
  // bytes apart (a step of one element, or of a single element, is none), added to it
  auto add_piece = [&](std::uint64_t dst, std::uint64_t at, std::uint64_t n, std::uint64_t ss, std::uint64_t ds) {
    const read_piece p{dst, at, n * item, n > 1 && ds != item ? ds : 0, n > 1 && ss != item ? ss : 0};
    cur.pieces.push_back(p);
    cur.len = std::max(cur.len, at + p.span(item));
    cur_needed += p.len;
  };
  // a run with steps (copy_run::dst_step, src_step): n elements from file offset src, ss bytes
  // apart, to dst, ds bytes apart; cut at whole elements, merged on the gap alone
  auto add_stepped = [&](std::uint64_t src, std::uint64_t dst, std::uint64_t n, std::uint64_t ss, std::uint64_t ds) {
    while (n > 0) {
      std::uint64_t gap = 0;
      if (!joins(src, gap) || src - cur.file_offset > max_read - item) flush();
      if (cur.pieces.empty()) cur.file_offset = src;
      const std::uint64_t at = src - cur.file_offset;
      const std::uint64_t take =
          std::min(n, (max_read - item - at) / std::max<std::uint64_t>(ss, 1) + 1);  // ending within max_read
      add_piece(dst, at, take, ss, ds);
      src += take * ss;
      dst += take * ds;
      n -= take;
      if (cur.len >= max_read) flush();
    }
  };
  for (std::size_t p = 0; p < order.size();) {
    const copy_run& r = runs[order[p]];
    if (r.src_step != 1 && r.len > 1) {
      // Runs that gather at one stride, of one length, starting within one stride of each other
      // (the rows of a tile of permuted_copy_plan): they fill each other's holes, so they are
      // read together in the file's order, K elements of each at a time, where the holes left
      // between them all pass for a gap; otherwise (or where a stride passes max_read) element
      // by element, in the file's order too.
      std::size_t q = p + 1;
      std::uint64_t hole = 0, last = r.src;  // the widest hole between the group's starts, in elements
      for (; q < order.size(); ++q) {
        const copy_run& x = runs[order[q]];
        if (x.src_step != r.src_step || x.len != r.len || x.src - r.src >= r.src_step) break;
        hole = std::max(hole, x.src - last - 1);
        last = x.src;
      }
      hole = std::max(hole, r.src + r.src_step - last - 1);
      const std::uint64_t ss = r.src_step * item;
      auto src_of = [&](std::size_t i, std::uint64_t k) {
        return data_offset + (runs[order[i]].src + k * r.src_step) * item;
      };
      auto dst_of = [&](std::size_t i, std::uint64_t k) {
        return (runs[order[i]].dst + k * runs[order[i]].dst_step) * item;
      };
      plan.bytes_needed += (q - p) * r.len * item;
      if (hole > opt.max_gap_bytes / item || ss > max_read) {
        for (std::uint64_t k = 0; k < r.len; ++k)
          for (std::size_t i = p; i < q; ++i) add_stepped(src_of(i, k), dst_of(i, k), 1, item, item);
      } else {
        const std::uint64_t per = max_read / ss;  // elements of each run a read takes at a time: its span fits
        for (std::uint64_t k = 0; k < r.len; k += per) {
          const std::uint64_t n = std::min(per, r.len - k);
          const std::uint64_t start = src_of(p, k), end = src_of(q - 1, k + n - 1) + item;
          std::uint64_t gap = 0;
          if (!joins(start, gap) || end - cur.file_offset > max_read) flush();
          if (cur.pieces.empty()) cur.file_offset = start;
          for (std::size_t i = p; i < q; ++i)
            add_piece(dst_of(i, k), src_of(i, k) - cur.file_offset, n, ss, runs[order[i]].dst_step * item);
          if (cur.len >= max_read) flush();
        }
      }
      p = q;
      continue;
    }
    ++p;
    std::uint64_t src = data_offset + r.src * item;
    std::uint64_t dst = r.dst * item;
    plan.bytes_needed += r.len * item;
    if (r.dst_step != 1 || r.src_step != 1) {  // a stepped run that reads contiguously (or one element)
      add_stepped(src, dst, r.len, r.src_step * item, r.dst_step * item);
      continue;
    }
    std::uint64_t left = r.len * item;
    while (left > 0) {
      std::uint64_t gap = 0;
      if (joins(src, gap)) {
        const std::uint64_t at = src - cur.file_offset;
        const std::uint64_t wasted = cur.len - cur_needed + gap;
        // judge the over-read by what this read would actually take of the run: a read
        // near max_read takes only a piece of it, and the rest goes to the next read
        const std::uint64_t takes = at < max_read ? std::min(left, max_read - at) : 0;
        if (takes == 0 || double(wasted) > opt.max_over_read * double(cur_needed + takes)) flush();
      } else {
        flush();
      }
      if (cur.pieces.empty()) cur.file_offset = src;
      const std::uint64_t at = src - cur.file_offset;
      const std::uint64_t take = std::min(left, max_read - std::min(max_read, at));
      if (take == 0) {
        flush();
        continue;
      }
      cur.pieces.push_back({dst, at, take});
      cur.len = std::max(cur.len, at + take);
      cur_needed += take;
      src += take;
      dst += take;
      left -= take;
      if (cur.len >= max_read) flush();
    }
  }
  flush();
  // a stepped run cut at max_read leaves reads that start after the next run's
  const auto by_offset = [](const read_op& a, const read_op& b) { return a.file_offset < b.file_offset; };
  if (!std::is_sorted(plan.ops.begin(), plan.ops.end(), by_offset))
    std::stable_sort(plan.ops.begin(), plan.ops.end(), by_offset);
  return plan;
}

}  // namespace shardsafe
