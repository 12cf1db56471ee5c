#pragma once
// kvchan's low-precision residual: the dims a packed row drops, kept as b-bit codes.
//
// The seed drops the unselected dims of a packed row (reads them as 0). On SmolLM2 that
// costs a median attention KL of 5e-3 at a quarter of the key dims dropped, so channel
// dropping alone saves little at KL <= 1e-3 (bench/RESULTS.md). With the residual, a row
// keeps its selected dims exact and the dropped ones as integers with one scale per row:
// the selected (high-importance, outlier) dims set most of a row's dynamic range, so once
// they are exact the scale of the rest is small and 8 or 4 bits describe it well.
//
// Math, for one (token, kv head) row x of K (or V) and its ascending channel set S of r
// dims out of D; R = [0, D) \ S ascending, n = D - r dropped dims, qmax = 2^(b-1) - 1:
//   s   = (max_{d in R} |x_d|) / qmax                        (float; s = 0 when all are 0)
//   c_j = clamp(round_half_even(x_{R_j} / s), -qmax, qmax)   (c_j = 0 when s = 0)
//   the row reads back as x_d on S and s * c_j on d = R_j, so |x_d - s c_j| <= s / 2
//   (up to the float rounding of x / s and s * c_j).
// Storage per row: ceil(n b / 8) code bytes (8 bits: one int8 per code; 4 bits: code j in
// the low nibble of byte j / 2 when j is even, the high nibble when odd, two's complement)
// and the float s; one K and one V residual per (page, slot, kv head), in the same page
// block as the packed rows of that page id of a PackedPagePool (packed_store.hpp).
//
// residual_channel_attention: decode attention over packed pages plus their residual,
//   score_t = sm_scale * (sum_{c < r} q[S_c] k_t[c] + sum_j q[R_j] (s_t c_tj))
//   out     = sum_t p_t v'_t, v'_t the V row read back as above (selected dims exact),
// with the lse of the scaled scores (natural log; -inf when nothing is read), so
// channel_attention merges it with the full-width window like the plain packed part.
// It is the dense attention of the rows as they read back, to float rounding (tested
// against float64).
//
// Errors: bits outside {4, 8}, geometry that does not match, page or channel ids out of
// range give a Status and nothing is written. Never allocates: the attention kernel keeps
// its scratch on the stack (about 43 KiB per worker at the limits kMaxResidualDim and
// kMaxResidualGroup; larger head dims or groups are kUnsupported).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kvkit/channel/pack_pages.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/kernels/cpu/attention.hpp"
#include "kvkit/kernels/cpu/parallel.hpp"
#include "kvkit/kernels/cpu/simd.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace channel {

/// Largest head dim and query group the residual kernels take (their stack arrays).
inline constexpr std::int32_t kMaxResidualDim = 256;
inline constexpr std::int32_t kMaxResidualGroup = 16;

/// Code bytes of n dropped dims at `bits` bits (0 when n == 0).
KVKIT_HOST_DEVICE std::int32_t residual_code_bytes(std::int32_t n, std::int32_t bits) {
  return (n * bits + 7) / 8;
}

/// The residual rows of one layer of a pool (views own nothing; pass by value). Row
/// (page, slot, head) has k_bytes K code bytes at k_codes + page * page_stride + (slot *
/// num_kv_heads + head) * k_row_stride and its float K scale at the same offset from
/// k_scales; V likewise with v_codes, v_scales and v_row_stride (offsets in bytes). A
/// PackedPagePool keeps them as records (codes, then the scale: ResidualBlock) in the
/// page's block, after its packed rows (packed_store.hpp), so a page is one span of memory
/// to prefetch; separate arrays work as well.
struct ResidualView {
  std::uint8_t* k_codes = nullptr;  // [num_pages_total, page_size, Hkv] rows of k_bytes, strides below
  std::uint8_t* v_codes = nullptr;  // [num_pages_total, page_size, Hkv] rows of v_bytes
  float* k_scales = nullptr;        // [num_pages_total, page_size, Hkv], strides below
  float* v_scales = nullptr;        // [num_pages_total, page_size, Hkv]
  std::int64_t page_stride = 0;     // bytes from page p to p + 1 (every part)
  std::int64_t k_row_stride = 0;    // bytes from row (slot, head) to the next (K codes and scales)
  std::int64_t v_row_stride = 0;    // bytes from row to row (V codes and scales)
  std::int32_t bits = 0;            // 4 or 8
  std::int32_t k_bytes = 0;         // code bytes per K row: residual_code_bytes(D - rK, bits)
  std::int32_t v_bytes = 0;         // code bytes per V row: residual_code_bytes(Dv - rV, bits)
  std::int32_t page_size = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t num_pages_total = 0;

  /// Byte offset of row (page, slot, head) from a part's base, at `row_stride`.
  KVKIT_HOST_DEVICE std::int64_t offset(std::int32_t page, std::int32_t slot, std::int32_t head,
                                        std::int64_t row_stride) const {
    return page * page_stride + (static_cast<std::int64_t>(slot) * num_kv_heads + head) * row_stride;
  }
  /// The K / V codes and scales of row (page, slot, head).
  KVKIT_HOST_DEVICE std::uint8_t* k_row(std::int32_t page, std::int32_t slot, std::int32_t head) const {
    return k_codes + offset(page, slot, head, k_row_stride);
  }
  KVKIT_HOST_DEVICE std::uint8_t* v_row(std::int32_t page, std::int32_t slot, std::int32_t head) const {
    return v_codes + offset(page, slot, head, v_row_stride);
  }
  KVKIT_HOST_DEVICE float* k_scale(std::int32_t page, std::int32_t slot, std::int32_t head) const {
    return reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(k_scales) + offset(page, slot, head, k_row_stride));
  }
  KVKIT_HOST_DEVICE float* v_scale(std::int32_t page, std::int32_t slot, std::int32_t head) const {
    return reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(v_scales) + offset(page, slot, head, v_row_stride));
  }
};

