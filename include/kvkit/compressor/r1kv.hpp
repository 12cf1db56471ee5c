#pragma once
// R1KV (R-KV) token eviction: the exact algorithm of ../shared/specs/r1kv.md, as a
// Compressor policy that picks, per (sequence, kv head), which cache slots to keep.
//
// The math, one layer, one sequence, KV head h (S slots, window w, budget Bud, G = Hq/Hkv):
//   1. l[r,j]  = max_g <q[hG+g, r], k[h,j]> / sqrt(D)   for the last R = min(w, Lq) query
//                rows r and candidates j in [0, S-w)          (detail::importance)
//   2. p[r,.]  = softmax_j l[r,.] in float32;  a[j] = mean_r p[r,j]
//   3. I[j]    = max_{|j'-j| <= kernel/2, 0 <= j' < S-w} a[j']  (max-pool, truncated edges)
//   4. n_j     = k_j / (|k_j|_2 + 1e-8);  C[i,j] = <n_i,n_j>, C[i,i] = 0
//      r(i)    = max{ j : C[i,j] > thr } or 0;  C[i,r(i)] = 0
//      m_j     = (1/S) sum_i C[i,j]   (all rows, raw cosines incl. negatives)
//      Rd      = softmax_j m  over all S columns, first S-w kept   (detail::redundancy)
//   5. Z[j]    = lambda I[j] - (1-lambda) Rd[j]
//   6. keep the Bud-w largest Z (ties: lower slot first), then the last w slots.
//      KeepOrder::kReference: selected in descending Z, then the window (what the
//      reference returns; consecutive compressions need it because step 3 pools over slot
//      order); KeepOrder::kPositional: all kept slots ascending.
// S < Bud: nothing happens (num_keep = S, keep = 0..S-1). S == Bud: Bud slots, possibly
// reordered (reference order).
//
// How step 4 runs in O(S) memory and mostly O(S*D) time: sum_i C[i,j] = <sum_i n_i, n_j>
// - <n_j,n_j> - sum_{i : r(i)=j, i != j} <n_i,n_j>, so only the search for r(i) touches
// pairs: it scans j from S-1 downward, stops at the first cosine above thr, and uses the
// symmetry of C so no cosine is computed twice (detail::redundancy). Random keys (no
// near-duplicates) still cost S^2/2 cosines; keys sharing a direction, as real post-RoPE
// keys often do, stop after a few. Sums are taken in double, so scores differ from a
// float64 evaluation only by the float32 logits/softmax/normalised keys (relative ~1e-6):
// kept sets are identical except where two scores are that close (near-ties).
//
// Deliberate differences from the reference code (each a fix):
// - batches: the reference computes redundancy from batch element 0 for every element;
//   here each sequence uses its own keys (identical for batch size 1).
// - only retain_direction="last" (the reference default); the "first" variants are
//   degenerate upstream.
//
// Other scorers of the same pipeline (same Params, same select API, so they compare at
// equal budgets) are in <kvkit/compressor/scorers.hpp>: SnapKV (Z = I, no redundancy) and
// StreamingLLM (sinks + most recent). This header includes no other policy.
//
// Execution: exec::Host (plain loops written to vectorise, an int8 VNNI filter for the r(i)
// scan where AVX-512 VNNI is compiled in; parallel over kv heads) and exec::Cuda: the
// same select on device buffers, with its kernels in <kvkit/kernels/cuda/r1kv.cuh>
// (reached through <kvkit/cuda.cuh>); it never allocates or synchronises the host, so an
// engine can capture it in a CUDA graph.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kvkit/core/config.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/cpu/checks.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/cpu/simd.hpp"  // the ISA choice and <immintrin.h> (warnings silenced there)

// The r(i) scan's int8 cosine filter (detail::redundancy) needs AVX-512 VNNI on top of
// simd.hpp's AVX-512 path; elsewhere the scan computes every cosine in float (same kept
// sets). KVKIT_SIMD_PORTABLE turns it off (simd.hpp then picks no vector path).
#if defined(KVKIT_SIMD_AVX512) && (defined(__GNUC__) || defined(__clang__)) && \
    defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVKIT_R1KV_VNNI 1
#endif

namespace kvkit {
namespace compressor {

/// Order of the kept slots of one (sequence, kv head).
enum class KeepOrder : unsigned char {
  kReference = 0,  // selected slots by descending score (ties: lower slot first), then window
  kPositional = 1  // every kept slot ascending: compact_tokens' fast (in-place) path
};

/// Settings shared by every scorer of the pipeline (defaults: the spec's). Checked by
/// validate(), which Compressor's constructor calls: a kvkit::Error names the bad value.
struct Params {
  std::int32_t budget = 0;            // Bud: slots kept per kv head after a compression
  std::int32_t window = 8;            // w: last slots always kept; also the query rows used
  std::int32_t kernel = 7;            // max-pool width over slot order (odd)
  float lambda = 0.07f;               // mix: Z = lambda I - (1 - lambda) Rd
  std::int32_t buffer = 128;          // the engine compresses when seq_len >= budget + buffer
  float similarity_threshold = 0.5f;  // cosine above which a key is a near-duplicate
  std::int32_t sinks = 4;             // StreamingLLM only: first slots kept (at most budget-window)
  KeepOrder order = KeepOrder::kReference;

