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
#include <limits>
#include <type_traits>

#include "kvkit/core/config.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"

namespace kvkit {

/// Which page-table encoding a view carries.
enum class PageTableKind : unsigned char { kCsr = 0, kBlockTable = 1 };

/// Contiguous layouts of one page: NHD = [page_size, heads, head_dim] (vLLM, FlashInfer
/// default), HND = [heads, page_size, head_dim] (FlashInfer HND, TensorRT-LLM).
enum class KVLayout : unsigned char { kNHD = 0, kHND = 1 };

/// "nhd" or "hnd", for messages.
inline const char* to_string(KVLayout l) { return l == KVLayout::kNHD ? "nhd" : "hnd"; }

/// Shape of the KV pool of one layer. K and V may have different head dims (a
/// ChannelSelector stores packed keys of rK dims and values of rV dims).
struct KVGeometry {
  std::int32_t num_kv_heads = 0;  // heads stored per token
  std::int32_t head_dim = 0;      // elements per K head vector (contiguous)
  std::int32_t page_size = 0;     // tokens per page (the engine's block size)
  std::int32_t num_pages = 0;     // pages in the pool; valid page ids are [0, num_pages)
  std::int32_t v_head_dim = 0;    // elements per V head vector; 0 means head_dim

  /// Elements per V head vector (v_head_dim, or head_dim when that is 0).
  std::int32_t v_dim() const { return v_head_dim != 0 ? v_head_dim : head_dim; }
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

// Throws naming the first non-positive size.
inline void check_geometry(const KVGeometry& g) {
  KVKIT_CHECK(g.num_kv_heads > 0, "kvkit: num_kv_heads must be > 0, got ", g.num_kv_heads);
  KVKIT_CHECK(g.head_dim > 0, "kvkit: head_dim must be > 0, got ", g.head_dim);
  KVKIT_CHECK(g.page_size > 0, "kvkit: page_size must be > 0, got ", g.page_size);
  KVKIT_CHECK(g.num_pages > 0, "kvkit: num_pages must be > 0, got ", g.num_pages);
  KVKIT_CHECK(g.v_head_dim >= 0, "kvkit: v_head_dim must be >= 0 (0: head_dim), got ",
              g.v_head_dim);
}

// The layout strides describe: NHD when the heads of a token are closer than its tokens.
// Computed once when a view is built, so kernels branch on a field, never on strides.
inline KVLayout layout_of(const KVStrides& s) {
  return s.head < s.token ? KVLayout::kNHD : KVLayout::kHND;
}

// Throws unless the strides are positive and never alias two elements; `which` is "K"/"V"
// (V strides are checked against g.v_dim()).
inline void check_strides(const char* which, const KVStrides& s, KVGeometry g) {
  if (which[0] == 'V') g.head_dim = g.v_dim();
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

  std::int32_t num_kv_heads = 0;     // heads stored per token
  std::int32_t head_dim = 0;         // elements per K head vector (contiguous)
  std::int32_t v_head_dim = 0;       // elements per V head vector (contiguous; may differ)
  std::int32_t page_size = 0;        // tokens per page
  std::int32_t num_pages_total = 0;  // pool capacity: page ids must be < this
  std::int32_t batch_size = 0;       // sequences in the page table

  T* k_data = nullptr;  // [pages] strided by k_stride_page/token/head, head_dim contiguous
  T* v_data = nullptr;  // [pages] strided by v_stride_page/token/head, head_dim contiguous
  std::int64_t k_stride_page = 0, k_stride_token = 0, k_stride_head = 0;  // elements
  std::int64_t v_stride_page = 0, v_stride_token = 0, v_stride_head = 0;  // elements
  KVLayout k_layout = KVLayout::kNHD;  // NHD: heads of a token adjacent; HND: head-major
  KVLayout v_layout = KVLayout::kNHD;  // V's own layout (may differ from K's)

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
    // Rounded up in 64 bits: seq_lens[b] + page_size - 1 overflows int32 near INT32_MAX.
    return static_cast<std::int32_t>(
        (static_cast<std::int64_t>(seq_lens[b]) + page_size - 1) / page_size);
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
  /// Element offset of (page, in-page slot, head) in the V pool.
  KVKIT_HOST_DEVICE std::int64_t v_offset(std::int32_t page, std::int32_t slot,
                                          std::int32_t head) const {
    return page * v_stride_page + slot * v_stride_token + head * v_stride_head;
  }
  /// Address of the key of token `token` of sequence b, head `head` (head_dim elements).
  KVKIT_HOST_DEVICE T* k_ptr(std::int32_t b, std::int32_t token, std::int32_t head) const {
    return k_data + k_offset(page_id(b, token / page_size), token % page_size, head);
  }
  /// Address of the value of token `token` of sequence b, head `head` (head_dim elements).
  KVKIT_HOST_DEVICE T* v_ptr(std::int32_t b, std::int32_t token, std::int32_t head) const {
    return v_data + v_offset(page_id(b, token / page_size), token % page_size, head);
  }
  /// Slot-mapping address (vLLM convention: slot = page * page_size + offset).
  KVKIT_HOST_DEVICE T* k_slot_ptr(std::int64_t slot, std::int32_t head) const {
    return k_data + k_offset(static_cast<std::int32_t>(slot / page_size),
                             static_cast<std::int32_t>(slot % page_size), head);
  }
  /// V twin of k_slot_ptr.
  KVKIT_HOST_DEVICE T* v_slot_ptr(std::int64_t slot, std::int32_t head) const {
    return v_data + v_offset(static_cast<std::int32_t>(slot / page_size),
                             static_cast<std::int32_t>(slot % page_size), head);
  }

  /// The geometry this view was built from (num_pages = num_pages_total).
  KVGeometry geometry() const {
    return {num_kv_heads, head_dim, page_size, num_pages_total, v_head_dim};
  }

  /// Reads a host-resident page table and throws kvkit::Error on the first bad entry
  /// (non-monotone indptr, page id outside [0, num_pages_total), last_page_len outside
  /// [1, page_size], a sequence longer than its row). O(total pages); call it when a
  /// table is built, not per step. Device-resident tables cannot be read here and throw.
  void validate_page_table() const;
};

static_assert(std::is_trivially_copyable<PagedKVView<float>>::value, "views are passed by value");

namespace detail {

/// Checks the page-table entries of sequence b of a host-resident table (lengths,
/// last_page_len, page ids) and returns a Status naming the first bad value. Run paths
/// call this (they must not throw); validate_page_table() throws what it returns.
template <class T>
Status check_sequence_pages(const PagedKVView<T>& v, std::int32_t b) {
  constexpr std::int64_t kMaxLen = std::numeric_limits<std::int32_t>::max();
  if (v.table_kind == PageTableKind::kCsr) {
    KVKIT_CHECK_STATUS(v.indptr != nullptr, StatusCode::kInvalidArgument, "CSR indptr is null");
    // Compared, not subtracted: indptr[b + 1] - indptr[b] overflows on a corrupt table.
    KVKIT_CHECK_STATUS(v.indptr[b] >= 0 && v.indptr[b + 1] >= v.indptr[b],
                       StatusCode::kOutOfRange, "indptr of sequence ", b, " is invalid: ",
                       v.indptr[b], " -> ", v.indptr[b + 1]);
    const std::int32_t n = v.indptr[b + 1] - v.indptr[b];
    if (n > 0) {
      KVKIT_CHECK_STATUS(v.indices != nullptr && v.last_page_len != nullptr,
                         StatusCode::kInvalidArgument, "CSR indices or last_page_len is null");
      const std::int32_t last = v.last_page_len[b];
      KVKIT_CHECK_STATUS(last >= 1 && last <= v.page_size, StatusCode::kOutOfRange,
                         "last_page_len ", last, " of sequence ", b, " outside [1, ", v.page_size,
                         "]");
      // seq_len() is an int32 token count, so (n - 1) * page_size + last must fit.
      const std::int64_t len = static_cast<std::int64_t>(n - 1) * v.page_size + last;
      KVKIT_CHECK_STATUS(len <= kMaxLen, StatusCode::kOutOfRange, "sequence ", b, " holds ", len,
                         " tokens on ", n, " pages, more than the int32 maximum ", kMaxLen);
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

/// check_sequence_pages for every sequence (O(total pages)).
template <class T>
Status check_page_table(const PagedKVView<T>& v) {
  for (std::int32_t b = 0; b < v.batch_size; ++b) KVKIT_RETURN_IF_ERROR(check_sequence_pages(v, b));
  return Status::ok();
}

}  // namespace detail

template <class T>
void PagedKVView<T>::validate_page_table() const {
  KVKIT_CHECK(space == MemorySpace::kHost,
              "kvkit: validate_page_table needs a host page table, view is in ", to_string(space));
  KVKIT_CHECK(batch_size >= 0, "kvkit: batch_size must be >= 0, got ", batch_size);
  if (table_kind == PageTableKind::kCsr) {
    KVKIT_CHECK(indptr != nullptr && last_page_len != nullptr, "kvkit: CSR table has null arrays");
    KVKIT_CHECK(indptr[0] == 0, "kvkit: indptr[0] must be 0, got ", indptr[0]);
  }
  const Status st = detail::check_page_table(*this);
  if (!st.is_ok()) fail("kvkit: ", st.message());
}

namespace detail {
// Validated geometry, storage and strides shared by make_csr_view / make_block_table_view.
template <class T>
PagedKVView<T> make_view_storage(const KVGeometry& g,
                                 T* k_data,  // K pool, addressed by ks
                                 const KVStrides& ks,
                                 T* v_data,  // V pool, addressed by vs
                                 const KVStrides& vs, MemorySpace space) {
  check_geometry(g);
  KVKIT_CHECK(k_data != nullptr && v_data != nullptr, "kvkit: null K or V base pointer");
  check_strides("K", ks, g);
  check_strides("V", vs, g);
  PagedKVView<T> v;
  v.num_kv_heads = g.num_kv_heads;
  v.head_dim = g.head_dim;
  v.v_head_dim = g.v_dim();
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
  v.k_layout = layout_of(ks);
  v.v_layout = layout_of(vs);
  v.space = space;
  return v;
}
}  // namespace detail

/// Builds a view over a CSR page table. Throws kvkit::Error on bad geometry or strides.
template <class T>
PagedKVView<T> make_csr_view(const KVGeometry& g,
                             T* k_data,  // K pool: [g.num_pages] pages strided by ks
                             const KVStrides& ks,
                             T* v_data,  // V pool: [g.num_pages] pages strided by vs
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
PagedKVView<T> make_block_table_view(const KVGeometry& g,
                                     T* k_data,  // K pool: [g.num_pages] pages strided by ks
                                     const KVStrides& ks,
                                     T* v_data,  // V pool: [g.num_pages] pages strided by vs
                                     const KVStrides& vs, const BlockTable& table,
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

/// Strides of a pool of densely packed K pages in the given layout.
inline KVStrides packed_strides(const KVGeometry& g, KVLayout layout) {
  detail::check_geometry(g);
  const std::int64_t dim = g.head_dim;
  const std::int64_t page = static_cast<std::int64_t>(g.page_size) * g.num_kv_heads * dim;
  if (layout == KVLayout::kNHD) return {page, static_cast<std::int64_t>(g.num_kv_heads) * dim, dim};
  return {page, dim, static_cast<std::int64_t>(g.page_size) * dim};
}

/// Strides of a pool of densely packed V pages (rows of g.v_dim() elements).
inline KVStrides packed_v_strides(KVGeometry g, KVLayout layout) {
  g.head_dim = g.v_dim();
  return packed_strides(g, layout);
}

}  // namespace kvkit
