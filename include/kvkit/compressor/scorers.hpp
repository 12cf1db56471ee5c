#pragma once
// Other scorers of the Compressor pipeline of <kvkit/compressor/r1kv.hpp>, so users compare
// policies at equal budgets with the same Params, select API and kept-slot layout. Every
// scorer keeps the last `window` slots and ranks candidates j < S - window by Z[j]
// (ties: lower slot first); only Z differs:
// - SnapKV: Z = I, the pooled observation-window attention of R1KV's steps 1-3 (GQA max
//   over raw logits, float32 softmax, mean over the last min(window, Lq) queries, max-pool
//   of width `kernel`); no redundancy term.
// - StreamingLLM: attention sinks plus the most recent tokens: the first `sinks` slots
//   score 2, every other candidate j scores j / S (< 1), so the kept set is slots
//   [0, sinks) and the most recent budget - sinks slots. Needs no keys or queries.

#include <cstdint>

#include "kvkit/compressor/r1kv.hpp"

namespace kvkit {
namespace compressor {

/// SnapKV: observation-window attention, pooled (R1KV with lambda = 1, redundancy skipped).
struct SnapKV {
  static constexpr const char* kName = "snapkv";
  static constexpr bool kUsesAttention = true;
  static constexpr bool kUsesRedundancy = false;
  KVKIT_HOST_DEVICE static double score(const Params&, double importance, double, std::int32_t,
                                        std::int32_t) {
    return importance;
  }
};

/// StreamingLLM: the first `sinks` slots and the most recent ones.
struct StreamingLLM {
  static constexpr const char* kName = "streaming";
  static constexpr bool kUsesAttention = false;
  static constexpr bool kUsesRedundancy = false;
  KVKIT_HOST_DEVICE static double score(const Params& p, double, double, std::int32_t j,
                                        std::int32_t s) {
    return j < p.sinks ? 2.0 : static_cast<double>(j) / s;
  }
};

using SnapKVCompressor = Compressor<SnapKV>;
using StreamingLLMCompressor = Compressor<StreamingLLM>;

}  // namespace compressor
}  // namespace kvkit
