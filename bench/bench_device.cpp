// bench/bench_device.cpp - a checkpoint loaded into CUDA tensors through the staging ring
// (torch/device_copy.hpp) and saved from them, against the limits measured in the same run:
// pinned host-to-device and device-to-host copy rates, the file read rate (threads reading the
// files into pinned buffers, no device), and the rate of a durable write. The loads:
//   - the checkpoint as it is, from the page cache, at a few read-thread counts (--sweep; the
//     best is the headline, and its count is what the later loads use);
//   - resharded: the same model saved from its CPU copy by --ranks thread ranks holding it as
//     FSDP2 does (dim-0 row blocks), loaded into whole tensors and into a 2-way TP split;
//   - cold: both checkpoints with every file evicted from the page cache first (posix_fadvise;
//     the residency left, by mincore, is printed), against the cold read limit: the best of
//     plain buffered and O_DIRECT reads of the same files, cold.
// Every load is checked byte for byte against a CPU load. The Python peers (safetensors'
// load_file(device="cuda"), torch.load(map_location="cuda")) run from scripts/device-check.sh
// beside it, on the same files. Without a CUDA device it says so and measures nothing (CI builds
// it; the GPU machine runs it); with --cpu-rehearsal it runs what needs no device, into CPU
// tensors (plain loads, no ring): the resharded save, the loads of both checkpoints and their
// checks, the eviction and the cold limit (on a small model: `python3 bench/device_peers.py write
// DIR 0.2 0`, then --dir DIR/st).
//
//   bench_device --dir DIR [--out DIR] [--reps N] [--slots N] [--slot-mib N] [--threads N]
//                [--sweep N,N] [--ranks N] [--cold-reps N] [--cpu-rehearsal]
//
// DIR holds the checkpoint (a model.safetensors or any folder shardsafe reads); --out, on disk,
// is where the saves and the resharded checkpoint go (default DIR/../bench_device_out).
#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/async_checkpointer.hpp"
#include "shardsafe/torch/state_dict.hpp"

using namespace shardsafe;
using bench::GiB;
using bench::MiB;
using bench::read_config;
namespace fs = std::filesystem;

namespace {

void device_sync(c10::Device d) { c10::impl::VirtualGuardImpl(d.type()).getStream(d).synchronize(); }

/// Copy rate between pinned host memory and the device, moving `total` bytes in 256 MiB copies.
double copy_rate(c10::Device dev, std::uint64_t total, bool to_device) {
  const std::int64_t n = 256 * MiB;
  auto host = pinned_host_bytes(n);
  at::Tensor h = at::from_blob(host.get(), {n}, at::TensorOptions().dtype(at::kByte));
  at::Tensor d = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(dev));
  const int reps = static_cast<int>(std::max<std::uint64_t>(8, total / n));
  (to_device ? d.copy_(h, true) : h.copy_(d, true));
  device_sync(dev);
  const double t0 = bench::now_s();
  for (int i = 0; i < reps; ++i) (to_device ? d.copy_(h, true) : h.copy_(d, true));
  device_sync(dev);
  return double(reps) * double(n) / (bench::now_s() - t0);
}

/// Rate of a write of `total` bytes into `path` by `threads` threads in 16 MiB blocks. Durable:
/// aligned blocks through O_DIRECT (buffered where refused), then fdatasync - what a save to
/// this disk can reach. Else buffered, no fdatasync: into the page cache (on tmpfs, all a write is).
double write_rate(const std::filesystem::path& path, std::uint64_t total, unsigned threads, bool durable) {
  std::filesystem::create_directories(path.parent_path());
  int fd = durable ? ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644) : -1;
  if (fd < 0) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return 0;
  const std::uint64_t block = 16 * MiB;
  total = total / block * block;
  void* buf = nullptr;
  if (::posix_memalign(&buf, 4096, block) != 0) return 0;
  std::memset(buf, 1, block);
  std::atomic<std::uint64_t> next{0};
  const double t0 = bench::now_s();
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([&] {
      for (std::uint64_t o; (o = next.fetch_add(block)) < total;)
        if (::pwrite(fd, buf, block, off_t(o)) < 0) break;
    });
  for (auto& t : ts) t.join();
  if (durable) ::fdatasync(fd);
  const double dt = bench::now_s() - t0;
  ::close(fd);
  ::unlink(path.c_str());
  std::free(buf);
  return double(total) / dt;
}

