// Sketcher rotated box (method rbox, sketch/eps.hpp): the bound holds against float64
// q·k for fitted, perturbed and far-from-orthonormal bases (float and half keys), its
// ε_B slack is what keeps a non-orthonormal basis sound, records begun before the basis
// keep no rotated box while appends stay sound, the fitted basis tightens the bound on
// keys that spread along a few directions, and the parameters / set_basis misuse throw
// kvkit::Error naming the value.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvkit/core/dtype.hpp"
#include "kvkit/sketch/eps.hpp"
#include "reference.hpp"

namespace sk = kvkit::sketch;
using kvkit::half_t;
using kvkit::test::PoolSpec;
using kvkit::test::RandomPool;

namespace {

// Random orthonormal rows (Gram–Schmidt in double of Gaussian rows), [d, d].
std::vector<double> random_orthonormal(std::mt19937_64& rng, int d) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> Q(static_cast<std::size_t>(d) * d);
  for (int i = 0; i < d; ++i) {
    double* r = Q.data() + static_cast<std::size_t>(i) * d;
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 0)
        for (int c = 0; c < d; ++c) r[c] = nd(rng);
      for (int j = 0; j < i; ++j) {
        const double* s = Q.data() + static_cast<std::size_t>(j) * d;
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += r[c] * s[c];
        for (int c = 0; c < d; ++c) r[c] -= dot * s[c];
      }
      double n = 0;
      for (int c = 0; c < d; ++c) n += r[c] * r[c];
      for (int c = 0; c < d; ++c) r[c] /= std::sqrt(n);
    }
  }
  return Q;
}

// Keys of one page: a random page mean plus a spread along `rank` random directions
// (scale `big`) and isotropic noise (scale `small`).
template <class T>
void page_keys(std::mt19937_64& rng, int d, int n, int rank, float big, float small, std::vector<T>& out) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> mean(static_cast<std::size_t>(d)), dirs(static_cast<std::size_t>(rank) * d);
  for (float& x : mean) x = 2.f * nd(rng);
  for (float& x : dirs) x = nd(rng) / std::sqrt(static_cast<float>(d));
  out.assign(static_cast<std::size_t>(n) * d, kvkit::from_float<T>(0.f));
  for (int t = 0; t < n; ++t) {
    std::vector<float> a(static_cast<std::size_t>(rank));
    for (float& x : a) x = big * nd(rng);
    for (int c = 0; c < d; ++c) {
      float x = mean[c] + small * nd(rng);
      for (int r = 0; r < rank; ++r) x += a[r] * dirs[static_cast<std::size_t>(r) * d + c];
      out[static_cast<std::size_t>(t) * d + c] = kvkit::from_float<T>(x);
    }
  }
}

template <class T>
double max_logit(const std::vector<T>& keys, int n, int d, const float* q) {
  double best = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int c = 0; c < d; ++c) s += static_cast<double>(kvkit::to_float(keys[static_cast<std::size_t>(t) * d + c])) * q[c];
    best = std::max(best, s);
  }
  return best;
}

// Queries: random, aimed at one key, and tiny / huge magnitudes.
void make_query(std::mt19937_64& rng, const float* key, int d, std::vector<float>& q) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> mag(-3.f, 3.f);
  const float m = std::pow(10.f, mag(rng));
  const bool aimed = (rng() & 1) != 0;
  for (int c = 0; c < d; ++c) q[c] = m * (aimed ? key[c] + 0.05f * nd(rng) : nd(rng));
}

