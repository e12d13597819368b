// bench_scale - what one rank pays for the checkpoint's metadata as the world grows: the
// planner alone, on synthetic metadata of a 70B-parameter model, for worlds of 64 to 16,384 ranks,
// in both forms of metadata.json.
//
//   meson compile -C build bench/bench_scale && ./build/bench/bench_scale [--quick] [--max-world N]
//
// The model: Llama-3-70B's 723 tensors (80 layers, hidden 8192, intermediate 28672, 64 query /
// 8 key-value heads of 128, vocab 128,256; 70.6 billion parameters, BF16). Two layouts of the
// saving world:
//   fsdp  every tensor flattened and split over all W ranks in torch.chunk pieces of ceil(n / W)
//         elements (FSDP's flat split: W files per tensor, the last ones short or empty);
//   3d    TP 8 x PP (min(W/8, 16) stages, layers split evenly) x DP (the rest): each tensor
//         lives on one stage, split by rows (q, k, v, gate, up, embeddings, lm_head) or columns
//         (o, down) over TP, norms whole; only data-parallel rank 0 writes (TP files per tensor).
// Each in two forms of metadata.json (docs/FORMAT.md §2): listed (one entry per file per tensor,
// OLMo-core's) and compact (each regular sharding a grid of O(dims) numbers, found by
// detect_grid from the listed entries, as a save with metadata_form::compact does).
// For each W and form, one rank (rank W/2) of a loading world of the same layout and size, and
// one of a world half the size (a resharded resume):
//   entries     shard entries the listed form holds (tensors x files per tensor)
//   json MB     metadata.json's size (write_checkpoint_metadata, as a save writes it)
//   parse s     parse_checkpoint_metadata of that text: every rank reads all of it
//   parse MiB   heap the parsed metadata holds (glibc's mallinfo2, in use after minus before)
//   plan s      checkpoint_reader::plan's step before reading file headers, the planner's
//               plan_views (checkpoint/load_plan.hpp): each view checked, the files that may
//               hold it (every listed file, or a grid's parts by division) and plan_load over them
//   files       distinct files the rank's plan reads from
//   read MiB    bytes the plan reads (the rank's share of the model)
// --max-world stops the doubling early (default 16384; --quick: 256). Above 1 GiB of text the
// parser refuses metadata.json (storage/text.hpp, max_metadata_size): the table says so.
#include "bench_common.hpp"
#include "bench_llama.hpp"
#include "shardsafe/checkpoint/load_plan.hpp"
#include "shardsafe/format/metadata.hpp"

#include <malloc.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <unordered_map>
#include <string>
#include <vector>

using namespace shardsafe;
using u64 = std::uint64_t;

