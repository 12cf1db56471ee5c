#pragma once
// Element types of KV memory: float, IEEE binary16 (`half_t`) and bfloat16 (`bfloat16_t`).
//
// The 16-bit types are plain 2-byte storage with round-to-nearest-even conversion
// written out bit by bit, so core/ depends on nothing (no Eigen, no CUDA headers) and
// the same bytes mean the same value on host and device. They are layout-compatible
// with Eigen::half / __half and Eigen::bfloat16 / __nv_bfloat16; CUDA kernels
// reinterpret device pointers to those types. Arithmetic always accumulates in float.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvkit/core/config.hpp"

namespace kvkit {

/// Runtime tag of an element type (stored in block headers, printed in errors).
enum class DType : std::uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

/// Lower-case name of a dtype ("float32", "float16", "bfloat16") for messages and headers.
inline const char* to_string(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

/// The dtype named by to_string's name ("float32", "float16", "bfloat16"): true and *out
/// set, or false (unknown name, *out unchanged).
inline bool dtype_from_string(const char* name, DType* out) {
  const DType all[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  for (DType d : all)
    if (name != nullptr && std::strcmp(name, to_string(d)) == 0) {
      *out = d;
      return true;
    }
  return false;
}

/// Bytes per element of a dtype.
inline int dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

namespace detail {

KVKIT_HOST_DEVICE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
KVKIT_HOST_DEVICE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary32 -> binary16, round to nearest even, overflow to inf, NaN kept quiet.
KVKIT_HOST_DEVICE std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // below half of min subnormal
    const std::uint32_t mant = (abs & 0x007fffffu) | 0x00800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    std::uint32_t h = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = ((abs - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

// Branch-free (integer masks, no selects GCC would turn into jumps), so loops of
// conversions vectorize with plain SSE2.
KVKIT_HOST_DEVICE float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  const std::uint32_t em = static_cast<std::uint32_t>(h) & 0x7fffu;  // exponent | mantissa
  const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(em < 0x0400u);    // all ones
  const std::uint32_t is_spec = 0u - static_cast<std::uint32_t>(em >= 0x7c00u);  // inf, nan
  // Rebias the exponent 15 -> 127 (inf/nan: 31 -> 255, mantissa kept).
  const std::uint32_t normal = (em << 13) + 0x38000000u + (is_spec & 0x38000000u);
  // Subnormal (and zero): 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact in float.
  const std::uint32_t sub =
      float_bits(bits_float(0x38800000u + (em << 13)) - bits_float(0x38800000u));
  return bits_float(sign | (normal & ~is_sub) | (sub & is_sub));
}

KVKIT_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

KVKIT_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// IEEE binary16 storage. Converts to/from float; no arithmetic operators on purpose.
struct half_t {
  std::uint16_t bits;
  half_t() = default;
  KVKIT_HOST_DEVICE explicit half_t(float f) : bits(detail::float_to_half_bits(f)) {}
  KVKIT_HOST_DEVICE explicit operator float() const { return detail::half_bits_to_float(bits); }
  KVKIT_HOST_DEVICE static half_t from_bits(std::uint16_t b) {
    half_t h;
    h.bits = b;
    return h;
  }
};

/// bfloat16 storage (the top 16 bits of a float32, rounded to nearest even).
struct bfloat16_t {
  std::uint16_t bits;
  bfloat16_t() = default;
  KVKIT_HOST_DEVICE explicit bfloat16_t(float f) : bits(detail::float_to_bf16_bits(f)) {}
  KVKIT_HOST_DEVICE explicit operator float() const { return detail::bf16_bits_to_float(bits); }
  KVKIT_HOST_DEVICE static bfloat16_t from_bits(std::uint16_t b) {
    bfloat16_t h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(half_t) == 2 && std::is_trivially_copyable<half_t>::value, "half_t layout");
static_assert(sizeof(bfloat16_t) == 2 && std::is_trivially_copyable<bfloat16_t>::value, "bf16 layout");

/// Element conversions used by every kernel: load to float, store from float.
KVKIT_HOST_DEVICE float to_float(float x) { return x; }
KVKIT_HOST_DEVICE float to_float(half_t x) { return static_cast<float>(x); }
KVKIT_HOST_DEVICE float to_float(bfloat16_t x) { return static_cast<float>(x); }

/// float -> T, rounding to nearest even for the 16-bit types.
template <class T>
KVKIT_HOST_DEVICE T from_float(float x) {
  return T(x);
}

/// Compile-time map from element type to its DType tag.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct dtype_of<half_t> {
  static constexpr DType value = DType::kFloat16;
};
template <>
struct dtype_of<bfloat16_t> {
  static constexpr DType value = DType::kBFloat16;
};
template <class T>
inline constexpr DType dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

/// Runtime DType to element type: calls f(T{}) with T = float, half_t or bfloat16_t for d
/// (float for any other value), so host code instantiates its typed path once per dtype
/// and runs the one a run-time option picked.
template <class F>
auto visit_dtype(DType d, F&& f) -> decltype(f(float{})) {
  switch (d) {
    case DType::kFloat16: return f(half_t{});
    case DType::kBFloat16: return f(bfloat16_t{});
    default: return f(float{});
  }
}

}  // namespace kvkit
