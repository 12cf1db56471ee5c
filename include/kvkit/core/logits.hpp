#pragma once
// Comparisons of next-token distributions given as logits, in float64. Policies that guard
// their own fidelity (kvchan's check) and hosts that report it (the example engine's
// FidelityMeter) use the same formula, so their numbers can be compared directly.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvkit/core/error.hpp"

namespace kvkit {

/// KL(softmax(p) || softmax(q)) in nats over n logits (float or double), computed in float64
/// with each side's log-sum-exp shifted by its own maximum (no overflow for any finite
/// logits). Rounding can give -1e-17 for equal inputs; the result is clamped at 0. Float
/// logits are widened exactly, so float inputs give the same result as their double copies.
/// Throws kvkit::Error for n <= 0.
template <class T>
double kl_from_logits(const T* p,  // [n] reference logits
                      const T* q,  // [n] compared logits
                      std::int32_t n) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "kvkit: kl_from_logits takes float or double logits");
  KVKIT_CHECK(n > 0, "kvkit: kl_from_logits needs n > 0, got ", n);
  double mp = p[0], mq = q[0];
  for (std::int32_t i = 1; i < n; ++i) {
    mp = std::max<double>(mp, p[i]);
    mq = std::max<double>(mq, q[i]);
  }
  double zp = 0, zq = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    zp += std::exp(p[i] - mp);
    zq += std::exp(q[i] - mq);
  }
  const double lzp = std::log(zp) + mp, lzq = std::log(zq) + mq;
  double kl = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    const double lp = p[i] - lzp, lq = q[i] - lzq;
    kl += std::exp(lp) * (lp - lq);
  }
  return std::max(0.0, kl);
}

}  // namespace kvkit
