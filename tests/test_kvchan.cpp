// Tests of the ChannelSelector (include/kvkit/channel/) and its engine host
// (examples/engine/kvchan_policy.hpp): top-r selection with its tie-break, retention,
// pack/unpack round trips (float, half, bfloat16), packed attention against a float64
// reference with the dropped dims zeroed (or mean-filled), the stability / back-off state
// machine on scripted inputs, rejected parameters, and engine runs on stories260K (the
// generated checkpoint of its shape when the file is absent): byte accounting against
// the allocators, equality with the dense engine when nothing is dropped, a back-off in
// the middle of a run that loses no token, and the fidelity guard.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sys/wait.h>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/conversation_host.hpp"
#include "engine/engine.hpp"
#include "engine/kvchan_policy.hpp"
#include "kvkit/conversation/conversation_cache.hpp"
#include "kvkit/channel/kvchan.hpp"
#include "kvkit/channel/packed_store.hpp"
#include "engine_runs.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::channel;
using kvkit::engine::Engine;
using kvkit::engine::EngineOptions;
using kvkit::engine::KvchanOptions;
using kvkit::engine::KvchanPolicy;
using kvkit::engine::SeqId;

namespace {

const std::string kStoriesPath = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";

std::shared_ptr<const engine::Checkpoint> stories() { return test::stories_or_synthetic(); }

// A random ascending set of r dims of [0, d).
std::vector<std::int32_t> random_set(std::int32_t d, std::int32_t r, std::mt19937_64& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(d));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<std::size_t>(r));
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace

TEST_CASE("top_r_channels: highest scores, ties to the lower dim, ascending output", "[kvchan]") {
  const float s[8] = {0.5f, 2.f, 1.f, 2.f, 1.f, -3.f, 2.f, 1.f};
  std::int32_t out[4];
  top_r_channels(s, 8, 4, out);  // 2,2,2 at dims 1,3,6; then 1.0 at dims 2,4,7 -> dim 2
  CHECK(std::vector<std::int32_t>(out, out + 4) == std::vector<std::int32_t>{1, 2, 3, 6});
  top_r_channels(s, 8, 2, out);
  CHECK(std::vector<std::int32_t>(out, out + 2) == std::vector<std::int32_t>{1, 3});
  const float n[4] = {std::nanf(""), -1.f, 0.f, -2.f};
  top_r_channels(n, 4, 3, out);  // NaN ranks lowest
  CHECK(std::vector<std::int32_t>(out, out + 3) == std::vector<std::int32_t>{1, 2, 3});

  KVKIT_TEST_RNG(rng);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> sc(37);
    test::fill_uniform(sc.data(), sc.size(), rng, 0.f, 1.f);
    std::vector<std::int32_t> got(9);
    top_r_channels(sc.data(), 37, 9, got.data());
    // Reference: stable sort by descending score (stable keeps lower dims first on ties).
    std::vector<std::int32_t> ids(37);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) { return sc[a] > sc[b]; });
    ids.resize(9);
    std::sort(ids.begin(), ids.end());
    CHECK(got == ids);
  }
  const std::int32_t a[4] = {0, 2, 5, 7}, b[4] = {0, 3, 5, 6};
  CHECK(retention(a, b, 4) == 0.5);
  CHECK(retention(a, a, 4) == 1.0);
}

TEMPLATE_TEST_CASE("pack/unpack round trip is exact on the selected dims", "[kvchan]", float, half_t,
                   bfloat16_t) {
  KVKIT_TEST_RNG(rng);
  for (std::int32_t d : {8, 64, 100}) {
    for (std::int32_t r : {1, d / 4, d / 2, d}) {
      const std::int64_t n = 13;
      std::vector<TestType> full = test::random_vector<TestType>(static_cast<std::size_t>(n * d), rng);
      const std::vector<std::int32_t> sel = random_set(d, r, rng);
      std::vector<TestType> packed(static_cast<std::size_t>(n * r)), back(static_cast<std::size_t>(n * d));
      pack_channels(full.data(), d, sel.data(), r, n, packed.data(), r);
      std::vector<float> fill(static_cast<std::size_t>(d));
      test::fill_uniform(fill.data(), fill.size(), rng);
      for (const float* f : {static_cast<const float*>(nullptr), static_cast<const float*>(fill.data())}) {
        unpack_channels(packed.data(), r, sel.data(), r, d, n, f, back.data(), d);
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int32_t k = 0; k < d; ++k) {
            const bool kept = std::binary_search(sel.begin(), sel.end(), k);
            const float got = to_float(back[static_cast<std::size_t>(i * d + k)]);
            const float want = kept ? to_float(full[static_cast<std::size_t>(i * d + k)])
                                    : to_float(from_float<TestType>(f ? f[k] : 0.f));
            INFO("d=" << d << " r=" << r << " row " << i << " dim " << k);
            REQUIRE(got == want);
          }
      }
    }
  }
}

