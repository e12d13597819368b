// Tests of torch DCP folders read through the checkpoint reader (checkpoint/source.hpp's dcp
// source, format/dcp_data.hpp) and the tool: checkpoints written by a real 3-process Gloo world
// of Debian's torch 1.13 (tests/dcp_fixture_dist.py), loaded into 1, 2 and 4 ranks under other
// shardings and compared bit for bit with the bytes torch wrote out itself; digests against
// hashes torch computed; damaged folders; to-hf output read back by torch.
#include <doctest/doctest.h>

#include "support/test_util.hpp"
#include "support/dcp_digest.hpp"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

/// The fixture's output, written once per run of the test executable.
const fs::path& dist_fixture() {
  static testing::temp_dir dir("dcp-dist");
  static const bool made = [] {
    const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp_fixture_dist.py";
    const auto r = testing::peer(testing::torch_python, {script.string(), dir.str()});
    REQUIRE_MESSAGE(r.code == 0, r.err);
    return true;
  }();
  (void)made;
  return dir.path;
}

/// The 1-process fixture's output (tests/dcp_fixture.py), written once per run of the test executable.
const fs::path& single_fixture() {
  static testing::temp_dir dir("dcp1");
  static const bool made = [] {
    const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp_fixture.py";
    const auto r = testing::peer(testing::torch_python, {script.string(), dir.str()});
    REQUIRE_MESSAGE(r.code == 0, r.err);  // torch read its own folders back (the script checks)
    return true;
  }();
  (void)made;
  return dir.path;
}

/// What torch says about each tensor (tests/support/dcp_digest.hpp), by name.
using expected_tensor = testing::torch_digest_entry;

std::map<std::string, expected_tensor> expected(const fs::path& dir) {
  std::map<std::string, expected_tensor> out;
  for (auto& e : testing::read_torch_digest(dir)) out.emplace(e.key, std::move(e));
  return out;
}

/// The bytes of block (offsets, sizes) of a row-major tensor of `shape` held in `raw`,
/// element by element.
std::string block_bytes(const std::string& raw, const shape_t& shape, const shape_t& offsets, const shape_t& sizes,
                        std::size_t item) {
  std::string out;
  const std::uint64_t n = numel(sizes);
  for (std::uint64_t i = 0; i < n; ++i) {
    std::uint64_t rest = i, flat = 0;
    std::vector<std::uint64_t> idx(sizes.size());
    for (std::size_t d = sizes.size(); d-- > 0;) {
      idx[d] = rest % sizes[d];
      rest /= sizes[d];
    }
    for (std::size_t d = 0; d < sizes.size(); ++d) flat = flat * shape[d] + offsets[d] + idx[d];
    out += raw.substr(flat * item, item);
  }
  return out;
}

/// torch.chunk's split of n into k: chunk size ceil(n / k); [begin, end) of chunk i.
std::pair<std::uint64_t, std::uint64_t> chunk_of(std::uint64_t n, std::uint64_t k, std::uint64_t i) {
  const std::uint64_t c = (n + k - 1) / k;
  return {std::min(n, i * c), std::min(n, (i + 1) * c)};
}

/// One rank's view of a tensor: its spec and the bytes it must end up holding.
struct wanted {
  std::optional<shard_spec> spec;
  std::string expect;
};

wanted flat_part(const expected_tensor& t, std::uint64_t world, std::uint64_t rank) {
  const auto [b, e] = chunk_of(numel(t.shape), world, rank);
  const std::size_t item = item_size(t.type);
  return {shard_spec(flat_spec{{b, e}}), t.raw.substr(b * item, (e - b) * item)};
}

wanted block_part(const expected_tensor& t, std::uint64_t world, std::uint64_t rank, std::size_t dim) {
  shape_t off(t.shape.size(), 0), size = t.shape;
  const auto [b, e] = chunk_of(t.shape[dim], world, rank);
  off[dim] = b;
  size[dim] = e - b;
  return {shard_spec(block_spec(size, off)), block_bytes(t.raw, t.shape, off, size, item_size(t.type))};
}

