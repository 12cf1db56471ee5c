// bench_eps: the Sketcher (sketch/eps.hpp) against Quest's box bound on the same data.
//
// Traces: synthetic long contexts with needles (page size 16, 4K..64K tokens, head dim
// 128, keys = mean + low-rank drifting topic + noise, four planted needle keys, queries
// aimed at one needle) and stories260K decode traces (every layer and kv head after a
// greedy run, its two query heads). Per trace and query:
//   - pages ranked by each bound (box = Quest, FD, JL estimate, 1-PC estimate, strict =
//     min(box, norm, FD)): pages needed for 100 % recall of the top-10 tokens;
//   - attention-output relative error (float64) when reading the last page plus the top
//     pages of each ranking at fixed budgets;
//   - the certified pre-pass (ε = 1e-3): pages visited with box-only bounds vs strict FD;
//   - metadata bytes per page of each summary;
// and on the 64K trace: pre-pass time / dense decode time, page-subset attention bytes/s
// vs dense and vs the read floor of the same pages (a plain sum of their bytes, best of
// several prefetch distances) (same process, single thread, min of repeats). Plain program (no Google
// Benchmark: it reports tables of ratios, not one timed loop); --small for a smoke run.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <sys/mman.h>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "read_floor.hpp"
#include "kvkit/sketch/eps.hpp"
#include "kvkit/sketch/eps_twin.hpp"
#ifdef KVKIT_BENCH_EPS_ENGINE
#include "engine/engine.hpp"
#endif

namespace sk = kvkit::sketch;

namespace {

struct Trace {
  std::string name;
  std::int32_t d = 0, P = 16, n = 0;
  std::vector<float> k, v;               // [n, d]
  std::vector<std::vector<float>> qs;    // queries [d]
  float scale = 0;
};

// This thread's CPU time: the timed code is single-threaded and the build machine is
// shared, so wall time would charge other processes' time slices.
double now() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Single-sequence, one-head paged view over the trace's keys (page i = physical page i).
// --huge: the K/V pools in 2 MiB-aligned memory advised for transparent huge pages (a
// host's choice: a page subset then costs no page walk per 4 KiB OS page it touches).
bool g_huge = false;
struct PoolMem {
  float* p = nullptr;
  std::size_t n = 0;
  void alloc(std::size_t floats) {
    const std::size_t bytes = (floats * sizeof(float) + (std::size_t{2} << 20) - 1) / (std::size_t{2} << 20) * (std::size_t{2} << 20);
    p = static_cast<float*>(std::aligned_alloc(std::size_t{2} << 20, bytes));
#ifdef MADV_HUGEPAGE
    if (g_huge) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    n = floats;
    std::fill(p, p + floats, 0.f);
  }
  ~PoolMem() { std::free(p); }
  float* data() { return p; }
  float* begin() { return p; }
};
struct TraceView {
  PoolMem kp, vp;
  std::vector<std::int32_t> indptr, indices, last;
  kvkit::PagedKVView<float> view;
  explicit TraceView(const Trace& t) {
    const std::int32_t np = (t.n + t.P - 1) / t.P;
    kvkit::KVGeometry g{1, t.d, t.P, np, 0};
    const kvkit::KVStrides s = kvkit::packed_strides(g, kvkit::KVLayout::kNHD);
    kp.alloc(static_cast<std::size_t>(s.page) * np);
    vp.alloc(static_cast<std::size_t>(s.page) * np);
    std::copy(t.k.begin(), t.k.end(), kp.begin());
    std::copy(t.v.begin(), t.v.end(), vp.begin());
    indptr = {0, np};
    indices.resize(static_cast<std::size_t>(np));
    std::iota(indices.begin(), indices.end(), 0);
    last = {t.n - (np - 1) * t.P};
    view = kvkit::make_csr_view(g, kp.data(), s, vp.data(), s,
                                kvkit::CsrPageTable{indptr.data(), indices.data(), last.data(), 1});
  }
};

Trace synthetic_trace(std::int32_t n, std::uint64_t seed, std::int32_t queries) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Trace t;
  t.d = 128;
  t.n = n;
  t.scale = 1.f / std::sqrt(128.f);
  t.name = "synthetic " + std::to_string(n / 1024) + "K";
  const int d = t.d, r = 8;
  std::vector<float> mu(d), A(static_cast<std::size_t>(d) * r), c(r);
  for (int i = 0; i < d; ++i) mu[i] = (i % 16 == 0 ? 3.f : 0.3f) * nd(rng);
  for (float& x : A) x = nd(rng) / std::sqrt(float(r));
  t.k.resize(static_cast<std::size_t>(n) * d);
  t.v.resize(t.k.size());
  for (std::int32_t i = 0; i < n; ++i) {
    if (i % t.P == 0)
      for (float& x : c) x = nd(rng);  // the page's topic
    for (int a = 0; a < d; ++a) {
      float x = mu[a];
      for (int b = 0; b < r; ++b) x += A[a * r + b] * (c[b] + 0.3f * nd(rng));
      t.k[static_cast<std::size_t>(i) * d + a] = x + 0.3f * nd(rng);
      t.v[static_cast<std::size_t>(i) * d + a] = nd(rng);
    }
  }
  // Needles: unit directions planted at random positions; each query aims at one.
  std::vector<std::vector<float>> dirs;
  for (int nn = 0; nn < 4; ++nn) {
    std::vector<float> u(d);
    double s = 0;
    for (float& x : u) {
      x = nd(rng);
      s += double(x) * x;
    }
    for (float& x : u) x /= float(std::sqrt(s));
    const std::int32_t pos = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n - t.P));
    for (int a = 0; a < d; ++a) t.k[static_cast<std::size_t>(pos) * d + a] = mu[a] + 6.f * u[a];
    dirs.push_back(u);
  }
  for (std::int32_t qi = 0; qi < queries; ++qi) {
    const auto& u = dirs[static_cast<std::size_t>(qi) % dirs.size()];
    std::vector<float> q(d);
    for (int a = 0; a < d; ++a) q[a] = 22.f * (u[a] + 0.03f * nd(rng));
    t.qs.push_back(q);
  }
  return t;
}

