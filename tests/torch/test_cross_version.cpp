// Checkpoints that cross LibTorch versions: a model + AdamW checkpoint saved by a world under one
// LibTorch (1.13 or 2.x) resumes in a world of another size under the other. The worlds are
// started by tests/torch/cross_version.sh (scripts/test.sh's debian13 leg), one side from each
// build; this file holds the worker both sides run, and a doctest case that runs the same
// exchange within one version, so the scenario itself is exercised by every torch_tests run.
//
// What is compared is written by this worker alone, not by the library: every rank's shards of
// each parameter and of its AdamW state gathered over the comm and written out as raw bytes, with
// the step counts and hyper-parameters as text (dump_train_state). The saving side dumps before
// saving and after two more steps; the loading side dumps after loading and after two steps.
#include <ATen/Parallel.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../../examples/sharded_mlp.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/compat.hpp"
#include "shardsafe/torch/model_and_optim.hpp"
#include "fixtures.hpp"
#include "world.hpp"

namespace {

using namespace shardsafe;

/// Appends `t`'s shards from every rank, in rank order, as raw bytes.
template <class C>
void gather_raw(C& comm, const at::Tensor& t, std::string& out) {
  auto parts = comm.all_gather_bytes(std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes()));
  for (const auto& p : parts) out += p;
}

/// The full training state: parameters, AdamW's exp_avg, exp_avg_sq and max_exp_avg_sq (raw bytes,
/// gathered), step counts and every group's hyper-parameters (text). Written by rank 0.
template <class C>
void dump_train_state(demo::sharded_mlp& m, C& comm, int rank, const std::string& path) {
  std::string text, raw;
  auto sd = m.state();
  std::vector<const std::pair<std::string, sharded_tensor>*>
      by_name;  // sorted: the same order however the model was built
  for (const auto& e : sd) by_name.push_back(&e);
  std::sort(by_name.begin(), by_name.end(), [](auto* a, auto* b) { return a->first < b->first; });
  for (const auto* e : by_name) {
    const auto& [name, st] = *e;
    auto* ps = optimizer_state_of(m.optimizer(), st.local);
    if (!ps) throw std::runtime_error("no AdamW state for " + name);
    auto& s = static_cast<torch::optim::AdamWParamState&>(*ps);
    text += name + " step " + std::to_string(s.step()) + "\n";
    gather_raw(comm, st.local, raw);
    gather_raw(comm, s.exp_avg(), raw);
    gather_raw(comm, s.exp_avg_sq(), raw);
    gather_raw(comm, s.max_exp_avg_sq(), raw);
  }
  // the hyper-parameters by the smallest name of the group's parameters (groups, and parameters
  // in them, may be in another order)
  std::vector<std::string> groups;
  for (auto& g : m.optimizer().param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(g.options());
    std::string first;
    for (const auto& p : g.params())
      for (const auto& [name, st] : sd)
        if (st.local.unsafeGetTensorImpl() == p.unsafeGetTensorImpl() && (first.empty() || name < first)) first = name;
    std::ostringstream line;
    line.precision(17);
    line << "group of " << first << ": lr " << o.lr() << " betas " << std::get<0>(o.betas()) << ","
         << std::get<1>(o.betas()) << " eps " << o.eps() << " weight_decay " << o.weight_decay() << " amsgrad "
         << o.amsgrad() << "\n";
    groups.push_back(line.str());
  }
  std::sort(groups.begin(), groups.end());
  for (const auto& g : groups) text += g;
  if (rank != 0) return;
  std::ofstream f(path, std::ios::binary);
  f << text << "--\n" << raw;
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace

// args: save|load, folder. save: trains 3 steps, dumps saved.dump, saves DIR/ckpt, takes two more
// steps and dumps saved_after.dump. load: a model of zeros with wrong learning rates, its groups in
// the other order, loads DIR/ckpt, dumps loaded.dump, takes two steps, dumps loaded_after.dump.
// Every dump also records the LibTorch version it was made under (DIR/MODE.version).
WORKER_SCENARIO("cross_version") {
  at::set_num_threads(1);
  auto w = init_world_from_env();
  auto comm = w.comm();
  const std::string mode = args.at(0);
  const std::filesystem::path dir = args.at(1);
  const file_directory ckpt((dir / "ckpt").string());
  const bool save = mode == "save";
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_kind::adamw, /*group_order_reversed=*/!save,
                      /*zero_init=*/!save);
  if (save) {
    for (int s = 0; s < 3; ++s) m.step(comm);
    dump_train_state(m, comm, w.rank, (dir / "saved.dump").string());
    save_model_and_optim_state(ckpt, m.state(), &m.optimizer(), comm);
  } else {
    auto sd = m.state();
    load_model_and_optim_state(ckpt, sd, &m.optimizer(), comm);
    dump_train_state(m, comm, w.rank, (dir / "loaded.dump").string());
  }
  for (int s = 0; s < 2; ++s) m.step(comm);
  dump_train_state(m, comm, w.rank, (dir / (save ? "saved_after.dump" : "loaded_after.dump")).string());
  if (w.rank == 0) std::ofstream(dir / (mode + ".version")) << torch_version() << "\n";
  return 0;
}

TEST_CASE("cross-version worker: a 2-rank save resumes in 3 ranks with the same state (one LibTorch)") {
  testing::temp_dir dir("cross-version");
  auto a = testing::run_world("cross_version", 2, {"save", dir.path.string()});
  REQUIRE_MESSAGE(a.ok(), a.report());
  auto b = testing::run_world("cross_version", 3, {"load", dir.path.string()});
  REQUIRE_MESSAGE(b.ok(), b.report());
  const std::string saved = testing::slurp(dir.path / "saved.dump");
  CHECK(saved.size() > 10000);
  CHECK(saved.find("step 3\n") != std::string::npos);
  CHECK_MESSAGE(saved == testing::slurp(dir.path / "loaded.dump"), "the loaded state differs from the saved one");
  CHECK_MESSAGE(testing::slurp(dir.path / "saved_after.dump") == testing::slurp(dir.path / "loaded_after.dump"),
                "two steps after the resume differ from two steps of the uninterrupted run");
  CHECK(testing::slurp(dir.path / "saved_after.dump") != saved);
}
