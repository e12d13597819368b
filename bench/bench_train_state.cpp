// bench_train_state - a training checkpoint: a torch::nn::Module's parameters plus its Adam
// state (exp_avg, exp_avg_sq, step), saved and loaded with shardsafe's
// save_model_and_optim_state / load_model_and_optim_state, beside LibTorch's
// torch::save(module) + torch::save(optimizer) and torch::load of both, and the I/O and copy
// limits of the same bytes. One process (single_process).
//
//   meson setup build-bench -Dbench=true -Dbuildtype=release -Dtests=false -Dexamples=false
//   meson compile -C build-bench bench_train_state
//   ./build-bench/bench/bench_train_state [--quick] [--dir /tmp] [--reps 3] [--layers 4]
//
// The module registers the transformer tensors of bench_checkpoint as parameters (names with
// '_' for '.', as Module requires): embed [32000, 2048] and per layer qkv [6144, 2048],
// o [2048, 2048], up [8192, 2048], down [2048, 8192], two norms [2048]; --layers 4 (default)
// gives 1018 MiB of F32 parameters, 3054 MiB with Adam's two moments. --quick: d = 256,
// 2 layers (~6 MiB of parameters), one repetition.
//
// Each measurement runs in a fresh process. The saving process holds the module and an Adam
// whose state exists (values set, step 7). The loading process holds the module (parameters
// allocated and zeroed, as a model built before a resume) and a fresh Adam without state: both
// libraries create the state tensors as they load. One more row loads into an Adam whose state
// exists already (a trainer that rolls back in place), where shardsafe allocates nothing. "peak +MiB" is VmHWM minus VmRSS before the
// module was built; the target compares it with parameters + optimizer state.
// Loads read warm files (each read once before; resident % printed): shardsafe saves with
// O_DIRECT, which leaves its files uncached. shardsafe's save is durable (fdatasync + rename +
// folder fsync); torch::save is shown alone and + fsync.
// Asynchronous saves (torch/async_checkpointer.hpp): the training thread's stall (plan + snapshot into
// staging) of the second of two saves (staging reused) and of the first (staging allocated),
// and the time from the call to durable, for the whole state and for the parameters alone
// (the ~1 GiB state, beside a blocking save_state_dict of them and one memcpy of their bytes).
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include "bench_torch_common.hpp"
#include "shardsafe/torch/async_checkpointer.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;
using bench::MiB;
using bench::u64;
namespace fs = std::filesystem;

