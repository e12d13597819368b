// A save's description agreed up the binomial tree of ranks (checkpoint/description_tree.hpp,
// issue 56): boxes expand to exactly the entries appended, a grid's run of ranks is a few boxes
// whatever its length, a save over the tree writes the bytes the all-gather writes (listed,
// compact and automatic forms, checksums in metadata.json or in sidecars; torch DCP folders
// too), errors are the all-gather's words, and the bytes a rank receives grow with log world, not
// with the world.
#include "shardsafe/checkpoint/description_tree.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/hf/export_views.hpp"
#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/random_grid.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
using testing::counting_comm;
using testing::random_grid;

namespace {

using entry = std::pair<std::uint64_t, shard_spec>;

std::vector<entry> expanded(const std::vector<detail::entry_box>& boxes) {
  std::vector<entry> out;
  for (const auto& b : boxes) b.for_each([&](std::uint64_t r, const shard_spec& s) { out.emplace_back(r, s); });
  return out;
}

}  // namespace

TEST_CASE("the binary tree of runs: every rank heads a run, its two children the rest of it, depth log2 world") {
  for (int n = 1; n <= 700; ++n) {
    CAPTURE(n);
    std::vector<int> parent(static_cast<std::size_t>(n), -2);
    int depth = 0;
    for (int r = 0; r < n; ++r) {
      const detail::run_node node = detail::run_tree_node(r, n);
      int at = r + 1;  // the children's runs follow the rank, one after the other, to its run's end
      for (int k = 0; k < 2; ++k) {
        const int c = node.children[k];
        if (c < 0) continue;
        REQUIRE(c == at);
        const detail::run_node child = detail::run_tree_node(c, n);
        CHECK(child.parent == r);
        CHECK(child.end == node.child_end[k]);
        parent[static_cast<std::size_t>(c)] = r;
        at = node.child_end[k];
      }
      CHECK(at == node.end);
    }
    CHECK(detail::run_tree_node(0, n).end == n);
    for (int r = 1; r < n; ++r) {
      int d = 0;
      for (int x = r; x != 0; x = parent[static_cast<std::size_t>(x)]) {
        REQUIRE(parent[static_cast<std::size_t>(x)] >= 0);
        ++d;
      }
      depth = std::max(depth, d);
    }
    int lg = 0;
    while ((1 << lg) < n + 1) ++lg;
    CHECK(depth == lg - 1);  // ceil(log2(n + 1)) - 1
  }
}

TEST_CASE("entry boxes: every run of a grid's parts expands to exactly its entries, in a few boxes") {
  std::mt19937_64 rng(56);
  std::uint64_t grids = 0, most_boxes = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    auto [g, full] = random_grid(rng);
    try {
      validate(g, full, "random");
    } catch (const error&) {
      continue;
    }
    ++grids;
    // each part held by `rep` consecutive ranks (replicas without roles: a norm that tensor
    // parallelism replicates), the tree's runs cutting groups anywhere
    const std::uint64_t rep = trial % 3 == 0 ? 1 + trial / 3 % 4 : 1;
    std::vector<entry> parts;
    for (const auto& [r, s] : expand(g, full))
      for (std::uint64_t k = 0; k < rep; ++k) parts.emplace_back(r * rep + k, s);
    CAPTURE(to_string(full));
    CAPTURE(rep);
    // appended one by one
    std::vector<detail::entry_box> one;
    for (const auto& [r, s] : parts) detail::append_box(one, detail::entry_box::of(r, replica_role::none, s));
    REQUIRE(expanded(one) == parts);
    // merged as the tree merges: runs of consecutive parts, built alone, then appended in order
    std::vector<detail::entry_box> merged;
    for (std::size_t at = 0; at < parts.size();) {
      const std::size_t len = std::uniform_int_distribution<std::size_t>(1, parts.size() - at)(rng);
      std::vector<detail::entry_box> run;
      for (std::size_t i = at; i < at + len; ++i)
        detail::append_box(run, detail::entry_box::of(parts[i].first, replica_role::none, parts[i].second));
      for (auto& b : run) detail::append_box(merged, std::move(b));
      at += len;
    }
    REQUIRE(expanded(merged) == parts);
    // a grid cut evenly along every dimension but its slowest is a few boxes: its short and
    // empty pieces, one box each per cut dimension
    bool even_inner = true;
    const auto rank_order = detail::grid_rank_order(g);
    const shape_t dims = detail::grid_dims(g, full);
    for (std::size_t k = 1; k < rank_order.size(); ++k) {
      const std::size_t d = rank_order[k];
      if (g.chunks[d] * g.parts[d] != dims[d]) even_inner = false;
    }
    if (even_inner) {
      CHECK(one.size() <= 3);
      CHECK(merged.size() <= 3);
      most_boxes = std::max<std::uint64_t>(most_boxes, merged.size());
    }
  }
  CHECK(grids > 1000);
  CHECK(most_boxes >= 2);  // the short and empty pieces were met

  // a multi-range flat spec stays one entry of its own, between boxes it does not join
  std::vector<detail::entry_box> mixed;
  const std::vector<entry> want = {{0, flat_spec{{0, 4}}},
                                   {1, flat_spec{{4, 8}}},
                                   {2, flat_spec{{8, 9}, {10, 12}}},
                                   {3, flat_spec{{12, 16}}},
                                   {4, flat_spec{{16, 20}}}};
  for (const auto& [r, s] : want) detail::append_box(mixed, detail::entry_box::of(r, replica_role::none, s));
  CHECK(expanded(mixed) == want);
  CHECK(mixed.size() == 3);
}

