// Asynchronous saves (checkpoint/async_save.hpp) in worlds of threads: what is saved is the
// snapshot taken before save() returned, errors reach wait() on every rank, one save at a
// time, staging reused, and rotation keeps the newest complete checkpoint while one is in flight.
#include "shardsafe/checkpoint/async_save.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <thread>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/hooked_directory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;

namespace {

/// A gate the background part of a save can be held at.
struct gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = true;
  int waiting = 0;
  void close() {
    std::lock_guard l(m);
    open = false;
  }
  void release() {
    {
      std::lock_guard l(m);
      open = true;
    }
    cv.notify_all();
  }
  void pass() {
    std::unique_lock l(m);
    ++waiting;
    cv.notify_all();
    cv.wait(l, [&] { return open; });
    --waiting;
  }
  /// Waits until n threads wait at the gate.
  void await_waiting(int n) {
    std::unique_lock l(m);
    cv.wait(l, [&] { return waiting >= n; });
  }
};

/// A folder of files whose rank files wait at g before they are written: a save held part
/// way, its folder made and its commit mark not yet written.
auto gated_directory(const std::filesystem::path& p, gate* g) {
  return testing::hooked_directory(file_directory(p), [g](std::string_view n, auto make) {
    if (n.ends_with(".safetensors")) g->pass();
    return make();
  });
}
static_assert(WritableDirectory<decltype(gated_directory({}, nullptr))>);

/// Rank r's part of a 3-rank state: w [1000] F32 split 400/400/200 (flat), b [7] I32 whole.
struct async_rank_state {
  std::vector<float> w;
  std::vector<std::int32_t> b{0, 0, 0, 0, 0, 0, 0};
  std::vector<flat_view> views;
  async_rank_state(int r, float base) {
    const std::uint64_t lo = 400 * std::uint64_t(r), hi = std::min<std::uint64_t>(lo + 400, 1000);
    for (std::uint64_t i = lo; i < hi; ++i) w.push_back(base + static_cast<float>(i));
    for (int i = 0; i < 7; ++i) b[i] = static_cast<std::int32_t>(base) * 10 + i;
    views.push_back(
        {"w", dtype::F32, {1000}, flat_spec{{lo, hi}}, reinterpret_cast<std::byte*>(w.data()), w.size() * 4});
    views.push_back({"b", dtype::I32, {7}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), 28});
  }
  void scribble() {
    std::fill(w.begin(), w.end(), -1.f);
    std::fill(b.begin(), b.end(), -1);
  }
};

/// The full tensors of a checkpoint, read by the loader into fresh memory.
std::pair<std::vector<float>, std::vector<std::int32_t>> read_back(const std::filesystem::path& p) {
  std::vector<float> w(1000, -2.f);
  std::vector<std::int32_t> b(7, -2);
  std::vector<flat_view> into{{"w", dtype::F32, {1000}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 4000},
                              {"b", dtype::I32, {7}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), 28}};
  load(file_directory(p), std::span<const flat_view>(into));
  return {w, b};
}

void check_values(const std::filesystem::path& p, float base) {
  auto [w, b] = read_back(p);
  for (int i = 0; i < 1000; ++i) REQUIRE(w[i] == base + static_cast<float>(i));
  for (int i = 0; i < 7; ++i) REQUIRE(b[i] == static_cast<std::int32_t>(base) * 10 + i);
}

}  // namespace

