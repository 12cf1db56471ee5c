// Compressed conversations in the ConversationCache (conversation_cache.hpp's file
// comment): a chat whose sequence R1KV compresses (CompressorPolicy, budget 32, buffer 16,
// pages of 8 tokens) is suspended between turns with the pages of its kept tokens, its
// position and the policy's query window, and resumed at that position:
//  - four turns with suspend / resume decode bit for bit the tokens and logits of one
//    uninterrupted sequence teacher-forced on the same turns (several compressions,
//    counters equal); without the policy's state the resumed run defers and diverges
//    (the comparison can fail);
//  - page accounting: after each suspend the cache holds exactly the compressed
//    sequence's pages (fewer than the history would need), refcounts equal holders, none
//    leaks after end();
//  - a prompt that does not extend the whole history (an edited token, the processed
//    tokens alone, a shorter prefix) is a miss: every page released, the turn recomputes
//    from token 0 and decodes what a fresh run decodes;
//  - share_prefixes never indexes a compressed conversation's pages; a BlockStore spill
//    stores nothing for it and its resume recomputes; trim_under_pressure drops it whole;
//  - bad input throws kvkit::Error naming the value, changing nothing;
//  - a CompositePolicy (r1kv+eps) as the keeper carries its R1KV part's window: the same
//    bit-for-bit comparison with EPS choosing the pages every step.
// Runs on stories260K when present, else on the synthetic checkpoint (a WARN says so).

#include <catch2/catch.hpp>

#include <any>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "conversation_fixture.hpp"
#include "engine/composite_policy.hpp"
#include "engine/eps_policy.hpp"
#include "engine/r1kv_policy.hpp"
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

constexpr std::int32_t kPageSize = 8;
constexpr std::int32_t kBudget = 32;
constexpr std::int32_t kBuffer = 16;

EngineOptions options() {
  EngineOptions o;
  o.page_size = kPageSize;
  o.num_pages = 128;
  o.max_batch = 4;
  o.shuffle_seed = 11;
  return o;
}

CompressorPolicyOptions r1kv_options() {
  CompressorPolicyOptions o;
  o.params.budget = kBudget;
  o.params.buffer = kBuffer;
  return o;
}

std::int32_t pages_for(std::int64_t tokens) {
  return static_cast<std::int32_t>((tokens + kPageSize - 1) / kPageSize);
}

// One engine with R1KV attached.
struct Rig {
  Engine eng;
  R1KVPolicy policy;
  explicit Rig(std::shared_ptr<const Checkpoint> ck) : eng(std::move(ck), options()), policy(r1kv_options()) {
    policy.attach(eng);
  }
};

// A fresh engine + policy fed `prompt` from token 0, decoding `reply` tokens.
TurnOut fresh_run(std::shared_ptr<const Checkpoint> ck, const std::vector<std::int32_t>& prompt,
                  std::int32_t reply) {
  Rig rig(std::move(ck));
  const SeqId s = rig.eng.add_sequence(prompt);
  return decode_turn(rig.eng, s, reply, false);
}

void require_same(const TurnOut& got, const TurnOut& ref) {
  REQUIRE(got.tokens == ref.tokens);
  REQUIRE(got.logits.size() == ref.logits.size());
  for (std::size_t i = 0; i < got.logits.size(); ++i) {
    INFO("reply step " << i);
    REQUIRE(got.logits[i] == ref.logits[i]);
  }
}

// The turn plan: user tokens and reply steps per turn. The processed counts at the suspends
// (61, 97, 127) leave kv_len 45, 33, 47 (32 + (N - 48) % 16): turns 1 and 3 are due for a
// compression within fewer steps than the query window (8), so a resume without the
// policy's window must defer, and one with it must not.
const std::int32_t kUser[4] = {20, 12, 10, 8};
const std::int32_t kReply[4] = {41, 24, 20, 16};

