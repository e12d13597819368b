// shardsafe/core/convert.hpp - dtype conversion between the IEEE-754 floating dtypes F16, BF16,
// F32 and F64, element by element over spans (docs/FORMAT.md §4, `to-hf --dtype`).
//
// The rules, the ones IEEE-754 gives for a conversion in the default rounding mode:
// - a value is rounded once, from its exact value, to the nearest value of the destination;
//   a tie goes to the value whose last significand bit is 0 (round to nearest, ties to even);
//   so F64 -> BF16 is not F64 -> F32 -> BF16 (that would round twice);
// - a value past the destination's largest finite value (after rounding) becomes an infinity
//   of its sign; infinities stay infinities; zeros keep their sign;
// - subnormal values are read and written exactly as IEEE-754 defines them (no flush to zero);
// - a NaN stays a NaN of its sign: the top bits of its payload are kept where the destination
//   has room for them, and the result is a quiet NaN (its top significand bit set), as the
//   hardware conversions do.
// Every value of F16, BF16 and F32 is exact in F64, so a widening conversion is exact and
// F16/BF16 -> F32 -> F16/BF16 gives back the same bits for every non-NaN value.
//
// Integer, BOOL and the other dtypes are never converted: asking to convert one to a different
// dtype is an errc::unsupported_dtype error naming both dtypes. A "conversion" to the same dtype
// is a plain copy, for any byte-sized dtype.
//
// convert_elements works on caller-provided spans, any length, element by element: a caller
// converts a tensor a chunk at a time while streaming it, without a full-size temporary.
// BF16 <-> F32 (what loading HF weights into F32 parameters and exporting them back run over
// every element) take a bit-level path with the same results; the other pairs go through the
// exact F64 value of each element.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"

namespace shardsafe {

/// True for the dtypes convert_elements converts between: F16, BF16, F32, F64.
constexpr bool is_convertible_float(dtype t) noexcept {
  return t == dtype::F16 || t == dtype::BF16 || t == dtype::F32 || t == dtype::F64;
}

/// Throws errc::unsupported_dtype, naming `context` and both dtypes, unless src == dst (a byte-
/// sized dtype, copied as it is) or both are among F16, BF16, F32, F64.
inline void require_convertible(dtype src, dtype dst, std::string_view context) {
  if (src == dst) {
    require_byte_sized(src, context);
    return;
  }
  if (!is_convertible_float(src) || !is_convertible_float(dst)) {
    const bool src_ok = is_convertible_float(src);
    fail(errc::unsupported_dtype,
         std::string(context) + ": cannot convert " + std::string(to_string(src)) + " to " +
             std::string(to_string(dst)) + ": " + std::string(to_string(src_ok ? dst : src)) +
             " is not a floating dtype that converts (only F16, BF16, F32 and F64 do; integer and BOOL "
             "tensors are never converted)");
  }
}

namespace detail {

/// The layout of one of the binary floating formats: exponent and stored significand bits.
struct float_format {
  int exponent_bits;
  int mantissa_bits;
};

constexpr float_format float_format_of(dtype t) noexcept {
  switch (t) {
    case dtype::F16: return {5, 10};
    case dtype::BF16: return {8, 7};
    case dtype::F32: return {8, 23};
    default: return {11, 52};  // F64
  }
}

/// The exact value of the bits of format f, as a double (every F16/BF16/F32/F64 value is one).
/// A NaN keeps its sign and payload (shifted to the top of the double's significand) and is
/// made quiet.
inline double decode_float_bits(std::uint64_t bits, float_format f) noexcept {
  const int mb = f.mantissa_bits, eb = f.exponent_bits;
  const std::uint64_t sign = (bits >> (mb + eb)) & 1u;
  const std::uint64_t exp = (bits >> mb) & ((std::uint64_t{1} << eb) - 1);
  const std::uint64_t man = bits & ((std::uint64_t{1} << mb) - 1);
  const std::uint64_t exp_all = (std::uint64_t{1} << eb) - 1;
  std::uint64_t out;
  if (exp == exp_all) {  // infinity or NaN
    out = (sign << 63) | (std::uint64_t{0x7ff} << 52) | (man << (52 - mb));
    if (man != 0) out |= std::uint64_t{1} << 51;  // quiet
    return std::bit_cast<double>(out);
  }
  const int bias = (1 << (eb - 1)) - 1;
  if (exp == 0) {  // zero or subnormal: man * 2^(1 - bias - mb), exact in a double
    const double v = std::ldexp(static_cast<double>(man), 1 - bias - mb);
    return sign ? -v : v;
  }
  // normal: rebias the exponent (a double's range holds every one of these formats)
  out = (sign << 63) | (static_cast<std::uint64_t>(static_cast<int>(exp) - bias + 1023) << 52) | (man << (52 - mb));
  return std::bit_cast<double>(out);
}

/// The bits of format f nearest to x, rounded once, ties to even; see the rules at the top.
inline std::uint64_t encode_float_bits(double x, float_format f) noexcept {
  const int mb = f.mantissa_bits, eb = f.exponent_bits;
  const std::uint64_t u = std::bit_cast<std::uint64_t>(x);
  const std::uint64_t sign = (u >> 63) << (mb + eb);
  const std::uint64_t dexp = (u >> 52) & 0x7ff;
  const std::uint64_t dman = u & ((std::uint64_t{1} << 52) - 1);
  const std::uint64_t exp_all = (std::uint64_t{1} << eb) - 1;
  const std::uint64_t inf = sign | (exp_all << mb);
  if (dexp == 0x7ff) {
    if (dman == 0) return inf;
    return inf | (dman >> (52 - mb)) | (std::uint64_t{1} << (mb - 1));  // NaN: payload top bits, quiet
  }
  if (dexp == 0 && dman == 0) return sign;  // signed zero
  // x = sig * 2^e exactly, sig < 2^53
  std::uint64_t sig = dexp == 0 ? dman : (dman | (std::uint64_t{1} << 52));
  const int e = dexp == 0 ? -1074 : static_cast<int>(dexp) - 1075;
  const int top = 63 - std::countl_zero(sig);  // x is in [2^(top+e), 2^(top+e+1))
  const int bias = (1 << (eb - 1)) - 1, emin = 1 - bias;
  const int exponent = top + e;
  // The destination's unit in the last place at x's magnitude (subnormals share emin's).
  const int unit = (exponent < emin ? emin : exponent) - mb;
  const int shift = unit - e;  // low bits of sig below that unit
  std::uint64_t q;
  if (shift <= 0) {
    q = sig << -shift;  // exact (only when the destination is at least as precise)
  } else if (shift > 54) {
    q = 0;  // below half of the smallest subnormal: sig < 2^53 <= 2^(shift-2)
  } else {
    q = sig >> shift;
    const std::uint64_t rem = sig & ((std::uint64_t{1} << shift) - 1), half = std::uint64_t{1} << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
  }
  if (exponent < emin) return sign | q;  // subnormal (q == 2^mb is the smallest normal: same bits)
  // normal: q in [2^mb, 2^(mb+1)]; adding it to the exponent field minus one carries a rounding
  // up to the next binade by itself
  const std::uint64_t bits = (static_cast<std::uint64_t>(exponent + bias - 1) << mb) + q;
  if (bits >= (exp_all << mb)) return inf;  // overflow, before or after rounding
  return sign | bits;
}

inline std::uint64_t load_le(const std::byte* p, std::size_t n) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

inline void store_le(std::byte* p, std::size_t n, std::uint64_t v) noexcept {
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

/// n elements through the exact F64 value of each: the definition every pair follows.
inline void convert_elements_generic(dtype src_type, const std::byte* s, dtype dst_type, std::byte* d,
                                     std::size_t n) noexcept {
  const std::size_t si = item_size(src_type), di = item_size(dst_type);
  const float_format sf = float_format_of(src_type), df = float_format_of(dst_type);
  for (std::size_t i = 0; i < n; ++i) {
    const double v = decode_float_bits(load_le(s + i * si, si), sf);
    store_le(d + i * di, di, encode_float_bits(v, df));
  }
}

// The pairs an import or export of BF16 weights runs over every element, on bits (little-
// endian hosts only), with the same results as convert_elements_generic: BF16 is the top half
// of an F32, so widening is a shift (a NaN made quiet), and narrowing rounds the low half to
// nearest even by adding 0x7fff plus the kept half's last bit (a carry into the exponent is
// the right rounding up, to infinity past the largest finite value). Loops the compiler
// vectorises.
inline void bf16_to_f32(const std::byte* s, std::byte* d, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t b;
    std::memcpy(&b, s + 2 * i, 2);
    const bool nan = (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0;
    const std::uint32_t u = std::uint32_t(b | (nan ? 0x0040u : 0u)) << 16;
    std::memcpy(d + 4 * i, &u, 4);
  }
}
inline void f32_to_bf16(const std::byte* s, std::byte* d, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, s + 4 * i, 4);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const std::uint16_t b = std::uint16_t(nan ? ((u >> 16) | 0x0040u) : rounded);
    std::memcpy(d + 2 * i, &b, 2);
  }
}

}  // namespace detail