/// Where a page block keeps its residual: after `lead` bytes (the page's packed rows; 0:
/// none) rounded up to 4, K records [page_size, Hkv], then V records [page_size, Hkv]; a
/// record is a row's codes, then its float scale at the next multiple of 4, so records
/// stay aligned. PackedPagePool lays out its pages so; view() describes `pages` such
/// blocks one after the other.
struct ResidualBlock {
  std::int64_t k_records = 0, v_records = 0;  // byte offsets of the K / V records in a block
  std::int64_t k_record = 0, v_record = 0;    // bytes of one K / V record
  std::int64_t k_scale = 0, v_scale = 0;      // byte offset of the scale in a K / V record
  std::int64_t end = 0;                       // bytes of a block
  std::int32_t bits = 0, k_bytes = 0, v_bytes = 0, page_size = 0, num_kv_heads = 0;

  /// The residual of `pages` blocks from `base` (nullptr: null parts, which the kernels'
  /// checks reject).
  ResidualView view(std::uint8_t* base, std::int32_t pages) const {
    ResidualView r{nullptr, nullptr, nullptr, nullptr, end, k_record, v_record, bits, k_bytes, v_bytes,
                   page_size, num_kv_heads, pages};
    if (base == nullptr) return r;
    r.k_codes = base + k_records;
    r.v_codes = base + v_records;
    r.k_scales = reinterpret_cast<float*>(base + k_records + k_scale);
    r.v_scales = reinterpret_cast<float*>(base + v_records + v_scale);
    return r;
  }
};
/// The residual block of rows that drop n_drop_k K and n_drop_v V dims at `bits` bits.
inline ResidualBlock residual_block(std::int64_t lead, std::int32_t bits, std::int32_t page_size,
                                    std::int32_t heads, std::int32_t n_drop_k, std::int32_t n_drop_v) {
  auto up4 = [](std::int64_t x) { return (x + 3) / 4 * 4; };
  const std::int64_t rows = static_cast<std::int64_t>(page_size) * heads;
  ResidualBlock r;
  r.bits = bits;
  r.k_bytes = residual_code_bytes(n_drop_k, bits);
  r.v_bytes = residual_code_bytes(n_drop_v, bits);
  r.page_size = page_size;
  r.num_kv_heads = heads;
  r.k_scale = up4(r.k_bytes);
  r.v_scale = up4(r.v_bytes);
  r.k_record = r.k_scale + 4;
  r.v_record = r.v_scale + 4;
  r.k_records = up4(lead);
  r.v_records = r.k_records + rows * r.k_record;
  r.end = r.v_records + rows * r.v_record;
  return r;
}

