// Device meshes and placements (shard/mesh.hpp): blocks checked against a brute force that
// assigns every element to its ranks by slicing index lists as torch.chunk does, the named
// layouts (FSDP2, TP, HSDP, FSDP + TP, 3-D) against hand-worked values, replicas and writers,
// and a fixed table against torch 1.13's own torch.chunk (/usr/bin/python3).
#include "shardsafe/shard/mesh.hpp"

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "shardsafe/checkpoint/hf/experts.hpp"
#include "shardsafe/checkpoint/hf/export_views.hpp"
#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/shard/copy_plan.hpp"
#include "shardsafe/shard/merged_ranges.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;
using u64 = std::uint64_t;

namespace {

// --- the brute force --------------------------------------------------------------------------
//
// Along each tensor dimension a rank holds a list of indices. It starts as 0..n-1; each
// Shard(d) placement, left to right, cuts the list of dimension d as torch.chunk cuts a
// sequence (consecutive slices of ceil(len / k) items, as many as there are items for) and
// keeps slice `coord`, or nothing when there are fewer slices. No formula from mesh.hpp is used.

std::vector<std::vector<u64>> chunk_list(const std::vector<u64>& items, u64 k) {
  u64 size = 0;
  while (size * k < items.size()) ++size;  // the smallest size with size * k >= len
  std::vector<std::vector<u64>> pieces;
  for (std::size_t at = 0; at < items.size(); at += size)
    pieces.emplace_back(items.begin() + static_cast<std::ptrdiff_t>(at),
                        items.begin() + static_cast<std::ptrdiff_t>(std::min<std::size_t>(at + size, items.size())));
  return pieces;
}

/// held[d][i]: whether the rank at coords holds index i of tensor dimension d.
std::vector<std::vector<bool>> held_indices(const shape_t& full, const shape_t& mesh, const shape_t& coords,
                                            const std::vector<placement>& pls) {
  std::vector<std::vector<u64>> lists(full.size());
  for (std::size_t d = 0; d < full.size(); ++d)
    for (u64 i = 0; i < full[d]; ++i) lists[d].push_back(i);
  for (std::size_t m = 0; m < pls.size(); ++m) {
    if (!pls[m].is_shard()) continue;
    auto& l = lists[pls[m].dim];
    auto pieces = chunk_list(l, mesh[m]);
    l = coords[m] < pieces.size() ? pieces[coords[m]] : std::vector<u64>{};
  }
  std::vector<std::vector<bool>> held(full.size());
  for (std::size_t d = 0; d < full.size(); ++d) {
    held[d].assign(full[d], false);
    for (u64 i : lists[d]) held[d][i] = true;
  }
  return held;
}

shape_t coords_of(u64 r, const shape_t& mesh) {
  shape_t c(mesh.size());
  for (std::size_t d = mesh.size(); d-- > 0;) {
    c[d] = r % mesh[d];
    r /= mesh[d];
  }
  return c;
}

/// owners[e]: the ranks holding global flat element e, by brute force.
std::vector<std::vector<u64>> brute_owners(const shape_t& full, const shape_t& mesh,
                                           const std::vector<placement>& pls) {
  const u64 n = numel(full), ranks = numel(mesh);
  std::vector<std::vector<std::vector<bool>>> held;
  for (u64 r = 0; r < ranks; ++r) held.push_back(held_indices(full, mesh, coords_of(r, mesh), pls));
  std::vector<std::vector<u64>> owners(n);
  for (u64 e = 0; e < n; ++e) {
    const shape_t idx = coords_of(e, full);  // row-major multi-index of e
    for (u64 r = 0; r < ranks; ++r) {
      bool all = true;
      for (std::size_t d = 0; d < full.size() && all; ++d) all = held[r][d][idx[d]];
      if (all) owners[e].push_back(r);
    }
  }
  return owners;
}

/// owners[e] from the specs: which ranks' blocks cover element e (through the cursors).
std::vector<std::vector<u64>> spec_owners(const shape_t& full, const std::vector<block_spec>& blocks) {
  std::vector<std::vector<u64>> owners(numel(full));
  for (u64 r = 0; r < blocks.size(); ++r) {
    blocks[r].validate(full, "block");
    u64 local = 0;
    for (auto c = blocks[r].cursor(full); !c.done(); c.next()) {
      const spec_run run = c.run();
      CHECK(run.local == local);  // local data in increasing global order, no gaps
      local += run.end - run.begin;
      for (u64 e = run.begin; e < run.end; ++e) owners[e].push_back(r);
    }
    CHECK(local == blocks[r].local_numel());
  }
  return owners;
}

std::string describe(const shape_t& full, const shape_t& mesh, const std::vector<placement>& pls) {
  return "tensor " + to_string(full) + " on mesh " + to_string(mesh) + " " + to_string(pls);
}

/// Every rank's block against the brute force, element by element; returns the blocks.
std::vector<block_spec> check_against_brute_force(const shape_t& full, const shape_t& mesh,
                                                  const std::vector<placement>& pls) {
  INFO(describe(full, mesh, pls));
  const auto blocks = mesh_blocks(full, mesh, pls, "t");
  REQUIRE(blocks.size() == numel(mesh));
  const auto want = brute_owners(full, mesh, pls), got = spec_owners(full, blocks);
  u64 bad = 0;
  for (u64 e = 0; e < want.size(); ++e)
    if (want[e] != got[e] && bad++ < 3)
      CHECK_MESSAGE(want[e] == got[e], "element " << e << " " << multi_index_string(full, e));
  CHECK(bad == 0);
  // every rank's own view agrees with the list (mesh_block through a device_mesh)
  for (u64 r = 0; r < blocks.size(); ++r) {
    const device_mesh dm(mesh, {}, r);
    CHECK(mesh_block(full, dm, pls, "t") == blocks[r]);
    CHECK(dm.coords() == coords_of(r, mesh));
    CHECK(dm.rank_of(dm.coords()) == r);
  }
  return blocks;
}

u64 replicas_of(const shape_t& mesh, const std::vector<placement>& pls) {
  u64 n = 1;
  for (std::size_t m = 0; m < mesh.size(); ++m)
    if (pls[m].is_replicate()) n *= mesh[m];
  return n;
}

}  // namespace

// ============================================================ torch.chunk along one dimension

TEST_CASE("mesh: torch_chunk matches slicing a list into ceil(n/k) pieces, empty pieces at n") {
  for (u64 n = 0; n <= 40; ++n)
    for (u64 k = 1; k <= 9; ++k) {
      std::vector<u64> items(n);
      for (u64 i = 0; i < n; ++i) items[i] = i;
      const auto pieces = chunk_list(items, k);
      for (u64 i = 0; i < k; ++i) {
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(i);
        const chunk_extent c = torch_chunk(n, k, i);
        if (i < pieces.size()) {
          REQUIRE(!pieces[i].empty());
          CHECK(c == chunk_extent{pieces[i].front(), pieces[i].size()});
        } else {
          CHECK(c == chunk_extent{n, 0});
        }
      }
    }
  // torch.chunk(arange(10), 4) gives 3, 3, 3, 1; chunk(arange(7), 8): seven of 1, then empty;
  // chunk(arange(10), 6): ceil = 2, so five pieces of 2 and the sixth rank gets nothing
  CHECK(torch_chunk(10, 4, 3) == chunk_extent{9, 1});
  CHECK(torch_chunk(7, 8, 7) == chunk_extent{7, 0});
  CHECK(torch_chunk(10, 6, 4) == chunk_extent{8, 2});
  CHECK(torch_chunk(10, 6, 5) == chunk_extent{10, 0});
  CHECK(torch_chunk(0, 3, 0) == chunk_extent{0, 0});
  // no overflow near the top of the range
  const u64 big = ~u64(0) - 16;
  CHECK(torch_chunk(big, 7, 6).offset + torch_chunk(big, 7, 6).size == big);
}

// ============================================================ against the brute force