// A first turn (BOS + user tokens) long enough to be compressed, suspended under "c".
// Returns the history (processed tokens + the pending one).
std::vector<std::int32_t> compressed_first_turn(Rig& rig, ConversationCache<float>& cache,
                                                const std::string& id, std::mt19937_64& rng,
                                                std::vector<std::int32_t> prompt = {kBosToken}) {
  const auto u = random_tokens(20, rig.eng.config().vocab_size, rng);
  prompt.insert(prompt.end(), u.begin(), u.end());
  Resume r;
  const SeqId s = start_turn(rig.eng, cache, id, prompt, &r, &rig.policy);
  decode_turn(rig.eng, s, 41, false);
  REQUIRE(rig.eng.kv_len(s) < rig.eng.position(s));
  std::vector<std::int32_t> history = rig.eng.tokens(s);
  finish_turn(rig.eng, cache, id, s, &rig.policy);
  REQUIRE(cache.compressed(id));
  return history;
}

}  // namespace

TEST_CASE("suspended and resumed compressed turns decode exactly what one uninterrupted sequence decodes",
          "[conversation][compressed]") {
  KVKIT_TEST_RNG(rng);
  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  INFO(name);
  const std::int32_t vocab = ck->config().vocab_size;
  std::vector<std::vector<std::int32_t>> user;
  for (std::int32_t u : kUser) user.push_back(random_tokens(static_cast<std::size_t>(u), vocab, rng));

  // Reference: one sequence, never suspended; each turn appended to it (the pending last
  // generated token is fed first, as the resumed prompt does).
  Rig ref(ck);
  std::vector<TurnOut> want;
  std::vector<std::int32_t> first{kBosToken};
  first.insert(first.end(), user[0].begin(), user[0].end());
  const SeqId rs = ref.eng.add_sequence(first);
  for (int t = 0; t < 4; ++t) {
    if (t > 0) ref.eng.append_tokens(rs, user[static_cast<std::size_t>(t)]);
    want.push_back(decode_turn(ref.eng, rs, kReply[t], false));
  }
  REQUIRE(ref.policy.counters().compressions >= 6);
  REQUIRE(ref.policy.counters().deferred_steps == 0);

  for (bool keep_state : {true, false}) {
    INFO("policy state carried: " << keep_state);
    Rig rig(ck);
    EngineConversationHost host(rig.eng);
    ConversationCache<float> cache(host, Params{});
    rig.eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
    SequenceStateKeeper* keeper = keep_state ? &rig.policy : nullptr;
    std::vector<std::int32_t> prompt = first, history;
    std::int32_t kv_before = 0, pos_before = 0;
    bool diverged = false;
    for (int t = 0; t < 4; ++t) {
      INFO("turn " << t);
      if (t > 0) {
        prompt = history;
        prompt.insert(prompt.end(), user[static_cast<std::size_t>(t)].begin(),
                      user[static_cast<std::size_t>(t)].end());
      }
      Resume r;
      const SeqId s = start_turn(rig.eng, cache, "c", prompt, &r, keeper);
      CHECK(r.cached_len == kv_before);
      CHECK(r.position == pos_before);
      CHECK(static_cast<std::int32_t>(r.pages.size()) == pages_for(kv_before));
      CHECK(r.state.has_value() == (t > 0 && keep_state));
      CHECK(rig.eng.position(s) == pos_before);
      CHECK(rig.eng.kv_len(s) == kv_before);
      const TurnOut got = decode_turn(rig.eng, s, kReply[t], false);
      if (keep_state) {
        require_same(got, want[static_cast<std::size_t>(t)]);
      } else {
        diverged = diverged || got.tokens != want[static_cast<std::size_t>(t)].tokens ||
                   got.logits != want[static_cast<std::size_t>(t)].logits;
      }
      history = rig.eng.tokens(s);
      kv_before = rig.eng.kv_len(s);
      pos_before = rig.eng.position(s);
      REQUIRE(kv_before < pos_before);  // every turn ends compressed
      finish_turn(rig.eng, cache, "c", s, keeper);

      // Page accounting: the cache holds the compressed sequence's pages, and only those.
      CHECK(cache.state("c") == State::kSuspended);
      CHECK(cache.compressed("c"));
      CHECK(cache.cached_len("c") == static_cast<std::size_t>(kv_before));
      CHECK(cache.tokens("c").size() == static_cast<std::size_t>(pos_before));
      CHECK(static_cast<std::int32_t>(cache.pages("c").size()) == pages_for(kv_before));
      CHECK(cache.held_pages() == pages_for(kv_before));
      CHECK(cache.held_pages() < pages_for(pos_before));  // what an uncompressed cache holds
      CHECK(rig.eng.pages_in_use() == cache.held_pages());
      check_invariants(rig.eng, cache);
      // The kept state is counted: R1KV's window of layers x window x Hq x D floats.
      const engine::ModelConfig& mc = rig.eng.config();
      const std::int64_t window_bytes = static_cast<std::int64_t>(mc.n_layers) * r1kv_options().params.window *
                                        mc.n_heads * mc.head_dim() * static_cast<std::int64_t>(sizeof(float));
      if (keep_state) {
        CHECK(cache.host_state_bytes() >= window_bytes);
        CHECK(cache.host_state_bytes() < window_bytes + 4096);
      } else {
        CHECK(cache.host_state_bytes() == 0);
      }
    }
    if (keep_state) {
      CHECK(rig.policy.counters().compressions == ref.policy.counters().compressions);
      CHECK(rig.policy.counters().tokens_dropped == ref.policy.counters().tokens_dropped);
      CHECK(rig.policy.counters().deferred_steps == 0);
      CHECK(cache.metrics().compressed_hits == 3);
      CHECK(cache.metrics().tokens_reused == static_cast<std::uint64_t>(61 + 97 + 127));
    } else {
      // Without the window the resumed sequence waits for a fresh one (turns 1 and 3 are due
      // within fewer steps than the window): other slots are kept, so the comparison above
      // would fail.
      CHECK(rig.policy.counters().deferred_steps > 0);
      CHECK(diverged);
    }
    CHECK(history.size() == first.size() - 1 + 41 + 12 + 24 + 10 + 20 + 8 + 16 + 1);
    cache.end("c");
    CHECK(rig.eng.pages_in_use() == 0);
    CHECK(cache.held_pages() == 0);
    CHECK(cache.host_state_bytes() == 0);
    check_invariants(rig.eng, cache);
  }
}

