// Tests of checkpoint/hf_folder.hpp and checkpoint/verify.hpp: Hugging Face folders and sharded
// checkpoints built by hand (tests/checkpoint_fixtures.hpp), valid and broken in every way the
// shardsafe tool reports, on the file and the memory backends.
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/checkpoint/hf_folder.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_fixtures.hpp"
#include "malformed_corpus.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "test_util.hpp"

using namespace shardsafe;
using fixtures::file1;
using fixtures::file2;
using fixtures::tensor;
using testing::expect_error;

namespace {

/// A fresh, empty root directory of backend D.
template <class D>
struct backend;

template <>
struct backend<file_directory> {
  testing::temp_dir tmp{"verify"};
  file_directory root() const { return file_directory(tmp.path); }
};

template <>
struct backend<memory_directory> {
  memory_directory dir;
  memory_directory root() const { return dir; }
};

/// "dir/name": how a backend names an object of dir in messages (file and memory agree).
template <class D>
std::string path_of(const D& dir, const std::string& name) {
  return std::string(dir.name()) + "/" + name;
}

/// The bytes of tensor `name` as the folder reads them: from its file, at its header offset.
template <class D>
std::string read_tensor(const hf_folder<D>& h, const std::string& name) {
  const hf_tensor_location at = h.tensors.at(name);
  const auto& f = h.files[at.file];
  const tensor_entry& e = h.entry(at);
  std::string out(static_cast<std::size_t>(e.nbytes()), '\0');
  f.storage.read_into(f.header.offset_of(e), std::as_writable_bytes(std::span(out)));
  return out;
}

/// The folder holds exactly the tensors ts, each in `file_for(t)`, with its dtype, shape and bytes.
template <class D, class FileFor>
void check_holds(const hf_folder<D>& h, const std::vector<tensor>& ts, FileFor file_for) {
  CHECK(h.tensors.size() == ts.size());
  for (const auto& t : ts) {
    INFO("tensor " << t.name);
    REQUIRE(h.tensors.count(t.name) == 1);
    const hf_tensor_location at = h.tensors.at(t.name);
    CHECK(h.files[at.file].name == file_for(t));
    const tensor_entry& e = h.entry(at);
    CHECK(e.name == t.name);
    CHECK(name(e.type) == t.dtype);
    CHECK(e.shape == t.shape);
    CHECK(read_tensor(h, t.name) == t.bytes);
  }
  CHECK(h.tensor_bytes() == fixtures::total_bytes(ts));
}

}  // namespace

TEST_CASE_TEMPLATE("hf_folder: model.safetensors alone opens with every tensor in place", D, file_directory,
                   memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("hf");
  const auto ts = fixtures::sample_tensors();
  CHECK_FALSE(is_hf_folder(dir));
  fixtures::put(dir, "model.safetensors", fixtures::build_file(ts));
  CHECK(is_hf_folder(dir));
  const hf_folder<D> h = open_hf_folder(dir);
  CHECK_FALSE(h.sharded());
  REQUIRE(h.files.size() == 1);
  CHECK(h.files[0].name == "model.safetensors");
  CHECK(h.files[0].header.file == path_of(dir, "model.safetensors"));
  check_holds(h, ts, [](const tensor&) { return std::string("model.safetensors"); });
}

TEST_CASE_TEMPLATE("hf_folder: an index and its two files open with every tensor where the index says", D,
                   file_directory, memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("hf-indexed");
  const auto ts = fixtures::sample_tensors();
  fixtures::make_indexed(dir, ts);
  CHECK(is_hf_folder(dir));
  const hf_folder<D> h = open_hf_folder(dir);
  REQUIRE(h.sharded());
  CHECK(h.index->total_size == fixtures::total_bytes(ts));
  CHECK(h.index->weight_map.size() == ts.size());
  REQUIRE(h.files.size() == 2);
  CHECK(h.files[0].name == file1);
  CHECK(h.files[1].name == file2);
  check_holds(h, ts, [](const tensor& t) { return std::string(fixtures::file_of(t)); });

  // the index wins over a model.safetensors beside it (as the tool has always read it)
  fixtures::put(dir, "model.safetensors", fixtures::build_file({ts[0]}));
  CHECK(open_hf_folder(dir).sharded());
  // an index without total_size is not checked against it
  std::string no_total_index = fixtures::index_text(ts);
  const auto md = no_total_index.find("\"metadata\""), wm = no_total_index.find("\"weight_map\"");
  REQUIRE(md < wm);
  no_total_index.erase(md, wm - md);
  fixtures::put(dir, "model.safetensors.index.json", no_total_index);
  const hf_folder<D> no_total = open_hf_folder(dir);
  CHECK_FALSE(no_total.index->total_size.has_value());
  CHECK(no_total.tensors.size() == ts.size());
}

