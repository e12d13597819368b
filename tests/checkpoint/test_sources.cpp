// Tests of checkpoint/source.hpp and of the loader on every layout it reads: Hugging Face
// folders and torch's DCP-sharded HF files built by hand (tests/support/checkpoint_fixtures.hpp), read
// through checkpoint_reader into flat and block shards, on the file and memory backends; and
// load_options::convert_dtypes against conversions computed here bit by bit.
#include "shardsafe/checkpoint/source.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "support/malformed_corpus.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"

using namespace shardsafe;
using fixtures::tensor;
using testing::expect_error;

namespace {

template <class D>
struct src_backend;
template <>
struct src_backend<file_directory> {
  testing::temp_dir tmp{"sources"};
  file_directory root() const { return file_directory(tmp.path); }
};
template <>
struct src_backend<memory_directory> {
  memory_directory dir;
  memory_directory root() const { return dir; }
};

/// A safetensors file laid out by hand with a __metadata__ object (JSON text `meta`).
std::string build_file_with_metadata(const std::vector<tensor>& ts, const std::string& meta) {
  std::string json = "{\"__metadata__\":" + meta, data;
  for (const auto& t : ts) {
    json += ',';
    json += corpus::entry(t.name, t.dtype, fixtures::shape_text(t.shape, ","),
                          "[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) + "]");
    data += t.bytes;
  }
  json += '}';
  return corpus::file_bytes(json, data);
}

/// Rows [r0, r1) of a row-major [rows, cols] tensor of `item`-byte elements.
std::string rows_of(const std::string& full, std::uint64_t cols, std::uint64_t item, std::uint64_t r0,
                    std::uint64_t r1) {
  return full.substr(r0 * cols * item, (r1 - r0) * cols * item);
}
/// Columns [c0, c1) of every row of a row-major [rows, cols] tensor.
std::string cols_of(const std::string& full, std::uint64_t rows, std::uint64_t cols, std::uint64_t item,
                    std::uint64_t c0, std::uint64_t c1) {
  std::string r;
  for (std::uint64_t i = 0; i < rows; ++i) r += full.substr((i * cols + c0) * item, (c1 - c0) * item);
  return r;
}

flat_view view_into(std::string& mem, const std::string& key, dtype t, shape_t full, std::optional<shard_spec> spec) {
  return flat_view{key, t, std::move(full), std::move(spec), reinterpret_cast<std::byte*>(mem.data()), mem.size()};
}

/// bf16 -> f32, exactly: the 16 bits become the top half.
std::uint32_t bf16_to_f32_bits(std::uint16_t b) { return std::uint32_t(b) << 16; }
/// f32 -> bf16, round to nearest even (finite inputs; NaN is made quiet with its sign kept).
std::uint16_t f32_to_bf16_bits(std::uint32_t u) {
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return std::uint16_t((u >> 16) | 0x0040u);
  const std::uint32_t lsb = (u >> 16) & 1u;
  return std::uint16_t((u + 0x7fffu + lsb) >> 16);
}

using testing::random_bytes;

}  // namespace

