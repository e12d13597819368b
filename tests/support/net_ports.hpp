// tests/support/net_ports.hpp - what the remote tests and bench_remote need to run servers on
// 127.0.0.1: a free port, whether one is listened on, and a server process that dies with the
// process that started it (guarded_process). No doctest (the benchmark includes it).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

extern char** environ;

namespace testing {

/// A port on 127.0.0.1 nothing listened on a moment ago (bind to port 0, read it, close).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("free_port: socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("free_port: cannot bind a port of 127.0.0.1");
  return ntohs(a.sin_port);
}

/// The contents of a small file (a /proc table); empty when it cannot be read.
inline std::string read_small_file(const char* path) {
  std::string out;
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return out;
}

/// Whether something accepts connections on 127.0.0.1:port.
inline bool port_open(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

/// Whether process `pid` itself holds the socket that listens on 127.0.0.1:port (or on any
/// address of that port): the listening socket's inode from /proc/net/tcp, found among the
/// process's descriptors. A server started on a port chosen by free_port() checks this, for
/// between choosing and binding another process may have taken the port.
inline bool listens_on(pid_t pid, int port) {
  std::vector<std::string> inodes;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream in(read_small_file(table));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, st, queues, tr, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> st >> queues >> tr >> retr >> uid >> timeout >> inode;
      const auto colon = local.rfind(':');
      if (st != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) inodes.push_back("socket:[" + inode + "]");
    }
  }
  if (inodes.empty()) return false;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    std::error_code lec;
    const auto target = std::filesystem::read_symlink(fd.path(), lec).string();
    for (const auto& i : inodes)
      if (!lec && target == i) return true;
  }
  return false;
}

/// A program run in the background (stdin /dev/null, stdout and stderr to a log file) that
/// cannot outlive the process that started it: stopped (SIGTERM to its process group, after
/// 5 s SIGKILL) and reaped when destroyed, and also when the starting process dies in any way
/// (SIGKILL, abort, a signal from ^C), so that no server of a crashed test is left running.
///
/// How: a guard process (a fork that runs only async-signal-safe calls) starts the program in
/// a process group of its own (nginx's workers go with their master) and waits on a pipe whose
/// only writer is the starting process (the write end is close-on-exec, and the guard closes
/// every other descriptor it inherited, other guards' pipes among them). At end-of-file (the
/// destructor closed the pipe, or the kernel did as the starting process died) the guard stops
/// the group and exits. It ignores SIGINT and SIGTERM (a ^C reaches the starting process's
/// group, not the program's: that process dies and the pipe closes), and it exits, killing
/// what is left of the group, when the program exits on its own. Throws std::runtime_error
/// when the program cannot be started.
class guarded_process {
 public:
  guarded_process(std::vector<std::string> argv, const std::filesystem::path& log) {
    if (argv.empty()) throw std::runtime_error("guarded_process: no program");
    // everything the forked processes need is made before fork (no allocation after it)
    std::string exe = argv[0];
    if (exe.find('/') == std::string::npos) {
      const char* path = std::getenv("PATH");
      std::istringstream dirs(path ? path : "/usr/bin:/bin");
      for (std::string d; std::getline(dirs, d, ':');)
        if (!d.empty() && ::access((d + "/" + exe).c_str(), X_OK) == 0) {
          exe = d + "/" + exe;
          break;
        }
    }
    if (::access(exe.c_str(), X_OK) != 0)
      throw std::runtime_error("cannot start " + argv[0] + ": not found or not executable");
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int alive[2] = {-1, -1}, info[2] = {-1, -1};
    if (in < 0 || out < 0 || ::pipe2(alive, O_CLOEXEC) != 0 || ::pipe2(info, O_CLOEXEC) != 0) {
      for (int fd : {in, out, alive[0], alive[1], info[0], info[1]})
        if (fd >= 0) ::close(fd);
      throw std::runtime_error("cannot start " + argv[0] + ": cannot open " + log.string() + " or make pipes");
    }
    const pid_t guard = ::fork();
    if (guard == 0) run_guard(exe.c_str(), args.data(), in, out, alive[0], info[1]);  // never returns
    ::close(alive[0]);
    ::close(info[1]);
    ::close(in);
    ::close(out);
    if (guard < 0) {
      ::close(alive[1]);
      ::close(info[0]);
      throw std::runtime_error("cannot start " + argv[0] + ": fork failed");
    }
    guard_ = guard;
    alive_fd_ = alive[1];
    pid_t server = -1;
    ssize_t n;
    while ((n = ::read(info[0], &server, sizeof server)) < 0 && errno == EINTR) {
    }
    ::close(info[0]);
    if (n != static_cast<ssize_t>(sizeof server) || server <= 0) {
      stop();
      throw std::runtime_error("cannot start " + argv[0] + ": the guard process could not fork");
    }
    pid_ = server;
  }
  guarded_process(const guarded_process&) = delete;
  guarded_process& operator=(const guarded_process&) = delete;
  ~guarded_process() { stop(); }

