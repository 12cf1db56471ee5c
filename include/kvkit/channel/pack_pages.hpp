#pragma once
// kvchan's page transforms: pack whole pages of a full-width pool into pages of a packed
// pool (K rows keep their rK selected dims, V rows their rV dims), and unpack them back.
//
// Both pools are PagedKVViews used only for their storage (geometry, bases, strides; the
// page table is ignored), so the full-width side may be an engine's pool in either layout
// and the packed side a PackedPagePool (NHD, K rows of rK, V rows of rV elements). Pair i
// maps page src_pages[i] to page dst_pages[i]; the n_tokens tokens fill slots 0 ..
// page_size - 1 of the pairs in order (only the last pair may be partial), and slots past
// n_tokens are not touched. For head h:
//   pack    packed_k[dst, s, h, c] = full_k[src, s, h, k_channels[h, c]]   (same for V)
//   unpack  full_k[dst, s, h, d]   = packed_k[src, s, h, c] when d = k_channels[h, c],
//                                    else k_fill[h, d] (nullptr: zero); same for V.
// Exact: a copy of elements (the fill goes through from_float, round to nearest even).
// Channel sets are strictly ascending per head (as ChannelSelector stores them).
//
// One contract with the CUDA twin (kernels/cuda/kvchan_pack.cuh): scalars, geometry and
// pointers give a Status at once; page ids outside their pool and channel ids outside
// [0, full dim) or not ascending give kInvalidArgument (on CUDA recorded in the
// DeviceStatus) and nothing is written. Destination pages must be distinct (not checked:
// a repeated destination gets one of its sources' rows, written by two workers at once
// when threaded). Never allocates (beyond the
// std::threads a threaded call without an executor starts, as in every CPU kernel).
//
// Threads: the page pairs are split into ex.threads contiguous chunks (parallel_for of
// kernels/cpu/parallel.hpp, on ex.executor when set); a pair's rows are written by one
// worker, and an element is a copy (or the fill) whatever the chunking, so the output is
// bitwise the same for any thread count.