constexpr int kMethods = 6;  // ranking columns: box, strict, fd, jl, 1pc, rbox
constexpr int kWalkBounds = 9;  // certified-walk columns (kWalkNames)
const char* const kWalkNames[kWalkBounds] = {"box+norm", "rbox (box,norm,rot)", "rot+norm (no axis box)",
                                             "centred norm", "min(all certified)", "int4 tokens (page mass)",
                                             "int8 tokens (page mass)", "oracle max logit", "oracle page mass"};
const double kWalkEps[3] = {1e-3, 1e-2, 1e-1};
const double kCodeEps[2] = {1e-3, 1e-2};

struct Row {
  std::string trace;
  std::int32_t pages = 0;
  // pages for 100 % top-10 recall: box, strict, fd, jl, 1pc, rbox
  double recall_pages[kMethods] = {};
  double err[3][kMethods] = {};  // [budget][method]
  double visited_box = 0, visited_strict = 0, visited_jl = 0, visited_rbox = 0;
  // Strict walks at eps 1e-3 / 1e-2 (kCodeEps): box-only, codes at 4 and 8 bits.
  double code_box[2] = {}, code4[2] = {}, code8[2] = {};
  double walk[3][kWalkBounds] = {};  // [eps][bound] pages visited by the certified walk
  double slack_nats[kWalkBounds] = {};  // mean over queries and pages of s·(U - true max)
  std::int32_t queries = 0;
};

// The pre-pass's ε rule for one query head and a single sequence (last page always read,
// groups of one page) over arbitrary per-page upper bounds ub[j] on max q·k: pages visited.
std::int32_t walk_pages(const Trace& t, const std::vector<double>& logit, const std::vector<double>& ub, double eps) {
  const std::int32_t np = (t.n + t.P - 1) / t.P, nc = np - 1;
  double mx = -1e300;
  for (std::int32_t i = (np - 1) * t.P; i < t.n; ++i) mx = std::max(mx, logit[i]);
  double S = 0;
  for (std::int32_t i = (np - 1) * t.P; i < t.n; ++i) S += std::exp(logit[i] - mx);
  std::vector<double> lub(static_cast<std::size_t>(nc));
  double ref = mx;
  for (std::int32_t j = 0; j < nc; ++j) {
    lub[j] = std::log(double(t.P)) + t.scale * ub[j];
    ref = std::max(ref, lub[j]);
  }
  std::vector<sk::detail::Mass128> w(static_cast<std::size_t>(nc));
  sk::detail::Mass128 W;
  for (std::int32_t j = 0; j < nc; ++j) {
    w[j] = sk::detail::quantise_mass(lub[j] - ref);
    W.add(w[j]);
  }
  std::vector<std::int32_t> ord(static_cast<std::size_t>(nc)), out(static_cast<std::size_t>(nc));
  const sk::detail::WalkResult r = sk::detail::certified_walk(
      lub.data(), w.data(), W, nc, S * std::exp(mx - ref), eps, nc, 0, ord.data(), out.data(), [&](std::int32_t j) {
        double m = 0;
        for (std::int32_t i = j * t.P; i < (j + 1) * t.P; ++i) m += std::exp(logit[i] - 1e-12 * std::fabs(logit[i]) - ref);
        return m;
      });
  return r.visited + 1;
}

// Page j's mass bound from `bits`-bit per-token keys: each channel c of the page is coded on
// 2^bits levels over the page's own [min_c, max_c] (the box), k̂ the level's midpoint, so
// |k_c − k̂_c| <= Δ_c / 2 and q·k <= q·k̂ + Σ_c |q_c| Δ_c / 2 =: U_t for every token. The
// page's mass is then <= Σ_t exp(s·U_t); returned as the max-logit bound U with
// P·exp(s·U) equal to that sum (what walk_pages takes). Double arithmetic, 1e-9 margin.
double quant_mass_bound(const Trace& t, std::int32_t j, const std::vector<float>& q, int bits, double ref) {
  const int d = t.d, levels = 1 << bits;
  const std::int32_t i0 = j * t.P, i1 = std::min(t.n, (j + 1) * t.P);
  double slack = 0, sum = 0;
  std::vector<double> lo(static_cast<std::size_t>(d), 1e300), step(static_cast<std::size_t>(d));
  for (std::int32_t i = i0; i < i1; ++i)
    for (int c = 0; c < d; ++c) lo[c] = std::min(lo[c], double(t.k[static_cast<std::size_t>(i) * d + c]));
  for (int c = 0; c < d; ++c) {
    double hi = -1e300;
    for (std::int32_t i = i0; i < i1; ++i) hi = std::max(hi, double(t.k[static_cast<std::size_t>(i) * d + c]));
    step[c] = (hi - lo[c]) / levels;
    slack += std::fabs(double(q[c])) * step[c] / 2;
  }
  for (std::int32_t i = i0; i < i1; ++i) {
    double u = slack;
    for (int c = 0; c < d; ++c) {
      const double x = t.k[static_cast<std::size_t>(i) * d + c];
      const double code = step[c] > 0 ? std::min<double>(levels - 1, std::floor((x - lo[c]) / step[c])) : 0;
      u += double(q[c]) * (lo[c] + (code + 0.5) * step[c]);
    }
    sum += std::exp(t.scale * u - ref);
  }
  const double U = (std::log(sum) + ref - std::log(double(t.P))) / t.scale;
  return U + 1e-9 * std::fabs(U);
}

const double kBudgets[3] = {0.02, 0.05, 0.10};

