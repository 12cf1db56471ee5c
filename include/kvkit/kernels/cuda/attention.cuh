#pragma once
// Paged decode attention on CUDA: one query token per sequence against its cached
// tokens, GQA, float accumulation, online softmax, and the variants of
// DecodeAttentionParams (page subset, channel-restricted K/V, scores out). Also the
// log-sum-exp merge of two attention states. Twin of kernels/cpu/attention.hpp.
//
// Work split: a block owns (sequence b, kv head, GB query heads of that kv head, split s)
// so each K/V row is loaded once for GB query heads. Within the block, "token groups" of
// TG lanes each hold one token's K/V row (VEC elements per lane per vector load) and keep
// an online-softmax state (max, sum, unnormalised output slice) per query head; groups
// are merged by warp shuffles, warps through shared memory. Long token lists are cut into
// up to kMaxSplits chunks run by separate blocks (split-K); their partial states go to
// the workspace and a second kernel merges them. Scores are kept in the log2 domain
// (q pre-scaled by sm_scale * log2(e)) so exponentials are exp2f.
//
// One kernel serves every variant; the variants only change three small pieces:
//   - PageList / locate_token: which tokens (b, kv head) reads (all pages or a subset),
//   - load_query: q[hq] or q[hq][k_channels] (keys stored with fewer channels),
//   - the output store: out[d] or out[v_channels[d]] (rest zeroed by a fill kernel),
// plus an optional scores store; the tile loop and online-softmax update are shared.
// K rows (head_dim) and V rows (v_head_dim) are both held in a register tile of DT
// elements, DT = the smallest compiled size >= both; lanes past a row's length load
// zeros.

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

inline constexpr int kAttnWarps = 4;
inline constexpr int kAttnThreads = kAttnWarps * 32;
/// Tokens each token group loads per step before computing (memory-level parallelism).
inline constexpr int kUnroll = 2;
/// Most chunks one sequence is split into.
inline constexpr int kMaxSplits = 64;
/// Blocks per launch the split heuristic aims for: about eight per SM of an H100/H200
/// (132 SMs; a block of 4 warps at ~127 registers fits 4 per SM, so two waves). Measured
/// on an H100 (bench_cuda, bench/RESULTS.md "H100"): 264 blocks and at most 16 splits
/// left B 1-8 at 0.12-0.21 of the d2d copy's rate, this gives 0.25-0.38 (f16).
inline constexpr int kTargetBlocks = 1056;
/// Shortest chunk worth its own block; shorter sequences use fewer splits.
inline constexpr int kMinSplitTokens = 128;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

/// Splits per sequence: a function of the shapes only, so the workspace size the host
/// computes is the one the launch uses. The per-sequence chunk length is chosen on the
/// device from the real length (at least kMinSplitTokens), so idle splits cost one
/// tiny block each.
inline int decode_num_splits(std::int32_t batch, std::int32_t num_kv_heads) {
  const std::int64_t units = static_cast<std::int64_t>(batch) * num_kv_heads;
  if (units <= 0) return 1;
  const std::int64_t s = kTargetBlocks / units;
  return static_cast<int>(s < 1 ? 1 : (s > kMaxSplits ? kMaxSplits : s));
}

// Online-softmax state merge: (m, l, acc) <- (m, l, acc) (+) (mo, lo, acco), log2 domain.
template <int E>
KVKIT_DEVICE void merge_state(float& m, float& l,
                              float* acc,  // [E]
                              float mo, float lo,
                              const float* acco) {  // [E]
  const float mm = fmaxf(m, mo);
  if (mm == -INFINITY) return;  // both empty
  const float ca = exp2f(m - mm);
  const float cb = exp2f(mo - mm);
  l = l * ca + lo * cb;
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = acc[e] * ca + acco[e] * cb;
  m = mm;
}

// Final or partial result of a block: (m, l, acc) per query head in shared memory.
template <int DT, int GB>
struct DecodeSmem {
  float m[kAttnWarps][GB];
  float l[kAttnWarps][GB];
  float acc[kAttnWarps][GB][DT];
};

