// Tests of checkpoint/hf/import.hpp: Hugging Face folders written here byte by byte
// (tests/support/checkpoint_fixtures.hpp) imported into thread worlds of 1-4 ranks (tests/support/thread_world.hpp)
// with row, column and flat shards, in both modes; the values expected are cut from the full
// tensors by this file's own loops, and conversions computed here bit by bit. Folders in the
// torch.save layout (pytorch_model.bin, format/torch_save.hpp) are written by torch itself
// (tests/torch_save_fixture.py), their tensors' bytes as torch gives them.
#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/checkpoint/verify.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
using fixtures::tensor;

namespace {

// ---------------------------------------------------------------------------------------
// the folder: a llama-like model under "model.", split over two files, with a tensor the
// rules drop and one the model does not have

std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// n elements of `item` bytes: raw bits, or finite values in [0.5, 2) for BF16/F32 (`finite`),
/// with some F32 values exactly halfway between two BF16s (ties, both parities).
std::string make_bytes(std::uint64_t seed, std::uint64_t n, const std::string& dt, bool finite = false) {
  std::string out;
  for (std::uint64_t i = 0; i < n; ++i) {
    std::uint64_t b = mix(seed * 1000003 + i);
    if (dt == "BF16") {
      if (finite) b = (b & 0x807F) | 0x3F00;
      out.append(reinterpret_cast<const char*>(&b), 2);
    } else {
      if (finite) b = (b & 0x807FFFFF) | 0x3F000000;
      if (finite && i % 5 == 1) b = (b & 0xFFFE0000) | 0x8000;   // tie, even: rounds down
      if (finite && i % 5 == 3) b = (b & 0xFFFE0000) | 0x18000;  // tie, odd: rounds up
      std::uint32_t v = static_cast<std::uint32_t>(b);
      out.append(reinterpret_cast<const char*>(&v), 4);
    }
  }
  return out;
}

std::vector<tensor> hf_tensors() {
  return {
      {"model.embed_tokens.weight", "F32", {10, 6}, make_bytes(1, 60, "F32")},
      {"model.layers.0.mlp.bf16", "BF16", {5, 4}, make_bytes(2, 20, "BF16", true)},
      {"model.layers.0.mlp.f32", "F32", {4, 5}, make_bytes(3, 20, "F32", true)},
      {"model.layers.0.norm.weight", "F32", {7}, make_bytes(4, 7, "F32")},
      {"model.layers.0.o_proj.weight", "F32", {6, 8}, make_bytes(5, 48, "F32")},
      {"model.layers.0.q_proj.weight", "F32", {8, 6}, make_bytes(6, 48, "F32")},
      {"rotary.inv_freq", "F32", {3}, make_bytes(7, 3, "F32")},
      {"zz.unused", "I64", {2}, make_bytes(8, 4, "F32")},
  };
}

const std::vector<std::string> rules = {R"(^model\.(.*)=\1)", R"(^rotary\..*=)"};

/// The folder: tensors before "model.layers.0.n" in file 1, the others in file 2, an index.
template <class D>
void write_folder(const D& dir, const std::vector<tensor>& ts) {
  std::vector<tensor> a, b;
  std::string map;
  std::uint64_t total = 0;
  for (const auto& t : ts) {
    const bool first = t.name < "model.layers.0.n";
    (first ? a : b).push_back(t);
    map += std::string(map.empty() ? "" : ", ") + "\"" + t.name + "\": \"" +
           (first ? fixtures::file1 : fixtures::file2) + "\"";
    total += t.bytes.size();
  }
  fixtures::put(dir, fixtures::file1, fixtures::build_file(a));
  fixtures::put(dir, fixtures::file2, fixtures::build_file(b));
  fixtures::put(dir, "model.safetensors.index.json",
                "{\"metadata\": {\"total_size\": " + std::to_string(total) + "}, \"weight_map\": {" + map + "}}");
}

// ---------------------------------------------------------------------------------------
// the model side: how each rank holds each tensor, and the bytes it should end with

enum class cut { whole, rows, cols, flat };

std::pair<std::uint64_t, std::uint64_t> part(std::uint64_t n, int w, int r) {
  const std::uint64_t per = (n + w - 1) / w, b = std::min<std::uint64_t>(n, per * r);
  return {b, std::min<std::uint64_t>(n, b + per)};
}

std::optional<shard_spec> spec_of(cut c, const shape_t& s, int w, int r) {
  switch (c) {
    case cut::whole: return std::nullopt;
    case cut::rows: {
      auto [b, e] = part(s[0], w, r);
      return block_spec({e - b, s[1]}, {b, 0});
    }
    case cut::cols: {
      auto [b, e] = part(s[1], w, r);
      return block_spec({s[0], e - b}, {0, b});
    }
    case cut::flat: {
      std::uint64_t n = 1;
      for (auto d : s) n *= d;
      auto [b, e] = part(n, w, r);
      return flat_spec{{b, e}};
    }
  }
  return std::nullopt;
}

/// The elements of `full` (row-major, `item` bytes each) rank r holds, by plain loops.
std::string cut_bytes(const std::string& full, std::size_t item, cut c, const shape_t& s, int w, int r) {
  std::string out;
  auto el = [&](std::uint64_t i) { out += full.substr(i * item, item); };
  std::uint64_t n = 1;
  for (auto d : s) n *= d;
  if (c == cut::whole) return full;
  if (c == cut::flat) {
    auto [b, e] = part(n, w, r);
    for (std::uint64_t i = b; i < e; ++i) el(i);
  } else if (c == cut::rows) {
    auto [b, e] = part(s[0], w, r);
    for (std::uint64_t i = b; i < e; ++i)
      for (std::uint64_t j = 0; j < s[1]; ++j) el(i * s[1] + j);
  } else {
    auto [b, e] = part(s[1], w, r);
    for (std::uint64_t i = 0; i < s[0]; ++i)
      for (std::uint64_t j = b; j < e; ++j) el(i * s[1] + j);
  }
  return out;
}

/// BF16 bits -> F32 bits (exact), and F32 -> BF16 rounded to nearest even (finite values).
std::string bf16_to_f32(const std::string& in) {
  std::string out;
  for (std::size_t i = 0; i < in.size(); i += 2) {
    std::uint16_t h;
    std::memcpy(&h, in.data() + i, 2);
    const std::uint32_t f = std::uint32_t(h) << 16;
    out.append(reinterpret_cast<const char*>(&f), 4);
  }
  return out;
}
std::string f32_to_bf16(const std::string& in) {
  std::string out;
  for (std::size_t i = 0; i < in.size(); i += 4) {
    std::uint32_t f;
    std::memcpy(&f, in.data() + i, 4);
    const std::uint16_t h = static_cast<std::uint16_t>((f + 0x7FFF + ((f >> 16) & 1)) >> 16);
    out.append(reinterpret_cast<const char*>(&h), 2);
  }
  return out;
}

struct model_tensor {
  std::string key;       ///< model key
  std::string file_key;  ///< where its data comes from ("" : nowhere)
  dtype type;
  shape_t shape;
  cut how;
};

std::vector<model_tensor> model_tensors() {
  return {
      {"embed_tokens.weight", "model.embed_tokens.weight", dtype::F32, {10, 6}, cut::rows},
      {"lm_head.weight", "model.embed_tokens.weight", dtype::F32, {10, 6}, cut::rows},  // tied to embed_tokens
      {"layers.0.q_proj.base_layer.weight", "model.layers.0.q_proj.weight", dtype::F32, {8, 6}, cut::rows},
      {"layers.0.q_proj.lora_A.weight", "", dtype::F32, {2, 6}, cut::whole},
      {"layers.0.o_proj.weight", "model.layers.0.o_proj.weight", dtype::F32, {6, 8}, cut::cols},
      {"layers.0.norm.weight", "model.layers.0.norm.weight", dtype::F32, {7}, cut::flat},
      {"layers.0.mlp.bf16", "model.layers.0.mlp.bf16", dtype::F32, {5, 4}, cut::rows},  // BF16 file
      {"layers.0.mlp.f32", "model.layers.0.mlp.f32", dtype::BF16, {4, 5}, cut::cols},   // F32 file
  };
}

/// One rank's model: memory (filled with 0xA5) and views; lm_head shares embed_tokens' memory.
struct rank_model {
  std::vector<std::vector<std::byte>> memory;
  std::vector<flat_view> views;

