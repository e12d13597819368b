// Hugging Face folders imported into torch::nn::Modules in real multi-process c10d worlds
// (torch/hf_state_dict.hpp): row, column and flat shards, a transposed (non-contiguous) parameter
// that goes through staging, a BF16 file tensor into an F32 parameter, a buffer, and a tied
// output embedding; every-rank-read and rank-0-broadcast. Expected values are the full
// tensors sliced with ATen (fixtures.hpp), never the library's own cursors.
#include "shardsafe/torch/hf_state_dict.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "fixtures.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "cluster.hpp"
#include "world.hpp"

using namespace shardsafe;
using testing::block_part;
using testing::expected_full;
using testing::flat_part;
using testing::local_of;

namespace {

/// A module to hang parameters on by dotted name.
struct holder : torch::nn::Module {};

/// The child module `name` of m, made if missing.
torch::nn::Module& child(torch::nn::Module& m, const std::string& name) {
  for (auto& c : m.named_children())
    if (c.key() == name) return *c.value();
  return *m.register_module(name, std::make_shared<holder>());
}

/// Registers t as parameter (or buffer) `dotted` of root, making the modules on the way.
void put(torch::nn::Module& root, const std::string& dotted, const at::Tensor& t, bool buffer = false) {
  torch::nn::Module* m = &root;
  std::size_t start = 0;
  for (std::size_t dot; (dot = dotted.find('.', start)) != std::string::npos; start = dot + 1)
    m = &child(*m, dotted.substr(start, dot - start));
  if (buffer)
    m->register_buffer(dotted.substr(start), t);
  else
    m->register_parameter(dotted.substr(start), t);
}

enum class cut { whole, rows, cols, flat };

struct param {
  std::string key;  ///< the model's name; the file's is "model." + key
  dtype file_type, model_type;
  shape_t shape;
  cut how;
  bool transposed = false;  ///< the parameter is a transposed view (not contiguous)
  bool buffer = false;
};

std::vector<param> params() {
  return {
      {"embed_tokens.weight", dtype::F32, dtype::F32, {12, 8}, cut::rows},
      {"layers.0.q_proj.weight", dtype::F32, dtype::F32, {8, 8}, cut::rows},
      {"layers.0.o_proj.weight", dtype::F32, dtype::F32, {8, 10}, cut::cols, true},
      {"layers.0.norm.weight", dtype::F32, dtype::F32, {9}, cut::flat},
      {"layers.0.mlp.up.weight", dtype::BF16, dtype::F32, {6, 8}, cut::cols},
      {"layers.0.attn.scale", dtype::I64, dtype::I64, {3}, cut::whole, false, true},
  };
}

std::optional<shard_spec> spec_of(const param& p, int w, int r) {
  switch (p.how) {
    case cut::whole: return std::nullopt;
    case cut::rows: return block_part(p.shape, 0, w, r);
    case cut::cols: return block_part(p.shape, 1, w, r);
    case cut::flat: return flat_part(p.shape, w, r);
  }
  return std::nullopt;
}

at::Tensor file_tensor(const param& p) { return expected_full("model." + p.key, p.file_type, p.shape, true); }

std::string hf_bytes_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

/// The folder: the embedding and layer 0's attention in file 1, the rest in file 2, indexed;
/// no lm_head (tied to the embedding, as tie_word_embeddings folders are).
void write_folder(const std::filesystem::path& dir) {
  std::vector<fixtures::tensor> a, b;
  std::string map;
  std::uint64_t total = 0;
  for (const auto& p : params()) {
    const std::string key = "model." + p.key;
    const bool first = key < "model.layers.0.n";
    at::Tensor t = file_tensor(p);
    (first ? a : b).push_back({key, std::string(name(p.file_type)), p.shape, hf_bytes_of(t)});
    map += std::string(map.empty() ? "" : ", ") + "\"" + key + "\": \"" + (first ? fixtures::file1 : fixtures::file2) +
           "\"";
    total += t.nbytes();
  }
  file_directory d(dir);
  fixtures::put(d, fixtures::file1, fixtures::build_file(a));
  fixtures::put(d, fixtures::file2, fixtures::build_file(b));
  fixtures::put(d, "model.safetensors.index.json",
                "{\"metadata\": {\"total_size\": " + std::to_string(total) + "}, \"weight_map\": {" + map + "}}");
}

}  // namespace

