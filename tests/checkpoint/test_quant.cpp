// Quantized weights (issue 55, checkpoint/quant.hpp): the goldens of tests/fixtures/quant/ (written
// by tests/quant/make_quant_goldens.py from the formats' definitions, not from this code) loaded
// dequantized into F32 and BF16 views, whole and resharded in worlds of 2, 3 and 4 ranks, each
// rank's bytes its slice of the script's values; kept quantized, the weight's shard and its scale's
// shard together; and the silent-wrong cases refused.
#include <doctest/doctest.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <map>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/load.hpp"
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"
#include "support/trainer_goldens.hpp"

using namespace shardsafe;
using testing::expect_error;

namespace {

namespace fs = std::filesystem;
const fs::path quant_goldens = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "quant";
constexpr const char* quant_cases[] = {"fp8_block", "mxfp4", "mxfp8", "nvfp4", "fp8_channel"};

/// The bytes of tensor w a shard holds, in the shard's local order (the spec's runs).
std::string slice_of(const testing::golden_tensor& w, const shard_spec& spec) {
  const std::size_t isz = item_size(w.type);
  std::string out(static_cast<std::size_t>(spec.local_numel()) * isz, '\0');
  for (auto c = spec.cursor(w.shape); !c.done(); c.next()) {
    const spec_run r = c.run();
    std::memcpy(out.data() + r.local * isz, w.bytes.data() + r.begin * isz, (r.end - r.begin) * isz);
  }
  return out;
}

/// A shard of rank r of n: blocks of the second-last dimension's rows ("rows"), of the last
/// dimension ("cols": cut one past the middle, so packed bytes and blocks are cut), or flat ranges.
shard_spec shard_for(const shape_t& shape, const std::string& how, std::uint64_t r, std::uint64_t n) {
  const std::size_t k = shape.size();
  if (how == "flat") {
    const std::uint64_t all = numel(shape), per = (all + n - 1) / n;
    return flat_spec{{std::min(all, r * per), std::min(all, (r + 1) * per)}};
  }
  const std::size_t d = how == "rows" ? k - 2 : k - 1;
  const std::uint64_t len = shape[d];
  std::uint64_t a, e;
  if (how == "rows") {
    const std::uint64_t per = (len + n - 1) / n;
    a = std::min(len, r * per);
    e = std::min(len, (r + 1) * per);
  } else {  // two ranks: [0, len/2 + 1), [len/2 + 1, len)
    a = r == 0 ? 0 : len / 2 + 1;
    e = r == 0 ? len / 2 + 1 : len;
  }
  shape_t local = shape, off(k, 0);
  local[d] = e - a;
  off[d] = a;
  return block_spec(local, off);
}

/// Writes a safetensors file of tensors (name -> golden_tensor), the header by hand.
void write_safetensors(const fs::path& p, const std::map<std::string, testing::golden_tensor>& ts) {
  std::string header = "{", data;
  for (const auto& [name, t] : ts) {
    std::string shape;
    for (auto d : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    header += (header.size() > 1 ? "," : "") + std::string("\"") + name + "\":{\"dtype\":\"" +
              std::string(to_string(t.type)) + "\",\"shape\":[" + shape + "],\"data_offsets\":[" +
              std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) + "]}";
    data += t.bytes;
  }
  header += "}";
  while (header.size() % 8) header += ' ';
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  testing::write_file(p, out + header + data);
}

/// A copy of golden `name`'s folder under dir with model.safetensors edited by f.
template <class F>
fs::path edited_copy(const fs::path& dir, const char* name, F f) {
  const fs::path d = dir / name;
  fs::create_directories(d);
  fs::copy_file(quant_goldens / name / "config.json", d / "config.json");
  auto ts = testing::read_golden_tensors(quant_goldens / name / "model.safetensors");
  f(ts);
  write_safetensors(d / "model.safetensors", ts);
  return d;
}

load_options dequantizing() {
  load_options o;
  o.convert_dtypes = true;
  return o;
}

}  // namespace

