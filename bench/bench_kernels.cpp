// Google Benchmark benchmarks for kvkit's core CPU kernels.
//
// Every benchmark times its baseline in the same iteration as the kvkit kernel (manual
// timing, baselines and kernel interleaved, order rotated each iteration), so machine
// noise hits both alike and the reported ratios come from one process:
//   decode/...       paged_decode_attention on a shuffled page pool vs a dense decode
//                    attention over contiguous [Hkv, S, D] K/V written here (online
//                    softmax, float accumulation), and vs the kvkit kernel on a
//                    "contiguous" view (one page per sequence, page_size = S).
//   compact_asc/...  compact_tokens, strictly ascending keep lists (in-place fast path)
//   compact_perm/... compact_tokens, keep lists in arbitrary order (staged path)
//   compact_r1kv/... compact_tokens, R1KV-shaped ascending lists (S - S/32 kept per head)
//   gather/...       gather_tokens of an ascending half of each sequence
//   copy_pages/...   copy_pages of half the pool onto the other half
//   write_kv/...     write_kv of prefill-sized chunks into shuffled pages
//   convert/...      write_kv from float rows into a half / bfloat16 pool and gather_tokens
//                    from it into float outputs (converting copies, simd.hpp's convert)
//                    vs the same through a scalar from_float / to_float loop and a
//                    same-dtype kernel (what a caller did before the converting overloads)
// The data-movement benchmarks compare with one memcpy of the same number of bytes (the
// moved tokens' K+V bytes; for compaction, rows whose position changes); compaction also
// against reading just the rows it moves, nothing written (read_floor_GBps,
// frac_of_read_floor: the floor of its access pattern). Buffers exceed the last-level cache (32 MiB on the
// reference machine) so bandwidth, not cache, is measured; decode rotates over enough
// "layers" that each layer's KV is cold when it is read again, as in real decoding.
// Every benchmark first checks the kernel's output against the baseline / a direct
// address computation and fails the run (SkipWithError) on a mismatch.
//
// Extra flags (consumed before Google Benchmark's): --kvkit_small shrinks every buffer so
// the CTest smoke run finishes in seconds (its timings mean nothing); --kvkit_hugepages
// asks for transparent huge pages on big buffers (default: plain 4 KiB pages, as an
// engine's pool usually gets when THP is in "madvise" mode); --kvkit_wall times phases
// with the wall clock instead of the thread's CPU time.

#include <benchmark/benchmark.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "kvkit/kernels/cpu.hpp"

namespace {

using kvkit::half_t;
using kvkit::KVLayout;
using kvkit::PagedKVView;

constexpr std::int32_t kHq = 32;    // query heads
constexpr std::int32_t kHkv = 8;    // KV heads (GQA group of 4)
constexpr std::int32_t kDim = 128;  // head_dim

bool g_small = false;  // --kvkit_small: tiny buffers for the smoke test
bool g_hugepages = false;  // --kvkit_hugepages: madvise(MADV_HUGEPAGE) big buffers
bool g_failed = false;  // any benchmark failed its check: main returns 1 (CTest smoke)

void fail_bench(benchmark::State& state, const std::string& why) {
  g_failed = true;
  state.SkipWithError(why.c_str());
}

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kHugePage = 2 * kMiB;

// Bytes one decode kind (dense / kvkit-contiguous / paged) cycles through before reusing a
// layer: 128 MiB and at least twice the last-level cache, so each layer is read from DRAM.
std::size_t decode_rotation_bytes() { return g_small ? 0 : kvkit::bench::dram_rotation_bytes(128 * kMiB); }
// K+V bytes each data-movement call moves (read + written: twice that touched).
std::size_t moved_bytes() { return g_small ? 2 * kMiB : 128 * kMiB; }
// Tokens per sequence in the data-movement pool.
std::int32_t move_seq_len() { return g_small ? 256 : 4096; }

// Phase timer. Default: this thread's CPU time, so time spent descheduled while other
// processes share the cores is not charged to whichever phase was running (all timed
// code is single-threaded, exec::Host{1}). --kvkit_wall switches to steady_clock.
bool g_wall = false;
double now_seconds() { return g_wall ? kvkit::bench::wall_now() : kvkit::bench::thread_cpu_now(); }
double seconds_since(double t0) { return now_seconds() - t0; }

// ---------------------------------------------------------------------------------------
// Buffers and random data

/// Page-aligned, uninitialised heap array (filled by the caller).
template <class T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t n) : n_(n) {
    // 2 MiB alignment for big buffers so --kvkit_hugepages can back them with huge pages.
    const std::size_t align = n * sizeof(T) >= kHugePage ? kHugePage : 4096;
    const std::size_t bytes = std::max(align, (n * sizeof(T) + align - 1) / align * align);
    p_.reset(static_cast<T*>(std::aligned_alloc(align, bytes)));
    if (!p_) throw std::bad_alloc();
    if (g_hugepages && align == kHugePage) (void)madvise(p_.get(), bytes, MADV_HUGEPAGE);
  }
  T* data() const { return p_.get(); }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  T& operator[](std::size_t i) const { return p_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
  std::size_t n_ = 0;
};

/// splitmix64: fast, good enough for benchmark data, deterministic per seed.
struct SplitMix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1), never (near) zero.
  float uniform() {
    const float u = static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f;
    return std::fabs(u) < 1e-3f ? 0.5f : u;
  }
};

std::uint64_t g_seed = 0x6b766b6974ull;  // every buffer gets fresh data

template <class T>
void fill_random(const Buffer<T>& b, float scale = 1.0f) {
  SplitMix rng{g_seed++ * 0x2545f4914f6cdd1dull};
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = T(rng.uniform() * scale);
}

void fill_random_bytes(const Buffer<unsigned char>& b) {
  SplitMix rng{g_seed++ * 0x2545f4914f6cdd1dull};
  std::size_t i = 0;
  for (; i + 8 <= b.size(); i += 8) {
    const std::uint64_t x = rng.next() | 0x0101010101010101ull;  // no zero bytes
    std::memcpy(b.data() + i, &x, 8);
  }
  for (; i < b.size(); ++i) b[i] = 0x5a;
}

