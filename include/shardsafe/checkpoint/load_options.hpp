// shardsafe/checkpoint/load_options.hpp - what a load is asked (load_options) and what it
// reports (load_stats); the planner that honours them: checkpoint/load_plan.hpp.
//
// Read settings, each taken from the first place that sets it: load_options (reads.*,
// threads), then the backend's hint (read_defaults(), storage/concepts.hpp), then the
// library's defaults (read_options in shard/read_plan.hpp, detail::default_threads()).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/core/read_settings.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/shard/read_plan.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

struct load_options {
  unsigned threads =
      0;  ///< reads in flight; 0: reads.requests_in_flight, else the backend's hint, else detail::default_threads()
  read_settings reads{};      ///< gap merging, read sizes, requests in flight (unset: the backend's, else the defaults)
  bool strict = true;         ///< a view whose key the checkpoint lacks is an error (else listed)
  bool validate_nan = false;  ///< fill floating views with NaN first, fail if any remain (OLMo-core's check)
  /// List the checkpoint's tensors no view asks for (load_stats::unexpected_keys): a walk of
  /// every tensor, so a caller that loads a piece at a time (unshard, the exports, the import's
  /// chunks) turns it off, or N loads of N tensors would cost N^2.
  bool list_unexpected = true;
  /// Load a floating tensor stored as another floating dtype (F16, BF16, F32, F64), converting
  /// each element while copying, rounded to nearest even (core/convert.hpp); converted reads
  /// go through a staging buffer of at most one read (reads.max_read_bytes), never a
  /// tensor-sized one. Off: a dtype that differs is errc::dtype_mismatch.
  bool convert_dtypes = false;
  /// Check the bytes the load reads against the checksums metadata.json records (docs/FORMAT.md
  /// §2, "Checksums"): every checksum block a read touches is hashed, from the tensor's memory
  /// where one read landed the whole block there, else read again, and a mismatch is
  /// errc::checksum_mismatch naming file, tensor and element range. A checkpoint without
  /// checksums (saved before them, or by another writer) loads unchecked: load_stats says
  /// how many blocks were checked.
  bool verify_checksums = false;
  /// Every view must have this dtype (errc::dtype_mismatch before a byte moves): what a
  /// configured loader's policy fixes (checkpoint/configured.hpp, load_policy::views).
  std::optional<dtype> view_dtype{};
};

/// How the ranks of a collective load that load the same views (replicas) read them
/// (checkpoint/replica_reads.hpp): each its own, or each byte once between them, shared over
/// the Comm.
enum class replica_reads { every_rank_reads, read_once, automatic };

constexpr std::string_view to_string(replica_reads m) noexcept {
  return m == replica_reads::every_rank_reads ? "every_rank_reads"
         : m == replica_reads::read_once      ? "read_once"
                                              : "automatic";
}

/// How the ranks of a collective load that load the same views read them.
struct replica_options {
  /// every_rank_reads (the default: no coordination beyond agreeing on the outcome), read_once,
  /// or automatic (measured: checkpoint/replica_reads.hpp).
  replica_reads replicas = replica_reads::every_rank_reads;
  std::uint64_t exchange_chunk_bytes = std::uint64_t(16) << 20;  ///< read_once: bytes a message
  std::uint64_t probe_bytes = std::uint64_t(8) << 20;            ///< automatic: bytes read and exchanged to measure
};

/// What a collective load is asked: a load's options, and those only a load over a Comm
/// honours (checkpoint/load.hpp; a load_options is accepted wherever this is).
struct collective_load_options : load_options, replica_options {
  collective_load_options() = default;
  collective_load_options(const load_options& o) : load_options(o) {}
  collective_load_options(const load_options& o, const replica_options& r) : load_options(o), replica_options(r) {}
};

/// A ring of host buffers (pinned for a GPU) that loads into memory the reader cannot write
/// itself go through: host memory stays at slots x slot_bytes whatever the model's size
/// (checkpoint/staged_load.hpp).
struct staging_ring {
  std::size_t slots = 4;
  std::uint64_t slot_bytes = std::uint64_t(64) << 20;
};