TEST_CASE("mesh: every block matches the brute force over random meshes of 1-3 dims and tensors of 1-4 dims") {
  std::mt19937_64 rng(20261123);
  auto pick = [&](u64 lo, u64 hi) { return std::uniform_int_distribution<u64>(lo, hi)(rng); };
  u64 cases = 0, with_empty = 0, nested = 0, uneven = 0;
  for (int it = 0; it < 1500; ++it) {
    shape_t mesh(pick(1, 3));
    for (auto& s : mesh) s = pick(1, 8);
    if (numel(mesh) > 96) continue;
    shape_t full(pick(1, 4));
    for (auto& s : full) s = pick(1, 13);
    if (numel(full) > 1200) continue;
    std::vector<placement> pls;
    for (std::size_t m = 0; m < mesh.size(); ++m)
      pls.push_back(pick(0, 3) == 0 ? replicate() : shard(pick(0, full.size() - 1)));
    const auto blocks = check_against_brute_force(full, mesh, pls);
    ++cases;
    bool empty = false, uneven_here = false;
    std::set<std::size_t> dims;
    for (std::size_t m = 0; m < pls.size(); ++m)
      if (pls[m].is_shard() && !dims.insert(pls[m].dim).second && mesh[m] > 1) nested += 1;
    for (const auto& b : blocks) empty = empty || holds_nothing(b);
    for (std::size_t m = 0; m < pls.size(); ++m)
      if (pls[m].is_shard() && full[pls[m].dim] % mesh[m] != 0) uneven_here = true;
    with_empty += empty;
    uneven += uneven_here;
  }
  MESSAGE(cases << " cases: " << uneven << " uneven, " << with_empty << " with empty pieces, " << nested << " nested");
  // the generator must have reached the interesting corners
  CHECK(cases > 800);
  CHECK(with_empty > 100);
  CHECK(nested > 100);
  CHECK(uneven > 400);
}

TEST_CASE("mesh: tensors with a zero extent and size-1 mesh dimensions") {
  check_against_brute_force({0, 5}, {4}, {shard(0)});
  check_against_brute_force({3, 0}, {2, 2}, {shard(0), shard(1)});
  check_against_brute_force({6, 5}, {1, 1, 1}, {shard(0), shard(1), replicate()});
  check_against_brute_force({5}, {8, 8}, {shard(0), shard(0)});  // 5 elements over 64 nested ranks
}

// ============================================================ the named layouts

TEST_CASE("mesh: FSDP2 is shard(0) on a 1-D mesh, torch.chunk pieces including empty ones") {
  const std::vector<placement> fsdp{shard(0)};
  // [10, 6] over 4 ranks: ceil(10/4) = 3 rows, so 3, 3, 3, 1
  const auto b = check_against_brute_force({10, 6}, {4}, fsdp);
  CHECK(b[0] == block_spec({3, 6}, {0, 0}));
  CHECK(b[1] == block_spec({3, 6}, {3, 0}));
  CHECK(b[2] == block_spec({3, 6}, {6, 0}));
  CHECK(b[3] == block_spec({1, 6}, {9, 0}));
  // [10] over 8 ranks: ceil = 2, five ranks of 2 and three holding nothing (DTensor puts their
  // offset at the full extent)
  const auto v = check_against_brute_force({10}, {8}, fsdp);
  CHECK(v[4] == block_spec({2}, {8}));
  for (int r = 5; r < 8; ++r) {
    CHECK(holds_nothing(v[r]));
    CHECK(v[r] == block_spec({0}, {10}));
  }
}

TEST_CASE("mesh: TP column (shard(0)) and row (shard(1)) parallel weights") {
  const shape_t full{8, 6};
  const auto col = check_against_brute_force(full, {4}, {shard(0)});
  const auto row = check_against_brute_force(full, {4}, {shard(1)});
  for (u64 r = 0; r < 4; ++r) CHECK(col[r] == block_spec({2, 6}, {2 * r, 0}));
  // 6 columns over 4: ceil = 2, so 2, 2, 2 and an empty fourth
  CHECK(row[0] == block_spec({8, 2}, {0, 0}));
  CHECK(row[2] == block_spec({8, 2}, {0, 4}));
  CHECK(row[3] == block_spec({8, 0}, {0, 6}));
  // a column block's runs are its rows (8 runs of 2), a row block is one run per rank
  CHECK(merged_ranges_vector(row[1], full).size() == 8);
  CHECK(merged_ranges_vector(col[1], full).size() == 1);
}

TEST_CASE("mesh: HSDP [replicate(), shard(0)] gives each replica the same blocks, one writer per block") {
  const shape_t mesh{3, 4}, full{10, 3};
  const std::vector<placement> hsdp{replicate(), shard(0)};
  const auto b = check_against_brute_force(full, mesh, hsdp);
  for (u64 rep = 0; rep < 3; ++rep)
    for (u64 s = 0; s < 4; ++s) CHECK(b[rep * 4 + s] == b[s]);
  CHECK(b[3] == block_spec({1, 3}, {9, 0}));
  // rank 6 = [1, 2]: block 2, replica 1; writers go round the replicas: block k by replica k % 3
  const device_mesh m(mesh, {"replicate", "shard"}, 6);
  const replica_info info = mesh_replicas(m, hsdp);
  CHECK(info == replica_info{2, 4, 1, 3, 2});
  CHECK(!info.is_writer());
  CHECK(replica_ranks(m, hsdp) == std::vector<u64>{2, 6, 10});
  CHECK(writer_rank(m, hsdp) == 10);
  CHECK(writer_rank(m, hsdp, /*salt=*/1) == 2);
  // every block written once, writes spread: replicas 0, 1, 2 write blocks {0,3}, {1}, {2}
  std::map<u64, std::vector<u64>> writers_of_block;
  std::vector<u64> blocks_per_replica(3);
  for (u64 r = 0; r < 12; ++r) {
    const device_mesh dm = m.at_rank(r);
    if (writes_block(full, dm, hsdp, "w")) {
      writers_of_block[mesh_replicas(dm, hsdp).block_index].push_back(r);
      ++blocks_per_replica[dm.coords()[0]];
      CHECK(writer_rank(dm, hsdp) == r);
    }
  }
  CHECK(writers_of_block.size() == 4);
  for (const auto& [blk, ws] : writers_of_block) CHECK(ws.size() == 1);
  CHECK(blocks_per_replica == std::vector<u64>{2, 1, 1});
}

TEST_CASE("mesh: 2-D FSDP + TP nests shard(0) twice, or splits rows and columns") {
  const shape_t mesh{2, 3}, full{11, 7};
  // [shard(0), shard(0)]: rows 11 -> 6 | 5, then each into 3: 2,2,2 | 2,2,1
  const auto nest = check_against_brute_force(full, mesh, {shard(0), shard(0)});
  const std::vector<u64> rows{2, 2, 2, 2, 2, 1}, starts{0, 2, 4, 6, 8, 10};
  for (u64 r = 0; r < 6; ++r) CHECK(nest[r] == block_spec({rows[r], 7}, {starts[r], 0}));
  // [shard(0), shard(1)]: rows 6 | 5, columns 3 | 3 | 1
  const auto grid = check_against_brute_force(full, mesh, {shard(0), shard(1)});
  CHECK(grid[5] == block_spec({5, 1}, {6, 6}));
  CHECK(grid[1] == block_spec({6, 3}, {0, 3}));
  // nesting where the outer piece is already short: 5 rows over [2, 4] -> 3 | 2, then
  // 3 -> 1,1,1,empty and 2 -> 1,1,empty,empty
  const auto shortp = check_against_brute_force({5, 2}, {2, 4}, {shard(0), shard(0)});
  CHECK(shortp[2] == block_spec({1, 2}, {2, 0}));
  CHECK(holds_nothing(shortp[3]));
  CHECK(shortp[5] == block_spec({1, 2}, {4, 0}));
  CHECK(holds_nothing(shortp[6]));
  CHECK(shortp[6] == block_spec({0, 2}, {5, 0}));
}

