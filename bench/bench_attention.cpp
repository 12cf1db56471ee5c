// Google Benchmark: CPU paged_decode_attention against the machine's memory floor.
//
//   attn/<dtype>/<layout>/B<batch>/S<seq>/T<threads>
//   attn/bf16dot/...   bfloat16 KV with DecodeAttentionParams::bf16_dot (opt-in scores
//                      from bf16 products; vdpbf16ps where the build has AVX512_BF16)
//
// Hq 32, Hkv 8, head_dim 128, page 16, pages shuffled over the pool (as an engine's
// allocator leaves them). Each iteration times, interleaved (order alternating), the
// kernel on one "layer" and the floor on another: a vectorised read (integer sum) of
// exactly as many KV bytes as the kernel reads, with the same thread count and the same
// parallel_for. Layers rotate over 160 MiB and at least twice the last-level cache
// (dram_rotation_bytes: 520 MiB on a 260 MiB-L3 Xeon) so both always read from DRAM.
// Counters:
//   GBps        KV bytes the kernel reads / kernel time
//   floor_GBps  the same bytes / floor time
//   vs_floor    GBps / floor_GBps (1.0 = the kernel reads KV as fast as a plain sum)
//   tok_per_s   decoded tokens (batch) per second of kernel time
//   simd        1 portable, 2 NEON, 3 AVX2, 4 AVX-512 (the compiled path)
//   bf16_dot    1 when the row's bf16_dot runs on vdpbf16ps, 0 otherwise
// Timing: 1-thread runs use the thread's CPU time (time descheduled while other processes
// share the cores is not charged; --kvkit_wall switches to the wall clock); runs with more
// threads use the wall clock (steady_clock), so they suffer from a busy machine.
// --kvkit_small shrinks the shapes so the CTest smoke run takes seconds (timings mean
// nothing there). Before timing, each fixture checks the kernel's output on a few rows
// against a float64 reference and fails the run on a mismatch.

#include <benchmark/benchmark.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "read_floor.hpp"
#include "kvkit/kernels/cpu.hpp"

