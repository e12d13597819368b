// shardsafe/checkpoint/dcp_save.hpp - saves flat views from every rank as a torch.distributed.checkpoint
// folder that torch 2.x's dcp.load reads (docs/FORMAT.md §5): `.metadata` and one data file per
// rank, `__R_0.distcp`.
//
// The protocol is the sharded save's (checkpoint/saver.hpp, its steps in save_agree.hpp and
// save_write.hpp), with DCP's files:
//   1. the ranks' plans are all-gathered, merged and checked alike on every rank (one shape and
//      dtype per key, shards covering each tensor, no two different shards overlapping); over a
//      PeerComm they are merged up the tree of ranks instead (save_agree.hpp: O(tensors) a rank)
//      and rank 0 alone holds every rank's: each rank writes its own shards but copies and, where
//      ranks save one shard without replica roles, but those a lower rank saves too, which rank
//      0 names to each rank alone (agree_dcp), as it names the holders of a sharded tensor of
//      no elements but its first (whose file writes its one empty chunk);
//   2. rank 0 prepares the folder: refuses a non-empty one unless overwrite, else removes
//      `.metadata` first (the old checkpoint stops loading as complete), then the rest;
//   3. every rank writes `__R_0.distcp` (temporary name, synced, renamed): rank 0 first the
//      non-tensor items, then each rank the chunks it writes, each a torch.save archive
//      (format/dcp_writer.hpp). A block shard is one chunk; a flat shard (FSDP's flattened
//      offsets) is the N-D blocks that tile each of its ranges (shard/flat_blocks.hpp), since DCP
//      records blocks; a tensor that is not sharded is one chunk, written by the lowest rank
//      holding it; identical shards (replicas) are written once, by their writer replica or
//      else the lowest rank holding them. A rank with nothing to write writes no file;
//   4. the places of every chunk are all-gathered (over the tree: sent to rank 0 alone) and rank
//      0 writes `.metadata` last, by rename: the commit mark. Each step runs under
//      dist/agree.hpp: a failure anywhere is thrown on every rank.
//
// Non-tensor items (dcp_object: an optimizer's hyper-parameters, say) are given by rank 0 (other
// ranks' are ignored) as plain values; each is a torch.save archive of its pickle. `paths` gives
// a key's path in the nested state dict (`.metadata`'s planner_data: ('optim', 'param_groups',
// 0, 'lr')); keys without one get (key,).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/save_agree.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/checkpoint/save_write.hpp"
#include "shardsafe/detail/crc32.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/dcp_metadata_writer.hpp"
#include "shardsafe/format/dcp_writer.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/shard/flat_blocks.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// A non-tensor item of a DCP checkpoint: written by rank 0 as torch.save of `value`.
struct dcp_object {
  std::string key;
  pickle_value value;
};

