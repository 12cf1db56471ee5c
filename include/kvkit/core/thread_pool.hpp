#pragma once
// A small persistent thread pool an engine can hand to the CPU kernels as their executor
// (exec::Host{threads, pool.executor()}), so a decode step does not start and join
// std::threads on every kernel call. Engines with their own pool can instead wrap it in an
// exec::HostExecutor directly; this one is the ready default.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"

namespace kvkit {

/// Persistent workers for exec::HostExecutor. `ThreadPool pool(4)` starts 3 workers; the
/// thread calling run() is the fourth. run(num_tasks, task, arg) calls task(arg, i) once
/// for each i in [0, num_tasks) and returns when all returned; indices are handed out one
/// at a time, so the calling thread and the workers balance uneven tasks. A run costs no
/// allocation and no thread start: a job is published through members, and idle workers
/// spin for `spin` polls before sleeping on a condition variable (0: sleep at once, the
/// right choice when cores are oversubscribed). Calls from several threads are serialised;
/// a run() issued from inside one of this pool's tasks runs its tasks inline (no deadlock).
/// Tasks must not throw. Construction starts threads and may throw (std::system_error)
/// like std::thread; if the OS refuses a thread the pool keeps the workers it got (built
/// without exceptions, the standard library aborts instead). Not copyable or movable:
/// executors hold its address.
class ThreadPool {
 public:
  /// Polls an idle worker or a waiting caller makes before blocking (a few microseconds).
  static constexpr int kDefaultSpin = 2048;

  explicit ThreadPool(int threads, int spin = kDefaultSpin) : spin_(spin < 0 ? 0 : spin) {
    KVKIT_CHECK(threads >= 1, "ThreadPool threads must be >= 1, got ", threads);
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int i = 1; i < threads; ++i) {
#if KVKIT_HAS_EXCEPTIONS
      try {
        workers_.emplace_back([this] { worker_loop(); });
      } catch (...) {
        break;  // keep the workers we got: results never depend on the thread count
      }
#else
      workers_.emplace_back([this] { worker_loop(); });
#endif
    }
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  /// Threads that run tasks: the workers plus the calling thread.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// A non-owning executor for exec::Host; valid while this pool lives.
  exec::HostExecutor executor() { return exec::HostExecutor{&ThreadPool::run_tasks, this}; }

  /// exec::Host splitting work into size() tasks, run by this pool.
  exec::Host host() { return exec::Host{size(), executor()}; }

  /// Runs task(arg, i) for every i in [0, num_tasks) on the pool and the calling thread;
  /// returns when all have returned. Allocation-free.
  void run(int num_tasks, exec::HostTask task, void* arg) {
    if (num_tasks <= 0) return;
    if (num_tasks == 1 || workers_.empty() || current() == this) {
      // Serial: one task, no workers, or nested inside this pool's own task.
      for (int i = 0; i < num_tasks; ++i) task(arg, i);
      return;
    }
    std::lock_guard<std::mutex> submit(submit_mutex_);
    std::uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = task;
      arg_ = arg;
      num_tasks_ = num_tasks;
      pending_.store(num_tasks, std::memory_order_relaxed);
      gen = (generation_ >> 32) + 1;
      generation_ = gen << 32;  // new job, next index 0
      claim_.store(generation_, std::memory_order_release);
      published_.store(gen, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    work(gen, task, arg, num_tasks);
    // Wait for tasks other threads claimed: spin, then sleep.
    for (int i = 0; i < spin_ && pending_.load(std::memory_order_acquire) != 0; ++i) relax();
    if (pending_.load(std::memory_order_acquire) != 0) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
  }

 private:
  static void run_tasks(void* ctx, int num_tasks, exec::HostTask task, void* arg) {
    static_cast<ThreadPool*>(ctx)->run(num_tasks, task, arg);
  }

  /// The pool whose tasks this thread is running now (nullptr outside any).
  static const ThreadPool*& current() {
    static thread_local const ThreadPool* pool = nullptr;
    return pool;
  }

  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#else
    std::this_thread::yield();
#endif
  }

  /// Claims and runs indices of job `gen` until none is left. claim_ holds (job << 32 |
  /// next index), so a thread holding a stale job never takes an index of a newer one.
  void work(std::uint64_t gen, exec::HostTask task, void* arg, int num_tasks) {
    const ThreadPool* outer = current();
    current() = this;
    std::uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      if ((c >> 32) != gen) break;
      const int index = static_cast<int>(c & 0xffffffffu);
      if (index >= num_tasks) break;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      task(arg, index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);  // the caller may be about to sleep
        done_.notify_one();
      }
      c = claim_.load(std::memory_order_acquire);
    }
    current() = outer;
  }

  void worker_loop() {
    std::uint64_t seen = 0;
    for (;;) {
      for (int i = 0; i < spin_ && published_.load(std::memory_order_acquire) == seen; ++i)
        relax();
      exec::HostTask task;
      void* arg;
      int num_tasks;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if ((generation_ >> 32) == seen && !stop_) {
          sleeping_.fetch_add(1, std::memory_order_acq_rel);
          wake_.wait(lock, [&] { return stop_ || (generation_ >> 32) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        }
        if (stop_) return;
        seen = generation_ >> 32;
        task = task_;
        arg = arg_;
        num_tasks = num_tasks_;
      }
      work(seen, task, arg, num_tasks);
    }
  }

  const int spin_;
  std::vector<std::thread> workers_;
  std::mutex submit_mutex_;  // one job at a time
  std::mutex mutex_;         // guards the job fields, generation_ and stop_
  std::condition_variable wake_;
  std::condition_variable done_;
  exec::HostTask task_ = nullptr;
  void* arg_ = nullptr;
  int num_tasks_ = 0;
  std::uint64_t generation_ = 0;  // job number << 32, written under mutex_
  bool stop_ = false;
  std::atomic<std::uint64_t> claim_{0};      // job number << 32 | next index
  std::atomic<std::uint64_t> published_{0};  // job number, for spinning workers
  std::atomic<int> pending_{0};              // tasks of the current job not yet finished
  std::atomic<int> sleeping_{0};             // workers blocked in wake_
};

}  // namespace kvkit
