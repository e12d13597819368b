// bench/bench_hf_export.cpp - export of the ~1 GiB benchmark model (bench_checkpoint's shapes,
// F32, 1018 MiB) from a sharded checkpoint to a Hugging Face folder (checkpoint/hf/export.hpp),
// against the write limits of the same bytes, in one run. No LibTorch.
//
// The checkpoint is saved once (single_process: one rank file) and read once so that the page
// cache holds it. Then the cases run round-robin (--reps rounds), each into a folder that does
// not exist yet (the previous one removed untimed, then sync()):
//   - O_DIRECT pwrite + fdatasync: the export's bytes from 16 MiB aligned blocks, 2 threads
//     (the durable-write limit without the page cache; what export_hf's writer does);
//   - pwrite + fdatasync: the same bytes through the page cache, 64 MiB calls;
//   - pread + O_DIRECT pwrite + fdatasync: each 16 MiB block read from the checkpoint's file
//     (warm) and written (the copy limit of an export that reads a cached checkpoint);
//   - export_hf with the default --max-shard-size (one model.safetensors), with 500MB (files +
//     index), and with --dtype bf16 (half the bytes written, every element converted).
// Columns: best / median ms, GB/s (bytes written ÷ seconds), x limit (the O_DIRECT row's median
// ÷ this row's, for the same bytes), peak +MiB (VmHWM − VmRSS before the case). The last round's
// export is checked against the model (every tensor's first, middle and last element).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/detail/posix.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;
using bench::u64;

namespace {

struct model_tensor {
  std::string name;
  shape_t shape;
};

std::vector<model_tensor> model_shapes(bool quick) {
  const u64 h = quick ? 256 : 2048, vocab = quick ? 4000 : 32000;
  const int layers = quick ? 2 : 4;
  std::vector<model_tensor> m{{"embed.weight", {vocab, h}}, {"norm.weight", {h}}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    m.push_back({p + "attn.qkv", {3 * h, h}});
    m.push_back({p + "attn.o", {h, h}});
    m.push_back({p + "mlp.up", {4 * h, h}});
    m.push_back({p + "mlp.down", {h, 4 * h}});
    m.push_back({p + "norm1.weight", {h}});
    m.push_back({p + "norm2.weight", {h}});
  }
  return m;
}

float value_at(std::size_t tensor, u64 i) {
  return static_cast<float>((i * 2654435761u + tensor) % 65521) * 1e-3f - 30.0f;
}

/// Writes `size` bytes to path from 16 MiB aligned blocks on 2 threads, O_DIRECT, then
/// fdatasync; each block filled by fill(offset, block) (untimed work included: it is the case).
template <class Fill>
void direct_write(const fs::path& path, u64 size, Fill&& fill) {
  file_writer w(path);
  w.write_blocks(size, fill, block_write_options{2, true, 16 * bench::MiB});
  w.sync();
  w.commit();
}

void buffered_write(const fs::path& path, u64 size, const std::vector<std::byte>& block) {
  detail::unique_fd fd = detail::open_fd(path.string(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (u64 off = 0; off < size; off += block.size()) {
    const u64 n = std::min<u64>(block.size(), size - off);
    detail::pwrite_full(fd.get(), off, std::span<const std::byte>(block.data(), n), path.string());
  }
  if (::fdatasync(fd.get()) != 0) std::abort();
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  bench::accept_only(
      a, "Exports the ~1 GiB benchmark model to a Hugging Face folder against the write limits (bench/README.md).",
      {{"--quick", nullptr, "a small model, one round (a smoke run)"},
       {"--reps", "N", "rounds of every case (default 5)"},
       {"--dir", "DIR", "where the folders are written (default /tmp)"}});
  const bool quick = a.has("--quick");
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 5));
  const fs::path scratch = fs::path(a.get("--dir", "/tmp")) / ("shardsafe-bench-hf-" + std::to_string(::getpid()));
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  std::printf("bench_hf_export: load average before: %s\n", bench::loadavg().c_str());

  // the checkpoint: saved once, then read once (warm page cache)
  const auto shapes = model_shapes(quick);
  const fs::path ckpt = scratch / "ckpt";
  u64 model_bytes = 0;
  {
    std::vector<std::vector<float>> mem;
    std::vector<flat_view> views;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      mem.emplace_back(numel(shapes[t].shape));
      for (u64 i = 0; i < mem.back().size(); ++i) mem.back()[i] = value_at(t, i);
      views.push_back({shapes[t].name, dtype::F32, shapes[t].shape, std::nullopt,
                       reinterpret_cast<std::byte*>(mem.back().data()), mem.back().size() * 4});
      model_bytes += mem.back().size() * 4;
    }
    single_process comm;
    save_options so;
    so.direct_io = false;  // leave it in the page cache
    save(file_directory(ckpt), std::span<const flat_view>(views), comm, so);
  }
  const fs::path rank_file = ckpt / rank_file_name(0);
  {
    file_storage s(rank_file);
    std::vector<std::byte> b(64 * bench::MiB);
    for (u64 off = 0; off < s.size(); off += b.size())
      s.read_into(off, std::span(b.data(), std::min<u64>(b.size(), s.size() - off)));
  }
  std::printf("model: %zu tensors, %.1f MiB F32; checkpoint in page cache: %.0f%%\n", shapes.size(),
              double(model_bytes) / bench::MiB, 100 * bench::page_cache_resident(rank_file.string()));

