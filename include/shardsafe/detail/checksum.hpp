// shardsafe/detail/checksum.hpp - the checksums of tensor data (docs/FORMAT.md §2, "Checksums"):
// XXH3-64 (xxHash, from the system's libxxhash) of each block of a tensor's bytes in a file.
//
// A tensor of N bytes in a file is cut into blocks of B bytes from its first byte (block k:
// bytes [k*B, min((k+1)*B, N)) of its data; the last one shorter; none when N is 0), and each
// block has its own 64-bit hash. A damaged byte is then located to one block (an element
// range), and a load that reads part of a tensor checks only the blocks it touches. Hashes
// are written as 16 lowercase hex digits (the value, most significant digit first: what
// `xxhsum -H3` prints).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <string_view>

#include <xxhash.h>

#include "shardsafe/detail/hex.hpp"
// On x86-64, xxHash's dispatcher picks the widest XXH3 kernel the CPU has (AVX2, AVX-512) at
// run time, where the library ships it (Debian's libxxhash does; the wrap builds it too):
// about twice the speed of the SSE2 kernel a baseline x86-64 build compiles. The hashes are
// the same. Its header would rename XXH3_64bits for every includer: that is switched off.
#if (defined(__x86_64__) || defined(_M_X64)) && __has_include(<xxh_x86dispatch.h>) && !defined(SHARDSAFE_NO_XXH3_DISPATCH)
#ifndef XXH_DISPATCH_DISABLE_REPLACE
#define XXH_DISPATCH_DISABLE_REPLACE
#define SHARDSAFE_UNDEF_XXH_DISPATCH_DISABLE_REPLACE
#endif
#include <xxh_x86dispatch.h>
#ifdef SHARDSAFE_UNDEF_XXH_DISPATCH_DISABLE_REPLACE
#undef XXH_DISPATCH_DISABLE_REPLACE
#undef SHARDSAFE_UNDEF_XXH_DISPATCH_DISABLE_REPLACE
#endif
#define SHARDSAFE_XXH3_DISPATCH 1
#endif

namespace shardsafe {

/// The one checksum algorithm this library writes and checks.
inline constexpr std::string_view checksum_algorithm = "xxh3-64";
/// The block size saves use unless told otherwise: 4 MiB. A 70B-parameter model in BF16
/// (140 GB) then has ~33,400 blocks, ~0.7 MB of hashes in metadata.json; with its Adam state
/// in F32 (~840 GB), ~4 MB.
inline constexpr std::uint64_t default_checksum_block_bytes = std::uint64_t(4) << 20;

namespace detail {

/// XXH3-64 of n bytes at p (seed 0).
inline std::uint64_t xxh3_64(const void* p, std::size_t n) noexcept {
#ifdef SHARDSAFE_XXH3_DISPATCH
  return XXH3_64bits_dispatch(p, n);
#else
  return XXH3_64bits(p, n);
#endif
}

/// XXH3-64 (seed 0) of bytes given a piece at a time: the same hash as xxh3_64 of them all, so
/// a block larger than any read is hashed through pieces of bounded size.
class xxh3_64_stream {
 public:
  xxh3_64_stream() : st_(XXH3_createState()) {
    if (!st_) throw std::bad_alloc();
    XXH3_64bits_reset(st_);
  }
  ~xxh3_64_stream() { XXH3_freeState(st_); }
  xxh3_64_stream(const xxh3_64_stream&) = delete;
  xxh3_64_stream& operator=(const xxh3_64_stream&) = delete;
  void update(const void* p, std::size_t n) noexcept {
#ifdef SHARDSAFE_XXH3_DISPATCH
    XXH3_64bits_update_dispatch(st_, p, n);
#else
    XXH3_64bits_update(st_, p, n);
#endif
  }
  std::uint64_t digest() const noexcept { return XXH3_64bits_digest(st_); }

 private:
  XXH3_state_t* st_;
};

/// How many blocks of `block` bytes a tensor of `nbytes` bytes has (block > 0).
constexpr std::uint64_t checksum_block_count(std::uint64_t nbytes, std::uint64_t block) noexcept {
  return nbytes == 0 ? 0 : (nbytes - 1) / block + 1;
}

/// 16 lowercase hex digits.
inline std::string hex64(std::uint64_t v) { return hex_digits(v, 16); }

/// The value of exactly 16 hex digits (either case), or nothing.
inline std::optional<std::uint64_t> parse_hex64(std::string_view s) noexcept {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    unsigned d;
    if (c >= '0' && c <= '9')
      d = static_cast<unsigned>(c - '0');
    else if (c >= 'a' && c <= 'f')
      d = static_cast<unsigned>(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      d = static_cast<unsigned>(c - 'A' + 10);
    else
      return std::nullopt;
    v = (v << 4) | d;
  }
  return v;
}

}  // namespace detail
}  // namespace shardsafe
