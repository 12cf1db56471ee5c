// Views whose K and V differ in head dim and layout (packed ChannelSelector pages, engines
// that keep V head-major): the layout is a field of the view, and every data-movement
// kernel moves V rows of v_head_dim elements with V's own strides.
#include <catch2/catch.hpp>
#include <cstdint>
#include <random>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

struct DimCase {
  KVLayout k_layout;
  KVLayout v_layout;
  std::int32_t head_dim;
  std::int32_t v_head_dim;
};

const DimCase kCases[] = {
    {KVLayout::kNHD, KVLayout::kNHD, 16, 8},   {KVLayout::kHND, KVLayout::kHND, 8, 24},
    {KVLayout::kNHD, KVLayout::kHND, 12, 20},  {KVLayout::kHND, KVLayout::kNHD, 32, 4},
    {KVLayout::kHND, KVLayout::kNHD, 16, 16},
};

PoolSpec dims_spec(const DimCase& c, std::int32_t page_size, std::vector<std::int32_t> lens) {
  PoolSpec s;
  s.num_kv_heads = 3;
  s.head_dim = c.head_dim;
  s.v_head_dim = c.v_head_dim;
  s.layout = c.k_layout;
  s.v_layout = static_cast<int>(c.v_layout);
  s.page_size = page_size;
  s.seq_lens = std::move(lens);
  s.spare_pages = 4;
  return s;
}

}  // namespace

TEST_CASE("views carry K and V layouts and head dims explicitly", "[view][dims]") {
  const KVGeometry g{2, 16, 4, 8, 6};
  REQUIRE(g.v_dim() == 6);
  REQUIRE(KVGeometry{2, 16, 4, 8}.v_dim() == 16);
  const KVStrides ks = packed_strides(g, KVLayout::kNHD);
  const KVStrides vs = packed_v_strides(g, KVLayout::kHND);
  REQUIRE(vs.page == 4 * 2 * 6);
  REQUIRE(vs.token == 6);
  REQUIRE(vs.head == 4 * 6);
  std::vector<float> k(static_cast<std::size_t>(ks.page) * 8), v(static_cast<std::size_t>(vs.page) * 8);
  std::vector<std::int32_t> indptr{0}, last{};
  const auto view = make_csr_view(g, k.data(), ks, v.data(), vs,
                                  CsrPageTable{indptr.data(), nullptr, last.data(), 0});
  REQUIRE(view.k_layout == KVLayout::kNHD);
  REQUIRE(view.v_layout == KVLayout::kHND);
  REQUIRE(view.head_dim == 16);
  REQUIRE(view.v_head_dim == 6);
  REQUIRE(view.geometry().v_head_dim == 6);
  // V strides are checked against V's own rows: K-sized rows would overlap.
  const KVStrides too_narrow{4 * 2 * 4, 2 * 4, 4};
  REQUIRE_THROWS_WITH(make_csr_view(g, k.data(), ks, v.data(), too_narrow,
                                    CsrPageTable{indptr.data(), nullptr, last.data(), 0}),
                      Catch::Contains("V strides overlap") && Catch::Contains("head_dim=6"));
  REQUIRE_THROWS_WITH(packed_strides(KVGeometry{2, 16, 4, 8, -3}, KVLayout::kNHD),
                      Catch::Contains("v_head_dim must be >= 0") && Catch::Contains("-3"));
}

