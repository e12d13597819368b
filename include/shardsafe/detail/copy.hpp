// shardsafe/detail/copy.hpp - bulk copies that bypass the cache on the way out.
//
// Loading copies tensor data (tens of MiB at a time) out of a mapping or a buffer into memory
// that nobody reads soon. An ordinary cached store first reads each destination line into
// the cache (a read for ownership), so a copy moves three bytes over the memory bus for each
// byte copied; a non-temporal (streaming) store moves two. glibc's memcpy switches to
// streaming stores only above __x86_shared_non_temporal_threshold, which is 3/4 of a
// thread's share of the last-level cache and so can be hundreds of MiB (181 MiB on a VM that
// reports a 480 MiB L3): a per-tensor copy of 16 MiB then runs at ~2/3 of what one large
// memcpy achieves (bench/bench_read measures both).
//
// stream_copy streams copies of at least stream_copy_min_bytes on x86-64 (SSE2, part of the
// x86-64 baseline: no special compiler flags) and is memcpy otherwise (and everywhere when
// SHARDSAFE_NO_STREAM_COPY is defined). It copies two 4 KiB
// pages side by side, a cache line of each per step, as glibc's own large-copy loop does:
// the hardware prefetchers work within a page, and two streams keep more lines in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(SHARDSAFE_NO_STREAM_COPY)
#include <emmintrin.h>
#define SHARDSAFE_STREAM_COPY 1
#endif

namespace shardsafe::detail {

/// Copies of this many bytes or more use streaming stores (where available).
inline constexpr std::size_t stream_copy_min_bytes = std::size_t(1) << 20;

/// memcpy(dst, src, n) for non-overlapping ranges; large copies bypass the cache.
inline void stream_copy(void* dst, const void* src, std::size_t n) noexcept {
  if (n == 0) return;  // empty tensors may have no memory at all (null pointers)
#ifdef SHARDSAFE_STREAM_COPY
  if (n >= stream_copy_min_bytes) {
    auto* d = static_cast<unsigned char*>(dst);
    const auto* s = static_cast<const unsigned char*>(src);
    // align the destination to a cache line: streaming stores then fill whole lines
    const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(d) & 63)) & 63;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    constexpr std::size_t page = 4096, block = 2 * page;
    for (; n >= block; d += block, s += block, n -= block) {
      for (std::size_t off = 0; off < page; off += 64) {
        const unsigned char* p0 = s + off;
        const unsigned char* p1 = s + page + off;
        _mm_prefetch(reinterpret_cast<const char*>(p0 + 512), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p1 + 512), _MM_HINT_T0);
        const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
        const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + 16));
        const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + 32));
        const __m128i a3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + 48));
        const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1));
        const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + 16));
        const __m128i b2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + 32));
        const __m128i b3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + 48));
        unsigned char* q0 = d + off;
        unsigned char* q1 = d + page + off;
        _mm_stream_si128(reinterpret_cast<__m128i*>(q0), a0);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q0 + 16), a1);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q0 + 32), a2);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q0 + 48), a3);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q1), b0);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q1 + 16), b1);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q1 + 32), b2);
        _mm_stream_si128(reinterpret_cast<__m128i*>(q1 + 48), b3);
      }
    }
    _mm_sfence();  // streaming stores are weakly ordered: fence before anyone else looks
    std::memcpy(d, s, n);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

/// Copies n elements of `item` bytes, element k from src + k * src_step bytes to dst + k *
/// dst_step bytes: a run of a chunk stored with its dimensions in another order (shard/read_plan.hpp's
/// read_piece steps). A loop per element size, so each copy is one move.
inline void strided_copy(void* dst, std::size_t dst_step, const void* src, std::size_t src_step, std::size_t n,
                         std::size_t item) noexcept {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  auto each = [&]<std::size_t B>() {
    for (std::size_t k = 0; k < n; ++k) std::memcpy(d + k * dst_step, s + k * src_step, B);
  };
  switch (item) {
    case 1: return each.template operator()<1>();
    case 2: return each.template operator()<2>();
    case 4: return each.template operator()<4>();
    case 8: return each.template operator()<8>();
    default:
      for (std::size_t k = 0; k < n; ++k) std::memcpy(d + k * dst_step, s + k * src_step, item);
  }
}

}  // namespace shardsafe::detail
