// Loads into memory the library provides: the zero-copy mapping of files (map_state) and the
// huge-page arena of unshard_state, checked against the tensors saved (fixtures.hpp values).
#include "shardsafe/torch/mapped_state.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "fixtures.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/torch/state_dict.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

const std::vector<std::pair<std::string, shape_t>> mem_tensors{
    {"embed", {300, 64}}, {"w", {64, 64}}, {"b", {64}}, {"scalar", {}}, {"empty", {0, 5}}};

using named_tensors = std::vector<std::pair<std::string, at::Tensor>>;

/// got holds want's names in want's order, each tensor bit for bit want's; each is 64-byte
/// aligned when aligned64.
void check_same_named(const named_tensors& got, const named_tensors& want, bool aligned64 = false) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].first);
    CHECK(got[i].first == want[i].first);
    CHECK(testing::same_bits(got[i].second, want[i].second));
    if (aligned64) CHECK(reinterpret_cast<std::uintptr_t>(got[i].second.data_ptr()) % 64 == 0);
  }
}

state_dict whole_state() {
  state_dict sd;
  for (const auto& [k, s] : mem_tensors) sd.add(k, testing::expected_full(k, dtype::F32, s));
  return sd;
}

}  // namespace

TEST_CASE("map_state: tensors held whole by one file are copy-on-write views of it; the file never changes") {
  testing::temp_dir dir("map");
  single_process one;
  save_state_dict(file_directory(dir.path / "c"), whole_state(), one);
  const std::string before = testing::slurp(dir.path / "c" / "rank_0.safetensors");
  map_stats st;
  auto state = map_state(dir.path / "c", &st);
  CHECK(st.mapped == mem_tensors.size());
  CHECK(st.copied == 0);
  REQUIRE(state.size() == mem_tensors.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    CAPTURE(state[i].first);
    const auto& [k, s] =
        *std::find_if(mem_tensors.begin(), mem_tensors.end(), [&](auto& p) { return p.first == state[i].first; });
    CHECK(testing::same_bits(state[i].second, testing::expected_full(k, dtype::F32, s)));
  }
  // the mapping is the file's: the tensor's memory lies inside a mapping of rank_0.safetensors
  at::Tensor w;
  for (auto& [k, t] : state)
    if (k == "w") w = t;
  CHECK(testing::same_bits(w, testing::expected_full("w", dtype::F32, {64, 64})));
  // writes stay in memory (copy-on-write); the file keeps its bytes
  w.fill_(3.f);
  CHECK(w.sum().item<float>() == 3.f * 64 * 64);
  CHECK(testing::slurp(dir.path / "c" / "rank_0.safetensors") == before);
  // a tensor kept alone keeps its mapping after every other one (and the reader) is gone
  at::Tensor b;
  for (auto& [k, t] : state)
    if (k == "b") b = t;
  state.clear();
  w = at::Tensor();
  CHECK(testing::same_bits(b, testing::expected_full("b", dtype::F32, {64})));
}

TEST_CASE("map_state: tensors split over rank files are assembled; the others mapped") {
  testing::temp_dir dir("map2");
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& c) {
    state_dict sd;
    at::Tensor w = testing::expected_full("w", dtype::F32, {64, 64});
    const auto spec = testing::block_part({64, 64}, 0, 2, c.rank());
    sd.add("w", testing::local_of(w, spec), spec, {64, 64});
    sd.add("b", testing::expected_full("b", dtype::F32, {64}));
    save_state_dict(file_directory(dir.path / "c"), sd, c);
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
  map_stats st;
  auto state = map_state(dir.path / "c", &st);
  CHECK(st.mapped == 1);
  CHECK(st.copied == 1);
  CHECK(st.copied_bytes == 64 * 64 * 4);
  for (auto& [k, t] : state)
    CHECK(testing::same_bits(t, testing::expected_full(k, dtype::F32, k == "w" ? shape_t{64, 64} : shape_t{64})));
}

TEST_CASE(
    "map_state: a torch DCP folder's tensors, those torch.save kept transposed mapped with its strides, values "
    "torch's") {
  // the golden folder torch 2.6 wrote (tests/dcp2_fixture.py --small): extra.whole_t is a plain
  // transposed F16 tensor, written whole in one chunk with strides (1, 3)
  const fs::path golden = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "dcp_torch2";
  map_stats st;
  const auto state = map_state(golden / "ckpt", &st);
  std::string digest;
  std::vector<std::string> lines;
  for (const auto& [k, t] : state) {
    const at::Tensor c = t.contiguous();
    const std::string hash = testing::sha256_hex(c.data_ptr(), static_cast<std::size_t>(c.nbytes()));
    std::string shape = "[";
    for (std::int64_t d = 0; d < t.dim(); ++d) shape += (d ? "," : "") + std::to_string(t.size(d));
    lines.push_back(k + " " + std::string(name(to_dtype(t.scalar_type()))) + " " + shape + "] " + hash + "\n");
    if (k == "extra.whole_t") {
      CHECK(t.strides().vec() == std::vector<std::int64_t>{1, 3});
      CHECK_FALSE(t.is_contiguous());
    }
  }
  std::sort(lines.begin(), lines.end());
  for (const auto& l : lines) digest += l;
  CHECK(digest == testing::slurp(golden / "digest.txt"));
  CHECK(st.mapped >= 1);  // extra.whole_t and the other tensors one chunk holds
}

