#pragma once
// Sketcher (EPS, EigenPage Summaries): per (layer, kv head, group of g pages) key summaries
// and a decode-time pre-pass that chooses which pages attention reads
// (../shared/seeds/eps-eigenpage-summaries.md, made sound). All of the policy's math is here.
//
// Summaries of one group of keys k_1..k_n (d channels), updated token by token as K is
// written (each key read once, when it lands; a group is re-read only after a kRewrite):
//   box      min_d, max_d per channel                         8d bytes
//   scalars  Σ‖k‖², max‖k‖, ‖(max(|min_d|, |max_d|))_d‖        12 bytes
//   JL       G = Σ y yᵀ, y = Φᵀk, Φ ∈ {±1}^{d×m} per kv head     4m² bytes (seed §7, §17)
//   FD       centre c (the group's first key), Frequent Directions rows B (ℓ×d) of the
//            centred keys K_c = K − 1cᵀ and the shrinkage Δ = Σδ, so that
//            BᵀB ≼ K_cᵀK_c ≼ BᵀB + Δ·I (Liberty 2013; each shrink by the
//            median σ² frees half the rows)                     4ℓd + 4d + 12 bytes
//   1-PC     u₁ (int8 + scale), λ₁, residual r² = Σ‖k−c‖² − λ₁, from FD's top direction
//                                                                d + 12 bytes
//   rotated  (method kRotBox only) per basis direction b_j (column j of a basis B fixed
//   box      once per (layer, kv head)), bounds lo_j <= b_j·k <= hi_j (rounded outward),
//            and ‖max(|lo|, |hi|)‖                              8d + 4 bytes
//            (+ B itself, 4d² bytes per (layer, kv head): the eigenvectors of the pooled
//            within-page covariance of at most kBasisFitKeys keys of the first sync()
//            that sees basis_keys tokens, or set_basis(); once fixed it never changes, so
//            summaries stay valid)
//   codes    (method kCodes only) every key of a full group coded channel by channel on
//            2^bits cells of the group's own box (code_bits 4 or 8), so each token keeps
//            its own little box: one cell per channel      ⌈g·P/16⌉·16·d·bits/8 bytes
//            (coded once, when the group is full and its box final: one more read of
//            its K; the group being filled is the newest, which is always read)
// Bounds on the largest logit max_i q·k_i of a group:
//   certified: box  Σ_d max(q_d·min_d, q_d·max_d);  norm ‖q‖·max‖k‖;
//              FD   q·c + sqrt(‖Bq‖² + Δ‖q‖²) ≥ q·c + ‖K_c q‖₂ ≥ max_i q·k_i
//                   (Cauchy–Schwarz on the centred keys, exact)
//              rotated box  Σ_j max(q'_j lo_j, q'_j hi_j) + slack, q' = Bᵀq once per query
//                   head and step; the slack covers B's distance from orthonormality
//                   (ε_B, measured in double when B is fixed) and every rounding
//                   (derivation at detail::rotate_query)
//   estimates: JL   sqrt(zᵀGz)/m with z = Φᵀq  (≈ ‖Kq‖₂ ≥ max|q·k|, the seed's bound,
//                   biased upward by ~‖K‖_F‖q‖/√m)
//              1-PC q·c + sqrt(λ₁)|u₁·q| + r‖q‖
// A lower bound on every logit is the box's Σ_d min(q_d·min_d, q_d·max_d).
// Bounds on a group's softmax mass Σ_i exp(s·q·k_i) (kCodes, certified; detail::codes_log_mass):
//   per token the box bound of its own cells, U_i = Σ_c (q_c·min_c + max(a_c, 0)) + Σ_c a_c·x_ic
//   with a_c = q_c·step_c, and the matching lower bound U_i − Σ_c|a_c|; the group's mass lies
//   in [Σ_i exp(s(U_i − Σ|a|)), Σ_i exp(s·U_i)]. A max-logit bound charges every token of a
//   group with the largest logit; these charge each token with its own.
//
// Pre-pass, per (sequence b, query head): the last `last_n` groups (and any group without a
// valid summary) are always visited and their logits computed exactly, giving the mass
// S = Σ exp(s·q·k) over them. Every other group j has the mass bound A_j = n_j·exp(s·U_j)
// (U_j: the group's upper bound on q·k, s: the softmax scale). Groups are taken in
// decreasing A_j; each visited group is scored exactly (reading its K once) and its mass
// added to S; the walk stops as soon as the bound on all groups left, Σ A_j, is <= ε·S.
// S <= Z (the softmax denominator), so the omitted mass satisfies M_Ω/Z <= ε, every
// skipped token has softmax weight <= ε, and the reported omitted-mass bound
// ΣA_Ω / (ΣA_Ω + S) >= M_Ω / Z. (The seed's rule "skip when B_p < T/α", which compares
// bounds with bounds, is not sound and is not implemented.) Strict mode uses certified
// bounds only: min(box, norm), and also FD with method kFD, the rotated box with kRotBox. With kCodes
// the mass bound of a coded group is min(n_j·exp(s·U_j), its codes' upper mass), and S also
// counts every candidate's lower mass bound (Z >= the always-visited mass + Σ_j lower_j), so the
// walk reads no keys (detail::bound_walk: the first rank where Σ A_j <= ε·S). Default mode uses
// min(certified, α·estimate) for kJL / kOnePC and its omitted bound is then an estimate.
// top_pages caps the pages visited beyond the always-visited ones (when the cap cuts,
// the ε guarantee is void but the reported bound still holds). GQA: a kv head reads the
// union of its query heads' groups. Per (layer, kv head) the pre-pass can be switched off
// (all pages read). The pre-pass reads summaries of every group and K of the visited
// groups it must score. The exact rule (tail sums as 128-bit integers, so the decisions do
// not depend on summation order; ties by logical position) is detail::certified_walk;
// it is reached by quickselect on the tail sums, scoring a group only when a later
// decision needs its mass (when no stop is possible before the cap, nothing is scored).
// score_budget > 0 and score_fraction < 1 cap the groups scored per (sequence, query head)
// (detail::score_limit): past the cap, the groups left up to top_pages are visited unscored
// (a superset, the bound still certified). The default score_fraction 0.25 gives up as soon
// as a stop would need more than a quarter of the candidates scored: scoring reads K, so
// that would cost more than attention saves on the pages it could skip.
//
// Cost per (sequence, kv head): one pass over the box arrays for all of the head's query
// heads (detail::box_norm_bounds: 8 float lanes, mul / max / add per channel and query),
// one exp per group and query head, an O(groups) selection, plus the K of scored groups.
// With kRotBox also one d×d product per query head (q' = Bᵀq) and a second box pass over
// the rotated boxes; on the K-write path one d×d product per key and kv head (y = Bᵀk),
// and once per (layer, kv head) the basis fit (one read of the keys present then, a d×d
// covariance and its Jacobi eigenvectors). Measured (bench_eps): the rotated box is
// 0.15 nats tighter than min(box, norm) on the synthetic needle traces and 0.9 nats on
// stories260K, too little to change the pages the ε rule visits at ε = 1e-3, where even
// the exact per-page max logit would save only ~15 %. kCodes: per candidate group and
// query head d float products per token on the codes (g·P·d·bits/8 bytes read, no K) and
// one exp per token; on the K-write path one read of each full group's keys.
//
// Storage: a group is identified by the physical id of its first page; its record r owns
// row r of each per-(layer, kv head) component array: box min / max [groups, d], max‖k‖
// and ‖max(|min|, |max|)‖ [groups] (what every pre-pass reads, contiguous), and the FD /
// JL / 1-PC floats [groups, layout().floats] and u₁ [groups, d]. A record also keeps
// the physical ids of its pages and their versions. The host bumps a page's version on
// every event that changes its contents (kRewrite: compaction, truncation, copies;
// allocation) and drops a record when its first page is freed; a record whose pages or
// versions differ from the sequence's page table is rebuilt from the view (one read of
// the group's K). So summaries survive page-table rewrites (a moved page keeps its
// summary as long as the group's page list is the same), and pages the host filled
// without the hooks seeing them (batched prefill) are summarised lazily on first use.
// All buffers are sized at construction / reserve(); sync() and select() never allocate.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvkit/core/config.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"

#if defined(__AVX__) || defined(__SSE2__) || defined(_M_X64)
#include "kvkit/core/immintrin.hpp"
#endif

namespace kvkit {
namespace sketch {

/// Which summary orders and bounds the groups (see the file comment).
enum class SketchMethod : unsigned char { kBox = 0, kJL = 1, kOnePC = 2, kFD = 3, kRotBox = 4, kCodes = 5 };

inline const char* to_string(SketchMethod m) {
  switch (m) {
    case SketchMethod::kBox: return "box";
    case SketchMethod::kJL: return "jl";
    case SketchMethod::kOnePC: return "1pc";
    case SketchMethod::kFD: return "fd";
    case SketchMethod::kRotBox: return "rbox";
    case SketchMethod::kCodes: return "codes";
  }
  return "?";
}

/// "box" | "jl" | "1pc" | "fd" | "rbox" | "codes"; throws kvkit::Error naming anything else.
inline SketchMethod parse_method(const std::string& s) {
  if (s == "box") return SketchMethod::kBox;
  if (s == "jl") return SketchMethod::kJL;
  if (s == "1pc") return SketchMethod::kOnePC;
  if (s == "fd") return SketchMethod::kFD;
  if (s == "rbox") return SketchMethod::kRotBox;
  if (s == "codes") return SketchMethod::kCodes;
  fail("kvkit: unknown sketch method '", s, "' (expected box, jl, 1pc, fd, rbox or codes)");
}

/// Sketcher settings; validate() (called by the constructors) throws kvkit::Error naming
/// the bad value.
struct SketchParams {
  SketchMethod method = SketchMethod::kBox;
  bool strict = true;          // certified bounds only
  double eps = 1e-3;           // omitted softmax mass budget, in (0, 1)
  double alpha = 1.1;          // safety factor on estimates (default mode), >= 1
  std::int32_t jl_dim = 8;     // m >= 1
  std::int32_t fd_rows = 8;    // ℓ >= 1
  std::int32_t group_pages = 1;  // g >= 1 pages per group
  std::int32_t last_n = 1;     // groups always visited, >= 1
  std::int32_t top_pages = 0;  // cap on pages visited beyond the always-visited ones; 0: none
  std::int32_t score_budget = 0;  // groups scored exactly per (sequence, query head) before the
                                  // rest up to the cap is visited unscored; 0: no limit (the ε rule)
  // Scoring a group reads its K, about what attention pays for the page, so a walk that
  // must score most candidates before it may stop costs more than visiting them all: the
  // walk scores at most ceil(score_fraction · candidates) groups per (sequence, query head)
  // and otherwise visits the candidates up to the cap unscored (a superset, the bound still
  // certified). In (0, 1]; 1: no limit, the plain ε rule. 0.25: below the break-even of
  // bench_eps (scoring all 4095 groups of a 64K trace took 1.6-1.9 dense attention steps).
  double score_fraction = 0.25;
  std::uint64_t seed = 0x5eed5eedULL;  // Φ
  std::int32_t basis_keys = 64;  // kRotBox: tokens a layer's view must hold before its basis is fitted, >= 2
  std::int32_t code_bits = 4;    // kCodes: bits per key channel, 4 or 8
  std::vector<std::uint8_t> head_on;  // [num_layers * num_kv_heads] 0: read all pages; empty: all on
  // true: every summary of the seed (box, scalars, JL, FD, 1-PC) whatever the method, so
  // the methods can be compared on one store. false: only what `method` reads (box and
  // scalars always, JL for jl, FD for fd and 1pc, the 1-PC for 1pc, the rotated box for
  // rbox): less memory (box only: 8d + 12 bytes per kv head and group instead of
  // ~(4l + 9)d + 4m² + 48) and less work per written key. Selections are the same.
  bool all_summaries = true;