const char* const folders[] = {"ckpt", "ckpt_single"};

}  // namespace

TEST_CASE("dcp: a 3-rank torch world's checkpoint loads into 1, 2 and 4 ranks, flat and in blocks, bit-exact" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  const fs::path& dir = dist_fixture();
  const auto want = expected(dir);
  REQUIRE(want.size() == 8);
  for (const std::string folder : folders) {
    CAPTURE(folder);
    checkpoint_reader<file_directory> r(file_directory(dir / folder));
    CHECK(r.layout() == dcp_layout::info);
    CHECK(r.described_by() == ".metadata");
    REQUIRE(r.non_tensors().size() == 1);
    CHECK(r.non_tensors()[0].key == "extra.epoch");
    REQUIRE(r.metadata().tensors.size() == want.size());
    for (const auto& [key, tm] : r.metadata().tensors) {
      CAPTURE(key);
      REQUIRE(want.count(key));
      CHECK(tm.type == want.at(key).type);
      CHECK(tm.shape == want.at(key).shape);
    }
    // rank 1 held two blocks of model.model.grid: in one file they are two names of it
    if (folder == "ckpt_single") {
      const auto& files = r.find("model.model.grid")->files;
      CHECK(std::count_if(files.begin(), files.end(), [](const auto& f) { return f.first == "__1_0.distcp#1"; }) == 1);
    }
    const checkpoint_report rep = verify_checkpoint(r);
    CHECK(rep.tensors == 8);

    for (const std::uint64_t world : {1, 2, 4})
      for (const std::string how : {"flat", "rows", "cols"})
        for (std::uint64_t rank = 0; rank < world; ++rank) {
          CAPTURE(world);
          CAPTURE(how);
          CAPTURE(rank);
          // a fresh reader per rank, as each rank of a world opens its own
          checkpoint_reader<file_directory> rr(file_directory(dir / folder));
          std::vector<wanted> parts;
          std::vector<std::string> mem;
          std::vector<flat_view> views;
          for (const auto& [key, t] : want) {
            wanted w = t.shape.empty()                        ? wanted{std::nullopt, t.raw}
                       : how == "flat"                        ? flat_part(t, world, rank)
                       : how == "cols" && t.shape.size() == 2 ? block_part(t, world, rank, 1)
                                                              : block_part(t, world, rank, 0);
            parts.push_back(std::move(w));
            mem.emplace_back(parts.back().expect.size(), '\x5a');
          }
          std::size_t i = 0;
          for (const auto& [key, t] : want) {
            views.push_back(flat_view{key, t.type, t.shape, parts[i].spec, reinterpret_cast<std::byte*>(mem[i].data()),
                                      mem[i].size()});
            ++i;
          }
          const load_stats st = load(rr, views);
          std::uint64_t need = 0;
          for (std::size_t j = 0; j < views.size(); ++j) {
            CAPTURE(views[j].key);
            CHECK(testing::hex(mem[j]) == testing::hex(parts[j].expect));
            need += parts[j].expect.size();
          }
          CHECK(st.bytes_needed == need);
          CHECK(st.bytes_read >= need);
          CHECK(st.tensors == want.size());
        }
    // whole tensors, hashed as torch hashed them
    for (const auto& [key, t] : want) {
      CAPTURE(key);
      std::string full(t.raw.size(), '\0');
      unshard_tensor(r, key, std::as_writable_bytes(std::span<char>(full.data(), full.size())));
      CHECK(testing::sha256_hex(full) == t.sha256);
    }
  }
}

