// A LibTorch model + AdamW resumed from the trainers' own checkpoints (tests/fixtures/peers/:
// DeepSpeed's ZeRO and universal checkpoints, Megatron-Core's torch_dist and Megatron-LM's legacy
// ones) in real c10d worlds of other sizes and shardings than the trainer's, through
// load_model_and_optim_state (torch/train_layouts.hpp: trainer_train_layout).
//
// Each rank holds its piece (a flat element range, or a block of rows) of every parameter in an
// AdamW whose groups are the trainer's in the other order, with wrong hyper-parameters. After the
// load, every piece of the weights (the fp32 masters), exp_avg and exp_avg_sq, the step and the
// groups' lr and weight decay are the trainer's own (its expected/ files, read by the plain
// safetensors parser), bit for bit. Where the golden holds the trainer's own resumed step
// (expected/resume/: DeepSpeed's load_checkpoint and step 3; Megatron's dist_checkpointing.load
// at TP1 PP1 and step 3; the gradient it stepped with and its state after the step), each rank
// steps with its piece of that gradient, and then:
// - the pieces equal, bit for bit, LibTorch's AdamW stepped on one rank from the trainer's saved
//   tensors (no shardsafe load): the resharded resume is the unsharded one;
// - exp_avg_sq equals the trainer's, bit for bit; the weights and exp_avg are within 4 F32
//   epsilons (of their tensor's scale) of the trainer's. They cannot be equal: LibTorch's AdamW
//   updates exp_avg as exp_avg * beta1 + grad * (1 - beta1), torch.optim.AdamW (both trainers'
//   optimizer here) as exp_avg.lerp_(grad, 1 - beta1), which rounds otherwise (the peers check
//   that torch's AdamW gives their step bit for bit). The worker prints how many elements differ.
#include "shardsafe/torch/model_and_optim.hpp"

#include <ATen/Parallel.h>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <string_view>
#include <string>
#include <tuple>
#include <vector>

#include "fixtures.hpp"
#include "shardsafe/detail/json_dom.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "support/trainer_goldens.hpp"
#include "world.hpp"

using namespace shardsafe;

namespace {

namespace fs = std::filesystem;

const fs::path trainer_peers = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "peers";

/// The names a Megatron golden's module tensors are presented by in torch_dist (their keys in
/// checkpoint_keys.json, each stacked one per layer), or none for keys "-" (names kept).
std::map<std::string, std::string> presented_names(const std::string& keys) {
  std::map<std::string, std::string> out;
  if (keys == "-") return out;
  simdjson::dom::parser parser;
  const std::string text = testing::slurp(keys);
  for (const auto [module, v] : shardsafe::detail::parse_json(parser, text, keys).get_object()) {
    std::string_view key;
    if (v["key"].get(key) != simdjson::SUCCESS) throw std::runtime_error(keys + ": no key for " + std::string(module));
    out[std::string(module)] = testing::mc_name_of(std::string(module), std::string(key));
  }
  return out;
}

/// A golden's expected tensors as whole CPU tensors, by name, or by the name `rename` gives.
std::map<std::string, at::Tensor> golden_tensors(const fs::path& p,
                                                 const std::map<std::string, std::string>& rename = {}) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, g] : testing::read_golden_tensors(p)) {
    at::Tensor t = at::empty(to_sizes(g.shape), *to_scalar_type(g.type));
    std::memcpy(t.data_ptr(), g.bytes.data(), g.bytes.size());
    const auto it = rename.find(name);
    if (!rename.empty() && it == rename.end()) throw std::runtime_error(p.string() + ": no key for " + name);
    out[it == rename.end() ? name : it->second] = t;
  }
  return out;
}

/// How far a is from b, elementwise at most, in units of F32's epsilon (2^-23) times `scale`
/// (the largest magnitude among the step's inputs or outputs: rounding differences of a few
/// units in the last place stay within a few such units), and how many elements differ.
std::pair<double, std::int64_t> distance(const at::Tensor& a, const at::Tensor& b, double scale) {
  const at::Tensor d = (a.to(at::kDouble) - b.to(at::kDouble)).abs();
  return {d.numel() ? d.max().item<double>() / (scale * std::ldexp(1.0, -23)) : 0.0,
          a.ne(b).sum().item<std::int64_t>()};
}

double largest(std::initializer_list<at::Tensor> ts) {
  double m = 0;
  for (const auto& t : ts)
    if (t.numel()) m = std::max(m, t.abs().max().to(at::kDouble).item<double>());
  return m > 0 ? m : 1.0;
}

