#pragma once
// Host stand-in for <cuda_fp16.h> (see cuda_runtime.h): __half as its bits, conversions
// through kvkit's scalar converters (round to nearest even, as the device's).
#include "kvkit/core/dtype.hpp"
struct __half {
  unsigned short x;
};
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { return kvkit::to_float(kvkit::half_t::from_bits(h.x)); }
inline __half __float2half_rn(float f) { return __half{kvkit::from_float<kvkit::half_t>(f).bits}; }
