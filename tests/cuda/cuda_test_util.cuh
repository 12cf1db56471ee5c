#pragma once
// Helpers shared by the CUDA tests: GPU detection (the "skipped: no GPU" rule), error
// macros, an owning device array and a blocking stream carrying its own DeviceStatus.
#include <kvkit/cuda.cuh>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvkit {
namespace test {

inline bool gpu_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return false;
  }
  return n > 0;
}

#define KVKIT_REQUIRE_GPU()          \
  do {                               \
    if (!::kvkit::test::gpu_present()) { \
      WARN("skipped: no GPU");       \
      return;                        \
    }                                \
  } while (0)

#define KVKIT_CUDA_REQUIRE(expr)                                               \
  do {                                                                         \
    const cudaError_t kvkit_err_ = (expr);                                     \
    if (kvkit_err_ != cudaSuccess) FAIL(#expr << ": " << cudaGetErrorString(kvkit_err_)); \
  } while (0)

#define KVKIT_REQUIRE_OK(expr)                 \
  do {                                         \
    const ::kvkit::Status kvkit_st_ = (expr);  \
    INFO(#expr << " -> " << kvkit_st_.to_string()); \
    REQUIRE(kvkit_st_.is_ok());                \
  } while (0)

/// Owning device array (cudaMalloc / cudaFree); size 0 still gets a valid pointer.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    KVKIT_CUDA_REQUIRE(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == n_);
    if (n_ > 0) KVKIT_CUDA_REQUIRE(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0) KVKIT_CUDA_REQUIRE(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// A blocking stream (so it orders after the synchronous cudaMemcpy uploads) with its
/// own zeroed DeviceStatus; exec() carries both.
class Stream {
 public:
  Stream() {
    KVKIT_CUDA_REQUIRE(cudaStreamCreate(&s_));
    KVKIT_CUDA_REQUIRE(cudaMalloc(&status_, sizeof(DeviceStatus)));
    KVKIT_CUDA_REQUIRE(cudaMemset(status_, 0, sizeof(DeviceStatus)));
  }
  ~Stream() {
    if (status_ != nullptr) (void)cudaFree(status_);
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  exec::Cuda exec() const { return exec::Cuda{s_, status_}; }
  cudaStream_t get() const { return s_; }
  /// Waits for the stream and surfaces kernel faults.
  void sync() const { KVKIT_CUDA_REQUIRE(cudaStreamSynchronize(s_)); }
  /// Synchronises, then reads the device status.
  Status status() const {
    sync();
    return read_device_status(status_);
  }
  /// Clears the device status (on the stream) and waits.
  void reset() const {
    KVKIT_REQUIRE_OK(reset_device_status(exec()));
    sync();
  }

 private:
  cudaStream_t s_ = nullptr;
  DeviceStatus* status_ = nullptr;
};

}  // namespace test
}  // namespace kvkit
