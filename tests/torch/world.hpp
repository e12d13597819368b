// tests/torch/world.hpp - real multi-process c10d worlds on localhost for the tests.
//
// A test calls run_world("scenario", n, args): the test binary starts itself n times with
// RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), SHARDSAFE_WORKER and
// SHARDSAFE_WORKER_ARGS set; torch_main.cpp sees SHARDSAFE_WORKER and runs the scenario
// registered under that name instead of doctest. Each worker's exit code and stderr come
// back to the test.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace testing {

using scenario_fn = std::function<int(const std::vector<std::string>& args)>;

inline std::map<std::string, scenario_fn>& scenarios() {
  static std::map<std::string, scenario_fn> s;
  return s;
}

struct scenario_registrar {
  scenario_registrar(const char* name, scenario_fn f) { scenarios()[name] = std::move(f); }
};

#define SHARDSAFE_CAT2(a, b) a##b
#define SHARDSAFE_CAT(a, b) SHARDSAFE_CAT2(a, b)
/// Defines a worker scenario: int body(const std::vector<std::string>& args).
#define WORKER_SCENARIO(name)                                                                    \
  static int SHARDSAFE_CAT(worker_fn_, __LINE__)(const std::vector<std::string>& args);          \
  static ::testing::scenario_registrar SHARDSAFE_CAT(worker_reg_, __LINE__)(name, SHARDSAFE_CAT(worker_fn_, __LINE__)); \
  static int SHARDSAFE_CAT(worker_fn_, __LINE__)([[maybe_unused]] const std::vector<std::string>& args)

inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("free_port: cannot bind");
  int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

inline std::string join_args(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += a + '\x1f';
  return s;
}

inline std::vector<std::string> split_args(const char* s) {
  std::vector<std::string> out;
  if (!s) return out;
  std::string cur;
  for (const char* p = s; *p; ++p) {
    if (*p == '\x1f') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *p;
    }
  }
  return out;
}

struct world_result {
  std::vector<int> status;       ///< exit code per rank (128 + signal if killed)
  std::vector<std::string> err;  ///< stderr per rank
  bool ok() const {
    for (int s : status)
      if (s != 0) return false;
    return true;
  }
  std::string report() const {
    std::ostringstream o;
    for (std::size_t r = 0; r < status.size(); ++r) o << "--- rank " << r << " exit " << status[r] << "\n" << err[r];
    return o.str();
  }
};

/// Starts `n` ranks of scenario `name` and waits (at most timeout) for all of them.
inline world_result run_world(const std::string& name, int n, const std::vector<std::string>& args = {},
                              std::chrono::seconds timeout = std::chrono::seconds(240),
                              std::map<std::string, std::string> extra_env = {}) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const int port = free_port();
  const auto logdir = std::filesystem::temp_directory_path() /
                      ("shardsafe-world-" + std::to_string(::getpid()) + "-" + std::to_string(port));
  std::filesystem::create_directories(logdir);
  std::vector<pid_t> pids(n);
  for (int r = 0; r < n; ++r) {
    std::map<std::string, std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = std::to_string(n);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    env["SHARDSAFE_WORKER"] = name;
    env["SHARDSAFE_WORKER_ARGS"] = join_args(args);
    env["OMP_NUM_THREADS"] = "1";
    for (const auto& [k, v] : extra_env) env[k] = v;
    std::vector<std::string> kvs;
    for (const auto& [k, v] : env) kvs.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : kvs) envp.push_back(s.data());
    envp.push_back(nullptr);
    const std::string errpath = (logdir / ("rank" + std::to_string(r) + ".err")).string();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, errpath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::string arg0 = self;
    char* argv[] = {arg0.data(), nullptr};
    if (posix_spawn(&pids[r], self.c_str(), &fa, nullptr, argv, envp.data()) != 0)
      throw std::runtime_error("run_world: posix_spawn failed");
    posix_spawn_file_actions_destroy(&fa);
  }
  world_result res;
  res.status.assign(n, -1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (res.status[r] != -1) continue;
      int st = 0;
      pid_t p = ::waitpid(pids[r], &st, WNOHANG);
      if (p == pids[r]) {
        res.status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r)
        if (res.status[r] == -1) {
          ::kill(pids[r], SIGKILL);
          int st;
          ::waitpid(pids[r], &st, 0);
          res.status[r] = 124;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < n; ++r) {
    std::ifstream f(logdir / ("rank" + std::to_string(r) + ".err"));
    std::stringstream ss;
    ss << f.rdbuf();
    res.err.push_back(ss.str());
  }
  std::filesystem::remove_all(logdir);
  return res;
}

/// A fresh empty folder for a test, removed when the object goes.
struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(const std::string& tag) {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("shardsafe-test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

}  // namespace testing