std::mt19937_64& rng() {
  static std::mt19937_64 r(12345);
  return r;
}

/// Page ids 0..n-1 in random order: a real allocator scatters a sequence's pages.
std::vector<std::int32_t> shuffled_ids(std::int32_t n) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng());
  return ids;
}

/// A sorted random subset of [0, n) of size k.
std::vector<std::int32_t> random_subset_sorted(std::int32_t n, std::int32_t k) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng());
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

using kvkit::bench::dtype_name;

/// One cached fixture at a time: Google Benchmark calls a benchmark function several
/// times (iteration estimate, repetitions), and building hundreds of MiB of random data
/// each time would dominate the run. Keyed by a string naming the configuration; a new
/// key frees the old fixture first so peak memory stays one fixture.
std::string g_cached_key;            // names the configuration (and so the type) held
std::shared_ptr<void> g_cached;      // one fixture of any type

template <class F>
F& cached_fixture(const std::string& key, const std::function<std::unique_ptr<F>()>& make) {
  auto& cached_key = g_cached_key;
  auto& cached = g_cached;
  if (cached_key != key || !cached) {
    cached.reset();
    cached_key.clear();
    cached = std::shared_ptr<F>(make().release());
    cached_key = key;
  }
  return *static_cast<F*>(cached.get());
}

/// CSR page table of `batch` sequences of `seq_len` tokens over the given page ids.
struct CsrTable {
  std::vector<std::int32_t> indptr, indices, last_page_len;
  kvkit::CsrPageTable table() const {
    return {indptr.data(), indices.data(), last_page_len.data(),
            static_cast<std::int32_t>(last_page_len.size())};
  }
};

CsrTable make_csr(std::int32_t batch, std::int32_t seq_len, std::int32_t page_size,
                  const std::vector<std::int32_t>& page_ids) {
  CsrTable t;
  const std::int32_t per_seq = (seq_len + page_size - 1) / page_size;
  t.indptr.push_back(0);
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t i = 0; i < per_seq; ++i)
      t.indices.push_back(page_ids[static_cast<std::size_t>(b * per_seq + i)]);
    t.indptr.push_back(t.indptr.back() + per_seq);
    t.last_page_len.push_back(seq_len - (per_seq - 1) * page_size);
  }
  return t;
}

// ---------------------------------------------------------------------------------------
// Dense decode attention baseline over contiguous K/V.
//
// Layout K, V: [batch, Hkv, S, D], q/out: [batch, Hq, D]. For each (sequence, KV head) the
// GQA group's query heads are processed together so every K/V row is loaded once; tokens
// go in tiles of kTile: scores for the tile, one max/rescale per tile (online softmax),
// then the probability-weighted V rows. Float accumulation; 8 independent partial sums
// in the dot product so the compiler vectorises it without reassociating. 16-bit rows
// are widened to float once per row.

constexpr int kTile = 32;
constexpr int kMaxGroup = 8;

template <class T>
inline const float* row_as_float(const T* row, float* tmp, int d) {
  if constexpr (std::is_same<T, float>::value) {
    (void)tmp;
    (void)d;
    return row;
  } else {
    for (int i = 0; i < d; ++i) tmp[i] = kvkit::to_float(row[i]);
    return tmp;
  }
}

inline float dot8(const float* a, const float* b, int d) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < d; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

template <class T>
void dense_decode_attention(const T* k,  // [batch, Hkv, S, D]
                            const T* v,  // [batch, Hkv, S, D]
                            const T* q,  // [batch, Hq, D]
                            T* out,      // [batch, Hq, D]
                            int batch, int hq, int hkv, int seq_len, int d, float sm_scale) {
  const int group = hq / hkv;
  alignas(64) float qf[kMaxGroup][kDim];
  alignas(64) float acc[kMaxGroup][kDim];
  alignas(64) float score[kMaxGroup][kTile];
  alignas(64) float tmp[kDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hkv; ++h) {
      const std::size_t kv_base = (static_cast<std::size_t>(b) * hkv + h) * seq_len * d;
      for (int g = 0; g < group; ++g) {
        const T* qrow = q + (static_cast<std::size_t>(b) * hq + h * group + g) * d;
        for (int i = 0; i < d; ++i) qf[g][i] = kvkit::to_float(qrow[i]) * sm_scale;
        for (int i = 0; i < d; ++i) acc[g][i] = 0.f;
        m[g] = -INFINITY;
        l[g] = 0.f;
      }
      for (int s0 = 0; s0 < seq_len; s0 += kTile) {
        const int n = std::min(kTile, seq_len - s0);
        for (int t = 0; t < n; ++t) {
          const float* kr = row_as_float(k + kv_base + static_cast<std::size_t>(s0 + t) * d, tmp, d);
          for (int g = 0; g < group; ++g) score[g][t] = dot8(qf[g], kr, d);
        }
        for (int g = 0; g < group; ++g) {
          float mx = m[g];
          for (int t = 0; t < n; ++t) mx = std::max(mx, score[g][t]);
          const float corr = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first tile
          if (corr != 1.f) {
            l[g] *= corr;
            for (int i = 0; i < d; ++i) acc[g][i] *= corr;
          }
          m[g] = mx;
          float sum = 0.f;
          for (int t = 0; t < n; ++t) {
            score[g][t] = std::exp(score[g][t] - mx);
            sum += score[g][t];
          }
          l[g] += sum;
        }
        for (int t = 0; t < n; ++t) {
          const float* vr = row_as_float(v + kv_base + static_cast<std::size_t>(s0 + t) * d, tmp, d);
          for (int g = 0; g < group; ++g) {
            const float p = score[g][t];
            for (int i = 0; i < d; ++i) acc[g][i] += p * vr[i];
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        T* orow = out + (static_cast<std::size_t>(b) * hq + h * group + g) * d;
        const float inv = 1.f / l[g];
        for (int i = 0; i < d; ++i) orow[i] = T(acc[g][i] * inv);
      }
    }
  }
}

/// Largest |a - b| / (1 + |b|) over n elements.
template <class T>
double max_rel_diff(const T* a, const T* b, std::size_t n) {
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = kvkit::to_float(a[i]), y = kvkit::to_float(b[i]);
    worst = std::max(worst, std::fabs(x - y) / (1.0 + std::fabs(y)));
  }
  return worst;
}

