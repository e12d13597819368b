// Tests of format/safetensors.hpp and format/safetensors_writer.hpp: round trips of every
// dtype checked by an independent byte-level reader, then the reject corpus and valid edges.
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/safetensors_writer.hpp"

#include <doctest/doctest.h>

#include "support/test_util.hpp"

#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "support/malformed_corpus.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/storage/mmap.hpp"

using namespace shardsafe;
using testing::temp_dir;
namespace fs = std::filesystem;

namespace {

std::string as_string(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }
std::span<const std::byte> as_span(const std::string& s) { return std::as_bytes(std::span(s)); }

// ---------------------------------------------------------------------------------------
// An independent minimal JSON reader (objects keep their key order), used to check what the
// writer produced without parse_safetensors.

struct jmember;  // a struct, not std::pair: clang with libstdc++ refuses a pair of an incomplete type here
struct jvalue {
  enum kind_t { null_v, bool_v, number_v, string_v, array_v, object_v } kind = null_v;
  std::string text;  // string contents, or the number as written
  std::vector<jvalue> items;
  std::vector<jmember> members;
};
struct jmember {
  std::string first;
  jvalue second;
};

class mini_json {
 public:
  explicit mini_json(std::string_view t) : t_(t) {}
  jvalue parse_document() {
    jvalue v = value();
    rest_ = t_.substr(i_);
    return v;
  }
  std::string_view rest() const { return rest_; }

 private:
  char peek() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\t' || t_[i_] == '\r')) ++i_;
    REQUIRE(i_ < t_.size());
    return t_[i_];
  }
  void expect(char c) {
    REQUIRE(peek() == c);
    ++i_;
  }
  std::string str() {
    expect('"');
    std::string s;
    while (true) {
      REQUIRE(i_ < t_.size());
      char c = t_[i_++];
      if (c == '"') return s;
      if (c != '\\') {
        s += c;
        continue;
      }
      char e = t_[i_++];
      switch (e) {
        case 'n': s += '\n'; break;
        case 't': s += '\t'; break;
        case 'r': s += '\r'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'u': {  // the writer only escapes control characters this way
          unsigned v = std::stoul(std::string(t_.substr(i_, 4)), nullptr, 16);
          REQUIRE(v < 0x80);
          s += static_cast<char>(v);
          i_ += 4;
          break;
        }
        default: s += e;
      }
    }
  }
  jvalue value() {
    jvalue v;
    char c = peek();
    if (c == '{') {
      v.kind = jvalue::object_v;
      ++i_;
      if (peek() == '}') return ++i_, v;
      while (true) {
        std::string k = str();
        expect(':');
        v.members.emplace_back(k, value());
        if (peek() == '}') return ++i_, v;
        expect(',');
      }
    }
    if (c == '[') {
      v.kind = jvalue::array_v;
      ++i_;
      if (peek() == ']') return ++i_, v;
      while (true) {
        v.items.push_back(value());
        if (peek() == ']') return ++i_, v;
        expect(',');
      }
    }
    if (c == '"') {
      v.kind = jvalue::string_v;
      v.text = str();
      return v;
    }
    std::size_t b = i_;
    while (i_ < t_.size() && std::string_view("-+.eE0123456789").find(t_[i_]) != std::string_view::npos) ++i_;
    REQUIRE(i_ > b);
    v.kind = jvalue::number_v;
    v.text = std::string(t_.substr(b, i_ - b));
    return v;
  }
  std::string_view t_;
  std::size_t i_ = 0;
  std::string_view rest_;
};

std::uint64_t to_u64(const jvalue& v) {
  REQUIRE(v.kind == jvalue::number_v);
  REQUIRE(v.text.find_first_not_of("0123456789") == std::string::npos);
  return std::stoull(v.text);
}

const jvalue& member(const jvalue& o, std::string_view k) {
  for (const auto& [key, v] : o.members)
    if (key == k) return v;
  FAIL("no member " << k);
  return o;
}

