#pragma once
// copy_pages on the CPU: whole-page copies inside one pool (copy-on-write, defrag).

#include <algorithm>
#include <bitset>
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
namespace detail {
namespace cpu {

/// The src/dst clash check marks ids in two on-stack bitsets (2 x 16 KiB) covering a
/// window of this many page ids; pools up to this size take one pass, larger ones one
/// pass per window of ids that holds any id (see find_copy_clash_windowed).
inline constexpr std::int32_t kCopyPagesBitsetPages = 1 << 17;

/// Above this many windows (pools over 2^21 pages) copy_pages with a workspace sorts the
/// ids instead (O(n log n) whatever the pool size); without one see
/// find_copy_clash_no_scratch.
inline constexpr std::int64_t kCopyPagesMaxWindows = 16;

/// The first destination position that breaks copy_pages' rules (-1: none), and whether
/// it repeats an earlier destination (else it is also a source page).
struct CopyClash {
  std::int32_t position = -1;
  bool repeated = false;
};

/// Finds the first i with dst[i] among the sources or equal to an earlier dst[j], with no
/// scratch beyond 32 KiB of stack: each pass marks the ids of one window
/// [lo, lo + kCopyPagesBitsetPages) and finds the next non-empty window on the way, so a
/// pool up to 131072 pages takes one pass and any pool at most one pass per window that
/// holds an id (O(n * windows), windows <= min(2n, ids' span / 131072 + 1)). Ids must be
/// >= 0. `passes` (optional) receives the number of passes, for tests.
inline CopyClash find_copy_clash_windowed(const std::int32_t* src,  // [n]
                                          const std::int32_t* dst,  // [n]
                                          std::int32_t n, std::int64_t* passes = nullptr) {
  constexpr std::int64_t kWindow = kCopyPagesBitsetPages;
  std::bitset<kCopyPagesBitsetPages> is_src, is_dst;
  CopyClash best;
  std::int64_t lo = 0, count = 0;
  for (;;) {
    ++count;
    const std::int64_t hi = lo + kWindow;
    std::int64_t next = INT64_MAX;  // smallest id >= hi: where the next window starts
    if (count > 1) {
      is_src.reset();
      is_dst.reset();
    }
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int64_t s = src[i];
      if (s >= lo && s < hi)
        is_src.set(static_cast<std::size_t>(s - lo));
      else if (s >= hi && s < next)
        next = s;
    }
    bool found = false;  // only the first clash of a window can be the earliest
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int64_t d = dst[i];
      if (d >= lo && d < hi) {
        if (found) continue;
        const auto bit = static_cast<std::size_t>(d - lo);
        if (is_src.test(bit) || is_dst.test(bit)) {
          found = true;
          if (best.position < 0 || i < best.position) best = CopyClash{i, !is_src.test(bit)};
        }
        is_dst.set(bit);
      } else if (d >= hi && d < next) {
        next = d;
      }
    }
    if (next == INT64_MAX) break;
    lo = next;
  }
  if (passes != nullptr) *passes = count;
  return best;
}

/// Entries find_copy_clash_selected keeps on the stack per pass (32 KiB).
inline constexpr std::int32_t kCopyPagesSelectEntries = 4096;

