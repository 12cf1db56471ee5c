// CPU paged_decode_attention (every variant, both layouts, K/V of different widths) and
// merge_attention_states against float64 references on fresh random pools. Compiled once
// per instruction set the build machine has (tests/kvkit_simd_tests.cmake), so the
// portable, AVX2 and AVX-512 paths are each checked.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"
#include "test_scale.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// Shape of a random pool whose K and V may differ in width and layout.
struct Spec {
  std::int32_t hkv = 2, kdim = 16, vdim = 16, page_size = 4;
  KVLayout k_layout = KVLayout::kNHD, v_layout = KVLayout::kNHD;
  PageTableKind table = PageTableKind::kCsr;
  std::vector<std::int32_t> lens;
};

/// Random K/V pool (reference.hpp's RandomPool: shuffled pages, two spare pages) with
/// this file's Spec; its view's page table is validated.
template <class T>
struct Pool : RandomPool<T> {
  Pool(const Spec& sp, std::mt19937_64& rng) : RandomPool<T>(pool_spec(sp), rng), spec(sp) {
    this->view.validate_page_table();
  }
  std::int32_t batch() const { return static_cast<std::int32_t>(spec.lens.size()); }
  static PoolSpec pool_spec(const Spec& sp) {
    PoolSpec ps;
    ps.num_kv_heads = sp.hkv;
    ps.head_dim = sp.kdim;
    ps.v_head_dim = sp.vdim;
    ps.page_size = sp.page_size;
    ps.layout = sp.k_layout;
    ps.v_layout = static_cast<int>(sp.v_layout);
    ps.table = sp.table;
    ps.seq_lens = sp.lens;
    ps.spare_pages = 2;
    return ps;
  }

  Spec spec;
};

/// float64 decode attention with every variant of DecodeAttentionParams: out
/// [batch, Hq, out_width], lse [batch, Hq], scores [batch, Hq, scores_stride] (-inf where
/// no token was read; only written when p.scores is set).
template <class T>
void reference(const PagedKVView<T>& view, const T* q, const DecodeAttentionParams& p,
               std::vector<double>& out, std::vector<double>& lse, std::vector<double>& scores) {
  const std::int32_t hkv = view.num_kv_heads, hq = p.num_qo_heads, G = hq / hkv;
  const std::int32_t kdim = view.head_dim, vdim = view.v_head_dim;
  const std::int32_t q_width = p.k_channels ? p.q_dim : kdim;
  const std::int32_t out_width = p.v_channels ? p.q_dim : vdim;
  out.assign(static_cast<std::size_t>(view.batch_size) * hq * out_width, 0.0);
  lse.assign(static_cast<std::size_t>(view.batch_size) * hq, -kInf);
  scores.assign(static_cast<std::size_t>(view.batch_size) * hq * std::max<std::int64_t>(1, p.scores_stride), -kInf);
  for (std::int32_t b = 0; b < view.batch_size; ++b)
    for (std::int32_t qh = 0; qh < hq; ++qh) {
      const std::int32_t h = qh / G;
      const std::size_t row = static_cast<std::size_t>(b) * hq + qh;
      std::vector<std::int32_t> pages;
      if (p.page_subset_indptr) {
        for (std::int32_t i = p.page_subset_indptr[b * hkv + h]; i < p.page_subset_indptr[b * hkv + h + 1]; ++i)
          pages.push_back(p.page_subset[i]);
      } else {
        for (std::int32_t i = 0; i < view.num_pages(b); ++i) pages.push_back(i);
      }
      std::vector<std::int32_t> toks;
      for (std::int32_t lp : pages)
        for (std::int32_t t = lp * view.page_size; t < std::min(view.seq_len(b), (lp + 1) * view.page_size); ++t)
          toks.push_back(t);
      if (toks.empty()) continue;
      const T* qr = q + row * q_width;
      std::vector<double> logit;
      double mx = -kInf;
      for (std::int32_t t : toks) {
        const T* kr = view.k_ptr(b, t, h);
        double s = 0;
        for (std::int32_t c = 0; c < kdim; ++c)
          s += to_double(qr[p.k_channels ? p.k_channels[h * kdim + c] : c]) * to_double(kr[c]);
        logit.push_back(s * p.sm_scale);
        mx = std::max(mx, logit.back());
        if (p.scores) scores[row * p.scores_stride + t] = logit.back();
      }
      double sum = 0;
      for (double& l : logit) sum += (l = std::exp(l - mx));
      for (std::size_t i = 0; i < toks.size(); ++i) {
        const T* vr = view.v_ptr(b, toks[i], h);
        for (std::int32_t c = 0; c < vdim; ++c)
          out[row * out_width + (p.v_channels ? p.v_channels[h * vdim + c] : c)] +=
              logit[i] / sum * to_double(vr[c]);
      }
      lse[row] = mx + std::log(sum);
    }
}

