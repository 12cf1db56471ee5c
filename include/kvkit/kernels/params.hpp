#pragma once
// Parameters and argument checks shared by the CPU (kernels/cpu) and CUDA (kernels/cuda)
// backends of every core KV operation. Each operation has one public name; the backend
// is picked by the execution object passed first:
//
//   write_kv(exec, view, key, value, slot_mapping, num_tokens, token_stride)
//   paged_decode_attention(exec, view, q, out, params, workspace[, lse])
//   gather_tokens(exec, view, seq, token_ids, n, k_out, v_out)
//   compact_tokens(exec, view, keep, num_keep, keep_stride, workspace)
//   copy_pages(exec, view, src_pages, dst_pages, n)
//
// Each has `<op>_workspace_size(...)` where it needs scratch (0 otherwise). Run paths
// return kvkit::Status and never throw or allocate.

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
struct DecodeAttentionParams {
  std::int32_t num_qo_heads = 0;  // Hq; a positive multiple of view.num_kv_heads
  float sm_scale = 0.f;           // softmax scale, typically 1/sqrt(head_dim); must be finite > 0
};

namespace detail {

template <class T, class Exec>
Status check_view_space(const PagedKVView<T>& view, const Exec&) {
  KVKIT_CHECK_STATUS(view.space == Exec::space, StatusCode::kWrongMemorySpace, "view memory is ",
                     to_string(view.space), " but the execution object runs on ",
                     to_string(Exec::space));
  return Status::ok();
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
