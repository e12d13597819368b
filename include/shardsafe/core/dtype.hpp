// shardsafe/core/dtype.hpp - the safetensors dtype vocabulary (docs/FORMAT.md §1).
//
// Every dtype has a name, a size in bits and, for the byte-sized ones, an item size. Sub-byte
// dtypes (F4, F6_*) are parsed, validated and copied whole, but element-range reads refuse
// them by name, since an element boundary need not fall on a byte.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "shardsafe/core/error.hpp"

namespace shardsafe {

enum class dtype : std::uint8_t {
  BOOL,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
  F8_E8M0,
  F8_E4M3FNUZ,
  F8_E5M2FNUZ,
  C64,
  F4,
  F6_E2M3,
  F6_E3M2,
};

struct dtype_info {
  dtype type;
  std::string_view name;
  std::uint32_t bits;  ///< storage bits per element
};

inline constexpr std::array<dtype_info, 22> all_dtypes{{
    {dtype::BOOL, "BOOL", 8},
    {dtype::U8, "U8", 8},
    {dtype::I8, "I8", 8},
    {dtype::F8_E5M2, "F8_E5M2", 8},
    {dtype::F8_E4M3, "F8_E4M3", 8},
    {dtype::I16, "I16", 16},
    {dtype::U16, "U16", 16},
    {dtype::F16, "F16", 16},
    {dtype::BF16, "BF16", 16},
    {dtype::I32, "I32", 32},
    {dtype::U32, "U32", 32},
    {dtype::F32, "F32", 32},
    {dtype::F64, "F64", 64},
    {dtype::I64, "I64", 64},
    {dtype::U64, "U64", 64},
    {dtype::F8_E8M0, "F8_E8M0", 8},
    {dtype::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {dtype::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {dtype::C64, "C64", 64},
    {dtype::F4, "F4", 4},
    {dtype::F6_E2M3, "F6_E2M3", 6},
    {dtype::F6_E3M2, "F6_E3M2", 6},
}};

constexpr const dtype_info& info(dtype t) noexcept { return all_dtypes[static_cast<std::size_t>(t)]; }
/// A dtype's name as safetensors spells it ("F32"). Every enum of the library prints through
/// to_string(e) (the naming rule; name() is the deprecated spelling, kept one release).
constexpr std::string_view to_string(dtype t) noexcept { return info(t).name; }
[[deprecated("use to_string(dtype)")]] constexpr std::string_view name(dtype t) noexcept { return info(t).name; }
constexpr std::uint32_t bit_size(dtype t) noexcept { return info(t).bits; }
/// True when every element occupies whole bytes, so element ranges are byte ranges.
constexpr bool is_byte_sized(dtype t) noexcept { return info(t).bits % 8 == 0; }
/// Bytes per element; 0 for sub-byte dtypes (use bit_size).
constexpr std::size_t item_size(dtype t) noexcept { return is_byte_sized(t) ? info(t).bits / 8 : 0; }
/// Alignment the writer gives a tensor of this dtype (its item size, at least 1).
constexpr std::size_t alignment(dtype t) noexcept { return is_byte_sized(t) ? info(t).bits / 8 : 1; }
/// True for the floating-point dtypes that have a NaN (used by the NaN-fill validation).
constexpr bool has_nan(dtype t) noexcept {
  switch (t) {
    case dtype::F16:
    case dtype::BF16:
    case dtype::F32:
    case dtype::F64:
    case dtype::C64:
    case dtype::F8_E5M2:
    case dtype::F8_E4M3:
    case dtype::F8_E4M3FNUZ:
    case dtype::F8_E5M2FNUZ: return true;
    default: return false;
  }
}

static_assert(
    [] {
      for (std::size_t i = 0; i < all_dtypes.size(); ++i)
        if (static_cast<std::size_t>(all_dtypes[i].type) != i) return false;
      return true;
    }(),
    "all_dtypes must be indexed by the enum value");

/// The dtype with this safetensors name, or nullopt.
constexpr std::optional<dtype> parse_dtype(std::string_view s) noexcept {
  for (const auto& d : all_dtypes)
    if (d.name == s) return d.type;
  return std::nullopt;
}

/// Like parse_dtype, but throws errc::unknown_dtype naming the context.
inline dtype dtype_from_name(std::string_view s, std::string_view context) {
  if (auto d = parse_dtype(s)) return *d;
  fail(errc::unknown_dtype, std::string(context) + ": unknown dtype '" + std::string(s) + "'");
}

/// Throws errc::unsupported_dtype unless elements of t are whole bytes.
inline void require_byte_sized(dtype t, std::string_view context) {
  if (!is_byte_sized(t))
    fail(errc::unsupported_dtype, std::string(context) + ": dtype " + std::string(to_string(t)) + " has " +
                                      std::to_string(bit_size(t)) +
                                      "-bit elements; element-range access needs whole bytes");
}

}  // namespace shardsafe
