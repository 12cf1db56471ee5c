#pragma once
// The Sketcher's strict pre-pass (sketch/eps.hpp) on CUDA: page summaries built on the
// device and the certified ε selection, writing the page subsets the page-subset variant
// of paged_decode_attention reads. Reached through <kvkit/cuda.cuh>.
//
// Scope (EpsCudaConfig throws kvkit::Error naming anything else): method box, strict
// mode, group_pages 1; last_n, top_pages, eps, score_budget, score_fraction and the
// per-(layer, kv head) on/off list as on the CPU. No telemetry (counts are in indptr).
//
// Layout (sketch::twin::BoxSummaries, one per layer, caller-owned device memory):
// box min / max [num_pages, Hkv, d], max‖k‖ and ‖max(|min|, |max|)‖ [num_pages, Hkv] and
// count [num_pages], indexed by physical page id, so summaries survive page-table
// rewrites. A page's summary is valid in a view iff count equals the tokens the page
// holds there; the host calls update_summaries for every page it writes (the decode
// token's page), rewrites (compaction, copies) or frees (ntok 0), as the CPU store's
// version numbers do.
//
// Kernels, in stream order:
//   update_summaries: check (pages / ntok in range) then grid (n, Hkv), block 256: threads
//     over channels (min / max over the page's tokens in token order), over tokens
//     (round_up ‖k‖), thread 0 the amax norm of the final box.
//   select: check (page table, pages per sequence <= max_pages; blocks over sequences and
//     slices of their pages), then
//     bounds   grid (batch*Hkv, pages/128), block 256: an aligned group of 8 threads per
//              page, lane l computing the CPU's float lane l of the box bound for each
//              query head of the group (8 adjacent floats per step: coalesced), lane 0
//              combining the lanes in the CPU's order; the one pass over every summary,
//              so it gets the whole GPU
//     classify grid batch*Hkv: candidates / always-visited pages (a contiguous range of
//              pages per thread, one block scan per list)
//     prepass  grid batch*Hq, block 256, one block per (b, query head): exact
//              log-sum-exp of the always-visited tokens (threads compute logits, thread 0
//              folds them in token order); the candidates' bounds; ref = block max;
//              quantised masses and their exact total. The walk can need in order only
//              the top `known` = min(scoring cap, lim) ranks (twin::walk_reach): when that
//              is fewer than the candidates, a radix cut on twin::rank_key (bytes all keys
//              share skipped, a 256-bin histogram per byte, ties by position) finds them
//              and their mass; if no stop is possible within the cap (twin::stop_possible
//              at `known`) every page up to lim is picked with nothing sorted (random keys:
//              every page visited). Otherwise the top `known` are compacted, sorted by a
//              bitonic network of (bound, candidate) pairs (shared memory when it fits, up
//              to 227 KiB on an H100: 16K pages), tail sums by rank above tail[known];
//              then every thread runs twin::walk on the same data (uniform control flow)
//              and the masses it asks for are computed by lane groups (a group per page)
//              behind a barrier; a pick flag per candidate
//     union    grid (batch*Hkv, pages/256): visit = always visited or picked by any query
//              head of the group (the GQA union), counts added atomically
//     emit     grid batch*Hkv, block 256: offset = Σ counts before the block, indptr,
//              ascending page indices (a contiguous range per thread, one block scan).
//   Block scans and reductions are warp butterflies (__shfl_xor_sync) plus one exchange
//   through shared memory: two barriers each.
// Measured on an H100 (bench_cuda, llama8b shape, f16, bench/RESULTS.md): one sequence of
// 64K with random keys (every page visited) 110 us, 0.42x a dense decode step (the first
// version took 3.4 ms); with needles, where the walk stops after 1 % of the pages, 218 us
// (0.83x): the sorted path's walk, scoring and barriers, one block per query head.
// The per-item arithmetic is sketch/eps_twin.hpp's (shared with the host test), following
// the CPU's order with non-contracted IEEE operations, so summaries are equal bit for bit
// and the subsets equal the CPU's except where a stop test sits within ~1 ulp of CUDA's
// exp vs glibc's (see eps_twin.hpp). Nothing is allocated or synchronised on the run path
// (workspace via workspace_size), so a decode step can be captured in a CUDA graph
// (tests/cuda/test_eps_cuda's [graph] case; written after the last GPU session's device
// time ran out, it has not run on a GPU yet).
//
// Limits: the always-visited tokens' exps are folded serially by one thread (cheap for
// last_n pages, slow when many pages have no summary); every thread of a block runs the
// walk's serial mass sum (O(pages visited) per query head); one block per (b, query head)
// whatever the sequence length (the cut, sort and walk are most of the 64K figures above,
// the bounds kernel 49 us of them); the update list must hold distinct page ids. Checked by
// tests/cuda/test_eps_cuda on a GPU (H100: bits equal to the CPU Sketcher's, memcheck and
// racecheck clean), and without one by tests/test_eps_twin.cpp (the per-item functions and
// the host schedule against SketchSelector) and scripts/cuda_emulation/run_tests.sh
// test_eps_cuda (the GPU test itself, these kernels on host fibers).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvkit/kernels/cuda/common.cuh"
#include "kvkit/sketch/eps.hpp"
#include "kvkit/sketch/eps_twin.hpp"

namespace kvkit {
namespace cuda_detail {

inline constexpr int kEpsThreads = 256;

/// Floats a query row of d takes in the kernels' shared memory: d rounded up to whole
/// 16-byte words. nvcc reads the last d % 4 floats of loops over such a row (qnorm_of)
/// with one 128-bit load, which compute-sanitizer reported past the end of a [d]
/// allocation (d = 13, H100).
KVKIT_HOST_DEVICE std::int32_t eps_row_floats(std::int32_t d) { return (d + 3) / 4 * 4; }

inline constexpr int kEpsWarps = kEpsThreads / 32;

/// Op-combination of v over the block (op associative and commutative, exact: min, max,
/// integer sums), returned to every thread: butterflies in each warp, then the warps'
/// values through sh. Every thread calls it (two barriers).
template <class V, class Op>
KVKIT_DEVICE V eps_block_reduce(V v, V* sh /* [kEpsWarps] shared */, Op op) {
  const int t = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, k));
  if ((t & 31) == 0) sh[t >> 5] = v;
  __syncthreads();
  V r = sh[0];
#pragma unroll
  for (int w = 1; w < kEpsWarps; ++w) r = op(r, sh[w]);
  __syncthreads();  // sh is reused by the next call
  return r;
}

/// Exclusive prefix sum of v over the block; *total gets the sum (every thread calls it).
/// A butterfly scan in each warp (lane l adds the other half's total where bit k of l is
/// set), then the warp totals through sh: two barriers, where a Kogge-Stone scan over the
/// block took sixteen and made the pre-pass's list kernels barrier-bound.
KVKIT_DEVICE int eps_block_scan(int v, int* sh /* [kEpsWarps] shared */, int* total) {
  const int t = static_cast<int>(threadIdx.x), lane = t & 31, warp = t >> 5;
  int pre = v, sum = v;  // inclusive prefix in the lane's group, the group's total
#pragma unroll
  for (int k = 1; k < 32; k <<= 1) {
    const int o = __shfl_xor_sync(0xffffffffu, sum, k);
    if (lane & k) pre += o;
    sum += o;
  }
  if (lane == 0) sh[warp] = sum;
  __syncthreads();
  int off = 0, tot = 0;
#pragma unroll
  for (int w = 0; w < kEpsWarps; ++w) {
    const int x = sh[w];
    off += w < warp ? x : 0;
    tot += x;
  }
  *total = tot;
  __syncthreads();
  return off + pre - v;
}

