// shardsafe/checkpoint/save_write.hpp - steps 2 to 4 of a save in shardsafe's layout
// (checkpoint/saver.hpp): rank 0 prepares the folder, every rank streams its rank file, the
// outcomes are gathered and rank 0 writes metadata.json last, the commit mark.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/save_agree.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"
#include "shardsafe/version.hpp"

namespace shardsafe {
namespace detail {

/// On rank 0: refuses a non-empty dir unless overwrite; otherwise empties it, commit marks
/// first (remove_mark(dir), the new layout's, then those of any layout: remove_commit_marks),
/// so the old checkpoint stops loading as complete whatever its layout; then makes it.
template <WritableDirectory D, Comm C, class RemoveMark>
void prepare_emptied(const D& dir, bool overwrite, C& comm, RemoveMark&& remove_mark) {
  const step_scope step("preparing the folder");
  rank0_step(comm, [&] {
    if (!dir.list().empty()) {
      if (!overwrite)
        fail(errc::already_exists,
             std::string(dir.name()) + ": not empty; refusing to save over it (pass overwrite to replace it)");
      remove_mark(dir);
      remove_commit_marks(dir);
      for (const auto& n : dir.list()) dir.remove(n);
    }
    dir.make();
  });
}

/// Step 2: dir prepared (prepare_emptied), its commit mark metadata.json (a DCP folder's .metadata).
template <WritableDirectory D, Comm C>
void prepare_directory(const D& dir, bool overwrite, C& comm, std::string_view commit_mark = metadata_file_name) {
  prepare_emptied(dir, overwrite, comm, [&](const D& d) { d.remove(commit_mark); });
}

/// The parent of a multi-folder save (save with folders) prepared: its commit mark is the commit
/// folder's metadata.json or DCP .metadata (removing a name that is not there is no error; an
/// object store has no folder to ask about).
template <WritableDirectory D, Comm C>
void prepare_folder_set(const D& parent, std::string_view commit_folder, bool overwrite, C& comm) {
  prepare_emptied(parent, overwrite, comm, [&](const D& d) {
    const D last = d.sub(commit_folder);
    for (std::string_view mark : commit_mark_names) last.remove(mark);
  });
}

/// The views `rank` writes: its shards (not those it holds as a replica copy), and each
/// replicated tensor it is the lowest rank to hold.
inline std::vector<const flat_view*> views_to_write(std::span<const flat_view> views, const checkpoint_metadata& md,
                                                    int rank) {
  const std::string fname = rank_file_name(rank);
  std::vector<const flat_view*> out;
  for (const auto& v : views) {
    const tensor_metadata* tm = md.find(v.key);
    if (tm->is_sharded ? v.replica != replica_role::copy : tm->files.front().first == fname) out.push_back(&v);
  }
  return out;
}

/// A rank file written: its size, and (when asked) its checksum table (tensor -> block hashes).
struct written_rank_file {
  std::uint64_t size = 0;
  std::map<std::string, std::vector<std::uint64_t>> checksums;
};

/// Writes `views` as the safetensors file `fname` in dir (temporary name, synced, committed):
/// in aligned blocks where the writer is a BlockWritableStorage, else in chunks through write_at;
/// the writer is aborted when anything fails. With opt.checksums, each part written is hashed
/// right after it is produced (safetensors_checksummer).
template <WritableDirectory D>
written_rank_file write_rank_file(const D& dir, const std::string& fname, std::span<const flat_view* const> views,
                                  const save_options& opt) {
  std::vector<tensor_entry> entries;
  for (const flat_view* v : views) entries.push_back({v->key, v->type, shape_t{v->local_numel()}, 0, 0});
  auto w = dir.create(fname);
  written_rank_file out;
  abort_on_failure(w, [&] {  // a failed save leaves no temporary, no open upload
    auto layout = plan_safetensors(std::move(entries), {}, w.name());
    if constexpr (requires { w.reserve(std::uint64_t{}); }) w.reserve(layout.file_size());
    std::vector<const std::byte*> data(layout.tensors.size(), nullptr);
    std::vector<const flat_view*> by_index(layout.tensors.size(), nullptr);
    for (const flat_view* v : views) {
      const std::size_t i = layout.index_of(v->key);
      by_index[i] = v;
      data[i] = v->data;
    }
    // the bytes of views without memory (opt.fetch), by layout index
    auto fetch = [&](std::size_t i, std::uint64_t off, std::span<std::byte> dst) {
      if (!opt.fetch) no_fetch{}(i, off, dst);
      opt.fetch(*by_index[i], off, dst);
    };
    std::optional<safetensors_checksummer> sums;
    if (opt.checksums) sums.emplace(layout, data, opt.checksum_block_bytes);
    if constexpr (BlockWritableStorage<typename D::writer_type>) {
      // the whole file in aligned blocks: header and tensors gathered into each block
      block_write_options bo;
      bo.threads = opt.threads;
      bo.direct = opt.direct_io;
      bo.block_bytes = std::clamp<std::uint64_t>(opt.write_chunk_bytes, 1, std::uint64_t(16) << 20);
      w.write_blocks(
          layout.file_size(),
          [&](std::uint64_t off, std::span<std::byte> dst) {
            if (!sums) return render_safetensors_bytes(layout, data, off, dst, fetch);
            // in steps of 1 MiB, each hashed (the blocks ending in it) while still in the cache
            constexpr std::uint64_t step = std::uint64_t(1) << 20;
            for (std::uint64_t p = 0; p < dst.size(); p += step) {
              const std::uint64_t n = std::min<std::uint64_t>(step, dst.size() - p);
              render_safetensors_bytes(layout, data, off + p,
                                       dst.subspan(static_cast<std::size_t>(p), static_cast<std::size_t>(n)), fetch);
              sums->hash_range(off + p, off + p + n, dst.first(static_cast<std::size_t>(p + n)), off, fetch);
            }
          },
          bo);
      w.sync();
      w.commit();
    } else {
      safetensors_writer<typename D::writer_type> sw(w, layout);
      struct piece {
        std::size_t index;
        std::uint64_t offset, len;
        const std::byte* src;  // null: fetched
      };
      std::vector<piece> pieces;
      const std::uint64_t chunk = std::max<std::uint64_t>(opt.write_chunk_bytes, 1);
      for (const flat_view* v : views) {
        const std::size_t idx = layout.index_of(v->key);
        if (v->nbytes == 0) pieces.push_back({idx, 0, 0, v->data});
        for (std::uint64_t off = 0; off < v->nbytes; off += chunk)
          pieces.push_back({idx, off, std::min(chunk, v->nbytes - off), v->data ? v->data + off : nullptr});
      }
      parallel_for(pieces.size(), opt.threads, [&](std::size_t i) {
        const piece& p = pieces[i];
        std::vector<std::byte> fetched;  // a chunk of a view without memory
        std::span<const std::byte> bytes(p.src, static_cast<std::size_t>(p.len));
        if (!p.src && p.len) {
          fetched.resize(static_cast<std::size_t>(p.len));
          fetch(p.index, p.offset, std::span<std::byte>(fetched));
          bytes = fetched;
        }
        sw.write_part(p.index, p.offset, bytes);
        if (sums) {
          const std::uint64_t at = layout.data_start() + layout.tensors[p.index].begin + p.offset;
          sums->hash_range(at, at + p.len, bytes, at, fetch);
        }
      });
      sw.finish();
    }
    out.size = layout.file_size();
    if (sums) out.checksums = sums->table();
  });
  return out;
}

/// What a rank sends after writing its file, a message (dist/message.hpp): its size, then
/// (with checksums sent) its checksum table: items(tensors), per tensor its name and counts(hashes).
inline std::string encode_written(const written_rank_file& w, bool checksums) {
  message_writer m;
  m.count(w.size);
  if (checksums) {
    m.count(w.checksums.size());
    for (const auto& [key, hashes] : w.checksums) m.text(key).counts(hashes);
  }
  return std::move(m).str();
}

/// Reads what encode_written wrote; from names the sender in errc::comm_error.
inline written_rank_file decode_written(std::string_view bytes, bool checksums, std::string from) {
  message_reader m(bytes, std::move(from));
  written_rank_file w;
  w.size = m.count();
  if (checksums)
    for (std::uint64_t i = 0, n = m.items(16, "checksummed tensors"); i < n; ++i) {
      std::string key = m.text();
      if (w.checksums.count(key)) m.malformed("the checksums of tensor '" + key + "' are listed twice");
      w.checksums.emplace(std::move(key), m.counts());
    }
  m.finish();
  return w;
}

/// This rank's part of step 3: rank_R.safetensors written, and with sidecars its checksum table
/// beside it (checksum_sidecar_name).
template <WritableDirectory D>
written_rank_file write_own_file(const D& dir, const std::string& fname, std::span<const flat_view* const> mine,
                                 const save_options& opt, bool sidecars) {
  written_rank_file w = write_rank_file(dir, fname, mine, opt);
  if (opt.checksums && sidecars) {
    std::string table;
    append_checksum_table(table, w.checksums);
    write_text(dir, checksum_sidecar_name(fname), table);
  }
  return w;
}

/// Step 3: every rank writes rank_R.safetensors; returns every rank's file (size and
/// checksums), by rank. sidecars: each rank writes its checksum table beside its file
/// (checksum_sidecar_name) and sends only the size.
template <WritableDirectory D, Comm C>
std::vector<written_rank_file> write_rank_files(const D& dir, std::span<const flat_view* const> mine, C& comm,
                                                const save_options& opt, bool sidecars = false) {
  const std::string fname = rank_file_name(comm.rank());
  const step_scope step("writing the rank files");
  const bool send_sums = opt.checksums && !sidecars;
  const auto texts =
      every_rank_step(comm, [&] { return encode_written(write_own_file(dir, fname, mine, opt, sidecars), send_sums); });
  std::vector<written_rank_file> files;
  files.reserve(texts.size());
  for (std::size_t r = 0; r < texts.size(); ++r)
    files.push_back(
        decode_written(texts[r], send_sums, std::string(dir.name()) + " (rank " + std::to_string(r) + "'s file)"));
  return files;
}

/// Step 4, on rank 0, once every rank file is written: `finish` (which completes md: the rank
/// files' sizes and checksums, and returns what every rank gets back), then metadata.json, by
/// rename (the commit mark). Returns finish's text on every rank.
template <WritableDirectory D, Comm C, class F>
std::string commit_metadata(const D& dir, checkpoint_metadata& md, C& comm, F&& finish) {
  const step_scope step("committing metadata.json");
  return rank0_step(comm, [&] {
    std::string back = finish();
    std::string text = write_checkpoint_metadata(md);
    if (text.size() > max_checkpoint_metadata_size)  // refused before it commits a checkpoint no reader takes
      fail(errc::invalid_argument, std::string(dir.name()) + "/" + std::string(metadata_file_name) + ": would be " +
                                       std::to_string(text.size()) + " bytes, more than the " +
                                       std::to_string(max_checkpoint_metadata_size) +
                                       " readers take (docs/FORMAT.md §2): save it with "
                                       "save_options::metadata = metadata_form::compact");
    write_text(dir, metadata_file_name, text);
    return back;
  });
}

/// Steps 2-4 of a save whose plan (step 1, agreed) every rank has agreed on: prepare the
/// directory, write the rank files, commit metadata.json. t0: when the save began. The
/// asynchronous save (checkpoint/async_save.hpp) runs this on its background thread. Over a tree
/// (agreed.tree: agree_on_description), the ranks agree on their writes up
/// and down the tree and send their file's size (and checksums) to rank 0 alone; otherwise they
/// are all-gathered.
template <WritableDirectory D, Comm C>
save_stats write_and_commit(const D& dir, std::span<const flat_view> views, agreed_description agreed, C& comm,
                            const save_options& opt, std::chrono::steady_clock::time_point t0) {
  const int rank = comm.rank(), world = comm.world_size();
  const bool compact = use_compact_form(agreed.entries, opt.metadata);  // alike on every rank: agreed
  if (opt.checksums && agreed.checksum_hashes > max_checksum_hashes)    // refused before a file is written
    fail(errc::invalid_argument, std::string(dir.name()) + ": " + std::to_string(agreed.checksum_hashes) +
                                     " checksum blocks of " + std::to_string(opt.checksum_block_bytes) +
                                     " bytes, more than the " + std::to_string(max_checksum_hashes) +
                                     " a checkpoint's tables may hold (docs/FORMAT.md §2): raise "
                                     "save_options::checksum_block_bytes");
  checkpoint_metadata& md = agreed.md;
  prepare_directory(dir, opt.overwrite, comm);  // 2
  const auto mine = views_to_write(views, md, rank);
  const std::span<const flat_view* const> mine_span(mine);
  const bool send_sums = opt.checksums && !compact;

  save_stats st;
  st.tensors_written = mine.size();
  // on rank 0: md completed with every rank's file; returns the bytes of all files
  auto finish = [&](std::vector<written_rank_file>& written) {
    std::uint64_t total = 0;
    md.extras.writer = "shardsafe " + std::string(library_version);
    md.extras.world_size = static_cast<std::uint64_t>(world);
    if (opt.checksums) {
      md.extras.checksums.emplace();
      md.extras.checksums->block_bytes = opt.checksum_block_bytes;
      md.extras.checksums->sidecars = compact;
    }
    for (int r = 0; r < world; ++r) {
      auto& w = written[static_cast<std::size_t>(r)];
      md.extras.file_sizes[rank_file_name(r)] = w.size;
      total += w.size;
      if (send_sums) md.extras.checksums->files.emplace(rank_file_name(r), std::move(w.checksums));
    }
    if (compact && !agreed.tree)  // over the tree, rank 0 found the grids as it built md (finish_partial)
      for (auto& [key, tm] : md.tensors)
        if (auto g = detect_grid(tm)) {
          tm.grid = std::move(g);
          tm.files.clear();
        }
    return std::to_string(total);
  };
  std::string total;
  if constexpr (PeerComm<C>)
    if (agreed.tree) {
      const std::string fname = rank_file_name(rank);
      written_rank_file own;
      {
        const step_scope step("writing the rank files");
        every_rank_step(comm, [&] { own = write_own_file(dir, fname, mine_span, opt, compact); });  // 3
      }
      st.bytes_written = own.size;
      total = gathered_at_rank0(
          comm, encode_written(own, send_sums), [&](auto&& g) { return commit_metadata(dir, md, comm, g); },  // 4
          [&](const std::vector<std::string>& texts) {
            std::vector<written_rank_file> written;
            for (std::size_t r = 0; r < texts.size(); ++r)
              written.push_back(decode_written(texts[r], send_sums,
                                               std::string(dir.name()) + " (rank " + std::to_string(r) + "'s file)"));
            return finish(written);
          });
    }
  if (!agreed.tree) {
    auto written = write_rank_files(dir, mine_span, comm, opt, compact);  // 3
    st.bytes_written = written[static_cast<std::size_t>(rank)].size;
    total = commit_metadata(dir, md, comm, [&] { return finish(written); });  // 4
  }
  st.total_bytes = std::stoull(total);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// A save in shardsafe's layout: the four steps (checkpoint/saver.hpp's protocol).
template <WritableDirectory D, Comm C>
save_stats save_shardsafe(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt) {
  const step_scope scope("save " + std::string(dir.name()));
  const auto t0 = std::chrono::steady_clock::now();
  agreed_description agreed = agree_on_description(views, comm, std::string(dir.name()), opt);  // 1
  return write_and_commit(dir, views, std::move(agreed), comm, opt, t0);                        // 2-4
}

}  // namespace detail
}  // namespace shardsafe
