#pragma once
// gather_tokens and compact_tokens on CUDA: read selected tokens of a sequence out of
// its pages, and rewrite each (sequence, kv-head) to keep only chosen tokens. Twins of
// kernels/cpu/gather.hpp.

#include <cstddef>
#include <cstdint>

#include "kvkit/kernels/cuda/common.cuh"

namespace kvkit {
namespace cuda_detail {

// gather's device checks: sequence seq's page table, then every token id (or n <= len).
template <class T>
__global__ void validate_gather_kernel(PagedKVView<T> view, std::int32_t seq,
                                       const std::int32_t* __restrict__ token_ids,  // [n] or null
                                       std::int32_t n, DeviceStatus* st) {
  if (failed(st)) return;
  const std::int64_t tid = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  if (check_sequence_pages_dev(view, seq, st, tid == 0, tid, step) < 0) return;
  const std::int32_t len = view.seq_len(seq);
  if (token_ids == nullptr) {
    if (tid == 0 && n > len)
      report(st, StatusCode::kOutOfRange, DeviceCheck::kGatherCount, n, -1, seq, len);
    return;
  }
  for (std::int64_t i = tid; i < n; i += step) {
    const std::int32_t t = token_ids[i];
    if (t < 0 || t >= len)
      report(st, StatusCode::kOutOfRange, DeviceCheck::kTokenId, t, i, seq, len);
  }
}

// One thread per (head, output token, vector) of the K rows then the V rows. Returns at
// once when the status holds an error.
template <class T, int VEC>
__global__ void gather_tokens_kernel(PagedKVView<T> view, std::int32_t seq,
                                     const std::int32_t* __restrict__ token_ids,  // [n] or null
                                     std::int32_t n, T* __restrict__ k_out,       // [Hkv, n, D]
                                     T* __restrict__ v_out,                       // [Hkv, n, Dv]
                                     const DeviceStatus* st) {
  if (failed(st)) return;
  const int kvecs = view.head_dim / VEC, vvecs = view.v_head_dim / VEC;
  const int per_row = kvecs + vvecs;
  const std::int64_t per_head = static_cast<std::int64_t>(n) * per_row;
  const std::int64_t total = per_head * view.num_kv_heads;
  const std::int32_t len = view.seq_len(seq);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t h = static_cast<std::int32_t>(i / per_head);
    const std::int64_t rem = i - h * per_head;
    const std::int32_t j = static_cast<std::int32_t>(rem / per_row);
    const int c = static_cast<int>(rem - static_cast<std::int64_t>(j) * per_row);
    const std::int32_t t = token_ids ? token_ids[j] : j;
    if (t < 0 || t >= len) continue;  // unreachable after validation; never read past
    const std::int32_t page = view.page_id(seq, t / view.page_size);
    const std::int32_t slot = t % view.page_size;
    const std::int64_t row = static_cast<std::int64_t>(h) * n + j;
    if (c < kvecs) {
      const int d = c * VEC;
      copy_vec<T, VEC>(k_out + row * view.head_dim + d, view.k_data + view.k_offset(page, slot, h) + d);
    } else {
      const int d = (c - kvecs) * VEC;
      copy_vec<T, VEC>(v_out + row * view.v_head_dim + d,
                       view.v_data + view.v_offset(page, slot, h) + d);
    }
  }
}

// compact's device checks (as the CPU twin): every sequence's page table, then
// num_keep[b] in [0, min(seq_len, keep_stride)], then keep entries in [0, seq_len).
// Block x takes sequences x, x + gridDim.x, ...
template <class T>
__global__ void validate_compact_kernel(PagedKVView<T> view,
                                        const std::int32_t* __restrict__ keep,      // [batch, Hkv, keep_stride]
                                        const std::int32_t* __restrict__ num_keep,  // [batch]
                                        std::int32_t keep_stride, DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t bb = blockIdx.x; bb < view.batch_size; bb += gridDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(bb);
    if (check_sequence_pages_dev(view, b, st, threadIdx.x == 0, threadIdx.x, blockDim.x) < 0)
      continue;
    const std::int32_t len = view.seq_len(b);
    const std::int32_t nk = num_keep[b];
    const std::int32_t max_keep = len < keep_stride ? len : keep_stride;
    if (nk < 0 || nk > max_keep) {
      if (threadIdx.x == 0)
        report(st, StatusCode::kOutOfRange, DeviceCheck::kNumKeep, nk, -1, b, max_keep);
      continue;
    }
    if (nk == 0) continue;
    if (keep == nullptr) {
      if (threadIdx.x == 0)
        report(st, StatusCode::kInvalidArgument, DeviceCheck::kNullKeep, nk, -1, b, 0);
      continue;
    }
    const std::int64_t items = static_cast<std::int64_t>(view.num_kv_heads) * nk;
    for (std::int64_t it = threadIdx.x; it < items; it += blockDim.x) {
      const std::int32_t h = static_cast<std::int32_t>(it / nk);
      const std::int32_t i = static_cast<std::int32_t>(it - static_cast<std::int64_t>(h) * nk);
      const std::int32_t src =
          keep[(static_cast<std::int64_t>(b) * view.num_kv_heads + h) * keep_stride + i];
      if (src < 0 || src >= len)
        report(st, StatusCode::kOutOfRange, DeviceCheck::kKeepIndex, src, i, b, len, h);
    }
  }
}

