#pragma once
// Helpers shared by kvkit's Google Benchmark programs (bench_kernels, bench_attention,
// bench_executor): the two clocks they time phases with, dtype names for benchmark names,
// and the main() that strips kvkit's own flags before Google Benchmark parses the rest.

#include <benchmark/benchmark.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "kvkit/core/dtype.hpp"
#include "read_floor.hpp"

namespace kvkit {
namespace bench {

/// Wall clock (steady_clock), seconds.
inline double wall_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
/// This thread's CPU time, seconds: time spent descheduled while other processes share
/// the cores is not charged (only meaningful for single-threaded timed code).
inline double thread_cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

/// "f32", "f16" or "bf16", for benchmark names.
template <class T>
const char* dtype_name() {
  if (std::is_same<T, float>::value) return "f32";
  if (std::is_same<T, half_t>::value) return "f16";
  return "bf16";
}

/// A benchmark program's main: removes kvkit's own boolean flags from argv (each listed
/// flag sets its bool), then calls `register_all` (after the flags, since they change the
/// shapes registered) and runs Google Benchmark on the rest. Returns main's exit code: 1
/// on an argument Google Benchmark does not know, when `failed` is set (a benchmark's
/// check failed) or when nothing ran (a bad filter), so the CTest smoke runs can fail.
template <class Register>
int run_main(int argc, char** argv, std::initializer_list<std::pair<const char*, bool*>> flags,
             const bool& failed, Register register_all) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    bool ours = false;
    for (const auto& f : flags)
      if (std::strcmp(argv[i], f.first) == 0) {
        *f.second = true;
        ours = true;
      }
    if (!ours) argv[out++] = argv[i];
  }
  argc = out;
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const std::size_t ran = benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return (failed || ran == 0) ? 1 : 0;
}

}  // namespace bench
}  // namespace kvkit
