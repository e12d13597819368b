// shardsafe/detail/nan.hpp - NaN patterns for the NaN-fill validation of loads.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "shardsafe/core/dtype.hpp"

namespace shardsafe::detail {

/// Fills floating-point memory with a quiet NaN of its dtype; other dtypes are left alone.
inline void fill_nan(dtype t, std::span<std::byte> mem) noexcept {
  auto fill = [&](auto pattern) {
    const std::size_t n = mem.size() / sizeof(pattern);
    for (std::size_t i = 0; i < n; ++i) std::memcpy(mem.data() + i * sizeof(pattern), &pattern, sizeof(pattern));
  };
  switch (t) {
    case dtype::F32:
    case dtype::C64: fill(std::uint32_t{0x7FC00000u}); break;
    case dtype::F64: fill(std::uint64_t{0x7FF8000000000000ull}); break;
    case dtype::F16: fill(std::uint16_t{0x7E00}); break;
    case dtype::BF16: fill(std::uint16_t{0x7FC0}); break;
    case dtype::F8_E5M2: fill(std::uint8_t{0x7F}); break;
    case dtype::F8_E4M3: fill(std::uint8_t{0x7F}); break;
    case dtype::F8_E4M3FNUZ:
    case dtype::F8_E5M2FNUZ: fill(std::uint8_t{0x80}); break;
    default: break;
  }
}

/// Index of the first NaN element, or -1 (for dtypes without NaN: -1).
inline std::int64_t first_nan(dtype t, std::span<const std::byte> mem) noexcept {
  auto scan = [&](auto zero, auto is_nan) -> std::int64_t {
    using U = decltype(zero);
    const std::size_t n = mem.size() / sizeof(U);
    for (std::size_t i = 0; i < n; ++i) {
      U v;
      std::memcpy(&v, mem.data() + i * sizeof(U), sizeof(U));
      if (is_nan(v)) return static_cast<std::int64_t>(t == dtype::C64 ? i / 2 : i);
    }
    return -1;
  };
  switch (t) {
    case dtype::F32:
    case dtype::C64:
      return scan(std::uint32_t{}, [](std::uint32_t v) { return (v & 0x7F800000u) == 0x7F800000u && (v & 0x7FFFFFu); });
    case dtype::F64:
      return scan(std::uint64_t{}, [](std::uint64_t v) {
        return (v & 0x7FF0000000000000ull) == 0x7FF0000000000000ull && (v & 0xFFFFFFFFFFFFFull);
      });
    case dtype::F16:
      return scan(std::uint16_t{}, [](std::uint16_t v) { return (v & 0x7C00) == 0x7C00 && (v & 0x3FF); });
    case dtype::BF16:
      return scan(std::uint16_t{}, [](std::uint16_t v) { return (v & 0x7F80) == 0x7F80 && (v & 0x7F); });
    case dtype::F8_E5M2: return scan(std::uint8_t{}, [](std::uint8_t v) { return (v & 0x7C) == 0x7C && (v & 0x03); });
    case dtype::F8_E4M3: return scan(std::uint8_t{}, [](std::uint8_t v) { return (v & 0x7F) == 0x7F; });
    case dtype::F8_E4M3FNUZ:
    case dtype::F8_E5M2FNUZ: return scan(std::uint8_t{}, [](std::uint8_t v) { return v == 0x80; });
    default: return -1;
  }
}

}  // namespace shardsafe::detail
