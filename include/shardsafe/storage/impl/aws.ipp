// shardsafe/storage/impl/aws.ipp - aws.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/aws.hpp"

namespace shardsafe {

SHARDSAFE_DECL std::optional<std::map<std::string, std::string>> aws_profile_settings_of(std::string_view text,
                                                                                         std::string_view profile) {
  std::optional<std::map<std::string, std::string>> out;
  bool in_profile = false;
  std::string block;  // the "key =" block the indented lines belong to
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string t = detail::trim_spaces(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    if (t.front() == '[') {
      std::string name = detail::trim_spaces(std::string_view(t).substr(1, t.find(']') - 1));
      if (name.starts_with("profile ")) name = detail::trim_spaces(std::string_view(name).substr(8));
      in_profile = name == profile;
      if (in_profile && !out) out.emplace();
      block.clear();
      continue;
    }
    if (!in_profile) continue;
    const std::size_t eq = t.find('=');
    if (eq == std::string::npos || eq == 0) continue;  // not a setting (no key)
    const std::string k = detail::trim_spaces(std::string_view(t).substr(0, eq)),
                      v = detail::trim_spaces(std::string_view(t).substr(eq + 1));
    const bool indented = line[0] == ' ' || line[0] == '\t';
    if (indented && !block.empty()) {  // a setting of the block above
      (*out)[block + "." + k] = v;
    } else {  // (an indented line with no block above is a plain setting, as Python's configparser reads it)
      block = v.empty() ? k : std::string();
      if (!v.empty()) (*out)[k] = v;
    }
  }
  return out;
}

SHARDSAFE_DECL std::optional<std::map<std::string, std::string>> aws_profile_settings(const std::filesystem::path& file,
                                                                                      std::string_view profile) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return std::nullopt;
  constexpr std::size_t max_bytes = std::size_t(1) << 20;
  std::string text(max_bytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > max_bytes)
    throw error(errc::invalid_argument, file.string() + ": over 1 MiB: not an AWS credentials or config file");
  return aws_profile_settings_of(text, profile);
}

namespace detail {

SHARDSAFE_DECL std::optional<aws_credentials> credentials_from_file(const std::filesystem::path& file,
                                                                    std::string_view profile) {
  const auto s = aws_profile_settings(file, profile);
  if (!s) return std::nullopt;
  auto get = [&](const char* k) {
    const auto it = s->find(k);
    return it == s->end() ? std::string() : it->second;
  };
  aws_credentials c{get("aws_access_key_id"), get("aws_secret_access_key"), get("aws_session_token")};
  if (c.access_key_id.empty()) return std::nullopt;
  return c;
}

}  // namespace detail

SHARDSAFE_DECL aws_credentials aws_credentials_from_environment(std::string profile) {
  if (auto id = detail::env("AWS_ACCESS_KEY_ID")) {
    auto secret = detail::env("AWS_SECRET_ACCESS_KEY");
    if (!secret) throw error(errc::invalid_argument, "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not");
    return {*id, *secret, detail::env("AWS_SESSION_TOKEN").value_or("")};
  }
  profile = aws_profile_name(profile);
  std::filesystem::path file;
  if (auto f = detail::env("AWS_SHARED_CREDENTIALS_FILE"))
    file = *f;
  else if (auto h = detail::env("HOME"))
    file = std::filesystem::path(*h) / ".aws" / "credentials";
  if (!file.empty())
    if (auto c = detail::credentials_from_file(file, profile)) return *c;
  throw error(errc::not_found, "no AWS credentials: AWS_ACCESS_KEY_ID is not set and " +
                                   (file.empty() ? std::string("there is no HOME") : file.string()) +
                                   " has no profile '" + profile + "' with aws_access_key_id");
}

}  // namespace shardsafe
