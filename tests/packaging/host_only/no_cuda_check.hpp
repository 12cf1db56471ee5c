#pragma once
// Fails the build when a host header pulled in any part of the CUDA toolkit. Each macro
// is defined by the header named next to it.
#if defined(__CUDACC__) || defined(__NVCC__)
#error "host-only check compiled by nvcc"
#endif
#if defined(CUDART_VERSION) || defined(__CUDA_RUNTIME_H__)  // cuda_runtime(_api).h
#error "a kvkit host header included the CUDA runtime"
#endif
#if defined(CUDA_VERSION)  // cuda.h
#error "a kvkit host header included the CUDA driver API"
#endif
#if defined(__CUDA_FP16_H__) || defined(__CUDA_BF16_H__)  // cuda_fp16.h, cuda_bf16.h
#error "a kvkit host header included cuda_fp16.h / cuda_bf16.h"
#endif
#if defined(__DRIVER_TYPES_H__) || defined(__HOST_DEFINES_H__)  // driver_types.h, host_defines.h
#error "a kvkit host header included CUDA's driver_types.h / host_defines.h"
#endif
#if defined(CUB_VERSION) || defined(THRUST_VERSION) || defined(CCCL_VERSION)  // CUB, Thrust, CCCL
#error "a kvkit host header included CUB / Thrust"
#endif
#if KVKIT_IS_DEVICE_COMPILER || KVKIT_IN_DEVICE_CODE
#error "kvkit's config.hpp believes this is device compilation"
#endif
