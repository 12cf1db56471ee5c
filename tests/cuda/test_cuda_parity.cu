// Parity of the CUDA backend with the CPU twins: every core KV operation runs on random
// paged pools (shuffled page ids, NHD/HND, CSR/block table, padded and unaligned
// strides) on the GPU and on the CPU, for float, half and bfloat16. Copies must match
// bit for bit (whole pools, padding included, so stray writes show); attention is also
// checked against the float64 reference. Device-side index checks (bad entries are
// skipped) are checked against a CPU run on the corrected input.
//
// Without a GPU every GPU case passes with WARN("skipped: no GPU"); the argument-check
// case needs no GPU (host checks come before any CUDA call) and always runs.
#include <kvkit/cuda.cuh>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "reference.hpp"

using namespace kvkit;

namespace {

bool gpu_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return false;
  }
  return n > 0;
}

#define KVKIT_REQUIRE_GPU()          \
  do {                               \
    if (!gpu_present()) {            \
      WARN("skipped: no GPU");       \
      return;                        \
    }                                \
  } while (0)

#define KVKIT_CUDA_REQUIRE(expr)                                               \
  do {                                                                         \
    const cudaError_t kvkit_err_ = (expr);                                     \
    if (kvkit_err_ != cudaSuccess) FAIL(#expr << ": " << cudaGetErrorString(kvkit_err_)); \
  } while (0)

#define KVKIT_REQUIRE_OK(expr)                 \
  do {                                         \
    const ::kvkit::Status kvkit_st_ = (expr);  \
    INFO(#expr << " -> " << kvkit_st_.to_string()); \
    REQUIRE(kvkit_st_.is_ok());                \
  } while (0)

/// Owning device array (cudaMalloc / cudaFree); size 0 still gets a valid pointer.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    KVKIT_CUDA_REQUIRE(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == n_);
    if (n_ > 0) KVKIT_CUDA_REQUIRE(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0) KVKIT_CUDA_REQUIRE(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

/// A blocking stream, so it orders after the synchronous cudaMemcpy uploads.
class Stream {
 public:
  Stream() { KVKIT_CUDA_REQUIRE(cudaStreamCreate(&s_)); }
  ~Stream() {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  exec::Cuda exec() const { return exec::Cuda{s_}; }
  /// Waits for the stream and surfaces kernel faults.
  void sync() const { KVKIT_CUDA_REQUIRE(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

/// Device copy of a RandomPool (storage and page table) and a kCuda view over it.
template <class T>
struct DevicePool {
  explicit DevicePool(const test::RandomPool<T>& p)
      : k(p.k), v(p.v), indptr(p.indptr), indices(p.indices), last_page_len(p.last_page_len),
        block_table(p.block_table), seq_lens(p.seq_lens) {
    view = p.make_view_over(k.get(), v.get(),
                            test::TableArrays{indptr.get(), indices.get(), last_page_len.get(),
                                              block_table.get(), seq_lens.get()},
                            MemorySpace::kCuda);
  }
  DeviceBuffer<T> k, v;
  DeviceBuffer<std::int32_t> indptr, indices, last_page_len, block_table, seq_lens;
  PagedKVView<T> view;
};

/// Pool variants every op runs on: packed NHD + CSR, HND + block table with padded
/// (still 16-byte aligned) pages, and NHD rows padded by one element, which forces the
/// scalar (unvectorised) kernels.
struct Flavor {
  KVLayout layout;
  PageTableKind table;
  std::int32_t row_padding;
  std::int32_t page_padding;
  const char* name;
};
const Flavor kFlavors[] = {
    {KVLayout::kNHD, PageTableKind::kCsr, 0, 0, "nhd/csr/packed"},
    {KVLayout::kHND, PageTableKind::kBlockTable, 0, 8, "hnd/block-table/page-padded"},
    {KVLayout::kNHD, PageTableKind::kBlockTable, 1, 3, "nhd/block-table/unaligned-rows"},
};

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
void require_same_pool(const test::RandomPool<T>& host, const DevicePool<T>& dev) {
  CHECK(test::bitwise_equal(dev.k.download(), host.k));
  CHECK(test::bitwise_equal(dev.v.download(), host.v));
}

std::int32_t uniform_int(std::mt19937_64& rng, std::int32_t lo, std::int32_t hi) {  // inclusive
  return std::uniform_int_distribution<std::int32_t>(lo, hi)(rng);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Host-side argument checks: no GPU needed, nothing is launched.

TEMPLATE_TEST_CASE("cuda: argument checks come before any CUDA call", "[cuda][errors]", float,
                   half_t, bfloat16_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  const exec::Cuda cu{};
  test::RandomPool<T> host(make_spec(kFlavors[0], 2, 16, 4, {9, 5}), rng);
  std::vector<T> buf(1024);
  std::vector<std::int32_t> idx(64, 0);
  std::vector<std::int64_t> slots(64, 0);
  std::vector<float> lse(64);

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

  // Views labelled kCuda over host memory: the checks below fail before any access.
  SECTION("unsupported head_dim names the value") {
    test::RandomPool<T> h96(make_spec(kFlavors[0], 2, 96, 4, {5}), rng);
    const auto dv = h96.make_view_over(h96.k.data(), h96.v.data(), h96.host_tables(), MemorySpace::kCuda);
    const Status s = paged_decode_attention(cu, dv, buf.data(), buf.data(), DecodeAttentionParams{2, 0.1f},
                                            Workspace{}, nullptr);
    INFO(s.to_string());
    CHECK(s.code() == StatusCode::kUnsupported);
    CHECK(s.message().find("96") != std::string::npos);
  }

  SECTION("bad scalar arguments name the value") {
    const auto dv = host.make_view_over(host.k.data(), host.v.data(), host.host_tables(), MemorySpace::kCuda);
    auto expect = [](const Status& s, StatusCode code, const std::string& value) {
      INFO(s.to_string());
      CHECK(s.code() == code);
      CHECK(s.message().find(value) != std::string::npos);
    };
    expect(paged_decode_attention(cu, dv, buf.data(), buf.data(), DecodeAttentionParams{3, 0.1f},
                                  Workspace{}, nullptr),
           StatusCode::kInvalidArgument, "3");
    expect(write_kv(cu, dv, buf.data(), buf.data(), slots.data(), 2, 31), StatusCode::kInvalidArgument,
           "31");
    expect(write_kv(cu, dv, buf.data(), buf.data(), slots.data(), -4, 32), StatusCode::kInvalidArgument,
           "-4");
    expect(gather_tokens(cu, dv, 7, idx.data(), 3, buf.data(), buf.data()), StatusCode::kOutOfRange,
           "7");
    expect(gather_tokens(cu, dv, 0, idx.data(), 3, static_cast<T*>(nullptr), buf.data()), StatusCode::kInvalidArgument,
           "k_out");
    expect(compact_tokens(cu, dv, idx.data(), idx.data(), -2, Workspace{}),
           StatusCode::kInvalidArgument, "-2");
    expect(copy_pages(cu, dv, idx.data(), idx.data(), -5), StatusCode::kInvalidArgument, "-5");
  }

  SECTION("a workspace smaller than *_workspace_size is refused") {
    // One sequence, one kv head: decode splits long sequences and needs scratch.
    test::RandomPool<T> h1(make_spec(kFlavors[0], 1, 64, 4, {5}), rng);
    const auto dv = h1.make_view_over(h1.k.data(), h1.v.data(), h1.host_tables(), MemorySpace::kCuda);
    const DecodeAttentionParams p{2, 0.125f};
    const std::size_t need = paged_decode_attention_workspace_size(cu, dv, p);
    REQUIRE(need > 0);
    const Status s = paged_decode_attention(cu, dv, buf.data(), buf.data(), p,
                                            Workspace{buf.data(), need - 1}, nullptr);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK(s.message().find(std::to_string(need)) != std::string::npos);
    const std::size_t cneed = compact_tokens_workspace_size(cu, dv, 4);
    REQUIRE(cneed > 0);
    const Status c = compact_tokens(cu, dv, idx.data(), idx.data(), 4, Workspace{buf.data(), cneed / 2});
    CHECK(c.code() == StatusCode::kInvalidArgument);
    CHECK(c.message().find(std::to_string(cneed)) != std::string::npos);
  }
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
      test::RandomPool<T> host(make_spec(f, heads, dim, page_size, {20, 0, 9}, 6), rng);
      DevicePool<T> dev(host);
      const std::int32_t n = 40;
      const std::int64_t stride = heads * dim + extra;
      const auto key = test::random_vector<T>(static_cast<std::size_t>(n * stride), rng);
      const auto value = test::random_vector<T>(static_cast<std::size_t>(n * stride), rng);
      const std::int32_t num_slots = host.geometry.num_pages * page_size;
      std::vector<std::int64_t> slots;
      for (std::int32_t s : test::random_distinct(n, num_slots, rng)) slots.push_back(s);
      for (int i = 0; i < 6; ++i) slots[static_cast<std::size_t>(uniform_int(rng, 0, n - 1))] = -1;
      // Device-only: a slot past the pool is skipped on the device (the CPU refuses it).
      std::vector<std::int64_t> dslots = slots;
      dslots[7] = num_slots + 11;
      slots[7] = -1;

      DeviceBuffer<T> dkey(key), dvalue(value);
      DeviceBuffer<std::int64_t> dslot(dslots);
      KVKIT_REQUIRE_OK(write_kv(exec::Host{2}, host.view, key.data(), value.data(), slots.data(), n, stride));
      KVKIT_REQUIRE_OK(write_kv(stream.exec(), dev.view, dkey.get(), dvalue.get(), dslot.get(), n, stride));
      stream.sync();
      require_same_pool(host, dev);
    }
  }
}

// ---------------------------------------------------------------------------------------
// paged_decode_attention

namespace {

struct DecodeCase {
  std::int32_t head_dim, num_kv_heads, num_qo_heads, page_size;
  std::vector<std::int32_t> lens;
  const Flavor* flavor;
  bool expect_split;  // whether the shapes make the kernel use split-K (workspace > 0)
};

template <class T>
void run_decode_case(const DecodeCase& c, std::mt19937_64& rng, const Stream& stream) {
  CAPTURE(c.head_dim, c.num_kv_heads, c.num_qo_heads, c.page_size, c.lens, c.flavor->name);
  test::RandomPool<T> host(make_spec(*c.flavor, c.num_kv_heads, c.head_dim, c.page_size, c.lens), rng);
  DevicePool<T> dev(host);
  const std::int32_t batch = host.batch_size();
  const std::size_t rows = static_cast<std::size_t>(batch) * c.num_qo_heads;
  // |q| up to 3 so the softmax is far from uniform.
  const auto q = test::random_vector<T>(rows * c.head_dim, rng, -3.f, 3.f);
  const DecodeAttentionParams p{c.num_qo_heads, 1.f / std::sqrt(static_cast<float>(c.head_dim))};

  // CPU twin.
  std::vector<unsigned char> cpu_ws(paged_decode_attention_workspace_size(exec::Host{2}, host.view, p));
  std::vector<T> cpu_out(rows * c.head_dim);
  std::vector<float> cpu_lse(rows);
  KVKIT_REQUIRE_OK(paged_decode_attention(exec::Host{2}, host.view, q.data(), cpu_out.data(), p,
                                          Workspace{cpu_ws.data(), cpu_ws.size()}, cpu_lse.data()));

  // CUDA, with output buffers pre-filled with garbage so unwritten elements show.
  const std::size_t ws_bytes = paged_decode_attention_workspace_size(stream.exec(), dev.view, p);
  CHECK((ws_bytes > 0) == c.expect_split);
  DeviceBuffer<unsigned char> dws(ws_bytes);
  DeviceBuffer<T> dq(q);
  DeviceBuffer<T> dout(test::random_vector<T>(rows * c.head_dim, rng));
  DeviceBuffer<float> dlse(test::random_vector<float>(rows, rng));
  KVKIT_REQUIRE_OK(paged_decode_attention(stream.exec(), dev.view, dq.get(), dout.get(), p,
                                          Workspace{dws.get(), ws_bytes}, dlse.get()));
  stream.sync();
  const auto out = dout.download();
  const auto lse = dlse.download();

  std::vector<double> ref_out, ref_lse;
  test::ref_decode_attention(host.view, q.data(), c.num_qo_heads, p.sm_scale, ref_out, ref_lse);
  const test::Tolerance lse_tol{1e-4, 1e-5};
  CHECK(test::compare_close(out.data(), ref_out, test::value_tolerance<T>(), "out") == "");
  CHECK(test::compare_close(lse.data(), ref_lse, lse_tol, "lse") == "");
  CHECK(test::nmse(out.data(), ref_out) < nmse_tol<T>());
  // Parity with the CPU twin.
  CHECK(test::nmse(out.data(), as_double(cpu_out)) < nmse_tol<T>());
  CHECK(test::compare_close(lse.data(), as_double(cpu_lse), lse_tol, "lse vs cpu") == "");
}

}  // namespace

TEMPLATE_TEST_CASE("cuda parity: paged_decode_attention", "[cuda][attention]", float, half_t,
                   bfloat16_t) {
  using T = TestType;
  KVKIT_REQUIRE_GPU();
  KVKIT_TEST_RNG(rng);
  Stream stream;
  const Flavor* packed = &kFlavors[0];
  const Flavor* hnd = &kFlavors[1];
  const Flavor* unaligned = &kFlavors[2];
  std::vector<DecodeCase> cases;
  // Every head_dim, GQA group 4, an empty sequence, split-K on the 700-token one.
  for (std::int32_t d : {8, 16, 32, 64, 128, 256})
    cases.push_back({d, 2, 8, 16, {0, 37, 700}, d % 32 == 0 ? hnd : packed, true});
  // Many (sequence, head) pairs: one split, MHA (group 1).
  {
    std::vector<std::int32_t> lens;
    for (int b = 0; b < 40; ++b) lens.push_back(uniform_int(rng, 0, 300));
    cases.push_back({128, 8, 8, 16, lens, hnd, false});
  }
  // Group 8 (MQA-like), 5000 tokens split 16 ways, odd page size.
  cases.push_back({64, 1, 8, 7, {5000}, packed, true});
  // Group 3 (no power of two), group 2, one-token pages.
  cases.push_back({64, 2, 6, 5, {3000, 1}, hnd, true});
  cases.push_back({32, 4, 8, 1, {300, 65, 2}, packed, true});
  // Unaligned rows: the scalar fallback kernel, with and without splitting.
  cases.push_back({32, 2, 4, 16, {900, 3}, unaligned, true});
  cases.push_back({16, 4, 8, 4, [] {
                     std::vector<std::int32_t> l(80, 33);
                     l[5] = 0;
                     return l;
                   }(),
                   unaligned, false});
  for (const DecodeCase& c : cases) run_decode_case<T>(c, rng, stream);
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
    test::RandomPool<T> host(make_spec(f, heads, dim, 8, {45, 0, 20}), rng);
    DevicePool<T> dev(host);
    auto run = [&](std::int32_t seq, const std::vector<std::int32_t>* ids, std::int32_t n,
                   std::int32_t bad_pos) {
      CAPTURE(seq, n, bad_pos);
      const std::size_t elems = static_cast<std::size_t>(heads) * n * dim;
      std::vector<T> k_cpu(elems), v_cpu(elems);
      DeviceBuffer<T> dk(test::random_vector<T>(elems, rng)), dv(test::random_vector<T>(elems, rng));
      std::vector<std::int32_t> dids;
      if (ids != nullptr) {
        dids = *ids;
        if (bad_pos >= 0) dids[static_cast<std::size_t>(bad_pos)] = host.seq_lens[static_cast<std::size_t>(seq)] + 3;
      }
      DeviceBuffer<std::int32_t> did(dids);
      KVKIT_REQUIRE_OK(gather_tokens(exec::Host{}, host.view, seq, ids ? ids->data() : nullptr, n,
                                     k_cpu.data(), v_cpu.data()));
      KVKIT_REQUIRE_OK(gather_tokens(stream.exec(), dev.view, seq, ids ? did.get() : nullptr, n,
                                     dk.get(), dv.get()));
      stream.sync();
      if (bad_pos >= 0) {  // the device writes zeros for an id outside the sequence
        for (std::int32_t h = 0; h < heads; ++h)
          for (std::int32_t d = 0; d < dim; ++d) {
            const std::size_t i = (static_cast<std::size_t>(h) * n + bad_pos) * dim + d;
            k_cpu[i] = v_cpu[i] = from_float<T>(0.f);
          }
      }
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
      const std::int32_t heads = 3, dim = 16, keep_stride = 40;
      const std::vector<std::int32_t> lens = {50, 0, 33, 17};
      test::RandomPool<T> host(make_spec(f, heads, dim, 4, lens), rng);
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
      std::vector<std::int32_t> dkeep = keep;
      if (bad_entry) {
        // Position 3 of (seq 0, head 1) names a token past the sequence: the device skips it,
        // which leaves old token 3 in place, as keeping token 3 does on the CPU.
        const std::size_t at = (0 * heads + 1) * keep_stride + 3;
        // (A repeated keep entry is allowed by both backends.)
        dkeep[at] = lens[0];
        keep[at] = 3;
      }

      std::vector<unsigned char> cpu_ws(compact_tokens_workspace_size(exec::Host{2}, host.view, keep_stride));
      KVKIT_REQUIRE_OK(compact_tokens(exec::Host{2}, host.view, keep.data(), num_keep.data(), keep_stride,
                                      Workspace{cpu_ws.data(), cpu_ws.size()}));
      const std::size_t ws_bytes = compact_tokens_workspace_size(stream.exec(), dev.view, keep_stride);
      DeviceBuffer<unsigned char> dws(ws_bytes);
      DeviceBuffer<std::int32_t> dk(dkeep), dnk(num_keep);
      KVKIT_REQUIRE_OK(compact_tokens(stream.exec(), dev.view, dk.get(), dnk.get(), keep_stride,
                                      Workspace{dws.get(), ws_bytes}));
      stream.sync();
      require_same_pool(host, dev);
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
    test::RandomPool<T> host(make_spec(f, 2, 32, 8, {40, 17, 0}, 8), rng);
    DevicePool<T> dev(host);
    // Sources: used pages (one feeds two destinations); destinations: distinct free pages.
    std::vector<std::int32_t> src = {host.pages[0][1], host.pages[1][0], host.pages[0][4],
                                     host.pages[1][2], host.pages[0][1]};
    std::vector<std::int32_t> dst(host.free_pages.begin(), host.free_pages.begin() + 5);
    // Device-only pairs with an id outside the pool: skipped on the device.
    std::vector<std::int32_t> dsrc = src, ddst = dst;
    dsrc.insert(dsrc.begin() + 2, -1);
    ddst.insert(ddst.begin() + 2, host.free_pages[5]);
    dsrc.push_back(host.pages[0][0]);
    ddst.push_back(host.geometry.num_pages);

    KVKIT_REQUIRE_OK(copy_pages(exec::Host{2}, host.view, src.data(), dst.data(),
                                static_cast<std::int32_t>(src.size())));
    DeviceBuffer<std::int32_t> ds(dsrc), dd(ddst);
    KVKIT_REQUIRE_OK(copy_pages(stream.exec(), dev.view, ds.get(), dd.get(),
                                static_cast<std::int32_t>(dsrc.size())));
    stream.sync();
    require_same_pool(host, dev);
  }
}
