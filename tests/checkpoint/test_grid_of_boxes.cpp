// Rank 0 of a save over the tree finds each sharded tensor's grid from the boxes of the final
// partial description (detail::grid_of_boxes, issue 56), without expanding its entries. What it
// builds must be what the all-gather path builds from every rank's description
// (merge_descriptions, then detect_grid): checked on random grids, with and without replicas,
// whole and damaged; and at 16,384 ranks it expands no entry of a regular sharding.
#include "shardsafe/checkpoint/save_agree.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "support/random_grid.hpp"

using namespace shardsafe;

namespace {

/// One rank's entry of a sharded tensor.
struct held {
  std::uint64_t rank;
  shard_spec spec;
  replica_role role = replica_role::none;
};

/// A model: its sharded tensors' entries (in rank order), and a tensor every rank holds whole.
struct model {
  std::uint64_t world = 0;
  std::vector<std::pair<std::string, shape_t>> tensors;
  std::vector<std::vector<held>> entries;  ///< per tensor
};

/// What a save agrees on: the metadata with grids found (compact form), the checksum blocks, or
/// the error.
struct agreed {
  std::optional<checkpoint_metadata> md;
  std::uint64_t hashes = 0, expanded = 0;
  std::string error;
};

constexpr std::uint64_t block = 64;

/// The all-gather's way: every rank's description merged (checkpoint/save_agree.hpp), then each
/// tensor's grid looked for in its listed files.
agreed all_gather_way(const model& m) {
  std::vector<checkpoint_metadata> parts(m.world);
  std::vector<std::vector<replica_role>> roles(m.world);
  for (std::size_t t = 0; t < m.tensors.size(); ++t)
    for (const held& h : m.entries[t]) {
      tensor_metadata tm;
      tm.shape = m.tensors[t].second;
      tm.type = dtype::BF16;
      tm.is_sharded = true;
      tm.files.emplace_back(rank_file_name(h.rank), h.spec);
      parts[h.rank].tensors.emplace_back(m.tensors[t].first, std::move(tm));
      roles[h.rank].push_back(h.role);
    }
  for (std::uint64_t r = 0; r < m.world; ++r) {
    tensor_metadata bias;
    bias.shape = {3};
    bias.type = dtype::BF16;
    bias.files.emplace_back(rank_file_name(r), flat_spec{{0, 3}});
    parts[r].tensors.emplace_back("bias", std::move(bias));
  }
  agreed out;
  try {
    detail::agreed_description a = detail::agreed_whole(detail::merge_descriptions(parts, "ckpt", roles), block);
    for (auto& [key, tm] : a.md.tensors)
      if (auto g = detect_grid(tm)) {
        tm.grid = std::move(g);
        tm.files.clear();
      }
    out.md = std::move(a.md);
    out.hashes = a.checksum_hashes;
  } catch (const error& e) {
    out.error = e.what();
  }
  return out;
}

/// The tree's way: each rank's partial made alone, runs of consecutive ranks merged, the runs
/// merged in rank order, and rank 0's finish_partial in the compact form.
agreed tree_way(const model& m, std::mt19937_64& rng, metadata_form form = metadata_form::compact) {
  std::vector<std::vector<const held*>> of_rank(m.world);
  std::vector<std::vector<std::size_t>> tensor_of(m.world);
  for (std::size_t t = 0; t < m.tensors.size(); ++t)
    for (const held& h : m.entries[t]) {
      of_rank[h.rank].push_back(&h);
      tensor_of[h.rank].push_back(t);
    }
  auto partial = [&](std::uint64_t r) {
    detail::partial_description p;
    p.first = r;
    p.end = r + 1;
    for (std::size_t i = 0; i < of_rank[r].size(); ++i) {
      const held& h = *of_rank[r][i];
      const auto& [key, shape] = m.tensors[tensor_of[r][i]];
      p.add(key, shape, dtype::BF16, true, r, h.spec, h.role);
    }
    p.add("bias", {3}, dtype::BF16, false, r, flat_spec{{0, 3}}, replica_role::none);
    return p;
  };
  detail::partial_description all = partial(0);
  for (std::uint64_t at = 1; at < m.world;) {
    const std::uint64_t len =
        std::uniform_int_distribution<std::uint64_t>(1, std::min<std::uint64_t>(m.world - at, 64))(rng);
    detail::partial_description run = partial(at);
    for (std::uint64_t r = at + 1; r < at + len; ++r) run.merge(partial(r));
    all.merge(std::move(run));
    at += len;
  }
  agreed out;
  try {
    detail::agreed_description a = detail::finish_partial(all, m.world, "ckpt", form, block);
    out.md = std::move(a.md);
    out.hashes = a.checksum_hashes;
    out.expanded = a.entries_expanded;
  } catch (const error& e) {
    out.error = e.what();
  }
  return out;
}

/// The tensor's pieces of a grid as entries, or damaged, with roles; the world they need.
model random_model(std::mt19937_64& rng, int& kind) {
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
  };
  model m;
  while (true) {
    auto [g, full] = testing::random_grid(rng);
    try {
      validate(g, full, "random");
    } catch (const error&) {
      continue;
    }
    const auto parts = expand(g, full);
    std::vector<held> e;
    kind = static_cast<int>(pick(0, 2));  // 0: no roles; 1: writers, then their copies; 2: some writers
    for (const auto& [r, s] : parts)
      e.push_back({r, s, kind == 1 || (kind == 2 && pick(0, 1) == 0) ? replica_role::writer : replica_role::none});
    std::uint64_t world = parts.back().first + 1 + pick(0, 2);
    if (kind == 1) {  // HSDP: a second replica group after the first, every part copied
      const std::uint64_t shift = world;
      for (const auto& [r, s] : parts) e.push_back({r + shift, s, replica_role::copy});
      world += shift;
    }
    if (pick(0, 2) == 0) {  // damaged: one entry's spec, role or presence changed
      const std::size_t i = static_cast<std::size_t>(pick(0, e.size() - 1));
      const std::size_t j = static_cast<std::size_t>(pick(0, e.size() - 1));
      switch (pick(0, 4)) {
        case 0:  // moved by one element (kept inside the tensor)
          if (e[i].spec.is_flat() && e[i].spec.flat().ranges()[0].end < numel(full)) {
            const auto r = e[i].spec.flat().ranges()[0];
            e[i].spec = flat_spec{{r.begin + 1, r.end + 1}};
          } else if (e[i].spec.is_block()) {
            shape_t off = e[i].spec.block().global_offset();
            const shape_t ext = e[i].spec.block().local_shape();
            if (off[0] + ext[0] < full[0]) {
              ++off[0];
              e[i].spec = block_spec(ext, off);
            }
          }
          break;
        case 1:  // gone
          e.erase(e.begin() + static_cast<std::ptrdiff_t>(i));
          break;
        case 2:  // another entry's spec
          e[i].spec = e[j].spec;
          break;
        case 3:  // two entries' specs swapped
          std::swap(e[i].spec, e[j].spec);
          break;
        default:  // another role
          e[i].role = static_cast<replica_role>((static_cast<int>(e[i].role) + 1 + pick(0, 1)) % 3);
      }
    }
    if (e.empty()) continue;
    m.world = world;
    m.tensors.emplace_back("t", full);
    m.entries.push_back(std::move(e));
    return m;
  }
}

