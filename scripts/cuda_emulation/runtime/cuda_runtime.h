#pragma once
// Host stand-in for the CUDA runtime, enough to compile kvkit's real CUDA headers
// (include/kvkit/cuda.cuh and kernels/cuda/*.cuh) and its CUDA tests (tests/cuda/*.cu) as
// ordinary C++ and run them on a machine without a GPU (run_tests.sh). run_tests.sh
// rewrites every `kernel<<<grid, block, smem, stream>>>(args);` into
// `emu::launch(grid, block, stream, [=] { kernel(args); });`.
//
// Execution model: a launch runs its blocks one after another; the threads of a block are
// fibers on the calling thread, each run until it reaches a barrier (__syncthreads, or
// __shfl_xor_sync's barrier per lane group) or ends, in thread order, round after round
// (KVKIT_EMU_SCHEDULE=reverse: highest thread and block first; random: shuffled, see
// Schedule). A missing barrier then shows as a read of shared data before its writer ran
// (forward order catches a lower thread reading what a higher one writes; reverse order
// the other way round).
// Threads that ended count as arrived at __syncthreads; a barrier nobody can pass aborts
// with "deadlock". __shared__ variables are function statics (one block at a time makes
// that sound); atomics are std::atomic_ref. Streams run their work at once, in order; a stream in graph capture
// records it instead, and cudaGraphLaunch replays the record. Device memory is host
// memory from cudaMalloc (256-byte aligned, like the real allocator).
//
// What this checks: indexing, barriers (one some threads never reach aborts with
// "deadlock"), shared-memory use (a missing barrier reads stale data), the status contract,
// graph capture (no blocking call inside a captured step), vector-access alignment (UBSan
// checks the uint2 / uint4 casts); code that assumes a warp runs in lockstep fails, as it
// may on Volta and later. What it cannot: the GPU's math library (host expf / logf
// instead), its memory model (blocks never overlap), timing.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) alignas(n)
#define __launch_bounds__(...)

// ---------------------------------------------------------------------------------------
// Types.
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorStreamCaptureUnsupported = 900,
};
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  std::size_t sharedSizeBytes = 8 << 10;     // static shared memory of a kernel (a guess)
  int maxDynamicSharedSizeBytes = 48 << 10;  // the default opt-out limit
};

namespace emu {
/// A stream: its work runs at once unless it is capturing, then it is recorded.
struct Stream {
  bool capturing = false;
  std::vector<std::function<void()>> ops;
};
struct Graph {
  std::vector<std::function<void()>> ops;
};
}  // namespace emu
using cudaStream_t = emu::Stream*;
using cudaGraph_t = emu::Graph*;
using cudaGraphExec_t = emu::Graph*;

// Plain globals, not thread_local: every block runs on the launching thread (as fibers).
inline dim3 threadIdx, blockIdx, blockDim, gridDim;
inline constexpr int warpSize = 32;

namespace emu {
inline cudaError_t& last_error() {
  static thread_local cudaError_t e = cudaSuccess;
  return e;
}
inline cudaError_t fail(cudaError_t e) {
  last_error() = e;
  return e;
}
/// Runs `op` now, or records it when `s` is capturing.
inline void submit(cudaStream_t s, std::function<void()> op) {
  if (s != nullptr && s->capturing)
    s->ops.push_back(std::move(op));
  else
    op();
}

// Blocks run one at a time; the threads of a block are fibers on the calling thread,
// switched only at barriers (__syncthreads, __shfl_xor_sync) and when they end, so a run
// is deterministic and costs no system calls. The switch saves the x86-64 SysV
// callee-saved registers; ASan is told about every stack switch.
extern "C" void kvkit_emu_switch(void** save_sp, void* to_sp);
asm(R"(
.text
.weak kvkit_emu_switch
.type kvkit_emu_switch,@function
kvkit_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size kvkit_emu_switch,.-kvkit_emu_switch
)");
}  // namespace emu
#if defined(__SANITIZE_ADDRESS__)
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, std::size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, std::size_t* size_old);
#else
inline void __sanitizer_start_switch_fiber(void**, const void*, std::size_t) {}
inline void __sanitizer_finish_switch_fiber(void*, const void**, std::size_t*) {}
#endif
namespace emu {

/// The order blocks of a grid, and the threads of a block within each round, run in:
/// KVKIT_EMU_SCHEDULE=forward (default), reverse, or random (a fresh permutation each time,
/// from KVKIT_EMU_SEED, default 1). Each is a schedule a GPU may run; a kernel that is
/// right only under some of them has a race.
class Schedule {
 public:
  static Schedule& get() {
    static Schedule s;
    return s;
  }
  /// o = a permutation of [0, n).
  void order(std::vector<int>& o, int n) {
    o.resize(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) o[static_cast<std::size_t>(i)] = kind_ == kReverse ? n - 1 - i : i;
    if (kind_ == kRandom) std::shuffle(o.begin(), o.end(), rng_);
  }