TEST_CASE("dcp: the 1-process torch checkpoint of every dtype loads whole and resharded" * testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  const fs::path& fixture = single_fixture();
  for (const std::string folder : folders) {
    CAPTURE(folder);
    checkpoint_reader<file_directory> r(file_directory(fixture / folder));
    REQUIRE(r.non_tensors().size() == 1);
    CHECK(r.non_tensors()[0].key == "step");
    std::size_t n = 0;
    for (const auto& [key, tm] : r.metadata().tensors) {
      CAPTURE(key);
      const std::string raw = testing::slurp(fixture / "raw" / (key + ".bin"));
      const expected_tensor t{key, tm.type, tm.shape, "", raw};
      REQUIRE(raw.size() == numel(tm.shape) * item_size(tm.type));
      std::string full(raw.size(), '\0');
      unshard_tensor(r, key, std::as_writable_bytes(std::span<char>(full.data(), full.size())));
      CHECK(testing::hex(full) == testing::hex(raw));
      if (tm.shape.empty() || numel(tm.shape) == 0) {
        ++n;
        continue;
      }
      for (std::uint64_t rank = 0; rank < 3; ++rank) {
        const wanted w = tm.shape.size() > 1 && rank % 2 ? block_part(t, 3, rank, 1) : flat_part(t, 3, rank);
        std::string mem(w.expect.size(), '\0');
        flat_view v{key, tm.type, tm.shape, w.spec, reinterpret_cast<std::byte*>(mem.data()), mem.size()};
        load(r, std::span<const flat_view>(&v, 1));
        CHECK(testing::hex(mem) == testing::hex(w.expect));
      }
      ++n;
    }
    CHECK(n == 13);
    CHECK(verify_checkpoint(r).tensors == 13);  // every chunk's archive indexed, empty tensors' too
  }
}

namespace {

/// Sets the compression method of every zip record named `*/data/0` in file p (central and
/// local headers) to deflate (8), as a writer that compressed the storage would have.
void mark_compressed(const fs::path& p) {
  std::string b = testing::slurp(p);
  int changed = 0;
  for (std::size_t i = 0; i + 46 < b.size(); ++i) {
    const bool central = b.compare(i, 4, "PK\x01\x02") == 0, local = b.compare(i, 4, "PK\x03\x04") == 0;
    if (!central && !local) continue;
    const std::size_t name_len = static_cast<unsigned char>(b[i + (central ? 28 : 26)]) |
                                 static_cast<unsigned char>(b[i + (central ? 29 : 27)]) << 8;
    const std::string name = b.substr(i + (central ? 46 : 30), name_len);
    if (!name.ends_with("/data/0")) continue;
    b[i + (central ? 10 : 8)] = 8;
    ++changed;
  }
  REQUIRE(changed >= 2);
  testing::write_file(p, b);
}

/// The tool's verify on a damaged folder: exit 1, one line naming each phrase (when the tool
/// was built).
void tool_refuses(const fs::path& ck, const std::vector<std::string>& phrases) {
  if (!testing::have_tool()) return;
  const auto r = testing::run_tool({"verify", ck.string()});
  CHECK(r.code == 1);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  for (const auto& p : phrases) CHECK_MESSAGE(r.err.find(p) != std::string::npos, r.err);
}

/// The data file holding the first chunk of `key`, as the reader of torch's .metadata says.
std::string file_of(const fs::path& dir, const std::string& folder, const std::string& key) {
  checkpoint_reader<file_directory> r(file_directory(dir / folder));
  return r.find(key)->files.front().first;
}

}  // namespace

