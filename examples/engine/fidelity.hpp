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
    agree_ += argmax_logit(full, vocab) == argmax_logit(policy, vocab);
    kls_.push_back(kl_from_logits(full, policy, vocab));
  }
  std::int64_t steps() const { return static_cast<std::int64_t>(kls_.size()); }
  double top1_agreement() const { return kls_.empty() ? 1.0 : static_cast<double>(agree_) / steps(); }
  double mean_kl() const {
    double sum = 0;
    for (double kl : kls_) sum += kl;  // in step order
    return kls_.empty() ? 0.0 : sum / steps();
  }
  double max_kl() const {
    double m = 0;
    for (double kl : kls_) m = std::max(m, kl);
    return m;
  }
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
  std::int64_t agree_ = 0;
  std::vector<double> kls_;  // [steps] KL of every step: mean, median and max derive from it
};

}  // namespace engine
}  // namespace kvkit
