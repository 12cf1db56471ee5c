#pragma once
// Parameters and argument checks shared by the CPU (kernels/cpu) and CUDA (kernels/cuda)
// backends of every core KV operation. Each operation has one public name; the backend
// is picked by the execution object passed first:
//
//   write_kv(exec, view, key, value, slot_mapping, num_tokens, token_stride[, v_token_stride])
//   paged_decode_attention(exec, view, q, out, params, workspace[, lse])
//   merge_attention_states(exec, out_a, lse_a, out_b, lse_b, out, lse, rows, dim)
//   gather_tokens(exec, view, seq, token_ids, n, k_out, v_out)
//   compact_tokens(exec, view, keep, num_keep, keep_stride, workspace)
//   copy_pages(exec, view, src_pages, dst_pages, n[, workspace])   (workspace required on CUDA)
//
// Each has `<op>_workspace_size(...)` where it needs scratch (0 otherwise). Run paths
// return kvkit::Status and never throw or allocate. Both backends check the same things
// and return the same StatusCode, writing nothing on failure; on CUDA, checks of
// device-resident tables are recorded in the exec::Cuda's DeviceStatus (see cuda.cuh).

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"

namespace kvkit {

/// Decode attention settings: one query token per sequence, GQA by head grouping
/// (query head hq reads KV head hq / (num_qo_heads / num_kv_heads)).
///
/// The first two fields give plain dense decode; every other field defaults to "off" and
/// turns on one variant the policies need. Variants combine freely, on both backends:
/// - page subset (Sketcher/EPS): (sequence b, kv head h) reads only the logical pages
///   page_subset[page_subset_indptr[b*Hkv+h] .. page_subset_indptr[b*Hkv+h+1]) of b,
///   strictly ascending indices into b's page list (< view.num_pages(b)).
/// - channel-restricted keys (ChannelSelector): the view's K rows hold view.head_dim
///   channels k_channels[h*head_dim + c] of the q_dim-wide query, so scores are
///   q[k_channels] · k (no scatter); V rows hold view.v_head_dim channels
///   v_channels[h*v_head_dim + c] of the q_dim-wide output, the rest of out is 0.
/// - scores out (Compressor/R1KV, SnapKV): scores[b, hq, t] = sm_scale * q·k_t for each
///   token t < seq_len(b) read; tokens of pages not read get -inf.
/// q is [batch, Hq, q_width] and out [batch, Hq, out_width] with q_width = q_dim when
/// k_channels is set, else view.head_dim, and out_width = q_dim when v_channels is set,
/// else view.v_head_dim. `lse` (natural log of the softmax denominator of the scaled
/// logits, -inf for nothing read) lets merge_attention_states combine two parts, e.g. a
/// packed old part and a full-width recent window.
struct DecodeAttentionParams {
  std::int32_t num_qo_heads = 0;  // Hq; a positive multiple of view.num_kv_heads
  float sm_scale = 0.f;           // softmax scale, typically 1/sqrt(head_dim); must be finite > 0

  const std::int32_t* page_subset_indptr = nullptr;  // [batch * Hkv + 1] or nullptr (all pages)
  const std::int32_t* page_subset = nullptr;         // [page_subset_indptr[batch * Hkv]]

  const std::int32_t* k_channels = nullptr;  // [Hkv, view.head_dim] ids in [0, q_dim) or nullptr
  const std::int32_t* v_channels = nullptr;  // [Hkv, view.v_head_dim] ids in [0, q_dim) or nullptr
  std::int32_t q_dim = 0;                    // full head dim when k_channels/v_channels are set

  float* scores = nullptr;         // [batch, Hq, scores_stride] scaled logits, or nullptr
  std::int64_t scores_stride = 0;  // >= the longest seq_len when scores is set

  /// Opt-in, bfloat16 views on the CPU only (kInvalidArgument for float/half views; the
  /// CUDA backend ignores it): scores are sm_scale * (q·k) with q left in bfloat16 (as the
  /// caller passes it) instead of (sm_scale * q)·k in float. Every product q_d k_d of two
  /// bfloat16 values is exact in float, so the score differs from the default only by
  /// float accumulation (order and pairing of the sums) and one rounding of the scale:
  /// the same error bound, not the same bits. A consumer built with AVX512_BF16
  /// (`__AVX512BF16__`, e.g. -march=znver4/sapphirerapids) computes it with `vdpbf16ps`
  /// (32 products per instruction, half the score FMAs of the default); other builds run
  /// the same arithmetic with float FMAs (unscaled q, scale applied to the dot product).
  /// Denormal bfloat16 inputs count as zero under vdpbf16ps. p·v is unchanged (float).
  bool bf16_dot = false;
};

namespace detail {

/// kWrongMemorySpace unless the view's memory lives where `Exec` runs (a host view handed
/// to exec::Cuda, or the reverse).
template <class T, class Exec>
Status check_view_space(const PagedKVView<T>& view, const Exec&) {
  KVKIT_CHECK_STATUS(view.space == Exec::space, StatusCode::kWrongMemorySpace, "view memory is ",
                     to_string(view.space), " but the execution object runs on ",
                     to_string(Exec::space));
  return Status::ok();
}

/// Storage pointers and geometry a kernel relies on (make_*_view guarantees these; a
/// hand-filled view may not). Reads only the view's own fields, never its memory or page
/// table, so it serves host and device views alike.
template <class T>
Status check_view_storage(const PagedKVView<T>& v) {
  KVKIT_CHECK_STATUS(v.k_data != nullptr && v.v_data != nullptr, StatusCode::kInvalidArgument,
                     "view has a null K or V base pointer");
  KVKIT_CHECK_STATUS(
      v.num_kv_heads > 0 && v.head_dim > 0 && v.v_head_dim > 0 && v.page_size > 0 &&
          v.num_pages_total > 0,
      StatusCode::kInvalidArgument, "view geometry must be positive, got heads=", v.num_kv_heads,
      " head_dim=", v.head_dim, " v_head_dim=", v.v_head_dim, " page_size=", v.page_size,
      " num_pages=", v.num_pages_total);
  KVKIT_CHECK_STATUS(v.batch_size >= 0, StatusCode::kInvalidArgument,
                     "batch_size must be >= 0, got ", v.batch_size);
  return Status::ok();
}

/// check_view_space then check_view_storage: the first checks of every operation on both
/// backends.
template <class T, class Exec>
Status check_view(const PagedKVView<T>& view, const Exec& ex) {
  KVKIT_RETURN_IF_ERROR(check_view_space(view, ex));
  return check_view_storage(view);
}

template <class T>
Status check_decode_params(const PagedKVView<T>& view, const DecodeAttentionParams& p) {
  KVKIT_CHECK_STATUS(p.num_qo_heads > 0 && p.num_qo_heads % view.num_kv_heads == 0,
                     StatusCode::kInvalidArgument, "num_qo_heads ", p.num_qo_heads,
                     " is not a positive multiple of num_kv_heads ", view.num_kv_heads);
  KVKIT_CHECK_STATUS(std::isfinite(p.sm_scale) && p.sm_scale > 0.f, StatusCode::kInvalidArgument,
                     "sm_scale ", p.sm_scale, " must be finite and > 0");
  return Status::ok();
}

}  // namespace detail
}  // namespace kvkit