TEST_CASE("quantized goldens: dequantized whole into F32 and BF16 equal the script's values, bit for bit") {
  std::size_t tensors = 0;
  for (const char* name : quant_cases) {
    CAPTURE(name);
    checkpoint_reader<file_directory> r{file_directory(quant_goldens / name)};
    for (const char* kind : {"f32", "bf16"}) {
      CAPTURE(kind);
      for (const auto& [key, w] :
           testing::read_golden_tensors(quant_goldens / name / "expected" / (std::string(kind) + ".safetensors"))) {
        CAPTURE(key);
        const auto q = find_quantized(r, key);
        REQUIRE(q.has_value());
        CHECK(q->shape == w.shape);
        std::string got(w.bytes.size(), '\x5a');
        flat_view v{key, w.type, w.shape, std::nullopt, reinterpret_cast<std::byte*>(got.data()), got.size()};
        load(r, std::span<const flat_view>(&v, 1), dequantizing());
        if (got != w.bytes) {
          std::size_t i = 0;
          while (got[i] == w.bytes[i]) ++i;
          const std::size_t isz = item_size(w.type), at = i / isz;
          MESSAGE("first difference at element " << at << ": got " << testing::hex(got.substr(at * isz, isz))
                                                 << ", want " << testing::hex(w.bytes.substr(at * isz, isz)));
        }
        CHECK(got == w.bytes);
        ++tensors;
      }
    }
  }
  CHECK(tensors == 2 * (3 + 2 + 1 + 2 + 5));
}

TEST_CASE("quantized goldens: dequantized in place by 3 ranks in row blocks, 2 in column blocks, 4 in flat ranges") {
  std::size_t compared = 0;
  for (const char* name : quant_cases)
    for (const char* kind : {"f32", "bf16"}) {
      const auto want =
          testing::read_golden_tensors(quant_goldens / name / "expected" / (std::string(kind) + ".safetensors"));
      for (const auto& [how, world] : {std::pair{"rows", 3}, std::pair{"cols", 2}, std::pair{"flat", 4}}) {
        const std::string what = std::string(name) + " " + kind + " " + how;
        CAPTURE(what);
        std::vector<std::map<std::string, std::pair<std::string, std::string>>> got(world);
        const auto thrown = run_ranks(world, [&](thread_comm& comm) {
          const auto rk = static_cast<std::uint64_t>(comm.rank());
          std::vector<flat_view> views;
          auto& mine = got[rk];
          for (const auto& [key, w] : want) {
            const shard_spec spec = shard_for(w.shape, how, rk, static_cast<std::uint64_t>(world));
            auto& [buf, expect] = mine[key];
            expect = slice_of(w, spec);
            buf.assign(expect.size(), '\x5a');
            views.push_back({key, w.type, w.shape, spec, reinterpret_cast<std::byte*>(buf.data()), buf.size()});
          }
          // a plain tensor in the same load: the quantized ones do not change how it loads
          load(file_directory(quant_goldens / name), std::span<const flat_view>(views), comm, dequantizing());
        });
        for (const auto& e : thrown) CHECK(testing::error_message_of(e) == "");
        for (const auto& rank : got)
          for (const auto& [key, pair] : rank) {
            CAPTURE(key);
            CHECK(pair.first == pair.second);
            ++compared;
          }
      }
    }
  CHECK(compared == 2 * (3 + 2 + 4) * (3 + 2 + 1 + 2 + 5));
}

