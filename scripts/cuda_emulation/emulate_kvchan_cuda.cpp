#include "kvkit/kernels/cuda/kvchan_residual.cuh"  // the rewritten copies (run.sh puts their dir first)
// kvchan's CUDA page pack / unpack and residual kernels, emulated on the host (see run.sh),
// against the CPU twins on the cases of tests/cuda/test_kvchan_residual_cuda.cu: packed rows,
// codes, scales and unpacked dims bit for bit; residual attention within float rounding
// (the host expf / logf stand in for the GPU's); a bad channel id is recorded in the
// DeviceStatus and nothing is written.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvchan_pack_cases.hpp"
using namespace kvkit;

int total_cases = 0, bad_cases = 0;

// One case: host (exec::Host) and emulated device (exec::Cuda, host memory tagged kCuda)
// runs of pack, residual pack, residual unpack and residual attention, compared.
template <class T>
void run(const test::PackCase<T>& c0, std::int32_t bits, std::mt19937_64& rng) {
  ++total_cases;
  test::PackCase<T> c = c0, g = c0;  // host side, "device" side
  test::ResidualCase hr(bits, c.heads, c.page_size, c.packed_g.num_pages, c.k_dim - c.rk, c.v_dim - c.rv, rng);
  test::ResidualCase dr = hr;
  dr.view.k_codes = dr.kc.data();
  dr.view.v_codes = dr.vc.data();
  dr.view.scales = dr.sc.data();
  const exec::Host host{1};
  DeviceStatus dst;
  const exec::Cuda dev{nullptr, &dst};
  const MemorySpace kd = MemorySpace::kCuda;
  std::string why;
  auto check = [&](bool ok, const char* what) {
    if (!ok && why.empty()) why = what;
  };
  check(channel::pack_channel_pages(host, c.full_view(c.fk.data(), c.fv.data()), c.packed_view(c.pk.data(), c.pv.data()),
                                    c.kch.data(), c.vch.data(), c.full_pages.data(), c.packed_pages.data(), c.n_pages,
                                    c.n_tokens)
            .is_ok(), "host pack");
  check(channel::pack_channel_pages(dev, g.full_view(g.fk.data(), g.fv.data(), kd), g.packed_view(g.pk.data(), g.pv.data(), kd),
                                    g.kch.data(), g.vch.data(), g.full_pages.data(), g.packed_pages.data(), g.n_pages,
                                    g.n_tokens)
            .is_ok() && dst.code == 0, "device pack");
  check(test::bitwise_equal(c.pk, g.pk) && test::bitwise_equal(c.pv, g.pv), "packed rows differ");
  check(channel::pack_residual_pages(host, c.full_view(c.fk.data(), c.fv.data()), hr.view, c.kch.data(), c.vch.data(),
                                     c.rk, c.rv, c.full_pages.data(), c.packed_pages.data(), c.n_pages, c.n_tokens)
            .is_ok(), "host residual pack");
  check(channel::pack_residual_pages(dev, g.full_view(g.fk.data(), g.fv.data(), kd), dr.view, g.kch.data(), g.vch.data(),
                                     g.rk, g.rv, g.full_pages.data(), g.packed_pages.data(), g.n_pages, g.n_tokens)
            .is_ok() && dst.code == 0, "device residual pack");
  check(hr.kc == dr.kc && hr.vc == dr.vc && test::bitwise_equal(hr.sc, dr.sc), "codes or scales differ");
  // Unpack into another full-width pool (random contents) at other page ids.
  std::vector<T> bk = test::random_vector<T>(c.fk.size(), rng), bv = test::random_vector<T>(c.fv.size(), rng);
  std::vector<T> gbk = bk, gbv = bv;
  const std::vector<std::int32_t> pages = test::random_pages(c.n_pages, c.full_g.num_pages, rng);
  check(channel::unpack_residual_pages(host, hr.view, c.full_view(bk.data(), bv.data()), c.kch.data(), c.vch.data(), c.rk,
                                       c.rv, c.packed_pages.data(), pages.data(), c.n_pages, c.n_tokens)
            .is_ok(), "host residual unpack");
  check(channel::unpack_residual_pages(dev, dr.view, g.full_view(gbk.data(), gbv.data(), kd), g.kch.data(), g.vch.data(),
                                       g.rk, g.rv, g.packed_pages.data(), pages.data(), g.n_pages, g.n_tokens)
            .is_ok() && dst.code == 0, "device residual unpack");
  check(test::bitwise_equal(bk, gbk) && test::bitwise_equal(bv, gbv), "unpacked dims differ");
  // Attention over the packed pages + residual: one sequence of the case's pages, one empty.
  const std::int32_t G = 2, Hq = c.heads * G, D = c.k_dim;
  const std::vector<std::int32_t> indptr{0, c.n_pages, c.n_pages};
  const std::vector<std::int32_t> last{c.n_tokens - (c.n_pages - 1) * c.page_size, 0};
  const KVGeometry pg = c.packed_g;
  auto view = [&](test::PackCase<T>& x, MemorySpace space) {
    return make_csr_view(pg, x.pk.data(), packed_strides(pg, KVLayout::kNHD), x.pv.data(),
                         packed_v_strides(pg, KVLayout::kNHD),
                         CsrPageTable{indptr.data(), x.packed_pages.data(), last.data(), 2}, space);
  };
  const std::vector<T> q = test::random_vector<T>(static_cast<std::size_t>(2) * Hq * D, rng, -2.f, 2.f);
  std::vector<T> out(q.size()), gout(q.size());
  std::vector<float> lse(2 * Hq), glse(2 * Hq);
  DecodeAttentionParams p{Hq, 1.f / std::sqrt(static_cast<float>(D))};
  p.k_channels = c.kch.data();
  p.v_channels = c.vch.data();
  p.q_dim = D;
  check(channel::residual_channel_attention(host, view(c, MemorySpace::kHost), hr.view, q.data(), out.data(), lse.data(), p)
            .is_ok(), "host attention");
  check(channel::residual_channel_attention(dev, view(g, kd), dr.view, q.data(), gout.data(), glse.data(), p).is_ok() &&
            dst.code == 0, "device attention");
  const double tol = std::is_same<T, float>::value ? 1e-5 : std::is_same<T, half_t>::value ? 2e-3 : 1.6e-2;
  double worst = 0;
  for (std::size_t i = 0; i < out.size(); ++i)
    worst = std::max(worst, std::fabs(test::to_double(gout[i]) - test::to_double(out[i])) /
                                (tol * (1 + std::fabs(test::to_double(out[i])))));
  for (std::size_t i = 0; i < lse.size(); ++i)
    if (std::isinf(lse[i]) ? !(std::isinf(glse[i]) && glse[i] < 0)
                           : std::fabs(glse[i] - lse[i]) > 1e-5 * (1 + std::fabs(lse[i])))
      worst = 2;
  check(worst <= 1, "attention differs beyond float rounding");
  if (!why.empty()) {
    ++bad_cases;
    std::printf("MISMATCH %s: T size %zu bits %d layout %d rk %d rv %d tokens %d (status %d check %d value %lld)\n",
                why.c_str(), sizeof(T), bits, static_cast<int>(c.full_layout), c.rk, c.rv, c.n_tokens, dst.code,
                dst.check, static_cast<long long>(dst.value));
  }
}

