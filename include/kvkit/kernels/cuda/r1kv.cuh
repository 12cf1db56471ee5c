#pragma once
// The Compressor pipeline (compressor/r1kv.hpp) on CUDA: the exec::Cuda twin of the dense
// Compressor::select, for every scorer (R1KV, SnapKV, StreamingLLM). Reached through
// <kvkit/cuda.cuh>.
//
// Kernels, one launch each, in stream order (the spec's steps, see r1kv.hpp):
//   normalize   grid (S/256, Hkv): thread per slot: n_j = k_j / (|k_j| + 1e-8)
//   logits      grid (R*(S-w)*8/256, Hkv): an 8-lane group per (query row, slot): the
//               GQA-max logit                                           (step 1)
//   importance  grid Hkv, one block per head: float32 softmax per query row, mean over
//               rows, max-pool                                          (steps 2-3)
//   near        grid (S*8/256, Hkv): an 8-lane group per row i: r(i), scanning j from
//               S-1 down and stopping at the first cosine > threshold   (step 4)
// (The 8-lane groups compute the CPU's 8-lane dot product, one lane per partial sum.)
//   colsum      grid Hkv: sum_i n_i per dim;  columns grid (S/256, Hkv): thread per
//               column j: <sum_i n_i, n_j> - <n_j, n_j> - sum_{r(i)=j, i!=j} <n_i, n_j>
//   score       grid Hkv: softmax of m / S over all S columns, Z = Scorer::score; a
//               non-finite Z is reported to the DeviceStatus (kInvalidArgument)
//   rank        grid (S/256, Hkv): rank[j] = #{j' : Z[j'] > Z[j] or (== and j' < j)}
//   finalize    grid Hkv: the Bud-w slots of rank < Bud-w in reference order (by rank)
//               or positional order (block scan), then the window; num_keep.
// The arithmetic follows the CPU twin's order where it can (8-lane float dot products
// reduced as reduce8, 4-lane double dots, sums taken serially in slot order), so scores
// usually match bit for bit; kept sets are identical up to near-ties either way. Memory is
// O(Hkv * S * (D + R)) workspace; the O(S^2) parts (r(i), ranks) recompute instead of
// storing. Every kernel returns at once when the status already holds an error, and the
// run path never allocates or synchronises (graph-capturable).

#include <cstddef>
#include <cstdint>

#include "kvkit/compressor/r1kv.hpp"
#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

inline constexpr int kR1kvThreads = 256;

/// <a, b> in float with the CPU dot4's arithmetic, computed by an aligned group of 8
/// lanes. The CPU keeps eight partial sums over the first D - D % 8 dims (sum l takes dims
/// l, l + 8, ... in order), reduces them ((s0+s4)+(s2+s6)) + ((s1+s5)+(s3+s7)) and adds
/// the tail in order. Here lane l of the group accumulates s[l], the pair sums are taken
/// in that order by xor shuffles (exact: float addition commutes) and every lane adds the
/// tail, so every lane returns the CPU's bits. The group's lanes read 8 consecutive
/// elements per step (32 bytes of a float row), where one thread per row made a warp
/// touch 32 scattered rows per load. `mask`: the group's 8 lanes.
template <class A, class B>
KVKIT_DEVICE float r1kv_dot8_group(const A* a,  // [D]
                                   const B* b,  // [D]
                                   std::int32_t dim, int sub, unsigned mask) {
  const std::int32_t body = dim - dim % 8;
  float r = 0.f;
  for (std::int32_t d = sub; d < body; d += 8) r = fmaf(load_float(a[d]), load_float(b[d]), r);
  r += __shfl_xor_sync(mask, r, 4);  // s[l] + s[l + 4]
  r += __shfl_xor_sync(mask, r, 2);  // (s0 + s4) + (s2 + s6) | (s1 + s5) + (s3 + s7)
  r += __shfl_xor_sync(mask, r, 1);
  for (std::int32_t d = body; d < dim; ++d) r = fmaf(load_float(a[d]), load_float(b[d]), r);
  return r;
}