namespace detail {

KVKIT_HOST_DEVICE std::int32_t residual_qmax(std::int32_t bits) { return (1 << (bits - 1)) - 1; }

/// Code j of a row (sign-extended).
KVKIT_HOST_DEVICE std::int32_t residual_code(const std::uint8_t* codes, std::int32_t j, std::int32_t bits) {
  if (bits == 8) return static_cast<std::int8_t>(codes[j]);
  const std::int32_t nib = (codes[j >> 1] >> ((j & 1) * 4)) & 0xF;
  return nib >= 8 ? nib - 16 : nib;
}

/// The dims of [0, dim) not in the ascending set ch[0, r), ascending, into out[dim - r].
inline void dropped_channels(const std::int32_t* ch, std::int32_t r, std::int32_t dim, std::int32_t* out) {
  std::int32_t c = 0, n = 0;
  for (std::int32_t d = 0; d < dim; ++d) {
    if (c < r && ch[c] == d) {
      ++c;
      continue;
    }
    out[n++] = d;
  }
}

/// Quantizes x[drop[j]] (j < n) into codes[residual_code_bytes(n, bits)] and *scale.
template <class T>
void quantize_residual_row(const T* x, const std::int32_t* drop, std::int32_t n, std::int32_t bits,
                           std::uint8_t* codes, float* scale) {
  float amax = 0.f;
  for (std::int32_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(to_float(x[drop[j]])));
  const std::int32_t qmax = residual_qmax(bits);
  const float s = amax / static_cast<float>(qmax);
  *scale = s;
  std::fill(codes, codes + residual_code_bytes(n, bits), std::uint8_t{0});
  if (s == 0.f) return;
  for (std::int32_t j = 0; j < n; ++j) {
    const float c = std::nearbyint(to_float(x[drop[j]]) / s);  // round half to even (default mode)
    const std::int32_t q = static_cast<std::int32_t>(std::min<float>(std::max<float>(c, -qmax), qmax));
    if (bits == 8)
      codes[j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(q));
    else
      codes[j >> 1] = static_cast<std::uint8_t>(codes[j >> 1] | ((q & 0xF) << ((j & 1) * 4)));
  }
}

/// Checks shared by packing, unpacking and attention: bits, residual geometry against
/// the packed pool and the code widths against the channel counts.
inline Status check_residual(const ResidualView& res, std::int32_t heads, std::int32_t page_size,
                             std::int32_t pages_total, std::int32_t n_drop_k, std::int32_t n_drop_v,
                             const char* op) {
  KVKIT_CHECK_STATUS(res.bits == 4 || res.bits == 8, StatusCode::kInvalidArgument, op,
                     ": residual bits must be 4 or 8, got ", res.bits);
  KVKIT_CHECK_STATUS(res.num_kv_heads == heads && res.page_size == page_size &&
                         res.num_pages_total >= pages_total,
                     StatusCode::kInvalidArgument, op, ": residual geometry (heads ", res.num_kv_heads,
                     ", page_size ", res.page_size, ", pages ", res.num_pages_total,
                     ") does not match the packed pool (", heads, ", ", page_size, ", ", pages_total, ")");
  KVKIT_CHECK_STATUS(res.k_bytes == residual_code_bytes(n_drop_k, res.bits) &&
                         res.v_bytes == residual_code_bytes(n_drop_v, res.bits),
                     StatusCode::kInvalidArgument, op, ": residual code bytes (", res.k_bytes, ", ", res.v_bytes,
                     ") do not fit ", n_drop_k, " and ", n_drop_v, " dropped dims at ", res.bits, " bits");
  // Rows need their codes and a scale (4-byte aligned); a page holds its rows.
  const std::int64_t rows = static_cast<std::int64_t>(res.page_size) * res.num_kv_heads;
  KVKIT_CHECK_STATUS(res.k_row_stride % 4 == 0 && res.k_row_stride >= std::max(4, res.k_bytes) &&
                         res.v_row_stride % 4 == 0 && res.v_row_stride >= std::max(4, res.v_bytes),
                     StatusCode::kInvalidArgument, op, ": residual row strides (", res.k_row_stride, ", ",
                     res.v_row_stride, ") bytes: need multiples of 4 that hold a row's codes (", res.k_bytes, ", ",
                     res.v_bytes, ")");
  KVKIT_CHECK_STATUS(res.page_stride % 4 == 0 && res.page_stride >= rows * std::max(res.k_row_stride, res.v_row_stride),
                     StatusCode::kInvalidArgument, op, ": residual page stride ", res.page_stride,
                     " bytes: needs a multiple of 4, at least ", rows * std::max(res.k_row_stride, res.v_row_stride));
  KVKIT_CHECK_STATUS(res.k_scales != nullptr && res.v_scales != nullptr && (res.k_bytes == 0 || res.k_codes != nullptr) &&
                         (res.v_bytes == 0 || res.v_codes != nullptr),
                     StatusCode::kInvalidArgument, op, ": residual arrays are null");
  return Status::ok();
}

/// The host checks pack and unpack share (both backends): `full`'s memory space and
/// geometry, head dims the kernels take, packed widths, residual geometry and counts.
template <class T, class Exec>
Status check_residual_pages_args(const Exec& ex, const PagedKVView<T>& full, const ResidualView& res,
                                 std::int32_t rk, std::int32_t rv, std::int32_t n_pages, std::int32_t n_tokens,
                                 const char* op) {
  KVKIT_RETURN_IF_ERROR(kvkit::detail::check_view(full, ex));
  const std::int32_t D = full.head_dim, Dv = full.v_head_dim, P = full.page_size;
  KVKIT_CHECK_STATUS(D <= kMaxResidualDim && Dv <= kMaxResidualDim, StatusCode::kUnsupported, op,
                     ": unsupported head_dim ", D > Dv ? D : Dv, " (at most ", kMaxResidualDim, ")");
  KVKIT_CHECK_STATUS(rk >= 1 && rk <= D && rv >= 1 && rv <= Dv, StatusCode::kInvalidArgument, op,
                     ": packed widths (", rk, ", ", rv, ") outside [1, (", D, ", ", Dv, ")]");
  KVKIT_RETURN_IF_ERROR(check_residual(res, full.num_kv_heads, P, 0, D - rk, Dv - rv, op));
  KVKIT_CHECK_STATUS(n_pages >= 0 && (static_cast<std::int64_t>(n_tokens) + P - 1) / P == n_pages,
                     StatusCode::kInvalidArgument, op, ": ", n_tokens, " tokens do not fill ", n_pages, " pages of ",
                     P);
  return Status::ok();
}

/// The host checks residual_channel_attention runs on both backends: the view, the head
/// grouping, sm_scale, q_dim against the packed widths and kMaxResidualDim, the channel
/// sets a packed width needs, no unsupported variant, non-null outputs, and the residual's
/// geometry against `old`.
template <class T, class Exec>
Status check_residual_attention_args(const Exec& ex, const PagedKVView<T>& old, const ResidualView& res,
                                     const T* q, const T* out, const float* lse, const DecodeAttentionParams& p,
                                     const char* op) {
  KVKIT_RETURN_IF_ERROR(kvkit::detail::check_view(old, ex));
  const std::int32_t H = old.num_kv_heads, Dq = p.q_dim, rk = old.head_dim, rv = old.v_head_dim;
  KVKIT_CHECK_STATUS(p.num_qo_heads >= H && H > 0 && p.num_qo_heads % H == 0, StatusCode::kInvalidArgument, op,
                     ": num_qo_heads ", p.num_qo_heads, " is not a multiple of ", H);
  KVKIT_CHECK_STATUS(std::isfinite(p.sm_scale) && p.sm_scale > 0.f, StatusCode::kInvalidArgument, op,
                     ": sm_scale must be finite and > 0, got ", p.sm_scale);
  KVKIT_CHECK_STATUS(Dq >= rk && Dq >= rv && Dq >= 1, StatusCode::kInvalidArgument, op, ": q_dim ", Dq,
                     " below the packed widths (", rk, ", ", rv, ")");
  KVKIT_CHECK_STATUS(Dq <= kMaxResidualDim, StatusCode::kUnsupported, op, ": unsupported head_dim ", Dq,
                     " (at most ", kMaxResidualDim, ")");
  KVKIT_CHECK_STATUS((p.k_channels != nullptr || rk == Dq) && (p.v_channels != nullptr || rv == Dq),
                     StatusCode::kInvalidArgument, op, ": a packed width below q_dim needs its channel set");
  KVKIT_CHECK_STATUS(p.page_subset == nullptr && p.page_subset_indptr == nullptr && p.scores == nullptr,
                     StatusCode::kInvalidArgument, op, ": page subsets and scores out are not supported");
  KVKIT_CHECK_STATUS(q != nullptr && out != nullptr && lse != nullptr, StatusCode::kInvalidArgument, op,
                     ": q, out or lse is null");
  return check_residual(res, H, old.page_size, old.num_pages_total, Dq - rk, Dq - rv, op);
}

}  // namespace detail

