// Tests of format/pickle.hpp (the plain-data subset of Python's pickle that OLMo-core stores
// param groups and state keys in), cross-checked against Python 3 where it is installed:
// Python loads what we write, we load what Python writes (protocols 2 to 5). Also the ASCII
// escaping of metadata.json and model.safetensors.index.json against Python's json.dumps.
#include "shardsafe/format/pickle.hpp"

#include <doctest/doctest.h>

#include "support/test_util.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "shardsafe/format/hf_index.hpp"
#include "shardsafe/format/metadata.hpp"

extern char** environ;

// Work is counted here, not timed: every allocation the test binary makes adds its size to
// pickle_test_allocated (operator new replaced for the whole binary), so a refusal can be
// checked to have allocated little where building what the input claims would take gigabytes.
namespace {
std::atomic<std::uint64_t> pickle_test_allocated{0};
}  // namespace
void* operator new(std::size_t n) {
  pickle_test_allocated.fetch_add(n, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using namespace shardsafe;
namespace fs = std::filesystem;

namespace {

using pv = pickle_value;

/// Bytes allocated while f runs (this test's thread allocates alone while it does).
template <class F>
std::uint64_t allocated_by(F&& f) {
  const std::uint64_t before = pickle_test_allocated.load();
  f();
  return pickle_test_allocated.load() - before;
}
constexpr std::uint64_t one_mib = std::uint64_t(1) << 20;

// --- building values and bytes ----------------------------------------------------------

pv N() { return pv::none(); }
pv Bo(bool b) { return pv::boolean(b); }
pv I(std::int64_t i) { return pv::integer(i); }
pv F(double d) { return pv::real(d); }
pv Fbits(std::uint64_t bits) { return pv::real(std::bit_cast<double>(bits)); }
pv S(std::string s) { return pv::string(std::move(s)); }
pv L(std::vector<pv> v = {}) { return pv::list(std::move(v)); }
pv T(std::vector<pv> v = {}) { return pv::tuple(std::move(v)); }
pv D(std::vector<std::pair<pv, pv>> e = {}) { return pv::dict(std::move(e)); }

/// Bytes from a list of byte values and one-char strings; no escape sequences to misread
/// ("\x01a" is one byte in C++, and a string literal stops at the first NUL).
struct pickle_bytes {
  std::string s;
  pickle_bytes(std::initializer_list<int> b) {
    for (int x : b) s += static_cast<char>(x);
  }
};
std::string B(std::initializer_list<int> b) { return pickle_bytes(b).s; }
/// A protocol 2 pickle: PROTO 2, the body, STOP.
std::string P(const std::string& body) { return B({0x80, 2}) + body + "."; }

using testing::hex;

/// The same canonical text as canon() in the Python scripts below: a type tag per value,
/// floats as their IEEE bits (big-endian hex), strings as their UTF-8 bytes in hex.
std::string canon(const pv& v) {
  using k = pv::kind;
  switch (v.type()) {
    case k::none: return "N";
    case k::boolean: return v.as_bool("") ? "T" : "F";
    case k::integer: return "i" + std::to_string(v.as_int(""));
    case k::real: {
      const auto bits = std::bit_cast<std::uint64_t>(v.as_real(""));
      std::string h;
      for (int i = 7; i >= 0; --i) h += static_cast<char>((bits >> (8 * i)) & 0xff);
      return "f" + hex(h);
    }
    case k::string: return "s" + hex(v.as_string(""));
    case k::list:
    case k::tuple: {
      std::string s = v.type() == k::list ? "L[" : "T[";
      const auto& items = v.as_sequence("");
      for (std::size_t i = 0; i < items.size(); ++i) s += (i ? "," : "") + canon(items[i]);
      return s + "]";
    }
    case k::dict: {
      std::string s = "D[";
      for (std::size_t i = 0; i < v.dict_size(); ++i)
        s += (i ? "," : "") + canon(v.dict_key(i)) + ":" + canon(v.dict_value(i));
      return s + "]";
    }
    // read from torch.save files only: tagged apart from every plain kind the scripts compare
    case k::bytes: return (v.as_bytes("").bytearray ? "A" : "B") + hex(v.as_bytes("").data);
    case k::set: {
      std::string s = v.as_set("").frozen ? "Z[" : "S[";
      const auto& items = v.as_set("").items;
      for (std::size_t i = 0; i < items.size(); ++i) s += (i ? "," : "") + canon(items[i]);
      return s + "]";
    }
  }
  return "?";
}

const std::string what = "ckpt/optim/rank_0.safetensors: param_group0";

/// pickle_loads(bytes) must throw shardsafe::error, invalid_metadata, naming `what` and each phrase.
void expect_refused(const std::string& bytes, const std::vector<std::string>& phrases) {
  try {
    auto v = pickle_loads(bytes, what);
    FAIL("accepted " << hex(bytes) << " as " << canon(v));
  } catch (const shardsafe::error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(e.code() == errc::invalid_metadata, msg);
    CHECK_MESSAGE(msg.rfind(what + ": pickle ", 0) == 0, msg);
    for (const auto& p : phrases) CHECK_MESSAGE(msg.find(p) != std::string::npos, msg, " / wanted: ", p);
  }
}

// --- Python --------------------------------------------------------------------------------

using testing::slurp;
using testing::temp_dir;
using testing::write_file;

/// The modules the scripts import.
const std::string py_modules = "pickle pickletools json struct functools";

/// Runs `python3 -I -c script args...` through testing::python (a script that fails, fails the
/// test); an empty result where the peer is missing (the decorator skips those tests).
testing::program_result python(const std::string& script, const std::vector<std::string>& args) {
  std::vector<std::string> all{"-I", "-c", script};
  all.insert(all.end(), args.begin(), args.end());
  auto r = testing::python("python3", all);
  return r ? *r : testing::program_result{};
}

bool have_python() { return testing::python_has("python3", py_modules); }

using testing::python_required;

/// The decorator of a Python cross-check: skipped (and counted as skipped) without python3,
/// unless python3 is required.
doctest::skip python_check() { return testing::python_check("python3", py_modules); }

/// First statement of a Python cross-check: fails when python3 is required and missing.
#define REQUIRE_PYTHON()         \
  REQUIRE_MESSAGE(have_python(), \
                  "SHARDSAFE_REQUIRE_PYTHON=1 but python3 with pickle, pickletools and json does not run")

// canon() as above; shared by the scripts.
const std::string py_canon = R"PY(
import json, pickle, pickletools, struct, sys, functools
def canon(x):
    if x is None: return 'N'
    if x is True: return 'T'
    if x is False: return 'F'
    if type(x) is int: return 'i%d' % x
    if type(x) is float: return 'f' + struct.pack('>d', x).hex()
    if type(x) is str: return 's' + x.encode('utf-8').hex()
    if type(x) is list: return 'L[' + ','.join(canon(i) for i in x) + ']'
    if type(x) is tuple: return 'T[' + ','.join(canon(i) for i in x) + ']'
    if type(x) is dict: return 'D[' + ','.join(canon(k) + ':' + canon(v) for k, v in x.items()) + ']'
    raise TypeError(type(x))
)PY";

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// --- the values shared by the round-trip and Python tests ---------------------------------

struct py_case {
  pv value;
  std::string expr;  // a Python expression for the same value
  std::string repr;  // Python's repr() of it, by hand; empty: the same as expr
};

std::string repr_of_ints(int n) {  // "[0, 1, ..., n-1]"
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(i);
  return s + "]";
}

std::vector<py_case> cases() {
  constexpr auto i64min = std::numeric_limits<std::int64_t>::min();
  constexpr auto i64max = std::numeric_limits<std::int64_t>::max();
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<py_case> c = {
      {N(), "None", ""},
      {Bo(true), "True", ""},
      {Bo(false), "False", ""},
      {I(0), "0", ""},
      {I(1), "1", ""},
      {I(255), "255", ""},
      {I(256), "256", ""},
      {I(65535), "65535", ""},
      {I(65536), "65536", ""},
      {I(-1), "-1", ""},
      {I(-256), "-256", ""},
      {I(INT32_MIN), "-2147483648", ""},
      {I(INT32_MAX), "2147483647", ""},
      {I(std::int64_t(INT32_MAX) + 1), "2147483648", ""},
      {I(std::int64_t(INT32_MIN) - 1), "-2147483649", ""},
      {I(std::int64_t(1) << 40), "1099511627776", ""},
      {I(-(std::int64_t(1) << 40)), "-1099511627776", ""},
      {I(-(std::int64_t(1) << 39)), "-549755813888", ""},
      {I(i64max), "9223372036854775807", ""},
      {I(i64min), "-9223372036854775808", ""},
      {F(0.0), "0.0", ""},
      {F(-0.0), "-0.0", ""},
      {F(1.0), "1.0", ""},
      {F(0.1), "0.1", ""},
      {F(0.001), "0.001", ""},
      {F(1e-08), "1e-08", ""},
      {F(1e-300), "1e-300", ""},
      {F(1.5e300), "1.5e+300", ""},
      {F(1e16), "1e+16", ""},
      {F(123456789.0), "123456789.0", ""},
      {F(5e-324), "5e-324", ""},
      {F(inf), "float('inf')", "inf"},
      {F(-inf), "float('-inf')", "-inf"},
      {Fbits(0x7ff8000000000000), "float('nan')", "nan"},
      {Fbits(0x7ff8000000000123), "struct.unpack('>d', bytes.fromhex('7ff8000000000123'))[0]", "nan"},
      {Fbits(0xfff8000000000000), "struct.unpack('>d', bytes.fromhex('fff8000000000000'))[0]", "nan"},
      {S(""), "''", ""},
      {S("abc"), "'abc'", ""},
      {S("w\xc3\xa9ight"), "'w\\xe9ight'", "'w\xc3\xa9ight'"},
      {S("\xe5\xb1\x82.bias"), "'\\u5c42.bias'", "'\xe5\xb1\x82.bias'"},
      {S("emoji\xf0\x9f\x98\x80"), "'emoji\\U0001f600'", "'emoji\xf0\x9f\x98\x80'"},
      {S(std::string("nul\0tab\tquote'", 14)), "'nul\\x00tab\\tquote\\''", "\"nul\\x00tab\\tquote'\""},
      {S(std::string(300, 'x')), "'x' * 300", "'" + std::string(300, 'x') + "'"},
      {L(), "[]", ""},
      {L({I(1)}), "[1]", ""},
      {L({I(1), I(2)}), "[1, 2]", ""},
      {L({I(1), I(2), I(3)}), "[1, 2, 3]", ""},
      {L({I(1), I(2), I(3), I(4)}), "[1, 2, 3, 4]", ""},
      {L({L(), L({L()}), L({I(1), L({S("two"), L({F(3.5)})})})}), "[[], [[]], [1, ['two', [3.5]]]]", ""},
      {T(), "()", ""},
      {T({I(1)}), "(1,)", ""},
      {T({I(1), I(2)}), "(1, 2)", ""},
      {T({I(1), I(2), I(3)}), "(1, 2, 3)", ""},
      {T({I(1), I(2), I(3), I(4)}), "(1, 2, 3, 4)", ""},
      {T({I(1), I(2), I(3), I(4), I(5)}), "(1, 2, 3, 4, 5)", ""},
      {T({T(), T({T()}), T({I(1), T({I(2), T({I(3)})})})}), "((), ((),), (1, (2, (3,))))", ""},
      {D(), "{}", ""},
      {D({{S("a"), I(1)}}), "{'a': 1}", ""},
      {D({{S("a"), I(1)}, {S("b"), L({I(2), I(3)})}}), "{'a': 1, 'b': [2, 3]}", ""},
      {D({{I(1), S("one")}, {F(2.5), N()}, {N(), T({I(1)})}, {T({I(1), I(2)}), S("pair")}}),
       "{1: 'one', 2.5: None, None: (1,), (1, 2): 'pair'}", ""},
      {D({{S("lr"), F(0.001)},
          {S("betas"), T({F(0.9), F(0.95)})},
          {S("eps"), F(1e-08)},
          {S("weight_decay"), F(0.1)},
          {S("amsgrad"), Bo(false)},
          {S("maximize"), Bo(false)},
          {S("foreach"), N()},
          {S("capturable"), Bo(false)},
          {S("differentiable"), Bo(false)},
          {S("fused"), N()},
          {S("params"), L({I(0), I(1), I(2)})},
          {S("_param_names"), L({S("a.weight"), S("b.weight"), S("c")})}}),
       "{'lr': 0.001, 'betas': (0.9, 0.95), 'eps': 1e-08, 'weight_decay': 0.1, 'amsgrad': False, "
       "'maximize': False, 'foreach': None, 'capturable': False, 'differentiable': False, 'fused': None, "
       "'params': [0, 1, 2], '_param_names': ['a.weight', 'b.weight', 'c']}",
       ""},
      {L({S("exp_avg"), S("exp_avg_sq"), S("step")}), "['exp_avg', 'exp_avg_sq', 'step']", ""},
  };
  // more than one batch of APPENDS / SETITEMS (Python writes 1000 at a time)
  std::vector<pv> many;
  for (int i = 0; i < 2500; ++i) many.push_back(I(i));
  c.push_back({L(many), "list(range(2500))", repr_of_ints(2500)});
  std::vector<std::pair<pv, pv>> entries;
  std::string drepr = "{";
  for (int i = 0; i < 1200; ++i) {
    entries.emplace_back(S(std::to_string(i)), I(i));
    drepr += (i ? ", '" : "'") + std::to_string(i) + "': " + std::to_string(i);
  }
  c.push_back({D(std::move(entries)), "{str(i): i for i in range(1200)}", drepr + "}"});
  // nesting up to the reader's limit
  pv deep = L();
  std::string deep_repr = "[]";
  for (int i = 0; i < 150; ++i) {
    deep = L({std::move(deep)});
    deep_repr = "[" + deep_repr + "]";
  }
  c.push_back({deep, "functools.reduce(lambda a, _: [a], range(150), [])", deep_repr});
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("pickle: every value round-trips through pickle_dumps and pickle_loads") {
  for (const auto& c : cases()) {
    INFO(c.expr);
    const std::string bytes = pickle_dumps(c.value);
    CHECK(bytes.substr(0, 2) == B({0x80, 2}));
    CHECK(bytes.back() == '.');
    const pv back = pickle_loads(bytes, what);
    CHECK(canon(back) == canon(c.value));
    CHECK(back == c.value);
  }
  // containers of every small size, and around the one-byte boundaries
  for (std::size_t n : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 255, 256, 1000, 1001}) {
    std::vector<pv> items;
    std::vector<std::pair<pv, pv>> entries;
    for (std::size_t i = 0; i < n; ++i) {
      items.push_back(i % 3 ? I(static_cast<std::int64_t>(i)) : S("s" + std::to_string(i)));
      entries.emplace_back(S("k" + std::to_string(i)), i % 2 ? L({I(1)}) : T({F(0.5)}));
    }
    for (const pv& v : {L(items), T(items), D(entries), T({L(items), T(items)}), L({D(entries), D()})}) {
      INFO(n << " " << canon(v).substr(0, 60));
      CHECK(pickle_loads(pickle_dumps(v), what) == v);
    }
  }
}

TEST_CASE("pickle: pickle_dumps writes protocol 2 opcodes as the pickle spec defines them") {
  // Expected bytes from Lib/pickletools.py's opcode table: PROTO 0x80 n, STOP '.', NONE 'N',
  // NEWTRUE 0x88, NEWFALSE 0x89, BININT1 'K' u8, BININT2 'M' u16le, BININT 'J' i32le,
  // LONG1 0x8a n + n bytes of little-endian two's complement, BINFLOAT 'G' f64be,
  // BINUNICODE 'X' u32le + UTF-8, EMPTY_LIST ']', EMPTY_TUPLE ')', EMPTY_DICT '}', MARK '(',
  // APPEND 'a', APPENDS 'e', SETITEM 's', SETITEMS 'u', TUPLE1..3 0x85..0x87, TUPLE 't'.
  // Lists and dicts are filled as Python's pickler does: MARK ... APPENDS per 1000 items, a
  // lone item with APPEND (SETITEM for dicts).
  const std::vector<std::pair<pv, std::string>> exact = {
      {N(), B({0x80, 2, 'N', '.'})},
      {Bo(true), B({0x80, 2, 0x88, '.'})},
      {Bo(false), B({0x80, 2, 0x89, '.'})},
      {I(0), P(B({'K', 0}))},
      {I(255), P(B({'K', 0xff}))},
      {I(256), P(B({'M', 0x00, 0x01}))},
      {I(65535), P(B({'M', 0xff, 0xff}))},
      {I(65536), P(B({'J', 0x00, 0x00, 0x01, 0x00}))},
      {I(-1), P(B({'J', 0xff, 0xff, 0xff, 0xff}))},
      {I(INT32_MIN), P(B({'J', 0x00, 0x00, 0x00, 0x80}))},
      {I(INT32_MAX), P(B({'J', 0xff, 0xff, 0xff, 0x7f}))},
      // 2^31 needs a fifth byte for its sign; -2^31-1 likewise
      {I(std::int64_t(1) << 31), P(B({0x8a, 5, 0x00, 0x00, 0x00, 0x80, 0x00}))},
      {I(-(std::int64_t(1) << 31) - 1), P(B({0x8a, 5, 0xff, 0xff, 0xff, 0x7f, 0xff}))},
      {I(std::int64_t(1) << 40), P(B({0x8a, 6, 0, 0, 0, 0, 0, 0x01}))},
      {I(-(std::int64_t(1) << 40)), P(B({0x8a, 6, 0, 0, 0, 0, 0, 0xff}))},
      {I(-(std::int64_t(1) << 39)), P(B({0x8a, 5, 0, 0, 0, 0, 0x80}))},
      {I(std::numeric_limits<std::int64_t>::max()), P(B({0x8a, 8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}))},
      {I(std::numeric_limits<std::int64_t>::min()), P(B({0x8a, 8, 0, 0, 0, 0, 0, 0, 0, 0x80}))},
      {F(1.0), P(B({'G', 0x3f, 0xf0, 0, 0, 0, 0, 0, 0}))},
      {F(-0.0), P(B({'G', 0x80, 0, 0, 0, 0, 0, 0, 0}))},
      {F(0.5), P(B({'G', 0x3f, 0xe0, 0, 0, 0, 0, 0, 0}))},
      {F(-2.0), P(B({'G', 0xc0, 0x00, 0, 0, 0, 0, 0, 0}))},
      {F(std::numeric_limits<double>::infinity()), P(B({'G', 0x7f, 0xf0, 0, 0, 0, 0, 0, 0}))},
      {Fbits(0x7ff8000000000123), P(B({'G', 0x7f, 0xf8, 0, 0, 0, 0, 0x01, 0x23}))},
      {S(""), P(B({'X', 0, 0, 0, 0}))},
      {S("abc"), P(B({'X', 3, 0, 0, 0, 'a', 'b', 'c'}))},
      {S("\xc3\xa9"), P(B({'X', 2, 0, 0, 0, 0xc3, 0xa9}))},
      {S(std::string(256, 'z')), P(B({'X', 0, 1, 0, 0}) + std::string(256, 'z'))},
      {L(), P("]")},
      {L({I(1)}), P(B({']', 'K', 1, 'a'}))},
      {L({I(1), N()}), P(B({']', '(', 'K', 1, 'N', 'e'}))},
      {T(), P(")")},
      {T({I(1)}), P(B({'K', 1, 0x85}))},
      {T({I(1), I(2)}), P(B({'K', 1, 'K', 2, 0x86}))},
      {T({I(1), I(2), I(3)}), P(B({'K', 1, 'K', 2, 'K', 3, 0x87}))},
      {T({I(1), I(2), I(3), I(4)}), P(B({'(', 'K', 1, 'K', 2, 'K', 3, 'K', 4, 't'}))},
      {D(), P("}")},
      {D({{S("a"), I(1)}}), P(B({'}', 'X', 1, 0, 0, 0, 'a', 'K', 1, 's'}))},
      {D({{S("a"), T()}, {I(7), L()}}), P(B({'}', '(', 'X', 1, 0, 0, 0, 'a', ')', 'K', 7, ']', 'u'}))},
  };
  for (const auto& [v, bytes] : exact) {
    INFO(canon(v));
    CHECK(hex(pickle_dumps(v)) == hex(bytes));
  }
  // 2001 and 1001 items: two full batches and a lone APPEND / one batch and a lone SETITEM
  std::vector<pv> items(2001, N());
  CHECK(pickle_dumps(L(items)) == P("](" + std::string(1000, 'N') + "e(" + std::string(1000, 'N') + "eNa"));
  std::vector<std::pair<pv, pv>> entries;
  std::string body;
  for (int i = 0; i < 1001; ++i) {
    entries.emplace_back(I(i % 256), N());
    body += B({'K', i % 256, 'N'});
  }
  CHECK(pickle_dumps(D(entries)) == P("}(" + body.substr(0, 3000) + "u" + body.substr(3000) + "s"));
}

TEST_CASE("pickle: a list of more items than the reader's stack holds round-trips (it is batched)") {
  std::vector<pv> items(std::size_t(1) << 17, I(7));  // twice the reader's stack
  items.back() = S("last");
  const pv v = L(std::move(items));
  CHECK(pickle_loads(pickle_dumps(v), what) == v);
  std::vector<std::pair<pv, pv>> entries;
  for (std::int64_t i = 0; i < (std::int64_t(1) << 16) + 5; ++i) entries.emplace_back(I(i), Bo(i % 2));
  const pv d = D(std::move(entries));
  CHECK(pickle_loads(pickle_dumps(d), what) == d);
}

TEST_CASE("pickle: reads opcodes Python's pickler writes that pickle_dumps does not") {
  // memo: BINPUT/LONG_BINPUT/MEMOIZE and BINGET/LONG_BINGET; APPEND/SETITEM; FRAME;
  // SHORT_BINUNICODE/BINUNICODE8; LONG1 of zero bytes; LONG4; LIST/DICT (protocol 1); DUP; POP
  const std::string what2 = "w";
  // (the FRAME declares the 7 bytes that follow it, as Python writes: one declaring more is
  // refused as truncated, below)
  CHECK(pickle_loads(B({0x80, 4, 0x95, 7, 0, 0, 0, 0, 0, 0, 0, 0x8c, 3, 'a', 'b', 'c', 0x94, '.'}), what2) == S("abc"));
  CHECK(pickle_loads(P(B({0x8d, 2, 0, 0, 0, 0, 0, 0, 0, 'h', 'i'})), what2) == S("hi"));
  CHECK(pickle_loads(P(B({0x8a, 0})), what2) == I(0));
  CHECK(pickle_loads(P(B({0x8a, 1, 0xff})), what2) == I(-1));
  CHECK(pickle_loads(P(B({0x8a, 2, 0x00, 0x80})), what2) == I(-32768));
  CHECK(pickle_loads(P(B({0x8b, 2, 0, 0, 0, 0x34, 0x12})), what2) == I(0x1234));
  CHECK(pickle_loads(P(B({0x8b, 0, 0, 0, 0})), what2) == I(0));
  CHECK(pickle_loads(P(B({']', 'q', 0, 'K', 1, 'a', 'K', 2, 'a'})), what2) == L({I(1), I(2)}));
  CHECK(pickle_loads(P(B({'}', 'r', 7, 0, 0, 0, 'K', 1, 'K', 2, 's', 'j', 7, 0, 0, 0, '0'})), what2) ==
        D({{I(1), I(2)}}));
  CHECK(pickle_loads(P(B({'(', 'K', 1, 'K', 2, 'l'})), what2) == L({I(1), I(2)}));
  CHECK(pickle_loads(P(B({'(', 'K', 1, 'K', 2, 'd'})), what2) == D({{I(1), I(2)}}));
  CHECK(pickle_loads(P(B({'(', 'l'})), what2) == L());
  CHECK(pickle_loads(P(B({'(', 'd'})), what2) == D());
  CHECK(pickle_loads(P(B({'(', 't'})), what2) == T());
  CHECK(pickle_loads(P(B({'X', 1, 0, 0, 0, 'x', '2', 0x86})), what2) == T({S("x"), S("x")}));
  CHECK(pickle_loads(P(B({'N', 'K', 5, '0'})), what2) == N());
  // a shared list is read as two equal lists; appending after the second reference shows in both
  CHECK(pickle_loads(P(B({']', 'q', 0, 'h', 0, 0x86, 'h', 0, 'K', 9, 'a', '0'})), what2) == T({L({I(9)}), L({I(9)})}));
  // no PROTO at all (protocol 1 style) is fine
  CHECK(pickle_loads(B({'K', 3, '.'}), what2) == I(3));
}

TEST_CASE("pickle: malformed and hostile input is refused with invalid_metadata naming what and why") {
  SUBCASE("empty, no STOP, STOP with 0 or 2 values, MARK left open") {
    expect_refused("", {"ends without STOP"});
    expect_refused(B({0x80, 2}), {"ends without STOP"});
    expect_refused(B({0x80, 2, 'N'}), {"ends without STOP"});
    expect_refused(P(""), {"STOP with 0 values"});
    expect_refused(P("NN"), {"STOP with 2 values"});
    expect_refused(P("(N"), {"STOP"});
  }
  SUBCASE("truncated inside each opcode's argument") {
    struct op_case {
      std::string before;  // what the stack needs
      std::string op_and_arg;
    };
    const std::vector<op_case> ops = {
        {"", B({0x80, 2})},                                      // PROTO
        {"", B({0x95, 1, 0, 0, 0, 0, 0, 0, 0})},                 // FRAME
        {"", B({'K', 1})},                                       // BININT1
        {"", B({'M', 1, 2})},                                    // BININT2
        {"", B({'J', 1, 2, 3, 4})},                              // BININT
        {"", B({0x8a, 2, 1, 2})},                                // LONG1
        {"", B({0x8b, 2, 0, 0, 0, 1, 2})},                       // LONG4
        {"", B({'G', 0x3f, 0xf0, 0, 0, 0, 0, 0, 0})},            // BINFLOAT
        {"", B({'X', 3, 0, 0, 0, 'a', 'b', 'c'})},               // BINUNICODE
        {"", B({0x8c, 3, 'a', 'b', 'c'})},                       // SHORT_BINUNICODE
        {"", B({0x8d, 3, 0, 0, 0, 0, 0, 0, 0, 'a', 'b', 'c'})},  // BINUNICODE8
        {"N", B({'q', 0})},                                      // BINPUT
        {"N", B({'r', 0, 0, 0, 0})},                             // LONG_BINPUT
        {B({'N', 'q', 0, '0'}), B({'h', 0})},                    // BINGET
        {B({'N', 'q', 0, '0'}), B({'j', 0, 0, 0, 0})},           // LONG_BINGET
    };
    for (const auto& [before, full] : ops) {
      // the whole opcode reads
      CHECK_NOTHROW(
          pickle_loads(B({0x80, 2}) + before + full + (full[0] == '\x80' || full[0] == '\x95' ? "N." : "."), what));
      for (std::size_t cut = 1; cut < full.size(); ++cut) {
        INFO(hex(full) << " cut at " << cut);
        expect_refused(B({0x80, 2}) + before + full.substr(0, cut), {"is truncated", "bytes at byte"});
      }
    }
  }
  SUBCASE("opcodes that name classes or call code are refused by name") {
    const std::vector<std::pair<std::string, std::string>> refused = {
        {"cos\nsystem\n", "GLOBAL"},
        {B({0x8c, 2, 'o', 's', 0x8c, 6, 's', 'y', 's', 't', 'e', 'm', 0x93}), "STACK_GLOBAL"},
        {B({')', 'R'}), "REDUCE"},
        {B({'}', '}', 'b'}), "BUILD"},
        {B({')', 0x81}), "NEWOBJ"},
        {B({')', '}', 0x92}), "NEWOBJ_EX"},
        {"(ios\nsystem\n", "INST"},
        {B({'(', 'N', 'o'}), "OBJ"},
        {"P1\n", "PERSID"},
        {B({'N', 'Q'}), "BINPERSID"},
        {B({0x82, 1}), "EXT1"},
        {B({0x83, 1, 0}), "EXT2"},
        {B({0x84, 1, 0, 0, 0}), "EXT4"},
        {B({'C', 1, 'x'}), "SHORT_BINBYTES"},
        {B({'B', 1, 0, 0, 0, 'x'}), "BINBYTES"},
        {B({0x8f}), "EMPTY_SET"},
        {B({'(', 0x91}), "FROZENSET"},
        {"I01\n", "INT"},
        {"S'x'\n", "STRING"},
        {B({'U', 1, 'x'}), "SHORT_BINSTRING"},
        {B({0x97}), "NEXT_BUFFER"},
    };
    for (const auto& [body, name] : refused) {
      INFO(name);
      expect_refused(P(body), {"unsupported opcode", "(" + name + ")", "only plain data"});
    }
    // the byte offset of the refused opcode is named
    expect_refused(P("cos\nsystem\n"), {"0x63 (GLOBAL) at byte 2"});
    expect_refused(P(B({'N', 'Q'})), {"0x51 (BINPERSID) at byte 3"});
  }
  SUBCASE("unknown opcodes") {
    for (int op : {0x00, 0x01, 0x7f, 0x99, 0xa0, 0xfe, 0xff, int('z'), int('A')}) {
      INFO(op);
      expect_refused(P(B({op})), {"unsupported opcode 0x", "at byte 2"});
    }
  }
  SUBCASE("containers used the wrong way") {
    expect_refused(P(B({'}', 'K', 1, 'a'})), {"APPEND on a dict"});
    expect_refused(P(B({')', 'K', 1, 'a'})), {"APPEND on a tuple"});
    expect_refused(P(B({'}', '(', 'K', 1, 'e'})), {"APPENDS on a dict"});
    expect_refused(P(B({']', 'K', 1, 'K', 2, 's'})), {"SETITEM on a list"});
    expect_refused(P(B({']', '(', 'K', 1, 'K', 2, 'u'})), {"SETITEMS on a list"});
    expect_refused(P(B({'}', '(', 'K', 1, 'K', 2, 'K', 3, 'u'})), {"SETITEMS with an odd number"});
    expect_refused(P(B({'(', 'K', 1, 'd'})), {"DICT with an odd number"});
    expect_refused(P(B({']', 'K', 1, 'e'})), {"needs a MARK"});
    expect_refused(P(B({'K', 1, 't'})), {"needs a MARK"});
    expect_refused(P(B({'}', 'K', 1, 'K', 2, 'u'})), {"needs a MARK"});
    expect_refused(P(B({'K', 1, 'l'})), {"needs a MARK"});
    expect_refused(P(B({'K', 1, 0x86})), {"TUPLE2 with too few values"});
    expect_refused(P(B({'K', 1, '(', 'K', 2, 0x86})), {"TUPLE2 with too few values"});
    expect_refused(P(B({0x87})), {"TUPLE3 with too few values"});
    expect_refused(P(B({'a'})), {"empty stack"});
    expect_refused(P(B({']', '(', 'K', 1, 'a'})), {"empty stack"});  // the list is below the MARK
    expect_refused(P(B({'0'})), {"empty stack"});
    expect_refused(P(B({'2'})), {"empty stack"});
    expect_refused(P(B({'q', 0})), {"empty stack"});
  }
  SUBCASE("memo references") {
    expect_refused(P(B({'h', 0})), {"memo index 0 was never stored"});
    expect_refused(P(B({'N', 'q', 1, 'h', 0})), {"memo index 0 was never stored"});
    expect_refused(P(B({'j', 0xff, 0xff, 0xff, 0xff})), {"memo index 4294967295 was never stored"});
    expect_refused(P(B({'N', 'r', 0xff, 0xff, 0xff, 0xff})), {"memo index 4294967295 is too large"});
  }
  SUBCASE("sizes read from the input") {
    expect_refused(P(B({0x8b, 0xff, 0xff, 0xff, 0xff})), {"integer of 4294967295 bytes", "does not fit 64 bits"});
    expect_refused(P(B({0x8b, 9, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9})), {"integer of 9 bytes"});
    expect_refused(P(B({0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0, 1})), {"integer of 9 bytes"});
    expect_refused(P(B({'X', 0xff, 0xff, 0xff, 0xff, 'a'})), {"is truncated", "4294967295"});
    expect_refused(P(B({0x8d, 0, 0, 0, 0, 0, 0, 0, 0x80, 'a'})), {"is truncated", "9223372036854775808"});
    expect_refused(P(B({0x8d, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})), {"is truncated"});
  }
  SUBCASE("strings that are not UTF-8") {
    expect_refused(P(B({'X', 2, 0, 0, 0, 0xc3, 0x28})), {"string at byte 7 is not UTF-8"});
    expect_refused(P(B({0x8c, 1, 0xff})), {"is not UTF-8"});
    expect_refused(P(B({'X', 3, 0, 0, 0, 0xed, 0xa0, 0x80})), {"is not UTF-8"});  // a lone surrogate
    expect_refused(P(B({'X', 2, 0, 0, 0, 0xc0, 0x80})), {"is not UTF-8"});        // overlong NUL
  }
  SUBCASE("nesting deeper than 1000 (Python's own recursion limit), and a cycle") {
    auto nested = [](int n) {  // n lists, each inside the one before
      return P(std::string(static_cast<std::size_t>(n), ']') + std::string(static_cast<std::size_t>(n - 1), 'a'));
    };
    CHECK_NOTHROW(pickle_loads(nested(1001), what));  // depth 1000 below the outermost
    expect_refused(nested(1002), {"nests deeper than 1000"});
    expect_refused(nested(5000), {"nests deeper than 1000"});
    // far deeper than the call stack could unwind recursively (and, past 65536 open lists,
    // refused already for the size of the stack)
    expect_refused(nested(60000), {"nests deeper than 1000"});
    expect_refused(nested(400000), {"too many values on the stack"});
    // tuples nest the same way
    std::string t = "K\x01";
    for (int i = 0; i < 1200; ++i) t += '\x85';
    expect_refused(P(t), {"nests deeper than 1000"});
    // a list appended to itself, through DUP and through the memo
    expect_refused(P(B({']', '2', 'a'})), {"contains itself"});
    expect_refused(P(B({']', 'q', 0, 'h', 0, 'a'})), {"contains itself"});
    expect_refused(P(B({']', 'q', 0, '(', 'h', 0, 'h', 0, 'e'})), {"contains itself"});
    // a dict holding a list holding the dict
    expect_refused(P(B({'}', 'q', 0, 'K', 1, ']', 'h', 0, 'a', 's'})), {"contains itself"});
  }
  SUBCASE("a memo blow-up (billion laughs) is refused at once") {
    // [1]; then 30 times: l = [l, l]  ->  2^31 values when expanded, 110 bytes of pickle
    std::string b = B({']', 'K', 1, 'a', 'q', 0, '0'});
    for (int i = 1; i <= 30; ++i) b += B({'(', 'h', i - 1, 'h', i - 1, 'l', 'q', i, '0'});
    b += B({'h', 30});
    const auto used = allocated_by([&] { expect_refused(P(b), {"expands to more than"}); });
    CHECK_MESSAGE(used < one_mib, "allocated ", used, " bytes");  // the tree: 2^31 values
    // the same with a wide list of references: 64 x 64 x 64 x 64 x 64
    std::string w = B({'K', 1, 'q', 0, '0'});
    for (int i = 1; i <= 5; ++i) {
      w += B({']', '('});
      for (int k = 0; k < 64; ++k) w += B({'h', i - 1});
      w += B({'e', 'q', i, '0'});
    }
    w += B({'h', 5});
    const auto wide = allocated_by([&] { expect_refused(P(w), {"expands to more than"}); });
    CHECK_MESSAGE(wide < one_mib, "allocated ", wide, " bytes");
    // a long str held once by the memo and referred to many times: each reference is a copy
    // when the tree is built, so its bytes count (one value per 8): 2000 x 64 KiB = 128 MiB
    const std::string text(64 * 1024, 's');
    std::string lots = B({'X', 0, 0, 1, 0}) + text + B({'q', 0, '0', ']', '('});
    for (int i = 0; i < 2000; ++i) lots += B({'h', 0});
    lots += B({'e'});
    const std::string lots_pickle = P(lots);
    const std::string bound =
        std::to_string((std::size_t(1) << 20) + lots_pickle.size() / 8);  // max_values + the input's strings
    const auto strings = allocated_by([&] {
      expect_refused(lots_pickle, {"expands to more than " + bound + " values (strings count 1 per 8 bytes)"});
    });
    CHECK_MESSAGE(strings < 4 * one_mib, "allocated ", strings, " bytes");
    // one str of 9 MiB, read once: its bytes are the input's, never what the bound refuses
    const std::string big(9 * one_mib, 'b');
    const pv one = pickle_loads(P(B({'X', 0, 0, 0x90, 0}) + big), what);
    CHECK(one.as_string("") == big);
    // 16 references of it are within the bound, each a copy equal to it
    std::string few = B({'X', 0, 0, 1, 0}) + text + B({'q', 0, '0', ']', '('});
    for (int i = 0; i < 16; ++i) few += B({'h', 0});
    const pv copies = pickle_loads(P(few + B({'e'})), what);
    REQUIRE(copies.as_sequence("").size() == 16u);
    for (const pv& c : copies.as_sequence("")) CHECK(c.as_string("") == text);
    // a shared list within the budget is fine: 2^10 leaves
    std::string ok = B({']', 'K', 1, 'a', 'q', 0, '0'});
    for (int i = 1; i <= 10; ++i) ok += B({'(', 'h', i - 1, 'h', i - 1, 'l', 'q', i, '0'});
    ok += B({'h', 10});
    pv v = pickle_loads(P(ok), what);
    std::size_t leaves = 0;
    auto count = [&](auto&& self, const pv& x) -> void {
      if (x.type() != pv::kind::list) {
        ++leaves;
        return;
      }
      for (const auto& c : x.as_sequence("")) self(self, c);
    };
    count(count, v);
    CHECK(leaves == 1024);
  }
  SUBCASE("every prefix of valid pickles, and every single-byte change, ends in a value or invalid_metadata") {
    for (const auto& c : cases()) {
      const std::string bytes = pickle_dumps(c.value);
      if (bytes.size() > 400) continue;
      for (std::size_t n = 0; n < bytes.size(); ++n) expect_refused(bytes.substr(0, n), {});
      for (std::size_t i = 0; i < bytes.size(); ++i)
        for (int x : {0x00, 0x01, 0x28, 0x2e, 0x7f, 0x80, 0xff}) {
          std::string m = bytes;
          m[i] = static_cast<char>(x);
          try {
            const pv v = pickle_loads(m, what);
            CHECK(pickle_loads(pickle_dumps(v), what) == v);
          } catch (const shardsafe::error& e) {
            CHECK_MESSAGE(e.code() == errc::invalid_metadata, e.what());
          }
        }
    }
  }
}

TEST_CASE("pickle_value: accessors and their errors") {
  pv d = D({{S("lr"), F(0.5)}, {S("n"), I(3)}, {I(1), S("int key")}});
  CHECK(d.dict_size() == 3);
  CHECK(d.at("lr", "g").as_real("lr") == 0.5);
  CHECK(d.at("n", "g").as_real("n") == 3.0);  // an int reads as a float
  CHECK(d.find("missing") == nullptr);
  CHECK(d.find("int key") == nullptr);
  d.set("lr", F(0.25));
  d.set("new", N());
  CHECK(d.dict_size() == 4);
  CHECK(d.at("lr", "g") == F(0.25));
  CHECK(d.dict_key(3) == S("new"));
  try {
    (void)d.at("nope", "param_group0");
    FAIL("no error");
  } catch (const shardsafe::error& e) {
    CHECK(e.code() == errc::invalid_metadata);
    CHECK(std::string(e.what()) == "param_group0: no key 'nope'");
  }
  try {
    (void)S("x").as_int("param_group0.params[2]");
    FAIL("no error");
  } catch (const shardsafe::error& e) {
    CHECK(std::string(e.what()) == "param_group0.params[2]: expected int, got str");
  }
  try {
    (void)I(1).as_sequence("state_keys");
    FAIL("no error");
  } catch (const shardsafe::error& e) {
    CHECK(std::string(e.what()) == "state_keys: expected a list or tuple, got int");
  }
  CHECK(L().dict_size() == 0);
  CHECK(L().find("x") == nullptr);
  // NaN equals NaN with the same bits only; -0.0 is not 0.0
  CHECK(Fbits(0x7ff8000000000000) == Fbits(0x7ff8000000000000));
  CHECK_FALSE(Fbits(0x7ff8000000000000) == Fbits(0x7ff8000000000001));
  CHECK_FALSE(F(0.0) == F(-0.0));
  CHECK_FALSE(I(1) == Bo(true));
  CHECK_FALSE(L() == T());
}

TEST_CASE("pickle_value: one variant alternative per kind; copies never change each other") {
  using k = pv::kind;
  const std::vector<std::pair<pv, k>> kinds = {{N(), k::none},
                                               {Bo(true), k::boolean},
                                               {I(-3), k::integer},
                                               {F(2.5), k::real},
                                               {S("s"), k::string},
                                               {L({I(1)}), k::list},
                                               {T({I(1)}), k::tuple},
                                               {D({{S("a"), I(1)}}), k::dict},
                                               {pv::byte_string("b"), k::bytes},
                                               {pv::set_of({I(1)}, true), k::set}};
  for (const auto& [v, want] : kinds) {
    INFO(pv::kind_name(want));
    CHECK(v.type() == want);
    CHECK(v.as_variant().index() == static_cast<std::size_t>(want));
  }
  CHECK(std::get<std::int64_t>(I(-3).as_variant()) == -3);
  CHECK(std::get<std::string>(S("s").as_variant()) == "s");
  CHECK(std::get<std::shared_ptr<pickle_dict>>(D({{S("a"), I(1)}}).as_variant())->entries.size() == 1);
  // a copy shares the container until one of them is changed
  const pv inner = L({I(1), I(2)});
  pv a = D({{S("x"), inner}, {S("y"), I(0)}});
  pv b = a;
  CHECK(&a.dict_value(0) == &b.dict_value(0));
  b.set("y", I(5));
  b.set("z", inner);
  CHECK(a == D({{S("x"), L({I(1), I(2)})}, {S("y"), I(0)}}));
  CHECK(b == D({{S("x"), L({I(1), I(2)})}, {S("y"), I(5)}, {S("z"), L({I(1), I(2)})}}));
  CHECK(a.dict_size() == 2);
  CHECK(b.dict_size() == 3);
  // a value nobody else holds is changed in place
  const pv* before = &b.dict_value(0);
  b.set("y", I(6));
  CHECK(&b.dict_value(0) == before);
  CHECK(b.at("y", "b") == I(6));
}

namespace {

// A policy for the hook tests: reads SHORT_BINBYTES (0x43 'C', a length byte and the bytes) as
// the str of their hex digits and EMPTY_SET (0x8f) as an empty list; every other opcode outside
// plain data is left to the reader, which refuses it. Counts what it was asked.
struct bytes_as_hex {
  std::vector<std::pair<unsigned, std::size_t>>* asked;
  template <class Reader>
  bool on_opcode(Reader& r, unsigned char op, std::size_t at) {
    asked->emplace_back(op, at);
    if (op == 'C') {
      const auto n = static_cast<unsigned char>(r.take(1)[0]);
      r.push(S(hex(std::string(r.take(n)))));
      return true;
    }
    if (op == 0x8f) {
      r.push(L({I(7)}));
      return true;
    }
    return false;
  }
};
static_assert(PickleOpcodePolicy<bytes_as_hex>);
static_assert(PickleOpcodePolicy<plain_data_only>);

}  // namespace

TEST_CASE("pickle: an opcode policy sees the opcodes outside plain data, and may read them") {
  std::vector<std::pair<unsigned, std::size_t>> asked;
  const bytes_as_hex policy{&asked};
  // handled: SHORT_BINBYTES inside a tuple, and a pushed list that APPEND then adds to
  CHECK(pickle_loads(P(B({'K', 1, 'C', 2, 0xab, 0x01, 0x86})), what, policy) == T({I(1), S("ab01")}));
  CHECK(asked == std::vector<std::pair<unsigned, std::size_t>>{{'C', 4}});
  CHECK(pickle_loads(P(B({0x8f, 'K', 8, 'a'})), what, policy) == L({I(7), I(8)}));
  // truncated inside a handled opcode's argument: the reader's own message
  asked.clear();
  try {
    (void)pickle_loads(P(B({'C', 5, 0xab})), what, policy);
    FAIL("no error");
  } catch (const shardsafe::error& e) {
    CHECK(std::string(e.what()) == what + ": pickle is truncated (needs 5 bytes at byte 4)");
  }
  // not handled: refused exactly as without a policy, after asking it
  asked.clear();
  const std::string reduce = P(B({')', ')', 'R'}));
  std::string with, without;
  try {
    (void)pickle_loads(reduce, what, policy);
  } catch (const shardsafe::error& e) {
    with = e.what();
  }
  try {
    (void)pickle_loads(reduce, what);
  } catch (const shardsafe::error& e) {
    without = e.what();
  }
  CHECK(asked == std::vector<std::pair<unsigned, std::size_t>>{{'R', 4}});
  CHECK(with == without);
  CHECK(with.find("unsupported opcode 0x52 (REDUCE) at byte 4") != std::string::npos);
  // the plain reader never asks about plain data
  asked.clear();
  const pv plain = D({{S("lr"), F(0.5)}, {S("betas"), T({F(0.9), F(0.99)})}, {S("params"), L({I(0), N(), Bo(true)})}});
  CHECK(pickle_loads(pickle_dumps(plain), what, policy) == plain);
  CHECK(asked.empty());
}

TEST_CASE("pickle: a container changed after it was counted is counted again (run(f) reads in place)") {
  // A policy that pops REDUCE's operands (counting them, as every pop does) and pushes None.
  struct reduce_to_none {
    bool on_opcode(basic_pickle_reader<reduce_to_none>& r, unsigned char op, std::size_t) {
      if (op != 'R') return false;
      (void)r.pop_value();
      (void)r.pop_value();
      r.push(pickle_value::none());
      return true;
    }
  };
  // L = []; REDUCE(None, (L,)) counts L (1 value); then L.append(D) where D is a chain of 40
  // tuples (A, A), each doubling the one before: L now expands to 2^41 values. A count kept from
  // before the APPEND would let the in-place walk below expand it.
  std::vector<unsigned char> b{']', 'q', 0, 'N', 'h', 0, 0x85, 'R', '0', 'K', 0};
  for (int i = 0; i < 40; ++i) b.insert(b.end(), {'q', 1, 'h', 1, 0x86});
  b.push_back('a');
  const std::string bytes = P(std::string(b.begin(), b.end()));
  std::uint64_t walked = 0;
  try {
    basic_pickle_reader<reduce_to_none> r(bytes, what);
    r.run([&](pickle_view v) {
      walked = v.size();
      return 0;
    });
    FAIL("no error");
  } catch (const shardsafe::error& e) {
    CHECK(e.code() == make_error_code(errc::invalid_metadata));
    CHECK(std::string(e.what()).find("expands to more than") != std::string::npos);
  }
  CHECK(walked == 0);  // refused before the view is handed out
  // the same list without the doubling chain is read, in place and as a copy
  const std::string small = P(B({']', 'q', 0, 'N', 'h', 0, 0x85, 'R', '0', 'K', 7, 'a'}));
  basic_pickle_reader<reduce_to_none> r(small, what);
  const auto n = r.run([](pickle_view v) { return v.size() == 1 && v.item(0).as_int("") == 7; });
  CHECK(n);
  CHECK(pickle_loads(small, what, reduce_to_none{}) == L({I(7)}));
}

TEST_CASE("pickle: Python 3 loads what pickle_dumps writes" * python_check()) {
  REQUIRE_PYTHON();
  temp_dir dir;
  const auto cs = cases();
  std::vector<std::string> args{(dir.path / "out.txt").string()};
  for (std::size_t i = 0; i < cs.size(); ++i) {
    const auto p = dir.path / ("ours_" + std::to_string(i) + ".pkl");
    write_file(p, pickle_dumps(cs[i].value));
    args.push_back(p.string());
  }
  // Also the bytes Python itself writes with protocol 2, without its memo PUTs.
  const std::string script = py_canon + R"PY(
with open(sys.argv[1], 'w', encoding='utf-8') as out:
    for path in sys.argv[2:]:
        with open(path, 'rb') as f:
            data = f.read()
        v = pickle.loads(data)
        out.write(repr(v) + '\n')
        out.write(canon(v) + '\n')
        out.write(pickletools.optimize(pickle.dumps(v, 2)).hex() + '\n')
)PY";
  const auto r = python(script, args);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const auto lines = lines_of(slurp(dir.path / "out.txt"));
  REQUIRE(lines.size() == 3 * cs.size());
  std::size_t same_bytes = 0, compared_bytes = 0;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    const auto& c = cs[i];
    INFO(c.expr);
    CHECK(lines[3 * i] == (c.repr.empty() ? c.expr : c.repr));
    CHECK(lines[3 * i + 1] == canon(c.value));
    // Python's own protocol 2 bytes, less its memo PUTs, are what we write.
    ++compared_bytes;
    same_bytes += lines[3 * i + 2] == hex(pickle_dumps(c.value));
    CHECK(lines[3 * i + 2] == hex(pickle_dumps(c.value)));
  }
  MESSAGE("Python loaded " << cs.size() << " pickles; " << same_bytes << " of " << compared_bytes
                           << " are byte-identical to Python's own protocol 2 (memo PUTs optimized away)");
}

