#pragma once
// Shared helpers of the ConversationCache tests (test_conversation_cache.cpp and the
// Redis spill test): models, a turn runner and the allocator invariant check.

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/conversation_host.hpp"
#include "engine/engine.hpp"

namespace kvkit {
namespace test {

inline std::shared_ptr<const engine::Checkpoint> stories_or_synthetic(std::string* name) {
  const std::string path = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
  if (std::filesystem::exists(path)) {
    *name = "stories260K";
    return std::make_shared<const engine::Checkpoint>(engine::load_checkpoint(path));
  }
  WARN("stories260K: no model file " << path << "; using the synthetic checkpoint");
  *name = "synthetic";
  return std::make_shared<const engine::Checkpoint>(engine::default_synthetic_checkpoint());
}

inline std::vector<std::int32_t> random_tokens(std::size_t n, std::int32_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> d(3, vocab - 1);
  std::vector<std::int32_t> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

/// What one decoded turn produced.
struct TurnOut {
  std::vector<std::int32_t> tokens;          // generated tokens
  std::vector<std::vector<float>> logits;    // logits of every decode step
};

/// Feeds the pending prompt of `seq` (stepwise, or batched prefill then one step) and
/// decodes `reply` tokens greedily; the last generated token stays pending.
inline TurnOut decode_turn(engine::Engine& eng, engine::SeqId seq, std::int32_t reply, bool use_prefill) {
  TurnOut out;
  if (use_prefill) eng.prefill(seq);
  // Teacher-force the rest of the prompt.
  while (static_cast<std::size_t>(eng.position(seq)) + 1 < eng.tokens(seq).size()) eng.step();
  for (std::int32_t i = 0; i < reply; ++i) {
    eng.step();
    out.logits.push_back(eng.last_logits(seq));
    out.tokens.push_back(eng.tokens(seq).back());
  }
  return out;
}

/// Every page's refcount equals the cache's references plus the engine sequences' pages
/// (plus `extra` references held by the test); free pages are exactly those at zero.
template <class Cache>
void check_invariants(const engine::Engine& eng, const Cache& cache,
                      const std::map<std::int32_t, std::int32_t>& extra = {}) {
  const engine::BlockAllocator& a = eng.allocator();
  std::vector<std::int32_t> expect(static_cast<std::size_t>(a.num_pages()), 0);
  for (const auto& kv : cache.references()) expect[static_cast<std::size_t>(kv.first)] += kv.second;
  for (engine::SeqId s : eng.sequences())
    for (std::int32_t p : eng.pages(s)) ++expect[static_cast<std::size_t>(p)];
  for (const auto& kv : extra) expect[static_cast<std::size_t>(kv.first)] += kv.second;
  std::int32_t zero = 0;
  for (std::int32_t p = 0; p < a.num_pages(); ++p) {
    INFO("page " << p);
    REQUIRE(a.refcount(p) == expect[static_cast<std::size_t>(p)]);
    zero += expect[static_cast<std::size_t>(p)] == 0 ? 1 : 0;
  }
  REQUIRE(a.num_free() == zero);
  std::int32_t held = 0;
  for (const auto& kv : cache.references()) held += kv.second > 0 ? 1 : 0;
  REQUIRE(held == cache.held_pages());
}

}  // namespace test
}  // namespace kvkit
