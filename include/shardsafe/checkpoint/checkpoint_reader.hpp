// shardsafe/checkpoint/checkpoint_reader.hpp - checkpoint_reader: load a checkpoint into caller
// memory, in place, under any sharding (the loads of flat views on it: checkpoint/load.hpp). A load is planned, then executed, in three parts:
// - the reader (checkpoint/reader.hpp): the description and the files, opened and indexed as
//   the description says, whichever layout the folder has (checkpoint/source.hpp);
// - the planner (checkpoint/load_plan.hpp), pure: each view checked and resolved against the
//   files' shards, then the copies turned into reads of byte ranges (a load_schedule);
// - the read executor (checkpoint/read_executor.hpp): the reads run on the shared thread pool,
//   straight out of a mapping, as one batch per file, or one read_into each.
// A read with one piece lands straight in the view's memory; a merged read lands in a bounded
// staging buffer that is scattered at once. With load_options::convert_dtypes, a floating
// tensor stored as another floating dtype (an HF file's BF16 into F32 parameters) is converted
// as its pieces are scattered. Nothing the size of a tensor or a file is allocated.
//
// After the reads, replicas are compared (load_schedule::compares: the load is refused if two
// files hold different bytes for an element it loaded), and with verify_checksums every
// checksum block the reads touched is checked (checkpoint/checksums.hpp), from the view where
// one read landed the block whole, else read again through the executor.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "shardsafe/checkpoint/checksums.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/checkpoint/read_executor.hpp"
#include "shardsafe/checkpoint/reader.hpp"
#include "shardsafe/core/config.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/detail/nan.hpp"

namespace shardsafe {

/// A checkpoint opened for reading (checkpoint_files) that loads views from it.
template <ReadableDirectory D>
class checkpoint_reader : public checkpoint_files<D> {
 public:
  using checkpoint_files<D>::checkpoint_files;
  using typename checkpoint_files<D>::open_file;
  using typename checkpoint_files<D>::reader_type;

  /// Plans loading every view: checks each against the checkpoint, opens the files needed
  /// and computes the reads. Touches no view's memory (memory_later: they may have none yet).
  /// Throws on the first problem, naming file, tensor and rule.
  load_schedule plan(std::span<const flat_view> views, const load_options& opt = {}, bool memory_later = false) {
    const checkpoint_metadata& md = this->metadata();
    view_plans vp =
        plan_views(md, [&](std::string_view k) { return this->find_readable(k); }, views, opt, where(), memory_later);
    for (const auto& f : this->foreign_tensors())  // not loaded and not asked for: unexpected too
      if (opt.list_unexpected &&
          std::none_of(views.begin(), views.end(), [&](const flat_view& v) { return v.key == f.key; }))
        vp.partial.stats.unexpected_keys.push_back(f.key);
    this->open_files(vp.files, opt.threads);
    const std::vector<const open_file*> files = this->opened(vp.files);
    std::vector<planned_file> pf;
    pf.reserve(files.size());
    for (const open_file* f : files)
      pf.push_back({&f->header, f->storage.name(), resolve_read_options(opt.reads, read_defaults_of(f->storage))});
    if (opt.verify_checksums && md.extras.checksums) {
      detail::require_known_checksums(*md.extras.checksums, std::string(where()) + "/" + this->described_by());
      this->checksums_for(vp.files, opt.threads);
    }
    const read_settings hint = files.empty() ? read_settings{} : read_defaults_of(files.front()->storage);
    load_schedule s = schedule_reads(std::move(vp), views, pf, opt, resolve_threads(opt.threads, opt.reads, hint),
                                     this->described_by());
    s.hint = hint;
    return s;
  }

