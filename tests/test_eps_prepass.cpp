// Sketcher pre-pass internals (sketch/eps.hpp): the batched box/norm bounds equal
// group_bounds bit for bit and bound the float64 formula within their derived slack; the
// partial-selection ε walk returns exactly what a straightforward full sort of the same
// rule returns (random bounds with many ties, random caps, scoring budgets); select()
// allocates nothing; a store keeping only its method's summaries selects exactly the
// pages the full store selects, with fewer bytes.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <numeric>
#include <random>
#include <vector>

#include "eps_cases.hpp"
#include "kvkit/sketch/eps.hpp"
#include "reference.hpp"
#include "test_scale.hpp"


namespace {
std::atomic<long> g_allocs{0};
}  // namespace

#ifndef KVKIT_TEST_SANITIZED
// Counts every allocation of this test program (select() must make none). Not under ASan,
// whose own operator new allocates objects our delete would then free. GCC pairs the
// inlined std::allocator calls with these bodies and warns about malloc/free vs
// new/delete, which is what they are meant to be.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace sk = kvkit::sketch;
using kvkit::test::PoolSpec;
using kvkit::test::RandomPool;

namespace {

// Two sequences of `lens` tokens, 2 kv heads of 32 dims, pages of 8, each page's keys
// scaled by its own log-normal factor, so bounds differ and prune.
RandomPool<float> scaled_pool(std::vector<std::int32_t> lens, std::mt19937_64& rng) {
  PoolSpec spec;
  spec.num_kv_heads = 2;
  spec.head_dim = 32;
  spec.page_size = 8;
  spec.seq_lens = std::move(lens);
  RandomPool<float> pool(spec, rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int32_t b = 0; b < pool.view.batch_size; ++b)
    for (std::int32_t pg = 0; pg < pool.view.num_pages(b); ++pg) {
      const float sc = std::exp(nd(rng));
      for (std::int32_t t = pg * 8; t < std::min(pool.view.seq_len(b), pg * 8 + 8); ++t)
        for (std::int32_t h = 0; h < 2; ++h)
          for (std::int32_t c = 0; c < 32; ++c) pool.view.k_ptr(b, t, h)[c] *= sc;
    }
  return pool;
}

// The rule of detail::certified_walk, written the plain way: full sort, then a linear walk.
sk::detail::WalkResult reference_walk(const std::vector<double>& ub, double s0, double eps, std::int32_t lim,
                                      std::int32_t budget, const std::vector<double>& mass,
                                      std::vector<std::int32_t>& out) {
  using sk::detail::Mass128;
  const std::int32_t n = static_cast<std::int32_t>(ub.size());
  lim = std::max<std::int32_t>(0, std::min(lim, n));
  std::vector<std::int32_t> ord(static_cast<std::size_t>(n));
  std::iota(ord.begin(), ord.end(), 0);
  std::sort(ord.begin(), ord.end(), [&](std::int32_t a, std::int32_t b) { return ub[a] > ub[b] || (ub[a] == ub[b] && a < b); });
  double ref = -1e300;
  for (double u : ub) ref = std::max(ref, u);
  std::vector<Mass128> w(static_cast<std::size_t>(n));
  Mass128 W;
  for (std::int32_t i = 0; i < n; ++i) {
    w[i] = sk::detail::quantise_mass(ub[i] - ref);
    W.add(w[i]);
  }
  std::vector<Mass128> tail(static_cast<std::size_t>(n) + 1);  // tail[i] = Σ w over ranks >= i
  for (std::int32_t i = n - 1; i >= 0; --i) {
    tail[i] = tail[i + 1];
    tail[i].add(w[ord[i]]);
  }
  const double f = 1 + (4.0 * n + 64) * 0x1p-53;
  auto bound = [&](const Mass128& t) { return sk::detail::tail_bound(t); };
  std::int32_t i0 = 0;
  for (; i0 < lim; ++i0) {
    Mass128 seen = W;
    seen.sub(tail[i0]);
    if (bound(tail[i0]) <= eps * f * (s0 + seen.value())) break;
  }
  sk::detail::WalkResult r;
  double S = s0;
  out.clear();
  std::int32_t i = 0;
  if (i0 == lim) {
    for (; i < lim; ++i) out.push_back(ord[i]);
  } else {
    for (; i < lim; ++i) {
      if (i >= i0 && bound(tail[i]) <= eps * S) break;
      if (budget > 0 && r.scored + 1 > budget) {  // the rest up to lim unscored
        for (; i < lim; ++i) out.push_back(ord[i]);
        break;
      }
      out.push_back(ord[i]);
      S += mass[ord[i]];
      ++r.scored;
    }
  }
  r.visited = i;
  const double t = bound(tail[i]);
  r.omitted = t > 0 ? t / (t + S) : 0.0;
  return r;
}

}  // namespace

