// shardsafe/core/shape.hpp - tensor shapes and their printing in messages.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace shardsafe {

/// A tensor shape: one extent per dimension, row-major. An empty shape is a 0-d tensor.
using shape_t = std::vector<std::uint64_t>;

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
