#pragma once
// gather_tokens and compact_tokens on the CPU: read selected tokens out of a sequence,
// and rewrite a sequence so that it holds only the kept tokens of each head, in order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/cpu/checks.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {

/// Copies tokens token_ids[0..n) of sequence `seq` (or tokens 0..n-1 when token_ids is
/// nullptr) into dense head-major buffers: k_out[h, i, :] = K[seq, token_ids[i], h].
/// Returns kOutOfRange naming a token id outside [0, seq_len(seq)) or a bad sequence.
template <class T>
Status gather_tokens(exec::Host ex, PagedKVView<T> view, std::int32_t seq,
                     const std::int32_t* token_ids,  // [n] or nullptr for 0..n-1
                     std::int32_t n,
                     T* k_out,    // [Hkv, n, D]
                     T* v_out) {  // [Hkv, n, D]
  KVKIT_RETURN_IF_ERROR(detail::check_host_view(view, /*check_table=*/false));
  KVKIT_CHECK_STATUS(seq >= 0 && seq < view.batch_size, StatusCode::kOutOfRange, "sequence ", seq,
                     " out of range [0, ", view.batch_size, ")");
  KVKIT_CHECK_STATUS(n >= 0, StatusCode::kInvalidArgument, "n must be >= 0, got ", n);
  KVKIT_RETURN_IF_ERROR(detail::check_sequence_pages(view, seq));
  if (n == 0) return Status::ok();
  KVKIT_CHECK_STATUS(k_out != nullptr && v_out != nullptr, StatusCode::kInvalidArgument,
                     "gather_tokens got a null k_out or v_out");
  const std::int32_t len = view.seq_len(seq);
  if (token_ids == nullptr) {
    KVKIT_CHECK_STATUS(n <= len, StatusCode::kOutOfRange, "n ", n, " exceeds seq_len ", len,
                       " of sequence ", seq);
  } else {
    for (std::int32_t i = 0; i < n; ++i)
      KVKIT_CHECK_STATUS(token_ids[i] >= 0 && token_ids[i] < len, StatusCode::kOutOfRange,
                         "token id ", token_ids[i], " at position ", i, " out of range [0, ", len,
                         ") of sequence ", seq);
  }
  const std::int32_t dim = view.head_dim;
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(dim);
  const std::int64_t items = static_cast<std::int64_t>(view.num_kv_heads) * n;
  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int) {
    for (std::int64_t it = begin; it < end; ++it) {  // it = h * n + i, the output row
      const std::int32_t h = static_cast<std::int32_t>(it / n);
      const std::int32_t i = static_cast<std::int32_t>(it % n);
      const std::int32_t t = token_ids ? token_ids[i] : i;
      std::memcpy(k_out + it * dim, view.k_ptr(seq, t, h), bytes);
      std::memcpy(v_out + it * dim, view.v_ptr(seq, t, h), bytes);
    }
  });
  return Status::ok();
}

/// Bytes of workspace compact_tokens needs: one staging slice of keep_stride K and V rows
/// per worker thread of `ex` (used only for keep lists that are not strictly ascending).
template <class T>
std::size_t compact_tokens_workspace_size(exec::Host ex, const PagedKVView<T>& view,
                                          std::int32_t keep_stride) {
  if (keep_stride <= 0 || view.head_dim <= 0) return 0;
  const std::size_t slice = 2 * static_cast<std::size_t>(keep_stride) * view.head_dim;
  const std::size_t workers =
      static_cast<std::size_t>(detail::host_workers(ex, detail::kMaxHostThreads));
  return WorkspaceSizer().add<T>(slice * workers).bytes();
}

