// shardsafe/checkpoint/saver.hpp - save flat views from every rank as one sharded checkpoint.
//
// The protocol (every step agreed by all ranks, so a failure anywhere is thrown everywhere
// and nobody is left waiting in a collective):
//   1. each rank validates its views and describes them (its part of metadata.json);
//      the descriptions are merged (over a PeerComm, up the binomial tree of ranks: each rank
//      merges its children's partial descriptions, rank 0 checks the whole and sends down what
//      every rank needs, checkpoint/description_tree.hpp; otherwise all-gathered, every rank
//      merging them all) and checked the same way:
//      one key has one shape, dtype and sharded-ness on all ranks, the shards of every
//      sharded tensor together cover it, and no two different shards overlap (identical
//      shards are replicas: declared in flat_view::replica, one writer and the others copies,
//      they are written once; undeclared, each holder writes its own);
//   2. rank 0 prepares the directory: refuses a non-empty one unless overwrite was asked,
//      and otherwise removes metadata.json first (so the old checkpoint stops loading as
//      complete), then the rest;
//   3. every rank streams rank_R.safetensors (under a temporary name, fsynced, renamed):
//      its shards (but those it holds as a replica copy: the writer replica writes them), and
//      each replicated tensor it is the lowest rank to hold;
//   4. the outcomes are agreed (over a PeerComm, up and down the tree, each rank's file size
//      sent to rank 0 alone; otherwise all-gathered); then rank 0 writes metadata.json, last, by
//      rename: the commit mark. A save killed at any point leaves no directory that loads as complete.
// Each step runs under dist/agree.hpp: a failure on any rank is thrown, with its own code,
// on every rank. shardsafe's layout reads as these four steps (checkpoint/save_agree.hpp's
// detail::agree_on_description, then checkpoint/save_write.hpp's detail::write_and_commit:
// prepare_directory, write_rank_files, commit_metadata); another layout's writer (torch DCP's,
// checkpoint/dcp_save.hpp) runs the same steps with its own files; an
// asynchronous save (checkpoint/async_save.hpp) runs step 1 on the caller's thread and the
// others in the background.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/layout.hpp"
#include "shardsafe/checkpoint/layouts/writers.hpp"
#include "shardsafe/checkpoint/save_agree.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/checkpoint/save_write.hpp"
#include "shardsafe/core/config.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// One folder of a multi-folder save (save with folders): its name under the parent and this
/// rank's views of it.
struct folder_views {
  std::string name;
  std::span<const flat_view> views;
};

/// The folders of a model + optimizer pair (docs/FORMAT.md §2) in their commit order: optim/
/// (when with_optim), then model/, whose metadata.json is the pair's commit mark.
inline std::vector<folder_views> model_and_optim_folders(std::span<const flat_view> model,
                                                         std::span<const flat_view> optim, bool with_optim) {
  std::vector<folder_views> f;
  if (with_optim) f.push_back({std::string(optim_folder_name), optim});
  f.push_back({std::string(model_folder_name), model});
  return f;
}

/// Saves every rank's views into dir as one checkpoint, in opt.format's layout (the writer
/// registered for it in checkpoint/layouts/writers.hpp). A collective: every rank calls it. The
/// asynchronous counterpart is async_saver::save (checkpoint/async_save.hpp).
template <WritableDirectory D, Comm C>
save_stats save(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt = {}) {
  return save_in_layout(dir, views, comm, opt);
}

/// Saves several folders under `parent` as one checkpoint (a model + optimizer pair:
/// model_and_optim_folders), each as the save of one folder does, in the order given: the last
/// folder's commit mark is the commit mark of them all, so a save killed at any point leaves a
/// parent that does not load as complete. The parent is prepared first (prepare_folder_set:
/// refused when not empty unless opt.overwrite). A collective; the stats in folder order. The
/// asynchronous counterpart is async_saver::save with folders (checkpoint/async_save.hpp).
template <WritableDirectory D, Comm C>
std::vector<save_stats> save(const D& parent, std::span<const folder_views> folders, C& comm,
                             const save_options& opt = {}) {
  if (folders.empty())
    fail(errc::invalid_argument, std::string(parent.name()) + ": a folder set to save has no folder");
  detail::prepare_folder_set(parent, folders.back().name, opt.overwrite, comm);
  save_options each = opt;
  each.overwrite = false;  // (the parent is prepared as a whole)
  std::vector<save_stats> st;
  for (const folder_views& f : folders) st.push_back(save(parent.sub(f.name), f.views, comm, each));
  return st;
}

/// (the save's name before issue 52)
template <WritableDirectory D, Comm C>
[[deprecated("save_flat_views is shardsafe::save (CHANGELOG migration table)")]]
save_stats save_flat_views(const D& dir, std::span<const flat_view> views, C& comm, const save_options& opt = {}) {
  return save(dir, views, comm, opt);
}

/// (the save of a folder set's name before issue 52)
template <WritableDirectory D, Comm C>
[[deprecated("save_folder_set is shardsafe::save with a span of folder_views (CHANGELOG migration table)")]]
std::vector<save_stats> save_folder_set(const D& parent, std::span<const folder_views> folders, C& comm,
                                        const save_options& opt = {}) {
  return save(parent, folders, comm, opt);
}

}  // namespace shardsafe