/// Zeroed F32 tensors for each of r's model tensors `wanted` keeps, whole, in sd; the tensors.
template <class Keep>
std::vector<at::Tensor> zeros_for(const checkpoint_reader<file_directory>& r, state_dict& sd, Keep&& wanted) {
  std::vector<at::Tensor> out;
  for (const auto& [name, tm] : r.metadata().tensors)
    if (!name.starts_with("optimizer.") && tm.type == dtype::F32 && wanted(name)) {
      out.push_back(at::zeros(to_sizes(tm.shape)));
      sd.add(name, out.back());
    }
  return out;
}

torch::optim::AdamWParamState& adamw_state(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto* s = optimizer_state_of(opt, p);
  testing::worker_check(s != nullptr, "no AdamW state for a parameter after the load");
  return static_cast<torch::optim::AdamWParamState&>(*s);
}

/// The folder of a golden's expected fp32, exp_avg and exp_avg_sq tensors: `exp`, or (Megatron
/// without the distributed optimizer keeps the model's weights, the fp32 parameters, as
/// model.safetensors) a copy under `tmp` with model.safetensors as fp32.safetensors. The
/// trainers' step is 2.
fs::path expected_folder(const fs::path& exp, const fs::path& tmp) {
  if (fs::exists(exp / "fp32.safetensors")) return exp;
  fs::create_directories(tmp / "exp");
  for (const char* f : {"exp_avg.safetensors", "exp_avg_sq.safetensors"}) fs::copy_file(exp / f, tmp / "exp" / f);
  fs::copy_file(exp / "model.safetensors", tmp / "exp" / "fp32.safetensors");
  return tmp / "exp";
}

}  // namespace