template <class T>
void bound_round(std::mt19937_64& rng, int d, int basis_kind, std::int64_t& checks, double& worst_margin) {
  const int n = 16, pages = 12;
  sk::SketchParams p;
  p.method = sk::SketchMethod::kRotBox;
  sk::SketchStore store(p, 1, 1, d, n, pages);
  // 0: fitted from page 0's keys, 1: orthonormal + 1e-3 noise,
  // 2: 0.5 x orthonormal (ε_B = 0.75), 3: exactly the identity.
  std::vector<std::vector<T>> keys(static_cast<std::size_t>(pages));
  for (auto& k : keys) page_keys(rng, d, n, 1 + static_cast<int>(rng() % 4), 3.f, 0.2f, k);
  if (basis_kind > 0) {
    std::vector<double> Q = basis_kind == 3 ? std::vector<double>() : random_orthonormal(rng, d);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<float> rows(static_cast<std::size_t>(d) * d);
    for (int i = 0; i < d * d; ++i) {
      if (basis_kind == 3) rows[i] = (i / d == i % d) ? 1.f : 0.f;
      else if (basis_kind == 1) rows[i] = static_cast<float>(Q[i] + 1e-3 * nd(rng));
      else rows[i] = static_cast<float>(0.5 * Q[i]);
    }
    store.set_basis(0, 0, rows.data());
  } else {
    // A fitted basis: the eigenvectors of page 0's within-page covariance (double),
    // through set_basis; the store's own fit_basis is exercised by the selector tests.
    std::vector<double> C(static_cast<std::size_t>(d) * d, 0.0), V(C.size()), mean(static_cast<std::size_t>(d), 0.0);
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) mean[c] += kvkit::to_float(keys[0][static_cast<std::size_t>(t) * d + c]) / n;
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j)
          C[static_cast<std::size_t>(i) * d + j] += (kvkit::to_float(keys[0][static_cast<std::size_t>(t) * d + i]) - mean[i]) *
                                                    (kvkit::to_float(keys[0][static_cast<std::size_t>(t) * d + j]) - mean[j]);
    sk::detail::jacobi_eigen(C.data(), V.data(), d);
    std::vector<float> B(V.begin(), V.end());  // columns: the eigenvectors
    store.set_basis(0, 0, B.data());
  }
  REQUIRE(store.basis_ready(0, 0));
  std::vector<std::int32_t> recs;
  for (int pg = 0; pg < pages; ++pg) recs.push_back(store.summarise_keys(0, pg, 0, keys[pg].data(), n, d));
  std::vector<float> q(static_cast<std::size_t>(d)), qr(static_cast<std::size_t>(d)), kf(static_cast<std::size_t>(d));
  std::vector<double> rwork(2 * static_cast<std::size_t>(d));
  for (int it = 0; it < 40; ++it) {
    const int pg = static_cast<int>(rng() % pages), tk = static_cast<int>(rng() % n);
    for (int c = 0; c < d; ++c) kf[c] = kvkit::to_float(keys[pg][static_cast<std::size_t>(tk) * d + c]);
    make_query(rng, kf.data(), d, q);
    double qn = 0;
    for (float x : q) qn += static_cast<double>(x) * x;
    qn = std::sqrt(qn);
    const sk::detail::RotQuery rq = sk::detail::rotate_query(store.basis(0, 0), store.basis_eps(0, 0), d, q.data(), qn, qr.data(), rwork.data());
    for (int j = 0; j < pages; ++j) {
      const double u = sk::rot_bound(store, 0, recs[j], 0, qr.data(), rq);
      const double ex = max_logit(keys[j], n, d, q.data());
      REQUIRE(std::isfinite(u));
      if (!(u >= ex)) {
        CAPTURE(basis_kind, d, j, u, ex, store.basis_eps(0, 0), qn);
        REQUIRE(u >= ex);
      }
      worst_margin = std::min(worst_margin, (u - ex) / (qn * store.max_norm(0, 0)[recs[j]] + 1e-300));
      ++checks;
    }
  }
}

}  // namespace

