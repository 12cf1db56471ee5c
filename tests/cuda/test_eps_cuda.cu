// The Sketcher's strict pre-pass on CUDA (kernels/cuda/eps.cuh) against its CPU twin
// (sketch/eps.hpp): random paged K (float and half, ragged batches, partial last pages,
// shuffled physical pages, NHD / HND, CSR / block table, Hq/Hkv = 3 and 4, needles, some
// pages without a summary, heads switched off, top_pages caps). Summaries built on the
// device equal SketchStore's bit for bit; the device's indptr / subset equal
// SketchSelector's exactly; the omitted-mass bounds agree (see the tolerance below); and
// page-subset decode attention over the device's subset equals the CPU attention over the
// CPU's subset. Without a GPU every case prints "skipped: no GPU".
//
// Why page sets are compared exactly and omitted bounds to 1e-11 relative: every value
// feeding a decision is computed with the CPU's operations in the CPU's order
// (sketch/eps_twin.hpp, verified bit for bit on the host by test_eps_twin) except exp,
// where CUDA's double exp may differ from glibc's by 1 ulp. That perturbs each mass term
// by <= 2^-52 relative, so every sum (S, the tail sums) by <= 2^-52 + the n·2^-53 of its
// own roundings (n <= 5000 tokens here): < 2e-12 relative. The omitted bound t/(t+S) inherits
// that; a page decision flips only when a stop test lies within that margin of its
// threshold, which random continuous inputs hit with probability ~1e-12 per test.

#include <kvkit/cuda.cuh>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_test_util.cuh"
#include "eps_cases.hpp"
#include "reference.hpp"

namespace sk = kvkit::sketch;
using kvkit::test::DeviceBuffer;