// Everything a decode launch passes besides the view (one struct keeps signatures short).
template <class T>
struct DecodeArgs {
  const T* q = nullptr;                          // [batch, Hq, q_width]
  T* out = nullptr;                              // [batch, Hq, out_width]
  float* lse = nullptr;                          // [batch, Hq] or null
  float* part_acc = nullptr;                     // [batch, Hq, S, Dv] when S > 1
  float* part_m = nullptr;                       // [batch, Hq, S] when S > 1
  float* part_l = nullptr;                       // [batch, Hq, S] when S > 1
  const std::int32_t* subset_indptr = nullptr;   // [batch * Hkv + 1] or null
  const std::int32_t* subset = nullptr;          // [subset_indptr[batch * Hkv]]
  const std::int32_t* k_channels = nullptr;      // [Hkv, D] or null
  const std::int32_t* v_channels = nullptr;      // [Hkv, Dv] or null
  float* scores = nullptr;                       // [batch, Hq, scores_stride] or null
  std::int64_t scores_stride = 0;
  std::int32_t num_qo_heads = 0, group_size = 0, q_width = 0, out_width = 0, q_dim = 0;
  std::int32_t num_splits = 1;
  float q_scale = 0.f;                           // sm_scale * log2(e)
  DeviceStatus* status = nullptr;                // [1]
};

// Page iteration: the tokens (sequence b, kv head h) reads, in order. Token u of the
// list is slot u % page_size of list entry u / page_size; only the sequence's last
// page can be partial, and in a strictly ascending subset it can only be the last entry.
struct PageList {
  const std::int32_t* pages;  // [count] logical page indices of b, or null: 0..count-1
  std::int32_t count;         // entries
  std::int32_t tokens;        // tokens over all entries
  KVKIT_DEVICE std::int32_t logical(std::int32_t i) const { return pages ? pages[i] : i; }
};

template <class T>
KVKIT_DEVICE PageList page_list(const PagedKVView<T>& view, const DecodeArgs<T>& a, std::int32_t b,
                                std::int32_t h) {
  const std::int32_t len = view.seq_len(b);
  const std::int32_t np = view.num_pages(b);
  if (a.subset_indptr == nullptr) return {nullptr, np, len};
  const std::int64_t r = static_cast<std::int64_t>(b) * view.num_kv_heads + h;
  const std::int32_t beg = a.subset_indptr[r];
  PageList pl{a.subset + beg, a.subset_indptr[r + 1] - beg, 0};
  if (pl.count > 0) {
    const std::int32_t last = pl.pages[pl.count - 1];
    const std::int32_t last_tokens =
        last == np - 1 ? len - (np - 1) * view.page_size : view.page_size;
    pl.tokens = (pl.count - 1) * view.page_size + last_tokens;
  }
  return pl;
}

// Token u of a page list: its logical position t in the sequence, physical page, slot.
struct TokenLoc {
  std::int32_t t, page, slot;
};
template <class T>
KVKIT_DEVICE TokenLoc locate_token(const PagedKVView<T>& view, const PageList& pl, std::int32_t b,
                                   std::int32_t u) {
  const std::int32_t i = u / view.page_size;
  const std::int32_t slot = u - i * view.page_size;
  const std::int32_t lp = pl.logical(i);
  return {lp * view.page_size + slot, view.page_id(b, lp), slot};
}

// Loads the lane's slice of query row `qrow` (elements (v * TG + lig) * VEC + [0, VEC)
// below `dim`, zeros past it), through the channel map when keys are channel-restricted,
// and scales it.
template <class T, int VEC, int TG, int NV>
KVKIT_DEVICE void load_query(const T* qrow,              // [q_width]
                             const std::int32_t* chans,  // [dim] channels of this kv head, or null
                             int dim, int lig, float scale, float* qv) {  // qv: [NV * VEC]
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int c = (v * TG + lig) * VEC;
    float* dst = qv + v * VEC;
    if (c >= dim) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[e] = 0.f;
    } else if (chans != nullptr) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[e] = load_float(qrow[chans[c + e]]);
    } else {
      load_vec_float<T, VEC>(qrow + c, dst);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) dst[e] *= scale;
  }
}

// Loads the lane's slice of a K or V row (zeros past `dim`).
template <class T, int VEC, int TG, int NV>
KVKIT_DEVICE void load_row(const T* row, int dim, int lig, float* x) {  // x: [NV * VEC]
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int c = (v * TG + lig) * VEC;
    if (c < dim) {
      load_vec_float<T, VEC>(row + c, x + v * VEC);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[v * VEC + e] = 0.f;
    }
  }
}

// The online-softmax update of one query head by one token with score s (log2 domain).
template <int E>
KVKIT_DEVICE void online_update(float& m, float& l, float* acc,  // [E]
                                float s, const float* vf) {      // [E]
  const float mn = fmaxf(m, s);
  const float c = exp2f(m - mn);  // 0 on the first token (m = -inf)
  const float p = exp2f(s - mn);
  l = l * c + p;
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = fmaf(p, vf[e], acc[e] * c);
  m = mn;
}

// Output column of V channel d of kv head kvh.
template <class T>
KVKIT_DEVICE std::int64_t out_column(const DecodeArgs<T>& a, std::int32_t kvh, std::int32_t vdim,
                                     std::int32_t d) {
  return a.v_channels ? a.v_channels[static_cast<std::int64_t>(kvh) * vdim + d] : d;
}