template <class T>
void all(std::mt19937_64& rng) {
  test::for_each_residual_parity_case<T>(rng, [&](const test::PackCase<T>& c, std::int32_t bits) { run(c, bits, rng); });
}

// A bad channel id: the device status names it and no code or scale is written.
void bad_channel(std::mt19937_64& rng) {
  ++total_cases;
  auto c = test::make_pack_case<float>(2, 8, 8, 3, 5, 4, 9, KVLayout::kNHD, rng);
  test::ResidualCase r(8, 2, 4, c.packed_g.num_pages, 5, 3, rng);
  const test::ResidualCase before = r;
  c.kch[1] = 99;
  DeviceStatus dst;
  const Status s = channel::pack_residual_pages(exec::Cuda{nullptr, &dst}, c.full_view(c.fk.data(), c.fv.data(),
                                                MemorySpace::kCuda), r.view, c.kch.data(), c.vch.data(), 3, 5,
                                                c.full_pages.data(), c.packed_pages.data(), c.n_pages, c.n_tokens);
  // Either report may come first (threads race to it, as on a GPU): id 99 out of range, or
  // the next id not above 99.
  if (!(s.is_ok() && dst.code == static_cast<int>(StatusCode::kInvalidArgument) && (dst.value == 99 || dst.bound == 99) &&
        r.kc == before.kc && r.vc == before.vc && test::bitwise_equal(r.sc, before.sc))) {
    ++bad_cases;
    std::printf("MISMATCH bad channel id: status %s, device code %d value %lld\n", s.to_string().c_str(), dst.code,
                static_cast<long long>(dst.value));
  }
}

int main() {
  std::mt19937_64 rng(42);
  all<float>(rng);
  all<half_t>(rng);
  all<bfloat16_t>(rng);
  bad_channel(rng);
  std::printf("cases %d, mismatched %d, launches %d\n", total_cases, bad_cases, emu::launches);
  return bad_cases != 0;
}
