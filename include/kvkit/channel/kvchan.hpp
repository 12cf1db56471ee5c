#pragma once
// ChannelSelector (seed kvchan): dynamic per-channel compression of the KV cache.
//
// The math of the policy, engine-independent:
//   1. Importance per (layer, kv head, dim d):
//        EMA      ema_k[d] <- a * ema_k[d] + (1 - a) * |k_d|   (same for |v_d|), per token;
//        ThinK    think_k[d] = ||Q_d|| * ||K_d||, ||Q_d||^2 = the sum of q_d^2 of the group's
//                 query heads averaged over a window of about `think_window` decode queries
//                 (an EMA with weight 1/think_window: no per-query ring to store), ||K_d||^2 an
//                 EMA of k_d^2 (option; values always use ema_v).
//        Centered centered_k[d] = E[q_d^2] * Var_t[k_d], E[q_d^2] the ThinK query statistic,
//                 Var_t[k_d] over every token observed so far (running mean of k_d and of
//                 k_d^2, not decayed: the compensation below uses the mean over all packed
//                 tokens, so the spread that matters is the spread around that mean); values
//                 then rank by Var_t[v_d] (the output error of reading a dropped dim as its
//                 mean is sum_t p_t (v_td - mu_d)). Why: softmax is shift-invariant per
//                 query, so a dropped key dim read as the constant mu_d changes the scores
//                 of the packed tokens by q_d (k_td - mu_d), whose expected square is
//                 E[q_d^2] Var_t[k_d]: large but constant channels (low-frequency RoPE
//                 pairs, bias channels) cost nothing once compensated.
//   2. Selection: every `t_update` tokens the top-rK (keys) / top-rV (values) dims per
//      (layer, head); ties go to the lower dim index; sets are stored ascending.
//      retention = |S_prev ∩ S_new| / r. A head is stable after `n_stable` consecutive
//      updates with retention >= `min_retention` (0.9) for K (when compressed) and V (when
//      rV < head_dim). The run starts in full mode (phase kProbing) and packs only when
//      every head is stable (phase kPacked; min_stable_fraction < 1 relaxes this to that
//      fraction of heads, the others packed with their latest sets, under the fidelity
//      guard); the selection is then frozen: packed tokens were stored with it. Counters
//      keep updating against the frozen sets.
//   3. Packing: a token's K row keeps its rK selected dims, its V row its rV dims
//      (pack_channels); unpacking scatters them back, zero on the dropped dims (or, for V
//      with mean compensation, the mean of the dropped dim over the packed tokens, which
//      makes the attention output of the packed part exactly what the zero-filled V plus
//      the compensation term gives). Key compensation (k_compensation): the packed score
//      is sum_sel q_d k_td + sum_dropped q_d mu_d, mu_d the mean of k_d over the packed
//      tokens of the (layer, kv head); the second term is the same for every packed token,
//      so it is added to the packed part's log-sum-exp (sm_scale times it, natural log)
//      before the merge with the window, and the kernel stays channel-restricted.
//      Residual (residual_bits 4 or 8, residual.hpp): the dropped dims are kept too, as
//      b-bit integers with one float scale per (token, head) row, so a packed row reads
//      back as its selected dims exactly and the rest to within half a scale step.
//   4. Fidelity guard: the engine's next-token logits vs a full-width baseline: top-k
//      overlap, margin drift (|(l1 - l2)_policy - (l1 - l2)_baseline| of the baseline's top
//      two tokens), KL(baseline || policy) in nats. A failure backs off: everything is
//      unpacked, the counters reset, probing restarts.
//
// Parameters are validated at construction (kvkit::Error naming the bad value).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/logits.hpp"

