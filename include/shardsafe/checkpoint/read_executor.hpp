// shardsafe/checkpoint/read_executor.hpp - runs reads of byte ranges of open files, the one way
// every load-side reader moves bytes: a load's reads, its comparison of replicas, checksum
// checks (of a load and of verify), and so rank 0's reads for an HF import's broadcast (which
// are loads).
//
// Each job is a byte range of one file, with optionally the memory it may land in straight
// (the view's bytes, when the read is exactly one piece and needs no conversion). How the bytes
// come depends on the storage (storage/concepts.hpp):
// - a MappableStorage (mmap, memory): straight out of bytes(); no read call, no copy here;
// - a BatchReadableStorage (HTTP, S3): the jobs of one file as one read_batch, split only
//   where the staging of jobs that cannot land straight would pass batch_staging_bytes;
// - any other ReadableStorage (a file): one read_into per job, staging buffers reused.
// `done(i, bytes, landed)` is then called once per job i, on a pool thread, with the job's
// bytes: landed says they are already in the job's `land` memory. Jobs of one call may run
// concurrently; a throw from a read or from done is rethrown once all jobs have returned.
// scatter_pieces then copies a staged read's pieces into a view (converting, or scattering the
// runs of a chunk stored in another order of dimensions).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <vector>

#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/copy.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// A read of bytes [offset, offset + len) of file `file` (an index into the storages given).
struct read_job {
  std::size_t file = 0;
  std::uint64_t offset = 0;
  std::uint64_t len = 0;
  std::byte* land = nullptr;  ///< where the bytes may land straight (len bytes), or nullptr: staging
};

/// Copies the pieces of a read out of src (the read's bytes) into base; `from` set: the pieces
/// hold `from` elements (offsets count stored bytes), converted to `to`.
inline void scatter_pieces(const read_op& op, const std::byte* src, std::byte* base, std::optional<dtype> from,
                           dtype to) {
  const std::uint64_t di = item_size(to), si = from ? item_size(*from) : di;
  for (const auto& p : op.pieces) {
    if (!from && p.stepped()) {  // a run of a chunk stored in another order of dimensions
      detail::strided_copy(base + p.dst, static_cast<std::size_t>(p.dst_stride(si)), src + p.offset,
                           static_cast<std::size_t>(p.src_stride(si)), static_cast<std::size_t>(p.len / si),
                           static_cast<std::size_t>(si));
      continue;
    }
    for_each_contiguous(p, si, [&](std::uint64_t dst, std::uint64_t off, std::uint64_t len) {
      const std::span<const std::byte> in(src + off, static_cast<std::size_t>(len));
      if (!from) return detail::stream_copy(base + dst, in.data(), in.size());
      convert_elements(*from, in, to, {base + dst / si * di, static_cast<std::size_t>(len / si * di)});
    });
  }
}

