// Model + optimizer checkpoints: bit-exact resume across world sizes for every supported
// optimizer, param groups, strictness, unsharding optimizer state, and Python's pickle.
#include "shardsafe/torch/model_and_optim.hpp"

#include <ATen/Parallel.h>

#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

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
        auto it = m.optimizer().state().find(c10::guts::to_string(st.local.unsafeGetTensorImpl()));
        const std::string key = kind == demo::optim_kind::adagrad ? "sum"
                                : kind == demo::optim_kind::rmsprop ? "square_avg" : "exp_avg";
        at::Tensor* shard = nullptr;
        if (kind == demo::optim_kind::adagrad)
          shard = &static_cast<torch::optim::AdagradParamState&>(*it->second).sum();
        else if (kind == demo::optim_kind::rmsprop)
          shard = &static_cast<torch::optim::RMSpropParamState&>(*it->second).square_avg();
        else if (kind == demo::optim_kind::adam)
          shard = &static_cast<torch::optim::AdamParamState&>(*it->second).exp_avg();
        else
          shard = &static_cast<torch::optim::AdamWParamState&>(*it->second).exp_avg();
        auto parts = comm.all_gather_bytes(std::string_view(static_cast<const char*>(shard->data_ptr()), shard->nbytes()));
        if (w.rank == 0) {
          std::string all;
          for (auto& p : parts) all += p;
          const at::Tensor& f = full.state.at(name).at(key);
          if (shape_of(f) != st.full_shape || all.size() != f.nbytes() || std::memcmp(all.data(), f.data_ptr(), all.size())) {
            std::fprintf(stderr, "unshard_optim_state: %s %s differs from the gathered shards\n", name.c_str(), key.c_str());
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
      auto a = testing::run_world("train_resume", 2, {opt, ckpt, (dir.path / "a.safetensors").string(), "save",
                                                      std::to_string(before), "3"});
      REQUIRE_MESSAGE(a.ok(), a.report());
      auto b = testing::run_world("train_resume", 1, {opt, ckpt, (dir.path / "b.safetensors").string(), "load",
                                                      std::to_string(before), "3"});
      REQUIRE_MESSAGE(b.ok(), b.report());
      auto c = testing::run_world("train_resume", 3, {opt, ckpt, (dir.path / "c.safetensors").string(), "load",
                                                      std::to_string(before), "3"});
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
    const std::string tool = SHARDSAFE_TOOL;
    if (tool.empty()) return;
    auto d = testing::run_program(tool, {"digest", (dir.path / "c").string()});
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
    const std::string cmd = "python3 -c \"import pickle,sys; d=pickle.load(open(sys.argv[1],'rb')); "
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