// ---------------------------------------------------------------------------------------
// Decode attention: paged vs contiguous.

template <class T>
struct DecodeFixture {
  std::int32_t batch = 0, seq_len = 0, page_size = 0;
  KVLayout layout = KVLayout::kNHD;
  int layers = 1;
  std::size_t kv_elems = 0;  // per layer and per K or V: batch * Hkv * S * D
  // Per layer: dense [batch, Hkv, S, D] (baseline), the same layout again for the kvkit
  // "contiguous" view (separate memory so neither warms the other's cache), and a pool.
  std::vector<Buffer<T>> dense_k, dense_v, contig_k, contig_v, pool_k, pool_v;
  CsrTable contig_table, paged_table;
  std::vector<PagedKVView<T>> contig_views, paged_views;
  Buffer<T> q, out_dense, out_contig, out_paged;
  Buffer<unsigned char> ws_contig, ws_paged;
  kvkit::DecodeAttentionParams params;
  std::string error;  // non-empty: setup or correctness check failed
};

template <class T>
std::unique_ptr<DecodeFixture<T>> make_decode_fixture(std::int32_t batch, std::int32_t seq_len,
                                                      std::int32_t page_size, KVLayout layout) {
  auto f = std::make_unique<DecodeFixture<T>>();
  f->batch = batch;
  f->seq_len = seq_len;
  f->page_size = page_size;
  f->layout = layout;
  f->kv_elems = static_cast<std::size_t>(batch) * kHkv * seq_len * kDim;
  const std::size_t layer_bytes = 2 * f->kv_elems * sizeof(T);
  f->layers = static_cast<int>(
      std::max<std::size_t>(1, (decode_rotation_bytes() + layer_bytes - 1) / layer_bytes));
  f->params.num_qo_heads = kHq;
  f->params.sm_scale = 1.0f / std::sqrt(static_cast<float>(kDim));

  const std::int32_t pages_per_seq = (seq_len + page_size - 1) / page_size;
  const std::int32_t num_pages = batch * pages_per_seq;
  f->paged_table = make_csr(batch, seq_len, page_size, shuffled_ids(num_pages));
  std::vector<std::int32_t> one_page_each(static_cast<std::size_t>(batch));
  std::iota(one_page_each.begin(), one_page_each.end(), 0);
  f->contig_table = make_csr(batch, seq_len, seq_len, one_page_each);

  const kvkit::KVGeometry cg{kHkv, kDim, seq_len, batch};
  const kvkit::KVStrides cs = kvkit::packed_strides(cg, KVLayout::kHND);  // == [B, Hkv, S, D]
  const kvkit::KVGeometry pg{kHkv, kDim, page_size, num_pages};
  const kvkit::KVStrides ps = kvkit::packed_strides(pg, layout);
  const std::size_t pool_elems = static_cast<std::size_t>(num_pages) * page_size * kHkv * kDim;

  for (int layer = 0; layer < f->layers; ++layer) {
    f->dense_k.emplace_back(f->kv_elems);
    f->dense_v.emplace_back(f->kv_elems);
    fill_random(f->dense_k.back());
    fill_random(f->dense_v.back());
    f->contig_k.emplace_back(f->kv_elems);
    f->contig_v.emplace_back(f->kv_elems);
    std::memcpy(f->contig_k.back().data(), f->dense_k.back().data(), f->dense_k.back().bytes());
    std::memcpy(f->contig_v.back().data(), f->dense_v.back().data(), f->dense_v.back().bytes());
    f->pool_k.emplace_back(pool_elems);
    f->pool_v.emplace_back(pool_elems);
    f->contig_views.push_back(kvkit::make_csr_view<T>(cg, f->contig_k.back().data(), cs,
                                                      f->contig_v.back().data(), cs,
                                                      f->contig_table.table()));
    f->paged_views.push_back(kvkit::make_csr_view<T>(pg, f->pool_k.back().data(), ps,
                                                     f->pool_v.back().data(), ps,
                                                     f->paged_table.table()));
    // Scatter the same logical cache into the pages.
    const PagedKVView<T>& pv = f->paged_views.back();
    for (std::int32_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h < kHkv; ++h)
        for (std::int32_t s = 0; s < seq_len; ++s) {
          const std::size_t src = ((static_cast<std::size_t>(b) * kHkv + h) * seq_len + s) * kDim;
          std::memcpy(pv.k_ptr(b, s, h), f->dense_k.back().data() + src, kDim * sizeof(T));
          std::memcpy(pv.v_ptr(b, s, h), f->dense_v.back().data() + src, kDim * sizeof(T));
        }
  }
  f->contig_views.front().validate_page_table();
  f->paged_views.front().validate_page_table();

  const std::size_t q_elems = static_cast<std::size_t>(batch) * kHq * kDim;
  f->q = Buffer<T>(q_elems);
  fill_random(f->q, 2.0f);  // |q.k| * scale spans a few units: a non-flat softmax
  f->out_dense = Buffer<T>(q_elems);
  f->out_contig = Buffer<T>(q_elems);
  f->out_paged = Buffer<T>(q_elems);
  f->ws_contig = Buffer<unsigned char>(std::max<std::size_t>(
      1, kvkit::paged_decode_attention_workspace_size(kvkit::exec::Host{1},
                                                      f->contig_views.front(), f->params)));
  f->ws_paged = Buffer<unsigned char>(std::max<std::size_t>(
      1, kvkit::paged_decode_attention_workspace_size(kvkit::exec::Host{1},
                                                      f->paged_views.front(), f->params)));

  // Correctness: all three must agree on layer 0.
  dense_decode_attention(f->dense_k[0].data(), f->dense_v[0].data(), f->q.data(),
                         f->out_dense.data(), batch, kHq, kHkv, seq_len, kDim, f->params.sm_scale);
  const kvkit::Workspace wc{f->ws_contig.data(), f->ws_contig.size()};
  const kvkit::Workspace wp{f->ws_paged.data(), f->ws_paged.size()};
  kvkit::Status s1 = kvkit::paged_decode_attention(kvkit::exec::Host{1}, f->contig_views[0],
                                                   f->q.data(), f->out_contig.data(), f->params, wc);
  kvkit::Status s2 = kvkit::paged_decode_attention(kvkit::exec::Host{1}, f->paged_views[0],
                                                   f->q.data(), f->out_paged.data(), f->params, wp);
  if (!s1.is_ok() || !s2.is_ok()) {
    f->error = "paged_decode_attention failed: " + s1.to_string() + " / " + s2.to_string();
    return f;
  }
  const double tol = sizeof(T) == 4 ? 1e-4 : 4e-3;
  const double d1 = max_rel_diff(f->out_contig.data(), f->out_dense.data(), q_elems);
  const double d2 = max_rel_diff(f->out_paged.data(), f->out_dense.data(), q_elems);
  if (!(d1 <= tol && d2 <= tol))
    f->error = "kvkit output differs from the dense baseline: contiguous " + std::to_string(d1) +
               ", paged " + std::to_string(d2);
  return f;
}