  /// Runs a schedule plan() made for these views (the same views, in the same order): the
  /// reads, copies, comparisons, checksums and the NaN check. Throws on the first problem.
  load_stats execute(std::span<const flat_view> views, const load_schedule& s) {
    const auto t0 = std::chrono::steady_clock::now();
    if (views.size() != s.views)
      fail(errc::invalid_argument, std::string(where()) + ": a load schedule planned for " + std::to_string(s.views) +
                                       " views executed with " + std::to_string(views.size()));
    for (std::size_t vi : s.nan_checked) detail::fill_nan(views[vi].type, views[vi].bytes());
    std::vector<std::string> names;
    for (const auto& f : s.files) names.push_back(f.name);
    const std::vector<const open_file*> files = this->opened(names);
    std::vector<const reader_type*> storages;
    for (const open_file* f : files) storages.push_back(&f->storage);
    std::vector<std::optional<dtype>> stored(views.size());
    for (const auto& [vi, t] : s.converted) {
      if (vi >= views.size())
        fail(errc::invalid_argument, std::string(where()) + ": a load schedule converts a view it does not have");
      stored[vi] = t;
    }
    // the reads: a read lands straight in a view only when it is one whole piece and needs no conversion
    std::vector<read_job> jobs;
    std::vector<const load_schedule::file_read*> of_job;
    for (std::size_t f = 0; f < s.files.size(); ++f)
      for (const auto& rd : s.files[f].reads) {
        const bool direct = rd.op.direct() && !stored[rd.view];
        jobs.push_back({f, rd.op.file_offset, rd.op.len, direct ? views[rd.view].data + rd.op.pieces[0].dst : nullptr});
        of_job.push_back(&rd);
      }
    execute_reads<reader_type>(storages, jobs, s.threads, [&](std::size_t i, const std::byte* bytes, bool landed) {
      const load_schedule::file_read& rd = *of_job[i];
      if (!landed) scatter_pieces(rd.op, bytes, views[rd.view].data, stored[rd.view], views[rd.view].type);
    });
    compare_replicas(views, s, storages, stored);
    const std::uint64_t checked = s.verify_checksums && this->metadata().extras.checksums
                                      ? check_blocks_read(views, s, files, storages, stored)
                                      : 0;
    for (std::size_t vi : s.nan_checked) {
      const flat_view& v = views[vi];
      const std::int64_t at = detail::first_nan(v.type, v.bytes());
      if (at >= 0) {
        auto g = global_index_of(v.effective_spec(), v.full_shape, static_cast<std::uint64_t>(at));
        fail(errc::missing_coverage, std::string(where()) + ": tensor '" + v.key +
                                         "': NaN after loading at local element " + std::to_string(at) +
                                         (g ? " (index " + multi_index_string(v.full_shape, *g) + ")" : std::string()) +
                                         ": not loaded, or NaN in the checkpoint");
      }
    }
    load_stats st = s.stats;
    st.checksum_blocks = checked;
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
  }

  /// plan(), then execute(): now shardsafe::load(reader, views, opt) (checkpoint/load.hpp).
  [[deprecated("checkpoint_reader::load(views, opt) is shardsafe::load(reader, views, opt) (CHANGELOG)")]]
  load_stats load(std::span<const flat_view> views, const load_options& opt = {}) {
    const auto t0 = std::chrono::steady_clock::now();
    load_stats st = execute(views, plan(views, opt));
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
  }

 private:
  std::string_view where() const { return this->directory().name(); }

  /// Runs the schedule's compares (after the reads): each piece's bytes, as stored (converted
  /// where the view's dtype differs), must equal the view's; errc::invalid_metadata otherwise.
  void compare_replicas(std::span<const flat_view> views, const load_schedule& s,
                        const std::vector<const reader_type*>& storages,
                        const std::vector<std::optional<dtype>>& stored) const {
    std::vector<read_job> jobs;
    for (const auto& [f, rd] : s.compares) jobs.push_back({f, rd.op.file_offset, rd.op.len, nullptr});
    execute_reads<reader_type>(storages, jobs, s.threads, [&](std::size_t i, const std::byte* src, bool) {
      // plain references, not structured bindings: the lambdas below capture them (clang < 16 cannot)
      const std::size_t f = s.compares[i].first;
      const auto& rd = s.compares[i].second;
      const flat_view& v = views[rd.view];
      const std::uint64_t di = item_size(v.type), si = stored[rd.view] ? item_size(*stored[rd.view]) : di;
      std::vector<std::byte> conv;
      for (const auto& p : rd.op.pieces)
        for_each_contiguous(p, si, [&](std::uint64_t dst, std::uint64_t off, std::uint64_t len) {
          const std::byte* have = src + off;
          const std::size_t n = static_cast<std::size_t>(len / si * di);
          if (stored[rd.view]) {
            conv.resize(n);
            convert_elements(*stored[rd.view], {have, static_cast<std::size_t>(len)}, v.type, conv);
            have = conv.data();
          }
          const std::byte* loaded = v.data + dst / si * di;
          if (std::memcmp(have, loaded, n) == 0) return;
          std::uint64_t at = 0;
          while (std::memcmp(have + at * di, loaded + at * di, static_cast<std::size_t>(di)) == 0) ++at;
          const std::uint64_t local = dst / si + at;
          auto g = global_index_of(v.effective_spec(), v.full_shape, local);
          fail(errc::invalid_metadata,
               std::string(storages[f]->name()) + ": tensor '" + v.key + "': holds other bytes for element " +
                   (g ? "index " + multi_index_string(v.full_shape, *g) : "local " + std::to_string(local)) +
                   " than the file it was loaded from: two files claim the same elements with different values, and a "
                   "load cannot choose between them (shardsafe verify names both files)");
        });
    });
  }