/// Runs every job on up to `threads` threads (see the top of this header).
template <ReadableStorage R, class Done>
void execute_reads(std::span<const R* const> files, std::span<const read_job> jobs, unsigned threads, Done&& done) {
  if constexpr (MappableStorage<R>) {
    detail::parallel_for(jobs.size(), threads, [&](std::size_t i) {
      const read_job& j = jobs[i];
      const R& st = *files[j.file];
      detail::check_read_range(st.name(), j.offset, j.len, st.size());
      done(i, st.bytes().data() + j.offset, false);
    });
  } else if constexpr (BatchReadableStorage<R>) {
    // jobs by file (in the order given within a file), cut into batches of bounded staging
    std::vector<std::size_t> order(jobs.size());
    std::iota(order.begin(), order.end(), std::size_t(0));
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return jobs[a].file < jobs[b].file; });
    struct batch {
      std::size_t first, last;  // order[first, last)
      std::uint64_t staging;
    };
    std::vector<batch> batches;
    batch b{0, 0, 0};
    for (std::size_t k = 0; k < order.size(); ++k) {
      const read_job& j = jobs[order[k]];
      const std::uint64_t need = j.land ? 0 : j.len;
      if (b.last > b.first &&
          (jobs[order[b.first]].file != j.file || (need > 0 && b.staging + need > batch_staging_bytes))) {
        batches.push_back(b);
        b = batch{k, k, 0};
      }
      b.last = k + 1;
      b.staging += need;
    }
    if (b.last > b.first) batches.push_back(b);
    detail::parallel_for(batches.size(), threads, [&](std::size_t bi) {
      const batch& bt = batches[bi];
      std::vector<std::byte> staging(static_cast<std::size_t>(bt.staging));
      std::vector<read_request> rq;
      std::vector<std::byte*> at;
      rq.reserve(bt.last - bt.first);
      std::uint64_t used = 0;
      for (std::size_t k = bt.first; k < bt.last; ++k) {
        const read_job& j = jobs[order[k]];
        std::byte* dst = j.land ? j.land : staging.data() + used;
        if (!j.land) used += j.len;
        rq.push_back({j.offset, {dst, static_cast<std::size_t>(j.len)}});
        at.push_back(dst);
      }
      files[jobs[order[bt.first]].file]->read_batch(std::span<const read_request>(rq));
      for (std::size_t k = bt.first; k < bt.last; ++k) done(order[k], at[k - bt.first], jobs[order[k]].land != nullptr);
    });
  } else {
    detail::buffer_pool spare;  // pool threads outlive this call: buffers are not kept per thread
    detail::parallel_for(jobs.size(), threads, [&](std::size_t i) {
      const read_job& j = jobs[i];
      if (j.land) {
        files[j.file]->read_into(j.offset, {j.land, static_cast<std::size_t>(j.len)});
        done(i, j.land, true);
        return;
      }
      std::vector<std::byte> staging = spare.take();
      staging.resize(static_cast<std::size_t>(j.len));
      files[j.file]->read_into(j.offset, staging);
      done(i, staging.data(), false);
      spare.give(std::move(staging));
    });
  }
}

/// The most bytes hash_reads reads of one job at a time: a job longer than this (a checksum
/// block of a large block_bytes) is read and hashed in pieces of this size, in turn.
inline constexpr std::uint64_t hash_piece_bytes = std::uint64_t(8) << 20;

/// The XXH3-64 of each job's bytes (detail/checksum.hpp), the jobs read by execute_reads: those
/// of at most hash_piece_bytes together, each in one read; each longer one alone, a piece of
/// hash_piece_bytes at a time through xxh3_64_stream, so that what is held at once stays
/// bounded whatever a job's length (the hash is the same as of all its bytes at once).
template <ReadableStorage R>
std::vector<std::uint64_t> hash_reads(std::span<const R* const> files, std::span<const read_job> jobs,
                                      unsigned threads) {
  std::vector<std::uint64_t> got(jobs.size());
  std::vector<read_job> small;
  std::vector<std::size_t> small_of, large_of;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    (jobs[i].len <= hash_piece_bytes ? small_of : large_of).push_back(i);
    if (jobs[i].len <= hash_piece_bytes) small.push_back({jobs[i].file, jobs[i].offset, jobs[i].len, nullptr});
  }
  execute_reads<R>(files, small, threads, [&](std::size_t j, const std::byte* bytes, bool) {
    got[small_of[j]] = detail::xxh3_64(bytes, static_cast<std::size_t>(small[j].len));
  });
  for (const std::size_t i : large_of) {
    detail::xxh3_64_stream h;
    for (std::uint64_t at = 0; at < jobs[i].len; at += hash_piece_bytes) {
      const read_job piece{jobs[i].file, jobs[i].offset + at, std::min(hash_piece_bytes, jobs[i].len - at), nullptr};
      execute_reads<R>(files, std::span<const read_job>(&piece, 1), 1, [&](std::size_t, const std::byte* bytes, bool) {
        h.update(bytes, static_cast<std::size_t>(piece.len));
      });
    }
    got[i] = h.digest();
  }
  return got;
}

}  // namespace shardsafe