/// Lanes per row of the group kernels (r1kv_dot8_group).
inline constexpr int kR1kvGroup = 8;

/// The calling thread's aligned 8-lane group in a 1-D grid over groups: the group's index
/// (the item it computes), the thread's lane in it (r1kv_dot8_group's `sub`) and the
/// group's lanes (the shuffles' `mask`).
struct R1kvLaneGroup {
  std::int64_t index;
  int sub;
  unsigned mask;
};
KVKIT_DEVICE R1kvLaneGroup r1kv_lane_group() {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  return {t / kR1kvGroup, static_cast<int>(threadIdx.x % kR1kvGroup),
          0xffu << (threadIdx.x % 32 / kR1kvGroup * kR1kvGroup)};
}

/// <a, b> in double with the CPU dot_double's four lanes.
template <class A>
KVKIT_DEVICE double r1kv_dot_double(const A* a,      // [D]
                                    const float* b,  // [D]
                                    std::int32_t dim) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::int32_t d = 0;
  for (; d + 4 <= dim; d += 4) {
#pragma unroll
    for (int l = 0; l < 4; ++l)
      s[l] = fma(static_cast<double>(a[d + l]), static_cast<double>(b[d + l]), s[l]);
  }
  for (; d < dim; ++d) s[0] = fma(static_cast<double>(a[d]), static_cast<double>(b[d]), s[0]);
  return (s[0] + s[2]) + (s[1] + s[3]);
}

/// Maximum of v over the block (every thread calls it; every thread gets the result).
template <class V>
__device__ V r1kv_block_max(V v, V* red) {  // red: [kR1kvThreads] shared
  red[threadIdx.x] = v;
  __syncthreads();
  for (int w = kR1kvThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) {
      const V o = red[threadIdx.x + w];
      if (o > red[threadIdx.x]) red[threadIdx.x] = o;
    }
    __syncthreads();
  }
  const V out = red[0];
  __syncthreads();  // red is reused by the caller's next reduction
  return out;
}

/// True when x is neither NaN nor +-inf.
KVKIT_DEVICE bool r1kv_finite(double x) { return fabs(x) <= 1.7976931348623157e308; }

// normed[h, j, :] = k / (|k| + 1e-8) in the CPU's arithmetic (norm in double, 4 lanes).
template <class T>
__global__ void r1kv_normalize_kernel(const T* __restrict__ keys,  // [Hkv, S, D]
                                      std::int32_t s, std::int32_t dim,
                                      float* __restrict__ normed,  // [Hkv, S, D]
                                      const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= s) return;
  const std::int64_t row = (static_cast<std::int64_t>(h) * s + j) * dim;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  std::int32_t d = 0;
  for (; d + 4 <= dim; d += 4)
    for (int l = 0; l < 4; ++l) {
      const double x = static_cast<double>(load_float(keys[row + d + l]));
      acc[l] = fma(x, x, acc[l]);
    }
  for (; d < dim; ++d) {
    const double x = static_cast<double>(load_float(keys[row + d]));
    acc[0] = fma(x, x, acc[0]);
  }
  const double nrm = (acc[0] + acc[2]) + (acc[1] + acc[3]);
  const double inv = 1.0 / (sqrt(nrm) + 1e-8);
  for (std::int32_t e = 0; e < dim; ++e)
    normed[row + e] = static_cast<float>(static_cast<double>(load_float(keys[row + e])) * inv);
}