TEST_CASE("partial descriptions: merged in rank order and sent as messages, they say what the ranks said") {
  // 64 ranks of FSDP's flat split of a tensor of 1,000 elements (a short piece and empty ones),
  // HSDP's replicas (writers then copies) and a tensor every rank holds unsharded
  constexpr std::uint64_t world = 64;
  auto part_of = [&](std::uint64_t r) {
    detail::partial_description p;
    p.first = r;
    p.end = r + 1;
    auto add = [&](std::string key, shape_t shape, bool sharded, shard_spec s, replica_role role) {
      p.add(std::move(key), std::move(shape), dtype::BF16, sharded, r, s, role);
    };
    const std::uint64_t c = 16;  // ceil(1000 / 64)
    add("fsdp", {1000}, true,
        flat_spec{{std::min<std::uint64_t>(1000, c * r), std::min<std::uint64_t>(1000, c * r + c)}},
        replica_role::none);
    const std::uint64_t shard = r % 8;
    add("hsdp", {8, 4}, true, block_spec({1, 4}, {shard, 0}), r < 8 ? replica_role::writer : replica_role::copy);
    add("bias", {4}, false, flat_spec{{0, 4}}, replica_role::none);
    return p;
  };
  // up the binary tree of runs: each rank merges its children's partials after its own
  std::vector<detail::partial_description> at(world);
  std::uint64_t biggest = 0;
  for (std::uint64_t r = world; r-- > 0;) {
    at[r] = part_of(r);
    const detail::run_node node = detail::run_tree_node(static_cast<int>(r), static_cast<int>(world));
    for (int k = 0; k < 2; ++k) {
      const int child = node.children[k];
      if (child < 0) continue;
      message_writer m;
      detail::encode_partial(m, at[static_cast<std::size_t>(child)]);
      const std::string bytes = std::move(m).str();
      biggest = std::max<std::uint64_t>(biggest, bytes.size());
      message_reader rd(bytes, "rank " + std::to_string(child));
      at[r].merge(
          detail::decode_partial(rd, static_cast<std::uint64_t>(child), static_cast<std::uint64_t>(node.child_end[k])));
      rd.finish();
    }
  }
  const auto& root = at[0];
  CHECK_FALSE(root.disagrees);
  REQUIRE(root.tensors.size() == 3);
  CHECK(root.tensors[0].boxes.size() == 3);  // full pieces, the short one, the empty ones
  CHECK(root.tensors[1].boxes.size() == 2);  // the writers, the copies
  CHECK(root.tensors[2].boxes.size() == 1);  // the lowest holder
  CHECK(biggest < 1000);                     // a partial of 32 ranks: a few hundred bytes
  for (std::size_t t = 0; t < 2; ++t) {
    std::vector<std::pair<std::string, shard_spec>> files;
    std::vector<int> ranks;
    std::vector<replica_role> roles;
    detail::expand_entries(root.tensors[t], world, "ckpt", files, ranks, roles);
    REQUIRE(files.size() == world);
    for (std::uint64_t r = 0; r < world; ++r) {
      CHECK(ranks[r] == static_cast<int>(r));
      std::vector<entry> one = expanded(part_of(r).tensors[t].boxes);
      CHECK(one.front().second == files[r].second);
      CHECK(roles[r] == part_of(r).tensors[t].boxes[0].role);
    }
  }
  // a rank that disagrees on a shape is kept apart, to be named by the all-gather path
  auto odd = part_of(5);
  odd.tensors[0].shape = {999};
  at[4].merge(std::move(odd));
  CHECK(at[4].disagrees);
  // a partial that claims more entries than its ranks, or other ranks, is malformed
  message_writer m;
  detail::encode_partial(m, at[2]);  // ranks [2, 18)
  const std::string bytes = std::move(m).str();
  message_reader wrong(bytes, "rank 2");
  CHECK_THROWS_WITH_AS(detail::decode_partial(wrong, 2, 3), doctest::Contains("rank 2"), error);
  // entries of ranks outside the run, or a first holder that is not the first entry, are refused
  auto refused = [&](detail::partial_description p, std::uint64_t first, std::uint64_t end, std::string why) {
    message_writer w;
    detail::encode_partial(w, p);
    const std::string b = std::move(w).str();
    message_reader rd(b, "rank " + std::to_string(first));
    CHECK_THROWS_WITH_AS(detail::decode_partial(rd, first, end), doctest::Contains(why.c_str()), error);
  };
  auto stray = part_of(5);
  stray.tensors[0].boxes[0].start[0] = 7;
  refused(stray, 5, 6, "outside [5, 6)");
  auto late = part_of(5);
  late.tensors[2].first_rank = 5;
  late.tensors[2].boxes[0].start[0] = 5;
  late.tensors[1].boxes[0].start[0] = 4;
  refused(late, 5, 6, "outside");
  auto named = part_of(9);
  named.first = 8;
  named.tensors[0].first_rank = 8;
  refused(named, 8, 10, "is not its first entry");
}

