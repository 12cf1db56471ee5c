#pragma once
// Shared pieces of the CUDA backend: cudaError_t -> Status, stream access, element
// conversions and vectorised raw loads/stores.
//
// Reached only through <kvkit/cuda.cuh>. half_t / bfloat16_t keep their raw bits on the
// device: loads go through the hardware conversions (__half2float, a 16-bit shift for
// bf16) and stores round to nearest even (__float2half_rn, __float2bfloat16_rn), which
// give the same bits as kvkit's host converters for every finite value, so CUDA and CPU
// twins store identical elements.
//
// Device-side tables (slot mappings, page tables, index lists) cannot be validated by
// the host without synchronising. Every kernel therefore checks each index it reads on
// the device and skips entries that would address memory outside the view; the host
// only validates scalar arguments.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"
#include "kvkit/kernels/params.hpp"

namespace kvkit {
namespace cuda_detail {

/// Threads per block of the element-wise copy kernels.
inline constexpr int kCopyThreads = 256;
/// Cap on blocks of grid-stride kernels (enough to fill any current GPU many times over).
inline constexpr std::int64_t kMaxCopyBlocks = std::int64_t{1} << 20;

/// Turns a CUDA error into a Status naming the operation and CUDA's own message.
inline Status cuda_status(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return Status::ok();
  return make_status(StatusCode::kDeviceError, op, ": ", cudaGetErrorName(err), ": ",
                     cudaGetErrorString(err));
}

/// Status of the launches just made on this thread (clears CUDA's last error; does not
/// synchronise, so faults inside the kernels surface later on the stream).
inline Status launch_status(const char* op) { return cuda_status(cudaGetLastError(), op); }

/// The cudaStream_t an exec::Cuda carries.
inline cudaStream_t stream_of(exec::Cuda ex) { return static_cast<cudaStream_t>(ex.stream); }

/// Blocks for a grid-stride loop over `total` items.
inline unsigned grid_for(std::int64_t total, int threads = kCopyThreads) {
  std::int64_t blocks = (total + threads - 1) / threads;
  if (blocks > kMaxCopyBlocks) blocks = kMaxCopyBlocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

/// True when p is a multiple of `bytes` (a power of two).
inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

/// Largest power-of-two vector width in bytes (<= 16, >= sizeof(T)) dividing the
/// head_dim row, every view base and stride, and every extra pointer / element stride
/// given; vectorised accesses of that width stay aligned for every (page, token, head).
template <class T>
int view_vector_bytes(const PagedKVView<T>& view, std::initializer_list<const void*> ptrs = {},
                      std::initializer_list<std::int64_t> elem_strides = {}) {
  int bytes = 16;
  auto fits = [&](int w) {
    auto ok_stride = [&](std::int64_t s) {
      return (s * static_cast<std::int64_t>(sizeof(T))) % w == 0;
    };
    if (!ok_stride(view.head_dim)) return false;
    if (!aligned_to(view.k_data, w) || !aligned_to(view.v_data, w)) return false;
    const std::int64_t view_strides[] = {view.k_stride_page, view.k_stride_token,
                                         view.k_stride_head,  view.v_stride_page,
                                         view.v_stride_token, view.v_stride_head};
    for (std::int64_t s : view_strides)
      if (!ok_stride(s)) return false;
    for (const void* p : ptrs)
      if (p != nullptr && !aligned_to(p, w)) return false;
    for (std::int64_t s : elem_strides)
      if (!ok_stride(s)) return false;
    return true;
  };
  while (bytes > static_cast<int>(sizeof(T)) && !fits(bytes)) bytes /= 2;
  return bytes;
}

/// Raw storage of one vector of `Bytes` bytes (one ld/st instruction).
template <int Bytes>
struct RawVec;
template <>
struct RawVec<2> {
  using type = unsigned short;
};
template <>
struct RawVec<4> {
  using type = unsigned int;
};
template <>
struct RawVec<8> {
  using type = uint2;
};
template <>
struct RawVec<16> {
  using type = uint4;
};

/// Copies N elements of T with a single vector access (pointers aligned to sizeof(T)*N).
template <class T, int N>
KVKIT_DEVICE void copy_vec(T* dst,         // [N]
                           const T* src) {  // [N]
  using Raw = typename RawVec<static_cast<int>(sizeof(T)) * N>::type;
  *reinterpret_cast<Raw*>(dst) = *reinterpret_cast<const Raw*>(src);
}

/// Element -> float on the device (hardware conversions; exact for all three types).
KVKIT_DEVICE float load_float(float x) { return x; }
KVKIT_DEVICE float load_float(half_t x) { return __half2float(__ushort_as_half(x.bits)); }
KVKIT_DEVICE float load_float(bfloat16_t x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

/// float -> element on the device, round to nearest even.
template <class T>
KVKIT_DEVICE T store_float(float x);
template <>
KVKIT_DEVICE float store_float<float>(float x) {
  return x;
}
template <>
KVKIT_DEVICE half_t store_float<half_t>(float x) {
  return half_t::from_bits(__half_as_ushort(__float2half_rn(x)));
}
template <>
KVKIT_DEVICE bfloat16_t store_float<bfloat16_t>(float x) {
  return bfloat16_t::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
}

/// Loads N elements with one vector access and widens them to float.
template <class T, int N>
KVKIT_DEVICE void load_vec_float(const T* src,  // [N]
                                 float* out) {  // [N]
  using Raw = typename RawVec<static_cast<int>(sizeof(T)) * N>::type;
  const Raw raw = *reinterpret_cast<const Raw*>(src);
  T e[N];
  static_assert(sizeof(e) == sizeof(raw), "vector size");
  std::memcpy(e, &raw, sizeof(raw));  // register moves; avoids type-punned loads
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = load_float(e[i]);
}

/// Checks a caller-supplied device pointer argument is present.
inline Status check_arg_ptr(const void* p, const char* name, const char* op) {
  KVKIT_CHECK_STATUS(p != nullptr, StatusCode::kInvalidArgument, op, ": ", name, " is null");
  return Status::ok();
}

/// Calls f(std::integral_constant<int, N>) with N = vector_bytes / sizeof(T) elements.
template <class T, class F>
Status dispatch_vec_elems(int vector_bytes, F&& f) {
  constexpr int kMax = 16 / static_cast<int>(sizeof(T));
  switch (vector_bytes / static_cast<int>(sizeof(T))) {
    case 8:
      if constexpr (kMax >= 8) return f(std::integral_constant<int, 8>{});
      break;
    case 4: return f(std::integral_constant<int, 4>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: break;
  }
  return f(std::integral_constant<int, 1>{});
}

}  // namespace cuda_detail
}  // namespace kvkit
