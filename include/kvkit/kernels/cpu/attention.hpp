#pragma once
// paged_decode_attention on the CPU: one query token per sequence against its paged K/V,
// and merge_attention_states, the log-sum-exp merge of two partial attentions.
//
// The kernel is built from three pieces that every variant shares:
//   - a page list per (sequence, kv head): all of the sequence's pages, or a page subset,
//     cut into chunks (work items) at page boundaries; TileCursor walks a list and hands
//     out tiles of up to kDecodeTile token rows (K and V addresses, token indices);
//   - the tile update (decode_tile): scores of the GQA group's queries against the tile's
//     K rows, several tokens per step with the queries' vectors shared (with AVX-512, 16
//     dot products per step reduced together), an online-softmax rescale per tile with a
//     vectorised exp, then the probability-weighted V rows;
//   - the state merge (merge_states / merge_attention_states): (acc, max, sum) states of
//     two chunks, or (out, lse) pairs of two calls, combine in log-sum-exp form.
// Scores out, page subsets and channel-restricted K/V only change the inputs of these
// pieces (which page list, which query channels, where the output goes).
// params.bf16_dot (opt-in, bfloat16 KV) swaps the score step for one on the queries'
// bfloat16 bits, unscaled (vdpbf16ps under AVX512_BF16, float FMAs elsewhere), with
// sm_scale applied to the tile's dot products; p·v stays in float.
//
// Threads: items are (sequence, kv head, chunk). Long sequences are cut into several
// chunks only when the batch has few (sequence, kv head) pairs; the cut depends on the
// shape alone (batch, heads, page counts), never on the thread count, and chunk states
// are merged in a fixed order, so outputs are bitwise identical for any thread count.
// Vector code comes from kernels/cpu/simd.hpp, chosen by the consumer's compiler flags.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/cpu/checks.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/cpu/simd.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace detail {
namespace cpu {
inline namespace KVKIT_SIMD_NS {

/// Tokens scored per softmax rescale (a multiple of every Vec width).
inline constexpr std::int32_t kDecodeTile = 32;
/// Batches with fewer (sequence, kv head) pairs than this cut sequences into chunks.
inline constexpr std::int32_t kSplitTargetItems = 16;
/// At most this many chunks per (sequence, kv head).
inline constexpr std::int32_t kMaxSplits = 16;
/// Chunks hold at least this many tokens (so the merge stays negligible).
inline constexpr std::int32_t kMinSplitTokens = 512;

/// Tokens per step of the score and V loops (GQA queries x tokens accumulators in registers).
#if defined(KVKIT_SIMD_AVX512)
inline constexpr int kTokensPerStep = 4;
#else
inline constexpr int kTokensPerStep = 2;
#endif

/// Shape-derived sizes of one decode call.
struct DecodeShape {
  std::int32_t hkv = 0, hq = 0, group = 0;
  std::int32_t kdim = 0, vdim = 0;         // K and V row widths in the pool
  std::int32_t q_width = 0, out_width = 0;  // row widths of q and out
  std::int32_t splits = 1;                  // chunks per (sequence, kv head), at most
  std::size_t item_floats = 0;              // workspace floats per (b, h, chunk) item
  bool bf16_dot = false;                    // params.bf16_dot on a bfloat16 view
  float sm_scale = 0.f;
};

template <class T>
DecodeShape decode_shape(const PagedKVView<T>& view, const DecodeAttentionParams& p) {
  DecodeShape s;
  s.hkv = view.num_kv_heads;
  s.hq = p.num_qo_heads;
  s.group = std::max(1, s.hq / std::max(1, s.hkv));
  s.kdim = view.head_dim;
  s.vdim = view.v_head_dim;
  s.q_width = p.k_channels != nullptr ? p.q_dim : s.kdim;
  s.out_width = p.v_channels != nullptr ? p.q_dim : s.vdim;
  s.bf16_dot = std::is_same<T, bfloat16_t>::value && p.bf16_dot;
  s.sm_scale = p.sm_scale;
  const std::int64_t pairs = static_cast<std::int64_t>(std::max(0, view.batch_size)) * s.hkv;
  s.splits = pairs >= kSplitTargetItems || pairs == 0
                 ? 1
                 : static_cast<std::int32_t>(
                       std::min<std::int64_t>(kMaxSplits, (kSplitTargetItems + pairs - 1) / pairs));
  const std::size_t g = static_cast<std::size_t>(s.group);
  // q (scaled, gathered), acc, max, sum, tile scores; rounded to 64 bytes per item.
  const std::size_t f = g * static_cast<std::size_t>(s.kdim) + g * static_cast<std::size_t>(s.vdim) +
                        2 * g + g * kDecodeTile;
  s.item_floats = (f + 15) / 16 * 16;
  return s;
}

/// Logical page indices a (sequence, kv head) reads: [begin, end) of `subset`, or of the
/// identity when subset is null.
struct PageList {
  const std::int32_t* subset = nullptr;  // [end] or nullptr
  std::int32_t begin = 0, end = 0;
  std::int32_t logical(std::int32_t i) const { return subset != nullptr ? subset[i] : i; }
  std::int32_t size() const { return end - begin; }
};

/// Page list of (sequence b, kv head h) under params p.
template <class T>
PageList page_list(const PagedKVView<T>& view, const DecodeAttentionParams& p, std::int32_t b,
                   std::int32_t h) {
  if (p.page_subset_indptr == nullptr) return {nullptr, 0, view.num_pages(b)};
  const std::int64_t i = static_cast<std::int64_t>(b) * view.num_kv_heads + h;
  return {p.page_subset, p.page_subset_indptr[i], p.page_subset_indptr[i + 1]};
}

/// True when heads [h0, h0 + heads) of sequence b read the same pages: always without a
/// page subset; with one, when their subset lists are equal (a Sketcher's GQA union, or
/// every page, makes that common). Such heads can share one walk over the pages.
template <class T>
bool same_page_lists(const PagedKVView<T>& view, const DecodeAttentionParams& p, std::int32_t b, std::int32_t h0,
                     std::int32_t heads) {
  if (p.page_subset_indptr == nullptr || heads <= 1) return true;
  const PageList first = page_list(view, p, b, h0);
  for (std::int32_t i = 1; i < heads; ++i) {
    const PageList other = page_list(view, p, b, h0 + i);
    if (other.size() != first.size() ||
        !std::equal(p.page_subset + first.begin, p.page_subset + first.end, p.page_subset + other.begin))
      return false;
  }
  return true;
}

/// Chunks the list is cut into (shape-only: list length, page size, shape.splits).
inline std::int32_t list_chunks(const PageList& list, std::int32_t page_size, std::int32_t splits) {
  if (splits <= 1 || list.size() <= 1) return 1;
  const std::int32_t min_pages = std::max(1, (kMinSplitTokens + page_size - 1) / page_size);
  return std::max(1, std::min(splits, list.size() / min_pages));
}

/// Up to kDecodeTile rows of one (sequence, head): K and V addresses and token indices.
template <class T>
struct Tile {
  std::int32_t n = 0;
  const T* k[kDecodeTile];
  const T* v[kDecodeTile];
  std::int32_t tok[kDecodeTile];
};

/// Walks the pages [begin, end) of a page list of sequence b, head h, tile by tile.
template <class T>
class TileCursor {
 public:
  TileCursor(const PagedKVView<T>& view, std::int32_t b, std::int32_t h, const PageList& list,
             std::int32_t begin, std::int32_t end)
      : view_(view), b_(b), h_(h), list_(list), i_(begin), end_(end) {
    len_ = view.seq_len(b);
    last_ = view.num_pages(b) - 1;
    if (i_ < end_) open_page();
  }
  /// Fills `t` with the next rows (t.n == 0 at the end of the list).
  void next(Tile<T>& t) {
    t.n = 0;
    while (t.n < kDecodeTile && i_ < end_) {
      const std::int32_t take = std::min(kDecodeTile - t.n, page_tokens_ - slot_);
      for (std::int32_t j = 0; j < take; ++j, ++slot_, ++t.n) {
        t.k[t.n] = kbase_ + slot_ * view_.k_stride_token;
        t.v[t.n] = vbase_ + slot_ * view_.v_stride_token;
        t.tok[t.n] = first_tok_ + slot_;
      }
      if (slot_ == page_tokens_ && ++i_ < end_) open_page();
    }
  }

 private:
  void open_page() {
    const std::int32_t lp = list_.logical(i_);
    const std::int32_t page = view_.page_id(b_, lp);
    first_tok_ = lp * view_.page_size;
    page_tokens_ = lp == last_ ? len_ - first_tok_ : view_.page_size;
    slot_ = 0;
    kbase_ = view_.k_data + view_.k_offset(page, 0, h_);
    vbase_ = view_.v_data + view_.v_offset(page, 0, h_);
  }
  const PagedKVView<T>& view_;
  std::int32_t b_, h_;
  PageList list_;
  std::int32_t i_, end_, len_ = 0, last_ = 0;
  std::int32_t first_tok_ = 0, page_tokens_ = 0, slot_ = 0;
  const T* kbase_ = nullptr;
  const T* vbase_ = nullptr;
};

/// Prefetches n rows of `bytes` bytes each.
template <class T>
inline void prefetch_row(const T* row, std::size_t bytes) {
  detail::prefetch_bytes(row, bytes);
}

/// Prefetches rows[j, j + count) of an upcoming tile (clipped to its n rows) into L2, not
/// L1: an L1 prefetch holds one of the core's few L1 miss buffers until its line arrives,
/// which caps the bytes in flight well below DRAM bandwidth (measured: L2 prefetch reads
/// KV 2-2.5x faster on the reference machine).
template <class T>
inline void prefetch_rows(const T* const* rows, std::int32_t n, std::int32_t j, std::int32_t count,
                          std::size_t bytes) {
  for (std::int32_t e = std::min(n, j + count); j < e; ++j) {
    const char* c = reinterpret_cast<const char*>(rows[j]);
    for (std::size_t o = 0; o < bytes; o += 64) detail::prefetch_line_l2(c + o);
  }
}

/// Rows of the following tile to prefetch while this one is processed: K rows during the
/// score pass, V rows during the V pass, a few per step so that memory requests stay
/// spread over the compute instead of arriving in bursts (rows of another page are where
/// the hardware prefetchers cannot follow). n == 0: nothing. advance() spreads the n rows
/// evenly over the current tile's tokens, and remembers what it issued, so the score and
/// V loops may walk the tile in any blocking.
template <class T>
struct Upcoming {
  const T* const* rows = nullptr;  // [n]
  std::int32_t n = 0;
  std::size_t bytes = 0;  // per row
  std::int32_t issued = 0;
  /// Prefetches the rows due once `done` of the current tile's `total` tokens are
  /// processed (all of them when done == total).
  void advance(std::int32_t done, std::int32_t total) {
    const std::int32_t due =
        done >= total ? n : static_cast<std::int32_t>(static_cast<std::int64_t>(n) * done / total);
    if (due > issued) prefetch_rows(rows, n, issued, due - issued, bytes);
    issued = std::max(issued, due);
  }
};

/// sc[g * kDecodeTile + j0 + t] = q_g · k_t for NG queries (rows of q, stride kdim) and
/// NT tokens: the queries' vectors are loaded once per chunk of dims for all NT tokens.
template <int NG, int NT, class T>
inline void score_block(const float* q,  // [NG, kdim]
                        const T* const* rows,  // [NT] K rows of kdim elements
                        std::int32_t kdim, float* sc,  // [NG, kDecodeTile]
                        std::int32_t j0) {
  constexpr int W = Vec::kLanes;
  Vec acc[NG][NT];
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < NT; ++t) acc[g][t] = Vec::zero();
  std::int32_t d = 0;
  for (; d + W <= kdim; d += W) {
    Vec kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = Vec::load(rows[t] + d);
    for (int g = 0; g < NG; ++g) {
      const Vec qv = Vec::load(q + static_cast<std::size_t>(g) * kdim + d);
      for (int t = 0; t < NT; ++t) acc[g][t] = Vec::fma(qv, kv[t], acc[g][t]);
    }
  }
  if (d < kdim) {
    const int rest = kdim - d;
    Vec kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = load_partial(rows[t] + d, rest);
    for (int g = 0; g < NG; ++g) {
      const Vec qv = load_partial(q + static_cast<std::size_t>(g) * kdim + d, rest);
      for (int t = 0; t < NT; ++t) acc[g][t] = Vec::fma(qv, kv[t], acc[g][t]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    int t = 0;
    for (; t + 4 <= NT; t += 4) Vec::hsum4(&acc[g][t], sc + g * kDecodeTile + j0 + t);
    for (; t < NT; ++t) sc[g * kDecodeTile + j0 + t] = acc[g][t].hsum();
  }
}

/// acc_g += sum_t p[g, j0 + t] * v_t for NG accumulator rows and NT V rows: each chunk of
/// an accumulator row is loaded and stored once for all NT tokens.
template <int NG, int NT, class T>
inline void accum_block(float* acc,            // [NG, vdim]
                        const float* pr,       // [NG, kDecodeTile] probabilities
                        std::int32_t j0, const T* const* rows,  // [NT] V rows of vdim elements
                        std::int32_t vdim) {
  constexpr int W = Vec::kLanes;
  Vec w[NG][NT];
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < NT; ++t) w[g][t] = Vec::set1(pr[g * kDecodeTile + j0 + t]);
  std::int32_t d = 0;
  for (; d + W <= vdim; d += W) {
    Vec vv[NT];
    for (int t = 0; t < NT; ++t) vv[t] = Vec::load(rows[t] + d);
    for (int g = 0; g < NG; ++g) {
      float* a = acc + static_cast<std::size_t>(g) * vdim + d;
      Vec x = Vec::load(a);
      for (int t = 0; t < NT; ++t) x = Vec::fma(w[g][t], vv[t], x);
      x.store(a);
    }
  }
  if (d < vdim) {
    const int rest = vdim - d;
    Vec vv[NT];
    for (int t = 0; t < NT; ++t) vv[t] = load_partial(rows[t] + d, rest);
    for (int g = 0; g < NG; ++g) {
      float* a = acc + static_cast<std::size_t>(g) * vdim + d;
      Vec x = load_partial(a, rest);
      for (int t = 0; t < NT; ++t) x = Vec::fma(w[g][t], vv[t], x);
      store_partial(x, a, rest);
    }
  }
}

#if defined(KVKIT_SIMD_AVX512)
/// One step of reduce16: the halves (at 256-, 128- or 64-bit granularity, selected by
/// Step) of a and b added pairwise, a's partial sums in the lower part of each pair.
template <int Step>
KVKIT_SIMD_INLINE __m512 reduce_step(__m512 a, __m512 b) {
  if constexpr (Step == 0)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  else if constexpr (Step == 1)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  else if constexpr (Step == 2)
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
  else
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/// Lane sums of 16 vectors in one vector (lane i = sum of x[i]'s lanes, in a fixed
/// order): a tree of 256/128/64/32-bit shuffles and adds, 3 instructions per sum instead
/// of about 10 for a lone hsum. The tree leaves input slot s's sum in lane P[s] with
/// P = {0,2,1,3, 8,10,9,11, 4,6,5,7, 12,14,13,15} (its own inverse), so slot s is fed x[P[s]].
KVKIT_SIMD_INLINE __m512 reduce16(const Vec (&x)[16]) {
  const __m512 y0 = reduce_step<0>(x[0].v, x[4].v), y1 = reduce_step<0>(x[2].v, x[6].v);
  const __m512 y2 = reduce_step<0>(x[1].v, x[5].v), y3 = reduce_step<0>(x[3].v, x[7].v);
  const __m512 y4 = reduce_step<0>(x[8].v, x[12].v), y5 = reduce_step<0>(x[10].v, x[14].v);
  const __m512 y6 = reduce_step<0>(x[9].v, x[13].v), y7 = reduce_step<0>(x[11].v, x[15].v);
  const __m512 z0 = reduce_step<1>(y0, y4), z1 = reduce_step<1>(y1, y5);
  const __m512 z2 = reduce_step<1>(y2, y6), z3 = reduce_step<1>(y3, y7);
  return reduce_step<3>(reduce_step<2>(z0, z2), reduce_step<2>(z1, z3));
}

/// score_block for NG queries x 16 / NG tokens: the 16 dot products are reduced together
/// (reduce16) and land in sc with one store per query.
template <int NG, bool Tail, class T>
inline void score_block16(const float* q,            // [NG, kdim]
                          const T* const* rows,      // [16 / NG] K rows of kdim elements
                          std::int32_t kdim, float* sc,  // [NG, kDecodeTile]
                          std::int32_t j0) {
  static_assert(NG == 1 || NG == 2 || NG == 4, "16 dot products per block");
  constexpr int NT = 16 / NG, W = Vec::kLanes;
  Vec acc[16];
  for (Vec& a : acc) a = Vec::zero();
  std::int32_t d = 0;
  for (; d + W <= kdim; d += W) {
    Vec kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = Vec::load(rows[t] + d);
    for (int g = 0; g < NG; ++g) {
      Vec qv = Vec::load(q + static_cast<std::size_t>(g) * kdim + d);
      // One load per query chunk: without this GCC folds the load into each of the NT
      // FMAs, and the loads, not the FMAs, become the bottleneck.
#if defined(__GNUC__) || defined(__clang__)
      __asm__("" : "+v"(qv.v));
#endif
      for (int t = 0; t < NT; ++t) acc[g * NT + t] = Vec::fma(qv, kv[t], acc[g * NT + t]);
    }
  }
  // A kdim that is not a multiple of W is its own instantiation: the partial loads of
  // the tail would otherwise keep the accumulators in memory for the whole loop.
  if constexpr (Tail) {
    const int rest = kdim - d;
    Vec kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = load_partial(rows[t] + d, rest);
    for (int g = 0; g < NG; ++g) {
      const Vec qv = load_partial(q + static_cast<std::size_t>(g) * kdim + d, rest);
      for (int t = 0; t < NT; ++t) acc[g * NT + t] = Vec::fma(qv, kv[t], acc[g * NT + t]);
    }
  }
  const __m512 r = reduce16(acc);  // lane g * NT + t: query g, token j0 + t
  if constexpr (NG == 1) {
    _mm512_storeu_ps(sc + j0, r);
  } else if constexpr (NG == 2) {
    _mm256_storeu_ps(sc + j0, _mm512_castps512_ps256(r));
    _mm256_storeu_ps(sc + kDecodeTile + j0,
                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
  } else {
    _mm_storeu_ps(sc + j0, _mm512_castps512_ps128(r));
    _mm_storeu_ps(sc + kDecodeTile + j0, _mm512_extractf32x4_ps(r, 1));
    _mm_storeu_ps(sc + 2 * kDecodeTile + j0, _mm512_extractf32x4_ps(r, 2));
    _mm_storeu_ps(sc + 3 * kDecodeTile + j0, _mm512_extractf32x4_ps(r, 3));
  }
}
#endif

#if defined(KVKIT_SIMD_AVX512BF16)
/// 32 bfloat16 of p (the first `rest` when Tail, zeros after), as vdpbf16ps's operand.
template <bool Tail>
KVKIT_SIMD_INLINE __m512bh load_bf16x32(const std::uint16_t* p, int rest) {
  if constexpr (Tail)
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((std::uint64_t{1} << rest) - 1), p);
  else
    return (__m512bh)_mm512_loadu_si512(p);
}

/// params.bf16_dot scores, unscaled: sc[g * kDecodeTile + j0 + t] = q_g · k_t for NG
/// bfloat16 queries (raw bits, rows of stride kdim) and NT tokens, with vdpbf16ps: each
/// lane accumulates two exact bf16 products per instruction in float. NG * NT == 16
/// reduces with reduce16 (one store per query), otherwise one lane sum per dot product.
template <int NG, int NT, bool Tail>
inline void score_block_bf16(const std::uint16_t* q,           // [NG, kdim] bf16 bits
                             const bfloat16_t* const* rows,    // [NT] K rows of kdim elements
                             std::int32_t kdim, float* sc,     // [NG, kDecodeTile]
                             std::int32_t j0) {
  Vec acc[NG * NT];
  for (Vec& a : acc) a = Vec::zero();
  std::int32_t d = 0;
  for (; d + 32 <= kdim; d += 32) {
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = load_bf16x32<false>(&rows[t][d].bits, 0);
    for (int g = 0; g < NG; ++g) {
      __m512i qi = _mm512_loadu_si512(q + static_cast<std::size_t>(g) * kdim + d);
#if defined(__GNUC__) || defined(__clang__)
      __asm__("" : "+v"(qi));  // one load per query chunk (see score_block16)
#endif
      const __m512bh qv = (__m512bh)qi;
      for (int t = 0; t < NT; ++t) acc[g * NT + t].v = _mm512_dpbf16_ps(acc[g * NT + t].v, qv, kv[t]);
    }
  }
  if constexpr (Tail) {
    const int rest = kdim - d;
    __m512bh kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = load_bf16x32<true>(&rows[t][d].bits, rest);
    for (int g = 0; g < NG; ++g) {
      const __m512bh qv = load_bf16x32<true>(q + static_cast<std::size_t>(g) * kdim + d, rest);
      for (int t = 0; t < NT; ++t) acc[g * NT + t].v = _mm512_dpbf16_ps(acc[g * NT + t].v, qv, kv[t]);
    }
  }
  if constexpr (NG * NT == 16) {
    const __m512 r = reduce16(acc);  // lane g * NT + t: query g, token j0 + t
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, r);
    for (int g = 0; g < NG; ++g)
      std::memcpy(sc + g * kDecodeTile + j0, lanes + g * NT, sizeof(float) * NT);
  } else {
    for (int g = 0; g < NG; ++g)
      for (int t = 0; t < NT; ++t) sc[g * kDecodeTile + j0 + t] = acc[g * NT + t].hsum();
  }
}

/// score_block_bf16 over all n tokens of a tile for NG queries.
template <int NG, bool Tail>
inline void score_tile_bf16(const std::uint16_t* q, const Tile<bfloat16_t>& tile, std::int32_t kdim,
                            float* sc, Upcoming<bfloat16_t>& pre) {
  static_assert(NG == 1 || NG == 2 || NG == 4, "16 dot products per block");
  constexpr int NT16 = 16 / NG;
  std::int32_t j = 0;
  for (; j + NT16 <= tile.n; j += NT16) {
    pre.advance(j + NT16, tile.n);
    score_block_bf16<NG, NT16, Tail>(q, tile.k + j, kdim, sc, j);
  }
  for (; j < tile.n; ++j) {
    pre.advance(j + 1, tile.n);
    score_block_bf16<NG, 1, Tail>(q, tile.k + j, kdim, sc, j);
  }
  pre.advance(tile.n, tile.n);
}
#endif

/// score_block over all n tokens of a tile for NG queries.
template <int NG, class T>
inline void score_tile(const float* q, const Tile<T>& tile, std::int32_t kdim, float* sc,
                       Upcoming<T>& pre) {
  constexpr int NT = kTokensPerStep;
  std::int32_t j = 0;
#if defined(KVKIT_SIMD_AVX512)
  if constexpr (NG == 1 || NG == 2 || NG == 4) {
    constexpr int NT16 = 16 / NG;
    const bool tail = kdim % Vec::kLanes != 0;
    for (; j + NT16 <= tile.n; j += NT16) {
      pre.advance(j + NT16, tile.n);
      if (tail)
        score_block16<NG, true>(q, tile.k + j, kdim, sc, j);
      else
        score_block16<NG, false>(q, tile.k + j, kdim, sc, j);
    }
  }
#endif
  for (; j + NT <= tile.n; j += NT) {
    pre.advance(j + NT, tile.n);
    score_block<NG, NT>(q, tile.k + j, kdim, sc, j);
  }
  for (; j < tile.n; ++j) {
    pre.advance(j + 1, tile.n);
    score_block<NG, 1>(q, tile.k + j, kdim, sc, j);
  }
  pre.advance(tile.n, tile.n);
}

/// accum_block over all n tokens of a tile for NG accumulator rows.
template <int NG, class T>
inline void accum_tile(float* acc, const float* pr, const Tile<T>& tile, std::int32_t vdim,
                       Upcoming<T>& pre) {
  constexpr int NT = kTokensPerStep;
  std::int32_t j = 0;
  for (; j + NT <= tile.n; j += NT) {
    pre.advance(j + NT, tile.n);
    accum_block<NG, NT>(acc, pr, j, tile.v + j, vdim);
  }
  for (; j < tile.n; ++j) {
    pre.advance(j + 1, tile.n);
    accum_block<NG, 1>(acc, pr, j, tile.v + j, vdim);
  }
  pre.advance(tile.n, tile.n);
}

/// Online-softmax state of one (sequence, kv head, chunk): G queries' scaled q rows, the
/// unnormalised V accumulators, running max and sum, and the tile's scores.
struct SoftmaxState {
  float* q;    // [G, kdim] sm_scale * q, gathered through k_channels
  float* acc;  // [G, vdim]
  float* m;    // [G] running max of the scaled logits
  float* l;    // [G] running sum of exp(logit - m)
  float* sc;   // [G, kDecodeTile] tile scores, then probabilities
};

inline SoftmaxState state_at(float* slice, const DecodeShape& s) {
  const std::size_t g = static_cast<std::size_t>(s.group);
  SoftmaxState st;
  st.q = slice;
  st.acc = st.q + g * static_cast<std::size_t>(s.kdim);
  st.m = st.acc + g * static_cast<std::size_t>(s.vdim);
  st.l = st.m + g;
  st.sc = st.l + g;
  return st;
}

/// One query's online-softmax step over a tile: sg [n] scaled logits become exp(logit -
/// m') with m' the new running max (lanes n .. up to the next multiple of Vec::kLanes are
/// set to -inf, so sg needs that room), l and the accumulator row acc [vdim] are rescaled
/// when the max moves, and l gains the tile's sum.
inline void softmax_tile(float* sg, std::int32_t n, float& m, float& l, float* acc, std::int32_t vdim) {
  constexpr int W = Vec::kLanes;
  const std::int32_t padded = (n + W - 1) / W * W;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (std::int32_t j = n; j < padded; ++j) sg[j] = ninf;  // exp -> 0
  Vec mx = Vec::set1(ninf);
  for (std::int32_t j = 0; j < padded; j += W) mx = Vec::max(mx, Vec::load(sg + j));
  const float m_new = std::max(m, mx.hmax());
  if (m_new > m) {
    const float alpha = std::exp(m - m_new);  // 0 on the first tile
    l *= alpha;
    scale(acc, alpha, vdim);
    m = m_new;
  }
  const Vec mv = Vec::set1(m_new);
  Vec sum = Vec::zero();
  for (std::int32_t j = 0; j < padded; j += W) {
    const Vec e = vexp(Vec::load(sg + j) - mv);
    e.store(sg + j);
    sum = sum + e;
  }
  l += sum.hsum();
}

/// The per-tile update: scores, softmax rescale, V accumulation, for all G queries, while
/// the K rows of next_k (during the scores) and the V rows of next_v (during the V pass)
/// are prefetched. `scores_row(g)` is where query g's scaled logits go (nullptr: not
/// requested).
template <class T, class ScoresRow>
void decode_tile(const SoftmaxState& st, const Tile<T>& tile, Upcoming<T> next_k, Upcoming<T> next_v,
                 const DecodeShape& s, ScoresRow&& scores_row) {
  constexpr int W = Vec::kLanes;
  const std::int32_t G = s.group, n = tile.n;
  Upcoming<T> none{};
  std::int32_t g = 0;
  bool scored = false;
#if defined(KVKIT_SIMD_AVX512BF16)
  if constexpr (std::is_same<T, bfloat16_t>::value) {
    if (s.bf16_dot) {
      // st.q holds the queries' bfloat16 bits (begin_state); the same query blocking.
      const std::uint16_t* qb = reinterpret_cast<const std::uint16_t*>(st.q);
      const bool tail = s.kdim % 32 != 0;
      auto blocks = [&](auto ng, auto tl) {
        constexpr int NG = decltype(ng)::value;
        constexpr bool TL = decltype(tl)::value;
        score_tile_bf16<NG, TL>(qb + static_cast<std::size_t>(g) * s.kdim, tile, s.kdim,
                                st.sc + g * kDecodeTile, g == 0 ? next_k : none);
      };
      using I4 = std::integral_constant<int, 4>;
      using I2 = std::integral_constant<int, 2>;
      using I1 = std::integral_constant<int, 1>;
      for (; g + 4 <= G; g += 4) tail ? blocks(I4{}, std::true_type{}) : blocks(I4{}, std::false_type{});
      for (; g + 2 <= G; g += 2) tail ? blocks(I2{}, std::true_type{}) : blocks(I2{}, std::false_type{});
      for (; g < G; ++g) tail ? blocks(I1{}, std::true_type{}) : blocks(I1{}, std::false_type{});
      scored = true;
    }
  }
#endif
  // The first head block issues the prefetches; the others find the rows on their way.
  if (!scored) {
    for (; g + 4 <= G; g += 4)
      score_tile<4>(st.q + static_cast<std::size_t>(g) * s.kdim, tile, s.kdim, st.sc + g * kDecodeTile,
                    g == 0 ? next_k : none);
    for (; g + 2 <= G; g += 2)
      score_tile<2>(st.q + static_cast<std::size_t>(g) * s.kdim, tile, s.kdim, st.sc + g * kDecodeTile,
                    g == 0 ? next_k : none);
    for (; g < G; ++g)
      score_tile<1>(st.q + static_cast<std::size_t>(g) * s.kdim, tile, s.kdim, st.sc + g * kDecodeTile,
                    g == 0 ? next_k : none);
  }

  const std::int32_t padded = (n + W - 1) / W * W;  // <= kDecodeTile
  for (g = 0; g < G; ++g) {
    float* sg = st.sc + g * kDecodeTile;
    if (s.bf16_dot) {  // unscaled q·k: apply sm_scale (lanes past n are reset below)
      const Vec sv = Vec::set1(s.sm_scale);
      for (std::int32_t j = 0; j < padded; j += W) (Vec::load(sg + j) * sv).store(sg + j);
    }
    if (float* out = scores_row(g))
      for (std::int32_t j = 0; j < n; ++j) out[tile.tok[j]] = sg[j];
    softmax_tile(sg, n, st.m[g], st.l[g], st.acc + static_cast<std::size_t>(g) * s.vdim, s.vdim);
  }

  g = 0;
  for (; g + 4 <= G; g += 4)
    accum_tile<4>(st.acc + static_cast<std::size_t>(g) * s.vdim, st.sc + g * kDecodeTile, tile, s.vdim,
                  g == 0 ? next_v : none);
  for (; g + 2 <= G; g += 2)
    accum_tile<2>(st.acc + static_cast<std::size_t>(g) * s.vdim, st.sc + g * kDecodeTile, tile, s.vdim,
                  g == 0 ? next_v : none);
  for (; g < G; ++g)
    accum_tile<1>(st.acc + static_cast<std::size_t>(g) * s.vdim, st.sc + g * kDecodeTile, tile, s.vdim,
                  g == 0 ? next_v : none);
}

/// Folds state b into state a (G rows): log-sum-exp merge of unnormalised accumulators.
inline void merge_states(const SoftmaxState& a, const SoftmaxState& b, std::int32_t G,
                         std::int32_t vdim) {
  for (std::int32_t g = 0; g < G; ++g) {
    const float m = std::max(a.m[g], b.m[g]);
    if (b.m[g] == -std::numeric_limits<float>::infinity()) continue;
    const float wa = std::exp(a.m[g] - m), wb = std::exp(b.m[g] - m);
    float* x = a.acc + static_cast<std::size_t>(g) * vdim;
    const float* y = b.acc + static_cast<std::size_t>(g) * vdim;
    for (std::int32_t d = 0; d < vdim; ++d) x[d] = x[d] * wa + y[d] * wb;
    a.l[g] = a.l[g] * wa + b.l[g] * wb;
    a.m[g] = m;
  }
}

/// Writes out rows (acc / l, scattered through v_channels) and lse of (b, h).
template <class T>
void finalize_state(const SoftmaxState& st, const DecodeShape& s, const DecodeAttentionParams& p,
                    std::int32_t b, std::int32_t h, T* out, float* lse) {
  constexpr std::size_t kBuf = 256;
  float buf[kBuf];
  for (std::int32_t g = 0; g < s.group; ++g) {
    const std::int64_t row = static_cast<std::int64_t>(b) * s.hq + static_cast<std::int64_t>(h) * s.group + g;
    T* o = out + row * s.out_width;
    const float inv = st.l[g] > 0.f ? 1.f / st.l[g] : 0.f;
    const float* a = st.acc + static_cast<std::size_t>(g) * s.vdim;
    if (p.v_channels != nullptr) {
      std::memset(static_cast<void*>(o), 0, sizeof(T) * static_cast<std::size_t>(s.out_width));
      const std::int32_t* ch = p.v_channels + static_cast<std::int64_t>(h) * s.vdim;
      for (std::int32_t d = 0; d < s.vdim; ++d) o[ch[d]] = from_float<T>(a[d] * inv);
    } else {
      for (std::int32_t d0 = 0; d0 < s.vdim; d0 += static_cast<std::int32_t>(kBuf)) {
        const std::int32_t n = std::min<std::int32_t>(static_cast<std::int32_t>(kBuf), s.vdim - d0);
        for (std::int32_t d = 0; d < n; ++d) buf[d] = a[d0 + d] * inv;
        convert(buf, o + d0, static_cast<std::size_t>(n));
      }
    }
    if (lse != nullptr)
      lse[row] = st.l[g] > 0.f ? st.m[g] + std::log(st.l[g])
                               : -std::numeric_limits<float>::infinity();
  }
}

/// Sets up the state of chunk [lb, le) of (b, h)'s list: scaled (channel-gathered)
/// queries, empty accumulators, and -inf scores for the unread pages this chunk answers
/// for. Returns the first scores row of (b, h) (nullptr when scores are off).
template <class T>
float* begin_state(const PagedKVView<T>& view, const T* q, const DecodeAttentionParams& p,
                   const DecodeShape& s, const SoftmaxState& st, const PageList& list,
                   std::int32_t lb, std::int32_t le, std::int32_t b, std::int32_t h, std::int32_t c) {
  const std::int32_t G = s.group;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (std::int32_t g = 0; g < G; ++g) {
    const T* qg = q + (static_cast<std::int64_t>(b) * s.hq + static_cast<std::int64_t>(h) * G + g) * s.q_width;
    float* qf = st.q + static_cast<std::size_t>(g) * s.kdim;
    if (s.bf16_dot) {
      // q as passed (bfloat16), unscaled: sm_scale multiplies the dot product instead.
      const std::int32_t* ch = p.k_channels != nullptr ? p.k_channels + static_cast<std::int64_t>(h) * s.kdim
                                                      : nullptr;
#if defined(KVKIT_SIMD_AVX512BF16)
      if constexpr (std::is_same<T, bfloat16_t>::value) {
        std::uint16_t* qb = reinterpret_cast<std::uint16_t*>(st.q) + static_cast<std::size_t>(g) * s.kdim;
        for (std::int32_t d = 0; d < s.kdim; ++d) qb[d] = qg[ch != nullptr ? ch[d] : d].bits;
      }
#else
      for (std::int32_t d = 0; d < s.kdim; ++d) qf[d] = to_float(qg[ch != nullptr ? ch[d] : d]);
#endif
    } else if (p.k_channels != nullptr) {
      const std::int32_t* ch = p.k_channels + static_cast<std::int64_t>(h) * s.kdim;
      for (std::int32_t d = 0; d < s.kdim; ++d) qf[d] = to_float(qg[ch[d]]) * p.sm_scale;
    } else {
      for (std::int32_t d = 0; d < s.kdim; ++d) qf[d] = to_float(qg[d]) * p.sm_scale;
    }
    st.m[g] = ninf;
    st.l[g] = 0.f;
  }
  std::fill(st.acc, st.acc + static_cast<std::size_t>(G) * s.vdim, 0.f);
  if (p.scores == nullptr) return nullptr;
  float* scores_base =
      p.scores + (static_cast<std::int64_t>(b) * s.hq + static_cast<std::int64_t>(h) * G) * p.scores_stride;
  if (list.subset != nullptr) {
    // Unread pages this chunk answers for: logical pages from the chunk's first (0 for
    // chunk 0) up to the next chunk's first (the sequence's end for the last chunk).
    const std::int32_t len = view.seq_len(b);
    const std::int32_t from = c == 0 ? 0 : list.logical(lb);
    const std::int32_t to = le < list.end ? list.logical(le) : view.num_pages(b);
    std::int32_t i = lb;
    for (std::int32_t lp = from; lp < to; ++lp) {
      if (i < le && list.logical(i) == lp) {
        ++i;
        continue;
      }
      const std::int32_t t0 = lp * view.page_size, t1 = std::min(len, t0 + view.page_size);
      for (std::int32_t g = 0; g < G; ++g)
        std::fill(scores_base + g * p.scores_stride + t0, scores_base + g * p.scores_stride + t1, ninf);
    }
  }
  return scores_base;
}

/// `src` with every row moved from head 0 to head h (row offsets are linear in the head).
template <class T>
inline void tile_for_head(const Tile<T>& src, std::int64_t koff, std::int64_t voff, Tile<T>& dst) {
  dst.n = src.n;
  for (std::int32_t j = 0; j < src.n; ++j) {
    dst.k[j] = src.k[j] + koff;
    dst.v[j] = src.v[j] + voff;
    dst.tok[j] = src.tok[j];
  }
}

/// One work item: chunk c of the page lists of heads [h0, h0 + heads) of sequence b (the
/// heads' lists must be equal: same_page_lists). Heads of a group walk the
/// tiles together, so with NHD K the whole [heads, D] row of a token is read in one pass;
/// each head's arithmetic is the same whatever the grouping. Leaves each head's state in
/// its slice (slice_of(h)) and, when its list has a single chunk, writes its output rows.
template <class T, class SliceOf>
void decode_item(const PagedKVView<T>& view, const T* q, T* out, float* lse,
                 const DecodeAttentionParams& p, const DecodeShape& s, SliceOf&& slice_of,
                 std::int32_t b, std::int32_t h0, std::int32_t heads, std::int32_t c) {
  const PageList list = page_list(view, p, b, h0);
  const std::int32_t chunks = list_chunks(list, view.page_size, s.splits);
  if (c >= chunks) return;
  const std::int32_t lb = list.begin + static_cast<std::int32_t>(
                                           static_cast<std::int64_t>(list.size()) * c / chunks);
  const std::int32_t le = list.begin + static_cast<std::int32_t>(
                                           static_cast<std::int64_t>(list.size()) * (c + 1) / chunks);
  constexpr std::int32_t kMaxGroupHeads = 16;  // callers group at most this many heads
  SoftmaxState st[kMaxGroupHeads];
  float* scores_base[kMaxGroupHeads];
  for (std::int32_t i = 0; i < heads; ++i) {
    st[i] = state_at(slice_of(h0 + i), s);
    scores_base[i] = begin_state(view, q, p, s, st[i], list, lb, le, b, h0 + i, c);
  }

  TileCursor<T> cursor(view, b, h0, list, lb, le);
  Tile<T> tiles[2];
  Tile<T> head_cur, head_next;
  cursor.next(tiles[0]);
  // Only the first tile is requested in one burst; later tiles are prefetched a tile
  // ahead, spread over the work of the tile before them (decode_tile). (Two tiles ahead,
  // or whole NHD token rows spread over the heads, measured slower on the reference machine.)
  for (std::int32_t i = 0; i < heads; ++i)
    for (std::int32_t j = 0; j < tiles[0].n; ++j) {
      prefetch_row(tiles[0].k[j] + i * view.k_stride_head, sizeof(T) * static_cast<std::size_t>(s.kdim));
      prefetch_row(tiles[0].v[j] + i * view.v_stride_head, sizeof(T) * static_cast<std::size_t>(s.vdim));
    }
  const std::size_t k_row = sizeof(T) * static_cast<std::size_t>(s.kdim);
  const std::size_t v_row = sizeof(T) * static_cast<std::size_t>(s.vdim);
  for (int cur = 0; tiles[cur].n > 0; cur ^= 1) {
    Tile<T>& next = tiles[cur ^ 1];
    cursor.next(next);
    for (std::int32_t i = 0; i < heads; ++i) {
      float* const sb = scores_base[i];
      auto scores_row = [&](std::int32_t g) -> float* {
        return sb != nullptr ? sb + g * p.scores_stride : nullptr;
      };
      if (i == 0) {
        decode_tile(st[0], tiles[cur], Upcoming<T>{next.k, next.n, k_row}, Upcoming<T>{next.v, next.n, v_row},
                    s, scores_row);
      } else {
        tile_for_head(tiles[cur], i * view.k_stride_head, i * view.v_stride_head, head_cur);
        tile_for_head(next, i * view.k_stride_head, i * view.v_stride_head, head_next);
        decode_tile(st[i], head_cur, Upcoming<T>{head_next.k, head_next.n, k_row},
                    Upcoming<T>{head_next.v, head_next.n, v_row}, s, scores_row);
      }
    }
  }
  if (chunks == 1)
    for (std::int32_t i = 0; i < heads; ++i) finalize_state(st[i], s, p, b, h0 + i, out, lse);
}

/// Status naming the first bad variant parameter (channels, page subset, scores), before
/// any output is written.
template <class T>
Status check_decode_variants(const PagedKVView<T>& view, const DecodeAttentionParams& p) {
  const std::int32_t hkv = view.num_kv_heads;
  KVKIT_CHECK_STATUS((!p.bf16_dot || std::is_same<T, bfloat16_t>::value), StatusCode::kInvalidArgument,
                     "bf16_dot is set but the view holds ", sizeof(T) == 4 ? "float" : "half",
                     " KV (bf16_dot needs bfloat16 KV)");
  if (p.k_channels != nullptr || p.v_channels != nullptr)
    KVKIT_CHECK_STATUS(p.q_dim > 0, StatusCode::kInvalidArgument, "q_dim ", p.q_dim,
                       " must be > 0 when k_channels or v_channels is set");
  const struct {
    const std::int32_t* ids;
    std::int32_t width;
    const char* name;
  } channel_sets[] = {{p.k_channels, view.head_dim, "k_channels"},
                      {p.v_channels, view.v_head_dim, "v_channels"}};
  for (const auto& cs : channel_sets) {
    if (cs.ids == nullptr) continue;
    const std::int64_t n = static_cast<std::int64_t>(hkv) * cs.width;
    for (std::int64_t i = 0; i < n; ++i)
      KVKIT_CHECK_STATUS(cs.ids[i] >= 0 && cs.ids[i] < p.q_dim, StatusCode::kOutOfRange, cs.name,
                         "[", i, "] = ", cs.ids[i], " (kv head ", i / cs.width, ") outside [0, q_dim ",
                         p.q_dim, ")");
  }
  KVKIT_CHECK_STATUS(p.page_subset == nullptr || p.page_subset_indptr != nullptr,
                     StatusCode::kInvalidArgument, "page_subset is set but page_subset_indptr is null");
  if (p.page_subset_indptr != nullptr) {
    const std::int32_t* ip = p.page_subset_indptr;
    KVKIT_CHECK_STATUS(ip[0] >= 0, StatusCode::kOutOfRange, "page_subset_indptr[0] = ", ip[0],
                       " is negative");
    for (std::int32_t b = 0; b < view.batch_size; ++b) {
      const std::int32_t np = view.num_pages(b);
      for (std::int32_t h = 0; h < hkv; ++h) {
        const std::int64_t i = static_cast<std::int64_t>(b) * hkv + h;
        KVKIT_CHECK_STATUS(ip[i + 1] >= ip[i], StatusCode::kOutOfRange, "page_subset_indptr[", i + 1,
                           "] = ", ip[i + 1], " is below page_subset_indptr[", i, "] = ", ip[i],
                           " (sequence ", b, ", kv head ", h, ")");
        KVKIT_CHECK_STATUS(ip[i + 1] == ip[i] || p.page_subset != nullptr,
                           StatusCode::kInvalidArgument, "page_subset is null");
        for (std::int32_t k = ip[i]; k < ip[i + 1]; ++k) {
          const std::int32_t lp = p.page_subset[k];
          KVKIT_CHECK_STATUS(lp >= 0 && lp < np, StatusCode::kOutOfRange, "page_subset[", k, "] = ", lp,
                             " outside [0, ", np, ") pages of sequence ", b, " (kv head ", h, ")");
          KVKIT_CHECK_STATUS(k == ip[i] || lp > p.page_subset[k - 1], StatusCode::kInvalidArgument,
                             "page_subset[", k, "] = ", lp, " is not above the previous entry ",
                             p.page_subset[k - 1], " (sequence ", b, ", kv head ", h,
                             "): subsets must be strictly ascending");
        }
      }
    }
  }
  if (p.scores != nullptr) {
    for (std::int32_t b = 0; b < view.batch_size; ++b)
      KVKIT_CHECK_STATUS(p.scores_stride >= view.seq_len(b), StatusCode::kInvalidArgument,
                         "scores_stride ", p.scores_stride, " is smaller than sequence ", b, "'s ",
                         view.seq_len(b), " tokens");
  }
  return Status::ok();
}

}  // namespace KVKIT_SIMD_NS
}  // namespace cpu
}  // namespace detail

