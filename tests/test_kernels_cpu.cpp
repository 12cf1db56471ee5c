// CPU kernels (kernels/cpu) against float64 / exact references on random pools.
#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

const char* table_name(PageTableKind k) { return k == PageTableKind::kCsr ? "csr" : "block"; }

// Ragged lengths: empty, exactly-full last pages, partial last pages, and one sequence
// longer than the attention tile.
std::vector<std::int32_t> ragged_lens(std::int32_t page_size, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> u(1, 4 * page_size);
  return {0, page_size, 3 * page_size, u(rng), 129 + u(rng) % 23, 1};
}

PoolSpec make_spec(KVLayout layout, PageTableKind table, std::int32_t heads, std::int32_t dim,
                   std::int32_t page_size, std::vector<std::int32_t> lens) {
  PoolSpec s;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.page_size = page_size;
  s.layout = layout;
  s.table = table;
  s.seq_lens = std::move(lens);
  return s;
}

std::vector<unsigned char> workspace_bytes(std::size_t n) {
  return std::vector<unsigned char>(n + 1);
}

/// Two pools with identical contents and page tables (one sub-seed drawn from rng), for
/// running one operation with different thread counts. Moving keeps their views valid.
template <class T>
std::pair<RandomPool<T>, RandomPool<T>> twin_pools(const PoolSpec& spec, std::mt19937_64& rng) {
  const std::uint64_t seed = rng();
  std::mt19937_64 ra(seed), rb(seed);
  return {RandomPool<T>(spec, ra), RandomPool<T>(spec, rb)};
}

/// Requires the whole K and V storage of `pool` (padding and unused pages included) to
/// equal the expected arrays bit for bit.
template <class T>
void require_pool_equals(const RandomPool<T>& pool, const std::vector<T>& want_k,
                         const std::vector<T>& want_v) {
  REQUIRE(bitwise_equal(pool.k, want_k));
  REQUIRE(bitwise_equal(pool.v, want_v));
}

}  // namespace

TEMPLATE_TEST_CASE("write_kv scatters rows by slot mapping and skips padding", "[cpu][write_kv]",
                   float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t ps : {1, 16})
      for (std::int32_t dim : {8, 64, 128})
        for (std::int32_t pad : {0, 3}) {
          CAPTURE(to_string(layout), ps, dim, pad);
          PoolSpec spec =
              make_spec(layout, PageTableKind::kBlockTable, 2, dim, ps, {ps + 3, 2 * ps});
          spec.row_padding = pad;
          auto [a, b] = twin_pools<T>(spec, rng);
          const std::int32_t num_slots = a.geometry.num_pages * ps;
          const std::int32_t n = std::min(20, num_slots);
          std::vector<std::int32_t> picks = random_distinct(n, num_slots, rng);
          std::vector<std::int64_t> slots(picks.begin(), picks.end());
          slots[0] = -1;  // padding tokens
          if (n > 3) slots[3] = -7;
          const std::int64_t stride = 2 * dim + 5;
          std::vector<T> key = random_vector<T>(static_cast<std::size_t>(n * stride), rng);
          std::vector<T> value = random_vector<T>(key.size(), rng);

          std::vector<T> want_k = a.k, want_v = a.v;
          for (std::int32_t i = 0; i < n; ++i) {
            if (slots[i] < 0) continue;
            const auto page = static_cast<std::int32_t>(slots[i] / ps),
                       off = static_cast<std::int32_t>(slots[i] % ps);
            for (std::int32_t h = 0; h < 2; ++h)
              for (std::int32_t d = 0; d < dim; ++d) {
                want_k[a.index(page, off, h, d)] = key[i * stride + h * dim + d];
                want_v[a.index(page, off, h, d)] = value[i * stride + h * dim + d];
              }
          }
          REQUIRE(write_kv(exec::Host{1}, a.view, key.data(), value.data(), slots.data(), n, stride)
                      .is_ok());
          require_pool_equals(a, want_k, want_v);
          REQUIRE(write_kv(exec::Host{3}, b.view, key.data(), value.data(), slots.data(), n, stride)
                      .is_ok());
          require_pool_equals(b, want_k, want_v);
        }
}

