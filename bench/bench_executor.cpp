// Google Benchmark: what running the CPU kernels' tasks costs, by executor.
//
// Each iteration runs the same call once per runner, in an order rotated every iteration
// (so machine noise hits all alike), timing each with the wall clock:
//   serial   exec::Host{1}: everything on the calling thread (the baseline)
//   builtin  exec::Host{T}: parallel_for starts and joins T-1 std::threads per call
//   pool     exec::Host{T, pool.executor()}: a kvkit::ThreadPool(T), default spin
//   pool0    the same with ThreadPool(T, /*spin=*/0): workers sleep at once when idle
// Benchmarks:
//   decode/B8/...     paged_decode_attention, one layer of a decode step at batch 8
//                     (Hq 32, Hkv 8, D 128, S tokens each, page 16, shuffled pages),
//                     rotating over layers so each is read from DRAM like a real step
//   decode_tiny/...   the same kernel on B1, S 16, Hq 4, Hkv 2, D 64 (overhead-bound)
//   write_kv/B8/...   write_kv of one token per sequence (a decode step's append)
//   parallel_for/...  an empty parallel_for body: the pure dispatch cost
// Reported time is the pool's; counters give every runner's microseconds per call and the
// ratios builtin/pool (pool speed-up over per-call threads), serial/pool and
// serial/builtin (speed-up over one thread). Outputs of all runners are compared bit for
// bit before timing; a mismatch fails the run.
//
// --kvkit_small shrinks the decode sizes for the CTest smoke run (timings meaningless).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvkit/core/thread_pool.hpp"
#include "bench_common.hpp"
#include "kvkit/kernels/cpu.hpp"

