// kernels/cpu/simd.hpp: every vectorised conversion equals the scalar converter of
// core/dtype.hpp bit for bit, and the vector exp / dot / axpy are accurate. This file is
// compiled once per instruction set the build machine has (see tests/CMakeLists.txt), so
// each path is checked where it can run.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvkit/kernels/cpu/simd.hpp"
#include "reference.hpp"

using namespace kvkit;
using kvkit::detail::cpu::convert;
using kvkit::detail::cpu::code_at;
using kvkit::detail::cpu::load_codes;
using kvkit::detail::cpu::load_codes_partial;
using kvkit::detail::cpu::load_nibble_pairs;
using kvkit::detail::cpu::Vec;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Converts through convert() at every offset/length mix (vector body + scalar tail) and
// returns the first index whose bits differ from the scalar converter, or -1.
template <class From, class To, class Scalar>
long first_mismatch(const std::vector<From>& src, Scalar scalar) {
  std::vector<To> got(src.size());
  // Unaligned start and odd length so both the vector loop and the tail run.
  convert(src.data(), got.data(), 3);
  convert(src.data() + 3, got.data() + 3, src.size() - 3);
  for (std::size_t i = 0; i < src.size(); ++i) {
    const To want = scalar(src[i]);
    if (std::memcmp(&want, &got[i], sizeof(To)) != 0) return static_cast<long>(i);
  }
  return -1;
}

}  // namespace

TEST_CASE("simd path reported", "[simd]") {
  // Not a check: shows in the log which instruction set this binary exercises.
  WARN("simd path: " << kvkit::detail::cpu::simd_isa());
  SUCCEED();
}

TEST_CASE("half -> float equals the scalar converter on all 65536 patterns", "[simd][half]") {
  std::vector<half_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = half_t::from_bits(static_cast<std::uint16_t>(i));
  const long bad = first_mismatch<half_t, float>(all, [](half_t h) { return to_float(h); });
  CAPTURE(bad);
  REQUIRE(bad == -1);
  // NaN payloads survive: a signalling NaN pattern stays a NaN with its payload.
  float f;
  convert(&all[0x7c01], &f, 1);
  REQUIRE(std::isnan(f));
  std::vector<float> out(16);
  convert(all.data() + 0x7c01, out.data(), 16);
  for (float x : out) REQUIRE(std::isnan(x));
  REQUIRE(bits_of(out[0]) == 0x7f802000u);
  // Vec::load (the kernels' fast widening) agrees on every non-NaN pattern.
  std::vector<float> lanes(Vec::kLanes);
  for (std::uint32_t i = 0; i < 65536; i += Vec::kLanes) {
    Vec::load(all.data() + i).store(lanes.data());
    for (int j = 0; j < Vec::kLanes; ++j) {
      const float want = to_float(all[i + j]);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(lanes[j]));
      } else if (bits_of(want) != bits_of(lanes[j])) {
        FAIL("Vec::load(half) pattern " << (i + j) << " gives " << lanes[j] << " want " << want);
      }
    }
  }
}

TEST_CASE("float -> half equals the scalar converter", "[simd][half]") {
  KVKIT_TEST_RNG(rng);
  std::vector<float> src;
  // Every half value, the midpoints between neighbours (ties round to even), and one ulp
  // either side of each midpoint: all rounding edges including subnormals and overflow.
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const float a = to_float(half_t::from_bits(static_cast<std::uint16_t>(h)));
    const float b = h + 1 == 0x7c00 ? 65536.f : to_float(half_t::from_bits(static_cast<std::uint16_t>(h + 1)));
    const float mid = (a + b) * 0.5f;  // exact: halves have few mantissa bits
    for (float x : {a, mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e30f)}) {
      src.push_back(x);
      src.push_back(-x);
    }
  }
  for (float x : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 65519.99f, 65520.f, 1e-8f, 3e-8f})
    for (float s : {1.f, -1.f}) src.push_back(s * x);
  // NaNs with assorted payloads and signs (scalar: sign | 0x7e00).
  for (std::uint32_t u : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0x7fffe000u, 0xffc00001u,
                          0xff800100u, 0x7f802000u})
    src.push_back(float_of(u));
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 1000000; ++i) src.push_back(float_of(any(rng)));
  const long bad = first_mismatch<float, half_t>(
      src, [](float x) { return half_t::from_bits(detail::float_to_half_bits(x)); });
  const std::uint32_t bad_bits = bad >= 0 ? bits_of(src[static_cast<std::size_t>(bad)]) : 0u;
  CAPTURE(bad, bad_bits);
  REQUIRE(bad == -1);
}