template <class T, int DT, int VEC, int GB>
__global__ void __launch_bounds__(kAttnThreads)
    decode_attention_kernel(PagedKVView<T> view, DecodeArgs<T> a) {
  constexpr int kChunks = DT / VEC;                 // vectors per row tile
  constexpr int TG = kChunks < 32 ? kChunks : 32;   // lanes per token group
  constexpr int NV = kChunks / TG;                  // vectors per lane
  constexpr int GPW = 32 / TG;                      // token groups per warp
  constexpr int E = NV * VEC;                       // row elements per lane
  static_assert(kChunks * VEC == DT && NV * TG == kChunks && GPW * TG == 32, "tiling");
  __shared__ DecodeSmem<DT, GB> sm;
  if (failed(a.status)) return;  // uniform: every thread of the block returns

  const std::int32_t b = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t blocks_per_kv = a.group_size / GB;
  const std::int32_t kvh = static_cast<std::int32_t>(blockIdx.y) / blocks_per_kv;
  const std::int32_t hq0 =
      kvh * a.group_size + (static_cast<std::int32_t>(blockIdx.y) % blocks_per_kv) * GB;
  const std::int32_t split = static_cast<std::int32_t>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int lig = lane % TG;  // lane in its token group
  const int kdim = view.head_dim, vdim = view.v_head_dim;

  // This block's range [u_begin, u_end) of the (b, kvh) token list.
  const PageList pl = page_list(view, a, b, kvh);
  std::int64_t chunk = (static_cast<std::int64_t>(pl.tokens) + a.num_splits - 1) / a.num_splits;
  if (chunk < kMinSplitTokens) chunk = kMinSplitTokens;
  const std::int64_t tb = split * chunk;
  const std::int32_t u_begin = static_cast<std::int32_t>(tb < pl.tokens ? tb : pl.tokens);
  const std::int32_t u_end =
      static_cast<std::int32_t>(tb + chunk < pl.tokens ? tb + chunk : pl.tokens);

  const std::int32_t* kch =
      a.k_channels ? a.k_channels + static_cast<std::int64_t>(kvh) * kdim : nullptr;
  float qv[GB][E];
#pragma unroll
  for (int g = 0; g < GB; ++g)
    load_query<T, VEC, TG, NV>(a.q + (static_cast<std::int64_t>(b) * a.num_qo_heads + hq0 + g) *
                                         a.q_width,
                               kch, kdim, lig, a.q_scale, qv[g]);
  float m[GB], l[GB], acc[GB][E];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  // Each warp takes kUnroll * GPW consecutive tokens per step and issues all their K/V
  // loads before using them (more loads in flight per lane). The trip count depends only
  // on the warp, so every lane reaches every shuffle.
  constexpr int kWarpTokens = kUnroll * GPW;
  for (std::int32_t base = u_begin + warp * kWarpTokens; base < u_end;
       base += kAttnWarps * kWarpTokens) {
    float kf[kUnroll][E], vf[kUnroll][E];
    bool valid[kUnroll];
    std::int32_t tok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int32_t uu = base + u * GPW + lane / TG;
      valid[u] = false;
      tok[u] = 0;
      if (uu < u_end) {
        const TokenLoc loc = locate_token(view, pl, b, uu);
        // The validation kernel rejected bad page ids; this guard only keeps any
        // unchecked path from reading outside the pool.
        valid[u] = loc.page >= 0 && loc.page < view.num_pages_total;
        tok[u] = loc.t;
        if (valid[u]) {
          load_row<T, VEC, TG, NV>(view.k_data + view.k_offset(loc.page, loc.slot, kvh), kdim, lig,
                                   kf[u]);
          load_row<T, VEC, TG, NV>(view.v_data + view.v_offset(loc.page, loc.slot, kvh), vdim, lig,
                                   vf[u]);
        }
      }
      if (!valid[u]) {
#pragma unroll
        for (int e = 0; e < E; ++e) kf[u][e] = vf[u][e] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int g = 0; g < GB; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) s = fmaf(qv[g][e], kf[u][e], s);
#pragma unroll
        for (int off = TG / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (valid[u]) {
          if (a.scores != nullptr && lig == 0)
            a.scores[(static_cast<std::int64_t>(b) * a.num_qo_heads + hq0 + g) * a.scores_stride +
                     tok[u]] = s * kLn2;
          online_update<E>(m[g], l[g], acc[g], s, vf[u]);
        }
      }
    }
  }

  // Merge the token groups of each warp (lanes lig, lig + TG, ... hold the same slice).
