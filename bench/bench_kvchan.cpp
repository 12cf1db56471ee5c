// bench_kvchan: the ChannelSelector's two measurements.
//
// 1. Timing (Google Benchmark, default): decode attention with the old tokens packed
//    (channel_attention: channel-restricted kernel over rK/rV pages + full-width window,
//    merged by LSE) against dense paged_decode_attention over the same tokens, timed in
//    the same process, one thread, both timed in thread CPU time and interleaved per
//    iteration. Counters: dense_us, packed_us, ratio = packed / dense,
//    saved = fraction of KV bytes saved, goal = (1 - saved) / 0.8 (met when ratio <= goal).
//    kvchan_pack/...: pack_channel_pages / unpack_channel_pages of 4096 tokens (256 pages
//    of 16, 4 kv heads of 64 dims, float; 512 tokens with --kvkit_small) on 1 thread
//    against 2 threads of a ThreadPool, interleaved per iteration, wall time. Counters:
//    t1_us, t2_us, speedup = t1 / t2.
//
// 2. Fidelity (--kvkit_fidelity [--kvkit_models DIR]): attention KL tables, no timing.
//    Traces: a synthetic trace with outlier channels, stories260K and SmolLM2-135M (the
//    seed's three code prompts of examples/prompts/suite.json, as ChatML user turns) when
//    the model files exist. A trace = every token's K and the decode queries of every
//    layer. The selection is calibrated on the first half of the decode steps (the
//    ChannelSelector's own statistics: EMA of |k| or ThinK, fed in token order) and the
//    attention KL(dense || packed) is measured per (decode step, layer, query head) on the
//    second half, with tokens older than the window W read through the rK selected dims.
//    Printed: median / p90 KL at 25 / 37.5 / 50 / 62.5 / 75 % of the key dims pruned for
//    the EMA, ThinK and Centered scores, each without and with key mean compensation (the
//    packed score adds sum over dropped dims of q_d mu_d, mu_d the mean of k_d over the
//    packed tokens), the KV bytes saved (packed K pages, V full width, window, metadata
//    counted as the policy's memory_bytes() does) at the largest pruning whose median KL
//    <= 1e-3 / 1e-2, and for V pruning (K full width) the output-level relative error
//    ||o - o'|| / ||o|| (|v| EMA vs Var[v] selection, dropped dims 0 vs their mean): V
//    pruning does not change the attention distribution, so it has no attention KL.
//    At most 32 evenly spaced decode steps of the second half are evaluated.
//    Options: --kvkit_window=W (32), --kvkit_steps=N decode steps (64), --kvkit_prompts=
//    KIND of the suite (code; long_doc for the long documents), --kvkit_max_prompts=N (3),
//    --kvkit_smol_only (skip the synthetic and stories260K traces), --kvkit_sinks=0,16,32 (the
//    first N tokens stay full width, never packed: one table row per N; bytes count them full
//    width, rounded up to pages), --kvkit_prune=6.25,12.5,.. (% of K dims pruned),
//    --kvkit_calib_skip_sink (the selector does not observe the sink tokens),
//    --kvkit_no_vtable / --kvkit_no_basis (skip the V-pruning / offline basis tables),
//    --kvkit_per_layer (per-layer median KL, ThinK without and Centered with key compensation).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvkit/channel/kvchan.hpp"
#include "kvkit/channel/pack_pages.hpp"
#include "kvkit/channel/packed_store.hpp"
#include "kvkit/core/logits.hpp"
#include "kvkit/core/thread_pool.hpp"
#include "kvkit/kernels/cpu.hpp"
#include "read_floor.hpp"
#if defined(KVKIT_BENCH_KVCHAN_ENGINE)
#include <nlohmann/json.hpp>

#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/tokenizer.hpp"
#endif

using namespace kvkit;

