// Tests of checkpoint/configured.hpp: loaders whose backend, communicator and policy are
// template arguments, in worlds of thread ranks. The wrong combinations are compile errors;
// tests/compile_fail/ checks their messages (meson test 'compile_fail').
#include "shardsafe/checkpoint/configured.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
using u64 = std::uint64_t;

// the policies' consistency, at compile time
static_assert(is_consistent(strict_policy));
static_assert(is_consistent(load_policy{.validate_nan = true, .views = only(dtype::BF16)}));
static_assert(!is_consistent(load_policy{.validate_nan = true, .views = only(dtype::I32)}));
static_assert(!is_consistent(load_policy{.convert_dtypes = true, .views = only(dtype::I8)}));
static_assert(is_consistent(load_policy{.convert_dtypes = true}));  // any views: checked per tensor at run time
static_assert(configured_loader<memory_directory, single_process>::policy == strict_policy);
static_assert(!configured_loader<memory_directory, single_process, lenient_policy>::policy.strict);
static_assert(std::is_same_v<decltype(make_configured_loader<lenient_policy>(memory_directory(),
                                                                             std::declval<single_process&>())),
                             configured_loader<memory_directory, single_process, lenient_policy>>);

namespace {

/// A checkpoint of "w" F32 [4, 3] = 0..11, "h" BF16 [5] = 1.5 * i (exact in BF16) and "n"
/// F32 [2] holding a NaN, saved whole by one process.
memory_directory make_checkpoint(const std::shared_ptr<memory_store>& store) {
  const memory_directory dir(store, "mem:configured");
  std::vector<float> w(12), n{1.f, std::numeric_limits<float>::quiet_NaN()};
  for (int i = 0; i < 12; ++i) w[i] = static_cast<float>(i);
  std::vector<std::uint16_t> h(5);
  for (int i = 0; i < 5; ++i) {
    const float f = 1.5f * static_cast<float>(i);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    h[i] = static_cast<std::uint16_t>(bits >> 16);  // exact: the low 16 bits are zero
  }
  const std::vector<flat_view> views{
      {"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 48},
      {"h", dtype::BF16, {5}, std::nullopt, reinterpret_cast<std::byte*>(h.data()), 10},
      {"n", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(n.data()), 8}};
  single_process c;
  save(dir, std::span<const flat_view>(views), c);
  return dir;
}

/// Runs body on 2 thread ranks; returns each rank's error text ("" if none) and checks every
/// rank threw the same code.
template <class F>
std::vector<std::string> on_two_ranks(F&& body, std::optional<errc> code = std::nullopt) {
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& c) { body(c); });
  std::vector<std::string> what(2);
  for (int r = 0; r < 2; ++r) {
    if (!thrown[r]) {
      CHECK_MESSAGE(!code, "rank " << r << " did not throw");
      continue;
    }
    try {
      std::rethrow_exception(thrown[r]);
    } catch (const error& e) {
      CHECK_MESSAGE(code.has_value(), e.what());
      if (code) CHECK(e.code() == *code);
      what[r] = e.what();
    }
  }
  return what;
}

}  // namespace

TEST_CASE("configured loader: strict, 2 ranks loading row blocks, bit-exact; a missing tensor fails every rank") {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir = make_checkpoint(store);
  std::vector<std::vector<float>> rows(2, std::vector<float>(6, -1.f));
  on_two_ranks([&](testing::thread_comm& c) {
    configured_loader<memory_directory, testing::thread_comm, strict_policy> l(dir, c);
    CHECK(l.options().strict);
    CHECK_FALSE(l.options().convert_dtypes);
    const u64 r = static_cast<u64>(c.rank());
    flat_view v{"w", dtype::F32, {4, 3}, block_spec({2, 3}, {2 * r, 0}), reinterpret_cast<std::byte*>(rows[r].data()),
                24};
    const load_stats st = load(l, std::span<const flat_view>(&v, 1));
    CHECK(st.tensors == 1);
    CHECK(st.bytes_needed == 24);
  });
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 6; ++i) CHECK(rows[r][i] == static_cast<float>(6 * r + i));

  // rank 1 asks for a tensor the checkpoint lacks: both ranks throw its error
  const auto what = on_two_ranks(
      [&](testing::thread_comm& c) {
        auto l = make_configured_loader(dir, c);
        std::vector<float> x(2);
        flat_view v{c.rank() == 1 ? "absent" : "n",         dtype::F32, {2}, std::nullopt,
                    reinterpret_cast<std::byte*>(x.data()), 8};
        load(l, std::span<const flat_view>(&v, 1));
      },
      errc::not_found);
  CHECK(what[0] == what[1]);
  CHECK(what[0].find("rank 1: mem:configured: tensor 'absent': not in the checkpoint") != std::string::npos);
}

