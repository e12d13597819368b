// Writing torch.distributed.checkpoint folders without torch (issue 28): the flat-range tiling
// (shard/flat_blocks.hpp), CRC-32 (detail/crc32.hpp), torch.save archives
// (format/torch_zip_writer.hpp), `.metadata` (format/dcp_metadata_writer.hpp) and the collective
// save (checkpoint/dcp_save.hpp), each checked against an independent reader: brute-force element
// enumeration, Python's zlib and zipfile, and tests/dcp_stub_read.py (Python's pickle with
// stand-in classes, reassembling every tensor). torch 2.x itself reads these folders in the
// Debian 13 leg (tests/torch/test_dcp2.cpp). Also the golden folder torch 2.6 wrote
// (tests/fixtures/dcp_torch2/), read here without torch.
#include "shardsafe/checkpoint/dcp_save.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/dcp_export.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/detail/crc32.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/format/torch_zip_writer.hpp"
#include "shardsafe/shard/flat_blocks.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

const fs::path source_dir = SHARDSAFE_SOURCE_DIR;

/// tests/dcp_stub_read.py's lines for a folder (Python without torch).
std::string stub_read(const fs::path& dir) {
  const auto r = testing::peer("python3", {(source_dir / "tests" / "dcp_stub_read.py").string(), dir.string()});
  REQUIRE_MESSAGE(r.code == 0, r.out << r.err);
  return r.out;
}

/// The byte of element-byte i of tensor `key` (a value no two tensors share at the same place).
unsigned char value_byte(const std::string& key, std::uint64_t i) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  h ^= i * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  return static_cast<unsigned char>(h & 0xff);
}

std::string full_bytes(const std::string& key, dtype t, const shape_t& shape) {
  std::string b(static_cast<std::size_t>(numel(shape) * item_size(t)), '\0');
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(value_byte(key, i));
  if (t == dtype::BOOL)
    for (auto& c : b) c = static_cast<char>(c & 1);
  return b;
}

}  // namespace

TEST_CASE("dcp write: a flat range is tiled by at most 2 * ndim - 1 blocks, in order (brute force)") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t nd = 1 + rng() % 4;
    shape_t shape(nd);
    for (auto& d : shape) d = rng() % 5;
    const std::uint64_t n = numel(shape);
    const std::uint64_t b = n ? rng() % (n + 1) : 0, e = n ? b + rng() % (n - b + 1) : 0;
    CAPTURE(to_string(shape));
    CAPTURE(b);
    CAPTURE(e);
    const auto blocks = blocks_of_range(shape, {b, e});
    CHECK(blocks.size() <= 2 * nd - 1);
    // the blocks' elements, each block row-major, one after another, are exactly b, b+1, ..., e-1
    std::vector<std::uint64_t> got;
    for (const auto& blk : blocks) {
      REQUIRE(blk.offsets.size() == nd);
      std::vector<std::uint64_t> idx(nd, 0);
      const std::uint64_t m = numel(blk.sizes);
      CHECK(m > 0);
      for (std::uint64_t k = 0; k < m; ++k) {
        std::uint64_t flat = 0;
        for (std::size_t d = 0; d < nd; ++d) flat = flat * shape[d] + blk.offsets[d] + idx[d];
        got.push_back(flat);
        for (std::size_t d = nd; d-- > 0;) {
          if (++idx[d] < blk.sizes[d]) break;
          idx[d] = 0;
        }
      }
    }
    std::vector<std::uint64_t> want;
    for (std::uint64_t i = b; i < e; ++i) want.push_back(i);
    CHECK(got == want);
  }
  CHECK(blocks_of_range(shape_t{}, {0, 1}).size() == 1);  // a 0-d tensor
  CHECK_THROWS_AS(blocks_of_range(shape_t{2, 3}, {4, 7}), error);
}