/// Runs the kernel with `threads` threads on fresh garbage outputs.
template <class T>
struct Run {
  std::vector<T> out;
  std::vector<float> lse, scores;
  Status status;
};

template <class T>
Run<T> run(const PagedKVView<T>& view, const std::vector<T>& q, const DecodeAttentionParams& p0,
           int threads, std::mt19937_64& rng, bool with_lse = true) {
  const std::int32_t out_width = p0.v_channels ? p0.q_dim : view.v_head_dim;
  Run<T> r;
  r.out = random_vector<T>(static_cast<std::size_t>(view.batch_size) * p0.num_qo_heads * out_width, rng);
  r.lse.assign(static_cast<std::size_t>(view.batch_size) * p0.num_qo_heads, 77.f);
  DecodeAttentionParams p = p0;
  if (p.scores != nullptr) {
    r.scores.assign(static_cast<std::size_t>(view.batch_size) * p.num_qo_heads * p.scores_stride, 55.f);
    p.scores = r.scores.data();
  }
  std::vector<unsigned char> ws(paged_decode_attention_workspace_size(exec::Host{threads}, view, p) + 1);
  r.status = paged_decode_attention(exec::Host{threads}, view, q.data(), r.out.data(), p,
                                    Workspace{ws.data(), ws.size()}, with_lse ? r.lse.data() : nullptr);
  return r;
}

/// Checks one run against the reference (empty sequences: exact zeros and lse -inf), and
/// that 1 and 3 threads agree bit for bit. Returns the 1-thread run.
template <class T>
Run<T> check(const PagedKVView<T>& view, const std::vector<T>& q, const DecodeAttentionParams& p,
           std::mt19937_64& rng) {
  float dummy = 0.f;
  DecodeAttentionParams pr = p;
  if (p.scores != nullptr) pr.scores = &dummy;  // run() substitutes its own buffer
  std::vector<double> want, want_lse, want_scores;
  reference(view, q.data(), p, want, want_lse, want_scores);
  Run<T> a = run(view, q, pr, 1, rng);
  INFO(a.status.to_string());
  REQUIRE(a.status.is_ok());
  REQUIRE(compare_close(a.out.data(), want, value_tolerance<T>(), "out") == "");
  REQUIRE(compare_close(a.lse.data(), want_lse, Tolerance{1e-4, 1e-5}, "lse") == "");
  const std::size_t out_width = a.out.size() / a.lse.size();
  for (std::int32_t b = 0; b < view.batch_size; ++b)
    if (view.seq_len(b) == 0)
      for (std::int32_t h = 0; h < p.num_qo_heads; ++h) {
        const std::size_t row = static_cast<std::size_t>(b) * p.num_qo_heads + h;
        REQUIRE(std::isinf(a.lse[row]));
        REQUIRE(a.lse[row] < 0);
        for (std::size_t c = 0; c < out_width; ++c) REQUIRE(to_float(a.out[row * out_width + c]) == 0.f);
      }
  if (p.scores != nullptr) {
    // Tokens past each sequence's end are not written (sentinel 55 stays).
    const std::int32_t hq = p.num_qo_heads;
    for (std::int32_t b = 0; b < view.batch_size; ++b)
      for (std::int32_t h = 0; h < hq; ++h)
        for (std::int64_t t = view.seq_len(b); t < p.scores_stride; ++t) {
          const std::size_t i = (static_cast<std::size_t>(b) * hq + h) * p.scores_stride + t;
          REQUIRE(a.scores[i] == 55.f);
          want_scores[i] = 55.0;
        }
    REQUIRE(compare_close(a.scores.data(), want_scores, Tolerance{1e-4, 1e-4}, "scores") == "");
  }
  Run<T> b = run(view, q, pr, 3, rng);
  REQUIRE(b.status.is_ok());
  REQUIRE(bitwise_equal(a.out, b.out));
  REQUIRE(bitwise_equal(a.lse, b.lse));
  REQUIRE(bitwise_equal(a.scores, b.scores));
  return a;
}

