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

/// Most kv heads one item of compact_tokens' in-place pass moves together (its per-head
/// cursors live on the stack); more heads are split into items of at most this many.
inline constexpr std::int32_t kCompactMaxHeads = 32;

/// Total K+V bytes from which compact_tokens writes with non-temporal stores: far more
/// than the caches hold, where the destination lines would otherwise be read before they
/// are written and would evict source rows still to be read. Below it, cached stores
/// leave the compacted rows in cache for the next attention step.
inline constexpr std::size_t kCompactStreamBytes = std::size_t{16} << 20;

/// The in-place pass of compact_tokens for sequence b and kv heads [h0, h0 + hc), each
/// with a strictly ascending keep list (keep + (h0 + j) * keep_stride, nk entries), so
/// keep[i] >= i and every source row is read before its slot is overwritten.
///
/// The heads advance through the sequence's source pages together, so each source page
/// is read once, as one block, whatever the layout, instead of once per head; each head
/// keeps its own destination cursor. Within a page: in NHD-like layouts (heads of a token
/// adjacent) slot outer, head inner, reading the page in address order; otherwise head
/// outer, with consecutive kept slots that are also consecutive in the destination page
/// moved as one run when rows are packed (HND). One page-table load per source and per
/// destination page, rows addressed by pointer increments, the leading rows already in
/// place (keep[i] == i) skipped. While page p is moved, the chunk's rows of page p + 1
/// are prefetched. `move` (CachedRowMove or StreamingRowMove) copies each run.
template <class T, class Move>
void compact_heads_ascending(const PagedKVView<T>& view, std::int32_t b, std::int32_t h0,
                             std::int32_t hc,
                             const std::int32_t* keep,  // [Hkv, keep_stride] of sequence b
                             std::int32_t keep_stride, std::int32_t nk, Move move) {
  struct Cursor {
    const std::int32_t* kl;  // [nk] this head's keep list
    std::int32_t i;          // next entry of kl to move (== its destination token)
    std::int32_t dpi, dslot; // destination logical page and slot of token i
    T* kd;                   // [Dk] destination K row of token i
    T* vd;                   // [Dv] destination V row of token i
  };
  Cursor cur[kCompactMaxHeads];
  const std::int32_t ps = view.page_size;
  const std::size_t k_bytes = sizeof(T) * static_cast<std::size_t>(view.head_dim);
  const std::size_t v_bytes = sizeof(T) * static_cast<std::size_t>(view.v_head_dim);
  const std::int64_t kst = view.k_stride_token, vst = view.v_stride_token;
  const bool packed = kst == view.head_dim && vst == view.v_head_dim;
  // Heads of a token adjacent (NHD-like): move the page slot by slot, all heads of a
  // slot together, so the page is read in address order and each destination token row
  // is written by all heads close together.
  const bool token_outer =
      !packed && hc > 1 && kst > view.k_stride_head && vst > view.v_stride_head;
  // Prefetches the rows of heads [h0, h0 + hc) in a page: as one span when the span is
  // dense (a whole NHD page, a chunk of HND head blocks), else row by row.
  auto prefetch_page_rows = [&](const T* base, std::size_t row_bytes, auto offset) {
    const std::int64_t lo = offset(0, h0), hi = offset(ps - 1, h0 + hc - 1);
    const std::size_t useful = static_cast<std::size_t>(ps) * hc * row_bytes;
    if (hi >= lo && sizeof(T) * static_cast<std::size_t>(hi - lo) + row_bytes <= 2 * useful) {
      prefetch_bytes(base + lo, sizeof(T) * static_cast<std::size_t>(hi - lo) + row_bytes);
      return;
    }
    for (std::int32_t j = 0; j < hc; ++j)
      for (std::int32_t t = 0; t < ps; ++t) prefetch_bytes(base + offset(t, h0 + j), row_bytes);
  };
  std::int32_t sp0 = 0, sp1 = -1;  // logical source pages holding rows to move
  for (std::int32_t j = 0; j < hc; ++j) {
    Cursor& c = cur[j];
    const std::int32_t h = h0 + j;
    c.kl = keep + static_cast<std::int64_t>(h) * keep_stride;
    c.i = 0;
    while (c.i < nk && c.kl[c.i] == c.i) ++c.i;  // already in place; later kl[i] > i
    c.dpi = c.i / ps;
    c.dslot = c.i - c.dpi * ps;
    c.kd = c.vd = nullptr;
    if (c.i == nk) continue;
    const std::int32_t dp = view.page_id(b, c.dpi);
    c.kd = view.k_data + view.k_offset(dp, c.dslot, h);
    c.vd = view.v_data + view.v_offset(dp, c.dslot, h);
    const std::int32_t first = c.kl[c.i] / ps, last = c.kl[nk - 1] / ps;
    if (sp1 < 0 || first < sp0) sp0 = first;
    if (last > sp1) sp1 = last;
  }
  for (std::int32_t spi = sp0; spi <= sp1; ++spi) {
    const std::int32_t page = view.page_id(b, spi);
    const std::int32_t next = spi < sp1 ? view.page_id(b, spi + 1) : -1;
    const std::int32_t first = spi * ps, limit = first + ps;
    if (next >= 0) {
      prefetch_page_rows(view.k_data, k_bytes, [&](std::int32_t t, std::int32_t h) {
        return view.k_offset(next, t, h);
      });
      prefetch_page_rows(view.v_data, v_bytes, [&](std::int32_t t, std::int32_t h) {
        return view.v_offset(next, t, h);
      });
    }
    if (token_outer) {
      // Heads of a token adjacent (NHD): slot outer, head inner, so the page is read in
      // address order; each head's next kept row is moved when its slot comes up.
      const T* ks0 = view.k_data + view.k_offset(page, 0, 0);
      const T* vs0 = view.v_data + view.v_offset(page, 0, 0);
      for (std::int32_t t = first; t < limit; ++t) {
        for (std::int32_t j = 0; j < hc; ++j) {
          Cursor& c = cur[j];
          if (c.i >= nk || c.kl[c.i] != t) continue;
          const std::int32_t h = h0 + j;
          if (c.dslot == ps) {  // next destination page
            ++c.dpi;
            c.dslot = 0;
            const std::int32_t dp = view.page_id(b, c.dpi);
            c.kd = view.k_data + view.k_offset(dp, 0, h);
            c.vd = view.v_data + view.v_offset(dp, 0, h);
          }
          const std::int64_t slot = t - first;
          move(c.kd, ks0 + slot * kst + h * view.k_stride_head, k_bytes);
          move(c.vd, vs0 + slot * vst + h * view.v_stride_head, v_bytes);
          c.kd += kst;
          c.vd += vst;
          ++c.dslot;
          ++c.i;
        }
      }
      continue;
    }
    for (std::int32_t j = 0; j < hc; ++j) {
      Cursor& c = cur[j];
      const std::int32_t h = h0 + j;
      const std::int32_t* kl = c.kl;
      std::int32_t i = c.i;
      if (i < nk && kl[i] < limit) {
        const T* ks = view.k_data + view.k_offset(page, 0, h);
        const T* vs = view.v_data + view.v_offset(page, 0, h);
        T* kd = c.kd;
        T* vd = c.vd;
        std::int32_t dslot = c.dslot;
        while (i < nk && kl[i] < limit) {
          if (dslot == ps) {  // next destination page
            ++c.dpi;
            dslot = 0;
            const std::int32_t dp = view.page_id(b, c.dpi);
            kd = view.k_data + view.k_offset(dp, 0, h);
            vd = view.v_data + view.v_offset(dp, 0, h);
          }
          const std::int32_t slot = kl[i] - first;
          std::int32_t r = 1;
          if (packed) {
            const std::int32_t max_r = std::min({nk - i, ps - dslot, ps - slot});
            while (r < max_r && kl[i + r] == kl[i] + r) ++r;
          }
          const std::size_t n = static_cast<std::size_t>(r);
          move(kd, ks + slot * kst, k_bytes * n);
          move(vd, vs + slot * vst, v_bytes * n);
          kd += kst * r;
          vd += vst * r;
          dslot += r;
          i += r;
        }
        c.i = i;
        c.kd = kd;
        c.vd = vd;
        c.dslot = dslot;
      }
    }
  }
  move.fence();
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
/// are staged through the workspace. The ascending pass moves the heads of a sequence
/// through its source pages together (each page read once; one page-table load per page;
/// rows already in place skipped; consecutive kept slots moved as one run; the next page
/// prefetched), with non-temporal stores when the call moves at least
/// kCompactStreamBytes. The pages of the sequences being compacted must not be shared
/// with other sequences (copy them first with copy_pages).
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
  // Items are (sequence, chunk of heads): the in-place pass moves a chunk's heads through
  // the source pages together; chunks split the heads only to feed the threads (or past
  // kCompactMaxHeads), and results never depend on the chunking.
  const std::int32_t hpi =
      detail::heads_per_item(ex, view.batch_size, hkv, detail::cpu::kCompactMaxHeads);
  const std::int32_t chunks = hkv / hpi;
  std::size_t total = 0;  // upper bound of the bytes moved, for the store kind
  for (std::int32_t b = 0; b < view.batch_size; ++b)
    total += static_cast<std::size_t>(num_keep[b]) * hkv * (bytes + v_bytes);
  // Non-temporal stores for big passes, where stream_lines' preconditions hold for every
  // run: whole 64-byte lines, 16-byte aligned rows (runs move forward by whole rows of a
  // non-aliasing view, so dst <= src - 64 when they overlap).
  auto aligned16 = [](std::int64_t elems) { return (elems * sizeof(T)) % 16 == 0; };
  const bool stream =
      detail::cpu::kCanStreamRows && total >= detail::cpu::kCompactStreamBytes &&
      bytes % 64 == 0 && v_bytes % 64 == 0 &&
      reinterpret_cast<std::uintptr_t>(view.k_data) % 16 == 0 &&
      reinterpret_cast<std::uintptr_t>(view.v_data) % 16 == 0 &&
      aligned16(view.k_stride_page) && aligned16(view.k_stride_token) &&
      aligned16(view.k_stride_head) && aligned16(view.v_stride_page) &&
      aligned16(view.v_stride_token) && aligned16(view.v_stride_head);
  const std::int64_t items = static_cast<std::int64_t>(view.batch_size) * chunks;
  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int worker) {
    T* kst = staging + static_cast<std::size_t>(worker) * slice;
    T* vst = kst + static_cast<std::size_t>(keep_stride) * dim;
    for (std::int64_t it = begin; it < end; ++it) {
      const std::int32_t b = static_cast<std::int32_t>(it / chunks);
      const std::int32_t h0 = static_cast<std::int32_t>(it % chunks) * hpi;
      const std::int32_t nk = num_keep[b];
      if (nk == 0) continue;
      const std::int32_t* kb = keep + static_cast<std::int64_t>(b) * hkv * keep_stride;
      // Heads with ascending lists move in one in-place pass; the others are staged.
      std::int32_t asc_begin = h0, asc_end = h0;  // a run of ascending heads
      auto flush = [&] {
        if (asc_end == asc_begin) return;
        if (stream)
          detail::cpu::compact_heads_ascending(view, b, asc_begin, asc_end - asc_begin, kb,
                                               keep_stride, nk, detail::cpu::StreamingRowMove{});
        else
          detail::cpu::compact_heads_ascending(view, b, asc_begin, asc_end - asc_begin, kb,
                                               keep_stride, nk, detail::cpu::CachedRowMove{});
      };
      for (std::int32_t h = h0; h < h0 + hpi; ++h) {
        const std::int32_t* kl = kb + static_cast<std::int64_t>(h) * keep_stride;
        bool ascending = true;
        for (std::int32_t i = 1; i < nk && ascending; ++i) ascending = kl[i] > kl[i - 1];
        if (ascending) {
          asc_end = h + 1;
          continue;
        }
        flush();
        asc_begin = asc_end = h + 1;
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
      flush();
    }
  });
  return Status::ok();
}

}  // namespace kvkit
