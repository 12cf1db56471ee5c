#pragma once
// kvchan's low-precision residual on CUDA: twins of channel/residual.hpp's
// pack_residual_pages, unpack_residual_pages and residual_channel_attention (same
// signatures with exec::Cuda; device pointers everywhere, the ResidualView's too).
//
// Packing and unpacking give the CPU twin's bytes bit for bit: one thread per (token,
// head, K or V) row walks its dropped dims in ascending order as the CPU does, with the
// same float arithmetic (IEEE division, rintf = round half to even, no FMA in play).
// Attention runs one thread per (sequence, query head) over its tokens in order (selected
// sum, residual sum, online softmax per token); the CPU twin computes the same formula with
// the scale folded into the codes and its maximum updated per block of 16 tokens, so the
// two agree to float rounding. A correctness twin, not a tuned kernel (it has not run on a
// GPU yet; the parity test runs where one is present).
//
// Errors: the host checks of the CPU twin return at once; bad page or channel ids (and
// bad page tables for attention) are recorded in *ex.status by a validation kernel, and
// the main kernel, queued behind it, then writes nothing. No allocation, no host sync.

#include <cstdint>

#include "kvkit/channel/residual.hpp"
#include "kvkit/kernels/cuda/common.cuh"
#include "kvkit/kernels/cuda/kvchan_pack.cuh"

namespace kvkit {
namespace cuda_detail {

// The residual of one row: x [dim] with ascending set ch [r]; codes and *scale as the CPU.
template <class T>
KVKIT_DEVICE void quantize_row_dev(const T* x, const std::int32_t* ch, std::int32_t r, std::int32_t dim,
                                   std::int32_t bits, std::uint8_t* codes, float* scale) {
  float amax = 0.f;
  for (std::int32_t d = 0, c = 0; d < dim; ++d) {
    if (c < r && ch[c] == d) {
      ++c;
      continue;
    }
    amax = fmaxf(amax, fabsf(load_float(x[d])));
  }
  const std::int32_t qmax = channel::detail::residual_qmax(bits);
  const float s = __fdiv_rn(amax, static_cast<float>(qmax));
  *scale = s;
  const std::int32_t nbytes = channel::residual_code_bytes(dim - r, bits);
  for (std::int32_t i = 0; i < nbytes; ++i) codes[i] = 0;
  if (s == 0.f) return;
  for (std::int32_t d = 0, c = 0, j = 0; d < dim; ++d) {
    if (c < r && ch[c] == d) {
      ++c;
      continue;
    }
    const float v = rintf(__fdiv_rn(load_float(x[d]), s));
    const std::int32_t q = static_cast<std::int32_t>(fminf(fmaxf(v, -static_cast<float>(qmax)), static_cast<float>(qmax)));
    if (bits == 8)
      codes[j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q));
    else
      codes[j >> 1] = static_cast<std::uint8_t>(codes[j >> 1] | ((q & 0xF) << ((j & 1) * 4)));
    ++j;
  }
}

// One thread per (token, head, K or V) row.
template <class T>
__global__ void kvchan_residual_pack_kernel(PagedKVView<T> full, channel::ResidualView res,
                                            const std::int32_t* __restrict__ k_channels,  // [heads, rk]
                                            const std::int32_t* __restrict__ v_channels,  // [heads, rv]
                                            std::int32_t rk, std::int32_t rv,
                                            const std::int32_t* __restrict__ src_pages,  // [n_pages]
                                            const std::int32_t* __restrict__ dst_pages,  // [n_pages]
                                            std::int32_t n_tokens, const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t H = full.num_kv_heads, P = full.page_size;
  const std::int64_t total = static_cast<std::int64_t>(n_tokens) * H * 2;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t which = static_cast<std::int32_t>(i & 1);
    const std::int64_t th = i >> 1;
    const std::int32_t t = static_cast<std::int32_t>(th / H), h = static_cast<std::int32_t>(th % H);
    const std::int32_t src = src_pages[t / P], dst = dst_pages[t / P], s = t % P;
    if (which == 0)
      quantize_row_dev(full.k_data + full.k_offset(src, s, h), k_channels + static_cast<std::int64_t>(h) * rk, rk,
                       full.head_dim, res.bits, res.k_row(dst, s, h), res.k_scale(dst, s, h));
    else
      quantize_row_dev(full.v_data + full.v_offset(src, s, h), v_channels + static_cast<std::int64_t>(h) * rv, rv,
                       full.v_head_dim, res.bits, res.v_row(dst, s, h), res.v_scale(dst, s, h));
  }
}