TEST_CASE("bfloat16 <-> float equal the scalar converters", "[simd][bf16]") {
  KVKIT_TEST_RNG(rng);
  std::vector<bfloat16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i)
    all[i] = bfloat16_t::from_bits(static_cast<std::uint16_t>(i));
  REQUIRE((first_mismatch<bfloat16_t, float>(all, [](bfloat16_t b) { return to_float(b); })) == -1);

  std::vector<float> src;
  // Round-to-nearest-even edges: exact ties with even and odd kept bits, one below and
  // above a tie, carries into the exponent, overflow to inf, subnormals, NaN payloads.
  for (std::uint32_t hi : {0x3f80u, 0x3f81u, 0x7f7fu, 0x0000u, 0x0001u, 0x007fu, 0x0080u, 0x7f7eu,
                           0x4049u, 0x8000u, 0xbf81u}) {
    for (std::uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x0001u}) {
      src.push_back(float_of((hi << 16) | lo));
    }
  }
  for (std::uint32_t u : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xff800001u,
                          0x7fbfffffu, 0x7f810000u, 0x7fff0000u})
    src.push_back(float_of(u));
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 1000000; ++i) src.push_back(float_of(any(rng)));
  std::uniform_real_distribution<float> real(-100.f, 100.f);
  for (int i = 0; i < 100000; ++i) src.push_back(real(rng));
  const long bad = first_mismatch<float, bfloat16_t>(
      src, [](float x) { return bfloat16_t::from_bits(detail::float_to_bf16_bits(x)); });
  CAPTURE(bad);
  REQUIRE(bad == -1);
}

TEST_CASE("vector exp, dot and axpy match double precision", "[simd][math]") {
  KVKIT_TEST_RNG(rng);
  // exp on the softmax domain (x <= 0) and a little above; relative error a few ulp.
  std::uniform_real_distribution<float> u(-90.f, 5.f);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float x = i < 3 ? (i == 0 ? 0.f : i == 1 ? -87.f : -std::numeric_limits<float>::infinity())
                          : u(rng);
    const float got = kvkit::detail::cpu::vexp1(x);
    const double want = std::exp(static_cast<double>(x));
    if (want < 1e-37) {
      REQUIRE(got <= 2e-37f);  // underflow region: 0 or a tiny value
      REQUIRE(got >= 0.f);
      continue;
    }
    worst = std::max(worst, std::abs(got - want) / want);
  }
  CAPTURE(worst);
  REQUIRE(worst < 1e-6);
  REQUIRE(kvkit::detail::cpu::vexp1(-std::numeric_limits<float>::infinity()) == 0.f);
  REQUIRE(kvkit::detail::cpu::vexp1(0.f) == 1.f);

  for (std::int32_t n : {1, 7, 8, 16, 33, 64, 128, 129}) {
    CAPTURE(n);
    std::vector<float> a = test::random_vector<float>(static_cast<std::size_t>(n), rng);
    std::vector<half_t> b = test::random_vector<half_t>(static_cast<std::size_t>(n), rng);
    double want = 0;
    for (std::int32_t i = 0; i < n; ++i) want += static_cast<double>(a[i]) * to_float(b[i]);
    REQUIRE(std::abs(kvkit::detail::cpu::dot(a.data(), b.data(), n) - want) < 1e-5 * n);
    std::vector<float> y = test::random_vector<float>(static_cast<std::size_t>(n), rng);
    std::vector<double> wy(y.begin(), y.end());
    for (std::int32_t i = 0; i < n; ++i) wy[i] += 0.75 * to_float(b[i]);
    kvkit::detail::cpu::axpy(y.data(), 0.75f, b.data(), n);
    REQUIRE(test::compare_close(y.data(), wy, test::Tolerance{1e-6, 1e-6}, "axpy") == "");
  }
}