/// Rate of device-to-host copies into pageable memory (what a save's writer blocks are): `threads`
/// threads each copying 16 MiB pieces of a device tensor into a malloc'd buffer of its own with
/// copy_from_device, `total` bytes in all.
double pageable_d2h_rate(c10::Device dev, std::uint64_t total, unsigned threads) {
  const std::int64_t n = 256 * MiB, piece = 16 * MiB;
  at::Tensor d = at::zeros({n}, at::TensorOptions().dtype(at::kByte).device(dev));
  device_sync(dev);
  std::atomic<std::uint64_t> next{0};
  const double t0 = bench::now_s();
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([&] {
      std::vector<std::byte> buf(static_cast<std::size_t>(piece));
      for (std::uint64_t o; (o = next.fetch_add(std::uint64_t(piece))) < total;)
        copy_from_device(d, o % std::uint64_t(n), buf);
    });
  for (auto& t : ts) t.join();
  return double(total) / (bench::now_s() - t0);
}

std::string gbs(double bytes_per_s) { return bench::fmt("%.2f", bytes_per_s / 1e9) + " GB/s"; }

/// The files of a checkpoint folder: every one (what eviction drops), or its .safetensors (what
/// the read limits read).
std::vector<fs::path> files_of(const fs::path& dir, bool safetensors_only) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && (!safetensors_only || e.path().extension() == ".safetensors")) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

/// Plain reads of files (bench::read_rate) into pinned buffers where `pinned` (what the ring's
/// reads do, without the device).
double file_read_rate(const std::vector<fs::path>& files, const read_config& c, bool pinned) {
  if (!pinned) return bench::read_rate(files, c);
  return bench::read_rate(files, c, [](std::uint64_t n) { return pinned_host_bytes(n); });
}

/// Empty whole tensors on dev, one for each tensor of the checkpoint.
state_dict whole_tensors(const checkpoint_metadata& md, c10::Device dev) {
  state_dict sd;
  for (const auto& [k, tm] : md.tensors)
    sd.add(k, at::empty(to_sizes(tm.shape), at::TensorOptions().dtype(require_scalar_type(tm.type, k)).device(dev)));
  return sd;
}

/// TP rank r of `ways` (Megatron's split, torch.chunk's blocks), empty on dev: matrices cut on
/// dim 0 (column-parallel), the output projections (o_proj, down_proj) on dim 1 (row-parallel);
/// 1-D tensors whole on every rank.
state_dict tp_rank(const checkpoint_metadata& md, std::uint64_t r, std::uint64_t ways, c10::Device dev) {
  state_dict sd;
  for (const auto& [k, tm] : md.tensors) {
    const auto o = at::TensorOptions().dtype(require_scalar_type(tm.type, k)).device(dev);
    if (tm.shape.size() < 2) {
      sd.add(k, at::empty(to_sizes(tm.shape), o));
      continue;
    }
    const std::size_t d = k.find("o_proj") != k.npos || k.find("down_proj") != k.npos ? 1 : 0;
    const std::uint64_t n = tm.shape[d], c = (n + ways - 1) / ways, b = std::min(n, c * r), e = std::min(n, c * r + c);
    if (b == e) continue;
    shape_t local = tm.shape, off(tm.shape.size(), 0);
    local[d] = e - b;
    off[d] = b;
    sd.add(k, at::empty(to_sizes(local), o), block_spec(local, off), tm.shape);
  }
  return sd;
}