  rank_model(int w, int r, const std::vector<model_tensor>& ms = model_tensors()) {
    memory.reserve(ms.size());
    for (const auto& m : ms) {
      flat_view v;
      v.key = m.key;
      v.type = m.type;
      v.full_shape = m.shape;
      v.spec = spec_of(m.how, m.shape, w, r);
      v.nbytes = v.local_numel() * item_size(m.type);
      if (m.key == "lm_head.weight") {
        v.data = views.front().data;  // tied
      } else {
        memory.emplace_back(v.nbytes, std::byte{0xA5});
        v.data = memory.back().data();
      }
      views.push_back(v);
    }
  }
};

/// What rank r of w should hold for model tensor m, from the folder's bytes.
std::string expected(const model_tensor& m, const std::vector<tensor>& ts, int w, int r) {
  for (const auto& t : ts)
    if (t.name == m.file_key) {
      const std::size_t item = t.dtype == "BF16" ? 2 : t.dtype == "I64" ? 8 : 4;
      std::string local = cut_bytes(t.bytes, item, m.how, m.shape, w, r);
      if (t.dtype == "BF16" && m.type == dtype::F32) return bf16_to_f32(local);
      if (t.dtype == "F32" && m.type == dtype::BF16) return f32_to_bf16(local);
      return local;
    }
  return {};
}

hf_import_options options(hf_import_mode mode) {
  hf_import_options o;
  o.rename = rename_rules(rules);
  o.lora_base_layer = true;
  o.mode = mode;
  o.chunk_bytes = 24;  // several chunks per tensor, cut mid-row
  return o;
}

}  // namespace