// One trace: every analysis but timing. `g` pages per group (bounds per group).
Row analyse(const Trace& t, std::int32_t m, std::int32_t l) {
  TraceView tv(t);
  const auto& view = tv.view;
  const std::int32_t np = view.num_pages(0), d = t.d;
  sk::SketchParams p;
  p.method = sk::SketchMethod::kFD;
  p.jl_dim = m;
  p.fd_rows = l;
  sk::SketchStore store(p, 1, 1, d, t.P, np);
  store.sync(0, view);
  Row row;
  row.trace = t.name;
  row.pages = np;
  std::vector<double> logit(static_cast<std::size_t>(t.n));
  std::vector<double> ub[kMethods];
  for (auto& u : ub) u.resize(static_cast<std::size_t>(np));
  // The rotated box (basis fitted from all of the trace's keys at the first sync).
  sk::SketchParams rp;
  rp.method = sk::SketchMethod::kRotBox;
  sk::SketchStore rstore(rp, 1, 1, d, t.P, np);
  rstore.sync(0, view);
  std::vector<float> qr(static_cast<std::size_t>(d));
  std::vector<double> rwork(2 * static_cast<std::size_t>(d));
  // Centred norm: q·c + ‖q‖·max‖k − c‖, c = the page's first key (what a K-write path
  // can keep); computed here in double with a 1e-9 relative margin (bench only).
  std::vector<double> cmax(static_cast<std::size_t>(np), 0.0);
  for (std::int32_t j = 0; j < np; ++j)
    for (std::int32_t i = j * t.P; i < std::min(t.n, (j + 1) * t.P); ++i) {
      double r2 = 0;
      for (int c = 0; c < d; ++c) {
        const double x = double(t.k[static_cast<std::size_t>(i) * d + c]) - t.k[static_cast<std::size_t>(j) * t.P * d + c];
        r2 += x * x;
      }
      cmax[j] = std::max(cmax[j], std::sqrt(r2));
    }
  std::vector<double> wub[kWalkBounds];
  for (auto& u : wub) u.resize(static_cast<std::size_t>(np));
  for (const auto& q : t.qs) {
    double qn = 0;
    for (float x : q) qn += double(x) * x;
    qn = std::sqrt(qn);
    std::vector<double> z(static_cast<std::size_t>(m), 0.0);
    for (int c = 0; c < d; ++c)
      for (int a = 0; a < m; ++a) z[a] += double(q[c]) * store.phi(0)[c * m + a];
    const sk::detail::RotQuery rq =
        sk::detail::rotate_query(rstore.basis(0, 0), rstore.basis_eps(0, 0), d, q.data(), qn, qr.data(), rwork.data());
    double mx = -1e300;
    for (std::int32_t i = 0; i < t.n; ++i) {
      double s = 0;
      for (int c = 0; c < d; ++c) s += double(q[c]) * t.k[static_cast<std::size_t>(i) * d + c];
      logit[i] = s * t.scale;
      mx = std::max(mx, logit[i]);
    }
    for (std::int32_t j = 0; j < np; ++j) {
      const std::int32_t r = store.record_of(0, j);
      const sk::GroupBounds gb = sk::group_bounds(store, 0, r, 0, q.data(), qn, z.data());
      const double rot = sk::rot_bound(rstore, 0, rstore.record_of(0, j), 0, qr.data(), rq);
      ub[0][j] = gb.box_hi;
      ub[1][j] = std::min({gb.box_hi, gb.norm, gb.fd});
      ub[2][j] = gb.fd;
      ub[3][j] = gb.jl;
      ub[4][j] = gb.one_pc;
      ub[5][j] = std::min({gb.box_hi, gb.norm, rot});
      double qc = 0, tmax = -1e300;
      for (int c = 0; c < d; ++c) qc += double(q[c]) * t.k[static_cast<std::size_t>(j) * t.P * d + c];
      for (std::int32_t i = j * t.P; i < std::min(t.n, (j + 1) * t.P); ++i) tmax = std::max(tmax, logit[i] / t.scale);
      const double cn = (qc + qn * cmax[j]) * (1 + 1e-9) + 1e-9 * std::fabs(qc);
      wub[0][j] = std::min(gb.box_hi, gb.norm);
      wub[1][j] = ub[5][j];
      wub[2][j] = std::min(rot, gb.norm);
      wub[3][j] = std::min(cn, gb.norm);
      wub[4][j] = std::min({ub[5][j], gb.fd, cn});
      wub[7][j] = tmax;
      double lse = 0;  // the page's exact mass as a bound: log(P) + s·U = log Σ exp(logit)
      for (std::int32_t i = j * t.P; i < std::min(t.n, (j + 1) * t.P); ++i) lse += std::exp(logit[i] - mx);
      wub[8][j] = (std::log(lse) + mx - std::log(double(t.P))) / t.scale + 1e-9 * std::fabs(tmax);
      for (int bits = 4, col = 5; bits <= 8; bits += 4, ++col) wub[col][j] = quant_mass_bound(t, j, q, bits, mx);
      for (int b = 0; b < 8; ++b) row.slack_nats[b] += t.scale * (wub[b][j] - tmax) / np;
    }
    for (int e = 0; e < 3; ++e)
      for (int b = 0; b < kWalkBounds; ++b) row.walk[e][b] += walk_pages(t, logit, wub[b], kWalkEps[e]);
    std::vector<std::int32_t> idx(static_cast<std::size_t>(t.n));
    std::iota(idx.begin(), idx.end(), 0);
    const std::int32_t top = std::min<std::int32_t>(10, t.n);
    std::partial_sort(idx.begin(), idx.begin() + top, idx.end(), [&](std::int32_t a, std::int32_t b) { return logit[a] > logit[b]; });
    // Dense output (float64).
    auto attend = [&](const std::vector<char>& vis, std::vector<double>& o) {
      o.assign(static_cast<std::size_t>(d), 0.0);
      double z0 = 0;
      for (std::int32_t i = 0; i < t.n; ++i) {
        if (!vis[i / t.P]) continue;
        const double w = std::exp(logit[i] - mx);
        z0 += w;
        for (int c = 0; c < d; ++c) o[c] += w * t.v[static_cast<std::size_t>(i) * d + c];
      }
      for (double& x : o) x /= z0;
    };
    std::vector<char> all(static_cast<std::size_t>(np), 1);
    std::vector<double> dense, part;
    attend(all, dense);
    double dn = 0;
    for (double x : dense) dn += x * x;
    for (int mt = 0; mt < kMethods; ++mt) {
      std::vector<std::int32_t> order;
      for (std::int32_t j = 0; j < np - 1; ++j) order.push_back(j);
      std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return ub[mt][a] > ub[mt][b]; });
      std::vector<std::int32_t> rank(static_cast<std::size_t>(np), 0);
      for (std::size_t i = 0; i < order.size(); ++i) rank[order[i]] = static_cast<std::int32_t>(i) + 2;  // last page is 1
      rank[np - 1] = 1;
      std::int32_t need = 1;
      for (std::int32_t i = 0; i < top; ++i) need = std::max(need, rank[idx[i] / t.P]);
      row.recall_pages[mt] += need;
      for (int bi = 0; bi < 3; ++bi) {
        const std::int32_t budget = std::max<std::int32_t>(2, static_cast<std::int32_t>(std::lround(kBudgets[bi] * np)));
        std::vector<char> vis(static_cast<std::size_t>(np), 0);
        vis[np - 1] = 1;
        for (std::int32_t i = 0; i + 1 < budget && i < static_cast<std::int32_t>(order.size()); ++i) vis[order[i]] = 1;
        attend(vis, part);
        double e = 0;
        for (int c = 0; c < d; ++c) e += (part[c] - dense[c]) * (part[c] - dense[c]);
        row.err[bi][mt] += std::sqrt(e / dn);
      }
    }
    ++row.queries;
  }
  // Certified pre-pass (ε = 1e-3): box-only vs strict FD; default-mode JL for reference.
  auto visited = [&](sk::SketchMethod mt, bool strict, double eps = 1e-3, std::int32_t bits = 4) {
    sk::SketchParams sp;
    sp.method = mt;
    sp.strict = strict;
    sp.eps = eps;
    sp.code_bits = bits;
    sp.jl_dim = m;
    sp.fd_rows = l;
    sp.score_fraction = 1;  // the rule's own pruning, without the scoring cap
    sk::SketchStore st(sp, 1, 1, d, t.P, np);
    st.sync(0, view);
    sk::SketchSelector sel(st);
    sel.reserve(1, 1, np);
    double v = 0;
    for (const auto& q : t.qs) {
      sk::SketchTelemetry tel;
      if (!sel.select(0, view, q.data(), 1, t.scale, &tel).is_ok()) return -1.0;
      v += static_cast<double>(tel.pages_visited);
    }
    return v;
  };
  row.visited_box = visited(sk::SketchMethod::kBox, true);
  row.visited_strict = visited(sk::SketchMethod::kFD, true);
  row.visited_jl = visited(sk::SketchMethod::kJL, false);
  row.visited_rbox = visited(sk::SketchMethod::kRotBox, true);
  for (int e = 0; e < 2; ++e) {
    row.code_box[e] = visited(sk::SketchMethod::kBox, true, kCodeEps[e]);
    row.code4[e] = visited(sk::SketchMethod::kCodes, true, kCodeEps[e], 4);
    row.code8[e] = visited(sk::SketchMethod::kCodes, true, kCodeEps[e], 8);
  }
  return row;
}