namespace {

/// One rank's views of a model mixing every kind of entry: FSDP flat pieces (short and empty
/// ones), a 2-D block grid (uneven columns), HSDP replicas with roles, an unsharded tensor, a
/// tensor every rank holds whole without roles, multi-range flat pieces on ranks 0 and 1, and a
/// tensor only the last rank holds.
struct model_rank {
  std::vector<std::vector<std::byte>> data;
  std::vector<flat_view> views;
  model_rank(int rank, int world, bool everywhere = true, bool pairs = false, bool empty = false) {
    const auto r = static_cast<std::uint64_t>(rank), w = static_cast<std::uint64_t>(world);
    auto add = [&](std::string key, shape_t full, std::optional<shard_spec> spec,
                   replica_role role = replica_role::none) {
      const std::uint64_t n = spec ? spec->local_numel() : numel(full);
      data.emplace_back(static_cast<std::size_t>(n * 4));
      for (std::size_t i = 0; i < data.back().size(); ++i)
        data.back()[i] = static_cast<std::byte>((i * 31 + r * 7 + key.size()) & 0xff);
      views.push_back({std::move(key), dtype::F32, std::move(full), std::move(spec), data.back().data(), n * 4, role});
    };
    for (std::uint64_t t = 0; t < 3; ++t) {  // FSDP: 37, 38 and 39 elements over the world
      const std::uint64_t n = 37 + t, c = (n + w - 1) / w;
      add("fsdp." + std::to_string(t), {n}, flat_spec{{std::min(n, c * r), std::min(n, c * r + c)}});
    }
    if (world % 2 == 0) {  // rows in 2, columns in world / 2: rank = row * (world / 2) + column
      const std::uint64_t cols = w / 2, i = r / cols, j = r % cols, cc = (13 + cols - 1) / cols;
      const std::uint64_t c0 = std::min<std::uint64_t>(13, cc * j), c1 = std::min<std::uint64_t>(13, cc * j + cc);
      add("grid", {6, 13}, block_spec({3, c1 - c0}, {3 * i, c0}));
      const std::uint64_t half = w / 2, s = r % half;  // 3 elements a shard: no two empty writers
      add("hsdp", {3 * half}, flat_spec{{3 * s, 3 * s + 3}}, r < half ? replica_role::writer : replica_role::copy);
    }
    add("bias", {5}, std::nullopt);
    if (everywhere) add("everywhere", {4}, flat_spec{{0, 4}});  // one shard saved by every rank, without roles
    if (pairs) {  // the ranks in pairs saving one shard, without roles (HSDP's replicas undeclared); the
                  // last pair's shard is shorter, and with an odd world its second rank is missing
      const std::uint64_t n = 3 * ((w + 1) / 2) - 1;
      add("pairs", {n}, flat_spec{{std::min(n, 3 * (r / 2)), std::min(n, 3 * (r / 2) + 3)}});
    }
    if (empty)  // a sharded tensor of no elements: a row of no columns a rank (DCP: one empty chunk)
      add("empty", {w, 0}, block_spec({1, 0}, {r, 0}));
    if (rank == 0) add("multi", {10}, flat_spec{{0, 3}, {5, 7}});
    if (rank == 1) add("multi", {10}, flat_spec{{3, 5}, {7, 10}});
    if (rank == world - 1) add("late", {2}, std::nullopt);
  }
};

/// go(comm) over a counting comm of tc: a PeerComm (peer: the tree) or not (the all-gather).
template <class F>
void over_comm(testing::thread_comm& tc, bool peer, F&& go) {
  if (peer) {
    counting_comm<true> c{tc};
    go(c);
  } else {
    counting_comm<false> c{tc};
    go(c);
  }
}

/// What a save in a world of thread ranks wrote, and what each rank received.
struct saved_model {
  std::shared_ptr<memory_store> store;
  std::map<std::string, std::string> objects;
  std::vector<std::uint64_t> bytes_in, largest_in, messages;
};

/// Saves the model in a world of `world` thread ranks, over the tree (peer) or the all-gather.
saved_model save_model(int world, bool peer, const save_options& opt, bool everywhere = true, bool pairs = false,
                       bool empty = false) {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir(store, "mem:ckpt");
  saved_model out;
  out.bytes_in.resize(static_cast<std::size_t>(world));
  out.largest_in.resize(static_cast<std::size_t>(world));
  out.messages.resize(static_cast<std::size_t>(world));
  const auto thrown = testing::run_ranks(world, [&](testing::thread_comm& tc) {
    model_rank m(tc.rank(), world, everywhere, pairs, empty);
    auto go = [&](auto& comm) {
      save(dir, std::span<const flat_view>(m.views), comm, opt);
      const auto r = static_cast<std::size_t>(tc.rank());
      out.bytes_in[r] = comm.bytes_in;
      out.largest_in[r] = comm.largest_in;
      out.messages[r] = comm.messages;
    };
    over_comm(tc, peer, go);
  });
  for (const auto& e : thrown) REQUIRE(testing::error_message_of(e) == "");
  out.store = store;
  for (const auto& [name, buf] : store->objects)
    out.objects.emplace(name, std::string(reinterpret_cast<const char*>(buf->data()), buf->size()));
  return out;
}

/// What a load asks of its folder: listings, and names asked for (exists).
struct probe_counts {
  std::atomic<std::uint64_t> lists{0}, probes{0};
};

/// A memory folder that counts what is asked of it.
struct probing_folder {
  using reader_type = memory_directory::reader_type;
  memory_directory d;
  std::shared_ptr<probe_counts> counts;
  std::string_view name() const noexcept { return d.name(); }
  reader_type open(std::string_view n) const { return d.open(n); }
  bool exists(std::string_view n) const {
    ++counts->probes;
    return d.exists(n);
  }
  std::vector<std::string> list() const {
    ++counts->lists;
    return d.list();
  }
  probing_folder sub(std::string_view n) const { return {d.sub(n), counts}; }
};

}  // namespace

