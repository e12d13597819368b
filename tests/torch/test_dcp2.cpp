// torch.distributed.checkpoint as torch 2.x writes and reads it, against real torch 2.x (the
// Debian 13 leg: torch 2.6 in /usr/bin/python3 of the root; skipped where the interpreter holds
// torch 1.13, failed where SHARDSAFE_TORCH_PEER=2 asks for it). Both ways:
// - folders torch writes from a 4-process Gloo world of DTensors (tests/dcp2_fixture.py: FSDP2's
//   Shard(0) pieces of a model and its optimizer taken by get_state_dict, 2-D [Shard(0), Shard(1)]
//   and [Replicate(), Shard(0)] tensors, empty pieces, BF16/F16/I64/BOOL, a 3-D expert tensor,
//   non-tensor items) load into c10d worlds of 1, 2, 3 and 4 processes bit for bit; the tool's
//   digest equals torch's hashes; to-hf is read back by Python's safetensors; a LibTorch AdamW,
//   Adam and SGD (momentum) resume in 3 processes with torch's state, steps and hyper-parameters;
// - the golden fixtures (tests/fixtures/dcp_torch2/), made again by this torch, still match;
// - the tool's to-dcp of an HF folder (written by Python's safetensors) and of torch's own folder
//   loads in torch's dcp.load bit for bit (tests/dcp2_tool_check.py);
// - torch.save files this torch writes (tests/torch_save_fixture.py: zip, legacy and protocol-4
//   state dicts, a training checkpoint) digest as torch gives their tensors; the tool's to-dcp of
//   the training checkpoint is torch's own dcp.save of it;
// - a folder 3 C++ processes save in get_state_dict's layout (examples/sharded_mlp.hpp's model
//   and AdamW, flat shards) is read by torch's dcp.load + set_state_dict in one process (and
//   resumes AdamW: tests/dcp2_check.py) and into DTensors on a 2 x 2 mesh.
// Expected values are always torch's own (raw bytes written by the Python side) or, for the C++
// save, the ranks' shards gathered by the test and written out raw, never the library's reading.
#include "shardsafe/torch/model_and_optim.hpp"

#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <simdjson.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "../../examples/sharded_mlp.hpp"
#include "support/dcp_digest.hpp"
#include "fixtures.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/c10d.hpp"
#include "shardsafe/torch/compat.hpp"
#include "world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

/// The fixture folder of tests/dcp2_fixture.py, made once per test binary run.
const fs::path& torch2_fixture() {
  static testing::temp_dir dir("dcp2-fixture");
  static const bool made = [] {
    const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp2_fixture.py";
    const auto r = testing::peer(testing::torch_python, {script.string(), dir.str()});
    if (r.code != 0) throw std::runtime_error("tests/dcp2_fixture.py failed:\n" + r.err);
    return true;
  }();
  (void)made;
  return dir.path;
}

/// A tensor's full bytes gathered from every rank's flat shard (ranks hold consecutive ranges).
template <class C>
std::string gather_flat(C& comm, const at::Tensor& local) {
  std::string all;
  for (const auto& p :
       comm.all_gather_bytes(std::string_view(static_cast<const char*>(local.data_ptr()), local.nbytes())))
    all += p;
  return all;
}

/// The hyper-parameters of group 0 in a groups_KIND.json the fixture wrote.
struct py_group {
  double lr = 0, eps = 0, weight_decay = 0, momentum = 0, dampening = 0, beta1 = 0, beta2 = 0;
  bool amsgrad = false, nesterov = false;
};
py_group read_group(const fs::path& json) {
  simdjson::dom::parser p;
  const std::string text = testing::slurp(json);
  simdjson::dom::element g = p.parse(text).at(0);
  py_group out;
  auto num = [&](const char* k) { return double(g[k]); };
  out.lr = num("lr");
  out.weight_decay = num("weight_decay");
  if (g["eps"].error() == simdjson::SUCCESS) out.eps = num("eps");
  if (g["betas"].error() == simdjson::SUCCESS) {
    out.beta1 = double(g["betas"].at(0));
    out.beta2 = double(g["betas"].at(1));
  }
  if (g["amsgrad"].error() == simdjson::SUCCESS) out.amsgrad = bool(g["amsgrad"]);
  if (g["momentum"].error() == simdjson::SUCCESS) {
    out.momentum = num("momentum");
    out.dampening = num("dampening");
    out.nesterov = bool(g["nesterov"]);
  }
  return out;
}

}  // namespace

