// DecodeAttentionParams::bf16_dot (opt-in, bfloat16 KV): scores sm_scale * (q·k) from
// exact bf16 products accumulated in float (vdpbf16ps where the build has AVX512_BF16,
// float FMAs otherwise), against a float64 emulation of the same arithmetic (q as passed
// in bfloat16, unscaled, products exact, sm_scale applied to the dot product). Compiled
// per instruction set (tests/kvkit_simd_tests.cmake): the native build checks vdpbf16ps,
// the others the fallback.
//
// Tolerances come from error bounds, per element:
//   score_t: any float summation order of kdim exact products errs by at most
//            gamma(kdim) * sum_d |q_d k_d| (gamma(n) = n u / (1 - n u), u = 2^-24), the
//            scale multiply by u |score|, flushed subnormal partial sums by kdim 2^-126.
//   out:     score errors <= D shift each softmax weight by a factor within e^{+-2D};
//            exp (vexp, about 2 ulp; 4 allowed) and the subtraction s - m add relative
//            errors; float accumulation of V, rescales, the chunk merge and 1/l add
//            (2T + 64) u relative to sum_t w_t |v_t|; the bf16 output rounding adds
//            2^-8 of the result.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"
#include "test_scale.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

constexpr double kU = 1.0 / 16777216.0;  // 2^-24, float unit roundoff
constexpr double kFtz = 1.1754943508222875e-38;  // 2^-126
constexpr double kExpRel = 4.0 * 2.0 * kU;  // 4 ulp of vexp

double gamma(double n) { return n * kU / (1.0 - n * kU); }

struct Case {
  std::int32_t hkv = 2, kdim = 64, vdim = 64, page_size = 16, group = 4;
  KVLayout k_layout = KVLayout::kNHD, v_layout = KVLayout::kNHD;
  std::vector<std::int32_t> lens;
  bool channels = false, subset = false, scores = false;
};

/// float64 emulation with per-element bounds. out/lse/scores as the kernel's, plus the
/// tolerance of each.
struct Expect {
  std::vector<double> out, out_tol, lse, lse_tol, scores, scores_tol;
};