namespace kvkit {
namespace channel {

/// Which importance score ranks the key dims (values always use the |v| EMA).
enum class ChannelScore : unsigned char { kEma = 0, kThink = 1, kCentered = 2 };
inline const char* to_string(ChannelScore s) {
  return s == ChannelScore::kEma ? "ema" : s == ChannelScore::kThink ? "think" : "centered";
}
/// full: never pack (dense cache); dynamic: probe, pack when stable, guard, back off;
/// probe: importance statistics only (never packs).
enum class ChannelMode : unsigned char { kFull = 0, kDynamic = 1, kProbe = 2 };
/// kProbing: collecting statistics, cache full width; kPacked: old tokens packed.
enum class ChannelPhase : unsigned char { kProbing = 0, kPacked = 1 };

inline const char* to_string(ChannelMode m) {
  return m == ChannelMode::kFull ? "full" : m == ChannelMode::kDynamic ? "dynamic" : "probe";
}
inline const char* to_string(ChannelPhase p) { return p == ChannelPhase::kPacked ? "packed" : "probing"; }

/// Thresholds of the fidelity guard (conservative defaults: small KL, high overlap).
struct FidelityThresholds {
  std::int32_t top_k = 5;          // tokens compared by the overlap metric
  double min_overlap = 0.8;        // |top_k(policy) ∩ top_k(baseline)| / top_k must reach this
  double max_margin_drift = 0.5;   // logit units
  double max_kl = 1e-2;            // nats
};

/// ChannelSelector settings. validate(head_dim) throws kvkit::Error naming a bad value.
struct ChannelParams {
  std::int32_t r_k = 32;            // key dims kept per head (ignored when !compress_k)
  std::int32_t r_v = 0;             // value dims kept per head; 0 = head_dim (no V compression)
  std::int32_t window = 128;        // W: most recent tokens always kept full width
  std::int32_t t_update = 16;       // tokens between selection updates
  std::int32_t n_stable = 3;        // consecutive retained updates for stability
  double min_retention = 0.9;       // retention a stable update needs
  double min_stable_fraction = 1.0; // packing starts when this fraction of heads is stable
  float ema_decay = 0.95f;          // a in ema <- a * ema + (1 - a) * |x|
  ChannelScore score = ChannelScore::kEma;
  std::int32_t think_window = 32;   // ThinK ||Q_d|| averages about this many decode queries
  bool compress_k = true;           // false: keys stay full width (--no-k)
  bool mean_compensation = false;   // dropped V dims read as their mean over packed tokens
  bool k_compensation = false;      // dropped K dims read as their mean (an LSE bias per query)
  std::int32_t residual_bits = 0;   // 4 or 8: dropped dims kept as b-bit codes (residual.hpp); 0: dropped
  std::int32_t check_every = 16;    // tokens between fidelity checks while packed (0: never)
  FidelityThresholds thresholds;
  ChannelMode mode = ChannelMode::kDynamic;

  /// r_v with 0 resolved to head_dim.
  std::int32_t r_v_of(std::int32_t head_dim) const { return r_v == 0 ? head_dim : r_v; }
  /// Key width of packed pages: r_k when compressing keys, else head_dim.
  std::int32_t r_k_of(std::int32_t head_dim) const { return compress_k ? r_k : head_dim; }

