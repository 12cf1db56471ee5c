// The Compressor policies hosted by the example engine (examples/engine/r1kv_policy.hpp):
// after each step a checker hook registered before the policy's snapshots every
// sequence's K/V and keeps its own window of queries; after the policy ran it checks that
//  - the compressed sequence's kept slots are exactly Compressor::select's on the
//    snapshot (dense keys, the checker's own query window), and its K/V rows are the
//    selected rows, bit for bit, in every layer and head;
//  - the pages past the new length went back to the allocator (pages_in_use matches the
//    sum over sequences, pages_freed counts them) and the position keeps counting;
//  - every other sequence's K/V is unchanged (also when it shared pages with the
//    compressed one);
// plus ragged batches against each sequence alone, prefill deferral and prompt
// compression, and the fidelity of a policy run against the full cache (KL 0, agreement
// 1 exactly while nothing is evicted).
//
// Runs on stories260K when present, else on the synthetic checkpoint of the same shape
// (a WARN says so).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "engine/fidelity.hpp"
#include "engine/r1kv_policy.hpp"
#include "kvkit/kernels/cpu/gather.hpp"
#include "engine_runs.hpp"

using namespace kvkit;
using namespace kvkit::engine;

namespace {

std::shared_ptr<const Checkpoint> model() { return test::stories_or_synthetic(); }

CompressorPolicyOptions options(std::int32_t budget, std::int32_t buffer) {
  CompressorPolicyOptions o;
  o.params.budget = budget;
  o.params.buffer = buffer;
  return o;
}

// Dense K and V of one sequence in one layer: [Hkv, kv_len, D], in the pages' type T.
template <class T = float>
struct Dense {
  std::vector<T> k, v;
  std::int32_t len = 0;
};

template <class T = float>
Dense<T> dense(Engine& eng, SeqId id, int layer) {
  const std::vector<std::int32_t>& pages = eng.pages(id);
  const std::int32_t len = eng.kv_len(id), ps = eng.options().page_size;
  const std::int32_t indptr[2] = {0, static_cast<std::int32_t>(pages.size())};
  const std::int32_t last = pages.empty() ? 0 : len - (indptr[1] - 1) * ps;
  const PagedKVView<T> pool = eng.pool_view<T>(layer);
  const auto v = make_csr_view(eng.geometry(), pool.k_data, eng.strides(), pool.v_data, eng.strides(),
                               CsrPageTable{indptr, pages.data(), &last, 1});
  const std::size_t n = static_cast<std::size_t>(eng.geometry().num_kv_heads) * len * eng.geometry().head_dim;
  Dense<T> d;
  d.len = len;
  d.k.resize(n);
  d.v.resize(n);
  REQUIRE(gather_tokens(exec::Host{}, v, 0, nullptr, len, d.k.data(), d.v.data()).is_ok());
  return d;
}

// The checker hook: snapshots before the policy's hook, checks after the step returned.
template <class Scorer, class T = float>
struct Checker {
  const CompressorPolicy<Scorer>* policy = nullptr;
  std::int32_t window = 8;
  struct Snap {
    std::vector<Dense<T>> layers;
    std::vector<std::int32_t> pages;
    std::int32_t position = 0;
    std::deque<std::vector<std::vector<float>>> queries;  // per step: [layer][Hq*D]
  };
  std::map<SeqId, Snap> snaps;
  std::int64_t compressions_before = 0, freed_before = 0;
  std::int64_t compressions_checked = 0;

