#pragma once
// A minimal static parallel_for for the CPU kernels.
//
// Work items [0, n) are cut into at most `threads` contiguous chunks, one per worker;
// worker 0 runs on the calling thread. Every item is computed by the same code whatever
// the chunking, so results are bitwise identical for any thread count. Chunk bodies must
// not throw (kernels validate everything before they start). If the OS refuses a thread,
// its chunk runs on the calling thread instead, so a run path never throws from here.

#include <algorithm>
#include <array>
#include <cstdint>
#include <thread>

#include "kvkit/core/exec.hpp"

namespace kvkit {
namespace detail {

/// Upper bound on workers one call uses (bounds the fixed-size thread array below).
inline constexpr int kMaxHostThreads = 64;

/// Number of workers parallel_for uses for `n` items under `ex` (>= 1).
inline int host_workers(exec::Host ex, std::int64_t n) {
  const std::int64_t t = std::min<std::int64_t>(std::max(ex.threads, 1), kMaxHostThreads);
  return static_cast<int>(std::max<std::int64_t>(1, std::min(t, n)));
}

/// Calls body(begin, end, worker) for disjoint chunks covering [0, n); worker is in
/// [0, host_workers(ex, n)). threads <= 1 (or n <= 1) runs inline.
template <class Body>
void parallel_for(exec::Host ex, std::int64_t n, Body&& body) {
  if (n <= 0) return;
  const int workers = host_workers(ex, n);
  if (workers == 1) {
    body(std::int64_t{0}, n, 0);
    return;
  }
  auto chunk_begin = [&](int w) { return n * w / workers; };
  std::array<std::thread, kMaxHostThreads> pool;
  for (int w = 1; w < workers; ++w) {
    const std::int64_t b = chunk_begin(w), e = chunk_begin(w + 1);
    try {
      pool[static_cast<std::size_t>(w)] = std::thread([&body, b, e, w] { body(b, e, w); });
    } catch (...) {
      body(b, e, w);  // no thread available: run this chunk here
    }
  }
  body(std::int64_t{0}, chunk_begin(1), 0);
  for (int w = 1; w < workers; ++w)
    if (pool[static_cast<std::size_t>(w)].joinable()) pool[static_cast<std::size_t>(w)].join();
}

}  // namespace detail
}  // namespace kvkit