const char* table_name(PageTableKind k) { return k == PageTableKind::kCsr ? "csr" : "block"; }

// Ragged lengths: empty, S = 1, a full page, three exactly full pages, a partial last
// page, longer than a tile, and one long enough that small batches are cut into chunks
// (merged in log-sum-exp form).
std::vector<std::int32_t> ragged_lens(std::int32_t ps, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> u(1, 3 * ps);
  return {0, 1, ps, 3 * ps, u(rng), 70 + u(rng) % 9, 1100 + u(rng)};
}

/// Random strictly ascending page subsets per (sequence, kv head), some empty.
struct Subsets {
  std::vector<std::int32_t> indptr{0}, pages;
};
template <class T>
Subsets random_subsets(const PagedKVView<T>& view, std::mt19937_64& rng) {
  Subsets s;
  std::bernoulli_distribution keep(0.5);
  for (std::int32_t b = 0; b < view.batch_size; ++b)
    for (std::int32_t h = 0; h < view.num_kv_heads; ++h) {
      const bool none = (b + h) % 5 == 3;
      for (std::int32_t i = 0; i < view.num_pages(b) && !none; ++i)
        if (keep(rng)) s.pages.push_back(i);
      s.indptr.push_back(static_cast<std::int32_t>(s.pages.size()));
    }
  return s;
}

/// Per kv head, `width` distinct channel ids of [0, q_dim), in random order.
std::vector<std::int32_t> random_channels(std::int32_t hkv, std::int32_t width, std::int32_t q_dim,
                                          std::mt19937_64& rng) {
  std::vector<std::int32_t> ids;
  for (std::int32_t h = 0; h < hkv; ++h) {
    std::vector<std::int32_t> c = random_distinct(width, q_dim, rng);
    ids.insert(ids.end(), c.begin(), c.end());
  }
  return ids;
}

}  // namespace

TEMPLATE_TEST_CASE("paged_decode_attention matches float64 on every layout and width",
                   "[cpu][attention]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  INFO("simd path " << kvkit::detail::cpu::simd_isa());
  const std::pair<KVLayout, KVLayout> layouts[] = {{KVLayout::kNHD, KVLayout::kNHD},
                                                   {KVLayout::kHND, KVLayout::kHND},
                                                   {KVLayout::kNHD, KVLayout::kHND}};
  const std::pair<std::int32_t, std::int32_t> dims[] = {{128, 128}, {64, 64}, {64, 32}, {20, 36}, {8, 8}};
  long c = -1;
  for (const auto& lay : layouts)
    for (PageTableKind table : {PageTableKind::kCsr, PageTableKind::kBlockTable})
      for (std::int32_t group : {1, 2, 3, 4})
        for (std::int32_t ps : {1, 16})
          for (const auto& kv : dims) {
            if (!sampled(++c, 3)) continue;  // the sanitizer build: 80 of the 240 cases
            CAPTURE(to_string(lay.first), to_string(lay.second), table_name(table), group, ps,
                    kv.first, kv.second);
            Spec sp;
            sp.hkv = 2;
            sp.kdim = kv.first;
            sp.vdim = kv.second;
            sp.page_size = ps;
            sp.k_layout = lay.first;
            sp.v_layout = lay.second;
            sp.table = table;
            sp.lens = ragged_lens(ps, rng);
            Pool<T> pool(sp, rng);
            const std::int32_t hq = sp.hkv * group;
            std::vector<T> q = random_vector<T>(static_cast<std::size_t>(pool.batch()) * hq * sp.kdim, rng, -3.f, 3.f);
            DecodeAttentionParams p{hq, 1.f / std::sqrt(static_cast<float>(sp.kdim))};
            const Run<T> one = check(pool.view, q, p, rng);
            // without lse (2 threads): the same output
            const Run<T> no_lse = run(pool.view, q, p, 2, rng, /*with_lse=*/false);
            REQUIRE(no_lse.status.is_ok());
            REQUIRE(bitwise_equal(one.out, no_lse.out));
          }
}

