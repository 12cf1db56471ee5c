#pragma once
// gather_tokens and compact_tokens on CUDA: read selected tokens of a sequence out of
// its pages, and rewrite each (sequence, kv-head) to keep only chosen tokens. Twins of
// kernels/cpu/gather.hpp.

#include <cstddef>
#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// Page id of token t of sequence b, or -1 when the device table points outside the pool.
template <class T>
KVKIT_DEVICE std::int32_t checked_page(const PagedKVView<T>& view, std::int32_t b, std::int32_t t) {
  const std::int32_t p = view.page_id(b, t / view.page_size);
  return (p >= 0 && p < view.num_pages_total) ? p : -1;
}

// One thread per (head, output token, vector); an out-of-range token id (or page id)
// yields zeros so the output never holds stale data.
template <class T, int VEC>
__global__ void gather_tokens_kernel(PagedKVView<T> view, std::int32_t seq,
                                     const std::int32_t* __restrict__ token_ids,  // [n] or null
                                     std::int32_t n, T* __restrict__ k_out,       // [Hkv, n, D]
                                     T* __restrict__ v_out) {                     // [Hkv, n, D]
  const int vecs = view.head_dim / VEC;
  const std::int64_t per_head = static_cast<std::int64_t>(n) * vecs;
  const std::int64_t total = per_head * view.num_kv_heads;
  const std::int32_t len = view.seq_len(seq);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t h = static_cast<std::int32_t>(i / per_head);
    const std::int64_t rem = i - h * per_head;
    const std::int32_t j = static_cast<std::int32_t>(rem / vecs);
    const std::int32_t d = static_cast<std::int32_t>(rem - static_cast<std::int64_t>(j) * vecs) * VEC;
    const std::int32_t t = token_ids ? token_ids[j] : j;
    T* ko = k_out + (static_cast<std::int64_t>(h) * n + j) * view.head_dim + d;
    T* vo = v_out + (static_cast<std::int64_t>(h) * n + j) * view.head_dim + d;
    const std::int32_t page = (t >= 0 && t < len) ? checked_page(view, seq, t) : -1;
    if (page < 0) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) ko[e] = vo[e] = store_float<T>(0.f);
      continue;
    }
    const std::int32_t slot = t % view.page_size;
    copy_vec<T, VEC>(ko, view.k_data + view.k_offset(page, slot, h) + d);
    copy_vec<T, VEC>(vo, view.v_data + view.v_offset(page, slot, h) + d);
  }
}

// Source token of new position i of (b, h), or -1 when position i is not rewritten:
// i past num_keep (clamped to keep_stride and the sequence length), or a keep entry
// outside [0, seq_len), or a page id outside the pool.
template <class T>
KVKIT_DEVICE std::int32_t compact_source(const PagedKVView<T>& view,
                                         const std::int32_t* keep,      // [batch, Hkv, keep_stride]
                                         const std::int32_t* num_keep,  // [batch]
                                         std::int32_t keep_stride, std::int32_t b, std::int32_t h,
                                         std::int32_t i) {
  const std::int32_t len = view.seq_len(b);
  const std::int32_t nk = num_keep[b];
  if (i >= nk || i >= len) return -1;
  const std::int32_t src =
      keep[(static_cast<std::int64_t>(b) * view.num_kv_heads + h) * keep_stride + i];
  if (src < 0 || src >= len) return -1;
  if (checked_page(view, b, src) < 0 || checked_page(view, b, i) < 0) return -1;
  return src;
}

// Pass 1 (Scatter == false): stage[b][h][i] = token keep[b][h][i].
// Pass 2 (Scatter == true):  token i := stage[b][h][i].
// Staging makes any keep order safe (sources may be overwritten by earlier positions).
template <class T, int VEC, bool Scatter>
__global__ void compact_tokens_kernel(PagedKVView<T> view,
                                      const std::int32_t* __restrict__ keep,      // [batch, Hkv, keep_stride]
                                      const std::int32_t* __restrict__ num_keep,  // [batch]
                                      std::int32_t keep_stride,
                                      T* __restrict__ k_stage,   // [batch, Hkv, keep_stride, D]
                                      T* __restrict__ v_stage) {  // [batch, Hkv, keep_stride, D]
  const int vecs = view.head_dim / VEC;
  const std::int64_t per_head = static_cast<std::int64_t>(keep_stride) * vecs;
  const std::int64_t per_seq = per_head * view.num_kv_heads;
  const std::int64_t total = per_seq * view.batch_size;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(idx / per_seq);
    std::int64_t rem = idx - b * per_seq;
    const std::int32_t h = static_cast<std::int32_t>(rem / per_head);
    rem -= h * per_head;
    const std::int32_t i = static_cast<std::int32_t>(rem / vecs);
    const std::int32_t d = static_cast<std::int32_t>(rem - static_cast<std::int64_t>(i) * vecs) * VEC;
    const std::int32_t src = compact_source(view, keep, num_keep, keep_stride, b, h, i);
    if (src < 0) continue;
    const std::int64_t s = (static_cast<std::int64_t>(b) * view.num_kv_heads + h) * keep_stride + i;
    T* ks = k_stage + s * view.head_dim + d;
    T* vs = v_stage + s * view.head_dim + d;
    const std::int32_t t = Scatter ? i : src;
    const std::int32_t page = view.page_id(b, t / view.page_size);
    const std::int32_t slot = t % view.page_size;
    T* kp = view.k_data + view.k_offset(page, slot, h) + d;
    T* vp = view.v_data + view.v_offset(page, slot, h) + d;
    if (Scatter) {
      copy_vec<T, VEC>(kp, ks);
      copy_vec<T, VEC>(vp, vs);
    } else {
      copy_vec<T, VEC>(ks, kp);
      copy_vec<T, VEC>(vs, vp);
    }
  }
}

