// Device meshes in real c10d worlds of processes (tests/torch/world.hpp): an HSDP save
// (2 replicas x 2 shards) of parameters with Adam state writes each block once, and loads
// into 3 ranks flat (FSDP) and 2 ranks by TP columns; stacked expert weights saved under
// EP = 2 x ep_fsdp = 2 load under EP = 4 and EP = 1 x 3. Expected tensors come from
// tests/torch/fixtures.hpp (values from a hash, shards cut with ATen's narrow/slice).
#include "shardsafe/torch/model_and_optim.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "shardsafe/shard/mesh.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "world.hpp"

using namespace shardsafe;
using testing::expected_full;
using testing::local_of;
using testing::same_bits;
using u64 = std::uint64_t;

namespace {

struct mesh_tensor {
  std::string key;
  dtype type;
  shape_t full;
};

/// The model of each layout: dense weights (with Adam state) or a MoE layer (model only).
std::vector<mesh_tensor> model_of(const std::string& layout) {
  if (layout.rfind("ep", 0) == 0)
    return {{"layers.0.experts.w1", dtype::F32, {6, 5, 4}}, {"layers.0.router", dtype::F32, {6, 5}}};
  return {{"w1", dtype::F32, {10, 6}}, {"w2", dtype::F64, {7, 4}}, {"b", dtype::F32, {6}}};
}

struct placed {
  std::optional<shard_spec> spec;
  replica_role role = replica_role::none;
};

/// How rank `rank` of a world of `world` holds tensor t (its index in the model: the writer salt).
placed place(const std::string& layout, const mesh_tensor& t, std::size_t index, int world, int rank) {
  auto on = [&](const shape_t& mesh, std::vector<std::string> names, std::vector<placement> pls) {
    const device_mesh m(mesh, std::move(names), static_cast<u64>(rank));
    if (m.size() != static_cast<u64>(world))
      throw std::runtime_error("layout " + layout + " needs " + std::to_string(m.size()) + " ranks");
    return placed{mesh_block(t.full, m, pls, t.key), mesh_replica_role(m, pls, index)};
  };
  if (layout == "hsdp") return on({2, 2}, {"replicate", "shard"}, {replicate(), shard(0)});
  if (layout == "tp2") return on({2}, {"tp"}, {t.full.size() > 1 ? shard(1) : shard(0)});
  if (layout == "flat3") return {testing::flat_part(t.full, world, rank), replica_role::none};
  // EP: "ep_A_B" is a mesh [A, B] ("ep", "ep_fsdp"); experts [shard(0), shard(1)], the router HSDP-like
  const auto a = static_cast<u64>(std::stoul(layout.substr(3, 1))),
             b = static_cast<u64>(std::stoul(layout.substr(5, 1)));
  if (t.key.find("experts") != std::string::npos) return on({a, b}, {"ep", "ep_fsdp"}, {shard(0), shard(1)});
  return on({a, b}, {"ep", "ep_fsdp"}, {replicate(), shard(0)});
}

at::Tensor state_want(const mesh_tensor& t, const std::string& which, const std::optional<shard_spec>& spec) {
  return local_of(expected_full("state." + t.key + "." + which, t.type, t.full, true), spec);
}

}  // namespace

// args: save|load, checkpoint dir, layout
WORKER_SCENARIO("mesh_state") {
  auto w = init_world_from_env();
  auto comm = w.comm();
  const std::string mode = args.at(0), layout = args.at(2);
  const file_directory dir(args.at(1));
  const bool with_optim = layout.rfind("ep", 0) != 0;
  const auto model = model_of(layout);
  state_dict sd;
  std::vector<at::Tensor> params;
  std::vector<placed> where;
  for (std::size_t i = 0; i < model.size(); ++i) {
    const auto& t = model[i];
    where.push_back(place(layout, t, i, w.world_size, w.rank));
    at::Tensor want = local_of(expected_full(t.key, t.type, t.full, true), where.back().spec).clone();
    at::Tensor local = mode == "save" ? want : at::zeros_like(want);
    params.push_back(local);
    if (where.back().spec)
      sd.add(t.key, local, *where.back().spec, t.full, where.back().role);
    else
      sd.add(t.key, local);
  }
  std::unique_ptr<torch::optim::Adam> adam;
  if (with_optim)
    adam = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(mode == "save" ? 1e-3 : 0.5));
  auto adam_state = [&](std::size_t i) -> torch::optim::AdamParamState& {
    auto* s = optimizer_state_of(*adam, params[i]);
    if (!s) throw std::runtime_error("no Adam state for " + model[i].key);
    return static_cast<torch::optim::AdamParamState&>(*s);
  };
  if (mode == "save") {
    if (adam) {  // Adam state of known values, sharded (and replicated) like its parameter
      init_optimizer_state(*adam);
      for (std::size_t i = 0; i < model.size(); ++i) {
        adam_state(i).exp_avg().copy_(state_want(model[i], "exp_avg", where[i].spec));
        adam_state(i).exp_avg_sq().copy_(state_want(model[i], "exp_avg_sq", where[i].spec));
        adam_state(i).step(static_cast<std::int64_t>(10 + i));
      }
    }
    save_model_and_optim_state(dir, sd, adam.get(), comm);
    return 0;
  }
  load_model_and_optim_state(dir, sd, adam.get(), comm);
  for (std::size_t i = 0; i < model.size(); ++i) {
    const auto& t = model[i];
    const at::Tensor want = local_of(expected_full(t.key, t.type, t.full, true), where[i].spec);
    if (!same_bits(params[i], want))
      throw std::runtime_error("rank " + std::to_string(w.rank) + ": " + t.key + " differs");
    if (!adam) continue;
    auto& st = adam_state(i);
    if (!same_bits(st.exp_avg(), state_want(t, "exp_avg", where[i].spec)) ||
        !same_bits(st.exp_avg_sq(), state_want(t, "exp_avg_sq", where[i].spec)))
      throw std::runtime_error("rank " + std::to_string(w.rank) + ": Adam state of " + t.key + " differs");
    if (st.step() != static_cast<std::int64_t>(10 + i))
      throw std::runtime_error("rank " + std::to_string(w.rank) + ": step of " + t.key + " is " +
                               std::to_string(st.step()));
    if (adam->param_groups()[0].options().get_lr() != 1e-3)
      throw std::runtime_error("rank " + std::to_string(w.rank) + ": lr not restored");
  }
  return 0;
}

