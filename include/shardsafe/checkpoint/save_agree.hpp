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
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/checkpoint/description_message.hpp"
#include "shardsafe/checkpoint/flat_view.hpp"
#include "shardsafe/checkpoint/save_options.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/dist/agree.hpp"
#include "shardsafe/dist/concepts.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/shard/copy_plan.hpp"
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

}  // namespace detail
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/save_agree.ipp"
#endif