// The dtype table of docs/FORMAT.md §1, written out independently: name and bits per element.
const std::pair<const char*, unsigned> format_dtypes[] = {
    {"BOOL", 8}, {"U8", 8},   {"I8", 8},      {"F8_E5M2", 8}, {"F8_E4M3", 8},     {"I16", 16},
    {"U16", 16}, {"F16", 16}, {"BF16", 16},   {"I32", 32},    {"U32", 32},        {"F32", 32},
    {"F64", 64}, {"I64", 64}, {"U64", 64},    {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
    {"C64", 64}, {"F4", 4},   {"F6_E2M3", 6}, {"F6_E3M2", 6}};

struct input_tensor {
  std::string name;
  std::string dtype_name;
  unsigned bits;
  shape_t shape;
  std::vector<std::byte> bytes;
};

std::vector<input_tensor> make_inputs(std::mt19937_64& rng) {
  std::vector<input_tensor> in;
  auto add = [&](std::string name, const char* dt, unsigned bits, shape_t shape) {
    std::uint64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<std::byte> b(n * bits / 8);
    for (auto& x : b) x = static_cast<std::byte>(rng());
    in.push_back({std::move(name), dt, bits, std::move(shape), std::move(b)});
  };
  for (auto [dt, bits] : format_dtypes) {
    if (bits % 8 == 0) {
      add(std::string("t.") + dt, dt, bits, {3, 5});
      add(std::string("s.") + dt, dt, bits, {});      // 0-d: one element
      add(std::string("e.") + dt, dt, bits, {3, 0});  // empty
    } else {
      add(std::string("t.") + dt, dt, bits, {4, 2, 6});  // 48 elements: a whole number of bytes
      add(std::string("e.") + dt, dt, bits, {0});
    }
  }
  add("odd name \"q\"\\\n\x01 \xc3\xa9", "U8", 8, {7});  // escapes and UTF-8 in a name
  add("big", "F32", 32, {64, 33});
  return in;
}

std::vector<tensor_data> to_tensor_data(const std::vector<input_tensor>& in) {
  std::vector<tensor_data> td;
  for (const auto& t : in) td.push_back({t.name, *parse_dtype(t.dtype_name), t.shape, t.bytes});
  return td;
}

/// Checks file bytes against the inputs with the independent reader.
void check_bytes(const std::string& file, const std::vector<input_tensor>& in,
                 const std::map<std::string, std::string>& md) {
  REQUIRE(file.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[static_cast<std::size_t>(i)]);
  const std::uint64_t data_start = 8 + n;
  REQUIRE(data_start <= file.size());
  CHECK(data_start % 8 == 0);
  mini_json p(std::string_view(file).substr(8, n));
  jvalue root = p.parse_document();
  REQUIRE(root.kind == jvalue::object_v);
  // the padding is spaces only, fewer than 8 of them
  CHECK(p.rest().find_first_not_of(' ') == std::string_view::npos);
  CHECK(p.rest().size() < 8);

  // expected order: decreasing alignment (item size; 1 for sub-byte), then name
  std::vector<const input_tensor*> order;
  for (const auto& t : in) order.push_back(&t);
  auto align = [](const input_tensor* t) { return t->bits % 8 == 0 ? t->bits / 8 : 1u; };
  std::sort(order.begin(), order.end(),
            [&](auto* a, auto* b) { return align(a) != align(b) ? align(a) > align(b) : a->name < b->name; });
  std::size_t k = 0;
  if (!md.empty()) {
    REQUIRE(root.members.size() > 0);
    CHECK(root.members[0].first == "__metadata__");
    const jvalue& m = root.members[0].second;
    REQUIRE(m.kind == jvalue::object_v);
    REQUIRE(m.members.size() == md.size());
    for (const auto& [key, v] : m.members) {
      CHECK(v.kind == jvalue::string_v);
      CHECK(md.at(key) == v.text);
    }
    k = 1;
  }
  REQUIRE(root.members.size() == k + order.size());
  std::uint64_t expected_begin = 0;
  for (std::size_t i = 0; i < order.size(); ++i, ++k) {
    const input_tensor& t = *order[i];
    const auto& [key, e] = root.members[k];
    INFO("tensor " << t.name);
    CHECK(key == t.name);
    REQUIRE(e.kind == jvalue::object_v);
    CHECK(member(e, "dtype").text == t.dtype_name);
    const jvalue& shape = member(e, "shape");
    REQUIRE(shape.items.size() == t.shape.size());
    for (std::size_t d = 0; d < t.shape.size(); ++d) CHECK(to_u64(shape.items[d]) == t.shape[d]);
    const jvalue& offs = member(e, "data_offsets");
    REQUIRE(offs.items.size() == 2);
    const std::uint64_t b = to_u64(offs.items[0]), en = to_u64(offs.items[1]);
    CHECK(b == expected_begin);  // offsets tile the buffer
    CHECK(en - b == t.bytes.size());
    CHECK((data_start + b) % align(&t) == 0);  // aligned to its element size in the file
    REQUIRE(data_start + en <= file.size());
    CHECK((t.bytes.empty() || std::memcmp(file.data() + data_start + b, t.bytes.data(), t.bytes.size()) == 0));
    expected_begin = en;
  }
  CHECK(data_start + expected_begin == file.size());  // the file ends where the last tensor ends
}

/// Parses with the library and reads everything back through storage s.
template <ReadableStorage S>
void check_read_back(const S& s, const std::vector<input_tensor>& in, const std::map<std::string, std::string>& md,
                     std::mt19937_64& rng) {
  safetensors_header h = read_safetensors_header(s);
  CHECK(h.file == std::string(s.name()));
  CHECK(h.file_size() == s.size());
  CHECK(h.data_start() % 8 == 0);
  CHECK(h.metadata == md);
  CHECK(h.has_metadata == !md.empty());
  REQUIRE(h.tensors.size() == in.size());
  std::vector<std::string> want_names;
  for (const auto& t : in) want_names.push_back(t.name);
  std::sort(want_names.begin(), want_names.end());
  auto names = h.names();
  CHECK(std::vector<std::string>(names.begin(), names.end()) == want_names);
  for (const auto& t : in) {
    INFO("tensor " << t.name);
    const tensor_entry& e = h.at(t.name);
    CHECK(to_string(e.type) == t.dtype_name);
    CHECK(e.shape == t.shape);
    CHECK(e.nbytes() == t.bytes.size());
    std::vector<std::byte> got(t.bytes.size());
    read_tensor(s, h, e, got);
    CHECK(got == t.bytes);
    if (t.bits % 8 != 0) {
      std::vector<std::byte> one(1);
      CHECK_THROWS_AS(read_elements(s, h, e, 0, one), shardsafe::error);
      try {
        read_elements(s, h, e, 0, one);
      } catch (const error& x) {
        CHECK(x.code() == errc::unsupported_dtype);
        CHECK(std::string(x.what()).find(t.dtype_name) != std::string::npos);
      }
      continue;
    }
    const std::uint64_t isz = t.bits / 8, n = t.bytes.size() / isz;
    for (int trial = 0; trial < 4; ++trial) {  // random element sub-ranges, empty ones included
      const std::uint64_t first = n ? rng() % (n + 1) : 0;
      const std::uint64_t count = (n - first) ? rng() % (n - first + 1) : 0;
      std::vector<std::byte> part(count * isz);
      read_elements(s, h, e, first, part);
      CHECK(std::equal(part.begin(), part.end(), t.bytes.begin() + static_cast<std::ptrdiff_t>(first * isz)));
      const byte_range r = element_byte_range(h, e, first, count);
      CHECK(r.begin == h.data_start() + e.begin + first * isz);
      CHECK(r.size() == count * isz);
    }
    std::vector<std::byte> past((n + 1) * isz);
    CHECK_THROWS_AS(read_elements(s, h, e, 0, past), shardsafe::error);
    if (isz > 1) {
      std::vector<std::byte> ragged(isz + 1);
      CHECK_THROWS_AS(read_elements(s, h, e, 0, ragged), shardsafe::error);
    }
  }
  CHECK(h.find("no such tensor") == nullptr);
  CHECK_THROWS_WITH_AS(h.at("nope"), (std::string(s.name()) + ": no tensor 'nope'").c_str(), shardsafe::error);
}

using testing::expect_error;

}  // namespace

