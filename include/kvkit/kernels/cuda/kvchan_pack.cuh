#pragma once
// kvchan's pack / unpack of whole pages on CUDA. Twin of channel/pack_pages.hpp (same
// signatures with exec::Cuda, same results bit for bit: element copies, and the fill
// rounds to nearest even as from_float does).
//
// A validation kernel checks the page ids and the channel sets first and records the
// first bad entry in *ex.status (kInvalidArgument, the CPU twin's message); the main
// kernel, queued behind it, returns at once when the status holds an error, so a failed
// call writes nothing. Each thread writes one output element: packing gathers
// full[k_channels[h, c]] into packed[c]; unpacking finds d in the head's ascending set by
// binary search (its packed element, or the fill). No allocation, no host
// synchronisation; everything runs on ex.stream.

#include <cstdint>

#include "kvkit/channel/pack_pages.hpp"
#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// Page ids of the pairs in range, channel ids in range and strictly ascending per head.
template <class Unused = void>
__global__ void kvchan_pack_check_kernel(const std::int32_t* __restrict__ k_channels,  // [heads, rk]
                                         const std::int32_t* __restrict__ v_channels,  // [heads, rv]
                                         std::int32_t heads, std::int32_t rk, std::int32_t rv,
                                         std::int32_t k_dim, std::int32_t v_dim,
                                         const std::int32_t* __restrict__ src_pages,  // [n_pages]
                                         const std::int32_t* __restrict__ dst_pages,  // [n_pages]
                                         std::int32_t n_pages, std::int32_t src_total,
                                         std::int32_t dst_total, DeviceStatus* st) {
  if (failed(st)) return;
  const std::int64_t nk = static_cast<std::int64_t>(heads) * rk;
  const std::int64_t total = n_pages + nk + static_cast<std::int64_t>(heads) * rv;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (i < n_pages) {
      const std::int32_t s = src_pages[i], d = dst_pages[i];
      if (s < 0 || s >= src_total)
        report(st, StatusCode::kInvalidArgument, DeviceCheck::kSrcPage, s, i, -1, src_total);
      if (d < 0 || d >= dst_total)
        report(st, StatusCode::kInvalidArgument, DeviceCheck::kDstPage, d, i, -1, dst_total);
      continue;
    }
    const bool is_k = i - n_pages < nk;
    const std::int64_t j = is_k ? i - n_pages : i - n_pages - nk;
    const std::int32_t r = is_k ? rk : rv, dim = is_k ? k_dim : v_dim;
    const std::int32_t* ch = is_k ? k_channels : v_channels;
    const std::int32_t x = ch[j], c = static_cast<std::int32_t>(j % r);
    const std::int64_t h = j / r, which = is_k ? 0 : 1;
    // An entry after an out-of-range one is not compared with it: the bad entry reports
    // itself, so one corrupted id gives one report (and the CPU twin's Status), not two
    // racing for the status (found running this kernel on host fibers, run_tests.sh).
    if (x < 0 || x >= dim)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kPackChannel, x, c, which, dim, h);
    else if (c > 0 && x <= ch[j - 1] && ch[j - 1] < dim)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kPackChannelOrder, x, c, which, ch[j - 1], h);
  }
}

// One thread per packed element: items (token, head, c) with c < rk for K, else V.
template <class T>
__global__ void kvchan_pack_kernel(PagedKVView<T> full, PagedKVView<T> packed,
                                   const std::int32_t* __restrict__ k_channels,  // [heads, rk]
                                   const std::int32_t* __restrict__ v_channels,  // [heads, rv]
                                   const std::int32_t* __restrict__ src_pages,   // [n_pages]
                                   const std::int32_t* __restrict__ dst_pages,   // [n_pages]
                                   std::int32_t n_tokens, const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t H = full.num_kv_heads, rk = packed.head_dim, rv = packed.v_head_dim;
  const std::int32_t P = full.page_size, per_row = rk + rv;
  const std::int64_t total = static_cast<std::int64_t>(n_tokens) * H * per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / per_row;
    const std::int32_t c = static_cast<std::int32_t>(i - row * per_row);
    const std::int32_t t = static_cast<std::int32_t>(row / H), h = static_cast<std::int32_t>(row - static_cast<std::int64_t>(t) * H);
    const std::int32_t src = src_pages[t / P], dst = dst_pages[t / P], s = t % P;
    if (c < rk) {
      packed.k_data[packed.k_offset(dst, s, h) + c] =
          full.k_data[full.k_offset(src, s, h) + k_channels[static_cast<std::int64_t>(h) * rk + c]];
    } else {
      const std::int32_t cv = c - rk;
      packed.v_data[packed.v_offset(dst, s, h) + cv] =
          full.v_data[full.v_offset(src, s, h) + v_channels[static_cast<std::int64_t>(h) * rv + cv]];
    }
  }
}