 private:
  enum Kind { kForward, kReverse, kRandom };
  Schedule() {
    const char* e = std::getenv("KVKIT_EMU_SCHEDULE");
    const std::string k = e != nullptr ? e : "forward";
    if (k == "reverse") {
      kind_ = kReverse;
    } else if (k == "random") {
      kind_ = kRandom;
      const char* seed = std::getenv("KVKIT_EMU_SEED");
      rng_.seed(seed != nullptr ? std::strtoull(seed, nullptr, 10) : 1);
      std::fprintf(stderr, "emu: random schedule, KVKIT_EMU_SEED=%s\n", seed != nullptr ? seed : "1");
    } else if (k != "forward") {
      std::fprintf(stderr, "emu: unknown KVKIT_EMU_SCHEDULE '%s' (forward, reverse or random)\n", k.c_str());
      std::abort();
    }
  }
  Kind kind_ = kForward;
  std::mt19937_64 rng_;
};

/// A barrier among `expected` fibers; fibers that end count as arrived (block barrier).
struct Barrier {
  int expected = 0, arrived = 0;
  std::uint64_t gen = 0;
};

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  dim3 tid;
  bool done = false;
  Barrier* wait = nullptr;  // waiting on this barrier until its gen moves past wait_gen
  std::uint64_t wait_gen = 0;
};

class Block {
 public:
  static constexpr std::size_t kStack = std::size_t{1} << 20;
  static Block& get() {
    static Block b;
    return b;
  }
  ~Block() {
    for (char* s : stacks_) std::free(s);
  }
  /// Runs kernel() as n fibers (thread indices from `block`) until all end.
  void run(dim3 block, const std::function<void()>& kernel) {
    const int n = static_cast<int>(block.x * block.y * block.z);
    while (static_cast<int>(stacks_.size()) < n) stacks_.push_back(static_cast<char*>(std::aligned_alloc(64, kStack)));
    fibers_.assign(n, Fiber{});
    kernel_ = &kernel;
    bar_ = Barrier{n, 0, 0};
    shfl_.clear();
    for (int t = 0; t < n; ++t) {
      Fiber& f = fibers_[t];
      f.stack = stacks_[t];
      f.tid = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      // Initial frame: six saved registers, then the return address (the entry point), so
      // that after `ret` the stack is aligned as at a function's entry.
      auto* top = reinterpret_cast<void**>(f.stack + kStack);
      top[-2] = reinterpret_cast<void*>(&Block::entry);
      f.sp = top - 8;
    }
    for (int live = n; live > 0;) {
      bool progress = false;
      Schedule::get().order(order_, n);
      for (const int t : order_) {
        Fiber& f = fibers_[t];
        if (f.done || (f.wait != nullptr && f.wait->gen == f.wait_gen)) continue;
        f.wait = nullptr;
        resume(t);
        progress = true;
        if (f.done) --live;
      }
      if (!progress && live > 0) {
        std::fprintf(stderr, "emu: deadlock: %d threads wait at a barrier others never reach (block %u,%u,%u)\n", live,
                     blockIdx.x, blockIdx.y, blockIdx.z);
        std::abort();
      }
    }
    kernel_ = nullptr;
  }
  /// The calling fiber waits until `expected` fibers reached b (or ended, for the block's).
  void arrive_and_wait(Barrier& b) {
    Fiber& f = fibers_[cur_];
    f.wait = &b;
    f.wait_gen = b.gen;
    if (++b.arrived == b.expected) release(b);
    yield();
  }
  Barrier& block_barrier() { return bar_; }
  /// The shuffle slots and barrier of the lane group (warp, mask) (a short list per block:
  /// one entry per warp and mask in use).
  std::pair<Barrier*, std::uint64_t*> shfl_group(unsigned warp, unsigned mask) {
    const std::uint64_t key = (std::uint64_t{warp} << 32) | mask;
    for (auto& g : shfl_)
      if (g->key == key) return {&g->bar, g->slots};
    shfl_.push_back(std::make_unique<ShflGroup>());
    ShflGroup& g = *shfl_.back();
    g.key = key;
    g.bar.expected = std::popcount(mask);
    return {&g.bar, g.slots};
  }