  /// Throws kvkit::Error naming the first value out of range.
  void validate() const {
    KVKIT_CHECK(window > 0, "compressor: window must be > 0, got ", window);
    KVKIT_CHECK(budget > window, "compressor: budget must be > window (", window, "), got ",
                budget);
    KVKIT_CHECK(kernel >= 1 && kernel % 2 == 1, "compressor: kernel must be odd and >= 1, got ",
                kernel);
    KVKIT_CHECK(lambda >= 0.f && lambda <= 1.f, "compressor: lambda must be in [0, 1], got ",
                lambda);
    KVKIT_CHECK(buffer >= 0, "compressor: buffer must be >= 0, got ", buffer);
    KVKIT_CHECK(similarity_threshold >= -1.f && similarity_threshold <= 1.f,
                "compressor: similarity_threshold must be in [-1, 1], got ", similarity_threshold);
    KVKIT_CHECK(sinks >= 0, "compressor: sinks must be >= 0, got ", sinks);
    KVKIT_CHECK(order == KeepOrder::kReference || order == KeepOrder::kPositional,
                "compressor: unknown order ", static_cast<int>(order));
  }
};

/// Shape of one select call (or, for workspace_size, the largest call planned).
struct Shape {
  std::int32_t num_kv_heads = 0;  // Hkv
  std::int32_t num_q_heads = 0;   // Hq, a multiple of Hkv (query head h*G+g reads kv head h)
  std::int32_t head_dim = 0;      // D of keys and queries
  std::int32_t seq_len = 0;       // S (for workspace_size: the largest S, e.g. budget+buffer)
  std::int32_t num_queries = 0;   // Lq rows in the query window (only the last `window` used)
};

/// The R1KV scorer: attention importance mixed with key redundancy (spec step 5).
struct R1KV {
  static constexpr const char* kName = "r1kv";
  static constexpr bool kUsesAttention = true;
  static constexpr bool kUsesRedundancy = true;
  KVKIT_HOST_DEVICE static double score(const Params& p, double importance, double redundancy,
                                        std::int32_t, std::int32_t) {
    const double lam = p.lambda;
    return lam * importance - (1.0 - lam) * redundancy;
  }
};

namespace detail {

/// The scalar tail [d, dim) of dot4 added to the 4 reduced sums r, written to out.
inline void dot4_tail(const float* a0, const float* a1, const float* a2, const float* a3,  // [D] each
                      const float* b, std::int32_t d, std::int32_t dim, float r[4], float out[4]) {
  for (; d < dim; ++d) {
    r[0] += a0[d] * b[d];
    r[1] += a1[d] * b[d];
    r[2] += a2[d] * b[d];
    r[3] += a3[d] * b[d];
  }
  for (int i = 0; i < 4; ++i) out[i] = r[i];
}

/// Four dot products <a_r, b> over D floats: each load of b serves four rows. Eight
/// independent lanes per row (GCC/Clang vector extensions, plain arrays elsewhere) so the
/// loop vectorises without -ffast-math; lanes are summed in a fixed order (reduce8), so
/// results do not depend on the instruction set beyond FMA contraction.
#if defined(__GNUC__) || defined(__clang__)
// 8 lanes: one ymm with AVX (16-lane zmm measured slower on Zen 4), two xmm on SSE2.
constexpr int kLanes = 8;
typedef float F8 __attribute__((vector_size(kLanes * 4)));
// By reference: returning a 32-byte vector by value changes the ABI without AVX (-Wpsabi).
inline void load8(F8& v, const float* p) {  // p: [kLanes], any alignment
  std::memcpy(&v, p, sizeof(v));
}
/// Horizontal sums of eight vectors at once: out[k] = sum of the lanes of v_k, for
/// v = (v0, v1, v2, v3, v4, v5, v6, v7) returned as lanes (v0, v2, v4, v6, v1, v3, v5, v7).
/// Every lane sum is ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), whatever the other vectors.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KVKIT_R1KV_SHUFFLE 1
#endif
#endif
inline void reduce8(const F8& v0, const F8& v1, const F8& v2, const F8& v3, const F8& v4,
                    const F8& v5, const F8& v6, const F8& v7, float out[8]) {
#if defined(KVKIT_R1KV_SHUFFLE)
  const F8 w0 = __builtin_shufflevector(v0, v1, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v0, v1, 4, 5, 6, 7, 12, 13, 14, 15);
  const F8 w1 = __builtin_shufflevector(v2, v3, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v2, v3, 4, 5, 6, 7, 12, 13, 14, 15);
  const F8 w2 = __builtin_shufflevector(v4, v5, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v4, v5, 4, 5, 6, 7, 12, 13, 14, 15);
  const F8 w3 = __builtin_shufflevector(v6, v7, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v6, v7, 4, 5, 6, 7, 12, 13, 14, 15);
  const F8 x0 = __builtin_shufflevector(w0, w1, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(w0, w1, 2, 3, 10, 11, 6, 7, 14, 15);
  const F8 x1 = __builtin_shufflevector(w2, w3, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(w2, w3, 2, 3, 10, 11, 6, 7, 14, 15);
  const F8 y = __builtin_shufflevector(x0, x1, 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(x0, x1, 1, 3, 9, 11, 5, 7, 13, 15);
  std::memcpy(out, &y, sizeof(y));
#else
  const F8* v[8] = {&v0, &v2, &v4, &v6, &v1, &v3, &v5, &v7};
  for (int k = 0; k < 8; ++k) {
    const F8& x = *v[k];
    out[k] = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
  }
#endif
}
inline void dot4(const float* a0, const float* a1, const float* a2, const float* a3,  // [D] each
                 const float* b,                                                      // [D]
                 std::int32_t dim, float out[4]) {
  F8 s0 = {}, s1 = {}, s2 = {}, s3 = {};
  std::int32_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    F8 bv, x0, x1, x2, x3;
    load8(bv, b + d);
    load8(x0, a0 + d);
    load8(x1, a1 + d);
    load8(x2, a2 + d);
    load8(x3, a3 + d);
    s0 += x0 * bv;
    s1 += x1 * bv;
    s2 += x2 * bv;
    s3 += x3 * bv;
  }
  const F8 z = {};
  float r[8];
  reduce8(s0, z, s1, z, s2, z, s3, z, r);  // r[0..4) = rows 0..3
  dot4_tail(a0, a1, a2, a3, b, d, dim, r, out);
}
/// dot4 against two columns b0 and b1 at once (8 accumulators, 6 loads per 8 FMAs); the
/// same per-lane arithmetic and reduction order as dot4, so results equal two dot4 calls.
inline void dot4x2(const float* a0, const float* a1, const float* a2, const float* a3,  // [D] each
                   const float* b0, const float* b1,                                  // [D] each
                   std::int32_t dim, float out0[4], float out1[4]) {
  F8 s0 = {}, s1 = {}, s2 = {}, s3 = {}, t0 = {}, t1 = {}, t2 = {}, t3 = {};
  std::int32_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    F8 x0, x1, x2, x3, u, v;
    load8(x0, a0 + d);
    load8(x1, a1 + d);
    load8(x2, a2 + d);
    load8(x3, a3 + d);
    load8(u, b0 + d);
    load8(v, b1 + d);
    s0 += x0 * u;
    s1 += x1 * u;
    s2 += x2 * u;
    s3 += x3 * u;
    t0 += x0 * v;
    t1 += x1 * v;
    t2 += x2 * v;
    t3 += x3 * v;
  }
  if (d < dim) {  // ragged head dim: finish with the scalar tails of dot4
    dot4(a0, a1, a2, a3, b0, dim, out0);
    dot4(a0, a1, a2, a3, b1, dim, out1);
    return;
  }
  float r[8];
  reduce8(s0, t0, s1, t1, s2, t2, s3, t3, r);  // (s0, s1, s2, s3, t0, t1, t2, t3)
  for (int i = 0; i < 4; ++i) {
    out0[i] = r[i];
    out1[i] = r[4 + i];
  }
}
/// dot4 against four columns (16 accumulators: worth it with AVX-512's 32 registers);
/// the same per-lane arithmetic and reduction order as dot4.
inline void dot4x4(const float* const a[4],  // 4 rows, [D] each
                   const float* const b[4],  // 4 columns, [D] each
                   std::int32_t dim, float out[4][4]) {  // out[column][row]
  F8 acc[4][4] = {};
  std::int32_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    F8 x[4], y[4];
    for (int t = 0; t < 4; ++t) load8(x[t], a[t] + d);
    for (int c = 0; c < 4; ++c) load8(y[c], b[c] + d);
    for (int c = 0; c < 4; ++c)
      for (int t = 0; t < 4; ++t) acc[c][t] += x[t] * y[c];
  }
  if (d < dim) {  // ragged head dim: dot4 handles the scalar tail
    for (int c = 0; c < 4; ++c) dot4(a[0], a[1], a[2], a[3], b[c], dim, out[c]);
    return;
  }
  for (int c = 0; c < 4; c += 2) {
    float r[8];
    reduce8(acc[c][0], acc[c + 1][0], acc[c][1], acc[c + 1][1], acc[c][2], acc[c + 1][2],
            acc[c][3], acc[c + 1][3], r);
    for (int t = 0; t < 4; ++t) {
      out[c][t] = r[t];
      out[c + 1][t] = r[4 + t];
    }
  }
}
#else
inline void dot4(const float* a0, const float* a1, const float* a2, const float* a3,  // [D] each
                 const float* b,                                                      // [D]
                 std::int32_t dim, float out[4]) {
  float s0[8] = {}, s1[8] = {}, s2[8] = {}, s3[8] = {};
  std::int32_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int l = 0; l < 8; ++l) {
      const float bv = b[d + l];
      s0[l] += a0[d + l] * bv;
      s1[l] += a1[d + l] * bv;
      s2[l] += a2[d + l] * bv;
      s3[l] += a3[d + l] * bv;
    }
  }
  float r[4] = {0.f, 0.f, 0.f, 0.f};
  for (int l = 0; l < 8; ++l) {
    r[0] += s0[l];
    r[1] += s1[l];
    r[2] += s2[l];
    r[3] += s3[l];
  }
  dot4_tail(a0, a1, a2, a3, b, d, dim, r, out);
}
inline void dot4x2(const float* a0, const float* a1, const float* a2, const float* a3,  // [D] each
                   const float* b0, const float* b1,                                  // [D] each
                   std::int32_t dim, float out0[4], float out1[4]) {
  dot4(a0, a1, a2, a3, b0, dim, out0);
  dot4(a0, a1, a2, a3, b1, dim, out1);
}
inline void dot4x4(const float* const a[4], const float* const b[4], std::int32_t dim,
                   float out[4][4]) {
  for (int c = 0; c < 4; ++c) dot4(a[0], a[1], a[2], a[3], b[c], dim, out[c]);
}
#endif

/// <a, b> in double, four independent lanes (vectorisable without -ffast-math).
template <class A>
inline double dot_double(const A* a, const float* b, std::int32_t dim) {  // [D], [D]
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::int32_t d = 0;
  for (; d + 4 <= dim; d += 4)
    for (int l = 0; l < 4; ++l) s[l] += static_cast<double>(a[d + l]) * b[d + l];
  for (; d < dim; ++d) s[0] += static_cast<double>(a[d]) * b[d];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

/// int8 copies of one head's normalised keys for the r(i) scan's filter (detail::redundancy):
/// q[i,k] = round(n[i,k] / scale[i]) with scale[i] = max_k |n[i,k]| / 127, so
/// <n_i, n_j> = scale[i] scale[j] sum_k q[i,k] q[j,k] + e with |e| <= the head's `band`.
/// Columns are packed for VNNI (16 columns x 4 dims per 64-byte vector, stored as q + 128).
struct CosineFilter {
  std::int8_t* rows = nullptr;    // [ceil(S/16), D4/4, 16, 4] q, 0 past S / D (D4 = D up to 4)
  std::uint8_t* cols = nullptr;   // [ceil(S/16), D4/4, 16, 4] q + 128 (the same bytes ^ 0x80)
  float* scale = nullptr;         // [ceil(S/16)*16] max_k |n[i,k]| / 127 (0: zero key, padding)
  std::int32_t* corr = nullptr;   // [S] 128 sum_k q[i,k] (the +128 of the packed side)
};

inline std::size_t filter_dim(std::size_t d) { return (d + 3) / 4 * 4; }
inline std::size_t filter_cols(std::size_t s) { return (s + 15) / 16 * 16; }

/// Per-head scratch of the pipeline, carved from one worker's slab.
struct HeadScratch {
  float* keys = nullptr;    // [S, D] raw keys as float
  float* normed = nullptr;  // [S, D] n_j = k_j / (|k_j| + 1e-8)
  float* queries = nullptr; // [G*R, D] this head's query rows
  float* logits = nullptr;  // [R, S-w] GQA-max-pooled logits
  double* attn = nullptr;   // [S] a[j], then reused
  double* imp = nullptr;    // [S] I[j]
  double* red = nullptr;    // [S] m_j, then Rd
  double* score = nullptr;  // [S] Z[j]
  std::int32_t* near = nullptr;  // [S] r(i)
  std::int32_t* low = nullptr;   // [S] largest lower match found in phase A
  std::int32_t* reach = nullptr; // [S] lowest column phase A computed per row
  std::int32_t* early = nullptr; // [S] rows whose phase-A scan stopped early
  std::int32_t* order = nullptr; // [S] candidate slots being ranked
  double* nsum = nullptr;   // [D] sum_i n_i
  CosineFilter filter;      // int8 copies of normed (used with AVX-512 VNNI)
};

inline WorkspaceSizer& size_head_scratch(WorkspaceSizer& w, std::size_t s, std::size_t d,
                                         std::size_t gr, std::size_t r) {
  return w.add<float>(s * d).add<float>(s * d).add<float>(gr * d).add<float>(r * s)
      .add<double>(s).add<double>(s).add<double>(s).add<double>(s)
      .add<std::int32_t>(s).add<std::int32_t>(s).add<std::int32_t>(s).add<std::int32_t>(s)
      .add<std::int32_t>(s).add<double>(d)
      .add<std::int8_t>(filter_cols(s) * filter_dim(d))
      .add<std::uint8_t>(filter_cols(s) * filter_dim(d))
      .add<float>(filter_cols(s)).add<std::int32_t>(s);
}

inline bool carve_head_scratch(WorkspaceCarver& c, std::size_t s, std::size_t d, std::size_t gr,
                               std::size_t r, HeadScratch& h) {
  h.keys = c.take<float>(s * d);
  h.normed = c.take<float>(s * d);
  h.queries = c.take<float>(gr * d);
  h.logits = c.take<float>(r * s);
  h.attn = c.take<double>(s);
  h.imp = c.take<double>(s);
  h.red = c.take<double>(s);
  h.score = c.take<double>(s);
  h.near = c.take<std::int32_t>(s);
  h.low = c.take<std::int32_t>(s);
  h.reach = c.take<std::int32_t>(s);
  h.early = c.take<std::int32_t>(s);
  h.order = c.take<std::int32_t>(s);
  h.nsum = c.take<double>(d);
  h.filter.rows = c.take<std::int8_t>(filter_cols(s) * filter_dim(d));
  h.filter.cols = c.take<std::uint8_t>(filter_cols(s) * filter_dim(d));
  h.filter.scale = c.take<float>(filter_cols(s));
  h.filter.corr = c.take<std::int32_t>(s);
  return h.filter.corr != nullptr;
}

/// Device scratch of the exec::Cuda select for Hkv heads of up to S slots, D dims and R
/// query rows (carved in this order by kernels/cuda/r1kv.cuh).
inline WorkspaceSizer& size_cuda_scratch(WorkspaceSizer& w, std::size_t hkv, std::size_t s,
                                         std::size_t d, std::size_t r) {
  const std::size_t hs = hkv * s;
  return w.add<float>(hs * d)                                  // normed  [Hkv, S, D]
      .add<float>(hs * r)                                      // logits  [Hkv, R, S]
      .add<double>(hs).add<double>(hs).add<double>(hs)         // attn, imp, red [Hkv, S]
      .add<double>(hs)                                         // score   [Hkv, S]
      .add<std::int32_t>(hs).add<std::int32_t>(hs)             // near, rank [Hkv, S]
      .add<double>(hkv * d);                                   // nsum    [Hkv, D]
}

/// Steps 1-3: importance I[j] for candidates j < n_cand (= S - w). queries: [G*R, D]
/// (row g*R + r), keys: [S, D]. Logits and softmax in float32, as the reference.
inline void importance(const float* queries, const float* keys, std::int32_t groups,
                       std::int32_t rows, std::int32_t n_cand, std::int32_t dim,
                       std::int32_t kernel, float* logits, double* attn, double* imp) {
  const float inv_norm = std::sqrt(static_cast<float>(dim));
  const std::int32_t gr = groups * rows;
  float tmp[4], tmp1[4];
  for (std::int32_t r = 0; r < rows; ++r)
    for (std::int32_t j = 0; j < n_cand; ++j)
      logits[static_cast<std::int64_t>(r) * n_cand + j] = -std::numeric_limits<float>::infinity();
  for (std::int32_t j = 0; j < n_cand; j += 2) {  // keys two at a time, queries four
    const std::int32_t j1 = std::min(j + 1, n_cand - 1);
    const float* kj = keys + static_cast<std::int64_t>(j) * dim;
    const float* kj1 = keys + static_cast<std::int64_t>(j1) * dim;
    for (std::int32_t q0 = 0; q0 < gr; q0 += 4) {
      const float* qa[4];
      for (int t = 0; t < 4; ++t)
        qa[t] = queries + static_cast<std::int64_t>(std::min(q0 + t, gr - 1)) * dim;
      dot4x2(qa[0], qa[1], qa[2], qa[3], kj, kj1, dim, tmp, tmp1);
      for (int t = 0; t < 4 && q0 + t < gr; ++t) {
        float* row = logits + static_cast<std::int64_t>((q0 + t) % rows) * n_cand;
        row[j] = std::max(row[j], tmp[t]);  // GQA max over the group, on raw logits
        row[j1] = std::max(row[j1], tmp1[t]);
      }
    }
  }
  for (std::int32_t j = 0; j < n_cand; ++j) attn[j] = 0.0;
  for (std::int32_t r = 0; r < rows; ++r) {
    float* l = logits + static_cast<std::int64_t>(r) * n_cand;
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int32_t j = 0; j < n_cand; ++j) {
      l[j] /= inv_norm;
      mx = std::max(mx, l[j]);
    }
    double sum = 0.0;
    for (std::int32_t j = 0; j < n_cand; ++j) {
      l[j] = std::exp(l[j] - mx);
      sum += l[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (std::int32_t j = 0; j < n_cand; ++j) attn[j] += static_cast<double>(l[j] * inv);
  }
  for (std::int32_t j = 0; j < n_cand; ++j) attn[j] /= rows;
  const std::int32_t half = kernel / 2;
  for (std::int32_t j = 0; j < n_cand; ++j) {
    double m = attn[j];
    const std::int32_t lo = std::max(0, j - half), hi = std::min(n_cand - 1, j + half);
    for (std::int32_t t = lo; t <= hi; ++t) m = std::max(m, attn[t]);
    imp[j] = m;
  }
}

#if defined(KVKIT_R1KV_VNNI)
/// Fills f from normed (see CosineFilter) and returns the head's error band: for every
/// pair, |<n_i, n_j> - scale_i scale_j sum_k q_ik q_jk| < band, the float rounding of both
/// sides included (2 e L + D4 e^2 + 1e-4 with e the largest half step max_i scale_i / 2
/// and L the largest L1 norm of a row: |a.b - a'.b'| <= |a|_1 e_b + |b|_1 e_a + D e_a e_b).
inline float quantize_keys(const float* normed, std::int32_t s, std::int32_t dim,  // [S, D]
                           CosineFilter& f) {
  const std::int32_t d4 = static_cast<std::int32_t>(filter_dim(dim)), k4n = d4 / 4;
  const std::int32_t sp = static_cast<std::int32_t>(filter_cols(s));
  double emax = 0.0, lmax = 0.0;
  for (std::int32_t i = 0; i < sp; ++i) {
    const std::int32_t cb = i / 16, c = i % 16;
    std::int8_t* q = f.rows + static_cast<std::int64_t>(cb) * k4n * 64 + c * 4;  // + k4*64 + e
    if (i >= s) {  // padding rows: q = 0
      for (std::int32_t k = 0; k < d4; ++k) q[(k / 4) * 64 + k % 4] = 0;
      f.scale[i] = 0.f;
      continue;
    }
    // 16 dims at a time (masked tail): |n| max and L1, q = round-to-even(n * 127 / m)
    // clamped to [-127, 127] (NaN -> INT_MIN -> -127), stored as four 4-byte groups.
    const float* n = normed + static_cast<std::int64_t>(i) * dim;
    __m512 vmax = _mm512_setzero_ps(), vl1 = _mm512_setzero_ps();
    for (std::int32_t k = 0; k < dim; k += 16) {
      const __mmask16 mk = dim - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                         : static_cast<__mmask16>((1u << (dim - k)) - 1u);
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, n + k));
      vmax = _mm512_max_ps(a, vmax);  // a NaN lane of a keeps the old maximum
      vl1 = _mm512_add_ps(vl1, a);
    }
    const float m = _mm512_reduce_max_ps(vmax);
    const double l1 = static_cast<double>(_mm512_reduce_add_ps(vl1)) * (1.0 + 1e-5);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    __m512i vsum = _mm512_setzero_si512();
    for (std::int32_t k = 0; k < d4; k += 16) {
      const std::int32_t left = dim - k;
      const __mmask16 mk = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                           : left > 0 ? static_cast<__mmask16>((1u << left) - 1u)
                                      : static_cast<__mmask16>(0);
      __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, n + k), inv));
      qi = _mm512_min_epi32(_mm512_max_epi32(qi, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      vsum = _mm512_add_epi32(vsum, qi);
      alignas(16) std::int8_t b[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(b), _mm512_cvtepi32_epi8(qi));
      for (std::int32_t g = 0; g < 4 && k + 4 * g < d4; ++g)
        std::memcpy(q + ((k / 4) + g) * 64, b + 4 * g, 4);
    }
    const std::int32_t sum = _mm512_reduce_add_epi32(vsum);
    f.scale[i] = m / 127.f;
    f.corr[i] = 128 * sum;
    emax = std::max(emax, 0.5 * static_cast<double>(m) / 127.0);
    lmax = std::max(lmax, l1);
  }
  // cols = rows ^ 0x80 (q + 128), 64 bytes at a time (sp * d4 is a multiple of 64).
  const std::int64_t bytes = static_cast<std::int64_t>(sp) * d4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (std::int64_t b = 0; b < bytes; b += 64)
    _mm512_storeu_si512(f.cols + b, _mm512_xor_si512(_mm512_loadu_si512(f.rows + b), flip));
  return static_cast<float>(2.0 * emax * lmax + d4 * emax * emax + 1e-4);
}