template <class T>
std::size_t compact_stage_elems(const PagedKVView<T>& view, std::int32_t keep_stride) {
  return static_cast<std::size_t>(view.batch_size) * static_cast<std::size_t>(view.num_kv_heads) *
         static_cast<std::size_t>(keep_stride) * static_cast<std::size_t>(view.head_dim);
}

}  // namespace cuda_detail

/// Copies tokens token_ids[j] (or j when token_ids is null) of sequence `seq` into
/// k_out/v_out laid out [Hkv, n, head_dim], on `ex.stream`. token_ids lives on the device
/// and is checked there: an id outside [0, seq_len) (or on a page outside the pool)
/// writes zeros for that token instead of reading out of bounds.
template <class T>
Status gather_tokens(exec::Cuda ex, PagedKVView<T> view, std::int32_t seq,
                     const std::int32_t* token_ids,  // [n] device, or nullptr for 0..n-1
                     std::int32_t n, T* k_out,       // [Hkv, n, D] device
                     T* v_out) {                     // [Hkv, n, D] device
  constexpr const char* kOp = "gather_tokens";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(seq >= 0 && seq < view.batch_size, StatusCode::kOutOfRange, "sequence ", seq,
                     " out of range [0, ", view.batch_size, ")");
  KVKIT_CHECK_STATUS(n >= 0, StatusCode::kInvalidArgument, "n must be >= 0, got ", n);
  if (n == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(k_out, "k_out", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(v_out, "v_out", kOp));

  const int vbytes = cuda_detail::view_vector_bytes(view, {k_out, v_out});
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const std::int64_t total =
        static_cast<std::int64_t>(view.num_kv_heads) * n * (view.head_dim / kVec);
    cuda_detail::gather_tokens_kernel<T, kVec>
        <<<cuda_detail::grid_for(total), cuda_detail::kCopyThreads, 0, cuda_detail::stream_of(ex)>>>(
            view, seq, token_ids, n, k_out, v_out);
    return cuda_detail::launch_status(kOp);
  });
}

/// Bytes of scratch compact_tokens needs: a K and a V staging copy of every kept token.
template <class T>
std::size_t compact_tokens_workspace_size(exec::Cuda, const PagedKVView<T>& view,
                                          std::int32_t keep_stride) {
  if (keep_stride <= 0 || view.batch_size <= 0) return 0;
  const std::size_t elems = cuda_detail::compact_stage_elems(view, keep_stride);
  WorkspaceSizer sizer;
  sizer.add<T>(elems);  // K staging
  sizer.add<T>(elems);  // V staging
  return sizer.bytes();
}

/// Rewrites each (sequence b, kv-head h) so new token i (i < num_keep[b]) is old token
/// keep[b][h][i], on `ex.stream`. Any order of keep is allowed: a gather pass stages the
/// kept tokens in the workspace, then a scatter pass writes them back. The page table
/// is not modified (the caller shortens the sequence afterwards). keep and num_keep live
/// on the device and are checked there: positions past min(num_keep[b], keep_stride,
/// seq_len) and entries outside [0, seq_len) are skipped (that position keeps its old
/// token); nothing is ever written outside the view.
template <class T>
Status compact_tokens(exec::Cuda ex, PagedKVView<T> view,
                      const std::int32_t* keep,      // [batch, Hkv, keep_stride] device
                      const std::int32_t* num_keep,  // [batch] device
                      std::int32_t keep_stride, Workspace ws) {
  constexpr const char* kOp = "compact_tokens";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(keep_stride >= 0, StatusCode::kInvalidArgument,
                     "keep_stride must be >= 0, got ", keep_stride);
  if (keep_stride == 0 || view.batch_size == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(keep, "keep", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(num_keep, "num_keep", kOp));
  const std::size_t need = compact_tokens_workspace_size(ex, view, keep_stride);
  KVKIT_CHECK_STATUS(ws.data != nullptr && ws.bytes >= need, StatusCode::kInvalidArgument,
                     "compact_tokens workspace has ", ws.bytes, " bytes, needs ", need);
  const std::size_t elems = cuda_detail::compact_stage_elems(view, keep_stride);
  WorkspaceCarver carver(ws);
  T* k_stage = carver.take<T>(elems);
  T* v_stage = carver.take<T>(elems);
  KVKIT_CHECK_STATUS(k_stage != nullptr && v_stage != nullptr, StatusCode::kInvalidArgument,
                     "compact_tokens workspace of ", ws.bytes, " bytes is too small");

  // Stage rows are head_dim apart and 256-byte aligned, so only the view limits the width.
  const int vbytes = cuda_detail::view_vector_bytes(view);
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const std::int64_t total = static_cast<std::int64_t>(elems / kVec);
    const unsigned grid = cuda_detail::grid_for(total);
    cudaStream_t stream = cuda_detail::stream_of(ex);
    cuda_detail::compact_tokens_kernel<T, kVec, false>
        <<<grid, cuda_detail::kCopyThreads, 0, stream>>>(view, keep, num_keep, keep_stride, k_stage,
                                                          v_stage);
    KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
    cuda_detail::compact_tokens_kernel<T, kVec, true>
        <<<grid, cuda_detail::kCopyThreads, 0, stream>>>(view, keep, num_keep, keep_stride, k_stage,
                                                          v_stage);
    return cuda_detail::launch_status(kOp);
  });
}

}  // namespace kvkit
