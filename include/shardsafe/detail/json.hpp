// shardsafe/detail/json.hpp - small helpers for reading (simdjson DOM, and On-Demand for large documents) and writing JSON.
//
// Writing follows Python's json.dumps layout (", " and ": " separators, no indent) so the
// files we write diff cleanly against the ones Python tools write.
//
// This header writes (append_json_string) and includes the readers:
//   json_error.hpp     how a text is refused: UTF-8, a number that does not fit, a key given twice
//   json_dom.hpp       parse_json, require_unique_keys, as_count and parse_count_array on a DOM
//   json_ondemand.hpp  json_check, json_document, as_count and parse_count_array On-Demand
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
#include <system_error>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"
#include "shardsafe/detail/json_dom.hpp"
#include "shardsafe/detail/json_error.hpp"
#include "shardsafe/detail/json_ondemand.hpp"

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

}  // namespace shardsafe::detail