void same(const agreed& tree, const agreed& flat) {
  REQUIRE(tree.error == flat.error);
  if (!flat.md) return;
  REQUIRE(tree.md);
  CHECK(tree.hashes == flat.hashes);
  REQUIRE(tree.md->tensors.size() == flat.md->tensors.size());
  for (std::size_t t = 0; t < flat.md->tensors.size(); ++t) {
    const auto& [key, want] = flat.md->tensors[t];
    const auto& [tkey, got] = tree.md->tensors[t];
    CAPTURE(key);
    CHECK(tkey == key);
    CHECK(got.shape == want.shape);
    CHECK(got.is_sharded == want.is_sharded);
    CHECK(got.grid == want.grid);
    CHECK(got.files == want.files);
  }
}

}  // namespace

TEST_CASE("rank 0's grids found from boxes are the all-gather's: random grids, replicas, damaged ones") {
  std::mt19937_64 rng(5656);
  std::uint64_t from_boxes = 0, expanded = 0, errors = 0, with_copies = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    CAPTURE(trial);
    int kind = 0;
    const model m = random_model(rng, kind);
    const agreed flat = all_gather_way(m), tree = tree_way(m, rng);
    same(tree, flat);
    if (!flat.error.empty()) {
      ++errors;
    } else if (tree.expanded == 1) {  // the bias alone: the sharded tensor's grid came from its boxes
      ++from_boxes;
      with_copies += kind == 1;
      CHECK(tree.md->find("t")->grid);
    } else {
      ++expanded;
    }
  }
  MESSAGE("grids from boxes " << from_boxes << " (with copies " << with_copies << "), expanded " << expanded
                              << ", errors " << errors);
  CHECK(from_boxes > 1000);
  CHECK(with_copies > 200);
  CHECK(expanded > 200);  // damaged and irregular ones took the long way, to the same answer
  CHECK(errors > 200);
}