TEST_CASE("mesh: 3-D meshes (HSDP + TP, and three mesh dims on one tensor dim)") {
  const std::vector<placement> pls{replicate(), shard(0), shard(1)};
  const auto b = check_against_brute_force({9, 10}, {2, 3, 4}, pls);
  // rank 23 = [1, 2, 3]: rows 6..8, columns ceil(10/4) = 3 -> 9..9
  CHECK(b[23] == block_spec({3, 1}, {6, 9}));
  CHECK(b[23] == b[11]);
  check_against_brute_force({13, 3}, {2, 3, 2}, {shard(0), shard(0), shard(0)});
  check_against_brute_force({4, 5, 6, 7}, {2, 2, 3}, {shard(3), shard(1), shard(3)});
  const device_mesh m({2, 3, 4}, {"dp", "fsdp", "tp"}, shape_t{1, 2, 3});
  CHECK(m.rank() == 23);
  CHECK(m.dim_index("tp") == 2);
  CHECK(m.size("fsdp") == 3);
  CHECK(replica_ranks(m, pls) == std::vector<u64>{11, 23});
}

TEST_CASE("mesh: replica groups are exactly the ranks with equal non-empty blocks; one writer each") {
  std::mt19937_64 rng(7);
  auto pick = [&](u64 lo, u64 hi) { return std::uniform_int_distribution<u64>(lo, hi)(rng); };
  for (int it = 0; it < 300; ++it) {
    shape_t mesh(pick(1, 3));
    for (auto& s : mesh) s = pick(1, 5);
    shape_t full(pick(1, 3));
    for (auto& s : full) s = pick(1, 9);
    std::vector<placement> pls;
    for (std::size_t m = 0; m < mesh.size(); ++m)
      pls.push_back(pick(0, 2) == 0 ? replicate() : shard(pick(0, full.size() - 1)));
    INFO(describe(full, mesh, pls));
    const auto blocks = mesh_blocks(full, mesh, pls, "t");
    const u64 salt = pick(0, 10);
    std::map<std::pair<shape_t, shape_t>, std::vector<u64>> by_block;  // non-empty blocks -> ranks
    for (u64 r = 0; r < blocks.size(); ++r)
      if (!holds_nothing(blocks[r])) by_block[{blocks[r].local_shape(), blocks[r].global_offset()}].push_back(r);
    for (const auto& [blk, ranks] : by_block) {
      CHECK(ranks.size() == replicas_of(mesh, pls));
      u64 writers = 0;
      for (u64 r : ranks) {
        const device_mesh dm(mesh, {}, r);
        CHECK(replica_ranks(dm, pls) == ranks);
        writers += writes_block(full, dm, pls, "t", salt);
        CHECK(writer_rank(dm, pls, salt) == writer_rank(device_mesh(mesh, {}, ranks[0]), pls, salt));
      }
      CHECK(writers == 1);
    }
  }
}

TEST_CASE("mesh: errors name the tensor and the rule") {
  const device_mesh m({2, 4}, {"dp", "tp"}, 3);
  CHECK(m.coords() == shape_t{0, 3});
  const shape_t full{8, 6};
  testing::expect_error([&] { mesh_block(full, m, {shard(0)}, "tensor 'w'"); }, errc::invalid_spec,
                        {"tensor 'w'", "1 placements", "2 dimensions", "one per mesh dimension"});
  testing::expect_error([&] { mesh_block(full, m, {replicate(), shard(2)}, "tensor 'w'"); }, errc::invalid_spec,
                        {"tensor 'w'", "Shard(2)", "mesh dimension 1", "[8,6] has 2"});
  testing::expect_error([&] { device_mesh({2, 4}, {}, 8); }, errc::invalid_argument, {"rank 8", "8 ranks"});
  testing::expect_error([&] { device_mesh({2, 0}, {}, 0); }, errc::invalid_argument, {"dimension 1 has no ranks"});
  testing::expect_error([&] { device_mesh({2, 4}, {"a", "a"}, 0); }, errc::invalid_argument, {"both named 'a'"});
  testing::expect_error([&] { device_mesh({2, 4}, {"a"}, 0); }, errc::invalid_argument, {"1 dimension names"});
  testing::expect_error([&] { device_mesh({2, 4}, {}, shape_t{1, 4}); }, errc::invalid_argument,
                        {"coordinate 4", "dimension 1"});
  testing::expect_error([&] { (void)m.dim_index("ep"); }, errc::not_found, {"no dimension named 'ep'", "'dp', 'tp'"});
}

// ============================================================ a resharded load, end to end

TEST_CASE("mesh: a save under one mesh covers a load under another exactly once per element") {
  // saved: HSDP [2, 3] (the writers' blocks only); loaded: FSDP + TP [2, 2]
  const shape_t full{17, 10};
  const std::vector<placement> saved_pls{replicate(), shard(0)}, load_pls{shard(0), shard(1)};
  std::vector<shard_spec> files;
  for (u64 r = 0; r < 6; ++r) {
    const device_mesh dm({2, 3}, {}, r);
    if (writes_block(full, dm, saved_pls, "w")) files.push_back(mesh_block(full, dm, saved_pls, "w"));
  }
  CHECK(files.size() == 3);  // each of the 3 distinct blocks once
  for (u64 r = 0; r < 4; ++r) {
    const block_spec mine = mesh_block(full, device_mesh({2, 2}, {}, r), load_pls, "w");
    const load_plan p = plan_load(mine, files, full);
    CHECK(p.missing.empty());
    CHECK(p.covered == mine.local_numel());
  }
}

// ============================================================ replicas written once (save_flat_views)

namespace {

/// One rank of an HSDP world [2 replicas, 2 shards]: "w" [10, 3] and "b" [5], both
/// [replicate(), shard(0)], their values their global flat index (+ 1000 for b).
struct hsdp_rank {
  std::vector<float> w, b;
  std::vector<flat_view> views;
  hsdp_rank(int rank, bool declare) {
    const device_mesh mesh({2, 2}, {"replicate", "shard"}, static_cast<u64>(rank));
    const std::vector<placement> pls{replicate(), shard(0)};
    auto add = [&](const std::string& key, const shape_t& full, std::vector<float>& mem, float base, u64 salt) {
      const block_spec blk = mesh_block(full, mesh, pls, key);
      for (auto c = blk.cursor(full); !c.done(); c.next())
        for (u64 e = c.run().begin; e < c.run().end; ++e) mem.push_back(base + static_cast<float>(e));
      flat_view v{key, dtype::F32, full, blk, reinterpret_cast<std::byte*>(mem.data()), mem.size() * sizeof(float)};
      if (declare) v.replica = mesh_replica_role(mesh, pls, salt);
      views.push_back(v);
    };
    w.reserve(15);
    b.reserve(3);
    add("w", {10, 3}, w, 0.f, 0);
    add("b", {5}, b, 1000.f, 1);  // salt 1: b's blocks go to the other replicas
  }
};

/// Tensor data bytes per name in one rank file.
std::map<std::string, u64> data_in(const memory_directory& dir, int rank) {
  const auto f = dir.open(rank_file_name(rank));
  const safetensors_header h = read_safetensors_header(f);
  std::map<std::string, u64> out;
  for (const auto& t : h.tensors) out[t.name] = t.nbytes();
  return out;
}

}  // namespace

