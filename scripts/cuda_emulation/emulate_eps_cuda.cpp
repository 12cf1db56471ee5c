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
#include "eps_cases.hpp"
#include "reference.hpp"
using namespace kvkit;
namespace sk = kvkit::sketch;

int total_cases = 0, bad_cases = 0;
long long pruned = 0;

template <class T>
void run_case(std::mt19937_64& rng, bool long_seq = false) {
  test::EpsCaseOptions o;
  if (long_seq) {  // > 256 pages: every tile / chunk boundary of the kernels
    o.page_size = 8;
    o.max_batch = 1;
    o.seq_len = [](std::mt19937_64& r) { return static_cast<std::int32_t>(2100 + r() % 2000); };
  } else {
    o.seq_len = [](std::mt19937_64& r) { return static_cast<std::int32_t>(r() % 400); };
  }
  const test::EpsCase<T> ec = test::make_eps_case<T>(rng, o);
  test::RandomPool<T>& pool = *ec.pool;  // the "device" view is made over its memory
  const sk::SketchStore& store = *ec.store;
  const sk::SketchSelector& sel = *ec.sel;
  const sk::SketchParams& p = ec.p;
  const std::vector<T>& q = ec.q;
  const std::int32_t hkv = ec.hkv, hq = ec.hq, d = ec.d, P = ec.P, batch = ec.batch, used = ec.used,
                     max_pages = ec.max_pages, max_groups = ec.max_groups, pages = pool.geometry.num_pages;
  const std::vector<std::int32_t>& lens = ec.lens;
  const float sm_scale = ec.sm_scale;
  const Status cs = ec.cpu;

  // "Device" side: a kCuda view over the same host memory.
  const PagedKVView<T> dv = pool.make_view_over(pool.k.data(), pool.v.data(), pool.host_tables(), MemorySpace::kCuda);
  std::vector<float> mn(static_cast<std::size_t>(pages) * hkv * d, 7.f), mx(mn.size(), 7.f),
      nrm(static_cast<std::size_t>(pages) * hkv, 7.f), am(nrm.size(), 7.f);
  std::vector<std::int32_t> count(static_cast<std::size_t>(pages), 7);
  const sk::twin::BoxSummaries s{mn.data(), mx.data(), nrm.data(), am.data(), count.data(), pages, hkv, d};
  sk::EpsCudaConfig cfg(p);
  cfg.set_smem_sort(rng() % 2 != 0);  // both places of the sort: shared memory, workspace
  DeviceStatus dst;
  const exec::Cuda ex{nullptr, &dst};
  Status st = cfg.reset_summaries(ex, s);
  std::vector<std::int32_t> upd, ntok;
  test::summarised_pages(ec, &upd, &ntok);
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
  const sk::EpsCudaShape shape{batch, hkv, max_pages, hq};
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
