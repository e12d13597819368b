// mesh_resume - a 2-D device mesh job saved by 4 ranks and resumed by 2.
//
// The 4-rank job lays its model out FSDP2-style on a mesh [2, 2] ("replicate", "shard"), HSDP:
// every weight [replicate(), shard(0)] (two replicas of two row shards), its Adam moments with
// it. Each rank turns the mesh and placements into its block (mesh_shard: shard/mesh.hpp) and
// its replica role, so the save writes each block once, the two replicas taking turns. The job
// is then resumed by 2 ranks on a mesh [1, 2] (plain FSDP): each reads only the bytes of its
// new blocks, and checks them, and the Adam moments, bit for bit against the full tensors.
//
//   mesh_resume [--dir DIR]
//
// Run without RANK in the environment it is the launcher (like torchrun): it starts the two
// worlds of itself (c10d + Gloo on localhost) one after the other. With RANK set it is a worker.
#include <ATen/Parallel.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/dist/launch.hpp"
#include "shardsafe/shard/mesh.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/model_and_optim.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;

namespace {

struct param {
  std::string name;
  shape_t shape;
};

const std::vector<param> model = {{"fc1.weight", {96, 64}}, {"fc1.bias", {96}}, {"fc2.weight", {10, 96}}};

/// The full value of a tensor: the same bits in every process that computes it.
at::Tensor full_value(const std::string& name, const shape_t& shape, double scale) {
  const auto n = static_cast<std::int64_t>(numel(shape));
  double seed = 0;
  for (unsigned char c : name) seed = seed * 0.5 + c;
  return at::arange(n, at::kFloat).add(seed).mul(scale).sin().reshape(to_sizes(shape));
}

/// One rank of a world laid out on mesh [replicas, shards] by [replicate(), shard(0)].
int worker(const std::string& role, const fs::path& dir) {
  at::set_num_threads(1);
  c10d_world w = init_world_from_env();
  c10d_comm comm = w.comm();
  const std::uint64_t replicas = role == "save" ? 2 : 1, shards = static_cast<std::uint64_t>(w.world_size) / replicas;
  const device_mesh mesh({replicas, shards}, {"replicate", "shard"}, static_cast<std::uint64_t>(w.rank));
  const std::vector<placement> hsdp{replicate(), shard(0)};

  state_dict sd;
  std::vector<at::Tensor> params;
  std::vector<shard_info> where;
  for (std::size_t i = 0; i < model.size(); ++i) {
    // salt i: the tensors' blocks start on different replicas, so writes are spread
    where.push_back(mesh_shard(model[i].shape, mesh, hsdp, model[i].name, i));
    at::Tensor mine = block_of(full_value(model[i].name, model[i].shape, 0.01), where.back().spec.block());
    params.push_back(role == "save" ? mine : at::zeros_like(mine));
    sd.add(model[i].name, params.back(), where.back().spec, model[i].shape, where.back().replica);
  }
  torch::optim::Adam adam(params, torch::optim::AdamOptions(1e-3));
  auto state = [&](std::size_t i) -> torch::optim::AdamParamState& {
    auto* s = optimizer_state_of(adam, params[i]);  // LibTorch's state of a parameter, any version
    if (!s) throw std::runtime_error("no Adam state for " + model[i].name);
    return static_cast<torch::optim::AdamParamState&>(*s);
  };
  const file_directory ckpt(dir / "step-100");

  if (role == "save") {
    init_optimizer_state(adam);
    for (std::size_t i = 0; i < model.size(); ++i) {  // moments as a job would have them, by block
      state(i).exp_avg().copy_(
          block_of(full_value(model[i].name + ".m", model[i].shape, 0.003), where[i].spec.block()));
      state(i).exp_avg_sq().copy_(
          block_of(full_value(model[i].name + ".v", model[i].shape, 0.007), where[i].spec.block()).abs());
      state(i).step(100);
    }
    const model_and_optim_save_stats st =
        save_model_and_optim_state(ckpt, sd, &adam, comm, save_options{.overwrite = true});
    const auto written =
        comm.all_gather_bytes(std::to_string(st.model.bytes_written) + " " + std::to_string(st.optim.bytes_written));
    if (w.rank == 0) {
      std::printf("saved by %d ranks on mesh %s, placements %s:\n", w.world_size, mesh.describe().c_str(),
                  to_string(hsdp).c_str());
      for (std::size_t r = 0; r < written.size(); ++r)
        std::printf("  rank %zu (coordinates %s) wrote model + optimizer files of %s bytes\n", r,
                    to_string(mesh.coords_of(r)).c_str(), written[r].c_str());
      std::printf("  model: %llu bytes in all, each block written once by one of its 2 replicas\n",
                  static_cast<unsigned long long>(st.model.total_bytes));
    }
    return 0;
  }

  const model_and_optim_load_stats rep = load_model_and_optim_state(ckpt, sd, &adam, comm);
  int bad = 0;
  std::uint64_t need = 0;
  for (std::size_t i = 0; i < model.size(); ++i) {
    const block_spec& b = where[i].spec.block();
    need += b.local_numel() * 4;
    bad += !params[i].equal(block_of(full_value(model[i].name, model[i].shape, 0.01), b));
    bad += !state(i).exp_avg().equal(block_of(full_value(model[i].name + ".m", model[i].shape, 0.003), b));
    bad += !state(i).exp_avg_sq().equal(block_of(full_value(model[i].name + ".v", model[i].shape, 0.007), b).abs());
    bad += state(i).step() != 100;
  }
  const auto all = comm.all_gather_bytes(std::to_string(rep.model.bytes_read) + " " + std::to_string(need) + " " +
                                         std::to_string(bad));
  int bad_all = 0;
  for (std::size_t r = 0; r < all.size(); ++r) {
    unsigned long long read = 0, n = 0;
    int b = 0;
    std::sscanf(all[r].c_str(), "%llu %llu %d", &read, &n, &b);
    bad_all += b;
    if (w.rank == 0)
      std::printf("  resumed rank %zu (coordinates %s): read %llu model bytes for a %llu-byte block, %s\n", r,
                  to_string(mesh.coords_of(r)).c_str(), read, n, b ? "MISMATCH" : "bit for bit equal");
  }
  return bad_all == 0 ? 0 : 1;
}

int launcher(const std::string& self, const fs::path& dir) {
  for (const auto& [role, n] : {std::pair<std::string, int>{"save", 4}, {"resume", 2}}) {
    if (role == "resume") std::printf("resumed by 2 ranks on mesh [1,2] (FSDP, no replicas):\n");
    local_world w(self, {role, dir.string()}, n);
    const auto status = w.wait();
    for (std::size_t r = 0; r < status.size(); ++r)
      if (status[r] != 0) {
        std::printf("rank %zu of the %s world exited with %d\n", r, role.c_str(), status[r]);
        return 1;
      }
  }
  std::printf("OK: saved by 4 ranks on a 2-D mesh, resumed by 2, parameters and Adam state bit for bit\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  fs::path dir = "mesh-resume-run";
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "mesh_resume: a job on a 2-D device mesh [2, 2] (HSDP) saved by 4 ranks and resumed by 2\n"
          "(see the top of examples/mesh_resume.cpp).\n\n  mesh_resume [--dir DIR]\n");
      return 0;
    }
    if (a == "--dir" && i + 1 < argc) dir = argv[++i];
  }
  try {
    if (std::getenv("RANK")) {
      if (argc < 3) return 2;
      return worker(argv[1], argv[2]);
    }
    return launcher(fs::read_symlink("/proc/self/exe").string(), dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mesh_resume%s%s: %s\n", std::getenv("RANK") ? " rank " : "",
                 std::getenv("RANK") ? std::getenv("RANK") : "", e.what());
    return 1;
  }
}
