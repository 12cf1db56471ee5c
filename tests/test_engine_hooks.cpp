// Tests of the example engine's host contract (examples/engine/engine.hpp): all-or-nothing
// steps, page-count overflow and pool-size limits, and the policy hooks (attention hook
// with sequence ids and a workspace, page events, position vs cached length,
// copy-on-write and fork, reclaim under allocation pressure, extra pools, tokens()).
//
// Runs on a generated checkpoint of the stories260K shape (5 layers, GQA), so every
// check covers all layers; logits are compared for exact equality with clean runs, since
// the engine's result for a sequence does not depend on its batch or page ids.

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.hpp"

using namespace kvkit;
using namespace kvkit::engine;

namespace {

std::shared_ptr<const Checkpoint> synthetic() {
  static const auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  return ck;
}

// Everything a step may change about one sequence.
struct SeqState {
  std::vector<std::int32_t> tokens, pages;
  std::int32_t kv_len = 0, position = 0;
  std::vector<float> logits;
  bool operator==(const SeqState& o) const {
    return tokens == o.tokens && pages == o.pages && kv_len == o.kv_len &&
           position == o.position && logits == o.logits;
  }
};

SeqState state(const Engine& e, SeqId id) {
  SeqState s;
  s.tokens = e.tokens(id);
  s.pages = e.pages(id);
  s.kv_len = e.kv_len(id);
  s.position = e.position(id);
  try {
    s.logits = e.last_logits(id);
  } catch (const Error&) {  // no step yet: no logits
  }
  return s;
}

std::map<SeqId, SeqState> snapshot(const Engine& e) {
  std::map<SeqId, SeqState> m;
  for (SeqId id : e.sequences()) m[id] = state(e, id);
  return m;
}

// The dense attention, called from a hook through the AttentionCall it gets.
Status dense(const AttentionCall& c) {
  return paged_decode_attention(c.exec, c.view, c.q, c.out, c.params, c.workspace);
}

// Logits of `steps` clean steps of one sequence with `prompt`, one vector per step.
std::vector<std::vector<float>> clean_logits(const EngineOptions& o, const std::vector<std::int32_t>& prompt,
                                             int steps) {
  Engine eng(synthetic(), o);
  const SeqId id = eng.add_sequence(prompt);
  std::vector<std::vector<float>> out;
  for (int s = 0; s < steps; ++s) {
    eng.step();
    out.push_back(eng.last_logits(id));
  }
  return out;
}

EngineOptions small_pages() {
  EngineOptions o;
  o.page_size = 4;
  o.max_batch = 4;
  o.shuffle_seed = 7;
  return o;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Bug: a failed step corrupted its sequence.

TEST_CASE("a failed step leaves every sequence as before and later logits equal a clean run",
          "[engine][hooks][atomic]") {
  const EngineOptions o = small_pages();
  const std::vector<std::int32_t> pa = {kBosToken, 30, 31}, pb = {kBosToken};
  const int steps = 14;
  const auto ref_a = clean_logits(o, pa, steps), ref_b = clean_logits(o, pb, steps);
  // Fail at steps 4 (both sequences open a fresh page) and 6 (no fresh page), in layer 2:
  // layers 0 and 1 already wrote the step's K/V by then.
  for (const bool throws : {false, true}) {
    INFO((throws ? "hook throws" : "hook returns an error"));
    Engine eng(synthetic(), o);
    const SeqId a = eng.add_sequence(pa), b = eng.add_sequence(pb);
    std::int64_t calls = 0;
    std::set<std::int64_t> fail_at;
    eng.set_attention([&](const AttentionCall& c) -> Status {
      ++calls;
      if (c.layer == 2 && fail_at.count(eng.steps_run())) {
        fail_at.erase(eng.steps_run());
        if (throws) throw std::runtime_error("injected throw");
        return make_status(StatusCode::kDeviceError, "injected failure");
      }
      return dense(c);
    });
    int done = 0;
    for (int s = 0; s < steps; ++s) {
      if (s == 4 || s == 6) {
        fail_at.insert(s);
        const auto before = snapshot(eng);
        const std::int32_t in_use = eng.pages_in_use();
        if (throws) {
          CHECK_THROWS_WITH(eng.step(), Catch::Contains("injected throw"));
        } else {
          const Status st = eng.try_step();
          CHECK(st.code() == StatusCode::kDeviceError);
          CHECK(st.message().find("injected failure") != std::string::npos);
        }
        CHECK(snapshot(eng) == before);
        CHECK(eng.pages_in_use() == in_use);
        CHECK(eng.steps_run() == s);
      }
      eng.step();
      ++done;
      CHECK(eng.last_logits(a) == ref_a[static_cast<std::size_t>(s)]);
      CHECK(eng.last_logits(b) == ref_b[static_cast<std::size_t>(s)]);
    }
    CHECK(done == steps);
    CHECK(eng.kv_len(a) == steps);
    CHECK(eng.position(b) == steps);
    CHECK(calls > 0);
  }
}

TEST_CASE("a failed copy-on-write step returns the copy and keeps the shared page", "[engine][hooks][atomic]") {
  const EngineOptions o = small_pages();
  Engine eng(synthetic(), o);
  const SeqId a = eng.add_sequence({kBosToken, 9});
  for (int s = 0; s < 6; ++s) eng.step();
  const SeqId f = eng.fork_sequence(a);  // shares page 0, copies the partial page 1
  const std::vector<std::int32_t> pa = eng.pages(a);
  eng.free_sequence(f);
  // Share the partial page itself: the next step must copy it for one of the two owners.
  for (std::int32_t p : pa) eng.allocator().retain(p);
  const SeqId b = eng.add_sequence(eng.tokens(a), pa, 6);
  REQUIRE(eng.allocator().refcount(pa[1]) == 2);
  bool fail = true;
  eng.set_attention([&](const AttentionCall& c) -> Status {
    if (fail && c.layer == 4) return make_status(StatusCode::kDeviceError, "late failure");
    return dense(c);
  });
  const auto before = snapshot(eng);
  const std::int32_t in_use = eng.pages_in_use();
  CHECK_THROWS_WITH(eng.step(), Catch::Contains("late failure"));
  CHECK(snapshot(eng) == before);
  CHECK(eng.pages_in_use() == in_use);
  CHECK(eng.allocator().refcount(pa[1]) == 2);
  fail = false;
  eng.step();
  CHECK(eng.pages(a)[1] != eng.pages(b)[1]);  // one of them got a private copy
  CHECK(eng.last_logits(a) == eng.last_logits(b));
  CHECK(eng.allocator().refcount(pa[0]) == 2);
}

// ---------------------------------------------------------------------------------------
// Bug: signed overflow in the page counts; pools the machine cannot hold.

TEST_CASE("huge page sizes and pools fail with the value and the bytes named", "[engine][hooks][errors]") {
  EngineOptions o;
  o.page_size = 2147483647;  // ceil(seq_len / page_size) overflowed int32 here
  try {
    Engine eng(synthetic(), o);
    FAIL("a 2^31-1 token page pool was accepted");
  } catch (const PoolTooLargeError& e) {
    const std::string m = e.what();
    CHECK(m.find("page_size 2147483647") != std::string::npos);
    CHECK(m.find("num_pages 8") != std::string::npos);
    // 2147483647 tokens x 8 pages x 4 heads x 8 dims x 4 bytes x 5 layers x 2 (K, V)
    CHECK(m.find(std::to_string(2147483647LL * 8 * 4 * 8 * 4 * 5 * 2) + " bytes") != std::string::npos);
  }
  o.page_size = 1000000000;  // std::bad_alloc before
  CHECK_THROWS_AS(Engine(synthetic(), o), PoolTooLargeError);
  CHECK_THROWS_WITH(Engine(synthetic(), o), Catch::Contains("page_size 1000000000") &&
                                                Catch::Contains("physical memory"));
  // An explicit cap: the default pool of the synthetic model is 8 x 32 pages of 16 tokens.
  o = EngineOptions{};
  const std::int64_t need = Engine::pool_bytes_needed(synthetic()->config(), o);
  CHECK(need == 8LL * 32 * 16 * 4 * 8 * 4 * 5 * 2);
  o.max_pool_bytes = need - 1;
  CHECK_THROWS_WITH(Engine(synthetic(), o), Catch::Contains(std::to_string(need) + " bytes") &&
                                                Catch::Contains("max_pool_bytes"));
  o.max_pool_bytes = need;
  Engine ok(synthetic(), o);
  CHECK(ok.pages_bytes(ok.options().num_pages) == need);
  // Page counts near INT32_MAX are computed in 64 bits.
  EngineOptions big;
  big.page_size = 2147483647;
  big.num_pages = 3;
  CHECK(Engine::pool_bytes_needed(synthetic()->config(), big) == 2147483647LL * 3 * 4 * 8 * 4 * 5 * 2);
  big.num_pages = 2147483647;
  CHECK(Engine::pool_bytes_needed(synthetic()->config(), big) == INT64_MAX);
}

TEST_CASE("a page as long as the model's context works (contiguous mode, ceil in 64 bits)",
          "[engine][hooks]") {
  EngineOptions o;
  o.page_size = synthetic()->config().seq_len;  // one page per sequence
  o.max_batch = 1;
  Engine eng(synthetic(), o);
  const SeqId a = eng.add_sequence({kBosToken});
  for (int s = 0; s < 5; ++s) eng.step();
  eng.truncate_kv(a, 3);
  CHECK(eng.pages(a).size() == 1);
  eng.truncate_kv(a, 0);
  CHECK(eng.pages(a).empty());
}

// ---------------------------------------------------------------------------------------
// Hooks.

TEST_CASE("the attention hook gets each row's sequence id and a sized workspace", "[engine][hooks]") {
  const EngineOptions o = small_pages();
  Engine eng(synthetic(), o), ref(synthetic(), o);
  std::vector<SeqId> ids, ref_ids;
  for (std::int32_t t : {5, 6, 7}) {
    ids.push_back(eng.add_sequence({kBosToken, t}));
    ref_ids.push_back(ref.add_sequence({kBosToken, t}));
  }
  const std::size_t extra = 12345;
  std::vector<SeqId> seen;
  int calls = 0;
  eng.set_attention(
      [&](const AttentionCall& c) -> Status {
        ++calls;
        seen.assign(c.seq_ids, c.seq_ids + c.view.batch_size);
        CHECK(c.workspace.bytes >= extra);
        CHECK(c.workspace.bytes >= paged_decode_attention_workspace_size(c.exec, c.view, c.params));
        CHECK(c.workspace.data != nullptr);
        CHECK(c.params.num_qo_heads == synthetic()->config().n_heads);
        for (std::int32_t b = 0; b < c.view.batch_size; ++b)
          CHECK(c.view.seq_len(b) == eng.kv_len(c.seq_ids[b]) + 1);  // this step's token included
        return dense(c);
      },
      [&](int, const PagedKVView<float>&) { return extra; });
  for (int s = 0; s < 3; ++s) {
    eng.step();
    ref.step();
  }
  CHECK(seen == ids);
  eng.free_sequence(ids[1]);  // rows are now ids 0 and 2
  ref.free_sequence(ref_ids[1]);
  eng.step();
  ref.step();
  CHECK(seen == std::vector<SeqId>{ids[0], ids[2]});
  CHECK(calls == 4 * synthetic()->config().n_layers);
  CHECK(eng.last_logits(ids[2]) == ref.last_logits(ref_ids[2]));
  eng.set_attention({});  // back to the dense kernel
  eng.step();
  CHECK(calls == 4 * synthetic()->config().n_layers);
}

TEST_CASE("page events report allocation, release and rewrites with their sequence", "[engine][hooks][events]") {
  const EngineOptions o = small_pages();
  Engine eng(synthetic(), o);
  std::vector<PageEvent> ev;
  std::map<std::int32_t, std::int32_t> rc;  // refcounts rebuilt from the events alone
  eng.add_page_listener([&](const PageEvent& e) {
    ev.push_back(e);
    if (e.kind != PageEventKind::kRewrite) rc[e.page] = e.refcount;
  });
  auto count = [&](PageEventKind k, SeqId seq) {
    return std::count_if(ev.begin(), ev.end(), [&](const PageEvent& e) { return e.kind == k && e.seq == seq; });
  };
  const SeqId a = eng.add_sequence({kBosToken});
  const SeqId b = eng.add_sequence({kBosToken, 3});
  for (int s = 0; s < 10; ++s) eng.step();  // 3 pages each
  CHECK(count(PageEventKind::kAllocate, a) == 3);
  CHECK(count(PageEventKind::kAllocate, b) == 3);
  for (const PageEvent& e : ev) CHECK(e.refcount == 1);

  ev.clear();
  const std::vector<std::int32_t> pa = eng.pages(a);
  eng.truncate_kv(a, 5);  // drops page 2, cuts page 1 after slot 1
  REQUIRE(ev.size() == 2);
  CHECK(ev[0].kind == PageEventKind::kRelease);
  CHECK(ev[0].page == pa[2]);
  CHECK(ev[0].refcount == 0);
  CHECK(ev[0].seq == a);
  CHECK(ev[1].kind == PageEventKind::kRewrite);
  CHECK(ev[1].page == pa[1]);
  CHECK(ev[1].first_slot == 1);
  CHECK(ev[1].source_page == -1);

  ev.clear();
  eng.notify_rewrite(a, {pa[0]});  // a compaction policy rewrote page 0
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == PageEventKind::kRewrite);
  CHECK(ev[0].page == pa[0]);
  CHECK(ev[0].seq == a);
  CHECK(ev[0].first_slot == 0);
  CHECK_THROWS_WITH(eng.notify_rewrite(a, {pa[2]}), Catch::Contains("not a page of sequence 0"));
  CHECK_THROWS_WITH(eng.notify_rewrite(a, {pa[0]}, 4), Catch::Contains("first_slot 4"));

  ev.clear();
  eng.allocator().retain(pa[0]);  // a direct call: no sequence
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].kind == PageEventKind::kRetain);
  CHECK(ev[0].seq == -1);
  CHECK(ev[0].refcount == 2);
  CHECK_THROWS_WITH(eng.notify_rewrite(a, {pa[0]}), Catch::Contains("is shared (refcount 2)"));

  ev.clear();
  eng.make_exclusive(a);  // copies the shared page 0 for a
  CHECK(count(PageEventKind::kAllocate, a) == 1);
  CHECK(count(PageEventKind::kRelease, a) == 1);
  const auto copy = std::find_if(ev.begin(), ev.end(), [](const PageEvent& e) { return e.kind == PageEventKind::kRewrite; });
  REQUIRE(copy != ev.end());
  CHECK(copy->source_page == pa[0]);
  CHECK(copy->page == eng.pages(a)[0]);
  CHECK(eng.allocator().refcount(pa[0]) == 1);
  eng.allocator().release(pa[0]);  // our own reference

  ev.clear();
  const std::vector<std::int32_t> pb = eng.pages(b);
  eng.free_sequence(b);
  CHECK(count(PageEventKind::kRelease, b) == 3);
  for (const PageEvent& e : ev) CHECK(e.refcount == 0);

  // The events alone reproduce every page's refcount.
  for (std::int32_t p = 0; p < eng.allocator().num_pages(); ++p) {
    INFO("page " << p);
    CHECK((rc.count(p) ? rc[p] : 0) == eng.allocator().refcount(p));
  }
  CHECK(rc.size() > 0);
}