// paged_decode_attention: test_attention_cpu.cpp (every dtype, layout, table, GQA group,
// page size and width, ragged lengths, thread counts, with and without lse).

TEMPLATE_TEST_CASE("gather_tokens copies selected tokens head-major", "[cpu][gather]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (PageTableKind table : {PageTableKind::kCsr, PageTableKind::kBlockTable})
      for (std::int32_t ps : {1, 16})
        for (std::int32_t dim : {8, 64, 128}) {
          CAPTURE(to_string(layout), table_name(table), ps, dim);
          const std::int32_t hkv = 3;
          RandomPool<T> pool(make_spec(layout, table, hkv, dim, ps, ragged_lens(ps, rng)), rng);
          for (std::int32_t b = 0; b < pool.batch_size(); ++b) {
            const std::int32_t len = pool.seq_lens[static_cast<std::size_t>(b)];
            CAPTURE(b, len);
            for (bool explicit_ids : {true, false}) {
              const std::int32_t n = explicit_ids ? len + 3 : len;
              std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
              if (len > 0) {
                std::uniform_int_distribution<std::int32_t> u(0, len - 1);
                for (auto& t : ids) t = u(rng);  // duplicates and any order
              } else if (explicit_ids) {
                continue;  // no valid ids exist
              }
              const std::size_t sz = static_cast<std::size_t>(hkv) * n * dim;
              std::vector<T> k1 = random_vector<T>(sz + 1, rng), v1 = random_vector<T>(sz + 1, rng);
              std::vector<T> k3 = random_vector<T>(sz + 1, rng), v3 = random_vector<T>(sz + 1, rng);
              const T guard = k1[sz];
              const std::int32_t* idp = explicit_ids ? ids.data() : nullptr;
              REQUIRE(
                  gather_tokens(exec::Host{1}, pool.view, b, idp, n, k1.data(), v1.data()).is_ok());
              REQUIRE(
                  gather_tokens(exec::Host{3}, pool.view, b, idp, n, k3.data(), v3.data()).is_ok());
              for (std::int32_t h = 0; h < hkv; ++h)
                for (std::int32_t i = 0; i < n; ++i) {
                  const std::int32_t t = explicit_ids ? ids[static_cast<std::size_t>(i)] : i;
                  for (std::int32_t d = 0; d < dim; ++d) {
                    const std::size_t o = (static_cast<std::size_t>(h) * n + i) * dim + d;
                    REQUIRE(same_bits(k1[o], pool.k[pool.token_index(b, t, h, d)]));
                    REQUIRE(same_bits(v1[o], pool.v[pool.token_index(b, t, h, d)]));
                  }
                }
              REQUIRE(same_bits(k1[sz], guard));  // nothing written past the output
              k1.pop_back();
              v1.pop_back();
              k3.pop_back();
              v3.pop_back();
              REQUIRE(bitwise_equal(k1, k3));
              REQUIRE(bitwise_equal(v1, v3));
            }
          }
        }
}

namespace {

enum class KeepMode { kAscending, kArbitrary, kMixed };

// keep[b][h][i] lists plus num_keep[b]; num_keep covers 0, full length and in between.
struct KeepLists {
  std::vector<std::int32_t> keep, num_keep;
  std::int32_t stride = 0;
};

template <class T>
KeepLists random_keeps(const RandomPool<T>& pool, KeepMode mode, std::mt19937_64& rng) {
  KeepLists k;
  const std::int32_t batch = pool.batch_size(), hkv = pool.geometry.num_kv_heads;
  for (std::int32_t len : pool.seq_lens) k.stride = std::max(k.stride, len);
  k.stride += 2;
  k.keep.assign(static_cast<std::size_t>(batch) * hkv * k.stride, -1);
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t len = pool.seq_lens[static_cast<std::size_t>(b)];
    std::int32_t nk = len == 0 ? 0 : std::uniform_int_distribution<std::int32_t>(1, len)(rng);
    if (b == 2) nk = len;  // keep everything
    if (b == 5) nk = 0;    // keep nothing
    k.num_keep.push_back(nk);
    for (std::int32_t h = 0; h < hkv; ++h) {
      std::int32_t* kl = k.keep.data() + (static_cast<std::size_t>(b) * hkv + h) * k.stride;
      const bool ascending =
          mode == KeepMode::kAscending || (mode == KeepMode::kMixed && h % 2 == 0);
      if (ascending) {
        std::vector<std::int32_t> pick = random_distinct(nk, len, rng);
        std::sort(pick.begin(), pick.end());
        std::copy(pick.begin(), pick.end(), kl);
      } else if (nk > 0) {
        std::uniform_int_distribution<std::int32_t> u(0, len - 1);
        for (std::int32_t i = 0; i < nk; ++i) kl[i] = u(rng);  // duplicates, any order
        if (nk >= 2) {  // make sure the list is not ascending and repeats a source
          kl[0] = len - 1;
          kl[1] = len - 1;
        }
      }
    }
  }
  return k;
}

}  // namespace

