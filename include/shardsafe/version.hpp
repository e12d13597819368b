// shardsafe/version.hpp - the library's version. A plain header, so that the library works from a
// checkout with `-Iinclude` and no build step. The top meson.build's project version must equal
// SHARDSAFE_VERSION_STRING: configuring stops when they differ (include/shardsafe/meson.build), and
// the .pc file and the CMake package carry the same number.
#pragma once

#include <string_view>

#define SHARDSAFE_VERSION_MAJOR 0
#define SHARDSAFE_VERSION_MINOR 1
#define SHARDSAFE_VERSION_PATCH 0
/// "MAJOR.MINOR.PATCH"
#define SHARDSAFE_VERSION_STRING "0.1.0"
/// MAJOR * 10000 + MINOR * 100 + PATCH, for `#if SHARDSAFE_VERSION >= 100` (1.0.0)
#define SHARDSAFE_VERSION (SHARDSAFE_VERSION_MAJOR * 10000 + SHARDSAFE_VERSION_MINOR * 100 + SHARDSAFE_VERSION_PATCH)

namespace shardsafe {

/// The library version, "MAJOR.MINOR.PATCH"; a checkpoint records it as its writer
/// (metadata.json's "shardsafe": {"writer": "shardsafe 0.1.0"}), and `shardsafe --version` prints it.
inline constexpr std::string_view library_version = SHARDSAFE_VERSION_STRING;

}  // namespace shardsafe