TEST_CASE("a resumed sequence keeps its position apart from its cached length", "[engine][hooks][position]") {
  const EngineOptions o = small_pages();
  Engine eng(synthetic(), o);
  const SeqId a = eng.add_sequence({kBosToken, 21, 22, 23});
  for (int s = 0; s < 12; ++s) eng.step();
  // A policy keeps the first 8 tokens' K/V (drops the last 4): position 12, kv_len 8.
  eng.truncate_kv(a, 8);
  CHECK(eng.position(a) == 12);
  CHECK(eng.kv_len(a) == 8);
  const std::vector<std::int32_t> history = eng.tokens(a);  // 12 processed + pending
  REQUIRE(history.size() == 13);
  CHECK(eng.processed_tokens(a) == std::vector<std::int32_t>(history.begin(), history.begin() + 12));
  CHECK(eng.pending_token(a) == history[12]);
  // Resume the compressed conversation as a new sequence on shared copies of its pages.
  std::vector<std::int32_t> pages = eng.pages(a);
  for (std::int32_t p : pages) eng.allocator().retain(p);
  const SeqId r = eng.add_sequence(history, pages, 8, 12);
  CHECK(eng.position(r) == 12);
  CHECK(eng.kv_len(r) == 8);
  CHECK(eng.pending_token(r) == history[12]);
  std::vector<float> first_resumed;
  for (int s = 0; s < 6; ++s) {
    eng.step();
    if (s == 0) first_resumed = eng.last_logits(r);
    // Same cache, same RoPE positions: the same logits (a resume at position kv_len
    // would rotate the new queries and keys differently).
    CHECK(eng.last_logits(r) == eng.last_logits(a));
  }
  CHECK(eng.position(r) == 18);
  CHECK(eng.kv_len(r) == 14);
  CHECK(eng.tokens(r) == eng.tokens(a));

  // Resuming at position == kv_len instead gives other logits: positions matter.
  Engine other(synthetic(), o);
  const SeqId x = other.add_sequence({kBosToken, 21, 22, 23});
  for (int s = 0; s < 12; ++s) other.step();
  other.truncate_kv(x, 8);
  std::vector<std::int32_t> px = other.pages(x);
  for (std::int32_t p : px) other.allocator().retain(p);
  std::vector<std::int32_t> shifted(history.begin() + 4, history.end());  // 8 processed + pending
  const SeqId y = other.add_sequence(shifted, px, 8, 8);
  other.free_sequence(x);
  other.step();
  CHECK(other.last_logits(y) != first_resumed);

  CHECK_THROWS_WITH(eng.add_sequence(history, {}, 0, 13), Catch::Contains("position 13"));
  CHECK_THROWS_WITH(eng.add_sequence(history, pages, 9, 8), Catch::Contains("cached_len 9"));
  CHECK_THROWS_WITH(eng.add_sequence(history, {pages[0], pages[0]}, 8, 12), Catch::Contains("listed twice"));
}