namespace {

// Packed attention vs a float64 reference over full-width rows whose dropped dims are
// zero or `kfill` (K, k_comp: key compensation as an lse bias) and zero or `fill` (V).
template <class T>
void check_packed_attention(bool compensation, std::mt19937_64& rng, bool k_comp = false) {
  const std::int32_t B = 3, Hkv = 2, G = 3, Hq = Hkv * G, D = 32, rk = 12, rv = 20, P = 8;
  const std::int32_t old_len[B] = {24, 0, 40}, win_len[B] = {11, 17, 1};
  // Full-width rows of every token: [b][t][h][D].
  std::vector<std::vector<float>> K(B), V(B);
  std::vector<std::int32_t> ksel, vsel;
  for (std::int32_t h = 0; h < Hkv; ++h) {
    auto a = random_set(D, rk, rng), c = random_set(D, rv, rng);
    ksel.insert(ksel.end(), a.begin(), a.end());
    vsel.insert(vsel.end(), c.begin(), c.end());
  }
  std::vector<float> fill(static_cast<std::size_t>(B) * Hkv * D, 0.f);
  std::vector<float> kfill(fill.size(), 0.f);
  PackedPagePool<T> pool(1, Hkv, rk, rv, P);
  std::vector<std::int32_t> o_indptr{0}, o_indices, o_last;
  // Window: a plain full-width pool.
  const std::int32_t wpages = 16;
  KVGeometry wg{Hkv, D, P, wpages, D};
  const KVStrides ws = packed_strides(wg, KVLayout::kNHD);
  std::vector<T> wk(static_cast<std::size_t>(ws.page) * wpages), wv(wk.size());
  std::vector<std::int32_t> w_indptr{0}, w_indices, w_last;
  std::int32_t next_wpage = 0;
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int32_t n = old_len[b] + win_len[b];
    K[b] = test::random_vector<float>(static_cast<std::size_t>(n) * Hkv * D, rng);
    V[b] = test::random_vector<float>(K[b].size(), rng);
    for (float& x : K[b]) x = to_float(from_float<T>(x));
    for (float& x : V[b]) x = to_float(from_float<T>(x));
    auto row = [&](std::vector<float>& X, std::int32_t t, std::int32_t h) {
      return X.data() + (static_cast<std::size_t>(t) * Hkv + h) * D;
    };
    // Old part into packed pages.
    for (std::int32_t p = 0; p * P < old_len[b]; ++p) {
      const std::int32_t page = pool.allocate();
      o_indices.push_back(page);
      for (std::int32_t s = 0; s < P && p * P + s < old_len[b]; ++s)
        for (std::int32_t h = 0; h < Hkv; ++h) {
          std::vector<T> tk(D), tv(D);
          for (std::int32_t d = 0; d < D; ++d) {
            tk[d] = from_float<T>(row(K[b], p * P + s, h)[d]);
            tv[d] = from_float<T>(row(V[b], p * P + s, h)[d]);
          }
          pack_channels(tk.data(), D, ksel.data() + h * rk, rk, 1, pool.k_row(0, page, s, h), rk);
          pack_channels(tv.data(), D, vsel.data() + h * rv, rv, 1, pool.v_row(0, page, s, h), rv);
        }
    }
    o_indptr.push_back(static_cast<std::int32_t>(o_indices.size()));
    o_last.push_back(old_len[b] == 0 ? 0 : old_len[b] - (old_len[b] - 1) / P * P);
    // Reference rows of the old part: dropped dims zero / fill.
    for (std::int32_t h = 0; h < Hkv; ++h) {
      float* f = fill.data() + (static_cast<std::size_t>(b) * Hkv + h) * D;
      float* kf = kfill.data() + (static_cast<std::size_t>(b) * Hkv + h) * D;
      if (compensation && old_len[b] > 0)
        for (std::int32_t d = 0; d < D; ++d)
          if (!std::binary_search(vsel.begin() + h * rv, vsel.begin() + (h + 1) * rv, d))
            f[d] = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
      if (k_comp && old_len[b] > 0)  // 0 on kept dims, as the policy's means are
        for (std::int32_t d = 0; d < D; ++d)
          if (!std::binary_search(ksel.begin() + h * rk, ksel.begin() + (h + 1) * rk, d))
            kf[d] = std::uniform_real_distribution<float>(-2.f, 2.f)(rng);
      for (std::int32_t t = 0; t < old_len[b]; ++t)
        for (std::int32_t d = 0; d < D; ++d) {
          if (!std::binary_search(ksel.begin() + h * rk, ksel.begin() + (h + 1) * rk, d))
            row(K[b], t, h)[d] = k_comp ? kf[d] : 0.f;
          if (!std::binary_search(vsel.begin() + h * rv, vsel.begin() + (h + 1) * rv, d))
            row(V[b], t, h)[d] = compensation ? f[d] : 0.f;
        }
    }
    // Window part.
    for (std::int32_t p = 0; p * P < win_len[b]; ++p) {
      const std::int32_t page = next_wpage++;
      w_indices.push_back(page);
      for (std::int32_t s = 0; s < P && p * P + s < win_len[b]; ++s)
        for (std::int32_t h = 0; h < Hkv; ++h)
          for (std::int32_t d = 0; d < D; ++d) {
            const std::size_t off = static_cast<std::size_t>(page * ws.page + s * ws.token + h * ws.head + d);
            wk[off] = from_float<T>(row(K[b], old_len[b] + p * P + s, h)[d]);
            wv[off] = from_float<T>(row(V[b], old_len[b] + p * P + s, h)[d]);
          }
    }
    w_indptr.push_back(static_cast<std::int32_t>(w_indices.size()));
    w_last.push_back(win_len[b] - (win_len[b] - 1) / P * P);
  }
  const PagedKVView<T> wview = make_csr_view(wg, wk.data(), ws, wv.data(), ws,
                                             CsrPageTable{w_indptr.data(), w_indices.data(), w_last.data(), B});
  const PagedKVView<T> oview =
      make_csr_view(pool.geometry(), pool.k(0), pool.k_strides(), pool.v(0), pool.v_strides(),
                    CsrPageTable{o_indptr.data(), o_indices.data(), o_last.data(), B});
  const std::vector<T> q = test::random_vector<T>(static_cast<std::size_t>(B) * Hq * D, rng);
  DecodeAttentionParams dense{Hq, 1.f / std::sqrt(static_cast<float>(D))};
  DecodeAttentionParams pk = dense;
  pk.k_channels = ksel.data();
  pk.v_channels = vsel.data();
  pk.q_dim = D;
  const exec::Host ex{2};
  std::vector<unsigned char> scratch(channel_attention_workspace_size(ex, wview, oview, dense, pk));
  std::vector<T> out(static_cast<std::size_t>(B) * Hq * D);
  REQUIRE(channel_attention(ex, wview, oview, q.data(), out.data(), dense, pk,
                            compensation ? fill.data() : nullptr, k_comp ? kfill.data() : nullptr,
                            Workspace{scratch.data(), scratch.size()})
              .is_ok());
  // float64 reference over all tokens.
  double max_err = 0, max_ref = 0;
  for (std::int32_t b = 0; b < B; ++b) {
    const std::int32_t n = old_len[b] + win_len[b];
    for (std::int32_t hq = 0; hq < Hq; ++hq) {
      const std::int32_t h = hq / G;
      std::vector<double> sc(static_cast<std::size_t>(n));
      double m = -1e300;
      for (std::int32_t t = 0; t < n; ++t) {
        double s = 0;
        for (std::int32_t d = 0; d < D; ++d)
          s += test::to_double(q[(static_cast<std::size_t>(b) * Hq + hq) * D + d]) *
               K[b][(static_cast<std::size_t>(t) * Hkv + h) * D + d];
        sc[t] = s * dense.sm_scale;
        m = std::max(m, sc[t]);
      }
      double z = 0;
      for (double& s : sc) z += (s = std::exp(s - m));
      for (std::int32_t d = 0; d < D; ++d) {
        double o = 0;
        for (std::int32_t t = 0; t < n; ++t) o += sc[t] / z * V[b][(static_cast<std::size_t>(t) * Hkv + h) * D + d];
        const double got = test::to_double(out[(static_cast<std::size_t>(b) * Hq + hq) * D + d]);
        max_err = std::max(max_err, std::fabs(got - o));
        max_ref = std::max(max_ref, std::fabs(o));
      }
    }
  }
  const double tol = std::is_same<T, float>::value ? 1e-5 : std::is_same<T, half_t>::value ? 4e-3 : 2e-2;
  INFO("max abs error " << max_err << " (max |ref| " << max_ref << ")");
  CHECK(max_err <= tol * std::max(1.0, max_ref));
}

}  // namespace

TEMPLATE_TEST_CASE("packed attention equals dense attention with the dropped dims zeroed (float64 reference)",
                   "[kvchan]", float, half_t, bfloat16_t) {
  KVKIT_TEST_RNG(rng);
  SECTION("zero fill") { check_packed_attention<TestType>(false, rng); }
  SECTION("mean compensation") { check_packed_attention<TestType>(true, rng); }
  SECTION("key compensation: dropped K dims read as their mean (lse bias)") {
    check_packed_attention<TestType>(false, rng, true);
  }
  SECTION("key and value compensation") { check_packed_attention<TestType>(true, rng, true); }
}