/// Phase A of redundancy with an int8 filter (AVX-512 VNNI): rows in blocks of 16 against
/// columns in blocks of 16, from the last block down; an int8 cosine below thr - band
/// is not a match, above thr + band is one, and the few in between are computed in float
/// (dot4, as phase B). Same outputs as the float scan (near, low, reach), for any keys.
inline void scan_upper_filtered(const float* normed, std::int32_t s, std::int32_t dim,  // [S, D]
                                float thr, CosineFilter& f,
                                std::int32_t* near,    // [S]
                                std::int32_t* low,     // [S]
                                std::int32_t* reach) { // [S]
  const float band = quantize_keys(normed, s, dim, f);
  const __m512 lo = _mm512_set1_ps(thr - band), hi = _mm512_set1_ps(thr + band);
  const std::int32_t k4n = static_cast<std::int32_t>(filter_dim(dim)) / 4;
  constexpr std::int32_t kRows = 16;
  for (std::int32_t i0 = 0; i0 < s; i0 += kRows) {
    bool open[kRows];
    std::int32_t left = 0;
    for (std::int32_t t = 0; t < kRows; ++t) {
      open[t] = i0 + t < s - 1;  // the last row has no upper columns
      left += open[t];
    }
    const std::int8_t* pr = f.rows + static_cast<std::int64_t>(i0 / kRows) * k4n * 64;
    std::int32_t lowest = s;
    // Column blocks from the last one down, while one holds a column above i0.
    for (std::int32_t cb = (s - 1) / 16; left > 0 && 16 * cb + 15 > i0; --cb) {
      __m512i acc[kRows];
      for (std::int32_t t = 0; t < kRows; ++t) acc[t] = _mm512_setzero_si512();
      const std::uint8_t* pc = f.cols + static_cast<std::int64_t>(cb) * k4n * 64;
      for (std::int32_t k = 0; k < k4n; ++k) {
        const __m512i b = _mm512_loadu_si512(pc + static_cast<std::int64_t>(k) * 64);
        const std::int8_t* a = pr + static_cast<std::int64_t>(k) * 64;
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 16
#endif
        for (std::int32_t t = 0; t < kRows; ++t) {
          std::int32_t a4;
          std::memcpy(&a4, a + 4 * t, 4);  // row i0 + t, dims 4k .. 4k+3
          acc[t] = _mm512_dpbusd_epi32(acc[t], b, _mm512_set1_epi32(a4));
        }
      }
      const std::int32_t c0 = 16 * cb;
      lowest = c0;
      const __m512 cs = _mm512_loadu_ps(f.scale + c0);
      const std::int32_t last = std::min(16, s - c0);  // columns c0 .. c0+last-1 exist
      for (std::int32_t t = 0; t < kRows; ++t) {
        const std::int32_t i = i0 + t;
        if (i >= s) break;
        const std::int32_t first = std::max(0, i + 1 - c0);  // columns above i
        if (first >= last) continue;
        const std::uint32_t valid = ((1u << last) - 1u) & ~((1u << first) - 1u);
        const __m512 approx =
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t], _mm512_set1_epi32(f.corr[i]))),
                          _mm512_mul_ps(cs, _mm512_set1_ps(f.scale[i])));
        const std::uint32_t cand = _mm512_cmp_ps_mask(approx, lo, _CMP_GT_OQ) & valid;
        if (cand == 0) continue;
        std::uint32_t match = _mm512_cmp_ps_mask(approx, hi, _CMP_GT_OQ) & cand;
        const float* ni = normed + static_cast<std::int64_t>(i) * dim;
        for (std::uint32_t m = cand & ~match; m != 0; m &= m - 1) {
          const std::int32_t c = __builtin_ctz(m);
          float cc[4];
          dot4(ni, ni, ni, ni, normed + static_cast<std::int64_t>(c0 + c) * dim, dim, cc);
          if (cc[0] > thr) match |= 1u << c;
        }
        for (std::uint32_t m = match; m != 0; m &= m - 1) {
          const std::int32_t j = c0 + __builtin_ctz(m);
          low[j] = std::max(low[j], i);
        }
        if (match != 0 && open[t]) {  // the largest match of the first block with one
          near[i] = c0 + 31 - __builtin_clz(match);
          open[t] = false;
          --left;
        }
      }
    }
    for (std::int32_t t = 0; t < kRows && i0 + t < s; ++t)
      reach[i0 + t] = std::max(lowest, i0 + t + 1);
  }
}
#endif

