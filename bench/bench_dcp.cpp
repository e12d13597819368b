// bench/bench_dcp.cpp - a torch DCP checkpoint (~1 GiB, F32, saved by 2 Gloo ranks through
// bench/dcp_peer.py: Debian 12's torch 1.13, or torch 2.x in the Debian 13 root, whichever
// /usr/bin/python3 holds) read by shardsafe and by torch itself, in one run; with torch 2.x also
// shardsafe's DCP save against torch's dcp.save of the same state. No LibTorch in this program.
//
// Cases, round-robin over --reps rounds, each in a fresh process (so that each peak RSS is its
// own), the checkpoint in the page cache (read once before):
//   - torch: FileSystemReader + load_state_dict(no_dist=True) into freshly allocated full
//     tensors: the read half of the Python DCP -> HF converters;
//   - shardsafe load: checkpoint_reader on the folder, every tensor loaded whole into freshly
//     allocated memory (the same work);
//   - shardsafe to-hf: export_hf with the dcp-to-hf preset into a new folder, durable (fsync):
//     the whole conversion, writing included.
// Columns: best / median seconds, x torch (torch's median ÷ this row's), peak RSS of the process
// and its RSS before the work (torch's includes the interpreter and torch itself).
// With torch 2.x, two more rows: torch's dcp.save of the same tensors, whole, in one process
// (FileSystemWriter fsyncs every file), and shardsafe's save_dcp of the tensors loaded from the
// checkpoint (one process, O_DIRECT and fsync: durable), the latter read back and compared whole.
// Then a resharded load into 3 ranks (rows split in three, the checkpoint's rows in two; each
// rank a fresh reader): bytes the ranks need, bytes their read plans read, and every byte the
// process read (/proc/self/io rchar: .metadata, the archives' zip headers and the plans' reads),
// against the target of 1.02x; each rank's bytes are checked against the whole tensors.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "shardsafe/checkpoint/dcp_save.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/format/rename.hpp"
#include "shardsafe/storage/file.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;
using bench::u64;

namespace {

const std::string python = "/usr/bin/python3";

/// How long one step may take before it counts as hung (set in main: 120 s with --quick, whose
/// steps take seconds; 900 s otherwise): a bound on a hang, not a measurement.
int step_limit_s = 900;

/// cmd under `timeout`, which kills the command's whole process group (mp.spawn's ranks too)
/// past step_limit_s.
std::string bounded(const std::string& cmd) { return "timeout -k 10 " + std::to_string(step_limit_s) + " " + cmd; }

/// Runs a step of the Python peer through the shell, bounded(); its output, "FAILED: ..." when
/// it failed. A peer that hung is run once more, saying so: it is torch, not the code measured.
std::string run_capture(const std::string& what, const std::string& cmd) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::string out;
    const double t0 = bench::now_s();
    FILE* p = ::popen(bounded(cmd).c_str(), "r");
    if (!p) return "FAILED: popen";
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int status = ::pclose(p);
    const int rc = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : 255;
    // 124: timeout's own; 137 (SIGKILL) counts only past the limit (else: the OOM killer, say)
    if (rc == 124 || (rc == 137 && bench::now_s() - t0 >= step_limit_s)) {
      std::fprintf(stderr, "bench_dcp: torch's %s did not finish in %d s and was killed (%s)%s\n", what.c_str(),
                   step_limit_s, attempt == 0 ? "; once more" : "; again: giving up",
                   out.empty() ? "" : (": " + out).c_str());
      continue;
    }
    return rc == 0 ? out : "FAILED: " + out;
  }
  return "FAILED: torch's " + what + " hung twice";
}

/// The state of every thread of a process that did not finish (its wait channel: where in
/// the kernel it sleeps), for the report of a hang.
std::string thread_states(pid_t pid) {
  std::string out;
  const fs::path tasks = "/proc/" + std::to_string(pid) + "/task";
  std::error_code ec;
  for (const auto& t : fs::directory_iterator(tasks, ec)) {
    std::ifstream w(t.path() / "wchan"), st(t.path() / "stat");
    std::string wchan, stat;
    std::getline(w, wchan);
    std::getline(st, stat);
    const auto close = stat.rfind(')');
    out += "\n  thread " + t.path().filename().string() + ": state " +
           (close != std::string::npos && close + 2 < stat.size() ? stat.substr(close + 2, 1) : "?") + ", waits in " +
           (wchan.empty() || wchan == "0" ? "user space" : wchan);
  }
  return out;
}

double field(const std::string& line, const std::string& name) {
  const auto at = line.find(name + "=");
  return at == std::string::npos ? -1 : std::atof(line.c_str() + at + name.size() + 1);
}