  void validate() const {
    KVKIT_CHECK(std::isfinite(eps) && eps > 0.0 && eps < 1.0, "kvkit: sketch eps must be in (0, 1), got ", eps);
    KVKIT_CHECK(std::isfinite(alpha) && alpha >= 1.0, "kvkit: sketch alpha must be >= 1, got ", alpha);
    KVKIT_CHECK(jl_dim >= 1 && jl_dim <= 64, "kvkit: sketch JL dimension m must be in [1, 64], got ", jl_dim);
    KVKIT_CHECK(fd_rows >= 1 && fd_rows <= 64, "kvkit: sketch FD rows l must be in [1, 64], got ", fd_rows);
    KVKIT_CHECK(group_pages >= 1, "kvkit: sketch group size (pages) must be >= 1, got ", group_pages);
    KVKIT_CHECK(last_n >= 1, "kvkit: sketch last_n must be >= 1, got ", last_n);
    KVKIT_CHECK(score_budget >= 0, "kvkit: sketch score_budget must be >= 0 (0: no limit), got ", score_budget);
    KVKIT_CHECK(score_fraction > 0.0 && score_fraction <= 1.0,
                "kvkit: sketch score_fraction must be in (0, 1] (1: no limit), got ", score_fraction);
    KVKIT_CHECK(top_pages >= 0, "kvkit: sketch top_pages must be >= 0 (0: no cap), got ", top_pages);
    KVKIT_CHECK(basis_keys >= 2, "kvkit: sketch basis_keys must be >= 2, got ", basis_keys);
    KVKIT_CHECK(code_bits == 4 || code_bits == 8, "kvkit: sketch code_bits must be 4 or 8, got ", code_bits);
    KVKIT_CHECK(static_cast<int>(method) <= 5, "kvkit: unknown sketch method ", static_cast<int>(method));
  }
};

/// The FD / JL / 1-PC summaries a store keeps under params p (box and scalars always).
struct SummaryParts {
  bool jl = true, fd = true, one_pc = true;
};
inline SummaryParts summary_parts(const SketchParams& p) {
  if (p.all_summaries) return {};
  return {p.method == SketchMethod::kJL, p.method == SketchMethod::kFD || p.method == SketchMethod::kOnePC,
          p.method == SketchMethod::kOnePC};
}

namespace detail {
/// kCodes layout of one group's codes (one kv head): its tokens in blocks of 16, and in a
/// block, channel by channel, the 16 tokens' codes: 16 bytes at 8 bits (token j of the
/// block at byte j), 8 bytes at 4 bits (token j in the low nibble of byte j, token j + 8
/// in the high one). Channel-major, so the bound scores 16 tokens at once, one channel a
/// step, with no sum across vector lanes. A partial last block is padded with zeros.
/// code_blocks: blocks in a group of ntok tokens; code_block_bytes: bytes of one block.
inline std::int32_t code_blocks(std::int32_t ntok) { return (ntok + 15) / 16; }
inline std::int32_t code_block_bytes(std::int32_t d, std::int32_t bits) { return d * (bits == 8 ? 16 : 8); }
}  // namespace detail

/// Summary bytes of one (layer, kv head, group), per component (seed §7/§17 formulas).
/// `rot`: the rotated box of kRotBox (8d + 4 bytes; its basis, 4d² per (layer, kv head),
/// is counted by SketchStore::memory_bytes()). `codes`: kCodes' per-token key codes,
/// ⌈g·P/16⌉·16·d·bits/8 bytes (the grid is the box, so codes add nothing else).
struct SummaryBytes {
  std::int64_t box = 0, scalars = 0, jl = 0, fd = 0, one_pc = 0, rot = 0, codes = 0;
  std::int64_t total() const { return box + scalars + jl + fd + one_pc + rot + codes; }
};
inline SummaryBytes summary_bytes(std::int32_t head_dim, std::int32_t m, std::int32_t l, bool rot = false) {
  SummaryBytes b;
  b.box = 8LL * head_dim;
  b.scalars = 12;  // Σ‖k‖², max‖k‖, ‖max(|min|, |max|)‖ (the box bound's rounding slack)
  b.jl = 4LL * m * m;
  b.fd = 4LL * l * head_dim + 4LL * head_dim + 12;  // rows, centre, Δ, Σ‖k-c‖², rows used
  b.one_pc = head_dim + 12;
  b.rot = rot ? 8LL * head_dim + 4 : 0;
  return b;
}
/// summary_bytes of the components a store with params p keeps (summary_parts); with
/// kCodes the codes of a group of p.group_pages pages of `page_size` tokens.
inline SummaryBytes summary_bytes(const SketchParams& p, std::int32_t head_dim, std::int32_t page_size = 0) {
  SummaryBytes b = summary_bytes(head_dim, p.jl_dim, p.fd_rows, p.method == SketchMethod::kRotBox);
  if (p.method == SketchMethod::kCodes)
    b.codes = static_cast<std::int64_t>(detail::code_blocks(p.group_pages * page_size)) * detail::code_block_bytes(head_dim, p.code_bits);
  const SummaryParts k = summary_parts(p);
  if (!k.jl) b.jl = 0;
  if (!k.fd) b.fd = 0;
  if (!k.one_pc) b.one_pc = 0;
  return b;
}

/// Per-step counters of select() (summed over the batch and kv heads of one call).
struct SketchTelemetry {
  std::int64_t pages_total = 0;       // pages of every (sequence, kv head)
  std::int64_t pages_visited = 0;     // pages in the subsets
  std::int64_t bytes_kv_read_est = 0; // K+V bytes of the visited tokens
  std::int64_t summaries_rebuilt = 0; // groups re-read from the view by sync()
  std::int64_t groups_scored = 0;     // (group, query head) pairs whose keys select() read exactly
  double prepass_seconds = 0;         // select() wall time
  double certified_omitted_max = 0;   // max over (sequence, query head) of the omitted-mass bound
  void add(const SketchTelemetry& t) {
    pages_total += t.pages_total;
    pages_visited += t.pages_visited;
    bytes_kv_read_est += t.bytes_kv_read_est;
    summaries_rebuilt += t.summaries_rebuilt;
    groups_scored += t.groups_scored;
    prepass_seconds += t.prepass_seconds;
    certified_omitted_max = std::max(certified_omitted_max, t.certified_omitted_max);
  }
};

namespace detail {

/// Cyclic Jacobi eigen-decomposition of the symmetric n×n `a` (row-major, destroyed: its
/// diagonal ends as the eigenvalues); `v` receives the eigenvectors as columns. At most
/// `max_sweeps` sweeps (v is a product of rotations, orthonormal whether or not it converged).
inline void jacobi_eigen(double* a /* [n*n] */, double* v /* [n*n] */, int n, int max_sweeps = 50) {
  for (int i = 0; i < n * n; ++i) v[i] = 0.0;
  for (int i = 0; i < n; ++i) v[i * n + i] = 1.0;
  for (int sweep = 0; sweep < max_sweeps; ++sweep) {
    double off = 0.0, diag = 0.0;
    for (int i = 0; i < n; ++i) {
      diag += a[i * n + i] * a[i * n + i];
      for (int j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    }
    if (off <= 1e-30 * diag || off == 0.0) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (apq == 0.0) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {
          const double vkp = v[k * n + p], vkq = v[k * n + q];
          v[k * n + p] = c * vkp - s * vkq;
          v[k * n + q] = s * vkp + c * vkq;
        }
      }
  }
}

/// Smallest float >= x (so a stored bound never rounds below the double it came from).
inline float round_up_float(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}
/// Largest float <= x.
inline float round_down_float(double x) { return -round_up_float(-x); }

/// kCodes: the cell width of a channel whose box is [lo, hi], on `levels` (a power of two)
/// cells: a float >= (hi − lo)/levels, so the cells cover the box; 0 for a flat channel
/// (every key equals lo). Three float operations (the pre-pass calls it d times a group):
/// hi − lo and the factor 1 + 2⁻²⁰ each round by at most 2⁻²⁴ relative, 1/levels is
/// exact; steps below 2⁻¹⁰⁰ become 2⁻¹⁰⁰, so no rounding happens in the subnormal range
/// (and no subnormal operand costs a microcode assist: x86 takes ~100 cycles for one).
/// The coder and the bound both call it, so they agree on every cell.
inline float code_step(float lo, float hi, std::int32_t levels) {
  if (!(hi > lo)) return 0.f;
  const float st = (hi - lo) * (1.f / static_cast<float>(levels)) * (1.f + 0x1p-20f);
  return st < 0x1p-100f ? 0x1p-100f : st;
}

/// Code of token t, channel c in a group's codes (the layout of code_blocks).
inline std::int32_t code_at(const std::uint8_t* codes, std::int32_t d, std::int32_t bits, std::int32_t t, std::int32_t c) {
  const std::uint8_t* blk = codes + static_cast<std::size_t>(t / 16) * code_block_bytes(d, bits);
  const std::int32_t j = t % 16;
  if (bits == 8) return blk[c * 16 + j];
  return j < 8 ? (blk[c * 8 + j] & 15) : (blk[c * 8 + j - 8] >> 4);
}

/// y = Bᵀx in float, the same loop as mat_t_vec (the K-write path: 8 lanes a step).
inline void mat_t_vec_f(const float* B /* [d, d] */, std::int32_t d, const float* x /* [d] */, float* y /* [d] */) {
  for (std::int32_t j = 0; j < d; ++j) y[j] = 0.f;
  for (std::int32_t c = 0; c < d; ++c) {
    const float* row = B + static_cast<std::size_t>(c) * d;
    const float xc = x[c];
    for (std::int32_t j = 0; j < d; ++j) y[j] += row[j] * xc;
  }
}

/// y = Bᵀx in double for B [d, d] row-major (y_j = Σ_c B[c, j]·x_c, summed in order of c;
/// each product of a float and a float-valued double is exact). Row by row, so the
/// compiler vectorises across j without reassociating any sum.
inline void mat_t_vec(const float* B /* [d, d] */, std::int32_t d, const double* x /* [d] */, double* y /* [d] */) {
  for (std::int32_t j = 0; j < d; ++j) y[j] = 0.0;
  for (std::int32_t c = 0; c < d; ++c) {
    const float* row = B + static_cast<std::size_t>(c) * d;
    const double xc = x[c];
    for (std::int32_t j = 0; j < d; ++j) y[j] += static_cast<double>(row[j]) * xc;
  }
}

/// Relative error factor of a double sum of n products (γ_n = n·2⁻⁵³/(1 − n·2⁻⁵³), with a
/// 2x margin; n <= 2²⁰): |fl(Σ a_i b_i) − Σ a_i b_i| <= double_dot_slack(n)·Σ|a_i b_i|.
inline double double_dot_slack(std::int32_t n) { return 2.0 * (static_cast<double>(n) + 2) * 0x1p-53; }

}  // namespace detail

/// Summaries of every group of one engine's KV pool, all layers. Groups are keyed by the
/// physical id of their first page (see the file comment); at most `max_groups` records
/// per layer live at once (default: enough for every page to start a group), a group
/// without a record is always visited.
class SketchStore {
 public:
  /// Offsets (in floats) of one head's FD / JL / 1-PC summary inside a record (the box and
  /// max ‖k‖, which every pre-pass reads, live in their own arrays: box_min() etc.).
  struct Layout {
    std::int32_t jl = 0, fd = 0, center = 0, sumsq = 0, delta = 0, fd_used = 0, csumsq = 0, lambda1 = 0,
                 resid = 0, u1_scale = 0, floats = 0;
  };

  SketchStore(const SketchParams& p, std::int32_t num_layers, std::int32_t num_kv_heads,
              std::int32_t head_dim, std::int32_t page_size, std::int32_t num_pages,
              std::int32_t max_groups = 0)
      : p_(p), layers_(num_layers), hkv_(num_kv_heads), d_(head_dim), page_size_(page_size),
        num_pages_(num_pages) {
    p_.validate();
    KVKIT_CHECK(num_layers > 0, "kvkit: sketch num_layers must be > 0, got ", num_layers);
    KVKIT_CHECK(num_kv_heads > 0, "kvkit: sketch num_kv_heads must be > 0, got ", num_kv_heads);
    KVKIT_CHECK(head_dim > 0, "kvkit: sketch head_dim must be > 0, got ", head_dim);
    KVKIT_CHECK(page_size > 0, "kvkit: sketch page_size must be > 0, got ", page_size);
    KVKIT_CHECK(num_pages > 0, "kvkit: sketch num_pages must be > 0, got ", num_pages);
    KVKIT_CHECK(max_groups >= 0, "kvkit: sketch max_groups must be >= 0, got ", max_groups);
    KVKIT_CHECK(p_.head_on.empty() || p_.head_on.size() == static_cast<std::size_t>(num_layers) * num_kv_heads,
                "kvkit: sketch head_on has ", p_.head_on.size(), " entries, expected layers x kv heads = ",
                static_cast<std::int64_t>(num_layers) * num_kv_heads);
    cap_ = max_groups > 0 ? max_groups : num_pages;
    parts_ = summary_parts(p_);
    const std::int32_t m = p_.jl_dim, l = p_.fd_rows;
    Layout& L = lay_;
    // A part not kept has no floats (its offsets stay 0): no code reads or writes it
    // (add_key, refresh_one_pc, group_bounds and select() check parts_).
    std::int32_t o = 0;
    L.sumsq = o++;
    if (parts_.jl) {
      L.jl = o;
      o += m * m;
    }
    if (parts_.fd) {
      L.fd = o;
      o += l * d_;
      L.center = o;
      o += d_;
      L.delta = o++;
      L.fd_used = o++;
      L.csumsq = o++;
    }
    if (parts_.one_pc) {
      L.lambda1 = o++;
      L.resid = o++;
      L.u1_scale = o++;
    }
    L.floats = o;
    const std::size_t recs = static_cast<std::size_t>(layers_) * cap_;
    data_.assign(recs * hkv_ * L.floats, 0.f);
    box_min_.assign(recs * hkv_ * d_, std::numeric_limits<float>::infinity());
    box_max_.assign(recs * hkv_ * d_, -std::numeric_limits<float>::infinity());
    max_norm_.assign(recs * hkv_, 0.f);
    amax_norm_.assign(recs * hkv_, 0.f);
    u1_.assign(parts_.one_pc ? recs * hkv_ * d_ : 0, 0);
    rec_pages_.assign(recs * p_.group_pages, -1);
    rec_versions_.assign(recs * p_.group_pages, 0);
    rec_count_.assign(recs, 0);
    rec_key_.assign(recs, -1);
    slot_.assign(static_cast<std::size_t>(layers_) * num_pages_, -1);
    version_.assign(static_cast<std::size_t>(num_pages_), 1);
    free_.resize(static_cast<std::size_t>(layers_));
    for (std::int32_t ly = 0; ly < layers_; ++ly) {
      free_[ly].reserve(cap_);
      for (std::int32_t r = cap_ - 1; r >= 0; --r) free_[ly].push_back(r);
    }
    live_.assign(static_cast<std::size_t>(layers_), 0);
    // Φ per kv head: ±1 from a fixed-seed generator (the same for every run and machine).
    phi_.assign(parts_.jl ? static_cast<std::size_t>(hkv_) * d_ * m : 0, 0.f);
    std::mt19937_64 rng(p_.seed);
    for (float& x : phi_) x = (rng() >> 63) ? 1.f : -1.f;
    scratch_.assign(static_cast<std::size_t>(3 * d_ + 128 + 2 * l * l + l * d_ + l + m), 0.0);
    if (p_.method == SketchMethod::kRotBox) {
      const std::size_t hr = recs * hkv_;
      rot_min_.assign(hr * d_, std::numeric_limits<float>::infinity());
      rot_max_.assign(hr * d_, -std::numeric_limits<float>::infinity());
      rot_amax_.assign(hr, std::numeric_limits<float>::infinity());  // +inf: no rotated box
      basis_.assign(static_cast<std::size_t>(layers_) * hkv_ * d_ * d_, 0.f);
      basis_eps_.assign(static_cast<std::size_t>(layers_) * hkv_, 0.0);
      basis_set_.assign(static_cast<std::size_t>(layers_) * hkv_, 0);
      fit_scratch_.assign(static_cast<std::size_t>(2) * d_ * d_ + d_, 0.0);
      basis_tmp_.assign(static_cast<std::size_t>(d_) * d_, 0.f);
      rot_work_.assign(2 * static_cast<std::size_t>(d_), 0.f);
    }
    if (coded()) {
      codes_.assign(recs * hkv_ * static_cast<std::size_t>(code_group_bytes()), 0);
      coded_.assign(recs, 0);
    }
  }

  const SketchParams& params() const { return p_; }
  std::int32_t num_layers() const { return layers_; }
  std::int32_t num_kv_heads() const { return hkv_; }
  std::int32_t head_dim() const { return d_; }
  std::int32_t page_size() const { return page_size_; }
  std::int32_t num_pages() const { return num_pages_; }
  const Layout& layout() const { return lay_; }
  /// The FD / JL / 1-PC summaries this store keeps (SketchParams::all_summaries).
  const SummaryParts& parts() const { return parts_; }
  const float* phi(std::int32_t h) const { return phi_.data() + static_cast<std::size_t>(h) * d_ * p_.jl_dim; }
  bool head_on(std::int32_t layer, std::int32_t h) const {
    return p_.head_on.empty() || p_.head_on[static_cast<std::size_t>(layer) * hkv_ + h] != 0;
  }

  /// The host changed page `page`'s contents (kRewrite, a fresh allocation): every record
  /// holding it is rebuilt when next used.
  void page_changed(std::int32_t page) {
    if (page >= 0 && page < num_pages_) ++version_[static_cast<std::size_t>(page)];
  }
  /// The host freed `page` (refcount 0): the records it keys are dropped.
  void page_freed(std::int32_t page) {
    if (page < 0 || page >= num_pages_) return;
    ++version_[static_cast<std::size_t>(page)];
    for (std::int32_t ly = 0; ly < layers_; ++ly) drop(ly, page);
  }

  /// Summary bytes in use: live records x kv heads x summary_bytes of the kept parts,
  /// plus Φ (1 byte an entry) when JL is kept, plus with kRotBox the fitted bases (4d²
  /// bytes per (layer, kv head)).
  std::int64_t memory_bytes() const {
    std::int64_t recs = 0, bases = 0;
    for (std::int32_t n : live_) recs += n;
    for (std::uint8_t b : basis_set_) bases += b;
    return recs * hkv_ * summary_bytes(p_, d_, page_size_).total() +
           (parts_.jl ? static_cast<std::int64_t>(hkv_) * d_ * p_.jl_dim : 0) + bases * 4LL * d_ * d_;
  }

  /// True when this store keeps per-token key codes (method kCodes).
  bool coded() const { return p_.method == SketchMethod::kCodes; }
  /// Bytes of one group's codes for one kv head (detail::code_blocks layout).
  std::int32_t code_group_bytes() const {
    return detail::code_blocks(p_.group_pages * page_size_) * detail::code_block_bytes(d_, p_.code_bits);
  }
  /// True when record r of `layer` has its codes (built once its group is full).
  bool has_codes(std::int32_t layer, std::int32_t r) const { return coded() && coded_[rec(layer, r)] != 0; }
  /// Codes of record r of (layer, kv head h): [code_group_bytes()] in the layout of
  /// detail::code_blocks (detail::code_at reads one); channel c's code x stands for the
  /// cell [min_c + x·step_c, min_c + (x + 1)·step_c] of the record's box (detail::code_step).
  const std::uint8_t* codes(std::int32_t layer, std::int32_t r, std::int32_t h) const {
    return codes_.data() + hrec(layer, h, r) * static_cast<std::size_t>(code_group_bytes());
  }