template <class T>
void bm_decode(benchmark::State& state, std::int32_t batch, std::int32_t seq_len,
               std::int32_t page_size, KVLayout layout) {
  const std::string key = std::string("decode/") + dtype_name<T>() + "/" + kvkit::to_string(layout) +
                          "/" + std::to_string(page_size) + "/" + std::to_string(batch) + "/" +
                          std::to_string(seq_len);
  auto& f = cached_fixture<DecodeFixture<T>>(
      key, [&] { return make_decode_fixture<T>(batch, seq_len, page_size, layout); });
  if (!f.error.empty()) {
    fail_bench(state, f.error);
    return;
  }
  const kvkit::exec::Host host{1};
  const kvkit::Workspace wc{f.ws_contig.data(), f.ws_contig.size()};
  const kvkit::Workspace wp{f.ws_paged.data(), f.ws_paged.size()};
  double t_dense = 0, t_contig = 0, t_paged = 0;
  std::int64_t iter = 0;
  bool ok = true;
  for (auto _ : state) {
    const int layer = static_cast<int>(iter % f.layers);
    double t_this_paged = 0;
    // Rotate which of the three goes first so drift (frequency, neighbours) is shared.
    for (int j = 0; j < 3; ++j) {
      const int which = static_cast<int>((iter + j) % 3);
      const double t0 = now_seconds();
      if (which == 0) {
        dense_decode_attention(f.dense_k[layer].data(), f.dense_v[layer].data(), f.q.data(),
                               f.out_dense.data(), f.batch, kHq, kHkv, f.seq_len, kDim,
                               f.params.sm_scale);
        benchmark::ClobberMemory();
        t_dense += seconds_since(t0);
      } else if (which == 1) {
        ok &= kvkit::paged_decode_attention(host, f.contig_views[layer], f.q.data(),
                                            f.out_contig.data(), f.params, wc)
                  .is_ok();
        benchmark::ClobberMemory();
        t_contig += seconds_since(t0);
      } else {
        ok &= kvkit::paged_decode_attention(host, f.paged_views[layer], f.q.data(),
                                            f.out_paged.data(), f.params, wp)
                  .is_ok();
        benchmark::ClobberMemory();
        t_this_paged = seconds_since(t0);
        t_paged += t_this_paged;
      }
    }
    state.SetIterationTime(t_this_paged);
    ++iter;
  }
  if (!ok) {
    fail_bench(state, "paged_decode_attention returned an error");
    return;
  }
  const double kv_bytes = 2.0 * static_cast<double>(f.kv_elems) * sizeof(T) * iter;
  state.counters["paged_GBps"] = kv_bytes / t_paged * 1e-9;
  state.counters["dense_GBps"] = kv_bytes / t_dense * 1e-9;
  state.counters["kvcontig_GBps"] = kv_bytes / t_contig * 1e-9;
  state.counters["vs_contiguous"] = t_dense / t_paged;        // paged speed / dense baseline speed
  state.counters["vs_kvkit_contig"] = t_contig / t_paged;     // paged / kvkit on one page per seq
  state.counters["kvcontig_vs_dense"] = t_dense / t_contig;   // kernel quality, paging aside
  state.counters["layers"] = f.layers;
}

// ---------------------------------------------------------------------------------------
// Data movement: compact / gather / copy_pages / write_kv vs memcpy.

template <class T>
struct MoveFixture {
  std::int32_t page_size = 0;
  KVLayout layout = KVLayout::kNHD;
  std::int32_t batch = 0, seq_len = 0, num_pages = 0;
  Buffer<T> pool_k, pool_v;
  CsrTable table;
  PagedKVView<T> view;
  Buffer<unsigned char> memcpy_src, memcpy_dst;  // moved_bytes() each
  Buffer<T> side_k, side_v;                      // gather outputs / write_kv inputs
};

template <class T>
std::unique_ptr<MoveFixture<T>> make_move_fixture(std::int32_t page_size, KVLayout layout) {
  auto f = std::make_unique<MoveFixture<T>>();
  f->page_size = page_size;
  f->layout = layout;
  f->seq_len = move_seq_len();
  const std::size_t token_bytes = 2 * sizeof(T) * kHkv * kDim;  // K + V of one token
  // The pool holds twice the moved bytes: compaction keeps half of every sequence,
  // copy_pages copies half the pages onto the other half.
  const std::size_t pool_tokens = 2 * moved_bytes() / token_bytes;
  f->batch = static_cast<std::int32_t>(pool_tokens / f->seq_len);
  f->num_pages = f->batch * (f->seq_len / page_size);
  const kvkit::KVGeometry g{kHkv, kDim, page_size, f->num_pages};
  const kvkit::KVStrides s = kvkit::packed_strides(g, layout);
  const std::size_t pool_elems = static_cast<std::size_t>(f->num_pages) * page_size * kHkv * kDim;
  f->pool_k = Buffer<T>(pool_elems);
  f->pool_v = Buffer<T>(pool_elems);
  fill_random(f->pool_k);
  fill_random(f->pool_v);
  f->table = make_csr(f->batch, f->seq_len, page_size, shuffled_ids(f->num_pages));
  f->view = kvkit::make_csr_view<T>(g, f->pool_k.data(), s, f->pool_v.data(), s, f->table.table());
  f->view.validate_page_table();
  f->memcpy_src = Buffer<unsigned char>(moved_bytes());
  f->memcpy_dst = Buffer<unsigned char>(moved_bytes());
  fill_random_bytes(f->memcpy_src);
  fill_random_bytes(f->memcpy_dst);
  const std::size_t side_elems = moved_bytes() / 2 / sizeof(T);
  f->side_k = Buffer<T>(side_elems);
  f->side_v = Buffer<T>(side_elems);
  fill_random(f->side_k);
  fill_random(f->side_v);
  return f;
}

