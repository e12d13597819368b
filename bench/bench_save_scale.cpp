// bench_save_scale - what one rank pays to agree on a save as the world grows (issue 56): step 1
// (every rank's description checked and merged) and the steps after it, over the binomial tree
// of ranks (a PeerComm) against the all-gather a Comm without peers uses, per rank.
//
//   meson compile -C build bench/bench_save_scale && ./build/bench/bench_save_scale [--quick] [--max-world N] [--part N]
//
// Part 1, real saves: worlds of 64 to 4,096 thread ranks (dist/threads.hpp), each rank running
// the library's whole save (describe, agree, prepare, write its rank file and checksum sidecar to
// memory, commit) of a fixed model: 32 layers of a Llama-shaped model scaled down (291 tensors,
// hidden 128), every tensor flattened and split over all ranks as FSDP does (torch.chunk's pieces:
// at 4,096 ranks most are empty), metadata.json compact; and the same as a torch DCP folder
// (save_format::dcp: ", DCP" rows, to the all-gather's largest world), and as a DCP folder whose
// norms (the 1-D tensors, 65 of them) every rank saves whole without replica roles, as tensor
// parallelism replicates them (", DCP, norms repeated": the lowest holder writes a shard, and rank
// 0 tells each rank which of its shards a lower rank writes). Counted per rank (dist/counted.hpp):
//   in KiB / out KiB   bytes received / sent, all steps (max over ranks but 0, and rank 0)
//   msgs               messages sent and received (max over ranks but 0; rank 0 also hears
//                      every rank's file size)
//   largest KiB        the longest message a rank received (what it holds at once to merge)
//   wall s             the whole save, every rank (2 cores run all the threads)
// (A rank's memory is measured in part 2, where one thread runs one rank at a time.)
// The all-gather (the same save through counted_comm<thread_comm, false>) runs to 256 ranks (--quick:
// 64): past
// that every rank receives every rank's description (W x W copies in one process); its per-rank
// bytes are then W times one description, printed as computed.
//
// Part 3, real loads: part 1's model saved over the tree by W thread ranks, then loaded by W ranks
// resharded (each rank's piece of every tensor moved by half a piece, so its bytes lie in two
// ranks' files), each rank planning from the files alone (checkpoint/load.hpp); the only
// messages are the agreed outcome's. The same columns, and read / needed (bytes read over bytes
// the views need, summed over ranks); every rank checks sampled elements against their saver.
//
// Part 2, the tree's agreement to 16,384 ranks, simulated in one process from the same code: the
// 70B model of bench_scale (723 tensors) split as FSDP does, each rank's partial description made
// (partial_of's boxes), encoded, decoded and merged by its parent in the binary tree of runs
// (dist/tree.hpp), rank 0's finish_partial (the checks and the compact metadata). Per world:
//   largest KiB   the longest partial any rank sends up
//   most in KiB   the most partial bytes one rank receives (two children at most)
//   merge ms      the longest time one rank spends decoding and merging its children's
//   held KiB      the most heap one rank holds for it: its partial made and its children's
//                 decoded and merged, plus their messages (mallinfo2, one rank at a time)
//   root ms       rank 0's finish_partial: each tensor's grid found from its boxes and checked
//                 there (grid_of_boxes), else its entries expanded once, checked, a grid looked for
//   root entries  the entries rank 0 expanded one by one (finish_partial's entries_expanded)
//   root MiB      heap rank 0 holds after it (the compact metadata)
//   all-gather    what every rank would receive instead: W descriptions (MiB)
// Part 2b: the same with tensor parallelism of 8 replicating the norms: each norm split over the
// W / 8 groups of 8 consecutive ranks, a group's ranks saving one shard without replica roles (a
// run of the tree may cut a group; the boxes make it whole again). Rank 0 expands those norms'
// entries (each rank's file is listed, as the all-gather path lists it).
// --max-world stops the doubling early (default 16384, --quick 256; part 1 stops at 4096).
#include "bench_common.hpp"
#include "bench_llama.hpp"
#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/counted.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/storage/memory.hpp"

#include <malloc.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using namespace shardsafe;
using u64 = std::uint64_t;