// args: checkpoint folder, expected folder (fp32, exp_avg, exp_avg_sq and module safetensors; with
// TP, expected/joined/ and the module's other tensors from expected/tp0/),
// sharding (below), the resume folder or "-" (the trainer's own step: grad, fp32, exp_avg,
// exp_avg_sq), the step saved, the weight decay of the group without decay as the trainer stored it,
// a Megatron golden's checkpoint_keys.json (torch_dist names) or "-"; optionally how replicas read
// (every_rank_reads | read_once: train_load_options::replica) and a file for this rank's reads.
// Shardings: flat (an element range a rank), rows, hsdp (element ranges over 2 shards, rank % 2:
// ranks r and r + 2 load the same pieces), dp (every rank the whole tensors)
WORKER_SCENARIO("trainer_adamw_resume") {
  at::set_num_threads(1);
  auto w = init_world_from_env();
  auto comm = w.comm();
  const file_directory ckpt(args.at(0));
  const fs::path exp(args.at(1));
  const std::string sharding = args.at(2);
  const int shards = sharding == "hsdp" ? 2 : sharding == "dp" ? 1 : w.world_size;
  const std::string resume = args.at(3);
  const std::int64_t saved_step = std::stoll(args.at(4));
  const double no_decay_wd = std::stod(args.at(5));
  const auto keys = presented_names(args.at(6));
  const auto fp32 = golden_tensors(exp / "fp32.safetensors", keys);
  const auto ea = golden_tensors(exp / "exp_avg.safetensors", keys);
  const auto eas = golden_tensors(exp / "exp_avg_sq.safetensors", keys);

  // this rank's piece of every trained parameter (F32: the masters come in), and the rest of the
  // module's tensors whole, in the checkpoint's dtype
  state_dict sd;
  std::map<std::string, std::optional<shard_spec>> spec;
  std::map<std::string, at::Tensor> local;
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& [name, full] : fp32) {
    const shape_t shape = shape_of(full);
    spec[name] = sharding == "rows" ? testing::block_part(shape, 0, w.world_size, w.rank)
                                    : testing::flat_part(shape, shards, w.rank % shards);
    local[name] = at::full_like(testing::local_of(full, spec[name]), 7.0f).requires_grad_(true);
    sd.add(name, local[name], *spec[name], shape);
    (full.dim() == 2 ? decay : no_decay).push_back(local[name]);
  }
  // the rest of the module: with TP (expected/joined/), TP rank 0's, presented as tp0/<name>
  const bool tp = exp.filename() == "joined";
  const fs::path module_file = tp ? exp.parent_path() / "tp0" / "module.safetensors" : exp / "module.safetensors";
  std::map<std::string, at::Tensor> buffers, module;
  if (fs::exists(module_file)) module = golden_tensors(module_file);
  for (const auto& [name, t] : module)
    if (!fp32.count(name)) sd.add((tp ? "tp0/" : "") + name, buffers[name] = at::zeros_like(t));
  // the trainer's groups in the other order, every hyper-parameter wrong
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(0.5).weight_decay(0.25).betas({0.5, 0.5}).eps(1.0)));
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(0.5).weight_decay(0.25).betas({0.5, 0.5}).eps(1.0)));
  torch::optim::AdamW adamw(groups, torch::optim::AdamWOptions(0.5));

  train_load_options lopt;
  if (args.size() > 7)
    lopt.replica.replicas = args.at(7) == "read_once" ? replica_reads::read_once : replica_reads::every_rank_reads;
  auto rep = load_model_and_optim_state(ckpt, sd, &adamw, comm, lopt);
  if (args.size() > 8)
    std::ofstream(args.at(8) + "." + std::to_string(w.rank))
        << rep.model.bytes_read << " " << rep.optim.stats.bytes_read << " "
        << rep.model.bytes_received + rep.optim.stats.bytes_received << " " << rep.model.replica_group << " "
        << rep.optim.stats.replica_group;
  // (with TP, the other TP rank's own tensors are this job's to leave)
  std::erase_if(rep.model.unexpected_keys, [&](const std::string& k) { return tp && k.starts_with("tp1/"); });
  testing::worker_check(rep.model.unexpected_keys.empty() && rep.optim.unexpected_keys.empty(),
                        "entries left unexpected: " + std::to_string(rep.model.unexpected_keys.size()) + " " +
                            std::to_string(rep.optim.unexpected_keys.size()) +
                            (rep.optim.unexpected_keys.empty() ? "" : " " + rep.optim.unexpected_keys.front()));
  std::size_t checked = 0;
  for (const auto& [name, p] : local) {
    const auto& st = adamw_state(adamw, p);
    testing::worker_check(testing::same_bits(p.detach(), testing::local_of(fp32.at(name), spec[name])),
                          name + ": the weights are not the trainer's fp32 master");
    testing::worker_check(testing::same_bits(st.exp_avg(), testing::local_of(ea.at(name), spec[name])),
                          name + ": exp_avg is not the trainer's");
    testing::worker_check(testing::same_bits(st.exp_avg_sq(), testing::local_of(eas.at(name), spec[name])),
                          name + ": exp_avg_sq is not the trainer's");
    testing::worker_check(st.step() == saved_step, name + ": step " + std::to_string(st.step()));
    checked += 4;
  }
  for (const auto& [name, t] : buffers)
    testing::worker_check(testing::same_bits(t, module.at(name)), name + ": the module's tensor differs");
  for (const auto& g : adamw.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(g.options());
    const bool decays = g.params().size() == decay.size() && g.params().front().is_same(decay.front());
    testing::worker_check(o.lr() == 1e-2 && o.eps() == 1e-8 && std::get<0>(o.betas()) == 0.9 &&
                              std::get<1>(o.betas()) == 0.999 && o.weight_decay() == (decays ? 0.01 : no_decay_wd),
                          "a group's hyper-parameters are not the trainer's");
  }
  if (resume == "-") {
    if (w.rank == 0) std::fprintf(stderr, "checked %zu pieces\n", checked);
    return 0;
  }

  // the trainer's resumed step, taken here with each rank's piece of its gradient
  const fs::path rs(resume);
  const auto grad = golden_tensors(rs / "grad.safetensors", keys);
  for (const auto& [name, p] : local) p.mutable_grad() = testing::local_of(grad.at(name), spec[name]);
  adamw.step();
  // LibTorch's AdamW on one rank, from the trainer's saved tensors
  std::map<std::string, at::Tensor> ref;
  std::vector<std::unique_ptr<torch::optim::AdamW>> ref_optims;
  for (const auto& [name, full] : fp32) {
    ref[name] = full.clone().requires_grad_(true);
    ref_optims.push_back(std::make_unique<torch::optim::AdamW>(
        std::vector<at::Tensor>{ref[name]},
        torch::optim::AdamWOptions(1e-2).weight_decay(full.dim() == 2 ? 0.01 : no_decay_wd)));
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(saved_step);
    s->exp_avg(ea.at(name).clone());
    s->exp_avg_sq(eas.at(name).clone());
    optimizer_state_slot(*ref_optims.back(), ref[name]) = std::move(s);
    ref[name].mutable_grad() = grad.at(name).clone();
    ref_optims.back()->step();
  }
  const auto ds_fp32 = golden_tensors(rs / "fp32.safetensors", keys);
  const auto ds_ea = golden_tensors(rs / "exp_avg.safetensors", keys);
  const auto ds_eas = golden_tensors(rs / "exp_avg_sq.safetensors", keys);
  double worst = 0;
  std::int64_t differ = 0, total = 0;
  std::size_t i = 0;
  for (const auto& [name, p] : local) {
    const auto& st = adamw_state(adamw, p);
    const auto& rst = adamw_state(*ref_optims.at(i++), ref.at(name));
    const auto& sp = spec[name];
    testing::worker_check(testing::same_bits(p.detach(), testing::local_of(ref.at(name).detach(), sp)) &&
                              testing::same_bits(st.exp_avg(), testing::local_of(rst.exp_avg(), sp)) &&
                              testing::same_bits(st.exp_avg_sq(), testing::local_of(rst.exp_avg_sq(), sp)),
                          name + ": the resharded step differs from LibTorch's AdamW stepped on one rank");
    testing::worker_check(testing::same_bits(st.exp_avg_sq(), testing::local_of(ds_eas.at(name), sp)),
                          name + ": exp_avg_sq after the step is not the trainer's");
    // scales: a weight's, before and after; exp_avg's inputs (its old value and the gradient)
    const double wscale = largest({fp32.at(name), ds_fp32.at(name)});
    const double mscale = largest({ea.at(name), grad.at(name)});
    for (const auto& [mine, theirs, scale] :
         {std::tuple{p.detach(), testing::local_of(ds_fp32.at(name), sp), wscale},
          std::tuple{st.exp_avg(), testing::local_of(ds_ea.at(name), sp), mscale}}) {
      const auto [u, n] = distance(mine, theirs, scale);
      worst = std::max(worst, u);
      differ += n;
      total += mine.numel();
    }
  }
  std::fprintf(stderr,
               "rank %d: weights and exp_avg after the step: %lld of %lld elements differ from the trainer's, by at "
               "most %.2f epsilon of their tensor's scale\n",
               w.rank, static_cast<long long>(differ), static_cast<long long>(total), worst);
  testing::worker_check(worst <= 4, "more than 4 epsilon from the trainer's own step");
  return 0;
}

