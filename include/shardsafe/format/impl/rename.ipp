// shardsafe/format/impl/rename.ipp - rename.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/rename.hpp"

namespace shardsafe {

SHARDSAFE_DECL rename_rule parse_rename_rule(std::string_view text) {
  const std::string t(text);
  auto bad = [&](const std::string& why) -> void { fail(errc::invalid_argument, "rename rule '" + t + "': " + why); };
  rename_rule r;
  r.text = t;
  std::size_t split = std::string_view::npos;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == '=') {
      r.pattern += '=';
      ++i;
    } else if (text[i] == '=') {
      split = i;
      break;
    } else {
      r.pattern += text[i];
    }
  }
  if (split == std::string_view::npos) bad("no '=' between REGEX and REPL");
  if (r.pattern.empty()) bad("empty REGEX");
  r.replacement = std::string(text.substr(split + 1));
  re2::RE2::Options opt;
  opt.set_log_errors(false);
  auto re = std::make_shared<re2::RE2>(r.pattern, opt);
  if (!re->ok()) bad("bad regex '" + r.pattern + "': " + re->error());
  r.regex = std::move(re);
  const int groups = r.regex->NumberOfCapturingGroups();
  for (std::size_t i = 0; i < r.replacement.size(); ++i) {
    if (r.replacement[i] != '\\') continue;
    if (i + 1 == r.replacement.size()) bad("REPL ends with a lone '\\'");
    const char n = r.replacement[++i];
    if (n == '\\') continue;
    if (n >= '1' && n <= '9') {
      if (n - '0' > groups)
        bad("REPL refers to group \\" + std::string(1, n) + " but the regex has " + std::to_string(groups));
      continue;
    }
    bad(std::string("unknown escape '\\") + n + "' in REPL (only \\1..\\9 and \\\\)");
  }
  return r;
}

}  // namespace shardsafe