TEST_CASE("stability counters and back-off on scripted inputs", "[kvchan]") {
  ChannelParams p;
  p.r_k = 10;
  p.r_v = 10;
  p.window = 4;
  p.t_update = 2;
  p.n_stable = 2;
  p.ema_decay = 0.f;  // each update sees the last token only: fully scripted
  const std::int32_t D = 16;
  ChannelSelector s(p, 1, 1, D, 1);
  // A token whose |x_d| ranks `top` (ascending list of 10 dims) highest.
  auto token = [&](const std::vector<std::int32_t>& top) {
    std::vector<float> x(D, 0.01f);
    for (std::size_t i = 0; i < top.size(); ++i) x[static_cast<std::size_t>(top[i])] = 1.f + static_cast<float>(i);
    s.observe_kv(0, 0, x.data(), x.data());
  };
  const std::vector<std::int32_t> a{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<std::int32_t> a9{0, 1, 2, 3, 4, 5, 6, 7, 8, 10};   // 9 of 10 retained (0.9)
  const std::vector<std::int32_t> a8{0, 1, 2, 3, 4, 5, 6, 7, 11, 12};  // 8 of 10 (0.8)
  token(a);
  CHECK_FALSE(s.tick(1));  // clock 1: no update yet
  CHECK(s.updates() == 0);
  CHECK_FALSE(s.tick(1));  // clock 2: first update, nothing to compare with
  CHECK(s.updates() == 1);
  CHECK(s.counter(0, 0) == 0);
  token(a9);
  CHECK_FALSE(s.tick(2));  // retention 0.9 >= 0.9: counter 1
  CHECK(s.counter(0, 0) == 1);
  CHECK(s.last_retention_k(0, 0) == Approx(0.9));
  token(a8);
  CHECK_FALSE(s.tick(2));  // retention 0.8 (a9 -> a8 shares 8): reset
  CHECK(s.counter(0, 0) == 0);
  CHECK(s.phase() == ChannelPhase::kProbing);
  token(a8);
  CHECK_FALSE(s.tick(2));
  CHECK(s.counter(0, 0) == 1);
  token(a8);
  CHECK(s.tick(100));  // one update however many tokens: counter 2 = n_stable -> packed
  CHECK(s.updates() == 5);
  CHECK(s.phase() == ChannelPhase::kPacked);
  CHECK(std::vector<std::int32_t>(s.packed_k(0), s.packed_k(0) + 10) == a8);
  // While packed the sets stay frozen even when the statistics move.
  token(a);
  CHECK_FALSE(s.tick(2));
  CHECK(s.counter(0, 0) == 0);
  CHECK(s.phase() == ChannelPhase::kPacked);
  CHECK(std::vector<std::int32_t>(s.packed_k(0), s.packed_k(0) + 10) == a8);
  CHECK(std::vector<std::int32_t>(s.current_k(0), s.current_k(0) + 10) == a);
  // Back-off: probing, counters reset, stability needed again.
  s.back_off();
  CHECK(s.phase() == ChannelPhase::kProbing);
  CHECK(s.backoffs() == 1);
  token(a);
  CHECK_FALSE(s.tick(2));
  CHECK(s.counter(0, 0) == 1);
  CHECK(s.tick(2));
  CHECK(std::vector<std::int32_t>(s.packed_k(0), s.packed_k(0) + 10) == a);
}

TEST_CASE("probe and full modes never pack; no-k keeps keys full width", "[kvchan]") {
  ChannelParams p;
  p.r_k = 4;
  p.t_update = 1;
  p.n_stable = 1;
  p.mode = ChannelMode::kProbe;
  ChannelSelector s(p, 2, 2, 8, 2);
  std::vector<float> x{3, 1, 4, 1, 5, 9, 2, 6};
  for (int i = 0; i < 10; ++i) {
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) s.observe_kv(l, h, x.data(), x.data());
    CHECK_FALSE(s.tick(1));
  }
  CHECK(s.all_stable());
  CHECK(s.phase() == ChannelPhase::kProbing);
  ChannelParams nk = p;
  nk.mode = ChannelMode::kDynamic;
  nk.compress_k = false;
  nk.r_k = 999;  // ignored without K compression
  ChannelSelector t(nk, 1, 1, 8, 1);
  CHECK(t.r_k() == 8);
  CHECK_FALSE(t.compresses_k());
  CHECK_FALSE(t.compresses_v());
}

TEST_CASE("rejected parameters name the value", "[kvchan]") {
  using Catch::Matchers::Contains;
  auto make = [](ChannelParams p) { ChannelSelector s(p, 2, 2, 64, 1); };
  ChannelParams p;
  p.r_k = 65;
  CHECK_THROWS_WITH(make(p), Contains("rK") && Contains("65"));
  p = {};
  p.r_k = 0;
  CHECK_THROWS_WITH(make(p), Contains("rK") && Contains("got 0"));
  p = {};
  p.r_v = 100;
  CHECK_THROWS_WITH(make(p), Contains("rV") && Contains("100"));
  p = {};
  p.window = 0;
  CHECK_THROWS_WITH(make(p), Contains("W must be >= 1") && Contains("got 0"));
  p = {};
  p.n_stable = -2;
  CHECK_THROWS_WITH(make(p), Contains("N_stable") && Contains("-2"));
  p = {};
  p.t_update = 0;
  CHECK_THROWS_WITH(make(p), Contains("T_update") && Contains("got 0"));
  p = {};
  p.check_every = -1;
  CHECK_THROWS_WITH(make(p), Contains("check_every") && Contains("-1"));
  p = {};
  p.min_retention = 1.5;
  CHECK_THROWS_WITH(make(p), Contains("retention") && Contains("1.5"));
  p = {};
  p.thresholds.top_k = 0;
  CHECK_THROWS_WITH(make(p), Contains("top_k") && Contains("got 0"));
  p = {};
  p.compress_k = false;
  p.k_compensation = true;
  CHECK_THROWS_WITH(make(p), Contains("k_compensation needs compress_k"));
  CHECK_THROWS_AS(make(p), Error);
}

TEST_CASE("compare_logits: KL, top-k overlap and margin drift", "[kvchan]") {
  const float base[6] = {5.f, 4.f, 1.f, 0.f, -1.f, 0.5f};
  FidelityThresholds th;
  th.top_k = 3;
  FidelityMetrics same = compare_logits(base, base, 6, th);
  CHECK(same.kl == Approx(0.0).margin(1e-12));
  CHECK(same.overlap == 1.0);
  CHECK(same.margin_drift == 0.0);
  CHECK(same.passed);
  const float pol[6] = {4.f, 5.f, -2.f, 0.f, -1.f, 0.5f};  // top3 {1, 0, 5} vs {0, 1, 2}
  FidelityMetrics m = compare_logits(base, pol, 6, th);
  CHECK(m.overlap == Approx(2.0 / 3.0));
  CHECK(m.margin_drift == Approx(2.0));  // (4 - 5) - (5 - 4)
  double kl = 0, zb = 0, zp = 0;
  for (int i = 0; i < 6; ++i) zb += std::exp(double(base[i])), zp += std::exp(double(pol[i]));
  for (int i = 0; i < 6; ++i) {
    const double pb = std::exp(double(base[i])) / zb, pp = std::exp(double(pol[i])) / zp;
    kl += pb * std::log(pb / pp);
  }
  CHECK(m.kl == Approx(kl).epsilon(1e-9));
  CHECK_FALSE(m.passed);
}

// ---------------------------------------------------------------------------------------
// Engine runs.

