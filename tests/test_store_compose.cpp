// The BlockStore beside the policies that move tokens (StoreConnector with StreamingLLM,
// R1KV, r1kv+eps and kvchan attached to the same engine). None of them calls the
// connector: it learns which pages changed only from the engine's page events
// (notify_rewrite, truncate_kv) and the kv_len / position split, and must then save only
// blocks that hold exactly what the model computes for their tokens. Checked here, on a
// run long enough for several compactions (or kvchan packs):
//  - a fresh engine without the token-moving policy loads every block the run saved (a
//    warm start on the run's tokens), and every loaded block equals, bit for bit in every
//    layer, K and V, the page an engine with the run's attention (dense, or EPS for
//    r1kv+eps) computes for the same tokens one step at a time;
//  - blocks are saved (a save before the first compaction finds every full page clean;
//    with sinks that fill whole pages, StreamingLLM's sinks are saved at the end too), so
//    the test would notice a connector that saved nothing, and nothing past the first
//    compaction is;
//  - decoding on from the warm start gives that engine's logits, bit for bit.
// Runs on stories260K when present, else on the synthetic checkpoint of the same shape.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/composite_policy.hpp"
#include "engine/engine.hpp"
#include "engine/eps_policy.hpp"
#include "engine/kvchan_policy.hpp"
#include "engine/r1kv_policy.hpp"
#include "engine/store_connector.hpp"
#include "engine_runs.hpp"
#include "kvkit/store/block_store.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::engine;

namespace {

constexpr std::int32_t kPage = 8;
constexpr std::int32_t kMidSave = 24;  // position of the mid-run save

EngineOptions store_engine_options() {
  EngineOptions o;
  o.page_size = kPage;
  o.max_batch = 2;
  o.shuffle_seed = 5;  // physical page ids out of order
  return o;
}

std::unique_ptr<EnginePolicy> attention_part(const std::string& name);

std::unique_ptr<EnginePolicy> make_policy(const std::string& name) {
  CompressorPolicyOptions c;
  c.params.budget = 32;
  c.params.buffer = 16;
  if (name == "streaming") {
    c.params.sinks = 2 * kPage;  // two whole pages never move
    return std::make_unique<StreamingLLMPolicy>(c);
  }
  if (name == "r1kv") return std::make_unique<R1KVPolicy>(c);
  if (name == "r1kv+eps") {
    std::vector<std::unique_ptr<EnginePolicy>> parts;
    parts.push_back(std::make_unique<R1KVPolicy>(c));
    parts.push_back(attention_part(name));
    return std::make_unique<CompositePolicy>(std::move(parts));
  }
  KvchanOptions k;  // tiny stability settings so it packs within the run
  k.params.r_k = 4;
  k.params.r_v = 6;
  k.params.window = 8;
  k.params.t_update = 4;
  k.params.n_stable = 2;
  k.params.ema_decay = 0.5f;
  k.params.min_retention = 0.5;
  k.params.min_stable_fraction = 0.5;  // pack once half the heads are stable: soon on any prompt
  k.params.check_every = 0;
  return std::make_unique<KvchanPolicy>(k);
}

// What the reference engines attach: the part of `name` that changes the attention
// call (EPS skips pages whose certified mass is below eps, so the K/V it leads to are what
// the engine with EPS computes, and a block saved from such a run matches only that; an
// engine mixing attention settings would give each its own store namespace).
std::unique_ptr<EnginePolicy> attention_part(const std::string& name) {
  if (name != "r1kv+eps") return nullptr;
  sketch::SketchParams e;
  e.strict = true;
  e.eps = 1e-3;
  return std::make_unique<EpsPolicy>(e);
}

// K and V of page `page` in every layer (the whole page, all slots and heads).
std::vector<float> page_contents(Engine& eng, std::int32_t page) {
  std::vector<float> out;
  const std::int64_t n = eng.strides().page;
  for (int l = 0; l < eng.config().n_layers; ++l) {
    out.insert(out.end(), eng.k_pool(l) + page * n, eng.k_pool(l) + (page + 1) * n);
    out.insert(out.end(), eng.v_pool(l) + page * n, eng.v_pool(l) + (page + 1) * n);
  }
  return out;
}

}  // namespace