#pragma unroll
  for (int off = TG; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      float ao[E];
#pragma unroll
      for (int e = 0; e < E; ++e) ao[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
      merge_state<E>(m[g], l[g], acc[g], mo, lo, ao);
    }
  }

  // Merge the warps through shared memory.
  if (lane < TG) {
#pragma unroll
    for (int g = 0; g < GB; ++g) {
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) sm.acc[warp][g][(v * TG + lig) * VEC + e] = acc[g][v * VEC + e];
      if (lane == 0) {
        sm.m[warp][g] = m[g];
        sm.l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();
  for (int idx = static_cast<int>(threadIdx.x); idx < GB * vdim; idx += kAttnThreads) {
    const int g = idx / vdim;
    const int d = idx - g * vdim;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mm = fmaxf(mm, sm.m[w][g]);
    float ls = 0.f, acc_d = 0.f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float c = exp2f(sm.m[w][g] - mm);
        ls += sm.l[w][g] * c;
        acc_d += sm.acc[w][g][d] * c;
      }
    }
    const std::int64_t row = static_cast<std::int64_t>(b) * a.num_qo_heads + hq0 + g;
    if (a.num_splits == 1) {
      a.out[row * a.out_width + out_column(a, kvh, vdim, d)] =
          store_float<T>(ls > 0.f ? acc_d / ls : 0.f);
      if (a.lse != nullptr && d == 0) a.lse[row] = ls > 0.f ? (mm + log2f(ls)) * kLn2 : -INFINITY;
    } else {
      const std::int64_t prow = row * a.num_splits + split;
      a.part_acc[prow * vdim + d] = acc_d;
      if (d == 0) {
        a.part_m[prow] = mm;
        a.part_l[prow] = ls;
      }
    }
  }
}

// Merges the S partial states of each (b, query head); one thread per V channel.
template <class T>
__global__ void decode_combine_kernel(DecodeArgs<T> a, std::int64_t rows, std::int32_t vdim) {
  if (failed(a.status)) return;
  const std::int64_t total = rows * vdim;
  const std::int32_t S = a.num_splits;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / vdim;
    const std::int32_t d = static_cast<std::int32_t>(i - row * vdim);
    const std::int32_t kvh = static_cast<std::int32_t>(row % a.num_qo_heads) / a.group_size;
    const float* pm = a.part_m + row * S;
    const float* pl = a.part_l + row * S;
    float mm = -INFINITY;
    for (int s = 0; s < S; ++s) mm = fmaxf(mm, pm[s]);
    float ls = 0.f, acc_d = 0.f;
    if (mm != -INFINITY) {
      for (int s = 0; s < S; ++s) {
        const float c = exp2f(pm[s] - mm);
        ls += pl[s] * c;
        acc_d += a.part_acc[(row * S + s) * vdim + d] * c;
      }
    }
    a.out[row * a.out_width + out_column(a, kvh, vdim, d)] =
        store_float<T>(ls > 0.f ? acc_d / ls : 0.f);
    if (a.lse != nullptr && d == 0) a.lse[row] = ls > 0.f ? (mm + log2f(ls)) * kLn2 : -INFINITY;
  }
}

// p[0..n) = value unless the status holds an error (the zeroed output columns of
// v_channels; done before the attention kernels on the same stream).
template <class U>
__global__ void fill_kernel(U* __restrict__ p, std::int64_t n, U value, const DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

// scores[b, hq, t] = -inf for t < seq_len(b): the tokens a page subset skips keep it.
template <class T>
__global__ void fill_scores_kernel(PagedKVView<T> view, DecodeArgs<T> a) {
  if (failed(a.status)) return;
  const std::int64_t per_seq = static_cast<std::int64_t>(a.num_qo_heads) * a.scores_stride;
  const std::int64_t total = per_seq * view.batch_size;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(i / per_seq);
    const std::int64_t t = i % a.scores_stride;
    if (t < view.seq_len(b)) a.scores[i] = -INFINITY;
  }
}