template <class T>
MoveFixture<T>& move_fixture(std::int32_t page_size, KVLayout layout) {
  const std::string key = std::string("move/") + dtype_name<T>() + "/" + kvkit::to_string(layout) +
                          "/" + std::to_string(page_size);
  return cached_fixture<MoveFixture<T>>(key, [&] { return make_move_fixture<T>(page_size, layout); });
}

/// The same bytes as one memcpy, but in head_dim-sized rows (one call per row, as the
/// kernels copy): for rows this small glibc uses ordinary cached stores, so the
/// destination is read before it is written (no non-temporal streaming as in the big
/// memcpy). A ceiling for row-granular kernels.
void memcpy_rows(unsigned char* dst, const unsigned char* src, std::size_t bytes, std::size_t row) {
  for (std::size_t off = 0; off < bytes; off += row) std::memcpy(dst + off, src + off, row);
}

/// No extra baseline for time_vs_memcpy.
struct NoFloor {
  void operator()() const {}
  static constexpr bool kPresent = false;
};
/// An extra baseline for time_vs_memcpy: calls `fn`.
template <class F>
struct ExtraFloor {
  F& fn;
  void operator()() const { fn(); }
  static constexpr bool kPresent = true;
};

/// Times `op` (returns a Status) against memcpy of `bytes` in the same iterations and
/// sets the counters: op and memcpy bandwidth (bytes moved / s), frac_of_memcpy, and
/// frac_of_rows against memcpy_rows. With a `floor` (kPresent), also that baseline's
/// time, as read_floor_GBps and frac_of_read_floor (its time / op's time).
template <class T, class Op, class Floor = NoFloor>
void time_vs_memcpy(benchmark::State& state, MoveFixture<T>& f, std::size_t bytes, Op&& op,
                    Floor&& floor = NoFloor{}) {
  constexpr bool kFloor = std::decay_t<Floor>::kPresent;
  constexpr int kSides = kFloor ? 4 : 3;
  if (bytes > f.memcpy_src.size()) {
    fail_bench(state, "moved bytes exceed the memcpy buffers");
    return;
  }
  volatile std::size_t row_bytes = kDim * sizeof(T);  // opaque size: a real memcpy call
  double t_op = 0, t_memcpy = 0, t_rows = 0, t_floor = 0;
  std::int64_t iter = 0;
  bool ok = true;
  for (auto _ : state) {
    double t_this_op = 0;
    for (int j = 0; j < kSides; ++j) {
      const double t0 = now_seconds();
      const int which = static_cast<int>((iter + j) % kSides);
      if (which == 0) {
        std::memcpy(f.memcpy_dst.data(), f.memcpy_src.data(), bytes);
        benchmark::ClobberMemory();
        t_memcpy += seconds_since(t0);
      } else if (which == 1) {
        memcpy_rows(f.memcpy_dst.data(), f.memcpy_src.data(), bytes, row_bytes);
        benchmark::ClobberMemory();
        t_rows += seconds_since(t0);
      } else if (which == 3) {
        floor();
        benchmark::ClobberMemory();
        t_floor += seconds_since(t0);
      } else {
        ok &= op().is_ok();
        benchmark::ClobberMemory();
        t_this_op = seconds_since(t0);
        t_op += t_this_op;
      }
    }
    state.SetIterationTime(t_this_op);
    ++iter;
  }
  if (!ok) {
    fail_bench(state, "kernel returned an error");
    return;
  }
  const double total = static_cast<double>(bytes) * iter;
  state.counters["op_GBps"] = total / t_op * 1e-9;
  state.counters["memcpy_GBps"] = total / t_memcpy * 1e-9;
  state.counters["rows_GBps"] = total / t_rows * 1e-9;
  state.counters["frac_of_memcpy"] = t_memcpy / t_op;
  state.counters["frac_of_rows"] = t_rows / t_op;
  if (kFloor) {
    state.counters["read_floor_GBps"] = total / t_floor * 1e-9;
    state.counters["frac_of_read_floor"] = t_floor / t_op;
  }
  state.counters["MiB_moved"] = static_cast<double>(bytes) / kMiB;
}

template <class T>
bool rows_equal(const T* a, const T* b) {
  return std::memcmp(a, b, kDim * sizeof(T)) == 0;
}

/// Keep lists of the compaction benchmarks.
enum class CompactPattern {
  kHalfAscending,  // a random half of every (sequence, head), ascending (in-place path)
  kHalfShuffled,   // the same sets in shuffled order (staged path)
  kR1kv,           // R1KV's shape: S - S/32 kept (S 4096: 128 = one buffer dropped), 4 sink
                   // and 8 window tokens always kept, the dropped ones uniform in between,
                   // per head; only the first half of the sequences is compacted so the
                   // moved bytes fit the memcpy buffers
};

