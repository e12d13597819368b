// shardsafe/checkpoint/hf/export_views.hpp - a Hugging Face folder (docs/FORMAT.md §3) written
// straight from a running job's flat views: every rank writes its own shard's bytes into the
// final files at their computed offsets. No gather to one rank, no consolidation pass, no second
// copy of the model.
//
// REQUIRES A SHARED FILE SYSTEM: every rank opens and writes the same files under out_dir (NFS,
// Lustre, GPFS, a local disk for ranks on one machine). This is the POSIX file backend only.
//
// The protocol (each step agreed by all ranks, dist/agree.hpp, so a failure anywhere is thrown
// everywhere and nobody is left waiting in a collective):
//   1. the ranks agree on their views' names, shapes, dtypes and shard specs as a DCP save does
//      (checkpoint/dcp_save.hpp's agree_dcp: one shape and dtype per key, every sharded tensor
//      covered, and who writes a shard ranks repeat): over a PeerComm up the tree of ranks
//      (O(tensors) a rank: each learns every tensor's name, shape, dtype, sharded-ness and,
//      unsharded, its lowest holder, and which of its shards a lower rank writes), else
//      all-gathered; every rank then computes the same export plan from that alone
//      (plan_hf_export_layout: renames, dtype, packing, every file's header and offsets);
//   2. rank 0 checks out_dir is absent or empty, creates it, and creates every output file as a
//      file_writer (storage/file.hpp: under a temporary name, broadcast; each rank finds it in
//      its own out_dir), at its full size, with its header;
//   3. every rank writes the bytes of its shards (converted when asked) at their offsets through
//      file_part_writers of those files: its spec's runs against the whole tensor's flat layout
//      (compute_copy_plan of the whole tensor against its spec); a tensor that is not sharded,
//      and a shard ranks repeat without replica roles, is written by the lowest rank holding it
//      only, a replica by its writer (dcp_writes); then fdatasync;
//   4. rank 0 commits every file_writer (rename into place, folder fsynced) and writes
//      model.safetensors.index.json last (for more than one file).
// A failure in 2 or 3 leaves no file behind (rank 0's file_writers remove the temporaries). The files are
// byte for byte those export_to (checkpoint/hf/export.hpp) writes from a checkpoint of the same
// tensors with the same options.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "shardsafe/checkpoint/dcp_save.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/storage/file.hpp"

