// Groundwork of the Hugging Face interop (issue 10): dtype conversion (core/convert.hpp),
// rename rules and LoRA names (format/rename.hpp), the export plan (format/hf_export.hpp).
// Values are checked against computations written here independently of the headers, and
// against Python (struct's 'e' format, json.dumps, re.sub; torch for BF16) when it runs.
#include "shardsafe/core/convert.hpp"
#include "shardsafe/format/hf_export.hpp"
#include "shardsafe/format/rename.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

#include "support/test_util.hpp"

using namespace shardsafe;

namespace {

// ---- helpers: bytes of little-endian values, and an independent rounding reference

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());  // the test machines are little-endian
  return b;
}

template <class T>
std::vector<T> values_of(const std::vector<std::byte>& b) {
  std::vector<T> v(b.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}

template <class To, class From>
std::vector<To> convert(dtype from, const std::vector<From>& v, dtype to) {
  std::vector<std::byte> out(v.size() * sizeof(To));
  const auto in = bytes_of(v);
  CHECK(convert_elements(from, in, to, out) == v.size());
  return values_of<To>(out);
}

/// F16 bits -> value, from the IEEE-754 binary16 definition.
double f16_value(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = m * std::pow(2.0, -24);
  else
    v = (1.0 + m / 1024.0) * std::pow(2.0, e - 15);
  return s ? -v : v;
}

/// BF16 bits -> value: by definition the top half of an F32.
double bf16_value(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

bool is_nan16(std::uint16_t h, int exp_bits) {
  const int mb = 15 - exp_bits;
  return ((h >> mb) & ((1 << exp_bits) - 1)) == (1 << exp_bits) - 1 && (h & ((1 << mb) - 1)) != 0;
}

/// Every finite non-negative value of a 16-bit format, ascending, with its bits, followed by
/// the value one step past the largest (2^(bias+1)) standing for infinity.
struct table16 {
  std::vector<std::pair<double, std::uint16_t>> up;
  std::uint16_t inf_bits;
};

table16 make_table(bool bf16) {
  table16 t;
  const std::uint16_t inf = bf16 ? 0x7f80 : 0x7c00;
  for (std::uint32_t b = 0; b < inf; ++b)
    t.up.emplace_back(bf16 ? bf16_value(static_cast<std::uint16_t>(b)) : f16_value(static_cast<std::uint16_t>(b)),
                      static_cast<std::uint16_t>(b));
  t.up.emplace_back(std::ldexp(1.0, bf16 ? 128 : 16), inf);
  t.inf_bits = inf;
  for (std::size_t i = 1; i < t.up.size(); ++i) REQUIRE(t.up[i - 1].first < t.up[i].first);
  return t;
}

/// Round-to-nearest-even by search: the two neighbours of |x| in the table, the midpoint
/// between them (exact in a double), ties to the neighbour with an even last bit.
std::uint16_t reference_round(double x, const table16& t) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (std::isinf(a) || a >= t.up.back().first) return sign | t.inf_bits;
  auto hi = std::upper_bound(t.up.begin(), t.up.end(), a, [](double v, const auto& e) { return v < e.first; });
  auto lo = std::prev(hi);
  if (lo->first == a) return sign | lo->second;
  const double mid = (lo->first + hi->first) / 2;
  if (a < mid) return sign | lo->second;
  if (a > mid) return sign | hi->second;
  return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

/// Values around every rounding boundary of the table: each value, each midpoint, and the
/// floats just below and above each midpoint; both signs. With `wide`, also doubles a hair
/// off each midpoint, that an F32 cannot hold (they catch rounding twice through F32).
std::vector<double> boundary_values(const table16& t, bool wide) {
  std::vector<double> v;
  for (std::size_t i = 0; i + 1 < t.up.size(); ++i) {
    const double lo = t.up[i].first, hi = t.up[i + 1].first, mid = (lo + hi) / 2;
    const float fm = static_cast<float>(mid);
    REQUIRE(static_cast<double>(fm) == mid);
    for (double x : {lo, mid, double(std::nextafter(fm, 0.0f)), double(std::nextafter(fm, INFINITY))}) {
      v.push_back(x);
      v.push_back(-x);
    }
    if (wide) {
      const double d = std::ldexp(mid, -40);
      for (double x : {mid - d, mid + d}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
  }
  return v;
}

std::vector<float> to_floats(const std::vector<double>& v) {
  std::vector<float> f;
  for (double x : v)
    if (static_cast<double>(static_cast<float>(x)) == x) f.push_back(static_cast<float>(x));
  return f;
}

// ---- Python cross-checks: run when python3 runs; SHARDSAFE_REQUIRE_PYTHON=1 makes a missing
// python3 a failure.

using testing::python_required;

using testing::run_python;

std::vector<std::uint32_t> parse_hex_lines(const std::string& text) {
  std::vector<std::uint32_t> v;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) v.push_back(static_cast<std::uint32_t>(std::stoul(line, nullptr, 16)));
  return v;
}

}  // namespace

// ============================================================ dtype conversion

TEST_CASE("convert: every F16 and BF16 bit pattern widens exactly and comes back bit for bit") {
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    const dtype t = bf16 ? dtype::BF16 : dtype::F16;
    std::vector<std::uint16_t> all(65536);
    for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
    const auto f32 = convert<float>(t, all, dtype::F32);
    const auto f64 = convert<double>(t, all, dtype::F64);
    const auto back32 = convert<std::uint16_t>(dtype::F32, f32, t);
    const auto back64 = convert<std::uint16_t>(dtype::F64, f64, t);
    int nans = 0;
    for (std::uint32_t i = 0; i < 65536; ++i) {
      const auto h = all[i];
      const double want = bf16 ? bf16_value(h) : f16_value(h);
      if (is_nan16(h, bf16 ? 8 : 5)) {
        ++nans;
        CHECK(std::isnan(f32[i]));
        CHECK(std::isnan(f64[i]));
        CHECK(std::signbit(f32[i]) == bool(h & 0x8000));
        CHECK(is_nan16(back32[i], bf16 ? 8 : 5));
        CHECK(is_nan16(back64[i], bf16 ? 8 : 5));
        CHECK((back32[i] & 0x8000) == (h & 0x8000));
        continue;
      }
      if (double(f32[i]) != want || f64[i] != want || std::signbit(f32[i]) != bool(h & 0x8000)) {
        FAIL_CHECK("bits " << h << " widened to " << f32[i] << " / " << f64[i] << ", want " << want);
      }
      if (back32[i] != h || back64[i] != h)
        FAIL_CHECK("bits " << h << " came back as " << back32[i] << " / " << back64[i]);
    }
    CHECK(nans == (bf16 ? 2 * 127 : 2 * 1023));
  }
}

TEST_CASE("convert: F32 and F64 to F16 and BF16 round to nearest even, as a search of every value does") {
  for (bool bf16 : {false, true}) {
    CAPTURE(bf16);
    const dtype t = bf16 ? dtype::BF16 : dtype::F16;
    const table16 table = make_table(bf16);
    // around every boundary, from F32 and (with doubles an F32 cannot hold) from F64
    const auto wide = boundary_values(table, true);
    std::vector<float> f = to_floats(wide);
    // and a stride through every F32 bit pattern (NaNs left to the next test)
    for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 7919) {
      const float x = std::bit_cast<float>(static_cast<std::uint32_t>(b));
      if (!std::isnan(x)) f.push_back(x);
    }
    f.push_back(INFINITY);
    f.push_back(-INFINITY);
    const auto got32 = convert<std::uint16_t>(dtype::F32, f, t);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < f.size(); ++i)
      if (got32[i] != reference_round(f[i], table) && ++bad < 10)
        FAIL_CHECK("F32 " << f[i] << " -> " << got32[i] << ", want " << reference_round(f[i], table));
    CHECK(bad == 0);
    const auto got64 = convert<std::uint16_t>(dtype::F64, wide, t);
    bad = 0;
    for (std::size_t i = 0; i < wide.size(); ++i)
      if (got64[i] != reference_round(wide[i], table) && ++bad < 10)
        FAIL_CHECK("F64 " << wide[i] << " -> " << got64[i] << ", want " << reference_round(wide[i], table));
    CHECK(bad == 0);
  }
}

