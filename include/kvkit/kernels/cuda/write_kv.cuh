#pragma once
// write_kv on CUDA: scatter new tokens' K/V rows into their paged slots (vLLM's
// reshape_and_cache). Twin of kernels/cpu/write_kv.hpp.

#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// Reports the first slot past the pool (negative slots are padding), as the CPU twin.
template <class Slot>  // a template so the header can be included by several TUs
__global__ void validate_slots_kernel(const Slot* __restrict__ slot_mapping,  // [n]
                                      std::int32_t num_tokens, std::int64_t num_slots,
                                      DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < num_tokens; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t s = slot_mapping[i];
    if (s >= num_slots) report(st, StatusCode::kOutOfRange, DeviceCheck::kSlot, s, i, -1, num_slots);
  }
}

// One thread per (token, head, vector of VEC elements) of K rows then V rows (which may
// be narrower); grid-stride over all of them. Returns at once when the status holds an
// error (a bad slot anywhere: nothing is written).
template <class T, int VEC>
__global__ void write_kv_kernel(PagedKVView<T> view,
                                const T* __restrict__ key,    // [num_tokens, Hkv, D] (token_stride)
                                const T* __restrict__ value,  // [num_tokens, Hkv, Dv] (v_token_stride)
                                const std::int64_t* __restrict__ slot_mapping,  // [num_tokens]
                                std::int32_t num_tokens, std::int64_t token_stride,
                                std::int64_t v_token_stride, const DeviceStatus* st) {
  if (failed(st)) return;
  const int kvecs = view.head_dim / VEC;
  const int vvecs = view.v_head_dim / VEC;
  const int per_head = kvecs + vvecs;
  const std::int64_t per_token = static_cast<std::int64_t>(view.num_kv_heads) * per_head;
  const std::int64_t total = per_token * num_tokens;
  const std::int64_t num_slots = static_cast<std::int64_t>(view.num_pages_total) * view.page_size;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / per_token;
    const std::int64_t rem = i - t * per_token;
    const std::int32_t h = static_cast<std::int32_t>(rem / per_head);
    const int j = static_cast<int>(rem - static_cast<std::int64_t>(h) * per_head);
    const std::int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;  // padding (the validation caught the rest)
    if (j < kvecs) {
      const int d = j * VEC;
      copy_vec<T, VEC>(view.k_slot_ptr(slot, h) + d,
                       key + t * token_stride + static_cast<std::int64_t>(h) * view.head_dim + d);
    } else {
      const int d = (j - kvecs) * VEC;
      copy_vec<T, VEC>(view.v_slot_ptr(slot, h) + d,
                       value + t * v_token_stride + static_cast<std::int64_t>(h) * view.v_head_dim + d);
    }
  }
}

}  // namespace cuda_detail

/// Writes `num_tokens` new tokens into the paged pool on `ex.stream`: token t's rows
/// key[t * token_stride + h * head_dim + d] and value[t * v_token_stride + h * v_head_dim
/// + d] go to slot slot_mapping[t] (= page * page_size + offset); a negative slot is
/// padding and skips the token. v_token_stride = -1 means token_stride.
///
/// Contract (same as the CPU twin): scalars are checked on the host (kInvalidArgument
/// for num_tokens < 0, null pointers, strides shorter than a row, a null ex.status).
/// slot_mapping lives on the device and is checked there: a slot >= num_pages *
/// page_size is recorded in *ex.status as kOutOfRange ("slot S of token I out of range")
/// and nothing is written. Never synchronises or allocates; launch errors are
/// kDeviceError.
template <class T>
Status write_kv(exec::Cuda ex, PagedKVView<T> view,
                const T* key,    // [num_tokens, Hkv, D] device, rows token_stride apart
                const T* value,  // [num_tokens, Hkv, Dv] device, rows v_token_stride apart
                const std::int64_t* slot_mapping,  // [num_tokens] device; < 0 skips
                std::int32_t num_tokens, std::int64_t token_stride,
                std::int64_t v_token_stride = -1) {  // -1: token_stride
  constexpr const char* kOp = "write_kv";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(num_tokens >= 0, StatusCode::kInvalidArgument, "num_tokens must be >= 0, got ",
                     num_tokens);
  if (num_tokens == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(key, "key", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(value, "value", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(slot_mapping, "slot_mapping", kOp));
  if (v_token_stride < 0) v_token_stride = token_stride;
  const std::int64_t row = static_cast<std::int64_t>(view.num_kv_heads) * view.head_dim;
  const std::int64_t v_row = static_cast<std::int64_t>(view.num_kv_heads) * view.v_head_dim;
  KVKIT_CHECK_STATUS(token_stride >= row, StatusCode::kInvalidArgument, "token_stride ",
                     token_stride, " is smaller than num_kv_heads*head_dim ", row);
  KVKIT_CHECK_STATUS(v_token_stride >= v_row, StatusCode::kInvalidArgument, "v_token_stride ",
                     v_token_stride, " is smaller than num_kv_heads*v_head_dim ", v_row);
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));

  cudaStream_t stream = cuda_detail::stream_of(ex);
  const std::int64_t num_slots = static_cast<std::int64_t>(view.num_pages_total) * view.page_size;
  cuda_detail::validate_slots_kernel<<<cuda_detail::grid_for(num_tokens), cuda_detail::kCopyThreads,
                                       0, stream>>>(slot_mapping, num_tokens, num_slots, ex.status);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  const int vbytes =
      cuda_detail::view_vector_bytes(view, {key, value}, {token_stride, v_token_stride});
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const std::int64_t total = (row + v_row) / kVec * num_tokens;
    cuda_detail::write_kv_kernel<T, kVec>
        <<<cuda_detail::grid_for(total), cuda_detail::kCopyThreads, 0, stream>>>(
            view, key, value, slot_mapping, num_tokens, token_stride, v_token_stride, ex.status);
    return cuda_detail::launch_status(kOp);
  });
}

}  // namespace kvkit