TEST_CASE("pickle: pickle_loads reads what Python 3 writes with protocols 2 to 5" * python_check()) {
  REQUIRE_PYTHON();
  temp_dir dir;
  auto cs = cases();
  // shared references: Python memoizes each object once and refers back to it
  cs.push_back(
      {D({{S("a"), L({I(1), I(2)})}, {S("b"), L({I(1), I(2)})}, {S("c"), T({L({I(1), I(2)}), L({I(1), I(2)})})}}),
       "(lambda l: {'a': l, 'b': l, 'c': (l, l)})([1, 2])", ""});
  cs.push_back(
      {L({S("sharedshared"), S("sharedshared"), S("sharedshared")}), "(lambda s: [s, s, s])('shared' * 2)", ""});
  cs.push_back({L({D({{S("k"), F(1.5)}}), D({{S("inner"), D({{S("k"), F(1.5)}})}})}),
                "(lambda d: [d, {'inner': d}])({'k': 1.5})", ""});
  cs.push_back({T({T({I(1), I(2)}), T({I(1), I(2)})}), "(lambda t: (t, t))((1, 2))", ""});
  // what must be refused: cycles, blow-ups, ints past 64 bits, types that are not plain data
  struct refused_case {
    std::string expr;
    std::string phrase;
    int min_protocol = 2;
    int max_protocol = 5;
  };
  const std::vector<refused_case> refused = {
      {"(lambda l: (l.append(l), l)[1])([])", "contains itself"},
      {"(lambda d: (d.__setitem__('me', d), d)[1])({})", "contains itself"},
      {"(lambda t: (t[0].append(t), t)[1])(([],))", "contains itself"},
      {"(lambda l: (l.append((l, 1)), l)[1])([])", "contains itself"},
      {"functools.reduce(lambda a, _: [a, a], range(30), [1])", "expands to more than"},
      {"(sys.setrecursionlimit(5000), functools.reduce(lambda a, _: [a], range(1200), []))[1]",
       "nests deeper than 1000"},
      {"2 ** 64", "does not fit 64 bits"},
      {"-2 ** 63 - 1", "does not fit 64 bits"},
      {"b'bytes'", "(GLOBAL)", 2, 2},  // _codecs.encode
      {"b'bytes'", "(SHORT_BINBYTES)", 3, 5},
      {"{1, 2}", "(GLOBAL)", 2, 3},
      {"{1, 2}", "(EMPTY_SET)", 4, 5},
      {"frozenset([1])", "(FROZENSET)", 4, 5},
      {"complex(1, 2)", "(GLOBAL)", 2, 3},
      {"complex(1, 2)", "(STACK_GLOBAL)", 4, 5},
      {"bytearray(b'x')", "(BYTEARRAY8)", 5, 5},
      {"collections.OrderedDict(a=1)", "(GLOBAL)", 2, 3},
      {"collections.OrderedDict(a=1)", "(STACK_GLOBAL)", 4, 5},
  };
  std::string exprs;
  for (const auto& c : cs) exprs += c.expr + "\n";
  for (const auto& r : refused) exprs += r.expr + "\n";
  write_file(dir.path / "exprs.txt", exprs);
  const std::string script = py_canon + R"PY(
import collections
d = sys.argv[1]
with open(d + '/exprs.txt', encoding='utf-8') as f:
    exprs = f.read().split('\n')[:-1]
for i, e in enumerate(exprs):
    v = eval(e)
    for p in range(0, 6):
        with open('%s/py_%d_%d.pkl' % (d, i, p), 'wb') as f:
            f.write(pickle.dumps(v, protocol=p))
)PY";
  const auto r = python(script, {dir.path.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  auto file = [&](std::size_t i, int p) {
    return slurp(dir.path / ("py_" + std::to_string(i) + "_" + std::to_string(p) + ".pkl"));
  };
  std::size_t loaded = 0, old_loaded = 0, old_refused = 0;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    for (int p = 2; p <= 5; ++p) {
      INFO(cs[i].expr << " protocol " << p);
      const std::string bytes = file(i, p);
      REQUIRE(!bytes.empty());
      try {
        const pv v = pickle_loads(bytes, what);
        CHECK(canon(v) == canon(cs[i].value));
        CHECK(v == cs[i].value);
        ++loaded;
      } catch (const shardsafe::error& e) {
        FAIL("refused: " << e.what());
      }
    }
    // protocols 0 and 1 are outside the contract (text opcodes): a value or a clean refusal
    for (int p = 0; p <= 1; ++p) {
      INFO(cs[i].expr << " protocol " << p);
      try {
        const pv v = pickle_loads(file(i, p), what);
        CHECK(v == cs[i].value);
        ++old_loaded;
      } catch (const shardsafe::error& e) {
        CHECK_MESSAGE(e.code() == errc::invalid_metadata, e.what());
        ++old_refused;
      }
    }
  }
  std::size_t refusals = 0;
  for (std::size_t j = 0; j < refused.size(); ++j) {
    const auto& rc = refused[j];
    for (int p = rc.min_protocol; p <= rc.max_protocol; ++p) {
      INFO(rc.expr << " protocol " << p);
      const std::string bytes = file(cs.size() + j, p);
      const auto used = allocated_by([&] { expect_refused(bytes, {rc.phrase}); });
      CHECK_MESSAGE(used < one_mib + 256 * bytes.size(), "allocated ", used, " bytes for ", bytes.size());
      ++refusals;
    }
  }
  MESSAGE("read " << loaded << " Python pickles (protocols 2-5) equal to the expected values; refused " << refusals
                  << " as expected; protocols 0/1: " << old_loaded << " read, " << old_refused << " refused cleanly");
}

