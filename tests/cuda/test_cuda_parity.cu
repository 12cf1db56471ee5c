// Parity of the CUDA backend with the CPU twins: every core KV operation runs on random
// paged pools (shuffled page ids, NHD/HND for K and V separately, V rows narrower or
// wider than K rows, CSR/block table, padded and unaligned strides) on the GPU and on the
// CPU, for float, half and bfloat16. Copies must match bit for bit (whole pools, padding
// included, so stray writes show); attention and its variants (page subset, channel-
// restricted K/V, scores out) and the LSE merge are checked against float64 references.
//
// The device-status contract: bad device-resident indices give the same StatusCode as
// the CPU twin (read back with read_device_status after a sync) and the operation writes
// nothing; a status holding an error makes later operations do nothing.
//
// Without a GPU every GPU case passes with WARN("skipped: no GPU"); the argument-check
// cases need no GPU (host checks come before any CUDA call) and always run.
#include <kvkit/cuda.cuh>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.cuh"
#include "reference.hpp"

using namespace kvkit;
using kvkit::test::DeviceBuffer;
using kvkit::test::gpu_present;
using kvkit::test::Stream;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// Pool variants the ops run on. K gets layout/table/padding like the engines' pools; V
/// gets its own layout and a row length of head_dim * v_num / v_den (kvchan's packed
/// pools store K and V with different widths), padded like K.
struct Flavor {
  KVLayout layout;
  PageTableKind table;
  std::int32_t row_padding;
  std::int32_t page_padding;
  KVLayout v_layout;
  std::int32_t v_num, v_den;
  const char* name;
};
const Flavor kFlavors[] = {
    {KVLayout::kNHD, PageTableKind::kCsr, 0, 0, KVLayout::kNHD, 1, 1, "nhd/csr/packed"},
    {KVLayout::kHND, PageTableKind::kBlockTable, 0, 8, KVLayout::kHND, 1, 1,
     "hnd/block-table/page-padded"},
    {KVLayout::kNHD, PageTableKind::kBlockTable, 1, 3, KVLayout::kNHD, 1, 1,
     "nhd/block-table/unaligned-rows"},
    {KVLayout::kNHD, PageTableKind::kCsr, 0, 0, KVLayout::kHND, 1, 2, "k-nhd/v-hnd/v-half-width"},
    {KVLayout::kHND, PageTableKind::kBlockTable, 0, 4, KVLayout::kNHD, 2, 1,
     "k-hnd/v-nhd/v-double-width"},
};
const Flavor& kPacked = kFlavors[0];
const Flavor& kHndPadded = kFlavors[1];
const Flavor& kUnaligned = kFlavors[2];
const Flavor& kNarrowV = kFlavors[3];
const Flavor& kWideV = kFlavors[4];

test::PoolSpec make_spec(const Flavor& f, std::int32_t heads, std::int32_t dim, std::int32_t page_size,
                         std::vector<std::int32_t> lens, std::int32_t spare_pages = 3) {
  test::PoolSpec s;
  s.num_kv_heads = heads;
  s.head_dim = dim;
  s.page_size = page_size;
  s.layout = f.layout;
  s.table = f.table;
  s.seq_lens = std::move(lens);
  s.spare_pages = spare_pages;
  s.row_padding = f.row_padding;
  s.page_padding = f.page_padding;
  return s;
}

/// A RandomPool (page table, K storage) plus a random V pool with its own row length and
/// layout; `view` is the host view over both.
template <class T>
struct KVPool {
  KVPool(const Flavor& f, std::int32_t heads, std::int32_t dim, std::int32_t page_size,
         std::vector<std::int32_t> lens, std::mt19937_64& rng, std::int32_t spare_pages = 3)
      : base(make_spec(f, heads, dim, page_size, std::move(lens), spare_pages), rng) {
    geometry = base.geometry;
    geometry.v_head_dim = dim * f.v_num / f.v_den;
    const std::int64_t row = geometry.v_head_dim + f.row_padding;
    const std::int64_t page_elems = static_cast<std::int64_t>(page_size) * heads * row;
    if (f.v_layout == KVLayout::kNHD)
      v_strides = {page_elems + f.page_padding, heads * row, row};
    else
      v_strides = {page_elems + f.page_padding, row, page_size * row};
    v = test::random_vector<T>(static_cast<std::size_t>(v_strides.page) * geometry.num_pages, rng);
    view = make_view_over(base.k.data(), v.data(), base.host_tables(), MemorySpace::kHost);
  }
  template <class U>
  PagedKVView<U> make_view_over(U* k_base, U* v_base, const test::TableArrays& t,
                                MemorySpace space) const {
    if (base.spec().table == PageTableKind::kCsr)
      return make_csr_view(geometry, k_base, base.strides, v_base, v_strides,
                           CsrPageTable{t.indptr, t.indices, t.last_page_len, batch_size()}, space);
    return make_block_table_view(geometry, k_base, base.strides, v_base, v_strides,
                                 BlockTable{t.block_table, base.row_stride, t.seq_lens, batch_size()},
                                 space);
  }
  std::int32_t batch_size() const { return base.batch_size(); }
  std::int32_t v_dim() const { return geometry.v_head_dim; }
  std::vector<T>& k() { return base.k; }

  test::RandomPool<T> base;
  KVGeometry geometry;
  KVStrides v_strides;
  std::vector<T> v;  // [num_pages * v_strides.page]
  PagedKVView<T> view;
};

/// Device copy of a KVPool (storage and page table) and a kCuda view over it.
template <class T>
struct DevicePool {
  explicit DevicePool(const KVPool<T>& p)
      : k(p.base.k), v(p.v), indptr(p.base.indptr), indices(p.base.indices),
        last_page_len(p.base.last_page_len), block_table(p.base.block_table),
        seq_lens(p.base.seq_lens) {
    view = p.make_view_over(k.get(), v.get(),
                            test::TableArrays{indptr.get(), indices.get(), last_page_len.get(),
                                              block_table.get(), seq_lens.get()},
                            MemorySpace::kCuda);
  }
  DeviceBuffer<T> k, v;
  DeviceBuffer<std::int32_t> indptr, indices, last_page_len, block_table, seq_lens;
  PagedKVView<T> view;
};

/// Parity threshold on NMSE: float output is compared at float precision, 16-bit
/// outputs can differ by one rounding step of T.
template <class T>
double nmse_tol() {
  if (std::is_same<T, float>::value) return 1e-6;
  if (std::is_same<T, half_t>::value) return 1e-5;
  return 1e-4;
}

template <class T>
std::vector<double> as_double(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = test::to_double(x[i]);
  return r;
}

/// Checks both pools hold the same bits (K and V, every element).
template <class T>
void require_same_pool(const KVPool<T>& host, const DevicePool<T>& dev) {
  CHECK(test::bitwise_equal(dev.k.download(), host.base.k));
  CHECK(test::bitwise_equal(dev.v.download(), host.v));
}

std::int32_t uniform_int(std::mt19937_64& rng, std::int32_t lo, std::int32_t hi) {  // inclusive
  return std::uniform_int_distribution<std::int32_t>(lo, hi)(rng);
}

