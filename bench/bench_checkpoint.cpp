// bench_checkpoint - saving and loading a ~1 GiB transformer state dict with shardsafe, in one
// process and in a 2-rank c10d (Gloo) world, beside LibTorch's torch::save / torch::load of
// the same tensors and the copy and I/O limits of the same bytes; and the bytes a resharded
// load (4 ranks -> 3 ranks) reads against the bytes it needs.
//
//   meson setup build-bench -Dbench=true -Dbuildtype=release -Dtests=false -Dexamples=false
//   meson compile -C build-bench bench_checkpoint
//   ./build-bench/bench/bench_checkpoint [--quick] [--dir /tmp] [--reps 5] [--dtype f32|bf16]
//
// The state dict (F32; --dtype bf16 doubles the layers to stay near 1 GiB):
//   embed.weight [32000, 2048]; per layer (4): attn.qkv.weight [6144, 2048],
//   attn.o.weight [2048, 2048], mlp.up.weight [8192, 2048], mlp.down.weight [2048, 8192],
//   norm1.weight [2048], norm2.weight [2048]; norm.weight [2048]  = 1018 MiB.
// --quick: d = 256, ffn = 1024, vocab 4000, 2 layers (~6 MiB), one repetition.
//
// Every measurement runs in a fresh process (this program re-executed, or a local_world of
// it), so peak RSS (VmHWM) is that measurement's alone: "peak +MiB" is VmHWM minus VmRSS just
// before the model's tensors were allocated (LibTorch already loaded and initialised).
// shardsafe saves with O_DIRECT (save_options::direct_io), which leaves its files uncached:
// one row loads right after the save (uncached: the file comes from the disk); before the
// other loads every file is read once, so the page cache is warm for shardsafe and torch alike
// (the table prints how much of each file was resident, by mincore); dropping caches needs
// root privileges we lack.
// Saves: shardsafe fdatasyncs every file and fsyncs the folder (durable); torch::save does
// not sync, so it is reported alone and with an fsync of its file and folder after it.
// Limits of the same bytes, each in its own process: memcpy and pread (warm) with 1 and 2
// threads into touched memory; pwrite + fdatasync (buffered) and O_DIRECT pwrite + fdatasync
// (staged through aligned blocks, 2 threads); the first touch of fresh tensors of the model's
// size (the page faults any load into new memory pays). bench/README.md explains each column.
// Loads where the loader allocates (the inference case: nothing exists yet): unshard_state into
// one at::empty per tensor, into a tensor_arena (huge pages, populated ahead of the reads) and
// into a hugetlb_arena (the machine's reserved huge pages, when vm.nr_hugepages has room),
// and the zero-copy map_state (copy-on-write mappings of the file), alone and with every page
// then read once (the cost moved to the first use), each against torch::load.
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>

#include "bench_torch_common.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/dist/launch.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/mmap.hpp"
#include "shardsafe/torch/mapped_state.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "shardsafe/torch/tensor_memory.hpp"

using namespace shardsafe;
using bench::MiB;
using bench::u64;
namespace fs = std::filesystem;

