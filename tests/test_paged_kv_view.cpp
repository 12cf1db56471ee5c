#include <catch2/catch.hpp>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvkit/core/paged_kv_view.hpp"
#include "kvkit/core/workspace.hpp"

using namespace kvkit;

TEST_CASE("CSR and block-table views address the same tokens", "[view]") {
  const KVGeometry g{3, 8, 4, 20};
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    const KVStrides s = packed_strides(g, layout);
    std::vector<float> k(static_cast<size_t>(s.page) * g.num_pages), v(k.size());
    // two sequences: 7 tokens on pages {5, 2}, 9 tokens on pages {11, 0, 19}
    std::vector<int32_t> indptr{0, 2, 5}, indices{5, 2, 11, 0, 19}, last{3, 1};
    std::vector<int32_t> table{5, 2, -1, 11, 0, 19}, lens{7, 9};
    auto csr = make_csr_view(g, k.data(), s, v.data(), s,
                             CsrPageTable{indptr.data(), indices.data(), last.data(), 2});
    auto dense = make_block_table_view(g, k.data(), s, v.data(), s,
                                       BlockTable{table.data(), 3, lens.data(), 2});
    csr.validate_page_table();
    dense.validate_page_table();
    for (int b = 0; b < 2; ++b) {
      REQUIRE(csr.seq_len(b) == dense.seq_len(b));
      REQUIRE(csr.num_pages(b) == dense.num_pages(b));
      for (int t = 0; t < csr.seq_len(b); ++t)
        for (int h = 0; h < g.num_kv_heads; ++h) {
          REQUIRE(csr.k_ptr(b, t, h) == dense.k_ptr(b, t, h));
          const int page = (b == 0 ? std::vector<int>{5, 2} : std::vector<int>{11, 0, 19})[t / 4];
          const int slot = t % 4;
          const long off = layout == KVLayout::kNHD ? ((page * 4 + slot) * 3 + h) * 8
                                                    : ((page * 3 + h) * 4 + slot) * 8;
          REQUIRE(csr.k_ptr(b, t, h) == k.data() + off);
          REQUIRE(csr.v_ptr(b, t, h) == v.data() + off);
          REQUIRE(csr.k_slot_ptr(page * 4 + slot, h) == k.data() + off);
        }
    }
    REQUIRE(csr.seq_len(0) == 7);
    REQUIRE(csr.seq_len(1) == 9);
  }
}

TEST_CASE("bad geometry and tables throw kvkit::Error naming the value", "[view][errors]") {
  std::vector<float> k(1024), v(1024);
  const KVGeometry good{2, 8, 4, 4};
  const KVStrides s = packed_strides(good, KVLayout::kNHD);
  std::vector<int32_t> indptr{0, 2}, indices{1, 7}, last{2};
  CsrPageTable t{indptr.data(), indices.data(), last.data(), 1};
  REQUIRE_THROWS_WITH(make_csr_view(KVGeometry{2, 0, 4, 4}, k.data(), s, v.data(), s, t),
                      Catch::Contains("head_dim must be > 0, got 0"));
  REQUIRE_THROWS_WITH(make_csr_view(KVGeometry{2, 8, -3, 4}, k.data(), s, v.data(), s, t),
                      Catch::Contains("page_size must be > 0, got -3"));
  REQUIRE_THROWS_AS(make_csr_view(good, k.data(), KVStrides{64, 8, 4}, v.data(), s, t), Error);
  REQUIRE_THROWS_WITH(make_csr_view(good, k.data(), KVStrides{64, 8, 4}, v.data(), s, t),
                      Catch::Contains("K strides overlap"));
  auto view = make_csr_view(good, k.data(), s, v.data(), s, t);
  REQUIRE_THROWS_WITH(view.validate_page_table(), Catch::Contains("page id 7 out of range [0, 4)"));
  indices[1] = 3;
  last[0] = 5;
  REQUIRE_THROWS_WITH(view.validate_page_table(), Catch::Contains("last_page_len 5"));
  last[0] = 4;
  REQUIRE_NOTHROW(view.validate_page_table());
  view.space = MemorySpace::kCuda;
  REQUIRE_THROWS_WITH(view.validate_page_table(), Catch::Contains("cuda"));

  std::vector<int32_t> table{0, 1}, lens{13};
  auto dense = make_block_table_view(good, k.data(), s, v.data(), s, BlockTable{table.data(), 2, lens.data(), 1});
  REQUIRE_THROWS_WITH(dense.validate_page_table(), Catch::Contains("needs 4 pages but block table rows hold 2"));
}

TEST_CASE("page tables whose lengths overflow int32 are refused, not wrapped", "[view][errors]") {
  std::vector<float> k(16), v(16);  // never read: the tables are refused first
  // Block table: INT32_MAX tokens need 134217728 pages of 16 (len + 15 must not wrap to a
  // negative page count that passes the row check).
  const KVGeometry g{1, 1, 16, 4};
  const KVStrides s = packed_strides(g, KVLayout::kNHD);
  std::vector<int32_t> table{0, 1, 2, 3}, lens{std::numeric_limits<int32_t>::max()};
  auto dense = make_block_table_view(g, k.data(), s, v.data(), s,
                                     BlockTable{table.data(), 4, lens.data(), 1});
  REQUIRE(dense.num_pages(0) == 134217728);
  REQUIRE_THROWS_WITH(dense.validate_page_table(),
                      Catch::Contains("needs 134217728 pages but block table rows hold 4"));
  // CSR: 3 pages of 2^30 tokens hold 3 * 2^30 tokens, more than seq_len() can return.
  const KVGeometry big{1, 1, 1 << 30, 4};
  const KVStrides bs = packed_strides(big, KVLayout::kNHD);
  std::vector<int32_t> indptr{0, 3}, indices{0, 1, 2}, last{1 << 30};
  auto csr = make_csr_view(big, k.data(), bs, v.data(), bs,
                           CsrPageTable{indptr.data(), indices.data(), last.data(), 1});
  REQUIRE_THROWS_WITH(csr.validate_page_table(), Catch::Contains("holds 3221225472 tokens"));
  last[0] = 1;  // 2 * 2^30 + 1 tokens: still too many
  REQUIRE_THROWS_WITH(csr.validate_page_table(), Catch::Contains("holds 2147483649 tokens"));
  indptr[1] = 2;  // 2^30 + 1 tokens fit
  REQUIRE_NOTHROW(csr.validate_page_table());
  REQUIRE(csr.seq_len(0) == (1 << 30) + 1);
}

TEST_CASE("workspace carver aligns and refuses overflow", "[workspace]") {
  WorkspaceSizer sz;
  sz.add<float>(10).add<int32_t>(3);
  std::vector<unsigned char> buf(sz.bytes());
  WorkspaceCarver c(Workspace{buf.data(), buf.size()});
  float* a = c.take<float>(10);
  int32_t* b = c.take<int32_t>(3);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  REQUIRE(reinterpret_cast<uintptr_t>(a) % kWorkspaceAlign == 0);
  REQUIRE(reinterpret_cast<uintptr_t>(b) % kWorkspaceAlign == 0);
  REQUIRE(c.take<double>(1000) == nullptr);
}