namespace detail {

/// The file that writes view v's spec of tm: the first in tm's list with that spec (nullptr:
/// none).
inline const std::string* dcp_writer_of(const flat_view& v, const tensor_metadata& tm) {
  const shard_spec spec = v.effective_spec();
  for (const auto& [fname, s] : tm.files)
    if (s == spec) return &fname;
  return nullptr;
}

/// Whether `rank` writes view v of tm: a DCP save's rule, and an HF export's from views. Agreed
/// over the tree (agree_dcp: md whole on rank 0 alone), a rank writes its own shards but replica
/// copies and those a lower rank saves too (agreed.saved_lower); otherwise the file
/// dcp_writer_of names.
inline bool dcp_writes(const flat_view& v, const tensor_metadata& tm, int rank, const agreed_description& agreed) {
  if (agreed.tree && tm.is_sharded)
    return v.replica != replica_role::copy &&
           (agreed.saved_lower.empty() || !agreed.saved_lower.count({v.key, to_string(v.effective_spec())}));
  const std::string* w = dcp_writer_of(v, tm);
  return w && *w == rank_file_name(rank);
}

/// The views of `views` this rank writes chunks of into its DCP data file (dcp_writes): what an
/// asynchronous save snapshots.
inline std::vector<const flat_view*> dcp_views_to_write(std::span<const flat_view> views,
                                                        const agreed_description& agreed, int rank) {
  std::vector<const flat_view*> out;
  for (const auto& v : views)
    if (dcp_writes(v, *agreed.md.find(v.key), rank, agreed)) out.push_back(&v);
  return out;
}

/// The chunks this rank writes (rules at the top), their data in the views' memory.
SHARDSAFE_DECL std::vector<dcp_chunk_data> dcp_chunks_to_write(std::span<const flat_view> views,
                                                               const agreed_description& agreed, int rank);

/// On rank 0, over the tree (md whole): who writes what where shards repeat. Returns "distinct"
/// where no two ranks save one non-empty shard of a sharded tensor (each rank writes its own but
/// copies) and no sharded tensor is empty; "lower" otherwise, with lower[r] (one per rank of the
/// world) the message telling rank r its shards a lower rank saves too
/// (agreed_description::saved_lower), and the shards of a sharded tensor of no elements it holds
/// when it is not the tensor's first file (which writes its one empty chunk).
SHARDSAFE_DECL std::string dcp_writers_of_repeats(const checkpoint_metadata& md, int world,
                                                  std::vector<std::string>& lower);

/// Reads a message of dcp_writers_of_repeats (from rank 0) into saved_lower.
SHARDSAFE_DECL std::set<std::pair<std::string, std::string>> read_saved_lower(const std::string& bytes);

/// Step 1 of a DCP save: over a PeerComm that offers it (world > 1), the description agreed up
/// the tree of ranks (agree_description_over_tree, listed: md whole on rank 0, each tensor's
/// shape, dtype and writer elsewhere), then rank 0 says who writes shards that repeat
/// (dcp_writers_of_repeats), and tells each rank its own (scattered_from_rank0); over any other
/// Comm, every rank's description all-gathered and merged on every rank (agree_on_metadata), as
/// the lowest holder of a shard writes it.
template <Comm C>
agreed_description agree_dcp(std::span<const flat_view> views, C& comm, const std::string& dname) {
  if constexpr (PeerComm<C>)
    if (comm.peer_to_peer() && comm.world_size() > 1) {
      agreed_description a = agree_description_over_tree(views, comm, dname, false, metadata_form::listed, 0);
      const step_scope step("agreeing on the writers");
      std::vector<std::string> lower;  // rank 0's, one message a rank
      const std::string how = rank0_step(comm, [&] { return dcp_writers_of_repeats(a.md, comm.world_size(), lower); });
      if (how == "lower")
        scattered_from_rank0(comm, std::move(lower),
                             [&](const std::string& mine) { a.saved_lower = read_saved_lower(mine); });
      return a;
    }
  return agreed_whole(agree_on_metadata(views, comm, dname), 0);
}

/// CRC-32 of every chunk's bytes, in pieces of at most 8 MiB on the pool's threads, joined.
inline void checksum_chunks(std::vector<dcp_chunk_data>& chunks, unsigned threads) {
  constexpr std::uint64_t piece = std::uint64_t(8) << 20;
  struct part {
    std::size_t chunk;
    std::uint64_t offset, len;
    std::uint32_t crc = 0;
  };
  std::vector<part> parts;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const std::uint64_t n = numel(chunks[i].sizes) * item_size(chunks[i].type);
    for (std::uint64_t o = 0; o < n; o += piece) parts.push_back({i, o, std::min(piece, n - o)});
  }
  parallel_for(parts.size(), threads, [&](std::size_t k) {
    part& p = parts[k];
    p.crc = crc32_of({chunks[p.chunk].data + p.offset, static_cast<std::size_t>(p.len)});
  });
  for (auto& c : chunks) c.crc = 0;
  for (const auto& p : parts) chunks[p.chunk].crc = crc32_combine(chunks[p.chunk].crc, p.crc, p.len);
}