std::uint64_t bytes_of(const state_dict& sd) {
  std::uint64_t n = 0;
  for (const auto& [k, t] : sd) n += std::uint64_t(t.local.numel()) * std::uint64_t(t.local.element_size());
  return n;
}

using model_copy = std::map<std::string, at::Tensor, std::less<>>;

/// Tensors of sd whose bytes differ from the same elements of `model` (whole CPU tensors of
/// the same names; a block spec's block of one), compared on sd's device.
std::size_t differing(const state_dict& sd, const model_copy& model) {
  auto raw = [](const at::Tensor& t) { return t.contiguous().reshape({-1}).view(at::kByte); };
  std::size_t bad = 0;
  for (const auto& [k, t] : sd) {
    at::Tensor want = model.at(k);
    if (t.spec && t.spec->is_block())
      for (std::size_t d = 0; d < t.spec->block().global_offset().size(); ++d)
        want = want.narrow(std::int64_t(d), std::int64_t(t.spec->block().global_offset()[d]),
                           std::int64_t(t.spec->block().local_shape()[d]));
    if (!at::equal(raw(t.local), raw(want).to(t.local.device()))) ++bad;
  }
  return bad;
}

/// Saves the model (whole CPU tensors) into dir as `ranks` thread ranks holding it as FSDP2 does:
/// each tensor cut on dim 0 into torch.chunk's row blocks (ceil(rows / ranks) a rank; a 0-d one
/// whole on rank 0), each rank saving its blocks (views of the model's memory, no copy) in one
/// collective save over a world of threads (dist/threads.hpp). Durable, as every save.
void save_row_blocks(const fs::path& dir, const model_copy& model, int ranks) {
  const auto thrown = run_ranks(
      ranks,
      [&](thread_comm& comm) {
        const std::int64_t r = comm.rank();
        state_dict part;
        for (const auto& [k, t] : model) {
          if (t.dim() == 0) {
            if (r == 0) part.add(k, t);
            continue;
          }
          const std::int64_t rows = t.size(0), c = (rows + ranks - 1) / ranks;
          const std::int64_t b = std::min(rows, c * r), e = std::min(rows, c * r + c);
          if (b == e) continue;
          const at::Tensor block = t.narrow(0, b, e - b);
          shape_t off(static_cast<std::size_t>(t.dim()), 0);
          off[0] = std::uint64_t(b);
          part.add(k, block, block_spec(shape_of(block), off), shape_of(t));
        }
        save_options so;
        so.overwrite = true;
        so.threads = 2;  // writer threads per rank
        save_state_dict(file_directory(dir), part, comm, so);
      },
      std::chrono::minutes(10));
  for (const auto& e : thrown)
    if (e) std::rethrow_exception(e);
}

/// Timed loads of the checkpoint in dir into each state dict in turn, each load by a fresh
/// reader (its metadata and headers read inside the time); with `cold`, those files evicted
/// from the page cache before each run.
struct timed {
  bench::samples s;
  double host_peak = 0;  ///< MiB: VmHWM during a run over VmRSS before it, the most of any run
  double resident = 0;   ///< the largest fraction of a file still cached when a cold run began
};
timed time_loads(const fs::path& dir, std::initializer_list<state_dict*> sds, const device_load_options& opt, int reps,
                 const std::vector<fs::path>* cold = nullptr) {
  timed out;
  for (int r = 0; r < reps; ++r) {
    for (state_dict* sd : sds)  // zeroed, untimed: the check after the last run sees its bytes only
      for (auto& [k, t] : *sd) {
        t.local.zero_();
        if (t.local.is_cuda()) device_sync(t.local.device());
      }
    if (cold) out.resident = std::max(out.resident, bench::evict_all(*cold));
    bench::reset_peak_rss();
    const double rss0 = bench::rss_mib(), t0 = bench::now_s();
    for (state_dict* sd : sds) load_state_dict(file_directory(dir), *sd, opt);
    out.s.add(bench::now_s() - t0);
    out.host_peak = std::max(out.host_peak, bench::hwm_mib() - rss0);
  }
  return out;
}