TEST_CASE_TEMPLATE("a Hugging Face folder reads as a checkpoint: whole, row, column and flat shards", D, file_directory,
                   memory_directory) {
  src_backend<D> b;
  const D dir = b.root();
  std::mt19937_64 rng(5);
  const std::vector<tensor> ts = {
      {"a.weight", "F32", {6, 5}, random_bytes(120, rng)},          {"a.bias", "F32", {5}, random_bytes(20, rng)},
      {"m.embed", "BF16", {7, 4}, random_bytes(56, rng)},           {"n.count", "I64", {3}, random_bytes(24, rng)},
      {"z.flags", "BOOL", {4}, std::string("\x01\x00\x00\x01", 4)},
  };
  fixtures::make_indexed(dir, ts);
  checkpoint_reader<D> r(dir);
  CHECK(r.layout() == hf_layout::info);
  CHECK(r.described_by() == "model.safetensors.index.json");
  REQUIRE(r.metadata().tensors.size() == ts.size());
  CHECK(r.find("a.weight")->shape == shape_t{6, 5});
  CHECK(r.find("m.embed")->type == dtype::BF16);

  SUBCASE("every tensor whole, and verify accepts it") {
    std::vector<std::string> mem;
    for (const auto& t : ts) mem.emplace_back(t.bytes.size(), '\0');
    std::vector<flat_view> views;
    for (std::size_t i = 0; i < ts.size(); ++i)
      views.push_back(view_into(mem[i], ts[i].name, dtype_from_name(ts[i].dtype, "t"), ts[i].shape, std::nullopt));
    load_stats st = load(r, views);
    for (std::size_t i = 0; i < ts.size(); ++i) CHECK_MESSAGE(mem[i] == ts[i].bytes, ts[i].name);
    CHECK(st.bytes_read == fixtures::total_bytes(ts));
    CHECK(verify_checkpoint(r).tensors == ts.size());
  }
  SUBCASE("rank 1 of 3 of a row split, a column split and a flat split read only their bytes") {
    std::string rows(2 * 5 * 4, '\0'), cols(7 * 2 * 2, '\0'), flat(2 * 8, '\0');
    std::vector<flat_view> views = {
        view_into(rows, "a.weight", dtype::F32, {6, 5}, shard_spec(block_spec({2, 5}, {2, 0}))),
        view_into(cols, "m.embed", dtype::BF16, {7, 4}, shard_spec(block_spec({7, 2}, {0, 2}))),
        view_into(flat, "n.count", dtype::I64, {3}, shard_spec(flat_spec{{1, 3}})),
    };
    load_options opt;
    opt.strict = true;
    load_stats st = load(r, views, opt);
    CHECK(rows == rows_of(ts[0].bytes, 5, 4, 2, 4));
    CHECK(cols == cols_of(ts[2].bytes, 7, 4, 2, 2, 4));
    CHECK(flat == ts[3].bytes.substr(8, 16));
    CHECK(st.bytes_needed == rows.size() + cols.size() + flat.size());
    // columns of a row-major tensor are strided: merged reads may take the small gaps
    CHECK(double(st.bytes_read) <= 1.1 * double(st.bytes_needed) + 64);
    CHECK(st.unexpected_keys == std::vector<std::string>{"a.bias", "z.flags"});
    // a caller loading a piece at a time asks for no list (each would walk every tensor)
    opt.list_unexpected = false;
    const load_stats quiet = load(r, views, opt);
    CHECK(quiet.unexpected_keys.empty());
    CHECK(quiet.bytes_needed == st.bytes_needed);
  }
  SUBCASE("a single model.safetensors") {
    src_backend<D> b2;
    const D d2 = b2.root();
    fixtures::put(d2, "model.safetensors", fixtures::build_file(ts));
    checkpoint_reader<D> r2(d2);
    CHECK(r2.layout() == hf_layout::info);
    CHECK(r2.described_by() == "model.safetensors");
    std::string out(20, '\0');
    flat_view v = view_into(out, "a.bias", dtype::F32, {5}, std::nullopt);
    load(r2, std::span<const flat_view>(&v, 1));
    CHECK(out == ts[1].bytes);
  }
}