TEST_CASE("eps prepass: batched box/norm bounds equal group_bounds and bound the float64 formula", "[eps]") {
  KVKIT_TEST_RNG(rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int32_t d : {8, 13, 64, 128}) {
    const std::int32_t groups = 40, P = 4, G = 7;  // G = 7: blocks of 4, 2 and 1 queries
    sk::SketchParams p;
    sk::SketchStore store(p, 2, 2, d, P, groups);
    std::vector<float> keys(static_cast<std::size_t>(P) * d);
    for (std::int32_t gi = 0; gi < groups; ++gi)
      for (std::int32_t h = 0; h < 2; ++h) {
        const float sc = std::exp(nd(rng)), off = nd(rng);
        for (float& x : keys) x = off + sc * nd(rng);
        store.summarise_keys(1, gi, h, keys.data(), P, d);
      }
    std::vector<float> q(static_cast<std::size_t>(G) * d);
    for (float& x : q) x = 3.f * nd(rng);
    std::vector<double> qn(static_cast<std::size_t>(G));
    for (std::int32_t g = 0; g < G; ++g) {
      double s = 0;
      for (std::int32_t c = 0; c < d; ++c) s += double(q[g * d + c]) * q[g * d + c];
      qn[g] = std::sqrt(s);
    }
    std::vector<std::int32_t> recs;
    for (std::int32_t gi = groups - 1; gi >= 0; gi -= 2) recs.push_back(store.record_of(1, gi));  // any order
    const std::int32_t n = static_cast<std::int32_t>(recs.size());
    for (std::int32_t h = 0; h < 2; ++h) {
      std::vector<double> out(static_cast<std::size_t>(G) * n);
      sk::detail::box_norm_bounds(store.box_min(1, h), store.box_max(1, h), store.max_norm(1, h),
                                  store.box_amax_norm(1, h), recs.data(), n, d,
                                  q.data(), qn.data(), G, out.data(), n);
      for (std::int32_t g = 0; g < G; ++g)
        for (std::int32_t i = 0; i < n; ++i) {
          const sk::GroupBounds gb = sk::group_bounds(store, 1, recs[i], h, q.data() + g * d, qn[g], nullptr, 0);
          REQUIRE(out[g * n + i] == std::min(gb.box_hi, gb.norm));  // bit for bit
          // float64 box formula: box_hi within [exact, exact + 2·slack·‖q‖·‖a‖] (a: the
          // per-channel max |min|, |max|; box_slack's Cauchy–Schwarz form).
          const float* mn = store.box_min(1, h) + static_cast<std::size_t>(recs[i]) * d;
          const float* mx = store.box_max(1, h) + static_cast<std::size_t>(recs[i]) * d;
          double ex = 0, an = 0;
          for (std::int32_t c = 0; c < d; ++c) {
            const double a = double(q[g * d + c]) * mn[c], b = double(q[g * d + c]) * mx[c];
            ex += std::max(a, b);
            an += std::max(double(mn[c]) * mn[c], double(mx[c]) * mx[c]);
          }
          const double mag = qn[g] * std::sqrt(an);
          CAPTURE(d, g, i, ex, mag, gb.box_hi);
          REQUIRE(gb.box_hi >= ex);
          REQUIRE(gb.box_hi <= ex + 2 * sk::detail::float_sum_slack(d) * mag * (1 + 1e-6));
        }
    }
  }
}

