#pragma once
// Host stand-in for <cuda_fp16.h> and <cuda_bf16.h> (see cuda_runtime.h): __half and
// __nv_bfloat16 as their bits, converted by kvkit's scalar converters (round to nearest
// even, as the device's __float2half_rn / __float2bfloat16_rn).
#include "kvkit/core/dtype.hpp"
struct __half {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short x;
};
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { return kvkit::to_float(kvkit::half_t::from_bits(h.x)); }
inline __half __float2half_rn(float f) { return {kvkit::from_float<kvkit::half_t>(f).bits}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return {b}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline float __bfloat162float(__nv_bfloat16 h) { return kvkit::to_float(kvkit::bfloat16_t::from_bits(h.x)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {kvkit::from_float<kvkit::bfloat16_t>(f).bits}; }