TEST_CASE_TEMPLATE("convert_dtypes: BF16 into F32 and F32 into BF16, bit for bit, through every read path", D,
                   file_directory, memory_directory) {
  src_backend<D> b;
  const D dir = b.root();
  std::mt19937_64 rng(11);
  // finite values and a few NaNs / infinities, with random signs
  std::string f32(4 * 64, '\0');
  for (std::size_t i = 0; i < 64; ++i) {
    std::uint32_t u = std::uint32_t(rng());
    if (i % 17 == 3) u = (u & 0x80000000u) | 0x7fc00001u;                                  // quiet NaN with payload
    if (i % 19 == 5) u = (u & 0x80000000u) | 0x7f800000u;                                  // infinity
    if ((u & 0x7f800000u) == 0x7f800000u && i % 17 != 3 && i % 19 != 5) u &= 0xbfffffffu;  // keep the rest finite
    std::memcpy(f32.data() + 4 * i, &u, 4);
  }
  std::string bf16 = random_bytes(2 * 48, rng);
  for (std::size_t i = 0; i < 48; ++i)  // no NaN patterns in the BF16 source: checked separately above
    if ((std::uint8_t(bf16[2 * i + 1]) & 0x7f) == 0x7f && (std::uint8_t(bf16[2 * i]) & 0x80)) bf16[2 * i + 1] ^= 0x40;
  fixtures::put(dir, "model.safetensors",
                fixtures::build_file({{"h", "BF16", {6, 8}, bf16}, {"w", "F32", {8, 8}, f32}}));
  checkpoint_reader<D> r(dir);

  // expectations computed here
  std::string h_as_f32, w_rows_as_bf16;
  for (std::size_t i = 0; i < 48; ++i) {
    std::uint16_t v;
    std::memcpy(&v, bf16.data() + 2 * i, 2);
    const std::uint32_t u = bf16_to_f32_bits(v);
    h_as_f32.append(reinterpret_cast<const char*>(&u), 4);
  }
  for (std::size_t i = 3 * 8; i < 7 * 8; ++i) {
    std::uint32_t u;
    std::memcpy(&u, f32.data() + 4 * i, 4);
    const std::uint16_t v = f32_to_bf16_bits(u);
    w_rows_as_bf16.append(reinterpret_cast<const char*>(&v), 2);
  }

  for (std::uint64_t max_read : {std::uint64_t(64) << 20, std::uint64_t(6), std::uint64_t(7)}) {
    CAPTURE(max_read);
    std::string h(48 * 4, '\0'), w(4 * 8 * 2, '\0');
    std::vector<flat_view> views = {
        view_into(h, "h", dtype::F32, {6, 8}, std::nullopt),
        view_into(w, "w", dtype::BF16, {8, 8}, shard_spec(block_spec({4, 8}, {3, 0}))),
    };
    load_options opt;
    opt.convert_dtypes = true;
    opt.reads.max_read_bytes = max_read;
    const load_schedule s = r.plan(views, opt);
    CHECK(s.converted.size() == 2);
    load_stats st = r.execute(views, s);
    CHECK(h == h_as_f32);
    CHECK(w == w_rows_as_bf16);
    CHECK(st.bytes_needed == bf16.size() + 4 * 8 * 4);
  }
  std::string h(48 * 4, '\0');
  flat_view v = view_into(h, "h", dtype::F32, {6, 8}, std::nullopt);
  expect_error([&] { load(r, std::span<const flat_view>(&v, 1)); }, errc::dtype_mismatch,
               {"tensor 'h'", "BF16", "F32", "convert_dtypes is off"});
}

TEST_CASE("convert_dtypes never converts integers or BOOL") {
  memory_directory dir;
  fixtures::put(dir, "model.safetensors", fixtures::build_file({{"n", "I32", {2}, std::string(8, '\1')}}));
  checkpoint_reader<memory_directory> r(dir);
  std::string out(8, '\0');
  flat_view v = view_into(out, "n", dtype::F32, {2}, std::nullopt);
  load_options opt;
  opt.convert_dtypes = true;
  expect_error([&] { load(r, std::span<const flat_view>(&v, 1), opt); }, errc::dtype_mismatch,
               {"tensor 'n'", "I32", "only F16, BF16, F32 and F64 convert"});
}

