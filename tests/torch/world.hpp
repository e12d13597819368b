// tests/torch/world.hpp - real multi-process c10d worlds on localhost for the tests.
//
// A test calls run_world("scenario", n, args): the test binary starts itself n times with
// RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), SHARDSAFE_WORKER and
// SHARDSAFE_WORKER_ARGS set; torch_main.cpp sees SHARDSAFE_WORKER and runs the scenario
// registered under that name instead of doctest (shardsafe::local_world starts them). Each
// worker's exit code and stderr come back to the test.
#pragma once

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

#include "support/test_util.hpp"
#include "shardsafe/dist/launch.hpp"

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
/// Defines a worker scenario: int body(const std::vector<std::string>& args). The names come
/// from __COUNTER__, not __LINE__: in a unity build several test files share one translation unit.
#define WORKER_SCENARIO(name) SHARDSAFE_WORKER_SCENARIO(name, __COUNTER__)
#define SHARDSAFE_WORKER_SCENARIO(name, id)                                                                 \
  static int SHARDSAFE_CAT(worker_fn_, id)(const std::vector<std::string>& args);                           \
  static ::testing::scenario_registrar SHARDSAFE_CAT(worker_reg_, id)(name, SHARDSAFE_CAT(worker_fn_, id)); \
  static int SHARDSAFE_CAT(worker_fn_, id)([[maybe_unused]] const std::vector<std::string>& args)

/// A check inside a worker scenario: throws `what`, which torch_main.cpp prints with the rank
/// and turns into exit code 98.
inline void worker_check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
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

/// This test binary: what a world's ranks run.
inline std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

/// The launch options of a world of scenario `name` with `args`: the worker's variables (and
/// `extra_env`), one OpenMP thread unless extra_env says otherwise, rank R's stderr to
/// LOGDIR/rankR.err.
inline shardsafe::launch_options worker_options(const std::string& name, const std::vector<std::string>& args,
                                                const std::filesystem::path& logdir,
                                                std::map<std::string, std::string> extra_env = {}) {
  shardsafe::launch_options opt;
  opt.env = std::move(extra_env);
  opt.env["SHARDSAFE_WORKER"] = name;
  opt.env["SHARDSAFE_WORKER_ARGS"] = join_args(args);
  if (!opt.env.count("OMP_NUM_THREADS")) opt.env["OMP_NUM_THREADS"] = "1";
  opt.stderr_dir = logdir;
  return opt;
}

/// The stderr of each of n ranks, from the folder worker_options sent it to.
inline std::vector<std::string> rank_errors(const std::filesystem::path& logdir, int n) {
  std::vector<std::string> err;
  for (int r = 0; r < n; ++r) err.push_back(slurp(logdir / ("rank" + std::to_string(r) + ".err")));
  return err;
}

/// Starts `n` ranks of scenario `name` and waits (at most timeout) for all of them.
inline world_result run_world(const std::string& name, int n, const std::vector<std::string>& args = {},
                              std::chrono::seconds timeout = std::chrono::seconds(240),
                              std::map<std::string, std::string> extra_env = {}) {
  const int port = shardsafe::free_local_port();
  const auto logdir = std::filesystem::temp_directory_path() /
                      ("shardsafe-world-" + std::to_string(::getpid()) + "-" + std::to_string(port));
  shardsafe::launch_options opt = worker_options(name, args, logdir, std::move(extra_env));
  opt.master_port = port;
  world_result res;
  {
    shardsafe::local_world w(self_exe(), {}, n, opt);
    res.status = w.wait(timeout);
  }
  res.err = rank_errors(logdir, n);
  std::filesystem::remove_all(logdir);
  return res;
}

}  // namespace testing
