// Kill trials: saving processes (one process, and a 2-rank c10d world) are killed with SIGKILL
// at random moments spread over the whole save (and the rotation after it); after each kill
// the newest complete checkpoint loads bit-exact, every unfinished folder is refused by load
// and by verify, and rotation has kept the newest complete one.
//
// The suite runs SHARDSAFE_KILL_TRIALS trials per world (default 8); the full campaign is
//   SHARDSAFE_KILL_TRIALS=100 ./build/tests/torch_tests -tc="kill trials*"
// which prints its figures (README "Guarantees").
#include <doctest/doctest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "fixtures.hpp"
#include "shardsafe/dist/launch.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

// the state saved at step s: three tensors, 12 MiB in all, values depending on s
const std::vector<std::pair<std::string, shape_t>> kill_tensors{{"w", {1024, 2048}}, {"v", {512, 1024}}, {"b", {4096}}};

at::Tensor step_values(const std::string& key, std::uint64_t step, const shape_t& shape) {
  return testing::expected_full("step" + std::to_string(step) + "." + key, dtype::F32, shape);
}

void touch(const fs::path& p) { std::ofstream(p) << "x"; }

template <Comm C>
void save_and_rotate(const fs::path& root, std::uint64_t step, C& comm, const fs::path& marks) {
  const int r = comm.rank(), n = comm.world_size();
  state_dict sd;
  for (const auto& [key, shape] : kill_tensors) {
    at::Tensor full = step_values(key, step, shape);
    if (shape.size() == 2) {
      const auto spec = testing::block_part(shape, 0, n, r);
      sd.add(key, testing::local_of(full, spec), spec, shape);
    } else {
      sd.add(key, full);
    }
  }
  touch(marks / ("ready" + std::to_string(r)));
  const auto t0 = std::chrono::steady_clock::now();
  save_options o;
  o.write_chunk_bytes = 1 << 20;
  save_state_dict(file_directory(root / checkpoint_name(step)), sd, comm, o);
  rotate_checkpoints(file_directory(root), 1, comm);
  if (r == 0)
    std::ofstream(marks / "seconds") << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Loads checkpoint dir and compares it with step's values; "" when equal, else what differs.
std::string loads_as(const fs::path& dir, std::uint64_t step) {
  state_dict sd;
  std::vector<at::Tensor> into;
  for (const auto& [key, shape] : kill_tensors) sd.add(key, into.emplace_back(at::zeros(to_sizes(shape))));
  load_state_dict(file_directory(dir), sd);
  for (std::size_t k = 0; k < kill_tensors.size(); ++k)
    if (!testing::same_bits(into[k], step_values(kill_tensors[k].first, step, kill_tensors[k].second)))
      return dir.string() + ": tensor '" + kill_tensors[k].first + "' differs from step " + std::to_string(step);
  return "";
}

struct trial_counts {
  int trials = 0, committed = 0, interrupted = 0;
  std::set<std::string> unfinished;  ///< distinct unfinished folders seen (each refused after every trial)
};

/// Runs `trials` kill trials with worlds of n processes saving under root.
trial_counts run_trials(int n, int trials, const fs::path& root, std::mt19937_64& rng) {
  trial_counts c;
  const fs::path marks = root.parent_path() / ("marks" + std::to_string(n));
  auto start = [&](std::uint64_t step) {
    fs::remove_all(marks);
    fs::create_directories(marks);
    launch_options opt;
    opt.env["SHARDSAFE_WORKER"] = "kill_trial_save";
    opt.env["SHARDSAFE_WORKER_ARGS"] = testing::join_args({root.string(), std::to_string(step), marks.string()});
    opt.env["OMP_NUM_THREADS"] = "1";
    opt.stderr_dir = marks / "err";
    return std::make_unique<local_world>(fs::read_symlink("/proc/self/exe").string(), std::vector<std::string>{}, n,
                                         opt);
  };
  auto await_ready = [&] {
    for (int i = 0; i < 60000; ++i) {
      bool all = true;
      for (int r = 0; r < n; ++r) all = all && fs::exists(marks / ("ready" + std::to_string(r)));
      if (all) return;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    FAIL("the ranks never got ready");
  };
  // step 1, whole: how long a save + rotation takes
  {
    auto w = start(1);
    const auto st = w->wait(std::chrono::seconds(120));
    for (int s : st) REQUIRE_MESSAGE(s == 0, testing::slurp(marks / "err" / "rank0.err"));
  }
  double seconds = 0;
  std::ifstream(marks / "seconds") >> seconds;
  REQUIRE(seconds > 0);
  std::uint64_t committed_step = 1;
  for (int t = 0; t < trials; ++t) {
    const std::uint64_t step = committed_step + 1 + static_cast<std::uint64_t>(t);  // a fresh folder each trial
    auto w = start(step);
    await_ready();
    // a moment spread over the whole save and rotation (and a little past it)
    const double at = std::uniform_real_distribution<double>(0, seconds * 1.1)(rng);
    std::this_thread::sleep_for(std::chrono::duration<double>(at));
    w->kill_all(SIGKILL);
    w->wait();
    ++c.trials;
    // the newest complete checkpoint loads bit-exact: the new one if it committed, else the last
    const auto latest = latest_checkpoint(file_directory(root));
    REQUIRE(latest);
    CHECK((latest->step == step || latest->step == committed_step));
    const std::string diff = loads_as(root / latest->name, latest->step);
    CHECK_MESSAGE(diff.empty(), diff);
    CHECK(verify_checkpoint(file_directory(root / latest->name)).tensors == kill_tensors.size());
    if (latest->step == step) {
      ++c.committed;
      committed_step = step;
    } else {
      ++c.interrupted;
    }
    // every unfinished folder is refused by load and by verify
    for (const auto& e : list_checkpoints(file_directory(root))) {
      if (e.complete) continue;
      c.unfinished.insert(e.name);
      errc code{};
      const std::string msg = testing::error_of([&] { (void)loads_as(root / e.name, e.step); }, &code);
      CHECK_MESSAGE(code == errc::not_found, e.name << ": " << msg);
      const std::string vmsg = testing::error_of([&] { verify_checkpoint(file_directory(root / e.name)); }, &code);
      CHECK_MESSAGE(code == errc::not_found, e.name << ": " << vmsg);
    }
    // rotation (keep 1) never removed the newest complete one (older complete ones stay when
    // a save was killed between its commit and its rotation; the next rotation removes them)
    CHECK(latest_checkpoint(file_directory(root))->step == committed_step);
  }
  return c;
}

}  // namespace

// args: root, step, marks folder
WORKER_SCENARIO("kill_trial_save") {
  const fs::path root = args.at(0), marks = args.at(2);
  const std::uint64_t step = std::stoull(args.at(1));
  if (std::getenv("WORLD_SIZE") && std::string(std::getenv("WORLD_SIZE")) == "1") {
    single_process one;
    save_and_rotate(root, step, one, marks);
  } else {
    c10d_world w = init_world_from_env();
    c10d_comm comm = w.comm();
    save_and_rotate(root, step, comm, marks);
  }
  return 0;
}

TEST_CASE("kill trials: saves killed at random moments never break the newest complete checkpoint") {
  const char* env = std::getenv("SHARDSAFE_KILL_TRIALS");
  const int trials = env ? std::atoi(env) : 8;
  std::mt19937_64 rng(env ? 20261123 : std::random_device{}());
  for (int n : {1, 2}) {
    CAPTURE(n);
    testing::temp_dir dir("kill");
    const auto c = run_trials(n, trials, dir.path / "ckpts", rng);
    MESSAGE("kill trials, world of "
            << n << ": " << c.trials << " trials: " << c.committed << " committed before the kill, " << c.interrupted
            << " interrupted (the previous checkpoint loaded bit-exact), " << c.unfinished.size()
            << " distinct unfinished folders, each refused by load and verify after every later trial");
    CHECK(c.trials == trials);
  }
}
