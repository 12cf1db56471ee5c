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
// Device-side tables (slot mappings, page tables, index lists) cannot be read by the
// host without synchronising. Each operation therefore checks scalars on the host (a
// Status right away) and checks the device tables on the device: a validation kernel
// runs first on the stream and records the first bad entry in the caller's
// DeviceStatus (exec::Cuda::status); the main kernels, queued behind it, return at once
// when the status holds an error, so a failed operation writes nothing. The caller turns
// the status into a kvkit::Status after synchronising (read_device_status). Nothing is
// ever read or written outside the view and the caller's arrays, whatever the tables
// hold.

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

/// Which device-side check failed; read_device_status turns it into the message the
/// CPU twin gives for the same input.
enum class DeviceCheck : std::int32_t {
  kNone = 0,
  kSlot,           // write_kv: slot `value` of token `pos` >= `bound` slots
  kNullTable,      // a page-table array the sequence needs is null
  kIndptr,         // CSR indptr of sequence `seq`: `value` -> `bound` is not monotone
  kLastPageLen,    // last_page_len `value` of `seq` outside [1, `bound`]
  kSeqTooLong,     // sequence `seq` holds `value` tokens (> INT32_MAX)
  kSeqLenNegative, // seq_lens[`seq`] = `value` < 0
  kRowTooShort,    // sequence `seq` needs `value` pages, block-table rows hold `bound`
  kPageId,         // page id `value` at (`seq`, page `pos`) outside [0, `bound`)
  kTokenId,        // gather: token id `value` at `pos` outside [0, `bound`) of `seq`
  kGatherCount,    // gather: n = `value` exceeds seq_len `bound` of `seq`
  kNumKeep,        // compact: num_keep `value` of `seq` outside [0, `bound`]
  kNullKeep,       // compact: keep is null but sequence `seq` keeps tokens
  kKeepIndex,      // compact: keep `value` at (`seq`, `head`, `pos`) outside [0, `bound`)
  kSrcPage,        // copy_pages: source page `value` at `pos` outside [0, `bound`)
  kDstPage,        // copy_pages: destination page `value` at `pos` outside [0, `bound`)
  kDstIsSource,    // copy_pages: destination page `value` at `pos` is also a source
  kDstRepeated,    // copy_pages: destination page `value` at `pos` is repeated
  kSubsetIndptr,   // decode: page_subset_indptr of (`seq`, `head`): `value` -> `bound`
  kSubsetEntry,    // decode: page_subset entry `value` at (`seq`, `head`, `pos`) outside
                   //   [0, `bound`) pages
  kSubsetOrder,    // decode: page_subset entry `value` at (`seq`, `head`, `pos`) not
                   //   above the previous entry `bound`
  kSubsetNull,     // decode: page_subset is null but (`seq`, `head`) has `value` entries
  kKChannel,       // decode: k_channels[`head`, `pos`] = `value` outside [0, `bound`)
  kVChannel,       // decode: v_channels[`head`, `pos`] = `value` outside [0, `bound`)
  kScoresStride,   // decode: seq_len `value` of `seq` > scores_stride `bound`
  kNonFiniteScore, // compressor: kv head `head` has a non-finite score at candidate `pos`
  kPackChannel,    // kvchan pack: channel `value` of (`head`, `pos`) outside [0, `bound`);
                   //   `seq` 0: k_channels, 1: v_channels
  kPackChannelOrder, // kvchan pack: channel `value` of (`head`, `pos`) not above the
                     //   previous entry `bound`; `seq` as kPackChannel
  kSummaryTokens,  // eps update_summaries: ntok `value` at `pos` outside [0, `bound`]
  kSummaryRepeated, // eps update_summaries: page id `value` at `pos` also at `bound`
};

/// Device-side error word the CUDA kernels report bad device-resident input to. The
/// caller owns it (device memory, or managed/pinned memory the device can write), zeroes
/// it with reset_device_status, and passes it in exec::Cuda::status. The first error
/// wins (atomic), later ones are dropped. It is sticky: every kvkit operation launched
/// with a status that already holds an error does nothing (its kernels return at once),
/// so an engine step fails as a whole and is checked once, after the stream is
/// synchronised, with read_device_status. Plain data, 8-byte aligned, 48 bytes.
struct DeviceStatus {
  std::int32_t code = 0;   // StatusCode as int; 0 = ok
  std::int32_t check = 0;  // DeviceCheck
  std::int64_t value = 0;  // the bad value
  std::int64_t pos = -1;   // position in its array (token, pair, page, channel), or -1
  std::int64_t seq = -1;   // sequence, or -1
  std::int64_t head = -1;  // kv head, or -1
  std::int64_t bound = 0;  // the limit `value` broke
};
static_assert(std::is_trivially_copyable<DeviceStatus>::value, "copied with cudaMemcpy");

