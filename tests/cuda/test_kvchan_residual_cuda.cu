// Parity of kvchan's residual on CUDA (kernels/cuda/kvchan_residual.cuh) with the CPU twin
// (channel/residual.hpp): on fresh random pools (float / half / bfloat16, NHD or HND full
// side, 4 and 8 bits, sets of 1 dim up to the full width) the GPU's codes, scales and
// unpacked dims equal the CPU twin's bit for bit, and residual attention agrees with the
// CPU's within float rounding (expf / logf differ). Bad channel ids are recorded in the
// DeviceStatus and nothing is written.
//
// Without a GPU every GPU case passes with WARN("skipped: no GPU"); the host-side argument
// checks need no GPU and always run.
#include <kvkit/cuda.cuh>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.cuh"
#include "kvchan_pack_cases.hpp"
#include "reference.hpp"

using namespace kvkit;
using kvkit::test::DeviceBuffer;
using kvkit::test::PackCase;
using kvkit::test::Stream;

namespace {

template <class T>
void check_parity(const PackCase<T>& c0, std::int32_t bits, std::mt19937_64& rng) {
  PackCase<T> c = c0;
  test::ResidualCase hp(bits, c.heads, c.page_size, c.packed_g.num_pages, c.k_dim - c.rk, c.v_dim - c.rv, rng);
  DeviceBuffer<T> fk(c.fk), fv(c.fv);
  DeviceBuffer<std::uint8_t> dbytes(hp.bytes);
  DeviceBuffer<std::int32_t> kch(c.kch), vch(c.vch), fp(c.full_pages), pp(c.packed_pages);
  const channel::ResidualView dres = hp.block.view(dbytes.get(), hp.view.num_pages_total);
  Stream st;
  const exec::Host host{1};
  REQUIRE(channel::pack_residual_pages(host, c.full_view(c.fk.data(), c.fv.data()), hp.view, c.kch.data(),
                                       c.vch.data(), c.rk, c.rv, c.full_pages.data(), c.packed_pages.data(), c.n_pages,
                                       c.n_tokens)
              .is_ok());
  KVKIT_REQUIRE_OK(channel::pack_residual_pages(st.exec(), c.full_view(fk.get(), fv.get(), MemorySpace::kCuda), dres,
                                                kch.get(), vch.get(), c.rk, c.rv, fp.get(), pp.get(), c.n_pages,
                                                c.n_tokens));
  KVKIT_REQUIRE_OK(st.status());
  REQUIRE(dbytes.download() == hp.bytes);  // codes and scales, bit for bit
  // Unpack into another full-width pool (random contents) at other page ids.
  std::vector<T> bk = test::random_vector<T>(c.fk.size(), rng), bv = test::random_vector<T>(c.fv.size(), rng);
  const std::vector<std::int32_t> pages = test::random_pages(c.n_pages, c.full_g.num_pages, rng);
  DeviceBuffer<T> dbk(bk), dbv(bv);
  DeviceBuffer<std::int32_t> dpages(pages);
  REQUIRE(channel::unpack_residual_pages(host, hp.view, c.full_view(bk.data(), bv.data()), c.kch.data(), c.vch.data(),
                                         c.rk, c.rv, c.packed_pages.data(), pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  KVKIT_REQUIRE_OK(channel::unpack_residual_pages(st.exec(), dres, c.full_view(dbk.get(), dbv.get(), MemorySpace::kCuda),
                                                  kch.get(), vch.get(), c.rk, c.rv, pp.get(), dpages.get(), c.n_pages,
                                                  c.n_tokens));
  KVKIT_REQUIRE_OK(st.status());
  REQUIRE(test::bitwise_equal(dbk.download(), bk));
  REQUIRE(test::bitwise_equal(dbv.download(), bv));

  // Attention over the packed pages + residual, every sequence one page list of the case.
  KVKIT_REQUIRE_OK(channel::pack_channel_pages(host, c.full_view(c.fk.data(), c.fv.data()),
                                               c.packed_view(c.pk.data(), c.pv.data()), c.kch.data(), c.vch.data(),
                                               c.full_pages.data(), c.packed_pages.data(), c.n_pages, c.n_tokens));
  DeviceBuffer<T> dpk(c.pk), dpv(c.pv);
  const std::int32_t G = 2, Hq = c.heads * G, D = c.k_dim;
  const std::vector<std::int32_t> indptr{0, c.n_pages, c.n_pages};  // a second, empty sequence
  const std::vector<std::int32_t> last{c.n_tokens - (c.n_pages - 1) * c.page_size, 0};
  DeviceBuffer<std::int32_t> dindptr(indptr), dlast(last);
  const KVGeometry g = c.packed_g;
  const auto hview = make_csr_view(g, c.pk.data(), packed_strides(g, KVLayout::kNHD), c.pv.data(),
                                   packed_v_strides(g, KVLayout::kNHD),
                                   CsrPageTable{indptr.data(), c.packed_pages.data(), last.data(), 2});
  const auto dview = make_csr_view(g, dpk.get(), packed_strides(g, KVLayout::kNHD), dpv.get(),
                                   packed_v_strides(g, KVLayout::kNHD),
                                   CsrPageTable{dindptr.get(), pp.get(), dlast.get(), 2}, MemorySpace::kCuda);
  const std::vector<T> q = test::random_vector<T>(static_cast<std::size_t>(2) * Hq * D, rng, -2.f, 2.f);
  DeviceBuffer<T> dq(q), dout(q.size());
  DeviceBuffer<float> dlse(2 * Hq);
  std::vector<T> out(q.size());
  std::vector<float> lse(2 * Hq);
  DecodeAttentionParams p{Hq, 1.f / std::sqrt(static_cast<float>(D))};
  p.k_channels = c.kch.data();
  p.v_channels = c.vch.data();
  p.q_dim = D;
  REQUIRE(channel::residual_channel_attention(host, hview, hp.view, q.data(), out.data(), lse.data(), p).is_ok());
  p.k_channels = kch.get();
  p.v_channels = vch.get();
  KVKIT_REQUIRE_OK(channel::residual_channel_attention(st.exec(), dview, dres, dq.get(), dout.get(), dlse.get(), p));
  KVKIT_REQUIRE_OK(st.status());
  const std::vector<T> gout = dout.download();
  const std::vector<float> glse = dlse.download();
  const double tol = std::is_same<T, float>::value ? 1e-5 : std::is_same<T, half_t>::value ? 2e-3 : 1.6e-2;
  for (std::size_t i = 0; i < out.size(); ++i)
    REQUIRE(std::fabs(test::to_double(gout[i]) - test::to_double(out[i])) <= tol * (1 + std::fabs(test::to_double(out[i]))));
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse[i])) {
      REQUIRE(std::isinf(glse[i]));
      continue;
    }
    REQUIRE(std::fabs(glse[i] - lse[i]) <= 1e-5 * (1 + std::fabs(lse[i])));
  }
}

