// train_demo - the end-to-end job of the README, the whole life of a model: it starts from a
// Hugging Face folder (written first: a small "pretrained" model, BF16, indexed over several
// files), imports it into a multi-process world on localhost (c10d + Gloo) with every rank
// reading only its slice, trains, checkpoints every few steps with keep-last-N rotation, gets
// killed, resumes in a world of another size, checks that the resumed run reproduced an
// uninterrupted one bit for bit, and exports the last checkpoint to a Hugging Face folder whose
// values it checks against the trained parameters.
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
#include <string_view>
#include <thread>
#include <vector>

#include "sharded_mlp.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "shardsafe/checkpoint/hf/export.hpp"
#include "shardsafe/checkpoint/hf/export_views.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/hf_state_dict.hpp"
#include "shardsafe/dist/launch.hpp"
#include "shardsafe/dist/single.hpp"
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
    if (a == "--dir")
      c.dir = next();
    else if (a == "--steps")
      c.steps = std::stoi(next());
    else if (a == "--every")
      c.every = std::stoi(next());
    else if (a == "--keep")
      c.keep = std::stoi(next());
    else if (a == "--kill-after")
      c.kill_after = std::stoi(next());
    else if (a == "--world")
      c.world = std::stoi(next());
    else if (a == "--resume-world")
      c.resume_world = std::stoi(next());
    else if (a == "--optim")
      c.optim = next();
    else if (a == "--in")
      c.in = std::stoi(next());
    else if (a == "--hidden")
      c.hidden = std::stoi(next());
    else if (a == "--step-delay-ms")
      c.step_delay_ms = std::stoi(next());
    else
      throw std::invalid_argument("unknown option " + a);
  }
  return c;
}

std::vector<std::string> worker_args(const config& c, const std::string& role) {
  return {role,
          "--dir",
          c.dir.string(),
          "--steps",
          std::to_string(c.steps),
          "--every",
          std::to_string(c.every),
          "--keep",
          std::to_string(c.keep),
          "--optim",
          c.optim,
          "--in",
          std::to_string(c.in),
          "--hidden",
          std::to_string(c.hidden),
          "--step-delay-ms",
          std::to_string(c.step_delay_ms)};
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}
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
// the "pretrained" model: a Hugging Face folder, as a hub download would give

/// The folder's names carry a "model." prefix that the import maps away with a rename rule.
const char* const pretrained_rename = R"(^model\.(.*)=\1)";

/// Writes the demo model's initial parameters as an indexed BF16 Hugging Face folder (files of
/// at most a third of the weights), from full tensors in this one process.
hf_export_stats write_pretrained(const config& c) {
  std::vector<at::Tensor> keep;
  std::vector<flat_view> views;
  for (const auto& d : demo::mlp_params(c.in, c.hidden)) {
    keep.push_back(demo::initial_value(d).contiguous());
    views.push_back(make_flat_view("model." + d.name, keep.back()));
  }
  hf_export_options o;
  o.convert_to = dtype::BF16;
  o.max_shard_size = demo::sharded_mlp(1, 0, demo::optim_kind::sgd, false, false, c.in, c.hidden).param_bytes() / 2 / 3;
  single_process one;
  return export_to(std::span<const flat_view>(views), one, c.dir / "pretrained", o);
}

// ---------------------------------------------------------------------------------------
// a worker: one rank