TEST_CASE("paged_decode_attention is bitwise identical for 1 to 5 threads", "[cpu][attention]") {
  // Hkv 8 and one sequence: the kernel groups NHD heads differently per thread count and
  // cuts the sequence into chunks; neither may change a bit of the output.
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t len : {1, 700, 3000}) {
      CAPTURE(to_string(layout), len);
      Spec sp;
      sp.hkv = 8;
      sp.kdim = sp.vdim = 32;
      sp.page_size = 16;
      sp.k_layout = sp.v_layout = layout;
      sp.lens = {len};
      Pool<half_t> pool(sp, rng);
      std::vector<half_t> q = random_vector<half_t>(16 * 32, rng, -3.f, 3.f);
      const DecodeAttentionParams p{16, 0.2f};
      check(pool.view, q, p, rng);
      const Run<half_t> one = run(pool.view, q, p, 1, rng);
      for (int threads : {2, 4, 5}) {
        const Run<half_t> many = run(pool.view, q, p, threads, rng);
        REQUIRE(many.status.is_ok());
        REQUIRE(bitwise_equal(one.out, many.out));
        REQUIRE(bitwise_equal(one.lse, many.lse));
      }
    }
}

TEMPLATE_TEST_CASE("paged_decode_attention variants: page subset, channels, scores, combined",
                   "[cpu][attention][variants]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t batch_kind : {0, 1})  // 0: ragged batch, 1: one long sequence (chunked)
      for (int mask = 1; mask < 8; ++mask) {
        const bool subset = mask & 1, channels = mask & 2, scores = mask & 4;
        CAPTURE(to_string(layout), batch_kind, subset, channels, scores);
        Spec sp;
        sp.hkv = 2;
        sp.kdim = channels ? 24 : 64;
        sp.vdim = channels ? 40 : 64;
        sp.page_size = 16;
        sp.k_layout = layout;
        sp.v_layout = layout == KVLayout::kNHD ? KVLayout::kHND : KVLayout::kNHD;
        sp.lens = batch_kind == 0 ? ragged_lens(16, rng) : std::vector<std::int32_t>{2100};
        Pool<T> pool(sp, rng);
        const std::int32_t hq = 6, q_dim = 64;
        DecodeAttentionParams p{hq, 0.125f};
        Subsets sub;
        std::vector<std::int32_t> kch, vch;
        if (subset) {
          sub = random_subsets(pool.view, rng);
          p.page_subset_indptr = sub.indptr.data();
          p.page_subset = sub.pages.data();
        }
        if (channels) {
          kch = random_channels(sp.hkv, sp.kdim, q_dim, rng);
          vch = random_channels(sp.hkv, sp.vdim, q_dim, rng);
          p.k_channels = kch.data();
          p.v_channels = vch.data();
          p.q_dim = q_dim;
        }
        float marker = 0.f;
        if (scores) {
          p.scores = &marker;
          std::int32_t longest = 0;
          for (std::int32_t l : sp.lens) longest = std::max(longest, l);
          p.scores_stride = longest + 5;
        }
        const std::int32_t q_width = channels ? q_dim : sp.kdim;
        std::vector<T> q = random_vector<T>(static_cast<std::size_t>(pool.batch()) * hq * q_width, rng, -3.f, 3.f);
        check(pool.view, q, p, rng);
      }
}