namespace {

struct Run {
  std::unique_ptr<Engine> eng;
  std::unique_ptr<KvchanPolicy> pol;
  SeqId id = -1;
  // Full-width K/V of every token as written ([t][layer][head][D]), recorded before the
  // policy packs anything.
  struct Written {
    SeqId id = -1;
    std::vector<std::vector<float>> k, v;
  };
  std::shared_ptr<Written> rec = std::make_shared<Written>();
};

EngineOptions small_opts() {
  EngineOptions o;
  o.page_size = 4;
  o.max_batch = 2;
  return o;
}

// Builds an engine of T pages with a recorder hook (registered first: it reads the views
// before the policy moves anything) and the policy attached. Rows are recorded widened to
// float (exact).
template <class T = float>
Run make_run(const ChannelParams& p, std::int32_t batch = 1, EngineOptions o = small_opts()) {
  Run r;
  o.kv_dtype = dtype_of_v<T>;
  r.eng = std::make_unique<Engine>(stories(), o);
  auto rp = r.rec;
  const engine::ModelConfig c = r.eng->config();
  r.eng->add_step_hook([rp, c](Engine& e, const engine::StepInfo& info) {
    if (info.seq_ids[0] != rp->id) return;
    const std::int32_t D = c.head_dim();
    const std::int32_t t = e.kv_len(rp->id) - 1;  // the token this step wrote (row 0)
    const std::vector<PagedKVView<T>>& views = e.layer_views<T>();
    std::vector<float> k, v;
    for (int l = 0; l < c.n_layers; ++l)
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const T* kp = views[static_cast<std::size_t>(l)].k_ptr(0, t, h);
        const T* vp = views[static_cast<std::size_t>(l)].v_ptr(0, t, h);
        for (std::int32_t d = 0; d < D; ++d) {
          k.push_back(to_float(kp[d]));
          v.push_back(to_float(vp[d]));
        }
      }
    rp->k.push_back(std::move(k));
    rp->v.push_back(std::move(v));
  });
  KvchanOptions ko;
  ko.params = p;
  r.pol = std::make_unique<KvchanPolicy>(ko);
  r.pol->attach(*r.eng);
  for (std::int32_t i = 0; i < batch; ++i) {
    const SeqId id = r.eng->add_sequence({engine::kBosToken, 10 + i});
    if (i == 0) r.id = r.rec->id = id;
  }
  return r;
}

ChannelParams small_params() {
  ChannelParams p;
  p.r_k = 4;  // of head_dim 8
  p.r_v = 6;
  p.window = 8;
  p.t_update = 4;
  p.n_stable = 2;
  p.ema_decay = 0.5f;
  p.min_retention = 0.5;  // tiny heads: allow one swap per update
  p.check_every = 0;
  return p;
}

// small_params() for the runs on every page type: 16-bit pages change the generated
// tokens, and with them when stories260K's tiny heads (D 8) settle; packing once 3/4 of
// the heads are stable happens within the tests' steps on all three types.
ChannelParams typed_params() {
  ChannelParams p = small_params();
  p.min_stable_fraction = 0.75;
  return p;
}

// The engine's pages + the policy's pools (of T pages) account for every KV byte.
template <class T = float>
void check_bytes(const Run& r) {
  const Engine& e = *r.eng;
  const KvchanPolicy& p = *r.pol;
  const std::int64_t engine_pages = e.pages_bytes(e.pages_in_use());
  const std::int64_t pools = p.packed_pool<T>().pages_in_use() * p.packed_pool<T>().page_bytes() +
                             p.full_pool<T>().pages_in_use() * p.full_pool<T>().page_bytes();
  CHECK(p.pool_bytes() == pools + p.metadata_bytes());
  CHECK(p.memory_bytes() == engine_pages + pools + p.metadata_bytes());
  CHECK(e.kv_bytes_in_use() == p.memory_bytes());
  CHECK(e.pool_bytes("kvchan") == p.pool_bytes());
  // The engine holds exactly the pages of the window tokens.
  std::int64_t pages = 0;
  for (SeqId id : e.sequences()) {
    pages += (e.kv_len(id) + e.options().page_size - 1) / e.options().page_size;
    CHECK(static_cast<std::int64_t>(e.pages(id).size()) == (e.kv_len(id) + e.options().page_size - 1) / e.options().page_size);
    CHECK(r.pol->old_tokens(id) + e.kv_len(id) == e.position(id));  // no token lost
  }
  CHECK(e.pages_in_use() == pages);
}

}  // namespace

TEMPLATE_TEST_CASE("engine: packs after stability, frees engine pages, bytes exact", "[kvchan][engine]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  Run r = make_run<T>(typed_params(), 2);
  const std::int32_t P = r.eng->options().page_size, W = 8;
  std::int64_t max_pages = 0;
  bool packed_seen = false;
  for (int s = 0; s < 90; ++s) {
    r.eng->step();
    check_bytes<T>(r);
    max_pages = std::max<std::int64_t>(max_pages, r.eng->pages_in_use());
    if (r.pol->old_tokens(r.id) > 0) {
      packed_seen = true;
      for (SeqId id : r.eng->sequences()) {
        CHECK(r.eng->kv_len(id) >= W);
        CHECK(r.eng->kv_len(id) < W + P);
        CHECK(r.pol->old_tokens(id) % P == 0);
        CHECK(r.pol->old_tokens_packed(id));
      }
    }
  }
  REQUIRE(packed_seen);
  CHECK(r.pol->selector().phase() == ChannelPhase::kPacked);
  // 2 sequences of 90 tokens would hold 2 * ceil(90/4) = 46 engine pages; the window
  // keeps at most 2 * ceil(11/4) = 6.
  CHECK(r.eng->pages_in_use() <= 6);
  const std::int64_t full = r.eng->pages_bytes(2 * ((r.eng->position(r.id) + P - 1) / P));
  const std::int64_t packed_bytes = r.pol->packed_pool<T>().bytes_in_use();
  // Packed pages hold (rK + rV) / (2 D) = 10/16 of full-width pages of the same type.
  CHECK(packed_bytes * 16 == r.pol->packed_pool<T>().pages_in_use() * r.eng->pages_bytes(1) * 10);
  CHECK(r.eng->kv_bytes_in_use() < full);
  const auto st = r.pol->stats();
  auto get = [&](const std::string& k) {
    for (const auto& kv : st)
      if (kv.first == k) return kv.second;
    FAIL("no stat " << k);
    return 0.0;
  };
  CHECK(get("packed_heads") == r.eng->config().n_layers * r.eng->config().n_kv_heads);
  CHECK(get("backoffs") == 0);
  CHECK(get("old_tokens") > 0);
}

