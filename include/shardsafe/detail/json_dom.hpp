// shardsafe/detail/json_dom.hpp - reading JSON through simdjson's DOM: parse_json, the check
// that no object holds a key twice (require_unique_keys), and non-negative integers (as_count,
// parse_count_array) with messages naming the field. For documents that may be large, see
// detail/json_ondemand.hpp.
#pragma once

// config.hpp first: it settles simdjson's development checks for a separately compiled program
#include "shardsafe/core/config.hpp"

#include <simdjson.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/json_error.hpp"

namespace shardsafe::detail {

/// Refuses an object that holds a key twice, anywhere in the document (errc::invalid_json naming
/// `what`, the key and where: `tensors.w`). JSON leaves duplicate keys to the reader, and readers
/// differ (simdjson's DOM gives the first, Python's json the last): a file holding two values for
/// one key would load as different tensors in two programs, so no shardsafe reader accepts one
/// (the safetensors crate refuses them in headers too). O(n log n) in the document's keys, no
/// recursion (objects and arrays are walked from an explicit stack).
SHARDSAFE_DECL void require_unique_keys(simdjson::dom::element root, const std::string& what);

/// Parses `text` into a DOM held by `parser`; throws errc::invalid_json naming `what`.
inline simdjson::dom::element parse_json(simdjson::dom::parser& parser, std::string_view text,
                                         const std::string& what) {
  if (!is_valid_utf8(text)) fail(errc::invalid_json, what + ": not valid UTF-8");
  simdjson::dom::element root;
  if (auto err = parser.parse(text.data(), text.size(), /*realloc_if_needed=*/true).get(root))
    json_error(what, err, text);
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
  if (e.get_array().get(arr)) fail(code, ctx + ": " + std::string(field) + " is not an array");
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

}  // namespace shardsafe::detail

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/detail/impl/json_dom.ipp"
#endif