  /// True when this store keeps rotated boxes (method kRotBox).
  bool rotated() const { return p_.method == SketchMethod::kRotBox; }
  /// Fixes the basis of (layer, kv head h): B [d, d] row-major, its columns are the basis
  /// vectors b_j (B[c * d + j] = b_j[c]). Any matrix is sound: its distance from
  /// orthonormality, ε_B >= ‖BᵀB − I‖₂, is measured here in double and enters the bound;
  /// a near-orthonormal B makes it tight. A basis is set once (kvkit::Error otherwise):
  /// records whose first key came before it keep no rotated box. sync() fits one itself
  /// when none was set (fit_basis()).
  void set_basis(std::int32_t layer, std::int32_t h, const float* rows /* [d, d] */) {
    KVKIT_CHECK(rotated(), "kvkit: sketch set_basis needs method rbox, got ", to_string(p_.method));
    KVKIT_CHECK(layer >= 0 && layer < layers_ && h >= 0 && h < hkv_, "kvkit: sketch set_basis: layer ", layer,
                " kv head ", h, " out of range");
    const std::size_t lh = static_cast<std::size_t>(layer) * hkv_ + h;
    KVKIT_CHECK(basis_set_[lh] == 0, "kvkit: sketch basis of layer ", layer, " kv head ", h, " is already set");
    float* B = basis_.data() + lh * d_ * d_;
    std::copy(rows, rows + static_cast<std::size_t>(d_) * d_, B);
    // ε_B = ‖BᵀB − I‖_F (>= the 2-norm) in double: (BᵀB)_ij = b_i·b_j, each product exact,
    // the sum off by <= double_dot_slack(d)·‖b_i‖‖b_j‖; the entry errors add <= slack·‖B‖_F²
    // to the Frobenius norm (Cauchy–Schwarz); then a 1e-12 relative margin.
    double fro = 0, bf = 0;
    for (std::int32_t i = 0; i < d_; ++i)
      for (std::int32_t j = 0; j < d_; ++j) {
        double g = 0;
        for (std::int32_t c = 0; c < d_; ++c) g += static_cast<double>(B[c * d_ + i]) * B[c * d_ + j];
        if (i == j) bf += g;
        g -= i == j ? 1.0 : 0.0;
        fro += g * g;
      }
    basis_eps_[lh] = (std::sqrt(fro) + detail::double_dot_slack(d_) * std::fabs(bf) * 2) * (1 + 1e-12) + 1e-300;
    KVKIT_CHECK(std::isfinite(basis_eps_[lh]), "kvkit: sketch basis of layer ", layer, " kv head ", h,
                " is not finite");
    basis_set_[lh] = 1;
  }
  /// Fits the bases of `layer` from the keys of `view` (one read of at most kBasisFitKeys
  /// of them per kv head, whole pages, sequence by sequence): per kv head the
  /// eigenvectors (cyclic Jacobi, double) of the pooled within-page covariance
  /// Σ_pages Σ_t (k_t − k̄_page)(k_t − k̄_page)ᵀ, so the directions along which keys of one
  /// page spread become the box's axes. Heads whose basis is set are left alone.
  static constexpr std::int32_t kBasisFitKeys = 4096;
  template <class T>
  void fit_basis(std::int32_t layer, const PagedKVView<T>& view) {
    if (!rotated()) return;
    double* C = fit_scratch_.data();  // [d, d]
    double* V = C + static_cast<std::size_t>(d_) * d_;  // [d, d]
    double* mean = V + static_cast<std::size_t>(d_) * d_;  // [d]
    for (std::int32_t h = 0; h < hkv_; ++h) {
      if (basis_set_[static_cast<std::size_t>(layer) * hkv_ + h]) continue;
      std::fill(C, C + static_cast<std::size_t>(d_) * d_, 0.0);
      std::int32_t used = 0;
      for (std::int32_t b = 0; b < view.batch_size && used < kBasisFitKeys; ++b) {
        const std::int32_t len = view.seq_len(b);
        for (std::int32_t t0 = 0; t0 < len && used < kBasisFitKeys; t0 += page_size_) {
          const std::int32_t n = std::min(page_size_, len - t0);
          if (n < 2) continue;
          used += n;
          std::fill(mean, mean + d_, 0.0);
          for (std::int32_t t = 0; t < n; ++t) {
            const T* k = view.k_ptr(b, t0 + t, h);
            for (std::int32_t c = 0; c < d_; ++c) mean[c] += to_float(k[c]);
          }
          for (std::int32_t c = 0; c < d_; ++c) mean[c] /= n;
          for (std::int32_t t = 0; t < n; ++t) {
            const T* k = view.k_ptr(b, t0 + t, h);
            for (std::int32_t i = 0; i < d_; ++i) {
              const double xi = to_float(k[i]) - mean[i];
              for (std::int32_t j = i; j < d_; ++j) C[i * d_ + j] += xi * (to_float(k[j]) - mean[j]);
            }
          }
        }
      }
      for (std::int32_t i = 0; i < d_; ++i)
        for (std::int32_t j = 0; j < i; ++j) C[i * d_ + j] = C[j * d_ + i];
      // Six sweeps: the directions that matter (large spread) have converged by then, and
      // an unconverged V is still orthonormal (a product of rotations), so sound.
      detail::jacobi_eigen(C, V, d_, 6);
      // B = V (columns: eigenvectors).
      for (std::size_t i = 0; i < static_cast<std::size_t>(d_) * d_; ++i) basis_tmp_[i] = static_cast<float>(V[i]);
      set_basis(layer, h, basis_tmp_.data());
    }
  }
  /// Basis B of (layer, kv head h) [d, d] row-major, columns b_j (valid when basis_ready()).
  const float* basis(std::int32_t layer, std::int32_t h) const {
    return basis_.data() + (static_cast<std::size_t>(layer) * hkv_ + h) * d_ * d_;
  }
  bool basis_ready(std::int32_t layer, std::int32_t h) const {
    return rotated() && basis_set_[static_cast<std::size_t>(layer) * hkv_ + h] != 0;
  }
  /// ε_B >= ‖BᵀB − I‖₂ of (layer, kv head h)'s basis.
  double basis_eps(std::int32_t layer, std::int32_t h) const {
    return basis_eps_[static_cast<std::size_t>(layer) * hkv_ + h];
  }
  /// Rotated box of every record of (layer, kv head h) [max_groups, d]: per basis
  /// direction j, bounds on b_j·k over the group's keys (exact reals: rounded outward).
  const float* rot_min(std::int32_t layer, std::int32_t h) const { return rot_min_.data() + hrec(layer, h, 0) * d_; }
  const float* rot_max(std::int32_t layer, std::int32_t h) const { return rot_max_.data() + hrec(layer, h, 0) * d_; }
  /// ‖(max(|rot_min_j|, |rot_max_j|))_j‖ per record [max_groups] (rounded up); +inf for a
  /// record without a rotated box (its first key came before the basis).
  const float* rot_amax_norm(std::int32_t layer, std::int32_t h) const { return rot_amax_.data() + hrec(layer, h, 0); }
  std::int64_t live_groups(std::int32_t layer) const { return live_[static_cast<std::size_t>(layer)]; }

  /// Brings the summaries of every group of every sequence of `view` (layer `layer`) up to
  /// date: new tokens of a valid record are added (each key read once), stale or missing
  /// records are rebuilt from the view. Returns the number of groups rebuilt. Never
  /// allocates; a group that finds no free record stays unsummarised (always visited).
  template <class T>
  std::int64_t sync(std::int32_t layer, const PagedKVView<T>& view) {
    std::int64_t rebuilt = 0;
    const std::int32_t g = p_.group_pages;
    bool unfitted = false;
    for (std::int32_t h = 0; rotated() && h < hkv_; ++h) unfitted |= !basis_ready(layer, h);
    if (unfitted) {
      std::int64_t tokens = 0;
      for (std::int32_t b = 0; b < view.batch_size; ++b) tokens += view.seq_len(b);
      if (tokens >= p_.basis_keys) fit_basis(layer, view);
    }
    for (std::int32_t b = 0; b < view.batch_size; ++b) {
      const std::int32_t len = view.seq_len(b), np = view.num_pages(b);
      for (std::int32_t j0 = 0; j0 < np; j0 += g) {
        const std::int32_t key = view.page_id(b, j0);
        const std::int32_t gp = std::min(g, np - j0);
        const std::int32_t ntok = std::min(len - j0 * page_size_, g * page_size_);
        std::int32_t r = slot_[idx(layer, key)];
        bool fresh = false;
        if (r < 0) {
          r = take(layer, key);
          if (r < 0) continue;
          fresh = true;
        } else {
          const std::size_t base = rec(layer, r) * g;
          const std::int32_t have = rec_count_[rec(layer, r)];
          bool same = have <= ntok;
          for (std::int32_t i = 0; i < g && same; ++i) {
            const std::int32_t want = i < gp ? view.page_id(b, j0 + i) : -1;
            if (rec_pages_[base + i] < 0 && want >= 0 && have <= i * page_size_) {
              // The group grew by a page since it was summarised: adopt it (appends only).
              rec_pages_[base + i] = want;
              rec_versions_[base + i] = version_[static_cast<std::size_t>(want)];
              continue;
            }
            same = rec_pages_[base + i] == want &&
                   (want < 0 || rec_versions_[base + i] == version_[static_cast<std::size_t>(want)]);
          }
          fresh = !same;
        }
        const std::size_t ri = rec(layer, r);
        if (fresh) {
          reset(layer, r);
          const std::size_t base = ri * g;
          for (std::int32_t i = 0; i < g; ++i) {
            const std::int32_t pg = i < gp ? view.page_id(b, j0 + i) : -1;
            rec_pages_[base + i] = pg;
            rec_versions_[base + i] = pg < 0 ? 0 : version_[static_cast<std::size_t>(pg)];
          }
          if (ntok > 1) ++rebuilt;  // re-read the group's keys (beyond the newest token)
        }
        if (rec_count_[ri] != ntok) {
          for (std::int32_t h = 0; h < hkv_; ++h) {
            for (std::int32_t t = rec_count_[ri]; t < ntok; ++t) {
              const T* k = view.k_ptr(b, j0 * page_size_ + t, h);
              add_key(layer, r, h, k, t == 0);
            }
            if (parts_.one_pc) refresh_one_pc(layer, r, h);
          }
          rec_count_[ri] = ntok;
        }
        // kCodes: a full group's box is final, so its keys are coded now (one more read of
        // the group's K in its life; the group being filled is the last one, always read).
        if (coded() && ntok == g * page_size_ && coded_[ri] == 0) {
          for (std::int32_t h = 0; h < hkv_; ++h)
            code_keys(layer, r, h, [&](std::int32_t t) { return view.k_ptr(b, j0 * page_size_ + t, h); });
          coded_[ri] = 1;
        }
      }
    }
    return rebuilt;
  }

  /// Record of the group whose first page is `key` in `layer`, or -1.
  std::int32_t record_of(std::int32_t layer, std::int32_t key) const { return slot_[idx(layer, key)]; }
  /// True when record r (of layer) summarises exactly the group of sequence b starting at
  /// logical page j0 of `view` with all its tokens.
  template <class T>
  bool record_matches(std::int32_t layer, std::int32_t r, const PagedKVView<T>& view, std::int32_t b,
                      std::int32_t j0) const {
    const std::int32_t g = p_.group_pages, np = view.num_pages(b);
    const std::int32_t gp = std::min(g, np - j0);
    const std::int32_t ntok = std::min(view.seq_len(b) - j0 * page_size_, g * page_size_);
    const std::size_t ri = rec(layer, r);
    if (rec_count_[ri] != ntok) return false;
    for (std::int32_t i = 0; i < g; ++i) {
      const std::int32_t want = i < gp ? view.page_id(b, j0 + i) : -1;
      if (rec_pages_[ri * g + i] != want) return false;
      if (want >= 0 && rec_versions_[ri * g + i] != version_[static_cast<std::size_t>(want)]) return false;
    }
    return true;
  }
  /// Head h's FD / JL / 1-PC summary floats of record r (see layout()).
  const float* summary(std::int32_t layer, std::int32_t r, std::int32_t h) const {
    return data_.data() + hrec(layer, h, r) * static_cast<std::size_t>(lay_.floats);
  }
  const std::int8_t* u1(std::int32_t layer, std::int32_t r, std::int32_t h) const {
    return u1_.data() + hrec(layer, h, r) * static_cast<std::size_t>(d_);
  }
  /// Per-channel box of every record of (layer, kv head h): [max_groups, d] each, record r
  /// at row r (contiguous, so the pre-pass streams them; unused rows hold ±inf).
  const float* box_min(std::int32_t layer, std::int32_t h) const { return box_min_.data() + hrec(layer, h, 0) * d_; }
  const float* box_max(std::int32_t layer, std::int32_t h) const { return box_max_.data() + hrec(layer, h, 0) * d_; }
  /// max ‖k‖ of every record of (layer, kv head h): [max_groups] (rounded up to float).
  const float* max_norm(std::int32_t layer, std::int32_t h) const { return max_norm_.data() + hrec(layer, h, 0); }
  /// ‖(max(|min_d|, |max_d|))_d‖₂ of every record of (layer, kv head h): [max_groups]
  /// (rounded up; the box bound's rounding slack).
  const float* box_amax_norm(std::int32_t layer, std::int32_t h) const { return amax_norm_.data() + hrec(layer, h, 0); }
  /// Records per layer (rows of box_min() / box_max() / max_norm()).
  std::int32_t max_groups() const { return cap_; }

  /// Summarises a group directly from keys (tests, benchmarks): record for `key` in
  /// `layer`, head h gets keys[0..n) (rows of d floats, stride `stride`). The record counts
  /// n tokens and lists no pages (select() ignores it unless the page list matches). With
  /// kCodes and n = g·P, head h's keys are also coded (and the record marked coded).
  template <class T>
  std::int32_t summarise_keys(std::int32_t layer, std::int32_t key, std::int32_t h, const T* keys,
                              std::int32_t n, std::int64_t stride) {
    std::int32_t r = slot_[idx(layer, key)];
    if (r < 0) {
      r = take(layer, key);
      KVKIT_CHECK(r >= 0, "kvkit: sketch store is full (", cap_, " groups)");
      reset(layer, r);
    }
    for (std::int32_t t = 0; t < n; ++t) add_key(layer, r, h, keys + t * stride, t == 0 && rec_count_[rec(layer, r)] == 0);
    if (parts_.one_pc) refresh_one_pc(layer, r, h);
    rec_count_[rec(layer, r)] = n;
    if (coded() && n == p_.group_pages * page_size_) {
      code_keys(layer, r, h, [&](std::int32_t t) { return keys + t * stride; });
      coded_[rec(layer, r)] = 1;
    }
    return r;
  }

 private:
  std::size_t idx(std::int32_t layer, std::int32_t page) const {
    return static_cast<std::size_t>(layer) * num_pages_ + static_cast<std::size_t>(page);
  }
  std::size_t rec(std::int32_t layer, std::int32_t r) const {
    return static_cast<std::size_t>(layer) * cap_ + static_cast<std::size_t>(r);
  }
  // Index of (layer, head h, record r) in the per-head arrays [layers, Hkv, cap, ...].
  std::size_t hrec(std::int32_t layer, std::int32_t h, std::int32_t r) const {
    return (static_cast<std::size_t>(layer) * hkv_ + static_cast<std::size_t>(h)) * cap_ + static_cast<std::size_t>(r);
  }
  std::int32_t take(std::int32_t layer, std::int32_t key) {
    auto& fl = free_[static_cast<std::size_t>(layer)];
    if (fl.empty()) return -1;
    const std::int32_t r = fl.back();
    fl.pop_back();  // no allocation: pop from reserved storage
    slot_[idx(layer, key)] = r;
    rec_key_[rec(layer, r)] = key;
    ++live_[static_cast<std::size_t>(layer)];
    return r;
  }
  void drop(std::int32_t layer, std::int32_t key) {
    std::int32_t& s = slot_[idx(layer, key)];
    if (s < 0) return;
    rec_key_[rec(layer, s)] = -1;
    free_[static_cast<std::size_t>(layer)].push_back(s);  // capacity reserved: no allocation
    --live_[static_cast<std::size_t>(layer)];
    s = -1;
  }
  void reset(std::int32_t layer, std::int32_t r) {
    const std::size_t ri = rec(layer, r);
    rec_count_[ri] = 0;
    if (coded()) coded_[ri] = 0;
    for (std::int32_t h = 0; h < hkv_; ++h) {
      const std::size_t hr = hrec(layer, h, r);
      float* s = data_.data() + hr * static_cast<std::size_t>(lay_.floats);
      std::fill(s, s + lay_.floats, 0.f);
      std::fill(box_min_.begin() + static_cast<std::ptrdiff_t>(hr * d_),
                box_min_.begin() + static_cast<std::ptrdiff_t>((hr + 1) * d_), std::numeric_limits<float>::infinity());
      std::fill(box_max_.begin() + static_cast<std::ptrdiff_t>(hr * d_),
                box_max_.begin() + static_cast<std::ptrdiff_t>((hr + 1) * d_), -std::numeric_limits<float>::infinity());
      max_norm_[hr] = 0.f;
      amax_norm_[hr] = 0.f;
      if (rotated()) {
        std::fill(rot_min_.begin() + static_cast<std::ptrdiff_t>(hr * d_),
                  rot_min_.begin() + static_cast<std::ptrdiff_t>((hr + 1) * d_), std::numeric_limits<float>::infinity());
        std::fill(rot_max_.begin() + static_cast<std::ptrdiff_t>(hr * d_),
                  rot_max_.begin() + static_cast<std::ptrdiff_t>((hr + 1) * d_), -std::numeric_limits<float>::infinity());
        rot_amax_[hr] = std::numeric_limits<float>::infinity();
      }
      if (parts_.one_pc)
        std::fill(u1_.begin() + static_cast<std::ptrdiff_t>(hr * d_),
                  u1_.begin() + static_cast<std::ptrdiff_t>((hr + 1) * d_), std::int8_t{0});
    }
  }

