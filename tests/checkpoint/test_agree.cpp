// Errors keep their codes across ranks: errc against operating-system codes, the steps of
// dist/agree.hpp in a world of threads, and each torch-free call site (save_flat_views' four
// steps, rotate_checkpoints) throwing the failing rank's own code on every rank.
#include "shardsafe/dist/agree.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>

#include "shardsafe/checkpoint/description_message.hpp"
#include "shardsafe/checkpoint/hf/import.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"
#include "shardsafe/version.hpp"
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

  failing_directory(memory_directory inner, std::shared_ptr<const faults> f)
      : inner_(std::move(inner)), f_(std::move(f)) {}

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
    views.push_back({"w",
                     dtype::F32,
                     {6, 4},
                     block_spec({rows, 4}, {first, 0}),
                     reinterpret_cast<std::byte*>(w.data()),
                     w.size() * sizeof(float)});
    views.push_back(
        {"b", dtype::F32, {3}, std::nullopt, reinterpret_cast<std::byte*>(b.data()), b.size() * sizeof(float)});
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

TEST_CASE("thread_world: a rank that timed out breaks the world; no round completes with its stale slot") {
  // The timeout only makes the first rank give up; nothing here measures time.
  testing::thread_world world(3, std::chrono::milliseconds(50));
  const auto names_rank0 = [](const std::string& what) {
    return what.find(
               "rank 0 timed out waiting in a collective that rank(s) 1, 2 did not come to; the world is of no "
               "further use") != std::string::npos;
  };
  SUBCASE("ranks that come after the timeout throw, and so does the rank that timed out, again") {
    try {
      world.exchange(0, "stale from rank 0");
      FAIL("rank 0 alone completed a round");
    } catch (const shardsafe::error& e) {
      CHECK(e.code() == errc::comm_error);
      CHECK(names_rank0(e.what()));
    }
    std::vector<std::exception_ptr> thrown(3);
    std::vector<std::vector<std::string>> got(3);
    std::vector<std::thread> late;
    for (int r = 1; r < 3; ++r)
      late.emplace_back([&, r] {
        try {
          got[r] = world.exchange(r, "from " + std::to_string(r));
        } catch (...) {
          thrown[r] = std::current_exception();
        }
      });
    for (auto& t : late) t.join();
    for (int r = 1; r < 3; ++r) {
      CAPTURE(r);
      CHECK(testing::error_code_of(thrown[r]) == errc::comm_error);
      CHECK(names_rank0(testing::error_message_of(thrown[r])));
      CHECK(testing::error_message_of(thrown[r]).find("rank " + std::to_string(r) + " cannot complete") !=
            std::string::npos);
      CHECK(got[r].empty());
    }
    try {
      world.exchange(0, "rank 0 again");
      FAIL("a broken world completed a round");
    } catch (const shardsafe::error& e) {
      CHECK(e.code() == errc::comm_error);
      CHECK(names_rank0(e.what()));
    }
  }
  SUBCASE("a rank waiting when another times out throws, naming that rank") {
    std::vector<std::exception_ptr> thrown(3);
    std::vector<std::thread> two;
    for (int r = 0; r < 2; ++r)
      two.emplace_back([&, r] {
        try {
          world.exchange(r, "x");
        } catch (...) {
          thrown[r] = std::current_exception();
        }
      });
    for (auto& t : two) t.join();
    // whichever timed out first broke the world; both name it
    const std::string first = testing::error_message_of(thrown[0]);
    const int culprit = first.find("rank 1 timed out") != std::string::npos ? 1 : 0;
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CHECK(testing::error_code_of(thrown[r]) == errc::comm_error);
      CHECK(testing::error_message_of(thrown[r]).find("rank " + std::to_string(culprit) +
                                                      " timed out waiting in a collective that rank(s) 2 did not "
                                                      "come to") != std::string::npos);
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

namespace {

using testing::counting_comm;

int ceil_log2(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

}  // namespace

TEST_CASE("the binomial tree of ranks: every rank once under one parent, depth and fan-out log2 world") {
  for (int n : {1, 2, 3, 5, 8, 13, 64, 100, 1000, 4096, 16384}) {
    CAPTURE(n);
    std::vector<int> parent(n, -1);
    int most_children = 0;
    for (int r = 0; r < n; ++r) {
      const auto kids = detail::tree_children(r, n);
      most_children = std::max(most_children, static_cast<int>(kids.size()));
      for (std::size_t i = 0; i < kids.size(); ++i) {
        REQUIRE(parent[kids[i]] == -1);
        parent[kids[i]] = r;
        CHECK(detail::tree_parent(kids[i]) == r);
        // the children, nearest first, hold consecutive runs of ranks after r
        const int end = i + 1 < kids.size() ? kids[i + 1] : std::min(n, r + (r == 0 ? n : detail::tree_lowbit(r)));
        CHECK(std::min(n, kids[i] + detail::tree_lowbit(kids[i])) == end);
      }
    }
    int deepest = 0;
    for (int r = 1; r < n; ++r) {
      CHECK(parent[r] >= 0);
      CHECK(parent[r] < r);
      int d = 0;
      for (int x = r; x != 0; x = parent[x]) ++d;
      deepest = std::max(deepest, d);
    }
    // depth: the most set bits of a rank; fan-out: rank 0's, one child a bit of the world
    int most_bits = 0;
    for (int r = 0; r < n; ++r) most_bits = std::max(most_bits, std::popcount(static_cast<unsigned>(r)));
    CHECK(deepest == most_bits);
    CHECK(deepest <= ceil_log2(n));
    CHECK(most_children == ceil_log2(n));
  }
}

TEST_CASE("every_rank_step over a PeerComm: O(log world) messages a rank, the same errors as the all-gather") {
  constexpr int n = 1024;
  const int logn = ceil_log2(n);
  for (const bool fails : {false, true}) {
    CAPTURE(fails);
    std::vector<std::uint64_t> tree_messages(n), tree_bytes(n), gather_messages(n);
    std::vector<std::string> tree_what(n), gather_what(n);
    const auto step = [&](int rank) {
      if (fails && (rank == 700 || rank == 301)) fail(errc::shape_mismatch, "ckpt: rank " + std::to_string(rank));
    };
    const auto thrown = testing::run_ranks(n, [&](testing::thread_comm& tc) {
      counting_comm<true> tree{tc};
      try {
        every_rank_step(tree, [&] { step(tc.rank()); });
      } catch (const error& e) {
        CHECK(e.code() == errc::shape_mismatch);
        tree_what[tc.rank()] = e.what();
      }
      CHECK(tree.gathers == 0);
      tree_messages[tc.rank()] = tree.messages;
      tree_bytes[tc.rank()] = tree.bytes_in;
      counting_comm<false> flat{tc};
      try {
        every_rank_step(flat, [&] { step(tc.rank()); });
      } catch (const error& e) {
        gather_what[tc.rank()] = e.what();
      }
      gather_messages[tc.rank()] = flat.messages;
    });
    for (const auto& e : thrown) CHECK(testing::error_message_of(e) == "");
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      // up: its children's tallies in, one out; down: one in, one to each child
      CHECK(tree_messages[r] == 2 * detail::tree_children(r, n).size() + (r == 0 ? 0 : 2));
      CHECK(tree_messages[r] <= static_cast<std::uint64_t>(2 * logn));
      CHECK(tree_bytes[r] <= static_cast<std::uint64_t>(2 * logn) * 80);  // a tally: three counts and an outcome
      CHECK(gather_messages[r] == n);                                     // what the all-gather hands every rank
      CHECK(tree_what[r] == gather_what[r]);
      CHECK(tree_what[r] == (fails ? "rank 301: ckpt: rank 301 (and 1 more rank(s) failed)" : ""));
    }
  }
}

TEST_CASE("rank0_step over a PeerComm: rank 0's result or error down the tree, one message in a rank") {
  constexpr int n = 1000;
  for (const bool fails : {false, true}) {
    CAPTURE(fails);
    std::vector<std::uint64_t> messages(n);
    std::vector<std::string> got(n);
    const auto thrown = testing::run_ranks(n, [&](testing::thread_comm& tc) {
      counting_comm<true> c{tc};
      try {
        got[tc.rank()] = rank0_step(c, [&] {
          if (fails) fail(errc::io_error, "ckpt/metadata.json: write");
          return std::string("the plan");
        });
      } catch (const error& e) {
        CHECK(e.code() == errc::io_error);
        got[tc.rank()] = e.what();
      }
      CHECK(c.gathers == 0);
      messages[tc.rank()] = c.messages;
    });
    for (const auto& e : thrown) CHECK(testing::error_message_of(e) == "");
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(got[r] == (fails ? "rank 0: ckpt/metadata.json: write" : "the plan"));
      CHECK(messages[r] == detail::tree_children(r, n).size() + (r == 0 ? 0 : 1));
    }
  }
}

TEST_CASE("every_rank_step over a PeerComm: a rank that never comes is named by every other rank") {
  // the timeout only makes a parent give up on rank 5; nothing here measures time
  constexpr int n = 8;
  testing::thread_world world(n, std::chrono::milliseconds(200));
  std::vector<std::string> what(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      testing::thread_comm c(world, r);
      if (r == 5) return;  // never comes to the step
      try {
        every_rank_step(c, [] {});
        what[r] = "(returned)";
      } catch (const error& e) {
        CHECK(e.code() == errc::comm_error);
        what[r] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < n; ++r) {
    if (r == 5) continue;
    CAPTURE(r);
    // whichever rank gave up first (rank 5's parent, or a rank waiting on it), it names rank 5
    // alone as in no call of the world
    CHECK(what[r].find("(rank(s) 5 in no call of the world: never came, or busy elsewhere)") != std::string::npos);
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
      stats[c.rank()] = save(mem, std::span<const flat_view>(s.views), c);
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
    load(mem, std::span<const flat_view>(into));
    for (int i = 0; i < 24; ++i) CHECK(w[i] == static_cast<float>(i));
    CHECK((b == std::vector<float>{1.5f, -2.5f, 3.5f}));
  }
  SUBCASE("1. describe: unsupported_dtype on one rank stays unsupported_dtype") {
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      if (c.rank() == 1) s.views[1].type = dtype::F4;  // 4-bit elements: no element ranges
      save(mem, std::span<const flat_view>(s.views), c);
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
      save(mem, std::span<const flat_view>(s.views), c);
    });
    check_all_threw(errors_of(thrown), make_error_code(errc::invalid_spec), 2);
  }
  SUBCASE("2. prepare: a failed mkdir keeps its errno, not already_exists") {
    testing::temp_dir tmp("agree");
    testing::write_file(tmp.path / "plain", "x");
    const file_directory dir(tmp.path / "plain" / "ckpt");
    auto thrown = testing::run_ranks(n, [&](testing::thread_comm& c) {
      rank_state s(c.rank(), n);
      save(dir, std::span<const flat_view>(s.views), c);
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
      save(mem, std::span<const flat_view>(s.views), c);
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
      save(dir, std::span<const flat_view>(s.views), c);
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
      save(dir, std::span<const flat_view>(s.views), c);
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
    auto thrown =
        testing::run_ranks(n, [&](testing::thread_comm& c) { got[c.rank()] = rotate_checkpoints(root, 2, c); });
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
        [&] { save(file_directory(dir.path / "ckpt"), std::span<const flat_view>(st.views), comm); }, &code);
    CHECK(code == errc::comm_error);
    const std::string want = "save " + (dir.path / "ckpt").string() + ": " + steps[at - 1] + ": c10d " +
                             (at % 2 ? "all_gather_bytes" : "broadcast_bytes") + " on rank 0 of 1 failed: rank 7 lost";
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

// --- the one wire encoding (dist/message.hpp): descriptions, replica roles, rank files, the HF
// tensor table and step outcomes travel as messages; malformed ones are comm_error naming the rank

namespace {

/// Rank r of 2: "w" [4, 3] F32 in row blocks, "f" [10] F16 in flat ranges (one empty), "b" [2]
/// F32 not sharded (both ranks), "rep" [4] F32 one flat shard held by both (rank 0 the writer).
struct mixed_state {
  std::vector<float> w, b, rep;
  std::vector<std::uint16_t> f;
  std::vector<flat_view> views;
  explicit mixed_state(int r) {
    const std::uint64_t ur = static_cast<std::uint64_t>(r);
    for (std::uint64_t i = 0; i < 6; ++i) w.push_back(static_cast<float>(ur * 6 + i));
    b = {0.5f, -0.5f};
    rep = {1, 2, 3, 4};
    const flat_spec fs = r == 0 ? flat_spec{{0, 3}, {3, 3}, {5, 7}} : flat_spec{{3, 5}, {7, 10}};
    f.assign(static_cast<std::size_t>(fs.local_numel()), static_cast<std::uint16_t>(0x3c00 + r));
    auto bytes = [](auto& v) { return reinterpret_cast<std::byte*>(v.data()); };
    views.push_back({"w", dtype::F32, {4, 3}, block_spec({2, 3}, {2 * ur, 0}), bytes(w), 24});
    views.push_back({"f", dtype::F16, {10}, fs, bytes(f), f.size() * 2});
    views.push_back({"b", dtype::F32, {2}, std::nullopt, bytes(b), 8});
    views.push_back({"rep",
                     dtype::F32,
                     {4},
                     flat_spec{{0, 4}},
                     bytes(rep),
                     16,
                     r == 0 ? replica_role::writer : replica_role::copy});
  }
};

/// What f throws must be errc::comm_error whose message names `who`.
template <class F>
void check_comm_error(F&& f, const std::string& who) {
  try {
    f();
    FAIL("decoded without an error");
  } catch (const shardsafe::error& e) {
    CAPTURE(e.what());
    CHECK(e.code() == errc::comm_error);
    CHECK(std::string(e.what()).find(who) != std::string::npos);
  }
}

/// A Comm of 2 ranks in one thread: rank 0, whose all_gather_bytes gives its own bytes for
/// rank 0 and, for rank 1, the step outcome holding its result passed through `tamper`.
struct tampering_comm {
  std::function<std::string(std::string)> tamper;
  int rank() const noexcept { return 0; }
  int world_size() const noexcept { return 2; }
  void barrier() {}
  std::vector<std::string> all_gather_bytes(std::string_view s) {
    step_outcome o = step_outcome::decode(s, "rank 0");
    o.text = tamper(o.text);
    return {std::string(s), o.encode()};
  }
  void broadcast_bytes(std::string&, int) {}
};
static_assert(Comm<tampering_comm>);

}  // namespace

TEST_CASE("description message: flat, block and replicated descriptions round-trip bit for bit") {
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    mixed_state s(r);
    const checkpoint_metadata md = detail::describe_views(std::span<const flat_view>(s.views), r, "ckpt");
    const std::string bytes = detail::encode_description(md);
    const checkpoint_metadata back = detail::decode_description(bytes, "ckpt (rank " + std::to_string(r) + "'s plan)");
    CHECK(detail::encode_description(back) == bytes);  // encode(decode(x)) == x
    REQUIRE(back.tensors.size() == md.tensors.size());
    for (std::size_t i = 0; i < md.tensors.size(); ++i) {
      const auto& [k, a] = md.tensors[i];
      const auto& [k2, b] = back.tensors[i];
      CHECK(k == k2);
      CHECK(a.shape == b.shape);
      CHECK(a.type == b.type);
      CHECK(a.is_sharded == b.is_sharded);
      CHECK(a.files == b.files);  // names and specs, empty flat ranges included
      CHECK_FALSE(b.grid);
    }
    // the same as the JSON text that used to travel, parsed again
    const checkpoint_metadata via_json = parse_checkpoint_metadata(write_checkpoint_metadata(md), "plan");
    CHECK(write_checkpoint_metadata(back) == write_checkpoint_metadata(via_json));
    CHECK(detail::encode_description(via_json) == bytes);
  }
  SUBCASE("merged, the two paths give the same metadata") {
    std::vector<checkpoint_metadata> by_message, by_json;
    std::vector<std::vector<replica_role>> roles;
    for (int r = 0; r < 2; ++r) {
      mixed_state s(r);
      const auto md = detail::describe_views(std::span<const flat_view>(s.views), r, "ckpt");
      by_message.push_back(detail::decode_description(detail::encode_description(md), "rank"));
      by_json.push_back(parse_checkpoint_metadata(write_checkpoint_metadata(md), "plan"));
      message_writer m;
      detail::encode_replica_roles(m, std::span<const flat_view>(s.views), "ckpt");
      message_reader rd(m.str(), "rank " + std::to_string(r));
      roles.push_back(detail::decode_replica_roles(rd, 4));
      rd.finish();
      CHECK(roles.back() == std::vector<replica_role>{replica_role::none, replica_role::none, replica_role::none,
                                                      r == 0 ? replica_role::writer : replica_role::copy});
    }
    CHECK(write_checkpoint_metadata(detail::merge_descriptions(by_message, "ckpt", roles)) ==
          write_checkpoint_metadata(detail::merge_descriptions(by_json, "ckpt", roles)));
  }
}

TEST_CASE("description message: a save by thread ranks writes the metadata.json built by hand") {
  auto store = std::make_shared<memory_store>();
  const memory_directory mem(store, "mem:ckpt");
  save_options opt;
  opt.checksums = false;  // hashes are not built by hand (test_verify.cpp checks the tables)
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& c) {
    mixed_state s(c.rank());
    save(mem, std::span<const flat_view>(s.views), c, opt);
  });
  for (const auto& t : thrown) CHECK_FALSE(t);
  const std::string s0 = std::to_string(mem.open(rank_file_name(0)).size()),
                    s1 = std::to_string(mem.open(rank_file_name(1)).size());
  const std::string block = R"({"flattened_offsets": null, "local_shape": [2, 3], "global_offset": )";
  const std::string golden =
      R"({"tensors": {"w": {"shape": [4, 3], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {)"
      R"("rank_0.safetensors": )" +
      block + R"([0, 0]}, "rank_1.safetensors": )" + block +
      R"([2, 0]}}}, )"
      R"("f": {"shape": [10], "is_sharded": true, "dtype": "F16", "shard_spec_per_file": {)"
      R"("rank_0.safetensors": {"flattened_offsets": [[0, 3], [3, 3], [5, 7]], "local_shape": null, "global_offset": null}, )"
      R"("rank_1.safetensors": {"flattened_offsets": [[3, 5], [7, 10]], "local_shape": null, "global_offset": null}}}, )"
      R"("b": {"shape": [2], "is_sharded": false, "dtype": "F32", "shard_spec_per_file": {)"
      R"("rank_0.safetensors": {"flattened_offsets": [[0, 2]], "local_shape": null, "global_offset": null}}}, )"
      R"("rep": {"shape": [4], "is_sharded": true, "dtype": "F32", "shard_spec_per_file": {)"
      R"("rank_0.safetensors": {"flattened_offsets": [[0, 4]], "local_shape": null, "global_offset": null}}}}, )"
      R"("shardsafe": {"writer": "shardsafe )" +
      std::string(library_version) +
      R"(", "world_size": 2, )"
      R"("file_sizes": {"rank_0.safetensors": )" +
      s0 + R"(, "rank_1.safetensors": )" + s1 + "}}}";
  CHECK(read_text(mem.open(metadata_file_name), max_metadata_size, text_kind::json) == golden);
}