TEST_CASE("convert: named cases of F16 and BF16 rounding, zeros, infinities and subnormals") {
  const auto h = [](std::vector<float> v) { return convert<std::uint16_t>(dtype::F32, v, dtype::F16); };
  const auto b = [](std::vector<float> v) { return convert<std::uint16_t>(dtype::F32, v, dtype::BF16); };
  const float tiny = std::ldexp(1.0f, -24);  // smallest F16 subnormal
  CHECK(h({0.0f, -0.0f, 1.0f, -2.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e9f, INFINITY, -INFINITY}) ==
        std::vector<std::uint16_t>{0x0000, 0x8000, 0x3c00, 0xc000, 0x7bff, 0x7bff, 0x7c00, 0xfc00, 0x7c00, 0x7c00,
                                   0xfc00});
  CHECK(h({tiny, tiny / 2, tiny * 0.75f, tiny * 1.5f, tiny * 2.5f, -tiny / 2,
           std::ldexp(1.0f, -14) * (1 - 1.0f / 2048)}) ==
        std::vector<std::uint16_t>{0x0001, 0x0000, 0x0001, 0x0002, 0x0002, 0x8000, 0x0400});
  // 1 + 2^-11 is the tie between 1 and 1 + 2^-10: even is 1; 1 + 3*2^-11 goes up to 1 + 2^-9
  CHECK(h({1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11)}) ==
        std::vector<std::uint16_t>{0x3c00, 0x3c02});
  CHECK(b({1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8), 1.0f / 3, -0.0f, std::ldexp(1.0f, -133),
           std::numeric_limits<float>::max()}) ==
        std::vector<std::uint16_t>{0x3f80, 0x3f82, 0x3eab, 0x8000, 0x0001, 0x7f80});
  // F64 -> F32: the hardware conversion (round to nearest even) is the reference
  std::mt19937_64 rng(7);
  std::vector<double> d;
  for (int i = 0; i < 20000; ++i) {
    double x = std::bit_cast<double>(rng());
    if (!std::isnan(x)) d.push_back(x);
  }
  for (int i = 0; i < 20000; ++i) d.push_back(std::ldexp(static_cast<double>(rng() >> 11), -int(rng() % 250) - 53));
  const auto f = convert<float>(dtype::F64, d, dtype::F32);
  for (std::size_t i = 0; i < d.size(); ++i)
    if (std::bit_cast<std::uint32_t>(f[i]) != std::bit_cast<std::uint32_t>(static_cast<float>(d[i])))
      FAIL_CHECK("F64 " << d[i] << " -> F32 " << f[i] << ", want " << static_cast<float>(d[i]));
}