// Pass 1 (Scatter == false): stage[b][h][i] = token keep[b][h][i].
// Pass 2 (Scatter == true):  token i := stage[b][h][i].
// Staging makes any keep order safe (sources may be overwritten by earlier positions).
// One thread per (b, h, i, vector) of the K rows then the V rows; positions past
// num_keep[b] are idle. Returns at once when the status holds an error.
template <class T, int VEC, bool Scatter>
__global__ void compact_tokens_kernel(PagedKVView<T> view,
                                      const std::int32_t* __restrict__ keep,      // [batch, Hkv, keep_stride]
                                      const std::int32_t* __restrict__ num_keep,  // [batch]
                                      std::int32_t keep_stride,
                                      T* __restrict__ k_stage,  // [batch, Hkv, keep_stride, D]
                                      T* __restrict__ v_stage,  // [batch, Hkv, keep_stride, Dv]
                                      const DeviceStatus* st) {
  if (failed(st)) return;
  const int kvecs = view.head_dim / VEC, vvecs = view.v_head_dim / VEC;
  const int per_row = kvecs + vvecs;
  const std::int64_t per_head = static_cast<std::int64_t>(keep_stride) * per_row;
  const std::int64_t per_seq = per_head * view.num_kv_heads;
  const std::int64_t total = per_seq * view.batch_size;
  for (std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       idx < total; idx += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int32_t b = static_cast<std::int32_t>(idx / per_seq);
    std::int64_t rem = idx - b * per_seq;
    const std::int32_t h = static_cast<std::int32_t>(rem / per_head);
    rem -= h * per_head;
    const std::int32_t i = static_cast<std::int32_t>(rem / per_row);
    const int c = static_cast<int>(rem - static_cast<std::int64_t>(i) * per_row);
    if (i >= num_keep[b]) continue;
    const std::int64_t s = (static_cast<std::int64_t>(b) * view.num_kv_heads + h) * keep_stride + i;
    const std::int32_t t = Scatter ? i : keep[s];
    const std::int32_t page = view.page_id(b, t / view.page_size);
    const std::int32_t slot = t % view.page_size;
    T* pool;
    T* stage;
    if (c < kvecs) {
      const int d = c * VEC;
      pool = view.k_data + view.k_offset(page, slot, h) + d;
      stage = k_stage + s * view.head_dim + d;
    } else {
      const int d = (c - kvecs) * VEC;
      pool = view.v_data + view.v_offset(page, slot, h) + d;
      stage = v_stage + s * view.v_head_dim + d;
    }
    if (Scatter)
      copy_vec<T, VEC>(pool, stage);
    else
      copy_vec<T, VEC>(stage, pool);
  }
}

