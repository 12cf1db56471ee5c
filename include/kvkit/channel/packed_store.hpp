#pragma once
// Storage and attention of the ChannelSelector's packed tokens.
//
// PackedPagePool: a policy-owned page pool (one array per layer of page blocks, each a
// page's NHD K rows [page_size, Hkv, k_dim], V rows [page_size, Hkv, v_dim] and residual)
// whose page ids are shared by all layers, like an engine's pool. The ChannelSelector
// keeps a sequence's tokens older than the full-width window in pages of such a pool with
// k_dim = rK, v_dim = rV, so their bytes are rK/D and rV/D of the full-width bytes (the
// engine's full-width pages of those tokens are given back to the engine). bytes_in_use() counts the pages handed out; the
// pool grows by doubling and never shrinks its capacity (capacity_bytes()).
//
// channel_attention: decode attention over an old part (packed pages read with the
// channel-restricted variant of paged_decode_attention: q·k on the rK selected dims, V
// written to the rV selected dims of the output, zero elsewhere) and a full-width window
// part (dense), merged in log-sum-exp form (merge_attention_states); with a residual
// (residual.hpp) the old part reads its dropped dims from their b-bit codes instead of 0.
// Mean compensation adds, to the old part's normalised output, a per-(sequence, kv head)
// vector `v_fill` (the mean over packed tokens of each dropped V dim): since the old part's
// attention weights sum to 1, this equals attention over V rows whose dropped dims hold
// that mean.
// Key compensation adds, to the old part's log-sum-exp of each query row, sm_scale * q·k_fill
// (natural log, as the kernel's lse), `k_fill` the per-(sequence, kv head) mean over packed
// tokens of each dropped K dim (0 on kept dims): the term is the same for every packed token,
// so this equals attention over K rows whose dropped dims hold that mean, and the packed
// part's scores are no longer biased against the window's full-width scores.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvkit/channel/residual.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/cpu/attention.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace channel {

/// A growable page pool of K rows of k_dim and V rows of v_dim elements per (token, head),
/// one array per layer, page ids shared by the layers (see the file comment). Each layer
/// keeps a page in one block, page p at p * page stride: K rows [page_size, Hkv, k_dim],
/// V rows [page_size, Hkv, v_dim] and, with a residual, K records [page_size, Hkv] and V
/// records [page_size, Hkv], a record a row's codes and its scale (ResidualBlock). A
/// sequence's pages come in any order after interleaved packing and releases; a block per
/// page keeps each page's parts together so that its next page can be prefetched as one
/// span (residual_channel_attention).
template <class T>
class PackedPagePool {
 public:
  /// residual_bits 4 or 8 adds, per (page, slot, head), the residual of the dims a row
  /// drops out of full_k_dim / full_v_dim (residual.hpp); 0: none.
  PackedPagePool(std::int32_t n_layers, std::int32_t n_kv_heads, std::int32_t k_dim, std::int32_t v_dim,
                 std::int32_t page_size, std::int32_t residual_bits = 0, std::int32_t full_k_dim = 0,
                 std::int32_t full_v_dim = 0)
      : layers_(n_layers), heads_(n_kv_heads), kdim_(k_dim), vdim_(v_dim), page_size_(page_size),
        rbits_(residual_bits) {
    KVKIT_CHECK(n_layers >= 1 && n_kv_heads >= 1 && k_dim >= 1 && v_dim >= 1 && page_size >= 1,
                "kvchan: packed pool geometry must be positive, got layers=", n_layers,
                " heads=", n_kv_heads, " k_dim=", k_dim, " v_dim=", v_dim, " page_size=", page_size);
    KVKIT_CHECK(residual_bits == 0 || residual_bits == 4 || residual_bits == 8,
                "kvchan: residual bits must be 0, 4 or 8, got ", residual_bits);
    const std::int64_t rows = static_cast<std::int64_t>(page_size_) * heads_;
    block_ = rows * (kdim_ + vdim_) * static_cast<std::int64_t>(sizeof(T));
    if (rbits_ != 0) {
      KVKIT_CHECK(full_k_dim >= k_dim && full_v_dim >= v_dim, "kvchan: residual full dims (", full_k_dim, ", ",
                  full_v_dim, ") below the packed dims (", k_dim, ", ", v_dim, ")");
      res_ = residual_block(block_, rbits_, page_size_, heads_, full_k_dim - k_dim, full_v_dim - v_dim);
      block_ = res_.end;
    }
    blocks_.resize(static_cast<std::size_t>(layers_));
  }

