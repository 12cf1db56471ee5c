#pragma once
// Host stand-in for <cuda_bf16.h> (see cuda_runtime.h).
#include "kvkit/core/dtype.hpp"
struct __nv_bfloat16 {
  unsigned short x;
};
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return __nv_bfloat16{b}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline float __bfloat162float(__nv_bfloat16 h) { return kvkit::to_float(kvkit::bfloat16_t::from_bits(h.x)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{kvkit::from_float<kvkit::bfloat16_t>(f).bits}; }