TEST_CASE_TEMPLATE("hf_folder: a folder with neither an index nor model.safetensors", D, file_directory,
                   memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("empty");
  fixtures::put(dir, "other.safetensors", fixtures::build_file(fixtures::sample_tensors()));
  CHECK_FALSE(is_hf_folder(dir));
  expect_error([&] { open_hf_folder(dir); }, errc::not_found,
               {std::string(dir.name()), "model.safetensors.index.json", "model.safetensors"});
}

TEST_CASE_TEMPLATE("hf_folder: every bad index is refused with its code, file, tensor and rule", D, file_directory,
                   memory_directory) {
  backend<D> be;
  const auto ts = fixtures::sample_tensors();
  const auto cases = fixtures::bad_indexes(ts);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    INFO(c.what);
    const D dir = be.root().sub("bad-" + std::to_string(i));
    fixtures::make_indexed(dir, ts, c.index);
    expect_error([&] { open_hf_folder(dir); }, c.code, c.phrases);
  }
  // the missing file and the index are named by their paths in the folder
  REQUIRE(cases[3].what == "missing file");
  expect_error([&] { open_hf_folder(be.root().sub("bad-3")); }, errc::not_found,
               {path_of(be.root().sub("bad-3"), "model-00003-of-00003.safetensors") +
                ": listed in model.safetensors.index.json but missing"});
  REQUIRE(cases[7].what == "wrong total_size");
  expect_error([&] { open_hf_folder(be.root().sub("bad-7")); }, errc::invalid_metadata,
               {path_of(be.root().sub("bad-7"), "model.safetensors.index.json") + ": metadata.total_size is"});
}

TEST_CASE_TEMPLATE("hf_folder: a malformed shard file fails with the header's own error", D, file_directory,
                   memory_directory) {
  backend<D> be;
  const auto ts = fixtures::sample_tensors();
  const auto bad = corpus::malformed();
  for (std::size_t i = 0; i < bad.size(); ++i) {
    const auto& c = bad[i];
    INFO("case " << c.name);
    const D dir = be.root().sub("shard-" + std::to_string(i));
    fixtures::make_indexed(dir, ts);
    fixtures::put(dir, file2, c.bytes);
    auto phrases = c.phrases;
    phrases.push_back(path_of(dir, file2));
    expect_error([&] { open_hf_folder(dir); }, c.code, phrases);
    // the same file as model.safetensors of a folder without an index
    const D single = be.root().sub("single-" + std::to_string(i));
    fixtures::put(single, "model.safetensors", c.bytes);
    phrases.back() = path_of(single, "model.safetensors");
    expect_error([&] { open_hf_folder(single); }, c.code, phrases);
  }
}

TEST_CASE_TEMPLATE("hf_folder: a tensor in two files, the index naming one of them", D, file_directory,
                   memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("twice");
  const auto ts = fixtures::sample_tensors();
  fixtures::make_indexed(dir, ts);
  std::vector<tensor> second;
  for (const auto& t : ts)
    if (fixtures::file_of(t) == file2 || t.name == "flags") second.push_back(t);
  REQUIRE(std::count_if(ts.begin(), ts.end(), [](const tensor& t) { return fixtures::file_of(t) == file2; }) + 1 ==
          static_cast<std::ptrdiff_t>(second.size()));  // flags, of file1, joined file2's own
  fixtures::put(dir, file2, fixtures::build_file(second));
  expect_error([&] { open_hf_folder(dir); }, errc::invalid_metadata,
               {path_of(dir, file2) + ": tensor 'flags': the index places it in " + file1});
}

// ---------------------------------------------------------------------------------------
// sharded checkpoints