  // the export's size, for the limit rows (the same bytes)
  hf_export_options big;
  const u64 out_bytes = [&] {
    std::vector<hf_export_input> in;
    for (const auto& s : shapes) in.push_back({s.name, dtype::F32, s.shape});
    return plan_hf_export_layout(in, big, "x").bytes;
  }();
  std::vector<std::byte> block64(64 * bench::MiB, std::byte{1});

  struct kase {
    std::string name;
    u64 bytes;
    std::function<void(const fs::path&)> run;
    bench::samples t;
    double peak = 0;
  };
  hf_export_options shards;
  shards.max_shard_size = parse_size("500MB");
  hf_export_options bf16;
  bf16.convert_to = dtype::BF16;
  const u64 bf16_bytes = [&] {
    std::vector<hf_export_input> in;
    for (const auto& s : shapes) in.push_back({s.name, dtype::F32, s.shape});
    return plan_hf_export_layout(in, bf16, "x").bytes;
  }();
  std::vector<kase> cases;
  auto add = [&](std::string n, u64 b, std::function<void(const fs::path&)> f) {
    kase k;
    k.name = std::move(n);
    k.bytes = b;
    k.run = std::move(f);
    cases.push_back(std::move(k));
  };
  add("O_DIRECT pwrite + fdatasync (16 MiB blocks, 2 threads)", out_bytes, [&](const fs::path& d) {
    fs::create_directories(d);
    direct_write(d / "model.safetensors", out_bytes,
                 [](u64, std::span<std::byte> b) { std::memset(b.data(), 1, b.size()); });
  });
  add("pwrite + fdatasync (64 MiB calls)", out_bytes, [&](const fs::path& d) {
    fs::create_directories(d);
    buffered_write(d / "model.safetensors", out_bytes, block64);
  });
  add("pread (warm) + O_DIRECT pwrite + fdatasync", out_bytes, [&](const fs::path& d) {
    fs::create_directories(d);
    file_storage src(rank_file);
    direct_write(d / "model.safetensors", out_bytes, [&](u64 off, std::span<std::byte> b) {
      const u64 n = std::min<u64>(b.size(), src.size() - std::min(off, src.size()));
      src.read_into(off, b.first(n));
    });
  });
  add("export_hf (one model.safetensors)", out_bytes,
      [&](const fs::path& d) { export_to(file_directory(ckpt), file_directory(d), big); });
  add("export_hf --max-shard-size 500MB", out_bytes,
      [&](const fs::path& d) { export_to(file_directory(ckpt), file_directory(d), shards); });
  add("export_hf --dtype bf16", bf16_bytes,
      [&](const fs::path& d) { export_to(file_directory(ckpt), file_directory(d), bf16); });

  for (int r = 0; r < reps; ++r)
    for (auto& c : cases) {
      const fs::path d = scratch / "out";
      fs::remove_all(d);
      ::sync();
      const double rss0 = bench::rss_mib();
      bench::reset_peak_rss();
      const double t0 = bench::now_s();
      c.run(d);
      c.t.add(bench::now_s() - t0);
      c.peak = std::max(c.peak, bench::hwm_mib() - rss0);
      if (r == reps - 1 && c.name == "export_hf --max-shard-size 500MB") {  // check the values
        checkpoint_reader<file_directory> rd{file_directory(d)};
        for (std::size_t t = 0; t < shapes.size(); ++t) {
          const u64 n = numel(shapes[t].shape);
          for (u64 i : {u64{0}, n / 2, n - 1}) {
            float got = 0;
            flat_view v{shapes[t].name,
                        dtype::F32,
                        shapes[t].shape,
                        shard_spec(flat_spec{{i, i + 1}}),
                        reinterpret_cast<std::byte*>(&got),
                        4};
            load(rd, std::span<const flat_view>(&v, 1));
            if (got != value_at(t, i)) {
              std::fprintf(stderr, "%s[%llu]: %g, want %g\n", shapes[t].name.c_str(), (unsigned long long)i, got,
                           value_at(t, i));
              return 1;
            }
          }
        }
      }
    }
  fs::remove_all(scratch);

  const double limit = cases.front().t.median();
  bench::table tab({"case", "MiB written", "best ms", "median ms", "GB/s", "x limit", "peak +MiB"});
  for (const auto& c : cases)
    tab.add({c.name, bench::fmt("%.0f", double(c.bytes) / bench::MiB), bench::fmt("%.0f", c.t.best() * 1e3),
             bench::fmt("%.0f", c.t.median() * 1e3), bench::fmt("%.2f", double(c.bytes) / c.t.median() / 1e9),
             bench::fmt("%.2f", c.bytes == out_bytes ? limit / c.t.median()
                                                     : limit * double(c.bytes) / double(out_bytes) / c.t.median()),
             bench::fmt("%.1f", c.peak)});
  tab.print();
  std::printf("x limit: the O_DIRECT row's median (scaled to the bytes written) / the row's median; > 1 is faster\n");
  std::printf("load average after: %s\n", bench::loadavg().c_str());
  const double ex = cases[3].t.median();
  bench::print_target(60, "export_hf time / O_DIRECT write limit of the same bytes", ex / limit, "x",
                      ex / limit <= 1.3);
  bench::print_target(60, "export_hf peak RSS above the start", cases[3].peak, "MiB", cases[3].peak <= 64);
  return 0;
}
