// kvkit/core/logits.hpp: KL between two logit vectors, against a long-double reference
// computed from normalised probabilities (a different formulation from the kernel's
// log-sum-exp form), on fresh random logits.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "kvkit/core/logits.hpp"
#include "reference.hpp"

namespace {

template <class T>
long double kl_reference(const std::vector<T>& p, const std::vector<T>& q) {
  auto probs = [](const std::vector<T>& x) {
    long double m = x[0];
    for (T v : x) m = std::max<long double>(m, v);
    std::vector<long double> e(x.size());
    long double z = 0;
    for (std::size_t i = 0; i < x.size(); ++i) z += e[i] = std::exp(static_cast<long double>(x[i]) - m);
    for (long double& v : e) v /= z;
    return e;
  };
  const std::vector<long double> a = probs(p), b = probs(q);
  long double kl = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] > 0) kl += a[i] * std::log(a[i] / b[i]);
  return kl;
}

}  // namespace

TEMPLATE_TEST_CASE("kl_from_logits: against a long-double reference on random logits", "[core]", float,
                   double) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  for (int n : {1, 2, 7, 1000, 49152}) {
    for (T scale : {T(0.1), T(3), T(30)}) {
      INFO("n " << n << " scale " << scale);
      std::normal_distribution<T> g(T(0), scale);
      std::vector<T> p(static_cast<std::size_t>(n)), q(p.size());
      for (std::size_t i = 0; i < p.size(); ++i) {
        p[i] = g(rng) + T(50);  // an offset the shift by the maximum must absorb
        q[i] = p[i] + T(0.3) * g(rng);
      }
      const double got = kvkit::kl_from_logits(p.data(), q.data(), n);
      const long double ref = kl_reference(p, q);
      // float64 sums over n terms of magnitude <= max |lp - lq| * p_i (for double logits too:
      // the error comes from the float64 arithmetic, not from the inputs).
      REQUIRE(std::abs(got - static_cast<double>(ref)) <= 1e-12 * (1 + n * 1e-3) + 1e-9 * static_cast<double>(ref));
      REQUIRE(got >= 0.0);
      REQUIRE(kvkit::kl_from_logits(p.data(), p.data(), n) == 0.0);
    }
  }
}

TEST_CASE("kl_from_logits: float logits give the bitwise result of their double copies", "[core]") {
  // Float logits are widened exactly and every step runs in double, so the float and the
  // double instantiation must agree to the bit on the same values.
  KVKIT_TEST_RNG(rng);
  std::normal_distribution<float> g(0.f, 5.f);
  for (int n : {1, 3, 1000, 49152}) {
    INFO("n " << n);
    std::vector<float> p(static_cast<std::size_t>(n)), q(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      p[i] = g(rng) - 20.f;
      q[i] = p[i] + 0.5f * g(rng);
    }
    const std::vector<double> pd(p.begin(), p.end()), qd(q.begin(), q.end());
    const double f = kvkit::kl_from_logits(p.data(), q.data(), n);
    REQUIRE(f == kvkit::kl_from_logits(pd.data(), qd.data(), n));
    REQUIRE((n == 1 || f > 0.0));  // a real comparison, not two zeros
  }
}

TEST_CASE("kl_from_logits: n <= 0 is an error naming the value", "[core]") {
  const float x = 1.f;
  REQUIRE_THROWS_WITH(kvkit::kl_from_logits(&x, &x, 0), Catch::Contains("n > 0, got 0"));
  const double y = 1.0;
  REQUIRE_THROWS_WITH(kvkit::kl_from_logits(&y, &y, -1), Catch::Contains("n > 0, got -1"));
}
