#pragma once
// Paged decode attention on CUDA: one query token per sequence against all its cached
// tokens, GQA, float accumulation, online softmax. Twin of kernels/cpu/attention.hpp.
//
// Work split: a block owns (sequence b, kv head, GB query heads of that kv head, split s)
// so each K/V row is loaded once for GB query heads. Within the block, "token groups" of
// TG lanes each hold one token's K/V row (VEC elements per lane per vector load) and keep
// an online-softmax state (max, sum, unnormalised output slice) per query head; groups
// are merged by warp shuffles, warps through shared memory. Long sequences are cut into
// up to kMaxSplits chunks run by separate blocks (split-K); their partial states go to
// the workspace and a second kernel merges them. Scores are kept in the log2 domain
// (q pre-scaled by sm_scale * log2(e)) so exponentials are exp2f.

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
inline constexpr int kMaxSplits = 16;
/// Blocks per launch the split heuristic aims for (about two per SM of an H100/H200).
inline constexpr int kTargetBlocks = 264;
/// Shortest chunk worth its own block; shorter sequences use fewer splits.
inline constexpr int kMinSplitTokens = 256;
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
template <int D, int GB>
struct DecodeSmem {
  float m[kAttnWarps][GB];
  float l[kAttnWarps][GB];
  float acc[kAttnWarps][GB][D];
};

template <class T, int D, int VEC, int GB>
__global__ void __launch_bounds__(kAttnThreads)
    decode_attention_kernel(PagedKVView<T> view,
                            const T* __restrict__ q,        // [batch, Hq, D]
                            T* __restrict__ out,            // [batch, Hq, D]
                            float* __restrict__ lse,        // [batch, Hq] or null
                            float* __restrict__ part_acc,   // [batch, Hq, S, D] when S > 1
                            float* __restrict__ part_m,     // [batch, Hq, S] when S > 1
                            float* __restrict__ part_l,     // [batch, Hq, S] when S > 1
                            std::int32_t num_qo_heads, std::int32_t group_size,
                            float q_scale, std::int32_t num_splits) {
  constexpr int kChunks = D / VEC;                  // vectors per row
  constexpr int TG = kChunks < 32 ? kChunks : 32;   // lanes per token group
  constexpr int NV = kChunks / TG;                  // vectors per lane
  constexpr int GPW = 32 / TG;                      // token groups per warp
  constexpr int E = NV * VEC;                       // row elements per lane
  static_assert(kChunks * VEC == D && NV * TG == kChunks && GPW * TG == 32, "tiling");
  __shared__ DecodeSmem<D, GB> sm;

  const std::int32_t b = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t blocks_per_kv = group_size / GB;
  const std::int32_t kvh = static_cast<std::int32_t>(blockIdx.y) / blocks_per_kv;
  const std::int32_t hq0 = kvh * group_size + (static_cast<std::int32_t>(blockIdx.y) % blocks_per_kv) * GB;
  const std::int32_t split = static_cast<std::int32_t>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int lig = lane % TG;  // lane in its token group

  // This block's token range [t_begin, t_end).
  const std::int32_t len = view.seq_len(b);
  std::int64_t chunk = (static_cast<std::int64_t>(len) + num_splits - 1) / num_splits;
  if (chunk < kMinSplitTokens) chunk = kMinSplitTokens;
  const std::int64_t tb = split * chunk;
  const std::int32_t t_begin = static_cast<std::int32_t>(tb < len ? tb : len);
  const std::int32_t t_end = static_cast<std::int32_t>(tb + chunk < len ? tb + chunk : len);

  // Lane's slice of each query row: elements (v * TG + lig) * VEC + [0, VEC).
  float qv[GB][E];
#pragma unroll
  for (int g = 0; g < GB; ++g) {
    const T* qrow = q + (static_cast<std::int64_t>(b) * num_qo_heads + hq0 + g) * D;
#pragma unroll
    for (int v = 0; v < NV; ++v) load_vec_float<T, VEC>(qrow + (v * TG + lig) * VEC, &qv[g][v * VEC]);
#pragma unroll
    for (int e = 0; e < E; ++e) qv[g][e] *= q_scale;
  }
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
  for (std::int32_t base = t_begin + warp * kWarpTokens; base < t_end;
       base += kAttnWarps * kWarpTokens) {
    float kf[kUnroll][E], vf[kUnroll][E];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int32_t t = base + u * GPW + lane / TG;
      std::int32_t page = -1;
      if (t < t_end) {
        page = view.page_id(b, t / view.page_size);
        if (page >= view.num_pages_total) page = -1;  // bad device entry: skip the token
      }
      valid[u] = page >= 0;
      if (valid[u]) {
        const std::int32_t slot = t % view.page_size;
        const T* krow = view.k_data + view.k_offset(page, slot, kvh);
        const T* vrow = view.v_data + view.v_offset(page, slot, kvh);
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          load_vec_float<T, VEC>(krow + (v * TG + lig) * VEC, &kf[u][v * VEC]);
          load_vec_float<T, VEC>(vrow + (v * TG + lig) * VEC, &vf[u][v * VEC]);
        }
      } else {
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
          const float mn = fmaxf(m[g], s);
          const float c = exp2f(m[g] - mn);  // 0 on the group's first token (m = -inf)
          const float p = exp2f(s - mn);
          l[g] = l[g] * c + p;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, vf[u][e], acc[g][e] * c);
          m[g] = mn;
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
  for (int idx = static_cast<int>(threadIdx.x); idx < GB * D; idx += kAttnThreads) {
    const int g = idx / D;
    const int d = idx - g * D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mm = fmaxf(mm, sm.m[w][g]);
    float ls = 0.f, a = 0.f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float c = exp2f(sm.m[w][g] - mm);
        ls += sm.l[w][g] * c;
        a += sm.acc[w][g][d] * c;
      }
    }
    const std::int64_t row = static_cast<std::int64_t>(b) * num_qo_heads + hq0 + g;
    if (num_splits == 1) {
      out[row * D + d] = store_float<T>(ls > 0.f ? a / ls : 0.f);
      if (lse != nullptr && d == 0) lse[row] = ls > 0.f ? (mm + log2f(ls)) * kLn2 : -INFINITY;
    } else {
      const std::int64_t prow = row * num_splits + split;
      part_acc[prow * D + d] = a;
      if (d == 0) {
        part_m[prow] = mm;
        part_l[prow] = ls;
      }
    }
  }
}