  /// The program's process id (also its process group's id); its guard's.
  pid_t pid() const noexcept { return pid_; }
  pid_t guard_pid() const noexcept { return guard_; }
  /// Whether the program has not exited (the guard exits with it).
  bool running() {
    int status = 0;
    if (guard_ <= 0) return false;
    if (::waitpid(guard_, &status, WNOHANG) == 0) return true;
    guard_ = -1;
    return false;
  }
  /// Stops the program (its group) and waits until it and its guard are gone.
  void stop() {
    if (alive_fd_ >= 0) ::close(std::exchange(alive_fd_, -1));  // end-of-file: the guard stops the group
    if (guard_ > 0) {
      int status = 0;
      while (::waitpid(guard_, &status, 0) < 0 && errno == EINTR) {
      }
      guard_ = -1;
    }
  }

 private:
  /// The guard (see the class comment); async-signal-safe calls only.
  [[noreturn]] static void run_guard(const char* exe, char* const* args, int in, int out, int alive, int info) {
    ::signal(SIGINT, SIG_IGN);
    ::signal(SIGTERM, SIG_IGN);
    ::signal(SIGPIPE, SIG_IGN);
    for (int fd = 3; fd < 65536; ++fd)  // inherited descriptors: other guards' pipes above all
      if (fd != in && fd != out && fd != alive && fd != info) ::close(fd);
    const pid_t server = ::fork();
    if (server == 0) {
      ::setpgid(0, 0);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
      ::dup2(in, 0);
      ::dup2(out, 1);
      ::dup2(out, 2);
      ::execve(exe, args, environ);
      ::_exit(127);
    }
    if (server > 0) ::setpgid(server, server);  // here too: no window where kill(-server) misses
    ::close(in);
    ::close(out);
    const pid_t said = server > 0 ? server : -1;
    (void)!::write(info, &said, sizeof said);
    ::close(info);
    if (server <= 0) ::_exit(1);
    int status = 0;
    bool exited = false;
    for (;;) {  // until the pipe closes or the program exits
      pollfd p{alive, POLLIN, 0};
      const int r = ::poll(&p, 1, 100);
      if (::waitpid(server, &status, WNOHANG) == server) {
        exited = true;
        break;
      }
      if (r > 0) {
        char c;
        if (::read(alive, &c, 1) <= 0) break;  // end-of-file (nothing is ever written)
      }
    }
    if (!exited) {
      ::kill(-server, SIGTERM);
      for (int i = 0; i < 100 && !exited; ++i) {  // 5 s, then SIGKILL
        if (::waitpid(server, &status, WNOHANG) == server) {
          exited = true;
        } else {
          timespec t{0, 50'000'000};
          ::nanosleep(&t, nullptr);
        }
      }
    }
    ::kill(-server, SIGKILL);  // what is left of the group (workers of a master that exited)
    if (!exited) ::waitpid(server, &status, 0);
    ::_exit(0);
  }

  pid_t pid_ = -1;
  pid_t guard_ = -1;
  int alive_fd_ = -1;
};

}  // namespace testing