/// compact_tokens with keep lists of `pattern`. Bytes counted for the kernel and for both
/// baselines alike: the K+V rows whose position changes (keep[i] != i), so rows already
/// in place (R1KV's long kept prefixes) count for neither side.
template <class T>
void bm_compact(benchmark::State& state, std::int32_t page_size, KVLayout layout,
                CompactPattern pattern) {
  auto& f = move_fixture<T>(page_size, layout);
  const bool r1kv = pattern == CompactPattern::kR1kv;
  const std::int32_t keep_n = r1kv ? f.seq_len - f.seq_len / 32 : f.seq_len / 2;
  const std::int32_t stride = keep_n;
  constexpr std::int32_t kSinks = 4, kWindow = 8;
  std::vector<std::int32_t> keep(static_cast<std::size_t>(f.batch) * kHkv * stride);
  for (std::int32_t b = 0; b < f.batch; ++b)
    for (std::int32_t h = 0; h < kHkv; ++h) {
      std::vector<std::int32_t> sel;
      if (r1kv) {
        std::vector<std::int32_t> mid(static_cast<std::size_t>(f.seq_len - kSinks - kWindow));
        std::iota(mid.begin(), mid.end(), kSinks);
        std::shuffle(mid.begin(), mid.end(), rng());
        std::vector<char> dropped(static_cast<std::size_t>(f.seq_len), 0);
        for (std::int32_t d = 0; d < f.seq_len - keep_n; ++d) dropped[static_cast<std::size_t>(mid[d])] = 1;
        for (std::int32_t t = 0; t < f.seq_len; ++t)
          if (!dropped[static_cast<std::size_t>(t)]) sel.push_back(t);
      } else {
        sel = random_subset_sorted(f.seq_len, keep_n);
        if (pattern == CompactPattern::kHalfShuffled) std::shuffle(sel.begin(), sel.end(), rng());
      }
      std::copy(sel.begin(), sel.end(), keep.begin() + (static_cast<std::ptrdiff_t>(b) * kHkv + h) * stride);
    }
  const std::int32_t compacted = r1kv ? f.batch / 2 : f.batch;  // sequences compacted
  std::vector<std::int32_t> num_keep(static_cast<std::size_t>(f.batch), 0);
  std::fill(num_keep.begin(), num_keep.begin() + compacted, keep_n);
  std::size_t moved_rows = 0;
  for (std::int32_t b = 0; b < compacted; ++b)
    for (std::int32_t h = 0; h < kHkv; ++h)
      for (std::int32_t i = 0; i < keep_n; ++i)
        moved_rows += keep[(static_cast<std::size_t>(b) * kHkv + h) * stride + i] != i;
  Buffer<unsigned char> ws(std::max<std::size_t>(
      1, kvkit::compact_tokens_workspace_size(kvkit::exec::Host{1}, f.view, stride)));
  const kvkit::Workspace w{ws.data(), ws.size()};
  auto run = [&] {
    return kvkit::compact_tokens(kvkit::exec::Host{1}, f.view, keep.data(), num_keep.data(), stride, w);
  };

  // Check a sample of moved rows against a snapshot taken before the call.
  struct Probe {
    std::int32_t b, h, i;
    std::vector<T> k, v;
  };
  std::vector<Probe> probes;
  std::uniform_int_distribution<std::int32_t> pick_b(0, compacted - 1), pick_h(0, kHkv - 1),
      pick_i(0, keep_n - 1);
  for (int n = 0; n < 256; ++n) {
    Probe p{pick_b(rng()), pick_h(rng()), pick_i(rng()), {}, {}};
    const std::int32_t src = keep[(static_cast<std::size_t>(p.b) * kHkv + p.h) * stride + p.i];
    p.k.assign(f.view.k_ptr(p.b, src, p.h), f.view.k_ptr(p.b, src, p.h) + kDim);
    p.v.assign(f.view.v_ptr(p.b, src, p.h), f.view.v_ptr(p.b, src, p.h) + kDim);
    probes.push_back(std::move(p));
  }
  kvkit::Status st = run();
  if (!st.is_ok()) {
    fail_bench(state, st.to_string());
    return;
  }
  for (const Probe& p : probes)
    if (!rows_equal(f.view.k_ptr(p.b, p.i, p.h), p.k.data()) ||
        !rows_equal(f.view.v_ptr(p.b, p.i, p.h), p.v.data())) {
      fail_bench(state, "compact_tokens moved the wrong rows");
      return;
    }
  const std::size_t bytes = moved_rows * kDim * sizeof(T) * 2;
  // The floor of the access pattern: only reading the K and V rows that move, in the
  // kernel's order, with nothing written (row addresses listed beforehand; each row's
  // lines prefetched 32 rows ahead; 64-bit words into 8 accumulators). A compaction must
  // at least read them; on a random half it enters the pages at scattered offsets, which a
  // sequential memcpy never pays.
  std::vector<const unsigned char*> rows;
  for (std::int32_t b = 0; b < compacted; ++b)
    for (std::int32_t h = 0; h < kHkv; ++h)
      for (std::int32_t i = 0; i < keep_n; ++i) {
        const std::int32_t src = keep[(static_cast<std::size_t>(b) * kHkv + h) * stride + i];
        if (src == i) continue;
        rows.push_back(reinterpret_cast<const unsigned char*>(f.view.k_ptr(b, src, h)));
        rows.push_back(reinterpret_cast<const unsigned char*>(f.view.v_ptr(b, src, h)));
      }
  std::uint64_t floor_sink = 0;
  auto read_moved = [&] {
    constexpr std::size_t kAhead = 32, kRow = kDim * sizeof(T);
    std::uint64_t acc[8] = {};
    for (std::size_t r = 0; r < rows.size(); ++r) {
#if defined(__GNUC__)
      if (r + kAhead < rows.size())
        for (std::size_t o = 0; o < kRow; o += 64) __builtin_prefetch(rows[r + kAhead] + o);
#endif
      for (std::size_t o = 0; o + 64 <= kRow; o += 64)
        for (int l = 0; l < 8; ++l) {
          std::uint64_t x;
          std::memcpy(&x, rows[r] + o + 8 * l, 8);
          acc[l] ^= x;
        }
    }
    for (std::uint64_t a : acc) floor_sink ^= a;
  };
  time_vs_memcpy(state, f, bytes, run, ExtraFloor<decltype(read_moved)>{read_moved});
  benchmark::DoNotOptimize(floor_sink);
  state.counters["moved_frac"] =
      static_cast<double>(moved_rows) / (static_cast<double>(compacted) * kHkv * keep_n);
}