/// Prints a load's row (best and median rate of `bytes`, the median's ratio to `limit`, the
/// host peak) and returns that ratio.
double print_load(const std::string& what, const timed& t, std::uint64_t bytes, double limit) {
  const double best = double(bytes) / t.s.best(), median = double(bytes) / t.s.median();
  std::printf("%s: best %s, median %s (%zu runs); %.2fx the lesser limit; host peak +%.0f MiB\n", what.c_str(),
              gbs(best).c_str(), gbs(median).c_str(), t.s.s.size(), median / limit, t.host_peak);
  return median / limit;
}

/// The cold read limit of a checkpoint's files: the best of plain reads as `configs` say, each
/// run after every file of the checkpoint (`all`) is evicted. Prints each; returns the best and
/// puts its config in *best.
double cold_limit(const std::string& what, const std::vector<fs::path>& files, const std::vector<fs::path>& all,
                  const std::vector<read_config>& configs, bool pinned, read_config* best) {
  double top = 0, resident = 0;
  std::string line;
  for (const read_config& c : configs) {
    resident = std::max(resident, bench::evict_all(all));
    const double r = file_read_rate(files, c, pinned);
    line += (line.empty() ? "" : ", ") + c.name() + " " + (r > 0 ? gbs(r) : std::string("refused"));
    if (r > top) top = r, *best = c;
  }
  std::printf(
      "limit: cold read of the %s checkpoint (plain reads after eviction; at most %.1f%% of a file resident "
      "at a start): %s; best %s\n",
      what.c_str(), resident * 100, line.c_str(), gbs(top).c_str());
  return top;
}