// Step 1: logits[h, r, j] = max over the GQA group of q . k / sqrt(D), j < n_cand, one
// 8-lane group per (r, j) (grid: y = head).
template <class T>
__global__ void r1kv_logits_kernel(const T* __restrict__ keys,     // [Hkv, S, D]
                                   const T* __restrict__ queries,  // [Hq, Lq, D]
                                   std::int32_t s, std::int32_t dim, std::int32_t groups,
                                   std::int32_t q_len, std::int32_t rows, std::int32_t n_cand,
                                   float* __restrict__ logits,  // [Hkv, R, S]
                                   const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.y;
  const R1kvLaneGroup grp = r1kv_lane_group();
  const std::int64_t idx = grp.index;
  if (idx >= static_cast<std::int64_t>(rows) * n_cand) return;  // whole groups
  const std::int32_t r = static_cast<std::int32_t>(idx / n_cand);
  const std::int32_t j = static_cast<std::int32_t>(idx % n_cand);
  const T* k = keys + (static_cast<std::int64_t>(h) * s + j) * dim;
  float best = -INFINITY;
  for (std::int32_t g = 0; g < groups; ++g) {
    const T* q = queries + ((static_cast<std::int64_t>(h) * groups + g) * q_len +
                            (q_len - rows + r)) * dim;
    best = fmaxf(best, r1kv_dot8_group(q, k, dim, grp.sub, grp.mask));  // GQA max over raw logits
  }
  // Row r of head h starts at h * rows * s + r * n_cand (the importance kernel's layout).
  if (grp.sub == 0)
    logits[static_cast<std::int64_t>(h) * rows * s + idx] = best / sqrtf(static_cast<float>(dim));
}

// Steps 2-3 for head blockIdx.x: imp[h, j] for j < n_cand from the logits. One block per
// head.
__global__ void __launch_bounds__(kR1kvThreads)
    r1kv_importance_kernel(std::int32_t s, std::int32_t rows, std::int32_t n_cand,
                           std::int32_t kernel,
                           float* __restrict__ logits,  // [Hkv, R, S]
                           double* __restrict__ attn,   // [Hkv, S]
                           double* __restrict__ imp,    // [Hkv, S]
                           const DeviceStatus* st) {
  if (block_failed(st)) return;
  __shared__ float red_f[kR1kvThreads];
  __shared__ float inv_sum;
  const std::int32_t h = blockIdx.x;
  const int tid = threadIdx.x;
  float* lg = logits + static_cast<std::int64_t>(h) * rows * s;  // row r at lg + r * n_cand
  double* a = attn + static_cast<std::int64_t>(h) * s;
  __syncthreads();
  for (std::int32_t r = 0; r < rows; ++r) {
    float* l = lg + static_cast<std::int64_t>(r) * n_cand;
    float mx = -INFINITY;
    for (std::int32_t j = tid; j < n_cand; j += blockDim.x) mx = fmaxf(mx, l[j]);
    mx = r1kv_block_max(mx, red_f);
    for (std::int32_t j = tid; j < n_cand; j += blockDim.x) l[j] = expf(l[j] - mx);
    __syncthreads();
    if (tid == 0) {  // in slot order, as the CPU
      double sum = 0.0;
      for (std::int32_t j = 0; j < n_cand; ++j) sum += l[j];
      inv_sum = static_cast<float>(1.0 / sum);
    }
    __syncthreads();
    const float inv = inv_sum;
    for (std::int32_t j = tid; j < n_cand; j += blockDim.x)
      a[j] = (r == 0 ? 0.0 : a[j]) + static_cast<double>(l[j] * inv);
    __syncthreads();  // inv_sum is rewritten by the next row
  }
  for (std::int32_t j = tid; j < n_cand; j += blockDim.x) a[j] /= rows;
  __syncthreads();
  const std::int32_t half = kernel / 2;
  double* out = imp + static_cast<std::int64_t>(h) * s;
  for (std::int32_t j = tid; j < n_cand; j += blockDim.x) {
    double m = a[j];
    const std::int32_t lo = j - half > 0 ? j - half : 0;
    const std::int32_t hi = j + half < n_cand - 1 ? j + half : n_cand - 1;
    for (std::int32_t t = lo; t <= hi; ++t) m = a[t] > m ? a[t] : m;
    out[j] = m;
  }
}