  // One key into head h's summaries of record r: box, scalars, JL Gram, FD.
  template <class T>
  void add_key(std::int32_t layer, std::int32_t r, std::int32_t h, const T* kp, bool first) {
    const std::size_t hr = hrec(layer, h, r);
    float* s = data_.data() + hr * static_cast<std::size_t>(lay_.floats);
    float* bmin = box_min_.data() + hr * d_;
    float* bmax = box_max_.data() + hr * d_;
    const std::int32_t m = p_.jl_dim, l = p_.fd_rows;
    double* k = scratch_.data();  // [d]
    double* y = k + d_;           // [m]
    double nn = 0.0;
    for (std::int32_t c = 0; c < d_; ++c) {
      const float x = to_float(kp[c]);
      k[c] = x;
      nn += static_cast<double>(x) * x;
      bmin[c] = std::min(bmin[c], x);
      bmax[c] = std::max(bmax[c], x);
    }
    s[lay_.sumsq] = detail::round_up_float(static_cast<double>(s[lay_.sumsq]) + nn);
    double an = 0.0;
    for (std::int32_t c = 0; c < d_; ++c) {
      const double a = std::max(std::fabs(static_cast<double>(bmin[c])), std::fabs(static_cast<double>(bmax[c])));
      an += a * a;
    }
    amax_norm_[hr] = detail::round_up_float(std::sqrt(an) * (1 + 1e-12));
    max_norm_[hr] = std::max(max_norm_[hr], detail::round_up_float(std::sqrt(nn)));
    if (rotated()) add_key_rotated(layer, h, hr, k, nn, first);
    if (parts_.jl) {
      const float* ph = phi(h);
      for (std::int32_t a = 0; a < m; ++a) y[a] = 0.0;
      for (std::int32_t c = 0; c < d_; ++c)
        for (std::int32_t a = 0; a < m; ++a) y[a] += k[c] * ph[c * m + a];
      float* G = s + lay_.jl;
      for (std::int32_t a = 0; a < m; ++a)
        for (std::int32_t bb = 0; bb < m; ++bb) G[a * m + bb] += static_cast<float>(y[a] * y[bb]);
    }
    if (!parts_.fd) return;
    // Frequent Directions over the keys centred on the group's first key c (removes the
    // common offset real keys share): append k - c; when all l rows are used, shrink.
    float* ctr = s + lay_.center;
    if (first) {
      for (std::int32_t c = 0; c < d_; ++c) ctr[c] = static_cast<float>(k[c]);
      return;  // k - c = 0
    }
    double cn = 0.0;
    for (std::int32_t c = 0; c < d_; ++c) {
      k[c] -= ctr[c];
      cn += k[c] * k[c];
    }
    s[lay_.csumsq] = detail::round_up_float(static_cast<double>(s[lay_.csumsq]) + cn);
    std::int32_t used = static_cast<std::int32_t>(s[lay_.fd_used]);
    float* B = s + lay_.fd;
    if (used == l) {
      fd_shrink(s, B, l);
      used = static_cast<std::int32_t>(s[lay_.fd_used]);
    }
    for (std::int32_t c = 0; c < d_; ++c) B[used * d_ + c] = static_cast<float>(k[c]);
    s[lay_.fd_used] = static_cast<float>(used + 1);
  }

  // kCodes: every key of head h's full group r coded on the grid of the record's final box
  // (key(t): token t's row). code = ⌊(k − min)/step⌋ in double, clamped to [0, 2^bits − 1]:
  // k lies in its cell, up to the double rounding of that quotient at a cell edge, which
  // the bound's widening covers (detail::codes_log_mass).
  template <class KeyFn>
  void code_keys(std::int32_t layer, std::int32_t r, std::int32_t h, KeyFn&& key) {
    const std::size_t hr = hrec(layer, h, r);
    const float* lo = box_min_.data() + hr * d_;
    const float* hi = box_max_.data() + hr * d_;
    const std::int32_t levels = 1 << p_.code_bits, n = p_.group_pages * page_size_, gb = code_group_bytes();
    const std::int32_t bb = detail::code_block_bytes(d_, p_.code_bits);
    std::uint8_t* out = codes_.data() + hr * static_cast<std::size_t>(gb);
    std::fill(out, out + gb, std::uint8_t{0});
    for (std::int32_t t = 0; t < n; ++t) {
      const auto* k = key(t);
      std::uint8_t* blk = out + static_cast<std::size_t>(t / 16) * bb;
      const std::int32_t j = t % 16;
      for (std::int32_t c = 0; c < d_; ++c) {
        const double st = detail::code_step(lo[c], hi[c], levels);
        const double x = (static_cast<double>(to_float(k[c])) - lo[c]) / (st > 0 ? st : 1.0);
        const std::int32_t code = st > 0 && x > 0 ? static_cast<std::int32_t>(std::min<double>(levels - 1, std::floor(x))) : 0;
        if (p_.code_bits == 8)
          blk[c * 16 + j] = static_cast<std::uint8_t>(code);
        else
          blk[c * 8 + j % 8] |= static_cast<std::uint8_t>(j < 8 ? code : code << 4);
      }
    }
  }

  // Rotated box: y_j = b_j·k in float (detail::mat_t_vec_f: d rounded products and d
  // sequential adds, so |error| <= 2(d + 2)·2⁻²⁴·Σ_c|B_cj k_c| <= that·‖b_j‖‖k‖, with
  // ‖b_j‖² <= 1 + ε_B), widened by that error and rounded outward, so [rot_min_j,
  // rot_max_j] holds the exact b_j·k of every key. A record whose first key came before
  // the basis keeps none (rot_amax = +inf) for its whole life, so a box never misses a key.
  void add_key_rotated(std::int32_t layer, std::int32_t h, std::size_t hr, const double* k /* [d] */, double nn,
                       bool first) {
    if (first) rot_amax_[hr] = basis_ready(layer, h) ? 0.f : std::numeric_limits<float>::infinity();
    if (!std::isfinite(rot_amax_[hr])) return;
    const float* B = basis(layer, h);
    float* lo = rot_min_.data() + hr * d_;
    float* hi = rot_max_.data() + hr * d_;
    // (+ 1e-40: products that underflow into subnormals err absolutely, <= d·2⁻¹⁵⁰ in all)
    const double e = 2.0 * (d_ + 2) * 0x1p-24 * std::sqrt(nn) * std::sqrt(1 + basis_eps(layer, h)) * (1 + 1e-9) + 1e-40;
    float* kf = rot_work_.data();      // [d]
    float* yv = kf + d_;               // [d]
    for (std::int32_t c = 0; c < d_; ++c) kf[c] = static_cast<float>(k[c]);  // exact: k holds floats
    detail::mat_t_vec_f(B, d_, kf, yv);
    double an = 0.0;
    for (std::int32_t j = 0; j < d_; ++j) {
      const double y = yv[j];
      lo[j] = std::min(lo[j], detail::round_down_float(y - e));
      hi[j] = std::max(hi[j], detail::round_up_float(y + e));
      const double a = std::max(std::fabs(static_cast<double>(lo[j])), std::fabs(static_cast<double>(hi[j])));
      an += a * a;
    }
    rot_amax_[hr] = detail::round_up_float(std::sqrt(an) * (1 + 1e-12));
  }

  // B (used rows) -> rows sqrt(max(σ_i² - δ, 0)) v_iᵀ, δ = smallest σ²; keeps the nonzero rows.
  void fd_shrink(float* s, float* B, std::int32_t l) {
    double* M = scratch_.data() + 2 * d_ + 64;  // [l*l]
    double* V = M + l * l;                      // [l*l]
    double* R = V + l * l;                      // [l*d]
    for (std::int32_t i = 0; i < l; ++i)
      for (std::int32_t j = i; j < l; ++j) {
        double acc = 0.0;
        for (std::int32_t c = 0; c < d_; ++c) acc += static_cast<double>(B[i * d_ + c]) * B[j * d_ + c];
        M[i * l + j] = M[j * l + i] = acc;
      }
    detail::jacobi_eigen(M, V, l);
    // δ = the (⌊l/2⌋+1)-th largest σ² (the smallest for l = 1): frees about half the rows,
    // so shrinks happen every ~l/2 keys (amortised O(l·d) per key; the bound stays
    // certified, with ‖KᵀK − BᵀB‖ <= Δ <= 2‖K‖_F²/l).
    double* ev = R + l * d_;  // [l]
    for (std::int32_t i = 0; i < l; ++i) ev[i] = std::max(0.0, M[i * l + i]);
    std::sort(ev, ev + l, [](double a, double b) { return a > b; });
    const double delta = ev[std::min(l - 1, l / 2)];
    // Right singular vectors: v_i = Bᵀ u_i / σ_i, new row = sqrt(σ² - δ) v_iᵀ.
    std::int32_t out = 0;
    for (std::int32_t i = 0; i < l; ++i) {
      const double s2 = std::max(0.0, M[i * l + i]);
      if (s2 - delta <= 1e-30 * std::max(1.0, s2) || s2 <= 0.0) continue;
      const double f = std::sqrt((s2 - delta) / s2);
      for (std::int32_t c = 0; c < d_; ++c) {
        double acc = 0.0;
        for (std::int32_t j = 0; j < l; ++j) acc += V[j * l + i] * B[j * d_ + c];
        R[out * d_ + c] = acc * f;
      }
      ++out;
    }
    if (out == l) out = l - 1;  // degenerate (all σ equal): drop one row, δ already covers it
    for (std::int32_t i = 0; i < out; ++i)
      for (std::int32_t c = 0; c < d_; ++c) B[i * d_ + c] = static_cast<float>(R[i * d_ + c]);
    for (std::int32_t i = out; i < l; ++i)
      for (std::int32_t c = 0; c < d_; ++c) B[i * d_ + c] = 0.f;
    s[lay_.delta] = detail::round_up_float(static_cast<double>(s[lay_.delta]) + delta);
    s[lay_.fd_used] = static_cast<float>(out);
  }

  // 1-PC from the FD rows: u₁ = top right singular vector of B (int8 + scale), λ₁ = σ₁²,
  // residual r² = Σ‖k‖² − λ₁.
  void refresh_one_pc(std::int32_t layer, std::int32_t r, std::int32_t h) {
    float* s = data_.data() + hrec(layer, h, r) * static_cast<std::size_t>(lay_.floats);
    std::int8_t* u = u1_.data() + hrec(layer, h, r) * static_cast<std::size_t>(d_);
    const std::int32_t n = static_cast<std::int32_t>(s[lay_.fd_used]);
    const float* B = s + lay_.fd;
    if (n == 0) return;
    double* M = scratch_.data() + 2 * d_ + 64;
    double* V = M + p_.fd_rows * p_.fd_rows;
    double* R = V + p_.fd_rows * p_.fd_rows;
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t j = i; j < n; ++j) {
        double acc = 0.0;
        for (std::int32_t c = 0; c < d_; ++c) acc += static_cast<double>(B[i * d_ + c]) * B[j * d_ + c];
        M[i * n + j] = M[j * n + i] = acc;
      }
    detail::jacobi_eigen(M, V, n);
    std::int32_t top = 0;
    for (std::int32_t i = 1; i < n; ++i)
      if (M[i * n + i] > M[top * n + top]) top = i;
    const double s2 = std::max(0.0, M[top * n + top]);
    double amax = 0.0, norm = 0.0;
    for (std::int32_t c = 0; c < d_; ++c) {
      double acc = 0.0;
      for (std::int32_t j = 0; j < n; ++j) acc += V[j * n + top] * B[j * d_ + c];
      R[c] = acc;
      norm += acc * acc;
    }
    norm = std::sqrt(norm);
    for (std::int32_t c = 0; c < d_; ++c) {
      R[c] = norm > 0 ? R[c] / norm : 0.0;
      amax = std::max(amax, std::fabs(R[c]));
    }
    const double scale = amax > 0 ? amax / 127.0 : 1.0;
    for (std::int32_t c = 0; c < d_; ++c)
      u[c] = static_cast<std::int8_t>(std::lround(std::max(-127.0, std::min(127.0, R[c] / scale))));
    s[lay_.u1_scale] = static_cast<float>(scale);
    s[lay_.lambda1] = static_cast<float>(s2);
    s[lay_.resid] = static_cast<float>(std::max(0.0, static_cast<double>(s[lay_.csumsq]) - s2));
  }

