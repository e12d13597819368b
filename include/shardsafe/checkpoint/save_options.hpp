// shardsafe/checkpoint/save_options.hpp - what a save is asked (save_options: the layout it
// writes, the metadata form, threads, direct I/O, checksums) and what it reports (save_stats).
// The save itself: checkpoint/saver.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/format/metadata.hpp"

namespace shardsafe {

/// Which layout a save writes.
enum class save_format {
  shardsafe,  ///< metadata.json + rank_R.safetensors (docs/FORMAT.md §2; OLMo-core's pre-1.0 layout)
  dcp,        ///< torch.distributed.checkpoint: .metadata + __R_0.distcp (checkpoint/dcp_save.hpp)
};

/// How metadata.json describes sharded tensors (docs/FORMAT.md §2).
enum class metadata_form {
  /// compact when the listed form would hold more than compact_metadata_entries shard entries
  /// (tensors x files each): past there the listed form nears the 32 MiB readers take
  automatic,
  listed,  ///< one entry per file per tensor, as OLMo-core writes and reads it
  /// a regular sharding as a grid of O(dims) numbers ("shardsafe_grid", shard/shard_grid.hpp),
  /// other tensors listed; checksums beside the rank files (rank_R.checksums.json). Readers
  /// other than shardsafe (OLMo-core) cannot read it.
  compact,
};

/// metadata_form::automatic's threshold: shard entries of the listed form (2^17 entries of
/// ~110 bytes, with their checksum tables ~170: 14-30 MB, under max_checkpoint_metadata_size).
inline constexpr std::uint64_t compact_metadata_entries = std::uint64_t(1) << 17;

struct save_options {
  save_format format = save_format::shardsafe;
  metadata_form metadata = metadata_form::automatic;          ///< save_format::shardsafe only
  bool overwrite = false;                                     ///< replace an existing non-empty directory
  unsigned threads = 0;                                       ///< writer threads per rank (0: default)
  std::uint64_t write_chunk_bytes = std::uint64_t(64) << 20;  ///< tensors are written in chunks of this
  /// Rank files go out through O_DIRECT (BlockWritableStorage writers: file_directory's), in
  /// aligned blocks (of write_chunk_bytes, at most 16 MiB; one per writer thread) assembled in
  /// memory, bypassing the page cache: a durable save then runs at the device's speed, not at
  /// the speed of filling page-cache pages (2-3x faster in bench/bench_checkpoint), and leaves
  /// the checkpoint uncached. Where the file system refuses O_DIRECT, buffered writes are used.
  /// false: buffered writes (e.g. to reload at once from the page cache).
  bool direct_io = true;
  /// Record an XXH3-64 checksum of every block of checksum_block_bytes of every tensor in
  /// metadata.json (docs/FORMAT.md §2, "Checksums"), computed while the bytes are written; what
  /// verify checks, and a load checks with load_options::verify_checksums.
  bool checksums = true;
  std::uint64_t checksum_block_bytes = default_checksum_block_bytes;  ///< recorded in metadata.json
  /// The bytes of views given without memory (data == nullptr), copied while the rank file is
  /// written: fetch(view, offset, dst) puts the view's bytes [offset, offset + dst.size()) into
  /// dst, called from several writer threads at once for disjoint parts, so host memory stays at
  /// the writer's blocks (save_state_dict sets it for CUDA tensors: device-to-host copies
  /// overlapped with the writes). Empty: every view must have memory. save_format::shardsafe only.
  std::function<void(const flat_view&, std::uint64_t, std::span<std::byte>)> fetch{};
};

struct save_stats {
  std::uint64_t bytes_written = 0;    ///< this rank's file
  std::uint64_t total_bytes = 0;      ///< all rank files
  std::uint64_t tensors_written = 0;  ///< entries in this rank's file
  double seconds = 0;
};

}  // namespace shardsafe
