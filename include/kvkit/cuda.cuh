#pragma once
// Umbrella header for CUDA code: everything <kvkit/kvkit.hpp> offers plus the CUDA
// backend of the core KV operations (exec::Cuda overloads of write_kv,
// paged_decode_attention, merge_attention_states, gather_tokens, compact_tokens and
// copy_pages), kvchan's page pack / unpack (channel/pack_pages.hpp,
// kernels/cuda/kvchan_pack.cuh), the exec::Cuda select of the Compressor policies (compressor/r1kv.hpp,
// kernels/cuda/r1kv.cuh), the Sketcher's strict box pre-pass (sketch::EpsCudaConfig,
// kernels/cuda/eps.cuh) and DeviceStatus with reset_device_status / read_device_status /
// to_status.
// This is the only header that reaches kernels/cuda; compile it with nvcc and link
// CUDA::cudart (the kvkit::cuda CMake target does both).
//
// Host contract: an engine allocates one DeviceStatus per stream (cudaMalloc), zeroes it
// (reset_device_status), and passes exec::Cuda{stream, status} to every operation. Each
// operation checks its scalars on the host (a Status right away) and its device tables
// on the device, queued on the stream; nothing synchronises or allocates, so a whole step
// can be captured in a CUDA graph. After the step the engine synchronises and calls
// read_device_status: an error carries the StatusCode the CPU twin returns for the same
// input, the failing operation wrote nothing, and every later operation on that status
// did nothing (the status is sticky until reset).

#if !defined(__CUDACC__)
#error "<kvkit/cuda.cuh> must be compiled by a CUDA compiler (nvcc)"
#endif

#include "kvkit/kvkit.hpp"

#include "kvkit/kernels/cuda/common.cuh"
#include "kvkit/kernels/cuda/write_kv.cuh"
#include "kvkit/kernels/cuda/attention.cuh"
#include "kvkit/kernels/cuda/gather.cuh"
#include "kvkit/kernels/cuda/copy_pages.cuh"
#include "kvkit/kernels/cuda/kvchan_pack.cuh"
#include "kvkit/kernels/cuda/kvchan_residual.cuh"
#include "kvkit/kernels/cuda/r1kv.cuh"
#include "kvkit/kernels/cuda/eps.cuh"
