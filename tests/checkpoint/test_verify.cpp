// Tests of checkpoint/hf/folder.hpp and checkpoint/verify.hpp: Hugging Face folders and sharded
// checkpoints built by hand (tests/support/checkpoint_fixtures.hpp), valid and broken in every way the
// shardsafe tool reports, on the file and the memory backends.
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/checkpoint/hf/folder.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <xxhash.h>

#include "support/checkpoint_fixtures.hpp"
#include "support/malformed_corpus.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;
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
    CHECK(to_string(e.type) == t.dtype);
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
  // totals that do not match the files are not refused: transformers writes total_parameters
  // without buffers, and no reader uses them (the index's figures are kept as given)
  const D odd = be.root().sub("odd-totals");
  const std::uint64_t total = fixtures::total_bytes(ts);
  std::string text = fixtures::index_text(ts, "", "", "", total + 1);
  text.insert(text.find("\"total_size\""), "\"total_parameters\": 7, ");
  fixtures::make_indexed(odd, ts, text);
  const hf_folder<D> h = open_hf_folder(odd);
  CHECK(h.index->total_size == total + 1);
  CHECK(h.index->total_parameters == 7u);
  CHECK(h.tensors.size() == ts.size());
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

TEST_CASE_TEMPLATE("verify_checkpoint: a complete checkpoint reports its tensors, files and bytes", D, file_directory,
                   memory_directory) {
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
  const std::string sizes =
      ", \"shardsafe\": {\"file_sizes\": {\"rank_0.safetensors\": " + std::to_string(s.rank0.size()) +
      ", \"rank_2.safetensors\": " + std::to_string(fixtures::build_file({}).size()) + "}}";
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
    fixtures::put(
        dir, "rank_1.safetensors",
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
    fixtures::put(
        dir, "metadata.json",
        fixtures::sharded_sample::metadata(true, ", \"shardsafe\": {\"file_sizes\": {\"rank_1.safetensors\": " +
                                                     std::to_string(s.rank1.size() + 8) + "}}"));
    expect_error([&] { verify_checkpoint(dir); }, errc::truncated,
                 {path_of(dir, "rank_1.safetensors"), std::to_string(s.rank1.size()),
                  std::to_string(s.rank1.size() + 8), "recorded"});
  }
  SUBCASE("a file metadata.json records but no tensor uses is missing") {
    const D dir = fresh();
    fixtures::put(
        dir, "metadata.json",
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

// ---------------------------------------------------------------------------------------
// checksums (docs/FORMAT.md §2, "Checksums")

namespace {

/// One tensor saved by a 2-rank world: rank r holds flat elements [r * n / 2, (r + 1) * n / 2).
struct saved_tensor {
  std::string key;
  dtype type;
  shape_t shape;
  std::string bytes;  // the full tensor
};

/// Ten tensors of every byte-sized kind, some spanning several 1000-byte checksum blocks per
/// rank, one empty, one of 3 elements (a rank holds 1 of it).
std::vector<saved_tensor> checksum_sample(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<std::tuple<const char*, dtype, shape_t>> defs = {
      {"f32", dtype::F32, {30, 101}}, {"bf16", dtype::BF16, {1777}}, {"f16", dtype::F16, {3, 5, 7}},
      {"f64", dtype::F64, {999}},     {"i64", dtype::I64, {260}},    {"i32", dtype::I32, {513}},
      {"i16", dtype::I16, {2, 1001}}, {"u8", dtype::U8, {4099}},     {"bool", dtype::BOOL, {3}},
      {"empty", dtype::I8, {0, 4}}};
  std::vector<saved_tensor> out;
  for (const auto& [k, t, s] : defs)
    out.push_back({k, t, s, fixtures::random_string(static_cast<std::size_t>(numel(s) * item_size(t)), rng)});
  return out;
}

/// Saves ts from a 2-rank thread world into dir, each tensor split into two flat halves.
template <WritableDirectory D>
void save_two_ranks(const D& dir, std::vector<saved_tensor>& ts, const save_options& so) {
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& comm) {
    std::vector<flat_view> views;
    for (auto& t : ts) {
      const std::uint64_t n = numel(t.shape), lo = comm.rank() * n / 2, hi = (comm.rank() + 1) * n / 2;
      const std::uint64_t item = item_size(t.type);
      views.push_back(flat_view{t.key, t.type, t.shape, shard_spec(flat_spec{{lo, hi}}),
                                reinterpret_cast<std::byte*>(t.bytes.data() + lo * item), (hi - lo) * item});
    }
    save(dir, std::span<const flat_view>(views), comm, so);
  });
  for (auto& e : thrown)
    if (e) std::rethrow_exception(e);
}

/// Views of the full tensors over fresh memory (one rank loading everything).
std::vector<flat_view> full_views(const std::vector<saved_tensor>& ts, std::vector<std::string>& mem) {
  std::vector<flat_view> views;
  mem.assign(ts.size(), std::string());
  for (std::size_t i = 0; i < ts.size(); ++i) {
    mem[i].assign(ts[i].bytes.size(), '\0');
    views.push_back(flat_view{ts[i].key, ts[i].type, ts[i].shape, std::nullopt,
                              reinterpret_cast<std::byte*>(mem[i].data()), mem[i].size()});
  }
  return views;
}

}  // namespace

TEST_CASE("checksums: a save records XXH3-64 of every block of every tensor, as Python computes them from the files") {
  testing::temp_dir tmp("checksums");
  auto ts = checksum_sample(1);
  // O_DIRECT blocks and buffered ones, both with 4 KiB write blocks that straddle the 1000-byte
  // checksum blocks; and the write_at path (memory) below
  for (bool direct : {true, false}) {
    save_options so;
    so.direct_io = direct;
    so.write_chunk_bytes = 4096;
    so.threads = 3;
    so.checksum_block_bytes = 1000;
    const std::string name = direct ? "direct" : "buffered";
    save_two_ranks(file_directory(tmp.path / name), ts, so);
  }
  // an independent reading: the files' headers parsed by Python, every block hashed with
  // libxxhash itself through ctypes, compared with metadata.json
  const std::string script = R"PY(
import ctypes, json, struct, sys
lib = ctypes.CDLL("libxxhash.so.0")
lib.XXH3_64bits.restype = ctypes.c_uint64
lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
d = sys.argv[1]
md = json.load(open(d + "/metadata.json"))
cs = md["shardsafe"]["checksums"]
assert cs["algorithm"] == "xxh3-64" and cs["block_bytes"] == 1000, cs
blocks = 0
for f in ("rank_0.safetensors", "rank_1.safetensors"):
    raw = open(d + "/" + f, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    hdr.pop("__metadata__", None)
    table = cs["files"][f]
    assert sorted(table) == sorted(hdr), (f, sorted(table), sorted(hdr))
    for k, e in hdr.items():
        b, en = e["data_offsets"]
        data = raw[8 + n + b: 8 + n + en]
        want = ["%016x" % lib.XXH3_64bits(data[i:i + 1000], len(data[i:i + 1000])) for i in range(0, len(data), 1000)]
        assert table[k] == want, (f, k, table[k], want)
        blocks += len(want)
print(blocks)
)PY";
  testing::write_file(tmp.path / "check.py", script);
  std::uint64_t want_blocks = 0;
  for (const auto& t : ts) {
    const std::uint64_t n = numel(t.shape), item = item_size(t.type);
    want_blocks +=
        detail::checksum_block_count(n / 2 * item, 1000) + detail::checksum_block_count((n - n / 2) * item, 1000);
  }
  for (const char* name : {"direct", "buffered"}) {
    INFO(name);
    const auto r = testing::peer("python3", {(tmp.path / "check.py").string(), (tmp.path / name).string()});
    CHECK_MESSAGE(r.code == 0, r.err);
    CHECK(r.out == std::to_string(want_blocks) + "\n");
    const checkpoint_report rep = verify_checkpoint(file_directory(tmp.path / name));
    CHECK(rep.checksums);
    CHECK(rep.checksum_blocks == want_blocks);
    CHECK(rep.tensors == ts.size());
  }
  // the write_at path (a memory directory): the same table, checked by hashing the saved memory
  memory_directory mem(std::make_shared<memory_store>(), "mem:ck");
  save_options so;
  so.checksum_block_bytes = 1000;
  so.write_chunk_bytes = 777;
  save_two_ranks(mem, ts, so);
  const checkpoint_metadata md = read_checkpoint_metadata(mem.open("metadata.json"));
  REQUIRE(md.extras.checksums);
  for (const auto& t : ts) {
    const std::uint64_t n = numel(t.shape), item = item_size(t.type);
    for (int r = 0; r < 2; ++r) {
      const std::string part = t.bytes.substr(static_cast<std::size_t>(r * n / 2 * item),
                                              static_cast<std::size_t>(((r + 1) * n / 2 - r * n / 2) * item));
      std::vector<std::uint64_t> want;
      for (std::size_t i = 0; i < part.size(); i += 1000)
        want.push_back(XXH3_64bits(part.data() + i, std::min<std::size_t>(1000, part.size() - i)));
      CHECK(md.extras.checksums->files.at(rank_file_name(r)).at(t.key) == want);
    }
  }
  CHECK(verify_checkpoint(mem).checksum_blocks == want_blocks);
  // a save without checksums records none, and verify says so
  so.checksums = false;
  so.overwrite = true;
  save_two_ranks(mem, ts, so);
  CHECK(!read_checkpoint_metadata(mem.open("metadata.json")).extras.checksums);
  const checkpoint_report plain = verify_checkpoint(mem);
  CHECK(!plain.checksums);
  CHECK(plain.checksum_blocks == 0);
}

TEST_CASE("checksums: a flipped byte anywhere in a rank file's data is found by verify and by a checked load") {
  testing::temp_dir tmp("flip");
  auto ts = checksum_sample(2);
  const file_directory dir(tmp.path / "ck");
  save_options so;
  so.checksum_block_bytes = 1000;
  save_two_ranks(dir, ts, so);
  // undamaged: verify and a checked load pass
  CHECK(verify_checkpoint(dir).checksums);
  std::vector<std::string> mem;
  {
    auto views = full_views(ts, mem);
    checkpoint_reader<file_directory> r(dir);
    load_options lo;
    lo.verify_checksums = true;
    const load_stats st = load(r, std::span<const flat_view>(views), lo);
    CHECK(st.checksum_blocks == verify_checkpoint(dir).checksum_blocks);
    for (std::size_t i = 0; i < ts.size(); ++i) CHECK(mem[i] == ts[i].bytes);
  }
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    std::mt19937_64 rng(seed);
    const int rank = static_cast<int>(rng() % 2);
    const fs::path file = tmp.path / "ck" / rank_file_name(rank);
    const safetensors_header h = read_safetensors_header(file_storage(file));
    std::vector<const tensor_entry*> nonempty;
    for (const auto& e : h.tensors)
      if (e.nbytes() > 0) nonempty.push_back(&e);
    const tensor_entry& e = *nonempty[rng() % nonempty.size()];
    const std::uint64_t at = rng() % e.nbytes();  // the byte within the tensor's data
    const unsigned char mask = static_cast<unsigned char>(1u << (rng() % 8));
    INFO("seed " << seed << ": " << file.string() << " tensor " << e.name << " data byte " << at);
    std::string bytes = testing::slurp(file);
    const std::size_t pos = static_cast<std::size_t>(h.offset_of(e) + at);
    bytes[pos] = static_cast<char>(bytes[pos] ^ mask);
    testing::write_file(file, bytes);
    const std::uint64_t bits = bit_size(e.type), k = at / 1000;
    const std::uint64_t from = k * 1000, to = std::min(e.nbytes(), from + 1000);
    const std::uint64_t first = from * 8 / bits, last = (to * 8 + bits - 1) / bits, flipped = at * 8 / bits;
    REQUIRE(first <= flipped);
    REQUIRE(flipped < last);
    const std::string range = "elements [" + std::to_string(first) + ", " + std::to_string(last) + ")";
    expect_error([&] { verify_checkpoint(dir); }, errc::checksum_mismatch,
                 {file.string(), "tensor '" + e.name + "'", range, "checksum block " + std::to_string(k), "damaged"});
    // the element's index in the full tensor: the rank's first element is n / 2 for rank 1
    const saved_tensor& t = *std::find_if(ts.begin(), ts.end(), [&](const saved_tensor& x) { return x.key == e.name; });
    const std::uint64_t global = (rank == 0 ? 0 : numel(t.shape) / 2) + first;
    expect_error([&] { verify_checkpoint(dir); }, errc::checksum_mismatch,
                 {"from index " + multi_index_string(t.shape, global)});
    // the tool: exit 1, one line naming file, tensor and elements
    if (testing::have_tool()) {
      const auto r = testing::run_tool({"verify", (tmp.path / "ck").string()});
      CHECK(r.code == 1);
      CHECK(r.out.empty());
      CHECK(r.err.find(file.string()) != std::string::npos);
      CHECK(r.err.find("tensor '" + e.name + "'") != std::string::npos);
      CHECK(r.err.find(range) != std::string::npos);
    }
    // a checked load fails naming it; an unchecked one loads the damaged byte as it is
    auto views = full_views(ts, mem);
    {
      checkpoint_reader<file_directory> r(dir);
      load_options lo;
      lo.verify_checksums = true;
      expect_error([&] { load(r, std::span<const flat_view>(views), lo); }, errc::checksum_mismatch,
                   {file.string(), "tensor '" + e.name + "'", range});
    }
    {
      checkpoint_reader<mmap_directory> r(mmap_directory(tmp.path / "ck"));
      load_options lo;
      lo.verify_checksums = true;
      expect_error([&] { load(r, std::span<const flat_view>(views), lo); }, errc::checksum_mismatch,
                   {"tensor '" + e.name + "'", range});
    }
    checkpoint_reader<file_directory> r(dir);
    CHECK(load(r, std::span<const flat_view>(views)).checksum_blocks == 0);
    const std::size_t ti = static_cast<std::size_t>(&t - ts.data());
    const std::uint64_t item = item_size(t.type);
    const std::size_t gpos = static_cast<std::size_t>((rank == 0 ? 0 : numel(t.shape) / 2) * item + at);
    CHECK(static_cast<unsigned char>(mem[ti][gpos] ^ ts[ti].bytes[gpos]) == mask);
    // a load that reads only the other rank's half of that tensor is not concerned
    {
      const std::uint64_t n = numel(t.shape), lo_e = rank == 0 ? n / 2 : 0, hi_e = rank == 0 ? n : n / 2;
      std::string half((hi_e - lo_e) * item, '\0');
      flat_view v{
          t.key,      t.type, t.shape, shard_spec(flat_spec{{lo_e, hi_e}}), reinterpret_cast<std::byte*>(half.data()),
          half.size()};
      load_options lo;
      lo.verify_checksums = true;
      checkpoint_reader<file_directory> r2(dir);
      CHECK(load(r2, std::span<const flat_view>(&v, 1), lo).checksum_blocks > 0);
      CHECK(half == t.bytes.substr(static_cast<std::size_t>(lo_e * item), half.size()));
    }
    bytes[pos] = static_cast<char>(bytes[pos] ^ mask);  // repaired
    testing::write_file(file, bytes);
  }
  CHECK(verify_checkpoint(dir).checksums);
}

