// shardsafe/format/pickle_repr.hpp - a plain Python value as Python's repr() writes it, cut to a
// bounded length (format/pickle_value.hpp's values; inspect and messages print them).
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardsafe/format/pickle_value.hpp"

namespace shardsafe {

/// v as Python's repr() writes it (None, True, 3, 0.001, 1e-05, 'adam', "it's", [0, 1],
/// (0.9, 0.999), {'a': 1}; a str's bytes outside ASCII as they are, its control bytes escaped),
/// cut to at most max_chars characters (ending in "..." when max_chars is 3 or more) when it is
/// longer: bounded work whatever the value (its containers may be shared). `special(d)`, given
/// each dict d first, returns its text when d stands for an object an opcode policy made (a
/// torch storage, a global): std::optional<std::string>, nullopt for a plain dict.
template <class Special>
std::string pickle_repr(const pickle_value& v, std::size_t max_chars, const Special& special);

inline std::string pickle_repr(const pickle_value& v, std::size_t max_chars) {
  return pickle_repr(v, max_chars, [](const pickle_value&) { return std::optional<std::string>(); });
}

template <class Special>
std::string pickle_repr(const pickle_value& v, std::size_t max_chars, const Special& special) {
  std::string out;
  const std::size_t cap = max_chars;
  auto full = [&] { return out.size() > cap; };
  auto put = [&](std::string_view s) { out.append(s.substr(0, cap + 1 - std::min(out.size(), cap + 1))); };
  // a str's or bytes' literal as Python writes it: quoted with ' unless it holds ' and no ",
  // backslash, quote, \n, \r and \t escaped, other bytes below 0x20 and 0x7f as \xHH, and (a
  // bytes: `ascii_only`) those above 0x7e too; a str's other bytes as they are. Cut past cap.
  auto quoted = [&](std::string_view data, std::string_view before, std::string_view after, bool ascii_only) {
    const char q = data.find('\'') != std::string_view::npos && data.find('"') == std::string_view::npos ? '"' : '\'';
    std::string t = std::string(before) + q;
    for (unsigned char c : data) {
      if (t.size() > cap) break;
      if (c == '\\' || c == static_cast<unsigned char>(q))
        t += '\\', t += char(c);
      else if (c == '\n')
        t += "\\n";
      else if (c == '\r')
        t += "\\r";
      else if (c == '\t')
        t += "\\t";
      else if (c >= 0x20 && c != 0x7f && (!ascii_only || c < 0x7f))
        t += char(c);
      else {
        t += "\\x";
        detail::append_hex(t, c, 2);
      }
    }
    return t + q + std::string(after);
  };
  auto walk = [&](auto& self, const pickle_value& x) -> void {
    if (full()) return;
    switch (x.type()) {
      case pickle_value::kind::none: put("None"); break;
      case pickle_value::kind::boolean: put(x.as_bool("") ? "True" : "False"); break;
      case pickle_value::kind::integer: put(std::to_string(x.as_int(""))); break;
      case pickle_value::kind::real: {
        const double d = x.as_real("");
        if (d != d) {
          put("nan");
          break;
        }
        if (d == std::numeric_limits<double>::infinity() || d == -std::numeric_limits<double>::infinity()) {
          put(d > 0 ? "inf" : "-inf");
          break;
        }
        // the shortest digits that read back as d, laid out as Python does: positional for
        // exponents -4 to 15 ("0.0001", "100000.0"), else "1e-05", "1.5e+16"
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
        const std::string sci(buf, r.ptr);
        const std::size_t e_at = sci.find('e');
        const bool neg = sci[0] == '-';
        std::string digits;
        for (std::size_t i = neg ? 1 : 0; i < e_at; ++i)
          if (sci[i] != '.') digits += sci[i];
        const int exp = std::stoi(sci.substr(e_at + 1));
        std::string t = neg ? "-" : "";
        if (exp < -4 || exp >= 16) {
          t += digits.substr(0, 1);
          if (digits.size() > 1) t += "." + digits.substr(1);
          t += exp < 0 ? "e-" : "e+";
          t += (std::abs(exp) < 10 ? "0" : "") + std::to_string(std::abs(exp));
        } else if (exp < 0) {
          t += "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
        } else {
          const std::size_t point = static_cast<std::size_t>(exp) + 1;
          if (digits.size() <= point)
            t += digits + std::string(point - digits.size(), '0') + ".0";
          else
            t += digits.substr(0, point) + "." + digits.substr(point);
        }
        put(t);
        break;
      }
      case pickle_value::kind::string: put(quoted(x.as_string(""), "", "", false)); break;
      case pickle_value::kind::bytes: {
        const pickle_bytes& b = x.as_bytes("");
        put(b.bytearray ? quoted(b.data, "bytearray(b", ")", true) : quoted(b.data, "b", "", true));
        break;
      }
      case pickle_value::kind::set: {
        const pickle_set& st = x.as_set("");
        if (st.items.empty()) {
          put(st.frozen ? "frozenset()" : "set()");
          break;
        }
        put(st.frozen ? "frozenset({" : "{");
        for (std::size_t i = 0; i < st.items.size() && !full(); ++i) {
          if (i) put(", ");
          self(self, st.items[i]);
        }
        put(st.frozen ? "})" : "}");
        break;
      }
      case pickle_value::kind::list:
      case pickle_value::kind::tuple: {
        const bool list = x.type() == pickle_value::kind::list;
        const auto& items = x.as_sequence("");
        put(list ? "[" : "(");
        for (std::size_t i = 0; i < items.size() && !full(); ++i) {
          if (i) put(", ");
          self(self, items[i]);
        }
        put(list ? "]" : items.size() == 1 ? ",)" : ")");
        break;
      }
      case pickle_value::kind::dict: {
        if (const std::optional<std::string> t = special(x)) {
          put(*t);
          break;
        }
        put("{");
        for (std::size_t i = 0; i < x.dict_size() && !full(); ++i) {
          if (i) put(", ");
          self(self, x.dict_key(i));
          put(": ");
          self(self, x.dict_value(i));
        }
        put("}");
        break;
      }
    }
  };
  walk(walk, v);
  if (out.size() > cap) out = cap >= 3 ? out.substr(0, cap - 3) + "..." : out.substr(0, cap);
  return out;
}

}  // namespace shardsafe
