// shardsafe/detail/checked.hpp - overflow-checked arithmetic on sizes read from files.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace shardsafe::detail {

/// s as an unsigned decimal number: one to max_digits ASCII digits and nothing else (no sign,
/// no blanks), whose value fits 64 bits; nothing otherwise. The one such parser of the library
/// (HTTP fields, URL ports, sizes in answers).
inline std::optional<std::uint64_t> parse_decimal(std::string_view s, std::size_t max_digits = 20) noexcept {
  if (s.empty() || s.size() > max_digits) return std::nullopt;
  std::uint64_t n = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    if (__builtin_mul_overflow(n, 10u, &n) || __builtin_add_overflow(n, static_cast<std::uint64_t>(c - '0'), &n))
      return std::nullopt;
  }
  return n;
}

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