 private:
  static void release(Barrier& b) {
    b.arrived = 0;
    ++b.gen;
  }
  void resume(int t) {
    cur_ = t;
    threadIdx = fibers_[t].tid;
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, fibers_[t].stack, kStack);
    kvkit_emu_switch(&main_sp_, fibers_[t].sp);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
  }
  void yield() {
    Fiber& f = fibers_[cur_];
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, main_bottom_, main_size_);
    kvkit_emu_switch(&f.sp, main_sp_);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
  }
  [[noreturn]] static void entry() {
    Block& b = get();
    __sanitizer_finish_switch_fiber(nullptr, &b.main_bottom_, &b.main_size_);
    (*b.kernel_)();
    Fiber& f = b.fibers_[b.cur_];
    f.done = true;
    // An ended thread counts as arrived at the block barrier.
    if (--b.bar_.expected == b.bar_.arrived && b.bar_.arrived > 0) release(b.bar_);
    void* dummy = nullptr;
    __sanitizer_start_switch_fiber(nullptr, b.main_bottom_, b.main_size_);
    kvkit_emu_switch(&dummy, b.main_sp_);
    std::abort();  // never resumed
  }
  std::vector<char*> stacks_;
  std::vector<Fiber> fibers_;
  std::vector<int> order_;
  const std::function<void()>* kernel_ = nullptr;
  Barrier bar_;
  struct ShflGroup {
    std::uint64_t key = 0;
    Barrier bar;
    std::uint64_t slots[32] = {};
  };
  std::vector<std::unique_ptr<ShflGroup>> shfl_;
  int cur_ = 0;
  void* main_sp_ = nullptr;
  const void* main_bottom_ = nullptr;
  std::size_t main_size_ = 0;
};

/// Runs a grid: blocks in turn, in the schedule's order (forward: x fastest).
inline void run_grid(dim3 grid, dim3 block, const std::function<void()>& kernel) {
  blockDim = block;
  gridDim = grid;
  static std::vector<int> order;
  Schedule::get().order(order, static_cast<int>(grid.x * grid.y * grid.z));
  for (const int i : order) {
    const unsigned u = static_cast<unsigned>(i);
    blockIdx = dim3(u % grid.x, (u / grid.x) % grid.y, u / (grid.x * grid.y));
    Block::get().run(block, kernel);
  }
}

/// The rewritten `kernel<<<grid, block[, smem[, stream]]>>>(args)`.
template <class F>
void launch(dim3 grid, dim3 block, std::size_t smem, cudaStream_t s, F&& kernel) {
  const unsigned n = block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || n == 0 || n > 1024 || smem > (227u << 10)) {
    fail(cudaErrorInvalidValue);
    return;
  }
  submit(s, [grid, block, k = std::function<void()>(std::forward<F>(kernel))] { run_grid(grid, block, k); });
}
template <class F>
void launch(dim3 grid, dim3 block, F&& kernel) {
  launch(grid, block, 0, nullptr, std::forward<F>(kernel));
}
template <class F>
void launch(dim3 grid, dim3 block, std::size_t smem, F&& kernel) {
  launch(grid, block, smem, nullptr, std::forward<F>(kernel));
}
}  // namespace emu

// ---------------------------------------------------------------------------------------
// Device-side functions.
inline void __syncthreads() { emu::Block::get().arrive_and_wait(emu::Block::get().block_barrier()); }

/// Exchanges through the lane group's slots: write, wait for the group, read the partner's,
/// wait again before the slots are reused.
template <class V>
V __shfl_xor_sync(unsigned mask, V v, int off) {
  static_assert(sizeof(V) <= sizeof(std::uint64_t), "a lane's value fits a slot");
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned lane = t % 32, warp = t / 32;
  emu::Block& blk = emu::Block::get();
  auto [bar, slots] = blk.shfl_group(warp, mask);
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  slots[lane] = bits;
  blk.arrive_and_wait(*bar);
  bits = slots[lane ^ static_cast<unsigned>(off)];
  blk.arrive_and_wait(*bar);
  V o;
  std::memcpy(&o, &bits, sizeof(V));
  return o;
}

