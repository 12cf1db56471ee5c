#pragma once
// paged_decode_attention on the CPU: one query token per sequence against its paged K/V.
//
// Work is split over (sequence, kv head), or (sequence, group of kv heads) when the heads
// of a token are adjacent in memory (NHD), so that each token's row is read in one pass.
// Each head converts its G = Hq/Hkv query heads to float once (pre-scaled by sm_scale),
// then streams the sequence in tiles of up to kDecodeTile tokens, with software prefetch
// of rows a few KiB ahead (rows of shuffled pages defeat the hardware prefetchers):
// scores for the whole tile and all G heads while each K row is hot,
// one softmax rescale per tile (online softmax, so no per-token scratch grows with the
// sequence), then the V rows are accumulated for all G heads. Accumulation is in float.

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
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace detail {
namespace cpu {

/// Tokens scored per softmax rescale.
inline constexpr std::int32_t kDecodeTile = 64;

/// Dot product with 8 independent partial sums so the compiler vectorizes it without
/// -ffast-math (the summation order is fixed, hence deterministic).
inline float dot_f32(const float* __restrict a,  // [n]
                     const float* __restrict b,  // [n]
                     std::int32_t n) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  std::int32_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[d + j] * b[d + j];
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; d < n; ++d) r += a[d] * b[d];
  return r;
}

/// y += a * x over n floats.
inline void axpy_f32(float* __restrict y,  // [n]
                     float a,
                     const float* __restrict x,  // [n]
                     std::int32_t n) {
  for (std::int32_t d = 0; d < n; ++d) y[d] += a * x[d];
}

#if defined(__GNUC__) || defined(__clang__)
// GCC/Clang vector extension: 4 floats, lowered to SSE2 on x86-64 and NEON on Arm.
typedef float F32x4 __attribute__((vector_size(16)));
inline F32x4 load_f32x4(const float* p) {  // [4], any alignment
  F32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_f32x4(float* p, F32x4 v) { std::memcpy(p, &v, sizeof v); }  // [4]
#endif

/// out[g] = dot_f32(q + g * q_stride, k, n) for g < 4, bitwise: the same 8 partial sums
/// per query, but each K chunk is loaded once for four queries, and the 8 independent
/// accumulator chains hide the add latency that bounds a single dot product.
inline void dot4_f32(const float* __restrict q,  // [4, q_stride]
                     std::size_t q_stride,
                     const float* __restrict k,  // [n]
                     std::int32_t n,
                     float* __restrict out) {  // [4]
#if defined(__GNUC__) || defined(__clang__)
  F32x4 lo[4] = {}, hi[4] = {};  // lanes 0-3 and 4-7 of dot_f32's partial sums
  std::int32_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const F32x4 k0 = load_f32x4(k + d), k1 = load_f32x4(k + d + 4);
    for (int g = 0; g < 4; ++g) {
      lo[g] += load_f32x4(q + g * q_stride + d) * k0;
      hi[g] += load_f32x4(q + g * q_stride + d + 4) * k1;
    }
  }
  for (int g = 0; g < 4; ++g) {
    float r = ((lo[g][0] + lo[g][1]) + (lo[g][2] + lo[g][3])) +
              ((hi[g][0] + hi[g][1]) + (hi[g][2] + hi[g][3]));
    for (std::int32_t e = d; e < n; ++e) r += q[g * q_stride + e] * k[e];
    out[g] = r;
  }
#else
  for (int g = 0; g < 4; ++g) out[g] = dot_f32(q + g * q_stride, k, n);
#endif
}

/// y[g] += a[g] * x for g < 4 (rows y + g * y_stride), each element exactly as axpy_f32
/// computes it, with x loaded once for the four rows.
inline void axpy4_f32(float* __restrict y,  // [4, y_stride]
                      std::size_t y_stride,
                      const float* __restrict a,  // [4]
                      const float* __restrict x,  // [n]
                      std::int32_t n) {
  std::int32_t d = 0;
#if defined(__GNUC__) || defined(__clang__)
  for (; d + 4 <= n; d += 4) {
    const F32x4 xv = load_f32x4(x + d);
    for (int g = 0; g < 4; ++g) {
      float* yg = y + g * y_stride + d;
      store_f32x4(yg, load_f32x4(yg) + a[g] * xv);
    }
  }
#endif
  for (; d < n; ++d)
    for (int g = 0; g < 4; ++g) y[g * y_stride + d] += a[g] * x[d];
}