/// Writes the dropped dims of residual row `row` (K, or V when `values`) into x [dim] as
/// they read back, s * code rounded to Out; the selected dims set[0, r) (ascending) are not
/// touched. For a host-side reader of single rows (the engine host's read_token).
template <class Out>
void read_residual(const ResidualView& res, std::int32_t page, std::int32_t slot, std::int32_t head, bool values,
                   const std::int32_t* set, std::int32_t r, std::int32_t dim, Out* x) {
  std::int32_t drop[kMaxResidualDim];
  detail::dropped_channels(set, r, dim, drop);
  const std::uint8_t* codes = values ? res.v_row(page, slot, head) : res.k_row(page, slot, head);
  const float sc = *(values ? res.v_scale(page, slot, head) : res.k_scale(page, slot, head));
  for (std::int32_t j = 0; j < dim - r; ++j)
    x[drop[j]] = from_float<Out>(sc * static_cast<float>(detail::residual_code(codes, j, res.bits)));
}

/// Writes the residual of n_tokens tokens of full-width pages src_pages[i] of `full` into
/// rows of page dst_pages[i] of `res` (the pages pack_channel_pages fills with the same
/// pairs and sets; see the file comment). rk / rv are the packed widths (rk == full dim:
/// no K residual). Returns kInvalidArgument (nothing written) on bad arguments.
template <class T>
Status pack_residual_pages(exec::Host ex, PagedKVView<T> full, ResidualView res,
                           const std::int32_t* k_channels,  // [Hkv, rk] ascending
                           const std::int32_t* v_channels,  // [Hkv, rv] ascending
                           std::int32_t rk, std::int32_t rv,
                           const std::int32_t* src_pages,   // [n_pages] pages of `full`
                           const std::int32_t* dst_pages,   // [n_pages] residual pages, distinct
                           std::int32_t n_pages, std::int32_t n_tokens) {
  KVKIT_RETURN_IF_ERROR(
      detail::check_residual_pages_args(ex, full, res, rk, rv, n_pages, n_tokens, "pack_residual_pages"));
  const std::int32_t H = full.num_kv_heads, D = full.head_dim, Dv = full.v_head_dim, P = full.page_size;
  if (n_pages == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::check_pack_tables(k_channels, v_channels, H, rk, rv, D, Dv, src_pages, dst_pages,
                                                  n_pages, full.num_pages_total, res.num_pages_total));
  detail::for_each_page_token(ex, src_pages, dst_pages, n_pages, n_tokens, P,
                              [&](std::int32_t src, std::int32_t dst, std::int32_t s) {
    std::int32_t kd[kMaxResidualDim], vd[kMaxResidualDim];
    for (std::int32_t h = 0; h < H; ++h) {
      detail::dropped_channels(k_channels + static_cast<std::int64_t>(h) * rk, rk, D, kd);
      detail::dropped_channels(v_channels + static_cast<std::int64_t>(h) * rv, rv, Dv, vd);
      detail::quantize_residual_row(full.k_data + full.k_offset(src, s, h), kd, D - rk, res.bits,
                                    res.k_row(dst, s, h), res.k_scale(dst, s, h));
      detail::quantize_residual_row(full.v_data + full.v_offset(src, s, h), vd, Dv - rv, res.bits,
                                    res.v_row(dst, s, h), res.v_scale(dst, s, h));
    }
  });
  return Status::ok();
}

/// Writes s * c_j (rounded to T) to the dropped dims of n_tokens tokens of full-width
/// pages dst_pages[i] of `full` from the residual rows of pages src_pages[i]; the selected
/// dims are not touched (unpack_channel_pages writes them). Same errors as packing.
template <class T>
Status unpack_residual_pages(exec::Host ex, ResidualView res, PagedKVView<T> full,
                             const std::int32_t* k_channels,  // [Hkv, rk] ascending
                             const std::int32_t* v_channels,  // [Hkv, rv] ascending
                             std::int32_t rk, std::int32_t rv,
                             const std::int32_t* src_pages,   // [n_pages] residual pages
                             const std::int32_t* dst_pages,   // [n_pages] pages of `full`, distinct
                             std::int32_t n_pages, std::int32_t n_tokens) {
  KVKIT_RETURN_IF_ERROR(
      detail::check_residual_pages_args(ex, full, res, rk, rv, n_pages, n_tokens, "unpack_residual_pages"));
  const std::int32_t H = full.num_kv_heads, D = full.head_dim, Dv = full.v_head_dim, P = full.page_size;
  if (n_pages == 0) return Status::ok();
  KVKIT_RETURN_IF_ERROR(detail::check_pack_tables(k_channels, v_channels, H, rk, rv, D, Dv, src_pages, dst_pages,
                                                  n_pages, res.num_pages_total, full.num_pages_total));
  detail::for_each_page_token(ex, src_pages, dst_pages, n_pages, n_tokens, P,
                              [&](std::int32_t src, std::int32_t dst, std::int32_t s) {
    for (std::int32_t h = 0; h < H; ++h) {
      read_residual(res, src, s, h, /*values=*/false, k_channels + static_cast<std::int64_t>(h) * rk, rk, D,
                    full.k_data + full.k_offset(dst, s, h));
      read_residual(res, src, s, h, /*values=*/true, v_channels + static_cast<std::int64_t>(h) * rv, rv, Dv,
                    full.v_data + full.v_offset(dst, s, h));
    }
  });
  return Status::ok();
}

