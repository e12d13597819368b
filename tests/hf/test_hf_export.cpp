// Tests of the Hugging Face export (checkpoint/hf/export.hpp, checkpoint/hf/export_views.hpp):
// checkpoints saved from known full tensors, exported at several shard sizes and dtypes, and the
// files read back with this file's own plain safetensors and JSON parser (not the library's
// reader); values checked bit for bit against conversions written here; the index checked
// against Python's json.dumps with the packing loop written in Python; a 3-rank distributed
// export against the single-process one, byte for byte; torch's DCP-sharded HF folders of every
// byte-sized dtype consolidated bit for bit; the `to-hf` command of the tool.
#include "shardsafe/checkpoint/hf/export.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "support/checkpoint_fixtures.hpp"
#include "support/malformed_corpus.hpp"
#include "shardsafe/checkpoint/hf/export_views.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

namespace fs = std::filesystem;
using namespace shardsafe;
using testing::expect_error;
using testing::temp_dir;

namespace {

// ---------------------------------------------------------------- a plain JSON + safetensors parser

struct export_jvalue {
  std::variant<std::nullptr_t, std::uint64_t, std::string, std::vector<export_jvalue>,
               std::map<std::string, export_jvalue>>
      v;
  const std::map<std::string, export_jvalue>& obj() const { return std::get<4>(v); }
  const std::vector<export_jvalue>& arr() const { return std::get<3>(v); }
  const std::string& str() const { return std::get<2>(v); }
  std::uint64_t num() const { return std::get<1>(v); }
  const export_jvalue& at(const std::string& k) const { return obj().at(k); }
};

/// JSON of the subset these files use: objects, arrays, strings (with \" \\ \/ \n \uXXXX < 0x80
/// escapes), unsigned integers, null. Anything else fails the test.
struct jparser {
  std::string_view s;
  std::size_t i = 0;
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) ++i;
  }
  char peek() {
    ws();
    REQUIRE(i < s.size());
    return s[i];
  }
  void expect(char c) {
    REQUIRE(peek() == c);
    ++i;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      REQUIRE(i < s.size());
      char c = s[i++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      char e = s[i++];
      if (e == 'u') {
        const unsigned cp = static_cast<unsigned>(std::stoul(std::string(s.substr(i, 4)), nullptr, 16));
        i += 4;
        REQUIRE(cp < 0x80);
        out += static_cast<char>(cp);
      } else {
        out += e == 'n' ? '\n' : e;
      }
    }
  }
  export_jvalue value() {
    const char c = peek();
    if (c == '{') {
      ++i;
      std::map<std::string, export_jvalue> m;
      if (peek() == '}') return ++i, export_jvalue{std::move(m)};
      while (true) {
        std::string k = string();
        expect(':');
        REQUIRE(m.emplace(k, value()).second);
        if (peek() == '}') return ++i, export_jvalue{std::move(m)};
        expect(',');
      }
    }
    if (c == '[') {
      ++i;
      std::vector<export_jvalue> a;
      if (peek() == ']') return ++i, export_jvalue{std::move(a)};
      while (true) {
        a.push_back(value());
        if (peek() == ']') return ++i, export_jvalue{std::move(a)};
        expect(',');
      }
    }
    if (c == '"') return export_jvalue{string()};
    if (s.substr(i, 4) == "null") return i += 4, export_jvalue{nullptr};
    REQUIRE((c >= '0' && c <= '9'));
    std::uint64_t n = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') n = n * 10 + static_cast<std::uint64_t>(s[i++] - '0');
    return export_jvalue{n};
  }
};

export_jvalue parse_json(std::string_view text) {
  jparser p{text};
  export_jvalue v = p.value();
  p.ws();
  CHECK(p.i == text.size());
  return v;
}

struct parsed_tensor {
  std::string dtype;
  shape_t shape;
  std::string bytes;
};
struct parsed_file {
  std::map<std::string, std::string> metadata;
  std::map<std::string, parsed_tensor> tensors;
};

/// A safetensors file read by hand: the rules of docs/FORMAT.md §1 a writer must keep (data
/// aligned to 8, tensors tiling the buffer, aligned to their element size) checked on the way.
parsed_file parse_safetensors(const std::string& file) {
  REQUIRE(file.size() >= 8);
  std::uint64_t n = 0;
  for (int k = 0; k < 8; ++k) n |= std::uint64_t(static_cast<unsigned char>(file[k])) << (8 * k);
  REQUIRE(8 + n <= file.size());
  CHECK((8 + n) % 8 == 0);
  const export_jvalue h = parse_json(std::string_view(file).substr(8, n));
  parsed_file out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& [k, v] : h.obj()) {
    if (k == "__metadata__") {
      for (const auto& [mk, mv] : v.obj()) out.metadata[mk] = mv.str();
      continue;
    }
    parsed_tensor t;
    t.dtype = v.at("dtype").str();
    for (const auto& d : v.at("shape").arr()) t.shape.push_back(d.num());
    const auto& off = v.at("data_offsets").arr();
    const std::uint64_t b = off.at(0).num(), e = off.at(1).num();
    REQUIRE(b <= e);
    REQUIRE(8 + n + e <= file.size());
    t.bytes = file.substr(8 + n + b, e - b);
    spans.emplace_back(b, e);
    out.tensors.emplace(k, std::move(t));
  }
  std::sort(spans.begin(), spans.end());
  std::uint64_t at = 0;
  for (const auto& [b, e] : spans) {
    CHECK(b == at);
    at = e;
  }
  CHECK(8 + n + at == file.size());
  return out;
}

// ---------------------------------------------------------------- reference conversions

std::uint16_t f32_to_bf16(std::uint32_t u) {
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return std::uint16_t((u >> 16) | 0x0040u);
  return std::uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_f16(std::uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }
std::uint16_t to_f16(float f) { return std::bit_cast<std::uint16_t>(static_cast<_Float16>(f)); }

/// x as F32, rounded to odd (toward zero, then the last bit set when inexact): F32 keeps more
/// than two bits beyond BF16's, so a BF16 rounding of this is x rounded once.
float to_f32_round_to_odd(double x) {
  const int old = std::fegetround();
  std::fesetround(FE_TOWARDZERO);
  volatile double in = x;
  volatile float f = static_cast<float>(in);
  std::fesetround(old);
  const float t = f;
  if (std::isnan(x) || static_cast<double>(t) == x) return t;
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(t) | 1u);
}

