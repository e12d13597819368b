// bench/bench_layouts.cpp - loads at the storage limit against the peers (issue 57): one model
// (Llama-like F32 shapes) and its Adam moments in every layout a user brings, loaded into
// existing memory by shardsafe and by the Python route a user would pick instead, cold (the files
// evicted from the page cache before each run) and warm, in one run, against the best plain read
// of the same files measured in the same run. No LibTorch in this program.
//
// Layouts (written once; --keep reuses them):
//   shardsafe  model + Adam saved by 4 thread ranks as dim-0 row blocks (FSDP2's), rank_R files
//   dcp        the same state saved by torch's dcp.save from 4 Gloo ranks (DTensor Shard(0))
//   hf         the model as 2 safetensors files + model.safetensors.index.json
//   bin        the model as 2 torch.save files + pytorch_model.bin.index.json
// (bench/layouts_peer.py writes dcp, hf and bin with torch 2.x; this program the shardsafe one.)
// Loads, each in a fresh process (fork; the peers a Python child) so that its peak RSS is its own,
// every destination allocated and touched before the clock starts (the model and optimizer exist):
//   shardsafe whole       one rank, every tensor whole (load(dir, views))
//   shardsafe 3 ranks     three ranks (threads of one process, each its own load) each loading its
//                         torch.chunk row blocks: the 4 saved blocks resharded
//   torch dcp.load whole  / 3 Gloo ranks into DTensor Shard(0) blocks (dcp; also the peer of the
//                         shardsafe layout: what a torch user saves and loads instead)
//   load_file, load_file into the model, torch.load(mmap) into the model, torch.load (hf, bin)
// Every value shardsafe loads is checked against v(k, i) (layouts_peer.py), the peers check theirs.
// Limits, per layout and cache state: plain reads of every byte of its files (pread at 1 to 16
// threads and 1 to 16 MiB, O_DIRECT at 4 and 8 threads), the best median of them. Each plain read
// runs again later in every round, after the loads: the control row ("the same read again") is
// the limit's own read against its best median, what the disk's spread and the pick of the best
// of seven leave to any load. "x paired": each round's load over the geometric mean of the
// limit's read in that round before the loads and after them, the median over rounds (the drift
// between rounds and the best-of-seven's lift left out); the cold target is listed both ways.
// The in-place reads land in one buffer made once (bench::place_buffer).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "bench_llama.hpp"
#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;
using bench::u64;
namespace fs = std::filesystem;

namespace {

struct tensor_def {
  std::string key;
  shape_t shape;
};

struct dims {
  u64 h, vocab, layers;
};

/// layouts_peer.py's params(): the model's parameters in order.
std::vector<tensor_def> params(const dims& d) {
  const u64 h = d.h;
  std::vector<tensor_def> m{{"model.embed_tokens.weight", {d.vocab, h}}};
  for (u64 l = 0; l < d.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    m.push_back({p + "self_attn.qkv_proj.weight", {3 * h, h}});
    m.push_back({p + "self_attn.o_proj.weight", {h, h}});
    m.push_back({p + "mlp.up_proj.weight", {4 * h, h}});
    m.push_back({p + "mlp.down_proj.weight", {h, 4 * h}});
    m.push_back({p + "input_layernorm.weight", {h}});
    m.push_back({p + "post_attention_layernorm.weight", {h}});
  }
  m.push_back({"model.norm.weight", {h}});
  m.push_back({"lm_head.weight", {d.vocab, h}});
  return m;
}

/// layouts_peer.py's train_state(): the model, then Adam's exp_avg and exp_avg_sq of each.
std::vector<tensor_def> train_state(const dims& d) {
  auto ps = params(d), out = ps;
  for (const char* m : {"exp_avg", "exp_avg_sq"})
    for (const auto& p : ps) out.push_back({"optim." + p.key + "." + m, p.shape});
  return out;
}

/// v(k, i) for i = begin, begin + 1, ...: x = (i * 2654435761 + k * 40503 + 12345) mod 2^24, x / 2^24.
struct values {
  static constexpr u64 mask = (u64(1) << 24) - 1, step = 2654435761u & mask;
  u64 x;
  values(u64 k, u64 begin) : x((begin * 2654435761u + k * 40503 + 12345) & mask) {}
  float next() {
    const float f = float(x) * (1.0f / 16777216.0f);
    x = (x + step) & mask;
    return f;
  }
};

/// One rank's memory and views of `state`: tensor k's torch.chunk row block r of n (n == 1: whole
/// tensors, no spec).
struct rank_views {
  std::vector<std::vector<float>> mem;
  std::vector<flat_view> views;
  std::vector<std::pair<u64, u64>> origin;  ///< (k, first flat element) of each view