TEST_CASE("crc32: the check value, Python's zlib on random bytes, and pieces joined by crc32_combine") {
  const std::string check = "123456789";
  CHECK(detail::crc32_of(std::as_bytes(std::span<const char>(check.data(), check.size()))) == 0xCBF43926u);
  std::mt19937_64 rng(3);
  std::string data(300000, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  const auto bytes = std::as_bytes(std::span<const char>(data.data(), data.size()));
  const std::uint32_t whole = detail::crc32_of(bytes);
  testing::temp_dir dir("crc");
  testing::write_file(dir.path / "r.bin", data);
  const auto py = testing::peer("python3", {"-c", "import sys, zlib; print(zlib.crc32(open(sys.argv[1], 'rb').read()))",
                                            (dir.path / "r.bin").string()});
  REQUIRE_MESSAGE(py.code == 0, py.err);
  CHECK(py.out == std::to_string(whole) + "\n");
  for (std::size_t cut :
       {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(4096), std::size_t(123457), data.size()}) {
    const std::uint32_t a = detail::crc32_of(bytes.subspan(0, cut)), b = detail::crc32_of(bytes.subspan(cut));
    CHECK(detail::crc32_combine(a, b, data.size() - cut) == whole);
  }
}

TEST_CASE(
    "torch.save archives: Python's zipfile reads every record (CRC-32 checked); shardsafe's reader finds the tensor") {
  testing::temp_dir dir("zipw");
  struct one {
    const char* name;
    dtype type;
    shape_t shape;
    const char* global;
  };
  const one cases[] = {{"f32", dtype::F32, {2, 3}, "FloatStorage"},     {"bf16", dtype::BF16, {5}, "BFloat16Storage"},
                       {"scalar", dtype::F64, {}, "DoubleStorage"},     {"empty", dtype::I64, {0, 3}, "LongStorage"},
                       {"f8", dtype::F8_E4M3, {3, 2}, "float8_e4m3fn"}, {"u16", dtype::U16, {4}, "uint16"}};
  for (const auto& c : cases) {
    CAPTURE(c.name);
    torch_tensor_archive a(c.type, c.shape);
    const std::string data = full_bytes(c.name, c.type, c.shape);
    const std::string all =
        a.head() + data + a.tail(detail::crc32_of(std::as_bytes(std::span<const char>(data.data(), data.size()))));
    CHECK(all.size() == a.size());
    testing::write_file(dir.path / (std::string(c.name) + ".pt"), all);
    // Python's zipfile: every CRC, the names, data/0 holding the bytes, a pickle naming the storage class
    testing::write_file(dir.path / "data.bin", data);
    const auto py2 = testing::peer(
        "python3", {"-c",
                    "import sys, zipfile, pickletools, io\n"
                    "z = zipfile.ZipFile(sys.argv[1]); assert z.testzip() is None\n"
                    "print(sorted(z.namelist()))\n"
                    "print(z.read('archive/data/0') == open(sys.argv[2], 'rb').read())\n"
                    "out = io.StringIO(); pickletools.dis(z.read('archive/data.pkl'), out=out); print(sys.argv[3] in "
                    "out.getvalue())\n"
                    "print(all((i.header_offset + 30 + len(i.filename) + 4) % 64 <= 64 for i in z.infolist()))\n",
                    (dir.path / (std::string(c.name) + ".pt")).string(), (dir.path / "data.bin").string(), c.global});
    REQUIRE_MESSAGE(py2.code == 0, py2.err);
    CHECK(py2.out ==
          "['archive/byteorder', 'archive/data.pkl', 'archive/data/0', 'archive/version']\nTrue\nTrue\nTrue\n");
    // shardsafe's reader: the storage record where the data is, data.pkl the chunk's tensor
    const torch_zip_archive z = locate_torch_zip(all, c.name, numel(c.shape) * item_size(c.type));
    CHECK(z.storage.data_offset == a.head().size());
    CHECK(z.storage.data_offset % 64 == 0);  // aligned as torch aligns its records
    REQUIRE(z.pickle);
    const torch_zip_tensor t = parse_torch_tensor_pickle(all.substr(z.pickle->data_offset, z.pickle->size), c.name);
    check_torch_zip_tensor(t, z.storage, c.type, c.shape, c.name);
  }
  // a non-tensor item: data.pkl alone, the value pickled
  const std::string v =
      torch_value_archive(pickle_dumps(pickle_value::tuple({pickle_value::real(0.9), pickle_value::real(0.95)})));
  const torch_zip_archive z = locate_torch_zip(v, "value", torch_zip_value);
  REQUIRE(z.pickle);
  CHECK(pickle_loads(v.substr(z.pickle->data_offset, z.pickle->size), "value") ==
        pickle_value::tuple({pickle_value::real(0.9), pickle_value::real(0.95)}));
  CHECK_THROWS_WITH_AS(locate_torch_zip(v, "value", 16), doctest::Contains("holds no storage record"), error);
}

TEST_CASE("torch.save archives past 4 GiB are written in zip64 form that Python's zipfile and shardsafe read") {
  testing::temp_dir dir("zip64");
  const shape_t shape{std::uint64_t(5) << 30};  // 5 GiB of U8, sparse on disk
  torch_tensor_archive a(dtype::U8, shape);
  // the CRC-32 of 5 GiB of zeros, by doubling with crc32_combine (and checked on a small size)
  auto zeros_crc = [](std::uint64_t n) {
    std::uint32_t crc = 0;
    std::uint64_t done = 0;
    std::uint32_t piece = 0;  // CRC of 2^k zero bytes
    std::string one(1, '\0');
    piece = detail::crc32_of(std::as_bytes(std::span<const char>(one.data(), 1)));
    for (std::uint64_t len = 1; done < n; len *= 2) {
      if (n & len) {
        crc = detail::crc32_combine(crc, piece, len);
        done += len;
      }
      piece = detail::crc32_combine(piece, piece, len);
    }
    return crc;
  };
  const std::string z4096(4096, '\0');
  CHECK(zeros_crc(4096) == detail::crc32_of(std::as_bytes(std::span<const char>(z4096.data(), z4096.size()))));
  const std::string tail = a.tail(zeros_crc(shape[0]));
  const fs::path f = dir.path / "big.pt";
  {
    const int fd = ::open(f.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::pwrite(fd, a.head().data(), a.head().size(), 0) == static_cast<ssize_t>(a.head().size()));
    const off_t at = static_cast<off_t>(a.head().size() + shape[0]);
    REQUIRE(::pwrite(fd, tail.data(), tail.size(), at) == static_cast<ssize_t>(tail.size()));
    ::close(fd);
  }
  CHECK(fs::file_size(f) == a.size());
  const auto py = testing::peer(
      "python3",
      {"-c",
       "import sys, zipfile\n"
       "z = zipfile.ZipFile(sys.argv[1])\n"
       "i = z.getinfo('archive/data/0'); v = z.getinfo('archive/version')\n"
       "print(i.file_size, v.header_offset > 2**32, z.read('archive/version'), z.read('archive/byteorder'))\n",
       f.string()});
  REQUIRE_MESSAGE(py.code == 0, py.err);
  CHECK(py.out == std::to_string(shape[0]) + " True b'3\\n' b'little'\n");
  file_storage st(f);
  dcp_file_chunk c{"big", dtype::U8, {0}, shape, 0, a.size()};
  dcp_data_file df{"big.pt", false, {c}};
  const safetensors_header h = index_dcp_data_file(st, df);
  REQUIRE(h.tensors.size() == 1);
  CHECK(h.tensors[0].begin == a.head().size());
}

TEST_CASE(
    "dcp save: 3 ranks write flat, block, replicated, 0-d and empty tensors and values; Python reads back each "
    "tensor") {
  testing::temp_dir dir("dcp-save");
  struct tensor_def {
    std::string key;
    dtype type;
    shape_t shape;
  };
  const std::vector<tensor_def> defs{{"a", dtype::F32, {5, 7}},  {"b", dtype::BF16, {6, 4}}, {"c", dtype::I64, {3}},
                                     {"d", dtype::F32, {}},      {"e", dtype::BOOL, {2, 3}}, {"f", dtype::F16, {0, 4}},
                                     {"g", dtype::U8, {4, 3, 2}}};
  std::map<std::string, std::string> full;
  for (const auto& d : defs) full[d.key] = full_bytes(d.key, d.type, d.shape);
  const std::vector<dcp_object> objects{
      {"epoch", pickle_value::integer(7)},
      {"betas", pickle_value::tuple({pickle_value::real(0.9), pickle_value::real(0.95)})},
      {"params", pickle_value::list({pickle_value::string("a"), pickle_value::string("b")})}};
  std::map<std::string, pickle_value> paths{
      {"a", pickle_value::tuple({pickle_value::string("model"), pickle_value::string("a")})},
      {"epoch", pickle_value::tuple({pickle_value::string("x"), pickle_value::integer(0)})}};
  auto save = [&](const fs::path& where, bool overwrite) {
    return testing::run_ranks(3, [&](testing::thread_comm& comm) {
      const int r = comm.rank();
      std::vector<std::string> memory;
      memory.reserve(16);
      std::vector<flat_view> views;
      auto local = [&](const std::string& key, std::initializer_list<std::pair<std::uint64_t, std::uint64_t>> ranges) {
        std::string m;
        const std::uint64_t it =
            item_size(std::find_if(defs.begin(), defs.end(), [&](auto& d) { return d.key == key; })->type);
        for (auto [b, e] : ranges) m += full[key].substr(b * it, (e - b) * it);
        return &memory.emplace_back(std::move(m));
      };
      auto add = [&](const std::string& key, std::optional<shard_spec> spec, std::string* m,
                     replica_role role = replica_role::none) {
        const auto& d = *std::find_if(defs.begin(), defs.end(), [&](auto& x) { return x.key == key; });
        flat_view v{key, d.type, d.shape, std::move(spec), reinterpret_cast<std::byte*>(m->data()), m->size()};
        v.replica = role;
        views.push_back(std::move(v));
      };
      // a: flat ranges, rank 1 holding two, crossing rows
      if (r == 0) add("a", shard_spec(flat_spec{{0, 9}}), local("a", {{0, 9}}));
      if (r == 1) add("a", shard_spec(flat_spec{{9, 20}, {20, 21}}), local("a", {{9, 21}}));
      if (r == 2) add("a", shard_spec(flat_spec{{21, 35}}), local("a", {{21, 35}}));
      // b: row blocks, rank 2's empty (at the end)
      if (r == 0) add("b", shard_spec(block_spec({2, 4}, {0, 0})), local("b", {{0, 8}}));
      if (r == 1) add("b", shard_spec(block_spec({4, 4}, {2, 0})), local("b", {{8, 24}}));
      if (r == 2) add("b", shard_spec(block_spec({0, 4}, {6, 0})), local("b", {}));
      // c, d, f: not sharded, every rank holds them (the lowest writes them)
      add("c", std::nullopt, local("c", {{0, 3}}));
      add("d", std::nullopt, local("d", {{0, 1}}));
      add("f", std::nullopt, local("f", {}));
      // e: a replicated block on ranks 0 (writer) and 1 (copy)
      if (r < 2)
        add("e", shard_spec(block_spec({2, 3}, {0, 0})), local("e", {{0, 6}}),
            r == 0 ? replica_role::writer : replica_role::copy);
      // g: 3-D flat ranges crossing planes
      if (r == 0) add("g", shard_spec(flat_spec{{0, 5}}), local("g", {{0, 5}}));
      if (r == 1) add("g", shard_spec(flat_spec{{5, 17}}), local("g", {{5, 17}}));
      if (r == 2) add("g", shard_spec(flat_spec{{17, 24}}), local("g", {{17, 24}}));
      save_options o;
      o.overwrite = overwrite;
      save_dcp(file_directory(where), std::span<const flat_view>(views), comm, o, std::span<const dcp_object>(objects),
               paths);
    });
  };
  const fs::path ckpt = dir.path / "ckpt";
  for (const auto& e : save(ckpt, false)) CHECK(e == nullptr);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(ckpt)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  CHECK(files == std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"});
  // Python, without torch: each tensor reassembled from its chunks, every CRC checked
  std::string want;
  for (const auto& d : defs)
    want += d.key + " " + std::string(to_string(d.type)) + " " + to_string(d.shape) + " " +
            testing::sha256_hex(full[d.key]) + " ";
  const std::string got = stub_read(ckpt);
  for (const auto& d : defs) {
    CAPTURE(d.key);
    CHECK(got.find(d.key + " " + std::string(to_string(d.type)) + " " + to_string(d.shape) + " " +
                   testing::sha256_hex(full[d.key]) + " ") != std::string::npos);
  }
  CHECK(got.find("\nb BF16 [6,4] " + testing::sha256_hex(full["b"]) + " 2\n") !=
        std::string::npos);  // the empty block is no chunk
  CHECK(got.find("\ne BOOL [2,3] " + testing::sha256_hex(full["e"]) + " 1\n") !=
        std::string::npos);                                                                   // replicas written once
  CHECK(got.find("\nf F16 [0,4] " + testing::sha256_hex("") + " 1\n") != std::string::npos);  // the empty tensor listed
  CHECK(got.find("epoch = 7\n") != std::string::npos);
  CHECK(got.find("betas = (0.9, 0.95)\n") != std::string::npos);
  CHECK(got.find("params = ['a', 'b']\n") != std::string::npos);
  CHECK(got.find("planner a ('model', 'a')\n") != std::string::npos);
  CHECK(got.find("planner epoch ('x', 0)\n") != std::string::npos);
  CHECK(got.find("planner c ('c',)\n") != std::string::npos);
  // shardsafe reads it back too: every tensor whole, the values
  checkpoint_reader<file_directory> r(file_directory{ckpt});
  CHECK(r.layout() == dcp_layout::info);
  for (const auto& d : defs) {
    std::string back(full[d.key].size(), '\0');
    unshard_tensor(r, d.key, std::as_writable_bytes(std::span(back)));
    CHECK_MESSAGE(back == full[d.key], d.key);
  }
  CHECK(r.read_object("epoch") == pickle_value::integer(7));
  // a second save into it needs overwrite; with it, .metadata goes first and comes back last
  for (const auto& e : save(ckpt, false)) {
    REQUIRE(e != nullptr);
    CHECK(testing::error_code_of(e) == make_error_code(errc::already_exists));
  }
  for (const auto& e : save(ckpt, true)) CHECK(e == nullptr);
  CHECK(stub_read(ckpt) == got);
}

TEST_CASE("dcp save: ranks that disagree fail on every rank and leave no .metadata") {
  testing::temp_dir dir("dcp-disagree");
  std::vector<float> m(12, 1.f);
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& comm) {
    const shape_t shape = comm.rank() == 0 ? shape_t{3, 4} : shape_t{4, 3};
    std::vector<flat_view> v{{"w", dtype::F32, shape, shard_spec(flat_spec{{comm.rank() * 6u, comm.rank() * 6u + 6}}),
                              reinterpret_cast<std::byte*>(m.data() + comm.rank() * 6), 24}};
    save_options o;
    o.format = save_format::dcp;
    save(file_directory(dir.path / "ckpt"), std::span<const flat_view>(v), comm, o);
  });
  for (const auto& e : thrown) {
    REQUIRE(e != nullptr);
    CHECK(testing::error_message_of(e).find("tensor 'w': rank 0 saves shape [3,4] but rank 1 saves [4,3]") !=
          std::string::npos);
  }
  CHECK(!fs::exists(dir.path / "ckpt" / ".metadata"));
}

