// shardsafe/checkpoint/verify.hpp - every check docs/FORMAT.md §2 asks of a sharded checkpoint,
// without loading a tensor: what `shardsafe verify` runs on a checkpoint folder.
//
// verify_checkpoint checks, in this order, throwing at the first problem with a message that
// names the file, the tensor and the rule:
//   - metadata.json exists and is valid (opening the checkpoint_reader; errc::not_found,
//     errc::invalid_metadata);
//   - for each tensor, in metadata.json's order: every file its shard_spec_per_file (or its
//     grid, part by part in rank order, never listed whole) names
//     exists (errc::not_found), has a valid header and, when metadata.json records the file's
//     size, that size (errc::truncated); the file holds the tensor (errc::not_found) with
//     metadata.json's dtype (errc::dtype_mismatch) and as many elements as its shard spec
//     (errc::shape_mismatch); a sub-byte dtype is not sharded (errc::unsupported_dtype); the
//     files together hold every element (errc::missing_coverage, naming the first gap);
//   - every file whose size metadata.json records exists with that size, and is valid;
//   - where two files hold some of the same elements of a tensor (replicas, or a damaged or
//     hostile checkpoint), their bytes for those elements are equal (errc::invalid_metadata,
//     naming both files and the first index that differs); equal ones are counted as
//     replicas in the report. The work is O(n log n) in a tensor's n shards, never pairwise:
//     identical shards are grouped (each compared with its group's first), and the distinct
//     ones' runs are merged in order of their first element, each element compared once, with
//     the first file that held it (equality carries over);
//   - a DCP folder's non-tensor items: each is a torch.save archive of a pickled value with no
//     storage record (format/dcp_data.hpp's read_dcp_object_archive; a value holding tensors,
//     as torch 1.13 saves a nested dict, is errc::invalid_metadata naming the item);
//   - a Hugging Face folder with an index: no safetensors file the index does not name holds
//     a tensor it lists or bears the name of one of its shards (check_unlisted_hf_files);
//   - when metadata.json records checksums (docs/FORMAT.md §2, "Checksums"): every file and
//     tensor has its table, and every block of every tensor's data hashes to its recorded
//     value (errc::checksum_mismatch, naming the file, the tensor and the block's element
//     range). Without checksums (a checkpoint saved before them, or by another writer) the
//     report says so and no tensor data is read but that of replicas;
//   - every quantized weight (checkpoint/quant.hpp, docs/FORMAT.md §8) has its scales, of the
//     dtype and shape its block size asks, and every scale is finite (check_quantized: the
//     scales are read, never the weights).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <map>
#include <queue>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/checksums.hpp"
#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/layouts/registry.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/checkpoint/read_executor.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/shard/overlap.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/coverage.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// What verify_checkpoint checked (all of it valid, or it would have thrown).
struct checkpoint_report {
  std::size_t tensors = 0;                ///< tensors of metadata.json, each fully covered
  std::size_t files = 0;                  ///< distinct rank files opened and validated
  std::uint64_t tensor_bytes = 0;         ///< bytes of the full tensors (numel * bits / 8)
  bool checksums = false;                 ///< metadata.json records checksums (and all were checked)
  std::uint64_t checksum_blocks = 0;      ///< blocks hashed and found equal to their record
  std::uint64_t bytes_hashed = 0;         ///< bytes of tensor data hashed
  std::size_t replicated_tensors = 0;     ///< tensors some elements of which several files hold, equal
  std::uint64_t replicated_elements = 0;  ///< elements held a second (third, ...) time, compared equal
  /// Quantized weights (checkpoint/quant.hpp) found with their scales, each scale finite
  std::vector<quantized_tensor> quantized;
};

/// How verify_checkpoint reads tensor data (checksums and replicas).
struct verify_options {
  unsigned threads = 0;  ///< reads in flight (0: the default)
};

