#pragma once
// Host-device twins of the Sketcher's strict pre-pass (sketch/eps.hpp), for the CUDA
// kernels of kernels/cuda/eps.cuh. Scope: method box, strict mode, group_pages 1,
// any score_budget / score_fraction.
//
// Every per-item piece of the CUDA pre-pass is a KVKIT_HOST_DEVICE function here, so a
// plain host test (no GPU) runs the very code the kernels run, in the kernels' schedule
// (prepass_host below), and compares it with SketchSelector:
//   summaries   box min/max per channel, max‖k‖, ‖max(|min|, |max|)‖ of one page and
//               kv head (SketchStore::add_key's values; a full rebuild of the page equals
//               the CPU's token-by-token updates bit for bit: min / max / max are applied
//               in token order, the amax norm is a function of the final box)
//   bounds      box_norm_bound: min(box + slack, ‖q‖·max‖k‖) of one (page, query head),
//               detail::box_bounds_block's 8 float lanes written out as scalars
//   ranks       rank_of: decreasing bound, ties by increasing candidate position
//   masses      logit_lo / page_mass: SketchSelector::logit_lo's 8 lanes and the exp sum
//   ε rule      walk: detail::certified_walk's three phases (the first possible stop,
//               the exact test there, the next possible stop from the exact mass, then
//               one rank at a time) over the tail sums in rank order. The jumps search a
//               monotone predicate by bisection, as certified_walk's quickselect does, so
//               they find the same ranks.
// Arithmetic: every float / double operation the CPU does separately is done with the
// _rn intrinsics on the device (never contracted into an FMA), in the CPU's order.
// Where bits can still differ: the device's double exp / log (CUDA's, <= 1 ulp) against
// glibc's. exp enters the masses, the quantised mass bounds and s0, so a GPU decision
// can differ from the CPU's only where a stop test is within ~1e-15 relative of its
// threshold; the host twin (this file compiled by the host compiler) uses std::exp and is
// bit for bit the CPU's. log is only used for a partial page, which is never a candidate
// (the last page is always visited, last_n >= 1); full pages use the host's log_full.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvkit/core/config.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/sketch/eps.hpp"