/// Compacts every sequence in place: for sequence b, kv head h and i < num_keep[b],
/// new token i of head h (K and V) := old token keep[b][h][i] of head h. Heads choose
/// independently; tokens at positions >= num_keep[b] are left as they were. Pages are not
/// freed here: the engine then shrinks seq_len(b) to num_keep[b] and releases the pages
/// past it. Everything is validated first (kOutOfRange naming the value, sequence and
/// head; kInvalidArgument when ws is smaller than compact_tokens_workspace_size(ex, ...)),
/// so a failed call changes nothing. Strictly ascending keep lists are compacted by one
/// forward pass (keep[i] >= i, so no source is overwritten before it is read); others
/// are staged through the workspace. The pages of the sequences being compacted must not
/// be shared with other sequences (copy them first with copy_pages).
template <class T>
Status compact_tokens(exec::Host ex, PagedKVView<T> view,
                      const std::int32_t* keep,      // [batch, Hkv, keep_stride]
                      const std::int32_t* num_keep,  // [batch]
                      std::int32_t keep_stride, Workspace ws) {
  KVKIT_RETURN_IF_ERROR(detail::check_host_view(view, /*check_table=*/true));
  KVKIT_CHECK_STATUS(keep_stride >= 0, StatusCode::kInvalidArgument,
                     "keep_stride must be >= 0, got ", keep_stride);
  if (view.batch_size == 0) return Status::ok();
  KVKIT_CHECK_STATUS(num_keep != nullptr, StatusCode::kInvalidArgument, "num_keep is null");
  const std::int32_t hkv = view.num_kv_heads;
  bool any_kept = false;
  for (std::int32_t b = 0; b < view.batch_size; ++b) {
    const std::int32_t len = view.seq_len(b);
    const std::int32_t nk = num_keep[b];
    KVKIT_CHECK_STATUS(nk >= 0 && nk <= std::min(len, keep_stride), StatusCode::kOutOfRange,
                       "num_keep ", nk, " of sequence ", b, " outside [0, min(seq_len ", len,
                       ", keep_stride ", keep_stride, ")]");
    if (nk == 0) continue;
    any_kept = true;
    KVKIT_CHECK_STATUS(keep != nullptr, StatusCode::kInvalidArgument, "keep is null");
    for (std::int32_t h = 0; h < hkv; ++h) {
      const std::int32_t* kl = keep + (static_cast<std::int64_t>(b) * hkv + h) * keep_stride;
      for (std::int32_t i = 0; i < nk; ++i)
        KVKIT_CHECK_STATUS(kl[i] >= 0 && kl[i] < len, StatusCode::kOutOfRange, "keep index ", kl[i],
                           " at position ", i, " of sequence ", b, " head ", h,
                           " out of range [0, ", len, ")");
    }
  }
  const std::size_t need = compact_tokens_workspace_size(ex, view, keep_stride);
  KVKIT_CHECK_STATUS(ws.bytes >= need && (need == 0 || ws.data != nullptr),
                     StatusCode::kInvalidArgument, "workspace of ", ws.bytes,
                     " bytes is smaller than the ", need, " bytes compact_tokens needs");
  if (!any_kept) return Status::ok();
  const std::int32_t dim = view.head_dim;
  const std::size_t slice = 2 * static_cast<std::size_t>(keep_stride) * dim;
  T* staging =
      WorkspaceCarver(ws).take<T>(slice * detail::host_workers(ex, detail::kMaxHostThreads));
  if (staging == nullptr)
    return make_status(StatusCode::kInvalidArgument, "workspace of ", ws.bytes, " bytes too small");
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(dim);
  const std::int64_t items = static_cast<std::int64_t>(view.batch_size) * hkv;
  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int worker) {
    T* kst = staging + static_cast<std::size_t>(worker) * slice;
    T* vst = kst + static_cast<std::size_t>(keep_stride) * dim;
    for (std::int64_t it = begin; it < end; ++it) {
      const std::int32_t b = static_cast<std::int32_t>(it / hkv);
      const std::int32_t h = static_cast<std::int32_t>(it % hkv);
      const std::int32_t nk = num_keep[b];
      if (nk == 0) continue;
      const std::int32_t* kl = keep + it * keep_stride;
      bool ascending = true;
      for (std::int32_t i = 1; i < nk && ascending; ++i) ascending = kl[i] > kl[i - 1];
      if (ascending) {
        for (std::int32_t i = 0; i < nk; ++i) {
          if (kl[i] == i) continue;
          std::memcpy(view.k_ptr(b, i, h), view.k_ptr(b, kl[i], h), bytes);
          std::memcpy(view.v_ptr(b, i, h), view.v_ptr(b, kl[i], h), bytes);
        }
      } else {
        for (std::int32_t i = 0; i < nk; ++i) {
          std::memcpy(kst + static_cast<std::size_t>(i) * dim, view.k_ptr(b, kl[i], h), bytes);
          std::memcpy(vst + static_cast<std::size_t>(i) * dim, view.v_ptr(b, kl[i], h), bytes);
        }
        for (std::int32_t i = 0; i < nk; ++i) {
          std::memcpy(view.k_ptr(b, i, h), kst + static_cast<std::size_t>(i) * dim, bytes);
          std::memcpy(view.v_ptr(b, i, h), vst + static_cast<std::size_t>(i) * dim, bytes);
        }
      }
    }
  });
  return Status::ok();
}

}  // namespace kvkit
