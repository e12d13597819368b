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
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL void encode_replica_roles(message_writer& m, std::span<const flat_view> views, std::string_view dir) {
  std::vector<std::pair<std::uint64_t, replica_role>> roles;
  for (std::size_t i = 0; i < views.size(); ++i) {
    const flat_view& v = views[i];
    if (v.replica == replica_role::none) continue;
    if (!v.is_sharded())
      fail(errc::invalid_argument,
           std::string(dir) + ": tensor '" + v.key + "' is declared a replica " + std::string(to_string(v.replica)) +
               " but has no shard spec; a tensor that is not sharded is written once, by the lowest rank");
    roles.emplace_back(i, v.replica);
  }
  m.count(views.size()).count(roles.size());
  for (const auto& [i, role] : roles) m.count(i).count(role == replica_role::writer ? 1 : 2);
}
#else
SHARDSAFE_DECL void encode_replica_roles(message_writer& m, std::span<const flat_view> views, std::string_view dir);
#endif

/// Reads what encode_replica_roles wrote from the front of m (left at what follows): the role
/// of each of the sender's `views` views (the tensors its description gave), by index.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::vector<replica_role> decode_replica_roles(message_reader& m, std::size_t views) {
  if (const std::uint64_t sent = m.count(); sent != views)
    m.malformed("its replica roles are for " + std::to_string(sent) + " views, not the " + std::to_string(views) +
                " it describes");
  std::vector<replica_role> roles(static_cast<std::size_t>(views), replica_role::none);
  const std::uint64_t n = m.items(16, "replica roles");
  for (std::uint64_t k = 0, next = 0; k < n; ++k) {
    const std::uint64_t i = m.count();
    if (i < next || i >= views)
      m.malformed("replica role " + std::to_string(k) + " is for view " + std::to_string(i) +
                  "; roles name views below " + std::to_string(views) + ", in increasing order");
    const std::uint64_t role = m.count(2, "the replica role of view " + std::to_string(i));
    if (role == 0) m.malformed("the replica role of view " + std::to_string(i) + " is none, which is not sent");
    roles[static_cast<std::size_t>(i)] = role == 1 ? replica_role::writer : replica_role::copy;
    next = i + 1;
  }
  return roles;
}
#else
SHARDSAFE_DECL std::vector<replica_role> decode_replica_roles(message_reader& m, std::size_t views);
#endif

/// The shards of one sharded tensor, checked: every copy replica has a writer with its spec,
/// no shard has two writers, and no two shards overlap unless they are identical (the distinct
/// shards hold, together, no more elements than the tensor; with the coverage check after,
/// each element is held by exactly one distinct shard). Identical shards that are not declared
/// replicas (a replicated DTensor saved by every rank) stay accepted and are each written, as
/// before roles existed. Returns the files to list: the shards written, in rank order.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> check_shards(const std::string& key,
                                                                            const tensor_metadata& tm,
                                                                            const std::vector<int>& ranks,
                                                                            const std::vector<replica_role>& roles,
                                                                            std::string_view dir) {
  const std::string c = std::string(dir) + ": tensor '" + key + "' " + to_string(tm.shape);
  std::map<std::string, std::size_t> writer_of;  // spec text -> index of its writer
  for (std::size_t i = 0; i < tm.files.size(); ++i) {
    if (roles[i] != replica_role::writer) continue;
    auto [it, fresh] = writer_of.emplace(to_string(tm.files[i].second), i);
    if (!fresh)
      fail(errc::invalid_argument, c + ": ranks " + std::to_string(ranks[it->second]) + " and " +
                                       std::to_string(ranks[i]) + " are both the writer of the replicated shard " +
                                       it->first + "; one replica writes it, the others are copies");
  }
  std::vector<std::pair<std::string, shard_spec>> files;
  std::vector<int> file_rank;
  std::map<std::string, bool> distinct;  // spec texts counted in held
  std::uint64_t held = 0;
  for (std::size_t i = 0; i < tm.files.size(); ++i) {
    if (roles[i] == replica_role::copy) {
      if (!writer_of.count(to_string(tm.files[i].second)))
        fail(errc::invalid_argument, c + ": rank " + std::to_string(ranks[i]) + " holds " +
                                         to_string(tm.files[i].second) +
                                         " as a replica copy, but no rank is the writer of that shard");
      continue;
    }
    files.push_back(tm.files[i]);
    file_rank.push_back(ranks[i]);
    if (distinct.emplace(to_string(tm.files[i].second), true).second) held += tm.files[i].second.local_numel();
  }
  if (held > tm.numel()) {  // some shards overlap: name two (only on this error path: pairwise)
    const std::span<const std::uint64_t> full(tm.shape);
    for (std::size_t a = 0; a < files.size(); ++a)
      for (std::size_t b = a + 1; b < files.size(); ++b) {
        if (files[a].second == files[b].second) continue;  // identical: replicas
        const std::uint64_t both = overlap_numel(files[a].second, files[b].second, full);
        if (both == 0) continue;
        std::string first;
        for_each_overlap(files[a].second, files[b].second, full, [&](const overlap_piece& p) {
          if (first.empty()) first = multi_index_string(full, p.global);
        });
        fail(errc::invalid_argument,
             c + ": rank " + std::to_string(file_rank[a]) + "'s shard " + to_string(files[a].second) + " and rank " +
                 std::to_string(file_rank[b]) + "'s shard " + to_string(files[b].second) + " share " +
                 std::to_string(both) + " elements (the first at index " + first +
                 "); shards must not overlap unless they are identical and declared replicas (flat_view::replica)");
      }
  }
  return files;
}
#else
SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> check_shards(const std::string& key,
                                                                            const tensor_metadata& tm,
                                                                            const std::vector<int>& ranks,
                                                                            const std::vector<replica_role>& roles,
                                                                            std::string_view dir);