template <class T>
std::vector<T> as(const std::string& b) {
  std::vector<T> v(b.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}
template <class T>
std::string export_bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

/// The bytes of `b` (a `from` tensor) converted to `to` as the export must: F16/BF16/F32 only.
std::string convert_ref(const std::string& b, const std::string& from, const std::string& to) {
  if (from == to) return b;
  std::vector<float> f;  // exact for every F16, BF16 and F32 value
  if (from == "F32") f = as<float>(b);
  if (from == "BF16")
    for (auto x : as<std::uint16_t>(b)) f.push_back(std::bit_cast<float>(std::uint32_t(x) << 16));
  if (from == "F16")
    for (auto x : as<std::uint16_t>(b)) f.push_back(from_f16(x));
  REQUIRE(f.size() * item_size(dtype_from_name(from, "")) == b.size());
  if (to == "F32") return export_bytes_of(f);
  std::vector<std::uint16_t> o;
  for (float x : f) o.push_back(to == "BF16" ? f32_to_bf16(std::bit_cast<std::uint32_t>(x)) : to_f16(x));
  return export_bytes_of(o);
}

// ---------------------------------------------------------------- the tensors of the tests

struct full_tensor {
  std::string name, dtype;
  shape_t shape;
  std::string bytes;
};

/// Random bytes of n elements of dtype d; floating values finite (no NaN, no infinity).
std::string random_values(const std::string& d, std::uint64_t n, std::mt19937_64& rng) {
  const std::size_t item = item_size(dtype_from_name(d, ""));
  std::string b = fixtures::random_string(n * item, rng);
  for (std::uint64_t k = 0; k < n; ++k) {
    char* p = b.data() + k * item;
    if (d == "F32") p[3] = static_cast<char>(p[3] & 0xbf);  // top exponent bit clear: finite
    if (d == "BF16") p[1] = static_cast<char>(p[1] & 0xbf);
    if (d == "F16") p[1] = static_cast<char>(p[1] & 0xbf);
    if (d == "BOOL") p[0] = static_cast<char>(p[0] & 1);
  }
  return b;
}

/// How rank r of 3 holds a tensor: a spec, or nothing (the whole tensor, replicated), or absent.
struct holding {
  bool holds = true;
  std::optional<shard_spec> spec;
};

struct sample_tensor {
  full_tensor t;
  std::vector<holding> ranks;  // 3
};

/// The local elements of spec (flat ranges, or a block of up to 3 dimensions), row-major.
std::string local_bytes(const full_tensor& t, const std::optional<shard_spec>& spec) {
  if (!spec) return t.bytes;
  const std::size_t item = item_size(dtype_from_name(t.dtype, ""));
  std::string out;
  if (spec->is_flat()) {
    for (const auto& r : spec->flat().ranges()) out += t.bytes.substr(r.begin * item, (r.end - r.begin) * item);
    return out;
  }
  const block_spec& b = spec->block();
  shape_t ls = b.local_shape(), go = b.global_offset(), full = t.shape;
  while (ls.size() < 3) {  // pad to 3 dimensions in front
    ls.insert(ls.begin(), 1);
    go.insert(go.begin(), 0);
    full.insert(full.begin(), 1);
  }
  for (std::uint64_t i = 0; i < ls[0]; ++i)
    for (std::uint64_t j = 0; j < ls[1]; ++j) {
      const std::uint64_t row = ((go[0] + i) * full[1] + (go[1] + j)) * full[2] + go[2];
      out += t.bytes.substr(row * item, ls[2] * item);
    }
  return out;
}

std::vector<sample_tensor> sample_model(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto t = [&](std::string n, std::string d, shape_t s) {
    return full_tensor{std::move(n), d, s, random_values(d, numel(s), rng)};
  };
  const holding rep{true, std::nullopt}, none{false, std::nullopt};
  auto fl = [](std::vector<element_range> r) { return holding{true, shard_spec(flat_spec(std::move(r)))}; };
  auto bl = [](shape_t ls, shape_t go) { return holding{true, shard_spec(block_spec(std::move(ls), std::move(go)))}; };
  return {
      {t("model.embed.weight", "F32", {40, 16}), {bl({14, 16}, {0, 0}), bl({13, 16}, {14, 0}), bl({13, 16}, {27, 0})}},
      {t("model.layers.0.attn.q.weight", "BF16", {16, 16}),
       {bl({16, 6}, {0, 0}), bl({16, 5}, {0, 6}), bl({16, 5}, {0, 11})}},
      {t("model.layers.0.attn.q.bias", "F16", {16}), {fl({{0, 5}}), fl({{5, 10}}), fl({{10, 16}})}},
      {t("model.layers.0.mlp.up.weight", "F32", {32, 16}),
       {fl({{0, 100}, {300, 350}}), fl({{100, 300}}), fl({{350, 512}})}},
      {t("model.norm.weight", "F32", {16}), {rep, rep, rep}},
      {t("model.ids", "I32", {5, 3}), {bl({2, 3}, {0, 0}), bl({2, 3}, {2, 0}), bl({1, 3}, {4, 0})}},
      {t("model.mask", "BOOL", {7}), {fl({{0, 3}}), none, fl({{3, 7}})}},
      {t("model.f8", "F8_E4M3", {2, 5}), {fl({{0, 4}}), fl({{4, 10}}), fl({})}},
      {t("model.cube", "U8", {2, 3, 4}), {bl({2, 3, 2}, {0, 0, 0}), bl({2, 3, 2}, {0, 0, 2}), none}},
      {t("step", "I64", {}), {none, rep, rep}},
      {t("empty", "F32", {0, 4}), {rep, rep, rep}},
  };
}

std::vector<full_tensor> fulls(const std::vector<sample_tensor>& s) {
  std::vector<full_tensor> v;
  for (const auto& x : s) v.push_back(x.t);
  return v;
}

/// Rank r's flat views of the sample (memory in `mem`, which must outlive them).
std::vector<flat_view> views_of(const std::vector<sample_tensor>& s, int r, std::vector<std::string>& mem) {
  mem.clear();
  mem.reserve(s.size());
  std::vector<flat_view> v;
  for (const auto& x : s) {
    const holding& h = x.ranks[static_cast<std::size_t>(r)];
    if (!h.holds) continue;
    mem.push_back(local_bytes(x.t, h.spec));
    v.push_back({x.t.name, dtype_from_name(x.t.dtype, ""), x.t.shape, h.spec,
                 reinterpret_cast<std::byte*>(mem.back().data()), mem.back().size()});
  }
  return v;
}

/// Saves the sample as a 3-rank sharded checkpoint into dir.
void save_sample(const std::vector<sample_tensor>& s, const fs::path& dir) {
  auto thrown = testing::run_ranks(3, [&](testing::thread_comm& comm) {
    std::vector<std::string> mem;
    const auto v = views_of(s, comm.rank(), mem);
    save(file_directory(dir), std::span<const flat_view>(v), comm);
  });
  for (auto& e : thrown) REQUIRE(!e);
}

// ---------------------------------------------------------------- what an export must give

/// The expected HF folder: file name -> (tensor name -> tensor), by the packing rule of
/// docs/FORMAT.md §3 computed here; `renames` maps old -> new names (absent: kept; "": dropped).
std::map<std::string, std::map<std::string, full_tensor>> expected_folder(
    std::vector<full_tensor> ts, std::uint64_t max_size, const std::string& to_dtype,
    const std::map<std::string, std::string>& renames = {}) {
  std::vector<full_tensor> out;
  for (auto t : ts) {
    if (auto it = renames.find(t.name); it != renames.end()) t.name = it->second;
    if (t.name.empty()) continue;
    const bool fl = t.dtype == "F32" || t.dtype == "BF16" || t.dtype == "F16";
    if (!to_dtype.empty() && fl) {
      t.bytes = convert_ref(t.bytes, t.dtype, to_dtype);
      t.dtype = to_dtype;
    }
    out.push_back(t);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::vector<std::vector<full_tensor>> files(1);
  std::uint64_t cur = 0;
  for (const auto& t : out) {
    if (!files.back().empty() && cur + t.bytes.size() > max_size) {
      files.emplace_back();
      cur = 0;
    }
    files.back().push_back(t);
    cur += t.bytes.size();
  }
  std::map<std::string, std::map<std::string, full_tensor>> folder;
  for (std::size_t f = 0; f < files.size(); ++f) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
    const std::string n = files.size() == 1 ? "model.safetensors" : name;
    for (const auto& t : files[f]) folder[n][t.name] = t;
  }
  return folder;
}

/// Checks the folder at dir holds exactly `want` (files, tensors, bytes), with a correct index.
void check_folder(const fs::path& dir, const std::map<std::string, std::map<std::string, full_tensor>>& want) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::vector<std::string> want_names;
  for (const auto& [f, ts] : want) want_names.push_back(f);
  if (want.size() > 1) want_names.push_back("model.safetensors.index.json");
  std::sort(want_names.begin(), want_names.end());
  REQUIRE(names == want_names);
  std::uint64_t total = 0;
  std::map<std::string, std::string> weight_map;
  for (const auto& [f, ts] : want) {
    INFO("file " << f);
    const parsed_file p = parse_safetensors(testing::slurp(dir / f));
    CHECK(p.metadata == std::map<std::string, std::string>{{"format", "pt"}});
    REQUIRE(p.tensors.size() == ts.size());
    for (const auto& [n, t] : ts) {
      INFO("tensor " << n);
      REQUIRE(p.tensors.count(n) == 1);
      const parsed_tensor& got = p.tensors.at(n);
      CHECK(got.dtype == t.dtype);
      CHECK(got.shape == t.shape);
      CHECK(got.bytes == t.bytes);
      total += t.bytes.size();
      weight_map[n] = f;
    }
  }
  if (want.size() > 1) {
    const export_jvalue idx = parse_json(testing::slurp(dir / "model.safetensors.index.json"));
    CHECK(idx.at("metadata").at("total_size").num() == total);
    std::map<std::string, std::string> got;
    for (const auto& [k, v] : idx.at("weight_map").obj()) got[k] = v.str();
    CHECK(got == weight_map);
  }
}

