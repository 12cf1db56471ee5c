// The host-device twins of the Sketcher's strict pre-pass (sketch/eps_twin.hpp), which the
// CUDA kernels (kernels/cuda/eps.cuh) run, against the CPU Sketcher (sketch/eps.hpp), on
// fresh random inputs every run: page summaries built the kernels' way equal SketchStore's
// bit for bit; the per-(page, query head) bound equals detail::box_norm_bounds bit for
// bit; the twin walk takes exactly certified_walk's decisions (ties, caps, masses at
// their bounds); and the whole pre-pass in the kernels' schedule (prepass_host) returns
// SketchSelector's indptr / subset exactly and its omitted-mass bounds bit for bit, with
// needles, ragged batches, partial pages, unsummarised pages and heads switched off.
// No GPU is needed: this is what verifies the CUDA pre-pass's logic on machines without one.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "eps_cases.hpp"
#include "kvkit/sketch/eps_twin.hpp"
#include "reference.hpp"

namespace sk = kvkit::sketch;
namespace tw = kvkit::sketch::twin;
using kvkit::test::RandomPool;

namespace {

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Host arrays behind a twin::BoxSummaries.
struct HostSummaries {
  std::vector<float> mn, mx, norm, amax;
  std::vector<std::int32_t> count;
  tw::BoxSummaries s;
  HostSummaries(std::int32_t pages, std::int32_t hkv, std::int32_t d)
      : mn(static_cast<std::size_t>(pages) * hkv * d, HUGE_VALF), mx(mn.size(), -HUGE_VALF),
        norm(static_cast<std::size_t>(pages) * hkv, 0.f), amax(norm.size(), 0.f),
        count(static_cast<std::size_t>(pages), 0) {
    s = {mn.data(), mx.data(), norm.data(), amax.data(), count.data(), pages, hkv, d};
  }
  // The update kernel's work for one page holding n tokens (block (page, h), threads over
  // channels, then over tokens, then thread 0's scalars).
  template <class T>
  void update(const kvkit::PagedKVView<T>& v, std::int32_t pid, std::int32_t n) {
    const std::int32_t d = v.head_dim;
    for (std::int32_t h = 0; h < v.num_kv_heads; ++h) {
      const std::int64_t r = s.row(pid, h);
      const T* k0 = v.k_data + v.k_offset(pid, 0, h);
      for (std::int32_t c = 0; c < d; ++c) tw::box_channel(k0, v.k_stride_token, n, c, &mn[r * d + c], &mx[r * d + c]);
      float m = 0.f;
      for (std::int32_t t = 0; t < n; ++t) {
        const float x = tw::key_norm_up(k0 + t * v.k_stride_token, d);
        m = m < x ? x : m;
      }
      norm[r] = m;
      amax[r] = tw::amax_norm_up(&mn[r * d], &mx[r * d], d);
    }
    count[pid] = n;
  }
};


}  // namespace

TEST_CASE("eps twin: round_up_f and the per-page summaries equal SketchStore's bit for bit", "[eps][twin]") {
  KVKIT_TEST_RNG(rng);
  std::uniform_real_distribution<double> ud(-1e6, 1e6);
  for (int i = 0; i < 20000; ++i) {
    const double x = ud(rng) * std::pow(10.0, static_cast<double>(rng() % 40) - 20);
    REQUIRE(same_bits(tw::round_up_f(x), sk::detail::round_up_float(x)));
  }
  for (int it = 0; it < 12; ++it) {
    const std::int32_t d = std::vector<std::int32_t>{13, 32, 64, 8}[it % 4], P = it % 3 == 0 ? 16 : 8, hkv = 2;
    std::vector<std::int32_t> lens;
    for (int b = 0; b < 3; ++b) lens.push_back(static_cast<std::int32_t>(rng() % 90));
    std::vector<float> q(static_cast<std::size_t>(lens.size()) * 4 * d, 0.5f);
    auto check = [&](auto pool) {
      using T = typename decltype(pool.view)::value_type;
      sk::SketchParams p;
      p.all_summaries = false;
      sk::SketchStore store(p, 1, hkv, d, P, pool.geometry.num_pages);
      store.sync(0, pool.view);
      HostSummaries hs(pool.geometry.num_pages, hkv, d);
      std::int32_t checked = 0;
      for (std::int32_t b = 0; b < pool.view.batch_size; ++b)
        for (std::int32_t j = 0; j < pool.view.num_pages(b); ++j) {
          const std::int32_t pid = pool.view.page_id(b, j);
          hs.update<T>(pool.view, pid, std::min(P, pool.view.seq_len(b) - j * P));
          const std::int32_t r = store.record_of(0, pid);
          REQUIRE(r >= 0);
          for (std::int32_t h = 0; h < hkv; ++h) {
            const std::int64_t row = hs.s.row(pid, h);
            REQUIRE(std::memcmp(&hs.mn[row * d], store.box_min(0, h) + static_cast<std::size_t>(r) * d, sizeof(float) * d) == 0);
            REQUIRE(std::memcmp(&hs.mx[row * d], store.box_max(0, h) + static_cast<std::size_t>(r) * d, sizeof(float) * d) == 0);
            REQUIRE(same_bits(hs.norm[row], store.max_norm(0, h)[r]));
            REQUIRE(same_bits(hs.amax[row], store.box_amax_norm(0, h)[r]));
            ++checked;
          }
        }
      CAPTURE(d, P);
      REQUIRE((checked > 0 || lens[0] + lens[1] + lens[2] == 0));
    };
    if (it % 2) check(kvkit::test::make_eps_pool<float>(lens, hkv, d, P, rng, q, 4));
    else check(kvkit::test::make_eps_pool<kvkit::half_t>(lens, hkv, d, P, rng, q, 4));
  }
}

