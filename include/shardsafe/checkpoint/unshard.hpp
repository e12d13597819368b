// shardsafe/checkpoint/unshard.hpp - full tensors out of a sharded checkpoint, in one process.
//
// The loader does the work: a chunk [a, b) of a full tensor is just a flat shard
// {[a, b)}, so reading full tensors chunk by chunk keeps memory bounded by the chunk size
// whatever the tensor size, and reads only what each chunk needs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/shard/coverage.hpp"

namespace shardsafe {

namespace detail {

/// Fails unless the files' shards cover the tensor (gap: first_gap_in_whole), naming the first
/// elements in no file, or, where the walk stopped short of them, how few the shards hold.
inline void fail_unless_whole(const coverage_gap& gap, std::string_view dir, const std::string& key,
                              std::span<const std::uint64_t> shape) {
  const std::string at = std::string(dir) + ": tensor '" + key + "' " + to_string(shape);
  if (gap.first)
    fail(errc::missing_coverage, at + ": elements " + to_string(*gap.first) + " (from index " +
                                     multi_index_string(shape, gap.first->begin) + ") are in no file");
  if (gap.by_count)
    fail(errc::missing_coverage, at + ": its files hold " + std::to_string(gap.held) +
                                     " elements in all, fewer than its " + std::to_string(numel(shape)) +
                                     ": some are in no file");
}

/// Elements [first, first + n) of tensor idx of a layout, landing in bytes.
struct layout_piece {
  std::size_t idx;
  std::uint64_t first, n;
  std::span<std::byte> bytes;
};

/// The bytes [off, off + dst.size()) of a file laid out as `layout`: its header, then for each
/// tensor it crosses, the elements there, got by load(std::span<const layout_piece>): once with
/// every piece that lands in dst in whole elements (one load for the many small tensors a block
/// may hold), and once for each piece a block edge cuts inside an element (loaded into a scratch,
/// then copied).
template <class Load>
void fill_layout_block(const safetensors_layout& layout, std::uint64_t off, std::span<std::byte> dst, Load&& load) {
  std::vector<layout_piece> whole;
  layout.for_each_piece(
      off, off + dst.size(),
      [&](std::uint64_t pos, std::uint64_t n) {
        std::memcpy(dst.data() + (pos - off), layout.header.data() + pos, static_cast<std::size_t>(n));
      },
      [&](std::size_t idx, std::uint64_t lo, std::uint64_t n, std::uint64_t pos) {
        const std::uint64_t item = item_size(layout.tensors[idx].type), hi = lo + n;  // bytes of the tensor
        const std::uint64_t e0 = lo / item, e1 = (hi + item - 1) / item;
        std::byte* out = dst.data() + (pos - off);
        if (lo % item == 0 && hi % item == 0) {
          whole.push_back({idx, e0, e1 - e0, std::span<std::byte>(out, static_cast<std::size_t>(n))});
        } else {
          std::vector<std::byte> scratch(static_cast<std::size_t>((e1 - e0) * item));
          const layout_piece p{idx, e0, e1 - e0, std::span<std::byte>(scratch)};
          load(std::span<const layout_piece>(&p, 1));
          std::memcpy(out, scratch.data() + (lo - e0 * item), static_cast<std::size_t>(n));
        }
      });
  if (!whole.empty()) load(std::span<const layout_piece>(whole));
}

/// Loads pieces with one load per reader they come from: reader_of(idx) says which,
/// view_of(piece) gives each its view.
template <class ReaderOf, class ViewOf>
void load_pieces(std::span<const layout_piece> pieces, ReaderOf&& reader_of, ViewOf&& view_of, const load_options& lo) {
  using reader_ptr = decltype(reader_of(std::size_t(0)));
  std::vector<std::pair<reader_ptr, std::vector<flat_view>>> by_reader;
  for (const layout_piece& p : pieces) {
    const reader_ptr r = reader_of(p.idx);
    auto it = std::find_if(by_reader.begin(), by_reader.end(), [&](const auto& g) { return g.first == r; });
    if (it == by_reader.end()) it = by_reader.insert(by_reader.end(), {r, {}});
    it->second.push_back(view_of(p));
  }
  for (auto& [r, views] : by_reader) shardsafe::load(*r, std::span<const flat_view>(views), lo);
}

/// Opens every file of tensor `key` (tm: its metadata in r) and checks that each holds the
/// tensor as its shard says (checkpoint_files::entry_in), calling each(file, spec, entry) in
/// file order. A grid's parts are visited one at a time (tensor_metadata::for_each_file) and
/// opened a batch at a time, in parallel, so the first missing file of a million-part grid is
/// refused after one batch of attempts, before anything is planned, and no list of its parts is
/// ever held; the first file that fails, in file order, is the one named.
template <ReadableDirectory D, class F>
void for_each_file_opened(checkpoint_files<D>& r, const std::string& key, const tensor_metadata& tm, F&& each,
                          unsigned threads = 0) {
  constexpr std::size_t batch = 512;
  std::vector<std::string> names;
  std::vector<shard_spec> specs;
  auto flush = [&] {
    try {
      r.open_files(names, threads);
    } catch (...) {  // opened again below one at a time, in order: the first failing file is named
    }
    for (std::size_t i = 0; i < names.size(); ++i)
      each(names[i], specs[i], r.entry_in(r.file(names[i]), key, tm, specs[i]));
    names.clear();
    specs.clear();
  };
  tm.for_each_file([&](const std::string& n, const shard_spec& s) {
    names.push_back(n);
    specs.push_back(s);
    if (names.size() == batch) flush();
  });
  flush();
}

}  // namespace detail

struct unshard_options {
  /// How each chunk is loaded: by default with the checksums the checkpoint records checked
  /// (load_options::verify_checksums; none recorded: unchecked), so that a damaged byte is
  /// errc::checksum_mismatch, as verify reports it, not written out.
  load_options load{.verify_checksums = true};
  std::uint64_t chunk_bytes = std::uint64_t(64) << 20;  ///< memory per chunk
};

/// Calls f(bytes, byte_offset) for consecutive chunks of the full tensor `key`, in order (the
/// offset of the chunk's first byte in the full tensor's bytes). A tensor with no elements gets
/// no call. A sub-byte tensor (F4, F6) is streamed as its one file stores it, whole; held any
/// other way (split over files, in part) it is errc::unsupported_dtype, as for every reader.
/// Returns the reads made (load_stats::add_reads of every chunk's load).
template <ReadableDirectory D, class F>
load_stats for_each_full_chunk(checkpoint_reader<D>& r, const std::string& key, F&& f,
                               const unshard_options& opt = {}) {
  load_stats stats;
  const tensor_metadata* tm = r.find(key);
  const std::string ctx = std::string(r.directory().name()) + ": tensor '" + key + "'";
  if (!tm) fail(errc::not_found, ctx + " is not in the checkpoint");
  if (!is_byte_sized(tm->type)) {
    const std::uint64_t bytes =
        tm->numel() * bit_size(tm->type) / 8;  // whole bytes: checked when the metadata was read
    if (tm->files.size() != 1 || tm->files.front().second.local_numel() != tm->numel())
      fail(errc::unsupported_dtype, ctx + ": sub-byte dtype " + std::string(to_string(tm->type)) +
                                        " is read only whole from one file, not split over " +
                                        std::to_string(tm->files.size()));
    const auto& of = r.file(tm->files.front().first);
    const tensor_entry& e = r.entry_in(of, key, *tm, tm->files.front().second);
    const std::uint64_t step = std::max<std::uint64_t>(3, opt.chunk_bytes / 3 * 3);  // whole F6 groups
    std::vector<std::byte> buf(static_cast<std::size_t>(std::min(bytes, step)));
    for (std::uint64_t at = 0; at < bytes; at += step) {
      const std::uint64_t len = std::min(step, bytes - at);
      of.storage.read_into(of.header.offset_of(e) + at,
                           std::span<std::byte>(buf.data(), static_cast<std::size_t>(len)));
      f(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(len)), at);
      stats.bytes_needed += len;
      stats.bytes_read += len;
      ++stats.read_ops;
    }
    return stats;
  }
  const std::uint64_t n = tm->numel(), item = item_size(tm->type);
  if (n == 0) return stats;
  // A window's copy plan holds a run per contiguous piece of each file in it: for files whose
  // runs are short (a column block: one row's slice a run), the window shrinks so that a plan
  // holds at most about 2^20 runs per file, whatever the chunk's bytes.
  // A DCP chunk (or a torch.save file's tensor) stored in another order of dimensions is read along the dimension it stores
  // innermost, s: a window covering few indices of s reads a piece of every stored row, and
  // merged reads pass over the rest (a [1030, 20000] chunk stored transposed, in 2^18-element
  // windows, was read 79 times over). So the window grows to cover the chunk's whole extent
  // along s (or as much of it as the chunk bytes allow), in whole indices of s (windows start at
  // one, so no box of a window is a piece of a stored row's element set: runs of one element),
  // as long as its runs along s stay at most 2^20; otherwise (a window inside one index of s:
  // runs of single elements, which permuted_copy_plan gathers) it is 2^18 elements.
  // A grid's files are opened and checked first, a batch at a time: a missing one is refused
  // before a window's plan lists the parts it meets (a million for a 300-byte grid).
  if (tm->grid) detail::for_each_file_opened(r, key, *tm, [](const auto&...) {}, opt.load.threads);
  const std::uint64_t cap = std::max<std::uint64_t>(1, opt.chunk_bytes / item);
  std::uint64_t shortest = n, permuted = 0;
  tm->for_each_file([&](const std::string& fname, const shard_spec& spec) {
    std::span<const std::size_t> order;
    if (spec.is_block() && r.layout().permuted_files) {  // torch.save'd: a DCP chunk, a .bin's tensor
      const auto& of = r.file(fname);
      order = of.header.stored_order(r.entry_in(of, key, *tm, spec));
    }
    if (order.empty()) {
      if (auto c = spec.cursor(tm->shape); !c.done()) shortest = std::min(shortest, c.run().end - c.run().begin);
      return;
    }
    const std::size_t s = order.back();
    std::uint64_t after = 1;  // elements of the full tensor per index of s
    for (std::size_t d = s + 1; d < tm->shape.size(); ++d) after *= tm->shape[d];
    const std::uint64_t extent = spec.block().local_shape()[s];
    const std::uint64_t want = std::min(cap, std::max<std::uint64_t>(std::uint64_t(1) << 18, extent * after));
    const std::uint64_t rows = want / after, along = std::min(extent, rows);  // indices of s a window covers
    const std::uint64_t w =
        along > 0 && after <= (std::uint64_t(1) << 20) && rows * after / along <= (std::uint64_t(1) << 20)
            ? rows * after
            : std::uint64_t(1) << 18;
    permuted = permuted == 0 ? w : std::min(permuted, w);
  });
  const std::uint64_t by_runs = shortest >= (std::uint64_t(1) << 44) ? n : std::max<std::uint64_t>(1, shortest) << 20;
  const std::uint64_t per = std::max<std::uint64_t>(1, std::min({cap, by_runs, permuted == 0 ? by_runs : permuted}));
  std::vector<std::byte> buf(static_cast<std::size_t>(std::min(n, per) * item));
  load_options lo = opt.load;
  lo.list_unexpected = false;  // a window at a time
  for (std::uint64_t a = 0; a < n; a += per) {
    const std::uint64_t b = std::min(n, a + per);
    flat_view v{key, tm->type, tm->shape, shard_spec(flat_spec{{a, b}}), buf.data(), (b - a) * item};
    stats.add_reads(shardsafe::load(r, std::span<const flat_view>(&v, 1), lo));
    f(std::span<const std::byte>(buf.data(), static_cast<std::size_t>((b - a) * item)), a * item);
  }
  return stats;
}

