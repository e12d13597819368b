// shardsafe/detail/checked.hpp - overflow-checked arithmetic on sizes read from files.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace shardsafe::detail {

inline std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<std::uint64_t> checked_add(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

/// Product of the dimensions, or nullopt on overflow (numel in core/shape.hpp, checked).
inline std::optional<std::uint64_t> checked_numel(std::span<const std::uint64_t> shape) noexcept {
  std::uint64_t n = 1;
  for (auto d : shape) {
    auto m = checked_mul(n, d);
    if (!m) return std::nullopt;
    n = *m;
  }
  return n;
}

}  // namespace shardsafe::detail