// --- metadata.json and model.safetensors.index.json against json.dumps -------------------

TEST_CASE("pickle_repr: a value as Python's repr() writes it, cut to the characters asked" * python_check()) {
  REQUIRE_PYTHON();
  // each value pickled by Python and its repr(), both as hex: the pickle read here must print so
  const std::string script = R"PY(
values = [None, True, False, 0, -7, 2 ** 62, -2 ** 63, 0.0, -0.0, 1.0, 0.1, 1e-05, 0.0001, 0.00025, 100000.0, 1e15,
          1e16, 1.5e16, 1.2345678901234568e+17, 123.456, -2.5e-07, 5e-324, 1.7976931348623157e+308, float("inf"),
          float("-inf"), float("nan"), "adam", "it's", 'say "hi"', "both ' and \"", "tab\tnew\nline\r", "back\\slash",
          "\x01\x7f", "\u00e9t\u00e9", "", [], (), {}, (1,), (0.9, 0.999), [0, 1, [2, (3,)]], {"a": 1, 2: [None]},
          {"lr": 0.001, "betas": (0.9, 0.95), "params": [0, 1, 2]}]
for v in values:
    print(pickle.dumps(v, protocol=2).hex(), repr(v).encode("utf-8").hex())
)PY";
  const auto r = python("import pickle\n" + script, {});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  auto unhex = [](std::string_view h) {
    std::string b;
    for (std::size_t i = 0; i + 1 < h.size(); i += 2)
      b += static_cast<char>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16));
    return b;
  };
  std::size_t n = 0;
  for (const auto& line : lines_of(r.out)) {
    const auto sp = line.find(' ');
    REQUIRE(sp != std::string::npos);
    const pickle_value v = pickle_loads(unhex(std::string_view(line).substr(0, sp)), "Python's pickle");
    const std::string want = unhex(std::string_view(line).substr(sp + 1));
    CHECK(pickle_repr(v, 1000) == want);
    // cut: at most the characters asked, "..." at the end where it is cut and 3 or more are asked
    for (std::size_t cap : {0, 2, 3, 5, 12}) {
      const std::string cut = pickle_repr(v, cap);
      CHECK(cut.size() <= cap);
      if (want.size() <= cap)
        CHECK(cut == want);
      else if (cap >= 3)
        CHECK(cut == want.substr(0, cap - 3) + "...");
    }
    ++n;
  }
  CHECK(n == 43);
}