/// Calls f(key, bytes, byte_offset) for the chunks of each full tensor of keys, in that order,
/// as for_each_full_chunk does for one; tensors of at most 1 MiB (and the chunk size) are
/// loaded many at once, up to opt.chunk_bytes a load, so that a checkpoint of many small
/// tensors costs a few loads, whose reads the backend merges (over HTTP or S3, a request per
/// part, not one per tensor: 20,000 storages of a torch.save file were 20,000 requests).
/// Returns the reads made.
template <ReadableDirectory D, class F>
load_stats for_each_full_tensor(checkpoint_reader<D>& r, std::span<const std::string> keys, F&& f,
                                const unshard_options& opt = {}) {
  load_stats stats;
  const std::uint64_t small =
      std::min<std::uint64_t>(std::uint64_t(1) << 20, std::max<std::uint64_t>(opt.chunk_bytes, 1));
  std::vector<const std::string*> pending;
  std::vector<flat_view> views;
  std::uint64_t used = 0;
  load_options lo = opt.load;
  lo.list_unexpected = false;  // a batch at a time
  auto flush = [&] {
    if (pending.empty()) return;
    std::vector<std::byte> buf(static_cast<std::size_t>(used));  // freed before a large tensor's chunks
    std::uint64_t at = 0;
    for (auto& v : views) {
      v.data = buf.data() + at;
      at += v.nbytes;
    }
    stats.add_reads(shardsafe::load(r, std::span<const flat_view>(views), lo));
    at = 0;
    for (std::size_t i = 0; i < pending.size(); ++i) {
      f(*pending[i], std::span<const std::byte>(buf.data() + at, static_cast<std::size_t>(views[i].nbytes)),
        std::uint64_t(0));
      at += views[i].nbytes;
    }
    pending.clear();
    views.clear();
    used = 0;
  };
  for (const std::string& key : keys) {
    const tensor_metadata* tm = r.find(key);
    const std::uint64_t bytes = tm && is_byte_sized(tm->type) ? tm->numel() * item_size(tm->type) : 0;
    // absent, sub-byte, empty or large, or a grid (its files are opened and checked before a
    // plan lists its parts: a million for 300 bytes of metadata.json): on its own
    if (bytes == 0 || bytes > small || tm->grid) {
      flush();
      stats.add_reads(
          for_each_full_chunk(r, key, [&](std::span<const std::byte> b, std::uint64_t at) { f(key, b, at); }, opt));
      continue;
    }
    if (used + bytes > std::max<std::uint64_t>(opt.chunk_bytes, small)) flush();
    pending.push_back(&key);
    views.push_back({key, tm->type, tm->shape, shard_spec(flat_spec{{0, tm->numel()}}), nullptr, bytes});
    used += bytes;
  }
  flush();
  return stats;
}