/// Returns a float view of a row: the row itself for float, else `buf` filled by conversion.
template <class T>
inline const float* row_as_float(const T* __restrict row,  // [n]
                                 float* __restrict buf,    // [n] scratch, unused for float
                                 std::int32_t n) {
  if constexpr (std::is_same<T, float>::value) {
    (void)buf;
    (void)n;
    return row;
  } else {
    for (std::int32_t d = 0; d < n; ++d) buf[d] = to_float(row[d]);
    return buf;
  }
}

/// Floats of workspace one (sequence, kv head) item uses.
inline std::size_t decode_item_floats(std::int32_t group, std::int32_t head_dim) {
  const std::size_t g = static_cast<std::size_t>(group), d = static_cast<std::size_t>(head_dim);
  return 2 * g * d           // scaled q, accumulators
         + 2 * d             // converted K and V rows (16-bit types)
         + 2 * g             // running max and sum
         + g * kDecodeTile;  // tile scores / probabilities
}

}  // namespace cpu
}  // namespace detail

/// Bytes of workspace paged_decode_attention needs for this view and params (one float
/// slice per (sequence, kv head), so any thread count fits).
template <class T>
std::size_t paged_decode_attention_workspace_size(exec::Host, const PagedKVView<T>& view,
                                                  const DecodeAttentionParams& p) {
  if (view.num_kv_heads <= 0 || p.num_qo_heads <= 0 || view.batch_size <= 0) return 0;
  const std::int32_t group = std::max(1, p.num_qo_heads / view.num_kv_heads);
  const std::size_t items = static_cast<std::size_t>(view.batch_size) * view.num_kv_heads;
  return WorkspaceSizer()
      .add<float>(items * detail::cpu::decode_item_floats(group, view.head_dim))
      .bytes();
}

