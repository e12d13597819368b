// Tests of the shardsafe command-line tool (docs/FORMAT.md §4), run as a separate process with its
// stdout and stderr captured to files. Expected digests are computed here with OpenSSL.
#include "shardsafe/core/error.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <fcntl.h>
#include <openssl/sha.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "malformed_corpus.hpp"

namespace fs = std::filesystem;

namespace {

using testing::temp_dir;
using testing::slurp;
using testing::write_file;
using result = testing::program_result;

bool have_tool() { return std::string_view(SHARDSAFE_TOOL).size() > 0 && fs::exists(SHARDSAFE_TOOL); }

/// Runs SHARDSAFE_TOOL with args (no shell), stdout and stderr captured.
result run_tool(const std::vector<std::string>& args) { return testing::run_program(SHARDSAFE_TOOL, args); }

/// The tool failed as docs/FORMAT.md §4 asks: exit 1 (not a signal), one line on stderr with the phrases.
void check_fails(const result& r, const std::vector<std::string>& phrases) {
  CHECK(r.exited);
  CHECK(r.code == 1);
  CHECK(r.out.empty());
  REQUIRE_MESSAGE(!r.err.empty(), "no message on stderr");
  CHECK_MESSAGE(std::count(r.err.begin(), r.err.end(), '\n') == 1, "stderr is not one line: ", r.err);
  CHECK(r.err.back() == '\n');
  for (const auto& p : phrases) CHECK_MESSAGE(r.err.find(p) != std::string::npos, r.err, " lacks ", p);
}

using testing::sha256_hex;

struct tensor {
  std::string name, dtype;
  std::vector<std::uint64_t> shape;
  std::string bytes;
};

std::string shape_text(const std::vector<std::uint64_t>& s, const char* sep) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? sep : "") + std::to_string(s[i]);
  return r + "]";
}

/// A safetensors file laid out by hand: tensors in the given order, header padded to 8.
std::string build_file(const std::vector<tensor>& ts) {
  std::string json = "{", data;
  for (const auto& t : ts) {
    if (json.size() > 1) json += ',';
    json += corpus::entry(t.name, t.dtype, shape_text(t.shape, ","),
                          "[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) + "]");
    data += t.bytes;
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');
  return corpus::file_bytes(json, data);
}

/// The digest docs/FORMAT.md §4 specifies, computed independently.
std::string expected_digest(std::vector<tensor> ts, const std::string& prefix = "") {
  std::sort(ts.begin(), ts.end(), [](const tensor& a, const tensor& b) { return a.name < b.name; });
  std::string out;
  for (const auto& t : ts) out += prefix + t.name + " " + t.dtype + " " + shape_text(t.shape, ",") + " " + sha256_hex(t.bytes) + "\n";
  return out;
}

std::string random_string(std::size_t n, std::mt19937_64& rng) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

std::vector<tensor> sample_tensors() {
  std::mt19937_64 rng(99);
  return {
      {"layer.0.weight", "F32", {3, 4}, random_string(48, rng)},
      {"layer.0.bias", "F32", {4}, random_string(16, rng)},
      {"embed", "BF16", {5, 2}, random_string(20, rng)},
      {"scalar", "I64", {}, random_string(8, rng)},
      {"empty", "F16", {0, 3}, ""},
      {"flags", "BOOL", {3}, std::string("\x01\x00\x01", 3)},
      {"q4", "F4", {4}, random_string(2, rng)},
  };
}

const char* const file1 = "model-00001-of-00002.safetensors";
const char* const file2 = "model-00002-of-00002.safetensors";

/// An indexed HF folder: tensors split over two files, index text from `index` (or correct).
void make_indexed(const fs::path& dir, const std::vector<tensor>& ts, const std::string& index = "") {
  fs::create_directories(dir);
  std::vector<tensor> a, b;
  std::uint64_t total = 0;
  std::string map;
  for (const auto& t : ts) {
    (t.name < "l" ? a : b).push_back(t);
    total += t.bytes.size();
    map += std::string(map.empty() ? "" : ", ") + "\"" + t.name + "\": \"" + (t.name < "l" ? file1 : file2) + "\"";
  }
  write_file(dir / file1, build_file(a));
  write_file(dir / file2, build_file(b));
  write_file(dir / "model.safetensors.index.json",
             index.empty() ? "{\"metadata\": {\"total_size\": " + std::to_string(total) + "}, \"weight_map\": {" + map + "}}"
                           : index);
}

}  // namespace