TEST_CASE("a prompt that does not extend a compressed conversation's history is a full recompute",
          "[conversation][compressed]") {
  KVKIT_TEST_RNG(rng);
  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  INFO(name);
  const std::int32_t vocab = ck->config().vocab_size;
  Rig rig(ck);
  EngineConversationHost host(rig.eng);
  ConversationCache<float> cache(host, Params{});
  rig.eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
  const std::vector<std::int32_t> history = compressed_first_turn(rig, cache, "c", rng);
  const std::vector<std::int32_t> processed = cache.tokens("c");
  REQUIRE(processed.size() + 1 == history.size());
  const std::int32_t held = cache.held_pages();
  REQUIRE(held > 0);
  REQUIRE(rig.eng.pages_in_use() == held);

  std::vector<std::int32_t> prompt;
  SECTION("an edited token") {
    prompt = history;
    prompt[prompt.size() / 2] = prompt[prompt.size() / 2] == 5 ? 6 : 5;
    const auto more = random_tokens(9, vocab, rng);
    prompt.insert(prompt.end(), more.begin(), more.end());
  }
  SECTION("the processed tokens alone (no token to feed past them)") {
    prompt = processed;
  }
  SECTION("a shorter prefix and new tokens") {
    prompt.assign(processed.begin(), processed.begin() + 30);
    const auto more = random_tokens(9, vocab, rng);
    prompt.insert(prompt.end(), more.begin(), more.end());
  }
  Resume r;
  const SeqId s = start_turn(rig.eng, cache, "c", prompt, &r, &rig.policy);
  CHECK(r.cached_len == 0);
  CHECK(r.position == 0);
  CHECK(r.pages.empty());
  CHECK_FALSE(r.state.has_value());
  CHECK(rig.eng.position(s) == 0);
  CHECK(rig.eng.pages_in_use() == 0);  // every cached page went back
  CHECK(cache.held_pages() == 0);
  CHECK(cache.metrics().compressed_misses == 1);
  CHECK(cache.metrics().compressed_hits == 0);
  CHECK(cache.metrics().hits == 0);
  CHECK(cache.metrics().tokens_released == processed.size());
  check_invariants(rig.eng, cache);
  const TurnOut got = decode_turn(rig.eng, s, 12, false);
  require_same(got, fresh_run(ck, prompt, 12));
  finish_turn(rig.eng, cache, "c", s, &rig.policy);
  check_invariants(rig.eng, cache);
  cache.end("c");
  CHECK(rig.eng.pages_in_use() == 0);
}