TEST_CASE("mesh: HSDP replicas are written once, by the writer replica; the checkpoint loads bit-exact") {
  constexpr int n = 4;
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:hsdp");
  std::vector<save_stats> stats(n);
  auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
    hsdp_rank s(c.rank(), true);
    stats[c.rank()] = save(mem, std::span<const flat_view>(s.views), c);
  });
  for (int r = 0; r < n; ++r) REQUIRE_FALSE(thrown[r]);
  // Worked by hand: w's blocks are rows 0-4 (block 0) and 5-9 (block 1), written by replica
  // 0 and 1: ranks 0 ([0,0]) and 3 ([1,1]). b's are [0,3) and [3,5), salt 1: replica 1 and 0:
  // ranks 2 ([1,0]) and 1 ([0,1]).
  const std::vector<std::map<std::string, u64>> want{{{"w", 60}}, {{"b", 8}}, {{"b", 12}}, {{"w", 60}}};
  u64 data = 0;
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(data_in(mem, r) == want[r]);
    CHECK(stats[r].tensors_written == 1);
    CHECK(stats[r].bytes_written == mem.open(rank_file_name(r)).size());
    for (const auto& [k, bytes] : data_in(mem, r)) data += bytes;
  }
  CHECK(data == (30 + 5) * sizeof(float));  // every element once
  auto md_file = mem.open(metadata_file_name);
  const auto md = read_checkpoint_metadata(md_file);
  CHECK(md.find("w")->files.size() == 2);
  CHECK(md.find("b")->files.size() == 2);
  // the whole tensors back, bit-exact
  std::vector<float> w(30), b(5);
  std::vector<flat_view> into{{"w", dtype::F32, {10, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 120},
                              {"b", dtype::F32, {5}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), 20}};
  load(mem, std::span<const flat_view>(into));
  for (int i = 0; i < 30; ++i) CHECK(w[i] == static_cast<float>(i));
  for (int i = 0; i < 5; ++i) CHECK(b[i] == 1000.f + static_cast<float>(i));

  // the same shards with no roles declared: identical shards are accepted and each holder
  // writes its own (the behaviour before roles), twice the bytes
  const memory_directory twice(store, "mem:undeclared");
  thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
    hsdp_rank s(c.rank(), false);
    stats[c.rank()] = save(twice, std::span<const flat_view>(s.views), c);
  });
  for (int r = 0; r < n; ++r) {
    REQUIRE_FALSE(thrown[r]);
    const u64 w_rows = 5, b_len = r % 2 == 0 ? 3 : 2;
    CHECK(data_in(twice, r) == std::map<std::string, u64>{{"w", w_rows * 3 * 4}, {"b", b_len * 4}});
  }
  std::fill(w.begin(), w.end(), -1.f);
  load(twice, std::span<const flat_view>(into));
  for (int i = 0; i < 30; ++i) CHECK(w[i] == static_cast<float>(i));
}

TEST_CASE("mesh: the save's agreement rejects overlapping shards that are not declared replicas of one writer") {
  constexpr int n = 4;
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:bad");
  auto errors_when = [&](const std::function<void(int, std::vector<flat_view>&)>& change) {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      hsdp_rank s(c.rank(), true);
      change(c.rank(), s.views);
      save(mem, std::span<const flat_view>(s.views), c, save_options{.overwrite = true});
    });
    std::vector<std::string> what;
    for (int r = 0; r < n; ++r) {
      REQUIRE(thrown[r]);
      try {
        std::rethrow_exception(thrown[r]);
      } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        what.push_back(e.what());
      }
    }
    for (const auto& w : what) CHECK(w == what[0]);  // the same error on every rank
    return what[0];
  };
  auto has = [](const std::string& what, const std::vector<std::string>& phrases) {
    for (const auto& p : phrases) CHECK_MESSAGE(what.find(p) != std::string::npos, what, " / ", p);
  };
  SUBCASE("two different shards, neither a replica") {
    has(errors_when([](int r, std::vector<flat_view>& v) {
          for (auto& x : v) x.replica = replica_role::none;
          if (r == 2) v[0].spec = block_spec({5, 3}, {1, 0});  // rows 1-5: meets rank 0's and rank 1's
          if (r == 3) v[0].spec = block_spec({5, 3}, {4, 0});
        }),
        {"tensor 'w' [10,3]", "rank 0's shard block [5,3] at [0,0] and rank 2's shard block [5,3] at [1,0]",
         "share 12 elements", "index [1,0]", "declared replicas"});
  }
  SUBCASE("two writers of one shard") {
    has(errors_when([](int r, std::vector<flat_view>& v) {
          if (r == 2) v[0].replica = replica_role::writer;
        }),
        {"tensor 'w'", "ranks 0 and 2 are both the writer of the replicated shard block [5,3] at [0,0]"});
  }
  SUBCASE("a copy with no writer") {
    has(errors_when([](int r, std::vector<flat_view>& v) {
          if (r == 0) v[0].replica = replica_role::copy;
        }),
        {"tensor 'w'", "rank 0 holds block [5,3] at [0,0] as a replica copy", "no rank is the writer"});
  }
  SUBCASE("a different block overlapping a replica group") {
    // rank 1 (a copy of w's rows 5-9) claims rows 4-8 as a writer instead
    has(errors_when([](int r, std::vector<flat_view>& v) {
          if (r != 1) return;
          v[0].spec = block_spec({5, 3}, {4, 0});
          v[0].replica = replica_role::writer;
        }),
        {"tensor 'w'", "rank 0's shard block [5,3] at [0,0] and rank 1's shard block [5,3] at [4,0]",
         "share 3 elements", "index [4,0]"});
  }
  SUBCASE("a replica role on a tensor that is not sharded") {
    has(errors_when([](int, std::vector<flat_view>& v) {
          v[1].spec = std::nullopt;
          v[1].full_shape = {v[1].nbytes / 4};
        }),
        {"tensor 'b'", "declared a replica", "no shard spec"});
  }
}

// ============================================================ torch 1.13's torch.chunk

namespace {

struct table_case {
  shape_t full, mesh;
  std::vector<placement> pls;
};

std::string csv(const shape_t& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

/// SHA-256 of the block's elements' global flat indices, in its row-major order, as LE int64.
std::string block_hash(const block_spec& b, const shape_t& full) {
  std::string bytes;
  for (auto c = b.cursor(full); !c.done(); c.next())
    for (u64 e = c.run().begin; e < c.run().end; ++e)
      for (int i = 0; i < 8; ++i) bytes += static_cast<char>((e >> (8 * i)) & 0xff);
  return testing::sha256_hex(bytes);
}

}  // namespace

TEST_CASE("mesh: a fixed table of layouts agrees with torch 1.13's nested torch.chunk (shape, offset, element hash)" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(),
                  "SHARDSAFE_REQUIRE_PYTHON=1 but " << testing::torch_python << " cannot import torch");
  const std::vector<table_case> table{
      {{10, 6}, {4}, {shard(0)}},                                 // FSDP2, 3,3,3,1
      {{10}, {8}, {shard(0)}},                                    // empty trailing pieces
      {{7}, {8}, {shard(0)}},                                     // more ranks than elements
      {{8, 6}, {4}, {shard(1)}},                                  // TP row parallel, an empty column piece
      {{10, 3}, {3, 4}, {replicate(), shard(0)}},                 // HSDP
      {{11, 7}, {2, 3}, {shard(0), shard(0)}},                    // FSDP + TP on one dimension
      {{11, 7}, {2, 3}, {shard(0), shard(1)}},                    // FSDP + TP, rows and columns
      {{5, 2}, {2, 4}, {shard(0), shard(0)}},                     // nested with a short outer piece
      {{9, 10}, {2, 3, 4}, {replicate(), shard(0), shard(1)}},    // HSDP + TP
      {{13, 3}, {2, 3, 2}, {shard(0), shard(0), shard(0)}},       // three levels of nesting
      {{4, 5, 6, 7}, {2, 2, 3}, {shard(3), shard(1), shard(3)}},  // 4-D tensor, interleaved
      {{3, 1, 9, 2}, {3, 5}, {shard(2), shard(0)}},
      {{6, 4}, {1, 2, 1}, {shard(1), replicate(), shard(0)}},  // size-1 mesh dimensions
      {{2, 3}, {8}, {shard(1)}},
  };
  testing::temp_dir dir("mesh");
  std::string lines;
  for (const auto& c : table) {
    std::string p;
    for (std::size_t i = 0; i < c.pls.size(); ++i)
      p += (i ? "," : "") + (c.pls[i].is_shard() ? "s" + std::to_string(c.pls[i].dim) : std::string("r"));
    lines += csv(c.full) + ";" + csv(c.mesh) + ";" + p + "\n";
  }
  testing::write_file(dir.path / "cases.txt", lines);
  const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "mesh_chunk_fixture.py";
  const auto r = testing::peer(testing::torch_python, {script.string(), (dir.path / "cases.txt").string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);

  std::istringstream in(r.out);
  std::string line;
  u64 seen = 0, empties = 0;
  std::vector<std::vector<block_spec>> blocks;
  for (const auto& c : table) blocks.push_back(mesh_blocks(c.full, c.mesh, c.pls, "t"));
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::size_t ci = 0;
    u64 rank = 0;
    std::string shape_s;
    ls >> ci >> rank >> shape_s;
    REQUIRE(ci < table.size());
    REQUIRE(rank < blocks[ci].size());
    const auto& c = table[ci];
    const block_spec& b = blocks[ci][rank];
    INFO(describe(c.full, c.mesh, c.pls) << " rank " << rank << ": torch says " << line << ", shardsafe "
                                         << to_string(b));
    ++seen;
    if (shape_s == "empty") {
      ++empties;
      CHECK(holds_nothing(b));
      continue;
    }
    std::string offset_s, hash;
    ls >> offset_s >> hash;
    CHECK(csv(b.local_shape()) == shape_s);
    CHECK(csv(b.global_offset()) == offset_s);
    CHECK(block_hash(b, c.full) == hash);
  }
  u64 want = 0;
  for (const auto& c : table) want += numel(c.mesh);
  CHECK(seen == want);  // every rank of every case answered
  CHECK(empties > 10);
}