#endif

/// Merges the ranks' descriptions into the checkpoint's metadata, checking they agree, that
/// every sharded tensor is covered, and that its shards do not overlap (but as replicas).
/// roles[r][i]: rank r's role for its i-th tensor (missing: none).
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts,
                                                      std::string_view dir,
                                                      const std::vector<std::vector<replica_role>>& roles = {}) {
  checkpoint_metadata out;
  std::map<std::string, std::size_t> where;  // key -> index in out.tensors
  std::map<std::string, int> first_rank;     // key -> lowest rank holding it
  // per sharded tensor (index in out.tensors): the rank and role of each entry of its files
  std::vector<std::vector<int>> file_ranks;
  std::vector<std::vector<replica_role>> file_roles;
  for (std::size_t r = 0; r < parts.size(); ++r) {
    for (std::size_t i = 0; i < parts[r].tensors.size(); ++i) {
      const std::string& key = parts[r].tensors[i].first;  // named, not bound: `disagree` captures it
      const tensor_metadata& tm = parts[r].tensors[i].second;
      const replica_role role = r < roles.size() && i < roles[r].size() ? roles[r][i] : replica_role::none;
      auto it = where.find(key);
      if (it == where.end()) {
        where.emplace(key, out.tensors.size());
        first_rank.emplace(key, static_cast<int>(r));
        out.tensors.emplace_back(key, tm);
        file_ranks.push_back({static_cast<int>(r)});
        file_roles.push_back({role});
        continue;
      }
      tensor_metadata& have = out.tensors[it->second].second;
      const int r0 = first_rank[key];
      auto disagree = [&](const std::string& what, const std::string& a, const std::string& b) {
        fail(errc::invalid_argument, std::string(dir) + ": tensor '" + key + "': rank " + std::to_string(r0) +
                                         " saves " + what + " " + a + " but rank " + std::to_string(r) + " saves " + b);
      };
      if (have.shape != tm.shape) disagree("shape", to_string(have.shape), to_string(tm.shape));
      if (have.type != tm.type) disagree("dtype", std::string(to_string(have.type)), std::string(to_string(tm.type)));
      if (have.is_sharded != tm.is_sharded)
        disagree("it", have.is_sharded ? "sharded" : "not sharded", tm.is_sharded ? "sharded" : "not sharded");
      if (have.is_sharded) {  // replicated: the lowest rank's copy only
        have.files.push_back(tm.files.front());
        file_ranks[it->second].push_back(static_cast<int>(r));
        file_roles[it->second].push_back(role);
      }
    }
  }
  for (std::size_t t = 0; t < out.tensors.size(); ++t) {
    auto& [key, tm] = out.tensors[t];
    if (!tm.is_sharded) continue;
    tm.files = check_shards(key, tm, file_ranks[t], file_roles[t], dir);
    std::vector<shard_spec> specs;
    for (const auto& f : tm.files) specs.push_back(f.second);
    const shard_spec whole = flat_spec{{0, tm.numel()}};
    auto missing = missing_elements(whole, std::span<const shard_spec>(specs), tm.shape);
    if (!missing.empty())
      fail(errc::missing_coverage, std::string(dir) + ": tensor '" + key + "' " + to_string(tm.shape) +
                                       ": no rank holds elements " + to_string(missing.front()) + " (index " +
                                       multi_index_string(tm.shape, missing.front().begin) +
                                       "); the shards of all ranks must cover the tensor");
  }
  return out;
}
#else
SHARDSAFE_DECL checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts,
                                                      std::string_view dir,
                                                      const std::vector<std::vector<replica_role>>& roles = {});
#endif

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