// Decode's device checks (as the CPU twin): channel maps in [0, q_dim); for every
// sequence (block x takes x, x + gridDim.x, ...) its page table, seq_len <= scores_stride
// and each kv head's page subset (indptr monotone, entries strictly ascending below the
// sequence's page count). A subset is checked by the whole block (one thread per entry)
// and the first bad entry is reported, as the CPU's serial scan does: a 4096-page subset
// checked by one thread cost more than the attention itself (1.5 x dense at 64K, H100).
template <class T>
__global__ void validate_decode_kernel(PagedKVView<T> view, DecodeArgs<T> a) {
  DeviceStatus* st = a.status;
  __shared__ std::int32_t first_bad;
  if (block_failed(st)) return;
  const std::int64_t tid = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int32_t hkv = view.num_kv_heads;
  if (a.k_channels != nullptr) {
    for (std::int64_t i = tid; i < static_cast<std::int64_t>(hkv) * view.head_dim; i += step) {
      const std::int32_t c = a.k_channels[i];
      if (c < 0 || c >= a.q_dim)
        report(st, StatusCode::kOutOfRange, DeviceCheck::kKChannel, c, i % view.head_dim, -1, a.q_dim,
               i / view.head_dim);
    }
  }
  if (a.v_channels != nullptr) {
    for (std::int64_t i = tid; i < static_cast<std::int64_t>(hkv) * view.v_head_dim; i += step) {
      const std::int32_t c = a.v_channels[i];
      if (c < 0 || c >= a.q_dim)
        report(st, StatusCode::kOutOfRange, DeviceCheck::kVChannel, c, i % view.v_head_dim, -1,
               a.q_dim, i / view.v_head_dim);
    }
  }
  const bool lead = threadIdx.x == 0;
  for (std::int64_t bb = blockIdx.x; bb < view.batch_size; bb += gridDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(bb);
    const std::int32_t np = check_sequence_pages_dev(view, b, st, lead, threadIdx.x, blockDim.x);
    if (np < 0) continue;
    const std::int32_t len = view.seq_len(b);
    if (a.scores != nullptr && len > a.scores_stride && lead)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kScoresStride, len, -1, b,
             a.scores_stride);
  }
  if (a.subset_indptr == nullptr) return;
  // Subsets: block x takes rows (sequence, kv head) x, x + gridDim.x, ...
  for (std::int64_t rr = blockIdx.x; rr < static_cast<std::int64_t>(view.batch_size) * hkv; rr += gridDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(rr / hkv), h = static_cast<std::int32_t>(rr % hkv);
    // The header only (the loop above reports it and the page ids); block-uniform.
    const std::int32_t np = check_sequence_pages_dev(view, b, st, false, std::int64_t{1} << 62, 1);
    if (np < 0) continue;
    const std::int64_t r = rr;
    const std::int32_t lo = a.subset_indptr[r], hi = a.subset_indptr[r + 1];
    if (lo < 0 || hi < lo) {
      if (lead) report(st, StatusCode::kOutOfRange, DeviceCheck::kSubsetIndptr, lo, -1, b, hi, h);
      continue;
    }
    if (hi > lo && a.subset == nullptr) {
      if (lead) report(st, StatusCode::kInvalidArgument, DeviceCheck::kSubsetNull, hi - lo, -1, b, 0, h);
      continue;
    }
    const std::int32_t n = hi - lo;
    if (lead) first_bad = n;
    __syncthreads();
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n;
         i += static_cast<std::int32_t>(blockDim.x)) {
      const std::int32_t e = a.subset[lo + i];
      if (e < 0 || e >= np || (i > 0 && e <= a.subset[lo + i - 1])) atomicMin(&first_bad, i);
    }
    __syncthreads();
    if (lead && first_bad < n) {
      // Entries before i are in range and ascending, so subset[i - 1] is the serial
      // scan's `prev`.
      const std::int32_t i = first_bad, e = a.subset[lo + i];
      if (e < 0 || e >= np)
        report(st, StatusCode::kOutOfRange, DeviceCheck::kSubsetEntry, e, i, b, np, h);
      else  // in range but not ascending: kInvalidArgument, as on the CPU
        report(st, StatusCode::kInvalidArgument, DeviceCheck::kSubsetOrder, e, i, b,
               a.subset[lo + i - 1], h);
    }
    __syncthreads();  // first_bad is reset for the next row
  }
}

/// The row tile sizes with a compiled kernel: K and V rows up to 256 elements.
inline constexpr int kMaxDecodeDim = 256;

inline Status check_decode_dims(int kdim, int vdim) {
  KVKIT_CHECK_STATUS(kdim <= kMaxDecodeDim && vdim <= kMaxDecodeDim, StatusCode::kUnsupported,
                     "unsupported head_dim ", kdim, " / v_head_dim ", vdim,
                     " (CUDA decode attention supports rows of up to ", kMaxDecodeDim,
                     " elements)");
  return Status::ok();
}