/// This thread's contiguous share [*r0, *r1) of n items split over the block (the list
/// kernels and the tail sums: one scan over per-thread counts instead of one per 256).
KVKIT_DEVICE void eps_thread_range(std::int32_t n, std::int32_t* r0, std::int32_t* r1) {
  const std::int32_t per = (n + kEpsThreads - 1) / kEpsThreads, t = static_cast<std::int32_t>(threadIdx.x);
  *r0 = t * per < n ? t * per : n;
  *r1 = *r0 + per < n ? *r0 + per : n;
}

/// Lanes per page in the pre-pass's bound and mass loops: lane l of an aligned group of 8
/// threads computes the CPU's float lane l (twin::box_hi_lane / logit_lane), so the group
/// reads 8 adjacent floats per step (one 32-byte sector) where one thread per page read a
/// sector per float; lane 0 then combines the lanes in the CPU's order.
inline constexpr int kEpsLanes = 8;
inline constexpr int kEpsGroups = kEpsThreads / kEpsLanes;

/// The 8 values v of a lane group, gathered in lane 0 (other lanes get garbage).
KVKIT_DEVICE void eps_gather8(float v, float* out /* [8] */) {
  const unsigned mask = 0xFFu << (threadIdx.x & 24u);  // the group's lanes in its warp
  out[0] = v;
#pragma unroll
  for (int k = 1; k < kEpsLanes; ++k) out[k] = __shfl_xor_sync(mask, v, k);  // lane 0 gets lane k's
}

/// twin::box_hi of one (page, query head) by a lane group; the value is lane 0's.
KVKIT_DEVICE double eps_group_box_hi(const float* mn, const float* mx, std::int32_t d, const float* q, int lane) {
  namespace tw = sketch::twin;
  float h[kEpsLanes];
  eps_gather8(tw::box_hi_lane(mn, mx, d, q, lane), h);
  double hs = 0;
#pragma unroll
  for (int j = 0; j < kEpsLanes; ++j) hs = tw::dadd(hs, h[j]);
  return hs;
}

/// twin::page_mass of one page by a lane group; the value is lane 0's.
template <class T>
KVKIT_DEVICE double eps_group_page_mass(const float* q, const T* k0, std::int64_t stride, std::int32_t n,
                                        std::int32_t d, double scale, double ref, int lane) {
  namespace tw = sketch::twin;
  double m = 0;
  for (std::int32_t t = 0; t < n; ++t) {
    const tw::LogitLane l = tw::logit_lane(q, k0 + t * stride, d, lane);
    float a[kEpsLanes], g[kEpsLanes];
    eps_gather8(l.a, a);
    eps_gather8(l.m, g);
    m = tw::dadd(m, tw::exp_d(tw::dsub(tw::dmul(scale, tw::logit_lo_of(a, g, d)), ref)));
  }
  return m;
}

/// twin::bitonic_pair_step's network over n2 (a power of two) (key, candidate) pairs by
/// the block, a thread per pair: the sort was most of the pre-pass's instructions.
KVKIT_DEVICE void eps_block_sort(double* key /* [n2] */, std::int32_t* ord /* [n2] */, std::int32_t n2) {
  for (std::int32_t k = 2; k <= n2; k <<= 1)
    for (std::int32_t j = k >> 1; j > 0; j >>= 1) {
      for (std::int32_t p = static_cast<std::int32_t>(threadIdx.x); p < n2 / 2; p += kEpsThreads)
        sketch::twin::bitonic_pair_step(key, ord, k, j, p);
      __syncthreads();
    }
}

/// Σ of v over the block, exact (128-bit integers: any order), returned to every thread.
KVKIT_DEVICE sketch::detail::Mass128 eps_block_mass_sum(sketch::detail::Mass128 v,
                                                        unsigned long long* hi /* [kEpsWarps] shared */,
                                                        unsigned long long* lo /* [kEpsWarps] shared */) {
  using sketch::detail::Mass128;
  const int t = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) {
    Mass128 o;
    o.hi = __shfl_xor_sync(0xffffffffu, static_cast<unsigned long long>(v.hi), k);
    o.lo = __shfl_xor_sync(0xffffffffu, static_cast<unsigned long long>(v.lo), k);
    v.add(o);
  }
  if ((t & 31) == 0) {
    hi[t >> 5] = v.hi;
    lo[t >> 5] = v.lo;
  }
  __syncthreads();
  Mass128 r;
  for (int w = 0; w < kEpsWarps; ++w) {
    Mass128 x;
    x.hi = hi[w];
    x.lo = lo[w];
    r.add(x);
  }
  __syncthreads();
  return r;
}

/// The cut above exactly k of the n candidates in rank order (0 < k < n), by a radix
/// selection on twin::rank_key: bytes the keys all share are skipped (their minimum and
/// maximum), then a 256-bin histogram per byte keeps the bin holding the k-th key, until
/// the cut falls on a bin's end or a full key's ties, resolved by position. A few passes
/// over n keys instead of sorting n: the walk orders only the ranks it can reach.
KVKIT_DEVICE sketch::twin::RankCut eps_block_cut(const double* ub /* [n] */, std::int32_t n, std::int32_t k,
                                                 int* hist /* [kEpsThreads] shared */,
                                                 int* scan /* [kEpsWarps] shared */,
                                                 unsigned long long* red /* [kEpsWarps] shared */,
                                                 int* shv /* [3] shared */) {
  namespace tw = sketch::twin;
  static_assert(kEpsThreads == 256, "a thread per histogram bin");
  const int tid = static_cast<int>(threadIdx.x);
  unsigned long long kmin = ~0ull, kmax = 0;
  for (std::int32_t i = tid; i < n; i += kEpsThreads) {
    const unsigned long long key = tw::rank_key(ub[i]);
    kmin = key < kmin ? key : kmin;
    kmax = key > kmax ? key : kmax;
  }
  kmin = eps_block_reduce(kmin, red, [](unsigned long long x, unsigned long long y) { return y < x ? y : x; });
  kmax = eps_block_reduce(kmax, red, [](unsigned long long x, unsigned long long y) { return y > x ? y : x; });
  tw::RankCut c;
  int shift = 56;
  while (shift >= 0 && ((kmin ^ kmax) >> shift) == 0) shift -= 8;  // bytes every key shares
  c.mask = shift < 0 ? ~0ull : (shift >= 56 ? 0ull : ~0ull << (shift + 8));
  c.prefix = kmin & c.mask;
  std::int32_t need = k;  // keys still to take among those under prefix
  for (; shift >= 0; shift -= 8) {
    hist[tid] = 0;
    __syncthreads();
    // Counts are flushed when a thread's bin changes: keys crowd into few bins (most
    // bounds alike), and one shared atomic per key on one address serialises the block.
    int run_bin = -1, run = 0;
    for (std::int32_t i = tid; i < n; i += kEpsThreads) {
      const unsigned long long key = tw::rank_key(ub[i]);
      if ((key & c.mask) != c.prefix) continue;
      const int bin = static_cast<int>((key >> shift) & 255u);
      if (bin != run_bin) {
        if (run > 0) atomicAdd(&hist[run_bin], run);
        run_bin = bin;
        run = 0;
      }
      ++run;
    }
    if (run > 0) atomicAdd(&hist[run_bin], run);
    __syncthreads();
    const int cnt = hist[tid];
    int tot = 0;
    const int ex = eps_block_scan(cnt, scan, &tot);
    if (ex < need && need <= ex + cnt) {
      shv[0] = tid;
      shv[1] = ex;
      shv[2] = cnt;
    }
    __syncthreads();
    const int bin = shv[0], in_bin = shv[2];
    need -= shv[1];
    __syncthreads();
    c.prefix |= static_cast<unsigned long long>(bin) << shift;
    c.mask |= 255ull << shift;
    if (need == in_bin) return c;  // the cut is the bin's end: no position tie-break
  }
  // Equal full keys (equal bounds) across the cut: the first `need` of them by position.
  std::int32_t seen = 0;
  for (std::int32_t i0 = 0; i0 < n; i0 += kEpsThreads) {
    const std::int32_t i = i0 + tid;
    const int f = i < n && tw::rank_key(ub[i]) == c.prefix ? 1 : 0;
    int tot = 0;
    const int p = eps_block_scan(f, scan, &tot);
    if (f && seen + p + 1 == need) shv[0] = i;
    seen += tot;
  }
  __syncthreads();
  c.tie_pos = shv[0];
  __syncthreads();
  return c;
}