  void validate(std::int32_t head_dim) const {
    KVKIT_CHECK(head_dim > 0, "kvchan: head_dim must be > 0, got ", head_dim);
    if (compress_k)
      KVKIT_CHECK(r_k >= 1 && r_k <= head_dim, "kvchan: rK must be in [1, head_dim ", head_dim,
                  "], got ", r_k);
    KVKIT_CHECK(r_v >= 0 && r_v <= head_dim, "kvchan: rV must be in [1, head_dim ", head_dim,
                "] (0: head_dim), got ", r_v);
    // Keys kept full width drop no dims, so a key compensation there would silently do nothing.
    KVKIT_CHECK(compress_k || !k_compensation,
                "kvchan: k_compensation needs compress_k (keys full width have no dropped dims)");
    KVKIT_CHECK(residual_bits == 0 || residual_bits == 4 || residual_bits == 8,
                "kvchan: residual bits must be 0, 4 or 8, got ", residual_bits);
    // The residual already reads the dropped dims back; a mean on top would count them twice.
    KVKIT_CHECK(residual_bits == 0 || (!mean_compensation && !k_compensation),
                "kvchan: residual bits ", residual_bits, " exclude mean / key compensation");
    KVKIT_CHECK(window >= 1, "kvchan: W must be >= 1, got ", window);
    KVKIT_CHECK(t_update >= 1, "kvchan: T_update must be >= 1, got ", t_update);
    KVKIT_CHECK(n_stable >= 1, "kvchan: N_stable must be >= 1, got ", n_stable);
    KVKIT_CHECK(min_retention > 0.0 && min_retention <= 1.0,
                "kvchan: retention threshold must be in (0, 1], got ", min_retention);
    KVKIT_CHECK(min_stable_fraction > 0.0 && min_stable_fraction <= 1.0,
                "kvchan: stable fraction must be in (0, 1], got ", min_stable_fraction);
    KVKIT_CHECK(ema_decay >= 0.f && ema_decay < 1.f, "kvchan: EMA decay must be in [0, 1), got ",
                ema_decay);
    KVKIT_CHECK(think_window >= 1, "kvchan: ThinK query window must be >= 1, got ", think_window);
    KVKIT_CHECK(check_every >= 0, "kvchan: check_every must be >= 0, got ", check_every);
    KVKIT_CHECK(thresholds.top_k >= 1, "kvchan: fidelity top_k must be >= 1, got ", thresholds.top_k);
    KVKIT_CHECK(thresholds.min_overlap >= 0.0 && thresholds.min_overlap <= 1.0,
                "kvchan: min_overlap must be in [0, 1], got ", thresholds.min_overlap);
    KVKIT_CHECK(thresholds.max_margin_drift >= 0.0, "kvchan: max_margin_drift must be >= 0, got ",
                thresholds.max_margin_drift);
    KVKIT_CHECK(thresholds.max_kl >= 0.0, "kvchan: max_kl must be >= 0, got ", thresholds.max_kl);
  }
};

/// The r dims of highest score, ascending in `out` ([r]); equal scores prefer the lower
/// dim index (a NaN score ranks below every number).
inline void top_r_channels(const float* score,  // [d]
                           std::int32_t d, std::int32_t r,
                           std::int32_t* out) {  // [r]
  std::int32_t idx[1024];
  std::vector<std::int32_t> big;
  std::int32_t* ids = idx;
  if (d > 1024) {
    big.resize(static_cast<std::size_t>(d));
    ids = big.data();
  }
  std::iota(ids, ids + d, 0);
  auto key = [&](std::int32_t i) { return std::isnan(score[i]) ? -std::numeric_limits<float>::infinity() : score[i]; };
  std::partial_sort(ids, ids + r, ids + d, [&](std::int32_t a, std::int32_t b) {
    const float sa = key(a), sb = key(b);
    return sa > sb || (sa == sb && a < b);
  });
  std::sort(ids, ids + r);
  std::copy(ids, ids + r, out);
}

/// |a ∩ b| / r for two ascending sets of r dims.
inline double retention(const std::int32_t* a,  // [r] ascending
                        const std::int32_t* b,  // [r] ascending
                        std::int32_t r) {
  std::int32_t i = 0, j = 0, common = 0;
  while (i < r && j < r) {
    if (a[i] == b[j]) {
      ++common, ++i, ++j;
    } else if (a[i] < b[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return r > 0 ? static_cast<double>(common) / r : 1.0;
}

/// dst[i, c] = src[i, channels[c]] for n rows: gathers the selected dims of n full-width
/// rows (row strides in elements) into rows of r elements. Exact (a copy).
template <class T>
void pack_channels(const T* src, std::int64_t src_stride,  // [n, src_stride], head_dim used
                   const std::int32_t* channels,           // [r] ids in [0, head_dim)
                   std::int32_t r, std::int64_t n,
                   T* dst, std::int64_t dst_stride) {      // [n, dst_stride], r used
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int32_t c = 0; c < r; ++c) dst[i * dst_stride + c] = src[i * src_stride + channels[c]];
}

/// The inverse of pack_channels for n rows: dst[i, channels[c]] = src[i, c]; every other
/// dim d of dst gets fill[d] (nullptr: zero).
template <class T>
void unpack_channels(const T* src, std::int64_t src_stride,  // [n, src_stride], r used
                     const std::int32_t* channels,           // [r] ascending ids in [0, head_dim)
                     std::int32_t r, std::int32_t head_dim, std::int64_t n,
                     const float* fill,                      // [head_dim] or nullptr
                     T* dst, std::int64_t dst_stride) {      // [n, dst_stride], head_dim used
  for (std::int64_t i = 0; i < n; ++i) {
    T* row = dst + i * dst_stride;
    for (std::int32_t d = 0; d < head_dim; ++d) row[d] = from_float<T>(fill != nullptr ? fill[d] : 0.f);
    for (std::int32_t c = 0; c < r; ++c) row[channels[c]] = src[i * src_stride + c];
  }
}

/// Fidelity metrics of one comparison (see the file comment).
struct FidelityMetrics {
  double kl = 0;            // KL(baseline || policy), nats
  double overlap = 1;       // top-k overlap fraction
  double margin_drift = 0;  // logit units
  bool passed = true;
};

/// Compares the policy's next-token logits with the baseline's (float64 softmax).
inline FidelityMetrics compare_logits(const float* baseline,  // [vocab]
                                      const float* policy,    // [vocab]
                                      std::int32_t vocab, const FidelityThresholds& th) {
  KVKIT_CHECK(vocab >= 2, "kvchan: compare_logits needs a vocabulary of >= 2, got ", vocab);
  FidelityMetrics m;
  m.kl = kl_from_logits(baseline, policy, vocab);
  const std::int32_t k = std::min(th.top_k, vocab);
  const std::int32_t k2 = std::max<std::int32_t>(k, 2);  // the margin needs the top two
  auto top = [&](const float* x) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(vocab));
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k2, ids.end(), [&](std::int32_t a, std::int32_t b) {
      return x[a] > x[b] || (x[a] == x[b] && a < b);
    });
    ids.resize(static_cast<std::size_t>(k2));
    return ids;
  };
  std::vector<std::int32_t> tb = top(baseline), tp = top(policy);
  std::int32_t common = 0;
  for (std::int32_t i = 0; i < k; ++i)
    common += std::count(tp.begin(), tp.begin() + k, tb[static_cast<std::size_t>(i)]) > 0 ? 1 : 0;
  m.overlap = static_cast<double>(common) / k;
  const std::int32_t b1 = tb[0], b2 = tb[1];
  m.margin_drift = std::fabs(static_cast<double>(policy[b1] - policy[b2]) -
                             static_cast<double>(baseline[b1] - baseline[b2]));
  m.passed = m.kl <= th.max_kl && m.overlap >= th.min_overlap && m.margin_drift <= th.max_margin_drift;
  return m;
}

/// Per-(layer, kv head) importance statistics and the stability-gated selection state
/// machine. Feed tokens with observe_kv (and decode queries with observe_q for ThinK),
/// advance the token clock with tick(); the selection updates every t_update tokens.
class ChannelSelector {
 public:
  ChannelSelector(const ChannelParams& p, std::int32_t n_layers, std::int32_t n_kv_heads,
                  std::int32_t head_dim, std::int32_t group)
      : p_(p), layers_(n_layers), heads_(n_kv_heads), dim_(head_dim), group_(group) {
    p_.validate(head_dim);
    KVKIT_CHECK(n_layers >= 1, "kvchan: n_layers must be >= 1, got ", n_layers);
    KVKIT_CHECK(n_kv_heads >= 1, "kvchan: n_kv_heads must be >= 1, got ", n_kv_heads);
    KVKIT_CHECK(group >= 1, "kvchan: query group must be >= 1, got ", group);
    rk_ = p_.r_k_of(head_dim);
    rv_ = p_.r_v_of(head_dim);
    const std::size_t hd = pairs() * static_cast<std::size_t>(dim_);
    ema_k_.assign(hd, 0.f);
    ema_v_.assign(hd, 0.f);
    if (p_.score == ChannelScore::kThink) {  // k^2 and query statistics: ThinK only
      ema_k2_.assign(hd, 0.f);
      q2_.assign(hd, 0.f);
    }
    if (p_.score == ChannelScore::kCentered) {  // running moments and query statistics
      mom_.assign(4 * hd, 0.0);
      n_obs_.assign(pairs(), 0);
      q2_.assign(hd, 0.f);
    }
    sel_k_.assign(pairs() * static_cast<std::size_t>(rk_), 0);
    sel_v_.assign(pairs() * static_cast<std::size_t>(rv_), 0);
    for (std::size_t i = 0; i < pairs(); ++i) {
      std::iota(sel_k_.begin() + static_cast<std::ptrdiff_t>(i * rk_),
                sel_k_.begin() + static_cast<std::ptrdiff_t>((i + 1) * rk_), 0);
      std::iota(sel_v_.begin() + static_cast<std::ptrdiff_t>(i * rv_),
                sel_v_.begin() + static_cast<std::ptrdiff_t>((i + 1) * rv_), 0);
    }
    frozen_k_ = sel_k_;
    frozen_v_ = sel_v_;
    counter_.assign(pairs(), 0);
    last_ret_k_.assign(pairs(), 0.0);
    last_ret_v_.assign(pairs(), 0.0);
  }