TEST_CASE("copy-on-write and fork_sequence share full pages and copy the partial one",
          "[engine][hooks][cow]") {
  const EngineOptions o = small_pages();
  const ModelConfig& c = synthetic()->config();
  Engine eng(synthetic(), o);
  const SeqId a = eng.add_sequence({kBosToken, 40});
  for (int s = 0; s < 10; ++s) eng.step();  // kv_len 10: pages 0, 1 full, 2 partial
  const std::vector<std::int32_t> pa = eng.pages(a);
  const std::int32_t in_use = eng.pages_in_use();
  const SeqId f = eng.fork_sequence(a);
  const std::vector<std::int32_t> pf = eng.pages(f);
  CHECK(pf[0] == pa[0]);
  CHECK(pf[1] == pa[1]);
  CHECK(pf[2] != pa[2]);
  CHECK(eng.allocator().refcount(pa[0]) == 2);
  CHECK(eng.allocator().refcount(pa[2]) == 1);
  CHECK(eng.pages_in_use() == in_use + 1);
  CHECK(eng.tokens(f) == eng.tokens(a));
  CHECK(eng.position(f) == 10);
  CHECK(eng.kv_len(f) == 10);
  CHECK(eng.last_logits(f) == eng.last_logits(a));
  // The copy holds the same K and V in every layer.
  for (int l = 0; l < c.n_layers; ++l) {
    const std::int64_t page = eng.strides().page;
    CHECK(std::equal(eng.k_pool(l) + pa[2] * page, eng.k_pool(l) + (pa[2] + 1) * page, eng.k_pool(l) + pf[2] * page));
    CHECK(std::equal(eng.v_pool(l) + pa[2] * page, eng.v_pool(l) + (pa[2] + 1) * page, eng.v_pool(l) + pf[2] * page));
  }
  // Diverge: force different next tokens; each then equals a clean run whose prompt holds
  // its history.
  eng.forward_tokens({100, 200});
  for (int s = 0; s < 8; ++s) eng.step();
  for (SeqId id : {a, f}) {
    INFO("sequence " << id);
    std::vector<std::int32_t> prompt(eng.tokens(id).begin(), eng.tokens(id).begin() + 12);
    Engine clean(synthetic(), o);
    const SeqId cid = clean.add_sequence(prompt);
    for (int s = 0; s < 19; ++s) clean.step();
    CHECK(clean.tokens(cid) == eng.tokens(id));
    CHECK(clean.last_logits(cid) == eng.last_logits(id));
  }
  CHECK(eng.tokens(a) != eng.tokens(f));
  // Page 2 filled (slots 10, 11), then page 3 opened: full pages stayed shared.
  CHECK(eng.pages(a)[0] == eng.pages(f)[0]);
  CHECK(eng.pages(a)[3] != eng.pages(f)[3]);
}

