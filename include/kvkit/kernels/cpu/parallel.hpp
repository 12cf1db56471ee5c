#pragma once
// A minimal static parallel_for for the CPU kernels, and the small memory helpers they
// share (software prefetch, incremental page lookup, head chunking).
//
// Work items [0, n) are cut into at most `threads` contiguous chunks (tasks), one per
// worker; the chunking depends only on ex.threads and n. When ex.executor is set, the
// engine's executor runs the tasks (e.g. kvkit::ThreadPool); otherwise worker 0 runs on
// the calling thread and the others on std::threads started and joined per call. Every
// item is computed by the same code whatever the chunking or executor, so results are
// bitwise identical for any thread count. Chunk bodies must not throw (kernels validate
// everything before they start). If the OS refuses a thread, its chunk runs on the calling
// thread instead, so a run path never throws from here; built without exceptions
// (-fno-exceptions) a refused thread cannot be caught and the standard library aborts, so
// such builds that must survive thread exhaustion should pass an executor.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <type_traits>

#include "kvkit/core/error.hpp"
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
/// [0, host_workers(ex, n)) and each worker index gets exactly one chunk (so per-worker
/// scratch indexed by it is never shared). threads <= 1 (or n <= 1) runs inline.
template <class Body>
void parallel_for(exec::Host ex, std::int64_t n, Body&& body) {
  if (n <= 0) return;
  const int workers = host_workers(ex, n);
  if (workers == 1) {
    body(std::int64_t{0}, n, 0);
    return;
  }
  if (ex.executor) {
    // The executor sees only a function pointer and an opaque argument: this frame.
    struct Job {
      std::remove_reference_t<Body>* body;
      std::int64_t n;
      int workers;
    } job{&body, n, workers};
    ex.executor.run(ex.executor.ctx, workers, [](void* arg, int w) {
      const Job& j = *static_cast<const Job*>(arg);
      (*j.body)(j.n * w / j.workers, j.n * (w + 1) / j.workers, w);
    }, &job);
    return;
  }
  auto chunk_begin = [&](int w) { return n * w / workers; };
  std::array<std::thread, kMaxHostThreads> pool;
  for (int w = 1; w < workers; ++w) {
    const std::int64_t b = chunk_begin(w), e = chunk_begin(w + 1);
#if KVKIT_HAS_EXCEPTIONS
    try {
      pool[static_cast<std::size_t>(w)] = std::thread([&body, b, e, w] { body(b, e, w); });
    } catch (...) {
      body(b, e, w);  // no thread available: run this chunk here
    }
#else
    pool[static_cast<std::size_t>(w)] = std::thread([&body, b, e, w] { body(b, e, w); });
#endif
  }
  body(std::int64_t{0}, chunk_begin(1), 0);
  for (int w = 1; w < workers; ++w)
    if (pool[static_cast<std::size_t>(w)].joinable()) pool[static_cast<std::size_t>(w)].join();
}

/// Hints the cache to load [p, p + bytes) (one prefetch per 64-byte line). Used where
/// rows are scattered over pages and the hardware prefetchers cannot follow.
inline void prefetch_bytes(const void* p,  // [bytes]
                           std::size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (std::size_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
#else
  (void)p;
  (void)bytes;
#endif
}

/// Hints the cache to load the line at p into L2, not L1: an L1 prefetch holds one of the
/// core's few L1 miss buffers until its line arrives (kernels/cpu/attention.hpp).
inline void prefetch_line_l2(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);  // x86: prefetcht1
#else
  (void)p;
#endif
}

/// Incremental page lookup within one sequence: maps a token to (page id, slot) with a
/// division and a page-table load only when the token leaves the page of the previous
/// lookup, so walks over nearby tokens cost an add and a compare per row.
struct PageCursor {
  std::int32_t first = 0;  // first token of the current page
  std::int32_t size = 0;   // tokens in the current page's span (0: nothing looked up yet)
  std::int32_t page = 0;   // physical page id of the current page
  std::int32_t slot = 0;   // slot of the last token looked up

  /// Points the cursor at token t of sequence b of view v.
  template <class View>
  void seek(const View& v, std::int32_t b, std::int32_t t) {
    if (t < first || t - first >= size) {
      const std::int32_t pi = t / v.page_size;
      first = pi * v.page_size;
      size = v.page_size;
      page = v.page_id(b, pi);
    }
    slot = t - first;
  }
};

/// Splits the kv heads of each sequence into chunks of equal size (a divisor of num_heads)
/// so that batch * chunks >= the workers of ex where possible. Kernels that read all heads
/// of a token together (NHD) use whole-head chunks; results never depend on the chunking.
inline std::int32_t heads_per_item(exec::Host ex, std::int32_t batch, std::int32_t num_heads,
                                   std::int32_t max_heads) {
  std::int32_t hpi = num_heads;
  const std::int64_t workers = host_workers(ex, kMaxHostThreads);
  while (hpi > 1 &&
         (hpi > max_heads || static_cast<std::int64_t>(batch) * (num_heads / hpi) < workers)) {
    std::int32_t next = hpi - 1;
    while (num_heads % next != 0) --next;
    hpi = next;
  }
  return hpi;
}

}  // namespace detail
}  // namespace kvkit