TEST_CASE("quantized goldens: kept quantized, each rank's weight shard comes with its scale shard") {
  // two ranks cut on a block boundary: the stored bytes of the weight and of its scale, as the
  // stored tensors hold them
  std::size_t pairs = 0;
  for (const char* name : quant_cases) {
    CAPTURE(name);
    const auto stored = testing::read_golden_tensors(quant_goldens / name / "model.safetensors");
    checkpoint_reader<file_directory> r{file_directory(quant_goldens / name)};
    for (const auto& [key, w] : testing::read_golden_tensors(quant_goldens / name / "expected" / "f32.safetensors")) {
      CAPTURE(key);
      const quantized_tensor q = *find_quantized(r, key);
      const std::size_t k = q.shape.size();
      for (const bool flat : {false, true}) {
        for (std::uint64_t rk = 0; rk < 2; ++rk) {
          // rows: a block of rows at fp8_block's 128-row boundary (or half the rows); flat: the
          // same rows as one range
          // (a weight of fewer rows than a block: rank 1's shard is empty)
          const std::uint64_t rows = q.shape[k - 2], cut = q.block_rows > 1 ? std::min(rows, q.block_rows) : rows / 2;
          const std::uint64_t a = rk ? cut : 0, e = rk ? rows : cut, inner = q.shape[k - 1];
          shape_t local = q.shape, off(k, 0);
          local[k - 2] = e - a;
          off[k - 2] = a;
          const std::uint64_t lead = numel(q.shape) / (rows * inner);
          const shard_spec logical =
              flat && lead == 1 ? shard_spec(flat_spec{{a * inner, e * inner}}) : shard_spec(block_spec(local, off));
          const quantized_shard qs = quantized_shard_of(q, logical);
          const auto& sd = stored.at(q.data);
          const auto& ss = stored.at(q.scale);
          std::string data(slice_of(sd, qs.data).size(), '\0'), scale(slice_of(ss, qs.scale).size(), '\0');
          std::vector<flat_view> views{
              {q.data, sd.type, sd.shape, qs.data, reinterpret_cast<std::byte*>(data.data()), data.size()},
              {q.scale, ss.type, ss.shape, qs.scale, reinterpret_cast<std::byte*>(scale.data()), scale.size()}};
          load(r, std::span<const flat_view>(views));
          CHECK(data == slice_of(sd, qs.data));
          CHECK(scale == slice_of(ss, qs.scale));
          CHECK(data.empty() == (a == e));
          ++pairs;
        }
      }
    }
  }
  CHECK(pairs == 4 * (3 + 2 + 1 + 2 + 5));
}

TEST_CASE(
    "quantized weights: a shard that cuts a scale block or a packed byte is refused naming dimension and boundary") {
  checkpoint_reader<file_directory> fp8{file_directory(quant_goldens / "fp8_block")};
  const quantized_tensor q = *find_quantized(fp8, "model.layers.0.self_attn.o_proj.weight");
  CHECK(q.scheme == quant_scheme::fp8_block);
  CHECK(q.block_rows == 128);
  expect_error([&] { quantized_shard_of(q, block_spec({68, 160}, {0, 0})); }, errc::invalid_spec,
               {"o_proj.weight", "boundary at 68 of dimension 0", "multiples of 128"});
  expect_error([&] { quantized_shard_of(q, flat_spec{{0, 160 * 64}}); }, errc::invalid_spec,
               {"boundary at 64 of dimension 0", "whole blocks of rows"});
  checkpoint_reader<file_directory> nv{file_directory(quant_goldens / "nvfp4")};
  const quantized_tensor n = *find_quantized(nv, "model.layers.0.mlp.gate_proj.weight");
  expect_error([&] { quantized_shard_of(n, block_spec({64, 49}, {0, 0})); }, errc::invalid_spec,
               {"gate_proj.weight", "boundary at 49 of dimension 1", "multiples of 16"});
  expect_error([&] { quantized_shard_of(n, flat_spec{{0, 24}}); }, errc::invalid_spec,
               {"boundary at 24 of dimension 1", "nvfp4"});
}