TEMPLATE_TEST_CASE("engine: with every dim kept the packed run equals the dense engine", "[kvchan][engine]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  ChannelParams p = small_params();
  p.r_k = 8;
  p.r_v = 8;
  Run r = make_run<T>(p);
  EngineOptions dense_opts = small_opts();
  dense_opts.kv_dtype = dtype_of_v<T>;
  Engine dense(stories(), dense_opts);
  // Only rounding differs: float, the LSE merge's order; 16-bit pages, also the two parts'
  // outputs, each rounded to T before the merge as the dense kernel rounds its one output
  // (measured worst relative logit error over the run: 2.2e-6 / 2.8e-3 (half) / 2.1e-2
  // (bfloat16); the bounds leave about 3x).
  const double kTol = std::is_same<T, float>::value ? 1e-4 : std::is_same<T, half_t>::value ? 1e-2 : 6e-2;
  const SeqId d = dense.add_sequence({engine::kBosToken, 10});
  bool packed = false;
  for (int s = 0; s < 60; ++s) {
    r.eng->step();
    const std::size_t next = static_cast<std::size_t>(r.eng->position(r.id));
    dense.forward_tokens({r.eng->tokens(r.id)[next]});  // the policy run's choice
    const auto& a = r.eng->last_logits(r.id);
    const auto& b = dense.last_logits(d);
    double err = 0, mx = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      err = std::max(err, std::fabs(double(a[i]) - b[i]));
      mx = std::max(mx, std::fabs(double(b[i])));
    }
    packed = packed || r.pol->old_tokens(r.id) > 0;
    INFO("step " << s << " err " << err << " max " << mx);
    REQUIRE(err <= kTol * std::max(1.0, mx));
  }
  CHECK(packed);
  CHECK(r.eng->tokens(r.id) == dense.tokens(d));
}

TEMPLATE_TEST_CASE("engine: a back-off mid-run loses no token", "[kvchan][engine]", float, half_t, bfloat16_t) {
  using T = TestType;
  // Dropped dims read as 0, V dims as their mean, or every dropped dim as its 8- / 4-bit residual.
  for (int mode : {0, 1, 8, 4}) {
    const bool comp = mode == 1;
    const std::int32_t bits = mode >= 4 ? mode : 0;
    INFO("mode " << mode);
    ChannelParams p = typed_params();
    p.mean_compensation = comp;
    p.residual_bits = bits;
    Run r = make_run<T>(p);
    const engine::ModelConfig c = r.eng->config();
    const std::int32_t D = c.head_dim();
    int s = 0;
    for (; s < 200 && r.pol->old_tokens(r.id) < 24; ++s) r.eng->step();
    REQUIRE(r.pol->old_tokens(r.id) >= 24);
    // Sets frozen at packing, before the back-off.
    std::vector<std::vector<std::int32_t>> ks, vs;
    for (int l = 0; l < c.n_layers; ++l) {
      ks.emplace_back(r.pol->selector().packed_k(l), r.pol->selector().packed_k(l) + c.n_kv_heads * 4);
      vs.emplace_back(r.pol->selector().packed_v(l), r.pol->selector().packed_v(l) + c.n_kv_heads * 6);
    }
    auto verify = [&](bool old_packed_view) {
      const std::int32_t n_old = r.pol->old_tokens(r.id);
      const std::int32_t total = n_old + r.eng->kv_len(r.id);
      REQUIRE(total == r.eng->position(r.id));
      REQUIRE(static_cast<std::int32_t>(r.rec->k.size()) == total);
      std::vector<float> k(D), v(D);
      for (std::int32_t t = 0; t < total; ++t)
        for (int l = 0; l < c.n_layers; ++l)
          for (int h = 0; h < c.n_kv_heads; ++h) {
            r.pol->read_token(r.id, l, t, h, k.data(), v.data());
            const float* wk = r.rec->k[t].data() + (static_cast<std::size_t>(l) * c.n_kv_heads + h) * D;
            const float* wv = r.rec->v[t].data() + (static_cast<std::size_t>(l) * c.n_kv_heads + h) * D;
            // Residual: a dropped dim reads back within half a step of its row's scale (unpacked
            // to 16-bit pages: plus one rounding to the page type, 2^-8 relative at most).
            auto round_of = [&](float x) { return old_packed_view || sizeof(T) == 4 ? 0.f : std::fabs(x) / 128; };
            float kstep = 0.f, vstep = 0.f;
            for (std::int32_t dd = 0; bits != 0 && dd < D; ++dd) {
              if (!std::binary_search(ks[l].begin() + h * 4, ks[l].begin() + (h + 1) * 4, dd))
                kstep = std::max(kstep, std::fabs(wk[dd]) / ((1 << (bits - 1)) - 1));
              if (!std::binary_search(vs[l].begin() + h * 6, vs[l].begin() + (h + 1) * 6, dd))
                vstep = std::max(vstep, std::fabs(wv[dd]) / ((1 << (bits - 1)) - 1));
            }
            for (std::int32_t dd = 0; dd < D; ++dd) {
              const bool kk = std::binary_search(ks[l].begin() + h * 4, ks[l].begin() + (h + 1) * 4, dd);
              const bool vk = std::binary_search(vs[l].begin() + h * 6, vs[l].begin() + (h + 1) * 6, dd);
              INFO("t=" << t << " layer " << l << " head " << h << " dim " << dd << " old " << (t < n_old)
                        << " packed view " << old_packed_view);
              if (t >= n_old || kk) REQUIRE(k[dd] == wk[dd]);
              else if (bits != 0) REQUIRE(std::fabs(k[dd] - wk[dd]) <= kstep * (0.5f + 1e-4f) + round_of(wk[dd]));
              else REQUIRE(k[dd] == 0.f);
              if (t >= n_old || vk) REQUIRE(v[dd] == wv[dd]);
              else if (bits != 0) REQUIRE(std::fabs(v[dd] - wv[dd]) <= vstep * (0.5f + 1e-4f) + round_of(wv[dd]));
              else if (!comp) REQUIRE(v[dd] == 0.f);
            }
          }
    };
    verify(true);
    // Collect the attention-visible V of dropped dims before the back-off (means) to
    // check the unpacked rows keep them.
    const std::int32_t n_old = r.pol->old_tokens(r.id);
    std::vector<float> before(static_cast<std::size_t>(n_old) * D), k(D);
    for (std::int32_t t = 0; t < n_old; ++t) r.pol->read_token(r.id, 1, t, 0, k.data(), before.data() + t * D);
    r.pol->back_off();
    CHECK(r.pol->selector().phase() == ChannelPhase::kProbing);
    CHECK_FALSE(r.pol->old_tokens_packed(r.id));
    CHECK(r.pol->packed_pool<T>().pages_in_use() == 0);
    check_bytes<T>(r);
    verify(false);
    for (std::int32_t t = 0; t < n_old; ++t) {
      std::vector<float> v(D);
      r.pol->read_token(r.id, 1, t, 0, k.data(), v.data());
      // Unpacked rows hold the dropped dims' means (or residual) rounded to the pages' type.
      for (std::int32_t dd = 0; dd < D; ++dd)
        REQUIRE(v[dd] == to_float(from_float<T>(before[static_cast<std::size_t>(t) * D + dd])));
    }
    // The run goes on: full width until stable again, then re-packed with the new sets.
    for (int i = 0; i < 60; ++i) {
      r.eng->step();
      check_bytes<T>(r);
      CHECK(r.pol->old_tokens(r.id) + r.eng->kv_len(r.id) == r.eng->position(r.id));
    }
    CHECK(r.pol->selector().backoffs() == 1);
    CHECK(r.pol->old_tokens_packed(r.id));
    CHECK(r.pol->full_pool<T>().pages_in_use() == 0);
  }
}