/// Writes the laid-out file through dir's writer (blocks or write_at); aborted on failure.
template <WritableDirectory D>
void write_dcp_file(const D& dir, const dcp_file_layout& layout, const save_options& opt) {
  auto w = dir.create(layout.file());
  abort_on_failure(w, [&] {
    if constexpr (BlockWritableStorage<typename D::writer_type>) {
      block_write_options bo;
      bo.threads = opt.threads;
      bo.direct = opt.direct_io;
      bo.block_bytes = std::clamp<std::uint64_t>(opt.write_chunk_bytes, 1, std::uint64_t(16) << 20);
      w.write_blocks(layout.size(), [&](std::uint64_t off, std::span<std::byte> dst) { layout.render(off, dst); }, bo);
    } else {
      const std::uint64_t chunk = std::max<std::uint64_t>(opt.write_chunk_bytes, 1);
      const std::uint64_t n = (layout.size() + chunk - 1) / chunk;
      parallel_for(static_cast<std::size_t>(n), opt.threads, [&](std::size_t i) {
        const std::uint64_t off = i * chunk, len = std::min(chunk, layout.size() - off);
        std::vector<std::byte> buf(static_cast<std::size_t>(len));
        layout.render(off, buf);
        w.write_at(off, buf);
      });
    }
    w.sync();
    w.commit();
  });
}

/// What a rank sends after writing its file: its size, then each object and chunk with its place.
inline std::string encode_dcp_places(const dcp_file_layout* layout) {
  message_writer m;
  if (!layout) return std::move(m.count(0).count(0).count(0)).str();
  m.count(layout->size()).count(layout->objects().size());
  for (std::size_t i = 0; i < layout->objects().size(); ++i)
    m.text(layout->objects()[i].key).count(layout->object_place(i).offset).count(layout->object_place(i).length);
  m.count(layout->chunks().size());
  for (std::size_t i = 0; i < layout->chunks().size(); ++i) {
    const auto& c = layout->chunks()[i];
    m.text(c.key)
        .counts(c.offsets)
        .counts(c.sizes)
        .count(layout->chunk_place(i).offset)
        .count(layout->chunk_place(i).length);
  }
  return std::move(m).str();
}

}  // namespace detail