TEST_CASE("a step writing into a shared page copies it first, in every layer", "[engine][hooks][cow]") {
  const EngineOptions o = small_pages();
  const ModelConfig& c = synthetic()->config();
  Engine eng(synthetic(), o);
  const SeqId a = eng.add_sequence({kBosToken, 41, 42});
  for (int s = 0; s < 6; ++s) eng.step();  // page 1 holds slots 0, 1
  const std::vector<std::int32_t> pa = eng.pages(a);
  for (std::int32_t p : pa) eng.allocator().retain(p);
  // A second owner of the same cache (e.g. a stored conversation): a keeps its pages.
  const SeqId b = eng.add_sequence(eng.tokens(a), pa, 6);
  const std::int64_t page = eng.strides().page;
  std::vector<std::vector<float>> k_before, v_before;
  for (int l = 0; l < c.n_layers; ++l) {
    k_before.emplace_back(eng.k_pool(l) + pa[1] * page, eng.k_pool(l) + (pa[1] + 1) * page);
    v_before.emplace_back(eng.v_pool(l) + pa[1] * page, eng.v_pool(l) + (pa[1] + 1) * page);
  }
  std::vector<PageEvent> ev;
  eng.add_page_listener([&](const PageEvent& e) { ev.push_back(e); });
  eng.step();
  // Both wrote slot 2 of page 1: the first in batch order (a) copied it, b kept the
  // original, now with refcount 1.
  CHECK(eng.pages(a)[1] != pa[1]);
  CHECK(eng.pages(b)[1] == pa[1]);
  CHECK(eng.allocator().refcount(pa[1]) == 1);
  CHECK(eng.allocator().refcount(pa[0]) == 2);
  const std::int32_t copy = eng.pages(a)[1];
  CHECK(std::count_if(ev.begin(), ev.end(), [&](const PageEvent& e) {
          return e.kind == PageEventKind::kRewrite && e.page == copy && e.source_page == pa[1] && e.seq == a;
        }) == 1);
  CHECK(eng.last_logits(a) == eng.last_logits(b));
  // Slots 0, 1 of the copy equal the original's, in every layer, K and V.
  const std::int64_t tok = static_cast<std::int64_t>(c.n_kv_heads) * c.head_dim();  // NHD slot
  for (int l = 0; l < c.n_layers; ++l) {
    INFO("layer " << l);
    CHECK(std::equal(k_before[l].begin(), k_before[l].begin() + 2 * tok, eng.k_pool(l) + copy * page));
    CHECK(std::equal(v_before[l].begin(), v_before[l].begin() + 2 * tok, eng.v_pool(l) + copy * page));
  }
  // Release one owner: the other decodes exactly as a clean run.
  eng.free_sequence(b);
  for (int s = 0; s < 6; ++s) eng.step();
  const auto ref = clean_logits(o, {kBosToken, 41, 42}, 13);
  CHECK(eng.last_logits(a) == ref.back());
}