/// Same answer as find_copy_clash_windowed with no scratch beyond 32 KiB of stack and a
/// cost independent of the ids' range: every source and destination is an entry keyed
/// (id << 32 | position << 1 | is_destination), and each pass selects the next
/// kCopyPagesSelectEntries keys in order with a bounded max-heap, then walks them sorted,
/// carrying the current id's state across passes. ceil(2n / 4096) passes of O(n log 4096):
/// one sort for n <= 2048, O(n^2 / 2048) beyond. `passes` (optional) receives the count.
inline CopyClash find_copy_clash_selected(const std::int32_t* src,  // [n]
                                          const std::int32_t* dst,  // [n]
                                          std::int32_t n, std::int64_t* passes = nullptr) {
  constexpr std::int32_t kCap = kCopyPagesSelectEntries;
  std::uint64_t heap[kCap];
  auto key = [](std::int32_t id, std::int32_t pos, bool is_dst) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(id)) << 32) |
           (static_cast<std::uint64_t>(static_cast<std::uint32_t>(pos)) << 1) |
           static_cast<std::uint64_t>(is_dst);
  };
  CopyClash best;
  // State of the id being walked (its entries may span two passes).
  std::int64_t cur_id = -1;
  bool cur_src = false;
  std::int32_t cur_dsts = 0, first_dst = -1, second_dst = -1;
  auto close_id = [&] {
    CopyClash c;
    if (cur_src && cur_dsts > 0)
      c = CopyClash{first_dst, false};
    else if (cur_dsts >= 2)
      c = CopyClash{second_dst, true};
    if (c.position >= 0 && (best.position < 0 || c.position < best.position)) best = c;
  };
  bool have_last = false;
  std::uint64_t last = 0;  // largest key walked so far
  std::int64_t count = 0;
  const std::int64_t total = 2 * static_cast<std::int64_t>(n);
  for (std::int64_t walked = 0; walked < total;) {
    ++count;
    std::int32_t size = 0;
    auto offer = [&](std::uint64_t k) {
      if (have_last && k <= last) return;
      if (size < kCap) {
        heap[size++] = k;
        std::push_heap(heap, heap + size);
      } else if (k < heap[0]) {
        std::pop_heap(heap, heap + size);
        heap[size - 1] = k;
        std::push_heap(heap, heap + size);
      }
    };
    for (std::int32_t i = 0; i < n; ++i) offer(key(src[i], i, false));
    for (std::int32_t i = 0; i < n; ++i) offer(key(dst[i], i, true));
    std::sort_heap(heap, heap + size);
    for (std::int32_t e = 0; e < size; ++e) {
      const std::uint64_t k = heap[e];
      const auto id = static_cast<std::int64_t>(k >> 32);
      const auto pos = static_cast<std::int32_t>((k >> 1) & 0x7fffffffu);
      if (id != cur_id) {
        close_id();
        cur_id = id;
        cur_src = false;
        cur_dsts = 0;
        first_dst = second_dst = -1;
      }
      if ((k & 1u) == 0) {
        cur_src = true;
      } else {
        if (cur_dsts == 0) first_dst = pos;
        if (cur_dsts == 1) second_dst = pos;
        ++cur_dsts;
      }
    }
    walked += size;
    last = heap[size - 1];
    have_last = true;
  }
  close_id();
  if (passes != nullptr) *passes = count;
  return best;
}

/// The allocation-free check copy_pages runs without a (big enough) workspace: windows of
/// page ids when the pool spans few of them, else selection passes (a selection pass
/// costs about 4 window passes, measured): O(n * min(num_pages / 131072 + 1, n / 512 + 1)).
inline CopyClash find_copy_clash_no_scratch(const std::int32_t* src,  // [n]
                                            const std::int32_t* dst,  // [n]
                                            std::int32_t n, std::int32_t num_pages) {
  const std::int64_t windows =
      (static_cast<std::int64_t>(num_pages) + kCopyPagesBitsetPages - 1) / kCopyPagesBitsetPages;
  const std::int64_t selections =
      (2 * static_cast<std::int64_t>(n) + kCopyPagesSelectEntries - 1) / kCopyPagesSelectEntries;
  return windows <= 4 * selections ? find_copy_clash_windowed(src, dst, n)
                               : find_copy_clash_selected(src, dst, n);
}