/// The index Python writes for tensors (name, bytes, elements) packed into max_size: shard_checkpoint's
/// loop and json.dumps(indent=2, sort_keys=True), with today's transformers' total_parameters;
/// nullopt when python3 does not run (a failure instead where Python is required).
std::optional<std::string> python_index(const std::vector<std::tuple<std::string, std::uint64_t, std::uint64_t>>& ts,
                                        std::uint64_t max) {
  std::string input = std::to_string(max) + "\n";
  for (const auto& [n, b, e] : ts) input += n + "\t" + std::to_string(b) + "\t" + std::to_string(e) + "\n";
  const char* script =
      "import json,sys\n"
      "lines=open(sys.argv[1]).read().split('\\n')[:-1]\n"
      "mx=int(lines[0]); ts=sorted((l.split('\\t')[0],int(l.split('\\t')[1])) for l in lines[1:])\n"
      "params=sum(int(l.split('\\t')[2]) for l in lines[1:])\n"
      "blocks=[[]]; cur=0\n"
      "for n,b in ts:\n"
      "  if blocks[-1] and cur+b>mx: blocks.append([]); cur=0\n"
      "  blocks[-1].append((n,b)); cur+=b\n"
      "wm={n:'model-%05d-of-%05d.safetensors'%(i+1,len(blocks)) for i,bl in enumerate(blocks) for n,b in bl}\n"
      "sys.stdout.write(json.dumps({'metadata':{'total_parameters':params,'total_size':sum(b for n,b in "
      "ts)},'weight_map':wm},"
      "indent=2,sort_keys=True)+'\\n')\n";
  return testing::run_python("python3", script, input);  // (with SHARDSAFE_REQUIRE_PYTHON=1, never skipped)
}

}  // namespace