TEST_CASE("async save: the snapshot taken before save() returns is what is saved, on its own comm") {
  testing::temp_dir tmp("async");
  testing::thread_world ckpt_world(3);  // the checkpoint traffic's own group
  std::vector<async_save_stats> res(3);
  std::vector<std::uint64_t> file_sizes(3);
  auto thrown = testing::run_ranks(3, [&](testing::thread_comm& train) {
    const int r = train.rank();
    async_saver saver(testing::thread_comm(ckpt_world, r));
    async_rank_state s(r, 5.f);
    async_save_handle h = saver.save(file_directory(tmp.path / "step1"), std::span<const flat_view>(s.views));
    s.scribble();     // training goes on: the save must not see this
    train.barrier();  // the training group's collectives run while the save is in flight
    res[r] = h.wait();
    CHECK(h.ready());
    CHECK_FALSE(saver.busy());
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
  check_values(tmp.path / "step1", 5.f);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    REQUIRE(res[r].folders.size() == 1);
    const auto on_disk = std::filesystem::file_size(tmp.path / "step1" / rank_file_name(r));
    CHECK(res[r].folders[0].bytes_written == on_disk);
    // staged: its w shard, and b on rank 0 only (the lowest rank writes a whole tensor)
    CHECK(res[r].staged_bytes == (r == 2 ? 800u : 1600u) + (r == 0 ? 28u : 0u));
    CHECK(res[r].stall_seconds <= res[r].seconds);
    CHECK(res[r].snapshot_seconds <= res[r].stall_seconds);
  }
}

TEST_CASE("async save: staging is reused from save to save and grows with the state") {
  testing::temp_dir tmp("async");
  single_process one;
  async_saver<single_process> saver(one);
  async_rank_state a(0, 1.f);  // its b; w whole on the one rank
  std::vector<float> w(1000);
  std::iota(w.begin(), w.end(), 1.f);
  std::vector<flat_view> views{{"w", dtype::F32, {1000}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 4000},
                               a.views[1]};
  saver.save(file_directory(tmp.path / "s1"), std::span<const flat_view>(views)).wait();
  const std::byte* first = saver.staging().data();
  const std::uint64_t cap = saver.staging().capacity();
  CHECK(cap >= 4028);
  CHECK(cap % staging_buffer::huge_page == 0);
  saver.save(file_directory(tmp.path / "s2"), std::span<const flat_view>(views)).wait();
  CHECK(saver.staging().data() == first);
  CHECK(saver.staging().capacity() == cap);
  std::vector<float> big(std::size_t(3) << 20, 2.f);  // 12 MiB: more than one huge page rounding of 4 KiB
  std::vector<flat_view> more{
      {"big", dtype::F32, {big.size()}, std::nullopt, reinterpret_cast<std::byte*>(big.data()), big.size() * 4}};
  saver.save(file_directory(tmp.path / "s3"), std::span<const flat_view>(more)).wait();
  CHECK(saver.staging().capacity() >= big.size() * 4);
  check_values(tmp.path / "s1", 1.f);
  auto [w2, b2] = read_back(tmp.path / "s2");
  CHECK(w2 == w);
}

TEST_CASE("async save: a failure in the background reaches wait() on every rank; the folder it refused is untouched") {
  testing::temp_dir tmp("async");
  testing::thread_world ckpt_world(2);
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& train) {
    async_saver saver(testing::thread_comm(ckpt_world, train.rank()));
    async_rank_state s(train.rank(), 3.f);
    s.views[0].full_shape = {800};  // two ranks: w [800]
    saver.save(file_directory(tmp.path / "old"), std::span<const flat_view>(s.views)).wait();
    // the same folder again without overwrite: refused in the background, on every rank
    async_rank_state t(train.rank(), 9.f);
    t.views[0].full_shape = {800};
    async_save_handle h = saver.save(file_directory(tmp.path / "old"), std::span<const flat_view>(t.views));
    try {
      h.wait();
      FAIL("the second save should have been refused");
    } catch (const error& e) {
      CHECK(e.code() == errc::already_exists);
      CHECK(std::string(e.what()).find("not empty") != std::string::npos);
    }
    // wait() rethrows every time; the saver rethrows it too
    CHECK_THROWS_AS(h.wait(), error);
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
  std::vector<float> w(800, 0.f);
  std::vector<flat_view> into{{"w", dtype::F32, {800}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 3200}};
  load(file_directory(tmp.path / "old"), std::span<const flat_view>(into));
  for (int i = 0; i < 800; ++i) REQUIRE(w[i] == 3.f + static_cast<float>(i));
}

TEST_CASE("async save: a plan the ranks disagree on is thrown by save() itself; nothing is in flight") {
  testing::temp_dir tmp("async");
  testing::thread_world ckpt_world(2);
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& train) {
    async_saver saver(testing::thread_comm(ckpt_world, train.rank()));
    async_rank_state s(train.rank(), 1.f);
    s.views[0].full_shape = {train.rank() == 0 ? 800u : 900u};
    CHECK_THROWS_WITH_AS(saver.save(file_directory(tmp.path / "x"), std::span<const flat_view>(s.views)),
                         doctest::Contains("shape"), error);
    CHECK_FALSE(saver.busy());
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
  CHECK_FALSE(std::filesystem::exists(tmp.path / "x" / metadata_file_name));
}

TEST_CASE("async save: one save at a time; rotation keeps the newest complete checkpoint while one is in flight") {
  testing::temp_dir tmp("async");
  gate g;
  const auto root = gated_directory(tmp.path, &g);
  single_process train, ckpt;
  async_saver<single_process> saver(ckpt);
  async_rank_state s1(0, 1.f), s2(0, 2.f), s3(0, 3.f);
  for (auto* s : {&s1, &s2, &s3}) {
    s->views[0].spec.reset();
    s->views[0].full_shape = {400};
  }
  saver.save(root.sub("step1"), std::span<const flat_view>(s1.views)).wait();

  g.close();
  async_save_handle h2 = saver.save(root.sub("step2"), std::span<const flat_view>(s2.views));
  g.await_waiting(1);  // step2's folder is made; its rank file waits
  CHECK_FALSE(h2.ready());
  CHECK(saver.busy());
  CHECK(std::filesystem::exists(tmp.path / "step2"));
  // keep 1: step1 is the newest complete one, step2 (in flight) is newer: both stay
  CHECK(rotate_checkpoints(root, 1, train).empty());
  CHECK(latest_checkpoint(root)->name == "step1");

  // a third save waits for the second (held at the gate) before it starts
  std::atomic<bool> third_returned{false};
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CHECK_FALSE(third_returned.load());
    g.release();
  });
  async_save_handle h3 = saver.save(root.sub("step3"), std::span<const flat_view>(s3.views));
  third_returned = true;
  release.join();
  CHECK(h2.ready());
  CHECK(h3.wait().waited_seconds > 0.1);
  h2.wait();
  CHECK(rotate_checkpoints(root, 1, train) == std::vector<std::string>{"step2", "step1"});
  CHECK(latest_checkpoint(root)->name == "step3");
  std::vector<float> w(400);
  std::vector<flat_view> into{{"w", dtype::F32, {400}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 1600}};
  load(file_directory(tmp.path / "step3"), std::span<const flat_view>(into));
  for (int i = 0; i < 400; ++i) REQUIRE(w[i] == 3.f + static_cast<float>(i));
}