  const ChannelParams& params() const { return p_; }
  std::int32_t r_k() const { return rk_; }
  std::int32_t r_v() const { return rv_; }
  std::int32_t head_dim() const { return dim_; }
  std::int32_t n_layers() const { return layers_; }
  std::int32_t n_kv_heads() const { return heads_; }
  bool compresses_k() const { return p_.compress_k && rk_ < dim_; }
  bool compresses_v() const { return rv_ < dim_; }

  /// One token's K and V of (layer, head): updates the |k|, |v| EMAs and the k^2 EMA.
  void observe_kv(std::int32_t layer, std::int32_t head,
                  const float* k,    // [head_dim]
                  const float* v) {  // [head_dim]
    const std::size_t o = at(layer, head);
    const float a = p_.ema_decay, b = 1.f - a;
    for (std::int32_t d = 0; d < dim_; ++d) {
      ema_k_[o + d] = a * ema_k_[o + d] + b * std::fabs(k[d]);
      ema_v_[o + d] = a * ema_v_[o + d] + b * std::fabs(v[d]);
    }
    if (!ema_k2_.empty())
      for (std::int32_t d = 0; d < dim_; ++d) ema_k2_[o + d] = a * ema_k2_[o + d] + b * k[d] * k[d];
    if (!mom_.empty()) {  // running means of k, k^2, v, v^2 over every observed token
      const double w = 1.0 / static_cast<double>(++n_obs_[pair(layer, head)]);
      double* m = mom_.data() + 4 * o;
      for (std::int32_t d = 0; d < dim_; ++d) {
        const double kd = k[d], vd = v[d];
        m[d] += w * (kd - m[d]);
        m[dim_ + d] += w * (kd * kd - m[dim_ + d]);
        m[2 * dim_ + d] += w * (vd - m[2 * dim_ + d]);
        m[3 * dim_ + d] += w * (vd * vd - m[3 * dim_ + d]);
      }
    }
  }