TEST_CASE("configured loader: lenient lists a missing tensor and loads the rest") {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir = make_checkpoint(store);
  single_process c;
  auto l = make_configured_loader<lenient_policy>(dir, c);
  std::vector<float> w(12, -1.f), x(3, 7.f);
  const std::vector<flat_view> views{
      {"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 48},
      {"absent", dtype::F32, {3}, std::nullopt, reinterpret_cast<std::byte*>(x.data()), 12}};
  const load_stats st = load(l, std::span<const flat_view>(views));
  CHECK(st.missing_keys == std::vector<std::string>{"absent"});
  CHECK(x == std::vector<float>(3, 7.f));  // untouched
  for (int i = 0; i < 12; ++i) CHECK(w[i] == static_cast<float>(i));
  // a second load through the same loader reuses the opened checkpoint
  std::fill(w.begin(), w.end(), 0.f);
  load(l, std::span<const flat_view>(views.data(), 1));
  CHECK(w[11] == 11.f);
}

TEST_CASE("configured loader: dtype conversion and a fixed view dtype") {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir = make_checkpoint(store);
  std::vector<float> h(5, -1.f);
  const flat_view hv{"h", dtype::F32, {5}, std::nullopt, reinterpret_cast<std::byte*>(h.data()), 20};
  single_process c;
  // BF16 in the checkpoint into F32 views: converted under a converting policy
  auto conv = make_configured_loader<load_policy{.convert_dtypes = true, .views = only(dtype::F32)}>(dir, c);
  load(conv, std::span<const flat_view>(&hv, 1));
  for (int i = 0; i < 5; ++i) CHECK(h[i] == 1.5f * static_cast<float>(i));
  // refused without conversion
  auto plain = make_configured_loader(dir, c);
  testing::expect_error([&] { load(plain, std::span<const flat_view>(&hv, 1)); }, errc::dtype_mismatch,
                        {"tensor 'h'", "BF16", "convert_dtypes is off"});
  // a view of another dtype than the policy's, on one rank of two: refused on both before any byte moves
  std::vector<std::uint16_t> raw(5, 0xFFFF);
  const auto what = on_two_ranks(
      [&](testing::thread_comm& tc) {
        auto l = make_configured_loader<load_policy{.views = only(dtype::F32)}>(dir, tc);
        std::vector<float> w(12);
        flat_view v =
            tc.rank() == 0
                ? flat_view{"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 48}
                : flat_view{"h", dtype::BF16, {5}, std::nullopt, reinterpret_cast<std::byte*>(raw.data()), 10};
        load(l, std::span<const flat_view>(&v, 1));
      },
      errc::dtype_mismatch);
  CHECK(what[0].find("rank 1: mem:configured: tensor 'h': the view has dtype BF16 but this loader's policy takes only "
                     "F32 views") != std::string::npos);
  CHECK(raw == std::vector<std::uint16_t>(5, 0xFFFF));
}

TEST_CASE("configured loader: NaN validation finds the NaN the checkpoint holds") {
  auto store = std::make_shared<memory_store>();
  const memory_directory dir = make_checkpoint(store);
  single_process c;
  std::vector<float> n(2, 0.f);
  const flat_view nv{"n", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(n.data()), 8};
  load(make_configured_loader(dir, c), std::span<const flat_view>(&nv, 1));  // loads as it is
  CHECK(n[0] == 1.f);
  CHECK(std::isnan(n[1]));
  auto checked = make_configured_loader<load_policy{.validate_nan = true}>(dir, c);
  CHECK(checked.options().validate_nan);
  testing::expect_error([&] { load(checked, std::span<const flat_view>(&nv, 1)); }, errc::missing_coverage,
                        {"tensor 'n'", "NaN after loading at local element 1"});
  std::vector<float> w(12);
  const flat_view wv{"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 48};
  load(checked, std::span<const flat_view>(&wv, 1));
  CHECK(w[5] == 5.f);
}

TEST_CASE("configured loader: every setting the policy does not fix reaches the load") {
  // (the loader kept threads and reads alone before, and dropped verify_checksums and
  // list_unexpected silently)
  auto store = std::make_shared<memory_store>();
  const memory_directory dir = make_checkpoint(store);
  single_process c;
  std::vector<float> w(12, -1.f);
  const flat_view wv{"w", dtype::F32, {4, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 48};
  configured_load_settings set;
  set.threads = 3;
  set.reads.max_gap_bytes = 7;
  set.verify_checksums = true;
  set.list_unexpected = false;
  auto l = make_configured_loader(dir, c, set);
  CHECK(l.options().threads == 3);
  CHECK(l.options().reads.max_gap_bytes == 7u);
  CHECK(l.options().verify_checksums);
  CHECK_FALSE(l.options().list_unexpected);
  CHECK(l.options().strict);  // the policy's
  const load_stats st = load(l, std::span<const flat_view>(&wv, 1));
  CHECK(st.checksum_blocks > 0);      // checked
  CHECK(st.unexpected_keys.empty());  // not listed
  for (int i = 0; i < 12; ++i) CHECK(w[i] == static_cast<float>(i));
  const load_stats plain = load(make_configured_loader(dir, c), std::span<const flat_view>(&wv, 1));
  CHECK(plain.checksum_blocks == 0);
  CHECK_FALSE(plain.unexpected_keys.empty());  // h and n
  // a damaged byte of w is caught by the checked loader alone
  for (auto& [name, bytes] : store->objects)
    if (name.ends_with("rank_0.safetensors")) {
      const safetensors_header h = read_safetensors_header(memory_storage(bytes, name));
      byte_buffer damaged = *bytes;
      for (const auto& e : h.tensors)
        if (e.name == "w") damaged[h.offset_of(e) + 5] ^= std::byte{0x01};
      bytes = std::make_shared<const byte_buffer>(std::move(damaged));
    }
  load(make_configured_loader(dir, c), std::span<const flat_view>(&wv, 1));
  auto checked = make_configured_loader(dir, c, set);  // (l keeps the bytes it opened)
  testing::expect_error([&] { load(checked, std::span<const flat_view>(&wv, 1)); }, errc::checksum_mismatch,
                        {"rank_0.safetensors"});
}
