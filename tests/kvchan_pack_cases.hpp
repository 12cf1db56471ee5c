#pragma once
// Random cases of kvchan's page pack / unpack (channel/pack_pages.hpp), shared by the CPU
// test (test_kvchan_pack.cpp) and the CUDA parity test (cuda/test_kvchan_pack_cuda.cu):
// a full-width pool (NHD or HND, random values), a packed NHD pool pre-filled with random
// values (so untouched slots are detectable), random ascending channel sets per head,
// random fills, and random distinct page ids on both sides; and residual arrays
// (ResidualCase) for the residual tests.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "kvkit/channel/pack_pages.hpp"
#include "kvkit/channel/residual.hpp"
#include "reference.hpp"

namespace kvkit {
namespace test {

template <class T>
struct PackCase {
  std::int32_t heads = 0, k_dim = 0, v_dim = 0, rk = 0, rv = 0, page_size = 0, n_tokens = 0, n_pages = 0;
  KVLayout full_layout = KVLayout::kNHD;
  KVGeometry full_g, packed_g;
  std::vector<T> fk, fv;                           // full pool, [full_g.num_pages] pages
  std::vector<T> pk, pv;                           // packed pool, [packed_g.num_pages] pages
  std::vector<std::int32_t> kch, vch;              // [heads, rk], [heads, rv] ascending
  std::vector<float> kfill, vfill;                 // [heads, k_dim], [heads, v_dim]
  std::vector<std::int32_t> full_pages, packed_pages;  // [n_pages] distinct ids per pool

  PagedKVView<T> full_view(T* k, T* v, MemorySpace space = MemorySpace::kHost) const {
    static const std::int32_t kZero[1] = {0};
    return make_csr_view(full_g, k, packed_strides(full_g, full_layout), v, packed_v_strides(full_g, full_layout),
                         CsrPageTable{kZero, nullptr, nullptr, 0}, space);
  }
  PagedKVView<T> packed_view(T* k, T* v, MemorySpace space = MemorySpace::kHost) const {
    static const std::int32_t kZero[1] = {0};
    return make_csr_view(packed_g, k, packed_strides(packed_g, KVLayout::kNHD), v,
                         packed_v_strides(packed_g, KVLayout::kNHD), CsrPageTable{kZero, nullptr, nullptr, 0},
                         space);
  }
};

/// n distinct ids of [0, total), in random order.
inline std::vector<std::int32_t> random_pages(std::int32_t n, std::int32_t total, std::mt19937_64& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<std::size_t>(n));
  return ids;
}

/// heads random ascending sets of r dims of [0, d), one after the other.
inline std::vector<std::int32_t> random_sets(std::int32_t heads, std::int32_t d, std::int32_t r,
                                             std::mt19937_64& rng) {
  std::vector<std::int32_t> out;
  for (std::int32_t h = 0; h < heads; ++h) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(d));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<std::size_t>(r));
    std::sort(ids.begin(), ids.end());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

template <class T>
PackCase<T> make_pack_case(std::int32_t heads, std::int32_t k_dim, std::int32_t v_dim, std::int32_t rk,
                           std::int32_t rv, std::int32_t page_size, std::int32_t n_tokens, KVLayout layout,
                           std::mt19937_64& rng) {
  PackCase<T> c;
  c.heads = heads, c.k_dim = k_dim, c.v_dim = v_dim, c.rk = rk, c.rv = rv, c.page_size = page_size;
  c.n_tokens = n_tokens;
  c.n_pages = (n_tokens + page_size - 1) / page_size;
  c.full_layout = layout;
  c.full_g = KVGeometry{heads, k_dim, page_size, c.n_pages + 3, v_dim};
  c.packed_g = KVGeometry{heads, rk, page_size, c.n_pages + 2, rv};
  const auto elems = [](const KVGeometry& g, bool v) {
    return static_cast<std::size_t>(g.num_pages) * static_cast<std::size_t>(g.page_size) *
           static_cast<std::size_t>(g.num_kv_heads) * static_cast<std::size_t>(v ? g.v_dim() : g.head_dim);
  };
  c.fk = random_vector<T>(elems(c.full_g, false), rng);
  c.fv = random_vector<T>(elems(c.full_g, true), rng);
  c.pk = random_vector<T>(elems(c.packed_g, false), rng);
  c.pv = random_vector<T>(elems(c.packed_g, true), rng);
  c.kch = random_sets(heads, k_dim, rk, rng);
  c.vch = random_sets(heads, v_dim, rv, rng);
  c.kfill = random_vector<float>(static_cast<std::size_t>(heads) * k_dim, rng, -2.f, 2.f);
  c.vfill = random_vector<float>(static_cast<std::size_t>(heads) * v_dim, rng, -2.f, 2.f);
  c.full_pages = random_pages(c.n_pages, c.full_g.num_pages, rng);
  c.packed_pages = random_pages(c.n_pages, c.packed_g.num_pages, rng);
  return c;
}

/// Residual rows of one layer (channel/residual.hpp) as a pool lays them out, without
/// the packed rows: blocks of residual_block(0, ...), per page K records [page_size,
/// heads] then V records, a record its codes and then its scale. Host-owned, filled with
/// random codes and scales so rows a call must not touch stay detectable; `view` points
/// at them.
struct ResidualCase {
  std::vector<std::uint8_t> bytes;  // [pages, block.end] (+1)
  channel::ResidualBlock block;
  channel::ResidualView view;
  ResidualCase(std::int32_t bits, std::int32_t heads, std::int32_t page_size, std::int32_t pages,
               std::int32_t n_drop_k, std::int32_t n_drop_v, std::mt19937_64& rng) {
    block = channel::residual_block(0, bits, page_size, heads, n_drop_k, n_drop_v);
    const std::int64_t rows = static_cast<std::int64_t>(page_size) * heads;
    bytes.resize(static_cast<std::size_t>(pages * block.end) + 1);
    for (auto& x : bytes) x = static_cast<std::uint8_t>(rng());
    for (std::int64_t r = 0; r < pages * rows; ++r) {  // scales: finite random floats
      const std::vector<float> sc = random_vector<float>(2, rng);
      std::uint8_t* page = bytes.data() + r / rows * block.end;
      std::memcpy(page + block.k_records + r % rows * block.k_record + block.k_scale, &sc[0], 4);
      std::memcpy(page + block.v_records + r % rows * block.v_record + block.v_scale, &sc[1], 4);
    }
    view = block.view(bytes.data(), pages);
  }
};

/// The residual cases the CPU round trips (test_kvchan_residual.cpp) and the CUDA parity test
/// (cuda/test_kvchan_residual_cuda.cu) both run: f(case, bits) for 4 and 8 bits, NHD and HND
/// full pools, channel counts from 1 dim to the full width, 3 heads of 16 dims, pages of 4,
/// 1-40 tokens.
template <class T, class F>
void for_each_residual_parity_case(std::mt19937_64& rng, F&& f) {
  for (std::int32_t bits : {4, 8})
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
      for (auto rr : {std::pair<int, int>{1, 16}, {5, 11}, {16, 3}, {8, 8}}) {
        const std::int32_t n_tokens = std::uniform_int_distribution<std::int32_t>(1, 40)(rng);
        f(make_pack_case<T>(3, 16, 16, rr.first, rr.second, 4, n_tokens, layout, rng), bits);
      }
}

}  // namespace test
}  // namespace kvkit