// Merges the S partial states of each (b, query head); one thread per output element.
template <class T>
__global__ void decode_combine_kernel(const float* __restrict__ part_acc,  // [rows, S, D]
                                      const float* __restrict__ part_m,    // [rows, S]
                                      const float* __restrict__ part_l,    // [rows, S]
                                      std::int64_t rows, std::int32_t num_splits, std::int32_t head_dim,
                                      T* __restrict__ out,      // [rows, D]
                                      float* __restrict__ lse) {  // [rows] or null
  const std::int64_t total = rows * head_dim;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / head_dim;
    const std::int32_t d = static_cast<std::int32_t>(i - row * head_dim);
    const float* pm = part_m + row * num_splits;
    const float* pl = part_l + row * num_splits;
    float mm = -INFINITY;
    for (int s = 0; s < num_splits; ++s) mm = fmaxf(mm, pm[s]);
    float ls = 0.f, a = 0.f;
    if (mm != -INFINITY) {
      for (int s = 0; s < num_splits; ++s) {
        const float c = exp2f(pm[s] - mm);
        ls += pl[s] * c;
        a += part_acc[(row * num_splits + s) * head_dim + d] * c;
      }
    }
    out[i] = store_float<T>(ls > 0.f ? a / ls : 0.f);
    if (lse != nullptr && d == 0) lse[row] = ls > 0.f ? (mm + log2f(ls)) * kLn2 : -INFINITY;
  }
}

/// The head dims with a compiled kernel; others are kUnsupported, naming the value.
inline Status check_decode_head_dim(int hd) {
  KVKIT_CHECK_STATUS(hd == 8 || hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256,
                     StatusCode::kUnsupported, "unsupported head_dim ", hd,
                     " (CUDA decode attention supports 8, 16, 32, 64, 128, 256)");
  return Status::ok();
}