namespace {

bool g_small = false;
bool g_smol_only = false;  // --kvkit_smol_only: SmolLM2 traces only
std::int32_t g_sink = 0;  // the first g_sink tokens stay full width (not packed); set per table row
std::vector<std::int32_t> g_sinks{0};  // --kvkit_sink=N or --kvkit_sinks=A,B,..: sink sizes in tokens
std::vector<double> g_prune{0.25, 0.375, 0.5, 0.625, 0.75};  // --kvkit_prune=25,37.5,..: % of K dims pruned
bool g_basis_only = false;  // --kvkit_basis_only: only the offline basis tables
bool g_calib_skip_sink = false;  // --kvkit_calib_skip_sink: the selector does not observe the sink tokens
bool g_no_vtable = false;  // --kvkit_no_vtable: skip the V-pruning table
bool g_no_basis = false;   // --kvkit_no_basis: skip the offline basis tables
std::vector<std::int32_t> g_resid_bits;  // --kvkit_resid_bits=4,8: only the residual table, these widths (4, 8)
bool g_per_layer = false;  // --kvkit_per_layer: per-layer median KL (ThinK, Centered + comp)

template <class T>
std::vector<T> parse_list(const std::string& s) {
  std::vector<T> out;
  std::size_t a = 0;
  while (a <= s.size()) {
    const std::size_t b = std::min(s.find(',', a), s.size());
    out.push_back(static_cast<T>(std::stod(s.substr(a, b - a))));
    a = b + 1;
  }
  return out;
}

// This thread's CPU time: the timed code is single-threaded (exec::Host{1}), and on a
// shared, overloaded machine wall time mostly measures waiting for a core.
double now_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ---- 1. timing ------------------------------------------------------------------------

// T: the page element type (float, or half_t: the end-to-end runs' float16 pages).
template <class T>
struct AttnSetup {
  std::int32_t B, Hkv, G, D, S, W, P, rk, rv;
  std::vector<T> fk, fv;              // full-width pool (dense: all S tokens)
  std::vector<std::int32_t> f_indptr, f_indices, f_last;
  std::unique_ptr<channel::PackedPagePool<T>> pool;  // old tokens packed
  std::vector<std::int32_t> o_indptr, o_indices, o_last;
  std::vector<std::int32_t> w_indptr, w_indices, w_last;  // window pages (in the full pool)
  std::vector<std::int32_t> ksel, vsel;
  std::vector<T> q, out;
  std::vector<float> kfill;  // [B, Hkv, D] key compensation means (0 on kept dims)
  PagedKVView<T> dense_view, window_view, old_view;
  DecodeAttentionParams dense{}, packed{};
  std::vector<unsigned char> ws_dense, ws_packed;
};

// bits 4 or 8: the packed pool also keeps the dropped dims as a residual (residual.hpp).
template <class T>
std::unique_ptr<AttnSetup<T>> make_setup(std::int32_t B, std::int32_t S, std::int32_t rk, std::int32_t rv,
                                         std::int32_t bits = 0, bool scattered = false) {
  auto s = std::make_unique<AttnSetup<T>>();
  s->B = B, s->Hkv = 3, s->G = 3, s->D = 64, s->S = S, s->W = 128, s->P = 16, s->rk = rk, s->rv = rv;
  const std::int32_t P = s->P, D = s->D, H = s->Hkv;
  const std::int32_t pages_per = (S + P - 1) / P, old = (S - s->W) / P * P, opages = old / P;
  KVGeometry g{H, D, P, B * pages_per, D};
  const KVStrides st = packed_strides(g, KVLayout::kNHD);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  s->fk.resize(static_cast<std::size_t>(st.page) * g.num_pages);
  s->fv.resize(s->fk.size());
  for (T& x : s->fk) x = from_float<T>(nd(rng));
  for (T& x : s->fv) x = from_float<T>(nd(rng));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(g.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  s->pool = std::make_unique<channel::PackedPagePool<T>>(1, H, rk, rv, P, bits, D, D);
  for (std::int32_t h = 0; h < H; ++h) {
    std::vector<std::int32_t> a(static_cast<std::size_t>(D));
    std::iota(a.begin(), a.end(), 0);
    std::shuffle(a.begin(), a.end(), rng);
    std::vector<std::int32_t> k(a.begin(), a.begin() + rk), v(a.begin(), a.begin() + rv);
    std::sort(k.begin(), k.end());
    std::sort(v.begin(), v.end());
    s->ksel.insert(s->ksel.end(), k.begin(), k.end());
    s->vsel.insert(s->vsel.end(), v.begin(), v.end());
  }
  s->f_indptr = {0};
  s->o_indptr = {0};
  std::vector<std::int32_t> src_pages, dst_pages;  // old pages: full pool -> packed pool
  s->w_indptr = {0};
  // Packed page ids in allocation order (a sequence's packed pages adjacent and ascending in
  // memory: one sequence packing alone), or with `scattered` shuffled over the pool as the
  // full pool's pages are (sequences that pack as they age interleave their pages, and
  // releases fragment the pool). The dense call reads shuffled pages in both cases.
  std::vector<std::int32_t> packed_ids(static_cast<std::size_t>(B) * opages);
  for (std::int32_t& id : packed_ids) id = s->pool->allocate();
  if (scattered) std::shuffle(packed_ids.begin(), packed_ids.end(), rng);
  for (std::int32_t b = 0; b < B; ++b) {
    for (std::int32_t i = 0; i < pages_per; ++i) {
      const std::int32_t page = perm[static_cast<std::size_t>(b * pages_per + i)];
      s->f_indices.push_back(page);
      if (i < opages) {
        const std::int32_t pp = packed_ids[static_cast<std::size_t>(b * opages + i)];
        s->o_indices.push_back(pp);
        src_pages.push_back(page);
        dst_pages.push_back(pp);
        for (std::int32_t t = 0; t < P; ++t)
          for (std::int32_t h = 0; h < H; ++h) {
            const T* kr = s->fk.data() + page * st.page + t * st.token + h * st.head;
            const T* vr = s->fv.data() + page * st.page + t * st.token + h * st.head;
            channel::pack_channels(kr, 0, s->ksel.data() + h * rk, rk, 1, s->pool->k_row(0, pp, t, h), 0);
            channel::pack_channels(vr, 0, s->vsel.data() + h * rv, rv, 1, s->pool->v_row(0, pp, t, h), 0);
          }
      } else {
        s->w_indices.push_back(page);
      }
    }
    s->f_indptr.push_back(static_cast<std::int32_t>(s->f_indices.size()));
    s->o_indptr.push_back(static_cast<std::int32_t>(s->o_indices.size()));
    s->w_indptr.push_back(static_cast<std::int32_t>(s->w_indices.size()));
    s->f_last.push_back(S - (pages_per - 1) * P);
    s->o_last.push_back(opages > 0 ? P : 0);
    s->w_last.push_back(S - (pages_per - 1) * P);
  }
  if (bits != 0) {
    static const std::int32_t kZero[1] = {0};
    const PagedKVView<T> store =
        make_csr_view(g, s->fk.data(), st, s->fv.data(), st, CsrPageTable{kZero, nullptr, nullptr, 0});
    const Status rs = channel::pack_residual_pages(exec::Host{1}, store, s->pool->residual(0), s->ksel.data(),
                                                   s->vsel.data(), rk, rv, src_pages.data(), dst_pages.data(),
                                                   static_cast<std::int32_t>(src_pages.size()),
                                                   static_cast<std::int32_t>(src_pages.size()) * P);
    if (!rs.is_ok()) throw Error(rs.to_string());
  }
  s->dense_view = make_csr_view(g, s->fk.data(), st, s->fv.data(), st,
                                CsrPageTable{s->f_indptr.data(), s->f_indices.data(), s->f_last.data(), B});
  s->window_view = make_csr_view(g, s->fk.data(), st, s->fv.data(), st,
                                 CsrPageTable{s->w_indptr.data(), s->w_indices.data(), s->w_last.data(), B});
  s->old_view = make_csr_view(s->pool->geometry(), s->pool->k(0), s->pool->k_strides(), s->pool->v(0),
                              s->pool->v_strides(), CsrPageTable{s->o_indptr.data(), s->o_indices.data(), s->o_last.data(), B});
  s->dense = DecodeAttentionParams{H * s->G, 1.f / std::sqrt(static_cast<float>(D))};
  s->packed = s->dense;
  if (rk < D) s->packed.k_channels = s->ksel.data();
  if (rv < D) s->packed.v_channels = s->vsel.data();
  s->packed.q_dim = D;
  s->q.resize(static_cast<std::size_t>(B) * H * s->G * D);
  for (T& x : s->q) x = from_float<T>(nd(rng));
  s->kfill.assign(static_cast<std::size_t>(B) * H * D, 0.f);
  for (std::int32_t b = 0; b < B; ++b)
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t d = 0; d < D; ++d)
        if (!std::binary_search(s->ksel.begin() + h * rk, s->ksel.begin() + (h + 1) * rk, d))
          s->kfill[(static_cast<std::size_t>(b) * H + h) * D + d] = nd(rng);
  s->out.resize(s->q.size());
  const exec::Host ex{1};
  s->ws_dense.resize(paged_decode_attention_workspace_size(ex, s->dense_view, s->dense));
  s->ws_packed.resize(channel::channel_attention_workspace_size(ex, s->window_view, s->old_view, s->dense, s->packed));
  return s;
}

// Args: B, S, rK, rV, mode (0 drop, 1 key compensation, 4 / 8 residual bits), dram, the
// page type (0 float, 1 half_t, 2 bfloat16_t), and packed pages scattered (1) or in
// allocation order (0; see make_setup).
// dram 1: as many independent setups (layers) as make up dram_rotation_bytes (twice the
// last-level cache), visited in turn, so every call reads its KV from DRAM, as a decode
// step over a model's layers does; dram 0: one setup, its KV cache-resident after the
// first call (6-50 MiB here).
template <class T>
void packed_vs_dense(benchmark::State& state) {
  const std::int32_t B = static_cast<std::int32_t>(state.range(0)), S = static_cast<std::int32_t>(state.range(1));
  const std::int32_t rk = static_cast<std::int32_t>(state.range(2)), rv = static_cast<std::int32_t>(state.range(3));
  const bool kcomp = state.range(4) == 1;  // key compensation (lse bias) on
  const std::int32_t bits = state.range(4) >= 4 ? static_cast<std::int32_t>(state.range(4)) : 0;  // residual
  const bool dram = state.range(5) != 0 && !g_small;
  std::vector<std::unique_ptr<AttnSetup<T>>> layers;
  const bool scattered = state.range(7) != 0;
  layers.push_back(make_setup<T>(B, g_small ? 512 : S, rk, rv, bits, scattered));
  if (dram) {
    const AttnSetup<T>& f = *layers.front();
    const std::size_t bytes = (f.fk.size() + f.fv.size()) * sizeof(T) + static_cast<std::size_t>(f.pool->capacity_bytes());
    const std::size_t n = (bench::dram_rotation_bytes(std::size_t{256} << 20) + bytes - 1) / bytes;
    while (layers.size() < std::max<std::size_t>(n, 2)) layers.push_back(make_setup<T>(B, S, rk, rv, bits, scattered));
  }
  const exec::Host ex{1};
  AttnSetup<T>* s = layers.front().get();
  auto dense = [&] {
    const Status st = paged_decode_attention(ex, s->dense_view, s->q.data(), s->out.data(), s->dense,
                                             Workspace{s->ws_dense.data(), s->ws_dense.size()});
    if (!st.is_ok()) state.SkipWithError(st.to_string().c_str());
  };
  auto packed = [&] {
    const Workspace ws{s->ws_packed.data(), s->ws_packed.size()};
    const Status st =
        bits != 0 ? channel::channel_attention(ex, s->window_view, s->old_view, s->pool->residual(0), s->q.data(),
                                               s->out.data(), s->dense, s->packed, ws)
                  : channel::channel_attention(ex, s->window_view, s->old_view, s->q.data(), s->out.data(), s->dense,
                                               s->packed, nullptr, kcomp ? s->kfill.data() : nullptr, ws);
    if (!st.is_ok()) state.SkipWithError(st.to_string().c_str());
  };
  dense();
  packed();
  double td = 0, tp = 0;
  std::int64_t n = 0;
  const std::size_t L = layers.size();
  for (auto _ : state) {
    // Interleaved so both see the same machine load (2 shared cores); with several layers,
    // the packed call reads the layer half a rotation away from the dense one (the window
    // pages they share are then not in cache from the dense call).
    s = layers[static_cast<std::size_t>(n) % L].get();
    const double t0 = now_s();
    dense();
    const double t1 = now_s();
    s = layers[(static_cast<std::size_t>(n) + L / 2) % L].get();
    packed();
    const double t2 = now_s();
    td += t1 - t0;
    tp += t2 - t1;
    ++n;
    state.SetIterationTime(t2 - t1);
  }
  const double S_ = s->S, W = s->W, D = s->D;
  const double old = std::floor((S_ - W) / s->P) * s->P;
  // Bytes per old token and kv head: the packed pool's page bytes (residual included).
  const double old_row = static_cast<double>(s->pool->page_bytes()) / (s->P * s->Hkv * sizeof(T));
  const double saved = 1.0 - (old * old_row + (S_ - old) * 2 * D) / (S_ * 2 * D);
  state.counters["dense_us"] = 1e6 * td / static_cast<double>(n);
  state.counters["packed_us"] = 1e6 * tp / static_cast<double>(n);
  state.counters["ratio"] = tp / td;
  state.counters["saved"] = saved;
  state.counters["goal"] = (1 - saved) / 0.8;
  state.counters["layers"] = static_cast<double>(L);
}

void BM_packed_vs_dense(benchmark::State& state) {
  if (state.range(6) == 1)
    packed_vs_dense<half_t>(state);
  else if (state.range(6) == 2)
    packed_vs_dense<bfloat16_t>(state);
  else
    packed_vs_dense<float>(state);
}

// Page pack (op 0) or unpack (op 1) on 1 thread vs 2 pool threads (the same calls and data).
void BM_pack_threads(benchmark::State& state) {
  const bool unpack = state.range(0) != 0;
  const std::int32_t rk = static_cast<std::int32_t>(state.range(1)), rv = static_cast<std::int32_t>(state.range(2));
  const std::int32_t H = 4, D = 64, P = 16, n_tokens = g_small ? 512 : 4096, n_pages = n_tokens / P;
  const KVGeometry fg{H, D, P, n_pages + 8, D}, pg{H, rk, P, n_pages + 8, rv};
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto random = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
  };
  const std::size_t fe = static_cast<std::size_t>(fg.num_pages) * P * H * D;
  std::vector<float> fk = random(fe), fv = random(fe);
  std::vector<float> pk = random(static_cast<std::size_t>(pg.num_pages) * P * H * rk);
  std::vector<float> pv = random(static_cast<std::size_t>(pg.num_pages) * P * H * rv);
  std::vector<float> kfill = random(static_cast<std::size_t>(H) * D), vfill = random(static_cast<std::size_t>(H) * D);
  auto sets = [&](std::int32_t r) {  // r ascending dims of D per head
    std::vector<std::int32_t> out;
    for (std::int32_t h = 0; h < H; ++h) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(D));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::sort(ids.begin(), ids.begin() + r);
      out.insert(out.end(), ids.begin(), ids.begin() + r);
    }
    return out;
  };
  const std::vector<std::int32_t> kch = sets(rk), vch = sets(rv);
  auto pages = [&](std::int32_t total) {  // n_pages distinct ids in random order
    std::vector<std::int32_t> ids(static_cast<std::size_t>(total));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<std::size_t>(n_pages));
    return ids;
  };
  const std::vector<std::int32_t> fpages = pages(fg.num_pages), ppages = pages(pg.num_pages);
  static const std::int32_t kZero[1] = {0};
  const CsrPageTable none{kZero, nullptr, nullptr, 0};
  const auto full = make_csr_view(fg, fk.data(), packed_strides(fg, KVLayout::kNHD), fv.data(),
                                  packed_v_strides(fg, KVLayout::kNHD), none);
  const auto packed = make_csr_view(pg, pk.data(), packed_strides(pg, KVLayout::kNHD), pv.data(),
                                    packed_v_strides(pg, KVLayout::kNHD), none);
  ThreadPool pool(2);
  auto call = [&](exec::Host ex) {
    const Status st = unpack ? channel::unpack_channel_pages(ex, packed, full, kch.data(), vch.data(), kfill.data(),
                                                             vfill.data(), ppages.data(), fpages.data(), n_pages,
                                                             n_tokens)
                             : channel::pack_channel_pages(ex, full, packed, kch.data(), vch.data(), fpages.data(),
                                                           ppages.data(), n_pages, n_tokens);
    if (!st.is_ok()) state.SkipWithError(st.to_string().c_str());
  };
  auto wall = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  call(exec::Host{1});
  call(exec::Host{2, pool.executor()});
  double t1 = 0, t2 = 0;
  std::int64_t n = 0;
  for (auto _ : state) {
    // Interleaved so both see the same machine load.
    const double a = wall();
    call(exec::Host{1});
    const double b = wall();
    call(exec::Host{2, pool.executor()});
    const double c = wall();
    t1 += b - a;
    t2 += c - b;
    ++n;
    state.SetIterationTime(c - b);
  }
  state.counters["t1_us"] = 1e6 * t1 / static_cast<double>(n);
  state.counters["t2_us"] = 1e6 * t2 / static_cast<double>(n);
  state.counters["speedup"] = t1 / t2;
}

