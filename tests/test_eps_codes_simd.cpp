// EPS method codes, the arithmetic its certified bounds rest on, in every SIMD build of
// sketch/eps.hpp (portable, AVX2, -march=native: kvkit_add_simd_test):
//  - codes_block: each token's Σ_c a_c·x_tc within codes_seq_slack(d)·Σ_c |a_c|·x_tc of the
//    float64 sum, 4- and 8-bit codes, odd and even d;
//  - exp_sum_neg: within a quarter of kExpSumRel of the exact Σ e^x (a sweep of [-80, 0],
//    random sets, the edges), the slack codes_log_mass certifies with.
// The bounds' soundness end to end is test_eps's "eps codes" cases.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvkit/sketch/eps.hpp"
#include "reference.hpp"

namespace sk = kvkit::sketch;

TEST_CASE("eps codes: codes_block sums within codes_seq_slack of float64, 4 and 8 bits", "[eps][simd]") {
  KVKIT_TEST_RNG(rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int32_t bits : {4, 8})
    for (std::int32_t d : {1, 2, 3, 8, 17, 30, 64, 128}) {
      const std::int32_t levels = 1 << bits, bb = sk::detail::code_block_bytes(d, bits);
      double worst = 0;
      for (int trial = 0; trial < 200; ++trial) {
        std::vector<float> a(static_cast<std::size_t>(d));
        for (float& v : a) v = nd(rng) * std::exp(3.f * nd(rng));  // mixed magnitudes and signs
        // Codes of 16 tokens in the block layout (code_at reads them back).
        std::vector<std::uint8_t> blk(static_cast<std::size_t>(bb), 0);
        std::vector<std::int32_t> x(static_cast<std::size_t>(16) * d);
        for (std::int32_t t = 0; t < 16; ++t)
          for (std::int32_t c = 0; c < d; ++c) {
            const std::int32_t v = trial % 7 == 0 ? levels - 1 : static_cast<std::int32_t>(rng() % levels);
            x[static_cast<std::size_t>(t) * d + c] = v;
            if (bits == 8) {
              blk[static_cast<std::size_t>(c) * 16 + t] = static_cast<std::uint8_t>(v);
            } else {
              std::uint8_t& byte = blk[static_cast<std::size_t>(c) * 8 + (t % 8)];
              byte = static_cast<std::uint8_t>(t < 8 ? (byte & 0xF0) | v : (byte & 0x0F) | (v << 4));
            }
          }
        for (std::int32_t t = 0; t < 16; ++t)
          for (std::int32_t c = 0; c < d; ++c)
            REQUIRE(sk::detail::code_at(blk.data(), d, bits, t, c) == x[static_cast<std::size_t>(t) * d + c]);
        float acc[16];
        if (bits == 8)
          sk::detail::codes_block<8>(a.data(), blk.data(), d, acc);
        else
          sk::detail::codes_block<4>(a.data(), blk.data(), d, acc);
        for (std::int32_t t = 0; t < 16; ++t) {
          double exact = 0, mag = 0;
          for (std::int32_t c = 0; c < d; ++c) {
            const double term = double(a[c]) * x[static_cast<std::size_t>(t) * d + c];
            exact += term;
            mag += std::fabs(term);
          }
          CAPTURE(bits, d, trial, t, acc[t], exact, mag);
          REQUIRE(std::fabs(acc[t] - exact) <= sk::detail::codes_seq_slack(d) * mag);
          if (mag > 0) worst = std::max(worst, std::fabs(acc[t] - exact) / (sk::detail::codes_seq_slack(d) * mag));
        }
      }
      INFO(bits << " bits, d " << d << ": worst error " << worst << " of the slack");
      CHECK(worst <= 1.0);
    }
}

TEST_CASE("eps codes: exp_sum_neg is within a quarter of kExpSumRel of the exact sum", "[eps][simd]") {
  KVKIT_TEST_RNG(rng);
  double worst = 0;
  auto check = [&](const std::vector<double>& x) {
    long double exact = 0;
    for (double v : x) exact += std::exp(static_cast<long double>(v));
    std::vector<double> work = x;  // exp_sum_neg overwrites its input with the terms
    const double got = sk::detail::exp_sum_neg(work.data(), static_cast<std::int32_t>(work.size()));
    const double err = std::fabs(static_cast<double>(got - exact));
    const double allowed = sk::detail::kExpSumRel / 4 * static_cast<double>(exact) + x.size() * 2e-35;
    CAPTURE(x.size(), x.back(), got, static_cast<double>(exact));
    REQUIRE(err <= allowed);
    if (exact > 0) worst = std::max(worst, err / static_cast<double>(exact));
  };
  // One term at a time over [-80, 0] (each term's own relative error), 16 a call so the
  // vectorised loop runs whole: the sum's error is at most its worst term's.
  std::vector<double> x(16);
  for (int i = 0; i < 200000; i += 16) {
    for (int j = 0; j < 16; ++j) x[static_cast<std::size_t>(j)] = -80.0 * (i + j) / 200000.0;
    check(x);
  }
  std::uniform_real_distribution<double> u(-90.0, 0.0), small(-1.0, 0.0);
  for (int trial = 0; trial < 5000; ++trial) {
    x.assign(static_cast<std::size_t>(1 + trial % 64), 0.0);
    for (std::size_t i = 1; i < x.size(); ++i) x[i] = trial % 3 == 0 ? small(rng) : u(rng);
    check(x);
  }
  // The edges: 0, tiny, the reduction's boundary ±ln2/2, the clamp at -80, far below, -inf.
  const double half_ln2 = 0.34657359027997264;
  for (double e : {0.0, -1e-300, -1e-30, -half_ln2, std::nextafter(-half_ln2, 0.0), std::nextafter(-half_ln2, -1.0),
                   -79.999, -80.0, -80.001, -1e6, -std::numeric_limits<double>::infinity()}) {
    x = {0.0, e};
    check(x);
  }
  WARN("exp_sum_neg: worst relative error " << worst << " (certified " << sk::detail::kExpSumRel << ")");
}
