// Tests of format/metadata.hpp (a checkpoint's metadata.json, docs/FORMAT.md §2) and
// format/hf_index.hpp (model.safetensors.index.json, docs/FORMAT.md §3).
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/format/hf_index.hpp"

#include <doctest/doctest.h>

#include "support/test_util.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "shardsafe/storage/memory.hpp"

using namespace shardsafe;

namespace {

using testing::expect_error;

void check_same(const checkpoint_metadata& a, const checkpoint_metadata& b) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [ka, ta] = a.tensors[i];
    const auto& [kb, tb] = b.tensors[i];
    INFO("tensor " << ka);
    CHECK(ka == kb);
    CHECK(ta.shape == tb.shape);
    CHECK(ta.type == tb.type);
    CHECK(ta.is_sharded == tb.is_sharded);
    REQUIRE(ta.files.size() == tb.files.size());
    for (std::size_t j = 0; j < ta.files.size(); ++j) {
      CHECK(ta.files[j].first == tb.files[j].first);
      CHECK(ta.files[j].second == tb.files[j].second);
    }
  }
  CHECK(a.extras.writer == b.extras.writer);
  CHECK(a.extras.world_size == b.extras.world_size);
  CHECK(a.extras.file_sizes == b.extras.file_sizes);
  REQUIRE(a.extras.checksums.has_value() == b.extras.checksums.has_value());
  if (a.extras.checksums) {
    CHECK(a.extras.checksums->algorithm == b.extras.checksums->algorithm);
    CHECK(a.extras.checksums->block_bytes == b.extras.checksums->block_bytes);
    CHECK(a.extras.checksums->files == b.extras.checksums->files);
  }
}

// docs/FORMAT.md §2's example, as json.dumps(obj) writes it (checked once against Python 3).
const std::string format_example =
    R"({"tensors": {"w": {"shape": [16, 8], "is_sharded": true, "dtype": "BF16", "shard_spec_per_file": )"
    R"({"rank_0.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], "global_offset": [0, 0]}, )"
    R"("rank_1.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], "global_offset": [8, 0]}}}, )"
    R"("b": {"shape": [6], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": )"
    R"({"rank_0.safetensors": {"flattened_offsets": [[0, 4]], "local_shape": null, "global_offset": null}, )"
    R"("rank_1.safetensors": {"flattened_offsets": [[4, 6]], "local_shape": null, "global_offset": null}}}}})";

checkpoint_metadata example_metadata() {
  checkpoint_metadata md;
  tensor_metadata w{{16, 8}, dtype::BF16, true, {}, {}};
  w.files.emplace_back("rank_0.safetensors", block_spec({8, 8}, {0, 0}));
  w.files.emplace_back("rank_1.safetensors", block_spec({8, 8}, {8, 0}));
  tensor_metadata b{{6}, dtype::F32, true, {}, {}};
  b.files.emplace_back("rank_0.safetensors", flat_spec{{0, 4}});
  b.files.emplace_back("rank_1.safetensors", flat_spec{{4, 6}});
  md.tensors.emplace_back("w", std::move(w));
  md.tensors.emplace_back("b", std::move(b));
  return md;
}

/// metadata.json with one tensor "w" of `shape`/`dtype` and the given shard_spec_per_file body.
std::string one_tensor(std::string_view specs, std::string_view shape = "[6]", std::string_view dt = "\"F32\"") {
  return R"({"tensors": {"w": {"shape": )" + std::string(shape) + R"(, "is_sharded": true, "dtype": )" +
         std::string(dt) + R"(, "shard_spec_per_file": {)" + std::string(specs) + "}}}}";
}
/// metadata.json with one sharded F32 tensor "w" of `shape` described by a grid of these fields.
std::string grid_tensor(std::string_view shape, std::string_view fields) {
  return R"({"tensors": {"w": {"shape": )" + std::string(shape) + R"(, "is_sharded": true, "dtype": "F32", )" +
         R"("shardsafe_grid": {)" + std::string(fields) + "}}}}";
}
std::string flat(std::string_view file, std::string_view ranges) {
  return "\"" + std::string(file) + R"(": {"flattened_offsets": )" + std::string(ranges) +
         R"(, "local_shape": null, "global_offset": null})";
}

}  // namespace

