// tests/support/servers.hpp - servers the remote-storage tests start on 127.0.0.1 and stop after:
// a child process (nginx, moto_server, tests/fault_proxy.py) on a free port; a small
// misbehaving HTTP server run on a thread of the test, whose answers follow a script (faults
// first, then correct); a raw server whose every answer is bytes the test gives (malformed
// ones); and the 2-rank checkpoint the remote tests serve. Every one is an object whose
// destructor stops it, so a failed REQUIRE (an exception) stops it too.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "net_ports.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "test_util.hpp"
#include "thread_world.hpp"

namespace testing {

/// A program run in the background, stdout and stderr to child.log in `log_dir`; stopped
/// (SIGTERM, after 5 s SIGKILL, its whole process group) and reaped when destroyed, and also
/// when the test process dies in any way (SIGKILL, abort): see guarded_process (net_ports.hpp).
class child_process {
 public:
  child_process(std::vector<std::string> argv, const std::filesystem::path& log_dir) : log_(log_dir / "child.log") {
    try {
      p_ = std::make_unique<guarded_process>(std::move(argv), log_);
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
  }
  child_process(const child_process&) = delete;

  /// The program's process id (also its process group's); its guard's.
  pid_t pid() const noexcept { return p_->pid(); }
  pid_t guard_pid() const noexcept { return p_->guard_pid(); }

  /// Waits until the program accepts connections on port (it must not exit first).
  void wait_for_port(int port, std::chrono::seconds limit = std::chrono::seconds(30)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!port_open(port)) {
      REQUIRE_MESSAGE(p_->running(), "the server exited: ", slurp(log_));
      REQUIRE_MESSAGE(std::chrono::steady_clock::now() < until, "the server did not listen: ", slurp(log_));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  /// Waits until the program itself listens on port (listens_on: not another process that
  /// took the port between free_port() and the program's bind); false when the program exits
  /// first (it could not bind: try another port).
  bool serves_on(int port, std::chrono::seconds limit = std::chrono::seconds(30)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!(port_open(port) && listens_on(p_->pid(), port))) {
      if (!p_->running()) return false;
      REQUIRE_MESSAGE(std::chrono::steady_clock::now() < until, "the server did not listen on ", port, ": ",
                      slurp(log_));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }
  std::string log() const { return slurp(log_); }

 private:
  std::filesystem::path log_;
  std::unique_ptr<guarded_process> p_;
};

/// A server started on a free port of 127.0.0.1 (argv_for(port) gives its command line; its log
/// in log_dir): a port another process took before the server could bind it is given up for
/// another (five tries).
template <class ArgvFor>
std::unique_ptr<child_process> start_server(int& port, ArgvFor&& argv_for, const std::filesystem::path& log_dir,
                                            std::chrono::seconds limit = std::chrono::seconds(30)) {
  std::string last;
  for (int attempt = 0; attempt < 5; ++attempt) {
    port = free_port();
    auto p = std::make_unique<child_process>(argv_for(port), log_dir);
    if (p->serves_on(port, limit)) return p;
    last = p->log();
  }
  FAIL("the server exited on five ports in a row; its last log: " << last);
  return nullptr;
}

/// A test CA and a certificate for 127.0.0.1 (and localhost) that it signed, made with the
/// openssl command: ca.pem, server.pem, server.key in dir.
inline void make_test_certificates(const std::filesystem::path& dir) {
  const std::string d = dir.string();
  auto run = [](std::vector<std::string> args) {
    const auto r = run_program("openssl", args);
    REQUIRE_MESSAGE((r.exited && r.code == 0), "openssl failed: ", r.err);
  };
  run({"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", d + "/ca.key", "-out", d + "/ca.pem", "-days", "2",
       "-subj", "/CN=shardsafe test CA"});
  run({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", d + "/server.key", "-out", d + "/server.csr", "-subj",
       "/CN=127.0.0.1"});
  write_file(dir / "ext.cnf", "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
  run({"x509", "-req", "-in", d + "/server.csr", "-CA", d + "/ca.pem", "-CAkey", d + "/ca.key", "-CAcreateserial",
       "-out", d + "/server.pem", "-days", "2", "-extfile", d + "/ext.cnf"});
}

/// nginx serving the folder www/ of a temporary directory on 127.0.0.1:port, with range
/// requests and keep-alive as shipped, and an access log of each request's bytes; over TLS
/// with a certificate from make_test_certificates when tls is true (the CA: ca_file()).
struct nginx_server {
  temp_dir dir{"nginx"};
  std::filesystem::path www = dir.path / "www";
  int port = 0;
  bool tls = false;
  std::unique_ptr<child_process> proc;

  explicit nginx_server(bool with_tls = false) : tls(with_tls) {
    if (tls) make_test_certificates(dir.path);
    std::filesystem::create_directories(www);
    std::filesystem::create_directories(dir.path / "tmp");
    const std::string d = dir.str();
    proc = start_server(
        port,
        [&](int p) {
          write_file(
              dir.path / "nginx.conf",
              "worker_processes 1;\n"
              "user root;\n"
              "error_log " +
                  d +
                  "/error.log;\n"
                  "pid " +
                  d +
                  "/nginx.pid;\n"
                  "events { worker_connections 512; }\n"
                  "http {\n"
                  "  default_type application/octet-stream;\n"
                  "  log_format bytes '$request_method $uri $http_range $status $body_bytes_sent';\n"
                  "  access_log " +
                  d +
                  "/access.log bytes;\n"
                  "  client_body_temp_path " +
                  d + "/tmp/body; proxy_temp_path " + d +
                  "/tmp/proxy;\n"
                  "  fastcgi_temp_path " +
                  d + "/tmp/fcgi; uwsgi_temp_path " + d + "/tmp/uwsgi; scgi_temp_path " + d +
                  "/tmp/scgi;\n"
                  "  keepalive_requests 100000;\n"
                  "  server {\n"
                  "    listen 127.0.0.1:" +
                  std::to_string(p) + (tls ? " ssl" : "") + ";\n" +
                  (tls ? "    ssl_certificate " + d + "/server.pem;\n    ssl_certificate_key " + d + "/server.key;\n"
                       : std::string()) +
                  "    root " + www.string() +
                  ";\n"
                  "    location / { }\n"
                  "  }\n"
                  "}\n");
          return std::vector<std::string>{"/usr/sbin/nginx", "-p", d, "-c", d + "/nginx.conf", "-g", "daemon off;"};
        },
        dir.path);
  }
  std::string url(const std::string& path = "") const {
    return (tls ? "https://127.0.0.1:" : "http://127.0.0.1:") + std::to_string(port) + "/" + path;
  }
  std::string ca_file() const { return (dir.path / "ca.pem").string(); }
};

/// The one nginx (of each kind: plain or TLS) of a test binary, started by the first case that
/// asks and stopped when the binary exits (and by guarded_process if it dies).
inline nginx_server& shared_nginx(bool tls = false) {
  static std::unique_ptr<nginx_server> servers[2];
  auto& s = servers[tls ? 1 : 0];
  if (!s) s = std::make_unique<nginx_server>(tls);
  return *s;
}

/// A test case's own folder on the binary's shared nginx: www (a fresh folder, removed
/// afterwards) served at url(); port and ca_file() the server's.
struct nginx_site {
  nginx_server& server;
  std::string name;
  std::filesystem::path www;
  int port;

  explicit nginx_site(bool tls = false)
      : server(shared_nginx(tls)), name(next_name()), www(server.www / name), port(server.port) {
    std::filesystem::create_directories(www);
  }
  nginx_site(const nginx_site&) = delete;
  ~nginx_site() {
    std::error_code ec;
    std::filesystem::remove_all(www, ec);
  }
  std::string url(const std::string& path = "") const { return server.url(name + "/" + path); }
  std::string ca_file() const { return server.ca_file(); }

 private:
  static std::string next_name() {
    static int n = 0;
    return "site" + std::to_string(++n);
  }
};

/// How the scripted server answers one GET (HEAD is always answered correctly).
enum class fault {
  none,                 ///< 206 with the bytes asked for
  ignore_range,         ///< 200 with the whole object
  wrong_content_range,  ///< 206, Content-Range shifted by one byte (the bytes of the shifted range)
  short_body,           ///< 206 announcing all the bytes, half of them sent, then the connection closed
  long_content_length,  ///< 206, Content-Length one more than the range (one extra byte sent)
  status_503,           ///< 503 with Retry-After: 1
  status_429,           ///< 429 without Retry-After
  redirect,             ///< 302 to /moved/PATH (served like any path)
  stall,                ///< nothing for 1 s, then the connection closed
};

/// A listening TCP socket on 127.0.0.1 at a free port (set in port); its descriptor.
inline int listen_on_loopback(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  port = ntohs(a.sin_port);
  REQUIRE(::listen(fd, 64) == 0);
  return fd;
}

/// An HTTP/1.1 server on 127.0.0.1 serving one object, `body`, at any path: each GET takes
/// the next fault of the script (none once it is empty). Keeps a log of the Range headers.
class scripted_server {
 public:
  /// head_length false: HEAD answers without Content-Length (chunked), so the size must come
  /// from a GET's Content-Range.
  explicit scripted_server(std::string body, bool head_length = true)
      : body_(std::move(body)), head_length_(head_length) {
    listen_fd_ = listen_on_loopback(port_);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~scripted_server() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    acceptor_.join();
    {
      std::lock_guard lock(m_);
      for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : workers_) t.join();
    for (int fd : open_) ::close(fd);
  }
  std::string url(const std::string& path = "obj") const {
    return "http://127.0.0.1:" + std::to_string(port_) + "/" + path;
  }
  void script(std::vector<fault> f) {
    std::lock_guard lock(m_);
    script_.assign(f.begin(), f.end());
  }
  std::vector<std::string> ranges() {
    std::lock_guard lock(m_);
    return ranges_;
  }
  int gets() {
    std::lock_guard lock(m_);
    return static_cast<int>(ranges_.size());
  }

 private:
  void accept_loop() {
    for (;;) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      std::lock_guard lock(m_);
      open_.push_back(fd);
      workers_.emplace_back([this, fd] { serve(fd); });
    }
  }
  static bool send_all(int fd, const std::string& s) {
    std::size_t at = 0;
    while (at < s.size()) {
      const ssize_t n = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
      if (n <= 0) return false;
      at += static_cast<std::size_t>(n);
    }
    return true;
  }
  void serve(int fd) {
    std::string in;
    char buf[4096];
    for (;;) {
      std::size_t end;
      while ((end = in.find("\r\n\r\n")) == std::string::npos) {
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) return;
        in.append(buf, static_cast<std::size_t>(n));
      }
      const std::string head = in.substr(0, end);
      in.erase(0, end + 4);
      if (!answer(fd, head)) {
        ::shutdown(fd, SHUT_RDWR);
        return;
      }
    }
  }
  /// Answers one request; false closes the connection.
  bool answer(int fd, const std::string& head) {
    const std::size_t total = body_.size();
    if (head.rfind("HEAD ", 0) == 0)
      return send_all(fd, head_length_ ? "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(total) + "\r\n\r\n"
                                       : std::string("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"));
    std::uint64_t first = 0, last = total - 1;
    std::string range;
    if (const std::size_t r = head.find("\r\nRange: bytes="); r != std::string::npos) {
      range = head.substr(r + 15, head.find("\r\n", r + 2) - r - 15);
      first = std::stoull(range.substr(0, range.find('-')));
      last = std::stoull(range.substr(range.find('-') + 1));
    }
    fault f = fault::none;
    {
      std::lock_guard lock(m_);
      ranges_.push_back(range);
      if (!script_.empty()) {
        f = script_.front();
        script_.pop_front();
      }
    }
    auto part = [&](std::uint64_t a, std::uint64_t b) { return body_.substr(a, b - a + 1); };
    auto partial = [&](std::uint64_t a, std::uint64_t b, std::uint64_t cl, const std::string& bytes) {
      return "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes " + std::to_string(a) + "-" + std::to_string(b) +
             "/" + std::to_string(total) + "\r\nContent-Length: " + std::to_string(cl) + "\r\n\r\n" + bytes;
    };
    switch (f) {
      case fault::none: return send_all(fd, partial(first, last, last - first + 1, part(first, last)));
      case fault::ignore_range:
        return send_all(fd, "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(total) + "\r\n\r\n" + body_);
      case fault::wrong_content_range: {
        const std::uint64_t a = first + 1, b = std::min<std::uint64_t>(last + 1, total - 1);
        return send_all(fd, partial(a, b, b - a + 1, part(a, b)));
      }
      case fault::short_body: {
        const std::string all = partial(first, last, last - first + 1, part(first, last));
        send_all(fd, all.substr(0, all.size() - (last - first + 1) / 2));
        return false;
      }
      case fault::long_content_length: {
        const std::uint64_t b = std::min<std::uint64_t>(last + 1, total - 1);
        return send_all(fd, partial(first, last, last - first + 2, part(first, b))) && false;
      }
      case fault::status_503:
        return send_all(fd, "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nbusy");
      case fault::status_429: return send_all(fd, "HTTP/1.1 429 Too Many Requests\r\nContent-Length: 4\r\n\r\nslow");
      case fault::redirect: {
        const std::size_t sp = head.find(' '), sp2 = head.find(' ', sp + 1);
        return send_all(fd, "HTTP/1.1 302 Found\r\nLocation: /moved" + head.substr(sp + 1, sp2 - sp - 1) +
                                "\r\nContent-Length: 0\r\n\r\n");
      }
      case fault::stall: std::this_thread::sleep_for(std::chrono::seconds(1)); return false;
    }
    return false;
  }

  std::string body_;
  bool head_length_ = true;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  std::mutex m_;
  std::vector<int> open_;
  std::vector<std::thread> workers_;
  std::deque<fault> script_;
  std::vector<std::string> ranges_;
};

/// tests/fault_proxy.py on a free port in front of the server at 127.0.0.1:upstream_port,
/// injecting the faults of a seeded schedule (see the script); faults() lists those injected.
struct fault_proxy {
  temp_dir dir{"proxy"};
  int port = 0;
  std::unique_ptr<child_process> proc;

  /// extra: more arguments of the script (--faults, --stall, --kill-parts-after).
  fault_proxy(int upstream_port, std::uint64_t seed, double rate, std::vector<std::string> extra = {}) {
    proc = start_server(
        port,
        [&](int p) {
          std::vector<std::string> argv{
              "python3",    (std::filesystem::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fault_proxy.py").string(),
              "--port",     std::to_string(p),
              "--upstream", "127.0.0.1:" + std::to_string(upstream_port),
              "--seed",     std::to_string(seed),
              "--rate",     std::to_string(rate),
              "--log",      (dir.path / "faults.log").string()};
          argv.insert(argv.end(), extra.begin(), extra.end());
          return argv;
        },
        dir.path);
  }
  std::string url(const std::string& path = "") const {
    return "http://127.0.0.1:" + std::to_string(port) + "/" + path;
  }
  /// The faults injected so far, one "FAULT METHOD TARGET RANGE" line each.
  std::vector<std::string> faults() const {
    std::vector<std::string> out;
    std::istringstream in(std::filesystem::exists(dir.path / "faults.log") ? slurp(dir.path / "faults.log")
                                                                           : std::string());
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(line);
    return out;
  }
};

/// An HTTP server on 127.0.0.1 that answers every request with the bytes answer(request head)
/// gives, then closes the connection: for answers no real server would send. Counts requests.
class raw_server {
 public:
  explicit raw_server(std::function<std::string(const std::string&)> answer) : answer_(std::move(answer)) {
    listen_fd_ = listen_on_loopback(port_);
    thread_ = std::thread([this] {
      for (;;) {
        const int fd = ::accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) return;
        std::string in;
        char buf[4096];
        while (in.find("\r\n\r\n") == std::string::npos) {
          const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
          if (n <= 0) break;
          in.append(buf, static_cast<std::size_t>(n));
        }
        if (in.find("\r\n\r\n") != std::string::npos) {
          const std::string head = in.substr(0, in.find("\r\n\r\n"));
          {
            std::lock_guard lock(m_);
            heads_.push_back(head);
          }
          const std::string out = answer_(head);
          for (std::size_t at = 0; at < out.size();) {
            const ssize_t n = ::send(fd, out.data() + at, out.size() - at, MSG_NOSIGNAL);
            if (n <= 0) break;
            at += static_cast<std::size_t>(n);
          }
        }
        // until the client closes, at most 300 ms (closing with unread bytes would send an RST
        // that can overtake the answer)
        ::shutdown(fd, SHUT_WR);
        timeval tv{0, 300'000};
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        while (::recv(fd, buf, sizeof buf, 0) > 0) {
        }
        ::close(fd);
      }
    });
  }
  raw_server(const raw_server&) = delete;
  ~raw_server() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    thread_.join();
  }
  std::string url(const std::string& path = "obj") const {
    return "http://127.0.0.1:" + std::to_string(port_) + "/" + path;
  }
  int port() const noexcept { return port_; }
  /// The heads of the requests answered so far (request line and headers).
  std::vector<std::string> heads() {
    std::lock_guard lock(m_);
    return heads_;
  }
  int requests() { return static_cast<int>(heads().size()); }

 private:
  std::function<std::string(const std::string&)> answer_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::mutex m_;
  std::vector<std::string> heads_;
  std::thread thread_;
};

/// A 2-rank checkpoint (w: F32 [64, 30] in row halves; e: BF16 [10, 8] in column halves, their
/// bytes from seeds seed and seed + 1) saved by a world of 2 threads into each of dirs.
template <shardsafe::WritableDirectory... Ds>
void save_two_rank_checkpoint(std::uint64_t seed, const Ds&... dirs) {
  using namespace shardsafe;
  const std::string w = random_bytes(64 * 30 * 4, seed), e = random_bytes(10 * 8 * 2, seed + 1);
  auto thrown = run_ranks(2, [&](thread_comm& comm) {
    const std::uint64_t r = static_cast<std::uint64_t>(comm.rank());
    std::string wm = w.substr(r * 32 * 30 * 4, 32 * 30 * 4), em;
    for (std::uint64_t row = 0; row < 10; ++row) em += e.substr((row * 8 + r * 4) * 2, 4 * 2);
    std::vector<flat_view> v{{"w",
                              dtype::F32,
                              {64, 30},
                              shard_spec(block_spec({32, 30}, {32 * r, 0})),
                              reinterpret_cast<std::byte*>(wm.data()),
                              wm.size()},
                             {"e",
                              dtype::BF16,
                              {10, 8},
                              shard_spec(block_spec({10, 4}, {0, 4 * r})),
                              reinterpret_cast<std::byte*>(em.data()),
                              em.size()}};
    (save(dirs, std::span<const flat_view>(v), comm), ...);
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
}

}  // namespace testing
