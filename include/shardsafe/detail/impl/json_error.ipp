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

SHARDSAFE_DECL std::string json_structure_problem(std::string_view t, std::size_t max_depth) {
  // what may come next: a value (top level, after ':' or an array's ','), a value or ']' (after
  // '['), a key or '}' (after '{'), a key (after an object's ','), ':' (after a key), ',' or the
  // close of the innermost container (after a value), nothing but spaces (after the top value)
  enum class next { value, value_or_close, key_or_close, key, colon, comma_or_close, end };
  std::string open;  // the '{' and '[' not closed yet
  next e = next::value;
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  const auto say = [](std::size_t at, const char* want) {
    return "byte " + std::to_string(at) + ": expected " + std::string(want);
  };
  const auto after_value = [&] { e = open.empty() ? next::end : next::comma_or_close; };
  for (std::size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (ws(c)) continue;
    switch (e) {
      case next::end: return say(i, "nothing after the top value (trailing content)");
      case next::colon:
        if (c != ':') return say(i, "':' after a key");
        e = next::value;
        continue;
      case next::comma_or_close:
        if (c == ',') {
          e = open.back() == '{' ? next::key : next::value;
          continue;
        }
        if (c == (open.back() == '{' ? '}' : ']')) {
          open.pop_back();
          after_value();
          continue;
        }
        return say(i, open.back() == '{' ? "',' or '}' after an object's value" : "',' or ']' after an array's item");
      case next::key_or_close:
      case next::key:
        if (c == '}' && e == next::key_or_close) {
          open.pop_back();
          after_value();
          continue;
        }
        if (c != '"') return say(i, e == next::key ? "a key after ','" : "a key or '}'");
        break;  // the key's string, below
      case next::value_or_close:
        if (c == ']') {
          open.pop_back();
          after_value();
          continue;
        }
        [[fallthrough]];
      case next::value:
        if (c == '{' || c == '[') {
          if (open.size() >= max_depth) return {};  // too deep: the reader's own depth check says so
          open.push_back(c);
          e = c == '{' ? next::key_or_close : next::value_or_close;
          continue;
        }
        if (c == '}' || c == ']' || c == ',' || c == ':') return say(i, "a value");
        break;
    }
    if (c == '"') {  // a string: to its closing quote
      std::size_t j = i + 1;
      while (j < t.size() && t[j] != '"') j += t[j] == '\\' ? 2 : 1;
      if (j >= t.size()) return say(i, "a string that ends");
      const bool key = e == next::key || e == next::key_or_close;
      i = j;
      if (key)
        e = next::colon;
      else
        after_value();
      continue;
    }
    // a number or a literal: to the next space or structural byte
    while (i + 1 < t.size() && !ws(t[i + 1]) && std::string_view("{}[],:\"").find(t[i + 1]) == std::string_view::npos)
      ++i;
    after_value();
  }
  if (e != next::end) return say(t.size(), open.empty() ? "a value" : "the close of every open '{' and '['");
  return {};
}

}  // namespace shardsafe::detail