  SketchParams p_;
  std::int32_t layers_, hkv_, d_, page_size_, num_pages_, cap_ = 0;
  Layout lay_;
  std::vector<float> data_;                 // [layers, Hkv, cap, layout.floats] FD, JL, 1-PC, scalars
  std::vector<float> box_min_, box_max_;    // [layers, Hkv, cap, d]
  std::vector<float> max_norm_;             // [layers, Hkv, cap]
  std::vector<float> amax_norm_;            // [layers, Hkv, cap] ‖max(|min|, |max|)‖
  std::vector<std::int8_t> u1_;             // [layers, Hkv, cap, d] (empty without the 1-PC)
  SummaryParts parts_;
  std::vector<std::int32_t> rec_pages_;     // [layers, cap, g] physical pages of the group
  std::vector<std::uint32_t> rec_versions_; // [layers, cap, g] their versions when summarised
  std::vector<std::int32_t> rec_count_;     // [layers, cap] tokens summarised
  std::vector<std::int32_t> rec_key_;       // [layers, cap] first page (-1: free)
  std::vector<std::int32_t> slot_;          // [layers, num_pages] record keyed by a first page
  std::vector<std::uint32_t> version_;      // [num_pages]
  std::vector<std::vector<std::int32_t>> free_;  // [layers] free records (capacity cap)
  std::vector<std::int32_t> live_;          // [layers]
  std::vector<float> phi_;                  // [Hkv, d, m] ±1
  std::vector<double> scratch_;             // key, projections, FD eigen work
  // kRotBox only (empty otherwise):
  std::vector<float> rot_min_, rot_max_;    // [layers, Hkv, cap, d] bounds on b_j·k
  std::vector<float> rot_amax_;             // [layers, Hkv, cap] ‖max(|lo|, |hi|)‖; +inf: none
  std::vector<float> basis_;                // [layers, Hkv, d, d] rows b_j
  std::vector<double> basis_eps_;           // [layers, Hkv] ε_B >= ‖BᵀB − I‖₂
  std::vector<std::uint8_t> basis_set_;     // [layers, Hkv]
  std::vector<double> fit_scratch_;         // [2d² + d] covariance, eigenvectors, mean
  std::vector<float> basis_tmp_;            // [d, d] a fitted basis before set_basis
  std::vector<float> rot_work_;             // [2d] a key and its rotation
  // kCodes only (empty otherwise):
  std::vector<std::uint8_t> codes_;         // [layers, Hkv, cap, code_group_bytes]
  std::vector<std::uint8_t> coded_;         // [layers, cap] codes built
};

/// Upper and lower bounds on the logits q·k of one group for one query (see the file
/// comment); `z` is Φᵀq of the group's kv head.
struct GroupBounds {
  static constexpr double kInf = std::numeric_limits<double>::infinity();
  double box_hi = 0, box_lo = 0, norm = 0;
  double fd = kInf, jl = kInf, one_pc = kInf;  // +inf when not computed (never a bound)
  double rot = kInf;  // rotated box (kRotBox; set by the caller from rot_bound())
};

/// Which bounds group_bounds computes besides box and norm (always).
enum BoundSet : unsigned { kBoundsFD = 1, kBoundsJL = 2, kBoundsOnePC = 4, kBoundsAll = 7 };

namespace detail {
/// Float sums of n products, 8 accumulators: |error| <= float_sum_slack(n) · Σ|terms|
/// (a 2x margin over (n/8 + 8 + 1)·2⁻²⁴).
KVKIT_HOST_DEVICE double float_sum_slack(std::int32_t n) { return (n / 8 + 17) * 1.2e-7; }
}  // namespace detail

namespace detail {
/// Eight float lanes (one AVX register, two SSE registers, or an array): the box bound's
/// accumulators. Lane-wise IEEE mul / add / max / abs only, so every backend gives the
/// same bits as the scalar loop.
struct F8 {
#if defined(__AVX__)
  __m256 v;
  static F8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static F8 set1(float x) { return {_mm256_set1_ps(x)}; }
  static F8 zero() { return {_mm256_setzero_ps()}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  friend F8 operator+(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend F8 operator*(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static F8 max(F8 a, F8 b) { return {_mm256_max_ps(a.v, b.v)}; }  // a > b ? a : b
  static F8 min(F8 a, F8 b) { return {_mm256_min_ps(a.v, b.v)}; }  // a < b ? a : b
  static F8 abs(F8 a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), a.v)}; }
#elif defined(__SSE2__) || defined(_M_X64)
  __m128 lo, hi;
  static F8 load(const float* p) { return {_mm_loadu_ps(p), _mm_loadu_ps(p + 4)}; }
  static F8 set1(float x) { return {_mm_set1_ps(x), _mm_set1_ps(x)}; }
  static F8 zero() { return {_mm_setzero_ps(), _mm_setzero_ps()}; }
  void store(float* p) const {
    _mm_storeu_ps(p, lo);
    _mm_storeu_ps(p + 4, hi);
  }
  friend F8 operator+(F8 a, F8 b) { return {_mm_add_ps(a.lo, b.lo), _mm_add_ps(a.hi, b.hi)}; }
  friend F8 operator*(F8 a, F8 b) { return {_mm_mul_ps(a.lo, b.lo), _mm_mul_ps(a.hi, b.hi)}; }
  static F8 max(F8 a, F8 b) { return {_mm_max_ps(a.lo, b.lo), _mm_max_ps(a.hi, b.hi)}; }
  static F8 min(F8 a, F8 b) { return {_mm_min_ps(a.lo, b.lo), _mm_min_ps(a.hi, b.hi)}; }
  static F8 abs(F8 a) {
    const __m128 m = _mm_set1_ps(-0.f);
    return {_mm_andnot_ps(m, a.lo), _mm_andnot_ps(m, a.hi)};
  }
#else
  float x[8];
  static F8 load(const float* p) {
    F8 r;
    for (int j = 0; j < 8; ++j) r.x[j] = p[j];
    return r;
  }
  static F8 set1(float s) {
    F8 r;
    for (float& e : r.x) e = s;
    return r;
  }
  static F8 zero() { return set1(0.f); }
  void store(float* p) const {
    for (int j = 0; j < 8; ++j) p[j] = x[j];
  }
  friend F8 operator+(F8 a, F8 b) {
    for (int j = 0; j < 8; ++j) a.x[j] += b.x[j];
    return a;
  }
  friend F8 operator*(F8 a, F8 b) {
    for (int j = 0; j < 8; ++j) a.x[j] *= b.x[j];
    return a;
  }
  static F8 max(F8 a, F8 b) {
    for (int j = 0; j < 8; ++j) a.x[j] = a.x[j] > b.x[j] ? a.x[j] : b.x[j];
    return a;
  }
  static F8 min(F8 a, F8 b) {
    for (int j = 0; j < 8; ++j) a.x[j] = a.x[j] < b.x[j] ? a.x[j] : b.x[j];
    return a;
  }
  static F8 abs(F8 a) {
    for (float& e : a.x) e = std::fabs(e);
    return a;
  }
#endif
};

/// Box upper bounds of one group for NG queries at once (rows of q, stride ldq): for each
/// query, Σ_d max(q_d·min_d, q_d·max_d) in float with 8 accumulators (lane j takes the
/// channels c ≡ j mod 8, the tail c >= 8⌊d/8⌋ goes to lane 0), the lanes summed in double
/// in lane order; the caller adds box_slack(). Each query's arithmetic is the same for any
/// NG and any F8 backend, so the batched pre-pass and group_bounds agree bit for bit.
/// With kLo also Σ_d min(q_d·min_d, q_d·max_d) (the lower bound before the slack).
template <int NG, bool kLo>
inline void box_bounds_block(const float* mn /* [d] */, const float* mx /* [d] */, std::int32_t d,
                             const float* q /* [NG, ldq] */, std::int32_t ldq, double* hi /* [NG] */,
                             double* lo /* [NG] when kLo */) {
  F8 h8[NG], l8[NG];
  for (int g = 0; g < NG; ++g) h8[g] = l8[g] = F8::zero();
  std::int32_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const F8 vn = F8::load(mn + c), vx = F8::load(mx + c);
    for (int g = 0; g < NG; ++g) {
      const F8 qq = F8::load(q + g * ldq + c);
      const F8 a = qq * vn, b = qq * vx;
      h8[g] = h8[g] + F8::max(a, b);
      if (kLo) l8[g] = l8[g] + F8::min(b, a);  // a > b ? b : a
    }
  }
  for (int g = 0; g < NG; ++g) {
    float h[8], l[8];
    h8[g].store(h);
    l8[g].store(l);
    for (std::int32_t cc = c; cc < d; ++cc) {
      const float qq = q[g * ldq + cc];
      const float a = qq * mn[cc], b = qq * mx[cc];
      h[0] += a > b ? a : b;
      if (kLo) l[0] += a > b ? b : a;
    }
    double hs = 0, ls = 0;
    for (int j = 0; j < 8; ++j) {
      hs += h[j];
      ls += l[j];
    }
    hi[g] = hs;
    if (kLo) lo[g] = ls;
  }
}

/// Rounding slack of box_bounds_block's sums: float_sum_slack(d)·Σ_d |q_d|·max(|min_d|,
/// |max_d|) <= float_sum_slack(d)·‖q‖·‖a‖ (Cauchy–Schwarz; a_d = max(|min_d|, |max_d|),
/// ‖a‖ stored per group rounded up), so the kernel needs no magnitude accumulator.
KVKIT_HOST_DEVICE double box_slack(std::int32_t d, double qnorm, float amax_norm) {
  return float_sum_slack(d) * qnorm * static_cast<double>(amax_norm) * (1 + 1e-12);
}

/// Certified upper bounds min(box, ‖q‖·max‖k‖) of the groups recs[0..n) of one (layer,
/// kv head) for G queries, reading each group's min/max once for all G queries:
/// out[g * ldo + i] for query g (row g of q, stride d) and group i. Same arithmetic as
/// group_bounds (box_bounds_block + box_slack; norm = ‖q‖·max‖k‖·(1 + 1e-12)).
inline void box_norm_bounds(const float* bmin /* [groups, d] */, const float* bmax /* [groups, d] */,
                            const float* max_norm /* [groups] */, const float* amax_norm /* [groups] */,
                            const std::int32_t* recs /* [n] */,
                            std::int32_t n, std::int32_t d, const float* q /* [G, d] */,
                            const double* qnorm /* [G] */, std::int32_t G, double* out /* [G, ldo] */,
                            std::int64_t ldo) {
#if defined(__AVX__)
  constexpr bool kBlock4 = true;  // 12 accumulator registers of 16
#else
  constexpr bool kBlock4 = false;
#endif
  double hi[4];
  for (std::int32_t i = 0; i < n; ++i) {
    const std::size_t r = static_cast<std::size_t>(recs[i]);
    const float* mn = bmin + r * static_cast<std::size_t>(d);
    const float* mx = bmax + r * static_cast<std::size_t>(d);
    std::int32_t g = 0;
    for (; kBlock4 && g + 4 <= G; g += 4) {
      box_bounds_block<4, false>(mn, mx, d, q + static_cast<std::size_t>(g) * d, d, hi, nullptr);
      for (int k = 0; k < 4; ++k)
        out[(g + k) * ldo + i] = std::min(hi[k] + box_slack(d, qnorm[g + k], amax_norm[r]),
                                          qnorm[g + k] * max_norm[r] * (1 + 1e-12));
    }
    for (; g + 2 <= G; g += 2) {
      box_bounds_block<2, false>(mn, mx, d, q + static_cast<std::size_t>(g) * d, d, hi, nullptr);
      for (int k = 0; k < 2; ++k)
        out[(g + k) * ldo + i] = std::min(hi[k] + box_slack(d, qnorm[g + k], amax_norm[r]),
                                          qnorm[g + k] * max_norm[r] * (1 + 1e-12));
    }
    for (; g < G; ++g) {
      box_bounds_block<1, false>(mn, mx, d, q + static_cast<std::size_t>(g) * d, d, hi, nullptr);
      out[g * ldo + i] = std::min(hi[0] + box_slack(d, qnorm[g], amax_norm[r]), qnorm[g] * max_norm[r] * (1 + 1e-12));
    }
  }
}

/// The query side of the rotated box bound (kRotBox) for basis rows B (b_j = row j) with
/// ε_B >= ‖BᵀB − I‖₂ (math below with B the matrix whose columns are the b_j):
///   q·k = (Bᵀq)·(Bᵀk) + qᵀ(I − BBᵀ)k,  |qᵀ(I − BBᵀ)k| <= ε_B‖q‖‖k‖  (‖I − BBᵀ‖₂ = ‖I − BᵀB‖₂).
/// q' = Bᵀq is formed in double (mat_t_vec; error <= double_dot_slack(d)·‖b_j‖‖q‖ per entry, so
/// <= slack·‖B‖_F‖q‖ <= slack·sqrt(d(1 + ε_B))‖q‖ in norm) and rounded to float qr
/// (<= 2⁻²⁴|q'_j| more): E_q >= ‖Bᵀq − qr‖. With y = Bᵀk, ‖y‖ <= sqrt(1 + ε_B)‖k‖ and
/// y_j in [lo_j, hi_j] (the stored rotated box):
///   q·k <= Σ_j max(qr_j lo_j, qr_j hi_j) + (E_q sqrt(1 + ε_B) + ε_B‖q‖)·max‖k‖,
/// the sum computed as the axis box's (box_bounds_block + box_slack with ‖qr‖ and the
/// record's rot_amax_norm). `extra` is the bracket (with a 2x margin), times max‖k‖ per group.
struct RotQuery {
  double qr_norm = 0;  // ‖qr‖
  double extra = 0;    // multiplies the group's max‖k‖
};
inline RotQuery rotate_query(const float* B /* [d, d] columns b_j */, double eps_b, std::int32_t d, const float* q /* [d] */,
                             double qnorm, float* qr /* [d] */, double* work /* [2d] */) {
  double n2 = 0;
  for (std::int32_t c = 0; c < d; ++c) work[d + c] = q[c];
  mat_t_vec(B, d, work + d, work);
  for (std::int32_t j = 0; j < d; ++j) {
    qr[j] = static_cast<float>(work[j]);
    n2 += static_cast<double>(qr[j]) * qr[j];
  }
  RotQuery r;
  r.qr_norm = std::sqrt(n2) * (1 + 1e-12);
  // (+ 1e-40: the float rounding of entries below the normal range errs absolutely)
  const double e_q = double_dot_slack(d) * std::sqrt(d * (1 + eps_b)) * qnorm + 0x1p-23 * r.qr_norm + 1e-40;
  r.extra = 2.0 * (e_q * std::sqrt(1 + eps_b) + eps_b * qnorm);
  return r;
}

/// Rotated-box bounds of the groups recs[0..n) for G rotated queries (rows of qr, stride
/// d), min-ed into out[g * ldo + i] (so out keeps min(box, norm, rotated)); groups
/// without a rotated box (rot_amax = +inf) are left as they are.
inline void rot_bounds(const float* rmin /* [groups, d] */, const float* rmax /* [groups, d] */,
                       const float* rot_amax /* [groups] */, const float* max_norm /* [groups] */,
                       const std::int32_t* recs /* [n] */, std::int32_t n, std::int32_t d,
                       const float* qr /* [G, d] */, const RotQuery* rq /* [G] */, std::int32_t G,
                       double* out /* [G, ldo] */, std::int64_t ldo) {
  double hi[4];
  for (std::int32_t i = 0; i < n; ++i) {
    const std::size_t r = static_cast<std::size_t>(recs[i]);
    if (!std::isfinite(rot_amax[r])) continue;
    const float* mn = rmin + r * static_cast<std::size_t>(d);
    const float* mx = rmax + r * static_cast<std::size_t>(d);
    std::int32_t g = 0;
    auto put = [&](std::int32_t gg, double h) {
      // (+ 1e-40: float products that underflow err absolutely, <= d·2⁻¹⁵⁰ in all)
      const double u = h + box_slack(d, rq[gg].qr_norm, rot_amax[r]) + rq[gg].extra * max_norm[r] + 1e-40;
      double& o = out[gg * ldo + i];
      o = std::min(o, u);
    };
#if defined(__AVX__)
    for (; g + 4 <= G; g += 4) {
      box_bounds_block<4, false>(mn, mx, d, qr + static_cast<std::size_t>(g) * d, d, hi, nullptr);
      for (int k = 0; k < 4; ++k) put(g + k, hi[k]);
    }
#endif
    for (; g + 2 <= G; g += 2) {
      box_bounds_block<2, false>(mn, mx, d, qr + static_cast<std::size_t>(g) * d, d, hi, nullptr);
      for (int k = 0; k < 2; ++k) put(g + k, hi[k]);
    }
    for (; g < G; ++g) {
      box_bounds_block<1, false>(mn, mx, d, qr + static_cast<std::size_t>(g) * d, d, hi, nullptr);
      put(g, hi[0]);
    }
  }
}
}  // namespace detail

namespace detail {
/// kCodes: Σ_c a_c·x_tc for the 16 tokens t of one block of codes (detail::code_blocks
/// layout) in float, token t in lane t. Channels alternate between two accumulators (one
/// chain of d/2 steps each, so the adds' latency does not serialise the loop) that are
/// added at the end: each token's sum takes at most d/2 + 2 rounded steps, within the
/// (d + 2)·2⁻²³·Σ_c |a_c|·x_tc of codes_seq_slack. AVX-512: one register of 16 tokens an
/// accumulator; AVX2: two of 8; otherwise a portable loop.
template <int kBits>
inline void codes_block(const float* a /* [d] */, const std::uint8_t* blk /* [code_block_bytes] */, std::int32_t d,
                        float* acc /* [16] */) {
  constexpr std::int32_t kStride = kBits == 8 ? 16 : 8;  // bytes a channel
#if !defined(KVKIT_SIMD_PORTABLE) && defined(__AVX512F__)
  auto codes16 = [&](std::int32_t c) {  // tokens 0-15 of channel c as 16 float lanes
    const std::uint8_t* x = blk + static_cast<std::size_t>(c) * kStride;
    if (kBits == 8) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi32(15))),
                                            _mm256_srli_epi32(b, 4), 1);
    return _mm512_cvtepi32_ps(both);
  };
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  std::int32_t c = 0;
  for (; c + 2 <= d; c += 2) {
    s0 = _mm512_fmadd_ps(_mm512_set1_ps(a[c]), codes16(c), s0);
    s1 = _mm512_fmadd_ps(_mm512_set1_ps(a[c + 1]), codes16(c + 1), s1);
  }
  if (c < d) s0 = _mm512_fmadd_ps(_mm512_set1_ps(a[c]), codes16(c), s0);
  _mm512_storeu_ps(acc, _mm512_add_ps(s0, s1));
