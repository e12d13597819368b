// Tests of the shardsafe command-line tool (docs/FORMAT.md §4), run as a separate process with its
// stdout and stderr captured to files. Expected digests are computed here with OpenSSL.
#include "shardsafe/core/error.hpp"

#include <doctest/doctest.h>

#include "support/test_util.hpp"

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
#include <regex>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "support/malformed_corpus.hpp"
#include "shardsafe/storage/file.hpp"
#include "../tools/sha256.hpp"

namespace fs = std::filesystem;

namespace {

using testing::slurp;
using testing::temp_dir;
using testing::write_file;
using result = testing::program_result;

using testing::have_tool;
using testing::run_tool;

/// The tool's tests are skipped, and counted as skipped in doctest's summary, when the tool
/// is not built (configured with -Dtools=false).
const auto skip_without_tool = doctest::skip(!have_tool());

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

using fixtures::build_file;
using fixtures::file1;
using fixtures::file2;
using fixtures::random_string;
using fixtures::sample_tensors;
using fixtures::shape_text;
using fixtures::tensor;
using testing::sha256_hex;

/// The digest docs/FORMAT.md §4 specifies, computed independently.
std::string expected_digest(std::vector<tensor> ts, const std::string& prefix = "") {
  std::sort(ts.begin(), ts.end(), [](const tensor& a, const tensor& b) { return a.name < b.name; });
  std::string out;
  for (const auto& t : ts)
    out += prefix + t.name + " " + t.dtype + " " + shape_text(t.shape, ",") + " " + sha256_hex(t.bytes) + "\n";
  return out;
}

/// An indexed HF folder on disk: tensors split over two files, index text from `index` (or correct).
void make_indexed(const fs::path& dir, const std::vector<tensor>& ts, const std::string& index = "") {
  fixtures::make_indexed(shardsafe::file_directory(dir), ts, index);
}

}  // namespace

TEST_CASE("tool: every malformed safetensors file fails verify, inspect and digest with one line" * skip_without_tool) {
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

/// A usage error as docs/FORMAT.md §4 asks: exit 2, nothing on stdout, one line on stderr with the phrases.
void check_usage_error(const result& r, const std::vector<std::string>& phrases) {
  CHECK(r.exited);
  CHECK(r.code == 2);
  CHECK(r.out.empty());
  CHECK_MESSAGE(std::count(r.err.begin(), r.err.end(), '\n') == 1, "stderr is not one line: ", r.err);
  for (const auto& p : phrases) CHECK_MESSAGE(r.err.find(p) != std::string::npos, r.err, " lacks ", p);
}

TEST_CASE("tool: usage errors and missing paths" * skip_without_tool) {
  temp_dir tmp;
  const result none = run_tool({});
  CHECK(none.exited);
  CHECK(none.code == 2);
  CHECK(run_tool({"frobnicate", "x"}).code == 2);
  check_usage_error(none, {"shardsafe --help"});
  check_usage_error(run_tool({"frobnicate", "x"}), {"unknown command 'frobnicate'"});
  check_usage_error(run_tool({"verify"}), {"PATH"});
  check_usage_error(run_tool({"verify", "a", "b"}), {"b"});
  check_usage_error(run_tool({"unshard", "a"}), {"OUT"});
  check_usage_error(run_tool({"inspect", "--frobnicate", "a"}), {"--frobnicate"});
  check_fails(run_tool({"verify", (tmp.path / "absent").string()}), {(tmp.path / "absent").string()});
  check_fails(run_tool({"verify", tmp.path.string()}), {tmp.path.string(), "model.safetensors"});
}

TEST_CASE("tool: --help and --version print on stdout and exit 0" * skip_without_tool) {
  for (const char* h : {"--help", "-h"}) {
    const result r = run_tool({h});
    CHECK(r.exited);
    CHECK(r.code == 0);
    CHECK(r.err.empty());
    for (const char* cmd : {"inspect", "verify", "digest", "unshard"})
      CHECK_MESSAGE(r.out.find(cmd) != std::string::npos, cmd);
  }
  for (const char* cmd : {"inspect", "verify", "digest", "unshard"}) {
    INFO(cmd);
    const result r = run_tool({cmd, "--help"});
    CHECK(r.code == 0);
    CHECK(r.err.empty());
    CHECK(r.out.find(std::string("shardsafe ") + cmd) != std::string::npos);
  }
  const result v = run_tool({"--version"});
  CHECK(v.code == 0);
  CHECK(v.err.empty());
  // "shardsafe MAJOR.MINOR.PATCH", one line
  CHECK_MESSAGE(std::regex_match(v.out, std::regex("shardsafe [0-9]+\\.[0-9]+\\.[0-9]+\n")), v.out);
}

TEST_CASE("tool: its SHA-256 agrees with the FIPS 180-2 vectors and with OpenSSL's one-shot digest, in any chunks") {
  // tools/sha256.hpp is the tool's own (the library installs no OpenSSL code); checked here
  // without running the tool.
  auto digest = [](std::string_view text, std::size_t chunk) {
    shardsafe::tool::sha256 h;
    for (std::size_t i = 0; i < text.size(); i += chunk)
      h.update(std::as_bytes(std::span(text.data() + i, std::min(chunk, text.size() - i))));
    return h.hex();
  };
  CHECK(digest("abc", 1) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(digest("", 1) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(digest("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", 5) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::mt19937_64 rng(3);
  const std::string big = random_string(100'003, rng);
  for (std::size_t chunk : {1u, 63u, 64u, 4096u, 100'003u}) CHECK(digest(big, chunk) == sha256_hex(big));
}

TEST_CASE("tool: a valid file, a Hugging Face folder and an indexed one agree on the digest" * skip_without_tool) {
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

TEST_CASE("tool: bad Hugging Face indexes fail verify" * skip_without_tool) {
  temp_dir tmp;
  const auto ts = sample_tensors();
  const std::vector<fixtures::bad_index> cases = fixtures::bad_indexes(ts);
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
  check_fails(run_tool({"verify", twice.string()}),
              {(twice / file2).string(), "tensor 'flags'", "places it in", file1});
}

TEST_CASE("tool: a sharded checkpoint unshards to the digest of its full tensors" * skip_without_tool) {
  temp_dir tmp;
  const fixtures::sharded_sample sample;
  const tensor &w = sample.w, &b = sample.b, &c = sample.c;
  auto make_ckpt = [&](const fs::path& dir, bool complete) { sample.write(shardsafe::file_directory(dir), complete); };
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
