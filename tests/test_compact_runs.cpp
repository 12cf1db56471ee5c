// compact_tokens' in-place pass (heads moved together page by page, runs of consecutive
// kept tokens as one copy, in-place prefixes skipped, cached or non-temporal stores)
// against a per-row reference on random pools: every head with its own keep list, run
// shapes that stress run merging, page crossings and chunking of the heads.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

// A strictly ascending list of nk tokens of [0, len) in one of several shapes (nk < len
// unless noted; shapes that cannot hold nk tokens fall back to a random subset):
//   0: 0..nk-1, all in place (nothing moves; nk == len: everything kept)
//   1: every other token (runs of one, each moved by a different distance)
//   2: random runs of 1..2*ps tokens with gaps of 1..3 (runs crossing page boundaries,
//      destination and source pages changing inside a run)
//   3: the last nk tokens (everything moves; one run per source page)
//   4: R1KV's shape: len - nk random drops between 4 sinks and an 8-token window
//   5: a random subset
//   6: one dropped token at a random position (a long in-place prefix, then a shift by one)
std::vector<std::int32_t> shaped_keep(int shape, std::int32_t len, std::int32_t nk,
                                      std::int32_t ps, std::mt19937_64& rng) {
  std::vector<std::int32_t> kl;
  switch (shape) {
    case 0:
      for (std::int32_t t = 0; t < nk; ++t) kl.push_back(t);
      break;
    case 1:
      for (std::int32_t t = 0; t < len && static_cast<std::int32_t>(kl.size()) < nk; t += 2)
        kl.push_back(t);
      break;
    case 2: {
      std::uniform_int_distribution<std::int32_t> run(1, 2 * ps), gap(1, 3);
      for (std::int32_t t = gap(rng) - 1; t < len && static_cast<std::int32_t>(kl.size()) < nk;) {
        for (std::int32_t r = run(rng); r > 0 && t < len && static_cast<std::int32_t>(kl.size()) < nk; --r)
          kl.push_back(t++);
        t += gap(rng);
      }
      break;
    }
    case 3:
      for (std::int32_t t = len - nk; t < len; ++t) kl.push_back(t);
      break;
    case 4: {
      const std::int32_t lo = std::min(4, len), hi = std::max(lo, len - 8);
      if (hi - lo < len - nk) break;  // too short: falls back below
      std::vector<std::int32_t> mid(static_cast<std::size_t>(hi - lo));
      std::iota(mid.begin(), mid.end(), lo);
      std::shuffle(mid.begin(), mid.end(), rng);
      std::vector<char> dropped(static_cast<std::size_t>(len), 0);
      for (std::int32_t d = 0; d < len - nk; ++d) dropped[static_cast<std::size_t>(mid[static_cast<std::size_t>(d)])] = 1;
      for (std::int32_t t = 0; t < len; ++t)
        if (!dropped[static_cast<std::size_t>(t)]) kl.push_back(t);
      break;
    }
    case 6:
      if (nk == len - 1) {
        const std::int32_t drop = std::uniform_int_distribution<std::int32_t>(0, len - 1)(rng);
        for (std::int32_t t = 0; t < len; ++t)
          if (t != drop) kl.push_back(t);
      }
      break;
    default:
      break;
  }
  if (static_cast<std::int32_t>(kl.size()) != nk) {
    kl = random_distinct(nk, len, rng);
    std::sort(kl.begin(), kl.end());
  }
  return kl;
}

PoolSpec spec_of(KVLayout layout, std::int32_t heads, std::int32_t dim, std::int32_t ps,
                 std::vector<std::int32_t> lens) {
  PoolSpec s;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.page_size = ps;
  s.layout = layout;
  s.seq_lens = std::move(lens);
  return s;
}

