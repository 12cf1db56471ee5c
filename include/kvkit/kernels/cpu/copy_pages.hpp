#pragma once
// copy_pages on the CPU: whole-page copies inside one pool (copy-on-write, defrag).

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/cpu/checks.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace detail {
namespace cpu {

/// Pools up to this many pages are checked for src/dst clashes with on-stack bitsets
/// (2 x 16 KiB); larger pools fall back to a quadratic scan, still allocation-free.
inline constexpr std::int32_t kCopyPagesBitsetPages = 1 << 17;

/// True when the tokens and heads of one page pack into a single dense block of
/// page_size*heads*head_dim elements (NHD or HND order), so the page is one memcpy even
/// when pages themselves are further apart (e.g. K and V pages interleaved).
inline bool page_is_dense(std::int64_t sp, std::int64_t st, std::int64_t sh, std::int32_t page_size,
                          std::int32_t heads, std::int32_t dim) {
  const std::int64_t elems = static_cast<std::int64_t>(page_size) * heads * dim;
  if (sp < elems) return false;
  const bool nhd =
      (page_size == 1 || st == static_cast<std::int64_t>(heads) * dim) && (heads == 1 || sh == dim);
  const bool hnd = (heads == 1 || sh == static_cast<std::int64_t>(page_size) * dim) &&
                   (page_size == 1 || st == dim);
  return nhd || hnd;
}

/// Copies page src to page dst of one pool (every token slot and head), one memcpy when
/// `dense`, else row by row.
template <class T>
void copy_one_page(T* base,  // pool: pages sp apart, tokens st, heads sh, rows contiguous
                   std::int64_t sp, std::int64_t st, std::int64_t sh, bool dense,
                   std::int32_t page_size, std::int32_t heads, std::int32_t dim, std::int32_t src,
                   std::int32_t dst) {
  const T* s = base + src * sp;
  T* d = base + dst * sp;
  if (dense) {
    const std::size_t elems = static_cast<std::size_t>(page_size) * heads * dim;
    std::memcpy(d, s, sizeof(T) * elems);
    return;
  }
  const std::size_t bytes = sizeof(T) * static_cast<std::size_t>(dim);
  for (std::int32_t t = 0; t < page_size; ++t)
    for (std::int32_t h = 0; h < heads; ++h)
      std::memcpy(d + t * st + h * sh, s + t * st + h * sh, bytes);
}

}  // namespace cpu
}  // namespace detail

/// Copies all tokens and heads of K and V of page src_pages[i] to page dst_pages[i] of
/// the same pool, for i < n. The same source may feed several destinations, but a
/// destination may appear only once and never as a source (so the result does not depend
/// on order or threads). Ids must be in [0, view.num_pages_total). Returns
/// kInvalidArgument naming the offending id; nothing is copied when a check fails.
/// Dense pages are copied with one memcpy each, strided ones row by row.
template <class T>
Status copy_pages(exec::Host ex, PagedKVView<T> view,
                  const std::int32_t* src_pages,  // [n]
                  const std::int32_t* dst_pages,  // [n]
                  std::int32_t n) {
  KVKIT_RETURN_IF_ERROR(detail::check_host_view(view, /*check_table=*/false));
  KVKIT_CHECK_STATUS(n >= 0, StatusCode::kInvalidArgument, "n must be >= 0, got ", n);
  if (n == 0) return Status::ok();
  KVKIT_CHECK_STATUS(src_pages != nullptr && dst_pages != nullptr, StatusCode::kInvalidArgument,
                     "copy_pages got a null src_pages or dst_pages");
  const std::int32_t np = view.num_pages_total;
  for (std::int32_t i = 0; i < n; ++i) {
    KVKIT_CHECK_STATUS(src_pages[i] >= 0 && src_pages[i] < np, StatusCode::kInvalidArgument,
                       "source page id ", src_pages[i], " at position ", i, " out of range [0, ",
                       np, ")");
    KVKIT_CHECK_STATUS(dst_pages[i] >= 0 && dst_pages[i] < np, StatusCode::kInvalidArgument,
                       "destination page id ", dst_pages[i], " at position ", i,
                       " out of range [0, ", np, ")");
  }
  if (np <= detail::cpu::kCopyPagesBitsetPages) {
    std::bitset<detail::cpu::kCopyPagesBitsetPages> is_src, is_dst;
    for (std::int32_t i = 0; i < n; ++i) is_src.set(static_cast<std::size_t>(src_pages[i]));
    for (std::int32_t i = 0; i < n; ++i) {
      const auto d = static_cast<std::size_t>(dst_pages[i]);
      KVKIT_CHECK_STATUS(!is_src.test(d), StatusCode::kInvalidArgument, "destination page id ",
                         dst_pages[i], " at position ", i, " is also a source page");
      KVKIT_CHECK_STATUS(!is_dst.test(d), StatusCode::kInvalidArgument, "destination page id ",
                         dst_pages[i], " at position ", i, " is repeated");
      is_dst.set(d);
    }
  } else {
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t j = 0; j < n; ++j) {
        KVKIT_CHECK_STATUS(dst_pages[i] != src_pages[j], StatusCode::kInvalidArgument,
                           "destination page id ", dst_pages[i], " at position ", i,
                           " is also a source page");
        KVKIT_CHECK_STATUS(j >= i || dst_pages[i] != dst_pages[j], StatusCode::kInvalidArgument,
                           "destination page id ", dst_pages[i], " at position ", i,
                           " is repeated");
      }
  }
  const std::int32_t ps = view.page_size, hkv = view.num_kv_heads;
  const std::int32_t dim = view.head_dim, vdim = view.v_head_dim;
  const bool k_dense = detail::cpu::page_is_dense(view.k_stride_page, view.k_stride_token,
                                                  view.k_stride_head, ps, hkv, dim);
  const bool v_dense = detail::cpu::page_is_dense(view.v_stride_page, view.v_stride_token,
                                                  view.v_stride_head, ps, hkv, vdim);
  detail::parallel_for(ex, n, [&](std::int64_t begin, std::int64_t end, int) {
    for (std::int64_t i = begin; i < end; ++i) {
      detail::cpu::copy_one_page(view.k_data, view.k_stride_page, view.k_stride_token,
                                 view.k_stride_head, k_dense, ps, hkv, dim, src_pages[i],
                                 dst_pages[i]);
      detail::cpu::copy_one_page(view.v_data, view.v_stride_page, view.v_stride_token,
                                 view.v_stride_head, v_dense, ps, hkv, vdim, src_pages[i],
                                 dst_pages[i]);
    }
  });
  return Status::ok();
}

}  // namespace kvkit
