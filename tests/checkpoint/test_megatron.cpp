// Tests of checkpoint/layouts/megatron_dist.hpp and megatron_legacy.hpp: Megatron-Core's own
// torch_dist and legacy torch checkpoints (the
// goldens of tests/fixtures/peers/mcore_*, written by Megatron-Core 0.16.1) read through
// checkpoint_reader and unshard_tensor, and loaded in place by worlds of other sizes and
// shardings, every presented tensor compared bit for bit with Megatron's own load of the
// checkpoint into a TP1 PP1 EP1 model (expected/full/, read here by the plain safetensors parser).
// Names: expected/full/checkpoint_keys.json gives each module tensor's checkpoint key; a stacked
// key is presented per layer (and expert), as docs/FORMAT.md §7 says, which name_of computes here
// from the module name's own layer and expert numbers.
#include "shardsafe/checkpoint/layouts/megatron_dist.hpp"
#include "shardsafe/checkpoint/layouts/megatron_legacy.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/detail/json_dom.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/test_util.hpp"
#include "support/trainer_goldens.hpp"

using namespace shardsafe;
using testing::expect_error;

namespace {

namespace fs = std::filesystem;
const fs::path mc_peers = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "peers";

using testing::mc_name_of;
using testing::mc_number_after;

/// What a torch_dist golden must present: Megatron's model tensors and Adam's moments (and the
/// step, two AdamW steps; with `masters`, the distributed optimizer's fp32 masters, which these
/// fp32 runs keep equal to the model's, and no step tensor: its step is per param group). A bf16
/// run's masters (Float16OptimizerWithFloat16Params) are what Megatron loaded: expected/full/fp32.
std::map<std::string, testing::golden_tensor> mc_want(const std::string& golden, bool optimizer, bool masters) {
  const fs::path full = mc_peers / golden / "expected" / "full";
  const std::string keys_text = testing::slurp(full / "checkpoint_keys.json");
  simdjson::dom::parser parser;
  const simdjson::dom::element keys = detail::parse_json(parser, keys_text, "checkpoint_keys.json");
  std::map<std::string, testing::golden_tensor> want;
  const float two = 2.0f;
  for (const auto& [kind, suffix] : {std::pair<const char*, const char*>{"model", ""},
                                     {"exp_avg", ".exp_avg"},
                                     {"exp_avg_sq", ".exp_avg_sq"},
                                     {"fp32", ".fp32"}}) {
    if (!optimizer && std::strcmp(kind, "model") != 0) continue;
    if (!fs::exists(full / (std::string(kind) + ".safetensors"))) continue;  // fp32: a bf16 run's alone
    for (const auto& [module, t] : testing::read_golden_tensors(full / (std::string(kind) + ".safetensors"))) {
      std::string_view key;
      REQUIRE(keys[module]["key"].get(key) == simdjson::SUCCESS);
      const std::string name = mc_name_of(module, std::string(key));
      if (std::strcmp(kind, "model") == 0) {
        want[name] = t;
        if (masters && optimizer) want["optimizer.state." + name + ".fp32"] = t;
      } else {
        want["optimizer.state." + name + suffix] = t;
      }
      if (std::strcmp(kind, "exp_avg") == 0 && !masters)
        want["optimizer.state." + name + ".step"] = {
            dtype::F32, {}, std::string(reinterpret_cast<const char*>(&two), 4)};
    }
  }
  return want;
}

struct mc_golden {
  const char* name;
  const char* form;
  bool masters;  // fully_reshardable: fp32 masters, step per param group
  bool buffers;  // dp_reshardable: the optimizer's buffers are listed, not read
};
constexpr mc_golden mc_goldens[] = {{"mcore_gpt_tp2_pp2", "torch_dist", false, false},
                                    {"mcore_moe_ep2", "torch_dist", false, false},
                                    {"mcore_distopt_tp2_dp2", "torch_dist_fully_reshardable", true, false},
                                    {"mcore_distopt_tp2_dp2", "torch_dist", false, true},
                                    {"mcore_gpt_bf16_tp2", "torch_dist", false, false}};

}  // namespace

