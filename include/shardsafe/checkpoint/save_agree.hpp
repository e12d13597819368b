// shardsafe/checkpoint/save_agree.hpp - step 1 of a save (checkpoint/saver.hpp): each rank
// describes its views, the descriptions are all-gathered and merged, and every rank checks the
// same things (one key one shape, dtype and sharded-ness; shards cover their tensor; no two
// different shards overlap; replica roles). What every writable layout's save starts with.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/description_message.hpp"
#include "shardsafe/checkpoint/description_tree.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/coverage.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {
namespace detail {

/// This rank's part of the metadata: every view with this rank's file as its only file.
inline checkpoint_metadata describe_views(std::span<const flat_view> views, int rank, std::string_view dir,
                                          bool memory_later = false) {
  checkpoint_metadata md;
  std::map<std::string_view, bool> seen;
  for (const auto& v : views) {
    v.validate(dir, memory_later);
    if (!seen.emplace(v.key, true).second)
      fail(errc::invalid_argument, std::string(dir) + ": tensor '" + v.key + "' is given twice");
    tensor_metadata tm;
    tm.shape = v.full_shape;
    tm.type = v.type;
    tm.is_sharded = v.is_sharded();
    tm.files.emplace_back(rank_file_name(rank), v.effective_spec());
    md.tensors.emplace_back(v.key, std::move(tm));
  }
  return md;
}

/// The replica roles of a rank's views, sent after its description in the same message
/// (dist/message.hpp): the number of views, then items(roles) and per view declared a replica
/// its index among the views (increasing) and its role (1 writer, 2 copy). A view without a
/// spec cannot be a replica (unsharded tensors are written once already).
SHARDSAFE_DECL void encode_replica_roles(message_writer& m, std::span<const flat_view> views, std::string_view dir);

/// Reads what encode_replica_roles wrote from the front of m (left at what follows): the role
/// of each of the sender's `views` views (the tensors its description gave), by index.
SHARDSAFE_DECL std::vector<replica_role> decode_replica_roles(message_reader& m, std::size_t views);

/// The shards of one sharded tensor, checked: every copy replica has a writer with its spec,
/// no shard has two writers, and no two shards overlap unless they are identical (the distinct
/// shards hold, together, no more elements than the tensor; with the coverage check after,
/// each element is held by exactly one distinct shard). Identical shards that are not declared
/// replicas (a replicated DTensor saved by every rank) stay accepted and are each written, as
/// before roles existed. Returns the files to list: the shards written, in rank order.
SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> check_shards(const std::string& key,
                                                                            const tensor_metadata& tm,
                                                                            const std::vector<int>& ranks,
                                                                            const std::vector<replica_role>& roles,
                                                                            std::string_view dir);

/// check_shards, then the coverage check: the files a sharded tensor lists, or the error
/// merge_descriptions throws for it.
SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> checked_files(const std::string& key,
                                                                             const tensor_metadata& tm,
                                                                             const std::vector<int>& ranks,
                                                                             const std::vector<replica_role>& roles,
                                                                             std::string_view dir);

/// Merges the ranks' descriptions into the checkpoint's metadata, checking they agree, that
/// every sharded tensor is covered, and that its shards do not overlap (but as replicas).
/// roles[r][i]: rank r's role for its i-th tensor (missing: none).
SHARDSAFE_DECL checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts,
                                                      std::string_view dir,
                                                      const std::vector<std::vector<replica_role>>& roles = {});

/// Step 1: every rank describes its views; the descriptions (with the replica roles, one
/// message per rank: checkpoint/description_message.hpp) are all-gathered, merged and
/// checked on every rank alike. Returns the checkpoint's metadata (without its extras).
template <Comm C>
checkpoint_metadata agree_on_metadata(std::span<const flat_view> views, C& comm, const std::string& dname,
                                      bool memory_later = false) {
  const int rank = comm.rank();
  const step_scope step("agreeing on the metadata");
  const auto plans = every_rank_step(comm, [&] {
    message_writer roles;  // first: a replica without a spec is reported before the views are described
    encode_replica_roles(roles, views, dname);
    message_writer m;
    encode_description(m, describe_views(views, rank, dname, memory_later));
    return std::move(m).str() + roles.str();
  });
  std::vector<checkpoint_metadata> parts;
  std::vector<std::vector<replica_role>> roles;
  parts.reserve(plans.size());
  roles.reserve(plans.size());
  for (std::size_t r = 0; r < plans.size(); ++r) {
    message_reader m(plans[r], dname + " (rank " + std::to_string(r) + "'s plan)");
    parts.push_back(decode_description(m));
    roles.push_back(decode_replica_roles(m, parts.back().tensors.size()));
    m.finish();
  }
  return merge_descriptions(parts, dname, roles);
}