// The residual kernels' code loads (channel/residual.hpp): every lane equals the code the
// documented layout holds, read here bit by bit, for all 256 byte values in every lane
// position, whole vectors at every even offset and partial ones of every length; a partial
// load reads no byte past its codes (the row ends at its last code, under ASan); 4-bit
// codes also as load_nibble_pairs splits them (even codes, odd codes).
namespace {
template <int kBits>
void check_code_loads(std::mt19937_64& rng) {
  constexpr int W = Vec::kLanes;
  const int n = 3 * W + 5;  // codes per row
  std::vector<std::uint8_t> row(static_cast<std::size_t>((n * kBits + 7) / 8));
  std::uniform_int_distribution<int> byte(0, 255);
  auto documented = [&](int c) {
    if (kBits == 8) return static_cast<int>(static_cast<std::int8_t>(row[static_cast<std::size_t>(c)]));
    const int nib = (row[static_cast<std::size_t>(c / 2)] >> ((c % 2) * 4)) & 0xF;
    return nib >= 8 ? nib - 16 : nib;
  };
  for (int round = 0; round < 256 + 16; ++round) {
    for (std::size_t i = 0; i < row.size(); ++i)
      row[i] = static_cast<std::uint8_t>(round < 256 ? (round + static_cast<int>(i)) & 255 : byte(rng));
    float got[W];
    for (int j = 0; j + W <= n; j += 2) {
      load_codes<kBits>(row.data(), j).store(got);
      for (int i = 0; i < W; ++i)
        if (got[i] != static_cast<float>(documented(j + i)))
          FAIL(kBits << "-bit code " << j + i << ": " << got[i] << " != " << documented(j + i));
    }
    for (int len = 1; len < W; ++len) {
      const int j = (n - len) / 2 * 2;  // even start; the row's last codes when n - len is even
      load_codes_partial<kBits>(row.data(), j, len).store(got);
      for (int i = 0; i < W; ++i)
        if (got[i] != (i < len ? static_cast<float>(documented(j + i)) : 0.f))
          FAIL(kBits << "-bit partial load of " << len << " at " << j << ", lane " << i << ": " << got[i]);
    }
    // 4 bits, split by parity: every even start, every length up to a whole pair
    // (2 kLanes codes, the vector path), the row's last codes included.
    if constexpr (kBits == 4)
      for (int j = 0; j < n; j += 2)
        for (int rest = 1; rest <= std::min(2 * W, n - j); ++rest) {
          Vec ev, od;
          load_nibble_pairs(row.data(), j, rest, &ev, &od);
          float e[W], o[W];
          ev.store(e);
          od.store(o);
          for (int i = 0; i < W; ++i) {
            const float want_e = 2 * i < rest ? static_cast<float>(documented(j + 2 * i)) : 0.f;
            const float want_o = 2 * i + 1 < rest ? static_cast<float>(documented(j + 2 * i + 1)) : 0.f;
            if (e[i] != want_e || o[i] != want_o)
              FAIL("nibble pairs of " << rest << " at " << j << ", lane " << i << ": " << e[i] << " / " << o[i]
                                      << " != " << want_e << " / " << want_o);
          }
        }
  }
}
}  // namespace

TEST_CASE("code loads equal the documented 4- and 8-bit layouts", "[simd][codes]") {
  KVKIT_TEST_RNG(rng);
  check_code_loads<8>(rng);
  check_code_loads<4>(rng);
  CHECK(code_at<4>(std::vector<std::uint8_t>{0x8F}.data(), 0) == -1);
  CHECK(code_at<4>(std::vector<std::uint8_t>{0x8F}.data(), 1) == -8);
  CHECK(code_at<8>(std::vector<std::uint8_t>{0x80}.data(), 0) == -128);
}