// Picks the query-head batch GB (largest of 4/2/1 dividing the group) and launches. More
// than 4 query heads per block costs more registers (lower occupancy) than the extra K/V
// reads it saves; those mostly hit L2 anyway.
template <class T, int DT, int VEC>
Status launch_decode(exec::Cuda ex, const PagedKVView<T>& view, const DecodeArgs<T>& a) {
  auto go = [&](auto gb) {
    constexpr int kGB = decltype(gb)::value;
    const dim3 grid(static_cast<unsigned>(view.batch_size),
                    static_cast<unsigned>(a.num_qo_heads / kGB), static_cast<unsigned>(a.num_splits));
    KVKIT_CHECK_STATUS(grid.y <= 65535u, StatusCode::kUnsupported, "num_qo_heads ", a.num_qo_heads,
                       " needs ", grid.y, " blocks in grid y (max 65535)");
    decode_attention_kernel<T, DT, VEC, kGB><<<grid, kAttnThreads, 0, stream_of(ex)>>>(view, a);
    return launch_status("paged_decode_attention");
  };
  // The unaligned fallback (VEC == 1) is rare; keep it to one instantiation per DT.
  if constexpr (VEC > 1) {
    if (a.group_size % 4 == 0) return go(std::integral_constant<int, 4>{});
    if (a.group_size % 2 == 0) return go(std::integral_constant<int, 2>{});
  }
  return go(std::integral_constant<int, 1>{});
}

template <class T, int DT>
Status dispatch_decode_vec(exec::Cuda ex, const PagedKVView<T>& view, const DecodeArgs<T>& a) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  // 16-byte loads need every K/V row and base aligned, and q too when it is read
  // directly (through k_channels it is read element by element).
  const int vbytes = a.k_channels ? view_vector_bytes(view)
                                  : view_vector_bytes(view, {a.q}, {a.q_width});
  if (vbytes == 16) return launch_decode<T, DT, kVec>(ex, view, a);
  return launch_decode<T, DT, 1>(ex, view, a);
}

template <class T>
Status dispatch_decode_dim(exec::Cuda ex, const PagedKVView<T>& view, const DecodeArgs<T>& a) {
  const int dim = view.head_dim > view.v_head_dim ? view.head_dim : view.v_head_dim;
  if (dim <= 8) return dispatch_decode_vec<T, 8>(ex, view, a);
  if (dim <= 16) return dispatch_decode_vec<T, 16>(ex, view, a);
  if (dim <= 32) return dispatch_decode_vec<T, 32>(ex, view, a);
  if (dim <= 64) return dispatch_decode_vec<T, 64>(ex, view, a);
  if (dim <= 128) return dispatch_decode_vec<T, 128>(ex, view, a);
  if (dim <= 256) return dispatch_decode_vec<T, 256>(ex, view, a);
  return check_decode_dims(view.head_dim, view.v_head_dim);
}

// Merge of two attention states, one thread per element: out = (e^la a + e^lb b) /
// (e^la + e^lb) with the max subtracted; reads and writes the same index, so out may
// alias out_a or out_b.
template <class T>
__global__ void merge_states_out_kernel(const T* out_a,      // [rows, dim]
                                        const float* lse_a,  // [rows]
                                        const T* out_b,      // [rows, dim]
                                        const float* lse_b,  // [rows]
                                        T* out,              // [rows, dim], may alias a or b
                                        std::int64_t rows, std::int32_t dim) {
  const std::int64_t total = rows * dim;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / dim;
    const float la = lse_a[row], lb = lse_b[row];
    const float mx = fmaxf(la, lb);
    if (mx == -INFINITY) {
      out[i] = store_float<T>(0.f);
    } else if (la == -INFINITY || lb == -INFINITY) {
      out[i] = la == -INFINITY ? out_b[i] : out_a[i];  // the other side, bit for bit
    } else {
      const float wa = expf(la - mx), wb = expf(lb - mx);
      out[i] = store_float<T>((wa * load_float(out_a[i]) + wb * load_float(out_b[i])) / (wa + wb));
    }
  }
}

// The merged lse, one thread per row (after the out kernel: lse may alias lse_a / lse_b).
template <class Unused = void>
__global__ void merge_states_lse_kernel_t(const float* lse_a,  // [rows]
                                          const float* lse_b,  // [rows]
                                          float* lse,          // [rows], may alias either
                                          std::int64_t rows) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < rows;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float la = lse_a[i], lb = lse_b[i];
    const float mx = fmaxf(la, lb);
    lse[i] = mx == -INFINITY ? -INFINITY : mx + logf(expf(la - mx) + expf(lb - mx));
  }
}

}  // namespace cuda_detail

