// Model + optimizer checkpoints: bit-exact resume across world sizes for every supported
// optimizer, param groups, strictness, unsharding optimizer state, and Python's pickle.
#include "shardsafe/torch/model_and_optim.hpp"

#include <ATen/Parallel.h>

#include <doctest/doctest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../examples/sharded_mlp.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/file.hpp"
#include "fixtures.hpp"
#include "world.hpp"

using namespace shardsafe;

using demo::write_params;
using testing::slurp;

// args: optimizer, checkpoint dir, output file, mode (save|load), steps before, steps after
WORKER_SCENARIO("train_resume") {
  at::set_num_threads(1);
  auto w = init_world_from_env();
  auto comm = w.comm();
  const auto kind = demo::optim_from_name(args.at(0));
  const file_directory ckpt(args.at(1));
  const std::string out = args.at(2), mode = args.at(3);
  const int before = std::stoi(args.at(4)), after = std::stoi(args.at(5));
  if (mode == "save") {
    demo::sharded_mlp m(w.world_size, w.rank, kind);
    for (int s = 0; s < before; ++s) m.step(comm);
    save_model_and_optim_state(ckpt, m.state(), &m.optimizer(), comm);
    // the unsharded optimizer state equals the ranks' shards, gathered
    if (before > 0 && kind != demo::optim_kind::sgd) {
      full_optimizer_state full = w.rank == 0 ? unshard_optim_state(ckpt.sub("optim")) : full_optimizer_state{};
      auto sd = m.state();
      for (const auto& [name, st] : sd) {
        auto* ps = optimizer_state_of(m.optimizer(), st.local);
        if (!ps) {
          std::fprintf(stderr, "no optimizer state for %s\n", name.c_str());
          return 4;
        }
        const std::string key = kind == demo::optim_kind::adagrad   ? "sum"
                                : kind == demo::optim_kind::rmsprop ? "square_avg"
                                                                    : "exp_avg";
        at::Tensor* shard = nullptr;
        if (kind == demo::optim_kind::adagrad)
          shard = &static_cast<torch::optim::AdagradParamState&>(*ps).sum();
        else if (kind == demo::optim_kind::rmsprop)
          shard = &static_cast<torch::optim::RMSpropParamState&>(*ps).square_avg();
        else if (kind == demo::optim_kind::adam)
          shard = &static_cast<torch::optim::AdamParamState&>(*ps).exp_avg();
        else
          shard = &static_cast<torch::optim::AdamWParamState&>(*ps).exp_avg();
        auto parts =
            comm.all_gather_bytes(std::string_view(static_cast<const char*>(shard->data_ptr()), shard->nbytes()));
        if (w.rank == 0) {
          std::string all;
          for (auto& p : parts) all += p;
          const at::Tensor& f = full.state.at(name).at(key);
          if (shape_of(f) != st.full_shape || all.size() != f.nbytes() ||
              std::memcmp(all.data(), f.data_ptr(), all.size())) {
            std::fprintf(stderr, "unshard_optim_state: %s %s differs from the gathered shards\n", name.c_str(),
                         key.c_str());
            return 5;
          }
        }
      }
    }
    for (int s = 0; s < after; ++s) m.step(comm);
    auto params = m.full_params(comm);
    if (w.rank == 0) write_params(out, params);
    return 0;
  }
  // load: another world size, zeroed weights, wrong learning rates, groups in the other order
  demo::sharded_mlp m(w.world_size, w.rank, kind, /*group_order_reversed=*/true, /*zero_init=*/true);
  auto sd = m.state();
  load_model_and_optim_state(ckpt, sd, &m.optimizer(), comm);
  // learning rates came back from the checkpoint: weights 0.05, the rest 0.02 (groups reversed here)
  for (auto& g : m.optimizer().param_groups()) {
    const double lr = g.options().get_lr();
    const bool weights = g.params().size() == 2;
    if (std::abs(lr - (weights ? 0.05 : 0.02)) > 0) {
      std::fprintf(stderr, "rank %d: a group's lr is %g after loading\n", w.rank, lr);
      return 6;
    }
  }
  for (int s = 0; s < after; ++s) m.step(comm);
  auto params = m.full_params(comm);
  if (w.rank == 0) write_params(out, params);
  return 0;
}

