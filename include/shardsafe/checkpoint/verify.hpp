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
//   - every file whose size metadata.json records exists with that size, and is valid;
//   - where two files hold some of the same elements of a tensor (replicas, or a damaged or
//     hostile checkpoint), their bytes for those elements are equal (errc::invalid_metadata,
//     naming both files and the first index that differs); equal ones are counted as
//     replicas in the report;
//   - a Hugging Face folder with an index: no safetensors file the index does not name holds
//     a tensor it lists or bears the name of one of its shards (check_unlisted_hf_files);
//   - when metadata.json records checksums (docs/FORMAT.md §2, "Checksums"): every file and
//     tensor has its table, and every block of every tensor's data hashes to its recorded
//     value (errc::checksum_mismatch, naming the file, the tensor and the block's element
//     range). Without checksums (a checkpoint saved before them, or by another writer) the
//     report says so and no tensor data is read but that of replicas.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/checksums.hpp"
#include "shardsafe/checkpoint/hf_folder.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/shard/overlap.hpp"
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
  bool checksums = false;          ///< metadata.json records checksums (and all were checked)
  std::uint64_t checksum_blocks = 0;  ///< blocks hashed and found equal to their record
  std::uint64_t bytes_hashed = 0;     ///< bytes of tensor data hashed
  std::size_t replicated_tensors = 0;      ///< tensors some elements of which several files hold, equal
  std::uint64_t replicated_elements = 0;   ///< elements held a second (third, ...) time, compared equal
};

/// How verify_checkpoint reads tensor data (checksums and replicas).
struct verify_options {
  unsigned threads = 0;  ///< reads in flight (0: the default)
};

namespace detail {

/// Compares the elements files a and b of tensor `key` both hold (their shards overlap);
/// returns how many, or throws errc::invalid_metadata at the first that differs.
template <ReadableDirectory D>
std::uint64_t compare_shared_elements(checkpoint_reader<D>& r, const std::string& key, const tensor_metadata& tm,
                                      std::size_t a, std::size_t b) {
  const auto& [fa, sa] = tm.files[a];
  const auto& [fb, sb] = tm.files[b];
  const auto& oa = r.file(fa);
  const auto& ob = r.file(fb);
  const tensor_entry& ea = r.entry_in(oa, key, tm, sa);
  const tensor_entry& eb = r.entry_in(ob, key, tm, sb);
  const std::uint64_t item = bit_size(tm.type) / 8;  // sharded tensors are byte-sized (checked before)
  const std::span<const std::uint64_t> full(tm.shape);
  constexpr std::uint64_t chunk = std::uint64_t(1) << 20;
  std::vector<std::byte> ba, bb;
  std::uint64_t shared = 0;
  for_each_overlap(sa, sb, full, [&](const overlap_piece& p) {
    for (std::uint64_t done = 0; done < p.len;) {
      const std::uint64_t n = std::min(p.len - done, std::max<std::uint64_t>(1, chunk / std::max<std::uint64_t>(item, 1)));
      ba.resize(static_cast<std::size_t>(n * item));
      bb.resize(static_cast<std::size_t>(n * item));
      oa.storage.read_into(oa.header.offset_of(ea) + (p.mine + done) * item, ba);
      ob.storage.read_into(ob.header.offset_of(eb) + (p.other + done) * item, bb);
      if (ba != bb) {
        std::uint64_t i = 0;
        while (std::memcmp(ba.data() + i * item, bb.data() + i * item, static_cast<std::size_t>(item)) == 0) ++i;
        fail(errc::invalid_metadata,
             std::string(r.directory().name()) + ": tensor '" + key + "' " + to_string(tm.shape) + ": " + fa + " and " +
                 fb + " both hold elements from index " + multi_index_string(full, p.global) +
                 " but their bytes differ at index " + multi_index_string(full, p.global + done + i) +
                 ": two files claim the same elements with different values (which is right cannot be told)");
      }
      done += n;
    }
    shared += p.len;
  });
  return shared;
}

/// Checks every block of every tensor of every file the checksums cover; adds to rep.
template <ReadableDirectory D>
void verify_all_checksums(checkpoint_reader<D>& r, const std::set<std::string>& files, const verify_options& opt,
                          checkpoint_report& rep) {
  const checkpoint_checksums& cs = *r.metadata().extras.checksums;
  const std::string mdname = std::string(r.directory().name()) + "/" + r.described_by();
  require_known_checksums(cs, mdname);
  for (const auto& [fname, table] : cs.files)
    if (!files.count(fname))
      fail(errc::invalid_metadata, mdname + ": shardsafe.checksums names the file '" + fname +
                                       "', which is not a file of the checkpoint");
  struct block {
    const typename checkpoint_reader<D>::open_file* file;
    std::string fname;
    const tensor_entry* e;
    std::uint64_t k, want;
  };
  std::vector<block> blocks;
  for (const auto& fname : files) {
    const auto& f = r.file(fname);
    const auto t = cs.files.find(fname);
    if (t != cs.files.end())
      for (const auto& [key, hashes] : t->second)
        if (!f.header.find(key))
          fail(errc::invalid_metadata, std::string(f.storage.name()) + ": tensor '" + key +
                                           "': metadata.json records its checksums, but the file has no such tensor");
    for (const auto& e : f.header.tensors) {
      const auto& hashes = recorded_hashes(cs, fname, f.storage.name(), e);
      for (std::uint64_t k = 0; k < hashes.size(); ++k) blocks.push_back({&f, fname, &e, k, hashes[k]});
    }
  }
  std::vector<std::uint64_t> got(blocks.size());
  buffer_pool spare;
  parallel_for(blocks.size(), opt.threads, [&](std::size_t i) {
    const block& bl = blocks[i];
    const auto sp = block_span(bl.k, cs.block_bytes, bl.e->nbytes());
    std::vector<std::byte> buf = spare.take();
    got[i] = hash_stored(bl.file->storage, bl.file->header.offset_of(*bl.e) + sp.from, sp.to - sp.from, buf);
    spare.give(std::move(buf));
  });
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const block& bl = blocks[i];
    if (got[i] != bl.want) {
      const tensor_metadata* tm = r.find(bl.e->name);
      fail(errc::checksum_mismatch, checksum_mismatch_message(bl.file->storage.name(), *bl.e, bl.k, cs.block_bytes,
                                                              bl.want, got[i], tm, spec_in(tm, bl.fname)));
    }
    const auto sp = block_span(bl.k, cs.block_bytes, bl.e->nbytes());
    rep.bytes_hashed += sp.to - sp.from;
  }
  rep.checksum_blocks = blocks.size();
  rep.checksums = true;
}

}  // namespace detail