TEMPLATE_TEST_CASE("compact_tokens keeps the listed tokens per head and nothing else moves",
                   "[cpu][compact]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (PageTableKind table : {PageTableKind::kCsr, PageTableKind::kBlockTable})
      for (std::int32_t ps : {1, 16})
        for (std::int32_t dim : {8, 64, 128})
          for (KeepMode mode : {KeepMode::kAscending, KeepMode::kArbitrary, KeepMode::kMixed}) {
            CAPTURE(to_string(layout), table_name(table), ps, dim, static_cast<int>(mode));
            const PoolSpec spec = make_spec(layout, table, 2, dim, ps, ragged_lens(ps, rng));
            auto [a, b] = twin_pools<T>(spec, rng);
            const KeepLists kl = random_keeps(a, mode, rng);
            std::vector<T> want_k = a.k, want_v = a.v;
            for (std::int32_t s = 0; s < a.batch_size(); ++s)
              for (std::int32_t h = 0; h < 2; ++h)
                for (std::int32_t i = 0; i < kl.num_keep[static_cast<std::size_t>(s)]; ++i) {
                  const std::int32_t src =
                      kl.keep[(static_cast<std::size_t>(s) * 2 + h) * kl.stride + i];
                  for (std::int32_t d = 0; d < dim; ++d) {
                    want_k[a.token_index(s, i, h, d)] = a.k[a.token_index(s, src, h, d)];
                    want_v[a.token_index(s, i, h, d)] = a.v[a.token_index(s, src, h, d)];
                  }
                }
            for (int threads : {1, 3}) {
              RandomPool<T>& pool = threads == 1 ? a : b;
              const exec::Host ex{threads};
              std::vector<unsigned char> ws =
                  workspace_bytes(compact_tokens_workspace_size(ex, pool.view, kl.stride));
              REQUIRE(compact_tokens(ex, pool.view, kl.keep.data(), kl.num_keep.data(), kl.stride,
                                     Workspace{ws.data(), ws.size()})
                          .is_ok());
              // whole pools: kept prefixes moved, everything else (tails, other pages,
              // padding) bit-identical
              require_pool_equals(pool, want_k, want_v);
            }
          }
}

namespace {

// Ascending keep lists shaped to hit every branch of compact_tokens' in-place pass:
// everything kept (nothing moves), one token dropped (a long in-place prefix, then runs
// shifted by one), every other token (runs of 1), random runs crossing page boundaries,
// the last nk tokens (every row moves, sources and destinations in different pages), and
// a random subset.
std::vector<std::int32_t> patterned_keep(int pattern, std::int32_t len, std::mt19937_64& rng) {
  std::vector<std::int32_t> kl;
  switch (pattern) {
    case 0:
      for (std::int32_t t = 0; t < len; ++t) kl.push_back(t);
      break;
    case 1: {
      const std::int32_t drop = len / 2;
      for (std::int32_t t = 0; t < len; ++t)
        if (t != drop || len == 1) kl.push_back(t);
      break;
    }
    case 2:
      for (std::int32_t t = 0; t < len; t += 2) kl.push_back(t);
      break;
    case 3: {
      std::uniform_int_distribution<std::int32_t> run(1, 40), gap(1, 5);
      for (std::int32_t t = gap(rng) - 1; t < len;) {
        for (std::int32_t r = run(rng); r > 0 && t < len; --r) kl.push_back(t++);
        t += gap(rng);
      }
      if (kl.empty()) kl.push_back(len - 1);
      break;
    }
    case 4:
      for (std::int32_t t = len / 3; t < len; ++t) kl.push_back(t);
      break;
    default: {
      std::uniform_int_distribution<std::int32_t> u(1, len);
      kl = random_distinct(u(rng), len, rng);
      std::sort(kl.begin(), kl.end());
    }
  }
  return kl;
}

}  // namespace