/// Loads the full tensor `key` into out (numel * itemsize bytes); by default with the checksums
/// the checkpoint records checked (as unshard_options).
template <ReadableDirectory D>
void unshard_tensor(checkpoint_reader<D>& r, const std::string& key, std::span<std::byte> out,
                    const load_options& opt = load_options{.verify_checksums = true}) {
  const tensor_metadata* tm = r.find(key);
  if (!tm) fail(errc::not_found, std::string(r.directory().name()) + ": tensor '" + key + "' is not in the checkpoint");
  flat_view v{key, tm->type, tm->shape, std::nullopt, out.data(), out.size()};
  load_options lo = opt;
  lo.list_unexpected = false;  // nothing returns them; a caller unsharding tensor by tensor would pay N^2
  shardsafe::load(r, std::span<const flat_view>(&v, 1), lo);
}

/// One source of full tensors for unshard_to_safetensors: a checkpoint and a name prefix.
template <ReadableDirectory D>
struct unshard_source {
  checkpoint_reader<D>* reader;
  std::string prefix;  ///< prepended to every tensor name in the output ("" or "model/")
};

namespace detail {
/// Every tensor of the sources is covered by its files (errc::missing_coverage naming the first
/// gap) and its files exist with valid headers holding it: checked before an output is sized or
/// written, so that metadata claiming a tensor of terabytes that no file holds costs nothing.
/// What the output cannot hold is refused, not left out: a tensor of a dtype shardsafe has no
/// type for, and a non-tensor item whose value holds tensors (checkpoint_files::check_objects).
template <ReadableDirectory D>
void require_unshardable(std::span<const unshard_source<D>> sources) {
  for (const auto& s : sources) s.reader->check_all_readable();
  for (const auto& s : sources)
    for (const auto& [key, tm] : s.reader->metadata().tensors) {
      if (tm.grid) {  // its parts tile the tensor (validate): each file is checked, none listed
        for_each_file_opened(*s.reader, key, tm, [](const auto&...) {});
        continue;
      }
      std::vector<shard_spec> specs;
      const auto& files = tm.files;
      specs.reserve(files.size());
      for (const auto& [fname, spec] : files) {
        s.reader->entry_in(s.reader->file(fname), key, tm, spec);
        specs.push_back(spec);
      }
      fail_unless_whole(first_gap_in_whole(std::span<const shard_spec>(specs), tm.shape), s.reader->directory().name(),
                        key, tm.shape);
    }
}
}  // namespace detail