/// Scratch of the pre-pass: nb = batch x Hkv (sequence, kv head) rows and nq = nb x group
/// (sequence, query head) rows of M = max_pages entries.
struct EpsScratch {
  std::int32_t* cand = nullptr;     // [nb, M] candidate pages, ascending
  std::int32_t* alw = nullptr;      // [nb, M] always-visited pages, ascending
  std::int32_t* ord = nullptr;      // [nq, pow2 >= M] candidate at each rank (sort buffer)
  double* ub = nullptr;             // [nq, pow2 >= M] bounds of the candidates (sort keys)
  double* ub_page = nullptr;        // [nq, M] log-mass bound of each page
  sketch::detail::Mass128* w = nullptr;     // [nq, M] quantised masses
  sketch::detail::Mass128* tail = nullptr;  // [nq, M + 1] tail sums by rank
  double* mass = nullptr;           // [nq, M] exact relative masses by rank
  std::uint8_t* pick = nullptr;     // [nq, M] 1: candidate page picked by the query head
  std::uint8_t* visit = nullptr;    // [nb, M] 1: page read
  std::int32_t* count = nullptr;    // [nb] pages read
  std::int32_t* np = nullptr;       // [nb] pages of the sequence
  std::int32_t* nc = nullptr;       // [nb] candidates
  std::int32_t* na = nullptr;       // [nb] pages always visited
};

/// Page ids and token counts of an update list within range, and no page id twice (two
/// blocks would write one summary row); the repeat scan is O(n^2 / threads), n being the
/// pages one step writes or rewrites.
template <class Unused = void>
__global__ void eps_check_update_kernel(const std::int32_t* pages,  // [n]
                                               const std::int32_t* ntok,   // [n]
                                               std::int32_t n, std::int32_t num_pages,
                                               std::int32_t page_size, DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t p = pages[i], c = ntok[i];
    if (p < 0 || p >= num_pages)
      report(st, StatusCode::kOutOfRange, DeviceCheck::kPageId, p, i, -1, num_pages);
    else if (c < 0 || c > page_size)  // 0 is allowed: invalidate
      report(st, StatusCode::kOutOfRange, DeviceCheck::kSummaryTokens, c, i, -1, page_size);
    for (std::int64_t j = 0; j < i; ++j)
      if (pages[j] == p) {
        report(st, StatusCode::kInvalidArgument, DeviceCheck::kSummaryRepeated, p, i, -1, j);
        break;
      }
  }
}

/// Summaries of page pages[blockIdx.x] (ntok[blockIdx.x] tokens), kv head blockIdx.y.
template <class T>
__global__ void __launch_bounds__(kEpsThreads)
    eps_update_kernel(PagedKVView<T> view, sketch::twin::BoxSummaries s,
                      const std::int32_t* pages,  // [n]
                      const std::int32_t* ntok,   // [n]
                      const DeviceStatus* st) {
  __shared__ float norms[kEpsThreads];
  if (block_failed(st)) return;
  namespace tw = sketch::twin;
  const std::int32_t pid = pages[blockIdx.x], n = ntok[blockIdx.x], h = blockIdx.y, d = s.head_dim;
  const std::int64_t r = s.row(pid, h);
  const T* k0 = view.k_data + view.k_offset(pid, 0, h);
  for (std::int32_t c = threadIdx.x; c < d; c += blockDim.x)
    tw::box_channel(k0, view.k_stride_token, n, c, s.box_min + r * d + c, s.box_max + r * d + c);
  float m = 0.f;
  for (std::int32_t t = threadIdx.x; t < n; t += blockDim.x) {
    const float x = tw::key_norm_up(k0 + t * view.k_stride_token, d);
    m = m < x ? x : m;
  }
  norms[threadIdx.x] = m;
  __syncthreads();  // also publishes the box to thread 0
  if (threadIdx.x != 0) return;
  float mm = 0.f;  // max of non-negative floats: any order gives the same bits
  for (int i = 0; i < kEpsThreads; ++i) mm = mm < norms[i] ? norms[i] : mm;
  s.max_norm[r] = mm;
  s.amax_norm[r] = tw::amax_norm_up(s.box_min + r * d, s.box_max + r * d, d);
  if (h == 0) s.count[pid] = n;
}

/// Empty summaries (box ±inf, norms 0, count 0) for every page and head.
template <class Unused = void>
__global__ void eps_reset_kernel(sketch::twin::BoxSummaries s, const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int64_t rows = static_cast<std::int64_t>(s.num_pages) * s.num_kv_heads;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * s.head_dim;
       i += stride) {
    s.box_min[i] = HUGE_VALF;
    s.box_max[i] = -HUGE_VALF;
    if (i < rows) {
      s.max_norm[i] = 0.f;
      s.amax_norm[i] = 0.f;
    }
    if (i < s.num_pages) s.count[i] = 0;
  }
}

/// The page table of every sequence, and pages per sequence <= max_pages; blocks
/// (sequences, slices of a sequence's pages).
template <class T>
__global__ void eps_check_prepass_kernel(PagedKVView<T> view, std::int32_t max_pages, DeviceStatus* st) {
  if (failed(st)) return;
  const bool lead = blockIdx.y == 0 && threadIdx.x == 0;
  for (std::int64_t b = blockIdx.x; b < view.batch_size; b += gridDim.x) {
    const std::int32_t n = check_sequence_pages_dev(view, static_cast<std::int32_t>(b), st, lead,
                                                    static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x,
                                                    static_cast<std::int64_t>(gridDim.y) * blockDim.x);
    if (lead && n > max_pages)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kRowTooShort, n, -1, b, max_pages);
  }
}

/// Whether `kernel` can take `bytes` of dynamic shared memory on the current device
/// (raising its limit past the default 48 KiB where the device allows); host calls only,
/// nothing on a stream, so select() stays capturable.
template <class Kernel>
Status eps_smem_fits(Kernel* kernel, std::size_t bytes, bool* fits) {
  *fits = false;
  int dev = 0, optin = 0;
  cudaFuncAttributes attr{};
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return cuda_status(e, "eps cuda select");
  if (attr.sharedSizeBytes + bytes > static_cast<std::size_t>(optin)) return Status::ok();
  if (static_cast<int>(bytes) > attr.maxDynamicSharedSizeBytes) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess) return cuda_status(e, "eps cuda select");
  }
  *fits = true;
  return Status::ok();
}