TEST_CASE("trainer checkpoints: LibTorch model + AdamW resumed in other worlds, and the trainer's own next step") {
  struct golden_case {
    const char* golden;
    const char* folder;    // the checkpoint, under the golden
    const char* expected;  // the trainer's tensors, under the golden
    bool resume;           // expected/resume/ holds the trainer's own resumed step
    // the weight decay of the group without it, as stored: Megatron keeps the optimizer's 0.01 and
    // wd_mult 0 beside it (its scheduler multiplies them before a step; the peer ran none)
    const char* no_decay_wd;
    bool torch_dist = false;  // presented by torch_dist keys (expected/full/checkpoint_keys.json)
  };
  const golden_case cases[] = {
      {"zero2_fp32", "ckpt", "expected", true, "0"},
      {"zero3_bf16", "ckpt", "expected", true, "0"},
      {"zero3_bf16", "universal", "expected", true, "0"},
      {"zero1_bf16", "ckpt", "expected", false, "0"},  // BF16 weights in the files: the masters come in
      {"zero1_bf16", "universal", "expected", false, "0"},
      // TP 2: the pieces joined as universal_checkpoint_info says (expected/joined/)
      {"zero2_bf16_tp2", "ckpt", "expected/joined", false, "0"},
      {"zero2_bf16_tp2", "universal", "expected/joined", false, "0"},
      {"mcore_gpt_tp2_pp2", "legacy", "expected/full", true, "0.01"},
      {"mcore_moe_ep2", "legacy", "expected/full", true, "0.01"},
      {"mcore_gpt_tp2_pp2", "torch_dist", "expected/full", true, "0.01", true},
      {"mcore_moe_ep2", "torch_dist", "expected/full", true, "0.01", true},
      // the distributed optimizer: fp32 masters, and one step per param group
      {"mcore_distopt_tp2_dp2", "torch_dist_fully_reshardable", "expected/full", true, "0.01", true},
      {"mcore_distopt_tp2_dp2", "legacy", "expected/full", true, "0.01"},
      // bf16 weights: Float16OptimizerWithFloat16Params' fp32 masters are the weights that come in
      {"mcore_gpt_bf16_tp2", "legacy", "expected/full", true, "0.01"},
      {"mcore_gpt_bf16_tp2", "torch_dist", "expected/full", true, "0.01", true},
  };
  int worlds = 0;
  for (const auto& c : cases) {
    const fs::path g = trainer_peers / c.golden;
    testing::temp_dir tmp("trainer-resume");
    const fs::path exp = expected_folder(g / c.expected, tmp.path);
    for (const auto& [n, sharding] : {std::pair{3, "flat"}, std::pair{2, "rows"}}) {
      const std::string what =
          std::string(c.golden) + "/" + c.folder + ", " + std::to_string(n) + " ranks, " + sharding;
      CAPTURE(what);
      auto res = testing::run_world(
          "trainer_adamw_resume", n,
          {(g / c.folder).string(), exp.string(), sharding, c.resume ? (g / "expected" / "resume").string() : "-", "2",
           c.no_decay_wd, c.torch_dist ? (g / "expected" / "full" / "checkpoint_keys.json").string() : "-"});
      REQUIRE_MESSAGE(res.ok(), res.report());
      MESSAGE(res.err.front());
      ++worlds;
    }
  }
  CHECK(worlds == 30);
}