TEST_CASE("engine: the fidelity guard backs off on failure and passes when nothing is dropped",
          "[kvchan][engine]") {
  SECTION("strict thresholds fail and back off") {
    ChannelParams p = small_params();
    p.check_every = 4;
    p.thresholds.max_kl = 0.0;
    p.thresholds.max_margin_drift = 0.0;
    Run r = make_run(p);
    for (int s = 0; s < 100 && r.pol->selector().backoffs() == 0; ++s) r.eng->step();
    REQUIRE(r.pol->selector().backoffs() >= 1);
    REQUIRE_FALSE(r.pol->checks().empty());
    CHECK_FALSE(r.pol->checks().back().metrics.passed);
    CHECK(r.pol->selector().phase() == ChannelPhase::kProbing);
    CHECK(r.pol->checks().back().full_kv_bytes > 0);
    check_bytes(r);
    // restore_on_backoff: every token now holds the full-width recomputation's K/V, i.e.
    // what a fresh dense engine computes for the same tokens (same arithmetic: exact).
    Engine ref(stories(), small_opts());
    const SeqId rid = ref.add_sequence(r.eng->processed_tokens(r.id));
    ref.prefill(rid);
    ref.step();
    const engine::ModelConfig c = r.eng->config();
    const std::int32_t D = c.head_dim(), total = r.pol->old_tokens(r.id) + r.eng->kv_len(r.id);
    REQUIRE(r.pol->old_tokens(r.id) > 0);
    REQUIRE(ref.kv_len(rid) == total);
    std::vector<float> k(D), v(D);
    for (std::int32_t t = 0; t < total; ++t)
      for (int l = 0; l < c.n_layers; ++l)
        for (int h = 0; h < c.n_kv_heads; ++h) {
          r.pol->read_token(r.id, l, t, h, k.data(), v.data());
          const PagedKVView<float>& rv = ref.layer_views()[static_cast<std::size_t>(l)];
          INFO("t=" << t << " layer " << l << " head " << h);
          REQUIRE(std::equal(k.begin(), k.end(), rv.k_ptr(0, t, h)));
          REQUIRE(std::equal(v.begin(), v.end(), rv.v_ptr(0, t, h)));
        }
  }
  SECTION("all dims kept: every check passes with KL ~ 0") {
    ChannelParams p = small_params();
    p.r_k = 8;
    p.r_v = 8;
    p.check_every = 4;
    Run r = make_run(p);
    for (int s = 0; s < 80; ++s) r.eng->step();
    REQUIRE(r.pol->checks().size() >= 3);
    for (const auto& ch : r.pol->checks()) {
      CHECK(ch.metrics.passed);
      CHECK(ch.metrics.kl < 1e-6);
      CHECK(ch.metrics.overlap == 1.0);
    }
    CHECK(r.pol->selector().backoffs() == 0);
  }
}

TEST_CASE("engine: a sequence with packed tokens is not forked or suspended, and keeps every token",
          "[kvchan][engine]") {
  Engine eng(stories(), small_opts());
  KvchanOptions ko;
  ko.params = small_params();
  KvchanPolicy pol(ko);
  pol.attach(eng);
  engine::EngineConversationHost host(eng);
  conversation::ConversationCache<float> cache(host, conversation::Params{});
  const SeqId id = engine::start_turn(eng, cache, "chat", {engine::kBosToken, 10});
  // Before packing the sequence is self-contained: forking it works.
  eng.step();
  CHECK(eng.external_tokens(id) == 0);
  const SeqId fork = eng.fork_sequence(id);
  eng.free_sequence(fork);
  for (int s = 0; s < 90 && pol.old_tokens(id) == 0; ++s) eng.step();
  REQUIRE(pol.old_tokens(id) > 0);
  for (int s = 0; s < 8; ++s) {  // the engine follows every pack
    eng.step();
    REQUIRE(eng.external_tokens(id) == pol.old_tokens(id));
  }
  const std::int32_t kv = eng.kv_len(id), pos = eng.position(id), old = pol.old_tokens(id);
  const std::vector<std::int32_t> pages = eng.pages(id);
  const std::int32_t in_use = eng.pages_in_use();
  REQUIRE_THROWS_WITH(eng.fork_sequence(id), Catch::Contains("cannot be forked") &&
                                                 Catch::Contains(std::to_string(old) + " of its tokens") &&
                                                 Catch::Contains("policy kvchan"));
  REQUIRE_THROWS_WITH(engine::finish_turn(eng, cache, "chat", id),
                      Catch::Contains("cannot be suspended") && Catch::Contains("policy kvchan"));
  // Nothing changed: the sequence is live with its pages and old tokens, the turn is open.
  REQUIRE(eng.has_sequence(id));
  CHECK(eng.num_sequences() == 1);
  CHECK(eng.kv_len(id) == kv);
  CHECK(eng.position(id) == pos);
  CHECK(eng.pages(id) == pages);
  CHECK(eng.pages_in_use() == in_use);
  CHECK(pol.old_tokens(id) == old);
  CHECK(cache.held_pages() == 0);
  // And it decodes on, every token accounted for.
  for (int s = 0; s < 8; ++s) {
    eng.step();
    CHECK(pol.old_tokens(id) + eng.kv_len(id) == eng.position(id));
    CHECK(eng.external_tokens(id) == pol.old_tokens(id));
  }
  CHECK_THROWS_WITH(eng.set_external_tokens(id, eng.position(id), "x"), Catch::Contains("cannot have"));
}

TEST_CASE("engine: ThinK scores and no-k runs pack and stay consistent", "[kvchan][engine]") {
  ChannelParams p = small_params();
  SECTION("think") { p.score = ChannelScore::kThink; }
  SECTION("no-k") {
    p.compress_k = false;
    p.r_v = 4;
  }
  Run r = make_run(p);
  for (int s = 0; s < 80; ++s) {
    r.eng->step();
    check_bytes(r);
  }
  CHECK(r.pol->old_tokens(r.id) > 0);
}

TEST_CASE("engine: attach rejects bad parameters naming the value", "[kvchan][engine]") {
  using Catch::Matchers::Contains;
  Engine e(stories(), small_opts());
  KvchanOptions o;
  o.params.r_k = 9;  // head_dim 8
  KvchanPolicy pol(o);
  CHECK_THROWS_WITH(pol.attach(e), Contains("rK") && Contains("9"));
}

TEST_CASE("stable fraction: packing starts with part of the heads stable", "[kvchan]") {
  ChannelParams p;
  p.r_k = 2;
  p.r_v = 2;
  p.t_update = 1;
  p.n_stable = 1;
  p.ema_decay = 0.f;
  p.min_stable_fraction = 0.5;
  ChannelSelector s(p, 1, 2, 4, 1);
  const float a[4] = {4, 3, 0, 0}, b[4] = {0, 0, 4, 3};
  s.observe_kv(0, 0, a, a);
  s.observe_kv(0, 1, a, a);
  CHECK_FALSE(s.tick(1));
  s.observe_kv(0, 0, a, a);  // head 0 stable, head 1 changes
  s.observe_kv(0, 1, b, b);
  CHECK(s.tick(1));
  CHECK(s.stable_heads() == 1);
  CHECK(s.phase() == ChannelPhase::kPacked);
  CHECK(std::vector<std::int32_t>(s.packed_k(0), s.packed_k(0) + 4) == std::vector<std::int32_t>{0, 1, 2, 3});
  p.min_stable_fraction = 0.0;
  CHECK_THROWS_WITH(ChannelSelector(p, 1, 2, 4, 1), Catch::Matchers::Contains("stable fraction") &&
                                                        Catch::Matchers::Contains("got 0"));
}

