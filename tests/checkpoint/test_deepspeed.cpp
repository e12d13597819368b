// Tests of checkpoint/layouts/deepspeed.hpp and deepspeed_universal.hpp: DeepSpeed's own ZeRO
// checkpoints and ds_to_universal's output of them (the goldens of tests/fixtures/peers/, written
// by DeepSpeed 0.19.5) read through checkpoint_reader and unshard_tensor, and loaded in place by
// worlds of other sizes and shardings, every presented tensor compared bit for bit with the
// trainer's tensors in the golden's expected/ (read here by the plain safetensors parser); and the opaque records of
// format/torch_tensor_pickle.hpp, read only where a caller names their classes.
#include "shardsafe/checkpoint/layouts/deepspeed.hpp"
#include "shardsafe/checkpoint/layouts/deepspeed_universal.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/format/torch_state_dict.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/test_util.hpp"
#include "support/trainer_goldens.hpp"

using namespace shardsafe;
using testing::expect_error;

namespace {

namespace fs = std::filesystem;

/// What a golden's checkpoint must present, under the names the layout gives (docs/FORMAT.md §6),
/// from the trainer's tensors in its expected/. `master`: a trainable parameter is presented as
/// its fp32 master (ZeRO-3's files and universal checkpoints hold no other weight).
std::map<std::string, testing::golden_tensor> ds_want(const fs::path& golden, bool master, int tp) {
  std::map<std::string, testing::golden_tensor> want;
  const float step = 2.0f;  // step.json's adam_step of every golden
  const testing::golden_tensor step_bytes{
      dtype::F32, {}, std::string(reinterpret_cast<const char*>(&step), sizeof step)};
  // TP: the parameters and their state joined as the checkpoint's universal_checkpoint_info
  // says (expected/joined/), buffers and frozen parameters per TP rank (expected/tp{T}/)
  const fs::path exp = golden / "expected" / (tp > 1 ? "joined" : "");
  const auto fp32 = testing::read_golden_tensors(exp / "fp32.safetensors");
  for (const auto& [k, v] : testing::read_golden_tensors(exp / "module.safetensors"))
    if (tp == 1 || fp32.count(k)) want[k] = master && fp32.count(k) ? fp32.at(k) : v;
  for (const char* kind : {"fp32", "exp_avg", "exp_avg_sq"})
    for (const auto& [k, v] : testing::read_golden_tensors(exp / (std::string(kind) + ".safetensors")))
      want["optimizer.state." + k + "." + kind] = v;
  for (const auto& [k, v] : fp32) want["optimizer.state." + k + ".step"] = step_bytes;
  for (int t = 0; t < tp && tp > 1; ++t)
    for (const auto& [k, v] :
         testing::read_golden_tensors(golden / "expected" / ("tp" + std::to_string(t)) / "module.safetensors"))
      if (!fp32.count(k)) want["tp" + std::to_string(t) + "/" + k] = v;
  return want;
}

/// A checkpoint of the goldens: DeepSpeed's save (ckpt/) or ds_to_universal's output of it (universal/).
struct ds_checkpoint {
  const char* golden;
  int stage, tp;
  bool universal;
  /// A trainable parameter is presented as its fp32 master (ZeRO-3's files and universal
  /// checkpoints hold no other weight).
  bool master() const { return stage == 3 || universal; }
  const char* folder() const { return universal ? "universal" : "ckpt"; }
  const char* tag() const { return universal ? "global_step2_universal" : "global_step2"; }
};
constexpr ds_checkpoint ds_checkpoints[] = {{"zero1_bf16", 1, 1, false},    {"zero1_bf16", 1, 1, true},
                                            {"zero2_fp32", 2, 1, false},    {"zero2_bf16_tp2", 2, 2, false},
                                            {"zero2_bf16_tp2", 2, 2, true}, {"zero3_bf16", 3, 1, false},
                                            {"zero3_bf16", 3, 1, true}};
const fs::path ds_peers = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "peers";

}  // namespace

TEST_CASE("deepspeed layouts: every golden's tensors read through the library are the trainer's, bit for bit") {
  for (const auto& c : ds_checkpoints) {
    CAPTURE(c.golden);
    CAPTURE(c.universal);
    const auto want = ds_want(ds_peers / c.golden, c.master(), c.tp);
    const fs::path top = ds_peers / c.golden / c.folder();
    for (const fs::path& dir : {top, top / c.tag()}) {
      checkpoint_reader<file_directory> r{file_directory(dir)};
      CHECK(r.layout() == (c.universal ? deepspeed_universal_layout::info : deepspeed_layout::info));
      CHECK(r.metadata().tensors.size() == want.size());
      testing::check_golden_tensors(r, want);
      CHECK(r.read_object("global_steps") == pickle_value::integer(2));
      CHECK(r.read_object("optimizer.param_groups.0.weight_decay") == pickle_value::real(0.01));
      // each group's params by name, as get_state_dict names them: the peer's groups are the 2-D
      // weights (weight decay) and the rest
      for (int g = 0; g < 2; ++g) {
        const pickle_value params = r.read_object("optimizer.param_groups." + std::to_string(g) + ".params");
        REQUIRE(params.type() == pickle_value::kind::list);
        CHECK(!params.as_sequence("").empty());
        for (const auto& n : params.as_sequence("")) {
          const tensor_metadata* tm = r.find("optimizer.state." + n.as_string("") + ".exp_avg");
          REQUIRE(tm != nullptr);
          CHECK((tm->shape.size() == 2) == (g == 0));
        }
      }
    }
  }
}

