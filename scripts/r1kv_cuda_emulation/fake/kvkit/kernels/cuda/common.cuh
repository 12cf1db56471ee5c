#pragma once
// Host stand-ins for the pieces of common.cuh that kernels/cuda/r1kv.cuh uses (see run.sh).
#include <barrier>
#include <bit>
#include <map>
#include <memory>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/workspace.hpp"

struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
using cudaStream_t = void*;
inline thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;
inline std::barrier<>* g_bar = nullptr;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
// __shfl_xor_sync among the lanes of `mask` (a warp's aligned lane group): each group of
// one block meets at its own barrier, writes its value, reads its partner's, and meets
// again before the slots are reused.
struct ShflGroup {
  std::barrier<> bar;
  float v[32] = {};
  explicit ShflGroup(int n) : bar(n) {}
};
inline std::mutex g_shfl_mu;
inline std::map<std::pair<unsigned, unsigned>, std::unique_ptr<ShflGroup>>* g_shfl = nullptr;
inline float __shfl_xor_sync(unsigned mask, float v, int off) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  ShflGroup* g;
  {
    std::lock_guard<std::mutex> l(g_shfl_mu);
    auto& slot = (*g_shfl)[{warp, mask}];
    if (!slot) slot = std::make_unique<ShflGroup>(std::popcount(mask));
    g = slot.get();
  }
  g->v[lane] = v;
  g->bar.arrive_and_wait();
  const float o = g->v[lane ^ static_cast<unsigned>(off)];
  g->bar.arrive_and_wait();
  return o;
}
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(x)

namespace emu {
inline int launches = 0;
inline void launch(dim3 grid, int threads, const std::function<void()>& body) {
  ++launches;
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> bar(threads);
      g_bar = &bar;
      std::map<std::pair<unsigned, unsigned>, std::unique_ptr<ShflGroup>> shfl;
      g_shfl = &shfl;
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          blockIdx = dim3(bx, by); threadIdx = dim3(t); blockDim = dim3(threads); gridDim = grid;
          body();
          bar.arrive_and_drop();
        });
      for (auto& th : ts) th.join();
    }
}
}  // namespace emu

namespace kvkit {
enum class DeviceCheck : std::int32_t { kNone = 0, kNonFiniteScore = 99 };
struct DeviceStatus {
  std::int32_t code = 0, check = 0;
  std::int64_t value = 0, pos = -1, seq = -1, head = -1, bound = 0;
};
namespace cuda_detail {
inline std::mutex g_mu;
inline void report(DeviceStatus* st, StatusCode code, DeviceCheck check, std::int64_t value,
                   std::int64_t pos, std::int64_t seq, std::int64_t bound, std::int64_t head = -1) {
  std::lock_guard<std::mutex> l(g_mu);
  if (st->code != 0) return;
  st->code = static_cast<int>(code); st->check = static_cast<int>(check); st->value = value;
  st->pos = pos; st->seq = seq; st->head = head; st->bound = bound;
}
inline bool failed(const DeviceStatus* st) { std::lock_guard<std::mutex> l(g_mu); return st->code != 0; }
inline float load_float(float x) { return x; }
inline float load_float(half_t x) { return to_float(x); }
inline float load_float(bfloat16_t x) { return to_float(x); }
inline Status check_status_ptr(exec::Cuda ex, const char* op) {
  KVKIT_CHECK_STATUS(ex.status != nullptr, StatusCode::kInvalidArgument, op, ": no status");
  return Status::ok();
}
inline Status launch_status(const char*) { return Status::ok(); }
inline cudaStream_t stream_of(exec::Cuda ex) { return ex.stream; }
}  // namespace cuda_detail
}  // namespace kvkit
