#pragma once
// gather_tokens and compact_tokens on the CPU: read selected tokens out of a sequence,
// and rewrite a sequence so that it holds only the kept tokens of each head, in order.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/cpu/checks.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/cpu/row_copy.hpp"
#include "kvkit/kernels/cpu/write_kv.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace detail {
namespace cpu {

/// Steps to prefetch ahead when each step moves `step_bytes` from scattered rows: about
/// 8 KiB of reads in flight (4 to 64 KiB measured alike on the reference machine).
inline std::int32_t rows_ahead(std::size_t step_bytes) {
  return static_cast<std::int32_t>(
      std::max<std::size_t>(1, 8192 / std::max<std::size_t>(1, step_bytes)));
}


/// The in-place pass of compact_tokens for one (sequence b, kv head h) whose keep list
/// kl[0..nk) is strictly ascending, so kl[i] >= i and every source row is read before its
/// slot is overwritten. Walks the kept rows source page by source page: one page-table
/// load per source page and per destination page, row addresses by pointer increments;
/// rows already in place (the prefix where kl[i] == i) are skipped; consecutive kept
/// slots that are also consecutive in the destination page are moved as one run when
/// rows are packed; the kept rows `ahead` positions ahead are prefetched.
template <class T>
void compact_head_ascending(const PagedKVView<T>& view, std::int32_t b, std::int32_t h,
                            const std::int32_t* kl,  // [nk] strictly ascending
                            std::int32_t nk, std::int32_t ahead) {
  const std::int32_t ps = view.page_size;
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(view.head_dim);
  const std::size_t v_bytes = sizeof(T) * static_cast<std::size_t>(view.v_head_dim);
  const std::int64_t kst = view.k_stride_token, vst = view.v_stride_token;
  const bool packed = kst == view.head_dim && vst == view.v_head_dim;
  std::int32_t i = 0;
  while (i < nk && kl[i] == i) ++i;  // already in place
  if (i == nk) return;
  // Prefetch cursor: kept rows up to `pf` have been prefetched.
  PageCursor pre;
  std::int32_t pf = i;
  auto prefetch_to = [&](std::int32_t upto) {
    for (; pf < std::min(nk, upto); ++pf) {
      pre.seek(view, b, kl[pf]);
      prefetch_bytes(view.k_data + view.k_offset(pre.page, pre.slot, h), bytes);
      prefetch_bytes(view.v_data + view.v_offset(pre.page, pre.slot, h), v_bytes);
    }
  };
  prefetch_to(i + ahead);
  // Destination: row i of logical page i / ps.
  std::int32_t dpi = i / ps, dslot = i - dpi * ps;
  T* kd = view.k_data + view.k_offset(view.page_id(b, dpi), dslot, h);
  T* vd = view.v_data + view.v_offset(view.page_id(b, dpi), dslot, h);
  while (i < nk) {
    // One source page: kept rows i..j of logical page spi.
    const std::int32_t t0 = kl[i];
    const std::int32_t spi = t0 / ps, first = spi * ps;
    const std::int32_t page = view.page_id(b, spi);
    const T* ks = view.k_data + view.k_offset(page, 0, h);
    const T* vs = view.v_data + view.v_offset(page, 0, h);
    const std::int32_t limit = first + ps;
    while (i < nk && kl[i] < limit) {
      prefetch_to(i + ahead);
      if (dslot == ps) {  // next destination page
        ++dpi;
        dslot = 0;
        const std::int32_t dp = view.page_id(b, dpi);
        kd = view.k_data + view.k_offset(dp, 0, h);
        vd = view.v_data + view.v_offset(dp, 0, h);
      }
      const std::int32_t slot = kl[i] - first;
      std::int32_t r = 1;
      if (packed) {
        const std::int32_t max_r = std::min({nk - i, ps - dslot, ps - slot});
        while (r < max_r && kl[i + r] == kl[i] + r) ++r;
      }
      if (kl[i] != i) {
        copy_rows(kd, ks + slot * kst, bytes * static_cast<std::size_t>(r));
        copy_rows(vd, vs + slot * vst, v_bytes * static_cast<std::size_t>(r));
      }
      kd += kst * r;
      vd += vst * r;
      dslot += r;
      i += r;
    }
  }
}

}  // namespace cpu
}  // namespace detail