namespace detail {
// The attention kernel's pieces use kernels/cpu/simd.hpp's vectors, so they live in the
// instruction set's inline namespace like the dense kernel (attention.hpp explains why).
inline namespace KVKIT_SIMD_NS {
using kvkit::detail::cpu::Vec;

/// Tokens per score / softmax / V tile of residual_channel_attention (a multiple of every
/// Vec width).
inline constexpr std::int32_t kResidualTile = 32;
/// Tokens per step of the score and V loops (as the dense kernel's kTokensPerStep).
inline constexpr int kResidualStep = kvkit::detail::cpu::kTokensPerStep;

/// One tile's K (or V) rows: the packed part of token j (its r selected dims, type T),
/// its code row and its scale. Row j reads back as x[j] on the selected dims and s[j] *
/// codes on the dropped ones.
template <class T>
struct ResidualRows {
  const T* x[kResidualTile];             // [kResidualTile] rows of r elements
  const std::uint8_t* c[kResidualTile];  // [kResidualTile] rows of codes
  const float* s[kResidualTile];         // [kResidualTile] scales
};

/// Byte spans of the next tile (its rows, codes and scales) prefetched into L2 while this
/// tile is processed, a few lines per step, as the dense kernel spreads its prefetches
/// (attention.hpp): a sequence's next page may lie anywhere, where the hardware
/// prefetchers do not follow, and a burst of prefetches at the tile's start would queue
/// behind each other instead of overlapping the arithmetic. Prefetching is a hint: spans
/// past kMaxSpans are left to the hardware.
struct SpanPrefetch {
  static constexpr int kMaxSpans = 64;
  const char* begin[kMaxSpans];
  const char* end[kMaxSpans];
  int n = 0, cur = 0;
  const char* at = nullptr;  // next line of span cur
  /// Adds [p, p + bytes), merged into the last span when they overlap or touch.
  void add(const void* p, std::int64_t bytes) {
    const char* b = static_cast<const char*>(p);
    const char* e = b + bytes;
    if (n > 0 && b >= begin[n - 1] && b <= end[n - 1]) {
      end[n - 1] = std::max(end[n - 1], e);
      return;
    }
    if (n == kMaxSpans) return;
    begin[n] = b;
    end[n] = e;
    if (n++ == 0) at = b;
  }
  std::int64_t lines() const {
    std::int64_t l = 0;
    for (int i = 0; i < n; ++i) l += (end[i] - begin[i] + 63) / 64;
    return l;
  }
  /// Prefetches up to `count` more lines.
  void issue(std::int64_t count) {
    for (; count > 0 && cur < n; --count) {
      kvkit::detail::prefetch_line_l2(at);  // L2, as the dense kernel
      if (end[cur] - at > 64)
        at += 64;
      else if (++cur < n)
        at = begin[cur];
    }
  }
  void reset() { n = cur = 0; }
};

/// Vectors one coded chunk of a row decodes into: 4 bits two (its even and its odd codes,
/// load_nibble_pairs), 8 bits one.
template <int kBits>
inline constexpr int kCodeVecs = kBits == 4 ? 2 : 1;

/// x rounded up to a multiple of Vec::kLanes.
inline std::int32_t lanes_up(std::int32_t x) { return (x + Vec::kLanes - 1) / Vec::kLanes * Vec::kLanes; }

/// n codes rounded up to whole coded chunks (kCodeVecs vectors each).
template <int kBits>
inline std::int32_t codes_up(std::int32_t n) {
  constexpr std::int32_t step = kCodeVecs<kBits> * Vec::kLanes;
  return (n + step - 1) / step * step;
}

/// Position of code j in the kernel's block of coded dims: 8 bits, j; 4 bits, within each
/// chunk of 2 kLanes codes the even codes come first, then the odd ones, the order
/// load_nibble_pairs decodes them in (q and the accumulators are kept in this order).
template <int kBits>
inline std::int32_t code_pos(std::int32_t j) {
  if constexpr (kBits == 8) {
    return j;
  } else {
    constexpr std::int32_t W = Vec::kLanes;
    const std::int32_t c = j / (2 * W) * (2 * W), w = j - c;
    return c + (w & 1) * W + w / 2;
  }
}

/// Calls f(d, rest) for the chunks of a span of len elements: whole ones of kStep, then
/// the tail (0 < rest < kStep); rest is the constant kStep in the first loop, so a
/// callee's "whole chunk" branch folds away once inlined.
template <int kStep, class F>
KVKIT_SIMD_INLINE void for_each_span(std::int32_t len, F&& f) {
  std::int32_t d = 0;
  for (; d + kStep <= len; d += kStep) f(d, kStep);
  if (d < len) f(d, static_cast<int>(len - d));
}

/// Lanes d .. d + rest - 1 of token j's exact part (rest <= Vec::kLanes; pads read 0).
template <class T>
KVKIT_SIMD_INLINE Vec exact_chunk(const ResidualRows<T>& rows, std::int32_t j, std::int32_t d, int rest) {
  return rest == Vec::kLanes ? Vec::load(rows.x[j] + d) : kvkit::detail::cpu::load_partial(rows.x[j] + d, rest);
}

/// Token j's codes d .. d + rest - 1, unscaled, as kCodeVecs<kBits> vectors in code_pos
/// order (lanes past rest read 0; rest <= kCodeVecs<kBits> * Vec::kLanes).
template <int kBits, class T>
KVKIT_SIMD_INLINE void code_chunk(const ResidualRows<T>& rows, std::int32_t j, std::int32_t d, int rest,
                                  Vec* c) {  // [kCodeVecs<kBits>]
  if constexpr (kBits == 4) {
    kvkit::detail::cpu::load_nibble_pairs(rows.c[j], d, rest, c, c + 1);
  } else {
    c[0] = rest == Vec::kLanes ? kvkit::detail::cpu::load_codes<8>(rows.c[j], d)
                               : kvkit::detail::cpu::load_codes_partial<8>(rows.c[j], d, rest);
  }
}

/// sc[g * kResidualTile + j0 + t] = q_g · (row j0 + t as it reads back) for NG queries
/// (padded rows of q, stride dq, zero in the pads) and NT tokens. The coded dims go first
/// and unscaled, q_R · c_t, then times s_t: one multiply per (query, token) instead of one
/// per chunk and token; then the exact dims. Each chunk of a row is loaded and decoded
/// once for all NG queries.
template <int kBits, int NG, int NT, class T>
inline void residual_score_block(const float* q,  // [NG, dq]
                                 std::int32_t dq, const ResidualRows<T>& rows, std::int32_t j0, std::int32_t r,
                                 std::int32_t n, float* sc) {  // [NG, kResidualTile]
  constexpr int W = Vec::kLanes, C = kCodeVecs<kBits>;
  Vec acc[NG][NT];
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < NT; ++t) acc[g][t] = Vec::zero();
  const std::int32_t base = lanes_up(r);
  for_each_span<C * W>(n, [&](std::int32_t d, int rest) {
    Vec kv[NT][C];
    for (int t = 0; t < NT; ++t) code_chunk<kBits>(rows, j0 + t, d, rest, kv[t]);
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < C; ++c) {
        const Vec qv = Vec::load(q + static_cast<std::size_t>(g) * dq + base + d + c * W);  // pads are 0
        for (int t = 0; t < NT; ++t) acc[g][t] = Vec::fma(qv, kv[t][c], acc[g][t]);
      }
  });
  if (n > 0)
    for (int t = 0; t < NT; ++t) {
      const Vec s = Vec::set1(*rows.s[j0 + t]);
      for (int g = 0; g < NG; ++g) acc[g][t] = acc[g][t] * s;
    }
  for_each_span<W>(r, [&](std::int32_t d, int rest) {
    Vec kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = exact_chunk(rows, j0 + t, d, rest);
    for (int g = 0; g < NG; ++g) {
      const Vec qv = Vec::load(q + static_cast<std::size_t>(g) * dq + d);  // pads are 0
      for (int t = 0; t < NT; ++t) acc[g][t] = Vec::fma(qv, kv[t], acc[g][t]);
    }
  });
  for (int g = 0; g < NG; ++g) {
    int t = 0;
    for (; t + 4 <= NT; t += 4) Vec::hsum4(&acc[g][t], sc + g * kResidualTile + j0 + t);
    for (; t < NT; ++t) sc[g * kResidualTile + j0 + t] = acc[g][t].hsum();
  }
}