TEST_CASE("metadata: docs/FORMAT.md's example, written in Python's json.dumps layout and read back") {
  CHECK(write_checkpoint_metadata(example_metadata()) == format_example);
  const auto md = parse_checkpoint_metadata(format_example, "ckpt/model/metadata.json");
  check_same(md, example_metadata());
  REQUIRE(md.find("w") != nullptr);
  CHECK(md.find("w")->numel() == 128);
  CHECK(md.find("nope") == nullptr);
  // the same content as docs/FORMAT.md §2 prints it, with newlines and indentation
  const std::string pretty = R"({"tensors": {
  "w": {"shape": [16, 8], "is_sharded": true, "dtype": "BF16",
        "shard_spec_per_file": {
          "rank_0.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], "global_offset": [0, 0]},
          "rank_1.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], "global_offset": [8, 0]}}},
  "b": {"shape": [6], "is_sharded": true, "dtype": "F32",
        "shard_spec_per_file": {
          "rank_0.safetensors": {"flattened_offsets": [[0, 4]], "local_shape": null, "global_offset": null},
          "rank_1.safetensors": {"flattened_offsets": [[4, 6]], "local_shape": null, "global_offset": null}}}}})";
  check_same(parse_checkpoint_metadata(pretty, "m.json"), example_metadata());
  // through a storage: the storage's name is the file in messages
  const std::string text = write_checkpoint_metadata(example_metadata());
  memory_storage s(byte_buffer(reinterpret_cast<const std::byte*>(text.data()),
                               reinterpret_cast<const std::byte*>(text.data()) + text.size()),
                   "run/model/metadata.json");
  check_same(read_checkpoint_metadata(s), example_metadata());
}

TEST_CASE("metadata: round trip of flat and N-D block specs, 0-d tensors and extras") {
  checkpoint_metadata md;
  auto add = [&](std::string key, shape_t shape, dtype t, bool sharded,
                 std::vector<std::pair<std::string, shard_spec>> files) {
    md.tensors.emplace_back(std::move(key), tensor_metadata{std::move(shape), t, sharded, std::move(files), {}});
  };
  add("flat.multi", {10, 3}, dtype::F32, true,
      {{"rank_0.safetensors", flat_spec{{0, 4}, {4, 4}, {9, 12}}},
       {"rank_1.safetensors", flat_spec{{4, 9}, {12, 30}}},
       {"rank_2.safetensors", flat_spec{}}});
  add("block.3d", {4, 6, 5}, dtype::BF16, true,
      {{"rank_0.safetensors", block_spec({2, 6, 5}, {0, 0, 0})},
       {"rank_1.safetensors", block_spec({2, 3, 5}, {2, 0, 0})},
       {"rank_2.safetensors", block_spec({2, 3, 2}, {2, 3, 0})},
       {"rank_3.safetensors", block_spec({2, 3, 3}, {2, 3, 2})}});
  add("block.4d", {2, 2, 2, 2}, dtype::I64, true, {{"rank_0.safetensors", block_spec({1, 2, 1, 2}, {1, 0, 1, 0})}});
  add("scalar", {}, dtype::F64, false, {{"rank_0.safetensors", block_spec({}, {})}});
  add("scalar.flat", {}, dtype::I32, false, {{"rank_0.safetensors", flat_spec{{0, 1}}}});
  add("empty", {0, 7}, dtype::U8, false, {{"rank_0.safetensors", flat_spec{{0, 0}}}});
  add("name \"quoted\" \\ \xc3\xa9", {3}, dtype::F8_E4M3, false, {{"rank_1.safetensors", flat_spec{{0, 3}}}});
  add("f4", {8}, dtype::F4, false, {{"rank_0.safetensors", block_spec({8}, {0})}});
  SUBCASE("without extras") {}
  SUBCASE("with extras") {
    md.extras.writer = "shardsafe 0.1.0";
    md.extras.world_size = 4;
    md.extras.file_sizes = {{"rank_0.safetensors", 1234}, {"rank_3.safetensors", 0}};
  }
  SUBCASE("with checksums") {
    md.extras.world_size = 2;
    checkpoint_checksums cs;
    cs.block_bytes = 1000;
    cs.files["rank_0.safetensors"] = {{"a", {0x0123456789abcdefu, 0}}, {"empty", {}}};
    cs.files["rank_1.safetensors"] = {{"a", {0xffffffffffffffffu}}};
    md.extras.checksums = cs;
  }
  const std::string text = write_checkpoint_metadata(md);
  check_same(parse_checkpoint_metadata(text, "metadata.json"), md);
  CHECK(text.find(R"("block.3d": {"shape": [4, 6, 5], "is_sharded": true, "dtype": "BF16")") != std::string::npos);
  CHECK(text.find(R"("rank_2.safetensors": {"flattened_offsets": [], "local_shape": null)") != std::string::npos);
  CHECK(text.find(R"({"flattened_offsets": [[0, 4], [4, 4], [9, 12]], "local_shape": null, "global_offset": null})") !=
        std::string::npos);
  CHECK(text.find(R"({"flattened_offsets": null, "local_shape": [2, 3, 2], "global_offset": [2, 3, 0]})") !=
        std::string::npos);
  if (md.extras.checksums)
    CHECK(text.substr(text.find(", \"shardsafe\"")) ==
          R"(, "shardsafe": {"world_size": 2, "checksums": {"algorithm": "xxh3-64", "block_bytes": 1000, "files": )"
          R"({"rank_0.safetensors": {"a": ["0123456789abcdef", "0000000000000000"], "empty": []}, )"
          R"("rank_1.safetensors": {"a": ["ffffffffffffffff"]}}}}})");
  else if (md.extras.world_size)
    CHECK(text.substr(text.find(", \"shardsafe\"")) ==
          R"(, "shardsafe": {"writer": "shardsafe 0.1.0", "world_size": 4, "file_sizes": )"
          R"({"rank_0.safetensors": 1234, "rank_3.safetensors": 0}}})");
  else
    CHECK(text.find("shardsafe") == std::string::npos);
}

