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

/// One unit of work an executor runs: task(arg, index).
using HostTask = void (*)(void* arg, int index);

/// A non-owning reference to an engine's own task runner (its thread pool), so the CPU
/// kernels reuse the engine's threads instead of starting std::threads on every call.
/// `run(ctx, num_tasks, task, arg)` must call task(arg, i) exactly once for every i in
/// [0, num_tasks), on any threads, in any order, concurrently or one after another (the
/// kernels have no barriers between tasks), and return only after every call returned.
/// Tasks never throw. Kernels split their work into the same tasks whatever runs them, so
/// results are bitwise identical with or without an executor. Trivially copyable: the
/// engine keeps `ctx` alive while kernels run. kvkit::ThreadPool (core/thread_pool.hpp)
/// is a ready implementation. A null `run` means "use the built-in std::thread workers".
struct HostExecutor {
  void (*run)(void* ctx, int num_tasks, HostTask task, void* arg) = nullptr;
  void* ctx = nullptr;  // passed to run unchanged (e.g. the pool)

  explicit operator bool() const { return run != nullptr; }
};

/// CPU execution. `threads` <= 1 runs on the calling thread; more splits the outer loop
/// into up to `threads` tasks (at most kMaxHostThreads), run by `executor` when set, else
/// by std::thread workers started and joined per call (no allocation beyond the threads).
/// `threads` alone decides how the work is split, so outputs never depend on which
/// executor runs it.
struct Host {
  int threads = 1;
  HostExecutor executor{};  // optional: the engine's pool (default: built-in workers)
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