template <class T>
T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <class T>
T atomicOr(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_or(v);
}
template <class T>
T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T cur = a.load();
  while (v < cur && !a.compare_exchange_weak(cur, v)) {
  }
  return cur;
}
template <class T>
T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
  return expected;  // the old value either way
}

// Correctly rounded arithmetic intrinsics: the host's IEEE operations (round to nearest).
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __double2float_rn(double a) { return static_cast<float>(a); }
inline long long __double_as_longlong(double a) { return std::bit_cast<long long>(a); }
inline float __uint_as_float(unsigned a) { return std::bit_cast<float>(a); }
inline unsigned __float_as_uint(float a) { return std::bit_cast<unsigned>(a); }
inline float __int_as_float(int a) { return std::bit_cast<float>(a); }
inline int __float_as_int(float a) { return std::bit_cast<int>(a); }

// CUDA's global min / max overloads (math_functions.h), for the device code that calls
// them unqualified.
#define KVKIT_EMU_MINMAX(T)                        \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
KVKIT_EMU_MINMAX(int)
KVKIT_EMU_MINMAX(unsigned)
KVKIT_EMU_MINMAX(long)
KVKIT_EMU_MINMAX(unsigned long)
KVKIT_EMU_MINMAX(long long)
KVKIT_EMU_MINMAX(unsigned long long)
KVKIT_EMU_MINMAX(float)
KVKIT_EMU_MINMAX(double)
#undef KVKIT_EMU_MINMAX
using std::isfinite;  // expf, logf, ... are the C library's

// ---------------------------------------------------------------------------------------
// Host API.
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::last_error();
  emu::last_error() = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return emu::last_error(); }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
// Limits as an H100 / H200 reports them.
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  if (a != cudaDevAttrMaxSharedMemoryPerBlockOptin) return emu::fail(cudaErrorInvalidValue);
  *v = 227 << 10;
  return cudaSuccess;
}
template <class K>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, K*) {
  *a = cudaFuncAttributes{};
  return cudaSuccess;
}
template <class K>
cudaError_t cudaFuncSetAttribute(K*, cudaFuncAttribute, int v) {
  return v <= (227 << 10) ? cudaSuccess : emu::fail(cudaErrorInvalidValue);
}

template <class T>
cudaError_t cudaMalloc(T** p, std::size_t n) {
  void* q = std::aligned_alloc(256, (std::max<std::size_t>(n, 1) + 255) / 256 * 256);
  if (q == nullptr) return emu::fail(cudaErrorMemoryAllocation);
  *p = static_cast<T*>(q);
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
// Blocking calls: not allowed while a stream captures (as with cudaStreamCaptureModeGlobal).
inline bool& emu_capturing_any() {
  static bool b = false;
  return b;
}
inline cudaError_t cudaMemcpy(void* d, const void* s, std::size_t n, cudaMemcpyKind) {
  if (emu_capturing_any()) return emu::fail(cudaErrorStreamCaptureUnsupported);
  if (n > 0) std::memcpy(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* d, int v, std::size_t n) {
  if (emu_capturing_any()) return emu::fail(cudaErrorStreamCaptureUnsupported);
  std::memset(d, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* d, int v, std::size_t n, cudaStream_t s = nullptr) {
  emu::submit(s, [=] { std::memset(d, v, n); });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* src, std::size_t n, cudaMemcpyKind, cudaStream_t s = nullptr) {
  emu::submit(s, [=] { if (n > 0) std::memcpy(d, src, n); });
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new emu::Stream;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (s != nullptr && s->capturing) return emu::fail(cudaErrorStreamCaptureUnsupported);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return emu_capturing_any() ? emu::fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess; }
inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (s == nullptr || s->capturing) return emu::fail(cudaErrorInvalidValue);
  s->capturing = true;
  s->ops.clear();
  emu_capturing_any() = true;
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  if (s == nullptr || !s->capturing) return emu::fail(cudaErrorInvalidValue);
  s->capturing = false;
  emu_capturing_any() = false;
  *g = new emu::Graph{std::move(s->ops)};
  s->ops.clear();
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long = 0) {
  *e = new emu::Graph{g->ops};
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  for (auto& op : e->ops) emu::submit(s, op);
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete e;
  return cudaSuccess;
}
