// Tests of format/dcp_metadata.hpp (torch DCP's .metadata through the allowlist unpickler) and
// format/torch_zip.hpp (the storage record of a torch.save archive): pickles and zips built by
// hand for the rules and hostile inputs, and real DCP checkpoints written by Debian's torch 1.13
// (/usr/bin/python3 running tests/dcp_fixture.py) checked against what torch itself reports.
#include "shardsafe/format/dcp_metadata.hpp"

#include <doctest/doctest.h>

#include "support/checkpoint_fixtures.hpp"
#include "support/test_util.hpp"

#include <cstdint>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/pickle_extent.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/format/zip_directory.hpp"
#include "shardsafe/storage/memory.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

// --- protocol 2 pickles by hand -----------------------------------------------------------

std::string le(std::uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string pstr(const std::string& s) { return "X" + le(s.size(), 4) + s; }
std::string num(std::int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) return "J" + le(static_cast<std::uint64_t>(v), 4);
  return std::string(1, '\x8a') + le(8, 1) + le(static_cast<std::uint64_t>(v), 8);  // LONG1
}
std::string glob(const std::string& m, const std::string& n) { return "c" + m + "\n" + n + "\n"; }
std::string tup(const std::vector<std::string>& items) {
  std::string s = "(";
  for (const auto& i : items) s += i;
  return s + "t";
}
std::string dict(const std::vector<std::pair<std::string, std::string>>& items) {
  std::string s = "}(";
  for (const auto& [k, v] : items) s += k + v;
  return s + "u";
}
std::string list(const std::vector<std::string>& items) {
  std::string s = "](";
  for (const auto& i : items) s += i;
  return s + "e";
}
std::string tsize(const std::vector<std::int64_t>& d) {
  std::vector<std::string> items;
  for (auto x : d) items.push_back(num(x));
  return glob("torch", "Size") + tup({tup(items)}) + "R";
}
/// NEWOBJ of class `cls` of `module` with no arguments, then BUILD with `state`.
std::string obj(const std::string& module, const std::string& cls, const std::string& state) {
  return glob(module, cls) + ")" + std::string(1, '\x81') + state + "b";
}
std::string pickle(const std::string& body) { return std::string("\x80\x02", 2) + body + "."; }

const std::string m113 = "torch.distributed._shard.checkpoint.metadata";
const std::string st113 = "torch.distributed._shard.sharded_tensor.metadata";

struct meta_parts {
  std::string module = m113;
  /// TensorProperties as torch >= 2.2 pickles it: torch.distributed.checkpoint.metadata's class,
  /// its enum _MEM_FORMAT_ENCODING made by REDUCE of a value (mem_format) instead of getattr
  bool torch2_properties = false;
  std::int64_t mem_format = 0;
  std::string storage_meta_path;  ///< a StorageMeta with checkpoint_id pathlib._local.PosixPath(this) in planner_data
  std::string dtype = "float32";
  std::vector<std::int64_t> size{4, 6};
  std::vector<std::int64_t> offsets{0, 0}, sizes{4, 6};
  std::string path = "__0_0.distcp";
  bool with_storage = true;
  std::string extra_global;                                     // a global put into planner_data
  std::vector<std::pair<std::string, std::string>> info_extra;  // more fields of each _StorageInfo
  int copies = 1;                                               // the chunk listed this many times
  struct chunk {
    std::vector<std::int64_t> offsets, sizes;
    std::string path;
  };
  std::vector<chunk> more;  // more chunks of "w" (each at bytes [200 + 100 i, +96) of its path)
};

/// A .metadata of one tensor "w" (one chunk) and one bytes item "step", as torch 1.13 writes it
/// (or torch >= 2.0 with module torch.distributed.checkpoint.metadata).
std::string metadata_pickle(const meta_parts& p) {
  const std::string props =
      p.torch2_properties
          ? obj(p.module, "TensorProperties",
                tup({glob("torch", p.dtype),
                     glob("torch.serialization", "_get_layout") + tup({pstr("torch.strided")}) + "R", "\x89",
                     glob(p.module, "_MEM_FORMAT_ENCODING") + tup({num(p.mem_format)}) + "R", "\x89"}))
          : obj(st113, "TensorProperties",
                tup({glob("torch", p.dtype),
                     glob("torch.serialization", "_get_layout") + tup({pstr("torch.strided")}) + "R", "\x89",
                     glob("builtins", "getattr") +
                         tup({glob(st113, "MEM_FORMAT_ENCODING"), pstr("TORCH_CONTIGUOUS_FORMAT")}) + "R",
                     "\x89"}));
  auto chunk_of = [&](const std::vector<std::int64_t>& off, const std::vector<std::int64_t>& sz) {
    return obj(p.module, "ChunkStorageMetadata", dict({{pstr("offsets"), tsize(off)}, {pstr("sizes"), tsize(sz)}}));
  };
  std::vector<std::string> chunks(static_cast<std::size_t>(p.copies), chunk_of(p.offsets, p.sizes));
  for (const auto& c : p.more) chunks.push_back(chunk_of(c.offsets, c.sizes));
  const std::string tsm =
      obj(p.module, "TensorStorageMetadata",
          dict({{pstr("properties"), props}, {pstr("size"), tsize(p.size)}, {pstr("chunks"), list(chunks)}}));
  const std::string bsm = obj(p.module, "BytesStorageMetadata", dict({}));
  const std::string fs_module = p.module.substr(0, p.module.rfind('.')) + ".filesystem";
  auto info = [&](std::int64_t off, std::int64_t len, const std::string& path = "") {
    std::vector<std::pair<std::string, std::string>> fields{{pstr("relative_path"), pstr(path.empty() ? p.path : path)},
                                                            {pstr("offset"), num(off)},
                                                            {pstr("length"), num(len)}};
    fields.insert(fields.end(), p.info_extra.begin(), p.info_extra.end());
    return obj(fs_module, "_StorageInfo", dict(fields));
  };
  auto index = [&](const std::string& fqn, const std::string& offset) {
    return obj(p.module, "MetadataIndex",
               dict({{pstr("fqn"), pstr(fqn)}, {pstr("index"), num(0)}, {pstr("offset"), offset}}));
  };
  std::vector<std::pair<std::string, std::string>> storage{{index("step", "N"), info(0, 10)}};
  if (p.with_storage) storage.push_back({index("w", tsize(p.offsets)), info(10, 96)});
  for (std::size_t i = 0; i < p.more.size(); ++i)
    storage.push_back(
        {index("w", tsize(p.more[i].offsets)), info(200 + 100 * static_cast<std::int64_t>(i), 96, p.more[i].path)});
  std::string planner = p.extra_global.empty() ? "N" : p.extra_global;
  if (!p.storage_meta_path.empty())
    planner =
        obj(p.module, "StorageMeta",
            dict({{pstr("checkpoint_id"), glob("pathlib._local", "PosixPath") + tup({pstr(p.storage_meta_path)}) + "R"},
                  {pstr("save_id"), pstr("s")},
                  {pstr("load_id"), "N"}}));
  return pickle(obj(p.module, "Metadata",
                    dict({{pstr("state_dict_metadata"), dict({{pstr("w"), tsm}, {pstr("step"), bsm}})},
                          {pstr("planner_data"), planner},
                          {pstr("storage_data"), dict(storage)},
                          {pstr("version"), pstr("1.0.0")}})));
}