TEST_CASE("convert: a NaN stays a NaN of its sign, made quiet, with the top of its payload") {
  const std::vector<std::uint32_t> nans{0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7fa12345u, 0xffffffffu};
  std::vector<float> f;
  for (auto n : nans) f.push_back(std::bit_cast<float>(n));
  const auto h = convert<std::uint16_t>(dtype::F32, f, dtype::F16);
  const auto b = convert<std::uint16_t>(dtype::F32, f, dtype::BF16);
  const auto d = convert<double>(dtype::F32, f, dtype::F64);
  for (std::size_t i = 0; i < nans.size(); ++i) {
    CAPTURE(nans[i]);
    const std::uint16_t sign = (nans[i] >> 31) ? 0x8000 : 0;
    const std::uint32_t man = nans[i] & 0x7fffff;
    CHECK(h[i] == (sign | 0x7c00 | 0x200 | (man >> 13)));
    CHECK(b[i] == (sign | 0x7f80 | 0x40 | (man >> 16)));
    CHECK(std::bit_cast<std::uint64_t>(d[i]) == ((std::uint64_t{sign != 0} << 63) | (std::uint64_t{0x7ff} << 52) |
                                                 (std::uint64_t{1} << 51) | (std::uint64_t{man} << 29)));
  }
}

TEST_CASE("convert: chunked conversion equals one pass; same dtype copies; in place when sizes match") {
  std::mt19937 rng(3);
  std::vector<float> f(1000);
  for (auto& x : f) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
  const auto src = bytes_of(f);
  std::vector<std::byte> whole(f.size() * 2), chunked(f.size() * 2);
  convert_elements(dtype::F32, src, dtype::BF16, whole);
  for (std::size_t at = 0, step = 1; at < f.size(); at += step, step = step * 2 + 1) {
    const std::size_t n = std::min(step, f.size() - at);
    convert_elements(dtype::F32, std::span(src).subspan(at * 4, n * 4), dtype::BF16,
                     std::span(chunked).subspan(at * 2, n * 2));
  }
  CHECK(whole == chunked);
  std::vector<std::int64_t> ints{1, -2, 1ll << 40};
  CHECK(convert<std::int64_t>(dtype::I64, ints, dtype::I64) == ints);
  std::vector<std::uint16_t> in_place{0x3c00, 0x7c00, 0x8001};  // F16 -> BF16 in the same bytes
  auto bytes = bytes_of(in_place);
  convert_elements(dtype::F16, bytes, dtype::BF16, bytes);
  CHECK(values_of<std::uint16_t>(bytes) == std::vector<std::uint16_t>{0x3f80, 0x7f80, 0xb380});
}