TEST_CASE("allocation pressure calls reclaim, then fails leaving every sequence intact",
          "[engine][hooks][reclaim]") {
  EngineOptions o = small_pages();
  o.num_pages = 6;
  o.shuffle_seed = 0;
  const auto ref = clean_logits(o, {kBosToken, 50}, 17);
  Engine eng(synthetic(), o);
  // A cached conversation the policy holds: 3 pages, released on demand.
  std::vector<std::int32_t> cached;
  for (int i = 0; i < 3; ++i) cached.push_back(eng.allocator().allocate());
  std::vector<std::int32_t> asked;
  eng.set_reclaim([&](std::int32_t need) {
    asked.push_back(need);
    std::int32_t freed = 0;
    while (freed < need && !cached.empty()) {
      eng.allocator().release(cached.back());
      cached.pop_back();
      ++freed;
    }
    return freed;
  });
  const SeqId a = eng.add_sequence({kBosToken, 50});
  for (int s = 0; s < 12; ++s) eng.step();  // 3 pages of a, 3 cached: pool full
  CHECK(asked.empty());
  CHECK(eng.allocator().num_free() == 0);
  eng.step();  // needs page 4: reclaim frees one cached page
  CHECK(asked == std::vector<std::int32_t>{1});
  CHECK(cached.size() == 2);
  CHECK(eng.last_logits(a) == ref[12]);

  // A fork needs a copy of the partial page: reclaim again.
  const SeqId f = eng.fork_sequence(a);
  CHECK(asked.size() == 2);
  CHECK(cached.size() == 1);
  for (int s = 0; s < 3; ++s) eng.step();  // both fill page 4 (private copies)
  // Next step needs 2 pages; reclaim can free only 1: the step fails, nothing changes.
  const auto before = snapshot(eng);
  const std::int32_t in_use = eng.pages_in_use();
  const Status st = eng.try_step();
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK(st.message().find("out of KV pages") != std::string::npos);
  CHECK(st.message().find("needs 2 new pages") != std::string::npos);
  CHECK(st.message().find("reclaim freed 1") != std::string::npos);
  CHECK(snapshot(eng) == before);
  CHECK(eng.pages_in_use() == in_use - 1);  // the reclaimed page stays free
  CHECK(cached.empty());
  // Dropping the fork lets a finish exactly like a clean run.
  eng.free_sequence(f);
  eng.set_reclaim({});
  eng.step();
  CHECK(eng.last_logits(a) == ref[16]);
  CHECK(eng.position(a) == 17);
}