TEST_CASE("description message: malformed messages are comm_error naming the rank, in bounded time and memory") {
  mixed_state s(1);
  const std::string who = "ckpt (rank 1's plan)";
  const std::string good =
      detail::encode_description(detail::describe_views(std::span<const flat_view>(s.views), 1, "ckpt"));
  auto decode = [&](const std::string& bytes) { return [&, bytes] { detail::decode_description(bytes, who); }; };
  SUBCASE("truncated anywhere") {
    for (std::size_t n = 0; n < good.size(); ++n) {
      CAPTURE(n);
      check_comm_error(decode(good.substr(0, n)), who);
    }
  }
  SUBCASE("trailing bytes") { check_comm_error(decode(good + "x"), "1 bytes are left over"); }
  // one tensor "w" [4] F32 sharded, one file with a flat spec, the field under test replaced
  struct parts {
    std::uint64_t tensors = 1, ndim = 1, type = static_cast<std::uint64_t>(dtype::F32), sharded = 1, files = 1,
                  kind = 0, ranges = 1, end = 4;
    std::string key = "w", file = "rank_1.safetensors";
  };
  auto build = [](const parts& p) {
    message_writer m;
    m.count(p.tensors).text(p.key).count(p.ndim);
    for (std::uint64_t d = 0; d < std::min<std::uint64_t>(p.ndim, 4); ++d) m.count(4);
    m.count(p.type).count(p.sharded).count(p.files).text(p.file).count(p.kind);
    if (p.kind == 1) return std::move(m.counts({2}).counts({0})).str();
    m.count(p.ranges).count(0).count(p.end);
    return std::move(m).str();
  };
  SUBCASE("the test's own message is good") {
    const auto md = detail::decode_description(build(parts{}), who);
    REQUIRE(md.tensors.size() == 1);
    CHECK(md.tensors[0].second.files[0].second == shard_spec(flat_spec{{0, 4}}));
  }
  SUBCASE("a dtype out of range") {
    parts p;
    p.type = all_dtypes.size();
    check_comm_error(decode(build(p)), "tensor 'w''s dtype is 22, past 21");
    p.type = UINT64_MAX;
    check_comm_error(decode(build(p)), who);
  }
  SUBCASE("counts past the end: nothing of that size is allocated (bad_alloc would not be comm_error)") {
    for (std::uint64_t big : {std::uint64_t(2), std::uint64_t(1) << 40, UINT64_MAX}) {
      CAPTURE(big);
      parts a;
      a.tensors = big;
      const bool huge = big > 2;  // 2 fits in what is left: the second item is cut short instead
      check_comm_error(decode(build(a)), huge ? "tensors cannot fit" : "ends inside");
      parts b;
      b.ndim = big;
      if (huge) check_comm_error(decode(build(b)), who);
      parts c;
      c.files = big;
      check_comm_error(decode(build(c)), huge ? "files of tensor 'w' cannot fit" : who);
      parts d;
      d.ranges = big;
      check_comm_error(decode(build(d)), "cannot fit");
      // a string's length past the end
      std::string e = build(parts{});
      e[8] = '\xff';
      e[15] = static_cast<char>(big >> 56);
      check_comm_error(decode(e), who);
    }
  }
  SUBCASE("values out of range, and specs, names and keys the JSON path refused") {
    parts a;
    a.sharded = 2;
    check_comm_error(decode(build(a)), "is_sharded is 2, past 1");
    parts b;
    b.kind = 2;
    check_comm_error(decode(build(b)), "kind (0 flat, 1 block) is 2, past 1");
    parts c;
    c.end = 5;  // past the 4 elements
    check_comm_error(decode(build(c)), "out of bounds");
    parts d;
    d.kind = 1;  // a 1-D block of a 1-D tensor is fine: [2] at [0]
    CHECK_NOTHROW(detail::decode_description(build(d), who));
    d.ndim = 2;  // ... of a 2-D tensor is not
    check_comm_error(decode(build(d)), "must both have the 2 dimensions");
    parts e;
    e.file = "../rank_1.safetensors";
    check_comm_error(decode(build(e)), "not a plain file name");
    parts f;
    f.ndim = 4;  // [4, 4, 4, 4] is fine; with 2^62 in a dimension it overflows
    CHECK_NOTHROW(detail::decode_description(build(f), who));
    message_writer g;
    g.count(1).text("w").counts({std::uint64_t(1) << 62, 8}).count(0).count(0).count(0);
    check_comm_error(decode(std::move(g).str()), "more than 2^64 elements");
    message_writer h;  // the same tensor twice
    h.count(2);
    for (int i = 0; i < 2; ++i) h.text("w").counts({1}).count(0).count(0).count(0);
    check_comm_error(decode(std::move(h).str()), "tensor 'w' is described twice");
  }
  SUBCASE("a description with a grid or extras is not one") {
    checkpoint_metadata md;
    md.extras.world_size = 2;
    CHECK_THROWS_AS(detail::encode_description(md), shardsafe::error);
  }
}