namespace {

struct config {
  bool quick = false;
  int layers = 4;
};

// torch::nn::Module parameter names may not contain dots
std::vector<bench::tensor_def> defs_of(const config& c) { return bench::transformer_defs(c.quick, c.layers, '_'); }

u64 param_bytes(const config& c) { return bench::defs_bytes(defs_of(c), 4); }

struct bench_model : torch::nn::Module {
  std::vector<at::Tensor> params;
  explicit bench_model(const config& c) {
    for (const auto& d : defs_of(c)) params.push_back(register_parameter(d.name, at::zeros(to_sizes(d.shape))));
  }
};

void fill_whole(const at::Tensor& t, std::uint64_t k) {
  bench::fill_runs(t, k, [&](auto&& f) { f(0, static_cast<u64>(t.numel()), 0); });
}

bool check_whole(const at::Tensor& t, std::uint64_t k, const char* what) {
  const u64 n = static_cast<u64>(t.numel());
  for (u64 i = 0; i < n; i += std::max<u64>(1, n / 256))
    if (!bench::same_value(t, i, k, i)) {
      std::fprintf(stderr, "verify: %s %llu element %llu is wrong\n", what, (unsigned long long)k,
                   (unsigned long long)i);
      return false;
    }
  return true;
}

torch::optim::AdamParamState& adam_state(torch::optim::Adam& opt, const at::Tensor& p) {
  auto* s = optimizer_state_of(opt, p);
  if (!s) throw std::runtime_error("no Adam state for a parameter");
  return static_cast<torch::optim::AdamParamState&>(*s);
}

// The saving side: parameters and Adam state with known values.
struct train_state {
  std::shared_ptr<bench_model> model;
  std::unique_ptr<torch::optim::Adam> opt;
  train_state(const config& c, bool with_values) {
    model = std::make_shared<bench_model>(c);
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
    if (!with_values) return;
    at::NoGradGuard ng;
    init_optimizer_state(*opt);
    for (std::size_t k = 0; k < model->params.size(); ++k) {
      fill_whole(model->params[k], k);
      auto& s = adam_state(*opt, model->params[k]);
      fill_whole(s.exp_avg(), 1000 + k);
      fill_whole(s.exp_avg_sq(), 2000 + k);
      s.step(7);
    }
  }
  bool verify() {
    for (std::size_t k = 0; k < model->params.size(); ++k) {
      const auto& p = model->params[k];
      if (!check_whole(p, k, "parameter")) return false;
      if (!optimizer_state_of(*opt, p)) {
        std::fprintf(stderr, "verify: no optimizer state for parameter %zu\n", k);
        return false;
      }
      auto& s = adam_state(*opt, p);
      if (!check_whole(s.exp_avg(), 1000 + k, "exp_avg") || !check_whole(s.exp_avg_sq(), 2000 + k, "exp_avg_sq"))
        return false;
      if (s.step() != 7) {
        std::fprintf(stderr, "verify: step %lld\n", (long long)s.step());
        return false;
      }
    }
    return true;
  }
  u64 state_bytes() {
    u64 n = 0;
    for (const auto& p : model->params) n += 3 * p.nbytes();
    return n;
  }
};

int child(const std::string& what, const bench::args& a) {
  config c;
  c.quick = a.has("--quick");
  c.layers = static_cast<int>(a.get_int("--layers", c.quick ? 2 : 4));
  const std::string dir = a.get("--path", "");
  {
    at::Tensor t = at::ones({1024});
    (void)t.sum().item<float>();
  }
  const double rss0 = bench::rss_mib();
  const double anon0 = double(bench::proc_status_kib("RssAnon")) / 1024.0;
  bench::reset_peak_rss();
  single_process comm;
  if (what == "ss-save") {
    train_state ts(c, true);
    save_options so;
    so.overwrite = true;
    const double t0 = bench::now_s();
    save_model_and_optim_state(file_directory(dir), *ts.model, ts.opt.get(), comm, so);
    bench::emit("seconds", bench::now_s() - t0);
  } else if (what == "ss-save-model") {
    // the parameters alone (the ~1 GiB state): blocking save_state_dict
    train_state ts(c, true);
    const state_dict model = module_state_dict(*ts.model);
    save_options so;
    so.overwrite = true;
    const double t0 = bench::now_s();
    save_state_dict(file_directory(dir), model, comm, so);
    bench::emit("seconds", bench::now_s() - t0);
  } else if (what == "ss-async" || what == "ss-async-model") {
    // two asynchronous saves of the same state (into DIR/a, then DIR/b): the first allocates
    // and touches the staging memory, the second reuses it. The caller waits at once.
    const bool model_only = what == "ss-async-model";
    train_state ts(c, true);
    const state_dict model = module_state_dict(*ts.model);
    async_checkpointer<single_process> ckpt{single_process{}};
    save_options so;
    so.overwrite = true;
    for (const char* sub : {"a", "b"}) {
      const double t0 = bench::now_s();
      async_save_handle h =
          model_only ? ckpt.save_state_dict(file_directory(dir + "/" + sub), model, so)
                     : ckpt.save_model_and_optim_state(file_directory(dir + "/" + sub), model, ts.opt.get(), so);
      const double stall = bench::now_s() - t0;
      h.wait();
      const double durable = bench::now_s() - t0;
      bench::emit(sub == std::string("a") ? "stall_first" : "stall", stall);
      bench::emit(sub == std::string("a") ? "durable_first" : "durable", durable);
    }
    if (model_only) {  // one memcpy of the same bytes, 1 thread, into touched memory
      u64 n = 0;
      for (const auto& p : ts.model->params) n += p.nbytes();
      std::vector<std::byte> dst(n);
      std::memset(dst.data(), 1, n);
      const double t0 = bench::now_s();
      u64 off = 0;
      for (const auto& p : ts.model->params) {
        std::memcpy(dst.data() + off, p.data_ptr(), p.nbytes());
        off += p.nbytes();
      }
      bench::emit("memcpy_1t", bench::now_s() - t0);
    }
    if (a.has("--verify")) {  // the second checkpoint loads back with the values saved
      train_state back(c, false);
      if (model_only) {
        state_dict into = module_state_dict(*back.model);
        load_state_dict(file_directory(dir + "/b"), into);
        for (std::size_t k = 0; k < back.model->params.size(); ++k)
          if (!check_whole(back.model->params[k], k, "parameter")) return 1;
      } else {
        load_model_and_optim_state(file_directory(dir + "/b"), *back.model, back.opt.get(), comm);
        if (!back.verify()) return 1;
      }
    }
  } else if (what == "torch-save") {
    train_state ts(c, true);
    fs::create_directories(dir);
    const double t0 = bench::now_s();
    torch::save(ts.model, dir + "/model.pt");
    torch::save(*ts.opt, dir + "/optim.pt");
    const double t1 = bench::now_s();
    bench::fsync_path(dir + "/model.pt");
    bench::fsync_path(dir + "/optim.pt");
    bench::emit("seconds", t1 - t0);
    bench::emit("fsync_seconds", bench::now_s() - t1);
  } else if (what == "ss-load" || what == "ss-load-existing" || what == "torch-load") {
    const bool ss = what != "torch-load";
    bench::emit("resident", ss ? bench::page_cache_resident(dir + "/optim/rank_0.safetensors")
                               : bench::page_cache_resident(dir + "/optim.pt"));
    train_state ts(c, false);                                       // the model as built before a resume; a fresh Adam
    if (what == "ss-load-existing") init_optimizer_state(*ts.opt);  // its state exists (zeros), untimed
    bench::rss_sampler sampler;
    const double t0 = bench::now_s();
    if (ss) {
      auto rep = load_model_and_optim_state(file_directory(dir), *ts.model, ts.opt.get(), comm);
      if (std::getenv("BENCH_DEBUG"))
        std::fprintf(stderr, "model load %.3f s (%llu ops), optimizer state load %.3f s (%llu ops), all %.3f s\n",
                     rep.model.seconds, (unsigned long long)rep.model.read_ops, rep.optim.stats.seconds,
                     (unsigned long long)rep.optim.stats.read_ops, rep.seconds);
    } else {
      torch::load(ts.model, dir + "/model.pt");
      torch::load(*ts.opt, dir + "/optim.pt");
    }
    const double t1 = bench::now_s();
    sampler.stop();
    if (!ts.verify()) return 1;
    bench::emit("seconds", t1 - t0);
    bench::emit("peak_mib", bench::hwm_mib() - rss0);
    bench::emit("anon_mib", sampler.peak_anon_mib() - anon0);
  } else if (what == "first-touch") {
    // what the loader allocates: the optimizer's state (the module's parameters exist)
    std::vector<at::Tensor> fresh;
    for (const auto& d : defs_of(c))
      for (int i = 0; i < 2; ++i) fresh.push_back(at::empty(to_sizes(d.shape)));
    bench::emit("seconds", bench::first_touch(fresh));
  } else if (what == "limits") {
    // the same bytes: memcpy into touched memory, pwrite + fdatasync to one file, pread back
    train_state src(c, true), dst(c, true);
    std::vector<std::pair<at::Tensor, at::Tensor>> pairs;
    for (std::size_t k = 0; k < src.model->params.size(); ++k) {
      const auto& p = src.model->params[k];
      const auto& q = dst.model->params[k];
      pairs.emplace_back(p, q);
      pairs.emplace_back(adam_state(*src.opt, p).exp_avg(), adam_state(*dst.opt, q).exp_avg());
      pairs.emplace_back(adam_state(*src.opt, p).exp_avg_sq(), adam_state(*dst.opt, q).exp_avg_sq());
    }
    std::vector<bench::byte_piece> pieces;
    for (auto& [s, d] : pairs)
      pieces.push_back(
          {static_cast<const std::byte*>(s.data_ptr()), static_cast<std::byte*>(d.data_ptr()), s.nbytes()});
    bench::measure_limits(pieces, dir);
    if (!dst.verify()) return 1;
  } else {
    std::fprintf(stderr, "unknown child '%s'\n", what.c_str());
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  bench::accept_only(a,
                     "Saves and loads a module's parameters and its Adam state with shardsafe beside torch::save /\n"
                     "torch::load of both (bench/README.md).",
                     {{"--quick", nullptr, "a small model, one repetition (a smoke run)"},
                      {"--reps", "N", "repetitions of every case (default 3)"},
                      {"--dir", "DIR", "where the checkpoints are written (default /tmp)"},
                      {"--layers", "N", "transformer layers (default 4: 1018 MiB of parameters, 3054 MiB with Adam)"},
                      {"--child", "KIND", "", true},
                      {"--path", "P", "", true},
                      {"--verify", nullptr, "", true}});
  if (argc > 2 && std::string(argv[1]) == "--child") return child(argv[2], a);

  config c;
  c.quick = a.has("--quick");
  c.layers = static_cast<int>(a.get_int("--layers", c.quick ? 2 : 4));
  const int reps = static_cast<int>(a.get_int("--reps", c.quick ? 1 : 3));
  const fs::path scratch = fs::path(a.get("--dir", "/tmp")) / ("shardsafe-bench-train-" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  struct cleanup {
    fs::path p;
    ~cleanup() { fs::remove_all(p); }
  } rm{scratch};
  std::vector<std::string> common{"--layers", std::to_string(c.layers)};
  if (c.quick) common.push_back("--quick");
  auto args = [&](std::vector<std::string> v) {
    v.insert(v.end(), common.begin(), common.end());
    return v;
  };
  const u64 pbytes = param_bytes(c), total = 3 * pbytes;
  const double gb = double(total) / 1e9;
  const std::string load_before = bench::loadavg();
  const double t_start = bench::now_s();
  const std::string ss = (scratch / "ss").string(), pt = (scratch / "torch").string();

  struct row {
    bench::samples t, peak, anon;
    double resident = -1;
  };
  std::map<std::string, row> rows;
  for (int rep = 0; rep < reps; ++rep) {
    std::fprintf(stderr, "repetition %d/%d ...\n", rep + 1, reps);
    // saves go to paths that do not exist (removed untimed before): deleting 3 GiB of files costs
    // up to seconds on this file system (online discard), and it is no part of saving
    fs::remove_all(ss);
    fs::remove_all(pt);
    auto r = bench::run_child(args({"--child", "ss-save", "--path", ss}));
    rows["ss-save"].t.add(r["seconds"]);
    bench::warm_files(ss);  // saved with O_DIRECT: not cached; the loads compared are warm
    // asynchronous saves, and the blocking save of the parameters alone (the ~1 GiB state)
    for (const char* k : {"ss-async", "ss-async-model"}) {
      const std::string p = (scratch / k).string();
      fs::remove_all(p);
      std::vector<std::string> v{"--child", k, "--path", p};
      if (rep == 0) v.push_back("--verify");
      r = bench::run_child(args(v));
      const std::string pre = k;
      for (const char* m : {"stall_first", "stall", "durable_first", "durable"}) rows[pre + ":" + m].t.add(r[m]);
      if (pre == "ss-async-model") rows["memcpy_model_1t"].t.add(r["memcpy_1t"]);
      fs::remove_all(p);
    }
    fs::remove_all(scratch / "ss-model");
    r = bench::run_child(args({"--child", "ss-save-model", "--path", (scratch / "ss-model").string()}));
    rows["ss-save-model"].t.add(r["seconds"]);
    fs::remove_all(scratch / "ss-model");
    r = bench::run_child(args({"--child", "torch-save", "--path", pt}));
    rows["torch-save"].t.add(r["seconds"]);
    rows["torch-save-fsync"].t.add(r["seconds"] + r["fsync_seconds"]);
    for (const char* k : {"ss-load", "ss-load-existing", "torch-load"}) {
      r = bench::run_child(args({"--child", k, "--path", k == std::string("torch-load") ? pt : ss}));
      rows[k].t.add(r["seconds"]);
      rows[k].peak.add(r["peak_mib"]);
      rows[k].anon.add(r["anon_mib"]);
      rows[k].resident = r["resident"];
    }
    r = bench::run_child(args({"--child", "limits", "--path", (scratch / "raw").string()}));
    for (const char* k : {"memcpy_1t", "memcpy_2t", "read_1t", "read_2t", "write_buffered"}) rows[k].t.add(r[k]);
    if (r["write_direct"] > 0) rows["write_direct"].t.add(r["write_direct"]);
    r = bench::run_child(args({"--child", "first-touch"}));
    rows["first_touch_2t"].t.add(r["seconds"]);
  }
  const double t_total = bench::now_s() - t_start;

  std::printf(
      "bench_train_state: %zu parameters (%d layers), F32: parameters %.1f MiB + Adam exp_avg, exp_avg_sq "
      "= %.1f MiB (%.3f GB); %d repetition(s), each measurement in a fresh process\n",
      defs_of(c).size(), c.layers, double(pbytes) / double(MiB), double(total) / double(MiB), gb, reps);
  std::printf(
      "files in %s (ext4, virtual disk); loads read warm files (each read once before the load; no drop_caches: "
      "needs root privileges we lack)\n",
      scratch.c_str());
  std::printf(
      "peak +MiB = VmHWM - VmRSS before the module was built; state = parameters + optimizer state = %.1f MiB\n",
      double(total) / double(MiB));
  std::printf("load average before: %s, after: %s; wall time %.0f s\n\n", load_before.c_str(), bench::loadavg().c_str(),
              t_total);
  bench::table tab({"case", "best ms", "median ms", "best GB/s", "median GB/s", "x torch (median)", "x torch+fsync",
                    "peak +MiB", "peak - state MiB", "anon peak +MiB", "cache"});
  auto add = [&](const std::string& label, const std::string& k, const std::string& peer, const std::string& peer2) {
    const row& x = rows.at(k);
    auto ratio = [&](const std::string& p) {
      return p.empty() ? std::string("") : bench::fmt("%.2f", rows.at(p).t.median() / x.t.median());
    };
    tab.add({label, bench::fmt("%.1f", x.t.best() * 1e3), bench::fmt("%.1f", x.t.median() * 1e3),
             bench::fmt("%.2f", gb / x.t.best()), bench::fmt("%.2f", gb / x.t.median()), ratio(peer), ratio(peer2),
             x.peak.empty() ? "" : bench::fmt("%.0f", x.peak.s.back()),
             x.peak.empty() ? "" : bench::fmt("%+.0f", x.peak.s.back() - double(total) / double(MiB)),
             x.anon.empty() ? "" : bench::fmt("%.0f", x.anon.s.back()),
             x.resident < 0 ? "" : bench::fmt("%.0f%%", x.resident * 100)});
  };
  add("shardsafe save_model_and_optim_state (durable)", "ss-save", "torch-save", "torch-save-fsync");
  add("torch::save(module) + torch::save(optimizer)", "torch-save", "", "");
  add("torch::save x2 + fsync", "torch-save-fsync", "", "");
  add("pwrite + fdatasync of the same bytes (1 thread)", "write_buffered", "", "");
  if (rows.count("write_direct")) add("O_DIRECT pwrite + fdatasync (staged, 2 threads)", "write_direct", "", "");
  tab.separator();
  add("async save_model_and_optim_state: training-thread stall (staging reused)", "ss-async:stall", "", "");
  add("  the first save's stall (staging allocated and touched)", "ss-async:stall_first", "", "");
  add("  from the call to durable (staging reused; the caller waits at once)", "ss-async:durable", "torch-save",
      "torch-save-fsync");
  add("memcpy of the same bytes, 1 thread (touched dst)", "memcpy_1t", "", "");
  tab.separator();
  // the parameters alone: a third of the bytes (GB/s columns use the whole state's bytes)
  add("parameters alone: async save_state_dict, stall (staging reused)", "ss-async-model:stall", "", "");
  add("  the first save's stall (staging allocated and touched)", "ss-async-model:stall_first", "", "");
  add("  from the call to durable (staging reused)", "ss-async-model:durable", "", "");
  add("parameters alone: blocking save_state_dict (durable)", "ss-save-model", "", "");
  add("parameters alone: memcpy, 1 thread (touched dst)", "memcpy_model_1t", "", "");
  tab.separator();
  add("shardsafe load_model_and_optim_state", "ss-load", "torch-load", "");
  add("  the same into an Adam whose state exists", "ss-load-existing", "torch-load", "");
  add("torch::load(module) + torch::load(optimizer)", "torch-load", "", "");
  add("pread of the same bytes, 1 thread (warm cache)", "read_1t", "", "");
  add("pread of the same bytes, 2 threads (warm cache)", "read_2t", "", "");
  add("memcpy of the same bytes, 1 thread (touched dst)", "memcpy_1t", "", "");
  add("memcpy of the same bytes, 2 threads", "memcpy_2t", "", "");
  add("first touch of fresh tensors of the optimizer state's size, 2 threads", "first_touch_2t", "", "");
  tab.print();
  std::printf(
      "(peak columns: the largest over repetitions; anon peak = RssAnon sampled every 2 ms minus its baseline)\n\n");

  auto med = [&](const char* k) { return rows.at(k).t.median(); };
  auto line = [](const char* what, double v, const char* unit, bool ok) { bench::print_target(66, what, v, unit, ok); };
  std::printf("targets (medians):\n");
  double x = med("torch-save") / med("ss-save");
  line("save >= 2x faster than torch::save (shardsafe durable, torch not)", x, "x", x >= 2);
  x = med("torch-save-fsync") / med("ss-save");
  line("save >= 2x faster than torch::save + fsync (both durable)", x, "x", x >= 2);
  x = med("torch-load") / med("ss-load");
  line("load >= 3x faster than torch::load", x, "x", x >= 3);
  x = med("torch-load") / med("ss-load-existing");
  line("  the same, loading into optimizer state that exists", x, "x", x >= 3);
  x = med("ss-async:stall") / med("memcpy_1t");
  line("async save: stall <= 1.5x one memcpy of the same bytes (params + Adam)", x, "x", x <= 1.5);
  x = med("ss-async:durable") / med("ss-save");
  line("async save: to durable <= 1.1x the blocking save (params + Adam)", x, "x", x <= 1.1);
  x = med("ss-async-model:stall") / med("memcpy_model_1t");
  line("async save: stall <= 1.5x one memcpy of the same bytes (params alone)", x, "x", x <= 1.5);
  x = med("ss-async-model:durable") / med("ss-save-model");
  line("async save: to durable <= 1.1x the blocking save (params alone)", x, "x", x <= 1.1);
  const double over = rows.at("ss-load").peak.s.back() - double(total) / double(MiB);
  line("peak RSS on load <= parameters + optimizer state + 64 MiB [MiB over]", over, "", over <= 64);
  return 0;
}
