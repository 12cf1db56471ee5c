#include "kvkit/kernels/cuda/eps.cuh"  // the rewritten copy (run.sh puts its dir first)
// The host-emulated CUDA EPS kernels (see run.sh) against the CPU Sketcher: device-layout
// summaries equal SketchStore's bit for bit, indptr / subset equal SketchSelector's
// exactly, omitted bounds bit for bit (the emulation's exp is glibc's, as the CPU's);
// a bad update list (page id out of range, token count past the page, a page twice) is
// reported and nothing is written. Seed:
// KVKIT_TEST_SEED or random (printed).
#include <cstdio>
#include <random>
#include <algorithm>
#include "reference.hpp"
using namespace kvkit;
namespace sk = kvkit::sketch;

int total_cases = 0, bad_cases = 0;
long long pruned = 0;

template <class T>
void run_case(std::mt19937_64& rng, bool long_seq = false) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::int32_t hkv = 2, grp = rng() % 2 ? 3 : 4, hq = hkv * grp;
  const std::int32_t d = std::vector<std::int32_t>{16, 13, 32, 64}[rng() % 4];
  const std::int32_t P = long_seq ? 8 : (rng() % 2 ? 8 : 16);
  const std::int32_t batch = long_seq ? 1 : 1 + static_cast<std::int32_t>(rng() % 3);
  std::vector<std::int32_t> lens;
  // Long sequences (> 256 pages) cross every tile / chunk boundary of the kernels.
  for (std::int32_t b = 0; b < batch; ++b)
    lens.push_back(static_cast<std::int32_t>(long_seq ? 2100 + rng() % 2000 : rng() % 400));
  std::vector<float> qv(static_cast<std::size_t>(batch) * hq * d);
  const float qs = 0.5f + 2.f * static_cast<float>(rng() % 100) / 100.f;
  for (float& x : qv) x = to_float(from_float<T>(qs * nd(rng)));
  test::PoolSpec spec;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.page_size = P;
  spec.seq_lens = lens;
  spec.layout = rng() % 2 ? KVLayout::kNHD : KVLayout::kHND;
  spec.table = rng() % 2 ? PageTableKind::kCsr : PageTableKind::kBlockTable;
  test::RandomPool<T> pool(spec, rng);
  const float spread = 0.3f + 1.5f * static_cast<float>(rng() % 100) / 100.f;
  for (std::int32_t b = 0; b < batch; ++b)
    for (std::int32_t pg = 0; pg < pool.view.num_pages(b); ++pg) {
      const float sc = std::exp(spread * nd(rng));
      const std::int32_t end = std::min(pool.view.seq_len(b), (pg + 1) * P);
      for (std::int32_t h = 0; h < hkv; ++h) {
        const float off = 0.5f * nd(rng);
        for (std::int32_t t = pg * P; t < end; ++t) {
          T* k = pool.view.k_ptr(b, t, h);
          for (std::int32_t c = 0; c < d; ++c) k[c] = from_float<T>(off + sc * to_float(k[c]));
        }
        if (rng() % 6 == 0) {
          const std::int32_t t = pg * P + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(end - pg * P));
          T* k = pool.view.k_ptr(b, t, h);
          for (std::int32_t c = 0; c < d; ++c) k[c] = from_float<T>(2.5f * qv[(static_cast<std::size_t>(b) * hq + h * grp) * d + c]);
        }
      }
    }
  std::vector<T> q(qv.size());
  for (std::size_t i = 0; i < qv.size(); ++i) q[i] = from_float<T>(qv[i]);

  sk::SketchParams p;
  p.all_summaries = false;
  const double epss[] = {1e-4, 1e-3, 1e-2, 0.1, 0.5};
  p.eps = epss[rng() % 5];
  p.last_n = 1 + static_cast<std::int32_t>(rng() % 3);
  p.top_pages = rng() % 3 == 0 ? 1 + static_cast<std::int32_t>(rng() % 10) : 0;
  if (rng() % 4 == 0) p.head_on = {1, static_cast<std::uint8_t>(rng() % 2)};
  std::int32_t used = 0, max_pages = 1;
  for (std::int32_t b = 0; b < batch; ++b) {
    used += pool.view.num_pages(b);
    max_pages = std::max(max_pages, pool.view.num_pages(b));
  }
  const std::int32_t max_groups = rng() % 4 == 0 ? std::max(1, used / 2) : 0;
  const std::int32_t pages = pool.geometry.num_pages;
  sk::SketchStore store(p, 1, hkv, d, P, pages, max_groups);
  store.sync(0, pool.view);
  sk::SketchSelector sel(store);
  sel.reserve(batch, hq, max_pages);
  const float sm_scale = 1.f / std::sqrt(static_cast<float>(d)) * (rng() % 2 ? 1.f : 3.f);
  const Status cs = sel.select(0, pool.view, q.data(), hq, sm_scale, nullptr);

  // "Device" side: a kCuda view over the same host memory.
  const PagedKVView<T> dv = pool.make_view_over(pool.k.data(), pool.v.data(), pool.host_tables(), MemorySpace::kCuda);
  std::vector<float> mn(static_cast<std::size_t>(pages) * hkv * d, 7.f), mx(mn.size(), 7.f),
      nrm(static_cast<std::size_t>(pages) * hkv, 7.f), am(nrm.size(), 7.f);
  std::vector<std::int32_t> count(static_cast<std::size_t>(pages), 7);
  const sk::twin::BoxSummaries s{mn.data(), mx.data(), nrm.data(), am.data(), count.data(), pages, hkv, d};
  const sk::EpsCudaConfig cfg(p);
  DeviceStatus dst;
  const exec::Cuda ex{nullptr, &dst};
  Status st = cfg.reset_summaries(ex, s);
  std::vector<std::int32_t> upd, ntok;
  for (std::int32_t b = 0; b < batch; ++b)
    for (std::int32_t j = 0; j < pool.view.num_pages(b); ++j)
      if (store.record_of(0, pool.view.page_id(b, j)) >= 0) {
        upd.push_back(pool.view.page_id(b, j));
        ntok.push_back(std::min(P, pool.view.seq_len(b) - j * P));
      }
  if (st.is_ok()) st = cfg.update_summaries(ex, dv, s, upd.data(), ntok.data(), static_cast<std::int32_t>(upd.size()));
  bool ok = cs.is_ok() && st.is_ok() && dst.code == 0;
  for (std::int32_t pid : upd) {
    const std::int32_t r = store.record_of(0, pid);
    for (std::int32_t h = 0; h < hkv; ++h) {
      const std::size_t row = static_cast<std::size_t>(pid) * hkv + h;
      ok = ok && std::memcmp(&mn[row * d], store.box_min(0, h) + static_cast<std::size_t>(r) * d, sizeof(float) * d) == 0;
      ok = ok && std::memcmp(&mx[row * d], store.box_max(0, h) + static_cast<std::size_t>(r) * d, sizeof(float) * d) == 0;
      ok = ok && std::memcmp(&nrm[row], store.max_norm(0, h) + r, sizeof(float)) == 0;
      ok = ok && std::memcmp(&am[row], store.box_amax_norm(0, h) + r, sizeof(float)) == 0;
    }
  }
  const bool sums_ok = ok;
  const sk::EpsCudaShape shape{batch, hkv, max_pages};
  std::vector<unsigned char> ws(cfg.workspace_size(shape) + 256);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(batch) * hkv + 1, -7),
      subset(static_cast<std::size_t>(batch) * hkv * max_pages, -7);
  std::vector<double> omitted(static_cast<std::size_t>(batch) * hq, -7);
  st = cfg.select(ex, 0, dv, q.data(), hq, sm_scale, s, shape, indptr.data(), subset.data(), omitted.data(),
                  Workspace{ws.data(), ws.size()});
  ok = ok && st.is_ok() && dst.code == 0;
  for (std::size_t i = 0; ok && i < indptr.size(); ++i) ok = indptr[i] == sel.indptr()[i];
  for (std::int32_t i = 0; ok && i < indptr.back(); ++i) ok = subset[i] == sel.subset()[i];
  for (std::int32_t b = 0; ok && b < batch; ++b)
    for (std::int32_t h = 0; ok && h < hq; ++h) {
      const double g = omitted[static_cast<std::size_t>(b) * hq + h], c = sel.omitted_bound(b, h);
      ok = std::memcmp(&g, &c, sizeof g) == 0;
    }
  ++total_cases;
  if (ok) pruned += static_cast<long long>(used) * hkv - indptr.back();
  if (!ok) {
    ++bad_cases;
    std::printf("MISMATCH batch %d (len %d) hq %d d %d P %d eps %g last_n %d top %d max_groups %d head_on %zu: summaries %d cpu=%s gpu=%s code %d\n",
                batch, lens[0], hq, d, P, p.eps, p.last_n, p.top_pages, max_groups, p.head_on.size(), sums_ok,
                cs.to_string().c_str(), st.to_string().c_str(), dst.code);
  }
}