/// Imports the pretrained folder into this rank's shards: every rank reads only the bytes of
/// its own slices (BF16 in the files, converted to the F32 parameters while copying).
template <class C>
void import_pretrained(const config& c, demo::sharded_mlp& m, C& comm, int world_size, bool lead) {
  hf_import_options o;
  o.rename.add(pretrained_rename);
  o.strict = true;  // every parameter must come from the folder
  state_dict sd = m.state();
  auto t0 = clock_type::now();
  hf_import_stats res = load_hf_state_dict(file_directory(c.dir / "pretrained"), sd, comm, o);
  const double s = seconds_since(t0);
  std::uint64_t shard = 0;  // this rank's slice as stored: BF16
  for (const auto& [k, t] : sd) shard += static_cast<std::uint64_t>(t.local.numel()) * 2;
  auto all = comm.all_gather_bytes(std::to_string(res.stats.bytes_read) + " " + std::to_string(shard));
  if (!lead) return;
  std::printf("  [world %d] imported %s in %.3f s (%s), every rank reading only its slice:\n", world_size,
              (c.dir / "pretrained").string().c_str(), s, res.message.c_str());
  for (std::size_t r = 0; r < all.size(); ++r) {
    unsigned long long read = 0, need = 0;
    std::sscanf(all[r].c_str(), "%llu %llu", &read, &need);
    std::printf("    rank %zu read %s for a %s slice (%.3fx)\n", r, mb(read).c_str(), mb(need).c_str(),
                need ? double(read) / double(need) : 0.0);
  }
}

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
        std::printf("  [world %d] resumed from %s: %s read by %d ranks in %.3f s (%s)\n", w.world_size,
                    latest->name.c_str(), mb(total).c_str(), w.world_size, s, gbps(total, s).c_str());
    } else {
      if (lead) std::printf("  [world %d] no checkpoint yet: starting from the pretrained weights\n", w.world_size);
      import_pretrained(c, m, comm, w.world_size, lead);
    }
  } else {
    import_pretrained(c, m, comm, w.world_size, lead);
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
  std::printf(
      "shardsafe end-to-end demo: an MLP (%d -> %d -> %d, two param groups, %s), %d steps, checkpoint every %d, keep "
      "last %d\n",
      c.in, c.hidden, c.in, c.optim.c_str(), c.steps, c.every, c.keep);
  std::printf("work folder: %s\n\n", fs::absolute(c.dir).string().c_str());

  std::printf("0. a pretrained model as a Hugging Face folder (BF16, indexed)\n");
  {
    auto st = write_pretrained(c);
    std::printf("  %s: %zu files + index, %s\n\n", (c.dir / "pretrained").string().c_str(), st.files,
                mb(st.bytes).c_str());
  }

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
  bool same = same_tensors(c.dir / "reference-final.safetensors", c.dir / "train-final.safetensors", why);
  std::printf("  final parameters bit for bit equal: %s%s\n", same ? "YES" : "NO: ", same ? "" : why.c_str());

  std::printf("\n5. exporting the last checkpoint to a Hugging Face folder\n");
  auto latest = latest_checkpoint(file_directory(c.dir / "checkpoints"));
  if (!latest) {
    std::printf("  no complete checkpoint\n");
    return 1;
  }
  const fs::path out = c.dir / "hf-export";
  hf_export_options o;
  o.max_shard_size = 1'000'000;  // small files, to show the index
  const hf_export_stats st = export_to(file_directory(c.dir / "checkpoints" / latest->name), file_directory(out), o);
  std::printf("  %s -> %s: %zu file%s%s, %s in %.3f s (%s)\n", latest->name.c_str(), out.string().c_str(), st.files,
              st.files == 1 ? "" : "s", st.indexed ? " + index" : "", mb(st.bytes).c_str(), st.seconds,
              gbps(st.bytes, st.seconds).c_str());
  // the export read back as a checkpoint, against the parameters the training job gathered
  // (when the last checkpoint is the last step)
  bool exported_same = true;
  if (latest->step != static_cast<std::uint64_t>(c.steps)) {
    std::printf("  (the last checkpoint is not the last step: values not compared)\n");
  } else {
    checkpoint_reader<file_directory> hf(file_directory{out});
    file_storage fin(c.dir / "train-final.safetensors");
    const auto h = read_safetensors_header(fin);
    exported_same = hf.metadata().tensors.size() == h.tensors.size();
    for (const auto& t : h.tensors) {
      std::vector<std::byte> want(t.nbytes()), got(t.nbytes());
      read_tensor(fin, h, t, want);
      if (!hf.find(t.name)) {
        exported_same = false;
        continue;
      }
      unshard_tensor(hf, t.name, got);
      exported_same = exported_same && want == got;
    }
    std::printf("  exported values bit for bit equal to the trained parameters: %s\n", exported_same ? "YES" : "NO");
  }
  same = same && exported_same;
  std::printf("\ndone in %.1f s: %s\n", seconds_since(t_all),
              same ? "resume reproduced the uninterrupted run" : "MISMATCH");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines in order when stdout is a pipe
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::printf(
          "train_demo: the whole life of a model (see the top of examples/train_demo.cpp):\n"
          "a pretrained Hugging Face folder imported into a sharded world, training with\n"
          "rotating checkpoints, a kill, a resume on another world size, an HF export.\n\n"
          "  train_demo [--dir DIR] [--steps 12] [--every 3] [--keep 2] [--kill-after 7]\n"
          "             [--world 2] [--resume-world 3] [--optim adamw|adam|sgd|adagrad|rmsprop]\n"
          "             [--in 512] [--hidden 2048]\n");
      return 0;
    }
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
