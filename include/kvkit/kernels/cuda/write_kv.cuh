#pragma once
// write_kv on CUDA: scatter new tokens' K/V rows into their paged slots (vLLM's
// reshape_and_cache). Twin of kernels/cpu/write_kv.hpp.

#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// One thread per (token, head, vector of VEC elements); grid-stride over all of them.
template <class T, int VEC>
__global__ void write_kv_kernel(PagedKVView<T> view, const T* __restrict__ key,  // [num_tokens, Hkv, D]
                                const T* __restrict__ value,                   // [num_tokens, Hkv, D]
                                const std::int64_t* __restrict__ slot_mapping,  // [num_tokens]
                                std::int32_t num_tokens, std::int64_t token_stride) {
  const int vecs = view.head_dim / VEC;
  const std::int64_t per_token = static_cast<std::int64_t>(view.num_kv_heads) * vecs;
  const std::int64_t total = per_token * num_tokens;
  const std::int64_t num_slots = static_cast<std::int64_t>(view.num_pages_total) * view.page_size;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / per_token;
    const std::int64_t rem = i - t * per_token;
    const std::int32_t h = static_cast<std::int32_t>(rem / vecs);
    const std::int32_t d = static_cast<std::int32_t>(rem - static_cast<std::int64_t>(h) * vecs) * VEC;
    const std::int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;  // padding (<0) or a bad device entry
    const std::int64_t src = t * token_stride + static_cast<std::int64_t>(h) * view.head_dim + d;
    copy_vec<T, VEC>(view.k_slot_ptr(slot, h) + d, key + src);
    copy_vec<T, VEC>(view.v_slot_ptr(slot, h) + d, value + src);
  }
}

}  // namespace cuda_detail

/// Writes `num_tokens` new tokens into the paged pool on `ex.stream`: token t's rows
/// key/value[t * token_stride + h * head_dim + d] go to slot slot_mapping[t]
/// (= page * page_size + offset); a negative slot skips the token, and so does a slot
/// past the pool (device tables are checked on the device, never read by the host).
/// Never synchronises or allocates; returns launch errors as kDeviceError.
template <class T>
Status write_kv(exec::Cuda ex, PagedKVView<T> view,
                const T* key,                       // [num_tokens, Hkv, D], rows token_stride apart
                const T* value,                     // [num_tokens, Hkv, D], rows token_stride apart
                const std::int64_t* slot_mapping,   // [num_tokens] device; < 0 skips
                std::int32_t num_tokens, std::int64_t token_stride) {
  constexpr const char* kOp = "write_kv";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(num_tokens >= 0, StatusCode::kInvalidArgument, "num_tokens must be >= 0, got ",
                     num_tokens);
  if (num_tokens == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(key, "key", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(value, "value", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(slot_mapping, "slot_mapping", kOp));
  const std::int64_t row = static_cast<std::int64_t>(view.num_kv_heads) * view.head_dim;
  KVKIT_CHECK_STATUS(token_stride >= row, StatusCode::kInvalidArgument, "token_stride ",
                     token_stride, " is smaller than num_kv_heads * head_dim = ", row);

  const int vbytes = cuda_detail::view_vector_bytes(view, {key, value}, {token_stride});
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const std::int64_t total = row / kVec * num_tokens;
    cuda_detail::write_kv_kernel<T, kVec>
        <<<cuda_detail::grid_for(total), cuda_detail::kCopyThreads, 0, cuda_detail::stream_of(ex)>>>(
            view, key, value, slot_mapping, num_tokens, token_stride);
    return cuda_detail::launch_status(kOp);
  });
}

}  // namespace kvkit