/// Whether a save writes metadata.json in the compact form (metadata_form), its tensors listing
/// `entries` files in all.
inline bool use_compact_form(std::uint64_t entries, metadata_form form) {
  if (form != metadata_form::automatic) return form == metadata_form::compact;
  return entries > compact_metadata_entries;
}

/// What step 1 leaves a rank with.
struct agreed_description {
  /// The checkpoint's metadata without its extras: whole (every file of every tensor) on rank 0,
  /// and on every rank without a tree; on the other ranks of a tree agreement, each tensor's shape,
  /// dtype and sharded-ness, in the checkpoint's order, and for a tensor that is not sharded the
  /// file of the rank that writes it (its lowest holder) alone.
  checkpoint_metadata md;
  bool tree = false;                  ///< agreed over a PeerComm's tree: the later steps of the save are too
  std::uint64_t entries = 0;          ///< files the tensors list in all (what metadata_form::automatic counts)
  std::uint64_t checksum_hashes = 0;  ///< blocks the checksum tables hold (0 without checksums)
  /// Entries rank 0 expanded one by one to check them (finish_partial): one per tensor not
  /// sharded, and every entry of a sharded tensor written listed or whose grid its boxes did not
  /// show (grid_of_boxes). 0 on the other ranks and without a tree.
  std::uint64_t entries_expanded = 0;
  /// A DCP save over the tree (agree_dcp): this rank's non-empty shards (key, spec as
  /// to_string) that a lower rank saves too without replica roles, and so writes (the lowest
  /// holder writes a shard, as torch's dedup does), and its shards of a sharded tensor of no
  /// elements where a lower rank's file is the tensor's first (it writes the one empty chunk).
  /// Empty elsewhere.
  std::set<std::pair<std::string, std::string>> saved_lower;
};

/// The blocks of `block` bytes tm's files hold (sharded: each file's shard; not sharded: its
/// first file, the one written); 0 when block is 0 (no checksums).
inline std::uint64_t checksum_hashes_of(const tensor_metadata& tm, std::uint64_t block) {
  std::uint64_t hashes = 0;
  if (block == 0) return 0;
  for (const auto& [fname, spec] : tm.files) {
    const std::uint64_t n = tm.is_sharded ? spec.local_numel() : tm.numel();
    hashes += checksum_block_count((n * bit_size(tm.type) + 7) / 8, block);
    if (!tm.is_sharded) break;  // written by its first file only
  }
  return hashes;
}

/// A whole description agreed (every rank holds it): its counts.
inline agreed_description agreed_whole(checkpoint_metadata md, std::uint64_t block) {
  agreed_description a;
  for (const auto& [key, tm] : md.tensors) {
    a.entries += tm.file_count();
    a.checksum_hashes += checksum_hashes_of(tm, block);
  }
  a.md = std::move(md);
  return a;
}

/// On rank 0 of a tree agreement: the final partial checked as merge_descriptions checks the
/// merged descriptions, and the metadata built, each tensor a grid when `compact` finds one
/// (write_and_commit's rule), so that no more than the final description is held. In the compact
/// form a sharded tensor's grid is found from its boxes (grid_of_boxes: O(tensors) work for a
/// regular sharding, whatever the world), else its entries are expanded as the all-gather path
/// expands them, one tensor at a time (entries_expanded counts them). Throws what
/// merge_descriptions throws (for a disagreement: errc::invalid_argument without saying which).
SHARDSAFE_DECL agreed_description finish_partial(const partial_description& p, std::uint64_t world,
                                                 std::string_view dir, metadata_form form, std::uint64_t block);

/// The message rank 0 sends down the tree once it has agreed: entries, hashes, then per tensor
/// its key, shape, dtype, sharded-ness, lowest holder and (not sharded) that holder's spec.
SHARDSAFE_DECL std::string encode_agreed(const agreed_description& a, const partial_description& p);
/// What a rank other than 0 makes of it: a description that is not whole.
SHARDSAFE_DECL agreed_description decode_agreed(message_reader& m);