#elif !defined(KVKIT_SIMD_PORTABLE) && defined(__AVX2__)
  // Lanes 0-7 tokens 0-7, lanes 8-15 tokens 8-15 (mul then add: the same bound as FMA);
  // even channels in s0 / s1, odd ones in s2 / s3.
  auto codes8 = [&](std::int32_t c, __m256* lo8, __m256* hi8) {
    const std::uint8_t* x = blk + static_cast<std::size_t>(c) * kStride;
    __m256i lo, hi;
    if (kBits == 8) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
      lo = _mm256_cvtepu8_epi32(b);
      hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    } else {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
      lo = _mm256_and_si256(b, _mm256_set1_epi32(15));
      hi = _mm256_srli_epi32(b, 4);
    }
    *lo8 = _mm256_cvtepi32_ps(lo);
    *hi8 = _mm256_cvtepi32_ps(hi);
  };
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  __m256 lo8, hi8;
  std::int32_t c = 0;
  for (; c + 2 <= d; c += 2) {
    const __m256 a0 = _mm256_set1_ps(a[c]), a1 = _mm256_set1_ps(a[c + 1]);
    codes8(c, &lo8, &hi8);
    s0 = _mm256_add_ps(s0, _mm256_mul_ps(a0, lo8));
    s1 = _mm256_add_ps(s1, _mm256_mul_ps(a0, hi8));
    codes8(c + 1, &lo8, &hi8);
    s2 = _mm256_add_ps(s2, _mm256_mul_ps(a1, lo8));
    s3 = _mm256_add_ps(s3, _mm256_mul_ps(a1, hi8));
  }
  if (c < d) {
    const __m256 a0 = _mm256_set1_ps(a[c]);
    codes8(c, &lo8, &hi8);
    s0 = _mm256_add_ps(s0, _mm256_mul_ps(a0, lo8));
    s1 = _mm256_add_ps(s1, _mm256_mul_ps(a0, hi8));
  }
  _mm256_storeu_ps(acc, _mm256_add_ps(s0, s2));
  _mm256_storeu_ps(acc + 8, _mm256_add_ps(s1, s3));
#else
  float s[2][16] = {};
  for (std::int32_t c = 0; c < d; ++c) {
    const float ac = a[c];
    const std::uint8_t* x = blk + static_cast<std::size_t>(c) * kStride;
    float* sc = s[c & 1];
    for (int j = 0; j < 8; ++j) {
      const std::uint32_t lo = kBits == 8 ? x[j] : (x[j] & 15u), hi = kBits == 8 ? x[j + 8] : (x[j] >> 4);
      sc[j] += ac * static_cast<float>(static_cast<std::int32_t>(lo));
      sc[j + 8] += ac * static_cast<float>(static_cast<std::int32_t>(hi));
    }
  }
  for (int j = 0; j < 16; ++j) acc[j] = s[0][j] + s[1][j];
#endif
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast) && !defined(__CUDACC__)
#define KVKIT_EPS_HAS_BIT_CAST 1
#endif
#endif
/// The bits of `from` as a To of the same size (std::bit_cast before C++20; the builtin,
/// where there is one, keeps loops over it vectorisable).
template <class To, class From>
inline To bit_cast_to(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast_to: sizes differ");
#if defined(KVKIT_EPS_HAS_BIT_CAST)
  return __builtin_bit_cast(To, from);
#else
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
#endif
}

/// Relative error bound of exp_sum_neg (below): 2⁻¹⁸ ≈ 3.8e-6, about 6x what its
/// arithmetic can err (degree-6 Taylor remainder on |r| <= ln2/2: 1.7e-7 relative; the
/// float Horner steps and the final product: < 5e-7; the reduction in double: ~1e-14), and
/// test_eps checks 4x under it against std::exp.
inline constexpr double kExpSumRel = 0x1p-18;

/// Σ_t e^{x_t} for x_t <= 0, in a loop compilers vectorise: x clamped to >= -80 (raises a
/// term by < e^-80 < 2e-35), then e^x = 2^k·e^r with k = round(x/ln 2) and r = x − k·ln 2
/// in double, e^r by a degree-6 polynomial in float, 2^k (normal: k >= -116) set in the
/// exponent bits; the terms are summed in double. Result within kExpSumRel·Σ e^x + n·2e-35
/// of the exact sum (no subnormal float arithmetic anywhere).
/// e^x of exp_sum_neg for -80 <= x <= 0 (the caller clamps, in a loop of its own: GCC does
/// not vectorise a loop where the comparison meets this arithmetic).
inline double exp_neg_term(double xc) {
  // x/ln 2 + 1.5·2^52 rounds to an integer k in the low mantissa bits: k as a double and
  // as an int32 without a float-to-int conversion (the loop stays branch-free).
  const double kb = xc * 1.4426950408889634 + 0x1.8p52;
  const double k = kb - 0x1.8p52;
  const std::int64_t kbits = bit_cast_to<std::int64_t>(kb);
  const float r = static_cast<float>(xc - k * 0.6931471805599453);
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float two_k = bit_cast_to<float>((static_cast<std::int32_t>(kbits) + 127) << 23);
  return static_cast<double>(p * two_k);
}
inline double exp_sum_neg(double* x /* [n] in: exponents, out: their exp */, std::int32_t n) {
  for (std::int32_t t = 0; t < n; ++t) x[t] = std::max(x[t], -80.0);
  for (std::int32_t t = 0; t < n; ++t) x[t] = exp_neg_term(x[t]);  // both loops vectorise
  // 8 double lanes: the sum errs by < n·2⁻⁵³ relative, far inside kExpSumRel.
  double lane[8] = {};
  std::int32_t t = 0;
  for (; t + 8 <= n; t += 8)
    for (int j = 0; j < 8; ++j) lane[j] += x[t + j];
  for (; t < n; ++t) lane[0] += x[t];
  double sum = 0;
  for (double v : lane) sum += v;
  return sum;
}

/// Relative error factor of codes_block's sums of d products.
inline double codes_seq_slack(std::int32_t d) { return (static_cast<double>(d) + 2) * 0x1p-23; }

/// kCodes: certified bounds on the log softmax mass log Σ_t exp(s·q·k_t) of one coded group
/// (ntok tokens) for query q. Channel c's code x puts k_c in [lo_c + x·st_c, lo_c + (x+1)·st_c]
/// (st = code_step of the box [lo, hi]), so with a_c = q_c·st_c, in reals,
///   q·k_t <= U_t = Σ_c (q_c·lo_c + max(a_c, 0)) + Σ_c a_c·x_tc,   q·k_t >= U_t − Σ_c |a_c|:
/// a box bound on the token's own cell (2^bits cells a channel instead of one). The base
/// sum is formed in double (products of floats exact; double_dot_slack), Σ a·x in float
/// (codes_block) from a rounded to float (<= 2⁻²⁴|a| each), and each cell is widened by
/// 2⁻⁴⁰(|lo| + 2^bits·st) for a code the coder's double quotient put one cell off at an
/// edge. `slack` collects all three. Then with M = max_t U_t:
///   hi = s·M + log Σ_t exp(s(U_t − M))                          >= log Σ exp(s·q·k)
///   lo = hi − s·(Σ|a| + 2·slack)  (every token's lower bound is U_t − gap, one gap a group)
/// each with a 1e-12 relative margin for exp and log. a: [d], dots: [ntok] work.
template <class T>
inline void codes_log_mass(const float* lo /* [d] */, const float* hi /* [d] */, const std::uint8_t* codes /* [code_blocks(ntok) · code_block_bytes] */,
                           std::int32_t ntok, std::int32_t d, std::int32_t bits, const T* q /* [d] */, double scale,
                           float* a /* [d] */, double* dots /* [ntok] */, double* log_hi, double* log_lo) {
  const std::int32_t levels = 1 << bits, bb = code_block_bytes(d, bits);
  // Per channel, in 16 float lanes (vectorised): the base Σ q·lo + max(a, 0), and the
  // magnitudes Σ(|q·lo| + |a|), Σ|a|, Σ|q|(|lo| + levels·st) that bound its rounding.
  // Every sum passes through < 2d/8 + 17 roundings (d/16 + 15 in a lane, 4 pairwise), so the
  // base errs by <= float_sum_slack(2d)·mag (one more 2⁻²⁴ for each product), and each
  // magnitude (a sum of non-negative terms) is low by at most that fraction, so
  // ×(1 + 2·float_sum_slack(2d) + 2⁻²²) makes it an upper bound.
  float lb[16] = {}, lm[16] = {}, la[16] = {}, lw[16] = {};
  auto channel = [&](std::int32_t c, int j) {
    const float qc = to_float(q[c]);
    const float st = code_step(lo[c], hi[c], levels);
    const float ql = qc * lo[c], qa = qc * st;
    a[c] = qa;
    lb[j] += ql + (qa > 0.f ? qa : 0.f);
    lm[j] += std::fabs(ql) + std::fabs(qa);
    la[j] += std::fabs(qa);
    lw[j] += std::fabs(qc) * (std::fabs(lo[c]) + static_cast<float>(levels) * st);
  };
  std::int32_t c0 = 0;
  for (; c0 + 16 <= d; c0 += 16)
    for (int j = 0; j < 16; ++j) channel(c0 + j, j);
  for (std::int32_t c = c0; c < d; ++c) channel(c, static_cast<int>(c - c0));
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) {
      lb[j] += lb[j + w];
      lm[j] += lm[j + w];
      la[j] += la[j + w];
      lw[j] += lw[j + w];
    }
  const double up = 1 + 2 * float_sum_slack(2 * d) + 0x1p-22;
  const double mag = lm[0] * up, sabs = la[0] * up, wide = lw[0] * up;
  const double base = lb[0];
  // a_c = fl(q_c·st_c) is within 2⁻²⁴|a_c| of the real product (2⁻²³ with the products
  // in the codes' sums); the cell widening is 2⁻⁴⁰·wide; 1e-30 covers products that
  // underflow.
  const double slack = (codes_seq_slack(d) + 0x1p-23) * (levels - 1) * sabs + (float_sum_slack(2 * d) + 0x1p-23) * mag +
                       0x1p-40 * wide + 1e-30;
  const double gap = sabs * (1 + 0x1p-22) + 2 * slack;  // >= Σ|q_c·st_c| exact
  double M = -std::numeric_limits<double>::infinity();
  float acc[16];
  for (std::int32_t t0 = 0; t0 < ntok; t0 += 16) {
    const std::uint8_t* blk = codes + static_cast<std::size_t>(t0 / 16) * bb;
    if (bits == 8)
      codes_block<8>(a, blk, d, acc);
    else
      codes_block<4>(a, blk, d, acc);
    for (std::int32_t j = 0; j < 16 && t0 + j < ntok; ++j) {
      dots[t0 + j] = acc[j];
      M = std::max(M, dots[t0 + j]);
    }
  }
  for (std::int32_t t = 0; t < ntok; ++t) dots[t] = scale * (dots[t] - M);  // <= 0, one is 0
  const double sum = exp_sum_neg(dots, ntok);
  const double top = scale * (base + M + slack), ls = std::log(sum);
  // exp_sum_neg errs by <= kExpSumRel relative plus ntok·2e-35, and the exact sum is >= 1
  // (the largest term is e^0), so 2·kExpSumRel + ntok·2e-35 bounds |log(sum) − log(exact)|.
  const double margin = 1e-12 * (1 + std::fabs(top) + std::fabs(ls) + scale * gap) + 2 * kExpSumRel +
                        static_cast<double>(ntok) * 2e-35;
  *log_hi = top + ls + margin;
  *log_lo = top + ls - scale * gap - margin;
}
}  // namespace detail

/// kCodes bounds of record r of (layer, kv head h) for query q (what select() computes):
/// {log-mass upper, log-mass lower} of the group's tokens (softmax scale `scale`); a: [d]
/// work. Requires store.has_codes(layer, r). a: [d], dots: [g·P] work.
template <class T>
inline void codes_bounds(const SketchStore& store, std::int32_t layer, std::int32_t r, std::int32_t h, const T* q /* [d] */,
                         double scale, float* a /* [d] */, double* dots /* [g·P] */, double* log_hi, double* log_lo) {
  const std::int32_t d = store.head_dim(), ntok = store.params().group_pages * store.page_size();
  detail::codes_log_mass(store.box_min(layer, h) + static_cast<std::size_t>(r) * d,
                         store.box_max(layer, h) + static_cast<std::size_t>(r) * d, store.codes(layer, r, h), ntok, d,
                         store.params().code_bits, q, scale, a, dots, log_hi, log_lo);
}

/// Rotated-box bound of record r of (layer, kv head h) for a query rotated by
/// detail::rotate_query (same arithmetic as the pre-pass); +inf when the record has none.
inline double rot_bound(const SketchStore& store, std::int32_t layer, std::int32_t r, std::int32_t h,
                        const float* qr /* [d] */, const detail::RotQuery& rq) {
  double u = std::numeric_limits<double>::infinity();
  if (!store.basis_ready(layer, h)) return u;
  detail::rot_bounds(store.rot_min(layer, h), store.rot_max(layer, h), store.rot_amax_norm(layer, h),
                     store.max_norm(layer, h), &r, 1, store.head_dim(), qr, &rq, 1, &u, 1);
  return u;
}

/// Bounds of record r of (layer, kv head h) of `store` for query q (float, [d]); `u1`
/// and the FD / JL / 1-PC floats come from store.summary(layer, r, h). The box in float
/// with 8 accumulators plus its rounding slack (detail::box_bounds_block).
inline GroupBounds group_bounds(const SketchStore& store, std::int32_t layer, std::int32_t r, std::int32_t h,
                                const float* q /* [d] */, double qnorm, const double* z /* [m] */,
                                unsigned which = kBoundsAll) {
  const SketchStore::Layout& L = store.layout();
  const std::int32_t d = store.head_dim(), m = store.params().jl_dim;
  const float* s = store.summary(layer, r, h);
  const SummaryParts& kept = store.parts();
  // Only the bounds of the summaries the store keeps (the others stay +inf).
  if (!kept.fd) which &= ~static_cast<unsigned>(kBoundsFD);
  if (!kept.jl) which &= ~static_cast<unsigned>(kBoundsJL);
  if (!kept.one_pc) which &= ~static_cast<unsigned>(kBoundsOnePC);  // one_pc implies fd (its centre)
  GroupBounds g;
  const std::size_t row = static_cast<std::size_t>(r) * static_cast<std::size_t>(d);
  detail::box_bounds_block<1, true>(store.box_min(layer, h) + row, store.box_max(layer, h) + row, d, q, d, &g.box_hi,
                                    &g.box_lo);
  const double slack = detail::box_slack(d, qnorm, store.box_amax_norm(layer, h)[r]);
  g.box_hi += slack;
  g.box_lo -= slack;
  g.norm = qnorm * store.max_norm(layer, h)[r] * (1 + 1e-12);
  double qc = 0;  // q·c, c the group's first key (FD's centre), rounded up
  if (which & (kBoundsFD | kBoundsOnePC)) {
    double qc_mag = 0;
    for (std::int32_t c = 0; c < d; ++c) {
      qc += static_cast<double>(q[c]) * s[L.center + c];
      qc_mag += std::fabs(static_cast<double>(q[c]) * s[L.center + c]);
    }
    qc += 1e-9 * qc_mag;
  }
  if (which & kBoundsFD) {
    const std::int32_t used = static_cast<std::int32_t>(s[L.fd_used]);
    double e = 0;
    for (std::int32_t i = 0; i < used; ++i) {
      double acc = 0;
      const float* row = s + L.fd + i * d;
      for (std::int32_t c = 0; c < d; ++c) acc += static_cast<double>(row[c]) * q[c];
      e += acc * acc;
    }
    // float storage of B perturbs BᵀB by ~1e-7 ‖B‖_F² <= 1e-7 Σ‖k-c‖²: covered by the slack.
    e += (static_cast<double>(s[L.delta]) + 1e-5 * s[L.csumsq]) * qnorm * qnorm;
    g.fd = qc + std::sqrt(e);
  }
  if (which & kBoundsJL) {
    double qf = 0;
    const float* G = s + L.jl;
    for (std::int32_t a = 0; a < m; ++a) {
      double row = 0;
      for (std::int32_t b = 0; b < m; ++b) row += static_cast<double>(G[a * m + b]) * z[b];
      qf += row * z[a];
    }
    g.jl = std::sqrt(std::max(0.0, qf)) / m;
  }
  if ((which & kBoundsOnePC) == 0) return g;
  const std::int8_t* u1 = store.u1(layer, r, h);
  double dot = 0;
  for (std::int32_t c = 0; c < d; ++c) dot += static_cast<double>(u1[c]) * q[c];
  dot *= s[L.u1_scale];
  if (which & kBoundsOnePC) g.one_pc = qc + std::sqrt(std::max(0.f, s[L.lambda1])) * std::fabs(dot) +
             std::sqrt(std::max(0.f, s[L.resid])) * qnorm;
  return g;
}

/// Bounds the selector needs for params p.
inline unsigned bounds_needed(const SketchParams& p) {
  if (p.method == SketchMethod::kFD) return kBoundsFD;
  if (p.strict) return 0;
  if (p.method == SketchMethod::kJL) return kBoundsJL;
  return p.method == SketchMethod::kOnePC ? static_cast<unsigned>(kBoundsOnePC) : 0u;
}