TEST_CASE("registered pools count in kv_bytes_in_use", "[engine][hooks][pools]") {
  Engine eng(synthetic(), small_pages());
  const SeqId a = eng.add_sequence({kBosToken});
  for (int s = 0; s < 5; ++s) eng.step();
  const std::int64_t own = eng.kv_bytes_in_use();
  CHECK(own == eng.pages_bytes(2));
  std::int64_t packed = 1000, packed_peak = 5000;
  eng.register_pool("packed", [&] { return packed; }, [&] { return packed_peak; });
  eng.register_pool("window", [&] { return std::int64_t{24}; });
  CHECK(eng.kv_bytes_in_use() == own + 1024);
  CHECK(eng.kv_bytes_peak() == eng.pages_bytes(2) + 5024);
  CHECK(eng.pool_bytes("packed") == 1000);
  packed = 0;
  CHECK(eng.kv_bytes_in_use() == own + 24);
  CHECK_THROWS_WITH(eng.register_pool("packed", [] { return std::int64_t{0}; }),
                    Catch::Contains("'packed' is already registered"));
  CHECK_THROWS_WITH(eng.register_pool("x", {}), Catch::Contains("needs a byte counter"));
  eng.unregister_pool("packed");
  eng.unregister_pool("window");
  CHECK(eng.kv_bytes_in_use() == own);
  CHECK_THROWS_WITH(eng.pool_bytes("packed"), Catch::Contains("no registered pool 'packed'"));
  (void)a;
}

