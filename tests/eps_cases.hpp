#pragma once
// Random cases of the Sketcher's strict box pre-pass, shared by the three checks of its
// CUDA twin: tests/test_eps_twin.cpp (the host-device functions), tests/cuda/test_eps_cuda.cu
// (the kernels on a GPU) and scripts/cuda_emulation/emulate_eps_cuda.cpp (the kernels on
// host threads). A case is a paged pool whose pages have their own log-normal scales and
// offsets (so bounds differ and prune) with needles (in some pages one key is 2.5x a
// query), fresh queries, random SketchParams (eps, last_n, top_pages, scoring caps,
// heads switched off, sometimes too few records), and the CPU Sketcher's store and selection over it:
// the reference every twin must equal. Also random inputs of the ε walk alone
// (make_walk_case), shared by test_eps_prepass and test_eps_twin.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "kvkit/sketch/eps.hpp"
#include "reference.hpp"

namespace kvkit {
namespace test {

/// The pool of a case (see the file comment); q [batch, Hq, d] places the needles.
template <class T>
RandomPool<T> make_eps_pool(const std::vector<std::int32_t>& lens, std::int32_t hkv, std::int32_t d, std::int32_t P,
                            std::mt19937_64& rng, const std::vector<float>& q, std::int32_t hq) {
  PoolSpec spec;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.page_size = P;
  spec.seq_lens = lens;
  spec.layout = rng() % 2 ? KVLayout::kNHD : KVLayout::kHND;
  spec.table = rng() % 2 ? PageTableKind::kCsr : PageTableKind::kBlockTable;
  RandomPool<T> pool(spec, rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  const float spread = 0.3f + 1.5f * static_cast<float>(rng() % 100) / 100.f;
  for (std::int32_t b = 0; b < pool.view.batch_size; ++b)
    for (std::int32_t pg = 0; pg < pool.view.num_pages(b); ++pg) {
      const float sc = std::exp(spread * nd(rng));
      const std::int32_t end = std::min(pool.view.seq_len(b), (pg + 1) * P);
      for (std::int32_t h = 0; h < hkv; ++h) {
        const float off = 0.5f * nd(rng);
        for (std::int32_t t = pg * P; t < end; ++t) {
          T* k = pool.view.k_ptr(b, t, h);
          for (std::int32_t c = 0; c < d; ++c) k[c] = from_float<T>(off + sc * to_float(k[c]));
        }
        if (rng() % 6 == 0) {  // needle: aligned with query head h*grp of row b
          const std::int32_t t = pg * P + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(end - pg * P));
          const float* qq = q.data() + (static_cast<std::size_t>(b) * hq + h * (hq / hkv)) * d;
          T* k = pool.view.k_ptr(b, t, h);
          for (std::int32_t c = 0; c < d; ++c) k[c] = from_float<T>(2.5f * qq[c]);
        }
      }
    }
  return pool;
}

/// What make_eps_case draws from.
struct EpsCaseOptions {
  std::vector<std::int32_t> head_dims{16, 13, 32, 64};
  std::int32_t max_batch = 3;                              // batch in [1, max_batch]
  std::function<std::int32_t(std::mt19937_64&)> seq_len;  // one sequence's length
  std::int32_t page_size = 0;                              // 0: 8 or 16 at random
};

/// One case and the CPU Sketcher's answer (`cpu`: the select's status; on success
/// sel->indptr() / subset() / omitted_bound() are the reference).
template <class T>
struct EpsCase {
  std::int32_t hkv = 2, grp = 0, hq = 0, d = 0, P = 0, batch = 0;
  std::vector<std::int32_t> lens;
  std::vector<float> qf;  // [batch, Hq, d] the queries as floats (exactly representable in T)
  std::vector<T> q;       // the same in T
  sketch::SketchParams p;
  std::int32_t used = 0, max_pages = 1, max_groups = 0;  // pages in use, the longest sequence's
  float sm_scale = 0.f;
  std::unique_ptr<RandomPool<T>> pool;
  std::unique_ptr<sketch::SketchStore> store;
  std::unique_ptr<sketch::SketchSelector> sel;
  Status cpu;
};

template <class T>
EpsCase<T> make_eps_case(std::mt19937_64& rng, const EpsCaseOptions& o) {
  std::normal_distribution<float> nd(0.f, 1.f);
  EpsCase<T> c;
  c.grp = rng() % 2 ? 3 : 4;
  c.hq = c.hkv * c.grp;
  c.d = o.head_dims[rng() % o.head_dims.size()];
  c.P = o.page_size > 0 ? o.page_size : (rng() % 2 ? 8 : 16);
  c.batch = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(o.max_batch));
  for (std::int32_t b = 0; b < c.batch; ++b) c.lens.push_back(o.seq_len(rng));
  c.qf.resize(static_cast<std::size_t>(c.batch) * c.hq * c.d);
  const float qs = 0.5f + 2.f * static_cast<float>(rng() % 100) / 100.f;
  for (float& x : c.qf) x = to_float(from_float<T>(qs * nd(rng)));
  c.pool = std::make_unique<RandomPool<T>>(make_eps_pool<T>(c.lens, c.hkv, c.d, c.P, rng, c.qf, c.hq));
  c.q.resize(c.qf.size());
  for (std::size_t i = 0; i < c.qf.size(); ++i) c.q[i] = from_float<T>(c.qf[i]);