TEST_CASE("tool: every malformed safetensors file fails verify, inspect and digest with one line") {
  if (!have_tool()) {
    MESSAGE("the shardsafe tool is not built; skipped");
    return;
  }
  temp_dir tmp;
  for (const auto& c : corpus::malformed()) {
    INFO("case " << c.name);
    const fs::path p = tmp.path / c.name;
    write_file(p, c.bytes);
    auto phrases = c.phrases;
    phrases.push_back(p.string());
    const result v = run_tool({"verify", p.string()});
    check_fails(v, phrases);
    if (c.name == "name_newline.safetensors") CHECK(v.err.find("tensor 'a\\nb'") != std::string::npos);
    check_fails(run_tool({"inspect", p.string()}), {p.string()});
    check_fails(run_tool({"digest", p.string()}), {p.string()});
  }
  for (const auto& c : corpus::valid_edges()) {
    INFO("case " << c.name);
    const fs::path p = tmp.path / c.name;
    write_file(p, c.bytes);
    const result r = run_tool({"verify", p.string()});
    CHECK(r.exited);
    CHECK(r.code == 0);
    CHECK(r.out == "OK " + p.string() + ": " + std::to_string(c.tensors) + " tensors valid\n");
    CHECK(run_tool({"digest", p.string()}).code == 0);
  }
}

TEST_CASE("tool: usage errors and missing paths") {
  if (!have_tool()) return;
  temp_dir tmp;
  const result none = run_tool({});
  CHECK(none.exited);
  CHECK(none.code == 2);
  CHECK(run_tool({"frobnicate", "x"}).code == 2);
  check_fails(run_tool({"verify", (tmp.path / "absent").string()}), {(tmp.path / "absent").string()});
  check_fails(run_tool({"verify", tmp.path.string()}), {tmp.path.string(), "model.safetensors"});
}

TEST_CASE("tool: a valid file, a Hugging Face folder and an indexed one agree on the digest") {
  if (!have_tool()) return;
  temp_dir tmp;
  const auto ts = sample_tensors();
  const std::string want = expected_digest(ts);
  const fs::path single = tmp.path / "one.safetensors";
  write_file(single, build_file(ts));

  const result v = run_tool({"verify", single.string()});
  CHECK(v.code == 0);
  CHECK(v.out == "OK " + single.string() + ": 7 tensors valid\n");
  CHECK(v.err.empty());
  const result d = run_tool({"digest", single.string()});
  CHECK(d.exited);
  CHECK(d.code == 0);
  CHECK(d.out == want);
  const result i = run_tool({"inspect", single.string()});
  CHECK(i.code == 0);
  for (const auto& t : ts) CHECK(i.out.find(t.name) != std::string::npos);

  const fs::path hf = tmp.path / "hf";
  fs::create_directories(hf);
  write_file(hf / "model.safetensors", build_file(ts));
  CHECK(run_tool({"verify", hf.string()}).code == 0);
  CHECK(run_tool({"digest", hf.string()}).out == want);
  CHECK(run_tool({"inspect", hf.string()}).code == 0);

  const fs::path idx = tmp.path / "hf-indexed";
  make_indexed(idx, ts);
  const result iv = run_tool({"verify", idx.string()});
  CHECK(iv.code == 0);
  CHECK(iv.out == "OK " + idx.string() + ": 7 tensors valid\n");
  const result id = run_tool({"digest", idx.string()});
  CHECK(id.code == 0);
  CHECK(id.out == want);
  const result ii = run_tool({"inspect", idx.string()});
  CHECK(ii.code == 0);
  CHECK(ii.out.find(file1) != std::string::npos);
  CHECK(ii.out.find(file2) != std::string::npos);
}

