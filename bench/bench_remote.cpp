// bench_remote - loading a checkpoint from nginx on loopback (storage/http.hpp) and from
// moto_server (storage/s3.hpp) against loading the same files from the local file system
// (file_storage), same views, same bytes; and the aws CLI downloading the same object from
// moto, moto's own ceiling.
//
//   meson compile -C build bench/bench_remote && ./build/bench/bench_remote [--quick] [--mib 1024] [--reps 3]
//       [--moto-reps 1] [--no-moto]
//
// The checkpoint: --mib MiB (default 1024; --quick 64) of F32 tensors of 16 MiB each, saved by
// save_flat_views from one rank into a temporary folder that an nginx started here serves on a
// free port of 127.0.0.1 (2 workers, sendfile), and into a bucket of a moto_server started here.
// Each repetition loads every tensor whole (one rank, the unsharded view) through
// file_directory, through http_directory (the default options: 16 requests in flight, 8 MiB
// parts; and with 4 and 2 in flight), and through s3_directory; each one's bytes are compared
// with the tensors saved. Then `aws s3 cp` (its own concurrent ranged GETs) and `aws s3api
// get-object` (one GET) download the rank file from moto to /dev/null, timed. The table:
// seconds (best of the reps), GB/s, requests, response body bytes received against the bytes
// needed, and peak RSS growth.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "../tests/net_ports.hpp"
#include "bench_common.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/http.hpp"
#if SHARDSAFE_HTTP_TLS
#include "shardsafe/storage/s3.hpp"
#endif

extern char** environ;

using namespace shardsafe;
using bench::MiB;
using bench::u64;
namespace fs = std::filesystem;