TEST_CASE("bit-exact resume in worlds of 2, 1 and 3 ranks for every optimizer") {
  for (const char* opt : {"adam", "adamw", "sgd", "adagrad", "rmsprop"}) {
    for (int before : {3, 0}) {
      if (before == 0 && std::string(opt) != "adam" && std::string(opt) != "sgd") continue;
      CAPTURE(opt);
      CAPTURE(before);
      testing::temp_dir dir(std::string("resume-") + opt);
      const std::string ckpt = (dir.path / "ckpt").string();
      auto a = testing::run_world(
          "train_resume", 2, {opt, ckpt, (dir.path / "a.safetensors").string(), "save", std::to_string(before), "3"});
      REQUIRE_MESSAGE(a.ok(), a.report());
      auto b = testing::run_world(
          "train_resume", 1, {opt, ckpt, (dir.path / "b.safetensors").string(), "load", std::to_string(before), "3"});
      REQUIRE_MESSAGE(b.ok(), b.report());
      auto c = testing::run_world(
          "train_resume", 3, {opt, ckpt, (dir.path / "c.safetensors").string(), "load", std::to_string(before), "3"});
      REQUIRE_MESSAGE(c.ok(), c.report());
      const std::string fa = slurp(dir.path / "a.safetensors");
      CHECK(fa.size() > 1000);
      CHECK_MESSAGE(fa == slurp(dir.path / "b.safetensors"), "world 1 resume differs from the uninterrupted run");
      CHECK_MESSAGE(fa == slurp(dir.path / "c.safetensors"), "world 3 resume differs from the uninterrupted run");
      // and the training moved the weights: resuming from the wrong (zero) weights would not give this
      demo::sharded_mlp fresh(1, 0, demo::optim_from_name(opt));
      single_process one;
      testing::temp_dir d2("fresh");
      write_params((d2.path / "f.safetensors").string(), fresh.full_params(one));
      CHECK(fa != slurp(d2.path / "f.safetensors"));
    }
  }
}