// --- zips by hand --------------------------------------------------------------------------

struct zip_entry_spec {
  std::string name, data;
  int method = 0;
  std::uint64_t declared_size = ~std::uint64_t(0);  // the size the headers claim (default: data's)
};

std::string zip(const std::vector<zip_entry_spec>& entries) {
  std::string out, cd;
  for (const auto& e : entries) {
    const std::uint64_t sz = e.declared_size == ~std::uint64_t(0) ? e.data.size() : e.declared_size;
    const std::uint64_t local = out.size();
    out += le(0x04034b50, 4) + le(20, 2) + le(0, 2) + le(e.method, 2) + le(0, 4) + le(0, 4) + le(sz, 4) + le(sz, 4) +
           le(e.name.size(), 2) + le(4, 2) + e.name + le(0xabcd, 2) + le(0, 2) + e.data;
    cd += le(0x02014b50, 4) + le(20, 2) + le(20, 2) + le(0, 2) + le(e.method, 2) + le(0, 4) + le(0, 4) + le(sz, 4) +
          le(sz, 4) + le(e.name.size(), 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 4) + le(local, 4) +
          e.name;
  }
  const std::uint64_t cd_at = out.size();
  out += cd + le(0x06054b50, 4) + le(0, 2) + le(0, 2) + le(entries.size(), 2) + le(entries.size(), 2) +
         le(cd.size(), 4) + le(cd_at, 4) + le(0, 2);
  return out;
}

/// The same archive with every size and offset in zip64 extra fields and a zip64 end record.
std::string zip64(const std::vector<zip_entry_spec>& entries) {
  std::string out, cd;
  const std::string ff = le(0xffffffff, 4);
  for (const auto& e : entries) {
    const std::uint64_t local = out.size();
    out += le(0x04034b50, 4) + le(45, 2) + le(0, 2) + le(e.method, 2) + le(0, 4) + le(0, 4) + ff + ff +
           le(e.name.size(), 2) + le(20, 2) + e.name + le(1, 2) + le(16, 2) + le(e.data.size(), 8) +
           le(e.data.size(), 8) + e.data;
    cd += le(0x02014b50, 4) + le(45, 2) + le(45, 2) + le(0, 2) + le(e.method, 2) + le(0, 4) + le(0, 4) + ff + ff +
          le(e.name.size(), 2) + le(28, 2) + le(0, 2) + le(0, 2) + le(0, 2) + le(0, 4) + ff + e.name + le(1, 2) +
          le(24, 2) + le(e.data.size(), 8) + le(e.data.size(), 8) + le(local, 8);
  }
  const std::uint64_t cd_at = out.size();
  out += cd;
  const std::uint64_t z = out.size();
  out += le(0x06064b50, 4) + le(44, 8) + le(45, 2) + le(45, 2) + le(0, 4) + le(0, 4) + le(entries.size(), 8) +
         le(entries.size(), 8) + le(cd.size(), 8) + le(cd_at, 8);
  out += le(0x07064b50, 4) + le(0, 4) + le(z, 8) + le(1, 4);
  out += le(0x06054b50, 4) + le(0xffff, 2) + le(0xffff, 2) + le(0xffff, 2) + le(0xffff, 2) + ff + ff + le(0, 2);
  return out;
}

}  // namespace

// ============================================================ .metadata rules

