// write_kv from float rows into half / bfloat16 pools and gather_tokens from them into
// float outputs: the converting copies (simd.hpp's vectorised convert) must equal the
// scalar converters of core/dtype.hpp bit for bit, on random rows salted with the edge
// cases (subnormals, +-0, +-inf, NaN payloads, rounding ties, overflow). Built with the
// default flags, -march=native and AVX2 (kvkit_add_simd_test), so every vector path of
// the build machine runs.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Random floats in a wide range, every 7th element an edge case.
std::vector<float> salted_floats(std::size_t n, std::mt19937_64& rng) {
  const float edge[] = {0.f, -0.f, std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(),
                        bits_to_float(0x7fc00001u),  // quiet NaN with payload
                        bits_to_float(0xff800123u),  // signalling NaN, negative
                        65504.f, 65520.f, 1e-8f, -5.96e-8f, 2.98e-8f,  // half max/overflow/subnormal/ties
                        bits_to_float(0x00000001u), bits_to_float(0x3f808000u),  // bf16 tie to even
                        bits_to_float(0x3f818000u), 6.1035156e-05f, -3.0517578e-05f};
  std::uniform_real_distribution<float> mant(-2.f, 2.f);
  std::uniform_int_distribution<int> ex(-30, 20);
  std::uniform_int_distribution<std::size_t> pick(0, sizeof(edge) / sizeof(edge[0]) - 1);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = i % 7 == 3 ? edge[pick(rng)] : std::ldexp(mant(rng), ex(rng));
  return v;
}

template <class T>
bool same(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

}  // namespace

TEMPLATE_TEST_CASE("write_kv from float rounds like from_float, bit for bit", "[cpu][write_kv][convert]",
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t ps : {1, 16})
      for (std::int32_t dim : {5, 8, 64, 128})
        for (std::int32_t pad : {0, 3}) {
          CAPTURE(to_string(layout), ps, dim, pad);
          PoolSpec spec;
          spec.num_kv_heads = 2;
          spec.head_dim = dim;
          spec.page_size = ps;
          spec.layout = layout;
          spec.seq_lens = std::vector<std::int32_t>{ps + 3, 2 * ps};
          spec.row_padding = pad;
          const std::uint64_t seed = rng();
          std::mt19937_64 ra(seed);
          RandomPool<T> a(spec, ra);
          const std::int32_t num_slots = a.geometry.num_pages * ps;
          const std::int32_t n = std::min(20, num_slots);
          std::vector<std::int32_t> picks = random_distinct(n, num_slots, rng);
          std::vector<std::int64_t> slots(picks.begin(), picks.end());
          slots[0] = -1;  // padding token
          const std::int64_t stride = 2 * dim + 5;
          const std::vector<float> key = salted_floats(static_cast<std::size_t>(n * stride), rng);
          const std::vector<float> value = salted_floats(key.size(), rng);
          std::vector<T> want_k = a.k, want_v = a.v;
          for (std::int32_t i = 0; i < n; ++i) {
            if (slots[i] < 0) continue;
            const auto page = static_cast<std::int32_t>(slots[i] / ps),
                       off = static_cast<std::int32_t>(slots[i] % ps);
            for (std::int32_t h = 0; h < 2; ++h)
              for (std::int32_t d = 0; d < dim; ++d) {
                want_k[a.index(page, off, h, d)] = from_float<T>(key[i * stride + h * dim + d]);
                want_v[a.index(page, off, h, d)] = from_float<T>(value[i * stride + h * dim + d]);
              }
          }
          for (int threads : {1, 3}) {
            std::mt19937_64 rp(seed);
            RandomPool<T> pool(spec, rp);  // same contents as a
            REQUIRE(write_kv(exec::Host{threads}, pool.view, key.data(), value.data(), slots.data(),
                             n, stride)
                        .is_ok());
            for (std::size_t i = 0; i < want_k.size(); ++i) REQUIRE(same(pool.k[i], want_k[i]));
            for (std::size_t i = 0; i < want_v.size(); ++i) REQUIRE(same(pool.v[i], want_v[i]));
          }
        }
}

TEMPLATE_TEST_CASE("gather_tokens into float widens like to_float, bit for bit", "[cpu][gather][convert]",
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t ps : {1, 16})
      for (std::int32_t dim : {5, 8, 64, 128}) {
        CAPTURE(to_string(layout), ps, dim);
        PoolSpec spec;
        spec.num_kv_heads = 3;
        spec.head_dim = dim;
        spec.page_size = ps;
        spec.layout = layout;
        spec.seq_lens = std::vector<std::int32_t>{3 * ps + 2, 1, 40};
        RandomPool<T> pool(spec, rng);
        // Salt the pool with every special pattern class (subnormals, inf, NaN payloads).
        std::uniform_int_distribution<int> bits(0, 0xffff);
        for (std::size_t i = 0; i < pool.k.size(); i += 5) {
          pool.k[i] = T::from_bits(static_cast<std::uint16_t>(bits(rng)));
          pool.v[i] = T::from_bits(static_cast<std::uint16_t>(i % 2 ? 0x7c01 + i % 500 : 0x0001 + i % 1000));
        }
        for (std::int32_t b = 0; b < pool.batch_size(); ++b) {
          const std::int32_t len = pool.seq_lens[static_cast<std::size_t>(b)];
          for (bool explicit_ids : {true, false}) {
            std::vector<std::int32_t> ids(static_cast<std::size_t>(len));
            std::uniform_int_distribution<std::int32_t> u(0, len - 1);
            for (std::int32_t i = 0; i < len; ++i) ids[static_cast<std::size_t>(i)] = i % 3 ? i : u(rng);
            const std::size_t sz = static_cast<std::size_t>(3) * len * dim;
            for (int threads : {1, 3}) {
              std::vector<float> k(sz + 1, 7.f), v(sz + 1, 7.f);
              const std::int32_t* idp = explicit_ids ? ids.data() : nullptr;
              REQUIRE(gather_tokens(exec::Host{threads}, pool.view, b, idp, len, k.data(), v.data())
                          .is_ok());
              for (std::int32_t h = 0; h < 3; ++h)
                for (std::int32_t i = 0; i < len; ++i) {
                  const std::int32_t t = explicit_ids ? ids[static_cast<std::size_t>(i)] : i;
                  for (std::int32_t d = 0; d < dim; ++d) {
                    const std::size_t o = (static_cast<std::size_t>(h) * len + i) * dim + d;
                    REQUIRE(same(k[o], to_float(pool.k[pool.token_index(b, t, h, d)])));
                    REQUIRE(same(v[o], to_float(pool.v[pool.token_index(b, t, h, d)])));
                  }
                }
              REQUIRE(k[sz] == 7.f);  // nothing written past the output
            }
          }
        }
      }
}