namespace {

using kvkit::bfloat16_t;
using kvkit::half_t;
using kvkit::KVLayout;
using kvkit::PagedKVView;

constexpr std::int32_t kHq = 32, kHkv = 8, kDim = 128, kPage = 16;
constexpr std::size_t kMiB = std::size_t{1} << 20;

bool g_small = false;
bool g_failed = false;
bool g_hugepages = false;  // --kvkit_hugepages: madvise(MADV_HUGEPAGE) the pools

bool g_wall = false;  // --kvkit_wall: wall clock for 1-thread runs too

using kvkit::bench::dtype_name;
using kvkit::bench::thread_cpu_now;
using kvkit::bench::wall_now;

int simd_code() {
  const std::string isa = kvkit::detail::cpu::simd_isa();
  return isa == "avx512" ? 4 : isa == "avx2" ? 3 : isa == "neon" ? 2 : 1;
}

/// 64-byte aligned heap array.
template <class T>
struct Buf {
  explicit Buf(std::size_t n = 0) : n(n) {
    const std::size_t bytes = std::max<std::size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
    const std::size_t align = bytes >= (2u << 20) ? (2u << 20) : 64;
    p.reset(static_cast<T*>(std::aligned_alloc(align, (bytes + align - 1) / align * align)));
    if (g_hugepages && align > 64) (void)madvise(p.get(), bytes, MADV_HUGEPAGE);
  }
  T* data() const { return p.get(); }
  struct Free {
    void operator()(T* x) const { std::free(x); }
  };
  std::unique_ptr<T, Free> p;
  std::size_t n;
};

struct Layer {
  std::size_t elems = 0;  // per pool
  Buf<unsigned char> k, v;
};

template <class T>
struct Fixture {
  std::int32_t batch = 0, seq = 0;
  KVLayout layout = KVLayout::kNHD;
  std::vector<Layer> layers;
  std::vector<std::int32_t> indptr, indices, last_page_len;
  std::vector<PagedKVView<T>> views;
  std::vector<T> q, out;
  std::vector<unsigned char> ws;
  kvkit::DecodeAttentionParams params;
  std::size_t kv_bytes = 0;  // K + V bytes one call reads
  std::string error;
};

std::string g_key;
std::shared_ptr<void> g_fixture;

template <class T>
std::unique_ptr<Fixture<T>> make_fixture(std::int32_t batch, std::int32_t seq, KVLayout layout,
                                         bool bf16_dot) {
  auto f = std::make_unique<Fixture<T>>();
  f->batch = batch;
  f->seq = seq;
  f->layout = layout;
  const std::int32_t per_seq = (seq + kPage - 1) / kPage, pages = batch * per_seq;
  const kvkit::KVGeometry g{kHkv, kDim, kPage, pages};
  const kvkit::KVStrides s = kvkit::packed_strides(g, layout);
  const std::size_t elems = static_cast<std::size_t>(pages) * kPage * kHkv * kDim;
  f->kv_bytes = 2 * elems * sizeof(T);
  const std::size_t rotation = g_small ? 0 : kvkit::bench::dram_rotation_bytes(160 * kMiB);
  const std::size_t nlayers = std::max<std::size_t>(2, (rotation + f->kv_bytes - 1) / f->kv_bytes);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(1234);
  std::shuffle(ids.begin(), ids.end(), rng);
  f->indptr.push_back(0);
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t i = 0; i < per_seq; ++i) f->indices.push_back(ids[static_cast<std::size_t>(b * per_seq + i)]);
    f->indptr.push_back(f->indptr.back() + per_seq);
    f->last_page_len.push_back(seq - (per_seq - 1) * kPage);
  }
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (std::size_t l = 0; l < nlayers; ++l) {
    Layer layer;
    layer.elems = elems;
    layer.k = Buf<unsigned char>(elems * sizeof(T));
    layer.v = Buf<unsigned char>(elems * sizeof(T));
    T* k = reinterpret_cast<T*>(layer.k.data());
    T* v = reinterpret_cast<T*>(layer.v.data());
    std::uint64_t x = rng();
    auto next = [&x] {  // xorshift: fast enough for a GiB of data, uniform in [-1, 1)
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return static_cast<float>(x >> 40) * (2.f / 16777216.f) - 1.f;
    };
    for (std::size_t i = 0; i < elems; ++i) {
      k[i] = T(next());
      v[i] = T(next());
    }
    f->views.push_back(kvkit::make_csr_view<T>(
        g, k, s, v, s,
        kvkit::CsrPageTable{f->indptr.data(), f->indices.data(), f->last_page_len.data(), batch}));
    f->layers.push_back(std::move(layer));
  }
  f->q.resize(static_cast<std::size_t>(batch) * kHq * kDim);
  for (T& x : f->q) x = T(2.f * u(rng));
  f->out.resize(f->q.size());
  f->params.num_qo_heads = kHq;
  f->params.sm_scale = 1.f / std::sqrt(static_cast<float>(kDim));
  f->params.bf16_dot = bf16_dot;
  f->ws.resize(std::max<std::size_t>(
      1, kvkit::paged_decode_attention_workspace_size(kvkit::exec::Host{2}, f->views[0], f->params)));

  // Correctness on layer 0: a few rows against float64.
  const kvkit::Status st =
      kvkit::paged_decode_attention(kvkit::exec::Host{1}, f->views[0], f->q.data(), f->out.data(),
                                    f->params, kvkit::Workspace{f->ws.data(), f->ws.size()});
  if (!st.is_ok()) {
    f->error = st.to_string();
    return f;
  }
  const PagedKVView<T>& view = f->views[0];
  for (std::int32_t b : {0, batch - 1})
    for (std::int32_t hq : {0, kHq - 1}) {
      const std::int32_t h = hq / (kHq / kHkv);
      const T* qr = f->q.data() + (static_cast<std::size_t>(b) * kHq + hq) * kDim;
      std::vector<double> logit(static_cast<std::size_t>(seq)), o(kDim, 0.0);
      double mx = -1e300, sum = 0;
      for (std::int32_t t = 0; t < seq; ++t) {
        double d = 0;
        for (std::int32_t c = 0; c < kDim; ++c)
          d += static_cast<double>(kvkit::to_float(qr[c])) * kvkit::to_float(view.k_ptr(b, t, h)[c]);
        logit[static_cast<std::size_t>(t)] = d * f->params.sm_scale;
        mx = std::max(mx, logit[static_cast<std::size_t>(t)]);
      }
      for (double& l : logit) sum += (l = std::exp(l - mx));
      for (std::int32_t t = 0; t < seq; ++t)
        for (std::int32_t c = 0; c < kDim; ++c)
          o[static_cast<std::size_t>(c)] += logit[static_cast<std::size_t>(t)] / sum * kvkit::to_float(view.v_ptr(b, t, h)[c]);
      const T* got = f->out.data() + (static_cast<std::size_t>(b) * kHq + hq) * kDim;
      const double tol = sizeof(T) == 4 ? 1e-4 : 1e-2;
      for (std::int32_t c = 0; c < kDim; ++c)
        if (std::abs(kvkit::to_float(got[c]) - o[static_cast<std::size_t>(c)]) > tol * (1 + std::abs(o[static_cast<std::size_t>(c)]))) {
          f->error = "output differs from the float64 reference at b=" + std::to_string(b) +
                     " hq=" + std::to_string(hq) + " c=" + std::to_string(c);
          return f;
        }
    }
  return f;
}