/// The Status a DeviceStatus (already copied to the host) stands for: ok when it holds
/// no error, else its code with the message the CPU twin gives for the same input.
inline Status to_status(const DeviceStatus& s) {
  if (s.code == 0) return Status::ok();
  const auto code = static_cast<StatusCode>(s.code);
  const std::string at_seq = s.seq >= 0 ? detail::concat(" of sequence ", s.seq) : std::string();
  switch (static_cast<DeviceCheck>(s.check)) {
    case DeviceCheck::kSlot:
      return make_status(code, "slot ", s.value, " of token ", s.pos, " out of range [0, ", s.bound,
                         ")");
    case DeviceCheck::kNullTable:
      return make_status(code, "page table array needed by sequence ", s.seq, " is null");
    case DeviceCheck::kIndptr:
      return make_status(code, "indptr of sequence ", s.seq, " is invalid: ", s.value, " -> ",
                         s.bound);
    case DeviceCheck::kLastPageLen:
      return make_status(code, "last_page_len ", s.value, at_seq, " outside [1, ", s.bound, "]");
    case DeviceCheck::kSeqTooLong:
      return make_status(code, "sequence ", s.seq, " holds ", s.value,
                         " tokens, more than the int32 maximum");
    case DeviceCheck::kSeqLenNegative:
      return make_status(code, "seq_len ", s.value, at_seq, " is negative");
    case DeviceCheck::kRowTooShort:
      return make_status(code, "sequence ", s.seq, " needs ", s.value,
                         " pages but block table rows hold ", s.bound);
    case DeviceCheck::kPageId:
      return make_status(code, "page id ", s.value, " out of range [0, ", s.bound, ") at sequence ",
                         s.seq, " page ", s.pos);
    case DeviceCheck::kTokenId:
      return make_status(code, "token id ", s.value, " at position ", s.pos, " out of range [0, ",
                         s.bound, ")", at_seq);
    case DeviceCheck::kGatherCount:
      return make_status(code, "n ", s.value, " exceeds seq_len ", s.bound, at_seq);
    case DeviceCheck::kNumKeep:
      return make_status(code, "num_keep ", s.value, at_seq, " outside [0, ", s.bound, "]");
    case DeviceCheck::kNullKeep:
      return make_status(code, "keep is null but sequence ", s.seq, " keeps ", s.value, " tokens");
    case DeviceCheck::kKeepIndex:
      return make_status(code, "keep index ", s.value, " at position ", s.pos, at_seq, " head ",
                         s.head, " out of range [0, ", s.bound, ")");
    case DeviceCheck::kSrcPage:
      return make_status(code, "source page id ", s.value, " at position ", s.pos,
                         " out of range [0, ", s.bound, ")");
    case DeviceCheck::kDstPage:
      return make_status(code, "destination page id ", s.value, " at position ", s.pos,
                         " out of range [0, ", s.bound, ")");
    case DeviceCheck::kDstIsSource:
      return make_status(code, "destination page id ", s.value, " at position ", s.pos,
                         " is also a source page");
    case DeviceCheck::kDstRepeated:
      return make_status(code, "destination page id ", s.value, " at position ", s.pos,
                         " is repeated");
    case DeviceCheck::kSubsetIndptr:
      return make_status(code, "page_subset_indptr", at_seq, " head ", s.head, " is invalid: ",
                         s.value, " -> ", s.bound);
    case DeviceCheck::kSubsetEntry:
      return make_status(code, "page_subset entry ", s.value, " at position ", s.pos, at_seq,
                         " head ", s.head, " outside [0, ", s.bound, ") pages");
    case DeviceCheck::kSubsetOrder:
      return make_status(code, "page_subset entry ", s.value, " at position ", s.pos, at_seq,
                         " head ", s.head, " is not above the previous entry ", s.bound,
                         ": subsets must be strictly ascending");
    case DeviceCheck::kSubsetNull:
      return make_status(code, "page_subset is null but", at_seq, " head ", s.head, " has ",
                         s.value, " entries");
    case DeviceCheck::kKChannel:
      return make_status(code, "k_channels entry ", s.value, " of head ", s.head, " channel ", s.pos,
                         " out of range [0, q_dim ", s.bound, ")");
    case DeviceCheck::kVChannel:
      return make_status(code, "v_channels entry ", s.value, " of head ", s.head, " channel ", s.pos,
                         " out of range [0, q_dim ", s.bound, ")");
    case DeviceCheck::kScoresStride:
      return make_status(code, "seq_len ", s.value, at_seq, " exceeds scores_stride ", s.bound);
    case DeviceCheck::kSummaryTokens:
      return make_status(code, "eps update_summaries: ntok ", s.value, " at position ", s.pos, " outside [0, ",
                         s.bound, "]");
    case DeviceCheck::kSummaryRepeated:
      return make_status(code, "eps update_summaries: page id ", s.value, " at position ", s.pos,
                         " is repeated (also at position ", s.bound, ")");
    case DeviceCheck::kNonFiniteScore:
      return make_status(code, "compressor: kv head ", s.head,
                         " has non-finite scores (NaN or inf in keys or queries)");
    case DeviceCheck::kPackChannel:
      return make_status(code, s.seq == 0 ? "k_channels" : "v_channels", " entry ", s.value,
                         " of head ", s.head, " channel ", s.pos, " out of range [0, ", s.bound, ")");
    case DeviceCheck::kPackChannelOrder:
      return make_status(code, s.seq == 0 ? "k_channels" : "v_channels", " entry ", s.value,
                         " of head ", s.head, " channel ", s.pos,
                         " is not above the previous entry ", s.bound,
                         ": channel sets must be strictly ascending");
    case DeviceCheck::kNone: break;
  }
  return make_status(code, "device check ", s.check, " failed on value ", s.value);
}

