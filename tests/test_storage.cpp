// Conformance suites for storage/concepts.hpp: one over every ReadableStorage backend and one
// over every directory backend, plus static checks that the backends model their concepts.
#include "shardsafe/storage/concepts.hpp"

#include <doctest/doctest.h>

#include "test_util.hpp"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"

using namespace shardsafe;
using testing::temp_dir;
namespace fs = std::filesystem;

namespace {

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> b(n);
  for (auto& x : b) x = static_cast<std::byte>(rng());
  return b;
}

std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

template <class F>
void expect_errc(F&& f, errc code, std::string_view phrase) {
  try {
    f();
    FAIL("no error thrown");
  } catch (const shardsafe::error& e) {
    CHECK(e.code() == code);
    CHECK_MESSAGE(std::string(e.what()).find(phrase) != std::string::npos, e.what(), " lacks ", phrase);
  }
}

// How to get a storage holding given bytes, for each ReadableStorage backend.
template <class S>
struct storage_maker;

template <class S>
struct file_backed_maker {
  temp_dir tmp;
  int n = 0;
  S make(const std::vector<std::byte>& bytes) {
    const fs::path p = tmp.path / ("obj" + std::to_string(n++) + ".bin");
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return S(p);
  }
  std::string name_of(int i) const { return (tmp.path / ("obj" + std::to_string(i) + ".bin")).string(); }
};
template <>
struct storage_maker<file_storage> : file_backed_maker<file_storage> {};
template <>
struct storage_maker<mmap_storage> : file_backed_maker<mmap_storage> {};
template <>
struct storage_maker<memory_storage> {
  int n = 0;
  memory_storage make(const std::vector<std::byte>& bytes) { return memory_storage(bytes, name_of(n++)); }
  std::string name_of(int i) const { return "mem-object-" + std::to_string(i); }
};

// A fresh, empty directory of each directory backend.
template <class D>
struct directory_maker;
template <class Reader>
struct directory_maker<basic_file_directory<Reader>> {
  temp_dir tmp;
  basic_file_directory<Reader> dir{tmp.path};
  std::size_t files_on_disk() const {
    return static_cast<std::size_t>(std::distance(fs::recursive_directory_iterator(tmp.path), {}));
  }
};
template <>
struct directory_maker<memory_directory> {
  memory_directory dir{std::make_shared<memory_store>(), "mem:root"};
  std::size_t files_on_disk() const { return dir.store()->objects.size(); }
};

template <ReadableDirectory D>
std::vector<std::byte> read_all(const D& d, std::string_view n) {
  auto r = d.open(n);
  std::vector<std::byte> b(r.size());
  r.read_into(0, b);
  return b;
}

template <WritableDirectory D>
void put(const D& d, std::string_view n, std::string_view content) {
  auto w = d.create(n);
  w.write_at(0, bytes_of(content));
  w.commit();
}

std::string str(const std::vector<std::byte>& b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

}  // namespace

// ---------------------------------------------------------------------------------------
// static checks

struct no_read_into {
  std::uint64_t size() const { return 0; }
  std::string_view name() const { return ""; }
};
struct no_size {
  void read_into(std::uint64_t, std::span<std::byte>) const {}
  std::string_view name() const { return ""; }
};
struct no_name {
  std::uint64_t size() const { return 0; }
  void read_into(std::uint64_t, std::span<std::byte>) const {}
};
struct mutable_read_into {  // read_into must work on a const storage
  std::uint64_t size() const { return 0; }
  void read_into(std::uint64_t, std::span<std::byte>) {}
  std::string_view name() const { return ""; }
};
struct minimal_reader {
  std::uint64_t size() const { return 0; }
  void read_into(std::uint64_t, std::span<std::byte>) const {}
  std::string_view name() const { return ""; }
};
struct wrong_bytes : minimal_reader {
  std::span<const char> bytes() const { return {}; }
};
struct no_commit {
  void write_at(std::uint64_t, std::span<const std::byte>) {}
  void sync() {}
  std::string_view name() const { return ""; }
};
struct no_list_directory {
  using reader_type = memory_storage;
  using writer_type = memory_writer;
  memory_storage open(std::string_view) const;
  memory_writer create(std::string_view) const;
  bool exists(std::string_view) const;
  void remove(std::string_view) const;
  no_list_directory sub(std::string_view) const;
  void make() const;
  std::string_view name() const;
};

