#pragma once
// vLLM adapter: a PagedKVView over one layer of vLLM's FlashAttention-backend KV cache.
//
// Target layout (vLLM FlashAttentionBackend.get_kv_cache_shape), per layer, contiguous:
//   kv_cache      [2, num_blocks, block_size, num_kv_heads, head_size]   (index 0 = K, 1 = V)
//   block_tables  [num_seqs, max_blocks_per_seq] int32, row b lists the physical blocks of
//                 sequence b in token order; entries past ceil(seq_lens[b] / block_size)
//                 are never read (vLLM pads them)
//   seq_lens      [num_seqs] int32 tokens per sequence (the KV length, i.e. context + new)
// Element (kv, block, offset, head, d) is at
//   (((kv * num_blocks + block) * block_size + offset) * num_kv_heads + head) * head_size + d,
// and vLLM's slot_mapping value for a token is block * block_size + offset, which is what
// PagedKVView::k_slot_ptr / v_slot_ptr take.

#include <cstdint>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"

namespace kvkit {

/// Builds a dense-block-table view of one layer of vLLM's `(2, num_blocks, block_size,
/// num_kv_heads, head_size)` cache without copying. The view's page ids are vLLM block
/// ids, so block tables and slot mappings are used as vLLM produced them. Throws
/// kvkit::Error naming the bad value for non-positive sizes, a negative sequence count or
/// null pointers. The table itself is not read here (it may live on the device); call
/// `validate_page_table()` on the result to check a host table's ids and lengths.
template <class T>
PagedKVView<T> make_vllm_view(T* kv_cache,  // [2, num_blocks, block_size, num_kv_heads, head_size]
                              std::int32_t num_blocks, std::int32_t block_size,
                              std::int32_t num_kv_heads, std::int32_t head_size,
                              const std::int32_t* block_tables,  // [num_seqs, max_blocks_per_seq]
                              std::int32_t max_blocks_per_seq,
                              const std::int32_t* seq_lens,  // [num_seqs]
                              std::int32_t num_seqs, MemorySpace space = MemorySpace::kHost) {
  KVKIT_CHECK(num_blocks > 0, "kvkit: vllm num_blocks must be > 0, got ", num_blocks);
  KVKIT_CHECK(block_size > 0, "kvkit: vllm block_size must be > 0, got ", block_size);
  KVKIT_CHECK(num_kv_heads > 0, "kvkit: vllm num_kv_heads must be > 0, got ", num_kv_heads);
  KVKIT_CHECK(head_size > 0, "kvkit: vllm head_size must be > 0, got ", head_size);
  KVKIT_CHECK(max_blocks_per_seq > 0, "kvkit: vllm max_blocks_per_seq must be > 0, got ",
              max_blocks_per_seq);
  KVKIT_CHECK(num_seqs >= 0, "kvkit: vllm num_seqs must be >= 0, got ", num_seqs);
  KVKIT_CHECK(kv_cache != nullptr, "kvkit: vllm kv_cache is null");
  KVKIT_CHECK(num_seqs == 0 || block_tables != nullptr, "kvkit: vllm block_tables is null for ",
              num_seqs, " sequences");
  KVKIT_CHECK(num_seqs == 0 || seq_lens != nullptr, "kvkit: vllm seq_lens is null for ",
              num_seqs, " sequences");

  const KVGeometry g{num_kv_heads, head_size, block_size, num_blocks};
  const KVStrides s = packed_strides(g, KVLayout::kNHD);  // one [block_size, H, D] per block
  T* v_cache = kv_cache + s.page * num_blocks;            // kv_cache[1]
  return make_block_table_view(g, kv_cache, s, v_cache, s,
                               BlockTable{block_tables, max_blocks_per_seq, seq_lens, num_seqs},
                               space);
}

}  // namespace kvkit
