// shardsafe/checkpoint/checksums.hpp - checking stored tensor data against the checksums that
// metadata.json records, or in the compact form each rank file's sidecar rank_R.checksums.json
// (docs/FORMAT.md §2, "Checksums"; the hashes: detail/checksum.hpp).
//
// What the loader (load_options::verify_checksums, for the blocks its reads touch) and verify
// (every block of every file) share: finding a tensor's recorded hashes, checked against the
// file's header (one hash per block of its data); hashing one block of a stored file; and the
// message of a mismatch, which names the file, the tensor, the block's bytes, its elements in
// the file and, for a sharded tensor, the index of its first element in the full tensor. Every
// message names the file that holds the recorded hashes (checksums_holder).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe::detail {

/// Refuses checksums this library cannot check (another algorithm, written by a newer version).
inline void require_known_checksums(const checkpoint_checksums& cs, std::string_view where) {
  if (cs.algorithm != checksum_algorithm)
    fail(errc::invalid_metadata, std::string(where) + ": shardsafe.checksums uses the algorithm '" + cs.algorithm +
                                     "'; this version checks only " + std::string(checksum_algorithm));
}

/// The file, beside the rank file `fname`, that holds the hashes recorded for it, as messages
/// name it: metadata.json, or in the compact form (cs.sidecars) its rank_R.checksums.json.
inline std::string checksums_holder(const checkpoint_checksums& cs, std::string_view fname) {
  return cs.sidecars ? checksum_sidecar_name(fname) : std::string("metadata.json");
}

/// The hashes recorded for tensor e of file `fname` (whose path `path` messages name): one per
/// block of e's data, or errc::invalid_metadata when the file or tensor has none or the count
/// is wrong. (Checksums recorded at all cover every tensor of every file the writer wrote.)
inline const std::vector<std::uint64_t>& recorded_hashes(const checkpoint_checksums& cs, const std::string& fname,
                                                         std::string_view path, const tensor_entry& e) {
  const std::string ctx = std::string(path) + ": tensor '" + e.name + "'";
  const std::string holder = checksums_holder(cs, fname);
  const auto f = cs.files.find(fname);
  if (f == cs.files.end())
    fail(errc::invalid_metadata, ctx + (cs.sidecars ? ": metadata.json keeps checksums beside the rank files, but none "
                                                      "for this file were read from " +
                                                          holder
                                                    : ": metadata.json records checksums, but none for this file"));
  const auto t = f->second.find(e.name);
  if (t == f->second.end())
    fail(errc::invalid_metadata, ctx + ": " + holder + " records checksums for this file, but none for this tensor");
  const std::uint64_t want = checksum_block_count(e.nbytes(), cs.block_bytes);
  if (t->second.size() != want)
    fail(errc::invalid_metadata, ctx + ": " + holder + " records " + std::to_string(t->second.size()) +
                                     " block checksums, but its " + std::to_string(e.nbytes()) + " bytes make " +
                                     std::to_string(want) + " blocks of " + std::to_string(cs.block_bytes));
  return t->second;
}

/// The most bytes a checksum table of the file whose header is h can take (a sidecar,
/// rank_R.checksums.json): per tensor, 64 bytes per block hash (16 hex digits, quotes, comma,
/// and room for a pretty-printer's line and indent), 6 per byte of its name (every byte
/// escaped as \u00XX) and 64 more; 4 KiB for the object. A larger sidecar is refused before it
/// is read (a 200 MB string where a hash goes would otherwise be read and parsed first).
inline std::uint64_t checksum_table_bound(const safetensors_header& h, std::uint64_t block_bytes) noexcept {
  std::uint64_t most = 4096;
  auto add = [&](std::uint64_t a, std::uint64_t b) {  // most += a * b, saturating
    most = (b != 0 && a > (UINT64_MAX - most) / b) ? UINT64_MAX : most + a * b;
  };
  for (const tensor_entry& e : h.tensors) {
    add(64, checksum_block_count(e.nbytes(), block_bytes));
    add(6, e.name.size());
    add(64, 1);
  }
  return most;
}

/// Bytes [from, to) of block k of a tensor of nbytes bytes, in blocks of `block`.
struct checksum_block_span {
  std::uint64_t from = 0, to = 0;
};
inline checksum_block_span block_span(std::uint64_t k, std::uint64_t block, std::uint64_t nbytes) noexcept {
  return {k * block, std::min(nbytes, k * block + block)};
}

/// The message of block k of tensor e (in the file `path`) not matching its hash `stored`, which
/// the file `holder` records (checksums_holder). tm and spec, when given, place the block in the
/// full tensor (the index of its first element).
SHARDSAFE_DECL std::string checksum_mismatch_message(std::string_view path, std::string_view holder,
                                                     const tensor_entry& e, std::uint64_t k, std::uint64_t block,
                                                     std::uint64_t stored, std::uint64_t computed,
                                                     const tensor_metadata* tm = nullptr,
                                                     const shard_spec* spec = nullptr);

/// The spec a file holds of tm (nullptr when tm does not name the file): for messages.
inline const shard_spec* spec_in(const tensor_metadata* tm, std::string_view fname) {
  if (!tm) return nullptr;
  for (const auto& [n, s] : tm->files)
    if (n == fname) return &s;
  return nullptr;
}

}  // namespace shardsafe::detail

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/checksums.ipp"
#endif