/// acc_g += sum_t p[g, j0 + t] * (V row j0 + t as it reads back) for NG accumulator rows
/// (padded, stride dq; the pads stay 0) and NT tokens: the coded dims with the weights
/// p * s_t times the unscaled codes, then the exact dims with p.
template <int kBits, int NG, int NT, class T>
inline void residual_accum_block(float* acc,  // [NG, dq]
                                 std::int32_t dq,
                                 const float* pr,  // [NG, kResidualTile] probabilities
                                 const ResidualRows<T>& rows, std::int32_t j0, std::int32_t r, std::int32_t n) {
  constexpr int W = Vec::kLanes, C = kCodeVecs<kBits>;
  Vec w[NG][NT];
  const std::int32_t base = lanes_up(r);
  if (n > 0) {
    for (int g = 0; g < NG; ++g)
      for (int t = 0; t < NT; ++t) w[g][t] = Vec::set1(pr[g * kResidualTile + j0 + t] * *rows.s[j0 + t]);
    for_each_span<C * W>(n, [&](std::int32_t d, int rest) {
      Vec vv[NT][C];
      for (int t = 0; t < NT; ++t) code_chunk<kBits>(rows, j0 + t, d, rest, vv[t]);
      for (int g = 0; g < NG; ++g)
        for (int c = 0; c < C; ++c) {
          float* a = acc + static_cast<std::size_t>(g) * dq + base + d + c * W;
          Vec x = Vec::load(a);
          for (int t = 0; t < NT; ++t) x = Vec::fma(w[g][t], vv[t][c], x);
          x.store(a);
        }
    });
  }
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < NT; ++t) w[g][t] = Vec::set1(pr[g * kResidualTile + j0 + t]);
  for_each_span<W>(r, [&](std::int32_t d, int rest) {
    Vec vv[NT];
    for (int t = 0; t < NT; ++t) vv[t] = exact_chunk(rows, j0 + t, d, rest);
    for (int g = 0; g < NG; ++g) {
      float* a = acc + static_cast<std::size_t>(g) * dq + d;
      Vec x = Vec::load(a);
      for (int t = 0; t < NT; ++t) x = Vec::fma(w[g][t], vv[t], x);
      x.store(a);
    }
  });
}