TEST_CASE("convert: integer and BOOL are never converted; sizes must match") {
  std::vector<std::byte> four(4), eight(8), two(2);
  CHECK_THROWS_WITH_AS(convert_elements(dtype::I32, four, dtype::F32, four),
                       doctest::Contains("cannot convert I32 to F32: I32 is not a floating dtype"), shardsafe::error);
  CHECK_THROWS_WITH_AS(convert_elements(dtype::BF16, two, dtype::BOOL, two),
                       doctest::Contains("cannot convert BF16 to BOOL: BOOL is not"), shardsafe::error);
  CHECK_THROWS_WITH_AS(require_convertible(dtype::I64, dtype::I32, "w.safetensors: tensor 'steps'"),
                       doctest::Contains("w.safetensors: tensor 'steps': cannot convert I64 to I32"), shardsafe::error);
  try {
    convert_elements(dtype::F8_E4M3, two, dtype::F16, four);
    FAIL("F8 converted");
  } catch (const shardsafe::error& e) {
    CHECK(e.code() == errc::unsupported_dtype);
  }
  CHECK_NOTHROW(require_convertible(dtype::BOOL, dtype::BOOL, "x"));
  CHECK_THROWS_WITH_AS(convert_elements(dtype::F32, std::span(eight).first(6), dtype::F16, four),
                       doctest::Contains("6 source bytes are not whole F32"), shardsafe::error);
  CHECK_THROWS_WITH_AS(convert_elements(dtype::F32, eight, dtype::F16, eight),
                       doctest::Contains("2 F32 elements need 4 bytes of F16, the destination has 8"),
                       shardsafe::error);
}

TEST_CASE("convert: F32 -> F16 agrees with Python's struct 'e', F32 -> BF16 with torch") {
  const table16 th = make_table(false), tb = make_table(true);
  std::vector<float> f = to_floats(boundary_values(th, false));
  std::vector<float> fb = to_floats(boundary_values(tb, false));
  std::mt19937 rng(11);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (!std::isnan(x)) {
      f.push_back(x);
      fb.push_back(x);
    }
  }
  auto hex_lines = [](const std::vector<float>& v) {
    std::string s;
    char buf[16];
    for (float x : v) {
      std::snprintf(buf, sizeof buf, "%08x\n", std::bit_cast<std::uint32_t>(x));
      s += buf;
    }
    return s;
  };
  // struct.pack('<e') raises OverflowError past the largest F16 where IEEE gives an infinity
  const std::string f16_script =
      "import struct,sys\n"
      "for l in open(sys.argv[1]):\n"
      "  x=struct.unpack('<f',bytes.fromhex(l.strip())[::-1])[0]\n"
      "  try: b=struct.unpack('<H',struct.pack('<e',x))[0]\n"
      "  except OverflowError: b=0xfc00 if x<0 else 0x7c00\n"
      "  print('%04x'%b)\n";
  if (auto out = run_python("python3", f16_script, hex_lines(f))) {
    const auto want = parse_hex_lines(*out);
    REQUIRE(want.size() == f.size());
    const auto got = convert<std::uint16_t>(dtype::F32, f, dtype::F16);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < f.size(); ++i)
      if (got[i] != want[i] && ++bad < 10) FAIL_CHECK("F32 " << f[i] << ": " << got[i] << ", Python " << want[i]);
    CHECK(bad == 0);
  }
  const std::string bf16_script =
      "import struct,sys,torch\n"
      "v=[struct.unpack('<f',bytes.fromhex(l.strip())[::-1])[0] for l in open(sys.argv[1])]\n"
      "for b in torch.tensor(v,dtype=torch.float32).to(torch.bfloat16).view(torch.int16).tolist():\n"
      "  print('%04x'%(b&0xffff))\n";
  if (auto out = run_python(testing::torch_python, bf16_script, hex_lines(fb))) {
    const auto want = parse_hex_lines(*out);
    REQUIRE(want.size() == fb.size());
    const auto got = convert<std::uint16_t>(dtype::F32, fb, dtype::BF16);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < fb.size(); ++i)
      if (got[i] != want[i] && ++bad < 10) FAIL_CHECK("F32 " << fb[i] << ": " << got[i] << ", torch " << want[i]);
    CHECK(bad == 0);
  }
}

// ============================================================ rename rules

