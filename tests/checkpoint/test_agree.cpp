// Errors keep their codes across ranks: errc against operating-system codes, the steps of
// dist/agree.hpp in a world of threads, and each torch-free call site (save_flat_views' four
// steps, rotate_checkpoints) throwing the failing rank's own code on every rank.
#include "shardsafe/dist/agree.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <future>
#include <memory>
#include <stdexcept>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;

namespace {

/// What rank r threw: its code and message (the code is empty if it threw nothing).
struct thrown_error {
  std::error_code code;
  std::string what;
};

std::vector<thrown_error> errors_of(const std::vector<std::exception_ptr>& thrown) {
  std::vector<thrown_error> out;
  for (const auto& p : thrown) {
    thrown_error t;
    if (p) {
      try {
        std::rethrow_exception(p);
      } catch (const shardsafe::error& e) {
        t = {e.code(), e.what()};
      } catch (const std::exception& e) {
        t = {std::error_code(-1, std::generic_category()), std::string("not a shardsafe::error: ") + e.what()};
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

/// Every rank threw exactly `want` (category and value), with a message starting "rank R: ".
void check_all_threw(const std::vector<thrown_error>& got, std::error_code want, int failing_rank) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    CAPTURE(got[r].what);
    CHECK(got[r].code.category() == want.category());
    CHECK(got[r].code.value() == want.value());
    CHECK(got[r].what.rfind("rank " + std::to_string(failing_rank) + ": ", 0) == 0);
  }
}

/// A memory_directory whose create, remove or make fail, with an errno code, for chosen names.
class failing_directory {
 public:
  using reader_type = memory_storage;
  using writer_type = memory_writer;

  struct faults {
    std::string create;  ///< create(n) of this name throws
    std::string remove;  ///< remove(n) of this name throws
    bool make = false;   ///< make() throws
    int err = EIO;       ///< the errno value thrown
  };

  failing_directory(memory_directory inner, std::shared_ptr<const faults> f) : inner_(std::move(inner)), f_(std::move(f)) {}

  std::string_view name() const noexcept { return inner_.name(); }
  reader_type open(std::string_view n) const { return inner_.open(n); }
  bool exists(std::string_view n) const { return inner_.exists(n); }
  std::vector<std::string> list() const { return inner_.list(); }
  failing_directory sub(std::string_view n) const { return {inner_.sub(n), f_}; }
  writer_type create(std::string_view n) const {
    if (n == f_->create) fail_errno(f_->err, std::string(name()) + "/" + std::string(n) + ": create");
    return inner_.create(n);
  }
  void remove(std::string_view n) const {
    if (n == f_->remove) fail_errno(f_->err, std::string(name()) + "/" + std::string(n) + ": remove");
    inner_.remove(n);
  }
  void make() const {
    if (f_->make) fail_errno(f_->err, std::string(name()) + ": make");
    inner_.make();
  }

 private:
  memory_directory inner_;
  std::shared_ptr<const faults> f_;
};
static_assert(WritableDirectory<failing_directory>);

/// Rank r's part of a [6, 4] F32 tensor "w" (rows split between ranks) and a replicated "b".
struct rank_state {
  std::vector<float> w, b;
  std::vector<flat_view> views;
  rank_state(int rank, int world) {
    const std::uint64_t rows = 6 / static_cast<std::uint64_t>(world), first = rows * static_cast<std::uint64_t>(rank);
    for (std::uint64_t i = 0; i < rows * 4; ++i) w.push_back(static_cast<float>(first * 4 + i));
    b = {1.5f, -2.5f, 3.5f};
    views.push_back({"w", dtype::F32, {6, 4}, block_spec({rows, 4}, {first, 0}), reinterpret_cast<std::byte*>(w.data()),
                     w.size() * sizeof(float)});
    views.push_back({"b", dtype::F32, {3}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), b.size() * sizeof(float)});
  }
};

}  // namespace

TEST_CASE("errc: io_error holds for shardsafe's own io_error and for every errno code") {
  CHECK(std::error_code(EIO, std::generic_category()) == errc::io_error);
  CHECK(std::error_code(ENOTDIR, std::generic_category()) == errc::io_error);
  CHECK(std::error_code(EACCES, std::system_category()) == errc::io_error);
  CHECK(make_error_code(errc::io_error) == errc::io_error);
  // and only those
  CHECK_FALSE(std::error_code() == errc::io_error);
  CHECK_FALSE(make_error_code(errc::not_found) == errc::io_error);
  CHECK_FALSE(std::error_code(EIO, std::generic_category()) == errc::not_found);
  CHECK(static_cast<int>(std::future_errc::future_already_retrieved) == static_cast<int>(errc::io_error));
  CHECK_FALSE(std::make_error_code(std::future_errc::future_already_retrieved) == errc::io_error);
  // every other errc is itself and nothing else
  CHECK(make_error_code(errc::shape_mismatch) == errc::shape_mismatch);
  CHECK_FALSE(make_error_code(errc::shape_mismatch) == errc::dtype_mismatch);
  CHECK(make_error_code(errc::foreign_exception) == errc::foreign_exception);
  CHECK(std::string(make_error_code(errc::foreign_exception).message()) != "unknown shardsafe error");

  SUBCASE("fail_errno: io_error and the std::errc of its errno") {
    try {
      fail_errno(EACCES, "f");
      FAIL("fail_errno returned");
    } catch (const shardsafe::error& e) {
      CHECK(e.code() == errc::io_error);
      CHECK(e.code() == std::errc::permission_denied);
      CHECK(std::string(e.what()) == std::string("f: ") + std::strerror(EACCES));
    }
  }
  SUBCASE("a real failed mkdir") {
    testing::temp_dir tmp("errc");
    testing::write_file(tmp.path / "plain", "x");
    try {
      file_directory(tmp.path / "plain" / "sub").make();
      FAIL("make() under a regular file succeeded");
    } catch (const shardsafe::error& e) {
      CHECK(e.code() == errc::io_error);
      CHECK(e.code() == std::errc::not_a_directory);
      CHECK_FALSE(e.code() == errc::already_exists);
    }
  }
}

TEST_CASE("step_outcome: category, value and message survive encoding") {
  const std::string msg = "ckpt/rank_1.safetensors: line one\nline two";  // what() is a C string: no NUL
  for (const auto& code : {make_error_code(errc::unsupported_dtype), std::error_code(ENOSPC, std::generic_category()),
                           std::error_code(EPERM, std::system_category())}) {
    CAPTURE(code.message());
    auto o = step_outcome::of_exception(std::make_exception_ptr(shardsafe::error(code, msg)));
    const auto back = step_outcome::decode(o.encode(), "rank 3");
    CHECK(back.failed);
    CHECK(back.code() == code);
    CHECK(back.code().category() == code.category());
    CHECK(back.text == msg);
  }
  SUBCASE("success carries its result, bytes and all") {
    step_outcome ok;
    ok.text = std::string("a\nNUL \0 inside", 14);
    const auto back = step_outcome::decode(ok.encode(), "rank 0");
    CHECK_FALSE(back.failed);
    CHECK(back.text == ok.text);
  }
  SUBCASE("what is not a shardsafe code becomes foreign_exception, what() kept") {
    auto a = step_outcome::of_exception(std::make_exception_ptr(std::runtime_error("boom")));
    CHECK(a.code() == errc::foreign_exception);
    CHECK(a.text == "boom");
    auto b = step_outcome::of_exception(
        std::make_exception_ptr(std::system_error(std::make_error_code(std::future_errc::broken_promise), "p")));
    CHECK(b.code() == errc::foreign_exception);
    CHECK(b.text.find("future error " + std::to_string(static_cast<int>(std::future_errc::broken_promise))) !=
          std::string::npos);
    auto c = step_outcome::of_exception(std::make_exception_ptr(42));
    CHECK(c.code() == errc::foreign_exception);
    CHECK(c.text.find("not a std::exception") != std::string::npos);
  }
  SUBCASE("malformed bytes are a comm_error naming the sender") {
    for (std::string bad : {std::string(), std::string("x"), std::string("eshardsafe\n12"),
                            std::string("enonsense\n1\nmsg"), std::string("egeneric\n1x\nmsg")}) {
      CAPTURE(bad);
      try {
        step_outcome::decode(bad, "rank 7");
        FAIL("decoded");
      } catch (const shardsafe::error& e) {
        CHECK(e.code() == errc::comm_error);
        CHECK(std::string(e.what()).find("rank 7") != std::string::npos);
      }
    }
  }
}

TEST_CASE("every_rank_step: results by rank, or the lowest failing rank's own error everywhere") {
  constexpr int n = 4;
  SUBCASE("all succeed") {
    std::vector<std::vector<std::string>> got(n);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      got[c.rank()] = every_rank_step(c, [&] { return "from " + std::to_string(c.rank()); });
      every_rank_step(c, [] {});
    });
    for (int r = 0; r < n; ++r) {
      CHECK_FALSE(thrown[r]);
      CHECK((got[r] == std::vector<std::string>{"from 0", "from 1", "from 2", "from 3"}));
    }
  }
  SUBCASE("one rank fails: its errc on every rank") {
    std::atomic<int> went_on{0};
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      every_rank_step(c, [&] {
        if (c.rank() == 2) fail(errc::unsupported_dtype, "ckpt: tensor 'w': dtype F4");
      });
      ++went_on;  // not reached by anyone
    });
    CHECK(went_on == 0);
    auto e = errors_of(thrown);
    check_all_threw(e, make_error_code(errc::unsupported_dtype), 2);
    for (const auto& t : e) CHECK(t.what == "rank 2: ckpt: tensor 'w': dtype F4");
  }
  SUBCASE("several ranks fail: the lowest one, and how many more") {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      every_rank_step(c, [&] {
        if (c.rank() == 3) fail(errc::shape_mismatch, "three");
        if (c.rank() == 1) fail_errno(EACCES, "one");
      });
    });
    auto e = errors_of(thrown);
    check_all_threw(e, std::error_code(EACCES, std::generic_category()), 1);
    for (const auto& t : e) {
      CHECK(t.code == std::errc::permission_denied);
      CHECK(t.what.find("(and 1 more rank(s) failed)") != std::string::npos);
    }
  }
  SUBCASE("a foreign exception becomes foreign_exception with its what()") {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      every_rank_step(c, [&] {
        if (c.rank() == 0) throw std::out_of_range("index 9 of 3");
      });
    });
    auto e = errors_of(thrown);
    check_all_threw(e, make_error_code(errc::foreign_exception), 0);
    for (const auto& t : e) CHECK(t.what == "rank 0: index 9 of 3");
  }
}

