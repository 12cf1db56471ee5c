// The store-demo workload and the engine's StoreConnector: a cold run saves the full
// blocks of a shared-prefix workload, a fresh engine loads them through the prefix-page
// start, and its greedy outputs equal the store-free run's token for token (memory store
// always; a private redis-server when one is installed; stories260K and SmolLM2 when their
// files exist). A corrupted stored block is a miss (recomputed, then repaired by the save),
// and pages a policy rewrote (notify_rewrite, truncate_kv) are never saved.
#include <catch2/catch.hpp>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli/store_demo.hpp"
#include "engine/checkpoint.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "kvkit/store/block_store.hpp"
#include "test_scale.hpp"
#if defined(KVKIT_TEST_REDIS)
#include "redis_server.hpp"
#endif

using namespace kvkit;
using namespace kvkit::engine;

namespace {

const std::string kStoriesPath = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
const std::string kSmolPath = std::string(KVKIT_MODEL_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

bool file_exists(const std::string& p) { return std::ifstream(p).good(); }

// The workloads: a shared prefix of kPrefix tokens (17 pages of 16, 9 under the sanitizers)
// and kRequests requests with their own suffixes.
constexpr std::int32_t kPrefix = kvkit::test::scaled(272, 144);
constexpr std::int32_t kRequests = kvkit::test::scaled(4, 2);

// Baseline (no store), cold (save only) and warm (fresh engine, load) runs over `backend`.
struct ThreeRuns {
  DemoRun base, cold, warm;
};

ThreeRuns run_three(std::shared_ptr<const Checkpoint> ck, const DemoWorkload& w, store::BlockBackend& backend,
                    const std::string& ns, std::int32_t max_tokens, std::int32_t stop = -1,
                    DType kv_dtype = DType::kFloat32) {
  DemoRunConfig cfg;
  cfg.engine.page_size = 16;
  cfg.engine.kv_dtype = kv_dtype;
  cfg.max_tokens = max_tokens;
  cfg.stop_token = stop;
  ThreeRuns r;
  r.base = run_demo_workload(ck, w, cfg);
  cfg.backend = &backend;
  cfg.store.ns = ns;
  cfg.store.lookup = false;
  r.cold = run_demo_workload(ck, w, cfg);
  cfg.store.lookup = true;
  r.warm = run_demo_workload(ck, w, cfg);
  return r;
}

void check_warm(const ThreeRuns& r, const DemoWorkload& w, std::int32_t P) {
  REQUIRE(same_outputs(r.base, r.cold));
  REQUIRE(same_outputs(r.base, r.warm));
  CHECK(r.cold.hit_tokens == 0);
  CHECK(r.cold.blocks_saved > 0);
  CHECK(r.warm.blocks_saved == 0);  // everything was stored by the cold run
  std::int32_t want = 0;
  for (const DemoRequest& q : w.requests) want += static_cast<std::int32_t>((q.prompt.size() - 1) / P) * P;
  CHECK(r.warm.hit_tokens == want);
  CHECK(r.warm.prefill_tokens_avoided == want);
  for (const DemoRequestResult& q : r.warm.requests) CHECK(q.load_error.empty());
}

}  // namespace

TEST_CASE("store demo: synthetic model, memory store: warm run equals the store-free run", "[store_demo]") {
  auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  const DemoWorkload w = token_workload(ck->config().vocab_size, kPrefix, kRequests);
  REQUIRE(w.shared_prefix_tokens >= kPrefix - 16);
  store::MemoryBackend mem(64u << 20);
  const ThreeRuns r = run_three(ck, w, mem, store::make_namespace("synthetic"), 12);
  check_warm(r, w, 16);
  // The shared prefix blocks saved once, plus each request's own full blocks.
  CHECK(r.cold.blocks_saved >= kPrefix / 16);
  CHECK(r.cold.requests[1].saved_blocks < r.cold.requests[0].saved_blocks);
}

TEST_CASE("store demo: 16-bit pages store 16-bit blocks (half the bytes); another dtype's blocks are a miss",
          "[store_demo][kv_dtype]") {
  auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  const DemoWorkload w = token_workload(ck->config().vocab_size, kPrefix, kRequests, 5);
  store::MemoryBackend mem32(64u << 20);
  const ThreeRuns r32 = run_three(ck, w, mem32, store::make_namespace("synthetic-f32"), 8);
  check_warm(r32, w, 16);
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    INFO("kv_dtype " << to_string(d));
    store::MemoryBackend mem(64u << 20);
    const std::string ns = store::make_namespace(std::string("synthetic-") + to_string(d));
    const ThreeRuns r = run_three(ck, w, mem, ns, 8, -1, d);
    check_warm(r, w, 16);  // loaded 16-bit blocks give the 16-bit run's own tokens
    CHECK(r.cold.blocks_saved == r32.cold.blocks_saved);
    // Same keys, payloads of half the size (headers and keys are the rest).
    CHECK(mem.used_bytes() < mem32.used_bytes() * 0.55);
    CHECK(mem.used_bytes() > mem32.used_bytes() * 0.45);
    // A float32 engine on the 16-bit namespace: the blocks are there but of another
    // dtype, so the first load is rejected (a miss), recomputed, and the outputs stay exact.
    DemoRunConfig cfg;
    cfg.max_tokens = 8;
    cfg.backend = &mem;
    cfg.store.ns = ns;
    cfg.store.lookup = true;
    const DemoRun cross = run_demo_workload(ck, w, cfg);
    CHECK(same_outputs(r32.base, cross));
    CHECK(cross.requests[0].matched_blocks > 0);
    CHECK(cross.requests[0].loaded_blocks == 0);
    CHECK(cross.requests[0].load_error.find(std::string("block dtype ") + to_string(d)) != std::string::npos);
  }
}