namespace {
/// A file_directory that logs every remove(n) as its path under the root: the order a save that
/// overwrites, or a rotation, takes things away.
struct removal_log_directory {
  using reader_type = file_storage;
  using writer_type = file_writer;
  file_directory d;
  std::string at;  // under the root: "" or "a/b/"
  std::vector<std::string>* log;
  std::string_view name() const noexcept { return d.name(); }
  reader_type open(std::string_view n) const { return d.open(n); }
  writer_type create(std::string_view n) const { return d.create(n); }
  bool exists(std::string_view n) const { return d.exists(n); }
  std::vector<std::string> list() const { return d.list(); }
  void remove(std::string_view n) const {
    if (d.exists(n)) log->push_back(at + std::string(n));
    d.remove(n);
  }
  removal_log_directory sub(std::string_view n) const { return {d.sub(n), at + std::string(n) + "/", log}; }
  void make() const { d.make(); }
};
}  // namespace

TEST_CASE(
    "checkpoints of every layout: a DCP model + optimizer pair counts as complete, is rotated as one, and loses its "
    "mark first") {
  testing::temp_dir dir("dcp-rotation");
  single_process comm;
  std::vector<float> w(12), m(12);
  auto views_of = [&](float base) {
    for (std::size_t i = 0; i < 12; ++i) w[i] = base + float(i), m[i] = -base - float(i);
    return std::vector<flat_view>{{"w", dtype::F32, {3, 4}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 48}};
  };
  auto optim_of = [&] {
    return std::vector<flat_view>{
        {"state.w.exp_avg", dtype::F32, {3, 4}, std::nullopt, reinterpret_cast<std::byte*>(m.data()), 48}};
  };
  save_options dcp;
  dcp.format = save_format::dcp;
  const file_directory root(dir.path);
  // step1: a pair as DCP folders; step2: a plain checkpoint; step3: a pair in shardsafe's layout;
  // step4: a DCP folder; step5: a pair killed before its commit (optim/ written, model/ not)
  {
    const auto v = views_of(1), o = optim_of();
    save(root.sub("step1"), std::span<const folder_views>(model_and_optim_folders(v, o, true)), comm, dcp);
  }
  save(root.sub("step2"), std::span<const flat_view>(views_of(2)), comm);
  {
    const auto v = views_of(3), o = optim_of();
    save(root.sub("step3"), std::span<const folder_views>(model_and_optim_folders(v, o, true)), comm);
  }
  save(root.sub("step4"), std::span<const flat_view>(views_of(4)), comm, dcp);
  save(root.sub("step5").sub(std::string(optim_folder_name)), std::span<const flat_view>(optim_of()), comm, dcp);
  root.sub("step5").sub(std::string(model_folder_name)).make();
  REQUIRE(fs::exists(dir.path / "step1" / "model" / ".metadata"));

  std::vector<std::uint64_t> steps;
  std::vector<bool> complete;
  for (const auto& e : list_checkpoints(root)) steps.push_back(e.step), complete.push_back(e.complete);
  CHECK(steps == std::vector<std::uint64_t>{1, 2, 3, 4, 5});
  CHECK(complete == std::vector<bool>{true, true, true, true, false});
  CHECK(latest_checkpoint(root)->name == "step4");
  // keep 4: nothing goes (step5, unfinished, is newer than the newest complete one)
  CHECK(rotate_checkpoints(root, 4, comm).empty());
  std::vector<float> back(12);
  std::vector<flat_view> into{{"w", dtype::F32, {3, 4}, std::nullopt, reinterpret_cast<std::byte*>(back.data()), 48}};
  load(root.sub("step1").sub(std::string(model_folder_name)), std::span<const flat_view>(into));
  for (std::size_t i = 0; i < 12; ++i) REQUIRE(back[i] == 1.f + float(i));
  // a removal takes the pair's commit mark first
  std::vector<std::string> log;
  const removal_log_directory logged{root, "", &log};
  CHECK(rotate_checkpoints(logged, 3, comm) == std::vector<std::string>{"step1"});
  REQUIRE(log.size() == 2u);
  CHECK(log[0] == "step1/model/.metadata");
  CHECK(log[1] == "step1");
  CHECK(latest_checkpoint(root)->name == "step4");

  // an overwrite takes the old checkpoint's marks first, whatever its layout: a pair's
  // model/metadata.json goes before the folders (a cut there leaves nothing that looks complete)
  log.clear();
  save_options replace;
  replace.overwrite = true;
  save(logged.sub("step3"), std::span<const flat_view>(views_of(5)), comm, replace);
  REQUIRE(log.size() >= 3u);
  CHECK(log[0] == "step3/model/metadata.json");
  CHECK(std::find(log.begin(), log.end(), "step3/model") > log.begin());
  CHECK(is_complete_checkpoint(root.sub("step3")));
  CHECK(fs::exists(dir.path / "step3" / "metadata.json"));
  CHECK(!fs::exists(dir.path / "step3" / "model"));
}

