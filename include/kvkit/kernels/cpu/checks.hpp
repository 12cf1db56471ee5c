#pragma once
// Non-throwing view checks of the CPU kernels.
//
// PagedKVView::validate_page_table() throws and is meant for table construction; run
// paths instead call these, which return a Status naming the first bad value. They read
// the page table (detail::check_sequence_pages in core/paged_kv_view.hpp), so they are
// only for host-resident views. The space and storage checks the CUDA backend shares
// are in kernels/params.hpp.

#include <cstdint>

#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace detail {

/// Space + storage + whole page table: what every op that walks sequences needs.
template <class T>
Status check_host_view(const PagedKVView<T>& v, bool check_table) {
  KVKIT_RETURN_IF_ERROR(check_view(v, exec::Host{}));
  if (check_table) KVKIT_RETURN_IF_ERROR(check_page_table(v));
  return Status::ok();
}

}  // namespace detail
}  // namespace kvkit