template <class F>
double best_of(int reps, F f) {
  double b = 1e300;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    f();
    b = std::min(b, now() - t0);
  }
  return b;
}

// --cold: before every timed repetition, read a buffer larger than the last-level cache,
// so dense and subset attention both start from DRAM (without it a small subset stays
// cached between repetitions and reads faster than DRAM allows).
bool g_cold = false;
// --rows STR: the 64K timing table runs only the pre-pass rows whose name contains STR
// (for profiling one configuration).
std::string g_rows;
int g_reps = 7;  // --reps N: best of N in the 64K timing table
std::vector<float>& evict_buffer() {
  // 256 MiB, or twice the last-level cache where that is larger (260 MiB of L3 on the
  // Xeon CI now runs on: a fixed 256 MiB left small subsets cached there).
  static std::vector<float> b(kvkit::bench::dram_rotation_bytes(std::size_t{256} << 20) / sizeof(float), 1.f);
  return b;
}
float g_sink = 0;
void evict() {
  if (!g_cold) return;
  auto& b = evict_buffer();
  float s = 0;
  for (std::size_t i = 0; i < b.size(); i += 16) s += b[i];
  g_sink += s;
}

template <class F>
double best_of_cold(int reps, F f) {
  double b = 1e300;
  for (int i = 0; i < reps; ++i) {
    evict();
    const double t0 = now();
    f();
    b = std::min(b, now() - t0);
  }
  return b;
}

