// tests/checkpoint/test_staging.cpp - what a GPU's tensors go through, tested without a GPU: loads through
// the staging ring (checkpoint/staged_load.hpp) with the stand-in copy engine (whole, resharded
// and converted tensors against bytes the fixtures laid out by hand; the ring's depth and host
// memory counted; refusals before any copy), and saves of views without memory whose bytes are
// fetched while the file is written (save_options::fetch), against the same save from memory.
#include "shardsafe/checkpoint/staged_load.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"

using namespace shardsafe;

namespace {

/// A destination buffer and its staged view.
struct staged_dest {
  std::vector<std::byte> bytes;
  staged_view<std::byte*> sv;
  staged_dest(std::string key, dtype t, shape_t full, std::optional<shard_spec> spec) {
    sv.view.key = std::move(key);
    sv.view.type = t;
    sv.view.full_shape = std::move(full);
    sv.view.spec = std::move(spec);
    sv.view.nbytes = sv.view.local_numel() * item_size(t);
    bytes.assign(static_cast<std::size_t>(sv.view.nbytes), std::byte{0xEE});
    sv.target = bytes.data();
  }
  std::string str() const { return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()); }
};

std::vector<staged_view<std::byte*>> staged_views_of(std::vector<staged_dest>& ds) {
  std::vector<staged_view<std::byte*>> v;
  for (auto& d : ds) v.push_back(d.sv);
  return v;
}

/// The fixtures' two-rank sharded checkpoint, in memory.
struct staged_sample {
  fixtures::sharded_sample s;
  memory_directory dir;
  staged_sample() { s.write(dir); }
};

device_load_options ring_options(std::size_t slots, std::uint64_t slot_bytes) {
  device_load_options o;
  o.staging.slots = slots;
  o.staging.slot_bytes = slot_bytes;
  o.threads = 2;
  return o;
}

}  // namespace

TEST_CASE("staged load: whole tensors through a two-slot ring of 16 bytes equal the files' bytes") {
  const staged_sample cs;
  const fixtures::sharded_sample& s = cs.s;
  checkpoint_reader<memory_directory> reader(cs.dir);
  std::vector<staged_dest> ds;
  ds.emplace_back("w", dtype::F32, shape_t{4, 3}, std::nullopt);
  ds.emplace_back("b", dtype::I16, shape_t{5}, std::nullopt);
  ds.emplace_back("c", dtype::U8, shape_t{2, 2, 4}, std::nullopt);
  host_copy_engine engine;
  const auto views = staged_views_of(ds);
  const staged_load_stats st =
      load(reader, std::span<const staged_view<std::byte*>>(views), engine, ring_options(2, 16));
  CHECK(ds[0].str() == s.w.bytes);
  CHECK(ds[1].str() == s.b.bytes);
  CHECK(ds[2].str() == s.c.bytes);
  CHECK(st.tensors == 3);
  CHECK(st.host_bytes == 32);  // the ring, not the 74 bytes loaded
  CHECK(engine.allocated() == 32);
  CHECK(engine.max_outstanding() == 2);  // both slots in flight at once: the ring pipelines
  CHECK(engine.bytes() == 48 + 10 + 16);
  CHECK(engine.pending() == 0);
  // 48 + 10 + 16 bytes in 16-byte slots, pieces aligned to 16: w 3 slots, b 1, c 1
  CHECK(st.fills == 5);
  CHECK(st.unexpected_keys.empty());
}