TEST_CASE("safetensors: round trip of every dtype, 0-d and empty tensors, __metadata__") {
  std::mt19937_64 rng(20240611);
  const auto in = make_inputs(rng);
  const auto td = to_tensor_data(in);
  const std::map<std::string, std::string> md{{"format", "pt"}, {"note", "quote \" and \xc3\xa9"}, {"z", ""}};

  SUBCASE("memory_writer") {
    for (const auto& meta : {md, std::map<std::string, std::string>{}}) {
      memory_writer w("mem.safetensors");
      write_safetensors(w, std::span<const tensor_data>(td), meta);
      const byte_buffer bytes = w.take();
      check_bytes(as_string(bytes), in, meta);
      const memory_storage s(bytes, "mem.safetensors");
      check_read_back(s, in, meta, rng);
      CHECK(parse_safetensors(bytes, "x").tensors.size() == in.size());
    }
  }
  SUBCASE("files through file_directory, read by file_storage and mmap_storage") {
    temp_dir tmp;
    file_directory dir(tmp.path);
    auto w = dir.create("model.safetensors");
    write_safetensors(w, std::span<const tensor_data>(td), md);
    CHECK(dir.list() == std::vector<std::string>{"model.safetensors"});
    const fs::path p = tmp.path / "model.safetensors";
    std::ifstream f(p, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    check_bytes(bytes, in, md);
    check_read_back(file_storage(p), in, md, rng);
    check_read_back(mmap_storage(p), in, md, rng);
    // the same bytes as the in-memory writer
    memory_writer mw("m");
    write_safetensors(mw, std::span<const tensor_data>(td), md);
    CHECK(as_string(mw.take()) == bytes);
  }
}

TEST_CASE("safetensors: exact bytes of small files") {
  SUBCASE("no tensors") {
    memory_writer w("e");
    write_safetensors(w, std::span<const tensor_data>{});
    CHECK(as_string(w.take()) == corpus::le64(8) + "{}      ");
  }
  SUBCASE("one tensor and metadata") {
    const std::string a = "\x01\x02\x03", b = "\x10\x11\x12\x13";
    std::vector<tensor_data> td{{"b", dtype::F16, {2}, as_span(b)}, {"a", dtype::U8, {3}, as_span(a)}};
    memory_writer w("f");
    write_safetensors(w, std::span<const tensor_data>(td), {{"k", "v"}});
    std::string json = R"({"__metadata__":{"k":"v"},"b":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},)"
                       R"("a":{"dtype":"U8","shape":[3],"data_offsets":[4,7]}})";
    json.append((8 - json.size() % 8) % 8, ' ');
    CHECK(as_string(w.take()) == corpus::le64(json.size()) + json + b + a);
  }
}

TEST_CASE("safetensors: the writer refuses bad input and commits nothing") {
  const std::string four = "abcd";
  auto attempt = [&](std::vector<tensor_data> td, std::map<std::string, std::string> md = {}) {
    memory_directory dir;
    auto w = dir.create("out.safetensors");
    try {
      write_safetensors(w, std::span<const tensor_data>(td), md);
    } catch (...) {
      CHECK_FALSE(dir.exists("out.safetensors"));
      throw;
    }
  };
  expect_error([&] { attempt({{"a", dtype::U8, {4}, as_span(four)}, {"a", dtype::U8, {4}, as_span(four)}}); },
               errc::invalid_argument, {"out.safetensors", "tensor 'a'", "twice"});
  expect_error([&] { attempt({{"", dtype::U8, {4}, as_span(four)}}); }, errc::invalid_argument,
               {"not a valid tensor name"});
  expect_error([&] { attempt({{"__metadata__", dtype::U8, {4}, as_span(four)}}); }, errc::invalid_argument,
               {"__metadata__"});
  expect_error([&] { attempt({{"bad\xff", dtype::U8, {4}, as_span(four)}}); }, errc::invalid_argument,
               {"not a valid tensor name"});
  expect_error([&] { attempt({{"q", dtype::F4, {3}, as_span(four)}}); }, errc::invalid_shape,
               {"tensor 'q'", "whole number of bytes"});
  expect_error([&] { attempt({{"q", dtype::F6_E2M3, {}, as_span(four)}}); }, errc::invalid_shape, {"tensor 'q'"});
  expect_error([&] { attempt({{"o", dtype::F32, {std::uint64_t(1) << 62, 8}, as_span(four)}}); }, errc::invalid_shape,
               {"tensor 'o'"});
  expect_error([&] { attempt({{"s", dtype::F32, {2}, as_span(four)}}); }, errc::invalid_argument,
               {"tensor 's'", "4 of 8 bytes were written"});
  expect_error([&] { attempt({{"l", dtype::U8, {2}, as_span(four)}}); }, errc::invalid_argument,
               {"tensor 'l'", "passes its 2 bytes"});
  expect_error([&] { attempt({{"a", dtype::U8, {4}, as_span(four)}}, {{"k", "\xc3"}}); }, errc::invalid_argument,
               {"__metadata__", "'k'"});
}

TEST_CASE("safetensors: streaming writer, parts out of order from several threads") {
  std::vector<float> w(4096), b(37);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = float(i) * 0.5f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = -float(i);
  std::vector<tensor_entry> entries{{"w", dtype::F32, {64, 64}, 0, 0}, {"b", dtype::F32, {37}, 0, 0}};
  auto layout = plan_safetensors(entries, {}, "stream.safetensors");
  CHECK(layout.tensors[0].name == "b");  // equal alignment: name order
  CHECK(layout.index_of("w") == 1);
  CHECK_THROWS_AS(layout.index_of("x"), shardsafe::error);
  memory_writer out("stream.safetensors");
  safetensors_writer<memory_writer> sw(out, layout);
  auto wb = std::as_bytes(std::span(w));
  std::vector<std::thread> threads;
  for (int t = 3; t >= 0; --t)  // four disjoint quarters, last first
    threads.emplace_back([&, t] {
      sw.write_part(1, std::size_t(t) * wb.size() / 4, wb.subspan(std::size_t(t) * wb.size() / 4, wb.size() / 4));
    });
  for (auto& th : threads) th.join();
  sw.write("b", std::as_bytes(std::span(b)));
  sw.finish();
  const byte_buffer bytes = out.take();
  CHECK(bytes.size() == layout.file_size());
  const memory_storage s(bytes, "stream.safetensors");
  auto h = read_safetensors_header(s);
  std::vector<float> got(w.size());
  read_tensor(s, h, h.at("w"), std::as_writable_bytes(std::span(got)));
  CHECK(got == w);
}

TEST_CASE("safetensors: streaming writer refuses overlapping parts and names the first missing byte") {
  const std::vector<std::byte> data(16, std::byte{7});
  const auto part = [&](std::size_t n) { return std::span(data).first(n); };
  auto layout = plan_safetensors({{"t", dtype::U8, {16}, 0, 0}}, {}, "parts.safetensors");
  {  // the same 4 bytes twice and 4 never: the byte count alone would be 16 of 16
    memory_writer out("parts.safetensors");
    safetensors_writer<memory_writer> sw(out, layout);
    sw.write_part(0, 0, part(4));
    sw.write_part(0, 8, part(8));
    expect_error([&] { sw.write_part(0, 0, part(4)); }, errc::invalid_argument,
                 {"parts.safetensors", "tensor 't'", "bytes [0, 4) overlap bytes [0, 4) written before"});
    expect_error([&] { sw.write_part(0, 6, part(3)); }, errc::invalid_argument, {"bytes [6, 9) overlap bytes [8, 16)"});
    expect_error([&] { sw.finish(); }, errc::invalid_argument,
                 {"tensor 't'", "12 of 16 bytes", "byte 4 first missing"});
    sw.write_part(0, 4, part(0));  // empty parts are no-ops anywhere in range
    sw.write_part(0, 4, part(4));  // fills the hole; [0, 16) is now one range
    expect_error([&] { sw.write_part(0, 15, part(1)); }, errc::invalid_argument, {"overlap bytes [0, 16)"});
    sw.finish();
    CHECK(out.take().size() == layout.file_size());
  }
}

TEST_CASE("safetensors: every malformed file is rejected with its errc, file, tensor and rule") {
  temp_dir tmp;
  for (const auto& c : corpus::malformed()) {
    INFO("case " << c.name);
    const std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(c.bytes.data()),
                                       reinterpret_cast<const std::byte*>(c.bytes.data()) + c.bytes.size());
    std::vector<std::string> phrases = c.phrases;
    phrases.push_back(c.name);
    expect_error([&] { parse_safetensors(bytes, c.name); }, c.code, phrases);
    expect_error([&] { read_safetensors_header(memory_storage(bytes, c.name)); }, c.code, phrases);
    // and from files, where the message names the path
    const fs::path p = tmp.path / c.name;
    std::ofstream(p, std::ios::binary).write(c.bytes.data(), static_cast<std::streamsize>(c.bytes.size()));
    phrases.back() = p.string();
    expect_error([&] { read_safetensors_header(file_storage(p)); }, c.code, phrases);
    expect_error([&] { read_safetensors_header(mmap_storage(p)); }, c.code, phrases);
  }
  // one file per rule: names are unique
  auto all = corpus::malformed();
  std::vector<std::string> names;
  for (const auto& c : all) names.push_back(c.name);
  std::sort(names.begin(), names.end());
  CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());
}