TEST_CASE_TEMPLATE("verify_checkpoint: a complete checkpoint reports its tensors, files and bytes", D,
                   file_directory, memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("ckpt");
  const fixtures::sharded_sample s;
  s.write(dir);
  const checkpoint_report rep = verify_checkpoint(dir);
  CHECK(rep.tensors == 3);
  CHECK(rep.files == 2);
  CHECK(rep.tensor_bytes == s.w.bytes.size() + s.b.bytes.size() + s.c.bytes.size());

  // the overload on an open reader reports the same and keeps the files open in it
  checkpoint_reader<D> r(dir);
  const checkpoint_report again = verify_checkpoint(r);
  CHECK(again.tensors == rep.tensors);
  CHECK(again.files == rep.files);
  CHECK(again.tensor_bytes == rep.tensor_bytes);

  // a file metadata.json records with its size but no tensor uses is checked and counted
  fixtures::put(dir, "rank_2.safetensors", fixtures::build_file({}));
  const std::string sizes = ", \"shardsafe\": {\"file_sizes\": {\"rank_0.safetensors\": " +
                            std::to_string(s.rank0.size()) + ", \"rank_2.safetensors\": " +
                            std::to_string(fixtures::build_file({}).size()) + "}}";
  fixtures::put(dir, "metadata.json", fixtures::sharded_sample::metadata(true, sizes));
  CHECK(verify_checkpoint(dir).files == 3);
}