TEST_CASE("staged load: resharded blocks, flat ranges and columns, cut across slots") {
  const staged_sample cs;
  const fixtures::sharded_sample& s = cs.s;
  checkpoint_reader<memory_directory> reader(cs.dir);
  std::vector<staged_dest> ds;
  // w F32 [4,3]: rows 1..3 (spans both files' row blocks)
  ds.emplace_back("w", dtype::F32, shape_t{4, 3}, block_spec({2, 3}, {1, 0}));
  // b I16 [5]: elements [1, 4) (both files' flat ranges)
  ds.emplace_back("b", dtype::I16, shape_t{5}, flat_spec{{1, 4}});
  // c U8 [2,2,4]: columns 1..3 of every row (both files' column blocks)
  ds.emplace_back("c", dtype::U8, shape_t{2, 2, 4}, block_spec({2, 2, 3}, {0, 0, 1}));
  for (const std::uint64_t slot : {16u, 32u, 4096u}) {
    for (auto& d : ds) std::fill(d.bytes.begin(), d.bytes.end(), std::byte{0xEE});
    host_copy_engine engine;
    const auto views = staged_views_of(ds);
    load(reader, std::span<const staged_view<std::byte*>>(views), engine, ring_options(3, slot));
    CHECK(ds[0].str() == s.w.bytes.substr(12, 24));
    CHECK(ds[1].str() == s.b.bytes.substr(2, 6));
    std::string cols;
    for (std::size_t ij = 0; ij < 4; ++ij) cols += s.c.bytes.substr(ij * 4 + 1, 3);
    CHECK(ds[2].str() == cols);
    CHECK(engine.allocated() <= 3 * slot);
  }
}

TEST_CASE("staged load: a tensor many slots long, converted BF16 -> F32 on the host") {
  // 1000 BF16 values stored; loaded as F32 through 4 slots of 256 bytes (64 elements each)
  std::mt19937_64 rng(7);
  std::string bf16 = fixtures::random_string(2000, rng);
  for (std::size_t i = 0; i < 1000; ++i) bf16[2 * i + 1] = static_cast<char>(bf16[2 * i + 1] & 0x3F);  // finite
  memory_directory dir;
  fixtures::put(dir, "model.safetensors", fixtures::build_file({{"x", "BF16", {10, 100}, bf16}}));
  checkpoint_reader<memory_directory> reader(dir);
  std::vector<staged_dest> ds;
  ds.emplace_back("x", dtype::F32, shape_t{10, 100}, std::nullopt);
  host_copy_engine engine;
  device_load_options o = ring_options(4, 256);
  o.convert_dtypes = true;
  const auto views = staged_views_of(ds);
  const staged_load_stats st = load(reader, std::span<const staged_view<std::byte*>>(views), engine, o);
  // BF16 -> F32 is exact: the 16 bits become the high half of the F32
  std::string want;
  for (std::size_t i = 0; i < 1000; ++i) {
    want += '\0';
    want += '\0';
    want += bf16.substr(2 * i, 2);
  }
  CHECK(ds[0].str() == want);
  CHECK(st.fills == (4000 + 255) / 256);
  CHECK(st.host_bytes == 4 * 256);
  CHECK(engine.max_outstanding() == 4);
  CHECK(st.bytes_needed == 2000);  // counted as stored
}

TEST_CASE("staged load: a missing key is refused before anything is read or copied; listed when not strict") {
  const staged_sample cs;
  const fixtures::sharded_sample& s = cs.s;
  checkpoint_reader<memory_directory> reader(cs.dir);
  std::vector<staged_dest> ds;
  ds.emplace_back("w", dtype::F32, shape_t{4, 3}, std::nullopt);
  ds.emplace_back("nope", dtype::F32, shape_t{2}, std::nullopt);
  const auto views = staged_views_of(ds);
  {
    host_copy_engine engine;
    CHECK_THROWS_WITH_AS(load(reader, std::span<const staged_view<std::byte*>>(views), engine, ring_options(2, 64)),
                         doctest::Contains("tensor 'nope': not in the checkpoint"), error);
    CHECK(engine.copies() == 0);
    CHECK(engine.allocated() == 0);
  }
  {
    host_copy_engine engine;
    device_load_options o = ring_options(2, 64);
    o.strict = false;
    const staged_load_stats st = load(reader, std::span<const staged_view<std::byte*>>(views), engine, o);
    CHECK(st.missing_keys == std::vector<std::string>{"nope"});
    CHECK(st.unexpected_keys == std::vector<std::string>{"b", "c"});
    CHECK(ds[0].str() == s.w.bytes);
    CHECK(ds[1].str() == std::string(8, '\xEE'));
  }
  {  // a wrong shape, also before any copy
    std::vector<staged_dest> bad;
    bad.emplace_back("b", dtype::I16, shape_t{5}, std::nullopt);
    bad.emplace_back("w", dtype::F32, shape_t{3, 4}, std::nullopt);
    const auto bv = staged_views_of(bad);
    host_copy_engine engine;
    CHECK_THROWS_WITH_AS(load(reader, std::span<const staged_view<std::byte*>>(bv), engine, ring_options(2, 64)),
                         doctest::Contains("tensor 'w': checkpoint has shape [4,3]"), error);
    CHECK(engine.copies() == 0);
  }
}