Expect emulate(const PagedKVView<bfloat16_t>& view, const std::vector<bfloat16_t>& q,
               const DecodeAttentionParams& p, std::int64_t scores_stride) {
  const std::int32_t hkv = view.num_kv_heads, hq = p.num_qo_heads, G = hq / hkv;
  const std::int32_t kdim = view.head_dim, vdim = view.v_head_dim;
  const std::int32_t q_width = p.k_channels ? p.q_dim : kdim;
  const std::int32_t out_width = p.v_channels ? p.q_dim : vdim;
  const double inf = std::numeric_limits<double>::infinity();
  Expect e;
  const std::size_t rows = static_cast<std::size_t>(view.batch_size) * hq;
  e.out.assign(rows * out_width, 0.0);
  e.out_tol.assign(rows * out_width, 0.0);
  e.lse.assign(rows, -inf);
  e.lse_tol.assign(rows, 0.0);
  e.scores.assign(rows * std::max<std::int64_t>(1, scores_stride), -inf);
  e.scores_tol.assign(e.scores.size(), 0.0);
  const double s = p.sm_scale;
  for (std::int32_t b = 0; b < view.batch_size; ++b)
    for (std::int32_t qh = 0; qh < hq; ++qh) {
      const std::int32_t h = qh / G;
      const std::size_t row = static_cast<std::size_t>(b) * hq + qh;
      std::vector<std::int32_t> toks;
      for (std::int32_t lp = 0; lp < view.num_pages(b); ++lp) {
        if (p.page_subset_indptr &&
            !std::binary_search(p.page_subset + p.page_subset_indptr[b * hkv + h],
                                p.page_subset + p.page_subset_indptr[b * hkv + h + 1], lp))
          continue;
        for (std::int32_t t = lp * view.page_size; t < std::min(view.seq_len(b), (lp + 1) * view.page_size); ++t)
          toks.push_back(t);
      }
      if (toks.empty()) continue;
      const bfloat16_t* qr = q.data() + row * q_width;
      std::vector<double> logit, err;
      double mx = -inf, max_abs = 0, worst = 0;
      for (std::int32_t t : toks) {
        const bfloat16_t* kr = view.k_ptr(b, t, h);
        double dot = 0, mag = 0;
        for (std::int32_t c = 0; c < kdim; ++c) {
          const double x = to_double(qr[p.k_channels ? p.k_channels[h * kdim + c] : c]) * to_double(kr[c]);
          dot += x;  // exact: bf16 x bf16 products, |sum| far inside double's range
          mag += std::abs(x);
        }
        const double sc = s * dot;
        const double tol = s * (gamma(kdim) * mag + kdim * kFtz) + 2 * kU * std::abs(sc);
        logit.push_back(sc);
        err.push_back(tol);
        mx = std::max(mx, sc);
        max_abs = std::max(max_abs, std::abs(sc));
        worst = std::max(worst, tol);
        if (scores_stride > 0) {
          e.scores[row * scores_stride + t] = sc;
          e.scores_tol[row * scores_stride + t] = tol;
        }
      }
      const double T = static_cast<double>(toks.size());
      // Per-weight relative error: score errors (2 worst, max and own), s - m rounding,
      // exp, and the float sum l.
      const double d = 2 * worst + 2 * max_abs * kU + kExpRel + gamma(T + 64);
      const double wrel = std::expm1(2 * d);
      double sum = 0;
      for (double& l : logit) sum += (l = std::exp(l - mx));
      for (std::int32_t c = 0; c < vdim; ++c) {
        double o = 0, mag = 0;
        for (std::size_t i = 0; i < toks.size(); ++i) {
          const double v = to_double(view.v_ptr(b, toks[i], h)[c]);
          o += logit[i] / sum * v;
          mag += logit[i] / sum * std::abs(v);
        }
        const std::size_t oi = row * out_width + (p.v_channels ? p.v_channels[h * vdim + c] : c);
        e.out[oi] = o;
        e.out_tol[oi] = 0x1p-8 * std::abs(o) + (wrel + gamma(2 * T + 64)) * mag * (1 + 0x1p-8) + 1e-30;
      }
      e.lse[row] = mx + std::log(sum);
      e.lse_tol[row] = d + 4 * kU * (std::abs(e.lse[row]) + 1);
    }
  return e;
}

/// Worst (|got - want| / tol) over finite wants; also checks that -inf wants are -inf.
template <class G>
std::string check_within(const G* got, const std::vector<double>& want, const std::vector<double>& tol,
                         const char* what) {
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = to_double(got[i]);
    if (std::isinf(want[i])) {
      if (g != want[i]) return std::string(what) + "[" + std::to_string(i) + "] should be -inf, got " + std::to_string(g);
      continue;
    }
    const double r = g == want[i] ? 0.0 : std::abs(g - want[i]) / tol[i];  // exact zeros: tol 0
    if (!(r <= worst)) {
      worst = r;
      at = i;
    }
  }
  if (worst <= 1.0) return "";
  return std::string(what) + "[" + std::to_string(at) + "] = " + std::to_string(to_double(got[at])) +
         " but emulation is " + std::to_string(want[at]) + " (error " + std::to_string(worst) + " x the bound " +
         std::to_string(tol[at]) + ")";
}

struct Out {
  std::vector<bfloat16_t> out;
  std::vector<float> lse, scores;
  Status status;
};

Out run(const PagedKVView<bfloat16_t>& view, const std::vector<bfloat16_t>& q, DecodeAttentionParams p,
        std::int64_t scores_stride, int threads, std::mt19937_64& rng) {
  const std::int32_t out_width = p.v_channels ? p.q_dim : view.v_head_dim;
  Out r;
  r.out = random_vector<bfloat16_t>(static_cast<std::size_t>(view.batch_size) * p.num_qo_heads * out_width, rng);
  r.lse.assign(static_cast<std::size_t>(view.batch_size) * p.num_qo_heads, 77.f);
  if (scores_stride > 0) {
    r.scores.assign(static_cast<std::size_t>(view.batch_size) * p.num_qo_heads * scores_stride, 55.f);
    p.scores = r.scores.data();
    p.scores_stride = scores_stride;
  }
  std::vector<unsigned char> ws(paged_decode_attention_workspace_size(exec::Host{threads}, view, p) + 1);
  r.status = paged_decode_attention(exec::Host{threads}, view, q.data(), r.out.data(), p,
                                    Workspace{ws.data(), ws.size()}, r.lse.data());
  return r;
}