// ---- 2. fidelity ------------------------------------------------------------------------

struct Trace {
  std::string name;
  std::int32_t L = 0, H = 0, G = 0, D = 0, n = 0;  // layers, kv heads, group, head dim, tokens
  std::vector<float> k;                           // [L, n, H, D]
  std::vector<float> v;                           // [L, n, H, D] (engine traces; synthetic: empty)
  std::vector<std::int32_t> qpos;                 // [steps] position of each decode query
  std::vector<float> q;                           // [steps, L, H*G, D]
  const float* krow(std::int32_t l, std::int32_t t, std::int32_t h) const {
    return k.data() + ((static_cast<std::size_t>(l) * n + t) * H + h) * D;
  }
  const float* vrow(std::int32_t l, std::int32_t t, std::int32_t h) const {
    return v.data() + ((static_cast<std::size_t>(l) * n + t) * H + h) * D;
  }
  const float* qrow(std::size_t s, std::int32_t l, std::int32_t hq) const {
    return q.data() + ((s * L + l) * static_cast<std::size_t>(H * G) + hq) * D;
  }
};

Trace synthetic_trace() {
  Trace t;
  t.name = "synthetic-outliers";
  t.L = 2, t.H = 4, t.G = 2, t.D = 64, t.n = g_small ? 256 : 1024;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> scale(static_cast<std::size_t>(t.L * t.H * t.D));
  for (std::size_t i = 0; i < scale.size(); ++i) scale[i] = std::exp(0.5f * nd(rng));
  for (std::int32_t l = 0; l < t.L; ++l)
    for (std::int32_t h = 0; h < t.H; ++h)
      for (std::int32_t j = 0; j < 4; ++j)  // four outlier channels per head
        scale[static_cast<std::size_t>((l * t.H + h) * t.D + (j * 13 + h * 5) % t.D)] = 8.f;
  t.k.resize(static_cast<std::size_t>(t.L) * t.n * t.H * t.D);
  for (std::int32_t l = 0; l < t.L; ++l)
    for (std::int32_t p = 0; p < t.n; ++p)
      for (std::int32_t h = 0; h < t.H; ++h)
        for (std::int32_t d = 0; d < t.D; ++d)
          t.k[((static_cast<std::size_t>(l) * t.n + p) * t.H + h) * t.D + d] =
              scale[static_cast<std::size_t>((l * t.H + h) * t.D + d)] * nd(rng);
  const std::int32_t steps = g_small ? 32 : 128;
  for (std::int32_t s = 0; s < steps; ++s) {
    t.qpos.push_back(t.n - steps + s);
    for (std::int32_t l = 0; l < t.L; ++l)
      for (std::int32_t hq = 0; hq < t.H * t.G; ++hq)
        for (std::int32_t d = 0; d < t.D; ++d)
          t.q.push_back(nd(rng) * std::sqrt(scale[static_cast<std::size_t>((l * t.H + hq / t.G) * t.D + d)]));
  }
  return t;
}

#if defined(KVKIT_BENCH_KVCHAN_ENGINE)
// Full-cache greedy run of `prompt` (prefilled) then `steps` decode steps; queries of
// every step, all K at the end.
Trace engine_trace(const std::string& name, std::shared_ptr<const engine::Checkpoint> ck,
                   const std::vector<std::int32_t>& prompt, std::int32_t steps) {
  const engine::ModelConfig& c = ck->config();
  Trace t;
  t.name = name;
  t.L = c.n_layers, t.H = c.n_kv_heads, t.G = c.n_heads / c.n_kv_heads, t.D = c.head_dim();
  engine::EngineOptions eo;
  eo.page_size = 16;
  eo.max_batch = 1;
  eo.num_pages = static_cast<std::int32_t>((prompt.size() + steps) / 16 + 2);
  engine::Engine eng(ck, eo);
  eng.add_step_hook([&](engine::Engine& e, const engine::StepInfo& info) {
    t.qpos.push_back(e.position(info.seq_ids[0]) - 1);
    for (std::int32_t l = 0; l < t.L; ++l)
      t.q.insert(t.q.end(), info.queries[l], info.queries[l] + static_cast<std::size_t>(t.H * t.G * t.D));
  });
  const engine::SeqId id = eng.add_sequence(prompt);
  eng.prefill(id);
  for (std::int32_t s = 0; s < steps; ++s) eng.step();
  t.n = eng.kv_len(id);
  t.k.resize(static_cast<std::size_t>(t.L) * t.n * t.H * t.D);
  t.v.resize(t.k.size());
  const auto& views = eng.layer_views();
  for (std::int32_t l = 0; l < t.L; ++l)
    for (std::int32_t p = 0; p < t.n; ++p)
      for (std::int32_t h = 0; h < t.H; ++h) {
        const std::ptrdiff_t o = static_cast<std::ptrdiff_t>(((static_cast<std::size_t>(l) * t.n + p) * t.H + h) * t.D);
        std::copy_n(views[static_cast<std::size_t>(l)].k_ptr(0, p, h), t.D, t.k.begin() + o);
        std::copy_n(views[static_cast<std::size_t>(l)].v_ptr(0, p, h), t.D, t.v.begin() + o);
      }
  return t;
}
#endif

// The scores a ChannelSelector (score) holds after the calibration half: key scores and
// value scores per (layer, kv head, dim); the sets of any r are their top r (ties to the
// lower dim), as ChannelSelector::update() takes them.
struct Calib {
  std::int32_t L = 0, H = 0, D = 0;
  std::vector<float> k, v;  // [L, H, D]
  std::vector<std::int32_t> top(const std::vector<float>& sc, std::int32_t r) const {
    std::vector<std::int32_t> out(static_cast<std::size_t>(L) * H * r);
    for (std::int32_t i = 0; i < L * H; ++i)
      channel::top_r_channels(sc.data() + static_cast<std::size_t>(i) * D, D, r, out.data() + static_cast<std::size_t>(i) * r);
    return out;
  }
};