u64 rchar() {
  std::ifstream f("/proc/self/io");
  std::string k;
  u64 v = 0;
  while (f >> k >> v)
    if (k == "rchar:") return v;
  return 0;
}

struct result {
  double seconds = 0, rss_before = 0, peak = 0;
};

/// Runs prepare() then f() in a child process: f's seconds, the RSS before f and the peak RSS
/// (wait4's ru_maxrss; prepare's memory included). A child that has not finished after
/// step_limit_s is reported with its threads' states, killed, and the benchmark fails: that is
/// shardsafe hanging.
template <class P, class F>
result in_child(const char* what, P&& prepare, F&& f) {
  int fd[2];
  if (::pipe(fd) != 0) std::abort();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fd[0]);
    prepare();
    double r[2] = {bench::rss_mib(), 0};
    const double t0 = bench::now_s();
    f();
    r[1] = bench::now_s() - t0;
    if (::write(fd[1], r, sizeof r) != sizeof r) ::_exit(2);
    ::_exit(0);
  }
  ::close(fd[1]);
  double r[2] = {0, 0};
  pollfd pf{fd[0], POLLIN, 0};
  const double deadline = bench::now_s() + step_limit_s;
  int ready = 0;
  while ((ready = ::poll(&pf, 1, static_cast<int>(std::max(0.0, deadline - bench::now_s()) * 1000))) < 0 &&
         errno == EINTR) {
  }
  if (ready == 0) {
    std::fprintf(stderr, "bench_dcp: %s did not finish in %d s: a hang in shardsafe; its threads:%s\n", what,
                 step_limit_s, thread_states(pid).c_str());
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    std::exit(1);
  }
  const bool got = ::read(fd[0], r, sizeof r) == sizeof r;
  ::close(fd[0]);
  int status = 0;
  struct rusage ru{};
  ::wait4(pid, &status, 0, &ru);
  if (!got || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "bench_dcp: %s failed in its child process\n", what);
    std::exit(1);
  }
  return {r[1], r[0], double(ru.ru_maxrss) / 1024.0};
}
template <class F>
result in_child(const char* what, F&& f) {
  return in_child(what, [] {}, std::forward<F>(f));
}

void load_all(const fs::path& ckpt, std::vector<std::unique_ptr<std::byte[]>>& mem, std::vector<flat_view>& views) {
  checkpoint_reader<file_directory> r{file_directory(ckpt)};
  for (const auto& [key, tm] : r.metadata().tensors) {
    const u64 n = tm.numel() * item_size(tm.type);
    mem.emplace_back(new std::byte[n]);  // uninitialised, as torch.empty
    views.push_back(flat_view{key, tm.type, tm.shape, std::nullopt, mem.back().get(), n});
  }
  load(r, views);
}

void load_all(const fs::path& ckpt) {
  std::vector<std::unique_ptr<std::byte[]>> mem;
  std::vector<flat_view> views;
  load_all(ckpt, mem, views);
}

}  // namespace

