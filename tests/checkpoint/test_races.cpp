// The race tests: built with -fsanitize=thread as tests/race_tests (tests/meson.build), where
// ThreadSanitizer stops the run at the first data race it sees. Each case runs real concurrency
// through what a training process shares between threads, and checks the values it gets:
// the thread pool (parallel_for from several threads at once, nested, failing), concurrent
// loads of one checkpoint from memory, file and mmap storage, concurrent reads of one storage
// object, the async saver (training memory changed while the save is in flight), worlds of
// thread ranks saving and loading resharded, and checksums computed by several writer threads
// (checked against XXH3 computed here, one block at a time).
//
// Names here are static or prefixed race_ (this file may be built together with others).
#include "shardsafe/detail/thread_pool.hpp"

#include <doctest/doctest.h>
#include <xxhash.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardsafe/checkpoint/async_save.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;

/// The value of element i of tensor `seed` (distinct per tensor and element, exact in F32).
static float race_value(int seed, std::uint64_t i) {
  return static_cast<float>(seed * 100000 + static_cast<int>(i % 99991));
}

/// Runs body(t) on n threads of their own and joins them; rethrows the first exception.
template <class F>
static void race_threads(int n, F body) {
  std::vector<std::exception_ptr> err(static_cast<std::size_t>(n));
  std::vector<std::thread> ts;
  for (int t = 0; t < n; ++t)
    ts.emplace_back([&, t] {
      try {
        body(t);
      } catch (...) {
        err[static_cast<std::size_t>(t)] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

/// A whole (unsharded) F32 tensor of n elements with race_value(seed, i).
struct race_tensor {
  std::string key;
  std::vector<float> v;
  race_tensor(std::string k, int seed, std::uint64_t n) : key(std::move(k)), v(n) {
    for (std::uint64_t i = 0; i < n; ++i) v[i] = race_value(seed, i);
  }
  flat_view view() {
    return {key, dtype::F32, {v.size()}, std::nullopt, reinterpret_cast<std::byte*>(v.data()), v.size() * 4};
  }
};

TEST_CASE("races: parallel_for from several threads at once, nested, and failing") {
  constexpr std::size_t n = 2000;
  // four callers share the pool; each index of each caller is visited once (plain writes: a
  // second visit from another thread would be a race TSan reports, and a wrong count here)
  std::vector<std::vector<int>> hits(4, std::vector<int>(n, 0));
  std::vector<std::vector<std::uint64_t>> inner(4, std::vector<std::uint64_t>(n, 0));
  race_threads(4, [&](int t) {
    detail::parallel_for(n, 4, [&](std::size_t i) {
      ++hits[t][i];
      // a parallel_for inside a task finishes even when every pool thread is busy
      if (i % 100 == 0) {
        std::vector<std::uint64_t> part(8, 0);
        detail::parallel_for(8, 3, [&](std::size_t k) { part[k] = i * 8 + k; });
        for (auto x : part) inner[t][i] += x;
      }
    });
  });
  for (int t = 0; t < 4; ++t)
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(hits[t][i] == 1);
      REQUIRE(inner[t][i] == (i % 100 == 0 ? i * 64 + 28 : 0));
    }

  // the first exception is rethrown once every started task has returned
  std::atomic<int> started{0};
  std::vector<int> touched(500, 0);
  CHECK_THROWS_WITH_AS(detail::parallel_for(500, 4,
                                            [&](std::size_t i) {
                                              started.fetch_add(1);
                                              touched[i] = 1;
                                              if (i == 17) throw std::runtime_error("race: task 17");
                                            }),
                       "race: task 17", std::runtime_error);
  int seen = 0;
  for (int x : touched) seen += x;
  CHECK(seen == started.load());

  // a pool of its own: used from two threads, then destroyed (its threads joined)
  {
    detail::thread_pool pool;
    std::vector<std::uint64_t> sum(2, 0);
    race_threads(2, [&](int t) {
      std::vector<std::uint64_t> v(300, 0);
      pool.parallel_for(v.size(), 5, [&](std::size_t i) { v[i] = i * i; });
      for (auto x : v) sum[t] += x;
    });
    for (auto s : sum) CHECK(s == 299ull * 300 * 599 / 6);
    CHECK(pool.size() >= 1);
  }
}

/// Saves three whole tensors (one of 300,000 elements, read in several pieces) into dir.
template <WritableDirectory D>
static void race_save_sample(const D& dir) {
  race_tensor a("a", 1, 300000), b("b", 2, 1000), c("c", 3, 7);
  std::vector<flat_view> views{a.view(), b.view(), c.view()};
  single_process one;
  save_options opt;
  opt.threads = 3;
  opt.direct_io = false;
  opt.write_chunk_bytes = 64 << 10;
  save(dir, std::span<const flat_view>(views), one, opt);
}

/// Six threads load the sample from dir at once, each into memory of its own, in a range of
/// its own of tensor a (plus all of b and c), reads on three pool threads each, checksums
/// verified: every value must be the saved one.
template <ReadableDirectory D>
static void race_load_sample(const D& dir) {
  race_threads(6, [&](int t) {
    const std::uint64_t lo = 50000 * std::uint64_t(t), hi = lo + 50000 + 17 * std::uint64_t(t % 2);
    const std::uint64_t hi_c = std::min<std::uint64_t>(hi, 300000);
    std::vector<float> a(hi_c - lo, -1.f), b(1000, -1.f), c(7, -1.f);
    std::vector<flat_view> views{
        {"a", dtype::F32, {300000}, flat_spec{{lo, hi_c}}, reinterpret_cast<std::byte*>(a.data()), a.size() * 4},
        {"b", dtype::F32, {1000}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), 4000},
        {"c", dtype::F32, {7}, std::nullopt, reinterpret_cast<std::byte*>(c.data()), 28}};
    load_options opt;
    opt.threads = 3;
    opt.verify_checksums = true;
    opt.reads.max_read_bytes = 32 << 10;  // many reads, so the pool's threads share the work
    const load_stats st = load(dir, std::span<const flat_view>(views), opt);
    if (st.tensors != 3 || st.checksum_blocks == 0) throw std::runtime_error("race: load stats wrong");
    for (std::uint64_t i = lo; i < hi_c; ++i)
      if (a[i - lo] != race_value(1, i)) throw std::runtime_error("race: a[" + std::to_string(i) + "] wrong");
    for (std::uint64_t i = 0; i < 1000; ++i)
      if (b[i] != race_value(2, i)) throw std::runtime_error("race: b wrong");
    for (std::uint64_t i = 0; i < 7; ++i)
      if (c[i] != race_value(3, i)) throw std::runtime_error("race: c wrong");
  });
}

TEST_CASE("races: concurrent loads of one checkpoint from memory, file and mmap storage") {
  testing::temp_dir tmp("race-load");
  SUBCASE("memory") {
    memory_directory dir(std::make_shared<memory_store>(), "mem:ck");
    race_save_sample(dir);
    race_load_sample(dir);
  }
  SUBCASE("file") {
    race_save_sample(file_directory(tmp.path / "ck"));
    race_load_sample(file_directory(tmp.path / "ck"));
  }
  SUBCASE("mmap") {
    race_save_sample(file_directory(tmp.path / "ck"));
    race_load_sample(mmap_directory(tmp.path / "ck"));
  }
}

/// Eight threads read overlapping ranges of one storage object s whose bytes are `want`.
template <ReadableStorage S>
static void race_read_one(const S& s, const std::vector<std::byte>& want) {
  race_threads(8, [&](int t) {
    for (std::uint64_t k = 0; k < 40; ++k) {
      const std::uint64_t off = (std::uint64_t(t) * 7919 + k * 104729) % (want.size() - 5000);
      std::vector<std::byte> got(1000 + 97 * k % 4000);
      s.read_into(off, got);
      if (std::memcmp(got.data(), want.data() + off, got.size()) != 0)
        throw std::runtime_error("race: bytes at " + std::to_string(off) + " wrong");
    }
  });
}

TEST_CASE("races: concurrent reads of one storage object") {
  testing::temp_dir tmp("race-read");
  std::vector<std::byte> bytes(1 << 20);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 131 + i / 977) & 0xff);
  {
    file_writer w = file_directory(tmp.path).create("blob");
    w.write_at(0, bytes);
    w.sync();
    w.commit();
  }
  SUBCASE("memory") { race_read_one(memory_storage(byte_buffer(bytes), "blob"), bytes); }
  SUBCASE("file") { race_read_one(file_storage(tmp.path / "blob"), bytes); }
  SUBCASE("mmap") { race_read_one(mmap_storage(tmp.path / "blob"), bytes); }
}