namespace shardsafe {

namespace detail {

/// Step 2 on rank 0: the folder and every file at full size with its header, as file_writers
/// (committed in step 4; destroyed uncommitted, they remove their temporaries). Returns their
/// temporaries' file names, '\0'-separated, in file order (each rank finds them in its own
/// out_dir: ranks on other machines may mount the shared folder elsewhere).
inline std::string create_export_files(const std::filesystem::path& dir, const hf_export_layout& l,
                                       std::vector<file_writer>& writers) {
  detail::require_empty_output(file_directory(dir));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw error(ec, dir.string() + ": create directory: " + ec.message());
  std::string temps;
  for (std::size_t f = 0; f < l.files.size(); ++f) {
    file_writer& w = writers.emplace_back(dir / l.plan.files[f].name);
    w.reserve(l.files[f].file_size());
    w.write_at(0, std::as_bytes(std::span(l.files[f].header)));
    temps += std::filesystem::path(w.temp_path()).filename().string();
    temps += '\0';
  }
  return temps;
}

/// One pwrite of step 3: n elements of a view from element `src`, at byte `at` of file `file`.
struct export_piece {
  std::size_t file;
  std::uint64_t at;
  const flat_view* view;
  std::uint64_t src, n;
  dtype out;
};

/// Step 3 on every rank: this rank's pieces written and synced. Returns the bytes written.
inline std::uint64_t write_export_shards(const std::filesystem::path& dir, const hf_export_layout& l,
                                         std::span<const std::string> temps, std::span<const flat_view> views,
                                         const agreed_description& agreed, int rank, const hf_export_options& opt) {
  const checkpoint_metadata& md = agreed.md;
  std::map<std::string, std::size_t> plan_index;  // input name -> plan tensor
  for (std::size_t t = 0; t < l.source.size(); ++t) plan_index.emplace(md.tensors[l.source[t]].first, t);
  std::vector<std::size_t> file_of(l.plan.tensors.size());
  for (std::size_t f = 0; f < l.plan.files.size(); ++f)
    for (std::size_t t : l.plan.files[f].tensors) file_of[t] = f;
  std::vector<export_piece> pieces;
  for (const flat_view& v : views) {
    auto it = plan_index.find(v.key);
    if (it == plan_index.end()) continue;  // dropped by a rename rule
    const tensor_metadata* tm = md.find(v.key);
    if (!dcp_writes(v, *tm, rank, agreed)) continue;  // its writer replica, or a lower rank, writes it
    const std::size_t f = file_of[it->second];
    const safetensors_layout& layout = l.files[f];
    const tensor_entry& e = layout.tensors[layout.index_of(l.plan.tensors[it->second].name)];
    const std::uint64_t oi = item_size(e.type), ii = item_size(v.type);
    const std::uint64_t per = std::max<std::uint64_t>(1, opt.chunk_bytes / std::max(oi, ii));
    const copy_plan runs = compute_copy_plan(shard_spec(flat_spec{{0, tm->numel()}}), v.effective_spec(), tm->shape);
    for (const copy_run& r : runs)
      for (std::uint64_t k = 0; k < r.len; k += per)
        pieces.push_back(
            {f, layout.data_start() + e.begin + (r.dst + k) * oi, &v, r.src + k, std::min(per, r.len - k), e.type});
  }
  std::vector<std::optional<file_part_writer>> out(l.files.size());
  for (const auto& p : pieces)
    if (!out[p.file]) out[p.file].emplace((dir / temps[p.file]).string(), (dir / l.plan.files[p.file].name).string());
  std::uint64_t written = 0;
  for (const auto& p : pieces) written += p.n * item_size(p.out);
  parallel_for(pieces.size(), opt.threads, [&](std::size_t i) {
    const export_piece& p = pieces[i];
    const std::uint64_t ii = item_size(p.view->type);
    const std::span<const std::byte> src(p.view->data + p.src * ii, static_cast<std::size_t>(p.n * ii));
    if (p.out == p.view->type) {
      out[p.file]->write_at(p.at, src);
      return;
    }
    std::vector<std::byte> buf(static_cast<std::size_t>(p.n * item_size(p.out)));
    convert_elements(p.view->type, src, p.out, buf);
    out[p.file]->write_at(p.at, buf);
  });
  for (auto& w : out)
    if (w) w->finish();
  return written;
}

}  // namespace detail

/// Writes every rank's views as one Hugging Face folder at out_dir (protocol at the top). A
/// collective: every rank calls it with its own views. options.model_only and direct_io do not
/// apply; threads and chunk_bytes bound each rank's writes (one conversion buffer of chunk_bytes
/// per thread). With options.experts, the views those rules stack are split into per-expert
/// views of their memory first (checkpoint/hf/experts.hpp; the rename rules then apply to the
/// per-expert names): one Hugging Face tensor per expert, each rank writing its own slices.
template <Comm C>
hf_export_stats export_to(std::span<const flat_view> views, C& comm, const std::filesystem::path& out_dir,
                          const hf_export_options& opt) {
  if (!opt.experts.empty()) {
    unstacked_views u;
    every_rank_step(comm, [&] { u = unstack_experts(views, opt.experts, out_dir.string()); });
    hf_export_options per_expert = opt;
    per_expert.experts = expert_stacking{};
    return export_to(std::span<const flat_view>(u.views), comm, out_dir, per_expert);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string dname = out_dir.string();
  const detail::agreed_description agreed = detail::agree_dcp(views, comm, dname);  // 1
  const checkpoint_metadata& md = agreed.md;
  hf_export_layout l;
  every_rank_step(comm, [&] {
    std::vector<hf_export_input> inputs;
    for (const auto& [key, tm] : md.tensors) inputs.push_back({key, tm.type, tm.shape});
    l = plan_hf_export_layout(inputs, opt, dname);
  });
  std::vector<file_writer> writers;  // rank 0's, from step 2 to step 4
  const std::string joined = rank0_step(comm, [&] { return detail::create_export_files(out_dir, l, writers); });  // 2
  std::vector<std::string> temps;
  for (std::size_t at = 0, z; (z = joined.find('\0', at)) != std::string::npos; at = z + 1)
    temps.push_back(joined.substr(at, z - at));
  every_rank_step(comm, [&] { detail::write_export_shards(out_dir, l, temps, views, agreed, comm.rank(), opt); });  // 3
  rank0_step(comm, [&] {                                                                                            // 4
    for (file_writer& w : writers) w.commit();
    if (l.plan.indexed()) write_text(file_directory(out_dir), hf_index_file, l.plan.index_json());
  });
  hf_export_stats st;
  st.files = l.files.size();
  st.tensors = l.plan.tensors.size();
  st.bytes = l.bytes;
  st.indexed = l.plan.indexed();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// (the export's name before issue 52)
template <Comm C>
[[deprecated(
    "export_hf_from_views(out_dir, views, comm, opt) is shardsafe::export_to(views, comm, out_dir, opt) (CHANGELOG)")]]
hf_export_stats export_hf_from_views(const std::filesystem::path& out_dir, std::span<const flat_view> views, C& comm,
                                     const hf_export_options& opt = {}) {
  return export_to(views, comm, out_dir, opt);
}

}  // namespace shardsafe
