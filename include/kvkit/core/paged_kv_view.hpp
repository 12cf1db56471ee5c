#pragma once
// PagedKVView: a non-owning description of one layer of an engine's paged K/V memory.
//
// The engine keeps its memory; the view only says where token t of sequence b, head h
// lives. It is trivially copyable and passed by value, to CUDA kernels too. Two page
// table encodings are supported:
//   - CSR (FlashInfer): pages of sequence b are indices[indptr[b] .. indptr[b+1]), the last
//     page holds last_page_len[b] tokens (1..page_size; a sequence with no pages has 0).
//   - dense block table (vLLM, TensorRT-LLM): pages of b are block_table[b*row_stride + i]
//     for i < ceil(seq_lens[b] / page_size).
// K and V have separate bases and strides (in elements); head_dim is contiguous.
// Addresses: k_ptr(b, t, h) = k_data + page*k_stride_page + (t % page_size)*k_stride_token
//                             + h*k_stride_head, with page = the (t / page_size)-th page of b.

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#include "kvkit/core/config.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"

namespace kvkit {

/// Which page-table encoding a view carries.
enum class PageTableKind : unsigned char { kCsr = 0, kBlockTable = 1 };

/// Shape of the KV pool of one layer.
struct KVGeometry {
  std::int32_t num_kv_heads = 0;  // heads stored per token
  std::int32_t head_dim = 0;      // elements per head vector (contiguous)
  std::int32_t page_size = 0;     // tokens per page (the engine's block size)
  std::int32_t num_pages = 0;     // pages in the pool; valid page ids are [0, num_pages)
};

/// Element strides of one of the K/V pools.
struct KVStrides {
  std::int64_t page = 0;   // elements between page p and p+1
  std::int64_t token = 0;  // elements between consecutive tokens of a page
  std::int64_t head = 0;   // elements between consecutive heads of a token
};

/// CSR page table (FlashInfer's paged_kv_indptr / indices / last_page_len).
struct CsrPageTable {
  const std::int32_t* indptr = nullptr;         // [batch_size + 1], indptr[0] == 0
  const std::int32_t* indices = nullptr;        // [indptr[batch_size]] page ids
  const std::int32_t* last_page_len = nullptr;  // [batch_size] tokens in each last page
  std::int32_t batch_size = 0;
};

/// Dense block table (vLLM block_tables / TensorRT-LLM kv_cache_block_offsets, one pool).
struct BlockTable {
  const std::int32_t* table = nullptr;     // [batch_size, row_stride] page ids
  std::int32_t row_stride = 0;             // entries per row (max pages per sequence)
  const std::int32_t* seq_lens = nullptr;  // [batch_size] tokens per sequence
  std::int32_t batch_size = 0;
};

namespace detail {

// True when a strided [extent_0, extent_1, extent_2] x head_dim layout never maps two
// different (page, token, head, d) to one element: sorted by stride, each stride must
// step over everything the smaller ones span.
inline bool strides_disjoint(const KVStrides& s, const KVGeometry& g) {
  std::array<std::pair<std::int64_t, std::int64_t>, 3> dims = {
      std::make_pair(s.page, static_cast<std::int64_t>(g.num_pages)),
      std::make_pair(s.token, static_cast<std::int64_t>(g.page_size)),
      std::make_pair(s.head, static_cast<std::int64_t>(g.num_kv_heads))};
  std::sort(dims.begin(), dims.end());
  std::int64_t span = g.head_dim;  // elements covered by the faster dimensions
  for (const auto& d : dims) {
    if (d.second == 1) continue;  // an extent-1 dimension never steps
    if (d.first < span) return false;
    span = d.first * d.second;
  }
  return true;
}

inline void check_geometry(const KVGeometry& g) {
  KVKIT_CHECK(g.num_kv_heads > 0, "kvkit: num_kv_heads must be > 0, got ", g.num_kv_heads);
  KVKIT_CHECK(g.head_dim > 0, "kvkit: head_dim must be > 0, got ", g.head_dim);
  KVKIT_CHECK(g.page_size > 0, "kvkit: page_size must be > 0, got ", g.page_size);
  KVKIT_CHECK(g.num_pages > 0, "kvkit: num_pages must be > 0, got ", g.num_pages);
}

inline void check_strides(const char* which, const KVStrides& s, const KVGeometry& g) {
  KVKIT_CHECK(s.page > 0 && s.token > 0 && s.head > 0, "kvkit: ", which,
              " strides must be positive, got page=", s.page, " token=", s.token,
              " head=", s.head);
  KVKIT_CHECK(strides_disjoint(s, g), "kvkit: ", which, " strides overlap: page=", s.page,
              " token=", s.token, " head=", s.head, " for page_size=", g.page_size,
              " num_kv_heads=", g.num_kv_heads, " head_dim=", g.head_dim);
}

}  // namespace detail

/// Non-owning view of one layer's paged K/V memory (see file comment for addressing).
/// Build it with make_csr_view / make_block_table_view (or an engine adapter), which
/// validate the geometry and throw kvkit::Error naming any bad value.
template <class T>
struct PagedKVView {
  using value_type = T;

  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t page_size = 0;
  std::int32_t num_pages_total = 0;  // pool capacity: page ids must be < this
  std::int32_t batch_size = 0;

