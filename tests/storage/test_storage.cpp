// Conformance suites for storage/concepts.hpp: one over every ReadableStorage backend and one
// over every directory backend, plus static checks that the backends model their concepts.
#include "shardsafe/storage/concepts.hpp"

#include <doctest/doctest.h>

#include "support/test_util.hpp"

#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"
#if SHARDSAFE_TEST_REMOTE
#include "support/servers.hpp"
#include "shardsafe/storage/http.hpp"
#define SHARDSAFE_READABLE_BACKENDS file_storage, mmap_storage, memory_storage, http_storage
#else
#define SHARDSAFE_READABLE_BACKENDS file_storage, mmap_storage, memory_storage
#endif

using namespace shardsafe;
using testing::expect_error;
using testing::temp_dir;
namespace fs = std::filesystem;

namespace {

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  const std::string s = testing::random_bytes(n, seed);
  const auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

std::span<const std::byte> sv_bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// How to get a storage holding given bytes, for each ReadableStorage backend.
template <class S>
struct storage_maker;

template <class S>
struct file_backed_maker {
  temp_dir tmp;
  int n = 0;
  S make(const std::vector<std::byte>& bytes) {
    const fs::path p = tmp.path / ("obj" + std::to_string(n++) + ".bin");
    std::ofstream(p, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
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

#if SHARDSAFE_TEST_REMOTE
// objects written into the folder nginx serves, read back through one shared client
template <>
struct storage_maker<http_storage> {
  testing::nginx_server srv;
  std::shared_ptr<detail::http_client> client = std::make_shared<detail::http_client>();
  int n = 0;
  http_storage make(const std::vector<std::byte>& bytes) {
    const std::string name = "obj" + std::to_string(n++) + ".bin";
    std::ofstream(srv.www / name, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return http_storage(client, parse_url(srv.url(name)));
  }
  std::string name_of(int i) const { return srv.url("obj" + std::to_string(i) + ".bin"); }
};
#endif

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
  w.write_at(0, sv_bytes(content));
  w.commit();
}

std::string byte_str(const std::vector<std::byte>& b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

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
struct no_abort {
  void write_at(std::uint64_t, std::span<const std::byte>) {}
  void sync() {}
  void commit() {}
  std::string_view name() const { return ""; }
};
struct no_shape {  // neither write_at nor write_blocks: no WritableDirectory may hand it out
  void sync() {}
  void commit() {}
  void abort() {}
  std::string_view name() const { return ""; }
};
struct block_only : no_shape {
  template <class Fill>
  void write_blocks(std::uint64_t, Fill&&, const block_write_options&) {}
};
struct misspelt_blocks : no_shape {
  template <class Fill>
  void write_block(std::uint64_t, Fill&&, const block_write_options&) {}
};
struct blocks_without_options : no_shape {
  template <class Fill>
  void write_blocks(std::uint64_t, Fill&&) {}
};
struct batch_reader : minimal_reader {
  void read_batch(std::span<const read_request>) const {}
  read_settings read_defaults() const { return {}; }
};
struct batch_without_reader {
  void read_batch(std::span<const read_request>) const {}
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
static_assert(RandomAccessWritableStorage<file_writer> && RandomAccessWritableStorage<memory_writer>);
static_assert(BlockWritableStorage<file_writer> && !BlockWritableStorage<memory_writer>);
static_assert(WritableDirectory<file_directory> && WritableDirectory<mmap_directory> &&
              WritableDirectory<memory_directory>);
static_assert(ReadableStorage<minimal_reader>);
static_assert(!ReadableStorage<no_read_into>, "a type without read_into is not a ReadableStorage");
static_assert(!ReadableStorage<no_size>);
static_assert(!ReadableStorage<no_name>);
static_assert(!ReadableStorage<mutable_read_into>);
static_assert(!MappableStorage<wrong_bytes>);
static_assert(!WritableStorage<no_commit>);
static_assert(!WritableStorage<no_abort>, "every writer has abort()");
static_assert(BlockWritableStorage<block_only> && !RandomAccessWritableStorage<block_only>);
static_assert(!BlockWritableStorage<misspelt_blocks>, "write_block (no s) is not write_blocks");
static_assert(!BlockWritableStorage<blocks_without_options>);
static_assert(WritableStorage<no_shape> && !RandomAccessWritableStorage<no_shape> && !BlockWritableStorage<no_shape>);
static_assert(BatchReadableStorage<batch_reader> && !BatchReadableStorage<minimal_reader>);
static_assert(!BatchReadableStorage<batch_without_reader>, "read_batch refines ReadableStorage");
static_assert(HintedStorage<batch_reader> && !HintedStorage<minimal_reader>);
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
// a writer of either shape will do; one of neither will not
template <class W>
struct directory_writing : read_only_directory {
  using writer_type = W;
  W create(std::string_view) const;
  void remove(std::string_view) const;
  void make() const;
  directory_writing sub(std::string_view) const;
};
static_assert(WritableDirectory<directory_writing<block_only>> && WritableDirectory<directory_writing<memory_writer>>);
static_assert(!WritableDirectory<directory_writing<no_shape>>);
// copy and move: storages that own a descriptor or a mapping move; memory bytes are shared
static_assert(std::is_copy_constructible_v<memory_storage>);
static_assert(!std::is_copy_constructible_v<file_storage> && std::is_nothrow_move_constructible_v<file_storage>);
static_assert(!std::is_copy_constructible_v<mmap_storage> && std::is_nothrow_move_constructible_v<mmap_storage>);
static_assert(!std::is_copy_constructible_v<file_writer> && std::is_move_constructible_v<file_writer>);
static_assert(!std::is_copy_constructible_v<memory_writer> && std::is_move_constructible_v<memory_writer>);
static_assert(std::is_copy_constructible_v<file_directory> && std::is_copy_constructible_v<memory_directory>);

TEST_CASE("storage: plain names") {
  for (const char* ok : {"a", "rank_0.safetensors", "metadata.json", ".hidden", "a.b", "x y"}) CHECK(is_plain_name(ok));
  for (const char* bad : {"", ".", "..", "a/b", "/a", "a\\b", "..a", "a..", "a/../b"}) CHECK_FALSE(is_plain_name(bad));
  CHECK_FALSE(is_plain_name(std::string_view("a\0b", 3)));
}

// ---------------------------------------------------------------------------------------
// ReadableStorage conformance

TEST_CASE_TEMPLATE("ReadableStorage conformance", S, SHARDSAFE_READABLE_BACKENDS) {
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
    expect_error([&] { s.read_into(bytes.size() - 9, dst); }, errc::truncated, {sname});
    expect_error([&] { s.read_into(bytes.size(), std::span(dst).first(1)); }, errc::truncated, {sname});
    expect_error([&] { s.read_into(~std::uint64_t(0) - 3, dst); }, errc::truncated, {"passes the end"});
    expect_error([&] { s.read_into(~std::uint64_t(0), std::span(dst).first(1)); }, errc::truncated, {sname});
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
    expect_error([&] { e.read_into(0, one); }, errc::truncated, {maker.name_of(1)});
    if constexpr (MappableStorage<S>) CHECK(e.bytes().empty());
  }
  SUBCASE("copy and move") {
    S a = maker.make(bytes);
    if constexpr (std::is_copy_constructible_v<S> && MappableStorage<S>) {
      // memory_storage: a copy shares the same immutable bytes and name
      const S c = a;
      CHECK(c.bytes().data() == a.bytes().data());
      CHECK(std::string_view(c.name()) == std::string_view(a.name()));
    } else if constexpr (std::is_copy_constructible_v<S>) {
      // http_storage: a copy names and reads the same object
      const S c = a;
      CHECK(std::string_view(c.name()) == std::string_view(a.name()));
      std::vector<std::byte> all(bytes.size());
      c.read_into(0, all);
      CHECK(all == bytes);
    }
    S b = std::move(a);  // the moved-to object reads what the original did
    CHECK(b.size() == bytes.size());
    std::vector<std::byte> all(bytes.size());
    b.read_into(0, all);
    CHECK(all == bytes);
    a = maker.make(random_bytes(10, 1));  // a moved-from object may be assigned to
    CHECK(a.size() == 10);
    CHECK(b.size() == bytes.size());
  }
  if constexpr (MappableStorage<S>) {
    CHECK(s.bytes().size() == bytes.size());
    CHECK(std::equal(bytes.begin(), bytes.end(), s.bytes().begin()));
  }
}

TEST_CASE("storage: opening what is not there") {
  temp_dir tmp;
  expect_error([&] { file_storage(tmp.path / "absent"); }, errc::not_found, {(tmp.path / "absent").string()});
  expect_error([&] { mmap_storage(tmp.path / "absent"); }, errc::not_found, {"absent"});
  expect_error([&] { file_storage{tmp.path}; }, errc::invalid_argument, {"is a directory"});
  expect_error([&] { mmap_storage{tmp.path}; }, errc::invalid_argument, {"is a directory"});
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
      w.write_at(0, sv_bytes("hello"));
      CHECK_FALSE(d.exists("obj"));
      expect_error([&] { d.open("obj"); }, errc::not_found, {"obj"});
      w.sync();
      w.commit();
      CHECK(std::string_view(w.name()).find("obj") != std::string_view::npos);
      expect_error([&] { w.write_at(0, sv_bytes("x")); }, errc::invalid_argument, {"obj"});
    }
    CHECK(d.exists("obj"));
    CHECK(byte_str(read_all(d, "obj")) == "hello");
    CHECK(d.list() == std::vector<std::string>{"obj"});
    // a second commit replaces it whole
    put(d, "obj", "bye");
    CHECK(byte_str(read_all(d, "obj")) == "bye");
  }
  SUBCASE("a writer destroyed without commit leaves nothing, not even a temporary") {
    {
      auto w = d.create("gone");
      w.write_at(0, sv_bytes("partial data"));
    }
    CHECK_FALSE(d.exists("gone"));
    CHECK(d.list().empty());
    CHECK(m.files_on_disk() == 0);
    // and an existing object is untouched by an abandoned rewrite
    put(d, "keep", "v1");
    {
      auto w = d.create("keep");
      w.write_at(0, sv_bytes("v2 that never lands"));
    }
    CHECK(byte_str(read_all(d, "keep")) == "v1");
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
          for (std::size_t p = 15 - std::size_t(t);; p -= 8) {  // from the end backwards
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
      w.write_at(4, sv_bytes("5678"));
      w.write_at(0, sv_bytes("1234"));
      w.commit();
    }
    CHECK(byte_str(read_all(d, "gaps")) == "12345678");
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
    CHECK(byte_str(read_all(deeper, "leaf")) == "leaf");
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
    expect_error([&] { d.open("alpha"); }, errc::not_found, {"alpha"});
  }
  SUBCASE("abort: nothing under the final name, no temporary, and no use afterwards") {
    put(d, "keep", "v1");
    {
      auto w = d.create("keep");
      w.write_at(0, sv_bytes("v2 that never lands"));
      w.abort();
      w.abort();  // a second abort does nothing
      expect_error([&] { w.write_at(0, sv_bytes("x")); }, errc::invalid_argument, {"after abort"});
      expect_error([&] { w.commit(); }, errc::invalid_argument, {"keep"});
    }
    {
      auto w = d.create("fresh");
      w.write_at(0, sv_bytes("partial"));
      w.abort();
      CHECK_FALSE(d.exists("fresh"));
    }
    CHECK(byte_str(read_all(d, "keep")) == "v1");
    CHECK(d.list() == std::vector<std::string>{"keep"});
    CHECK(m.files_on_disk() == 1);
    auto w = d.create("done");
    w.commit();
    expect_error([&] { w.abort(); }, errc::invalid_argument, {"abort after commit"});
    CHECK(d.exists("done"));
  }
  SUBCASE("a made sub-directory exists and is listed while empty, until removed") {
    const D e = d.sub("empty");
    CHECK_FALSE(d.exists("empty"));
    e.make();
    e.make();  // again: no error
    CHECK(d.exists("empty"));
    CHECK(d.list() == std::vector<std::string>{"empty"});
    CHECK(e.list().empty());
    d.sub("a").sub("b").make();  // parents too
    CHECK(d.exists("a"));
    CHECK(d.sub("a").exists("b"));
    CHECK(d.sub("a").list() == std::vector<std::string>{"b"});
    CHECK(d.list() == std::vector<std::string>{"a", "empty"});
    put(e, "x", "x");
    e.remove("x");
    CHECK(d.exists("empty"));  // emptied, not removed
    d.remove("a");
    d.remove("empty");
    CHECK_FALSE(d.exists("a"));
    CHECK_FALSE(d.exists("empty"));
    CHECK_FALSE(d.sub("a").exists("b"));
    CHECK(d.list().empty());
  }
  SUBCASE("copies of a directory name the same place; writers move") {
    const D c = d;
    put(c, "via-copy", "c");
    CHECK(byte_str(read_all(d, "via-copy")) == "c");
    {
      auto w = d.create("moved");
      w.write_at(0, sv_bytes("carried on"));
      auto w2 = std::move(w);  // the moved-from writer is destroyed first and must do nothing
      w2.write_at(0, sv_bytes("C"));
      w2.commit();
    }
    CHECK(byte_str(read_all(d, "moved")) == "Carried on");
    {
      auto w = d.create("dropped");
      w.write_at(0, sv_bytes("never"));
      auto w2 = std::move(w);
    }  // neither committed: nothing is left
    CHECK(d.list() == std::vector<std::string>{"moved", "via-copy"});
    CHECK(m.files_on_disk() == 2);
  }
  SUBCASE("names that are not plain are rejected by every operation") {
    for (std::string_view bad : {std::string_view("a/b"), std::string_view(".."), std::string_view("a\\b"),
                                 std::string_view(""), std::string_view("../x"), std::string_view(".")}) {
      INFO("name '" << std::string(bad) << "'");
      expect_error([&] { d.open(bad); }, errc::invalid_argument, {"not a plain"});
      expect_error([&] { d.create(bad); }, errc::invalid_argument, {std::string(d.name())});
      expect_error([&] { (void)d.exists(bad); }, errc::invalid_argument, {"not a plain"});
      expect_error([&] { d.remove(bad); }, errc::invalid_argument, {"not a plain"});
      expect_error([&] { d.sub(bad); }, errc::invalid_argument, {"not a plain"});
    }
    CHECK(d.list().empty());
  }
}

TEST_CASE("storage: memory_writer without a store, and a mapping outliving its file name") {
  memory_writer w("standalone");
  w.write_at(2, sv_bytes("cd"));
  w.write_at(0, sv_bytes("ab"));
  w.commit();
  expect_error([&] { w.commit(); }, errc::invalid_argument, {"standalone"});
  CHECK(byte_str(w.take()) == "abcd");

  temp_dir tmp;
  file_directory d(tmp.path);
  put(d, "f", "mapped bytes");
  mmap_storage ms(tmp.path / "f");
  mmap_storage moved(std::move(ms));
  d.remove("f");
  std::vector<std::byte> b(moved.size());
  moved.read_into(0, b);
  CHECK(byte_str(b) == "mapped bytes");
}

TEST_CASE_TEMPLATE("ReadableStorage: large reads (streaming copies) at odd alignments", S,
                   SHARDSAFE_READABLE_BACKENDS) {
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
            w.write_blocks(
                size,
                [&](std::uint64_t off, std::span<std::byte> dst) {
                  for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = byte_at(off + i);
                  filled += dst.size();
                },
                o);
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
    CHECK_THROWS_AS(w.write_blocks(
                        100'000,
                        [](std::uint64_t off, std::span<std::byte>) {
                          if (off > 0) throw std::runtime_error("fill failed");
                        },
                        block_write_options{2, true, 8192}),
                    std::runtime_error);
  }
  CHECK(!fs::exists(p));
  CHECK(fs::is_empty(tmp.path));
}

TEST_CASE(
    "file_part_writer: writers of one file_writer's temporary each write their ranges; the creator commits or removes "
    "it") {
  temp_dir tmp;
  const std::string bytes = testing::random_bytes(3 * 4096 + 17, 41);
  const auto part = [&](std::size_t a, std::size_t b) {
    return std::as_bytes(std::span<const char>(bytes.data() + a, b - a));
  };
  {
    file_writer w(tmp.path / "shared");
    w.reserve(bytes.size());
    w.write_at(0, part(0, 100));
    // two more writers of the same file (as ranks of one job are), each its own ranges, at once
    std::thread t1([&] {
      file_part_writer p(w.temp_path(), "shared");
      p.write_at(100, part(100, 5000));
      p.finish();
    });
    std::thread t2([&] {
      file_part_writer p(w.temp_path(), "shared");
      p.write_at(5000, part(5000, bytes.size()));
      p.finish();
      testing::expect_error([&] { p.write_at(0, part(0, 1)); }, errc::invalid_argument,
                            {"shared", "write after finish"});
    });
    t1.join();
    t2.join();
    CHECK(!fs::exists(tmp.path / "shared"));  // not there until the creator commits
    w.commit();
  }
  CHECK(testing::slurp(tmp.path / "shared") == bytes);
  CHECK(fs::file_size(tmp.path / "shared") == bytes.size());
  {
    file_writer w(tmp.path / "dropped");
    file_part_writer p(w.temp_path(), "dropped");
    p.write_at(0, part(0, 10));
    p.finish();
  }  // the creator gone without commit: the temporary goes with it
  CHECK(!fs::exists(tmp.path / "dropped"));
  std::vector<std::string> left;  // the committed file only: no temporary of either writer
  for (const auto& e : fs::directory_iterator(tmp.path)) left.push_back(e.path().filename().string());
  CHECK(left == std::vector<std::string>{"shared"});
  // a temporary that is not there (its creator gone) is an error naming the file
  expect_error([&] { file_part_writer(tmp.path / "gone.tmp", "gone"); }, errc::not_found, {"gone.tmp"});
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
    save(file_directory(tmp.path / (direct ? "direct" : "buffered")), std::span<const flat_view>(views), comm, so);
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
  load(file_directory(tmp.path / "direct"), std::span<const flat_view>(into));
  CHECK(back == mem);
}

// ---------------------------------------------------------------------------------------
// Backends of the shapes to come (an S3-like block-only writer, a batch-reading server with
// its own read hints), built over memory_directory, and what the saver and loader do with them

namespace {

struct io_counts {
  std::atomic<int> read_into{0}, read_batch{0}, batch_requests{0}, opens{0}, exists{0}, lists{0}, aborts{0}, blocks{0};
};

// A reader without bytes(): read_into and, when Batch, read_batch; the hint it is given.
template <bool Batch>
struct counted_storage {
  memory_storage inner;
  std::shared_ptr<io_counts> n;
  read_settings hint;
  std::uint64_t size() const { return inner.size(); }
  std::string_view name() const { return inner.name(); }
  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    ++n->read_into;
    inner.read_into(off, dst);
  }
  void read_batch(std::span<const read_request> rs) const
    requires Batch
  {
    ++n->read_batch;
    n->batch_requests += static_cast<int>(rs.size());
    for (auto it = rs.rbegin(); it != rs.rend(); ++it) inner.read_into(it->offset, it->dst);  // any order
  }
  read_settings read_defaults() const { return hint; }
};

template <bool Batch>
struct counted_directory {
  using reader_type = counted_storage<Batch>;
  memory_directory inner;
  std::shared_ptr<io_counts> n = std::make_shared<io_counts>();
  read_settings hint{};
  reader_type open(std::string_view name) const {
    ++n->opens;
    return reader_type{inner.open(name), n, hint};
  }
  bool exists(std::string_view name) const {
    ++n->exists;
    return inner.exists(name);
  }
  std::vector<std::string> list() const {
    ++n->lists;
    return inner.list();
  }
  counted_directory sub(std::string_view name) const { return {inner.sub(name), n, hint}; }
  std::string_view name() const { return inner.name(); }
};
static_assert(BatchReadableStorage<counted_storage<true>> && !BatchReadableStorage<counted_storage<false>>);
static_assert(!MappableStorage<counted_storage<true>> && HintedStorage<counted_storage<false>>);
static_assert(ReadableDirectory<counted_directory<true>> && !WritableDirectory<counted_directory<true>>);

// A writer that only writes whole blocks (as an S3 multipart upload does), in reverse order;
// `fail_after` blocks, it throws instead.
struct block_writer {
  memory_writer inner;
  std::shared_ptr<io_counts> n;
  int fail_after = -1;
  template <class Fill>
  void write_blocks(std::uint64_t size, Fill&& fill, const block_write_options& o) {
    const std::uint64_t block = std::max<std::uint64_t>(o.block_bytes, 1);
    std::vector<std::byte> buf(static_cast<std::size_t>(size));
    for (std::uint64_t i = (size + block - 1) / block; i-- > 0;) {
      if (fail_after == 0) throw error(errc::io_error, std::string(name()) + ": upload of a part failed");
      --fail_after;
      const std::uint64_t off = i * block;
      fill(off, std::span(buf).subspan(static_cast<std::size_t>(off),
                                       static_cast<std::size_t>(std::min(block, size - off))));
      ++n->blocks;
    }
    inner.write_at(0, buf);
  }
  void sync() { inner.sync(); }
  void commit() { inner.commit(); }
  void abort() {
    ++n->aborts;
    inner.abort();
  }
  std::string_view name() const { return inner.name(); }
};
static_assert(BlockWritableStorage<block_writer> && !RandomAccessWritableStorage<block_writer>);

struct block_directory {
  using reader_type = memory_storage;
  using writer_type = block_writer;
  memory_directory inner;
  std::shared_ptr<io_counts> n = std::make_shared<io_counts>();
  int fail_after = -1;
  reader_type open(std::string_view name) const { return inner.open(name); }
  bool exists(std::string_view name) const { return inner.exists(name); }
  std::vector<std::string> list() const { return inner.list(); }
  block_directory sub(std::string_view name) const { return {inner.sub(name), n, fail_after}; }
  std::string_view name() const { return inner.name(); }
  writer_type create(std::string_view name) const { return block_writer{inner.create(name), n, fail_after}; }
  void remove(std::string_view name) const { inner.remove(name); }
  void make() const { inner.make(); }
};
static_assert(WritableDirectory<block_directory>);

// Tensors to save: odd sizes and several dtypes.
struct saved_tensors {
  std::vector<std::vector<std::byte>> mem;
  std::vector<flat_view> views;
  explicit saved_tensors(std::uint64_t seed) {
    const std::vector<std::pair<dtype, shape_t>> defs = {
        {dtype::F32, {301, 7}}, {dtype::BF16, {1234}}, {dtype::U8, {3}}, {dtype::I64, {0}}, {dtype::F64, {}}};
    std::mt19937_64 rng(seed);
    mem.reserve(defs.size());
    for (std::size_t i = 0; i < defs.size(); ++i) {
      mem.emplace_back(numel(defs[i].second) * item_size(defs[i].first));
      for (auto& b : mem.back()) b = static_cast<std::byte>(rng());
      views.push_back(
          {"w" + std::to_string(i), defs[i].first, defs[i].second, std::nullopt, mem[i].data(), mem[i].size()});
    }
  }
};

}  // namespace

TEST_CASE("save_flat_views through a block-only writer: the same bytes as through write_at; abort on failure") {
  saved_tensors t(5);
  single_process comm;
  memory_directory plain(std::make_shared<memory_store>(), "mem:plain");
  save(plain, std::span<const flat_view>(t.views), comm);
  block_directory blocks{memory_directory(std::make_shared<memory_store>(), "mem:blocks")};
  save_options so;
  so.write_chunk_bytes = 1000;  // many blocks
  save(blocks, std::span<const flat_view>(t.views), comm, so);
  CHECK(blocks.n->blocks.load() > 5);
  CHECK(blocks.n->aborts.load() == 0);
  for (const char* f : {"rank_0.safetensors", "metadata.json"}) {
    INFO(f);
    CHECK(read_all(blocks, f) == read_all(plain, f));
  }

  SUBCASE("a part that fails aborts the rank file; nothing is committed") {
    block_directory failing{memory_directory(std::make_shared<memory_store>(), "mem:failing"),
                            std::make_shared<io_counts>(), 2};
    expect_error([&] { save(failing, std::span<const flat_view>(t.views), comm, so); }, errc::io_error,
                 {"upload of a part failed"});
    CHECK(failing.n->aborts.load() == 1);
    CHECK(failing.inner.store()->objects.empty());
  }
  SUBCASE("a failed abort is reported with the failure that caused it") {
    temp_dir tmp;
    file_directory d(tmp.path);
    auto w = d.create("x");
    w.write_at(0, sv_bytes("abc"));
    fs::remove(tmp.path / fs::directory_iterator(tmp.path)->path().filename());  // the temporary vanishes
    // abort of an already missing temporary is no error: the original error comes back alone
    expect_error([&] { detail::abort_on_failure(w, [] { fail(errc::truncated, "first failure"); }); }, errc::truncated,
                 {"first failure"});
    memory_writer done("committed-already");
    done.commit();
    // abort after commit throws: both messages, the first error's code
    try {
      detail::abort_on_failure(done, [] { fail(errc::shape_mismatch, "first failure"); });
      FAIL("no error thrown");
    } catch (const error& e) {
      CHECK(e.code() == errc::shape_mismatch);
      CHECK(std::string(e.what()).find("first failure") != std::string::npos);
      CHECK(std::string(e.what()).find("abort after commit") != std::string::npos);
    }
  }
}

TEST_CASE("checkpoint_reader: plan() lists files, byte ranges and copies; execute() carries them out") {
  saved_tensors t(6);
  single_process comm;
  memory_directory mem(std::make_shared<memory_store>(), "mem:ckpt");
  save(mem, std::span<const flat_view>(t.views), comm);
  const safetensors_header h = read_safetensors_header(mem.open("rank_0.safetensors"));

  // elements [10, 20) and [30, 40) of w0 (F32): two runs 40 bytes apart in the file
  std::vector<std::byte> out(20 * 4, std::byte{0});
  const flat_view v{"w0", dtype::F32, {301, 7}, shard_spec(flat_spec{{10, 20}, {30, 40}}), out.data(), out.size()};
  const std::uint64_t w0 = h.offset_of(h.at("w0"));
  auto expect = [&](std::uint64_t file_off, std::uint64_t elems) {
    return std::vector<std::byte>(t.mem[0].begin() + static_cast<std::ptrdiff_t>(file_off - w0),
                                  t.mem[0].begin() + static_cast<std::ptrdiff_t>(file_off - w0 + elems * 4));
  };

  SUBCASE("defaults: two direct reads") {
    checkpoint_reader<memory_directory> r(mem);
    const load_schedule s = r.plan(std::span<const flat_view>(&v, 1));
    REQUIRE(s.files.size() == 1);
    CHECK(s.files[0].name == "rank_0.safetensors");
    REQUIRE(s.files[0].reads.size() == 2);
    CHECK(s.files[0].reads[0].op.file_offset == w0 + 10 * 4);
    CHECK(s.files[0].reads[0].op.len == 40);
    CHECK(s.files[0].reads[1].op.file_offset == w0 + 30 * 4);
    CHECK(s.files[0].reads[1].op.pieces[0].dst == 40);
    CHECK(s.stats.bytes_needed == 80);
    CHECK(s.stats.bytes_read == 80);
    CHECK(s.threads == detail::default_threads());
    CHECK(std::all_of(out.begin(), out.end(), [](std::byte b) { return b == std::byte{0}; }));  // plan touches nothing
    const load_stats st = r.execute(std::span<const flat_view>(&v, 1), s);
    CHECK(st.read_ops == 2);
    std::vector<std::byte> want = expect(w0 + 40, 10), second = expect(w0 + 120, 10);
    want.insert(want.end(), second.begin(), second.end());
    CHECK(out == want);
    expect_error([&] { r.execute({}, s); }, errc::invalid_argument, {"planned for 1 views"});
  }
  SUBCASE("load_options over the backend's hint over the defaults") {
    counted_directory<false> cd{mem};
    cd.hint.max_read_bytes = 16;  // the backend wants small reads
    cd.hint.requests_in_flight = 3;
    checkpoint_reader<counted_directory<false>> r(cd);
    load_schedule s = r.plan(std::span<const flat_view>(&v, 1));
    CHECK(s.files[0].settings.max_read_bytes == 16);
    CHECK(s.files[0].settings.max_gap_bytes == read_options{}.max_gap_bytes);
    CHECK(s.threads == 3);
    CHECK(s.files[0].reads.size() == 6);  // 40 bytes in reads of 16, 16, 8, twice
    load_options lo;
    lo.reads.max_read_bytes = 1 << 20;
    lo.reads.max_over_read = 1.0;  // and merge across the 40-byte gap
    lo.threads = 2;
    s = r.plan(std::span<const flat_view>(&v, 1), lo);
    CHECK(s.threads == 2);
    REQUIRE(s.files[0].reads.size() == 1);
    const read_op& op = s.files[0].reads[0].op;
    CHECK(op.file_offset == w0 + 40);
    CHECK(op.len == 120);
    REQUIRE(op.pieces.size() == 2);
    CHECK(op.pieces[1].offset == 80);
    CHECK(op.pieces[1].dst == 40);
    CHECK(s.stats.bytes_read == 120);
    r.execute(std::span<const flat_view>(&v, 1), s);
    std::vector<std::byte> want = expect(w0 + 40, 10), second = expect(w0 + 120, 10);
    want.insert(want.end(), second.begin(), second.end());
    CHECK(out == want);
  }
}

// No file is asked for before it is opened; the layout is told apart by 3 names (Megatron's
// tracker file and common.pt, metadata.json: what rules Megatron's layouts out), never by listing
// the folder (O(files) names on every rank that loads it: a LIST page per 1,000 on S3).
constexpr int layout_probes = 3;

TEST_CASE("loading: one open per file, no exists() pre-check, one header read, one read_batch per file") {
  saved_tensors t(8);
  single_process comm;
  auto store = std::make_shared<memory_store>();
  save(memory_directory(store, "mem:ckpt"), std::span<const flat_view>(t.views), comm);
  std::vector<std::vector<std::byte>> back;
  std::vector<flat_view> into = t.views;
  for (std::size_t i = 0; i < into.size(); ++i) {
    back.emplace_back(into[i].nbytes, std::byte{0});
    into[i].data = back.back().data();
  }
  auto fresh = [&] {
    for (auto& b : back) std::fill(b.begin(), b.end(), std::byte{0});
  };
  SUBCASE("batched") {
    counted_directory<true> d{memory_directory(store, "mem:ckpt")};
    load(d, std::span<const flat_view>(into));
    CHECK(back == t.mem);
    CHECK(d.n->exists.load() == layout_probes);
    CHECK(d.n->lists.load() == 0);
    CHECK(d.n->opens.load() == 2);      // metadata.json, rank_0.safetensors
    CHECK(d.n->read_into.load() == 2);  // metadata.json whole; the header in one probe
    CHECK(d.n->read_batch.load() == 1);
    CHECK(d.n->batch_requests.load() == 4);  // every non-empty tensor in one read
  }
  SUBCASE("per read, the fallback") {
    fresh();
    counted_directory<false> d{memory_directory(store, "mem:ckpt")};
    const load_stats st = load(d, std::span<const flat_view>(into));
    CHECK(back == t.mem);
    CHECK(d.n->exists.load() == layout_probes);
    CHECK(d.n->lists.load() == 0);
    CHECK(d.n->read_into.load() == 2 + static_cast<int>(st.read_ops));
  }
  SUBCASE("a missing rank file: not_found naming it, from open") {
    store->objects.erase("mem:ckpt/rank_0.safetensors");
    counted_directory<true> d{memory_directory(store, "mem:ckpt")};
    expect_error([&] { load(d, std::span<const flat_view>(into)); }, errc::not_found,
                 {"mem:ckpt/rank_0.safetensors: missing: metadata.json lists it but it does not exist"});
    CHECK(d.n->exists.load() == layout_probes);
    CHECK(d.n->lists.load() == 0);
    store->objects.erase("mem:ckpt/metadata.json");
    expect_error([&] { checkpoint_reader<counted_directory<true>> r(d); }, errc::not_found, {"no metadata.json"});
  }
}

TEST_CASE_TEMPLATE("loading with merged reads gives the same bytes through every backend", D, file_directory,
                   mmap_directory, memory_directory) {
  // strided shards: many runs, merged into staged reads that are scattered
  directory_maker<D> m;
  single_process comm;
  std::vector<std::byte> full(64 * 33 * 4);
  std::mt19937_64 rng(12);
  for (auto& b : full) b = static_cast<std::byte>(rng());
  flat_view whole{"m", dtype::F32, {64, 33}, std::nullopt, full.data(), full.size()};
  save(m.dir, std::span<const flat_view>(&whole, 1), comm);
  // columns [3, 30) of every row: 64 runs 24 bytes apart
  std::vector<std::byte> got(64 * 27 * 4), want;
  for (std::uint64_t r = 0; r < 64; ++r)
    want.insert(want.end(), full.begin() + static_cast<std::ptrdiff_t>((r * 33 + 3) * 4),
                full.begin() + static_cast<std::ptrdiff_t>((r * 33 + 30) * 4));
  flat_view part{"m", dtype::F32, {64, 33}, shard_spec(block_spec({64, 27}, {0, 3})), got.data(), got.size()};
  load_options lo;
  lo.reads.max_over_read = 0.5;
  lo.threads = 3;
  checkpoint_reader<D> r(m.dir);
  const load_schedule s = r.plan(std::span<const flat_view>(&part, 1), lo);
  CHECK(s.stats.read_ops < 64);  // merged
  CHECK(s.stats.bytes_read > s.stats.bytes_needed);
  r.execute(std::span<const flat_view>(&part, 1), s);
  CHECK(got == want);
}

TEST_CASE("file_storage: a load of files keeps 8 to 16 reads in flight, whatever the host's cores") {
  // a cold local disk wants requests queued (bench_layouts): the file's hint, under load_options
  directory_maker<file_directory> m;
  single_process comm;
  std::vector<float> w(1000, 1.5f);
  flat_view v{"w", dtype::F32, {1000}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), w.size() * 4};
  save(m.dir, std::span<const flat_view>(&v, 1), comm);
  const unsigned want = std::clamp(std::thread::hardware_concurrency(), 8u, 16u);
  CHECK(m.dir.open("rank_0.safetensors").read_defaults().requests_in_flight == want);
  checkpoint_reader<file_directory> r(m.dir);
  CHECK(r.plan(std::span<const flat_view>(&v, 1)).threads == want);
  load_options lo;
  lo.threads = 3;  // the caller's word first
  CHECK(r.plan(std::span<const flat_view>(&v, 1), lo).threads == 3);
  // a mapped file's reads are page faults of the caller's threads: no hint, the library's default
  checkpoint_reader<mmap_directory> mr(mmap_directory(m.dir.path()));
  CHECK(mr.plan(std::span<const flat_view>(&v, 1)).threads == detail::default_threads());
}

