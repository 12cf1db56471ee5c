// ConversationCache cross-conversation prefix sharing (Params::share_prefixes,
// kvkit/conversation/conversation_cache.hpp): full pages whose chained token hash matches
// the prefix of a new (or evicted) conversation's prompt are shared by refcount, counted
// once against the page budget; a page is shared only when the whole chain up to it
// matches; evicting one sharer keeps the other's pages; reclaim prefers a conversation
// whose eviction frees pages; decoding on shared pages is bit-exact with recomputing (the
// stepwise path, same arithmetic); randomized lifecycles with sharing keep every page's
// refcount equal to its holders after every operation and leak nothing.

#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "conversation_fixture.hpp"
#include "kvkit/conversation/conversation_cache.hpp"
#include "kvkit/store/block_store.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::engine;
using namespace kvkit::conversation;
using kvkit::test::check_invariants;
using kvkit::test::decode_turn;
using kvkit::test::random_tokens;
using kvkit::test::TurnOut;

namespace {

Params sharing() {
  Params p;
  p.share_prefixes = true;
  return p;
}

EngineOptions opts(std::int32_t page_size, std::int32_t num_pages) {
  EngineOptions o;
  o.page_size = page_size;
  o.num_pages = num_pages;
  o.max_batch = 4;
  o.shuffle_seed = 11;
  return o;
}

std::vector<std::int32_t> cat(std::vector<std::int32_t> a, const std::vector<std::int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A turn on a bare allocator: the request's pages are the handed ones plus fresh pages for
// the rest of `tokens`; the cache keeps them, the request's references go.
void bare_turn(BlockAllocator& alloc, ConversationCache<float>& cache, const std::string& id,
               const std::vector<std::int32_t>& tokens, Resume r) {
  std::vector<std::int32_t> pages = r.pages;
  while (pages.size() * 4 < tokens.size()) pages.push_back(alloc.allocate());
  cache.suspend(id, tokens, pages);
  for (std::int32_t pg : pages) alloc.release(pg);
}

}  // namespace

TEST_CASE("shared prefix pages are refcounted and counted once against the budget", "[conversation][sharing]") {
  KVKIT_TEST_RNG(rng);
  BlockAllocator alloc(64);
  AllocatorPageHost host(alloc, 4);
  ConversationCache<float> cache(host, sharing());
  const auto system = random_tokens(8, 500, rng);  // two full pages of page size 4
  const auto a_tokens = cat(system, random_tokens(3, 500, rng));
  // The first conversation finds nothing and indexes its full pages.
  Resume ra = cache.create("a", a_tokens);
  CHECK(ra.pages.empty());
  CHECK(ra.cached_len == 0);
  bare_turn(alloc, cache, "a", a_tokens, ra);
  const std::vector<std::int32_t> ap = cache.pages("a");
  REQUIRE(ap.size() == 3);
  CHECK(cache.indexed_pages() == 2);  // the partial last page is not indexed
  CHECK(alloc.refcount(ap[0]) == 2);  // a's reference + the index's
  CHECK(alloc.refcount(ap[2]) == 1);
  CHECK(cache.held_references() == 3);

  // A second conversation with the same system prompt takes its two pages.
  const auto b_prompt = cat(system, random_tokens(5, 500, rng));
  Resume rb = cache.create("b", b_prompt);
  REQUIRE(rb.pages == std::vector<std::int32_t>{ap[0], ap[1]});
  CHECK(rb.cached_len == 8);
  CHECK(alloc.refcount(ap[0]) == 3);  // a, the index, b's request
  CHECK(cache.sharers(ap[0]) == 2);
  CHECK(cache.metrics().shared_pages == 2);
  CHECK(cache.metrics().shared_tokens == 8);
  bare_turn(alloc, cache, "b", b_prompt, rb);
  const std::vector<std::int32_t> bp = cache.pages("b");
  REQUIRE(bp.size() == 4);
  CHECK(bp[0] == ap[0]);
  CHECK(bp[1] == ap[1]);
  CHECK(alloc.refcount(ap[0]) == 3);  // a, b, the index
  // Distinct pages: 2 shared + a's partial + b's third (full, indexed) and partial page.
  CHECK(cache.held_pages() == 5);
  CHECK(cache.held_references() == 5);
  CHECK(alloc.pages_in_use() == 5);

  // A page is shared only when the whole chain up to it matches: the same second page
  // after a different first page is not found.
  std::vector<std::int32_t> other = random_tokens(4, 500, rng);
  other.insert(other.end(), system.begin() + 4, system.end());
  other.push_back(7);
  Resume rc = cache.create("c", other);
  CHECK(rc.pages.empty());
  cache.abort_turn("c");
  cache.end("c");

  SECTION("the budget counts a shared page once") {
    BlockAllocator a2(64);
    AllocatorPageHost h2(a2, 4);
    Params p = sharing();
    p.page_budget = 5;
    ConversationCache<float> c2(h2, p);
    bare_turn(a2, c2, "a", a_tokens, c2.create("a", a_tokens));
    bare_turn(a2, c2, "b", b_prompt, c2.create("b", b_prompt));
    CHECK(c2.held_references() == 5);  // without sharing: 3 + 4 = 7 > 5, a would go
    CHECK(c2.state("a") == State::kSuspended);
    CHECK(c2.metrics().evictions == 0);
  }
  SECTION("evicting one sharer keeps the other's pages") {
    CHECK(cache.evict("a") == 1);  // only a's partial page was a's alone
    CHECK(cache.state("a") == State::kEvicted);
    CHECK(cache.pages("b") == bp);
    CHECK(alloc.refcount(ap[0]) == 2);  // b + the index
    CHECK(cache.sharers(ap[0]) == 1);
    // a's next turn finds its full pages in the index (b holds them).
    const auto a_next = cat(a_tokens, random_tokens(4, 500, rng));
    Resume r = cache.resume("a", a_next);
    CHECK(r.pages == std::vector<std::int32_t>{ap[0], ap[1]});
    CHECK(r.cached_len == 8);  // the partial page went with the eviction
    bare_turn(alloc, cache, "a", a_next, r);
    CHECK(cache.pages("a")[0] == ap[0]);
    CHECK(cache.sharers(ap[0]) == 2);
  }
  SECTION("pressure prefers a conversation whose eviction frees pages") {
    // A third conversation whose pages are all b's: evicting it would free nothing.
    const std::vector<std::int32_t> d_tokens(b_prompt.begin(), b_prompt.begin() + 12);
    Resume rd = cache.create("d", cat(d_tokens, {3}));
    CHECK(rd.pages.size() == 3);
    std::vector<std::int32_t> pages = rd.pages;
    cache.suspend("d", d_tokens, pages);
    for (std::int32_t pg : pages) alloc.release(pg);
    // b's next turn (its partial page fills to 3 tokens) makes d the least recent.
    const auto b_next = cat(b_prompt, random_tokens(2, 500, rng));
    bare_turn(alloc, cache, "b", b_next, cache.resume("b", b_next));
    CHECK(cache.pages("b").size() == 4);
    cache.evict("a");
    CHECK(cache.lru_order() == std::vector<std::string>{"d", "b"});
    // d's pages are all b's too, so evicting it would free nothing: b, more recent but
    // alone on its partial page, goes instead.
    CHECK(cache.reclaim(1) == 1);
    CHECK(cache.state("b") == State::kEvicted);
    CHECK(cache.state("d") == State::kSuspended);
    CHECK(cache.pages("d") == std::vector<std::int32_t>{bp[0], bp[1], bp[2]});
    CHECK(cache.unused_pages() == 0);
    // Now d holds every indexed page alone: evicting it queues them, reclaim frees them
    // tail first.
    CHECK(cache.reclaim(1) == 1);
    CHECK(cache.state("d") == State::kEvicted);
    CHECK(cache.indexed_pages() == 2);
    CHECK(alloc.refcount(bp[2]) == 0);
    CHECK(cache.release_unused() == 2);
    CHECK(alloc.pages_in_use() == 0);
  }
  for (const char* id : {"a", "b", "d"})
    if (cache.contains(id)) cache.end(id);
  cache.release_unused();
  CHECK(alloc.pages_in_use() == 0);
}

TEST_CASE("decoding on shared prefix pages is exactly recomputing", "[conversation][sharing]") {
  KVKIT_TEST_RNG(rng);
  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  INFO(name);
  const std::int32_t vocab = ck->config().vocab_size;
  const EngineOptions o = opts(8, 256);
  Engine eng(ck, o);
  EngineConversationHost host(eng);
  ConversationCache<float> cache(host, sharing());
  eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
  std::vector<std::int32_t> system{kBosToken};
  const auto sys_more = random_tokens(20 + rng() % 12, vocab, rng);  // 2-4 full pages
  system.insert(system.end(), sys_more.begin(), sys_more.end());
  auto recompute = [&](const std::vector<std::int32_t>& prompt) {
    Engine ref(ck, o);
    const SeqId s = ref.add_sequence(prompt);
    return decode_turn(ref, s, 6, false);
  };
  std::map<std::string, std::vector<std::int32_t>> history;
  // Three conversations with the system prompt, two turns each, interleaved; between the
  // rounds one of them is evicted and comes back through the index.
  for (int turn = 0; turn < 3; ++turn) {
    for (const char* id : {"x", "y", "z"}) {
      INFO("turn " << turn << " conversation " << id);
      std::vector<std::int32_t> prompt = turn == 0 ? system : history[id];
      auto user = random_tokens(3 + rng() % 9, vocab, rng);
      if (turn == 0) user[0] = id[0];  // first turns differ right after the system prompt
      prompt.insert(prompt.end(), user.begin(), user.end());
      Resume r;
      const SeqId s = start_turn(eng, cache, id, prompt, &r);
      if (turn == 0 && std::string(id) != "x")
        CHECK(r.cached_len == static_cast<std::int32_t>((system.size() / 8) * 8));
      const TurnOut got = decode_turn(eng, s, 6, false);
      const TurnOut ref = recompute(prompt);
      REQUIRE(got.tokens == ref.tokens);
      for (std::size_t i = 0; i < got.logits.size(); ++i) CHECK(got.logits[i] == ref.logits[i]);
      history[id] = eng.tokens(s);
      finish_turn(eng, cache, id, s);
      check_invariants(eng, cache);
    }
    if (turn == 1) {
      cache.evict("y");  // y's shared pages stay (x and z hold them)
      check_invariants(eng, cache);
      CHECK(cache.state("x") == State::kSuspended);
    }
  }
  const Metrics& m = cache.metrics();
  CHECK(m.shared_pages >= 2 * (system.size() / 8) + system.size() / 8);  // y, z at create; y again
  for (const char* id : {"x", "y", "z"}) cache.end(id);
  CHECK(eng.pages_in_use() == 0);
  check_invariants(eng, cache);
}

TEST_CASE("randomized lifecycles with prefix sharing keep every refcount equal to its holders",
          "[conversation][sharing]") {
  KVKIT_TEST_RNG(rng);
  auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  const std::int32_t vocab = ck->config().vocab_size;
  // A few shared "system prompts" (1 to 3 full pages) so conversations do share pages.
  std::vector<std::vector<std::int32_t>> systems;
  for (int i = 0; i < 3; ++i) systems.push_back(random_tokens(4 * (1 + i) + rng() % 3, vocab, rng));
  for (int spill = 0; spill < 2; ++spill) {
    INFO("spill " << spill);
    Engine eng(ck, opts(4, 40));
    EngineConversationHost host(eng);
    store::MemoryBackend backend(8 << 20);
    store::BlockStore<float> bs(backend, kvkit::test::store_config(ck->config(), 4, "randomized-sharing"));
    double now = 0;
    Params p = sharing();
    p.idle_timeout_s = 100;
    p.max_active = 6;
    p.page_budget = 30;
    p.spill = spill == 1;
    p.fork_copies_partial_page = rng() % 2 == 0;
    p.trim_under_pressure = rng() % 3 == 0;
    INFO("fork copies " << p.fork_copies_partial_page << " trim " << p.trim_under_pressure);
    ConversationCache<float> cache(host, p, [&] { return now; }, &bs);
    eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
    kvkit::test::RandomLifecycle ops;
    std::map<std::string, SeqId>& running = ops.running;
    std::vector<std::string>& ids = ops.ids;
    // Start with two conversations on the longest system prompt: the second shares its
    // full pages (then the random operations take over).
    for (const char* id : {"w0", "w1"}) {
      const std::vector<std::int32_t> prompt = cat(systems[2], {static_cast<std::int32_t>(3 + ids.size())});
      Resume r;
      running[id] = start_turn(eng, cache, id, prompt, &r);
      CHECK(r.cached_len == (ids.empty() ? 0 : 12));
      ids.push_back(id);
      if (ids.size() == 1) {
        eng.prefill(running[id]);
        finish_turn(eng, cache, id, running[id]);
        running.erase(id);
      }
      check_invariants(eng, cache);
    }
    CHECK(cache.metrics().shared_pages == 3);
    for (int op = 0; op < 500; ++op) {
      now += static_cast<double>(rng() % 7);
      const int kind = static_cast<int>(rng() % 10);
      std::string pick = ids.empty() ? std::string("none") : ids[rng() % ids.size()];
      if ((kind == 2 || kind == 3) && !running.empty()) {  // turns get finished more often
        auto it = running.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % running.size()));
        pick = it->first;
      }
      INFO("op " << op << " kind " << kind << " id " << pick);
      try {
        if (kind == 0 || ids.empty()) {  // a new conversation, often with a shared prefix
          if (running.size() < 3) {
            const std::string id = "c" + std::to_string(ops.next_id++);
            std::vector<std::int32_t> prompt;
            if (rng() % 4 != 0) prompt = systems[rng() % systems.size()];
            const auto more = random_tokens(1 + rng() % 6, vocab, rng);
            prompt.insert(prompt.end(), more.begin(), more.end());
            running[id] = start_turn(eng, cache, id, prompt);
            ids.push_back(id);
          }
        } else if (!ops.apply(kind, pick, eng, cache, rng)) {
          if (kind == 8 && rng() % 4 == 0)
            cache.release_unused();
          else
            cache.evict_idle();
        }
      } catch (const Error& e) {
        INFO(e.what());  // refused calls (fork of a running turn, out of pages, ...) change nothing
      }
      check_invariants(eng, cache);
      // Each indexed page counts at least its suspended holders; the budget holds.
      std::map<std::int32_t, std::int32_t> suspended_holders;
      for (const std::string& id : ids) {
        const State st = cache.state(id);
        CHECK((st == State::kRunning) == (running.count(id) == 1));
        if (st != State::kSuspended) CHECK(cache.pages(id).empty());
        for (std::int32_t pg : cache.pages(id)) ++suspended_holders[pg];
      }
      for (const auto& kv : suspended_holders)
        if (cache.sharers(kv.first) > 0) CHECK(cache.sharers(kv.first) >= kv.second);
      CHECK(cache.unused_pages() <= cache.indexed_pages());
      CHECK(cache.active() == static_cast<std::int32_t>(running.size()) + cache.suspended());
    }
    const Metrics& m = cache.metrics();
    CHECK(m.resumes > 0);
    CHECK(m.evictions > 0);
    CHECK(m.shared_pages > 0);
    for (auto& kv : running) eng.free_sequence(kv.second);
    for (const std::string& id : ids) cache.end(id);
    cache.release_unused();
    CHECK(cache.indexed_pages() == 0);
    CHECK(eng.pages_in_use() == 0);
    check_invariants(eng, cache);
  }
}