static_assert(ReadableStorage<file_storage> && ReadableStorage<mmap_storage> && ReadableStorage<memory_storage>);
static_assert(MappableStorage<mmap_storage> && MappableStorage<memory_storage>);
static_assert(!MappableStorage<file_storage>);
static_assert(WritableStorage<file_writer> && WritableStorage<memory_writer>);
static_assert(WritableDirectory<file_directory> && WritableDirectory<mmap_directory> &&
              WritableDirectory<memory_directory>);
static_assert(ReadableStorage<minimal_reader>);
static_assert(!ReadableStorage<no_read_into>, "a type without read_into is not a ReadableStorage");
static_assert(!ReadableStorage<no_size>);
static_assert(!ReadableStorage<no_name>);
static_assert(!ReadableStorage<mutable_read_into>);
static_assert(!MappableStorage<wrong_bytes>);
static_assert(!WritableStorage<no_commit>);
static_assert(!WritableStorage<file_storage> && !ReadableStorage<memory_writer>);
static_assert(!ReadableDirectory<no_list_directory> && !WritableDirectory<no_list_directory>);
static_assert(!ReadableDirectory<file_storage>);
// the readable half alone: what a read-only backend (an HTTP server) provides
struct read_only_directory {
  using reader_type = memory_storage;
  memory_storage open(std::string_view) const;
  bool exists(std::string_view) const;
  std::vector<std::string> list() const;
  read_only_directory sub(std::string_view) const;
  std::string_view name() const;
};
static_assert(ReadableDirectory<read_only_directory> && !WritableDirectory<read_only_directory>);
// a writable refinement needs writer_type, create, remove and make
struct no_make_directory : read_only_directory {
  using writer_type = memory_writer;
  memory_writer create(std::string_view) const;
  void remove(std::string_view) const;
  no_make_directory sub(std::string_view) const;
};
static_assert(ReadableDirectory<no_make_directory> && !WritableDirectory<no_make_directory>);

TEST_CASE("storage: plain names") {
  for (const char* ok : {"a", "rank_0.safetensors", "metadata.json", ".hidden", "a.b", "x y"}) CHECK(is_plain_name(ok));
  for (const char* bad : {"", ".", "..", "a/b", "/a", "a\\b", "..a", "a..", "a/../b"}) CHECK_FALSE(is_plain_name(bad));
  CHECK_FALSE(is_plain_name(std::string_view("a\0b", 3)));
}

// ---------------------------------------------------------------------------------------
// ReadableStorage conformance

TEST_CASE_TEMPLATE("ReadableStorage conformance", S, file_storage, mmap_storage, memory_storage) {
  storage_maker<S> maker;
  const auto bytes = random_bytes(100'003, 7);
  const S s = maker.make(bytes);
  const std::string sname = maker.name_of(0);
  CHECK(s.size() == bytes.size());
  CHECK(std::string_view(s.name()) == sname);

  SUBCASE("exact bytes at random offsets") {
    std::mt19937_64 rng(11);
    for (int i = 0; i < 300; ++i) {
      const std::uint64_t off = rng() % (bytes.size() + 1);
      const std::uint64_t len = rng() % (bytes.size() - off + 1) % 5000;
      std::vector<std::byte> dst(len, std::byte{0xee});
      s.read_into(off, dst);
      REQUIRE(std::equal(dst.begin(), dst.end(), bytes.begin() + static_cast<std::ptrdiff_t>(off)));
    }
    std::vector<std::byte> all(bytes.size());
    s.read_into(0, all);
    CHECK(all == bytes);
    std::vector<std::byte> last(1);
    s.read_into(bytes.size() - 1, last);
    CHECK(last[0] == bytes.back());
  }
  SUBCASE("empty reads are no-ops anywhere") {
    std::span<std::byte> none;
    s.read_into(0, none);
    s.read_into(bytes.size(), none);
    s.read_into(bytes.size() + 1000, none);
  }
  SUBCASE("reads past the end throw errc::truncated naming the storage") {
    std::vector<std::byte> dst(10, std::byte{0x5a});
    expect_errc([&] { s.read_into(bytes.size() - 9, dst); }, errc::truncated, sname);
    expect_errc([&] { s.read_into(bytes.size(), std::span(dst).first(1)); }, errc::truncated, sname);
    expect_errc([&] { s.read_into(~std::uint64_t(0) - 3, dst); }, errc::truncated, "passes the end");
    expect_errc([&] { s.read_into(~std::uint64_t(0), std::span(dst).first(1)); }, errc::truncated, sname);
  }
  SUBCASE("concurrent reads from 8 threads") {
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(100 + t);
        std::vector<std::byte> dst;
        for (int i = 0; i < 2000; ++i) {
          const std::uint64_t off = rng() % bytes.size();
          dst.resize(rng() % std::min<std::uint64_t>(bytes.size() - off, 4096) + 1);
          s.read_into(off, dst);
          if (!std::equal(dst.begin(), dst.end(), bytes.begin() + static_cast<std::ptrdiff_t>(off))) ++bad;
        }
      });
    for (auto& t : threads) t.join();
    CHECK(bad.load() == 0);
  }
  SUBCASE("0-byte objects") {
    const S e = maker.make({});
    CHECK(e.size() == 0);
    std::span<std::byte> none;
    e.read_into(0, none);
    std::byte one[1];
    expect_errc([&] { e.read_into(0, one); }, errc::truncated, maker.name_of(1));
    if constexpr (MappableStorage<S>) CHECK(e.bytes().empty());
  }
  if constexpr (MappableStorage<S>) {
    CHECK(s.bytes().size() == bytes.size());
    CHECK(std::equal(bytes.begin(), bytes.end(), s.bytes().begin()));
  }
}