namespace {

/// One rank's file of a DCP-sharded folder: tensors with their block offsets.
struct dcp_block {
  tensor t;
  shape_t offsets;
};

std::string dcp_file(const std::vector<dcp_block>& blocks, const std::string& info_override = "") {
  std::string info = "{";
  std::vector<tensor> ts;
  for (const auto& b : blocks) {
    if (info.size() > 1) info += ',';
    info += "\"" + b.t.name + "\":{\"saved_offsets\":" + fixtures::shape_text(b.offsets, ",") + "}";
    ts.push_back(b.t);
  }
  info += "}";
  if (!info_override.empty()) info = info_override;
  return build_file_with_metadata(
      ts, "{\"DCP_SHARDING_INFO\":" + testing::json_quoted(info) + ",\"DCP_VERSION\":\"1.0\",\"format\":\"pt\"}");
}

/// The full tensors of the DCP fixture and the folder written from them on 3 ranks:
/// ids I64 [5,4] in row blocks 2/2/1, mask BOOL [6] in blocks 3/0/3 (rank 1 holds none),
/// emb BF16 [4,6] in column blocks 2/2/2.
struct dcp_fixture {
  std::string ids, mask, emb;
  std::vector<std::string> files;
  explicit dcp_fixture(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    ids = random_bytes(5 * 4 * 8, rng);
    mask.clear();
    for (int i = 0; i < 6; ++i) mask += char(rng() & 1);
    emb = random_bytes(4 * 6 * 2, rng);
    files.push_back(dcp_file({{{"ids", "I64", {2, 4}, rows_of(ids, 4, 8, 0, 2)}, {0, 0}},
                              {{"mask", "BOOL", {3}, mask.substr(0, 3)}, {0}},
                              {{"emb", "BF16", {4, 2}, cols_of(emb, 4, 6, 2, 0, 2)}, {0, 0}}}));
    files.push_back(dcp_file({{{"ids", "I64", {2, 4}, rows_of(ids, 4, 8, 2, 4)}, {2, 0}},
                              {{"emb", "BF16", {4, 2}, cols_of(emb, 4, 6, 2, 2, 4)}, {0, 2}}}));
    files.push_back(dcp_file({{{"ids", "I64", {1, 4}, rows_of(ids, 4, 8, 4, 5)}, {4, 0}},
                              {{"mask", "BOOL", {3}, mask.substr(3, 3)}, {3}},
                              {{"emb", "BF16", {4, 2}, cols_of(emb, 4, 6, 2, 4, 6)}, {0, 4}}}));
  }
  static std::string name(int i) { return "shard-0000" + std::to_string(i + 1) + "-model-00001-of-00001.safetensors"; }
  template <class D>
  void write(const D& dir) const {
    for (int i = 0; i < 3; ++i) fixtures::put(dir, name(i), files[i]);
  }
};

}  // namespace

TEST_CASE_TEMPLATE("torch's DCP-sharded HF files read as a checkpoint: I64, BOOL and BF16 blocks on 3 ranks", D,
                   file_directory, memory_directory) {
  src_backend<D> b;
  const D dir = b.root();
  dcp_fixture fx(21);
  fx.write(dir);
  checkpoint_reader<D> r(dir);
  CHECK(r.layout() == dcp_sharded_hf_layout::info);
  REQUIRE(r.metadata().tensors.size() == 3);
  CHECK(r.metadata().tensors[0].first == "emb");  // by name
  CHECK(r.find("ids")->shape == shape_t{5, 4});
  CHECK(r.find("mask")->shape == shape_t{6});
  CHECK(r.find("emb")->shape == shape_t{4, 6});
  CHECK(r.find("mask")->type == dtype::BOOL);
  CHECK(verify_checkpoint(r).tensors == 3);

  std::string ids(fx.ids.size(), '\0'), mask(6, '\0'), emb(fx.emb.size(), '\0');
  unshard_tensor(r, "ids", std::as_writable_bytes(std::span(ids)));
  unshard_tensor(r, "mask", std::as_writable_bytes(std::span(mask)));
  unshard_tensor(r, "emb", std::as_writable_bytes(std::span(emb)));
  CHECK(ids == fx.ids);
  CHECK(mask == fx.mask);
  CHECK(emb == fx.emb);

  // a reshard: rows 1..4 of emb (crossing every column block)
  std::string part(3 * 6 * 2, '\0');
  flat_view v = view_into(part, "emb", dtype::BF16, {4, 6}, shard_spec(block_spec({3, 6}, {1, 0})));
  load(r, std::span<const flat_view>(&v, 1));
  CHECK(part == rows_of(fx.emb, 6, 2, 1, 4));
}

