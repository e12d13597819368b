// shardsafe/core/quant.hpp - the block-scaled quantized weight formats (docs/FORMAT.md §8): their
// element and scale encodings, and a weight's value from its element and its block's scales.
//
// | scheme      | elements                 | scale per block                        | block         |
// |-------------|--------------------------|----------------------------------------|---------------|
// | fp8_block   | F8_E4M3                  | F32 (DeepSeek-V3's weight_scale_inv)   | 128 x 128 (the|
// |             |                          |                                        | config's)     |
// | fp8_channel | F8_E4M3                  | F32, BF16 or F16 a row: [M, 1] or [M]  | a row, 1 x N  |
// |             |                          | (compressed-tensors, FBGEMM)           |               |
// | fp8_tensor  | F8_E4M3                  | F32, BF16 or F16: one value            | M x N         |
// | mxfp8       | F8_E4M3                  | E8M0 (F8_E8M0 or U8)                   | 32, last dim  |
// | mxfp4       | FP4 E2M1, two a byte     | E8M0 (U8: gpt-oss's X_scales)          | 32, last dim  |
// | nvfp4       | FP4 E2M1, two a byte     | F8_E4M3, times one F32 per tensor      | 16, last dim  |
//
// The encodings, from their definitions (OCP 8-bit Floating Point v1.0, OCP Microscaling
// Formats v1.0, NVIDIA's NVFP4):
// - E4M3 (torch's float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
//   subnormal (m/8 * 2^-6); no infinities; S.1111.111 is the only NaN; largest 448.
// - E8M0: 2^(v - 127); 0xFF is NaN. No sign, no zero.
// - E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
// - Two E2M1 codes a byte, the first element in the low nibble (OCP MX packing, gpt-oss's blocks,
//   torch's float4_e2m1fn_x2).
//
// A value is element x block scale (x the tensor scale, for NVFP4): computed exactly (each
// product has at most 30 significant bits, exact in a double) and rounded once, to nearest with
// ties to even, into the destination (F32, BF16, F16, F64): detail::encode_float_bits. A route
// through F32 (torch's `w.float() * s` then `.to(bfloat16)`) rounds twice and may differ in the
// last BF16 bit where the F32 product lands on a BF16 tie.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

#include "shardsafe/core/convert.hpp"
#include "shardsafe/core/dtype.hpp"

namespace shardsafe {

/// A block-scaled quantization scheme (the table at the top).
enum class quant_scheme : std::uint8_t { fp8_block, mxfp8, mxfp4, nvfp4, fp8_channel, fp8_tensor };

/// Whether a scheme's scales are a 2-D grid over [M, N] of block_rows x block_cols blocks (FP8
/// with F32/BF16/F16 scales: blocks, rows, the tensor), rather than one scale per block_cols
/// elements of each row (the MX formats, NVFP4).
constexpr bool row_blocked(quant_scheme s) noexcept {
  return s == quant_scheme::fp8_block || s == quant_scheme::fp8_channel || s == quant_scheme::fp8_tensor;
}

constexpr std::string_view to_string(quant_scheme s) noexcept {
  switch (s) {
    case quant_scheme::fp8_block: return "fp8_block";
    case quant_scheme::mxfp8: return "mxfp8";
    case quant_scheme::mxfp4: return "mxfp4";
    case quant_scheme::nvfp4: return "nvfp4";
    case quant_scheme::fp8_channel: return "fp8_channel";
    case quant_scheme::fp8_tensor: return "fp8_tensor";
  }
  return "?";
}

/// Bits per element of a scheme's weight (4: two a byte, the first in the low nibble).
constexpr unsigned element_bits(quant_scheme s) noexcept {
  return s == quant_scheme::mxfp4 || s == quant_scheme::nvfp4 ? 4 : 8;
}

/// The value of an E4M3 (fn) code; NaN for S.1111.111.
inline double e4m3_value(std::uint8_t c) noexcept {
  const unsigned e = (c >> 3) & 0xF, m = c & 0x7;
  if (e == 0xF && m == 0x7) return std::numeric_limits<double>::quiet_NaN();
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(8.0 + m, static_cast<int>(e) - 10);
  return (c & 0x80) ? -v : v;
}

/// The value of an E8M0 scale, 2^(c - 127); nullopt for 0xFF (NaN).
inline std::optional<double> e8m0_value(std::uint8_t c) noexcept {
  if (c == 0xFF) return std::nullopt;
  return std::ldexp(1.0, static_cast<int>(c) - 127);
}

/// The value of an E2M1 code (its low 4 bits).
inline double e2m1_value(std::uint8_t nibble) noexcept {
  static constexpr double mag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double v = mag[nibble & 0x7];
  return (nibble & 0x8) ? -v : v;
}

/// The value of element `i` (0 or 1 within its byte for 4-bit elements) of a scheme's weight,
/// from the byte holding it.
inline double element_value(quant_scheme s, std::uint8_t byte, unsigned nibble) noexcept {
  if (element_bits(s) == 8) return e4m3_value(byte);
  return e2m1_value(static_cast<std::uint8_t>(nibble ? byte >> 4 : byte & 0xF));
}

/// The value of a block scale stored as `type` (F32, BF16, F16, F8_E4M3, F8_E8M0 or U8 holding E8M0) at
/// p; nullopt where it is not a usable scale (NaN, infinite, E8M0's 0xFF).
inline std::optional<double> scale_value(dtype type, const std::byte* p) noexcept {
  double v;
  switch (type) {
    case dtype::F32:
    case dtype::BF16:
    case dtype::F16:
      v = detail::decode_float_bits(detail::load_le(p, item_size(type)), detail::float_format_of(type));
      break;
    case dtype::F8_E4M3: v = e4m3_value(std::to_integer<std::uint8_t>(*p)); break;
    case dtype::F8_E8M0:
    case dtype::U8: return e8m0_value(std::to_integer<std::uint8_t>(*p));
    default: return std::nullopt;
  }
  if (!std::isfinite(v)) return std::nullopt;
  return v;
}

/// The bits of x rounded once into the floating dtype dst (F16, BF16, F32, F64), stored at out.
inline void store_float(dtype dst, double x, std::byte* out) noexcept {
  if (dst == dtype::F64) {
    detail::store_le(out, 8, std::bit_cast<std::uint64_t>(x));
    return;
  }
  detail::store_le(out, item_size(dst), detail::encode_float_bits(x, detail::float_format_of(dst)));
}

}  // namespace shardsafe