/// Writes the full tensors of the sources into one safetensors file, chunk by chunk (after
/// checking that every tensor is covered: nothing is sized or written before).
template <ReadableDirectory D, RandomAccessWritableStorage W>
std::uint64_t unshard_to_safetensors(std::span<const unshard_source<D>> sources, W& out,
                                     const unshard_options& opt = {},
                                     const std::map<std::string, std::string>& metadata = {}) {
  detail::require_unshardable(sources);
  std::vector<tensor_entry> entries;
  for (const auto& s : sources)
    for (const auto& [key, tm] : s.reader->metadata().tensors)
      entries.push_back({s.prefix + key, tm.type, tm.shape, 0, 0});
  auto layout = plan_safetensors(std::move(entries), metadata, out.name());
  if constexpr (requires { out.reserve(std::uint64_t{}); }) out.reserve(layout.file_size());
  safetensors_writer<W> w(out, layout);
  for (const auto& s : sources) {
    std::vector<std::string> keys;
    for (const auto& [key, tm] : s.reader->metadata().tensors) keys.push_back(key);
    for_each_full_tensor(
        *s.reader, std::span<const std::string>(keys),
        [&](const std::string& key, std::span<const std::byte> bytes, std::uint64_t at) {
          w.write_part(layout.index_of(s.prefix + key), at, bytes);
        },
        opt);
  }
  w.finish();
  return layout.file_size();
}

