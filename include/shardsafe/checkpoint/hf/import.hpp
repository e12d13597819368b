// shardsafe/checkpoint/hf/import.hpp - a Hugging Face folder (or any checkpoint a
// checkpoint_reader reads) imported into this rank's flat views, collectively over a Comm.
//
// Names are mapped first (checkpoint/hf/import_keys.hpp: rename rules, LoRA base layers, tied
// views, missing / unexpected keys, strict mode; stacked expert weights fed by per-expert
// tensors, checkpoint/hf/experts.hpp). Then the bytes move in one of two ways:
//
// | mode            | who reads                          | memory per rank            | traffic        |
// |-----------------|------------------------------------|----------------------------|----------------|
// | every_rank_read | every rank: only the byte ranges of | one read's staging (loader)| ~1x the weights|
// |                 | its own shards (checkpoint_reader)  |                            | over all ranks |
// | rank0_broadcast | rank 0 alone, each tensor chunk by  | one chunk (chunk_bytes)    | each chunk to  |
// |                 | chunk; Comm::broadcast_bytes sends  |                            | every rank     |
// |                 | it, every rank keeps its slice      |                            |                |
//
// every_rank_read suits a local or parallel filesystem; rank0_broadcast suits storage that
// many clients read slowly (one reader, the interconnect does the rest). automatic (the
// default) picks: every_rank_read when every rank runs on one host (one page cache, no
// interconnect to spare: hostname and network namespace alike), else by what it measures -
// each rank reads probe_bytes of the largest tensor at once with the others, rank 0 reads as
// many again alone (the next ones, where the tensor has them) and broadcasts them, and the
// mode whose estimate is smaller wins (every_rank_read: the slowest rank's share at the rate
// it read with the others; rank0_broadcast: everything at rank 0's rate alone, then at the
// slowest rank's broadcast rate). Every rank decides from the same all-gathered figures, so
// all pick alike; hf_import_stats says which and why. The readers the probe opened serve the
// import. In rank0_broadcast,
// rank 0 first broadcasts the tensor table (names, dtypes, shapes), so every rank maps names
// and checks its views without opening anything; a tensor is sent only when some rank needs
// it, and each rank copies out of each chunk the overlap of its spec with the chunk's flat
// range (compute_copy_plan), converting dtype while copying. A Comm with
// `broadcast_buffer(std::span<std::byte>, root)` (c10d_comm) receives straight into the chunk
// buffer; any other uses broadcast_bytes.
//
// Both modes convert F16/BF16/F32/F64 on the fly by default (load_options::convert_dtypes,
// rounding to nearest even), and never allocate a tensor- or file-sized buffer.
//
// Errors agree across ranks (dist/agree.hpp): a bad file, a view that does not fit, a strict
// import with missing keys, on any rank, is thrown on every rank with its code and the failing
// rank's message (naming folder, tensor and rule); no rank is left waiting in a collective.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/hf/import_keys.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/replica_reads.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/shard/copy_plan.hpp"

