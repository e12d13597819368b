// shardsafe/checkpoint/verify.hpp - every check docs/FORMAT.md §2 asks of a sharded checkpoint,
// without loading a tensor: what `shardsafe verify` runs on a checkpoint folder.
//
// verify_checkpoint checks, in this order, throwing at the first problem with a message that
// names the file, the tensor and the rule:
//   - metadata.json exists and is valid (opening the checkpoint_reader; errc::not_found,
//     errc::invalid_metadata);
//   - for each tensor, in metadata.json's order: every file its shard_spec_per_file names
//     exists (errc::not_found), has a valid header and, when metadata.json records the file's
//     size, that size (errc::truncated); the file holds the tensor (errc::not_found) with
//     metadata.json's dtype (errc::dtype_mismatch) and as many elements as its shard spec
//     (errc::shape_mismatch); a sub-byte dtype is not sharded (errc::unsupported_dtype); the
//     files together hold every element (errc::missing_coverage, naming the first gap);
//   - every file whose size metadata.json records exists with that size, and is valid.
// No tensor data is read: only headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// What verify_checkpoint checked (all of it valid, or it would have thrown).
struct checkpoint_report {
  std::size_t tensors = 0;         ///< tensors of metadata.json, each fully covered
  std::size_t files = 0;           ///< distinct rank files opened and validated
  std::uint64_t tensor_bytes = 0;  ///< bytes of the full tensors (numel * bits / 8)
};

/// Verifies the checkpoint r has open (see the list at the top). Files r opens stay open in r.
template <ReadableDirectory D>
checkpoint_report verify_checkpoint(checkpoint_reader<D>& r) {
  const std::string dname(r.directory().name());
  checkpoint_report rep;
  std::set<std::string> opened;
  for (const auto& [key, tm] : r.metadata().tensors) {
    std::vector<shard_spec> specs;
    specs.reserve(tm.files.size());
    for (const auto& [fname, spec] : tm.files) {
      r.entry_in(r.file(fname), key, tm, spec);
      opened.insert(fname);
      specs.push_back(spec);
    }
    if (!is_byte_sized(tm.type) && tm.is_sharded)
      fail(errc::unsupported_dtype, dname + ": tensor '" + key + "': sub-byte dtype " + std::string(name(tm.type)) +
                                        " cannot be sharded by elements");
    const shard_spec whole = flat_spec{{0, tm.numel()}};
    const auto missing = missing_elements(whole, std::span<const shard_spec>(specs), tm.shape);
    if (!missing.empty())
      fail(errc::missing_coverage, dname + ": tensor '" + key + "' " + to_string(tm.shape) + ": elements " +
                                       to_string(missing.front()) + " (from index " +
                                       multi_index_string(tm.shape, missing.front().begin) + ") are in no file");
    ++rep.tensors;
    rep.tensor_bytes += tm.numel() * bit_size(tm.type) / 8;
  }
  // every rank file the writer recorded must be there with its size, even one no tensor uses
  for (const auto& [fname, size] : r.metadata().extras.file_sizes) {
    r.file(fname);
    opened.insert(fname);
  }
  rep.files = opened.size();
  return rep;
}

/// Verifies the checkpoint in dir (a folder holding metadata.json and its rank files).
template <ReadableDirectory D>
checkpoint_report verify_checkpoint(const D& dir) {
  checkpoint_reader<D> r(dir);
  return verify_checkpoint(r);
}

}  // namespace shardsafe