/// The upper bound a selector with params p uses: certified (strict) or
/// min(certified, α·estimate) (default mode).
inline double upper_bound(const SketchParams& p, const GroupBounds& g) {
  double cert = std::min(g.box_hi, g.norm);
  if (p.method == SketchMethod::kFD) cert = std::min(cert, g.fd);
  if (p.method == SketchMethod::kRotBox) cert = std::min(cert, g.rot);
  if (p.strict) return cert;
  switch (p.method) {
    case SketchMethod::kJL: return std::min(cert, p.alpha * g.jl);
    case SketchMethod::kOnePC: return std::min(cert, p.alpha * g.one_pc);
    default: return cert;
  }
}

namespace detail {

/// Unsigned 128-bit fixed-point mass: the pre-pass's group mass bounds are integers in
/// units of 2⁻⁹⁶ (relative to the largest bound), so every tail sum is exact and does not
/// depend on the order it is formed in: a partial selection and a full sort give the
/// same sums, hence the same decisions, bit for bit. (Host-device, like quantise_mass,
/// tail_bound and the slack helpers: the CUDA pre-pass, kernels/cuda/eps.cuh, calls them.)
struct Mass128 {
  std::uint64_t hi = 0, lo = 0;
  KVKIT_HOST_DEVICE void add(const Mass128& x) {
    lo += x.lo;
    hi += x.hi + (lo < x.lo ? 1u : 0u);
  }
  KVKIT_HOST_DEVICE void sub(const Mass128& x) {  // requires *this >= x
    hi -= x.hi + (lo < x.lo ? 1u : 0u);
    lo -= x.lo;
  }
  KVKIT_HOST_DEVICE bool zero() const { return hi == 0 && lo == 0; }
  /// The value times 2⁻⁹⁶ (round to nearest in two steps; monotone in the value).
  KVKIT_HOST_DEVICE double value() const { return (static_cast<double>(hi) * 0x1p64 + static_cast<double>(lo)) * 0x1p-96; }
};

/// Quantised mass bound of a group whose log-mass bound is x = ub − ref <= 0:
/// ⌈exp(x)·(1 + 2⁻⁵⁰)·2⁹⁶⌉ units, at least one (an upper bound even where exp underflows).
KVKIT_HOST_DEVICE Mass128 quantise_mass(double x) {
  const double w = std::exp(x) * (1 + 0x1p-50);
  double v = std::ceil(w * 0x1p96);
  if (!(v >= 1.0)) v = 1.0;
  Mass128 m;
  const double h = std::floor(v * 0x1p-64);
  m.hi = static_cast<std::uint64_t>(h);
  m.lo = static_cast<std::uint64_t>(v - h * 0x1p64);
  return m;
}

/// Upper bound (with a 2⁻⁵⁰ margin) of the mass a tail sum stands for.
KVKIT_HOST_DEVICE double tail_bound(const Mass128& t) { return t.zero() ? 0.0 : t.value() * (1 + 0x1p-50); }

/// The cap on groups scored per (sequence, query head) among n candidates: score_budget
/// (0: none) and ceil(score_fraction · n) (none at 1), whichever is smaller; 0: no cap.
/// Host and device compute it with the same double operations.
KVKIT_HOST_DEVICE std::int32_t score_limit(std::int32_t score_budget, double score_fraction, std::int32_t n) {
  std::int32_t cap = 0;
  if (score_fraction < 1.0) {
    const double c = std::ceil(score_fraction * static_cast<double>(n));
    cap = c < 1.0 ? 1 : static_cast<std::int32_t>(c);
  }
  if (score_budget > 0 && (cap == 0 || score_budget < cap)) cap = score_budget;
  return cap;
}

/// Result of certified_walk for one (sequence, query head).
struct WalkResult {
  std::int32_t visited = 0;  // groups taken: out[0..visited)
  std::int32_t scored = 0;   // groups whose keys were read (mass() calls)
  double omitted = 0;        // omitted-mass bound T/(T + S) at the stop
  double tail = 0;           // T: the bound on the omitted mass (relative units)
};

/// The smallest rank p in (start, n] with stop(p, T_p), for a stop test monotone in p and
/// true at p = n; ranks by `before` (a strict order on positions), T_p the exact tail sum
/// of w over ranks >= p. Quickselect on ord[start..n) (median-of-three pivots) until at
/// most 16 candidates are left, then a sort of those: ranks [start, p) end in
/// ord[start..p) (unsorted but the last block). T: T_start in, T_p out.
template <class Before, class Stop>
std::int32_t first_stop(const Mass128* w /* [n] */, std::int32_t n, std::int32_t* ord /* [n] */, std::int32_t start,
                        Before before, Stop stop, Mass128& T) {
  std::int32_t lo = start, hi = n;  // the answer is in (lo, hi]
  while (hi - lo > 16) {
    const std::int32_t a = ord[lo], b = ord[lo + (hi - lo) / 2], c = ord[hi - 1];
    const std::int32_t m = before(a, b) ? (before(b, c) ? lo + (hi - lo) / 2 : (before(a, c) ? hi - 1 : lo))
                                        : (before(a, c) ? lo : (before(b, c) ? hi - 1 : lo + (hi - lo) / 2));
    std::swap(ord[m], ord[hi - 1]);
    const std::int32_t pv = ord[hi - 1];
    std::int32_t* mid = std::partition(ord + lo, ord + hi - 1, [&](std::int32_t x) { return before(x, pv); });
    std::swap(*mid, ord[hi - 1]);
    const std::int32_t k = static_cast<std::int32_t>(mid - ord);
    Mass128 Tk = T;
    for (std::int32_t i = lo; i <= k; ++i) Tk.sub(w[ord[i]]);
    if (stop(k + 1, Tk)) {
      hi = k + 1;
    } else {
      lo = k + 1;
      T = Tk;
    }
  }
  std::sort(ord + lo, ord + hi, before);
  for (std::int32_t p = lo; p < hi; ++p) {
    if (p > lo && stop(p, T)) return p;
    T.sub(w[ord[p]]);
  }
  return hi;
}

/// The pre-pass's certified ε rule over n candidate groups: positions 0..n-1 with
/// log-mass bounds ub[pos] relative to ref >= every ub, quantised masses
/// w[pos] = quantise_mass(ub[pos] − ref), W = Σ w. Ranks: decreasing ub, ties by
/// increasing position. With T_i = Σ w over ranks >= i, S_i = s0 + Σ_{k<i} mass(rank k)
/// (in rank order) and f = 1 + (4n + 64)·2⁻⁵³:
///   i0 = the first i in [0, lim) with tail_bound(T_i) <= ε·f·(s0 + (W − T_i)·2⁻⁹⁶),
///        else lim (no stop before i0 is possible even if every group held its bound);
///   i0 == lim: ranks [0, lim) are visited, none scored, S = s0;
///   else ranks are visited in order from 0, each scored, and the walk stops at the first
///        i >= i0 with tail_bound(T_i) <= ε·S_i, or at lim.
/// With score_budget > 0, once more than score_budget ranks would be scored, the ranks
/// left up to lim are visited unscored (S kept): more pages, the bound still certified.
/// omitted = tail_bound(T)/(tail_bound(T) + S) at the stop (0 when T = 0).
/// This implementation reaches the same ranks without sorting every group: quickselect on
/// the exact tail sums finds the next rank where a stop is possible at all (ranks before
/// it are visited; they are scored only when a later decision needs S, i.e. not when the
/// next possible stop is lim with nothing left), then a heap walks the rest; only visited
/// ranks are sorted. Its early jumps skip exact tests that cannot pass (mass <= bound and
/// the factor f cover the double rounding of S). mass(pos): the group's exact relative
/// mass (<= its bound). ord, out: [n] workspace; out[0..visited) = the visited positions,
/// the scored ones first and by rank, the unscored ones after them in no particular order.
template <class MassFn>
WalkResult certified_walk(const double* ub /* [n] */, const Mass128* w /* [n] */, Mass128 W, std::int32_t n,
                          double s0, double eps, std::int32_t lim, std::int32_t score_budget,
                          std::int32_t* ord /* [n] */, std::int32_t* out /* [n] */, MassFn&& mass) {
  WalkResult res;
  lim = std::max<std::int32_t>(0, std::min(lim, n));
  for (std::int32_t i = 0; i < n; ++i) ord[i] = i;
  const double f = 1 + (4.0 * static_cast<double>(n) + 64) * 0x1p-53;
  auto before = [&](std::int32_t a, std::int32_t b) { return ub[a] > ub[b] || (ub[a] == ub[b] && a < b); };
  auto after = [&](std::int32_t a, std::int32_t b) { return before(b, a); };  // heap order
  double S = s0;
  std::int32_t cnt = 0;
  auto finish = [&](const Mass128& T) {
    res.visited = cnt;
    const double t = tail_bound(T);
    res.omitted = t > 0 ? t / (t + S) : 0.0;
    return res;
  };
  // Smallest rank p in (start, lim] (or [start, lim] when !strict) where a stop is
  // possible with every rank before p holding its bound: tail_bound(T_p) <=
  // ε·f·(s_base + (T_start − T_p)·2⁻⁹⁶). Moves ranks [start, p) (unsorted) to
  // ord[start..p); T: T_start in, T_p out.
  auto jump = [&](std::int32_t start, double s_base, bool strict, Mass128& T) -> std::int32_t {
    const Mass128 T0 = T;
    auto stop_possible = [&](std::int32_t p, const Mass128& Tp) {
      if (p >= lim) return true;
      Mass128 seen = T0;
      seen.sub(Tp);
      return tail_bound(Tp) <= eps * f * (s_base + seen.value());
    };
    if (!strict && stop_possible(start, T)) return start;
    return first_stop(w, n, ord, start, before, stop_possible, T);
  };
  // Budget exhausted: the top lim − cnt of ord[rb..re) are visited unscored.
  auto give_up = [&](std::int32_t rb, std::int32_t re, Mass128 T) {
    const std::int32_t k = lim - cnt;
    if (rb + k < re) std::nth_element(ord + rb, ord + rb + k, ord + re, before);
    for (std::int32_t p = rb; p < rb + k; ++p) {
      out[cnt++] = ord[p];
      T.sub(w[ord[p]]);
    }
    return finish(T);
  };
  auto over_budget = [&](std::int32_t more) { return score_budget > 0 && res.scored + more > score_budget; };
  auto score = [&](std::int32_t from, std::int32_t to) {
    for (std::int32_t p = from; p < to; ++p) S += mass(out[p]);
    res.scored += to - from;
  };
  if (lim == 0) return finish(W);
  // Phase 1: the first rank where a stop is possible at all.
  Mass128 T = W;
  std::int32_t a = jump(0, s0, false, T);
  if (a == lim) {  // visited unscored (in no particular order)
    for (std::int32_t p = 0; p < a; ++p) out[cnt++] = ord[p];
    return finish(T);
  }
  if (over_budget(a)) return give_up(0, n, W);
  std::sort(ord, ord + a, before);
  for (std::int32_t p = 0; p < a; ++p) out[cnt++] = ord[p];
  score(0, a);
  if (cnt >= lim || tail_bound(T) <= eps * S) return finish(T);
  // Phase 2: rank cnt is visited (its test failed); jump to the next possible stop.
  const Mass128 Ti = T;
  a = jump(cnt, S, true, T);
  if (a == lim && lim == n) {  // everything visited, nothing left to bound
    for (std::int32_t p = cnt; p < a; ++p) out[cnt++] = ord[p];
    return finish(T);
  }
  if (over_budget(a - cnt)) return give_up(cnt, n, Ti);
  std::sort(ord + cnt, ord + a, before);
  const std::int32_t from = cnt;
  for (std::int32_t p = cnt; p < a; ++p) out[cnt++] = ord[p];
  score(from, cnt);
  // Phase 3: one rank at a time from a heap of the rest, ord[cnt..he).
  const std::int32_t hb = cnt;
  std::int32_t he = n;
  std::make_heap(ord + hb, ord + he, after);
  while (cnt < lim && !(tail_bound(T) <= eps * S)) {
    if (over_budget(1)) return give_up(hb, he, T);
    std::pop_heap(ord + hb, ord + he, after);
    const std::int32_t x = ord[--he];
    out[cnt++] = x;
    S += mass(x);
    ++res.scored;
    T.sub(w[x]);
  }
  return finish(T);
}

/// kCodes' ε rule: no keys are read. s0 is a certified lower bound of the softmax
/// denominator (relative to ref) that already counts every candidate's lower mass bound,
/// so the walk only finds the first rank i (decreasing ub, ties by position, as
/// certified_walk) with tail_bound(T_i) <= ε·s0, or lim. Quickselect on the exact tail
/// sums (first_stop, as certified_walk's jumps). ord, out: [n]
/// workspace; out[0..visited) = the visited positions, in no particular order.
/// omitted = T/s0 (>= M_Ω/Z as Z >= s0); the caller may tighten it with the lower
/// bound of the visited groups alone (T/(T + S_visited)).
inline WalkResult bound_walk(const double* ub /* [n] */, const Mass128* w /* [n] */, Mass128 W, std::int32_t n, double s0,
                             double eps, std::int32_t lim, std::int32_t* ord /* [n] */, std::int32_t* out /* [n] */) {
  WalkResult res;
  lim = std::max<std::int32_t>(0, std::min(lim, n));
  for (std::int32_t i = 0; i < n; ++i) ord[i] = i;
  auto before = [&](std::int32_t a, std::int32_t b) { return ub[a] > ub[b] || (ub[a] == ub[b] && a < b); };
  auto stop = [&](std::int32_t p, const Mass128& Tp) { return p >= lim || tail_bound(Tp) <= eps * s0; };
  Mass128 T = W;
  const std::int32_t at = stop(0, T) ? 0 : first_stop(w, n, ord, 0, before, stop, T);
  for (std::int32_t p = 0; p < at; ++p) out[p] = ord[p];
  res.visited = at;
  res.tail = tail_bound(T);
  res.omitted = res.tail > 0 ? std::min(1.0, res.tail / s0) : 0.0;
  return res;
}

}  // namespace detail

/// Decode-time pre-pass: page subsets per (sequence, kv head) for the page-subset variant
/// of paged_decode_attention (DecodeAttentionParams::page_subset_indptr / page_subset).
/// reserve() sizes every buffer once; select() never allocates.
class SketchSelector {
 public:
  explicit SketchSelector(const SketchStore& store) : store_(&store) {}

  /// Buffers for batches up to max_batch sequences of up to max_pages pages, num_qo_heads
  /// query heads.
  void reserve(std::int32_t max_batch, std::int32_t num_qo_heads, std::int32_t max_pages) {
    KVKIT_CHECK(max_batch > 0 && num_qo_heads > 0 && max_pages > 0, "kvkit: sketch reserve needs positive sizes, got batch ",
                max_batch, " heads ", num_qo_heads, " pages ", max_pages);
    const std::int32_t hkv = store_->num_kv_heads(), g = store_->params().group_pages;
    const std::int32_t d = store_->head_dim();
    max_batch_ = max_batch;
    hq_ = num_qo_heads;
    max_pages_ = max_pages;
    const std::size_t groups = static_cast<std::size_t>((max_pages + g - 1) / g);
    const std::size_t grp = static_cast<std::size_t>(std::max(1, num_qo_heads / hkv));
    indptr_.assign(static_cast<std::size_t>(max_batch) * hkv + 1, 0);
    subset_.assign(static_cast<std::size_t>(max_batch) * hkv * max_pages, 0);
    cert_.assign(grp * groups, 0.0);
    ub_.assign(groups, 0.0);
    w_.assign(groups, detail::Mass128{});
    ord_.assign(groups, 0);
    out_.assign(groups, 0);
    cand_.assign(groups, 0);
    crec_.assign(groups, 0);
    rec_.assign(groups, -1);
    visit_.assign(groups, 0);
    always_.assign(groups, 0);
    qbuf_.assign(grp * d, 0.f);
    qn_.assign(grp, 0.0);
    qrot_.assign(store_->rotated() ? grp * d : 0, 0.f);
    rq_.assign(store_->rotated() ? grp : 0, detail::RotQuery{});
    rwork_.assign(store_->rotated() ? 2 * static_cast<std::size_t>(d) : 0, 0.0);
    chi_.assign(store_->coded() ? grp * groups : 0, 0.0);
    clo_.assign(store_->coded() ? grp * groups : 0, 0.0);
    awork_.assign(store_->coded() ? static_cast<std::size_t>(d) : 0, 0.f);
    dwork_.assign(store_->coded() ? static_cast<std::size_t>(g) * store_->page_size() : 0, 0.0);
    z_.assign(static_cast<std::size_t>(store_->params().jl_dim), 0.0);
    omitted_.assign(static_cast<std::size_t>(max_batch) * num_qo_heads, 0.0);
  }