TEST_CASE("replica roles and the whole plan: malformed is comm_error naming the rank, on every rank") {
  auto roles_of = [](const std::string& bytes) {
    message_reader m(bytes, "ckpt (rank 1's plan)");
    auto r = detail::decode_replica_roles(m, 3);
    m.finish();
    return r;
  };
  auto msg = [](std::initializer_list<std::uint64_t> v) {
    message_writer m;
    for (auto x : v) m.count(x);
    return std::move(m).str();
  };
  CHECK(roles_of(msg({3, 2, 0, 2, 2, 1})) ==
        std::vector<replica_role>{replica_role::copy, replica_role::none, replica_role::writer});
  for (const std::string& bad : {msg({3, 1, 3, 1}), msg({3, 2, 2, 1, 1, 1}), msg({3, 1, 0, 0}), msg({3, 1, 0, 3}),
                                 msg({std::uint64_t(1) << 40, 0}), msg({3, 5, 0, 1}), msg({3, 1, 0})}) {
    check_comm_error([&] { roles_of(bad); }, "rank 1's plan");
  }
  SUBCASE("through agree_on_metadata: one rank's plan damaged") {
    const std::vector<std::pair<std::string, std::function<std::string(std::string)>>> damage{
        {"left over", [](std::string s) { return s + "x"; }},
        {"1 replica roles cannot fit in the 13 bytes left", [](std::string s) { return s.substr(0, s.size() - 3); }},
        {"its replica roles are for 5 views, not the 4 it describes",
         [](std::string s) {  // the roles' view count (after the description: 4 views, 1 role)
           const std::size_t at = s.size() - 4 * 8;
           s[at] = 5;
           return s;
         }},
    };
    for (const auto& [want, f] : damage) {
      CAPTURE(want);
      tampering_comm comm{f};
      mixed_state st(0);
      check_comm_error([&] { detail::agree_on_metadata(std::span<const flat_view>(st.views), comm, "ckpt"); },
                       "the message from ckpt (rank 1's plan) is malformed: ");
      check_comm_error([&] { detail::agree_on_metadata(std::span<const flat_view>(st.views), comm, "ckpt"); }, want);
    }
  }
}

