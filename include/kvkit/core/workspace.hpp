#pragma once
// Two-phase scratch memory (as CUB): an operation first reports how many bytes it needs
// (`*_workspace_size(...)`), the caller allocates once, and `run` carves that buffer
// without allocating, so run paths are allocation-free and safe under graph capture.

#include <cstddef>
#include <cstdint>

#include "kvkit/core/error.hpp"

namespace kvkit {

/// A caller-owned scratch buffer handed to run paths.
struct Workspace {
  void* data = nullptr;  // [bytes], aligned to at least 16 bytes
  std::size_t bytes = 0;
};

/// Alignment every carved sub-buffer gets.
inline constexpr std::size_t kWorkspaceAlign = 256;

/// n rounded up to a multiple of a.
inline constexpr std::size_t align_up(std::size_t n, std::size_t a = kWorkspaceAlign) {
  return (n + a - 1) / a * a;
}

/// Accumulates the size of several sub-buffers (phase 1).
class WorkspaceSizer {
 public:
  template <class T>
  WorkspaceSizer& add(std::size_t count) {
    bytes_ += align_up(count * sizeof(T));
    return *this;
  }
  std::size_t bytes() const { return bytes_ + (bytes_ ? kWorkspaceAlign : 0); }

 private:
  std::size_t bytes_ = 0;
};

/// Hands out sub-buffers of a Workspace in the same order WorkspaceSizer added them
/// (phase 2). take() returns nullptr when the workspace is too small; callers turn that
/// into a Status.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(Workspace ws) : ws_(ws) {
    const auto base = reinterpret_cast<std::uintptr_t>(ws.data);
    offset_ = ws.data ? (align_up(base) - base) : 0;
  }
  template <class T>
  T* take(std::size_t count) {
    const std::size_t need = align_up(count * sizeof(T));
    if (ws_.data == nullptr || offset_ + need > ws_.bytes) return nullptr;
    T* p = reinterpret_cast<T*>(static_cast<unsigned char*>(ws_.data) + offset_);
    offset_ += need;
    return p;
  }

 private:
  Workspace ws_;
  std::size_t offset_ = 0;
};

}  // namespace kvkit
