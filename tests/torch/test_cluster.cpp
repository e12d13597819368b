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
//     file, and the checkpoint before still loads bit-exact on another world;
//   - a rank SIGKILLed during a load: the others' errors name the load as well;
//   - model + AdamW saved to S3 (moto_server on a store node of its own) by 6 ranks on 3 nodes and
//     loaded from there, resharded, by 4 ranks on 2 nodes, bit-exact (where the remote backends
//     are built);
//   - (tests/torch/test_hf_import.cpp) an HF import on 3 nodes in both modes, and a rank killed
//     during rank 0's broadcast.
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
#if SHARDSAFE_TEST_REMOTE
#include "support/servers.hpp"
#include "shardsafe/storage/s3.hpp"
#endif

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

/// Files under dir whose names say they are temporary (`NAME.tmp.PID...`), but not those of pid `except`.
std::vector<std::string> temporaries(const fs::path& dir, pid_t except) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    const auto at = n.find(".tmp.");
    if (at == std::string::npos) continue;
    const std::string mark = std::to_string(except) + ".";
    if (n.compare(at + 5, mark.size(), mark) == 0) continue;  // the killed rank's: nobody was left to remove it
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
  save_options again;
  again.overwrite = true;  // a save done before the break must not end the loop (the next would refuse its folder)
  for (;;) {
    m.step(comm);
    save_model_and_optim_state(file_directory(root / "next"), m.state(), &m.optimizer(), comm, again);
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
  auto a =
      testing::run_on(c, "train_resume", 8, 2, {"adamw", ckpt, (dir.path / "a.safetensors").string(), "save", "3", "3"},
                      dir.path / "log-a");
  REQUIRE_MESSAGE(a.ok(), a.report());
  auto b =
      testing::run_on(c, "train_resume", 6, 2, {"adamw", ckpt, (dir.path / "b.safetensors").string(), "load", "3", "3"},
                      dir.path / "log-b");
  REQUIRE_MESSAGE(b.ok(), b.report());
  const std::string fa = testing::slurp(dir.path / "a.safetensors");
  CHECK(fa.size() > 1000);
  CHECK_MESSAGE(fa == testing::slurp(dir.path / "b.safetensors"), "the 6-rank resume differs from the 8-rank run");
}

namespace {

/// A save loop on 6 ranks over 3 nodes (2 each), broken by `brk` once every rank has saved the
/// first checkpoint; then every rank must have ended within the world's timeout (plus its roll
/// call and a margin for the processes' exit), with an error naming the save's step where it
/// survived, no temporary file left, and the first checkpoint loads bit-exact on 4 ranks over 2
/// nodes.
template <class Break, class Expect>
void break_a_save(const char* what, Break&& brk, Expect&& expect) {
  testing::sim_cluster c(3);
  testing::temp_dir dir(std::string("cluster-") + what);
  const fs::path root = dir.path / "ckpt";
  fs::create_directories(root);
  const int ranks = 6, timeout_ms = 10000;
  const auto b = testing::break_world(
      c, "cluster_save_forever", {root.string(), std::to_string(timeout_ms), (dir.path / "good.safetensors").string()},
      root, ranks, 2, timeout_ms, dir.path / "log", brk);
  testing::check_broken(b, ranks, "");
  for (int r = 0; r < ranks; ++r)
    if (r != b.victim) expect(r, b.res.err[r]);
  // no rank that lived to see the failure left a temporary file
  const auto temps = temporaries(root, b.victim_pid);
  CHECK_MESSAGE(temps.empty(), temps.front());
  // the checkpoint before loads bit-exact on 4 ranks over 2 nodes
  c.run("heal " + c.name + " 2");
  auto l =
      testing::run_on(c, "cluster_load_params", 4, 2,
                      {(root / "good").string(), (dir.path / "loaded.safetensors").string()}, dir.path / "log-load");
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
      [](int, const std::string&) {});  // check_broken: rank 3 named as lost
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
          const auto silent = testing::silent_ranks(err);
          CHECK_MESSAGE((testing::lists(silent, 4) && testing::lists(silent, 5)),
                        "rank " << r << " does not name ranks 4 and 5: " << err);
          CHECK_MESSAGE(!testing::lists(silent, r), err);
        }
      });
}

// args: checkpoint dir, ready folder, timeout in ms. Loads model + AdamW state again and again
// (marking itself ready after the first load) until the world breaks.
WORKER_SCENARIO("cluster_load_forever") {
  at::set_num_threads(1);
  auto w = init_world_from_env(std::chrono::milliseconds(std::stol(args.at(2))));
  auto comm = w.comm();
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_kind::adamw, true, true);  // train_resume's shapes
  auto sd = m.state();
  const file_directory dir(args.at(0));
  load_model_and_optim_state(dir, sd, &m.optimizer(), comm);
  std::ofstream(fs::path(args.at(1)) / ("ready" + std::to_string(w.rank))) << "x";
  for (;;) load_model_and_optim_state(dir, sd, &m.optimizer(), comm);
}