  /// Chooses the pages of every (sequence b, kv head) of `view` for queries q
  /// [batch, Hq, d] scaled by sm_scale; fills indptr()/subset() (ascending logical page
  /// indices, i.e. oldest to newest) and `tel`. The store must be sync()ed for this layer
  /// and view. kInvalidArgument when the batch, heads or pages exceed reserve().
  /// Per (b, kv head): the certified box/norm bounds of every group for all of the head's
  /// query heads in one pass over the box arrays; per query head, the ε rule of
  /// detail::certified_walk (exact keys read only for groups it must score).
  template <class T>
  Status select(std::int32_t layer, const PagedKVView<T>& view, const T* q, std::int32_t num_qo_heads,
                float sm_scale, SketchTelemetry* tel) {
    const auto t0 = std::chrono::steady_clock::now();
    const SketchStore& st = *store_;
    const SketchParams& p = st.params();
    const std::int32_t hkv = st.num_kv_heads(), d = st.head_dim(), g = p.group_pages, P = st.page_size();
    KVKIT_CHECK_STATUS(view.batch_size <= max_batch_ && num_qo_heads == hq_ && view.num_kv_heads == hkv &&
                           view.head_dim == d,
                       StatusCode::kInvalidArgument, "sketch select: batch ", view.batch_size, " heads ",
                       num_qo_heads, " kv heads ", view.num_kv_heads, " head_dim ", view.head_dim,
                       " outside the reserved batch ", max_batch_, " heads ", hq_);
    const std::int32_t grp = num_qo_heads / hkv;
    const double scale = sm_scale;
    const unsigned need = bounds_needed(p);
    const double log_full = std::log(static_cast<double>(g) * P);
    SketchTelemetry t;
    std::int32_t out = 0;
    indptr_[0] = 0;
    for (std::int32_t b = 0; b < view.batch_size; ++b) {
      const std::int32_t np = view.num_pages(b), len = view.seq_len(b);
      KVKIT_CHECK_STATUS(np <= max_pages_, StatusCode::kInvalidArgument, "sketch select: sequence row ", b,
                         " has ", np, " pages, more than the reserved ", max_pages_);
      const std::int32_t ng = (np + g - 1) / g;
      for (std::int32_t j = 0; j < ng; ++j) {  // records are shared by the kv heads
        const std::int32_t r = st.record_of(layer, view.page_id(b, j * g));
        rec_[j] = r >= 0 && st.record_matches(layer, r, view, b, j * g) ? r : -1;
      }
      for (std::int32_t h = 0; h < hkv; ++h) {
        t.pages_total += np;
        const bool on = st.head_on(layer, h);
        std::int32_t nc = 0;
        for (std::int32_t j = 0; j < ng; ++j) {
          always_[j] = (!on || j >= ng - p.last_n || rec_[j] < 0) ? 1 : 0;
          visit_[j] = always_[j];
          if (!always_[j]) {
            cand_[nc] = j;
            crec_[nc++] = rec_[j];
          }
        }
        if (!on) {  // pre-pass off for this head: every page read, nothing omitted
          for (std::int32_t gq = 0; gq < grp; ++gq) omitted_[static_cast<std::size_t>(b) * num_qo_heads + h * grp + gq] = 0;
        } else {
          for (std::int32_t gq = 0; gq < grp; ++gq) {
            const T* qp = q + (static_cast<std::size_t>(b) * num_qo_heads + h * grp + gq) * d;
            float* qf = qbuf_.data() + static_cast<std::size_t>(gq) * d;
            double qn = 0;
            for (std::int32_t c = 0; c < d; ++c) {
              qf[c] = to_float(qp[c]);
              qn += static_cast<double>(qf[c]) * qf[c];
            }
            qn_[gq] = std::sqrt(qn);
          }
          // min(box, norm) of every candidate for every query head: one read of the box.
          detail::box_norm_bounds(st.box_min(layer, h), st.box_max(layer, h), st.max_norm(layer, h),
                                  st.box_amax_norm(layer, h), crec_.data(),
                                  nc, d, qbuf_.data(), qn_.data(), grp, cert_.data(), nc);
          if (st.basis_ready(layer, h)) {  // kRotBox: min with the rotated box
            for (std::int32_t gq = 0; gq < grp; ++gq)
              rq_[gq] = detail::rotate_query(st.basis(layer, h), st.basis_eps(layer, h), d,
                                             qbuf_.data() + static_cast<std::size_t>(gq) * d, qn_[gq],
                                             qrot_.data() + static_cast<std::size_t>(gq) * d, rwork_.data());
            detail::rot_bounds(st.rot_min(layer, h), st.rot_max(layer, h), st.rot_amax_norm(layer, h),
                               st.max_norm(layer, h), crec_.data(), nc, d, qrot_.data(), rq_.data(), grp,
                               cert_.data(), nc);
          }
          if (st.coded()) {  // kCodes: per-token log-mass bounds, a group's codes read once for all query heads
            for (std::int32_t i = 0; i < nc; ++i)
              for (std::int32_t gq = 0; gq < grp; ++gq) {
                double& hi = chi_[static_cast<std::size_t>(gq) * nc + i];
                double& lo = clo_[static_cast<std::size_t>(gq) * nc + i];
                if (st.has_codes(layer, crec_[i])) {
                  codes_bounds(st, layer, crec_[i], h, qbuf_.data() + static_cast<std::size_t>(gq) * d, scale,
                               awork_.data(), dwork_.data(), &hi, &lo);
                } else {
                  hi = std::numeric_limits<double>::infinity();
                  lo = -std::numeric_limits<double>::infinity();
                }
              }
          }
          for (std::int32_t gq = 0; gq < grp; ++gq) select_head(layer, view, b, h, gq, num_qo_heads, nc, len, scale,
                                                                log_full, need, t);
        }
        // Emit the union in ascending logical order.
        for (std::int32_t j = 0; j < ng; ++j) {
          if (!visit_[j]) continue;
          const std::int32_t pe = std::min(np, (j + 1) * g);
          for (std::int32_t pg = j * g; pg < pe; ++pg) {
            subset_[out++] = pg;
            ++t.pages_visited;
            const std::int32_t ntok = pg == np - 1 ? len - pg * P : P;
            t.bytes_kv_read_est += static_cast<std::int64_t>(ntok) * (view.head_dim + view.v_head_dim) *
                                   static_cast<std::int64_t>(sizeof(T));
          }
        }
        indptr_[static_cast<std::size_t>(b) * hkv + h + 1] = out;
        for (std::int32_t gq = 0; gq < grp; ++gq)
          t.certified_omitted_max =
              std::max(t.certified_omitted_max, omitted_[static_cast<std::size_t>(b) * num_qo_heads + h * grp + gq]);
      }
    }
    t.prepass_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (tel != nullptr) *tel = t;
    return Status::ok();
  }

  const std::int32_t* indptr() const { return indptr_.data(); }  // [batch * Hkv + 1]
  const std::int32_t* subset() const { return subset_.data(); }  // [indptr()[batch * Hkv]]
  /// Omitted-mass bound of (row b, query head hq) from the last select(): certified in
  /// strict mode (>= the true omitted softmax fraction), an estimate otherwise.
  double omitted_bound(std::int32_t b, std::int32_t hq) const {
    return omitted_[static_cast<std::size_t>(b) * hq_ + hq];
  }

 private:
  // Query head gq of kv head h, row b: exact mass of the always-visited groups, bounds of
  // the nc candidates (cert_ row gq, tightened by FD / estimates when the method asks),
  // then the ε rule; marks visit_.
  template <class T>
  void select_head(std::int32_t layer, const PagedKVView<T>& view, std::int32_t b, std::int32_t h, std::int32_t gq,
                   std::int32_t num_qo_heads, std::int32_t nc, std::int32_t len, double scale, double log_full,
                   unsigned need, SketchTelemetry& t) {
    const SketchStore& st = *store_;
    const SketchParams& p = st.params();
    const std::int32_t d = st.head_dim(), g = p.group_pages, P = st.page_size(), grp = num_qo_heads / st.num_kv_heads();
    const float* qf = qbuf_.data() + static_cast<std::size_t>(gq) * d;
    double& omitted = omitted_[static_cast<std::size_t>(b) * num_qo_heads + h * grp + gq];
    if (need & kBoundsJL) {  // z = Φᵀq, read only by the JL estimate
      const std::int32_t m = p.jl_dim;
      const float* ph = st.phi(h);
      for (std::int32_t a = 0; a < m; ++a) z_[a] = 0;
      for (std::int32_t c = 0; c < d; ++c)
        for (std::int32_t a = 0; a < m; ++a) z_[a] += static_cast<double>(qf[c]) * ph[c * m + a];
    }
    // Exact log-mass of the always-visited groups (online max; logits rounded down by
    // their float error bound, so S stays a lower bound of their mass).
    const std::int32_t ng = (view.num_pages(b) + g - 1) / g;
    double mx = -std::numeric_limits<double>::infinity(), S = 0;
    for (std::int32_t j = 0; j < ng; ++j) {
      if (!always_[j]) continue;
      for (std::int32_t tk = j * g * P; tk < std::min(len, (j + 1) * g * P); ++tk) {
        const double x = scale * logit_lo(qf, view.k_ptr(b, tk, h), d);
        if (x > mx) {
          S = S * std::exp(mx - x) + 1.0;
          mx = x;
        } else {
          S += std::exp(x - mx);
        }
      }
    }
    // Upper log-mass bound of every candidate: log(tokens) + s·U.
    const double* cert = cert_.data() + static_cast<std::size_t>(gq) * nc;
    double ref = mx;
    for (std::int32_t i = 0; i < nc; ++i) {
      const std::int32_t j = cand_[i];
      const std::int32_t ntok = std::min(len - j * g * P, g * P);
      double u = cert[i];
      if (need != 0) {
        const GroupBounds gb = group_bounds(st, layer, crec_[i], h, qf, qn_[gq], z_.data(), need);
        u = upper_bound(p, gb);
      }
      ub_[i] = (ntok == g * P ? log_full : std::log(static_cast<double>(ntok))) + scale * u;
      if (st.coded()) ub_[i] = std::min(ub_[i], chi_[static_cast<std::size_t>(gq) * nc + i]);
      ref = std::max(ref, ub_[i]);
    }
    if (!(S > 0) || !std::isfinite(mx)) {  // nothing always visited: visit everything
      for (std::int32_t i = 0; i < nc; ++i) visit_[cand_[i]] = 1;
      omitted = 0;
      return;
    }
    // Masses relative to `ref` >= every logit, so no exp overflows.
    detail::Mass128 W;
    for (std::int32_t i = 0; i < nc; ++i) {
      w_[i] = detail::quantise_mass(ub_[i] - ref);
      W.add(w_[i]);
    }
    const std::int32_t lim = p.top_pages > 0 ? std::min(nc, std::max(1, p.top_pages / g)) : nc;
    if (st.coded()) {
      // Z >= the always-visited mass + every candidate's lower bound: the walk needs no keys.
      double s0 = S * std::exp(mx - ref);
      for (std::int32_t i = 0; i < nc; ++i) s0 += std::exp(clo_[static_cast<std::size_t>(gq) * nc + i] - ref) * (1 - 0x1p-50);
      const detail::WalkResult r = detail::bound_walk(ub_.data(), w_.data(), W, nc, s0, p.eps, lim, ord_.data(), out_.data());
      // The omitted fraction M_Ω/Z: <= T/s0, and <= T/(T + S_vis) with S_vis the lower
      // bound of what is read (not T/(T + s0): s0 also counts the skipped groups' mass).
      double s_vis = S * std::exp(mx - ref);
      for (std::int32_t k = 0; k < r.visited; ++k) {
        visit_[cand_[out_[k]]] = 1;
        s_vis += std::exp(clo_[static_cast<std::size_t>(gq) * nc + out_[k]] - ref) * (1 - 0x1p-50);
      }
      omitted = r.tail > 0 ? std::min(r.omitted, r.tail / (r.tail + s_vis)) : 0.0;
      return;
    }
    const std::int32_t cap = detail::score_limit(p.score_budget, p.score_fraction, nc);
    const detail::WalkResult r = detail::certified_walk(
        ub_.data(), w_.data(), W, nc, S * std::exp(mx - ref), p.eps, lim, cap, ord_.data(), out_.data(),
        [&](std::int32_t i) { return group_mass(view, b, h, qf, cand_[i], len, scale, ref); });
    for (std::int32_t k = 0; k < r.visited; ++k) visit_[cand_[out_[k]]] = 1;
    t.groups_scored += r.scored;
    omitted = r.omitted;
  }

  // q·k in float minus its rounding error bound: 8 accumulators (lane j takes the channels
  // c ≡ j mod 8, the tail goes to lane 0), each product rounded, then added; the lanes
  // summed in double in lane order. detail::F8 does the 8 lanes in one or two vector
  // registers with the same IEEE operations, so every backend gives the same bits.
  template <class T>
  static double logit_lo(const float* q, const T* k, std::int32_t d) {
    detail::F8 a = detail::F8::zero(), mg = detail::F8::zero();
    std::int32_t c = 0;
    for (; c + 8 <= d; c += 8) {
      const detail::F8 x = detail::F8::load(q + c) * load8(k + c);
      a = a + x;
      mg = mg + detail::F8::abs(x);
    }
    float a8[8], m8[8];
    a.store(a8);
    mg.store(m8);
    for (; c < d; ++c) {
      const float x = q[c] * to_float(k[c]);
      a8[0] += x;
      m8[0] += std::fabs(x);
    }
    double acc = 0, mag = 0;
    for (int j = 0; j < 8; ++j) {
      acc += a8[j];
      mag += m8[j];
    }
    return acc - detail::float_sum_slack(d) * mag;
  }
  // 8 keys as floats (a plain load for float keys).
  static detail::F8 load8(const float* k) { return detail::F8::load(k); }
  template <class T>
  static detail::F8 load8(const T* k) {
    float f[8];
    for (int j = 0; j < 8; ++j) f[j] = to_float(k[j]);
    return detail::F8::load(f);
  }
  // Σ exp(s·q·k − ref) over group j's tokens (a lower bound of its mass relative to ref);
  // rows addressed page by page.
  template <class T>
  double group_mass(const PagedKVView<T>& view, std::int32_t b, std::int32_t h, const float* q, std::int32_t j,
                    std::int32_t len, double scale, double ref) const {
    const std::int32_t g = store_->params().group_pages, P = store_->page_size(), d = store_->head_dim();
    double m = 0;
    const std::int32_t end = std::min(len, (j + 1) * g * P);
    for (std::int32_t t0 = j * g * P; t0 < end; t0 += P) {
      const T* k = view.k_ptr(b, t0, h);
      const std::int32_t n = std::min(P, end - t0);
      for (std::int32_t i = 0; i < n; ++i, k += view.k_stride_token)
        m += std::exp(scale * logit_lo(q, k, d) - ref);
    }
    return m;
  }

  const SketchStore* store_;
  std::int32_t max_batch_ = 0, hq_ = 0, max_pages_ = 0;
  std::vector<std::int32_t> indptr_, subset_, ord_, out_, cand_, crec_, rec_;
  std::vector<double> cert_, ub_, z_, qn_, omitted_;
  std::vector<detail::Mass128> w_;
  std::vector<std::uint8_t> visit_, always_;
  std::vector<float> qbuf_;
  std::vector<float> qrot_;                 // [grp, d] rotated queries (kRotBox)
  std::vector<detail::RotQuery> rq_;        // [grp]
  std::vector<double> rwork_;               // [2d] rotate_query's work
  std::vector<double> chi_, clo_;           // [grp, groups] kCodes log-mass bounds (upper, lower)
  std::vector<float> awork_;                // [d] codes_log_mass's a
  std::vector<double> dwork_;               // [g·P] codes_log_mass's token dots
};

}  // namespace sketch
}  // namespace kvkit