// One thread per full-width element; only dropped dims are written.
template <class T>
__global__ void kvchan_residual_unpack_kernel(channel::ResidualView res, PagedKVView<T> full,
                                              const std::int32_t* __restrict__ k_channels,  // [heads, rk]
                                              const std::int32_t* __restrict__ v_channels,  // [heads, rv]
                                              std::int32_t rk, std::int32_t rv,
                                              const std::int32_t* __restrict__ src_pages,  // [n_pages]
                                              const std::int32_t* __restrict__ dst_pages,  // [n_pages]
                                              std::int32_t n_tokens, const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t H = full.num_kv_heads, D = full.head_dim, Dv = full.v_head_dim, P = full.page_size;
  const std::int32_t per_row = D + Dv;
  const std::int64_t total = static_cast<std::int64_t>(n_tokens) * H * per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t th = i / per_row;
    const std::int32_t e = static_cast<std::int32_t>(i - th * per_row);
    const std::int32_t t = static_cast<std::int32_t>(th / H), h = static_cast<std::int32_t>(th % H);
    const std::int32_t src = src_pages[t / P], dst = dst_pages[t / P], s = t % P;
    const bool k = e < D;
    const std::int32_t d = k ? e : e - D, r = k ? rk : rv;
    const std::int32_t* ch = (k ? k_channels : v_channels) + static_cast<std::int64_t>(h) * r;
    const std::int32_t below = count_below(ch, r, d);
    if (below < r && ch[below] == d) continue;  // a selected dim: unpack_channel_pages writes it
    const std::uint8_t* codes = k ? res.k_row(src, s, h) : res.v_row(src, s, h);
    const float v = *(k ? res.k_scale(src, s, h) : res.v_scale(src, s, h)) *
                    static_cast<float>(channel::detail::residual_code(codes, d - below, res.bits));
    if (k)
      full.k_data[full.k_offset(dst, s, h) + d] = store_float<T>(v);
    else
      full.v_data[full.v_offset(dst, s, h) + d] = store_float<T>(v);
  }
}

// Page tables of `old`: one block per sequence, as the decode kernel's validation.
template <class T>
__global__ void kvchan_residual_table_kernel(PagedKVView<T> old, DeviceStatus* st) {
  for (std::int32_t b = blockIdx.x; b < old.batch_size; b += gridDim.x)
    (void)check_sequence_pages_dev(old, b, st, threadIdx.x == 0, threadIdx.x, blockDim.x);
}