// Split-K scratch carved from the workspace (all null when num_splits == 1).
struct DecodeLaunch {
  float* part_acc = nullptr;  // [batch, Hq, num_splits, D]
  float* part_m = nullptr;    // [batch, Hq, num_splits]
  float* part_l = nullptr;    // [batch, Hq, num_splits]
  int num_splits = 1;
};

// Picks the query-head batch GB (largest of 4/2/1 dividing the group) and launches. More
// than 4 query heads per block costs more registers (lower occupancy) than the extra K/V
// reads it saves; those mostly hit L2 anyway.
template <class T, int D, int VEC>
Status launch_decode(exec::Cuda ex, const PagedKVView<T>& view,
                     const T* q,    // [batch, Hq, D] device
                     T* out,        // [batch, Hq, D] device
                     float* lse,    // [batch, Hq] device or null
                     const DecodeAttentionParams& p, const DecodeLaunch& dl) {
  const std::int32_t group = p.num_qo_heads / view.num_kv_heads;
  auto go = [&](auto gb) {
    constexpr int kGB = decltype(gb)::value;
    const dim3 grid(static_cast<unsigned>(view.batch_size),
                    static_cast<unsigned>(p.num_qo_heads / kGB), static_cast<unsigned>(dl.num_splits));
    KVKIT_CHECK_STATUS(grid.y <= 65535u, StatusCode::kUnsupported, "num_qo_heads ", p.num_qo_heads,
                       " needs ", grid.y, " blocks in grid y (max 65535)");
    decode_attention_kernel<T, D, VEC, kGB><<<grid, kAttnThreads, 0, stream_of(ex)>>>(
        view, q, out, lse, dl.part_acc, dl.part_m, dl.part_l, p.num_qo_heads, group,
        p.sm_scale * kLog2e, dl.num_splits);
    return launch_status("paged_decode_attention");
  };
  // The unaligned fallback (VEC == 1) is rare; keep it to one instantiation per D.
  if constexpr (VEC > 1) {
    if (group % 4 == 0) return go(std::integral_constant<int, 4>{});
    if (group % 2 == 0) return go(std::integral_constant<int, 2>{});
  }
  return go(std::integral_constant<int, 1>{});
}

template <class T, int D>
Status dispatch_decode_vec(exec::Cuda ex, const PagedKVView<T>& view,
                           const T* q,    // [batch, Hq, D] device
                           T* out,        // [batch, Hq, D] device
                           float* lse,    // [batch, Hq] device or null
                           const DecodeAttentionParams& p, const DecodeLaunch& dl) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  if (view_vector_bytes(view, {q, out}) == 16)
    return launch_decode<T, D, kVec>(ex, view, q, out, lse, p, dl);
  return launch_decode<T, D, 1>(ex, view, q, out, lse, p, dl);
}

template <class T>
Status dispatch_decode_head_dim(exec::Cuda ex, const PagedKVView<T>& view,
                                const T* q,    // [batch, Hq, D] device
                                T* out,        // [batch, Hq, D] device
                                float* lse,    // [batch, Hq] device or null
                                const DecodeAttentionParams& p, const DecodeLaunch& dl) {
  switch (view.head_dim) {
    case 8: return dispatch_decode_vec<T, 8>(ex, view, q, out, lse, p, dl);
    case 16: return dispatch_decode_vec<T, 16>(ex, view, q, out, lse, p, dl);
    case 32: return dispatch_decode_vec<T, 32>(ex, view, q, out, lse, p, dl);
    case 64: return dispatch_decode_vec<T, 64>(ex, view, q, out, lse, p, dl);
    case 128: return dispatch_decode_vec<T, 128>(ex, view, q, out, lse, p, dl);
    case 256: return dispatch_decode_vec<T, 256>(ex, view, q, out, lse, p, dl);
    default: return check_decode_head_dim(view.head_dim);
  }
}

}  // namespace cuda_detail