/// Same answer as find_copy_clash_windowed in O(n log n) whatever the ids' range, using
/// caller scratch: the sources sorted, and the destinations sorted as (id << 32 | position)
/// so each id's earliest positions come first.
inline CopyClash find_copy_clash_sorted(const std::int32_t* src,  // [n]
                                        const std::int32_t* dst,  // [n]
                                        std::int32_t n,
                                        std::int32_t* src_sorted,  // [n] scratch
                                        std::uint64_t* dst_keys) {  // [n] scratch
  std::copy(src, src + n, src_sorted);
  std::sort(src_sorted, src_sorted + n);
  for (std::int32_t i = 0; i < n; ++i)
    dst_keys[i] = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(dst[i])) << 32) |
                  static_cast<std::uint32_t>(i);
  std::sort(dst_keys, dst_keys + n);
  CopyClash best;
  std::int32_t j = 0;  // first source >= the current id
  for (std::int32_t g = 0; g < n;) {
    const auto id = static_cast<std::int32_t>(dst_keys[g] >> 32);
    std::int32_t end = g + 1;
    while (end < n && static_cast<std::int32_t>(dst_keys[end] >> 32) == id) ++end;
    while (j < n && src_sorted[j] < id) ++j;
    CopyClash c;
    if (j < n && src_sorted[j] == id)
      c = CopyClash{static_cast<std::int32_t>(dst_keys[g] & 0xffffffffu), false};
    else if (end - g >= 2)
      c = CopyClash{static_cast<std::int32_t>(dst_keys[g + 1] & 0xffffffffu), true};
    if (c.position >= 0 && (best.position < 0 || c.position < best.position)) best = c;
    g = end;
  }
  return best;
}

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

/// Bytes of optional workspace that keep copy_pages' id check O(n log n) for n pairs on
/// pools of more than 2^21 pages (0 for smaller pools, whose check is linear without it):
/// n source ids and n destination keys to sort.
template <class T>
std::size_t copy_pages_workspace_size(exec::Host, const PagedKVView<T>& view, std::int32_t n) {
  const std::int64_t windows =
      (static_cast<std::int64_t>(view.num_pages_total) + detail::cpu::kCopyPagesBitsetPages - 1) /
      detail::cpu::kCopyPagesBitsetPages;
  if (n <= 0 || windows <= detail::cpu::kCopyPagesMaxWindows) return 0;
  return WorkspaceSizer()
      .add<std::int32_t>(static_cast<std::size_t>(n))
      .add<std::uint64_t>(static_cast<std::size_t>(n))
      .bytes();
}

/// Copies all tokens and heads of K and V of page src_pages[i] to page dst_pages[i] of
/// the same pool, for i < n. The same source may feed several destinations, but a
/// destination may appear only once and never as a source (so the result does not depend
/// on order or threads). Ids must be in [0, view.num_pages_total). Returns
/// kInvalidArgument naming the first offending position and id; nothing is copied when a
/// check fails. Dense pages are copied with one memcpy each, strided ones row by row.
/// The clash check needs no scratch: one linear pass over the ids for pools up to 131072
/// pages; above that, allocation-free passes over the pool's 131072-page windows or, when
/// there are many (huge pools), ceil(2n / 4096) selection passes (O(n log n) for n <= 2048
/// at any pool size; see find_copy_clash_no_scratch).
/// `ws` is optional: with copy_pages_workspace_size(ex, view, n) bytes (non-zero only for
/// pools over 2^21 pages) the check sorts the ids instead, O(n log n) at any size; a
/// smaller workspace is simply not used. The verdict and message are the same either way.
template <class T>
Status copy_pages(exec::Host ex, PagedKVView<T> view,
                  const std::int32_t* src_pages,  // [n]
                  const std::int32_t* dst_pages,  // [n]
                  std::int32_t n, Workspace ws = Workspace{}) {
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
  const std::size_t sort_bytes = copy_pages_workspace_size(ex, view, n);
  detail::cpu::CopyClash clash;
  if (sort_bytes != 0 && ws.data != nullptr && ws.bytes >= sort_bytes) {
    WorkspaceCarver carve(ws);
    std::int32_t* src_sorted = carve.take<std::int32_t>(static_cast<std::size_t>(n));
    std::uint64_t* dst_keys = carve.take<std::uint64_t>(static_cast<std::size_t>(n));
    clash = detail::cpu::find_copy_clash_sorted(src_pages, dst_pages, n, src_sorted, dst_keys);
  } else {
    clash = detail::cpu::find_copy_clash_no_scratch(src_pages, dst_pages, n, np);
  }
  KVKIT_CHECK_STATUS(clash.position < 0, StatusCode::kInvalidArgument, "destination page id ",
                     dst_pages[clash.position < 0 ? 0 : clash.position], " at position ",
                     clash.position, clash.repeated ? " is repeated" : " is also a source page");
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