void check_case(const Case& cs, std::mt19937_64& rng) {
  PoolSpec ps;
  ps.num_kv_heads = cs.hkv;
  ps.head_dim = cs.kdim;
  ps.v_head_dim = cs.vdim;
  ps.page_size = cs.page_size;
  ps.layout = cs.k_layout;
  ps.v_layout = static_cast<int>(cs.v_layout);
  ps.seq_lens = cs.lens;
  ps.spare_pages = 2;
  RandomPool<bfloat16_t> pool(ps, rng);
  const PagedKVView<bfloat16_t>& view = pool.view;
  const std::int32_t hq = cs.hkv * cs.group, batch = static_cast<std::int32_t>(cs.lens.size());
  DecodeAttentionParams p{hq, 1.f / std::sqrt(static_cast<float>(cs.kdim))};
  p.bf16_dot = true;
  std::vector<std::int32_t> kch, vch, indptr{0}, pages;
  if (cs.channels) {
    p.q_dim = std::max(cs.kdim, cs.vdim) + 8;
    for (std::int32_t h = 0; h < cs.hkv; ++h) {
      for (std::int32_t c : random_distinct(cs.kdim, p.q_dim, rng)) kch.push_back(c);
      for (std::int32_t c : random_distinct(cs.vdim, p.q_dim, rng)) vch.push_back(c);
    }
    p.k_channels = kch.data();
    p.v_channels = vch.data();
  }
  if (cs.subset) {
    std::bernoulli_distribution keep(0.6);
    for (std::int32_t b = 0; b < batch; ++b)
      for (std::int32_t h = 0; h < cs.hkv; ++h) {
        for (std::int32_t i = 0; i < view.num_pages(b); ++i)
          if (keep(rng)) pages.push_back(i);
        indptr.push_back(static_cast<std::int32_t>(pages.size()));
      }
    p.page_subset_indptr = indptr.data();
    p.page_subset = pages.data();
  }
  const std::int32_t q_width = cs.channels ? p.q_dim : cs.kdim;
  const std::vector<bfloat16_t> q =
      random_vector<bfloat16_t>(static_cast<std::size_t>(batch) * hq * q_width, rng, -3.f, 3.f);
  std::int64_t stride = 0;
  if (cs.scores)
    for (std::int32_t len : cs.lens) stride = std::max<std::int64_t>(stride, len + 3);
  const Expect want = emulate(view, q, p, stride);
  const Out one = run(view, q, p, stride, 1, rng);
  INFO(one.status.to_string());
  REQUIRE(one.status.is_ok());
  REQUIRE(check_within(one.out.data(), want.out, want.out_tol, "out") == "");
  REQUIRE(check_within(one.lse.data(), want.lse, want.lse_tol, "lse") == "");
  if (cs.scores) {
    std::vector<double> ws = want.scores, wt = want.scores_tol;
    for (std::int32_t b = 0; b < batch; ++b)  // past each sequence's end: untouched (55)
      for (std::int32_t h = 0; h < hq; ++h)
        for (std::int64_t t = cs.lens[static_cast<std::size_t>(b)]; t < stride; ++t) {
          const std::size_t i = (static_cast<std::size_t>(b) * hq + h) * stride + t;
          ws[i] = 55.0;
          wt[i] = 0.0;
          REQUIRE(one.scores[i] == 55.f);
        }
    for (double& t : wt) t = std::max(t, 1e-300);
    REQUIRE(check_within(one.scores.data(), ws, wt, "scores") == "");
  }
  const Out three = run(view, q, p, stride, 3, rng);
  REQUIRE(three.status.is_ok());
  REQUIRE(bitwise_equal(one.out, three.out));
  REQUIRE(bitwise_equal(one.lse, three.lse));
  REQUIRE(bitwise_equal(one.scores, three.scores));
}

}  // namespace