TEST_CASE("hf export: a 3-rank checkpoint round-trips at several shard sizes and dtypes, bit for bit") {
  temp_dir tmp("hfexp");
  const auto sample = sample_model(7);
  save_sample(sample, tmp.path / "ckpt");
  const auto ts = fulls(sample);
  std::uint64_t largest = 0;
  for (const auto& t : ts) largest = std::max<std::uint64_t>(largest, t.bytes.size());
  int n = 0;
  for (const std::string to : {"", "BF16", "F16", "F32"})
    for (std::uint64_t max : {hf_default_max_shard_size, std::uint64_t{4000}, std::uint64_t{1000}, std::uint64_t{1}}) {
      CAPTURE(to);
      CAPTURE(max);
      const fs::path out = tmp.path / ("out" + std::to_string(n++));
      hf_export_options opt;
      opt.max_shard_size = max;
      if (!to.empty()) opt.convert_to = dtype_from_name(to, "");
      opt.chunk_bytes = 100;  // many blocks, edges inside tensors and inside elements
      opt.threads = 2;
      const hf_export_stats st = export_to(file_directory(tmp.path / "ckpt"), file_directory(out), opt);
      const auto want = expected_folder(ts, max, to);
      check_folder(out, want);
      CHECK(st.files == want.size());
      CHECK(st.tensors == ts.size());
      CHECK(st.indexed == (want.size() > 1));
      if (max == 1000) CHECK(max < largest);
      if (want.size() > 1 && to.empty()) {
        std::vector<std::tuple<std::string, std::uint64_t, std::uint64_t>> sizes;
        for (const auto& t : ts) sizes.emplace_back(t.name, t.bytes.size(), numel(t.shape));
        if (auto py = python_index(sizes, max)) CHECK(testing::slurp(out / "model.safetensors.index.json") == *py);
      }
    }
}

TEST_CASE("hf export: memory directories, single-file sources and chunk sizes give the same bytes") {
  temp_dir tmp("hfexp");
  const auto sample = sample_model(8);
  save_sample(sample, tmp.path / "ckpt");
  hf_export_options opt;
  opt.max_shard_size = 3000;
  export_to(file_directory(tmp.path / "ckpt"), file_directory(tmp.path / "ref"), opt);
  for (std::uint64_t chunk : {1u, 7u, 4096u, 1u << 20}) {
    CAPTURE(chunk);
    memory_directory mem;
    opt.chunk_bytes = chunk;
    opt.threads = chunk == 7 ? 1 : 3;
    export_to(file_directory(tmp.path / "ckpt"), mem, opt);
    for (const auto& e : fs::directory_iterator(tmp.path / "ref")) {
      const auto r = mem.open(e.path().filename().string());
      std::string got(r.size(), '\0');
      r.read_into(0, std::as_writable_bytes(std::span(got)));
      CHECK(got == testing::slurp(e.path()));
    }
    CHECK(mem.list().size() == static_cast<std::size_t>(std::distance(fs::directory_iterator(tmp.path / "ref"), {})));
  }
  // an HF folder re-exported at another size: same tensors
  export_to(file_directory(tmp.path / "ref"), file_directory(tmp.path / "again"), hf_export_options{});
  check_folder(tmp.path / "again", expected_folder(fulls(sample), hf_default_max_shard_size, ""));
}

TEST_CASE("hf export: NaN, infinities, signed zeros and subnormals convert as IEEE-754 asks") {
  temp_dir tmp("hfexp");
  const std::vector<std::uint32_t> f32{0x7fc00001u, 0xff800000u, 0x7f800000u, 0x80000000u, 0x00000001u,
                                       0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xffa00000u, 0x3f800001u};
  const full_tensor t{"x", "F32", {10}, export_bytes_of(f32)};
  fixtures::put(file_directory(tmp.path / "hf"), "model.safetensors",
                fixtures::build_file({{t.name, t.dtype, t.shape, t.bytes}}));
  hf_export_options opt;
  opt.convert_to = dtype::BF16;
  export_to(file_directory(tmp.path / "hf"), file_directory(tmp.path / "out"), opt);
  const parsed_file p = parse_safetensors(testing::slurp(tmp.path / "out" / "model.safetensors"));
  const auto got = as<std::uint16_t>(p.tensors.at("x").bytes);
  // quiet NaN with payload top bits, -inf, inf, -0, a subnormal to 0, ties to even both ways,
  // the largest F32 to inf, a signalling NaN made quiet, 1 + ulp rounds to 1
  CHECK(got ==
        std::vector<std::uint16_t>{0x7fc0, 0xff80, 0x7f80, 0x8000, 0x0000, 0x3f80, 0x3f82, 0x7f80, 0xffe0, 0x3f80});
  for (std::size_t i = 0; i < f32.size(); ++i) CHECK(got[i] == f32_to_bf16(f32[i]));
}

