#pragma once
// Compiler glue shared by host and device code.
//
// KVKIT_HOST_DEVICE marks functions that kernels and host code both call; it degrades
// to plain `inline` when the translation unit is not compiled by nvcc, so core headers
// stay ordinary C++17.

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVKIT_HOST_DEVICE __host__ __device__ __forceinline__
#define KVKIT_DEVICE __device__ __forceinline__
#define KVKIT_IS_DEVICE_COMPILER 1
#else
#define KVKIT_HOST_DEVICE inline
#define KVKIT_DEVICE inline
#define KVKIT_IS_DEVICE_COMPILER 0
#endif

#if defined(__CUDA_ARCH__)
#define KVKIT_IN_DEVICE_CODE 1
#else
#define KVKIT_IN_DEVICE_CODE 0
#endif

#define KVKIT_VERSION_MAJOR 0
#define KVKIT_VERSION_MINOR 1
#define KVKIT_VERSION_PATCH 0
