#pragma once
// Shared helpers of the ConversationCache tests (test_conversation_cache.cpp and the
// Redis spill test): models, a turn runner and the allocator invariant check.

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/conversation_host.hpp"
#include "engine/engine.hpp"
#include "engine_runs.hpp"  // stories_or_synthetic
#include "kvkit/store/block_store.hpp"

namespace kvkit {
namespace test {

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

/// A BlockStore configuration for the engine's model with pages of `page_size` tokens.
inline store::BlockStoreConfig store_config(const engine::ModelConfig& c, std::int32_t page_size,
                                            const std::string& ns) {
  store::BlockStoreConfig sc;
  sc.ns = ns;
  sc.num_layers = c.n_layers;
  sc.page_size = page_size;
  sc.num_kv_heads = c.n_kv_heads;
  sc.head_dim = c.head_dim();
  return sc;
}

/// The running turns and known ids of a randomized lifecycle test, and the operations the
/// lifecycle tests (with and without prefix sharing) share: kind 1 next turn (sometimes
/// diverging), 2 decode a few tokens (may reclaim), 3 finish the turn, 4 fork, 5 end,
/// 6 evict, 7 reclaim. apply() returns false for any other kind, or when the operation does
/// not apply (no such running turn, three turns running): the caller does its own then.
struct RandomLifecycle {
  std::map<std::string, engine::SeqId> running;
  std::vector<std::string> ids;
  int next_id = 0;

  bool apply(int kind, const std::string& pick, engine::Engine& eng,
             conversation::ConversationCache<float>& cache, std::mt19937_64& rng) {
    const std::int32_t vocab = eng.config().vocab_size, seq_len = eng.config().seq_len;
    if (kind == 1 && running.count(pick) == 0 && running.size() < 3) {
      std::vector<std::int32_t> prompt = cache.tokens(pick);
      if (!prompt.empty() && rng() % 4 == 0) prompt.resize(rng() % prompt.size());  // diverge
      const auto more = random_tokens(1 + rng() % 8, vocab, rng);
      prompt.insert(prompt.end(), more.begin(), more.end());
      if (static_cast<std::int32_t>(prompt.size()) + 8 < seq_len)
        running[pick] = engine::start_turn(eng, cache, pick, prompt);
    } else if (kind == 2 && running.count(pick)) {
      for (int i = 0; i < 1 + static_cast<int>(rng() % 6); ++i)
        if (!eng.try_step().is_ok()) break;
    } else if (kind == 3 && running.count(pick)) {
      const engine::SeqId s = running[pick];
      if (rng() % 2 == 0 && eng.position(s) + 1 < static_cast<std::int32_t>(eng.tokens(s).size()))
        eng.prefill(s);
      engine::finish_turn(eng, cache, pick, s);
      running.erase(pick);
    } else if (kind == 4) {
      cache.fork(pick, "c" + std::to_string(next_id));
      ids.push_back("c" + std::to_string(next_id++));
    } else if (kind == 5) {
      if (running.count(pick)) {
        eng.free_sequence(running[pick]);
        running.erase(pick);
      }
      cache.end(pick);
      ids.erase(std::find(ids.begin(), ids.end(), pick));
    } else if (kind == 6) {
      cache.evict(pick);
    } else if (kind == 7) {
      cache.reclaim(static_cast<std::int32_t>(rng() % 8));
    } else {
      return false;
    }
    return true;
  }
};

}  // namespace test
}  // namespace kvkit