#include <algorithm>
#include <cstdint>

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace channel {
namespace detail {

/// Host-side checks shared by both backends: views in `ex`'s memory, matching geometry
/// (heads, page size), packed dims within the full dims, counts consistent.
template <class T, class Exec>
Status check_pack_args(const Exec& ex, const PagedKVView<T>& full, const PagedKVView<T>& packed,
                       const std::int32_t* k_channels, const std::int32_t* v_channels,
                       const std::int32_t* src_pages, const std::int32_t* dst_pages,
                       std::int32_t n_pages, std::int32_t n_tokens, const char* op) {
  KVKIT_RETURN_IF_ERROR(kvkit::detail::check_view(full, ex));
  KVKIT_RETURN_IF_ERROR(kvkit::detail::check_view(packed, ex));
  KVKIT_CHECK_STATUS(full.num_kv_heads == packed.num_kv_heads && full.page_size == packed.page_size,
                     StatusCode::kInvalidArgument, op, ": full view has ", full.num_kv_heads,
                     " heads and page_size ", full.page_size, ", packed view ", packed.num_kv_heads,
                     " and ", packed.page_size);
  KVKIT_CHECK_STATUS(packed.head_dim <= full.head_dim && packed.v_head_dim <= full.v_head_dim,
                     StatusCode::kInvalidArgument, op, ": packed dims (", packed.head_dim, ", ",
                     packed.v_head_dim, ") exceed the full dims (", full.head_dim, ", ",
                     full.v_head_dim, ")");
  KVKIT_CHECK_STATUS(n_pages >= 0 && n_tokens >= 0, StatusCode::kInvalidArgument, op,
                     ": n_pages ", n_pages, " and n_tokens ", n_tokens, " must be >= 0");
  const std::int64_t need = (static_cast<std::int64_t>(n_tokens) + full.page_size - 1) / full.page_size;
  KVKIT_CHECK_STATUS(need == n_pages, StatusCode::kInvalidArgument, op, ": ", n_tokens,
                     " tokens fill ", need, " pages of ", full.page_size, ", got n_pages ", n_pages);
  if (n_pages == 0) return Status::ok();
  KVKIT_CHECK_STATUS(k_channels != nullptr && v_channels != nullptr, StatusCode::kInvalidArgument,
                     op, ": k_channels or v_channels is null");
  KVKIT_CHECK_STATUS(src_pages != nullptr && dst_pages != nullptr, StatusCode::kInvalidArgument, op,
                     ": src_pages or dst_pages is null");
  const std::int64_t rows = static_cast<std::int64_t>(n_tokens) * full.num_kv_heads *
                            (static_cast<std::int64_t>(full.head_dim) + full.v_head_dim);
  KVKIT_CHECK_STATUS(rows <= INT32_MAX, StatusCode::kUnsupported, op, ": ", rows,
                     " elements in one call, more than the int32 maximum");
  return Status::ok();
}

/// The CPU side of the device checks: the first bad page id or channel id, with the
/// messages the CUDA twin's DeviceStatus gives (kernels/cuda/common.cuh, to_status).
inline Status check_pack_tables(const std::int32_t* k_channels,  // [heads, rk]
                                const std::int32_t* v_channels,  // [heads, rv]
                                std::int32_t heads, std::int32_t rk, std::int32_t rv,
                                std::int32_t k_dim, std::int32_t v_dim,
                                const std::int32_t* src_pages,  // [n_pages]
                                const std::int32_t* dst_pages,  // [n_pages]
                                std::int32_t n_pages, std::int32_t src_total, std::int32_t dst_total) {
  for (std::int32_t i = 0; i < n_pages; ++i) {
    if (src_pages[i] < 0 || src_pages[i] >= src_total)
      return make_status(StatusCode::kInvalidArgument, "source page id ", src_pages[i], " at position ", i,
                         " out of range [0, ", src_total, ")");
    if (dst_pages[i] < 0 || dst_pages[i] >= dst_total)
      return make_status(StatusCode::kInvalidArgument, "destination page id ", dst_pages[i],
                         " at position ", i, " out of range [0, ", dst_total, ")");
  }
  for (int which = 0; which < 2; ++which) {
    const std::int32_t* ch = which == 0 ? k_channels : v_channels;
    const std::int32_t r = which == 0 ? rk : rv, dim = which == 0 ? k_dim : v_dim;
    const char* name = which == 0 ? "k_channels" : "v_channels";
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t c = 0; c < r; ++c) {
        const std::int32_t x = ch[static_cast<std::int64_t>(h) * r + c];
        if (x < 0 || x >= dim)
          return make_status(StatusCode::kInvalidArgument, name, " entry ", x, " of head ", h, " channel ", c,
                             " out of range [0, ", dim, ")");
        if (c > 0 && x <= ch[static_cast<std::int64_t>(h) * r + c - 1])
          return make_status(StatusCode::kInvalidArgument, name, " entry ", x, " of head ", h, " channel ", c,
                             " is not above the previous entry ", ch[static_cast<std::int64_t>(h) * r + c - 1],
                             ": channel sets must be strictly ascending");
      }
  }
  return Status::ok();
}

// Calls f(src_pages[t / P], dst_pages[t / P], t % P) for every token t < n_tokens of the
// page pairs, the pairs split over ex's threads (a pair's tokens stay on one thread).
template <class F>
void for_each_page_token(exec::Host ex,
                         const std::int32_t* src_pages,  // [n_pages]
                         const std::int32_t* dst_pages,  // [n_pages]
                         std::int32_t n_pages, std::int32_t n_tokens, std::int32_t P, F&& f) {
  kvkit::detail::parallel_for(ex, n_pages, [&](std::int64_t pb, std::int64_t pe, int) {
    const std::int32_t t_end = static_cast<std::int32_t>(std::min<std::int64_t>(pe * P, n_tokens));
    for (std::int32_t t = static_cast<std::int32_t>(pb * P); t < t_end; ++t)
      f(src_pages[t / P], dst_pages[t / P], t % P);
  });
}

}  // namespace detail

