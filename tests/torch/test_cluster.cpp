// Past one machine: c10d worlds whose ranks live on the nodes of a simulated cluster made by
// scripts/cluster.sh (network namespaces on a switch of their own, links with a rate limit, and a
// delay where the kernel has netem), MASTER_ADDR the head node's address, not loopback.
//
//   - model + AdamW saved by 8 ranks on 4 nodes resumes bit-exact on 6 ranks on 3 nodes (the
//     world changes its node count);
//   - a rank SIGKILLed during a save, and a node whose link is cut during a save: every other
//     rank ends with an error within the timeout given to the world (init_world_from_env's, for
//     Gloo and the store) and its roll call (torch/c10d.hpp), naming the collective, itself and
//     the ranks it lost (or that it lost the store); none outlives that, none leaves a temporary
//     file, and the checkpoint before still loads bit-exact on another world.
//
// Needs root (network namespaces) and iproute2; skipped without them unless
// SHARDSAFE_REQUIRE_CLUSTER=1 (scripts/test.sh's debian12 leg sets it).
#include <doctest/doctest.h>

#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/sharded_mlp.hpp"
#include "shardsafe/dist/launch.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "cluster.hpp"
#include "world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

/// The ranks a comm_error says did not answer the roll call ("; rank 3 did not answer ..." or
/// "; ranks 4, 5 did not answer ..."); empty when it names none.
std::vector<int> silent_ranks(const std::string& err) {
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
bool lists(const std::vector<int>& v, int r) { return std::find(v.begin(), v.end(), r) != v.end(); }

/// Files under dir whose names say they are temporary (`NAME.tmp.PID...`), but not those of pid `except`.
std::vector<std::string> temporaries(const fs::path& dir, pid_t except) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    const auto at = n.find(".tmp.");
    if (at == std::string::npos) continue;
    if (n.compare(at + 5, std::string::npos, std::to_string(except) + ".", 0, std::to_string(except).size() + 1) == 0)
      continue;
    out.push_back(e.path().string());
  }
  return out;
}

}  // namespace

// args: checkpoint root, timeout in ms, params file. Saves a first checkpoint (root/good) after
// one step and writes the full parameters it holds, marks itself ready, then steps and saves to
// root/next, again and again, until the world breaks (the test kills a rank or cuts a link).
WORKER_SCENARIO("cluster_save_forever") {
  at::set_num_threads(1);
  const fs::path root(args.at(0));
  auto w = init_world_from_env(std::chrono::milliseconds(std::stol(args.at(1))));
  auto comm = w.comm();
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_kind::adamw, false, false, 64, 256);
  m.step(comm);
  save_model_and_optim_state(file_directory(root / "good"), m.state(), &m.optimizer(), comm);
  auto params = m.full_params(comm);
  if (w.rank == 0) demo::write_params(args.at(2), params);
  comm.barrier();
  std::ofstream(root / ("ready" + std::to_string(w.rank))) << "x";
  for (;;) {
    m.step(comm);
    save_model_and_optim_state(file_directory(root / "next"), m.state(), &m.optimizer(), comm);
  }
}

// args: checkpoint dir, params file. Loads model + AdamW state into zeroed weights and writes the
// full parameters it then holds.
WORKER_SCENARIO("cluster_load_params") {
  at::set_num_threads(1);
  auto w = init_world_from_env(std::chrono::seconds(120));
  auto comm = w.comm();
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_kind::adamw, true, true, 64, 256);
  auto sd = m.state();
  load_model_and_optim_state(file_directory(args.at(0)), sd, &m.optimizer(), comm);
  auto params = m.full_params(comm);
  if (w.rank == 0) demo::write_params(args.at(1), params);
  return 0;
}

TEST_CASE("cluster: model + AdamW saved by 8 ranks on 4 nodes resumes bit-exact on 6 ranks on 3 nodes" *
          doctest::skip(testing::cluster_skipped())) {
  testing::sim_cluster c(4);
  MESSAGE("cluster " << c.name << ": 4 nodes, links " << c.links);
  testing::temp_dir dir("cluster-resume");
  const std::string ckpt = (dir.path / "ckpt").string();
  // train_resume (test_optim.cpp): 3 steps, save, 3 more steps; the load world loads into zeroed
  // weights and steps 3 times: both end with the same parameters, bit for bit
  auto a = testing::run_on(c, "train_resume", 8, 2, {"adamw", ckpt, (dir.path / "a.safetensors").string(), "save", "3", "3"},
                  dir.path / "log-a");
  REQUIRE_MESSAGE(a.ok(), a.report());
  auto b = testing::run_on(c, "train_resume", 6, 2, {"adamw", ckpt, (dir.path / "b.safetensors").string(), "load", "3", "3"},
                  dir.path / "log-b");
  REQUIRE_MESSAGE(b.ok(), b.report());
  const std::string fa = testing::slurp(dir.path / "a.safetensors");
  CHECK(fa.size() > 1000);
  CHECK_MESSAGE(fa == testing::slurp(dir.path / "b.safetensors"), "the 6-rank resume differs from the 8-rank run");
}

