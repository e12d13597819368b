// shardsafe/detail/json.hpp - small helpers for reading (simdjson DOM, and On-Demand for large documents) and writing JSON.
//
// Writing follows Python's json.dumps layout (", " and ": " separators, no indent) so the
// files we write diff cleanly against the ones Python tools write.
#pragma once

#include <simdjson.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"

namespace shardsafe::detail {

/// Appends s as a JSON string literal. s must be valid UTF-8 (checked by callers that take
/// names from users); control characters are escaped. With ascii_only, DEL and every non-ASCII
/// character is written as \uXXXX (surrogate pairs past U+FFFF), as Python's json.dumps does.
inline void append_json_string(std::string& out, std::string_view s, bool ascii_only = false) {
  auto u16 = [&](unsigned v) {
    out += "\\u";
    append_hex(out, v, 4);
  };
  out += '"';
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (ascii_only && c >= 0x80) {
      // decode one UTF-8 sequence (s is valid UTF-8)
      const int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
      unsigned cp = c & (len == 4 ? 0x07 : len == 3 ? 0x0F : 0x1F);
      for (int k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
      i += static_cast<std::size_t>(len - 1);
      if (cp >= 0x10000) {
        cp -= 0x10000;
        u16(0xD800 + (cp >> 10));
        u16(0xDC00 + (cp & 0x3FF));
      } else {
        u16(cp);
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ascii_only && c == 0x7f)) {  // json.dumps' ensure_ascii escapes DEL too
          u16(c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

inline bool is_valid_utf8(std::string_view s) noexcept {
  return simdjson::validate_utf8(s.data(), s.size());
}

/// For a document simdjson refused because of a number: finds the first number literal that
/// fits neither a 64-bit integer nor a finite double and says where it is, as a path of keys
/// and indices (`w.data_offsets[1]`: tensor `w`, field `data_offsets`, second element) and a
/// byte offset. Empty when no such literal is found (the number error is then a malformed
/// literal, which the parser's own message covers). One pass, no allocation beyond the path.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::string locate_bad_number(std::string_view text) {
  struct level {
    bool object;
    std::string key;
    std::size_t index = 0;
  };
  std::vector<level> stack;
  std::string pending_key;  // the last string seen where an object expects a key
  bool expect_key = false;
  auto path = [&] {
    std::string p;
    for (const auto& l : stack) {
      if (l.object) {
        if (!p.empty()) p += '.';
        p += l.key.size() > 80 ? l.key.substr(0, 80) + "..." : l.key;
      } else {
        p += '[' + std::to_string(l.index) + ']';
      }
    }
    return p.empty() ? std::string("the top level") : p;
  };
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      const std::size_t start = ++i;
      while (i < text.size() && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
      if (i > text.size()) i = text.size();
      if (expect_key && !stack.empty() && stack.back().object) {
        pending_key.assign(text.substr(start, i - start));
        expect_key = false;
      }
      ++i;
    } else if (c == '{' || c == '[') {
      stack.push_back(level{c == '{', {}, 0});
      expect_key = c == '{';
      ++i;
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      ++i;
    } else if (c == ':') {
      if (!stack.empty() && stack.back().object) stack.back().key = pending_key;
      ++i;
    } else if (c == ',') {
      if (!stack.empty()) {
        if (stack.back().object) expect_key = true;
        else ++stack.back().index;
      }
      ++i;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      const std::size_t start = i;
      bool integral = true;
      while (i < text.size() && (std::strchr("0123456789+-.eE", text[i]) != nullptr)) {
        if (text[i] == '.' || text[i] == 'e' || text[i] == 'E') integral = false;
        ++i;
      }
      const std::string lit(text.substr(start, i - start));
      const char* b = lit.data();
      const char* e = b + lit.size();
      std::string why;
      if (integral) {
        if (lit[0] == '-') {
          std::int64_t v;
          if (std::from_chars(b, e, v).ec == std::errc::result_out_of_range) why = "is below the smallest 64-bit integer";
        } else {
          std::uint64_t v;
          if (std::from_chars(b, e, v).ec == std::errc::result_out_of_range) why = "does not fit a 64-bit integer";
        }
      } else {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(lit.c_str(), &end);
        if (errno == ERANGE && std::isinf(v)) why = "is too large for a double";
      }
      if (!why.empty()) {
        const std::string shown = lit.size() > 40 ? lit.substr(0, 40) + "..." : lit;
        return "the number " + shown + " at byte " + std::to_string(start) + " of the JSON (" + path() + ") " + why;
      }
    } else {
      ++i;
    }
  }
  return {};
}
#else
SHARDSAFE_DECL std::string locate_bad_number(std::string_view text);
#endif

/// Throws errc::invalid_json for a simdjson error in `what`: "not valid JSON (why)", with where a
/// number that does not fit is.
[[noreturn]] inline void json_error(const std::string& what, simdjson::error_code err, std::string_view text) {
  std::string msg = what + ": not valid JSON (" + simdjson::error_message(err) + ")";
  if (err == simdjson::NUMBER_ERROR) {
    const std::string where = locate_bad_number(text);
    if (!where.empty()) msg += ": " + where;
  }
  fail(errc::invalid_json, msg);
}

/// The message for an object of `what` whose `keys` (sorted here) hold one twice; "" when none
/// does. path_of() gives where the object is ("" for the top level), asked only for the message.
template <class PathOf>
std::string duplicate_key_problem(std::vector<std::string_view>& keys, const std::string& what, PathOf&& path_of) {
  std::sort(keys.begin(), keys.end());
  const auto d = std::adjacent_find(keys.begin(), keys.end());
  if (d == keys.end()) return {};
  const std::string path = path_of();
  std::string k(*d);
  for (auto& c : k)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return what + ": key '" + k + "' appears twice in one object" +
         (path.empty() ? std::string(" (the top level)") : " (at " + path + ")") + "; readers would disagree on its value";
}

/// Refuses an object that holds a key twice, anywhere in the document (errc::invalid_json naming
/// `what`, the key and where: `tensors.w`). JSON leaves duplicate keys to the reader, and readers
/// differ (simdjson's DOM gives the first, Python's json the last): a file holding two values for
/// one key would load as different tensors in two programs, so no shardsafe reader accepts one
/// (the safetensors crate refuses them in headers too). O(n log n) in the document's keys, no
/// recursion (objects and arrays are walked from an explicit stack).
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL void require_unique_keys(simdjson::dom::element root, const std::string& what) {
  // Every object and array met, with its parent and its key in it (or its index): the path of
  // one is built only for a message, so memory stays linear in the document whatever its depth
  // and its keys' lengths.
  constexpr std::size_t none = std::size_t(-1);
  struct container {
    simdjson::dom::element e;
    std::size_t parent;
    std::string_view key;  // in the parent object; empty with index when the parent is an array
    std::size_t index;
  };
  std::vector<container> seen{{root, none, {}, 0}};
  std::vector<std::size_t> todo{0};
  auto path_of = [&](std::size_t at) {
    std::vector<std::size_t> chain;
    for (std::size_t i = at; seen[i].parent != none; i = seen[i].parent) chain.push_back(i);
    std::string path;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      const container& c = seen[*it];
      const bool in_array = seen[c.parent].e.type() == simdjson::dom::element_type::ARRAY;
      if (in_array) path += "[" + std::to_string(c.index) + "]";
      else path += (path.empty() ? "" : ".") + std::string(c.key);
    }
    return path;
  };
  std::vector<std::string_view> keys;
  while (!todo.empty()) {
    const std::size_t at = todo.back();
    todo.pop_back();
    const simdjson::dom::element e = seen[at].e;
    simdjson::dom::object o;
    simdjson::dom::array a;
    if (!e.get_object().get(o)) {
      keys.clear();
      for (auto kv : o) {
        keys.push_back(kv.key);
        const auto t = kv.value.type();
        if (t == simdjson::dom::element_type::OBJECT || t == simdjson::dom::element_type::ARRAY) {
          todo.push_back(seen.size());
          seen.push_back({kv.value, at, kv.key, 0});
        }
      }
      if (const std::string problem = duplicate_key_problem(keys, what, [&] { return path_of(at); }); !problem.empty())
        fail(errc::invalid_json, problem);
    } else if (!e.get_array().get(a)) {
      std::size_t i = 0;
      for (auto v : a) {
        const auto t = v.type();
        if (t == simdjson::dom::element_type::OBJECT || t == simdjson::dom::element_type::ARRAY) {
          todo.push_back(seen.size());
          seen.push_back({v, at, {}, i});
        }
        ++i;
      }
    }
  }
}
#else
SHARDSAFE_DECL void require_unique_keys(simdjson::dom::element root, const std::string& what);
#endif

/// Parses `text` into a DOM held by `parser`; throws errc::invalid_json naming `what`.
inline simdjson::dom::element parse_json(simdjson::dom::parser& parser, std::string_view text,
                                         const std::string& what) {
  if (!is_valid_utf8(text)) fail(errc::invalid_json, what + ": not valid UTF-8");
  simdjson::dom::element root;
  if (auto err = parser.parse(text.data(), text.size(), /*realloc_if_needed=*/true).get(root)) json_error(what, err, text);
  return root;
}

/// A non-negative integer from a JSON number; nullopt for negative, fractional or non-numbers.
inline std::optional<std::uint64_t> as_count(simdjson::dom::element e) noexcept {
  using t = simdjson::dom::element_type;
  switch (e.type()) {
    case t::UINT64: return std::uint64_t(e.get_uint64().value_unsafe());
    case t::INT64: {
      std::int64_t v = e.get_int64().value_unsafe();
      if (v < 0) return std::nullopt;
      return std::uint64_t(v);
    }
    default: return std::nullopt;
  }
}

/// Describes why as_count refused e, for messages.
inline std::string count_problem(simdjson::dom::element e) {
  using t = simdjson::dom::element_type;
  switch (e.type()) {
    case t::INT64: return "negative number " + std::to_string(e.get_int64().value_unsafe());
    case t::DOUBLE: return "non-integer number";
    case t::STRING: return "a string";
    case t::NULL_VALUE: return "null";
    case t::BOOL: return "a boolean";
    case t::ARRAY: return "an array";
    case t::OBJECT: return "an object";
    default: return "not a non-negative integer";
  }
}

/// Reads a JSON array of non-negative integers; throws naming the field.
inline std::vector<std::uint64_t> parse_count_array(simdjson::dom::element e, const std::string& ctx,
                                                    std::string_view field, errc code) {
  simdjson::dom::array arr;
  if (e.get_array().get(arr))
    fail(code, ctx + ": " + std::string(field) + " is not an array");
  std::vector<std::uint64_t> out;
  out.reserve(arr.size());
  std::size_t i = 0;
  for (auto v : arr) {
    auto c = as_count(v);
    if (!c)
      fail(code, ctx + ": " + std::string(field) + "[" + std::to_string(i) + "] is " + count_problem(v) +
                     ", not a non-negative integer");
    out.push_back(*c);
    ++i;
  }
  return out;
}

// --- On-Demand (no DOM): for documents that may be large (metadata.json) ---
//
// A DOM costs about four times the text (its tape, strings and structural index) on top of what
// the reader builds from it; simdjson's On-Demand API reads values in place instead. A reader
// walks the text twice: json_check first (every value read, so the text is validated as the DOM
// parser validates it, and duplicate keys found), then its own schema over the rewound document.

/// The text of `text` as simdjson needs it (64 readable bytes past the end): in place when
/// `owner` holds it with that spare capacity (read_text leaves it), else copied into `copy`.
inline simdjson::padded_string_view padded_json(std::string_view text, const std::string* owner, simdjson::padded_string& copy) {
  if (owner && owner->data() == text.data() && owner->capacity() >= text.size() + simdjson::SIMDJSON_PADDING)
    return simdjson::padded_string_view(text.data(), text.size(), owner->capacity());
  copy = simdjson::padded_string(text);
  return copy;
}

/// The first duplicate key json_check met (empty: none), as the message require_unique_keys gives.
struct json_check_result {
  std::string duplicate;
};

namespace ondemand_walk {
// The nesting the DOM parser allows (simdjson's default); deeper is refused before it is walked.
inline constexpr std::size_t max_depth = simdjson::DEFAULT_MAX_DEPTH;
inline void value(simdjson::ondemand::value v, std::string& path, json_check_result& r, const std::string& what,
                  std::string_view text, std::size_t depth);
inline void check(simdjson::error_code e, const std::string& what, std::string_view text) {
  if (e) json_error(what, e, text);
}
inline void object(simdjson::ondemand::object o, std::string& path, json_check_result& r, const std::string& what,
                   std::string_view text, std::size_t depth) {
  std::vector<std::string_view> keys;
  for (auto field : o) {
    simdjson::ondemand::field f;
    check(std::move(field).get(f), what, text);
    std::string_view k;
    check(f.unescaped_key().get(k), what, text);
    keys.push_back(k);
    const std::size_t at = path.size();
    path += path.empty() ? "" : ".";
    path += k;
    value(f.value(), path, r, what, text, depth + 1);
    path.resize(at);
  }
  if (r.duplicate.empty()) r.duplicate = duplicate_key_problem(keys, what, [&] { return path; });
}
inline void value(simdjson::ondemand::value v, std::string& path, json_check_result& r, const std::string& what,
                  std::string_view text, std::size_t depth) {
  if (depth > max_depth) json_error(what, simdjson::DEPTH_ERROR, text);
  using jt = simdjson::ondemand::json_type;
  jt type;
  check(v.type().get(type), what, text);
  switch (type) {
    case jt::object: {
      simdjson::ondemand::object o;
      check(v.get_object().get(o), what, text);
      object(o, path, r, what, text, depth);
      break;
    }
    case jt::array: {
      simdjson::ondemand::array a;
      check(v.get_array().get(a), what, text);
      std::size_t i = 0;
      for (auto item : a) {
        simdjson::ondemand::value x;
        check(std::move(item).get(x), what, text);
        const std::size_t at = path.size();
        path += "[" + std::to_string(i++) + "]";
        value(x, path, r, what, text, depth + 1);
        path.resize(at);
      }
      break;
    }
    case jt::number: check(v.get_number().error(), what, text); break;
    case jt::string: check(v.get_string().error(), what, text); break;
    case jt::boolean: check(v.get_bool().error(), what, text); break;
    case jt::null: {
      bool null = false;
      check(v.is_null().get(null), what, text);
      if (!null) json_error(what, simdjson::N_ATOM_ERROR, text);
      break;
    }
  }
}
}  // namespace ondemand_walk

/// Starts `doc` on `text` and reads all of it once: refuses what the DOM parser refuses (invalid
/// UTF-8, syntax, numbers, depth, trailing content) as errc::invalid_json naming `what`, and
/// finds the first key given twice in one object (not refused here: see json_check_result). The
/// document is rewound for the caller's own reading. Nesting is bounded by simdjson's depth limit.
inline json_check_result json_check(simdjson::ondemand::parser& parser, simdjson::padded_string_view text,
                                    simdjson::ondemand::document& doc, const std::string& what) {
  const std::string_view raw(text.data(), text.size());
  if (!is_valid_utf8(raw)) fail(errc::invalid_json, what + ": not valid UTF-8");
  ondemand_walk::check(parser.iterate(text).get(doc), what, raw);
  json_check_result r;
  std::string path;
  using jt = simdjson::ondemand::json_type;
  jt type;
  ondemand_walk::check(doc.type().get(type), what, raw);
  if (type == jt::object || type == jt::array) {
    simdjson::ondemand::value root;
    ondemand_walk::check(doc.get_value().get(root), what, raw);
    ondemand_walk::value(root, path, r, what, raw, 1);
  } else {  // a scalar document: read as such
    switch (type) {
      case jt::number: ondemand_walk::check(doc.get_number().error(), what, raw); break;
      case jt::string: ondemand_walk::check(doc.get_string().error(), what, raw); break;
      case jt::boolean: ondemand_walk::check(doc.get_bool().error(), what, raw); break;
      default: {
        bool null = false;
        ondemand_walk::check(doc.is_null().get(null), what, raw);
        if (!null) json_error(what, simdjson::N_ATOM_ERROR, raw);
      }
    }
  }
  // past the last value, the document has no current location (simdjson 3.0 has no at_end())
  if (!doc.current_location().error()) json_error(what, simdjson::TRAILING_CONTENT, raw);
  doc.rewind();
  return r;
}

/// A non-negative integer from an On-Demand number; nullopt (with why) for anything else.
inline std::optional<std::uint64_t> as_count(simdjson::ondemand::value v, std::string* why = nullptr) {
  using jt = simdjson::ondemand::json_type;
  jt type;
  if (v.type().get(type)) return std::nullopt;
  auto say = [&](std::string s) -> std::optional<std::uint64_t> {
    if (why) *why = std::move(s);
    return std::nullopt;
  };
  switch (type) {
    case jt::number: {
      simdjson::ondemand::number n;
      if (v.get_number().get(n)) return say("not a non-negative integer");
      switch (n.get_number_type()) {
        case simdjson::ondemand::number_type::unsigned_integer: return n.get_uint64();
        case simdjson::ondemand::number_type::signed_integer:
          if (n.get_int64() < 0) return say("negative number " + std::to_string(n.get_int64()));
          return std::uint64_t(n.get_int64());
        default: return say("non-integer number");
      }
    }
    case jt::string: return say("a string");
    case jt::null: return say("null");
    case jt::boolean: return say("a boolean");
    case jt::array: return say("an array");
    case jt::object: return say("an object");
  }
  return say("not a non-negative integer");
}

/// Reads an On-Demand array of non-negative integers; throws naming the field.
inline std::vector<std::uint64_t> parse_count_array(simdjson::ondemand::value v, const std::string& ctx, std::string_view field,
                                                    errc code) {
  simdjson::ondemand::array arr;
  if (v.get_array().get(arr)) fail(code, ctx + ": " + std::string(field) + " is not an array");
  std::vector<std::uint64_t> out;
  for (auto item : arr) {
    simdjson::ondemand::value x;
    std::string why = "not a non-negative integer";
    std::optional<std::uint64_t> c;
    if (!std::move(item).get(x)) c = as_count(x, &why);
    if (!c)
      fail(code, ctx + ": " + std::string(field) + "[" + std::to_string(out.size()) + "] is " + why + ", not a non-negative integer");
    out.push_back(*c);
  }
  return out;
}

/// A JSON document read On-Demand: checked whole by json_check when made, then read by the
/// caller from root(); a key given twice is refused by require_unique_keys(), which the caller
/// calls after its own rules (so a tensor listed twice is named as such). Not movable (the
/// document refers to its parser).
class json_document {
 public:
  /// `owner`: the string `text` lies in, when it has 64 spare bytes of capacity (read in place).
  json_document(std::string_view text, std::string what, const std::string* owner = nullptr)
      : what_(std::move(what)), text_(padded_json(text, owner, copy_)) {
    check_ = json_check(parser_, text_, doc_, what_);
  }
  json_document(const json_document&) = delete;
  json_document& operator=(const json_document&) = delete;
  /// The top value (an object or an array; anything else is an error naming `expected`).
  simdjson::ondemand::value root(const char* expected) {
    simdjson::ondemand::value v;
    if (doc_.get_value().get(v)) fail(errc::invalid_metadata, what_ + ": " + expected);
    return v;
  }
  void require_unique_keys() const {
    if (!check_.duplicate.empty()) fail(errc::invalid_json, check_.duplicate);
  }

 private:
  std::string what_;
  simdjson::padded_string copy_;
  simdjson::padded_string_view text_;
  simdjson::ondemand::parser parser_;
  simdjson::ondemand::document doc_;
  json_check_result check_;
};

}  // namespace shardsafe::detail