  /// Checks every checksum block the schedule's reads touch (load_options::verify_checksums);
  /// returns how many. A block that one direct read landed whole in a view is hashed there;
  /// any other is read again through the executor.
  std::uint64_t check_blocks_read(std::span<const flat_view> views, const load_schedule& s,
                                  const std::vector<const open_file*>& files,
                                  const std::vector<const reader_type*>& storages,
                                  const std::vector<std::optional<dtype>>& stored) const {
    const checkpoint_checksums& cs = *this->metadata().extras.checksums;
    struct block {
      std::size_t file;
      const tensor_entry* e;
      std::uint64_t want, k;
      const std::byte* in_view = nullptr;  // the block's bytes, where a read landed them whole
    };
    std::vector<block> blocks;  // a record per block a read touches, made unique below (40 bytes each)
    for (std::size_t f = 0; f < s.files.size(); ++f) {
      const open_file& of = *files[f];
      for (const auto& rd : s.files[f].reads) {
        const tensor_entry* e = of.header.find(views[rd.view].key);
        if (!e || e->nbytes() == 0) continue;
        const std::vector<std::uint64_t>& hashes = detail::recorded_hashes(cs, s.files[f].name, of.storage.name(), *e);
        const std::uint64_t b = of.header.offset_of(*e);
        const std::uint64_t lo = std::max(rd.op.file_offset, b) - b;
        const std::uint64_t hi = std::min(rd.op.file_offset + rd.op.len, b + e->nbytes()) - b;
        if (hi <= lo) continue;
        const bool whole = rd.op.direct() && !stored[rd.view];
        for (std::uint64_t k = lo / cs.block_bytes; k * cs.block_bytes < hi; ++k) {
          block& bl = blocks.emplace_back(block{f, e, hashes[static_cast<std::size_t>(k)], k});
          const auto sp = detail::block_span(k, cs.block_bytes, e->nbytes());
          if (whole && b + sp.from >= rd.op.file_offset && b + sp.to <= rd.op.file_offset + rd.op.len)
            bl.in_view = views[rd.view].data + rd.op.pieces[0].dst + (b + sp.from - rd.op.file_offset);
        }
      }
    }
    // once each, by (file, tensor, block), the first read that landed it whole in a view first (a map of
    // them cost ~112 bytes a block: 2^20 blocks took 227 MiB)
    const auto id = [](const block& x) { return std::tuple(x.file, x.e, x.k); };
    std::stable_sort(blocks.begin(), blocks.end(), [&](const block& x, const block& y) {
      return std::tuple(id(x), !x.in_view) < std::tuple(id(y), !y.in_view);
    });
    const auto same = [&](const block& x, const block& y) { return id(x) == id(y); };
    blocks.erase(std::unique(blocks.begin(), blocks.end(), same), blocks.end());
    std::vector<std::uint64_t> got;
    std::vector<read_job> jobs;         // blocks not in a view, read again
    std::vector<std::size_t> block_of;  // jobs[j] reads blocks[block_of[j]]
    for (const block& bl : blocks) {
      const auto sp = detail::block_span(bl.k, cs.block_bytes, bl.e->nbytes());
      got.push_back(bl.in_view ? detail::xxh3_64(bl.in_view, static_cast<std::size_t>(sp.to - sp.from)) : 0);
      if (!bl.in_view) {
        block_of.push_back(got.size() - 1);
        jobs.push_back({bl.file, files[bl.file]->header.offset_of(*bl.e) + sp.from, sp.to - sp.from, nullptr});
      }
    }
    const std::vector<std::uint64_t> reread = hash_reads<reader_type>(storages, jobs, s.threads);
    for (std::size_t j = 0; j < jobs.size(); ++j) got[block_of[j]] = reread[j];
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const block& bl = blocks[i];
      if (got[i] == bl.want) continue;
      const tensor_metadata* tm = this->find(bl.e->name);
      fail(errc::checksum_mismatch,
           detail::checksum_mismatch_message(
               storages[bl.file]->name(), detail::checksums_holder(cs, s.files[bl.file].name), *bl.e, bl.k,
               cs.block_bytes, bl.want, got[i], tm, detail::spec_in(tm, s.files[bl.file].name)));
    }
    return blocks.size();
  }
};

}  // namespace shardsafe
