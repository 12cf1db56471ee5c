#pragma once
// TensorRT-LLM adapter: a PagedKVView over one layer of the KV block pool that
// TensorRT-LLM's KVCacheManager allocates (self-attention K+V cache, default
// block-major pool, primary/GPU memory).
//
// Target layout. A pool serves `num_layers` layers (layers with the same number of KV
// heads share one pool) and is one contiguous allocation of
//   pool  [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim]
// i.e. every block holds, per layer, a K sub-block then a V sub-block, and each
// sub-block is HND: [num_kv_heads, tokens_per_block, head_dim]. Call E =
// num_kv_heads * tokens_per_block * head_dim the elements of one sub-block.
//
// Page tables. TensorRT-LLM hands its attention kernels a "block offsets" table,
// one per pool, shaped [batch, beam, 2, max_blocks_per_seq] of 32-bit KVCacheIndex:
// row 0 holds the K entries and row 1 the V entries of a sequence. An entry is the
// sub-block number inside the layer-0 slice of the pool,
//   K entry = (block * num_layers) * 2,   V entry = K entry + 1,
// and the kernel of layer l (the l-th layer of this pool) adds l * 2 * E elements to
// the pool base, then entry * E; inside the sub-block, (head, token % tokens_per_block)
// is at (head * tokens_per_block + token % tokens_per_block) * head_dim. The top two bits
// of an entry tag the memory tier (0 = primary GPU pool); this adapter targets the
// primary pool, so tagged entries are rejected by validation.
//
// Two entry points:
//  - make_trtllm_view: reads the block offsets table as TensorRT-LLM builds it. View page
//    ids are the K entries (multiples of 2 * num_layers, so they are sparse); the V
//    entries are not read and must equal K + 1 (validate_trtllm_block_offsets checks).
//    Sequence b of the view is row pair b of the table, so with beam search pass
//    batch * beam sequences.
//  - make_trtllm_block_view: takes memory-pool block indices per sequence
//    ([num_seqs, max_blocks_per_seq], the block's position in the pool, which equals
//    its block id when no secondary pool is configured). View page ids are dense
//    block indices in [0, num_blocks).
// The layer-first pool layout (used for recurrent state) and K-only caches (MLA) are
// not covered.

#include <cstdint>
#include <limits>

#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/paged_kv_view.hpp"

