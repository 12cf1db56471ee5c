#pragma once
// copy_pages on CUDA: duplicate whole pages (copy-on-write forks, defragmentation).
// Twin of kernels/cpu/copy_pages.hpp.

#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// Block x walks pairs blockIdx.x, blockIdx.x + gridDim.x, ...; its threads copy the
// (token, head, vector) items of both pools. Only addressed elements are touched, so
// padded strides (other layers, interleaved K/V) stay intact.
template <class T, int VEC>
__global__ void copy_pages_kernel(PagedKVView<T> view,
                                  const std::int32_t* __restrict__ src_pages,  // [n]
                                  const std::int32_t* __restrict__ dst_pages,  // [n]
                                  std::int32_t n) {
  const int vecs = view.head_dim / VEC;
  const std::int32_t per_token = view.num_kv_heads * vecs;
  const std::int32_t per_page = view.page_size * per_token;
  // 64-bit pair index: pair + gridDim.x would wrap an int32 for n near INT32_MAX.
  for (std::int64_t pair = blockIdx.x; pair < n; pair += gridDim.x) {
    const std::int32_t src = src_pages[pair];
    const std::int32_t dst = dst_pages[pair];
    if (src < 0 || src >= view.num_pages_total || dst < 0 || dst >= view.num_pages_total) continue;
    for (std::int32_t i = threadIdx.x; i < per_page; i += blockDim.x) {
      const std::int32_t slot = i / per_token;
      const std::int32_t rem = i - slot * per_token;
      const std::int32_t h = rem / vecs;
      const std::int32_t d = (rem - h * vecs) * VEC;
      copy_vec<T, VEC>(view.k_data + view.k_offset(dst, slot, h) + d,
                       view.k_data + view.k_offset(src, slot, h) + d);
      copy_vec<T, VEC>(view.v_data + view.v_offset(dst, slot, h) + d,
                       view.v_data + view.v_offset(src, slot, h) + d);
    }
  }
}

}  // namespace cuda_detail

/// Copies page src_pages[i] to page dst_pages[i] (K and V, every token slot and head) for
/// i < n on `ex.stream`. Pairs run concurrently, so no destination may also be a source
/// or appear twice (the result is then unspecified). The index arrays live on the device
/// and are checked there: a pair with either id outside [0, num_pages) is skipped.
template <class T>
Status copy_pages(exec::Cuda ex, PagedKVView<T> view,
                  const std::int32_t* src_pages,  // [n] device
                  const std::int32_t* dst_pages,  // [n] device
                  std::int32_t n) {
  constexpr const char* kOp = "copy_pages";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(n >= 0, StatusCode::kInvalidArgument, "n must be >= 0, got ", n);
  if (n == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(src_pages, "src_pages", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(dst_pages, "dst_pages", kOp));
  const std::int64_t page_elems =
      static_cast<std::int64_t>(view.page_size) * view.num_kv_heads * view.head_dim;
  KVKIT_CHECK_STATUS(page_elems <= INT32_MAX, StatusCode::kUnsupported, "page of ", page_elems,
                     " elements is too large for copy_pages");

  const int vbytes = cuda_detail::view_vector_bytes(view);
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const unsigned grid = static_cast<unsigned>(
        n < cuda_detail::kMaxCopyBlocks ? n : cuda_detail::kMaxCopyBlocks);
    cuda_detail::copy_pages_kernel<T, kVec>
        <<<grid, cuda_detail::kCopyThreads, 0, cuda_detail::stream_of(ex)>>>(view, src_pages,
                                                                             dst_pages, n);
    return cuda_detail::launch_status(kOp);
  });
}

}  // namespace kvkit