TEMPLATE_TEST_CASE("compact_tokens in place: runs, prefixes in place, page crossings, strides",
                   "[cpu][compact]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t ps : {1, 3, 16, 64})
      for (std::int32_t dim : {8, 32, 128})
        for (std::int32_t padding : {0, 8})
          for (std::int32_t heads : {1, 8}) {
            CAPTURE(to_string(layout), ps, dim, padding, heads);
            PoolSpec spec = make_spec(layout, PageTableKind::kCsr, heads, dim, ps,
                                      {5 * ps + 7, 1, 2 * ps, 300, 6 * ps});
            spec.row_padding = padding;
            auto [a, b] = twin_pools<T>(spec, rng);
            KeepLists kl;
            for (std::int32_t len : a.seq_lens) kl.stride = std::max(kl.stride, len);
            const std::int32_t batch = a.batch_size();
            kl.keep.assign(static_cast<std::size_t>(batch) * heads * kl.stride, -1);
            for (std::int32_t s = 0; s < batch; ++s) {
              const std::int32_t len = a.seq_lens[static_cast<std::size_t>(s)];
              // One num_keep per sequence: every head's list is cut (or padded with the
              // tail) to the same length.
              std::vector<std::vector<std::int32_t>> lists;
              std::size_t nk = static_cast<std::size_t>(len);
              for (std::int32_t h = 0; h < heads; ++h) {
                lists.push_back(patterned_keep((s + h) % 6, len, rng));
                nk = std::min(nk, lists.back().size());
              }
              kl.num_keep.push_back(static_cast<std::int32_t>(nk));
              for (std::int32_t h = 0; h < heads; ++h)
                std::copy(lists[static_cast<std::size_t>(h)].begin(),
                          lists[static_cast<std::size_t>(h)].begin() + static_cast<std::ptrdiff_t>(nk),
                          kl.keep.begin() + (static_cast<std::ptrdiff_t>(s) * heads + h) * kl.stride);
            }
            std::vector<T> want_k = a.k, want_v = a.v;
            for (std::int32_t s = 0; s < batch; ++s)
              for (std::int32_t h = 0; h < heads; ++h)
                for (std::int32_t i = 0; i < kl.num_keep[static_cast<std::size_t>(s)]; ++i) {
                  const std::int32_t src =
                      kl.keep[(static_cast<std::size_t>(s) * heads + h) * kl.stride + i];
                  for (std::int32_t d = 0; d < dim; ++d) {
                    want_k[a.token_index(s, i, h, d)] = a.k[a.token_index(s, src, h, d)];
                    want_v[a.token_index(s, i, h, d)] = a.v[a.token_index(s, src, h, d)];
                  }
                }
            for (int threads : {1, 2}) {
              RandomPool<T>& pool = threads == 1 ? a : b;
              const exec::Host ex{threads};
              std::vector<unsigned char> ws =
                  workspace_bytes(compact_tokens_workspace_size(ex, pool.view, kl.stride));
              REQUIRE(compact_tokens(ex, pool.view, kl.keep.data(), kl.num_keep.data(), kl.stride,
                                     Workspace{ws.data(), ws.size()})
                          .is_ok());
              require_pool_equals(pool, want_k, want_v);
            }
          }
}

