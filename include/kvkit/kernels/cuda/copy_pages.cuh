#pragma once
// copy_pages on CUDA: duplicate whole pages (copy-on-write forks, defragmentation).
// Twin of kernels/cpu/copy_pages.hpp.

#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// Mark bits of the page-mark scratch: page is a source / a destination.
inline constexpr unsigned kMarkSrc = 1u, kMarkDst = 2u;

// Check pass 1: ids in range (kInvalidArgument, as the CPU twin); marks every source.
template <class Unused = void>
__global__ void copy_pages_mark_kernel(const std::int32_t* __restrict__ src_pages,  // [n]
                                       const std::int32_t* __restrict__ dst_pages,  // [n]
                                       std::int32_t n, std::int32_t num_pages,
                                       unsigned* __restrict__ marks,  // [num_pages], zeroed
                                       DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t s = src_pages[i], d = dst_pages[i];
    if (s < 0 || s >= num_pages)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kSrcPage, s, i, -1, num_pages);
    else
      atomicOr(marks + s, kMarkSrc);
    if (d < 0 || d >= num_pages)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kDstPage, d, i, -1, num_pages);
  }
}

// Check pass 2 (after every source is marked): a destination may not be a source nor
// appear twice. O(n) with the marks, at any pool size.
template <class Unused = void>
__global__ void copy_pages_clash_kernel(const std::int32_t* __restrict__ dst_pages,  // [n]
                                        std::int32_t n, std::int32_t num_pages,
                                        unsigned* __restrict__ marks,  // [num_pages]
                                        DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t d = dst_pages[i];
    if (d < 0 || d >= num_pages) continue;  // reported by pass 1
    const unsigned old = atomicOr(marks + d, kMarkDst);
    if (old & kMarkSrc)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kDstIsSource, d, i, -1, num_pages);
    else if (old & kMarkDst)
      report(st, StatusCode::kInvalidArgument, DeviceCheck::kDstRepeated, d, i, -1, num_pages);
  }
}

// Item i of a page of (page_size x heads) rows of `vecs` vectors, in the pool's memory
// order (NHD: slot-major, HND: head-major) so consecutive threads touch consecutive
// addresses in either layout.
KVKIT_DEVICE void page_item(KVLayout layout, std::int32_t i, std::int32_t page_size,
                            std::int32_t heads, std::int32_t vecs, std::int32_t& slot,
                            std::int32_t& h, std::int32_t& vec) {
  const std::int32_t row = i / vecs;
  vec = i - row * vecs;
  if (layout == KVLayout::kNHD) {
    slot = row / heads;
    h = row - slot * heads;
  } else {
    h = row / page_size;
    slot = row - h * page_size;
  }
}

// Block x walks pairs blockIdx.x, blockIdx.x + gridDim.x, ...; its threads copy the
// (token, head, vector) items of the K pool, then of the V pool (rows of v_head_dim).
// Only addressed elements are touched, so padded strides (other layers, interleaved
// K/V) stay intact. Returns at once when the status holds an error.
template <class T, int VEC>
__global__ void copy_pages_kernel(PagedKVView<T> view,
                                  const std::int32_t* __restrict__ src_pages,  // [n]
                                  const std::int32_t* __restrict__ dst_pages,  // [n]
                                  std::int32_t n, const DeviceStatus* st) {
  if (failed(st)) return;
  const int kvecs = view.head_dim / VEC, vvecs = view.v_head_dim / VEC;
  const std::int32_t k_per_token = view.num_kv_heads * kvecs;
  const std::int32_t v_per_token = view.num_kv_heads * vvecs;
  const std::int32_t k_items = view.page_size * k_per_token;
  const std::int32_t per_page = k_items + view.page_size * v_per_token;
  // 64-bit pair index: pair + gridDim.x would wrap an int32 for n near INT32_MAX.
  for (std::int64_t pair = blockIdx.x; pair < n; pair += gridDim.x) {
    const std::int32_t src = src_pages[pair];
    const std::int32_t dst = dst_pages[pair];
    if (src < 0 || src >= view.num_pages_total || dst < 0 || dst >= view.num_pages_total) continue;
    for (std::int32_t i = threadIdx.x; i < per_page; i += blockDim.x) {
      if (i < k_items) {
        std::int32_t slot, h, d;
        page_item(view.k_layout, i, view.page_size, view.num_kv_heads, kvecs, slot, h, d);
        copy_vec<T, VEC>(view.k_data + view.k_offset(dst, slot, h) + d * VEC,
                         view.k_data + view.k_offset(src, slot, h) + d * VEC);
      } else {
        std::int32_t slot, h, d;
        page_item(view.v_layout, i - k_items, view.page_size, view.num_kv_heads, vvecs, slot, h, d);
        copy_vec<T, VEC>(view.v_data + view.v_offset(dst, slot, h) + d * VEC,
                         view.v_data + view.v_offset(src, slot, h) + d * VEC);
      }
    }
  }
}

}  // namespace cuda_detail

