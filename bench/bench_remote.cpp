// bench_remote - loading a checkpoint from nginx on loopback (storage/http.hpp) and from
// moto_server (storage/s3.hpp) against loading the same files from the local file system
// (file_storage), same views, same bytes; and the aws CLI downloading the same object from
// moto, moto's own ceiling.
//
//   meson compile -C build bench/bench_remote && ./build/bench/bench_remote [--quick] [--mib 1024] [--reps 3]
//       [--moto-reps 1] [--no-moto] [--loopback-cc cubic]
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
// needed, and peak RSS growth. The loopback ceiling beside them: plain sockets (1, 2, 4
// threads, each one connection and one GET of an equal range of the rank file, recv into a
// reused 16 MiB buffer, Connection: close) reading the rank file from the same nginx, the
// bytes counted against its size; then 2 and 4 such connections landing their ranges in one
// touched buffer of the file's size (distinct memory, as a load does), compared with the file;
// and target lines for http against the best of each kind.
//
// The header names the TCP congestion control the loopback runs with: the sender's (nginx's)
// choice paces every byte. With BBR (this VM's default) the loopback gave any client, plain
// sockets included, mostly 1.5-7 GB/s; with cubic, 6-20 GB/s (bench/README.md). --loopback-cc NAME
// runs the whole benchmark (nginx, moto, the clients) in a network namespace of its own whose
// loopback uses NAME, leaving the machine's own setting alone (needs root: unshare(CLONE_NEWNET)).
#include <arpa/inet.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "../tests/support/net_ports.hpp"
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