namespace {

template <class T>
struct DevicePool {
  explicit DevicePool(const kvkit::test::RandomPool<T>& p)
      : k(p.k), v(p.v), indptr(p.indptr), indices(p.indices), last_page_len(p.last_page_len),
        block_table(p.block_table), seq_lens(p.seq_lens) {
    view = p.make_view_over(k.get(), v.get(),
                            kvkit::test::TableArrays{indptr.get(), indices.get(), last_page_len.get(),
                                                     block_table.get(), seq_lens.get()},
                            kvkit::MemorySpace::kCuda);
  }
  DeviceBuffer<T> k, v;
  DeviceBuffer<std::int32_t> indptr, indices, last_page_len, block_table, seq_lens;
  kvkit::PagedKVView<T> view;
};

/// Device box summaries of a case's pool ([pages, Hkv, d] boxes, [pages, Hkv] norms, [pages]
/// counts), none valid until update_summaries.
struct DeviceSummaries {
  DeviceSummaries(std::int32_t pages, std::int32_t hkv, std::int32_t d)
      : mn(static_cast<std::size_t>(pages) * hkv * d), mx(mn.size()), norm(static_cast<std::size_t>(pages) * hkv),
        amax(norm.size()), count(static_cast<std::size_t>(pages)),
        s{mn.get(), mx.get(), norm.get(), amax.get(), count.get(), pages, hkv, d} {}
  DeviceBuffer<float> mn, mx, norm, amax;
  DeviceBuffer<std::int32_t> count;
  sk::twin::BoxSummaries s;
};

template <class T>
void run_case(std::mt19937_64& rng, kvkit::test::Stream& stream, std::int64_t& pruned) {
  kvkit::test::EpsCaseOptions o;
  o.head_dims = {16, 13, 32, 64, 128};
  o.max_batch = 4;
  const std::int32_t max_len = rng() % 2 ? 1500 : 5000;  // > 256 pages: every tile / chunk boundary
  o.seq_len = [max_len](std::mt19937_64& r) { return static_cast<std::int32_t>(r() % static_cast<std::uint64_t>(max_len)); };
  const kvkit::test::EpsCase<T> c = kvkit::test::make_eps_case<T>(rng, o);
  KVKIT_REQUIRE_OK(c.cpu);
  const kvkit::test::RandomPool<T>& pool = *c.pool;
  const sk::SketchStore& store = *c.store;
  const sk::SketchSelector& sel = *c.sel;
  const sk::SketchParams& p = c.p;
  const std::vector<T>& q = c.q;
  const std::int32_t hkv = c.hkv, hq = c.hq, d = c.d, P = c.P, batch = c.batch;
  const std::int32_t used = c.used, max_pages = c.max_pages, pages_total = pool.geometry.num_pages;
  const float sm_scale = c.sm_scale;
  CAPTURE(batch, hq, d, P, p.eps, p.last_n, p.top_pages, c.max_groups, c.lens);

  // Device summaries of the pages the CPU store summarised (the others stay invalid).
  DevicePool<T> dev(pool);
  const DeviceSummaries sums(pages_total, hkv, d);
  const sk::twin::BoxSummaries& s = sums.s;
  sk::EpsCudaConfig cfg(p);
  const bool smem_sort = rng() % 2 != 0;  // both places of the sort: shared memory, workspace
  cfg.set_smem_sort(smem_sort);
  CAPTURE(smem_sort);
  KVKIT_REQUIRE_OK(cfg.reset_summaries(stream.exec(), s));
  std::vector<std::int32_t> upd, ntok;
  kvkit::test::summarised_pages(c, &upd, &ntok);
  DeviceBuffer<std::int32_t> d_upd(upd), d_ntok(ntok);
  KVKIT_REQUIRE_OK(cfg.update_summaries(stream.exec(), dev.view, s, d_upd.get(), d_ntok.get(),
                                        static_cast<std::int32_t>(upd.size())));
  KVKIT_REQUIRE_OK(stream.status());
  const std::vector<float> hmn = sums.mn.download(), hmx = sums.mx.download(), hnorm = sums.norm.download(),
                           hamax = sums.amax.download();
  for (std::int32_t pid : upd) {
    const std::int32_t r = store.record_of(0, pid);
    for (std::int32_t h = 0; h < hkv; ++h) {
      const std::size_t row = static_cast<std::size_t>(pid) * hkv + h;
      REQUIRE(std::memcmp(&hmn[row * d], store.box_min(0, h) + static_cast<std::size_t>(r) * d, sizeof(float) * d) == 0);
      REQUIRE(std::memcmp(&hmx[row * d], store.box_max(0, h) + static_cast<std::size_t>(r) * d, sizeof(float) * d) == 0);
      REQUIRE(std::memcmp(&hnorm[row], store.max_norm(0, h) + r, sizeof(float)) == 0);
      REQUIRE(std::memcmp(&hamax[row], store.box_amax_norm(0, h) + r, sizeof(float)) == 0);
    }
  }

  // The device pre-pass.
  const sk::EpsCudaShape shape{batch, hkv, max_pages, hq};
  DeviceBuffer<unsigned char> ws(cfg.workspace_size(shape));
  DeviceBuffer<T> dq(q);
  DeviceBuffer<std::int32_t> indptr(static_cast<std::size_t>(batch) * hkv + 1),
      subset(static_cast<std::size_t>(batch) * hkv * max_pages);
  DeviceBuffer<double> omitted(static_cast<std::size_t>(batch) * hq);
  KVKIT_REQUIRE_OK(cfg.select(stream.exec(), 0, dev.view, dq.get(), hq, sm_scale, s, shape, indptr.get(), subset.get(),
                              omitted.get(), kvkit::Workspace{ws.get(), ws.size()}));
  KVKIT_REQUIRE_OK(stream.status());
  const std::vector<std::int32_t> hi = indptr.download(), hs = subset.download();
  const std::vector<double> ho = omitted.download();
  for (std::size_t i = 0; i < hi.size(); ++i) REQUIRE(hi[i] == sel.indptr()[i]);
  for (std::int32_t i = 0; i < hi.back(); ++i) REQUIRE(hs[i] == sel.subset()[i]);
  for (std::int32_t b = 0; b < batch; ++b)
    for (std::int32_t h = 0; h < hq; ++h) {
      const double g = ho[static_cast<std::size_t>(b) * hq + h], c = sel.omitted_bound(b, h);
      CAPTURE(b, h, g, c);
      REQUIRE(std::fabs(g - c) <= 1e-11 * std::max(g, c));
    }
  pruned += static_cast<std::int64_t>(used) * hkv - hi.back();

  // Page-subset attention over the device's subset against the CPU's over the CPU's.
  kvkit::DecodeAttentionParams cp{hq, sm_scale};
  cp.page_subset_indptr = sel.indptr();
  cp.page_subset = sel.subset();
  const std::size_t out_n = static_cast<std::size_t>(batch) * hq * pool.view.v_head_dim;
  std::vector<T> cpu_out(out_n);
  std::vector<unsigned char> cpu_ws(kvkit::paged_decode_attention_workspace_size(kvkit::exec::Host{}, pool.view, cp) + 1);
  KVKIT_REQUIRE_OK(kvkit::paged_decode_attention(kvkit::exec::Host{}, pool.view, q.data(), cpu_out.data(), cp,
                                                 kvkit::Workspace{cpu_ws.data(), cpu_ws.size()}));
  kvkit::DecodeAttentionParams gp{hq, sm_scale};
  gp.page_subset_indptr = indptr.get();
  gp.page_subset = subset.get();
  DeviceBuffer<T> gout(out_n);
  DeviceBuffer<unsigned char> gws(kvkit::paged_decode_attention_workspace_size(stream.exec(), dev.view, gp) + 1);
  KVKIT_REQUIRE_OK(kvkit::paged_decode_attention(stream.exec(), dev.view, dq.get(), gout.get(), gp,
                                                 kvkit::Workspace{gws.get(), gws.size()}));
  KVKIT_REQUIRE_OK(stream.status());
  const std::vector<T> g = gout.download();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out_n; ++i) {
    const double a = kvkit::to_float(g[i]), b = kvkit::to_float(cpu_out[i]);
    num += (a - b) * (a - b);
    den += b * b;
  }
  // The parity suite's thresholds (test_cuda_parity): float to float precision, half to one
  // rounding step of the output.
  const double tol = std::is_same<T, float>::value ? 1e-6 : 1e-5;
  CAPTURE(num, den);
  REQUIRE(num <= tol * std::max(den, 1e-30));
}

}  // namespace