TEST_CASE_TEMPLATE("verify_checkpoint: every broken checkpoint is refused with its code, file, tensor and rule", D,
                   file_directory, memory_directory) {
  backend<D> be;
  const fixtures::sharded_sample s;
  int n = 0;
  auto fresh = [&] {
    const D dir = be.root().sub("ckpt-" + std::to_string(n++));
    s.write(dir);
    return dir;
  };

  SUBCASE("no metadata.json") {
    const D dir = be.root().sub("no-metadata");
    fixtures::put(dir, "rank_0.safetensors", s.rank0);
    expect_error([&] { verify_checkpoint(dir); }, errc::not_found, {std::string(dir.name()), "no metadata.json"});
  }
  SUBCASE("metadata.json that is not JSON") {
    const D dir = fresh();
    fixtures::put(dir, "metadata.json", "{\"tensors\": ");
    expect_error([&] { verify_checkpoint(dir); }, errc::invalid_json, {path_of(dir, "metadata.json")});
  }
  SUBCASE("a hole: rank 1's rows of w are listed nowhere") {
    const D dir = be.root().sub("holey");
    s.write(dir, /*complete=*/false);
    // w is [4,3] and rank 0 holds rows 0 and 1: the gap is rows 2 and 3, elements [2*3, 4*3)
    const std::string gap = "elements [" + std::to_string(2 * 3) + ", " + std::to_string(4 * 3) + ")";
    expect_error([&] { verify_checkpoint(dir); }, errc::missing_coverage,
                 {std::string(dir.name()), "tensor 'w' [4,3]", gap, "(from index [2,0])", "in no file"});
  }
  SUBCASE("a rank file is missing") {
    const D dir = fresh();
    dir.remove("rank_1.safetensors");
    expect_error([&] { verify_checkpoint(dir); }, errc::not_found, {path_of(dir, "rank_1.safetensors"), "missing"});
  }
  SUBCASE("a rank file is truncated") {
    const D dir = fresh();
    fixtures::put(dir, "rank_1.safetensors", s.rank1.substr(0, s.rank1.size() - 1));
    expect_error([&] { verify_checkpoint(dir); }, errc::truncated, {path_of(dir, "rank_1.safetensors")});
  }
  SUBCASE("a rank file lacks a tensor metadata.json places in it") {
    const D dir = fresh();
    fixtures::put(dir, "rank_1.safetensors",
                  fixtures::build_file({{"w", "F32", {6}, s.w.bytes.substr(24)}, {"b", "I16", {3}, s.b.bytes.substr(4)}}));
    expect_error([&] { verify_checkpoint(dir); }, errc::not_found,
                 {path_of(dir, "rank_1.safetensors"), "tensor 'c'", "absent from the file"});
  }
  SUBCASE("metadata.json's dtype differs from the file's") {
    const D dir = fresh();
    std::string md = fixtures::sharded_sample::metadata(true);
    const auto at = md.find("\"I16\"");
    REQUIRE(at != std::string::npos);
    md.replace(at, 5, "\"F16\"");  // same item size: only the dtype rule can catch it
    fixtures::put(dir, "metadata.json", md);
    expect_error([&] { verify_checkpoint(dir); }, errc::dtype_mismatch,
                 {path_of(dir, "rank_0.safetensors"), "tensor 'b'", "I16", "F16"});
  }
  SUBCASE("a file holds more elements than its shard spec") {
    const D dir = fresh();
    std::string md = fixtures::sharded_sample::metadata(true);
    const auto at = md.find("[[2, 5]]");
    REQUIRE(at != std::string::npos);
    md.replace(at, 8, "[[2, 4]]");
    fixtures::put(dir, "metadata.json", md);
    expect_error([&] { verify_checkpoint(dir); }, errc::shape_mismatch,
                 {path_of(dir, "rank_1.safetensors"), "tensor 'b'", "holds 3 elements", "holds 2"});
  }
  SUBCASE("a recorded file size differs from the file's") {
    const D dir = fresh();
    fixtures::put(dir, "metadata.json",
                  fixtures::sharded_sample::metadata(
                      true, ", \"shardsafe\": {\"file_sizes\": {\"rank_1.safetensors\": " +
                                std::to_string(s.rank1.size() + 8) + "}}"));
    expect_error([&] { verify_checkpoint(dir); }, errc::truncated,
                 {path_of(dir, "rank_1.safetensors"), std::to_string(s.rank1.size()),
                  std::to_string(s.rank1.size() + 8), "recorded"});
  }
  SUBCASE("a file metadata.json records but no tensor uses is missing") {
    const D dir = fresh();
    fixtures::put(dir, "metadata.json",
                  fixtures::sharded_sample::metadata(true, ", \"shardsafe\": {\"file_sizes\": {\"rank_7.safetensors\": 80}}"));
    expect_error([&] { verify_checkpoint(dir); }, errc::not_found, {path_of(dir, "rank_7.safetensors"), "missing"});
  }
  SUBCASE("a sub-byte dtype sharded by elements") {
    const D dir = be.root().sub("f4");
    std::mt19937_64 rng(7);
    fixtures::put(dir, "rank_0.safetensors", fixtures::build_file({{"q", "F4", {4}, fixtures::random_string(2, rng)}}));
    fixtures::put(dir, "metadata.json",
                  "{\"tensors\": {\"q\": {\"shape\": [4], \"is_sharded\": true, \"dtype\": \"F4\", "
                  "\"shard_spec_per_file\": {\"rank_0.safetensors\": {\"flattened_offsets\": [[0, 4]], "
                  "\"local_shape\": null, \"global_offset\": null}}}}}");
    expect_error([&] { verify_checkpoint(dir); }, errc::unsupported_dtype,
                 {std::string(dir.name()), "tensor 'q'", "sub-byte dtype F4", "cannot be sharded"});
    // the same tensor not sharded is valid
    fixtures::put(dir, "metadata.json",
                  "{\"tensors\": {\"q\": {\"shape\": [4], \"is_sharded\": false, \"dtype\": \"F4\", "
                  "\"shard_spec_per_file\": {\"rank_0.safetensors\": {\"flattened_offsets\": null, "
                  "\"local_shape\": [4], \"global_offset\": [0]}}}}}");
    const checkpoint_report rep = verify_checkpoint(dir);
    CHECK(rep.tensors == 1);
    CHECK(rep.tensor_bytes == 2);
  }
}

TEST_CASE("hf_folder: a folder named with a trailing '/' names its objects with one '/'") {
  testing::temp_dir tmp("verify");
  const file_directory plain(tmp.path / "hf"), slashed(tmp.str() + "/hf/");
  const auto ts = fixtures::sample_tensors();
  fixtures::make_indexed(plain, ts, fixtures::index_text(ts, "", "", ", \"x\": \"model-00003-of-00003.safetensors\""));
  const std::string want = (tmp.path / "hf" / "model-00003-of-00003.safetensors").string() + ": listed in";
  expect_error([&] { open_hf_folder(plain); }, errc::not_found, {want});
  expect_error([&] { open_hf_folder(slashed); }, errc::not_found, {want});
  CHECK(std::string(slashed.name()).back() == '/');
}