TEST_CASE("rank file outcomes, the HF tensor table and step outcomes travel as messages") {
  detail::written_rank_file w;
  w.size = 12345;
  w.checksums["a"] = {1, 0xffffffffffffffffULL};
  w.checksums["b"] = {};
  for (bool sums : {false, true}) {
    const auto back = detail::decode_written(detail::encode_written(w, sums), sums, "ckpt (rank 3's file)");
    CHECK(back.size == w.size);
    CHECK(back.checksums == (sums ? w.checksums : decltype(w.checksums){}));
  }
  const std::string bytes = detail::encode_written(w, true);
  for (std::size_t n = 0; n < bytes.size(); ++n)
    check_comm_error([&] { detail::decode_written(bytes.substr(0, n), true, "ckpt (rank 3's file)"); },
                     "rank 3's file");
  check_comm_error([&] { detail::decode_written(bytes, false, "ckpt (rank 3's file)"); }, "left over");
  message_writer twice;
  twice.count(1).count(2).text("a").counts({1}).text("a").counts({2});
  check_comm_error([&] { detail::decode_written(twice.str(), true, "ckpt (rank 3's file)"); }, "listed twice");

  checkpoint_metadata md;
  md.tensors.push_back({"x", {{2, 3}, dtype::BF16, false, {}, std::nullopt}});
  md.tensors.push_back({"scalar", {{}, dtype::F64, false, {}, std::nullopt}});
  const std::string table = detail::encode_tensor_table(md);
  const auto got = detail::decode_tensor_table(table, "hf");
  REQUIRE(got.size() == 2);
  CHECK((got[0].name == "x" && got[0].type == dtype::BF16 && got[0].shape == shape_t{2, 3}));
  CHECK((got[1].name == "scalar" && got[1].type == dtype::F64 && got[1].shape.empty()));
  for (std::size_t n = 0; n < table.size(); ++n)
    check_comm_error([&] { detail::decode_tensor_table(table.substr(0, n), "hf"); }, "hf (rank 0's tensor table)");
  message_writer bad_type;
  bad_type.count(1).text("x").count(99).counts({1});
  check_comm_error([&] { detail::decode_tensor_table(bad_type.str(), "hf"); }, "tensor 'x''s dtype is 99, past 21");

  step_outcome neg;
  neg.failed = true;
  neg.category = std::system_category().name();
  neg.value = -5;
  neg.text = "negative";
  const auto back = step_outcome::decode(neg.encode(), "rank 2");
  CHECK(
      (back.failed && back.value == -5 && back.code().category() == std::system_category() && back.text == "negative"));
  message_writer flag2, big;
  flag2.count(2).text("x");
  big.count(1).text("generic").count(std::uint64_t(1) << 40).text("m");
  check_comm_error([&] { step_outcome::decode(flag2.str(), "rank 2"); }, "rank 2 (the outcome of a step)");
  check_comm_error([&] { step_outcome::decode(big.str(), "rank 2"); }, "is not an int");
}