/// Heads [h0, h0 + nh) of sequence b of residual_channel_attention (nh * G <=
/// kMaxResidualGroup): tiles of kResidualTile tokens; per tile and head, scores for the
/// head's queries in blocks of up to 4 (one decode of a row serves them all), an
/// online-softmax step, then the probability-weighted V rows. The heads of a token are
/// adjacent in the pool and in the residual, so walking them tile by tile uses every cache
/// line a tile brings in; one head at a time, a (sequence, head) item read a third of each
/// line (3 kv heads) and left the rest to be fetched again. Each head's arithmetic is the
/// same whatever nh is, so the result does not depend on the grouping.
template <int kBits, class T>
void residual_attention_item(const PagedKVView<T>& old, const ResidualView& res, const T* q, T* out, float* lse,
                             const DecodeAttentionParams& p, std::int32_t b, std::int32_t h0, std::int32_t nh) {
  const std::int32_t Dq = p.q_dim, rk = old.head_dim, rv = old.v_head_dim, G = p.num_qo_heads / old.num_kv_heads;
  const std::int32_t nk = Dq - rk, nv = Dq - rv;
  // Scratch (about 43 KiB at kMaxResidualGroup x kMaxResidualDim): dims are kept permuted,
  // selected first (ascending) then dropped (code j at code_pos(j)), for q, the
  // accumulators and the rows; q and accumulator rows are padded so that the dropped dims
  // start on a vector boundary ([0, r) selected, [lanes_up(r), lanes_up(r) + codes_up(n))
  // dropped, zeros between and after): every access to them is a whole aligned vector,
  // and the zero pads meet the zero lanes of a partial row chunk. Query row i is head
  // h0 + i / G's query i % G.
  constexpr std::int32_t kRow = kMaxResidualDim + 3 * Vec::kLanes;
  const std::int32_t qw = lanes_up(rk) + codes_up<kBits>(nk), aw = lanes_up(rv) + codes_up<kBits>(nv);  // padded
  std::int32_t ord[kMaxResidualDim];  // permuted position -> dim, for one head's K or V
  alignas(64) float qs[kMaxResidualGroup * kRow];   // [nh * G, qw] sm_scale * q, K order
  alignas(64) float acc[kMaxResidualGroup * kRow];  // [nh * G, aw] unnormalised output, V order
  alignas(64) float sc[kMaxResidualGroup * kResidualTile];  // [nh * G, kResidualTile] scores, then weights
  float m[kMaxResidualGroup], l[kMaxResidualGroup];
  // The permuted order of head h's K (values false) or V dims into ord.
  auto order = [&](std::int32_t h, bool values) {
    const std::int32_t r = values ? rv : rk;
    const std::int32_t* set = values ? p.v_channels : p.k_channels;
    for (std::int32_t c = 0; c < r; ++c) ord[c] = set != nullptr ? set[static_cast<std::int64_t>(h) * r + c] : c;
    dropped_channels(ord, r, Dq, ord + r);
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  for (std::int32_t hi = 0; hi < nh; ++hi) {
    order(h0 + hi, false);
    for (std::int32_t g = 0; g < G; ++g) {
      const std::int32_t i = hi * G + g;
      const T* qr = q + (static_cast<std::int64_t>(b) * p.num_qo_heads + (h0 + hi) * G + g) * Dq;
      float* qg = qs + i * qw;
      std::fill(qg, qg + qw, 0.f);
      for (std::int32_t c = 0; c < rk; ++c) qg[c] = p.sm_scale * to_float(qr[ord[c]]);
      for (std::int32_t j = 0; j < nk; ++j) qg[lanes_up(rk) + code_pos<kBits>(j)] = p.sm_scale * to_float(qr[ord[rk + j]]);
      std::fill(acc + i * aw, acc + (i + 1) * aw, 0.f);
      m[i] = ninf;
      l[i] = 0.f;
    }
  }
  // Query blocks of 4, then one block of the remaining 1-3.
  auto by_groups = [&](auto&& f) {
    std::int32_t g = 0;
    for (; g + 4 <= G; g += 4) f(std::integral_constant<int, 4>{}, g);
    if (G - g == 3) f(std::integral_constant<int, 3>{}, g);
    if (G - g == 2) f(std::integral_constant<int, 2>{}, g);
    if (G - g == 1) f(std::integral_constant<int, 1>{}, g);
  };
  constexpr int NT = kResidualStep;
  const std::int32_t n = old.seq_len(b);
  // Row addresses of a tile: a page walk (no division per token); within a page every
  // part advances by a constant stride per slot. The next tile is prefetched a few lines
  // per step (SpanPrefetch): with a sequence's pages scattered over the pool, as a
  // long-running pool leaves them, that took the kernel from 1.0-1.2x dense to 0.78-0.90x
  // on the AVX2 EPYC; a burst at the tile's start, tried before, gained nothing
  // (bench/RESULTS.md, 2026-11-29 "night" and "late night").
  const std::int64_t kst = old.k_stride_token, vst = old.v_stride_token;  // per slot, elements
  const std::int64_t krs = res.num_kv_heads * res.k_row_stride, vrs = res.num_kv_heads * res.v_row_stride;  // bytes
  ResidualRows<T> kr, vr;
  SpanPrefetch pf;
  // The next tile's spans for heads [h0, h0 + nh): per page run, its K and V rows, codes
  // and scales from the first (slot, head) to the last.
  auto span = [&](const void* first, const void* last, std::int64_t last_bytes) {
    const char* f = static_cast<const char*>(first);
    pf.add(f, static_cast<const char*>(last) - f + last_bytes);
  };
  auto plan_prefetch = [&](std::int32_t t1) {
    pf.reset();
    const std::int32_t e1 = std::min(n, t1 + kResidualTile), hl = h0 + nh - 1;
    for (std::int32_t t = t1; t < e1;) {
      const std::int32_t page = old.page_id(b, t / old.page_size), s0 = t % old.page_size;
      const std::int32_t s1 = std::min(old.page_size, s0 + (e1 - t)) - 1;  // last slot
      span(old.k_data + old.k_offset(page, s0, h0), old.k_data + old.k_offset(page, s1, hl), rk * sizeof(T));
      span(old.v_data + old.v_offset(page, s0, h0), old.v_data + old.v_offset(page, s1, hl), rv * sizeof(T));
      span(res.k_row(page, s0, h0), res.k_row(page, s1, hl), res.k_bytes);
      span(res.k_scale(page, s0, h0), res.k_scale(page, s1, hl), 4);
      span(res.v_row(page, s0, h0), res.v_row(page, s1, hl), res.v_bytes);
      span(res.v_scale(page, s0, h0), res.v_scale(page, s1, hl), 4);
      t += s1 - s0 + 1;
    }
  };
  for (std::int32_t t0 = 0; t0 < n; t0 += kResidualTile) {
    const std::int32_t nt = std::min(kResidualTile, n - t0);
    std::int64_t per_step = 0;  // lines per score or V step: the next tile spread over this one (last tile: none)
    if (t0 + kResidualTile < n) {
      plan_prefetch(t0 + kResidualTile);
      const std::int64_t steps = static_cast<std::int64_t>(nh) * 2 * ((nt + NT - 1) / NT);
      per_step = (pf.lines() + steps - 1) / steps;
    }
    for (std::int32_t hi = 0; hi < nh; ++hi) {
      const std::int32_t h = h0 + hi;
      std::int32_t pi = t0 / old.page_size, slot = t0 % old.page_size;
      for (std::int32_t j = 0; j < nt;) {
        const std::int32_t page = old.page_id(b, pi), run = std::min(nt - j, old.page_size - slot);
        const T* kx = old.k_data + old.k_offset(page, slot, h);
        const T* vx = old.v_data + old.v_offset(page, slot, h);
        const std::uint8_t* kc = res.k_row(page, slot, h);
        const std::uint8_t* vc = res.v_row(page, slot, h);
        const std::uint8_t* ks = reinterpret_cast<const std::uint8_t*>(res.k_scale(page, slot, h));
        const std::uint8_t* vs = reinterpret_cast<const std::uint8_t*>(res.v_scale(page, slot, h));
        for (std::int32_t i = 0; i < run; ++i, ++j) {
          kr.x[j] = kx + i * kst;
          kr.c[j] = kc + i * krs;
          kr.s[j] = reinterpret_cast<const float*>(ks + i * krs);
          vr.x[j] = vx + i * vst;
          vr.c[j] = vc + i * vrs;
          vr.s[j] = reinterpret_cast<const float*>(vs + i * vrs);
        }
        ++pi;
        slot = 0;
      }
      const std::int32_t i0 = hi * G;  // the head's first query row
      by_groups([&](auto ng, std::int32_t g0) {
        constexpr int NG = decltype(ng)::value;
        const std::int32_t i = i0 + g0;
        std::int32_t j = 0;
        for (; j + NT <= nt; j += NT) {
          pf.issue(per_step);
          residual_score_block<kBits, NG, NT>(qs + i * qw, qw, kr, j, rk, nk, sc + i * kResidualTile);
        }
        for (; j < nt; ++j) residual_score_block<kBits, NG, 1>(qs + i * qw, qw, kr, j, rk, nk, sc + i * kResidualTile);
      });
      for (std::int32_t i = i0; i < i0 + G; ++i)
        kvkit::detail::cpu::softmax_tile(sc + i * kResidualTile, nt, m[i], l[i], acc + i * aw, aw);
      by_groups([&](auto ng, std::int32_t g0) {
        constexpr int NG = decltype(ng)::value;
        const std::int32_t i = i0 + g0;
        std::int32_t j = 0;
        for (; j + NT <= nt; j += NT) {
          pf.issue(per_step);
          residual_accum_block<kBits, NG, NT>(acc + i * aw, aw, sc + i * kResidualTile, vr, j, rv, nv);
        }
        for (; j < nt; ++j) residual_accum_block<kBits, NG, 1>(acc + i * aw, aw, sc + i * kResidualTile, vr, j, rv, nv);
      });
    }
  }
  for (std::int32_t hi = 0; hi < nh; ++hi) {
    order(h0 + hi, true);
    for (std::int32_t g = 0; g < G; ++g) {
      const std::int32_t i = hi * G + g;
      const std::int64_t r = static_cast<std::int64_t>(b) * p.num_qo_heads + (h0 + hi) * G + g;
      T* o = out + r * Dq;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      const float* a = acc + i * aw;
      for (std::int32_t c = 0; c < rv; ++c) o[ord[c]] = from_float<T>(a[c] * inv);
      for (std::int32_t j = 0; j < nv; ++j) o[ord[rv + j]] = from_float<T>(a[lanes_up(rv) + code_pos<kBits>(j)] * inv);
      lse[r] = l[i] > 0.f ? m[i] + std::log(l[i]) : ninf;
    }
  }
}

}  // namespace KVKIT_SIMD_NS
}  // namespace detail