/// Checks a device error: the same code as the CPU twin gave, a message naming `value`.
void require_device_error(const Status& dev, const Status& cpu, const std::string& value) {
  INFO("device: " << dev.to_string() << "\ncpu: " << cpu.to_string());
  REQUIRE_FALSE(cpu.is_ok());
  CHECK(dev.code() == cpu.code());
  CHECK(dev.message().find(value) != std::string::npos);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Host-side argument checks: no GPU needed, nothing is launched.

TEMPLATE_TEST_CASE("cuda: argument checks come before any CUDA call", "[cuda][errors]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  // A status pointer that is never dereferenced: every case below fails on the host.
  DeviceStatus fake_status;
  const exec::Cuda cu{nullptr, &fake_status};
  KVPool<T> host(kPacked, 2, 16, 4, {9, 5}, rng);
  std::vector<T> buf(4096);
  std::vector<std::int32_t> idx(64, 0);
  std::vector<std::int64_t> slots(64, 0);
  std::vector<float> lse(64);
  const auto dv =
      host.make_view_over(host.k().data(), host.v.data(), host.base.host_tables(), MemorySpace::kCuda);
  auto expect = [](const Status& s, StatusCode code, const std::string& value) {
    INFO(s.to_string());
    CHECK(s.code() == code);
    CHECK(s.message().find(value) != std::string::npos);
  };

  SECTION("a host view handed to exec::Cuda is refused") {
    DecodeAttentionParams p{4, 0.25f};
    const Status st[] = {
        write_kv(cu, host.view, buf.data(), buf.data(), slots.data(), 2, 32),
        paged_decode_attention(cu, host.view, buf.data(), buf.data(), p, Workspace{}, lse.data()),
        gather_tokens(cu, host.view, 0, idx.data(), 3, buf.data(), buf.data()),
        compact_tokens(cu, host.view, idx.data(), idx.data(), 4, Workspace{}),
        copy_pages(cu, host.view, idx.data(), idx.data(), 1),
    };
    for (const Status& s : st) {
      INFO(s.to_string());
      CHECK(s.code() == StatusCode::kWrongMemorySpace);
      CHECK(s.message().find("host") != std::string::npos);
    }
  }

  SECTION("operations that launch kernels need a DeviceStatus") {
    const exec::Cuda no_status{};
    const DecodeAttentionParams p{4, 0.25f};
    // One sequence per kv head pair would split; give the workspace it asks for.
    std::vector<unsigned char> ws(paged_decode_attention_workspace_size(no_status, dv, p) +
                                  copy_pages_workspace_size(no_status, dv, 1) +
                                  compact_tokens_workspace_size(no_status, dv, 4) + 1024);
    const Workspace w{ws.data(), ws.size()};
    const Status st[] = {
        write_kv(no_status, dv, buf.data(), buf.data(), slots.data(), 2, 32),
        paged_decode_attention(no_status, dv, buf.data(), buf.data(), p, w, lse.data()),
        gather_tokens(no_status, dv, 0, idx.data(), 3, buf.data(), buf.data()),
        compact_tokens(no_status, dv, idx.data(), idx.data(), 4, w),
        copy_pages(no_status, dv, idx.data(), idx.data(), 1, w),
    };
    for (const Status& s : st) expect(s, StatusCode::kInvalidArgument, "status");
    expect(reset_device_status(no_status), StatusCode::kInvalidArgument, "status");
    expect(read_device_status(nullptr), StatusCode::kInvalidArgument, "null");
  }

  SECTION("unsupported row lengths name the value") {
    KVPool<T> big(kPacked, 2, 512, 4, {5}, rng);
    const auto bv = big.make_view_over(big.k().data(), big.v.data(), big.base.host_tables(),
                                       MemorySpace::kCuda);
    expect(paged_decode_attention(cu, bv, buf.data(), buf.data(), DecodeAttentionParams{2, 0.1f},
                                  Workspace{}, nullptr),
           StatusCode::kUnsupported, "512");
    KVPool<T> wide(kWideV, 2, 256, 4, {5}, rng);  // V rows of 512
    const auto wv = wide.make_view_over(wide.k().data(), wide.v.data(), wide.base.host_tables(),
                                        MemorySpace::kCuda);
    expect(paged_decode_attention(cu, wv, buf.data(), buf.data(), DecodeAttentionParams{2, 0.1f},
                                  Workspace{}, nullptr),
           StatusCode::kUnsupported, "512");
  }

  SECTION("bad scalar arguments name the value") {
    expect(paged_decode_attention(cu, dv, buf.data(), buf.data(), DecodeAttentionParams{3, 0.1f},
                                  Workspace{}, nullptr),
           StatusCode::kInvalidArgument, "3");
    expect(write_kv(cu, dv, buf.data(), buf.data(), slots.data(), 2, 31), StatusCode::kInvalidArgument,
           "31");
    expect(write_kv(cu, dv, buf.data(), buf.data(), slots.data(), 2, 32, 29),
           StatusCode::kInvalidArgument, "29");
    expect(write_kv(cu, dv, buf.data(), buf.data(), slots.data(), -4, 32), StatusCode::kInvalidArgument,
           "-4");
    expect(gather_tokens(cu, dv, 7, idx.data(), 3, buf.data(), buf.data()), StatusCode::kOutOfRange,
           "7");
    expect(gather_tokens(cu, dv, 0, idx.data(), 3, static_cast<T*>(nullptr), buf.data()),
           StatusCode::kInvalidArgument, "k_out");
    expect(compact_tokens(cu, dv, idx.data(), idx.data(), -2, Workspace{}),
           StatusCode::kInvalidArgument, "-2");
    expect(copy_pages(cu, dv, idx.data(), idx.data(), -5), StatusCode::kInvalidArgument, "-5");
    expect(merge_attention_states(cu, buf.data(), lse.data(), buf.data(), lse.data(), buf.data(),
                                  lse.data(), -3, 8),
           StatusCode::kInvalidArgument, "-3");
    expect(merge_attention_states(cu, buf.data(), lse.data(), buf.data(), lse.data(), buf.data(),
                                  lse.data(), 4, -2),
           StatusCode::kInvalidArgument, "-2");
    expect(merge_attention_states(cu, buf.data(), lse.data(), static_cast<const T*>(nullptr),
                                  lse.data(), buf.data(), lse.data(), 4, 8),
           StatusCode::kInvalidArgument, "null");
    KVKIT_REQUIRE_OK(merge_attention_states(cu, buf.data(), lse.data(), buf.data(), lse.data(),
                                            buf.data(), lse.data(), 0, 8));  // nothing to do
  }

  SECTION("bad decode variant arguments") {
    DecodeAttentionParams p{4, 0.25f};
    std::vector<unsigned char> ws(paged_decode_attention_workspace_size(cu, dv, p) + 1);
    const Workspace w{ws.data(), ws.size()};
    DecodeAttentionParams a = p;
    a.page_subset = idx.data();  // without page_subset_indptr
    expect(paged_decode_attention(cu, dv, buf.data(), buf.data(), a, w), StatusCode::kInvalidArgument,
           "page_subset");
    DecodeAttentionParams c = p;
    c.k_channels = idx.data();  // q_dim left 0
    expect(paged_decode_attention(cu, dv, buf.data(), buf.data(), c, w), StatusCode::kInvalidArgument,
           "q_dim");
    DecodeAttentionParams s = p;
    s.scores = lse.data();
    s.scores_stride = -7;
    expect(paged_decode_attention(cu, dv, buf.data(), buf.data(), s, w), StatusCode::kInvalidArgument,
           "-7");
  }

  SECTION("a workspace smaller than *_workspace_size is refused") {
    // One sequence, one kv head: decode splits long sequences and needs scratch.
    KVPool<T> h1(kPacked, 1, 64, 4, {5}, rng);
    const auto v1 =
        h1.make_view_over(h1.k().data(), h1.v.data(), h1.base.host_tables(), MemorySpace::kCuda);
    const DecodeAttentionParams p{2, 0.125f};
    const std::size_t need = paged_decode_attention_workspace_size(cu, v1, p);
    REQUIRE(need > 0);
    const Status s = paged_decode_attention(cu, v1, buf.data(), buf.data(), p,
                                            Workspace{buf.data(), need - 1}, nullptr);
    expect(s, StatusCode::kInvalidArgument, std::to_string(need));
    const std::size_t cneed = compact_tokens_workspace_size(cu, v1, 4);
    REQUIRE(cneed > 0);
    expect(compact_tokens(cu, v1, idx.data(), idx.data(), 4, Workspace{buf.data(), cneed / 2}),
           StatusCode::kInvalidArgument, std::to_string(cneed));
    const std::size_t pneed = copy_pages_workspace_size(cu, v1, 1);
    REQUIRE(pneed > 0);
    expect(copy_pages(cu, v1, idx.data(), idx.data(), 1, Workspace{buf.data(), pneed - 1}),
           StatusCode::kInvalidArgument, std::to_string(pneed));
  }
}

TEST_CASE("cuda: a DeviceStatus reads back as the CPU twin's Status", "[cuda][errors]") {
  // Host copies of what the validation kernels record: the code and the values.
  DeviceStatus ok;
  CHECK(to_status(ok).is_ok());
  auto make = [](StatusCode code, DeviceCheck check, std::int64_t value, std::int64_t pos,
                 std::int64_t seq, std::int64_t bound, std::int64_t head = -1) {
    DeviceStatus s;
    s.code = static_cast<std::int32_t>(code);
    s.check = static_cast<std::int32_t>(check);
    s.value = value;
    s.pos = pos;
    s.seq = seq;
    s.bound = bound;
    s.head = head;
    return to_status(s);
  };
  auto expect = [](const Status& s, StatusCode code, const std::string& text) {
    INFO(s.to_string());
    CHECK(s.code() == code);
    CHECK(s.message().find(text) != std::string::npos);
  };
  expect(make(StatusCode::kOutOfRange, DeviceCheck::kSlot, 999, 7, -1, 640), StatusCode::kOutOfRange,
         "slot 999 of token 7 out of range [0, 640)");
  expect(make(StatusCode::kOutOfRange, DeviceCheck::kPageId, 77, 2, 1, 40), StatusCode::kOutOfRange,
         "page id 77 out of range [0, 40) at sequence 1 page 2");
  expect(make(StatusCode::kOutOfRange, DeviceCheck::kIndptr, 9, -1, 3, 4), StatusCode::kOutOfRange,
         "indptr of sequence 3 is invalid: 9 -> 4");
  expect(make(StatusCode::kInvalidArgument, DeviceCheck::kDstRepeated, 12, 5, -1, 40),
         StatusCode::kInvalidArgument, "destination page id 12 at position 5 is repeated");
  expect(make(StatusCode::kOutOfRange, DeviceCheck::kKeepIndex, 50, 3, 0, 50, 1),
         StatusCode::kOutOfRange, "keep index 50 at position 3 of sequence 0 head 1");
  expect(make(StatusCode::kOutOfRange, DeviceCheck::kSubsetEntry, 4, 1, 2, 3, 0),
         StatusCode::kOutOfRange, "page_subset entry 4");
  expect(make(StatusCode::kInvalidArgument, DeviceCheck::kSubsetOrder, 1, 1, 0, 2, 0),
         StatusCode::kInvalidArgument, "not above the previous entry 2");
  expect(make(StatusCode::kOutOfRange, DeviceCheck::kKChannel, 130, 5, -1, 128, 1),
         StatusCode::kOutOfRange, "k_channels entry 130");
}

// ---------------------------------------------------------------------------------------
// write_kv

TEMPLATE_TEST_CASE("cuda parity: write_kv", "[cuda][write_kv]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  for (const Flavor& f : kFlavors) {
    for (std::int32_t extra : {0, 3}) {  // token_stride padding (3 breaks 16-byte alignment)
      CAPTURE(f.name, extra);
      const std::int32_t heads = 3, dim = 32, page_size = 8;
      KVPool<T> host(f, heads, dim, page_size, {20, 0, 9}, rng, 6);
      DevicePool<T> dev(host);
      const std::int32_t n = 40, vdim = host.v_dim();
      const std::int64_t stride = heads * dim + extra, v_stride = heads * vdim + 2 * extra;
      const auto key = test::random_vector<T>(static_cast<std::size_t>(n * stride), rng);
      const auto value = test::random_vector<T>(static_cast<std::size_t>(n * v_stride), rng);
      const std::int32_t num_slots = host.geometry.num_pages * page_size;
      std::vector<std::int64_t> slots;
      for (std::int32_t s : test::random_distinct(n, num_slots, rng)) slots.push_back(s);
      for (int i = 0; i < 6; ++i) slots[static_cast<std::size_t>(uniform_int(rng, 0, n - 1))] = -1;

      DeviceBuffer<T> dkey(key), dvalue(value);
      DeviceBuffer<std::int64_t> dslot(slots);
      KVKIT_REQUIRE_OK(write_kv(exec::Host{2}, host.view, key.data(), value.data(), slots.data(), n,
                                stride, v_stride));
      KVKIT_REQUIRE_OK(write_kv(stream.exec(), dev.view, dkey.get(), dvalue.get(), dslot.get(), n,
                                stride, v_stride));
      KVKIT_REQUIRE_OK(stream.status());
      require_same_pool(host, dev);
    }
  }
}