/// Step 4: Rd[j] for all S slots (into red). normed: [S, D]. near: [S] receives r(i);
/// low, reach, early: [S] scratch.
///
/// r(i) in two phases that compute each cosine at most once (C is symmetric):
///  A. upper matches: rows in blocks of 4 scan columns j > i from S-1 downward, two at a
///     time (64 rows share each chunk of 256 columns, for cache reuse), until every row of
///     the block found its first (= largest) match or reached the diagonal. Row i's
///     computed columns are then [reach[i], S-1]; every computed pair (i, j > i) above the
///     threshold is also a lower match of row j: low[j] = max(low[j], i).
///  B. rows with no upper match: r(i) is the largest lower match. Pairs (j < i) computed
///     in A (reach[j] <= i) above low[i] are known not to match, so only the others are
///     computed, from i-1 down to low[i]; the first match wins, else low[i], else 0.
/// Random keys (no near-duplicates) cost S^2/2 cosines; keys that share a direction stop
/// after a few columns.
inline void redundancy(const float* normed, std::int32_t s, std::int32_t dim, float thr,
                       std::int32_t* near,   // [S]
                       std::int32_t* low,    // [S]
                       std::int32_t* reach,  // [S]
                       std::int32_t* early,  // [S]
                       double* nsum,         // [D]
                       double* red,          // [S]
                       CosineFilter* filter = nullptr) {  // scratch, see CosineFilter
  for (std::int32_t i = 0; i < s; ++i) {
    low[i] = -1;
    near[i] = -1;
  }
#if defined(KVKIT_R1KV_VNNI)
  if (filter != nullptr) {
    scan_upper_filtered(normed, s, dim, thr, *filter, near, low, reach);
  } else  // NOLINT(readability/braces): the portable scan below
#endif
  {  // NOLINT
    (void)filter;
    // Phase A. Columns go in steps of kCols from s-1 down; 64 rows (16 blocks of 4) share
    // each chunk of 256 columns so the chunk's keys stay in L2 while the rows pass over it.
    // Columns per step: 4 with AVX-512 (32 vector registers hold the 4x4 tile), else 2.
  #if defined(__AVX512F__)
    constexpr std::int32_t kCols = 4;
  #else
    constexpr std::int32_t kCols = 2;
  #endif
    constexpr std::int32_t kSub = 16, kChunk = 256 / kCols;
    struct Sub {
      const float* a[4];
      bool open[4];
      int left;
      bool active;
      std::int32_t lowest;
    };
    Sub sub[kSub];
    float cc[4][4];
    for (std::int32_t r0 = 0; r0 < s; r0 += 4 * kSub) {
      bool any = false;
      for (std::int32_t b = 0; b < kSub; ++b) {
        Sub& u = sub[b];
        const std::int32_t i0 = r0 + 4 * b;
        u.left = 0;
        u.lowest = s;
        for (int t = 0; t < 4; ++t) {
          u.a[t] = normed + static_cast<std::int64_t>(std::min(i0 + t, s - 1)) * dim;
          u.open[t] = i0 + t < s - 1;  // the last row has no upper columns
          u.left += u.open[t];
        }
        u.active = u.left > 0;
        any = any || u.active;
      }
      for (std::int32_t k0 = 0; any; k0 += kChunk) {
        any = false;
        for (std::int32_t b = 0; b < kSub; ++b) {
          Sub& u = sub[b];
          if (!u.active) continue;
          const std::int32_t i0 = r0 + 4 * b;
          for (std::int32_t k = k0; k < k0 + kChunk; ++k) {
            const std::int32_t j = s - 1 - kCols * k;  // columns j, j-1, ..., j-kCols+1
            if (j <= i0 || u.left == 0) {
              u.active = false;
              break;
            }
            if (kCols == 4) {
              const float* bc[4];
              for (int c = 0; c < 4; ++c)
                bc[c] = normed + static_cast<std::int64_t>(std::max(j - c, 0)) * dim;
              dot4x4(u.a, bc, dim, cc);
            } else {
              dot4x2(u.a[0], u.a[1], u.a[2], u.a[3], normed + static_cast<std::int64_t>(j) * dim,
                     normed + static_cast<std::int64_t>(j - 1) * dim, dim, cc[0], cc[1]);
            }
            u.lowest = j - kCols + 1;
            for (int t = 0; t < 4; ++t) {
              const std::int32_t i = i0 + t;
              if (i >= s) break;
              for (int c = 0; c < kCols; ++c) {  // descending: the first match is the largest
                const std::int32_t jc = j - c;
                if (jc > i && cc[c][t] > thr) {
                  low[jc] = std::max(low[jc], i);
                  if (u.open[t]) {
                    near[i] = jc;
                    u.open[t] = false;
                    --u.left;
                  }
                }
              }
            }
          }
          if (u.left == 0) u.active = false;
          any = any || u.active;
        }
      }
      for (std::int32_t b = 0; b < kSub; ++b)
        for (int t = 0; t < 4 && r0 + 4 * b + t < s; ++t)
          reach[r0 + 4 * b + t] = std::max(sub[b].lowest, r0 + 4 * b + t + 1);
    }
  }
  // Phase B. Only rows that stopped early (reach[j] > j+1) left pairs (j, i > j) uncomputed.
  std::int32_t n_early = 0;
  for (std::int32_t j = 0; j < s; ++j)
    if (reach[j] > j + 1) early[n_early++] = j;
  std::int32_t below = 0;  // early[0 .. below) are the early rows < i
  for (std::int32_t i = 0; i < s; ++i) {
    while (below < n_early && early[below] < i) ++below;
    if (near[i] >= 0) continue;
    const float* ni = normed + static_cast<std::int64_t>(i) * dim;
    std::int32_t found = -1;
    for (std::int32_t e = below - 1; e >= 0 && early[e] > low[i]; --e) {
      const std::int32_t j = early[e];
      if (reach[j] <= i) continue;  // computed in phase A: not a match (j > low[i])
      float c[4];
      dot4(ni, ni, ni, ni, normed + static_cast<std::int64_t>(j) * dim, dim, c);
      if (c[0] > thr) {
        found = j;
        break;
      }
    }
    near[i] = found >= 0 ? found : (low[i] >= 0 ? low[i] : 0);
  }
  // Column sums: <sum_i n_i, n_j> - <n_j, n_j> - sum_{r(i) = j, i != j} <n_i, n_j>.
  for (std::int32_t d = 0; d < dim; ++d) nsum[d] = 0.0;
  for (std::int32_t i = 0; i < s; ++i) {
    const float* n = normed + static_cast<std::int64_t>(i) * dim;
    for (std::int32_t d = 0; d < dim; ++d) nsum[d] += n[d];
  }
  for (std::int32_t j = 0; j < s; ++j) {
    const float* n = normed + static_cast<std::int64_t>(j) * dim;
    red[j] = dot_double(nsum, n, dim) - dot_double(n, n, dim);
  }
  for (std::int32_t i = 0; i < s; ++i) {
    const std::int32_t j = near[i];
    if (j != i)
      red[j] -= dot_double(normed + static_cast<std::int64_t>(i) * dim,
                           normed + static_cast<std::int64_t>(j) * dim, dim);
  }
  double mx = -std::numeric_limits<double>::infinity();
  for (std::int32_t j = 0; j < s; ++j) {
    red[j] /= s;
    mx = std::max(mx, red[j]);
  }
  double sum = 0.0;
  for (std::int32_t j = 0; j < s; ++j) {
    red[j] = std::exp(red[j] - mx);
    sum += red[j];
  }
  for (std::int32_t j = 0; j < s; ++j) red[j] /= sum;
}