TEST_CASE(
    "checksums: a mismatch names the file holding the hash: metadata.json, or the compact form's "
    "rank_R.checksums.json") {
  testing::temp_dir tmp("holder");
  auto ts = checksum_sample(3);
  for (const metadata_form form : {metadata_form::listed, metadata_form::compact}) {
    const bool compact = form == metadata_form::compact;
    const std::string name = compact ? "compact" : "listed";
    INFO(name);
    const file_directory dir(tmp.path / name);
    save_options so;
    so.checksum_block_bytes = 1000;
    so.metadata = form;
    save_two_ranks(dir, ts, so);
    REQUIRE(fs::exists(tmp.path / name / "rank_1.checksums.json") == compact);
    CHECK(verify_checkpoint(dir).checksums);
    // one byte of rank 1's first tensor with data, damaged
    const fs::path file = tmp.path / name / rank_file_name(1);
    const safetensors_header h = read_safetensors_header(file_storage(file));
    const auto e =
        std::find_if(h.tensors.begin(), h.tensors.end(), [](const tensor_entry& x) { return x.nbytes() > 0; });
    REQUIRE(e != h.tensors.end());
    std::string bytes = testing::slurp(file);
    const std::size_t pos = static_cast<std::size_t>(h.offset_of(*e) + e->nbytes() / 2);
    bytes[pos] = static_cast<char>(bytes[pos] ^ 0x10);
    testing::write_file(file, bytes);
    // the file that records the hash, and the one that does not
    const std::string holder = compact ? "rank_1.checksums.json" : "metadata.json";
    const std::string not_holder = compact ? "metadata.json" : "checksums.json";
    auto message_of = [](auto&& f) {
      try {
        f();
      } catch (const error& x) {
        CHECK(x.code() == errc::checksum_mismatch);
        return std::string(x.what());
      }
      FAIL("no error thrown");
      return std::string();
    };
    std::vector<std::string> msgs;
    msgs.push_back(message_of([&] { verify_checkpoint(dir); }));
    std::vector<std::string> mem;
    auto views = full_views(ts, mem);
    load_options lo;
    lo.verify_checksums = true;
    msgs.push_back(message_of([&] {
      checkpoint_reader<file_directory> r(dir);
      load(r, std::span<const flat_view>(views), lo);
    }));
    if (testing::have_tool()) {
      const auto r = testing::run_tool({"verify", (tmp.path / name).string()});
      CHECK(r.code == 1);
      msgs.push_back(r.err);
    }
    for (const auto& m : msgs) {
      INFO(m);
      CHECK(m.find(file.string()) != std::string::npos);
      CHECK(m.find("tensor '" + e->name + "'") != std::string::npos);
      CHECK(m.find("but " + holder + " records ") != std::string::npos);
      CHECK(m.find(not_holder) == std::string::npos);
    }
    bytes[pos] = static_cast<char>(bytes[pos] ^ 0x10);  // repaired
    testing::write_file(file, bytes);
    CHECK(verify_checkpoint(dir).checksums);
  }
  // a sidecar without a tensor's hashes is named as the file that lacks them
  testing::write_file(tmp.path / "compact" / "rank_1.checksums.json", "{}");
  expect_error(
      [&] { verify_checkpoint(file_directory(tmp.path / "compact")); }, errc::invalid_metadata,
      {"rank_1.safetensors", "rank_1.checksums.json records checksums for this file, but none for this tensor"});
}