TEMPLATE_TEST_CASE("copy_pages copies whole pages and nothing else", "[cpu][copy_pages]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t ps : {1, 16})
      for (std::int32_t row_pad : {0, 2})
        for (std::int32_t page_pad : {0, 5}) {
          CAPTURE(to_string(layout), ps, row_pad, page_pad);
          PoolSpec spec = make_spec(layout, PageTableKind::kCsr, 3, 8, ps, {3 * ps, ps + 1});
          spec.spare_pages = 4;
          spec.row_padding = row_pad;
          spec.page_padding = page_pad;
          auto [a, b] = twin_pools<T>(spec, rng);
          // sources from used pages (page 0 of seq 0 twice: a copy-on-write fork), dsts free
          std::vector<std::int32_t> src{a.pages[0][0], a.pages[0][0], a.pages[1][1], a.pages[0][2]};
          std::vector<std::int32_t> dst(a.free_pages.begin(), a.free_pages.begin() + 4);
          std::vector<T> want_k = a.k, want_v = a.v;
          for (std::size_t i = 0; i < src.size(); ++i)
            for (std::int32_t t = 0; t < ps; ++t)
              for (std::int32_t h = 0; h < 3; ++h)
                for (std::int32_t d = 0; d < 8; ++d) {
                  want_k[a.index(dst[i], t, h, d)] = a.k[a.index(src[i], t, h, d)];
                  want_v[a.index(dst[i], t, h, d)] = a.v[a.index(src[i], t, h, d)];
                }
          REQUIRE(copy_pages(exec::Host{1}, a.view, src.data(), dst.data(), 4).is_ok());
          REQUIRE(copy_pages(exec::Host{3}, b.view, src.data(), dst.data(), 4).is_ok());
          require_pool_equals(a, want_k, want_v);
          require_pool_equals(b, want_k, want_v);
        }
}