TEST_CASE("optimizer checkpoint layout, param group pickles and strictness") {
  single_process comm;
  testing::temp_dir dir("optim-layout");
  const file_directory ckpt(dir.path / "c");
  demo::sharded_mlp m(1, 0, demo::optim_kind::adamw);
  m.step(comm);
  save_model_and_optim_state(ckpt, m.state(), &m.optimizer(), comm);

  auto r = checkpoint_reader<file_directory>(ckpt.sub("optim"));
  const auto& md = r.metadata();
  const auto* n = md.find("num_param_groups");
  REQUIRE(n);
  CHECK(n->type == dtype::I64);
  CHECK(n->shape.empty());
  const auto* st = md.find("state.layers.0.weight.__exp_avg");
  REQUIRE(st);
  CHECK(st->is_sharded);
  CHECK(st->shape == shape_t{48, 24});
  const auto* step = md.find("state.layers.0.weight.__step");
  REQUIRE(step);
  CHECK(step->type == dtype::F32);
  CHECK(step->shape.empty());
  CHECK_FALSE(step->is_sharded);
  CHECK(md.find("state.layers.0.weight.__max_exp_avg_sq"));  // amsgrad

  auto full = unshard_optim_state(ckpt.sub("optim"));
  REQUIRE(full.param_groups.size() == 2);
  const auto& g0 = full.param_groups[0];
  CHECK(g0.at("lr", "g0").as_real("lr") == doctest::Approx(0.05));
  CHECK(g0.at("weight_decay", "g0").as_real("wd") == doctest::Approx(0.1));
  const auto& names = g0.at("_param_names", "g0").as_sequence("names");
  REQUIRE(names.size() == 2);
  CHECK(names[0].as_string("") == "layers.0.weight");
  CHECK(full.state.at("layers.0.bias").at("step").item<float>() == 1.0f);

  SUBCASE("the tool digests model/ and optim/ with prefixes") {
    if (testing::tool_subcase_skipped()) return;
    auto d = testing::run_tool({"digest", (dir.path / "c").string()});
    REQUIRE_MESSAGE(d.code == 0, d.err);
    const at::Tensor& exp_avg = full.state.at("layers.1.weight").at("exp_avg");
    const std::string line = "optim/state.layers.1.weight.__exp_avg F32 [24,48] " + testing::sha256_hex(exp_avg) + "\n";
    CHECK(d.out.find(line) != std::string::npos);
    auto params = m.full_params(comm);
    const std::string mline = "model/layers.0.weight F32 [48,24] " + testing::sha256_hex(params[0].second) + "\n";
    CHECK(d.out.find(mline) != std::string::npos);
  }
  SUBCASE("Python's pickle reads the param groups we write") {
    if (std::system("python3 -c 'import pickle' >/dev/null 2>&1") != 0) {
      // the README's test command sets SHARDSAFE_REQUIRE_PYTHON=1: there a missing Python fails
      REQUIRE_MESSAGE(std::getenv("SHARDSAFE_REQUIRE_PYTHON") == nullptr,
                      "python3 is required (SHARDSAFE_REQUIRE_PYTHON)");
      MESSAGE("python3 not available: skipped");
      return;
    }
    at::Tensor bytes;
    for (auto& [k, t] : unshard_state(ckpt.sub("optim")))
      if (k == "param_group0") bytes = t;
    REQUIRE(bytes.defined());
    const auto pk = dir.path / "g0.pickle";
    std::ofstream(pk, std::ios::binary).write(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
    const auto outp = dir.path / "py.txt";
    const std::string cmd =
        "python3 -c \"import pickle,sys; d=pickle.load(open(sys.argv[1],'rb')); "
        "print(d['lr'], d['betas'], d['eps'], d['weight_decay'], d['amsgrad'], d['params'], d['_param_names'])\" '" +
        pk.string() + "' > '" + outp.string() + "'";
    REQUIRE(std::system(cmd.c_str()) == 0);
    CHECK(slurp(outp) == "0.05 (0.9, 0.999) 1e-08 0.1 True [0, 1] ['layers.0.weight', 'layers.1.weight']\n");
  }
  SUBCASE("a parameter the checkpoint lacks: an error when strict, listed otherwise") {
    demo::sharded_mlp m2(1, 0, demo::optim_kind::adamw);
    auto sd = m2.state();
    at::Tensor extra = at::zeros({5}).set_requires_grad(true);
    sd.add("extra.weight", extra);
    m2.optimizer().param_groups()[0].params().push_back(extra);
    std::string msg;
    try {
      load_model_and_optim_state(ckpt, sd, &m2.optimizer(), comm);
    } catch (const shardsafe::error& e) {
      msg = e.what();
    }
    CHECK(msg.find("'extra.weight'") != std::string::npos);
    train_load_options lax;
    lax.strict = false;
    auto rep = load_model_and_optim_state(ckpt, sd, &m2.optimizer(), comm, lax);
    CHECK(rep.model.missing_keys == std::vector<std::string>{"extra.weight"});
    CHECK(rep.optim.missing_params == std::vector<std::string>{"extra.weight"});
  }
  SUBCASE("a save into a non-empty folder needs overwrite; the pair commits with model/metadata.json") {
    std::string msg;
    try {
      save_model_and_optim_state(ckpt, m.state(), &m.optimizer(), comm);
    } catch (const shardsafe::error& e) {
      msg = e.what();
    }
    CHECK(msg.find("not empty") != std::string::npos);
    save_options o;
    o.overwrite = true;
    save_model_and_optim_state(ckpt, m.state(), &m.optimizer(), comm, o);
    CHECK(is_complete_checkpoint(ckpt));
    std::filesystem::remove(dir.path / "c" / "model" / "metadata.json");
    CHECK_FALSE(is_complete_checkpoint(ckpt));
    try {
      auto sd = m.state();
      load_model_and_optim_state(ckpt, sd, &m.optimizer(), comm);
      msg.clear();
    } catch (const shardsafe::error& e) {
      msg = e.what();
    }
    CHECK(msg.find("not a complete checkpoint") != std::string::npos);
  }
}

namespace {

/// One optimizer family with two param groups of hyper-parameters away from the defaults; the
/// same values in Python (torch.optim) and the keys shardsafe writes, in the order it writes them.
struct family_case {
  const char* name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)> make;
  std::function<std::unique_ptr<torch::optim::OptimizerOptions>(int)> options;  // group 0 or 1
  std::string py_options;                                                       // Python kwargs per group
  std::string py_keys;
  std::array<std::string, 2> golden;  // hex of param_group0/1 as written before the traits were one list
};

template <class Opt, class Options>
std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)> maker() {
  return [](std::vector<torch::optim::OptimizerParamGroup> g) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<Opt>(std::move(g), Options(1.0));  // defaults for groups without options: none here
  };
}

