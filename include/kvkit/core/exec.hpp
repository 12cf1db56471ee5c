#pragma once
// Execution objects. Every operation has one public name; the first argument picks the
// backend by overload: `exec::Host{threads}` runs the CPU kernels in kernels/cpu,
// `exec::Cuda{stream}` the CUDA kernels (declared only by <kvkit/cuda.cuh>).

#include "kvkit/core/error.hpp"

namespace kvkit {

/// Where a view's memory lives; kernels refuse memory from the other side.
enum class MemorySpace : unsigned char { kHost = 0, kCuda = 1 };

/// "host" or "cuda", for messages.
inline const char* to_string(MemorySpace s) { return s == MemorySpace::kHost ? "host" : "cuda"; }

/// Device-side error word of the CUDA backend (defined in <kvkit/cuda.cuh>).
struct DeviceStatus;

namespace exec {

/// CPU execution. `threads` <= 1 runs on the calling thread; more splits the outer loop
/// over std::thread workers (no allocation beyond the threads themselves).
struct Host {
  int threads = 1;
  static constexpr MemorySpace space = MemorySpace::kHost;
};

/// CUDA execution on `stream` (a cudaStream_t stored as void* so this header needs no
/// CUDA headers; nullptr is the legacy default stream). `status` is where the kernels
/// report bad device-resident indices (see DeviceStatus); operations that launch
/// kernels require it.
struct Cuda {
  void* stream = nullptr;
  DeviceStatus* status = nullptr;  // [1] device memory, or nullptr
  static constexpr MemorySpace space = MemorySpace::kCuda;
};

}  // namespace exec
}  // namespace kvkit
