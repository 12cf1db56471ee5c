// Engine adapters: every (sequence, token, head) address of a view built by an adapter
// must equal the address the engine's own indexing formula gives. The formulas below are
// written from each engine's tensor shapes (flat row-major indices) and, for
// TensorRT-LLM, also from its kernel-side block-pointer arithmetic; they share no code
// with the adapters.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvkit/core/adapters/flashinfer.hpp"
#include "kvkit/core/adapters/trtllm.hpp"
#include "kvkit/core/adapters/vllm.hpp"
#include "reference.hpp"

using namespace kvkit;

namespace {

// Seeded by test::test_seed() (so KVKIT_TEST_SEED=<seed> replays a failure), cut to the
// 32 bits std::mt19937 uses: the CAPTUREd seed is then exactly the one to replay with.
std::mt19937 fresh_rng(std::uint32_t& seed) {
  seed = static_cast<std::uint32_t>(kvkit::test::test_seed());
  return std::mt19937(seed);
}

int uniform(std::mt19937& rng, int lo, int hi) {  // inclusive
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

// A random ragged batch: per-sequence lengths and distinct physical pages drawn from a
// shuffled pool, so neighbouring logical pages are never neighbours in memory.
struct RaggedBatch {
  std::vector<std::int32_t> seq_lens;
  std::vector<std::vector<std::int32_t>> pages;  // per sequence, in token order
  int max_pages = 0;
};

RaggedBatch random_batch(std::mt19937& rng, int num_pages, int page_size, int num_seqs) {
  RaggedBatch rb;
  std::vector<std::int32_t> pool(static_cast<size_t>(num_pages));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;
  for (int b = 0; b < num_seqs; ++b) {
    const int avail = static_cast<int>(pool.size() - next);
    // sequence 0 always has tokens, so every batch checks some addresses
    const int want_pages = uniform(rng, b == 0 ? 1 : 0, std::min(avail, 7));
    int len = 0;
    if (want_pages > 0) len = (want_pages - 1) * page_size + uniform(rng, 1, page_size);
    // one sequence in three is exactly page-aligned, to cover a full last page
    if (want_pages > 0 && uniform(rng, 0, 2) == 0) len = want_pages * page_size;
    rb.seq_lens.push_back(len);
    rb.pages.emplace_back(pool.begin() + static_cast<std::ptrdiff_t>(next),
                          pool.begin() + static_cast<std::ptrdiff_t>(next + want_pages));
    next += static_cast<size_t>(want_pages);
    rb.max_pages = std::max(rb.max_pages, want_pages);
  }
  return rb;
}

// Collects address mismatches so one REQUIRE reports the first of them.
struct Mismatches {
  long count = 0;
  long checked = 0;
  std::string first;
  template <class P>
  void expect(const P* got, const P* want, const char* what, int b, int t, int h) {
    ++checked;
    if (got == want) return;
    if (count++ == 0) {
      std::ostringstream os;
      os << what << " mismatch at seq " << b << " token " << t << " head " << h << ": view "
         << static_cast<const void*>(got) << " engine " << static_cast<const void*>(want);
      first = os.str();
    }
  }
};

}  // namespace

TEMPLATE_TEST_CASE("vLLM adapter matches vLLM's kv_cache indexing for every token",
                   "[adapters][vllm]", float, half_t, bfloat16_t) {
  using T = TestType;
  std::uint32_t seed = 0;
  std::mt19937 rng = fresh_rng(seed);
  CAPTURE(seed);
  for (int rep = 0; rep < 25; ++rep) {
    const int NB = uniform(rng, 4, 48), BS = uniform(rng, 1, 16), H = uniform(rng, 1, 5),
              D = uniform(rng, 1, 9), B = uniform(rng, 1, 6);
    CAPTURE(rep, NB, BS, H, D, B);
    const RaggedBatch rb = random_batch(rng, NB, BS, B);
    const int M = std::max(1, rb.max_pages) + uniform(rng, 0, 3);
    // unused entries hold garbage, as vLLM's padded rows may
    std::vector<std::int32_t> table(static_cast<size_t>(B) * M);
    for (auto& e : table) e = uniform(rng, -1000, 1000);
    for (int b = 0; b < B; ++b)
      for (size_t i = 0; i < rb.pages[b].size(); ++i) table[static_cast<size_t>(b) * M + i] = rb.pages[b][i];
    std::vector<T> kv(static_cast<size_t>(2) * NB * BS * H * D);

    const PagedKVView<T> view =
        make_vllm_view(kv.data(), NB, BS, H, D, table.data(), M, rb.seq_lens.data(), B);
    REQUIRE_NOTHROW(view.validate_page_table());
    REQUIRE(view.batch_size == B);
    REQUIRE(view.space == MemorySpace::kHost);

    // vLLM: kv_cache[kv][block][offset][head][d], row-major over (2, NB, BS, H, D).
    auto engine_index = [&](int kvi, long block, int offset, int head) {
      return (((kvi * static_cast<long>(NB) + block) * BS + offset) * H + head) * D;
    };
    Mismatches mm;
    for (int b = 0; b < B; ++b) {
      REQUIRE(view.seq_len(b) == rb.seq_lens[b]);
      REQUIRE(view.num_pages(b) == static_cast<int>(rb.pages[b].size()));
      for (int t = 0; t < rb.seq_lens[b]; ++t) {
        const long block = table[static_cast<size_t>(b) * M + t / BS];
        const int offset = t % BS;
        const long slot = block * BS + offset;  // vLLM slot_mapping value of this token
        for (int h = 0; h < H; ++h) {
          const T* k_want = kv.data() + engine_index(0, block, offset, h);
          const T* v_want = kv.data() + engine_index(1, block, offset, h);
          mm.expect(view.k_ptr(b, t, h), k_want, "K", b, t, h);
          mm.expect(view.v_ptr(b, t, h), v_want, "V", b, t, h);
          mm.expect(view.k_slot_ptr(slot, h), k_want, "K slot", b, t, h);
          mm.expect(view.v_slot_ptr(slot, h), v_want, "V slot", b, t, h);
        }
      }
    }
    INFO(mm.first);
    REQUIRE(mm.count == 0);
    REQUIRE(mm.checked > 0);
  }
}

TEMPLATE_TEST_CASE("FlashInfer adapter matches FlashInfer's paged cache indexing",
                   "[adapters][flashinfer]", float, half_t) {
  using T = TestType;
  std::uint32_t seed = 0;
  std::mt19937 rng = fresh_rng(seed);
  CAPTURE(seed);
  for (int rep = 0; rep < 20; ++rep) {
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      for (bool split : {false, true}) {
        const int P = uniform(rng, 4, 48), PS = uniform(rng, 1, 16), H = uniform(rng, 1, 5),
                  D = uniform(rng, 1, 9), B = uniform(rng, 1, 6);
        CAPTURE(rep, to_string(layout), split, P, PS, H, D, B);
        const RaggedBatch rb = random_batch(rng, P, PS, B);
        std::vector<std::int32_t> indptr{0}, indices, last(static_cast<size_t>(B));
        for (int b = 0; b < B; ++b) {
          indices.insert(indices.end(), rb.pages[b].begin(), rb.pages[b].end());
          indptr.push_back(static_cast<std::int32_t>(indices.size()));
          const int n = static_cast<int>(rb.pages[b].size());
          last[b] = n == 0 ? 0 : rb.seq_lens[b] - (n - 1) * PS;
        }
        if (indices.empty()) indices.push_back(0);  // keep data() non-null
        const size_t half = static_cast<size_t>(P) * PS * H * D;
        std::vector<T> one(2 * half), k_only(half), v_only(half);

        const PagedKVView<T> view =
            split ? make_flashinfer_view(k_only.data(), v_only.data(), P, PS, H, D, layout,
                                         indptr.data(), indices.data(), last.data(), B)
                  : make_flashinfer_view(one.data(), P, PS, H, D, layout, indptr.data(),
                                         indices.data(), last.data(), B);
        REQUIRE_NOTHROW(view.validate_page_table());

        // FlashInfer: one tensor [P, 2, PS, H, D] (NHD) / [P, 2, H, PS, D] (HND), or
        // separate K and V tensors without the "2" dimension.
        auto engine_ptr = [&](int kvi, long page, int slot, int head) -> const T* {
          if (!split) {
            const long pk = page * 2 + kvi;
            const long idx = layout == KVLayout::kNHD ? ((pk * PS + slot) * H + head) * D
                                                      : ((pk * H + head) * PS + slot) * D;
            return one.data() + idx;
          }
          const long idx = layout == KVLayout::kNHD ? ((page * PS + slot) * H + head) * D
                                                    : ((page * H + head) * PS + slot) * D;
          return (kvi == 0 ? k_only.data() : v_only.data()) + idx;
        };
        Mismatches mm;
        for (int b = 0; b < B; ++b) {
          REQUIRE(view.seq_len(b) == rb.seq_lens[b]);
          for (int t = 0; t < rb.seq_lens[b]; ++t) {
            const long page = indices[static_cast<size_t>(indptr[b] + t / PS)];
            for (int h = 0; h < H; ++h) {
              mm.expect(view.k_ptr(b, t, h), engine_ptr(0, page, t % PS, h), "K", b, t, h);
              mm.expect(view.v_ptr(b, t, h), engine_ptr(1, page, t % PS, h), "V", b, t, h);
            }
          }
        }
        INFO(mm.first);
        REQUIRE(mm.count == 0);
        REQUIRE(mm.checked > 0);
      }
    }
  }
}