TEST_CASE("eps twin: box_norm_bound equals detail::box_norm_bounds bit for bit", "[eps][twin]") {
  KVKIT_TEST_RNG(rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int32_t d : {5, 8, 13, 64, 128}) {
    const std::int32_t groups = 30, P = 6, G = 7;
    sk::SketchParams p;
    sk::SketchStore store(p, 1, 1, d, P, groups);
    std::vector<float> keys(static_cast<std::size_t>(P) * d);
    for (std::int32_t gi = 0; gi < groups; ++gi) {
      const float sc = std::exp(2 * nd(rng)), off = nd(rng);
      for (float& x : keys) x = off + sc * nd(rng);
      store.summarise_keys(0, gi, 0, keys.data(), P, d);
    }
    std::vector<float> q(static_cast<std::size_t>(G) * d);
    for (float& x : q) x = std::exp(nd(rng)) * nd(rng);
    std::vector<double> qn(G);
    for (std::int32_t g = 0; g < G; ++g) qn[g] = tw::qnorm_of(q.data() + g * d, d);
    std::vector<std::int32_t> recs;
    for (std::int32_t gi = 0; gi < groups; ++gi) recs.push_back(store.record_of(0, gi));
    std::vector<double> out(static_cast<std::size_t>(G) * groups);
    sk::detail::box_norm_bounds(store.box_min(0, 0), store.box_max(0, 0), store.max_norm(0, 0), store.box_amax_norm(0, 0),
                                recs.data(), groups, d, q.data(), qn.data(), G, out.data(), groups);
    std::int32_t norm_won = 0, box_won = 0;
    for (std::int32_t g = 0; g < G; ++g)
      for (std::int32_t i = 0; i < groups; ++i) {
        const std::size_t r = static_cast<std::size_t>(recs[i]);
        const double u = tw::box_norm_bound(store.box_min(0, 0) + r * d, store.box_max(0, 0) + r * d, d, q.data() + g * d,
                                            qn[g], store.box_amax_norm(0, 0)[r], store.max_norm(0, 0)[r]);
        CAPTURE(d, g, i, u, out[g * groups + i]);
        REQUIRE(same_bits(u, out[g * groups + i]));
        (u == qn[g] * store.max_norm(0, 0)[r] * (1 + 1e-12) ? norm_won : box_won)++;
      }
    REQUIRE(box_won > 0);
  }
}

TEST_CASE("eps twin: the kernel's bitonic sort gives rank_of's order (ties by position)", "[eps][twin]") {
  KVKIT_TEST_RNG(rng);
  for (int it = 0; it < 400; ++it) {
    const std::int32_t n = static_cast<std::int32_t>(rng() % 300);
    const int levels = 1 + static_cast<int>(rng() % 5);
    std::vector<double> ub(static_cast<std::size_t>(n));
    for (double& x : ub) x = rng() % 3 == 0 ? static_cast<double>(rng() % levels) : static_cast<double>(rng() % 1000) / 7.0;
    const std::int32_t n2 = tw::pow2_at_least(n);
    REQUIRE(n2 >= n);
    REQUIRE((n2 & (n2 - 1)) == 0);
    std::vector<std::int32_t> ord(static_cast<std::size_t>(n2));
    for (std::int32_t i = 0; i < n2; ++i) ord[i] = i < n ? i : -1;
    std::shuffle(ord.begin(), ord.end(), rng);  // the network sorts any start order
    std::vector<double> key(static_cast<std::size_t>(n2));
    for (std::int32_t i = 0; i < n2; ++i) key[i] = ord[i] >= 0 ? ub[ord[i]] : -HUGE_VAL;
    for (std::int32_t k = 2; k <= n2; k <<= 1)
      for (std::int32_t j = k >> 1; j > 0; j >>= 1)
        for (std::int32_t p = n2 / 2 - 1; p >= 0; --p) tw::bitonic_pair_step(key.data(), ord.data(), k, j, p);
    CAPTURE(it, n, levels);
    for (std::int32_t i = 0; i < n; ++i) REQUIRE(ord[tw::rank_of(ub.data(), n, i)] == i);
    for (std::int32_t r = n; r < n2; ++r) REQUIRE(ord[r] == -1);
    for (std::int32_t r = 0; r < n; ++r) REQUIRE(key[r] == ub[ord[r]]);  // keys moved with their candidates
  }
}