/// Copies the caller's device status to the host and returns to_status of it. Call it
/// after synchronising the stream the operations ran on (it is a blocking cudaMemcpy,
/// so never inside graph capture). A CUDA failure is kDeviceError.
inline Status read_device_status(const DeviceStatus* status) {  // [1] device
  KVKIT_CHECK_STATUS(status != nullptr, StatusCode::kInvalidArgument, "read_device_status: null");
  DeviceStatus h;
  const cudaError_t err = cudaMemcpy(&h, status, sizeof(h), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess)
    return make_status(StatusCode::kDeviceError, "read_device_status: ", cudaGetErrorName(err),
                       ": ", cudaGetErrorString(err));
  return to_status(h);
}

/// Clears ex.status on ex.stream (cudaMemsetAsync: no synchronisation, graph safe).
inline Status reset_device_status(exec::Cuda ex) {
  KVKIT_CHECK_STATUS(ex.status != nullptr, StatusCode::kInvalidArgument,
                     "reset_device_status: exec::Cuda has no status");
  const cudaError_t err = cudaMemsetAsync(ex.status, 0, sizeof(DeviceStatus),
                                          static_cast<cudaStream_t>(ex.stream));
  if (err != cudaSuccess)
    return make_status(StatusCode::kDeviceError, "reset_device_status: ", cudaGetErrorName(err),
                       ": ", cudaGetErrorString(err));
  return Status::ok();
}