// Number of entries of the ascending set ch[0, r) below d (binary search).
KVKIT_DEVICE std::int32_t count_below(const std::int32_t* ch, std::int32_t r, std::int32_t d) {
  std::int32_t lo = 0, hi = r;
  while (lo < hi) {
    const std::int32_t mid = (lo + hi) / 2;
    if (ch[mid] < d)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Position of d in the ascending set ch[0, r), or -1.
KVKIT_DEVICE std::int32_t find_channel(const std::int32_t* ch, std::int32_t r, std::int32_t d) {
  const std::int32_t lo = count_below(ch, r, d);
  return lo < r && ch[lo] == d ? lo : -1;
}

// One thread per full-width element: items (token, head, d) with d < D for K, else V.
template <class T>
__global__ void kvchan_unpack_kernel(PagedKVView<T> packed, PagedKVView<T> full,
                                     const std::int32_t* __restrict__ k_channels,  // [heads, rk]
                                     const std::int32_t* __restrict__ v_channels,  // [heads, rv]
                                     const float* __restrict__ k_fill,             // [heads, D] or null
                                     const float* __restrict__ v_fill,             // [heads, Dv] or null
                                     const std::int32_t* __restrict__ src_pages,   // [n_pages]
                                     const std::int32_t* __restrict__ dst_pages,   // [n_pages]
                                     std::int32_t n_tokens, const DeviceStatus* st) {
  if (failed(st)) return;
  const std::int32_t H = full.num_kv_heads, rk = packed.head_dim, rv = packed.v_head_dim;
  const std::int32_t D = full.head_dim, Dv = full.v_head_dim, P = full.page_size, per_row = D + Dv;
  const std::int64_t total = static_cast<std::int64_t>(n_tokens) * H * per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / per_row;
    const std::int32_t e = static_cast<std::int32_t>(i - row * per_row);
    const std::int32_t t = static_cast<std::int32_t>(row / H), h = static_cast<std::int32_t>(row - static_cast<std::int64_t>(t) * H);
    const std::int32_t src = src_pages[t / P], dst = dst_pages[t / P], s = t % P;
    if (e < D) {
      const std::int32_t c = find_channel(k_channels + static_cast<std::int64_t>(h) * rk, rk, e);
      full.k_data[full.k_offset(dst, s, h) + e] =
          c >= 0 ? packed.k_data[packed.k_offset(src, s, h) + c]
                 : store_float<T>(k_fill != nullptr ? k_fill[static_cast<std::int64_t>(h) * D + e] : 0.f);
    } else {
      const std::int32_t d = e - D;
      const std::int32_t c = find_channel(v_channels + static_cast<std::int64_t>(h) * rv, rv, d);
      full.v_data[full.v_offset(dst, s, h) + d] =
          c >= 0 ? packed.v_data[packed.v_offset(src, s, h) + c]
                 : store_float<T>(v_fill != nullptr ? v_fill[static_cast<std::int64_t>(h) * Dv + d] : 0.f);
    }
  }
}

}  // namespace cuda_detail

namespace channel {
namespace detail {

// The validation kernel on ex.stream: page ids of the pairs in [0, src_total) /
// [0, dst_total), channel sets of rk / rv ids in [0, k_dim) / [0, v_dim), ascending. Shared
// by pack and unpack and by the residual's kernels (n_pages 0: the sets alone).
inline Status launch_channel_checks(exec::Cuda ex,
                                    const std::int32_t* k_channels,  // [heads, rk] device
                                    const std::int32_t* v_channels,  // [heads, rv] device
                                    std::int32_t heads, std::int32_t rk, std::int32_t rv, std::int32_t k_dim,
                                    std::int32_t v_dim,
                                    const std::int32_t* src_pages,  // [n_pages] device
                                    const std::int32_t* dst_pages,  // [n_pages] device
                                    std::int32_t n_pages, std::int32_t src_total, std::int32_t dst_total,
                                    const char* op) {
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, op));
  const std::int64_t items = n_pages + static_cast<std::int64_t>(heads) * (static_cast<std::int64_t>(rk) + rv);
  cuda_detail::kvchan_pack_check_kernel<><<<cuda_detail::grid_for(items), cuda_detail::kCopyThreads, 0,
                                             cuda_detail::stream_of(ex)>>>(
      k_channels, v_channels, heads, rk, rv, k_dim, v_dim, src_pages, dst_pages, n_pages, src_total, dst_total,
      ex.status);
  return cuda_detail::launch_status(op);
}