namespace shardsafe {

/// How the bytes of an import move (table at the top).
enum class hf_import_mode { every_rank_read, rank0_broadcast, automatic };

constexpr std::string_view to_string(hf_import_mode m) noexcept {
  return m == hf_import_mode::every_rank_read   ? "every_rank_read"
         : m == hf_import_mode::rank0_broadcast ? "rank0_broadcast"
                                                : "automatic";
}
[[deprecated("use to_string(hf_import_mode)")]] constexpr std::string_view name(hf_import_mode m) noexcept {
  return to_string(m);
}

/// How an import reads: threads and read merging (load_options' own), for every_rank_read's
/// reads and rank 0's chunks. Strictness and dtype conversion are hf_key_options::strict and
/// ::convert_dtypes (an import has one of each, not two).
struct hf_import_reads {
  unsigned threads = 0;   ///< reads in flight (0: the backend's hint, else the default)
  read_settings reads{};  ///< gap merging, read sizes, requests in flight
};

struct hf_import_options : hf_key_options {
  hf_import_mode mode = hf_import_mode::automatic;
  std::uint64_t chunk_bytes = std::uint64_t(64) << 20;  ///< rank0_broadcast: bytes per broadcast
  std::uint64_t probe_bytes = std::uint64_t(8) << 20;   ///< automatic: bytes read and broadcast to measure
  hf_import_reads load{};
};

namespace detail {
/// The load_options an import reads with: its read settings, strict (the import has checked
/// every key itself), converting as `convert` says.
inline load_options import_load_options(const hf_import_reads& r, bool convert) {
  load_options lo;
  lo.threads = r.threads;
  lo.reads = r.reads;
  lo.strict = true;
  lo.convert_dtypes = convert;
  lo.list_unexpected = false;  // the import's own mapping lists them (hf_key_mapping); its chunks load one at a time
  return lo;
}
}  // namespace detail

struct hf_import_stats {
  hf_key_mapping keys;                ///< loads, missing / unexpected / dropped keys (this rank's views)
  std::string message;                ///< describe(keys): counts and a few examples of each
  load_stats stats;                   ///< this rank's reads (rank0_broadcast: only rank 0 reads)
  std::uint64_t bytes_broadcast = 0;  ///< rank0_broadcast: tensor bytes every rank received
  double seconds = 0;
  hf_import_mode mode = hf_import_mode::every_rank_read;  ///< the mode used (automatic's pick)
  std::string why;                                        ///< automatic: what decided it
};

namespace detail {

/// The tensor table rank 0 broadcasts, a message (dist/message.hpp): items(tensors), then per
/// tensor its name, dtype (its index in all_dtypes) and counts(shape).
inline std::string encode_tensor_table(const checkpoint_metadata& md) {
  message_writer m;
  m.count(md.tensors.size());
  for (const auto& [key, tm] : md.tensors) m.text(key).count(static_cast<std::uint64_t>(tm.type)).counts(tm.shape);
  return std::move(m).str();
}

/// Reads what encode_tensor_table wrote; ctx (the folder) names it in errc::comm_error.
inline std::vector<hf_tensor_info> decode_tensor_table(std::string_view s, std::string_view ctx) {
  message_reader m(s, std::string(ctx) + " (rank 0's tensor table)");
  std::vector<hf_tensor_info> out(static_cast<std::size_t>(m.items(24, "tensors")));  // name, dtype, ndim
  for (auto& t : out) {
    t.name = m.text();
    t.type = static_cast<dtype>(m.count(all_dtypes.size() - 1, "tensor '" + t.name + "''s dtype"));
    t.shape = m.counts();
  }
  m.finish();
  return out;
}

/// Copies the part of chunk [a, b) (elements of the full tensor, stored as `stored`) that v
/// holds into v's memory, converting to v's dtype.
inline void scatter_chunk(const flat_view& v, dtype stored, std::span<const std::byte> chunk, std::uint64_t a,
                          std::uint64_t b) {
  const std::uint64_t si = item_size(stored), di = item_size(v.type);
  const copy_plan runs = compute_copy_plan(v.effective_spec(), flat_spec{{a, b}}, v.full_shape);
  for (const auto& r : runs) {
    const std::byte* src = chunk.data() + r.src * si;
    std::byte* dst = v.data + r.dst * di;
    if (stored == v.type)
      std::memcpy(dst, src, static_cast<std::size_t>(r.len * si));
    else
      convert_elements(stored, {src, static_cast<std::size_t>(r.len * si)}, v.type,
                       {dst, static_cast<std::size_t>(r.len * di)});
  }
}

template <class C>
concept buffer_broadcaster = requires(C& c, std::span<std::byte> b) { c.broadcast_buffer(b, 0); };

/// reader: this rank's, when one is open already (automatic's probe), else opened here.
template <ReadableDirectory D, Comm C>
void import_every_rank_read(const D& dir, std::span<const flat_view> views, C& comm, const hf_import_options& opt,
                            hf_import_stats& res, std::optional<checkpoint_reader<D>>& reader) {
  every_rank_step(comm, [&] {
    if (!reader) reader.emplace(dir);
    std::vector<hf_tensor_info> table;
    for (const auto& [key, tm] : reader->metadata().tensors) table.push_back({key, tm.type, tm.shape});
    res.keys = map_hf_keys(views, table, opt, dir.name());
    std::vector<flat_view> renamed;  // the views to load, under the checkpoint's names
    renamed.reserve(res.keys.loads.size());
    for (const auto& e : res.keys.loads) {
      check_hf_import_entry(views[e.view], table[e.tensor], e, opt.convert_dtypes, dir.name());
      renamed.push_back(views[e.view]);
      renamed.back().key = table[e.tensor].name;
    }
    const load_options lo = import_load_options(opt.load, opt.convert_dtypes);
    res.stats = shardsafe::load(*reader, std::span<const flat_view>(renamed), lo);
    res.stats.unexpected_keys.clear();  // the loader's view of it; keys.unexpected_keys is the import's
  });
}

/// reader: rank 0's, when one is open already (automatic's probe), else opened here; only
/// rank 0 reads.
template <ReadableDirectory D, Comm C>
void import_rank0_broadcast(const D& dir, std::span<const flat_view> views, C& comm, const hf_import_options& opt,
                            hf_import_stats& res, std::optional<checkpoint_reader<D>>& reader) {
  const step_scope step("rank 0 reading and broadcasting");
  const bool root = comm.rank() == 0;
  const std::string table_bytes = rank0_step(comm, [&] {
    if (!reader) reader.emplace(dir);
    return encode_tensor_table(reader->metadata());
  });
  std::vector<hf_tensor_info> table;
  // map and check on every rank; each says which tensors it needs
  const std::vector<std::string> needs = every_rank_step(comm, [&] {
    table = decode_tensor_table(table_bytes, dir.name());
    res.keys = map_hf_keys(views, table, opt, dir.name());
    std::string mine(table.size(), '\0');
    for (const auto& e : res.keys.loads) {
      check_hf_import_entry(views[e.view], table[e.tensor], e, opt.convert_dtypes, dir.name());
      mine[e.tensor] = 1;
    }
    return mine;
  });
  std::vector<std::vector<std::size_t>> loads_of(table.size());  // tensor -> my loads
  for (std::size_t i = 0; i < res.keys.loads.size(); ++i) loads_of[res.keys.loads[i].tensor].push_back(i);

  const load_options lo = import_load_options(opt.load, false);
  std::string buf;
  std::exception_ptr deferred;  // a failure while copying: reported once every chunk has gone by
  for (std::size_t t = 0; t < table.size(); ++t) {
    bool anyone = false;
    for (const auto& n : needs) anyone = anyone || (n.size() == table.size() && n[t]);
    if (!anyone) continue;
    const hf_tensor_info& info = table[t];
    const std::uint64_t item = std::max<std::uint64_t>(1, item_size(info.type));
    const std::uint64_t n = numel(info.shape), per = std::max<std::uint64_t>(1, opt.chunk_bytes / item);
    for (std::uint64_t a = 0; a < n; a += per) {
      const std::uint64_t b = std::min(n, a + per), len = (b - a) * item;
      rank0_step(comm, [&] {
        buf.resize(static_cast<std::size_t>(len));
        flat_view cv{
            info.name, info.type, info.shape, shard_spec(flat_spec{{a, b}}), reinterpret_cast<std::byte*>(buf.data()),
            len};
        res.stats.add_reads(shardsafe::load(*reader, std::span<const flat_view>(&cv, 1), lo));
      });
      detail::exchange_in_scope([&] {
        if constexpr (buffer_broadcaster<C>) {
          if (!root) buf.resize(static_cast<std::size_t>(len));
          comm.broadcast_buffer(std::as_writable_bytes(std::span<char>(buf)), 0);
        } else {
          comm.broadcast_bytes(buf, 0);
        }
      });
      res.bytes_broadcast += len;
      if (deferred) continue;
      try {
        if (buf.size() != len)
          fail(errc::comm_error, std::string(dir.name()) + ": tensor '" + info.name + "': a chunk of " +
                                     std::to_string(len) + " bytes arrived as " + std::to_string(buf.size()));
        const std::span<const std::byte> chunk = std::as_bytes(std::span<const char>(buf));
        for (std::size_t i : loads_of[t]) scatter_chunk(views[res.keys.loads[i].view], info.type, chunk, a, b);
      } catch (...) {
        deferred = std::current_exception();
      }
    }
  }
  res.stats.tensors = res.keys.loads.size();
  every_rank_step(comm, [&] {
    if (deferred) std::rethrow_exception(deferred);
  });
}

/// hf_import_mode::automatic's pick (top of this header); res.why says what decided it.
/// reader: left open for the import (every rank's, when it measured).
template <ReadableDirectory D, Comm C>
hf_import_mode pick_import_mode(const D& dir, std::span<const flat_view> views, C& comm, const hf_import_options& opt,
                                hf_import_stats& res, std::optional<checkpoint_reader<D>>& reader) {
  const step_scope step("choosing how to import");
  if (every_rank_on_one_host(comm)) {
    res.why = "every rank runs on one host";
    return hf_import_mode::every_rank_read;
  }
  // each rank: its share (the bytes of its views) and how long it took to read the probe, at
  // once with the others; then rank 0's alone (how fast it reads when it is the only reader);
  // figures travel as counts (bytes, nanoseconds: dist/message.hpp)
  std::string probe;
  std::uint64_t total = 0;
  std::optional<flat_view> cv;
  auto timed_read = [&] {  // nanoseconds
    const auto t0 = std::chrono::steady_clock::now();
    shardsafe::load(*reader, std::span<const flat_view>(&*cv, 1), import_load_options(opt.load, false));
    return elapsed_ns(t0);
  };
  const auto figures = every_rank_step(comm, [&] {
    reader.emplace(dir);
    const std::pair<std::string, tensor_metadata>* big = nullptr;
    for (const auto& t : reader->metadata().tensors) {
      total += t.second.numel() * bit_size(t.second.type) / 8;
      if (is_byte_sized(t.second.type) &&
          (!big || t.second.numel() * item_size(t.second.type) > big->second.numel() * item_size(big->second.type)))
        big = &t;
    }
    std::uint64_t share = 0, ns = 0;
    for (const auto& v : views) share += v.nbytes;
    if (big) {
      const std::uint64_t item = item_size(big->second.type);
      const std::uint64_t n = std::min(big->second.numel(), std::max<std::uint64_t>(1, opt.probe_bytes / item));
      probe.resize(static_cast<std::size_t>(n * item));
      cv.emplace(flat_view{big->first, big->second.type, big->second.shape, shard_spec(flat_spec{{0, n}}),
                           reinterpret_cast<std::byte*>(probe.data()), n * item});
      comm.barrier();
      ns = timed_read();
    }
    return message_writer().count(share).count(probe.size()).count(ns).str();
  });
  // rank 0 alone reads the probe's next bytes where the tensor has them (not a cache's copy of the first)
  const std::string alone = rank0_step(comm, [&] {
    if (cv) {
      const std::uint64_t n = cv->local_numel(), all = numel(cv->full_shape);
      if (all >= 2 * n) cv->spec = shard_spec(flat_spec{{n, 2 * n}});
    }
    return message_writer().count(cv ? timed_read() : 0).str();
  });
  const std::uint64_t alone_ns = message_reader(alone, "rank 0's probe alone").count();
  // each rank's broadcast time: rank 0 sends what it read
  std::uint64_t got_ns = 0;
  detail::exchange_in_scope([&] {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    comm.broadcast_bytes(probe, 0);
    got_ns = elapsed_ns(t0);
  });
  const auto bcast = every_rank_step(comm, [&] { return message_writer().count(got_ns).str(); });
  auto rate = [](std::uint64_t bytes, std::uint64_t ns) { return ns > 0 ? double(bytes) * 1e9 / double(ns) : 0.0; };
  double every = 0, slowest_bcast = 0, read0 = 0;
  for (std::size_t r = 0; r < figures.size(); ++r) {
    message_reader m(figures[r], "rank " + std::to_string(r) + "'s probe");
    const std::uint64_t share = m.count(), bytes = m.count(), ns = m.count();
    m.finish();
    const double rr = rate(bytes, ns);
    every = std::max(every, rr > 0 ? double(share) / rr : 0.0);
    if (r == 0) read0 = rate(bytes, alone_ns);
    const double b = rate(bytes, message_reader(bcast[r], "rank " + std::to_string(r) + "'s broadcast").count());
    if (r > 0) slowest_bcast = slowest_bcast == 0 ? b : std::min(slowest_bcast, b);
  }
  const double broadcast =
      (read0 > 0 ? double(total) / read0 : 0.0) + (slowest_bcast > 0 ? double(total) / slowest_bcast : 0.0);
  std::ostringstream why;
  why.precision(3);
  why << "estimated every_rank_read " << every << " s, rank0_broadcast " << broadcast << " s (rank 0 alone reads "
      << read0 / 1e6 << " MB/s; the slowest rank receives " << slowest_bcast / 1e6 << " MB/s)";
  res.why = why.str();
  return broadcast < every ? hf_import_mode::rank0_broadcast : hf_import_mode::every_rank_read;
}

}  // namespace detail

/// Imports the checkpoint in dir into this rank's views (every rank calls it, each with its
/// own views and the same options). With opt.experts, the views those rules stack are split
/// into per-expert views first (checkpoint/hf/experts.hpp) and `keys` speaks of those. Views nothing feeds are left as they are (listed in
/// keys.missing_keys; an error with opt.strict). Throws, on every rank alike, the first
/// failure of any rank (see the top of this header).
template <ReadableDirectory D, Comm C>
hf_import_stats import_hf(const D& dir, std::span<const flat_view> views, C& comm, const hf_import_options& opt = {}) {
  const step_scope scope("import " + std::string(dir.name()));
  const auto t0 = std::chrono::steady_clock::now();
  hf_import_stats res;
  if (!opt.experts.empty()) {  // stacked experts: import into per-expert views of their memory
    unstacked_views u;
    every_rank_step(comm, [&] { u = unstack_experts(views, opt.experts, dir.name()); });
    hf_import_options per_expert = opt;
    per_expert.experts = expert_stacking{};
    res = import_hf(dir, std::span<const flat_view>(u.views), comm, per_expert);
    std::erase_if(res.keys.unexpected_keys, [&](const std::string& k) {  // other ranks' experts
      const std::string model_key = opt.rename.apply(k);
      return std::binary_search(u.elsewhere.begin(), u.elsewhere.end(), model_key);
    });
    res.message = describe(res.keys, opt.examples);
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    res.stats.seconds = res.seconds;
    return res;
  }
  std::optional<checkpoint_reader<D>> reader;  // automatic's probe opens it; the import reads through it
  res.mode =
      opt.mode == hf_import_mode::automatic ? detail::pick_import_mode(dir, views, comm, opt, res, reader) : opt.mode;
  if (res.mode == hf_import_mode::rank0_broadcast)
    detail::import_rank0_broadcast(dir, views, comm, opt, res, reader);
  else
    detail::import_every_rank_read(dir, views, comm, opt, res, reader);
  res.message = describe(res.keys, opt.examples);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.stats.seconds = res.seconds;
  return res;
}

}  // namespace shardsafe