TEST_CASE_TEMPLATE("checksums: a checkpoint without them verifies and loads; damaged tables are refused", D,
                   file_directory, memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("old");
  const fixtures::sharded_sample s;
  s.write(dir);  // written by hand, as before checksums: no "shardsafe" key
  const checkpoint_report rep = verify_checkpoint(dir);
  CHECK(!rep.checksums);
  CHECK(rep.checksum_blocks == 0);
  std::string w(48, '\0');
  flat_view v{"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), w.size()};
  load_options lo;
  lo.verify_checksums = true;
  checkpoint_reader<D> r(dir);
  CHECK(load(r, std::span<const flat_view>(&v, 1), lo).checksum_blocks == 0);
  CHECK(w == s.w.bytes);

  // tables that cannot be right
  auto h = [](const std::string& part) { return "\"" + detail::hex64(XXH3_64bits(part.data(), part.size())) + "\""; };
  const std::string w0 = h(s.w.bytes.substr(0, 24)), w1 = h(s.w.bytes.substr(24));
  auto with = [&](const std::string& files, const std::string& alg = "xxh3-64", const std::string& block = "1000") {
    return ", \"shardsafe\": {\"checksums\": {\"algorithm\": \"" + alg + "\", \"block_bytes\": " + block +
           ", \"files\": {" + files + "}}}";
  };
  const std::string b0 = h(s.b.bytes.substr(0, 4)), b1 = h(s.b.bytes.substr(4));
  auto c_cols = [&](std::size_t k0) {
    std::string x;
    for (std::size_t ij = 0; ij < 4; ++ij) x += s.c.bytes.substr(ij * 4 + k0, 2);
    return x;
  };
  const std::string c0 = h(c_cols(0)), c1 = h(c_cols(2));
  const std::string good = "\"rank_0.safetensors\": {\"w\": [" + w0 + "], \"b\": [" + b0 + "], \"c\": [" + c0 +
                           "]}, \"rank_1.safetensors\": {\"w\": [" + w1 + "], \"b\": [" + b1 + "], \"c\": [" + c1 +
                           "]}";
  fixtures::put(dir, "metadata.json", fixtures::sharded_sample::metadata(true, with(good)));
  const checkpoint_report ok = verify_checkpoint(dir);
  CHECK(ok.checksums);
  CHECK(ok.checksum_blocks == 6);
  CHECK(ok.bytes_hashed == 48 + 10 + 16);
  struct bad {
    std::string extra;
    errc code;
    std::vector<std::string> phrases;
  };
  const std::string m = path_of(dir, "metadata.json");
  const std::vector<bad> cases = {
      {with(good, "sha1"), errc::invalid_metadata, {"algorithm 'sha1'", "xxh3-64"}},
      {with(good, "xxh3-64", "0"), errc::invalid_metadata, {"block_bytes", "positive"}},
      {with("\"rank_0.safetensors\": {\"w\": [\"xyz\"]}"), errc::invalid_metadata, {"tensor 'w'", "16 hex digits"}},
      {with(good + ", \"rank_7.safetensors\": {}"),
       errc::invalid_metadata,
       {"rank_7.safetensors", "not a file of the checkpoint"}},
      {with("\"rank_0.safetensors\": {\"w\": [" + w0 + "], \"b\": [" + b0 + "], \"c\": [" + c0 + "]}"),
       errc::invalid_metadata,
       {path_of(dir, "rank_1.safetensors"), "none for this file"}},
      {with("\"rank_0.safetensors\": {\"w\": [" + w0 + "], \"b\": [" + b0 + "]}, \"rank_1.safetensors\": {\"w\": [" +
            w1 + "], \"b\": [" + b1 + "], \"c\": [" + c1 + "]}"),
       errc::invalid_metadata,
       {path_of(dir, "rank_0.safetensors"), "tensor 'c'", "none for this tensor"}},
      {with("\"rank_0.safetensors\": {\"w\": [" + w0 + ", " + w0 + "], \"b\": [" + b0 + "], \"c\": [" + c0 +
            "]}, \"rank_1.safetensors\": {\"w\": [" + w1 + "], \"b\": [" + b1 + "], \"c\": [" + c1 + "]}"),
       errc::invalid_metadata,
       {"tensor 'w'", "records 2 block checksums", "make 1 blocks"}},
      {with("\"rank_0.safetensors\": {\"w\": [" + w1 + "], \"b\": [" + b0 + "], \"c\": [" + c0 +
            "]}, \"rank_1.safetensors\": {\"w\": [" + w1 + "], \"b\": [" + b1 + "], \"c\": [" + c1 + "]}"),
       errc::checksum_mismatch,
       {path_of(dir, "rank_0.safetensors"), "tensor 'w'", "elements [0, 6)"}},
  };
  for (const auto& c : cases) {
    INFO(c.extra);
    fixtures::put(dir, "metadata.json", fixtures::sharded_sample::metadata(true, c.extra));
    expect_error([&] { verify_checkpoint(dir); }, c.code, c.phrases);
  }
}

TEST_CASE_TEMPLATE("a rank file's tensors that metadata.json does not list there are checked, not kept", D,
                   file_directory, memory_directory) {
  backend<D> be;
  const D dir = be.root().sub("extra");
  const fixtures::sharded_sample s;
  s.write(dir);
  // rank 0 holds w's and c's blocks, and "b" and "junk" beside them that no listing of it names
  // (b is listed in rank_1 only, here)
  std::string meta = fixtures::sharded_sample::metadata(true);
  const std::string b0 =
      "\"rank_0.safetensors\": {\"flattened_offsets\": [[0, 2]], \"local_shape\": null, "
      "\"global_offset\": null}, ";
  REQUIRE(meta.find(b0) != std::string::npos);
  meta.erase(meta.find(b0), b0.size());
  const std::string b_all = "[[2, 5]]";
  meta.replace(meta.find(b_all), b_all.size(), "[[0, 5]]");
  const tensor w0{"w", "F32", {6}, s.w.bytes.substr(0, 24)}, junk{"junk", "U8", {3}, "xyz"};
  const tensor c0{"c", "U8", {8}, s.rank0.substr(s.rank0.size() - 8)};
  const tensor b_here{"b", "I16", {2}, s.b.bytes.substr(0, 4)};
  fixtures::put(dir, "rank_0.safetensors", fixtures::build_file({w0, junk, b_here, c0}));
  fixtures::put(dir, "rank_1.safetensors",
                fixtures::build_file({{"w", "F32", {6}, s.w.bytes.substr(24)},
                                      {"b", "I16", {5}, s.b.bytes},
                                      {"c", "U8", {8}, s.rank1.substr(s.rank1.size() - 8)}}));
  fixtures::put(dir, "metadata.json", meta);
  const checkpoint_report rep = verify_checkpoint(dir);
  CHECK(rep.tensors == 3);
  checkpoint_reader<D> r(dir);
  const auto& f = r.file("rank_0.safetensors");
  CHECK(f.header.tensors.size() == 2);  // w and c: what metadata.json lists in rank 0
  CHECK(f.header.find("w"));
  CHECK(!f.header.find("junk"));
  CHECK(!f.header.find("b"));
  CHECK(f.header.file_size() == f.storage.size());
  std::string w(48, '\0'), b(10, '\0');
  const flat_view v[] = {{"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), w.size()},
                         {"b", dtype::I16, {5}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), b.size()}};
  load(r, std::span<const flat_view>(v));
  CHECK(w == s.w.bytes);
  CHECK(b == s.b.bytes);
  // a checksum table that records one of them is refused: it is not part of the checkpoint
  const std::string table =
      ", \"shardsafe\": {\"checksums\": {\"algorithm\": \"xxh3-64\", \"block_bytes\": 1000, \"files\": "
      "{\"rank_0.safetensors\": {\"junk\": [\"0000000000000000\"]}}}}";
  fixtures::put(dir, "metadata.json", meta.substr(0, meta.size() - 1) + table + "}");
  expect_error([&] { verify_checkpoint(dir); }, errc::invalid_metadata,
               {path_of(dir, "rank_0.safetensors"), "tensor 'junk'", "no such tensor that metadata.json lists there"});
  // and a name given twice among the tensors let go is refused as in any header
  fixtures::put(dir, "metadata.json", meta);
  fixtures::put(dir, "rank_0.safetensors", fixtures::build_file({w0, junk, junk, c0}));
  expect_error([&] { verify_checkpoint(dir); }, errc::invalid_header,
               {path_of(dir, "rank_0.safetensors"), "name 'junk' appears twice"});
}

// ---------------------------------------------------------------------------------------
// hostile input: files claiming the same elements, unlisted HF shards, links out of the folder

TEST_CASE_TEMPLATE(
    "overlapping shards: equal bytes are replicas; different bytes fail verify and every load that reads them", D,
    file_directory, memory_directory) {
  backend<D> be;
  std::mt19937_64 rng(11);
  const std::string b = fixtures::random_string(20, rng);  // I16 [10]
  auto md = [](const std::string& spec0, const std::string& spec1) {
    return "{\"tensors\": {\"b\": {\"shape\": [10], \"is_sharded\": true, \"dtype\": \"I16\", \"shard_spec_per_file\": "
           "{"
           "\"rank_0.safetensors\": " +
           spec0 + ", \"rank_1.safetensors\": " + spec1 + "}}}}";
  };
  auto flat = [](std::uint64_t lo, std::uint64_t hi) {
    return "{\"flattened_offsets\": [[" + std::to_string(lo) + ", " + std::to_string(hi) +
           "]], \"local_shape\": null, \"global_offset\": null}";
  };
  auto load_all = [](const D& dir, std::string& out) {
    out.assign(20, '\0');
    flat_view v{"b", dtype::I16, {10}, std::nullopt, reinterpret_cast<std::byte*>(out.data()), out.size()};
    checkpoint_reader<D> r(dir);
    return load(r, std::span<const flat_view>(&v, 1));
  };
  for (const bool identical : {false, true}) {
    // partial: rank 0 holds [0, 6), rank 1 holds [4, 10); identical: both hold all of it
    const std::uint64_t lo1 = identical ? 0 : 4, hi0 = identical ? 10 : 6;
    const std::string name = identical ? "identical" : "partial";
    INFO(name);
    const D dir = be.root().sub(name);
    fixtures::put(dir, "rank_0.safetensors", fixtures::build_file({{"b", "I16", {hi0}, b.substr(0, 2 * hi0)}}));
    std::string r1 = b.substr(2 * lo1);
    fixtures::put(dir, "rank_1.safetensors", fixtures::build_file({{"b", "I16", {10 - lo1}, r1}}));
    fixtures::put(dir, "metadata.json", md(flat(0, hi0), flat(lo1, 10)));
    const checkpoint_report rep = verify_checkpoint(dir);
    CHECK(rep.replicated_tensors == 1);
    CHECK(rep.replicated_elements == hi0 - lo1);
    std::string got;
    load_all(dir, got);
    CHECK(got == b);
    // element 5 differs between the two files
    r1[2 * (5 - lo1)] = static_cast<char>(r1[2 * (5 - lo1)] ^ 0x40);
    fixtures::put(dir, "rank_1.safetensors", fixtures::build_file({{"b", "I16", {10 - lo1}, r1}}));
    expect_error([&] { verify_checkpoint(dir); }, errc::invalid_metadata,
                 {"tensor 'b'", "rank_0.safetensors and rank_1.safetensors", "differ at index [5]", "same elements"});
    expect_error([&] { load_all(dir, got); }, errc::invalid_metadata,
                 {"tensor 'b'", "index [5]", "same elements with different values"});
    // a load of elements [0, 2) is not concerned: only one file holds them, or they are equal
    std::string head(4, '\0');
    flat_view v{"b", dtype::I16, {10}, shard_spec(flat_spec{{0, 2}}), reinterpret_cast<std::byte*>(head.data()), 4};
    // (of an identical replica every element is held twice: compared, equal there)
    checkpoint_reader<D> r(dir);
    CHECK(r.plan(std::span<const flat_view>(&v, 1)).compares.empty() == !identical);
    load(r, std::span<const flat_view>(&v, 1));
    CHECK(head == b.substr(0, 4));
  }
}

TEST_CASE("overlapping shards: replicas a save writes twice are proven equal by their checksums and not read twice") {
  memory_directory mem(std::make_shared<memory_store>(), "mem:rep");
  std::mt19937_64 rng(3);
  std::string w = fixtures::random_string(64, rng);  // F32 [16], saved whole by both ranks (undeclared replicas)
  auto save_both = [&](bool checksums) {
    save_options so;
    so.checksums = checksums;
    so.overwrite = true;
    auto thrown = testing::run_ranks(2, [&](testing::thread_comm& comm) {
      flat_view v{"w", dtype::F32, {16}, shard_spec(flat_spec{{0, 16}}), reinterpret_cast<std::byte*>(w.data()), 64};
      save(mem, std::span<const flat_view>(&v, 1), comm, so);
    });
    for (auto& e : thrown)
      if (e) std::rethrow_exception(e);
  };
  std::string got(64, '\0');
  flat_view v{"w", dtype::F32, {16}, std::nullopt, reinterpret_cast<std::byte*>(got.data()), 64};
  save_both(true);
  {
    checkpoint_reader<memory_directory> r(mem);
    REQUIRE(r.metadata().find("w")->files.size() == 2);
    CHECK(r.plan(std::span<const flat_view>(&v, 1)).compares.empty());
    const checkpoint_report rep = verify_checkpoint(r);
    CHECK(rep.replicated_tensors == 1);
    CHECK(rep.replicated_elements == 16);
  }
  save_both(false);  // no checksums: the load compares the second copy
  checkpoint_reader<memory_directory> r(mem);
  CHECK(!r.plan(std::span<const flat_view>(&v, 1)).compares.empty());
  load(r, std::span<const flat_view>(&v, 1));
  CHECK(got == w);
}

TEST_CASE_TEMPLATE(
    "hf_folder: verify refuses a shard the index does not name when it claims the index's tensors or names", D,
    file_directory, memory_directory) {
  backend<D> be;
  const auto ts = fixtures::sample_tensors();
  std::mt19937_64 rng(4);
  const tensor extra{"extra.weight", "F32", {2}, fixtures::random_string(8, rng)};
  {
    // a third shard of the set that the index forgot
    const D dir = be.root().sub("forgot");
    fixtures::make_indexed(dir, ts);
    CHECK(verify_checkpoint(dir).tensors == ts.size());
    fixtures::put(dir, "model-00003-of-00002.safetensors", fixtures::build_file({extra}));
    expect_error([&] { verify_checkpoint(dir); }, errc::invalid_metadata,
                 {path_of(dir, "model-00003-of-00002.safetensors"), "does not name", "'extra.weight'"});
    open_hf_folder(dir);  // what the index names still opens (a load reads only that)
  }
  {
    // a file the index does not name holding a tensor it places elsewhere
    const D dir = be.root().sub("claims");
    fixtures::make_indexed(dir, ts);
    fixtures::put(dir, "consolidated.safetensors", fixtures::build_file({ts.front()}));
    expect_error([&] { verify_checkpoint(dir); }, errc::invalid_metadata,
                 {path_of(dir, "consolidated.safetensors"), "tensor '" + ts.front().name + "'", "places it in"});
  }
  {
    // another safetensors file with tensors of its own (consolidated weights beside the HF
    // layout, as some repositories ship) is left alone
    const D dir = be.root().sub("other");
    fixtures::make_indexed(dir, ts);
    fixtures::put(dir, "consolidated.safetensors", fixtures::build_file({extra}));
    CHECK(verify_checkpoint(dir).tensors == ts.size());
  }
}

TEST_CASE("symbolic links: a rank file, an HF shard or index leaving the folder is refused; inside it is followed") {
  testing::temp_dir tmp("links");
  const fixtures::sharded_sample s;
  // a checkpoint whose rank_1 is a link to a file elsewhere
  const fs::path outside = tmp.path / "elsewhere";
  fs::create_directories(outside);
  testing::write_file(outside / "rank_1.safetensors", s.rank1);
  const fs::path ck = tmp.path / "ck";
  s.write(file_directory(ck));
  fs::remove(ck / "rank_1.safetensors");
  fs::create_symlink(outside / "rank_1.safetensors", ck / "rank_1.safetensors");
  expect_error([&] { verify_checkpoint(file_directory(ck)); }, errc::unsafe_link,
               {(ck / "rank_1.safetensors").string(), "outside the folder", "link_policy::follow"});
  expect_error([&] { verify_checkpoint(mmap_directory(ck)); }, errc::unsafe_link, {"rank_1.safetensors"});
  std::string w(48, '\0');
  flat_view v{"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), w.size()};
  expect_error([&] { load(file_directory(ck), std::span<const flat_view>(&v, 1)); }, errc::unsafe_link,
               {"rank_1.safetensors"});
  // followed when the caller trusts the folder
  CHECK(verify_checkpoint(file_directory(ck, link_policy::follow)).tensors == 3);
  load(file_directory(ck, link_policy::follow), std::span<const flat_view>(&v, 1));
  CHECK(w == s.w.bytes);
  // a relative link that climbs out is refused too; one to a file inside the folder is fine
  fs::remove(ck / "rank_1.safetensors");
  fs::create_symlink("../elsewhere/rank_1.safetensors", ck / "rank_1.safetensors");
  expect_error([&] { verify_checkpoint(file_directory(ck)); }, errc::unsafe_link, {"outside the folder"});
  fs::remove(ck / "rank_1.safetensors");
  fs::create_directories(ck / "data");
  testing::write_file(ck / "data" / "r1", s.rank1);
  fs::create_symlink("data/r1", ck / "rank_1.safetensors");
  CHECK(verify_checkpoint(file_directory(ck)).tensors == 3);
  // the tool: exit 1 naming the link, exit 0 with --follow-links
  fs::remove(ck / "rank_1.safetensors");
  fs::create_symlink(outside / "rank_1.safetensors", ck / "rank_1.safetensors");
  if (testing::have_tool()) {
    const auto r = testing::run_tool({"verify", ck.string()});
    CHECK(r.code == 1);
    CHECK(r.err.find((ck / "rank_1.safetensors").string()) != std::string::npos);
    CHECK(r.err.find("--follow-links") != std::string::npos);
    CHECK(testing::run_tool({"verify", "--follow-links", ck.string()}).code == 0);
    CHECK(testing::run_tool({"digest", ck.string()}).code == 1);
  }

  // Hugging Face folders: a shard or the index linked from outside is refused
  const auto ts = fixtures::sample_tensors();
  const fs::path hf = tmp.path / "hf";
  fixtures::make_indexed(file_directory(hf), ts);
  for (const std::string n : {fixtures::file2, "model.safetensors.index.json"}) {
    INFO(n);
    fs::rename(hf / n, outside / n);
    fs::create_symlink(outside / n, hf / n);
    expect_error([&] { open_hf_folder(file_directory(hf)); }, errc::unsafe_link, {(hf / n).string()});
    if (testing::have_tool()) CHECK(testing::run_tool({"verify", hf.string()}).code == 1);
    CHECK(open_hf_folder(file_directory(hf, link_policy::follow)).tensors.size() == ts.size());
    fs::remove(hf / n);
    fs::rename(outside / n, hf / n);
  }
  // the Hugging Face hub cache: snapshots/REV/NAME -> ../../blobs/HASH is followed
  const fs::path repo = tmp.path / "models--org--name";
  const fs::path snap = repo / "snapshots" / "0123abcd";
  fs::create_directories(repo / "blobs");
  fixtures::make_indexed(file_directory(snap), ts);
  for (const std::string n : {fixtures::file1, fixtures::file2, "model.safetensors.index.json"}) {
    fs::rename(snap / n, repo / "blobs" / ("blob-" + n));
    fs::create_symlink("../../blobs/blob-" + n, snap / n);
  }
  CHECK(verify_checkpoint(file_directory(snap)).tensors == ts.size());
  if (testing::have_tool()) CHECK(testing::run_tool({"verify", snap.string()}).code == 0);
}

namespace {
/// A storage that is not mappable (read_into only), recording the longest read.
struct longest_read_storage {
  memory_storage s;
  std::shared_ptr<std::uint64_t> longest = std::make_shared<std::uint64_t>(0);
  std::uint64_t size() const { return s.size(); }
  std::string_view name() const { return s.name(); }
  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    *longest = std::max<std::uint64_t>(*longest, dst.size());
    s.read_into(off, dst);
  }
};
}  // namespace

TEST_CASE(
    "hash_reads: a checksum block longer than hash_piece_bytes is read in pieces, hashed as XXH3-64 of it whole") {
  byte_buffer b(static_cast<std::size_t>(3 * hash_piece_bytes + 4096));
  std::mt19937_64 rng(53);
  for (auto& x : b) x = static_cast<std::byte>(rng());
  const longest_read_storage st{memory_storage(b, "f")};
  const longest_read_storage* files[] = {&st};
  const std::vector<read_job> jobs = {{0, 0, 3 * hash_piece_bytes + 4096, nullptr},
                                      {0, 7, hash_piece_bytes, nullptr},
                                      {0, 1, 100, nullptr},
                                      {0, 5, hash_piece_bytes + 1, nullptr}};
  const auto got = hash_reads<longest_read_storage>(files, jobs, 2);
  REQUIRE(got.size() == jobs.size());
  for (std::size_t i = 0; i < jobs.size(); ++i)  // libxxhash's one-shot XXH3 of the same bytes
    CHECK(got[i] == XXH3_64bits(b.data() + jobs[i].offset, static_cast<std::size_t>(jobs[i].len)));
  CHECK(*st.longest <= hash_piece_bytes);
}