TEST_CASE("compressed conversations are never shared by prefix, spilled or trimmed",
          "[conversation][compressed]") {
  KVKIT_TEST_RNG(rng);
  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  INFO(name);
  const std::int32_t vocab = ck->config().vocab_size;
  Rig rig(ck);
  EngineConversationHost host(rig.eng);
  // A 17-token system prompt: two full pages shared by whoever starts with it.
  std::vector<std::int32_t> system{kBosToken};
  const auto sys = random_tokens(16, vocab, rng);
  system.insert(system.end(), sys.begin(), sys.end());

  SECTION("share_prefixes") {
    Params p;
    p.share_prefixes = true;
    ConversationCache<float> cache(host, p);
    rig.eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
    // "u": short, uncompressed; its two full pages are indexed.
    SeqId s = start_turn(rig.eng, cache, "u", system, nullptr, &rig.policy);
    decode_turn(rig.eng, s, 4, false);
    REQUIRE(rig.eng.kv_len(s) == rig.eng.position(s));
    finish_turn(rig.eng, cache, "u", s, &rig.policy);
    CHECK_FALSE(cache.compressed("u"));
    REQUIRE(cache.indexed_pages() == 2);
    const std::vector<std::int32_t> sys_pages(cache.pages("u").begin(), cache.pages("u").begin() + 2);
    check_invariants(rig.eng, cache);

    // "c" starts on the shared system pages, then R1KV compresses it (the shared pages are
    // copied first): nothing of it is indexed, and it no longer holds the system pages.
    const std::vector<std::int32_t> history = compressed_first_turn(rig, cache, "c", rng, system);
    CHECK(cache.metrics().shared_pages == 2);
    CHECK(rig.policy.counters().pages_copied == 2);  // the two system pages, once
    CHECK(cache.indexed_pages() == 2);
    for (std::int32_t pg : cache.pages("c")) CHECK(cache.sharers(pg) == 0);
    for (std::int32_t pg : sys_pages) CHECK(cache.sharers(pg) == 1);
    check_invariants(rig.eng, cache);

    // "d" opens with c's whole history: only the system pages match the index.
    Resume rd;
    s = start_turn(rig.eng, cache, "d", history, &rd, &rig.policy);
    CHECK(rd.cached_len == 16);
    CHECK(rd.pages == sys_pages);
    decode_turn(rig.eng, s, 4, false);
    finish_turn(rig.eng, cache, "d", s, &rig.policy);
    check_invariants(rig.eng, cache);

    // Evicting "c" drops it; its resume recomputes everything.
    const std::int32_t c_pages = static_cast<std::int32_t>(cache.pages("c").size());
    CHECK(c_pages == pages_for(static_cast<std::int64_t>(cache.cached_len("c"))));
    CHECK(cache.evict("c") == c_pages);  // all its own: nothing shared, nothing queued
    CHECK(cache.metrics().compressed_evictions == 1);
    CHECK(cache.state("c") == State::kEvicted);
    CHECK(cache.tokens("c").empty());
    std::vector<std::int32_t> prompt = history;
    const auto more = random_tokens(5, vocab, rng);
    prompt.insert(prompt.end(), more.begin(), more.end());
    Resume rc;
    s = start_turn(rig.eng, cache, "c", prompt, &rc, &rig.policy);
    CHECK(rc.cached_len == 0);
    CHECK(rc.position == 0);
    CHECK_FALSE(rc.state.has_value());
    require_same(decode_turn(rig.eng, s, 6, false), fresh_run(ck, prompt, 6));
    finish_turn(rig.eng, cache, "c", s, &rig.policy);
    check_invariants(rig.eng, cache);
    for (const char* id : {"u", "c", "d"}) cache.end(id);
    cache.release_unused();
    CHECK(rig.eng.pages_in_use() == 0);
  }

  SECTION("spill to a BlockStore") {
    store::MemoryBackend backend(64 << 20);
    store::BlockStore<float> bs(backend, kvkit::test::store_config(ck->config(), kPageSize,
                                                                  store::make_namespace(name, "compressed")));
    Params p;
    p.spill = true;
    ConversationCache<float> cache(host, p, {}, &bs);
    rig.eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
    const std::vector<std::int32_t> history = compressed_first_turn(rig, cache, "c", rng);
    const std::int32_t held = cache.held_pages();
    CHECK(cache.evict("c") == held);
    CHECK(backend.size() == 0);  // nothing stored for it
    CHECK(cache.metrics().spills == 0);
    CHECK(cache.metrics().compressed_evictions == 1);
    CHECK(cache.state("c") == State::kEvicted);
    CHECK(rig.eng.pages_in_use() == 0);

    // Control: an uncompressed conversation does spill in this setup.
    SeqId s = start_turn(rig.eng, cache, "u", system, nullptr, &rig.policy);
    decode_turn(rig.eng, s, 4, false);
    finish_turn(rig.eng, cache, "u", s, &rig.policy);
    CHECK(cache.evict("u") == 3);
    CHECK(cache.state("u") == State::kSpilled);
    CHECK(backend.size() > 0);
    CHECK(cache.metrics().spills == 1);

    std::vector<std::int32_t> prompt = history;
    const auto more = random_tokens(5, vocab, rng);
    prompt.insert(prompt.end(), more.begin(), more.end());
    Resume rc;
    s = start_turn(rig.eng, cache, "c", prompt, &rc, &rig.policy);
    CHECK(rc.cached_len == 0);
    CHECK(rc.position == 0);
    CHECK(rc.restored_tokens == 0);
    CHECK(cache.metrics().restores == 0);
    require_same(decode_turn(rig.eng, s, 6, false), fresh_run(ck, prompt, 6));
    finish_turn(rig.eng, cache, "c", s, &rig.policy);
    check_invariants(rig.eng, cache);
    cache.end("c");
    cache.end("u");
    CHECK(rig.eng.pages_in_use() == 0);
  }

  SECTION("trim_under_pressure evicts a compressed conversation whole") {
    Params p;
    p.trim_under_pressure = true;
    ConversationCache<float> cache(host, p);
    rig.eng.set_reclaim([&](std::int32_t n) { return cache.reclaim(n); });
    compressed_first_turn(rig, cache, "c", rng);
    const std::int32_t held = cache.held_pages();
    REQUIRE(held >= 2);
    CHECK(cache.reclaim(1) == held);
    CHECK(cache.state("c") == State::kEvicted);
    CHECK(cache.metrics().pages_trimmed == 0);
    CHECK(cache.metrics().compressed_evictions == 1);
    CHECK(rig.eng.pages_in_use() == 0);
    check_invariants(rig.eng, cache);
  }
}

