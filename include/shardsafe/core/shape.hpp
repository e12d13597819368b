// shardsafe/core/shape.hpp - tensor shapes, their element counts, dense strides and their printing
// in messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace shardsafe {

/// A tensor shape: one extent per dimension, row-major. An empty shape is a 0-d tensor.
using shape_t = std::vector<std::uint64_t>;

/// The number of elements of a tensor of this shape: the product of the extents (1 for a 0-d
/// tensor, 0 when any extent is 0). The product must fit in 64 bits: shapes read from a file
/// are checked with detail::checked_numel when they are parsed, before anything calls this.
constexpr std::uint64_t numel(std::span<const std::uint64_t> shape) noexcept {
  std::uint64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// The strides, in elements, of a dense tensor of this shape whose dimensions are stored in
/// `order` (outermost first, a permutation of the dimensions: a DCP chunk torch.save kept
/// channels_last or transposed); an empty order is row-major.
inline shape_t dense_strides(std::span<const std::uint64_t> shape, std::span<const std::size_t> order = {}) {
  shape_t s(shape.size(), 1);
  std::uint64_t t = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    const std::size_t d = order.empty() ? i : order[i];
    s[d] = t;
    t *= shape[d];
  }
  return s;
}

/// "[4,5]" - the form every message uses.
inline std::string to_string(std::span<const std::uint64_t> shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace shardsafe