TEMPLATE_TEST_CASE("cuda contract: write_kv with a slot past the pool writes nothing",
                   "[cuda][write_kv][errors]", float, half_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  KVPool<T> host(kNarrowV, 2, 16, 4, {10, 3}, rng, 4);
  DevicePool<T> dev(host);
  const std::int32_t n = 5;
  const std::int64_t stride = 2 * 16, v_stride = 2 * host.v_dim();
  const auto key = test::random_vector<T>(static_cast<std::size_t>(n * stride), rng);
  const auto value = test::random_vector<T>(static_cast<std::size_t>(n * v_stride), rng);
  const std::int64_t num_slots = static_cast<std::int64_t>(host.geometry.num_pages) * 4;
  const std::vector<std::int64_t> slots = {1, num_slots + 5, -1, 6, 2};
  DeviceBuffer<T> dkey(key), dvalue(value);
  DeviceBuffer<std::int64_t> dslot(slots);
  const Status cpu = write_kv(exec::Host{}, host.view, key.data(), value.data(), slots.data(), n,
                              stride, v_stride);
  KVKIT_REQUIRE_OK(write_kv(stream.exec(), dev.view, dkey.get(), dvalue.get(), dslot.get(), n,
                            stride, v_stride));
  require_device_error(stream.status(), cpu, std::to_string(num_slots + 5));
  require_same_pool(host, dev);  // the CPU wrote nothing either

  // Sticky: with the error still recorded, a valid write does nothing either.
  const std::vector<std::int64_t> good = {1, 0, -1, 6, 2};
  dslot.upload(good);
  KVKIT_REQUIRE_OK(write_kv(stream.exec(), dev.view, dkey.get(), dvalue.get(), dslot.get(), n,
                            stride, v_stride));
  CHECK_FALSE(stream.status().is_ok());
  require_same_pool(host, dev);
  // After a reset it goes through.
  stream.reset();
  KVKIT_REQUIRE_OK(write_kv(exec::Host{}, host.view, key.data(), value.data(), good.data(), n,
                            stride, v_stride));
  KVKIT_REQUIRE_OK(write_kv(stream.exec(), dev.view, dkey.get(), dvalue.get(), dslot.get(), n,
                            stride, v_stride));
  KVKIT_REQUIRE_OK(stream.status());
  require_same_pool(host, dev);
}

// ---------------------------------------------------------------------------------------
// paged_decode_attention

