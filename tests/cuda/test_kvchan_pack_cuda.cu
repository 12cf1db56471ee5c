// Parity of kvchan's page pack / unpack on CUDA (kernels/cuda/kvchan_pack.cuh) with the
// CPU twin (channel/pack_pages.hpp): on fresh random pools (full-width side NHD or HND,
// float / half / bfloat16, partial last pages, sets of 1 dim up to the full width) the
// GPU's packed pool and the GPU's unpacked pool (fill or zero) equal the CPU twin's bit
// for bit, including every element the call must not touch. Bad page or channel ids are
// recorded in the DeviceStatus with the CPU twin's message and nothing is written.
//
// Without a GPU every GPU case passes with WARN("skipped: no GPU"); the host-side argument
// checks need no GPU and always run.
#include <kvkit/cuda.cuh>

#include <catch2/catch.hpp>

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

// Device copies of a case's pools and tables.
template <class T>
struct DeviceCase {
  explicit DeviceCase(const PackCase<T>& c)
      : fk(c.fk), fv(c.fv), pk(c.pk), pv(c.pv), kch(c.kch), vch(c.vch), kfill(c.kfill), vfill(c.vfill),
        full_pages(c.full_pages), packed_pages(c.packed_pages) {}
  DeviceBuffer<T> fk, fv, pk, pv;
  DeviceBuffer<std::int32_t> kch, vch;
  DeviceBuffer<float> kfill, vfill;
  DeviceBuffer<std::int32_t> full_pages, packed_pages;
};

template <class T>
void check_parity(const PackCase<T>& c0, std::mt19937_64& rng) {
  PackCase<T> c = c0;  // the CPU twin works on this copy
  DeviceCase<T> d(c0);
  Stream st;
  const exec::Host host{1};
  // Pack.
  REQUIRE(channel::pack_channel_pages(host, c.full_view(c.fk.data(), c.fv.data()),
                                      c.packed_view(c.pk.data(), c.pv.data()), c.kch.data(), c.vch.data(),
                                      c.full_pages.data(), c.packed_pages.data(), c.n_pages, c.n_tokens)
              .is_ok());
  const auto dfull = c.full_view(d.fk.get(), d.fv.get(), MemorySpace::kCuda);
  const auto dpacked = c.packed_view(d.pk.get(), d.pv.get(), MemorySpace::kCuda);
  KVKIT_REQUIRE_OK(channel::pack_channel_pages(st.exec(), dfull, dpacked, d.kch.get(), d.vch.get(),
                                               d.full_pages.get(), d.packed_pages.get(), c.n_pages, c.n_tokens));
  KVKIT_REQUIRE_OK(st.status());
  REQUIRE(test::bitwise_equal(d.pk.download(), c.pk));
  REQUIRE(test::bitwise_equal(d.pv.download(), c.pv));
  // Unpack into another full-width pool (random contents) at other page ids.
  for (bool with_fill : {false, true}) {
    INFO("with_fill " << with_fill);
    std::vector<T> bk = test::random_vector<T>(c.fk.size(), rng), bv = test::random_vector<T>(c.fv.size(), rng);
    const std::vector<std::int32_t> pages = test::random_pages(c.n_pages, c.full_g.num_pages, rng);
    DeviceBuffer<T> dbk(bk), dbv(bv);
    DeviceBuffer<std::int32_t> dpages(pages);
    REQUIRE(channel::unpack_channel_pages(host, c.packed_view(c.pk.data(), c.pv.data()),
                                          c.full_view(bk.data(), bv.data()), c.kch.data(), c.vch.data(),
                                          with_fill ? c.kfill.data() : nullptr, with_fill ? c.vfill.data() : nullptr,
                                          c.packed_pages.data(), pages.data(), c.n_pages, c.n_tokens)
                .is_ok());
    KVKIT_REQUIRE_OK(channel::unpack_channel_pages(
        st.exec(), dpacked, c.full_view(dbk.get(), dbv.get(), MemorySpace::kCuda), d.kch.get(), d.vch.get(),
        with_fill ? d.kfill.get() : nullptr, with_fill ? d.vfill.get() : nullptr, d.packed_pages.get(),
        dpages.get(), c.n_pages, c.n_tokens));
    KVKIT_REQUIRE_OK(st.status());
    REQUIRE(test::bitwise_equal(dbk.download(), bk));
    REQUIRE(test::bitwise_equal(dbv.download(), bv));
  }
}

}  // namespace