TEST_CASE("dcp: damaged folders are refused naming file, tensor and rule" * testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  const fs::path& src = dist_fixture();
  auto copy = [&](const testing::temp_dir& t) {
    fs::copy(src / "ckpt", t.path / "ckpt", fs::copy_options::recursive);
    return t.path / "ckpt";
  };
  const std::string rows_file = file_of(src, "ckpt", "model.model.rows");
  auto load_all = [](const fs::path& p) {
    checkpoint_reader<file_directory> r{file_directory(p)};
    for (const auto& [key, tm] : r.metadata().tensors) {
      std::string full(numel(tm.shape) * item_size(tm.type), '\0');
      unshard_tensor(r, key, std::as_writable_bytes(std::span<char>(full.data(), full.size())));
    }
  };
  SUBCASE("a missing data file") {
    testing::temp_dir t("dcp-bad");
    const auto ck = copy(t);
    fs::remove(ck / rows_file);
    testing::expect_error([&] { load_all(ck); }, errc::not_found, {rows_file, "missing", ".metadata"});
    testing::expect_error([&] { verify_checkpoint(file_directory(ck)); }, errc::not_found, {rows_file});
    tool_refuses(ck, {rows_file, "missing"});
  }
  SUBCASE("a truncated data file") {
    testing::temp_dir t("dcp-bad");
    const auto ck = copy(t);
    const std::string b = testing::slurp(ck / rows_file);
    testing::write_file(ck / rows_file, b.substr(0, b.size() / 2));
    testing::expect_error([&] { load_all(ck); }, errc::truncated, {rows_file, "model.model.rows", "passes the end"});
    tool_refuses(ck, {rows_file, "model.model.rows", "passes the end"});
  }
  SUBCASE("a compressed storage record") {
    testing::temp_dir t("dcp-bad");
    const auto ck = copy(t);
    mark_compressed(ck / rows_file);
    testing::expect_error([&] { load_all(ck); }, errc::invalid_metadata, {rows_file, "model.model.rows", "compressed"});
    tool_refuses(ck, {rows_file, "model.model.rows", "compressed"});
  }
  SUBCASE("a data file replaced by a shorter one") {
    testing::temp_dir t("dcp-bad");
    const auto ck = copy(t);
    // lm_head's first chunk (F16 [3, 4]) where a rows chunk (F32 [4, 6]) should be: a shorter archive
    fs::copy_file(ck / file_of(src, "ckpt", "model.lm_head.weight"), ck / rows_file,
                  fs::copy_options::overwrite_existing);
    testing::expect_error([&] { load_all(ck); }, errc::truncated, {rows_file, "model.model.rows", "passes the end"});
  }
  SUBCASE("a chunk whose record holds another size") {
    testing::temp_dir t("dcp-bad");
    const auto ck = copy(t);
    // lm_head's first chunk (F16 [3, 4]: 24 bytes) where cols' first (BF16 [5, 3]: 30 bytes) should
    // be: archives of the same length (data is 64-byte aligned), records of other sizes
    const std::string cols_file = file_of(src, "ckpt", "model.model.cols");
    const std::string lm_file = file_of(src, "ckpt", "model.lm_head.weight");
    REQUIRE(fs::file_size(ck / cols_file) == fs::file_size(ck / lm_file));
    fs::copy_file(ck / lm_file, ck / cols_file, fs::copy_options::overwrite_existing);
    testing::expect_error([&] { load_all(ck); }, errc::invalid_metadata,
                          {cols_file, "model.model.cols", "holds 24 bytes but the chunk needs 30"});
    tool_refuses(ck, {cols_file, "model.model.cols", "holds 24 bytes but the chunk needs 30"});
  }
  SUBCASE("a .metadata that calls os.system is refused by name and nothing runs") {
    testing::temp_dir t("dcp-bad");
    const auto ck = copy(t);
    const fs::path marker = t.path / "ran";
    const std::string cmd = "touch " + marker.string();
    // protocol 2: os.system(cmd)
    std::string p =
        "\x80\x02"
        "cos\nsystem\nX";
    for (int i = 0; i < 4; ++i) p += static_cast<char>((cmd.size() >> (8 * i)) & 0xff);
    p += cmd +
         "\x85"
         "R.";
    testing::write_file(ck / ".metadata", p);
    testing::expect_error([&] { load_all(ck); }, errc::invalid_metadata, {".metadata", "os.system"});
    tool_refuses(ck, {".metadata", "os.system"});
    CHECK_FALSE(fs::exists(marker));
  }
}

