// Probe (not a kvkit kernel, not built by CMake): how many 8-lane float FMAs one core
// retires per second, to tell an arithmetic-bound kernel from one that waits on memory.
// Eight independent accumulator chains of 8-lane FMAs, unrolled so that the chains stay
// in registers (the loop must compile to 8 vfmadd per iteration; with the accumulators
// in an array the compiler may keep in memory, the loop measures store-to-load
// forwarding instead: 1.06 G/s against 6.0 G/s on the AVX2 EPYC of bench/RESULTS.md
// "2026-11-29 (night)").
// Build and run (AVX2 + FMA):
//   g++ -O2 -mavx2 -mfma -std=c++17 -Iinclude bench/probe_fma_throughput.cpp -o /tmp/fma && /tmp/fma
#include "kvkit/core/immintrin.hpp"  // <immintrin.h> without GCC 12's false warnings
#include <chrono>
#include <cstdio>

int main() {
  constexpr long kIters = 200000000;
  __m256 a0 = _mm256_set1_ps(0.1f), a1 = _mm256_set1_ps(0.2f), a2 = _mm256_set1_ps(0.3f),
         a3 = _mm256_set1_ps(0.4f), a4 = _mm256_set1_ps(0.5f), a5 = _mm256_set1_ps(0.6f),
         a6 = _mm256_set1_ps(0.7f), a7 = _mm256_set1_ps(0.8f);
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
    a0 = _mm256_fmadd_ps(a0, b, c);
    a1 = _mm256_fmadd_ps(a1, b, c);
    a2 = _mm256_fmadd_ps(a2, b, c);
    a3 = _mm256_fmadd_ps(a3, b, c);
    a4 = _mm256_fmadd_ps(a4, b, c);
    a5 = _mm256_fmadd_ps(a5, b, c);
    a6 = _mm256_fmadd_ps(a6, b, c);
    a7 = _mm256_fmadd_ps(a7, b, c);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  std::printf("8-lane FMAs: %.2f G/s (checksum %g)\n", 8.0 * kIters / s / 1e9,
              static_cast<double>(_mm256_cvtss_f32(sum)));
  return 0;
}