/// gather_tokens of an ascending half of every sequence into [Hkv, n, D] outputs.
template <class T>
void bm_gather(benchmark::State& state, std::int32_t page_size, KVLayout layout) {
  auto& f = move_fixture<T>(page_size, layout);
  const std::int32_t n = f.seq_len / 2;
  const std::size_t out_per_seq = static_cast<std::size_t>(kHkv) * n * kDim;
  const std::size_t bytes = static_cast<std::size_t>(f.batch) * out_per_seq * sizeof(T) * 2;
  if (out_per_seq * f.batch > f.side_k.size()) {
    fail_bench(state, "gather output buffer too small");
    return;
  }
  std::vector<std::vector<std::int32_t>> ids;
  for (std::int32_t b = 0; b < f.batch; ++b) ids.push_back(random_subset_sorted(f.seq_len, n));
  auto run = [&]() -> kvkit::Status {
    for (std::int32_t b = 0; b < f.batch; ++b)
      KVKIT_RETURN_IF_ERROR(kvkit::gather_tokens(kvkit::exec::Host{1}, f.view, b, ids[b].data(), n,
                                                 f.side_k.data() + b * out_per_seq,
                                                 f.side_v.data() + b * out_per_seq));
    return kvkit::Status::ok();
  };
  kvkit::Status st = run();
  if (!st.is_ok()) {
    fail_bench(state, st.to_string());
    return;
  }
  for (int probe = 0; probe < 256; ++probe) {
    const std::int32_t b = static_cast<std::int32_t>(rng()() % f.batch);
    const std::int32_t h = static_cast<std::int32_t>(rng()() % kHkv);
    const std::int32_t i = static_cast<std::int32_t>(rng()() % n);
    const std::size_t at = b * out_per_seq + (static_cast<std::size_t>(h) * n + i) * kDim;
    if (!rows_equal(f.side_k.data() + at, f.view.k_ptr(b, ids[b][i], h)) ||
        !rows_equal(f.side_v.data() + at, f.view.v_ptr(b, ids[b][i], h))) {
      fail_bench(state, "gather_tokens returned the wrong rows");
      return;
    }
  }
  time_vs_memcpy(state, f, bytes, run);
}

/// copy_pages of a random half of the pool onto the other half.
template <class T>
void bm_copy_pages(benchmark::State& state, std::int32_t page_size, KVLayout layout) {
  auto& f = move_fixture<T>(page_size, layout);
  const std::vector<std::int32_t> perm = shuffled_ids(f.num_pages);
  const std::int32_t n = f.num_pages / 2;
  const std::vector<std::int32_t> src(perm.begin(), perm.begin() + n), dst(perm.begin() + n, perm.begin() + 2 * n);
  const std::size_t page_elems = static_cast<std::size_t>(page_size) * kHkv * kDim;
  const std::size_t bytes = static_cast<std::size_t>(n) * page_elems * sizeof(T) * 2;
  auto run = [&] { return kvkit::copy_pages(kvkit::exec::Host{1}, f.view, src.data(), dst.data(), n); };
  kvkit::Status st = run();
  if (!st.is_ok()) {
    fail_bench(state, st.to_string());
    return;
  }
  for (std::int32_t i = 0; i < n; i += std::max(1, n / 64)) {
    if (std::memcmp(f.pool_k.data() + src[i] * page_elems, f.pool_k.data() + dst[i] * page_elems,
                    page_elems * sizeof(T)) != 0 ||
        std::memcmp(f.pool_v.data() + src[i] * page_elems, f.pool_v.data() + dst[i] * page_elems,
                    page_elems * sizeof(T)) != 0) {
      fail_bench(state, "copy_pages produced a wrong page");
      return;
    }
  }
  time_vs_memcpy(state, f, bytes, run);
}

/// write_kv of moved_bytes()/token_bytes tokens, prefill-style: consecutive slots in
/// shuffled pages.
template <class T>
void bm_write_kv(benchmark::State& state, std::int32_t page_size, KVLayout layout) {
  auto& f = move_fixture<T>(page_size, layout);
  const std::int64_t row = static_cast<std::int64_t>(kHkv) * kDim;
  const std::int32_t num_tokens = static_cast<std::int32_t>(f.side_k.size() / row);
  const std::vector<std::int32_t> pages = shuffled_ids(f.num_pages);
  std::vector<std::int64_t> slots(static_cast<std::size_t>(num_tokens));
  for (std::int32_t t = 0; t < num_tokens; ++t)
    slots[t] = static_cast<std::int64_t>(pages[t / page_size]) * page_size + t % page_size;
  const std::size_t bytes = static_cast<std::size_t>(num_tokens) * row * sizeof(T) * 2;
  auto run = [&] {
    return kvkit::write_kv(kvkit::exec::Host{1}, f.view, f.side_k.data(), f.side_v.data(),
                           slots.data(), num_tokens, row);
  };
  kvkit::Status st = run();
  if (!st.is_ok()) {
    fail_bench(state, st.to_string());
    return;
  }
  for (std::int32_t t = 0; t < num_tokens; t += std::max(1, num_tokens / 256)) {
    for (std::int32_t h = 0; h < kHkv; ++h)
      if (!rows_equal(f.view.k_slot_ptr(slots[t], h), f.side_k.data() + t * row + h * kDim) ||
          !rows_equal(f.view.v_slot_ptr(slots[t], h), f.side_v.data() + t * row + h * kDim)) {
        fail_bench(state, "write_kv wrote the wrong rows");
        return;
      }
  }
  time_vs_memcpy(state, f, bytes, run);
}

