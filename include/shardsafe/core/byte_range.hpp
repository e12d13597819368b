// shardsafe/core/byte_range.hpp - half-open ranges of bytes or elements.
#pragma once

#include <cstdint>
#include <string>

namespace shardsafe {

/// A half-open range [begin, end) of bytes in a file or elements in a flat view.
struct byte_range {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  constexpr std::uint64_t size() const noexcept { return end - begin; }
  constexpr bool empty() const noexcept { return end == begin; }
  friend constexpr bool operator==(const byte_range&, const byte_range&) = default;
};

inline std::string to_string(const byte_range& r) {
  std::string s = "[";  // built with += (a chain of + trips GCC 12's -Wrestrict at -O3)
  s += std::to_string(r.begin);
  s += ", ";
  s += std::to_string(r.end);
  s += ')';
  return s;
}

}  // namespace shardsafe
