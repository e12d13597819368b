// shardsafe/detail/json_error.hpp - how a JSON text is refused: the UTF-8 check, where a number
// that fits no 64-bit integer or double lies, the message for a key given twice, and the
// errc::invalid_json they end in (detail/json_dom.hpp and detail/json_ondemand.hpp use them).
#pragma once

// config.hpp first: it settles simdjson's development checks for a separately compiled program
#include "shardsafe/core/config.hpp"

#include <simdjson.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "shardsafe/core/error.hpp"

namespace shardsafe::detail {

inline bool is_valid_utf8(std::string_view s) noexcept { return simdjson::validate_utf8(s.data(), s.size()); }

/// For a document simdjson refused because of a number: finds the first number literal that
/// fits neither a 64-bit integer nor a finite double and says where it is, as a path of keys
/// and indices (`w.data_offsets[1]`: tensor `w`, field `data_offsets`, second element) and a
/// byte offset. Empty when no such literal is found (the number error is then a malformed
/// literal, which the parser's own message covers). One pass, no allocation beyond the path.
SHARDSAFE_DECL std::string locate_bad_number(std::string_view text);

/// Where the order of a JSON text's structural bytes breaks the grammar (a ':' where a ',' or a
/// close belongs, a value where a key belongs, a close that matches no open, content after the
/// top value), as "byte K: expected ..."; empty when it does not. The tokens themselves (strings'
/// escapes, numbers, literals) are not judged here. simdjson's On-Demand reading, even of every
/// value, does not check all of this: `{"a": {}, "b": "x": 1}}` read as a valid object. One
/// pass, a byte of memory per level of nesting (past `max_depth` levels it stops, saying nothing:
/// the reader refuses such depth itself).
SHARDSAFE_DECL std::string json_structure_problem(std::string_view text, std::size_t max_depth);

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
         (path.empty() ? std::string(" (the top level)") : " (at " + path + ")") +
         "; readers would disagree on its value";
}

}  // namespace shardsafe::detail

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/detail/impl/json_error.ipp"
#endif
