// Sketcher / EPS (sketch/eps.hpp): parameter errors, the JL quadratic-form estimate, the
// soundness of strict mode (certified omitted mass >= true omitted mass, no skipped token
// above ε) over >= 1e6 random (query, page) pairs with float and half keys, planted
// needles, summaries following page events, and page-subset attention against a float64
// reference.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvkit/core/dtype.hpp"
#include "kvkit/kernels/cpu.hpp"
#include "kvkit/sketch/eps.hpp"
#include "reference.hpp"
#include "test_scale.hpp"

namespace sk = kvkit::sketch;
using kvkit::half_t;
using kvkit::test::PoolSpec;
using kvkit::test::RandomPool;

namespace {

using kvkit::test::kSanitized;

template <class T>
double dotd(const T* a, const float* q, int d) {
  double s = 0;
  for (int c = 0; c < d; ++c) s += static_cast<double>(kvkit::to_float(a[c])) * q[c];
  return s;
}

// Keys with a per-page scale and a per-page mean direction (pages differ, as real pages
// do), rewritten in place into pool.k.
template <class T>
void structure_keys(RandomPool<T>& pool, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f), sc(0.1f, 2.f);
  const auto& g = pool.geometry;
  std::vector<float> mean(static_cast<std::size_t>(g.head_dim));
  for (std::int32_t p = 0; p < g.num_pages; ++p)
    for (std::int32_t h = 0; h < g.num_kv_heads; ++h) {
      const float s = sc(rng), ms = sc(rng);
      for (float& x : mean) x = u(rng) * ms;
      for (std::int32_t t = 0; t < g.page_size; ++t)
        for (std::int32_t c = 0; c < g.head_dim; ++c)
          pool.k[pool.index(p, t, h, c)] = kvkit::from_float<T>(mean[static_cast<std::size_t>(c)] + s * u(rng));
    }
}

struct PropertyCounts {
  std::int64_t pairs = 0, visited = 0, total = 0, checks = 0;
};

// One random pool, many queries: strict select, then for every (row, query head) the
// float64 softmax over all tokens: omitted mass <= certified bound, no skipped token
// above eps, certified bound <= eps (no cap).
template <class T>
void property_round(std::mt19937_64& rng, sk::SketchMethod method, double eps, std::int32_t group,
                    std::int32_t queries, PropertyCounts& cnt, std::int32_t code_bits = 4) {
  PoolSpec spec;
  spec.num_kv_heads = 2;
  spec.head_dim = 32;
  spec.page_size = 8;
  std::uniform_int_distribution<std::int32_t> len(1, 4000);
  spec.seq_lens = {len(rng), len(rng), 3000};
  RandomPool<T> pool(spec, rng);
  structure_keys(pool, rng);
  const std::int32_t Hq = 4, d = spec.head_dim;
  sk::SketchParams p;
  p.method = method;
  p.strict = true;
  p.eps = eps;
  p.group_pages = group;
  p.last_n = 1;
  p.score_fraction = 1;  // the plain ε rule: its skips are what is checked
  p.code_bits = code_bits;
  sk::SketchStore store(p, 1, spec.num_kv_heads, d, spec.page_size, pool.geometry.num_pages);
  store.sync(0, pool.view);
  sk::SketchSelector sel(store);
  std::int32_t max_pages = 0;
  for (auto l : spec.seq_lens) max_pages = std::max(max_pages, (l + spec.page_size - 1) / spec.page_size);
  sel.reserve(3, Hq, max_pages);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::uniform_real_distribution<float> u(-1.f, 1.f), mag(0.5f, 12.f);
  std::vector<T> q(static_cast<std::size_t>(3 * Hq * d));
  std::vector<double> logit;
  for (std::int32_t it = 0; it < queries; ++it) {
    for (std::int32_t i = 0; i < 3 * Hq; ++i) {
      const float m = mag(rng);
      const bool aligned = (rng() & 3) == 0;  // a query pointing at one random key
      const std::int32_t b = i / Hq, h = (i % Hq) / 2;
      const std::int32_t tk = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(spec.seq_lens[b]));
      const T* kk = pool.view.k_ptr(b, tk, h);
      for (std::int32_t c = 0; c < d; ++c)
        q[static_cast<std::size_t>(i) * d + c] =
            kvkit::from_float<T>(aligned ? m * 0.5f * kvkit::to_float(kk[c]) + 0.2f * u(rng) : m * u(rng) / 2.f);
    }
    sk::SketchTelemetry tel;
    REQUIRE(sel.select(0, pool.view, q.data(), Hq, scale, &tel).is_ok());
    cnt.visited += tel.pages_visited;
    cnt.total += tel.pages_total;
    for (std::int32_t b = 0; b < 3; ++b) {
      const std::int32_t L = pool.view.seq_len(b), np = pool.view.num_pages(b);
      for (std::int32_t hq = 0; hq < Hq; ++hq) {
        const std::int32_t h = hq / 2;
        std::vector<char> vis(static_cast<std::size_t>(np), 0);
        for (std::int32_t i = sel.indptr()[b * 2 + h]; i < sel.indptr()[b * 2 + h + 1]; ++i) vis[sel.subset()[i]] = 1;
        std::vector<float> qf(static_cast<std::size_t>(d));
        for (std::int32_t c = 0; c < d; ++c) qf[c] = kvkit::to_float(q[(static_cast<std::size_t>(b) * Hq + hq) * d + c]);
        logit.assign(static_cast<std::size_t>(L), 0);
        double mx = -1e300;
        for (std::int32_t t = 0; t < L; ++t) {
          logit[t] = scale * dotd(pool.view.k_ptr(b, t, h), qf.data(), d);
          mx = std::max(mx, logit[t]);
        }
        double z = 0, om = 0, worst = 0;
        for (std::int32_t t = 0; t < L; ++t) z += std::exp(logit[t] - mx);
        for (std::int32_t t = 0; t < L; ++t) {
          if (vis[t / spec.page_size]) continue;
          const double w = std::exp(logit[t] - mx) / z;
          om += w;
          worst = std::max(worst, w);
        }
        const double cert = sel.omitted_bound(b, hq);
        cnt.pairs += np;
        ++cnt.checks;
        if (!(om <= cert * (1 + 1e-9) + 1e-15) || !(worst <= eps) || !(cert <= eps * (1 + 1e-9))) {
          CAPTURE(b, hq, om, cert, worst, eps, group, sk::to_string(method), code_bits);
          REQUIRE(om <= cert * (1 + 1e-9) + 1e-15);
          REQUIRE(worst <= eps);
          REQUIRE(cert <= eps * (1 + 1e-9));
        }
      }
    }
  }
}