TEST_CASE("metadata: the compact form - grids detected from listed shards, written, read, expanded and queried") {
  using u64 = std::uint64_t;
  // a flat split in chunks of 7 over ranks 4, 6, 8, 10 (the last piece short), and a 2 x 3
  // block grid with an empty last column piece, ranks 8 + 4 i + j
  tensor_metadata f{{4, 6}, dtype::BF16, true, {}, {}};
  for (u64 i = 0; i < 4; ++i)
    f.files.emplace_back(rank_file_name(4 + 2 * i),
                         flat_spec{{std::min<u64>(24, 7 * i), std::min<u64>(24, 7 * i + 7)}});
  tensor_metadata b{{10, 5}, dtype::F32, true, {}, {}};
  for (u64 i = 0; i < 2; ++i)
    for (u64 j = 0; j < 3; ++j) {
      const u64 c0 = std::min<u64>(5, 3 * j), c1 = std::min<u64>(5, 3 * j + 3);
      b.files.emplace_back(rank_file_name(8 + 4 * i + j), block_spec({5, c1 - c0}, {5 * i, c0}));
    }
  const auto gf = detect_grid(f), gb = detect_grid(b);
  REQUIRE(gf);
  REQUIRE(gb);
  CHECK(*gf == shard_grid{true, {7}, {4}, 4, {2}});
  CHECK(*gb == shard_grid{false, {5, 3}, {2, 3}, 8, {4, 1}});
  // not grids: an irregular piece, files out of rank order, a name that is not a rank file, one file
  auto changed = [](tensor_metadata t, auto&& edit) {
    edit(t);
    return detect_grid(t).has_value();
  };
  CHECK_FALSE(changed(f, [](tensor_metadata& t) {
    t.files[1].second = flat_spec{{7, 13}};
    t.files[2].second = flat_spec{{13, 21}};
  }));
  CHECK_FALSE(changed(f, [](tensor_metadata& t) { std::swap(t.files[1].first, t.files[2].first); }));
  CHECK_FALSE(changed(f, [](tensor_metadata& t) { t.files[0].first = "rank_04.safetensors"; }));
  CHECK_FALSE(changed(f, [](tensor_metadata& t) { t.files.resize(1); }));

  checkpoint_metadata md;
  tensor_metadata cf = f, cb = b;
  cf.grid = gf;
  cb.grid = gb;
  cf.files.clear();
  cb.files.clear();
  md.tensors.emplace_back("f", cf);
  md.tensors.emplace_back("b", cb);
  const std::string text = write_checkpoint_metadata(md);
  CHECK(
      text ==
      R"({"tensors": {"f": {"shape": [4, 6], "is_sharded": true, "dtype": "BF16", "shardsafe_grid": {"flat": true, )"
      R"("chunks": [7], "parts": [4], "base": 4, "strides": [2]}}, "b": {"shape": [10, 5], "is_sharded": true, )"
      R"("dtype": "F32", "shardsafe_grid": {"flat": false, "chunks": [5, 3], "parts": [2, 3], "base": 8, "strides": [4, 1]}}}})");
  const checkpoint_metadata back = parse_checkpoint_metadata(std::string(text), "m.json");
  REQUIRE(back.tensors.size() == 2);
  CHECK(back.tensors[0].second.grid == gf);
  CHECK(back.tensors[1].second.grid == gb);
  CHECK(back.tensors[0].second.files.empty());
  CHECK(back.tensors[0].second.file_specs() == f.files);
  CHECK(back.tensors[1].second.file_specs() == b.files);
  CHECK(back.tensors[1].second.file_count() == 6);
  // queried by division: the parts a wanted shard meets, in rank order (never an empty one)
  auto names = [](const std::vector<std::pair<std::string, shard_spec>>& v) {
    std::vector<std::string> n;
    for (const auto& [k, s] : v) n.push_back(k);
    return n;
  };
  const tensor_metadata& qb = back.tensors[1].second;
  CHECK(names(qb.overlapping_files(block_spec({2, 2}, {4, 2}))) ==
        std::vector<std::string>{"rank_8.safetensors", "rank_9.safetensors", "rank_12.safetensors",
                                 "rank_13.safetensors"});
  CHECK(names(qb.overlapping_files(block_spec({1, 5}, {9, 0}))) ==
        std::vector<std::string>{"rank_12.safetensors", "rank_13.safetensors"});  // column piece 2 is empty
  // a flat range: its bounding box (element 26 is [5, 1]: one part; [24, 27) runs from [4, 4]
  // to [5, 1]: rows 4 and 5, all their columns)
  CHECK(names(qb.overlapping_files(flat_spec{{26, 27}})) == std::vector<std::string>{"rank_12.safetensors"});
  CHECK(names(qb.overlapping_files(flat_spec{{24, 27}})) ==
        std::vector<std::string>{"rank_8.safetensors", "rank_9.safetensors", "rank_12.safetensors",
                                 "rank_13.safetensors"});
  CHECK(names(back.tensors[0].second.overlapping_files(flat_spec{{6, 15}})) ==
        std::vector<std::string>{"rank_4.safetensors", "rank_6.safetensors", "rank_8.safetensors"});
  CHECK(names(back.tensors[0].second.overlapping_files(block_spec({1, 6}, {3, 0}))) ==
        std::vector<std::string>{"rank_8.safetensors", "rank_10.safetensors"});  // elements 18-23
  CHECK(qb.overlapping_files(flat_spec{{3, 3}}).empty());
}