// r(i) for every row i of head blockIdx.y: the largest j != i with cosine > thr, else 0.
// One 8-lane group per row (r1kv_dot8_group; one thread per row ran 174 ms at S 4224,
// Hkv 8 on an H100, most of the select).
__global__ void r1kv_near_kernel(const float* __restrict__ normed,  // [Hkv, S, D]
                                 std::int32_t s, std::int32_t dim, float thr,
                                 std::int32_t* __restrict__ near,   // [Hkv, S]
                                 const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.y;
  const R1kvLaneGroup grp = r1kv_lane_group();
  const std::int64_t i = grp.index;
  if (i >= s) return;  // whole groups
  const float* base = normed + static_cast<std::int64_t>(h) * s * dim;
  const float* ni = base + i * dim;
  std::int32_t r = 0;
  for (std::int32_t j = s - 1; j >= 0; --j) {  // the group's lanes take the same branches
    if (j == i) continue;
    const float* nj = base + static_cast<std::int64_t>(j) * dim;
    if (r1kv_dot8_group(ni, nj, dim, grp.sub, grp.mask) > thr) {
      r = j;
      break;
    }
  }
  if (grp.sub == 0) near[static_cast<std::int64_t>(h) * s + i] = r;
}

// nsum[h, d] = sum_i n[h, i, d] in double, rows in order (one block per head).
__global__ void r1kv_colsum_kernel(const float* __restrict__ normed,  // [Hkv, S, D]
                                   std::int32_t s, std::int32_t dim,
                                   double* __restrict__ nsum,         // [Hkv, D]
                                   const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.x;
  const float* base = normed + static_cast<std::int64_t>(h) * s * dim;
  for (std::int32_t d = threadIdx.x; d < dim; d += blockDim.x) {
    double acc = 0.0;
    for (std::int32_t i = 0; i < s; ++i) acc += base[static_cast<std::int64_t>(i) * dim + d];
    nsum[static_cast<std::int64_t>(h) * dim + d] = acc;
  }
}

// m[h, j] * S = <nsum, n_j> - <n_j, n_j> - sum_{i : r(i) = j, i != j} <n_i, n_j> (i in
// order, as the CPU), into red.
__global__ void r1kv_columns_kernel(const float* __restrict__ normed,     // [Hkv, S, D]
                                    const std::int32_t* __restrict__ near, // [Hkv, S]
                                    const double* __restrict__ nsum,       // [Hkv, D]
                                    std::int32_t s, std::int32_t dim,
                                    double* __restrict__ red,              // [Hkv, S]
                                    const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= s) return;
  const float* base = normed + static_cast<std::int64_t>(h) * s * dim;
  const std::int32_t* nh = near + static_cast<std::int64_t>(h) * s;
  const float* nj = base + j * dim;
  double m = r1kv_dot_double(nsum + static_cast<std::int64_t>(h) * dim, nj, dim) -
             r1kv_dot_double(nj, nj, dim);
  for (std::int32_t i = 0; i < s; ++i)
    if (nh[i] == j && i != j) m -= r1kv_dot_double(base + static_cast<std::int64_t>(i) * dim, nj, dim);
  red[static_cast<std::int64_t>(h) * s + j] = m;
}

