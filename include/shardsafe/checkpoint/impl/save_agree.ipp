// shardsafe/checkpoint/impl/save_agree.ipp - save_agree.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/save_agree.hpp"

namespace shardsafe {
namespace detail {

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

SHARDSAFE_DECL std::vector<std::pair<std::string, shard_spec>> checked_files(const std::string& key,
                                                                             const tensor_metadata& tm,
                                                                             const std::vector<int>& ranks,
                                                                             const std::vector<replica_role>& roles,
                                                                             std::string_view dir) {
  std::vector<std::pair<std::string, shard_spec>> files = check_shards(key, tm, ranks, roles, dir);
  std::vector<shard_spec> specs;
  specs.reserve(files.size());
  for (const auto& f : files) specs.push_back(f.second);
  // the first missing element names the error; where the shards hold fewer elements than the
  // tensor, the walk to it is bounded (first_gap_in_whole)
  const coverage_gap gap = first_gap_in_whole(std::span<const shard_spec>(specs), tm.shape);
  if (gap.first)
    fail(errc::missing_coverage, std::string(dir) + ": tensor '" + key + "' " + to_string(tm.shape) +
                                     ": no rank holds elements " + to_string(*gap.first) + " (index " +
                                     multi_index_string(tm.shape, gap.first->begin) +
                                     "); the shards of all ranks must cover the tensor");
  if (gap.by_count)
    fail(errc::missing_coverage, std::string(dir) + ": tensor '" + key + "' " + to_string(tm.shape) +
                                     ": the shards of all ranks are " + std::to_string(gap.held) +
                                     " elements in all, fewer than its " + std::to_string(tm.numel()) +
                                     "; the shards of all ranks must cover the tensor");
  return files;
}

SHARDSAFE_DECL checkpoint_metadata merge_descriptions(const std::vector<checkpoint_metadata>& parts,
                                                      std::string_view dir,
                                                      const std::vector<std::vector<replica_role>>& roles) {
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
    if (tm.is_sharded) tm.files = checked_files(key, tm, file_ranks[t], file_roles[t], dir);
  }
  return out;
}

SHARDSAFE_DECL agreed_description finish_partial(const partial_description& p, std::uint64_t world,
                                                 std::string_view dir, metadata_form form, std::uint64_t block) {
  if (p.disagrees)
    fail(errc::invalid_argument, std::string(dir) + ": the ranks disagree on a tensor's shape, dtype or sharded-ness");
  if (p.first != 0 || p.end != world)
    fail(errc::comm_error, std::string(dir) + ": the merged description is of ranks [" + std::to_string(p.first) +
                               ", " + std::to_string(p.end) + "), not of the world");
  agreed_description a;
  for (const auto& t : p.tensors)
    for (const auto& b : t.boxes)
      if (b.role != replica_role::copy) a.entries += b.count();  // not sharded: its one box of one entry
  const bool compact = use_compact_form(a.entries, form);
  a.md.tensors.reserve(p.tensors.size());
  for (const auto& t : p.tensors) {  // one tensor's entries expanded at a time, where they must be
    tensor_metadata tm;
    tm.shape = t.shape;
    tm.type = t.type;
    tm.is_sharded = t.sharded;
    if (compact)
      if (auto g = grid_of_boxes(t, world)) {  // checked without expanding: each box's pieces are alike
        for (const auto& b : t.boxes)
          if (b.role != replica_role::copy && block > 0)
            a.checksum_hashes += b.count() * checksum_block_count((numel(b.extents) * bit_size(t.type) + 7) / 8, block);
        tm.grid = std::move(g);
        a.md.tensors.emplace_back(t.key, std::move(tm));
        continue;
      }
    std::vector<int> ranks;
    std::vector<replica_role> roles;
    expand_entries(t, world, dir, tm.files, ranks, roles);
    a.entries_expanded += tm.files.size();
    if (t.sharded) tm.files = checked_files(t.key, tm, ranks, roles, dir);
    a.checksum_hashes += checksum_hashes_of(tm, block);
    if (compact)
      if (auto g = detect_grid(tm)) {
        tm.grid = std::move(g);
        tm.files = decltype(tm.files)();  // its memory too: rank 0 keeps the compact form alone
      }
    a.md.tensors.emplace_back(t.key, std::move(tm));
  }
  return a;
}

SHARDSAFE_DECL std::string encode_agreed(const agreed_description& a, const partial_description& p) {
  message_writer m;
  m.count(a.entries).count(a.checksum_hashes).count(p.tensors.size());
  for (std::size_t i = 0; i < p.tensors.size(); ++i) {
    const partial_tensor& t = p.tensors[i];
    m.text(t.key).counts(t.shape).count(static_cast<std::uint64_t>(t.type)).flag(t.sharded).count(t.first_rank);
    if (!t.sharded) encode_shard_spec(m, a.md.tensors[i].second.files.front().second);
  }
  return std::move(m).str();
}

SHARDSAFE_DECL agreed_description decode_agreed(message_reader& m) {
  agreed_description a;
  a.entries = m.count();
  a.checksum_hashes = m.count();
  const std::uint64_t n = m.items(min_described_tensor_bytes, "tensors");
  a.md.tensors.reserve(static_cast<std::size_t>(n));
  for (std::uint64_t i = 0; i < n; ++i) {
    std::string key = m.text();
    const std::string c = "tensor '" + key + "'";
    tensor_metadata tm;
    tm.shape = m.counts();
    if (!checked_numel(tm.shape)) m.malformed(c + ": shape " + to_string(tm.shape) + " has more than 2^64 elements");
    tm.type = static_cast<dtype>(m.count(all_dtypes.size() - 1, c + "'s dtype"));
    tm.is_sharded = m.flag(c + "'s is_sharded");
    const std::uint64_t first = m.count(max_grid_rank, c + "'s writer");
    if (!tm.is_sharded) {
      shard_spec spec = decode_shard_spec(m, c + "'s shard spec");
      try {
        spec.validate(tm.shape, c);
      } catch (const error& e) {
        m.malformed(e.what());
      }
      tm.files.emplace_back(rank_file_name(first), std::move(spec));
    }
    a.md.tensors.emplace_back(std::move(key), std::move(tm));
  }
  return a;
}

}  // namespace detail
}  // namespace shardsafe