  rank_views(const std::vector<tensor_def>& state, u64 r, u64 n, bool fill) {
    mem.reserve(state.size());
    for (u64 k = 0; k < state.size(); ++k) {
      const auto& t = state[k];
      const u64 rows = t.shape[0], row = numel(t.shape) / rows;
      auto [b, e] = bench::even_part(rows, n, r);
      if (b == e) continue;
      b *= row;
      e *= row;
      mem.emplace_back(static_cast<std::size_t>(e - b), 0.0f);  // touched: the memory exists
      if (fill) {
        values v(k, b);
        for (float& f : mem.back()) f = v.next();
      }
      flat_view fv{t.key,      dtype::F32, t.shape, std::nullopt, reinterpret_cast<std::byte*>(mem.back().data()),
                   (e - b) * 4};
      if (n > 1) fv.spec = flat_spec{{b, e}};
      views.push_back(std::move(fv));
      origin.emplace_back(k, b);
    }
  }
  /// Values that differ from v(k, i).
  u64 wrong() const {
    u64 bad = 0;
    for (std::size_t j = 0; j < mem.size(); ++j) {
      values v(origin[j].first, origin[j].second);
      for (float f : mem[j]) {
        const float w = v.next();
        bad += std::memcmp(&f, &w, 4) != 0;
      }
    }
    return bad;
  }
};

/// shardsafe's load of `state` from dir by n ranks (threads), each into its own existing memory;
/// returns the values that differ from v (after the clock: in_child times the whole call, so the
/// check is timed apart and subtracted).
double load_ranks(const fs::path& dir, const std::vector<tensor_def>& state, u64 n, const load_options& opt,
                  double& seconds) {
  std::vector<std::unique_ptr<rank_views>> ranks;
  for (u64 r = 0; r < n; ++r) ranks.push_back(std::make_unique<rank_views>(state, r, n, false));
  const double t0 = bench::now_s();
  std::vector<std::thread> ts;
  for (u64 r = 0; r < n; ++r)
    ts.emplace_back([&, r] { load(file_directory(dir), std::span<const flat_view>(ranks[r]->views), opt); });
  for (auto& t : ts) t.join();
  seconds = bench::now_s() - t0;
  u64 bad = 0;
  for (const auto& rv : ranks) bad += rv->wrong();
  return double(bad);
}

/// The shardsafe layout: `state` saved by 4 thread ranks as row blocks (durable).
void save_shardsafe(const fs::path& dir, const std::vector<tensor_def>& state) {
  const auto thrown = run_ranks(
      4,
      [&](thread_comm& comm) {
        const rank_views rv(state, u64(comm.rank()), 4, true);
        save_options so;
        so.overwrite = true;
        save(file_directory(dir), std::span<const flat_view>(rv.views), comm, so);
      },
      std::chrono::minutes(10));
  for (const auto& e : thrown)
    if (e) std::rethrow_exception(e);
}

std::vector<fs::path> files_of(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

u64 bytes_of(const std::vector<fs::path>& files) {
  u64 n = 0;
  for (const auto& f : files) n += fs::file_size(f);
  return n;
}

/// A timed route: shardsafe's (ranks > 0) or a peer's (peer case name), its runs per cache state.
struct route {
  std::string name;
  u64 ranks = 0;          ///< shardsafe: ranks loading (1: whole)
  std::string peer_case;  ///< layouts_peer.py's case
  int group = 0;          ///< shardsafe rows are compared with the peers of their group
  unsigned threads = 0;   ///< shardsafe: load_options::threads (0: the library's choice)
  std::vector<bench::outcome> runs[2];
  std::string why;
};

route our_route(std::string name, u64 ranks, int group) {
  route r;
  r.name = std::move(name);
  r.ranks = ranks;
  r.group = group;
  return r;
}
route peer_route(std::string name, std::string peer_case, int group = 0) {
  route r;
  r.name = std::move(name);
  r.peer_case = std::move(peer_case);
  r.group = group;
  return r;
}

/// A step of the peer, bounded (coreutils' timeout kills its whole process group, mp.spawn's
/// ranks too, past limit_s: a bound on a hang, not a measurement) and run once more when it
/// failed, saying so: a hang is torch's, not the code measured (bench_dcp does the same).
bench::outcome peer_step(std::vector<std::string> argv, int limit_s) {
  argv.insert(argv.begin(), {"/usr/bin/timeout", "-k", "10", std::to_string(limit_s)});
  bench::outcome o = bench::run_peer(argv);
  if (!o.ok && o.why.rfind("skipped", 0) != 0) {
    std::fprintf(stderr, "bench_layouts: the peer's '%s' failed or hung (%s); once more\n", argv[6].c_str(),
                 o.why.substr(0, 200).c_str());
    o = bench::run_peer(argv);
  }
  return o;
}

struct layout {
  std::string name, sub;
  bool optim;
  std::string peers_of;  ///< the layout whose peer rows this one's are compared with (empty: its own)
  std::vector<route> routes;
  std::vector<fs::path> files;
  std::map<std::string, bench::samples> limit[2];  ///< plain read config -> rates (bytes/s)
  /// The same plain reads measured again in each round, after the loads: the control that says
  /// how the best one scores against itself (the disk's spread, and the best-of-seven's lift)
  std::map<std::string, bench::samples> again[2];
  /// The same two, round by round (rates in the rounds' order): what pairs a load with the reads
  /// just before and after it
  std::map<std::string, std::vector<double>> limit_seq[2], again_seq[2];
};

layout make_layout(std::string name, std::string sub, bool optim, std::string peers_of, std::vector<route> routes) {
  layout l;
  l.name = std::move(name);
  l.sub = std::move(sub);
  l.optim = optim;
  l.peers_of = std::move(peers_of);
  l.routes = std::move(routes);
  return l;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::args a(argc, argv);
  bench::accept_only(
      a, "loads at the storage limit against the peers, cold and warm, every layout (issue 57)",
      {{"--quick", nullptr, "small model, one round, cold only (a smoke run)"},
       {"--reps", "N", "rounds, each every route cold then warm (default 3)"},
       {"--dir", "DIR", "where the layouts go (default /tmp; a real disk, not tmpfs)"},
       {"--keep", nullptr, "keep the layouts in DIR/shardsafe-bench-layouts (--quick: -quick) and reuse them later"},
       {"--layouts", "LIST", "only these of shardsafe,dcp,hf,bin"},
       {"--no-peers", nullptr, "shardsafe's rows and the limits only"},
       {"--threads", "LIST", "shardsafe's rows again at these reads in flight (load_options::threads)"},
       {"--max-read-mib", "N", "shardsafe's largest read (default: the library's)"}});
  const bool quick = a.has("--quick");
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 3));
  const dims d = quick ? dims{128, 1000, 2} : dims{1024, 16000, 6};
  const int step_limit_s = quick ? 120 : 900;  // a peer's step that takes longer has hung
  const std::vector<std::string> dim_args{std::to_string(d.h), std::to_string(d.vocab), std::to_string(d.layers)};
  const std::string py = "/usr/bin/python3";
  const std::string peer = (fs::path(SHARDSAFE_SOURCE_DIR) / "bench" / "layouts_peer.py").string();
  // a run that keeps its layouts writes them to a folder of their size; one that does not, to a
  // folder of its own that it removes (never a kept one)
  const fs::path base =
      fs::path(a.get("--dir", "/tmp")) / (std::string("shardsafe-bench-layouts") + (quick ? "-quick" : "") +
                                          (a.has("--keep") ? "" : "." + std::to_string(::getpid())));
  const bench::outcome version = bench::run_peer({py, peer, "version"});
  std::printf("bench_layouts: %s, %d round(s); load average %s\n", quick ? "--quick" : "full", reps,
              bench::loadavg().c_str());
  const bool reuse = a.has("--keep") && fs::exists(base / "bin" / "pytorch_model.bin.index.json");
  if (!version.ok && !(reuse && a.has("--no-peers"))) {
    // the dcp, hf and bin layouts are torch's own writes: without torch 2.x nothing compares
    std::printf(
        "peer: %snothing measured: run it where /usr/bin/python3 has torch >= 2.1 and safetensors "
        "(the Debian 13 root: bench/README.md)\n",
        (version.out.empty() ? version.why + "\n" : version.out).c_str());
    return 0;
  }
  std::printf("peer: /usr/bin/python3, %s", version.ok ? version.out.c_str() : "none (--no-peers on kept layouts)\n");
  const auto train = train_state(d), model = params(d);
  if (!reuse) {
    fs::remove_all(base);
    fs::create_directories(base);
    double t0 = bench::now_s();
    std::vector<std::string> w{py, peer, "write", base.string()};
    w.insert(w.end(), dim_args.begin(), dim_args.end());
    const bench::outcome wrote = peer_step(w, step_limit_s);
    if (!wrote.ok) {
      std::fprintf(stderr, "bench_layouts: the peer could not write the layouts: %s\n", wrote.why.c_str());
      if (!a.has("--keep")) fs::remove_all(base);
      return 1;
    }
    std::printf("written by torch (dcp by 4 Gloo ranks, hf, bin) in %.1f s; ", bench::now_s() - t0);
    t0 = bench::now_s();
    save_shardsafe(base / "shardsafe", train);
    std::printf("shardsafe by 4 thread ranks in %.1f s (durable)\n", bench::now_s() - t0);
  }