Calib calibrate(const Trace& t, channel::ChannelScore score) {
  channel::ChannelParams p;
  p.r_k = t.D;
  p.score = score;
  p.mode = channel::ChannelMode::kProbe;
  channel::ChannelSelector sel(p, t.L, t.H, t.D, t.G);
  const std::size_t half = t.qpos.size() / 2;
  const std::int32_t upto = t.qpos[half > 0 ? half - 1 : 0];
  std::size_t s = 0;
  for (std::int32_t pos = 0; pos <= upto; ++pos) {
    for (std::int32_t l = 0; l < t.L; ++l)
      for (std::int32_t h = 0; h < t.H; ++h)
        if (!g_calib_skip_sink || pos >= g_sink)
          sel.observe_kv(l, h, t.krow(l, pos, h), t.v.empty() ? t.krow(l, pos, h) : t.vrow(l, pos, h));
    for (; s < half && t.qpos[s] == pos; ++s)
      for (std::int32_t l = 0; l < t.L; ++l)
        for (std::int32_t h = 0; h < t.H; ++h) sel.observe_q(l, h, t.qrow(s, l, h * t.G));
  }
  Calib c;
  c.L = t.L, c.H = t.H, c.D = t.D;
  for (std::int32_t l = 0; l < t.L; ++l)
    for (std::int32_t h = 0; h < t.H; ++h)
      for (std::int32_t d = 0; d < t.D; ++d) {
        c.k.push_back(sel.key_score(l, h, d));
        c.v.push_back(sel.value_score(l, h, d));
      }
  return c;
}

// The evaluated decode steps: the second half, at most 32 of them, evenly spaced.
std::vector<std::size_t> eval_steps(const Trace& t) {
  const std::size_t a = t.qpos.size() / 2, n = t.qpos.size() - a, m = std::min<std::size_t>(n, 32);
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < m; ++i) out.push_back(a + i * n / m);
  return out;
}

// Prefix sums over tokens of K (or V) per (layer, kv head, dim), float64: [L, n+1, H, D].
std::vector<double> prefix_sums(const Trace& t, bool values) {
  std::vector<double> ps(static_cast<std::size_t>(t.L) * (t.n + 1) * t.H * t.D, 0.0);
  for (std::int32_t l = 0; l < t.L; ++l)
    for (std::int32_t j = 0; j < t.n; ++j)
      for (std::int32_t h = 0; h < t.H; ++h) {
        const float* x = values ? t.vrow(l, j, h) : t.krow(l, j, h);
        const std::size_t a = ((static_cast<std::size_t>(l) * (t.n + 1) + j) * t.H + h) * t.D;
        const std::size_t b = a + static_cast<std::size_t>(t.H) * t.D;
        for (std::int32_t d = 0; d < t.D; ++d) ps[b + d] = ps[a + d] + x[d];
      }
  return ps;
}
const double* prefix_at(const std::vector<double>& ps, const Trace& t, std::int32_t l, std::int32_t j, std::int32_t h) {
  return ps.data() + ((static_cast<std::size_t>(l) * (t.n + 1) + j) * t.H + h) * t.D;
}

// Calls f(n, old, l, h, q, mask) for every (eval step, layer, query head), in that order:
// n tokens attended at the step, the first `old` of them older than the window W, h the
// query head's kv head, q its query [D], mask[d] = 1 for the r dims `sel` keeps for (l, h)
// [D]. The loop the K and V pruning measurements share.
template <class F>
void for_each_masked_head(const Trace& t, const std::vector<std::int32_t>& sel, std::int32_t r,
                          std::int32_t W, F&& f) {
  std::vector<char> mask(static_cast<std::size_t>(t.D));
  for (std::size_t s : eval_steps(t)) {
    const std::int32_t pos = t.qpos[s], n = pos + 1, old = std::max(0, n - W);
    for (std::int32_t l = 0; l < t.L; ++l)
      for (std::int32_t hq = 0; hq < t.H * t.G; ++hq) {
        const std::int32_t h = hq / t.G;
        std::fill(mask.begin(), mask.end(), 0);
        const std::int32_t* keep = sel.data() + (static_cast<std::size_t>(l) * t.H + h) * r;
        for (std::int32_t c = 0; c < r; ++c) mask[static_cast<std::size_t>(keep[c])] = 1;
        f(n, old, l, h, t.qrow(s, l, hq), static_cast<const char*>(mask.data()));
      }
  }
}

// KL(dense || packed) of every (eval step, layer, query head). Tokens older than the
// window are scored on the r selected dims; with `compensate`, plus sum over the dropped
// dims of q_d mu_d, mu_d the mean of k_d over those old tokens.
std::vector<double> attention_kls(const Trace& t, const std::vector<std::int32_t>& sel, std::int32_t r,
                                  std::int32_t W, bool compensate, const std::vector<double>& kps) {
  std::vector<double> kls;
  const double scale = 1.0 / std::sqrt(static_cast<double>(t.D));
  std::vector<double> a, b;
  for_each_masked_head(t, sel, r, W, [&](std::int32_t n, std::int32_t old, std::int32_t l, std::int32_t h,
                                         const float* q, const char* mask) {
    a.resize(static_cast<std::size_t>(n));
    b.resize(static_cast<std::size_t>(n));
    double bias = 0;
    const std::int32_t s0 = std::min(g_sink, old);  // packed tokens: [s0, old)
    if (compensate && old > s0) {
      const double* sum = prefix_at(kps, t, l, old, h);
      const double* sum0 = prefix_at(kps, t, l, s0, h);
      for (std::int32_t d = 0; d < t.D; ++d)
        if (!mask[d]) bias += static_cast<double>(q[d]) * (sum[d] - sum0[d]) / (old - s0);
    }
    for (std::int32_t j = 0; j < n; ++j) {
      const float* k = t.krow(l, j, h);
      double full = 0, part = 0;
      for (std::int32_t d = 0; d < t.D; ++d) {
        const double x = static_cast<double>(q[d]) * k[d];
        full += x;
        part += mask[d] ? x : 0.0;
      }
      a[static_cast<std::size_t>(j)] = full * scale;
      b[static_cast<std::size_t>(j)] = (j < old && j >= s0 ? part + bias : full) * scale;
    }
    kls.push_back(kvkit::kl_from_logits(a.data(), b.data(), n));
  });
  return kls;
}

// Exact attention weights of query q [D] over the first n tokens of (layer l, kv head h),
// float64, into p [n].
void exact_weights(const Trace& t, std::int32_t l, std::int32_t h, const float* q, std::int32_t n,
                   std::vector<double>& p) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(t.D));
  p.resize(static_cast<std::size_t>(n));
  double ma = -1e300;
  for (std::int32_t j = 0; j < n; ++j) {
    const float* k = t.krow(l, j, h);
    double x = 0;
    for (std::int32_t d = 0; d < t.D; ++d) x += static_cast<double>(q[d]) * k[d];
    p[static_cast<std::size_t>(j)] = x * scale;
    ma = std::max(ma, x * scale);
  }
  double z = 0;
  for (double& x : p) z += (x = std::exp(x - ma));
  for (double& x : p) x /= z;
}