TEST_CASE("metadata: a grid's parts visited in rank order, one at a time, up to 2^20 of them") {
  // ranks that run down the columns (strides [1, 4]) and a dimension of one part: every index in
  // index order, ranked by the format's rule and sorted here, is the order the parts come in
  const shard_grid g{false, {2, 7, 1}, {3, 1, 4}, 5, {1, 0, 3}};
  const shape_t full{5, 7, 4};
  validate(g, full, "g");
  std::vector<std::pair<std::uint64_t, shard_spec>> want;
  for (std::uint64_t i = 0; i < 3; ++i)
    for (std::uint64_t k = 0; k < 4; ++k) {
      const std::uint64_t b = std::min<std::uint64_t>(5, 2 * i), e = std::min<std::uint64_t>(5, 2 * i + 2);
      want.emplace_back(5 + i + 3 * k, block_spec({e - b, 7, 1}, {b, 0, k}));
    }
  std::sort(want.begin(), want.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<std::uint64_t, shard_spec>> got;
  for_each_part(g, full, [&](std::uint64_t r, const shard_spec& s) { got.emplace_back(r, s); });
  CHECK(got == want);
  CHECK(expand(g, full) == want);
  tensor_metadata tm{full, dtype::U8, true, {}, g};
  std::vector<std::string> first;
  tm.for_each_file([&](const std::string& f, const shard_spec&) {
    first.push_back(f);
    return first.size() < 3;  // stops early
  });
  CHECK(first == std::vector<std::string>{"rank_5.safetensors", "rank_6.safetensors", "rank_7.safetensors"});
  // a million parts: counted through, never listed; the n-th part in rank order is rank base + n
  const shard_grid big{true, {1}, {std::uint64_t(1) << 20}, 3, {1}};
  const shape_t n{std::uint64_t(1) << 20};
  validate(big, n, "big");
  std::uint64_t count = 0;
  bool ordered = true;
  for_each_part(big, n, [&](std::uint64_t r, const shard_spec& s) {
    ordered = ordered && r == 3 + count && s == shard_spec(flat_spec{{count, count + 1}});
    ++count;
  });
  CHECK(ordered);
  CHECK(count == (std::uint64_t(1) << 20));
}

TEST_CASE("metadata: the legacy flattened_offsets_per_file, unknown keys, is_sharded default") {
  const auto md = parse_checkpoint_metadata(
      R"({"version": 3, "other": {"tensors": 1}, "tensors": {
           "b": {"shape": [6], "dtype": "F32", "is_sharded": true,
                 "flattened_offsets_per_file": {"rank_0.safetensors": [0, 4], "rank_1.safetensors": [[4, 5], [5, 6]]}},
           "c": {"shape": [2], "dtype": "U8", "shard_spec_per_file": {"rank_0.safetensors":
                 {"flattened_offsets": [[0, 2]]}}}},
          "shardsafe": {"writer": "w", "world_size": 2, "file_sizes": {"rank_0.safetensors": 9, "bad": -1},
                        "future": [1, 2]}})",
      "legacy.json");
  REQUIRE(md.tensors.size() == 2);
  const auto& b = *md.find("b");
  REQUIRE(b.files.size() == 2);
  CHECK(b.files[0].first == "rank_0.safetensors");
  CHECK(b.files[0].second == shard_spec(flat_spec{{0, 4}}));
  CHECK(b.files[1].second == shard_spec(flat_spec{{4, 5}, {5, 6}}));
  CHECK(b.is_sharded);
  CHECK_FALSE(md.find("c")->is_sharded);
  CHECK(md.extras.writer == "w");
  CHECK(md.extras.world_size == std::optional<std::uint64_t>(2));
  CHECK(md.extras.file_sizes == std::map<std::string, std::uint64_t>{{"rank_0.safetensors", 9}});
  // an unknown shape of "shardsafe" is ignored, as another reader would
  const auto md2 = parse_checkpoint_metadata(R"({"tensors": {}, "shardsafe": [1]})", "m");
  CHECK(md2.tensors.empty());
  CHECK(md2.extras.writer.empty());
}

namespace {
std::string repeated_text(std::string_view s, std::size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (std::size_t i = 0; i < n; ++i) out += s;
  return out;
}
}  // namespace