namespace {

/// Which variants a decode case turns on.
struct Variants {
  bool subset = false, k_channels = false, v_channels = false, scores = false;
};

/// Host copies of the variant arrays of one decode case (and the params over them).
struct VariantArrays {
  std::vector<std::int32_t> subset_indptr, subset, k_channels, v_channels;
  std::int32_t q_dim = 0;
  std::int64_t scores_stride = 0;
};

/// Random variant arrays for a host view: each (b, h) keeps a random ascending subset
/// of its pages (sometimes none, sometimes all); channels are distinct random ids of a
/// q_dim-wide head.
template <class T>
VariantArrays make_variants(const PagedKVView<T>& view, const Variants& v, std::mt19937_64& rng) {
  VariantArrays a;
  const std::int32_t hkv = view.num_kv_heads;
  if (v.subset) {
    a.subset_indptr.push_back(0);
    for (std::int32_t b = 0; b < view.batch_size; ++b)
      for (std::int32_t h = 0; h < hkv; ++h) {
        const std::int32_t np = view.num_pages(b);
        const int mode = uniform_int(rng, 0, 5);  // 0: none, 1: all, else random
        for (std::int32_t i = 0; i < np; ++i)
          if (mode == 1 || (mode > 1 && uniform_int(rng, 0, 2) != 0)) a.subset.push_back(i);
        a.subset_indptr.push_back(static_cast<std::int32_t>(a.subset.size()));
      }
  }
  if (v.k_channels || v.v_channels) {
    a.q_dim = std::max(view.head_dim, view.v_head_dim) + 8 * uniform_int(rng, 0, 4);
    for (std::int32_t h = 0; h < hkv; ++h) {
      if (v.k_channels)
        for (std::int32_t c : test::random_distinct(view.head_dim, a.q_dim, rng)) a.k_channels.push_back(c);
      if (v.v_channels)
        for (std::int32_t c : test::random_distinct(view.v_head_dim, a.q_dim, rng))
          a.v_channels.push_back(c);
    }
  }
  if (v.scores) {
    std::int32_t longest = 0;
    for (std::int32_t b = 0; b < view.batch_size; ++b) longest = std::max(longest, view.seq_len(b));
    a.scores_stride = longest + 3;
  }
  return a;
}

/// float64 decode attention with every variant, over a host view: out [batch, Hq,
/// out_width], lse [batch, Hq], scores [batch, Hq, scores_stride] (-inf for tokens not
/// read, NaN past seq_len: not compared).
template <class T>
void ref_decode_variants(const PagedKVView<T>& view, const T* q, std::int32_t hq_count, double sm_scale,
                         const VariantArrays& a, std::vector<double>& out, std::vector<double>& lse,
                         std::vector<double>& scores) {
  const std::int32_t kd = view.head_dim, vd = view.v_head_dim, group = hq_count / view.num_kv_heads;
  const bool kc = !a.k_channels.empty(), vc = !a.v_channels.empty();
  const std::int32_t q_width = kc ? a.q_dim : kd, out_width = vc ? a.q_dim : vd;
  const double ninf = -std::numeric_limits<double>::infinity();
  out.assign(static_cast<std::size_t>(view.batch_size) * hq_count * out_width, 0.0);
  lse.assign(static_cast<std::size_t>(view.batch_size) * hq_count, ninf);
  scores.assign(static_cast<std::size_t>(view.batch_size) * hq_count * a.scores_stride,
                std::numeric_limits<double>::quiet_NaN());
  for (std::int32_t b = 0; b < view.batch_size; ++b) {
    const std::int32_t len = view.seq_len(b);
    for (std::int32_t hq = 0; hq < hq_count; ++hq) {
      const std::int32_t h = hq / group;
      const std::size_t row = static_cast<std::size_t>(b) * hq_count + hq;
      for (std::int64_t t = 0; t < len && a.scores_stride > 0; ++t)
        scores[row * a.scores_stride + t] = ninf;
      std::vector<std::int32_t> tokens;
      if (a.subset_indptr.empty()) {
        for (std::int32_t t = 0; t < len; ++t) tokens.push_back(t);
      } else {
        const std::size_t r = static_cast<std::size_t>(b) * view.num_kv_heads + h;
        for (std::int32_t i = a.subset_indptr[r]; i < a.subset_indptr[r + 1]; ++i) {
          const std::int32_t lp = a.subset[static_cast<std::size_t>(i)];
          for (std::int32_t t = lp * view.page_size; t < std::min(len, (lp + 1) * view.page_size); ++t)
            tokens.push_back(t);
        }
      }
      if (tokens.empty()) continue;
      const T* qv = q + row * q_width;
      std::vector<double> logit(tokens.size());
      double mx = ninf;
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        const T* kr = view.k_ptr(b, tokens[i], h);
        double s = 0;
        for (std::int32_t d = 0; d < kd; ++d) {
          const std::int32_t qc = kc ? a.k_channels[static_cast<std::size_t>(h) * kd + d] : d;
          s += test::to_double(qv[qc]) * test::to_double(kr[d]);
        }
        logit[i] = s * sm_scale;
        if (a.scores_stride > 0) scores[row * a.scores_stride + tokens[i]] = logit[i];
        mx = std::max(mx, logit[i]);
      }
      double sum = 0;
      for (double& s : logit) sum += (s = std::exp(s - mx));
      double* o = out.data() + row * out_width;
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        const T* vr = view.v_ptr(b, tokens[i], h);
        for (std::int32_t d = 0; d < vd; ++d) {
          const std::int32_t oc = vc ? a.v_channels[static_cast<std::size_t>(h) * vd + d] : d;
          o[oc] += logit[i] / sum * test::to_double(vr[d]);
        }
      }
      lse[row] = mx + std::log(sum);
    }
  }
}

struct DecodeCase {
  std::int32_t head_dim, num_kv_heads, num_qo_heads, page_size;
  std::vector<std::int32_t> lens;
  const Flavor* flavor;
  bool expect_split;  // whether the shapes make the kernel use split-K (workspace > 0)
  Variants variants{};
};

template <class T>
void run_decode_case(const DecodeCase& c, std::mt19937_64& rng, const Stream& stream) {
  const Variants& vr = c.variants;
  CAPTURE(c.head_dim, c.num_kv_heads, c.num_qo_heads, c.page_size, c.lens, c.flavor->name,
          vr.subset, vr.k_channels, vr.v_channels, vr.scores);
  KVPool<T> host(*c.flavor, c.num_kv_heads, c.head_dim, c.page_size, c.lens, rng);
  DevicePool<T> dev(host);
  const std::int32_t batch = host.batch_size();
  const std::size_t rows = static_cast<std::size_t>(batch) * c.num_qo_heads;
  const VariantArrays va = make_variants(host.view, vr, rng);
  const std::int32_t q_width = vr.k_channels ? va.q_dim : c.head_dim;
  const std::int32_t out_width = vr.v_channels ? va.q_dim : host.v_dim();
  // |q| up to 3 so the softmax is far from uniform.
  const auto q = test::random_vector<T>(rows * q_width, rng, -3.f, 3.f);
  const float sm_scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));

  DeviceBuffer<std::int32_t> d_sip(va.subset_indptr), d_sub(va.subset), d_kc(va.k_channels),
      d_vc(va.v_channels);
  DeviceBuffer<float> d_scores(test::random_vector<float>(rows * static_cast<std::size_t>(va.scores_stride), rng));
  DecodeAttentionParams p{c.num_qo_heads, sm_scale};
  if (vr.subset) {
    p.page_subset_indptr = d_sip.get();
    p.page_subset = d_sub.get();
  }
  if (vr.k_channels) p.k_channels = d_kc.get();
  if (vr.v_channels) p.v_channels = d_vc.get();
  p.q_dim = va.q_dim;
  if (vr.scores) {
    p.scores = d_scores.get();
    p.scores_stride = va.scores_stride;
  }

  // CUDA, with output buffers pre-filled with garbage so unwritten elements show.
  const std::size_t ws_bytes = paged_decode_attention_workspace_size(stream.exec(), dev.view, p);
  CHECK((ws_bytes > 0) == c.expect_split);
  DeviceBuffer<unsigned char> dws(ws_bytes);
  DeviceBuffer<T> dq(q);
  DeviceBuffer<T> dout(test::random_vector<T>(rows * out_width, rng));
  DeviceBuffer<float> dlse(test::random_vector<float>(rows, rng));
  KVKIT_REQUIRE_OK(paged_decode_attention(stream.exec(), dev.view, dq.get(), dout.get(), p,
                                          Workspace{dws.get(), ws_bytes}, dlse.get()));
  KVKIT_REQUIRE_OK(stream.status());
  const auto out = dout.download();
  const auto lse = dlse.download();

  std::vector<double> ref_out, ref_lse, ref_scores;
  ref_decode_variants(host.view, q.data(), c.num_qo_heads, sm_scale, va, ref_out, ref_lse, ref_scores);
  const test::Tolerance lse_tol{1e-4, 1e-5};
  CHECK(test::compare_close(out.data(), ref_out, test::value_tolerance<T>(), "out") == "");
  CHECK(test::compare_close(lse.data(), ref_lse, lse_tol, "lse") == "");
  CHECK(test::nmse(out.data(), ref_out) < nmse_tol<T>());
  if (vr.scores) {
    const auto sc = d_scores.download();
    std::vector<float> got;
    std::vector<double> want;
    for (std::size_t i = 0; i < ref_scores.size(); ++i)
      if (!std::isnan(ref_scores[i])) {  // tokens past seq_len are not specified
        got.push_back(sc[i]);
        want.push_back(ref_scores[i]);
      }
    CHECK(test::compare_close(got.data(), want, test::Tolerance{1e-4, 1e-5}, "scores") == "");
  }

  // Parity with the CPU twin for plain decode (the variants have the float64 reference).
  const bool plain = !vr.subset && !vr.k_channels && !vr.v_channels && !vr.scores &&
                     c.flavor->v_num == c.flavor->v_den && c.flavor->v_layout == c.flavor->layout;
  if (plain) {
    std::vector<unsigned char> cpu_ws(paged_decode_attention_workspace_size(exec::Host{2}, host.view, p));
    std::vector<T> cpu_out(rows * out_width);
    std::vector<float> cpu_lse(rows);
    KVKIT_REQUIRE_OK(paged_decode_attention(exec::Host{2}, host.view, q.data(), cpu_out.data(), p,
                                            Workspace{cpu_ws.data(), cpu_ws.size()}, cpu_lse.data()));
    CHECK(test::nmse(out.data(), as_double(cpu_out)) < nmse_tol<T>());
    CHECK(test::compare_close(lse.data(), as_double(cpu_lse), lse_tol, "lse vs cpu") == "");
  }
}

}  // namespace