TEST_CASE("megatron_dist layout: every golden's tensors read through the library are Megatron's, bit for bit") {
  for (const auto& [name, form, masters, buffers] : mc_goldens) {
    CAPTURE(name);
    CAPTURE(form);
    const auto want = mc_want(name, !buffers, masters);
    for (const fs::path& dir : {mc_peers / name / form, mc_peers / name / form / "iter_0000002"}) {
      checkpoint_reader<file_directory> r{file_directory(dir)};
      CHECK(r.layout() == megatron_dist_layout::info);
      if (!buffers) CHECK(r.metadata().tensors.size() == want.size());
      testing::check_golden_tensors(r, want);
      CHECK(r.read_object("iteration") == pickle_value::integer(2));
      // dp_reshardable: every buffer listed as not read, naming how to re-save
      std::size_t listed = 0;
      for (const auto& f : r.foreign_tensors()) {
        CHECK(f.key.starts_with("optimizer.distributed."));
        CHECK(f.why.find("--dist-ckpt-optim-fully-reshardable") != std::string::npos);
        ++listed;
      }
      CHECK((listed > 0) == buffers);
    }
  }
}

TEST_CASE("megatron_dist layout: each param group's params named as Megatron's own optimizer grouped them") {
  // expected/local/<rank>/optimizer_param_order.json: each rank's groups as Megatron's optimizer
  // holds them (module names, local layer and expert numbers), made global here and presented
  // by their checkpoint keys; the union over ranks is each group of the whole model
  for (const auto& [name, form, masters, buffers] : mc_goldens) {
    if (buffers) continue;  // dp_reshardable: the same groups as the golden's torch_dist form
    const std::string which = std::string(name) + "/" + form;
    CAPTURE(which);
    const fs::path exp = mc_peers / name / "expected";
    simdjson::dom::parser kp;
    const std::string keys_text = testing::slurp(exp / "full" / "checkpoint_keys.json");
    const simdjson::dom::element keys = detail::parse_json(kp, keys_text, "checkpoint_keys.json");
    std::map<std::size_t, std::set<std::string>> want;
    // without the order files (the distributed optimizer's golden, whose groups Megatron saves
    // with no params at all): each group holds the parameters of its kind, every one once
    bool ordered = false;
    for (const auto& rank : fs::directory_iterator(exp / "local"))
      ordered = ordered || fs::exists(rank.path() / "optimizer_param_order.json");
    for (const auto& rank : fs::directory_iterator(exp / "local")) {
      if (!ordered) break;
      const std::string rn = rank.path().filename().string();  // tp{T}_pp{P}[_ep{E}]
      const std::size_t pp = std::stoul(mc_number_after(rn, "_pp")),
                        ep = rn.find("_ep") == std::string::npos ? 0 : std::stoul(mc_number_after(rn, "_ep"));
      simdjson::dom::parser op;
      const std::string order_text = testing::slurp(rank.path() / "optimizer_param_order.json");
      const simdjson::dom::element order = detail::parse_json(op, order_text, "optimizer_param_order.json");
      // this stage's layers and this EP rank's experts: local numbers, counted in the file
      std::size_t layers = 0, experts = 0;
      for (simdjson::dom::element g : order.get_array())
        for (simdjson::dom::element n : g.get_array()) {
          const std::string_view m = n.get_string();
          if (auto l = mc_number_after(m, "decoder.layers."); !l.empty()) layers = std::max(layers, std::stoul(l) + 1);
          if (auto e = mc_number_after(m, ".local_experts."); !e.empty())
            experts = std::max(experts, std::stoul(e) + 1);
        }
      std::size_t g = 0;
      for (simdjson::dom::element grp : order.get_array()) {
        for (simdjson::dom::element n : grp.get_array()) {
          std::string m(n.get_string().value());
          if (auto l = mc_number_after(m, "decoder.layers."); !l.empty()) {
            const auto at = m.find("decoder.layers.") + 15;
            m = m.substr(0, at) + std::to_string(std::stoul(l) + pp * layers) + m.substr(at + l.size());
          }
          if (auto e = mc_number_after(m, ".local_experts."); !e.empty()) {
            const auto at = m.find(".local_experts.") + 15;
            m = m.substr(0, at) + std::to_string(std::stoul(e) + ep * experts) + m.substr(at + e.size());
          }
          std::string_view key;
          REQUIRE(keys[m]["key"].get(key) == simdjson::SUCCESS);
          want[g].insert(mc_name_of(m, std::string(key)));
        }
        ++g;
      }
    }
    checkpoint_reader<file_directory> r{file_directory(mc_peers / name / form)};
    // the distributed optimizer's and the bf16 wrapper's groups are their torch optimizer's
    const std::string groups = r.find_object("optimizer.optimizer.param_groups.0.lr")
                                   ? "optimizer.optimizer.param_groups."
                                   : "optimizer.param_groups.";
    std::size_t g = 0, params = 0;
    for (; r.find_object(groups + std::to_string(g) + ".params"); ++g) {
      std::set<std::string> got;
      const pickle_value listed = r.read_object(groups + std::to_string(g) + ".params");
      for (const auto& n : listed.as_sequence("")) got.insert(n.as_string(""));
      if (ordered) {
        CHECK(got == want[g]);
      } else {
        const bool no_wd = r.read_object(groups + std::to_string(g) + ".wd_mult") == pickle_value::real(0.0);
        for (const auto& n : got) CHECK((n.ends_with(".bias") || r.find(n)->shape.size() == 1) == no_wd);
      }
      params += got.size();
    }
    CHECK(g == (ordered ? want.size() : 2u));
    CHECK(params == (std::string(name) == "mcore_moe_ep2"       ? 57u
                     : std::string(name) == "mcore_gpt_tp2_pp2" ? 53u
                                                                : 29u));
  }
}