/// A server run in the background, its output to log; stopped when destroyed, and when this
/// process dies in any way (testing::guarded_process: no nginx or moto left behind).
struct child {
  std::optional<testing::guarded_process> p;
  child(std::vector<std::string> argv, const fs::path& log) {
    try {
      p.emplace(std::move(argv), log);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
  bool wait_for_port(int port, int seconds) {
    for (int i = 0; p && i < seconds * 100; ++i) {
      if (testing::port_open(port)) return true;
      if (!p->running()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
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

/// The loopback ceiling: k threads, each with one socket to 127.0.0.1:port sending one GET of
/// an equal range of path (Connection: close) and recv'ing the answer into its own reused
/// buffer (bufs[i], 16 MiB), the body bytes counted. The total body bytes; 0 when an answer
/// is not the 206 of its range with exactly its bytes.
u64 plain_socket_read(int port, const std::string& path, u64 size, std::vector<std::vector<char>>& bufs,
                      std::byte* dst) {
  const unsigned k = static_cast<unsigned>(bufs.size());
  std::vector<u64> got(k, 0);
  std::vector<char> ok(k, 0);
  std::vector<std::thread> ts;
  for (unsigned i = 0; i < k; ++i)
    ts.emplace_back([&, i] {
      const u64 first = size * i / k, last = size * (i + 1) / k - 1;
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (fd < 0) return;
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<std::uint16_t>(port));
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return (void)::close(fd);
      const std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(port) +
                              "\r\nRange: bytes=" + std::to_string(first) + "-" + std::to_string(last) +
                              "\r\nConnection: close\r\n\r\n";
      if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size()))
        return (void)::close(fd);
      std::vector<char>& buf = bufs[i];
      std::string head;
      u64 body = 0;
      bool in_body = false;
      const u64 want_body = last - first + 1;
      for (;;) {
        if (in_body && dst) {  // straight into this range's place in dst, as a load lands its bytes
          if (body >= want_body) break;
          const ssize_t n =
              ::recv(fd, dst + first + body, static_cast<std::size_t>(std::min<u64>(want_body - body, 16 * MiB)), 0);
          if (n <= 0) break;
          body += u64(n);
          continue;
        }
        const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
        if (n <= 0) break;
        if (in_body) {
          body += u64(n);
          continue;
        }
        head.append(buf.data(), std::size_t(n));  // (once: the header and what came with it)
        const std::size_t end = head.find("\r\n\r\n");
        if (end == std::string::npos) continue;
        in_body = true;
        body = head.size() - (end + 4);
        if (dst) std::memcpy(dst + first, head.data() + end + 4, static_cast<std::size_t>(std::min(body, want_body)));
        head.resize(end);
      }
      ::close(fd);
      const std::string want =
          "Content-Range: bytes " + std::to_string(first) + "-" + std::to_string(last) + "/" + std::to_string(size);
      got[i] = body;
      ok[i] = head.starts_with("HTTP/1.1 206") && head.find(want) != std::string::npos && body == last - first + 1;
    });
  for (auto& t : ts) t.join();
  u64 total = 0;
  for (unsigned i = 0; i < k; ++i) {
    if (!ok[i]) return 0;
    total += got[i];
  }
  return total;
}

struct row {
  std::string name;
  bench::samples t;
  std::optional<u64> requests, body;
  double peak = 0;
  bool same = true;
  bool ceiling = false;      ///< a plain-socket row (its bytes: the rank file's)
  bool into_memory = false;  ///< a plain-socket row landing the bytes in distinct memory
};

/// The TCP congestion control of this process's network namespace ("?" where unreadable).
std::string congestion_control() {
  std::ifstream f("/proc/sys/net/ipv4/tcp_congestion_control");
  std::string cc;
  return std::getline(f, cc) && !cc.empty() ? cc : "?";
}

/// Moves this process into a network namespace of its own, brings its loopback up and sets its
/// congestion control to cc; the machine's namespace is untouched. Called before any thread or
/// child exists, so all of them (nginx, moto, the client threads) live in the new namespace.
bool private_loopback(const std::string& cc) {
  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "bench_remote: --loopback-cc: %s: %s\n", what.c_str(), std::strerror(errno));
    return false;
  };
  if (::unshare(CLONE_NEWNET) != 0) return fail("unshare(CLONE_NEWNET) (a network namespace of its own needs root)");
  const int s = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (s < 0) return fail("socket");
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  bool up = ::ioctl(s, SIOCGIFFLAGS, &ifr) == 0;
  if (up) {
    ifr.ifr_flags |= IFF_UP;
    up = ::ioctl(s, SIOCSIFFLAGS, &ifr) == 0;
  }
  ::close(s);
  if (!up) return fail("bringing lo up");
  std::ofstream f("/proc/sys/net/ipv4/tcp_congestion_control");
  errno = 0;
  f << cc << std::flush;
  const int e = errno;  // a namespace other than the machine's may only pick what the machine allows (EPERM)
  if (!f || congestion_control() != cc) {
    errno = e == EPERM ? EPERM : EINVAL;
    return fail("setting the congestion control to '" + cc +
                "' (it must be in /proc/sys/net/ipv4/tcp_available_congestion_control" +
                (e == EPERM ? ", and in the machine's tcp_allowed_congestion_control: echo \"$(cat "
                              "/proc/sys/net/ipv4/tcp_allowed_congestion_control) " +
                                  cc + "\" > /proc/sys/net/ipv4/tcp_allowed_congestion_control"
                            : std::string()) +
                ")");
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bench::args a(argc, argv);
  bench::accept_only(
      a,
      "Loads a checkpoint from nginx and moto_server on loopback against the local file system\n"
      "(bench/README.md).",
      {{"--quick", nullptr, "a 64 MiB checkpoint, one repetition (a smoke run)"},
       {"--mib", "N", "the checkpoint's size in MiB (default 1024)"},
       {"--reps", "N", "repetitions of the nginx and file rows (default 3)"},
       {"--moto-reps", "N", "repetitions of the moto rows (default 1)"},
       {"--no-moto", nullptr, "skip moto_server (its rows take most of the time)"},
       {"--loopback-cc", "NAME", "run in a network namespace whose loopback uses this TCP congestion control (root)"}});
  const std::string loopback_cc = a.get("--loopback-cc", "");
  if (!loopback_cc.empty() && !private_loopback(loopback_cc)) return 2;
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
  save(file_directory(www / "ckpt"), std::span<const flat_view>(views), comm);

  const int port = testing::free_port();
  {
    std::ofstream c(root / "nginx.conf");
    const std::string d = root.string();
    c << "worker_processes 2;\nuser root;\nerror_log " << d << "/error.log;\npid " << d << "/nginx.pid;\n"
      << "events { worker_connections 1024; }\nhttp {\n  default_type application/octet-stream;\n  access_log off;\n"
      << "  client_body_temp_path " << d << "/tmp/b; proxy_temp_path " << d << "/tmp/p; fastcgi_temp_path " << d
      << "/tmp/f; uwsgi_temp_path " << d << "/tmp/u; scgi_temp_path " << d << "/tmp/s;\n  keepalive_requests 100000;\n"
      << "  sendfile on;\n  server { listen 127.0.0.1:" << port << "; root " << www.string()
      << "; location / { } }\n}\n";
  }
  std::optional<child> nginx;
  nginx.emplace(std::vector<std::string>{"/usr/sbin/nginx", "-p", root.string(), "-c", (root / "nginx.conf").string(),
                                         "-g", "daemon off;"},
                root / "nginx.log");
  if (!nginx->wait_for_port(port, 5)) {
    std::fprintf(stderr, "nginx did not start\n");
    return 1;
  }

  std::vector<std::vector<std::byte>> out(n, std::vector<std::byte>(per));
  std::vector<flat_view> into;
  for (u64 i = 0; i < n; ++i)
    into.push_back({"t" + std::to_string(i), dtype::F32, {rows, cols}, std::nullopt, out[i].data(), per});
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
    const u64 req0 = client ? client->stats().requests.load() : 0,
              body0 = client ? client->stats().body_bytes.load() : 0;
    x.t = bench::time_reps(r, [&] { st = load(dir, std::span<const flat_view>(into)); });
    x.peak = bench::hwm_mib() - rss0;
    if (client) {
      x.requests = (client->stats().requests - req0) / u64(r);
      x.body = (client->stats().body_bytes - body0) / u64(r);
    }
    x.same = same_bytes();
    table.push_back(std::move(x));
  };

  const file_directory fd(www / "ckpt");
  load(fd, std::span<const flat_view>(into));  // warm the page cache
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
  // the loopback ceiling: plain sockets reading the rank file in 1, 2, 4 equal ranges, each
  // into a reused 16 MiB buffer (mostly cache-resident: what the loopback moves at best), then
  // in 2 and 4 ranges straight into one touched buffer of the file's size (distinct memory, as
  // a load lands its bytes: the ceiling a loader can reach), compared with the file after
  const fs::path rank_file = www / "ckpt" / "rank_0.safetensors";
  const u64 file_size = fs::file_size(rank_file);
  std::vector<std::byte> landed(file_size, std::byte{1});
  std::vector<std::byte> on_disk(file_size);
  file_directory(www / "ckpt").open("rank_0.safetensors").read_into(0, on_disk);
  struct ceiling_kind {
    unsigned conns;
    bool into_memory;
  };
  for (const auto [conns, into_memory] : {ceiling_kind{1, false}, {2, false}, {4, false}, {2, true}, {4, true}}) {
    std::vector<std::vector<char>> bufs(conns, std::vector<char>(16 * MiB, 1));
    row x;
    x.name = std::string(into_memory ? "plain sockets into memory" : "plain sockets (lo ceiling)") + ", " +
             std::to_string(conns) + (conns == 1 ? " connection" : " connections");
    x.ceiling = true;
    x.into_memory = into_memory;
    bench::reset_peak_rss();
    const double rss0 = bench::rss_mib();
    x.t = bench::time_reps(reps, [&] {
      x.same = x.same && plain_socket_read(port, "/ckpt/rank_0.safetensors", file_size, bufs,
                                           into_memory ? landed.data() : nullptr) == file_size;
    });
    if (into_memory) x.same = x.same && landed == on_disk;
    x.peak = bench::hwm_mib() - rss0;
    x.requests = conns;
    x.body = file_size;
    table.push_back(std::move(x));
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
      // moto assembles a multipart object in Python: completing a 1 GiB upload can take longer
      // than the default 30 s read timeout. A Complete whose answer timed out is now accepted
      // by its multipart ETag, but each timed-out try costs the timeout and moto's work again:
      // a generous timeout saves minutes (and the retried Complete path is taken only if moto
      // is slower still)
      o.http.read_timeout = std::chrono::seconds(180);
      try {
        s3_directory("s3://bench", o).create_bucket();
        const s3_directory sd("s3://bench/ckpt", o);
        const double t0 = bench::now_s();
        save(sd, std::span<const flat_view>(views), comm);
        moto_note =
            "saving the checkpoint to moto (multipart, 16 MiB parts): " + bench::fmt("%.1f s", bench::now_s() - t0);
        measure("s3_storage (moto_server, lo)", moto_reps, sd, &sd.client());
        aws_cp = timed_run({"aws", "s3", "cp", "--only-show-errors", "s3://bench/ckpt/rank_0.safetensors", "-"});
        aws_get = timed_run(
            {"aws", "s3api", "get-object", "--bucket", "bench", "--key", "ckpt/rank_0.safetensors", "/dev/null"});
      } catch (const std::exception& e) {
        moto_note = std::string("moto rows failed: ") + e.what();
      }
    }
  }
#endif
  std::error_code ec;
  fs::remove_all(root, ec);

