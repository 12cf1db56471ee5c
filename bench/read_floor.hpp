#pragma once
// The memory floor the benchmarks compare kernels with: a plain read of the same bytes, and
// how many bytes a benchmark must cycle through so that its reads come from DRAM.

#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kvkit {
namespace bench {

/// Sum of the 8-byte words w[begin, end): a plain read of those bytes with no other work
/// (4 independent sums, so the compiler vectorises the loop).
inline std::uint64_t sum_words(const std::uint64_t* w,  // [end]
                               std::size_t begin, std::size_t end) {
  std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  std::size_t i = begin;
  for (; i + 4 <= end; i += 4) {
    a0 += w[i];
    a1 += w[i + 1];
    a2 += w[i + 2];
    a3 += w[i + 3];
  }
  for (; i < end; ++i) a0 += w[i];
  return (a0 + a1) + (a2 + a3);
}

/// Bytes of the last-level cache as the C library reports it (the L3 on x86; 32 MiB when
/// it reports nothing). Server parts range from 32 MiB to over 256 MiB, so a fixed "cold"
/// working set that is DRAM on one machine is L3 on the next.
inline std::size_t llc_bytes() {
  long l3 = -1;
#if defined(_SC_LEVEL3_CACHE_SIZE)
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  return l3 > 0 ? static_cast<std::size_t>(l3) : std::size_t{32} << 20;
}

/// Bytes a benchmark cycles through before it reads the same data again, so that every
/// read comes from DRAM: at least `at_least`, and twice the last-level cache.
inline std::size_t dram_rotation_bytes(std::size_t at_least) {
  return std::max(at_least, 2 * llc_bytes());
}

}  // namespace bench
}  // namespace kvkit