TEST_CASE("store demo: a corrupted stored block is a miss, outputs stay exact, the save repairs it",
          "[store_demo]") {
  auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  const DemoWorkload w = token_workload(ck->config().vocab_size, kPrefix, kRequests, 11);
  store::MemoryBackend mem(64u << 20);
  const std::string ns = store::make_namespace("synthetic-corrupt");
  DemoRunConfig cfg;
  cfg.max_tokens = 10;
  const DemoRun base = run_demo_workload(ck, w, cfg);
  cfg.backend = &mem;
  cfg.store.ns = ns;
  cfg.store.lookup = false;
  const DemoRun cold = run_demo_workload(ck, w, cfg);
  REQUIRE(same_outputs(base, cold));
  // Flip one byte in the middle of layer 1's V rows of shared block 5.
  const auto hashes = prefix_block_hashes(w.requests[0].prompt.data(), 6 * 16, 16);
  const std::string key = store::block_key(ns, 1, hashes[5], store::KVKind::kValue);
  std::string value;
  store::KeyState st = store::KeyState::kMiss;
  REQUIRE(mem.get(&key, 1, &value, &st).is_ok());
  REQUIRE(st == store::KeyState::kHit);
  value[value.size() / 2] ^= 0x10;
  REQUIRE(mem.put(&key, &value, 1, &st).is_ok());

  cfg.store.lookup = true;
  const DemoRun warm = run_demo_workload(ck, w, cfg);
  CHECK(same_outputs(base, warm));
  CHECK(warm.requests[0].matched_blocks > 5);  // present, so matched...
  CHECK(warm.requests[0].loaded_blocks == 5);  // ...but rejected on load: blocks 5.. recomputed
  CHECK_FALSE(warm.requests[0].load_error.empty());
  CHECK(warm.requests[0].saved_blocks > 0);    // block 5 on written again
  for (std::size_t i = 1; i < warm.requests.size(); ++i) {  // later requests load everything
    CHECK(warm.requests[i].load_error.empty());
    CHECK(warm.requests[i].loaded_blocks ==
          static_cast<std::int32_t>((w.requests[i].prompt.size() - 1) / 16));
  }
}

TEST_CASE("store connector: pages rewritten by a policy are not saved", "[store_demo]") {
  auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  store::MemoryBackend mem(64u << 20);
  EngineOptions eo;
  eo.page_size = 8;
  eo.max_batch = 2;
  Engine eng(ck, eo);
  StoreConnectorOptions so;
  so.ns = store::make_namespace("synthetic-taint");
  so.lookup = false;
  StoreConnector conn(eng, mem, so);
  const DemoWorkload w = token_workload(ck->config().vocab_size, 60, 1, 3);
  const std::vector<std::int32_t>& prompt = w.requests[0].prompt;
  auto run_prompt = [&](SeqId id) {
    while (eng.prefill(id, 8 - eng.kv_len(id) % 8) > 0) {
    }
    while (eng.tokens(id).size() == prompt.size()) eng.step();
  };

  SECTION("notify_rewrite taints the page: only the blocks before it are saveable") {
    const SeqId id = conn.start(prompt).id;
    run_prompt(id);
    REQUIRE(conn.saveable_blocks(id) == eng.kv_len(id) / 8);
    eng.make_exclusive(id);
    eng.notify_rewrite(id, {eng.pages(id)[3]}, 2);  // a compaction rewrote page 3 from slot 2
    CHECK(conn.tainted(eng.pages(id)[3]));
    CHECK(conn.saveable_blocks(id) == 3);
    const StoreFinish f = conn.finish(id);
    CHECK(f.status.is_ok());
    CHECK(f.saved_blocks == 3);
    eng.free_sequence(id);
    // A new request with the same prompt finds exactly those 3 blocks.
    const auto hashes = prefix_block_hashes(prompt.data(), prompt.size(), 8);
    CHECK(conn.match_blocks(hashes.data(), hashes.size()) == 3);
  }
  SECTION("truncate_kv at a page boundary (no rewrite event): only the pages kept then") {
    const SeqId id = conn.start(prompt).id;
    run_prompt(id);
    eng.add_step_hook([id](Engine& e, const StepInfo&) {
      if (e.has_sequence(id) && e.kv_len(id) == e.position(id) && e.kv_len(id) >= 48) e.truncate_kv(id, 16);
    });
    for (int i = 0; i < 12; ++i) eng.step();  // cut to 16 tokens, then 2 more pages appended
    REQUIRE(eng.kv_len(id) < eng.position(id));
    REQUIRE(eng.kv_len(id) >= 24);
    CHECK(conn.saveable_blocks(id) == 2);
  }
  SECTION("a copy-on-write copy of a clean page is clean, of a tainted page tainted") {
    const SeqId id = conn.start(prompt).id;
    run_prompt(id);
    const SeqId child = eng.fork_sequence(id);  // copies the partial last page
    CHECK(conn.saveable_blocks(child) == eng.kv_len(child) / 8);
    eng.make_exclusive(id);  // copies every shared full page (clean -> clean)
    CHECK(conn.saveable_blocks(id) == eng.kv_len(id) / 8);
    eng.notify_rewrite(id, {eng.pages(id)[0]}, 0);
    CHECK(conn.saveable_blocks(id) == 0);
    CHECK(conn.saveable_blocks(child) == eng.kv_len(child) / 8);  // its pages were not rewritten
  }
}