TEST_CASE(
    "dcp: a non-tensor item whose value holds tensors (torch 1.13's nested dict) is refused by name, not left "
    "out" *
    testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  testing::temp_dir dir("dcp-nested");
  const fs::path ck = single_fixture() / "ckpt_nested";  // torch 1.13 read it back
  checkpoint_reader<file_directory> r{file_directory(ck)};
  CHECK(r.metadata().tensors.empty());
  REQUIRE(r.non_tensors().size() == 2);
  CHECK(r.read_object("step").as_int("step") == 3);
  const std::vector<std::string> why{"'model'", "2 storage records", "holds tensors", "flattened"};
  testing::expect_error([&] { r.read_object_archive("model"); }, errc::invalid_metadata, why);
  testing::expect_error([&] { verify_checkpoint(r); }, errc::invalid_metadata, why);
  if (!testing::have_tool()) return;
  // every command that reads every tensor refuses it, one line; inspect lists it
  for (const std::string cmd : {"verify", "digest", "unshard", "to-hf", "to-dcp"}) {
    CAPTURE(cmd);
    std::vector<std::string> args{cmd, ck.string()};
    if (cmd == "unshard" || cmd == "to-hf" || cmd == "to-dcp") args.push_back((dir.path / ("out-" + cmd)).string());
    const auto t = testing::run_tool(args);
    CHECK(t.code == 1);
    CHECK(t.out.empty());
    CHECK(std::count(t.err.begin(), t.err.end(), '\n') == 1);
    for (const auto& p : why) CHECK_MESSAGE(t.err.find(p) != std::string::npos, t.err);
  }
  // to-dcp --model-only skips items not under "model.": the item keyed "model" is still refused
  const auto m = testing::run_tool({"to-dcp", "--model-only", ck.string(), (dir.path / "out-model-only").string()});
  CHECK(m.code == 1);
  CHECK(m.err.find("'model'") != std::string::npos);
  const auto i = testing::run_tool({"inspect", ck.string()});
  CHECK(i.code == 0);
  CHECK(i.out.find("model") != std::string::npos);
}

TEST_CASE("dcp: a chunk torch kept transposed is unsharded reading each stored row once, not once a window" *
          testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  // "w" is [1030, 2000] F32 stored as [2000, 1030]: a window of full rows takes a piece of every
  // stored row. Windows of 2^18 elements (131 rows) read the whole chunk each, 8 times in all.
  const fs::path& fixture = single_fixture();
  const std::string raw = testing::slurp(fixture / "raw_transposed.bin");
  REQUIRE(raw.size() == 1030u * 2000u * 4u);
  checkpoint_reader<file_directory> r(file_directory(fixture / "ckpt_transposed"));
  const auto& f = r.file(r.find("w")->files.front().first);
  const auto order = f.header.stored_order(f.header.at("w"));
  REQUIRE(std::vector<std::size_t>(order.begin(), order.end()) == std::vector<std::size_t>{1, 0});
  for (const std::uint64_t chunk : {std::uint64_t(64) << 20, std::uint64_t(4) << 20}) {
    CAPTURE(chunk);
    unshard_options o;
    o.chunk_bytes = chunk;
    std::string got;
    std::size_t windows = 0;
    const load_stats st = for_each_full_chunk(
        r, "w",
        [&](std::span<const std::byte> b, std::uint64_t at) {
          CHECK(at == got.size());
          got.append(reinterpret_cast<const char*>(b.data()), b.size());
          ++windows;
        },
        o);
    CHECK(got == raw);  // bit for bit as torch made it contiguous
    CHECK(st.bytes_needed == raw.size());
    if (chunk == (std::uint64_t(64) << 20)) {
      CHECK(windows == 1);  // the whole chunk fits: each stored row read once, whole
      CHECK(st.bytes_read == raw.size());
    } else {
      CHECK(windows == 2);  // 1 MiB elements: 524 of 1030 indices, the rows read once a window
      CHECK(st.bytes_read <= 2 * raw.size());
    }
  }
}

