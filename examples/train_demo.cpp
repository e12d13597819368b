// train_demo - the end-to-end job of the README: train a small model in a multi-process
// world on localhost (c10d + Gloo), checkpoint every few steps with keep-last-N rotation,
// get killed, resume in a world of another size, check that the resumed run reproduced an
// uninterrupted one bit for bit, and unshard the last checkpoint into one safetensors file.
//
//   train_demo [--dir DIR] [--steps 12] [--every 3] [--keep 2] [--kill-after 7]
//              [--world 2] [--resume-world 3] [--optim adamw] [--in 512] [--hidden 2048]
//
// Run without RANK in the environment it is the launcher (like torchrun): it starts the
// worlds of itself, watches them, and reports. With RANK set it is one worker.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "sharded_mlp.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/dist/launch.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;
using clock_type = std::chrono::steady_clock;

namespace {

struct config {
  fs::path dir = "demo-run";
  int steps = 12, every = 3, keep = 2, kill_after = 7, world = 2, resume_world = 3, in = 512, hidden = 2048;
  std::string optim = "adamw";
  int step_delay_ms = 0;  // workers: pause after each step (so the launcher can kill mid-run)
};

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") c.dir = next();
    else if (a == "--steps") c.steps = std::stoi(next());
    else if (a == "--every") c.every = std::stoi(next());
    else if (a == "--keep") c.keep = std::stoi(next());
    else if (a == "--kill-after") c.kill_after = std::stoi(next());
    else if (a == "--world") c.world = std::stoi(next());
    else if (a == "--resume-world") c.resume_world = std::stoi(next());
    else if (a == "--optim") c.optim = next();
    else if (a == "--in") c.in = std::stoi(next());
    else if (a == "--hidden") c.hidden = std::stoi(next());
    else if (a == "--step-delay-ms") c.step_delay_ms = std::stoi(next());
    else throw std::invalid_argument("unknown option " + a);
  }
  return c;
}

std::vector<std::string> worker_args(const config& c, const std::string& role) {
  return {role, "--dir", c.dir.string(), "--steps", std::to_string(c.steps), "--every", std::to_string(c.every),
          "--keep", std::to_string(c.keep), "--optim", c.optim, "--in", std::to_string(c.in), "--hidden",
          std::to_string(c.hidden), "--step-delay-ms", std::to_string(c.step_delay_ms)};
}

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }
std::string mb(std::uint64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MB", double(b) / 1e6);
  return s;
}
std::string gbps(std::uint64_t b, double s) {
  char out[32];
  std::snprintf(out, sizeof out, "%.2f GB/s", s > 0 ? double(b) / s / 1e9 : 0.0);
  return out;
}

// ---------------------------------------------------------------------------------------
// a worker: one rank

int worker(const std::string& role, const config& c) {
  at::set_num_threads(1);
  c10d_world w = init_world_from_env();
  c10d_comm comm = w.comm();
  const bool lead = w.rank == 0;
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_from_name(c.optim), false, false, c.in, c.hidden);
  const file_directory root(c.dir / "checkpoints");
  int start = 0;
  if (role == "train") {
    if (auto latest = latest_checkpoint(root)) {
      auto sd = m.state();
      auto t0 = clock_type::now();
      auto rep = load_model_and_optim_state(root.sub(latest->name), sd, &m.optimizer(), comm);
      const double s = seconds_since(t0);
      start = static_cast<int>(latest->step);
      auto bytes = comm.all_gather_bytes(std::to_string(rep.model.bytes_read + rep.optim.stats.bytes_read));
      std::uint64_t total = 0;
      for (auto& b : bytes) total += std::stoull(b);
      if (lead)
        std::printf("  [world %d] resumed from %s: %s read by %d ranks in %.3f s (%s)\n", w.world_size, latest->name.c_str(),
                    mb(total).c_str(), w.world_size, s, gbps(total, s).c_str());
    } else if (lead) {
      std::printf("  [world %d] no checkpoint yet: starting from step 0\n", w.world_size);
    }
  }
  for (int step = start + 1; step <= c.steps; ++step) {
    const double loss = m.step(comm);
    if (lead) std::printf("  [world %d] step %2d  loss %.6f\n", w.world_size, step, loss);
    if (role == "train" && step % c.every == 0) {
      auto t0 = clock_type::now();
      auto st = save_model_and_optim_state(root.sub(checkpoint_name(step)), m.state(), &m.optimizer(), comm);
      const double s = seconds_since(t0);
      auto removed = rotate_checkpoints(root, static_cast<std::size_t>(c.keep), comm);
      if (lead) {
        std::printf("  [world %d] saved %s: %s (model %s, optimizer %s) in %.3f s (%s)", w.world_size,
                    checkpoint_name(step).c_str(), mb(st.total_bytes()).c_str(), mb(st.model.total_bytes).c_str(),
                    mb(st.optim.total_bytes).c_str(), s, gbps(st.total_bytes(), s).c_str());
        for (const auto& r : removed) std::printf("; rotated out %s", r.c_str());
        std::printf("\n");
      }
    }
    if (lead) {
      std::fflush(stdout);
      std::ofstream(c.dir / "progress") << step << "\n";
    }
    if (c.step_delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(c.step_delay_ms));
  }
  auto params = m.full_params(comm);
  if (lead) demo::write_params(c.dir / (role + "-final.safetensors"), params);
  comm.barrier();
  return 0;
}

