// bench_cluster - real c10d worlds on a simulated cluster (scripts/cluster.sh: network namespaces
// as nodes on a switch of their own, each link limited to --rate, MASTER_ADDR node 0's address):
// the cost curve of a save and a resharded load as the world grows, and the two ways an HF import
// reads, from a shared file system and from an HTTP object store on a node of its own.
//
//   meson compile -C build bench/bench_cluster && sudo ./build/bench/bench_cluster [--quick]
//       [--rate 10gbit] [--worlds 1,2,4,8,16] [--tensors 32] [--store-rates 100mbit,1gbit,10gbit]
//
// Needs root (network namespaces) and iproute2; says so and exits 0 without them.
//
// Part 1, the curve: worlds of W ranks over 4 nodes (ceil(W/4) ranks a node, node 0 first), each
// saving a synthetic model of --tensors F32 tensors [512, 1024] (2 MiB each) held as FSDP's flat
// pieces (ceil(n/W) elements a rank), then loading it back resharded as row blocks (ceil(512/W)
// rows a rank: every rank reads pieces of the files holding its rows) and checking every value.
// Per world: metadata.json's size, the save's and the load's wall time (the slowest rank, from a
// barrier), the plan's time (the slowest rank: checkpoint_reader::plan), the bytes and files a
// rank reads (the most), and GB/s of model per second of load. The rank files live on this
// machine's one file system, as on a shared file system every node sees; the links carry the
// c10d traffic (the agreement on the metadata, the file sizes and checksums sent to rank 0, the
// barriers). Two cores run every rank: the curve shows what the protocol costs as W grows, not
// what W machines would read.
//
// Part 2, HF import: a Hugging Face folder of the same model (one safetensors file), imported by
// a world of 4 ranks (one a node; links --rate) into row blocks, or whole on every rank (data-
// parallel replicas), every_rank_read vs rank0_broadcast vs automatic, from the shared file
// system and from nginx on a fifth node (when nginx is there) whose link gets each of
// --store-rates in turn (cluster.sh rate); automatic's pick and the figures it decided on.
//
// Part 3, replicas read once (issue 56): the model saved in shardsafe's layout (4 rank files of
// flat pieces) served by nginx on a fifth node, loaded by 4 ranks on 4 nodes either whole on
// every rank (data parallelism: one group of 4) or as HSDP (2 replicas of 2 row shards), with
// collective_load_options::replicas every_rank_reads, read_once and automatic, at each store
// rate. Counted: the bytes that left the store node (its eth0's tx_bytes, from the kernel),
// against the model's size; the physical limit is the model through the store link once.
#include "bench_common.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/launch.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#ifndef SHARDSAFE_BENCH_HTTP
#define SHARDSAFE_BENCH_HTTP 0
#endif
#if SHARDSAFE_BENCH_HTTP
#include "shardsafe/storage/http.hpp"
#endif

using namespace shardsafe;
namespace fs = std::filesystem;
using u64 = std::uint64_t;