TEST_CASE("staged load: a load that fails midway leaves no copy pending, and what came before landed") {
  // validate_nan: an element still NaN after its read fails the load. z's last element is a
  // NaN in the file, so the fourth fill (z[4..8)) fails after three were handed to the engine.
  const std::string one("\x00\x00\x80\x3f", 4), nan("\x00\x00\xc0\x7f", 4);
  std::string a, z;
  for (int i = 0; i < 8; ++i) a += one;
  for (int i = 0; i < 7; ++i) z += one;
  z += nan;
  memory_directory dir;
  fixtures::put(dir, "model.safetensors", fixtures::build_file({{"a", "F32", {8}, a}, {"z", "F32", {8}, z}}));
  checkpoint_reader<memory_directory> reader(dir);
  std::vector<staged_dest> ds;
  ds.emplace_back("a", dtype::F32, shape_t{8}, std::nullopt);
  ds.emplace_back("z", dtype::F32, shape_t{8}, std::nullopt);
  const auto views = staged_views_of(ds);
  host_copy_engine engine;
  device_load_options o = ring_options(2, 16);
  o.validate_nan = true;
  CHECK_THROWS_WITH_AS(load(reader, std::span<const staged_view<std::byte*>>(views), engine, o),
                       doctest::Contains("'z'"), error);
  CHECK(engine.copies() == 3);
  CHECK(engine.pending() == 0);  // synchronized before the ring was freed
  CHECK(ds[0].str() == a);
  CHECK(ds[1].str().substr(0, 16) == z.substr(0, 16));
}

namespace {

/// What the files of a hinted_directory saw: the threads that read them and the reads.
struct read_log {
  std::mutex m;
  std::set<std::thread::id> threads;
  int reads = 0;
};

/// A file in memory that gives a read hint, as an HTTP or S3 storage does, and logs its reads.
struct hinted_storage {
  memory_storage inner;
  read_settings hint;
  std::shared_ptr<read_log> log;
  std::uint64_t size() const { return inner.size(); }
  std::string_view name() const { return inner.name(); }
  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    {
      std::lock_guard lock(log->m);
      log->threads.insert(std::this_thread::get_id());
      ++log->reads;
    }
    inner.read_into(off, dst);
  }
  read_settings read_defaults() const { return hint; }
};

struct hinted_directory {
  using reader_type = hinted_storage;
  memory_directory inner;
  read_settings hint;
  std::shared_ptr<read_log> log = std::make_shared<read_log>();
  reader_type open(std::string_view n) const { return {inner.open(n), hint, log}; }
  bool exists(std::string_view n) const { return inner.exists(n); }
  std::vector<std::string> list() const { return inner.list(); }
  hinted_directory sub(std::string_view n) const { return {inner.sub(n), hint, log}; }
  std::string_view name() const { return inner.name(); }
};
static_assert(ReadableDirectory<hinted_directory> && HintedStorage<hinted_storage>);

}  // namespace