TEST_CASE(
    "dcp: the golden folder torch 2.6 wrote (4 ranks of DTensors, pieces channels_last and transposed) reads as torch "
    "computed it, values included") {
  const fs::path golden = source_dir / "tests" / "fixtures" / "dcp_torch2";
  checkpoint_reader<file_directory> r(file_directory{golden / "ckpt"});
  CHECK(r.layout() == dcp_layout::info);
  std::string digest;
  for (const auto& [key, tm] : r.metadata().tensors) {
    std::string bytes(static_cast<std::size_t>(tm.numel() * item_size(tm.type)), '\0');
    unshard_tensor(r, key, std::as_writable_bytes(std::span(bytes)));
    digest += key + " " + std::string(to_string(tm.type)) + " " + to_string(tm.shape) + " " +
              testing::sha256_hex(bytes) + "\n";
  }
  CHECK(digest == testing::slurp(golden / "digest.txt"));
  CHECK(r.read_object("extra.epoch") == pickle_value::integer(7));
  CHECK(r.read_object("optim.param_groups.0.lr") == pickle_value::real(0.01));
  CHECK(r.read_object("optim.param_groups.0.betas") ==
        pickle_value::tuple({pickle_value::real(0.9), pickle_value::real(0.95)}));
  CHECK(r.read_object("optim.param_groups.0.params") ==
        pickle_value::list({pickle_value::string("0.weight"), pickle_value::string("0.bias")}));
  const pickle_value* p = r.path_in_state_dict("optim.param_groups.0.lr");
  REQUIRE(p);
  CHECK(*p == pickle_value::tuple({pickle_value::string("optim"), pickle_value::string("param_groups"),
                                   pickle_value::integer(0), pickle_value::string("lr")}));
  // the pieces torch.save kept channels_last (conv) and transposed (tied, whole_t) are read in
  // their order: their digest lines above are torch's
  for (const auto& [key, order] : {std::pair<std::string, std::vector<std::size_t>>{"extra.conv", {0, 2, 3, 1}},
                                   {"extra.tied", {1, 0}},
                                   {"extra.whole_t", {1, 0}}}) {
    CAPTURE(key);
    const tensor_metadata* tm = r.find(key);
    REQUIRE(tm);
    const auto& f = r.file(tm->files.front().first);
    const auto got = f.header.stored_order(f.header.at(key));
    CHECK(std::vector<std::size_t>(got.begin(), got.end()) == order);
  }
  // HSDP replicas: torch wrote each [Replicate(), Shard(0)] piece once
  const tensor_metadata* hsdp = r.find("extra.hsdp");
  REQUIRE(hsdp);
  CHECK(hsdp->files.size() == 2);
}

