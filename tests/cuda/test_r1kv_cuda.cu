// Parity of the exec::Cuda Compressor select (kernels/cuda/r1kv.cuh) with its CPU twin
// (compressor/r1kv.hpp, exec::Host): random keys with planted near-duplicates, exact ties
// (identical keys), GQA groups 1/2/4/8, S from budget to budget + buffer, S == budget,
// S < budget, float / half / bfloat16 keys and queries, reference and positional order,
// for R1KV, SnapKV and StreamingLLM. Kept lists must be identical, except that a position
// may hold another slot when the two slots' float64 scores (computed here) are within a
// near-tie tolerance (the float32 logits / softmax of the two backends may order them
// differently); at most two such swaps per list.
//
// The device-status contract: NaN keys give kInvalidArgument (the CPU twin's code) after a
// sync, and keep / num_keep are not written. CUDA graphs: the select captures into a graph
// whose replay gives the eager lists bit for bit.
//
// Without a GPU every GPU case passes with WARN("skipped: no GPU"); the argument checks
// need no GPU (they return before any CUDA call) and always run.
#include <kvkit/cuda.cuh>
#include <kvkit/compressor/scorers.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_util.cuh"
#include "r1kv_reference.hpp"
#include "reference.hpp"

using namespace kvkit;
using kvkit::test::DeviceBuffer;
using kvkit::test::gpu_present;
using kvkit::test::Stream;
namespace cp = kvkit::compressor;

namespace {

using kvkit::test::Kind;

/// Keys [Hkv, S, D]: normal entries; about a quarter of the slots copy an earlier slot of
/// the same head plus 5% noise (planted near-duplicates). identical: every key the same.
template <class T>
std::vector<T> make_keys(int hkv, int s, int dim, std::mt19937_64& rng, bool identical = false) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<float> one(dim);
  for (auto& x : one) x = nd(rng);
  std::vector<T> k(static_cast<std::size_t>(hkv) * s * dim);
  for (int h = 0; h < hkv; ++h)
    for (int j = 0; j < s; ++j) {
      T* row = &k[(static_cast<std::size_t>(h) * s + j) * dim];
      if (identical) {
        for (int d = 0; d < dim; ++d) row[d] = from_float<T>(one[d]);
      } else if (j > 0 && u(rng) < 0.25f) {
        const int src = std::uniform_int_distribution<int>(0, j - 1)(rng);
        const T* from = &k[(static_cast<std::size_t>(h) * s + src) * dim];
        for (int d = 0; d < dim; ++d) row[d] = from_float<T>(to_float(from[d]) + 0.05f * nd(rng));
      } else {
        for (int d = 0; d < dim; ++d) row[d] = from_float<T>(nd(rng));
      }
    }
  return k;
}

template <class T>
std::vector<T> make_queries(int hq, int lq, int dim, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> q(static_cast<std::size_t>(hq) * lq * dim);
  for (auto& x : q) x = from_float<T>(nd(rng));
  return q;
}

template <class T>
std::vector<double> to_doubles(const T* p, std::size_t n) {
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = test::to_double(p[i]);
  return out;
}

struct Case {
  int hkv, groups, dim, s, lq;
  bool identical;
};