/// Bytes of scratch paged_decode_attention needs on CUDA: the split-K partial states
/// (0 when the shapes give one split per sequence). Depends on batch size, heads and
/// head_dim only, never on the (device-resident) sequence lengths.
template <class T>
std::size_t paged_decode_attention_workspace_size(exec::Cuda, const PagedKVView<T>& view,
                                                  const DecodeAttentionParams& p) {
  const int splits = cuda_detail::decode_num_splits(view.batch_size, view.num_kv_heads);
  if (splits <= 1 || view.batch_size <= 0 || p.num_qo_heads <= 0 || view.head_dim <= 0) return 0;
  const std::size_t rows = static_cast<std::size_t>(view.batch_size) *
                           static_cast<std::size_t>(p.num_qo_heads) * static_cast<std::size_t>(splits);
  return WorkspaceSizer()
      .add<float>(rows * static_cast<std::size_t>(view.head_dim))
      .add<float>(rows)
      .add<float>(rows)
      .bytes();
}

/// Decode attention on `ex.stream`: out[b, hq] = softmax_t(sm_scale * q[b, hq] . K[b, t, kvh])
/// . V[b, t, kvh] over the view.seq_len(b) cached tokens of sequence b, kvh = hq / (Hq / Hkv).
/// Optional lse[b, hq] = natural log of the softmax denominator. An empty sequence gives
/// out = 0 and lse = -inf. head_dim must be 8, 16, 32, 64, 128 or 256 (kUnsupported
/// otherwise). `ws` must hold paged_decode_attention_workspace_size() bytes. Tokens on
/// page ids outside the pool (a corrupt device table) are skipped, never read.
template <class T>
Status paged_decode_attention(exec::Cuda ex, PagedKVView<T> view,
                              const T* q,   // [batch, Hq, D] device
                              T* out,       // [batch, Hq, D] device
                              const DecodeAttentionParams& p, Workspace ws,
                              float* lse = nullptr) {  // [batch, Hq] device, optional
  constexpr const char* kOp = "paged_decode_attention";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_RETURN_IF_ERROR(detail::check_decode_params(view, p));
  const int hd = view.head_dim;
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_decode_head_dim(hd));
  if (view.batch_size == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(q, "q", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(out, "out", kOp));

  cuda_detail::DecodeLaunch dl;
  dl.num_splits = cuda_detail::decode_num_splits(view.batch_size, view.num_kv_heads);
  if (dl.num_splits > 1) {
    const std::size_t need = paged_decode_attention_workspace_size(ex, view, p);
    KVKIT_CHECK_STATUS(ws.data != nullptr && ws.bytes >= need, StatusCode::kInvalidArgument,
                       "paged_decode_attention workspace has ", ws.bytes, " bytes, needs ", need);
    const std::size_t rows = static_cast<std::size_t>(view.batch_size) *
                             static_cast<std::size_t>(p.num_qo_heads) *
                             static_cast<std::size_t>(dl.num_splits);
    WorkspaceCarver carver(ws);
    dl.part_acc = carver.take<float>(rows * static_cast<std::size_t>(hd));
    dl.part_m = carver.take<float>(rows);
    dl.part_l = carver.take<float>(rows);
    KVKIT_CHECK_STATUS(dl.part_acc && dl.part_m && dl.part_l, StatusCode::kInvalidArgument,
                       "paged_decode_attention workspace of ", ws.bytes, " bytes is too small");
  }

  KVKIT_RETURN_IF_ERROR(cuda_detail::dispatch_decode_head_dim(ex, view, q, out, lse, p, dl));
  if (dl.num_splits > 1) {
    const std::int64_t rows = static_cast<std::int64_t>(view.batch_size) * p.num_qo_heads;
    cuda_detail::decode_combine_kernel<T>
        <<<cuda_detail::grid_for(rows * hd), cuda_detail::kCopyThreads, 0, cuda_detail::stream_of(ex)>>>(
            dl.part_acc, dl.part_m, dl.part_l, rows, dl.num_splits, hd, out, lse);
    return cuda_detail::launch_status(kOp);
  }
  return Status::ok();
}

}  // namespace kvkit