TEST_CASE("hf export: rename rules rename, drop and refuse collisions; model-only exports model/") {
  temp_dir tmp("hfexp");
  const auto sample = sample_model(9);
  save_sample(sample, tmp.path / "ckpt");
  const auto ts = fulls(sample);

  hf_export_options opt;
  opt.rename = rename_rules({"^step$=", "^model\\.layers\\.(\\d+)\\.=model.h.\\1.", "^model\\.=transformer."});
  opt.max_shard_size = 2000;
  export_to(file_directory(tmp.path / "ckpt"), file_directory(tmp.path / "renamed"), opt);
  std::map<std::string, std::string> ren;
  for (const auto& t : ts) {
    std::string n = t.name;
    if (n == "step")
      n = "";
    else if (n.rfind("model.layers.0.", 0) == 0)
      n = "model.h.0." + n.substr(15);
    else if (n.rfind("model.", 0) == 0)
      n = "transformer." + n.substr(6);
    ren[t.name] = n;
  }
  check_folder(tmp.path / "renamed", expected_folder(ts, 2000, "", ren));

  opt.rename = rename_rules({"^model\\.layers\\.0\\.attn\\.q\\.(weight|bias)$=q"});
  expect_error([&] { export_to(file_directory(tmp.path / "ckpt"), file_directory(tmp.path / "clash"), opt); },
               errc::invalid_argument,
               {"model.layers.0.attn.q.bias", "model.layers.0.attn.q.weight", "both renamed to 'q'"});
  CHECK(!fs::exists(tmp.path / "clash"));  // planned before anything is written

  // a model + optimizer checkpoint: model/ only by default, both with model_only = false
  std::vector<sample_tensor> optim{sample[3]};
  optim[0].t.name = "state.model.layers.0.mlp.up.weight.__exp_avg";
  save_sample(sample, tmp.path / "pair" / "model");
  save_sample(optim, tmp.path / "pair" / "optim");
  export_to(file_directory(tmp.path / "pair"), file_directory(tmp.path / "model-only"), hf_export_options{});
  check_folder(tmp.path / "model-only", expected_folder(ts, hf_default_max_shard_size, ""));
  hf_export_options both;
  both.model_only = false;
  export_to(file_directory(tmp.path / "pair"), file_directory(tmp.path / "both"), both);
  std::vector<full_tensor> all;
  for (auto t : ts) all.push_back({"model/" + t.name, t.dtype, t.shape, t.bytes});
  all.push_back({"optim/" + optim[0].t.name, "F32", optim[0].t.shape, optim[0].t.bytes});
  check_folder(tmp.path / "both", expected_folder(all, hf_default_max_shard_size, ""));
  // the model/ sub-folder given directly
  export_to(file_directory(tmp.path / "pair" / "model"), file_directory(tmp.path / "sub"), hf_export_options{});
  check_folder(tmp.path / "sub", expected_folder(ts, hf_default_max_shard_size, ""));
}

TEST_CASE("hf export: errors name the folder, tensor and rule, and leave nothing behind") {
  temp_dir tmp("hfexp");
  const auto sample = sample_model(10);
  save_sample(sample, tmp.path / "ckpt");
  const file_directory src(tmp.path / "ckpt");
  fixtures::put(file_directory(tmp.path / "full"), "x", "y");
  expect_error([&] { export_to(src, file_directory(tmp.path / "full"), hf_export_options{}); }, errc::already_exists,
               {(tmp.path / "full").string(), "not empty"});
  hf_export_options bad;
  bad.convert_to = dtype::I8;
  expect_error([&] { export_to(src, file_directory(tmp.path / "o1"), bad); }, errc::invalid_argument,
               {"export dtype I8", "F16, BF16, F32 or F64"});
  expect_error([&] { rename_rules({"(=x"}); }, errc::invalid_argument, {"rename rule '(=x'", "bad regex"});
  expect_error([&] { parse_size("5 GB"); }, errc::invalid_argument, {"size '5 GB'"});
  // a rank file that lost its data: the failing file is aborted, files committed before it removed
  const fs::path r1 = tmp.path / "ckpt" / "rank_1.safetensors";
  std::string bytes = testing::slurp(r1);
  fs::remove(r1);
  testing::write_file(r1, bytes.substr(0, bytes.size() - 1));
  hf_export_options opt;
  opt.max_shard_size = 1;
  opt.chunk_bytes = 64;
  expect_error([&] { export_to(src, file_directory(tmp.path / "o2"), opt); }, errc::truncated, {"rank_1.safetensors"});
  CHECK(fs::is_empty(tmp.path / "o2"));
}

TEST_CASE("hf export: a 3-rank distributed export equals the single-process export byte for byte") {
  temp_dir tmp("hfexp");
  const auto sample = sample_model(11);
  save_sample(sample, tmp.path / "ckpt");
  for (int variant = 0; variant < 3; ++variant) {
    CAPTURE(variant);
    hf_export_options opt;
    if (variant == 1) {
      opt.max_shard_size = 1000;
      opt.convert_to = dtype::BF16;
      opt.rename = rename_rules({"^step$=", "^model\\.=m."});
      opt.chunk_bytes = 24;
    }
    if (variant == 2) {
      opt.max_shard_size = 1;
      opt.convert_to = dtype::F32;
      opt.threads = 1;
    }
    const fs::path single = tmp.path / ("single" + std::to_string(variant)),
                   dist = tmp.path / ("dist" + std::to_string(variant));
    export_to(file_directory(tmp.path / "ckpt"), file_directory(single), opt);
    std::vector<hf_export_stats> stats(3);
    auto thrown = testing::run_ranks(3, [&](testing::thread_comm& comm) {
      std::vector<std::string> mem;
      const auto v = views_of(sample, comm.rank(), mem);
      stats[static_cast<std::size_t>(comm.rank())] = export_to(std::span<const flat_view>(v), comm, dist, opt);
    });
    for (auto& e : thrown) REQUIRE(!e);
    std::vector<std::string> a, b;
    for (const auto& e : fs::directory_iterator(single)) a.push_back(e.path().filename().string());
    for (const auto& e : fs::directory_iterator(dist)) b.push_back(e.path().filename().string());
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    REQUIRE(a == b);
    for (const auto& n : a) CHECK_MESSAGE(testing::slurp(single / n) == testing::slurp(dist / n), n);
    CHECK(stats[0].files == stats[2].files);
    CHECK(stats[1].files == (a.size() > 1 ? a.size() - 1 : 1));
  }
  // every rank gets the error of a rank whose views disagree, and no file is left
  auto thrown = testing::run_ranks(3, [&](testing::thread_comm& comm) {
    std::vector<std::string> mem;
    auto v = views_of(sample, comm.rank(), mem);
    if (comm.rank() == 2) v.front().full_shape = {41, 16};
    export_to(std::span<const flat_view>(v), comm, tmp.path / "bad", hf_export_options{});
  });
  for (auto& e : thrown) {
    REQUIRE(e);
    expect_error([&] { std::rethrow_exception(e); }, errc::invalid_argument, {"model.embed.weight", "shape"});
  }
  CHECK(!fs::exists(tmp.path / "bad"));
  // an output folder that is not empty is refused on every rank
  fixtures::put(file_directory(tmp.path / "busy"), "x", "y");
  thrown = testing::run_ranks(3, [&](testing::thread_comm& comm) {
    std::vector<std::string> mem;
    const auto v = views_of(sample, comm.rank(), mem);
    export_to(std::span<const flat_view>(v), comm, tmp.path / "busy", hf_export_options{});
  });
  for (auto& e : thrown)
    expect_error([&] { std::rethrow_exception(e); }, errc::already_exists, {"rank 0", "not empty"});
}

