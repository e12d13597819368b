// shardsafe/checkpoint/hf/export.hpp - any checkpoint a checkpoint_reader reads (a sharded
// checkpoint, a Hugging Face folder, torch's DCP-sharded HF files) written out as a Hugging Face
// folder (docs/FORMAT.md §3; the tool's `to-hf`, §4).
//
// The export is planned from metadata alone, before any tensor byte is read:
//   1. every tensor of the sources, named `prefix + key`, is renamed by the rules (first match
//      wins; a key renamed to "" is dropped; two keys renamed alike are an error naming both; a
//      tensor with no name that no rule names, and rules that drop every tensor, are errors:
//      checkpoint/parts.hpp);
//      (with options.experts, a stacked expert tensor is first split into one tensor per
//      expert, checkpoint/hf/experts.hpp, and those are renamed);
//   2. its output dtype is options.convert_to for F16/BF16/F32/F64 tensors, its own otherwise
//      (integer, BOOL and F8 tensors are never converted); with options.dequantize, a quantized
//      weight (checkpoint/quant.hpp) is one tensor of its logical name and shape, of convert_to's
//      dtype or BF16, loaded dequantized, and its scales are not written;
//   3. format/hf_export.hpp packs the tensors, in name order, into files of at most
//      max_shard_size tensor bytes and names them; each file's header is rendered
//      (format/safetensors_writer.hpp, __metadata__ {"format": "pt"} as transformers writes).
// Then each file is produced in blocks of chunk_bytes: a block is the header's bytes and flat
// element ranges of the tensors it crosses, loaded by the checkpoint_reader straight into the
// block (converted while scattering, load_options::convert_dtypes; the checksums the sources
// record checked, verify_checksums), so memory is one block per writing thread whatever the
// tensor sizes. A BlockWritableStorage writer (file_directory's)
// gets the blocks through write_blocks (O_DIRECT where the file system allows it), any other
// through write_at. Each file is synced and committed (temporary name, rename) on its own;
// model.safetensors.index.json (only for more than one file) is written last. A failure aborts
// the file being written and removes those committed before it (the folder was empty).
//
// The output folder must not exist or be empty (errc::already_exists).
//
// hf/export_views.hpp writes the same files from a running job, every rank its own shard.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/hf/experts.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/parts.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/core/convert.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

struct hf_export_options {
  std::uint64_t max_shard_size = hf_default_max_shard_size;  ///< tensor bytes per file (5 GB)
  std::optional<dtype> convert_to;  ///< F16, BF16, F32 or F64: floating tensors converted (RNE)
  rename_rules rename;              ///< applied to every name (first match wins; "" drops)
  /// For a model + optimizer checkpoint (a folder with model/ and optim/): export model/ only
  /// (HF folders hold model weights). false: both, named `model/KEY` and `optim/KEY` before the
  /// rules apply, as `shardsafe unshard` names them.
  bool model_only = true;
  std::uint64_t chunk_bytes = std::uint64_t(16) << 20;  ///< memory per writing thread
  unsigned threads = 0;                                 ///< blocks in flight (0: detail::default_threads())
  bool direct_io = true;  ///< BlockWritableStorage writers bypass the page cache where they can
  std::map<std::string, std::string> file_metadata{{"format", "pt"}};  ///< each file's __metadata__
  /// Called as blocks are written, from one thread at a time, with the bytes written so far
  /// and the bytes of all the files (headers included).
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
  /// Stacked expert weights (checkpoint/hf/experts.hpp): a tensor `…experts.NAME` [E, ...]
  /// these rules match (by its name before renaming) is written as E tensors
  /// `…experts.{i}.NAME` [...], each read from its slice of the stacked tensor; the rename
  /// rules then apply to the per-expert names.
  expert_stacking experts;
  /// Quantized weights (checkpoint/quant.hpp, docs/FORMAT.md §8) written dequantized: each as one
  /// tensor under its logical name, of convert_to's dtype (BF16 where convert_to is not set), its
  /// scales left out. false: written as stored, scales and all (no dtype converts them).
  bool dequantize = false;
};