inline namespace KVKIT_SIMD_NS {

/// Decode attention over the packed pages of `old` (K rows of old.head_dim = rK dims
/// p.k_channels[h], V rows of old.v_head_dim = rV dims p.v_channels[h], a nullptr set
/// meaning the rows are full width) plus their residual `res` (same page ids): see the
/// file comment. q and out are [batch, Hq, p.q_dim]; lse [batch, Hq] (natural log, -inf
/// for a sequence with no tokens, whose out rows are 0). Page subsets and scores out are
/// not supported here (kInvalidArgument). Threads split the sequences' kv heads into
/// items of adjacent heads; each head's arithmetic is sequential and the same in any item,
/// so the result does not depend on the thread count. Never allocates beyond the threads
/// of a call without an executor. Vector code from kernels/cpu/simd.hpp: a row's codes are
/// decoded once per chunk for all the group's queries, never written back to memory, and
/// its scale is applied once per (query, token).
template <class T>
Status residual_channel_attention(exec::Host ex, const PagedKVView<T>& old, ResidualView res,
                                  const T* q,     // [batch, Hq, q_dim]
                                  T* out,         // [batch, Hq, q_dim]
                                  float* lse,     // [batch, Hq]
                                  const DecodeAttentionParams& p) {
  KVKIT_RETURN_IF_ERROR(
      detail::check_residual_attention_args(ex, old, res, q, out, lse, p, "residual_channel_attention"));
  const std::int32_t H = old.num_kv_heads, B = old.batch_size, Dq = p.q_dim;
  const std::int32_t rk = old.head_dim, rv = old.v_head_dim, G = p.num_qo_heads / H;
  KVKIT_CHECK_STATUS(G <= kMaxResidualGroup, StatusCode::kUnsupported,
                     "residual_channel_attention: unsupported group ", G, " (at most ", kMaxResidualGroup, ")");
  KVKIT_RETURN_IF_ERROR(kvkit::detail::check_page_table(old));
  // The sets as pack_channel_pages checks them (ids in range, ascending).
  static const std::int32_t kNone = 0;
  KVKIT_RETURN_IF_ERROR(detail::check_pack_tables(p.k_channels != nullptr ? p.k_channels : &kNone,
                                                  p.v_channels != nullptr ? p.v_channels : &kNone, H,
                                                  p.k_channels != nullptr ? rk : 0, p.v_channels != nullptr ? rv : 0,
                                                  Dq, Dq, &kNone, &kNone, 0, 1, 1));
  // Items of hpi adjacent kv heads of one sequence (as many as the stack scratch holds,
  // fewer when the threads need more items): see residual_attention_item.
  const std::int32_t hpi = kvkit::detail::heads_per_item(ex, B, H, std::max<std::int32_t>(1, kMaxResidualGroup / G));
  const std::int32_t groups = H / hpi;
  kvkit::detail::parallel_for(ex, static_cast<std::int64_t>(B) * groups, [&](std::int64_t ib, std::int64_t ie, int) {
    for (std::int64_t i = ib; i < ie; ++i) {
      const std::int32_t b = static_cast<std::int32_t>(i / groups), h0 = static_cast<std::int32_t>(i % groups) * hpi;
      if (res.bits == 8)
        detail::residual_attention_item<8>(old, res, q, out, lse, p, b, h0, hpi);
      else
        detail::residual_attention_item<4>(old, res, q, out, lse, p, b, h0, hpi);
    }
  });
  return Status::ok();
}

}  // namespace KVKIT_SIMD_NS

}  // namespace channel
}  // namespace kvkit