namespace {

/// Data bytes (tensor bytes, headers excluded) of each rank file of a folder.
std::vector<u64> data_bytes(const std::filesystem::path& folder, int ranks) {
  std::vector<u64> out;
  for (int r = 0; r < ranks; ++r) {
    file_storage f(folder / rank_file_name(r));
    const auto h = read_safetensors_header(f);
    u64 n = 0;
    for (const auto& t : h.tensors) n += t.nbytes();
    out.push_back(n);
  }
  return out;
}

}  // namespace

TEST_CASE(
    "mesh worlds: HSDP (2 replicas x 2 shards) with Adam state writes each block once; loads 3 ranks flat and 2 by TP "
    "columns") {
  testing::temp_dir dir("mesh-hsdp");
  const std::string ckpt = (dir.path / "ckpt").string();
  auto saved = testing::run_world("mesh_state", 4, {"save", ckpt, "hsdp"});
  REQUIRE_MESSAGE(saved.ok(), saved.report());

  // Each tensor's rows split in two blocks (torch.chunk: ceil(n/2) rows, then the rest);
  // block k of the tensor at position t is written by replica (k + t) % 2 only: the rank at
  // mesh coordinates [replica, k] = 2 * replica + k. Its Adam moments go with it.
  std::vector<u64> want(4, 0);
  u64 total = 0;
  const auto model = model_of("hsdp");
  for (std::size_t t = 0; t < model.size(); ++t) {
    const auto& m = model[t];
    const u64 rows = m.full[0], rest = numel(m.full) / rows, first = (rows + 1) / 2;
    for (u64 k = 0; k < 2; ++k) {
      const u64 bytes = (k == 0 ? first : rows - first) * rest * item_size(m.type);
      want[2 * ((k + t) % 2) + k] += bytes;
      total += bytes;
    }
  }
  const auto model_bytes = data_bytes(dir.path / "ckpt" / "model", 4);
  CHECK(model_bytes == want);
  u64 sum = 0;
  for (u64 b : model_bytes) sum += b;
  CHECK(sum == total);  // every element once: no replica wrote its copy
  const auto optim_bytes = data_bytes(dir.path / "ckpt" / "optim", 4);
  for (int r = 1; r < 4; ++r) CHECK(optim_bytes[r] == 2 * want[r]);  // exp_avg and exp_avg_sq
  CHECK(optim_bytes[0] > 2 * want[0]);                               // and rank 0: steps, param groups, state keys

  for (const auto& [layout, n] : std::vector<std::pair<std::string, int>>{{"flat3", 3}, {"tp2", 2}}) {
    CAPTURE(layout);
    auto loaded = testing::run_world("mesh_state", n, {"load", ckpt, layout});
    CHECK_MESSAGE(loaded.ok(), loaded.report());
  }
}

TEST_CASE("mesh worlds: stacked experts saved under EP=2 x ep_fsdp=2 load under EP=4 x 1 and EP=1 x 3, bit-exact") {
  testing::temp_dir dir("mesh-ep");
  const std::string ckpt = (dir.path / "ckpt").string();
  auto saved = testing::run_world("mesh_state", 4, {"save", ckpt, "ep_2_2"});
  REQUIRE_MESSAGE(saved.ok(), saved.report());
  // the router [replicate(), shard(0)] is written once: its 30 F32 elements appear once in all
  u64 sum = 0;
  for (u64 b : data_bytes(dir.path / "ckpt" / "model", 4)) sum += b;
  CHECK(sum == (6 * 5 * 4 + 6 * 5) * 4);
  for (const auto& [layout, n] : std::vector<std::pair<std::string, int>>{{"ep_4_1", 4}, {"ep_1_3", 3}}) {
    CAPTURE(layout);
    auto loaded = testing::run_world("mesh_state", n, {"load", ckpt, layout});
    CHECK_MESSAGE(loaded.ok(), loaded.report());
  }
}