// args: checkpoint folder, reference folder (digest.txt, raw/), groups json, adamw|adam|sgd.
// A model whose parameters are named as the Python one's ("0.weight", ...), flat shards of this
// world, an optimizer of wrong hyper-parameters; after load_model_and_optim_state the gathered
// parameters and state, the steps and the hyper-parameters must be torch's.
WORKER_SCENARIO("dcp2_resume") {
  at::set_num_threads(1);
  auto w = init_world_from_env();
  auto comm = w.comm();
  const fs::path ckpt = args.at(0), ref = args.at(1);
  const py_group want = read_group(args.at(2));
  const std::string kind = args.at(3);
  std::map<std::string, testing::torch_digest_entry> by_key;
  for (auto& e : testing::read_torch_digest(ref)) by_key.emplace(e.key, std::move(e));
  state_dict sd;
  std::vector<std::pair<std::string, at::Tensor>> params;  // name, local shard
  for (const auto& [key, e] : by_key) {
    if (!key.starts_with("model.")) continue;
    const std::string name = key.substr(6);
    const auto spec = testing::flat_part(e.shape, w.world_size, w.rank);
    at::Tensor local = at::zeros({static_cast<std::int64_t>(spec.local_numel())});
    sd.add(name, local, spec, e.shape);
    params.emplace_back(name, local);
  }
  std::vector<at::Tensor> ps;
  for (auto& [n, t] : params) ps.push_back(t);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (kind == "adamw")
    opt = std::make_unique<torch::optim::AdamW>(ps, torch::optim::AdamWOptions(0.5).weight_decay(0.7));
  if (kind == "adam") opt = std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(0.5).eps(0.3));
  if (kind == "sgd") opt = std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.5).momentum(0.1));
  load_model_and_optim_state(file_directory(ckpt), sd, opt.get(), comm);
  int bad = 0;
  auto check = [&](const std::string& key, const at::Tensor& local) {
    const std::string full = gather_flat(comm, local);
    if (w.rank == 0 && full != by_key.at(key).raw) {
      std::fprintf(stderr, "%s: %s differs from torch's\n", kind.c_str(), key.c_str());
      ++bad;
    }
  };
  for (auto& [n, t] : params) {
    check("model." + n, t);
    auto* s = optimizer_state_of(*opt, t);
    if (!s) {
      std::fprintf(stderr, "%s: no optimizer state for %s\n", kind.c_str(), n.c_str());
      return 2;
    }
    const std::string st = "optim.state." + n + ".";
    if (kind == "sgd") {
      check(st + "momentum_buffer", static_cast<torch::optim::SGDParamState&>(*s).momentum_buffer());
      continue;
    }
    std::int64_t step = 0;
    if (kind == "adamw") {
      auto& a = static_cast<torch::optim::AdamWParamState&>(*s);
      check(st + "exp_avg", a.exp_avg());
      check(st + "exp_avg_sq", a.exp_avg_sq());
      step = a.step();
    } else {
      auto& a = static_cast<torch::optim::AdamParamState&>(*s);
      check(st + "exp_avg", a.exp_avg());
      check(st + "exp_avg_sq", a.exp_avg_sq());
      step = a.step();
    }
    float want_step = 0;
    std::memcpy(&want_step, by_key.at(st + "step").raw.data(), 4);
    if (step != static_cast<std::int64_t>(want_step) || step != 2) {
      std::fprintf(stderr, "%s: %s step %lld, torch's %g\n", kind.c_str(), n.c_str(), (long long)step, want_step);
      ++bad;
    }
  }
  auto& o = opt->param_groups().front().options();
  auto differs = [&](const char* what, double a, double b) {
    if (a != b) {
      std::fprintf(stderr, "%s: %s is %.17g, torch's %.17g\n", kind.c_str(), what, a, b);
      ++bad;
    }
  };
  differs("lr", o.get_lr(), want.lr);
  if (kind == "adamw") {
    auto& a = static_cast<torch::optim::AdamWOptions&>(o);
    differs("weight_decay", a.weight_decay(), want.weight_decay);
    differs("eps", a.eps(), want.eps);
    differs("beta1", std::get<0>(a.betas()), want.beta1);
    differs("beta2", std::get<1>(a.betas()), want.beta2);
  } else if (kind == "adam") {
    auto& a = static_cast<torch::optim::AdamOptions&>(o);
    differs("eps", a.eps(), want.eps);
    differs("beta1", std::get<0>(a.betas()), want.beta1);
    differs("beta2", std::get<1>(a.betas()), want.beta2);
  } else {
    auto& a = static_cast<torch::optim::SGDOptions&>(o);
    differs("momentum", a.momentum(), want.momentum);
    differs("weight_decay", a.weight_decay(), want.weight_decay);
    differs("nesterov", a.nesterov(), want.nesterov);
  }
  return bad == 0 ? 0 : 1;
}

