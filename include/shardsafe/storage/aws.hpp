// shardsafe/storage/aws.hpp - AWS credentials and the settings of an AWS profile, found as the
// AWS tools find them (no network, no OpenSSL): environment variables first, then the INI
// files ~/.aws/credentials and ~/.aws/config (or AWS_SHARED_CREDENTIALS_FILE /
// AWS_CONFIG_FILE).
//
// An AWS INI file: "[name]" (or "[profile name]") starts a profile; "key = value" lines set its
// settings; "key =" with nothing after starts a block whose indented lines are its settings
// (the config file's "s3 =" then "  addressing_style = virtual"), read here as "s3.key"; an
// indented line with no such block above is a plain setting.
// Lines starting with '#' or ';' are comments.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"

namespace shardsafe {

/// An access key pair, and the session token of temporary credentials.
struct aws_credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  ///< empty for long-term keys
};

namespace detail {

/// An environment variable's value; nothing when unset or empty.
inline std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

/// v without leading and trailing blanks (spaces, tabs), each inner run of them one space.
inline std::string trim_spaces(std::string_view v) {
  std::string r;
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = !r.empty();
      continue;
    }
    if (space) r += ' ';
    space = false;
    r += c;
  }
  return r;
}

}  // namespace detail

/// The settings of profile `profile` in the text of an AWS INI file (top of this header), by
/// key ("region", "s3.addressing_style"); nothing when the profile is absent.
SHARDSAFE_DECL std::optional<std::map<std::string, std::string>> aws_profile_settings_of(std::string_view text,
                                                                                         std::string_view profile);

/// aws_profile_settings_of the AWS INI file `file` (at most 1 MiB is read: a larger file is
/// errc::invalid_argument); nothing when the file or the profile is absent.
SHARDSAFE_DECL std::optional<std::map<std::string, std::string>> aws_profile_settings(const std::filesystem::path& file,
                                                                                      std::string_view profile);

namespace detail {

/// The credentials of [profile] in an AWS credentials file, or nothing when the file or the
/// profile is absent or the profile has no aws_access_key_id.
SHARDSAFE_DECL std::optional<aws_credentials> credentials_from_file(const std::filesystem::path& file,
                                                                    std::string_view profile);

}  // namespace detail

/// The profile the AWS tools use: `profile` when given, else AWS_PROFILE, else "default".
inline std::string aws_profile_name(std::string_view profile = "") {
  return !profile.empty() ? std::string(profile) : detail::env("AWS_PROFILE").value_or("default");
}

/// Credentials as the AWS tools find them: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
/// AWS_SESSION_TOKEN, else profile `profile` (empty: AWS_PROFILE, else "default") of
/// AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials. errc::not_found when there are none.
SHARDSAFE_DECL aws_credentials aws_credentials_from_environment(std::string profile = "");

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/impl/aws.ipp"
#endif