// ---------------------------------------------------------------- torch's DCP-sharded HF files

namespace {

/// One rank's file of torch's sharded HF output: its blocks with their saved_offsets.
std::string export_dcp_file(const std::vector<std::pair<full_tensor, shape_t>>& blocks) {
  std::string info = "{", json = "{", data;
  for (const auto& [t, off] : blocks) {
    info += std::string(info.size() > 1 ? "," : "") + "\"" + t.name +
            "\":{\"saved_offsets\":" + fixtures::shape_text(off, ",") + "}";
  }
  info += "}";
  json += "\"__metadata__\":{\"DCP_SHARDING_INFO\":" + testing::json_quoted(info) +
          ",\"DCP_VERSION\":\"1.0\",\"format\":\"pt\"}";
  for (const auto& [t, off] : blocks) {
    json += "," +
            corpus::entry(t.name, t.dtype, fixtures::shape_text(t.shape, ","),
                          "[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) + "]");
    data += t.bytes;
  }
  json += "}";
  return corpus::file_bytes(json, data);
}

/// A DCP-sharded folder on 3 ranks of one tensor per dtype given, each split in row blocks
/// [0,2) [2,3) [3,5) of a [5, 3] tensor (the middle rank holding a 1-row block); returns the
/// full tensors.
std::vector<full_tensor> write_dcp_folder(const fs::path& dir, const std::vector<std::string>& dtypes,
                                          std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<full_tensor> full;
  std::vector<std::vector<std::pair<full_tensor, shape_t>>> ranks(3);
  const std::uint64_t rows[4] = {0, 2, 3, 5};
  for (const auto& d : dtypes) {
    full_tensor t{"model.t_" + d, d, {5, 3}, fixtures::random_string(15 * item_size(dtype_from_name(d, "")), rng)};
    if (d == "BOOL")
      for (auto& c : t.bytes) c = static_cast<char>(c & 1);
    const std::size_t row = 3 * item_size(dtype_from_name(d, ""));
    for (int r = 0; r < 3; ++r)
      ranks[r].push_back(
          {full_tensor{
               t.name, d, {rows[r + 1] - rows[r], 3}, t.bytes.substr(rows[r] * row, (rows[r + 1] - rows[r]) * row)},
           shape_t{rows[r], 0}});
    full.push_back(std::move(t));
  }
  for (int r = 0; r < 3; ++r)
    fixtures::put(file_directory(dir), "shard-0000" + std::to_string(r + 1) + "-model-00001-of-00001.safetensors",
                  export_dcp_file(ranks[r]));
  return full;
}

std::vector<std::string> every_byte_dtype() {
  std::vector<std::string> v;
  for (const auto& i : all_dtypes)
    if (is_byte_sized(i.type)) v.emplace_back(i.name);
  return v;
}

}  // namespace

TEST_CASE("hf export: torch's DCP-sharded HF files of every byte-sized dtype consolidate bit for bit") {
  temp_dir tmp("hfexp");
  const auto dtypes = every_byte_dtype();
  CHECK(std::find(dtypes.begin(), dtypes.end(), "F8_E5M2") != dtypes.end());
  const auto full = write_dcp_folder(tmp.path / "dcp", dtypes, 4);
  for (std::uint64_t max : {hf_default_max_shard_size, std::uint64_t{200}}) {
    const fs::path out = tmp.path / ("out" + std::to_string(max));
    hf_export_options opt;
    opt.max_shard_size = max;
    opt.chunk_bytes = 40;
    export_to(file_directory(tmp.path / "dcp"), file_directory(out), opt);
    check_folder(out, expected_folder(full, max, ""));
  }
  // with --dtype bf16: the floating ones converted, the others (I64, BOOL, F8, C64, ...) as they were
  hf_export_options opt;
  opt.convert_to = dtype::BF16;
  export_to(file_directory(tmp.path / "dcp"), file_directory(tmp.path / "bf16"), opt);
  std::vector<full_tensor> conv;
  for (auto t : full) {
    if (t.dtype == "F64") {  // rounded once: to F32 rounding to odd, then to BF16 (exact then)
      std::vector<std::uint16_t> o;
      for (double x : as<double>(t.bytes))
        o.push_back(f32_to_bf16(std::bit_cast<std::uint32_t>(to_f32_round_to_odd(x))));
      t = {t.name, "BF16", t.shape, export_bytes_of(o)};
    }
    conv.push_back(t);
  }
  const auto want = expected_folder(conv, hf_default_max_shard_size, "BF16");
  check_folder(tmp.path / "bf16", want);
  const auto& files = want.at("model.safetensors");
  CHECK(files.at("model.t_I64").dtype == "I64");
  CHECK(files.at("model.t_BOOL").dtype == "BOOL");
  CHECK(files.at("model.t_F8_E4M3").dtype == "F8_E4M3");
  CHECK(files.at("model.t_F32").dtype == "BF16");
}

