// tests/torch/cluster.hpp - c10d worlds on a simulated cluster (scripts/cluster.sh): network
// namespaces as nodes on a switch of their own, MASTER_ADDR the head node's address. A test
// makes a sim_cluster (removed when it goes, whatever way the test ends) and runs worlds of the
// test binary's worker scenarios on it with run_on (ranks placed per_node to a node, in order).
#pragma once

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardsafe/dist/launch.hpp"
#include "world.hpp"

namespace testing {

namespace fs = std::filesystem;

inline bool cluster_required() {
  const char* v = std::getenv("SHARDSAFE_REQUIRE_CLUSTER");
  return v && std::string(v) == "1";
}
/// root and iproute2's ip (the Debian 13 leg's root has no iproute2: the cluster is the debian12 leg's)
inline bool cluster_skipped() {
  const bool have_ip =
      fs::exists("/usr/sbin/ip") || fs::exists("/sbin/ip") || fs::exists("/usr/bin/ip") || fs::exists("/bin/ip");
  return (::geteuid() != 0 || !have_ip) && !cluster_required();
}

/// A cluster of `nodes` nodes made by scripts/cluster.sh for one test; removed (with whatever
/// still runs on it) when the object goes, whatever way the test ends. The script alone knows
/// the nodes' names and addresses: ranks start through `cluster.sh run NAME NODE` (which execs
/// into the node), and node 0's address comes from `cluster.sh addr`.
struct sim_cluster {
  std::string script = std::string(SHARDSAFE_SOURCE_DIR) + "/scripts/cluster.sh";
  std::string name = "c" + std::to_string(::getpid() % 10000000);
  int nodes;
  std::string links;  ///< what the links got (cluster.sh links)
  std::string head;   ///< node 0's address
  mutable int worlds = 0;
  explicit sim_cluster(int n, const std::string& rate = "10gbit") : nodes(n) {
    REQUIRE_MESSAGE(::geteuid() == 0, "the cluster tests need root (network namespaces)");
    // (a failed up removes what it made itself)
    REQUIRE_MESSAGE(run("up " + name + " " + std::to_string(n) + " " + rate) == 0, "scripts/cluster.sh up failed");
    try {  // a constructor that throws runs no destructor: the cluster goes here
      links = line_of({"links", name});
      head = line_of({"addr", name, "0"});
    } catch (...) {
      run("down " + name);
      throw;
    }
  }
  sim_cluster(const sim_cluster&) = delete;
  sim_cluster& operator=(const sim_cluster&) = delete;
  ~sim_cluster() { run("down " + name); }
  int run(const std::string& args) const { return std::system((script + " " + args + " >&2").c_str()); }

  /// The launch options of a world of `scenario`, `per_node` ranks on each node from node 0
  /// on: the worker's (worker_options), each rank started on its node, Gloo on eth0, the
  /// store on node 0.
  shardsafe::launch_options world(const std::string& scenario, const std::vector<std::string>& args, int per_node,
                                  const fs::path& logdir) const {
    shardsafe::launch_options o = worker_options(scenario, args, logdir, {{"GLOO_SOCKET_IFNAME", "eth0"}});
    o.master_addr = head;
    o.master_port = 29500 + worlds++;  // node 0 is a network of its own: nothing else listens there
    o.wrap = [this, per_node](int r) {
      return std::vector<std::string>{script, "run", name, std::to_string(r / per_node)};
    };
    o.local_rank = [per_node](int r) { return r % per_node; };
    return o;
  }

  /// The first line `cluster.sh CMD NAME ARG` prints (e.g. line("addr", "3")).
  std::string line(const std::string& cmd, const std::string& arg) const { return line_of({cmd, name, arg}); }