int main(int argc, char** argv) {
  const bench::args a(argc, argv);
  bench::accept_only(
      a,
      "Reads a torch DCP checkpoint written by torch (1.13 or 2.x, /usr/bin/python3's) with shardsafe and\n"
      "with torch itself; with torch 2.x, also saves one with both (bench/README.md).",
      {{"--quick", nullptr, "a small model, one round (a smoke run)"},
       {"--reps", "N", "rounds of every case (default 3)"},
       {"--dir", "DIR", "where the checkpoint is written (default the temporary folder)"}});
  const bool quick = a.has("--quick");
  step_limit_s = quick ? 120 : 900;
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 3));
  const u64 h = quick ? 256 : 2048, vocab = quick ? 4000 : 32000, layers = quick ? 2 : 3;
  if (std::system(bounded(python + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    std::printf("bench_dcp: skipped: %s cannot import torch (Debian's python3-torch is the peer)\n", python.c_str());
    return 0;
  }
  const fs::path base = fs::path(a.get("--dir", fs::temp_directory_path().string())) / "shardsafe-bench-dcp";
  fs::remove_all(base);
  fs::create_directories(base);
  const fs::path ckpt = base / "ckpt", out = base / "hf";
  const std::string peer = (fs::path(SHARDSAFE_SOURCE_DIR) / "bench" / "dcp_peer.py").string();
  std::string torch_version = run_capture("version", python + " " + peer + " version 2>/dev/null");
  while (!torch_version.empty() && std::isspace(static_cast<unsigned char>(torch_version.back())))
    torch_version.pop_back();
  const bool torch2 = !torch_version.empty() && torch_version[0] >= '2' && torch_version[0] <= '9';
  const double tw = bench::now_s();
  const std::string w =
      run_capture("write (2 ranks)", python + " " + peer + " write " + base.string() + " " + std::to_string(h) + " " +
                                         std::to_string(vocab) + " " + std::to_string(layers) + " 2>&1");
  if (w.rfind("FAILED", 0) == 0) {
    std::fprintf(stderr, "bench_dcp: writing the checkpoint with torch failed:\n%s\n", w.c_str());
    return 1;
  }
  u64 file_bytes = 0;
  for (const auto& e : fs::directory_iterator(ckpt)) {
    file_bytes += fs::file_size(e.path());
    std::ifstream f(e.path(), std::ios::binary);  // into the page cache
    std::vector<char> buf(1 << 20);
    while (f.read(buf.data(), buf.size()) || f.gcount() > 0) {
    }
  }
  u64 tensor_bytes = 0;
  std::size_t tensors = 0;
  {
    checkpoint_reader<file_directory> r{file_directory(ckpt)};
    for (const auto& [k, tm] : r.metadata().tensors) tensor_bytes += tm.numel() * item_size(tm.type);
    tensors = r.metadata().tensors.size();
  }
  std::printf(
      "# bench_dcp: torch %s DCP checkpoint of %zu F32 tensors, %.1f MiB of tensors in %.1f MiB of files, "
      "saved by 2 Gloo ranks in %.1f s (%s); %d round(s); loadavg %s\n",
      torch_version.c_str(), tensors, double(tensor_bytes) / bench::MiB, double(file_bytes) / bench::MiB,
      bench::now_s() - tw, torch2 ? "DTensors Shard(0), dcp.save" : "single_file_per_rank", reps,
      bench::loadavg().c_str());

  bench::samples torch_s, load_s, hf_s, tsave_s, ssave_s;
  result torch_r, load_r, hf_r, tsave_r, ssave_r;
  const fs::path saved = base / "saved";
  bool saved_exact = true;
  for (int i = 0; i < reps; ++i) {
    const std::string line = run_capture("load", python + " " + peer + " load " + ckpt.string() + " 2>&1");
    if (field(line, "seconds") < 0) {
      std::fprintf(stderr, "bench_dcp: torch's load failed:\n%s\n", line.c_str());
      return 1;
    }
    torch_s.add(field(line, "seconds"));
    torch_r = {field(line, "seconds"), field(line, "rss_before_mib"), field(line, "peak_rss_mib")};

    load_r = in_child("shardsafe's load", [&] { load_all(ckpt); });
    load_s.add(load_r.seconds);

    fs::remove_all(out);
    ::sync();
    hf_r = in_child("shardsafe's to-hf", [&] {
      hf_export_options opt;
      add_preset(opt.rename, "dcp-to-hf");
      export_to(file_directory(ckpt), file_directory(out), opt);
    });
    hf_s.add(hf_r.seconds);
    if (!torch2) continue;

    fs::remove_all(saved);
    ::sync();
    const std::string sline =
        run_capture("save", python + " " + peer + " save " + saved.string() + " " + std::to_string(h) + " " +
                                std::to_string(vocab) + " " + std::to_string(layers) + " 2>&1");
    if (field(sline, "seconds") < 0) {
      std::fprintf(stderr, "bench_dcp: torch's save failed:\n%s\n", sline.c_str());
      return 1;
    }
    tsave_s.add(field(sline, "seconds"));
    tsave_r = {field(sline, "seconds"), field(sline, "rss_before_mib"), field(sline, "peak_rss_mib")};
    fs::remove_all(saved);
    ::sync();
    // the state in memory first (as torch's is), then only the save timed
    std::vector<std::unique_ptr<std::byte[]>> mem;
    std::vector<flat_view> views;
    ssave_r = in_child(
        "shardsafe's DCP save", [&] { load_all(ckpt, mem, views); },
        [&] {
          single_process one;
          save_options so;
          so.format = save_format::dcp;
          save(file_directory(saved), std::span<const flat_view>(views), one, so);
        });
    ssave_s.add(ssave_r.seconds);
    // what shardsafe saved holds the checkpoint's tensors
    checkpoint_reader<file_directory> a{file_directory(ckpt)}, b{file_directory(saved)};
    for (const auto& [key, tm] : a.metadata().tensors) {
      std::vector<std::byte> x(tm.numel() * item_size(tm.type)), y(x.size());
      unshard_tensor(a, key, x);
      unshard_tensor(b, key, y);
      saved_exact = saved_exact && x == y;
    }
  }
  bench::table t({"case", "best s", "median s", "GB/s", "x torch", "RSS before MiB", "peak RSS MiB"});
  auto row = [&](const char* name, const bench::samples& s, const result& r) {
    t.add({name, bench::fmt("%.3f", s.best()), bench::fmt("%.3f", s.median()),
           bench::fmt("%.2f", double(tensor_bytes) / s.median() / 1e9),
           bench::fmt("%.2f", torch_s.median() / s.median()), bench::fmt("%.0f", r.rss_before),
           bench::fmt("%.0f", r.peak)});
  };
  row("torch: FileSystemReader + load_state_dict into full tensors", torch_s, torch_r);
  row("shardsafe: every tensor loaded whole into new memory", load_s, load_r);
  row("shardsafe: export_hf --preset dcp-to-hf, durable", hf_s, hf_r);
  t.print();
  if (torch2) {
    bench::table ts({"save (one process, the whole tensors)", "best s", "median s", "GB/s", "x torch", "RSS before MiB",
                     "peak RSS MiB"});
    auto srow = [&](const char* name, const bench::samples& s, const result& r) {
      ts.add({name, bench::fmt("%.3f", s.best()), bench::fmt("%.3f", s.median()),
              bench::fmt("%.2f", double(tensor_bytes) / s.median() / 1e9),
              bench::fmt("%.2f", tsave_s.median() / s.median()), bench::fmt("%.0f", r.rss_before),
              bench::fmt("%.0f", r.peak)});
    };
    std::printf("\n");
    srow("torch: dcp.save (FileSystemWriter, fsync)", tsave_s, tsave_r);
    srow("shardsafe: save_flat_views, format dcp (O_DIRECT, fsync)", ssave_s, ssave_r);
    ts.print();
    std::printf("shardsafe's DCP folder read back: %s\n", saved_exact ? "every tensor equal" : "WRONG");
  }

  // resharded: 3 ranks of rows (the checkpoint holds the rows in 2 halves)
  std::map<std::string, std::vector<std::byte>> whole;
  {
    checkpoint_reader<file_directory> r{file_directory(ckpt)};
    for (const auto& [key, tm] : r.metadata().tensors) {
      auto& m = whole[key];
      m.resize(tm.numel() * item_size(tm.type));
      unshard_tensor(r, key, m);
    }
  }
  u64 need = 0, planned = 0, syscalls = 0;
  bool exact = true;
  for (u64 rank = 0; rank < 3; ++rank) {
    const u64 before = rchar();
    checkpoint_reader<file_directory> r{file_directory(ckpt)};
    std::vector<std::vector<std::byte>> mem;
    std::vector<flat_view> views;
    std::vector<std::pair<u64, u64>> rows;  // [begin, end) rows of each view
    for (const auto& [key, tm] : r.metadata().tensors) {
      const u64 n = tm.shape[0], c = (n + 2) / 3, b = std::min(n, rank * c), e = std::min(n, b + c);
      shape_t local = tm.shape, off(tm.shape.size(), 0);
      local[0] = e - b;
      off[0] = b;
      mem.emplace_back(numel(local) * item_size(tm.type));
      views.push_back(
          flat_view{key, tm.type, tm.shape, shard_spec(block_spec(local, off)), mem.back().data(), mem.back().size()});
      rows.emplace_back(b, e);
    }
    const load_stats st = load(r, views);
    syscalls += rchar() - before;
    need += st.bytes_needed;
    planned += st.bytes_read;
    for (std::size_t i = 0; i < views.size(); ++i) {
      const auto& full = whole.at(views[i].key);
      const u64 row_bytes = full.size() / views[i].full_shape[0];
      exact = exact && std::memcmp(full.data() + rows[i].first * row_bytes, mem[i].data(), mem[i].size()) == 0;
    }
  }
  std::printf(
      "\nresharded into 3 ranks (rows; saved as 2): needed %.2f MiB, read by the plans %.2f MiB (%.4fx), "
      "read in all %.2f MiB (%.4fx: .metadata, zip headers, plans); bytes %s\n",
      double(need) / bench::MiB, double(planned) / bench::MiB, double(planned) / double(need),
      double(syscalls) / bench::MiB, double(syscalls) / double(need), exact ? "equal to the whole tensors" : "WRONG");
  std::printf("\ntargets:\n");
  bench::print_target(60, "bytes read / bytes needed, resharded into 3 ranks (<= 1.02)",
                      double(syscalls) / double(need), "x", double(syscalls) / double(need) <= 1.02);
  fs::remove_all(base);
  return exact && saved_exact ? 0 : 1;
}