/// Bytes of scratch paged_decode_attention needs on CUDA: the split-K partial states
/// (0 when the shapes give one split per sequence). Depends on batch size, heads and
/// v_head_dim only, never on the (device-resident) sequence lengths or variants.
template <class T>
std::size_t paged_decode_attention_workspace_size(exec::Cuda, const PagedKVView<T>& view,
                                                  const DecodeAttentionParams& p) {
  const int splits = cuda_detail::decode_num_splits(view.batch_size, view.num_kv_heads);
  if (splits <= 1 || view.batch_size <= 0 || p.num_qo_heads <= 0 || view.v_head_dim <= 0) return 0;
  const std::size_t rows = static_cast<std::size_t>(view.batch_size) *
                           static_cast<std::size_t>(p.num_qo_heads) * static_cast<std::size_t>(splits);
  return WorkspaceSizer()
      .add<float>(rows * static_cast<std::size_t>(view.v_head_dim))
      .add<float>(rows)
      .add<float>(rows)
      .bytes();
}

/// Decode attention on `ex.stream`: out[b, hq] = softmax_t(sm_scale * q[b, hq] . K[b, t, kvh])
/// . V[b, t, kvh] over the tokens (b, kvh) reads, kvh = hq / (Hq / Hkv), with the variants
/// of DecodeAttentionParams (page subset, channel-restricted K/V, scores out; they
/// combine freely). Optional lse[b, hq] = natural log of the softmax denominator. A
/// (b, kvh) that reads no token gives out = 0 and lse = -inf. K and V rows of up to 256
/// elements (kUnsupported otherwise). `ws` must hold
/// paged_decode_attention_workspace_size() bytes.
///
/// Contract (same as the CPU twin): scalars on the host (kInvalidArgument for bad
/// num_qo_heads / sm_scale, null q / out, page_subset without page_subset_indptr or the
/// reverse, k_channels / v_channels with q_dim <= 0, scores with scores_stride < 0, a
/// small workspace, a null ex.status). On the device, recorded in *ex.status: every
/// sequence's page table (as gather_tokens); page subsets: indptr negative or not
/// monotone or an entry outside [0, num_pages(b)) (kOutOfRange), an entry not above the
/// previous one or a null page_subset under a non-empty range (kInvalidArgument); channel
/// ids outside [0, q_dim) (kOutOfRange); seq_len(b) > scores_stride (kInvalidArgument).
/// On any error nothing is written (out, lse, scores).
template <class T>
Status paged_decode_attention(exec::Cuda ex, PagedKVView<T> view,
                              const T* q,  // [batch, Hq, q_width] device
                              T* out,      // [batch, Hq, out_width] device
                              const DecodeAttentionParams& p, Workspace ws,
                              float* lse = nullptr) {  // [batch, Hq] device, optional
  constexpr const char* kOp = "paged_decode_attention";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_RETURN_IF_ERROR(detail::check_decode_params(view, p));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_decode_dims(view.head_dim, view.v_head_dim));
  KVKIT_CHECK_STATUS(p.page_subset == nullptr || p.page_subset_indptr != nullptr,
                     StatusCode::kInvalidArgument,
                     "page_subset is set but page_subset_indptr is null");
  const bool channels = p.k_channels != nullptr || p.v_channels != nullptr;
  KVKIT_CHECK_STATUS(!channels || p.q_dim > 0, StatusCode::kInvalidArgument, "q_dim ", p.q_dim,
                     " must be > 0 with k_channels / v_channels");
  KVKIT_CHECK_STATUS(p.scores == nullptr || p.scores_stride >= 0, StatusCode::kInvalidArgument,
                     "scores_stride ", p.scores_stride, " must be >= 0");
  if (view.batch_size == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(q, "q", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(out, "out", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_table_ptrs(view));

  cuda_detail::DecodeArgs<T> a;
  a.q = q;
  a.out = out;
  a.lse = lse;
  a.subset_indptr = p.page_subset_indptr;
  a.subset = p.page_subset;
  a.k_channels = p.k_channels;
  a.v_channels = p.v_channels;
  a.scores = p.scores;
  a.scores_stride = p.scores_stride;
  a.num_qo_heads = p.num_qo_heads;
  a.group_size = p.num_qo_heads / view.num_kv_heads;
  a.q_dim = p.q_dim;
  a.q_width = p.k_channels ? p.q_dim : view.head_dim;
  a.out_width = p.v_channels ? p.q_dim : view.v_head_dim;
  a.q_scale = p.sm_scale * cuda_detail::kLog2e;
  a.num_splits = cuda_detail::decode_num_splits(view.batch_size, view.num_kv_heads);
  a.status = ex.status;
  const std::int64_t rows = static_cast<std::int64_t>(view.batch_size) * p.num_qo_heads;
  if (a.num_splits > 1) {
    const std::size_t need = paged_decode_attention_workspace_size(ex, view, p);
    KVKIT_CHECK_STATUS(ws.data != nullptr && ws.bytes >= need, StatusCode::kInvalidArgument,
                       "paged_decode_attention workspace has ", ws.bytes, " bytes, needs ", need);
    const std::size_t prows = static_cast<std::size_t>(rows) * static_cast<std::size_t>(a.num_splits);
    WorkspaceCarver carver(ws);
    a.part_acc = carver.take<float>(prows * static_cast<std::size_t>(view.v_head_dim));
    a.part_m = carver.take<float>(prows);
    a.part_l = carver.take<float>(prows);
    KVKIT_CHECK_STATUS(a.part_acc && a.part_m && a.part_l, StatusCode::kInvalidArgument,
                       "paged_decode_attention workspace of ", ws.bytes, " bytes is too small");
  }
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));

  cudaStream_t stream = cuda_detail::stream_of(ex);
  const std::int64_t vrows = static_cast<std::int64_t>(view.batch_size) * (p.page_subset_indptr ? view.num_kv_heads : 1);
  const unsigned vgrid = static_cast<unsigned>(vrows < cuda_detail::kMaxCopyBlocks ? vrows : cuda_detail::kMaxCopyBlocks);
  cuda_detail::validate_decode_kernel<T><<<vgrid, cuda_detail::kCopyThreads, 0, stream>>>(view, a);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  if (p.v_channels != nullptr) {  // channels V does not cover are 0
    const std::int64_t n = rows * a.out_width;
    cuda_detail::fill_kernel<T><<<cuda_detail::grid_for(n), cuda_detail::kCopyThreads, 0, stream>>>(
        out, n, from_float<T>(0.f), ex.status);
    KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  }
  if (p.scores != nullptr && p.page_subset_indptr != nullptr && p.scores_stride > 0) {
    cuda_detail::fill_scores_kernel<T>
        <<<cuda_detail::grid_for(rows * p.scores_stride), cuda_detail::kCopyThreads, 0, stream>>>(
            view, a);
    KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  }
  KVKIT_RETURN_IF_ERROR(cuda_detail::dispatch_decode_dim(ex, view, a));
  if (a.num_splits > 1) {
    cuda_detail::decode_combine_kernel<T>
        <<<cuda_detail::grid_for(rows * view.v_head_dim), cuda_detail::kCopyThreads, 0, stream>>>(
            a, rows, view.v_head_dim);
    return cuda_detail::launch_status(kOp);
  }
  return Status::ok();
}

