#pragma once
// Non-throwing argument checks shared by the CPU kernels.
//
// PagedKVView::validate_page_table() throws and is meant for table construction; run
// paths instead call these, which return a Status naming the first bad value. They read
// the page table, so they are only for host-resident views.

#include <cstdint>

#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace detail {

/// Storage pointers and geometry a kernel relies on (make_*_view guarantees these; a
/// hand-filled view may not).
template <class T>
Status check_host_view_storage(const PagedKVView<T>& v) {
  KVKIT_CHECK_STATUS(v.k_data != nullptr && v.v_data != nullptr, StatusCode::kInvalidArgument,
                     "view has a null K or V base pointer");
  KVKIT_CHECK_STATUS(
      v.num_kv_heads > 0 && v.head_dim > 0 && v.page_size > 0 && v.num_pages_total > 0,
      StatusCode::kInvalidArgument, "view geometry must be positive, got heads=", v.num_kv_heads,
      " head_dim=", v.head_dim, " page_size=", v.page_size, " num_pages=", v.num_pages_total);
  KVKIT_CHECK_STATUS(v.batch_size >= 0, StatusCode::kInvalidArgument,
                     "batch_size must be >= 0, got ", v.batch_size);
  return Status::ok();
}

/// Checks the page-table entries of sequence b (lengths, last_page_len, page ids).
template <class T>
Status check_sequence_pages(const PagedKVView<T>& v, std::int32_t b) {
  if (v.table_kind == PageTableKind::kCsr) {
    KVKIT_CHECK_STATUS(v.indptr != nullptr, StatusCode::kInvalidArgument, "CSR indptr is null");
    const std::int32_t n = v.indptr[b + 1] - v.indptr[b];
    KVKIT_CHECK_STATUS(v.indptr[b] >= 0 && n >= 0, StatusCode::kOutOfRange, "indptr of sequence ",
                       b, " is invalid: ", v.indptr[b], " -> ", v.indptr[b + 1]);
    if (n > 0) {
      KVKIT_CHECK_STATUS(v.indices != nullptr && v.last_page_len != nullptr,
                         StatusCode::kInvalidArgument, "CSR indices or last_page_len is null");
      const std::int32_t last = v.last_page_len[b];
      KVKIT_CHECK_STATUS(last >= 1 && last <= v.page_size, StatusCode::kOutOfRange,
                         "last_page_len ", last, " of sequence ", b, " outside [1, ", v.page_size,
                         "]");
    }
  } else {
    KVKIT_CHECK_STATUS(v.seq_lens != nullptr, StatusCode::kInvalidArgument,
                       "block table seq_lens is null");
    const std::int32_t len = v.seq_lens[b];
    KVKIT_CHECK_STATUS(len >= 0, StatusCode::kOutOfRange, "seq_len ", len, " of sequence ", b,
                       " is negative");
    const std::int32_t n = v.num_pages(b);
    KVKIT_CHECK_STATUS(n <= v.row_stride, StatusCode::kOutOfRange, "sequence ", b, " needs ", n,
                       " pages but block table rows hold ", v.row_stride);
    KVKIT_CHECK_STATUS(n == 0 || v.block_table != nullptr, StatusCode::kInvalidArgument,
                       "block table is null");
  }
  const std::int32_t n = v.num_pages(b);
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t p = v.page_id(b, i);
    KVKIT_CHECK_STATUS(p >= 0 && p < v.num_pages_total, StatusCode::kOutOfRange, "page id ", p,
                       " out of range [0, ", v.num_pages_total, ") at sequence ", b, " page ", i);
  }
  return Status::ok();
}

/// Checks every sequence's page-table entries (O(total pages)).
template <class T>
Status check_page_table(const PagedKVView<T>& v) {
  for (std::int32_t b = 0; b < v.batch_size; ++b) KVKIT_RETURN_IF_ERROR(check_sequence_pages(v, b));
  return Status::ok();
}

/// Space + storage + whole page table: what every op that walks sequences needs.
template <class T>
Status check_host_view(const PagedKVView<T>& v, bool check_table) {
  KVKIT_RETURN_IF_ERROR(check_view_space(v, exec::Host{}));
  KVKIT_RETURN_IF_ERROR(check_host_view_storage(v));
  if (check_table) KVKIT_RETURN_IF_ERROR(check_page_table(v));
  return Status::ok();
}

}  // namespace detail
}  // namespace kvkit