  T* k_data = nullptr;  // [pages] strided by k_stride_page/token/head, head_dim contiguous
  T* v_data = nullptr;  // [pages] strided by v_stride_page/token/head, head_dim contiguous
  std::int64_t k_stride_page = 0, k_stride_token = 0, k_stride_head = 0;  // elements
  std::int64_t v_stride_page = 0, v_stride_token = 0, v_stride_head = 0;  // elements

  PageTableKind table_kind = PageTableKind::kCsr;
  const std::int32_t* indptr = nullptr;         // CSR: [batch_size + 1]
  const std::int32_t* indices = nullptr;        // CSR: [indptr[batch_size]]
  const std::int32_t* last_page_len = nullptr;  // CSR: [batch_size]
  const std::int32_t* block_table = nullptr;    // dense: [batch_size, row_stride]
  std::int32_t row_stride = 0;                  // dense: entries per block_table row
  const std::int32_t* seq_lens = nullptr;       // dense: [batch_size]

  MemorySpace space = MemorySpace::kHost;  // where k/v data and the page table live

  /// Pages used by sequence b.
  KVKIT_HOST_DEVICE std::int32_t num_pages(std::int32_t b) const {
    if (table_kind == PageTableKind::kCsr) return indptr[b + 1] - indptr[b];
    return (seq_lens[b] + page_size - 1) / page_size;
  }
  /// Tokens held by sequence b.
  KVKIT_HOST_DEVICE std::int32_t seq_len(std::int32_t b) const {
    if (table_kind == PageTableKind::kBlockTable) return seq_lens[b];
    const std::int32_t n = indptr[b + 1] - indptr[b];
    return n == 0 ? 0 : (n - 1) * page_size + last_page_len[b];
  }
  /// Physical id of the i-th page of sequence b.
  KVKIT_HOST_DEVICE std::int32_t page_id(std::int32_t b, std::int32_t i) const {
    if (table_kind == PageTableKind::kCsr) return indices[indptr[b] + i];
    return block_table[static_cast<std::int64_t>(b) * row_stride + i];
  }
  /// Element offset of (page, in-page slot, head) in the K pool.
  KVKIT_HOST_DEVICE std::int64_t k_offset(std::int32_t page, std::int32_t slot,
                                          std::int32_t head) const {
    return page * k_stride_page + slot * k_stride_token + head * k_stride_head;
  }
  KVKIT_HOST_DEVICE std::int64_t v_offset(std::int32_t page, std::int32_t slot,
                                          std::int32_t head) const {
    return page * v_stride_page + slot * v_stride_token + head * v_stride_head;
  }
  /// Address of the key of token `token` of sequence b, head `head` (head_dim elements).
  KVKIT_HOST_DEVICE T* k_ptr(std::int32_t b, std::int32_t token, std::int32_t head) const {
    return k_data + k_offset(page_id(b, token / page_size), token % page_size, head);
  }
  KVKIT_HOST_DEVICE T* v_ptr(std::int32_t b, std::int32_t token, std::int32_t head) const {
    return v_data + v_offset(page_id(b, token / page_size), token % page_size, head);
  }
  /// Slot-mapping address (vLLM convention: slot = page * page_size + offset).
  KVKIT_HOST_DEVICE T* k_slot_ptr(std::int64_t slot, std::int32_t head) const {
    return k_data + k_offset(static_cast<std::int32_t>(slot / page_size),
                             static_cast<std::int32_t>(slot % page_size), head);
  }
  KVKIT_HOST_DEVICE T* v_slot_ptr(std::int64_t slot, std::int32_t head) const {
    return v_data + v_offset(static_cast<std::int32_t>(slot / page_size),
                             static_cast<std::int32_t>(slot % page_size), head);
  }