TEST_CASE("kvchan pack cuda: host-side argument checks need no GPU", "[cuda][kvchan][errors]") {
  // Never dereferenced: every call below fails on the host before any CUDA call.
  auto* fake = reinterpret_cast<float*>(std::uintptr_t{4096});
  auto* ids = reinterpret_cast<std::int32_t*>(std::uintptr_t{8192});
  auto* fstatus = reinterpret_cast<DeviceStatus*>(std::uintptr_t{16384});
  std::mt19937_64 rng(1);
  const auto c = test::make_pack_case<float>(2, 16, 16, 4, 8, 4, 10, KVLayout::kNHD, rng);
  const auto full = c.full_view(fake, fake, MemorySpace::kCuda);
  const auto packed = c.packed_view(fake, fake, MemorySpace::kCuda);
  const exec::Cuda ex{nullptr, fstatus};
  auto code = [](const Status& s) { return s.code(); };
  CHECK(code(channel::pack_channel_pages(exec::Cuda{nullptr, nullptr}, full, packed, ids, ids, ids, ids, 3, 10)) ==
        StatusCode::kInvalidArgument);  // no status
  CHECK(code(channel::pack_channel_pages(ex, c.full_view(fake, fake), packed, ids, ids, ids, ids, 3, 10)) ==
        StatusCode::kWrongMemorySpace);  // host view
  CHECK(code(channel::pack_channel_pages(ex, full, packed, ids, ids, ids, ids, 2, 10)) ==
        StatusCode::kInvalidArgument);  // 10 tokens need 3 pages
  CHECK(code(channel::pack_channel_pages(ex, full, packed, nullptr, ids, ids, ids, 3, 10)) ==
        StatusCode::kInvalidArgument);  // null channels
  CHECK(code(channel::unpack_channel_pages(ex, packed, full, ids, ids, nullptr, nullptr, ids, nullptr, 3, 10)) ==
        StatusCode::kInvalidArgument);  // null pages
  CHECK(channel::pack_channel_pages(ex, full, packed, ids, ids, ids, ids, 0, 0).is_ok());  // nothing to do
  // The device checks' messages are the CPU twin's.
  DeviceStatus ds;
  ds.code = static_cast<std::int32_t>(StatusCode::kInvalidArgument);
  ds.check = static_cast<std::int32_t>(DeviceCheck::kPackChannel);
  ds.value = 16, ds.pos = 1, ds.seq = 0, ds.head = 1, ds.bound = 16;
  CHECK(to_status(ds).to_string().find("k_channels entry 16 of head 1 channel 1 out of range [0, 16)") !=
        std::string::npos);
  ds.check = static_cast<std::int32_t>(DeviceCheck::kPackChannelOrder);
  ds.value = 3, ds.pos = 3, ds.seq = 1, ds.head = 0, ds.bound = 3;
  CHECK(to_status(ds).to_string().find("v_channels entry 3 of head 0 channel 3 is not above the previous entry 3") !=
        std::string::npos);
}

TEMPLATE_TEST_CASE("kvchan pack cuda: pack and unpack equal the CPU twin bit for bit", "[cuda][kvchan]", float,
                   half_t, bfloat16_t) {
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  struct Shape {
    std::int32_t heads, k_dim, v_dim, rk, rv, page_size, n_tokens;
  };
  const Shape shapes[] = {
      {1, 8, 8, 1, 8, 4, 1},        {2, 64, 64, 16, 32, 16, 37},    {3, 64, 48, 64, 5, 8, 64},
      {4, 100, 100, 25, 50, 5, 23}, {2, 32, 32, 31, 1, 1, 7},       {8, 128, 128, 32, 128, 16, 1000},
  };
  for (const Shape& s : shapes)
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      CAPTURE(s.heads, s.k_dim, s.v_dim, s.rk, s.rv, s.page_size, s.n_tokens, static_cast<int>(layout));
      check_parity(test::make_pack_case<TestType>(s.heads, s.k_dim, s.v_dim, s.rk, s.rv, s.page_size, s.n_tokens,
                                                  layout, rng),
                   rng);
    }
}

TEST_CASE("kvchan pack cuda: bad device tables set the status, nothing is written", "[cuda][kvchan][errors]") {
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  const auto c = test::make_pack_case<float>(2, 16, 16, 4, 8, 4, 10, KVLayout::kNHD, rng);
  const exec::Host host{1};
  auto run = [&](const PackCase<float>& x, bool unpack) {
    DeviceCase<float> d(x);
    Stream st;
    const auto full = x.full_view(d.fk.get(), d.fv.get(), MemorySpace::kCuda);
    const auto packed = x.packed_view(d.pk.get(), d.pv.get(), MemorySpace::kCuda);
    PackCase<float> h = x;
    const auto hfull = h.full_view(h.fk.data(), h.fv.data());
    const auto hpacked = h.packed_view(h.pk.data(), h.pv.data());
    const Status want =
        unpack ? channel::unpack_channel_pages(host, hpacked, hfull, h.kch.data(), h.vch.data(), nullptr, nullptr,
                                               h.packed_pages.data(), h.full_pages.data(), h.n_pages, h.n_tokens)
               : channel::pack_channel_pages(host, hfull, hpacked, h.kch.data(), h.vch.data(), h.full_pages.data(),
                                             h.packed_pages.data(), h.n_pages, h.n_tokens);
    if (unpack)
      KVKIT_REQUIRE_OK(channel::unpack_channel_pages(st.exec(), packed, full, d.kch.get(), d.vch.get(), nullptr,
                                                     nullptr, d.packed_pages.get(), d.full_pages.get(), x.n_pages,
                                                     x.n_tokens));
    else
      KVKIT_REQUIRE_OK(channel::pack_channel_pages(st.exec(), full, packed, d.kch.get(), d.vch.get(),
                                                   d.full_pages.get(), d.packed_pages.get(), x.n_pages, x.n_tokens));
    const Status got = st.status();
    INFO("cpu: " << want.to_string() << " / gpu: " << got.to_string());
    CHECK(want.code() == StatusCode::kInvalidArgument);
    CHECK(got.code() == want.code());
    CHECK(got.to_string() == want.to_string());
    CHECK(test::bitwise_equal(d.fk.download(), x.fk));  // nothing written
    CHECK(test::bitwise_equal(d.fv.download(), x.fv));
    CHECK(test::bitwise_equal(d.pk.download(), x.pk));
    CHECK(test::bitwise_equal(d.pv.download(), x.pv));
  };
  for (bool unpack : {false, true}) {
    CAPTURE(unpack);
    auto x = c;
    x.full_pages[1] = c.full_g.num_pages;
    run(x, unpack);
    x = c;
    x.packed_pages[2] = -1;
    run(x, unpack);
    x = c;
    x.kch[5] = 16;
    run(x, unpack);
    x = c;
    x.vch[3] = x.vch[2];
    run(x, unpack);
  }
}