TEST_CASE("metadata and HF index: non-ASCII names are escaped exactly as Python's json.dumps does" * python_check()) {
  REQUIRE_PYTHON();
  temp_dir dir;
  checkpoint_metadata md;
  md.tensors.emplace_back("w\xc3\xa9ight",
                          tensor_metadata{{4}, dtype::F32, false, {{"rank_0.safetensors", flat_spec{{0, 4}}}}, {}});
  md.tensors.emplace_back("\xe5\xb1\x82.bias", tensor_metadata{{2, 3},
                                                               dtype::BF16,
                                                               true,
                                                               {{"rank_0.safetensors", block_spec({1, 3}, {0, 0})},
                                                                {"rank_1.safetensors", block_spec({1, 3}, {1, 0})}},
                                                               {}});
  md.tensors.emplace_back("emoji\xf0\x9f\x98\x80",
                          tensor_metadata{{}, dtype::F64, false, {{"rank_0.safetensors", block_spec({}, {})}}, {}});
  md.tensors.emplace_back("ctl\x7f\x01\t\"\\/",
                          tensor_metadata{{1}, dtype::I64, false, {{"rank_0.safetensors", flat_spec{{0, 1}}}}, {}});
  md.tensors.emplace_back(
      "\xef\xbc\x81"
      "full\xc2\x80\xdf\xbf",
      tensor_metadata{{2}, dtype::U8, false, {{"rank_0.safetensors", flat_spec{{0, 2}}}}, {}});
  md.extras.writer = "shardsafe 0.1.0 \xe2\x9c\x93";
  md.extras.world_size = 2;
  md.extras.file_sizes = {{"rank_0.safetensors", 123}, {"r\xc3\xa9.safetensors", 7}};

  hf_index idx;
  idx.total_size = 1234;
  idx.metadata = {{"format", "pt"}, {"\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87", "\xd0\xb7\xd0\xbd\xd0\xb0\xd1\x87"}};
  idx.weight_map = {{"w\xc3\xa9ight", "model-00001-of-00002.safetensors"},
                    {"\xe5\xb1\x82.bias", "model-00002-of-00002.safetensors"},
                    {"emoji\xf0\x9f\x98\x80", "model-00001-of-00002.safetensors"},
                    {"\xef\xbc\x81"
                     "full",
                     "\xc3\xa9.safetensors"},
                    {"Zed", "model-00002-of-00002.safetensors"},
                    {"a", "model-00001-of-00002.safetensors"},
                    {"del\x7f", "model-00001-of-00002.safetensors"}};
  hf_index empty;

  // The same dicts written by hand in Python, with \u escapes only.
  const std::string script = R"PY(
import json, sys
md = {"tensors": {
  "w\u00e9ight": {"shape": [4], "is_sharded": False, "dtype": "F32", "shard_spec_per_file": {
    "rank_0.safetensors": {"flattened_offsets": [[0, 4]], "local_shape": None, "global_offset": None}}},
  "\u5c42.bias": {"shape": [2, 3], "is_sharded": True, "dtype": "BF16", "shard_spec_per_file": {
    "rank_0.safetensors": {"flattened_offsets": None, "local_shape": [1, 3], "global_offset": [0, 0]},
    "rank_1.safetensors": {"flattened_offsets": None, "local_shape": [1, 3], "global_offset": [1, 0]}}},
  "emoji\U0001f600": {"shape": [], "is_sharded": False, "dtype": "F64", "shard_spec_per_file": {
    "rank_0.safetensors": {"flattened_offsets": None, "local_shape": [], "global_offset": []}}},
  "ctl\x7f\x01\t\"\\/": {"shape": [1], "is_sharded": False, "dtype": "I64", "shard_spec_per_file": {
    "rank_0.safetensors": {"flattened_offsets": [[0, 1]], "local_shape": None, "global_offset": None}}},
  "\uff01full\u0080\u07ff": {"shape": [2], "is_sharded": False, "dtype": "U8", "shard_spec_per_file": {
    "rank_0.safetensors": {"flattened_offsets": [[0, 2]], "local_shape": None, "global_offset": None}}}},
  "shardsafe": {"writer": "shardsafe 0.1.0 \u2713", "world_size": 2,
                "file_sizes": {"rank_0.safetensors": 123, "r\u00e9.safetensors": 7}}}
idx = {"metadata": {"total_size": 1234, "format": "pt", "\u043a\u043b\u044e\u0447": "\u0437\u043d\u0430\u0447"},
       "weight_map": {"w\u00e9ight": "model-00001-of-00002.safetensors",
                      "\u5c42.bias": "model-00002-of-00002.safetensors",
                      "emoji\U0001f600": "model-00001-of-00002.safetensors",
                      "\uff01full": "\u00e9.safetensors",
                      "Zed": "model-00002-of-00002.safetensors",
                      "a": "model-00001-of-00002.safetensors",
                      "del\x7f": "model-00001-of-00002.safetensors"}}
empty = {"metadata": {}, "weight_map": {}}
d = sys.argv[1]
with open(d + '/metadata.json', 'w', encoding='ascii', newline='') as f:
    f.write(json.dumps(md))
with open(d + '/index.json', 'w', encoding='ascii', newline='') as f:
    f.write(json.dumps(idx, indent=2, sort_keys=True) + "\n")
with open(d + '/empty.json', 'w', encoding='ascii', newline='') as f:
    f.write(json.dumps(empty, indent=2, sort_keys=True) + "\n")
)PY";
  const auto r = python(script, {dir.path.string()});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const std::string ours_md = write_checkpoint_metadata(md);
  CHECK(ours_md == slurp(dir.path / "metadata.json"));
  CHECK(write_hf_index(idx) == slurp(dir.path / "index.json"));
  CHECK(write_hf_index(empty) == slurp(dir.path / "empty.json"));
  // and what we write reads back to the same names
  const auto back = parse_checkpoint_metadata(ours_md, "metadata.json");
  REQUIRE(back.tensors.size() == md.tensors.size());
  for (std::size_t i = 0; i < md.tensors.size(); ++i) CHECK(back.tensors[i].first == md.tensors[i].first);
  CHECK(back.extras.writer == md.extras.writer);
  CHECK(back.extras.file_sizes == md.extras.file_sizes);
  CHECK(parse_hf_index(write_hf_index(idx), "index.json").weight_map == idx.weight_map);
}