namespace {

/// A save loop on 6 ranks over 3 nodes (2 each), broken by `brk` once every rank has saved the
/// first checkpoint; then every rank must have ended within the world's timeout (plus a margin
/// for the processes' exit), with an error where it survived, and the first checkpoint loads
/// bit-exact on 4 ranks over 2 nodes.
template <class Break, class Expect>
void break_a_save(const char* what, Break&& brk, Expect&& expect) {
  testing::sim_cluster c(3);
  testing::temp_dir dir(std::string("cluster-") + what);
  const fs::path root = dir.path / "ckpt";
  fs::create_directories(root);
  const int ranks = 6, timeout_ms = 15000;
  const fs::path logdir = dir.path / "log";
  testing::world_result res;
  pid_t victim_pid = -1;
  int victim = -1;
  {
    local_world w(testing::self_exe(), {}, ranks,
                  c.world("cluster_save_forever",
                          {root.string(), std::to_string(timeout_ms), (dir.path / "good.safetensors").string()}, 2, logdir));
    bool ready = false;
    for (int i = 0; i < 600000 && !ready && !w.poll(); ++i) {
      ready = true;
      for (int r = 0; r < ranks; ++r) ready = ready && fs::exists(root / ("ready" + std::to_string(r)));
      if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE_MESSAGE(ready, "the world never saved its first checkpoint");
    // somewhere in the next saves: a few milliseconds to a few hundred
    std::mt19937 rng(static_cast<unsigned>(::getpid()));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(5, 400)(rng)));
    victim = brk(c, w);
    if (victim >= 0) victim_pid = w.pid(victim);
    // the timeout of the world's collectives and store, and 10 s for a rank to notice and exit
    res.status = w.wait(std::chrono::milliseconds(timeout_ms + 10000));
  }
  for (int r = 0; r < ranks; ++r) res.err.push_back(testing::slurp(logdir / ("rank" + std::to_string(r) + ".err")));
  MESSAGE(what << ": exit codes and the first line of each rank's error:\n" << [&] {
    std::string s;
    for (int r = 0; r < ranks; ++r)
      s += "  rank " + std::to_string(r) + ": " + std::to_string(res.status[r]) + " " +
           res.err[r].substr(0, res.err[r].find('\n')).substr(0, 300) + "\n";
    return s;
  }());
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK_MESSAGE(res.status[r] != 124, "rank " << r << " outlived the timeout: " << res.report());
    if (r == victim) continue;
    CHECK_MESSAGE(res.status[r] != 0, res.report());
    // the error names the collective, this rank, and what the roll call found
    CHECK_MESSAGE(res.err[r].find("c10d ") != std::string::npos, res.err[r]);
    CHECK_MESSAGE(res.err[r].find(" on rank " + std::to_string(r) + " of 6 failed") != std::string::npos, res.err[r]);
    expect(r, res.err[r]);
  }
  // no rank that lived to see the failure left a temporary file
  const auto temps = temporaries(root, victim_pid);
  CHECK_MESSAGE(temps.empty(), temps.front());
  // the checkpoint before loads bit-exact on 4 ranks over 2 nodes
  c.run("heal " + c.name + " 2");
  auto l = testing::run_on(c, "cluster_load_params", 4, 2, {(root / "good").string(), (dir.path / "loaded.safetensors").string()},
                  dir.path / "log-load");
  REQUIRE_MESSAGE(l.ok(), l.report());
  CHECK(testing::slurp(dir.path / "good.safetensors") == testing::slurp(dir.path / "loaded.safetensors"));
}

}  // namespace

TEST_CASE("cluster: a rank SIGKILLed during a save: every other rank ends with an error within the timeout" *
          doctest::skip(testing::cluster_skipped())) {
  break_a_save(
      "kill",
      [](const testing::sim_cluster&, local_world& w) {
        w.kill_rank(3, SIGKILL);  // node 1's second rank
        return 3;
      },
      [](int r, const std::string& err) {
        const auto silent = silent_ranks(err);
        CHECK_MESSAGE(lists(silent, 3), "rank " << r << " does not name rank 3 as lost: " << err);
        CHECK_MESSAGE(!lists(silent, r), err);
      });
}

TEST_CASE("cluster: a node cut off during a save: every rank ends with an error within the timeout" *
          doctest::skip(testing::cluster_skipped())) {
  break_a_save(
      "cut",
      [](const testing::sim_cluster& c, local_world&) {
        c.run("cut " + c.name + " 2");  // node 2 (ranks 4 and 5) loses its link
        return -1;
      },
      [](int r, const std::string& err) {
        if (r >= 4) {  // cut off from the store on node 0 too
          CHECK_MESSAGE(err.find("the store (rank 0's, where the world met) did not answer") != std::string::npos, err);
        } else {
          const auto silent = silent_ranks(err);
          CHECK_MESSAGE((lists(silent, 4) && lists(silent, 5)), "rank " << r << " does not name ranks 4 and 5: " << err);
          CHECK_MESSAGE(!lists(silent, r), err);
        }
      });
}