TEST_CASE("tool: bad Hugging Face indexes fail verify") {
  if (!have_tool()) return;
  temp_dir tmp;
  const auto ts = sample_tensors();
  std::uint64_t total = 0;
  for (const auto& t : ts) total += t.bytes.size();
  // the correct weight map, with one entry changed or added
  auto index = [&](std::string_view change_name, std::string value, std::string extra = "",
                   std::uint64_t size = 0) {
    std::string map;
    for (const auto& t : ts) {
      std::string v = "\"" + std::string(t.name < "l" ? file1 : file2) + "\"";
      if (t.name == change_name) {
        if (value.empty()) continue;
        v = value;
      }
      map += std::string(map.empty() ? "" : ", ") + "\"" + t.name + "\": " + v;
    }
    return "{\"metadata\": {\"total_size\": " + std::to_string(size ? size : total) + "}, \"weight_map\": {" + map +
           extra + "}}";
  };
  struct bad {
    std::string what, index;
    std::vector<std::string> phrases;
  };
  const std::vector<bad> cases = {
      {"slash", index("embed", "\"sub/model-00001-of-00002.safetensors\""), {"tensor 'embed'", "not a plain name"}},
      {"dotdot", index("embed", "\"../model-00001-of-00002.safetensors\""), {"tensor 'embed'", "not a plain name"}},
      {"backslash", index("embed", "\"a\\\\b.safetensors\""), {"tensor 'embed'", "not a plain name"}},
      {"missing file", index("", "", ", \"extra\": \"model-00003-of-00003.safetensors\""),
       {"model-00003-of-00003.safetensors", "missing"}},
      {"listed but absent", index("", "", ", \"ghost\": \"model-00001-of-00002.safetensors\""),
       {file1, "tensor 'ghost'", "absent"}},
      {"not listed", index("flags", "", "", total - 3), {file1, "tensor 'flags'", "not listed"}},
      {"wrong file", index("flags", "\"" + std::string(file2) + "\""), {file2, "tensor 'flags'", "absent"}},
      {"wrong total_size", index("", "", "", total + 1), {"model.safetensors.index.json", "total_size"}},
      {"not JSON", "{\"weight_map\": ", {"model.safetensors.index.json", "not valid JSON"}},
      {"duplicate tensor", index("", "", ", \"embed\": \"" + std::string(file1) + "\""), {"tensor 'embed'", "twice"}},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const fs::path dir = tmp.path / ("bad-" + std::to_string(&c - cases.data()));
    make_indexed(dir, ts, c.index);
    check_fails(run_tool({"verify", dir.string()}), c.phrases);
    check_fails(run_tool({"digest", dir.string()}), {});
  }
  // a shard file that is itself malformed
  const fs::path dir = tmp.path / "bad-shard";
  make_indexed(dir, ts);
  std::string bytes = slurp(dir / file2);
  bytes.pop_back();
  write_file(dir / file2, bytes);
  check_fails(run_tool({"verify", dir.string()}), {(dir / file2).string(), "truncated"});
  // a tensor in two files, the index naming one of them
  const fs::path twice = tmp.path / "in-two-files";
  make_indexed(twice, ts);
  std::vector<tensor> second;
  for (const auto& t : ts)
    if (t.name >= "l" || t.name == "flags") second.push_back(t);
  write_file(twice / file2, build_file(second));
  check_fails(run_tool({"verify", twice.string()}), {(twice / file2).string(), "tensor 'flags'", "places it in", file1});
}