TEST_CASE("async save: destroying a handle or the saver waits for the save") {
  testing::temp_dir tmp("async");
  gate g;
  const auto root = gated_directory(tmp.path, &g);
  async_rank_state s(0, 4.f);
  s.views[0].spec.reset();
  s.views[0].full_shape = {400};
  std::atomic<bool> released{false};
  g.close();
  std::thread opener([&] {
    g.await_waiting(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    released = true;
    g.release();
  });
  {
    async_saver<single_process> saver(single_process{});
    async_save_handle h = saver.save(root.sub("a"), std::span<const flat_view>(s.views));
  }  // the handle, then the saver: both wait
  CHECK(released.load());
  opener.join();
  CHECK(std::filesystem::exists(tmp.path / "a" / metadata_file_name));
}

TEST_CASE("async save: a DCP save in the background writes the bytes the blocking DCP save writes") {
  // (the asynchronous saver refused save_format::dcp before: one save for every writable layout)
  testing::temp_dir tmp("async_dcp");
  testing::thread_world ckpt_world(3);
  std::vector<async_save_stats> res(3);
  save_options dcp;
  dcp.format = save_format::dcp;
  auto thrown = testing::run_ranks(3, [&](testing::thread_comm& train) {
    const int r = train.rank();
    async_rank_state s(r, 9.f);
    save(file_directory(tmp.path / "blocking"), std::span<const flat_view>(s.views), train, dcp);
    async_saver saver(testing::thread_comm(ckpt_world, r));
    async_save_handle h = saver.save(file_directory(tmp.path / "async"), std::span<const flat_view>(s.views), dcp);
    s.scribble();  // the snapshot is what is saved
    res[r] = h.wait();
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
  checkpoint_reader<file_directory> r(file_directory(tmp.path / "async"));
  CHECK(r.layout() == dcp_layout::info);
  check_values(tmp.path / "async", 9.f);
  // the same files, byte for byte (the .metadata and every rank's data file)
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path / "blocking"))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"});
  for (const auto& n : names) {
    CAPTURE(n);
    CHECK(testing::slurp(tmp.path / "async" / n) == testing::slurp(tmp.path / "blocking" / n));
  }
  for (int k = 0; k < 3; ++k) {
    CAPTURE(k);
    REQUIRE(res[k].folders.size() == 1);
    CHECK(res[k].folders[0].bytes_written == std::filesystem::file_size(tmp.path / "async" / dcp_data_file_name(k)));
  }
}