// Host checks, then the validation kernel (shared by pack and unpack on CUDA).
template <class T>
Status launch_pack_checks(exec::Cuda ex, const PagedKVView<T>& full, const PagedKVView<T>& packed,
                          const std::int32_t* k_channels,  // [Hkv, rk] device
                          const std::int32_t* v_channels,  // [Hkv, rv] device
                          const std::int32_t* src_pages,   // [n_pages] device
                          const std::int32_t* dst_pages,   // [n_pages] device
                          std::int32_t n_pages, std::int32_t src_total, std::int32_t dst_total,
                          const char* op) {
  return launch_channel_checks(ex, k_channels, v_channels, full.num_kv_heads, packed.head_dim, packed.v_head_dim,
                               full.head_dim, full.v_head_dim, src_pages, dst_pages, n_pages, src_total, dst_total,
                               op);
}

}  // namespace detail

/// CUDA twin of pack_channel_pages (channel/pack_pages.hpp): same arguments, all device
/// pointers, on ex.stream. Host-side errors return at once; bad page or channel ids are
/// recorded in *ex.status (kInvalidArgument) and nothing is written.
template <class T>
Status pack_channel_pages(exec::Cuda ex, PagedKVView<T> full, PagedKVView<T> packed,
                          const std::int32_t* k_channels,  // [Hkv, packed.head_dim] device, ascending
                          const std::int32_t* v_channels,  // [Hkv, packed.v_head_dim] device, ascending
                          const std::int32_t* src_pages,   // [n_pages] device, pages of `full`
                          const std::int32_t* dst_pages,   // [n_pages] device, pages of `packed`, distinct
                          std::int32_t n_pages, std::int32_t n_tokens) {
  constexpr const char* kOp = "pack_channel_pages";
  KVKIT_RETURN_IF_ERROR(detail::check_pack_args(ex, full, packed, k_channels, v_channels, src_pages, dst_pages,
                                                n_pages, n_tokens, kOp));
  if (n_pages == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::launch_pack_checks(ex, full, packed, k_channels, v_channels, src_pages,
                                                   dst_pages, n_pages, full.num_pages_total,
                                                   packed.num_pages_total, kOp));
  const std::int64_t items = static_cast<std::int64_t>(n_tokens) * full.num_kv_heads *
                             (static_cast<std::int64_t>(packed.head_dim) + packed.v_head_dim);
  cuda_detail::kvchan_pack_kernel<T><<<cuda_detail::grid_for(items), cuda_detail::kCopyThreads, 0,
                                       cuda_detail::stream_of(ex)>>>(full, packed, k_channels, v_channels,
                                                                     src_pages, dst_pages, n_tokens, ex.status);
  return cuda_detail::launch_status(kOp);
}

/// CUDA twin of unpack_channel_pages (channel/pack_pages.hpp): same arguments, all device
/// pointers (the fills too), on ex.stream; same error contract as pack_channel_pages.
template <class T>
Status unpack_channel_pages(exec::Cuda ex, PagedKVView<T> packed, PagedKVView<T> full,
                            const std::int32_t* k_channels,  // [Hkv, packed.head_dim] device, ascending
                            const std::int32_t* v_channels,  // [Hkv, packed.v_head_dim] device, ascending
                            const float* k_fill,             // [Hkv, full.head_dim] device or nullptr
                            const float* v_fill,             // [Hkv, full.v_head_dim] device or nullptr
                            const std::int32_t* src_pages,   // [n_pages] device, pages of `packed`
                            const std::int32_t* dst_pages,   // [n_pages] device, pages of `full`, distinct
                            std::int32_t n_pages, std::int32_t n_tokens) {
  constexpr const char* kOp = "unpack_channel_pages";
  KVKIT_RETURN_IF_ERROR(detail::check_pack_args(ex, full, packed, k_channels, v_channels, src_pages, dst_pages,
                                                n_pages, n_tokens, kOp));
  if (n_pages == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::launch_pack_checks(ex, full, packed, k_channels, v_channels, src_pages,
                                                   dst_pages, n_pages, packed.num_pages_total,
                                                   full.num_pages_total, kOp));
  const std::int64_t items = static_cast<std::int64_t>(n_tokens) * full.num_kv_heads *
                             (static_cast<std::int64_t>(full.head_dim) + full.v_head_dim);
  cuda_detail::kvchan_unpack_kernel<T><<<cuda_detail::grid_for(items), cuda_detail::kCopyThreads, 0,
                                         cuda_detail::stream_of(ex)>>>(packed, full, k_channels, v_channels,
                                                                       k_fill, v_fill, src_pages, dst_pages,
                                                                       n_tokens, ex.status);
  return cuda_detail::launch_status(kOp);
}

}  // namespace channel
}  // namespace kvkit
