// kvchan's low-precision residual (include/kvkit/channel/residual.hpp) on the CPU, on fresh
// random pools (float / half / bfloat16, NHD or HND full-width side, 4 and 8 bits, sets
// from 1 dim to the full width): packing writes the documented codes and scale of every
// dropped dim; unpacking gives the selected dims back exactly and each dropped dim as
// s * code, within s / 2 of the original; residual attention (through channel_attention,
// merged with a full-width window) equals a float64 dense attention over the rows as they
// read back; bad bits, geometry and unsupported head dims are rejected naming the value.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvchan_pack_cases.hpp"
#include "kvkit/channel/kvchan.hpp"
#include "kvkit/channel/packed_store.hpp"
#include "kvkit/channel/residual.hpp"
#include "reference.hpp"

using namespace kvkit;
using kvkit::test::PackCase;

namespace {

// Reference of one dropped dim's code and scale, from the file comment's formulas.
template <class T>
void reference_row(const T* x, const std::vector<std::int32_t>& drop, std::int32_t bits, std::vector<std::int32_t>& code,
                   float& s) {
  float amax = 0.f;
  for (std::int32_t d : drop) amax = std::max(amax, std::fabs(to_float(x[d])));
  const std::int32_t qmax = (1 << (bits - 1)) - 1;
  s = amax / static_cast<float>(qmax);
  code.assign(drop.size(), 0);
  if (s == 0.f) return;
  for (std::size_t j = 0; j < drop.size(); ++j)
    code[j] = static_cast<std::int32_t>(std::clamp(std::nearbyint(to_float(x[drop[j]]) / s), -float(qmax), float(qmax)));
}

std::vector<std::int32_t> complement(const std::int32_t* set, std::int32_t r, std::int32_t dim) {
  std::vector<std::int32_t> out;
  for (std::int32_t d = 0; d < dim; ++d)
    if (!std::binary_search(set, set + r, d)) out.push_back(d);
  return out;
}

template <class T>
void check_residual_round_trip(const PackCase<T>& c0, std::int32_t bits, exec::Host ex, std::mt19937_64& rng) {
  PackCase<T> c = c0;
  auto full = c.full_view(c.fk.data(), c.fv.data());
  auto packed = c.packed_view(c.pk.data(), c.pv.data());
  test::ResidualCase ra(bits, c.heads, c.page_size, c.packed_g.num_pages, c.k_dim - c.rk, c.v_dim - c.rv, rng);
  const std::vector<std::uint8_t> bytes0 = ra.bytes;
  // The documented block: K records from 0, then V records; a record its codes, then the
  // scale at the next multiple of 4.
  const std::int64_t kb = ra.view.k_bytes, rows = static_cast<std::int64_t>(c.page_size) * c.heads;
  CHECK(ra.block.k_records == 0);
  CHECK(ra.block.k_scale == (kb + 3) / 4 * 4);
  CHECK(ra.block.k_record == ra.block.k_scale + 4);
  CHECK(ra.block.v_scale == (ra.view.v_bytes + 3) / 4 * 4);
  CHECK(ra.block.v_records == rows * ra.block.k_record);
  CHECK(ra.block.end == ra.block.v_records + rows * ra.block.v_record);
  // After a 6-byte lead (1 slot x 1 head x 3 halves), 5 code bytes at 8 bits: K records
  // from 8, the scale at 8 of 12 bytes, a V record (no codes) its scale alone.
  const channel::ResidualBlock led = channel::residual_block(6, 8, 1, 1, 5, 0);
  CHECK(led.k_records == 8);
  CHECK(led.k_scale == 8);
  CHECK(led.k_record == 12);
  CHECK(led.v_records == 20);
  CHECK(led.end == 24);
  REQUIRE(channel::pack_channel_pages(ex, full, packed, c.kch.data(), c.vch.data(), c.full_pages.data(),
                                      c.packed_pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  REQUIRE(channel::pack_residual_pages(ex, full, ra.view, c.kch.data(), c.vch.data(), c.rk, c.rv, c.full_pages.data(),
                                       c.packed_pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  // Codes and scales as documented (read through the documented byte layout).
  std::vector<std::int32_t> code;
  float s = 0.f;
  std::size_t checked_dims = 0;
  for (std::int32_t t = 0; t < c.n_tokens; ++t) {
    const std::int32_t src = c.full_pages[static_cast<std::size_t>(t / c.page_size)];
    const std::int32_t dst = c.packed_pages[static_cast<std::size_t>(t / c.page_size)], slot = t % c.page_size;
    for (std::int32_t h = 0; h < c.heads; ++h)
      for (int which = 0; which < 2; ++which) {
        const bool k = which == 0;
        const std::int32_t r = k ? c.rk : c.rv, dim = k ? c.k_dim : c.v_dim;
        const std::vector<std::int32_t> drop = complement((k ? c.kch : c.vch).data() + h * r, r, dim);
        const T* x = k ? c.fk.data() + full.k_offset(src, slot, h) : c.fv.data() + full.v_offset(src, slot, h);
        reference_row(x, drop, bits, code, s);
        // The documented layout: page dst's K (or V) records, record slot * heads + h.
        const std::int64_t row = static_cast<std::int64_t>(slot) * c.heads + h;
        const std::uint8_t* rec = ra.bytes.data() + dst * ra.view.page_stride +
                                  (k ? ra.block.k_records + row * ra.block.k_record
                                     : ra.block.v_records + row * ra.block.v_record);
        float s_got = 0.f;
        std::memcpy(&s_got, rec + (k ? ra.block.k_scale : ra.block.v_scale), 4);
        CHECK(s_got == s);
        const std::uint8_t* bytes = rec;  // codes first in a record
        for (std::size_t j = 0; j < drop.size(); ++j) {
          std::int32_t got = bits == 8 ? static_cast<std::int8_t>(bytes[j])
                                       : (bytes[j / 2] >> ((j % 2) * 4)) & 0xF;
          if (bits == 4 && got >= 8) got -= 16;
          if (got != code[j]) FAIL("code of dim " << drop[j] << " head " << h << ": " << got << " != " << code[j]);
          // The bound the format promises, independent of the formula's details.
          // (float rounding of x / s and of s * code: a few ulps of qmax steps)
          if (std::fabs(to_float(x[drop[j]]) - s * static_cast<float>(got)) > s * (0.5f + 1e-4f))
            FAIL("dim " << drop[j] << " reads back " << s * got << " for " << to_float(x[drop[j]]) << ", scale " << s);
          ++checked_dims;
        }
      }
  }
  if (c.rk < c.k_dim) CHECK(checked_dims > 0);
  // Rows outside the written pages are untouched.
  for (std::int32_t p = 0; p < c.packed_g.num_pages; ++p) {
    if (std::find(c.packed_pages.begin(), c.packed_pages.end(), p) != c.packed_pages.end()) continue;
    const std::size_t a = static_cast<std::size_t>(p * ra.view.page_stride), b = a + ra.view.page_stride;
    CHECK(std::equal(ra.bytes.begin() + a, ra.bytes.begin() + b, bytes0.begin() + a));
  }
  // Unpack both parts into a fresh full-width pool at other page ids.
  std::vector<T> bk = test::random_vector<T>(c.fk.size(), rng), bv = test::random_vector<T>(c.fv.size(), rng);
  const std::vector<std::int32_t> back_pages = test::random_pages(c.n_pages, c.full_g.num_pages, rng);
  auto back = c.full_view(bk.data(), bv.data());
  REQUIRE(channel::unpack_channel_pages(ex, packed, back, c.kch.data(), c.vch.data(), nullptr, nullptr,
                                        c.packed_pages.data(), back_pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  REQUIRE(channel::unpack_residual_pages(ex, ra.view, back, c.kch.data(), c.vch.data(), c.rk, c.rv,
                                         c.packed_pages.data(), back_pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  for (std::int32_t t = 0; t < c.n_tokens; ++t) {
    const std::int32_t orig = c.full_pages[static_cast<std::size_t>(t / c.page_size)];
    const std::int32_t dst = back_pages[static_cast<std::size_t>(t / c.page_size)], slot = t % c.page_size;
    for (std::int32_t h = 0; h < c.heads; ++h)
      for (int which = 0; which < 2; ++which) {
        const bool k = which == 0;
        const std::int32_t r = k ? c.rk : c.rv, dim = k ? c.k_dim : c.v_dim;
        const std::int32_t* set = (k ? c.kch : c.vch).data() + h * r;
        const std::vector<std::int32_t> drop = complement(set, r, dim);
        const T* x = k ? c.fk.data() + full.k_offset(orig, slot, h) : c.fv.data() + full.v_offset(orig, slot, h);
        const T* y = k ? bk.data() + back.k_offset(dst, slot, h) : bv.data() + back.v_offset(dst, slot, h);
        reference_row(x, drop, bits, code, s);
        for (std::int32_t i = 0; i < r; ++i)  // selected dims: the original element, bit for bit
          if (!test::bitwise_equal(std::vector<T>{x[set[i]]}, std::vector<T>{y[set[i]]}))
            FAIL("selected dim " << set[i] << " not exact");
        for (std::size_t j = 0; j < drop.size(); ++j)
          if (to_float(y[drop[j]]) != to_float(from_float<T>(s * static_cast<float>(code[j]))))
            FAIL("dropped dim " << drop[j] << " unpacked " << to_float(y[drop[j]]) << ", expected s*code "
                                << s * static_cast<float>(code[j]));
      }
  }
}

template <class T>
void residual_round_trips(std::mt19937_64& rng) {
  const exec::Host ex{2};
  test::for_each_residual_parity_case<T>(rng, [&](const PackCase<T>& c, std::int32_t bits) {
    INFO("bits " << bits << " rk " << c.rk << " rv " << c.rv << " tokens " << c.n_tokens);
    check_residual_round_trip(c, bits, ex, rng);
  });
}

// A pool with old tokens (packed + residual) for B sequences and a full-width window;
// channel_attention against float64 dense attention over the rows as they read back.
template <class T>
// D, G and the old lengths choose which of the kernel's paths run: long rows give whole
// vector chunks of exact dims and of codes (D 64: up to 3 chunks of 16 codes) besides the
// tails, old parts past one tile of 32 tokens and off a multiple of the token step, and
// groups of 5 and 6 a block of 4 queries plus a remainder.
void check_residual_attention(std::int32_t bits, std::int32_t rk, std::int32_t rv, std::mt19937_64& rng,
                              std::int32_t D = 16, std::int32_t G = 3, bool long_old = false) {
  const std::int32_t B = 3, Hkv = 2, Hq = Hkv * G, P = 4;
  const std::int32_t old_len[B] = {long_old ? 77 : 13, 0, long_old ? 40 : 8}, win_len[B] = {5, 7, 1};
  const std::vector<std::int32_t> ksel = test::random_sets(Hkv, D, rk, rng), vsel = test::random_sets(Hkv, D, rv, rng);
  channel::PackedPagePool<T> pool(1, Hkv, rk, rv, P, bits, D, D);
  // Full-width staging pool for every token, then packed into the pool.
  const std::int32_t max_n = 84;
  KVGeometry fg{Hkv, D, P, B * max_n / P, D};
  std::vector<T> fk = test::random_vector<T>(static_cast<std::size_t>(fg.num_pages) * P * Hkv * D, rng, -2.f, 2.f);
  std::vector<T> fv = test::random_vector<T>(fk.size(), rng, -2.f, 2.f);
  const KVStrides fs = packed_strides(fg, KVLayout::kNHD);
  static const std::int32_t kZero[1] = {0};
  const PagedKVView<T> full_store = make_csr_view(fg, fk.data(), fs, fv.data(), fs, CsrPageTable{kZero, nullptr, nullptr, 0});
  std::vector<std::int32_t> o_indptr{0}, o_indices, o_last, w_indptr{0}, w_indices, w_last;
  std::int32_t next_full = 0;
  std::vector<std::vector<std::int32_t>> full_pages(B);  // every token's staging page, per sequence
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int32_t n = old_len[b] + win_len[b];
    for (std::int32_t p = 0; p * P < n; ++p) full_pages[b].push_back(next_full++);
    // Old part: pages of the staging pool packed into pool pages (old_len is page aligned or the tail).
    std::vector<std::int32_t> src, dst;
    for (std::int32_t p = 0; p * P < old_len[b]; ++p) {
      src.push_back(full_pages[b][p]);
      dst.push_back(pool.allocate());
    }
    const exec::Host ex{1};
    REQUIRE(channel::pack_channel_pages(ex, full_store,
                                        make_csr_view(pool.geometry(), pool.k(0), pool.k_strides(), pool.v(0),
                                                      pool.v_strides(), CsrPageTable{kZero, nullptr, nullptr, 0}),
                                        ksel.data(), vsel.data(), src.data(), dst.data(),
                                        static_cast<std::int32_t>(src.size()), old_len[b])
                .is_ok());
    REQUIRE(channel::pack_residual_pages(ex, full_store, pool.residual(0), ksel.data(), vsel.data(), rk, rv,
                                         src.data(), dst.data(), static_cast<std::int32_t>(src.size()), old_len[b])
                .is_ok());
    o_indices.insert(o_indices.end(), dst.begin(), dst.end());
    o_indptr.push_back(static_cast<std::int32_t>(o_indices.size()));
    o_last.push_back(old_len[b] > 0 ? old_len[b] - (old_len[b] - 1) / P * P : 0);
  }
  // Window: copy the window tokens to their own full-width pool (page aligned from 0).
  KVGeometry wg{Hkv, D, P, 8, D};
  std::vector<T> wk(static_cast<std::size_t>(wg.num_pages) * P * Hkv * D), wv(wk.size());
  const KVStrides ws = packed_strides(wg, KVLayout::kNHD);
  std::int32_t next_w = 0;
  auto krow = [&](std::int32_t b, std::int32_t t, std::int32_t h) {
    return fk.data() + full_store.k_offset(full_pages[b][t / P], t % P, h);
  };
  auto vrow = [&](std::int32_t b, std::int32_t t, std::int32_t h) {
    return fv.data() + full_store.v_offset(full_pages[b][t / P], t % P, h);
  };
  for (std::int32_t b = 0; b < B; ++b) {
    for (std::int32_t p = 0; p * P < win_len[b]; ++p) {
      const std::int32_t page = next_w++;
      w_indices.push_back(page);
      for (std::int32_t s = 0; s < P && p * P + s < win_len[b]; ++s)
        for (std::int32_t h = 0; h < Hkv; ++h)
          for (std::int32_t d = 0; d < D; ++d) {
            const std::size_t off = static_cast<std::size_t>(page * ws.page + s * ws.token + h * ws.head + d);
            wk[off] = krow(b, old_len[b] + p * P + s, h)[d];
            wv[off] = vrow(b, old_len[b] + p * P + s, h)[d];
          }
    }
    w_indptr.push_back(static_cast<std::int32_t>(w_indices.size()));
    w_last.push_back(win_len[b] - (win_len[b] - 1) / P * P);
  }
  const PagedKVView<T> wview =
      make_csr_view(wg, wk.data(), ws, wv.data(), ws, CsrPageTable{w_indptr.data(), w_indices.data(), w_last.data(), B});
  const PagedKVView<T> oview = make_csr_view(pool.geometry(), pool.k(0), pool.k_strides(), pool.v(0), pool.v_strides(),
                                             CsrPageTable{o_indptr.data(), o_indices.data(), o_last.data(), B});
  const std::vector<T> q = test::random_vector<T>(static_cast<std::size_t>(B) * Hq * D, rng, -2.f, 2.f);
  DecodeAttentionParams dense{Hq, 1.f / std::sqrt(static_cast<float>(D))};
  DecodeAttentionParams pk = dense;
  pk.k_channels = ksel.data();
  pk.v_channels = vsel.data();
  pk.q_dim = D;
  const exec::Host ex{2};
  std::vector<unsigned char> scratch(channel::channel_attention_workspace_size(ex, wview, oview, dense, pk));
  std::vector<T> out(static_cast<std::size_t>(B) * Hq * D);
  REQUIRE(channel::channel_attention(ex, wview, oview, pool.residual(0), q.data(), out.data(), dense, pk,
                                     Workspace{scratch.data(), scratch.size()})
              .is_ok());
  // The result does not depend on the thread count (documented): bitwise equal outputs
  // with 1 thread and with more threads than (sequence, kv head) pairs.
  for (std::int32_t threads : {1, 6}) {
    const exec::Host ex_t{threads};
    std::vector<unsigned char> ws_t(channel::channel_attention_workspace_size(ex_t, wview, oview, dense, pk));
    std::vector<T> out_t(out.size());
    REQUIRE(channel::channel_attention(ex_t, wview, oview, pool.residual(0), q.data(), out_t.data(), dense, pk,
                                       Workspace{ws_t.data(), ws_t.size()})
                .is_ok());
    INFO("threads " << threads);
    CHECK(std::memcmp(out_t.data(), out.data(), sizeof(T) * out.size()) == 0);
  }
  // float64 reference: old rows as they read back (selected exact, dropped s * code).
  std::vector<std::int32_t> code;
  float s = 0.f;
  double max_err = 0, max_ref = 0;
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int32_t n = old_len[b] + win_len[b];
    for (std::int32_t hq = 0; hq < Hq; ++hq) {
      const std::int32_t h = hq / G;
      std::vector<double> sc(static_cast<std::size_t>(n));
      std::vector<std::vector<double>> vv(static_cast<std::size_t>(n), std::vector<double>(D));
      double m = -1e300;
      for (std::int32_t t = 0; t < n; ++t) {
        std::vector<double> kk(D);
        for (std::int32_t d = 0; d < D; ++d) {
          kk[d] = test::to_double(krow(b, t, h)[d]);
          vv[t][d] = test::to_double(vrow(b, t, h)[d]);
        }
        if (t < old_len[b])
          for (int which = 0; which < 2; ++which) {
            const std::int32_t r = which == 0 ? rk : rv;
            const std::vector<std::int32_t> drop = complement((which == 0 ? ksel : vsel).data() + h * r, r, D);
            reference_row(which == 0 ? krow(b, t, h) : vrow(b, t, h), drop, bits, code, s);
            for (std::size_t j = 0; j < drop.size(); ++j) (which == 0 ? kk[drop[j]] : vv[t][drop[j]]) = double(s) * code[j];
          }
        double x = 0;
        for (std::int32_t d = 0; d < D; ++d) x += test::to_double(q[(static_cast<std::size_t>(b) * Hq + hq) * D + d]) * kk[d];
        sc[t] = x * dense.sm_scale;
        m = std::max(m, sc[t]);
      }
      double z = 0;
      for (double& x : sc) z += (x = std::exp(x - m));
      for (std::int32_t d = 0; d < D; ++d) {
        double o = 0;
        for (std::int32_t t = 0; t < n; ++t) o += sc[t] / z * vv[t][d];
        const double got = test::to_double(out[(static_cast<std::size_t>(b) * Hq + hq) * D + d]);
        max_err = std::max(max_err, std::fabs(got - o));
        max_ref = std::max(max_ref, std::fabs(o));
      }
    }
  }
  const double tol = std::is_same<T, float>::value ? 1e-5 : std::is_same<T, half_t>::value ? 4e-3 : 2e-2;
  INFO("bits " << bits << " rk " << rk << " rv " << rv << ": max abs error " << max_err << " (max |ref| " << max_ref
               << ")");
  CHECK(max_err <= tol * std::max(1.0, max_ref));
}

}  // namespace

TEMPLATE_TEST_CASE("residual: codes as documented, selected dims exact, dropped within half a step",
                   "[kvchan][residual]", float, half_t, bfloat16_t) {
  KVKIT_TEST_RNG(rng);
  residual_round_trips<TestType>(rng);
}

TEMPLATE_TEST_CASE("residual attention equals dense attention over the rows as they read back (float64 reference)",
                   "[kvchan][residual]", float, half_t, bfloat16_t) {
  KVKIT_TEST_RNG(rng);
  for (std::int32_t bits : {4, 8})
    for (auto rr : {std::pair<int, int>{4, 16}, {16, 5}, {1, 1}, {9, 12}}) check_residual_attention<TestType>(bits, rr.first, rr.second, rng);
  // Head dim 64 (SmolLM2's), whole chunks and tails, several tiles, groups 3, 5, 6.
  for (std::int32_t bits : {4, 8})
    for (auto rr : {std::pair<int, int>{16, 16}, {20, 37}, {32, 64}, {64, 3}})
      for (std::int32_t G : {3, 5, 6}) check_residual_attention<TestType>(bits, rr.first, rr.second, rng, 64, G, true);
}

TEST_CASE("residual: an empty old part gives lse -inf and zero rows", "[kvchan][residual]") {
  KVKIT_TEST_RNG(rng);
  channel::PackedPagePool<float> pool(1, 1, 2, 2, 4, 8, 4, 4);
  (void)pool.allocate();  // capacity: the views need storage
  const std::int32_t indptr[2] = {0, 0}, last[1] = {0};
  const std::int32_t* none = nullptr;
  const PagedKVView<float> old = make_csr_view(pool.geometry(), pool.k(0), pool.k_strides(), pool.v(0),
                                               pool.v_strides(), CsrPageTable{indptr, none, last, 1});
  const std::int32_t set[2] = {0, 3};
  DecodeAttentionParams p{2, 0.5f};
  p.k_channels = set;
  p.v_channels = set;
  p.q_dim = 4;
  std::vector<float> q = test::random_vector<float>(8, rng), out(8, 7.f);
  float lse[2] = {1.f, 1.f};
  REQUIRE(channel::residual_channel_attention(exec::Host{1}, old, pool.residual(0), q.data(), out.data(), lse, p).is_ok());
  CHECK(std::isinf(lse[0]));
  CHECK(lse[0] < 0);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.f; }));
}

TEST_CASE("residual: bad bits, geometry and head dims are rejected naming the value", "[kvchan][residual]") {
  KVKIT_TEST_RNG(rng);
  const auto c = test::make_pack_case<float>(2, 8, 8, 3, 5, 4, 9, KVLayout::kNHD, rng);
  PackCase<float> cc = c;
  auto full = cc.full_view(cc.fk.data(), cc.fv.data());
  test::ResidualCase ra(8, 2, 4, cc.packed_g.num_pages, 5, 3, rng);
  const std::vector<std::uint8_t> bytes0 = ra.bytes;
  auto msg = [](const Status& s) { return s.to_string(); };
  channel::ResidualView bad = ra.view;
  bad.bits = 3;
  Status s = channel::pack_residual_pages(exec::Host{1}, full, bad, cc.kch.data(), cc.vch.data(), 3, 5,
                                          cc.full_pages.data(), cc.packed_pages.data(), cc.n_pages, cc.n_tokens);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(msg(s).find("residual bits must be 4 or 8, got 3") != std::string::npos);
  bad = ra.view;
  bad.k_bytes = 4;  // 5 dropped dims at 8 bits need 5
  s = channel::pack_residual_pages(exec::Host{1}, full, bad, cc.kch.data(), cc.vch.data(), 3, 5, cc.full_pages.data(),
                                   cc.packed_pages.data(), cc.n_pages, cc.n_tokens);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(msg(s).find("(4, 3)") != std::string::npos);
  std::vector<std::int32_t> bad_pages = cc.packed_pages;
  bad_pages.back() = 999;
  s = channel::pack_residual_pages(exec::Host{1}, full, ra.view, cc.kch.data(), cc.vch.data(), 3, 5,
                                   cc.full_pages.data(), bad_pages.data(), cc.n_pages, cc.n_tokens);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(msg(s).find("999") != std::string::npos);
  // Strides: K records of 5 codes + scale take 12 bytes, 8 of them a page of 4 slots x 2
  // heads, 96 bytes; floats need multiples of 4.
  auto rejects = [&](const channel::ResidualView& v, const std::string& expect) {
    const Status st = channel::pack_residual_pages(exec::Host{1}, full, v, cc.kch.data(), cc.vch.data(), 3, 5,
                                                   cc.full_pages.data(), cc.packed_pages.data(), cc.n_pages,
                                                   cc.n_tokens);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(msg(st).find(expect) != std::string::npos);
  };
  for (std::int64_t stride : {92, 98}) {
    bad = ra.view;
    bad.page_stride = stride;
    rejects(bad, "page stride " + std::to_string(stride) + " bytes: needs a multiple of 4, at least 96");
  }
  for (std::int64_t stride : {4, 14}) {
    bad = ra.view;
    bad.k_row_stride = stride;
    rejects(bad, "row strides (" + std::to_string(stride) + ", 8) bytes");
  }
  CHECK(ra.bytes == bytes0);  // nothing written by any failed call
  // Head dims past the kernels' stack arrays.
  KVGeometry g{1, 320, 4, 2, 320};
  std::vector<float> big(2 * 4 * 320);
  static const std::int32_t kZero[1] = {0};
  const auto bigv = make_csr_view(g, big.data(), packed_strides(g, KVLayout::kNHD), big.data(),
                                  packed_strides(g, KVLayout::kNHD), CsrPageTable{kZero, nullptr, nullptr, 0});
  s = channel::pack_residual_pages(exec::Host{1}, bigv, ra.view, cc.kch.data(), cc.vch.data(), 3, 5,
                                   cc.full_pages.data(), cc.packed_pages.data(), cc.n_pages, cc.n_tokens);
  CHECK(s.code() == StatusCode::kUnsupported);
  CHECK(msg(s).find("unsupported head_dim 320") != std::string::npos);
  // Parameters and pools.
  channel::ChannelParams p;
  p.residual_bits = 6;
  CHECK_THROWS_WITH(p.validate(64), Catch::Contains("residual bits must be 0, 4 or 8, got 6"));
  p.residual_bits = 4;
  p.k_compensation = true;
  CHECK_THROWS_WITH(p.validate(64), Catch::Contains("residual bits 4 exclude mean / key compensation"));
  CHECK_THROWS_WITH(channel::PackedPagePool<float>(1, 1, 4, 4, 4, 2, 8, 8), Catch::Contains("got 2"));
}

TEST_CASE("residual: pool bytes count the codes and scales", "[kvchan][residual]") {
  // 2 layers, 3 heads, K 5 of 16 dims (11 dropped), V 16 of 16 (none), page 4, half pages.
  channel::PackedPagePool<half_t> p4(2, 3, 5, 16, 4, 4, 16, 16), p8(2, 3, 5, 16, 4, 8, 16, 16), p0(2, 3, 5, 16, 4);
  CHECK(p0.page_bytes() == 4 * 3 * 2 * (5 + 16) * 2);
  // ceil(11 * 4 / 8) = 6 code bytes, the K scale at 8 (2 bytes of padding); a V record is
  // its scale alone.
  CHECK(p4.page_bytes() == 4 * 3 * 2 * ((5 + 16) * 2 + 12 + 4));
  // 11 code bytes: the scale at 12 (1 byte of padding), a record of 16 bytes; V none.
  CHECK(p8.page_bytes() == 4 * 3 * 2 * ((5 + 16) * 2 + 16 + 4));
  CHECK(p8.residual(0).k_row_stride == 16);
  CHECK(p8.residual(0).v_row_stride == 4);
  const std::int32_t a = p4.allocate(), b = p4.allocate();
  CHECK(a != b);
  CHECK(p4.bytes_in_use() == 2 * p4.page_bytes());
  const channel::ResidualView v = p4.residual(1);
  CHECK(v.k_bytes == 6);
  CHECK(v.v_bytes == 0);
  CHECK(v.num_pages_total == p4.capacity());
  CHECK_THROWS_WITH(p0.residual(0), Catch::Contains("keeps no residual"));
}