TEST_CASE("eps prepass: the partial-selection walk equals a full-sort walk (ties, caps, budgets)", "[eps]") {
  KVKIT_TEST_RNG(rng);
  std::int64_t cases = 0, stopped_early = 0, scored_total = 0;
  for (int it = 0; it < 3000; ++it) {
    const kvkit::test::WalkCase wc = kvkit::test::make_walk_case(rng, it % 10 == 0 ? 3000 : 200);
    const std::int32_t n = wc.n, levels = wc.levels, lim = wc.lim;
    const double spread = wc.spread, s0 = wc.s0, eps = wc.eps;
    const std::vector<double>& ub = wc.ub;
    const std::vector<double>& mass = wc.mass;
    const std::int32_t budget = rng() % 4 == 0 ? static_cast<std::int32_t>(rng() % 20) : 0;
    std::vector<std::int32_t> want;
    const sk::detail::WalkResult rr = reference_walk(ub, s0, eps, lim, budget, mass, want);
    const std::vector<sk::detail::Mass128>& w = wc.w;
    const sk::detail::Mass128 W = wc.W;
    std::vector<std::int32_t> ord(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n), -1);
    std::int64_t calls = 0;
    const sk::detail::WalkResult r = sk::detail::certified_walk(ub.data(), w.data(), W, n, s0, eps, lim, budget, ord.data(),
                                                                out.data(), [&](std::int32_t i) {
                                                                  ++calls;
                                                                  return mass[i];
                                                                });
    CAPTURE(it, n, levels, spread, s0, eps, lim, budget, rr.visited, r.visited, rr.scored, r.scored);
    REQUIRE(r.visited == rr.visited);
    // Scored ranks in rank order (S, hence the bound, depends on it), then the same set.
    REQUIRE(std::equal(want.begin(), want.begin() + r.scored, out.begin()));
    std::vector<std::int32_t> ws(want), os(out.begin(), out.begin() + r.visited);
    std::sort(ws.begin(), ws.end());
    std::sort(os.begin(), os.end());
    REQUIRE(ws == os);
    if (budget == 0) {
      REQUIRE(r.omitted == rr.omitted);
    } else {  // a budget may stop scoring a block earlier: less S, a larger (still certified) bound
      REQUIRE(r.omitted >= rr.omitted);
    }
    REQUIRE(r.scored == calls);
    REQUIRE(r.scored <= rr.scored);  // scoring skipped only where it decides nothing
    ++cases;
    stopped_early += rr.visited < lim ? 1 : 0;
    scored_total += r.scored;
  }
  WARN(cases << " walks, " << stopped_early << " stopped before the cap, " << scored_total << " groups scored");
  REQUIRE(stopped_early > cases / 10);  // not vacuous: the rule does stop
}

TEST_CASE("eps prepass: a score budget or fraction visits a superset and keeps the bound certified; select() never allocates",
          "[eps]") {
  KVKIT_TEST_RNG(rng);
  RandomPool<float> pool = scaled_pool({1500, 700}, rng);
  const std::int32_t Hq = 6, d = 32;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<std::size_t>(2 * Hq * d));
#ifdef KVKIT_TEST_SANITIZED
  WARN("sanitizer build: allocation counting is off (ASan owns operator new); the Release build checks it");
#endif
  for (int round = 0; round < 20; ++round) {
    for (float& x : q) x = 2.f * nd(rng);
    for (sk::SketchMethod m : {sk::SketchMethod::kBox, sk::SketchMethod::kFD, sk::SketchMethod::kRotBox}) {
      sk::SketchParams p;
      p.method = m;
      p.eps = 1e-2;
      p.group_pages = 1 + round % 2;
      p.score_fraction = 1;  // the plain ε rule
      sk::SketchStore store(p, 1, 2, d, 8, pool.geometry.num_pages);
      store.sync(0, pool.view);
      sk::SketchSelector exact(store);
      exact.reserve(2, Hq, 200);
      sk::SketchTelemetry te, tb;
      const long a0 = g_allocs.load();
      REQUIRE(exact.select(0, pool.view, q.data(), Hq, 0.3f, &te).is_ok());
      REQUIRE(g_allocs.load() == a0);  // no allocation on the decode path
      sk::SketchParams pb = p;
      if (round % 2 == 0)
        pb.score_budget = 1 + round % 3;
      else
        pb.score_fraction = 0.05 * (round % 5 + 1);
      sk::SketchStore store_b(pb, 1, 2, d, 8, pool.geometry.num_pages);
      store_b.sync(0, pool.view);
      sk::SketchSelector budget(store_b);
      budget.reserve(2, Hq, 200);
      const long a1 = g_allocs.load();
      REQUIRE(budget.select(0, pool.view, q.data(), Hq, 0.3f, &tb).is_ok());
      REQUIRE(g_allocs.load() == a1);
      REQUIRE(tb.groups_scored <= te.groups_scored);
      // Superset, per (row, kv head).
      for (std::int32_t i = 0; i < 4; ++i) {
        std::vector<std::int32_t> e(exact.subset() + exact.indptr()[i], exact.subset() + exact.indptr()[i + 1]);
        std::vector<std::int32_t> s(budget.subset() + budget.indptr()[i], budget.subset() + budget.indptr()[i + 1]);
        REQUIRE(std::includes(s.begin(), s.end(), e.begin(), e.end()));
      }
      // Certified: omitted bound >= the true omitted fraction (float64).
      for (std::int32_t b = 0; b < 2; ++b)
        for (std::int32_t hq = 0; hq < Hq; ++hq) {
          const std::int32_t h = hq / 3, L = pool.view.seq_len(b);
          std::vector<char> vis(static_cast<std::size_t>(pool.view.num_pages(b)), 0);
          for (std::int32_t i = budget.indptr()[b * 2 + h]; i < budget.indptr()[b * 2 + h + 1]; ++i) vis[budget.subset()[i]] = 1;
          std::vector<double> lg(static_cast<std::size_t>(L));
          double mx = -1e300;
          for (std::int32_t t = 0; t < L; ++t) {
            double s = 0;
            for (std::int32_t c = 0; c < d; ++c) s += double(q[(b * Hq + hq) * d + c]) * pool.view.k_ptr(b, t, h)[c];
            lg[t] = 0.3 * s;
            mx = std::max(mx, lg[t]);
          }
          double z = 0, om = 0;
          for (std::int32_t t = 0; t < L; ++t) {
            const double e = std::exp(lg[t] - mx);
            z += e;
            if (!vis[t / 8]) om += e;
          }
          REQUIRE(om / z <= budget.omitted_bound(b, hq) * (1 + 1e-9) + 1e-15);
        }
    }
  }
}

