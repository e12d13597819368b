// A save onto storage that runs out of space fails on every rank with a clear error, leaves
// nothing loadable and no temporary file, and the previous checkpoint stays as it was: on a
// real small file system (a tmpfs mounted by the test when it may mount) and on a storage
// wrapper that fails its writes with ENOSPC past a quota (always).
#include <sys/mount.h>

#include <doctest/doctest.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/hooked_directory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

/// A file writer whose writes fail with ENOSPC once the folder's writers together pass a
/// quota of bytes (a full disk, for writers that write at offsets: no O_DIRECT blocks).
class quota_writer {
 public:
  quota_writer(file_writer w, std::shared_ptr<std::atomic<std::uint64_t>> left)
      : w_(std::move(w)), left_(std::move(left)) {}
  std::string_view name() const noexcept { return w_.name(); }
  void write_at(std::uint64_t off, std::span<const std::byte> src) {
    std::uint64_t have = left_->load();
    do {
      if (have < src.size())
        throw error(std::error_code(ENOSPC, std::system_category()),
                    std::string(w_.name()) + ": write of " + std::to_string(src.size()) + " bytes at offset " +
                        std::to_string(off) + ": " + std::strerror(ENOSPC));
    } while (!left_->compare_exchange_weak(have, have - src.size()));
    w_.write_at(off, src);
  }
  void sync() { w_.sync(); }
  void commit() { w_.commit(); }
  void abort() { w_.abort(); }

 private:
  file_writer w_;
  std::shared_ptr<std::atomic<std::uint64_t>> left_;
};

/// A folder whose writers share the quota left.
auto quota_directory(const fs::path& p, std::shared_ptr<std::atomic<std::uint64_t>> left) {
  return testing::hooked_directory(
      file_directory(p), [left = std::move(left)](std::string_view, auto make) { return quota_writer(make(), left); });
}
static_assert(WritableDirectory<decltype(quota_directory({}, nullptr))>);

/// Rank r of 2: w [n] F32, halves, values base + i.
struct half {
  std::vector<float> w;
  std::vector<flat_view> views;
  half(int r, std::uint64_t n, float base) {
    const std::uint64_t lo = r * (n / 2), hi = r == 0 ? n / 2 : n;
    for (std::uint64_t i = lo; i < hi; ++i) w.push_back(base + static_cast<float>(i % 4096));
    views.push_back({"w", dtype::F32, {n}, flat_spec{{lo, hi}}, reinterpret_cast<std::byte*>(w.data()), w.size() * 4});
  }
};

void check_loads(const fs::path& p, std::uint64_t n, float base) {
  std::vector<float> w(n, -1.f);
  std::vector<flat_view> into{{"w", dtype::F32, {n}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), n * 4}};
  load(file_directory(p), std::span<const flat_view>(into));
  for (std::uint64_t i = 0; i < n; ++i) REQUIRE(w[i] == base + static_cast<float>(i % 4096));
}

/// What every rank of a 2-rank save into dir threw (each must have thrown).
template <class D>
std::vector<std::string> failed_save(const D& dir, std::uint64_t n) {
  std::vector<std::string> what(2);
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& c) {
    half h(c.rank(), n, 7.f);
    save(dir, std::span<const flat_view>(h.views), c);
  });
  for (int r = 0; r < 2; ++r) {
    REQUIRE(thrown[r]);
    try {
      std::rethrow_exception(thrown[r]);
    } catch (const error& e) {
      CHECK(e.code() == errc::io_error);
      what[r] = e.what();
    }
  }
  return what;
}

/// The failed save left no commit mark, nothing that loads or verifies, and no temporary.
void check_nothing_loadable(const fs::path& p) {
  CHECK_FALSE(fs::exists(p / metadata_file_name));
  std::vector<float> w(4);
  std::vector<flat_view> into{{"w", dtype::F32, {4}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 16}};
  try {
    load(file_directory(p), std::span<const flat_view>(into));
    FAIL("a failed save loaded");
  } catch (const error& e) {
    CHECK(e.code() == errc::not_found);
  }
  if (fs::exists(p))
    for (const auto& e : fs::directory_iterator(p))
      CHECK_MESSAGE(e.path().filename().string().find("tmp") == std::string::npos, "temporary left: " << e.path());
}

}  // namespace

TEST_CASE("disk full: a quota-limited folder fails the save on every rank; the previous checkpoint is untouched") {
  testing::temp_dir tmp("quota");
  constexpr std::uint64_t n = 1 << 18;  // 1 MiB of F32
  auto left = std::make_shared<std::atomic<std::uint64_t>>(std::uint64_t(1) << 40);
  const auto root = quota_directory(tmp.path, left);
  auto ok = testing::run_ranks(2, [&](testing::thread_comm& c) {
    half h(c.rank(), n, 3.f);
    save(root.sub("step1"), std::span<const flat_view>(h.views), c);
  });
  for (auto& t : ok) REQUIRE_FALSE(t);
  for (std::uint64_t quota :
       {std::uint64_t(0), std::uint64_t(100), std::uint64_t(600) << 10, std::uint64_t(1000) << 10}) {
    CAPTURE(quota);
    left->store(quota);
    const std::string name = "step2-" + std::to_string(quota);
    const auto what = failed_save(root.sub(name), n);
    for (const auto& w : what) {
      CHECK(w.find("No space left on device") != std::string::npos);
      CHECK(w.find("rank_") != std::string::npos);  // names the file
    }
    check_nothing_loadable(tmp.path / name);
    check_loads(tmp.path / "step1", n, 3.f);
    CHECK(verify_checkpoint(file_directory(tmp.path / "step1")).tensors == 1);
  }
}

TEST_CASE("disk full: a save onto a small tmpfs fails on every rank; the previous checkpoint is untouched") {
  testing::temp_dir tmp("tmpfs");
  const fs::path mnt = tmp.path / "mnt";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=4m") != 0) {
    MESSAGE("cannot mount a tmpfs here (" << std::strerror(errno) << "); the quota test above covers the logic");
    return;
  }
  struct unmount {
    fs::path p;
    ~unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } um{mnt};
  auto ok = testing::run_ranks(2, [&](testing::thread_comm& c) {
    half h(c.rank(), 1 << 18, 5.f);  // 1 MiB
    save(file_directory(mnt / "step1"), std::span<const flat_view>(h.views), c);
  });
  for (auto& t : ok) REQUIRE_FALSE(t);
  const auto what = failed_save(file_directory(mnt / "step2"), std::uint64_t(1) << 20);  // 4 MiB: does not fit
  for (const auto& w : what) CHECK(w.find("No space left on device") != std::string::npos);
  check_nothing_loadable(mnt / "step2");
  check_loads(mnt / "step1", 1 << 18, 5.f);
  CHECK(verify_checkpoint(file_directory(mnt / "step1")).tensors == 1);
}