namespace {

using bench::even_part;
using bench::model_tensor;

std::vector<model_tensor> llama70b() { return bench::llama(80, 8192, 28672, 8 * 128, 128256); }

std::string rank_file(u64 r) { return "rank_" + std::to_string(r) + ".safetensors"; }

// --- the 3-D layout: rank = (pp * dp_size + dp) * tp_size + tp
struct grid {
  u64 tp = 8, pp = 1, dp = 1;
  explicit grid(u64 world) {
    pp = std::max<u64>(1, std::min<u64>(16, world / tp));
    dp = world / (tp * pp);
  }
  u64 rank(u64 p, u64 d, u64 t) const { return (p * dp + d) * tp + t; }
  u64 stage_of(const model_tensor& t) const {
    if (t.layer == -1) return 0;
    if (t.layer == -2) return pp - 1;
    return static_cast<u64>(t.layer) * pp / 80;
  }
};

block_spec tp_block(const model_tensor& t, u64 tp, u64 i) {
  if (t.kind == 2) return block_spec::whole(t.shape);
  shape_t ext = t.shape, off(t.shape.size(), 0);
  const std::size_t d = static_cast<std::size_t>(t.kind);
  auto [b, e] = even_part(t.shape[d], tp, i);
  off[d] = b;
  ext[d] = e - b;
  return block_spec(ext, off);
}

checkpoint_metadata make_metadata(const std::vector<model_tensor>& model, const std::string& layout, u64 world) {
  checkpoint_metadata md;
  md.tensors.reserve(model.size());
  const grid g(world);
  for (const auto& t : model) {
    tensor_metadata tm;
    tm.shape = t.shape;
    tm.type = dtype::BF16;
    tm.is_sharded = true;
    if (layout == "fsdp") {
      tm.files.reserve(world);
      for (u64 r = 0; r < world; ++r) {
        auto [b, e] = even_part(numel(t.shape), world, r);
        tm.files.emplace_back(rank_file(r), shard_spec(flat_spec({element_range{b, e}})));
      }
    } else {
      const u64 stage = g.stage_of(t);
      const u64 parts = t.kind == 2 ? 1 : g.tp;
      for (u64 i = 0; i < parts; ++i)
        tm.files.emplace_back(rank_file(g.rank(stage, 0, i)), shard_spec(tp_block(t, g.tp, i)));
    }
    md.tensors.emplace_back(t.name, std::move(tm));
  }
  md.extras.writer = "bench_scale";
  md.extras.world_size = world;
  // as a save records them: every rank file's size (O(world) in both forms; the listed form's
  // checksum tables, O(tensors x world) more, are left out here)
  u64 bytes = 0;
  for (const auto& t : model) bytes += numel(t.shape) * 2;
  for (u64 r = 0; r < world; ++r) md.extras.file_sizes[rank_file(r)] = bytes / world;
  return md;
}

/// rank r's shards in a loading world of `world` ranks of `layout`: (tensor index, spec)
std::vector<std::pair<std::size_t, shard_spec>> my_shards(const std::vector<model_tensor>& model,
                                                          const std::string& layout, u64 world, u64 r) {
  std::vector<std::pair<std::size_t, shard_spec>> out;
  const grid g(world);
  for (std::size_t i = 0; i < model.size(); ++i) {
    const auto& t = model[i];
    if (layout == "fsdp") {
      auto [b, e] = even_part(numel(t.shape), world, r);
      out.emplace_back(i, shard_spec(flat_spec({element_range{b, e}})));
    } else {
      const u64 tp = r % g.tp, rest = r / g.tp, stage = rest / g.dp;
      if (g.stage_of(t) != stage) continue;
      out.emplace_back(i, shard_spec(tp_block(t, g.tp, tp)));
    }
  }
  return out;
}

struct plan_figures {
  double seconds = 0;
  std::size_t files = 0;
  u64 bytes = 0;
};

plan_figures plan_rank(const checkpoint_metadata& md, const std::vector<model_tensor>& model,
                       const std::vector<std::pair<std::size_t, shard_spec>>& mine) {
  plan_figures f;
  std::vector<flat_view> views;  // described only: the planner never touches their memory
  views.reserve(mine.size());
  for (const auto& [ti, spec] : mine)
    views.push_back({model[ti].name, dtype::BF16, model[ti].shape, spec, nullptr, spec.local_numel() * 2});
  std::unordered_map<std::string_view, const tensor_metadata*> index;  // as checkpoint_files keeps one
  for (const auto& [k, t] : md.tensors) index.emplace(k, &t);
  const double t0 = bench::now_s();
  const view_plans vp = plan_views(
      md,
      [&](std::string_view k) {
        const auto it = index.find(k);
        return it == index.end() ? nullptr : it->second;
      },
      std::span<const flat_view>(views), load_options{}, "bench_scale", /*memory_later=*/true);
  f.seconds = bench::now_s() - t0;
  for (const auto& p : vp.views)
    for (const auto& fp : p.lp.files) f.bytes += fp.numel * 2;
  f.files = vp.files.size();
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::args a(argc, argv);
  bench::accept_only(a, "What one rank pays for metadata.json as the world grows (a 70B model, synthetic metadata).",
                     {{"--quick", nullptr, "worlds 64 to 256 (a smoke run)"},
                      {"--max-world", "N", "the largest world (default 16384)"}});
  const u64 max_world = static_cast<u64>(a.get_int("--max-world", a.has("--quick") ? 256 : 16384));
  const auto model = llama70b();
  u64 params = 0;
  for (const auto& t : model) params += numel(t.shape);
  std::printf("bench_scale: %zu tensors, %.2f billion parameters (BF16); one rank (W/2) of the loading world\n\n",
              model.size(), double(params) / 1e9);
  std::printf("%-6s %-7s %6s %10s %9s %8s %9s %9s | %-10s %8s %6s %9s\n", "layout", "form", "world", "entries",
              "json MB", "write s", "parse s", "parse MiB", "load on", "plan s", "files", "read MiB");
  for (const std::string layout : {"3d", "fsdp"}) {
    for (u64 w = 64; w <= max_world; w *= 2) {
      u64 entries = 0, grids = 0;
      std::string texts[2];
      double write_s[2] = {0, 0};
      {
        checkpoint_metadata md = make_metadata(model, layout, w);
        for (const auto& [k, t] : md.tensors) entries += t.files.size();
        double t0 = bench::now_s();
        texts[0] = write_checkpoint_metadata(md);
        write_s[0] = bench::now_s() - t0;
        for (auto& [k, t] : md.tensors)
          if (auto g = detect_grid(t)) {
            t.grid = std::move(g);
            t.files.clear();
            ++grids;
          }
        t0 = bench::now_s();
        texts[1] = write_checkpoint_metadata(md);
        write_s[1] = bench::now_s() - t0;
      }
      for (int form = 0; form < 2; ++form) {
        std::string& text = texts[form];
        const char* fname = form == 0 ? "listed" : "compact";
        const double json_mb = double(text.size()) / 1e6;
        if (text.size() > max_metadata_size) {
          std::printf("%-6s %-7s %6llu %10llu %9.1f %8.2f  refused: over max_metadata_size (1 GiB); nothing planned\n",
                      layout.c_str(), fname, (unsigned long long)w, (unsigned long long)entries, json_mb,
                      write_s[form]);
          continue;
        }
        text.reserve(text.size() + 64);
        const auto heap0 = mallinfo2().uordblks;
        const double t0 = bench::now_s();
        const checkpoint_metadata md = parse_checkpoint_metadata(text, "metadata.json");
        const double parse_s = bench::now_s() - t0;
        const double parse_mib = double(mallinfo2().uordblks - heap0) / double(bench::MiB);
        bool first = true;
        for (const u64 lw : {w, w / 2}) {
          const plan_figures f = plan_rank(md, model, my_shards(model, layout, lw, lw / 2));
          const std::string on = std::to_string(lw) + " ranks";
          if (first)
            std::printf("%-6s %-7s %6llu %10llu %9.1f %8.2f %9.3f %9.0f | %-10s %8.3f %6zu %9.0f\n", layout.c_str(),
                        fname, (unsigned long long)w, (unsigned long long)entries, json_mb, write_s[form], parse_s,
                        parse_mib, on.c_str(), f.seconds, f.files, double(f.bytes) / double(bench::MiB));
          else
            std::printf("%-6s %-7s %6s %10s %9s %8s %9s %9s | %-10s %8.3f %6zu %9.0f\n", "", "", "", "", "", "", "", "",
                        on.c_str(), f.seconds, f.files, double(f.bytes) / double(bench::MiB));
          first = false;
        }
        if (form == 1 && grids != model.size())
          std::printf("%-6s %-7s %6s  (%llu of %zu tensors are grids; the rest stay listed)\n", "", "", "",
                      (unsigned long long)grids, model.size());
        std::fflush(stdout);
      }
    }
  }
  std::printf(
      "\nThe goal (issue 31): a rank reads and plans a 16,384-rank checkpoint in <= 1 s, with metadata read\n"
      "and planning per rank growing no faster than O(log world) or O(tensors): the compact form's parse and\n"
      "plan columns.\n");
  return 0;
}
