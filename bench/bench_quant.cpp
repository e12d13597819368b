// bench/bench_quant.cpp - quantized weights loaded into BF16 (issue 55, checkpoint/quant.hpp):
// shardsafe's dequantizing load against the Python routes a user would pick (bench/quant_peer.py,
// /usr/bin/python3's torch and safetensors: torch 2.x in the Debian 13 root), and the floor of
// reading the file. No LibTorch in this program.
//
// Two synthetic checkpoints, written once (config.json + model.safetensors, random codes, no NaN):
//   fp8_block  DeepSeek-V3's form: F8_E4M3 weights with an F32 weight_scale_inv per 128 x 128,
//              shapes of one of its MLPs ([2048, 7168] and [7168, 2048], x4; --quick: /8);
//   mxfp4      gpt-oss's form: experts' X_blocks U8 [E, rows, G, 16] and X_scales [E, rows, G]
//              (8 experts of [2880, 2880]; --quick: [720, 720]).
// Rows, round-robin over --reps rounds, each in a fresh process (fork; Python: a child) so that its
// peak RSS (wait4's ru_maxrss) is its own; the file in the page cache (read once before):
//   read floor        the file read into one buffer (the bytes every route must read)
//   shardsafe whole   every weight loaded dequantized into BF16 whole tensors (load, convert_dtypes)
//   shardsafe 2 ranks rank 0's rows of every weight (two ranks, rows split): its BF16 shard
//   python whole      safetensors.load_file, then the dequantization in torch (DeepSeek's
//                     fp8_cast_bf16.py route; gpt-oss's convert_moe_packed_tensors)
//   python 2 ranks    rank 0's rows through safe_open's get_slice, then the same dequantization
// Columns: best / median seconds, x python (the Python row's median / this row's), GB/s of stored
// bytes, peak RSS, and the BF16 values' sum (shardsafe's and torch's agree: the same values).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;
using bench::u64;
namespace fs = std::filesystem;