TEST_CASE("DCP-sharded folders: broken ones are refused naming file, tensor and rule") {
  dcp_fixture fx(3);
  SUBCASE("a file without DCP_SHARDING_INFO") {
    memory_directory dir;
    fx.write(dir);
    fixtures::put(dir, "zz.safetensors", fixtures::build_file({{"x", "U8", {1}, "a"}}));
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata,
                 {"zz.safetensors", "no DCP_SHARDING_INFO"});
  }
  SUBCASE("a tensor missing from DCP_SHARDING_INFO") {
    memory_directory dir;
    fixtures::put(dir, dcp_fixture::name(0), dcp_file({{{"ids", "I64", {2, 4}, fx.ids.substr(0, 64)}, {0, 0}}}, "{}"));
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata,
                 {dcp_fixture::name(0), "tensor 'ids'", "not in DCP_SHARDING_INFO"});
  }
  SUBCASE("saved_offsets of the wrong length") {
    memory_directory dir;
    fixtures::put(dir, dcp_fixture::name(0), dcp_file({{{"ids", "I64", {2, 4}, fx.ids.substr(0, 64)}, {0}}}));
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata,
                 {"tensor 'ids'", "saved_offsets", "2 dimensions"});
  }
  SUBCASE("dtypes that disagree between files") {
    memory_directory dir;
    fixtures::put(dir, dcp_fixture::name(0), dcp_file({{{"m", "U8", {2}, "ab"}, {0}}}));
    fixtures::put(dir, dcp_fixture::name(1), dcp_file({{{"m", "I8", {2}, "cd"}, {2}}}));
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata,
                 {dcp_fixture::name(1), "tensor 'm'", "dtype I8"});
  }
  SUBCASE("a block nobody wrote: verify names the gap, a load of it fails") {
    memory_directory dir;
    fixtures::put(dir, dcp_fixture::name(0), fx.files[0]);
    fixtures::put(dir, dcp_fixture::name(2), fx.files[2]);  // rank 1's rows and columns are gone
    checkpoint_reader<memory_directory> r(dir);
    expect_error([&] { verify_checkpoint(r); }, errc::missing_coverage, {"are in no file"});
    std::string ids(fx.ids.size(), '\0');
    expect_error([&] { unshard_tensor(r, "ids", std::as_writable_bytes(std::span(ids))); }, errc::missing_coverage,
                 {"tensor 'ids'"});
  }
  SUBCASE("column blocks of 2^21 + 1 rows, a row missing below the last: named by count, the walk bounded") {
    // 2^22 + 2 runs before the gap, more than the walk takes (coverage_walk_runs); the files
    // hold 2 elements fewer than the tensor
    const std::uint64_t rows = (std::uint64_t(1) << 21) + 1;
    REQUIRE(2 * rows > coverage_walk_runs);
    memory_directory dir;
    for (std::uint64_t c = 0; c < 2; ++c)
      fixtures::put(dir, dcp_fixture::name(static_cast<int>(c)),
                    dcp_file({{{"u", "U8", {rows, 1}, std::string(rows, char('a' + c))}, {0, c}}}));
    fixtures::put(dir, dcp_fixture::name(2), dcp_file({{{"u", "U8", {1, 2}, "zz"}, {rows + 1, 0}}}));
    checkpoint_reader<memory_directory> r(dir);
    const std::string held = "its files hold " + std::to_string(2 * rows + 2) + " elements in all, fewer than its " +
                             std::to_string(2 * rows + 4) + ": some are in no file";
    expect_error([&] { verify_checkpoint(r); }, errc::missing_coverage, {"tensor 'u'", held});
    const unshard_source<memory_directory> src{&r, ""};
    expect_error(
        [&] {
          memory_writer out("whole.safetensors");
          unshard_to_safetensors(std::span<const unshard_source<memory_directory>>(&src, 1), out);
        },
        errc::missing_coverage, {"tensor 'u'", held});
    // a tensor unsharded alone is planned run by run, as its read needs: the gap is named
    std::string u(2 * rows + 4, '\0');
    expect_error(
        [&] { unshard_tensor(r, "u", std::as_writable_bytes(std::span(u))); }, errc::missing_coverage,
        {"tensor 'u'", "global element " + std::to_string(2 * rows) + ", index [" + std::to_string(rows) + ",0]"});
  }
  SUBCASE("not a checkpoint at all, a DCP folder without .metadata, a damaged .metadata") {
    memory_directory dir;
    dir.make();
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::not_found, {"no metadata.json"});
    fixtures::put(dir, "__0_0.distcp", "y");
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::not_found,
                 {".distcp files but no .metadata", "torch.distributed.checkpoint folder"});
    fixtures::put(dir, ".metadata", "x");
    expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata, {".metadata"});
  }
}