TEST_CASE("page subsets shared by a sequence's kv heads take one NHD walk with the same bits",
          "[cpu][attention][variants]") {
  // With NHD K the kernel walks the heads of an item together when their page lists are
  // equal (always for dense, now also for equal subsets). A full subset must give the
  // dense kernel's bits; a shared random subset, the bits of the one-head-at-a-time walk
  // (forced by giving the last head a different list), for every head whose list is
  // unchanged, at 1 to 4 threads; and both match the float64 reference.
  KVKIT_TEST_RNG(rng);
  Spec sp;
  sp.hkv = 8;
  sp.kdim = sp.vdim = 32;
  sp.page_size = 16;
  sp.k_layout = sp.v_layout = KVLayout::kNHD;
  sp.lens = {700, 1, 3000, 90};
  Pool<half_t> pool(sp, rng);
  const std::int32_t hq = 16, group = hq / sp.hkv, batch = pool.batch();
  std::vector<half_t> q = random_vector<half_t>(static_cast<std::size_t>(batch) * hq * sp.kdim, rng, -3.f, 3.f);
  const DecodeAttentionParams dense{hq, 0.2f};
  Subsets all, shared, odd;
  std::bernoulli_distribution keep(0.4);
  for (std::int32_t b = 0; b < batch; ++b) {
    std::vector<std::int32_t> pick;
    for (std::int32_t i = 0; i < pool.view.num_pages(b); ++i)
      if (keep(rng) || i + 1 == pool.view.num_pages(b)) pick.push_back(i);
    for (std::int32_t h = 0; h < sp.hkv; ++h) {
      for (std::int32_t i = 0; i < pool.view.num_pages(b); ++i) all.pages.push_back(i);
      shared.pages.insert(shared.pages.end(), pick.begin(), pick.end());
      // odd: the last head drops its first page (so its list differs when it has two).
      odd.pages.insert(odd.pages.end(), pick.begin() + (h + 1 == sp.hkv && pick.size() > 1 ? 1 : 0), pick.end());
      all.indptr.push_back(static_cast<std::int32_t>(all.pages.size()));
      shared.indptr.push_back(static_cast<std::int32_t>(shared.pages.size()));
      odd.indptr.push_back(static_cast<std::int32_t>(odd.pages.size()));
    }
  }
  auto with = [&](const Subsets& sub) {
    DecodeAttentionParams p = dense;
    p.page_subset_indptr = sub.indptr.data();
    p.page_subset = sub.pages.data();
    return p;
  };
  check(pool.view, q, with(shared), rng);  // float64 reference
  check(pool.view, q, with(odd), rng);
  for (int threads : {1, 2, 3, 4}) {
    CAPTURE(threads);
    const Run<half_t> d = run(pool.view, q, dense, threads, rng), a = run(pool.view, q, with(all), threads, rng);
    const Run<half_t> sh = run(pool.view, q, with(shared), threads, rng), od = run(pool.view, q, with(odd), threads, rng);
    REQUIRE((d.status.is_ok() && a.status.is_ok() && sh.status.is_ok() && od.status.is_ok()));
    REQUIRE(bitwise_equal(d.out, a.out));
    REQUIRE(bitwise_equal(d.lse, a.lse));
    for (std::int32_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h + 1 < sp.hkv; ++h)
        for (std::int32_t g = 0; g < group; ++g) {
          const std::size_t row = static_cast<std::size_t>(b) * hq + static_cast<std::size_t>(h) * group + g;
          REQUIRE(std::memcmp(&sh.out[row * sp.vdim], &od.out[row * sp.vdim], sizeof(half_t) * sp.vdim) == 0);
          REQUIRE(std::memcmp(&sh.lse[row], &od.lse[row], sizeof(float)) == 0);
        }
  }
}