TEST_CASE("storage: opening what is not there") {
  temp_dir tmp;
  expect_errc([&] { file_storage(tmp.path / "absent"); }, errc::not_found, (tmp.path / "absent").string());
  expect_errc([&] { mmap_storage(tmp.path / "absent"); }, errc::not_found, "absent");
  expect_errc([&] { file_storage{tmp.path}; }, errc::invalid_argument, "is a directory");
  expect_errc([&] { mmap_storage{tmp.path}; }, errc::invalid_argument, "is a directory");
}

// ---------------------------------------------------------------------------------------
// Directory conformance

TEST_CASE_TEMPLATE("Directory conformance", D, file_directory, mmap_directory, memory_directory) {
  directory_maker<D> m;
  const D& d = m.dir;
  d.make();
  CHECK(d.list().empty());

  SUBCASE("an object is visible only after commit") {
    {
      auto w = d.create("obj");
      w.write_at(0, bytes_of("hello"));
      CHECK_FALSE(d.exists("obj"));
      expect_errc([&] { d.open("obj"); }, errc::not_found, "obj");
      w.sync();
      w.commit();
      CHECK(std::string_view(w.name()).find("obj") != std::string_view::npos);
      expect_errc([&] { w.write_at(0, bytes_of("x")); }, errc::invalid_argument, "obj");
    }
    CHECK(d.exists("obj"));
    CHECK(str(read_all(d, "obj")) == "hello");
    CHECK(d.list() == std::vector<std::string>{"obj"});
    // a second commit replaces it whole
    put(d, "obj", "bye");
    CHECK(str(read_all(d, "obj")) == "bye");
  }
  SUBCASE("a writer destroyed without commit leaves nothing, not even a temporary") {
    {
      auto w = d.create("gone");
      w.write_at(0, bytes_of("partial data"));
    }
    CHECK_FALSE(d.exists("gone"));
    CHECK(d.list().empty());
    CHECK(m.files_on_disk() == 0);
    // and an existing object is untouched by an abandoned rewrite
    put(d, "keep", "v1");
    {
      auto w = d.create("keep");
      w.write_at(0, bytes_of("v2 that never lands"));
    }
    CHECK(str(read_all(d, "keep")) == "v1");
    CHECK(d.list() == std::vector<std::string>{"keep"});
  }
  SUBCASE("write_at out of order and from several threads on disjoint ranges") {
    const auto bytes = random_bytes(1 << 20, 3);
    {
      auto w = d.create("big");
      const std::size_t piece = bytes.size() / 16;
      std::vector<std::thread> threads;
      for (int t = 0; t < 8; ++t)
        threads.emplace_back([&, t] {
          for (std::size_t p = 15 - std::size_t(t); ; p -= 8) {  // from the end backwards
            w.write_at(p * piece, std::span(bytes).subspan(p * piece, piece));
            if (p < 8) break;
          }
        });
      for (auto& th : threads) th.join();
      w.commit();
    }
    CHECK(read_all(d, "big") == bytes);
    {
      auto w = d.create("gaps");  // the tail first, then the head
      w.write_at(4, bytes_of("5678"));
      w.write_at(0, bytes_of("1234"));
      w.commit();
    }
    CHECK(str(read_all(d, "gaps")) == "12345678");
    put(d, "empty", "");
    CHECK(d.open("empty").size() == 0);
  }
  SUBCASE("exists, list (sorted), remove (recursive), sub, make") {
    for (const char* n : {"zeta", "alpha", "Mid", "beta.json"}) put(d, n, n);
    const D s = d.sub("sub");
    s.make();
    put(s, "inner", "in");
    const D deeper = s.sub("deeper");
    deeper.make();
    put(deeper, "leaf", "leaf");
    CHECK(d.list() == std::vector<std::string>{"Mid", "alpha", "beta.json", "sub", "zeta"});
    CHECK(s.list() == std::vector<std::string>{"deeper", "inner"});
    CHECK(d.exists("sub"));
    CHECK(s.exists("deeper"));
    CHECK_FALSE(d.exists("inner"));
    CHECK(str(read_all(deeper, "leaf")) == "leaf");
    CHECK(std::string_view(s.name()).find("sub") != std::string_view::npos);
    d.remove("sub");
    CHECK_FALSE(d.exists("sub"));
    CHECK_FALSE(s.exists("inner"));
    CHECK_FALSE(deeper.exists("leaf"));
    CHECK(d.list() == std::vector<std::string>{"Mid", "alpha", "beta.json", "zeta"});
    d.remove("alpha");
    d.remove("never-there");  // absent is no error
    CHECK_FALSE(d.exists("alpha"));
    CHECK(d.list() == std::vector<std::string>{"Mid", "beta.json", "zeta"});
    expect_errc([&] { d.open("alpha"); }, errc::not_found, "alpha");
  }
  SUBCASE("names that are not plain are rejected by every operation") {
    for (std::string_view bad : {std::string_view("a/b"), std::string_view(".."), std::string_view("a\\b"),
                                 std::string_view(""), std::string_view("../x"), std::string_view(".")}) {
      INFO("name '" << std::string(bad) << "'");
      expect_errc([&] { d.open(bad); }, errc::invalid_argument, "not a plain");
      expect_errc([&] { d.create(bad); }, errc::invalid_argument, std::string(d.name()));
      expect_errc([&] { (void)d.exists(bad); }, errc::invalid_argument, "not a plain");
      expect_errc([&] { d.remove(bad); }, errc::invalid_argument, "not a plain");
      expect_errc([&] { d.sub(bad); }, errc::invalid_argument, "not a plain");
    }
    CHECK(d.list().empty());
  }
}