TEST_CASE(
    "dcp export: a model + optimizer pair and a DCP folder written as DCP, read back by Python as the source holds "
    "them") {
  testing::temp_dir dir("dcp-export");
  const fs::path golden = source_dir / "tests" / "fixtures" / "dcp_torch2" / "ckpt";
  // DCP -> DCP: every tensor and value, the planner paths kept
  checkpoint_reader<file_directory> r(file_directory{golden});
  const unshard_source<file_directory> src{&r, ""};
  const auto st = export_to(std::span<const unshard_source<file_directory>>(&src, 1), file_directory(dir.path / "out"),
                            dcp_export_options{});
  CHECK(st.tensors == r.metadata().tensors.size());
  CHECK(st.objects == r.non_tensors().size());
  const std::string a = stub_read(golden), b = stub_read(dir.path / "out");
  // the same tensors, values and paths; each tensor now one chunk
  auto strip_chunks = [](const std::string& s) {
    std::istringstream in(s);
    std::string out;
    for (std::string l; std::getline(in, l);) {
      if (l.find(" = ") == std::string::npos && !l.starts_with("planner ")) l = l.substr(0, l.rfind(' '));
      out += l + "\n";
    }
    return out;
  };
  CHECK(strip_chunks(a) == strip_chunks(b));
  // --model-only and renames; a non-empty output folder is refused
  dcp_export_options o;
  o.model_only = true;
  o.rename.add("^model\\.(.*)$=\\1");
  export_to(std::span<const unshard_source<file_directory>>(&src, 1), file_directory(dir.path / "model"), o);
  const std::string m = stub_read(dir.path / "model");
  CHECK(m.find("0.weight F32 [3,4] ") != std::string::npos);
  CHECK(m.find("optim.") == std::string::npos);
  CHECK(m.find("extra.") == std::string::npos);
  CHECK_THROWS_WITH_AS(export_to(std::span<const unshard_source<file_directory>>(&src, 1),
                                 file_directory(dir.path / "model"), dcp_export_options{}),
                       doctest::Contains("not empty"), error);
}