TEST_CASE("eps twin: rank_key orders bounds as rank_before, and a RankCut keeps a prefix of that order", "[eps][twin]") {
  KVKIT_TEST_RNG(rng);
  const double specials[] = {0.0, -0.0, HUGE_VAL, -HUGE_VAL, 1e-310, -1e-310, 1.0, -1.0, 0x1p-1074, -0x1p-1074};
  for (int it = 0; it < 200; ++it) {
    const std::int32_t n = 1 + static_cast<std::int32_t>(rng() % 200);
    std::vector<double> ub(static_cast<std::size_t>(n));
    for (double& x : ub) {
      const int kind = static_cast<int>(rng() % 4);
      x = kind == 0 ? specials[rng() % 10]
                    : kind == 1 ? static_cast<double>(rng() % 5) - 2.0  // many ties
                                : std::ldexp(static_cast<double>(rng() % 100000) - 50000.0, static_cast<int>(rng() % 80) - 40);
    }
    // Every ordered pair; Catch is told only of the first disagreement (a REQUIRE per pair
    // would cost more than the comparisons).
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t j = 0; j < n; ++j) {
        const std::uint64_t ki = tw::rank_key(ub[i]), kj = tw::rank_key(ub[j]);
        if (tw::rank_before(ub[i], i, ub[j], j) != (ki < kj || (ki == kj && i < j))) {
          CAPTURE(ub[i], ub[j], i, j, ki, kj);
          FAIL("rank_before disagrees with the rank_key order");
        }
      }
    // The cut at every full key and position takes exactly the ranks before it.
    const std::int32_t k = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n));
    std::int32_t at = -1;
    for (std::int32_t i = 0; i < n; ++i)
      if (tw::rank_of(ub.data(), n, i) == k) at = i;
    tw::RankCut cut;
    cut.mask = ~0ull;
    cut.prefix = tw::rank_key(ub[at]);
    cut.tie_pos = at;
    for (std::int32_t i = 0; i < n; ++i)
      if (cut.has(tw::rank_key(ub[i]), i) != (tw::rank_of(ub.data(), n, i) <= k)) {
        CAPTURE(n, k, at, i, ub[i]);
        FAIL("the RankCut at rank k disagrees with rank_of");
      }

  }
}