TEST_CASE("megatron_dist layout: loaded in place by 3 ranks in row blocks and 4 in flat ranges, model and optimizer") {
  std::size_t loaded = 0, views = 0;
  for (const auto& [name, form, masters, buffers] : mc_goldens) {
    CAPTURE(name);
    CAPTURE(form);
    const auto want = mc_want(name, !buffers, masters);  // dp_reshardable: the model alone
    views += (3 + 4) * want.size();
    loaded += testing::load_golden_in_other_worlds(file_directory(mc_peers / name / form), want);
  }
  CHECK(loaded == views);
  CHECK(views == (3 + 4) * (212 + 228 + 116 + 29 + 145));
}

TEST_CASE("megatron_dist layout: what is not torch_dist, or points nowhere, is refused naming file and rule") {
  testing::temp_dir tmp;
  const fs::path src = mc_peers / "mcore_gpt_tp2_pp2" / "torch_dist";
  fs::copy(src, tmp.path / "a", fs::copy_options::recursive);
  testing::write_file(tmp.path / "a" / "latest_checkpointed_iteration.txt", "7");
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "a")}; }, errc::not_found,
               {"latest_checkpointed_iteration.txt", "iter_0000007", "pointing nowhere"});
  testing::write_file(tmp.path / "a" / "latest_checkpointed_iteration.txt", "x2");
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "a")}; }, errc::invalid_metadata,
               {"'x2'", "neither an iteration number nor 'release'"});
  testing::write_file(tmp.path / "a" / "latest_checkpointed_iteration.txt", "2");
  testing::write_file(tmp.path / "a" / "iter_0000002" / "metadata.json", R"({"sharded_backend": "zarr"})");
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "a")}; }, errc::invalid_metadata,
               {"metadata.json", "sharded_backend \"zarr\"", "torch_dist"});
}