TEST_CASE("tokens() splits into processed tokens, the pending token and unfed prompt",
          "[engine][hooks]") {
  Engine eng(synthetic(), small_pages());
  const SeqId a = eng.add_sequence({kBosToken, 60, 61, 62});
  CHECK(eng.processed_tokens(a).empty());
  CHECK(eng.pending_token(a) == kBosToken);
  eng.step();
  CHECK(eng.processed_tokens(a) == std::vector<std::int32_t>{kBosToken});
  CHECK(eng.pending_token(a) == 60);
  CHECK(eng.tokens(a).size() == 4);  // prompt 61, 62 not fed yet
  for (int s = 0; s < 3; ++s) eng.step();
  CHECK(eng.processed_tokens(a) == std::vector<std::int32_t>{kBosToken, 60, 61, 62});
  CHECK(eng.tokens(a).size() == 5);  // + the greedy token, pending
  CHECK(eng.pending_token(a) == eng.tokens(a).back());
}

TEST_CASE("truncating into a shared page copies it on the next write, not before",
          "[engine][hooks][cow][events]") {
  const EngineOptions o = small_pages();
  const auto ref = clean_logits(o, {kBosToken, 43}, 16);
  Engine eng(synthetic(), o);
  const SeqId a = eng.add_sequence({kBosToken, 43});
  for (int s = 0; s < 10; ++s) eng.step();
  const SeqId f = eng.fork_sequence(a);
  const std::int32_t shared = eng.pages(a)[1];
  std::vector<PageEvent> ev;
  eng.add_page_listener([&](const PageEvent& e) { ev.push_back(e); });
  eng.truncate_kv(f, 6);  // cuts page 1, which a still holds in full
  REQUIRE(ev.size() == 1);  // the copied page 2 of f is released; no rewrite of page 1
  CHECK(ev[0].kind == PageEventKind::kRelease);
  CHECK(ev[0].seq == f);
  ev.clear();
  eng.step();
  CHECK(eng.pages(a)[1] == shared);
  CHECK(eng.pages(f)[1] != shared);
  CHECK(std::count_if(ev.begin(), ev.end(), [&](const PageEvent& e) {
          return e.kind == PageEventKind::kRewrite && e.source_page == shared && e.seq == f;
        }) == 1);
  CHECK(eng.allocator().refcount(shared) == 1);
  for (int s = 0; s < 5; ++s) eng.step();
  CHECK(eng.last_logits(a) == ref.back());  // a's cache never changed
  CHECK(eng.kv_len(f) == 12);
  CHECK(eng.position(f) == 16);
}