/// Bytes of scratch copy_pages needs on CUDA for n pairs: one mark word per pool page,
/// for the O(n) device-side check that no destination is a source or repeated (0 when
/// n <= 0). Same signature as the CPU twin's, whose needs differ.
template <class T>
std::size_t copy_pages_workspace_size(exec::Cuda, const PagedKVView<T>& view, std::int32_t n) {
  if (n <= 0 || view.num_pages_total <= 0) return 0;
  return WorkspaceSizer().add<unsigned>(static_cast<std::size_t>(view.num_pages_total)).bytes();
}

/// Copies page src_pages[i] to page dst_pages[i] (K and V, every token slot and head) for
/// i < n on `ex.stream`. The same source may feed several destinations, but a destination
/// may appear only once and never as a source (pairs run concurrently).
///
/// Contract (same as the CPU twin): scalars on the host (kInvalidArgument for n < 0,
/// null arrays, a workspace smaller than copy_pages_workspace_size, a null ex.status). On
/// the device, recorded in *ex.status as kInvalidArgument: an id outside [0, num_pages),
/// a destination that is also a source, a repeated destination. On any error nothing is
/// copied. `ws` (device scratch, copy_pages_workspace_size(ex, view, n) bytes, always
/// > 0 on CUDA) holds the page marks; it is cleared with cudaMemsetAsync on the stream.
template <class T>
Status copy_pages(exec::Cuda ex, PagedKVView<T> view,
                  const std::int32_t* src_pages,  // [n] device
                  const std::int32_t* dst_pages,  // [n] device
                  std::int32_t n, Workspace ws = {}) {
  constexpr const char* kOp = "copy_pages";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(n >= 0, StatusCode::kInvalidArgument, "n must be >= 0, got ", n);
  if (n == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(src_pages, "src_pages", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(dst_pages, "dst_pages", kOp));
  const std::int64_t page_elems = static_cast<std::int64_t>(view.page_size) * view.num_kv_heads *
                                  (static_cast<std::int64_t>(view.head_dim) + view.v_head_dim);
  KVKIT_CHECK_STATUS(page_elems <= INT32_MAX, StatusCode::kUnsupported, "page of ", page_elems,
                     " K+V elements is too large for copy_pages");
  const std::size_t need = copy_pages_workspace_size(ex, view, n);
  KVKIT_CHECK_STATUS(ws.data != nullptr && ws.bytes >= need, StatusCode::kInvalidArgument,
                     "copy_pages workspace has ", ws.bytes, " bytes, needs ", need);
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));
  unsigned* marks =
      WorkspaceCarver(ws).take<unsigned>(static_cast<std::size_t>(view.num_pages_total));
  KVKIT_CHECK_STATUS(marks != nullptr, StatusCode::kInvalidArgument, "copy_pages workspace of ",
                     ws.bytes, " bytes is too small");

  cudaStream_t stream = cuda_detail::stream_of(ex);
  KVKIT_RETURN_IF_ERROR(cuda_detail::cuda_status(
      cudaMemsetAsync(marks, 0, sizeof(unsigned) * static_cast<std::size_t>(view.num_pages_total),
                      stream),
      kOp));
  const unsigned cgrid = cuda_detail::grid_for(n);
  cuda_detail::copy_pages_mark_kernel<><<<cgrid, cuda_detail::kCopyThreads, 0, stream>>>(
      src_pages, dst_pages, n, view.num_pages_total, marks, ex.status);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  cuda_detail::copy_pages_clash_kernel<><<<cgrid, cuda_detail::kCopyThreads, 0, stream>>>(
      dst_pages, n, view.num_pages_total, marks, ex.status);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));

  const int vbytes = cuda_detail::view_vector_bytes(view);
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const unsigned grid = static_cast<unsigned>(
        n < cuda_detail::kMaxCopyBlocks ? n : cuda_detail::kMaxCopyBlocks);
    cuda_detail::copy_pages_kernel<T, kVec>
        <<<grid, cuda_detail::kCopyThreads, 0, stream>>>(view, src_pages, dst_pages, n, ex.status);
    return cuda_detail::launch_status(kOp);
  });
}

}  // namespace kvkit