  /// One decode step's queries of the group of (layer, kv head), for ThinK's ||Q_d||.
  void observe_q(std::int32_t layer, std::int32_t head,
                 const float* q) {  // [group, head_dim]
    if (q2_.empty()) return;  // ThinK and Centered only
    const std::size_t o = at(layer, head);
    const float w = 1.f / static_cast<float>(p_.think_window);
    for (std::int32_t d = 0; d < dim_; ++d) {
      float s = 0.f;
      for (std::int32_t g = 0; g < group_; ++g) s += q[static_cast<std::size_t>(g) * dim_ + d] * q[static_cast<std::size_t>(g) * dim_ + d];
      q2_[o + d] += w * (s - q2_[o + d]);
    }
  }

  /// Key score of dim d of (layer, head) under the configured score.
  float key_score(std::int32_t layer, std::int32_t head, std::int32_t d) const {
    const std::size_t o = at(layer, head) + static_cast<std::size_t>(d);
    if (p_.score == ChannelScore::kEma) return ema_k_[o];
    if (p_.score == ChannelScore::kCentered) return q2_[o] * variance(layer, head, 0, d);
    return std::sqrt(q2_[o]) * std::sqrt(ema_k2_[o]);
  }
  /// Value score of dim d: Var_t[v_d] under kCentered, else the |v| EMA.
  float value_score(std::int32_t layer, std::int32_t head, std::int32_t d) const {
    if (p_.score == ChannelScore::kCentered) return variance(layer, head, 2, d);
    return ema_v_[at(layer, head) + static_cast<std::size_t>(d)];
  }
  /// Running variance (E[x^2] - E[x]^2, clamped at 0) of k (which = 0) or v (which = 2)
  /// dim d over the observed tokens; kCentered only.
  float variance(std::int32_t layer, std::int32_t head, int which, std::int32_t d) const {
    const double* m = mom_.data() + 4 * at(layer, head) + static_cast<std::size_t>(which) * dim_;
    const double mean = m[d];
    return static_cast<float>(std::max(0.0, m[dim_ + d] - mean * mean));
  }
  const float* ema_k(std::int32_t layer, std::int32_t head) const { return ema_k_.data() + at(layer, head); }
  const float* ema_v(std::int32_t layer, std::int32_t head) const { return ema_v_.data() + at(layer, head); }