TEST_CASE("rename: first matching rule wins, every match in the key replaced, no match keeps the name") {
  const rename_rules r({R"(^model\.model\.(.*)=\1)", R"(^a\.=b.)", R"(^a\.x=never)", R"(\.0\.=.zero.)"});
  CHECK(r.apply("model.model.layers.1.w") == "layers.1.w");
  CHECK(r.apply("a.x") == "b.x");  // the second rule matched first; the third is not tried
  CHECK(r.apply("l.0.x.0.y") == "l.zero.x.zero.y");
  CHECK(r.apply("lm_head.weight") == "lm_head.weight");
  CHECK(rename_rules().apply("k") == "k");
  CHECK(rename_rules({"x=$1"}).apply("axb") == "a$1b");                            // '$' is literal in REPL
  CHECK(rename_rules({R"(a\=b=c)"}).apply("a=b.w") == "c.w");                      // '\=' stands for '=' in REGEX
  CHECK(rename_rules({R"(^(\w+)\.(\w+)$=\2.\1=\\)"}).apply("p.q") == R"(q.p=\)");  // '=' and '\\' in REPL
}

TEST_CASE("rename: keys renamed to the empty name are dropped; two keys to one name is an error naming both") {
  const rename_rules r({R"(^lm_head\..*=)", R"(^model\.(.*)=\1)"});
  const auto m = rename_keys({"model.w", "lm_head.weight", "b"}, r, "export");
  CHECK(m == std::map<std::string, std::string>{{"w", "model.w"}, {"b", "b"}});
  CHECK_THROWS_WITH_AS(rename_keys({"model.w", "w"}, r, "export of ckpt/"),
                       "export of ckpt/: tensors 'model.w' and 'w' are both renamed to 'w'; rename rules must keep "
                       "names distinct",
                       shardsafe::error);
}

TEST_CASE("rename: rule syntax errors name the rule and what is wrong") {
  CHECK_THROWS_WITH_AS(parse_rename_rule("(abc=x"), doctest::Contains("rename rule '(abc=x': bad regex '(abc'"),
                       shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_rename_rule("abc"), "rename rule 'abc': no '=' between REGEX and REPL", shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_rename_rule("=x"), "rename rule '=x': empty REGEX", shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_rename_rule("(a)=\\2"), doctest::Contains("refers to group \\2 but the regex has 1"),
                       shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_rename_rule("a=\\n"), doctest::Contains("unknown escape '\\n'"), shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_rename_rule("a=b\\"), doctest::Contains("lone '\\'"), shardsafe::error);
  try {
    parse_rename_rule("[=x");
    FAIL("accepted");
  } catch (const shardsafe::error& e) {
    CHECK(e.code() == errc::invalid_argument);
  }
}

TEST_CASE(
    "rename: linear time (RE2): a 30,000-character name, and ^(a+)+$ that backtracking takes exponential time on") {
  const std::string tail(30000, 'x'), name = "model." + tail;
  CHECK(rename_rules({R"(^model\.(.*)=\1)"}).apply(name) ==
        tail);  // the README's rule (std::regex recursed per character)
  rename_rules preset;
  add_preset(preset, "dcp-to-hf");
  CHECK(preset.apply(name) == tail);
  const std::string evil = std::string(5000, 'a') + "b";
  CHECK(rename_rules({"^(a+)+$=x"}).apply(evil) == evil);
  CHECK(rename_rules({"^(a+)+$=x"}).apply(std::string(5000, 'a')) == "x");
  // what RE2 cannot run in linear time is refused by name: backreferences, lookarounds
  CHECK_THROWS_WITH_AS(parse_rename_rule(R"((a)\1=x)"), doctest::Contains("rename rule '(a)\\1=x': bad regex"),
                       shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_rename_rule(R"(a(?\=b)=x)"), doctest::Contains("bad regex"), shardsafe::error);
}

TEST_CASE("rename: rules give the names Python's re.sub gives") {
  const std::vector<std::pair<std::string, std::string>> rules{{R"(^model\.model\.(.*))", R"(\1)"},
                                                               {R"(\.(\d+)\.)", R"(.n\1.)"},
                                                               {R"(^(enc|dec)oder\.)", R"(\1.)"},
                                                               {R"(^drop\..*)", ""}};
  const std::vector<std::string> keys{"model.model.a.0.b", "x.12.y.3.z", "encoder.w", "decoder.layers.1.w",
                                      "drop.me",           "model.x",    "keep"};
  std::vector<std::string> texts;
  std::string input;
  for (const auto& [p, s] : rules) {
    texts.push_back(p + "=" + s);
    input += p + "\t" + s + "\n";
  }
  input += "--\n";
  for (const auto& k : keys) input += k + "\n";
  // first rule with a match wins: re.subn, stop when n > 0 (transformers' loop)
  const std::string script =
      "import re,sys\n"
      "rules,keys,sep=[],[],False\n"
      "for l in open(sys.argv[1]).read().split('\\n')[:-1]:\n"
      "  if l=='--': sep=True\n"
      "  elif sep: keys.append(l)\n"
      "  else: rules.append(l.split('\\t'))\n"
      "for k in keys:\n"
      "  for p,s in rules:\n"
      "    k2,n=re.subn(p,s,k)\n"
      "    if n>0: k=k2; break\n"
      "  print(k)\n";
  const rename_rules r(texts);
  if (auto out = run_python("python3", script, input)) {
    std::istringstream in(*out);
    for (const auto& k : keys) {
      std::string want;
      REQUIRE(std::getline(in, want));
      CHECK_MESSAGE(r.apply(k) == want, k);
    }
  }
}