/// Pages per block of eps_bounds_kernel.
inline constexpr int kEpsBoundPages = 128;

/// The log-mass bound of every candidate page j of (sequence b, kv head h) for each query
/// head gq of h's group: ub_page[(bh * group + gq) * max_pages + j] (pages always visited
/// are skipped). A block per (b, kv head) and kEpsBoundPages pages, a lane group per page;
/// the query heads share the page's box reads (L1). This is the pre-pass's one pass over
/// all summaries, so it gets the whole GPU; the per-(b, query head) walk then reads the
/// bounds of its candidates from here.
template <class T>
__global__ void __launch_bounds__(kEpsThreads)
    eps_bounds_kernel(PagedKVView<T> view, const T* q,  // [batch, Hq, d]
                      std::int32_t hq, sketch::twin::BoxSummaries s, sketch::twin::PrepassArgs a,
                      std::int32_t max_pages,
                      double* ub_page,  // [batch * Hkv, Hq / Hkv, max_pages]
                      const DeviceStatus* st) {
  namespace tw = sketch::twin;
  // Dynamic shared memory: the group's queries [group, d rounded up to 4] floats, then
  // their norms [group] doubles.
  extern __shared__ __align__(16) unsigned char eps_dyn[];
  if (block_failed(st)) return;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t hkv = view.num_kv_heads, bh = blockIdx.x, b = bh / hkv, h = bh % hkv;
  const std::int32_t d = view.head_dim, P = view.page_size, grp = hq / hkv, qw = eps_row_floats(d);
  const std::int32_t np = view.num_pages(b), len = view.seq_len(b);
  const std::int32_t j0 = static_cast<std::int32_t>(blockIdx.y) * kEpsBoundPages;
  const bool on = tw::head_is_on(a.head_mask, h);
  if (!on || j0 >= np) return;  // block-uniform
  float* qs = reinterpret_cast<float*>(eps_dyn);
  double* qn = reinterpret_cast<double*>(eps_dyn + sizeof(float) * static_cast<std::size_t>(grp) * qw);
  const T* qb = q + (static_cast<std::int64_t>(b) * hq + static_cast<std::int64_t>(h) * grp) * d;
  for (std::int32_t i = tid; i < grp * d; i += kEpsThreads) qs[(i / d) * qw + i % d] = to_float(qb[i]);
  __syncthreads();
  for (std::int32_t gq = tid; gq < grp; gq += kEpsThreads) qn[gq] = tw::qnorm_of(qs + gq * qw, d);
  __syncthreads();
  const int lane = tid % kEpsLanes;
  const std::int32_t j1 = j0 + kEpsBoundPages < np ? j0 + kEpsBoundPages : np;
  for (std::int32_t j = j0 + tid / kEpsLanes; j < j1; j += kEpsGroups) {  // uniform in a lane group
    const std::int32_t pid = view.page_id(b, j), ntok = tw::page_tokens(len, P, j);
    if (tw::always_visited(s, on, j, np, a.last_n, pid, ntok)) continue;
    const std::int64_t r = s.row(pid, h);
    for (std::int32_t gq = 0; gq < grp; ++gq) {
      const double hs = eps_group_box_hi(s.box_min + r * d, s.box_max + r * d, d, qs + gq * qw, lane);
      if (lane == 0) {
        const double u = tw::box_norm_bound_of(hs, d, qn[gq], s.amax_norm[r], s.max_norm[r]);
        ub_page[(static_cast<std::size_t>(bh) * grp + gq) * max_pages + j] =
            tw::log_mass_bound(ntok, P, a.log_full, a.scale, u);
      }
    }
  }
}

/// One block per (sequence b, kv head h): b's pages split into candidates and pages always
/// visited (both ascending), the latter flagged in visit.
template <class T>
__global__ void __launch_bounds__(kEpsThreads)
    eps_classify_kernel(PagedKVView<T> view, sketch::twin::BoxSummaries s, sketch::twin::PrepassArgs a,
                        std::int32_t max_pages, EpsScratch ws, const DeviceStatus* st) {
  namespace tw = sketch::twin;
  __shared__ int scan[kEpsThreads];
  if (block_failed(st)) return;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t hkv = view.num_kv_heads, bh = blockIdx.x, b = bh / hkv, h = bh % hkv;
  const std::int32_t P = view.page_size, np = view.num_pages(b), len = view.seq_len(b);
  const std::size_t base = static_cast<std::size_t>(bh) * max_pages;
  const bool on = tw::head_is_on(a.head_mask, h);
  // A contiguous range of pages per thread: one scan per list, where a scan per 256 pages
  // made the kernel barrier-bound (33 us for 4096 pages on an H100).
  std::int32_t j0, j1;
  eps_thread_range(np, &j0, &j1);
  int my_a = 0;
  for (std::int32_t j = j0; j < j1; ++j) {
    const int is_a = tw::always_visited(s, on, j, np, a.last_n, view.page_id(b, j), tw::page_tokens(len, P, j)) ? 1 : 0;
    ws.visit[base + j] = static_cast<std::uint8_t>(is_a);
    my_a += is_a;
  }
  int nc = 0, na = 0;
  std::int32_t pc = eps_block_scan(j1 - j0 - my_a, scan, &nc);
  std::int32_t pa = eps_block_scan(my_a, scan, &na);
  for (std::int32_t j = j0; j < j1; ++j) {  // this thread's own flags: no barrier needed
    if (ws.visit[base + j])
      ws.alw[base + pa++] = j;
    else
      ws.cand[base + pc++] = j;
  }
  if (tid == 0) {
    ws.np[bh] = np;
    ws.nc[bh] = nc;
    ws.na[bh] = na;
    ws.count[bh] = 0;  // eps_union_kernel's blocks add to it
  }
}