TEST_CASE("eps rbox: the rotated-box bound holds for fitted, perturbed and non-orthonormal bases", "[eps]") {
  KVKIT_TEST_RNG(rng);
  std::int64_t checks = 0;
  double worst = 1e300;
  for (int round = 0; round < 24; ++round) {
    const int d = round % 3 == 0 ? 8 : (round % 3 == 1 ? 64 : 128);
    const int kind = round % 4;
    if (round % 2 == 0) bound_round<float>(rng, d, kind, checks, worst);
    else bound_round<half_t>(rng, d, kind, checks, worst);
  }
  WARN("rbox bound: " << checks << " (query, page) checks, smallest (U - max q.k) / (|q| max|k|) = " << worst);
  REQUIRE(checks == 24 * 40 * 12);
}

TEST_CASE("eps rbox: the eps_B slack is what keeps a non-orthonormal basis sound", "[eps]") {
  KVKIT_TEST_RNG(rng);
  // B = 0.5 I: the raw rotated sum is a quarter of the box of q·k, far below q·k for a
  // query aimed at a key; the bound with its ε_B = 0.75 term is above it.
  const int d = 16, n = 8;
  sk::SketchParams p;
  p.method = sk::SketchMethod::kRotBox;
  sk::SketchStore store(p, 1, 1, d, n, 4);
  std::vector<float> rows(static_cast<std::size_t>(d) * d, 0.f);
  for (int i = 0; i < d; ++i) rows[static_cast<std::size_t>(i) * d + i] = 0.5f;
  store.set_basis(0, 0, rows.data());
  // ε_B is ‖BᵀB − I‖_F (= 0.75·sqrt(16) = 3 here), an upper bound of the 2-norm 0.75.
  CHECK(store.basis_eps(0, 0) >= 3.0);
  CHECK(store.basis_eps(0, 0) < 3.0 * (1 + 1e-9));
  std::vector<float> keys;
  page_keys(rng, d, n, 2, 1.f, 0.1f, keys);
  const std::int32_t r = store.summarise_keys(0, 0, 0, keys.data(), n, d);
  std::vector<float> q(keys.begin(), keys.begin() + d), qr(static_cast<std::size_t>(d));
  std::vector<double> rwork(2 * static_cast<std::size_t>(d));
  double qn = 0;
  for (float x : q) qn += static_cast<double>(x) * x;
  qn = std::sqrt(qn);
  const sk::detail::RotQuery rq = sk::detail::rotate_query(store.basis(0, 0), store.basis_eps(0, 0), d, q.data(), qn, qr.data(), rwork.data());
  double raw = 0;
  for (int j = 0; j < d; ++j)
    raw += std::max(static_cast<double>(qr[j]) * store.rot_min(0, 0)[static_cast<std::size_t>(r) * d + j],
                    static_cast<double>(qr[j]) * store.rot_max(0, 0)[static_cast<std::size_t>(r) * d + j]);
  const double ex = max_logit(keys, n, d, q.data());
  REQUIRE(ex > 0);
  REQUIRE(raw < ex);  // the sum alone would not be a bound
  REQUIRE(sk::rot_bound(store, 0, r, 0, qr.data(), rq) >= ex);
}