// The read floor of a page list: a plain sum of every 8-byte word of the listed pages' K
// and V rows (one kv head, the rows contiguous per page as TraceView lays them out), in
// list order: the bytes page-subset attention reads, with no arithmetic on them. With
// `ahead` > 0 the pages `ahead` places later are prefetched whole while a page is summed
// (scattered pages are where the hardware prefetchers cannot follow).
std::uint64_t page_read_floor(const kvkit::PagedKVView<float>& view, const std::int32_t* pages,  // [n]
                              std::size_t n, std::size_t ahead) {
  // Logical page lp's K and V rows of kv head 0 and their bytes (each side).
  struct Rows {
    const float* k;
    const float* v;
    std::size_t bytes;
  };
  auto rows_of = [&](std::int32_t lp) {
    const std::int32_t t0 = lp * view.page_size;
    return Rows{view.k_ptr(0, t0, 0), view.v_ptr(0, t0, 0),
                static_cast<std::size_t>(kvkit::sketch::twin::page_tokens(view.seq_len(0), view.page_size, lp)) *
                    view.head_dim * sizeof(float)};
  };
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (ahead > 0 && i + ahead < n) {
      const Rows r = rows_of(pages[i + ahead]);
      // Into L2 (prefetcht1), as the attention kernel does: an L1 prefetch holds one of
      // the few L1 miss buffers until its line arrives.
      for (const float* base : {r.k, r.v})
        for (std::size_t o = 0; o < r.bytes; o += 64) __builtin_prefetch(reinterpret_cast<const char*>(base) + o, 0, 2);
    }
    const Rows r = rows_of(pages[i]);
    for (const float* base : {r.k, r.v}) s += kvkit::bench::sum_words(reinterpret_cast<const std::uint64_t*>(base), 0, r.bytes / 8);
  }
  return s;
}