// Output-level effect of V pruning (K full width, exact attention weights): relative error
// ||o - o'|| / ||o|| per (eval step, layer, query head), o' reading the old tokens' dropped
// V dims as 0 or (compensate) as their mean over the old tokens.
std::vector<double> value_errors(const Trace& t, const std::vector<std::int32_t>& sel, std::int32_t r,
                                 std::int32_t W, bool compensate, const std::vector<double>& vps) {
  std::vector<double> errs;
  std::vector<double> a, o(static_cast<std::size_t>(t.D)), e(static_cast<std::size_t>(t.D));
  for_each_masked_head(t, sel, r, W, [&](std::int32_t n, std::int32_t old, std::int32_t l, std::int32_t h,
                                         const float* q, const char* mask) {
    exact_weights(t, l, h, q, n, a);
    std::fill(o.begin(), o.end(), 0.0);
    std::fill(e.begin(), e.end(), 0.0);
    double p_old = 0;
    for (std::int32_t j = 0; j < n; ++j) {
      const double pj = a[static_cast<std::size_t>(j)];
      const float* v = t.vrow(l, j, h);
      for (std::int32_t d = 0; d < t.D; ++d) {
        o[static_cast<std::size_t>(d)] += pj * v[d];
        if (j < old && !mask[d]) e[static_cast<std::size_t>(d)] += pj * v[d];
      }
      if (j < old) p_old += pj;
    }
    double num = 0, den = 0;
    const double* sum = old > 0 ? prefix_at(vps, t, l, old, h) : nullptr;
    for (std::int32_t d = 0; d < t.D; ++d) {
      double err = e[static_cast<std::size_t>(d)];  // o - o' on dropped dims
      if (compensate && sum != nullptr && !mask[d]) err -= p_old * sum[d] / old;
      num += err * err;
      den += o[static_cast<std::size_t>(d)] * o[static_cast<std::size_t>(d)];
    }
    errs.push_back(den > 0 ? std::sqrt(num / den) : 0.0);
  });
  return errs;
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// Fraction of KV bytes saved at the trace's length with K packed to r dims (V full width),
// as KvchanPolicy::memory_bytes() counts them (engine window pages + packed pages +
// selector metadata + page lists + the compensation sums and means), page size 16.
double bytes_saved(const Trace& t, std::int32_t r, std::int32_t W, channel::ChannelScore score, bool compensate) {
  const std::int64_t P = 16, n = t.n, per_tok_full = static_cast<std::int64_t>(t.L) * t.H * 2 * t.D * 4;
  const std::int64_t full = (n + P - 1) / P * P * per_tok_full;
  const std::int64_t n_old = n - W >= P ? (n - W) / P * P : 0;
  // --kvkit_sink: the first pages stay full width (counted as full-width bytes).
  const std::int64_t sink = std::min<std::int64_t>(n_old, (g_sink + P - 1) / P * P);
  const std::int64_t n_pack = n_old - sink;
  const std::int64_t engine = ((n - n_old + P - 1) / P * P + sink) * per_tok_full;
  const std::int64_t packed = n_pack * t.L * t.H * (r + t.D) * 4;
  channel::ChannelParams p;
  p.r_k = r;
  p.window = static_cast<std::int32_t>(W);
  p.score = score;
  const channel::ChannelSelector sel(p, t.L, t.H, t.D, t.G);
  std::int64_t meta = sel.metadata_bytes() + 4 * (n_pack / P);
  if (compensate) meta += static_cast<std::int64_t>(t.L) * t.H * t.D * (8 + 4);  // k_sum (double) + k_mean (float)
  return 1.0 - static_cast<double>(engine + packed + meta) / static_cast<double>(full);
}

const char* score_name(channel::ChannelScore s) {
  return s == channel::ChannelScore::kEma ? "EMA" : s == channel::ChannelScore::kThink ? "ThinK" : "Centered";
}

void fidelity_tables(const std::vector<Trace>& traces, std::int32_t W) {
  const channel::ChannelScore scores[] = {channel::ChannelScore::kEma, channel::ChannelScore::kThink,
                                          channel::ChannelScore::kCentered};
  // Calibrations per (sink, trace, score): they depend on the sink only with --kvkit_calib_skip_sink.
  std::vector<std::vector<std::vector<Calib>>> cal;
  for (std::int32_t sink : g_sinks) {
    g_sink = sink;
    cal.emplace_back();
    for (const Trace& t : traces) {
      cal.back().emplace_back();
      for (channel::ChannelScore sc : scores) cal.back().back().push_back(calibrate(t, sc));
    }
    if (!g_calib_skip_sink) break;
  }
  auto calib = [&](std::size_t k, std::size_t ti, std::size_t si) -> const Calib& {
    return cal[g_calib_skip_sink ? k : 0][ti][si];
  };
  std::printf("\n## attention KL(dense || packed), window W=%d, calibration on the first half of the decode steps%s\n\n", W,
              g_calib_skip_sink ? " (sink tokens not observed)" : "");
  std::printf("| trace | tokens | sink | score | K comp | pruned | rK/D | median KL | p90 KL | KV bytes saved |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (std::size_t ti = 0; ti < traces.size(); ++ti) {
    const Trace& t = traces[ti];
    const std::vector<double> kps = prefix_sums(t, false);
    for (std::size_t k = 0; k < g_sinks.size(); ++k) {
      g_sink = g_sinks[k];
      for (std::size_t si = 0; si < 3; ++si)
        for (bool comp : {false, true})
          for (double pr : g_prune) {
            const std::int32_t r = std::max(1, static_cast<std::int32_t>(std::lround(t.D * (1 - pr))));
            const Calib& c = calib(k, ti, si);
            const auto kl = attention_kls(t, c.top(c.k, r), r, W, comp, kps);
            std::printf("| %s | %d | %d | %s | %s | %.2f%% | %d/%d | %.3g | %.3g | %.1f%% |\n", t.name.c_str(), t.n,
                        g_sink, score_name(scores[si]), comp ? "yes" : "no", pr * 100, r, t.D, quantile(kl, 0.5),
                        quantile(kl, 0.9), 100 * bytes_saved(t, r, W, scores[si], comp));
            std::fflush(stdout);
          }
    }
  }
  if (g_per_layer) {
    // Per-layer medians: attention_kls orders its values by (step, layer, query head).
    std::printf("\n## per-layer median attention KL (W=%d), layers 0..L-1\n\n", W);
    std::printf("| trace | sink | score | K comp | pruned | per-layer median KL |\n|---|---|---|---|---|---|\n");
    for (std::size_t ti = 0; ti < traces.size(); ++ti) {
      const Trace& t = traces[ti];
      const std::vector<double> kps = prefix_sums(t, false);
      for (std::size_t k = 0; k < g_sinks.size(); ++k) {
        g_sink = g_sinks[k];
        for (std::size_t si : {std::size_t{1}, std::size_t{2}})
          for (double pr : g_prune) {
            const bool comp = si == 2;
            const std::int32_t r = std::max(1, static_cast<std::int32_t>(std::lround(t.D * (1 - pr))));
            const Calib& c = calib(k, ti, si);
            const auto kl = attention_kls(t, c.top(c.k, r), r, W, comp, kps);
            std::printf("| %s | %d | %s | %s | %.2f%% |", t.name.c_str(), g_sink, score_name(scores[si]),
                        comp ? "yes" : "no", pr * 100);
            const std::size_t hq = static_cast<std::size_t>(t.H * t.G);
            for (std::int32_t l = 0; l < t.L; ++l) {
              std::vector<double> v;
              for (std::size_t i = 0; i < kl.size(); ++i)
                if (static_cast<std::int32_t>(i / hq % static_cast<std::size_t>(t.L)) == l) v.push_back(kl[i]);
              std::printf(" %.2g", quantile(v, 0.5));
            }
            std::printf(" |\n");
            std::fflush(stdout);
          }
      }
    }
  }
  std::printf("\n## KV bytes saved at the largest key pruning with median attention KL <= threshold (W=%d)\n\n", W);
  std::printf("| trace | sink | score | K comp | threshold | rK/D | median KL | KV bytes saved |\n|---|---|---|---|---|---|---|---|\n");
  for (std::size_t ti = 0; ti < traces.size(); ++ti) {
    const Trace& t = traces[ti];
    const std::vector<double> kps = prefix_sums(t, false);
    for (std::size_t k = 0; k < g_sinks.size(); ++k) {
      g_sink = g_sinks[k];
      for (std::size_t si = 0; si < 3; ++si)
        for (bool comp : {false, true})
          for (double th : {1e-3, 1e-2}) {
            const Calib& c = calib(k, ti, si);
            std::int32_t best = t.D;
            double best_kl = 0;
            const std::int32_t step = std::max(1, t.D / 16);
            for (std::int32_t r = t.D - step; r >= 1; r -= step) {
              const double m = quantile(attention_kls(t, c.top(c.k, r), r, W, comp, kps), 0.5);
              if (m > th) break;
              best = r;
              best_kl = m;
            }
            std::printf("| %s | %d | %s | %s | %.0e | %d/%d | %.3g | %.1f%% |\n", t.name.c_str(), g_sink,
                        score_name(scores[si]), comp ? "yes" : "no", th, best, t.D, best_kl,
                        best < t.D ? 100 * bytes_saved(t, best, W, scores[si], comp) : 0.0);
            std::fflush(stdout);
          }
    }
  }
  g_sink = g_sinks.front();
  const std::vector<std::vector<Calib>>& cal0 = cal.front();
  if (g_no_vtable) return;
  std::printf("\n## V pruning, output level (K full width): median / p90 ||o - o'|| / ||o|| (W=%d)\n\n", W);
  std::printf("| trace | V score | V comp | pruned | rV/D | median rel. err | p90 rel. err |\n|---|---|---|---|---|---|---|\n");
  for (std::size_t ti = 0; ti < traces.size(); ++ti) {
    const Trace& t = traces[ti];
    if (t.v.empty()) continue;
    const std::vector<double> vps = prefix_sums(t, true);
    for (std::size_t si : {std::size_t{0}, std::size_t{2}})  // |v| EMA (EMA and ThinK) vs Var[v] (Centered)
      for (bool comp : {false, true})
        for (double pr : {0.25, 0.5, 0.75}) {
          const std::int32_t r = std::max(1, static_cast<std::int32_t>(std::lround(t.D * (1 - pr))));
          const auto e = value_errors(t, cal0[ti][si].top(cal0[ti][si].v, r), r, W, comp, vps);
          std::printf("| %s | %s | %s | %.0f%% | %d/%d | %.3g | %.3g |\n", t.name.c_str(),
                      si == 0 ? "EMA abs(v)" : "Var[v]", comp ? "yes" : "no", pr * 100, r, t.D, quantile(e, 0.5),
                      quantile(e, 0.9));
          std::fflush(stdout);
        }
  }
}

// ---- offline only: dropped dims kept as a low-precision residual -----------------------
// Instead of reading the dropped dims as 0, a packed token keeps them as signed b-bit
// integers with one scale per (token, kv head): x'_d = s round(x_d / s),
// s = max over the dropped dims of |x_d| / (2^(b-1) - 1). The selected dims stay exact.
void quantize_dropped(const float* x, const char* mask, std::int32_t D, std::int32_t bits, double* out) {
  double amax = 0;
  for (std::int32_t d = 0; d < D; ++d)
    if (!mask[d]) amax = std::max(amax, std::fabs(static_cast<double>(x[d])));
  const double qmax = static_cast<double>((1 << (bits - 1)) - 1);
  const double s = amax > 0 ? static_cast<double>(static_cast<float>(amax / qmax)) : 1.0;
  for (std::int32_t d = 0; d < D; ++d)
    out[d] = mask[d] ? static_cast<double>(x[d]) : s * std::clamp(std::nearbyint(x[d] / s), -qmax, qmax);
}

// KL(dense || packed) with the residual, as attention_kls; and the output error of V
// packed the same way (K exact), as value_errors.
std::vector<double> residual_kls(const Trace& t, const std::vector<std::int32_t>& sel, std::int32_t r, std::int32_t W,
                                 std::int32_t bits) {
  std::vector<double> kls, a, b, kq(static_cast<std::size_t>(t.D));
  const double scale = 1.0 / std::sqrt(static_cast<double>(t.D));
  for_each_masked_head(t, sel, r, W, [&](std::int32_t n, std::int32_t old, std::int32_t l, std::int32_t h,
                                         const float* q, const char* mask) {
    a.resize(static_cast<std::size_t>(n));
    b.resize(static_cast<std::size_t>(n));
    for (std::int32_t j = 0; j < n; ++j) {
      const float* k = t.krow(l, j, h);
      quantize_dropped(k, mask, t.D, bits, kq.data());
      double full = 0, part = 0;
      for (std::int32_t d = 0; d < t.D; ++d) {
        full += static_cast<double>(q[d]) * k[d];
        part += static_cast<double>(q[d]) * kq[static_cast<std::size_t>(d)];
      }
      a[static_cast<std::size_t>(j)] = full * scale;
      b[static_cast<std::size_t>(j)] = (j < old ? part : full) * scale;
    }
    kls.push_back(kvkit::kl_from_logits(a.data(), b.data(), n));
  });
  return kls;
}

std::vector<double> residual_value_errors(const Trace& t, const std::vector<std::int32_t>& sel, std::int32_t r,
                                          std::int32_t W, std::int32_t bits) {
  std::vector<double> errs, a, o(static_cast<std::size_t>(t.D)), e(static_cast<std::size_t>(t.D)),
      vq(static_cast<std::size_t>(t.D));
  for_each_masked_head(t, sel, r, W, [&](std::int32_t n, std::int32_t old, std::int32_t l, std::int32_t h,
                                         const float* q, const char* mask) {
    exact_weights(t, l, h, q, n, a);
    std::fill(o.begin(), o.end(), 0.0);
    std::fill(e.begin(), e.end(), 0.0);
    for (std::int32_t j = 0; j < n; ++j) {
      const double pj = a[static_cast<std::size_t>(j)];
      const float* v = t.vrow(l, j, h);
      if (j < old) quantize_dropped(v, mask, t.D, bits, vq.data());
      for (std::int32_t d = 0; d < t.D; ++d) {
        o[static_cast<std::size_t>(d)] += pj * v[d];
        if (j < old) e[static_cast<std::size_t>(d)] += pj * (v[d] - vq[static_cast<std::size_t>(d)]);
      }
    }
    double num = 0, den = 0;
    for (std::int32_t d = 0; d < t.D; ++d) {
      num += e[static_cast<std::size_t>(d)] * e[static_cast<std::size_t>(d)];
      den += o[static_cast<std::size_t>(d)] * o[static_cast<std::size_t>(d)];
    }
    errs.push_back(den > 0 ? std::sqrt(num / den) : 0.0);
  });
  return errs;
}

// KV bytes saved with K and V both packed to r exact dims plus their b-bit residual, on
// pages of T, window W, page size 16: packed rows as PackedPagePool::page_bytes() counts
// them (codes and scales); selector metadata not counted (under 0.1 % here).
template <class T>
double residual_bytes_saved(const Trace& t, std::int32_t r, std::int32_t W, std::int32_t bits) {
  const std::int64_t P = 16, n = t.n, per_tok_full = static_cast<std::int64_t>(t.L) * t.H * 2 * t.D * sizeof(T);
  const std::int64_t full = (n + P - 1) / P * P * per_tok_full;
  const std::int64_t n_old = n - W >= P ? (n - W) / P * P : 0;
  const std::int64_t engine = (n - n_old + P - 1) / P * P * per_tok_full;
  const channel::PackedPagePool<T> pool(t.L, t.H, std::max(1, r), std::max(1, r), static_cast<std::int32_t>(P), bits,
                                        t.D, t.D);
  const std::int64_t packed = n_old / P * pool.page_bytes();
  return 1.0 - static_cast<double>(engine + packed) / static_cast<double>(full);
}

void residual_tables(const std::vector<Trace>& traces, std::int32_t W) {
  std::printf("\n## dropped dims as a b-bit residual (W=%d): K by ThinK, V by EMA |v|, both packed\n\n", W);
  std::printf("| trace | tokens | bits | pruned | r/D | K median KL | K p90 KL | V median rel. err | saved, 16-bit pages | saved, float pages |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Trace& t : traces) {
    const Calib ck = calibrate(t, channel::ChannelScore::kThink), cv = calibrate(t, channel::ChannelScore::kEma);
    for (std::int32_t bits : g_resid_bits)
      for (double pr : g_prune) {
        const std::int32_t r = std::max(0, static_cast<std::int32_t>(std::lround(t.D * (1 - pr))));
        const auto kl = residual_kls(t, ck.top(ck.k, r), r, W, bits);
        std::vector<double> ve;
        if (!t.v.empty()) ve = residual_value_errors(t, cv.top(cv.v, r), r, W, bits);
        std::printf("| %s | %d | %d | %.1f%% | %d/%d | %.3g | %.3g | %.3g | %.1f%% | %.1f%% |\n", t.name.c_str(), t.n, bits,
                    pr * 100, r, t.D, quantile(kl, 0.5), quantile(kl, 0.9), quantile(ve, 0.5),
                    100 * residual_bytes_saved<half_t>(t, r, W, bits), 100 * residual_bytes_saved<float>(t, r, W, bits));
        std::fflush(stdout);
      }
  }
}

// ---- offline only: a per-(layer, kv head) basis instead of channel selection ----------
// Keys are stored as r coordinates in a basis computed on the calibration half; the
// packed score is q·mu + q^T S^-1 V V^T S (k - mu) (mu: the mean of k over the packed
// tokens, as the compensation), so the score error of a packed token is
// q^T A (k - mu), A = S^-1 (I - V V^T) S. "PCA": S = I, V = the top-r eigenvectors of the
// centred key covariance. "qPCA": S = E[q q^T]^(1/2) (the group's calibration queries),
// V = the top-r eigenvectors of S Cov[k] S, which minimises E[(q^T A (k - mu))^2] over
// rank-r projections for independent q and k. The kernel would be the channel-restricted
// one on rotated q (q~ = V^T S^-1 q) over r stored coordinates (V^T S (k - mu)).

// Cyclic Jacobi: eigenvalues (descending) and eigenvectors (columns of vec) of symmetric a.
void jacobi_eigen(std::vector<double> a, std::int32_t n, std::vector<double>& val, std::vector<double>& vec) {
  vec.assign(static_cast<std::size_t>(n) * n, 0.0);
  for (std::int32_t i = 0; i < n; ++i) vec[static_cast<std::size_t>(i) * n + i] = 1.0;
  auto A = [&](std::int32_t i, std::int32_t j) -> double& { return a[static_cast<std::size_t>(i) * n + j]; };
  for (int sweep = 0; sweep < 50; ++sweep) {
    double off = 0, tot = 0;
    for (std::int32_t i = 0; i < n; ++i)
      for (std::int32_t j = 0; j < n; ++j) (i == j ? tot : off) += A(i, j) * A(i, j);
    if (off <= 1e-22 * (tot + off)) break;
    for (std::int32_t p = 0; p < n - 1; ++p)
      for (std::int32_t q = p + 1; q < n; ++q) {
        if (A(p, q) == 0.0) continue;
        const double th = (A(q, q) - A(p, p)) / (2 * A(p, q));
        const double t = (th >= 0 ? 1.0 : -1.0) / (std::fabs(th) + std::sqrt(th * th + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (std::int32_t k = 0; k < n; ++k) {
          const double akp = A(k, p), akq = A(k, q);
          A(k, p) = c * akp - s * akq;
          A(k, q) = s * akp + c * akq;
        }
        for (std::int32_t k = 0; k < n; ++k) {
          const double apk = A(p, k), aqk = A(q, k);
          A(p, k) = c * apk - s * aqk;
          A(q, k) = s * apk + c * aqk;
        }
        for (std::int32_t k = 0; k < n; ++k) {
          double& vp = vec[static_cast<std::size_t>(k) * n + p];
          double& vq = vec[static_cast<std::size_t>(k) * n + q];
          const double x = vp, y = vq;
          vp = c * x - s * y;
          vq = s * x + c * y;
        }
      }
  }
  std::vector<std::int32_t> ord(static_cast<std::size_t>(n));
  std::iota(ord.begin(), ord.end(), 0);
  std::sort(ord.begin(), ord.end(), [&](std::int32_t x, std::int32_t y) { return A(x, x) > A(y, y); });
  std::vector<double> v2(vec.size());
  val.resize(static_cast<std::size_t>(n));
  for (std::int32_t j = 0; j < n; ++j) {
    val[static_cast<std::size_t>(j)] = A(ord[static_cast<std::size_t>(j)], ord[static_cast<std::size_t>(j)]);
    for (std::int32_t i = 0; i < n; ++i)
      v2[static_cast<std::size_t>(i) * n + j] = vec[static_cast<std::size_t>(i) * n + ord[static_cast<std::size_t>(j)]];
  }
  vec = v2;
}

// Per (layer, head): the eigen data of the basis ("S" and its inverse, V with all D columns).
struct Basis {
  std::vector<double> S, Si, V;  // [L*H][D*D]
};

Basis make_basis(const Trace& t, bool query_aware) {
  Basis b;
  const std::int32_t D = t.D;
  const std::size_t DD = static_cast<std::size_t>(D) * D, half = t.qpos.size() / 2;
  const std::int32_t upto = t.qpos[half > 0 ? half - 1 : 0];
  for (std::int32_t l = 0; l < t.L; ++l)
    for (std::int32_t h = 0; h < t.H; ++h) {
      std::vector<double> mu(static_cast<std::size_t>(D), 0.0), ck(DD, 0.0), cq(DD, 0.0);
      std::int32_t n = 0;
      for (std::int32_t j = std::min(g_sink, upto); j <= upto; ++j, ++n) {
        const float* k = t.krow(l, j, h);
        for (std::int32_t d = 0; d < D; ++d) mu[static_cast<std::size_t>(d)] += k[d];
      }
      for (double& m : mu) m /= std::max(1, n);
      for (std::int32_t j = std::min(g_sink, upto); j <= upto; ++j) {
        const float* k = t.krow(l, j, h);
        for (std::int32_t x = 0; x < D; ++x)
          for (std::int32_t y = 0; y < D; ++y)
            ck[static_cast<std::size_t>(x) * D + y] += (k[x] - mu[static_cast<std::size_t>(x)]) * (k[y] - mu[static_cast<std::size_t>(y)]) / n;
      }
      std::vector<double> S(DD, 0.0), Si(DD, 0.0);
      if (query_aware) {
        std::int32_t nq = 0;
        for (std::size_t s = 0; s < half; ++s)
          for (std::int32_t g = 0; g < t.G; ++g, ++nq) {
            const float* q = t.qrow(s, l, h * t.G + g);
            for (std::int32_t x = 0; x < D; ++x)
              for (std::int32_t y = 0; y < D; ++y) cq[static_cast<std::size_t>(x) * D + y] += static_cast<double>(q[x]) * q[y];
          }
        double tr = 0;
        for (std::int32_t x = 0; x < D; ++x) tr += cq[static_cast<std::size_t>(x) * D + x] /= 1.0;
        std::vector<double> ev, U;
        jacobi_eigen(cq, D, ev, U);
        const double eps = 1e-6 * tr / D;
        for (std::int32_t x = 0; x < D; ++x)
          for (std::int32_t y = 0; y < D; ++y) {
            double a = 0, c = 0;
            for (std::int32_t j = 0; j < D; ++j) {
              const double e = std::max(ev[static_cast<std::size_t>(j)], 0.0) + eps;
              const double u = U[static_cast<std::size_t>(x) * D + j] * U[static_cast<std::size_t>(y) * D + j];
              a += u * std::sqrt(e);
              c += u / std::sqrt(e);
            }
            S[static_cast<std::size_t>(x) * D + y] = a;
            Si[static_cast<std::size_t>(x) * D + y] = c;
          }
      } else {
        for (std::int32_t x = 0; x < D; ++x) S[static_cast<std::size_t>(x) * D + x] = Si[static_cast<std::size_t>(x) * D + x] = 1.0;
      }
      // M = S ck S
      std::vector<double> T(DD, 0.0), M(DD, 0.0);
      for (std::int32_t x = 0; x < D; ++x)
        for (std::int32_t y = 0; y < D; ++y)
          for (std::int32_t j = 0; j < D; ++j) T[static_cast<std::size_t>(x) * D + y] += S[static_cast<std::size_t>(x) * D + j] * ck[static_cast<std::size_t>(j) * D + y];
      for (std::int32_t x = 0; x < D; ++x)
        for (std::int32_t y = 0; y < D; ++y)
          for (std::int32_t j = 0; j < D; ++j) M[static_cast<std::size_t>(x) * D + y] += T[static_cast<std::size_t>(x) * D + j] * S[static_cast<std::size_t>(j) * D + y];
      std::vector<double> ev, V;
      jacobi_eigen(M, D, ev, V);
      b.S.insert(b.S.end(), S.begin(), S.end());
      b.Si.insert(b.Si.end(), Si.begin(), Si.end());
      b.V.insert(b.V.end(), V.begin(), V.end());
    }
  return b;
}

// KL(dense || packed) with the old tokens (after the g_sink first ones) read through the
// rank-r basis, mean-compensated.
std::vector<double> basis_kls(const Trace& t, const Basis& bs, std::int32_t r, std::int32_t W,
                              const std::vector<double>& kps) {
  std::vector<double> kls;
  const std::int32_t D = t.D;
  const std::size_t DD = static_cast<std::size_t>(D) * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // A^T per (l, h): A = Si (I - V_r V_r^T) S.
  std::vector<double> At(static_cast<std::size_t>(t.L) * t.H * DD);
  for (std::int32_t i = 0; i < t.L * t.H; ++i) {
    const double* S = bs.S.data() + i * DD;
    const double* Si = bs.Si.data() + i * DD;
    const double* V = bs.V.data() + i * DD;
    std::vector<double> P(DD, 0.0), T(DD, 0.0);  // P = I - V_r V_r^T
    for (std::int32_t x = 0; x < D; ++x)
      for (std::int32_t y = 0; y < D; ++y) {
        double a = x == y ? 1.0 : 0.0;
        for (std::int32_t j = 0; j < r; ++j) a -= V[static_cast<std::size_t>(x) * D + j] * V[static_cast<std::size_t>(y) * D + j];
        P[static_cast<std::size_t>(x) * D + y] = a;
      }
    for (std::int32_t x = 0; x < D; ++x)
      for (std::int32_t y = 0; y < D; ++y)
        for (std::int32_t j = 0; j < D; ++j) T[static_cast<std::size_t>(x) * D + y] += P[static_cast<std::size_t>(x) * D + j] * S[static_cast<std::size_t>(j) * D + y];
    double* a = At.data() + i * DD;
    for (std::int32_t x = 0; x < D; ++x)
      for (std::int32_t y = 0; y < D; ++y) {
        double v = 0;
        for (std::int32_t j = 0; j < D; ++j) v += Si[static_cast<std::size_t>(x) * D + j] * T[static_cast<std::size_t>(j) * D + y];
        a[static_cast<std::size_t>(y) * D + x] = v;  // transposed
      }
  }
  std::vector<double> a, b, qa(static_cast<std::size_t>(D)), mu(static_cast<std::size_t>(D));
  for (std::size_t s : eval_steps(t)) {
    const std::int32_t pos = t.qpos[s], n = pos + 1, old = std::max(0, n - W);
    a.resize(static_cast<std::size_t>(n));
    b.resize(static_cast<std::size_t>(n));
    for (std::int32_t l = 0; l < t.L; ++l)
      for (std::int32_t hq = 0; hq < t.H * t.G; ++hq) {
        const std::int32_t h = hq / t.G, s0 = std::min(g_sink, old);
        const float* q = t.qrow(s, l, hq);
        const double* A = At.data() + (static_cast<std::size_t>(l) * t.H + h) * DD;
        for (std::int32_t x = 0; x < D; ++x) {
          double v = 0;
          for (std::int32_t y = 0; y < D; ++y) v += A[static_cast<std::size_t>(x) * D + y] * q[y];
          qa[static_cast<std::size_t>(x)] = v;
        }
        if (old > s0) {
          const double* s1 = prefix_at(kps, t, l, old, h);
          const double* s2 = prefix_at(kps, t, l, s0, h);
          for (std::int32_t d = 0; d < D; ++d) mu[static_cast<std::size_t>(d)] = (s1[d] - s2[d]) / (old - s0);
        }
        for (std::int32_t j = 0; j < n; ++j) {
          const float* k = t.krow(l, j, h);
          double full = 0, err = 0;
          for (std::int32_t d = 0; d < D; ++d) full += static_cast<double>(q[d]) * k[d];
          if (j >= s0 && j < old)
            for (std::int32_t d = 0; d < D; ++d) err += qa[static_cast<std::size_t>(d)] * (k[d] - mu[static_cast<std::size_t>(d)]);
          a[static_cast<std::size_t>(j)] = full * scale;
          b[static_cast<std::size_t>(j)] = (full - err) * scale;
        }
        kls.push_back(kvkit::kl_from_logits(a.data(), b.data(), n));
      }
  }
  return kls;
}

void basis_tables(const std::vector<Trace>& traces, std::int32_t W) {
  std::printf("\n## offline: per-head basis (mean-compensated), attention KL, W=%d, sink=%d\n\n", W, g_sink);
  std::printf("| trace | tokens | basis | pruned | rK/D | median KL | p90 KL |\n|---|---|---|---|---|---|---|\n");
  for (const Trace& t : traces) {
    if (t.D < 16) continue;
    const std::vector<double> kps = prefix_sums(t, false);
    for (bool qa : {false, true}) {
      const Basis bs = make_basis(t, qa);
      for (double pr : {0.25, 0.375, 0.5, 0.625, 0.75}) {
        const std::int32_t r = std::max(1, static_cast<std::int32_t>(std::lround(t.D * (1 - pr))));
        const auto kl = basis_kls(t, bs, r, W, kps);
        std::printf("| %s | %d | %s | %.1f%% | %d/%d | %.3g | %.3g |\n", t.name.c_str(), t.n, qa ? "qPCA" : "PCA",
                    pr * 100, r, t.D, quantile(kl, 0.5), quantile(kl, 0.9));
        std::fflush(stdout);
      }
    }
  }
}

int run_fidelity(const std::string& models, std::int32_t W, std::int32_t steps, const std::string& kind,
                 std::int32_t max_prompts) {
  std::vector<Trace> traces;
  if (!g_smol_only) traces.push_back(synthetic_trace());
#if defined(KVKIT_BENCH_KVCHAN_ENGINE)
  const std::string stories = models + "/stories260K.bin", smol = models + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (g_smol_only) {
  } else if (std::filesystem::exists(stories)) {
    auto ck = std::make_shared<const engine::Checkpoint>(engine::load_checkpoint(stories));
    traces.push_back(engine_trace("stories260K", ck, {engine::kBosToken}, g_small ? 64 : 400));
  } else {
    std::printf("stories260K skipped: no model file %s\n", stories.c_str());
  }
  const std::string suite = std::string(KVKIT_BENCH_SOURCE_DIR) + "/../examples/prompts/suite.json";
  if (std::filesystem::exists(smol) && !g_small) {
    const engine::GgufFile g = engine::GgufFile::open(smol);
    auto ck = std::make_shared<const engine::Checkpoint>(engine::load_gguf_checkpoint(g));
    const engine::Tokenizer tok = engine::Tokenizer::from_gguf(g);
    const engine::ChatTemplate tmpl = engine::ChatTemplate::from_gguf(g);
    std::ifstream f(suite);
    const nlohmann::json j = nlohmann::json::parse(f);
    std::int32_t used = 0;
    for (const auto& p : j.at("prompts")) {
      if (p.value("kind", "") != kind || used >= max_prompts) continue;
      ++used;
      const auto prompt = tmpl.encode(tok, {{"user", p.at("turns").at(0).get<std::string>()}}, true);
      traces.push_back(engine_trace("SmolLM2/" + p.at("id").get<std::string>(), ck, prompt, steps));
    }
  } else {
    std::printf("SmolLM2 skipped: no model file %s (or --kvkit_small)\n", smol.c_str());
  }
#else
  (void)models;
  (void)steps;
  (void)kind;
  (void)max_prompts;
#endif
  g_sink = g_sinks.front();
  if (!g_resid_bits.empty()) {
    residual_tables(traces, W);
    return 0;
  }
  if (!g_basis_only) fidelity_tables(traces, W);
  if (!g_no_basis) basis_tables(traces, W);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool fidelity = false;
  std::string models = "../shared/models";
  std::int32_t W = 32, steps = 64, max_prompts = 3;
  std::string kind = "code";
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--kvkit_small") g_small = true;
    else if (a == "--kvkit_fidelity") fidelity = true;
    else if (a == "--kvkit_smol_only") g_smol_only = true;
    else if (a == "--kvkit_basis_only") g_basis_only = true;
    else if (a.rfind("--kvkit_sink=", 0) == 0) g_sinks = {std::stoi(a.substr(13))};
    else if (a.rfind("--kvkit_sinks=", 0) == 0) g_sinks = parse_list<std::int32_t>(a.substr(14));
    else if (a.rfind("--kvkit_prune=", 0) == 0) {
      g_prune.clear();
      for (double x : parse_list<double>(a.substr(14))) g_prune.push_back(x / 100);
    }
    else if (a == "--kvkit_calib_skip_sink") g_calib_skip_sink = true;
    else if (a == "--kvkit_no_vtable") g_no_vtable = true;
    else if (a == "--kvkit_no_basis") g_no_basis = true;
    else if (a == "--kvkit_per_layer") g_per_layer = true;
    else if (a.rfind("--kvkit_resid_bits=", 0) == 0) g_resid_bits = parse_list<std::int32_t>(a.substr(19));
    else if (a.rfind("--kvkit_models=", 0) == 0) models = a.substr(15);
    else if (a.rfind("--kvkit_window=", 0) == 0) W = std::stoi(a.substr(15));
    else if (a.rfind("--kvkit_steps=", 0) == 0) steps = std::stoi(a.substr(14));
    else if (a.rfind("--kvkit_prompts=", 0) == 0) kind = a.substr(16);
    else if (a.rfind("--kvkit_max_prompts=", 0) == 0) max_prompts = std::stoi(a.substr(20));
    else rest.push_back(argv[i]);
  }
  if (fidelity) return run_fidelity(models, W, steps, kind, max_prompts);
  // One attention benchmark: mode 0 drop, 1 key compensation, 4 / 8 residual bits (the
  // name's family), dram (_dram), dtype (1: _f16, 2: _bf16 pages), packed pages scattered
  // (_scattered); see packed_vs_dense.
  auto attn = [](std::int64_t B, int rk, int rv, int mode, int dram, int dtype, int scattered = 0) {
    const std::string family = mode == 1   ? std::string("kvchan_attn_kcomp")
                               : mode == 0 ? std::string("kvchan_attn")
                                           : "kvchan_attn_resid" + std::to_string(mode);
    const std::string name = family + (dram ? "_dram" : "") + (dtype == 1 ? "_f16" : dtype == 2 ? "_bf16" : "") +
                             (scattered ? "_scattered" : "") +
                             "/B" + std::to_string(B) +
                             "/S4096/rK" + std::to_string(rk) + "/rV" + std::to_string(rv);
    benchmark::RegisterBenchmark(name.c_str(), BM_packed_vs_dense)
        ->Args({B, 4096, rk, rv, mode, dram, dtype, scattered})
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  };
  for (std::int64_t B : {1, 8})
    for (auto rr : {std::pair<int, int>{32, 64}, {16, 64}, {32, 32}, {16, 32}, {48, 48}}) attn(B, rr.first, rr.second, 0, 0, 0);
  // Key compensation on (the lse bias of channel_attention), at the K-only operating points.
  for (std::int64_t B : {1, 8})
    for (int rk : {48, 40, 32}) attn(B, rk, 64, 1, 0, 0);
  // The residual (8 / 4 bits) at its end-to-end operating points.
  for (std::int64_t B : {1, 8})
    for (int bits : {8, 4})
      for (int r : {16, 32}) attn(B, r, r, bits, 0, 0);
  // KV from DRAM (layers rotated over twice the last-level cache): dropping and the residual.
  for (std::int64_t B : {1, 8})
    for (int bits : {0, 8, 4})
      for (int r : {16, 32}) attn(B, r, r, bits, 1, 0);
  // float16 pages (the end-to-end runs' type), then bfloat16 pages, B 8, from L3 and DRAM.
  for (int dtype : {1, 2})
    for (int dram : {0, 1})
      for (int bits : {0, 8, 4})
        for (int r : {16, 32}) attn(8, r, r, bits, dram, dtype);
  // float16 pages again with the packed pages scattered over their pool like the dense ones.
  for (int dram : {0, 1})
    for (int bits : {0, 8, 4})
      for (int r : {16, 32}) attn(8, r, r, bits, dram, 1, 1);
  for (int op : {0, 1})
    for (auto rr : {std::pair<int, int>{32, 64}, {16, 32}})
      benchmark::RegisterBenchmark((std::string(op == 0 ? "kvchan_pack" : "kvchan_unpack") + (g_small ? "/T512/rK" : "/T4096/rK") +
                                    std::to_string(rr.first) + "/rV" + std::to_string(rr.second) + "/threads1vs2")
                                       .c_str(),
                                   BM_pack_threads)
          ->Args({op, rr.first, rr.second})
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