TEST_CASE(
    "dcp: tensors of a dtype safetensors has no name for (complex128, qint8) are listed and refused by name where "
    "read; the rest of the folder reads, and an export that drops them by a rename runs" *
    testing::torch_check()) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  testing::temp_dir dir("dcp-foreign");
  const fs::path ck = single_fixture() / "ckpt_foreign";
  const std::string raw = testing::slurp(single_fixture() / "raw_foreign_w.bin");
  checkpoint_reader<file_directory> r{file_directory(ck)};
  REQUIRE(r.metadata().tensors.size() == 1);
  REQUIRE(r.foreign_tensors().size() == 2);
  CHECK(r.foreign_tensors()[0].key == "freqs");
  CHECK(r.foreign_tensors()[0].dtype == "torch.complex128");
  CHECK(r.foreign_tensors()[0].shape == shape_t{4, 2});
  CHECK(r.foreign_tensors()[1].key == "q");
  CHECK(r.foreign_tensors()[1].dtype == "torch.qint8");
  CHECK(r.read_object("step").as_int("step") == 5);
  // "w" loads as torch wrote it; asking for "freqs" is refused by name, strict or not
  std::string w(raw.size(), '\0');
  unshard_tensor(r, "w", std::as_writable_bytes(std::span(w)));
  CHECK(testing::hex(w) == testing::hex(raw));
  std::string c(4 * 2 * 8, '\0');
  flat_view v{"freqs", dtype::C64, {4, 2}, std::nullopt, reinterpret_cast<std::byte*>(c.data()), c.size()};
  const std::vector<std::string> why{"'freqs'", "[4,2]", "torch.complex128", "no type for"};
  for (const bool strict : {true, false}) {
    load_options lo;
    lo.strict = strict;
    testing::expect_error([&] { load(r, std::span<const flat_view>(&v, 1), lo); }, errc::unsupported_dtype, why);
  }
  // a load of the rest reports them as checkpoint tensors no view asked for
  std::string half(raw.size() / 2, '\0');
  const flat_view wv{
      "w", dtype::F32, {3, 4}, shard_spec(flat_spec{{6, 12}}), reinterpret_cast<std::byte*>(half.data()), half.size()};
  load_options lenient;
  lenient.strict = false;
  const load_stats ls = load(r, std::span<const flat_view>(&wv, 1), lenient);
  CHECK(half == raw.substr(raw.size() / 2));
  CHECK(ls.unexpected_keys == std::vector<std::string>{"freqs", "q"});
  // what would vouch for or write every tensor refuses them
  testing::expect_error([&] { verify_checkpoint(r); }, errc::unsupported_dtype, why);
  const unshard_source<file_directory> src{&r, ""};
  testing::expect_error(
      [&] {
        file_writer fw((dir.path / "lib.safetensors").string());
        unshard_to_safetensors(std::span<const unshard_source<file_directory>>(&src, 1), fw);
      },
      errc::unsupported_dtype, why);
  if (!testing::have_tool()) return;
  const std::string out = (dir.path / "out").string();
  for (const std::string cmd : {"verify", "digest", "unshard", "to-hf", "to-dcp"}) {
    CAPTURE(cmd);
    std::vector<std::string> args{cmd, ck.string()};
    if (cmd == "unshard" || cmd == "to-hf" || cmd == "to-dcp") args.push_back(out + "-" + cmd);
    const auto t = testing::run_tool(args);
    CHECK(t.code == 1);
    CHECK(std::count(t.err.begin(), t.err.end(), '\n') == 1);
    for (const auto& p : why) CHECK_MESSAGE(t.err.find(p) != std::string::npos, t.err);
    // the exports say how to export the rest, and write nothing
    const bool exports = cmd == "to-hf" || cmd == "to-dcp";
    CHECK(exports == (t.err.find("a rename rule that drops it exports the rest") != std::string::npos));
    if (args.size() == 3) CHECK_FALSE(fs::exists(args[2]));
  }
  const auto i = testing::run_tool({"inspect", ck.string()});
  CHECK(i.code == 0);
  CHECK(i.out.find("2 tensor(s) of a dtype shardsafe has no type for") != std::string::npos);
  CHECK(i.out.find("torch.qint8") != std::string::npos);
  // dropping one by a rename is not enough; dropping both exports the rest
  auto t = testing::run_tool({"to-hf", ck.string(), out + "-one", "--rename", "^freqs$="});
  CHECK(t.code == 1);
  CHECK(t.err.find("'q'") != std::string::npos);
  t = testing::run_tool({"to-hf", ck.string(), out + "-hf", "--rename", "^(freqs|q)$="});
  REQUIRE_MESSAGE(t.code == 0, t.err);
  t = testing::run_tool({"to-dcp", ck.string(), out + "-dcp", "--rename", "^(freqs|q)$="});
  REQUIRE_MESSAGE(t.code == 0, t.err);
  // read back by Python alone: the safetensors file parsed by hand; the DCP folder by
  // tests/dcp_stub_read.py (torch 1.13 does not read torch 2.x's DCP: the Debian 13 leg's suites do)
  const std::string check = R"(