namespace {

/// What a legacy golden must present: expected/full's tensors under their module names, Adam's
/// moments, and the step (non-distributed optimizer) or the fp32 masters (distrib_optim.pt); a
/// bf16 run's fp32_from_fp16_params besides the step (expected/full/fp32).
std::map<std::string, testing::golden_tensor> mc_legacy_want(const std::string& golden, bool distributed) {
  const fs::path full = mc_peers / golden / "expected" / "full";
  std::map<std::string, testing::golden_tensor> want = testing::read_golden_tensors(full / "model.safetensors");
  const float two = 2.0f;
  for (const std::string kind : {"exp_avg", "exp_avg_sq"})
    for (const auto& [module, t] : testing::read_golden_tensors(full / (kind + ".safetensors"))) {
      want["optimizer.state." + module + "." + kind] = t;
      if (kind != "exp_avg") continue;
      if (distributed)
        want["optimizer.state." + module + ".fp32"] = want.at(module);
      else
        want["optimizer.state." + module + ".step"] = {
            dtype::F32, {}, std::string(reinterpret_cast<const char*>(&two), 4)};
    }
  if (fs::exists(full / "fp32.safetensors"))
    for (const auto& [module, t] : testing::read_golden_tensors(full / "fp32.safetensors"))
      want["optimizer.state." + module + ".fp32"] = t;
  return want;
}

constexpr std::pair<const char*, bool> mc_legacy_goldens[] = {{"mcore_gpt_tp2_pp2", false},
                                                              {"mcore_moe_ep2", false},
                                                              {"mcore_distopt_tp2_dp2", true},
                                                              {"mcore_gpt_bf16_tp2", false}};

}  // namespace

TEST_CASE("megatron_legacy layout: TP pieces, stages and EP ranks joined are Megatron's tensors, bit for bit") {
  for (const auto& [name, distributed] : mc_legacy_goldens) {
    CAPTURE(name);
    const auto want = mc_legacy_want(name, distributed);
    for (const fs::path& dir : {mc_peers / name / "legacy", mc_peers / name / "legacy" / "iter_0000002"}) {
      checkpoint_reader<file_directory> r{file_directory(dir)};
      CHECK(r.layout() == megatron_legacy_layout::info);
      CHECK(r.metadata().tensors.size() == want.size());
      testing::check_golden_tensors(r, want);
      CHECK(r.read_object("iteration") == pickle_value::integer(2));
      if (distributed) continue;  // its step and groups stay per group (optimizer.optimizer.param_groups)
      // each group's params by global name, as get_state_dict names them; every parameter once
      // (the bf16 wrapper's groups: its torch optimizer's, optimizer.optimizer.param_groups)
      const std::string groups = r.find_object("optimizer.optimizer.param_groups.0.lr")
                                     ? "optimizer.optimizer.param_groups."
                                     : "optimizer.param_groups.";
      std::size_t named = 0, states = 0;
      for (const auto& [key, tm] : r.metadata().tensors) states += key.ends_with(".exp_avg");
      for (int g = 0; r.find_object(groups + std::to_string(g) + ".params"); ++g) {
        const pickle_value params = r.read_object(groups + std::to_string(g) + ".params");
        const bool no_wd = r.read_object(groups + std::to_string(g) + ".wd_mult") == pickle_value::real(0.0);
        for (const auto& n : params.as_sequence("")) {
          const tensor_metadata* tm = r.find(n.as_string(""));
          REQUIRE(tm != nullptr);
          CHECK((n.as_string("").ends_with(".bias") || tm->shape.size() == 1) == no_wd);
          ++named;
        }
      }
      CHECK(named == states);
    }
  }
}

TEST_CASE(
    "megatron_legacy layout: loaded in place by 3 ranks in row blocks and 4 in flat ranges, model and optimizer") {
  std::size_t loaded = 0, views = 0;
  for (const auto& [name, distributed] : mc_legacy_goldens) {
    CAPTURE(name);
    const auto want = mc_legacy_want(name, distributed);
    views += (3 + 4) * want.size();
    loaded += testing::load_golden_in_other_worlds(file_directory(mc_peers / name / "legacy"), want);
  }
  CHECK(loaded == views);
  CHECK(views == (3 + 4) * (212 + 228 + 116 + 145));
}