TEST_CASE(
    "staged load: threads = 0 takes the storage's hint (reads in flight, largest read), else the staged default") {
  // 64 KiB in one tensor, through 2 slots of 16 KiB, load_options::threads left at 0
  memory_directory dir;
  std::mt19937_64 rng(5);
  std::string x = fixtures::random_string(65536, rng);
  flat_view v{"x", dtype::U8, shape_t{65536}, std::nullopt, reinterpret_cast<std::byte*>(x.data()), x.size()};
  single_process comm;
  save(dir, std::span<const flat_view>(&v, 1), comm);
  device_load_options o;
  o.staging.slots = 2;
  o.staging.slot_bytes = 16384;
  REQUIRE(o.threads == 0);
  for (const bool hinted : {true, false}) {
    CAPTURE(hinted);
    hinted_directory hd{dir, hinted ? read_settings{.max_gap_bytes = std::nullopt,
                                                    .max_read_bytes = std::uint64_t(1024),
                                                    .requests_in_flight = 1u}
                                    : read_settings{}};
    checkpoint_reader<hinted_directory> reader(hd);
    std::vector<staged_dest> ds;
    ds.emplace_back("x", dtype::U8, shape_t{65536}, std::nullopt);
    const auto views = staged_views_of(ds);
    host_copy_engine engine;
    const staged_load_stats st = load(reader, std::span<const staged_view<std::byte*>>(views), engine, o);
    CHECK(ds[0].str() == x);
    CHECK(st.fills == 4);
    if (hinted) {
      CHECK(st.read_ops == 64);            // the hint's largest read, 1 KiB (was: the ring's own, 1 MiB at least)
      CHECK(hd.log->reads >= 64);          // and the files' headers
      CHECK(hd.log->threads.size() == 1);  // the hint's one request in flight: the caller's thread alone
    } else {
      CHECK(st.read_ops == 4);  // a read per slot: max(1 MiB, slot / threads)
    }
  }
}

TEST_CASE("staged load: a ring of no slots is refused") {
  const staged_sample cs;
  checkpoint_reader<memory_directory> reader(cs.dir);
  std::vector<staged_dest> ds;
  ds.emplace_back("w", dtype::F32, shape_t{4, 3}, std::nullopt);
  const auto views = staged_views_of(ds);
  host_copy_engine engine;
  CHECK_THROWS_WITH_AS(load(reader, std::span<const staged_view<std::byte*>>(views), engine, ring_options(0, 64)),
                       doctest::Contains("staging ring of 0 slots"), error);
}