// Fills keep lists (one per sequence and head, head h of sequence b of shape (b + h) % 7,
// one head of `shuffled_head` given a shuffled list for the staged path), compacts `pool`
// with `threads` workers and requires the whole pool to equal the per-row reference.
template <class T>
void check_compaction(RandomPool<T>& pool, const std::vector<std::int32_t>& num_keep,
                      std::int32_t shuffled_head, int threads, std::mt19937_64& rng) {
  const std::int32_t batch = pool.batch_size(), heads = pool.geometry.num_kv_heads;
  const std::int32_t dim = pool.geometry.head_dim, vdim = pool.geometry.v_dim();
  const std::int32_t ps = pool.geometry.page_size;
  std::int32_t stride = 1;
  for (std::int32_t len : pool.seq_lens) stride = std::max(stride, len);
  std::vector<std::int32_t> keep(static_cast<std::size_t>(batch) * heads * stride, -1);
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t len = pool.seq_lens[static_cast<std::size_t>(b)];
    const std::int32_t nk = num_keep[static_cast<std::size_t>(b)];
    for (std::int32_t h = 0; h < heads; ++h) {
      std::vector<std::int32_t> kl = shaped_keep((b + h) % 7, len, nk, ps, rng);
      if (h == shuffled_head && nk >= 2) std::reverse(kl.begin(), kl.end());
      std::copy(kl.begin(), kl.end(),
                keep.begin() + (static_cast<std::ptrdiff_t>(b) * heads + h) * stride);
    }
  }
  // Reference: row by row from the untouched pool (a row's dim elements are contiguous).
  std::vector<T> want_k = pool.k, want_v = pool.v;
  for (std::int32_t b = 0; b < batch; ++b)
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t i = 0; i < num_keep[static_cast<std::size_t>(b)]; ++i) {
        const std::int32_t src = keep[(static_cast<std::size_t>(b) * heads + h) * stride + i];
        std::copy_n(pool.k.begin() + static_cast<std::ptrdiff_t>(pool.token_index(b, src, h, 0)), dim,
                    want_k.begin() + static_cast<std::ptrdiff_t>(pool.token_index(b, i, h, 0)));
        std::copy_n(pool.v.begin() + static_cast<std::ptrdiff_t>(pool.v_token_index(b, src, h, 0)), vdim,
                    want_v.begin() + static_cast<std::ptrdiff_t>(pool.v_token_index(b, i, h, 0)));
      }
  const exec::Host ex{threads};
  std::vector<unsigned char> ws(compact_tokens_workspace_size(ex, pool.view, stride) + 1);
  REQUIRE(compact_tokens(ex, pool.view, keep.data(), num_keep.data(), stride,
                         Workspace{ws.data(), ws.size()})
              .is_ok());
  REQUIRE(bitwise_equal(pool.k, want_k));
  REQUIRE(bitwise_equal(pool.v, want_v));
}

}  // namespace

TEMPLATE_TEST_CASE("compact_tokens in place, cached stores: run shapes per head, page crossings, "
                   "head chunks",
                   "[cpu][compact]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t ps : {1, 5, 16, 64})
      // 40 heads: more than kCompactMaxHeads, so even one thread splits them into chunks.
      for (std::int32_t heads : {3, 8, 40})
        for (std::int32_t padding : {0, 4}) {
          const int threads = padding == 0 ? 1 : 3;
          {
            const std::int32_t dim = heads == 40 ? 8 : 64;
            CAPTURE(to_string(layout), ps, heads, padding, threads);
            PoolSpec spec = spec_of(layout, heads, dim, ps, {4 * ps + 3, 1, 2 * ps, 7 * ps + 1, 9});
            spec.row_padding = padding;
            if (padding != 0) spec.v_head_dim = dim + 16;  // K and V rows of different lengths
            RandomPool<T> pool(spec, rng);
            std::vector<std::int32_t> num_keep;
            for (std::size_t b = 0; b < pool.seq_lens.size(); ++b) {
              const std::int32_t len = pool.seq_lens[b];
              // all kept, one dropped, about half, a single token
              const std::int32_t choices[] = {len, std::max(1, len - 1), std::max(1, len / 2), 1};
              num_keep.push_back(choices[b % 4]);
            }
            check_compaction(pool, num_keep, /*shuffled_head=*/heads > 3 ? 1 : -1, threads, rng);
          }
        }
}

TEMPLATE_TEST_CASE("compact_tokens in place, non-temporal stores (a pass over more than "
                   "kCompactStreamBytes)",
                   "[cpu][compact]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  constexpr std::int32_t kHeads = 8, kDim = 128;  // 64-byte multiple rows: the streaming path
  const std::size_t token_bytes = 2 * sizeof(T) * kHeads * kDim;
  // Two sequences keeping 7/8 of their tokens move just over the threshold in total.
  const std::int32_t kept_tokens =
      static_cast<std::int32_t>(detail::cpu::kCompactStreamBytes / token_bytes) + 64;
  const std::int32_t len = kept_tokens / 2 * 8 / 7 + 8;
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    // one page size and thread count per layout keeps the 16+ MiB pools few
    const std::int32_t ps = layout == KVLayout::kNHD ? 16 : 64;
    const int threads = layout == KVLayout::kNHD ? 1 : 2;
    {
      CAPTURE(to_string(layout), ps, threads);
      RandomPool<T> pool(spec_of(layout, kHeads, kDim, ps, {len, len + ps / 2}), rng);
      // 16-byte aligned storage (operator new's), else compact_tokens would not stream
      REQUIRE(reinterpret_cast<std::uintptr_t>(pool.k.data()) % 16 == 0);
      REQUIRE(reinterpret_cast<std::uintptr_t>(pool.v.data()) % 16 == 0);
      std::vector<std::int32_t> num_keep = {len - len / 8, len + ps / 2 - (len + ps / 2) / 8};
      REQUIRE(static_cast<std::size_t>(num_keep[0] + num_keep[1]) * token_bytes >=
              detail::cpu::kCompactStreamBytes);
      check_compaction(pool, num_keep, /*shuffled_head=*/threads == 2 ? 5 : -1, threads, rng);
    }
  }
}