  std::vector<layout> layouts;
  // the shardsafe layout's peer is torch's load of the same state from torch's own layout (dcp)
  layouts.push_back(make_layout(
      "shardsafe checkpoint, model + Adam, saved by 4 ranks (x peer: torch's rows of the DCP below)", "shardsafe", true,
      "dcp", {our_route("shardsafe whole", 1, 0), our_route("shardsafe 3 ranks (resharded)", 3, 1)}));
  layouts.push_back(make_layout(
      "torch DCP, model + Adam, saved by 4 ranks", "dcp", true, "",
      {our_route("shardsafe whole", 1, 0), our_route("shardsafe 3 ranks (resharded)", 3, 1),
       peer_route("torch dcp.load whole", "dcp_whole", 0), peer_route("torch dcp.load 3 ranks", "dcp_resharded", 1)}));
  layouts.push_back(make_layout(
      "Hugging Face safetensors folder, model, 2 files", "hf", false, "",
      {our_route("shardsafe whole", 1, 0), peer_route("safetensors load_file (new tensors)", "st_load_file", 0),
       peer_route("load_file + copy into the model", "st_into", 0)}));
  layouts.push_back(make_layout(
      "torch.save .bin folder, model, 2 files", "bin", false, "",
      {our_route("shardsafe whole", 1, 0), peer_route("torch.load(mmap=True) + copy into the model", "bin_mmap", 0),
       peer_route("torch.load (new tensors)", "bin_load", 0)}));
  if (a.has("--layouts")) {
    const auto keep = bench::split_list(a.get("--layouts", ""));
    std::erase_if(layouts, [&](const layout& l) {
      return std::find(keep.begin(), keep.end(), l.sub) == keep.end() &&
             std::none_of(layouts.begin(), layouts.end(), [&](const layout& o) {
               return o.peers_of == l.sub && std::find(keep.begin(), keep.end(), o.sub) != keep.end();
             });
    });
  }
  if (a.has("--no-peers"))
    for (auto& l : layouts) std::erase_if(l.routes, [](const route& r) { return r.ranks == 0; });
  for (auto& l : layouts) l.files = files_of(base / l.sub);
  // the sweep: shardsafe's rows again at other reads in flight
  for (auto& l : layouts) {
    const std::vector<route> first = l.routes;
    for (const auto& t : bench::split_list(a.get("--threads", "")))
      for (route r : first)
        if (r.ranks) {
          r.threads = static_cast<unsigned>(std::stoul(t));
          r.name += ", " + t + " in flight";
          l.routes.push_back(std::move(r));
        }
  }
  load_options opt;
  if (a.has("--max-read-mib")) opt.reads.max_read_bytes = u64(a.get_int("--max-read-mib", 64)) * bench::MiB;

