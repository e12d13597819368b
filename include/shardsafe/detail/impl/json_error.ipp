// shardsafe/detail/impl/json_error.ipp - json_error.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/detail/json_error.hpp"

namespace shardsafe::detail {

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

}  // namespace shardsafe::detail