namespace kvkit {
namespace sketch {
namespace twin {

// IEEE operations that the device compiler must not contract (mul.rn / add.rn are never
// fused); the host gets plain operators. Bit equality with the CPU select on the host
// needs a host build that does not fuse either: x86-64 baseline has no FMA, and with FMA
// enabled GCC's default -ffp-contract=fast may fuse a product into a sum on one side
// only, so test_eps_twin is built with -ffp-contract=off.
KVKIT_HOST_DEVICE float fmul(float a, float b) {
#if KVKIT_IN_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVKIT_HOST_DEVICE float fadd(float a, float b) {
#if KVKIT_IN_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVKIT_HOST_DEVICE double dmul(double a, double b) {
#if KVKIT_IN_DEVICE_CODE
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
KVKIT_HOST_DEVICE double dadd(double a, double b) {
#if KVKIT_IN_DEVICE_CODE
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
KVKIT_HOST_DEVICE double dsub(double a, double b) {
#if KVKIT_IN_DEVICE_CODE
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
/// exp in double: CUDA's on the device (<= 1 ulp), std::exp (glibc) on the host.
KVKIT_HOST_DEVICE double exp_d(double x) {
#if KVKIT_IN_DEVICE_CODE
  return exp(x);
#else
  return std::exp(x);
#endif
}
KVKIT_HOST_DEVICE double log_d(double x) {
#if KVKIT_IN_DEVICE_CODE
  return log(x);
#else
  return std::log(x);
#endif
}

/// Smallest float >= x (detail::round_up_float; x finite).
KVKIT_HOST_DEVICE float round_up_f(double x) {
#if KVKIT_IN_DEVICE_CODE
  float f = __double2float_rn(x);
  if (static_cast<double>(f) < x) f = nextafterf(f, HUGE_VALF);
#else
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, HUGE_VALF);
#endif
  return f;
}

/// One layer's box summaries indexed by physical page id (group_pages 1): what the
/// strict box pre-pass reads. A page's summary is valid for a view iff count[page] equals
/// the tokens the page holds there (the host re-summarises every page it writes or
/// rewrites, see EpsCudaConfig::update_summaries). Plain pointers: host or device memory.
struct BoxSummaries {
  float* box_min = nullptr;          // [num_pages, Hkv, d]
  float* box_max = nullptr;          // [num_pages, Hkv, d]
  float* max_norm = nullptr;         // [num_pages, Hkv] max‖k‖ rounded up
  float* amax_norm = nullptr;        // [num_pages, Hkv] ‖max(|min|, |max|)‖ rounded up
  std::int32_t* count = nullptr;     // [num_pages] tokens summarised, 0: none
  std::int32_t num_pages = 0, num_kv_heads = 0, head_dim = 0;

  KVKIT_HOST_DEVICE std::int64_t row(std::int32_t page, std::int32_t h) const {
    return static_cast<std::int64_t>(page) * num_kv_heads + h;
  }
};

/// Channel c of the box of n keys (k0 + t·stride, t < n): std::min / std::max in token
/// order, as add_key applies them (signed zeros keep the CPU's choice).
template <class T>
KVKIT_HOST_DEVICE void box_channel(const T* k0, std::int64_t stride, std::int32_t n, std::int32_t c, float* mn,
                                   float* mx) {
  float lo = HUGE_VALF, hi = -HUGE_VALF;
  for (std::int32_t t = 0; t < n; ++t) {
    const float x = to_float(k0[t * stride + c]);
    lo = x < lo ? x : lo;  // std::min(lo, x)
    hi = hi < x ? x : hi;  // std::max(hi, x)
  }
  *mn = lo;
  *mx = hi;
}

/// round_up(‖k‖) of one key: Σ x² in double in channel order (each product exact).
template <class T>
KVKIT_HOST_DEVICE float key_norm_up(const T* k, std::int32_t d) {
  double nn = 0.0;
  for (std::int32_t c = 0; c < d; ++c) {
    const double x = to_float(k[c]);
    nn = dadd(nn, dmul(x, x));
  }
  return round_up_f(sqrt(nn));
}

/// round_up(‖(max(|min_c|, |max_c|))_c‖·(1 + 1e-12)) of a final box.
KVKIT_HOST_DEVICE float amax_norm_up(const float* mn /* [d] */, const float* mx /* [d] */, std::int32_t d) {
  double an = 0.0;
  for (std::int32_t c = 0; c < d; ++c) {
    const double a0 = fabs(static_cast<double>(mn[c])), a1 = fabs(static_cast<double>(mx[c]));
    const double a = a0 < a1 ? a1 : a0;  // std::max(a0, a1)
    an = dadd(an, dmul(a, a));
  }
  return round_up_f(dmul(sqrt(an), 1 + 1e-12));
}

/// ‖q‖ in double (the selector's qn_).
KVKIT_HOST_DEVICE double qnorm_of(const float* q /* [d] */, std::int32_t d) {
  double qn = 0;
  for (std::int32_t c = 0; c < d; ++c) qn = dadd(qn, dmul(static_cast<double>(q[c]), q[c]));
  return sqrt(qn);
}

/// Calls f(c) for the channels of float lane j (0..7) in order: c ≡ j mod 8 below
/// 8⌊d/8⌋, then for lane 0 the tail channels (the CPU's 8-lane sums).
template <class F>
KVKIT_HOST_DEVICE void for_lane_channels(std::int32_t d, std::int32_t j, F&& f) {
  const std::int32_t d8 = d / 8 * 8;
  for (std::int32_t c = j; c < d8; c += 8) f(c);
  if (j == 0)
    for (std::int32_t c = d8; c < d; ++c) f(c);
}

/// Lane j (0..7) of box_hi: Σ max(q_c·min_c, q_c·max_c) over the channels c ≡ j mod 8
/// below 8⌊d/8⌋ in channel order, lane 0 going on with the tail channels. The CUDA
/// pre-pass gives each lane its own thread (8 threads read 8 adjacent floats per step).
KVKIT_HOST_DEVICE float box_hi_lane(const float* mn /* [d] */, const float* mx /* [d] */, std::int32_t d,
                                    const float* q /* [d] */, std::int32_t j) {
  float h = 0.f;
  for_lane_channels(d, j, [&](std::int32_t c) {
    const float a = fmul(q[c], mn[c]), b = fmul(q[c], mx[c]);
    h = fadd(h, a > b ? a : b);
  });
  return h;
}

/// Σ_c max(q_c·min_c, q_c·max_c) with detail::box_bounds_block's arithmetic: 8 float lanes
/// (box_hi_lane), lanes summed in double in lane order.
KVKIT_HOST_DEVICE double box_hi(const float* mn /* [d] */, const float* mx /* [d] */, std::int32_t d,
                                const float* q /* [d] */) {
  double hs = 0;
  for (std::int32_t j = 0; j < 8; ++j) hs = dadd(hs, box_hi_lane(mn, mx, d, q, j));
  return hs;
}

/// box_norm_bound given box_hi's value hs.
KVKIT_HOST_DEVICE double box_norm_bound_of(double hs, std::int32_t d, double qnorm, float amax_norm,
                                           float max_norm) {
  const double box = dadd(hs, detail::box_slack(d, qnorm, amax_norm));
  const double nrm = dmul(dmul(qnorm, static_cast<double>(max_norm)), 1 + 1e-12);
  return nrm < box ? nrm : box;  // std::min(box, nrm)
}

/// Certified bound min(box + slack, ‖q‖·max‖k‖·(1 + 1e-12)) of one (page, query head): the
/// value detail::box_norm_bounds stores for it.
KVKIT_HOST_DEVICE double box_norm_bound(const float* mn /* [d] */, const float* mx /* [d] */, std::int32_t d,
                                        const float* q /* [d] */, double qnorm, float amax_norm, float max_norm) {
  return box_norm_bound_of(box_hi(mn, mx, d, q), d, qnorm, amax_norm, max_norm);
}

/// Lane j (0..7) of logit_lo: the float sums of q_c·k_c and |q_c·k_c| over the channels
/// c ≡ j mod 8 below 8⌊d/8⌋, lane 0 going on with the tail channels.
struct LogitLane {
  float a = 0.f, m = 0.f;
};
template <class T>
KVKIT_HOST_DEVICE LogitLane logit_lane(const float* q /* [d] */, const T* k /* [d] */, std::int32_t d, std::int32_t j) {
  LogitLane l;
  for_lane_channels(d, j, [&](std::int32_t c) {
    const float x = fmul(q[c], to_float(k[c]));
    l.a = fadd(l.a, x);
    l.m = fadd(l.m, fabsf(x));
  });
  return l;
}

/// logit_lo from its 8 lanes: the lane sums in double in lane order, minus the rounding
/// bound.
KVKIT_HOST_DEVICE double logit_lo_of(const float* a /* [8] */, const float* m /* [8] */, std::int32_t d) {
  double acc = 0, mag = 0;
  for (int j = 0; j < 8; ++j) {
    acc = dadd(acc, a[j]);
    mag = dadd(mag, m[j]);
  }
  return dsub(acc, dmul(detail::float_sum_slack(d), mag));
}

/// SketchSelector::logit_lo: q·k in 8 float lanes minus its rounding bound.
template <class T>
KVKIT_HOST_DEVICE double logit_lo(const float* q /* [d] */, const T* k /* [d] */, std::int32_t d) {
  float a[8], m[8];
  for (std::int32_t j = 0; j < 8; ++j) {
    const LogitLane l = logit_lane(q, k, d, j);
    a[j] = l.a;
    m[j] = l.m;
  }
  return logit_lo_of(a, m, d);
}

/// One step of the always-visited pages' online log-sum-exp (x = s·logit, in token order).
KVKIT_HOST_DEVICE void online_step(double x, double* mx, double* S) {
  if (x > *mx) {
    *S = dadd(dmul(*S, exp_d(dsub(*mx, x))), 1.0);
    *mx = x;
  } else {
    *S = dadd(*S, exp_d(dsub(x, *mx)));
  }
}

/// Σ exp(s·logit_lo − ref) over the n keys k0 + t·stride (one page, token order).
template <class T>
KVKIT_HOST_DEVICE double page_mass(const float* q /* [d] */, const T* k0, std::int64_t stride, std::int32_t n,
                                   std::int32_t d, double scale, double ref) {
  double m = 0;
  for (std::int32_t t = 0; t < n; ++t) m = dadd(m, exp_d(dsub(dmul(scale, logit_lo(q, k0 + t * stride, d)), ref)));
  return m;
}

/// Tokens of page j of a sequence of len tokens in pages of P (only the last is partial).
KVKIT_HOST_DEVICE std::int32_t page_tokens(std::int32_t len, std::int32_t P, std::int32_t j) {
  return len - j * P < P ? len - j * P : P;
}

/// Log-mass bound of a candidate page of ntok tokens with logit bound u.
KVKIT_HOST_DEVICE double log_mass_bound(std::int32_t ntok, std::int32_t page_size, double log_full, double scale,
                                        double u) {
  return dadd(ntok == page_size ? log_full : log_d(static_cast<double>(ntok)), dmul(scale, u));
}

/// Rank order of (bound ka, candidate a) and (kb, b): decreasing bound, ties by increasing
/// position (certified_walk's `before`); candidate -1 (sort padding) goes after every
/// candidate.
KVKIT_HOST_DEVICE bool rank_before(double ka, std::int32_t a, double kb, std::int32_t b) {
  if (a < 0) return false;
  if (b < 0) return true;
  return ka > kb || (ka == kb && a < b);
}

/// rank_before's order of bounds as one unsigned key: a smaller key ranks first (a larger
/// bound; -0 and +0 give one key, as == compares them), equal keys exactly where the
/// bounds are equal, ties then going by position. The device's radix selection of the top
/// ranks (eps.cuh) cuts on it. Bounds are never NaN (finite summaries and queries).
KVKIT_HOST_DEVICE std::uint64_t rank_key(double u) {
  if (u == 0) u = 0.0;
  std::uint64_t b;
#ifdef __CUDA_ARCH__
  b = static_cast<std::uint64_t>(__double_as_longlong(u));
#else
  std::memcpy(&b, &u, sizeof b);
#endif
  const std::uint64_t asc = (b >> 63) != 0 ? ~b : (b | (1ull << 63));  // increasing with u
  return ~asc;
}

/// A cut of the rank order: candidate i with key k = rank_key(bound) is above it iff
/// (k & mask) < prefix, or (k & mask) == prefix and i <= tie_pos.
struct RankCut {
  std::uint64_t mask = 0, prefix = 0;
  std::int32_t tie_pos = 0x7fffffff;
  KVKIT_HOST_DEVICE bool has(std::uint64_t k, std::int32_t i) const {
    const std::uint64_t m = k & mask;
    return m < prefix || (m == prefix && i <= tie_pos);
  }
};

/// The factor walk's relaxed stop tests carry for n candidates (double rounding of S).
KVKIT_HOST_DEVICE double stop_factor(std::int32_t n) {
  return dadd(1.0, dmul(dadd(dmul(4.0, static_cast<double>(n)), 64.0), 0x1p-53));
}

/// rank_before of candidates a, b with their bounds in ub.
KVKIT_HOST_DEVICE bool rank_less(const double* ub /* [n] */, std::int32_t a, std::int32_t b) {
  return a >= 0 && (b < 0 || rank_before(ub[a], a, ub[b], b));
}

/// Rank of candidate i among n (O(n); the host schedule's way).
KVKIT_HOST_DEVICE std::int32_t rank_of(const double* ub /* [n] */, std::int32_t n, std::int32_t i) {
  std::int32_t r = 0;
  for (std::int32_t j = 0; j < n; ++j) r += rank_less(ub, j, i) ? 1 : 0;
  return r;
}

/// Smallest power of two >= n (0 <= n <= 2^30; larger n give 2^30, callers refuse them).
KVKIT_HOST_DEVICE std::int32_t pow2_at_least(std::int32_t n) {
  std::int32_t p = 1;
  while (p < n && p < (1 << 30)) p <<= 1;
  return p;
}

/// Pair p (0 <= p < n2/2) of stage (k, j) of a bitonic sorting network over the (key,
/// candidate) pairs key/ord[0..n2) (n2 a power of two; k = 2, 4, .., n2; j = k/2, .., 1):
/// p maps to the elements i (bit j clear) and i | j, so a stage's pairs are disjoint and a
/// thread per pair runs it. Afterwards ord is in rank order (rank_before; padding -1
/// last) and key holds each candidate's bound: the kernel's way to the rank order,
/// O(n log² n) instead of rank_of's O(n²). The keys move with the candidates, so a
/// comparison needs no dependent load.
KVKIT_HOST_DEVICE void bitonic_pair_step(double* key /* [n2] */, std::int32_t* ord /* [n2] */, std::int32_t k,
                                         std::int32_t j, std::int32_t p) {
  const std::int32_t i = ((p & ~(j - 1)) << 1) | (p & (j - 1)), l = i | j;
  const double ki = key[i], kl = key[l];
  const std::int32_t oi = ord[i], ol = ord[l];
  if ((i & k) == 0 ? rank_before(kl, ol, ki, oi) : rank_before(ki, oi, kl, ol)) {
    key[i] = kl;
    key[l] = ki;
    ord[i] = ol;
    ord[l] = oi;
  }
}

/// certified_walk's relaxed test: a stop at rank p is possible if every rank in
/// [start, p) held its bound (tail sums T0 = T_start, Tp = T_p; s_base = S at start).
KVKIT_HOST_DEVICE bool stop_possible(std::int32_t p, std::int32_t lim, const detail::Mass128& Tp,
                                     const detail::Mass128& T0, double s_base, double eps, double f) {
  if (p >= lim) return true;
  detail::Mass128 seen = T0;
  seen.sub(Tp);
  return detail::tail_bound(Tp) <= dmul(dmul(eps, f), dadd(s_base, seen.value()));
}

/// Smallest p in [first, lim] with stop_possible (monotone in p; true at lim).
KVKIT_HOST_DEVICE std::int32_t first_possible(const detail::Mass128* tail /* [n+1] */, std::int32_t first,
                                              std::int32_t lim, std::int32_t start, double s_base, double eps,
                                              double f) {
  std::int32_t lo = first, hi = lim;  // answer in [lo, hi]
  while (lo < hi) {
    const std::int32_t mid = lo + (hi - lo) / 2;
    if (stop_possible(mid, lim, tail[mid], tail[start], s_base, eps, f))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

/// Omitted-mass bound at a stop with tail T and exact mass S.
KVKIT_HOST_DEVICE double omitted_of(const detail::Mass128& T, double S) {
  const double t = detail::tail_bound(T);
  return t > 0 ? t / dadd(t, S) : 0.0;
}

struct WalkOut {
  std::int32_t visited = 0;  // ranks [0, visited) are visited
  double omitted = 0;
};

/// Ranks the walk may visit among nc candidates: top_pages of them (0: no cap).
KVKIT_HOST_DEVICE std::int32_t walk_limit(std::int32_t nc, std::int32_t top_pages) {
  return top_pages > 0 && top_pages < nc ? top_pages : nc;
}

/// Ranks whose order (and tail sums) the walk can need: with a scoring cap below lim it
/// never scores, stops at or reads the tail of a rank past the cap (over it, it gives up
/// and visits ranks [0, lim) as a set), so only the top `reach` ranks need sorting.
KVKIT_HOST_DEVICE std::int32_t walk_reach(std::int32_t lim, std::int32_t budget) {
  return budget > 0 && budget < lim ? budget : lim;
}

/// detail::certified_walk over n candidates in rank order: tail[r] =
/// Σ w over ranks >= r (tail[n] = 0), s0 the always-visited mass relative to ref, budget
/// the cap on scored ranks (detail::score_limit; 0: none): where a stop would need more,
/// ranks [0, lim) are visited and the mass seen so far bounds the omitted tail.
/// tail is read only at ranks [0, known], known >= walk_reach(lim, budget), and tail_lim
/// is tail[lim] (the omitted bound of a give-up): the device sorts only `known` ranks.
/// The stop tests are monotone in the rank (exact integer tails, monotone roundings), so
/// bisecting [0, known] after one test at `known` finds the rank bisecting [0, lim] finds.
/// score(r0, r1) must make mass[r] (the exact relative mass of rank r) readable for r in
/// [r0, r1); it is called with increasing, disjoint ranges, from uniform control flow (on
/// the device every thread of the block runs this function on the same data and score is
/// a block-wide step). `chunk`: ranks scored at once in the one-by-one phase.
template <class ScoreFn>
KVKIT_HOST_DEVICE WalkOut walk(const detail::Mass128* tail /* [known+1] */, std::int32_t n, std::int32_t lim,
                               double s0, double eps, std::int32_t budget, const double* mass /* [n] */,
                               std::int32_t chunk, std::int32_t known, const detail::Mass128& tail_lim,
                               ScoreFn&& score) {
  WalkOut res;
  lim = lim < 0 ? 0 : (lim > n ? n : lim);
  if (lim == 0) {
    res.omitted = omitted_of(tail[0], s0);
    return res;
  }
  const double f = stop_factor(n);
  // The first possible stop in [first, lim] (first_possible), or lim when it lies past
  // `known` (then past the cap: known < lim only when the cap is below lim).
  auto next_stop = [&](std::int32_t first, std::int32_t start, double s_base) -> std::int32_t {
    if (known >= lim) return first_possible(tail, first, lim, start, s_base, eps, f);
    if (first > known || !stop_possible(known, lim, tail[known], tail[start], s_base, eps, f)) return lim;
    return first_possible(tail, first, known, start, s_base, eps, f);
  };
  // Phase 1: the first rank where a stop is possible at all (rank 0 included).
  std::int32_t a = next_stop(0, 0, s0);
  // Over the budget: ranks [0, lim) visited, unscored beyond those counted in S.
  auto give_up = [&](double S_seen) {
    res.visited = lim;
    res.omitted = omitted_of(tail_lim, S_seen);
    return res;
  };
  if (a == lim || (budget > 0 && a > budget)) return give_up(s0);  // visited unscored, S = s0
  double S = s0;
  std::int32_t scored = a;
  if (a > 0) score(0, a);
  for (std::int32_t r = 0; r < a; ++r) S = dadd(S, mass[r]);
  std::int32_t cnt = a;
  if (detail::tail_bound(tail[cnt]) <= dmul(eps, S)) {
    res.visited = cnt;
    res.omitted = omitted_of(tail[cnt], S);
    return res;
  }
  // Phase 2: rank cnt failed its exact test; the next possible stop after it.
  a = next_stop(cnt + 1, cnt, S);
  if (a == lim && lim == n) {  // everything visited, nothing left to bound
    res.visited = n;
    res.omitted = 0;
    return res;
  }
  if (budget > 0 && a > budget) return give_up(S);
  if (a > scored) {
    score(scored, a);
    scored = a;
  }
  for (std::int32_t r = cnt; r < a; ++r) S = dadd(S, mass[r]);
  cnt = a;
  // Phase 3: one rank at a time.
  while (cnt < lim && !(detail::tail_bound(tail[cnt]) <= dmul(eps, S))) {
    if (budget > 0 && cnt + 1 > budget) return give_up(S);
    if (cnt >= scored) {
      std::int32_t to = lim - cnt < chunk ? lim : cnt + chunk;
      if (budget > 0 && to > budget) to = budget;  // never read K past the cap (cnt < budget here)
      score(scored, to);
      scored = to;
    }
    S = dadd(S, mass[cnt]);
    ++cnt;
  }
  res.visited = cnt;
  res.omitted = omitted_of(tail[cnt], S);
  return res;
}

/// The pre-pass arguments both schedules (prepass_host, the CUDA kernel) take.
struct PrepassArgs {
  double eps = 1e-3;
  std::int32_t last_n = 1;
  std::int32_t top_pages = 0;       // 0: no cap
  std::int32_t score_budget = 0;    // SketchParams::score_budget (0: none)
  double score_fraction = 1;        // SketchParams::score_fraction (1: none)
  std::uint64_t head_mask = ~0ull;  // bit h: pre-pass on for kv head h (this layer)
  double scale = 1;                 // softmax scale (the float sm_scale widened)
  double log_full = 0;              // std::log(page_size), computed on the host
};

/// Pre-pass on for kv head h under head_mask (heads past 64 are always on: a head_on list
/// is limited to 64 kv heads on CUDA).
KVKIT_HOST_DEVICE bool head_is_on(std::uint64_t head_mask, std::int32_t h) {
  return h >= 64 || ((head_mask >> h) & 1u) != 0;
}

/// True when page j (ntok tokens, physical id pid) of a (sequence, kv head) with np pages
/// is always visited: pre-pass off, one of the last last_n, or no valid summary.
KVKIT_HOST_DEVICE bool always_visited(const BoxSummaries& s, bool on, std::int32_t j, std::int32_t np,
                                      std::int32_t last_n, std::int32_t pid, std::int32_t ntok) {
  return !on || j >= np - last_n || s.count[pid] != ntok;
}

/// Host schedule of the CUDA pre-pass (same functions, same order of every sum), for
/// views in host memory: visit [batch*Hkv, max_pages] (1: page read), omitted [batch*Hq],
/// then indptr/subset as the emit kernel writes them. The tests compare it with
/// SketchSelector; eps.cuh's kernels run the same steps with a block per (b, query head).
template <class T>
void prepass_host(const PagedKVView<T>& view, const T* q /* [batch, Hq, d] */, std::int32_t hq,
                  const BoxSummaries& s, const PrepassArgs& a, std::vector<std::int32_t>& indptr,
                  std::vector<std::int32_t>& subset, std::vector<double>& omitted) {
  const std::int32_t hkv = view.num_kv_heads, d = view.head_dim, P = view.page_size, grp = hq / hkv;
  indptr.assign(static_cast<std::size_t>(view.batch_size) * hkv + 1, 0);
  subset.clear();
  omitted.assign(static_cast<std::size_t>(view.batch_size) * hq, 0.0);
  std::vector<std::int32_t> cand, alw, ord;
  std::vector<double> ub, mass;
  std::vector<detail::Mass128> w, tail;
  std::vector<std::uint8_t> visit;
  std::vector<float> qf(static_cast<std::size_t>(d));
  for (std::int32_t b = 0; b < view.batch_size; ++b) {
    const std::int32_t np = view.num_pages(b), len = view.seq_len(b);
    for (std::int32_t h = 0; h < hkv; ++h) {
      const bool on = head_is_on(a.head_mask, h);
      cand.clear();
      alw.clear();
      visit.assign(static_cast<std::size_t>(np), 0);
      for (std::int32_t j = 0; j < np; ++j) {
        const std::int32_t ntok = page_tokens(len, P, j);
        if (always_visited(s, on, j, np, a.last_n, view.page_id(b, j), ntok)) {
          alw.push_back(j);
          visit[j] = 1;
        } else {
          cand.push_back(j);
        }
      }
      const std::int32_t nc = static_cast<std::int32_t>(cand.size());
      for (std::int32_t gq = 0; on && gq < grp; ++gq) {
        const std::int32_t qh = h * grp + gq;
        const T* qp = q + (static_cast<std::size_t>(b) * hq + qh) * d;
        for (std::int32_t c = 0; c < d; ++c) qf[c] = to_float(qp[c]);
        const double qn = qnorm_of(qf.data(), d);
        double mx = -HUGE_VAL, S = 0;
        for (std::int32_t j : alw)
          for (std::int32_t t = j * P; t < len && t < (j + 1) * P; ++t)
            online_step(dmul(a.scale, logit_lo(qf.data(), view.k_ptr(b, t, h), d)), &mx, &S);
        ub.assign(static_cast<std::size_t>(nc), 0.0);
        double m = -HUGE_VAL;
        for (std::int32_t i = 0; i < nc; ++i) {
          const std::int32_t j = cand[i], pid = view.page_id(b, j);
          const std::int64_t r = s.row(pid, h);
          const double u = box_norm_bound(s.box_min + r * d, s.box_max + r * d, d, qf.data(), qn, s.amax_norm[r],
                                          s.max_norm[r]);
          ub[i] = log_mass_bound(page_tokens(len, P, j), P, a.log_full, a.scale, u);
          m = m < ub[i] ? ub[i] : m;
        }
        const double ref = mx < m ? m : mx;
        if (!(S > 0) || !std::isfinite(mx)) {
          for (std::int32_t j : cand) visit[j] = 1;
          omitted[static_cast<std::size_t>(b) * hq + qh] = 0;
          continue;
        }
        w.assign(static_cast<std::size_t>(nc), detail::Mass128{});
        ord.assign(static_cast<std::size_t>(nc), 0);
        for (std::int32_t i = 0; i < nc; ++i) {
          w[i] = detail::quantise_mass(dsub(ub[i], ref));
          ord[rank_of(ub.data(), nc, i)] = i;
        }
        tail.assign(static_cast<std::size_t>(nc) + 1, detail::Mass128{});
        for (std::int32_t r = nc - 1; r >= 0; --r) {
          tail[r] = tail[r + 1];
          tail[r].add(w[ord[r]]);
        }
        mass.assign(static_cast<std::size_t>(nc), -1.0);
        const double s0 = dmul(S, exp_d(dsub(mx, ref)));
        const std::int32_t lim = walk_limit(nc, a.top_pages);
        const WalkOut res = walk(tail.data(), nc, lim, s0, a.eps, detail::score_limit(a.score_budget, a.score_fraction, nc),
                                 mass.data(), 256, nc, tail[lim], [&](std::int32_t r0, std::int32_t r1) {
          for (std::int32_t r = r0; r < r1; ++r) {
            const std::int32_t j = cand[ord[r]];
            const std::int32_t n = page_tokens(len, P, j);
            mass[r] = page_mass(qf.data(), view.k_ptr(b, j * P, h), view.k_stride_token, n, d, a.scale, ref);
          }
        });
        for (std::int32_t r = 0; r < res.visited; ++r) visit[cand[ord[r]]] = 1;
        omitted[static_cast<std::size_t>(b) * hq + qh] = res.omitted;
      }
      for (std::int32_t j = 0; j < np; ++j)
        if (visit[j]) subset.push_back(j);
      indptr[static_cast<std::size_t>(b) * hkv + h + 1] = static_cast<std::int32_t>(subset.size());
    }
  }
}

}  // namespace twin
}  // namespace sketch
}  // namespace kvkit