namespace {

// TensorRT-LLM's kernel-side arithmetic (KVBlockArray): byte pointer of the layer slice,
// then entry * bytes-per-sub-block, then (head * tokens_per_block + local) * head_dim
// with local = token & (tokens_per_block - 1) (tokens_per_block is a power of two).
template <class T>
const T* trtllm_kernel_ptr(const T* pool, int layer, int tokens_per_block, int H, int D,
                           const std::int32_t* offsets, int M, int seq, int kvi, int token,
                           int head) {
  const long bytes_per_block = static_cast<long>(tokens_per_block) * H * D * sizeof(T);
  const char* layer_base = reinterpret_cast<const char*>(pool) + layer * 2L * bytes_per_block;
  const std::int32_t* row = offsets + (static_cast<long>(seq) * 2 + kvi) * M;
  int log2 = 0;
  while ((1 << log2) < tokens_per_block) ++log2;
  const std::int32_t entry = row[token >> log2] & 0x3fffffff;  // drop the tier bits
  const char* block = layer_base + entry * bytes_per_block;
  const int local = token & (tokens_per_block - 1);
  return reinterpret_cast<const T*>(block) + (static_cast<long>(head) * tokens_per_block + local) * D;
}

}  // namespace

TEMPLATE_TEST_CASE("TensorRT-LLM adapters match the block pool and KVBlockArray indexing",
                   "[adapters][trtllm]", float, half_t) {
  using T = TestType;
  std::uint32_t seed = 0;
  std::mt19937 rng = fresh_rng(seed);
  CAPTURE(seed);
  for (int rep = 0; rep < 25; ++rep) {
    const int NB = uniform(rng, 4, 40), L = uniform(rng, 1, 4), layer = uniform(rng, 0, L - 1),
              TPB = 1 << uniform(rng, 0, 4), H = uniform(rng, 1, 4), D = uniform(rng, 1, 8),
              requests = uniform(rng, 1, 4), beams = uniform(rng, 1, 2);
    const int S = requests * beams;  // one row pair per (request, beam)
    CAPTURE(rep, NB, L, layer, TPB, H, D, S);
    const RaggedBatch rb = random_batch(rng, NB, TPB, S);
    const int M = std::max(1, rb.max_pages) + uniform(rng, 0, 2);
    // Block offsets as KVCacheManager writes them: [S, 2, M], K = block*L*2, V = K + 1.
    std::vector<std::int32_t> offsets(static_cast<size_t>(S) * 2 * M), block_ids(static_cast<size_t>(S) * M);
    for (auto& e : offsets) e = uniform(rng, -50, 50);  // padding is never read
    for (auto& e : block_ids) e = uniform(rng, -50, 50);
    for (int s = 0; s < S; ++s)
      for (size_t i = 0; i < rb.pages[s].size(); ++i) {
        const std::int32_t blk = rb.pages[s][i];
        offsets[(static_cast<size_t>(s) * 2 + 0) * M + i] = blk * L * 2 + 0;
        offsets[(static_cast<size_t>(s) * 2 + 1) * M + i] = blk * L * 2 + 1;
        block_ids[static_cast<size_t>(s) * M + i] = blk;
      }
    std::vector<T> pool(static_cast<size_t>(NB) * L * 2 * H * TPB * D);

    const PagedKVView<T> by_offsets = make_trtllm_view(pool.data(), NB, L, layer, TPB, H, D,
                                                       offsets.data(), M, rb.seq_lens.data(), S);
    const PagedKVView<T> by_blocks = make_trtllm_block_view(
        pool.data(), NB, L, layer, TPB, H, D, block_ids.data(), M, rb.seq_lens.data(), S);
    REQUIRE_NOTHROW(by_offsets.validate_page_table());
    REQUIRE_NOTHROW(by_blocks.validate_page_table());
    REQUIRE_NOTHROW(validate_trtllm_block_offsets(offsets.data(), M, rb.seq_lens.data(), S, TPB,
                                                  L, NB));
    REQUIRE(by_blocks.num_pages_total == NB);

    // Pool tensor [NB, L, 2, H, TPB, D], row-major.
    auto pool_ptr = [&](long blk, int kvi, int head, int local) {
      return pool.data() + ((((blk * L + layer) * 2 + kvi) * H + head) * TPB + local) * D;
    };
    Mismatches mm;
    for (int s = 0; s < S; ++s) {
      REQUIRE(by_offsets.seq_len(s) == rb.seq_lens[s]);
      REQUIRE(by_blocks.num_pages(s) == static_cast<int>(rb.pages[s].size()));
      for (int t = 0; t < rb.seq_lens[s]; ++t) {
        const long blk = rb.pages[s][static_cast<size_t>(t / TPB)];
        for (int h = 0; h < H; ++h) {
          const T* k_kernel = trtllm_kernel_ptr(pool.data(), layer, TPB, H, D, offsets.data(), M, s, 0, t, h);
          const T* v_kernel = trtllm_kernel_ptr(pool.data(), layer, TPB, H, D, offsets.data(), M, s, 1, t, h);
          // the two engine formulas agree with each other...
          mm.expect(k_kernel, pool_ptr(blk, 0, h, t % TPB), "kernel-vs-pool K", s, t, h);
          mm.expect(v_kernel, pool_ptr(blk, 1, h, t % TPB), "kernel-vs-pool V", s, t, h);
          // ...and with both views
          mm.expect(by_offsets.k_ptr(s, t, h), k_kernel, "offsets view K", s, t, h);
          mm.expect(by_offsets.v_ptr(s, t, h), v_kernel, "offsets view V", s, t, h);
          mm.expect(by_blocks.k_ptr(s, t, h), k_kernel, "blocks view K", s, t, h);
          mm.expect(by_blocks.v_ptr(s, t, h), v_kernel, "blocks view V", s, t, h);
        }
      }
    }
    INFO(mm.first);
    REQUIRE(mm.count == 0);
    REQUIRE(mm.checked > 0);
  }
}