TEST_CASE("storage: memory_writer without a store, and a mapping outliving its file name") {
  memory_writer w("standalone");
  w.write_at(2, bytes_of("cd"));
  w.write_at(0, bytes_of("ab"));
  w.commit();
  expect_errc([&] { w.commit(); }, errc::invalid_argument, "standalone");
  CHECK(str(w.take()) == "abcd");

  temp_dir tmp;
  file_directory d(tmp.path);
  put(d, "f", "mapped bytes");
  mmap_storage ms(tmp.path / "f");
  mmap_storage moved(std::move(ms));
  d.remove("f");
  std::vector<std::byte> b(moved.size());
  moved.read_into(0, b);
  CHECK(str(b) == "mapped bytes");
}

TEST_CASE_TEMPLATE("ReadableStorage: large reads (streaming copies) at odd alignments", S, file_storage, mmap_storage,
                   memory_storage) {
  // reads of detail::stream_copy_min_bytes and more take the streaming-store path of the
  // mapped and memory backends: check every byte with source and destination misaligned
  storage_maker<S> maker;
  const std::size_t n = 3 * detail::stream_copy_min_bytes + 12'345;
  const auto bytes = random_bytes(n, 23);
  const S s = maker.make(bytes);
  using u64 = std::uint64_t;
  for (u64 off : {u64(0), u64(1), u64(63), u64(4095), u64(8193)})
    for (std::size_t dst_shift : {std::size_t(0), std::size_t(1), std::size_t(17), std::size_t(64)})
      for (std::size_t len : {detail::stream_copy_min_bytes, detail::stream_copy_min_bytes + 8191,
                              2 * detail::stream_copy_min_bytes + 77, std::size_t(n - off)}) {
        std::vector<std::byte> buf(len + dst_shift + 64, std::byte{0xee});
        s.read_into(off, std::span(buf).subspan(dst_shift, len));
        REQUIRE(std::equal(buf.begin() + static_cast<std::ptrdiff_t>(dst_shift),
                           buf.begin() + static_cast<std::ptrdiff_t>(dst_shift + len),
                           bytes.begin() + static_cast<std::ptrdiff_t>(off)));
        // nothing written outside the destination
        REQUIRE(std::all_of(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(dst_shift),
                            [](std::byte b) { return b == std::byte{0xee}; }));
        REQUIRE(std::all_of(buf.begin() + static_cast<std::ptrdiff_t>(dst_shift + len), buf.end(),
                            [](std::byte b) { return b == std::byte{0xee}; }));
      }
}