TEMPLATE_TEST_CASE("two page ranges merged with merge_attention_states equal the whole",
                   "[cpu][attention][merge]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    CAPTURE(to_string(layout));
    Spec sp;
    sp.hkv = 2;
    sp.kdim = sp.vdim = 64;
    sp.page_size = 16;
    sp.k_layout = sp.v_layout = layout;
    sp.lens = {1, 40, 16, 700, 0};
    Pool<T> pool(sp, rng);
    const std::int32_t hq = 8, batch = pool.batch();
    const DecodeAttentionParams whole{hq, 0.125f};
    std::vector<T> q = random_vector<T>(static_cast<std::size_t>(batch) * hq * sp.kdim, rng, -3.f, 3.f);
    // Part A: the first half of each sequence's pages (at least one); part B: the rest
    // (empty for one-page sequences: lse -inf, so the merge returns A).
    Subsets a, b;
    for (std::int32_t s = 0; s < batch; ++s)
      for (std::int32_t h = 0; h < sp.hkv; ++h) {
        const std::int32_t np = pool.view.num_pages(s), cut = (np + 1) / 2;
        for (std::int32_t i = 0; i < np; ++i) (i < cut ? a.pages : b.pages).push_back(i);
        a.indptr.push_back(static_cast<std::int32_t>(a.pages.size()));
        b.indptr.push_back(static_cast<std::int32_t>(b.pages.size()));
      }
    DecodeAttentionParams pa = whole, pb = whole;
    pa.page_subset_indptr = a.indptr.data();
    pa.page_subset = a.pages.data();
    pb.page_subset_indptr = b.indptr.data();
    pb.page_subset = b.pages.data();
    Run<T> ra = run(pool.view, q, pa, 2, rng), rb = run(pool.view, q, pb, 1, rng);
    REQUIRE(ra.status.is_ok());
    REQUIRE(rb.status.is_ok());
    const std::int64_t rows = static_cast<std::int64_t>(batch) * hq;
    std::vector<T> merged(ra.out.size());
    std::vector<float> lse(static_cast<std::size_t>(rows));
    REQUIRE(merge_attention_states(exec::Host{2}, ra.out.data(), ra.lse.data(), rb.out.data(),
                                   rb.lse.data(), merged.data(), lse.data(), rows, sp.vdim)
                .is_ok());
    std::vector<double> want, want_lse, unused;
    reference(pool.view, q.data(), whole, want, want_lse, unused);
    // Two roundings to T (the parts) before the merge: twice the single-call tolerance.
    Tolerance tol = value_tolerance<T>();
    tol.atol *= 2;
    tol.rtol *= 2;
    REQUIRE(compare_close(merged.data(), want, tol, "merged") == "");
    REQUIRE(compare_close(lse.data(), want_lse, Tolerance{1e-4, 1e-5}, "lse") == "");
    // In place (out aliases out_a), 1 thread: the same bits.
    std::vector<T> inplace = ra.out;
    REQUIRE(merge_attention_states(exec::Host{1}, inplace.data(), ra.lse.data(), rb.out.data(),
                                   rb.lse.data(), inplace.data(), static_cast<float*>(nullptr), rows,
                                   sp.vdim)
                .is_ok());
    REQUIRE(bitwise_equal(inplace, merged));
  }
}