TEST_CASE("rank0_step: only rank 0 runs; its result or its error on every rank") {
  constexpr int n = 3;
  std::atomic<int> runs{0};
  SUBCASE("result") {
    std::vector<std::string> got(n);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      got[c.rank()] = rank0_step(c, [&] {
        ++runs;
        return std::string("list\0of names", 13);
      });
    });
    CHECK(runs == 1);
    for (int r = 0; r < n; ++r) {
      CHECK_FALSE(thrown[r]);
      CHECK(got[r] == std::string("list\0of names", 13));
    }
  }
  SUBCASE("error") {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank0_step(c, [&] {
        ++runs;
        fail_errno(ENOSPC, "ckpt/metadata.json: write");
      });
    });
    CHECK(runs == 1);
    check_all_threw(errors_of(thrown), std::error_code(ENOSPC, std::generic_category()), 0);
  }
}

TEST_CASE("save_flat_views in a world of threads: saves, and each step's failure keeps its code") {
  constexpr int n = 3;
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:ckpt");

  SUBCASE("a save that works loads back, with every rank's file size in metadata.json") {
    std::vector<save_stats> stats(n);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      stats[c.rank()] = save_flat_views(mem, std::span<const flat_view>(s.views), c);
    });
    std::uint64_t total = 0;
    for (int r = 0; r < n; ++r) {
      CHECK_FALSE(thrown[r]);
      const auto f = mem.open(rank_file_name(r));
      CHECK(stats[r].bytes_written == f.size());
      CHECK(stats[r].tensors_written == (r == 0 ? 2u : 1u));  // b is written by rank 0 only
      total += f.size();
    }
    for (int r = 0; r < n; ++r) CHECK(stats[r].total_bytes == total);
    auto md_file = mem.open(metadata_file_name);
    const auto md = read_checkpoint_metadata(md_file);
    CHECK(md.extras.world_size == 3u);
    for (int r = 0; r < n; ++r) CHECK(md.extras.file_sizes.at(rank_file_name(r)) == stats[r].bytes_written);
    std::vector<float> w(24), b(3);
    std::vector<flat_view> into{{"w", dtype::F32, {6, 4}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 96},
                                {"b", dtype::F32, {3}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), 12}};
    load_flat_views(mem, std::span<const flat_view>(into));
    for (int i = 0; i < 24; ++i) CHECK(w[i] == static_cast<float>(i));
    CHECK((b == std::vector<float>{1.5f, -2.5f, 3.5f}));
  }
  SUBCASE("1. describe: unsupported_dtype on one rank stays unsupported_dtype") {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      if (c.rank() == 1) s.views[1].type = dtype::F4;  // 4-bit elements: no element ranges
      save_flat_views(mem, std::span<const flat_view>(s.views), c);
    });
    auto e = errors_of(thrown);
    check_all_threw(e, make_error_code(errc::unsupported_dtype), 1);
    for (const auto& t : e) CHECK(t.what.find("'b'") != std::string::npos);
    CHECK(mem.list().empty());
  }
  SUBCASE("1. describe: a bad spec is invalid_spec, not invalid_argument") {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      if (c.rank() == 2) s.views[0].spec = block_spec({2, 4}, {5, 0});  // rows 5-6 of 6
      save_flat_views(mem, std::span<const flat_view>(s.views), c);
    });
    check_all_threw(errors_of(thrown), make_error_code(errc::invalid_spec), 2);
  }
  SUBCASE("2. prepare: a failed mkdir keeps its errno, not already_exists") {
    testing::temp_dir tmp("agree");
    testing::write_file(tmp.path / "plain", "x");
    const file_directory dir(tmp.path / "plain" / "ckpt");
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      save_flat_views(dir, std::span<const flat_view>(s.views), c);
    });
    auto e = errors_of(thrown);
    for (const auto& t : e) {
      CAPTURE(t.what);
      CHECK(t.code == std::errc::not_a_directory);
      CHECK(t.code == errc::io_error);
      CHECK_FALSE(t.code == errc::already_exists);
      CHECK(t.code == e[0].code);
      CHECK(t.what.rfind("rank 0: ", 0) == 0);
    }
  }
  SUBCASE("2. prepare: a non-empty directory is already_exists") {
    mem.create("old").commit();
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      save_flat_views(mem, std::span<const flat_view>(s.views), c);
    });
    check_all_threw(errors_of(thrown), make_error_code(errc::already_exists), 0);
  }
  SUBCASE("3. write: one rank's failed create keeps its errno; no commit mark") {
    auto f = std::make_shared<failing_directory::faults>();
    f->create = rank_file_name(2);
    f->err = EDQUOT;
    const failing_directory dir(mem, f);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      save_flat_views(dir, std::span<const flat_view>(s.views), c);
    });
    check_all_threw(errors_of(thrown), std::error_code(EDQUOT, std::generic_category()), 2);
    CHECK_FALSE(mem.exists(metadata_file_name));
  }
  SUBCASE("4. commit: a failed metadata.json keeps its errno") {
    auto f = std::make_shared<failing_directory::faults>();
    f->create = std::string(metadata_file_name);
    f->err = ENOSPC;
    const failing_directory dir(mem, f);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      save_flat_views(dir, std::span<const flat_view>(s.views), c);
    });
    check_all_threw(errors_of(thrown), std::error_code(ENOSPC, std::generic_category()), 0);
    CHECK(mem.exists(rank_file_name(2)));
    CHECK_FALSE(mem.exists(metadata_file_name));
  }
}