TEST_CASE("file_writer::write_blocks: the exact bytes and size, through O_DIRECT or not") {
  temp_dir tmp;
  auto byte_at = [](std::uint64_t i) { return static_cast<std::byte>((i * 131) ^ (i >> 9)); };
  int n = 0;
  for (std::uint64_t size : {std::uint64_t(0), std::uint64_t(1), std::uint64_t(4095), std::uint64_t(4096),
                             std::uint64_t(4097), std::uint64_t(3 * 8192 + 5), std::uint64_t((1 << 20) + 123)})
    for (bool direct : {true, false})
      for (unsigned threads : {1u, 3u})
        for (bool reserve : {false, true}) {
          const fs::path p = tmp.path / ("blocks" + std::to_string(n++));
          {
            file_writer w(p);
            if (reserve) w.reserve(size);
            block_write_options o;
            o.direct = direct;
            o.threads = threads;
            o.block_bytes = 8000;  // rounded up to 8192: many blocks, a short last one
            std::atomic<std::uint64_t> filled{0};
            w.write_blocks(size, [&](std::uint64_t off, std::span<std::byte> dst) {
              for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = byte_at(off + i);
              filled += dst.size();
            }, o);
            CHECK(filled.load() == size);
            w.sync();
            w.commit();
          }
          REQUIRE(fs::file_size(p) == size);
          file_storage f(p);
          std::vector<std::byte> got(size);
          f.read_into(0, got);
          bool same = true;
          for (std::uint64_t i = 0; i < size; ++i) same = same && got[i] == byte_at(i);
          CHECK_MESSAGE(same, "size ", size, " direct ", direct, " threads ", threads);
        }
}

TEST_CASE("file_writer::write_blocks: an error in fill leaves no file") {
  temp_dir tmp;
  const fs::path p = tmp.path / "failed";
  {
    file_writer w(p);
    CHECK_THROWS_AS(w.write_blocks(100'000, [](std::uint64_t off, std::span<std::byte>) {
      if (off > 0) throw std::runtime_error("fill failed");
    }, block_write_options{2, true, 8192}),
                    std::runtime_error);
  }
  CHECK(!fs::exists(p));
  CHECK(fs::is_empty(tmp.path));
}

TEST_CASE("save_flat_views to a file_directory: O_DIRECT and buffered rank files are byte-identical") {
  // odd sizes, so that tensors straddle the 8 KiB blocks and the file ends mid-block
  std::mt19937_64 rng(9);
  std::vector<std::vector<std::byte>> mem;
  std::vector<flat_view> views;
  const std::vector<std::pair<dtype, shape_t>> defs = {{dtype::F32, {1001, 7}}, {dtype::BF16, {12'345}},
                                                       {dtype::U8, {3}},        {dtype::I64, {0}},
                                                       {dtype::F64, {}},        {dtype::F16, {70'001}}};
  for (std::size_t i = 0; i < defs.size(); ++i) {
    mem.emplace_back(numel(defs[i].second) * item_size(defs[i].first));
    for (auto& b : mem.back()) b = static_cast<std::byte>(rng());
  }
  for (std::size_t i = 0; i < defs.size(); ++i)
    views.push_back(
        {"w" + std::to_string(i), defs[i].first, defs[i].second, std::nullopt, mem[i].data(), mem[i].size()});
  temp_dir tmp;
  single_process comm;
  for (bool direct : {true, false}) {
    save_options so;
    so.direct_io = direct;
    so.write_chunk_bytes = 8192;
    so.threads = 3;
    save_flat_views(file_directory(tmp.path / (direct ? "direct" : "buffered")), std::span<const flat_view>(views), comm,
                    so);
  }
  const std::string a = testing::slurp(tmp.path / "direct" / "rank_0.safetensors");
  const std::string b = testing::slurp(tmp.path / "buffered" / "rank_0.safetensors");
  CHECK(a.size() == b.size());
  CHECK(a == b);
  // and it loads back
  std::vector<std::vector<std::byte>> back;
  std::vector<flat_view> into = views;
  for (std::size_t i = 0; i < views.size(); ++i) {
    back.emplace_back(views[i].nbytes, std::byte{0});
    into[i].data = back.back().data();
  }
  load_flat_views(file_directory(tmp.path / "direct"), std::span<const flat_view>(into));
  CHECK(back == mem);
}