TEST_CASE("trainer checkpoints: the model alone, with no optimizer, strict or not") {
  // each Megatron form: the weights into one process's whole tensors, the optimizer's entries
  // and the tensors not asked for left aside
  for (const auto& [golden, folder] :
       {std::pair{"mcore_gpt_tp2_pp2", "torch_dist"}, std::pair{"mcore_distopt_tp2_dp2", "legacy"}}) {
    const std::string which = std::string(golden) + "/" + folder;
    CAPTURE(which);
    const file_directory dir(trainer_peers / golden / folder);
    single_process one;
    checkpoint_reader<file_directory> r(dir);
    state_dict sd;
    const auto params = zeros_for(r, sd, [](const std::string& name) { return name.ends_with(".weight"); });
    REQUIRE(params.size() > 4);
    train_load_options lo;
    const std::string why = testing::error_of([&] { load_model_and_optim_state(dir, sd, nullptr, one, lo); });
    CHECK(why.empty());  // strict: every tensor asked for is there
    lo.strict = false;
    const auto rep = load_model_and_optim_state(dir, sd, nullptr, one, lo);
    CHECK(rep.model.tensors == params.size());
    CHECK(rep.model.missing_keys.empty());
    for (const auto& [name, t] : sd) {
      std::vector<std::byte> want(t.local.nbytes());
      unshard_tensor(r, name, want);
      CHECK(std::memcmp(want.data(), t.local.data_ptr(), want.size()) == 0);
    }
  }
}

TEST_CASE("trainer checkpoints: groups the grouping rule cannot tell apart are not named, and refused by name") {
  // mcore_moe_ep2's torch_dist with its first group (weights) marked is_expert_parallel: two
  // groups of one kind, whose params Megatron's grouping rule cannot name. common.pt's data.pkl
  // is stored, so one byte changes in place (shardsafe's reader does not check the zip's CRC)
  testing::temp_dir tmp("trainer-groups");
  const fs::path dst = tmp.path / "torch_dist";
  fs::copy(trainer_peers / "mcore_moe_ep2" / "torch_dist", dst, fs::copy_options::recursive);
  const fs::path common = dst / "iter_0000002" / "common.pt";
  std::string bytes = testing::slurp(common);
  const std::string key = "is_expert_parallel";
  const auto at = bytes.find(key);
  REQUIRE(at != std::string::npos);
  REQUIRE(bytes.find(key, at + 1) == std::string::npos);  // later groups refer to it by memo
  const std::size_t value = at + key.size() + 5;          // after LONG_BINPUT (r + 4 bytes)
  REQUIRE(bytes[at + key.size()] == 'r');
  REQUIRE(static_cast<unsigned char>(bytes[value]) == 0x89);  // NEWFALSE
  bytes[value] = static_cast<char>(0x88);                     // NEWTRUE
  std::ofstream(common, std::ios::binary | std::ios::trunc) << bytes;

  const file_directory dir(dst);
  checkpoint_reader<file_directory> r(dir);
  CHECK(!r.find_object("optimizer.param_groups.0.params"));
  CHECK(r.read_object("megatron.layout").as_string("").find("two param groups of weights, experts") !=
        std::string::npos);
  state_dict sd;
  const auto params = zeros_for(r, sd, [](const std::string&) { return true; });
  single_process one;
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-3));
  const std::string why = testing::error_of([&] { load_model_and_optim_state(dir, sd, &adamw, one); });
  CAPTURE(why);
  CHECK(why.find("'optimizer.param_groups.0.params'") != std::string::npos);
  CHECK(why.find("does not list its parameters by name") != std::string::npos);
  CHECK(why.find("load the model alone") != std::string::npos);
  const auto rep = load_model_and_optim_state(dir, sd, nullptr, one);
  CHECK(rep.model.tensors == params.size());
}