// ---------------------------------------------------------------------------------------
// the thread pool

TEST_CASE("thread_pool: every index once, threads kept across calls, nested calls, errors") {
  detail::thread_pool p;
  for (unsigned threads : {1u, 2u, 4u, 16u})
    for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(1000)}) {
      std::vector<std::atomic<int>> hits(n);
      p.parallel_for(n, threads, [&](std::size_t i) { ++hits[i]; });
      CHECK(std::all_of(hits.begin(), hits.end(), [](const std::atomic<int>& h) { return h.load() == 1; }));
    }
  const unsigned started = p.size();
  CHECK(started == 15);  // 16 threads asked: the caller and 15 kept in the pool
  std::mutex mu;
  std::set<std::thread::id> ids;
  for (int call = 0; call < 5; ++call)
    p.parallel_for(64, 4, [&](std::size_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      std::lock_guard lock(mu);
      ids.insert(std::this_thread::get_id());
    });
  CHECK(p.size() == started);  // no thread started for later calls
  ids.erase(std::this_thread::get_id());
  CHECK(ids.size() <= started);

  // nested: each outer task runs an inner parallel_for on the same pool
  std::atomic<std::uint64_t> sum{0};
  p.parallel_for(8, 4, [&](std::size_t i) { p.parallel_for(100, 4, [&](std::size_t j) { sum += i * 100 + j; }); });
  CHECK(sum.load() == 800 * 799 / 2);

  std::atomic<int> after{0};
  CHECK_THROWS_WITH(p.parallel_for(1000, 4,
                                   [&](std::size_t i) {
                                     if (i == 37) throw std::runtime_error("task 37 failed");
                                     ++after;
                                   }),
                    "task 37 failed");
  CHECK(after.load() < 1000);
  std::atomic<int> again{0};
  p.parallel_for(100, 4, [&](std::size_t) { ++again; });  // still usable
  CHECK(again.load() == 100);
}

