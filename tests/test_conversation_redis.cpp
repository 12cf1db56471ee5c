// ConversationCache spill -> restore through a real redis-server (RedisBackend): a
// conversation evicted under allocator pressure is saved as blocks, its pages go back to the
// pool, and its next turn restores them and decodes what recomputing the whole history
// decodes. Uses $KVKIT_REDIS_URL when set (scripts/test.sh starts one), else a private
// server on a free loopback port (tests/redis_server.hpp); skips, saying why, without a
// redis-server binary.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "conversation_fixture.hpp"
#include "kvkit/conversation/conversation_cache.hpp"
#include "kvkit/store/redis_store.hpp"
#include "redis_server.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::engine;
using namespace kvkit::conversation;

TEST_CASE("spill to redis under pressure, restore on resume", "[conversation][redis]") {
  KVKIT_TEST_RNG(rng);
  std::unique_ptr<kvkit_test::RedisServer> own;
  store::RedisOptions ro;
  if (const char* url = std::getenv("KVKIT_REDIS_URL")) {
    REQUIRE(store::parse_redis_url(url, &ro).is_ok());
    ro = kvkit_test::with_test_timeouts(ro);
  } else {
    own = std::make_unique<kvkit_test::RedisServer>();
    if (!own->running()) {
      WARN("skipped: no redis-server binary on PATH (or it did not start)");
      return;
    }
    ro = own->options();
  }
  store::RedisBackend backend(ro);
  REQUIRE(backend.connect().is_ok());

  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  const std::int32_t vocab = ck->config().vocab_size;
  EngineOptions o;
  o.page_size = 8;
  o.num_pages = 3;  // room for one conversation: each turn of the other forces a spill
  o.max_batch = 2;
  o.shuffle_seed = 3;
  Engine eng(ck, o);
  EngineConversationHost host(eng);
  const store::BlockStoreConfig sc = kvkit::test::store_config(
      ck->config(), o.page_size, store::make_namespace(name, "conversation-redis-" + std::to_string(rng())));
  store::BlockStore<float> bs(backend, sc);
  Params p;
  p.spill = true;
  ConversationCache<float> cache(host, p, {}, &bs);
  eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });

  std::vector<std::vector<std::int32_t>> history(2, std::vector<std::int32_t>{kBosToken});
  for (int round = 0; round < 2; ++round)
    for (int c = 0; c < 2; ++c) {
      const std::string id = "conv" + std::to_string(c);
      INFO(id << " round " << round);
      std::vector<std::int32_t> prompt = history[static_cast<std::size_t>(c)];
      const auto user = kvkit::test::random_tokens(6, vocab, rng);
      prompt.insert(prompt.end(), user.begin(), user.end());
      Resume r;
      const SeqId s = start_turn(eng, cache, id, prompt, &r);
      if (round == 1) {
        // The other conversation's turn evicted this one to redis; all of it came back.
        CHECK(r.restored_tokens == static_cast<std::int32_t>(history[static_cast<std::size_t>(c)].size()) - 1);
        CHECK(r.cached_len == r.restored_tokens);
      }
      const kvkit::test::TurnOut got = kvkit::test::decode_turn(eng, s, 6, false);
      Engine ref_eng(ck, o);
      const SeqId rs = ref_eng.add_sequence(prompt);
      const kvkit::test::TurnOut ref = kvkit::test::decode_turn(ref_eng, rs, 6, false);
      CHECK(got.tokens == ref.tokens);
      for (std::size_t i = 0; i < got.logits.size(); ++i) CHECK(got.logits[i] == ref.logits[i]);
      history[static_cast<std::size_t>(c)] = eng.tokens(s);
      finish_turn(eng, cache, id, s);
      kvkit::test::check_invariants(eng, cache);
    }
  const Metrics& m = cache.metrics();
  CHECK(m.spills >= 2);
  CHECK(m.restores == 2);
  CHECK(m.evictions_by[static_cast<int>(EvictReason::kPressure)] >= 2);
  cache.end("conv0");
  cache.end("conv1");
  CHECK(eng.pages_in_use() == 0);
}
