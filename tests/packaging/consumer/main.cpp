// A tiny engine-side program that uses kvkit the way a consumer project would: it
// builds a PagedKVView over its own K/V pool and block table, checks one address
// against the layout formula, and checks the version macros match the CMake package.
#include <kvkit/kvkit.hpp>
#include <kvkit/version.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(KVKIT_CONSUMER_EXPECT_EIGEN) != defined(KVKIT_HAS_EIGEN)
#error "kvkit::kvkit and the consumer disagree on whether Eigen3 is in use"
#endif

#if defined(KVKIT_CONSUMER_REDIS)
#include <hiredis/hiredis.h>
#endif
#if defined(KVKIT_CONSUMER_CUDA)
#include <cuda_runtime_api.h>
#endif
#if defined(KVKIT_CONSUMER_ZSTD)
#include <kvkit/store/block_format.hpp>
#include <zstd.h>
static_assert(kvkit::store::zstd_available(), "kvkit::zstd must define KVKIT_HAS_ZSTD=1");
#endif

int main() {
  const kvkit::KVGeometry g{/*num_kv_heads=*/2, /*head_dim=*/8, /*page_size=*/4,
                            /*num_pages=*/6};
  const kvkit::KVStrides s = kvkit::packed_strides(g, kvkit::KVLayout::kNHD);
  std::vector<float> k(static_cast<std::size_t>(g.num_pages * s.page), 0.f);
  std::vector<float> v(k.size(), 0.f);
  const std::vector<std::int32_t> table = {3, 1, 0, 0,   // sequence 0: pages 3, 1
                                           5, 2, 4, 0};  // sequence 1: pages 5, 2, 4
  const std::vector<std::int32_t> seq_lens = {6, 9};
  kvkit::PagedKVView<float> view;
  try {
    view = kvkit::make_block_table_view(g, k.data(), s, v.data(), s,
                                        kvkit::BlockTable{table.data(), 4, seq_lens.data(), 2});
    view.validate_page_table();
  } catch (const kvkit::Error& e) {
    std::fprintf(stderr, "consumer: view rejected: %s\n", e.what());
    return 1;
  }
  // Token 5 of sequence 1 is slot 1 of its second page (page 2), head 1, element 3.
  view.k_ptr(1, 5, 1)[3] = 42.f;
  const std::int64_t expect = 2 * s.page + 1 * s.token + 1 * s.head + 3;
  if (view.seq_len(1) != 9 || view.num_pages(1) != 3 || k[static_cast<std::size_t>(expect)] != 42.f) {
    std::fprintf(stderr, "consumer: view addressing is wrong\n");
    return 1;
  }
#if defined(KVKIT_EXPECTED_VERSION)
  if (std::strcmp(KVKIT_VERSION, KVKIT_EXPECTED_VERSION) != 0) {
    std::fprintf(stderr, "consumer: header version %s != package version %s\n", KVKIT_VERSION,
                 KVKIT_EXPECTED_VERSION);
    return 1;
  }
#endif
#if defined(KVKIT_CONSUMER_REDIS)
  // Take hiredis' address so the link proves kvkit::redis carries a usable library.
  void (*free_fn)(redisContext*) = &redisFree;
  if (free_fn == nullptr) return 1;
#endif
#if defined(KVKIT_CONSUMER_ZSTD)
  // And for libzstd through kvkit::zstd.
  std::size_t (*bound_fn)(std::size_t) = &ZSTD_compressBound;
  if (bound_fn == nullptr) return 1;
#endif
#if defined(KVKIT_CONSUMER_CUDA)
  // Same for the CUDA runtime (not called: the test machine may have no GPU).
  cudaError_t (*count_fn)(int*) = &cudaGetDeviceCount;
  if (count_fn == nullptr) return 1;
#endif
  std::printf("consumer ok: kvkit %s, view over %d pages, eigen=%d redis=%d cuda=%d\n",
              KVKIT_VERSION, view.num_pages_total,
#if defined(KVKIT_HAS_EIGEN)
              1,
#else
              0,
#endif
#if defined(KVKIT_CONSUMER_REDIS)
              1,
#else
              0,
#endif
#if defined(KVKIT_CONSUMER_CUDA)
              1
#else
              0
#endif
  );
  return 0;
}