  void install(Engine& eng) {
    eng.add_step_hook([this](Engine& e, const StepInfo& info) {
      const ModelConfig& c = e.config();
      const std::size_t row = static_cast<std::size_t>(c.n_heads) * c.head_dim();
      for (std::int32_t b = 0; b < info.batch; ++b) {
        Snap& s = snaps[info.seq_ids[b]];
        std::vector<std::vector<float>> q;
        for (int l = 0; l < c.n_layers; ++l)
          q.emplace_back(info.queries[l] + b * row, info.queries[l] + (b + 1) * row);
        s.queries.push_back(std::move(q));
        if (static_cast<std::int32_t>(s.queries.size()) > window) s.queries.pop_front();
        s.layers.clear();
        for (int l = 0; l < c.n_layers; ++l) s.layers.push_back(dense<T>(e, info.seq_ids[b], l));
        s.pages = e.pages(info.seq_ids[b]);
        s.position = e.position(info.seq_ids[b]);
      }
      compressions_before = policy->counters().compressions;
      freed_before = policy->counters().pages_freed;
    });
  }

  // After the step: the compressed sequence (at most one per step in these tests) and
  // every other one.
  void check(Engine& eng) {
    const ModelConfig& c = eng.config();
    const compressor::Params& p = policy->compressor().params();
    const std::int32_t hkv = c.n_kv_heads, d = c.head_dim(), ps = eng.options().page_size;
    const std::int64_t done = policy->counters().compressions - compressions_before;
    REQUIRE(done <= 1);
    SeqId cid = done == 1 ? policy->last_compressed() : -1;
    std::set<std::int32_t> held;
    for (SeqId id : eng.sequences()) {
      held.insert(eng.pages(id).begin(), eng.pages(id).end());
      const Snap& s = snaps.at(id);
      CHECK(eng.position(id) == s.position);  // the policy never moves the position
      if (id != cid) {  // untouched: same pages, same rows
        CHECK(eng.pages(id) == s.pages);
        for (int l = 0; l < c.n_layers; ++l) {
          const Dense<T> now = dense<T>(eng, id, l);
          REQUIRE(now.len == s.layers[l].len);
          CHECK(std::memcmp(now.k.data(), s.layers[l].k.data(), now.k.size() * sizeof(T)) == 0);
          CHECK(std::memcmp(now.v.data(), s.layers[l].v.data(), now.v.size() * sizeof(T)) == 0);
        }
        continue;
      }
      ++compressions_checked;
      const std::int32_t old_len = s.layers[0].len;
      REQUIRE(old_len >= p.budget + p.buffer);
      REQUIRE(eng.kv_len(id) == p.budget);
      CHECK(eng.pages(id).size() == static_cast<std::size_t>((p.budget + ps - 1) / ps));
      CHECK(policy->counters().pages_freed - freed_before ==
            static_cast<std::int64_t>(s.pages.size()) - static_cast<std::int64_t>(eng.pages(id).size()));
      // Expected kept slots: select on the dense snapshot with the checker's queries.
      compressor::Compressor<Scorer> comp(p);
      const std::int32_t lq = static_cast<std::int32_t>(s.queries.size());
      REQUIRE(lq == p.window);
      for (int l = 0; l < c.n_layers; ++l) {
        // The policy's window in the pages' type (16-bit pages: rounded to nearest even).
        std::vector<T> q(static_cast<std::size_t>(c.n_heads) * lq * d);
        for (int r = 0; r < lq; ++r)
          for (int h = 0; h < c.n_heads; ++h)
            for (int i = 0; i < d; ++i)
              q[(static_cast<std::size_t>(h) * lq + r) * d + i] = from_float<T>(s.queries[r][l][h * d + i]);
        const compressor::Shape sh{hkv, c.n_heads, d, old_len, lq};
        std::vector<unsigned char> ws(comp.workspace_size(exec::Host{}, sh));
        std::vector<std::int32_t> keep(static_cast<std::size_t>(hkv) * p.budget);
        std::int32_t nk = 0;
        REQUIRE(comp.select(exec::Host{}, s.layers[l].k.data(), q.data(), sh, keep.data(), p.budget, &nk,
                            Workspace{ws.data(), ws.size()})
                    .is_ok());
        REQUIRE(nk == p.budget);
        const std::int32_t* got = policy->last_keep().data() + static_cast<std::size_t>(l) * hkv * p.budget;
        CHECK(std::equal(keep.begin(), keep.end(), got));
        // Rows: new slot i of head h == old slot keep[h][i], bit for bit.
        const Dense<T> now = dense<T>(eng, id, l);
        std::int64_t bad = 0;
        for (int h = 0; h < hkv; ++h)
          for (int i = 0; i < p.budget; ++i) {
            const std::int32_t src = keep[static_cast<std::size_t>(h) * p.budget + i];
            const std::size_t o_new = (static_cast<std::size_t>(h) * now.len + i) * d;
            const std::size_t o_old = (static_cast<std::size_t>(h) * old_len + src) * d;
            bad += std::memcmp(&now.k[o_new], &s.layers[l].k[o_old], d * sizeof(T)) != 0;
            bad += std::memcmp(&now.v[o_new], &s.layers[l].v[o_old], d * sizeof(T)) != 0;
          }
        CHECK(bad == 0);
      }
    }
    CHECK(eng.pages_in_use() == static_cast<std::int32_t>(held.size()));  // exact: nothing leaked
  }
};

}  // namespace