TEST_CASE("safetensors: valid edge cases are accepted") {
  for (const auto& c : corpus::valid_edges()) {
    INFO("case " << c.name);
    const std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(c.bytes.data()),
                                       reinterpret_cast<const std::byte*>(c.bytes.data()) + c.bytes.size());
    safetensors_header h;
    try {
      h = parse_safetensors(bytes, c.name);
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
    CHECK(h.tensors.size() == c.tensors);
    CHECK(h.file_size() == bytes.size());
  }
  // details of some of them
  auto find = [](std::string_view n) {
    for (const auto& c : corpus::valid_edges())
      if (c.name == n) return c.bytes;
    FAIL("no case");
    return std::string();
  };
  const std::string shared = find("empty_tensors_shared_offset.safetensors");
  const memory_storage s(std::vector<std::byte>(reinterpret_cast<const std::byte*>(shared.data()),
                                                reinterpret_cast<const std::byte*>(shared.data()) + shared.size()),
                         "shared");
  auto h = read_safetensors_header(s);
  CHECK(h.data_size == 4);
  CHECK(h.at("b").shape == shape_t{3, 0});
  CHECK(h.at("d").begin == 4);
  std::vector<std::byte> none;
  read_tensor(s, h, h.at("e"), none);
  read_elements(s, h, h.at("b"), 0, none);
  std::array<std::byte, 4> c{};
  read_tensor(s, h, h.at("c"), c);
  CHECK(as_string(c) == "abcd");

  const std::string md = find("metadata_only.safetensors");
  auto hm = parse_safetensors(as_span(md), "m");
  CHECK(hm.has_metadata);
  CHECK(hm.metadata == std::map<std::string, std::string>{{"format", "pt"}});
  const std::string z = find("zero_d.safetensors");
  auto hz = parse_safetensors(as_span(z), "z");
  CHECK(hz.at("s").shape.empty());
  CHECK(hz.at("s").numel() == 1);
  CHECK(hz.at("s").nbytes() == 8);
  const std::string lw = find("leading_whitespace.safetensors");
  CHECK(parse_safetensors(as_span(lw), "lw").at("w").nbytes() == 2);
}