struct hf_export_stats {
  std::size_t files = 0;    ///< safetensors files written
  std::size_t tensors = 0;  ///< tensors written (dropped ones not counted)
  std::uint64_t bytes = 0;  ///< bytes of the safetensors files, headers included
  bool indexed = false;     ///< model.safetensors.index.json written
  double seconds = 0;
};

/// A tensor an export is planned from: its name before renaming, dtype and full shape.
struct hf_export_input {
  std::string name;
  dtype type = dtype::F32;
  shape_t shape;
};

/// An export's plan: the packing, where each output tensor comes from, and each file's layout.
struct hf_export_layout {
  hf_export_plan plan;                    ///< output names, sorted; files in order
  std::vector<std::size_t> source;        ///< plan.tensors[i] is inputs[source[i]], renamed
  std::vector<safetensors_layout> files;  ///< one per plan.files[f]: header and offsets
  std::uint64_t bytes = 0;                ///< sum of the files' sizes
};

/// Plans an export of `inputs` (steps 1-3 at the top). `out` names the output folder in file
/// names and messages. Throws errc::invalid_argument for a rename collision or convert_to that
/// is not F16/BF16/F32/F64, and what plan_hf_export and plan_safetensors throw.
SHARDSAFE_DECL hf_export_layout plan_hf_export_layout(const std::vector<hf_export_input>& inputs,
                                                      const hf_export_options& opt, std::string_view out);

namespace detail {

/// Fails with errc::already_exists unless dir is absent or empty.
template <ReadableDirectory D>
void require_empty_output(const D& dir) {
  if (!dir.list().empty())
    fail(errc::already_exists, std::string(dir.name()) + ": not empty; an export writes into a new or empty folder");
}

/// Writes one file of `size` bytes through w, in blocks that fill(off, dst) produces (above);
/// then syncs and commits it, or aborts it when anything fails.
/// `written` counts the bytes of all files so far, of `total`, for options.progress.
template <WritableStorage W, class Fill>
void write_export_file(W& w, std::uint64_t size, Fill&& fill, const hf_export_options& opt, std::uint64_t& written,
                       std::uint64_t total) {
  std::mutex progress_mutex;
  auto done = [&](std::uint64_t n) {
    std::lock_guard lock(progress_mutex);
    written += n;
    if (opt.progress) opt.progress(written, total);
  };
  abort_on_failure(w, [&] {
    if constexpr (BlockWritableStorage<W>) {
      block_write_options bo;
      bo.threads = opt.threads;
      bo.direct = opt.direct_io;
      bo.block_bytes = std::max<std::uint64_t>(opt.chunk_bytes, 1);
      w.write_blocks(
          size,
          [&](std::uint64_t off, std::span<std::byte> dst) {
            fill(off, dst);
            done(dst.size());
          },
          bo);
    } else {
      const std::uint64_t chunk = std::max<std::uint64_t>(opt.chunk_bytes, 1);
      if constexpr (requires { w.reserve(std::uint64_t{}); }) w.reserve(size);
      parallel_for(static_cast<std::size_t>((size + chunk - 1) / chunk), opt.threads, [&](std::size_t i) {
        const std::uint64_t off = i * chunk, len = std::min(chunk, size - off);
        std::vector<std::byte> buf(static_cast<std::size_t>(len));
        fill(off, std::span<std::byte>(buf));
        w.write_at(off, std::span<const std::byte>(buf));
        done(len);
      });
    }
    w.sync();
    w.commit();
  });
}

}  // namespace detail