TEST_CASE("a save over the tree writes the bytes the all-gather writes") {
  for (const int world : {2, 3, 8, 13, 16}) {
    for (const metadata_form form : {metadata_form::listed, metadata_form::compact, metadata_form::automatic})
      for (const bool checksums : {false, true}) {
        CAPTURE(world);
        CAPTURE(static_cast<int>(form));
        CAPTURE(checksums);
        save_options opt;
        opt.metadata = form;
        opt.checksums = checksums;
        opt.checksum_block_bytes = 64;
        const auto tree = save_model(world, true, opt, true, true).objects;
        const auto flat = save_model(world, false, opt, true, true).objects;
        REQUIRE(tree.size() == flat.size());
        CHECK(tree.count("mem:ckpt/metadata.json") == 1);
        for (const auto& [name, bytes] : flat) {
          CAPTURE(name);
          REQUIRE(tree.count(name) == 1);
          CHECK(tree.at(name) == bytes);
        }
        if (form == metadata_form::compact) {  // the grids were found
          const std::string md = tree.at("mem:ckpt/metadata.json");
          CHECK(md.find("shardsafe_grid") != std::string::npos);
        }
      }
  }
}

TEST_CASE("a DCP save over the tree writes the bytes the all-gather writes; a rank receives O(tensors)") {
  save_options opt;
  opt.format = save_format::dcp;
  // with shards that ranks repeat without roles (one every rank saves, one each pair of ranks
  // saves): the lowest holder writes it, as the all-gather's writers do; and a sharded tensor of
  // no elements, whose one empty chunk the first rank writes (it all-gathered before)
  for (const bool everywhere : {false, true})
    for (const int world : {2, 3, 8, 13, 32}) {
      CAPTURE(everywhere);
      CAPTURE(world);
      const saved_model tree = save_model(world, true, opt, everywhere, everywhere, everywhere),
                        flat = save_model(world, false, opt, everywhere, everywhere, everywhere);
      REQUIRE(tree.objects.size() == flat.objects.size());
      CHECK(tree.objects.count("mem:ckpt/.metadata") == 1);
      for (const auto& [name, bytes] : flat.objects) {
        CAPTURE(name);
        REQUIRE(tree.objects.count(name) == 1);
        CHECK(tree.objects.at(name) == bytes);
      }
      std::uint64_t most_tree = 0, most_flat = 0;
      for (int r = 1; r < world; ++r) {
        most_tree = std::max(most_tree, tree.bytes_in[static_cast<std::size_t>(r)]);
        most_flat = std::max(most_flat, flat.bytes_in[static_cast<std::size_t>(r)]);
      }
      MESSAGE("DCP, world " << world << std::string(everywhere ? ", shards repeated" : "")
                            << ": most bytes a rank but 0 receives: tree " << most_tree << ", all-gather "
                            << most_flat);
      if (world == 32)  // the tree: two partials, the agreement and the shards a lower rank writes; the
                        // all-gather: 32 descriptions and places
        CHECK(most_tree * 8 < most_flat);
    }
}