template <class T>
void parity_cases(std::mt19937_64& rng) {
  test::for_each_residual_parity_case<T>(rng, [&](const PackCase<T>& c, std::int32_t bits) {
    INFO("bits " << bits << " rk " << c.rk << " rv " << c.rv << " tokens " << c.n_tokens);
    check_parity(c, bits, rng);
  });
}

}  // namespace

TEMPLATE_TEST_CASE("CUDA residual pack / unpack / attention match the CPU twin", "[cuda][kvchan][residual]", float,
                   half_t, bfloat16_t) {
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  parity_cases<TestType>(rng);
}

TEST_CASE("CUDA residual: a bad channel id is recorded and nothing is written", "[cuda][kvchan][residual]") {
  KVKIT_TEST_RNG(rng);
  const auto c = test::make_pack_case<float>(2, 8, 8, 3, 5, 4, 9, KVLayout::kNHD, rng);
  // Host checks first (no GPU needed): bad bits.
  test::ResidualCase hp(8, 2, 4, c.packed_g.num_pages, 5, 3, rng);
  channel::ResidualView bad = hp.view;
  bad.bits = 5;
  const auto hfull = c.full_view(const_cast<float*>(c.fk.data()), const_cast<float*>(c.fv.data()), MemorySpace::kCuda);
  const Status s = channel::pack_residual_pages(exec::Cuda{nullptr, nullptr}, hfull, bad, c.kch.data(), c.vch.data(),
                                                3, 5, c.full_pages.data(), c.packed_pages.data(), c.n_pages,
                                                c.n_tokens);
  CHECK_FALSE(s.is_ok());
  KVKIT_REQUIRE_GPU();
  DeviceBuffer<float> fk(c.fk), fv(c.fv);
  DeviceBuffer<std::uint8_t> dbytes(hp.bytes);
  std::vector<std::int32_t> kch = c.kch;
  kch[1] = 99;
  DeviceBuffer<std::int32_t> dkch(kch), dvch(c.vch), fp(c.full_pages), pp(c.packed_pages);
  const channel::ResidualView dres = hp.block.view(dbytes.get(), hp.view.num_pages_total);
  Stream st;
  KVKIT_REQUIRE_OK(channel::pack_residual_pages(st.exec(), c.full_view(fk.get(), fv.get(), MemorySpace::kCuda), dres,
                                                dkch.get(), dvch.get(), 3, 5, fp.get(), pp.get(), c.n_pages,
                                                c.n_tokens));
  const Status ds = st.status();
  CHECK(ds.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(ds.to_string(), Catch::Contains("99"));
  CHECK(dbytes.download() == hp.bytes);
}