TEST_CASE("hf export: the I64, BOOL and BF16 blocks of 3 ranks, in the layout torch writes them") {
  temp_dir tmp("hfexp");
  std::mt19937_64 rng(17);
  const full_tensor ids{"ids", "I64", {5, 4}, fixtures::random_string(160, rng)};
  full_tensor mask{"mask", "BOOL", {6}, fixtures::random_string(6, rng)};
  for (auto& c : mask.bytes) c = static_cast<char>(c & 1);
  const full_tensor emb{"emb", "BF16", {4, 6}, fixtures::random_string(48, rng)};
  auto rows = [](const full_tensor& t, std::uint64_t r0, std::uint64_t r1) {
    const std::uint64_t row = t.bytes.size() / t.shape[0];
    return full_tensor{t.name, t.dtype, {r1 - r0, t.shape[1]}, t.bytes.substr(r0 * row, (r1 - r0) * row)};
  };
  auto cols = [](const full_tensor& t, std::uint64_t c0, std::uint64_t c1) {
    std::string b;
    for (std::uint64_t i = 0; i < t.shape[0]; ++i) b += t.bytes.substr((i * t.shape[1] + c0) * 2, (c1 - c0) * 2);
    return full_tensor{t.name, t.dtype, {t.shape[0], c1 - c0}, b};
  };
  auto part = [](const full_tensor& t, std::uint64_t a, std::uint64_t b) {
    return full_tensor{t.name, t.dtype, {b - a}, t.bytes.substr(a, b - a)};
  };
  const file_directory dcp(tmp.path / "dcp");
  fixtures::put(dcp, "shard-00001-model-00001-of-00001.safetensors",
                export_dcp_file({{rows(ids, 0, 2), {0, 0}}, {part(mask, 0, 3), {0}}, {cols(emb, 0, 2), {0, 0}}}));
  fixtures::put(dcp, "shard-00002-model-00001-of-00001.safetensors",
                export_dcp_file({{rows(ids, 2, 4), {2, 0}}, {cols(emb, 2, 4), {0, 2}}}));
  fixtures::put(dcp, "shard-00003-model-00001-of-00001.safetensors",
                export_dcp_file({{rows(ids, 4, 5), {4, 0}}, {part(mask, 3, 6), {3}}, {cols(emb, 4, 6), {0, 4}}}));
  hf_export_options opt;
  opt.chunk_bytes = 16;
  opt.max_shard_size = 100;
  export_to(dcp, file_directory(tmp.path / "out"), opt);
  check_folder(tmp.path / "out", expected_folder({ids, mask, emb}, 100, ""));
}

// ---------------------------------------------------------------- the tool's to-hf