TEST_CASE("compressed suspend and policy state restore reject bad input, naming the value",
          "[conversation][compressed]") {
  BlockAllocator alloc(16);
  AllocatorPageHost host(alloc, kPageSize);
  ConversationCache<float> cache(host, Params{});
  std::vector<std::int32_t> pages{alloc.try_allocate(), alloc.try_allocate()};
  const std::vector<std::int32_t> tokens(12, 7);
  cache.create("c");
  CHECK_THROWS_AS(cache.suspend("c", tokens.data(), 12, 13, pages.data(), 2), Error);
  CHECK_THROWS_WITH(cache.suspend("c", tokens.data(), 12, 13, pages.data(), 2),
                    Catch::Contains("kv_len 13 exceeds its 12 processed tokens"));
  CHECK_THROWS_WITH(cache.suspend("c", tokens.data(), 12, 9, pages.data(), 1),
                    Catch::Contains("1 pages for 9 tokens of page size 8, expected 2"));
  CHECK(alloc.refcount(pages[0]) == 1);  // nothing retained
  CHECK(alloc.refcount(pages[1]) == 1);
  CHECK_THROWS_WITH(cache.suspend("c", tokens.data(), 12, 9, pages.data(), 2, std::any(5), -3),
                    Catch::Contains("state_bytes -3 is negative"));
  CHECK(cache.state("c") == State::kRunning);
  cache.suspend("c", tokens.data(), 12, 9, pages.data(), 2, std::any(5), 1000);
  CHECK(cache.compressed("c"));
  CHECK(cache.cached_len("c") == 9);
  CHECK(alloc.refcount(pages[0]) == 2);
  CHECK(cache.host_state_bytes() == 1000);
  cache.fork("c", "d");  // a fork copies the state, and its bytes
  CHECK(cache.host_state_bytes() == 2000);
  cache.evict("d");  // eviction drops it
  CHECK(cache.host_state_bytes() == 1000);
  for (std::int32_t pg : pages) alloc.release(pg);
  // A resume by the history alone has no token to feed: a miss, pages released.
  const Resume r = cache.resume("c", tokens);
  CHECK(r.cached_len == 0);
  CHECK(r.pages.empty());
  CHECK_FALSE(r.state.has_value());
  CHECK(cache.host_state_bytes() == 0);  // a miss drops it
  CHECK(alloc.pages_in_use() == 0);
  CHECK_THROWS_WITH(cache.resume("c", tokens), Catch::Contains("still running"));
  cache.end("c");

  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  Rig rig(ck), other(ck);
  const SeqId s = rig.eng.add_sequence({kBosToken, 5, 6});
  const SeqId o = other.eng.add_sequence({kBosToken, 5, 6});
  other.eng.step();
  const std::any theirs = other.policy.save_sequence(o);
  REQUIRE(theirs.has_value());
  CHECK_FALSE(rig.policy.save_sequence(s).has_value());  // no step yet: nothing to keep
  CHECK_THROWS_AS(rig.policy.restore_sequence(s, std::any(42)), Error);
  CHECK_THROWS_WITH(rig.policy.restore_sequence(s, std::any(42)),
                    Catch::Contains("restore_sequence of sequence " + std::to_string(s) +
                                    " with a state this policy did not save"));
  CHECK_THROWS_WITH(rig.policy.restore_sequence(s, theirs),
                    Catch::Contains("with a state this policy did not save"));
  rig.eng.step();
  const std::any mine = rig.policy.save_sequence(s);
  CHECK(rig.policy.state_bytes(mine) > 0);
  CHECK(rig.policy.state_bytes(theirs) == other.policy.state_bytes(theirs));
  CHECK(rig.policy.state_bytes(std::any(42)) == 0);  // not its state: nothing of its own
  CHECK_THROWS_WITH(rig.policy.restore_sequence(s, mine),
                    Catch::Contains("restore_sequence of sequence " + std::to_string(s) + " which already ran a step"));
  CHECK_THROWS_WITH(rig.policy.restore_sequence(s + 7, mine),
                    Catch::Contains("restore_sequence of sequence " + std::to_string(s + 7) +
                                    " which is not live in the attached engine"));
}