// The pool of the page-event tests: 2 kv heads of 16, pages of 4, sequences of 37 and 20
// tokens (sequence 0's last group, with groups of 2 pages, not full).
PoolSpec events_spec() {
  PoolSpec spec;
  spec.num_kv_heads = 2;
  spec.head_dim = 16;
  spec.page_size = 4;
  spec.seq_lens = {37, 20};
  return spec;
}

}  // namespace

TEST_CASE("eps: bad parameters throw kvkit::Error naming the value", "[eps]") {
  auto bad = [](auto edit, const char* what) {
    sk::SketchParams p;
    edit(p);
    REQUIRE_THROWS_WITH(p.validate(), Catch::Contains(what));
  };
  bad([](sk::SketchParams& p) { p.eps = 0; }, "eps must be in (0, 1), got 0");
  bad([](sk::SketchParams& p) { p.eps = -0.5; }, "got -0.5");
  bad([](sk::SketchParams& p) { p.eps = 1; }, "eps must be in (0, 1), got 1");
  bad([](sk::SketchParams& p) { p.eps = 2.5; }, "got 2.5");
  bad([](sk::SketchParams& p) { p.jl_dim = 0; }, "JL dimension m must be in [1, 64], got 0");
  bad([](sk::SketchParams& p) { p.fd_rows = 0; }, "FD rows l must be in [1, 64], got 0");
  bad([](sk::SketchParams& p) { p.group_pages = 0; }, "group size (pages) must be >= 1, got 0");
  bad([](sk::SketchParams& p) { p.last_n = 0; }, "last_n must be >= 1, got 0");
  bad([](sk::SketchParams& p) { p.alpha = 0.5; }, "alpha must be >= 1, got 0.5");
  bad([](sk::SketchParams& p) { p.score_fraction = 0; }, "score_fraction must be in (0, 1] (1: no limit), got 0");
  bad([](sk::SketchParams& p) { p.score_fraction = 1.5; }, "score_fraction must be in (0, 1] (1: no limit), got 1.5");
  REQUIRE_THROWS_AS(sk::parse_method("pca"), kvkit::Error);
  REQUIRE_THROWS_WITH(sk::parse_method("pca"), Catch::Contains("'pca'"));
  REQUIRE(sk::parse_method("fd") == sk::SketchMethod::kFD);
  REQUIRE(sk::parse_method("1pc") == sk::SketchMethod::kOnePC);
  sk::SketchParams p;
  p.eps = 0;
  REQUIRE_THROWS_AS(sk::SketchStore(p, 1, 1, 8, 4, 4), kvkit::Error);
  sk::SketchParams ok;
  REQUIRE_THROWS_WITH(sk::SketchStore(ok, 1, 2, 8, 4, 4, -1), Catch::Contains("got -1"));
}