TEST_CASE("eps twin: the twin walk takes certified_walk's decisions", "[eps][twin]") {
  KVKIT_TEST_RNG(rng);
  std::int64_t early = 0, at_lim = 0, capped = 0, reach_cut = 0;
  for (int it = 0; it < 3000; ++it) {
    const kvkit::test::WalkCase wc = kvkit::test::make_walk_case(rng, it % 10 == 0 ? 2000 : 150);
    const std::int32_t n = wc.n, levels = wc.levels, lim = wc.lim;
    const double spread = wc.spread, s0 = wc.s0, eps = wc.eps;
    const std::vector<double>& ub = wc.ub;
    const std::vector<double>& mass = wc.mass;
    const std::vector<sk::detail::Mass128>& w = wc.w;
    const sk::detail::Mass128 W = wc.W;
    std::vector<std::int32_t> ord(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n));
    // The cap on scored ranks: none in a third of the cases, else anything up to n.
    const std::int32_t budget = it % 3 == 0 ? 0 : 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n));
    const sk::detail::WalkResult want = sk::detail::certified_walk(
        ub.data(), w.data(), W, n, s0, eps, lim, budget, ord.data(), out.data(), [&](std::int32_t i) { return mass[i]; });
    REQUIRE((budget == 0 || want.scored <= budget));
    {  // how often the cap changes the outcome (the test is not vacuous)
      std::vector<std::int32_t> ord2(ord.size()), out2(out.size());
      const sk::detail::WalkResult free = sk::detail::certified_walk(
          ub.data(), w.data(), W, n, s0, eps, lim, 0, ord2.data(), out2.data(), [&](std::int32_t i) { return mass[i]; });
      capped += free.visited != want.visited;
    }
    // Twin: ranks by rank_of, tails in rank order, masses by rank, scored in chunks of 7.
    std::vector<std::int32_t> by_rank(static_cast<std::size_t>(n));
    for (std::int32_t i = 0; i < n; ++i) by_rank[tw::rank_of(ub.data(), n, i)] = i;
    std::vector<sk::detail::Mass128> tail(static_cast<std::size_t>(n) + 1);
    for (std::int32_t r = n - 1; r >= 0; --r) {
      tail[r] = tail[r + 1];
      tail[r].add(w[by_rank[r]]);
    }
    std::vector<double> m(static_cast<std::size_t>(n), -1.0);
    std::int32_t next = 0;
    const std::int32_t lim_c = std::min(std::max(lim, 0), n);
    const tw::WalkOut got = tw::walk(tail.data(), n, lim, s0, eps, budget, m.data(), 7, n, tail[lim_c],
                                     [&](std::int32_t r0, std::int32_t r1) {
      REQUIRE(r0 == next);  // increasing, disjoint ranges
      REQUIRE(r1 > r0);
      for (std::int32_t r = r0; r < r1; ++r) m[r] = mass[by_rank[r]];
      next = r1;
    });
    CAPTURE(it, n, levels, spread, s0, eps, lim, budget, want.visited, got.visited);
    REQUIRE(got.visited == want.visited);
    REQUIRE(same_bits(got.omitted, want.omitted));
    {  // the device's way: only the top walk_reach ranks sorted, the tails past them unknown
      const std::int32_t known = tw::walk_reach(lim_c, budget);
      std::vector<sk::detail::Mass128> part(tail.begin(), tail.begin() + known + 1);
      std::vector<double> m2(static_cast<std::size_t>(n), -1.0);
      std::int32_t next2 = 0;
      const tw::WalkOut got2 = tw::walk(part.data(), n, lim, s0, eps, budget, m2.data(), 7, known, tail[lim_c],
                                        [&](std::int32_t r0, std::int32_t r1) {
        REQUIRE(r0 == next2);
        REQUIRE(r1 <= known);  // never scores a rank it did not sort
        for (std::int32_t r = r0; r < r1; ++r) m2[r] = mass[by_rank[r]];
        next2 = r1;
      });
      REQUIRE(got2.visited == got.visited);
      REQUIRE(same_bits(got2.omitted, got.omitted));
      REQUIRE((got2.visited <= known || got2.visited == lim_c));  // past the sorted ranks only as the set [0, lim)
      reach_cut += known < lim_c;
    }
    REQUIRE((budget == 0 || next <= budget));  // no rank scored past the cap, chunks included
    std::vector<std::int32_t> a(out.begin(), out.begin() + want.visited), b(by_rank.begin(), by_rank.begin() + got.visited);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    REQUIRE(a == b);
    early += want.visited < lim;
    at_lim += want.visited == lim;
  }
  REQUIRE(early > 100);  // the ε rule stopped early in many cases
  REQUIRE(at_lim > 10);
  REQUIRE(capped > 50);  // ... and the scoring cap often visited more
  REQUIRE(reach_cut > 100);  // ... and often left ranks unsorted
}