TEMPLATE_TEST_CASE("cuda parity: paged_decode_attention", "[cuda][attention]", float, half_t,
                   bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  std::vector<DecodeCase> cases;
  // Every head_dim, GQA group 4, an empty sequence, split-K on the 700-token one.
  for (std::int32_t d : {8, 16, 32, 64, 128, 256})
    cases.push_back({d, 2, 8, 16, {0, 37, 700}, d % 32 == 0 ? &kHndPadded : &kPacked, true});
  // A head_dim between the compiled tile sizes.
  cases.push_back({96, 2, 4, 16, {300, 5}, &kPacked, true});
  // Many (sequence, head) pairs (560 > kTargetBlocks / 2): one split, MHA (group 1).
  {
    std::vector<std::int32_t> lens;
    for (int b = 0; b < 70; ++b) lens.push_back(uniform_int(rng, 0, 300));
    cases.push_back({128, 8, 8, 16, lens, &kHndPadded, false});
  }
  // Group 8 (MQA-like), 5000 tokens in 64 splits of which 40 hold tokens, odd page size.
  cases.push_back({64, 1, 8, 7, {5000}, &kPacked, true});
  // Group 3 (no power of two), group 2, one-token pages.
  cases.push_back({64, 2, 6, 5, {3000, 1}, &kHndPadded, true});
  cases.push_back({32, 4, 8, 1, {300, 65, 2}, &kPacked, true});
  // Unaligned rows: the scalar fallback kernel, with and without splitting.
  cases.push_back({32, 2, 4, 16, {900, 3}, &kUnaligned, true});
  cases.push_back({16, 4, 8, 4, [] {
                     std::vector<std::int32_t> l(140, 33);
                     l[5] = 0;
                     return l;
                   }(),
                   &kUnaligned, false});
  // V rows narrower / wider than K rows, V layout != K layout.
  cases.push_back({128, 2, 8, 16, {0, 400, 33}, &kNarrowV, true});
  cases.push_back({64, 2, 4, 8, {900, 17}, &kWideV, true});
  cases.push_back({32, 8, 16, 4, std::vector<std::int32_t>(70, 50), &kWideV, false});
  for (const DecodeCase& c : cases) run_decode_case<T>(c, rng, stream);
}

TEMPLATE_TEST_CASE("cuda parity: paged_decode_attention variants", "[cuda][attention]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  std::vector<DecodeCase> cases;
  const Variants subset{true, false, false, false};
  const Variants kchan{false, true, false, false};
  const Variants vchan{false, false, true, false};
  const Variants scores{false, false, false, true};
  const Variants all{true, true, true, true};
  for (const Variants& v : {subset, kchan, vchan, scores, all}) {
    // Split-K (few pairs, long sequences) and one split (many pairs).
    cases.push_back({64, 2, 8, 16, {0, 37, 700}, &kPacked, true, v});
    cases.push_back({32, 8, 16, 8, std::vector<std::int32_t>(70, 45), &kHndPadded, false, v});
    // Packed kvchan shapes: K narrower than V, unaligned rows.
    cases.push_back({32, 2, 4, 16, {500, 9}, &kWideV, true, v});
    cases.push_back({16, 2, 4, 4, {130, 0, 7}, &kUnaligned, true, v});
  }
  for (const DecodeCase& c : cases) run_decode_case<T>(c, rng, stream);
}