  // every plain read lands in place in one buffer the files' size, as a load lands its bytes
  using rc = bench::read_config;
  const u64 MiB = bench::MiB;
  const std::vector<rc> configs =
      quick ? std::vector<rc>{{1, MiB, false, true}, {4, 4 * MiB, true, true}}
            : std::vector<rc>{{1, MiB, false, true},      {2, 16 * MiB, false, true}, {4, 4 * MiB, false, true},
                              {8, 16 * MiB, false, true}, {16, 8 * MiB, false, true}, {4, 4 * MiB, true, true},
                              {8, 16 * MiB, true, true}};
  double worst_resident = 0;
  bench::place_buffer place;  // the in-place reads' buffer, made once (touched) and reused
  auto warm = [](const std::vector<fs::path>& files) { bench::read_rate(files, {2, 16 * bench::MiB, false}); };
  for (int rep = 0; rep < reps; ++rep)
    for (int cold = 1; cold >= (quick ? 1 : 0); --cold)  // --quick: cold only (a smoke run)
      for (auto& l : layouts) {
        auto prepare = [&] {
          if (cold)
            worst_resident = std::max(worst_resident, bench::evict_all(l.files));
          else
            warm(l.files);
        };
        for (const auto& c : configs) {
          prepare();
          const double rate = bench::read_rate(l.files, c, bench::aligned_bytes, &place);
          l.limit[cold][c.name()].add(rate);
          l.limit_seq[cold][c.name()].push_back(rate);
        }
        const auto& state = l.optim ? train : model;
        for (auto& r : l.routes) {
          prepare();
          if (r.ranks) {
            r.runs[cold].push_back(bench::in_child([&] {
              double s = 0;
              load_options o = opt;
              o.threads = r.threads;
              const double bad = load_ranks(base / l.sub, state, r.ranks, o, s);
              return bad == 0 ? s : -1 - bad;  // seconds of the load alone, or the count of wrong values
            }));
            auto& o = r.runs[cold].back();
            if (o.ok && o.sum < 0) o = {0, 0, 0, false, bench::fmt("%.0f values differ from v(k, i)", -1 - o.sum), {}};
            if (o.ok) o.seconds = o.sum;  // the load's own seconds (the child's time includes allocation)
          } else {
            std::vector<std::string> c{py, peer, r.peer_case, base.string()};
            c.insert(c.end(), dim_args.begin(), dim_args.end());
            r.runs[cold].push_back(peer_step(c, step_limit_s));
            auto& o = r.runs[cold].back();
            if (o.ok && o.field("peak_rss_mib") > 0) o.peak = o.field("peak_rss_mib");
          }
          if (!r.runs[cold].back().ok) r.why = r.runs[cold].back().why;
        }
        for (const auto& c : configs) {
          prepare();
          const double rate = bench::read_rate(l.files, c, bench::aligned_bytes, &place);
          l.again[cold][c.name()].add(rate);
          l.again_seq[cold][c.name()].push_back(rate);
        }
      }

