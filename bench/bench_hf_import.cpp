// bench/bench_hf_import.cpp - a Hugging Face folder imported into a 2-rank row-sharded world
// (checkpoint/hf/import.hpp), three ways, each in a fresh process:
//   every_rank_read  each rank reads only its rows' byte ranges (import_hf, every_rank_read)
//   rank0_broadcast  rank 0 reads each tensor in 64 MiB chunks and broadcasts them; each rank
//                    keeps its rows (import_hf, rank0_broadcast)
//   whole files      each rank reads every file whole, then copies its rows out (what the
//                    Python loaders do: safetensors.load_file per shard file, then slicing)
// The model: the ~1 GiB benchmark shapes (bench_checkpoint's: embed [32000, 2048], 4 layers of
// qkv/o/up/down and norms; F32), written as an indexed folder of files of at most 300 MB.
// Columns: seconds (best and median of --reps), bytes read by each rank (x shard: the larger
// over one rank's shard bytes), peak RSS of the process above the
// model shards (the world is 2 threads of one process: its peak is both ranks' together).
// The ranks are threads joined by tests/support/thread_world.hpp plus a broadcast_buffer that copies
// straight out of rank 0's chunk (an interconnect at memory speed: the cost of reading is what
// is compared). Files are read warm (from the page cache, read once before).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "../tests/support/thread_world.hpp"
#include "bench_common.hpp"
#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;
using bench::GiB;
using bench::MiB;
using bench::u64;

namespace {

struct def {
  std::string name;
  shape_t shape;
};

/// bench_checkpoint's transformer shapes under HF-style names; quick: d = 256.
std::vector<def> model_defs(bool quick) {
  const u64 d = quick ? 256 : 2048, ffn = 4 * d, vocab = quick ? 4000 : 32000;
  std::vector<def> v{{"model.embed_tokens.weight", {vocab, d}}};
  for (int i = 0; i < 4; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    v.push_back({p + "self_attn.qkv_proj.weight", {3 * d, d}});
    v.push_back({p + "self_attn.o_proj.weight", {d, d}});
    v.push_back({p + "mlp.up_proj.weight", {ffn, d}});
    v.push_back({p + "mlp.down_proj.weight", {d, ffn}});
    v.push_back({p + "input_layernorm.weight", {d}});
    v.push_back({p + "post_attention_layernorm.weight", {d}});
  }
  v.push_back({"model.norm.weight", {d}});
  std::sort(v.begin(), v.end(), [](const def& a, const def& b) { return a.name < b.name; });
  return v;
}

/// Writes the folder: tensors in name order packed into files of at most max_file bytes.
void write_folder(const std::filesystem::path& dir, const std::vector<def>& defs, u64 max_file) {
  std::filesystem::create_directories(dir);
  file_directory fd(dir);
  std::vector<std::vector<def>> files(1);
  u64 size = 0;
  for (const auto& t : defs) {
    const u64 n = numel(t.shape) * 4;
    if (size > 0 && size + n > max_file) {
      files.emplace_back();
      size = 0;
    }
    files.back().push_back(t);
    size += n;
  }
  std::string map;
  u64 total = 0;
  std::vector<std::byte> buf;
  for (std::size_t f = 0; f < files.size(); ++f) {
    char fname[64];
    std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
    std::vector<tensor_entry> entries;
    for (const auto& t : files[f]) entries.push_back({t.name, dtype::F32, t.shape, 0, 0});
    auto out = fd.create(fname);
    auto layout = plan_safetensors(entries, {}, fname);
    safetensors_writer w(out, layout);
    for (const auto& t : files[f]) {
      buf.resize(numel(t.shape) * 4);
      float* p = reinterpret_cast<float*>(buf.data());
      for (u64 i = 0; i < numel(t.shape); ++i) p[i] = float(i % 1000) * 0.001f;
      w.write(t.name, buf);
      map += std::string(map.empty() ? "" : ", ") + "\"" + t.name + "\": \"" + fname + "\"";
      total += buf.size();
    }
    w.finish();
  }
  auto idx = fd.create("model.safetensors.index.json");
  const std::string text =
      "{\"metadata\": {\"total_size\": " + std::to_string(total) + "}, \"weight_map\": {" + map + "}}";
  idx.write_at(0, std::as_bytes(std::span(text.data(), text.size())));
  idx.sync();
  idx.commit();
}

/// A thread rank with a broadcast_buffer that copies straight from the root's memory.
class bench_comm {
 public:
  explicit bench_comm(testing::thread_comm& c) : c_(c) {}
  int rank() const { return c_.rank(); }
  int world_size() const { return c_.world_size(); }
  void barrier() { c_.barrier(); }
  std::vector<std::string> all_gather_bytes(std::string_view s) { return c_.all_gather_bytes(s); }
  void broadcast_bytes(std::string& s, int root) { c_.broadcast_bytes(s, root); }
  void broadcast_buffer(std::span<std::byte> b, int root) {
    std::string at(sizeof(std::byte*), '\0');
    std::byte* mine = b.data();
    if (rank() == root) std::memcpy(at.data(), &mine, sizeof mine);
    c_.broadcast_bytes(at, root);
    std::byte* src;
    std::memcpy(&src, at.data(), sizeof src);
    if (rank() != root) std::memcpy(b.data(), src, b.size());
    c_.barrier();  // the root's buffer stays until everyone has copied
  }