TEST_CASE("eps rbox: records begun before the basis keep no rotated box; appends stay sound", "[eps]") {
  KVKIT_TEST_RNG(rng);
  PoolSpec spec;
  spec.num_kv_heads = 2;
  spec.head_dim = 32;
  spec.page_size = 8;
  spec.seq_lens = {300};
  RandomPool<float> pool(spec, rng);
  const std::int32_t d = spec.head_dim, L = spec.seq_lens[0];
  sk::SketchParams p;
  p.method = sk::SketchMethod::kRotBox;
  p.basis_keys = 50;
  sk::SketchStore store(p, 1, 2, d, spec.page_size, pool.geometry.num_pages);
  // Grow the sequence token by token (the decode path): sync at every length.
  std::vector<std::int32_t> last = {0};
  std::vector<std::int32_t> indptr = {0, 0};
  for (std::int32_t len = 1; len <= L; ++len) {
    const std::int32_t np = (len + spec.page_size - 1) / spec.page_size;
    indptr[1] = np;
    last[0] = len - (np - 1) * spec.page_size;
    const kvkit::PagedKVView<float> v = kvkit::make_csr_view(
        pool.geometry, pool.k.data(), pool.strides, pool.v.data(), pool.v_strides,
        kvkit::CsrPageTable{indptr.data(), pool.indices.data(), last.data(), 1});
    store.sync(0, v);
    CHECK(store.basis_ready(0, 0) == (len >= p.basis_keys));
  }
  std::vector<float> q(static_cast<std::size_t>(d)), qr(static_cast<std::size_t>(d));
  std::vector<double> rwork(2 * static_cast<std::size_t>(d));
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::int32_t np = pool.view.num_pages(0);
  const std::int32_t first_full = (p.basis_keys + spec.page_size - 1) / spec.page_size;  // first page begun after
  std::int32_t with = 0;
  for (std::int32_t h = 0; h < 2; ++h)
    for (std::int32_t pg = 0; pg < np; ++pg) {
      const std::int32_t r = store.record_of(0, pool.view.page_id(0, pg));
      REQUIRE(r >= 0);
      const bool has = std::isfinite(store.rot_amax_norm(0, h)[r]);
      CHECK(has == (pg >= first_full));
      with += has ? 1 : 0;
      for (int it = 0; it < 8; ++it) {
        for (float& x : q) x = 3.f * nd(rng);
        double qn = 0;
        for (float x : q) qn += static_cast<double>(x) * x;
        qn = std::sqrt(qn);
        const auto rq = sk::detail::rotate_query(store.basis(0, h), store.basis_eps(0, h), d, q.data(), qn, qr.data(), rwork.data());
        const double u = sk::rot_bound(store, 0, r, h, qr.data(), rq);
        double ex = -1e300;
        for (std::int32_t t = pg * spec.page_size; t < std::min(L, (pg + 1) * spec.page_size); ++t) {
          double s = 0;
          for (std::int32_t c = 0; c < d; ++c) s += static_cast<double>(pool.view.k_ptr(0, t, h)[c]) * q[c];
          ex = std::max(ex, s);
        }
        if (has) REQUIRE(u >= ex);
        else REQUIRE(u == std::numeric_limits<double>::infinity());
      }
    }
  REQUIRE(with > 0);
  // memory_bytes counts the rotated boxes and the two bases.
  const std::int64_t live = store.live_groups(0);
  REQUIRE(store.memory_bytes() == live * 2 * sk::summary_bytes(d, p.jl_dim, p.fd_rows, true).total() + 2LL * d * p.jl_dim +
                                      2LL * 4 * d * d);
}