namespace {

using bench::tensor_def;

struct config {
  bool quick = false;
  bool bf16 = false;
  at::ScalarType st() const { return bf16 ? at::kBFloat16 : at::kFloat; }
};

std::vector<tensor_def> model_defs(const config& c) {
  return bench::transformer_defs(c.quick, (c.quick ? 2 : 4) * (c.bf16 ? 2 : 1), '.');
}

u64 model_bytes(const config& c) { return bench::defs_bytes(model_defs(c), c.bf16 ? 2 : 4); }

// How a world splits each tensor: whole (one process), row blocks, flat ranges, column blocks.
// 1-D tensors are split as flat ranges under every split but whole.
enum class split { whole, rows, flat, cols };

split split_from(const std::string& s) {
  if (s == "rows") return split::rows;
  if (s == "flat") return split::flat;
  if (s == "cols") return split::cols;
  return split::whole;
}

std::optional<shard_spec> spec_for(const tensor_def& t, split sp, int world, int rank) {
  if (sp == split::whole) return std::nullopt;
  const u64 n = shardsafe::numel(t.shape);
  auto part = [&](u64 len, int r) { return len * u64(r) / u64(world); };
  if (t.shape.size() == 1 || sp == split::flat) return shard_spec(flat_spec{{part(n, rank), part(n, rank + 1)}});
  const u64 rows = t.shape[0], cols = t.shape[1];
  if (sp == split::rows)
    return shard_spec(block_spec({part(rows, rank + 1) - part(rows, rank), cols}, {part(rows, rank), 0}));
  return shard_spec(block_spec({rows, part(cols, rank + 1) - part(cols, rank)}, {0, part(cols, rank)}));
}

struct local_tensors {
  state_dict sd;
  std::vector<at::Tensor> tensors;  // the local tensors, in model order
  u64 bytes = 0;
};

// This rank's tensors, allocated and then: filled with their values, zeroed (touched), or
// left untouched (their pages are faulted in by whoever writes them first).
enum class init { fill, zero, none };

local_tensors make_local(const config& c, split sp, int world, int rank, init how) {
  local_tensors out;
  const auto defs = model_defs(c);
  for (std::size_t k = 0; k < defs.size(); ++k) {
    const auto& d = defs[k];
    const auto spec = spec_for(d, sp, world, rank);
    const u64 n = spec ? spec->local_numel() : shardsafe::numel(d.shape);
    at::Tensor t = spec ? at::empty({static_cast<std::int64_t>(n)}, c.st()) : at::empty(to_sizes(d.shape), c.st());
    if (how == init::fill) {
      const shard_spec s = spec ? *spec : shard_spec(flat_spec{{0, n}});
      bench::fill_runs(t, k, [&](auto&& f) {
        for (auto cur = s.cursor(d.shape); !cur.done(); cur.next()) {
          const spec_run r = cur.run();
          f(r.begin, r.end, r.local);
        }
      });
    } else if (how == init::zero) {
      t.zero_();
    }
    out.bytes += t.nbytes();
    out.tensors.push_back(t);
    if (spec)
      out.sd.add(d.name, t, *spec, d.shape);
    else
      out.sd.add(d.name, t);
  }
  return out;
}

// Checks ~256 evenly spaced elements of every local tensor against the values saved.
bool verify(const config& c, const std::vector<at::Tensor>& tensors, split sp, int world, int rank) {
  const auto defs = model_defs(c);
  for (std::size_t k = 0; k < defs.size(); ++k) {
    const auto spec = spec_for(defs[k], sp, world, rank);
    const at::Tensor& t = tensors[k];
    const u64 n = static_cast<u64>(t.numel());
    const shard_spec s = spec ? *spec : shard_spec(flat_spec{{0, n}});
    for (u64 i = 0; i < n; i += std::max<u64>(1, n / 256)) {
      auto g = global_index_of(s, defs[k].shape, i);
      if (!g || !bench::same_value(t, i, k, *g)) {
        std::fprintf(stderr, "verify: tensor %s local element %llu is wrong\n", defs[k].name.c_str(),
                     (unsigned long long)i);
        return false;
      }
    }
  }
  return true;
}

// ---- children: one measurement each ------------------------------------------------------

config config_from(const bench::args& a) {
  config c;
  c.quick = a.has("--quick");
  c.bf16 = a.get("--dtype", "f32") == "bf16";
  return c;
}

void warm_up_torch() {
  at::Tensor t = at::ones({1024});
  (void)t.sum().item<float>();
}

// the RSS baseline: after LibTorch is up, before the model exists
double g_anon0 = 0;  // RssAnon at the baseline, MiB
double start_memory() {
  warm_up_torch();
  const double rss0 = bench::rss_mib();
  g_anon0 = double(bench::proc_status_kib("RssAnon")) / 1024.0;
  bench::reset_peak_rss();
  return rss0;
}

// one process: shardsafe save / load, torch::save / load, memcpy, raw I/O
int child_single(const std::string& what, const bench::args& a) {
  const config c = config_from(a);
  const std::string path = a.get("--path", "");
  const double rss0 = start_memory();
  if (what == "ss-save") {
    local_tensors m = make_local(c, split::whole, 1, 0, init::fill);
    single_process comm;
    save_options so;
    so.overwrite = true;
    so.checksums = a.get_int("--checksums", 1) != 0;
    const double t0 = bench::now_s();
    save_state_dict(file_directory(path), m.sd, comm, so);
    bench::emit("seconds", bench::now_s() - t0);
  } else if (what == "torch-save") {
    local_tensors m = make_local(c, split::whole, 1, 0, init::fill);
    const double t0 = bench::now_s();
    torch::save(m.tensors, path);
    const double t1 = bench::now_s();
    bench::fsync_path(path);
    bench::emit("seconds", t1 - t0);
    bench::emit("fsync_seconds", bench::now_s() - t1);
  } else if (what == "ss-load" || what == "ss-load-fresh" || what == "ss-load-mmap" || what == "ss-load-checked") {
    bench::emit("resident", bench::page_cache_resident(path + "/rank_0.safetensors"));
    const bool fresh = what == "ss-load-fresh";
    std::optional<local_tensors> m;
    if (!fresh) m = make_local(c, split::whole, 1, 0, init::zero);  // the model exists: allocated, touched
    bench::rss_sampler sampler;
    const double t0 = bench::now_s();
    if (fresh) m = make_local(c, split::whole, 1, 0, init::none);  // allocation and first touch timed
    load_options lo;
    lo.verify_checksums = what == "ss-load-checked";
    load_stats st = what == "ss-load-mmap" ? load_state_dict(mmap_directory(path), m->sd, lo)
                                           : load_state_dict(file_directory(path), m->sd, lo);
    if (lo.verify_checksums && st.checksum_blocks == 0) return 1;  // the checkpoint has checksums
    const double t1 = bench::now_s();
    sampler.stop();
    if (!verify(c, m->tensors, split::whole, 1, 0)) return 1;
    bench::emit("seconds", t1 - t0);
    bench::emit("peak_mib", bench::hwm_mib() - rss0);
    bench::emit("peak_anon_mib", sampler.peak_anon_mib() - g_anon0);
    bench::emit("bytes_read", double(st.bytes_read));
  } else if (what == "ss-unshard" || what == "ss-unshard-arena" || what == "ss-unshard-hugetlb" || what == "ss-map") {
    // the loader allocates: unshard_state into at::empty tensors or into one huge-page arena,
    // or map_state (zero-copy: copy-on-write mappings of the file, nothing read yet)
    bench::emit("resident", bench::page_cache_resident(path + "/rank_0.safetensors"));
    bench::rss_sampler sampler;
    const long pool0 = tensor_arena::hugetlb_pages_free();
    const double t0 = bench::now_s();
    map_stats ms;
    auto named = what == "ss-map" ? map_state(path, &ms)
                                  : unshard_state(file_directory(path), {},
                                                  what == "ss-unshard-arena"     ? tensor_memory::arena
                                                  : what == "ss-unshard-hugetlb" ? tensor_memory::hugetlb_arena
                                                                                 : tensor_memory::separate);
    const double t1 = bench::now_s();
    if (what == "ss-unshard-hugetlb")
      bench::emit("pool_pages_used", double(pool0 - tensor_arena::hugetlb_pages_free()));
    // pages of the reserved pool are outside VmRSS / VmHWM / RssAnon: counted beside them
    const double hugetlb_mib = double(bench::proc_status_kib("HugetlbPages")) / 1024.0;
    if (what == "ss-map") {
      if (ms.copied != 0 || ms.mapped != named.size()) return 1;  // every tensor is one file's: all mapped
      // then every page read once (the load is paid by the first use instead): one byte per 4 KiB
      volatile unsigned char sink = 0;
      for (const auto& [k, t] : named) {
        const auto* b = static_cast<const unsigned char*>(t.data_ptr());
        for (std::size_t i = 0; i < t.nbytes(); i += 4096) sink = sink + b[i];
      }
      bench::emit("touch_seconds", bench::now_s() - t1);
    }
    sampler.stop();
    std::map<std::string, at::Tensor> by_name(named.begin(), named.end());
    std::vector<at::Tensor> ordered;
    for (const auto& d : model_defs(c)) {
      auto it = by_name.find(d.name);
      if (it == by_name.end()) return 1;
      ordered.push_back(it->second);
    }
    if (!verify(c, ordered, split::whole, 1, 0)) return 1;
    bench::emit("seconds", t1 - t0);
    bench::emit("peak_mib", bench::hwm_mib() - rss0 + hugetlb_mib);
    bench::emit("peak_anon_mib", sampler.peak_anon_mib() - g_anon0 + hugetlb_mib);
  } else if (what == "torch-load") {
    bench::emit("resident", bench::page_cache_resident(path));
    std::vector<at::Tensor> v;
    bench::rss_sampler sampler;
    const double t0 = bench::now_s();
    torch::load(v, path);
    const double t1 = bench::now_s();
    sampler.stop();
    if (!verify(c, v, split::whole, 1, 0)) return 1;
    bench::emit("seconds", t1 - t0);
    bench::emit("peak_mib", bench::hwm_mib() - rss0);
    bench::emit("peak_anon_mib", sampler.peak_anon_mib() - g_anon0);
  } else if (what == "first-touch") {
    local_tensors m = make_local(c, split::whole, 1, 0, init::none);
    bench::emit("seconds", bench::first_touch(m.tensors));
  } else if (what == "limits") {
    local_tensors src = make_local(c, split::whole, 1, 0, init::fill);
    local_tensors dst = make_local(c, split::whole, 1, 0, init::zero);
    std::vector<bench::byte_piece> pieces;
    for (std::size_t i = 0; i < src.tensors.size(); ++i)
      pieces.push_back({static_cast<const std::byte*>(src.tensors[i].data_ptr()),
                        static_cast<std::byte*>(dst.tensors[i].data_ptr()), src.tensors[i].nbytes()});
    bench::measure_limits(pieces, path);
    if (!verify(c, dst.tensors, split::whole, 1, 0)) return 1;
  } else {
    std::fprintf(stderr, "unknown child '%s'\n", what.c_str());
    return 2;
  }
  return 0;
}

// one rank of a world: RESULT lines go to OUT/rank_R.txt
int child_world(const std::string& what, const bench::args& a) {
  const config c = config_from(a);
  const std::string path = a.get("--path", "");
  const std::string out = a.get("--out", "");
  const split sp = split_from(a.get("--split", "rows"));
  auto w = init_world_from_env();
  c10d_comm comm = w.comm();
  const double rss0 = start_memory();
  std::map<std::string, double> res;
  auto timed = [&](auto&& f) {
    comm.barrier();
    const double t0 = bench::now_s();
    f();
    comm.barrier();
    return bench::now_s() - t0;
  };
  if (what == "ss-save") {
    local_tensors m = make_local(c, sp, w.world_size, w.rank, init::fill);
    save_options so;
    so.overwrite = true;
    res["seconds"] = timed([&] { save_state_dict(file_directory(path), m.sd, comm, so); });
  } else if (what == "torch-save") {
    local_tensors m = make_local(c, sp, w.world_size, w.rank, init::fill);
    const std::string f = path + "/torch_rank_" + std::to_string(w.rank) + ".pt";
    if (w.rank == 0) fs::create_directories(path);
    comm.barrier();
    res["seconds"] = timed([&] { torch::save(m.tensors, f); });
    res["fsync_seconds"] = timed([&] { bench::fsync_path(f); });
  } else if (what == "ss-load") {
    local_tensors m = make_local(c, sp, w.world_size, w.rank, init::zero);
    load_stats st;
    const bool mapped = a.has("--mmap");
    bench::rss_sampler sampler;
    res["seconds"] = timed([&] {
      st = mapped ? load_state_dict(mmap_directory(path), m.sd) : load_state_dict(file_directory(path), m.sd);
    });
    sampler.stop();
    res["peak_anon_mib"] = sampler.peak_anon_mib() - g_anon0;
    if (!verify(c, m.tensors, sp, w.world_size, w.rank)) return 1;
    res["bytes_read"] = double(st.bytes_read);
    res["bytes_needed"] = double(st.bytes_needed);
    res["read_ops"] = double(st.read_ops);
    res["loader_seconds"] = st.seconds;
    if (std::getenv("BENCH_DEBUG"))
      std::fprintf(stderr, "rank %d: timed %.3f s, loader %.3f s, %llu ops\n", w.rank, res["seconds"], st.seconds,
                   (unsigned long long)st.read_ops);
    res["local_bytes"] = double(m.bytes);
  } else if (what == "torch-load") {
    const std::string f = path + "/torch_rank_" + std::to_string(w.rank) + ".pt";
    std::vector<at::Tensor> v;
    res["seconds"] = timed([&] { torch::load(v, f); });
    if (!verify(c, v, sp, w.world_size, w.rank)) return 1;
  } else {
    std::fprintf(stderr, "unknown world child '%s'\n", what.c_str());
    return 2;
  }
  res["peak_mib"] = bench::hwm_mib() - rss0;
  std::FILE* f = std::fopen((out + "/rank_" + std::to_string(w.rank) + ".txt").c_str(), "w");
  for (const auto& [k, v] : res) std::fprintf(f, "%s %.9g\n", k.c_str(), v);
  std::fclose(f);
  comm.barrier();
  return 0;
}

// Starts a world of n ranks of this program; returns each rank's results.
std::vector<bench::result> run_world(int n, const std::vector<std::string>& args, const fs::path& scratch) {
  const fs::path out = scratch / "world-out";
  fs::remove_all(out);
  fs::create_directories(out);
  ::sync();  // as run_child: the file system settles first
  std::vector<std::string> full{"--world-child"};
  full.insert(full.end(), args.begin(), args.end());
  full.push_back("--out");
  full.push_back(out.string());
  launch_options lo;
  lo.env["OMP_NUM_THREADS"] = "1";
  local_world world(bench::self_exe(), full, n, lo);
  const auto& st = world.wait(std::chrono::minutes(10));
  for (int r = 0; r < n; ++r)
    if (st[r] != 0) {
      std::fprintf(stderr, "world child rank %d failed with %d\n", r, st[r]);
      std::exit(2);
    }
  std::vector<bench::result> res(n);
  for (int r = 0; r < n; ++r) {
    std::FILE* f = std::fopen((out / ("rank_" + std::to_string(r) + ".txt")).c_str(), "r");
    char k[256];
    double v;
    while (f && std::fscanf(f, "%255s %lf", k, &v) == 2) res[r][k] = v;
    if (f) std::fclose(f);
  }
  return res;
}

double max_of(const std::vector<bench::result>& rs, const std::string& k) {
  double m = 0;
  for (const auto& r : rs) m = std::max(m, r.at(k));
  return m;
}
double sum_of(const std::vector<bench::result>& rs, const std::string& k) {
  double s = 0;
  for (const auto& r : rs) s += r.at(k);
  return s;
}

// the limits' rows
const std::string L_memcpy1 = "memcpy of the same bytes, 1 thread (touched dst)";
const std::string L_memcpy2 = "memcpy of the same bytes, 2 threads";
const std::string L_read1 = "pread of the same bytes, 1 thread (warm cache)";
const std::string L_read2 = "pread of the same bytes, 2 threads (warm cache)";
const std::string L_touch = "first touch of fresh tensors of the model's size, 2 threads";
const std::string L_wbuf = "pwrite + fdatasync of the same bytes (1 thread)";
const std::string L_wdio = "O_DIRECT pwrite + fdatasync (staged, 2 threads)";
const std::string L_cold = "shardsafe load (file_directory, into the model), uncached";
const std::string L_nosum = "shardsafe save without checksums";
const std::string L_checked = "shardsafe load (file_directory, into the model, checksums checked)";
const std::string L_unshard = "shardsafe unshard_state (loader allocates: at::empty each)";
const std::string L_arena = "shardsafe unshard_state (loader allocates: tensor_arena)";
const std::string L_hugetlb = "  the same, tensor_memory::hugetlb_arena";
const std::string L_map = "shardsafe map_state (zero-copy: tensors usable)";
const std::string L_map_touch = "  map_state + every page read once";
const std::string L_mmap2 = "shardsafe load, 2 ranks (mmap_directory, into the model)";

struct row {
  std::string name;
  int world = 1;
  bench::samples t;
  bench::samples peak;       // MiB above the baseline (per process; max over ranks)
  bench::samples peak_anon;  // MiB (sampled), where measured
  double resident = -1;
  std::string peer;        // the torch row this is compared with
  std::string peer_fsync;  // the torch + fsync row (saves)
};

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  bench::accept_only(
      a,
      "Saves and loads a ~1 GiB state dict with shardsafe beside torch::save / torch::load and the copy and\n"
      "I/O limits of the same bytes (bench/README.md).",
      {{"--quick", nullptr, "~6 MiB model, one repetition (a smoke run)"},
       {"--reps", "N", "repetitions of every case (default 5)"},
       {"--dir", "DIR", "where the checkpoints are written (default /tmp)"},
       {"--dtype", "f32|bf16", "the tensors' dtype (bf16 doubles the layers to stay near 1 GiB)"},
       {"--child", "KIND", "", true},
       {"--world-child", "KIND", "", true},
       {"--path", "P", "", true},
       {"--split", "S", "", true},
       {"--out", "DIR", "", true},
       {"--checksums", "0|1", "", true},
       {"--mmap", nullptr, "", true}});
  if (argc > 2 && std::string(argv[1]) == "--child") return child_single(argv[2], a);
  if (argc > 2 && std::string(argv[1]) == "--world-child") return child_world(argv[2], a);