TEST_CASE("rename: LoRA base-layer names map to the file's names and back") {
  CHECK(strip_base_layer("model.layers.0.q_proj.base_layer.weight") == "model.layers.0.q_proj.weight");
  CHECK(strip_base_layer("base_layer.bias") == "bias");
  CHECK(strip_base_layer("a.my_base_layer.w") == "a.my_base_layer.w");  // whole components only
  CHECK(strip_base_layer("plain.weight") == "plain.weight");
  CHECK(insert_base_layer("model.layers.0.q_proj.weight") == "model.layers.0.q_proj.base_layer.weight");
  CHECK(insert_base_layer("bias") == "base_layer.bias");
  for (std::string n : {"a.b.weight", "x.bias", "w"}) CHECK(strip_base_layer(insert_base_layer(n)) == n);
  CHECK(has_base_layer("q.base_layer.weight"));
  CHECK_FALSE(has_base_layer("q.weight"));
  CHECK(is_lora_adapter_name("q_proj.lora_A.default.weight"));
  CHECK(is_lora_adapter_name("emb.lora_embedding_B.default"));
  CHECK(is_lora_adapter_name("q.lora_magnitude_vector.default.weight"));
  CHECK_FALSE(is_lora_adapter_name("q_proj.base_layer.weight"));
  CHECK_FALSE(is_lora_adapter_name("flora_A.weight"));
}

// ============================================================ export plan

