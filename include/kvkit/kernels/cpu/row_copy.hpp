#pragma once
// Row copies for the data-movement kernels (compact_tokens): rows of a KV head are a few
// cache lines (256 bytes for a 128-wide f16 row), so a library memmove call per row costs
// about as much as the move itself; copy_rows inlines whole-line moves at the call site.

#include <cstddef>
#include <cstdint>
#include <cstring>

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

}  // namespace cpu
}  // namespace detail
}  // namespace kvkit