// The JL estimate sqrt(zᵀGz)/m of ‖Kq‖₂ (seed §2.2, §9.1). zᵀGz/m² = Σ_i (k_iᵀΦΦᵀq/m)², and
// k_iᵀΦΦᵀq/m = k_i·q + noise of variance (‖k‖²‖q‖² + (k·q)² − 2Σ_c k_c²q_c²)/m, so the estimate
// is biased upward by that noise: it is not a JL embedding of Kq. Checked: over seeds, the
// mean of zᵀGz/m² matches this expectation (within 6 % for isotropic keys, 30 % for
// aligned ones, whose noise is shared by all keys) and the relative error of the
// estimate shrinks from m = 8 to m = 16, for isotropic keys and for keys sharing the
// query's direction (the case the seed has in mind).
TEST_CASE("eps: JL quadratic-form estimate across seeds at m = 8 and 16", "[eps]") {
  KVKIT_TEST_RNG(rng);
  // 400 seeds: the m = 8 mean has a heavy tail, and with 100 seeds the bands below were
  // only ~2.5 sigma wide (7 of 500 fresh runs failed, e.g. seed 12035203168110775509 at
  // 1.083); with 400 they are ~5 sigma. Under the sanitizers 40 seeds run the same code
  // (and the certified-bound REQUIREs); the statistical bands are checked in Release only.
  const int d = 64, n = 96, queries = 8, seeds = kvkit::test::scaled(400, 40);
  std::normal_distribution<float> nd(0.f, 1.f);
  double mean_rel[2] = {0, 0}, mean_rel_aligned[2] = {0, 0};
  for (int mi = 0; mi < 2; ++mi) {
    const int m = mi == 0 ? 8 : 16;
    double ratio_sum[2] = {0, 0};
    int ratio_n[2] = {0, 0};
    for (int s = 0; s < seeds; ++s) {
      for (int aligned = 0; aligned < 2; ++aligned) {
        std::vector<float> dir(d), K(static_cast<std::size_t>(n) * d);
        for (float& x : dir) x = nd(rng);
        for (int i = 0; i < n; ++i)
          for (int c = 0; c < d; ++c)
            K[static_cast<std::size_t>(i) * d + c] =
                (aligned ? 3.f * dir[c] * (1.f + 0.1f * nd(rng)) : 0.f) + nd(rng) / std::sqrt(float(d));
        sk::SketchParams p;
        p.jl_dim = m;
        p.seed = rng();
        sk::SketchStore store(p, 1, 1, d, n, 1);
        const std::int32_t r = store.summarise_keys(0, 0, 0, K.data(), n, d);
        const float* ph = store.phi(0);
        for (int qi = 0; qi < queries; ++qi) {
          std::vector<float> q(d);
          for (int c = 0; c < d; ++c) q[c] = aligned ? dir[c] + 0.3f * nd(rng) : nd(rng);
          double qn = 0, exact = 0, expect = 0;
          for (float x : q) qn += double(x) * x;
          std::vector<double> z(static_cast<std::size_t>(m), 0.0);
          for (int c = 0; c < d; ++c)
            for (int a = 0; a < m; ++a) z[a] += double(q[c]) * ph[c * m + a];
          for (int i = 0; i < n; ++i) {
            const float* k = K.data() + static_cast<std::size_t>(i) * d;
            double kq = 0, kk = 0, diag = 0;
            for (int c = 0; c < d; ++c) {
              kq += double(k[c]) * q[c];
              kk += double(k[c]) * k[c];
              diag += double(k[c]) * k[c] * q[c] * q[c];
            }
            exact += kq * kq;
            expect += kq * kq + (kk * qn + kq * kq - 2 * diag) / m;
          }
          const sk::GroupBounds gb =
              sk::group_bounds(store, 0, r, 0, q.data(), std::sqrt(qn), z.data());
          const double est = gb.jl, ex = std::sqrt(exact);
          const double rel = std::fabs(est - ex) / ex;
          (aligned ? mean_rel_aligned : mean_rel)[mi] += rel / (seeds * queries);
          ratio_sum[aligned] += est * est / expect;
          ++ratio_n[aligned];
          // FD is certified: q·c + sqrt(‖Bq‖² + Δ‖q‖²) >= max_i q·k_i, and so is the box.
          double maxdot = -1e300;
          for (int i = 0; i < n; ++i) {
            double kq = 0;
            for (int c = 0; c < d; ++c) kq += double(K[static_cast<std::size_t>(i) * d + c]) * q[c];
            maxdot = std::max(maxdot, kq);
          }
          REQUIRE(gb.fd >= maxdot);
          REQUIRE(gb.box_hi >= maxdot);
        }
      }
    }
    for (int a = 0; a < 2 && !kSanitized; ++a) {
      INFO("m = " << m << (a ? " aligned" : " isotropic") << ": mean zGz/m^2 / expectation = "
                  << ratio_sum[a] / ratio_n[a]);
      // Aligned keys share one noise term per Φ, so their mean varies more across seeds.
      CHECK(std::fabs(ratio_sum[a] / ratio_n[a] - 1.0) < (a ? 0.3 : 0.06));
    }
  }
  WARN("JL mean relative error of sqrt(zGz)/m vs ||Kq||: isotropic keys m=8 " << mean_rel[0] << ", m=16 "
                                                                              << mean_rel[1] << "; keys sharing "
                                                                              << "the query's direction m=8 "
                                                                              << mean_rel_aligned[0] << ", m=16 "
                                                                              << mean_rel_aligned[1]);
  if (kSanitized) return;
  CHECK(mean_rel[1] < mean_rel[0]);
  CHECK(mean_rel_aligned[1] < mean_rel_aligned[0]);
  // The seed's "< 0.2" does not hold at these m even for aligned keys: the estimate's
  // relative error is about sqrt((1 + ‖k‖²‖q‖²/(k·q)²)/m) (~0.5 at m = 8, ~0.35 at m = 16
  // here), which is why strict mode never uses it.
  CHECK(mean_rel_aligned[0] > 0.2);
}

