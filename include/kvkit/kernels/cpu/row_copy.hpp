#pragma once
// Row copies for the data-movement kernels (compact_tokens): rows of a KV head are a few
// cache lines (256 bytes for a 128-wide f16 row), so a library memmove call per row costs
// about as much as the move itself; copy_rows inlines whole-line moves at the call site.
// stream_lines does the same with non-temporal stores, for passes that write far more
// than the caches hold: the destination lines are then not read before being written
// (no read-for-ownership) and do not evict the source rows still to be read.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#define KVKIT_ROW_COPY_STREAM 1
#endif

namespace kvkit {
namespace detail {
namespace cpu {

/// Copies `bytes` from src to dst front to back. When bytes is a multiple of 64 and the
/// ranges are either apart or dst <= src - 64 (compaction only moves rows towards the
/// front, by whole rows), it moves 64-byte chunks inlined at the call site, each loaded
/// before it is stored, which is a correct forward move for such overlaps; otherwise it
/// calls memmove.
inline void copy_rows(void* dst,        // [bytes]
                      const void* src,  // [bytes]
                      std::size_t bytes) {
  constexpr std::size_t kLine = 64;
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const bool forward_safe = s + bytes <= d || d + kLine <= s;
  if ((bytes & (kLine - 1)) != 0 || !forward_safe) {
    std::memmove(dst, src, bytes);
    return;
  }
  for (std::size_t o = 0; o < bytes; o += kLine) {
    unsigned char line[kLine];
    std::memcpy(line, s + o, kLine);
    std::memcpy(d + o, line, kLine);
  }
}

/// True where stream_lines can stream (SSE2 targets).
inline constexpr bool kCanStreamRows =
#if defined(KVKIT_ROW_COPY_STREAM)
    true;
#else
    false;
#endif

/// Copies `bytes` from src to dst with non-temporal stores, 64 bytes at a time, each
/// chunk loaded whole before it is stored. Preconditions (the caller checks them once per
/// pass, not per row): bytes is a multiple of 64, dst is 16-byte aligned, and the ranges
/// are apart or dst <= src - 64 (a forward move). A pass that calls it must end with
/// stream_fence() before other threads read what it wrote. Without SSE2 it is copy_rows.
inline void stream_lines(void* dst,        // [bytes]
                         const void* src,  // [bytes]
                         std::size_t bytes) {
#if defined(KVKIT_ROW_COPY_STREAM)
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (std::size_t o = 0; o < bytes; o += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + o));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + o + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + o + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + o + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + o), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + o + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + o + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + o + 48), e);
  }
#else
  copy_rows(dst, src, bytes);
#endif
}

/// Orders the non-temporal stores of stream_lines before any later store (an sfence on
/// x86; nothing elsewhere, where stream_lines never streams).
inline void stream_fence() {
#if defined(KVKIT_ROW_COPY_STREAM)
  _mm_sfence();
#endif
}

/// Row movers for passes templated on the store kind (no per-row branch on it): call
/// operator() per run, fence() once at the end of the pass.
struct CachedRowMove {
  void operator()(void* dst, const void* src, std::size_t bytes) const { copy_rows(dst, src, bytes); }
  void fence() const {}
};
struct StreamingRowMove {  // stream_lines' preconditions hold for every call
  void operator()(void* dst, const void* src, std::size_t bytes) const {
    stream_lines(dst, src, bytes);
  }
  void fence() const { stream_fence(); }
};

}  // namespace cpu
}  // namespace detail
}  // namespace kvkit