TEST_CASE("deepspeed layouts: loaded in place by 3 ranks in row blocks and 4 in flat ranges, model and optimizer") {
  // Every tensor a golden presents (parameters, buffers, fp32 masters, exp_avg, exp_avg_sq, step)
  // loaded by a collective load of another world: 3 ranks each holding a block of rows (dim 0 cut
  // in ceil(rows / 3)), then 4 ranks each a flat element range (numel cut in ceil(numel / 4));
  // 0-d tensors whole on every rank. Each rank's bytes must be its slice of the trainer's tensor.
  std::size_t loaded = 0, views_made = 0;
  for (const auto& c : ds_checkpoints) {
    CAPTURE(c.golden);
    CAPTURE(c.universal);
    const auto want = ds_want(ds_peers / c.golden, c.master(), c.tp);
    views_made += (3 + 4) * want.size();
    loaded += testing::load_golden_in_other_worlds(file_directory(ds_peers / c.golden / c.folder()), want);
  }
  CHECK(loaded == views_made);
  CHECK(views_made == (3 + 4) * (5 * 37 + 2 * 39));  // the 7 checkpoints' tensors, each rank's view
}

TEST_CASE("deepspeed layout: a trainer's class is an opaque record only where the caller names it") {
  // {'f': fragment_address() BUILT with {'numel': 5, 'start': 7}, 'z': ZeroStageEnum(2)}, protocol 2
  const std::string p(
      "\x80\x02}q\x00(X\x01\x00\x00\x00"
      "fcdeepspeed.utils.tensor_fragment\nfragment_address\n)\x81}(X\x05\x00\x00\x00"
      "numelK\x05X\x05\x00\x00\x00"
      "startK\x07ubX\x01\x00\x00\x00"
      "zcdeepspeed.runtime.zero.config\nZeroStageEnum\nK\x02\x85Ru.",
      149);
  const torch_state_dict_pickle sd = parse_torch_state_dict_pickle(p, "t", {&deepspeed_records, true});
  REQUIRE(sd.value);
  const pickle_value& f = *sd.value->find("f");
  CHECK(torch_record_class(f) == "deepspeed.utils.tensor_fragment.fragment_address");
  CHECK(*f.find("numel") == pickle_value::integer(5));
  CHECK(*f.find("start") == pickle_value::integer(7));
  const pickle_value& z = *sd.value->find("z");
  CHECK(torch_record_class(z) == "deepspeed.runtime.zero.config.ZeroStageEnum");
  CHECK(*z.find(torch_record_args_key) == pickle_value::tuple({pickle_value::integer(2)}));
  // a record is one value, not walked as a dict, and not pickled again
  REQUIRE(sd.values.size() == 2);
  CHECK(!sd.values[0].unwritable.empty());
  // without the list (every other layout), or with one that does not name the class: refused
  expect_error([&] { (void)parse_torch_state_dict_pickle(p, "t"); }, errc::invalid_metadata,
               {"global 'deepspeed.utils.tensor_fragment.fragment_address'", "allowlist"});
  constexpr std::string_view only_size[] = {"torch.Size"};
  const pickle_record_classes other{only_size};
  expect_error([&] { (void)parse_torch_state_dict_pickle(p, "t", {&other, false}); }, errc::invalid_metadata,
               {"fragment_address"});
}

TEST_CASE("deepspeed layout: universal_checkpoint_info's patterns match as Python's re.match, or are refused") {
  const std::vector<std::string> names{"embed.weight",
                                       "embed.weights",
                                       "norm.bias",
                                       "norm",
                                       "row.bias",
                                       "xrow.bias",
                                       "row.weight",
                                       "row.weight2",
                                       "3.mlp.dense_4h_to_h.weight",
                                       "layers.12.attn.qkv",
                                       "layers.1.attn.wqkv",
                                       "ab",
                                       "axb",
                                       "y",
                                       "xxy",
                                       ""};
  // what Python 3's re.match(pattern, name) gives (computed with Python, not with this code)
  const std::vector<std::pair<std::string, std::set<std::string>>> cases{
      {R"(^embed\.weight$)", {"embed.weight"}},
      {R"(^norm\..*)", {"norm.bias"}},
      {R"(^row\.bias$)", {"row.bias"}},
      {R"(row\.weight)", {"row.weight", "row.weight2"}},
      {R"(\d+\.mlp\.dense_4h_to_h\.weight$)", {"3.mlp.dense_4h_to_h.weight"}},
      {R"(layers\.\d+\.attn\.w?qkv)", {"layers.12.attn.qkv", "layers.1.attn.wqkv"}},
      {R"(a.+b)", {"axb"}},
      {R"(x*y)", {"y", "xxy"}},
      {R"(^$)", {""}}};
  for (const auto& [pat, matched] : cases)
    for (const auto& n : names) {
      CAPTURE(pat);
      CAPTURE(n);
      const auto m = detail::ds_pattern_match(pat, n);
      REQUIRE(m.has_value());
      CHECK(*m == (matched.count(n) == 1));
    }
  // beyond the plain subset: not matched at all (the TP ranks are then presented on their own)
  for (const char* pat : {"(a|b)", "[0-9]+", "a{2}", "*a", "a\\", "\\Aa", "a$b"})
    CHECK_FALSE(detail::ds_pattern_match(pat, "a").has_value());
}