void timing(const Trace& t, std::int32_t m, std::int32_t l, int reps) {
  TraceView tv(t);
  const auto& view = tv.view;
  const std::int32_t np = view.num_pages(0);
  const kvkit::exec::Host ex{1};
  kvkit::DecodeAttentionParams ap{1, t.scale};
  std::vector<unsigned char> ws(kvkit::paged_decode_attention_workspace_size(ex, view, ap));
  std::vector<float> out(static_cast<std::size_t>(t.d));
  const float* q = t.qs[0].data();
  const double dense = best_of_cold(reps, [&] {
    (void)kvkit::paged_decode_attention(ex, view, q, out.data(), ap, kvkit::Workspace{ws.data(), ws.size()});
  });
  const double dense_bytes = static_cast<double>(t.n) * 2 * t.d * 4;
  std::printf("\n64K timing (%s, d=%d, %d pages, 1 thread, thread CPU time, best of %d%s): dense decode %.3f ms (%.2f GB/s)\n",
              t.name.c_str(), t.d, np, reps, g_cold ? ", caches evicted before each run" : "", dense * 1e3,
              dense_bytes / dense / 1e9);
  std::printf("| pre-pass | pages visited | groups scored | pre-pass ms | pre-pass / dense | subset attn ms | subset GB/s / dense GB/s |\n|---|---|---|---|---|---|---|\n");
  struct Cfg {
    const char* name;
    sk::SketchMethod method;
    bool strict;
    std::int32_t g, budget;
    double fraction;  // SketchParams::score_fraction (1: the plain ε rule)
    double eps;
    std::int32_t bits;  // kCodes
  };
  const double def = sk::SketchParams{}.score_fraction;
  const Cfg cfgs[] = {{"strict box g=1, plain eps rule", sk::SketchMethod::kBox, true, 1, 0, 1.0, 1e-3, 4},
                      {"strict box g=1, default score_fraction", sk::SketchMethod::kBox, true, 1, 0, def, 1e-3, 4},
                      {"strict box g=1, score budget 1", sk::SketchMethod::kBox, true, 1, 1, 1.0, 1e-3, 4},
                      {"strict FD g=1, plain eps rule", sk::SketchMethod::kFD, true, 1, 0, 1.0, 1e-3, 4},
                      {"strict FD g=1, default score_fraction", sk::SketchMethod::kFD, true, 1, 0, def, 1e-3, 4},
                      {"strict rbox g=1, plain eps rule", sk::SketchMethod::kRotBox, true, 1, 0, 1.0, 1e-3, 4},
                      {"strict rbox g=1, default score_fraction", sk::SketchMethod::kRotBox, true, 1, 0, def, 1e-3, 4},
                      {"strict box g=4, plain eps rule", sk::SketchMethod::kBox, true, 4, 0, 1.0, 1e-3, 4},
                      {"strict box g=4, default score_fraction", sk::SketchMethod::kBox, true, 4, 0, def, 1e-3, 4},
                      {"default JL g=1 (alpha 1.1), plain eps rule", sk::SketchMethod::kJL, false, 1, 0, 1.0, 1e-3, 4},
                      {"default JL g=1 (alpha 1.1), default score_fraction", sk::SketchMethod::kJL, false, 1, 0, def, 1e-3, 4},
                      {"default 1-PC g=1 (alpha 1.1), plain eps rule", sk::SketchMethod::kOnePC, false, 1, 0, 1.0, 1e-3, 4},
                      {"strict codes 4 bit g=1 (no keys read)", sk::SketchMethod::kCodes, true, 1, 0, 1.0, 1e-3, 4},
                      {"strict codes 8 bit g=1 (no keys read)", sk::SketchMethod::kCodes, true, 1, 0, 1.0, 1e-3, 8},
                      {"strict box g=1, eps 1e-2, default score_fraction", sk::SketchMethod::kBox, true, 1, 0, def, 1e-2, 4},
                      {"strict codes 4 bit g=1, eps 1e-2", sk::SketchMethod::kCodes, true, 1, 0, 1.0, 1e-2, 4},
                      {"strict codes 8 bit g=1, eps 1e-2", sk::SketchMethod::kCodes, true, 1, 0, 1.0, 1e-2, 8}};
  double sync_s = 0, sync_rbox = 0;
  for (const Cfg& c : cfgs) {
    if (!g_rows.empty() && std::string(c.name).find(g_rows) == std::string::npos) continue;
    sk::SketchParams sp;
    sp.method = c.method;
    sp.strict = c.strict;
    sp.eps = c.eps;
    sp.code_bits = c.bits;
    sp.jl_dim = m;
    sp.fd_rows = l;
    sp.group_pages = c.g;
    sp.score_budget = c.budget;
    sp.score_fraction = c.fraction;
    sk::SketchStore st(sp, 1, 1, t.d, t.P, np);
    const double s1 = best_of(1, [&] { st.sync(0, view); });
    if (sync_s == 0) sync_s = s1;
    if (c.method == sk::SketchMethod::kRotBox && sync_rbox == 0) sync_rbox = s1;
    sk::SketchSelector sel(st);
    sel.reserve(1, 1, np);
    sk::SketchTelemetry tel;
    const double pre = best_of_cold(reps, [&] { (void)sel.select(0, view, q, 1, t.scale, &tel); });
    kvkit::DecodeAttentionParams sp2 = ap;
    sp2.page_subset_indptr = sel.indptr();
    sp2.page_subset = sel.subset();
    const double sub = best_of_cold(reps, [&] {
      (void)kvkit::paged_decode_attention(ex, view, q, out.data(), sp2, kvkit::Workspace{ws.data(), ws.size()});
    });
    const double sub_bytes = static_cast<double>(tel.bytes_kv_read_est);
    std::printf("| %s | %lld / %d | %lld | %.3f | %.4f | %.3f | %.2f |\n", c.name, static_cast<long long>(tel.pages_visited),
                np, static_cast<long long>(tel.groups_scored), pre * 1e3, pre / dense, sub * 1e3,
                (sub_bytes / sub) / (dense_bytes / dense));
  }
  std::printf("(summarising all %d tokens once: %.1f ms, %.2f us/token/head, all five summaries; with the rotated box "
              "(rbox, basis fit included) %.1f ms, %.2f us/token/head)\n", t.n, sync_s * 1e3, sync_s / t.n * 1e6,
              sync_rbox * 1e3, sync_rbox / t.n * 1e6);
  {
    // GQA: 4 query heads on the one kv head; the box is read once for the four.
    const std::int32_t G = 4;
    std::vector<float> q4(static_cast<std::size_t>(G) * t.d);
    for (std::int32_t g = 0; g < G; ++g)
      for (std::int32_t c = 0; c < t.d; ++c) q4[static_cast<std::size_t>(g) * t.d + c] = q[(c + 7 * g) % t.d];
    kvkit::DecodeAttentionParams a4{G, t.scale};
    std::vector<unsigned char> ws4(kvkit::paged_decode_attention_workspace_size(ex, view, a4));
    std::vector<float> out4(static_cast<std::size_t>(G) * t.d);
    const double dense4 = best_of_cold(reps, [&] {
      (void)kvkit::paged_decode_attention(ex, view, q4.data(), out4.data(), a4, kvkit::Workspace{ws4.data(), ws4.size()});
    });
    sk::SketchParams sp;  // the defaults: strict box, score_fraction 0.25
    sp.eps = 1e-3;
    sk::SketchStore st(sp, 1, 1, t.d, t.P, np);
    st.sync(0, view);
    sk::SketchSelector sel(st);
    sel.reserve(1, G, np);
    sk::SketchTelemetry tel;
    const double pre = best_of_cold(reps, [&] { (void)sel.select(0, view, q4.data(), G, t.scale, &tel); });
    std::printf("| strict box g=1, default score_fraction, GQA 4 query heads (dense %.3f ms) | %lld / %d | %lld | %.3f | %.4f | - | - |\n",
                dense4 * 1e3, static_cast<long long>(tel.pages_visited), np, static_cast<long long>(tel.groups_scored),
                pre * 1e3, pre / dense4);
  }
  std::uint64_t floor_sink = 0;
  std::vector<std::int32_t> all_pages(static_cast<std::size_t>(np));
  std::iota(all_pages.begin(), all_pages.end(), 0);
  // Each list's floor is the best of plain sums prefetching 0 (the hardware prefetchers
  // alone), 1, 2, 4, 8 or 16 pages ahead.
  auto read_floor = [&](const std::vector<std::int32_t>& pages) {
    double best = 1e300;
    for (std::size_t ahead : {0, 1, 2, 4, 8, 16})
      best = std::min(best, best_of_cold(reps, [&] {
                        floor_sink += page_read_floor(view, pages.data(), pages.size(), ahead);
                      }));
    return best;
  };
  const double dense_floor = read_floor(all_pages);
  std::printf("\n| random page subset | subset attn ms | bytes/s vs dense | read floor ms (the same pages summed) | floor bytes/s vs all pages' floor | attn bytes/s / floor bytes/s |\n|---|---|---|---|---|---|\n");
  std::mt19937_64 rng(7);
  for (double frac : {0.05, 0.10, 0.25, 0.5, 1.0}) {
    std::vector<std::int32_t> sub;
    for (std::int32_t j = 0; j < np; ++j)
      if (std::uniform_real_distribution<double>(0, 1)(rng) < frac || j == np - 1) sub.push_back(j);
    std::vector<std::int32_t> ip = {0, static_cast<std::int32_t>(sub.size())};
    kvkit::DecodeAttentionParams sp2 = ap;
    sp2.page_subset_indptr = ip.data();
    sp2.page_subset = sub.data();
    const double s = best_of_cold(reps, [&] {
      (void)kvkit::paged_decode_attention(ex, view, q, out.data(), sp2, kvkit::Workspace{ws.data(), ws.size()});
    });
    const double bytes = static_cast<double>(sub.size()) * t.P * 2 * t.d * 4;
    const double fl = read_floor(sub);
    std::printf("| %.0f %% (%zu pages) | %.3f | %.2f | %.3f | %.2f | %.2f |\n", frac * 100, sub.size(), s * 1e3,
                (bytes / s) / (dense_bytes / dense), fl * 1e3, (bytes / fl) / (dense_bytes / dense_floor), fl / s);
  }
  g_sink += static_cast<float>(floor_sink & 1);
}