/// What a load into device memory is asked: a load's options, and those only such a load
/// honours (the staged load, checkpoint/staged_load.hpp; LibTorch device tensors,
/// torch/state_dict.hpp). A load of flat views takes load_options and has neither field.
struct device_load_options : load_options {
  device_load_options() = default;
  /// A load's options, with the device's defaults (implicit: a load_options is accepted
  /// wherever device_load_options is).
  device_load_options(const load_options& o) : load_options(o) {}
  /// The ring the reads land in before the copy to the device.
  staging_ring staging{};
  /// With convert_dtypes, a GPU tensor stored as another floating dtype is loaded as stored and
  /// converted on the GPU (torch/state_dict.hpp; bench/bench_device measures both); false:
  /// converted on the host as the bytes land in the staging ring.
  bool convert_on_device = true;
};

/// The read settings a load uses with a storage whose hint is `hint`: load_options first,
/// then the hint, then read_options' defaults.
inline read_options resolve_read_options(const read_settings& o, const read_settings& hint) {
  read_options r;
  if (hint.max_gap_bytes) r.max_gap_bytes = *hint.max_gap_bytes;
  if (hint.max_over_read) r.max_over_read = *hint.max_over_read;
  if (hint.max_read_bytes) r.max_read_bytes = *hint.max_read_bytes;
  if (o.max_gap_bytes) r.max_gap_bytes = *o.max_gap_bytes;
  if (o.max_over_read) r.max_over_read = *o.max_over_read;
  if (o.max_read_bytes) r.max_read_bytes = *o.max_read_bytes;
  return r;
}

/// The reads in flight a load uses: load_options.threads, then its reads.requests_in_flight,
/// then the hint, then the default.
inline unsigned resolve_threads(unsigned threads, const read_settings& reads, const read_settings& hint) {
  if (threads != 0) return threads;
  if (reads.requests_in_flight && *reads.requests_in_flight != 0) return *reads.requests_in_flight;
  if (hint.requests_in_flight && *hint.requests_in_flight != 0) return *hint.requests_in_flight;
  return detail::default_threads();
}
/// (without load settings of requests in flight)
inline unsigned resolve_threads(unsigned threads, const read_settings& hint) {
  return resolve_threads(threads, {}, hint);
}

struct load_stats {
  std::uint64_t tensors = 0;                 ///< views loaded
  std::uint64_t bytes_needed = 0;            ///< bytes of stored data the views needed (as stored: before conversion)
  std::uint64_t bytes_read = 0;              ///< bytes read from files (needed + merged gaps)
  std::uint64_t read_ops = 0;                ///< reads issued
  std::uint64_t checksum_blocks = 0;         ///< checksum blocks checked (load_options::verify_checksums)
  std::vector<std::string> missing_keys;     ///< views the checkpoint lacks (strict = false)
  std::vector<std::string> unexpected_keys;  ///< checkpoint tensors no view asked for
  double seconds = 0;
  /// A collective load's (collective_load_options::replicas): how this rank's groups read (read_once
  /// where it read a piece of some class of its views), the ranks in its largest group (1: alone),
  /// the bytes of its views it received from them, and automatic's why.
  replica_reads replicas = replica_reads::every_rank_reads;
  std::uint32_t replica_group = 1;
  std::uint64_t bytes_received = 0;
  std::string why;

  /// Adds another load's reads (bytes needed and read, read operations, checksum blocks): a
  /// load made of several loads (an import's chunks, a staging ring's fills) counts them here.
  load_stats& add_reads(const load_stats& o) noexcept {
    bytes_needed += o.bytes_needed;
    bytes_read += o.bytes_read;
    read_ops += o.read_ops;
    checksum_blocks += o.checksum_blocks;
    return *this;
  }
};

}  // namespace shardsafe