/// The saves from sd's CUDA tensors, against the limits: durable as every save is (O_DIRECT
/// blocks, then fdatasync) into out; into the page cache (tmpfs: a folder of its own in
/// shm_root); async (the training stall).
void saves(const state_dict& sd, c10::Device dev, const fs::path& out, const fs::path& shm_root,
           std::uint64_t model_bytes, unsigned threads, double d2h) {
  const double wr = write_rate(out / "limit.bin", model_bytes, threads, true);
  std::printf("limit: durable write (O_DIRECT 16 MiB blocks + fdatasync, %u threads) %s\n", threads, gbs(wr).c_str());
  single_process comm;
  save_options so;
  so.overwrite = true;
  {
    bench::reset_peak_rss();
    const double rss0 = bench::rss_mib(), t0 = bench::now_s();
    save_state_dict(file_directory(out / "sync"), sd, comm, so);
    const double dt = bench::now_s() - t0;
    std::printf(
        "shardsafe save from cuda (durable): %s, %.2fx the lesser of the device->host and durable write "
        "limits; host peak +%.0f MiB\n",
        gbs(double(model_bytes) / dt).c_str(), double(model_bytes) / dt / std::min(d2h, wr), bench::hwm_mib() - rss0);
    std::filesystem::remove_all(out / "sync");
  }
  // --- the same save into the page cache: to tmpfs (--shm; its files are page-cache pages and
  // fdatasync returns at once), buffered writes
  // a folder of its own inside --shm, the only thing it removes there
  const std::filesystem::path shm = shm_root / ("shardsafe_bench_device." + std::to_string(::getpid()));
  std::filesystem::create_directories(shm);
  if (const auto space = std::filesystem::space(shm); space.available < model_bytes + GiB) {
    std::printf("save to the page cache: skipped, %s has %.1f GiB free (needs %.1f)\n", shm.c_str(),
                double(space.available) / double(GiB), double(model_bytes + GiB) / double(GiB));
  } else {
    const double pc = write_rate(shm / "limit.bin", model_bytes, threads, false);
    const double pd2h = pageable_d2h_rate(dev, model_bytes, threads);
    std::printf(
        "limit: page-cache write (tmpfs, 16 MiB blocks, %u threads) %s; device->host into pageable memory "
        "(%u threads) %s\n",
        threads, gbs(pc).c_str(), threads, gbs(pd2h).c_str());
    save_options po = so;
    po.direct_io = false;
    double best = 0, host = 0;
    for (int r = 0; r < 2; ++r) {
      bench::reset_peak_rss();
      const double rss0 = bench::rss_mib(), t0 = bench::now_s();
      save_state_dict(file_directory(shm / "sync"), sd, comm, po);
      best = std::max(best, double(model_bytes) / (bench::now_s() - t0));
      host = std::max(host, bench::hwm_mib() - rss0);
      std::filesystem::remove_all(shm / "sync");
    }
    const double lesser = std::min(d2h, pc);
    std::printf(
        "shardsafe save from cuda to the page cache: %s (best of 2), %.2fx the pinned device->host limit, %.2fx "
        "the lesser of it and the page-cache write limit; host peak +%.0f MiB\n",
        gbs(best).c_str(), best / d2h, best / lesser, host);
    bench::print_target(0, "  target >= 0.8x the lesser of the device->host and page-cache write limits", best / lesser,
                        "x", best / lesser >= 0.8);
  }
  std::filesystem::remove_all(shm);
  {
    async_checkpointer<single_process> ckpt(single_process{});
    ckpt.save_state_dict(file_directory(out / "async0"), sd, so).wait();  // staging allocated and pinned once
    std::filesystem::remove_all(out / "async0");
    const double t0 = bench::now_s();
    async_save_handle h = ckpt.save_state_dict(file_directory(out / "async1"), sd, so);
    const double stall = bench::now_s() - t0;
    const async_save_stats& r = h.wait();
    const double all = bench::now_s() - t0;
    std::printf(
        "async save from cuda: training stall %.3f s (snapshot %.3f s = %s, %.2fx the device->host limit); "
        "whole save %.2f s\n",
        stall, r.snapshot_seconds, gbs(double(model_bytes) / r.snapshot_seconds).c_str(),
        double(model_bytes) / r.snapshot_seconds / d2h, all);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out as it is printed
  const double start = bench::now_s();
  bench::args a(argc, argv);
  bench::accept_only(
      a, "A checkpoint loaded into CUDA tensors and saved from them, against measured limits.",
      {{"--dir", "DIR", "the checkpoint to load (e.g. a folder with model.safetensors)"},
       {"--out", "DIR", "where the saves and the resharded checkpoint go (default: DIR/../bench_device_out)"},
       {"--reps", "N", "loads timed (default 3)"},
       {"--slots", "N", "staging slots (default 4)"},
       {"--slot-mib", "N", "staging slot size in MiB (default 64)"},
       {"--threads", "N", "read threads T (default: the loader's)"},
       {"--sweep", "LIST", "read threads tried for the warm load, N,N,... (default: T and 2T; the best is used after)"},
       {"--ranks", "N", "thread ranks that save the resharded checkpoint (default 8)"},
       {"--cold-reps", "N", "cold loads timed per checkpoint (default 2, 1 for a slow disk; 0: no cold rows)"},
       {"--shm", "DIR", "a tmpfs folder for the save into the page cache (default /dev/shm)"},
       {"--peers", "LIST", "peers' load rates measured beside it, NAME=GB/s,... (printed as ratios)"},
       {"--cpu-rehearsal", nullptr, "without CUDA: what needs no device, into CPU tensors (plain loads)"},
       {"--quick", nullptr, "what CI runs: says whether a device is there, measures nothing without one"}});
  const bool cuda = at::hasCUDA();
  if (!cuda && !a.has("--cpu-rehearsal")) {
    std::printf(
        "bench_device: no CUDA device here; nothing measured (scripts/device-check.sh runs it on a GPU machine)\n");
    return 0;
  }
  if (a.get("--dir", "").empty()) {
    std::printf("bench_device: --dir DIR is needed\n");
    return 2;
  }
  const fs::path dir = a.get("--dir", "");
  const fs::path out = a.get("--out", (dir.parent_path() / "bench_device_out").string());
  const int reps = static_cast<int>(a.get_int("--reps", 3));
  device_load_options opt;
  opt.staging.slots = static_cast<std::size_t>(a.get_int("--slots", 4));
  opt.staging.slot_bytes = std::uint64_t(a.get_int("--slot-mib", 64)) * MiB;
  opt.threads = static_cast<unsigned>(a.get_int("--threads", 0));
  const unsigned threads =
      opt.threads ? opt.threads : shardsafe::staged_default_threads();  // a load into CUDA tensors is staged
  // a rehearsal: the same loads into CPU tensors, which are plain loads (no ring, no device)
  const c10::Device dev = cuda ? c10::Device(at::kCUDA, 0) : c10::Device(at::kCPU);
  const std::string to = cuda ? "cuda" : "cpu (rehearsal: a plain load)";

  checkpoint_reader<file_directory> reader{file_directory(dir)};
  const checkpoint_metadata& md = reader.metadata();
  std::uint64_t model_bytes = 0;
  for (const auto& [k, tm] : md.tensors) model_bytes += tm.numel() * item_size(tm.type);
  const std::vector<fs::path> files = files_of(dir, true);

  std::printf("model: %zu tensors, %.2f GiB; staging ring %zu x %llu MiB; %u read threads%s\n", md.tensors.size(),
              double(model_bytes) / double(GiB), opt.staging.slots,
              static_cast<unsigned long long>(opt.staging.slot_bytes / MiB), threads,
              cuda ? "" : "; CPU REHEARSAL: no device, loads into CPU tensors, the ratios are not a GPU's");

  // --- the limits, measured now
  const double h2d = cuda ? copy_rate(dev, model_bytes, true) : 0, d2h = cuda ? copy_rate(dev, model_bytes, false) : 0;
  auto lesser = [&](double read) { return cuda ? std::min(h2d, read) : read; };
  // the file read rate at the loader's threads and at twice as many: the higher is the limit
  auto warm_read = [&](const std::vector<fs::path>& fs) {
    return std::max(file_read_rate(fs, {threads, 64 * MiB, false}, cuda),
                    file_read_rate(fs, {2 * threads, 64 * MiB, false}, cuda));
  };
  const double rd = warm_read(files), limit = lesser(rd);
  std::printf("limit: pinned host->device %s, device->host %s, file read (page cache, %u or %u threads) %s\n",
              cuda ? gbs(h2d).c_str() : "-", cuda ? gbs(d2h).c_str() : "-", threads, 2 * threads, gbs(rd).c_str());

  // --- load into CUDA tensors, at each read-thread count of the sweep; the best median decides
  std::vector<unsigned> sweep;
  for (const std::string& w : bench::split_list(a.get("--sweep", "")))
    if (const long n = std::atol(w.c_str()); n > 0) sweep.push_back(unsigned(n));
  if (sweep.empty()) sweep = {threads, 2 * threads};
  state_dict sd = whole_tensors(md, dev);
  timed best;
  unsigned best_threads = threads;
  for (const unsigned th : sweep) {
    opt.threads = th;
    const timed t = time_loads(dir, {&sd}, opt, reps);
    print_load("  shardsafe load -> " + to + ", " + std::to_string(th) + " read threads", t, model_bytes, limit);
    if (best.s.empty() || t.s.median() < best.s.median()) best = t, best_threads = th;
  }
  opt.threads = best_threads;  // every load below
  const double x =
      print_load("shardsafe load -> " + to + " (" + std::to_string(best_threads) + " read threads: the sweep's best)",
                 best, model_bytes, limit);
  bench::print_target(0, "  target >= 0.9x the lesser limit", x, "x", x >= 0.9);
  for (const std::string& item : bench::split_list(a.get("--peers", "")))  // the peers scripts/device-check.sh ran
    if (const std::size_t eq = item.find('='); eq != std::string::npos) {
      const double rate = std::atof(item.c_str() + eq + 1) * 1e9, median = double(model_bytes) / best.s.median();
      std::printf("  vs %s (%s): %.2fx\n", item.substr(0, eq).c_str(), gbs(rate).c_str(), median / rate);
    }
  if (cuda)
    bench::print_target(0, "  target host peak <= ring + 64 MiB", best.host_peak, "MiB",
                        best.host_peak <= double(opt.staging.slots * opt.staging.slot_bytes / MiB + 64));

  // every tensor checked against a CPU load of the same checkpoint (bytes compared on the device);
  // that CPU copy of the model is also what the resharded checkpoint is saved from
  model_copy model;
  {
    load_options lo;
    lo.threads = best_threads;
    for (auto& [k, t] : unshard_state(reader, lo)) model.emplace(k, std::move(t));
  }
  std::size_t bad = differing(sd, model);
  std::printf("checked: %zu of %zu tensors differ from a CPU load\n", bad, sd.size());

  // --- converted: BF16/F16 stored, F32 on the device; on the GPU (default) and on the host
  for (const bool on_device : {true, false}) {
    if (!cuda) break;
    state_dict f32;
    std::uint64_t f32_bytes = 0;
    for (const auto& [k, tm] : md.tensors)
      if (tm.type == dtype::BF16 || tm.type == dtype::F16) {
        f32.add(k, at::empty(to_sizes(tm.shape), at::TensorOptions().dtype(at::kFloat).device(dev)));
        f32_bytes += tm.numel() * item_size(tm.type);
      }
    if (!f32_bytes) break;
    sd = state_dict();  // room on the device
    device_load_options co = opt;
    co.convert_dtypes = true;
    co.convert_on_device = on_device;
    co.strict = false;
    const double t0 = bench::now_s();
    load_state_dict(reader, f32, co);
    device_sync(dev);
    const double dt = bench::now_s() - t0;
    std::printf(
        "shardsafe load -> cuda, BF16 stored -> F32 converted on the %s: %s of stored bytes "
        "(%.2fx the lesser limit)\n",
        on_device ? "GPU" : "host", gbs(double(f32_bytes) / dt).c_str(), double(f32_bytes) / dt / limit);
  }
  if (sd.empty()) {
    sd = whole_tensors(md, dev);
    load_state_dict(reader, sd, opt);
  }

  // --- resharded: the model saved by `ranks` thread ranks as dim-0 row blocks (FSDP2's
  // sharding), from its CPU copy; loaded by this process into whole tensors and into a 2-way
  // tensor-parallel split (both TP ranks' loads in turn, timed together)
  const int ranks = static_cast<int>(a.get_int("--ranks", 8));
  const fs::path rdir = out / "resharded";
  double t0 = bench::now_s();
  save_row_blocks(rdir, model, ranks);
  const std::vector<fs::path> rfiles = files_of(rdir, true), rall = files_of(rdir, false);
  std::printf("resharded: saved by %d thread ranks as dim-0 row blocks in %.1f s (durable), %zu rank files\n", ranks,
              bench::now_s() - t0, rfiles.size());
  {
    double resident = 0;
    for (const auto& f : rfiles) resident = std::max(resident, bench::page_cache_resident(f.string()));
    load_options lo;
    lo.threads = best_threads;
    t0 = bench::now_s();
    state_dict cpu;
    for (auto& [k, t] : unshard_state(file_directory(rdir), lo)) cpu.add(k, std::move(t));
    const double dt = bench::now_s() - t0;
    const std::size_t n = differing(cpu, model);
    bad += n;
    std::printf(
        "checked: a plain load of it into CPU tensors (%s, at most %.0f%% of a file cached before) has %zu of %zu "
        "tensors differ from the model\n",
        gbs(double(model_bytes) / dt).c_str(), resident * 100, n, cpu.size());
  }
  const double rlimit = lesser(warm_read(rfiles));  // (also brings its files into the page cache)
  state_dict whole = whole_tensors(md, dev);
  const timed rt = time_loads(rdir, {&whole}, opt, reps);
  const double rx =
      print_load("resharded (" + std::to_string(ranks) + " ranks' row blocks) -> " + to + ", whole tensors", rt,
                 model_bytes, rlimit);
  bench::print_target(0, "  target >= 0.9x the lesser limit", rx, "x", rx >= 0.9);
  state_dict tp0 = tp_rank(md, 0, 2, dev), tp1 = tp_rank(md, 1, 2, dev);
  const timed tt = time_loads(rdir, {&tp0, &tp1}, opt, reps);
  print_load("resharded -> " + to + ", 2-way TP blocks (both ranks' loads in turn)", tt, bytes_of(tp0) + bytes_of(tp1),
             rlimit);
  const std::size_t rbad = differing(whole, model), tbad = differing(tp0, model) + differing(tp1, model);
  bad += rbad + tbad;
  std::printf("checked: %zu of %zu whole tensors and %zu of %zu TP blocks differ from a CPU load\n", rbad, whole.size(),
              tbad, tp0.size() + tp1.size());
  tp0 = state_dict();
  tp1 = state_dict();

  // --- cold: every file of the checkpoint evicted from the page cache before each run
  int cold_reps = static_cast<int>(a.get_int("--cold-reps", 2));
  std::vector<read_config> configs = {{threads, 16 * MiB, false},
                                      {2 * threads, 16 * MiB, false},
                                      {threads, 16 * MiB, true},
                                      {2 * threads, 16 * MiB, true}};
  for (int c = 0; cold_reps > 0 && c < 2; ++c) {
    const bool re = c == 1;
    const std::vector<fs::path> all = re ? rall : files_of(dir, false);
    read_config top{};
    const double cl = cold_limit(re ? "resharded" : "unsharded", re ? rfiles : files, all, configs, cuda, &top);
    if (cl <= 0) {
      std::printf("  no plain read of its files went through: no cold rows\n");
      continue;
    }
    if (!re) {  // the resharded files: the best read and the other kind's at T threads only
      if (double(model_bytes) / cl > 8 && !a.has("--cold-reps")) cold_reps = 1;  // a slow disk: one run each
      read_config bp = configs[0], bd = configs[2];
      for (const read_config& k : configs)
        if (k.name() == top.name()) (k.direct ? bd : bp) = k;
      configs = {bp, bd};
    }
    state_dict& target = re ? whole : sd;
    const timed ct = time_loads(re ? rdir : dir, {&target}, opt, cold_reps, &all);
    const double cx =
        print_load(std::string("cold: ") + (re ? "resharded" : "unsharded") + " -> " + to + ", whole tensors", ct,
                   model_bytes, lesser(cl));
    const std::size_t cb = differing(target, model);
    bad += cb;
    std::printf(
        "  at most %.1f%% of a file resident when a run began (mincore); %zu of %zu tensors differ from a CPU load\n",
        ct.resident * 100, cb, target.size());
    if (ct.resident > 0.01)
      std::printf("  not judged: the eviction did not take (posix_fadvise DONTNEED kept the pages)\n");
    else
      bench::print_target(0, "  target >= 0.9x the lesser of the cold read and host->device limits", cx, "x",
                          cx >= 0.9);
  }
  whole = state_dict();
  model.clear();
  fs::remove_all(rdir);

  if (cuda) saves(sd, dev, out, a.get("--shm", "/dev/shm"), model_bytes, threads, d2h);
  fs::remove_all(out);
  std::printf("bench_device: %.0f s in all; %s\n", bench::now_s() - start,
              bad == 0 ? "every load as the CPU load" : "SOME LOADS DIFFER from the CPU load");
  return bad == 0 ? 0 : 1;
}