namespace {

/// K 1, then n times MEMOIZE, DUP, TUPLE2 (x -> (x, x)), then padding pairs of None and POP up
/// to `size` bytes: a tuple of depth n whose two items are one shared tuple, 2^(n+1) - 1 values
/// when walked as a tree.
std::string doubling_chain(int n, std::size_t size = 0) {
  std::string b = B({0x80, 4, 'K', 1});
  for (int i = 0; i < n; ++i) b += B({0x94, '2', 0x86});
  while (b.size() + 3 <= size) b += B({'N', '0'});
  return b + ".";
}

/// The address of the container a list or tuple value holds.
const void* container_address(const pv& v) {
  if (auto* t = std::get_if<std::shared_ptr<pickle_tuple>>(&v.as_variant())) return t->get();
  if (auto* l = std::get_if<std::shared_ptr<pickle_list>>(&v.as_variant())) return l->get();
  return nullptr;
}

}  // namespace

TEST_CASE(
    "pickle: shared references stay shared; what a DUP/MEMOIZE/TUPLE chain may expand to is bounded by its size") {
  // 12 doublings in a 1 KB input: 8191 values as a tree, 12 containers in memory
  const std::string kb = doubling_chain(12, 1000);
  CHECK(kb.size() >= 997);
  pv v;
  const auto used = allocated_by([&] { v = pickle_loads(kb, what); });
  CHECK_MESSAGE(used < one_mib, "allocated ", used, " bytes");  // 12 tuples, not 8191 values
  const pv* x = &v;
  int depth = 0;
  while (x->type() == pv::kind::tuple) {
    const auto& items = x->as_sequence("");
    REQUIRE(items.size() == 2);
    CHECK(container_address(items[0]) == container_address(items[1]));  // one tuple, held twice
    x = &items[0];
    ++depth;
  }
  CHECK(depth == 12);
  CHECK(*x == I(1));
  // equal to the tree Python would build, value for value
  pv tree = I(1);
  for (int i = 0; i < 12; ++i) tree = T({tree, tree});
  CHECK(v == tree);
  // through the memo (BINGET) as through DUP
  std::string m = B({0x80, 2, ']', 'q', 0, 'K', 7, 'a', '0'});
  for (int i = 1; i <= 8; ++i) m += B({'(', 'h', i - 1, 'h', i - 1, 'l', 'q', i, '0'});
  const pv lv = pickle_loads(m + B({'h', 8, '.'}), what);
  CHECK(container_address(lv.as_sequence("")[0]) == container_address(lv.as_sequence("")[1]));
  // past 64 values per input byte (plus 4096) it is refused at once: 2^20 values from 64 bytes,
  // which the reader once built as a tree of ~87 MB; and 2^17 from a 1 KB input
  for (const int n : {19, 16}) {
    const std::string bytes = n == 19 ? doubling_chain(19) : doubling_chain(16, 1000);
    INFO(n << " doublings in " << bytes.size() << " bytes");
    const auto refused = allocated_by([&] {
      expect_refused(bytes, {"expands to more than " + std::to_string(64 * bytes.size() + 4096) + " values"});
    });
    CHECK_MESSAGE(refused < one_mib, "allocated ", refused, " bytes");
  }
}