// ---------------------------------------------------------------------------------------
// the launcher

int progress_of(const fs::path& dir) {
  std::ifstream f(dir / "progress");
  int s = 0;
  f >> s;
  return s;
}

bool run_world(const std::string& self, const config& c, const std::string& role, int world, int kill_after = 0) {
  launch_options o;
  local_world w(self, worker_args(c, role), world, o);
  if (kill_after > 0) {
    while (!w.poll()) {
      if (progress_of(c.dir) >= kill_after) {
        w.kill_all(SIGKILL);
        w.wait();
        std::printf("  >>> killed every rank with SIGKILL after step %d\n", progress_of(c.dir));
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  auto status = w.wait();
  for (std::size_t r = 0; r < status.size(); ++r)
    if (status[r] != 0) {
      std::printf("  rank %zu of the %s world exited with %d\n", r, role.c_str(), status[r]);
      return false;
    }
  return true;
}

bool same_tensors(const fs::path& a, const fs::path& b, std::string& why) {
  file_storage fa(a), fb(b);
  auto ha = read_safetensors_header(fa), hb = read_safetensors_header(fb);
  if (ha.tensors.size() != hb.tensors.size()) {
    why = "different tensor counts";
    return false;
  }
  for (const auto& t : ha.tensors) {
    const tensor_entry* u = hb.find(t.name);
    if (!u || u->shape != t.shape || u->type != t.type) {
      why = "tensor '" + t.name + "' differs in shape or dtype";
      return false;
    }
    std::vector<std::byte> x(t.nbytes()), y(u->nbytes());
    read_tensor(fa, ha, t, x);
    read_tensor(fb, hb, *u, y);
    if (x != y) {
      why = "tensor '" + t.name + "' differs";
      return false;
    }
  }
  return true;
}

int launcher(const std::string& self, config c) {
  std::error_code ec;
  fs::remove_all(c.dir, ec);
  fs::create_directories(c.dir);
  const auto t_all = clock_type::now();
  std::printf("shardsafe end-to-end demo: an MLP (%d -> %d -> %d, two param groups, %s), %d steps, checkpoint every %d, keep last %d\n",
              c.in, c.hidden, c.in, c.optim.c_str(), c.steps, c.every, c.keep);
  std::printf("work folder: %s\n\n", fs::absolute(c.dir).string().c_str());

  std::printf("1. reference: %d steps uninterrupted in a world of %d ranks\n", c.steps, c.world);
  if (!run_world(self, c, "reference", c.world)) return 1;

  std::printf("\n2. training in a world of %d ranks with checkpoints, killed after step %d\n", c.world, c.kill_after);
  fs::remove(c.dir / "progress", ec);
  config slow = c;
  slow.step_delay_ms = 300;  // slow enough that the kill lands while the job runs
  if (!run_world(self, slow, "train", c.world, c.kill_after)) return 1;
  for (const auto& e : list_checkpoints(file_directory(c.dir / "checkpoints")))
    std::printf("  on disk: %s (%s)\n", e.name.c_str(), e.complete ? "complete" : "incomplete: the kill cut its save");

  std::printf("\n3. resuming from the latest complete checkpoint in a world of %d ranks\n", c.resume_world);
  if (!run_world(self, c, "train", c.resume_world)) return 1;

  std::printf("\n4. checking the resumed run against the uninterrupted one\n");
  std::string why;
  const bool same = same_tensors(c.dir / "reference-final.safetensors", c.dir / "train-final.safetensors", why);
  std::printf("  final parameters bit for bit equal: %s%s\n", same ? "YES" : "NO: ", same ? "" : why.c_str());

  std::printf("\n5. unsharding the last checkpoint into one safetensors file\n");
  auto latest = latest_checkpoint(file_directory(c.dir / "checkpoints"));
  if (!latest) {
    std::printf("  no complete checkpoint\n");
    return 1;
  }
  const fs::path out = c.dir / "export" / "model.safetensors";
  fs::create_directories(out.parent_path());
  checkpoint_reader<file_directory> reader(file_directory(c.dir / "checkpoints" / latest->name / "model"));
  std::vector<unshard_source<file_directory>> src{{&reader, ""}};
  file_writer w(out);
  auto t0 = clock_type::now();
  const std::uint64_t size = unshard_to_safetensors(std::span<const unshard_source<file_directory>>(src), w);
  const double s = seconds_since(t0);
  std::printf("  %s -> %s: %s in %.3f s (%s)\n", latest->name.c_str(), out.string().c_str(), mb(size).c_str(), s,
              gbps(size, s).c_str());
  for (const auto& [k, tm] : reader.metadata().tensors)
    std::printf("    %-18s %s %s\n", k.c_str(), std::string(name(tm.type)).c_str(), to_string(tm.shape).c_str());
  std::printf("\ndone in %.1f s: %s\n", seconds_since(t_all), same ? "resume reproduced the uninterrupted run" : "MISMATCH");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines in order when stdout is a pipe
  try {
    if (std::getenv("RANK")) {
      if (argc < 2) return 2;
      return worker(argv[1], parse(argc - 1, argv + 1));
    }
    const std::string self = fs::read_symlink("/proc/self/exe").string();
    return launcher(self, parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_demo%s%s: %s\n", std::getenv("RANK") ? " rank " : "",
                 std::getenv("RANK") ? std::getenv("RANK") : "", e.what());
    return 1;
  }
}