TEST_CASE("reclaim may preempt a sequence in step() but not change a forward_tokens batch",
          "[engine][hooks][reclaim]") {
  EngineOptions o = small_pages();
  o.num_pages = 4;
  o.shuffle_seed = 0;
  const auto ref = clean_logits(o, {kBosToken, 70}, 9);
  for (const bool forced : {false, true}) {
    INFO((forced ? "forward_tokens" : "step"));
    Engine eng(synthetic(), o);
    const SeqId a = eng.add_sequence({kBosToken, 70});
    const SeqId b = eng.add_sequence({kBosToken, 71});
    for (int s = 0; s < 8; ++s) eng.step();  // 2 pages each: pool full
    int calls = 0;
    eng.set_reclaim([&](std::int32_t need) {
      ++calls;
      CHECK(need == 2);
      CHECK_THROWS_WITH(eng.step(), Catch::Contains("inside a step"));
      eng.free_sequence(b);  // preempt b
      return 2;
    });
    if (!forced) {
      eng.step();
      CHECK(eng.last_logits(a) == ref[8]);
    } else {
      const Status st = eng.try_forward_tokens({5, 6});
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK(st.message().find("changed the batch") != std::string::npos);
      CHECK(eng.position(a) == 8);
      CHECK(eng.kv_len(a) == 8);
    }
    CHECK(calls == 1);
    CHECK_FALSE(eng.has_sequence(b));
  }
}