TEST_CASE("a composite policy (r1kv+eps) carries its parts' state across suspend and resume",
          "[conversation][compressed][compose]") {
  KVKIT_TEST_RNG(rng);
  std::string name;
  auto ck = kvkit::test::stories_or_synthetic(&name);
  INFO(name);
  auto composite = [] {
    std::vector<std::unique_ptr<EnginePolicy>> parts;
    parts.push_back(std::make_unique<R1KVPolicy>(r1kv_options()));
    sketch::SketchParams p;
    p.eps = 1e-2;
    parts.push_back(std::make_unique<EpsPolicy>(p));
    return std::make_unique<CompositePolicy>(std::move(parts));
  };
  const std::vector<std::int32_t> first = [&] {
    std::vector<std::int32_t> f{kBosToken};
    const auto u = random_tokens(static_cast<std::size_t>(kUser[0]), ck->config().vocab_size, rng);
    f.insert(f.end(), u.begin(), u.end());
    return f;
  }();
  std::vector<std::vector<std::int32_t>> user;
  for (int t = 1; t < 4; ++t)
    user.push_back(random_tokens(static_cast<std::size_t>(kUser[t]), ck->config().vocab_size, rng));

  Engine ref(ck, options());
  auto ref_pol = composite();
  ref_pol->attach(ref);
  const SeqId rs = ref.add_sequence(first);
  std::vector<TurnOut> want;
  for (int t = 0; t < 4; ++t) {
    if (t > 0) ref.append_tokens(rs, user[static_cast<std::size_t>(t - 1)]);
    want.push_back(decode_turn(ref, rs, kReply[t], false));
  }

  Engine eng(ck, options());
  auto pol = composite();
  pol->attach(eng);
  EngineConversationHost host(eng);
  ConversationCache<float> cache(host, Params{});
  std::vector<std::int32_t> prompt = first;
  for (int t = 0; t < 4; ++t) {
    INFO("turn " << t);
    Resume r;
    const SeqId s = start_turn(eng, cache, "c", prompt, &r, pol.get());
    CHECK(r.state.has_value() == (t > 0));
    require_same(decode_turn(eng, s, kReply[t], false), want[static_cast<std::size_t>(t)]);
    prompt = eng.tokens(s);
    if (t < 3) prompt.insert(prompt.end(), user[static_cast<std::size_t>(t)].begin(), user[static_cast<std::size_t>(t)].end());
    REQUIRE(eng.kv_len(s) < eng.position(s));
    finish_turn(eng, cache, "c", s, pol.get());
  }
  const R1KVPolicy* rr = ref_pol->find<R1KVPolicy>();
  const R1KVPolicy* rp = pol->find<R1KVPolicy>();
  const EpsPolicy* ep = pol->find<EpsPolicy>();
  REQUIRE((rr != nullptr && rp != nullptr && ep != nullptr));
  CHECK(rp->counters().compressions == rr->counters().compressions);
  CHECK(rp->counters().deferred_steps == 0);
  CHECK(ep->telemetry().certified_omitted_max <= 1e-2 * (1 + 1e-9));
  // A state the composite did not save is refused, naming the policy.
  const SeqId other = eng.add_sequence({kBosToken, 5});
  CHECK_THROWS_WITH(pol->restore_sequence(other, std::any(42)), Catch::Contains("r1kv+eps cannot restore sequence"));
  eng.free_sequence(other);
  cache.end("c");
  CHECK(eng.pages_in_use() == 0);
}