// args: output folder. 3 steps of examples/sharded_mlp.hpp's model and AdamW (flat shards), saved
// in torch's get_state_dict layout to OUT/ckpt; OUT/ref holds the ranks' shards gathered (raw,
// digest.txt) and the groups (groups.json) for tests/dcp2_check.py.
WORKER_SCENARIO("dcp2_save") {
  at::set_num_threads(1);
  auto w = init_world_from_env();
  auto comm = w.comm();
  const fs::path out = args.at(0);
  demo::sharded_mlp m(w.world_size, w.rank, demo::optim_kind::adamw);
  for (int s = 0; s < 3; ++s) m.step(comm);
  save_options so;
  so.format = save_format::dcp;
  save_model_and_optim_state(file_directory(out / "ckpt"), m.state(), &m.optimizer(), comm, so);
  // the reference: every shard gathered, written raw with its digest line
  std::string digest;
  auto put = [&](const std::string& key, const std::string& bytes, const std::string& dt, const shape_t& shape) {
    if (w.rank != 0) return;
    fs::create_directories(out / "ref" / "raw");
    std::ofstream(out / "ref" / "raw" / (key + ".bin"), std::ios::binary) << bytes;
    digest += key + " " + dt + " " + to_string(shape) + " " + testing::sha256_hex(bytes) + "\n";
  };
  const auto sd = m.state();
  for (const auto& [name, st] : sd) {
    put("model." + name, gather_flat(comm, st.local), "F32", st.full_shape);
    auto& a = static_cast<torch::optim::AdamWParamState&>(*optimizer_state_of(m.optimizer(), st.local));
    put("optim.state." + name + ".exp_avg", gather_flat(comm, a.exp_avg()), "F32", st.full_shape);
    put("optim.state." + name + ".exp_avg_sq", gather_flat(comm, a.exp_avg_sq()), "F32", st.full_shape);
    put("optim.state." + name + ".max_exp_avg_sq", gather_flat(comm, a.max_exp_avg_sq()), "F32", st.full_shape);
    const float step = static_cast<float>(a.step());
    put("optim.state." + name + ".step", std::string(reinterpret_cast<const char*>(&step), 4), "F32", {});
  }
  if (w.rank == 0) {
    std::ofstream(out / "ref" / "digest.txt") << digest;
    // the groups, in the optimizer's order, with their parameters' names
    std::string json = "[";
    std::size_t gi = 0;
    for (auto& g : m.optimizer().param_groups()) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(g.options());
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "{\"lr\": %.17g, \"betas\": [%.17g, %.17g], \"eps\": %.17g, \"weight_decay\": %.17g, \"amsgrad\": "
                    "%s, \"params\": [",
                    o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                    o.amsgrad() ? "true" : "false");
      json += std::string(gi++ ? ", " : "") + buf;
      std::size_t pi = 0;
      for (const auto& p : g.params())
        for (const auto& [name, st] : sd)
          if (st.local.unsafeGetTensorImpl() == p.unsafeGetTensorImpl())
            json += std::string(pi++ ? ", " : "") + testing::json_quoted(name);
      json += "]}";
    }
    std::ofstream(out / "ref" / "groups.json") << json << "]\n";
  }
  return 0;
}

TEST_CASE("dcp2: torch 2.x DTensor folders (1-D, 2-D, HSDP, experts, empty pieces) load into 1, 2, 3 and 4 ranks" *
          testing::torch_major_check(2)) {
  REQUIRE_MESSAGE(testing::torch_major() == 2,
                  "the test command asks for torch 2.x but " << testing::torch_python << " does not hold it");
  const fs::path& dir = torch2_fixture();
  for (const char* how : {"rows", "cols", "flat"})
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(how);
      CAPTURE(n);
      auto res = testing::run_world("dcp_load", n, {dir.string(), "ckpt", how});
      CHECK_MESSAGE(res.ok(), res.report());
    }
}