  c.p.all_summaries = false;
  const double epss[] = {1e-4, 1e-3, 1e-2, 0.1, 0.5};
  c.p.eps = epss[rng() % 5];
  c.p.last_n = 1 + static_cast<std::int32_t>(rng() % 3);
  c.p.top_pages = rng() % 3 == 0 ? 1 + static_cast<std::int32_t>(rng() % 10) : 0;
  if (rng() % 4 == 0) c.p.head_on = {1, static_cast<std::uint8_t>(rng() % 2)};
  // The cap on scored groups: none (the plain ε rule), the default fraction, a random one,
  // sometimes with a count budget too.
  const double fractions[] = {1.0, 0.25, 0.05 + 0.95 * static_cast<double>(rng() % 1000) / 1000.0};
  c.p.score_fraction = fractions[rng() % 3];
  c.p.score_budget = rng() % 4 == 0 ? 1 + static_cast<std::int32_t>(rng() % 8) : 0;
  for (std::int32_t b = 0; b < c.batch; ++b) {
    c.used += c.pool->view.num_pages(b);
    c.max_pages = std::max(c.max_pages, c.pool->view.num_pages(b));
  }
  // Sometimes too few records: the pages left without one are always visited.
  c.max_groups = rng() % 4 == 0 ? std::max(1, c.used / 2) : 0;
  c.store = std::make_unique<sketch::SketchStore>(c.p, 1, c.hkv, c.d, c.P, c.pool->geometry.num_pages, c.max_groups);
  c.store->sync(0, c.pool->view);
  c.sel = std::make_unique<sketch::SketchSelector>(*c.store);
  c.sel->reserve(c.batch, c.hq, c.max_pages);
  c.sm_scale = 1.f / std::sqrt(static_cast<float>(c.d)) * (rng() % 2 ? 1.f : 3.f);
  const Status cpu = c.sel->select(0, c.pool->view, c.q.data(), c.hq, c.sm_scale, nullptr);
  c.cpu = cpu;  // (nvcc's front end reads `c.cpu = select(...)` as a discarded result)
  return c;
}

/// The pages of case `c` the CPU store summarised (physical ids, in sequence order) and the
/// tokens each holds: the update list a device-side store gets for the same summaries.
template <class T>
void summarised_pages(const EpsCase<T>& c, std::vector<std::int32_t>* pages, std::vector<std::int32_t>* ntok) {
  pages->clear();
  ntok->clear();
  const PagedKVView<T>& v = c.pool->view;
  for (std::int32_t b = 0; b < c.batch; ++b)
    for (std::int32_t j = 0; j < v.num_pages(b); ++j)
      if (c.store->record_of(0, v.page_id(b, j)) >= 0) {
        pages->push_back(v.page_id(b, j));
        ntok->push_back(std::min(c.P, v.seq_len(b) - j * c.P));
      }
}

/// Random inputs of detail::certified_walk over n groups: log-mass bounds ub from a few
/// levels (many ties) or continuous, spread over 0..60 nats; exact masses a random fraction
/// of each bound (some groups at their bound); their quantised masses w (sum W) relative
/// to ref = max ub; the always-visited mass s0, eps and a cap lim (sometimes below n).
struct WalkCase {
  std::int32_t n = 0, levels = 0, lim = 0;
  double spread = 0, ref = 0, s0 = 0, eps = 0;
  std::vector<double> ub, mass;
  std::vector<sketch::detail::Mass128> w;
  sketch::detail::Mass128 W;
};

/// n in [1, max_n].
inline WalkCase make_walk_case(std::mt19937_64& rng, std::int32_t max_n) {
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  WalkCase c;
  c.n = 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(max_n));
  c.levels = static_cast<int>(rng() % 4);
  c.spread = 60.0 * u01(rng);
  c.ub.resize(static_cast<std::size_t>(c.n));
  for (double& x : c.ub)
    x = c.levels == 0 ? c.spread * u01(rng) : std::floor(u01(rng) * (c.levels * 3)) * c.spread / (c.levels * 3);
  c.ref = -1e300;
  for (double x : c.ub) c.ref = std::max(c.ref, x);
  c.mass.resize(c.ub.size());
  const double tight = u01(rng);
  for (std::size_t i = 0; i < c.ub.size(); ++i)
    c.mass[i] = std::exp(c.ub[i] - c.ref) * (u01(rng) < tight ? 1.0 : std::pow(u01(rng), 1 + 20 * u01(rng)));
  c.s0 = std::exp(-c.spread * u01(rng)) * (0.5 + u01(rng));
  c.eps = std::pow(10.0, -1 - 4 * u01(rng));
  c.lim = rng() % 4 == 0 ? 1 + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.n)) : c.n;
  c.w.resize(c.ub.size());
  for (std::size_t i = 0; i < c.ub.size(); ++i) {
    c.w[i] = sketch::detail::quantise_mass(c.ub[i] - c.ref);
    c.W.add(c.w[i]);
  }
  return c;
}

}  // namespace test
}  // namespace kvkit