// Rd = softmax over the S columns of m / S (when the scorer uses redundancy), then
// Z[j] = Scorer::score for the candidates; a non-finite Z is reported. One block per head.
template <class Scorer>
__global__ void __launch_bounds__(kR1kvThreads)
    r1kv_score_kernel(Scorer scorer, compressor::Params p, std::int32_t s, std::int32_t n_cand,
                      const double* __restrict__ imp,  // [Hkv, S]
                      double* __restrict__ red,        // [Hkv, S]
                      double* __restrict__ score,      // [Hkv, S]
                      DeviceStatus* st) {
  if (block_failed(st)) return;
  __shared__ double red_d[kR1kvThreads];
  __shared__ double total;
  const std::int32_t h = blockIdx.x;
  const int tid = threadIdx.x;
  double* rd = red + static_cast<std::int64_t>(h) * s;
  const double* im = imp + static_cast<std::int64_t>(h) * s;
  double* z = score + static_cast<std::int64_t>(h) * s;
  if (Scorer::kUsesRedundancy) {
    double mx = -INFINITY;
    for (std::int32_t j = tid; j < s; j += blockDim.x) {
      rd[j] /= s;
      mx = rd[j] > mx ? rd[j] : mx;
    }
    mx = r1kv_block_max(mx, red_d);
    for (std::int32_t j = tid; j < s; j += blockDim.x) rd[j] = exp(rd[j] - mx);
    __syncthreads();
    if (tid == 0) {  // in slot order, as the CPU
      double sum = 0.0;
      for (std::int32_t j = 0; j < s; ++j) sum += rd[j];
      total = sum;
    }
    __syncthreads();
    for (std::int32_t j = tid; j < s; j += blockDim.x) rd[j] /= total;
  }
  for (std::int32_t j = tid; j < n_cand; j += blockDim.x) {
    const double zj = scorer.score(p, Scorer::kUsesAttention ? im[j] : 0.0,
                                   Scorer::kUsesRedundancy ? rd[j] : 0.0, j, s);
    z[j] = zj;
    if (!r1kv_finite(zj))
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kNonFiniteScore, j, j, -1, 0, h);
  }
}

// rank[h, j] = number of candidates ranked before j (larger Z, or equal Z and lower slot).
__global__ void r1kv_rank_kernel(const double* __restrict__ score,  // [Hkv, S]
                                 std::int32_t s, std::int32_t n_cand,
                                 std::int32_t* __restrict__ rank,   // [Hkv, S]
                                 const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n_cand) return;
  const double* z = score + static_cast<std::int64_t>(h) * s;
  const double zj = z[j];
  std::int32_t before = 0;
  for (std::int32_t t = 0; t < n_cand; ++t) {
    const double zt = z[t];
    before += (zt > zj || (zt == zj && t < j)) ? 1 : 0;
  }
  rank[static_cast<std::int64_t>(h) * s + j] = before;
}

// keep[h, :] = the k = Bud - w candidates of rank < k (reference order: position = rank;
// positional: ascending slots), then the window n_cand .. S-1; num_keep = Bud.
__global__ void __launch_bounds__(kR1kvThreads)
    r1kv_finalize_kernel(const std::int32_t* __restrict__ rank,  // [Hkv, S]
                         std::int32_t s, std::int32_t n_cand, std::int32_t budget,
                         std::int32_t window, bool positional,
                         std::int32_t* __restrict__ keep,  // [Hkv, keep_stride]
                         std::int32_t keep_stride,
                         std::int32_t* __restrict__ num_keep,  // [1]
                         const DeviceStatus* st) {
  if (block_failed(st)) return;
  __shared__ std::int32_t counts[kR1kvThreads];
  const std::int32_t h = blockIdx.x;
  const int tid = threadIdx.x;
  const std::int32_t k = budget - window;
  const std::int32_t* rk = rank + static_cast<std::int64_t>(h) * s;
  std::int32_t* out = keep + static_cast<std::int64_t>(h) * keep_stride;
  if (!positional) {
    for (std::int32_t j = tid; j < n_cand; j += blockDim.x)
      if (rk[j] < k) out[rk[j]] = j;
  } else {
    // Thread t owns the contiguous chunk [t * chunk, (t + 1) * chunk) of candidates.
    const std::int32_t chunk = (n_cand + kR1kvThreads - 1) / kR1kvThreads;
    const std::int64_t lo = static_cast<std::int64_t>(tid) * chunk;
    const std::int64_t hi = lo + chunk < n_cand ? lo + chunk : n_cand;
    std::int32_t c = 0;
    for (std::int64_t j = lo; j < hi; ++j) c += rk[j] < k ? 1 : 0;
    counts[tid] = c;
    __syncthreads();
    if (tid == 0) {  // exclusive prefix sum over the threads
      std::int32_t run = 0;
      for (int t = 0; t < kR1kvThreads; ++t) {
        const std::int32_t n = counts[t];
        counts[t] = run;
        run += n;
      }
    }
    __syncthreads();
    std::int32_t pos = counts[tid];
    for (std::int64_t j = lo; j < hi; ++j)
      if (rk[j] < k) out[pos++] = static_cast<std::int32_t>(j);
  }
  for (std::int32_t i = tid; i < window; i += blockDim.x) out[k + i] = n_cand + i;
  if (h == 0 && tid == 0) *num_keep = budget;
}