namespace detail {

/// Refuses (errc::invalid_metadata) to compare the elements that a chunk whose bytes hold its
/// dimensions in another order (safetensors_header::stored_order) shares with another file:
/// the comparisons below walk both files' bytes in row-major order. torch's planner writes each
/// element once, so its folders never ask for this.
inline void require_row_major_shared(std::string_view where, const std::string& key, const std::string& file,
                                     std::span<const std::size_t> order) {
  if (!order.empty())
    fail(errc::invalid_metadata, std::string(where) + ": tensor '" + key + "': " + display_file_name(file) +
                                     " shares elements with another file and stores its dimensions in the order " +
                                     to_string(shape_t(order.begin(), order.end())) +
                                     "; verify compares shared elements of row-major chunks only");
}

/// Compares the elements files a and b of tensor `key` both hold (their shards overlap);
/// returns how many, or throws errc::invalid_metadata at the first that differs.
template <ReadableDirectory D>
std::uint64_t compare_shared_elements(checkpoint_reader<D>& r, const std::string& key, const tensor_metadata& tm,
                                      std::size_t a, std::size_t b) {
  const std::string& fa = tm.files[a].first;  // named, not bound: lambdas below capture them
  const shard_spec& sa = tm.files[a].second;
  const std::string& fb = tm.files[b].first;
  const shard_spec& sb = tm.files[b].second;
  const auto& oa = r.file(fa);
  const auto& ob = r.file(fb);
  const tensor_entry& ea = r.entry_in(oa, key, tm, sa);
  const tensor_entry& eb = r.entry_in(ob, key, tm, sb);
  require_row_major_shared(r.directory().name(), key, fa, oa.header.stored_order(ea));
  require_row_major_shared(r.directory().name(), key, fb, ob.header.stored_order(eb));
  const std::uint64_t item = bit_size(tm.type) / 8;  // sharded tensors are byte-sized (checked before)
  const std::span<const std::uint64_t> full(tm.shape);
  constexpr std::uint64_t chunk = std::uint64_t(1) << 20;
  std::vector<std::byte> ba, bb;
  std::uint64_t shared = 0;
  for_each_overlap(sa, sb, full, [&](const overlap_piece& p) {
    for (std::uint64_t done = 0; done < p.len;) {
      const std::uint64_t n =
          std::min(p.len - done, std::max<std::uint64_t>(1, chunk / std::max<std::uint64_t>(item, 1)));
      ba.resize(static_cast<std::size_t>(n * item));
      bb.resize(static_cast<std::size_t>(n * item));
      oa.storage.read_into(oa.header.offset_of(ea) + (p.mine + done) * item, ba);
      ob.storage.read_into(ob.header.offset_of(eb) + (p.other + done) * item, bb);
      if (ba != bb) {
        std::uint64_t i = 0;
        while (std::memcmp(ba.data() + i * item, bb.data() + i * item, static_cast<std::size_t>(item)) == 0) ++i;
        fail(errc::invalid_metadata,
             std::string(r.directory().name()) + ": tensor '" + key + "' " + to_string(tm.shape) + ": " +
                 display_file_name(fa) + " and " + display_file_name(fb) + " both hold elements from index " +
                 multi_index_string(full, p.global) + " but their bytes differ at index " +
                 multi_index_string(full, p.global + done + i) +
                 ": two files claim the same elements with different values (which is right cannot be told)");
      }
      done += n;
    }
    shared += p.len;
  });
  return shared;
}

/// Compares the elements that the distinct shards `reps` (indices into tm.files, no two with the
/// same spec) hold more than once, each with the first file that held it: the shards' runs are
/// merged in order of their first element (a heap of one cursor per shard), against the
/// intervals already held (those that end past the current run; older ones are dropped). Returns
/// the elements held a second time, or throws errc::invalid_metadata at the first that differs.
/// O(R log n) for R runs over n shards, and memory O(n + the intervals alive at once).
template <ReadableDirectory D>
std::uint64_t compare_distinct_shards(checkpoint_reader<D>& r, const std::string& key, const tensor_metadata& tm,
                                      const std::vector<std::size_t>& reps) {
  const std::span<const std::uint64_t> full(tm.shape);
  const std::uint64_t item = bit_size(tm.type) / 8;
  struct shard {
    const typename checkpoint_reader<D>::open_file* file;
    std::uint64_t data;  ///< where its tensor's bytes start in the file
    shard_spec::cursor_type cursor;
    std::span<const std::size_t> stored_order;  ///< its header's stored_order(): empty for row-major
  };
  std::vector<shard> shards;
  shards.reserve(reps.size());
  for (const std::size_t i : reps) {
    const auto& f = r.file(tm.files[i].first);
    const tensor_entry& e = r.entry_in(f, key, tm, tm.files[i].second);
    shards.push_back({&f, f.header.offset_of(e), tm.files[i].second.cursor(full), f.header.stored_order(e)});
  }
  using item_t = std::pair<std::uint64_t, std::size_t>;  // run begin, shard
  std::priority_queue<item_t, std::vector<item_t>, std::greater<>> heap;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (!shards[s].cursor.done()) heap.emplace(shards[s].cursor.run().begin, s);
  struct held {
    std::uint64_t end, local;
    std::size_t shard;
  };
  std::map<std::uint64_t, held> covered;  // begin -> the interval and who held it first
  std::vector<std::byte> ba, bb;
  std::uint64_t shared = 0;
  auto compare = [&](std::size_t a, std::uint64_t la, std::size_t b, std::uint64_t lb, std::uint64_t global,
                     std::uint64_t n) {
    for (const std::size_t x : {a, b})
      require_row_major_shared(r.directory().name(), key, tm.files[reps[x]].first, shards[x].stored_order);
    constexpr std::uint64_t chunk = std::uint64_t(1) << 20;
    for (std::uint64_t done = 0; done < n;) {
      const std::uint64_t m = std::min(n - done, std::max<std::uint64_t>(1, chunk / std::max<std::uint64_t>(item, 1)));
      ba.resize(static_cast<std::size_t>(m * item));
      bb.resize(static_cast<std::size_t>(m * item));
      shards[a].file->storage.read_into(shards[a].data + (la + done) * item, ba);
      shards[b].file->storage.read_into(shards[b].data + (lb + done) * item, bb);
      if (ba != bb) {
        std::uint64_t i = 0;
        while (std::memcmp(ba.data() + i * item, bb.data() + i * item, static_cast<std::size_t>(item)) == 0) ++i;
        fail(errc::invalid_metadata,
             std::string(r.directory().name()) + ": tensor '" + key + "' " + to_string(tm.shape) + ": " +
                 display_file_name(tm.files[reps[a]].first) + " and " + display_file_name(tm.files[reps[b]].first) +
                 " both hold elements from index " + multi_index_string(full, global) +
                 " but their bytes differ at index " + multi_index_string(full, global + done + i) +
                 ": two files claim the same elements with different values (which is right cannot be told)");
      }
      done += m;
    }
  };
  while (!heap.empty()) {
    const std::size_t s = heap.top().second;
    heap.pop();
    const spec_run run = shards[s].cursor.run();
    shards[s].cursor.next();
    if (!shards[s].cursor.done()) heap.emplace(shards[s].cursor.run().begin, s);
    // intervals that end before this run can overlap nothing to come (runs arrive by begin)
    while (!covered.empty() && covered.begin()->second.end <= run.begin) covered.erase(covered.begin());
    std::uint64_t pos = run.begin;
    auto it = covered.upper_bound(run.begin);
    if (it != covered.begin()) --it;
    std::vector<std::pair<std::uint64_t, held>> fresh;  // the parts of the run no one held before
    for (; it != covered.end() && it->first < run.end; ++it) {
      const std::uint64_t b = it->first, e = it->second.end;
      if (e <= pos) continue;
      if (b > pos) fresh.emplace_back(pos, held{b, run.local + (pos - run.begin), s});
      const std::uint64_t lo = std::max(pos, b), hi = std::min(run.end, e);
      compare(it->second.shard, it->second.local + (lo - b), s, run.local + (lo - run.begin), lo, hi - lo);
      shared += hi - lo;
      pos = hi;
      if (pos >= run.end) break;
    }
    if (pos < run.end) fresh.emplace_back(pos, held{run.end, run.local + (pos - run.begin), s});
    for (auto& [b, h] : fresh) covered.emplace(b, h);
  }
  return shared;
}

/// Checks every block of every tensor of every file the checksums cover; adds to rep.
template <ReadableDirectory D>
void verify_all_checksums(checkpoint_reader<D>& r, const std::set<std::string>& files, const verify_options& opt,
                          checkpoint_report& rep) {
  const checkpoint_checksums& cs = *r.checksums_for(std::vector<std::string>(files.begin(), files.end()), opt.threads);
  const std::string mdname = std::string(r.directory().name()) + "/" + r.described_by();
  require_known_checksums(cs, mdname);
  for (const auto& [fname, table] : cs.files)
    if (!files.count(fname))
      fail(errc::invalid_metadata,
           mdname + ": shardsafe.checksums names the file '" + fname + "', which is not a file of the checkpoint");
  struct block {
    std::size_t file;  // index into storages
    const std::string* fname;
    const tensor_entry* e;
    std::uint64_t k, want;
  };
  using R = typename D::reader_type;
  std::vector<const R*> storages;
  std::vector<block> blocks;
  std::vector<read_job> jobs;
  // hashed and checked in batches of 2^16 blocks (a record per block of every file at once cost
  // ~200 bytes a block: 2^20 blocks took 231 MiB)
  const auto check = [&] {
    const std::vector<std::uint64_t> got = hash_reads<R>(storages, jobs, opt.threads);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const block& bl = blocks[i];
      if (got[i] != bl.want) {
        const tensor_metadata* tm = r.find(bl.e->name);
        fail(errc::checksum_mismatch,
             checksum_mismatch_message(storages[bl.file]->name(), checksums_holder(cs, *bl.fname), *bl.e, bl.k,
                                       cs.block_bytes, bl.want, got[i], tm, spec_in(tm, *bl.fname)));
      }
      rep.bytes_hashed += jobs[i].len;
    }
    rep.checksum_blocks += blocks.size();
    blocks.clear();
    jobs.clear();
  };
  for (const auto& fname : files) {
    const auto& f = r.file(fname);
    const auto t = cs.files.find(fname);
    if (t != cs.files.end())
      for (const auto& [key, hashes] : t->second)
        if (!f.header.find(key))
          fail(errc::invalid_metadata, std::string(f.storage.name()) + ": tensor '" + key +
                                           "': " + checksums_holder(cs, fname) +
                                           " records its checksums, but the file holds no such tensor that " +
                                           r.described_by() + " lists there");
    storages.push_back(&f.storage);
    for (const auto& e : f.header.tensors) {
      const auto& hashes = recorded_hashes(cs, fname, f.storage.name(), e);
      for (std::uint64_t k = 0; k < hashes.size(); ++k) {
        const auto sp = block_span(k, cs.block_bytes, e.nbytes());
        blocks.push_back({storages.size() - 1, &fname, &e, k, hashes[k]});
        jobs.push_back({storages.size() - 1, f.header.offset_of(e) + sp.from, sp.to - sp.from, nullptr});
        if (blocks.size() == (std::size_t(1) << 16)) check();
      }
    }
  }
  check();
  rep.checksums = true;
}

}  // namespace detail

