// shardsafe/checkpoint/load.hpp - load: the one load of flat views (checkpoint/flat_view.hpp),
// on this rank alone or as a collective over a Comm. Where from is the first argument: a
// directory (opened for this load), a checkpoint_reader (opened once and kept for the next
// loads: checkpoint/checkpoint_reader.hpp), or a configured_loader (its options fixed in its
// type: checkpoint/configured.hpp). The load into device memory, through a ring of host
// buffers, is the same verb with staged views and a copy engine (checkpoint/staged_load.hpp).
//
// | call                                 | runs on                 | a failure                      |
// |--------------------------------------|-------------------------|--------------------------------|
// | load(dir, views, opt)                | this rank               | thrown here                    |
// | load(reader, views, opt)             | this rank (reader kept) | thrown here                    |
// | load(dir, views, comm, opt)          | every rank (collective) | thrown on every rank alike     |
// | load(reader, views, comm, opt)       | every rank (reader kept)| thrown on every rank alike     |
// | (opt.replicas: read_once, automatic) | ranks of one view set   |                                |
// |                                      | read each byte once     |                                |
// | load(configured_loader, views)       | every rank (collective) | thrown on every rank alike     |
//
// (the collective throws the first failure of any rank on every rank, with its code: dist/agree.hpp)
#pragma once

#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>
#include <span>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/checkpoint/dequant_load.hpp"
#include "shardsafe/checkpoint/replica_reads.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Loads this rank's views in place from the checkpoint `reader` has open: its plan, then its
/// reads (checkpoint_reader::plan, ::execute). Throws on the first problem, naming file, tensor
/// and rule. A floating view of a quantized weight (checkpoint/quant.hpp) is dequantized, with
/// opt.convert_dtypes (load_dequantizing, checkpoint/dequant_load.hpp).
template <ReadableDirectory D>
load_stats load(checkpoint_reader<D>& reader, std::span<const flat_view> views, const load_options& opt = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto quantized = dequantized_views(reader, views);  // config.json read at most once
  load_stats st =
      quantized.empty()
          ? reader.execute(views, reader.plan(views, opt))
          : load_dequantizing(reader, views, std::span<const std::pair<std::size_t, quantized_tensor>>(quantized), opt);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

/// Loads this rank's views from the checkpoint in dir, on this rank alone.
template <ReadableDirectory D>
load_stats load(const D& dir, std::span<const flat_view> views, const load_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return load(r, views, opt);
}

/// The collective load through a reader opened once (every rank its own): every rank loads its
/// views; the first failure of any rank is thrown on every rank, with its code. With
/// opt.replicas, ranks that load the same views read each byte once between them
/// (checkpoint/replica_reads.hpp).
template <ReadableDirectory D, Comm C>
load_stats load(checkpoint_reader<D>& reader, std::span<const flat_view> views, C& comm,
                const collective_load_options& opt = {}) {
  load_stats st;
  if (opt.replicas == replica_reads::every_rank_reads) {
    every_rank_step(comm, [&] { st = load(reader, views, opt); });
    return st;
  }
  // a view the checkpoint has (its key, or a quantized weight's logical name); a dequantized
  // weight's stored parts count as asked for (unexpected_keys), as the plain load plans them
  std::set<std::string, std::less<>> asked;
  auto has = [&] {
    std::vector<char> held(views.size(), 0);
    for (std::size_t i = 0; i < views.size(); ++i) {
      held[i] = reader.find(views[i].key) != nullptr;
      asked.insert(views[i].key);
    }
    for (const auto& [i, q] : dequantized_views(reader, views)) {
      held[i] = 1;
      for (const std::string* k : {&q.data, &q.scale, &q.tensor_scale})
        if (!k->empty()) asked.insert(*k);
    }
    return held;
  };
  return load_replicated(
      views, comm, opt, [&](std::span<const flat_view> v, const load_options& o) { return load(reader, v, o); }, has,
      [&] { return reader.unexpected_keys([&](std::string_view k) { return asked.count(k) > 0; }); },
      reader.directory().name());
}

/// The collective load: every rank loads its views from the checkpoint in dir (opened in this
/// step: a rank that cannot open it fails the step on every rank).
template <ReadableDirectory D, Comm C>
load_stats load(const D& dir, std::span<const flat_view> views, C& comm, const collective_load_options& opt = {}) {
  load_stats st;
  if (opt.replicas == replica_reads::every_rank_reads) {
    every_rank_step(comm, [&] {
      checkpoint_reader<D> r(dir);
      st = load(r, views, opt);
    });
    return st;
  }
  std::optional<checkpoint_reader<D>> r;
  every_rank_step(comm, [&] { r.emplace(dir); });
  return load(*r, views, comm, opt);
}

namespace detail {
/// The collective load with a reader opened on first use (inside the step, so that a rank that
/// cannot open it fails the step on every rank) and kept: configured_loader's.
template <ReadableDirectory D, Comm C>
load_stats load_keeping_reader(const D& dir, std::optional<checkpoint_reader<D>>& reader,
                               std::span<const flat_view> views, C& comm, const load_options& opt) {
  load_stats st;
  every_rank_step(comm, [&] {
    if (!reader) reader.emplace(dir);
    st = load(*reader, views, opt);
  });
  return st;
}
}  // namespace detail

/// (the per-rank load's name before issue 52)
template <ReadableDirectory D>
[[deprecated("load_flat_views is shardsafe::load (CHANGELOG migration table)")]]
load_stats load_flat_views(const D& dir, std::span<const flat_view> views, const load_options& opt = {}) {
  return load(dir, views, opt);
}

/// (the collective load's name before issue 52; a kept reader is now load(reader, views, comm, opt))
template <ReadableDirectory D, Comm C>
[[deprecated("load_flat_views is shardsafe::load (CHANGELOG migration table)")]]
load_stats load_flat_views(const D& dir, std::span<const flat_view> views, C& comm, const load_options& opt = {},
                           std::optional<checkpoint_reader<D>>* reader = nullptr) {
  if (reader) return detail::load_keeping_reader(dir, *reader, views, comm, opt);
  return load(dir, views, comm, opt);
}

}  // namespace shardsafe