#ifdef KVKIT_BENCH_EPS_ENGINE
// Every (layer, kv head) of a greedy stories260K run after `steps` positions, its query
// heads as the queries.
std::vector<Trace> stories_traces(const std::string& path, int steps, std::int32_t page) {
  using namespace kvkit::engine;
  std::vector<Trace> out;
  auto ck = std::make_shared<const Checkpoint>(load_checkpoint(path));
  EngineOptions o;
  o.page_size = page;
  o.max_batch = 1;
  Engine eng(ck, o);
  const ModelConfig& c = ck->config();
  const int hd = c.head_dim(), grp = c.n_heads / c.n_kv_heads;
  int step = 0;
  eng.set_attention([&](const AttentionCall& call) {
    if (step == steps - 1) {
      for (int h = 0; h < c.n_kv_heads; ++h) {
        Trace t;
        t.d = hd;
        t.P = page;
        t.n = call.view.seq_len(0);
        t.scale = call.params.sm_scale;
        t.name = "stories260K L" + std::to_string(call.layer) + " H" + std::to_string(h);
        for (int i = 0; i < t.n; ++i) {
          const float* k = call.view.k_ptr(0, i, h);
          const float* v = call.view.v_ptr(0, i, h);
          t.k.insert(t.k.end(), k, k + hd);
          t.v.insert(t.v.end(), v, v + hd);
        }
        for (int gq = 0; gq < grp; ++gq) {
          const float* q = call.q + static_cast<std::size_t>(h * grp + gq) * hd;
          t.qs.emplace_back(q, q + hd);
        }
        out.push_back(std::move(t));
      }
    }
    return kvkit::paged_decode_attention(call.exec, call.view, call.q, call.out, call.params, call.workspace);
  });
  eng.add_sequence({1});
  for (step = 0; step < steps; ++step) eng.step();
  return out;
}
#endif