TEST_CASE("hf import: indexed folder into 1-4 thread ranks, row/column/flat shards, both modes, bit for bit") {
  memory_directory root;
  const auto ts = hf_tensors();
  write_folder(root.sub("hf"), ts);
  const auto ms = model_tensors();
  // automatic: threads are ranks on one host, so every rank reads its own shards
  for (auto mode : {hf_import_mode::every_rank_read, hf_import_mode::rank0_broadcast, hf_import_mode::automatic})
    for (int w = 1; w <= 4; ++w) {
      CAPTURE(to_string(mode));
      CAPTURE(w);
      std::vector<rank_model> models;
      std::vector<hf_import_stats> res(static_cast<std::size_t>(w));
      for (int r = 0; r < w; ++r) models.emplace_back(w, r);
      auto thrown = testing::run_ranks(w, [&](testing::thread_comm& c) {
        res[c.rank()] = import_hf(root.sub("hf"), std::span<const flat_view>(models[c.rank()].views), c, options(mode));
      });
      for (int r = 0; r < w; ++r) {
        REQUIRE_FALSE(thrown[r]);
        CHECK(res[r].mode == (mode == hf_import_mode::automatic ? hf_import_mode::every_rank_read : mode));
        CHECK(res[r].why == (mode == hf_import_mode::automatic ? "every rank runs on one host" : ""));
        const auto& k = res[r].keys;
        CHECK(k.loaded_views == 7);
        CHECK(k.tied_views == 1);
        CHECK(k.missing_keys == std::vector<std::string>{"layers.0.q_proj.lora_A.weight"});
        CHECK(k.unexpected_keys == std::vector<std::string>{"zz.unused"});
        CHECK(k.dropped_keys == std::vector<std::string>{"rotary.inv_freq"});
        CHECK(res[r].message.find("missing 1 (layers.0.q_proj.lora_A.weight)") != std::string::npos);
        std::uint64_t shard_bytes = 0;  // as stored in the file: what this rank needs to read
        for (std::size_t i = 0; i < ms.size(); ++i) {
          const flat_view& v = models[r].views[i];
          const std::string got(reinterpret_cast<const char*>(v.data), v.nbytes);
          if (ms[i].file_key.empty()) {
            CHECK(got == std::string(v.nbytes, '\xA5'));  // left alone
            continue;
          }
          CHECK_MESSAGE(got == expected(ms[i], ts, w, r), ms[i].key, " rank ", r);
          if (ms[i].key == "lm_head.weight") continue;
          for (const auto& t : ts)
            if (t.name == ms[i].file_key) shard_bytes += v.local_numel() * (t.dtype == "BF16" ? 2 : 4);
        }
        if (res[r].mode == hf_import_mode::every_rank_read) {
          CHECK(res[r].stats.bytes_needed == shard_bytes);
          CHECK(double(res[r].stats.bytes_read) <= 1.1 * double(shard_bytes));
          CHECK(res[r].bytes_broadcast == 0);
        } else {
          // rank 0 reads every tensor some rank needs once; the others read nothing
          const std::uint64_t all = 60 * 4 + 20 * 2 + 20 * 4 + 7 * 4 + 48 * 4 + 48 * 4;
          CHECK(res[r].stats.bytes_read == (r == 0 ? all : 0));
          CHECK(res[r].bytes_broadcast == all);
        }
      }
    }
}

TEST_CASE("hf import: tied weights, both in the file or only one of them") {
  const std::string e = make_bytes(11, 12, "F32"), h = make_bytes(12, 12, "F32");
  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    memory_directory dir;
    std::vector<tensor> ts;
    if (variant != 2) ts.push_back({"embed.weight", "F32", {4, 3}, e});
    if (variant != 1) ts.push_back({"lm_head.weight", "F32", {4, 3}, variant == 0 ? e : h});
    fixtures::put(dir, "model.safetensors", fixtures::build_file(ts));
    const std::string want = variant == 2 ? h : e;
    for (auto mode : {hf_import_mode::every_rank_read, hf_import_mode::rank0_broadcast})
      for (int w : {2, 3}) {  // with 3 ranks, rank 2's shards are empty (null data): still tied
        CAPTURE(w);
        std::vector<std::vector<std::byte>> mem(static_cast<std::size_t>(w));
        std::vector<hf_import_stats> res(static_cast<std::size_t>(w));
        auto thrown = testing::run_ranks(w, [&](testing::thread_comm& c) {
          auto spec = spec_of(cut::rows, {4, 3}, w, c.rank());
          mem[c.rank()].assign(spec->local_numel() * 4, std::byte{0});
          flat_view a{"embed.weight", dtype::F32, {4, 3}, spec, mem[c.rank()].data(), mem[c.rank()].size()};
          if (a.nbytes == 0) a.data = nullptr;
          flat_view b = a;
          b.key = "lm_head.weight";
          const flat_view vs[] = {a, b};
          hf_import_options o;
          o.strict = true;
          o.mode = mode;
          res[c.rank()] = import_hf(dir, std::span<const flat_view>(vs), c, o);
        });
        for (int r = 0; r < w; ++r) {
          REQUIRE_FALSE(thrown[r]);
          CHECK(res[r].keys.loaded_views == 2);
          CHECK(res[r].keys.tied_views == 1);
          CHECK(res[r].keys.missing_keys.empty());
          CHECK(res[r].keys.unexpected_keys.empty());  // both feed the pair: neither is unexpected
          CHECK(std::string(reinterpret_cast<const char*>(mem[r].data()), mem[r].size()) ==
                cut_bytes(want, 4, cut::rows, {4, 3}, w, r));
          if (mode == hf_import_mode::every_rank_read) CHECK(res[r].stats.bytes_read == mem[r].size());  // once
        }
      }
  }
}