namespace {

constexpr u64 rows = 512, cols = 1024;
const std::string script = std::string(SHARDSAFE_SOURCE_DIR) + "/scripts/cluster.sh";

std::string tensor_name(int t) { return "layers." + std::to_string(t) + ".weight"; }
float value_at(int t, u64 e) { return static_cast<float>((e * 2654435761u + static_cast<u64>(t)) % 1000003u); }

/// [b, e) of piece r of n elements split w ways as torch.chunk does.
std::pair<u64, u64> piece(u64 n, u64 w, u64 r) {
  const u64 c = (n + w - 1) / w;
  return {std::min(n, c * r), std::min(n, c * (r + 1))};
}

// --- the ranks --------------------------------------------------------------------------------

/// How a rank holds each tensor: FSDP's flat pieces (ceil(n / w) elements a rank), row blocks
/// (ceil(rows / w) rows a rank), or whole (every rank a replica).
enum class layout { flat, rows, whole };

/// One rank's tensors: memory and views, each element its value_at.
struct rank_state {
  std::vector<std::vector<float>> mem;
  std::vector<flat_view> views;
  rank_state(int tensors, u64 w, u64 r, layout how, bool fill) {
    mem.reserve(static_cast<std::size_t>(tensors));
    for (int t = 0; t < tensors; ++t) {
      const shape_t full{rows, cols};
      shard_spec spec;
      if (how == layout::whole) {
        spec = flat_spec{{0, rows * cols}};
      } else if (how == layout::rows) {
        auto [b, e] = piece(rows, w, r);
        spec = block_spec({e - b, cols}, {b, 0});
      } else {
        auto [b, e] = piece(rows * cols, w, r);
        spec = flat_spec{{b, e}};
      }
      auto& m = mem.emplace_back(spec.local_numel(), -1.f);
      if (fill) {
        u64 k = 0;
        for (auto c = spec.cursor(full); !c.done(); c.next())
          for (u64 e = c.run().begin; e < c.run().end; ++e) m[k++] = value_at(t, e);
      }
      views.push_back({tensor_name(t), dtype::F32, full, spec, reinterpret_cast<std::byte*>(m.data()), m.size() * 4});
    }
  }
  /// Elements that differ from value_at.
  u64 wrong() const {
    u64 bad = 0;
    for (std::size_t t = 0; t < views.size(); ++t) {
      const shard_spec spec = views[t].effective_spec();
      u64 k = 0;
      for (auto c = spec.cursor(views[t].full_shape); !c.done(); c.next())
        for (u64 e = c.run().begin; e < c.run().end; ++e) bad += mem[t][k++] != value_at(static_cast<int>(t), e);
    }
    return bad;
  }
};

template <class C>
double timed(C& comm, const std::function<void()>& f) {
  comm.barrier();
  const double t0 = bench::now_s();
  f();
  return bench::now_s() - t0;
}

/// Worker of part 1: args root, tensors, form. Writes its figures to root/figures/rankR.
int curve_worker(const bench::args& a) {
  at::set_num_threads(1);
  const fs::path root(a.get("--root", ""));
  const int tensors = static_cast<int>(a.get_int("--tensors", 32));
  auto w = init_world_from_env(std::chrono::seconds(120));
  auto comm = w.comm();
  const u64 W = static_cast<u64>(w.world_size), R = static_cast<u64>(w.rank);
  const file_directory dir(root / "ckpt");
  save_options so;
  so.overwrite = true;
  so.metadata = a.get("--form", "automatic") == "compact" ? metadata_form::compact : metadata_form::automatic;
  double save_s = 0, plan_s = 0, load_s = 0;
  {
    rank_state s(tensors, W, R, layout::flat, true);
    save_s = timed(comm, [&] { save(dir, std::span<const flat_view>(s.views), comm, so); });
  }
  rank_state l(tensors, W, R, layout::rows, false);
  load_schedule sched;
  load_s = timed(comm, [&] {
    checkpoint_reader<file_directory> reader(dir);
    const double t0 = bench::now_s();
    sched = reader.plan(std::span<const flat_view>(l.views));
    plan_s = bench::now_s() - t0;
    reader.execute(std::span<const flat_view>(l.views), sched);
  });
  comm.barrier();
  std::ofstream(root / "figures" / ("rank" + std::to_string(R)))
      << save_s << ' ' << load_s << ' ' << plan_s << ' ' << sched.stats.bytes_read << ' ' << sched.files.size() << ' '
      << l.wrong() << '\n';
  return 0;
}

#if SHARDSAFE_BENCH_HTTP
/// A thin store link shared by 4 ranks with many requests in flight answers a 2 MiB request in
/// more than the default 20 s at 100 Mbit/s (each request waits behind the others): a minute.
http_options slow_link() {
  http_options o;
  o.operation_timeout = std::chrono::seconds(60);
  return o;
}
#endif

/// f(the folder or, for an http:// URL, the HTTP store src names).
template <class F>
void with_source(const std::string& src, F&& f) {
#if SHARDSAFE_BENCH_HTTP
  if (src.rfind("http://", 0) == 0) return f(http_directory(src, slow_link()));
#endif
  f(file_directory(src));
}

/// Worker of part 2: args --source (a folder or an http:// URL), --mode, --tensors, --out.
int hf_worker(const bench::args& a) {
  at::set_num_threads(1);
  const int tensors = static_cast<int>(a.get_int("--tensors", 32));
  auto w = init_world_from_env(std::chrono::seconds(120));
  auto comm = w.comm();
  const u64 W = static_cast<u64>(w.world_size), R = static_cast<u64>(w.rank);
  rank_state l(tensors, W, R, a.get("--layout", "rows") == "whole" ? layout::whole : layout::rows, false);
  hf_import_options o;
  const std::string mode = a.get("--mode", "every_rank_read");
  o.mode = mode == "rank0_broadcast" ? hf_import_mode::rank0_broadcast
           : mode == "automatic"     ? hf_import_mode::automatic
                                     : hf_import_mode::every_rank_read;
  const std::string src = a.get("--source", "");
  hf_import_stats res;
  const double s = timed(comm, [&] {
    with_source(src, [&](const auto& dir) { res = import_hf(dir, std::span<const flat_view>(l.views), comm, o); });
  });
  comm.barrier();
  std::ofstream(fs::path(a.get("--out", "")) / ("rank" + std::to_string(R)))
      << s << ' ' << to_string(res.mode) << ' ' << l.wrong() << ' ' << res.why << '\n';
  return 0;
}

/// Worker of part 3: args --source (http:// URL or folder), --mode, --layout whole|hsdp, --out.
int replicas_worker(const bench::args& a) {
  at::set_num_threads(1);
  const int tensors = static_cast<int>(a.get_int("--tensors", 32));
  auto w = init_world_from_env(std::chrono::seconds(120));
  auto comm = w.comm();
  const u64 R = static_cast<u64>(w.rank);
  const bool hsdp = a.get("--layout", "whole") == "hsdp";
  rank_state l(tensors, hsdp ? 2 : 1, hsdp ? R % 2 : 0, hsdp ? layout::rows : layout::whole, false);
  collective_load_options o;
  const std::string mode = a.get("--mode", "every_rank_reads");
  o.replicas = mode == "read_once"   ? replica_reads::read_once
               : mode == "automatic" ? replica_reads::automatic
                                     : replica_reads::every_rank_reads;
  const std::string src = a.get("--source", "");
  load_stats st;
  const double s = timed(comm, [&] {
    with_source(src, [&](const auto& dir) { st = load(dir, std::span<const flat_view>(l.views), comm, o); });
  });
  comm.barrier();
  std::ofstream(fs::path(a.get("--out", "")) / ("rank" + std::to_string(R)))
      << s << ' ' << to_string(st.replicas) << ' ' << l.wrong() << ' ' << st.bytes_read << ' ' << st.bytes_received
      << ' ' << st.why << '\n';
  return 0;
}

// --- the driver -------------------------------------------------------------------------------

int sh(const std::string& cmd) { return std::system((cmd + " >&2").c_str()); }
std::string out_of(const std::string& cmd) {
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    ::pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

/// The cluster, removed whatever way the run ends.
struct cluster {
  std::string name = "b" + std::to_string(::getpid() % 10000000);
  int nodes;
  std::string head, links;
  cluster(int n, const std::string& rate) : nodes(n) {
    if (sh(script + " up " + name + " " + std::to_string(n) + " " + rate) != 0)
      throw std::runtime_error("cluster.sh up failed");
    head = out_of(script + " addr " + name + " 0");
    links = out_of(script + " links " + name);
  }
  ~cluster() { sh(script + " down " + name); }
  std::string addr(int node) const { return out_of(script + " addr " + name + " " + std::to_string(node)); }
};

/// Runs W ranks of this program (with `args`) on c, per_node to a node from node 0; false if a
/// rank failed (its stderr is printed).
bool run_world(const cluster& c, int W, int per_node, const std::vector<std::string>& args, const fs::path& logdir,
               int& port) {
  launch_options o;
  o.master_addr = c.head;
  o.master_port = port++;
  o.env = {{"GLOO_SOCKET_IFNAME", "eth0"}, {"OMP_NUM_THREADS", "1"}, {"USE_LIBUV", "0"}};
  o.stderr_dir = logdir;
  const std::string name = c.name;
  o.wrap = [name, per_node](int r) {
    return std::vector<std::string>{script, "run", name, std::to_string(r / per_node)};
  };
  o.local_rank = [per_node](int r) { return r % per_node; };
  std::vector<int> st;
  {
    local_world w(fs::read_symlink("/proc/self/exe").string(), args, W, o);
    st = w.wait(std::chrono::seconds(600));
  }
  bool ok = true;
  for (int r = 0; r < W; ++r)
    if (st[static_cast<std::size_t>(r)] != 0) {
      ok = false;
      std::ifstream in(logdir / ("rank" + std::to_string(r) + ".err"));
      std::stringstream ss;
      ss << in.rdbuf();
      std::fprintf(stderr, "rank %d exited %d:\n%s\n", r, st[static_cast<std::size_t>(r)], ss.str().c_str());
    }
  return ok;
}

std::vector<std::vector<double>> read_figures(const fs::path& dir, int W) {
  std::vector<std::vector<double>> out;
  for (int r = 0; r < W; ++r) {
    std::ifstream in(dir / ("rank" + std::to_string(r)));
    std::vector<double> v;
    double x;
    while (in >> x) v.push_back(x);
    out.push_back(v);
  }
  return out;
}

/// nginx serving `root` on c's last node (port 8080), state in nd; its URL once it answers.
std::string start_nginx(const cluster& c, const fs::path& root, const fs::path& nd) {
  fs::create_directories(nd / "tmp");
  const int node = c.nodes - 1;
  const std::string d = nd.string(), store = c.addr(node);
  std::ofstream(nd / "nginx.conf")
      << "worker_processes 2;\nuser root;\nerror_log " << d << "/error.log;\npid " << d << "/nginx.pid;\n"
      << "events { worker_connections 512; }\nhttp {\n  default_type application/octet-stream;\n"
      << "  access_log off;\n  client_body_temp_path " << d << "/tmp/body; proxy_temp_path " << d << "/tmp/proxy;\n"
      << "  fastcgi_temp_path " << d << "/tmp/fcgi; uwsgi_temp_path " << d << "/tmp/uwsgi; scgi_temp_path " << d
      << "/tmp/scgi;\n  keepalive_requests 100000;\n  server {\n    listen " << store << ":8080;\n    root "
      << root.string() << ";\n    location / { }\n  }\n}\n";
  sh(script + " run " + c.name + " " + std::to_string(node) + " /usr/sbin/nginx -p " + d + " -c " + d +
     "/nginx.conf -g 'daemon off;' &");
  for (int i = 0; i < 100; ++i) {
    if (sh(script + " run " + c.name + " 0 bash -c 'exec 3<>/dev/tcp/" + store + "/8080' 2>/dev/null") == 0)
      return "http://" + store + ":8080/";
    ::usleep(100000);
  }
  throw std::runtime_error("nginx on the store node did not come up");
}

/// Bytes node `node` of c has sent on its link (the kernel's count).
double tx_bytes(const cluster& c, int node) {
  return std::stod("0" + out_of(script + " run " + c.name + " " + std::to_string(node) +
                                " cat /sys/class/net/eth0/statistics/tx_bytes"));
}

}  // namespace

int main(int argc, char** argv) {
  const bench::args a(argc, argv);
  bench::accept_only(
      a, "Real c10d worlds on a simulated cluster: the save/load cost curve, the HF import modes, replicas read once.",
      {{"--quick", nullptr, "worlds 1, 2, 4 and one HF rate (a smoke run)"},
       {"--rate", "R", "link rate of the curve's cluster (tc units, default 10gbit)"},
       {"--worlds", "LIST", "world sizes of the curve (default 1,2,4,8,16)"},
       {"--tensors", "N", "tensors of 2 MiB in the model (default 32)"},
       {"--store-rates", "LIST", "the object store's link rates in the HF part (default 100mbit,1gbit,10gbit)"},
       {"--replica-rates", "LIST", "the object store's link rates in the replicas part (default 100mbit,1gbit,10gbit)"},
       {"--worker", "KIND", "", true},
       {"--root", "DIR", "", true},
       {"--form", "F", "", true},
       {"--source", "S", "", true},
       {"--mode", "M", "", true},
       {"--layout", "L", "", true},
       {"--out", "DIR", "", true}});
  if (a.has("--worker"))
    return a.get("--worker", "") == "hf"         ? hf_worker(a)
           : a.get("--worker", "") == "replicas" ? replicas_worker(a)
                                                 : curve_worker(a);
  const bool have_ip = fs::exists("/usr/sbin/ip") || fs::exists("/sbin/ip") || fs::exists("/usr/bin/ip");
  if (::geteuid() != 0 || !have_ip) {
    std::printf("bench_cluster: needs root and iproute2 (network namespaces); nothing measured\n");
    return 0;
  }
  const bool quick = a.has("--quick");
  const std::string tensors = std::to_string(a.get_int("--tensors", quick ? 8 : 32));
  const std::string rate = a.get("--rate", "10gbit");
  std::vector<int> worlds;
  for (const auto& w : bench::split_list(a.get("--worlds", quick ? "1,2,4" : "1,2,4,8,16")))
    worlds.push_back(std::stoi(w));
  const double model_mib = double(std::stoi(tensors)) * rows * cols * 4 / double(bench::MiB);
  char tmpl[] = "/tmp/bench_cluster-XXXXXX";
  const fs::path tmp(::mkdtemp(tmpl));
  int port = 29600;
  int status = 0;
  try {
    // --- part 1
    cluster c(4, rate);
    std::printf(
        "bench_cluster: 4 nodes, links %s; a model of %s F32 tensors [%llu, %llu] (%.0f MiB) held as flat "
        "pieces, loaded back as row blocks\n(the slowest rank's figures; files on this machine's file system, "
        "links carrying the c10d traffic; %ld cores run every rank)\n\n",
        c.links.c_str(), tensors.c_str(), (unsigned long long)rows, (unsigned long long)cols, model_mib,
        ::sysconf(_SC_NPROCESSORS_ONLN));
    bench::table t(
        {"world", "nodes", "form", "md KB", "save s", "load s", "plan ms", "read MiB", "files", "load MiB/s", "ok"});
    for (const std::string form : {"automatic", "compact"}) {
      for (int W : worlds) {
        const int per_node = (W + 3) / 4;
        const fs::path root = tmp / ("w" + std::to_string(W));
        fs::create_directories(root / "figures");
        if (!run_world(c, W, per_node,
                       {"--worker", "curve", "--root", root.string(), "--tensors", tensors, "--form", form},
                       root / "logs", port)) {
          status = 1;
          continue;
        }
        const auto f = read_figures(root / "figures", W);
        double save = 0, load = 0, plan = 0, bytes = 0, files = 0, wrong = 0;
        for (const auto& v : f) {
          if (v.size() < 6) continue;
          save = std::max(save, v[0]);
          load = std::max(load, v[1]);
          plan = std::max(plan, v[2]);
          bytes = std::max(bytes, v[3]);
          files = std::max(files, v[4]);
          wrong += v[5];
        }
        if (wrong > 0) status = 1;
        const auto md_bytes = fs::file_size(root / "ckpt" / "metadata.json");
        t.add({std::to_string(W), std::to_string((W + per_node - 1) / per_node),
               form == "automatic" ? "listed" : "compact", bench::fmt("%.1f", double(md_bytes) / 1e3),
               bench::fmt("%.3f", save), bench::fmt("%.3f", load), bench::fmt("%.2f", plan * 1e3),
               bench::fmt("%.1f", bytes / double(bench::MiB)), bench::fmt("%.0f", files),
               bench::fmt("%.0f", model_mib / load), wrong == 0 ? "yes" : "NO"});
        std::fflush(stdout);
        fs::remove_all(root);
      }
    }
    t.print();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cluster: %s\n", e.what());
    status = 1;
  }
  try {
    // --- part 2: the HF folder, one safetensors file of the model's full tensors
    const fs::path hf = tmp / "hf";
    fs::create_directories(hf);
    {
      const int T = std::stoi(tensors);
      std::string header = "{";
      u64 off = 0;
      for (int t = 0; t < T; ++t) {
        const u64 n = rows * cols * 4;
        header += (t ? ", \"" : "\"") + tensor_name(t) + "\": {\"dtype\": \"F32\", \"shape\": [" +
                  std::to_string(rows) + ", " + std::to_string(cols) + "], \"data_offsets\": [" + std::to_string(off) +
                  ", " + std::to_string(off + n) + "]}";
        off += n;
      }
      header += "}";
      header.append((8 - header.size() % 8) % 8, ' ');
      std::ofstream out(hf / "model.safetensors", std::ios::binary);
      const u64 len = header.size();
      for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
      out << header;
      std::vector<float> buf(rows * cols);
      for (int t = 0; t < T; ++t) {
        for (u64 e = 0; e < rows * cols; ++e) buf[e] = value_at(t, e);
        out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * 4));
      }
    }
    const bool http = SHARDSAFE_BENCH_HTTP && fs::exists("/usr/sbin/nginx");
    std::printf(
        "\nHF import of the same model (one safetensors file, %.0f MiB) by 4 ranks on 4 nodes (links %s), into row"
        "\nblocks or whole (every rank a replica: MiB/s counts what all ranks received); the shared file system is this"
        "\nmachine's; the object store is nginx on a fifth node whose link gets each store rate%s\n\n",
        model_mib, rate.c_str(), http ? "" : " (not run: no nginx, or built without storage/http.hpp)");
    bench::table t({"ranks load", "source", "mode", "import s", "MiB/s", "mode used", "ok"});
    std::vector<std::string> picks;  // automatic's reasons
    cluster c(5, rate);
    std::string url;
    if (http) url = start_nginx(c, hf, tmp / "nginx");
    std::vector<std::string> stores{"-"};  // the file system first (no store link)
    if (http)
      for (const auto& sr : bench::split_list(a.get("--store-rates", quick ? "1gbit" : "100mbit,1gbit,10gbit")))
        stores.push_back(sr);
    for (const std::string held : {"rows", "whole"}) {
      for (const auto& srate : stores) {
        const bool fs_source = srate == "-";
        if (!fs_source) sh(script + " rate " + c.name + " 4 " + srate);
        for (const std::string mode : {"every_rank_read", "rank0_broadcast", "automatic"}) {
          const fs::path out = tmp / "hf-figures";
          fs::remove_all(out);
          fs::create_directories(out);
          if (!run_world(c, 4, 1,
                         {"--worker", "hf", "--source", fs_source ? hf.string() : url, "--mode", mode, "--tensors",
                          tensors, "--layout", held, "--out", out.string()},
                         tmp / "hf-logs", port)) {
            status = 1;
            continue;
          }
          double secs = 0, wrong = 0;
          std::string used;
          for (int r = 0; r < 4; ++r) {
            std::ifstream in(out / ("rank" + std::to_string(r)));
            double x = 0, bad = 0;
            std::string m, why;
            in >> x >> m >> bad;
            std::getline(in, why);
            secs = std::max(secs, x);
            wrong += bad;
            if (r == 0) used = m;
            if (r == 0 && mode == "automatic")
              picks.push_back(held + ", " + (fs_source ? std::string("file system") : "store link " + srate) + ": " +
                              m + " -" + why);
          }
          if (wrong > 0) status = 1;
          const double mib = held == "whole" ? 4 * model_mib : model_mib;
          t.add({held == "rows" ? "row blocks" : "whole (replicas)", fs_source ? "file system" : "store, " + srate,
                 mode, bench::fmt("%.3f", secs), bench::fmt("%.0f", mib / secs), used, wrong == 0 ? "yes" : "NO"});
        }
      }
      t.separator();
    }
    t.print();
    std::printf("\nautomatic's pick (hf_import_options::mode's default), from what it measured:\n");
    for (const auto& p : picks) std::printf("  %s\n", p.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cluster: %s\n", e.what());
    status = 1;
  }
  try {
    // --- part 3: replicas read once, from a store behind a thin link
    const bool http = SHARDSAFE_BENCH_HTTP && fs::exists("/usr/sbin/nginx");
    const fs::path ck = tmp / "replicas-ckpt";
    {  // saved by 4 thread ranks of this process, as flat pieces
      const file_directory dir(ck);
      const int T = std::stoi(tensors);
      const auto thrown = run_ranks(4, [&](thread_comm& tc) {
        rank_state s(T, 4, static_cast<u64>(tc.rank()), layout::flat, true);
        save(dir, std::span<const flat_view>(s.views), tc);
      });
      for (const auto& e : thrown)
        if (e) std::rethrow_exception(e);
    }
    std::printf(
        "\nReplicas read once: the model (%.0f MiB, 4 rank files) from nginx on a fifth node, loaded by 4 ranks on 4"
        "\nnodes (links %s) whole on every rank (one group of 4) or as HSDP (2 replicas of 2 row shards); 'store MiB'"
        "\nis what left the store node (its link's tx_bytes), 'x model' that over the model's size; 'limit s' the model"
        "\nthrough the store link once%s\n\n",
        model_mib, rate.c_str(), http ? "" : " (not run: no nginx, or built without storage/http.hpp)");
    if (http) {
      cluster c(5, rate);
      const std::string url = start_nginx(c, ck, tmp / "nginx3");
      bench::table t({"ranks load", "store link", "replicas", "load s", "limit s", "store MiB", "x model",
                      "received MiB a rank", "used", "ok"});
      std::vector<std::string> picks;
      for (const std::string held : {"whole", "hsdp"}) {
        for (const auto& srate :
             bench::split_list(a.get("--replica-rates", quick ? "1gbit" : "100mbit,1gbit,10gbit"))) {
          sh(script + " rate " + c.name + " 4 " + srate);
          const double link_bps = srate.find("gbit") != std::string::npos   ? std::stod(srate) * 1e9
                                  : srate.find("mbit") != std::string::npos ? std::stod(srate) * 1e6
                                                                            : std::stod(srate);
          for (const std::string mode : {"every_rank_reads", "read_once", "automatic"}) {
            const fs::path out = tmp / "replica-figures";
            fs::remove_all(out);
            fs::create_directories(out);
            const double tx0 = tx_bytes(c, 4);
            if (!run_world(c, 4, 1,
                           {"--worker", "replicas", "--source", url, "--mode", mode, "--tensors", tensors, "--layout",
                            held, "--out", out.string()},
                           tmp / "replica-logs", port)) {
              status = 1;
              continue;
            }
            const double sent = tx_bytes(c, 4) - tx0;
            double secs = 0, wrong = 0, received = 0;
            std::string used;
            for (int r = 0; r < 4; ++r) {
              std::ifstream in(out / ("rank" + std::to_string(r)));
              double x = 0, bad = 0, rd = 0, got = 0;
              std::string m, why;
              in >> x >> m >> bad >> rd >> got;
              std::getline(in, why);
              secs = std::max(secs, x);
              wrong += bad;
              received = std::max(received, got);
              if (r == 0) used = m;
              if (r == 0 && mode == "automatic")
                picks.push_back(held + ", store link " + srate + ": " + m + " -" + why);
            }
            if (wrong > 0) status = 1;
            const double model_bytes = model_mib * double(bench::MiB);
            t.add({held == "whole" ? "whole (DP)" : "HSDP 2x2", srate, mode, bench::fmt("%.3f", secs),
                   bench::fmt("%.3f", model_bytes * 8 / link_bps), bench::fmt("%.1f", sent / double(bench::MiB)),
                   bench::fmt("%.2f", sent / model_bytes), bench::fmt("%.1f", received / double(bench::MiB)), used,
                   wrong == 0 ? "yes" : "NO"});
            std::fflush(stdout);
          }
        }
        t.separator();
      }
      t.print();
      std::printf("\nautomatic's pick (collective_load_options::replicas = automatic), from what it measured:\n");
      for (const auto& p : picks) std::printf("  %s\n", p.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cluster: %s\n", e.what());
    status = 1;
  }
  fs::remove_all(tmp);
  return status;
}