namespace detail {
namespace cpu {

/// gather_tokens' body for a pool of dtype T and outputs of dtype O (T or float).
template <class T, class O>
Status gather_tokens_impl(exec::Host ex, PagedKVView<T> view, std::int32_t seq,
                          const std::int32_t* token_ids,  // [n] or nullptr for 0..n-1
                          std::int32_t n,
                          O* k_out,    // [Hkv, n, D]
                          O* v_out) {  // [Hkv, n, Dv]
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
  const std::int32_t dim = view.head_dim, vdim = view.v_head_dim, hkv = view.num_kv_heads;
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(dim);
  const std::size_t v_bytes = sizeof(T) * static_cast<std::size_t>(vdim);
  const std::int64_t ksh = view.k_stride_head, vsh = view.v_stride_head;
  auto token = [&](std::int64_t i) {
    return token_ids ? token_ids[i] : static_cast<std::int32_t>(i);
  };
  if (view.k_layout == KVLayout::kNHD && view.v_layout == KVLayout::kNHD) {
    // Heads of a token are adjacent (NHD): one item per output token, all heads at once,
    // so each token's row is read in one pass.
    const std::int32_t ahead = detail::cpu::rows_ahead(bytes * hkv);
    detail::parallel_for(ex, n, [&](std::int64_t begin, std::int64_t end, int) {
      detail::PageCursor cur, pre;
      for (std::int64_t i = begin; i < end; ++i) {
        if (i == begin || i + ahead < end) {  // prefetch the first rows, then `ahead` on
          for (std::int64_t j = i == begin ? i : i + ahead; j < std::min(end, i + ahead + 1); ++j) {
            pre.seek(view, seq, token(j));
            for (std::int32_t h = 0; h < hkv; ++h) {
              detail::prefetch_bytes(view.k_data + view.k_offset(pre.page, pre.slot, h), bytes);
              detail::prefetch_bytes(view.v_data + view.v_offset(pre.page, pre.slot, h), v_bytes);
            }
          }
        }
        cur.seek(view, seq, token(i));
        const T* ks = view.k_data + view.k_offset(cur.page, cur.slot, 0);
        const T* vs = view.v_data + view.v_offset(cur.page, cur.slot, 0);
        for (std::int32_t h = 0; h < hkv; ++h) {
          detail::cpu::move_row(k_out + (static_cast<std::int64_t>(h) * n + i) * dim, ks + h * ksh,
                                static_cast<std::size_t>(dim));
          detail::cpu::move_row(v_out + (static_cast<std::int64_t>(h) * n + i) * vdim, vs + h * vsh,
                                static_cast<std::size_t>(vdim));
        }
      }
    });
    return Status::ok();
  }
  // Head-major: item it = h * n + i (the output row). Runs of consecutive token ids within
  // one page are contiguous on both sides when rows are packed, so they take one copy.
  const bool packed = view.k_stride_token == dim && view.v_stride_token == vdim;
  const std::int32_t ahead = detail::cpu::rows_ahead(bytes);
  const std::int64_t items = static_cast<std::int64_t>(hkv) * n;
  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int) {
    detail::PageCursor cur, pre;
    std::int64_t next_pf = begin;
    for (std::int64_t it = begin; it < end;) {
      const std::int32_t h = static_cast<std::int32_t>(it / n);
      const std::int64_t i = it % n;
      const std::int32_t t = token(i);
      cur.seek(view, seq, t);
      std::int64_t r = 1;
      if (packed) {
        const std::int64_t max_r = std::min<std::int64_t>({end - it, n - i, cur.size - cur.slot});
        while (r < max_r && token(i + r) == t + r) ++r;
      }
      for (; next_pf < std::min(end, it + r + ahead); ++next_pf) {
        const std::int32_t ph = static_cast<std::int32_t>(next_pf / n);
        pre.seek(view, seq, token(next_pf % n));
        detail::prefetch_bytes(view.k_data + view.k_offset(pre.page, pre.slot, ph), bytes);
        detail::prefetch_bytes(view.v_data + view.v_offset(pre.page, pre.slot, ph), v_bytes);
      }
      const std::size_t run = static_cast<std::size_t>(r);
      detail::cpu::move_row(k_out + it * dim, view.k_data + view.k_offset(cur.page, cur.slot, h),
                            static_cast<std::size_t>(dim) * run);
      detail::cpu::move_row(v_out + it * vdim, view.v_data + view.v_offset(cur.page, cur.slot, h),
                            static_cast<std::size_t>(vdim) * run);
      it += r;
    }
  });
  return Status::ok();
}

}  // namespace cpu
}  // namespace detail

/// Copies tokens token_ids[0..n) of sequence `seq` (or tokens 0..n-1 when token_ids is
/// nullptr) into dense head-major buffers: k_out[h, i, :] = K[seq, token_ids[i], h].
/// Returns kOutOfRange naming a token id outside [0, seq_len(seq)) or a bad sequence.
template <class T>
Status gather_tokens(exec::Host ex, PagedKVView<T> view, std::int32_t seq,
                     const std::int32_t* token_ids,  // [n] or nullptr for 0..n-1
                     std::int32_t n,
                     T* k_out,    // [Hkv, n, D]
                     T* v_out) {  // [Hkv, n, Dv]
  return detail::cpu::gather_tokens_impl(ex, view, seq, token_ids, n, k_out, v_out);
}