namespace {

struct weight {
  std::string name;  // logical
  shape_t shape;     // logical
};

/// Writes a safetensors file of (name, dtype, shape, bytes) with its header by hand.
void write_safetensors(const fs::path& p, const std::vector<std::tuple<std::string, dtype, shape_t, std::string>>& ts) {
  std::string header = "{", data;
  u64 off = 0;
  for (const auto& [name, t, shape, bytes] : ts) {
    std::string s;
    for (auto d : shape) s += (s.empty() ? "" : ",") + std::to_string(d);
    header += (header.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" +
              std::string(to_string(t)) + "\",\"shape\":[" + s + "],\"data_offsets\":[" + std::to_string(off) + "," +
              std::to_string(off + bytes.size()) + "]}";
    off += bytes.size();
  }
  header += "}";
  while (header.size() % 8) header += ' ';
  std::ofstream out(p, std::ios::binary);
  const u64 n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header;
  for (const auto& t : ts) out << std::get<3>(t);
}

/// The synthetic checkpoint of `scheme` in dir; its weights' logical names and shapes.
std::vector<weight> write_checkpoint(const fs::path& dir, const std::string& scheme, bool quick) {
  fs::create_directories(dir);
  std::mt19937_64 rng(55);
  auto bytes = [&](u64 n, unsigned char mask) {
    std::string b(static_cast<std::size_t>(n), '\0');
    for (auto& c : b) {
      c = static_cast<char>(rng() & mask);
      if ((c & 0x7F) == 0x7F) c = static_cast<char>(c & 0xFE);  // no E4M3 NaN
    }
    return b;
  };
  std::vector<std::tuple<std::string, dtype, shape_t, std::string>> ts;
  std::vector<weight> ws;
  if (scheme == "fp8_block") {
    const u64 h = quick ? 256 : 2048, f = quick ? 896 : 7168;
    for (int l = 0; l < 4; ++l)
      for (const auto& [n, shape] : {std::pair{"up_proj", shape_t{f, h}}, std::pair{"down_proj", shape_t{h, f}}}) {
        const std::string name = "model.layers." + std::to_string(l) + ".mlp." + n + ".weight";
        ts.emplace_back(name, dtype::F8_E4M3, shape, bytes(numel(shape), 0xFF));
        const shape_t s{(shape[0] + 127) / 128, (shape[1] + 127) / 128};
        std::string sb(static_cast<std::size_t>(numel(s) * 4), '\0');
        for (u64 i = 0; i < numel(s); ++i) {
          const float v = std::ldexp(0.5f + float(rng() % 1000) / 2000.0f, -int(rng() % 10) - 3);
          std::memcpy(sb.data() + i * 4, &v, 4);
        }
        ts.emplace_back(name + "_scale_inv", dtype::F32, s, sb);
        ws.push_back({name, shape});
      }
    std::ofstream(dir / "config.json")
        << R"({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}})";
  } else {
    const u64 e = 8, d = quick ? 720 : 2880, g = d / 32;
    for (const char* n : {"gate_up_proj", "down_proj"}) {
      const std::string name = std::string("model.layers.0.mlp.experts.") + n;
      const shape_t rows = std::string(n) == "gate_up_proj" ? shape_t{e, 2 * d} : shape_t{e, d};
      ts.emplace_back(name + "_blocks", dtype::U8, shape_t{rows[0], rows[1], g, 16},
                      bytes(rows[0] * rows[1] * g * 16, 0xFF));
      std::string s(static_cast<std::size_t>(rows[0] * rows[1] * g), '\0');
      for (auto& c : s) c = static_cast<char>(118 + rng() % 12);
      ts.emplace_back(name + "_scales", dtype::U8, shape_t{rows[0], rows[1], g}, s);
      ws.push_back({name, shape_t{rows[0], rows[1], g * 32}});
    }
    std::ofstream(dir / "config.json") << R"({"quantization_config": {"quant_method": "mxfp4"}})";
  }
  std::sort(ts.begin(), ts.end());
  write_safetensors(dir / "model.safetensors", ts);
  return ws;
}

/// Loads rank r of n's rows (the second-last dimension) of every weight into BF16; their sum.
double load_rows(const fs::path& dir, const std::vector<weight>& ws, u64 r, u64 n) {
  checkpoint_reader<file_directory> reader{file_directory(dir)};
  std::vector<std::vector<std::uint16_t>> mem;
  std::vector<flat_view> views;
  for (const auto& w : ws) {
    const std::size_t k = w.shape.size();
    const u64 rows = w.shape[k - 2], per = (rows + n - 1) / n, a = std::min(rows, r * per),
              e = std::min(rows, (r + 1) * per);
    shape_t local = w.shape, off(k, 0);
    local[k - 2] = e - a;
    off[k - 2] = a;
    mem.emplace_back(static_cast<std::size_t>(numel(local)));
    views.push_back({w.name, dtype::BF16, w.shape, block_spec(local, off),
                     reinterpret_cast<std::byte*>(mem.back().data()), mem.back().size() * 2});
  }
  load_options o;
  o.convert_dtypes = true;
  load(reader, std::span<const flat_view>(views), o);
  double sum = 0;
  for (const auto& m : mem)
    for (std::uint16_t b : m) {
      const std::uint32_t u = std::uint32_t(b) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      sum += f;
    }
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::args a(argc, argv);
  bench::accept_only(a, "quantized weights (FP8 block scales, MXFP4) loaded into BF16: shardsafe against Python",
                     {{"--quick", nullptr, "small shapes, one round"}, {"--reps", "N", "rounds (default 3)"}});
  const bool quick = a.has("--quick");
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 3));
  const std::string py = "/usr/bin/python3";
  const std::string peer = (fs::path(SHARDSAFE_SOURCE_DIR) / "bench" / "quant_peer.py").string();
  const fs::path base = fs::temp_directory_path() / ("shardsafe-bench-quant-" + std::to_string(::getpid()));
  const bench::outcome version = bench::run_peer({py, peer, "version"});
  std::printf("bench_quant: %s; peer: %s\n", quick ? "--quick" : "full",
              version.ok ? ("/usr/bin/python3, torch and safetensors") : version.why.c_str());
  for (const std::string scheme : {"fp8_block", "mxfp4"}) {
    const fs::path dir = base / scheme;
    const auto ws = write_checkpoint(dir, scheme, quick);
    const fs::path file = dir / "model.safetensors";
    const double stored = double(fs::file_size(file));
    u64 values = 0;
    for (const auto& w : ws) values += numel(w.shape);
    {  // into the page cache
      std::ifstream in(file, std::ios::binary);
      std::vector<char> b(1 << 20);
      while (in.read(b.data(), static_cast<std::streamsize>(b.size()))) {
      }
    }
    struct row {
      const char* name;
      std::vector<bench::outcome> runs;
    };
    std::vector<row> rows{{"read floor", {}},
                          {"shardsafe whole", {}},
                          {"shardsafe 2 ranks (rank 0)", {}},
                          {"python whole", {}},
                          {"python 2 ranks (rank 0)", {}}};
    for (int rep = 0; rep < reps; ++rep) {
      rows[0].runs.push_back(bench::in_child([&] {
        std::ifstream in(file, std::ios::binary);
        std::vector<char> b(static_cast<std::size_t>(stored));
        in.read(b.data(), static_cast<std::streamsize>(b.size()));
        return double(b[b.size() / 2]);
      }));
      rows[1].runs.push_back(bench::in_child([&] { return load_rows(dir, ws, 0, 1); }));
      rows[2].runs.push_back(bench::in_child([&] { return load_rows(dir, ws, 0, 2); }));
      rows[3].runs.push_back(bench::run_peer({py, peer, "whole", dir.string(), scheme}));
      rows[4].runs.push_back(bench::run_peer({py, peer, "rows", dir.string(), scheme, "0", "2"}));
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[v.size() / 2];
    };
    std::vector<double> py_med(2, 0);
    for (int k : {3, 4}) {
      std::vector<double> s;
      for (const auto& r : rows[k].runs)
        if (r.ok) s.push_back(r.seconds);
      py_med[k - 3] = median(s);
    }
    std::printf("\n%s: %zu weights, %.3g M values, %.1f MiB stored; %d round(s), the file in the page cache\n",
                scheme.c_str(), ws.size(), double(values) / 1e6, stored / bench::MiB, reps);
    bench::table t({"route", "best s", "median s", "x python", "GB/s stored", "peak MiB", "BF16 sum"});
    for (std::size_t k = 0; k < rows.size(); ++k) {
      std::vector<double> s, peak;
      std::string why;
      double sum = 0;
      for (const auto& r : rows[k].runs) {
        if (!r.ok) {
          why = r.why;
          continue;
        }
        s.push_back(r.seconds);
        peak.push_back(r.peak);
        sum = r.sum;
      }
      if (s.empty()) {
        t.add({rows[k].name, "-", "-", "-", "-", "-", why.substr(0, 60)});
        continue;
      }
      const double med = median(s), ref = k == 2 || k == 4 ? py_med[1] : py_med[0];
      const double share = k == 2 || k == 4 ? 0.5 : 1.0;  // rank 0 reads about half
      t.add({rows[k].name, bench::fmt("%.4f", *std::min_element(s.begin(), s.end())), bench::fmt("%.4f", med),
             k == 0 || ref == 0 ? "-" : bench::fmt("%.2f", ref / med), bench::fmt("%.2f", stored * share / med / 1e9),
             bench::fmt("%.0f", *std::max_element(peak.begin(), peak.end())), k == 0 ? "-" : bench::fmt("%.6g", sum)});
    }
    t.print();
  }
  fs::remove_all(base);
  return 0;
}