namespace cuda_detail {

/// Records an error unless one is already there (first error wins).
KVKIT_DEVICE void report(DeviceStatus* st, StatusCode code, DeviceCheck check, std::int64_t value,
                         std::int64_t pos, std::int64_t seq, std::int64_t bound,
                         std::int64_t head = -1) {
  if (atomicCAS(&st->code, 0, static_cast<int>(code)) != 0) return;
  st->check = static_cast<std::int32_t>(check);
  st->value = value;
  st->pos = pos;
  st->seq = seq;
  st->head = head;
  st->bound = bound;
}

/// True when the status already holds an error: main kernels then return at once. (The
/// validation kernels that set it ran before them on the same stream.)
KVKIT_DEVICE bool failed(const DeviceStatus* st) { return st->code != 0; }

/// failed(st) read once per block (every thread must call it), so a kernel with barriers
/// returns as a whole even when another block of the grid reports while it starts.
KVKIT_DEVICE bool block_failed(const DeviceStatus* st) {
  __shared__ bool stop;
  if (threadIdx.x == 0) stop = failed(st);
  __syncthreads();
  return stop;
}

/// Host side: every operation that launches kernels needs a status to report to.
inline Status check_status_ptr(exec::Cuda ex, const char* op) {
  KVKIT_CHECK_STATUS(ex.status != nullptr, StatusCode::kInvalidArgument, op,
                     ": exec::Cuda::status is null (device-side checks report there; see "
                     "DeviceStatus)");
  return Status::ok();
}

/// Checks the page-table entries of sequence b on the device, as
/// detail::check_sequence_pages does on the host: the header (indptr / last_page_len /
/// seq_lens / row length) by every thread that calls it, reporting only when `report_hdr`,
/// and page ids i = first, first + step, ... < num_pages(b). Returns b's page count, or
/// -1 when the header is bad (its pages are then not read).
template <class T>
KVKIT_DEVICE std::int32_t check_sequence_pages_dev(const PagedKVView<T>& v, std::int32_t b,
                                                   DeviceStatus* st, bool report_hdr,
                                                   std::int64_t first, std::int64_t step) {
  std::int32_t n = 0;
  if (v.table_kind == PageTableKind::kCsr) {
    const std::int32_t lo = v.indptr[b], hi = v.indptr[b + 1];
    if (lo < 0 || hi < lo) {
      if (report_hdr) report(st, StatusCode::kOutOfRange, DeviceCheck::kIndptr, lo, -1, b, hi);
      return -1;
    }
    n = hi - lo;
    if (n > 0) {
      if (v.indices == nullptr || v.last_page_len == nullptr) {
        if (report_hdr) report(st, StatusCode::kInvalidArgument, DeviceCheck::kNullTable, 0, -1, b, 0);
        return -1;
      }
      const std::int32_t last = v.last_page_len[b];
      if (last < 1 || last > v.page_size) {
        if (report_hdr)
          report(st, StatusCode::kOutOfRange, DeviceCheck::kLastPageLen, last, -1, b, v.page_size);
        return -1;
      }
      const std::int64_t len = static_cast<std::int64_t>(n - 1) * v.page_size + last;
      if (len > 2147483647LL) {
        if (report_hdr) report(st, StatusCode::kOutOfRange, DeviceCheck::kSeqTooLong, len, -1, b, 0);
        return -1;
      }
    }
  } else {
    const std::int32_t len = v.seq_lens[b];
    if (len < 0) {
      if (report_hdr) report(st, StatusCode::kOutOfRange, DeviceCheck::kSeqLenNegative, len, -1, b, 0);
      return -1;
    }
    n = v.num_pages(b);
    if (n > v.row_stride) {
      if (report_hdr)
        report(st, StatusCode::kOutOfRange, DeviceCheck::kRowTooShort, n, -1, b, v.row_stride);
      return -1;
    }
    if (n > 0 && v.block_table == nullptr) {
      if (report_hdr) report(st, StatusCode::kInvalidArgument, DeviceCheck::kNullTable, 0, -1, b, 0);
      return -1;
    }
  }
  for (std::int64_t i = first; i < n; i += step) {
    const std::int32_t p = v.page_id(b, static_cast<std::int32_t>(i));
    if (p < 0 || p >= v.num_pages_total)
      report(st, StatusCode::kOutOfRange, DeviceCheck::kPageId, p, i, b, v.num_pages_total);
  }
  return n;
}

/// Host side: the table pointers a device check dereferences unconditionally.
template <class T>
Status check_table_ptrs(const PagedKVView<T>& v) {
  if (v.batch_size == 0) return Status::ok();
  if (v.table_kind == PageTableKind::kCsr)
    KVKIT_CHECK_STATUS(v.indptr != nullptr, StatusCode::kInvalidArgument, "CSR indptr is null");
  else
    KVKIT_CHECK_STATUS(v.seq_lens != nullptr, StatusCode::kInvalidArgument,
                       "block table seq_lens is null");
  return Status::ok();
}

/// Checks the page table of every sequence: block x takes sequences x, x + gridDim.x, ...
/// and its threads share each sequence's page ids.
template <class T>
__global__ void validate_page_table_kernel(PagedKVView<T> view, DeviceStatus* st) {
  if (failed(st)) return;
  for (std::int64_t b = blockIdx.x; b < view.batch_size; b += gridDim.x)
    (void)check_sequence_pages_dev(view, static_cast<std::int32_t>(b), st, threadIdx.x == 0,
                                   threadIdx.x, blockDim.x);
}

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

/// Largest power-of-two vector width in bytes (<= 16, >= sizeof(T)) dividing the K and
/// V rows (head_dim, v_head_dim), every view base and stride, and every extra pointer / element stride
/// given; vectorised accesses of that width stay aligned for every (page, token, head).
template <class T>
int view_vector_bytes(const PagedKVView<T>& view, std::initializer_list<const void*> ptrs = {},
                      std::initializer_list<std::int64_t> elem_strides = {}) {
  int bytes = 16;
  auto fits = [&](int w) {
    auto ok_stride = [&](std::int64_t s) {
      return (s * static_cast<std::int64_t>(sizeof(T))) % w == 0;
    };
    if (!ok_stride(view.head_dim) || !ok_stride(view.v_head_dim)) return false;
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