TEMPLATE_TEST_CASE("cuda contract: bad decode tables write nothing", "[cuda][attention][errors]",
                   float, half_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  for (const Flavor* f : {&kPacked, &kHndPadded}) {
    CAPTURE(f->name);
    KVPool<T> host(*f, 2, 32, 4, {13, 6, 9}, rng);
    const std::int32_t hq = 4;
    const std::size_t rows = static_cast<std::size_t>(host.batch_size()) * hq;
    const auto q = test::random_vector<T>(rows * 32, rng);
    const DecodeAttentionParams p{hq, 0.2f};
    const auto garbage = test::random_vector<T>(rows * 32, rng);
    auto expect_nothing_written = [&](DevicePool<T>& dev, const DecodeAttentionParams& dp,
                                      const Status& cpu, const std::string& value) {
      stream.reset();
      DeviceBuffer<unsigned char> dws(paged_decode_attention_workspace_size(stream.exec(), dev.view, dp));
      DeviceBuffer<T> dq(q), dout(garbage);
      KVKIT_REQUIRE_OK(paged_decode_attention(stream.exec(), dev.view, dq.get(), dout.get(), dp,
                                              Workspace{dws.get(), dws.size()}));
      require_device_error(stream.status(), cpu, value);
      CHECK(test::bitwise_equal(dout.download(), garbage));
    };
    std::vector<unsigned char> cpu_ws(paged_decode_attention_workspace_size(exec::Host{}, host.view, p));
    std::vector<T> cpu_out(rows * 32);
    auto cpu_run = [&](const PagedKVView<T>& v, const DecodeAttentionParams& cp) {
      return paged_decode_attention(exec::Host{}, v, q.data(), cpu_out.data(), cp,
                                    Workspace{cpu_ws.data(), cpu_ws.size()});
    };
    {  // A page id past the pool.
      const std::int32_t bad = host.geometry.num_pages + 2;
      if (f->table == PageTableKind::kCsr) host.base.indices[3] = bad;
      else host.base.block_table[static_cast<std::size_t>(host.base.row_stride) + 1] = bad;
      DevicePool<T> dev(host);
      expect_nothing_written(dev, p, cpu_run(host.view, p), std::to_string(bad));
    }
    if (f->table == PageTableKind::kCsr) {  // indptr going backwards (would read before indices)
      KVPool<T> h2(*f, 2, 32, 4, {13, 6, 9}, rng);
      h2.base.indptr[2] = h2.base.indptr[1] - 3;
      DevicePool<T> dev(h2);
      expect_nothing_written(dev, p, cpu_run(h2.view, p), "indptr");
    } else {  // a sequence longer than its block-table row
      KVPool<T> h2(*f, 2, 32, 4, {13, 6, 9}, rng);
      h2.base.seq_lens[1] = h2.base.row_stride * 4 + 1;
      DevicePool<T> dev(h2);
      expect_nothing_written(dev, p, cpu_run(h2.view, p), std::to_string(h2.base.row_stride));
    }
  }
  // Variant arrays (the CPU twin must report the same codes): a page subset out of
  // order, a subset entry past the sequence's pages, a k channel id past q_dim, scores
  // rows shorter than a sequence. The device runs also write scores: they must stay.
  KVPool<T> host(kPacked, 2, 32, 4, {13, 6}, rng);
  DevicePool<T> dev(host);
  const std::int32_t hq = 4, q_dim = 40;
  const std::size_t rows = 2 * hq;
  struct BadCase {
    std::vector<std::int32_t> sip, sub, kch;
    std::int64_t scores_stride;
    std::string value;
  };
  std::vector<std::int32_t> kch(2 * 32);
  for (std::size_t i = 0; i < kch.size(); ++i) kch[i] = static_cast<std::int32_t>(i % 32) + 3;
  std::vector<std::int32_t> bad_kch = kch;
  bad_kch[40] = q_dim;
  const BadCase bad_cases[] = {
      {{0, 2, 3, 4, 4}, {2, 1, 0, 1}, {}, 16, "page_subset"},  // (0, 0): 2 then 1
      {{0, 1, 2, 3, 4}, {0, 3, 1, 2}, {}, 16, "2"},            // seq 1 has 2 pages
      {{}, {}, bad_kch, 16, std::to_string(q_dim)},
      {{}, {}, kch, 12, "12"},                                 // seq 0 holds 13 tokens
  };
  for (const BadCase& bc : bad_cases) {
    CAPTURE(bc.value);
    const bool channels = !bc.kch.empty();
    const auto q = test::random_vector<T>(rows * (channels ? q_dim : 32), rng);
    const auto garbage = test::random_vector<T>(rows * 32, rng);
    const auto scores_garbage =
        test::random_vector<float>(rows * static_cast<std::size_t>(bc.scores_stride), rng);
    DeviceBuffer<std::int32_t> dsip(bc.sip), dsub(bc.sub), dkch(bc.kch);
    DeviceBuffer<float> dscores(scores_garbage);
    std::vector<float> cpu_scores = scores_garbage;
    DecodeAttentionParams p{hq, 0.2f}, cp{hq, 0.2f};
    if (!bc.sip.empty()) {
      p.page_subset_indptr = dsip.get();
      p.page_subset = dsub.get();
      cp.page_subset_indptr = bc.sip.data();
      cp.page_subset = bc.sub.data();
    }
    if (channels) {
      p.k_channels = dkch.get();
      cp.k_channels = bc.kch.data();
      p.q_dim = cp.q_dim = q_dim;
    }
    p.scores = dscores.get();
    cp.scores = cpu_scores.data();
    p.scores_stride = cp.scores_stride = bc.scores_stride;
    std::vector<T> cpu_out = garbage;
    std::vector<unsigned char> cpu_ws(paged_decode_attention_workspace_size(exec::Host{}, host.view, cp));
    const Status cpu = paged_decode_attention(exec::Host{}, host.view, q.data(), cpu_out.data(), cp,
                                              Workspace{cpu_ws.data(), cpu_ws.size()});
    stream.reset();
    DeviceBuffer<unsigned char> dws(paged_decode_attention_workspace_size(stream.exec(), dev.view, p));
    DeviceBuffer<T> dq(q), dout(garbage);
    KVKIT_REQUIRE_OK(paged_decode_attention(stream.exec(), dev.view, dq.get(), dout.get(), p,
                                            Workspace{dws.get(), dws.size()}));
    require_device_error(stream.status(), cpu, bc.value);
    CHECK(test::bitwise_equal(dout.download(), garbage));
    CHECK(test::bitwise_equal(dscores.download(), scores_garbage));
    CHECK(test::bitwise_equal(cpu_out, garbage));  // the CPU twin wrote nothing either
  }
}

