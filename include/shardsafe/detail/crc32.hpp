// shardsafe/detail/crc32.hpp - CRC-32 (ISO-HDLC, the zip and zlib polynomial 0xEDB88320), as a
// running value over any number of byte spans. Slice-by-8 tables: about 8 bytes per table round.
// Used by the torch.save archives that DCP data files hold (format/torch_zip_writer.hpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace shardsafe::detail {

struct crc32_tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  constexpr crc32_tables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (std::size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

inline constexpr crc32_tables crc32_table{};

/// A running CRC-32: update() with each span in order, value() at any time.
class crc32 {
 public:
  void update(std::span<const std::byte> b) noexcept {
    const auto& t = crc32_table.t;
    std::uint32_t c = ~state_;
    const unsigned char* p = reinterpret_cast<const unsigned char*>(b.data());
    std::size_t n = b.size();
    while (n >= 8) {
      auto le32 = [](const unsigned char* q) {  // one load on little-endian hosts
        return std::uint32_t(q[0]) | std::uint32_t(q[1]) << 8 | std::uint32_t(q[2]) << 16 | std::uint32_t(q[3]) << 24;
      };
      const std::uint32_t lo = le32(p) ^ c, hi = le32(p + 4);
      c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
          t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
      p += 8;
      n -= 8;
    }
    while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
    state_ = ~c;
  }
  std::uint32_t value() const noexcept { return state_; }

 private:
  std::uint32_t state_ = 0;
};

/// The CRC-32 of the bytes A then B, from crc_a = CRC-32(A), crc_b = CRC-32(B) and B's length: so
/// that pieces of one record are checksummed on several threads and their values joined. It
/// appends len_b zero bits to crc_a through the CRC's shift operator in GF(2) (squared per bit
/// of len_b: O(32^2 log len_b) work), then adds crc_b.
inline std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b) noexcept {
  if (len_b == 0) return crc_a;
  using matrix = std::array<std::uint32_t, 32>;
  auto times = [](const matrix& m, std::uint32_t v) {
    std::uint32_t out = 0;
    for (std::size_t i = 0; v; ++i, v >>= 1)
      if (v & 1) out ^= m[i];
    return out;
  };
  auto square = [&](const matrix& m) {
    matrix out{};
    for (std::size_t i = 0; i < 32; ++i) out[i] = times(m, m[i]);
    return out;
  };
  matrix odd{};  // shifting by one zero bit
  odd[0] = 0xEDB88320u;
  for (std::size_t i = 1; i < 32; ++i) odd[i] = std::uint32_t(1) << (i - 1);
  matrix even = square(odd);  // two zero bits
  odd = square(even);         // four zero bits
  // each pass doubles the shift: one byte is eight bits, so start with the matrix of eight
  while (true) {
    even = square(odd);
    if (len_b & 1) crc_a = times(even, crc_a);
    len_b >>= 1;
    if (!len_b) break;
    odd = square(even);
    if (len_b & 1) crc_a = times(odd, crc_a);
    len_b >>= 1;
    if (!len_b) break;
  }
  return crc_a ^ crc_b;
}

/// The CRC-32 of one span.
inline std::uint32_t crc32_of(std::span<const std::byte> b) noexcept {
  crc32 c;
  c.update(b);
  return c.value();
}

}  // namespace shardsafe::detail