TEST_CASE("races: the async saver while training changes other memory, then wait and destroy") {
  testing::temp_dir tmp("race-async");
  race_tensor w("w", 4, 200000), b("b", 5, 333);
  std::vector<flat_view> views{w.view(), b.view()};
  std::vector<float> other(100000, 0.f);  // training's memory that is not saved
  async_save_handle last;                 // outlives the saver: the saver's destructor joins
  {
    async_saver<single_process> saver(single_process{}, 3);
    for (int step = 0; step < 3; ++step) {
      async_save_handle h =
          saver.save(file_directory(tmp.path / ("step" + std::to_string(step))), std::span<const flat_view>(views));
      // training goes on while the save is written: the saved views change, another thread
      // writes its own memory
      std::thread trainer([&] {
        for (int k = 0; k < 5; ++k)
          for (auto& x : other) x += 1.f;
      });
      for (auto& x : w.v) x = -1.f;
      for (auto& x : b.v) x = -1.f;
      trainer.join();
      const async_save_stats& r = h.wait();
      CHECK(r.folders.size() == 1);
      CHECK(r.staged_bytes == 200000 * 4 + 333 * 4);
      // the next step's values
      for (std::uint64_t i = 0; i < w.v.size(); ++i) w.v[i] = race_value(4 + step + 1, i);
      for (std::uint64_t i = 0; i < b.v.size(); ++i) b.v[i] = race_value(5 + step + 1, i);
    }
    // the last save is left in flight: the saver's destructor waits for it
    last = saver.save(file_directory(tmp.path / "last"), std::span<const flat_view>(views));
    for (auto& x : w.v) x = -3.f;
  }
  REQUIRE(last.ready());
  CHECK(last.wait().folders.size() == 1);
  CHECK(other[12345] == 15.f);
  for (int step = 0; step <= 3; ++step) {
    CAPTURE(step);
    std::vector<float> gw(200000, 0.f), gb(333, 0.f);
    std::vector<flat_view> into{
        {"w", dtype::F32, {200000}, std::nullopt, reinterpret_cast<std::byte*>(gw.data()), 800000},
        {"b", dtype::F32, {333}, std::nullopt, reinterpret_cast<std::byte*>(gb.data()), 333 * 4}};
    load(file_directory(tmp.path / (step == 3 ? std::string("last") : "step" + std::to_string(step))),
         std::span<const flat_view>(into));
    bool ok = true;
    for (std::uint64_t i = 0; i < gw.size(); ++i) ok = ok && gw[i] == race_value(4 + step, i);
    for (std::uint64_t i = 0; i < gb.size(); ++i) ok = ok && gb[i] == race_value(5 + step, i);
    CHECK(ok);
  }
}