namespace {

/// Runs child() in a child made by fork(), which exits 0 when it returns true: "" when it did,
/// else what became of it ("exited 3", "was killed by signal 14"). The child's alarm ends it
/// after 60 s: a bound on a hang (what the fork tests look for), not on speed.
template <class F>
std::string in_fork(F&& child) {
  const pid_t pid = ::fork();
  if (pid < 0) return "could not be made";
  if (pid == 0) {
    ::alarm(60);
    ::_exit(child() ? 0 : 3);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return "could not be waited for";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status))
                             : "exited " + std::to_string(WEXITSTATUS(status));
}

}  // namespace

TEST_CASE("thread_pool: a child made by fork() just after a parallel_for runs its own (pthread_atfork)") {
  // Before the fix the child's first parallel_for blocked for ever in about half of these forks
  // (its copy of the condition variable still counted the parent's waiting threads). A child
  // that still hangs is ended by its alarm (a bound on a hang, not on speed: the child's work is
  // 2 x 64 additions and starting 3 threads) and the test stops at the first.
  detail::thread_pool own;
  for (int round = 0; round < 40; ++round) {
    std::atomic<std::uint64_t> before{0};
    own.parallel_for(64, 4, [&](std::size_t i) { before += i; });
    detail::parallel_for(64, 4, [&](std::size_t i) { before += i; });
    REQUIRE(before.load() == 2 * 64 * 63 / 2);
    const std::string child = in_fork([&] {
      std::atomic<std::uint64_t> sum{0};
      own.parallel_for(64, 4, [&](std::size_t i) { sum += i; });
      detail::parallel_for(64, 4, [&](std::size_t i) { sum += i; });
      return sum.load() == 2 * 64 * 63 / 2 && own.size() == 3;
    });
    REQUIRE_MESSAGE(child.empty(), "round " << round << ": the child " << child);
  }
  // the parent's pools go on as before
  std::atomic<int> after{0};
  own.parallel_for(100, 4, [&](std::size_t) { ++after; });
  CHECK(after.load() == 100);
  CHECK(own.size() == 3);
}