std::vector<family_case> family_cases() {
  using namespace torch::optim;
  std::vector<family_case> c;
  c.push_back(
      {"Adam",
       maker<Adam, AdamOptions>(),
       [](int g) -> std::unique_ptr<OptimizerOptions> {
         auto o = std::make_unique<AdamOptions>(g ? 0.5 : 3e-4);
         o->betas({g ? 0.8 : 0.9, g ? 0.9 : 0.95}).eps(g ? 1e-6 : 1e-8).weight_decay(g ? 0.0 : 0.1).amsgrad(g == 1);
         return o;
       },
       "[dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False),"
       " dict(lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0, amsgrad=True)]",
       "['lr', 'betas', 'eps', 'weight_decay', 'amsgrad']",
       {"80027d2858020000006c72473f33a92a3055326158050000006265746173473feccccccccccccd473fee666666666666"
        "865803000000657073473e45798ee2308c3a580c0000007765696768745f6465636179473fb999999999999a58070000"
        "00616d7367726164895806000000706172616d735d284b004b0165580c0000005f706172616d5f6e616d65735d285808"
        "000000612e7765696768745806000000612e6269617365752e",
        "80027d2858020000006c72473fe000000000000058050000006265746173473fe999999999999a473feccccccccccccd"
        "865803000000657073473eb0c6f7a0b5ed8d580c0000007765696768745f646563617947000000000000000058070000"
        "00616d7367726164885806000000706172616d735d4b0261580c0000005f706172616d5f6e616d65735d580800000062"
        "2e77656967687461752e"}});
  c.push_back({"AdamW",
               maker<AdamW, AdamWOptions>(),
               [](int g) -> std::unique_ptr<OptimizerOptions> {
                 auto o = std::make_unique<AdamWOptions>(g ? 2.0 : 1e-3);
                 o->betas({0.9, g ? 0.98 : 0.999}).eps(g ? 1e-5 : 1e-8).weight_decay(g ? 1e-2 : 0.05).amsgrad(g == 0);
                 return o;
               },
               "[dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, amsgrad=True),"
               " dict(lr=2.0, betas=(0.9, 0.98), eps=1e-5, weight_decay=1e-2, amsgrad=False)]",
               "['lr', 'betas', 'eps', 'weight_decay', 'amsgrad']",
               {"80027d2858020000006c72473f50624dd2f1a9fc58050000006265746173473feccccccccccccd473feff7ced916872b"
                "865803000000657073473e45798ee2308c3a580c0000007765696768745f6465636179473fa999999999999a58070000"
                "00616d7367726164885806000000706172616d735d284b004b0165580c0000005f706172616d5f6e616d65735d285808"
                "000000612e7765696768745806000000612e6269617365752e",
                "80027d2858020000006c7247400000000000000058050000006265746173473feccccccccccccd473fef5c28f5c28f5c"
                "865803000000657073473ee4f8b588e368f1580c0000007765696768745f6465636179473f847ae147ae147b58070000"
                "00616d7367726164895806000000706172616d735d4b0261580c0000005f706172616d5f6e616d65735d580800000062"
                "2e77656967687461752e"}});
  c.push_back({"SGD",
               maker<SGD, SGDOptions>(),
               [](int g) -> std::unique_ptr<OptimizerOptions> {
                 auto o = std::make_unique<SGDOptions>(g ? 0.25 : 0.1);
                 o->momentum(g ? 0.0 : 0.9).dampening(g ? 0.5 : 0.0).weight_decay(g ? 1e-4 : 0.0).nesterov(g == 0);
                 return o;
               },
               "[dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True),"
               " dict(lr=0.25, momentum=0.0, dampening=0.5, weight_decay=1e-4, nesterov=False)]",
               "['lr', 'momentum', 'dampening', 'weight_decay', 'nesterov']",
               {"80027d2858020000006c72473fb999999999999a58080000006d6f6d656e74756d473feccccccccccccd580900000064"
                "616d70656e696e67470000000000000000580c0000007765696768745f64656361794700000000000000005808000000"
                "6e65737465726f76885806000000706172616d735d284b004b0165580c0000005f706172616d5f6e616d65735d285808"
                "000000612e7765696768745806000000612e6269617365752e",
                "80027d2858020000006c72473fd000000000000058080000006d6f6d656e74756d470000000000000000580900000064"
                "616d70656e696e67473fe0000000000000580c0000007765696768745f6465636179473f1a36e2eb1c432d5808000000"
                "6e65737465726f76895806000000706172616d735d4b0261580c0000005f706172616d5f6e616d65735d580800000062"
                "2e77656967687461752e"}});
  c.push_back({"Adagrad",
               maker<Adagrad, AdagradOptions>(),
               [](int g) -> std::unique_ptr<OptimizerOptions> {
                 auto o = std::make_unique<AdagradOptions>(g ? 0.3 : 0.01);
                 o->lr_decay(g ? 1e-3 : 0.0)
                     .weight_decay(g ? 0.2 : 0.0)
                     .initial_accumulator_value(g ? 0.1 : 0.0)
                     .eps(g ? 1e-6 : 1e-10);
                 return o;
               },
               "[dict(lr=0.01, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10),"
               " dict(lr=0.3, lr_decay=1e-3, weight_decay=0.2, initial_accumulator_value=0.1, eps=1e-6)]",
               "['lr', 'lr_decay', 'weight_decay', 'initial_accumulator_value', 'eps']",
               {"80027d2858020000006c72473f847ae147ae147b58080000006c725f6465636179470000000000000000580c00000077"
                "65696768745f64656361794700000000000000005819000000696e697469616c5f616363756d756c61746f725f76616c"
                "75654700000000000000005803000000657073473ddb7cdfd9d7bdbb5806000000706172616d735d284b004b0165580c"
                "0000005f706172616d5f6e616d65735d285808000000612e7765696768745806000000612e6269617365752e",
                "80027d2858020000006c72473fd333333333333358080000006c725f6465636179473f50624dd2f1a9fc580c00000077"
                "65696768745f6465636179473fc999999999999a5819000000696e697469616c5f616363756d756c61746f725f76616c"
                "7565473fb999999999999a5803000000657073473eb0c6f7a0b5ed8d5806000000706172616d735d4b0261580c000000"
                "5f706172616d5f6e616d65735d5808000000622e77656967687461752e"}});
  c.push_back({"RMSprop",
               maker<RMSprop, RMSpropOptions>(),
               [](int g) -> std::unique_ptr<OptimizerOptions> {
                 auto o = std::make_unique<RMSpropOptions>(g ? 0.125 : 0.01);
                 o->alpha(g ? 0.9 : 0.99)
                     .eps(g ? 1e-6 : 1e-8)
                     .weight_decay(g ? 0.5 : 0.0)
                     .momentum(g ? 0.0 : 0.7)
                     .centered(g == 1);
                 return o;
               },
               "[dict(lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.7, centered=False),"
               " dict(lr=0.125, alpha=0.9, eps=1e-6, weight_decay=0.5, momentum=0.0, centered=True)]",
               "['lr', 'alpha', 'eps', 'weight_decay', 'momentum', 'centered']",
               {"80027d2858020000006c72473f847ae147ae147b5805000000616c706861473fefae147ae147ae580300000065707347"
                "3e45798ee2308c3a580c0000007765696768745f646563617947000000000000000058080000006d6f6d656e74756d47"
                "3fe6666666666666580800000063656e7465726564895806000000706172616d735d284b004b0165580c0000005f7061"
                "72616d5f6e616d65735d285808000000612e7765696768745806000000612e6269617365752e",
                "80027d2858020000006c72473fc00000000000005805000000616c706861473feccccccccccccd580300000065707347"
                "3eb0c6f7a0b5ed8d580c0000007765696768745f6465636179473fe000000000000058080000006d6f6d656e74756d47"
                "0000000000000000580800000063656e7465726564885806000000706172616d735d4b0261580c0000005f706172616d"
                "5f6e616d65735d5808000000622e77656967687461752e"}});
  return c;
}