// One thread per (sequence, query head): the CPU twin's loops.
template <class T>
__global__ void kvchan_residual_attention_kernel(PagedKVView<T> old, channel::ResidualView res,
                                                 const T* __restrict__ q,  // [batch, Hq, q_dim]
                                                 T* __restrict__ out,      // [batch, Hq, q_dim]
                                                 float* __restrict__ lse,  // [batch, Hq]
                                                 const std::int32_t* __restrict__ k_channels,  // [Hkv, rk] or null
                                                 const std::int32_t* __restrict__ v_channels,  // [Hkv, rv] or null
                                                 std::int32_t Hq, std::int32_t q_dim, float sm_scale,
                                                 const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t H = old.num_kv_heads, G = Hq / H, rk = old.head_dim, rv = old.v_head_dim;
  const std::int64_t rows = static_cast<std::int64_t>(old.batch_size) * Hq;
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(r / Hq), hq = static_cast<std::int32_t>(r % Hq), h = hq / G;
    const std::int32_t* ks = k_channels != nullptr ? k_channels + static_cast<std::int64_t>(h) * rk : nullptr;
    const std::int32_t* vs = v_channels != nullptr ? v_channels + static_cast<std::int64_t>(h) * rv : nullptr;
    const T* qr = q + r * q_dim;
    float acc[channel::kMaxResidualDim];
    for (std::int32_t d = 0; d < q_dim; ++d) acc[d] = 0.f;
    float m = -INFINITY, l = 0.f;
    const std::int32_t n = old.seq_len(b);
    for (std::int32_t t = 0; t < n; ++t) {
      const std::int32_t page = old.page_id(b, t / old.page_size), slot = t % old.page_size;
      const T* kr = old.k_data + old.k_offset(page, slot, h);
      const T* vr = old.v_data + old.v_offset(page, slot, h);
      const std::uint8_t* kc = res.k_row(page, slot, h);
      const std::uint8_t* vc = res.v_row(page, slot, h);
      float sel = 0.f, drop = 0.f;
      for (std::int32_t c = 0; c < rk; ++c) sel += sm_scale * load_float(qr[ks != nullptr ? ks[c] : c]) * load_float(kr[c]);
      for (std::int32_t d = 0, c = 0, j = 0; d < q_dim && rk < q_dim; ++d) {
        if (c < rk && ks[c] == d) {
          ++c;
          continue;
        }
        drop += sm_scale * load_float(qr[d]) * static_cast<float>(channel::detail::residual_code(kc, j++, res.bits));
      }
      const float s = sel + *res.k_scale(page, slot, h) * drop;
      if (s > m) {
        const float a = m == -INFINITY ? 0.f : expf(m - s);
        l *= a;
        for (std::int32_t d = 0; d < q_dim; ++d) acc[d] *= a;
        m = s;
      }
      const float w = expf(s - m);
      l += w;
      const float vsc = *res.v_scale(page, slot, h);
      for (std::int32_t d = 0, c = 0, j = 0; d < q_dim; ++d) {
        float v;
        if (vs == nullptr) {
          v = load_float(vr[d]);
        } else if (c < rv && vs[c] == d) {
          v = load_float(vr[c++]);
        } else {
          v = vsc * static_cast<float>(channel::detail::residual_code(vc, j++, res.bits));
        }
        acc[d] += w * v;
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (std::int32_t d = 0; d < q_dim; ++d) out[r * q_dim + d] = store_float<T>(acc[d] * inv);
    lse[r] = l > 0.f ? m + logf(l) : -INFINITY;
  }
}

}  // namespace cuda_detail