// First in the file, so the first select of the process runs inside the capture: with more
// than 2048 pages the sort's pairs need more than the default 48 KiB of shared memory, and
// select raises the kernel's limit (host attribute calls only, no stream work) there.
TEST_CASE("eps cuda: select captures into a CUDA graph; replays equal an eager call and the CPU", "[eps][cuda][graph]") {
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  kvkit::test::EpsCaseOptions o;
  o.head_dims = {64};
  o.max_batch = 2;
  o.page_size = 8;
  o.seq_len = [](std::mt19937_64& r) { return 17000 + static_cast<std::int32_t>(r() % 8000); };  // > 2048 pages
  const kvkit::test::EpsCase<kvkit::half_t> c = kvkit::test::make_eps_case<kvkit::half_t>(rng, o);
  KVKIT_REQUIRE_OK(c.cpu);
  const sk::SketchSelector& sel = *c.sel;
  const std::int32_t pages_total = c.pool->geometry.num_pages, hkv = c.hkv, d = c.d;
  CAPTURE(c.batch, c.hq, c.max_pages, c.p.eps, c.p.top_pages, c.p.score_fraction, c.p.score_budget);
  REQUIRE(c.max_pages > 2048);
  DevicePool<kvkit::half_t> dev(*c.pool);
  const DeviceSummaries sums(pages_total, hkv, d);
  const sk::twin::BoxSummaries& s = sums.s;
  const sk::EpsCudaConfig cfg(c.p);
  std::vector<std::int32_t> upd, ntok;
  kvkit::test::summarised_pages(c, &upd, &ntok);
  DeviceBuffer<std::int32_t> d_upd(upd), d_ntok(ntok);
  const sk::EpsCudaShape shape{c.batch, hkv, c.max_pages, c.hq};
  DeviceBuffer<unsigned char> ws(cfg.workspace_size(shape));
  DeviceBuffer<kvkit::half_t> dq(c.q);
  const std::size_t nb = static_cast<std::size_t>(c.batch) * hkv;
  DeviceBuffer<std::int32_t> eager_indptr(nb + 1), graph_indptr(nb + 1), eager_subset(nb * c.max_pages),
      graph_subset(nb * c.max_pages);
  DeviceBuffer<double> eager_om(static_cast<std::size_t>(c.batch) * c.hq), graph_om(eager_om.size());
  // A decode step's EPS work: summaries of the pages written, then the pre-pass.
  auto step = [&](kvkit::exec::Cuda ex, std::int32_t* indptr, std::int32_t* subset, double* om) -> kvkit::Status {
    KVKIT_RETURN_IF_ERROR(kvkit::reset_device_status(ex));
    KVKIT_RETURN_IF_ERROR(cfg.reset_summaries(ex, s));
    KVKIT_RETURN_IF_ERROR(cfg.update_summaries(ex, dev.view, s, d_upd.get(), d_ntok.get(),
                                               static_cast<std::int32_t>(upd.size())));
    return cfg.select(ex, 0, dev.view, dq.get(), c.hq, c.sm_scale, s, shape, indptr, subset, om,
                      kvkit::Workspace{ws.get(), ws.size()});
  };
  kvkit::test::Stream s1, s2;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t instance = nullptr;
  // Global mode: any synchronising or allocating call inside the step fails the capture.
  KVKIT_CUDA_REQUIRE(cudaStreamBeginCapture(s2.get(), cudaStreamCaptureModeGlobal));
  const kvkit::Status captured = step(s2.exec(), graph_indptr.get(), graph_subset.get(), graph_om.get());
  KVKIT_CUDA_REQUIRE(cudaStreamEndCapture(s2.get(), &graph));
  KVKIT_REQUIRE_OK(captured);
  KVKIT_CUDA_REQUIRE(cudaGraphInstantiate(&instance, graph, 0));
  KVKIT_CUDA_REQUIRE(cudaGraphLaunch(instance, s2.get()));
  KVKIT_CUDA_REQUIRE(cudaGraphLaunch(instance, s2.get()));  // a replay gives the same subsets
  const kvkit::Status replayed = s2.status();
  (void)cudaGraphExecDestroy(instance);
  (void)cudaGraphDestroy(graph);
  KVKIT_REQUIRE_OK(replayed);
  KVKIT_REQUIRE_OK(step(s1.exec(), eager_indptr.get(), eager_subset.get(), eager_om.get()));
  KVKIT_REQUIRE_OK(s1.status());
  const std::vector<std::int32_t> gi = graph_indptr.download(), ei = eager_indptr.download();
  REQUIRE(gi == ei);
  for (std::size_t i = 0; i < gi.size(); ++i) REQUIRE(ei[i] == sel.indptr()[i]);
  const std::vector<std::int32_t> gs = graph_subset.download(), es = eager_subset.download();
  for (std::int32_t i = 0; i < ei.back(); ++i) {
    REQUIRE(gs[i] == es[i]);
    REQUIRE(es[i] == sel.subset()[i]);
  }
  const std::vector<double> go = graph_om.download(), eo = eager_om.download();
  for (std::size_t i = 0; i < go.size(); ++i) REQUIRE(std::memcmp(&go[i], &eo[i], sizeof(double)) == 0);
}

