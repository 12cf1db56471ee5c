#pragma once
// The memory floor the benchmarks compare kernels with: a plain read of the same bytes.

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

}  // namespace bench
}  // namespace kvkit