  KVGeometry geometry() const { return {num_kv_heads, head_dim, page_size, num_pages_total}; }

  /// Reads a host-resident page table and throws kvkit::Error on the first bad entry
  /// (non-monotone indptr, page id outside [0, num_pages_total), last_page_len outside
  /// [1, page_size], a sequence longer than its row). O(total pages); call it when a
  /// table is built, not per step. Device-resident tables cannot be read here and throw.
  void validate_page_table() const;
};

static_assert(std::is_trivially_copyable<PagedKVView<float>>::value, "views are passed by value");

template <class T>
void PagedKVView<T>::validate_page_table() const {
  KVKIT_CHECK(space == MemorySpace::kHost,
              "kvkit: validate_page_table needs a host page table, view is in ", to_string(space));
  KVKIT_CHECK(batch_size >= 0, "kvkit: batch_size must be >= 0, got ", batch_size);
  auto check_page = [&](std::int32_t b, std::int32_t i, std::int32_t p) {
    KVKIT_CHECK(p >= 0 && p < num_pages_total, "kvkit: page id ", p, " out of range [0, ",
                num_pages_total, ") at sequence ", b, " page ", i);
  };
  if (table_kind == PageTableKind::kCsr) {
    KVKIT_CHECK(indptr != nullptr && last_page_len != nullptr, "kvkit: CSR table has null arrays");
    KVKIT_CHECK(indptr[0] == 0, "kvkit: indptr[0] must be 0, got ", indptr[0]);
    for (std::int32_t b = 0; b < batch_size; ++b) {
      const std::int32_t n = indptr[b + 1] - indptr[b];
      KVKIT_CHECK(n >= 0, "kvkit: indptr decreases at sequence ", b, ": ", indptr[b], " -> ",
                  indptr[b + 1]);
      if (n > 0) {
        KVKIT_CHECK(indices != nullptr, "kvkit: CSR table has null indices");
        KVKIT_CHECK(last_page_len[b] >= 1 && last_page_len[b] <= page_size,
                    "kvkit: last_page_len ", last_page_len[b], " of sequence ", b,
                    " outside [1, ", page_size, "]");
      }
      for (std::int32_t i = 0; i < n; ++i) check_page(b, i, page_id(b, i));
    }
  } else {
    KVKIT_CHECK(seq_lens != nullptr, "kvkit: block table has null seq_lens");
    for (std::int32_t b = 0; b < batch_size; ++b) {
      KVKIT_CHECK(seq_lens[b] >= 0, "kvkit: seq_len ", seq_lens[b], " of sequence ", b,
                  " is negative");
      const std::int32_t n = num_pages(b);
      KVKIT_CHECK(n <= row_stride, "kvkit: sequence ", b, " needs ", n,
                  " pages but block table rows hold ", row_stride);
      if (n > 0) KVKIT_CHECK(block_table != nullptr, "kvkit: block table has null table");
      for (std::int32_t i = 0; i < n; ++i) check_page(b, i, page_id(b, i));
    }
  }
}

namespace detail {
template <class T>
PagedKVView<T> make_view_storage(const KVGeometry& g, T* k_data, const KVStrides& ks, T* v_data,
                                 const KVStrides& vs, MemorySpace space) {
  check_geometry(g);
  KVKIT_CHECK(k_data != nullptr && v_data != nullptr, "kvkit: null K or V base pointer");
  check_strides("K", ks, g);
  check_strides("V", vs, g);
  PagedKVView<T> v;
  v.num_kv_heads = g.num_kv_heads;
  v.head_dim = g.head_dim;
  v.page_size = g.page_size;
  v.num_pages_total = g.num_pages;
  v.k_data = k_data;
  v.v_data = v_data;
  v.k_stride_page = ks.page;
  v.k_stride_token = ks.token;
  v.k_stride_head = ks.head;
  v.v_stride_page = vs.page;
  v.v_stride_token = vs.token;
  v.v_stride_head = vs.head;
  v.space = space;
  return v;
}
}  // namespace detail

/// Builds a view over a CSR page table. Throws kvkit::Error on bad geometry or strides.
template <class T>
PagedKVView<T> make_csr_view(const KVGeometry& g, T* k_data, const KVStrides& ks, T* v_data,
                             const KVStrides& vs, const CsrPageTable& table,
                             MemorySpace space = MemorySpace::kHost) {
  KVKIT_CHECK(table.batch_size >= 0, "kvkit: batch_size must be >= 0, got ", table.batch_size);
  KVKIT_CHECK(table.batch_size == 0 || table.indptr != nullptr, "kvkit: CSR indptr is null");
  PagedKVView<T> v = detail::make_view_storage(g, k_data, ks, v_data, vs, space);
  v.table_kind = PageTableKind::kCsr;
  v.batch_size = table.batch_size;
  v.indptr = table.indptr;
  v.indices = table.indices;
  v.last_page_len = table.last_page_len;
  return v;
}

/// Builds a view over a dense block table. Throws kvkit::Error on bad geometry or strides.
template <class T>
PagedKVView<T> make_block_table_view(const KVGeometry& g, T* k_data, const KVStrides& ks,
                                     T* v_data, const KVStrides& vs, const BlockTable& table,
                                     MemorySpace space = MemorySpace::kHost) {
  KVKIT_CHECK(table.batch_size >= 0, "kvkit: batch_size must be >= 0, got ", table.batch_size);
  KVKIT_CHECK(table.row_stride >= 0, "kvkit: block table row_stride must be >= 0, got ",
              table.row_stride);
  PagedKVView<T> v = detail::make_view_storage(g, k_data, ks, v_data, vs, space);
  v.table_kind = PageTableKind::kBlockTable;
  v.batch_size = table.batch_size;
  v.block_table = table.table;
  v.row_stride = table.row_stride;
  v.seq_lens = table.seq_lens;
  return v;
}

/// Contiguous layouts of one page: NHD = [page_size, heads, head_dim] (vLLM, FlashInfer
/// default), HND = [heads, page_size, head_dim] (FlashInfer HND, TensorRT-LLM).
enum class KVLayout : unsigned char { kNHD = 0, kHND = 1 };

inline const char* to_string(KVLayout l) { return l == KVLayout::kNHD ? "nhd" : "hnd"; }

/// Strides of a pool of densely packed pages in the given layout.
inline KVStrides packed_strides(const KVGeometry& g, KVLayout layout) {
  detail::check_geometry(g);
  const std::int64_t page = static_cast<std::int64_t>(g.page_size) * g.num_kv_heads * g.head_dim;
  if (layout == KVLayout::kNHD)
    return {page, static_cast<std::int64_t>(g.num_kv_heads) * g.head_dim, g.head_dim};
  return {page, g.head_dim, static_cast<std::int64_t>(g.page_size) * g.head_dim};
}

}  // namespace kvkit