TEST_CASE("trainer checkpoints: data-parallel and HSDP replicas read each byte once with replicas") {
  // 4 c10d ranks over Gloo load a DeepSpeed ZeRO-1 checkpoint (bf16 files: the fp32 masters come
  // in) and Megatron's distributed optimizer (torch_dist), every piece checked bit for bit as
  // above; dp: every rank the whole model (one group of 4), hsdp: element ranges over 2 shards
  // (groups of 2). Summed over ranks, read_once reads each stored byte once, whatever the
  // sharding: exactly what dp reads once, a quarter of what dp's every_rank_reads reads.
  struct golden_case {
    const char *golden, *folder, *expected;
    bool resume;
    const char* no_decay_wd;
    bool torch_dist;
  };
  const golden_case cases[] = {
      {"zero1_bf16", "ckpt", "expected", false, "0", false},
      {"mcore_distopt_tp2_dp2", "torch_dist_fully_reshardable", "expected/full", true, "0.01", true}};
  constexpr int ranks = 4;
  for (const auto& c : cases) {
    const fs::path g = trainer_peers / c.golden;
    testing::temp_dir tmp("trainer-replicas");
    const fs::path exp = expected_folder(g / c.expected, tmp.path);
    // [sharding + mode] -> model read, optimizer read, received, summed over ranks
    std::map<std::string, std::array<std::uint64_t, 3>> sums;
    for (const std::string sharding : {"dp", "hsdp"})
      for (const std::string mode : {"every_rank_reads", "read_once"}) {
        const std::string what = std::string(c.golden) + "/" + c.folder + ", " + sharding + ", " + mode;
        CAPTURE(what);
        const fs::path st = tmp.path / ("st-" + sharding + "-" + mode);
        auto res = testing::run_world(
            "trainer_adamw_resume", ranks,
            {(g / c.folder).string(), exp.string(), sharding, c.resume ? (g / "expected" / "resume").string() : "-",
             "2", c.no_decay_wd, c.torch_dist ? (g / "expected" / "full" / "checkpoint_keys.json").string() : "-", mode,
             st.string()});
        REQUIRE_MESSAGE(res.ok(), res.report());
        auto& s = sums[sharding + " " + mode];
        s = {};
        for (int r = 0; r < ranks; ++r) {
          std::ifstream f(st.string() + "." + std::to_string(r));
          std::uint64_t model = 0, optim = 0, received = 0, group_m = 0, group_o = 0;
          f >> model >> optim >> received >> group_m >> group_o;
          REQUIRE(static_cast<bool>(f));
          s[0] += model;
          s[1] += optim;
          s[2] += received;
          const std::uint64_t group = mode == "every_rank_reads" ? 1 : sharding == "dp" ? 4 : 2;
          CHECK(group_m >= group);
          CHECK(group_o >= group);
        }
        MESSAGE(what << ": model " << s[0] << " B, optimizer " << s[1] << " B read, " << s[2] << " B received");
      }
    const auto &every = sums["dp every_rank_reads"], &once = sums["dp read_once"], &hsdp = sums["hsdp read_once"];
    CHECK(every[0] > 0);
    CHECK(every[1] > 0);
    CHECK(every[2] == 0);
    CHECK(sums["hsdp every_rank_reads"][2] == 0);
    CHECK(once[0] * ranks == every[0]);
    CHECK(once[1] * ranks == every[1]);
    CHECK(once[2] == (ranks - 1) * (once[0] + once[1]));
    CHECK(hsdp[0] == once[0]);
    CHECK(hsdp[1] == once[1]);
    CHECK(hsdp[2] > 0);
  }
}