namespace {

const auto export_skip_without_tool = doctest::skip(!testing::have_tool());

/// Exit `code` with nothing on stdout and one line on stderr holding the phrases.
void check_exit(const testing::program_result& r, int code, const std::vector<std::string>& phrases) {
  CHECK(r.exited);
  CHECK(r.code == code);
  CHECK(r.out.empty());
  CHECK_MESSAGE(std::count(r.err.begin(), r.err.end(), '\n') == 1, "stderr is not one line: ", r.err);
  for (const auto& p : phrases) CHECK_MESSAGE(r.err.find(p) != std::string::npos, r.err, " lacks ", p);
}

/// `shardsafe digest` of these tensors, computed here.
std::string digest_of(std::vector<full_tensor> ts) {
  std::sort(ts.begin(), ts.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::string out;
  for (const auto& t : ts)
    out +=
        t.name + " " + t.dtype + " " + fixtures::shape_text(t.shape, ",") + " " + testing::sha256_hex(t.bytes) + "\n";
  return out;
}

}  // namespace

TEST_CASE("tool: to-hf exports a sharded checkpoint that verify accepts, with sizes, dtypes and renames" *
          export_skip_without_tool) {
  temp_dir tmp("hftool");
  const auto sample = sample_model(12);
  save_sample(sample, tmp.path / "ckpt");
  const auto ts = fulls(sample);
  const fs::path out = tmp.path / "out";
  const auto r = testing::run_tool({"to-hf", (tmp.path / "ckpt").string(), out.string(), "--max-shard-size", "1KB",
                                    "--dtype", "bf16", "--rename", "^model\\.=m.", "--rename=^step$=", "--model-only"});
  CHECK(r.code == 0);
  CHECK(r.err.empty());  // no progress line off a terminal
  CHECK(r.out.find("wrote " + out.string()) != std::string::npos);
  std::map<std::string, std::string> ren;
  for (const auto& t : ts)
    ren[t.name] = t.name == "step" ? "" : t.name.rfind("model.", 0) == 0 ? "m." + t.name.substr(6) : t.name;
  const auto want = expected_folder(ts, 1000, "BF16", ren);
  REQUIRE(want.size() > 2);
  check_folder(out, want);
  const auto v = testing::run_tool({"verify", out.string()});
  CHECK(v.code == 0);
  CHECK(v.out == "OK " + out.string() + ": " + std::to_string(ts.size() - 1) + " tensors valid\n");
  std::vector<full_tensor> flat;
  for (const auto& [f, m] : want)
    for (const auto& [n, t] : m) flat.push_back(t);
  CHECK(testing::run_tool({"digest", out.string()}).out == digest_of(flat));
  // options after the positionals, sizes in binary units, a single safetensors file as SRC
  const fs::path one = tmp.path / "one.safetensors";
  const full_tensor a{"model._orig_mod.layers.0._checkpoint_wrapped_module.w", "F32", {3}, std::string(12, '\x01')};
  const full_tensor b{"my_orig_mod.x", "I64", {2}, std::string(16, '\x02')};
  testing::write_file(one,
                      fixtures::build_file({{a.name, a.dtype, a.shape, a.bytes}, {b.name, b.dtype, b.shape, b.bytes}}));
  // --preset dcp-to-hf: wrappers removed, then model.X -> X (the key is neither model.model.* nor
  // model.lm_head.weight); a non-model key dropped; one warning line each
  const auto p = testing::run_tool(
      {"to-hf", one.string(), (tmp.path / "one").string(), "--preset", "dcp-to-hf", "--max-shard-size", "1KiB"});
  CHECK(p.code == 0);
  CHECK(p.err ==
        "shardsafe: warning: 1 name(s) a 'model.' key that is neither 'model.model.*' nor 'model.lm_head.weight': "
        "its 'model.' prefix removed: " +
            a.name +
            " -> layers.0.w\n"
            "shardsafe: warning: 1 name(s) not a 'model.' key (optimizer or extra state): dropped: my_orig_mod.x\n");
  check_folder(tmp.path / "one", expected_folder({a, b}, 1024, "", {{a.name, "layers.0.w"}, {b.name, ""}}));
  // a --rename rule that matches decides the name; the preset's rules see the others
  const full_tensor c{"model.model._orig_mod.layers.1.w", "F32", {3}, std::string(12, '\x03')};
  const full_tensor d{"model.lm_head.weight", "BF16", {2}, std::string(4, '\x04')};
  testing::write_file(one, fixtures::build_file({{a.name, a.dtype, a.shape, a.bytes},
                                                 {b.name, b.dtype, b.shape, b.bytes},
                                                 {c.name, c.dtype, c.shape, c.bytes},
                                                 {d.name, d.dtype, d.shape, d.bytes}}));
  CHECK(testing::run_tool(
            {"to-hf", one.string(), (tmp.path / "two").string(), "--preset", "dcp-to-hf", "--rename", "^my_=kept_"})
            .code == 0);
  check_folder(tmp.path / "two", expected_folder({a, b, c, d}, hf_default_max_shard_size, "",
                                                 {{a.name, "layers.0.w"},
                                                  {b.name, "kept_orig_mod.x"},
                                                  {c.name, "model.layers.1.w"},
                                                  {d.name, "lm_head.weight"}}));
}

TEST_CASE("tool: torch's DCP-sharded HF files: to-hf, digest, inspect, verify and unshard" * export_skip_without_tool) {
  temp_dir tmp("hftool");
  const fs::path dcp = tmp.path / "dcp";
  const auto full = write_dcp_folder(dcp, {"I64", "I32", "BOOL", "BF16", "F8_E4M3", "F8_E5M2", "F32"}, 5);
  const auto d = testing::run_tool({"digest", dcp.string()});
  CHECK(d.code == 0);
  CHECK(d.out == digest_of(full));
  const auto i = testing::run_tool({"inspect", dcp.string()});
  CHECK(i.code == 0);
  CHECK(i.out.find("torch sharded Hugging Face files") != std::string::npos);
  CHECK(i.out.find("blocks over 3 file(s)") != std::string::npos);
  CHECK(testing::run_tool({"verify", dcp.string()}).code == 0);
  const fs::path hf = tmp.path / "hf";
  CHECK(testing::run_tool({"to-hf", dcp.string(), hf.string(), "--max-shard-size", "100"}).code == 0);
  check_folder(hf, expected_folder(full, 100, ""));
  CHECK(testing::run_tool({"digest", hf.string()}).out == d.out);  // the same tensors, whatever the layout
  CHECK(testing::run_tool({"verify", hf.string()}).code == 0);
  const fs::path one = tmp.path / "all.safetensors";
  CHECK(testing::run_tool({"unshard", dcp.string(), one.string()}).code == 0);
  const parsed_file p = parse_safetensors(testing::slurp(one));
  for (const auto& t : full) CHECK(p.tensors.at(t.name).bytes == t.bytes);
  CHECK(testing::run_tool({"digest", one.string()}).out == d.out);
  // an HF folder unshards too
  CHECK(testing::run_tool({"unshard", hf.string(), (tmp.path / "hf.safetensors").string()}).code == 0);
  CHECK(testing::slurp(tmp.path / "hf.safetensors") == testing::slurp(one));
  // a block gone: verify and to-hf name the gap
  fs::remove(dcp / "shard-00002-model-00001-of-00001.safetensors");
  check_exit(testing::run_tool({"verify", dcp.string()}), 1, {"are in no file"});
  check_exit(testing::run_tool({"to-hf", dcp.string(), (tmp.path / "gap").string()}), 1, {"in no file"});
  CHECK(fs::is_empty(tmp.path / "gap"));
}

TEST_CASE("tool: to-hf usage errors exit 2, failures exit 1, each with one line" * export_skip_without_tool) {
  temp_dir tmp("hftool");
  const auto sample = sample_model(13);
  save_sample(sample, tmp.path / "ckpt");
  const std::string src = (tmp.path / "ckpt").string(), out = (tmp.path / "out").string();
  check_exit(testing::run_tool({"to-hf", src}), 2, {"OUTDIR"});
  check_exit(testing::run_tool({"to-hf", src, out, "--max-shard-size", "5 GB"}), 2,
             {"--max-shard-size", "size '5 GB'"});
  check_exit(testing::run_tool({"to-hf", src, out, "--max-shard-size", "12TB"}), 2, {"unknown unit 'TB'"});
  check_exit(testing::run_tool({"to-hf", src, out, "--dtype", "int8"}), 2, {"--dtype", "int8"});
  check_exit(testing::run_tool({"to-hf", src, out, "--rename", "(=x"}), 2, {"rename rule '(=x'", "bad regex"});
  check_exit(testing::run_tool({"to-hf", src, out, "--rename", "nosplit"}), 2, {"rename rule 'nosplit'", "no '='"});
  check_exit(testing::run_tool({"to-hf", src, out, "--preset", "hf-to-dcp"}), 2, {"--preset", "hf-to-dcp"});
  CHECK(!fs::exists(out));
  check_exit(testing::run_tool({"to-hf", src, out, "--rename", "^model\\.layers\\.0\\.attn\\.q\\.(weight|bias)$=q"}), 1,
             {"'model.layers.0.attn.q.bias'", "'model.layers.0.attn.q.weight'", "both renamed to 'q'"});
  fixtures::put(file_directory(tmp.path / "busy"), "keep", "me");
  check_exit(testing::run_tool({"to-hf", src, (tmp.path / "busy").string()}), 1,
             {(tmp.path / "busy").string(), "not empty"});
  CHECK(testing::slurp(tmp.path / "busy" / "keep") == "me");
  check_exit(testing::run_tool({"to-hf", (tmp.path / "absent").string(), out}), 1, {"absent"});
  const auto h = testing::run_tool({"to-hf", "--help"});
  CHECK(h.code == 0);
  CHECK(h.err.empty());
  for (const char* w : {"shardsafe to-hf", "--max-shard-size", "--dtype", "--rename", "--preset", "--model-only"})
    CHECK_MESSAGE(h.out.find(w) != std::string::npos, w);
}