/// Runs one case on the CPU twin and on the GPU; compares the lists (see the file comment).
template <class T, class Scorer>
void compare(Kind kind, const cp::Params& p, const Case& c, std::mt19937_64& rng) {
  CAPTURE(c.hkv, c.groups, c.dim, c.s, c.lq, c.identical, static_cast<int>(p.order));
  const cp::Compressor<Scorer> comp(p);
  const auto keys = make_keys<T>(c.hkv, c.s, c.dim, rng, c.identical);
  const auto queries = make_queries<T>(c.hkv * c.groups, c.lq, c.dim, rng);
  const cp::Shape sh{c.hkv, c.hkv * c.groups, c.dim, c.s, c.lq};
  const int stride = p.budget + 5;
  // CPU twin.
  const exec::Host host{2};
  std::vector<unsigned char> hws(comp.workspace_size(host, sh));
  std::vector<std::int32_t> want(static_cast<std::size_t>(c.hkv) * stride, -7);
  std::int32_t want_n = -1;
  KVKIT_REQUIRE_OK(comp.select(host, keys.data(), queries.data(), sh, want.data(), stride, &want_n,
                               Workspace{hws.data(), hws.size()}));
  // GPU.
  Stream st;
  DeviceBuffer<T> dk(keys), dq(queries);
  DeviceBuffer<std::int32_t> dkeep(std::vector<std::int32_t>(want.size(), -7));
  DeviceBuffer<std::int32_t> dn(std::vector<std::int32_t>{-1});
  DeviceBuffer<unsigned char> dws(comp.workspace_size(st.exec(), sh));
  KVKIT_REQUIRE_OK(comp.select(st.exec(), dk.get(), dq.get(), sh, dkeep.get(), stride, dn.get(),
                               Workspace{dws.get(), dws.size()}));
  KVKIT_REQUIRE_OK(st.status());
  const std::vector<std::int32_t> got = dkeep.download();
  REQUIRE(dn.download()[0] == want_n);
  REQUIRE(want_n == std::min(c.s, p.budget));
  const int nc = c.s - p.window;
  for (int h = 0; h < c.hkv; ++h) {
    CAPTURE(h);
    const std::int32_t* g = got.data() + static_cast<std::size_t>(h) * stride;
    const std::int32_t* w = want.data() + static_cast<std::size_t>(h) * stride;
    for (int i = want_n; i < stride; ++i) REQUIRE(g[i] == -7);  // nothing past num_keep
    if (std::equal(g, g + want_n, w)) continue;
    REQUIRE(c.s >= p.budget);
    const std::size_t kn = static_cast<std::size_t>(c.s) * c.dim;
    const std::size_t qn = static_cast<std::size_t>(c.groups) * c.lq * c.dim;
    const auto z = kvkit::test::ref_head(to_doubles(keys.data() + h * kn, kn),
                                         to_doubles(queries.data() + h * qn, qn), c.s, c.dim, c.groups,
                                         c.lq, p, kind)
                       .z;
    double zmax = 0;
    for (double x : z) zmax = std::max(zmax, std::abs(x));
    const double tol = 1e-6 * zmax + 1e-15;
    int swaps = 0;
    for (int i = 0; i < want_n; ++i) {
      if (g[i] == w[i]) continue;
      INFO("position " << i << ": gpu slot " << g[i] << ", cpu slot " << w[i]);
      REQUIRE(g[i] >= 0);
      REQUIRE(g[i] < nc);
      REQUIRE(w[i] < nc);
      REQUIRE(std::abs(z[g[i]] - z[w[i]]) <= tol);
      ++swaps;
    }
    std::vector<std::int32_t> sorted(g, g + want_n);
    std::sort(sorted.begin(), sorted.end());
    REQUIRE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());  // distinct
    REQUIRE(swaps <= 2);
  }
}

cp::Params params(int budget, cp::KeepOrder order) {
  cp::Params p;
  p.budget = budget;
  p.buffer = 16;
  p.order = order;
  return p;
}

}  // namespace

// ---- host-side argument checks: no GPU needed, nothing is launched ----------------------