TEST_CASE("dcp metadata: a hand-built torch 1.13 and torch 2 pickle read into tensors and bytes items") {
  for (const std::string& module : {m113, std::string("torch.distributed.checkpoint.metadata")}) {
    CAPTURE(module);
    meta_parts p;
    p.module = module;
    p.dtype = "bfloat16";
    const auto md = parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata");
    REQUIRE(md.items.size() == 2);
    const auto& w = md.items.at("w");
    CHECK_FALSE(w.is_bytes);
    CHECK(w.type == dtype::BF16);
    CHECK(w.size == std::vector<std::uint64_t>{4, 6});
    REQUIRE(w.chunks.size() == 1);
    CHECK(w.chunks[0].offsets == std::vector<std::uint64_t>{0, 0});
    CHECK(w.chunks[0].sizes == std::vector<std::uint64_t>{4, 6});
    CHECK(w.chunks[0].storage == dcp_storage_info{"__0_0.distcp", 10, 96});
    const auto& step = md.items.at("step");
    CHECK(step.is_bytes);
    CHECK(step.bytes == dcp_storage_info{"__0_0.distcp", 0, 10});
  }
}

TEST_CASE("dcp metadata: newer torch's extra fields are ignored, transformed bytes refused") {
  meta_parts p;
  p.module = "torch.distributed.checkpoint.metadata";
  // StorageMeta(checkpoint_id=PosixPath(...), save_id=...), as torch >= 2.4 writes it
  p.extra_global =
      obj(p.module, "StorageMeta",
          dict({{pstr("checkpoint_id"), glob("pathlib", "PosixPath") + tup({pstr("/ckpt"), pstr("step1")}) + "R"},
                {pstr("save_id"), pstr("abc")},
                {pstr("modules"), list({})}}));
  p.info_extra = {{pstr("transform_descriptors"), "N"}};
  CHECK(parse_dcp_metadata(metadata_pickle(p), "m").items.at("w").chunks.size() == 1);
  p.info_extra = {{pstr("transform_descriptors"), list({})}};
  CHECK(parse_dcp_metadata(metadata_pickle(p), "m").items.at("w").type == dtype::F32);
  p.info_extra = {{pstr("transform_descriptors"), list({pstr("zstd")})}};
  testing::expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
                        {"transform_descriptors"});
}

TEST_CASE(
    "dcp metadata: torch 2.x's classes: _MEM_FORMAT_ENCODING by value, pathlib._local paths; hostile values refused") {
  meta_parts p;
  p.module = "torch.distributed.checkpoint.metadata";
  p.torch2_properties = true;
  for (std::int64_t v : {0, 1, 2}) {
    p.mem_format = v;
    CHECK(parse_dcp_metadata(metadata_pickle(p), "m").items.at("w").type == dtype::F32);
  }
  for (std::int64_t v : {3, -1, 1000000}) {
    CAPTURE(v);
    p.mem_format = v;
    testing::expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata"); }, errc::invalid_metadata,
                          {"ckpt/.metadata", "_MEM_FORMAT_ENCODING", "a member's value (0, 1 or 2)"});
  }
  p.mem_format = 0;
  // a StorageMeta whose checkpoint_id points anywhere is data: never opened, never followed
  p.storage_meta_path = "/etc/../../root/.ssh";
  CHECK(parse_dcp_metadata(metadata_pickle(p), "m").items.size() == 2);
  p.storage_meta_path.clear();
  // _StorageInfo paths that leave the folder are refused by rule
  for (const char* bad : {"../w.distcp", "/etc/passwd", "sub/w.distcp", "..", ""}) {
    CAPTURE(bad);
    p.path = bad;
    testing::expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata"); }, errc::invalid_metadata,
                          {"ckpt/.metadata", "relative_path"});
  }
  p.path = "__0_0.distcp";
  // a chunk (and its MetadataIndex) outside the tensor is refused
  p.more = {{{9, 9}, {1, 1}, "__1_0.distcp"}};
  testing::expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata"); }, errc::invalid_metadata,
                        {"ckpt/.metadata", "pass the tensor's size"});
}

TEST_CASE("dcp metadata: globals outside the allowlist are refused by name, nothing is called") {
  using testing::expect_error;
  meta_parts p;
  p.extra_global = glob("os", "system") + tup({pstr("touch /tmp/shardsafe-pwned")}) + "R";
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata"); }, errc::invalid_metadata,
               {"ckpt/.metadata", "'os.system'", "not on the DCP allowlist"});
  CHECK_FALSE(fs::exists("/tmp/shardsafe-pwned"));
  p.extra_global = glob("torch", "load");
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata, {"'torch.load'"});
  // a getattr that reaches outside the allowlist from an allowed global
  p.extra_global = glob("builtins", "getattr") + tup({glob("torch", "Size"), pstr("__class__")}) + "R";
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
               {"'torch.Size.__class__'"});
  // calling a value, NEWOBJ of a function, BUILD on plain data, a look-alike module
  p.extra_global = glob("torch", "float32") + tup({}) + "R";
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
               {"'torch.float32'", "is a value"});
  p.extra_global = glob("torch", "Size") + ")" + std::string(1, '\x81');
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
               {"NEWOBJ", "'torch.Size'", "not an allowlisted class"});
  p.extra_global = dict({}) + dict({{pstr("a"), num(1)}}) + "b";
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
               {"BUILD", "not an allowlisted object"});
  p.extra_global = glob("torch.distributed._shard.checkpoint.metadata_evil", "Metadata");
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
               {"metadata_evil.Metadata"});
  // a plain dict dressed as a marker does not make a call possible
  p.extra_global = dict({{pstr("__global__"), pstr("os.system")}}) + tup({pstr("ls")}) + "R";
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
               {"not an allowlisted global"});
  // protocol 4 spelling: STACK_GLOBAL of a refused name
  p.extra_global = pstr("subprocess") + pstr("Popen") + std::string(1, '\x93');
  expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata, {"'subprocess.Popen'"});
}