/// The same file through a writer that takes whole blocks (an S3 multipart upload): every
/// block is filled from the header and the elements of the tensors it crosses, read from the
/// sources; the object is committed at the end, or aborted when anything fails.
template <ReadableDirectory D, BlockWritableStorage W>
  requires(!RandomAccessWritableStorage<W>)
std::uint64_t unshard_to_safetensors(std::span<const unshard_source<D>> sources, W& out,
                                     const unshard_options& opt = {},
                                     const std::map<std::string, std::string>& metadata = {}) {
  struct origin {
    checkpoint_reader<D>* reader;
    std::string key;
  };
  std::vector<tensor_entry> entries;
  std::vector<std::pair<std::string, origin>> origins;  // output name, where it comes from
  for (const auto& s : sources)
    for (const auto& [key, tm] : s.reader->metadata().tensors) {
      require_byte_sized(tm.type, std::string(s.reader->directory().name()) + ": tensor '" + key + "'");
      entries.push_back({s.prefix + key, tm.type, tm.shape, 0, 0});
      origins.push_back({s.prefix + key, {s.reader, key}});
    }
  const safetensors_layout layout = plan_safetensors(std::move(entries), metadata, out.name());
  detail::require_unshardable(sources);
  std::vector<const origin*> of(layout.tensors.size());
  for (const auto& [n, o] : origins) of[layout.index_of(n)] = &o;
  load_options lo = opt.load;
  lo.threads = 1;              // blocks are the parallelism
  lo.list_unexpected = false;  // a block at a time
  block_write_options bo;
  bo.block_bytes = std::max<std::uint64_t>(opt.chunk_bytes, 1);
  detail::abort_on_failure(out, [&] {
    out.write_blocks(
        layout.file_size(),
        [&](std::uint64_t off, std::span<std::byte> dst) {
          detail::fill_layout_block(layout, off, dst, [&](std::span<const detail::layout_piece> pieces) {
            detail::load_pieces(
                pieces, [&](std::size_t idx) { return of[idx]->reader; },
                [&](const detail::layout_piece& p) {
                  const tensor_entry& e = layout.tensors[p.idx];
                  return flat_view{of[p.idx]->key, e.type,
                                   e.shape,        shard_spec(flat_spec{{p.first, p.first + p.n}}),
                                   p.bytes.data(), p.bytes.size()};
                },
                lo);
          });
        },
        bo);
    out.sync();
    out.commit();
  });
  return layout.file_size();
}

}  // namespace shardsafe