TEST_CASE("rotate_checkpoints in a world of threads: one list everywhere, or rank 0's own error") {
  constexpr int n = 3;
  auto store = std::make_shared<memory_store>();
  const memory_directory root(store, "mem:run");
  for (int step : {10, 20, 30, 40}) root.sub("step" + std::to_string(step)).create(metadata_file_name).commit();
  root.sub("step15").create(rank_file_name(0)).commit();  // an unfinished save, older than step40
  root.sub("step50").create(rank_file_name(0)).commit();  // one under way: kept

  SUBCASE("the removed list, newest first, on every rank") {
    std::vector<std::vector<std::string>> got(n);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) { got[c.rank()] = rotate_checkpoints(root, 2, c); });
    for (int r = 0; r < n; ++r) {
      CHECK_FALSE(thrown[r]);
      CHECK((got[r] == std::vector<std::string>{"step20", "step15", "step10"}));
    }
    CHECK((root.list() == std::vector<std::string>{"step30", "step40", "step50"}));
  }
  SUBCASE("a failed removal keeps its errno on every rank") {
    auto f = std::make_shared<failing_directory::faults>();
    f->remove = std::string(metadata_file_name);
    f->err = EBUSY;
    const failing_directory dir(root, f);
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) { rotate_checkpoints(dir, 2, c); });
    auto e = errors_of(thrown);
    check_all_threw(e, std::error_code(EBUSY, std::generic_category()), 0);
    for (const auto& t : e) CHECK(t.what.find("step20") != std::string::npos);
  }
}