/// One block per (sequence b, query head qh of kv head h): the ε walk of qh over the
/// candidates of (b, h), writing pick[j] for every candidate page j (1: read) and the
/// omitted-mass bound of qh. A block per query head rather than per kv head: at one
/// sequence and 8 kv heads the pre-pass ran on 8 SMs of 132 (H100).
template <class T>
__global__ void __launch_bounds__(kEpsThreads)
    eps_prepass_kernel(PagedKVView<T> view, const T* q,  // [batch, Hq, d]
                       std::int32_t hq, sketch::twin::PrepassArgs a, std::int32_t max_pages, EpsScratch ws,
                       bool smem_sort,
                       double* omitted,  // [batch, Hq]
                       const DeviceStatus* st) {
  namespace tw = sketch::twin;
  using sketch::detail::Mass128;
  // Dynamic shared memory: qf [d rounded up to a multiple of 4], then with smem_sort the
  // sort's keys [pow2 >= max_pages] doubles and rank order [pow2 >= max_pages] ints.
  extern __shared__ __align__(16) unsigned char eps_dyn[];
  float* qf = reinterpret_cast<float*>(eps_dyn);
  __shared__ int scan[kEpsThreads];
  __shared__ double red[kEpsThreads];
  __shared__ unsigned long long red_hi[kEpsThreads], red_lo[kEpsThreads];
  __shared__ double sh_mx, sh_s;
  __shared__ int hist[kEpsThreads], shv[3];
  if (block_failed(st)) return;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t hkv = view.num_kv_heads, grp = hq / hkv;
  const std::int32_t bq = blockIdx.x, bh = bq / grp, gq = bq % grp, b = bh / hkv, h = bh % hkv;
  const std::int32_t qh = h * grp + gq;
  const std::int32_t d = view.head_dim, P = view.page_size, len = view.seq_len(b);
  if (!tw::head_is_on(a.head_mask, h)) {  // every page always visited
    if (tid == 0) omitted[static_cast<std::int64_t>(b) * hq + qh] = 0;
    return;
  }
  const std::size_t base = static_cast<std::size_t>(bh) * max_pages, qbase = static_cast<std::size_t>(bq) * max_pages;
  const std::int32_t* cand = ws.cand + base;
  const std::int32_t* alw = ws.alw + base;
  const std::int32_t nc = ws.nc[bh], na = ws.na[bh];
  const std::int32_t m2 = tw::pow2_at_least(max_pages);
  const std::size_t qbytes = sizeof(float) * static_cast<std::size_t>(eps_row_floats(d));
  // The bitonic sort's 78 barrier steps (4096 pages) touch every key and rank: in shared
  // memory when they fit (EpsCudaConfig::select decides), else in the workspace.
  std::int32_t* ord = smem_sort ? reinterpret_cast<std::int32_t*>(eps_dyn + qbytes + sizeof(double) * m2)
                                : ws.ord + static_cast<std::size_t>(bq) * m2;
  double* ub = smem_sort ? reinterpret_cast<double*>(eps_dyn + qbytes) : ws.ub + static_cast<std::size_t>(bq) * m2;
  Mass128* w = ws.w + qbase;
  Mass128* tail = ws.tail + static_cast<std::size_t>(bq) * (max_pages + 1);
  double* mass = ws.mass + qbase;
  std::uint8_t* pick = ws.pick + qbase;

  const T* qp = q + (static_cast<std::int64_t>(b) * hq + qh) * d;
  for (std::int32_t c = tid; c < d; c += kEpsThreads) qf[c] = to_float(qp[c]);
  __syncthreads();
  // Exact log-sum-exp of the always-visited tokens, folded in token order by thread 0.
  double mx = -HUGE_VAL, S = 0;
  const std::int64_t flat = static_cast<std::int64_t>(na) * P;
  for (std::int64_t f0 = 0; f0 < flat; f0 += kEpsThreads) {
    const std::int64_t f = f0 + tid;
    int ok = 0;
    if (f < flat) {
      const std::int32_t t = alw[f / P] * P + static_cast<std::int32_t>(f % P);
      if (t < len) {
        red[tid] = tw::dmul(a.scale, tw::logit_lo(qf, view.k_ptr(b, t, h), d));
        ok = 1;
      }
    }
    scan[tid] = ok;
    __syncthreads();
    if (tid == 0)
      for (int i = 0; i < kEpsThreads && f0 + i < flat; ++i)
        if (scan[i]) tw::online_step(red[i], &mx, &S);
    __syncthreads();
  }
  if (tid == 0) {
    sh_mx = mx;
    sh_s = S;
  }
  __syncthreads();
  mx = sh_mx;
  S = sh_s;
  // Bounds of every candidate (eps_bounds_kernel's); ref = max(mx, every bound).
  double lm = -HUGE_VAL;
  const double* ubq = ws.ub_page + qbase;
  for (std::int32_t i = tid; i < nc; i += kEpsThreads) {
    ub[i] = ubq[cand[i]];
    lm = lm < ub[i] ? ub[i] : lm;
  }
  lm = eps_block_reduce(lm, red, [](double x, double y) { return x < y ? y : x; });
  const double ref = mx < lm ? lm : mx;
  if (!(S > 0) || !isfinite(mx)) {  // nothing always visited: visit everything
    for (std::int32_t i = tid; i < nc; i += kEpsThreads) pick[cand[i]] = 1;
    if (tid == 0) omitted[static_cast<std::int64_t>(b) * hq + qh] = 0;
    return;
  }
  // Quantised masses and their total (exact integers: any order).
  const std::int32_t lim = tw::walk_limit(nc, a.top_pages);
  const std::int32_t budget = sketch::detail::score_limit(a.score_budget, a.score_fraction, nc);
  const std::int32_t known = tw::walk_reach(lim, budget);  // the ranks the walk can need in order
  Mass128 loc;
  for (std::int32_t i = tid; i < nc; i += kEpsThreads) {
    w[i] = sketch::detail::quantise_mass(tw::dsub(ub[i], ref));
    loc.add(w[i]);
  }
  const Mass128 total = eps_block_mass_sum(loc, red_hi, red_lo);
  const double s0 = tw::dmul(S, tw::exp_d(tw::dsub(mx, ref)));
  // The top `known` candidates (ord[i] = i, else -1) and tail[known]; a radix cut, not a
  // sort, when the scoring cap leaves ranks the walk never orders.
  // tail[k] for the top k < nc by a cut; mark(i, in) records each candidate's side.
  auto tail_below_top = [&](std::int32_t k, auto&& mark) {
    const tw::RankCut cut = eps_block_cut(ub, nc, k, hist, scan, red_hi, shv);
    Mass128 in_sum;
    for (std::int32_t i = tid; i < nc; i += kEpsThreads) {
      const bool in = cut.has(tw::rank_key(ub[i]), i);
      mark(i, in);
      if (in) in_sum.add(w[i]);
    }
    Mass128 t = total;
    t.sub(eps_block_mass_sum(in_sum, red_hi, red_lo));
    return t;
  };
  Mass128 tail_k, tail_l;  // tail sums at ranks known and lim (0 at nc)
  if (known < nc)
    tail_k = tail_below_top(known, [&](std::int32_t i, bool in) { ord[i] = in ? i : -1; });
  else
    for (std::int32_t i = tid; i < nc; i += kEpsThreads) ord[i] = i;
  if (lim == known)
    tail_l = tail_k;
  else if (lim < nc)  // known < lim < nc: a give-up visits the top lim as a set
    tail_l = tail_below_top(lim, [&](std::int32_t i, bool in) { pick[cand[i]] = in ? 1 : 0; });
  // Capped below lim and no stop possible within the cap: walk's phase-1 give-up, decided
  // before anything is sorted (the case of every page visited).
  if (known < lim && !tw::stop_possible(known, lim, tail_k, total, s0, a.eps, tw::stop_factor(nc))) {
    if (lim == nc)
      for (std::int32_t i = tid; i < nc; i += kEpsThreads) pick[cand[i]] = 1;
    if (tid == 0) omitted[static_cast<std::int64_t>(b) * hq + qh] = tw::omitted_of(tail_l, s0);
    return;
  }
  // The top `known` moved to the front in position order (a chunk is read before the scan's
  // barriers, written after; writes land below the next chunk), padded to a power of two
  // with -1 (sorts last), then sorted by a bitonic network.
  std::int32_t out = 0;
  for (std::int32_t i0 = 0; i0 < nc; i0 += kEpsThreads) {
    const std::int32_t i = i0 + tid;
    const std::int32_t o = i < nc ? ord[i] : -1;
    const double key = i < nc ? ub[i] : 0.0;
    int tot = 0;
    const int p = eps_block_scan(o >= 0 ? 1 : 0, scan, &tot);
    if (o >= 0) {
      ub[out + p] = key;
      ord[out + p] = o;
    }
    out += tot;
  }
  const std::int32_t n2 = tw::pow2_at_least(known);
  for (std::int32_t r = known + tid; r < n2; r += kEpsThreads) {
    ub[r] = -HUGE_VAL;  // padding: never compared (ord -1 sorts last)
    ord[r] = -1;
  }
  __syncthreads();
  eps_block_sort(ub, ord, n2);  // ub is permuted with ord: no longer by candidate
  // Tail sums of ranks [0, known]: each thread sums its range of ranks, thread 0 turns the
  // range sums into suffixes above tail[known], then each thread fills its range.
  std::int32_t r0, r1;
  eps_thread_range(known, &r0, &r1);
  loc = Mass128{};
  for (std::int32_t r = r0; r < r1; ++r) loc.add(w[ord[r]]);
  red_hi[tid] = loc.hi;
  red_lo[tid] = loc.lo;
  __syncthreads();
  if (tid == 0) {
    Mass128 acc = tail_k;
    for (int t = kEpsThreads - 1; t >= 0; --t) {
      Mass128 x;
      x.hi = red_hi[t];
      x.lo = red_lo[t];
      red_hi[t] = acc.hi;
      red_lo[t] = acc.lo;
      acc.add(x);
    }
    tail[known] = tail_k;
  }
  __syncthreads();
  Mass128 tt;
  tt.hi = red_hi[tid];
  tt.lo = red_lo[tid];
  for (std::int32_t r = r1 - 1; r >= r0; --r) {
    tt.add(w[ord[r]]);
    tail[r] = tt;
  }
  __syncthreads();
  const int lane = tid % kEpsLanes;
  const tw::WalkOut res = tw::walk(tail, nc, lim, s0, a.eps, budget, mass, kEpsGroups, known, tail_l,
                                     [&](std::int32_t from, std::int32_t to) {
    for (std::int32_t r = from + tid / kEpsLanes; r < to; r += kEpsGroups) {
      const std::int32_t j = cand[ord[r]];
      const double m = eps_group_page_mass(qf, view.k_ptr(b, j * P, h), view.k_stride_token, tw::page_tokens(len, P, j), d,
                                           a.scale, ref, lane);
      if (lane == 0) mass[r] = m;
    }
    __syncthreads();
  });
  // Picks: ranks [0, visited), all sorted; or, for a give-up past the sorted ranks, the top
  // lim as a set (every candidate, or the lim cut's flags already in pick).
  if (res.visited > known) {
    if (lim == nc)
      for (std::int32_t i = tid; i < nc; i += kEpsThreads) pick[cand[i]] = 1;
  } else {
    for (std::int32_t i = tid; i < nc; i += kEpsThreads) pick[cand[i]] = 0;
    __syncthreads();
    for (std::int32_t r = tid; r < res.visited; r += kEpsThreads) pick[cand[ord[r]]] = 1;
  }
  if (tid == 0) omitted[static_cast<std::int64_t>(b) * hq + qh] = res.omitted;
}