TEST_CASE("hf export: parse_size takes bytes, decimal and binary units, and names bad input") {
  CHECK(parse_size("5GB") == 5'000'000'000ull);
  CHECK(parse_size("500MB") == 500'000'000ull);
  CHECK(parse_size("4KB") == 4000);
  CHECK(parse_size("4096") == 4096);
  CHECK(parse_size("0") == 0);
  CHECK(parse_size("1KiB") == 1024);
  CHECK(parse_size("3MiB") == 3ull * 1024 * 1024);
  CHECK(parse_size("2GiB") == 2ull << 30);
  CHECK(parse_size("18446744073709551615") == ~0ull);
  for (const char* bad : {"", "GB", "5 GB", "5gb", "5G", "-1", "1.5GB", "5TB", "+4", "4KB "}) {
    const std::string want = "size '" + std::string(bad) + "': ";
    CHECK_THROWS_WITH_AS(parse_size(bad), doctest::Contains(want.c_str()), shardsafe::error);
  }
  CHECK_THROWS_WITH_AS(parse_size("18446744073709551616"), "size '18446744073709551616': too large", shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_size("20000000000GB"), "size '20000000000GB': too large", shardsafe::error);
  CHECK_THROWS_WITH_AS(parse_size("5Gb"), doctest::Contains("unknown unit 'Gb'"), shardsafe::error);
}

namespace {
/// transformers' shard_checkpoint loop, written out as in modeling_utils.py: a new block when
/// the weight would tip the last block over the limit and the last block is not empty.
std::vector<std::vector<std::string>> reference_shards(std::vector<std::pair<std::string, std::uint64_t>> sd,
                                                       std::uint64_t max) {
  std::sort(sd.begin(), sd.end());
  std::vector<std::vector<std::string>> blocks(1);
  std::uint64_t last = 0;
  for (const auto& [k, size] : sd) {
    if (last + size > max && !blocks.back().empty()) {
      blocks.emplace_back();
      last = 0;
    }
    blocks.back().push_back(k);
    last += size;
  }
  return blocks;
}
}  // namespace

TEST_CASE("hf export: tensors in name order packed as transformers' shard_checkpoint packs them") {
  // a: 40 bytes, b: 100 (past the limit of 64), c and d: 32 each
  const std::vector<hf_tensor_info> t{
      {"d", dtype::F32, {8}}, {"b", dtype::F64, {5, 2, 1}}, {"c", dtype::I64, {4}}, {"a", dtype::BF16, {20}}};
  const auto p = plan_hf_export(t, 64);
  REQUIRE(p.files.size() == 3);
  CHECK(p.total_size == 40 + 80 + 32 + 32);
  CHECK(p.files[0].name == "model-00001-of-00003.safetensors");
  CHECK(p.files[1].name == "model-00002-of-00003.safetensors");
  CHECK(p.files[2].name == "model-00003-of-00003.safetensors");
  CHECK(p.files[0].tensors == std::vector<std::size_t>{0});
  CHECK(p.files[1].tensors == std::vector<std::size_t>{1});
  CHECK(p.files[2].tensors == std::vector<std::size_t>{2, 3});
  CHECK(p.files[2].bytes == 64);  // exactly the limit still fits
  CHECK(p.tensors[2].name == "c");
  CHECK(p.indexed());
  const auto one = plan_hf_export(t, hf_default_max_shard_size);
  REQUIRE(one.files.size() == 1);
  CHECK(one.files[0].name == "model.safetensors");
  CHECK_FALSE(one.indexed());
  CHECK(plan_hf_export({}, 10).files.size() == 1);
  CHECK(hf_shard_file_name(99999, 100000) == "model-100000-of-100000.safetensors");

  // random sets against the reference, at limits below, at and above the largest tensor
  std::mt19937 rng(5);
  const dtype types[] = {dtype::BOOL, dtype::BF16, dtype::F32, dtype::I64, dtype::F8_E4M3};
  for (int round = 0; round < 200; ++round) {
    std::vector<hf_tensor_info> ts;
    std::vector<std::pair<std::string, std::uint64_t>> sd;
    const int n = 1 + static_cast<int>(rng() % 30);
    std::uint64_t largest = 0;
    for (int i = 0; i < n; ++i) {
      hf_tensor_info ti{
          "layer." + std::to_string(rng() % 1000) + "." + std::to_string(i), types[rng() % 5], {rng() % 7, rng() % 9}};
      const std::uint64_t bytes = ti.shape[0] * ti.shape[1] * (bit_size(ti.type) / 8);
      largest = std::max(largest, bytes);
      sd.emplace_back(ti.name, bytes);
      ts.push_back(ti);
    }
    for (std::uint64_t max : {std::uint64_t{0}, largest / 2, largest, largest * 3, std::uint64_t{1} << 40}) {
      const auto plan = plan_hf_export(ts, max);
      const auto want = reference_shards(sd, max);
      REQUIRE(plan.files.size() == want.size());
      std::uint64_t total = 0;
      for (std::size_t f = 0; f < want.size(); ++f) {
        std::vector<std::string> got;
        std::uint64_t bytes = 0;
        for (std::size_t i : plan.files[f].tensors) {
          got.push_back(plan.tensors[i].name);
          bytes += plan.bytes[i];
        }
        CHECK(got == want[f]);
        CHECK(plan.files[f].bytes == bytes);
        CHECK((bytes <= max || got.size() == 1));
        total += bytes;
      }
      CHECK(plan.total_size == total);
    }
  }
}

TEST_CASE("hf export: bad tensors are named") {
  CHECK_THROWS_WITH_AS(plan_hf_export({{"w", dtype::F32, {2}}, {"w", dtype::F16, {1}}}, 10),
                       "hf export: tensor 'w' is listed twice", shardsafe::error);
  CHECK_THROWS_WITH_AS(plan_hf_export({{"", dtype::F32, {2}}}, 10), "hf export: a tensor has an empty name",
                       shardsafe::error);
  CHECK_THROWS_WITH_AS(plan_hf_export({{"q", dtype::F4, {2}}}, 10),
                       doctest::Contains("hf export: tensor 'q': dtype F4"), shardsafe::error);
  CHECK_THROWS_WITH_AS(plan_hf_export({{"big", dtype::F64, {1ull << 62, 4}}}, 10),
                       doctest::Contains("hf export: tensor 'big': shape [4611686018427387904,4] F64 has more than"),
                       shardsafe::error);
}

TEST_CASE("hf export: the index text is what Python's json.dumps(indent=2, sort_keys=True) writes") {
  std::vector<hf_tensor_info> t{{"model.embed_tokens.weight", dtype::BF16, {16, 4}},
                                {"lm_head.weight", dtype::BF16, {16, 4}},
                                {"model.norm.weight", dtype::F32, {4}},
                                {"caf\xc3\xa9.\"q\"\\w", dtype::F32, {3}},
                                {"emoji.\xf0\x9f\x98\x80", dtype::I64, {2}},
                                {"Z.upper", dtype::BOOL, {5}}};
  for (std::uint64_t max : {std::uint64_t{1}, std::uint64_t{130}, std::uint64_t{1000}}) {
    CAPTURE(max);
    const auto p = plan_hf_export(t, max);
    std::string input = std::to_string(p.total_size) + "\t" + std::to_string(p.total_parameters) + "\n";
    for (const auto& [k, v] : p.weight_map()) input += k + "\t" + v + "\n";
    const std::string script =
        "import json,sys\n"
        "lines=open(sys.argv[1],encoding='utf-8').read().split('\\n')[:-1]\n"
        "wm=dict(l.split('\\t') for l in lines[1:])\n"
        "sys.stdout.write(json.dumps({'metadata':{'total_size':int(lines[0].split('\\t')[0]),"
        "'total_parameters':int(lines[0].split('\\t')[1])},'weight_map':wm},"
        "indent=2,sort_keys=True)+'\\n')\n";
    const std::string text = p.index_json();
    if (auto out = run_python("python3", script, input)) CHECK(text == *out);
    // and the library's own index parser reads it back
    const auto idx = parse_hf_index(text, "model.safetensors.index.json");
    CHECK(idx.total_size == p.total_size);
    CHECK(idx.total_parameters == p.total_parameters);
    CHECK(idx.weight_map == p.weight_map());
    CHECK(idx.weight_map.size() == t.size());
  }
  CHECK(plan_hf_export({}, 1).index_json() ==
        "{\n  \"metadata\": {\n    \"total_parameters\": 0,\n    \"total_size\": 0\n  },\n  \"weight_map\": {}\n}\n");
}

TEST_CASE("convert: the bit-level BF16 <-> F32 paths agree with the F64 definition, NaNs included") {
  // (a sweep of all 2^32 F32 patterns agreed when the fast path was written; here a stride
  // through them, every BF16 pattern, and the patterns around each exponent boundary)
  std::vector<std::uint32_t> f;
  for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 65521) f.push_back(static_cast<std::uint32_t>(b));
  for (std::uint32_t e = 0; e < 256; ++e)
    for (std::uint32_t low : {0u, 1u, 0x7fffu, 0x8000u, 0x8001u, 0x17fffu, 0x18000u, 0x7fffffu})
      for (std::uint32_t sign : {0u, 0x80000000u}) f.push_back(sign | (e << 23) | low);
  std::vector<std::uint16_t> fast(f.size()), slow(f.size());
  convert_elements(dtype::F32, std::as_bytes(std::span(f)), dtype::BF16, std::as_writable_bytes(std::span(fast)));
  detail::convert_elements_generic(dtype::F32, reinterpret_cast<const std::byte*>(f.data()), dtype::BF16,
                                   reinterpret_cast<std::byte*>(slow.data()), f.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < f.size(); ++i)
    if (fast[i] != slow[i] && ++bad < 10) FAIL_CHECK("F32 bits " << f[i] << ": " << fast[i] << " vs " << slow[i]);
  CHECK(bad == 0);
  std::vector<std::uint16_t> h(65536);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint16_t>(i);
  std::vector<std::uint32_t> wide(h.size()), wide_slow(h.size());
  convert_elements(dtype::BF16, std::as_bytes(std::span(h)), dtype::F32, std::as_writable_bytes(std::span(wide)));
  detail::convert_elements_generic(dtype::BF16, reinterpret_cast<const std::byte*>(h.data()), dtype::F32,
                                   reinterpret_cast<std::byte*>(wide_slow.data()), h.size());
  CHECK(wide == wide_slow);
}