/// Converting write_kv (float rows -> T pool) or gather_tokens (T pool -> float rows) vs
/// the scalar route in the same iterations; counters: op_GBps and scalar_GBps (pool-side
/// bytes per second) and speedup.
template <class T>
void bm_convert(benchmark::State& state, std::int32_t page_size, KVLayout layout, bool gather) {
  auto& f = move_fixture<T>(page_size, layout);
  const std::int64_t row = static_cast<std::int64_t>(kHkv) * kDim;
  const std::int32_t num_tokens =
      static_cast<std::int32_t>(std::min<std::size_t>(f.side_k.size() / row,
                                                      static_cast<std::size_t>(f.seq_len)));
  const std::size_t elems = static_cast<std::size_t>(num_tokens) * row;
  std::vector<float> fk(elems), fv(elems), sk(elems), sv(elems);
  std::mt19937_64& r = rng();
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::size_t i = 0; i < elems; ++i) {
    fk[i] = nd(r);
    fv[i] = nd(r);
  }
  std::vector<std::int64_t> slots(static_cast<std::size_t>(num_tokens));
  for (std::int32_t t = 0; t < num_tokens; ++t)
    slots[static_cast<std::size_t>(t)] =
        static_cast<std::int64_t>(f.view.page_id(0, t / page_size)) * page_size + t % page_size;
  const kvkit::exec::Host ex{1};
  auto op = [&]() -> kvkit::Status {
    if (gather)
      return kvkit::gather_tokens(ex, f.view, 0, nullptr, num_tokens, fk.data(), fv.data());
    return kvkit::write_kv(ex, f.view, fk.data(), fv.data(), slots.data(), num_tokens, row);
  };
  auto scalar = [&]() -> kvkit::Status {
    if (gather) {
      KVKIT_RETURN_IF_ERROR(kvkit::gather_tokens(ex, f.view, 0, nullptr, num_tokens,
                                                 f.side_k.data(), f.side_v.data()));
      for (std::size_t i = 0; i < elems; ++i) {
        sk[i] = kvkit::to_float(f.side_k[i]);
        sv[i] = kvkit::to_float(f.side_v[i]);
      }
      return kvkit::Status::ok();
    }
    for (std::size_t i = 0; i < elems; ++i) {
      f.side_k[i] = kvkit::from_float<T>(fk[i]);
      f.side_v[i] = kvkit::from_float<T>(fv[i]);
    }
    return kvkit::write_kv(ex, f.view, f.side_k.data(), f.side_v.data(), slots.data(), num_tokens, row);
  };
  // Check: both routes give the same bits.
  if (!op().is_ok() || !scalar().is_ok()) {
    fail_bench(state, "kernel returned an error");
    return;
  }
  if (gather ? (std::memcmp(fk.data(), sk.data(), elems * 4) != 0 ||
                std::memcmp(fv.data(), sv.data(), elems * 4) != 0)
             : false) {
    fail_bench(state, "converting gather_tokens differs from the scalar route");
    return;
  }
  if (!gather) {
    std::vector<T> snap(f.view.k_slot_ptr(slots[0], 0), f.view.k_slot_ptr(slots[0], 0) + kDim);
    if (!op().is_ok() || std::memcmp(snap.data(), f.view.k_slot_ptr(slots[0], 0), kDim * sizeof(T)) != 0) {
      fail_bench(state, "converting write_kv differs from the scalar route");
      return;
    }
  }
  double t_op = 0, t_sc = 0;
  std::int64_t iter = 0;
  bool ok = true;
  for (auto _ : state) {
    double t_this = 0;
    for (int j = 0; j < 2; ++j) {
      const double t0 = now_seconds();
      if ((iter + j) % 2 == 0) {
        ok &= op().is_ok();
        benchmark::ClobberMemory();
        t_this = seconds_since(t0);
        t_op += t_this;
      } else {
        ok &= scalar().is_ok();
        benchmark::ClobberMemory();
        t_sc += seconds_since(t0);
      }
    }
    state.SetIterationTime(t_this);
    ++iter;
  }
  if (!ok) {
    fail_bench(state, "kernel returned an error");
    return;
  }
  const double bytes = 2.0 * static_cast<double>(elems) * sizeof(T) * static_cast<double>(iter);
  state.counters["op_GBps"] = bytes / t_op * 1e-9;
  state.counters["scalar_GBps"] = bytes / t_sc * 1e-9;
  state.counters["speedup"] = t_sc / t_op;
}

// ---------------------------------------------------------------------------------------
// Registration

template <class T>
void register_decode() {
  const std::pair<std::int32_t, std::int32_t> shapes[] = {{1, 1024}, {1, 4096}, {1, 8192},
                                                          {4, 2048}, {8, 1024}, {8, 8192}};
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t page : {16, 64})
      for (const auto& bs : shapes) {
        const std::string name = std::string("decode/") + dtype_name<T>() + "/" +
                                 kvkit::to_string(layout) + "/P" + std::to_string(page) + "/B" +
                                 std::to_string(bs.first) + "/S" + std::to_string(bs.second);
        benchmark::RegisterBenchmark(name.c_str(), bm_decode<T>, bs.first, bs.second, page, layout)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
}

template <class T>
void register_moves() {
  // Grouped by (dtype, layout, page) so consecutive benchmarks reuse one pool.
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (std::int32_t page : {16, 64}) {
      const std::string suffix = std::string("/") + dtype_name<T>() + "/" + kvkit::to_string(layout) +
                                 "/P" + std::to_string(page);
      auto reg = [&](const std::string& name, auto fn, auto... args) {
        benchmark::RegisterBenchmark((name + suffix).c_str(), fn, page, layout, args...)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      };
      reg("write_kv", bm_write_kv<T>);
      reg("gather", bm_gather<T>);
      reg("copy_pages", bm_copy_pages<T>);
      reg("compact_asc", bm_compact<T>, CompactPattern::kHalfAscending);
      reg("compact_perm", bm_compact<T>, CompactPattern::kHalfShuffled);
      reg("compact_r1kv", bm_compact<T>, CompactPattern::kR1kv);
    }
}

}  // namespace

int main(int argc, char** argv) {
  // Our own flags are stripped before Google Benchmark parses the rest; exit code 1 on a
  // failed check or a filter that matches nothing (the smoke test).
  return kvkit::bench::run_main(
      argc, argv,
      {{"--kvkit_small", &g_small}, {"--kvkit_wall", &g_wall}, {"--kvkit_hugepages", &g_hugepages}},
      g_failed, [] {
        register_decode<float>();
        register_decode<half_t>();
        register_moves<float>();
        register_moves<half_t>();
        for (bool gather : {false, true}) {
          const std::string op = gather ? "convert/gather_to_f32/" : "convert/write_kv_from_f32/";
          benchmark::RegisterBenchmark((op + "f16/hnd/P16").c_str(), bm_convert<half_t>, 16,
                                       KVLayout::kHND, gather)
              ->UseManualTime()->Unit(benchmark::kMillisecond);
          benchmark::RegisterBenchmark((op + "bf16/hnd/P16").c_str(), bm_convert<kvkit::bfloat16_t>,
                                       16, KVLayout::kHND, gather)
              ->UseManualTime()->Unit(benchmark::kMillisecond);
        }
      });
}