TEST_CASE("file_storage: a child made by fork() while another thread opens files opens and reads its own") {
  // The descriptor cache's lock is held across fork (pthread_atfork): before, a child forked
  // while another thread held it blocked for ever at its first open. A child that still hangs is
  // ended by its alarm (a bound on a hang, not on speed: the child opens and reads one small
  // file) and the test stops at the first.
  testing::temp_dir dir("forkfd");
  testing::write_file(dir.path / "busy", "opened and closed all the time by another thread");
  testing::write_file(dir.path / "mine", "the child's own file");
  std::atomic<bool> stop{false};
  std::atomic<long> opens{0};
  std::thread busy([&] {
    while (!stop) {
      file_storage f((dir.path / "busy").string());
      std::string got(f.size(), '\0');
      f.read_into(0, std::as_writable_bytes(std::span(got)));
      ++opens;
    }
  });
  for (int round = 0; round < 40; ++round) {
    for (const long before = opens.load(); opens.load() < before + 20;) std::this_thread::yield();
    const std::string child = in_fork([&] {
      file_storage g((dir.path / "mine").string());
      std::string got(g.size(), '\0');
      g.read_into(0, std::as_writable_bytes(std::span(got)));
      return got == "the child's own file";
    });
    if (!child.empty()) {
      stop = true;
      busy.join();
      REQUIRE_MESSAGE(false, "round " << round << ": the child " << child);
    }
  }
  stop = true;
  busy.join();
  CHECK(opens.load() >= 40 * 20);
}