// Staged rows: [batch, Hkv, keep_stride] rows of `dim` elements.
template <class T>
std::size_t compact_stage_elems(const PagedKVView<T>& view, std::int32_t keep_stride,
                                std::int32_t dim) {
  return static_cast<std::size_t>(view.batch_size) * static_cast<std::size_t>(view.num_kv_heads) *
         static_cast<std::size_t>(keep_stride) * static_cast<std::size_t>(dim);
}

}  // namespace cuda_detail

/// Copies tokens token_ids[j] (or j when token_ids is null) of sequence `seq` into
/// k_out [Hkv, n, head_dim] and v_out [Hkv, n, v_head_dim], on `ex.stream`.
///
/// Contract (same as the CPU twin): scalars on the host (kOutOfRange for seq outside
/// [0, batch); kInvalidArgument for n < 0, null outputs, a null ex.status). On the
/// device, recorded in *ex.status: sequence seq's page table (kOutOfRange for a bad
/// indptr, last_page_len, seq_len, row length or page id; kInvalidArgument for a null
/// table array it needs), then token ids outside [0, seq_len) or n > seq_len when
/// token_ids is null (kOutOfRange). On any error nothing is written.
template <class T>
Status gather_tokens(exec::Cuda ex, PagedKVView<T> view, std::int32_t seq,
                     const std::int32_t* token_ids,  // [n] device, or nullptr for 0..n-1
                     std::int32_t n, T* k_out,       // [Hkv, n, D] device
                     T* v_out) {                     // [Hkv, n, Dv] device
  constexpr const char* kOp = "gather_tokens";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(seq >= 0 && seq < view.batch_size, StatusCode::kOutOfRange, "sequence ", seq,
                     " out of range [0, ", view.batch_size, ")");
  KVKIT_CHECK_STATUS(n >= 0, StatusCode::kInvalidArgument, "n must be >= 0, got ", n);
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_table_ptrs(view));
  if (n > 0) {
    KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(k_out, "k_out", kOp));
    KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(v_out, "v_out", kOp));
  }
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));
  cudaStream_t stream = cuda_detail::stream_of(ex);
  // The table of `seq` is checked even when n == 0, as on the CPU.
  cuda_detail::validate_gather_kernel<T>
      <<<cuda_detail::grid_for(n > 0 ? n : 1), cuda_detail::kCopyThreads, 0, stream>>>(
          view, seq, token_ids, n, ex.status);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  if (n == 0) return Status::ok();

  const int vbytes = cuda_detail::view_vector_bytes(view, {k_out, v_out});
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const std::int64_t total = static_cast<std::int64_t>(view.num_kv_heads) * n *
                               ((view.head_dim + view.v_head_dim) / kVec);
    cuda_detail::gather_tokens_kernel<T, kVec>
        <<<cuda_detail::grid_for(total), cuda_detail::kCopyThreads, 0, stream>>>(
            view, seq, token_ids, n, k_out, v_out, ex.status);
    return cuda_detail::launch_status(kOp);
  });
}

/// Bytes of scratch compact_tokens needs: a K and a V staging copy of every kept token.
template <class T>
std::size_t compact_tokens_workspace_size(exec::Cuda, const PagedKVView<T>& view,
                                          std::int32_t keep_stride) {
  if (keep_stride <= 0 || view.batch_size <= 0 || view.head_dim <= 0 || view.v_head_dim <= 0)
    return 0;
  WorkspaceSizer sizer;
  sizer.add<T>(cuda_detail::compact_stage_elems(view, keep_stride, view.head_dim));    // K
  sizer.add<T>(cuda_detail::compact_stage_elems(view, keep_stride, view.v_head_dim));  // V
  return sizer.bytes();
}