/// Block (b·Hkv + h, c): pages [256c, 256c + 256) of (sequence b, kv head h), a thread per
/// page: read when always visited or picked by any of h's query heads (GQA's union); the
/// block's count is added to count[b·Hkv + h]. Spread over pages: a block per (b, h)
/// walking 4096 pages was bound by the latency of its dependent pick loads.
template <class Unused = void>
__global__ void __launch_bounds__(kEpsThreads)
    eps_union_kernel(std::int32_t grp, std::int32_t max_pages, EpsScratch ws, const DeviceStatus* st) {
  __shared__ int scan[kEpsThreads];
  if (block_failed(st)) return;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t bh = blockIdx.x, np = ws.np[bh];
  const std::int32_t j = static_cast<std::int32_t>(blockIdx.y) * kEpsThreads + tid;
  if (static_cast<std::int32_t>(blockIdx.y) * kEpsThreads >= np) return;  // block-uniform
  const std::size_t base = static_cast<std::size_t>(bh) * max_pages;
  int v = 0;
  if (j < np) {
    v = ws.visit[base + j];
    for (std::int32_t gq = 0; !v && gq < grp; ++gq)  // a candidate: every query head wrote its pick
      v = ws.pick[(static_cast<std::size_t>(bh) * grp + gq) * max_pages + j];
    ws.visit[base + j] = static_cast<std::uint8_t>(v);
  }
  int tot = 0;
  (void)eps_block_scan(v, scan, &tot);
  if (tid == 0 && tot > 0) atomicAdd(&ws.count[bh], tot);
}

/// indptr / subset of block (b, kv head) from the visit flags.
template <class Unused = void>
__global__ void __launch_bounds__(kEpsThreads)
    eps_emit_kernel(std::int32_t max_pages, EpsScratch ws,
                    std::int32_t* indptr,  // [nb + 1]
                    std::int32_t* subset,  // [indptr[nb]]
                    const DeviceStatus* st) {
  __shared__ int scan[kEpsThreads];
  if (block_failed(st)) return;
  const int tid = static_cast<int>(threadIdx.x);
  const std::int32_t bh = blockIdx.x;
  int part = 0;
  for (std::int32_t i = tid; i < bh; i += kEpsThreads) part += ws.count[i];
  int off = 0;
  (void)eps_block_scan(part, scan, &off);
  if (tid == 0) {
    indptr[bh + 1] = off + ws.count[bh];
    if (bh == 0) indptr[0] = 0;
  }
  const std::uint8_t* visit = ws.visit + static_cast<std::size_t>(bh) * max_pages;
  const std::int32_t np = ws.np[bh];
  // A contiguous range of pages per thread: one scan (a scan per 256 pages was
  // barrier-bound).
  std::int32_t j0, j1;
  eps_thread_range(np, &j0, &j1);
  int mine = 0;
  for (std::int32_t j = j0; j < j1; ++j) mine += visit[j];
  int tot = 0;
  std::int32_t o = off + eps_block_scan(mine, scan, &tot);
  for (std::int32_t j = j0; j < j1; ++j)
    if (visit[j]) subset[o++] = j;
}

}  // namespace cuda_detail

namespace sketch {

/// Sizes the CUDA pre-pass's workspace and output arrays are built for.
struct EpsCudaShape {
  std::int32_t max_batch = 0;     // sequences per call
  std::int32_t num_kv_heads = 0;  // Hkv
  std::int32_t max_pages = 0;     // pages per sequence; subset holds max_batch*Hkv*max_pages entries
  std::int32_t num_qo_heads = 0;  // Hq at most (a multiple of Hkv): the bounds' scratch
};

/// The strict box pre-pass of SketchParams p on CUDA (see the file comment). The
/// constructor throws kvkit::Error naming any setting the CUDA twin does not support;
/// the operations return a Status and never allocate or synchronise.
class EpsCudaConfig {
 public:
  explicit EpsCudaConfig(const SketchParams& p) : p_(p) {
    p_.validate();
    KVKIT_CHECK(p_.group_pages == 1, "eps cuda: unsupported group_pages ", p_.group_pages,
                " (CUDA summaries are per page: group_pages 1)");
    KVKIT_CHECK(p_.strict, "eps cuda: unsupported mode: default (estimate) mode; only strict is on CUDA");
    KVKIT_CHECK(p_.method == SketchMethod::kBox, "eps cuda: unsupported method ", to_string(p_.method),
                " in strict mode (only box is on CUDA)");
  }
  const SketchParams& params() const { return p_; }

  /// Whether select() sorts a (sequence, query head)'s candidates in shared memory when
  /// they fit (default: yes). Off keeps the sort in the workspace, as large page counts
  /// do; for tests and comparisons, the results are the same.
  void set_smem_sort(bool on) { smem_sort_ = on; }