TEST_CASE("hf import: strict mode, LoRA adapter exemption, and errors every rank agrees on") {
  memory_directory root;
  const auto ts = hf_tensors();
  write_folder(root.sub("hf"), ts);
  auto run = [&](int w, hf_import_options o, const std::function<void(int, rank_model&)>& spoil = {}) {
    std::vector<rank_model> models;
    for (int r = 0; r < w; ++r) {
      models.emplace_back(w, r);
      if (spoil) spoil(r, models.back());
    }
    return testing::run_ranks(w, [&](testing::thread_comm& c) {
      import_hf(root.sub("hf"), std::span<const flat_view>(models[c.rank()].views), c, o);
    });
  };
  auto same_error = [](const std::vector<std::exception_ptr>& thrown, errc code, const std::string& phrase) {
    std::string first;
    for (std::size_t r = 0; r < thrown.size(); ++r) {
      REQUIRE(thrown[r]);
      try {
        std::rethrow_exception(thrown[r]);
      } catch (const error& e) {
        CHECK_MESSAGE(e.code() == code, e.what());
        CHECK_MESSAGE(std::string(e.what()).find(phrase) != std::string::npos, e.what());
        if (r == 0) first = e.what();
        CHECK(first == e.what());
      }
    }
  };
  for (auto mode : {hf_import_mode::every_rank_read, hf_import_mode::rank0_broadcast}) {
    CAPTURE(to_string(mode));
    hf_import_options o = options(mode);
    o.strict = true;
    // only the LoRA adapter is missing: fine
    for (auto& t : run(3, o)) CHECK_FALSE(t);
    // without base-layer mapping q_proj's base layer is missing too: an error on every rank
    o.lora_base_layer = false;
    same_error(run(3, o), errc::not_found,
               "1 model tensor(s) fed by no tensor of the checkpoint (LoRA adapter weights excepted): "
               "layers.0.q_proj.base_layer.weight");
    o.lora_base_layer = true;
    // one rank's view has the wrong shape: every rank throws rank 1's error
    same_error(run(3, o,
                   [](int r, rank_model& m) {
                     if (r == 1) m.views[5].full_shape = {8};
                   }),
               errc::shape_mismatch, "rank 1: ");
    // a dtype that does not convert
    same_error(run(2, o,
                   [](int r, rank_model& m) {
                     if (r == 0) {
                       m.views[5].type = dtype::I32;
                     }
                   }),
               errc::dtype_mismatch,
               "tensor 'model.layers.0.norm.weight' (model tensor 'layers.0.norm.weight', by rename rule");
    // two file keys renamed to one name
    hf_import_options clash = o;
    clash.rename = rename_rules({R"(^zz\.unused=layers.0.norm.weight)", R"(^model\.(.*)=\1)"});
    same_error(run(2, clash), errc::invalid_argument, "both renamed to");
  }
  // a file the index names is gone: every rank (rank 0 alone, in rank0_broadcast) fails
  root.store()->objects.erase(std::string(root.sub("hf").name()) + "/" + fixtures::file2);
  for (auto mode : {hf_import_mode::every_rank_read, hf_import_mode::rank0_broadcast})
    same_error(run(2, options(mode)), errc::not_found, fixtures::file2);
}

TEST_CASE("hf import: key mapping alone") {
  std::vector<hf_tensor_info> table{
      {"a.weight", dtype::F32, {2}}, {"b.weight", dtype::F32, {2}}, {"c", dtype::F32, {2}}};
  float x[2], y[2];
  std::vector<flat_view> views{
      {"a.base_layer.weight", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(x), 8},
      {"b.weight", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(y), 8},
      {"a.lora_B.weight", dtype::F32, {2}, std::nullopt, nullptr, 0}};
  hf_key_options o;
  o.lora_base_layer = true;
  auto m = map_hf_keys(views, table, o, "dir");
  REQUIRE(m.loads.size() == 2);
  CHECK(m.loads[0].view == 0);
  CHECK(m.loads[0].tensor == 0);
  CHECK(m.loads[0].how == "LoRA base layer");
  CHECK(m.unexpected_keys == std::vector<std::string>{"c"});
  CHECK(m.missing_keys == std::vector<std::string>{"a.lora_B.weight"});
  o.lora_base_layer = false;
  o.strict = true;
  testing::expect_error([&] { map_hf_keys(views, table, o, "dir"); }, errc::not_found,
                        {"dir: strict import: 1 model tensor(s)", "excepted): a.base_layer.weight"});
  // rules rename file keys to model keys, first match wins
  o.strict = false;
  o.rename = rename_rules({"^c$=x", "^a\\.(.*)=a.base_layer.\\1", "^a=never"});
  m = map_hf_keys(views, table, o, "dir");
  REQUIRE(m.loads.size() == 2);
  CHECK(m.loads[0].how == "rename rule '^a\\.(.*)=a.base_layer.\\1'");
  CHECK(m.unexpected_keys == std::vector<std::string>{"c"});
  CHECK(count_with_examples({"a", "b", "c"}, 2) == "3 (a, b, ...)");
}

