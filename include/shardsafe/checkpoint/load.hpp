// shardsafe/checkpoint/load.hpp - the two loads of flat views (checkpoint/flat_view.hpp): on
// this rank alone, or as a collective over a Comm. Both run a checkpoint_reader's load
// (checkpoint/checkpoint_reader.hpp; checkpoint/loader.hpp includes both); configured_loader
// (checkpoint/configured.hpp) is the collective one with its options fixed and checked at
// compile time.
//
// | call                                        | runs on                 | a failure                      |
// |---------------------------------------------|-------------------------|--------------------------------|
// | load_flat_views(dir, views, opt)            | this rank               | thrown here                    |
// | checkpoint_reader<D>(dir).load(views, opt)  | this rank (reader kept) | thrown here                    |
// | load_flat_views(dir, views, comm, opt)      | every rank (collective) | thrown on every rank alike     |
//
// (the collective throws the first failure of any rank on every rank, with its code: dist/agree.hpp)
#pragma once

#include <optional>
#include <span>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/checkpoint/checkpoint_reader.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Loads this rank's views from the checkpoint in dir, on this rank alone.
template <ReadableDirectory D>
load_stats load_flat_views(const D& dir, std::span<const flat_view> views, const load_options& opt = {}) {
  checkpoint_reader<D> r(dir);
  return r.load(views, opt);
}

/// The collective load: every rank loads its views from the checkpoint in dir (opened once in
/// `reader`, kept for the next load, when given).
template <ReadableDirectory D, Comm C>
load_stats load_flat_views(const D& dir, std::span<const flat_view> views, C& comm, const load_options& opt = {},
                           std::optional<checkpoint_reader<D>>* reader = nullptr) {
  load_stats st;
  every_rank_step(comm, [&] {
    std::optional<checkpoint_reader<D>> local;
    std::optional<checkpoint_reader<D>>& r = reader ? *reader : local;
    if (!r) r.emplace(dir);
    st = r->load(views, opt);
  });
  return st;
}

}  // namespace shardsafe