/// Step 1 over the trees of a PeerComm (dist/tree.hpp): every rank describes its views (a failure
/// agreed as every_rank_step agrees it, up and down the binomial tree), then partial descriptions
/// go up the binary tree of runs, each rank merging its two children's after its own (consecutive
/// runs of ranks, in rank order), and rank 0 checks and builds the metadata and sends the agreed
/// table down the same tree: a rank receives at most three messages of O(tensors) bytes. A failure to hear a
/// child, or a malformed partial, is agreed as a failure of the rank that heard it. When rank 0's
/// checks fail, every rank runs the all-gather agreement instead, which throws the error
/// merge_descriptions gives (the same words as without a tree).
template <PeerComm C>
agreed_description agree_description_over_tree(std::span<const flat_view> views, C& comm, const std::string& dname,
                                               bool memory_later, metadata_form form, std::uint64_t block) {
  const int rank = comm.rank(), world = comm.world_size();
  const step_scope step("agreeing on the metadata");
  partial_description mine;
  every_rank_step(comm, [&] {
    message_writer roles;  // first: a replica without a spec is reported before the views are described
    encode_replica_roles(roles, views, dname);
    mine = partial_of(describe_views(views, rank, dname, memory_later), views, static_cast<std::uint64_t>(rank));
  });
  outcome_tally t;                                   // what went wrong in this subtree's exchange
  const run_node node = run_tree_node(rank, world);  // at most two children: O(tensors) in a rank
  for (int k = 0; k < 2; ++k) {
    const int child = node.children[k];
    if (child < 0) continue;
    const std::string from = dname + " (rank " + std::to_string(child) + "'s partial description)";
    try {
      const std::string bytes = exchange_in_scope([&] { return comm.recv_bytes(child); });
      message_reader m(bytes, from);
      if (m.flag("the failure flag")) {
        t.add(outcome_tally::decode(m.text(), from));
      } else {
        mine.merge(decode_partial(m, static_cast<std::uint64_t>(child), static_cast<std::uint64_t>(node.child_end[k])));
      }
      m.finish();
    } catch (...) {
      t.add(failure_of(rank, step_outcome::of_exception(std::current_exception())));
    }
  }
  if (rank != 0) {
    message_writer up;
    up.flag(t.failed > 0);
    if (t.failed > 0)
      up.text(t.encode());
    else
      encode_partial(up, mine);
    try {
      comm.send_bytes(std::move(up).str(), node.parent);
    } catch (const error&) {  // the parent is gone: hearing from it below fails, naming it
    }
  }
  std::string down;
  agreed_description out;
  if (rank == 0) {
    message_writer m;
    if (t.failed > 0) {
      m.count(1).text(t.encode());
    } else {
      try {
        out = finish_partial(mine, static_cast<std::uint64_t>(world), dname, form, block);
        m.count(0).text(encode_agreed(out, mine));
      } catch (...) {
        m.count(2);
      }
    }
    down = std::move(m).str();
  }
  broadcast_over_runs(comm, down);
  const std::string from = dname + " (rank " + std::to_string(std::max(node.parent, 0)) + "'s agreement)";
  message_reader m(down, from);
  const std::uint64_t status = m.count(2, "the agreement's status");
  if (status == 2) {  // rank 0's checks failed: the all-gather agreement says how, as without a tree
    m.finish();
    return agreed_whole(agree_on_metadata(views, comm, dname, memory_later), block);
  }
  const std::string body = m.text();
  m.finish();
  if (status == 1) outcome_tally::decode(body, from).throw_if_failed();
  if (rank != 0) {
    message_reader a(body, from);
    out = decode_agreed(a);
    a.finish();
  }
  out.tree = true;
  return out;
}

/// Step 1 for a save of `opt`: over the tree where the Comm is a PeerComm that offers it (and the
/// world has more than one rank), else by all-gather (agree_on_metadata), every rank whole.
template <Comm C>
agreed_description agree_on_description(std::span<const flat_view> views, C& comm, const std::string& dname,
                                        const save_options& opt) {
  const bool memory_later = bool(opt.fetch);
  if (opt.checksums && opt.checksum_block_bytes == 0)  // alike on every rank: the options are
    fail(errc::invalid_argument, dname +
                                     ": save_options::checksum_block_bytes is 0; checksums are kept per "
                                     "block of at least one byte (or pass checksums = false)");
  const std::uint64_t block = opt.checksums ? opt.checksum_block_bytes : 0;
  if constexpr (PeerComm<C>)
    if (comm.peer_to_peer() && comm.world_size() > 1)
      return agree_description_over_tree(views, comm, dname, memory_later, opt.metadata, block);
  return agreed_whole(agree_on_metadata(views, comm, dname, memory_later), block);
}

}  // namespace detail
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/save_agree.ipp"
#endif