TEST_CASE("hf import: a folder on files, read through the file backend") {
  testing::temp_dir tmp("hf-import");
  const auto ts = hf_tensors();
  write_folder(file_directory(tmp.path), ts);
  std::vector<rank_model> models;
  for (int r = 0; r < 2; ++r) models.emplace_back(2, r);
  std::vector<hf_import_stats> res(2);
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& c) {
    res[c.rank()] = import_hf(file_directory(tmp.path), std::span<const flat_view>(models[c.rank()].views), c,
                              options(hf_import_mode::every_rank_read));
  });
  const auto ms = model_tensors();
  for (int r = 0; r < 2; ++r) {
    REQUIRE_FALSE(thrown[r]);
    for (std::size_t i = 0; i < ms.size(); ++i)
      if (!ms[i].file_key.empty())
        CHECK(std::string(reinterpret_cast<const char*>(models[r].views[i].data), models[r].views[i].nbytes) ==
              expected(ms[i], ts, 2, r));
  }
}

// ---------------------------------------------------------------------------------------
// the torch.save layout: pytorch_model.bin written by torch

namespace {

namespace fs = std::filesystem;

/// tests/torch_save_fixture.py's output, written once per run of the test executable.
const fs::path& torch_save_fixture() {
  static testing::temp_dir dir("torch-save");
  static const bool made = [] {
    const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "torch_save_fixture.py";
    const auto r = testing::peer(testing::torch_python, {script.string(), dir.str()});
    REQUIRE_MESSAGE(r.code == 0, r.err);  // torch read each file back (the script checks)
    return true;
  }();
  (void)made;
  return dir.path;
}

struct torch_tensor_bytes {
  std::string dtype;
  shape_t shape;
  std::string bytes;  ///< row-major, as torch gave them
  std::string sha256;
};

/// What torch wrote into folder `name` of the fixture, by flattened name.
std::map<std::string, torch_tensor_bytes> torch_expected(const std::string& name) {
  const std::string json = testing::slurp(torch_save_fixture() / "expected.json");
  const std::string blob = testing::slurp(torch_save_fixture() / "expected.bin");
  simdjson::dom::parser parser;
  const simdjson::dom::element root = parser.parse(json);
  std::map<std::string, torch_tensor_bytes> out;
  const simdjson::dom::object folder = root[name].get_object();
  for (auto [key, v] : folder) {
    torch_tensor_bytes t;
    t.dtype = std::string(std::string_view(v["dtype"]));
    const simdjson::dom::array shape = v["shape"].get_array();
    for (auto d : shape) t.shape.push_back(std::uint64_t(d));
    t.bytes = blob.substr(std::uint64_t(v["offset"]), std::uint64_t(v["len"]));
    t.sha256 = std::string(std::string_view(v["sha256"]));
    out.emplace(std::string(key), std::move(t));
  }
  return out;
}

/// The fixture's folder of the same tensors in the zip format ("single" for "single_legacy").
std::string zip_twin(const std::string& folder) { return folder.substr(0, folder.find("_legacy")); }

}  // namespace

TEST_CASE("torch.save folders: every tensor of pytorch_model.bin bit for bit as torch gives it, both formats" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), testing::torch_python << " has no torch");
  for (const std::string folder :
       {"single", "sharded", "nested", "single_legacy", "sharded_legacy", "nested_legacy", "single_legacy4"}) {
    CAPTURE(folder);
    const auto want = torch_expected(zip_twin(folder));
    checkpoint_reader<file_directory> r(file_directory(torch_save_fixture() / folder));
    CHECK(r.layout() == hf_layout::info);
    CHECK(r.described_by() == (folder.starts_with("sharded") ? "pytorch_model.bin.index.json" : "pytorch_model.bin"));
    REQUIRE(r.metadata().tensors.size() == want.size());
    std::uint64_t bytes = 0;
    for (const auto& [key, tm] : r.metadata().tensors) {
      CAPTURE(key);
      const auto it = want.find(key);
      REQUIRE(it != want.end());
      CHECK(std::string(to_string(tm.type)) == it->second.dtype);
      CHECK(tm.shape == it->second.shape);
      std::string got(it->second.bytes.size(), '\xee');
      const flat_view v{key, tm.type, tm.shape, std::nullopt, reinterpret_cast<std::byte*>(got.data()), got.size()};
      load(r, std::span<const flat_view>(&v, 1));
      CHECK(got == it->second.bytes);
      bytes += got.size();
    }
    const checkpoint_report rep = verify_checkpoint(r);
    CHECK(rep.tensors == want.size());
    CHECK(rep.tensor_bytes == bytes);
  }
}

