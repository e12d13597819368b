// bench/bench_device.cpp - a checkpoint loaded into CUDA tensors through the staging ring
// (torch/device_copy.hpp) and saved from them, against the limits measured in the same run:
// pinned host-to-device and device-to-host copy rates, the file read rate (threads reading the
// files into pinned buffers, no device), and the rate of a durable write. The Python peers
// (safetensors.torch.load_file(device="cuda"), torch.load(map_location="cuda")) run from
// scripts/device-check.sh beside it, on the same files. Without a CUDA device it says so and
// measures nothing (CI builds it; the GPU machine runs it).
//
//   bench_device --dir DIR [--out DIR] [--reps N] [--slots N] [--slot-mib N] [--threads N]
//
// DIR holds the checkpoint (a model.safetensors or any folder shardsafe reads); --out is where
// the saves go (default DIR/../bench_device_out).
#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/async_checkpointer.hpp"
#include "shardsafe/torch/state_dict.hpp"

using namespace shardsafe;
using bench::GiB;
using bench::MiB;

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

/// Read rate of the files, `threads` threads each reading 64 MiB pieces into a pinned buffer of
/// its own (what the ring's reads do, without the device).
double read_rate(const std::vector<std::filesystem::path>& files, unsigned threads, std::uint64_t& total) {
  struct piece {
    int fd;
    std::uint64_t off, len;
  };
  std::vector<piece> pieces;
  std::vector<int> fds;
  total = 0;
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    fds.push_back(fd);
    const std::uint64_t size = std::filesystem::file_size(f);
    for (std::uint64_t o = 0; o < size; o += 64 * MiB)
      pieces.push_back({fd, o, std::min<std::uint64_t>(64 * MiB, size - o)});
    total += size;
  }
  std::atomic<std::size_t> next{0};
  const double t0 = bench::now_s();
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([&] {
      auto buf = pinned_host_bytes(64 * MiB);
      for (std::size_t i; (i = next.fetch_add(1)) < pieces.size();) {
        std::uint64_t done = 0;
        while (done < pieces[i].len) {
          const ssize_t r = ::pread(pieces[i].fd, buf.get() + done, pieces[i].len - done, off_t(pieces[i].off + done));
          if (r <= 0) break;
          done += std::uint64_t(r);
        }
      }
    });
  for (auto& t : ts) t.join();
  const double dt = bench::now_s() - t0;
  for (int fd : fds) ::close(fd);
  return double(total) / dt;
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

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out as it is printed
  bench::args a(argc, argv);
  bench::accept_only(
      a, "A checkpoint loaded into CUDA tensors and saved from them, against measured limits.",
      {{"--dir", "DIR", "the checkpoint to load (e.g. a folder with model.safetensors)"},
       {"--out", "DIR", "where the saves go (default: DIR/../bench_device_out)"},
       {"--reps", "N", "loads timed (default 3)"},
       {"--slots", "N", "staging slots (default 4)"},
       {"--slot-mib", "N", "staging slot size in MiB (default 64)"},
       {"--threads", "N", "read threads (default: the loader's)"},
       {"--shm", "DIR", "a tmpfs folder for the save into the page cache (default /dev/shm)"},
       {"--peers", "LIST", "peers' load rates measured beside it, NAME=GB/s,... (printed as ratios)"},
       {"--quick", nullptr, "what CI runs: says whether a device is there, measures nothing without one"}});
  if (!at::hasCUDA()) {
    std::printf(
        "bench_device: no CUDA device here; nothing measured (scripts/device-check.sh runs it on a GPU machine)\n");
    return 0;
  }
  if (a.get("--dir", "").empty()) {
    std::printf("bench_device: --dir DIR is needed\n");
    return 2;
  }
  const std::filesystem::path dir = a.get("--dir", "");
  const std::filesystem::path out = a.get("--out", (dir.parent_path() / "bench_device_out").string());
  const int reps = static_cast<int>(a.get_int("--reps", 3));
  device_load_options opt;
  opt.staging.slots = static_cast<std::size_t>(a.get_int("--slots", 4));
  opt.staging.slot_bytes = std::uint64_t(a.get_int("--slot-mib", 64)) * MiB;
  opt.threads = static_cast<unsigned>(a.get_int("--threads", 0));
  const unsigned threads =
      opt.threads ? opt.threads : shardsafe::staged_default_threads();  // a load into CUDA tensors is staged
  const c10::Device dev(at::kCUDA, 0);

  checkpoint_reader<file_directory> reader{file_directory(dir)};
  std::uint64_t model_bytes = 0;
  for (const auto& [k, tm] : reader.metadata().tensors) model_bytes += tm.numel() * item_size(tm.type);
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") files.push_back(e.path());

  std::printf("model: %zu tensors, %.2f GiB; staging ring %zu x %llu MiB; %u read threads\n",
              reader.metadata().tensors.size(), double(model_bytes) / double(GiB), opt.staging.slots,
              static_cast<unsigned long long>(opt.staging.slot_bytes / MiB), threads);

  // --- the limits, measured now
  const double h2d = copy_rate(dev, model_bytes, true), d2h = copy_rate(dev, model_bytes, false);
  std::uint64_t file_bytes = 0;
  // the file read rate at the loader's threads and at twice as many: the higher is the limit
  const double rd = std::max(read_rate(files, threads, file_bytes), read_rate(files, 2 * threads, file_bytes));
  const double limit = std::min(h2d, rd);
  std::printf("limit: pinned host->device %s, device->host %s, file read (page cache, %u or %u threads) %s\n",
              gbs(h2d).c_str(), gbs(d2h).c_str(), threads, 2 * threads, gbs(rd).c_str());

  // --- load into CUDA tensors
  state_dict sd;
  for (const auto& [k, tm] : reader.metadata().tensors)
    sd.add(k, at::empty(to_sizes(tm.shape), at::TensorOptions().dtype(require_scalar_type(tm.type, k)).device(dev)));
  std::vector<double> secs;
  double host_peak = 0;
  for (int r = 0; r < reps; ++r) {
    bench::reset_peak_rss();
    const double rss0 = bench::rss_mib(), t0 = bench::now_s();
    load_state_dict(reader, sd, opt);
    secs.push_back(bench::now_s() - t0);
    host_peak = std::max(host_peak, bench::hwm_mib() - rss0);
  }
  std::sort(secs.begin(), secs.end());
  const double best = double(model_bytes) / secs.front(), median = double(model_bytes) / secs[secs.size() / 2];
  std::printf(
      "shardsafe load -> cuda: best %s, median %s (%d runs); %.2fx the lesser limit; host peak +%.0f MiB "
      "(ring %llu MiB)\n",
      gbs(best).c_str(), gbs(median).c_str(), reps, median / limit, host_peak,
      static_cast<unsigned long long>(opt.staging.slots * opt.staging.slot_bytes / MiB));
  bench::print_target(0, "  target >= 0.8x the lesser limit", median / limit, "x", median / limit >= 0.8);
  {  // the peers scripts/device-check.sh ran on the same files: "name=GB/s,..."
    const std::string peers = a.get("--peers", "");
    for (std::size_t p = 0; p < peers.size();) {
      std::size_t e = peers.find(',', p);
      if (e == std::string::npos) e = peers.size();
      const std::string item = peers.substr(p, e - p);
      const std::size_t eq = item.find('=');
      if (eq != std::string::npos) {
        const double rate = std::atof(item.c_str() + eq + 1) * 1e9;
        std::printf("  vs %s (%s): %.2fx\n", item.substr(0, eq).c_str(), gbs(rate).c_str(), median / rate);
      }
      p = e + 1;
    }
  }
  bench::print_target(0, "  target host peak <= ring + 64 MiB", host_peak, "MiB",
                      host_peak <= double(opt.staging.slots * opt.staging.slot_bytes / MiB + 64));

  // every tensor checked against a CPU load of the same checkpoint (bytes compared on the device)
  std::size_t bad = 0;
  for (auto& [k, t] : sd) {
    state_dict one;
    one.add(k, at::empty(t.local.sizes(), t.local.options().device(at::kCPU)));
    load_state_dict(reader, one, load_options{.strict = false});
    const at::Tensor want = one.find(k)->local.to(dev), got = t.local;
    if (!at::equal(got.view(at::kByte), want.view(at::kByte))) ++bad;
  }
  std::printf("checked: %zu of %zu tensors differ from a CPU load\n", bad, sd.size());

  // --- converted: BF16/F16 stored, F32 on the device; on the GPU (default) and on the host
  for (const bool on_device : {true, false}) {
    state_dict f32;
    std::uint64_t f32_bytes = 0;
    for (const auto& [k, tm] : reader.metadata().tensors)
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
  for (const auto& [k, tm] : reader.metadata().tensors)
    sd.add(k, at::empty(to_sizes(tm.shape), at::TensorOptions().dtype(require_scalar_type(tm.type, k)).device(dev)));
  load_state_dict(reader, sd, opt);

  // --- saves from the CUDA tensors, durable as every save is (O_DIRECT blocks, then fdatasync)
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
  const std::filesystem::path shm =
      std::filesystem::path(a.get("--shm", "/dev/shm")) / ("shardsafe_bench_device." + std::to_string(::getpid()));
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
  std::filesystem::remove_all(out);
  return bad == 0 ? 0 : 1;
}