TEST_CASE("dcp metadata: rules on tensors, chunks and storage entries") {
  using testing::expect_error;
  auto refused = [](const meta_parts& p, errc code, std::vector<std::string> phrases) {
    expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata"); }, code, phrases);
  };
  meta_parts p;
  p.sizes = {4, 7};
  refused(p, errc::invalid_metadata, {"ckpt/.metadata", "'w': chunk 0", "pass the tensor's size [4,6] in dimension 1"});
  p = {};
  p.offsets = {0};
  p.sizes = {4};
  refused(p, errc::invalid_metadata, {"'w': chunk 0", "one entry per dimension"});
  p = {};
  p.with_storage = false;
  refused(p, errc::invalid_metadata, {"'w': chunk 0", "at offsets [0,0] has no storage_data entry"});
  for (const std::string bad_path : {"../x.distcp", "a/b.distcp", "", "..", "c:\\x"}) {
    p = {};
    p.path = bad_path;
    refused(p, errc::invalid_metadata, {"relative_path", "not a plain file name"});
  }
  // a torch dtype shardsafe has no type for: the tensor is foreign, its chunks checked all the same
  p = {};
  p.dtype = "complex128";
  const dcp_metadata fm = parse_dcp_metadata(metadata_pickle(p), "ckpt/.metadata");
  REQUIRE(fm.items.count("w") == 1);
  CHECK(fm.items.at("w").foreign_dtype == "torch.complex128");
  CHECK(fm.items.at("w").size == shape_t{4, 6});
  CHECK(fm.items.at("w").chunks.size() == 1);
  p.sizes = {4, 7};
  refused(p, errc::invalid_metadata, {"'w': chunk 0", "pass the tensor's size [4,6] in dimension 1"});
  p = {};
  p.dtype = "float32";
  CHECK(parse_dcp_metadata(metadata_pickle(p), "m").items.at("w").foreign_dtype.empty());
  p = {};
  p.dtype = "qint4";
  refused(p, errc::invalid_metadata, {"'torch.qint4'"});
  p = {};
  p.size = {std::int64_t(1) << 40, std::int64_t(1) << 40};
  p.sizes = {1, 1};
  refused(p, errc::invalid_metadata, {"'w'", "more elements than 64 bits"});
  p = {};
  p.size = {-1, 6};
  refused(p, errc::invalid_metadata, {"'w': size", "non-negative"});
}

TEST_CASE("dcp metadata: truncated and damaged pickles end in invalid_metadata") {
  const auto whole = metadata_pickle({});
  for (std::size_t n = 0; n < whole.size(); n += 7)
    testing::expect_error([&] { parse_dcp_metadata(whole.substr(0, n), "ckpt/.metadata"); }, errc::invalid_metadata,
                          {"ckpt/.metadata"});
  // not a Metadata at the top
  testing::expect_error([&] { parse_dcp_metadata(pickle(dict({})), "m"); }, errc::invalid_metadata,
                        {"top level", "Metadata"});
}

// ============================================================ torch.save zip records

TEST_CASE("torch zip: the storage record is found by its headers, compressed or odd records are refused") {
  using testing::expect_error;
  const std::string data(24, '\x5a');
  const auto good = zip({{"archive/data.pkl", "PKL"}, {"archive/data/0", data}, {"archive/version", "3\n"}});
  const auto a = locate_torch_zip(good, "f.distcp [0, 9)", data.size());
  CHECK(a.storage.name == "archive/data/0");
  CHECK(a.storage.size == 24);
  CHECK(good.substr(a.storage.data_offset, a.storage.size) == data);
  REQUIRE(a.pickle);
  CHECK(good.substr(a.pickle->data_offset, a.pickle->size) == "PKL");

  expect_error(
      [&] { locate_torch_zip(zip({{"archive/data.pkl", "P"}, {"archive/data/0", data, 8}}), "f.distcp [0, 9)"); },
      errc::invalid_metadata, {"f.distcp [0, 9)", "record 'archive/data/0'", "compressed (method 8)"});
  expect_error([&] { locate_torch_zip(good, "f", 20); }, errc::invalid_metadata,
               {"'archive/data/0' holds 24 bytes but the chunk needs 20"});
  expect_error([&] { locate_torch_zip(zip({{"a/data/0", data}, {"a/data/1", data}}), "f"); }, errc::invalid_metadata,
               {"two storage records"});
  expect_error([&] { locate_torch_zip(zip({{"a/data.pkl", data}}), "f"); }, errc::invalid_metadata,
               {"no storage record"});
  expect_error([&] { locate_torch_zip(zip({{"a/data/0", data, 0, 4000}}), "f"); }, errc::invalid_metadata,
               {"run into the central directory"});
  for (std::size_t n = 0; n + 1 < good.size(); n += 5)
    expect_error([&] { locate_torch_zip(std::string_view(good).substr(0, n), "f"); }, errc::invalid_metadata, {"f: "});
  expect_error([&] { locate_torch_zip(std::string(100, 'x'), "f"); }, errc::invalid_metadata,
               {"no zip end-of-central-directory"});

  // zip64: sizes and offsets in extra fields, the central directory found through the zip64 end record
  const auto big = zip64({{"model/data.pkl", "PKL"}, {"model/data/0", data}, {"model/version", "3\n"}});
  const auto b = locate_torch_zip(big, "z.distcp", data.size());
  CHECK(b.storage.name == "model/data/0");
  CHECK(big.substr(b.storage.data_offset, b.storage.size) == data);
  REQUIRE(b.pickle);
  CHECK(big.substr(b.pickle->data_offset, b.pickle->size) == "PKL");
  // an archive read by ranges: only the tail, the central directory and the headers are read
  const std::string mib(std::size_t(1) << 20, '\x11');
  const auto large = zip({{"archive/data.pkl", "PKL"}, {"archive/data/0", mib}, {"archive/version", "3\n"}});
  std::uint64_t read = 0;
  const auto c = locate_torch_zip(
      large.size(),
      [&](std::uint64_t off, std::size_t n) {
        read += n;
        return large.substr(static_cast<std::size_t>(off), n);
      },
      "f", mib.size());
  CHECK(large.substr(c.storage.data_offset, 16) == mib.substr(0, 16));
  CHECK(read < 70000);  // the end record's search window (64 KiB + 22) and a few headers
}