TEST_CASE("centered score: E[q_d^2] Var[k_d] for keys, Var[v_d] for values, top r with ties to the lower dim",
          "[kvchan]") {
  KVKIT_TEST_RNG(rng);
  ChannelParams p;
  p.r_k = 4;
  p.r_v = 3;
  p.score = ChannelScore::kCentered;
  p.think_window = 8;
  const std::int32_t L = 2, H = 2, G = 2, D = 8, N = 50, NQ = 20;
  ChannelSelector sel(p, L, H, D, G);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> uni(-3.f, 3.f), pos(0.3f, 2.f);
  // Per (layer, head, dim): k = offset + spread * z (offset up to 3 and spread >= 0.3, so
  // Var[k] >= 0.09 and E[k^2] <= ~40: the running-moment cancellation loses at most
  // ~3 of the float64 digits). Head (1, 1) scripts a tie: dims 2 and 5 carry identical
  // K and q streams, so their scores are bitwise equal.
  std::vector<float> off(static_cast<std::size_t>(L * H * D)), spr(off.size()), voff(off.size()), vspr(off.size()),
      qs(off.size());
  for (std::size_t i = 0; i < off.size(); ++i) {
    off[i] = uni(rng), spr[i] = pos(rng), voff[i] = uni(rng), vspr[i] = pos(rng), qs[i] = pos(rng);
  }
  const std::size_t t0 = static_cast<std::size_t>((1 * H + 1) * D);
  const float ladder[D] = {0.5f, 4.f, 2.5f, 3.f, 1.f, 2.5f, 0.4f, 5.f};  // ranks 7, 1, 3, {2, 5}, 4, 0, 6
  for (std::int32_t d = 0; d < D; ++d) off[t0 + d] = 0.f, spr[t0 + d] = ladder[d], qs[t0 + d] = 1.f;
  std::vector<std::vector<double>> ks(off.size()), vs(off.size());  // streams, for the reference
  std::vector<double> q2(off.size(), 0.0);
  std::vector<float> k(static_cast<std::size_t>(D)), v(static_cast<std::size_t>(D)), q(static_cast<std::size_t>(G * D));
  for (std::int32_t t = 0; t < N; ++t)
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::size_t o = static_cast<std::size_t>((l * H + h) * D);
        const float z = nd(rng);  // shared by the dims of head (1, 1): the tie stays exact
        for (std::int32_t d = 0; d < D; ++d) {
          k[d] = o == t0 ? spr[o + d] * z : off[o + d] + spr[o + d] * nd(rng);
          v[d] = voff[o + d] + vspr[o + d] * nd(rng);
          ks[o + d].push_back(k[d]);
          vs[o + d].push_back(v[d]);
        }
        sel.observe_kv(l, h, k.data(), v.data());
      }
  for (std::int32_t s = 0; s < NQ; ++s)
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const std::size_t o = static_cast<std::size_t>((l * H + h) * D);
        const float z = nd(rng);
        for (std::int32_t g = 0; g < G; ++g)
          for (std::int32_t d = 0; d < D; ++d) q[g * D + d] = o == t0 ? z : qs[o + d] * nd(rng);
        sel.observe_q(l, h, q.data());
        for (std::int32_t d = 0; d < D; ++d) {
          double sum = 0;
          for (std::int32_t g = 0; g < G; ++g) sum += static_cast<double>(q[g * D + d]) * q[g * D + d];
          q2[o + d] += (sum - q2[o + d]) / p.think_window;
        }
      }
  auto var = [](const std::vector<double>& x) {
    double m = 0, m2 = 0;
    for (double a : x) m += a;
    m /= static_cast<double>(x.size());
    for (double a : x) m2 += (a - m) * (a - m);
    return m2 / static_cast<double>(x.size());
  };
  sel.update();
  for (std::int32_t l = 0; l < L; ++l)
    for (std::int32_t h = 0; h < H; ++h) {
      const std::size_t o = static_cast<std::size_t>((l * H + h) * D);
      std::vector<float> want_k(static_cast<std::size_t>(D)), want_v(static_cast<std::size_t>(D));
      for (std::int32_t d = 0; d < D; ++d) {
        const double rk = q2[o + d] * var(ks[o + d]), rv = var(vs[o + d]);
        // Float score: float q2 recursion (NQ steps, ~NQ * 2^-24 relative) times a float
        // variance (2^-24 relative after the float64 moments): 1e-5 relative is > 10x that.
        INFO("layer " << l << " head " << h << " dim " << d);
        CHECK(std::fabs(sel.key_score(l, h, d) - rk) <= 1e-5 * rk);
        CHECK(std::fabs(sel.value_score(l, h, d) - rv) <= 1e-5 * rv);
        want_k[static_cast<std::size_t>(d)] = sel.key_score(l, h, d);
        want_v[static_cast<std::size_t>(d)] = sel.value_score(l, h, d);
      }
      std::vector<std::int32_t> tk(4), tv(3);
      top_r_channels(want_k.data(), D, 4, tk.data());
      top_r_channels(want_v.data(), D, 3, tv.data());
      CHECK(std::vector<std::int32_t>(sel.current_k(l) + h * 4, sel.current_k(l) + (h + 1) * 4) == tk);
      CHECK(std::vector<std::int32_t>(sel.current_v(l) + h * 3, sel.current_v(l) + (h + 1) * 3) == tv);
    }
  // The scripted tie: dims 2 and 5 of head (1, 1) score the same; the lower dim wins.
  REQUIRE(sel.key_score(1, 1, 2) == sel.key_score(1, 1, 5));
  CHECK(std::vector<std::int32_t>(sel.current_k(1) + 4, sel.current_k(1) + 8) == std::vector<std::int32_t>{1, 2, 3, 7});
  // Statistics are policy metadata: 4 float64 moments and a count per (layer, head, dim).
  ChannelParams pe = p;
  pe.score = ChannelScore::kThink;
  const ChannelSelector think(pe, L, H, D, G);
  CHECK(sel.metadata_bytes() - think.metadata_bytes() ==
        static_cast<std::int64_t>(L * H * (4 * D * sizeof(double) + sizeof(std::int64_t)) - L * H * D * sizeof(float)));
}

