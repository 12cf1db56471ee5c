#pragma once
// Fidelity of a policy run against the full-cache run, step by step: both engines get
// the same tokens (the full run's greedy choice is teacher-forced into the policy run,
// so their contexts never drift apart) and the next-token distributions are compared.
//
//   top1_agreement = fraction of steps whose argmax (lowest id on ties) is the same
//   KL             = sum_v p_full(v) * (log p_full(v) - log p_policy(v)), in nats, with
//                    p = softmax(logits) computed in float64; mean, median and max over
//                    steps (the median: the middle value, the mean of the two middle ones
//                    for an even count).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvkit/core/error.hpp"
#include "kvkit/core/logits.hpp"

namespace kvkit {
namespace engine {

/// KL(softmax(full) || softmax(policy)) in nats, float64 (kvkit/core/logits.hpp).
using kvkit::kl_from_logits;

/// Index of the largest logit, lowest index on ties (the engine's greedy rule).
inline std::int32_t argmax_logit(const float* x,  // [n]
                                 std::int32_t n) {
  std::int32_t best = 0;
  for (std::int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

/// Accumulates per-step comparisons of a policy run with the full-cache run.
class FidelityMeter {
 public:
  /// Compares one step's next-token logits of one sequence.
  void add(const float* full,    // [vocab]
           const float* policy,  // [vocab]
           std::int32_t vocab) {
    const double kl = kl_from_logits(full, policy, vocab);
    ++steps_;
    agree_ += argmax_logit(full, vocab) == argmax_logit(policy, vocab);
    sum_kl_ += kl;
    max_kl_ = std::max(max_kl_, kl);
    kls_.push_back(kl);
  }
  std::int64_t steps() const { return steps_; }
  double top1_agreement() const { return steps_ ? static_cast<double>(agree_) / steps_ : 1.0; }
  double mean_kl() const { return steps_ ? sum_kl_ / steps_ : 0.0; }
  double max_kl() const { return max_kl_; }
  double median_kl() const {
    if (kls_.empty()) return 0.0;
    std::vector<double> v = kls_;
    const std::size_t h = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(h), v.end());
    if (v.size() % 2 != 0) return v[h];
    const double hi = v[h];
    return (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(h)) + hi) / 2;
  }

 private:
  std::int64_t steps_ = 0, agree_ = 0;
  double sum_kl_ = 0, max_kl_ = 0;
  std::vector<double> kls_;  // [steps] KL of every step (for the median)
};

}  // namespace engine
}  // namespace kvkit