TEST_CASE("bf16_dot matches a float64 emulation within its error bound", "[cpu][attention][bf16_dot]") {
  KVKIT_TEST_RNG(rng);
  INFO("simd path " << kvkit::detail::cpu::simd_isa() << " vdpbf16ps "
#if defined(KVKIT_SIMD_AVX512BF16)
                    << "yes");
#else
                    << "no");
#endif
  const std::pair<KVLayout, KVLayout> layouts[] = {{KVLayout::kNHD, KVLayout::kNHD},
                                                   {KVLayout::kHND, KVLayout::kHND},
                                                   {KVLayout::kNHD, KVLayout::kHND}};
  // kdim 128/64/96: full 32-wide chunks; 20, 48 and 8: masked tails.
  const std::pair<std::int32_t, std::int32_t> dims[] = {{128, 128}, {64, 32}, {96, 64}, {20, 36}, {48, 48}, {8, 8}};
  long c = -1;
  for (const auto& lay : layouts)
    for (std::int32_t group : {1, 2, 3, 4})
      for (std::int32_t ps : {1, 16})
        for (const auto& kv : dims) {
          if (!sampled(++c, 5)) continue;  // the sanitizer build: 29 of the 144 cases
          CAPTURE(to_string(lay.first), to_string(lay.second), group, ps, kv.first, kv.second);
          std::uniform_int_distribution<std::int32_t> u(1, 3 * ps);
          Case cs;
          cs.kdim = kv.first;
          cs.vdim = kv.second;
          cs.page_size = ps;
          cs.group = group;
          cs.k_layout = lay.first;
          cs.v_layout = lay.second;
          // empty, S = 1, a full page, a partial last page, longer than a tile, and one long
          // enough to be cut into chunks (log-sum-exp merge)
          cs.lens = {0, 1, ps, u(rng), 70 + u(rng) % 9, 1100 + u(rng)};
          check_case(cs, rng);
        }
}

TEST_CASE("bf16_dot with page subsets, channels and scores", "[cpu][attention][bf16_dot]") {
  KVKIT_TEST_RNG(rng);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
    for (int mask = 0; mask < 8; ++mask) {
      Case cs;
      cs.subset = mask & 1;
      cs.channels = mask & 2;
      cs.scores = mask & 4;
      CAPTURE(to_string(layout), cs.subset, cs.channels, cs.scores);
      cs.kdim = cs.channels ? 40 : 64;
      cs.vdim = cs.channels ? 24 : 64;
      cs.group = 3;
      cs.k_layout = cs.v_layout = layout;
      std::uniform_int_distribution<std::int32_t> u(1, 40);
      cs.lens = {u(rng), 1, 0, 16, 33 + u(rng)};
      check_case(cs, rng);
      cs.lens = {2000 + u(rng)};  // one long sequence: chunked
      check_case(cs, rng);
    }
}

TEST_CASE("bf16_dot is rejected on float and half views before writing", "[cpu][attention][bf16_dot][errors]") {
  KVKIT_TEST_RNG(rng);
  auto reject = [&](auto tag) {
    using T = decltype(tag);
    PoolSpec ps;
    ps.seq_lens = {5, 9};
    RandomPool<T> pool(ps, rng);
    DecodeAttentionParams p{4, 0.25f};
    p.bf16_dot = true;
    const std::vector<T> q = random_vector<T>(2 * 4 * 16, rng);
    std::vector<T> out = random_vector<T>(q.size(), rng);
    const std::vector<T> before = out;
    std::vector<unsigned char> ws(paged_decode_attention_workspace_size(exec::Host{1}, pool.view, p) + 1);
    const Status st = paged_decode_attention(exec::Host{1}, pool.view, q.data(), out.data(), p,
                                             Workspace{ws.data(), ws.size()});
    INFO(st.to_string());
    REQUIRE(st.code() == StatusCode::kInvalidArgument);
    REQUIRE(st.to_string().find("bf16_dot") != std::string::npos);
    REQUIRE(bitwise_equal(out, before));
  };
  reject(float{});
  reject(half_t{});
}