// The public entry points live in an inline namespace named after the instruction set too:
// a program whose translation units are built with different flags (one with -mavx512f,
// one for x86-64 baseline) then links two differently named instantiations instead of
// letting the linker pick one body for both (an ODR violation that could run AVX-512 code
// from the baseline unit). Callers still write kvkit::paged_decode_attention.
inline namespace KVKIT_SIMD_NS {

/// Bytes of workspace paged_decode_attention needs for this view and params. Depends on
/// the batch size, heads, head dims and GQA group only (not on sequence lengths or the
/// thread count), so one allocation serves every step of a batch shape.
template <class T>
std::size_t paged_decode_attention_workspace_size(exec::Host, const PagedKVView<T>& view,
                                                  const DecodeAttentionParams& p) {
  if (view.num_kv_heads <= 0 || p.num_qo_heads <= 0 || view.batch_size <= 0) return 0;
  const detail::cpu::DecodeShape s = detail::cpu::decode_shape(view, p);
  const std::size_t items =
      static_cast<std::size_t>(view.batch_size) * static_cast<std::size_t>(s.hkv) * s.splits;
  return WorkspaceSizer().add<float>(items * s.item_floats).bytes();
}

/// Decode attention over a paged KV cache: for each sequence b and query head hq,
/// out[b, hq] = softmax(sm_scale * q[b, hq] · K[b, :, hq / G]ᵀ) · V[b, :, hq / G] with
/// G = num_qo_heads / num_kv_heads, over the tokens of the pages read: all of b's pages,
/// or the page subset of (b, kv head) when params.page_subset_indptr is set. With
/// k_channels / v_channels the keys / values are channel-restricted (see params.hpp), and
/// params.scores receives sm_scale * q·k of every token read (-inf on unread pages).
/// `lse`, when given, receives the natural-log sum of exp of the scaled logits, for
/// merge_attention_states. Nothing read (an empty sequence or subset) yields out = 0 and
/// lse = -inf. Checks the memory space, params (each variant's indices), pointers, page
/// table and workspace size (kInvalidArgument when smaller than
/// paged_decode_attention_workspace_size) before writing any output. Outputs are bitwise
/// identical for any thread count.
template <class T>
Status paged_decode_attention(exec::Host ex, PagedKVView<T> view,
                              const T* q,  // [batch, Hq, q_width] (q_dim or head_dim)
                              T* out,      // [batch, Hq, out_width] (q_dim or v_head_dim)
                              const DecodeAttentionParams& p, Workspace ws,
                              float* lse = nullptr) {  // [batch, Hq] or nullptr
  KVKIT_RETURN_IF_ERROR(detail::check_host_view(view, /*check_table=*/true));
  KVKIT_RETURN_IF_ERROR(detail::check_decode_params(view, p));
  KVKIT_RETURN_IF_ERROR(detail::cpu::check_decode_variants(view, p));
  if (view.batch_size == 0) return Status::ok();
  KVKIT_CHECK_STATUS(q != nullptr && out != nullptr, StatusCode::kInvalidArgument,
                     "paged_decode_attention got a null q or out");
  const std::size_t need = paged_decode_attention_workspace_size(ex, view, p);
  KVKIT_CHECK_STATUS(ws.bytes >= need && ws.data != nullptr, StatusCode::kInvalidArgument,
                     "workspace of ", ws.bytes, " bytes is smaller than the ", need,
                     " bytes paged_decode_attention needs");
  const detail::cpu::DecodeShape s = detail::cpu::decode_shape(view, p);
  const std::int64_t pairs = static_cast<std::int64_t>(view.batch_size) * s.hkv;
  float* scratch = WorkspaceCarver(ws).take<float>(static_cast<std::size_t>(pairs) * s.splits *
                                                   s.item_floats);
  if (scratch == nullptr)
    return make_status(StatusCode::kInvalidArgument, "workspace of ", ws.bytes, " bytes too small");
  auto slice = [&](std::int64_t item) { return scratch + static_cast<std::size_t>(item) * s.item_floats; };

  // NHD K (heads of a token adjacent): one item covers several heads so each token's row
  // is read in one pass, when they read the same pages (always without a page subset; with
  // one, checked per item, else the item's heads run one by one). The grouping may follow
  // the thread count: it changes which heads an item holds, never a head's arithmetic.
  // 16-bit HND too: an item then reads a page's head slices one after another, in address
  // order (Emerald Rapids VM, B 8 / B 1, S 8192, 1 thread: f16 and bf16 HND +5-16 %
  // tokens/s; float HND unchanged within noise, so it keeps one head per item, which an
  // EPYC measured as slightly faster).
  const bool group_heads = view.k_layout == KVLayout::kNHD || sizeof(T) == 2;
  const std::int32_t hpi =
      group_heads
          ? detail::heads_per_item(
                ex, static_cast<std::int32_t>(std::min<std::int64_t>(
                        std::numeric_limits<std::int32_t>::max(),
                        static_cast<std::int64_t>(view.batch_size) * s.splits)),
                s.hkv, 16)
          : 1;
  const std::int64_t groups = s.hkv / hpi;
  detail::parallel_for(ex, view.batch_size * groups * s.splits,
                       [&](std::int64_t begin, std::int64_t end, int) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t bg = item / s.splits;
      const std::int32_t b = static_cast<std::int32_t>(bg / groups);
      const std::int32_t c = static_cast<std::int32_t>(item % s.splits);
      auto slice_of = [&](std::int32_t h) {
        return slice((static_cast<std::int64_t>(b) * s.hkv + h) * s.splits + c);
      };
      const std::int32_t h0 = static_cast<std::int32_t>(bg % groups) * hpi;
      if (detail::cpu::same_page_lists(view, p, b, h0, hpi))
        detail::cpu::decode_item(view, q, out, lse, p, s, slice_of, b, h0, hpi, c);
      else
        for (std::int32_t h = h0; h < h0 + hpi; ++h)
          detail::cpu::decode_item(view, q, out, lse, p, s, slice_of, b, h, 1, c);
    }
  });
  if (s.splits > 1) {
    // Chunked pairs: fold chunk states in chunk order (fixed), then write the output. A
    // few KiB of states are merged on the calling thread (starting threads costs more).
    const std::int64_t merge_floats = pairs * s.splits * s.group * s.vdim;
    const exec::Host merge_ex = merge_floats < (std::int64_t{1} << 18) ? exec::Host{1} : ex;
    detail::parallel_for(merge_ex, pairs, [&](std::int64_t begin, std::int64_t end, int) {
      for (std::int64_t pair = begin; pair < end; ++pair) {
        const std::int32_t b = static_cast<std::int32_t>(pair / s.hkv);
        const std::int32_t h = static_cast<std::int32_t>(pair % s.hkv);
        const std::int32_t chunks = detail::cpu::list_chunks(
            detail::cpu::page_list(view, p, b, h), view.page_size, s.splits);
        if (chunks == 1) continue;  // written by its item
        const detail::cpu::SoftmaxState st0 = detail::cpu::state_at(slice(pair * s.splits), s);
        for (std::int32_t c = 1; c < chunks; ++c)
          detail::cpu::merge_states(st0, detail::cpu::state_at(slice(pair * s.splits + c), s),
                                    s.group, s.vdim);
        detail::cpu::finalize_state(st0, s, p, b, h, out, lse);
      }
    });
  }
  return Status::ok();
}

