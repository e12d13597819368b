// Asynchronous saves of model + optimizer state (torch/async_checkpointer.hpp) in real c10d worlds:
// the checkpoint traffic on a group of its own while the training group's collectives and
// optimizer steps go on; what is saved is the state at the call, byte for byte what a blocking
// save of the same state writes.
#include "shardsafe/torch/async_checkpointer.hpp"

#include <doctest/doctest.h>
#include <torch/optim/adam.h>

#include <filesystem>

#include "fixtures.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "world.hpp"

using namespace shardsafe;

namespace {

/// Every file under a and b, relative to them, with their bytes.
std::map<std::string, std::string> files_under(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file()) out[std::filesystem::relative(e.path(), root).string()] = testing::slurp(e.path());
  return out;
}

}  // namespace

// args: root folder. Rank r holds rows [32r, 32r + 32) of w [64, 16], a whole bias [16] and a
// non-contiguous whole tensor (a transposed view); Adam has taken one step.
WORKER_SCENARIO("async_save_while_training") {
  const std::filesystem::path root = args.at(0);
  c10d_world world = init_world_from_env();
  c10d_comm train = world.comm();
  async_checkpointer ckpt(world.new_group());
  const int r = world.rank, n = world.world_size;

  at::Tensor full = at::arange(64 * 16, at::kFloat).view({64, 16}).mul_(0.25);
  at::Tensor w = full.slice(0, 32 * r, 32 * r + 32).clone().set_requires_grad(true);
  at::Tensor bias = at::arange(16, at::kFloat).add_(100).set_requires_grad(true);
  at::Tensor tr = at::arange(12, at::kFloat).view({3, 4}).t();  // [4, 3], not contiguous
  state_dict model;
  model.add("w", w, block_spec{{32, 16}, {32 * std::uint64_t(r), 0}}, {64, 16}).add("bias", bias).add("tr", tr);
  torch::optim::Adam adam({w, bias}, torch::optim::AdamOptions(0.01));
  auto step = [&](float g) {
    w.mutable_grad() = at::full({32, 16}, g * float(r + 1));
    bias.mutable_grad() = at::full({16}, g);
    adam.step();
  };
  step(1.f);

  save_model_and_optim_state(file_directory(root / "blocking"), model, &adam, train);
  async_save_handle h = ckpt.save_model_and_optim_state(file_directory(root / "async"), model, &adam);
  // training goes on at once: collectives on the training group, steps changing w, bias, and
  // Adam's state in place, tr overwritten
  for (int i = 0; i < 20; ++i) {
    const std::vector<std::string> all =
        train.all_gather_bytes("step " + std::to_string(i) + " rank " + std::to_string(r));
    for (int q = 0; q < n; ++q)
      testing::worker_check(all.at(q) == "step " + std::to_string(i) + " rank " + std::to_string(q),
                            "all-gather on the training group gave wrong bytes");
    step(float(i + 2));
  }
  tr.fill_(-1.f);
  const async_save_stats& res = h.wait();
  testing::worker_check(res.folders.size() == 2, "two folders (optim, model) expected");
  testing::worker_check(res.stall_seconds <= res.seconds, "stall longer than the whole save");
  // a blocking save after the steps differs: the async one saved the state at the call
  save_model_and_optim_state(file_directory(root / "later"), model, &adam, train);
  // a second async save reuses staging
  const std::byte* staging = ckpt.saver().staging().data();
  ckpt.save_model_and_optim_state(file_directory(root / "async2"), model, &adam).wait();
  testing::worker_check(ckpt.saver().staging().data() == staging, "staging was not reused");
  return 0;
}

TEST_CASE("async save in a 2-process c10d world: the state at the call, as a blocking save writes it") {
  testing::temp_dir dir("async-c10d");
  auto res = testing::run_world("async_save_while_training", 2, {dir.str()});
  REQUIRE_MESSAGE(res.ok(), res.report());
  const auto blocking = files_under(dir.path / "blocking"), async = files_under(dir.path / "async"),
             later = files_under(dir.path / "later"), async2 = files_under(dir.path / "async2");
  REQUIRE(blocking.size() == 6);  // {model, optim} x {metadata.json, rank_0, rank_1}
  CHECK(async == blocking);
  CHECK(async2 == later);
  CHECK(later.at("model/rank_0.safetensors") != blocking.at("model/rank_0.safetensors"));
  CHECK(later.at("optim/rank_1.safetensors") != blocking.at("optim/rank_1.safetensors"));

  // and the model's values are the ones at the call: w after one Adam step of lr 0.01 from
  // 0.25 * i moves each element by -0.01 (Adam's first step is lr * sign(grad)); bias likewise
  state_dict sd;
  at::Tensor w = at::zeros({64, 16}), bias = at::zeros({16}), tr = at::zeros({4, 3});
  sd.add("w", w).add("bias", bias).add("tr", tr);
  load_state_dict(file_directory(dir.path / "async" / "model"), sd);
  const at::Tensor want_w = at::arange(64 * 16, at::kFloat).view({64, 16}).mul_(0.25).sub_(0.01);
  CHECK(at::allclose(w, want_w, 0, 1e-4));
  CHECK(at::allclose(bias, at::arange(16, at::kFloat).add_(100).sub_(0.01), 0, 1e-4));
  CHECK(testing::same_bits(tr, at::arange(12, at::kFloat).view({3, 4}).t().contiguous()));
}

TEST_CASE("async save in one process: a failure reaches wait(), the next save goes on") {
  testing::temp_dir dir("async-one");
  async_checkpointer<single_process> ckpt(single_process{});
  state_dict sd;
  at::Tensor a = at::arange(10, at::kFloat);
  sd.add("a", a);
  ckpt.save_state_dict(file_directory(dir.path / "x"), sd).wait();
  auto again = ckpt.save_state_dict(file_directory(dir.path / "x"), sd);  // not empty: refused in the background
  CHECK_THROWS_WITH_AS(again.wait(), doctest::Contains("not empty"), error);
  CHECK_THROWS_AS(ckpt.wait(), error);
  save_options o;
  o.overwrite = true;
  a.fill_(7.f);
  ckpt.save_state_dict(file_directory(dir.path / "x"), sd, o).wait();
  at::Tensor back = at::zeros({10});
  state_dict into;
  into.add("a", back);
  load_state_dict(file_directory(dir.path / "x"), into);
  CHECK(testing::same_bits(back, at::full({10}, 7.f)));
}