TEMPLATE_TEST_CASE("compaction keeps exactly the selected rows and frees the pages past the new length",
                   "[r1kv_engine]", compressor::R1KV, compressor::SnapKV, compressor::StreamingLLM) {
  const auto ck = model();
  for (std::int32_t ps : {16, 5}) {
    CAPTURE(ps);
    EngineOptions eo;
    eo.page_size = ps;
    eo.max_batch = 2;
    Engine eng(ck, eo);
    CompressorPolicy<TestType> pol(options(40, 16));
    Checker<TestType> chk;
    chk.policy = &pol;
    chk.install(eng);  // before the policy: sees each step's state before compression
    pol.attach(eng);
    std::set<std::int32_t> rewritten;
    eng.add_page_listener([&](const PageEvent& e) {
      if (e.kind == PageEventKind::kRewrite) rewritten.insert(e.page);
    });
    const SeqId a = eng.add_sequence({1, 40, 7});
    SeqId b = -1;
    for (int step = 0; step < 130; ++step) {
      if (step == 5) b = eng.add_sequence({1, 300});  // ragged: compresses 5 steps after a
      rewritten.clear();
      eng.step();
      chk.check(eng);
      if (eng.kv_len(a) == 40 && pol.last_compressed() == a && chk.compressions_before + 1 == pol.counters().compressions) {
        // notify_rewrite reached listeners for the compacted pages (reference order moves slot 0)
        for (std::int32_t p : eng.pages(a)) CHECK(rewritten.count(p) == 1);
      }
    }
    CHECK(chk.compressions_checked == pol.counters().compressions);
    CHECK(pol.counters().compressions >= 8);  // a: (130-56)/16+1 = 5, b: 5
    for (SeqId id : {a, b}) {
      CHECK(eng.position(id) - eng.kv_len(id) == pol.dropped_tokens(id));
      CHECK(eng.kv_len(id) < 56);
    }
    CHECK(pol.counters().tokens_dropped == pol.dropped_tokens(a) + pol.dropped_tokens(b));
    CHECK(pol.counters().pages_copied == 0);
  }
}

TEMPLATE_TEST_CASE("16-bit pages: select on the pages' keys with rounded queries, rows moved bit for bit",
                   "[r1kv_engine][kv_dtype]", half_t, bfloat16_t) {
  const auto ck = model();
  EngineOptions eo;
  eo.page_size = 16;
  eo.max_batch = 2;
  eo.kv_dtype = dtype_of_v<TestType>;
  Engine eng(ck, eo);
  CompressorPolicy<compressor::R1KV> pol(options(40, 16));
  CHECK(pol.supports_kv_dtype(eo.kv_dtype));
  Checker<compressor::R1KV, TestType> chk;
  chk.policy = &pol;
  chk.install(eng);
  pol.attach(eng);
  const SeqId a = eng.add_sequence({1, 40, 7});
  SeqId b = -1;
  for (int step = 0; step < 100; ++step) {
    if (step == 5) b = eng.add_sequence({1, 300});
    eng.step();
    chk.check(eng);
  }
  CHECK(chk.compressions_checked == pol.counters().compressions);
  CHECK(pol.counters().compressions >= 6);
  for (SeqId id : {a, b}) CHECK(eng.kv_len(id) < 56);
  // Half the bytes of the same run on float32 pages: same pages, 2-byte elements.
  CHECK(eng.kv_bytes_in_use() == eng.pages_in_use() * eng.bytes_per_page() * ck->config().n_layers * 2);
  CHECK(eng.bytes_per_page() == eng.strides().page * 2);
}