TEST_CASE("store beside token-moving policies: every saved block is what the model computes", "[store][compose]") {
  const auto ck = test::stories_or_synthetic();
  const std::string name = GENERATE(as<std::string>{}, "streaming", "r1kv", "r1kv+eps", "kvchan");
  INFO("policy " << name);
  KVKIT_TEST_RNG(rng);
  std::uniform_int_distribution<std::int32_t> tok(3, ck->config().vocab_size - 1);
  std::vector<std::int32_t> prompt(20);
  for (auto& t : prompt) t = tok(rng);
  store::MemoryBackend mem(256u << 20);
  StoreConnectorOptions so;
  so.ns = store::make_namespace("compose-" + name);

  // The policy run: the connector only saves (lookup off), the policy moves tokens.
  Engine run(ck, store_engine_options());
  so.lookup = false;
  StoreConnector run_conn(run, mem, so);
  const std::unique_ptr<EnginePolicy> policy = make_policy(name);
  policy->attach(run);
  const SeqId id = run_conn.start(prompt).id;
  // An engine may save a live sequence's blocks at any time (finish() does not free it):
  // once before the Compressor's first compaction (at budget + buffer = 48 tokens), when
  // every full page is still what the model computed, and again at the end.
  std::int32_t saved = 0, moved_at_mid = 0;
  // At least 110 positions, and on until the policy moved tokens (kvchan packs once its
  // channel sets are stable, which takes longer on some prompts).
  while (run.position(id) < 110 || (run.kv_len(id) == run.position(id) && run.position(id) < 400)) {
    run.step();
    if (run.position(id) == kMidSave) {
      moved_at_mid = run.position(id) - run.kv_len(id);
      const StoreFinish mid = run_conn.finish(id);
      REQUIRE(mid.status.is_ok());
      saved += mid.saved_blocks;
    }
  }
  REQUIRE(run.kv_len(id) < run.position(id));  // the policy moved tokens out
  const std::vector<std::int32_t> tokens = run.processed_tokens(id);
  const StoreFinish fin = run_conn.finish(id);
  REQUIRE(fin.status.is_ok());
  saved += fin.saved_blocks;
  run.free_sequence(id);
  const std::int32_t full_blocks = static_cast<std::int32_t>(tokens.size()) / kPage;
  CHECK(saved < full_blocks);  // blocks past the first compaction are not saved
  if (moved_at_mid == 0) CHECK(saved >= kMidSave / kPage);  // the mid-run save found clean pages
  if (name != "kvchan") CHECK(moved_at_mid == 0);
  if (name == "streaming") CHECK(saved >= 2);  // the sink pages never moved

  // The reference: one step per token, as the run computed its first pages, with the
  // run's attention (the policy-free dense kernel, or EPS).
  Engine ref(ck, store_engine_options());
  const std::unique_ptr<EnginePolicy> ref_attention = attention_part(name);
  if (ref_attention) ref_attention->attach(ref);
  const SeqId rid = ref.add_sequence(tokens);
  for (std::size_t i = 0; i < tokens.size(); ++i) ref.step();

  // A warm start on the run's tokens (no token-moving policy) loads every saved block.
  Engine warm(ck, store_engine_options());
  const std::unique_ptr<EnginePolicy> warm_attention = attention_part(name);
  if (warm_attention) warm_attention->attach(warm);
  so.lookup = true;
  StoreConnector warm_conn(warm, mem, so);
  const StoreStart st = warm_conn.start(tokens);
  REQUIRE(st.load_status.is_ok());
  CHECK(st.loaded_blocks == saved);
  for (std::int32_t i = 0; i < st.loaded_blocks; ++i) {
    INFO("block " << i);
    REQUIRE(page_contents(warm, warm.pages(st.id)[static_cast<std::size_t>(i)]) ==
            page_contents(ref, ref.pages(rid)[static_cast<std::size_t>(i)]));
  }
  // Decoding on from the loaded blocks gives the reference's logits bit for bit.
  while (warm.position(st.id) < static_cast<std::int32_t>(tokens.size())) warm.step();
  CHECK(warm.last_logits(st.id) == ref.last_logits(rid));
}