TEST_CASE("CPU kernels reject bad input with the bad value and change nothing", "[cpu][errors]") {
  KVKIT_TEST_RNG(rng);
  for (PageTableKind table : {PageTableKind::kCsr, PageTableKind::kBlockTable}) {
    CAPTURE(table_name(table));
    RandomPool<float> pool(make_spec(KVLayout::kNHD, table, 2, 8, 4, {5, 8, 0}), rng);
    const std::vector<float> k0 = pool.k, v0 = pool.v;
    auto unchanged = [&] { return bitwise_equal(pool.k, k0) && bitwise_equal(pool.v, v0); };
    const exec::Host ex{2};
    std::vector<float> q = random_vector<float>(3 * 4 * 8, rng), out(q.size());
    const DecodeAttentionParams p{4, 0.35f};
    std::vector<unsigned char> ws(1 << 16);
    const Workspace w{ws.data(), ws.size()};
    std::vector<float> key = random_vector<float>(2 * 16, rng);
    std::vector<std::int64_t> slots{3, 0};
    std::vector<std::int32_t> keep(3 * 2 * 8, 0), num_keep{2, 3, 0};
    std::vector<float> gk(2 * 4 * 8), gv(gk.size());

    SECTION("wrong memory space") {
      PagedKVView<float> dev = pool.view;
      dev.space = MemorySpace::kCuda;
      const Status s[] = {write_kv(ex, dev, key.data(), key.data(), slots.data(), 2, 16),
                          paged_decode_attention(ex, dev, q.data(), out.data(), p, w),
                          gather_tokens(ex, dev, 0, nullptr, 2, gk.data(), gv.data()),
                          compact_tokens(ex, dev, keep.data(), num_keep.data(), 8, w),
                          copy_pages(ex, dev, pool.indices.data(), pool.free_pages.data(), 1)};
      for (const Status& st : s) {
        REQUIRE(st.code() == StatusCode::kWrongMemorySpace);
        REQUIRE_THAT(st.message(), Catch::Contains("cuda"));
      }
      REQUIRE(unchanged());
    }
    SECTION("slot out of range") {
      const std::int64_t bad = static_cast<std::int64_t>(pool.geometry.num_pages) * 4;
      slots[1] = bad;
      const Status st = write_kv(ex, pool.view, key.data(), key.data(), slots.data(), 2, 16);
      REQUIRE(st.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st.message(), Catch::Contains("slot " + std::to_string(bad)));
      REQUIRE(unchanged());  // token 0 (valid) was not written either
      const Status st2 = write_kv(ex, pool.view, key.data(), key.data(), slots.data(), 2, 15);
      REQUIRE(st2.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st2.message(), Catch::Contains("token_stride 15"));
    }
    SECTION("page id out of range in the page table") {
      if (table == PageTableKind::kCsr)
        pool.indices[1] = 999;
      else
        pool.block_table[1] = 999;
      const Status st = paged_decode_attention(ex, pool.view, q.data(), out.data(), p, w);
      REQUIRE(st.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st.message(), Catch::Contains("page id 999"));
      const Status st2 = gather_tokens(ex, pool.view, 0, nullptr, 5, gk.data(), gv.data());
      REQUIRE(st2.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st2.message(), Catch::Contains("page id 999"));
      const Status st3 = compact_tokens(ex, pool.view, keep.data(), num_keep.data(), 8, w);
      REQUIRE(st3.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st3.message(), Catch::Contains("page id 999"));
      REQUIRE(unchanged());
    }
    SECTION("num_qo_heads not a multiple of num_kv_heads") {
      const Status st = paged_decode_attention(ex, pool.view, q.data(), out.data(),
                                               DecodeAttentionParams{3, 0.35f}, w);
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains("num_qo_heads 3"));
    }
    SECTION("keep index out of range leaves the pool unchanged") {
      // sequence 1 (8 tokens) head 1: a valid descending list whose last entry is bad,
      // so a kernel that moved rows before validating everything would be caught
      std::int32_t* kl = keep.data() + (1 * 2 + 1) * 8;
      kl[0] = 7;
      kl[1] = 2;
      kl[2] = 8;
      const Status st = compact_tokens(ex, pool.view, keep.data(), num_keep.data(), 8, w);
      REQUIRE(st.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st.message(), Catch::Contains("keep index 8") && Catch::Contains("sequence 1") &&
                                     Catch::Contains("head 1"));
      REQUIRE(unchanged());
      kl[2] = 1;
      num_keep[0] = 6;  // sequence 0 holds 5 tokens
      const Status st2 = compact_tokens(ex, pool.view, keep.data(), num_keep.data(), 8, w);
      REQUIRE(st2.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st2.message(), Catch::Contains("num_keep 6"));
      REQUIRE(unchanged());
    }
    SECTION("too-small workspace") {
      const std::size_t need = compact_tokens_workspace_size(ex, pool.view, 8);
      REQUIRE(need > 0);
      const Status st = compact_tokens(ex, pool.view, keep.data(), num_keep.data(), 8,
                                       Workspace{ws.data(), need - 1});
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains(std::to_string(need - 1)));
      REQUIRE(unchanged());
      const std::size_t need_a = paged_decode_attention_workspace_size(ex, pool.view, p);
      REQUIRE(need_a > 0);
      const Status st2 = paged_decode_attention(ex, pool.view, q.data(), out.data(), p,
                                                Workspace{ws.data(), need_a - 1});
      REQUIRE(st2.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st2.message(), Catch::Contains(std::to_string(need_a)));
    }
    SECTION("copy_pages id checks") {
      const std::int32_t free0 = pool.free_pages[0], free1 = pool.free_pages[1];
      std::vector<std::int32_t> src{pool.pages[0][0], pool.pages[1][0]}, dst{free0, free0};
      Status st = copy_pages(ex, pool.view, src.data(), dst.data(), 2);
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains("destination page id " + std::to_string(free0)) &&
                                     Catch::Contains("repeated"));
      dst = {free0, pool.pages[0][0]};
      st = copy_pages(ex, pool.view, src.data(), dst.data(), 2);
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains("also a source"));
      dst = {free0, pool.geometry.num_pages};
      st = copy_pages(ex, pool.view, src.data(), dst.data(), 2);
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(),
                   Catch::Contains("page id " + std::to_string(pool.geometry.num_pages)));
      src[0] = -4;
      dst = {free0, free1};
      st = copy_pages(ex, pool.view, src.data(), dst.data(), 2);
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains("page id -4"));
      REQUIRE(copy_pages(ex, pool.view, src.data(), dst.data(), -1).code() ==
              StatusCode::kInvalidArgument);
      REQUIRE(unchanged());
    }
    SECTION("gather_tokens bad sequence and token ids") {
      std::vector<std::int32_t> ids{1, 5};
      Status st = gather_tokens(ex, pool.view, 0, ids.data(), 2, gk.data(), gv.data());
      REQUIRE(st.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st.message(), Catch::Contains("token id 5"));
      st = gather_tokens(ex, pool.view, 3, nullptr, 1, gk.data(), gv.data());
      REQUIRE(st.code() == StatusCode::kOutOfRange);
      REQUIRE_THAT(st.message(), Catch::Contains("sequence 3"));
      st = gather_tokens(ex, pool.view, 2, nullptr, 1, gk.data(), gv.data());
      REQUIRE(st.code() == StatusCode::kOutOfRange);  // sequence 2 is empty
      REQUIRE_THAT(st.message(), Catch::Contains("n 1 exceeds seq_len 0"));
      st = gather_tokens(ex, pool.view, 0, nullptr, -2, gk.data(), gv.data());
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains("-2"));
    }
  }
}