namespace {

template <class T>
void prepass_case(std::mt19937_64& rng, std::int64_t& pruned, std::int64_t& total, std::int64_t& needles) {
  kvkit::test::EpsCaseOptions o;
  o.seq_len = [](std::mt19937_64& r) { return static_cast<std::int32_t>(r() % 700); };
  const kvkit::test::EpsCase<T> c = kvkit::test::make_eps_case<T>(rng, o);
  REQUIRE(c.cpu.is_ok());
  const RandomPool<T>& pool = *c.pool;
  const sk::SketchSelector& sel = *c.sel;
  const sk::SketchParams& p = c.p;
  const std::vector<float>& q = c.qf;
  const std::vector<T>& qt = c.q;
  const std::int32_t hkv = c.hkv, grp = c.grp, hq = c.hq, d = c.d, P = c.P, batch = c.batch;
  const std::int32_t max_groups = c.max_groups;
  const std::vector<std::int32_t>& lens = c.lens;
  const float sm_scale = c.sm_scale;

  HostSummaries hs(pool.geometry.num_pages, hkv, d);
  std::vector<std::int32_t> upd, ntok;
  kvkit::test::summarised_pages(c, &upd, &ntok);
  for (std::size_t i = 0; i < upd.size(); ++i) hs.update<T>(pool.view, upd[i], ntok[i]);
  tw::PrepassArgs a;
  a.eps = p.eps;
  a.last_n = p.last_n;
  a.top_pages = p.top_pages;
  a.score_budget = p.score_budget;
  a.score_fraction = p.score_fraction;
  a.head_mask = p.head_on.empty() ? ~0ull : ((p.head_on[0] ? 1ull : 0ull) | (p.head_on[1] ? 2ull : 0ull));
  a.scale = sm_scale;
  a.log_full = std::log(static_cast<double>(P));
  std::vector<std::int32_t> indptr, subset;
  std::vector<double> omitted;
  tw::prepass_host(pool.view, qt.data(), hq, hs.s, a, indptr, subset, omitted);

  CAPTURE(batch, hq, d, P, p.eps, p.last_n, p.top_pages, max_groups, lens);
  REQUIRE(indptr.size() == static_cast<std::size_t>(batch) * hkv + 1);
  for (std::size_t i = 0; i < indptr.size(); ++i) REQUIRE(indptr[i] == sel.indptr()[i]);
  for (std::int32_t i = 0; i < indptr.back(); ++i) REQUIRE(subset[i] == sel.subset()[i]);
  for (std::int32_t b = 0; b < batch; ++b)
    for (std::int32_t h = 0; h < hq; ++h) {
      CAPTURE(b, h, omitted[b * hq + h], sel.omitted_bound(b, h));
      REQUIRE(same_bits(omitted[static_cast<std::size_t>(b) * hq + h], sel.omitted_bound(b, h)));
    }
  // Needle pages (a key 2.5 q) whose needle holds softmax weight > ε are visited in strict
  // mode when no cap cuts.
  if (p.top_pages == 0)
    for (std::int32_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h < hkv; ++h) {
        const float* qq = q.data() + (static_cast<std::size_t>(b) * hq + h * grp) * d;
        for (std::int32_t t = 0; t < pool.view.seq_len(b); ++t) {
          const T* k = pool.view.k_ptr(b, t, h);
          bool needle = true;
          for (std::int32_t c = 0; c < d && needle; ++c)
            needle = kvkit::to_float(k[c]) == kvkit::to_float(kvkit::from_float<T>(2.5f * qq[c]));
          if (!needle) continue;
          // Its true softmax weight (float64) for query head h*grp.
          double mx = -1e300;
          std::vector<double> lg(static_cast<std::size_t>(pool.view.seq_len(b)));
          for (std::int32_t u = 0; u < pool.view.seq_len(b); ++u) {
            const T* ku = pool.view.k_ptr(b, u, h);
            double x = 0;
            for (std::int32_t c = 0; c < d; ++c) x += double(qq[c]) * kvkit::to_float(ku[c]);
            lg[u] = x * sm_scale;
            mx = std::max(mx, lg[u]);
          }
          double z = 0;
          for (double x : lg) z += std::exp(x - mx);
          const double weight = std::exp(lg[t] - mx) / z;
          if (weight <= p.eps) continue;
          ++needles;
          const std::int32_t pg = t / P;
          const std::int32_t* s0 = subset.data() + indptr[static_cast<std::size_t>(b) * hkv + h];
          const std::int32_t* s1 = subset.data() + indptr[static_cast<std::size_t>(b) * hkv + h + 1];
          CAPTURE(b, h, t, weight);
          REQUIRE(std::binary_search(s0, s1, pg));
        }
      }
  std::int64_t all = 0;
  for (std::int32_t b = 0; b < batch; ++b) all += static_cast<std::int64_t>(pool.view.num_pages(b)) * hkv;
  total += all;
  pruned += all - indptr.back();
}

}  // namespace

TEST_CASE("eps twin: the pre-pass in the kernels' schedule equals SketchSelector exactly", "[eps][twin]") {
  KVKIT_TEST_RNG(rng);
  std::int64_t pruned = 0, total = 0, needles = 0;
  for (int it = 0; it < 60; ++it) {
    if (it % 2)
      prepass_case<float>(rng, pruned, total, needles);
    else
      prepass_case<kvkit::half_t>(rng, pruned, total, needles);
  }
  INFO("pages skipped " << pruned << " of " << total << ", needles " << needles);
  REQUIRE(pruned > total / 20);  // the comparison covered real pruning, not all-visited sets
  REQUIRE(needles > 0);
}