TEST_CASE("torch.save folders: imported into 2 and 3 ranks, row, column and flat shards, both modes" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), testing::torch_python << " has no torch");
  const auto want = torch_expected("single");
  for (const std::string folder : {"single", "single_legacy"})
    for (auto mode : {hf_import_mode::every_rank_read, hf_import_mode::rank0_broadcast})
      for (int w : {2, 3}) {
        CAPTURE(folder);
        CAPTURE(w);
        const file_directory dir(torch_save_fixture() / folder);
        std::vector<std::vector<std::string>> mem(static_cast<std::size_t>(w));
        std::vector<std::vector<cut>> cuts(static_cast<std::size_t>(w));
        std::vector<hf_import_stats> res(static_cast<std::size_t>(w));
        auto thrown = testing::run_ranks(w, [&](testing::thread_comm& c) {
          std::vector<flat_view> views;
          auto& m = mem[c.rank()];
          m.reserve(want.size());
          std::size_t i = 0;
          for (const auto& [key, t] : want) {
            const cut how = t.shape.size() == 2 ? (i++ % 2 ? cut::cols : cut::rows) : cut::flat;
            cuts[c.rank()].push_back(how);
            const auto spec = t.shape.empty() ? std::nullopt : spec_of(how, t.shape, w, c.rank());
            const std::uint64_t n = spec ? spec->local_numel() : 1;
            const dtype type = *parse_dtype(t.dtype);
            m.emplace_back(n * item_size(type), '\0');
            views.push_back({key, type, t.shape, spec,
                             m.back().empty() ? nullptr : reinterpret_cast<std::byte*>(m.back().data()),
                             m.back().size()});
          }
          hf_import_options o;
          o.strict = true;
          o.mode = mode;
          res[c.rank()] = import_hf(dir, std::span<const flat_view>(views), c, o);
        });
        for (int r = 0; r < w; ++r) {
          REQUIRE_FALSE(thrown[r]);
          CHECK(res[r].keys.missing_keys.empty());
          std::size_t i = 0;
          for (const auto& [key, t] : want) {
            CAPTURE(key);
            const std::size_t item = item_size(*parse_dtype(t.dtype));
            CHECK(mem[r][i] == (t.shape.empty() ? t.bytes : cut_bytes(t.bytes, item, cuts[r][i], t.shape, w, r)));
            ++i;
          }
        }
      }
}

TEST_CASE("torch.save folders: the tool's inspect, digest and to-hf read them as torch wrote them" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), testing::torch_python << " has no torch");
  if (!testing::have_tool()) return;
  testing::temp_dir out("torch-save-out");
  // the folders, and the single file given as a path of its own
  for (const std::string folder :
       {"single", "sharded", "single/pytorch_model.bin", "sharded_legacy", "single_legacy/pytorch_model.bin"}) {
    CAPTURE(folder);
    const auto want = torch_expected(zip_twin(folder.substr(0, folder.find('/'))));
    const std::string in = (torch_save_fixture() / folder).string();
    const auto ins = testing::run_tool({"inspect", in});
    CHECK_MESSAGE(ins.code == 0, ins.err);
    CHECK(ins.out.find(folder.ends_with(".bin") ? ": torch.save file, 18 tensors" : "torch.save files") !=
          std::string::npos);
    std::string digest;
    for (const auto& [key, t] : want) digest += key + " " + t.dtype + " " + to_string(t.shape) + " " + t.sha256 + "\n";
    const auto d = testing::run_tool({"digest", in});
    CHECK_MESSAGE(d.code == 0, d.err);
    CHECK(d.out == digest);
    const fs::path hf = out.path / (folder.substr(0, folder.find('/')) + (folder.ends_with(".bin") ? "_file" : ""));
    const auto x = testing::run_tool({"to-hf", in, hf.string()});
    REQUIRE_MESSAGE(x.code == 0, x.err);
    const file_storage st(hf / "model.safetensors");
    const safetensors_header h = read_safetensors_header(st);
    REQUIRE(h.tensors.size() == want.size());
    for (const auto& e : h.tensors) {
      CAPTURE(e.name);
      const auto it = want.find(e.name);
      REQUIRE(it != want.end());
      std::string got(e.nbytes(), '\0');
      st.read_into(h.offset_of(e), std::as_writable_bytes(std::span<char>(got.data(), got.size())));
      CHECK(got == it->second.bytes);
    }
  }
}