/// Merges two partial attentions over disjoint token sets (e.g. a packed old part and a
/// full-width recent window, or two page ranges) given their outputs and log-sum-exps:
/// out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b}) and
/// lse = log(e^{lse_a} + e^{lse_b}), computed relative to max(lse_a, lse_b). A side with
/// lse -inf (nothing read) contributes nothing: the other is copied bit for bit; both -inf
/// gives 0 and -inf. `out` may alias out_a or out_b. Accumulates in float; rows are
/// independent, so results do not depend on the thread count.
template <class T>
Status merge_attention_states(exec::Host ex,
                              const T* out_a,      // [rows, dim]
                              const float* lse_a,  // [rows]
                              const T* out_b,      // [rows, dim]
                              const float* lse_b,  // [rows]
                              T* out,              // [rows, dim]
                              float* lse,          // [rows] or nullptr
                              std::int64_t rows, std::int32_t dim) {
  KVKIT_CHECK_STATUS(rows >= 0 && dim >= 0, StatusCode::kInvalidArgument,
                     "merge_attention_states needs rows >= 0 and dim >= 0, got rows=", rows,
                     " dim=", dim);
  if (rows == 0) return Status::ok();
  KVKIT_CHECK_STATUS(out_a != nullptr && lse_a != nullptr && out_b != nullptr && lse_b != nullptr &&
                         (out != nullptr || dim == 0),
                     StatusCode::kInvalidArgument,
                     "merge_attention_states got a null out_a, lse_a, out_b, lse_b or out");
  using detail::cpu::Vec;
  const std::int64_t per_task = std::max<std::int64_t>(1, 16384 / std::max(1, dim));
  const std::int64_t tasks = (rows + per_task - 1) / per_task;
  detail::parallel_for(ex, tasks, [&](std::int64_t tb, std::int64_t te, int) {
    constexpr std::int32_t kBuf = 256;
    alignas(64) float fa[kBuf], fb[kBuf];
    const float ninf = -std::numeric_limits<float>::infinity();
    for (std::int64_t r = tb * per_task; r < std::min(rows, te * per_task); ++r) {
      const float la = lse_a[r], lb = lse_b[r];
      const std::size_t off = static_cast<std::size_t>(r) * static_cast<std::size_t>(dim);
      if (la == ninf || lb == ninf) {
        if (la == ninf && lb == ninf) {
          for (std::int32_t d = 0; d < dim; ++d) out[off + d] = from_float<T>(0.f);
        } else {
          const T* src = la == ninf ? out_b : out_a;
          if (out + off != src + off)
            std::memmove(static_cast<void*>(out + off), src + off, sizeof(T) * static_cast<std::size_t>(dim));
        }
        if (lse != nullptr) lse[r] = la == ninf ? lb : la;
        continue;
      }
      const float m = std::max(la, lb);
      const float ea = std::exp(la - m), eb = std::exp(lb - m);  // one of them is 1
      const float inv = 1.f / (ea + eb);
      const Vec wa = Vec::set1(ea * inv), wb = Vec::set1(eb * inv);
      for (std::int32_t d0 = 0; d0 < dim; d0 += kBuf) {
        const std::int32_t n = std::min(kBuf, dim - d0);
        detail::cpu::convert(out_a + off + d0, fa, static_cast<std::size_t>(n));
        detail::cpu::convert(out_b + off + d0, fb, static_cast<std::size_t>(n));
        std::int32_t d = 0;
        for (; d + Vec::kLanes <= n; d += Vec::kLanes)
          Vec::fma(wa, Vec::load(fa + d), wb * Vec::load(fb + d)).store(fa + d);
        for (; d < n; ++d) fa[d] = (ea * inv) * fa[d] + (eb * inv) * fb[d];
        detail::cpu::convert(fa, out + off + d0, static_cast<std::size_t>(n));
      }
      if (lse != nullptr) lse[r] = m + std::log1p(std::min(ea, eb));
    }
  });
  return Status::ok();
}

}  // namespace KVKIT_SIMD_NS
}  // namespace kvkit