/// The param group pickles flatten_optimizer_state writes for this family: groups of
/// parameters {a.weight, a.bias} and {b.weight}.
std::array<std::string, 2> param_group_bytes(const family_case& f) {
  state_dict sd;
  at::Tensor aw = at::zeros({3, 2}).set_requires_grad(true), ab = at::zeros({3}).set_requires_grad(true),
             bw = at::zeros({4}).set_requires_grad(true);
  sd.add("a.weight", aw).add("a.bias", ab).add("b.weight", bw);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{aw, ab}, f.options(0));
  groups.emplace_back(std::vector<at::Tensor>{bw}, f.options(1));
  auto opt = f.make(std::move(groups));
  const state_dict flat = flatten_optimizer_state(*opt, sd);
  std::array<std::string, 2> out;
  for (int g = 0; g < 2; ++g) {
    const sharded_tensor* t = flat.find("param_group" + std::to_string(g));
    REQUIRE(t);
    out[g].assign(static_cast<const char*>(t->local.data_ptr()), t->local.nbytes());
  }
  return out;
}

}  // namespace

TEST_CASE(
    "the DCP layout's param groups hold every key torch's optimizers keep, decoupled_weight_decay (torch 2.7+) too") {
  // The keys of torch.optim's param groups (torch 2.11: Adam's and AdamW's defaults dicts, AdamW
  // an Adam with decoupled_weight_decay=True), which dcp.load asks the checkpoint for one by one:
  // one missing fails the whole load ("Missing key in checkpoint state_dict"), as torch 2.11 did
  // on the GPU machine before decoupled_weight_decay was written.
  const std::vector<std::string> torch_keys = {
      "lr",         "betas",          "eps",   "weight_decay",          "amsgrad", "foreach", "maximize",
      "capturable", "differentiable", "fused", "decoupled_weight_decay"};
  for (const bool adamw : {false, true}) {
    CAPTURE(adamw);
    const auto f = family_cases()[adamw ? 1 : 0];
    auto w = torch::ones({2, 3});
    w.set_requires_grad(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{w}, f.options(0));
    auto opt = f.make(std::move(groups));
    state_dict model;
    model.add("w", w);
    const dcp_train_state st = dcp_train_state_of(model, opt.get());
    std::map<std::string, pickle_value> got;
    for (const auto& o : st.objects) got.emplace(o.key, o.value);
    for (const auto& k : torch_keys) {
      CAPTURE(k);
      REQUIRE(got.count("optim.param_groups.0." + k) == 1);
      CHECK(st.paths.count("optim.param_groups.0." + k) == 1);
    }
    CHECK(got.at("optim.param_groups.0.decoupled_weight_decay").as_bool("") == adamw);
    CHECK(got.at("optim.param_groups.0.maximize").as_bool("") == false);
  }
}