TEST_CASE("tool: a sharded checkpoint unshards to the digest of its full tensors") {
  if (!have_tool()) return;
  temp_dir tmp;
  std::mt19937_64 rng(5);
  // w: F32 [4,3] in row blocks; b: I16 [5] by flattened offsets; c: U8 [2,2,4] in column blocks
  const tensor w{"w", "F32", {4, 3}, random_string(48, rng)};
  const tensor b{"b", "I16", {5}, random_string(10, rng)};
  const tensor c{"c", "U8", {2, 2, 4}, random_string(16, rng)};
  auto cols = [&](std::size_t k0) {  // c[:, :, k0:k0+2], row-major
    std::string s;
    for (std::size_t ij = 0; ij < 4; ++ij) s += c.bytes.substr(ij * 4 + k0, 2);
    return s;
  };
  const std::string rank0 = build_file({{"w", "F32", {6}, w.bytes.substr(0, 24)},
                                        {"b", "I16", {2}, b.bytes.substr(0, 4)},
                                        {"c", "U8", {8}, cols(0)}});
  const std::string rank1 = build_file({{"w", "F32", {6}, w.bytes.substr(24)},
                                        {"b", "I16", {3}, b.bytes.substr(4)},
                                        {"c", "U8", {8}, cols(2)}});
  auto block = [](const char* file, const char* ls, const char* go) {
    return std::string("\"") + file + "\": {\"flattened_offsets\": null, \"local_shape\": " + ls +
           ", \"global_offset\": " + go + "}";
  };
  auto metadata = [&](bool complete) {
    return std::string("{\"tensors\": {\"w\": {\"shape\": [4, 3], \"is_sharded\": true, \"dtype\": \"F32\", ") +
           "\"shard_spec_per_file\": {" + block("rank_0.safetensors", "[2, 3]", "[0, 0]") +
           (complete ? ", " + block("rank_1.safetensors", "[2, 3]", "[2, 0]") : std::string()) + "}}, " +
           "\"b\": {\"shape\": [5], \"is_sharded\": true, \"dtype\": \"I16\", \"shard_spec_per_file\": {" +
           "\"rank_0.safetensors\": {\"flattened_offsets\": [[0, 2]], \"local_shape\": null, \"global_offset\": null}, " +
           "\"rank_1.safetensors\": {\"flattened_offsets\": [[2, 5]], \"local_shape\": null, \"global_offset\": null}}}, " +
           "\"c\": {\"shape\": [2, 2, 4], \"is_sharded\": true, \"dtype\": \"U8\", \"shard_spec_per_file\": {" +
           block("rank_0.safetensors", "[2, 2, 2]", "[0, 0, 0]") + ", " +
           block("rank_1.safetensors", "[2, 2, 2]", "[0, 0, 2]") + "}}}}";
  };
  auto make_ckpt = [&](const fs::path& dir, bool complete) {
    fs::create_directories(dir);
    write_file(dir / "rank_0.safetensors", rank0);
    write_file(dir / "rank_1.safetensors", rank1);
    write_file(dir / "metadata.json", metadata(complete));
  };
  const fs::path ck = tmp.path / "ckpt";
  make_ckpt(ck, true);
  const result v = run_tool({"verify", ck.string()});
  CHECK(v.code == 0);
  CHECK(v.err.empty());
  const result d = run_tool({"digest", ck.string()});
  CHECK(d.code == 0);
  CHECK(d.out == expected_digest({w, b, c}));
  CHECK(run_tool({"inspect", ck.string()}).code == 0);

  const fs::path pair = tmp.path / "pair";
  make_ckpt(pair / "model", true);
  const result pd = run_tool({"digest", pair.string()});
  CHECK(pd.code == 0);
  CHECK(pd.out == expected_digest({w, b, c}, "model/"));

  const fs::path holey = tmp.path / "holey";
  make_ckpt(holey, false);
  check_fails(run_tool({"verify", holey.string()}), {holey.string(), "tensor 'w'", "in no file"});

  const fs::path lost = tmp.path / "lost";
  make_ckpt(lost, true);
  fs::remove(lost / "rank_1.safetensors");
  check_fails(run_tool({"verify", lost.string()}), {"rank_1.safetensors", "missing"});
  check_fails(run_tool({"digest", lost.string()}), {"rank_1.safetensors"});
}