  /// A free page id (the pool doubles its capacity, at least 16 pages, when none is free).
  std::int32_t allocate() {
    if (free_.empty()) grow(std::max<std::int32_t>(16, capacity_ * 2));
    const std::int32_t p = free_.back();
    free_.pop_back();
    ++in_use_;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  /// Gives page `p` back (it must be in use).
  void release(std::int32_t p) {
    KVKIT_CHECK(p >= 0 && p < capacity_, "kvchan: release of page ", p, " outside [0, ", capacity_, ")");
    KVKIT_CHECK(in_use_ > 0, "kvchan: release of page ", p, " with no page in use");
    free_.push_back(p);
    --in_use_;
  }

  std::int32_t pages_in_use() const { return in_use_; }
  std::int32_t peak_pages_in_use() const { return peak_; }
  std::int32_t capacity() const { return capacity_; }
  std::int32_t k_dim() const { return kdim_; }
  std::int32_t v_dim() const { return vdim_; }
  std::int32_t page_size() const { return page_size_; }
  /// Bytes of one page id over all layers: K and V rows and, with a residual, the codes
  /// and scales, with the 0-3 bytes that align each scale and the records.
  std::int64_t page_bytes() const { return block_ * layers_; }
  std::int32_t residual_bits() const { return rbits_; }
  /// The residual rows of one layer (residual_bits() must be non-zero).
  ResidualView residual(std::int32_t layer) {
    KVKIT_CHECK(rbits_ != 0, "kvchan: this pool keeps no residual");
    return res_.view(bytes(layer), std::max(1, capacity_));
  }
  std::int64_t bytes_in_use() const { return page_bytes() * in_use_; }
  std::int64_t peak_bytes() const { return page_bytes() * peak_; }
  std::int64_t capacity_bytes() const { return page_bytes() * capacity_; }

  /// Geometry and strides (elements) of one layer's K and V rows: NHD in page blocks.
  KVGeometry geometry() const { return {heads_, kdim_, page_size_, std::max(1, capacity_), vdim_}; }
  KVStrides k_strides() const { return strides(kdim_); }
  KVStrides v_strides() const { return strides(vdim_); }
  T* k(std::int32_t layer) { return reinterpret_cast<T*>(bytes(layer)); }
  T* v(std::int32_t layer) {
    std::uint8_t* k0 = bytes(layer);
    return k0 == nullptr ? nullptr
                         : reinterpret_cast<T*>(k0) + static_cast<std::int64_t>(page_size_) * heads_ * kdim_;
  }
  /// Row of (layer, page, slot, head) in the K / V rows.
  T* k_row(std::int32_t layer, std::int32_t page, std::int32_t slot, std::int32_t head) {
    const KVStrides s = k_strides();
    return k(layer) + page * s.page + slot * s.token + head * s.head;
  }
  T* v_row(std::int32_t layer, std::int32_t page, std::int32_t slot, std::int32_t head) {
    const KVStrides s = v_strides();
    return v(layer) + page * s.page + slot * s.token + head * s.head;
  }

 private:
  // Cache-line aligned storage; blocks follow each other (a block's bytes are a multiple of
  // 4 with a residual, of sizeof(T) without, so every block's parts stay aligned).
  struct alignas(64) Line {
    std::uint8_t b[64];
  };
  KVStrides strides(std::int64_t dim) const {
    return {block_ / static_cast<std::int64_t>(sizeof(T)), heads_ * dim, dim};
  }
  std::uint8_t* bytes(std::int32_t layer) {
    std::vector<Line>& a = blocks_.at(static_cast<std::size_t>(layer));
    return a.empty() ? nullptr : a.data()->b;
  }
  void grow(std::int32_t cap) {
    const std::size_t lines = static_cast<std::size_t>((block_ * cap + 63) / 64);
    for (auto& a : blocks_) a.resize(lines, Line{});  // zeroed; old pages keep their offsets
    for (std::int32_t p = cap - 1; p >= capacity_; --p) free_.push_back(p);  // lowest id first out
    capacity_ = cap;
  }

  std::int32_t layers_, heads_, kdim_, vdim_, page_size_;
  std::int32_t rbits_ = 0;  // residual bits (0: none)
  ResidualBlock res_;       // where a block keeps its residual (rbits_ != 0)
  std::int64_t block_ = 0;  // bytes of one page of one layer
  std::vector<std::vector<Line>> blocks_;               // [n_layers][capacity * block_ bytes, rounded up]
  std::vector<std::int32_t> free_;
  std::int32_t capacity_ = 0, in_use_ = 0, peak_ = 0;
};

/// A view with only the geometry fields decode_shape reads set (for workspace sizing).
template <class T>
PagedKVView<T> shape_only_view(std::int32_t n_kv_heads, std::int32_t k_dim, std::int32_t v_dim,
                               std::int32_t batch) {
  PagedKVView<T> v;
  v.num_kv_heads = n_kv_heads;
  v.head_dim = k_dim;
  v.v_head_dim = v_dim;
  v.batch_size = batch;
  v.page_size = 1;
  return v;
}

/// Workspace bytes of channel_attention: both parts' outputs and lses, plus the larger
/// of the two kernels' workspaces. `old_shape` needs only its geometry and batch set.
template <class T>
std::size_t channel_attention_workspace_size(exec::Host ex, const PagedKVView<T>& window,
                                             const PagedKVView<T>& old_shape,
                                             const DecodeAttentionParams& dense,
                                             const DecodeAttentionParams& packed) {
  const std::size_t rows = static_cast<std::size_t>(std::max(0, window.batch_size)) *
                           static_cast<std::size_t>(std::max(0, dense.num_qo_heads));
  const std::size_t dim = static_cast<std::size_t>(window.v_head_dim);
  const std::size_t kern = std::max(paged_decode_attention_workspace_size(ex, window, dense),
                                    paged_decode_attention_workspace_size(ex, old_shape, packed));
  WorkspaceSizer sz;
  sz.add<T>(rows * dim);
  sz.add<float>(rows);
  sz.add<T>(rows * dim);
  sz.add<float>(rows);
  sz.add<unsigned char>(kern);
  return sz.bytes();
}

namespace detail {

// The shared frame of the channel_attention overloads: carves the workspace, runs
// old_part(out_o, lse_o, kernel workspace) for the old part, the dense kernel for the
// window, and merges the two by LSE into `out`.
template <class T, class OldPart>
Status channel_attention_frame(exec::Host ex, const PagedKVView<T>& window, const PagedKVView<T>& old,
                               const T* q,  // [batch, Hq, q_dim]
                               T* out,      // [batch, Hq, q_dim]
                               const DecodeAttentionParams& dense, const DecodeAttentionParams& packed,
                               Workspace ws, OldPart&& old_part) {
  KVKIT_CHECK_STATUS(window.batch_size == old.batch_size, StatusCode::kInvalidArgument,
                     "channel_attention: window batch ", window.batch_size, " != old batch ",
                     old.batch_size);
  KVKIT_CHECK_STATUS(window.head_dim == window.v_head_dim, StatusCode::kInvalidArgument,
                     "channel_attention: the window must be full width");
  const std::size_t need = channel_attention_workspace_size(ex, window, old, dense, packed);
  KVKIT_CHECK_STATUS(ws.data != nullptr && ws.bytes >= need, StatusCode::kInvalidArgument,
                     "channel_attention: workspace of ", ws.bytes, " bytes, needs ", need);
  const std::int32_t B = window.batch_size, Hq = dense.num_qo_heads, D = window.v_head_dim;
  const std::size_t rows = static_cast<std::size_t>(B) * static_cast<std::size_t>(Hq);
  WorkspaceCarver c(ws);
  T* out_o = c.take<T>(rows * D);
  float* lse_o = c.take<float>(rows);
  T* out_w = c.take<T>(rows * D);
  float* lse_w = c.take<float>(rows);
  const std::size_t kern = std::max(paged_decode_attention_workspace_size(ex, window, dense),
                                    paged_decode_attention_workspace_size(ex, old, packed));
  unsigned char* kws = c.take<unsigned char>(kern);
  if (out_o == nullptr || kws == nullptr)
    return make_status(StatusCode::kInvalidArgument, "channel_attention: workspace too small");
  KVKIT_RETURN_IF_ERROR(old_part(out_o, lse_o, Workspace{kws, kern}));
  KVKIT_RETURN_IF_ERROR(paged_decode_attention(ex, window, q, out_w, dense, Workspace{kws, kern}, lse_w));
  return merge_attention_states(ex, out_o, lse_o, out_w, lse_w, out, static_cast<float*>(nullptr),
                                static_cast<std::int64_t>(rows), D);
}

}  // namespace detail

/// Attention of one layer over an old part (`old`, read with `packed` params: channel
/// sets or none) and a window part (`window`, dense), merged by LSE into `out`. Both views
/// have the same batch rows. `v_fill` (nullptr: none) is added to the old part's output
/// of every sequence with old tokens (mean compensation). Never allocates; returns the
/// kernels' Status.
template <class T>
Status channel_attention(exec::Host ex, const PagedKVView<T>& window, const PagedKVView<T>& old,
                         const T* q,                // [batch, Hq, q_dim]
                         T* out,                    // [batch, Hq, q_dim]
                         const DecodeAttentionParams& dense, const DecodeAttentionParams& packed,
                         const float* v_fill,       // [batch, Hkv, q_dim] or nullptr
                         const float* k_fill,       // [batch, Hkv, q_dim] or nullptr
                         Workspace ws) {
  const std::int32_t Hq = dense.num_qo_heads, D = window.v_head_dim;
  const std::size_t rows = static_cast<std::size_t>(window.batch_size) * static_cast<std::size_t>(std::max(0, Hq));
  return detail::channel_attention_frame(ex, window, old, q, out, dense, packed, ws,
                                         [&](T* out_o, float* lse_o, Workspace kws) -> Status {
    KVKIT_RETURN_IF_ERROR(paged_decode_attention(ex, old, q, out_o, packed, kws, lse_o));
    if (k_fill == nullptr && v_fill == nullptr) return Status::ok();
    const std::size_t Hkv = static_cast<std::size_t>(old.num_kv_heads);
    const std::size_t G = static_cast<std::size_t>(Hq) / Hkv;
    for (std::size_t r = 0; r < rows; ++r) {
      if (lse_o[r] == -std::numeric_limits<float>::infinity()) continue;  // no old tokens
      // fills are [B, Hkv, D]: row r = (sequence b, query head), kv head = query head / G
      const std::size_t fill_row =
          ((r / static_cast<std::size_t>(Hq)) * Hkv + (r % static_cast<std::size_t>(Hq)) / G) * D;
      if (k_fill != nullptr) {  // key compensation: a per-row shift of the old part's lse
        const float* f = k_fill + fill_row;
        const T* qr = q + r * D;
        float dot = 0.f;
        for (std::int32_t d = 0; d < D; ++d) dot += to_float(qr[d]) * f[d];
        lse_o[r] += packed.sm_scale * dot;
      }
      if (v_fill != nullptr) {  // dropped V dims read as their fill: sum_t p_t = 1 adds it once
        const float* f = v_fill + fill_row;
        T* o = out_o + r * D;
        for (std::int32_t d = 0; d < D; ++d) o[d] = from_float<T>(to_float(o[d]) + f[d]);
      }
    }
    return Status::ok();
  });
}

/// channel_attention with the old part's dropped dims read from their residual `res`
/// (residual.hpp: residual_channel_attention over `old` with `packed`'s channel sets);
/// no compensation (the residual replaces it). Same workspace, same merge.
template <class T>
Status channel_attention(exec::Host ex, const PagedKVView<T>& window, const PagedKVView<T>& old,
                         ResidualView res,
                         const T* q,  // [batch, Hq, q_dim]
                         T* out,      // [batch, Hq, q_dim]
                         const DecodeAttentionParams& dense, const DecodeAttentionParams& packed,
                         Workspace ws) {
  return detail::channel_attention_frame(ex, window, old, q, out, dense, packed, ws,
                                         [&](T* out_o, float* lse_o, Workspace) -> Status {
    return residual_channel_attention(ex, old, res, q, out_o, lse_o, packed);
  });
}

/// channel_attention without key compensation.
template <class T>
Status channel_attention(exec::Host ex, const PagedKVView<T>& window, const PagedKVView<T>& old,
                         const T* q,                // [batch, Hq, q_dim]
                         T* out,                    // [batch, Hq, q_dim]
                         const DecodeAttentionParams& dense, const DecodeAttentionParams& packed,
                         const float* v_fill,       // [batch, Hkv, q_dim] or nullptr
                         Workspace ws) {
  return channel_attention(ex, window, old, q, out, dense, packed, v_fill, static_cast<const float*>(nullptr), ws);
}

}  // namespace channel
}  // namespace kvkit