TEST_CASE("pickle: a FRAME that declares more bytes than follow is refused as truncated") {
  // FRAME at byte 2 declaring 9 bytes; 7 follow (SHORT_BINUNICODE 'abc', MEMOIZE, STOP)
  const std::string body = B({0x8c, 3, 'a', 'b', 'c', 0x94, '.'});
  auto framed = [&](int n) { return B({0x80, 4, 0x95, n, 0, 0, 0, 0, 0, 0, 0}) + body; };
  expect_refused(framed(9), {"is truncated", "a FRAME at byte 2 declares 9 bytes, 7 follow"});
  expect_refused(framed(8), {"is truncated", "declares 8 bytes, 7 follow"});
  CHECK(pickle_loads(framed(7), what) == S("abc"));
  CHECK(pickle_loads(framed(3), what) == S("abc"));  // a frame ending early: Python reads on too
  // a length past 2^63
  expect_refused(B({0x80, 4, 0x95, 0, 0, 0, 0, 0, 0, 0, 0x80}) + body, {"is truncated"});
}

TEST_CASE("pickle: Python refuses the truncated FRAME too, and shares what a DUP chain shares" * python_check()) {
  REQUIRE_PYTHON();
  const std::string script = R"PY(
import pickle, sys
try:
    pickle.loads(bytes.fromhex(sys.argv[1]))
    sys.exit(1)
except pickle.UnpicklingError as e:
    assert 'truncated' in str(e), e
assert pickle.loads(bytes.fromhex(sys.argv[2])) == 'abc'
t = pickle.loads(bytes.fromhex(sys.argv[3]))
d = 0
while type(t) is tuple:
    assert t[0] is t[1]
    t = t[0]
    d += 1
assert d == 12 and t == 1, (d, t)
)PY";
  const std::string body = B({0x8c, 3, 'a', 'b', 'c', 0x94, '.'});
  const auto r =
      python(script, {hex(B({0x80, 4, 0x95, 9, 0, 0, 0, 0, 0, 0, 0}) + body),
                      hex(B({0x80, 4, 0x95, 7, 0, 0, 0, 0, 0, 0, 0}) + body), hex(doubling_chain(12, 1000))});
  CHECK_MESSAGE(r.code == 0, r.err);
}