/// Verifies the checkpoint r has open (see the list at the top). Files r opens stay open in r.
template <ReadableDirectory D>
checkpoint_report verify_checkpoint(checkpoint_reader<D>& r, const verify_options& opt = {}) {
  const std::string dname(r.directory().name());
  checkpoint_report rep;
  std::set<std::string> opened;
  for (const auto& [key, tm] : r.metadata().tensors) {
    std::vector<shard_spec> specs;
    specs.reserve(tm.files.size());
    std::uint64_t held = 0;
    for (const auto& [fname, spec] : tm.files) {
      r.entry_in(r.file(fname), key, tm, spec);
      opened.insert(fname);
      specs.push_back(spec);
      held += spec.local_numel();
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
    // every element is in some file; held > numel means some are in two: compare those
    if (held > tm.numel()) {
      std::uint64_t again = 0;
      // a file whose shard an earlier file holds identically is compared with that one only
      // (equality carries over); the others with every earlier one they overlap
      auto first_identical = [&](std::size_t b) {
        for (std::size_t a = 0; a < b; ++a)
          if (tm.files[a].second == tm.files[b].second) return a;
        return b;
      };
      for (std::size_t b = 1; b < tm.files.size(); ++b) {
        if (const std::size_t a = first_identical(b); a != b) {
          again += detail::compare_shared_elements(r, key, tm, a, b);
          continue;
        }
        for (std::size_t a = 0; a < b; ++a)
          if (first_identical(a) == a &&
              overlap_numel(tm.files[a].second, tm.files[b].second, std::span<const std::uint64_t>(tm.shape)) > 0)
            again += detail::compare_shared_elements(r, key, tm, a, b);
      }
      if (again > 0) {
        ++rep.replicated_tensors;
        rep.replicated_elements += again;
      }
    }
    ++rep.tensors;
    rep.tensor_bytes += tm.numel() * bit_size(tm.type) / 8;
  }
  // every rank file the writer recorded must be there with its size, even one no tensor uses
  for (const auto& [fname, size] : r.metadata().extras.file_sizes) {
    r.file(fname);
    opened.insert(fname);
  }
  rep.files = opened.size();
  // a Hugging Face folder: no file the index does not name claims its tensors or its set's names
  if (r.format() == checkpoint_format::hf && r.described_by() == hf_index_file)
    check_unlisted_hf_files(r.directory(), open_hf_folder(r.directory()));
  if (r.metadata().extras.checksums) detail::verify_all_checksums(r, opened, opt, rep);
  return rep;
}

/// Verifies the checkpoint in dir (a folder holding metadata.json and its rank files).
template <ReadableDirectory D>
checkpoint_report verify_checkpoint(const D& dir, const verify_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return verify_checkpoint(r, opt);
}

}  // namespace shardsafe