/// Converts the elements in `src` (little-endian `src_type` values, as safetensors stores
/// them) into `dst` (little-endian `dst_type`), with the rules at the top of this header.
/// The number of elements is src.size() / item_size(src_type); src must hold whole elements
/// and dst exactly as many elements of dst_type, or errc::invalid_argument. src and dst must
/// not overlap unless they are the same span and the dtypes the same size. Returns the number
/// of elements converted.
///
/// Throws errc::unsupported_dtype (see require_convertible) for a pair that does not convert.
/// Call it on a chunk at a time: it keeps no state between calls.
inline std::size_t convert_elements(dtype src_type, std::span<const std::byte> src, dtype dst_type,
                                    std::span<std::byte> dst) {
  require_convertible(src_type, dst_type, "convert_elements");
  const std::size_t si = item_size(src_type), di = item_size(dst_type);
  if (src.size() % si != 0)
    fail(errc::invalid_argument, "convert_elements: " + std::to_string(src.size()) + " source bytes are not whole " +
                                     std::string(to_string(src_type)) + " elements");
  const std::size_t n = src.size() / si;
  if (dst.size() / di != n || dst.size() % di != 0)
    fail(errc::invalid_argument, "convert_elements: " + std::to_string(n) + " " + std::string(to_string(src_type)) +
                                     " elements need " + std::to_string(n * di) + " bytes of " +
                                     std::string(to_string(dst_type)) + ", the destination has " +
                                     std::to_string(dst.size()));
  if (src_type == dst_type) {
    if (n != 0 && src.data() != dst.data()) std::memmove(dst.data(), src.data(), src.size());
    return n;
  }
  if constexpr (std::endian::native == std::endian::little) {
    if (src_type == dtype::BF16 && dst_type == dtype::F32) {
      detail::bf16_to_f32(src.data(), dst.data(), n);
      return n;
    }
    if (src_type == dtype::F32 && dst_type == dtype::BF16) {
      detail::f32_to_bf16(src.data(), dst.data(), n);
      return n;
    }
  }
  detail::convert_elements_generic(src_type, src.data(), dst_type, dst.data(), n);
  return n;
}

}  // namespace shardsafe