TEST_CASE("FP8 per channel and per tensor: each scale form found, a misshapen scale and a cut row refused") {
  checkpoint_reader<file_directory> r{file_directory(quant_goldens / "fp8_channel")};
  struct want {
    const char* name;
    quant_scheme scheme;
    dtype scale_type;
    shape_t scale_shape;
    std::uint64_t block_rows, block_cols;
  };
  for (const want& w :
       {want{"model.layers.0.self_attn.q_proj.weight", quant_scheme::fp8_channel, dtype::BF16, {48, 1}, 1, 64},
        want{"model.layers.0.self_attn.k_proj.weight", quant_scheme::fp8_tensor, dtype::BF16, {1}, 16, 64},
        want{"model.layers.0.mlp.up_proj.weight", quant_scheme::fp8_channel, dtype::F32, {40, 1}, 1, 96},
        want{"model.layers.0.mlp.down_proj.weight", quant_scheme::fp8_tensor, dtype::F32, {}, 64, 40},
        want{"model.layers.0.mlp.gate_proj.weight", quant_scheme::fp8_channel, dtype::F32, {40}, 1, 64}}) {
    CAPTURE(w.name);
    const auto q = find_quantized(r, w.name);
    REQUIRE(q.has_value());
    CHECK(q->scheme == w.scheme);
    CHECK(q->scale_type == w.scale_type);
    CHECK(q->scale_shape == w.scale_shape);
    CHECK(q->block_rows == w.block_rows);
    CHECK(q->block_cols == w.block_cols);
  }
  // the activation scale and the BF16 head are plain tensors
  CHECK_FALSE(find_quantized(r, "model.layers.0.self_attn.q_proj.input_scale").has_value());
  CHECK_FALSE(find_quantized(r, "lm_head.weight").has_value());
  CHECK(quantized_tensors(r).size() == 5);
  // kept quantized: rows [8, 24) of a per-row weight take scales [8, 24) (as stored, [M] or
  // [M, 1]); a per-tensor weight takes its one scale; a cut inside a row is refused
  const quantized_tensor gate = *find_quantized(r, "model.layers.0.mlp.gate_proj.weight");
  CHECK(quantized_shard_of(gate, block_spec({16, 64}, {8, 0})).scale == shard_spec(flat_spec{{8, 24}}));
  const quantized_tensor up = *find_quantized(r, "model.layers.0.mlp.up_proj.weight");
  CHECK(quantized_shard_of(up, flat_spec{{8 * 96, 24 * 96}}).scale == shard_spec(flat_spec{{8, 24}}));
  CHECK(quantized_shard_of(up, block_spec({16, 96}, {8, 0})).scale == shard_spec(block_spec({16, 1}, {8, 0})));
  expect_error([&] { quantized_shard_of(up, block_spec({40, 48}, {0, 0})); }, errc::invalid_spec,
               {"up_proj.weight", "boundary at 48 of dimension 1", "fp8_channel"});
  const quantized_tensor down = *find_quantized(r, "model.layers.0.mlp.down_proj.weight");
  CHECK(quantized_shard_of(down, block_spec({64, 40}, {0, 0})).scale == shard_spec(flat_spec{{0, 1}}));
  expect_error([&] { quantized_shard_of(down, block_spec({32, 40}, {0, 0})); }, errc::invalid_spec,
               {"down_proj.weight", "boundary at 32 of dimension 0", "fp8_tensor"});
  // a per-row scale of the wrong length, a scale of F64, a 3-D weight: refused naming the rule
  testing::temp_dir tmp;
  const std::string q_proj = "model.layers.0.self_attn.q_proj.weight";
  const fs::path d1 = edited_copy(tmp.path / "len", "fp8_channel", [&](auto& ts) {
    auto& s = ts.at("model.layers.0.self_attn.q_proj.weight_scale");
    s.shape = {24, 1};
    s.bytes.resize(48);
  });
  checkpoint_reader<file_directory> r1{file_directory(d1)};
  expect_error([&] { quantized_tensors(r1); }, errc::invalid_metadata,
               {q_proj, "is [24,1], not [48,1] or [48]", "per channel", "per tensor"});
  const fs::path d2 = edited_copy(tmp.path / "f64", "fp8_channel", [&](auto& ts) {
    auto& s = ts.at("model.layers.0.mlp.down_proj.weight_scale");
    s.type = dtype::F64;
    s.bytes.resize(8);
  });
  checkpoint_reader<file_directory> r2{file_directory(d2)};
  expect_error([&] { quantized_tensors(r2); }, errc::invalid_metadata, {"down_proj.weight_scale", "is F64, not"});
  const fs::path d3 = edited_copy(tmp.path / "3d", "fp8_channel", [&](auto& ts) { ts.at(q_proj).shape = {4, 12, 64}; });
  checkpoint_reader<file_directory> r3{file_directory(d3)};
  expect_error([&] { quantized_tensors(r3); }, errc::invalid_metadata,
               {q_proj, "[4,12,64]", "per channel or per tensor are read for 2-D weights"});
}