namespace {

/// A program run in the background, its output to log; SIGTERM and reaped when destroyed.
struct child {
  pid_t pid = -1;
  child(std::vector<std::string> argv, const fs::path& log) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> c;
    for (auto& s : argv) c.push_back(s.data());
    c.push_back(nullptr);
    if (posix_spawnp(&pid, c[0], &fa, nullptr, c.data(), environ) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  bool wait_for_port(int port, int seconds) const {
    for (int i = 0; pid > 0 && i < seconds * 100; ++i) {
      if (testing::port_open(port)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  ~child() {
    if (pid <= 0) return;
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
  }
};

/// Runs argv to the end with stdout to /dev/null; its wall seconds, or a negative number if it failed.
double timed_run(std::vector<std::string> argv) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  std::vector<char*> c;
  for (auto& s : argv) c.push_back(s.data());
  c.push_back(nullptr);
  const double t0 = bench::now_s();
  pid_t pid;
  const int rc = posix_spawnp(&pid, c[0], &fa, nullptr, c.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  int status = 0;
  ::waitpid(pid, &status, 0);
  const double t = bench::now_s() - t0;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? t : -1;
}

struct row {
  std::string name;
  bench::samples t;
  std::optional<u64> requests, body;
  double peak = 0;
  bool same = true;
};

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  const bool quick = a.has("--quick");
  const u64 mib = static_cast<u64>(a.get_int("--mib", quick ? 64 : 1024));
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 3));
  const int moto_reps = static_cast<int>(a.get_int("--moto-reps", 1));
  const bool with_moto = !a.has("--no-moto") && SHARDSAFE_HTTP_TLS;
  char tmpl[] = "/tmp/shardsafe-bench-remote-XXXXXX";
  if (!::mkdtemp(tmpl)) return 1;
  const fs::path root = tmpl, www = root / "www";
  fs::create_directories(www / "ckpt");
  fs::create_directories(root / "tmp");

  // the checkpoint: tensors of 16 MiB of random bits
  const u64 per = 16 * MiB, n = std::max<u64>(1, mib * MiB / per), rows = 2048, cols = per / 4 / rows;
  std::vector<std::vector<std::byte>> data(n, std::vector<std::byte>(per));
  std::mt19937_64 rng(1);
  for (auto& t : data)
    for (std::size_t i = 0; i < t.size(); i += 8) {
      const u64 x = rng();
      std::memcpy(t.data() + i, &x, 8);
    }
  std::vector<flat_view> views;
  for (u64 i = 0; i < n; ++i)
    views.push_back({"t" + std::to_string(i), dtype::F32, {rows, cols}, std::nullopt, data[i].data(), per});
  single_process comm;
  save_flat_views(file_directory(www / "ckpt"), std::span<const flat_view>(views), comm);

  const int port = testing::free_port();
  {
    std::ofstream c(root / "nginx.conf");
    const std::string d = root.string();
    c << "worker_processes 2;\nuser root;\nerror_log " << d << "/error.log;\npid " << d << "/nginx.pid;\n"
      << "events { worker_connections 1024; }\nhttp {\n  default_type application/octet-stream;\n  access_log off;\n"
      << "  client_body_temp_path " << d << "/tmp/b; proxy_temp_path " << d << "/tmp/p; fastcgi_temp_path " << d
      << "/tmp/f; uwsgi_temp_path " << d << "/tmp/u; scgi_temp_path " << d << "/tmp/s;\n  keepalive_requests 100000;\n"
      << "  sendfile on;\n  server { listen 127.0.0.1:" << port << "; root " << www.string() << "; location / { } }\n}\n";
  }
  std::optional<child> nginx;
  nginx.emplace(std::vector<std::string>{"/usr/sbin/nginx", "-p", root.string(), "-c", (root / "nginx.conf").string(), "-g",
                                         "daemon off;"},
                root / "nginx.log");
  if (!nginx->wait_for_port(port, 5)) {
    std::fprintf(stderr, "nginx did not start\n");
    return 1;
  }

  std::vector<std::vector<std::byte>> out(n, std::vector<std::byte>(per));
  std::vector<flat_view> into;
  for (u64 i = 0; i < n; ++i) into.push_back({"t" + std::to_string(i), dtype::F32, {rows, cols}, std::nullopt, out[i].data(), per});
  auto same_bytes = [&] {
    bool same = true;
    for (u64 i = 0; i < n; ++i) same = same && std::memcmp(out[i].data(), data[i].data(), per) == 0;
    for (auto& o : out) std::memset(o.data(), 0, o.size());  // the next backend must land every byte again
    return same;
  };
  std::vector<row> table;
  load_stats st;
  // one backend's row: reps timed loads of every tensor, then its bytes compared
  auto measure = [&](const std::string& name, int r, auto&& dir, detail::http_client* client) {
    row x;
    x.name = name;
    bench::reset_peak_rss();
    const double rss0 = bench::rss_mib();
    const u64 req0 = client ? client->stats().requests.load() : 0, body0 = client ? client->stats().body_bytes.load() : 0;
    x.t = bench::time_reps(r, [&] { st = load_flat_views(dir, std::span<const flat_view>(into)); });
    x.peak = bench::hwm_mib() - rss0;
    if (client) {
      x.requests = (client->stats().requests - req0) / u64(r);
      x.body = (client->stats().body_bytes - body0) / u64(r);
    }
    x.same = same_bytes();
    table.push_back(std::move(x));
  };

  const file_directory fd(www / "ckpt");
  load_flat_views(fd, std::span<const flat_view>(into));  // warm the page cache
  measure("file_storage (page cache)", reps, fd, nullptr);
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/ckpt";
  {
    const http_directory hd(url);
    measure("http_storage (nginx, lo), 16 in flight", reps, hd, &hd.client());
  }
  for (const unsigned k : {4u, 2u}) {
    http_options o;
    o.requests_in_flight = k;
    const http_directory hd(url, o);
    measure("http_storage (nginx, lo), " + std::to_string(k) + " in flight", reps, hd, &hd.client());
  }
  nginx.reset();  // moto gets the cores to itself

  double aws_cp = -1, aws_get = -1;
  std::string moto_note;
#if SHARDSAFE_HTTP_TLS
  if (with_moto) {
    const int mport = testing::free_port();
    child moto({"moto_server", "-H", "127.0.0.1", "-p", std::to_string(mport)}, root / "moto.log");
    if (!moto.wait_for_port(mport, 60)) {
      moto_note = "moto_server did not start: no moto rows";
    } else {
      const std::string endpoint = "http://127.0.0.1:" + std::to_string(mport);
      ::setenv("AWS_ENDPOINT_URL", endpoint.c_str(), 1);  // for the aws CLI (path style)
      ::setenv("AWS_ACCESS_KEY_ID", "bench", 1);
      ::setenv("AWS_SECRET_ACCESS_KEY", "bench", 1);
      ::unsetenv("AWS_SESSION_TOKEN");
      ::setenv("AWS_DEFAULT_REGION", "us-east-1", 1);
      s3_options o;
      o.endpoint = endpoint;
      o.region = "us-east-1";
      o.credentials = aws_credentials{"bench", "bench", ""};
      // moto assembles a multipart object in Python: completing a 1 GiB upload takes longer than
      // the default 30 s read timeout (and a CompleteMultipartUpload retried after its answer
      // timed out finds the upload gone)
      o.http.read_timeout = std::chrono::seconds(600);
      try {
        s3_directory("s3://bench", o).create_bucket();
        const s3_directory sd("s3://bench/ckpt", o);
        const double t0 = bench::now_s();
        save_flat_views(sd, std::span<const flat_view>(views), comm);
        moto_note = "saving the checkpoint to moto (multipart, 16 MiB parts): " + bench::fmt("%.1f s", bench::now_s() - t0);
        measure("s3_storage (moto_server, lo)", moto_reps, sd, &sd.client());
        aws_cp = timed_run({"aws", "s3", "cp", "--only-show-errors", "s3://bench/ckpt/rank_0.safetensors", "-"});
        aws_get = timed_run({"aws", "s3api", "get-object", "--bucket", "bench", "--key", "ckpt/rank_0.safetensors", "/dev/null"});
      } catch (const std::exception& e) {
        moto_note = std::string("moto rows failed: ") + e.what();
      }
    }
  }
#endif
  std::error_code ec;
  fs::remove_all(root, ec);

  const double bytes = double(n * per);
  std::printf("bench_remote: %llu MiB checkpoint (%llu tensors of 16 MiB, 1 rank file), best of %d (moto: %d), load %s\n",
              (unsigned long long)(n * per / MiB), (unsigned long long)n, reps, moto_reps, bench::loadavg().c_str());
  bench::table t({"backend", "seconds", "GB/s", "x file", "requests", "body bytes", "bytes needed", "peak +MiB", "bytes"});
  const double file_best = table.front().t.best();
  for (const auto& x : table)
    t.add({x.name, bench::fmt("%.3f", x.t.best()), bench::fmt("%.2f", bytes / x.t.best() / 1e9),
           bench::fmt("%.2f", file_best / x.t.best()), x.requests ? std::to_string(*x.requests) : "-",
           x.body ? std::to_string(*x.body) : "-", std::to_string(st.bytes_needed), bench::fmt("%.0f", x.peak),
           x.same ? "same" : "DIFFERENT"});
  // the rank file holds the tensors and its header: GB/s of the CLI rows are of the tensor bytes, as the others
  if (aws_cp > 0) t.add({"aws s3 cp (moto ceiling, rank file)", bench::fmt("%.3f", aws_cp), bench::fmt("%.2f", bytes / aws_cp / 1e9),
                         bench::fmt("%.2f", file_best / aws_cp), "-", "-", "-", "-", "-"});
  if (aws_get > 0)
    t.add({"aws s3api get-object (one GET)", bench::fmt("%.3f", aws_get), bench::fmt("%.2f", bytes / aws_get / 1e9),
           bench::fmt("%.2f", file_best / aws_get), "-", "-", "-", "-", "-"});
  t.print();
  if (!moto_note.empty()) std::printf("%s\n", moto_note.c_str());
  if (with_moto && (aws_cp < 0 || aws_get < 0)) std::printf("the aws CLI did not run (or failed): no ceiling rows\n");
  bool same = true;
  for (const auto& x : table) same = same && x.same;
  std::printf("http (16 in flight) / file throughput: %.2f (target >= 0.5); bytes identical: %s\n",
              file_best / table[1].t.best(), same ? "yes" : "NO");
  return same ? 0 : 1;
}