TEST_CASE("a ragged batch with a compressor policy matches each sequence run alone", "[r1kv_engine]") {
  const auto ck = model();
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 9}, {1, 100, 200, 30, 4}, {1}};
  const std::vector<int> start = {0, 3, 11};  // steps before each sequence joins
  const int steps = 120;
  struct Out {
    std::vector<std::int32_t> tokens;
    std::int32_t kv_len;
    std::vector<Dense<>> kv;
    std::vector<float> logits;
  };
  auto finish = [&](Engine& eng, SeqId id) {
    Out o{eng.tokens(id), eng.kv_len(id), {}, eng.last_logits(id)};
    for (int l = 0; l < eng.config().n_layers; ++l) o.kv.push_back(dense(eng, id, l));
    return o;
  };
  EngineOptions eo;
  eo.page_size = 8;
  eo.max_batch = 3;
  std::vector<Out> alone;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    Engine eng(ck, eo);
    R1KVPolicy pol(options(32, 10));
    pol.attach(eng);
    const SeqId id = eng.add_sequence(prompts[i]);
    for (int s = start[i]; s < steps; ++s) eng.step();
    alone.push_back(finish(eng, id));
  }
  Engine eng(ck, eo);
  R1KVPolicy pol(options(32, 10));
  pol.attach(eng);
  std::vector<SeqId> ids(prompts.size(), -1);
  for (int s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < prompts.size(); ++i)
      if (start[i] == s) ids[i] = eng.add_sequence(prompts[i]);
    eng.step();
  }
  CHECK(pol.counters().compressions >= 20);  // 7 or 8 per sequence
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    const Out b = finish(eng, ids[i]);
    CHECK(b.tokens == alone[i].tokens);
    CHECK(b.kv_len == alone[i].kv_len);
    CHECK(b.logits == alone[i].logits);
    for (std::size_t l = 0; l < b.kv.size(); ++l) {
      CHECK(b.kv[l].k == alone[i].kv[l].k);
      CHECK(b.kv[l].v == alone[i].kv[l].v);
    }
  }
}

TEST_CASE("compressing a sequence leaves a fork sharing its pages untouched", "[r1kv_engine]") {
  const auto ck = model();
  EngineOptions eo;
  eo.page_size = 8;
  eo.max_batch = 2;
  Engine eng(ck, eo);
  R1KVPolicy pol(options(40, 16));
  Checker<compressor::R1KV> chk;
  chk.policy = &pol;
  chk.install(eng);
  pol.attach(eng);
  const SeqId a = eng.add_sequence({1, 33});
  for (int s = 0; s < 50; ++s) {
    eng.step();
    chk.check(eng);
  }
  const SeqId f = eng.fork_sequence(a);  // shares a's full pages; its query window starts empty
  std::int64_t while_shared = 0;
  for (int s = 0; s < 20; ++s) {
    const bool shared = eng.pages(a).front() == eng.pages(f).front();
    eng.step();
    chk.check(eng);  // a's compaction must not touch f's rows (nor f's a's)
    if (shared && pol.counters().compressions > chk.compressions_before) ++while_shared;
  }
  CHECK(while_shared == 1);
  CHECK(pol.counters().pages_copied > 0);  // a copied the pages it shared with f first
  // a at kv_len 56 (6 steps after the fork); f is due then too but its window holds 6
  // queries: it waits 2 steps (compresses at 58).
  CHECK(pol.counters().compressions == 2);
  CHECK(pol.counters().deferred_steps == 2);
  CHECK(eng.kv_len(a) == 40 + 14);
  CHECK(eng.kv_len(f) == 40 + 12);
}