TEMPLATE_TEST_CASE("kvchan: packed channel-restricted part + full-width window, merged",
                   "[cpu][attention][merge]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  const std::int32_t hkv = 2, hq = 8, D = 64, rk = 16, rv = 24;
  // Old tokens live packed (K rows of rk channels, V rows of rv channels) in one pool; the
  // recent window at full width in another.
  Spec packed;
  packed.hkv = hkv;
  packed.kdim = rk;
  packed.vdim = rv;
  packed.page_size = 16;
  packed.k_layout = KVLayout::kHND;
  packed.v_layout = KVLayout::kNHD;
  packed.lens = {300, 0, 45};
  Spec window = packed;
  window.kdim = window.vdim = D;
  window.k_layout = window.v_layout = KVLayout::kNHD;
  window.lens = {32, 7, 0};
  Pool<T> pp(packed, rng), wp(window, rng);
  const std::int32_t batch = 3;
  std::vector<T> q = random_vector<T>(static_cast<std::size_t>(batch) * hq * D, rng, -3.f, 3.f);
  std::vector<std::int32_t> kch = random_channels(hkv, rk, D, rng), vch = random_channels(hkv, rv, D, rng);
  DecodeAttentionParams pa{hq, 0.125f};
  pa.k_channels = kch.data();
  pa.v_channels = vch.data();
  pa.q_dim = D;
  const DecodeAttentionParams pb{hq, 0.125f};
  Run<T> ra = run(pp.view, q, pa, 3, rng), rb = run(wp.view, q, pb, 1, rng);
  REQUIRE(ra.status.is_ok());
  REQUIRE(rb.status.is_ok());
  const std::int64_t rows = static_cast<std::int64_t>(batch) * hq;
  std::vector<T> merged(static_cast<std::size_t>(rows) * D);
  std::vector<float> lse(static_cast<std::size_t>(rows));
  REQUIRE(merge_attention_states(exec::Host{1}, ra.out.data(), ra.lse.data(), rb.out.data(),
                                 rb.lse.data(), merged.data(), lse.data(), rows, D)
              .is_ok());
  // float64: one softmax over the packed part's logits (q restricted to k_channels) and
  // the window's full logits; packed values land on their v_channels, the rest are 0.
  std::vector<double> want(static_cast<std::size_t>(rows) * D, 0.0), want_lse(static_cast<std::size_t>(rows), -kInf);
  for (std::int32_t b = 0; b < batch; ++b)
    for (std::int32_t qh = 0; qh < hq; ++qh) {
      const std::int32_t h = qh / (hq / hkv);
      const std::size_t row = static_cast<std::size_t>(b) * hq + qh;
      const T* qr = q.data() + row * D;
      std::vector<double> logit;
      std::vector<std::vector<double>> val;
      for (std::int32_t t = 0; t < pp.view.seq_len(b); ++t) {
        double s = 0;
        for (std::int32_t c = 0; c < rk; ++c) s += to_double(qr[kch[h * rk + c]]) * to_double(pp.view.k_ptr(b, t, h)[c]);
        logit.push_back(0.125 * s);
        std::vector<double> v(D, 0.0);
        for (std::int32_t c = 0; c < rv; ++c) v[vch[h * rv + c]] = to_double(pp.view.v_ptr(b, t, h)[c]);
        val.push_back(v);
      }
      for (std::int32_t t = 0; t < wp.view.seq_len(b); ++t) {
        double s = 0;
        for (std::int32_t c = 0; c < D; ++c) s += to_double(qr[c]) * to_double(wp.view.k_ptr(b, t, h)[c]);
        logit.push_back(0.125 * s);
        std::vector<double> v(D);
        for (std::int32_t c = 0; c < D; ++c) v[c] = to_double(wp.view.v_ptr(b, t, h)[c]);
        val.push_back(v);
      }
      if (logit.empty()) continue;
      double mx = -kInf, sum = 0;
      for (double l : logit) mx = std::max(mx, l);
      for (double& l : logit) sum += (l = std::exp(l - mx));
      for (std::size_t i = 0; i < logit.size(); ++i)
        for (std::int32_t c = 0; c < D; ++c) want[row * D + c] += logit[i] / sum * val[i][c];
      want_lse[row] = mx + std::log(sum);
    }
  Tolerance tol = value_tolerance<T>();
  tol.atol *= 2;
  tol.rtol *= 2;
  REQUIRE(compare_close(merged.data(), want, tol, "merged") == "");
  REQUIRE(compare_close(lse.data(), want_lse, Tolerance{1e-4, 1e-5}, "lse") == "");
  // Sequence 1 has no packed tokens, sequence 2 no window: the merge returns the other side.
  for (std::int32_t qh = 0; qh < hq; ++qh) {
    REQUIRE(std::isinf(ra.lse[static_cast<std::size_t>(1 * hq + qh)]));
    REQUIRE(std::isinf(rb.lse[static_cast<std::size_t>(2 * hq + qh)]));
  }
}

TEST_CASE("merge_attention_states edge cases", "[cpu][merge]") {
  KVKIT_TEST_RNG(rng);
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::int32_t dim = 37;
  std::vector<half_t> a = random_vector<half_t>(4 * dim, rng), b = random_vector<half_t>(4 * dim, rng);
  std::vector<float> la{ninf, 0.5f, ninf, 3.f}, lb{1.25f, ninf, ninf, -2.f};
  std::vector<half_t> out(4 * dim);
  std::vector<float> lse(4);
  REQUIRE(merge_attention_states(exec::Host{2}, a.data(), la.data(), b.data(), lb.data(), out.data(),
                                 lse.data(), 4, dim)
              .is_ok());
  for (std::int32_t d = 0; d < dim; ++d) {
    REQUIRE(same_bits(out[d], b[d]));            // row 0: a is empty
    REQUIRE(same_bits(out[dim + d], a[dim + d]));  // row 1: b is empty
    REQUIRE(to_float(out[2 * dim + d]) == 0.f);    // row 2: both empty
    const double wa = 1.0 / (1.0 + std::exp(-5.0));
    const double want = wa * to_double(a[3 * dim + d]) + (1 - wa) * to_double(b[3 * dim + d]);
    REQUIRE(std::abs(to_double(out[3 * dim + d]) - want) <= 1e-3 + 2e-3 * std::abs(want));
  }
  REQUIRE(lse[0] == 1.25f);
  REQUIRE(lse[1] == 0.5f);
  REQUIRE(lse[2] == ninf);
  REQUIRE(std::abs(lse[3] - (3.0 + std::log1p(std::exp(-5.0)))) < 1e-6);
  // Large lse values do not overflow: only differences are exponentiated.
  std::vector<float> big_a{1e30f, 0.f, 0.f, 0.f}, big_b{1e30f, 0.f, 0.f, 0.f};
  REQUIRE(merge_attention_states(exec::Host{1}, a.data(), big_a.data(), b.data(), big_b.data(),
                                 out.data(), lse.data(), 1, dim)
              .is_ok());
  REQUIRE(std::isfinite(to_float(out[0])));
  REQUIRE(merge_attention_states(exec::Host{1}, a.data(), la.data(), b.data(), lb.data(),
                                 static_cast<half_t*>(nullptr), lse.data(), 4, dim)
              .code() == StatusCode::kInvalidArgument);
}

