// shardsafe/detail/json_error.hpp - how a JSON text is refused: the UTF-8 check, where a number
// that fits no 64-bit integer or double lies, the message for a key given twice, and the
// errc::invalid_json they end in (detail/json_dom.hpp and detail/json_ondemand.hpp use them).
#pragma once

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

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"

namespace shardsafe::detail {

inline bool is_valid_utf8(std::string_view s) noexcept { return simdjson::validate_utf8(s.data(), s.size()); }

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
        if (stack.back().object)
          expect_key = true;
        else
          ++stack.back().index;
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
          if (std::from_chars(b, e, v).ec == std::errc::result_out_of_range)
            why = "is below the smallest 64-bit integer";
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
         (path.empty() ? std::string(" (the top level)") : " (at " + path + ")") +
         "; readers would disagree on its value";
}

}  // namespace shardsafe::detail