TEST_CASE("CPU kernels refuse page tables whose sizes overflow int32", "[cpu][errors]") {
  const exec::Host ex{2};
  std::vector<float> k(16), v(16);  // never read: the tables are refused first
  std::vector<float> q(4, 0.5f), out(4), gk(4), gv(4);
  std::vector<unsigned char> ws(1 << 12);
  const Workspace w{ws.data(), ws.size()};
  const DecodeAttentionParams p{1, 1.f};
  std::vector<std::int32_t> ids{100};
  auto expect = [](const Status& st, const std::string& value) {
    INFO(st.to_string());
    REQUIRE(st.code() == StatusCode::kOutOfRange);
    REQUIRE_THAT(st.message(), Catch::Contains(value));
  };

  // Block table: INT32_MAX tokens on rows of 4 pages. A wrapped page count used to pass
  // the row check, and token 100 was then read from past the row.
  const KVGeometry g{1, 1, 16, 4};
  const KVStrides s = packed_strides(g, KVLayout::kNHD);
  std::vector<std::int32_t> table{0, 1, 2, 3}, lens{std::numeric_limits<std::int32_t>::max()};
  const auto dense = make_block_table_view(g, k.data(), s, v.data(), s,
                                           BlockTable{table.data(), 4, lens.data(), 1});
  expect(gather_tokens(ex, dense, 0, ids.data(), 1, gk.data(), gv.data()), "needs 134217728 pages");
  expect(paged_decode_attention(ex, dense, q.data(), out.data(), p, w), "needs 134217728 pages");

  // CSR: 3 pages of 2^30 tokens. seq_len() used to wrap negative, and attention returned ok
  // with an empty-sequence result.
  const KVGeometry big{1, 1, 1 << 30, 4};
  const KVStrides bs = packed_strides(big, KVLayout::kNHD);
  std::vector<std::int32_t> indptr{0, 3, 3}, indices{0, 1, 2}, last{1 << 30, 1};
  const auto csr = make_csr_view(big, k.data(), bs, v.data(), bs,
                                 CsrPageTable{indptr.data(), indices.data(), last.data(), 2});
  expect(paged_decode_attention(ex, csr, q.data(), out.data(), p, w), "holds 3221225472 tokens");
  expect(gather_tokens(ex, csr, 0, ids.data(), 1, gk.data(), gv.data()), "holds 3221225472 tokens");
  std::vector<std::int32_t> keep(4, 0), num_keep{1, 0};
  expect(compact_tokens(ex, csr, keep.data(), num_keep.data(), 2, w), "holds 3221225472 tokens");

  // CSR indptr whose difference overflows (2147483647 - (-1)): named, never subtracted.
  indptr = {0, -1, std::numeric_limits<std::int32_t>::max()};
  expect(gather_tokens(ex, csr, 1, ids.data(), 1, gk.data(), gv.data()), "-1 -> 2147483647");
}

TEST_CASE("parallel_for covers every item exactly once", "[cpu][parallel]") {
  for (int threads : {0, 1, 2, 3, 7, 100}) {
    for (std::int64_t n : {0, 1, 2, 5, 64, 1000}) {
      CAPTURE(threads, n);
      std::vector<int> hits(static_cast<std::size_t>(n), 0);
      std::vector<int> worker_of(static_cast<std::size_t>(n), -1);
      detail::parallel_for(exec::Host{threads}, n, [&](std::int64_t b, std::int64_t e, int w) {
        for (std::int64_t i = b; i < e; ++i) {
          ++hits[static_cast<std::size_t>(i)];
          worker_of[static_cast<std::size_t>(i)] = w;
        }
      });
      for (int h : hits) REQUIRE(h == 1);
      for (int w : worker_of) REQUIRE((w >= 0 && w < detail::host_workers(exec::Host{threads}, n)));
    }
  }
}