namespace {

/// An HF export from the model's views by `world` thread ranks into out (over the tree, or the
/// all-gather); the most bytes a rank but 0 receives, and the folder's files by name.
std::pair<std::uint64_t, std::map<std::string, std::string>> export_model(int world, bool peer,
                                                                          const std::filesystem::path& out) {
  std::vector<std::uint64_t> in(static_cast<std::size_t>(world));
  const auto thrown = testing::run_ranks(world, [&](testing::thread_comm& tc) {
    model_rank m(tc.rank(), world, true, true, true);
    hf_export_options opt;
    opt.max_shard_size = 300;  // several files and an index
    auto go = [&](auto& comm) {
      export_to(std::span<const flat_view>(m.views), comm, out, opt);
      in[static_cast<std::size_t>(tc.rank())] = comm.bytes_in;
    };
    over_comm(tc, peer, go);
  });
  for (const auto& e : thrown) REQUIRE(testing::error_message_of(e) == "");
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(out))
    files.emplace(e.path().filename().string(), testing::slurp(e.path()));
  return {*std::max_element(in.begin() + 1, in.end()), files};
}

}  // namespace

TEST_CASE("an HF export from views over the tree writes the all-gather's files; a rank receives O(tensors)") {
  // (the model's shards every rank, or each pair of ranks, repeats hold each rank's own bytes:
  // the lowest holder's are written on both paths)
  testing::temp_dir tmp("hftree");
  std::map<int, std::pair<std::uint64_t, std::uint64_t>> in;  // world -> most received: tree, all-gather
  for (const int world : {2, 3, 8, 13, 32}) {
    CAPTURE(world);
    const auto tree = export_model(world, true, tmp.path / ("tree" + std::to_string(world)));
    const auto flat = export_model(world, false, tmp.path / ("flat" + std::to_string(world)));
    CHECK(tree.second.size() > 2);  // shards and the index
    CHECK(tree.second == flat.second);
    MESSAGE("HF export, world " << world << ": most bytes a rank but 0 receives: tree " << tree.first << ", all-gather "
                                << flat.first);
    in[world] = {tree.first, flat.first};
  }
  // from 8 to 32 ranks the all-gather hands a rank over 3x the bytes, the tree under 1.5x
  CHECK(in[32].second > 3 * in[8].second);
  CHECK(in[32].first * 2 < in[8].first * 3);
  CHECK(in[32].first * 5 < in[32].second);
}