// ============================================================ real torch 1.13 checkpoints

TEST_CASE("dcp: checkpoints written by torch 1.13 parse as torch reports them, chunk records hold torch's bytes" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  testing::temp_dir dir("dcp");
  const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp_fixture.py";
  const auto r = testing::peer(testing::torch_python, {script.string(), dir.str()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  MESSAGE("torch 1.13's dataclass shim " << std::string(r.err.find("shim") != std::string::npos ? "was" : "was not")
                                         << " needed by this Python");
  for (const std::string folder : {"ckpt", "ckpt_single"}) {
    CAPTURE(folder);
    const auto ckpt = dir.path / folder;
    const auto md = parse_dcp_metadata(testing::slurp(ckpt / ".metadata"), (ckpt / ".metadata").string());
    // the same Metadata pickled with protocol 2 (GLOBAL, BINPUT/BINGET, BUILD on shared objects)
    const auto md2 = parse_dcp_metadata(testing::slurp(dir.path / (folder + ".metadata_p2")), folder + ".metadata_p2");
    REQUIRE(md2.items.size() == md.items.size());
    for (const auto& [k, v] : md.items) {
      const auto& v2 = md2.items.at(k);
      CHECK(v2.is_bytes == v.is_bytes);
      CHECK(v2.type == v.type);
      CHECK(v2.size == v.size);
      CHECK(v2.bytes == v.bytes);
      REQUIRE(v2.chunks.size() == v.chunks.size());
      for (std::size_t i = 0; i < v.chunks.size(); ++i) CHECK(v2.chunks[i].storage == v.chunks[i].storage);
    }

    simdjson::dom::parser parser;
    const std::string expect_text = testing::slurp(dir.path / (folder + ".json"));
    const auto expect = detail::parse_json(parser, expect_text, "expect.json").get_object().value();
    CHECK(md.items.size() == expect.size());
    int tensors = 0;
    for (auto [key, e] : expect) {
      const std::string fqn(key);
      CAPTURE(fqn);
      REQUIRE(md.items.count(fqn) == 1);
      const auto& item = md.items.at(fqn);
      auto ints = [](simdjson::dom::element a) {
        std::vector<std::uint64_t> v;
        const simdjson::dom::array arr = a.get_array().value();  // a copy: value() of a temporary dangles
        for (auto x : arr) v.push_back(x.get_uint64().value());
        return v;
      };
      auto storage_of = [](simdjson::dom::element a) {
        auto arr = a.get_array().value();
        return dcp_storage_info{std::string(arr.at(0).get_string().value()), arr.at(1).get_uint64().value(),
                                arr.at(2).get_uint64().value()};
      };
      if (e["bytes"].error() == simdjson::SUCCESS) {
        CHECK(item.is_bytes);
        auto entries = e["storage"].get_array().value();
        REQUIRE(entries.size() == 1);
        CHECK(item.bytes == storage_of(entries.at(0).value()));
        continue;
      }
      ++tensors;
      CHECK_FALSE(item.is_bytes);
      CHECK(to_string(item.type) == std::string_view(e["dtype"].get_string().value()));
      CHECK(item.size == ints(e["size"].value()));
      auto chunks = e["chunks"].get_array().value();
      REQUIRE(item.chunks.size() == chunks.size());
      const std::string raw = testing::slurp(dir.path / "raw" / (fqn + ".bin"));
      std::size_t i = 0;
      for (auto c : chunks) {
        const auto& ch = item.chunks[i++];
        CHECK(ch.offsets == ints(c["offsets"].value()));
        CHECK(ch.sizes == ints(c["sizes"].value()));
        CHECK(ch.storage == storage_of(c["storage"].value()));
        // the chunk's archive inside its data file, read by ranges
        const std::string file = testing::slurp(ckpt / ch.storage.relative_path);
        REQUIRE(ch.storage.offset + ch.storage.length <= file.size());
        const std::string_view archive = std::string_view(file).substr(ch.storage.offset, ch.storage.length);
        const std::string what = ch.storage.relative_path + " [" + std::to_string(ch.storage.offset) + ", +" +
                                 std::to_string(ch.storage.length) + ")";
        const std::uint64_t need = numel(ch.sizes) * item_size(item.type);
        const auto z = locate_torch_zip(archive, what, need);
        CHECK(archive.substr(z.storage.data_offset, z.storage.size) == raw);
        REQUIRE(z.pickle);
        const auto t =
            parse_torch_tensor_pickle(archive.substr(z.pickle->data_offset, z.pickle->size), what + " data.pkl");
        CHECK_NOTHROW(check_torch_zip_tensor(t, z.storage, item.type, ch.sizes, what));
        CHECK(t.type == item.type);
        testing::expect_error(
            [&] {
              check_torch_zip_tensor(t, z.storage, item.type == dtype::F32 ? dtype::I32 : dtype::F32, ch.sizes, what);
            },
            errc::invalid_metadata, {what, "data.pkl"});
      }
    }
    CHECK(tensors == 13);
    // a truncated .metadata of torch's own
    const std::string whole = testing::slurp(ckpt / ".metadata");
    testing::expect_error([&] { parse_dcp_metadata(std::string_view(whole).substr(0, whole.size() / 2), ".metadata"); },
                          errc::invalid_metadata, {".metadata: pickle"});
  }
}

TEST_CASE(
    "torch zip: data.pkl of a dense tensor in any order of its dimensions is read; a strided or offset view is "
    "refused") {
  torch_zip_tensor t{"0", dtype::F32, 6, 0, {2, 3}, {3, 1}};
  const torch_zip_record rec{"archive/data/0", 100, 24};
  CHECK(check_torch_zip_tensor(t, rec, dtype::F32, {2, 3}, "f").empty());
  auto t2 = t;
  t2.stride = {1, 2};  // transposed: dimension 1 stored outermost
  CHECK(check_torch_zip_tensor(t2, rec, dtype::F32, {2, 3}, "f") == std::vector<std::size_t>{1, 0});
  // channels_last [N, C, H, W] = [2, 3, 2, 2]: strides (C*H*W, 1, W*C, C), stored N, H, W, C
  const torch_zip_record rec4{"archive/data/0", 100, 96};
  torch_zip_tensor cl{"0", dtype::F32, 24, 0, {2, 3, 2, 2}, {12, 1, 6, 3}};
  CHECK(check_torch_zip_tensor(cl, rec4, dtype::F32, {2, 3, 2, 2}, "f") == std::vector<std::size_t>{0, 2, 3, 1});
  // size-1 dimensions come first in an order, whatever their stride
  torch_zip_tensor cl1{"0", dtype::F32, 24, 0, {1, 3, 2, 4}, {99, 1, 12, 3}};
  const torch_zip_record rec24{"archive/data/0", 100, 96};
  CHECK(check_torch_zip_tensor(cl1, rec24, dtype::F32, {1, 3, 2, 4}, "f") == std::vector<std::size_t>{0, 2, 3, 1});
  t2.stride = {3, 2};  // neither row-major nor dense in another order
  testing::expect_error([&] { check_torch_zip_tensor(t2, rec, dtype::F32, {2, 3}, "f"); }, errc::invalid_metadata,
                        {"f: data.pkl: stride [3,2] is not dense for size [2,3]"});
  t2.stride = {1, 1};  // two dimensions over the same elements
  testing::expect_error([&] { check_torch_zip_tensor(t2, rec, dtype::F32, {2, 3}, "f"); }, errc::invalid_metadata,
                        {"stride [1,1] is not dense"});
  t2.stride = {6, 2};  // every other element: a strided view
  testing::expect_error([&] { check_torch_zip_tensor(t2, rec, dtype::F32, {2, 3}, "f"); }, errc::invalid_metadata,
                        {"stride [6,2] is not dense"});
  t2 = t;
  t2.storage_offset = 2;
  testing::expect_error([&] { check_torch_zip_tensor(t2, rec, dtype::F32, {2, 3}, "f"); }, errc::invalid_metadata,
                        {"storage offset 2"});
  t2 = t;
  t2.storage_key = "1";
  testing::expect_error([&] { check_torch_zip_tensor(t2, rec, dtype::F32, {2, 3}, "f"); }, errc::invalid_metadata,
                        {"is not the record"});
  // size-1 dimensions may carry any stride
  torch_zip_tensor t3{"0", dtype::F32, 6, 0, {2, 1, 3}, {3, 99, 1}};
  CHECK(check_torch_zip_tensor(t3, rec, dtype::F32, {2, 1, 3}, "f").empty());
  // a pickle naming something else
  const std::string evil = pickle(glob("posix", "system") + tup({pstr("ls")}) + "R");
  testing::expect_error([&] { parse_torch_tensor_pickle(evil, "f data.pkl"); }, errc::invalid_metadata,
                        {"'posix.system'", "torch.save tensor allowlist"});
  // plain opcodes cannot build what _rebuild_tensor_v3 would: the keys the policy gives a
  // tensor and a storage are no str a pickle can spell (not UTF-8), so a dict of the same shape
  // under readable names is a dict, not a tensor (torch would load it as a dict)
  for (const std::string dn : {"ab", "float32", "torch.nosuch"}) {
    const std::string plain = pickle(dict({{pstr("__tensor__"), dict({{pstr("__storage__"), pstr("0")},
                                                                      {pstr("type"), pstr("torch.UntypedStorage")},
                                                                      {pstr("numel"), "K\x01"}})},
                                           {pstr("dtype"), pstr(dn)}}));
    testing::expect_error([&] { parse_torch_tensor_pickle(plain, "f data.pkl"); }, errc::invalid_metadata,
                          {"f data.pkl", "does not hold one tensor"});
  }
  const std::string unspellable = pickle(dict({{std::string("X\x07\x00\x00\x00\xfftensor", 12), dict({})}}));
  testing::expect_error([&] { parse_torch_tensor_pickle(unspellable, "f data.pkl"); }, errc::invalid_metadata,
                        {"f data.pkl", "not UTF-8"});
}

TEST_CASE("dcp: data files written as safetensors (newer torch's SAFETENSORS format) are read through their headers") {
  meta_parts p;
  p.module = "torch.distributed.checkpoint.metadata";
  p.size = {8, 6};  // the file holds rows 4..7
  p.offsets = {4, 0};
  p.sizes = {4, 6};
  p.path = "__0_0.safetensors";
  std::string w(96, '\0');
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<char>(i * 7 + 1);
  auto file = [&](const std::string& offsets, const std::string& shape) {
    const std::string json = "{\"__metadata__\":{\"DCP_SHARDING_INFO\":" +
                             testing::json_quoted("{\"w\": {\"saved_offsets\": " + offsets + "}}") +
                             "},\"w\":{\"dtype\":\"F32\",\"shape\":" + shape + ",\"data_offsets\":[0,96]}}";
    return le(json.size(), 8) + json + w;
  };
  auto load_rows_5_to_8 = [&](const memory_directory& dir) {
    checkpoint_reader<memory_directory> r(dir);
    CHECK(r.layout() == dcp_layout::info);
    std::string out(72, '\0');
    const flat_view v{
        "w",       dtype::F32, {8, 6}, shard_spec(block_spec({3, 6}, {5, 0})), reinterpret_cast<std::byte*>(out.data()),
        out.size()};
    load(r, std::span<const flat_view>(&v, 1));
    return out;
  };
  memory_directory dir;
  dir.make();
  fixtures::put(dir, ".metadata", metadata_pickle(p));
  fixtures::put(dir, p.path, file("[4, 0]", "[4,6]"));
  CHECK(load_rows_5_to_8(dir) == w.substr(24));
  fixtures::put(dir, p.path, file("[0, 0]", "[4,6]"));
  testing::expect_error(
      [&] { load_rows_5_to_8(dir); }, errc::invalid_metadata,
      {"__0_0.safetensors", "tensor 'w'", "DCP_SHARDING_INFO places the block at [0,0], .metadata at [4,0]"});
  fixtures::put(dir, p.path, file("[4, 0]", "[6,4]"));
  testing::expect_error([&] { load_rows_5_to_8(dir); }, errc::invalid_metadata,
                        {"__0_0.safetensors", "tensor 'w'", "file holds F32 [6,4], .metadata's chunk is F32 [4,6]"});
}

TEST_CASE("dcp: chunks listed twice count once; hostile chunk lists and data file names are refused by rule") {
  meta_parts p;
  p.copies = 3;  // one chunk, listed three times
  CHECK(parse_dcp_metadata(metadata_pickle(p), "m").items.at("w").chunks.size() == 1);
  p.copies = 1;
  p.size = {8, 6};
  p.more = {{{0, 0}, {2, 6}, "__0_0.distcp"}};  // another size at the same offsets
  testing::expect_error([&] { parse_dcp_metadata(metadata_pickle(p), "m"); }, errc::invalid_metadata,
                        {"'w'", "at offsets [0,0] has sizes [2,6], another chunk there [4,6]"});

  memory_directory dir;
  dir.make();
  // two chunks of one key in a safetensors data file (which holds each key once)
  p.path = "__0_0.safetensors";
  p.more = {{{4, 0}, {4, 6}, "__0_0.safetensors"}};
  fixtures::put(dir, ".metadata", metadata_pickle(p));
  testing::expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata,
                        {".metadata", "tensor 'w'", "second chunk", "__0_0.safetensors"});
  // "x.distcp#1" is a real data file and the name of x.distcp's second chunk of w
  p.path = "x.distcp#1";
  p.size = {12, 6};
  p.more = {{{4, 0}, {4, 6}, "x.distcp"}, {{8, 0}, {4, 6}, "x.distcp"}};
  fixtures::put(dir, ".metadata", metadata_pickle(p));
  testing::expect_error([&] { checkpoint_reader<memory_directory> r(dir); }, errc::invalid_metadata,
                        {".metadata", "tensor 'w'", "'x.distcp#1' names both the data file"});
}

// ============================================================ reading no more than a pickle, a zip directory

namespace {

/// A memory_storage that counts the bytes read from it.
struct counted_storage {
  memory_storage s;
  std::shared_ptr<std::uint64_t> read = std::make_shared<std::uint64_t>(0);
  std::uint64_t size() const { return s.size(); }
  std::string_view name() const { return s.name(); }
  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    *read += dst.size();
    s.read_into(off, dst);
  }
};

byte_buffer bytes_of(std::string_view s) {
  byte_buffer b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

}  // namespace

TEST_CASE("read_pickle_bytes: a pickle is read up to its STOP, never the bytes after it, as Python's unpickler") {
  const std::string md = metadata_pickle({});
  // 64 MiB of zeros after STOP: the pickle alone comes back, and at most one 1 MiB window is read
  counted_storage st{memory_storage(bytes_of(md + std::string(std::size_t(64) << 20, '\0')), "ckpt/.metadata")};
  const std::string got = read_pickle_bytes(st, max_metadata_size);
  CHECK(got == md);
  CHECK(*st.read <= (std::uint64_t(1) << 20));
  CHECK(parse_dcp_metadata(got, "ckpt/.metadata").items.size() == 2);
  // the limit is the pickle's, not the file's: a 4 KiB limit takes this one with a MiB after it
  CHECK(read_pickle_bytes(counted_storage{memory_storage(bytes_of(md + std::string(1 << 20, 'x')), "m")}, md.size()) ==
        md);
  testing::expect_error([&] { read_pickle_bytes(counted_storage{memory_storage(bytes_of(md), "m")}, md.size() - 1); },
                        errc::invalid_metadata, {"m: pickle does not end within its first"});
  // a str of 2 MiB (the argument runs past the first window) and text opcodes: read through
  const std::string two_mib(std::size_t(2) << 20, 's');
  const std::string big = std::string("\x80\x02") + pstr(two_mib) + "I12\n0cbuiltins\nlen\n0.";
  counted_storage b{memory_storage(bytes_of(big + "trailing"), "b")};
  CHECK(read_pickle_bytes(b, max_metadata_size) == big);
  // not a protocol 2+ pickle, a STOP inside a FRAME running past it, a line without its end
  testing::expect_error(
      [&] {
        read_pickle_bytes(counted_storage{memory_storage(bytes_of(std::string(99, '\0')), "z")}, max_metadata_size);
      },
      errc::invalid_metadata, {"z: does not start with a pickle's PROTO opcode"});
  const std::string framed = std::string("\x80\x04\x95", 3) + le(40, 8) + "N." + std::string(38, '\0');
  testing::expect_error([&] { read_pickle_bytes(counted_storage{memory_storage(bytes_of(framed), "f")}, 1 << 20); },
                        errc::invalid_metadata, {"f: pickle STOP at byte 12", "inside a FRAME that runs to byte 51"});
  const std::string line = std::string("\x80\x02") + "c" + std::string(std::size_t(3) << 20, 'a');
  counted_storage l{memory_storage(bytes_of(line), "l")};
  CHECK(read_pickle_bytes(l, max_metadata_size).size() == 3 + max_pickle_line);  // the reader refuses it
  CHECK(*l.read <= (std::uint64_t(1) << 20));
  // a truncated pickle: what the file holds, for the reader to call truncated
  CHECK(read_pickle_bytes(counted_storage{memory_storage(bytes_of(md.substr(0, 100)), "t")}, max_metadata_size) ==
        md.substr(0, 100));
}

TEST_CASE("zip directory: as many records as the end record counts are read (torch's miniz), a window at a time") {
  // 3 records of which the end record counts 2 (a 16-bit count that wrapped): the third is not there
  const std::string data(8, '\x11');
  std::string z = zip({{"archive/data.pkl", "P"}, {"archive/version", "3\n"}, {"archive/data/0", data}});
  const std::size_t eocd = z.rfind(std::string("PK\x05\x06", 4));
  z.replace(eocd + 8, 4, le(2, 2) + le(2, 2));
  CHECK_THROWS(locate_torch_zip(z, "f", data.size()));  // "holds no storage record"
  // 20,000 records of 200-byte names (4.2 MB of directory), the count 5: one window is read, not
  // the whole directory
  std::vector<zip_entry_spec> many{{"archive/data.pkl", "P"}, {"archive/data/0", data}};
  for (int i = 0; i < 20000; ++i) many.push_back({"archive/extra/" + std::to_string(i) + std::string(180, 'x'), ""});
  std::string m = zip(many);
  const std::size_t end = m.rfind(std::string("PK\x05\x06", 4));
  m.replace(end + 8, 4, le(5, 2) + le(5, 2));
  std::uint64_t read = 0;
  auto read_at = [&](std::uint64_t off, std::size_t n) {
    read += n;
    return m.substr(static_cast<std::size_t>(off), n);
  };
  auto bad = [](const std::string& why) { fail(errc::invalid_metadata, "m: " + why); };
  const auto dir = detail::read_zip_directory(m.size(), read_at, bad, 1 << 20, std::uint64_t(256) << 20, "t");
  REQUIRE(dir.entries.size() == 5);
  CHECK(dir.entries[1].name == "archive/data/0");
  CHECK(read <= (std::uint64_t(1) << 20) + 70000);
  // a keep filter holds only the records asked for; two names alike but for case are still found
  // among the others
  const auto kept = detail::read_zip_directory(m.size(), read_at, bad, 1 << 20, std::uint64_t(256) << 20, "t",
                                               [](std::string_view n) { return n.ends_with("/data.pkl"); });
  CHECK(kept.entries.size() == 1);
  testing::expect_error(  // the names kept are at most a quarter of the directory's limit
      [&] {
        const std::string all = zip(many);  // every record counted
        auto r = [&](std::uint64_t off, std::size_t n) { return all.substr(static_cast<std::size_t>(off), n); };
        detail::read_zip_directory(all.size(), r, bad, 1 << 20, std::uint64_t(8) << 20, "t");
      },
      errc::invalid_metadata, {"m: the names of the records read for t pass 2097152 bytes"});
  const std::string twice =
      zip({{"archive/data.pkl", "P"}, {"archive/x/Abc", ""}, {"archive/data/0", data}, {"archive/x/aBC", ""}});
  testing::expect_error(
      [&] {
        auto r = [&](std::uint64_t off, std::size_t n) { return twice.substr(static_cast<std::size_t>(off), n); };
        detail::read_zip_directory(twice.size(), r, bad, 1 << 20, 1 << 20, "t",
                                   [](std::string_view n) { return n.ends_with("/data.pkl"); });
      },
      errc::invalid_metadata, {"m: holds two records named 'archive/x/aBC' alike, but for case"});
}