/// Verifies the checkpoint r has open (see the list at the top). Files r opens stay open in r.
template <ReadableDirectory D>
checkpoint_report verify_checkpoint(checkpoint_reader<D>& r, const verify_options& opt = {}) {
  const std::string dname(r.directory().name());
  checkpoint_report rep;
  std::set<std::string> opened;
  for (const auto& entry : r.metadata().tensors) {
    const std::string& key = entry.first;  // named, not bound: lambdas below capture it
    const tensor_metadata& tm = entry.second;
    if (tm.grid) {
      // a grid (the compact form): every file it stands for checked as a listed one is, visited
      // one part at a time in rank order (a batch of files opened at once: the first missing one
      // is refused at once). Its parts tile the tensor (validate), so none is missing and none
      // shared: there is nothing to merge or compare.
      detail::for_each_file_opened(
          r, key, tm, [&](const std::string& fname, const auto&...) { opened.insert(fname); }, opt.threads);
      ++rep.tensors;
      rep.tensor_bytes += tm.numel() * bit_size(tm.type) / 8;
      continue;
    }
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
      fail(errc::unsupported_dtype, dname + ": tensor '" + key + "': sub-byte dtype " +
                                        std::string(to_string(tm.type)) + " cannot be sharded by elements");
    detail::fail_unless_whole(first_gap_in_whole(std::span<const shard_spec>(specs), tm.shape), dname, key, tm.shape);
    // every element is in some file; held > numel means some are in two: compare those
    if (held > tm.numel()) {
      std::uint64_t again = 0;
      // a file whose shard an earlier file holds identically is compared with that one only
      // (equality carries over); the distinct shards are merged in order (compare_distinct_shards)
      std::map<std::string, std::size_t> first_with;  // spec as text -> the first file holding it
      std::vector<std::size_t> distinct;
      for (std::size_t b = 0; b < tm.files.size(); ++b) {
        const auto [it, fresh] = first_with.emplace(to_string(tm.files[b].second), b);
        if (fresh)
          distinct.push_back(b);
        else
          again += detail::compare_shared_elements(r, key, tm, it->second, b);
      }
      again += detail::compare_distinct_shards(r, key, tm, distinct);
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
  r.check_all_readable();  // a DCP folder's non-tensor items, and tensors of a dtype with no type here
  // the layout's folder rules (a Hugging Face folder: no file the index does not name claims its
  // tensors or its set's names)
  with_layout(r.layout(), [&]<class L>() {
    if constexpr (requires { L::verify_folder(r); }) L::verify_folder(r);
  });
  if (r.metadata().extras.checksums) detail::verify_all_checksums(r, opened, opt, rep);
  // a quantized weight whose scale is missing, of the wrong dtype or shape, or not finite would
  // load off by its scale: refused here
  rep.quantized = check_quantized(r);
  return rep;
}

/// Verifies the checkpoint in dir (a folder holding metadata.json and its rank files).
template <ReadableDirectory D>
checkpoint_report verify_checkpoint(const D& dir, const verify_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return verify_checkpoint(r, opt);
}

}  // namespace shardsafe