TEST_CASE(
    "torch.save training checkpoint: tensors bit for bit, values as Python pickles them, paths as DCP flattens them; "
    "the tool lists the values and to-hf says it leaves them out, both formats" *
    testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), testing::torch_python << " has no torch");
  const auto want = torch_expected("train");
  // the values: name -> (path, Python's pickle of the value, its repr())
  struct value {
    pickle_value path, value;
    std::string repr;
  };
  std::map<std::string, value> values;
  auto path_of = [](simdjson::dom::array a) {
    std::vector<pickle_value> parts;
    for (auto p : a)
      parts.push_back(p.is_string() ? pickle_value::string(std::string(std::string_view(p)))
                                    : pickle_value::integer(std::int64_t(p)));
    return pickle_value::tuple(std::move(parts));
  };
  simdjson::dom::parser parser;
  const std::string vjson = testing::slurp(torch_save_fixture() / "expected_values.json");
  for (auto [key, v] : simdjson::dom::object(parser.parse(vjson))) {
    const std::string_view hex(v["pickle"]);
    std::string bytes;
    for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
      bytes += char(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16));
    values.emplace(std::string(key), value{path_of(v["path"].get_array()), pickle_loads(bytes, "Python's pickle"),
                                           std::string(std::string_view(v["repr"]))});
  }
  std::map<std::string, pickle_value> tensor_paths;
  const std::string tjson = testing::slurp(torch_save_fixture() / "expected.json");
  for (auto [key, v] : simdjson::dom::object(parser.parse(tjson)["train"]))
    tensor_paths.emplace(std::string(key), path_of(v["path"].get_array()));
  REQUIRE(values.size() >= 20);
  REQUIRE(values.count("optimizer_state_dict.param_groups.0.betas") == 1);  // a tuple: one value
  REQUIRE(want.count("optimizer_state_dict.state.0.exp_avg") == 1);
  for (const std::string folder : {"train", "train_legacy"}) {
    CAPTURE(folder);
    const file_directory dir(torch_save_fixture() / folder);
    checkpoint_reader<file_directory> r(dir, single_file_source(dir, "train.pt"));
    CHECK(r.metadata().tensors.size() == want.size());
    // a path is kept where it is not (name,): a nested dict's, a list index's
    auto check_path = [&](const std::string& key, const pickle_value& path) {
      const pickle_value* got = r.path_in_state_dict(key);
      if (path == pickle_value::tuple({pickle_value::string(key)}))
        CHECK(got == nullptr);
      else
        CHECK((got && *got == path));
    };
    for (const auto& [key, t] : want) {
      CAPTURE(key);
      const tensor_metadata* tm = r.find(key);
      REQUIRE(tm);
      CHECK(std::string(to_string(tm->type)) == t.dtype);
      CHECK(tm->shape == t.shape);
      std::string got(t.bytes.size(), '\0');
      unshard_tensor(r, key, std::as_writable_bytes(std::span<char>(got.data(), got.size())));
      CHECK(got == t.bytes);
      check_path(key, tensor_paths.at(key));
    }
    CHECK(r.non_tensors().size() == values.size());
    for (const auto& [key, v] : values) {
      CAPTURE(key);
      CHECK(r.read_object(key) == v.value);
      const std::string a = r.read_object_archive(key);  // as to-dcp writes it: decoded as a DCP item's
      CHECK(read_dcp_object(memory_storage(byte_buffer(reinterpret_cast<const std::byte*>(a.data()),
                                                       reinterpret_cast<const std::byte*>(a.data()) + a.size())),
                            dcp_storage_info{"<memory>", 0, a.size()}, key) == v.value);
      check_path(key, v.path);
    }
    if (!testing::have_tool()) continue;
    const std::string pt = (torch_save_fixture() / folder / "train.pt").string();
    const auto ins = testing::run_tool({"inspect", pt});
    REQUIRE_MESSAGE(ins.code == 0, ins.err);
    CHECK(ins.out.find(std::to_string(want.size()) + " tensors") != std::string::npos);
    // each value's row: its name first, Python's repr() last
    std::map<std::string, std::string> rows;
    for (std::size_t at = 0, nl; (nl = ins.out.find('\n', at)) != std::string::npos; at = nl + 1) {
      const std::string line = ins.out.substr(at, nl - at);
      rows.emplace(line.substr(0, line.find(' ')), line);
    }
    for (const auto& [key, v] : values) {
      CAPTURE(key);
      REQUIRE(rows.count(key) == 1);
      if (v.repr.size() <= 60) CHECK(rows.at(key).ends_with("  pickle  value: " + v.repr));
    }
    testing::temp_dir out("torch-save-train");
    const auto x = testing::run_tool({"to-hf", pt, (out.path / "hf").string()});
    REQUIRE_MESSAGE(x.code == 0, x.err);
    CHECK(x.out.find(std::to_string(want.size()) + " tensors") != std::string::npos);
    CHECK(x.out.find(std::to_string(values.size()) + " non-tensor item(s) left out") != std::string::npos);
  }
  {
    // [usage: torch_save_train]
    // torch.save({"model_state_dict": ..., "optimizer_state_dict": ..., "epoch": 3, ...}), read in place
    const file_directory folder(torch_save_fixture() / "train");
    checkpoint_reader<file_directory> ckpt(folder, single_file_source(folder, "train.pt"));
    std::vector<float> w(8 * 4);
    unshard_tensor(ckpt, "model_state_dict.0.weight", std::as_writable_bytes(std::span(w)));
    const std::int64_t epoch = ckpt.read_object("epoch").as_int("epoch");
    const double lr = ckpt.read_object("optimizer_state_dict.param_groups.0.lr").as_real("lr");
    // [/usage]
    CHECK(std::string(reinterpret_cast<const char*>(w.data()), w.size() * 4) ==
          want.at("model_state_dict.0.weight").bytes);
    CHECK(epoch == values.at("epoch").value.as_int(""));
    CHECK(lr == values.at("optimizer_state_dict.param_groups.0.lr").value.as_real(""));
  }
}