TEST_CASE("eps: strict mode is sound over >= 1e6 random (query, page) pairs, float and half keys", "[eps]") {
  KVKIT_TEST_RNG(rng);
  // Under ASan/UBSan the count is scaled down 18x (same code paths, fewer queries).
  const std::int32_t per_round = kSanitized ? 2 : 36;
  PropertyCounts cf, ch;
  const sk::SketchMethod methods[2] = {sk::SketchMethod::kBox, sk::SketchMethod::kFD};
  const double epss[3] = {1e-2, 1e-3, 1e-4};
  for (int round = 0; round < 6; ++round) {
    const sk::SketchMethod m = methods[round % 2];
    const double eps = epss[round % 3];
    const std::int32_t group = round < 3 ? 1 : 2;
    property_round<float>(rng, m, eps, group, per_round, cf);
    property_round<half_t>(rng, m, eps, group, per_round, ch);
  }
  WARN("strict soundness: " << cf.pairs << " float + " << ch.pairs << " half (query head, page) pairs, "
                            << cf.checks + ch.checks << " softmax checks; pages visited "
                            << double(cf.visited + ch.visited) / double(cf.total + ch.total) << " of all"
                            << (kSanitized ? " (sanitizer build: 18x fewer queries)" : ""));
  if (!kSanitized) REQUIRE(cf.pairs + ch.pairs >= 1000000);
  REQUIRE(ch.pairs > 0);
  // Not vacuous: pages were skipped.
  REQUIRE(cf.visited < cf.total);
  REQUIRE(ch.visited < ch.total);
}

TEST_CASE("eps: strict rbox (min(box, norm, rotated box)) is sound over >= 1e6 random (query, page) pairs",
          "[eps]") {
  KVKIT_TEST_RNG(rng);
  const std::int32_t per_round = kSanitized ? 2 : 36;
  PropertyCounts cf, ch;
  const double epss[3] = {1e-2, 1e-3, 1e-4};
  for (int round = 0; round < 6; ++round) {
    const double eps = epss[round % 3];
    const std::int32_t group = round < 3 ? 1 : 2;
    property_round<float>(rng, sk::SketchMethod::kRotBox, eps, group, per_round, cf);
    property_round<half_t>(rng, sk::SketchMethod::kRotBox, eps, group, per_round, ch);
  }
  WARN("strict rbox soundness: " << cf.pairs << " float + " << ch.pairs << " half (query head, page) pairs, "
                                 << cf.checks + ch.checks << " softmax checks; pages visited "
                                 << double(cf.visited + ch.visited) / double(cf.total + ch.total) << " of all"
                                 << (kSanitized ? " (sanitizer build: 18x fewer queries)" : ""));
  if (!kSanitized) REQUIRE(cf.pairs + ch.pairs >= 1000000);
  REQUIRE(cf.visited < cf.total);
  REQUIRE(ch.visited < ch.total);
}