  /// Advances the token clock by n tokens; runs at most one selection update when a
  /// multiple of t_update was crossed (a prefill of many tokens counts as one update, so
  /// stability always needs n_stable separate updates). Returns true when the phase
  /// changed to kPacked (every head stable; the selection is frozen).
  bool tick(std::int64_t n) {
    if (n <= 0) return false;
    const std::int64_t before = clock_ / p_.t_update;
    clock_ += n;
    if (clock_ / p_.t_update == before) return false;
    return update();
  }

  /// One selection update: new top sets from the scores, retention against the previous
  /// sets, counters, stability. Returns true on the transition to kPacked (dynamic mode).
  bool update() {
    ++updates_;
    std::vector<float> sc(static_cast<std::size_t>(dim_)), sv(static_cast<std::size_t>(dim_));
    std::vector<std::int32_t> nk(static_cast<std::size_t>(rk_)), nv(static_cast<std::size_t>(rv_));
    for (std::int32_t l = 0; l < layers_; ++l)
      for (std::int32_t h = 0; h < heads_; ++h) {
        const std::size_t i = pair(l, h);
        for (std::int32_t d = 0; d < dim_; ++d) {
          sc[static_cast<std::size_t>(d)] = key_score(l, h, d);
          sv[static_cast<std::size_t>(d)] = value_score(l, h, d);
        }
        top_r_channels(sc.data(), dim_, rk_, nk.data());
        top_r_channels(sv.data(), dim_, rv_, nv.data());
        std::int32_t* ok = sel_k_.data() + i * rk_;
        std::int32_t* ov = sel_v_.data() + i * rv_;
        const double rtk = compresses_k() ? retention(ok, nk.data(), rk_) : 1.0;
        const double rtv = compresses_v() ? retention(ov, nv.data(), rv_) : 1.0;
        last_ret_k_[i] = rtk;
        last_ret_v_[i] = rtv;
        if (updates_ > 1 && rtk >= p_.min_retention && rtv >= p_.min_retention) {
          ++counter_[i];
        } else {
          counter_[i] = 0;
        }
        std::copy(nk.begin(), nk.end(), ok);
        std::copy(nv.begin(), nv.end(), ov);
      }
    if (p_.mode == ChannelMode::kDynamic && phase_ == ChannelPhase::kProbing && ready()) {
      phase_ = ChannelPhase::kPacked;
      frozen_k_ = sel_k_;
      frozen_v_ = sel_v_;
      ++packs_;
      return true;
    }
    return false;
  }

  /// A failed fidelity check: phase back to kProbing, every counter to 0 (the current sets
  /// stay, as the reference of the next retention).
  void back_off() {
    phase_ = ChannelPhase::kProbing;
    std::fill(counter_.begin(), counter_.end(), 0);
    ++backoffs_;
  }