// ============================================================ expert parallelism
//
// A mixture-of-experts layer as an EP job holds it: stacked expert weights [E, ...] on an
// ("ep", "ep_fsdp") mesh by [shard(0), shard(1)] (one with E = 6 over EP = 4: the last EP rank
// holds no expert), a router HSDP-like [replicate(), shard(0)] (replicas declared, written
// once) and a norm every rank holds whole. Element e of tensor `id` holds id * 100000 + e
// (exact in F32). Expected values are computed here by walking each block's local multi-index
// by hand (no cursor, no copy plan of the library).

namespace {

struct moe_tensor {
  std::string key;
  shape_t full;
  std::vector<placement> pls;  // empty: not sharded (every rank holds it whole)
  u64 id;
};

std::vector<moe_tensor> moe_model() {
  return {
      {"model.layers.0.mlp.experts.gate_proj.weight", {8, 6, 5}, {shard(0), shard(1)}, 1},
      {"model.layers.0.mlp.experts.down_proj.weight", {6, 5, 7}, {shard(0), shard(1)}, 2},
      {"model.layers.0.mlp.router.weight", {8, 5}, {replicate(), shard(0)}, 3},
      {"model.norm.weight", {5}, {}, 4},
  };
}

float moe_value(u64 id, u64 e) { return static_cast<float>(id * 100000 + e); }

/// The values of block b of a tensor of shape full, row-major over the block, by hand.
std::vector<float> block_values(const shape_t& full, const shape_t& local, const shape_t& offset, u64 id) {
  std::vector<float> out;
  const u64 n = numel(local);
  shape_t idx(full.size(), 0);
  for (u64 k = 0; k < n; ++k) {
    u64 g = 0;
    for (std::size_t d = 0; d < full.size(); ++d) g = g * full[d] + offset[d] + idx[d];
    out.push_back(moe_value(id, g));
    for (std::size_t d = local.size(); d-- > 0;) {
      if (++idx[d] < local[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

/// One rank's tensors of the MoE model: on a mesh (shape mesh, "ep" x "ep_fsdp"), as whole
/// tensors (mesh empty), or as FSDP flat shards (torch.chunk of the flattened tensor over
/// flat_world ranks). Filled with the values, or with -1 to be loaded into.
struct moe_rank {
  std::vector<std::vector<float>> mem;
  std::vector<flat_view> views;
  std::vector<std::vector<float>> want;

  moe_rank(const shape_t& mesh, u64 rank, bool fill, bool roles = true, u64 flat_world = 0) {
    const auto model = moe_model();
    mem.reserve(model.size());
    for (std::size_t t = 0; t < model.size(); ++t) {
      const moe_tensor& m = model[t];
      std::optional<shard_spec> spec;
      replica_role role = replica_role::none;
      if (flat_world > 0) {  // FSDP flat parameters: no expert parallelism
        const chunk_extent c = torch_chunk(numel(m.full), flat_world, rank);
        spec = flat_spec{{c.offset, c.offset + c.size}};
        want.push_back({});
        for (u64 e = c.offset; e < c.offset + c.size; ++e) want.back().push_back(moe_value(m.id, e));
      } else if (!mesh.empty() && !m.pls.empty()) {
        const device_mesh dm(mesh, {"ep", "ep_fsdp"}, rank);
        const block_spec b = mesh_block(m.full, dm, m.pls, m.key);
        spec = b;
        if (roles) role = mesh_replica_role(dm, m.pls, /*salt=*/t);
        want.push_back(block_values(m.full, b.local_shape(), b.global_offset(), m.id));
      } else {
        want.push_back(block_values(m.full, m.full, shape_t(m.full.size(), 0), m.id));
      }
      mem.push_back(fill ? want.back() : std::vector<float>(want.back().size(), -1.f));
      flat_view v{m.key,
                  dtype::F32,
                  m.full,
                  spec,
                  reinterpret_cast<std::byte*>(mem.back().data()),
                  mem.back().size() * sizeof(float)};
      v.replica = role;
      views.push_back(v);
    }
  }
  void check(const std::string& what) const {
    for (std::size_t t = 0; t < views.size(); ++t) {
      INFO(what << ": tensor " << views[t].key);
      u64 bad = 0;
      for (std::size_t i = 0; i < want[t].size(); ++i) bad += mem[t][i] != want[t][i];
      CHECK(bad == 0);
    }
  }
};

/// Saves the MoE model from an EP mesh [ep, ep_fsdp] of thread ranks into dir.
void save_moe(const memory_directory& dir, const shape_t& mesh) {
  const int n = static_cast<int>(numel(mesh));
  auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
    moe_rank r(mesh, static_cast<u64>(c.rank()), true);
    save(dir, std::span<const flat_view>(r.views), c);
  });
  for (int r = 0; r < n; ++r) REQUIRE_FALSE(thrown[r]);
}

}  // namespace

TEST_CASE(
    "mesh: expert parallelism EP=4 x ep_fsdp=2 saved once, loaded under EP=2 x 4, EP=1, whole and FSDP flat, "
    "bit-exact") {
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:ep");
  save_moe(mem, {4, 2});

  // one global tensor per stacked weight; every element stored once (the router's replicas
  // declared: each of its blocks written by one of its 4 replicas)
  auto md_file = mem.open(metadata_file_name);
  const auto md = read_checkpoint_metadata(md_file);
  CHECK(md.tensors.size() == 4);
  CHECK(md.find("model.layers.0.mlp.experts.gate_proj.weight")->shape == shape_t{8, 6, 5});
  CHECK(md.find("model.layers.0.mlp.experts.gate_proj.weight")->files.size() == 8);
  // E = 6 over EP = 4: pieces of 2, 2, 2 and none, so the two ranks of EP coordinate 3 write nothing of it
  CHECK(md.find("model.layers.0.mlp.experts.down_proj.weight")->files.size() == 8);
  CHECK(md.find("model.layers.0.mlp.router.weight")->files.size() == 2);
  u64 data = 0;
  for (int r = 0; r < 8; ++r)
    for (const auto& [k, bytes] : data_in(mem, r)) data += bytes;
  CHECK(data == (8 * 6 * 5 + 6 * 5 * 7 + 8 * 5 + 5) * sizeof(float));
  CHECK(data_in(mem, 6)["model.layers.0.mlp.experts.down_proj.weight"] == 0);

  SUBCASE("EP=2 x ep_fsdp=4, 8 ranks") {
    for (u64 r = 0; r < 8; ++r) {
      moe_rank into({2, 4}, r, false);
      load(mem, std::span<const flat_view>(into.views));
      into.check("EP=2 x 4, rank " + std::to_string(r));
    }
  }
  SUBCASE("EP=1 x ep_fsdp=4, 4 ranks") {
    for (u64 r = 0; r < 4; ++r) {
      moe_rank into({1, 4}, r, false);
      load(mem, std::span<const flat_view>(into.views));
      into.check("EP=1 x 4, rank " + std::to_string(r));
    }
  }
  SUBCASE("no expert parallelism: whole tensors in one process") {
    moe_rank into({}, 0, false);
    const load_stats st = load(mem, std::span<const flat_view>(into.views));
    CHECK(st.bytes_needed == data);
    into.check("whole");
  }
  SUBCASE("no expert parallelism: FSDP flat shards over 3 ranks") {
    for (u64 r = 0; r < 3; ++r) {
      moe_rank into({}, r, false, true, 3);
      load(mem, std::span<const flat_view>(into.views));
      into.check("flat, rank " + std::to_string(r));
    }
  }
}

TEST_CASE("mesh: an EP=2 x ep_fsdp=4 save loads under EP=4 x ep_fsdp=2") {
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:ep24");
  save_moe(mem, {2, 4});
  for (u64 r = 0; r < 8; ++r) {
    moe_rank into({4, 2}, r, false);
    load(mem, std::span<const flat_view>(into.views));
    into.check("EP=4 x 2, rank " + std::to_string(r));
  }
}

// ============================================================ HF expert stacking

namespace {

const char* const expert_rule = "^(.*\\.experts)\\.([^.]+\\.weight)$=\\1.{i}.\\2";

std::string f32_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

/// A Hugging Face folder of the MoE model with one tensor per expert, written by hand
/// (tests/support/checkpoint_fixtures.hpp): experts 0-3 of each weight in the first file, the rest and
/// the other tensors in the second; an index.
template <class D>
void make_per_expert_folder(const D& dir) {
  std::vector<fixtures::tensor> a, b;
  std::string map;
  u64 total = 0;
  for (const auto& m : moe_model()) {
    const auto all = block_values(m.full, m.full, shape_t(m.full.size(), 0), m.id);
    auto put = [&](const std::string& name, const shape_t& shape, std::vector<float> v, bool first) {
      (first ? a : b).push_back({name, "F32", shape, f32_bytes(v)});
      map += std::string(map.empty() ? "" : ", ") + "\"" + name + "\": \"" +
             (first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors") + "\"";
      total += v.size() * sizeof(float);
    };
    if (m.key.find(".experts.") == std::string::npos) {
      put(m.key, m.full, all, false);
      continue;
    }
    const shape_t rest(m.full.begin() + 1, m.full.end());
    const u64 S = numel(rest);
    const std::size_t dot = m.key.find(".experts.") + 9;
    for (u64 i = 0; i < m.full[0]; ++i)
      put(m.key.substr(0, dot) + std::to_string(i) + "." + m.key.substr(dot), rest,
          std::vector<float>(all.begin() + static_cast<std::ptrdiff_t>(i * S),
                             all.begin() + static_cast<std::ptrdiff_t>((i + 1) * S)),
          i < 4);
  }
  fixtures::put(dir, "model-00001-of-00002.safetensors", fixtures::build_file(a));
  fixtures::put(dir, "model-00002-of-00002.safetensors", fixtures::build_file(b));
  fixtures::put(dir, "model.safetensors.index.json",
                "{\"metadata\": {\"total_size\": " + std::to_string(total) + "}, \"weight_map\": {" + map + "}}");
}

}  // namespace

TEST_CASE("mesh: expert stacking splits a stacked view into per-expert views of its memory") {
  const expert_stacking rules({expert_rule});
  std::vector<float> m(12);
  // flat: [3, 2, 2] holding global elements [2, 7) and [9, 12): expert 0 gets [2, 4) from
  // local 0, expert 1 [0, 3) from local 2, expert 2 [1, 4) from local 5
  flat_view flat{"x.experts.w.weight",
                 dtype::F32,
                 {3, 2, 2},
                 flat_spec{{2, 7}, {9, 12}},
                 reinterpret_cast<std::byte*>(m.data()),
                 8 * 4};
  flat.replica = replica_role::copy;
  auto u = unstack_experts(std::span<const flat_view>(&flat, 1), rules, "t");
  REQUIRE(u.views.size() == 3);
  CHECK(u.stacked == 1);
  CHECK(u.elsewhere.empty());
  const std::vector<flat_spec> specs{flat_spec{{2, 4}}, flat_spec{{0, 3}}, flat_spec{{1, 4}}};
  const std::vector<u64> first{0, 2, 5}, count{2, 3, 3};
  for (u64 i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(u.views[i].key == "x.experts." + std::to_string(i) + ".w.weight");
    CHECK(u.views[i].full_shape == shape_t{2, 2});
    CHECK(u.views[i].spec == std::optional<shard_spec>(specs[i]));
    CHECK(u.views[i].data == flat.data + first[i] * 4);
    CHECK(u.views[i].nbytes == count[i] * 4);
    CHECK(u.views[i].replica == replica_role::copy);
    CHECK(u.expert[i] == i);
    CHECK(u.origin[i] == 0);
  }
  // block: experts 1-2 of [4, 3, 2], columns 1.. of each: [2, 3, 1] at [1, 0, 1]
  flat_view blk{"x.experts.w.weight",
                dtype::F32,
                {4, 3, 2},
                block_spec({2, 3, 1}, {1, 0, 1}),
                reinterpret_cast<std::byte*>(m.data()),
                6 * 4};
  flat_view other{"x.norm.weight", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(m.data() + 6), 8};
  const std::vector<flat_view> two{other, blk};
  u = unstack_experts(std::span<const flat_view>(two), rules, "t");
  REQUIRE(u.views.size() == 3);
  CHECK(u.views[0].key == "x.norm.weight");
  CHECK(u.views[1].key == "x.experts.1.w.weight");
  CHECK(u.views[2].spec == std::optional<shard_spec>(block_spec({3, 1}, {0, 1})));
  CHECK(u.views[2].data == blk.data + 3 * 4);
  CHECK(u.origin == std::vector<std::size_t>{0, 1, 1});
  CHECK(u.elsewhere == std::vector<std::string>{"x.experts.0.w.weight", "x.experts.3.w.weight"});
  // whole: every expert, back to back
  flat_view whole{"x.experts.w.weight", dtype::F32, {3, 4}, std::nullopt, reinterpret_cast<std::byte*>(m.data()), 48};
  u = unstack_experts(std::span<const flat_view>(&whole, 1), rules, "t");
  REQUIRE(u.views.size() == 3);
  CHECK(u.views[2].data == whole.data + 32);
  CHECK(!u.views[2].spec);

  testing::expect_error([] { expert_stacking({"^(.*)\\.experts\\.(.*)$=\\1.\\2"}); }, errc::invalid_argument,
                        {"expert stacking rule", "no '{i}'"});
  flat_view scalar{"x.experts.s.weight", dtype::F32, {}, std::nullopt, reinterpret_cast<std::byte*>(m.data()), 4};
  testing::expect_error([&] { unstack_experts(std::span<const flat_view>(&scalar, 1), rules, "ctx"); },
                        errc::invalid_argument, {"ctx: tensor 'x.experts.s.weight'", "0-d", "no expert dimension"});
  const std::vector<flat_view> clash{
      whole,
      flat_view{"x.experts.1.w.weight", dtype::F32, {4}, std::nullopt, reinterpret_cast<std::byte*>(m.data()), 16}};
  testing::expect_error([&] { unstack_experts(std::span<const flat_view>(clash), rules, "ctx"); },
                        errc::invalid_argument, {"two views are named 'x.experts.1.w.weight'"});
}

TEST_CASE("mesh: an HF folder of per-expert tensors imports into stacked EP shards; each rank reads only its experts") {
  auto store = std::make_shared<memory_store>();
  const memory_directory hf(store, "mem:hf-experts");
  make_per_expert_folder(hf);
  for (const auto mode : {hf_import_mode::every_rank_read, hf_import_mode::rank0_broadcast}) {
    CAPTURE(to_string(mode));
    std::vector<hf_import_stats> res(8);
    std::vector<std::unique_ptr<moe_rank>> ranks(8);
    auto thrown = testing::run_ranks(8, [&](testing::thread_comm& c) {
      auto& r = ranks[c.rank()] = std::make_unique<moe_rank>(shape_t{4, 2}, c.rank(), false);
      hf_import_options opt;
      opt.experts = expert_stacking({expert_rule});
      opt.strict = true;
      opt.mode = mode;
      opt.load.reads.max_gap_bytes = 0;  // no merged reads: bytes read are bytes needed
      res[c.rank()] = import_hf(hf, std::span<const flat_view>(r->views), c, opt);
    });
    for (int r = 0; r < 8; ++r) {
      CAPTURE(r);
      REQUIRE_FALSE(thrown[r]);
      ranks[r]->check("rank " + std::to_string(r));
      const auto& k = res[r].keys;
      CHECK(k.missing_keys.empty());
      CHECK(k.unexpected_keys.empty());  // other ranks' experts are not unexpected
      if (mode != hf_import_mode::every_rank_read) continue;
      u64 mine = 0;
      for (const auto& v : ranks[r]->views) mine += v.nbytes;
      CHECK(res[r].stats.bytes_needed == mine);
      CHECK(res[r].stats.bytes_read == mine);
    }
    // rank 0 ([0, 0]) holds experts 0-1 of both stacked weights: 2 + 2 per-expert tensors,
    // the router and the norm
    CHECK(res[0].keys.loads.size() == 6);
    // ranks 6 and 7 (EP coordinate 3) hold no expert of down_proj (E = 6: pieces 2, 2, 2, none)
    CHECK(res[6].keys.loads.size() == 4);
  }
  // the same folder without the rule: the stacked keys are missing (listed, not strict), the
  // 14 experts unexpected
  moe_rank one({}, 0, false);
  single_process c;
  hf_import_options lenient;
  lenient.strict = false;
  const auto plain = import_hf(hf, std::span<const flat_view>(one.views), c, lenient);
  CHECK(plain.keys.missing_keys == std::vector<std::string>{"model.layers.0.mlp.experts.down_proj.weight",
                                                            "model.layers.0.mlp.experts.gate_proj.weight"});
  CHECK(plain.keys.unexpected_keys.size() == 14);
  // with it, in one process: everything, whole
  hf_import_options opt;
  opt.experts = expert_stacking({expert_rule});
  opt.strict = true;
  const auto whole = import_hf(hf, std::span<const flat_view>(one.views), c, opt);
  CHECK(whole.keys.loads.size() == 16);
  CHECK(whole.keys.unexpected_keys.empty());
  one.check("one process, whole");
}

namespace {

/// Loads every per-expert tensor of an exported folder whole (strict: each name must be there)
/// and compares it with its slice of the stacked tensor, computed by hand; nothing else may be
/// in the folder.
template <class D>
void check_per_expert_export(const D& out) {
  std::vector<std::vector<float>> mem, want;
  std::vector<flat_view> views;
  mem.reserve(32);
  for (const auto& m : moe_model()) {
    const auto all = block_values(m.full, m.full, shape_t(m.full.size(), 0), m.id);
    if (m.key.find(".experts.") == std::string::npos) {
      want.push_back(all);
      mem.emplace_back(all.size(), -1.f);
      views.push_back(
          {m.key, dtype::F32, m.full, std::nullopt, reinterpret_cast<std::byte*>(mem.back().data()), all.size() * 4});
      continue;
    }
    const shape_t rest(m.full.begin() + 1, m.full.end());
    const u64 S = numel(rest);
    const std::size_t dot = m.key.find(".experts.") + 9;
    for (u64 i = 0; i < m.full[0]; ++i) {
      want.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(i * S),
                        all.begin() + static_cast<std::ptrdiff_t>((i + 1) * S));
      mem.emplace_back(S, -1.f);
      views.push_back({m.key.substr(0, dot) + std::to_string(i) + "." + m.key.substr(dot), dtype::F32, rest,
                       std::nullopt, reinterpret_cast<std::byte*>(mem.back().data()), S * 4});
    }
  }
  REQUIRE(views.size() == 16);
  const load_stats st = load(out, std::span<const flat_view>(views));
  CHECK(st.unexpected_keys.empty());
  for (std::size_t t = 0; t < views.size(); ++t) {
    INFO(views[t].key);
    CHECK(mem[t] == want[t]);
  }
}

}  // namespace

TEST_CASE("mesh: a stacked EP model exports one HF tensor per expert, each equal to its slice") {
  testing::temp_dir dir("mesh-export");
  const fs::path out = dir.path / "hf";
  auto thrown = testing::run_ranks(8, [&](testing::thread_comm& c) {
    moe_rank r({4, 2}, c.rank(), true);
    hf_export_options opt;
    opt.max_shard_size = 600;  // several files and an index
    opt.experts = expert_stacking({expert_rule});
    export_to(std::span<const flat_view>(r.views), c, out, opt);
  });
  for (int r = 0; r < 8; ++r) REQUIRE_FALSE(thrown[r]);
  CHECK(fs::exists(out / "model.safetensors.index.json"));
  check_per_expert_export(file_directory(out));
}

TEST_CASE("mesh: a checkpoint saved under EP exports (export_hf) one HF tensor per expert, each equal to its slice") {
  auto store = std::make_shared<memory_store>();
  const memory_directory ckpt(store, "mem:ep-ckpt"), out(store, "mem:ep-hf");
  save_moe(ckpt, {4, 2});
  hf_export_options opt;
  opt.max_shard_size = 600;
  opt.experts = expert_stacking({expert_rule});
  const hf_export_stats st = export_to(ckpt, out, opt);
  CHECK(st.tensors == 16);
  CHECK(st.indexed);
  check_per_expert_export(out);
  // with a rename rule after the split: the per-expert names are renamed
  const memory_directory renamed(store, "mem:ep-hf-renamed");
  opt.rename.add("^model\\.=");
  export_to(ckpt, renamed, opt);
  CHECK(renamed.exists("model.safetensors.index.json"));
  std::vector<float> e3(30, -1.f);
  const flat_view v{"layers.0.mlp.experts.3.gate_proj.weight", dtype::F32, {6, 5}, std::nullopt,
                    reinterpret_cast<std::byte*>(e3.data()),   120};
  load(renamed, std::span<const flat_view>(&v, 1));
  for (u64 j = 0; j < 30; ++j) CHECK(e3[j] == moe_value(1, 3 * 30 + j));
  // a 0-d tensor cannot be split
  const memory_directory scalar(store, "mem:scalar");
  float x = 1.f;
  const flat_view sv{"x.experts.s.weight", dtype::F32, {}, std::nullopt, reinterpret_cast<std::byte*>(&x), 4};
  single_process one;
  save(scalar, std::span<const flat_view>(&sv, 1), one);
  hf_export_options o2;
  o2.experts = expert_stacking({expert_rule});
  testing::expect_error([&] { export_to(scalar, memory_directory(store, "mem:scalar-hf"), o2); },
                        errc::invalid_argument, {"tensor 'x.experts.s.weight'", "0-d"});
}

TEST_CASE("mesh: shardsafe to-hf --stack-experts writes one tensor per expert of an EP checkpoint" *
          doctest::skip(!testing::have_tool())) {
  testing::temp_dir dir("mesh-tool");
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:ep-tool");
  save_moe(mem, {4, 2});
  // the checkpoint copied to files, object by object
  fs::create_directories(dir.path / "ckpt");
  for (const auto& n : mem.list()) {
    auto f = mem.open(n);
    std::string bytes(f.size(), '\0');
    f.read_into(0, std::as_writable_bytes(std::span<char>(bytes)));
    testing::write_file(dir.path / "ckpt" / n, bytes);
  }
  const auto r = testing::run_tool({"to-hf", (dir.path / "ckpt").string(), (dir.path / "hf").string(),
                                    "--max-shard-size", "600", "--stack-experts", expert_rule});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  check_per_expert_export(file_directory(dir.path / "hf"));
  // a rule without {i} is a usage error
  const auto bad = testing::run_tool({"to-hf", (dir.path / "ckpt").string(), (dir.path / "hf2").string(),
                                      "--stack-experts", "^(.*)\\.experts\\.(.*)$=\\1.\\2"});
  CHECK(bad.code == 2);
  CHECK(bad.err.find("no '{i}'") != std::string::npos);
  CHECK_FALSE(fs::exists(dir.path / "hf2"));
}

// --- the compact form of metadata.json (shard/shard_grid.hpp, docs/FORMAT.md §2) -------------

namespace {

/// One rank of an 8-rank world [2 dp, 4 tp], its tensors sharded in the regular ways a save
/// meets, each element's value its global flat index plus the tensor's base:
///   emb  [37, 5]  flat, chunks of 24 over ranks 0-7 (FSDP's even flat split)
///   tiny [5]      flat, chunks of 1: ranks 5-7 hold nothing
///   m    [8, 6]   [shard(0), shard(1)]: rows over dp, columns over tp (tp 3's piece empty)
///   q    [10, 6]  [replicate(), shard(0)], replicas declared (writers spread by the salt)
///   norm [6]      not sharded: rank 0 writes it
struct grid_rank {
  std::vector<std::vector<float>> mem;
  std::vector<flat_view> views;
  explicit grid_rank(int rank) {
    const device_mesh mesh({2, 4}, {"dp", "tp"}, static_cast<u64>(rank));
    mem.reserve(5);
    auto add = [&](const std::string& key, const shape_t& full, std::optional<shard_spec> spec, float base) {
      auto& m = mem.emplace_back();
      const shard_spec s = spec ? *spec : shard_spec(flat_spec{{0, numel(full)}});
      for (auto c = s.cursor(full); !c.done(); c.next())
        for (u64 e = c.run().begin; e < c.run().end; ++e) m.push_back(base + static_cast<float>(e));
      views.push_back({key, dtype::F32, full, spec, reinterpret_cast<std::byte*>(m.data()), m.size() * sizeof(float)});
    };
    const u64 r = static_cast<u64>(rank);
    add("emb", {37, 5}, shard_spec(flat_spec{{std::min<u64>(185, 24 * r), std::min<u64>(185, 24 * r + 24)}}), 0.f);
    add("tiny", {5}, shard_spec(flat_spec{{std::min<u64>(5, r), std::min<u64>(5, r + 1)}}), 500.f);
    const std::vector<placement> both{shard(0), shard(1)}, rows{replicate(), shard(0)};
    add("m", {8, 6}, shard_spec(mesh_block(shape_t{8, 6}, mesh, both, "m")), 1000.f);
    add("q", {10, 6}, shard_spec(mesh_block(shape_t{10, 6}, mesh, rows, "q")), 2000.f);
    views.back().replica = mesh_replica_role(mesh, rows, 0);
    add("norm", {6}, std::nullopt, 3000.f);
  }
};

}  // namespace

TEST_CASE("mesh: the compact form - grids for regular shardings, checksums beside the files, the same loads") {
  constexpr int n = 8;
  testing::temp_dir tmp("grid");
  const file_directory listed(tmp.path / "listed"), compact(tmp.path / "compact");
  for (const auto form : {metadata_form::automatic, metadata_form::compact}) {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      grid_rank s(c.rank());
      save_options opt;
      opt.metadata = form;
      save(form == metadata_form::compact ? compact : listed, std::span<const flat_view>(s.views), c, opt);
    });
    for (int r = 0; r < n; ++r) REQUIRE_FALSE(thrown[r]);
  }
  // a small world's automatic form is the listed one (OLMo-core reads it)
  const auto lmd = read_checkpoint_metadata(listed.open(metadata_file_name));
  const auto cmd = read_checkpoint_metadata(compact.open(metadata_file_name));
  for (const auto& [k, t] : lmd.tensors) CHECK_MESSAGE(!t.grid, k);
  CHECK(lmd.extras.checksums->files.size() == n);
  for (const char* k : {"emb", "tiny", "m"}) {
    CAPTURE(k);
    REQUIRE(cmd.find(k)->grid);
    CHECK(cmd.find(k)->files.empty());
  }
  CHECK(*cmd.find("emb")->grid == shard_grid{true, {24}, {8}, 0, {1}});
  CHECK(*cmd.find("m")->grid == shard_grid{false, {4, 2}, {2, 4}, 0, {4, 1}});
  CHECK(cmd.find("norm")->files.size() == 1);
  REQUIRE(cmd.extras.checksums);
  CHECK(cmd.extras.checksums->sidecars);
  CHECK(cmd.extras.checksums->files.empty());
  // the same rank files, byte for byte
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(testing::slurp(tmp.path / "listed" / rank_file_name(r)) ==
          testing::slurp(tmp.path / "compact" / rank_file_name(r)));
  }
  // an independent reading: Python expands each grid by docs/FORMAT.md's rule and compares it
  // with the listed form, and the sidecars with the listed form's checksum tables
  if (const auto py =
          testing::python("python3", {"-I", (fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "grid_expand.py").string(),
                                      (tmp.path / "listed").string(), (tmp.path / "compact").string()})) {
    const std::string grids = py->out.substr(0, py->out.find('\n'));
    CHECK(grids.rfind("grids: emb tiny m", 0) == 0);
  }
  // loaded in a 3-rank layout (rows / flat thirds), checksums checked: the same plan and the
  // same values from both forms, each element its formula's
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    std::vector<std::vector<float>> mem;
    std::vector<flat_view> want;
    mem.reserve(5);
    auto add = [&](const std::string& key, const shape_t& full, const shard_spec& spec) {
      mem.emplace_back(spec.local_numel(), -1.f);
      want.push_back(
          {key, dtype::F32, full, spec, reinterpret_cast<std::byte*>(mem.back().data()), mem.back().size() * 4});
    };
    const u64 ur = static_cast<u64>(r);
    add("emb", {37, 5}, flat_spec{{185 * ur / 3, 185 * (ur + 1) / 3}});
    add("tiny", {5}, flat_spec{{5 * ur / 3, 5 * (ur + 1) / 3}});
    add("m", {8, 6}, block_spec({3, 6}, {std::min<u64>(3 * ur, 8) - (r == 2 ? 1 : 0), 0}));
    add("q", {10, 6}, block_spec({10, 2}, {0, 2 * ur}));
    add("norm", {6}, flat_spec{{0, 6}});
    load_options lo;
    lo.verify_checksums = true;
    const load_stats a = load(listed, std::span<const flat_view>(want), lo);
    std::vector<std::vector<float>> from_listed = mem;
    for (auto& m : mem) std::fill(m.begin(), m.end(), -1.f);
    const load_stats b = load(compact, std::span<const flat_view>(want), lo);
    CHECK(mem == from_listed);
    CHECK(a.bytes_read == b.bytes_read);
    CHECK(a.read_ops == b.read_ops);
    CHECK(b.checksum_blocks > 0);
    CHECK(a.checksum_blocks == b.checksum_blocks);
    const float bases[] = {0.f, 500.f, 1000.f, 2000.f, 3000.f};
    for (std::size_t i = 0; i < want.size(); ++i) {
      u64 k = 0;
      const shard_spec spec = want[i].effective_spec();  // the cursor refers to it
      for (auto c = spec.cursor(want[i].full_shape); !c.done(); c.next())
        for (u64 e = c.run().begin; e < c.run().end; ++e) CHECK(mem[i][k++] == bases[i] + static_cast<float>(e));
    }
  }
  const checkpoint_report rep = verify_checkpoint(compact);
  CHECK(rep.checksums);
  CHECK(rep.tensors == 5);
  CHECK(rep.files == n);
  // a sidecar gone: loads that check checksums, and verify, name it; other loads never read it
  fs::remove(tmp.path / "compact" / "rank_7.checksums.json");
  std::vector<float> emb(185);
  const flat_view all{"emb", dtype::F32, {37, 5}, std::nullopt, reinterpret_cast<std::byte*>(emb.data()), 185 * 4};
  load(compact, std::span<const flat_view>(&all, 1));
  CHECK(emb[184] == 184.f);
  load_options lo;
  lo.verify_checksums = true;
  testing::expect_error([&] { load(compact, std::span<const flat_view>(&all, 1), lo); }, errc::not_found,
                        {"rank_7.checksums.json", "missing", "kept beside"});
  testing::expect_error([&] { verify_checkpoint(compact); }, errc::not_found, {"rank_7.checksums.json"});
}