import json, struct, sys
b = open(sys.argv[1] + "/model.safetensors", "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
h.pop("__metadata__", None)
assert list(h) == ["w"] and h["w"]["dtype"] == "F32" and h["w"]["shape"] == [3, 4], h
s, e = h["w"]["data_offsets"]
assert b[8 + n + s:8 + n + e] == open(sys.argv[2], "rb").read()
print("ok")
)";
  const auto pr =
      testing::peer("python3", {"-c", check, out + "-hf", (single_fixture() / "raw_foreign_w.bin").string()});
  CHECK_MESSAGE(pr.code == 0, pr.err);
  CHECK(pr.out == "ok\n");
  const auto st = testing::peer(
      "python3", {(fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp_stub_read.py").string(), out + "-dcp"});
  REQUIRE_MESSAGE(st.code == 0, st.err);
  CHECK(st.out.starts_with("step = 5\nw F32 [3,4] " + testing::sha256_hex(raw) + " 1\n"));
}

// ============================================================ the tool on DCP folders

namespace {

/// Reads OUT/model.safetensors with torch (bytes parsed in Python, tensors made by
/// torch.frombuffer) and compares each tensor with the fixture's full tensors renamed as the
/// dcp-to-hf preset names them, converted to `to` ("" for none) by torch's own .to().
std::string torch_check_hf(const fs::path& file, const std::string& to) {
  const std::string script = R"(
import json, struct, sys
sys.path.insert(0, sys.argv[1])
import dcp_fixture_dist as f
import torch
full = f.full_tensors(1)
ren = {"model.model.rows": "model.rows", "model.model.cols": "model.cols", "model.model.grid": "model.grid",
       "model.lm_head.weight": "lm_head.weight", "model.norm": "norm", "model.conv": "conv", "model.proj": "proj"}
DT = {"F32": torch.float32, "BF16": torch.bfloat16, "F64": torch.float64, "F16": torch.float16, "I64": torch.int64}
b = open(sys.argv[2], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
names = sorted(k for k in h if k != "__metadata__")
assert names == sorted(ren.values()), names
for k, v in ren.items():
    e = h[v]
    s, t = e["data_offsets"]
    x = torch.frombuffer(bytearray(b[8 + n + s:8 + n + t]), dtype=DT[e["dtype"]]).reshape(e["shape"])
    want = full[k] if sys.argv[3] == "" else full[k].to(DT[sys.argv[3]])
    assert x.dtype == want.dtype and torch.equal(x, want), k
print("torch agrees")
)";
  const auto r = testing::peer(testing::torch_python,
                               {"-c", script, (fs::path(SHARDSAFE_SOURCE_DIR) / "tests").string(), file.string(), to});
  return r.code == 0 ? r.out : r.out + r.err;
}

}  // namespace

TEST_CASE("tool: a torch DCP folder: digest as torch hashes, inspect, verify, unshard, to-hf read back by torch" *
          testing::torch_check() * doctest::skip(!testing::have_tool())) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  const fs::path& src = dist_fixture();
  const std::string torch_digest = testing::slurp(src / "digest.txt");
  testing::temp_dir tmp("dcp-tool");
  for (const std::string folder : folders) {
    CAPTURE(folder);
    const std::string ck = (src / folder).string();
    const auto d = testing::run_tool({"digest", ck});
    CHECK(d.code == 0);
    CHECK(d.out == torch_digest);
    const auto i = testing::run_tool({"inspect", ck});
    CHECK(i.code == 0);
    CHECK(i.out.find(": torch.distributed.checkpoint folder, 8 tensors, ") != std::string::npos);
    CHECK(i.out.find(", 1 non-tensor item") != std::string::npos);
    CHECK(i.out.find("extra.epoch") != std::string::npos);
    CHECK(i.out.find("non-tensor item (not loaded)") != std::string::npos);
    // model.model.grid: 4 blocks, in 3 files when rank 1's two are in one
    CHECK(i.out.find(folder == "ckpt" ? "blocks over 4 file(s)" : "blocks (4) over 3 file(s)") != std::string::npos);
    const auto v = testing::run_tool({"verify", ck});
    CHECK(v.code == 0);
    CHECK(v.out == "OK " + ck + ": 8 tensors valid\n");
    const fs::path un = tmp.path / (folder + ".safetensors");
    CHECK(testing::run_tool({"unshard", ck, un.string()}).code == 0);
    CHECK(testing::run_tool({"digest", un.string()}).out == torch_digest);
    for (const std::string to : {"", "BF16"}) {
      CAPTURE(to);
      const fs::path hf = tmp.path / (folder + "-hf" + to);
      std::vector<std::string> args = {"to-hf", ck, hf.string(), "--preset", "dcp-to-hf"};
      if (!to.empty()) args.insert(args.end(), {"--dtype", to});
      const auto t = testing::run_tool(args);
      CHECK_MESSAGE(t.code == 0, t.err);
      CHECK(t.err.find("warning: 3 name(s) a 'model.' key") != std::string::npos);
      CHECK(t.err.find("model.conv -> conv, model.norm -> norm, model.proj -> proj") != std::string::npos);
      CHECK(t.err.find("warning: 1 name(s) not a 'model.' key (optimizer or extra state): dropped: optim.step") !=
            std::string::npos);
      CHECK(torch_check_hf(hf / "model.safetensors", to) == "torch agrees\n");
    }
  }
  // damaged folders: exit 1, one line naming the file and the rule
  const fs::path bad = tmp.path / "bad";
  fs::copy(src / "ckpt", bad, fs::copy_options::recursive);
  testing::write_file(bad / ".metadata", std::string("\x80\x02"
                                                     "cposix\nsystem\nX",
                                                     17) +
                                             std::string("\x04\0\0\0", 4) + "true\x85R.");
  for (const std::string cmd : {"inspect", "verify", "digest"}) {
    const auto r = testing::run_tool({cmd, bad.string()});
    CHECK(r.code == 1);
    CHECK(r.err.find("posix.system") != std::string::npos);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
  fs::copy(src / "ckpt" / ".metadata", bad / ".metadata", fs::copy_options::overwrite_existing);
  const std::string rows = file_of(src, "ckpt", "model.model.rows");
  fs::remove(bad / rows);
  for (const std::string cmd : {"verify", "digest"}) {
    const auto r = testing::run_tool({cmd, bad.string()});
    CHECK(r.code == 1);
    CHECK(r.err.find(rows) != std::string::npos);
  }
}