namespace {

/// What each rank of a world of thread ranks threw saving the model changed by `change`.
std::vector<std::string> save_errors(int world, bool peer, const std::function<void(int, model_rank&)>& change) {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir(store, "mem:ckpt");
  const auto thrown = testing::run_ranks(world, [&](testing::thread_comm& tc) {
    model_rank m(tc.rank(), world);
    change(tc.rank(), m);
    over_comm(tc, peer, [&](auto& c) { save(dir, std::span<const flat_view>(m.views), c); });
  });
  std::vector<std::string> out;
  for (const auto& e : thrown)
    out.push_back(testing::error_message_of(e) + " [" + testing::error_code_of(e).message() + "]");
  return out;
}

flat_view* view_named(model_rank& m, std::string_view key) {
  for (auto& v : m.views)
    if (v.key == key) return &v;
  return nullptr;
}

}  // namespace

TEST_CASE("a save over the tree fails on every rank with the all-gather's words") {
  constexpr int world = 8;
  const std::vector<std::pair<std::string, std::function<void(int, model_rank&)>>> cases = {
      {"rank 5 saves another shape",
       [](int r, model_rank& m) {
         if (r == 5) view_named(m, "everywhere")->full_shape = {8};
       }},
      {"rank 6 saves another dtype",
       [](int r, model_rank& m) {
         if (r == 6) view_named(m, "everywhere")->type = dtype::I32;
       }},
      {"rank 3's piece moved by one",
       [](int r, model_rank& m) {
         if (r == 3) view_named(m, "fsdp.1")->spec = flat_spec{{16, 21}};
       }},
      {"nobody holds the last piece",
       [](int r, model_rank& m) {
         if (r == 7) m.views.erase(m.views.begin() + 2);  // fsdp.2
       }},
      {"two writers of one replica",
       [](int r, model_rank& m) {
         if (r == 4) view_named(m, "hsdp")->replica = replica_role::writer;
       }},
      {"a copy without its writer",
       [](int r, model_rank& m) {
         if (r == 1) view_named(m, "hsdp")->replica = replica_role::copy;
       }},
      {"rank 2 gives a tensor twice",
       [](int r, model_rank& m) {
         if (r == 2) m.views.push_back(m.views.front());
       }},
  };
  for (const auto& [what, change] : cases) {
    CAPTURE(what);
    const auto tree = save_errors(world, true, change);
    const auto flat = save_errors(world, false, change);
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(tree[r] == flat[r]);
      CHECK(tree[r] == tree[0]);
      CHECK(tree[r].size() > 30);  // an error, not success
    }
  }
}