 private:
  testing::thread_comm& c_;
};

/// One rank's row shards: memory (touched before timing) and views.
struct rank_state {
  std::vector<std::vector<std::byte>> memory;
  std::vector<flat_view> views;
  rank_state(const std::vector<def>& defs, int w, int r) {
    for (const auto& t : defs) {
      const u64 rows = t.shape[0], per = (rows + w - 1) / w, b = std::min<u64>(rows, per * r),
                e = std::min<u64>(rows, b + per);
      shape_t local = t.shape, off(t.shape.size(), 0);
      local[0] = e - b;
      off[0] = b;
      flat_view v{t.name.substr(6), dtype::F32, t.shape, shard_spec(block_spec(local, off)), nullptr, 0};
      v.nbytes = v.local_numel() * 4;
      memory.emplace_back(v.nbytes, std::byte{1});
      v.data = memory.back().data();
      views.push_back(std::move(v));
    }
  }
};

/// Each rank reads every file whole into memory, then copies its rows of each tensor out.
u64 whole_files(const std::filesystem::path& dir, rank_state& st) {
  u64 read = 0;
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    file_storage f(dir / n);
    std::vector<std::byte> all(f.size());
    f.read_into(0, all);
    read += all.size();
    const safetensors_header h = read_safetensors_header(f);
    for (auto& v : st.views) {
      const tensor_entry* e = h.find("model." + v.key);
      if (!e) continue;
      const auto& b = v.spec->block();
      const u64 row = numel(v.full_shape) / v.full_shape[0] * 4;
      std::memcpy(v.data, all.data() + h.offset_of(*e) + b.global_offset()[0] * row, v.nbytes);
    }
  }
  return read;
}