TEST_CASE("eps codes: strict per-token code bounds are sound over >= 1e6 random (query, page) pairs, and skip more than the box",
          "[eps]") {
  KVKIT_TEST_RNG(rng);
  const std::int32_t per_round = kSanitized ? 2 : 36;
  PropertyCounts cf, ch, bf;
  const double epss[3] = {1e-2, 1e-3, 1e-4};
  for (int round = 0; round < 6; ++round) {
    const double eps = epss[round % 3];
    const std::int32_t group = round < 3 ? 1 : 2, bits = round % 2 ? 8 : 4;
    // The box on the same kind of pools and queries, for the comparison below.
    std::mt19937_64 twin(rng());
    std::mt19937_64 same = twin;
    property_round<float>(twin, sk::SketchMethod::kCodes, eps, group, per_round, cf, bits);
    property_round<float>(same, sk::SketchMethod::kBox, eps, group, per_round, bf);
    property_round<half_t>(rng, sk::SketchMethod::kCodes, eps, group, per_round, ch, bits);
  }
  WARN("strict codes soundness: " << cf.pairs << " float + " << ch.pairs << " half (query head, page) pairs, "
                                  << cf.checks + ch.checks << " softmax checks; pages visited "
                                  << double(cf.visited) / double(cf.total) << " of all (box on the same pools and queries: "
                                  << double(bf.visited) / double(bf.total) << ")"
                                  << (kSanitized ? " (sanitizer build: 18x fewer queries)" : ""));
  if (!kSanitized) REQUIRE(cf.pairs + ch.pairs >= 1000000);
  REQUIRE(ch.visited < ch.total);
  // The same pools and queries (one generator state copied): the per-token bounds skip
  // pages the box cannot.
  REQUIRE(cf.total == bf.total);
  REQUIRE(cf.visited < bf.visited);
}