  /// Bytes of scratch select() needs for `shape`.
  std::size_t workspace_size(const EpsCudaShape& shape) const {
    WorkspaceSizer z;
    cuda_detail::EpsScratch sc;
    scratch_layout(shape, sc, [&](auto*& p, std::size_t n) { z.add<std::remove_reference_t<decltype(*p)>>(n); });
    return z.bytes();
  }

  /// Empties every summary of s (all pages invalid) on ex.stream.
  Status reset_summaries(exec::Cuda ex, const twin::BoxSummaries& s) const {
    constexpr const char* kOp = "eps cuda reset_summaries";
    KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));
    KVKIT_RETURN_IF_ERROR(check_summaries(s, kOp));
    const std::int64_t total = static_cast<std::int64_t>(s.num_pages) * s.num_kv_heads * s.head_dim;
    cuda_detail::eps_reset_kernel<><<<cuda_detail::grid_for(total), cuda_detail::kCopyThreads, 0,
                                    cuda_detail::stream_of(ex)>>>(s, ex.status);
    return cuda_detail::launch_status(kOp);
  }

  /// Re-summarises pages[i] (physical ids, distinct) of `view`'s K pool, holding ntok[i]
  /// tokens (0: invalidate the page), every kv head. Call it for every page written,
  /// rewritten or freed since the last select. Device checks: ids in
  /// [0, min(view.num_pages_total, s.num_pages)) (kPageId), ntok in [0, page_size]
  /// (kSummaryTokens), no id twice (kSummaryRepeated); on error nothing is written.
  template <class T>
  Status update_summaries(exec::Cuda ex, const PagedKVView<T>& view, const twin::BoxSummaries& s,
                          const std::int32_t* pages,  // [n] device
                          const std::int32_t* ntok,   // [n] device
                          std::int32_t n) const {
    constexpr const char* kOp = "eps cuda update_summaries";
    KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));
    KVKIT_RETURN_IF_ERROR(check_summaries(s, kOp));
    KVKIT_CHECK_STATUS(view.space == MemorySpace::kCuda && view.k_data != nullptr, StatusCode::kInvalidArgument, kOp,
                       ": the view must be a CUDA view with K data");
    KVKIT_CHECK_STATUS(view.num_kv_heads == s.num_kv_heads && view.head_dim == s.head_dim,
                       StatusCode::kInvalidArgument, kOp, ": view has ", view.num_kv_heads, " kv heads of ",
                       view.head_dim, ", summaries ", s.num_kv_heads, " of ", s.head_dim);
    KVKIT_CHECK_STATUS(n >= 0 && s.num_kv_heads <= 65535, StatusCode::kInvalidArgument, kOp, ": bad count ", n,
                       " or kv heads ", s.num_kv_heads);
    if (n == 0) return Status::ok();
    KVKIT_CHECK_STATUS(pages != nullptr && ntok != nullptr, StatusCode::kInvalidArgument, kOp, ": pages or ntok is null");
    cudaStream_t stream = cuda_detail::stream_of(ex);
    const std::int32_t bound = view.num_pages_total < s.num_pages ? view.num_pages_total : s.num_pages;
    cuda_detail::eps_check_update_kernel<><<<cuda_detail::grid_for(n), cuda_detail::kCopyThreads, 0, stream>>>(
        pages, ntok, n, bound, view.page_size, ex.status);
    KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
    cuda_detail::eps_update_kernel<T><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(s.num_kv_heads)),
                                        cuda_detail::kEpsThreads, 0, stream>>>(view, s, pages, ntok, ex.status);
    return cuda_detail::launch_status(kOp);
  }

  /// The pre-pass of layer `layer` for queries q [batch, Hq, d] scaled by sm_scale:
  /// indptr [batch*Hkv + 1] and subset (ascending logical page indices per (b, kv head),
  /// SketchSelector::indptr() / subset()'s format, read by paged_decode_attention's page
  /// subset), omitted [batch, Hq] (the certified omitted-mass bounds,
  /// SketchSelector::omitted_bound). s must be up to date for the view (update_summaries).
  /// Host checks (kInvalidArgument): shapes against `shape` and s, null pointers, a small
  /// workspace. Device checks: the page table, pages per sequence <= shape.max_pages.
  template <class T>
  Status select(exec::Cuda ex, std::int32_t layer, const PagedKVView<T>& view,
                const T* q,  // [batch, Hq, d] device
                std::int32_t num_qo_heads, float sm_scale, const twin::BoxSummaries& s, const EpsCudaShape& shape,
                std::int32_t* indptr,  // [batch*Hkv + 1] device
                std::int32_t* subset,  // [batch*Hkv*max_pages] device
                double* omitted,       // [batch, Hq] device
                Workspace ws) const {
    constexpr const char* kOp = "eps cuda select";
    namespace cd = cuda_detail;
    KVKIT_RETURN_IF_ERROR(cd::check_status_ptr(ex, kOp));
    KVKIT_RETURN_IF_ERROR(check_summaries(s, kOp));
    const std::int32_t hkv = view.num_kv_heads;
    KVKIT_CHECK_STATUS(view.space == MemorySpace::kCuda && view.k_data != nullptr, StatusCode::kInvalidArgument, kOp,
                       ": the view must be a CUDA view with K data");
    KVKIT_CHECK_STATUS(hkv == s.num_kv_heads && hkv == shape.num_kv_heads && view.head_dim == s.head_dim &&
                           view.batch_size >= 0 && view.batch_size <= shape.max_batch && shape.max_pages > 0 &&
                           shape.max_pages <= (1 << 30),
                       StatusCode::kInvalidArgument, kOp, ": view (batch ", view.batch_size, ", kv heads ", hkv,
                       ", head_dim ", view.head_dim, ") does not fit the shape (batch ", shape.max_batch,
                       ", kv heads ", shape.num_kv_heads, ", pages ", shape.max_pages, ") or summaries (kv heads ",
                       s.num_kv_heads, ", head_dim ", s.head_dim, ")");
    KVKIT_CHECK_STATUS(view.num_pages_total <= s.num_pages, StatusCode::kInvalidArgument, kOp, ": view pool has ",
                       view.num_pages_total, " pages, summaries ", s.num_pages);
    KVKIT_CHECK_STATUS(num_qo_heads > 0 && num_qo_heads % hkv == 0, StatusCode::kInvalidArgument, kOp,
                       ": num_qo_heads ", num_qo_heads, " is not a positive multiple of ", hkv);
    KVKIT_CHECK_STATUS(shape.num_qo_heads % hkv == 0 && num_qo_heads / hkv <= shape.num_qo_heads / hkv,
                       StatusCode::kInvalidArgument, kOp, ": num_qo_heads ", num_qo_heads,
                       " does not fit the shape's ", shape.num_qo_heads, " query heads");
    KVKIT_CHECK_STATUS(std::isfinite(sm_scale) && sm_scale > 0.f, StatusCode::kInvalidArgument, kOp, ": sm_scale ",
                       sm_scale, " must be finite and > 0");
    KVKIT_CHECK_STATUS(indptr != nullptr && subset != nullptr && omitted != nullptr && (q != nullptr || view.batch_size == 0),
                       StatusCode::kInvalidArgument, kOp, ": q, indptr, subset or omitted is null");
    std::uint64_t mask = ~0ull;
    if (!p_.head_on.empty()) {
      KVKIT_CHECK_STATUS(hkv <= 64 && layer >= 0 && static_cast<std::size_t>(layer + 1) * hkv <= p_.head_on.size(),
                         StatusCode::kInvalidArgument, kOp, ": layer ", layer, " / kv heads ", hkv,
                         " outside head_on (at most 64 kv heads)");
      mask = 0;
      for (std::int32_t h = 0; h < hkv; ++h)
        if (p_.head_on[static_cast<std::size_t>(layer) * hkv + h]) mask |= 1ull << h;
    }
    KVKIT_RETURN_IF_ERROR(cd::check_table_ptrs(view));
    const std::size_t need = workspace_size(shape);
    KVKIT_CHECK_STATUS(ws.data != nullptr && ws.bytes >= need, StatusCode::kInvalidArgument, kOp, ": workspace of ",
                       ws.bytes, " bytes is smaller than the ", need, " bytes needed");
    WorkspaceCarver c(ws);
    cd::EpsScratch sc;
    scratch_layout(shape, sc, [&](auto*& p, std::size_t n) { p = c.take<std::remove_reference_t<decltype(*p)>>(n); });
    KVKIT_CHECK_STATUS(sc.na != nullptr, StatusCode::kInvalidArgument, kOp, ": workspace of ", ws.bytes,
                       " bytes is too small");
    cudaStream_t stream = cd::stream_of(ex);
    const std::int64_t blocks = static_cast<std::int64_t>(view.batch_size) * hkv;
    if (blocks == 0) return cd::cuda_status(cudaMemsetAsync(indptr, 0, sizeof(std::int32_t), stream), kOp);
    const std::int64_t qblocks = blocks * (num_qo_heads / hkv);
    KVKIT_CHECK_STATUS(qblocks <= 2147483647LL, StatusCode::kInvalidArgument, kOp, ": batch x query heads ", qblocks,
                       " exceeds the CUDA grid limit");
    // Slices of 256 pages: the check's second grid dimension (at most 64) and the union's.
    const std::int64_t slices = (shape.max_pages + cd::kEpsThreads - 1) / cd::kEpsThreads;
    cd::eps_check_prepass_kernel<T><<<dim3(static_cast<unsigned>(view.batch_size < 1024 ? view.batch_size : 1024),
                                           static_cast<unsigned>(slices < 64 ? slices : 64)),
                                      cd::kEpsThreads, 0, stream>>>(view, shape.max_pages, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    twin::PrepassArgs a;
    a.eps = p_.eps;
    a.last_n = p_.last_n;
    a.top_pages = p_.top_pages;
    a.score_budget = p_.score_budget;
    a.score_fraction = p_.score_fraction;
    a.head_mask = mask;
    a.scale = static_cast<double>(sm_scale);
    a.log_full = std::log(static_cast<double>(view.page_size));  // the CPU's log_full (g = 1)
    const std::size_t qbytes = sizeof(float) * static_cast<std::size_t>(cd::eps_row_floats(view.head_dim));
    const std::size_t sort_bytes =
        static_cast<std::size_t>(twin::pow2_at_least(shape.max_pages)) * (sizeof(double) + sizeof(std::int32_t));
    const std::int32_t grp = num_qo_heads / hkv;
    const std::int64_t chunks = (shape.max_pages + cd::kEpsBoundPages - 1) / cd::kEpsBoundPages;
    const std::size_t bsmem = qbytes * static_cast<std::size_t>(grp) + sizeof(double) * static_cast<std::size_t>(grp);
    bool bounds_fit = false;
    KVKIT_RETURN_IF_ERROR(cd::eps_smem_fits(&cd::eps_bounds_kernel<T>, bsmem, &bounds_fit));
    KVKIT_CHECK_STATUS(bounds_fit && chunks <= 65535, StatusCode::kUnsupported, kOp, ": unsupported group of ", grp,
                       " query heads of ", view.head_dim, " (", bsmem, " bytes of shared memory) or ",
                       shape.max_pages, " pages per sequence");
    cd::eps_bounds_kernel<T><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(chunks)), cd::kEpsThreads,
                               bsmem, stream>>>(view, q, num_qo_heads, s, a, shape.max_pages, sc.ub_page, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    cd::eps_classify_kernel<T><<<static_cast<unsigned>(blocks), cd::kEpsThreads, 0, stream>>>(
        view, s, a, shape.max_pages, sc, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    bool smem_sort = false;
    if (smem_sort_)
      KVKIT_RETURN_IF_ERROR(cd::eps_smem_fits(&cd::eps_prepass_kernel<T>, qbytes + sort_bytes, &smem_sort));
    const std::size_t smem = qbytes + (smem_sort ? sort_bytes : 0);
    cd::eps_prepass_kernel<T><<<static_cast<unsigned>(qblocks), cd::kEpsThreads, smem, stream>>>(
        view, q, num_qo_heads, a, shape.max_pages, sc, smem_sort, omitted, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    cd::eps_union_kernel<><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(slices)), cd::kEpsThreads,
                             0, stream>>>(grp, shape.max_pages, sc, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    cd::eps_emit_kernel<><<<static_cast<unsigned>(blocks), cd::kEpsThreads, 0, stream>>>(shape.max_pages, sc, indptr,
                                                                                        subset, ex.status);
    return cd::launch_status(kOp);
  }

 private:
  static Status check_summaries(const twin::BoxSummaries& s, const char* op) {
    KVKIT_CHECK_STATUS(s.box_min != nullptr && s.box_max != nullptr && s.max_norm != nullptr &&
                           s.amax_norm != nullptr && s.count != nullptr && s.num_pages > 0 && s.num_kv_heads > 0 &&
                           s.head_dim > 0,
                       StatusCode::kInvalidArgument, op, ": summaries need all five arrays and positive sizes (pages ",
                       s.num_pages, ", kv heads ", s.num_kv_heads, ", head_dim ", s.head_dim, ")");
    return Status::ok();
  }

  /// The scratch arrays of `shape` in workspace order: take(field, count) for each (one
  /// list for workspace_size and select). nb (sequence, kv head) rows, nq (sequence,
  /// query head) rows, m pages, m2 the sort's power of two.
  template <class Take>
  static void scratch_layout(const EpsCudaShape& shape, cuda_detail::EpsScratch& sc, Take&& take) {
    const std::size_t nb = static_cast<std::size_t>(shape.max_batch) * static_cast<std::size_t>(shape.num_kv_heads);
    const std::size_t m = static_cast<std::size_t>(shape.max_pages);
    const std::size_t m2 = static_cast<std::size_t>(twin::pow2_at_least(shape.max_pages));
    const std::size_t grp = shape.num_kv_heads > 0 && shape.num_qo_heads > 0
                                ? static_cast<std::size_t>(shape.num_qo_heads / shape.num_kv_heads)
                                : 0;
    const std::size_t nq = nb * grp;
    take(sc.cand, nb * m);
    take(sc.alw, nb * m);
    take(sc.ord, nq * m2);
    take(sc.ub, nq * m2);
    take(sc.ub_page, nq * m);
    take(sc.w, nq * m);
    take(sc.tail, nq * (m + 1));
    take(sc.mass, nq * m);
    take(sc.pick, nq * m);
    take(sc.visit, nb * m);
    take(sc.count, nb);
    take(sc.np, nb);
    take(sc.nc, nb);
    take(sc.na, nb);
  }

  SketchParams p_;
  bool smem_sort_ = true;
};

}  // namespace sketch
}  // namespace kvkit
