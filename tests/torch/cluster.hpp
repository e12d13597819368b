// tests/torch/cluster.hpp - c10d worlds on a simulated cluster (scripts/cluster.sh): network
// namespaces as nodes on a switch of their own, MASTER_ADDR the head node's address. A test
// makes a sim_cluster (removed when it goes, whatever way the test ends) and runs worlds of the
// test binary's worker scenarios on it with run_on (ranks placed per_node to a node, in order).
#pragma once

#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
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
  const bool have_ip = fs::exists("/usr/sbin/ip") || fs::exists("/sbin/ip") || fs::exists("/usr/bin/ip") || fs::exists("/bin/ip");
  return (::geteuid() != 0 || !have_ip) && !cluster_required();
}

/// A cluster of `nodes` nodes made by scripts/cluster.sh for one test; removed (with whatever
/// still runs on it) when the object goes, whatever way the test ends.
struct sim_cluster {
  std::string script = std::string(SHARDSAFE_SOURCE_DIR) + "/scripts/cluster.sh";
  std::string name = "c" + std::to_string(::getpid() % 10000000);
  int nodes;
  std::string links;
  mutable int worlds = 0;
  explicit sim_cluster(int n, const std::string& rate = "10gbit") : nodes(n) {
    REQUIRE_MESSAGE(::geteuid() == 0, "the cluster tests need root (network namespaces)");
    REQUIRE_MESSAGE(run("up " + name + " " + std::to_string(n) + " " + rate) == 0, "scripts/cluster.sh up failed");
    std::ifstream f("/run/shardsafe-cluster/" + name + "/links");
    std::getline(f, links);
  }
  sim_cluster(const sim_cluster&) = delete;
  sim_cluster& operator=(const sim_cluster&) = delete;
  ~sim_cluster() { run("down " + name); }
  int run(const std::string& args) const { return std::system((script + " " + args + " >&2").c_str()); }
  std::string addr(int node) const { return "10.213.0." + std::to_string(node + 1); }
  std::string ns(int node) const { return name + "-n" + std::to_string(node); }

  /// The launch options of a world of `ranks` ranks of `scenario`, `per_node` ranks on each
  /// node from node 0 on: each rank started by `ip netns exec` on its node, Gloo on eth0, the
  /// store on node 0's address.
  shardsafe::launch_options world(const std::string& scenario, const std::vector<std::string>& args, int per_node,
                       const fs::path& logdir) const {
    shardsafe::launch_options o;
    o.master_addr = addr(0);
    o.master_port = 29500 + worlds++;  // node 0 is a network of its own: nothing else listens there
    o.env["SHARDSAFE_WORKER"] = scenario;
    o.env["SHARDSAFE_WORKER_ARGS"] = join_args(args);
    o.env["OMP_NUM_THREADS"] = "1";
    o.env["GLOO_SOCKET_IFNAME"] = "eth0";
    o.stderr_dir = logdir;
    o.wrap = [this, per_node](int r) { return std::vector<std::string>{"ip", "netns", "exec", ns(r / per_node)}; };
    o.local_rank = [per_node](int r) { return r % per_node; };
    return o;
  }
};

inline std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

/// Runs a world on the cluster to its end (at most `timeout`); each rank's exit code and stderr.
inline world_result run_on(const sim_cluster& c, const std::string& scenario, int ranks, int per_node,
                             const std::vector<std::string>& args, const fs::path& logdir,
                             std::chrono::seconds timeout = std::chrono::seconds(300)) {
  world_result res;
  {
    shardsafe::local_world w(self_exe(), {}, ranks, c.world(scenario, args, per_node, logdir));
    res.status = w.wait(timeout);
  }
  for (int r = 0; r < ranks; ++r) res.err.push_back(slurp(logdir / ("rank" + std::to_string(r) + ".err")));
  return res;
}

}  // namespace testing