/// Rewrites each (sequence b, kv-head h) so new token i (i < num_keep[b]) is old token
/// keep[b][h][i], on `ex.stream`. Any order of keep is allowed: a gather pass stages the
/// kept tokens in the workspace, then a scatter pass writes them back. The page table
/// is not modified (the caller shortens the sequences afterwards).
///
/// Contract (same as the CPU twin): scalars on the host (kInvalidArgument for
/// keep_stride < 0, a null num_keep, a workspace smaller than
/// compact_tokens_workspace_size, a null ex.status). On the device, recorded in
/// *ex.status: every sequence's page table (as gather_tokens), num_keep[b] outside
/// [0, min(seq_len(b), keep_stride)] and keep entries outside [0, seq_len(b))
/// (kOutOfRange), a null keep while some num_keep[b] > 0 (kInvalidArgument). On any
/// error nothing is written. When several entries are bad, which one is reported may
/// differ from the CPU (which reports the first).
template <class T>
Status compact_tokens(exec::Cuda ex, PagedKVView<T> view,
                      const std::int32_t* keep,      // [batch, Hkv, keep_stride] device
                      const std::int32_t* num_keep,  // [batch] device
                      std::int32_t keep_stride, Workspace ws) {
  constexpr const char* kOp = "compact_tokens";
  KVKIT_RETURN_IF_ERROR(detail::check_view(view, ex));
  KVKIT_CHECK_STATUS(keep_stride >= 0, StatusCode::kInvalidArgument,
                     "keep_stride must be >= 0, got ", keep_stride);
  if (view.batch_size == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_arg_ptr(num_keep, "num_keep", kOp));
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_table_ptrs(view));
  const std::size_t need = compact_tokens_workspace_size(ex, view, keep_stride);
  KVKIT_CHECK_STATUS(need == 0 || (ws.data != nullptr && ws.bytes >= need),
                     StatusCode::kInvalidArgument, "compact_tokens workspace has ", ws.bytes,
                     " bytes, needs ", need);
  KVKIT_RETURN_IF_ERROR(cuda_detail::check_status_ptr(ex, kOp));
  cudaStream_t stream = cuda_detail::stream_of(ex);
  const unsigned vgrid = static_cast<unsigned>(
      view.batch_size < cuda_detail::kMaxCopyBlocks ? view.batch_size : cuda_detail::kMaxCopyBlocks);
  cuda_detail::validate_compact_kernel<T><<<vgrid, cuda_detail::kCopyThreads, 0, stream>>>(
      view, keep, num_keep, keep_stride, ex.status);
  KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
  if (keep_stride == 0) return Status::ok();  // validated: every num_keep is 0

  WorkspaceCarver carver(ws);
  T* k_stage = carver.take<T>(cuda_detail::compact_stage_elems(view, keep_stride, view.head_dim));
  T* v_stage = carver.take<T>(cuda_detail::compact_stage_elems(view, keep_stride, view.v_head_dim));
  KVKIT_CHECK_STATUS(k_stage != nullptr && v_stage != nullptr, StatusCode::kInvalidArgument,
                     "compact_tokens workspace of ", ws.bytes, " bytes is too small");

  // Stage rows are packed and 256-byte aligned, so only the view limits the width.
  const int vbytes = cuda_detail::view_vector_bytes(view);
  return cuda_detail::dispatch_vec_elems<T>(vbytes, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const std::int64_t total = static_cast<std::int64_t>(view.batch_size) * view.num_kv_heads *
                               keep_stride * ((view.head_dim + view.v_head_dim) / kVec);
    const unsigned grid = cuda_detail::grid_for(total);
    cuda_detail::compact_tokens_kernel<T, kVec, false>
        <<<grid, cuda_detail::kCopyThreads, 0, stream>>>(view, keep, num_keep, keep_stride, k_stage,
                                                          v_stage, ex.status);
    KVKIT_RETURN_IF_ERROR(cuda_detail::launch_status(kOp));
    cuda_detail::compact_tokens_kernel<T, kVec, true>
        <<<grid, cuda_detail::kCopyThreads, 0, stream>>>(view, keep, num_keep, keep_stride, k_stage,
                                                          v_stage, ex.status);
    return cuda_detail::launch_status(kOp);
  });
}

}  // namespace kvkit
