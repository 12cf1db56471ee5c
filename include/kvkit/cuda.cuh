#pragma once
// Umbrella header for CUDA code: everything <kvkit/kvkit.hpp> offers plus the CUDA
// backend of the core KV operations (exec::Cuda overloads of write_kv,
// paged_decode_attention, gather_tokens, compact_tokens and copy_pages). This is the
// only header that reaches kernels/cuda; compile it with nvcc and link CUDA::cudart
// (the kvkit::cuda CMake target does both).

#if !defined(__CUDACC__)
#error "<kvkit/cuda.cuh> must be compiled by a CUDA compiler (nvcc)"
#endif

#include "kvkit/kvkit.hpp"

#include "kvkit/kernels/cuda/common.cuh"
#include "kvkit/kernels/cuda/write_kv.cuh"
#include "kvkit/kernels/cuda/attention.cuh"
#include "kvkit/kernels/cuda/gather.cuh"
#include "kvkit/kernels/cuda/copy_pages.cuh"