namespace detail {

/// Steps 2-4 of a DCP save, once every rank agreed (step 1: agree_dcp): the folder prepared,
/// each rank's data file written, .metadata last. Over the tree (agreed.tree), the places of the
/// chunks go to rank 0 alone.
template <WritableDirectory D, Comm C>
save_stats write_dcp_and_commit(const D& dir, std::span<const flat_view> views, const agreed_description& agreed,
                                C& comm, const save_options& opt, std::span<const dcp_object> objects,
                                const std::map<std::string, pickle_value>& paths,
                                std::chrono::steady_clock::time_point t0) {
  const std::string dname(dir.name());
  const checkpoint_metadata& md = agreed.md;  // whole on rank 0 (and on every rank without a tree)
  const int rank = comm.rank(), world = comm.world_size();
  rank0_step(comm, [&] {
    for (const auto& o : objects)
      if (md.find(o.key))
        fail(errc::invalid_argument, dname + ": '" + o.key + "' is both a tensor and a non-tensor item");
    // .metadata and the items' archives are pickles, whose strings are Python str (UTF-8): a
    // key, path or value of other bytes is refused here, before anything is written, not
    // committed in a checkpoint that torch's unpickler (and shardsafe's reader) refuse
    auto utf8 = [&](const std::string& key, const char* what, const pickle_value* v) {
      if (!is_valid_utf8(key))
        fail(errc::invalid_argument, dname + ": key '" + key + "' is not UTF-8 (a .metadata holds it as a Python str)");
      try {
        if (v) (void)pickle_dumps(*v);
      } catch (const error& e) {
        fail(errc::invalid_argument, dname + ": the " + what + " of '" + key + "': " + e.what());
      }
    };
    for (const auto& [key, tm] : md.tensors) utf8(key, "", nullptr);
    for (const auto& o : objects) utf8(o.key, "value", &o.value);
    for (const auto& [key, path] : paths) utf8(key, "path", &path);
  });
  detail::prepare_directory(dir, opt.overwrite, comm, dcp_metadata_file_name);  // 2

  std::unique_ptr<dcp_file_layout> layout;  // 3
  auto write_own = [&] {
    std::vector<dcp_object_data> objs;
    if (rank == 0)
      for (const auto& o : objects) objs.push_back({o.key, torch_value_archive(pickle_dumps(o.value))});
    auto chunks = detail::dcp_chunks_to_write(views, agreed, rank);
    if (objs.empty() && chunks.empty()) return detail::encode_dcp_places(nullptr);
    detail::checksum_chunks(chunks, opt.threads);
    layout = std::make_unique<dcp_file_layout>(dcp_data_file_name(rank), std::move(objs), std::move(chunks));
    detail::write_dcp_file(dir, *layout, opt);
    return detail::encode_dcp_places(layout.get());
  };
  // on rank 0: .metadata written from every rank's places; returns the bytes of all files
  auto commit = [&](const std::vector<std::string>& places) {  // 4
    dcp_metadata out;
    std::uint64_t total = 0;
    for (const auto& [key, tm] : md.tensors) {
      dcp_item& it = out.items[key];
      it.type = tm.type;
      it.size = tm.shape;
    }
    for (int r = 0; r < world; ++r) {
      message_reader m(places[static_cast<std::size_t>(r)], dname + " (rank " + std::to_string(r) + "'s data file)");
      total += m.count();
      const std::string file = dcp_data_file_name(r);
      for (std::uint64_t i = 0, n = m.count(); i < n; ++i) {
        dcp_item& it = out.items[m.text()];
        it.is_bytes = true;
        it.bytes.relative_path = file;
        it.bytes.offset = m.count();
        it.bytes.length = m.count();
      }
      for (std::uint64_t i = 0, n = m.count(); i < n; ++i) {
        const std::string key = m.text();
        dcp_chunk c;
        c.offsets = m.counts();
        c.sizes = m.counts();
        c.storage = {file, m.count(), 0};
        c.storage.length = m.count();
        auto it = out.items.find(key);
        if (it == out.items.end()) m.malformed("a chunk of '" + key + "', which no rank planned");
        it->second.chunks.push_back(std::move(c));
      }
      m.finish();
    }
    write_text(dir, dcp_metadata_file_name, write_dcp_metadata(out, paths));
    return std::to_string(total);
  };
  save_stats st;
  std::string total;
  if constexpr (PeerComm<C>)
    if (agreed.tree) {
      std::string own;
      every_rank_step(comm, [&] { own = write_own(); });
      total = gathered_at_rank0(comm, std::move(own), [&](auto&& g) { return rank0_step(comm, g); }, commit);
    }
  if (!agreed.tree) {
    const auto places = every_rank_step(comm, write_own);
    total = rank0_step(comm, [&] { return commit(places); });
  }
  st.tensors_written = layout ? layout->chunks().size() : 0;
  st.bytes_written = layout ? layout->size() : 0;
  st.total_bytes = std::stoull(total);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace detail

/// Saves every rank's views (and rank 0's objects) into dir as a torch DCP folder. A collective:
/// every rank calls it. opt.checksums does not apply (each archive carries its CRC-32);
/// save of a save_format::dcp save calls it without objects (checkpoint/layouts/dcp_write.hpp).
template <WritableDirectory D, Comm C>
save_stats save_dcp(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt,
                    std::span<const dcp_object> objects, const std::map<std::string, pickle_value>& paths) {
  const auto t0 = std::chrono::steady_clock::now();
  const detail::agreed_description agreed = detail::agree_dcp(views, comm, std::string(dir.name()));  // 1
  return detail::write_dcp_and_commit(dir, views, agreed, comm, opt, objects, paths, t0);             // 2-4
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/dcp_save.ipp"
#endif