/// Step 6 for one head: writes Bud slots to keep (score: [S-w]; order: [S-w] scratch).
inline void select_slots(const double* score, std::int32_t s, std::int32_t window,
                         std::int32_t budget, KeepOrder ko, std::int32_t* order,
                         std::int32_t* keep) {  // [budget]
  const std::int32_t n_cand = s - window, k = budget - window;
  for (std::int32_t j = 0; j < n_cand; ++j) order[j] = j;
  auto better = [score](std::int32_t a, std::int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  };
  if (k < n_cand) std::nth_element(order, order + k, order + n_cand, better);
  if (ko == KeepOrder::kReference)
    std::sort(order, order + k, better);
  else
    std::sort(order, order + k);
  for (std::int32_t i = 0; i < k; ++i) keep[i] = order[i];
  for (std::int32_t i = 0; i < window; ++i) keep[k + i] = n_cand + i;
}

}  // namespace detail

/// A Compressor policy: picks, per (sequence, kv head), the `budget` cache slots to keep,
/// scoring candidates with `Scorer` (R1KV here; SnapKV / StreamingLLM in scorers.hpp).
///
/// Engine use (after a decode step, for each sequence b with seq_len >= budget + buffer,
/// see should_compress): call select(...) with b's keys (straight from the PagedKVView, or
/// dense [Hkv, S, D] buffers from gather_tokens) and the layer's last `window` post-RoPE
/// queries [Hq, Lq, D], writing keep + b*Hkv*keep_stride and num_keep[b]; then
/// compact_tokens(ex, view, keep, num_keep, keep_stride, ws) and shrink seq_len(b) to
/// num_keep[b], returning the pages past it. keep_stride >= budget. Reference order keeps
/// multi-step parity with the reference (compact_tokens stages it through its workspace);
/// positional order gives strictly ascending lists (compact_tokens' in-place fast path)
/// but changes later compressions (step 3 pools over slot order). When S < budget,
/// num_keep = S and keep = 0..S-1: nothing to compact. Run paths never allocate or throw.
template <class Scorer>
class Compressor {
 public:
  /// Validates p (kvkit::Error naming the bad value).
  explicit Compressor(const Params& p, Scorer scorer = Scorer{}) : params_(p), scorer_(scorer) {
    p.validate();
  }