namespace {

using bench::even_part;
using bench::llama;
using bench::model_tensor;

struct per_rank {
  u64 in = 0, out = 0, msgs = 0, largest = 0;
};

/// One rank's views of every tensor of the model, BF16: elements range(t) = [b, e) of tensor t,
/// flattened, each holding `fill`.
struct rank_views {
  std::vector<std::vector<std::uint16_t>> data;
  std::vector<flat_view> views;
  template <class Range>
  rank_views(const std::vector<model_tensor>& model, Range&& range, std::uint16_t fill) {
    data.reserve(model.size());
    for (const auto& t : model) {
      const auto [b, e] = range(t);
      data.emplace_back(static_cast<std::size_t>(e - b), fill);
      views.push_back({t.name, dtype::BF16, t.shape, flat_spec{{b, e}},
                       reinterpret_cast<std::byte*>(data.back().data()), (e - b) * 2});
    }
  }
};

/// Rank r's FSDP piece of n elements over w ranks, moved by half its length (part 3's loads).
std::pair<u64, u64> moved_part(u64 n, u64 w, u64 r) {
  const auto [b, e] = even_part(n, w, r);
  return {std::min(n, b + (e - b) / 2), std::min(n, e + (e - b) / 2)};
}

/// One save of the model by `world` thread ranks; the counts of each rank.
std::vector<per_rank> real_save(const std::vector<model_tensor>& model, int world, bool tree, save_format format,
                                bool repeated, double& wall, std::shared_ptr<memory_store> store = {}) {
  if (!store) store = std::make_shared<memory_store>();
  const memory_directory dir(store, "mem:ckpt");
  save_options opt;
  opt.metadata = metadata_form::compact;
  opt.format = format;
  std::vector<per_rank> out(static_cast<std::size_t>(world));
  const double t0 = bench::now_s();
  const auto thrown = run_ranks(
      world,
      [&](thread_comm& tc) {
        const u64 r = static_cast<u64>(tc.rank()), w = static_cast<u64>(world);
        const rank_views rv(
            model,
            [&](const model_tensor& t) {
              if (repeated && t.shape.size() == 1) return std::pair<u64, u64>(0, numel(t.shape));  // saved whole
              return even_part(numel(t.shape), w, r);
            },
            static_cast<std::uint16_t>(r));
        auto run = [&](auto& c) {
          save(dir, std::span<const flat_view>(rv.views), c, opt);
          out[r] = {c.bytes_in, c.bytes_out, c.messages, c.largest_in};
        };
        if (tree) {
          counted_comm<thread_comm, true> c(tc);
          run(c);
        } else {
          counted_comm<thread_comm, false> c(tc);
          run(c);
        }
      },
      std::chrono::minutes(10));
  wall = bench::now_s() - t0;
  for (const auto& e : thrown)
    if (e) std::rethrow_exception(e);
  return out;
}

std::string kib(double bytes) { return bench::fmt("%.1f", bytes / 1024.0); }

struct load_counts {
  std::vector<per_rank> ranks;
  u64 read = 0, needed = 0;  // summed over ranks
};

/// The world's collective load of what real_save left in `store`, resharded: each rank's piece of
/// every tensor moved by half a piece (its bytes in two ranks' files: MIXED overlaps).
load_counts real_load(const std::vector<model_tensor>& model, int world, const std::shared_ptr<memory_store>& store,
                      double& wall) {
  const memory_directory dir(store, "mem:ckpt");
  load_counts out;
  out.ranks.resize(static_cast<std::size_t>(world));
  std::vector<load_stats> stats(static_cast<std::size_t>(world));
  const double t0 = bench::now_s();
  const auto thrown = run_ranks(
      world,
      [&](thread_comm& tc) {
        const u64 r = static_cast<u64>(tc.rank()), w = static_cast<u64>(world);
        rank_views rv(model, [&](const model_tensor& t) { return moved_part(numel(t.shape), w, r); }, 0);
        auto& [data, views] = rv;
        counted_comm<thread_comm, true> c(tc);
        stats[r] = load(dir, std::span<const flat_view>(views), c);
        out.ranks[r] = {c.bytes_in, c.bytes_out, c.messages, c.largest_in};
        // each element holds the rank that saved it (real_save's fill: torch.chunk's pieces of c)
        for (std::size_t i = 0; i < views.size(); ++i) {
          const u64 n = numel(model[i].shape), c = (n + w - 1) / w, first = moved_part(n, w, r).first;
          for (u64 x = first; x < first + data[i].size(); x += 997)
            if (data[i][x - first] != static_cast<std::uint16_t>(x / c))
              throw std::runtime_error("rank " + std::to_string(r) + ": '" + views[i].key + "' element " +
                                       std::to_string(x) + " is not its saver's");
        }
      },
      std::chrono::minutes(10));
  wall = bench::now_s() - t0;
  for (const auto& e : thrown)
    if (e) std::rethrow_exception(e);
  for (const auto& st : stats) out.read += st.bytes_read, out.needed += st.bytes_needed;
  return out;
}

/// Part 3: the same model saved by W ranks over the tree, then loaded resharded by W ranks.
void part3(u64 max_world) {
  const auto model = llama(32, 128, 344, 32, 1024);
  std::printf(
      "part 3: real loads by thread ranks, resharded (each rank's pieces moved by half a piece), the "
      "checkpoint part 1's tree saved\n\n");
  bench::table t({"world", "in KiB", "rank 0 in KiB", "out KiB", "msgs", "largest KiB", "read / needed", "wall s"});
  for (u64 w = 64; w <= std::min<u64>(max_world, 4096); w *= 4) {
    auto store = std::make_shared<memory_store>();
    double save_wall = 0, wall = 0;
    real_save(model, static_cast<int>(w), true, save_format::shardsafe, false, save_wall, store);
    const load_counts c = real_load(model, static_cast<int>(w), store, wall);
    per_rank most;
    for (std::size_t r = 1; r < c.ranks.size(); ++r) {
      most.in = std::max(most.in, c.ranks[r].in);
      most.out = std::max(most.out, c.ranks[r].out);
      most.msgs = std::max(most.msgs, c.ranks[r].msgs);
      most.largest = std::max(most.largest, c.ranks[r].largest);
    }
    t.add({std::to_string(w), kib(double(most.in)), kib(double(c.ranks[0].in)), kib(double(most.out)),
           std::to_string(most.msgs), kib(double(most.largest)),
           bench::fmt("%.4f", c.needed ? double(c.read) / double(c.needed) : 0.0), bench::fmt("%.2f", wall)});
    std::fflush(stdout);
  }
  t.print();
  std::printf("\n");
}

void part1(u64 max_world, u64 max_gather) {
  const auto model = llama(32, 128, 344, 32, 1024);
  std::printf("part 1: real saves by thread ranks, %zu tensors split over every rank (FSDP), compact\n\n",
              model.size());
  bench::table t({"world", "comm", "in KiB", "rank 0 in KiB", "out KiB", "msgs", "largest KiB", "wall s"});
  u64 description = 0;  // one rank's all-gathered message at the last world the all-gather ran
  for (u64 w = 64; w <= std::min<u64>(max_world, 4096); w *= 4) {
    for (const int variant : {0, 1, 2})  // shardsafe's layout; DCP; DCP with the norms repeated
      for (const bool tree : {true, false}) {
        const bool dcp = variant > 0, repeated = variant == 2;
        const save_format format = dcp ? save_format::dcp : save_format::shardsafe;
        if (dcp && w > max_gather) continue;  // a DCP save's files are torch.save archives: 291 a rank
        if (!tree && w > max_gather) {
          t.add({std::to_string(w), "all-gather", kib(double(description) * double(w)) + " (computed)", "", "", "", "",
                 "not run"});
          continue;
        }
        double wall = 0;
        const auto c = real_save(model, static_cast<int>(w), tree, format, repeated, wall);
        per_rank most;
        for (std::size_t r = 1; r < c.size(); ++r) {
          most.in = std::max(most.in, c[r].in);
          most.out = std::max(most.out, c[r].out);
          most.msgs = std::max(most.msgs, c[r].msgs);
          most.largest = std::max(most.largest, c[r].largest);
        }
        if (!tree && !dcp) description = most.largest;
        t.add({std::to_string(w),
               std::string(tree ? "tree" : "all-gather") + (dcp ? ", DCP" : "") + (repeated ? ", norms repeated" : ""),
               kib(double(most.in)), kib(double(c[0].in)), kib(double(most.out)), std::to_string(most.msgs),
               kib(double(most.largest)), bench::fmt("%.2f", wall), bench::fmt("%.0f", bench::hwm_mib())});
      }
    std::fflush(stdout);
  }
  t.print();
  std::printf("\n");
}

/// Rank r's partial of the 70B model split over w ranks (FSDP); with tp > 1 the norms (1-D
/// tensors) are split over the w / tp groups of tp consecutive ranks, each group's ranks saving
/// the same shard without replica roles (tensor parallelism replicating them).
detail::partial_description partial_of_rank(const std::vector<model_tensor>& model, u64 w, u64 r, u64 tp) {
  detail::partial_description p;
  p.first = r;
  p.end = r + 1;
  for (const auto& t : model) {
    const bool norm = tp > 1 && t.shape.size() == 1;
    const auto [b, e] = norm ? even_part(numel(t.shape), w / tp, r / tp) : even_part(numel(t.shape), w, r);
    p.add(t.name, t.shape, dtype::BF16, true, r, shard_spec(flat_spec{{b, e}}), replica_role::none);
  }
  return p;
}

std::string encoded(const detail::partial_description& p) {
  message_writer m;
  detail::encode_partial(m, p);
  return std::move(m).str();
}

void part2(u64 max_world, u64 tp) {
  const auto model = llama(80, 8192, 28672, 1024, 128256);
  std::printf("part 2%s: the tree's agreement simulated to %llu ranks, the 70B model (%zu tensors, FSDP%s)\n\n",
              tp > 1 ? "b" : "", static_cast<unsigned long long>(max_world), model.size(),
              tp > 1 ? "; the norms' shards each saved by a group of 8 ranks without replica roles" : "");
  bench::table t({"world", "largest KiB", "most in KiB", "merge ms", "held KiB", "root ms", "root entries", "root MiB",
                  "all-gather MiB"});
  for (u64 w = 64; w <= max_world; w *= 4) {
    // ranks from the last to the first: each merges its children's partials (made before it),
    // which are then dropped; a partial lives until its parent is done
    std::vector<std::string> sent(static_cast<std::size_t>(w));
    u64 largest = 0, most_in = 0, held = 0;
    double merge_s = 0;
    detail::partial_description root;
    for (u64 r = w; r-- > 0;) {
      const std::size_t before = mallinfo2().uordblks;
      std::size_t most = 0;
      detail::partial_description p = partial_of_rank(model, w, r, tp);
      const double t0 = bench::now_s();
      u64 in = 0;
      const detail::run_node node = detail::run_tree_node(static_cast<int>(r), static_cast<int>(w));
      for (int k = 0; k < 2; ++k) {
        const int child = node.children[k];
        if (child < 0) continue;
        std::string& bytes = sent[static_cast<std::size_t>(child)];
        in += bytes.size();
        message_reader m(bytes, "rank " + std::to_string(child));
        p.merge(detail::decode_partial(m, static_cast<u64>(child), static_cast<u64>(node.child_end[k])));
        m.finish();
        most = std::max(most, mallinfo2().uordblks - before);
        std::string().swap(bytes);
      }
      merge_s = std::max(merge_s, bench::now_s() - t0);
      most_in = std::max(most_in, in);
      held = std::max<u64>(held, std::max(most, mallinfo2().uordblks - before) + in);
      if (r == 0) {
        root = std::move(p);
      } else {
        sent[static_cast<std::size_t>(r)] = encoded(p);
        largest = std::max<u64>(largest, sent[static_cast<std::size_t>(r)].size());
      }
    }
    malloc_trim(0);
    const std::size_t heap0 = mallinfo2().uordblks;
    const double t0 = bench::now_s();
    const detail::agreed_description agreed = detail::finish_partial(root, w, "bench", metadata_form::compact, 0);
    const double root_s = bench::now_s() - t0;
    malloc_trim(0);  // freed small blocks back together: what stays is what rank 0 holds
    const double root_mib = double(mallinfo2().uordblks - heap0) / double(bench::MiB);
    u64 grids = 0;
    for (const auto& [k, tm] : agreed.md.tensors) grids += tm.grid ? 1 : 0;
    if (grids != model.size())
      std::printf("  (world %llu: %llu grids of %zu)\n", (unsigned long long)w, (unsigned long long)grids,
                  model.size());
    // the all-gather: every rank receives every rank's description (about rank 0's size each)
    message_writer one;
    detail::encode_description(one, [&] {
      checkpoint_metadata md;
      for (const auto& tt : model) {
        tensor_metadata tm;
        tm.shape = tt.shape;
        tm.type = dtype::BF16;
        tm.is_sharded = true;
        const auto [b, e] = even_part(numel(tt.shape), w, w / 2);
        tm.files.emplace_back(rank_file_name(w / 2), shard_spec(flat_spec{{b, e}}));
        md.tensors.emplace_back(tt.name, std::move(tm));
      }
      return md;
    }());
    const double gather_mib = double(one.str().size()) * double(w) / double(bench::MiB);
    t.add({std::to_string(w), kib(double(largest)), kib(double(most_in)), bench::fmt("%.1f", merge_s * 1e3),
           kib(double(held)), bench::fmt("%.2f", root_s * 1e3), std::to_string(agreed.entries_expanded),
           bench::fmt("%.1f", root_mib), bench::fmt("%.1f", gather_mib)});
    std::fflush(stdout);
  }
  t.print();
}

}  // namespace

int main(int argc, char** argv) {
  const bench::args a(argc, argv);
  bench::accept_only(a, "What one rank pays to agree on a save as the world grows: the tree against the all-gather.",
                     {{"--quick", nullptr, "worlds 64 and 256 (a smoke run)"},
                      {"--max-world", "N", "the largest world (default 16384; real saves stop at 4096)"},
                      {"--part", "N", "only part N (1, 2 (with 2b) or 3)"}});
  const u64 max_world = static_cast<u64>(a.get_int("--max-world", a.has("--quick") ? 256 : 16384));
  const auto part = a.get_int("--part", 0);
  if (part == 0 || part == 1) part1(max_world, a.has("--quick") ? 64 : 256);
  if (part == 0 || part == 3) part3(max_world);
  if (part == 0 || part == 2) {
    part2(max_world, 1);
    std::printf("\n");
    part2(max_world, 8);
  }
}