TEST_CASE("dcp2: the tool's digest of a torch 2.x folder is torch's; to-hf is read back equal by Python's safetensors" *
          testing::torch_major_check(2, !testing::have_tool())) {
  REQUIRE(testing::torch_major() == 2);
  const fs::path& dir = torch2_fixture();
  const auto d = testing::run_tool({"digest", (dir / "ckpt").string()});
  REQUIRE_MESSAGE(d.code == 0, d.err);
  CHECK(d.out == testing::slurp(dir / "digest.txt"));  // non-tensor items are left out of a digest
  testing::temp_dir out("dcp2-hf");
  const auto h = testing::run_tool({"to-hf", (dir / "ckpt").string(), (out.path / "hf").string()});
  REQUIRE_MESSAGE(h.code == 0, h.err);
  const std::string py =
      "import sys, os, hashlib\n"
      "from safetensors.torch import load_file\n"
      "t = load_file(os.path.join(sys.argv[1], 'model.safetensors'))\n"
      "for k in sorted(t):\n"
      "    v = t[k].contiguous().reshape(-1)\n"
      "    b = v.view(__import__('torch').uint8).numpy().tobytes() if v.numel() else b''\n"
      "    print(k, hashlib.sha256(b).hexdigest(), b == open(os.path.join(sys.argv[2], 'raw', k + '.bin'), "
      "'rb').read())\n";
  const auto r = testing::peer(testing::torch_python, {"-c", py, (out.path / "hf").string(), dir.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(r.out.find("False") == std::string::npos);
  CHECK(r.out.find("model.0.weight ") != std::string::npos);
  CHECK(r.out.find("extra.experts ") != std::string::npos);
}

TEST_CASE("dcp2: the golden fixtures, made again by this torch, still match the committed ones" *
          testing::torch_major_check(2, !testing::have_tool())) {
  REQUIRE(testing::torch_major() == 2);
  const fs::path golden = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "dcp_torch2";
  testing::temp_dir out("dcp2-golden");
  const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp2_fixture.py";
  const auto r = testing::peer(testing::torch_python, {script.string(), out.str(), "--small"});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  // torch's own hashes of every tensor, and the tool's reading of the new folder, are the committed ones
  CHECK(testing::slurp(out.path / "digest.txt") == testing::slurp(golden / "digest.txt"));
  const auto d = testing::run_tool({"digest", (out.path / "ckpt").string()});
  REQUIRE_MESSAGE(d.code == 0, d.err);
  CHECK(d.out == testing::slurp(golden / "digest.txt"));
  // the same files (a .metadata and one data file per rank)
  auto names = [](const fs::path& d) {
    std::vector<std::string> n;
    for (const auto& e : fs::directory_iterator(d)) n.push_back(e.path().filename().string());
    std::sort(n.begin(), n.end());
    return n;
  };
  CHECK(names(out.path / "ckpt") == names(golden / "ckpt"));
}

TEST_CASE(
    "dcp2: the tool's to-dcp of an HF folder and of a torch 2.x folder loads in torch 2.x (dcp.load) bit for bit" *
    testing::torch_major_check(2, !testing::have_tool())) {
  REQUIRE(testing::torch_major() == 2);
  const fs::path& fixture = torch2_fixture();
  testing::temp_dir out("dcp2-to-dcp");
  const auto script = (fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp2_tool_check.py").string();
  const auto made = testing::peer(testing::torch_python, {script, "hf", out.str()});
  REQUIRE_MESSAGE(made.code == 0, made.err);
  struct conversion {
    fs::path from, to, raw;
  };
  for (const auto& c : {conversion{out.path / "hf", out.path / "hf_dcp", out.path / "hf_raw"},
                        conversion{fixture / "ckpt", out.path / "dcp_dcp", fixture / "raw"}}) {
    CAPTURE(c.from);
    const auto t = testing::run_tool({"to-dcp", c.from.string(), c.to.string()});
    REQUIRE_MESSAGE(t.code == 0, t.err);
    const auto r = testing::peer(testing::torch_python, {script, "check", c.to.string(), c.raw.string()});
    CHECK_MESSAGE(r.code == 0, r.out << r.err);
    CHECK(r.out.starts_with("ok "));
  }
}

TEST_CASE(
    "dcp2: torch 2.x's torch.save files (zip, legacy, protocol 4, a training checkpoint) digest as torch wrote them; "
    "to-dcp "
    "of the training checkpoint is torch's own dcp.save of it" *
    testing::torch_major_check(2, !testing::have_tool())) {
  REQUIRE(testing::torch_major() == 2);
  testing::temp_dir out("dcp2-train");
  const auto fixture = (fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "torch_save_fixture.py").string();
  const auto made = testing::peer(testing::torch_python, {fixture, (out.path / "fx").string()});
  REQUIRE_MESSAGE(made.code == 0, made.err);
  // every folder's digest from torch's own bytes (expected.json: sha256 of each tensor's
  // row-major bytes as torch gives them), the legacy and protocol-4 twins against their zip's
  simdjson::dom::parser parser;
  const std::string json = testing::slurp(out.path / "fx" / "expected.json");
  const simdjson::dom::element expected = parser.parse(json);
  for (const std::string folder : {"single", "sharded", "nested", "single_legacy", "sharded_legacy", "nested_legacy",
                                   "single_legacy4", "train/train.pt", "train_legacy/train.pt"}) {
    CAPTURE(folder);
    std::string want;
    for (auto [key, v] : simdjson::dom::object(expected[folder.substr(0, folder.find_first_of("_/"))])) {
      std::string shape = "[";
      for (auto d : simdjson::dom::array(v["shape"]))
        shape += (shape.size() > 1 ? "," : "") + std::to_string(std::uint64_t(d));
      want += std::string(key) + " " + std::string(std::string_view(v["dtype"])) + " " + shape + "] " +
              std::string(std::string_view(v["sha256"])) + "\n";
    }
    const auto d = testing::run_tool({"digest", (out.path / "fx" / folder).string()});
    REQUIRE_MESSAGE(d.code == 0, d.err);
    CHECK(d.out == want);
  }
  const auto script = (fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp2_tool_check.py").string();
  for (const std::string folder : {"train", "train_legacy"}) {
    CAPTURE(folder);
    const fs::path to = out.path / (folder + "_dcp");
    const auto t = testing::run_tool({"to-dcp", (out.path / "fx" / folder / "train.pt").string(), to.string()});
    REQUIRE_MESSAGE(t.code == 0, t.err);
    // the reference: torch.load of the zip file, saved by torch's dcp.save
    const auto r = testing::peer(testing::torch_python,
                                 {script, "train", (out.path / "fx" / "train" / "train.pt").string(), to.string()});
    CHECK_MESSAGE(r.code == 0, r.out << r.err);
    CHECK(r.out.starts_with("ok "));
  }
}

TEST_CASE(
    "dcp2: LibTorch AdamW, Adam and SGD (momentum) resume in 3 ranks from torch 2.x's get_state_dict layout, "
    "bit-exact" *
    testing::torch_major_check(2)) {
  REQUIRE(testing::torch_major() == 2);
  const fs::path& dir = torch2_fixture();
  for (const char* kind : {"adamw", "adam", "sgd"}) {
    CAPTURE(kind);
    const std::string k = kind;
    const fs::path ckpt = dir / (k == "adamw" ? "ckpt" : "ckpt_" + k);
    const fs::path ref = k == "adamw" ? dir : dir / ("ckpt_" + k + "_ref");
    auto res = testing::run_world("dcp2_resume", 3,
                                  {ckpt.string(), ref.string(), (dir / ("groups_" + k + ".json")).string(), k});
    CHECK_MESSAGE(res.ok(), res.report());
  }
}

TEST_CASE(
    "dcp2: a 3-rank C++ save in get_state_dict layout loads in torch 2.x (one process, set_state_dict resumes AdamW; "
    "DTensors on a 2 x 2 mesh)" *
    testing::torch_major_check(2)) {
  REQUIRE(testing::torch_major() == 2);
  testing::temp_dir out("dcp2-save");
  auto res = testing::run_world("dcp2_save", 3, {out.str()});
  REQUIRE_MESSAGE(res.ok(), res.report());
  CHECK(fs::exists(out.path / "ckpt" / ".metadata"));
  CHECK(fs::exists(out.path / "ckpt" / "__2_0.distcp"));
  const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp2_check.py";
  for (const char* mode : {"single", "mesh"}) {
    CAPTURE(mode);
    const auto r = testing::peer(testing::torch_python,
                                 {script.string(), (out.path / "ckpt").string(), (out.path / "ref").string(), mode});
    CHECK_MESSAGE(r.code == 0, r.out << r.err);
    CHECK(r.out == "ok\n");
  }
  // and the C++ side reads it back: the tool's digest equals the gathered shards' hashes
  if (testing::have_tool()) {
    const auto d = testing::run_tool({"digest", (out.path / "ckpt").string()});
    REQUIRE_MESSAGE(d.code == 0, d.err);
    std::vector<std::string> want, got;
    std::istringstream a(testing::slurp(out.path / "ref" / "digest.txt")), b(d.out);
    for (std::string l; std::getline(a, l);) want.push_back(l);
    for (std::string l; std::getline(b, l);) got.push_back(l);
    std::sort(want.begin(), want.end());
    CHECK(got == want);
  }
}