  bool head_stable(std::int32_t layer, std::int32_t head) const {
    return counter_[pair(layer, head)] >= p_.n_stable;
  }
  std::int32_t counter(std::int32_t layer, std::int32_t head) const { return counter_[pair(layer, head)]; }
  double last_retention_k(std::int32_t layer, std::int32_t head) const { return last_ret_k_[pair(layer, head)]; }
  double last_retention_v(std::int32_t layer, std::int32_t head) const { return last_ret_v_[pair(layer, head)]; }
  /// True when enough heads are stable to pack (all of them with the default fraction 1).
  bool ready() const {
    return static_cast<double>(stable_heads()) >= p_.min_stable_fraction * static_cast<double>(counter_.size()) - 1e-9;
  }
  bool all_stable() const {
    for (std::int32_t c : counter_)
      if (c < p_.n_stable) return false;
    return true;
  }
  std::int32_t stable_heads() const {
    std::int32_t n = 0;
    for (std::int32_t c : counter_) n += c >= p_.n_stable ? 1 : 0;
    return n;
  }
  ChannelPhase phase() const { return phase_; }
  std::int64_t updates() const { return updates_; }
  std::int64_t backoffs() const { return backoffs_; }
  std::int64_t packs() const { return packs_; }
  std::int64_t clock() const { return clock_; }

  /// The latest top sets of a layer: [n_kv_heads, r_k] / [n_kv_heads, r_v], ascending rows.
  const std::int32_t* current_k(std::int32_t layer) const { return sel_k_.data() + pair(layer, 0) * rk_; }
  const std::int32_t* current_v(std::int32_t layer) const { return sel_v_.data() + pair(layer, 0) * rv_; }
  /// The sets packed pages use (frozen at the last transition to kPacked).
  const std::int32_t* packed_k(std::int32_t layer) const { return frozen_k_.data() + pair(layer, 0) * rk_; }
  const std::int32_t* packed_v(std::int32_t layer) const { return frozen_v_.data() + pair(layer, 0) * rv_; }

  /// Bytes of the selector's state (statistics, sets, counters): policy metadata.
  std::int64_t metadata_bytes() const {
    return static_cast<std::int64_t>(
        sizeof(float) * (ema_k_.size() + ema_v_.size() + ema_k2_.size() + q2_.size()) +
        sizeof(double) * (last_ret_k_.size() + last_ret_v_.size() + mom_.size()) +
        sizeof(std::int64_t) * n_obs_.size() +
        sizeof(std::int32_t) * (sel_k_.size() + sel_v_.size() + frozen_k_.size() + frozen_v_.size() +
                                counter_.size()));
  }

 private:
  std::size_t pairs() const { return static_cast<std::size_t>(layers_) * static_cast<std::size_t>(heads_); }
  std::size_t pair(std::int32_t l, std::int32_t h) const {
    return static_cast<std::size_t>(l) * static_cast<std::size_t>(heads_) + static_cast<std::size_t>(h);
  }
  std::size_t at(std::int32_t l, std::int32_t h) const { return pair(l, h) * static_cast<std::size_t>(dim_); }

  ChannelParams p_;
  std::int32_t layers_, heads_, dim_, group_, rk_ = 0, rv_ = 0;
  std::vector<float> ema_k_, ema_v_, ema_k2_;  // [L, Hkv, D]
  std::vector<float> q2_;                      // [L, Hkv, D] ThinK/Centered: windowed mean of sum_g q_d^2
  std::vector<double> mom_;                    // [L, Hkv, 4, D] Centered: means of k, k^2, v, v^2
  std::vector<std::int64_t> n_obs_;            // [L, Hkv] Centered: tokens observed
  std::vector<std::int32_t> sel_k_, sel_v_;        // [L, Hkv, r] latest sets
  std::vector<std::int32_t> frozen_k_, frozen_v_;  // [L, Hkv, r] sets of packed pages
  std::vector<std::int32_t> counter_;              // [L, Hkv]
  std::vector<double> last_ret_k_, last_ret_v_;    // [L, Hkv]
  ChannelPhase phase_ = ChannelPhase::kProbing;
  std::int64_t clock_ = 0, updates_ = 0, backoffs_ = 0, packs_ = 0;
};

}  // namespace channel
}  // namespace kvkit