TEST_CASE("eps prepass: a store keeping only its method's summaries selects the same pages with fewer bytes",
          "[eps]") {
  KVKIT_TEST_RNG(rng);
  RandomPool<float> pool = scaled_pool({900, 333}, rng);
  const std::int32_t Hq = 6, d = 32;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<std::size_t>(2 * Hq * d));
  const sk::SketchMethod methods[] = {sk::SketchMethod::kBox, sk::SketchMethod::kJL, sk::SketchMethod::kOnePC,
                                      sk::SketchMethod::kFD, sk::SketchMethod::kRotBox};
  for (sk::SketchMethod m : methods)
    for (bool strict : {true, false}) {
      CAPTURE(sk::to_string(m), strict);
      sk::SketchParams all;
      all.method = m;
      all.strict = strict;
      all.eps = 5e-2;
      sk::SketchParams lean = all;
      lean.all_summaries = false;
      sk::SketchStore sa(all, 1, 2, d, 8, pool.geometry.num_pages), sl(lean, 1, 2, d, 8, pool.geometry.num_pages);
      sa.sync(0, pool.view);
      sl.sync(0, pool.view);
      // Bytes: the lean store counts only its parts, and holds only those floats.
      const sk::SummaryParts kept = sl.parts();
      CHECK(kept.jl == (m == sk::SketchMethod::kJL));
      CHECK(kept.fd == (m == sk::SketchMethod::kFD || m == sk::SketchMethod::kOnePC));
      CHECK(kept.one_pc == (m == sk::SketchMethod::kOnePC));
      const sk::SummaryBytes sb = sk::summary_bytes(lean, d);
      if (m == sk::SketchMethod::kBox) CHECK(sb.total() == 8 * d + 12);
      CHECK(sl.memory_bytes() < sa.memory_bytes());
      CHECK(sl.layout().floats < sa.layout().floats);
      sk::SketchSelector xa(sa), xl(sl);
      xa.reserve(2, Hq, 200);
      xl.reserve(2, Hq, 200);
      for (int round = 0; round < 6; ++round) {
        for (float& x : q) x = 2.f * nd(rng);
        sk::SketchTelemetry ta, tl;
        REQUIRE(xa.select(0, pool.view, q.data(), Hq, 0.3f, &ta).is_ok());
        REQUIRE(xl.select(0, pool.view, q.data(), Hq, 0.3f, &tl).is_ok());
        REQUIRE(ta.pages_visited == tl.pages_visited);
        for (std::int32_t i = 0; i <= 4; ++i) REQUIRE(xa.indptr()[i] == xl.indptr()[i]);
        for (std::int32_t i = 0; i < xa.indptr()[4]; ++i) REQUIRE(xa.subset()[i] == xl.subset()[i]);
        for (std::int32_t b = 0; b < 2; ++b)
          for (std::int32_t hq = 0; hq < Hq; ++hq) REQUIRE(xa.omitted_bound(b, hq) == xl.omitted_bound(b, hq));
      }
    }
}