TEST_CASE("megatron_legacy layout: missing ranks, lying args, groups and buffers are refused naming file and rule") {
  testing::temp_dir tmp;
  const fs::path src = mc_peers / "mcore_gpt_tp2_pp2" / "legacy";
  fs::copy(src, tmp.path / "a", fs::copy_options::recursive);
  const fs::path it = tmp.path / "a" / "iter_0000002";
  fs::remove_all(it / "mp_rank_01_001");
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "a")}; }, errc::not_found,
               {"mp_rank_01_001", "model_optim_rng.pt", "TP rank 1, stage 1, EP rank 0", "TP 2 x PP 2 x EP 1"});
  // a stage's file standing in for another: its layers are the wrong count for args.num_layers
  fs::copy(it / "mp_rank_01_000", it / "mp_rank_01_001", fs::copy_options::recursive);
  fs::remove_all(it / "mp_rank_00_001");
  fs::copy(src / "iter_0000002" / "mp_rank_00_000", it / "mp_rank_00_001", fs::copy_options::recursive);
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "a")}; }, errc::invalid_metadata,
               {"mp_rank_00_001", "embedding.word_embeddings.weight", "also in mp_rank_00_000",
                "two stages or EP ranks hold it"});
  // a distrib_optim.pt whose buffer is not the parameters' length
  fs::copy(mc_peers / "mcore_distopt_tp2_dp2" / "legacy", tmp.path / "d", fs::copy_options::recursive);
  fs::copy_file(mc_peers / "mcore_distopt_tp2_dp2" / "legacy" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt",
                tmp.path / "d" / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt",
                fs::copy_options::overwrite_existing);
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "d")}; }, errc::invalid_metadata,
               {"mp_rank_01/distrib_optim.pt", "buckets_coalesced"});
}

TEST_CASE(
    "megatron_dist layout: a stacked key's chunk must hold one layer; a key with its layer number is one tensor") {
  // a DCP folder written by shardsafe's own DCP save, made Megatron's by metadata.json and the
  // golden's common.pt: "decoder.layers.w" [2, 3] saved whole is one chunk spanning both layers
  testing::temp_dir tmp;
  std::vector<float> w{1, 2, 3, 4, 5, 6}, v{7, 8};
  const std::vector<flat_view> views{
      {"decoder.layers.w", dtype::F32, {2, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 24},
      {"decoder.layers.0.v", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(v.data()), 8}};
  save_options so;
  so.format = save_format::dcp;
  single_process comm;
  auto megatron_files = [&] {
    testing::write_file(tmp.path / "it" / "metadata.json", R"({"sharded_backend": "torch_dist"})");
    fs::copy_file(mc_peers / "mcore_gpt_tp2_pp2" / "torch_dist" / "iter_0000002" / "common.pt",
                  tmp.path / "it" / "common.pt", fs::copy_options::overwrite_existing);
  };
  save(file_directory(tmp.path / "it"), std::span<const flat_view>(views), comm, so);
  megatron_files();
  expect_error([&] { checkpoint_reader<file_directory> r{file_directory(tmp.path / "it")}; }, errc::invalid_metadata,
               {".metadata", "tensor 'decoder.layers.w'", "decoder.layers.0.w", "without its first 1 axes"});
  // the same folder without the stacked key: the numbered one is presented as it is, whole
  std::vector<flat_view> one{views[1]};
  save_options over = so;
  over.overwrite = true;
  save(file_directory(tmp.path / "it"), std::span<const flat_view>(one), comm, over);
  megatron_files();
  checkpoint_reader<file_directory> r{file_directory(tmp.path / "it")};
  CHECK(r.layout() == megatron_dist_layout::info);
  REQUIRE(r.find("decoder.layers.0.v") != nullptr);
  std::vector<float> got(2);
  unshard_tensor(r, "decoder.layers.0.v", std::as_writable_bytes(std::span(got)));
  CHECK(got == v);
}