  const Params& params() const { return params_; }
  const Scorer& scorer() const { return scorer_; }

  /// True when a sequence of seq_len tokens is due for compression (>= budget + buffer).
  bool should_compress(std::int32_t seq_len) const {
    return static_cast<std::int64_t>(seq_len) >=
           static_cast<std::int64_t>(params_.budget) + params_.buffer;
  }

  /// Slots a sequence of seq_len tokens holds after select: min(seq_len, budget).
  std::int32_t num_keep(std::int32_t seq_len) const { return std::min(seq_len, params_.budget); }

  /// Scratch bytes select needs for calls up to `max` (largest S and Lq) under `ex`.
  std::size_t workspace_size(exec::Host ex, const Shape& max) const {
    if (max.num_kv_heads <= 0 || max.head_dim <= 0 || max.seq_len <= 0) return 0;
    const std::size_t workers = static_cast<std::size_t>(
        kvkit::detail::host_workers(ex, max.num_kv_heads));
    WorkspaceSizer w;
    w.add<std::int32_t>(static_cast<std::size_t>(max.num_kv_heads));  // per-head status
    for (std::size_t i = 0; i < workers; ++i) size_slab(w, max);
    return w.bytes();
  }

  /// Device scratch bytes the exec::Cuda select needs for calls up to `max`.
  std::size_t workspace_size(exec::Cuda, const Shape& max) const {
    if (max.num_kv_heads <= 0 || max.head_dim <= 0 || max.seq_len <= 0) return 0;
    const std::size_t r = static_cast<std::size_t>(rows_used(params_, max));
    WorkspaceSizer w;
    detail::size_cuda_scratch(w, static_cast<std::size_t>(max.num_kv_heads),
                              static_cast<std::size_t>(max.seq_len),
                              static_cast<std::size_t>(max.head_dim), r);
    return w.bytes();
  }

