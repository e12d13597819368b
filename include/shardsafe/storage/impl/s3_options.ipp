// shardsafe/storage/impl/s3_options.ipp - s3_options.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/s3_options.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL std::optional<s3_addressing> addressing_from_config(const std::filesystem::path& file,
                                                                   std::string_view profile) {
  const auto settings = aws_profile_settings(file, profile);
  if (!settings) return std::nullopt;
  const auto it = settings->find("s3.addressing_style");
  if (it == settings->end()) return std::nullopt;
  const std::string& v = it->second;
  if (v == "auto") return s3_addressing::automatic;
  if (v == "path") return s3_addressing::path;
  if (v == "virtual") return s3_addressing::virtual_hosted;
  throw error(errc::invalid_argument, file.string() + ": profile '" + std::string(profile) +
                                          "': s3 addressing_style '" + v + "' is none of auto, path, virtual");
}

}  // namespace detail
}  // namespace shardsafe