TEST_CASE("unshard_state into a huge-page arena: the same tensors; one kept alive keeps the memory") {
  testing::temp_dir dir("arena");
  single_process one;
  save_state_dict(file_directory(dir.path / "c"), whole_state(), one);
  auto plain = unshard_state(file_directory(dir.path / "c"));
  auto arena = unshard_state(file_directory(dir.path / "c"), {}, tensor_memory::arena);
  check_same_named(arena, plain, true);
  at::Tensor keep = arena.front().second;
  const std::string name = arena.front().first;
  arena.clear();
  for (auto& [k, s] : mem_tensors)
    if (k == name) CHECK(testing::same_bits(keep, testing::expected_full(k, dtype::F32, s)));
}

TEST_CASE("tensor_arena::populate_ahead: switching to small pages part-way leaves every byte writable and intact") {
  // 3 tensors over 80 MiB: 4 MiB of huge pages and 4 MiB of small ones tried first, then
  // the populating thread's 32 MiB steps
  const std::vector<std::uint64_t> sizes{(std::uint64_t(40) << 20) + 4, std::uint64_t(24) << 20,
                                         std::uint64_t(16) << 20};
  std::uint64_t total = 0;
  for (auto n : sizes) total += n;
  for (const bool force : {true, false}) {
    CAPTURE(force);
    tensor_arena arena{std::span<const std::uint64_t>(sizes)};
    arena_populate_options opt;
    if (force) {
      opt.backed_huge_seconds_per_gib = -1;  // every step counts as slow
      opt.small_pages_if_cheaper_by = 1e12;  // and small pages always win
    } else {
      opt.backed_huge_seconds_per_gib = 1e12;  // no step is slow: huge pages throughout
    }
    const bool populating = arena.populate_ahead(opt);
    // write while it populates (as the reads do), each byte a function of its offset
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto* p = reinterpret_cast<std::uint8_t*>(arena.data(i));
      for (std::uint64_t k = 0; k < sizes[i]; ++k) p[k] = static_cast<std::uint8_t>((k * 131 + i * 7) >> 3);
    }
    arena.stop_populating();
    if (populating && force) {
      // decided by the trial before the thread started: small pages after the first 8 MiB
      CHECK(arena.small_pages_from() == (std::uint64_t(8) << 20));
    } else {
      CHECK(arena.small_pages_from() == 0);
    }
    std::uint64_t bad = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto* p = reinterpret_cast<const std::uint8_t*>(arena.data(i));
      for (std::uint64_t k = 0; k < sizes[i]; ++k) bad += p[k] != static_cast<std::uint8_t>((k * 131 + i * 7) >> 3);
    }
    CHECK(bad == 0);
    CHECK(arena.bytes() >= total);
  }
}

namespace {
/// The kernel page size (kB) of the mapping holding p, from /proc/self/smaps; 0 if not found.
long kernel_page_kib(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  bool in = false;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find('-') < line.find(' ')) {
      in = lo <= a && a < hi;
      continue;
    }
    long k = 0;
    if (in && std::sscanf(line.c_str(), "KernelPageSize: %ld kB", &k) == 1) return k;
  }
  return 0;
}
}  // namespace

TEST_CASE(
    "unshard_state into a hugetlb_arena: the reserved huge pages when the pool has room, else the arena; same "
    "tensors") {
  testing::temp_dir dir("hugetlb");
  single_process one;
  save_state_dict(file_directory(dir.path / "c"), whole_state(), one);
  auto plain = unshard_state(file_directory(dir.path / "c"));
  const long pool = tensor_arena::
      hugetlb_pages_free();  // (another process may take pages meanwhile: rare, and then the fallback is checked)
  {
    const std::vector<std::uint64_t> sizes{std::uint64_t(3) << 20};
    tensor_arena a{std::span<const std::uint64_t>(sizes), true};
    CHECK(a.from_hugetlb_pool() == (pool >= 2));  // 3 MiB: two huge pages
    CHECK(kernel_page_kib(a.data(0)) == (a.from_hugetlb_pool() ? 2048 : 4));
    a.populate_ahead();
    std::memset(a.data(0), 0x5a, sizes[0]);
    a.stop_populating();
    CHECK(a.small_pages_from() == 0);
    const auto* b = reinterpret_cast<const unsigned char*>(a.data(0));
    CHECK(std::count(b, b + sizes[0], 0x5a) == static_cast<std::ptrdiff_t>(sizes[0]));
  }
  check_same_named(unshard_state(file_directory(dir.path / "c"), {}, tensor_memory::hugetlb_arena), plain);
}
