#pragma once
// FlashInfer adapter: a PagedKVView over FlashInfer's paged KV cache of one layer.
//
// Target layouts (FlashInfer's paged_kv_cache argument), contiguous:
//   one tensor, NHD  [max_num_pages, 2, page_size, num_kv_heads, head_dim]
//   one tensor, HND  [max_num_pages, 2, num_kv_heads, page_size, head_dim]
//   K and V tensors, NHD  each [max_num_pages, page_size, num_kv_heads, head_dim]
//   K and V tensors, HND  each [max_num_pages, num_kv_heads, page_size, head_dim]
// In the one-tensor form, index 0 of the second dimension is K and 1 is V, so K and V of a
// page sit next to each other and the page stride covers both.
// Page table (CSR): the pages of request b are paged_kv_indices[paged_kv_indptr[b] ..
// paged_kv_indptr[b+1]) in token order, and the last of them holds
// paged_kv_last_page_len[b] tokens (1..page_size). That is PagedKVView's CSR table as is.

#include <cstdint>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"

namespace kvkit {
namespace detail {

// Checks what both make_flashinfer_view overloads share and returns the pool geometry.
inline KVGeometry flashinfer_geometry(std::int32_t max_num_pages, std::int32_t page_size,
                                      std::int32_t num_kv_heads, std::int32_t head_dim,
                                      KVLayout layout, const CsrPageTable& table) {
  KVKIT_CHECK(max_num_pages > 0, "kvkit: flashinfer max_num_pages must be > 0, got ",
              max_num_pages);
  KVKIT_CHECK(page_size > 0, "kvkit: flashinfer page_size must be > 0, got ", page_size);
  KVKIT_CHECK(num_kv_heads > 0, "kvkit: flashinfer num_kv_heads must be > 0, got ",
              num_kv_heads);
  KVKIT_CHECK(head_dim > 0, "kvkit: flashinfer head_dim must be > 0, got ", head_dim);
  KVKIT_CHECK(layout == KVLayout::kNHD || layout == KVLayout::kHND,
              "kvkit: flashinfer layout must be NHD or HND, got ", static_cast<int>(layout));
  const std::int32_t batch_size = table.batch_size;
  KVKIT_CHECK(batch_size >= 0, "kvkit: flashinfer batch_size must be >= 0, got ", batch_size);
  // indptr has batch_size + 1 entries, so it is needed even for an empty batch.
  KVKIT_CHECK(table.indptr != nullptr, "kvkit: flashinfer paged_kv_indptr is null");
  KVKIT_CHECK(batch_size == 0 || table.indices != nullptr,
              "kvkit: flashinfer paged_kv_indices is null for batch_size ", batch_size);
  KVKIT_CHECK(batch_size == 0 || table.last_page_len != nullptr,
              "kvkit: flashinfer paged_kv_last_page_len is null for batch_size ", batch_size);
  return KVGeometry{num_kv_heads, head_dim, page_size, max_num_pages};
}

}  // namespace detail

/// Builds a CSR view of FlashInfer's single-tensor paged cache `[max_num_pages, 2, ...]`
/// (NHD: `[.., page_size, num_kv_heads, head_dim]`, HND: `[.., num_kv_heads, page_size,
/// head_dim]`) without copying; page ids are FlashInfer's page indices. Throws
/// kvkit::Error naming the bad value for non-positive sizes, a negative batch or null
/// pointers. The table is not read here; call `validate_page_table()` for a host table.
template <class T>
PagedKVView<T> make_flashinfer_view(
    T* paged_kv_cache,  // [max_num_pages, 2, page_size, H, D] (NHD) or [max_num_pages, 2, H, page_size, D] (HND)
    std::int32_t max_num_pages, std::int32_t page_size, std::int32_t num_kv_heads,
    std::int32_t head_dim, KVLayout layout,
    const std::int32_t* paged_kv_indptr,         // [batch_size + 1]
    const std::int32_t* paged_kv_indices,        // [paged_kv_indptr[batch_size]]
    const std::int32_t* paged_kv_last_page_len,  // [batch_size]
    std::int32_t batch_size, MemorySpace space = MemorySpace::kHost) {
  const CsrPageTable table{paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, batch_size};
  const KVGeometry g =
      detail::flashinfer_geometry(max_num_pages, page_size, num_kv_heads, head_dim, layout, table);
  KVKIT_CHECK(paged_kv_cache != nullptr, "kvkit: flashinfer paged_kv_cache is null");
  KVStrides s = packed_strides(g, layout);  // strides inside one K (or V) half-page
  const std::int64_t half_page = s.page;
  s.page = 2 * half_page;  // a page holds its K half then its V half
  return make_csr_view(g, paged_kv_cache, s, paged_kv_cache + half_page, s, table, space);
}

/// Builds a CSR view of FlashInfer's split form: separate K and V tensors, each
/// `[max_num_pages, page_size, H, D]` (NHD) or `[max_num_pages, H, page_size, D]` (HND).
/// Same validation as the single-tensor overload.
template <class T>
PagedKVView<T> make_flashinfer_view(
    T* k_cache,  // [max_num_pages, page_size, H, D] (NHD) or [max_num_pages, H, page_size, D] (HND)
    T* v_cache,  // same shape as k_cache
    std::int32_t max_num_pages, std::int32_t page_size, std::int32_t num_kv_heads,
    std::int32_t head_dim, KVLayout layout,
    const std::int32_t* paged_kv_indptr,         // [batch_size + 1]
    const std::int32_t* paged_kv_indices,        // [paged_kv_indptr[batch_size]]
    const std::int32_t* paged_kv_last_page_len,  // [batch_size]
    std::int32_t batch_size, MemorySpace space = MemorySpace::kHost) {
  const CsrPageTable table{paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, batch_size};
  const KVGeometry g =
      detail::flashinfer_geometry(max_num_pages, page_size, num_kv_heads, head_dim, layout, table);
  KVKIT_CHECK(k_cache != nullptr, "kvkit: flashinfer k_cache is null");
  KVKIT_CHECK(v_cache != nullptr, "kvkit: flashinfer v_cache is null");
  const KVStrides s = packed_strides(g, layout);
  return make_csr_view(g, k_cache, s, v_cache, s, table, space);
}

}  // namespace kvkit
