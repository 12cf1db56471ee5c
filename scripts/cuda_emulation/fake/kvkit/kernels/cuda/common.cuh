#pragma once
// Host stand-ins for the pieces of common.cuh that kernels/cuda/r1kv.cuh and eps.cuh use
// (see run.sh): one std::thread per CUDA thread, a std::barrier per block for
// __syncthreads, __shared__ variables as function statics (blocks run one after another),
// __shfl_xor_sync through a barrier per lane group.
#include <atomic>
#include <barrier>
#include <bit>
#include <map>
#include <memory>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"

struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
using cudaStream_t = void*;
using cudaError_t = int;
inline constexpr cudaError_t cudaSuccess = 0;
inline cudaError_t cudaMemsetAsync(void* p, int v, std::size_t n, cudaStream_t) { std::memset(p, v, n); return cudaSuccess; }
inline thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;
inline std::barrier<>* g_bar = nullptr;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
using std::isfinite;
// __shfl_xor_sync among the lanes of `mask` (a warp's aligned lane group): each group of
// one block meets at its own barrier, writes its value, reads its partner's, and meets
// again before the slots are reused.
struct ShflGroup {
  std::barrier<> bar;
  std::uint64_t v[32] = {};  // each lane's value's bytes
  explicit ShflGroup(int n) : bar(n) {}
};
inline std::mutex g_shfl_mu;
inline std::map<std::pair<unsigned, unsigned>, std::unique_ptr<ShflGroup>>* g_shfl = nullptr;
template <class V>
V __shfl_xor_sync(unsigned mask, V v, int off) {
  static_assert(sizeof(V) <= sizeof(std::uint64_t), "a lane's value fits a slot");
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  ShflGroup* g;
  {
    std::lock_guard<std::mutex> l(g_shfl_mu);
    auto& slot = (*g_shfl)[{warp, mask}];
    if (!slot) slot = std::make_unique<ShflGroup>(std::popcount(mask));
    g = slot.get();
  }
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  g->v[lane] = bits;
  g->bar.arrive_and_wait();
  bits = g->v[lane ^ static_cast<unsigned>(off)];
  g->bar.arrive_and_wait();
  V o;
  std::memcpy(&o, &bits, sizeof(V));
  return o;
}
// IEEE division, round to nearest (kvchan_residual.cuh): the host's float division.
inline float __fdiv_rn(float a, float b) { return a / b; }
// Shared-memory atomics of the radix cut (eps.cuh).
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(x)

// Shared memory limits as an H100 reports them (227 KiB opt-in, 48 KiB by default).
struct cudaFuncAttributes { std::size_t sharedSizeBytes = 8 << 10; int maxDynamicSharedSizeBytes = 48 << 10; };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 227 << 10; return cudaSuccess; }
template <class K> cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, K*) { *a = cudaFuncAttributes{}; return cudaSuccess; }
template <class K> cudaError_t cudaFuncSetAttribute(K*, cudaFuncAttribute, int) { return cudaSuccess; }

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
enum class DeviceCheck : std::int32_t { kNone = 0, kIndptr, kNullTable, kLastPageLen, kSeqTooLong, kSeqLenNegative, kRowTooShort, kPageId, kNonFiniteScore, kSummaryTokens, kSummaryRepeated, kSrcPage, kDstPage, kPackChannel, kPackChannelOrder };
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
inline bool block_failed(const DeviceStatus* st) {
  __shared__ bool stop;
  if (threadIdx.x == 0) stop = failed(st);
  __syncthreads();
  return stop;
}
inline float load_float(float x) { return x; }
inline float load_float(half_t x) { return to_float(x); }
inline float load_float(bfloat16_t x) { return to_float(x); }
// Round to nearest even, as __float2half_rn / __float2bfloat16_rn (kvchan_residual.cuh).
template <class T> inline T store_float(float x) { return from_float<T>(x); }
inline Status check_status_ptr(exec::Cuda ex, const char* op) {
  KVKIT_CHECK_STATUS(ex.status != nullptr, StatusCode::kInvalidArgument, op, ": no status");
  return Status::ok();
}
inline Status launch_status(const char*) { return Status::ok(); }
inline Status cuda_status(cudaError_t e, const char* op) {
  KVKIT_CHECK_STATUS(e == cudaSuccess, StatusCode::kDeviceError, op, ": error ", e);
  return Status::ok();
}
inline cudaStream_t stream_of(exec::Cuda ex) { return ex.stream; }
inline constexpr int kCopyThreads = 256;
inline unsigned grid_for(std::int64_t total, int threads = kCopyThreads) {
  const std::int64_t b = (total + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}
template <class T>
Status check_table_ptrs(const PagedKVView<T>&) { return Status::ok(); }
// The page-table header and page ids of sequence b (the real one's checks, simplified:
// page ids in range, CSR header sane).
template <class T>
std::int32_t check_sequence_pages_dev(const PagedKVView<T>& v, std::int32_t b, DeviceStatus* st, bool report_hdr,
                                      std::int64_t first, std::int64_t step) {
  const std::int32_t n = v.num_pages(b);
  if (n < 0) {
    if (report_hdr) report(st, StatusCode::kOutOfRange, DeviceCheck::kIndptr, n, -1, b, 0);
    return -1;
  }
  for (std::int64_t i = first; i < n; i += step) {
    const std::int32_t p = v.page_id(b, static_cast<std::int32_t>(i));
    if (p < 0 || p >= v.num_pages_total) report(st, StatusCode::kOutOfRange, DeviceCheck::kPageId, p, i, b, v.num_pages_total);
  }
  return n;
}
}  // namespace cuda_detail
}  // namespace kvkit