TEST_CASE("eps cuda: summaries, page subsets and omitted bounds equal the CPU Sketcher's", "[eps][cuda]") {
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  kvkit::test::Stream stream;
  std::int64_t pruned = 0;
  for (int it = 0; it < 40; ++it) {
    if (it % 2)
      run_case<float>(rng, stream, pruned);
    else
      run_case<kvkit::half_t>(rng, stream, pruned);
  }
  REQUIRE(pruned > 0);  // real pruning was compared
}

TEST_CASE("eps cuda: unsupported settings throw naming the value; bad inputs give a Status", "[eps][cuda]") {
  sk::SketchParams p;
  p.group_pages = 4;
  REQUIRE_THROWS_WITH(sk::EpsCudaConfig(p), Catch::Contains("unsupported group_pages 4"));
  p.group_pages = 1;
  p.method = sk::SketchMethod::kFD;
  REQUIRE_THROWS_WITH(sk::EpsCudaConfig(p), Catch::Contains("unsupported method fd"));
  p.method = sk::SketchMethod::kBox;
  p.strict = false;
  REQUIRE_THROWS_WITH(sk::EpsCudaConfig(p), Catch::Contains("unsupported mode"));
  p.strict = true;
  p.score_fraction = 0;  // validated like the CPU's
  REQUIRE_THROWS_WITH(sk::EpsCudaConfig(p), Catch::Contains("score_fraction must be in (0, 1]"));
  p.score_fraction = 0.25;
  const sk::EpsCudaConfig cfg(p);
  // Host-side checks need no GPU: a null status, null summaries.
  const sk::twin::BoxSummaries none{};
  REQUIRE(cfg.reset_summaries(kvkit::exec::Cuda{}, none).code() == kvkit::StatusCode::kInvalidArgument);
  KVKIT_REQUIRE_GPU();
  kvkit::test::Stream stream;
  REQUIRE(cfg.reset_summaries(stream.exec(), none).code() == kvkit::StatusCode::kInvalidArgument);
  // Device checks: a page id out of range is reported, nothing written.
  std::mt19937_64 rng(7);
  kvkit::test::PoolSpec spec;
  spec.seq_lens = {20};
  kvkit::test::RandomPool<float> pool(spec, rng);
  DevicePool<float> dev(pool);
  const std::int32_t pages = pool.geometry.num_pages, hkv = spec.num_kv_heads, d = spec.head_dim;
  const DeviceSummaries sums(pages, hkv, d);
  const sk::twin::BoxSummaries& s = sums.s;
  KVKIT_REQUIRE_OK(cfg.reset_summaries(stream.exec(), s));
  KVKIT_REQUIRE_OK(stream.status());
  DeviceBuffer<std::int32_t> bad(std::vector<std::int32_t>{0, pages}), nt(std::vector<std::int32_t>{4, 4});
  KVKIT_REQUIRE_OK(cfg.update_summaries(stream.exec(), dev.view, s, bad.get(), nt.get(), 2));
  const kvkit::Status st = stream.status();
  REQUIRE(st.code() == kvkit::StatusCode::kOutOfRange);
  std::vector<std::int32_t> c = sums.count.download();
  REQUIRE(std::all_of(c.begin(), c.end(), [](std::int32_t x) { return x == 0; }));
  // A token count past the page size, and a page id listed twice.
  struct BadList {
    std::vector<std::int32_t> ids, nt;
    kvkit::StatusCode code;
    const char* what;
  };
  for (const BadList& bl : {BadList{{0, 1}, {4, spec.page_size + 1}, kvkit::StatusCode::kOutOfRange, "ntok"},
                            BadList{{1, 2, 1}, {4, 4, 4}, kvkit::StatusCode::kInvalidArgument, "is repeated"}}) {
    INFO(bl.what);
    stream.reset();
    DeviceBuffer<std::int32_t> ids(bl.ids), nts(bl.nt);
    KVKIT_REQUIRE_OK(cfg.update_summaries(stream.exec(), dev.view, s, ids.get(), nts.get(),
                                          static_cast<std::int32_t>(bl.ids.size())));
    const kvkit::Status bad_st = stream.status();
    REQUIRE(bad_st.code() == bl.code);
    REQUIRE_THAT(bad_st.message(), Catch::Contains(bl.what));
    c = sums.count.download();
    REQUIRE(std::all_of(c.begin(), c.end(), [](std::int32_t x) { return x == 0; }));
  }
  // More query heads than the shape's workspace was sized for: refused on the host.
  const std::int32_t hq = 2 * hkv, max_pages = pool.view.num_pages(0);
  const sk::EpsCudaShape shape{1, hkv, max_pages, hkv};
  DeviceBuffer<unsigned char> ws(cfg.workspace_size(shape));
  DeviceBuffer<float> q(static_cast<std::size_t>(hq) * d);
  DeviceBuffer<std::int32_t> indptr(static_cast<std::size_t>(hkv) + 1), subset(static_cast<std::size_t>(hkv) * max_pages);
  DeviceBuffer<double> omitted(static_cast<std::size_t>(hq));
  const kvkit::Status wide = cfg.select(stream.exec(), 0, dev.view, q.get(), hq, 0.125f, s, shape, indptr.get(),
                                        subset.get(), omitted.get(), kvkit::Workspace{ws.get(), ws.size()});
  REQUIRE(wide.code() == kvkit::StatusCode::kInvalidArgument);
  REQUIRE_THAT(wide.message(), Catch::Contains("num_qo_heads " + std::to_string(hq)));
}