  /// The CUDA twin of the dense select: keys, queries, keep and num_keep are device
  /// memory on ex.stream, ws is device memory of workspace_size(ex, shape) bytes. Scalars
  /// are checked on the host (a Status right away); non-finite scores are reported to
  /// ex.status (kInvalidArgument, as the CPU twin) and then keep / num_keep are not
  /// written. Never allocates or synchronises: the caller reads num_keep (or already
  /// knows it: min(S, budget)) after synchronising. Defined in kernels/cuda/r1kv.cuh.
  template <class T>
  Status select(exec::Cuda ex, const T* keys,  // [Hkv, S, D] device
                const T* queries,              // [Hq, Lq, D] device
                const Shape& shape,
                std::int32_t* keep,       // [Hkv, keep_stride] device
                std::int32_t keep_stride,
                std::int32_t* num_keep,   // [1] device
                Workspace ws) const;

  /// Selects the kept slots of one sequence from dense buffers. keys: [Hkv, S, D];
  /// queries: [Hq, Lq, D] (the layer's last Lq <= window queries, current one last;
  /// ignored by scorers that need none and then may be null). Writes num_keep[0] and
  /// keep[h*keep_stride + i] for i < num_keep[0]. kInvalidArgument for a bad shape, a small
  /// workspace or keep_stride, or non-finite scores (NaN/inf keys or queries).
  template <class T>
  Status select(exec::Host ex, const T* keys,  // [Hkv, S, D]
                const T* queries,              // [Hq, Lq, D]
                const Shape& shape,
                std::int32_t* keep,       // [Hkv, keep_stride]
                std::int32_t keep_stride,
                std::int32_t* num_keep,   // [1]
                Workspace ws) const {
    KVKIT_CHECK_STATUS(keys != nullptr || shape.seq_len == 0, StatusCode::kInvalidArgument,
                       "compressor: keys is null");
    const std::int64_t s = shape.seq_len, d = shape.head_dim;
    auto key_row = [keys, s, d](std::int32_t h, std::int32_t j) {
      return keys + (static_cast<std::int64_t>(h) * s + j) * d;
    };
    return run(ex, key_row, queries, shape, keep, keep_stride, num_keep, ws);
  }

  /// Same, reading sequence `seq`'s keys straight from a host PagedKVView (S = its
  /// seq_len, D = view.head_dim, Hkv = view.num_kv_heads). kOutOfRange for a bad sequence
  /// or page table.
  template <class T>
  Status select(exec::Host ex, const PagedKVView<T>& view, std::int32_t seq,
                const T* queries,  // [Hq, Lq, D]
                std::int32_t num_q_heads, std::int32_t num_queries,
                std::int32_t* keep,      // [Hkv, keep_stride]
                std::int32_t keep_stride,
                std::int32_t* num_keep,  // [1]
                Workspace ws) const {
    KVKIT_RETURN_IF_ERROR(kvkit::detail::check_host_view(view, /*check_table=*/false));
    KVKIT_CHECK_STATUS(seq >= 0 && seq < view.batch_size, StatusCode::kOutOfRange,
                       "compressor: sequence ", seq, " out of range [0, ", view.batch_size, ")");
    KVKIT_RETURN_IF_ERROR(kvkit::detail::check_sequence_pages(view, seq));
    const Shape shape{view.num_kv_heads, num_q_heads, view.head_dim, view.seq_len(seq),
                      num_queries};
    auto key_row = [&view, seq](std::int32_t h, std::int32_t j) {
      return static_cast<const T*>(view.k_ptr(seq, j, h));
    };
    return run(ex, key_row, queries, shape, keep, keep_stride, num_keep, ws);
  }

 private:
  static std::int32_t rows_used(const Params& p, const Shape& sh) {
    return std::max<std::int32_t>(1, std::min(p.window, sh.num_queries));
  }

  void size_slab(WorkspaceSizer& w, const Shape& sh) const {
    const std::size_t s = static_cast<std::size_t>(sh.seq_len), d = sh.head_dim;
    const std::size_t r = Scorer::kUsesAttention ? rows_used(params_, sh) : 0;
    const std::size_t g = sh.num_kv_heads > 0 && Scorer::kUsesAttention
                              ? static_cast<std::size_t>(std::max(1, sh.num_q_heads / sh.num_kv_heads))
                              : 0;
    detail::size_head_scratch(w, s, d, g * r, r);
  }