TEST_CASE("store demo: stories260K, memory store", "[store_demo]") {
  if (!file_exists(kStoriesPath)) {
    WARN("skipped: no model file " << kStoriesPath);
    return;
  }
  auto ck = std::make_shared<const Checkpoint>(load_checkpoint(kStoriesPath));
  const DemoWorkload w = token_workload(ck->config().vocab_size, kPrefix, kRequests);
  store::MemoryBackend mem(64u << 20);
  const ThreeRuns r = run_three(ck, w, mem, store::make_namespace("stories260K"), 24);
  check_warm(r, w, 16);
}

#if defined(KVKIT_TEST_REDIS)
TEST_CASE("store demo: stories260K on a private redis-server", "[store_demo][redis]") {
  std::shared_ptr<const Checkpoint> ck;
  if (file_exists(kStoriesPath)) {
    ck = std::make_shared<const Checkpoint>(load_checkpoint(kStoriesPath));
  } else {
    WARN("no model file " << kStoriesPath << ": using the synthetic model");
    ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  }
  kvkit_test::RedisServer server;
  if (!server.running()) {
    WARN("skipped: no redis-server binary on PATH");
    return;
  }
  store::RedisBackend redis(server.options());
  const DemoWorkload w = token_workload(ck->config().vocab_size, kPrefix, kRequests);
  const ThreeRuns r = run_three(ck, w, redis, store::make_namespace("stories260K-redis"), 24);
  check_warm(r, w, 16);
  // float16 pages move float16 blocks through the same server.
  const ThreeRuns h = run_three(ck, w, redis, store::make_namespace("stories260K-redis-f16"), 24, -1,
                                DType::kFloat16);
  check_warm(h, w, 16);
}
#endif

TEST_CASE("store demo: SmolLM2, shared document + 2 questions, memory store", "[store_demo][smollm2]") {
  if (!file_exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (run scripts/fetch-model.sh)");
    return;
  }
  const GgufFile g = GgufFile::open(kSmolPath);
  auto ck = std::make_shared<const Checkpoint>(load_gguf_checkpoint(g));
  const Tokenizer tok = Tokenizer::from_gguf(g);
  const ChatTemplate tmpl = ChatTemplate::from_gguf(g);
  // Two of the demo's four questions and few generated tokens keep the test fast; the
  // cold run is the reference: it never reads the store, so it computes exactly what the
  // store-free engine does (the synthetic and stories260K cases check that equality).
  const std::vector<std::string> questions(store_demo_questions().begin(), store_demo_questions().begin() + 2);
  const DemoWorkload w = text_workload(tok, tmpl, kStoreDemoDocument, questions);
  REQUIRE(w.shared_prefix_tokens >= 256);
  store::MemoryBackend mem(256u << 20);
  DemoRunConfig cfg;
  cfg.max_tokens = 4;
  cfg.engine.threads = 2;  // same in both runs, so the GEMM column split is the same too
  cfg.backend = &mem;
  cfg.store.ns = store::make_namespace("smollm2");
  cfg.store.lookup = false;
  const DemoRun cold = run_demo_workload(ck, w, cfg);
  cfg.store.lookup = true;
  const DemoRun warm = run_demo_workload(ck, w, cfg);
  REQUIRE(same_outputs(cold, warm));
  CHECK(cold.blocks_saved > 0);
  CHECK(warm.prefill_tokens_avoided >= 2 * (w.shared_prefix_tokens / 16) * 16);
  for (const DemoRequestResult& q : warm.requests) {
    CHECK(q.load_error.empty());
    CHECK(q.generated.size() == 4);
  }
}
