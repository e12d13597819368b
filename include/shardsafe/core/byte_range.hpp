// shardsafe/core/byte_range.hpp - half-open ranges of bytes or of elements, as distinct types.
//
// A copy plan counts elements and a read plan counts bytes; both are [begin, end) pairs of
// 64-bit numbers. They are different types (half_open_range<Unit> with a different Unit), so a
// range in elements cannot be passed where bytes are expected, nor the other way round: the
// conversion is a multiplication by the item size, written out where it happens.
#pragma once

#include <cstdint>
#include <string>

namespace shardsafe {

/// A half-open range [begin, end) counted in Unit (byte_unit or element_unit): a tag that
/// only keeps ranges of different units apart; it holds nothing.
template <class Unit>
struct half_open_range {
  using unit = Unit;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  constexpr std::uint64_t size() const noexcept { return end - begin; }
  constexpr bool empty() const noexcept { return end == begin; }
  friend constexpr bool operator==(const half_open_range&, const half_open_range&) = default;
};

/// The unit of offsets in a file or a buffer.
struct byte_unit {};
/// The unit of offsets in a flattened tensor or a flat view.
struct element_unit {};

/// A half-open range [begin, end) of bytes in a file or a buffer.
using byte_range = half_open_range<byte_unit>;
/// A half-open range [begin, end) of elements of a row-major flattened tensor or a flat view.
using element_range = half_open_range<element_unit>;

/// "[begin, end)" - the form every message uses, whatever the unit.
template <class Unit>
std::string to_string(const half_open_range<Unit>& r) {
  std::string s = "[";  // built with += (a chain of + trips GCC 12's -Wrestrict at -O3)
  s += std::to_string(r.begin);
  s += ", ";
  s += std::to_string(r.end);
  s += ')';
  return s;
}

}  // namespace shardsafe