  template <class KeyRow, class T>
  Status run(exec::Host ex, KeyRow key_row, const T* queries, const Shape& sh,
             std::int32_t* keep, std::int32_t keep_stride, std::int32_t* num_keep,
             Workspace ws) const {
    const Params& p = params_;
    const std::int32_t hkv = sh.num_kv_heads, dim = sh.head_dim, s = sh.seq_len;
    KVKIT_CHECK_STATUS(hkv > 0 && dim > 0 && s >= 0, StatusCode::kInvalidArgument,
                       "compressor: bad shape (Hkv ", hkv, ", D ", dim, ", S ", s, ")");
    KVKIT_CHECK_STATUS(num_keep != nullptr && keep != nullptr, StatusCode::kInvalidArgument,
                       "compressor: keep or num_keep is null");
    const std::int32_t out_n = std::min(s, p.budget);
    KVKIT_CHECK_STATUS(keep_stride >= out_n, StatusCode::kInvalidArgument,
                       "compressor: keep_stride ", keep_stride, " < ", out_n, " kept slots");
    if (s < p.budget) {  // step 0: nothing happens
      for (std::int32_t h = 0; h < hkv; ++h)
        for (std::int32_t i = 0; i < s; ++i) keep[static_cast<std::int64_t>(h) * keep_stride + i] = i;
      *num_keep = s;
      return Status::ok();
    }
    std::int32_t groups = 1, rows = 1;
    if (Scorer::kUsesAttention) {
      KVKIT_CHECK_STATUS(sh.num_q_heads > 0 && sh.num_q_heads % hkv == 0,
                         StatusCode::kInvalidArgument, "compressor: num_q_heads ", sh.num_q_heads,
                         " is not a positive multiple of num_kv_heads ", hkv);
      KVKIT_CHECK_STATUS(sh.num_queries > 0 && queries != nullptr, StatusCode::kInvalidArgument,
                         "compressor: needs at least one query row, got ", sh.num_queries);
      groups = sh.num_q_heads / hkv;
      rows = rows_used(p, sh);
    }
    const std::size_t need = workspace_size(ex, sh);
    KVKIT_CHECK_STATUS(ws.bytes >= need && ws.data != nullptr, StatusCode::kInvalidArgument,
                       "compressor: workspace of ", ws.bytes, " bytes is smaller than the ", need,
                       " bytes needed");
    const int workers = kvkit::detail::host_workers(ex, hkv);
    WorkspaceCarver carver(ws);
    std::int32_t* bad = carver.take<std::int32_t>(static_cast<std::size_t>(hkv));
    // Slabs are carved per worker inside the parallel body (same order as size_slab).
    const std::size_t su = static_cast<std::size_t>(s), du = static_cast<std::size_t>(dim);
    const std::size_t gr = Scorer::kUsesAttention ? static_cast<std::size_t>(groups * rows) : 0;
    const std::size_t ru = Scorer::kUsesAttention ? static_cast<std::size_t>(rows) : 0;
    WorkspaceSizer one;
    detail::size_head_scratch(one, su, du, gr, ru);
    const std::size_t slab_bytes = one.bytes() - (one.bytes() ? kWorkspaceAlign : 0);
    unsigned char* base = carver.take<unsigned char>(slab_bytes * static_cast<std::size_t>(workers));
    if (bad == nullptr || base == nullptr)
      return make_status(StatusCode::kInvalidArgument, "compressor: workspace too small");
    const std::int32_t n_cand = s - p.window;
    const std::int32_t q_len = sh.num_queries;
    kvkit::detail::parallel_for(ex, hkv, [&](std::int64_t hb, std::int64_t he, int w) {
      WorkspaceCarver c(Workspace{base + slab_bytes * static_cast<std::size_t>(w), slab_bytes});
      detail::HeadScratch hs;
      detail::carve_head_scratch(c, su, du, gr, ru, hs);
      for (std::int64_t h64 = hb; h64 < he; ++h64) {
        const auto h = static_cast<std::int32_t>(h64);
        bad[h] = 0;
        if (Scorer::kUsesAttention || Scorer::kUsesRedundancy) {
          for (std::int32_t j = 0; j < s; ++j) {
            const T* src = key_row(h, j);
            float* kf = hs.keys + static_cast<std::int64_t>(j) * dim;
            for (std::int32_t e = 0; e < dim; ++e) kf[e] = to_float(src[e]);
            const double nrm = detail::dot_double(kf, kf, dim);
            const double inv = 1.0 / (std::sqrt(nrm) + 1e-8);
            float* nf = hs.normed + static_cast<std::int64_t>(j) * dim;
            for (std::int32_t e = 0; e < dim; ++e) nf[e] = static_cast<float>(kf[e] * inv);
          }
        }
        if (Scorer::kUsesAttention) {
          for (std::int32_t g = 0; g < groups; ++g)
            for (std::int32_t r = 0; r < rows; ++r) {
              const T* src = queries + ((static_cast<std::int64_t>(h) * groups + g) * q_len +
                                        (q_len - rows + r)) * dim;
              float* dst = hs.queries + (static_cast<std::int64_t>(g) * rows + r) * dim;
              for (std::int32_t e = 0; e < dim; ++e) dst[e] = to_float(src[e]);
            }
          detail::importance(hs.queries, hs.keys, groups, rows, n_cand, dim, p.kernel, hs.logits,
                             hs.attn, hs.imp);
        } else {
          for (std::int32_t j = 0; j < n_cand; ++j) hs.imp[j] = 0.0;
        }
        if (Scorer::kUsesRedundancy) {
          detail::redundancy(hs.normed, s, dim, p.similarity_threshold, hs.near, hs.low, hs.reach,
                             hs.early, hs.nsum, hs.red, &hs.filter);
        } else {
          for (std::int32_t j = 0; j < s; ++j) hs.red[j] = 0.0;
        }
        for (std::int32_t j = 0; j < n_cand; ++j) {
          hs.score[j] = scorer_.score(p, hs.imp[j], hs.red[j], j, s);
          if (!std::isfinite(hs.score[j])) bad[h] = 1;
        }
        if (bad[h]) continue;
        detail::select_slots(hs.score, s, p.window, p.budget, p.order, hs.order,
                             keep + static_cast<std::int64_t>(h) * keep_stride);
      }
    });
    for (std::int32_t h = 0; h < hkv; ++h)
      KVKIT_CHECK_STATUS(!bad[h], StatusCode::kInvalidArgument, "compressor: kv head ", h,
                         " has non-finite scores (NaN or inf in keys or queries)");
    *num_keep = p.budget;
    return Status::ok();
  }

  Params params_;
  Scorer scorer_;
};

/// The R1KV policy.
using R1KVCompressor = Compressor<R1KV>;

}  // namespace compressor
}  // namespace kvkit