/// Merges two attention states over the same rows on `ex.stream` (e.g. a packed old part
/// and a full-width recent window): out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a +
/// e^lse_b), computed with the larger lse subtracted; lse = log(e^lse_a + e^lse_b). A
/// side with lse -inf (nothing read) drops out; both -inf give out = 0, lse = -inf.
/// A side with lse -inf is copied bit for bit. out may alias out_a or out_b and lse may
/// alias lse_a or lse_b. Reads no index, so it needs no DeviceStatus; kInvalidArgument
/// for rows < 0, dim < 0 or null inputs (as the CPU twin).
template <class T>
Status merge_attention_states(exec::Cuda ex,
                              const T* out_a,      // [rows, dim] device
                              const float* lse_a,  // [rows] device
                              const T* out_b,      // [rows, dim] device
                              const float* lse_b,  // [rows] device
                              T* out,              // [rows, dim] device
                              float* lse,          // [rows] device, or nullptr
                              std::int64_t rows, std::int32_t dim) {
  constexpr const char* kOp = "merge_attention_states";
  KVKIT_CHECK_STATUS(rows >= 0 && dim >= 0, StatusCode::kInvalidArgument, kOp,
                     " needs rows >= 0 and dim >= 0, got rows=", rows, " dim=", dim);
  if (rows == 0) return Status::ok();
  KVKIT_CHECK_STATUS(out_a != nullptr && lse_a != nullptr && out_b != nullptr &&
                         lse_b != nullptr && (out != nullptr || dim == 0),
                     StatusCode::kInvalidArgument, kOp, " got a null input or output");
  cudaStream_t stream = cuda_detail::stream_of(ex);
  if (dim > 0) {
    cuda_detail::merge_states_out_kernel<T>
        <<<cuda_detail::grid_for(rows * dim), cuda_detail::kCopyThreads, 0, stream>>>(
            out_a, lse_a, out_b, lse_b, out, rows, dim);
    KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  }
  if (lse != nullptr) {
    cuda_detail::merge_states_lse_kernel_t<>
        <<<cuda_detail::grid_for(rows), cuda_detail::kCopyThreads, 0, stream>>>(lse_a, lse_b, lse,
                                                                                 rows);
    return cuda_detail::launch_status(kOp);
  }
  return Status::ok();
}

}  // namespace kvkit