TEST_CASE(
    "dcp export: a DCP item that is not plain data (bytes, as torchtitan keeps its dataloader's state) is copied byte "
    "for byte") {
  using namespace std::string_literals;
  testing::temp_dir dir("dcp-export-raw");
  // Python's pickle of b"abc" (protocol 2): a call of _codecs.encode, which plain data refuses
  const std::string pk =
      "\x80\x02"
      "c_codecs\nencode\n"
      "q\x00"
      "X\x03\x00\x00\x00"
      "abc"
      "q\x01"
      "X\x06\x00\x00\x00"
      "latin1"
      "q\x02"
      "\x86"
      "q\x03"
      "R"
      "q\x04"
      "."s;
  const std::string archive = torch_value_archive(pk);
  fs::create_directories(dir.path / "src");
  testing::write_file(dir.path / "src" / "__0_0.distcp", archive);
  testing::write_file(dir.path / "src" / "__1_0.distcp", std::string(64, 'z'));  // not an archive
  dcp_metadata md;
  dcp_item& blob = md.items["extra.blob"];
  blob.is_bytes = true;
  blob.bytes = {"__0_0.distcp", 0, archive.size()};
  dcp_item& junk = md.items["extra.junk"];
  junk.is_bytes = true;
  junk.bytes = {"__1_0.distcp", 0, 64};
  testing::write_file(dir.path / "src" / ".metadata", write_dcp_metadata(md));
  checkpoint_reader<file_directory> r(file_directory{dir.path / "src"});
  REQUIRE(r.non_tensors().size() == 2u);
  testing::expect_error([&] { (void)r.read_object("extra.blob"); }, errc::invalid_metadata, {"'extra.blob'", "GLOBAL"});
  CHECK(r.read_object_archive("extra.blob") == archive);
  const unshard_source<file_directory> src{&r, ""};
  // the item that is not an archive is refused when copied, and left unread when dropped
  testing::expect_error(
      [&] {
        export_to(std::span<const unshard_source<file_directory>>(&src, 1), file_directory(dir.path / "all"),
                  dcp_export_options{});
      },
      errc::invalid_metadata, {"__1_0.distcp", "'extra.junk'"});
  dcp_export_options keep_blob;
  keep_blob.rename.add("^extra\\.junk$=");
  const auto st =
      export_to(std::span<const unshard_source<file_directory>>(&src, 1), file_directory(dir.path / "out"), keep_blob);
  CHECK(st.objects == 1u);
  checkpoint_reader<file_directory> out(file_directory{dir.path / "out"});
  CHECK(out.read_object_archive("extra.blob") == archive);
  CHECK(stub_read(dir.path / "out").find("extra.blob = b'abc'\n") !=
        std::string::npos);  // Python's own pickle reads it
  // both dropped: an export of nothing is refused, naming the rule (issue 53), before any item is read
  dcp_export_options drop;
  drop.rename.add("^extra\\..*$=");
  testing::expect_error(
      [&] {
        export_to(std::span<const unshard_source<file_directory>>(&src, 1), file_directory(dir.path / "dropped"), drop);
      },
      errc::invalid_argument, {"drop all 2 keys", "'^extra\\..*$='"});
  CHECK(!fs::exists(dir.path / "dropped" / ".metadata"));
}