namespace {

/// Three tensors: x (F32 [3000], 12,000 bytes) and y (U8 [30, 301])
/// without memory (their bytes fetched), z (I16 [7]) from memory.
struct fetch_sample {
  std::string x, y, z;
  fetch_sample() {
    std::mt19937_64 rng(11);
    x = fixtures::random_string(12000, rng);
    y = fixtures::random_string(30 * 301, rng);
    z = fixtures::random_string(14, rng);
  }
  std::vector<flat_view> views(bool with_memory) const {
    std::vector<flat_view> v(3);
    v[0].key = "x";
    v[0].type = dtype::F32;
    v[0].full_shape = {3000};
    v[0].nbytes = x.size();
    v[1].key = "y";
    v[1].type = dtype::U8;
    v[1].full_shape = {30, 301};
    v[1].nbytes = y.size();
    v[2].key = "z";
    v[2].type = dtype::I16;
    v[2].full_shape = {7};
    v[2].nbytes = z.size();
    v[2].data = const_cast<std::byte*>(reinterpret_cast<const std::byte*>(z.data()));
    if (with_memory) {
      v[0].data = const_cast<std::byte*>(reinterpret_cast<const std::byte*>(x.data()));
      v[1].data = const_cast<std::byte*>(reinterpret_cast<const std::byte*>(y.data()));
    }
    return v;
  }
};

std::string read_object(const memory_directory& d, const std::string& n) {
  auto s = d.open(n);
  std::string out(static_cast<std::size_t>(s.size()), '\0');
  s.read_into(0, std::as_writable_bytes(std::span(out.data(), out.size())));
  return out;
}

template <WritableDirectory D>
void check_fetched_save(const D& with_memory, const D& fetched,
                        const std::function<std::string(const D&, const std::string&)>& read) {
  fetch_sample s;
  single_process comm;
  save_options o;
  o.write_chunk_bytes = 5000;     // writer blocks (or parts) of 5000 bytes (8192 for aligned blocks)
  o.checksum_block_bytes = 3000;  // checksum blocks that straddle them
  o.direct_io = false;
  const auto mv = s.views(true);
  save(with_memory, std::span<const flat_view>(mv), comm, o);
  std::atomic<std::uint64_t> calls{0}, bytes{0};
  o.fetch = [&](const flat_view& v, std::uint64_t off, std::span<std::byte> dst) {
    REQUIRE((v.key == "x" || v.key == "y"));
    const std::string& src = v.key == "x" ? s.x : s.y;
    REQUIRE(off + dst.size() <= src.size());
    std::memcpy(dst.data(), src.data() + off, dst.size());
    ++calls;
    bytes += dst.size();
  };
  const auto fv = s.views(false);
  save(fetched, std::span<const flat_view>(fv), comm, o);
  CHECK(calls > 3);                         // fetched in pieces, not whole
  CHECK(bytes >= s.x.size() + s.y.size());  // every byte at least once (straddling blocks again)
  // the same files, byte for byte, as the save from memory: data and checksum table
  CHECK(read(fetched, "rank_0.safetensors") == read(with_memory, "rank_0.safetensors"));
  CHECK(read(fetched, "metadata.json") == read(with_memory, "metadata.json"));
  // and what loads back (checksums checked) is the bytes given
  checkpoint_reader<D> reader(fetched);
  std::string x(s.x.size(), '\0'), y(s.y.size(), '\0');
  std::vector<flat_view> back = s.views(false);
  back[0].data = reinterpret_cast<std::byte*>(x.data());
  back[1].data = reinterpret_cast<std::byte*>(y.data());
  back.pop_back();
  load_options lo;
  lo.verify_checksums = true;
  const load_stats st = load(reader, std::span<const flat_view>(back), lo);
  CHECK(st.checksum_blocks > 0);
  CHECK(x == s.x);
  CHECK(y == s.y);
}

}  // namespace

TEST_CASE("fetched save: views without memory, written in aligned blocks, equal the save from memory") {
  testing::temp_dir tmp("fetch");
  check_fetched_save<file_directory>(file_directory(tmp.path / "a"), file_directory(tmp.path / "b"),
                                     [](const file_directory& d, const std::string& n) {
                                       return testing::slurp(std::filesystem::path(std::string(d.name())) / n);
                                     });
}

TEST_CASE("fetched save: views without memory, written in parts, equal the save from memory") {
  auto store = std::make_shared<memory_store>();
  check_fetched_save<memory_directory>(memory_directory(store, "mem:a"), memory_directory(store, "mem:b"), read_object);
}

TEST_CASE("fetched save: a view without memory and no fetch is refused before anything is written") {
  fetch_sample s;
  memory_directory dir;
  single_process comm;
  const auto fv = s.views(false);
  CHECK_THROWS_WITH_AS(save(dir, std::span<const flat_view>(fv), comm),
                       doctest::Contains("tensor 'x': no memory given"), error);
  CHECK_FALSE(dir.exists("rank_0.safetensors"));
  // a shard whose bytes pass 2^64 (2^62 F32 elements) is refused as such, not as 0 bytes of memory
  const std::vector<flat_view> huge{{"h", dtype::F32, {std::uint64_t(1) << 62}, std::nullopt, nullptr, 0}};
  testing::expect_error([&] { save(dir, std::span<const flat_view>(huge), comm); }, errc::invalid_shape,
                        {"tensor 'h'", "4611686018427387904 F32 elements have more than 2^64 bytes"});
  CHECK_FALSE(dir.exists("rank_0.safetensors"));
}
