// Several policies in one engine (examples/engine/composite_policy.hpp): the Compressor
// (R1KV) compacts and truncates sequences while the Sketcher (EPS) picks the pages each
// attention call reads. They never call each other; EPS learns which pages R1KV rewrote
// only from the engine's page events. Checked here:
//  - after every step, each EPS summary the next pre-pass would use without rebuilding
//    still bounds its group's keys (box and max norm), in every layer and kv head, while
//    R1KV keeps moving tokens between pages; an EPS-only run rebuilds nothing, the
//    composite rebuilds after every compaction;
//  - the certified omitted mass stays <= eps, the composite frees exactly the pages R1KV
//    alone frees, and its KV bytes are those pages plus the summaries;
//  - teacher-forced on the R1KV-alone run, the composite agrees with it (EPS only drops
//    pages whose certified mass is below eps);
//  - attach order does not matter (bitwise the same logits);
//  - combinations that would need one engine slot twice (the attention call, moving
//    tokens) throw naming both policies, and so does a second attention hook.
// Runs on stories260K when present, else on the synthetic checkpoint of the same shape.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/composite_policy.hpp"
#include "engine/engine.hpp"
#include "engine/eps_policy.hpp"
#include "engine/fidelity.hpp"
#include "engine/kvchan_policy.hpp"
#include "engine/r1kv_policy.hpp"
#include "engine_runs.hpp"

using namespace kvkit;
using namespace kvkit::engine;

namespace {

std::shared_ptr<const Checkpoint> model() { return test::stories_or_synthetic(); }

CompressorPolicyOptions r1kv_options() {
  CompressorPolicyOptions o;
  o.params.budget = 32;
  o.params.buffer = 16;
  return o;
}

sketch::SketchParams eps_params() {
  sketch::SketchParams p;
  p.strict = true;
  p.eps = 1e-3;
  p.group_pages = 1;
  return p;
}

EngineOptions engine_options() {
  EngineOptions o;
  o.page_size = 8;
  o.max_batch = 2;
  return o;
}

std::unique_ptr<CompositePolicy> r1kv_eps(bool eps_first = false) {
  std::vector<std::unique_ptr<EnginePolicy>> parts;
  parts.push_back(std::make_unique<R1KVPolicy>(r1kv_options()));
  parts.push_back(std::make_unique<EpsPolicy>(eps_params()));
  if (eps_first) std::swap(parts[0], parts[1]);
  return std::make_unique<CompositePolicy>(std::move(parts));
}

// The composite's part of type P (the test fails when there is none).
template <class P>
const P& part_of(const CompositePolicy& c) {
  const P* p = c.find<const P>();
  REQUIRE(p != nullptr);
  return *p;
}

// Every summary record the next pre-pass would use as is (record_matches) must bound its
// group's keys: min_d <= k_d <= max_d per channel and ||k|| <= max ||k||. Counts the
// records checked and the keys outside their record's bounds.
struct BoundCheck {
  std::int64_t records = 0, violations = 0;
  std::string first;  // where the first violation is
};

void check_summaries_bound_keys(Engine& eng, const sketch::SketchStore& st, BoundCheck& out) {
  const std::vector<PagedKVView<float>>& views = eng.layer_views();
  const std::int32_t d = eng.geometry().head_dim, hkv = eng.geometry().num_kv_heads;
  const std::int32_t ps = eng.options().page_size;
  for (std::int32_t layer = 0; layer < static_cast<std::int32_t>(views.size()); ++layer) {
    const PagedKVView<float>& v = views[static_cast<std::size_t>(layer)];
    for (std::int32_t b = 0; b < v.batch_size; ++b)
      for (std::int32_t j = 0; j < v.num_pages(b); ++j) {  // group_pages 1: one group per page
        const std::int32_t r = st.record_of(layer, v.page_id(b, j));
        if (r < 0 || !st.record_matches(layer, r, v, b, j)) continue;  // rebuilt before use
        ++out.records;
        const std::int32_t t1 = std::min(v.seq_len(b), (j + 1) * ps);
        for (std::int32_t h = 0; h < hkv; ++h) {
          const float* mn = st.box_min(layer, h) + static_cast<std::size_t>(r) * d;
          const float* mx = st.box_max(layer, h) + static_cast<std::size_t>(r) * d;
          const double max_norm = st.max_norm(layer, h)[r];
          for (std::int32_t t = j * ps; t < t1; ++t) {
            const float* k = v.k_ptr(b, t, h);
            double n2 = 0;
            bool inside = true;
            for (std::int32_t c = 0; c < d; ++c) {
              inside = inside && k[c] >= mn[c] && k[c] <= mx[c];
              n2 += static_cast<double>(k[c]) * k[c];
            }
            inside = inside && std::sqrt(n2) <= max_norm * (1 + 1e-6);
            if (!inside && out.violations++ == 0)
              out.first = "layer " + std::to_string(layer) + ", batch row " + std::to_string(b) + ", token " +
                          std::to_string(t) + ", kv head " + std::to_string(h);
          }
        }
      }
  }
}

const std::vector<std::int32_t> kPromptA = {1, 200, 300, 40, 55, 61, 7};
const std::vector<std::int32_t> kPromptB = {1, 9, 8};

}  // namespace