TEST_CASE("param group pickles of every optimizer family keep their bytes, and equal Python's") {
  const auto cases = family_cases();
  for (const auto& f : cases) {
    CAPTURE(f.name);
    const auto bytes = param_group_bytes(f);
    for (int g = 0; g < 2; ++g) {
      CAPTURE(g);
      CHECK(testing::hex(bytes[g]) == f.golden[g]);
      // and they read back as the options they came from
      const pickle_value v = pickle_loads(bytes[g], "param_group");
      CHECK(v.at("lr", "g").as_real("lr") == f.options(g)->get_lr());
      // restoring them into the other group's options sets every field saving wrote
      const auto want = f.options(g), other = f.options(1 - g);
      const auto& tr = shardsafe::detail::traits_of(*other);
      CHECK(pickle_dumps(tr.hyper(*other)) != pickle_dumps(tr.hyper(*want)));
      tr.set_hyper(*other, v, "param_group" + std::to_string(g));
      CHECK(testing::hex(pickle_dumps(tr.hyper(*other))) == testing::hex(pickle_dumps(tr.hyper(*want))));
    }
  }
  // a field of the wrong type or shape is named with its group
  {
    auto o = family_cases()[0].options(0);
    pickle_value bad =
        pickle_value::dict({{pickle_value::string("betas"), pickle_value::tuple({pickle_value::real(0.9)})}});
    CHECK_THROWS_WITH(shardsafe::detail::traits_of(*o).set_hyper(*o, bad, "optim: param_group3"),
                      "optim: param_group3: betas must have two values");
    bad = pickle_value::dict({{pickle_value::string("amsgrad"), pickle_value::integer(1)}});
    CHECK_THROWS_WITH(shardsafe::detail::traits_of(*o).set_hyper(*o, bad, "optim: param_group3"),
                      "optim: param_group3: amsgrad: expected bool, got int");
  }
  // torch 2.7+'s decoupled_weight_decay (Adam's switch; AdamW's groups hold true): Adam and AdamW
  // each take the groups of their own rule and refuse the other's, which would train differently
  for (const bool adamw : {false, true}) {
    CAPTURE(adamw);
    auto o = family_cases()[adamw ? 1 : 0].options(0);
    const auto& tr = shardsafe::detail::traits_of(*o);
    auto group = [](bool decoupled) {
      return pickle_value::dict({{pickle_value::string("lr"), pickle_value::real(0.25)},
                                 {pickle_value::string("decoupled_weight_decay"), pickle_value::boolean(decoupled)}});
    };
    tr.set_hyper(*o, group(adamw), "optim: param_group0");
    CHECK(o->get_lr() == 0.25);
    CHECK_THROWS_WITH(tr.set_hyper(*o, group(!adamw), "optim: param_group0"),
                      adamw ? "optim: param_group0: 'decoupled_weight_decay' is false, the rule of torch::optim::Adam; "
                              "this optimizer is AdamW"
                            : "optim: param_group0: 'decoupled_weight_decay' is true, the rule of torch::optim::AdamW; "
                              "this optimizer is Adam");
  }
  // Python: the same optimizers built by torch.optim, their param groups cut to the keys
  // shardsafe writes (in its order), plus params and _param_names, pickled with protocol 2
  // less the memo PUTs.
  if (!testing::have_torch()) {
    REQUIRE_MESSAGE(std::getenv("SHARDSAFE_REQUIRE_PYTHON") == nullptr,
                    testing::torch_python << " with torch (python3-torch) is required (SHARDSAFE_REQUIRE_PYTHON)");
    MESSAGE("python3 with torch not available: the comparison with Python is skipped");
    return;
  }
  testing::temp_dir dir("optim-pickles");
  std::string script =
      "import torch, pickle, pickletools, sys\n"
      "def groups(cls, kwargs):\n"
      "    ps = [[torch.zeros(3, 2, requires_grad=True), torch.zeros(3, requires_grad=True)], [torch.zeros(4, "
      "requires_grad=True)]]\n"
      "    opt = cls([dict(params=p, **k) for p, k in zip(ps, kwargs)])\n"
      "    return opt.state_dict()['param_groups']\n"
      "names = [['a.weight', 'a.bias'], ['b.weight']]\n"
      "with open(sys.argv[1], 'w') as out:\n";
  for (const auto& f : cases)
    script += std::string("    for g, pg in enumerate(groups(torch.optim.") + f.name + ", " + f.py_options + ")):\n" +
              "        d = {k: pg[k] for k in " + f.py_keys + "}\n" +
              "        d['params'] = pg['params']\n"
              "        d['_param_names'] = names[g]\n"
              "        out.write(pickletools.optimize(pickle.dumps(d, 2)).hex() + '\\n')\n";
  testing::write_file(dir.path / "groups.py", script);
  const auto r =
      testing::peer(testing::torch_python, {(dir.path / "groups.py").string(), (dir.path / "out.txt").string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  std::istringstream lines(slurp(dir.path / "out.txt"));
  for (const auto& f : cases) {
    const auto bytes = param_group_bytes(f);
    for (int g = 0; g < 2; ++g) {
      CAPTURE(f.name);
      CAPTURE(g);
      std::string line;
      REQUIRE(std::getline(lines, line));
      CHECK(testing::hex(bytes[g]) == line);
    }
  }
}

TEST_CASE("keep-last-N rotation removes older and unfinished checkpoints, commit mark first") {
  single_process comm;
  testing::temp_dir dir("rotate");
  const file_directory root(dir.path);
  demo::sharded_mlp m(1, 0, demo::optim_kind::sgd);
  for (int step : {10, 20, 30, 40}) {
    m.step(comm);
    save_model_and_optim_state(root.sub(checkpoint_name(step)), m.state(), &m.optimizer(), comm);
  }
  // an unfinished save older than the newest complete one, and one newer (in progress elsewhere)
  std::filesystem::create_directories(dir.path / "step35" / "model");
  std::filesystem::create_directories(dir.path / "step50" / "model");
  auto latest = latest_checkpoint(root);
  REQUIRE(latest);
  CHECK(latest->step == 40);
  auto removed = rotate_checkpoints(root, 2, comm);
  CHECK(removed == std::vector<std::string>{"step35", "step20", "step10"});
  std::vector<std::uint64_t> left;
  for (const auto& e : list_checkpoints(root)) left.push_back(e.step);
  CHECK(left == std::vector<std::uint64_t>{30, 40, 50});
}