// S < budget: keep[h, i] = i for i < S, num_keep = S.
__global__ void r1kv_identity_kernel(std::int32_t s, std::int32_t* __restrict__ keep,  // [Hkv, stride]
                                     std::int32_t keep_stride,
                                     std::int32_t* __restrict__ num_keep,  // [1]
                                     const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t h = blockIdx.y;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < s) keep[static_cast<std::int64_t>(h) * keep_stride + i] = static_cast<std::int32_t>(i);
  if (h == 0 && i == 0) *num_keep = s;
}

/// Blocks covering n items at kR1kvThreads per block (at least one).
inline unsigned r1kv_blocks(std::int64_t n) {
  const std::int64_t b = (n + kR1kvThreads - 1) / kR1kvThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

}  // namespace cuda_detail

namespace compressor {

template <class Scorer>
template <class T>
Status Compressor<Scorer>::select(exec::Cuda ex, const T* keys,  // [Hkv, S, D] device
                                  const T* queries,              // [Hq, Lq, D] device
                                  const Shape& sh,
                                  std::int32_t* keep,       // [Hkv, keep_stride] device
                                  std::int32_t keep_stride,
                                  std::int32_t* num_keep,   // [1] device
                                  Workspace ws) const {
  constexpr const char* kOp = "compressor (cuda)";
  namespace cd = cuda_detail;
  const Params& p = params_;
  const std::int32_t hkv = sh.num_kv_heads, dim = sh.head_dim, s = sh.seq_len;
  KVKIT_CHECK_STATUS(hkv > 0 && dim > 0 && s >= 0, StatusCode::kInvalidArgument,
                     "compressor: bad shape (Hkv ", hkv, ", D ", dim, ", S ", s, ")");
  KVKIT_CHECK_STATUS(hkv <= 65535, StatusCode::kInvalidArgument, "compressor: num_kv_heads ", hkv,
                     " exceeds the CUDA grid limit 65535");
  KVKIT_CHECK_STATUS(num_keep != nullptr && keep != nullptr, StatusCode::kInvalidArgument,
                     "compressor: keep or num_keep is null");
  const std::int32_t out_n = std::min(s, p.budget);
  KVKIT_CHECK_STATUS(keep_stride >= out_n, StatusCode::kInvalidArgument, "compressor: keep_stride ",
                     keep_stride, " < ", out_n, " kept slots");
  KVKIT_RETURN_IF_ERROR(cd::check_status_ptr(ex, kOp));
  cudaStream_t stream = cd::stream_of(ex);
  constexpr int kT = cd::kR1kvThreads;
  if (s < p.budget) {  // step 0: nothing happens
    cd::r1kv_identity_kernel<<<dim3(cd::r1kv_blocks(s), static_cast<unsigned>(hkv)), kT, 0,
                               stream>>>(s, keep, keep_stride, num_keep, ex.status);
    return cd::launch_status(kOp);
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
  if (Scorer::kUsesAttention || Scorer::kUsesRedundancy)
    KVKIT_CHECK_STATUS(keys != nullptr, StatusCode::kInvalidArgument, "compressor: keys is null");
  const std::size_t need = workspace_size(ex, sh);
  KVKIT_CHECK_STATUS(ws.bytes >= need && ws.data != nullptr, StatusCode::kInvalidArgument,
                     "compressor: workspace of ", ws.bytes, " bytes is smaller than the ", need,
                     " bytes needed");
  // Carve in size_cuda_scratch's order (R as sized: rows_used for every scorer).
  const std::size_t hs = static_cast<std::size_t>(hkv) * static_cast<std::size_t>(s);
  const std::size_t r_sized = static_cast<std::size_t>(rows_used(p, sh));
  WorkspaceCarver c(ws);
  float* normed = c.take<float>(hs * static_cast<std::size_t>(dim));
  float* logits = c.take<float>(hs * r_sized);
  double* attn = c.take<double>(hs);
  double* imp = c.take<double>(hs);
  double* red = c.take<double>(hs);
  double* score = c.take<double>(hs);
  std::int32_t* near = c.take<std::int32_t>(hs);
  std::int32_t* rank = c.take<std::int32_t>(hs);
  double* nsum = c.take<double>(static_cast<std::size_t>(hkv) * static_cast<std::size_t>(dim));
  KVKIT_CHECK_STATUS(nsum != nullptr, StatusCode::kInvalidArgument, "compressor: workspace of ",
                     ws.bytes, " bytes is too small");
  const std::int32_t n_cand = s - p.window;
  const dim3 slots(cd::r1kv_blocks(s), static_cast<unsigned>(hkv));
  const unsigned heads = static_cast<unsigned>(hkv);
  if (Scorer::kUsesRedundancy) {
    cd::r1kv_normalize_kernel<T><<<slots, kT, 0, stream>>>(keys, s, dim, normed, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
  }
  if (Scorer::kUsesAttention) {
    const dim3 pairs(
        cd::r1kv_blocks(static_cast<std::int64_t>(rows) * n_cand * cd::kR1kvGroup), heads);
    cd::r1kv_logits_kernel<T><<<pairs, kT, 0, stream>>>(keys, queries, s, dim, groups,
                                                        sh.num_queries, rows, n_cand, logits,
                                                        ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    cd::r1kv_importance_kernel<<<heads, kT, 0, stream>>>(s, rows, n_cand, p.kernel, logits, attn,
                                                         imp, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
  }
  if (Scorer::kUsesRedundancy) {
    const dim3 row_groups(cd::r1kv_blocks(static_cast<std::int64_t>(s) * cd::kR1kvGroup), heads);
    cd::r1kv_near_kernel<<<row_groups, kT, 0, stream>>>(normed, s, dim, p.similarity_threshold,
                                                        near, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    cd::r1kv_colsum_kernel<<<heads, kT, 0, stream>>>(normed, s, dim, nsum, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
    cd::r1kv_columns_kernel<<<slots, kT, 0, stream>>>(normed, near, nsum, s, dim, red, ex.status);
    KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
  }
  cd::r1kv_score_kernel<Scorer><<<heads, kT, 0, stream>>>(scorer_, p, s, n_cand, imp, red, score,
                                                          ex.status);
  KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
  cd::r1kv_rank_kernel<<<dim3(cd::r1kv_blocks(n_cand), heads), kT, 0, stream>>>(score, s, n_cand,
                                                                               rank, ex.status);
  KVKIT_RETURN_IF_ERROR(cd::launch_status(kOp));
  cd::r1kv_finalize_kernel<<<heads, kT, 0, stream>>>(rank, s, n_cand, p.budget, p.window,
                                                     p.order == KeepOrder::kPositional, keep,
                                                     keep_stride, num_keep, ex.status);
  return cd::launch_status(kOp);
}

}  // namespace compressor
}  // namespace kvkit