TEST_CASE(
    "quantized weights: a missing or lying scale, a NaN scale, and a float view without convert_dtypes are refused") {
  testing::temp_dir tmp;
  const std::string o_proj = "model.layers.0.self_attn.o_proj.weight";
  // the FP8 scale missing beside a quantization_config: the values would be off by the scale
  {
    const fs::path d = edited_copy(tmp.path, "fp8_block", [&](auto& ts) { ts.erase(o_proj + "_scale_inv"); });
    checkpoint_reader<file_directory> r{file_directory(d)};
    std::vector<float> buf(136 * 160);
    flat_view v{o_proj, dtype::F32, {136, 160}, std::nullopt, reinterpret_cast<std::byte*>(buf.data()), buf.size() * 4};
    expect_error([&] { load(r, std::span<const flat_view>(&v, 1), dequantizing()); }, errc::invalid_metadata,
                 {o_proj, "its scale is missing", "quantization_config"});
  }
  // a scale of the wrong shape for its block size
  {
    const fs::path d = edited_copy(tmp.path / "shape", "fp8_block", [&](auto& ts) {
      auto& s = ts.at(o_proj + "_scale_inv");
      s.shape = {1, 6};  // 6 values where [2, 2] blocks of 128 x 128 need 4
      s.bytes += std::string(8, '\0');
    });
    checkpoint_reader<file_directory> r{file_directory(d)};
    expect_error([&] { find_quantized(r, o_proj); }, errc::invalid_metadata,
                 {o_proj + "_scale_inv", "[1,6]", "not [2,2]", "128 x 128 block"});
  }
  // MXFP4 scales of the wrong dtype
  {
    const std::string gu = "model.layers.0.mlp.experts.gate_up_proj";
    const fs::path d = edited_copy(tmp.path, "mxfp4", [&](auto& ts) { ts.at(gu + "_scales").type = dtype::I8; });
    checkpoint_reader<file_directory> r{file_directory(d)};
    expect_error([&] { find_quantized(r, gu); }, errc::invalid_metadata,
                 {gu + "_scales", "is I8", "not U8 or F8_E8M0"});
  }
  // an E8M0 scale of 0xFF (NaN) at flat index 5: the load names it
  {
    const std::string up = "model.layers.0.mlp.up_proj.weight";
    const fs::path d = edited_copy(
        tmp.path, "mxfp8", [&](auto& ts) { ts.at("model.layers.0.mlp.up_proj.weight_scale").bytes[5] = '\xff'; });
    checkpoint_reader<file_directory> r{file_directory(d)};
    std::vector<float> buf(64 * 96);
    flat_view v{up, dtype::F32, {64, 96}, std::nullopt, reinterpret_cast<std::byte*>(buf.data()), buf.size() * 4};
    expect_error([&] { load(r, std::span<const flat_view>(&v, 1), dequantizing()); }, errc::invalid_metadata,
                 {up, "weight_scale", "flat index 5", "NaN or infinite"});
    // rows 0 (scales 0..2) alone: index 5 is not read, the load goes through
    flat_view row0{
        up,    dtype::F32, {64, 96}, shard_spec(block_spec({1, 96}, {0, 0})), reinterpret_cast<std::byte*>(buf.data()),
        96 * 4};
    load(r, std::span<const flat_view>(&row0, 1), dequantizing());
  }
  // a floating view of a quantized weight without convert_dtypes: refused, saying how
  {
    checkpoint_reader<file_directory> r{file_directory(quant_goldens / "nvfp4")};
    std::vector<float> buf(64 * 96);
    flat_view v{"model.layers.0.mlp.gate_proj.weight",    dtype::F32,    {64, 96}, std::nullopt,
                reinterpret_cast<std::byte*>(buf.data()), buf.size() * 4};
    expect_error([&] { load(r, std::span<const flat_view>(&v, 1)); }, errc::dtype_mismatch,
                 {"gate_proj.weight", "nvfp4", "weight_scale", "convert_dtypes"});
  }
}

TEST_CASE("usage: a quantized weight loaded dequantized, and kept quantized with its scale") {
  const fs::path dir = quant_goldens / "fp8_block";
  // [usage: dequant_load]
  // rows 0..63 of an FP8 weight with 128 x 128 block scales, as BF16: its values, rounded once
  const std::string w = "model.layers.0.self_attn.o_proj.weight";
  std::vector<std::uint16_t> rows(64 * 160);
  const flat_view part{w,
                       dtype::BF16,
                       {136, 160},
                       block_spec({64, 160}, {0, 0}),
                       reinterpret_cast<std::byte*>(rows.data()),
                       rows.size() * 2};
  checkpoint_reader<file_directory> reader(file_directory{dir});
  load_options opt;
  opt.convert_dtypes = true;  // a quantized weight into a BF16 view: dequantized
  load(reader, std::span<const flat_view>(&part, 1), opt);

  // kept quantized: the weight's rows 128..135 and the scale row that goes with them
  const quantized_tensor q = *find_quantized(reader, w);
  const quantized_shard mine = quantized_shard_of(q, block_spec({8, 160}, {128, 0}));
  // mine.data: block [8,160] at [128,0] of the F8_E4M3 weight; mine.scale: [1,2] at [1,0]
  // [/usage]
  const auto want = testing::read_golden_tensors(dir / "expected" / "bf16.safetensors").at(part.key);
  CHECK(std::memcmp(rows.data(), want.bytes.data(), rows.size() * 2) == 0);
  CHECK(mine.data == shard_spec(block_spec({8, 160}, {128, 0})));
  CHECK(mine.scale == shard_spec(block_spec({1, 2}, {1, 0})));
}