TEST_CASE("rename preset dcp-to-hf: the seed rules, after the user's, in order") {
  rename_rules r({"^extra\\.keep$=kept"});
  add_preset(r, "dcp-to-hf");
  const rename_rule* by = nullptr;
  struct row {
    const char* key;
    const char* name;
    bool warned;
  };
  for (const row& x : std::initializer_list<row>{
           {"model.model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", false},
           {"model.lm_head.weight", "lm_head.weight", false},
           {"model._orig_mod.model.embed_tokens.weight", "model.embed_tokens.weight", false},
           {"model._fsdp_wrapped_module.model._checkpoint_wrapped_module.norm.weight", "model.norm.weight", false},
           {"model.lm_head.weight.extra", "lm_head.weight.extra", true},
           {"model.score.weight", "score.weight", true},
           {"optim.state.model.model.w.exp_avg", "", true},
           {"extra.keep", "kept", false},
           {"lm_head.weight", "", true}}) {
    CAPTURE(x.key);
    CHECK(r.apply(x.key, &by) == x.name);
    REQUIRE(by != nullptr);
    CHECK(!by->warning.empty() == x.warned);
  }
  CHECK_THROWS_WITH_AS(add_preset(r, "hf-to-dcp"), "rename preset 'hf-to-dcp': unknown (known: dcp-to-hf)",
                       shardsafe::error);
}
