// shardsafe/detail/json_ondemand.hpp - reading JSON On-Demand (no DOM), for documents that may
// be large (metadata.json).
//
// A DOM costs about four times the text (its tape, strings and structural index) on top of what
// the reader builds from it; simdjson's On-Demand API reads values in place instead. A reader
// walks the text twice: json_check first (every value read, so the text is validated as the DOM
// parser validates it, and duplicate keys found), then its own schema over the rewound document
// (json_document does both).
#pragma once

// config.hpp first: it settles simdjson's development checks for a separately compiled program
#include "shardsafe/core/config.hpp"

#include <simdjson.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json_error.hpp"

namespace shardsafe::detail {

/// The text of `text` as simdjson needs it (64 readable bytes past the end): in place when
/// `owner` holds it with that spare capacity (read_text leaves it), else copied into `copy`.
inline simdjson::padded_string_view padded_json(std::string_view text, const std::string* owner,
                                                simdjson::padded_string& copy) {
  if (owner && owner->data() == text.data() && owner->capacity() >= text.size() + simdjson::SIMDJSON_PADDING)
    return simdjson::padded_string_view(text.data(), text.size(), owner->capacity());
  copy = simdjson::padded_string(text);
  return copy;
}

/// The first duplicate key json_check met (empty: none), as the message require_unique_keys gives.
struct json_check_result {
  std::string duplicate;
};

/// A field's key, in place in the text when it holds no escape, else unescaped (into the
/// parser's string buffer). unescaped_key() copies every key, and simdjson keeps every copy until
/// the document is rewound: on a listed metadata.json, mostly keys, that buffer grew to 0.6 times
/// the text.
inline simdjson::error_code field_key(simdjson::ondemand::field& f, std::string_view& k) {
  const char* p = f.key().raw();  // the first byte after the opening quote
  const char* q = p;
  while (*q != '"' && *q != '\\') ++q;  // the document was checked: its closing quote is there
  if (*q == '"') {
    k = std::string_view(p, static_cast<std::size_t>(q - p));
    return simdjson::SUCCESS;
  }
  return f.unescaped_key().get(k);
}

/// A string value, in place in the text when it holds no escape, else unescaped (field_key's
/// reason: a checksum table's millions of hashes are not copied).
inline simdjson::error_code string_value(simdjson::ondemand::value v, std::string_view& s) {
  const std::string_view raw = v.raw_json_token();  // the token, up to the next structural byte
  if (raw.size() >= 2 && raw.front() == '"') {
    const std::size_t end = raw.find_first_of("\"\\", 1);
    if (end != std::string_view::npos && raw[end] == '"') {
      s = raw.substr(1, end - 1);
      return simdjson::SUCCESS;
    }
  }
  return v.get_string().get(s);
}

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
    check(field_key(f, k), what, text);
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
    case jt::string:  // without an escape it is valid as it stands (stage 1 checked its bytes): not copied
      if (v.raw_json_token().find('\\') != std::string_view::npos) check(v.get_string().error(), what, text);
      break;
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
  // the order of the structural bytes, which the walk below does not check whole
  if (const std::string p = json_structure_problem(raw, ondemand_walk::max_depth); !p.empty())
    fail(errc::invalid_json, what + ": not valid JSON (" + p + ")");
  // one level past the deepest accepted: simdjson's development checks (on where __OPTIMIZE__
  // is not defined, as at -O0) assert that a value's depth stays below the parser's max_depth
  // (iterate() grows the capacity itself, keeping the depth set here)
  if (parser.max_depth() <= ondemand_walk::max_depth)
    ondemand_walk::check(parser.allocate(text.size(), ondemand_walk::max_depth + 1), what, raw);
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
inline std::vector<std::uint64_t> parse_count_array(simdjson::ondemand::value v, const std::string& ctx,
                                                    std::string_view field, errc code) {
  simdjson::ondemand::array arr;
  if (v.get_array().get(arr)) fail(code, ctx + ": " + std::string(field) + " is not an array");
  std::vector<std::uint64_t> out;
  for (auto item : arr) {
    simdjson::ondemand::value x;
    std::string why = "not a non-negative integer";
    std::optional<std::uint64_t> c;
    if (!std::move(item).get(x)) c = as_count(x, &why);
    if (!c)
      fail(code, ctx + ": " + std::string(field) + "[" + std::to_string(out.size()) + "] is " + why +
                     ", not a non-negative integer");
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
