// bench_remote - loading a checkpoint from nginx on loopback (storage/http.hpp) against loading
// the same files from the local file system (file_storage), same views, same bytes.
//
//   meson compile -C build bench/bench_remote && ./build/bench/bench_remote [--quick] [--mib 1024] [--reps 3]
//
// The checkpoint: --mib MiB (default 1024; --quick 64) of F32 tensors of 16 MiB each, saved by
// save_flat_views from one rank into a temporary folder that an nginx started here serves on a
// free port of 127.0.0.1. Each repetition loads every tensor whole
// (one rank, the unsharded view) through file_directory and through http_directory; the
// second one's bytes are compared with the first. The table: seconds (best of --reps), GB/s,
// requests, response body bytes received against the bytes needed, and peak RSS growth.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "bench_common.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/http.hpp"

extern char** environ;

using namespace shardsafe;
using bench::MiB;
using bench::u64;
namespace fs = std::filesystem;

namespace {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

bool port_open(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  const bool quick = a.has("--quick");
  const u64 mib = static_cast<u64>(a.get_int("--mib", quick ? 64 : 1024));
  const int reps = static_cast<int>(a.get_int("--reps", quick ? 1 : 3));
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

  const int port = free_port();
  {
    std::ofstream c(root / "nginx.conf");
    const std::string d = root.string();
    c << "worker_processes 2;\nuser root;\nerror_log " << d << "/error.log;\npid " << d << "/nginx.pid;\n"
      << "events { worker_connections 1024; }\nhttp {\n  default_type application/octet-stream;\n  access_log off;\n"
      << "  client_body_temp_path " << d << "/tmp/b; proxy_temp_path " << d << "/tmp/p; fastcgi_temp_path " << d
      << "/tmp/f; uwsgi_temp_path " << d << "/tmp/u; scgi_temp_path " << d << "/tmp/s;\n  keepalive_requests 100000;\n"
      << "  sendfile on;\n  server { listen 127.0.0.1:" << port << "; root " << www.string() << "; location / { } }\n}\n";
  }
  std::vector<std::string> argv_s{"/usr/sbin/nginx", "-p", root.string(), "-c", (root / "nginx.conf").string(), "-g", "daemon off;"};
  std::vector<char*> cargv;
  for (auto& s : argv_s) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, cargv[0], nullptr, nullptr, cargv.data(), environ) != 0) {
    std::fprintf(stderr, "cannot start nginx\n");
    return 1;
  }
  for (int i = 0; i < 500 && !port_open(port); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));

  std::vector<std::vector<std::byte>> out_file(n, std::vector<std::byte>(per)), out_http(n, std::vector<std::byte>(per));
  auto views_into = [&](std::vector<std::vector<std::byte>>& out) {
    std::vector<flat_view> v;
    for (u64 i = 0; i < n; ++i) v.push_back({"t" + std::to_string(i), dtype::F32, {rows, cols}, std::nullopt, out[i].data(), per});
    return v;
  };
  const file_directory fd(www / "ckpt");
  const http_directory hd("http://127.0.0.1:" + std::to_string(port) + "/ckpt");
  const auto vf = views_into(out_file), vh = views_into(out_http);
  // warm the page cache
  load_flat_views(fd, std::span<const flat_view>(vf));
  bench::reset_peak_rss();
  const double rss0 = bench::rss_mib();
  const auto tf = bench::time_reps(reps, [&] { load_flat_views(fd, std::span<const flat_view>(vf)); });
  const double peak_file = bench::hwm_mib() - rss0;
  bench::reset_peak_rss();
  const double rss1 = bench::rss_mib();
  const u64 req0 = hd.client().stats().requests, body0 = hd.client().stats().body_bytes;
  load_stats st;
  const auto th = bench::time_reps(reps, [&] { st = load_flat_views(hd, std::span<const flat_view>(vh)); });
  const double peak_http = bench::hwm_mib() - rss1;
  const u64 reqs = (hd.client().stats().requests - req0) / u64(reps), body = (hd.client().stats().body_bytes - body0) / u64(reps);
  bool same = true;
  for (u64 i = 0; i < n; ++i) same = same && out_file[i] == data[i] && out_http[i] == data[i];
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  std::error_code ec;
  fs::remove_all(root, ec);

  const double bytes = double(n * per);
  std::printf("bench_remote: %llu MiB checkpoint (%llu tensors of 16 MiB, 1 rank file), best of %d, load %s\n",
              (unsigned long long)(n * per / MiB), (unsigned long long)n, reps, bench::loadavg().c_str());
  std::printf("%-28s %9s %9s %10s %14s %14s %10s\n", "backend", "seconds", "GB/s", "requests", "body bytes", "bytes needed",
              "peak MiB");
  std::printf("%-28s %9.3f %9.2f %10s %14s %14llu %10.0f\n", "file_storage (page cache)", tf.best(), bytes / tf.best() / 1e9,
              "-", "-", (unsigned long long)st.bytes_needed, peak_file);
  std::printf("%-28s %9.3f %9.2f %10llu %14llu %14llu %10.0f\n", "http_storage (nginx, lo)", th.best(), bytes / th.best() / 1e9,
              (unsigned long long)reqs, (unsigned long long)body, (unsigned long long)st.bytes_needed, peak_http);
  std::printf("http / file throughput: %.2f (target >= 0.5); bytes identical: %s\n", tf.best() / th.best(), same ? "yes" : "NO");
  return same ? 0 : 1;
}