TEST_CASE("quantized weights: the BF16 store's fast path rounds as the generic conversion does, edges included") {
  // doubles of every exponent BF16 meets (subnormals, the largest finite, past it), ties and
  // carries into the exponent, against detail::encode_float_bits (core/convert.hpp, the
  // conversion the F32 -> BF16 tests check against numpy and torch)
  std::mt19937_64 rng(55);
  std::size_t checked = 0;
  auto check = [&](double x) {
    std::byte got[2];
    detail::store_bf16(x, got);
    const auto want = static_cast<std::uint16_t>(detail::encode_float_bits(x, detail::float_format_of(dtype::BF16)));
    const auto g =
        static_cast<std::uint16_t>(std::to_integer<unsigned>(got[0]) | (std::to_integer<unsigned>(got[1]) << 8));
    if (g != want) CHECK(g == want);
    ++checked;
  };
  for (int e = -140; e <= 130; ++e)
    for (int i = 0; i < 2000; ++i) {
      const std::uint64_t m = rng() & ((std::uint64_t(1) << 52) - 1);
      const std::uint64_t tie = (m & ~((std::uint64_t(1) << 45) - 1)) | (std::uint64_t(1) << 44);  // exactly half
      for (const std::uint64_t mant : {m, tie, m | ((std::uint64_t(1) << 45) - 1)}) {
        const std::uint64_t bits = (std::uint64_t(e + 1023) << 52) | mant | (i % 2 ? std::uint64_t(1) << 63 : 0);
        check(std::bit_cast<double>(bits));
      }
    }
  for (double x : {0.0, -0.0, 3.3895313892515355e38, 3.3961775292304718e38, 1e39, -1e39,
                   std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), 1e-40, 9.2e-41})
    check(x);
  CHECK(checked == 271 * 2000 * 3 + 10);
}

namespace {
/// A folder that counts each object's opens (config.json's, here).
struct counting_directory {
  using reader_type = file_storage;
  file_directory d;
  std::shared_ptr<std::map<std::string, int>> opens = std::make_shared<std::map<std::string, int>>();
  std::string_view name() const noexcept { return d.name(); }
  reader_type open(std::string_view n) const {
    ++(*opens)[std::string(n)];
    return d.open(n);
  }
  bool exists(std::string_view n) const { return d.exists(n); }
  std::vector<std::string> list() const { return d.list(); }
  counting_directory sub(std::string_view n) const { return {d.sub(n), opens}; }
};
}  // namespace

TEST_CASE("quantized weights: config.json is read once for a load, verify or listing of many weights") {
  // a DeepSeek-V3 checkpoint has thousands of FP8 weights: over HTTP or S3 a read of config.json
  // for each would be a request each
  const counting_directory dir{file_directory(quant_goldens / "fp8_block")};
  checkpoint_reader<counting_directory> r{dir};
  const int before = (*dir.opens)["config.json"];
  std::vector<std::vector<float>> mem;
  std::vector<flat_view> views;
  for (const auto& [key, w] :
       testing::read_golden_tensors(quant_goldens / "fp8_block" / "expected" / "f32.safetensors")) {
    mem.emplace_back(numel(w.shape));
    views.push_back({key, dtype::F32, w.shape, std::nullopt, reinterpret_cast<std::byte*>(mem.back().data()),
                     mem.back().size() * 4});
  }
  REQUIRE(views.size() == 3);
  load(r, std::span<const flat_view>(views), dequantizing());
  CHECK((*dir.opens)["config.json"] - before == 1);
  CHECK(quantized_tensors(r).size() == 3);
  CHECK((*dir.opens)["config.json"] - before == 2);
  CHECK(check_quantized(r).size() == 3);
  CHECK((*dir.opens)["config.json"] - before == 3);
}