TEST_CASE("prefilled prompts: compression waits for a full query window; compress_prompt", "[r1kv_engine]") {
  const auto ck = model();
  std::vector<std::int32_t> prompt(100);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int32_t>(1 + (i * 37) % 400);
  EngineOptions eo;
  eo.page_size = 16;
  eo.max_batch = 1;
  SECTION("R1KV waits window - 1 steps after the prefill") {
    Engine eng(ck, eo);
    R1KVPolicy pol(options(40, 16));
    pol.attach(eng);
    const SeqId id = eng.add_sequence(prompt);
    REQUIRE(eng.prefill(id) == 99);
    for (int s = 0; s < 7; ++s) {
      eng.step();
      CHECK(eng.kv_len(id) == 100 + s);
    }
    eng.step();  // the 8th query: the window is full
    CHECK(eng.kv_len(id) == 40);
    CHECK(eng.position(id) == 107);
    CHECK(pol.counters().deferred_steps == 7);
    CHECK(pol.dropped_tokens(id) == 67);
    CHECK(eng.pages_in_use() == 3);
  }
  SECTION("StreamingLLM needs no queries: compresses at the first step") {
    Engine eng(ck, eo);
    StreamingLLMPolicy pol(options(40, 16));
    pol.attach(eng);
    const SeqId id = eng.add_sequence(prompt);
    eng.prefill(id);
    const Dense<> before = dense(eng, id, 2);
    eng.step();
    CHECK(eng.kv_len(id) == 40);
    // S = 100, window 8: sinks 0..3 (score 2), then candidates 91 down to 64 (score j/S,
    // descending: reference order), then the window 92..99, in every head.
    std::vector<std::int32_t> want = {0, 1, 2, 3};
    for (std::int32_t j = 91; j >= 64; --j) want.push_back(j);
    for (std::int32_t j = 92; j < 100; ++j) want.push_back(j);
    const std::int32_t hkv = eng.config().n_kv_heads, d = eng.config().head_dim();
    const Dense<> now = dense(eng, id, 2);
    for (std::int32_t h = 0; h < hkv; ++h) {
      const std::int32_t* got = pol.last_keep().data() + (static_cast<std::size_t>(2) * hkv + h) * 40;
      CHECK(std::vector<std::int32_t>(got, got + 40) == want);
      for (std::int32_t i = 0; i < 40; ++i)
        if (want[i] < 99)  // slot 99 was written by the step after the snapshot
          CHECK(std::equal(now.k.begin() + (h * 40 + i) * d, now.k.begin() + (h * 40 + i + 1) * d,
                           before.k.begin() + (h * 99 + want[i]) * d));
    }
  }
  SECTION("compress_prompt compresses a prompt above budget once its window is full") {
    Engine eng(ck, eo);
    CompressorPolicyOptions o = options(40, 100);
    o.compress_prompt = true;
    SnapKVPolicy pol(o);
    pol.attach(eng);
    std::vector<std::int32_t> p50(prompt.begin(), prompt.begin() + 50);
    const SeqId id = eng.add_sequence(p50);
    for (int s = 0; s < 48; ++s) eng.step();  // teacher-forced prompt, window full
    CHECK(eng.kv_len(id) == 48);
    CHECK(pol.counters().compressions == 0);
    eng.step();  // only the last prompt token is pending now: 49 > 40 cached
    CHECK(eng.kv_len(id) == 40);
    CHECK(pol.counters().prompt_compressions == 1);
    for (int s = 0; s < 20; ++s) eng.step();
    CHECK(pol.counters().compressions == 1);  // then only at budget + buffer = 140
  }
}