// The planner alone (checkpoint/load_plan.hpp): a description and two headers made here, no
// storage at all. Every read's file offset, length and destination is worked out by hand from
// the layout below, not by the code under test.
TEST_CASE("the load planner plans from a description and headers alone") {
  // "w" [4, 6] F32: rank_0 holds rows 0-1, rank_1 rows 2-3; "r" [3] F32 whole in both files
  checkpoint_metadata md;
  tensor_metadata w{{4, 6}, dtype::F32, true, {}, {}};
  w.files = {{"rank_0.safetensors", shard_spec(block_spec({2, 6}, {0, 0}))},
             {"rank_1.safetensors", shard_spec(block_spec({2, 6}, {2, 0}))}};
  tensor_metadata r{{3}, dtype::F32, true, {}, {}};
  r.files = {{"rank_0.safetensors", shard_spec(flat_spec{{0, 3}})},
             {"rank_1.safetensors", shard_spec(flat_spec{{0, 3}})}};
  md.tensors = {{"r", r}, {"w", w}};
  // rank_0: w's data at [0, 48), r's at [48, 60); rank_1: r at [0, 12), w at [12, 60)
  const std::string j0 =
      R"({"w":{"dtype":"F32","shape":[12],"data_offsets":[0,48]},"r":{"dtype":"F32","shape":[3],"data_offsets":[48,60]}})";
  const std::string j1 =
      R"({"r":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"w":{"dtype":"F32","shape":[12],"data_offsets":[12,60]}})";
  const safetensors_header h0 = parse_safetensors_header(j0, 8 + j0.size() + 60, "rank_0.safetensors");
  const safetensors_header h1 = parse_safetensors_header(j1, 8 + j1.size() + 60, "rank_1.safetensors");
  const std::uint64_t d0 = 8 + j0.size(), d1 = 8 + j1.size();  // where each file's data starts
  auto find = [&](std::string_view k) { return md.find(k); };

  // my shard: columns 3-5 of every row of w ([4, 3] at [0, 3]), and r whole; no memory: the
  // planner never touches it (memory_later)
  const std::vector<flat_view> views{{"w", dtype::F32, {4, 6}, block_spec({4, 3}, {0, 3}), nullptr, 48},
                                     {"r", dtype::F32, {3}, std::nullopt, nullptr, 12}};
  load_options opt;
  opt.reads.max_gap_bytes = 0;  // no merging: one read per row piece
  auto plan = [&](const checkpoint_metadata& m) {
    view_plans vp = plan_views(m, [&](std::string_view k) { return m.find(k); }, views, opt, "ckpt", true);
    REQUIRE(vp.files == std::vector<std::string>{"rank_0.safetensors", "rank_1.safetensors"});
    const read_options ro = resolve_read_options(opt.reads, read_settings{});
    const std::vector<planned_file> files{{&h0, "rank_0.safetensors", ro}, {&h1, "rank_1.safetensors", ro}};
    return schedule_reads(std::move(vp), views, files, opt, 3, "metadata.json");
  };
  const load_schedule s = plan(md);
  CHECK(s.threads == 3);
  CHECK(s.stats.tensors == 2);
  CHECK(s.stats.bytes_needed == 48 + 12);
  // (file, view, file offset, length, destination in the view) of every read, by hand:
  // w's row i, columns 3-5, is elements 6i+3 .. 6i+5 of the full tensor; rank_0 holds rows 0-1
  // (its elements 6i+3.. at byte 4(6i+3)), rank_1 rows 2-3 (at byte 4(6(i-2)+3) of its w)
  using row = std::tuple<std::size_t, std::size_t, std::uint64_t, std::uint64_t, std::uint64_t>;
  std::vector<row> got,
      want{{0, 0, d0 + 12, 12, 0}, {0, 0, d0 + 36, 12, 12}, {1, 0, d1 + 12 + 12, 12, 24}, {1, 0, d1 + 12 + 36, 12, 36}};
  std::vector<row> r_reads;
  for (std::size_t f = 0; f < s.files.size(); ++f)
    for (const auto& rd : s.files[f].reads) {
      REQUIRE(rd.op.pieces.size() == 1);
      (rd.view == 0 ? got : r_reads).push_back({f, rd.view, rd.op.file_offset, rd.op.len, rd.op.pieces[0].dst});
    }
  CHECK(got == want);
  // r: read whole from one file, and compared with the other's copy (no checksums say they are equal)
  REQUIRE(r_reads.size() == 1);
  REQUIRE(s.compares.size() == 1);
  const std::size_t from = std::get<0>(r_reads[0]), other = s.compares[0].first;
  CHECK(from != other);
  CHECK(std::get<2>(r_reads[0]) == (from == 0 ? d0 + 48 : d1));
  CHECK(s.compares[0].second.op.file_offset == (other == 0 ? d0 + 48 : d1));
  CHECK(s.compares[0].second.op.len == 12);
  CHECK(s.stats.read_ops == 4 + 1 + 1);
  CHECK(s.stats.bytes_read == 48 + 12 + 12);

  SUBCASE("equal recorded checksums: the replica is not read twice") {
    checkpoint_metadata m2 = md;
    checkpoint_checksums cs;
    cs.files["rank_0.safetensors"]["r"] = {42};
    cs.files["rank_1.safetensors"]["r"] = {42};
    m2.extras.checksums = cs;
    CHECK(plan(m2).compares.empty());
    cs.files["rank_1.safetensors"]["r"] = {43};
    m2.extras.checksums = cs;
    CHECK(plan(m2).compares.size() == 1);
  }
  SUBCASE("a gap in the files is missing coverage, found before any file is opened") {
    checkpoint_metadata m2 = md;
    m2.tensors[1].second.files.pop_back();  // rows 2-3 of w in no file
    expect_error([&] { plan_views(m2, [&](std::string_view k) { return m2.find(k); }, views, opt, "ckpt", true); },
                 errc::missing_coverage, {"ckpt: tensor 'w'", "6 of this shard's 12 elements are in no file"});
  }
  SUBCASE("a header that does not match the description is named") {
    view_plans vp = plan_views(md, find, views, opt, "ckpt", true);
    const read_options ro;
    const std::string jbad =
        R"({"w":{"dtype":"F16","shape":[12],"data_offsets":[0,24]},"r":{"dtype":"F32","shape":[3],"data_offsets":[24,36]}})";
    const safetensors_header hb = parse_safetensors_header(jbad, 8 + jbad.size() + 36, "rank_0.safetensors");
    const std::vector<planned_file> bad{{&hb, "rank_0.safetensors", ro}, {&h1, "rank_1.safetensors", ro}};
    expect_error([&] { schedule_reads(std::move(vp), views, bad, opt, 1, "metadata.json"); }, errc::dtype_mismatch,
                 {"rank_0.safetensors: tensor 'w'", "file has dtype F16, metadata.json says F32"});
  }
}