namespace {

/// A world of one whose n-th exchange fails as a c10d_comm fails when a rank is lost.
struct losing_comm {
  int fail_at;
  int calls = 0;
  int rank() const noexcept { return 0; }
  int world_size() const noexcept { return 1; }
  void barrier() { lose("barrier"); }
  std::vector<std::string> all_gather_bytes(std::string_view s) {
    lose("all_gather_bytes");
    return {std::string(s)};
  }
  void broadcast_bytes(std::string&, int) { lose("broadcast_bytes"); }
  void lose(const char* what) {
    if (++calls == fail_at) fail(errc::comm_error, std::string("c10d ") + what + " on rank 0 of 1 failed: rank 7 lost");
  }
};
static_assert(Comm<losing_comm>);

/// What f throws: its message, and its code in *code.
template <class F>
std::string lost_error_of(F&& f, errc* code) {
  try {
    f();
  } catch (const shardsafe::error& e) {
    *code = static_cast<errc>(e.code().value());
    return e.what();
  }
  return "(nothing thrown)";
}

}  // namespace

TEST_CASE("a lost rank during a save: the error names the save and its step, and keeps comm_error") {
  // save_flat_views' exchanges, in order: agree on the metadata (1), prepare the folder (2),
  // write the rank files (3), commit metadata.json (4)
  const char* steps[] = {"agreeing on the metadata", "preparing the folder", "writing the rank files",
                         "committing metadata.json"};
  for (int at = 1; at <= 4; ++at) {
    CAPTURE(at);
    testing::temp_dir dir("lost");
    rank_state st(0, 1);
    losing_comm comm{at};
    errc code{};
    const std::string msg = lost_error_of(
        [&] { save_flat_views(file_directory(dir.path / "ckpt"), std::span<const flat_view>(st.views), comm); }, &code);
    CHECK(code == errc::comm_error);
    const std::string want = "save " + (dir.path / "ckpt").string() + ": " + steps[at - 1] +
                             ": c10d " + (at % 2 ? "all_gather_bytes" : "broadcast_bytes") + " on rank 0 of 1 failed: rank 7 lost";
    CHECK(msg == want);
  }
  // nested scopes join with ": ", a scope equal to the one it nests in said once; none when gone
  {
    const step_scope a("import /hf"), b("import /hf"), c("rank 0 reading and broadcasting");
    CHECK(step_scope::describe() == "import /hf: rank 0 reading and broadcasting");
  }
  CHECK(step_scope::describe().empty());
  // outside any scope the error is the Comm's own
  losing_comm comm{1};
  errc code{};
  const std::string msg = lost_error_of([&] { every_rank_step(comm, [] {}); }, &code);
  CHECK(code == errc::comm_error);
  CHECK(msg == "c10d all_gather_bytes on rank 0 of 1 failed: rank 7 lost");
}