TEST_CASE("r1kv+eps: summaries follow every compaction through page events alone", "[compose][eps][r1kv_engine]") {
  const auto ck = model();
  const int steps = std::min(150, ck->config().seq_len - 8);
  auto run = [&](EnginePolicy& pol) {
    Engine eng(ck, engine_options());
    pol.attach(eng);
    eng.add_sequence(kPromptA);
    eng.add_sequence(kPromptB);
    BoundCheck bc;
    for (int s = 0; s < steps; ++s) {
      eng.step();
      const auto* c = dynamic_cast<const CompositePolicy*>(&pol);
      const EpsPolicy& e = c != nullptr ? part_of<EpsPolicy>(*c) : dynamic_cast<const EpsPolicy&>(pol);
      check_summaries_bound_keys(eng, *e.store(), bc);
    }
    return bc;
  };
  // EPS alone, tokens fed one at a time: summaries are only ever appended to.
  EpsPolicy alone(eps_params());
  const BoundCheck a = run(alone);
  INFO("eps alone: first key outside its summary at " << a.first);
  REQUIRE(a.records > 0);
  REQUIRE(a.violations == 0);
  CHECK(alone.telemetry().summaries_rebuilt == 0);

  auto comp = r1kv_eps();
  const BoundCheck bc = run(*comp);
  const R1KVPolicy& r = part_of<R1KVPolicy>(*comp);
  const EpsPolicy& e = part_of<EpsPolicy>(*comp);
  INFO("compressions " << r.counters().compressions << ", records checked " << bc.records << ", rebuilt "
                       << e.telemetry().summaries_rebuilt << ", first key outside its summary at " << bc.first);
  REQUIRE(r.counters().compressions >= 4);
  REQUIRE(bc.records > 0);
  REQUIRE(bc.violations == 0);
  // A compaction rewrites at least the page holding the first dropped token, in every layer.
  REQUIRE(e.telemetry().summaries_rebuilt >= r.counters().compressions * ck->config().n_layers);
  REQUIRE(e.telemetry().certified_omitted_max <= eps_params().eps * (1 + 1e-9));
}