TEST_CASE("metadata: nesting is accepted exactly as deep as simdjson's DOM parser accepts it") {
  // metadata.json is read On-Demand (no DOM); the DOM parser is the oracle for what is JSON
  for (std::size_t depth = 1020; depth <= 1028; ++depth) {
    const std::string text =
        R"({"tensors": {}, "x": )" + std::string(depth - 1, '[') + std::string(depth - 1, ']') + "}";
    simdjson::dom::parser dom;
    simdjson::dom::element root;
    const bool dom_ok = !dom.parse(text).get(root);
    bool ok = true;
    try {
      (void)parse_checkpoint_metadata(text, "m");
    } catch (const shardsafe::error& e) {
      ok = false;
      CHECK(e.code() == make_error_code(errc::invalid_json));
    }
    CAPTURE(depth);
    CHECK(ok == dom_ok);
  }
}

TEST_CASE("metadata: malformed files give the right errc and name file, tensor and rule") {
  struct bad {
    std::string what;
    std::string json;
    errc code;
    std::vector<std::string> phrases;
  };
  const std::string r0 = flat("rank_0.safetensors", "[[0, 6]]");
  const std::vector<bad> cases = {
      {"non-JSON", R"({"tensors": {"w": )", errc::invalid_json, {"not valid JSON"}},
      {"nested 100,000 deep",
       R"({"tensors": {}, "x": )" + std::string(100000, '[') + std::string(100000, ']') + "}",
       errc::invalid_json,
       {"not valid JSON", "too deep"}},
      {"objects nested 100,000 deep",
       R"({"tensors": {}, "x": )" + repeated_text(R"({"a": )", 100000) + "1" + std::string(100000, '}') + "}",
       errc::invalid_json,
       {"not valid JSON", "too deep"}},
      {"trailing content", R"({"tensors": {}} x)", errc::invalid_json, {"not valid JSON", "trailing"}},
      {"a second document", R"({"tensors": {}}{"tensors": {}})", errc::invalid_json, {"not valid JSON"}},
      {"a bad literal in an unknown key", R"({"tensors": {}, "x": [tru]})", errc::invalid_json, {"not valid JSON"}},
      {"a bad escape in an unknown key", R"({"tensors": {}, "x": "\q"})", errc::invalid_json, {"not valid JSON"}},
      {"non-UTF-8", "{\"tensors\": {\"w\xfe\": 1}}", errc::invalid_json, {"not valid UTF-8"}},
      {"integer past 2^64",
       R"({"tensors": {"w": {"shape": [2, 36893488147419103232]}}})",
       errc::invalid_json,
       {"not valid JSON", "36893488147419103232", "(tensors.w.shape[1])"}},
      {"not an object", "[1]", errc::invalid_metadata, {"not a JSON object"}},
      {"missing tensors", R"({"tensor": {}})", errc::invalid_metadata, {"missing \"tensors\""}},
      {"tensors not an object", R"({"tensors": []})", errc::invalid_metadata, {"\"tensors\" is not an object"}},
      {"entry not an object", R"({"tensors": {"w": 1}})", errc::invalid_metadata, {"tensor 'w'", "not an object"}},
      {"missing shape",
       R"({"tensors": {"w": {"dtype": "F32", "shard_spec_per_file": {}}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "missing \"shape\""}},
      {"negative shape", one_tensor(r0, "[-6]"), errc::invalid_metadata, {"tensor 'w'", "shape[0]", "negative"}},
      {"shape overflow",
       one_tensor(r0, "[4294967296, 4294967296]"),
       errc::invalid_metadata,
       {"tensor 'w'", "more than 2^64 elements"}},
      {"bad dtype", one_tensor(r0, "[6]", "\"F33\""), errc::unknown_dtype, {"tensor 'w'", "unknown dtype 'F33'"}},
      {"dtype not a string",
       one_tensor(r0, "[6]", "32"),
       errc::invalid_metadata,
       {"tensor 'w'", "dtype is not a string"}},
      {"missing dtype",
       R"({"tensors": {"w": {"shape": [6], "shard_spec_per_file": {}}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "missing \"dtype\""}},
      {"is_sharded not a boolean",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", "is_sharded": 1, )"
       R"("shard_spec_per_file": {}}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "is_sharded is not a boolean"}},
      {"missing specs",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32"}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "missing \"shard_spec_per_file\""}},
      {"specs not an object",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", "shard_spec_per_file": []}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "shard_spec_per_file is not an object"}},
      {"spec not an object",
       one_tensor(R"("rank_0.safetensors": [0, 6])"),
       errc::invalid_metadata,
       {"tensor 'w'", "file 'rank_0.safetensors'", "shard spec is not an object"}},
      {"flat range out of bounds",
       one_tensor(flat("rank_0.safetensors", "[[0, 7]]")),
       errc::invalid_spec,
       {"tensor 'w'", "file 'rank_0.safetensors'", "flattened_offsets[0] [0, 7)", "out of bounds for shape [6]"}},
      {"flat range reversed",
       one_tensor(flat("rank_1.safetensors", "[[0, 1], [5, 3]]")),
       errc::invalid_spec,
       {"tensor 'w'", "file 'rank_1.safetensors'", "flattened_offsets[1]", "ends before it begins"}},
      {"flat ranges overlap",
       one_tensor(flat("rank_0.safetensors", "[[0, 4], [3, 5]]")),
       errc::invalid_spec,
       {"tensor 'w'", "overlaps"}},
      {"flat range not a pair",
       one_tensor(flat("rank_0.safetensors", "[[0, 4, 5]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "flattened_offsets[0] is not a [start, end] pair"}},
      {"flat offsets not a list",
       one_tensor(flat("rank_0.safetensors", "7")),
       errc::invalid_metadata,
       {"tensor 'w'", "flattened_offsets is not a list"}},
      {"block out of bounds",
       one_tensor(R"("rank_3.safetensors": {"flattened_offsets": null, "local_shape": [8, 8], )"
                  R"("global_offset": [9, 0]})",
                  "[16, 8]"),
       errc::invalid_spec,
       {"tensor 'w'", "file 'rank_3.safetensors'", "passes the end of dimension 0 of shape [16,8]"}},
      {"block 3-D out of bounds",
       one_tensor(R"("r.safetensors": {"local_shape": [1, 2, 3], "global_offset": [0, 0, 3]})", "[2, 2, 5]"),
       errc::invalid_spec,
       {"tensor 'w'", "dimension 2"}},
      {"block wrong rank",
       one_tensor(R"("r.safetensors": {"local_shape": [8], "global_offset": [0]})", "[16, 8]"),
       errc::invalid_spec,
       {"tensor 'w'", "file 'r.safetensors'", "2 dimensions"}},
      {"both spec forms",
       one_tensor(R"("r.safetensors": {"flattened_offsets": [[0, 6]], "local_shape": [6], )"
                  R"("global_offset": [0]})"),
       errc::invalid_metadata,
       {"tensor 'w'", "file 'r.safetensors'", "both flattened_offsets and local_shape"}},
      {"neither spec form",
       one_tensor(R"("r.safetensors": {"flattened_offsets": null, "local_shape": [6], )"
                  R"("global_offset": null})"),
       errc::invalid_metadata,
       {"tensor 'w'", "file 'r.safetensors'", "neither"}},
      {"file name with /",
       one_tensor(flat("sub/rank_0.safetensors", "[[0, 6]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "file 'sub/rank_0.safetensors'", "not a plain file name"}},
      {"file name with ..",
       one_tensor(flat("..", "[[0, 6]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "file '..'", "not a plain file name"}},
      {"file name with ../",
       one_tensor(flat("../rank_0.safetensors", "[[0, 6]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "not a plain file name"}},
      {"file name with \\",
       one_tensor(flat("a\\\\rank_0.safetensors", "[[0, 6]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "file 'a\\rank_0.safetensors'", "not a plain file name"}},
      {"empty file name",
       one_tensor(flat("", "[[0, 6]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "not a plain file name"}},
      {"duplicate file",
       one_tensor(flat("r.safetensors", "[[0, 3]]") + ", " + flat("r.safetensors", "[[3, 6]]")),
       errc::invalid_metadata,
       {"tensor 'w'", "file 'r.safetensors' is listed twice"}},
      {"duplicate tensor",
       R"({"tensors": {"w": {"shape": [1], "dtype": "U8", "shard_spec_per_file": {}}, )"
       R"("w": {"shape": [1], "dtype": "U8", "shard_spec_per_file": {}}}})",
       errc::invalid_metadata,
       {"tensor 'w' is listed twice"}},
      {"legacy entry not a pair",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", )"
       R"("flattened_offsets_per_file": {"r.safetensors": [0, 1, 2]}}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "file 'r.safetensors'", "not [start, end]"}},
      {"legacy range out of bounds",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", )"
       R"("flattened_offsets_per_file": {"r.safetensors": [[0, 3], [3, 9]]}}}})",
       errc::invalid_spec,
       {"tensor 'w'", "file 'r.safetensors'", "out of bounds"}},
      {"legacy not an object",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", )"
       R"("flattened_offsets_per_file": [[0, 6]]}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "flattened_offsets_per_file is not an object"}},
      // the compact form's grid (shard/shard_grid.hpp)
      {"grid: two parts, one rank",
       grid_tensor("[6]", R"("flat": true, "chunks": [3], "parts": [2], "base": 0, "strides": [0])"),
       errc::invalid_metadata,
       {"tensor 'w'", "stride 0 gives two parts the same rank"}},
      {"grid: strides that repeat a rank",
       grid_tensor("[4, 6]", R"("flat": false, "chunks": [2, 3], "parts": [2, 2], "base": 0, "strides": [1, 1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "gives two parts the same rank"}},
      {"grid: pieces short of the tensor",
       grid_tensor("[6]", R"("flat": true, "chunks": [2], "parts": [2], "base": 0, "strides": [1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "do not cover its 6"}},
      {"grid: 2^34 parts",
       grid_tensor("[6]", R"("flat": true, "chunks": [1], "parts": [17179869184], "base": 0, "strides": [1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "more than 1048576 parts"}},
      {"grids: 2^26 parts together",
       [] {
         std::string t = R"({"tensors": {)";
         for (int i = 0; i < 65; ++i)
           t += std::string(i ? ", " : "") + "\"w" + std::to_string(i) +
                R"(": {"shape": [1048576], "is_sharded": true, "dtype": "U8", )" +
                R"("shardsafe_grid": {"flat": true, "chunks": [1], "parts": [1048576], "base": 0, "strides": [1]}})";
         return t + "}}";
       }(),
       errc::invalid_metadata,
       {"tensor 'w64'", "more than 67108864 parts together"}},
      {"grid: ranks past 2^31",
       grid_tensor("[6]", R"("flat": true, "chunks": [3], "parts": [2], "base": 2147483647, "strides": [1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "ranks past 2147483647"}},
      {"grid: a stride overflowing",
       grid_tensor("[6]", R"("flat": true, "chunks": [3], "parts": [2], "base": 0, "strides": [18446744073709551615])"),
       errc::invalid_metadata,
       {"tensor 'w'", "ranks past"}},
      {"grid: chunks of 0",
       grid_tensor("[6]", R"("flat": true, "chunks": [0], "parts": [2], "base": 0, "strides": [1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "chunks of 0 elements"}},
      {"grid: dimensions miscounted",
       grid_tensor("[2, 3]", R"("flat": false, "chunks": [1], "parts": [2], "base": 0, "strides": [1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "for 2 dimensions"}},
      {"grid: missing base",
       grid_tensor("[6]", R"("flat": true, "chunks": [3], "parts": [2], "strides": [1])"),
       errc::invalid_metadata,
       {"tensor 'w'", "missing \"base\""}},
      {"grid: not sharded",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", "shardsafe_grid": )"
       R"({"flat": true, "chunks": [3], "parts": [2], "base": 0, "strides": [1]}}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "not sharded"}},
      {"grid and files both",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F32", "is_sharded": true, "shardsafe_grid": )"
       R"({"flat": true, "chunks": [3], "parts": [2], "base": 0, "strides": [1]}, )"
       R"("shard_spec_per_file": {}}}})",
       errc::invalid_metadata,
       {"tensor 'w'", "both shardsafe_grid and a list of files"}},
      {"grid of a sub-byte dtype",
       R"({"tensors": {"w": {"shape": [6], "dtype": "F4", "is_sharded": true, "shardsafe_grid": )"
       R"({"flat": true, "chunks": [3], "parts": [2], "base": 0, "strides": [1]}}}})",
       errc::unsupported_dtype,
       {"tensor 'w'", "sub-byte dtype F4"}},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    auto phrases = c.phrases;
    phrases.push_back("ckpt/metadata.json");
    expect_error([&] { parse_checkpoint_metadata(c.json, "ckpt/metadata.json"); }, c.code, phrases);
  }
}

TEST_CASE("hf_index: exact text, round trip, total_size and other metadata") {
  hf_index idx;
  idx.total_size = 123;
  idx.metadata["format"] = "pt";
  idx.weight_map["b.x"] = "model-00002-of-00002.safetensors";
  idx.weight_map["a"] = "model-00001-of-00002.safetensors";
  // json.dumps(obj, indent=2, sort_keys=True) + "\n", checked once against Python 3
  const std::string expected =
      "{\n  \"metadata\": {\n    \"format\": \"pt\",\n    \"total_size\": 123\n  },\n  \"weight_map\": {\n"
      "    \"a\": \"model-00001-of-00002.safetensors\",\n    \"b.x\": \"model-00002-of-00002.safetensors\"\n  }\n}\n";
  CHECK(write_hf_index(idx) == expected);
  CHECK(write_hf_index(hf_index{}) == "{\n  \"metadata\": {},\n  \"weight_map\": {}\n}\n");
  const hf_index back = parse_hf_index(expected, "model.safetensors.index.json");
  CHECK(back.total_size == std::optional<std::uint64_t>(123));
  CHECK(back.metadata == idx.metadata);
  CHECK(back.weight_map == idx.weight_map);
  CHECK(back.files() ==
        std::vector<std::string>{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});

  const hf_index loose = parse_hf_index(
      R"({"weight_map": {"x": "m.safetensors", "y": "m.safetensors", "z": "a.safetensors"}, "extra": 1})", "i");
  CHECK_FALSE(loose.total_size);
  CHECK(loose.files() == std::vector<std::string>{"a.safetensors", "m.safetensors"});
  const hf_index nulls = parse_hf_index(R"({"metadata": null, "weight_map": {}})", "i");
  CHECK(nulls.weight_map.empty());
  const hf_index mixed = parse_hf_index(R"({"metadata": {"total_size": 0, "n": 5, "s": "t"}, "weight_map": {}})", "i");
  CHECK(mixed.total_size == std::optional<std::uint64_t>(0));
  CHECK(mixed.metadata == std::map<std::string, std::string>{{"s", "t"}});
  // the totals are advisory: what older transformers wrote (a bool as 1/8 byte: 1089.5) and other
  // values that are not counts are left unread, as transformers leaves them
  for (const char* v : {"1089.5", "-5", "\"10\"", "null", "[]"}) {
    INFO(v);
    const hf_index odd =
        parse_hf_index(std::string(R"({"metadata": {"total_size": )") + v + R"(, "total_parameters": )" + v +
                           R"(}, "weight_map": {"w": "a.safetensors"}})",
                       "i");
    CHECK_FALSE(odd.total_size);
    CHECK_FALSE(odd.total_parameters);
    CHECK(odd.weight_map.size() == 1u);
  }
}

TEST_CASE("hf_index: malformed indexes") {
  struct bad {
    std::string json;
    std::vector<std::string> phrases;
    errc code = errc::invalid_metadata;
  };
  const std::vector<bad> cases = {
      {R"({"weight_map": {"w": "sub/model.safetensors"}})",
       {"tensor 'w'", "'sub/model.safetensors'", "not a plain name"}},
      {R"({"weight_map": {"w": "/abs.safetensors"}})", {"tensor 'w'", "not a plain name"}},
      {R"({"weight_map": {"w": "a\\b.safetensors"}})", {"tensor 'w'", "'a\\b.safetensors'", "not a plain name"}},
      {R"({"weight_map": {"w": "..model.safetensors"}})", {"tensor 'w'", "not a plain name"}},
      {R"({"weight_map": {"w": ".."}})", {"tensor 'w'", "not a plain name"}},
      {R"({"weight_map": {"w": ""}})", {"tensor 'w'", "not a plain name"}},
      {R"({"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}})", {"tensor 'w' is listed twice"}},
      {R"({"weight_map": {"w": 3}})", {"tensor 'w'", "not a file name string"}},
      {R"({"metadata": [], "weight_map": {}})", {"\"metadata\" is not an object"}},
      {R"({"metadata": {}})", {"missing \"weight_map\""}},
      {R"({"weight_map": []})", {"\"weight_map\" is not an object"}},
      {R"([])", {"not a JSON object"}},
      {R"({"weight_map": {)", {"not valid JSON"}, errc::invalid_json},
  };
  for (const auto& c : cases) {
    INFO(c.json);
    auto phrases = c.phrases;
    phrases.push_back("hf/model.safetensors.index.json");
    expect_error([&] { parse_hf_index(c.json, "hf/model.safetensors.index.json"); }, c.code, phrases);
  }
}

TEST_CASE("metadata: the On-Demand reading refuses exactly what simdjson's DOM parser refuses, over mutated texts") {
  // simdjson's On-Demand API, even reading every value, let `{"a": {}, "b": "x": 1}}` through
  // (a ':' where a ',' belongs, then a '}' too many): found by fuzz_metadata. Every text below is
  // a valid metadata.json with one structural byte deleted, inserted, doubled or replaced; the
  // DOM parser (the independent judge) and the On-Demand reading must agree on each.
  const std::string good =
      R"({"tensors": {"w": {"shape": [4, 3], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": )"
      R"({"rank_0.safetensors": {"flattened_offsets": [[0, 6]], "local_shape": null, "global_offset": null}, )"
      R"("rank_1.safetensors": {"flattened_offsets": [[6, 12]], "local_shape": null, "global_offset": null}}}}, )"
      R"("shardsafe": {"writer": "x\"y", "world_size": 2, "file_sizes": {"rank_0.safetensors": 100}}})";
  const std::string structural = "{}[],:\"";
  std::size_t texts = 0, refused = 0;
  auto judge = [&](const std::string& text) {
    ++texts;
    simdjson::dom::parser dom;
    simdjson::dom::element root;
    const bool dom_ok = !dom.parse(text.data(), text.size(), true).get(root) && root.is_object();
    bool json_refused = false;
    try {
      parse_checkpoint_metadata(text, "metadata.json");
    } catch (const shardsafe::error& e) {
      json_refused = e.code() == make_error_code(errc::invalid_json);
    }
    INFO(text);
    CHECK(json_refused == !dom_ok);
    refused += json_refused;
  };
  judge(good);
  for (std::size_t i = 0; i <= good.size(); ++i) {
    if (i < good.size() && structural.find(good[i]) != std::string::npos) {
      judge(good.substr(0, i) + good.substr(i + 1));                                // deleted
      judge(good.substr(0, i + 1) + good.substr(i));                                // doubled
      for (char c : structural) judge(good.substr(0, i) + c + good.substr(i + 1));  // replaced
    }
    for (char c : std::string("}],:")) judge(good.substr(0, i) + c + good.substr(i));  // inserted
  }
  judge(R"({"tensors": {}, "shardsafe": "x": 1}})");  // the finding itself
  MESSAGE(texts << " texts judged, " << refused << " refused as invalid JSON by both readings");
  CHECK(refused > texts / 2);
}