  const config c = config_from(a);
  const int reps = static_cast<int>(a.get_int("--reps", c.quick ? 1 : 5));
  const fs::path scratch = fs::path(a.get("--dir", "/tmp")) / ("shardsafe-bench-ckpt-" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  struct cleanup {
    fs::path p;
    ~cleanup() { fs::remove_all(p); }
  } rm{scratch};
  const u64 mbytes = model_bytes(c);
  const double gb = double(mbytes) / 1e9;
  std::vector<std::string> common{"--dtype", c.bf16 ? "bf16" : "f32"};
  if (c.quick) common.push_back("--quick");
  auto args = [&](std::vector<std::string> v) {
    v.insert(v.end(), common.begin(), common.end());
    return v;
  };
  const std::string load_before = bench::loadavg();
  const double t_start = bench::now_s();

  std::map<std::string, row> rows;
  double hugetlb_pages_used = 1e18;  // the fewest a hugetlb_arena child took from the pool
  std::vector<std::string> order;
  auto R = [&](const std::string& name, int world = 1) -> row& {
    if (!rows.count(name)) {
      order.push_back(name);
      rows[name].name = name;
      rows[name].world = world;
    }
    return rows[name];
  };
  const std::string ck1 = (scratch / "ss1").string(), pt1 = (scratch / "torch1.pt").string();
  const std::string ck2 = (scratch / "ss2").string(), pt2 = (scratch / "torch2").string();

  for (int rep = 0; rep < reps; ++rep) {
    std::fprintf(stderr, "repetition %d/%d ...\n", rep + 1, reps);
    // ---- (a) one process, whole tensors
    // saves go to paths that do not exist (removed untimed before): deleting a 1 GiB checkpoint
    // costs up to a second on this file system (online discard), and it is no part of saving
    for (const auto& p : {ck1, pt1, ck2, pt2}) fs::remove_all(p);
    // with and without checksums, in turn (which goes first alternates between repetitions)
    for (int k = 0; k < 2; ++k) {
      const bool sums = (k + rep) % 2 == 0;
      const std::string p = sums ? ck1 : ck1 + "-nosum";
      fs::remove_all(p);
      auto rs = bench::run_child(args({"--child", "ss-save", "--path", p, "--checksums", sums ? "1" : "0"}));
      R(sums ? "shardsafe save (fdatasync + rename)" : L_nosum).t.add(rs["seconds"]);
    }
    fs::remove_all(ck1 + "-nosum");
    auto r = bench::run_child(args({"--child", "ss-load", "--path", ck1}));  // right after the save: uncached
    R(L_cold).t.add(r["seconds"]);
    R(L_cold).peak.add(r["peak_mib"]);
    R(L_cold).peak_anon.add(r["peak_anon_mib"]);
    R(L_cold).resident = r["resident"];
    bench::warm_files(ck1);
    r = bench::run_child(args({"--child", "torch-save", "--path", pt1}));
    R("torch::save (no sync)").t.add(r["seconds"]);
    R("torch::save + fsync").t.add(r["seconds"] + r["fsync_seconds"]);
    for (const char* kind : {"ss-load", "ss-load-fresh", "ss-load-mmap", "ss-load-checked"}) {
      r = bench::run_child(args({"--child", kind, "--path", ck1}));
      const std::string k = kind;
      row& x = R(k == "ss-load"         ? "shardsafe load (file_directory, into the model)"
                 : k == "ss-load-fresh" ? "shardsafe load (file_directory, fresh tensors)"
                 : k == "ss-load-mmap"  ? "shardsafe load (mmap_directory, into the model)"
                                        : L_checked);
      x.t.add(r["seconds"]);
      x.peak.add(r["peak_mib"]);
      x.peak_anon.add(r["peak_anon_mib"]);
      x.resident = r["resident"];
    }
    for (const char* kind : {"ss-unshard", "ss-unshard-arena", "ss-unshard-hugetlb", "ss-map"}) {
      r = bench::run_child(args({"--child", kind, "--path", ck1}));
      const std::string k = kind;
      row& x = R(k == "ss-unshard"           ? L_unshard
                 : k == "ss-unshard-arena"   ? L_arena
                 : k == "ss-unshard-hugetlb" ? L_hugetlb
                                             : L_map);
      if (k == "ss-unshard-hugetlb") hugetlb_pages_used = std::min(hugetlb_pages_used, r["pool_pages_used"]);
      x.t.add(r["seconds"]);
      x.peak.add(r["peak_mib"]);
      x.peak_anon.add(r["peak_anon_mib"]);
      x.resident = r["resident"];
      if (k == "ss-map") {
        row& y = R(L_map_touch);
        y.t.add(r["seconds"] + r["touch_seconds"]);
        y.peak.add(r["peak_mib"]);
        y.peak_anon.add(r["peak_anon_mib"]);
        y.resident = r["resident"];
      }
    }
    r = bench::run_child(args({"--child", "torch-load", "--path", pt1}));
    row& tl = R("torch::load");
    tl.t.add(r["seconds"]);
    tl.peak.add(r["peak_mib"]);
    tl.peak_anon.add(r["peak_anon_mib"]);
    tl.resident = r["resident"];
    r = bench::run_child(args({"--child", "limits", "--path", (scratch / "raw").string()}));
    R(L_memcpy1).t.add(r["memcpy_1t"]);
    R(L_memcpy2).t.add(r["memcpy_2t"]);
    R(L_read1).t.add(r["read_1t"]);
    R(L_read2).t.add(r["read_2t"]);
    R(L_wbuf).t.add(r["write_buffered"]);
    if (r["write_direct"] > 0) R(L_wdio).t.add(r["write_direct"]);
    r = bench::run_child(args({"--child", "first-touch"}));
    R(L_touch).t.add(r["seconds"]);

    // ---- (b) a 2-rank world, row halves (1-D tensors: flat halves)
    auto w = run_world(2, args({"ss-save", "--path", ck2, "--split", "rows"}), scratch);
    R("shardsafe save, 2 ranks", 2).t.add(max_of(w, "seconds"));
    R("shardsafe save, 2 ranks", 2).peak.add(max_of(w, "peak_mib"));
    bench::warm_files(ck2);
    w = run_world(2, args({"torch-save", "--path", pt2, "--split", "rows"}), scratch);
    R("torch::save per rank, 2 ranks (no sync)", 2).t.add(max_of(w, "seconds"));
    R("torch::save per rank + fsync, 2 ranks", 2).t.add(max_of(w, "seconds") + max_of(w, "fsync_seconds"));
    w = run_world(2, args({"ss-load", "--path", ck2, "--split", "rows"}), scratch);
    R("shardsafe load, 2 ranks (into the model)", 2).t.add(max_of(w, "seconds"));
    R("shardsafe load, 2 ranks (into the model)", 2).peak.add(max_of(w, "peak_mib"));
    R("shardsafe load, 2 ranks (into the model)", 2).peak_anon.add(max_of(w, "peak_anon_mib"));
    w = run_world(2, args({"ss-load", "--path", ck2, "--split", "rows", "--mmap"}), scratch);
    R(L_mmap2, 2).t.add(max_of(w, "seconds"));
    R(L_mmap2, 2).peak.add(max_of(w, "peak_mib"));
    R(L_mmap2, 2).peak_anon.add(max_of(w, "peak_anon_mib"));
    w = run_world(2, args({"torch-load", "--path", pt2, "--split", "rows"}), scratch);
    R("torch::load per rank, 2 ranks", 2).t.add(max_of(w, "seconds"));
    R("torch::load per rank, 2 ranks", 2).peak.add(max_of(w, "peak_mib"));
  }
  for (const char* n : {"shardsafe save (fdatasync + rename)"}) {
    rows[n].peer = "torch::save (no sync)";
    rows[n].peer_fsync = "torch::save + fsync";
  }
  rows["shardsafe save, 2 ranks"].peer = "torch::save per rank, 2 ranks (no sync)";
  rows["shardsafe save, 2 ranks"].peer_fsync = "torch::save per rank + fsync, 2 ranks";
  for (const std::string& n : {std::string("shardsafe load (file_directory, into the model)"),
                               std::string("shardsafe load (file_directory, fresh tensors)"),
                               std::string("shardsafe load (mmap_directory, into the model)"), L_cold, L_unshard,
                               L_arena, L_hugetlb, L_map, L_map_touch})
    rows[n].peer = "torch::load";
  rows["shardsafe load, 2 ranks (into the model)"].peer = "torch::load per rank, 2 ranks";
  rows[L_mmap2].peer = "torch::load per rank, 2 ranks";

  // ---- resharding: saved by 4 ranks (row blocks), loaded by 3 (flat ranges; column blocks)
  const std::string ck4 = (scratch / "ss4").string();
  std::fprintf(stderr, "resharding 4 -> 3 ...\n");
  run_world(4, args({"ss-save", "--path", ck4, "--split", "rows"}), scratch);
  bench::warm_files(ck4);
  struct reshard_row {
    std::string name;
    double needed, read, ops, seconds, peak;
  };
  std::vector<reshard_row> reshard;
  for (const char* sp : {"flat", "cols"}) {
    auto w = run_world(3, args({"ss-load", "--path", ck4, "--split", sp}), scratch);
    reshard.push_back({std::string("4 ranks (row blocks) -> 3 ranks (") +
                           (std::string(sp) == "flat" ? "flat ranges" : "column blocks") + ")",
                       sum_of(w, "bytes_needed"), sum_of(w, "bytes_read"), sum_of(w, "read_ops"), max_of(w, "seconds"),
                       max_of(w, "peak_mib")});
  }
  const double t_total = bench::now_s() - t_start;

  // ---- tables ---------------------------------------------------------------------------
  std::printf(
      "bench_checkpoint: %zu tensors, %s, %.1f MiB (%.3f GB); %d repetition(s); every measurement in a fresh process\n",
      model_defs(c).size(), c.bf16 ? "BF16" : "F32", double(mbytes) / double(MiB), gb, reps);
  std::printf(
      "files in %s (ext4 on a virtual disk); page cache warm for loads (each file read once before; resident %% "
      "below)\n"
      "but for the 'uncached' row, which loads right after shardsafe's O_DIRECT save;\n"
      "no drop_caches here: bench_read measures loads from a cold page cache against the dd-like limit. GB/s = model "
      "bytes / seconds (all ranks together).\n",
      scratch.c_str());
  std::printf(
      "peak +MiB = VmHWM - VmRSS before the model was allocated (max over ranks); model = %.1f MiB "
      "(%.1f MiB per rank in 2-rank rows).\n",
      double(mbytes) / double(MiB), double(mbytes) / double(MiB) / 2);
  std::printf(
      "reserved huge pages (vm.nr_hugepages) free at the end: %ld of 2 MiB; the hugetlb_arena row took %.0f of them "
      "(the model needs %.0f; fewer: it fell back to tensor_arena)\n",
      tensor_arena::hugetlb_pages_free(), hugetlb_pages_used,
      std::ceil(double(mbytes) / double(tensor_arena::huge_page)));
  std::printf("load average before: %s, after: %s; wall time %.0f s\n\n", load_before.c_str(), bench::loadavg().c_str(),
              t_total);
  bench::table tab({"case", "ranks", "best ms", "median ms", "best GB/s", "median GB/s", "x torch (median)",
                    "x torch+fsync", "peak +MiB", "peak - model MiB", "anon peak +MiB", "cache"});
  const std::vector<std::string> groups[] = {
      {"shardsafe save (fdatasync + rename)", L_nosum, "torch::save (no sync)", "torch::save + fsync", L_wbuf, L_wdio},
      {"shardsafe load (file_directory, into the model)", "shardsafe load (file_directory, fresh tensors)",
       "shardsafe load (mmap_directory, into the model)", L_checked, L_cold, L_unshard, L_arena, L_hugetlb, L_map,
       L_map_touch, "torch::load", L_read1, L_read2, L_memcpy1, L_memcpy2, L_touch},
      {"shardsafe save, 2 ranks", "torch::save per rank, 2 ranks (no sync)", "torch::save per rank + fsync, 2 ranks"},
      {"shardsafe load, 2 ranks (into the model)", L_mmap2, "torch::load per rank, 2 ranks"}};
  bool first = true;
  for (const auto& g : groups) {
    if (!first) tab.separator();
    first = false;
    for (const auto& n : g) {
      if (!rows.count(n)) continue;
      const row& x = rows.at(n);
      auto ratio = [&](const std::string& p) {
        return p.empty() ? std::string("") : bench::fmt("%.2f", rows.at(p).t.median() / x.t.median());
      };
      const double model_mib = double(mbytes) / double(MiB) / x.world;
      tab.add({n, std::to_string(x.world), bench::fmt("%.1f", x.t.best() * 1e3), bench::fmt("%.1f", x.t.median() * 1e3),
               bench::fmt("%.2f", gb / x.t.best()), bench::fmt("%.2f", gb / x.t.median()), ratio(x.peer),
               ratio(x.peer_fsync), x.peak.empty() ? "" : bench::fmt("%.0f", x.peak.s.back()),
               x.peak.empty() ? "" : bench::fmt("%+.0f", x.peak.s.back() - model_mib),
               x.peak_anon.empty() ? "" : bench::fmt("%.0f", x.peak_anon.s.back()),
               x.resident < 0 ? "" : bench::fmt("%.0f%%", x.resident * 100)});
    }
  }
  tab.print();
  std::printf(
      "(peak columns: the largest over repetitions; anon peak = RssAnon sampled every 2 ms minus its baseline: mapped "
      "file pages excluded;\n"
      " the hugetlb_arena row adds the reserved huge pages it holds, HugetlbPages, which RSS does not count)\n\n");

  bench::table rt({"resharded load", "bytes needed", "bytes read", "read / needed", "read ops", "seconds (max rank)",
                   "GB/s", "peak +MiB (max rank)"});
  for (const auto& x : reshard)
    rt.add({x.name, bench::fmt("%.0f", x.needed), bench::fmt("%.0f", x.read), bench::fmt("%.4f", x.read / x.needed),
            bench::fmt("%.0f", x.ops), bench::fmt("%.3f", x.seconds), bench::fmt("%.2f", x.needed / 1e9 / x.seconds),
            bench::fmt("%.0f", x.peak)});
  rt.print();
  std::printf("(sums over the 3 ranks of load_stats.bytes_needed / bytes_read / read_ops; one repetition)\n\n");

  auto med = [&](const std::string& n) { return rows.at(n).t.median(); };
  auto line = [](const char* what, double v, const char* unit, bool ok) { bench::print_target(74, what, v, unit, ok); };
  std::printf("targets (medians):\n");
  double x = med("torch::load") / med("shardsafe load (file_directory, into the model)");
  line("load >= 3x faster than torch::load (file_directory, into the model)", x, "x", x >= 3);
  x = med("torch::load") / med("shardsafe load (file_directory, fresh tensors)");
  line("load >= 3x faster than torch::load (file_directory, fresh tensors)", x, "x", x >= 3);
  x = med("torch::load") / med(L_arena);
  line("load >= 3x faster than torch::load (the loader allocates: tensor_arena)", x, "x", x >= 3);
  x = med("torch::load") / med(L_hugetlb);
  line(hugetlb_pages_used * double(tensor_arena::huge_page) >= double(mbytes)
           ? "  the same, tensor_arena in the reserved huge pages (vm.nr_hugepages)"
           : "  the same, hugetlb_arena (the pool was too small: tensor_arena)",
       x, "x", x >= 3);
  x = med("torch::load") / med(L_map_touch);
  line("  zero-copy map_state + every page read once, against torch::load", x, "x", x >= 3);
  x = med("torch::load") / med("shardsafe load (mmap_directory, into the model)");
  line("load >= 3x faster than torch::load (mmap_directory, into the model)", x, "x", x >= 3);
  x = med("torch::load per rank, 2 ranks") / med("shardsafe load, 2 ranks (into the model)");
  line("load >= 3x faster than torch::load, 2 ranks", x, "x", x >= 3);
  x = med("torch::load per rank, 2 ranks") / med(L_mmap2);
  line("load >= 3x faster than torch::load, 2 ranks (mmap_directory)", x, "x", x >= 3);
  x = (med("shardsafe save (fdatasync + rename)") / med(L_nosum) - 1) * 100;
  line("checksums cost <= 5% of the durable save (median with / without - 1)", x, "%", x <= 5);
  x = med("torch::save (no sync)") / med("shardsafe save (fdatasync + rename)");
  line("save >= 2x faster than torch::save (shardsafe durable, torch not synced)", x, "x", x >= 2);
  x = med("torch::save + fsync") / med("shardsafe save (fdatasync + rename)");
  line("save >= 2x faster than torch::save + fsync (both durable)", x, "x", x >= 2);
  x = med("torch::save per rank + fsync, 2 ranks") / med("shardsafe save, 2 ranks");
  line("save >= 2x faster than torch::save + fsync, 2 ranks", x, "x", x >= 2);
  const double model_mib = double(mbytes) / double(MiB);
  for (const char* n :
       {"shardsafe load (file_directory, into the model)", "shardsafe load (file_directory, fresh tensors)",
        "shardsafe load (mmap_directory, into the model)"}) {
    const double over = rows.at(n).peak.s.back() - model_mib;
    line((std::string("peak RSS <= model + 64 MiB: ") + std::string(n).substr(15) + " [MiB over]").c_str(), over, "",
         over <= 64);
  }
  {
    const double over = rows.at("shardsafe load (mmap_directory, into the model)").peak_anon.s.back() - model_mib;
    line("  the same, anonymous memory only (VmHWM counts the mapped file's pages) [MiB over]", over, "", over <= 64);
  }
  {
    const double over = rows.at("shardsafe load, 2 ranks (into the model)").peak.s.back() - model_mib / 2;
    line("peak RSS <= model + 64 MiB: 2 ranks, per rank [MiB over]", over, "", over <= 64);
  }
  for (const auto& r : reshard) {
    const double q = r.read / r.needed;
    line(("resharded load reads <= 1.02x needed: " + r.name.substr(21)).c_str(), q, "x", q <= 1.02);
  }
  return 0;
}