void print_rows(const std::vector<Row>& rows, const char* title) {
  std::printf("\n### %s\n\npages read for 100%% recall of the top-10 tokens (mean over queries; the last page always counts)\n\n", title);
  std::printf("| trace | pages | box (Quest) | strict min(box,norm,FD) | FD | JL est. | 1-PC est. | rbox min(box,norm,rot) |\n|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %d |", r.trace.c_str(), r.pages);
    for (double x : r.recall_pages) std::printf(" %.1f |", x / r.queries);
    std::printf("\n");
  }
  for (int bi = 0; bi < 3; ++bi) {
    std::printf("\nattention-output relative error (float64), last page + top pages, budget %.0f %% of pages (mean over queries)\n\n",
                kBudgets[bi] * 100);
    std::printf("| trace | box (Quest) | strict | FD | JL est. | 1-PC est. | rbox |\n|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      std::printf("| %s |", r.trace.c_str());
      for (double x : r.err[bi]) std::printf(" %.2e |", x / r.queries);
      std::printf("\n");
    }
  }
  std::printf("\ncertified pre-pass, eps = 1e-3 (pages visited, mean per query): box-only vs strict (min(box,norm,FD)); default-mode JL (alpha 1.1) for reference\n\n");
  std::printf("| trace | pages | box-only strict | strict FD | box / strict | default JL | strict rbox | box / rbox |\n|---|---|---|---|---|---|---|---|\n");
  std::vector<double> ratios, rratios;
  for (const Row& r : rows) {
    const double ratio = r.visited_box / std::max(1.0, r.visited_strict);
    const double rratio = r.visited_box / std::max(1.0, r.visited_rbox);
    ratios.push_back(ratio);
    rratios.push_back(rratio);
    std::printf("| %s | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.3f |\n", r.trace.c_str(), r.pages, r.visited_box / r.queries,
                r.visited_strict / r.queries, ratio, r.visited_jl / r.queries, r.visited_rbox / r.queries, rratio);
  }
  std::sort(ratios.begin(), ratios.end());
  std::sort(rratios.begin(), rratios.end());
  if (!ratios.empty()) {
    std::int64_t worse = 0, rworse = 0;
    for (const Row& r : rows) {
      worse += r.visited_strict > r.visited_box ? 1 : 0;
      rworse += r.visited_rbox > r.visited_box ? 1 : 0;
    }
    std::printf("\nmedian box/strict ratio %.2f; traces where strict visits more than box-only: %lld of %zu\n",
                ratios[ratios.size() / 2], static_cast<long long>(worse), rows.size());
    std::printf("median box/rbox ratio %.3f; traces where rbox visits more than box-only: %lld of %zu\n",
                rratios[rratios.size() / 2], static_cast<long long>(rworse), rows.size());
  }
  // The strict selector with per-token codes (method codes) against box-only, per eps.
  std::printf("\nstrict selector (SketchSelector, last page always read): box-only vs per-token codes (method codes, 4 and 8 bits); "
              "pages visited, mean per query\n\n| eps | trace | pages | box-only | codes 4 bit | codes 8 bit | box / codes4 | box / codes8 |\n"
              "|---|---|---|---|---|---|---|---|\n");
  for (int e = 0; e < 2; ++e) {
    std::vector<double> r4, r8;
    std::int64_t worse4 = 0, worse8 = 0;
    for (const Row& r : rows) {
      const double a = r.code_box[e] / std::max(1.0, r.code4[e]), b = r.code_box[e] / std::max(1.0, r.code8[e]);
      r4.push_back(a);
      r8.push_back(b);
      worse4 += r.code4[e] > r.code_box[e] ? 1 : 0;
      worse8 += r.code8[e] > r.code_box[e] ? 1 : 0;
      std::printf("| %g | %s | %d | %.1f | %.1f | %.1f | %.3f | %.3f |\n", kCodeEps[e], r.trace.c_str(), r.pages,
                  r.code_box[e] / r.queries, r.code4[e] / r.queries, r.code8[e] / r.queries, a, b);
    }
    std::sort(r4.begin(), r4.end());
    std::sort(r8.begin(), r8.end());
    std::printf("\neps %g: median box/codes ratio %.3f (4 bit), %.3f (8 bit); traces where codes visit more than box-only: "
                "%lld (4 bit), %lld (8 bit) of %zu\n\n",
                kCodeEps[e], r4[r4.size() / 2], r8[r8.size() / 2], static_cast<long long>(worse4),
                static_cast<long long>(worse8), rows.size());
  }
  // Candidate bounds in the same walk (single query head, last page always read): pages
  // visited per query, median over traces of (box+norm pages) / (candidate pages).
  std::printf("\ncandidate bounds, certified eps walk (pages visited, mean per query; oracle = the true max logit per page, "
              "the best any max-logit bound can do); mean slack s*(U - max logit) in nats\n\n| eps | metric |");
  for (const char* n : kWalkNames) std::printf(" %s |", n);
  std::printf("\n|---|---|");
  for (int b = 0; b < kWalkBounds; ++b) std::printf("---|");
  std::printf("\n");
  for (int e = 0; e < 3; ++e) {
    double med_pages[kWalkBounds], med_ratio[kWalkBounds];
    for (int b = 0; b < kWalkBounds; ++b) {
      std::vector<double> v, rr;
      for (const Row& r : rows) {
        v.push_back(r.walk[e][b] / r.queries);
        rr.push_back(r.walk[e][0] / std::max(1.0, r.walk[e][b]));
      }
      std::sort(v.begin(), v.end());
      std::sort(rr.begin(), rr.end());
      med_pages[b] = v[v.size() / 2];
      med_ratio[b] = rr[rr.size() / 2];
    }
    std::printf("| %g | median pages |", kWalkEps[e]);
    for (double x : med_pages) std::printf(" %.1f |", x);
    std::printf("\n| %g | median box/x |", kWalkEps[e]);
    for (double x : med_ratio) std::printf(" %.3f |", x);
    std::printf("\n");
  }
  std::printf("| - | median slack nats |");
  for (int b = 0; b < 8; ++b) {
    std::vector<double> v;
    for (const Row& r : rows) v.push_back(r.slack_nats[b] / r.queries);
    std::sort(v.begin(), v.end());
    std::printf(" %.2f |", v[v.size() / 2]);
  }
  std::printf(" - |\n");
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, timing_only = false;
  std::string model;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--small") == 0) small = true;
    if (std::strcmp(argv[i], "--timing-only") == 0) timing_only = true;
    if (std::strcmp(argv[i], "--cold") == 0) g_cold = true;
    if (std::strcmp(argv[i], "--huge") == 0) g_huge = true;
    if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc) g_rows = argv[++i];
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) g_reps = std::max(1, std::atoi(argv[++i]));
    if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) model = argv[++i];
  }
  const std::int32_t m = 8, l = 8;
  std::printf("# bench_eps (JL m = %d, FD l = %d, page 16)\n\nmetadata bytes per page and kv head (group of 1 page; /g for groups of g):\n\n", m, l);
  const sk::SummaryBytes sb = sk::summary_bytes(128, m, l), s64 = sk::summary_bytes(64, m, l), s8 = sk::summary_bytes(8, m, l);
  std::printf("| summary | d=128 | d=64 (SmolLM2) | d=8 (stories260K) | vs K+V page (16 tokens, fp32) d=128 |\n|---|---|---|---|---|\n");
  auto line = [&](const char* n, std::int64_t a, std::int64_t b, std::int64_t c) {
    std::printf("| %s | %lld | %lld | %lld | %.2f %% |\n", n, (long long)a, (long long)b, (long long)c, 100.0 * a / (16.0 * 2 * 128 * 4));
  };
  line("box (Quest, fp32 min/max)", sb.box, s64.box, s8.box);
  line("scalars (sum |k|^2, max |k|)", sb.scalars, s64.scalars, s8.scalars);
  line("JL Gram (4 m^2)", sb.jl, s64.jl, s8.jl);
  line("FD (centre + rows: 4 l d + 4 d + 12)", sb.fd, s64.fd, s8.fd);
  line("1-PC (int8 u1 + 3 floats)", sb.one_pc, s64.one_pc, s8.one_pc);
  line("all five", sb.total(), s64.total(), s8.total());
  const sk::SummaryBytes r128 = sk::summary_bytes(128, m, l, true), r64 = sk::summary_bytes(64, m, l, true),
                         r8 = sk::summary_bytes(8, m, l, true);
  line("rotated box (rbox: 8 d + 4; + 4 d^2 basis per layer and kv head)", r128.rot, r64.rot, r8.rot);

  if (timing_only) {
    timing(synthetic_trace(small ? 4096 : 65536, 99, 1), m, l, small ? 2 : g_reps);
    return 0;
  }
  std::vector<Row> rows;
  const std::vector<std::int32_t> lens = small ? std::vector<std::int32_t>{4096} : std::vector<std::int32_t>{4096, 8192, 16384, 32768, 65536};
  const int seeds = small ? 1 : 3, queries = small ? 4 : 8;
  for (std::int32_t n : lens)
    for (int s = 0; s < seeds; ++s) rows.push_back(analyse(synthetic_trace(n, 1000 + s * 17 + n, queries), m, l));
  print_rows(rows, "synthetic needle traces (d = 128, 3 seeds per length, 8 queries each)");
#ifdef KVKIT_BENCH_EPS_ENGINE
  if (!model.empty()) {
    std::vector<Row> srows;
    for (const Trace& t : stories_traces(model, small ? 64 : 500, 16)) srows.push_back(analyse(t, m, l));
    print_rows(srows, "stories260K after 500 greedy positions (every layer and kv head; 2 query heads each)");
  }
#endif
  timing(synthetic_trace(small ? 4096 : 65536, 99, 1), m, l, small ? 2 : g_reps);
  return 0;
}