TEST_CASE("r1kv+eps: same pages freed as r1kv alone, close logits, attach order irrelevant", "[compose][eps][r1kv_engine]") {
  const auto ck = model();
  const int steps = std::min(150, ck->config().seq_len - 8);
  Engine ref(ck, engine_options()), eng(ck, engine_options()), swapped(ck, engine_options());
  R1KVPolicy ref_pol(r1kv_options());
  ref_pol.attach(ref);
  auto comp = r1kv_eps(false), comp_swapped = r1kv_eps(true);
  CHECK(comp->name() == "r1kv+eps");
  CHECK(comp_swapped->name() == "eps+r1kv");
  comp->attach(eng);
  comp_swapped->attach(swapped);
  for (Engine* e : {&ref, &eng, &swapped}) {
    e->add_sequence(kPromptA);
    e->add_sequence(kPromptB);
  }
  // Teacher-forced on the R1KV-alone run. eps stays small: R1KV's top-k is discontinuous,
  // so once EPS shifts a score past a tie the two runs keep different tokens, and their
  // distance then measures R1KV, not the composition (at eps 5e-2 both stay as far from
  // the full cache as R1KV alone, but apart from each other).
  FidelityMeter meter;
  for (int s = 0; s < steps; ++s) {
    ref.step();
    std::vector<std::int32_t> forced;
    for (SeqId id : ref.sequences()) forced.push_back(ref.pending_token(id));
    eng.forward_tokens(forced);
    swapped.forward_tokens(forced);
    const std::vector<SeqId> ids = ref.sequences();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto& lr = ref.last_logits(ids[i]);
      meter.add(lr.data(), eng.last_logits(eng.sequences()[i]).data(), static_cast<std::int32_t>(lr.size()));
      REQUIRE(eng.last_logits(eng.sequences()[i]) == swapped.last_logits(swapped.sequences()[i]));
    }
    // Compactions are triggered by length alone: same pages in use at every step.
    REQUIRE(eng.pages_in_use() == ref.pages_in_use());
  }
  const EpsPolicy& e = part_of<EpsPolicy>(*comp);
  INFO("top-1 agreement " << meter.top1_agreement() << ", mean KL " << meter.mean_kl() << ", pages visited "
                          << e.telemetry().pages_visited << " of " << e.telemetry().pages_total);
  REQUIRE(part_of<R1KVPolicy>(*comp).counters().pages_freed == ref_pol.counters().pages_freed);
  REQUIRE(ref_pol.counters().pages_freed > 0);
  REQUIRE(eng.kv_bytes_in_use() == eng.pages_bytes(eng.pages_in_use()) + e.store()->memory_bytes());
  REQUIRE(e.telemetry().certified_omitted_max <= eps_params().eps * (1 + 1e-9));
  CHECK(meter.top1_agreement() >= 0.95);
  CHECK(meter.mean_kl() < 0.02);
}

TEST_CASE("composite policies refuse a second owner of one engine slot", "[compose]") {
  auto built = [](auto... ps) {
    std::vector<std::unique_ptr<EnginePolicy>> v;
    (v.push_back(std::move(ps)), ...);
    return v;
  };
  KvchanOptions ko;  // dynamic mode: replaces attention and moves tokens
  CHECK_THROWS_WITH(CompositePolicy(built(std::make_unique<EpsPolicy>(eps_params()), std::make_unique<KvchanPolicy>(ko))),
                    Catch::Contains("eps and kvchan both replace the attention call"));
  CHECK_THROWS_WITH(CompositePolicy(built(std::make_unique<R1KVPolicy>(r1kv_options()),
                                          std::make_unique<StreamingLLMPolicy>(r1kv_options()))),
                    Catch::Contains("r1kv and streaming both move cached tokens"));
  CHECK_THROWS_WITH(CompositePolicy(built(std::make_unique<R1KVPolicy>(r1kv_options()),
                                          std::make_unique<R1KVPolicy>(r1kv_options()))),
                    Catch::Contains("r1kv is listed twice"));
  CHECK_THROWS_WITH(CompositePolicy(built(std::make_unique<R1KVPolicy>(r1kv_options()))),
                    Catch::Contains("at least 2 policies, got 1"));

  // The engine's attention slot itself: a second hook throws, restoring the dense kernel
  // first is how a host swaps on purpose.
  Engine eng(model(), engine_options());
  EpsPolicy e1(eps_params()), e2(eps_params());
  e1.attach(eng);
  CHECK_THROWS_WITH(e2.attach(eng), Catch::Contains("attention call is already replaced"));
  eng.set_attention({});
  CHECK_NOTHROW(eng.set_attention([](const AttentionCall&) { return Status::ok(); }));
}