TEST_CASE("eps rbox: the fitted basis tightens the bound where page keys spread along a few directions", "[eps]") {
  KVKIT_TEST_RNG(rng);
  PoolSpec spec;
  spec.num_kv_heads = 1;
  spec.head_dim = 64;
  spec.page_size = 16;
  spec.seq_lens = {1024};
  RandomPool<float> pool(spec, rng);
  const std::int32_t d = spec.head_dim, L = spec.seq_lens[0], P = spec.page_size;
  // Shared spread directions (what a fitted basis can align with), page means random.
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> dirs(static_cast<std::size_t>(2) * d);
  for (float& x : dirs) x = nd(rng) / std::sqrt(static_cast<float>(d));
  for (std::int32_t pg = 0; pg * P < L; ++pg) {
    std::vector<float> mean(static_cast<std::size_t>(d));
    for (float& x : mean) x = nd(rng);
    for (std::int32_t t = pg * P; t < std::min(L, (pg + 1) * P); ++t) {
      const float a = 4.f * nd(rng), b = 4.f * nd(rng);
      for (std::int32_t c = 0; c < d; ++c)
        pool.view.k_ptr(0, t, 0)[c] = mean[c] + a * dirs[c] + b * dirs[d + c] + 0.01f * nd(rng);
    }
  }
  sk::SketchParams p;
  p.method = sk::SketchMethod::kRotBox;
  sk::SketchStore store(p, 1, 1, d, P, pool.geometry.num_pages);
  store.sync(0, pool.view);
  REQUIRE(store.basis_ready(0, 0));
  std::vector<float> q(static_cast<std::size_t>(d)), qr(static_cast<std::size_t>(d));
  std::vector<double> rwork(2 * static_cast<std::size_t>(d));
  double slack_box = 0, slack_rot = 0;
  for (int it = 0; it < 20; ++it) {
    for (float& x : q) x = nd(rng);
    double qn = 0;
    for (float x : q) qn += static_cast<double>(x) * x;
    qn = std::sqrt(qn);
    const auto rq = sk::detail::rotate_query(store.basis(0, 0), store.basis_eps(0, 0), d, q.data(), qn, qr.data(), rwork.data());
    std::vector<double> z(static_cast<std::size_t>(p.jl_dim), 0.0);
    for (std::int32_t pg = 0; pg < pool.view.num_pages(0); ++pg) {
      const std::int32_t r = store.record_of(0, pool.view.page_id(0, pg));
      const sk::GroupBounds gb = sk::group_bounds(store, 0, r, 0, q.data(), qn, z.data(), 0);
      const double u = sk::rot_bound(store, 0, r, 0, qr.data(), rq);
      double ex = -1e300;
      for (std::int32_t t = pg * P; t < (pg + 1) * P; ++t) {
        double s = 0;
        for (std::int32_t c = 0; c < d; ++c) s += static_cast<double>(pool.view.k_ptr(0, t, 0)[c]) * q[c];
        ex = std::max(ex, s);
      }
      REQUIRE(u >= ex);
      slack_box += gb.box_hi - ex;
      slack_rot += u - ex;
    }
  }
  INFO("mean slack: box " << slack_box << " rotated " << slack_rot);
  // The spread lives in 2 of 64 directions: the rotated box is several times tighter.
  REQUIRE(slack_rot < 0.25 * slack_box);
}

TEST_CASE("eps rbox: bad parameters and set_basis misuse throw kvkit::Error naming the value", "[eps]") {
  auto throws_with = [](auto&& f, const std::string& needle) {
    try {
      f();
    } catch (const kvkit::Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
      return;
    }
    FAIL("no kvkit::Error for " << needle);
  };
  CHECK(sk::parse_method("rbox") == sk::SketchMethod::kRotBox);
  CHECK(std::string(sk::to_string(sk::SketchMethod::kRotBox)) == "rbox");
  throws_with([] { sk::parse_method("rotbox"); }, "rotbox");
  sk::SketchParams p;
  p.method = sk::SketchMethod::kRotBox;
  p.basis_keys = 1;
  throws_with([&] { p.validate(); }, "basis_keys must be >= 2, got 1");
  p.basis_keys = 64;
  sk::SketchStore store(p, 2, 1, 8, 4, 8);
  std::vector<float> rows(64, 0.f);
  for (int i = 0; i < 8; ++i) rows[static_cast<std::size_t>(i) * 8 + i] = 1.f;
  store.set_basis(1, 0, rows.data());
  throws_with([&] { store.set_basis(1, 0, rows.data()); }, "layer 1 kv head 0 is already set");
  throws_with([&] { store.set_basis(2, 0, rows.data()); }, "layer 2");
  rows[3] = std::numeric_limits<float>::quiet_NaN();
  throws_with([&] { store.set_basis(0, 0, rows.data()); }, "not finite");
  sk::SketchParams pb;
  sk::SketchStore plain(pb, 1, 1, 8, 4, 8);
  throws_with([&] { plain.set_basis(0, 0, rows.data()); }, "needs method rbox, got box");
}