  std::printf(
      "\ncold: the layout's files evicted before every run (posix_fadvise DONTNEED; at most %.1f%% of a "
      "file still resident); warm: read once before. Seconds are medians of %d round(s) (best in "
      "brackets); GB/s of the files' bytes; x limit = this rate / the best plain read's median rate "
      "of the same files in the same cache state; x peer = the best peer row's median / this one's.\n",
      worst_resident * 100, reps);
  struct target {
    std::string what;
    double x, want;
    double ceiling = 0;  ///< against a peer: the limit's rate over the peer's (no load can beat the peer by more)
    double control = 0;  ///< against the limit: the limit's read measured again, x the limit
    double medians = 0;  ///< paired: the same load against the limit by medians (x limit)
    bool met() const { return x >= want; }
  };
  std::vector<target> targets;
  for (const auto& l : layouts) {
    const u64 bytes = bytes_of(l.files);
    std::printf("\n%s: %zu files, %.1f MiB (%s)\n", l.name.c_str(), l.files.size(), double(bytes) / bench::MiB,
                l.sub.c_str());
    double lim[2] = {0, 0};
    std::string lim_name[2];
    for (int cold : {1, 0})
      for (const auto& [n, rates] : l.limit[cold])
        if (rates.median() > lim[cold]) lim[cold] = rates.median(), lim_name[cold] = n;
    bench::table t({"route", "cold s", "cold GB/s", "x limit", "x paired", "x peer", "warm s", "warm GB/s", "x limit",
                    "x paired", "x peer", "peak MiB"});
    auto secs = [](const route& r, int cold, bool best) {
      bench::samples s;
      for (const auto& o : r.runs[cold])
        if (o.ok) s.add(o.seconds);
      return best ? s.best() : s.median();
    };
    const auto of = std::find_if(layouts.begin(), layouts.end(), [&](const layout& x) { return x.sub == l.peers_of; });
    const layout& pl = of == layouts.end() ? l : *of;
    auto best_peer = [&](int group, int cold) {
      double b = 0;
      for (const auto& r : pl.routes)
        if (!r.ranks && r.group == group && secs(r, cold, false) > 0)
          b = b == 0 ? secs(r, cold, false) : std::min(b, secs(r, cold, false));
      return b;
    };
    // a route's rate in each round over the limit's read in the same round, before and after it
    // (their geometric mean): the median of those ratios, free of the drift between rounds and
    // of the lift that picking the best of seven medians gives the limit
    auto paired = [&](const route& r, int cold) {
      const auto& before = l.limit_seq[cold].at(lim_name[cold]);
      const auto& after = l.again_seq[cold].at(lim_name[cold]);
      bench::samples x;
      for (std::size_t i = 0; i < r.runs[cold].size() && i < before.size() && i < after.size(); ++i)
        if (const auto& o = r.runs[cold][i]; o.ok && o.seconds > 0 && before[i] > 0 && after[i] > 0)
          x.add(double(bytes) / o.seconds / std::sqrt(before[i] * after[i]));
      return x.median();
    };
    double control[2] = {0, 0};  // the limit's read again, later in the same rounds, x the limit
    for (int cold : {1, 0})
      if (!lim_name[cold].empty()) {  // (--quick runs no warm round)
        const char* state = cold ? "cold" : "warm";
        control[cold] = l.again[cold].at(lim_name[cold]).median() / lim[cold];
        t.add({std::string(state) + " limit: " + lim_name[cold], "", bench::fmt("%.2f", lim[cold] / 1e9), "1.00"});
        t.add({std::string(state) + " the same read again (control)", "",
               bench::fmt("%.2f", control[cold] * lim[cold] / 1e9), bench::fmt("%.2f", control[cold])});
      }
    t.separator();
    for (const auto& r : l.routes) {
      std::vector<std::string> row{r.name};
      double peak = 0;
      for (int cold : {1, 0}) {
        const double m = secs(r, cold, false);
        if (m == 0) {
          row.insert(row.end(), {"-", "-", "-", "-", "-"});
          continue;
        }
        const double rate = double(bytes) / m, p = best_peer(r.group, cold), x_paired = paired(r, cold);
        row.push_back(bench::fmt("%.3f", m) + bench::fmt(" (%.3f)", secs(r, cold, true)));
        row.push_back(bench::fmt("%.2f", rate / 1e9));
        row.push_back(bench::fmt("%.2f", rate / lim[cold]));
        row.push_back(bench::fmt("%.2f", x_paired));
        row.push_back(r.ranks && p > 0 ? bench::fmt("%.2f", p / m) : "");
        for (const auto& o : r.runs[cold]) peak = std::max(peak, o.peak);
        if (r.ranks) {
          const std::string who = l.sub + ": " + r.name + (cold ? ", cold" : ", warm");
          if (cold) {
            targets.push_back({who + ": >= 0.9 x the best plain read", rate / lim[cold], 0.9, 0, control[cold]});
            targets.push_back(
                {who + ": >= 0.9 x the best plain read, paired by round", x_paired, 0.9, 0, 0, rate / lim[cold]});
          }
          if (p > 0)
            targets.push_back({who + (cold ? ": >= 2 x the best peer" : ": >= 4 x the best peer"), p / m,
                               cold ? 2.0 : 4.0, p * lim[cold] / double(bytes)});
        }
      }
      row.push_back(bench::fmt("%.0f", peak));
      t.add(row);
      if (!r.why.empty()) std::printf("  %s: %s\n", r.name.c_str(), r.why.substr(0, 200).c_str());
    }
    t.print();
  }
  std::printf("\ntargets:\n");
  bool all = true;
  for (const auto& x : targets) {
    bench::print_target(78, x.what.c_str(), x.x, " x", x.met());
    if (x.ceiling > 0 && !x.met())
      std::printf("      (the limit itself is %.2f x that peer: %s)\n", x.ceiling,
                  x.ceiling < x.want ? "out of reach of any load" : "within reach");
    if (x.control > 0 && !x.met())
      std::printf("      (the limit's own read, measured again in the same rounds: %.2f x%s)\n", x.control,
                  x.control < x.want ? ", short of the target too: the disk's spread" : "");
    if (x.medians > 0)
      std::printf(
          "      (by medians, the line above: %.2f x; paired: each round's load over the geometric mean of "
          "the limit's read in that round before the loads and after them, the median over rounds)\n",
          x.medians);
    all = all && x.met();
  }
  std::printf("%s\n\nload average after: %s\n", all ? "every target met" : "not every target met",
              bench::loadavg().c_str());
  if (!a.has("--keep")) fs::remove_all(base);
  bool failed = false;
  for (const auto& l : layouts)
    for (const auto& r : l.routes)
      if (r.ranks && !r.why.empty()) failed = true;  // a wrong value or a failed load of shardsafe's
  return failed ? 1 : 0;
}
