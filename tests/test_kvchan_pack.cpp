// kvchan's page pack / unpack (include/kvkit/channel/pack_pages.hpp) on the CPU: on fresh
// random pools (full-width side NHD or HND, float / half / bfloat16, partial last pages,
// sets from 1 dim to the full width) packing equals the per-element gather bit for bit and
// touches nothing else; unpacking the packed pages gives back the original elements on
// the selected dims (round trip exact) and the fill (or 0) elsewhere; bad page ids,
// channel ids out of range or out of order, and inconsistent counts are rejected with
// nothing written. The row transforms pack_channels / unpack_channels (kvchan.hpp) are
// tested in test_kvchan.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvchan_pack_cases.hpp"
#include "kvkit/core/thread_pool.hpp"
#include "reference.hpp"

using namespace kvkit;
using kvkit::test::PackCase;

namespace {

template <class T>
void check_pack_unpack(const PackCase<T>& c0, exec::Host ex) {
  PackCase<T> c = c0;
  const std::vector<T> pk0 = c.pk, pv0 = c.pv;
  auto full = c.full_view(c.fk.data(), c.fv.data());
  auto packed = c.packed_view(c.pk.data(), c.pv.data());
  REQUIRE(channel::pack_channel_pages(ex, full, packed, c.kch.data(), c.vch.data(), c.full_pages.data(),
                                      c.packed_pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  // Expected packed pool: the initial one with the gathered rows written.
  std::vector<T> wk = pk0, wv = pv0;
  for (std::int32_t t = 0; t < c.n_tokens; ++t) {
    const std::int32_t src = c.full_pages[static_cast<std::size_t>(t / c.page_size)];
    const std::int32_t dst = c.packed_pages[static_cast<std::size_t>(t / c.page_size)], s = t % c.page_size;
    for (std::int32_t h = 0; h < c.heads; ++h) {
      for (std::int32_t j = 0; j < c.rk; ++j)
        wk[static_cast<std::size_t>(packed.k_offset(dst, s, h) + j)] =
            c.fk[static_cast<std::size_t>(full.k_offset(src, s, h) + c.kch[static_cast<std::size_t>(h * c.rk + j)])];
      for (std::int32_t j = 0; j < c.rv; ++j)
        wv[static_cast<std::size_t>(packed.v_offset(dst, s, h) + j)] =
            c.fv[static_cast<std::size_t>(full.v_offset(src, s, h) + c.vch[static_cast<std::size_t>(h * c.rv + j)])];
    }
  }
  REQUIRE(test::bitwise_equal(c.pk, wk));
  REQUIRE(test::bitwise_equal(c.pv, wv));

  // Unpack into a second full-width pool (random contents) at other page ids.
  std::mt19937_64 rng(12345);
  for (bool with_fill : {false, true}) {
    std::vector<T> bk = test::random_vector<T>(c.fk.size(), rng), bv = test::random_vector<T>(c.fv.size(), rng);
    const std::vector<T> bk0 = bk, bv0 = bv;
    const std::vector<std::int32_t> back_pages = test::random_pages(c.n_pages, c.full_g.num_pages, rng);
    auto back = c.full_view(bk.data(), bv.data());
    REQUIRE(channel::unpack_channel_pages(ex, packed, back, c.kch.data(), c.vch.data(),
                                          with_fill ? c.kfill.data() : nullptr, with_fill ? c.vfill.data() : nullptr,
                                          c.packed_pages.data(), back_pages.data(), c.n_pages, c.n_tokens)
                .is_ok());
    std::vector<T> ek = bk0, ev = bv0;
    for (std::int32_t t = 0; t < c.n_tokens; ++t) {
      const std::int32_t orig = c.full_pages[static_cast<std::size_t>(t / c.page_size)];
      const std::int32_t dst = back_pages[static_cast<std::size_t>(t / c.page_size)], s = t % c.page_size;
      for (std::int32_t h = 0; h < c.heads; ++h) {
        for (std::int32_t d = 0; d < c.k_dim; ++d)
          ek[static_cast<std::size_t>(back.k_offset(dst, s, h) + d)] =
              from_float<T>(with_fill ? c.kfill[static_cast<std::size_t>(h * c.k_dim + d)] : 0.f);
        for (std::int32_t d = 0; d < c.v_dim; ++d)
          ev[static_cast<std::size_t>(back.v_offset(dst, s, h) + d)] =
              from_float<T>(with_fill ? c.vfill[static_cast<std::size_t>(h * c.v_dim + d)] : 0.f);
        for (std::int32_t j = 0; j < c.rk; ++j) {  // round trip: the original element
          const std::int32_t d = c.kch[static_cast<std::size_t>(h * c.rk + j)];
          ek[static_cast<std::size_t>(back.k_offset(dst, s, h) + d)] =
              c.fk[static_cast<std::size_t>(full.k_offset(orig, s, h) + d)];
        }
        for (std::int32_t j = 0; j < c.rv; ++j) {
          const std::int32_t d = c.vch[static_cast<std::size_t>(h * c.rv + j)];
          ev[static_cast<std::size_t>(back.v_offset(dst, s, h) + d)] =
              c.fv[static_cast<std::size_t>(full.v_offset(orig, s, h) + d)];
        }
      }
    }
    INFO("with_fill " << with_fill);
    REQUIRE(test::bitwise_equal(bk, ek));
    REQUIRE(test::bitwise_equal(bv, ev));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("pack_channel_pages / unpack_channel_pages: exact round trip on the selected dims",
                   "[kvchan][pack]", float, half_t, bfloat16_t) {
  KVKIT_TEST_RNG(rng);
  struct Shape {
    std::int32_t heads, k_dim, v_dim, rk, rv, page_size, n_tokens;
  };
  const Shape shapes[] = {
      {1, 8, 8, 1, 8, 4, 1},        {2, 64, 64, 16, 32, 16, 37},  {3, 64, 48, 64, 5, 8, 64},
      {4, 100, 100, 25, 50, 5, 23}, {2, 32, 32, 31, 1, 1, 7},     {2, 128, 128, 32, 128, 16, 48},
  };
  for (const Shape& s : shapes)
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      CAPTURE(s.heads, s.k_dim, s.v_dim, s.rk, s.rv, s.page_size, s.n_tokens, static_cast<int>(layout));
      const auto c = test::make_pack_case<TestType>(s.heads, s.k_dim, s.v_dim, s.rk, s.rv, s.page_size,
                                                    s.n_tokens, layout, rng);
      for (int threads : {1, 2, 3}) {  // pages split over workers: the same reference
        CAPTURE(threads);
        check_pack_unpack(c, exec::Host{threads});
      }
    }
}

TEMPLATE_TEST_CASE("pack_channel_pages / unpack_channel_pages: bitwise the same on 1, 2, 3 threads and a pool",
                   "[kvchan][pack][threads]", float, half_t, bfloat16_t) {
  KVKIT_TEST_RNG(rng);
  ThreadPool pool(3);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t n_tokens : {1, 5, 9, 47}) {  // 1 page (one worker), 2, 3 (one per worker), 12 (tail)
      CAPTURE(static_cast<int>(layout), n_tokens);
      const auto c = test::make_pack_case<TestType>(2, 32, 24, 7, 24, 4, n_tokens, layout, rng);
      // Packed and unpacked pools (K, V) of one run.
      struct Out {
        std::vector<TestType> pk, pv, bk, bv;
      };
      auto run = [&](exec::Host ex) {
        PackCase<TestType> x = c;
        auto full = x.full_view(x.fk.data(), x.fv.data());
        auto packed = x.packed_view(x.pk.data(), x.pv.data());
        REQUIRE(channel::pack_channel_pages(ex, full, packed, x.kch.data(), x.vch.data(), x.full_pages.data(),
                                            x.packed_pages.data(), x.n_pages, x.n_tokens)
                    .is_ok());
        Out o{x.pk, x.pv, x.fk, x.fv};
        std::reverse(o.bk.begin(), o.bk.end());  // other contents than the source pages
        std::reverse(o.bv.begin(), o.bv.end());
        auto back = x.full_view(o.bk.data(), o.bv.data());
        REQUIRE(channel::unpack_channel_pages(ex, packed, back, x.kch.data(), x.vch.data(), x.kfill.data(),
                                              x.vfill.data(), x.packed_pages.data(), x.full_pages.data(),
                                              x.n_pages, x.n_tokens)
                    .is_ok());
        return o;
      };
      const Out one = run(exec::Host{1});
      CHECK_FALSE(test::bitwise_equal(one.pk, c.pk));  // the call wrote something
      for (exec::Host ex : {exec::Host{2}, exec::Host{3}, exec::Host{3, pool.executor()}}) {
        CAPTURE(ex.threads, static_cast<bool>(ex.executor));
        const Out o = run(ex);
        CHECK(test::bitwise_equal(o.pk, one.pk));
        CHECK(test::bitwise_equal(o.pv, one.pv));
        CHECK(test::bitwise_equal(o.bk, one.bk));
        CHECK(test::bitwise_equal(o.bv, one.bv));
      }
    }
}

TEST_CASE("pack_channel_pages / unpack_channel_pages: bad input is rejected, nothing written",
          "[kvchan][pack][errors]") {
  KVKIT_TEST_RNG(rng);
  const exec::Host ex{1};
  auto c = test::make_pack_case<float>(2, 16, 16, 4, 8, 4, 10, KVLayout::kNHD, rng);
  const std::vector<float> pk0 = c.pk, pv0 = c.pv, fk0 = c.fk, fv0 = c.fv;
  auto full = c.full_view(c.fk.data(), c.fv.data());
  auto packed = c.packed_view(c.pk.data(), c.pv.data());
  auto pack = [&](const PackCase<float>& x) {
    return channel::pack_channel_pages(ex, full, packed, x.kch.data(), x.vch.data(), x.full_pages.data(),
                                       x.packed_pages.data(), x.n_pages, x.n_tokens);
  };
  auto unpack = [&](const PackCase<float>& x) {
    return channel::unpack_channel_pages(ex, packed, full, x.kch.data(), x.vch.data(), nullptr, nullptr,
                                         x.packed_pages.data(), x.full_pages.data(), x.n_pages, x.n_tokens);
  };
  auto expect = [&](const Status& s, const std::string& needle) {
    INFO(s.to_string());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.to_string().find(needle) != std::string::npos);
  };
  {
    auto x = c;
    x.full_pages[1] = c.full_g.num_pages;
    expect(pack(x), "source page id " + std::to_string(c.full_g.num_pages) + " at position 1 out of range");
    expect(unpack(x), "destination page id");
  }
  {
    auto x = c;
    x.packed_pages[2] = -1;
    expect(pack(x), "destination page id -1 at position 2 out of range");
    expect(unpack(x), "source page id -1");
  }
  {
    auto x = c;
    x.kch[5] = 16;  // head 1, channel 1
    expect(pack(x), "k_channels entry 16 of head 1 channel 1 out of range [0, 16)");
    expect(unpack(x), "k_channels entry 16 of head 1 channel 1 out of range [0, 16)");
  }
  {
    auto x = c;
    x.vch[3] = x.vch[2];  // head 0: a repeat is not ascending
    expect(pack(x), "v_channels entry " + std::to_string(x.vch[2]) + " of head 0 channel 3 is not above");
    expect(unpack(x), "strictly ascending");
  }
  {
    auto x = c;
    x.n_tokens = 13;  // needs 4 pages, 3 given
    expect(pack(x), "13 tokens fill 4 pages of 4, got n_pages 3");
  }
  {
    auto other = c.packed_view(c.pk.data(), c.pv.data());
    other.num_kv_heads = 1;
    CHECK(channel::pack_channel_pages(ex, full, other, c.kch.data(), c.vch.data(), c.full_pages.data(),
                                      c.packed_pages.data(), c.n_pages, c.n_tokens)
              .code() == StatusCode::kInvalidArgument);
    other = c.packed_view(c.pk.data(), c.pv.data());
    other.head_dim = 17;
    CHECK(channel::pack_channel_pages(ex, full, other, c.kch.data(), c.vch.data(), c.full_pages.data(),
                                      c.packed_pages.data(), c.n_pages, c.n_tokens)
              .code() == StatusCode::kInvalidArgument);
  }
  CHECK(test::bitwise_equal(c.pk, pk0));
  CHECK(test::bitwise_equal(c.pv, pv0));
  CHECK(test::bitwise_equal(c.fk, fk0));
  CHECK(test::bitwise_equal(c.fv, fv0));
  CHECK(channel::pack_channel_pages(ex, full, packed, c.kch.data(), c.vch.data(), nullptr, nullptr, 0, 0).is_ok());
}