TEST_CASE("render_safetensors_bytes: any window of the file, as the streaming writer writes it") {
  // tensors of several dtypes and sizes, empty ones among them; some of 1 MiB and more so that
  // the streaming copies take part
  std::mt19937_64 rng(5);
  std::vector<std::vector<std::byte>> bufs;
  std::vector<tensor_data> td;
  const std::vector<std::pair<dtype, shape_t>> defs = {
      {dtype::F32, {3, 5}}, {dtype::BF16, {7}}, {dtype::U8, {0}},       {dtype::I64, {2, 2}},   {dtype::F32, {300'000}},
      {dtype::U8, {1}},     {dtype::F64, {}},   {dtype::I8, {2, 0, 3}}, {dtype::F16, {600'001}}};
  for (std::size_t i = 0; i < defs.size(); ++i) {
    const std::uint64_t n = numel(defs[i].second) * item_size(defs[i].first);
    bufs.emplace_back(n);
    for (auto& b : bufs.back()) b = static_cast<std::byte>(rng());
  }
  for (std::size_t i = 0; i < defs.size(); ++i)
    td.push_back({"t" + std::to_string(i), defs[i].first, defs[i].second, bufs[i]});
  memory_writer mw("ref");
  write_safetensors(mw, std::span<const tensor_data>(td), {{"k", "v"}});
  const byte_buffer ref = mw.take();

  std::vector<tensor_entry> entries;
  for (const auto& t : td) entries.push_back({t.name, t.type, t.shape, 0, 0});
  const safetensors_layout layout = plan_safetensors(entries, {{"k", "v"}}, "rendered");
  REQUIRE(layout.file_size() == ref.size());
  std::vector<const std::byte*> data(layout.tensors.size());
  for (std::size_t i = 0; i < layout.tensors.size(); ++i)
    data[i] = bufs[std::stoul(layout.tensors[i].name.substr(1))].data();

  std::vector<std::pair<std::uint64_t, std::uint64_t>> windows = {{0, ref.size()},     {0, 1},         {0, 8}, {3, 100},
                                                                  {ref.size() - 1, 1}, {ref.size(), 0}};
  for (int i = 0; i < 200; ++i) {
    const std::uint64_t off = rng() % ref.size();
    windows.emplace_back(off, rng() % (ref.size() - off + 1));
  }
  for (std::uint64_t b = 0; b < ref.size(); b += 8192)
    windows.emplace_back(b, std::min<std::uint64_t>(8192, ref.size() - b));
  for (const auto& [off, len] : windows) {
    std::vector<std::byte> out(len + 2, std::byte{0x5a});
    render_safetensors_bytes(layout, data, off, std::span(out).subspan(1, len));
    REQUIRE(std::equal(out.begin() + 1, out.begin() + 1 + static_cast<std::ptrdiff_t>(len),
                       ref.begin() + static_cast<std::ptrdiff_t>(off)));
    CHECK(out.front() == std::byte{0x5a});
    CHECK(out.back() == std::byte{0x5a});
  }
  std::vector<std::byte> one(1);
  CHECK_THROWS_AS(render_safetensors_bytes(layout, data, ref.size(), one), shardsafe::error);
  CHECK_THROWS_AS(render_safetensors_bytes(layout, std::span(data).first(1), 0, one), shardsafe::error);
}

namespace {
// A storage that counts the reads made of it, and the bytes they asked for.
struct counting_storage {
  memory_storage inner;
  mutable int reads = 0;
  mutable std::uint64_t bytes = 0;
  std::uint64_t size() const { return inner.size(); }
  std::string_view name() const { return inner.name(); }
  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    ++reads;
    bytes += dst.size();
    inner.read_into(off, dst);
  }
};

// A file with one U8 tensor "t" of `data` bytes and a header of exactly n bytes (the JSON
// padded with spaces, which the format allows).
std::string file_with_header_length(std::uint64_t n, std::uint64_t data) {
  std::string json = "{\"t\":{\"dtype\":\"U8\",\"shape\":[" + std::to_string(data) + "],\"data_offsets\":[0," +
                     std::to_string(data) + "]}}";
  REQUIRE(json.size() <= n);
  json.resize(n, ' ');
  std::string f(8, '\0');
  for (int i = 0; i < 8; ++i) f[std::size_t(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  f += json;
  for (std::uint64_t i = 0; i < data; ++i) f += static_cast<char>(i * 7);
  return f;
}
}  // namespace

TEST_CASE("read_safetensors_header: one read when 8 + N fits the probe, two when it does not") {
  static_assert(header_probe_bytes == 65536);
  struct row {
    std::uint64_t n, data;
    int reads;
  };
  for (const row r : {row{64, 3, 1}, row{header_probe_bytes - 8, 5, 1}, row{header_probe_bytes - 7, 5, 2},
                      row{3 * header_probe_bytes, 100, 2}, row{100, header_probe_bytes * 2, 1}}) {
    INFO("N = " << r.n << ", data = " << r.data);
    const std::string f = file_with_header_length(r.n, r.data);
    counting_storage s{memory_storage(byte_buffer(as_span(f).begin(), as_span(f).end()), "probe.safetensors"), 0, 0};
    const safetensors_header h = read_safetensors_header(s);
    CHECK(s.reads == r.reads);
    // the probe reads at most its size or the file; the second read only the rest of the header
    CHECK(s.bytes == std::max<std::uint64_t>(std::min<std::uint64_t>(f.size(), header_probe_bytes), 8 + r.n));
    CHECK(h.header_size == r.n);
    REQUIRE(h.tensors.size() == 1);
    CHECK(h.at("t").nbytes() == r.data);
    CHECK(h.offset_of(h.at("t")) == 8 + r.n);
    // and the same header as parsing the whole file in memory
    CHECK(parse_safetensors(as_span(f), "probe.safetensors").data_start() == h.data_start());
  }
  // a header length past the file is still refused before a second read
  std::string bad = file_with_header_length(100, 1);
  bad[1] = '\x10';  // N = 4196 > file
  counting_storage s{memory_storage(byte_buffer(as_span(bad).begin(), as_span(bad).end()), "bad.safetensors"), 0, 0};
  CHECK_THROWS_WITH(read_safetensors_header(s), doctest::Contains("runs past the end"));
  CHECK(s.reads == 1);
}

TEST_CASE("read_safetensors_header: header_keep keeps what it says, and checks every rule on all of it") {
  using corpus::entry;
  using corpus::file_bytes;
  auto read = [](const std::string& f, header_keep keep) {
    return read_safetensors_header(
        memory_storage(std::vector<std::byte>(reinterpret_cast<const std::byte*>(f.data()),
                                              reinterpret_cast<const std::byte*>(f.data() + f.size())),
                       "keep.safetensors"),
        std::move(keep));
  };
  const std::string data = "abcdefghij";
  const std::string json = "{\"__metadata__\":{\"format\":\"pt\"}," + entry("a", "U8", "[4]", "[0,4]") + "," +
                           entry("b", "U8", "[2]", "[4,6]") + "," + entry("c", "U8", "[4]", "[6,10]") + "}";
  const std::string f = file_bytes(json, data);
  const header_keep only_b{[](std::string_view n) { return n == "b"; }, false};
  const safetensors_header all = read(f, {});
  CHECK(all.tensors.size() == 3);
  CHECK(all.metadata.size() == 1);
  const safetensors_header h = read(f, only_b);
  REQUIRE(h.tensors.size() == 1);
  CHECK(h.tensors[0].name == "b");
  CHECK(h.offset_of(h.at("b")) == all.offset_of(all.at("b")));
  CHECK(!h.find("a"));
  CHECK(!h.find("c"));
  CHECK(h.has_metadata);  // present, checked, not kept
  CHECK(h.metadata.empty());
  CHECK(h.data_size == data.size());  // the tensors let go count in the tiling
  CHECK(h.file_size() == f.size());
  // the rules hold for the tensors let go as for those kept: a name twice, a hole, an overlap,
  // a truncated buffer, each named as without header_keep
  struct bad {
    std::string json;
    errc code;
    std::vector<std::string> phrases;
  };
  for (const bad& c : std::vector<bad>{
           {"{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "U8", "[2]", "[4,6]") + "," +
                entry("a", "U8", "[4]", "[6,10]") + "}",
            errc::invalid_header,
            {"keep.safetensors", "name 'a' appears twice"}},
           {"{" + entry("a", "U8", "[3]", "[0,3]") + "," + entry("b", "U8", "[2]", "[4,6]") + "," +
                entry("c", "U8", "[4]", "[6,10]") + "}",
            errc::invalid_offsets,
            {"tensor 'b'", "leave a hole", "[3, 4)"}},
           {"{" + entry("a", "U8", "[5]", "[0,5]") + "," + entry("b", "U8", "[2]", "[4,6]") + "," +
                entry("c", "U8", "[4]", "[6,10]") + "}",
            errc::invalid_offsets,
            {"tensor 'b'", "overlap tensor 'a'"}},
           {"{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "U8", "[2]", "[4,6]") + "," +
                entry("c", "U8", "[5]", "[6,11]") + "}",
            errc::truncated,
            {"tensor 'c'", "truncated"}},
       }) {
    INFO(c.json);
    const std::string bad_file = file_bytes(c.json, data);
    expect_error([&] { read(bad_file, {}); }, c.code, c.phrases);
    expect_error([&] { read(bad_file, only_b); }, c.code, c.phrases);
    expect_error([&] { read(bad_file, {[](std::string_view) { return false; }, true}); }, c.code, c.phrases);
  }
}