/// Decode attention over a paged KV cache: for each sequence b and query head hq,
/// out[b, hq] = softmax(sm_scale * q[b, hq] · K[b, :, hq / G]ᵀ) · V[b, :, hq / G] with
/// G = num_qo_heads / num_kv_heads, over all view.seq_len(b) tokens. `lse`, when given,
/// receives the natural-log sum of exp of the scaled logits. An empty sequence yields
/// out = 0 and lse = -inf. Checks the memory space, params, pointers, page table and
/// workspace size (kInvalidArgument when smaller than
/// paged_decode_attention_workspace_size) before touching any output.
template <class T>
Status paged_decode_attention(exec::Host ex, PagedKVView<T> view,
                              const T* q,  // [batch, Hq, D]
                              T* out,      // [batch, Hq, D]
                              const DecodeAttentionParams& p, Workspace ws,
                              float* lse = nullptr) {  // [batch, Hq] or nullptr
  KVKIT_RETURN_IF_ERROR(detail::check_host_view(view, /*check_table=*/true));
  KVKIT_RETURN_IF_ERROR(detail::check_decode_params(view, p));
  if (view.batch_size == 0) return Status::ok();
  KVKIT_CHECK_STATUS(q != nullptr && out != nullptr, StatusCode::kInvalidArgument,
                     "paged_decode_attention got a null q or out");
  const std::size_t need = paged_decode_attention_workspace_size(ex, view, p);
  KVKIT_CHECK_STATUS(ws.bytes >= need && ws.data != nullptr, StatusCode::kInvalidArgument,
                     "workspace of ", ws.bytes, " bytes is smaller than the ", need,
                     " bytes paged_decode_attention needs");
  const std::int32_t hkv = view.num_kv_heads, hq = p.num_qo_heads, dim = view.head_dim;
  const std::int32_t group = hq / hkv;
  const std::size_t item_floats = detail::cpu::decode_item_floats(group, dim);
  float* scratch = WorkspaceCarver(ws).take<float>(item_floats *
                                                   static_cast<std::size_t>(view.batch_size) * hkv);
  if (scratch == nullptr)
    return make_status(StatusCode::kInvalidArgument, "workspace of ", ws.bytes, " bytes too small");
  const float scale = p.sm_scale;

  // NHD-like layouts (heads of a token adjacent) read each token's whole [Hkv, D] row in
  // one pass, so one work item covers several heads; head-major layouts keep one head per
  // item (its rows are contiguous within a page). Each head's arithmetic is the same
  // either way, so results do not depend on the chunking or the thread count.
  const bool token_major = view.k_stride_head < view.k_stride_token;
  const std::int32_t hpi =
      token_major ? detail::heads_per_item(ex, view.batch_size, hkv, hkv) : 1;
  const std::int64_t items = static_cast<std::int64_t>(view.batch_size) * (hkv / hpi);
  // Rows prefetched ahead: about 8 KiB of K (or V) in flight.
  const std::size_t row_bytes = sizeof(T) * static_cast<std::size_t>(dim);
  const std::int32_t ahead = std::min<std::int32_t>(
      detail::cpu::kDecodeTile,
      std::max<std::int32_t>(1, static_cast<std::int32_t>(8192 / (row_bytes * hpi))));

  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int) {
    constexpr std::int32_t kTile = detail::cpu::kDecodeTile;
    const T* krow[kTile];  // row of head h0 of each tile token
    const T* vrow[kTile];
    const T* knext[kTile];  // K rows of the next tile's first `ahead` tokens
    const std::int64_t ksh = view.k_stride_head, vsh = view.v_stride_head;
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int32_t b = static_cast<std::int32_t>(item / (hkv / hpi));
      const std::int32_t h0 = static_cast<std::int32_t>(item % (hkv / hpi)) * hpi;
      // Scratch slice of (b, h0 + i): q, acc, K and V rows, max, sum, scores.
      auto slice = [&](std::int32_t i) {
        return scratch + (static_cast<std::size_t>(b) * hkv + h0 + i) * item_floats;
      };
      const std::size_t gd = static_cast<std::size_t>(group) * dim;
      const std::size_t off_m = 2 * gd + 2 * static_cast<std::size_t>(dim);
      const std::int64_t head_base = static_cast<std::int64_t>(b) * hq;
      for (std::int32_t i = 0; i < hpi; ++i) {
        float* qf = slice(i);
        float* m = qf + off_m;
        float* l = m + group;
        const std::int64_t head0 = head_base + static_cast<std::int64_t>(h0 + i) * group;
        for (std::int32_t g = 0; g < group; ++g) {
          const T* qg = q + (head0 + g) * dim;
          for (std::int32_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(qg[d]) * scale;
          m[g] = -std::numeric_limits<float>::infinity();
          l[g] = 0.f;
        }
        std::fill(qf + gd, qf + 2 * gd, 0.f);
      }

      const std::int32_t len = view.seq_len(b);
      std::int32_t page_idx = 0, slot = 0;
      std::int32_t page = len > 0 ? view.page_id(b, 0) : 0;
      for (std::int32_t t0 = 0; t0 < len; t0 += kTile) {
        const std::int32_t n = std::min(kTile, len - t0);
        for (std::int32_t j = 0; j < n; ++j) {  // row addresses, no division per token
          krow[j] = view.k_data + view.k_offset(page, slot, h0);
          vrow[j] = view.v_data + view.v_offset(page, slot, h0);
          if (++slot == view.page_size && t0 + j + 1 < len) {
            slot = 0;
            page = view.page_id(b, ++page_idx);
          }
        }
        // The next tile's first rows, to prefetch during this tile's V pass (a new tile
        // often starts on a new page, which the hardware prefetchers do not predict).
        const std::int32_t n_next = std::min(ahead, len - t0 - n);
        {
          std::int32_t pi = page_idx, sl = slot, pg = page;
          for (std::int32_t j = 0; j < n_next; ++j) {
            knext[j] = view.k_data + view.k_offset(pg, sl, h0);
            if (++sl == view.page_size && j + 1 < n_next) {
              sl = 0;
              pg = view.page_id(b, ++pi);
            }
          }
        }
        if (t0 == 0)
          for (std::int32_t j = 0; j < std::min(ahead, n); ++j)
            for (std::int32_t i = 0; i < hpi; ++i)
              detail::prefetch_bytes(krow[j] + i * ksh, row_bytes);
        for (std::int32_t j = 0; j < n; ++j) {
          // Prefetch the K rows `ahead` tokens on, then the first V rows of the tile.
          const std::int32_t pj = j + ahead;
          const T* pre = pj < n ? krow[pj] : (pj - n < n ? vrow[pj - n] : nullptr);
          const std::int64_t pre_sh = pj < n ? ksh : vsh;
          for (std::int32_t i = 0; i < hpi; ++i) {
            if (pre != nullptr) detail::prefetch_bytes(pre + i * pre_sh, row_bytes);
            float* qf = slice(i);
            float* kbuf = qf + 2 * gd;
            float* sc = qf + off_m + 2 * static_cast<std::size_t>(group);
            const float* kf = detail::cpu::row_as_float(krow[j] + i * ksh, kbuf, dim);
            std::int32_t g = 0;
            for (; g + 4 <= group; g += 4) {
              float r[4];
              detail::cpu::dot4_f32(qf + g * dim, dim, kf, dim, r);
              for (int e = 0; e < 4; ++e) sc[(g + e) * kTile + j] = r[e];
            }
            for (; g < group; ++g) sc[g * kTile + j] = detail::cpu::dot_f32(qf + g * dim, kf, dim);
          }
        }
        for (std::int32_t i = 0; i < hpi; ++i) {
          float* qf = slice(i);
          float* acc = qf + gd;
          float* m = qf + off_m;
          float* l = m + group;
          float* sc = l + group;
          for (std::int32_t g = 0; g < group; ++g) {
            float* s = sc + g * kTile;
            float tile_max = s[0];
            for (std::int32_t j = 1; j < n; ++j) tile_max = std::max(tile_max, s[j]);
            const float m_new = std::max(m[g], tile_max);
            if (m_new > m[g]) {
              const float alpha = std::exp(m[g] - m_new);  // 0 on the first tile
              l[g] *= alpha;
              float* a = acc + static_cast<std::size_t>(g) * dim;
              for (std::int32_t d = 0; d < dim; ++d) a[d] *= alpha;
              m[g] = m_new;
            }
            float sum = 0.f;
            for (std::int32_t j = 0; j < n; ++j) {
              s[j] = std::exp(s[j] - m_new);
              sum += s[j];
            }
            l[g] += sum;
          }
        }
        for (std::int32_t j = 0; j < n; ++j) {
          const std::int32_t pj = j + ahead;
          for (std::int32_t i = 0; i < hpi; ++i) {
            if (pj < n)
              detail::prefetch_bytes(vrow[pj] + i * vsh, row_bytes);
            else if (pj - n < n_next)
              detail::prefetch_bytes(knext[pj - n] + i * ksh, row_bytes);
            float* qf = slice(i);
            float* acc = qf + gd;
            float* vbuf = qf + 2 * gd + dim;
            const float* sc = qf + off_m + 2 * static_cast<std::size_t>(group);
            const float* vf = detail::cpu::row_as_float(vrow[j] + i * vsh, vbuf, dim);
            std::int32_t g = 0;
            for (; g + 4 <= group; g += 4) {
              const float pr[4] = {sc[g * kTile + j], sc[(g + 1) * kTile + j],
                                   sc[(g + 2) * kTile + j], sc[(g + 3) * kTile + j]};
              detail::cpu::axpy4_f32(acc + static_cast<std::size_t>(g) * dim, dim, pr, vf, dim);
            }
            for (; g < group; ++g)
              detail::cpu::axpy_f32(acc + static_cast<std::size_t>(g) * dim, sc[g * kTile + j],
                                    vf, dim);
          }
        }
      }
      for (std::int32_t i = 0; i < hpi; ++i) {
        const float* qf = slice(i);
        const float* acc = qf + gd;
        const float* m = qf + off_m;
        const float* l = m + group;
        const std::int64_t head0 = head_base + static_cast<std::int64_t>(h0 + i) * group;
        for (std::int32_t g = 0; g < group; ++g) {
          T* og = out + (head0 + g) * dim;
          const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
          const float* a = acc + static_cast<std::size_t>(g) * dim;
          for (std::int32_t d = 0; d < dim; ++d) og[d] = from_float<T>(a[d] * inv);
          if (lse != nullptr)
            lse[head0 + g] =
                l[g] > 0.f ? m[g] + std::log(l[g]) : -std::numeric_limits<float>::infinity();
        }
      }
    }
  });
  return Status::ok();
}

}  // namespace kvkit