 private:
  std::string line_of(const std::vector<std::string>& args) const {
    const program_result r = run_program(script, args);
    REQUIRE_MESSAGE((r.exited && r.code == 0), "scripts/cluster.sh failed: " << r.err);
    return r.out.substr(0, r.out.find('\n'));
  }
};

/// Runs a world on the cluster to its end (at most `timeout`); each rank's exit code and stderr.
inline world_result run_on(const sim_cluster& c, const std::string& scenario, int ranks, int per_node,
                           const std::vector<std::string>& args, const fs::path& logdir,
                           std::chrono::seconds timeout = std::chrono::seconds(300)) {
  world_result res;
  {
    shardsafe::local_world w(self_exe(), {}, ranks, c.world(scenario, args, per_node, logdir));
    res.status = w.wait(timeout);
  }
  res.err = rank_errors(logdir, ranks);
  return res;
}

/// The ranks a comm_error says did not answer the roll call ("; rank 3 did not answer ..." or
/// "; ranks 4, 5 did not answer ..."); empty when it names none.
inline std::vector<int> silent_ranks(const std::string& err) {
  std::vector<int> out;
  const auto end = err.find(" did not answer the roll call in the store");
  if (end == std::string::npos) return out;
  const auto begin = err.rfind("; rank", end);
  if (begin == std::string::npos) return out;
  std::string list = err.substr(begin + 6, end - begin - 6);
  if (!list.empty() && list[0] == 's') list.erase(0, 1);
  for (std::size_t i = 0; i < list.size();) {
    if (!std::isdigit(static_cast<unsigned char>(list[i]))) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < list.size() && std::isdigit(static_cast<unsigned char>(list[j]))) ++j;
    out.push_back(std::stoi(list.substr(i, j - i)));
    i = j;
  }
  return out;
}
inline bool lists(const std::vector<int>& v, int r) { return std::find(v.begin(), v.end(), r) != v.end(); }

/// What break_world saw: each rank's exit code and stderr, and which rank the break killed.
struct broken_world {
  world_result res;
  int victim = -1;  ///< the rank the break killed (-1: none)
  pid_t victim_pid = -1;
};

/// Starts `ranks` ranks of `scenario` on c (`per_node` to a node), waits until each has written
/// READY_DIR/readyR (it has done its first round of work), lets it go on a few milliseconds to a
/// few hundred, then calls brk(c, world) (returns the rank it killed, or -1) and waits for every
/// rank at most twice timeout_ms plus 10 s: the world's own timeout and roll call, and as long
/// again for rank 0, which keeps the store up for the others' roll calls (torch/c10d.hpp), and the
/// time for a process to exit. A rank still running then is killed and reported 124.
template <class Break>
broken_world break_world(const sim_cluster& c, const std::string& scenario, const std::vector<std::string>& args,
                         const fs::path& ready_dir, int ranks, int per_node, int timeout_ms, const fs::path& logdir,
                         Break&& brk) {
  broken_world b;
  {
    shardsafe::local_world w(self_exe(), {}, ranks, c.world(scenario, args, per_node, logdir));
    bool ready = false;
    for (int i = 0; i < 600000 && !ready && !w.poll(); ++i) {
      ready = true;
      for (int r = 0; r < ranks; ++r) ready = ready && fs::exists(ready_dir / ("ready" + std::to_string(r)));
      if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!ready) w.kill_all(SIGKILL);
    REQUIRE_MESSAGE(ready, "the world never got ready");
    std::mt19937 rng(static_cast<unsigned>(::getpid()));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(5, 400)(rng)));
    b.victim = brk(c, w);
    if (b.victim >= 0) b.victim_pid = w.pid(b.victim);
    b.res.status = w.wait(std::chrono::milliseconds(2 * timeout_ms + 10000));
  }
  b.res.err = rank_errors(logdir, ranks);
  std::string s;
  for (int r = 0; r < ranks; ++r)
    s += "  rank " + std::to_string(r) + ": " + std::to_string(b.res.status[r]) + " " +
         b.res.err[r].substr(0, b.res.err[r].find('\n')).substr(0, 300) + "\n";
  MESSAGE(scenario << ": exit codes and the first line of each rank's error:\n" << s);
  return b;
}

/// Every rank ended before the bound; every rank but the victim failed with a comm_error that
/// names the collective, itself and its world size, the step (`step`, when not empty), and that
/// the killed rank did not answer the roll call.
inline void check_broken(const broken_world& b, int ranks, const std::string& step) {
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(b.res.status[r] != 124, "rank " << r << " outlived the timeout: " << b.res.report());
    if (r == b.victim) continue;
    const std::string& err = b.res.err[r];
    CHECK_MESSAGE(b.res.status[r] != 0, b.res.report());
    CHECK_MESSAGE(err.find("c10d ") != std::string::npos, err);
    CHECK_MESSAGE(
        err.find(" on rank " + std::to_string(r) + " of " + std::to_string(ranks) + " failed") != std::string::npos,
        err);
    if (!step.empty()) CHECK_MESSAGE(err.find(step) != std::string::npos, err);
    if (b.victim >= 0) {
      const auto silent = silent_ranks(err);
      CHECK_MESSAGE(lists(silent, b.victim), "rank " << r << " does not name rank " << b.victim << " as lost: " << err);
      CHECK_MESSAGE(!lists(silent, r), err);
    }
  }
}

}  // namespace testing
