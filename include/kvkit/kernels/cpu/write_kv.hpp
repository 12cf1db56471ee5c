#pragma once
// write_kv on the CPU: scatter new tokens' K/V rows into the paged pool by slot mapping.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/cpu/checks.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/cpu/simd.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {

namespace detail {
namespace cpu {

/// dst[0..n) = src[0..n) converted to the pool's dtype: memcpy for the same dtype, else
/// the exact vectorised converters of simd.hpp (bit for bit from_float / to_float).
template <class Dst, class Src>
inline void move_row(Dst* dst, const Src* src, std::size_t n) {
  if constexpr (std::is_same<Dst, Src>::value)
    std::memcpy(dst, src, n * sizeof(Dst));
  else
    convert(src, dst, n);
}

/// write_kv's body for source rows of dtype S into a pool of dtype T.
template <class T, class S>
Status write_kv_impl(exec::Host ex, PagedKVView<T> view, const S* key, const S* value,
                     const std::int64_t* slot_mapping,  // [num_tokens]
                     std::int32_t num_tokens, std::int64_t token_stride,
                     std::int64_t v_token_stride) {
  KVKIT_RETURN_IF_ERROR(check_host_view(view, /*check_table=*/false));
  KVKIT_CHECK_STATUS(num_tokens >= 0, StatusCode::kInvalidArgument, "num_tokens must be >= 0, got ",
                     num_tokens);
  if (num_tokens == 0) return Status::ok();
  KVKIT_CHECK_STATUS(key != nullptr && value != nullptr && slot_mapping != nullptr,
                     StatusCode::kInvalidArgument,
                     "write_kv got a null key, value or slot_mapping");
  if (v_token_stride < 0) v_token_stride = token_stride;
  const std::int64_t row = static_cast<std::int64_t>(view.num_kv_heads) * view.head_dim;
  const std::int64_t v_row = static_cast<std::int64_t>(view.num_kv_heads) * view.v_head_dim;
  KVKIT_CHECK_STATUS(token_stride >= row, StatusCode::kInvalidArgument, "token_stride ",
                     token_stride, " is smaller than num_kv_heads*head_dim ", row);
  KVKIT_CHECK_STATUS(v_token_stride >= v_row, StatusCode::kInvalidArgument, "v_token_stride ",
                     v_token_stride, " is smaller than num_kv_heads*v_head_dim ", v_row);
  const std::int64_t num_slots = static_cast<std::int64_t>(view.num_pages_total) * view.page_size;
  for (std::int32_t i = 0; i < num_tokens; ++i) {
    const std::int64_t s = slot_mapping[i];
    KVKIT_CHECK_STATUS(s < num_slots, StatusCode::kOutOfRange, "slot ", s, " of token ", i,
                       " out of range [0, ", num_slots, ")");
  }
  const std::size_t dim = static_cast<std::size_t>(view.head_dim);
  const std::size_t vdim = static_cast<std::size_t>(view.v_head_dim);
  parallel_for(ex, num_tokens, [&](std::int64_t begin, std::int64_t end, int) {
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int64_t s = slot_mapping[i];
      if (s < 0) continue;
      const S* k = key + i * token_stride;
      const S* v = value + i * v_token_stride;
      for (std::int32_t h = 0; h < view.num_kv_heads; ++h) {
        move_row(view.k_slot_ptr(s, h), k + static_cast<std::int64_t>(h) * view.head_dim, dim);
        move_row(view.v_slot_ptr(s, h), v + static_cast<std::int64_t>(h) * view.v_head_dim, vdim);
      }
    }
  });
  return Status::ok();
}

}  // namespace cpu
}  // namespace detail

/// Writes token i's key and value (num_kv_heads rows of head_dim / v_head_dim elements,
/// rows packed, tokens token_stride / v_token_stride apart) to pool slot slot_mapping[i]
/// (vLLM's reshape_and_cache: slot = page * page_size + offset). Negative slots are
/// padding and skipped. All slots are checked before anything is written, so a failed
/// call leaves the pool unchanged; if two tokens map to one slot, which one wins is
/// unspecified. Returns kOutOfRange naming the first slot outside the pool.
template <class T>
Status write_kv(exec::Host ex, PagedKVView<T> view,
                const T* key,                      // [num_tokens, Hkv, D] (token_stride)
                const T* value,                    // [num_tokens, Hkv, Dv] (v_token_stride)
                const std::int64_t* slot_mapping,  // [num_tokens]
                std::int32_t num_tokens, std::int64_t token_stride,
                std::int64_t v_token_stride = -1) {  // -1: token_stride
  return detail::cpu::write_kv_impl(ex, view, key, value, slot_mapping, num_tokens, token_stride,
                                    v_token_stride);
}

/// write_kv of float rows (a model's K/V projections) into a half or bfloat16 pool: each
/// row is rounded to T as it is stored (round to nearest even, NaN quieted), bit for bit
/// what from_float<T> gives, with the vectorised converters of simd.hpp (F16C / AVX-512 /
/// NEON where the consumer builds for them). Same checks and semantics as write_kv.
template <class T, class = std::enable_if_t<!std::is_same<T, float>::value>>
Status write_kv(exec::Host ex, PagedKVView<T> view,
                const float* key,                  // [num_tokens, Hkv, D] (token_stride)
                const float* value,                // [num_tokens, Hkv, Dv] (v_token_stride)
                const std::int64_t* slot_mapping,  // [num_tokens]
                std::int32_t num_tokens, std::int64_t token_stride,
                std::int64_t v_token_stride = -1) {  // -1: token_stride
  return detail::cpu::write_kv_impl(ex, view, key, value, slot_mapping, num_tokens, token_stride,
                                    v_token_stride);
}

}  // namespace kvkit