TEST_CASE(
    "file_storage: one descriptor per file, at most fd_cache::capacity() open, reopened on demand; a replaced file is "
    "refused") {
  testing::temp_dir dir("fdcache");
  auto& cache = detail::fd_cache::instance();
  const std::size_t cap = cache.capacity();
  REQUIRE(cap >= 16);
  const std::size_t n = cap + 40;
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < n; ++i) {
    paths.push_back((dir.path / ("f" + std::to_string(i))).string());
    testing::write_file(paths.back(), "file " + std::to_string(i) + " says hello");
  }
  {
    std::vector<file_storage> open;
    open.reserve(n + 8);
    for (const auto& p : paths) open.emplace_back(p);
    for (int k = 0; k < 8; ++k) open.emplace_back(paths[0]);  // the same file again: its descriptor, shared
    CHECK(cache.open_descriptors() <= cap);
    // every storage reads its own bytes, those closed for room reopened as they are read
    for (std::size_t i = 0; i < n + 8; ++i) {
      const std::size_t f = i < n ? i : 0;
      std::string got(open[i].size(), '\0');
      open[i].read_into(0, std::as_writable_bytes(std::span(got)));
      CHECK(got == "file " + std::to_string(f) + " says hello");
      CHECK(cache.open_descriptors() <= cap);
    }
    // the least recently read file is closed by now; another file put at its path is refused
    const std::size_t victim = 1;
    testing::write_file(dir.path / "new", "another file entirely!");
    std::filesystem::rename(dir.path / "new", paths[victim]);
    for (std::size_t i = 2; i < n; ++i)
      open[i].read_into(0, std::as_writable_bytes(std::span<char>(std::string(4, ' ').data(), 4)));
    std::string buf(4, '\0');
    CHECK_THROWS_WITH_AS(open[victim].read_into(0, std::as_writable_bytes(std::span(buf))),
                         doctest::Contains("changed since it was opened"), shardsafe::error);
  }
  CHECK(cache.open_descriptors() == 0);  // every storage gone: every descriptor closed
}

TEST_CASE("file_storage and mmap_storage refuse a FIFO, a directory and a device at once, naming what it is") {
  testing::temp_dir dir("nonregular");
  const auto fifo = dir.path / "pipe.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  CHECK_THROWS_WITH_AS(file_storage{fifo}, doctest::Contains("is a FIFO (named pipe), not a regular file"),
                       shardsafe::error);
  CHECK_THROWS_WITH_AS(mmap_storage{fifo}, doctest::Contains("is a FIFO (named pipe), not a regular file"),
                       shardsafe::error);
  CHECK_THROWS_WITH_AS(file_storage("/dev/zero"), doctest::Contains("is a character device"), shardsafe::error);
  CHECK_THROWS_WITH_AS(file_storage(dir.path), doctest::Contains("is a directory"), shardsafe::error);
}