namespace channel {

/// CUDA twin of pack_residual_pages (channel/residual.hpp): same arguments, device
/// pointers, on ex.stream; bytes equal to the CPU twin's.
template <class T>
Status pack_residual_pages(exec::Cuda ex, PagedKVView<T> full, ResidualView res,
                           const std::int32_t* k_channels,  // [Hkv, rk] device, ascending
                           const std::int32_t* v_channels,  // [Hkv, rv] device, ascending
                           std::int32_t rk, std::int32_t rv,
                           const std::int32_t* src_pages,   // [n_pages] device, pages of `full`
                           const std::int32_t* dst_pages,   // [n_pages] device, residual pages, distinct
                           std::int32_t n_pages, std::int32_t n_tokens) {
  constexpr const char* kOp = "pack_residual_pages";
  KVKIT_RETURN_IF_ERROR(detail::check_residual_pages_args(ex, full, res, rk, rv, n_pages, n_tokens, kOp));
  const std::int32_t H = full.num_kv_heads, D = full.head_dim, Dv = full.v_head_dim;
  if (n_pages == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::launch_channel_checks(ex, k_channels, v_channels, H, rk, rv, D, Dv, src_pages,
                                                  dst_pages, n_pages, full.num_pages_total, res.num_pages_total,
                                                  kOp));
  const std::int64_t items = static_cast<std::int64_t>(n_tokens) * H * 2;
  cuda_detail::kvchan_residual_pack_kernel<T><<<cuda_detail::grid_for(items), cuda_detail::kCopyThreads, 0,
                                                cuda_detail::stream_of(ex)>>>(
      full, res, k_channels, v_channels, rk, rv, src_pages, dst_pages, n_tokens, ex.status);
  return cuda_detail::launch_status(kOp);
}

/// CUDA twin of unpack_residual_pages (channel/residual.hpp).
template <class T>
Status unpack_residual_pages(exec::Cuda ex, ResidualView res, PagedKVView<T> full,
                             const std::int32_t* k_channels,  // [Hkv, rk] device, ascending
                             const std::int32_t* v_channels,  // [Hkv, rv] device, ascending
                             std::int32_t rk, std::int32_t rv,
                             const std::int32_t* src_pages,   // [n_pages] device, residual pages
                             const std::int32_t* dst_pages,   // [n_pages] device, pages of `full`, distinct
                             std::int32_t n_pages, std::int32_t n_tokens) {
  constexpr const char* kOp = "unpack_residual_pages";
  KVKIT_RETURN_IF_ERROR(detail::check_residual_pages_args(ex, full, res, rk, rv, n_pages, n_tokens, kOp));
  const std::int32_t H = full.num_kv_heads, D = full.head_dim, Dv = full.v_head_dim;
  if (n_pages == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::launch_channel_checks(ex, k_channels, v_channels, H, rk, rv, D, Dv, src_pages,
                                                  dst_pages, n_pages, res.num_pages_total, full.num_pages_total,
                                                  kOp));
  const std::int64_t items = static_cast<std::int64_t>(n_tokens) * H * (D + Dv);
  cuda_detail::kvchan_residual_unpack_kernel<T><<<cuda_detail::grid_for(items), cuda_detail::kCopyThreads, 0,
                                                  cuda_detail::stream_of(ex)>>>(
      res, full, k_channels, v_channels, rk, rv, src_pages, dst_pages, n_tokens, ex.status);
  return cuda_detail::launch_status(kOp);
}

/// CUDA twin of residual_channel_attention (channel/residual.hpp): q, out, lse, the
/// view's tables and the channel sets on the device.
template <class T>
Status residual_channel_attention(exec::Cuda ex, const PagedKVView<T>& old, ResidualView res,
                                  const T* q,    // [batch, Hq, q_dim] device
                                  T* out,        // [batch, Hq, q_dim] device
                                  float* lse,    // [batch, Hq] device
                                  const DecodeAttentionParams& p) {
  constexpr const char* kOp = "residual_channel_attention";
  KVKIT_RETURN_IF_ERROR(detail::check_residual_attention_args(ex, old, res, q, out, lse, p, kOp));
  const std::int32_t H = old.num_kv_heads, B = old.batch_size, Dq = p.q_dim;
  const std::int32_t rk = old.head_dim, rv = old.v_head_dim;
  if (B == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::launch_channel_checks(ex, p.k_channels, p.v_channels, H,
                                                  p.k_channels != nullptr ? rk : 0, p.v_channels != nullptr ? rv : 0,
                                                  Dq, Dq, nullptr, nullptr, 0, 1, 1, kOp));
  cuda_detail::kvchan_residual_table_kernel<T><<<B < 1024 ? B : 1024, 128, 0, cuda_detail::stream_of(ex)>>>(
      old, ex.status);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  const std::int64_t rows = static_cast<std::int64_t>(B) * p.num_qo_heads;
  cuda_detail::kvchan_residual_attention_kernel<T><<<cuda_detail::grid_for(rows, 64), 64, 0,
                                                     cuda_detail::stream_of(ex)>>>(
      old, res, q, out, lse, p.k_channels, p.v_channels, p.num_qo_heads, Dq, p.sm_scale, ex.status);
  return cuda_detail::launch_status(kOp);
}

}  // namespace channel
}  // namespace kvkit
