// shardsafe/detail/hex.hpp - hex digits: the one encoder behind checksums (16 digits of a hash),
// JSON's \uXXXX escapes, SHA-256 digests and ETags, percent-encoded URLs and escaped bytes in
// messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardsafe::detail {

/// Appends the `digits` lowest hex digits of v, most significant first (lowercase unless upper).
inline void append_hex(std::string& out, std::uint64_t v, int digits, bool upper = false) {
  const char* d = upper ? "0123456789ABCDEF" : "0123456789abcdef";
  for (int sh = 4 * (digits - 1); sh >= 0; sh -= 4) out += d[(v >> sh) & 15];
}

/// The `digits` lowest hex digits of v (lowercase), most significant first.
inline std::string hex_digits(std::uint64_t v, int digits) {
  std::string s;
  s.reserve(static_cast<std::size_t>(digits));
  append_hex(s, v, digits);
  return s;
}

/// Two lowercase hex digits per byte, in order.
inline std::string to_hex(const void* bytes, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  std::string s;
  s.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) append_hex(s, p[i], 2);
  return s;
}

}  // namespace shardsafe::detail