TEST_CASE("eps codes: the per-token log-mass bounds bracket the float64 mass, within the cell width", "[eps]") {
  KVKIT_TEST_RNG(rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::int32_t P = 16;
  for (std::int32_t bits : {4, 8})
    for (std::int32_t d : {8, 30, 64, 128}) {
      sk::SketchParams p;
      p.method = sk::SketchMethod::kCodes;
      p.code_bits = bits;
      std::vector<float> work(static_cast<std::size_t>(d));
      std::vector<double> dots(static_cast<std::size_t>(P));
      double worst_gap = 0;
      for (int trial = 0; trial < 40; ++trial) {
        // Keys with an offset and per-channel scales (outlier channels included), some
        // channels flat; half-precision keys in odd trials.
        std::vector<float> K(static_cast<std::size_t>(P) * d), q(static_cast<std::size_t>(d));
        std::vector<half_t> Kh(K.size());
        const bool flat = trial % 5 == 0;
        for (std::int32_t c = 0; c < d; ++c) {
          const float off = 2.f * nd(rng), sc = c % 7 == 0 ? 8.f : 0.5f + std::fabs(nd(rng));
          for (std::int32_t t = 0; t < P; ++t) K[static_cast<std::size_t>(t) * d + c] = flat && c % 3 == 0 ? off : off + sc * nd(rng);
          q[c] = 2.f * nd(rng);
        }
        for (std::size_t i = 0; i < K.size(); ++i) {
          Kh[i] = kvkit::from_float<half_t>(K[i]);
          if (trial % 2) K[i] = kvkit::to_float(Kh[i]);
        }
        sk::SketchStore store(p, 1, 1, d, P, 4);
        const std::int32_t r = trial % 2 ? store.summarise_keys(0, 1, 0, Kh.data(), P, d)
                                         : store.summarise_keys(0, 1, 0, K.data(), P, d);
        REQUIRE(store.has_codes(0, r));
        const double scale = 1.0 / std::sqrt(static_cast<double>(d));
        double mx = -1e300;
        std::vector<double> lg(static_cast<std::size_t>(P));
        for (std::int32_t t = 0; t < P; ++t) {
          lg[t] = scale * dotd(K.data() + static_cast<std::size_t>(t) * d, q.data(), d);
          mx = std::max(mx, lg[t]);
        }
        double z = 0;
        for (double x : lg) z += std::exp(x - mx);
        const double exact = mx + std::log(z);
        double hi = 0, lo = 0;
        sk::codes_bounds(store, 0, r, 0, q.data(), scale, work.data(), dots.data(), &hi, &lo);
        CAPTURE(bits, d, trial, exact, hi, lo);
        REQUIRE(hi >= exact);
        REQUIRE(lo <= exact);
        // The gap is s·Σ_c |q_c|·step_c (+ rounding): the box's width over 2^bits cells.
        double cells = 0, mag = 0;
        for (std::int32_t c = 0; c < d; ++c) {
          double mn = 1e300, mxc = -1e300;
          for (std::int32_t t = 0; t < P; ++t) {
            mn = std::min(mn, double(K[static_cast<std::size_t>(t) * d + c]));
            mxc = std::max(mxc, double(K[static_cast<std::size_t>(t) * d + c]));
          }
          cells += std::fabs(q[c]) * (mxc - mn) / (1 << bits);
          mag += std::fabs(q[c]) * (std::fabs(mn) + (mxc - mn) / (1 << bits));
        }
        // (+ the rounding slack on each side: (codes_seq_slack(d) + 2⁻²³)·(2^bits − 1)·Σ|a|
        // for the codes' sums, (float_sum_slack(2d) + 2⁻²³)·Σ|q|(|min| + step) for the base)
        const double tol = 2.2 * (sk::detail::codes_seq_slack(d) + 0x1p-23) * ((1 << bits) - 1) +
                           3 * sk::detail::float_sum_slack(2 * d);
        const double tol_base = 2.2 * (sk::detail::float_sum_slack(2 * d) + 0x1p-23) * mag;
        // (+ 4·kExpSumRel: the exp sum's certified error, on each side)
        REQUIRE(hi - lo <= scale * (cells * (1 + tol) + tol_base) + 4 * sk::detail::kExpSumRel + 1e-9);
        worst_gap = std::max(worst_gap, hi - lo);
      }
      WARN("codes " << bits << " bits, d " << d << ": widest log-mass bracket " << worst_gap << " nats");
    }
}

TEST_CASE("eps codes: bad code_bits throw naming the value; memory counts the codes",
          "[eps]") {
  sk::SketchParams p;
  p.method = sk::SketchMethod::kCodes;
  p.code_bits = 3;
  REQUIRE_THROWS_WITH(p.validate(), Catch::Contains("code_bits must be 4 or 8, got 3"));
  p.code_bits = 4;
  REQUIRE(sk::parse_method("codes") == sk::SketchMethod::kCodes);
  REQUIRE(std::string(sk::to_string(sk::SketchMethod::kCodes)) == "codes");
  for (std::int32_t bits : {4, 8}) {
    p.code_bits = bits;
    p.group_pages = 2;
    p.all_summaries = false;  // box and scalars besides the codes
    sk::SketchStore st(p, 1, 2, 16, 4, 8);
    REQUIRE(st.memory_bytes() == 0);
    std::vector<float> k(8 * 16, 1.f);
    st.summarise_keys(0, 0, 0, k.data(), 8, 16);
    // One record, 2 kv heads: box + scalars + one block of 16 tokens (8 used, the rest
    // padding) x 16 channels x bits / 8.
    REQUIRE(st.memory_bytes() == 2 * (8 * 16 + 12 + 16 * 16 * bits / 8));
  }
}

TEST_CASE("eps: a planted needle's page is always visited in strict mode", "[eps]") {
  KVKIT_TEST_RNG(rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Sanitizers: 3 trials, one per group size.
  for (int trial = 0; trial < kvkit::test::scaled(12, 3); ++trial) {
    PoolSpec spec;
    spec.num_kv_heads = 1;
    spec.head_dim = 64;
    spec.page_size = 16;
    spec.seq_lens = {4096 + static_cast<std::int32_t>(rng() % 512)};
    RandomPool<float> pool(spec, rng);
    const std::int32_t d = spec.head_dim, L = spec.seq_lens[0];
    std::vector<float> dir(d);
    double dn = 0;
    for (float& x : dir) {
      x = nd(rng);
      dn += double(x) * x;
    }
    for (float& x : dir) x /= static_cast<float>(std::sqrt(dn));
    for (std::int32_t t = 0; t < L; ++t)
      for (std::int32_t c = 0; c < d; ++c) pool.view.k_ptr(0, t, 0)[c] = 0.05f * nd(rng);
    const std::int32_t needle = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(L - 64));
    for (std::int32_t c = 0; c < d; ++c) pool.view.k_ptr(0, needle, 0)[c] = 4.f * dir[c] + 0.05f * nd(rng);
    std::vector<float> q(d);
    for (std::int32_t c = 0; c < d; ++c) q[c] = 30.f * dir[c] + 0.2f * nd(rng);
    for (sk::SketchMethod m : {sk::SketchMethod::kBox, sk::SketchMethod::kFD, sk::SketchMethod::kRotBox}) {
      sk::SketchParams p;
      p.method = m;
      p.eps = 1e-3;
      p.group_pages = 1 + trial % 3;
      p.score_fraction = 1;  // the plain ε rule (it must skip pages here, not just visit all)
      sk::SketchStore store(p, 1, 1, d, spec.page_size, pool.geometry.num_pages);
      store.sync(0, pool.view);
      sk::SketchSelector sel(store);
      sel.reserve(1, 1, pool.view.num_pages(0));
      sk::SketchTelemetry tel;
      REQUIRE(sel.select(0, pool.view, q.data(), 1, 1.f / 8.f, &tel).is_ok());
      bool found = false;
      for (std::int32_t i = 0; i < sel.indptr()[1]; ++i) found |= sel.subset()[i] == needle / spec.page_size;
      CAPTURE(trial, sk::to_string(m), needle, tel.pages_visited, tel.pages_total);
      REQUIRE(found);
      REQUIRE(tel.pages_visited < tel.pages_total);  // and it did skip pages
    }
  }
}

TEST_CASE("eps: summaries follow page events (rewrite, release) and appends", "[eps]") {
  KVKIT_TEST_RNG(rng);
  const PoolSpec spec = events_spec();
  RandomPool<float> pool(spec, rng);
  sk::SketchParams p;
  p.group_pages = 2;
  sk::SketchStore store(p, 2, 2, 16, 4, pool.geometry.num_pages);
  REQUIRE(store.sync(1, pool.view) > 0);
  REQUIRE(store.sync(1, pool.view) == 0);  // nothing new
  const std::int64_t per = sk::summary_bytes(16, p.jl_dim, p.fd_rows).total();
  REQUIRE(store.memory_bytes() == (5 + 3) * 2 * per + 2 * 16 * p.jl_dim);
  auto box_ok = [&](std::int32_t b, std::int32_t j0) {
    const std::int32_t r = store.record_of(1, pool.view.page_id(b, j0));
    REQUIRE(r >= 0);
    REQUIRE(store.record_matches(1, r, pool.view, b, j0));
    for (std::int32_t h = 0; h < 2; ++h) {
      const float* bmin = store.box_min(1, h) + static_cast<std::size_t>(r) * 16;
      const float* bmax = store.box_max(1, h) + static_cast<std::size_t>(r) * 16;
      for (std::int32_t t = j0 * 4; t < std::min(pool.view.seq_len(b), (j0 + 2) * 4); ++t)
        for (std::int32_t c = 0; c < 16; ++c) {
          const float x = pool.view.k_ptr(b, t, h)[c];
          REQUIRE(x >= bmin[c]);
          REQUIRE(x <= bmax[c]);
        }
    }
  };
  // Rewrite page 1 of sequence 0 with larger keys: stale until synced, then rebuilt.
  const std::int32_t pg = pool.view.page_id(0, 1);
  for (std::int32_t t = 0; t < 4; ++t)
    for (std::int32_t c = 0; c < 16; ++c) pool.view.k_ptr(0, 4 + t, 0)[c] = 5.f + static_cast<float>(c);
  store.page_changed(pg);
  const std::int32_t r = store.record_of(1, pool.view.page_id(0, 0));
  REQUIRE_FALSE(store.record_matches(1, r, pool.view, 0, 0));
  REQUIRE(store.sync(1, pool.view) == 1);
  box_ok(0, 0);
  // Releasing a group's first page drops its record.
  const std::int64_t before = store.memory_bytes();
  store.page_freed(pool.view.page_id(1, 2));
  REQUIRE(store.record_of(1, pool.view.page_id(1, 2)) < 0);
  REQUIRE(store.memory_bytes() == before - 2 * per);
  // Appending: one more token in sequence 0's last page is summarised without a rebuild.
  pool.last_page_len[0] += 1;  // 37 -> 38 tokens (page 9 had 1 token)
  REQUIRE(store.sync(1, pool.view) == 1);  // only the dropped group of sequence 1 is re-read
  box_ok(0, 8);
  box_ok(1, 2);
}

TEST_CASE("eps codes: every coded key lies in its cell; codes follow rewrites and wait for a group to fill", "[eps]") {
  KVKIT_TEST_RNG(rng);
  const PoolSpec spec = events_spec();
  for (std::int32_t bits : {4, 8}) {
    RandomPool<half_t> pool(spec, rng);
    sk::SketchParams p;
    p.method = sk::SketchMethod::kCodes;
    p.code_bits = bits;
    p.group_pages = 2;
    sk::SketchStore store(p, 1, 2, 16, 4, pool.geometry.num_pages);
    store.sync(0, pool.view);
    // The cell of token t, channel c: [min_c + x·step_c, min_c + (x + 1)·step_c].
    auto cells_ok = [&](std::int32_t b, std::int32_t j0) {
      const std::int32_t r = store.record_of(0, pool.view.page_id(b, j0));
      REQUIRE(r >= 0);
      REQUIRE(store.has_codes(0, r));
      for (std::int32_t h = 0; h < 2; ++h) {
        const float* lo = store.box_min(0, h) + static_cast<std::size_t>(r) * 16;
        const float* hi = store.box_max(0, h) + static_cast<std::size_t>(r) * 16;
        for (std::int32_t t = 0; t < 8; ++t)
          for (std::int32_t c = 0; c < 16; ++c) {
            const std::int32_t x = sk::detail::code_at(store.codes(0, r, h), 16, bits, t, c);
            const double st = sk::detail::code_step(lo[c], hi[c], 1 << bits);
            const double k = kvkit::to_float(pool.view.k_ptr(b, j0 * 4 + t, h)[c]);
            CAPTURE(bits, b, j0, t, c, x, st, k);
            REQUIRE(k >= lo[c] + x * st - 1e-12 * std::fabs(k));
            REQUIRE(k <= lo[c] + (x + 1) * st + 1e-12 * std::fabs(k));
          }
      }
    };
    for (std::int32_t j0 = 0; j0 < 8; j0 += 2) cells_ok(0, j0);
    cells_ok(1, 0);
    cells_ok(1, 2);
    // Sequence 0's last group (37 tokens: page 8 holds 4, page 9 one) is not full: no codes.
    const std::int32_t last = store.record_of(0, pool.view.page_id(0, 8));
    REQUIRE(last >= 0);
    REQUIRE_FALSE(store.has_codes(0, last));
    // A rewrite with larger keys: the record is rebuilt and recoded on the new box.
    for (std::int32_t t = 0; t < 4; ++t)
      for (std::int32_t c = 0; c < 16; ++c) pool.view.k_ptr(0, 4 + t, 1)[c] = kvkit::from_float<half_t>(5.f + c);
    store.page_changed(pool.view.page_id(0, 1));
    REQUIRE(store.sync(0, pool.view) == 1);
    cells_ok(0, 0);
    // Filling the last group (3 more tokens) codes it.
    pool.last_page_len[0] += 3;
    store.sync(0, pool.view);
    REQUIRE(store.has_codes(0, last));
    cells_ok(0, 8);
  }
}

TEST_CASE("eps: page-subset attention over all pages equals dense; strict subsets stay within 2*eps", "[eps]") {
  KVKIT_TEST_RNG(rng);
  for (int rep = 0; rep < 4; ++rep) {
    PoolSpec spec;
    spec.num_kv_heads = 2;
    spec.head_dim = 32;
    spec.page_size = 16;
    spec.seq_lens = {1 + static_cast<std::int32_t>(rng() % 3000), 2048, 17};
    RandomPool<float> pool(spec, rng);
    structure_keys(pool, rng);
    const std::int32_t Hq = 4, B = 3, d = 32;
    std::vector<float> q = kvkit::test::random_vector<float>(static_cast<std::size_t>(B * Hq * d), rng, -3.f, 3.f);
    kvkit::DecodeAttentionParams ap{Hq, 1.f / std::sqrt(32.f)};
    std::vector<double> ref, lse;
    kvkit::test::ref_decode_attention(pool.view, q.data(), Hq, ap.sm_scale, ref, lse);
    // All pages as an explicit subset.
    std::vector<std::int32_t> indptr(1, 0), subset;
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t h = 0; h < 2; ++h) {
        for (std::int32_t i = 0; i < pool.view.num_pages(b); ++i) subset.push_back(i);
        indptr.push_back(static_cast<std::int32_t>(subset.size()));
      }
    kvkit::DecodeAttentionParams all = ap;
    all.page_subset_indptr = indptr.data();
    all.page_subset = subset.data();
    const kvkit::exec::Host ex{1};
    std::vector<unsigned char> ws(kvkit::paged_decode_attention_workspace_size(ex, pool.view, all));
    std::vector<float> out(static_cast<std::size_t>(B * Hq * d));
    REQUIRE(kvkit::paged_decode_attention(ex, pool.view, q.data(), out.data(), all, kvkit::Workspace{ws.data(), ws.size()})
                .is_ok());
    REQUIRE(kvkit::test::compare_close(out.data(), ref, kvkit::test::value_tolerance<float>()).empty());
    // A strict selection: |out_subset - out_dense| <= 2 * omitted * max|v| per element.
    sk::SketchParams p;
    p.eps = 1e-3;
    p.method = rep % 2 ? sk::SketchMethod::kFD : sk::SketchMethod::kBox;
    p.score_fraction = 1;  // the plain ε rule, so that pages are skipped
    sk::SketchStore store(p, 1, 2, d, 16, pool.geometry.num_pages);
    store.sync(0, pool.view);
    sk::SketchSelector sel(store);
    sel.reserve(B, Hq, 200);
    sk::SketchTelemetry tel;
    REQUIRE(sel.select(0, pool.view, q.data(), Hq, ap.sm_scale, &tel).is_ok());
    kvkit::DecodeAttentionParams sp = ap;
    sp.page_subset_indptr = sel.indptr();
    sp.page_subset = sel.subset();
    REQUIRE(kvkit::paged_decode_attention(ex, pool.view, q.data(), out.data(), sp, kvkit::Workspace{ws.data(), ws.size()})
                .is_ok());
    double vmax = 0;
    for (float v : pool.v) vmax = std::max(vmax, double(std::fabs(v)));
    for (std::int32_t b = 0; b < B; ++b)
      for (std::int32_t hq = 0; hq < Hq; ++hq)
        for (std::int32_t c = 0; c < d; ++c) {
          const std::size_t i = (static_cast<std::size_t>(b) * Hq + hq) * d + c;
          REQUIRE(std::fabs(out[i] - ref[i]) <= 2 * sel.omitted_bound(b, hq) * vmax + 1e-4);
        }
  }
}