TEST_CASE("rank 0 finishes a 16,384-rank description expanding no entry of a regular sharding") {
  constexpr std::uint64_t world = 16384;
  model m;
  m.world = world;
  m.entries.resize(6);
  auto flat_pieces = [&](std::size_t t, std::uint64_t n, std::uint64_t ranks, replica_role role, std::uint64_t from) {
    const std::uint64_t c = (n + ranks - 1) / ranks;
    for (std::uint64_t r = 0; r < ranks; ++r)
      m.entries[t].push_back({from + r, flat_spec{{std::min(n, c * r), std::min(n, c * r + c)}}, role});
  };
  m.tensors.emplace_back("fsdp.large", shape_t{1000003});  // a short piece
  flat_pieces(0, 1000003, world, replica_role::none, 0);
  m.tensors.emplace_back("fsdp.small", shape_t{100, 100});  // fewer elements than ranks: empty pieces
  flat_pieces(1, 10000, world, replica_role::none, 0);
  m.tensors.emplace_back("hsdp", shape_t{3 * world / 2});  // two replica groups of 8,192
  flat_pieces(2, 3 * world / 2, world / 2, replica_role::writer, 0);
  flat_pieces(2, 3 * world / 2, world / 2, replica_role::copy, world / 2);
  // rows over 128, columns over 128, rank = row * 128 + column: [1020, 509] cuts evenly but the
  // last row and column (chunks 8 and 4), [1000, 500] leaves 3 rows and 3 columns of pieces empty
  auto tp_dp = [&](std::size_t t, std::uint64_t rows, std::uint64_t cols) {
    const std::uint64_t rc = (rows + 127) / 128, cc = (cols + 127) / 128;
    for (std::uint64_t r = 0; r < world; ++r) {
      const std::uint64_t i = r / 128, j = r % 128;
      const std::uint64_t r0 = std::min(rows, rc * i), r1 = std::min(rows, rc * i + rc);
      const std::uint64_t c0 = std::min(cols, cc * j), c1 = std::min(cols, cc * j + cc);
      m.entries[t].push_back({r, block_spec({r1 - r0, c1 - c0}, {r0, c0})});
    }
  };
  m.tensors.emplace_back("tp_dp", shape_t{1020, 509});
  tp_dp(3, 1020, 509);
  m.tensors.emplace_back("tp_dp.empty", shape_t{1000, 500});
  tp_dp(4, 1000, 500);
  m.tensors.emplace_back("rows", shape_t{2 * world, 8});
  for (std::uint64_t r = 0; r < world; ++r) m.entries[5].push_back({r, block_spec({2, 8}, {2 * r, 0})});
  std::mt19937_64 rng(16384);
  const agreed tree = tree_way(m, rng), flat = all_gather_way(m);
  same(tree, flat);
  REQUIRE(tree.md);
  for (std::size_t t = 0; t < 6; ++t) {
    CAPTURE(m.tensors[t].first);
    CHECK(bool(tree.md->tensors[t].second.grid) == (t != 4));  // empty block pieces: no grid, listed
  }
  // tp_dp.empty's 16,384 entries and the bias are expanded; no other tensor costs rank 0 an entry
  CHECK(tree.expanded == world + 1);
  // the listed form expands every entry of every tensor (what the counter counts)
  const agreed listed = tree_way(m, rng, metadata_form::listed);
  CHECK(listed.expanded == 6 * world + 1);
}

TEST_CASE("shards that surely leave elements out are named within a bounded walk, alike on both paths") {
  // two column blocks of 2^23 rows of a [2^40, 2] tensor: 2^24 runs before the first missing
  // element, more than a failing coverage check walks (coverage_walk_runs)
  model m;
  m.world = 2;
  m.tensors.emplace_back("long", shape_t{std::uint64_t(1) << 40, 2});
  m.entries.resize(1);
  for (std::uint64_t r = 0; r < 2; ++r) m.entries[0].push_back({r, block_spec({std::uint64_t(1) << 23, 1}, {0, r})});
  std::mt19937_64 rng(2);
  const agreed tree = tree_way(m, rng), flat = all_gather_way(m);
  same(tree, flat);
  CHECK(flat.error ==
        "ckpt: tensor 'long' [1099511627776,2]: the shards of all ranks are 16777216 elements in "
        "all, fewer than its 2199023255552; the shards of all ranks must cover the tensor");
  // within the walk, the first missing element is named, as before
  m.entries[0][1] = {1, block_spec({4, 1}, {0, 1})};
  const agreed near = all_gather_way(m);
  same(tree_way(m, rng), near);
  CHECK(near.error.find("no rank holds elements [9, 10)") != std::string::npos);
}