TEST_CASE("engine: key compensation means are exact after pack, back-off and re-pack; bytes exact",
          "[kvchan][engine]") {
  ChannelParams p = small_params();
  p.score = ChannelScore::kCentered;
  p.k_compensation = true;
  SECTION("keys only") {}
  SECTION("keys and values compensated") { p.mean_compensation = true; }
  auto eng = std::make_unique<Engine>(stories(), small_opts());
  const engine::ModelConfig c = eng->config();
  const std::int32_t L = c.n_layers, H = c.n_kv_heads, D = c.head_dim();
  // Recorder, registered before the policy's hook: full-width K of every token by position
  // (the policy has not packed this step's tokens yet when it runs).
  std::vector<std::vector<float>> rows;  // [pos][L, H, D]
  KvchanPolicy* pol = nullptr;
  SeqId id = -1;
  eng->add_step_hook([&](Engine& e, const engine::StepInfo&) {
    const std::int32_t n_old = pol->old_tokens(id);
    for (std::int32_t pos = static_cast<std::int32_t>(rows.size()); pos < n_old + e.kv_len(id); ++pos) {
      REQUIRE(pos >= n_old);
      std::vector<float> r;
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t h = 0; h < H; ++h) {
          const float* k = e.layer_views()[static_cast<std::size_t>(l)].k_ptr(0, pos - n_old, h);
          r.insert(r.end(), k, k + D);
        }
      rows.push_back(std::move(r));
    }
  });
  KvchanOptions ko;
  ko.params = p;
  KvchanPolicy policy(ko);
  pol = &policy;
  policy.attach(*eng);
  id = eng->add_sequence({engine::kBosToken, 10});
  auto check_means = [&]() {
    const std::int32_t n_old = policy.old_tokens(id);
    REQUIRE(n_old > 0);
    REQUIRE(policy.old_tokens_packed(id));
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        const float* m = policy.k_mean(id, l, h);
        REQUIRE(m != nullptr);
        const std::int32_t* ks = policy.selector().packed_k(l) + h * p.r_k;
        for (std::int32_t d = 0; d < D; ++d) {
          double sum = 0;  // token order, float64: the policy's order, so equality is exact
          for (std::int32_t t = 0; t < n_old; ++t) sum += rows[static_cast<std::size_t>(t)][static_cast<std::size_t>((l * H + h) * D + d)];
          const bool kept = std::binary_search(ks, ks + p.r_k, d);
          INFO("layer " << l << " head " << h << " dim " << d << " old tokens " << n_old);
          CHECK(m[d] == (kept ? 0.f : static_cast<float>(sum / n_old)));
        }
      }
  };
  auto bytes = [&]() {
    std::int64_t pages = 0;
    pages += (eng->kv_len(id) + eng->options().page_size - 1) / eng->options().page_size;
    CHECK(eng->pages_in_use() == pages);
    const std::int64_t pools = policy.packed_pool().pages_in_use() * policy.packed_pool().page_bytes() +
                               policy.full_pool().pages_in_use() * policy.full_pool().page_bytes();
    CHECK(policy.memory_bytes() == eng->pages_bytes(eng->pages_in_use()) + pools + policy.metadata_bytes());
    CHECK(eng->kv_bytes_in_use() == policy.memory_bytes());
    CHECK(policy.old_tokens(id) + eng->kv_len(id) == eng->position(id));
  };
  int s = 0;
  for (; s < 60 && !policy.old_tokens_packed(id); ++s) {
    eng->step();
    bytes();
  }
  REQUIRE(policy.old_tokens_packed(id));
  for (int i = 0; i < 10; ++i) {  // more pages packed: the running sums keep up
    eng->step();
    bytes();
  }
  check_means();
  // Back-off (no restore): old tokens to full width, dropped K dims = their mean.
  const std::int32_t n_old = policy.old_tokens(id);
  std::vector<std::vector<float>> means(static_cast<std::size_t>(L * H));
  for (std::int32_t i = 0; i < L * H; ++i) {
    const float* m = policy.k_mean(id, i / H, i % H);
    means[static_cast<std::size_t>(i)].assign(m, m + D);
  }
  std::vector<std::int32_t> old_sets;
  for (std::int32_t l = 0; l < L; ++l) old_sets.insert(old_sets.end(), policy.selector().packed_k(l), policy.selector().packed_k(l) + H * p.r_k);
  policy.back_off();
  CHECK_FALSE(policy.old_tokens_packed(id));
  CHECK(policy.k_mean(id, 0, 0) == nullptr);
  bytes();
  std::vector<float> k(static_cast<std::size_t>(D)), v(static_cast<std::size_t>(D));
  for (std::int32_t t = 0; t < n_old; ++t)
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        policy.read_token(id, l, t, h, k.data(), v.data());
        const std::int32_t* ks = old_sets.data() + (l * H + h) * p.r_k;
        for (std::int32_t d = 0; d < D; ++d) {
          const bool kept = std::binary_search(ks, ks + p.r_k, d);
          const float want = kept ? rows[static_cast<std::size_t>(t)][static_cast<std::size_t>((l * H + h) * D + d)]
                                  : means[static_cast<std::size_t>(l * H + h)][static_cast<std::size_t>(d)];
          REQUIRE(k[static_cast<std::size_t>(d)] == want);
        }
        // The unpacked rows are what a re-pack sums: the reference follows them.
        std::copy(k.begin(), k.end(), rows[static_cast<std::size_t>(t)].begin() + (l * H + h) * D);
      }
  for (s = 0; s < 60 && !policy.old_tokens_packed(id); ++s) {
    eng->step();
    bytes();
  }
  REQUIRE(policy.old_tokens_packed(id));
  check_means();
  for (int i = 0; i < 6; ++i) {
    eng->step();
    bytes();
  }
  check_means();
}

#if defined(KVKIT_CLI_PATH)
TEST_CASE("CLI: bad kvchan options exit 2 naming the value", "[kvchan][cli]") {
  if (!std::filesystem::exists(kStoriesPath)) {
    WARN("skipped: no model file " << kStoriesPath);
    return;
  }
  const std::string base = std::string(KVKIT_CLI_PATH) + " generate --model " + kStoriesPath + " --steps 4 ";
  struct Case {
    std::string args, want;
  } cases[] = {{"--policy kvchan --rK 9", "rK must be in [1, head_dim 8], got 9"},
               {"--policy kvchan --W 0", "W must be >= 1, got 0"},
               {"--policy kvchan --N-stable 0", "N_stable must be >= 1, got 0"},
               {"--policy kvchan --T-update -1", "T_update must be >= 1, got -1"},
               {"--policy kvchan --rV 20", "rV must be in [1, head_dim 8]"},
               {"--policy kvchan --kvchan-residual-bits 3", "residual bits must be 0, 4 or 8, got 3"},
               {"--policy kvchan --kvchan-residual-bits 8 --kvchan-compensate",
                "residual bits 8 exclude mean / key compensation"},
               {"--W 8", "--W needs --policy kvchan"}};
  const std::string err = (std::filesystem::temp_directory_path() / "kvchan_cli_err.txt").string();
  for (const Case& c : cases) {
    const int rc = std::system((base + c.args + " > /dev/null 2> " + err).c_str());
    std::ifstream f(err);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    INFO(c.args << " -> " << text);
    CHECK(WIFEXITED(rc));
    CHECK(WEXITSTATUS(rc) == 2);
    CHECK(text.find(c.want) != std::string::npos);
  }
  // A good run packs and reports its counters.
  const int rc = std::system((base.substr(0, base.find("--steps")) +
                              "--steps 120 --policy kvchan --W 16 --rK 6 --rV 8 --T-update 4 --N-stable 1 "
                              "--kvchan-retention 0.5 --kvchan-ema 0.99 --check-every 8 --json > " + err)
                                 .c_str());
  CHECK(rc == 0);
  std::ifstream f(err);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(text.find("\"packed_heads\"") != std::string::npos);
  CHECK(text.find("\"backoffs\"") != std::string::npos);
}
#endif