// args: HF folder, mode[, ready folder, timeout in ms]: with the last two, after the first
// import (checked) the rank marks itself ready and imports again and again until the world
// breaks (tests/torch/test_cluster.cpp's kill cases).
WORKER_SCENARIO("hf_import_module") {
  auto w =
      args.size() > 3 ? init_world_from_env(std::chrono::milliseconds(std::stol(args.at(3)))) : init_world_from_env();
  auto comm = w.comm();
  holder model;
  shard_map shards;
  std::vector<at::Tensor> locals;
  for (const auto& p : params()) {
    auto spec = spec_of(p, w.world_size, w.rank);
    shape_t local = shape_of(local_of(file_tensor(p), spec));
    if (spec && spec->is_flat()) local = {spec->local_numel()};
    at::Tensor t = p.transposed ? at::zeros({static_cast<std::int64_t>(local[1]), static_cast<std::int64_t>(local[0])},
                                            *to_scalar_type(p.model_type))
                                      .t()
                                : at::zeros(to_sizes(local), *to_scalar_type(p.model_type));
    put(model, p.key, t, p.buffer);
    if (spec) shards[p.key] = shard_info{*spec, p.shape};
    locals.push_back(t);
  }
  put(model, "lm_head.weight", locals.front());  // tied: the embedding's tensor under a second name
  shards["lm_head.weight"] = shards.at("embed_tokens.weight");

  hf_import_options opt;
  opt.rename = rename_rules({R"(^model\.(.*)=\1)"});
  opt.strict = true;
  opt.mode = args.at(1) == "rank0_broadcast" ? hf_import_mode::rank0_broadcast
             : args.at(1) == "automatic"     ? hf_import_mode::automatic
                                             : hf_import_mode::every_rank_read;
  opt.chunk_bytes = 100;  // several chunks per tensor
  const hf_import_stats res = load_hf_module(file_directory(args.at(0)), model, comm, shards, opt);
  const bool broadcast = res.mode == hf_import_mode::rank0_broadcast;
  // the mode used, for the test to compare across ranks (automatic: each rank's own pick)
  std::fprintf(stderr, "mode used: %s (%s)\n", std::string(to_string(res.mode)).c_str(), res.why.c_str());

  int bad = 0;
  auto complain = [&](const std::string& what) {
    std::fprintf(stderr, "rank %d of %d (%s): %s\n", w.rank, w.world_size, args.at(1).c_str(), what.c_str());
    ++bad;
  };
  std::uint64_t shard_bytes = 0;
  const auto named = model.named_parameters();
  const auto buffers = model.named_buffers();
  for (const auto& p : params()) {
    auto spec = spec_of(p, w.world_size, w.rank);
    at::Tensor want = local_of(file_tensor(p).to(*to_scalar_type(p.model_type)), spec);
    at::Tensor got = p.buffer ? buffers[p.key] : named[p.key];
    if (!testing::same_bits(got.contiguous().reshape({-1}), want.reshape({-1}))) complain(p.key + " differs");
    shard_bytes += static_cast<std::uint64_t>(want.numel()) * item_size(p.file_type);
  }
  if (named["lm_head.weight"].data_ptr() != named["embed_tokens.weight"].data_ptr() ||
      !named["lm_head.weight"].is_same(locals.front()))
    complain("lm_head.weight is no longer tied to embed_tokens.weight");
  if (res.keys.loaded_views != params().size() + 1 || res.keys.tied_views != 1 || !res.keys.missing_keys.empty() ||
      !res.keys.unexpected_keys.empty())
    complain("keys: " + res.message);
  if (!broadcast && double(res.stats.bytes_read) > 1.1 * double(shard_bytes))
    complain("read " + std::to_string(res.stats.bytes_read) + " bytes for a shard of " + std::to_string(shard_bytes));
  if (broadcast && w.rank != 0 && res.stats.bytes_read != 0) complain("a rank other than 0 read the files");
  if (bad == 0 && args.size() > 3) {
    std::ofstream(std::filesystem::path(args.at(2)) / ("ready" + std::to_string(w.rank))) << "x";
    for (;;) load_hf_module(file_directory(args.at(0)), model, comm, shards, opt);
  }
  return bad == 0 ? 0 : 1;
}

TEST_CASE("hf import into torch::nn::Module: 2-4 c10d ranks, row/column/flat shards, both modes, bit for bit") {
  testing::temp_dir dir("hf-import");
  write_folder(dir.path);
  for (const char* mode : {"every_rank_read", "rank0_broadcast"})
    for (int w : {2, 3}) {
      CAPTURE(mode);
      CAPTURE(w);
      auto r = testing::run_world("hf_import_module", w, {dir.str(), mode});
      CHECK_MESSAGE(r.ok(), r.report());
    }
  // automatic on one host: every rank reads its own shards, without measuring
  auto ra = testing::run_world("hf_import_module", 3, {dir.str(), "automatic"});
  CHECK_MESSAGE(ra.ok(), ra.report());
  for (const auto& e : ra.err)
    CHECK_MESSAGE(e.find("mode used: every_rank_read (every rank runs on one host)") != std::string::npos, e);
  auto r4 = testing::run_world("hf_import_module", 4, {dir.str(), "rank0_broadcast"});
  CHECK_MESSAGE(r4.ok(), r4.report());
}