/// The floor: sums every 8-byte word of the layer's K and V pools (the bytes the kernel
/// reads) with `threads` workers of the same parallel_for (sum_words, read_floor.hpp).
std::uint64_t floor_read(kvkit::exec::Host ex, const Layer& layer, std::size_t bytes_per_pool) {
  const std::size_t words = bytes_per_pool / 8;
  const std::int64_t tasks = 64;
  std::uint64_t partial[64] = {};
  kvkit::detail::parallel_for(ex, tasks, [&](std::int64_t tb, std::int64_t te, int) {
    for (std::int64_t t = tb; t < te; ++t) {
      const std::size_t w0 = words * static_cast<std::size_t>(t) / tasks;
      const std::size_t w1 = words * static_cast<std::size_t>(t + 1) / tasks;
      std::uint64_t s = 0;
      for (const unsigned char* base : {layer.k.data(), layer.v.data()})
        s += kvkit::bench::sum_words(reinterpret_cast<const std::uint64_t*>(base), w0, w1);
      partial[t] = s;
    }
  });
  std::uint64_t s = 0;
  for (std::uint64_t x : partial) s += x;
  return s;
}

template <class T>
void bm_attention(benchmark::State& state, std::int32_t batch, std::int32_t seq, KVLayout layout,
                  int threads, bool bf16_dot) {
  const std::string key = std::string(dtype_name<T>()) + (bf16_dot ? "dot" : "") + kvkit::to_string(layout) +
                          std::to_string(batch) + "/" + std::to_string(seq);
  if (g_key != key) {
    g_fixture.reset();
    g_fixture = std::shared_ptr<Fixture<T>>(make_fixture<T>(batch, seq, layout, bf16_dot).release());
    g_key = key;
  }
  Fixture<T>& f = *static_cast<Fixture<T>*>(g_fixture.get());
  if (!f.error.empty()) {
    g_failed = true;
    state.SkipWithError(f.error.c_str());
    return;
  }
  const kvkit::exec::Host ex{threads};
  double (*now)() = threads == 1 && !g_wall ? thread_cpu_now : wall_now;
  const kvkit::Workspace ws{f.ws.data(), f.ws.size()};
  const std::size_t nl = f.layers.size();
  double t_kernel = 0, t_floor = 0;
  std::int64_t it = 0;
  bool ok = true;
  std::uint64_t sink = 0;
  for (auto _ : state) {
    const std::size_t lk = static_cast<std::size_t>(it) % nl, lf = (lk + nl / 2) % nl;
    for (int j = 0; j < 2; ++j) {
      const double t0 = now();
      if ((j + it) % 2 == 0) {
        ok &= kvkit::paged_decode_attention(ex, f.views[lk], f.q.data(), f.out.data(), f.params, ws).is_ok();
        benchmark::ClobberMemory();
        const double dt = now() - t0;
        t_kernel += dt;
        state.SetIterationTime(dt);
      } else {
        sink += floor_read(ex, f.layers[lf], f.kv_bytes / 2);
        benchmark::DoNotOptimize(sink);
        t_floor += now() - t0;
      }
    }
    ++it;
  }
  if (!ok) {
    g_failed = true;
    state.SkipWithError("paged_decode_attention returned an error");
    return;
  }
  const double bytes = static_cast<double>(f.kv_bytes) * static_cast<double>(it);
  state.counters["GBps"] = bytes / t_kernel * 1e-9;
  state.counters["floor_GBps"] = bytes / t_floor * 1e-9;
  state.counters["vs_floor"] = t_floor / t_kernel;
  state.counters["tok_per_s"] = static_cast<double>(f.batch) * static_cast<double>(it) / t_kernel;
  state.counters["simd"] = simd_code();
#if defined(KVKIT_SIMD_AVX512BF16)
  state.counters["bf16_dot"] = bf16_dot ? 1 : 0;
#else
  state.counters["bf16_dot"] = 0;
#endif
}

template <class T>
void register_all(bool bf16_dot = false) {
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t batch : {1, 8})
      for (std::int32_t seq : {1024, 8192})
        for (int threads : {1, 2}) {
          const std::int32_t s = g_small ? seq / 32 : seq;
          const std::string name = std::string("attn/") + dtype_name<T>() + (bf16_dot ? "dot" : "") + "/" +
                                   kvkit::to_string(layout) +
                                   "/B" + std::to_string(batch) + "/S" + std::to_string(seq) + "/T" +
                                   std::to_string(threads);
          benchmark::RegisterBenchmark(name.c_str(), bm_attention<T>, batch, s, layout, threads,
                                       bf16_dot)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        }
}

}  // namespace

int main(int argc, char** argv) {
  return kvkit::bench::run_main(
      argc, argv,
      {{"--kvkit_small", &g_small}, {"--kvkit_hugepages", &g_hugepages}, {"--kvkit_wall", &g_wall}},
      g_failed, [] {
        register_all<float>();
        register_all<half_t>();
        register_all<bfloat16_t>();
        register_all<bfloat16_t>(/*bf16_dot=*/true);
      });
}