  const double bytes = double(n * per);
  std::printf(
      "bench_remote: %llu MiB checkpoint (%llu tensors of 16 MiB, 1 rank file), best of %d (moto: %d), load %s\n",
      (unsigned long long)(n * per / MiB), (unsigned long long)n, reps, moto_reps, bench::loadavg().c_str());
  std::printf("loopback TCP congestion control: %s (%s)\n", congestion_control().c_str(),
              loopback_cc.empty() ? "the machine's own" : "a network namespace of this run's own, --loopback-cc");
  bench::table t(
      {"backend", "seconds", "GB/s", "x file", "requests", "body bytes", "bytes needed", "peak +MiB", "bytes"});
  const double file_best = table.front().t.best();
  // GB/s of the plain-socket rows are of the rank file's bytes (the tensors and the header)
  for (const auto& x : table)
    t.add({x.name, bench::fmt("%.3f", x.t.best()),
           bench::fmt("%.2f", (x.ceiling ? double(*x.body) : bytes) / x.t.best() / 1e9),
           bench::fmt("%.2f", file_best / x.t.best()), x.requests ? std::to_string(*x.requests) : "-",
           x.body ? std::to_string(*x.body) : "-",
           x.ceiling ? std::to_string(*x.body) : std::to_string(st.bytes_needed), bench::fmt("%.0f", x.peak),
           x.ceiling ? (x.same ? (x.into_memory ? "same" : "counted") : "WRONG")
           : x.same  ? "same"
                     : "DIFFERENT"});
  // the rank file holds the tensors and its header: GB/s of the CLI rows are of the tensor bytes, as the others
  if (aws_cp > 0)
    t.add({"aws s3 cp (moto ceiling, rank file)", bench::fmt("%.3f", aws_cp), bench::fmt("%.2f", bytes / aws_cp / 1e9),
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
  // the ceilings: the best plain-socket rows of each kind, in GB/s (their bytes are the rank file's)
  double http_best = 0;
  for (const auto& x : table)
    if (!x.ceiling && x.name.starts_with("http_storage")) http_best = std::max(http_best, bytes / x.t.best());
  for (const bool into_memory : {false, true}) {
    double ceiling = 0;
    std::string ceiling_name;
    for (const auto& x : table)
      if (x.ceiling && x.into_memory == into_memory && double(*x.body) / x.t.best() > ceiling) {
        ceiling = double(*x.body) / x.t.best();
        ceiling_name = x.name;
      }
    if (ceiling > 0)
      std::printf("http (16 in flight) / %s (%s, %.2f GB/s): %.2f%s; best http row: %.2f\n",
                  into_memory ? "loopback ceiling into memory" : "loopback ceiling, reused buffer",
                  ceiling_name.c_str(), ceiling / 1e9, bytes / table[1].t.best() / ceiling,
                  into_memory ? " (target >= 0.8)" : "", http_best / ceiling);
  }
  return same ? 0 : 1;
}
