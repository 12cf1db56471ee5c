#pragma once
// paged_decode_attention on the CPU: one query token per sequence against its paged K/V.
//
// Work is split over (sequence, kv head). Each item converts its G = Hq/Hkv query heads
// to float once (pre-scaled by sm_scale), then streams the sequence in tiles of up to
// kDecodeTile tokens: scores for the whole tile and all G heads while each K row is hot,
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
inline float dot_f32(const float* a,  // [n]
                     const float* b,  // [n]
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
inline void axpy_f32(float* y,  // [n]
                     float a,
                     const float* x,  // [n]
                     std::int32_t n) {
  for (std::int32_t d = 0; d < n; ++d) y[d] += a * x[d];
}

/// Returns a float view of a row: the row itself for float, else `buf` filled by conversion.
template <class T>
inline const float* row_as_float(const T* row,  // [n]
                                 float* buf,    // [n] scratch, unused for float
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
  const std::int64_t items = static_cast<std::int64_t>(view.batch_size) * hkv;

  detail::parallel_for(ex, items, [&](std::int64_t begin, std::int64_t end, int) {
    constexpr std::int32_t kTile = detail::cpu::kDecodeTile;
    const T* krow[kTile];
    const T* vrow[kTile];
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int32_t b = static_cast<std::int32_t>(item / hkv);
      const std::int32_t h = static_cast<std::int32_t>(item % hkv);
      float* qf = scratch + static_cast<std::size_t>(item) * item_floats;
      float* acc = qf + static_cast<std::size_t>(group) * dim;
      float* kbuf = acc + static_cast<std::size_t>(group) * dim;
      float* vbuf = kbuf + dim;
      float* m = vbuf + dim;
      float* l = m + group;
      float* sc = l + group;  // [group, kTile]
      const std::int64_t head0 =
          static_cast<std::int64_t>(b) * hq + static_cast<std::int64_t>(h) * group;
      for (std::int32_t g = 0; g < group; ++g) {
        const T* qg = q + (head0 + g) * dim;
        for (std::int32_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(qg[d]) * scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc, acc + static_cast<std::size_t>(group) * dim, 0.f);

      const std::int32_t len = view.seq_len(b);
      std::int32_t page_idx = 0, slot = 0;
      std::int32_t page = len > 0 ? view.page_id(b, 0) : 0;
      for (std::int32_t t0 = 0; t0 < len; t0 += kTile) {
        const std::int32_t n = std::min(kTile, len - t0);
        for (std::int32_t j = 0; j < n; ++j) {  // row addresses, no division per token
          krow[j] = view.k_data + view.k_offset(page, slot, h);
          vrow[j] = view.v_data + view.v_offset(page, slot, h);
          if (++slot == view.page_size && t0 + j + 1 < len) {
            slot = 0;
            page = view.page_id(b, ++page_idx);
          }
        }
        for (std::int32_t j = 0; j < n; ++j) {
          const float* kf = detail::cpu::row_as_float(krow[j], kbuf, dim);
          for (std::int32_t g = 0; g < group; ++g)
            sc[g * kTile + j] = detail::cpu::dot_f32(qf + g * dim, kf, dim);
        }
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
        for (std::int32_t j = 0; j < n; ++j) {
          const float* vf = detail::cpu::row_as_float(vrow[j], vbuf, dim);
          for (std::int32_t g = 0; g < group; ++g)
            detail::cpu::axpy_f32(acc + static_cast<std::size_t>(g) * dim, sc[g * kTile + j], vf,
                                  dim);
        }
      }
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
  });
  return Status::ok();
}

}  // namespace kvkit