namespace {

bool g_small = false;
bool g_failed = false;

double now() { return kvkit::bench::wall_now(); }

/// The runners compared, in one process: built once per thread count.
struct Runners {
  explicit Runners(int threads)
      : pool(threads), pool0(threads, 0),
        ex{kvkit::exec::Host{1}, kvkit::exec::Host{threads},
           kvkit::exec::Host{threads, pool.executor()},
           kvkit::exec::Host{threads, pool0.executor()}} {}
  static constexpr int kCount = 4;
  static const char* name(int i) {
    static const char* const names[kCount] = {"serial", "builtin", "pool", "pool0"};
    return names[i];
  }
  kvkit::ThreadPool pool;
  kvkit::ThreadPool pool0;
  kvkit::exec::Host ex[kCount];
};

/// Runs call(ex) for every runner each iteration (rotated order) and reports.
/// call returns false on a kernel failure.
template <class Call>
void time_runners(benchmark::State& state, Runners& r, Call&& call) {
  double total[Runners::kCount] = {};
  std::int64_t iters = 0;
  for (auto _ : state) {
    double pool_time = 0;
    for (int j = 0; j < Runners::kCount; ++j) {
      const int i = static_cast<int>((j + iters) % Runners::kCount);
      const double t0 = now();
      if (!call(r.ex[i])) {
        g_failed = true;
        state.SkipWithError("kernel failed");
        return;
      }
      const double dt = now() - t0;
      total[i] += dt;
      if (i == 2) pool_time = dt;
    }
    state.SetIterationTime(pool_time);
    ++iters;
  }
  if (iters == 0) return;
  for (int i = 0; i < Runners::kCount; ++i)
    state.counters[std::string(Runners::name(i)) + "_us"] = total[i] / iters * 1e6;
  state.counters["builtin/pool"] = total[1] / total[2];
  state.counters["builtin/pool0"] = total[1] / total[3];
  state.counters["serial/pool"] = total[0] / total[2];
  state.counters["serial/builtin"] = total[0] / total[1];
}

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

/// One layer's paged pool: batch sequences of seq_len tokens on shuffled pages.
struct Layer {
  Layer(std::int32_t batch, std::int32_t seq_len, std::int32_t hkv, std::int32_t dim,
        std::int32_t page_size, std::uint64_t seed) {
    const std::int32_t per_seq = (seq_len + page_size - 1) / page_size;
    const kvkit::KVGeometry g{hkv, dim, page_size, batch * per_seq};
    const kvkit::KVStrides st = kvkit::packed_strides(g, kvkit::KVLayout::kNHD);
    k = random_floats(static_cast<std::size_t>(st.page) * g.num_pages, seed);
    v = random_floats(k.size(), seed + 1);
    indices.resize(static_cast<std::size_t>(g.num_pages));
    std::iota(indices.begin(), indices.end(), 0);
    std::shuffle(indices.begin(), indices.end(), std::mt19937_64(seed + 2));
    for (std::int32_t b = 0; b <= batch; ++b) indptr.push_back(b * per_seq);
    last_page_len.assign(static_cast<std::size_t>(batch), seq_len - (per_seq - 1) * page_size);
    view = kvkit::make_csr_view(g, k.data(), st, v.data(), st,
                                kvkit::CsrPageTable{indptr.data(), indices.data(),
                                                    last_page_len.data(), batch});
  }
  std::vector<float> k, v;
  std::vector<std::int32_t> indptr, indices, last_page_len;
  kvkit::PagedKVView<float> view;
};

void bench_decode(benchmark::State& state, std::int32_t batch, std::int32_t seq_len,
                  std::int32_t hq, std::int32_t hkv, std::int32_t dim, int threads,
                  int layers) {
  if (g_small) {
    seq_len = std::min(seq_len, 64);
    layers = 1;
  }
  Runners r(threads);
  std::vector<std::unique_ptr<Layer>> pool_layers;
  for (int l = 0; l < layers; ++l)
    pool_layers.push_back(std::make_unique<Layer>(batch, seq_len, hkv, dim, 16, 1000 + 7 * l));
  const std::vector<float> q = random_floats(static_cast<std::size_t>(batch) * hq * dim, 7);
  const kvkit::DecodeAttentionParams p{hq, 1.f / std::sqrt(static_cast<float>(dim))};
  std::size_t ws_bytes = 0;
  for (const kvkit::exec::Host& ex : r.ex)
    ws_bytes = std::max(ws_bytes,
                        kvkit::paged_decode_attention_workspace_size(ex, pool_layers[0]->view, p));
  std::vector<unsigned char> ws(ws_bytes + 1);
  std::vector<float> out(q.size());

  // Bitwise identical outputs whatever runs the tasks.
  std::vector<float> first;
  for (const kvkit::exec::Host& ex : r.ex) {
    const kvkit::Status s = kvkit::paged_decode_attention(
        ex, pool_layers[0]->view, q.data(), out.data(), p, kvkit::Workspace{ws.data(), ws.size()});
    if (!s) {
      g_failed = true;
      state.SkipWithError(s.to_string().c_str());
      return;
    }
    if (first.empty()) first = out;
    if (std::memcmp(first.data(), out.data(), out.size() * sizeof(float)) != 0) {
      g_failed = true;
      state.SkipWithError("outputs differ between executors");
      return;
    }
  }
  std::size_t layer = 0;
  time_runners(state, r, [&](kvkit::exec::Host ex) {
    const Layer& l = *pool_layers[layer++ % pool_layers.size()];
    return kvkit::paged_decode_attention(ex, l.view, q.data(), out.data(), p,
                                         kvkit::Workspace{ws.data(), ws.size()})
        .is_ok();
  });
  state.counters["threads"] = threads;
}

void bench_write_kv(benchmark::State& state, int threads) {
  const std::int32_t batch = 8, hkv = 8, dim = 128;
  Runners r(threads);
  Layer l(batch, g_small ? 64 : 1024, hkv, dim, 16, 99);
  const std::vector<float> k_new = random_floats(static_cast<std::size_t>(batch) * hkv * dim, 5);
  const std::vector<float> v_new = random_floats(k_new.size(), 6);
  std::vector<std::int64_t> slots;
  for (std::int32_t b = 0; b < batch; ++b)  // the last slot of each sequence
    slots.push_back(static_cast<std::int64_t>(l.indices[static_cast<std::size_t>(l.indptr[b + 1] - 1)]) * 16 +
                    l.last_page_len[static_cast<std::size_t>(b)] - 1);
  time_runners(state, r, [&](kvkit::exec::Host ex) {
    return kvkit::write_kv(ex, l.view, k_new.data(), v_new.data(), slots.data(), batch, hkv * dim)
        .is_ok();
  });
  state.counters["threads"] = threads;
}

void bench_parallel_for(benchmark::State& state, int threads) {
  Runners r(threads);
  std::int64_t sink = 0;
  time_runners(state, r, [&](kvkit::exec::Host ex) {
    kvkit::detail::parallel_for(ex, threads, [&](std::int64_t b, std::int64_t, int) {
      benchmark::DoNotOptimize(b);
    });
    benchmark::DoNotOptimize(sink);
    return true;
  });
  state.counters["threads"] = threads;
}

void register_all() {
  for (int threads : {2, 4}) {
    const std::string t = "/T" + std::to_string(threads);
    benchmark::RegisterBenchmark(("decode/B8/S1024/f32" + t).c_str(),
                                 [=](benchmark::State& s) {
                                   bench_decode(s, 8, 1024, 32, 8, 128, threads, 4);
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("decode_tiny/B1/S16/f32" + t).c_str(),
                                 [=](benchmark::State& s) {
                                   bench_decode(s, 1, 16, 4, 2, 64, threads, 1);
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("write_kv/B8/f32" + t).c_str(),
                                 [=](benchmark::State& s) { bench_write_kv(s, threads); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("parallel_for/empty" + t).c_str(),
                                 [=](benchmark::State& s) { bench_parallel_for(s, threads); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return kvkit::bench::run_main(argc, argv, {{"--kvkit_small", &g_small}}, g_failed, register_all);
}