TEST_CASE("torch.save folders: what is not read is refused, naming file, tensor and rule" * testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), testing::torch_python << " has no torch");
  const fs::path& fx = torch_save_fixture();
  auto open = [](const fs::path& p) { return checkpoint_reader<file_directory>(file_directory(p)); };
  testing::expect_error([&] { open(fx / "others"); }, errc::invalid_metadata,
                        {"pytorch_model.bin", "'epoch'", "not a tensor"});
  testing::expect_error([&] { open(fx / "gappy"); }, errc::invalid_metadata,
                        {"pytorch_model.bin", "tensor 'g'", "not dense"});
  // the legacy format: a storage's size in the file other than its pickle's, a file cut short
  // (torch refuses both: the fixture checks)
  testing::expect_error(
      [&] { open(fx / "legacy_size"); }, errc::invalid_metadata,
      {"pytorch_model.bin", "storage '", "the file says", "elements at byte", "but its persistent id says"});
  testing::expect_error([&] { open(fx / "legacy_short"); }, errc::invalid_metadata,
                        {"pytorch_model.bin", "storage '", "past the file's end"});
  // a persistent id that no tensor holds names a tensor's F16 storage as F32 first: torch gives
  // the tensor as F32 (the fixture checks), so it is refused, in both formats
  for (const std::string f : {"popped", "popped_legacy"})
    testing::expect_error([&] { open(fx / f); }, errc::invalid_metadata,
                          {"pytorch_model.bin", "BINPERSID at byte", "as 4 of torch.HalfStorage",
                           "of torch.FloatStorage", "torch would view"});
  // the single file with one global renamed (the same length: the zip's sizes still agree), and cut short
  testing::temp_dir tmp("torch-save-bad");
  std::string bytes = testing::slurp(fx / "single" / "pytorch_model.bin");
  const auto at = bytes.find("OrderedDict\n");
  REQUIRE(at != std::string::npos);
  std::string evil = bytes;
  evil.replace(at, 12, "OrderedDixx\n");
  fs::create_directories(tmp.path / "evil");
  testing::write_file(tmp.path / "evil" / "pytorch_model.bin", evil);
  testing::expect_error([&] { open(tmp.path / "evil"); }, errc::invalid_metadata,
                        {"data.pkl", "'collections.OrderedDixx'", "allowlist"});
  std::string legacy = testing::slurp(fx / "single_legacy" / "pytorch_model.bin");
  const auto lat = legacy.find("OrderedDict\n");
  REQUIRE(lat != std::string::npos);
  legacy.replace(lat, 12, "OrderedDixx\n");
  fs::create_directories(tmp.path / "evil_legacy");
  testing::write_file(tmp.path / "evil_legacy" / "pytorch_model.bin", legacy);
  testing::expect_error([&] { open(tmp.path / "evil_legacy"); }, errc::invalid_metadata,
                        {"pytorch_model.bin: state dict: pickle", "'collections.OrderedDixx'", "allowlist"});
  // verify: a .bin of the index's set that the index does not name; another pickle beside the
  // weights (transformers' training_args.bin) is not the folder's and is left alone
  fs::copy(fx / "sharded", tmp.path / "sharded");
  fs::copy_file(fx / "others" / "pytorch_model.bin", tmp.path / "sharded" / "training_args.bin");
  {
    checkpoint_reader<file_directory> beside{file_directory(tmp.path / "sharded")};
    CHECK(verify_checkpoint(beside).tensors == 7);
  }
  fs::copy_file(fx / "sharded" / "pytorch_model-00001-of-00002.bin",
                tmp.path / "sharded" / "pytorch_model-00003-of-00002.bin");
  checkpoint_reader<file_directory> extra{file_directory(tmp.path / "sharded")};
  testing::expect_error([&] { verify_checkpoint(extra); }, errc::invalid_metadata,
                        {"pytorch_model-00003-of-00002.bin", "pytorch_model.bin.index.json", "does not name"});
  fs::create_directories(tmp.path / "short");
  testing::write_file(tmp.path / "short" / "pytorch_model.bin", bytes.substr(0, bytes.size() - 100));
  testing::expect_error([&] { open(tmp.path / "short"); }, errc::invalid_metadata,
                        {"pytorch_model.bin", "end-of-central-directory"});
}