TEST_CASE("races: thread ranks save with checksums from several writer threads, then load resharded") {
  testing::temp_dir tmp("race-world");
  constexpr std::uint64_t n = 120000;  // x: F32 [n], split 3 ways on save and 2 ways on load
  constexpr std::uint64_t block = 4096;
  // every rank's writer threads hash blocks of 4 KiB at once; the table must equal XXH3 of
  // each block of the bytes each rank wrote, computed here one block at a time
  std::vector<std::vector<float>> part(3);
  auto thrown = testing::run_ranks(3, [&](testing::thread_comm& comm) {
    const int r = comm.rank();
    const std::uint64_t lo = n / 3 * std::uint64_t(r), hi = lo + n / 3;
    auto& mine = part[static_cast<std::size_t>(r)];
    for (std::uint64_t i = lo; i < hi; ++i) mine.push_back(race_value(7, i));
    race_tensor s("s", 8, 1000);  // the same on every rank: replicated, written by rank 0
    std::vector<flat_view> views{
        {"x", dtype::F32, {n}, flat_spec{{lo, hi}}, reinterpret_cast<std::byte*>(mine.data()), mine.size() * 4},
        s.view()};
    save_options opt;
    opt.threads = 4;
    opt.checksum_block_bytes = block;
    opt.write_chunk_bytes = 8 << 10;
    opt.direct_io = r != 1;  // rank 1 through buffered writes
    save(file_directory(tmp.path / "ck"), std::span<const flat_view>(views), comm, opt);
  });
  for (auto& t : thrown)
    if (t) std::rethrow_exception(t);

  checkpoint_reader<file_directory> reader(file_directory(tmp.path / "ck"));
  const auto& cs = reader.metadata().extras.checksums;
  REQUIRE(cs.has_value());
  REQUIRE(cs->block_bytes == block);
  auto check_table = [&](const std::string& file, const std::string& key, const std::byte* data, std::uint64_t bytes) {
    CAPTURE(file);
    CAPTURE(key);
    const auto& hashes = cs->files.at(file).at(key);
    REQUIRE(hashes.size() == (bytes + block - 1) / block);
    for (std::uint64_t k = 0; k < hashes.size(); ++k)
      REQUIRE(hashes[k] == XXH3_64bits(data + k * block, std::min(block, bytes - k * block)));
  };
  for (int r = 0; r < 3; ++r)
    check_table("rank_" + std::to_string(r) + ".safetensors", "x",
                reinterpret_cast<const std::byte*>(part[static_cast<std::size_t>(r)].data()), n / 3 * 4);
  race_tensor s_want("s", 8, 1000);
  check_table("rank_0.safetensors", "s", reinterpret_cast<const std::byte*>(s_want.v.data()), 4000);

  // two thread ranks load the halves at once, each across two or three saved files
  std::vector<std::vector<float>> got(2, std::vector<float>(n / 2, -1.f));
  thrown = testing::run_ranks(2, [&](testing::thread_comm& comm) {
    const int r = comm.rank();
    const std::uint64_t lo = n / 2 * std::uint64_t(r);
    std::vector<float> s(1000, -1.f);
    std::vector<flat_view> views{
        {"x", dtype::F32, {n}, flat_spec{{lo, lo + n / 2}}, reinterpret_cast<std::byte*>(got[r].data()), n / 2 * 4},
        {"s", dtype::F32, {1000}, std::nullopt, reinterpret_cast<std::byte*>(s.data()), 4000}};
    load_options opt;
    opt.threads = 3;
    opt.verify_checksums = true;
    opt.reads.max_read_bytes = 16 << 10;
    load(file_directory(tmp.path / "ck"), std::span<const flat_view>(views), opt);
    comm.barrier();
    for (std::uint64_t i = 0; i < 1000; ++i)
      if (s[i] != race_value(8, i)) throw std::runtime_error("race: s wrong on rank " + std::to_string(r));
  });
  for (auto& t : thrown)
    if (t) std::rethrow_exception(t);
  for (int r = 0; r < 2; ++r)
    for (std::uint64_t i = 0; i < n / 2; ++i) REQUIRE(got[r][i] == race_value(7, n / 2 * std::uint64_t(r) + i));
}