TEMPLATE_TEST_CASE("data-movement kernels move V rows of v_head_dim with V's layout",
                   "[cpu][dims]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (const DimCase& c : kCases)
    for (std::int32_t ps : {1, 4, 16}) {
      CAPTURE(to_string(c.k_layout), to_string(c.v_layout), c.head_dim, c.v_head_dim, ps);
      const PoolSpec spec = dims_spec(c, ps, {3 * ps + 1, 2 * ps, 5});
      RandomPool<T> pool(spec, rng);
      REQUIRE(pool.view.k_layout == c.k_layout);
      REQUIRE(pool.view.v_layout == c.v_layout);
      const std::int32_t hkv = spec.num_kv_heads, dk = c.head_dim, dv = c.v_head_dim;

      // write_kv: keys and values with their own token strides (padded by 1 and 3).
      {
        std::vector<T> want_k = pool.k, want_v = pool.v;
        const std::int64_t kts = hkv * dk + 1, vts = hkv * dv + 3;
        const auto key = random_vector<T>(static_cast<std::size_t>(kts) * 3, rng);
        const auto value = random_vector<T>(static_cast<std::size_t>(vts) * 3, rng);
        // Token 0 to the first slot of one free page, token 2 to the last of another.
        const std::int32_t p0 = pool.free_pages[0], p2 = pool.free_pages[3];
        const std::vector<std::int64_t> slots{static_cast<std::int64_t>(p0) * ps, -1,
                                              static_cast<std::int64_t>(p2) * ps + ps - 1};
        for (std::int32_t i : {0, 2})
          for (std::int32_t h = 0; h < hkv; ++h) {
            const std::int32_t slot = i == 0 ? 0 : ps - 1, p = i == 0 ? p0 : p2;
            for (std::int32_t d = 0; d < dk; ++d)
              want_k[pool.index(p, slot, h, d)] = key[static_cast<std::size_t>(i * kts + h * dk + d)];
            for (std::int32_t d = 0; d < dv; ++d)
              want_v[pool.v_index(p, slot, h, d)] =
                  value[static_cast<std::size_t>(i * vts + h * dv + d)];
          }
        REQUIRE(write_kv(exec::Host{2}, pool.view, key.data(), value.data(), slots.data(), 3, kts,
                         vts)
                    .is_ok());
        REQUIRE(bitwise_equal(pool.k, want_k));
        REQUIRE(bitwise_equal(pool.v, want_v));
        // A V token stride shorter than a V row is refused, naming it.
        const Status bad = write_kv(exec::Host{1}, pool.view, key.data(), value.data(),
                                    slots.data(), 3, kts, hkv * dv - 1);
        REQUIRE(bad.code() == StatusCode::kInvalidArgument);
        REQUIRE_THAT(bad.message(), Catch::Contains("v_token_stride " + std::to_string(hkv * dv - 1)));
      }

      // gather_tokens: V rows come out [Hkv, n, v_head_dim].
      {
        const std::vector<std::int32_t> ids{3 * ps, 0, 1, 2 * ps - 1};
        const std::int32_t n = static_cast<std::int32_t>(ids.size());
        std::vector<T> ko(static_cast<std::size_t>(hkv) * n * dk), vo(static_cast<std::size_t>(hkv) * n * dv);
        REQUIRE(gather_tokens(exec::Host{2}, pool.view, 0, ids.data(), n, ko.data(), vo.data())
                    .is_ok());
        for (std::int32_t h = 0; h < hkv; ++h)
          for (std::int32_t i = 0; i < n; ++i) {
            for (std::int32_t d = 0; d < dk; ++d)
              REQUIRE(same_bits(ko[static_cast<std::size_t>((h * n + i) * dk + d)],
                                pool.k[pool.token_index(0, ids[static_cast<std::size_t>(i)], h, d)]));
            for (std::int32_t d = 0; d < dv; ++d)
              REQUIRE(same_bits(vo[static_cast<std::size_t>((h * n + i) * dv + d)],
                                pool.v[pool.v_token_index(0, ids[static_cast<std::size_t>(i)], h, d)]));
          }
      }

      // compact_tokens: ascending for head 0, any order for the others.
      {
        const std::int32_t stride = 4;
        std::vector<std::int32_t> keep(static_cast<std::size_t>(pool.batch_size()) * hkv * stride, 0);
        std::vector<std::int32_t> num_keep(static_cast<std::size_t>(pool.batch_size()));
        for (std::int32_t b = 0; b < pool.batch_size(); ++b) {
          const std::int32_t len = spec.seq_lens[static_cast<std::size_t>(b)];
          const std::int32_t nk = std::min(stride, len);
          num_keep[static_cast<std::size_t>(b)] = nk;
          for (std::int32_t h = 0; h < hkv; ++h) {
            auto ids = random_distinct(nk, len, rng);
            if (h == 0) std::sort(ids.begin(), ids.end());
            std::copy(ids.begin(), ids.end(), keep.begin() + (b * hkv + h) * stride);
          }
        }
        std::vector<T> want_k = pool.k, want_v = pool.v;
        for (std::int32_t b = 0; b < pool.batch_size(); ++b)
          for (std::int32_t h = 0; h < hkv; ++h)
            for (std::int32_t i = 0; i < num_keep[static_cast<std::size_t>(b)]; ++i) {
              const std::int32_t src = keep[static_cast<std::size_t>((b * hkv + h) * stride + i)];
              for (std::int32_t d = 0; d < dk; ++d)
                want_k[pool.token_index(b, i, h, d)] = pool.k[pool.token_index(b, src, h, d)];
              for (std::int32_t d = 0; d < dv; ++d)
                want_v[pool.v_token_index(b, i, h, d)] = pool.v[pool.v_token_index(b, src, h, d)];
            }
        const exec::Host ex{2};
        std::vector<unsigned char> ws(compact_tokens_workspace_size(ex, pool.view, stride));
        REQUIRE(compact_tokens(ex, pool.view, keep.data(), num_keep.data(), stride,
                               Workspace{ws.data(), ws.size()})
                    .is_ok());
        REQUIRE(bitwise_equal(pool.k, want_k));
        REQUIRE(bitwise_equal(pool.v, want_v));
      }

      // copy_pages: whole V pages of V's size.
      {
        std::vector<T> want_k = pool.k, want_v = pool.v;
        const std::vector<std::int32_t> src{pool.pages[0][0], pool.pages[1][1]};
        const std::vector<std::int32_t> dst{pool.free_pages[1], pool.free_pages[2]};
        for (std::size_t i = 0; i < src.size(); ++i)
          for (std::int32_t t = 0; t < ps; ++t)
            for (std::int32_t h = 0; h < hkv; ++h) {
              for (std::int32_t d = 0; d < dk; ++d)
                want_k[pool.index(dst[i], t, h, d)] = pool.k[pool.index(src[i], t, h, d)];
              for (std::int32_t d = 0; d < dv; ++d)
                want_v[pool.v_index(dst[i], t, h, d)] = pool.v[pool.v_index(src[i], t, h, d)];
            }
        REQUIRE(copy_pages(exec::Host{2}, pool.view, src.data(), dst.data(), 2).is_ok());
        REQUIRE(bitwise_equal(pool.k, want_k));
        REQUIRE(bitwise_equal(pool.v, want_v));
      }
    }
}
