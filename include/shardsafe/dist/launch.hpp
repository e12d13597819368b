// shardsafe/dist/launch.hpp - start a world of local processes, as torchrun does on one host.
//
// local_world starts `n` copies of a program with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT set (a free port on 127.0.0.1 unless given), lets the caller watch them,
// kill them, and collect their exit codes. A rank may be started through a wrapper command
// (launch_options::wrap: e.g. `ip netns exec NODE`, to place it on a node of
// scripts/cluster.sh's cluster). POSIX only; no LibTorch needed.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/posix.hpp"

extern char** environ;

namespace shardsafe {

/// A TCP port on 127.0.0.1 that was free a moment ago.
inline int free_local_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail_errno(errno, "free_local_port: socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int e = errno;
    ::close(fd);
    fail_errno(e, "free_local_port: bind");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

struct launch_options {
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                              ///< 0: a free port
  std::map<std::string, std::string> env;           ///< more variables for every rank
  std::optional<std::filesystem::path> stderr_dir;  ///< rank R's stderr to DIR/rankR.err (else inherited)
  /// Rank r runs `wrap(r)... program args...` when set and not empty for r (its first word
  /// looked up in PATH), e.g. {"ip", "netns", "exec", "c-n1"}; the wrapper must exec the program
  /// (so that the rank's process is the program: kill_all reaches it).
  std::function<std::vector<std::string>(int rank)> wrap;
  /// LOCAL_RANK of rank r (default r: one host); e.g. r % ranks_per_node on a cluster
  std::function<int(int rank)> local_rank;
};

/// A running world of local processes.
class local_world {
 public:
  local_world(const std::string& program, const std::vector<std::string>& args, int n, launch_options opt = {})
      : opt_(std::move(opt)) {
    if (n < 1) fail(errc::invalid_argument, "local_world: world size must be at least 1");
    if (opt_.master_port == 0) opt_.master_port = free_local_port();
    std::map<std::string, std::string> base;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      auto eq = kv.find('=');
      if (eq != std::string::npos) base[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : opt_.env) base[k] = v;
    base["WORLD_SIZE"] = std::to_string(n);
    base["MASTER_ADDR"] = opt_.master_addr;
    base["MASTER_PORT"] = std::to_string(opt_.master_port);
    if (opt_.stderr_dir) std::filesystem::create_directories(*opt_.stderr_dir);
    for (int r = 0; r < n; ++r) {
      auto env = base;
      env["RANK"] = std::to_string(r);
      env["LOCAL_RANK"] = std::to_string(opt_.local_rank ? opt_.local_rank(r) : r);
      std::vector<std::string> kvs;
      for (const auto& [k, v] : env) kvs.push_back(k + "=" + v);
      const std::vector<char*> envp = detail::c_string_array(kvs);
      std::vector<std::string> argv_s = opt_.wrap ? opt_.wrap(r) : std::vector<std::string>{};
      const bool wrapped = !argv_s.empty();
      argv_s.push_back(program);
      argv_s.insert(argv_s.end(), args.begin(), args.end());
      const std::vector<char*> argv = detail::c_string_array(argv_s);
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      std::string errpath;
      if (opt_.stderr_dir) {
        errpath = (*opt_.stderr_dir / ("rank" + std::to_string(r) + ".err")).string();
        posix_spawn_file_actions_addopen(&fa, 2, errpath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      }
      pid_t pid;
      const int rc = wrapped ? posix_spawnp(&pid, argv_s[0].c_str(), &fa, nullptr, argv.data(), envp.data())
                             : posix_spawn(&pid, program.c_str(), &fa, nullptr, argv.data(), envp.data());
      posix_spawn_file_actions_destroy(&fa);
      if (rc != 0) {
        kill_all(SIGKILL);
        wait();
        fail_errno(rc, "local_world: cannot start " + argv_s[0] + " (rank " + std::to_string(r) + ")");
      }
      pids_.push_back(pid);
      status_.push_back(-1);
    }
  }
  local_world(const local_world&) = delete;
  local_world& operator=(const local_world&) = delete;
  ~local_world() {
    kill_all(SIGKILL);
    wait();
  }

  int size() const noexcept { return static_cast<int>(pids_.size()); }
  int master_port() const noexcept { return opt_.master_port; }

  /// Reaps ranks that ended; true when all have.
  bool poll() {
    bool all = true;
    for (std::size_t r = 0; r < pids_.size(); ++r) {
      if (status_[r] != -1) continue;
      int st = 0;
      if (::waitpid(pids_[r], &st, WNOHANG) == pids_[r])
        status_[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      else
        all = false;
    }
    return all;
  }

  /// Waits for every rank, at most `timeout` (then kills the rest with SIGKILL and marks
  /// them 124). Returns each rank's exit code, or 128 + signal.
  const std::vector<int>& wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
    const auto deadline =
        timeout ? std::chrono::steady_clock::now() + *timeout : std::chrono::steady_clock::time_point::max();
    while (!poll()) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill_all(SIGKILL);
        for (std::size_t r = 0; r < pids_.size(); ++r)
          if (status_[r] == -1) {
            int st;
            ::waitpid(pids_[r], &st, 0);
            status_[r] = 124;
          }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return status_;
  }

  /// Sends sig to rank r if it still runs.
  void kill_rank(int r, int sig) {
    if (r >= 0 && r < size() && status_[static_cast<std::size_t>(r)] == -1)
      ::kill(pids_[static_cast<std::size_t>(r)], sig);
  }
  /// Rank r's process id.
  pid_t pid(int r) const { return pids_.at(static_cast<std::size_t>(r)); }

  /// Sends sig to every rank still running.
  void kill_all(int sig) {
    for (std::size_t r = 0; r < pids_.size(); ++r)
      if (status_[r] == -1) ::kill(pids_[r], sig);
  }

 private:
  launch_options opt_;
  std::vector<pid_t> pids_;
  std::vector<int> status_;
};

}  // namespace shardsafe