TEST_CASE("a save over the tree: what a rank receives grows with log world, the all-gather's with the world") {
  save_options opt;
  opt.metadata = metadata_form::compact;  // checksums in sidecars: rank 0 gathers sizes alone
  std::map<int, std::uint64_t> most_tree, most_flat, largest;
  for (const int world : {16, 64, 256}) {
    CAPTURE(world);
    const saved_model tree = save_model(world, true, opt, true, true), flat = save_model(world, false, opt, true, true);
    std::uint64_t mt = 0, mf = 0, big = 0;
    for (int r = 1; r < world; ++r) {  // rank 0 also hears every rank's file size: what metadata.json lists
      const auto i = static_cast<std::size_t>(r);
      mt = std::max(mt, tree.bytes_in[i]);
      mf = std::max(mf, flat.bytes_in[i]);
      big = std::max(big, tree.largest_in[i]);
      // sent and received: up from each child and to the parent, down from the parent and to each
      // child, over the binomial tree for the steps' outcomes (the plan's check, the folder, the
      // files' check, the commit) and over the binary tree of runs for the partials and the
      // agreement; and its file's size to rank 0
      const detail::run_node node = detail::run_tree_node(r, world);
      const std::uint64_t runs = (node.children[0] >= 0 ? 1 : 0) + (node.children[1] >= 0 ? 1 : 0);
      CHECK(tree.messages[i] == 6 * (detail::tree_children(r, world).size() + 1) + 2 * (runs + 1) + 1);
    }
    most_tree[world] = mt;
    most_flat[world] = mf;
    largest[world] = std::max(big, tree.largest_in[0]);
    MESSAGE("world " << world << ": most bytes a rank but 0 receives: tree " << mt << " (largest message "
                     << largest[world] << "), all-gather " << mf << "; rank 0: tree " << tree.bytes_in[0]);
    // rank 0: one more child than any other, and world - 1 file sizes (a few bytes each)
    CHECK(tree.bytes_in[0] <= 2 * mt + static_cast<std::uint64_t>(world) * 64);
  }
  // no message grows with the world (a partial of any run of ranks is a few boxes a tensor, the
  // shard each pair of ranks saves without roles too: a run cutting a pair leaves half of it at
  // each end, made one group again when runs merge; before, 2.2 KiB at 16 ranks, 5.9 at 256), and
  // a rank hears three of them at most (two children's partials, the agreement): flat
  CHECK(largest[256] * 4 <= largest[16] * 5);
  CHECK(most_tree[256] <= 4 * largest[16]);
  CHECK(most_tree[256] * 4 <= most_tree[16] * 5);
  // the all-gather hands every rank every rank's description
  CHECK(most_flat[256] >= 12 * most_flat[16]);
  CHECK(most_tree[256] * 20 < most_flat[256]);
}

TEST_CASE("a save over the tree: a rank that never comes is named by every other rank") {
  constexpr int world = 8;
  auto store = std::make_shared<memory_store>();
  const memory_directory dir(store, "mem:ckpt");
  const auto thrown = testing::run_ranks(
      world,
      [&](testing::thread_comm& tc) {
        if (tc.rank() == 5) return;  // never comes to the save
        model_rank m(tc.rank(), world);
        save(dir, std::span<const flat_view>(m.views), tc);
      },
      std::chrono::milliseconds(1500));
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const std::string what = testing::error_message_of(thrown[static_cast<std::size_t>(r)]);
    if (r == 5) {
      CHECK(what.empty());
      continue;
    }
    CHECK(testing::error_code_of(thrown[static_cast<std::size_t>(r)]) == errc::comm_error);
    CHECK(what.find("save mem:ckpt: agreeing on the metadata") != std::string::npos);
    CHECK(what.find("rank(s) 5 in no call of the world") != std::string::npos);
  }
  CHECK(store->objects.count("mem:ckpt/metadata.json") == 0);
}