TEST_CASE("hf import on a simulated cluster: 6 ranks over 3 nodes, both modes and automatic's pick, bit for bit" *
          doctest::skip(testing::cluster_skipped())) {
  testing::temp_dir dir("hf-import-cluster");
  write_folder(dir.path);
  testing::sim_cluster c(3);
  for (const char* mode : {"every_rank_read", "rank0_broadcast", "automatic"}) {
    CAPTURE(mode);
    auto r = testing::run_on(c, "hf_import_module", 6, 2, {dir.str(), mode}, dir.path / (std::string("log-") + mode));
    CHECK_MESSAGE(r.ok(), r.report());
    if (std::string(mode) != "automatic") continue;
    // ranks on three nodes measure; every rank picks the same mode from the same figures
    std::string first;
    for (const auto& e : r.err) {
      const auto at = e.find("mode used: ");
      REQUIRE_MESSAGE(at != std::string::npos, e);
      const std::string line = e.substr(at, e.find('\n', at) - at);
      CHECK_MESSAGE(line.find("estimated every_rank_read ") != std::string::npos, line);
      const std::string picked = line.substr(0, line.find(" ("));
      if (first.empty()) first = picked;
      CHECK(picked == first);
    }
    MESSAGE("automatic on the cluster: " << r.err.front().substr(r.err.front().find("mode used: ")));
  }
}

TEST_CASE("hf import on a simulated cluster: a rank SIGKILLed during rank 0's broadcast ends every rank, naming it" *
          doctest::skip(testing::cluster_skipped())) {
  testing::temp_dir dir("hf-import-cluster-kill");
  std::filesystem::create_directories(dir.path / "hf");
  write_folder(dir.path / "hf");
  const auto ready = dir.path / "ready";
  std::filesystem::create_directories(ready);
  testing::sim_cluster c(3);
  const int ranks = 6, timeout_ms = 10000;
  const auto b = testing::break_world(
      c, "hf_import_module",
      {(dir.path / "hf").string(), "rank0_broadcast", ready.string(), std::to_string(timeout_ms)}, ready, ranks, 2,
      timeout_ms, dir.path / "log", [](const testing::sim_cluster&, shardsafe::local_world& w) {
        w.kill_rank(3, SIGKILL);
        return 3;
      });
  testing::check_broken(b, ranks, "import " + (dir.path / "hf").string() + ": ");
}

TEST_CASE("hf import into a state dict in one process: staging of non-contiguous tensors, tied staging") {
  testing::temp_dir dir("hf-import-sd");
  write_folder(dir.path);
  single_process comm;
  const auto ps = params();
  at::Tensor o = at::zeros({10, 8}).t();  // [8, 10], not contiguous
  state_dict sd;
  sd.add("model.layers.0.o_proj.weight", o).add("alias.o_proj", o);  // tied, both staged
  hf_import_options opt;
  opt.lora_base_layer = true;
  const hf_import_stats res = load_hf_state_dict(file_directory(dir.path), sd, comm, opt);
  CHECK(testing::same_bits(o.contiguous(), file_tensor(ps[2]).contiguous()));
  CHECK(res.keys.tied_views == 1);
  CHECK(res.keys.unexpected_keys.size() == ps.size() - 1);
  CHECK(res.keys.missing_keys.empty());
}

WORKER_SCENARIO("hf_import_bad_rank") {
  auto w = init_world_from_env();
  auto comm = w.comm();
  // rank 1 says the norm is 10 elements long (the file's is 9): every rank must throw its error
  holder model;
  const std::uint64_t n = w.rank == 1 ? 10 : 9;
  put(model, "layers.0.norm.weight", at::zeros({static_cast<std::int64_t>(n)}));
  hf_import_options opt;
  opt.rename = rename_rules({R"(^model\.(.*)=\1)"});
  opt.mode = args.at(1) == "rank0_broadcast" ? hf_import_mode::rank0_broadcast : hf_import_mode::every_rank_read;
  try {
    load_hf_module(file_directory(args.at(0)), model, comm, {}, opt);
  } catch (const error& e) {
    const std::string what = e.what();
    if (e.code() == errc::shape_mismatch && what.rfind("rank 1: ", 0) == 0 &&
        what.find("tensor 'model.layers.0.norm.weight' (model tensor 'layers.0.norm.weight', by rename rule") !=
            std::string::npos)
      return 0;
    std::fprintf(stderr, "rank %d: unexpected error: %s\n", w.rank, what.c_str());
    return 1;
  }
  std::fprintf(stderr, "rank %d: no error\n", w.rank);
  return 1;
}

TEST_CASE("hf import into torch::nn::Module: one rank's bad tensor fails every c10d rank with its error") {
  testing::temp_dir dir("hf-import-bad");
  write_folder(dir.path);
  for (const char* mode : {"every_rank_read", "rank0_broadcast"}) {
    CAPTURE(mode);
    auto r = testing::run_world("hf_import_bad_rank", 2, {dir.str(), mode});
    CHECK_MESSAGE(r.ok(), r.report());
  }
}