int child(const std::string& mode, const std::filesystem::path& dir, bool quick) {
  const auto defs = model_defs(quick);
  std::vector<rank_state> ranks;
  for (int r = 0; r < 2; ++r) ranks.emplace_back(defs, 2, r);
  bench::reset_peak_rss();
  const double rss0 = bench::rss_mib();
  std::vector<u64> read(2);
  const double t0 = bench::now_s();
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& tc) {
    bench_comm c(tc);
    rank_state& st = ranks[static_cast<std::size_t>(c.rank())];
    if (mode == "whole_files") {
      read[c.rank()] = whole_files(dir, st);
      return;
    }
    hf_import_options o;
    o.rename = rename_rules({R"(^model\.(.*)=\1)"});
    o.strict = true;
    o.mode = mode == "every_rank_read" ? hf_import_mode::every_rank_read : hf_import_mode::rank0_broadcast;
    read[c.rank()] = import_hf(file_directory(dir), std::span<const flat_view>(st.views), c, o).stats.bytes_read;
  });
  const double secs = bench::now_s() - t0;
  for (auto& t : thrown)
    if (t) std::rethrow_exception(t);
  // spot check: rank 1's first row of the embedding is row `rows/2` of the file
  const float* e = reinterpret_cast<const float*>(ranks[1].views[0].data);
  const u64 cols = ranks[1].views[0].full_shape[1], row0 = ranks[1].views[0].spec->block().global_offset()[0];
  if (e[1] != float((row0 * cols + 1) % 1000) * 0.001f) {
    std::fprintf(stderr, "%s: wrong data\n", mode.c_str());
    return 1;
  }
  std::printf("RESULT seconds %.6f\nRESULT read0 %llu\nRESULT read1 %llu\nRESULT peak %.1f\n", secs,
              (unsigned long long)read[0], (unsigned long long)read[1], bench::hwm_mib() - rss0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  bench::accept_only(a, "Imports a Hugging Face folder into a 2-rank row-sharded world three ways (bench/README.md).",
                     {{"--quick", nullptr, "a small model, one repetition (a smoke run)"},
                      {"--reps", "N", "repetitions of every case (default 3)"},
                      {"--dir", "DIR", "where the folder is written (default /tmp)"},
                      {"--keep", nullptr, "keep the folder afterwards"},
                      {"--child", "KIND", "", true}});
  const bool quick = a.has("--quick");
  const std::filesystem::path dir = std::filesystem::path(a.get("--dir", "/tmp")) / "shardsafe-bench-hf";
  if (a.has("--child")) return child(a.get("--child", ""), dir, quick);
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 3));
  const auto defs = model_defs(quick);
  u64 total = 0;
  for (const auto& d : defs) total += numel(d.shape) * 4;
  std::printf("load average before: %s\n", bench::loadavg().c_str());
  std::filesystem::remove_all(dir);
  write_folder(dir, defs, quick ? 2 * MiB : 300'000'000);
  u64 files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::vector<std::byte> warm(std::filesystem::file_size(e.path()));
    file_storage(e.path()).read_into(0, warm);  // into the page cache
    ++files;
  }
  std::printf("model: %.1f MiB F32 in %llu files (%s); world: 2 thread ranks, row shards; %d rep(s)\n",
              double(total) / MiB, (unsigned long long)files - 1, dir.c_str(), reps);
  bench::table t({"mode", "best s", "median s", "GB/s", "read MiB rank 0 / 1", "x shard", "peak RSS +MiB"});
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  for (const char* mode : {"every_rank_read", "rank0_broadcast", "whole_files"}) {
    std::vector<double> secs;
    double peak = 0, read0 = 0, read1 = 0;
    for (int i = 0; i < reps; ++i) {
      std::string cmd =
          "'" + exe + "' --child " + mode + " --dir '" + a.get("--dir", "/tmp") + "'" + (quick ? " --quick" : "");
      std::FILE* p = ::popen(cmd.c_str(), "r");
      char line[512], key[64];
      double v;
      while (p && std::fgets(line, sizeof line, p))
        if (std::sscanf(line, "RESULT %63s %lf", key, &v) == 2) {
          if (!std::strcmp(key, "seconds")) secs.push_back(v);
          if (!std::strcmp(key, "peak")) peak = std::max(peak, v);
          if (!std::strcmp(key, "read0")) read0 = v;
          if (!std::strcmp(key, "read1")) read1 = v;
        }
      if (!p || ::pclose(p) != 0 || secs.size() != std::size_t(i + 1)) {
        std::fprintf(stderr, "child %s failed\n", mode);
        return 2;
      }
    }
    std::sort(secs.begin(), secs.end());
    t.add({mode, bench::fmt("%.3f", secs.front()), bench::fmt("%.3f", secs[secs.size() / 2]),
           bench::fmt("%.2f", double(total) / secs.front() / 1e9),
           bench::fmt("%.1f", read0 / MiB) + " / " + bench::fmt("%.1f", read1 / MiB),
           bench::fmt("%.2f", std::max(read0, read1) / (double(total) / 2)), bench::fmt("%.0f", peak)});
  }
  t.print();
  std::printf("load average after: %s\n", bench::loadavg().c_str());
  if (!a.has("--keep")) std::filesystem::remove_all(dir);
  return 0;
}