TEST_CASE("r1kv cuda: argument checks come before any CUDA call", "[cuda][r1kv][errors]") {
  const cp::R1KVCompressor comp(params(16, cp::KeepOrder::kReference));
  const cp::Shape sh{2, 4, 32, 40, 8};
  // Never dereferenced: every call below fails on the host first.
  auto* fake = reinterpret_cast<float*>(std::uintptr_t{4096});
  auto* ikeep = reinterpret_cast<std::int32_t*>(std::uintptr_t{8192});
  auto* fstatus = reinterpret_cast<DeviceStatus*>(std::uintptr_t{16384});
  const std::size_t need = comp.workspace_size(exec::Cuda{}, sh);
  REQUIRE(need > 0);
  const Workspace ws{reinterpret_cast<void*>(std::uintptr_t{1} << 20), need};
  const exec::Cuda ex{nullptr, fstatus};
  auto code = [](const Status& s) { return s.code(); };
  CHECK(code(comp.select(exec::Cuda{nullptr, nullptr}, fake, fake, sh, ikeep, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // no status
  CHECK(code(comp.select(ex, fake, fake, sh, ikeep, 15, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // stride
  CHECK(code(comp.select(ex, fake, fake, sh, nullptr, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // keep
  CHECK(code(comp.select(ex, fake, fake, sh, ikeep, 16, nullptr, ws)) ==
        StatusCode::kInvalidArgument);                                               // num_keep
  CHECK(code(comp.select(ex, fake, fake, sh, ikeep, 16, ikeep, Workspace{ws.data, need - 1})) ==
        StatusCode::kInvalidArgument);                                               // workspace
  CHECK(code(comp.select(ex, fake, fake, cp::Shape{2, 3, 32, 40, 8}, ikeep, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // GQA
  CHECK(code(comp.select(ex, fake, static_cast<const float*>(nullptr), sh, ikeep, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // queries
  CHECK(code(comp.select(ex, fake, fake, cp::Shape{2, 4, 32, 40, 0}, ikeep, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // Lq = 0
  CHECK(code(comp.select(ex, static_cast<const float*>(nullptr), fake, sh, ikeep, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // keys
  CHECK(code(comp.select(ex, fake, fake, cp::Shape{0, 4, 32, 40, 8}, ikeep, 16, ikeep, ws)) ==
        StatusCode::kInvalidArgument);                                               // Hkv
  // The device check's message is the CPU twin's.
  DeviceStatus ds;
  ds.code = static_cast<std::int32_t>(StatusCode::kInvalidArgument);
  ds.check = static_cast<std::int32_t>(DeviceCheck::kNonFiniteScore);
  ds.head = 3;
  const Status s = to_status(ds);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.to_string().find("kv head 3 has non-finite scores") != std::string::npos);
}

// ---- parity ---------------------------------------------------------------------------

TEMPLATE_TEST_CASE("r1kv cuda parity: kept lists vs the CPU twin, GQA 1/2/4/8", "[cuda][r1kv]",
                   float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  for (auto order : {cp::KeepOrder::kReference, cp::KeepOrder::kPositional}) {
    const cp::Params p = params(48, order);
    for (int groups : {1, 2, 4, 8})
      for (int s : {48, 49, 57, 64})  // budget .. budget + buffer
        compare<T, cp::R1KV>(Kind::kR1KV, p, Case{2, groups, 32, s, 8, false}, rng);
    // Head dims off the 8-lane grid, fewer queries than the window, a longer sequence.
    compare<T, cp::R1KV>(Kind::kR1KV, p, Case{3, 2, 37, 60, 3, false}, rng);
    compare<T, cp::R1KV>(Kind::kR1KV, p, Case{1, 4, 4, 50, 8, false}, rng);
    compare<T, cp::R1KV>(Kind::kR1KV, params(300, order), Case{2, 4, 128, 428, 8, false}, rng);
  }
}

TEMPLATE_TEST_CASE("r1kv cuda parity: exact ties, S == budget, S < budget", "[cuda][r1kv]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  for (auto order : {cp::KeepOrder::kReference, cp::KeepOrder::kPositional}) {
    // Identical keys: every candidate score ties exactly; lower slots first on both sides.
    compare<T, cp::R1KV>(Kind::kR1KV, params(24, order), Case{2, 2, 16, 40, 3, true}, rng);
    compare<T, cp::R1KV>(Kind::kR1KV, params(48, order), Case{2, 2, 32, 48, 8, false}, rng);
    compare<T, cp::R1KV>(Kind::kR1KV, params(48, order), Case{2, 2, 32, 30, 8, false}, rng);
    compare<T, cp::R1KV>(Kind::kR1KV, params(48, order), Case{2, 2, 32, 0, 8, false}, rng);
  }
}

TEMPLATE_TEST_CASE("r1kv cuda parity: SnapKV and StreamingLLM scorers", "[cuda][r1kv]", float,
                   half_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  for (auto order : {cp::KeepOrder::kReference, cp::KeepOrder::kPositional})
    for (int groups : {1, 8}) {
      compare<T, cp::SnapKV>(Kind::kSnapKV, params(48, order), Case{2, groups, 32, 64, 8, false},
                             rng);
      compare<T, cp::StreamingLLM>(Kind::kStreaming, params(48, order),
                                   Case{2, groups, 32, 61, 8, false}, rng);
    }
}

// ---- the device-status contract ---------------------------------------------------------

TEST_CASE("r1kv cuda contract: NaN keys report kInvalidArgument and write nothing",
          "[cuda][r1kv][errors]") {
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  const cp::R1KVCompressor comp(params(16, cp::KeepOrder::kReference));
  const cp::Shape sh{2, 4, 16, 30, 8};
  auto keys = make_keys<float>(2, 30, 16, rng);
  keys[(30 + 5) * 16 + 2] = std::numeric_limits<float>::quiet_NaN();  // head 1, slot 5
  const auto queries = make_queries<float>(4, 8, 16, rng);
  Stream st;
  DeviceBuffer<float> dk(keys), dq(queries);
  DeviceBuffer<std::int32_t> dkeep(std::vector<std::int32_t>(32, -7)), dn(std::vector<std::int32_t>{-1});
  DeviceBuffer<unsigned char> dws(comp.workspace_size(st.exec(), sh));
  KVKIT_REQUIRE_OK(comp.select(st.exec(), dk.get(), dq.get(), sh, dkeep.get(), 16, dn.get(),
                               Workspace{dws.get(), dws.size()}));
  const Status s = st.status();
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.to_string().find("kv head 1 has non-finite scores") != std::string::npos);
  CHECK(dn.download()[0] == -1);
  for (std::int32_t x : dkeep.download()) CHECK(x == -7);
  // The status is sticky: a later select on it does nothing.
  keys[(30 + 5) * 16 + 2] = 0.5f;
  dk.upload(keys);
  KVKIT_REQUIRE_OK(comp.select(st.exec(), dk.get(), dq.get(), sh, dkeep.get(), 16, dn.get(),
                               Workspace{dws.get(), dws.size()}));
  CHECK(st.status().code() == StatusCode::kInvalidArgument);
  CHECK(dn.download()[0] == -1);
}

// ---- CUDA graphs ------------------------------------------------------------------------

TEMPLATE_TEST_CASE("r1kv cuda: select captures into a CUDA graph", "[cuda][r1kv][graph]", float,
                   half_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  const cp::R1KVCompressor comp(params(48, cp::KeepOrder::kReference));
  const int hkv = 2, groups = 4, dim = 64, s = 64, lq = 8;
  const cp::Shape sh{hkv, hkv * groups, dim, s, lq};
  DeviceBuffer<T> dk(make_keys<T>(hkv, s, dim, rng)), dq(make_queries<T>(hkv * groups, lq, dim, rng));
  DeviceBuffer<std::int32_t> eager_keep(static_cast<std::size_t>(hkv) * 48), graph_keep(eager_keep.size());
  DeviceBuffer<std::int32_t> eager_n(1), graph_n(1);
  DeviceBuffer<unsigned char> ws(comp.workspace_size(exec::Cuda{}, sh));
  auto step = [&](exec::Cuda ex, std::int32_t* keep, std::int32_t* n) -> Status {
    KVKIT_RETURN_IF_ERROR(reset_device_status(ex));
    return comp.select(ex, dk.get(), dq.get(), sh, keep, 48, n, Workspace{ws.get(), ws.size()});
  };
  Stream s1, s2;
  KVKIT_REQUIRE_OK(step(s1.exec(), eager_keep.get(), eager_n.get()));
  KVKIT_REQUIRE_OK(s1.status());

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t instance = nullptr;
  // Global mode: any synchronising or allocating call inside the step fails the capture.
  KVKIT_CUDA_REQUIRE(cudaStreamBeginCapture(s2.get(), cudaStreamCaptureModeGlobal));
  const Status captured = step(s2.exec(), graph_keep.get(), graph_n.get());
  KVKIT_CUDA_REQUIRE(cudaStreamEndCapture(s2.get(), &graph));
  KVKIT_REQUIRE_OK(captured);
  KVKIT_CUDA_REQUIRE(cudaGraphInstantiate(&instance, graph, 0));
  KVKIT_CUDA_REQUIRE(cudaGraphLaunch(instance, s2.get()));
  KVKIT_CUDA_REQUIRE(cudaGraphLaunch(instance, s2.get()));  // replays give the same lists
  const Status replayed = s2.status();
  (void)cudaGraphExecDestroy(instance);
  (void)cudaGraphDestroy(graph);
  KVKIT_REQUIRE_OK(replayed);
  CHECK(test::bitwise_equal(graph_keep.download(), eager_keep.download()));
  CHECK(graph_n.download()[0] == 48);
  CHECK(eager_n.download()[0] == 48);
}