TEST_CASE("TensorRT-LLM block offsets validation names the bad entry", "[adapters][trtllm][errors]") {
  // 2 layers, 4 blocks: sequence 0 uses blocks 3 then 1 (K entries 12, 4; V 13, 5).
  const int L = 2, NB = 4, TPB = 4, M = 3;
  std::vector<std::int32_t> offsets{12, 4, -7, 13, 5, -7}, lens{6};
  REQUIRE_NOTHROW(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, TPB, L, NB));
  offsets[4] = 6;
  REQUIRE_THROWS_WITH(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, TPB, L, NB),
                      Catch::Contains("V block offset 6 of sequence 0 page 1 must be K offset + 1 = 5"));
  offsets[1] = 6;  // layer 1's slot of block 1, not a block start
  offsets[4] = 7;
  REQUIRE_THROWS_WITH(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, TPB, L, NB),
                      Catch::Contains("K block offset 6 of sequence 0 page 1 is not a block start"));
  offsets[1] = 16;  // block 4 of a 4-block pool
  offsets[4] = 17;
  REQUIRE_THROWS_WITH(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, TPB, L, NB),
                      Catch::Contains("K block offset 16"));
  offsets[1] = static_cast<std::int32_t>(4u | (1u << 30));  // secondary-tier tag
  offsets[4] = static_cast<std::int32_t>(5u | (1u << 30));
  REQUIRE_THROWS_WITH(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, TPB, L, NB),
                      Catch::Contains("not in the primary pool"));
  offsets[1] = 4;
  offsets[4] = 5;
  lens[0] = 13;  // needs 4 blocks, rows hold 3
  REQUIRE_THROWS_WITH(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, TPB, L, NB),
                      Catch::Contains("needs 4 blocks but rows hold 3"));
  REQUIRE_THROWS_WITH(validate_trtllm_block_offsets(offsets.data(), M, lens.data(), 1, 0, L, NB),
                      Catch::Contains("tokens_per_block must be > 0, got 0"));
}

