// tests/support/test_util.hpp - small helpers shared by the test executables: temporary folders,
// whole-file reads and writes, running a program without a shell, SHA-256 from OpenSSL.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <openssl/sha.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <span>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/posix.hpp"

extern char** environ;

namespace testing {

/// A fresh empty folder (mkdtemp), removed with everything in it when the object goes.
struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(const std::string& tag = "t") {
    std::string t = (std::filesystem::temp_directory_path() / ("shardsafe-" + tag + "-XXXXXX")).string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct program_result {
  bool exited = false;  ///< false: killed by a signal
  int code = -1;        ///< exit code, or -signal
  std::string out, err;
};

/// Runs exe with args (no shell; a name without '/' is looked up in PATH), stdin from
/// /dev/null, stdout and stderr captured. A program that cannot start gives exited = false.
inline program_result run_program(const std::string& exe, const std::vector<std::string>& args) {
  temp_dir io("run");
  const auto out = io.path / "stdout", err = io.path / "stderr";
  posix_spawn_file_actions_t fa;
  REQUIRE(posix_spawn_file_actions_init(&fa) == 0);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> all{exe};
  all.insert(all.end(), args.begin(), args.end());
  const std::vector<char*> argv = shardsafe::detail::c_string_array(all);
  pid_t pid;
  const int rc = posix_spawnp(&pid, exe.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  program_result r;
  if (rc != 0) return r;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) REQUIRE(errno == EINTR);
  r.exited = WIFEXITED(status);
  r.code = r.exited ? WEXITSTATUS(status) : -WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

#ifdef SHARDSAFE_TOOL  // (core_tests and torch_tests: the path of this build's tool, "" without one)
/// Whether this build has the shardsafe tool (it has none when configured with -Dtools=false).
inline bool have_tool() {
  return std::string_view(SHARDSAFE_TOOL).size() > 0 && std::filesystem::exists(SHARDSAFE_TOOL);
}
/// Runs this build's shardsafe tool with args (no shell), stdout and stderr captured.
inline program_result run_tool(const std::vector<std::string>& args) { return run_program(SHARDSAFE_TOOL, args); }
/// For a SUBCASE that runs the tool (a subcase takes no doctest::skip): true, and says so, when
/// this build has no tool; the subcase then returns.
inline bool tool_subcase_skipped() {
  if (have_tool()) return false;
  MESSAGE("this build has no shardsafe tool (-Dtools=false): the tool's subcase is skipped");
  return true;
}
#endif

/// Lowercase hex of bytes.
inline std::string hex(std::string_view b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

/// SHA-256 (hex) of bytes, straight from OpenSSL.
inline std::string sha256_hex(const void* data, std::size_t n) {
  unsigned char md[SHA256_DIGEST_LENGTH];
  SHA256(static_cast<const unsigned char*>(data), n, md);
  return hex({reinterpret_cast<const char*>(md), sizeof md});
}

/// n bytes, each the low byte of one draw of rng: the one source of random test data (the
/// same draws as before it was one: seeded fixtures keep their bytes).
inline std::string random_bytes(std::size_t n, std::mt19937_64& rng) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}
/// random_bytes of a generator seeded with seed.
inline std::string random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  return random_bytes(n, rng);
}

/// f() must throw a shardsafe::error with this code whose message holds every phrase.
template <class F>
void expect_error(F&& f, shardsafe::errc code, const std::vector<std::string>& phrases) {
  try {
    f();
    FAIL("no error thrown");
  } catch (const shardsafe::error& e) {
    CHECK_MESSAGE(e.code() == code, e.what());
    for (const auto& p : phrases)
      CHECK_MESSAGE(std::string(e.what()).find(p) != std::string::npos, std::string(e.what()), " / ", p);
  }
}
inline std::string sha256_hex(const std::string& bytes) { return sha256_hex(bytes.data(), bytes.size()); }

/// SHARDSAFE_REQUIRE_PYTHON=1 (the test command sets it): a missing Python peer fails the
/// cross-checks instead of skipping them.
inline bool python_required() {
  const char* v = std::getenv("SHARDSAFE_REQUIRE_PYTHON");
  return v && std::string(v) == "1";
}

/// The tests' one way to run a Python peer (the oracle of JSON, pickle, float, packing, hashing
/// and signing rules; real torch): `exe args...`, no shell. The run when the script exits 0.
/// Nothing when exe does not run or lacks a module the script imports: the cross-check is then
/// skipped with a message, unless SHARDSAFE_REQUIRE_PYTHON=1, where that fails the test. A
/// script that fails otherwise fails the test (its stderr in the message).
inline std::optional<program_result> python(const std::string& exe, const std::vector<std::string>& args) {
  program_result r = run_program(exe, args);
  if (!r.exited) {
    CHECK_MESSAGE(!python_required(), exe << " does not run but SHARDSAFE_REQUIRE_PYTHON=1");
    if (!python_required()) MESSAGE(exe << " does not run: cross-check skipped");
    return std::nullopt;
  }
  if (r.code != 0 && r.err.find("ModuleNotFoundError") != std::string::npos && !python_required()) {
    MESSAGE(exe << " lacks a module; cross-check skipped: " << r.err);
    return std::nullopt;
  }
  REQUIRE_MESSAGE(r.code == 0, exe << " failed: " << r.out << r.err);
  return r;
}

/// python() where the test cannot go on without its peer (one its decorator requires, or the
/// image's python3 that the test command requires): the run, or the test fails here.
inline program_result peer(const std::string& exe, const std::vector<std::string>& args) {
  auto r = python(exe, args);
  REQUIRE_MESSAGE(r.has_value(), exe << " is this test's peer and is not usable");
  return std::move(*r);
}

/// python() of `exe -I -c script FILE` with `input` written to FILE: its standard output.
inline std::optional<std::string> run_python(const std::string& exe, const std::string& script,
                                             const std::string& input) {
  temp_dir dir("python");
  write_file(dir.path / "in", input);
  auto r = python(exe, {"-I", "-c", script, (dir.path / "in").string()});
  if (!r) return std::nullopt;
  return std::move(r->out);
}

/// Whether exe runs and finds every module named (space-separated; found, not imported: an
/// import of torch costs seconds). Checked once per question, with std::system, not run_program:
/// this runs while tests are registered, outside any test.
inline bool python_has(const std::string& exe, const std::string& modules) {
  static std::mutex mu;
  static std::map<std::string, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = exe + "\n" + modules;
  if (auto it = known.find(key); it != known.end()) return it->second;
  const std::string cmd =
      exe + " -I -c 'import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))' " +
      modules + " >/dev/null 2>&1";
  return known[key] = std::system(cmd.c_str()) == 0;
}

/// The decorator of a test whose peer is exe with these modules: skipped without them unless
/// Python is required (then the test's first REQUIRE_MESSAGE(python_has(...)) fails).
inline doctest::skip python_check(const std::string& exe, const std::string& modules) {
  return doctest::skip(!python_required() && !python_has(exe, modules));
}

/// The interpreter with the real PyTorch peer of the tests: /usr/bin/python3 (Debian 12's
/// python3-torch 1.13, or 2.6 in the Debian 13 root), or SHARDSAFE_TORCH_PYTHON where it is set
/// (scripts/device-check.sh: the GPU machine's Python, whose torch is the wheel's).
inline const std::string torch_python = [] {
  const char* p = std::getenv("SHARDSAFE_TORCH_PYTHON");
  return std::string(p && *p ? p : "/usr/bin/python3");
}();

/// Whether torch_python has torch.
inline bool have_torch() { return python_has(torch_python, "torch"); }

/// The decorator of a test with the torch peer: skipped without it unless Python is required
/// (then its first REQUIRE fails: REQUIRE_MESSAGE(have_torch(), ...)).
inline doctest::skip torch_check() { return python_check(torch_python, "torch"); }

/// The major version of torch_python's torch: 1 on Debian 12 (1.13), 2 in the Debian 13 root of
/// scripts/env-debian13.sh (2.6); 0 without torch. Checked once.
inline int torch_major() {
  static const int v = [] {
    for (int m : {1, 2})
      if (std::system((torch_python + " -c 'import torch, sys; sys.exit(torch.__version__.split(\".\")[0] != \"" +
                       std::to_string(m) + "\")' >/dev/null 2>&1")
                          .c_str()) == 0)
        return m;
    return 0;
  }();
  return v;
}

/// SHARDSAFE_TORCH_PEER: the torch major version the test command runs the peer tests with (1 in
/// the Debian 12 leg, 2 in the Debian 13 one); its tests then fail rather than skip when the
/// interpreter holds another torch.
inline int torch_peer_required() {
  const char* v = std::getenv("SHARDSAFE_TORCH_PEER");
  return v && (std::string(v) == "1" || std::string(v) == "2") ? v[0] - '0' : 0;
}

/// The decorator of a test whose peer is torch of major version `major` (the 1.13 fixtures need
/// torch 1; DTensors, get_state_dict and torch 2.x's DCP need torch 2): run where torch_python
/// holds it, or where the test command says it must; skipped elsewhere.
/// `also_skip`: another reason to skip (doctest keeps only the last skip decorator of a test, so
/// reasons are joined here).
/// Evaluated while tests register, in every process of the binary (the ranks of the torch tests'
/// worlds too, which run no test case): where the test command names the peer, or in a rank, it
/// decides without starting Python (an import of torch costs seconds; a suite starts hundreds of
/// ranks). The test bodies REQUIRE torch_major() == major, so a wrong interpreter still fails.
inline doctest::skip torch_major_check(int major, bool also_skip = false) {
  if (also_skip) return doctest::skip(true);
  if (int required = torch_peer_required()) return doctest::skip(required != major);
  if (std::getenv("SHARDSAFE_WORKER")) return doctest::skip(true);
  return doctest::skip(torch_major() != major);
}

/// A JSON string literal of s (only '"' and '\\' escaped: enough for what the tests write).
inline std::string json_quoted(const std::string& s) {
  std::string r = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    r += c;
  }
  return r + "\"";
}

}  // namespace testing
