#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>

#include "kvkit/core/dtype.hpp"

using namespace kvkit;

// Reference binary16 rounding done in double: the nearest representable half, ties to
// even, computed by enumerating neighbours rather than by bit tricks.
static double half_value(std::uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

TEST_CASE("half round trip is exact for every finite half", "[dtype]") {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    if (((h >> 10) & 31) == 31) continue;
    const float f = static_cast<float>(half_t::from_bits(h));
    REQUIRE(static_cast<double>(f) == half_value(h));
    REQUIRE(half_t(f).bits == h);
  }
}

TEST_CASE("float to half rounds to nearest even", "[dtype]") {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-70000.f, 70000.f);
  std::uniform_int_distribution<int> scale(-30, 0);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::ldexp(u(rng), scale(rng));
    const std::uint16_t h = half_t(f).bits;
    if (std::fabs(f) >= 65520.f) {
      REQUIRE((h & 0x7fff) == 0x7c00);
      continue;
    }
    const double got = half_value(h);
    // neighbours of the result must not be strictly closer
    const std::uint16_t mag = h & 0x7fff;
    for (int d : {-1, 1}) {
      if (mag == 0 && d == -1) continue;
      std::uint16_t n = static_cast<std::uint16_t>((h & 0x8000) | (mag + d));
      if (((n >> 10) & 31) == 31) continue;
      const double err_got = std::fabs(got - f), err_n = std::fabs(half_value(n) - f);
      REQUIRE(err_got <= err_n);
      if (err_got == err_n) REQUIRE((h & 1) == 0);
    }
  }
}

TEST_CASE("bfloat16 rounds to nearest even and keeps NaN", "[dtype]") {
  std::mt19937 rng(99);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t x = bits(rng);
    float f;
    std::memcpy(&f, &x, 4);
    const bfloat16_t b(f);
    const float back = static_cast<float>(b);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(back));
      continue;
    }
    // Reference: exact rounding in 64-bit integer arithmetic on the bit pattern.
    const std::uint64_t low = x & 0xffffu, hi = x >> 16;
    std::uint64_t r = hi + ((low > 0x8000u || (low == 0x8000u && (hi & 1))) ? 1 : 0);
    REQUIRE(b.bits == static_cast<std::uint16_t>(r));
  }
  REQUIRE(static_cast<float>(bfloat16_t(1.0f)) == 1.0f);
  REQUIRE(dtype_of_v<bfloat16_t> == DType::kBFloat16);
  REQUIRE(std::string(to_string(DType::kFloat16)) == "float16");
}

TEST_CASE("dtype names round-trip through dtype_from_string; other names are refused", "[dtype]") {
  for (kvkit::DType d : {kvkit::DType::kFloat32, kvkit::DType::kFloat16, kvkit::DType::kBFloat16}) {
    kvkit::DType got = d == kvkit::DType::kFloat32 ? kvkit::DType::kBFloat16 : kvkit::DType::kFloat32;
    CHECK(kvkit::dtype_from_string(kvkit::to_string(d), &got));
    CHECK(got == d);
  }
  kvkit::DType keep = kvkit::DType::kFloat16;
  for (const char* bad : {"float8", "Float16", "f16", "", "float16 "}) {
    CHECK_FALSE(kvkit::dtype_from_string(bad, &keep));
    CHECK(keep == kvkit::DType::kFloat16);  // unchanged
  }
  CHECK_FALSE(kvkit::dtype_from_string(nullptr, &keep));
}