// A bad update list (a page id out of range, a token count past the page size, a page id
// twice): reported with `code` / `check`, nothing written.
void bad_update(std::mt19937_64& rng, std::vector<std::int32_t> ids, std::vector<std::int32_t> nt, StatusCode code,
                DeviceCheck check) {
  test::PoolSpec spec;
  spec.seq_lens = {20};
  test::RandomPool<float> pool(spec, rng);
  const PagedKVView<float> dv = pool.make_view_over(pool.k.data(), pool.v.data(), pool.host_tables(), MemorySpace::kCuda);
  const std::int32_t pages = pool.geometry.num_pages, hkv = spec.num_kv_heads, d = spec.head_dim;
  std::vector<float> mn(static_cast<std::size_t>(pages) * hkv * d), mx(mn.size()), nrm(static_cast<std::size_t>(pages) * hkv),
      am(nrm.size());
  std::vector<std::int32_t> count(static_cast<std::size_t>(pages), 0);
  const sk::twin::BoxSummaries s{mn.data(), mx.data(), nrm.data(), am.data(), count.data(), pages, hkv, d};
  const sk::EpsCudaConfig cfg(sk::SketchParams{});
  DeviceStatus dst;
  for (std::int32_t& id : ids)
    if (id < 0) id = pages;  // -1 stands for "one past the last page"
  const Status st = cfg.update_summaries(exec::Cuda{nullptr, &dst}, dv, s, ids.data(), nt.data(),
                                         static_cast<std::int32_t>(ids.size()));
  ++total_cases;
  const bool ok = st.is_ok() && dst.code == static_cast<int>(code) && dst.check == static_cast<int>(check) &&
                  std::all_of(count.begin(), count.end(), [](std::int32_t x) { return x == 0; });
  if (!ok) {
    ++bad_cases;
    std::printf("MISMATCH bad update: %s code %d value %lld\n", st.to_string().c_str(), dst.code, (long long)dst.value);
  }
}

int main() {
  const std::uint64_t seed = test::test_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  for (int it = 0; it < 24; ++it) {
    if (it % 2) run_case<float>(rng);
    else run_case<half_t>(rng);
  }
  run_case<float>(rng, true);
  run_case<half_t>(rng, true);
  bad_update(rng, {0, -1}, {4, 4}, StatusCode::kOutOfRange, DeviceCheck::kPageId);
  bad_update(rng, {0, 1}, {4, 99}, StatusCode::kOutOfRange, DeviceCheck::kSummaryTokens);
  bad_update(rng, {1, 2, 1}, {4, 4, 4}, StatusCode::kInvalidArgument, DeviceCheck::kSummaryRepeated);
  std::printf("cases %d, mismatched %d, pages skipped %lld, launches %d\n", total_cases, bad_cases, pruned, emu::launches);
  return bad_cases != 0 || pruned == 0;
}