TEST_CASE("cuda parity: a long page subset reports its first bad entry", "[cuda][attention][errors]") {
  // The device checks a subset with one thread per entry; the reported entry must still be
  // the first bad one, as the CPU's serial scan finds it (two bad entries planted).
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  KVPool<float> host(kPacked, 2, 16, 4, {2800, 40}, rng);  // 700 and 10 pages
  DevicePool<float> dev(host);
  const std::int32_t hq = 4;
  for (int it = 0; it < 6; ++it) {
    std::vector<std::int32_t> sip{0}, sub;
    for (std::int32_t b = 0; b < 2; ++b)
      for (std::int32_t h = 0; h < 2; ++h) {
        for (std::int32_t j = 0; j < host.view.num_pages(b); ++j) sub.push_back(j);
        sip.push_back(static_cast<std::int32_t>(sub.size()));
      }
    const std::int32_t h = uniform_int(rng, 0, 1), lo = sip[static_cast<std::size_t>(h)];
    const std::int32_t i1 = uniform_int(rng, 1, 600), i2 = uniform_int(rng, i1 + 1, 699);
    const bool order_first = it % 2 == 0;
    // An order error repeats the previous entry; a range error names page 700 + i.
    auto plant = [&](std::int32_t i, bool order) {
      sub[static_cast<std::size_t>(lo + i)] = order ? sub[static_cast<std::size_t>(lo + i - 1)] : 700 + i;
    };
    plant(i2, !order_first);
    plant(i1, order_first);
    const std::int32_t e1 = sub[static_cast<std::size_t>(lo + i1)];
    CAPTURE(it, h, i1, i2, order_first);
    const auto q = test::random_vector<float>(2 * hq * 16, rng);
    DecodeAttentionParams p{hq, 0.2f}, cp{hq, 0.2f};
    cp.page_subset_indptr = sip.data();
    cp.page_subset = sub.data();
    std::vector<float> cpu_out(2 * hq * 16, 0.f);
    std::vector<unsigned char> cpu_ws(paged_decode_attention_workspace_size(exec::Host{}, host.view, cp));
    const Status cpu = paged_decode_attention(exec::Host{}, host.view, q.data(), cpu_out.data(), cp,
                                              Workspace{cpu_ws.data(), cpu_ws.size()});
    stream.reset();
    DeviceBuffer<std::int32_t> dsip(sip), dsub(sub);
    p.page_subset_indptr = dsip.get();
    p.page_subset = dsub.get();
    DeviceBuffer<unsigned char> dws(paged_decode_attention_workspace_size(stream.exec(), dev.view, p));
    DeviceBuffer<float> dq(q), dout(cpu_out.size());
    KVKIT_REQUIRE_OK(paged_decode_attention(stream.exec(), dev.view, dq.get(), dout.get(), p,
                                            Workspace{dws.get(), dws.size()}));
    const std::string at = "entry " + std::to_string(e1) + " at position " + std::to_string(i1);
    require_device_error(stream.status(), cpu, at);
    CHECK(cpu.message().find("page_subset[" + std::to_string(lo + i1) + "] = " + std::to_string(e1)) !=
          std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------
// merge_attention_states

TEMPLATE_TEST_CASE("cuda parity: merge_attention_states", "[cuda][attention][merge]", float, half_t,
                   bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  const std::int64_t rows = 37;
  const std::int32_t dim = 24;
  const std::size_t n = static_cast<std::size_t>(rows) * dim;
  const auto a = test::random_vector<T>(n, rng), b = test::random_vector<T>(n, rng);
  auto la = test::random_vector<float>(static_cast<std::size_t>(rows), rng, -20.f, 20.f);
  auto lb = test::random_vector<float>(static_cast<std::size_t>(rows), rng, -20.f, 20.f);
  la[3] = -kInf;               // one side empty: the other is returned
  lb[5] = -kInf;
  la[7] = lb[7] = -kInf;       // both empty: 0 and -inf
  la[9] = 100.f, lb[9] = 99.f;  // large: expf would overflow without the max subtracted
  std::vector<double> want(n), want_lse(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    const double x = la[static_cast<std::size_t>(r)], y = lb[static_cast<std::size_t>(r)];
    const double m = std::max(x, y);
    const double wa = m == -INFINITY ? 0 : std::exp(x - m), wb = m == -INFINITY ? 0 : std::exp(y - m);
    want_lse[static_cast<std::size_t>(r)] = m == -INFINITY ? m : m + std::log(wa + wb);
    for (std::int32_t d = 0; d < dim; ++d) {
      const std::size_t i = static_cast<std::size_t>(r) * dim + d;
      want[i] = m == -INFINITY ? 0.0
                               : (wa * test::to_double(a[i]) + wb * test::to_double(b[i])) / (wa + wb);
    }
  }
  DeviceBuffer<T> da(a), db(b), dout(test::random_vector<T>(n, rng));
  DeviceBuffer<float> dla(la), dlb(lb), dlse(test::random_vector<float>(static_cast<std::size_t>(rows), rng));
  KVKIT_REQUIRE_OK(merge_attention_states(stream.exec(), da.get(), dla.get(), db.get(), dlb.get(),
                                          dout.get(), dlse.get(), rows, dim));
  stream.sync();
  const auto out = dout.download();
  const auto lse = dlse.download();
  CHECK(test::compare_close(out.data(), want, test::value_tolerance<T>(), "out") == "");
  CHECK(test::compare_close(lse.data(), want_lse, test::Tolerance{1e-5, 1e-6}, "lse") == "");
  // In place: the result lands in out_a / lse_a.
  KVKIT_REQUIRE_OK(merge_attention_states(stream.exec(), da.get(), dla.get(), db.get(), dlb.get(),
                                          da.get(), dla.get(), rows, dim));
  stream.sync();
  CHECK(test::bitwise_equal(da.download(), out));
  const auto lse2 = dla.download();
  CHECK(std::equal(lse2.begin(), lse2.end(), lse.begin(),
                   [](float x, float y) { return x == y; }));
}

// ---------------------------------------------------------------------------------------
// gather_tokens

TEMPLATE_TEST_CASE("cuda parity: gather_tokens", "[cuda][gather]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  for (const Flavor& f : kFlavors) {
    CAPTURE(f.name);
    const std::int32_t heads = 3, dim = 64;
    KVPool<T> host(f, heads, dim, 8, {45, 0, 20}, rng);
    DevicePool<T> dev(host);
    const std::int32_t vdim = host.v_dim();
    auto run = [&](std::int32_t seq, const std::vector<std::int32_t>* ids, std::int32_t n,
                   std::int32_t bad_pos) {
      CAPTURE(seq, n, bad_pos);
      stream.reset();
      const std::size_t k_elems = static_cast<std::size_t>(heads) * n * dim;
      const std::size_t v_elems = static_cast<std::size_t>(heads) * n * vdim;
      const auto k_garbage = test::random_vector<T>(k_elems, rng);
      const auto v_garbage = test::random_vector<T>(v_elems, rng);
      std::vector<T> k_cpu = k_garbage, v_cpu = v_garbage;
      DeviceBuffer<T> dk(k_garbage), dv(v_garbage);
      std::vector<std::int32_t> hids;
      if (ids != nullptr) {
        hids = *ids;
        if (bad_pos >= 0) hids[static_cast<std::size_t>(bad_pos)] = host.base.seq_lens[static_cast<std::size_t>(seq)] + 3;
      }
      DeviceBuffer<std::int32_t> did(hids);
      const Status cpu = gather_tokens(exec::Host{}, host.view, seq, ids ? hids.data() : nullptr, n,
                                       k_cpu.data(), v_cpu.data());
      KVKIT_REQUIRE_OK(gather_tokens(stream.exec(), dev.view, seq, ids ? did.get() : nullptr, n,
                                     dk.get(), dv.get()));
      const Status st = stream.status();
      if (bad_pos >= 0)
        require_device_error(st, cpu, std::to_string(hids[static_cast<std::size_t>(bad_pos)]));
      else
        KVKIT_REQUIRE_OK(st);
      // On an error neither side wrote anything.
      CHECK(test::bitwise_equal(dk.download(), k_cpu));
      CHECK(test::bitwise_equal(dv.download(), v_cpu));
    };
    std::vector<std::int32_t> ids;
    for (int i = 0; i < 30; ++i) ids.push_back(uniform_int(rng, 0, 44));  // repeats allowed
    run(0, &ids, 30, -1);
    run(0, &ids, 30, 11);
    run(2, nullptr, 20, -1);
    run(1, nullptr, 0, -1);
  }
}

TEMPLATE_TEST_CASE("cuda contract: gather_tokens on a bad page id writes nothing",
                   "[cuda][gather][errors]", float, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  for (const Flavor* f : {&kPacked, &kWideV}) {
    CAPTURE(f->name);
    KVPool<T> host(*f, 2, 16, 4, {14, 9}, rng);
    const std::int32_t bad = -4;
    if (f->table == PageTableKind::kCsr) host.base.indices[host.base.indptr[1] + 1] = bad;
    else host.base.block_table[static_cast<std::size_t>(host.base.row_stride) + 1] = bad;
    DevicePool<T> dev(host);
    const std::int32_t n = 6;
    const auto kg = test::random_vector<T>(static_cast<std::size_t>(2 * n * 16), rng);
    const auto vg = test::random_vector<T>(static_cast<std::size_t>(2 * n * host.v_dim()), rng);
    std::vector<T> kc = kg, vc = vg;
    const Status cpu = gather_tokens(exec::Host{}, host.view, 1, nullptr, n, kc.data(), vc.data());
    stream.reset();
    DeviceBuffer<T> dk(kg), dv(vg);
    KVKIT_REQUIRE_OK(gather_tokens(stream.exec(), dev.view, 1, nullptr, n, dk.get(), dv.get()));
    require_device_error(stream.status(), cpu, std::to_string(bad));
    CHECK(test::bitwise_equal(dk.download(), kg));
    CHECK(test::bitwise_equal(dv.download(), vg));
  }
}

// ---------------------------------------------------------------------------------------
// compact_tokens

TEMPLATE_TEST_CASE("cuda parity: compact_tokens", "[cuda][compact]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  for (const Flavor& f : kFlavors) {
    for (bool bad_entry : {false, true}) {
      CAPTURE(f.name, bad_entry);
      stream.reset();
      const std::int32_t heads = 3, dim = 16, keep_stride = 40;
      const std::vector<std::int32_t> lens = {50, 0, 33, 17};
      KVPool<T> host(f, heads, dim, 4, lens, rng);
      DevicePool<T> dev(host);
      const std::int32_t batch = host.batch_size();
      const std::vector<std::int32_t> num_keep = {30, 0, 33, 5};
      // Unused tail entries hold garbage the kernels must not read.
      std::vector<std::int32_t> keep(static_cast<std::size_t>(batch) * heads * keep_stride, -77);
      for (std::int32_t b = 0; b < batch; ++b)
        for (std::int32_t h = 0; h < heads; ++h) {
          const std::int32_t nk = num_keep[static_cast<std::size_t>(b)];
          auto sel = test::random_distinct(nk, lens[static_cast<std::size_t>(b)], rng);
          if (h % 2 == 0) std::sort(sel.begin(), sel.end());  // ascending and arbitrary orders
          std::copy(sel.begin(), sel.end(),
                    keep.begin() + (static_cast<std::ptrdiff_t>(b) * heads + h) * keep_stride);
        }
      // A bad entry: position 3 of (seq 2, head 1) names a token past the sequence.
      if (bad_entry) keep[(2 * heads + 1) * keep_stride + 3] = lens[2];

      std::vector<unsigned char> cpu_ws(compact_tokens_workspace_size(exec::Host{2}, host.view, keep_stride));
      const Status cpu = compact_tokens(exec::Host{2}, host.view, keep.data(), num_keep.data(),
                                        keep_stride, Workspace{cpu_ws.data(), cpu_ws.size()});
      const std::size_t ws_bytes = compact_tokens_workspace_size(stream.exec(), dev.view, keep_stride);
      DeviceBuffer<unsigned char> dws(ws_bytes);
      DeviceBuffer<std::int32_t> dk(keep), dnk(num_keep);
      KVKIT_REQUIRE_OK(compact_tokens(stream.exec(), dev.view, dk.get(), dnk.get(), keep_stride,
                                      Workspace{dws.get(), ws_bytes}));
      const Status st = stream.status();
      if (bad_entry)
        require_device_error(st, cpu, std::to_string(lens[2]));
      else
        KVKIT_REQUIRE_OK(st);
      require_same_pool(host, dev);  // on an error both pools are untouched
    }
  }
}

// ---------------------------------------------------------------------------------------
// copy_pages

TEMPLATE_TEST_CASE("cuda parity: copy_pages", "[cuda][copy_pages]", float, half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  for (const Flavor& f : kFlavors) {
    CAPTURE(f.name);
    KVPool<T> host(f, 2, 32, 8, {40, 17, 0}, rng, 8);
    DevicePool<T> dev(host);
    const auto& pages = host.base.pages;
    const auto& free_pages = host.base.free_pages;
    // Sources: used pages (one feeds two destinations); destinations: distinct free pages.
    const std::vector<std::int32_t> src = {pages[0][1], pages[1][0], pages[0][4], pages[1][2],
                                           pages[0][1]};
    const std::vector<std::int32_t> dst(free_pages.begin(), free_pages.begin() + 5);
    DeviceBuffer<unsigned char> dws(copy_pages_workspace_size(stream.exec(), dev.view, 5));
    const Workspace ws{dws.get(), dws.size()};
    auto run = [&](std::vector<std::int32_t> s, std::vector<std::int32_t> d, const std::string& value) {
      stream.reset();
      const Status cpu = copy_pages(exec::Host{2}, host.view, s.data(), d.data(),
                                    static_cast<std::int32_t>(s.size()));
      DeviceBuffer<std::int32_t> ds(s), dd(d);
      KVKIT_REQUIRE_OK(copy_pages(stream.exec(), dev.view, ds.get(), dd.get(),
                                  static_cast<std::int32_t>(s.size()), ws));
      const Status st = stream.status();
      if (value.empty())
        KVKIT_REQUIRE_OK(st);
      else
        require_device_error(st, cpu, value);
      require_same_pool(host, dev);
    };
    run(src, dst, "");
    // Errors (each leaves both pools as they were): an id past the pool, a negative id,
    // a destination that is also a source, a repeated destination.
    auto with = [](std::vector<std::int32_t> v, std::size_t i, std::int32_t x) {
      v[i] = x;
      return v;
    };
    const std::int32_t np = host.geometry.num_pages;
    run(src, with(dst, 2, np), std::to_string(np));
    run(with(src, 1, -1), dst, "-1");
    run(src, with(dst, 3, pages[1][0]), std::to_string(pages[1][0]));
    run(src, with(dst, 4, dst[0]), std::to_string(dst[0]));
  }
}

// ---------------------------------------------------------------------------------------
// CUDA graphs: the launchers never synchronise or allocate, so a whole step captures.

TEMPLATE_TEST_CASE("cuda: a step of operations captures into a CUDA graph", "[cuda][graph]", float,
                   half_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  KVPool<T> host(kPacked, 2, 64, 16, {300, 40}, rng, 6);
  DevicePool<T> eager(host), graphed(host);
  const std::int32_t hkv = 2, dim = 64, hq = 8, n = 2;
  const std::size_t rows = static_cast<std::size_t>(host.batch_size()) * hq;
  const std::int32_t ps = 16;
  const auto& free_pages = host.base.free_pages;
  const std::vector<std::int64_t> slots = {static_cast<std::int64_t>(free_pages[0]) * ps + 1,
                                           static_cast<std::int64_t>(free_pages[1]) * ps + 7};
  const std::vector<std::int32_t> src = {host.base.pages[0][2]}, dst = {free_pages[2]};
  DeviceBuffer<T> key(test::random_vector<T>(static_cast<std::size_t>(n * hkv * dim), rng));
  DeviceBuffer<T> value(test::random_vector<T>(static_cast<std::size_t>(n * hkv * dim), rng));
  DeviceBuffer<std::int64_t> dslots(slots);
  DeviceBuffer<std::int32_t> dsrc(src), ddst(dst);
  DeviceBuffer<T> q(test::random_vector<T>(rows * dim, rng));
  DeviceBuffer<T> out_b(test::random_vector<T>(rows * dim, rng));
  DeviceBuffer<float> lse_b(test::random_vector<float>(rows, rng, -3.f, 3.f));
  const DecodeAttentionParams p{hq, 0.125f};
  struct Outputs {
    explicit Outputs(std::size_t r) : out(r * 64), merged(r * 64), lse(r), merged_lse(r) {}
    DeviceBuffer<T> out, merged;
    DeviceBuffer<float> lse, merged_lse;
  };
  Outputs eager_out(rows), graph_out(rows);
  DeviceBuffer<unsigned char> ws(paged_decode_attention_workspace_size(exec::Cuda{}, eager.view, p) +
                                 copy_pages_workspace_size(exec::Cuda{}, eager.view, 1));
  REQUIRE(paged_decode_attention_workspace_size(exec::Cuda{}, eager.view, p) > 0);  // split-K runs
  auto step = [&](exec::Cuda ex, const DevicePool<T>& d, Outputs& o) -> Status {
    KVKIT_RETURN_IF_ERROR(reset_device_status(ex));
    KVKIT_RETURN_IF_ERROR(write_kv(ex, d.view, key.get(), value.get(), dslots.get(), n, hkv * dim));
    KVKIT_RETURN_IF_ERROR(paged_decode_attention(ex, d.view, q.get(), o.out.get(), p,
                                                 Workspace{ws.get(), ws.size()}, o.lse.get()));
    KVKIT_RETURN_IF_ERROR(copy_pages(ex, d.view, dsrc.get(), ddst.get(), 1,
                                     Workspace{ws.get(), ws.size()}));
    return merge_attention_states(ex, o.out.get(), o.lse.get(), out_b.get(), lse_b.get(),
                                  o.merged.get(), o.merged_lse.get(), static_cast<std::int64_t>(rows),
                                  dim);
  };
  Stream s1, s2;
  KVKIT_REQUIRE_OK(step(s1.exec(), eager, eager_out));
  KVKIT_REQUIRE_OK(s1.status());

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t instance = nullptr;
  // Global mode: any synchronising or allocating call inside the step fails the capture.
  KVKIT_CUDA_REQUIRE(cudaStreamBeginCapture(s2.get(), cudaStreamCaptureModeGlobal));
  const Status captured = step(s2.exec(), graphed, graph_out);
  KVKIT_CUDA_REQUIRE(cudaStreamEndCapture(s2.get(), &graph));
  KVKIT_REQUIRE_OK(captured);
  KVKIT_CUDA_REQUIRE(cudaGraphInstantiate(&instance, graph, 0));
  KVKIT_CUDA_REQUIRE(cudaGraphLaunch(instance, s2.get()));
  const Status replayed = s2.status();
  (void)cudaGraphExecDestroy(instance);
  (void)cudaGraphDestroy(graph);
  KVKIT_REQUIRE_OK(replayed);
  CHECK(test::bitwise_equal(graphed.k.download(), eager.k.download()));
  CHECK(test::bitwise_equal(graphed.v.download(), eager.v.download()));
  CHECK(test::bitwise_equal(graph_out.out.download(), eager_out.out.download()));
  CHECK(test::bitwise_equal(graph_out.merged.download(), eager_out.merged.download()));
  CHECK(test::bitwise_equal(graph_out.lse.download(), eager_out.lse.download()));
  CHECK(test::bitwise_equal(graph_out.merged_lse.download(), eager_out.merged_lse.download()));
}