namespace kvkit {
namespace detail {

inline void check_trtllm_pool(const void* pool, std::int32_t num_blocks, std::int32_t num_layers,
                              std::int32_t layer_in_pool, std::int32_t tokens_per_block,
                              std::int32_t num_kv_heads, std::int32_t head_dim,
                              const std::int32_t* table, std::int32_t max_blocks_per_seq,
                              const std::int32_t* seq_lens, std::int32_t num_seqs) {
  KVKIT_CHECK(num_blocks > 0, "kvkit: trtllm num_blocks must be > 0, got ", num_blocks);
  KVKIT_CHECK(num_layers > 0, "kvkit: trtllm num_layers must be > 0, got ", num_layers);
  KVKIT_CHECK(layer_in_pool >= 0 && layer_in_pool < num_layers, "kvkit: trtllm layer_in_pool ",
              layer_in_pool, " outside [0, ", num_layers, ")");
  KVKIT_CHECK(tokens_per_block > 0, "kvkit: trtllm tokens_per_block must be > 0, got ",
              tokens_per_block);
  KVKIT_CHECK(num_kv_heads > 0, "kvkit: trtllm num_kv_heads must be > 0, got ", num_kv_heads);
  KVKIT_CHECK(head_dim > 0, "kvkit: trtllm head_dim must be > 0, got ", head_dim);
  KVKIT_CHECK(max_blocks_per_seq > 0, "kvkit: trtllm max_blocks_per_seq must be > 0, got ",
              max_blocks_per_seq);
  KVKIT_CHECK(num_seqs >= 0, "kvkit: trtllm num_seqs must be >= 0, got ", num_seqs);
  KVKIT_CHECK(pool != nullptr, "kvkit: trtllm pool is null");
  KVKIT_CHECK(num_seqs == 0 || table != nullptr, "kvkit: trtllm block table is null for ",
              num_seqs, " sequences");
  KVKIT_CHECK(num_seqs == 0 || seq_lens != nullptr, "kvkit: trtllm seq_lens is null for ",
              num_seqs, " sequences");
}

}  // namespace detail

/// Builds a dense-block-table view of layer `layer_in_pool` of a TensorRT-LLM KV block
/// pool, addressed through TensorRT-LLM's block offsets table for that pool
/// (`[num_seqs, 2, max_blocks_per_seq]` KVCacheIndex values, K row then V row per
/// sequence). Page ids of the view are the K entries. Throws kvkit::Error naming the bad
/// value for non-positive sizes, a layer outside the pool, null pointers, or a pool whose
/// sub-block count overflows the 32-bit entries. The table is not read; on a host table
/// call validate_trtllm_block_offsets (pairing and tier bits) and validate_page_table().
template <class T>
PagedKVView<T> make_trtllm_view(
    T* pool,  // [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim]
    std::int32_t num_blocks, std::int32_t num_layers, std::int32_t layer_in_pool,
    std::int32_t tokens_per_block, std::int32_t num_kv_heads, std::int32_t head_dim,
    const std::int32_t* block_offsets,  // [num_seqs, 2, max_blocks_per_seq] KVCacheIndex
    std::int32_t max_blocks_per_seq,
    const std::int32_t* seq_lens,  // [num_seqs]
    std::int32_t num_seqs, MemorySpace space = MemorySpace::kHost) {
  detail::check_trtllm_pool(pool, num_blocks, num_layers, layer_in_pool, tokens_per_block,
                            num_kv_heads, head_dim, block_offsets, max_blocks_per_seq, seq_lens,
                            num_seqs);
  const std::int64_t sub_blocks = 2LL * num_layers * num_blocks;
  KVKIT_CHECK(sub_blocks <= (1LL << 30),
              "kvkit: trtllm pool of ", num_blocks, " blocks x ", num_layers,
              " layers has more sub-blocks than 30-bit block offsets address");
  KVKIT_CHECK(2LL * max_blocks_per_seq <= std::numeric_limits<std::int32_t>::max(),
              "kvkit: trtllm max_blocks_per_seq ", max_blocks_per_seq, " too large");
  // Any K entry p below this keeps both p and p + 1 (its V) inside the pool for this layer.
  const auto num_entries = static_cast<std::int32_t>(sub_blocks - 2LL * layer_in_pool - 1);
  const KVGeometry g{num_kv_heads, head_dim, tokens_per_block, num_entries};
  KVStrides s = packed_strides(g, KVLayout::kHND);  // strides inside one sub-block
  const std::int64_t sub_block = s.page;            // E elements; entries count sub-blocks
  T* layer_base = pool + 2 * sub_block * layer_in_pool;
  return make_block_table_view(g, layer_base, s, layer_base + sub_block, s,
                               BlockTable{block_offsets, 2 * max_blocks_per_seq, seq_lens,
                                          num_seqs},
                               space);
}

/// Builds a dense-block-table view of layer `layer_in_pool` of a TensorRT-LLM KV block
/// pool from memory-pool block indices (`[num_seqs, max_blocks_per_seq]`, each in
/// [0, num_blocks)). Page ids of the view are those block indices. Same validation as
/// make_trtllm_view; call validate_page_table() on a host table.
template <class T>
PagedKVView<T> make_trtllm_block_view(
    T* pool,  // [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim]
    std::int32_t num_blocks, std::int32_t num_layers, std::int32_t layer_in_pool,
    std::int32_t tokens_per_block, std::int32_t num_kv_heads, std::int32_t head_dim,
    const std::int32_t* block_indices,  // [num_seqs, max_blocks_per_seq]
    std::int32_t max_blocks_per_seq,
    const std::int32_t* seq_lens,  // [num_seqs]
    std::int32_t num_seqs, MemorySpace space = MemorySpace::kHost) {
  detail::check_trtllm_pool(pool, num_blocks, num_layers, layer_in_pool, tokens_per_block,
                            num_kv_heads, head_dim, block_indices, max_blocks_per_seq, seq_lens,
                            num_seqs);
  const KVGeometry g{num_kv_heads, head_dim, tokens_per_block, num_blocks};
  KVStrides s = packed_strides(g, KVLayout::kHND);
  const std::int64_t sub_block = s.page;
  s.page = 2 * sub_block * num_layers;  // a block holds K and V of every layer of the pool
  T* layer_base = pool + 2 * sub_block * layer_in_pool;
  return make_block_table_view(g, layer_base, s, layer_base + sub_block, s,
                               BlockTable{block_indices, max_blocks_per_seq, seq_lens, num_seqs},
                               space);
}

/// Checks a host-resident TensorRT-LLM block offsets table against what
/// make_trtllm_view assumes, for the pages each sequence uses: the entry is in the
/// primary tier (top two bits clear), the K entry is a block start (a multiple of
/// 2 * num_layers) below 2 * num_layers * num_blocks, and the V entry equals K + 1.
/// Throws kvkit::Error naming the sequence, page and bad entry.
inline void validate_trtllm_block_offsets(
    const std::int32_t* block_offsets,  // [num_seqs, 2, max_blocks_per_seq] KVCacheIndex
    std::int32_t max_blocks_per_seq,
    const std::int32_t* seq_lens,  // [num_seqs]
    std::int32_t num_seqs, std::int32_t tokens_per_block, std::int32_t num_layers,
    std::int32_t num_blocks) {
  KVKIT_CHECK(tokens_per_block > 0, "kvkit: trtllm tokens_per_block must be > 0, got ",
              tokens_per_block);
  KVKIT_CHECK(num_layers > 0, "kvkit: trtllm num_layers must be > 0, got ", num_layers);
  KVKIT_CHECK(num_blocks > 0, "kvkit: trtllm num_blocks must be > 0, got ", num_blocks);
  KVKIT_CHECK(max_blocks_per_seq > 0, "kvkit: trtllm max_blocks_per_seq must be > 0, got ",
              max_blocks_per_seq);
  KVKIT_CHECK(num_seqs >= 0, "kvkit: trtllm num_seqs must be >= 0, got ", num_seqs);
  if (num_seqs == 0) return;
  KVKIT_CHECK(block_offsets != nullptr && seq_lens != nullptr,
              "kvkit: trtllm block offsets or seq_lens is null");
  const std::uint32_t tier_mask = 3u << 30;
  const std::int64_t stride = 2LL * num_layers;
  for (std::int32_t b = 0; b < num_seqs; ++b) {
    KVKIT_CHECK(seq_lens[b] >= 0, "kvkit: trtllm seq_len ", seq_lens[b], " of sequence ", b,
                " is negative");
    const std::int64_t pages =
        (static_cast<std::int64_t>(seq_lens[b]) + tokens_per_block - 1) / tokens_per_block;
    KVKIT_CHECK(pages <= max_blocks_per_seq, "kvkit: trtllm sequence ", b, " needs ", pages,
                " blocks but rows hold ", max_blocks_per_seq);
    const std::int32_t* k_row = block_offsets + 2LL * b * max_blocks_per_seq;
    const std::int32_t* v_row = k_row + max_blocks_per_seq;
    for (std::int64_t i = 0; i < pages; ++i) {
      const std::int32_t k = k_row[i], v = v_row[i];
      KVKIT_CHECK((static_cast<std::uint32_t>(k) & tier_mask) == 0 &&
                      (static_cast<std::uint32_t>(v) & tier_mask) == 0,
                  "kvkit: trtllm block offset ", k, "/", v, " of sequence ", b, " page ", i,
                  " is not in the primary pool");
      KVKIT_CHECK(k % stride == 0 && k / stride < num_blocks, "kvkit: trtllm K block offset ", k,
                  " of sequence ", b, " page ", i, " is not a block start (multiple of ", stride,
                  " below ", stride * num_blocks, ")");
      KVKIT_CHECK(v == k + 1, "kvkit: trtllm V block offset ", v, " of sequence ", b, " page ", i,
                  " must be K offset + 1 = ", k + 1);
    }
  }
}

}  // namespace kvkit