/// Packs n_tokens tokens of full-width pages src_pages[i] of `full` into pages
/// dst_pages[i] of `packed` (see the file comment): K rows keep the packed.head_dim dims
/// k_channels[h, :], V rows the packed.v_head_dim dims v_channels[h, :]. Returns
/// kInvalidArgument (nothing written) for bad geometry, counts, page or channel ids.
template <class T>
Status pack_channel_pages(exec::Host ex, PagedKVView<T> full, PagedKVView<T> packed,
                          const std::int32_t* k_channels,  // [Hkv, packed.head_dim] ascending, < full.head_dim
                          const std::int32_t* v_channels,  // [Hkv, packed.v_head_dim] ascending, < full.v_head_dim
                          const std::int32_t* src_pages,   // [n_pages] pages of `full`
                          const std::int32_t* dst_pages,   // [n_pages] pages of `packed`, distinct
                          std::int32_t n_pages, std::int32_t n_tokens) {
  KVKIT_RETURN_IF_ERROR(detail::check_pack_args(ex, full, packed, k_channels, v_channels, src_pages, dst_pages,
                                                n_pages, n_tokens, "pack_channel_pages"));
  if (n_pages == 0) return Status::ok();
  const std::int32_t H = full.num_kv_heads, rk = packed.head_dim, rv = packed.v_head_dim, P = full.page_size;
  KVKIT_RETURN_IF_ERROR(detail::check_pack_tables(k_channels, v_channels, H, rk, rv, full.head_dim,
                                                  full.v_head_dim, src_pages, dst_pages, n_pages,
                                                  full.num_pages_total, packed.num_pages_total));
  detail::for_each_page_token(ex, src_pages, dst_pages, n_pages, n_tokens, P,
                              [&](std::int32_t src, std::int32_t dst, std::int32_t s) {
    for (std::int32_t h = 0; h < H; ++h) {
      const T* fk = full.k_data + full.k_offset(src, s, h);
      const T* fv = full.v_data + full.v_offset(src, s, h);
      T* pk = packed.k_data + packed.k_offset(dst, s, h);
      T* pv = packed.v_data + packed.v_offset(dst, s, h);
      const std::int32_t* kc = k_channels + static_cast<std::int64_t>(h) * rk;
      const std::int32_t* vc = v_channels + static_cast<std::int64_t>(h) * rv;
      for (std::int32_t c = 0; c < rk; ++c) pk[c] = fk[kc[c]];
      for (std::int32_t c = 0; c < rv; ++c) pv[c] = fv[vc[c]];
    }
  });
  return Status::ok();
}

/// The inverse of pack_channel_pages: n_tokens tokens of packed pages src_pages[i] of
/// `packed` are scattered to full-width pages dst_pages[i] of `full`; dims outside a
/// head's set get k_fill[h, d] / v_fill[h, d] (nullptr: zero). Same errors as packing.
template <class T>
Status unpack_channel_pages(exec::Host ex, PagedKVView<T> packed, PagedKVView<T> full,
                            const std::int32_t* k_channels,  // [Hkv, packed.head_dim] ascending
                            const std::int32_t* v_channels,  // [Hkv, packed.v_head_dim] ascending
                            const float* k_fill,             // [Hkv, full.head_dim] or nullptr
                            const float* v_fill,             // [Hkv, full.v_head_dim] or nullptr
                            const std::int32_t* src_pages,   // [n_pages] pages of `packed`
                            const std::int32_t* dst_pages,   // [n_pages] pages of `full`, distinct
                            std::int32_t n_pages, std::int32_t n_tokens) {
  KVKIT_RETURN_IF_ERROR(detail::check_pack_args(ex, full, packed, k_channels, v_channels, src_pages, dst_pages,
                                                n_pages, n_tokens, "unpack_channel_pages"));
  if (n_pages == 0) return Status::ok();
  const std::int32_t H = full.num_kv_heads, rk = packed.head_dim, rv = packed.v_head_dim, P = full.page_size;
  const std::int32_t D = full.head_dim, Dv = full.v_head_dim;
  KVKIT_RETURN_IF_ERROR(detail::check_pack_tables(k_channels, v_channels, H, rk, rv, D, Dv, src_pages,
                                                  dst_pages, n_pages, packed.num_pages_total,
                                                  full.num_pages_total));
  detail::for_each_page_token(ex, src_pages, dst_pages, n_pages, n_tokens, P,
                              [&](std::int32_t src, std::int32_t dst, std::int32_t s) {
    for (std::int32_t h = 0; h < H; ++h) {
      const T* pk = packed.k_data + packed.k_offset(src, s, h);
      const T* pv = packed.v_data + packed.v_offset(src, s, h);
      T* fk = full.k_data + full.k_offset(dst, s, h);
      T* fv = full.v_data + full.v_offset(dst, s, h);
      const std::int32_t* kc = k_channels + static_cast<std::int64_t>(h) * rk;
      const std::int32_t* vc = v_channels + static_cast<std::int64_t>(h) * rv;
      const float* kf = k_fill != nullptr ? k_fill + static_cast<std::int64_t>(h) * D : nullptr;
      const float* vf = v_fill != nullptr ? v_fill + static_cast<std::int64_t>(h) * Dv : nullptr;
      for (std::int32_t d = 0; d < D; ++d) fk[d] = from_float<T>(kf != nullptr ? kf[d] : 0.f);
      for (std::int32_t d = 0; d < Dv; ++d) fv[d] = from_float<T>(vf != nullptr ? vf[d] : 0.f);
      for (std::int32_t c = 0; c < rk; ++c) fk[kc[c]] = pk[c];
      for (std::int32_t c = 0; c < rv; ++c) fv[vc[c]] = pv[c];
    }
  });
  return Status::ok();
}

}  // namespace channel
}  // namespace kvkit