TEST_CASE("paged_decode_attention rejects bad variant parameters before writing", "[cpu][attention][errors]") {
  KVKIT_TEST_RNG(rng);
  Spec sp;
  sp.hkv = 2;
  sp.kdim = 8;
  sp.vdim = 8;
  sp.page_size = 4;
  sp.lens = {9, 4};
  Pool<float> pool(sp, rng);
  const std::int32_t hq = 4;
  std::vector<float> q = random_vector<float>(2 * hq * 16, rng);
  std::vector<float> out = random_vector<float>(2 * hq * 16, rng);
  const std::vector<float> out0 = out;
  std::vector<unsigned char> ws(1 << 20);
  const Workspace w{ws.data(), ws.size()};
  auto expect = [&](const DecodeAttentionParams& p, StatusCode code, const std::string& text) {
    const Status st = paged_decode_attention(exec::Host{2}, pool.view, q.data(), out.data(), p, w);
    INFO(st.to_string());
    REQUIRE(st.code() == code);
    REQUIRE_THAT(st.message(), Catch::Contains(text));
    REQUIRE(bitwise_equal(out, out0));
  };
  SECTION("channel ids out of range") {
    std::vector<std::int32_t> kch(2 * 8, 1), vch(2 * 8, 2);
    DecodeAttentionParams p{hq, 0.3f};
    p.k_channels = kch.data();
    p.q_dim = 16;
    kch[11] = 16;
    expect(p, StatusCode::kOutOfRange, "k_channels[11] = 16");
    kch[11] = 0;
    p.v_channels = vch.data();
    vch[3] = -1;
    expect(p, StatusCode::kOutOfRange, "v_channels[3] = -1");
    vch[3] = 0;
    p.q_dim = 0;
    expect(p, StatusCode::kInvalidArgument, "q_dim 0");
  }
  SECTION("page subset not ascending or out of range") {
    // Sequence 0 has 3 pages, sequence 1 one page.
    std::vector<std::int32_t> indptr{0, 2, 3, 4, 4}, pages{0, 2, 1, 0};
    DecodeAttentionParams p{hq, 0.3f};
    p.page_subset_indptr = indptr.data();
    p.page_subset = pages.data();
    REQUIRE(paged_decode_attention(exec::Host{1}, pool.view, q.data(), out.data(), p, w).is_ok());
    out = out0;
    pages[1] = 0;
    expect(p, StatusCode::kInvalidArgument, "page_subset[1] = 0 is not above");
    pages[1] = 2;
    pages[3] = 1;
    expect(p, StatusCode::kOutOfRange, "page_subset[3] = 1 outside [0, 1)");
    pages[3] = 0;
    indptr[2] = 1;
    expect(p, StatusCode::kOutOfRange, "page_subset_indptr[2] = 1 is below");
  }
  SECTION("scores_stride too small") {
    std::vector<float> scores(2 * hq * 9);
    DecodeAttentionParams p{hq, 0.3f};
    p.scores = scores.data();
    p.scores_stride = 8;
    expect(p, StatusCode::kInvalidArgument, "scores_stride 8");
  }
}
