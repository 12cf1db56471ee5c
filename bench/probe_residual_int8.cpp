// Probe for #16 (not a kvkit kernel, not built by CMake): is an int8 query with AVX-512
// VNNI worth building into channel/residual.hpp? It times the score loop of
// residual_channel_attention alone, one thread, on one layout: 8-bit residual codes, 16
// exact half dims + 48 coded dims per token (rK 16 of a 64-dim head), 3 queries per kv
// head, blocks of 4 tokens, as the kernel does. Three loops, same process, same data:
//   dense      64 half dims per token (the dense kernel's score loop)
//   float      the residual as the kernel decodes it now: codes sign-extended, converted,
//              scaled, FMA with the float query
//   int8-q     the coded dims' query quantized to int8 (scale max|q|/127, round half even),
//              codes biased to unsigned (x ^ 0x80), one vpdpbusd per (query, token) for all
//              48 codes, the bias (-128 * sum qq) in lane 0, then convert, scale by
//              s_token * s_query, add to the exact part
// and prints the ratios plus the largest score difference int8-q vs float (random codes
// over the full range, so an upper end: real dropped dims are the small ones).
// Build and run (needs AVX-512 with VNNI and BW: Ice Lake and later, Zen 4):
//   g++ -O2 -march=native -std=c++17 -Iinclude bench/probe_residual_int8.cpp -o /tmp/probe
//   /tmp/probe 4096; /tmp/probe 1048576      # tokens: L2-resident, then from DRAM
#include "kvkit/core/immintrin.hpp"  // <immintrin.h> without GCC 12's false warnings
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cmath>
#include <algorithm>
#include <random>
#include <vector>
static int N = 4096; constexpr int G = 3, D = 64, R = 16, NC = 48;
static inline void hsum4(const __m512* x, float* out) {
  __m256 y[4];
  for (int i = 0; i < 4; ++i) y[i] = _mm256_add_ps(_mm512_castps512_ps256(x[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x[i]), 1)));
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}
int main(int argc, char** argv) {
  if (argc > 1) N = std::atoi(argv[1]);
  std::mt19937 rng(1);
  std::vector<uint16_t> dense(N * D), ex(N * R);
  std::vector<int8_t> codes(N * NC + 64);
  std::vector<float> sc(N), q(G * D), out(G * N), out2(G * N), out3(G * N);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : dense) x = _cvtss_sh(u(rng), 0);
  for (auto& x : ex) x = _cvtss_sh(u(rng), 0);
  for (auto& x : codes) x = (int8_t)(rng() % 255 - 127);
  for (auto& x : sc) x = 0.01f * (1 + u(rng));
  for (auto& x : q) x = u(rng);
  // int8 query of the coded dims
  alignas(64) int8_t qq[G][64] = {};
  float sq[G]; int32_t bias[G];
  for (int g = 0; g < G; ++g) {
    float m = 0; for (int j = 0; j < NC; ++j) m = std::max(m, std::fabs(q[g * D + R + j]));
    sq[g] = m / 127; int s = 0;
    for (int j = 0; j < NC; ++j) { qq[g][j] = (int8_t)std::nearbyint(q[g * D + R + j] / sq[g]); s += qq[g][j]; }
    bias[g] = -128 * s;
  }
  using Acc = __m512[G][4];
  // acc[g][t] += q[g, off .. off + 16) * k[t] for the G queries and 4 tokens.
  auto fma_rows = [&](Acc& acc, const __m512* k, int off) {
    for (int g = 0; g < G; ++g) {
      const __m512 qv = _mm512_loadu_ps(&q[g * D + off]);
      for (int t = 0; t < 4; ++t) acc[g][t] = _mm512_fmadd_ps(qv, k[t], acc[g][t]);
    }
  };
  // Fresh accumulators holding the 16 exact half dims of tokens t0 .. t0 + 3.
  auto exact_part = [&](Acc& acc, int t0) {
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < 4; ++t) acc[g][t] = _mm512_setzero_ps();
    __m512 k[4];
    for (int t = 0; t < 4; ++t) k[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)&ex[(t0 + t) * R]));
    fma_rows(acc, k, 0);
  };
  auto dense_k = [&] {
    for (int t0 = 0; t0 < N; t0 += 4) {
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g) for (int t = 0; t < 4; ++t) acc[g][t] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16) {
        __m512 k[4];
        for (int t = 0; t < 4; ++t) k[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)&dense[(t0 + t) * D + d]));
        fma_rows(acc, k, d);
      }
      for (int g = 0; g < G; ++g) hsum4(acc[g], &out[g * N + t0]);
    }
  };
  auto float_k = [&] {
    for (int t0 = 0; t0 < N; t0 += 4) {
      Acc acc;
      exact_part(acc, t0);
      for (int d = 0; d < NC; d += 16) {
        __m512 k[4];
        for (int t = 0; t < 4; ++t) k[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)&codes[(t0 + t) * NC + d]))), _mm512_set1_ps(sc[t0 + t]));
        fma_rows(acc, k, R + d);
      }
      for (int g = 0; g < G; ++g) hsum4(acc[g], &out2[g * N + t0]);
    }
  };
  auto int8_k = [&] {
    const __mmask64 m = (1ull << NC) - 1;
    for (int t0 = 0; t0 < N; t0 += 4) {
      Acc acc;
      exact_part(acc, t0);
      __m512i c[4];
      for (int t = 0; t < 4; ++t) c[t] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, &codes[(t0 + t) * NC]), _mm512_set1_epi8((char)0x80));
      for (int g = 0; g < G; ++g) {
        const __m512i qv = _mm512_load_si512(qq[g]);
        const __m512i b = _mm512_maskz_set1_epi32(1, bias[g]);
        for (int t = 0; t < 4; ++t) {
          const __m512 d = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(b, c[t], qv));
          acc[g][t] = _mm512_fmadd_ps(d, _mm512_set1_ps(sc[t0 + t] * sq[g]), acc[g][t]);
        }
      }
      for (int g = 0; g < G; ++g) hsum4(acc[g], &out3[g * N + t0]);
    }
  };
  auto time = [&](auto&& f) {
    double best = 1e9;
    for (int r = 0; r < (N > 100000 ? 5 : 30); ++r) {
      auto a = std::chrono::steady_clock::now();
      const int it = N > 100000 ? 2 : 20; for (int i = 0; i < it; ++i) f();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count() / it);
    }
    return best;
  };
  for (int rep = 0; rep < 3; ++rep) {
    const double td = time(dense_k), tf = time(float_k), ti = time(int8_k);
    printf("tokens %d: dense %.1f us, float %.1f us (%.2f of dense), int8-q %.1f us (%.2f of dense, %.2f of float)\n", N, td * 1e6, tf * 1e6, tf / td, ti * 1e6, ti / td, ti / tf);
  }
  double e = 0, mx = 0;
  for (int i = 0; i < G * N; ++i) { e = std::max(e, (double)std::fabs(out3[i] - out2[i])); mx = std::max(mx, (double)std::fabs(out2[i])); }
  printf("max |int8 - float| %.3g (max |score| %.3g)\n", e, mx);
}