/// Exports the tensors of `sources` (each a reader and a name prefix) into the Hugging Face
/// folder `out` (see the top of this header).
template <ReadableDirectory S, WritableDirectory D>
hf_export_stats export_to(std::span<const unshard_source<S>> sources, const D& out, const hf_export_options& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  struct origin {
    checkpoint_reader<S>* reader;
    std::string key;
    shape_t shape;            ///< the stored tensor's shape
    std::uint64_t first = 0;  ///< the output's first element in it (an expert's slice)
  };
  std::vector<hf_export_input> inputs;
  std::vector<origin> origins;
  // what the export cannot write is refused, not left out: a tensor of a dtype shardsafe has no
  // type for that the rename keeps, and a non-tensor item whose value holds tensors (torch 1.13's
  // nested dict: checkpoint_files::check_objects; other items have no place in the layout)
  for (const auto& s : sources) {
    s.reader->refuse_foreign([&](const std::string& key) { return !opt.rename.apply(s.prefix + key).empty(); },
                             s.reader->foreign_export_remedy);
    s.reader->check_objects();
  }
  // with opt.dequantize: each quantized weight's stored tensors stand for one, its logical tensor
  std::map<std::pair<const checkpoint_reader<S>*, std::string>, const quantized_tensor*> stored_as;
  std::vector<std::pair<const checkpoint_reader<S>*, quantized_tensor>> quantized;
  if (opt.dequantize)
    for (const auto& s : sources)
      for (auto& q : quantized_tensors(*s.reader)) quantized.emplace_back(s.reader, std::move(q));
  for (const auto& [r, q] : quantized)
    for (const std::string* k : {&q.data, &q.scale, &q.tensor_scale})
      if (!k->empty()) stored_as[{r, *k}] = &q;
  for (const auto& s : sources)
    for (const auto& [key, tm] : s.reader->metadata().tensors) {
      const std::string name = s.prefix + key;
      if (const auto it = stored_as.find({s.reader, key}); it != stored_as.end()) {
        const quantized_tensor& q = *it->second;
        if (key == q.data) {  // the weight, once, as its values (the scales are in them)
          inputs.push_back({s.prefix + q.name, opt.convert_to.value_or(dtype::BF16), q.shape});
          origins.push_back({s.reader, q.name, q.shape, 0});
        }
        continue;
      }
      const rename_rule* stack = opt.experts.empty() ? nullptr : opt.experts.match(name);
      if (!stack) {
        inputs.push_back({name, tm.type, tm.shape});
        origins.push_back({s.reader, key, tm.shape, 0});
        continue;
      }
      if (tm.shape.empty())
        fail(errc::invalid_argument, std::string(out.name()) + ": tensor '" + name + "' (expert stacking rule '" +
                                         stack->text + "'): a 0-d tensor has no expert dimension to split");
      if (tm.shape[0] > max_experts)
        fail(errc::invalid_argument,
             std::string(out.name()) + ": tensor '" + name + "' " + to_string(tm.shape) + " (expert stacking rule '" +
                 stack->text + "'): " + std::to_string(tm.shape[0]) + " experts pass the limit of " +
                 std::to_string(max_experts) + " (refused before anything is planned or written)");
      const shape_t rest(tm.shape.begin() + 1, tm.shape.end());
      for (std::uint64_t i = 0; i < tm.shape[0]; ++i) {
        inputs.push_back({expert_stacking::expert_name(*stack, name, i), tm.type, rest});
        origins.push_back({s.reader, key, tm.shape, i * numel(rest)});
      }
    }
  // a tensor without a name is refused, not left out; then an export that would export nothing
  for (std::size_t i = 0; i < inputs.size(); ++i)
    detail::refuse_unnamed(*origins[i].reader, origins[i].key, inputs[i].name, opt.rename, out.name());
  const hf_export_layout l = plan_hf_export_layout(inputs, opt, out.name());
  if (!inputs.empty() && l.plan.tensors.empty()) {
    std::vector<std::string> names;
    for (const auto& in : inputs) names.push_back(in.name);
    detail::refuse_export_of_nothing(names, opt.rename, out.name(), "tensors",
                                     " (e.g. --preset dcp-to-hf keeps only 'model.' keys)");
  }
  // the files of each grid exported are opened and checked before the output is made, a batch
  // at a time (unshard.hpp): a missing one is refused before a block's plan lists a million parts
  std::set<std::pair<const checkpoint_reader<S>*, std::string>> checked;
  for (const std::size_t src : l.source) {
    const origin& o = origins[src];
    const tensor_metadata* tm = o.reader->find(o.key);
    if (tm && tm->grid && checked.emplace(o.reader, o.key).second)
      detail::for_each_file_opened(*o.reader, o.key, *tm, [](const auto&...) {});
  }
  detail::require_empty_output(out);
  out.make();

  load_options lo;
  lo.verify_checksums = true;  // where the checkpoint records checksums: a damaged byte is refused, not exported
  lo.convert_dtypes = true;
  lo.threads = 1;                                                            // blocks are the parallelism
  lo.list_unexpected = false;                                                // a block at a time
  lo.reads.max_read_bytes = std::max<std::uint64_t>(opt.chunk_bytes, 4096);  // converted reads stage this much
  hf_export_stats st;
  std::vector<std::string> committed;
  std::uint64_t written = 0;
  try {
    for (std::size_t f = 0; f < l.files.size(); ++f) {
      const safetensors_layout& layout = l.files[f];
      // layout index -> plan tensor (for its origin)
      std::vector<std::size_t> plan_of(layout.tensors.size());
      for (std::size_t t : l.plan.files[f].tensors) plan_of[layout.index_of(l.plan.tensors[t].name)] = t;
      auto w = out.create(l.plan.files[f].name);
      detail::write_export_file(
          w, layout.file_size(),
          [&](std::uint64_t off, std::span<std::byte> dst) {
            detail::fill_layout_block(layout, off, dst, [&](std::span<const detail::layout_piece> pieces) {
              detail::load_pieces(
                  pieces, [&](std::size_t idx) { return origins[l.source[plan_of[idx]]].reader; },
                  [&](const detail::layout_piece& p) {
                    const origin& o = origins[l.source[plan_of[p.idx]]];
                    return flat_view{
                        o.key,          layout.tensors[p.idx].type,
                        o.shape,        shard_spec(flat_spec{{o.first + p.first, o.first + p.first + p.n}}),
                        p.bytes.data(), p.bytes.size()};
                  },
                  lo);
            });
          },
          opt, written, l.bytes);
      committed.push_back(l.plan.files[f].name);
      st.bytes += layout.file_size();
      st.tensors += layout.tensors.size();
      ++st.files;
    }
    if (l.plan.indexed()) {
      write_text(out, hf_index_file, l.plan.index_json());
      st.indexed = true;
    }
  } catch (...) {
    for (const auto& n : committed) {  // best effort: the folder was empty before
      try {
        out.remove(n);
      } catch (...) {
      }
    }
    throw;
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// Exports the checkpoint in src, whichever layout it has, into the Hugging Face folder out.
/// A folder with model/ (and optim/) but no description of its own is a model + optimizer
/// checkpoint: model/ is exported (and optim/ too when options.model_only is false).
template <ReadableDirectory S, WritableDirectory D>
hf_export_stats export_to(const S& src, const D& out, const hf_export_options& opt) {
  const checkpoint_parts<S> parts = open_checkpoint_parts(src, opt.model_only);
  return export_to(std::span<const unshard_source<S>>(parts.sources), out, opt);
}

/// (the export's name before issue 52)
template <ReadableDirectory S, WritableDirectory D>
[[deprecated("export_hf is shardsafe::export_to with hf_export_options (CHANGELOG migration table)")]]
hf_export_stats export_hf(std::span<const unshard_source<S>> sources, const D& out, const hf_export_options& opt = {}) {
  return export_to(sources, out, opt);
}
template <ReadableDirectory S, WritableDirectory D>
[[deprecated("export_hf is shardsafe::export_to with hf_export_options (CHANGELOG migration table)")]]
hf_export_stats export_hf(const S& src, const D& out, const hf_export_options& opt = {}) {
  return export_to(src, out, opt);
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/hf/impl/export.ipp"
#endif