/// gather_tokens of a half or bfloat16 pool into float outputs (e.g. keys for a scorer
/// that works in float): each row is widened as it is copied, bit for bit what to_float
/// gives, with the vectorised converters of simd.hpp. Same checks and semantics.
template <class T, class = std::enable_if_t<!std::is_same<T, float>::value>>
Status gather_tokens(exec::Host ex, PagedKVView<T> view, std::int32_t seq,
                     const std::int32_t* token_ids,  // [n] or nullptr for 0..n-1
                     std::int32_t n,
                     float* k_out,    // [Hkv, n, D]
                     float* v_out) {  // [Hkv, n, Dv]
  return detail::cpu::gather_tokens_impl(ex, view, seq, token_ids, n, k_out, v_out);
}

/// Bytes of workspace compact_tokens needs: one staging slice of keep_stride K and V rows
/// per worker thread of `ex` (used only for keep lists that are not strictly ascending).
template <class T>
std::size_t compact_tokens_workspace_size(exec::Host ex, const PagedKVView<T>& view,
                                          std::int32_t keep_stride) {
  if (keep_stride <= 0 || view.head_dim <= 0 || view.v_head_dim <= 0) return 0;
  const std::size_t slice =
      static_cast<std::size_t>(keep_stride) * (static_cast<std::size_t>(view.head_dim) + view.v_head_dim);
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
/// are staged through the workspace. The ascending pass walks each head's kept rows
/// source page by source page (one page-table load per page, rows already in place
/// skipped, consecutive kept slots moved as one run, rows prefetched ahead). The pages of the sequences being compacted must not
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
  const std::int32_t dim = view.head_dim, vdim = view.v_head_dim;
  const std::size_t slice =
      static_cast<std::size_t>(keep_stride) * (static_cast<std::size_t>(dim) + vdim);
  T* staging =
      WorkspaceCarver(ws).take<T>(slice * detail::host_workers(ex, detail::kMaxHostThreads));
  if (staging == nullptr)
    return make_status(StatusCode::kInvalidArgument, "workspace of ", ws.bytes, " bytes too small");
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(dim);
  const std::size_t v_bytes = sizeof(T) * static_cast<std::size_t>(vdim);
  // One (sequence, head) per item in either layout: heads choose their rows
  // independently, and a head's pass walks its own kept rows page by page.
  const std::int32_t ahead = detail::cpu::rows_ahead(bytes + v_bytes);
  const std::int64_t items = static_cast<std::int64_t>(view.batch_size) * hkv;
  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int worker) {
    T* kst = staging + static_cast<std::size_t>(worker) * slice;
    T* vst = kst + static_cast<std::size_t>(keep_stride) * dim;
    for (std::int64_t it = begin; it < end; ++it) {
      const std::int32_t b = static_cast<std::int32_t>(it / hkv);
      const std::int32_t h = static_cast<std::int32_t>(it % hkv);
      const std::int32_t nk = num_keep[b];
      if (nk == 0) continue;
      const std::int32_t* kl = keep + (static_cast<std::int64_t>(b) * hkv + h) * keep_stride;
      bool ascending = true;
      for (std::int32_t i = 1; i < nk && ascending; ++i) ascending = kl[i] > kl[i - 1];
      if (ascending) {
        detail::cpu::compact_head_ascending(view, b, h, kl, nk, ahead);
        continue;
      }
      // Any order: stage the kept rows, then write them back in order.
      detail::PageCursor cur;
      for (std::int32_t i = 0; i < nk; ++i) {
        cur.seek(view, b, kl[i]);
        std::memcpy(kst + static_cast<std::size_t>(i) * dim,
                    view.k_data + view.k_offset(cur.page, cur.slot, h), bytes);
        std::memcpy(vst + static_cast<std::size_t>(i) * vdim,
                    view.v_data + view.v_offset(cur.page, cur.slot, h), v_bytes);
      }
      for (std::int32_t i = 0; i < nk; ++i) {
        cur.seek(view, b, i);
        std::memcpy(view.k_data + view.k_offset(cur.page, cur.slot, h),
                    kst + static_cast<std::size_t>(i) * dim, bytes);
        std::memcpy(view.v_data + view.v_offset(cur.page, cur.slot, h),
                    vst + static_cast<std::size_t>(i) * vdim, v_bytes);
      }
    }
  });
  return Status::ok();
}

}  // namespace kvkit