TEST_CASE("cluster: a rank SIGKILLed during a load: every other rank ends with an error naming the load" *
          doctest::skip(testing::cluster_skipped())) {
  testing::sim_cluster c(3);
  testing::temp_dir dir("cluster-load-kill");
  const fs::path root = dir.path / "ckpt";
  // a checkpoint to load: 2 steps of the save loop's model, saved by 6 ranks
  auto s = testing::run_on(c, "train_resume", 6, 2,
                           {"adamw", root.string(), (dir.path / "a.safetensors").string(), "save", "2", "0"},
                           dir.path / "log-save");
  REQUIRE_MESSAGE(s.ok(), s.report());
  const fs::path ready = dir.path / "ready";
  fs::create_directories(ready);
  const int ranks = 6, timeout_ms = 10000;
  const auto b = testing::break_world(c, "cluster_load_forever",
                                      {root.string(), ready.string(), std::to_string(timeout_ms)}, ready, ranks, 2,
                                      timeout_ms, dir.path / "log", [](const testing::sim_cluster&, local_world& w) {
                                        w.kill_rank(3, SIGKILL);
                                        return 3;
                                      });
  testing::check_broken(b, ranks, "load " + root.string() + ": ");
  CHECK(temporaries(dir.path, b.victim_pid).empty());
}

#if SHARDSAFE_TEST_REMOTE
// args: S3 endpoint (http://ADDR:PORT), save|load, params file. save: rank 0 makes the bucket;
// one step of the model, then model + AdamW saved to s3://cluster/ckpt; load: into zeroed
// weights. Either writes the full parameters it then holds (rank 0).
WORKER_SCENARIO("cluster_s3") {
  at::set_num_threads(1);
  auto w = init_world_from_env(std::chrono::seconds(120));
  auto comm = w.comm();
  s3_options o;
  o.endpoint = args.at(0);
  o.region = "us-east-1";
  o.credentials = aws_credentials{"testing", "testing", ""};
  const bool save = args.at(1) == "save";
  if (save && w.rank == 0) s3_directory("s3://cluster", o).create_bucket();
  comm.barrier();
  const s3_directory dir("s3://cluster/ckpt", o);
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_kind::adamw, !save, !save, 64, 256);
  if (save) {
    m.step(comm);
    save_model_and_optim_state(dir, m.state(), &m.optimizer(), comm);
  } else {
    auto sd = m.state();
    load_model_and_optim_state(dir, sd, &m.optimizer(), comm);
  }
  auto params = m.full_params(comm);
  if (w.rank == 0) demo::write_params(args.at(2), params);
  return 0;
}

TEST_CASE("cluster: model + AdamW saved to S3 on a store node by 6 ranks on 3 nodes, loaded bit-exact by 4 ranks on 2" *
          doctest::skip(testing::cluster_skipped())) {
  testing::sim_cluster c(4);  // nodes 0-2 run ranks, node 3 is the object store
  testing::temp_dir dir("cluster-s3");
  const std::string store = c.line("addr", "3"), endpoint = "http://" + store + ":5000";
  testing::child_process moto({c.script, "run", c.name, "3", "moto_server", "-H", store, "-p", "5000"}, dir.path);
  // it listens on the store node's address, which only the nodes reach: ask from node 0
  bool up = false;
  for (int i = 0; i < 600 && !up; ++i) {
    up = c.run("run " + c.name + " 0 bash -c 'exec 3<>/dev/tcp/" + store + "/5000' 2>/dev/null") == 0;
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  REQUIRE_MESSAGE(up, "moto_server on the store node did not listen: " << moto.log());
  auto a = testing::run_on(c, "cluster_s3", 6, 2, {endpoint, "save", (dir.path / "saved.safetensors").string()},
                           dir.path / "log-a");
  REQUIRE_MESSAGE(a.ok(), a.report());
  auto b = testing::run_on(c, "cluster_s3", 4, 2, {endpoint, "load", (dir.path / "loaded.safetensors").string()},
                           dir.path / "log-b");
  REQUIRE_MESSAGE(b.ok(), b.report());
  const std::string saved = testing::slurp(dir.path / "saved.safetensors");
  CHECK(saved.size() > 1000);
  CHECK_MESSAGE(saved == testing::slurp(dir.path / "loaded.safetensors"),
                "the 4-rank load from S3 differs from what was saved");
}
#endif