TEST_CASE("adapters reject bad shapes and pointers, naming the value", "[adapters][errors]") {
  std::vector<float> mem(4096);
  std::vector<std::int32_t> table{0, 1, 2, 3}, lens{5, 3};
  float* p = mem.data();
  const std::int32_t* tb = table.data();
  const std::int32_t* ln = lens.data();

  SECTION("vllm") {
    REQUIRE_NOTHROW(make_vllm_view(p, 8, 4, 2, 8, tb, 2, ln, 2));
    REQUIRE_THROWS_WITH(make_vllm_view(p, 0, 4, 2, 8, tb, 2, ln, 2),
                        Catch::Contains("num_blocks must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_vllm_view(p, 8, -2, 2, 8, tb, 2, ln, 2),
                        Catch::Contains("block_size must be > 0, got -2"));
    REQUIRE_THROWS_WITH(make_vllm_view(p, 8, 4, 0, 8, tb, 2, ln, 2),
                        Catch::Contains("num_kv_heads must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_vllm_view(p, 8, 4, 2, -8, tb, 2, ln, 2),
                        Catch::Contains("head_size must be > 0, got -8"));
    REQUIRE_THROWS_WITH(make_vllm_view(p, 8, 4, 2, 8, tb, 0, ln, 2),
                        Catch::Contains("max_blocks_per_seq must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_vllm_view(p, 8, 4, 2, 8, tb, 2, ln, -1),
                        Catch::Contains("num_seqs must be >= 0, got -1"));
    REQUIRE_THROWS_WITH(make_vllm_view<float>(nullptr, 8, 4, 2, 8, tb, 2, ln, 2),
                        Catch::Contains("kv_cache is null"));
    REQUIRE_THROWS_WITH(make_vllm_view<float>(p, 8, 4, 2, 8, nullptr, 2, ln, 2),
                        Catch::Contains("block_tables is null for 2 sequences"));
    REQUIRE_THROWS_WITH(make_vllm_view<float>(p, 8, 4, 2, 8, tb, 2, nullptr, 2),
                        Catch::Contains("seq_lens is null for 2 sequences"));
    REQUIRE_NOTHROW(make_vllm_view<float>(p, 8, 4, 2, 8, nullptr, 2, nullptr, 0));  // empty batch
    // a block id past the pool is caught when the host table is validated
    table[2] = 8;  // first block of sequence 1
    const auto v = make_vllm_view(p, 8, 4, 2, 8, tb, 2, ln, 2);
    REQUIRE_THROWS_WITH(v.validate_page_table(), Catch::Contains("page id 8 out of range [0, 8)"));
    // device tables are tagged and refuse host validation
    const auto dv = make_vllm_view(p, 8, 4, 2, 8, tb, 2, ln, 2, MemorySpace::kCuda);
    REQUIRE(dv.space == MemorySpace::kCuda);
    REQUIRE_THROWS_WITH(dv.validate_page_table(), Catch::Contains("cuda"));
  }

  SECTION("flashinfer") {
    std::vector<std::int32_t> indptr{0, 2, 3}, indices{4, 1, 0}, last{1, 3};
    const std::int32_t* ip = indptr.data();
    const std::int32_t* ix = indices.data();
    const std::int32_t* lp = last.data();
    REQUIRE_NOTHROW(make_flashinfer_view(p, 8, 4, 2, 8, KVLayout::kHND, ip, ix, lp, 2));
    REQUIRE_NOTHROW(make_flashinfer_view(p, p + 1024, 8, 4, 2, 8, KVLayout::kNHD, ip, ix, lp, 2));
    REQUIRE_THROWS_WITH(make_flashinfer_view(p, -1, 4, 2, 8, KVLayout::kNHD, ip, ix, lp, 2),
                        Catch::Contains("max_num_pages must be > 0, got -1"));
    REQUIRE_THROWS_WITH(make_flashinfer_view(p, 8, 0, 2, 8, KVLayout::kNHD, ip, ix, lp, 2),
                        Catch::Contains("page_size must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_flashinfer_view(p, 8, 4, -4, 8, KVLayout::kNHD, ip, ix, lp, 2),
                        Catch::Contains("num_kv_heads must be > 0, got -4"));
    REQUIRE_THROWS_WITH(make_flashinfer_view(p, p, 8, 4, 2, 0, KVLayout::kNHD, ip, ix, lp, 2),
                        Catch::Contains("head_dim must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_flashinfer_view(p, 8, 4, 2, 8, static_cast<KVLayout>(7), ip, ix, lp, 2),
                        Catch::Contains("layout must be NHD or HND, got 7"));
    REQUIRE_THROWS_WITH(make_flashinfer_view(p, 8, 4, 2, 8, KVLayout::kNHD, ip, ix, lp, -3),
                        Catch::Contains("batch_size must be >= 0, got -3"));
    REQUIRE_THROWS_WITH(make_flashinfer_view<float>(nullptr, 8, 4, 2, 8, KVLayout::kNHD, ip, ix, lp, 2),
                        Catch::Contains("paged_kv_cache is null"));
    REQUIRE_THROWS_WITH(make_flashinfer_view<float>(p, nullptr, 8, 4, 2, 8, KVLayout::kNHD, ip, ix, lp, 2),
                        Catch::Contains("v_cache is null"));
    REQUIRE_THROWS_WITH(make_flashinfer_view<float>(p, 8, 4, 2, 8, KVLayout::kNHD, nullptr, ix, lp, 2),
                        Catch::Contains("paged_kv_indptr is null"));
    REQUIRE_THROWS_WITH(make_flashinfer_view<float>(p, 8, 4, 2, 8, KVLayout::kNHD, ip, nullptr, lp, 2),
                        Catch::Contains("paged_kv_indices is null for batch_size 2"));
    REQUIRE_THROWS_WITH(make_flashinfer_view<float>(p, 8, 4, 2, 8, KVLayout::kNHD, ip, ix, nullptr, 2),
                        Catch::Contains("paged_kv_last_page_len is null for batch_size 2"));
    last[1] = 5;
    const auto v = make_flashinfer_view(p, 8, 4, 2, 8, KVLayout::kNHD, ip, ix, lp, 2);
    REQUIRE_THROWS_WITH(v.validate_page_table(), Catch::Contains("last_page_len 5 of sequence 1"));
  }

  SECTION("trtllm") {
    REQUIRE_NOTHROW(make_trtllm_view(p, 8, 3, 2, 4, 2, 8, tb, 1, ln, 2));
    REQUIRE_NOTHROW(make_trtllm_block_view(p, 8, 3, 2, 4, 2, 8, tb, 2, ln, 2));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 0, 3, 2, 4, 2, 8, tb, 1, ln, 2),
                        Catch::Contains("num_blocks must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 8, 0, 0, 4, 2, 8, tb, 1, ln, 2),
                        Catch::Contains("num_layers must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_trtllm_block_view(p, 8, 3, 3, 4, 2, 8, tb, 2, ln, 2),
                        Catch::Contains("layer_in_pool 3 outside [0, 3)"));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 8, 3, -1, 4, 2, 8, tb, 1, ln, 2),
                        Catch::Contains("layer_in_pool -1 outside [0, 3)"));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 8, 3, 0, -4, 2, 8, tb, 1, ln, 2),
                        Catch::Contains("tokens_per_block must be > 0, got -4"));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 8, 3, 0, 4, 0, 8, tb, 1, ln, 2),
                        Catch::Contains("num_kv_heads must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 8, 3, 0, 4, 2, -1, tb, 1, ln, 2),
                        Catch::Contains("head_dim must be > 0, got -1"));
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 8, 3, 0, 4, 2, 8, tb, 0, ln, 2),
                        Catch::Contains("max_blocks_per_seq must be > 0, got 0"));
    REQUIRE_THROWS_WITH(make_trtllm_block_view(p, 8, 3, 0, 4, 2, 8, tb, 2, ln, -2),
                        Catch::Contains("num_seqs must be >= 0, got -2"));
    REQUIRE_THROWS_WITH(make_trtllm_view<float>(nullptr, 8, 3, 0, 4, 2, 8, tb, 1, ln, 2),
                        Catch::Contains("pool is null"));
    REQUIRE_THROWS_WITH(make_trtllm_view<float>(p, 8, 3, 0, 4, 2, 8, nullptr, 1, ln, 2),
                        Catch::Contains("block table is null for 2 sequences"));
    REQUIRE_THROWS_WITH(make_trtllm_block_view<float>(p, 8, 3, 0, 4, 2, 8, tb, 2, nullptr, 2),
                        Catch::Contains("seq_lens is null for 2 sequences"));
    // 2^28 blocks x 8 layers x 2 = 2^32 sub-blocks: more than 30-bit entries address
    // (checked before any memory is touched).
    REQUIRE_THROWS_WITH(make_trtllm_view(p, 1 << 28, 8, 0, 4, 2, 8, tb, 1, ln, 2),
                        Catch::Contains("268435456 blocks x 8 layers"));
    // view over offsets: a V-slot (odd) entry past the last block is out of range
    table = {2 * 3 * 7, 2 * 3 * 7 + 1, 2 * 3 * 8, 2 * 3 * 8 + 1};  // blocks 7 and 8 of 8
    lens = {4, 0};
    const auto v = make_trtllm_view(p, 8, 3, 2, 4, 2, 8, tb, 1, ln, 2);
    REQUIRE_NOTHROW(v.validate_page_table());
    lens = {4, 1};
    REQUIRE_THROWS_WITH(v.validate_page_table(), Catch::Contains("page id 48 out of range"));
  }
}