TEST_CASE("a save with checksums in blocks of 0 bytes is refused on every rank, before anything is written") {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir(store, "mem:ckpt");
  save_options opt;
  opt.checksum_block_bytes = 0;
  const auto thrown = testing::run_ranks(4, [&](testing::thread_comm& tc) {
    model_rank m(tc.rank(), 4);
    save(dir, std::span<const flat_view>(m.views), tc, opt);
  });
  for (const auto& e : thrown) {
    CHECK(testing::error_code_of(e) == errc::invalid_argument);
    CHECK(testing::error_message_of(e).find("mem:ckpt: save_options::checksum_block_bytes is 0") != std::string::npos);
  }
  CHECK(store->objects.empty());
}

TEST_CASE("a load plans from the files alone: no rank lists the folder, whatever the world that saved it") {
  // A folder of W ranks' files (and their sidecars) is not listed by each of the ranks that load
  // it (on a shared file system or S3: W x files entries, 33 LIST pages a rank at 16,384 ranks);
  // recognising its layout asks for a few names. 3 thread ranks load the FSDP tensors resharded,
  // and the bytes are the savers' (model_rank's formula).
  std::map<save_format, std::uint64_t> probes_of;
  for (const save_format format : {save_format::shardsafe, save_format::dcp})
    for (const int world : {4, 16, 64}) {
      CAPTURE(world);
      CAPTURE(format == save_format::dcp);
      save_options opt;
      opt.format = format;
      opt.metadata = metadata_form::compact;
      const saved_model saved = save_model(world, true, opt, false);
      const probing_folder dir{memory_directory(saved.store, "mem:ckpt"), std::make_shared<probe_counts>()};
      constexpr int loaders = 3;
      const auto thrown = testing::run_ranks(loaders, [&](testing::thread_comm& tc) {
        const auto r = static_cast<std::uint64_t>(tc.rank());
        std::vector<std::vector<std::byte>> data;
        std::vector<flat_view> views;
        for (std::uint64_t t = 0; t < 3; ++t) {
          const std::uint64_t n = 37 + t, c = (n + loaders - 1) / loaders, b = std::min(n, c * r),
                              e = std::min(n, c * r + c);
          data.emplace_back(static_cast<std::size_t>((e - b) * 4));
          views.push_back(
              {"fsdp." + std::to_string(t), dtype::F32, {n}, flat_spec{{b, e}}, data.back().data(), (e - b) * 4});
        }
        load(dir, std::span<const flat_view>(views), tc);
        for (std::uint64_t t = 0; t < 3; ++t) {
          const std::uint64_t n = 37 + t, saver_c = (n + world - 1) / world,
                              b = std::min(n, (n + loaders - 1) / loaders * r);
          for (std::uint64_t i = 0; i < data[t].size(); ++i) {
            const std::uint64_t p = b * 4 + i, saver = p / 4 / saver_c, local = p - 4 * saver_c * saver;
            const auto want = static_cast<std::byte>((local * 31 + saver * 7 + views[t].key.size()) & 0xff);
            if (data[t][i] != want)
              throw std::runtime_error(views[t].key + " byte " + std::to_string(p) + " is not its saver's");
          }
        }
      });
      for (const auto& e : thrown) REQUIRE(testing::error_message_of(e) == "");
      CHECK(dir.counts->lists.load() == 0);
      // the names a layout is told apart by (a few a rank), the same for every world
      const std::uint64_t probes = dir.counts->probes.load();
      CHECK(probes <= 10 * loaders);
      CHECK(probes == probes_of.emplace(format, probes).first->second);
      MESSAGE("world " << world << std::string(format == save_format::dcp ? ", DCP" : "") << ": "
                       << dir.counts->lists.load() << " lists, " << probes << " names asked by " << loaders
                       << " ranks");
    }
}