TEST_CASE("fidelity against the full cache: exact while nothing is evicted", "[r1kv_engine]") {
  const auto ck = model();
  auto run = [&](std::int32_t budget, std::int32_t buffer, int steps, FidelityMeter& m) {
    EngineOptions eo;
    eo.page_size = 16;
    eo.max_batch = 1;
    Engine full(ck, eo), pol_eng(ck, eo);
    R1KVPolicy pol(options(budget, buffer));
    pol.attach(pol_eng);
    const SeqId a = full.add_sequence({1}), b = pol_eng.add_sequence({1});
    for (int s = 0; s < steps; ++s) {
      full.step();
      pol_eng.forward_tokens({full.tokens(a).back()});
      const auto& lf = full.last_logits(a);
      m.add(lf.data(), pol_eng.last_logits(b).data(), static_cast<std::int32_t>(lf.size()));
    }
    return pol.counters().compressions;
  };
  FidelityMeter exact;
  CHECK(run(200, 32, 200, exact) == 0);  // 200 < 232: never compressed
  CHECK(exact.top1_agreement() == 1.0);
  CHECK(exact.mean_kl() == 0.0);
  CHECK(exact.max_kl() == 0.0);
  CHECK(exact.median_kl() == 0.0);
  FidelityMeter lossy;
  CHECK(run(32, 16, 200, lossy) > 0);
  CHECK(lossy.steps() == 200);
  CHECK(lossy.top1_agreement() > 0.3);
  CHECK(lossy.top1_agreement() <= 1.0);
  CHECK(lossy.max_kl() > 0.0);
  CHECK(std::isfinite(lossy.mean_kl()));
  CHECK(lossy.median_kl() >= 0.0);
  CHECK(lossy.median_kl() <= lossy.max_kl());
}

TEST_CASE("FidelityMeter: median KL is the middle step's (mean of the two middle ones when even)",
          "[r1kv_engine]") {
  // Three steps whose KLs differ: the policy logits move further from the full ones.
  const float full[3] = {1.f, 0.f, -1.f};
  const float pol[4][3] = {{1.f, 0.f, -1.f}, {0.5f, 0.f, -1.f}, {0.f, 0.f, 0.f}, {-1.f, 0.f, 1.f}};
  double kl[4];
  for (int i = 0; i < 4; ++i) kl[i] = engine::kl_from_logits(full, pol[i], 3);
  REQUIRE(kl[0] < kl[1]);
  REQUIRE(kl[1] < kl[2]);
  REQUIRE(kl[2] < kl[3]);
  FidelityMeter m;
  CHECK(m.median_kl() == 0.0);
  for (int i : {2, 0, 1}) m.add(full, pol[i], 3);
  CHECK(m.median_kl() == kl[1]);
  m.add(full, pol[3], 3);
  CHECK(m.median_kl() == (kl[1] + kl[2]) / 2);
  CHECK(m.max_kl() == kl[3]);
}

TEST_CASE("compressor policy options and stats", "[r1kv_engine]") {
  const auto ck = model();
  CHECK_THROWS_WITH(R1KVPolicy(options(8, 4)), Catch::Contains("budget must be > window"));
  EngineOptions eo;
  eo.max_batch = 1;
  Engine eng(ck, eo);
  R1KVPolicy big(options(eng.config().seq_len, 4));
  CHECK_THROWS_WITH(big.attach(eng), Catch::Contains("must be below the model's seq_len"));
  SnapKVPolicy pol(options(24, 8));
  pol.attach(eng);
  CHECK_THROWS_WITH(pol.attach(eng), Catch::Contains("already attached"));
  CHECK(pol.name() == "snapkv");
  eng.add_sequence({1});
  for (int s = 0; s < 40; ++s) eng.step();
  const PolicyStats stats = pol.stats();
  const std::map<std::string, double> st(stats.begin(), stats.end());
  CHECK(st.at("compressions") == 2);   // at 32 and at 32 again after 8 more
  CHECK(st.at("tokens_dropped") == 16);
  CHECK(st.count("pages_freed") == 1);
}
