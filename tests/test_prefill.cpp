// Batched prefill (examples/engine/prefill.hpp, Engine::prefill) against token-by-token
// teacher forcing in the engine: after the prompt, the logits of the next step and every
// cached K/V row agree to 1e-4 relative (max abs difference / max abs reference value;
// 1e-3 on SmolLM2's 30 layers, see there), on the synthetic model, stories260K and
// SmolLM2-135M-Instruct (the real ones when KVKIT_MODEL_DIR holds them), with chunked
// passes, both page layouts, a prefill that continues a cached prefix (append_tokens, a
// chat's next turn), a shared partly filled page (copy-on-write) and the reclaim callback.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/prefill.hpp"
#include "engine_runs.hpp"
#include "reference.hpp"
#include "test_scale.hpp"

using namespace kvkit;
using namespace kvkit::engine;
using kvkit::test::random_prompt;
namespace fs = std::filesystem;

namespace {

const std::string kStoriesPath = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
const std::string kSmolPath = std::string(KVKIT_MODEL_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

struct NamedModel {
  std::string name;
  std::shared_ptr<const Checkpoint> ck;
};

std::vector<NamedModel> small_models() {
  std::vector<NamedModel> m{{"synthetic", std::make_shared<const Checkpoint>(default_synthetic_checkpoint())}};
  if (fs::exists(kStoriesPath))
    m.push_back({"stories260K", std::make_shared<const Checkpoint>(load_checkpoint(kStoriesPath))});
  else
    WARN("skipped stories260K: no model file " << kStoriesPath);
  return m;
}

// max |a - b| / max |b|.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  REQUIRE(den > 0);
  return num / den;
}

// The cached K and V of sequence `id`, all layers, token-major.
std::vector<float> cached_kv(Engine& eng, SeqId id) {
  const auto ids = eng.sequences();
  const auto row = static_cast<std::int32_t>(std::find(ids.begin(), ids.end(), id) - ids.begin());
  const auto& views = eng.layer_views();
  std::vector<float> out;
  const std::int32_t hd = eng.config().head_dim();
  for (const auto& v : views)
    for (std::int32_t t = 0; t < eng.kv_len(id); ++t)
      for (std::int32_t h = 0; h < v.num_kv_heads; ++h) {
        out.insert(out.end(), v.k_ptr(row, t, h), v.k_ptr(row, t, h) + hd);
        out.insert(out.end(), v.v_ptr(row, t, h), v.v_ptr(row, t, h) + hd);
      }
  return out;
}

struct Run {
  std::vector<float> logits;  // after the step that processes the last prompt token
  std::vector<float> kv;      // every cached K/V row then
  std::int32_t next = -1;     // the greedy token it chose
};

// Teacher forcing: one engine step per prompt token.
Run stepwise(std::shared_ptr<const Checkpoint> ck, EngineOptions o, const std::vector<std::int32_t>& prompt) {
  Engine eng(std::move(ck), o);
  const SeqId id = eng.add_sequence(prompt);
  for (std::size_t i = 0; i < prompt.size(); ++i) eng.step();
  return {eng.last_logits(id), cached_kv(eng, id), eng.tokens(id).back()};
}

// Batched: Engine::prefill over all but the last prompt token (`chunk` tokens per call),
// then one step.
Run batched(std::shared_ptr<const Checkpoint> ck, EngineOptions o, const std::vector<std::int32_t>& prompt,
            std::int32_t chunk) {
  Engine eng(std::move(ck), o);
  const SeqId id = eng.add_sequence(prompt);
  std::int32_t total = 0;
  for (std::int32_t n; (n = eng.prefill(id, chunk)) > 0;) {
    CHECK(n <= chunk);
    total += n;
  }
  CHECK(total == static_cast<std::int32_t>(prompt.size()) - 1);
  CHECK(eng.sequences() == std::vector<SeqId>{id});
  CHECK_THROWS_WITH(eng.last_logits(id), Catch::Contains("has not run a step"));
  CHECK(eng.position(id) == static_cast<std::int32_t>(prompt.size()) - 1);
  CHECK(eng.kv_len(id) == eng.position(id));
  eng.step();
  CHECK(eng.tokens(id).size() == prompt.size() + 1);
  return {eng.last_logits(id), cached_kv(eng, id), eng.tokens(id).back()};
}

}  // namespace

TEST_CASE("batched prefill matches token-by-token teacher forcing (small models)", "[prefill]") {
  KVKIT_TEST_RNG(rng);
  for (const NamedModel& m : small_models()) {
    long c = -1;
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
      for (std::int32_t page : {7, 16})
        for (std::int32_t chunk : {5, 100, 512}) {
          if (!test::sampled(++c, 2)) continue;  // the sanitizer build: 6 of the 12 cases
          // Long enough for several query blocks and key tiles of the tiled attention.
          const auto prompt = random_prompt(chunk == 100 ? 301 : 61, m.ck->config().vocab_size, rng);
          EngineOptions o;
          o.page_size = page;
          o.layout = layout;
          o.max_batch = 2;
          o.shuffle_seed = 11;  // scattered page ids
          INFO(m.name << " page " << page << " chunk " << chunk << " layout "
                      << (layout == KVLayout::kNHD ? "nhd" : "hnd"));
          const Run a = stepwise(m.ck, o, prompt), b = batched(m.ck, o, prompt, chunk);
          CHECK(rel_err(b.logits, a.logits) < 1e-4);
          CHECK(rel_err(b.kv, a.kv) < 1e-4);
        }
  }
}

TEST_CASE("Prefiller::run gives the last token's logits (tiled or decode-kernel attention)", "[prefill]") {
  KVKIT_TEST_RNG(rng);
  for (const NamedModel& m : small_models()) {
    const auto prompt = random_prompt(45, m.ck->config().vocab_size, rng);
    EngineOptions o;
    o.page_size = 8;
    o.layout = KVLayout::kHND;
    const Run a = stepwise(m.ck, o, prompt);
    Engine eng(m.ck, o);
    std::vector<std::int32_t> pages;
    for (int i = 0; i < 6; ++i) pages.push_back(eng.allocator().allocate());
    const std::vector<PagedKVView<float>> pools = test::pool_views(eng);
    std::vector<float> logits(static_cast<std::size_t>(eng.config().vocab_size));
    Prefiller pre(16);
    for (bool tiled : {true, false}) {  // tiled attention, and the paged decode kernel per token
      INFO(m.name << (tiled ? " tiled" : " decode kernel"));
      pre.set_tiled_attention(tiled);
      std::fill(logits.begin(), logits.end(), 0.f);
      REQUIRE(pre.run(eng.model(), pools.data(), pages, prompt.data(), 45, 0, 0, logits.data()).is_ok());
      CHECK(rel_err(logits, a.logits) < 1e-4);
    }
    // Too few pages or a position past seq_len are errors naming the values.
    CHECK_THROWS_WITH(pre.run(eng.model(), pools.data(), {pages[0]}, prompt.data(), 45, 0, 0, nullptr),
                      Catch::Contains("cannot hold 45 tokens"));
    CHECK_THROWS_WITH(pre.run(eng.model(), pools.data(), pages, prompt.data(), 45, 0, eng.config().seq_len, nullptr),
                      Catch::Contains("exceeds the model's seq_len"));
  }
}

TEST_CASE("prefill continues a cached prefix (append_tokens) and copies a shared page", "[prefill]") {
  KVKIT_TEST_RNG(rng);
  const auto ck = small_models().back().ck;
  const std::int32_t vocab = ck->config().vocab_size;
  const auto first = random_prompt(21, vocab, rng), second = random_prompt(30, vocab, rng);
  EngineOptions o;
  o.page_size = 8;
  o.max_batch = 3;
  // Reference: the whole conversation token by token, with the generated token of turn 1.
  Engine ref(ck, o);
  SeqId rid = ref.add_sequence(first);
  for (std::size_t i = 0; i < first.size(); ++i) ref.step();
  std::vector<std::int32_t> all = ref.tokens(rid);  // first + its greedy token (pending)
  {
    Engine eng(ck, o);
    std::vector<PageEvent> events;
    eng.add_page_listener([&](const PageEvent& e) { events.push_back(e); });
    const SeqId id = eng.add_sequence(first);
    CHECK(eng.prefill(id) == static_cast<std::int32_t>(first.size()) - 1);
    CHECK(eng.prefill(id) == 0);  // nothing left but the last prompt token
    for (const PageEvent& e : events) CHECK(e.seq == id);
    eng.step();
    REQUIRE(eng.tokens(id) == all);
    // A second owner of every page (as a stored conversation would be): prefill must copy
    // the partly filled last page before writing into it, and share the full ones.
    const std::vector<std::int32_t> pages = eng.pages(id);
    for (std::int32_t p : pages) eng.allocator().retain(p);
    eng.append_tokens(id, second);
    CHECK(eng.kv_len(id) == static_cast<std::int32_t>(first.size()));
    // The pending token + `second` but its last.
    CHECK(eng.prefill(id) == static_cast<std::int32_t>(second.size()));
    const std::vector<std::int32_t> now = eng.pages(id);
    CHECK(now[pages.size() - 1] != pages.back());  // the shared partial page was copied
    CHECK(eng.allocator().refcount(pages.back()) == 1);  // only our extra reference is left
    for (std::size_t i = 0; i + 1 < pages.size(); ++i) CHECK(now[i] == pages[i]);
    eng.step();
    // Reference continues with `second` teacher-forced after the pending token.
    std::vector<std::int32_t> more = all;
    more.insert(more.end(), second.begin(), second.end());
    Engine ref2(ck, o);
    const SeqId r2 = ref2.add_sequence(more);
    for (std::size_t i = 0; i < more.size(); ++i) ref2.step();
    CHECK(rel_err(eng.last_logits(id), ref2.last_logits(r2)) < 1e-4);
    CHECK(rel_err(cached_kv(eng, id), cached_kv(ref2, r2)) < 1e-4);
    CHECK_THROWS_WITH(eng.append_tokens(id, {vocab}), Catch::Contains("outside the vocabulary"));
    CHECK_THROWS_WITH(eng.append_tokens(id, std::vector<std::int32_t>(static_cast<std::size_t>(ck->config().seq_len), 1)),
                      Catch::Contains("exceed the model's seq_len"));
    for (std::int32_t p : pages) eng.allocator().release(p);
  }
}

TEST_CASE("prefill refuses what does not fit, changing nothing; asks the reclaim callback", "[prefill]") {
  const auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  EngineOptions o;
  o.page_size = 4;
  o.num_pages = 5;
  o.max_batch = 2;
  Engine eng(ck, o);
  const SeqId other = eng.add_sequence({1, 2, 3, 4, 5, 6});
  eng.step();  // `other` holds a page
  const SeqId id = eng.add_sequence(std::vector<std::int32_t>(20, 5));  // 19 to prefill: 5 pages
  CHECK_THROWS_WITH(eng.prefill(id), Catch::Contains("out of KV pages"));
  CHECK(eng.position(id) == 0);
  CHECK(eng.kv_len(id) == 0);
  CHECK(eng.pages(id).empty());
  CHECK(eng.pages_in_use() == 1);
  CHECK_THROWS_WITH(eng.prefill(id, 0), Catch::Contains("max_tokens must be > 0"));
  CHECK_THROWS_WITH(Prefiller(0), Catch::Contains("chunk must be > 0"));
  std::int32_t asked = 0;
  eng.set_reclaim([&](std::int32_t need) {
    asked = need;
    eng.free_sequence(other);
    return 1;
  });
  CHECK(eng.prefill(id) == 19);
  CHECK(asked == 1);
  CHECK(eng.position(id) == 19);
  CHECK(eng.pages_in_use() == 5);
}

TEST_CASE("batched prefill matches teacher forcing on SmolLM2-135M-Instruct", "[prefill][smollm2]") {
  if (!fs::exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (run scripts/fetch-model.sh)");
    return;
  }
  const auto ck = std::make_shared<const Checkpoint>(load_gguf_checkpoint(kSmolPath));
  KVKIT_TEST_RNG(rng);
  const auto prompt = random_prompt(70, ck->config().vocab_size, rng);
  EngineOptions o;
  o.max_batch = 1;
  o.num_pages = 8;
  o.quantized_matvec = false;  // float decode: the same math as the float prefill
  const Run a = stepwise(ck, o, prompt), b = batched(ck, o, prompt, 32);
  // Both runs are float32 and differ only in summation order (GEMM vs matvec, tiled vs
  // decode attention), but 30 layers amplify that unevenly: on random prompts SmolLM2 puts
  // a massive activation on an early token, and its K/V rows in layers 12-29 then differ
  // by up to ~1e-4 of the largest cached value while every other token stays near 1e-6.
  // Measured over 111 fresh seeds: logits <= 5.3e-6, KV <= 1.0e-4 (plus 1.44e-4 in one CI
  // run), so the bound is 1e-3. Indexing or position bugs give errors of order 1e-1.
  const double logit_err = rel_err(b.logits, a.logits), kv_err = rel_err(b.kv, a.kv);
  INFO("relative error: logits " << logit_err << ", KV " << kv_err);
  CHECK(logit_err < 1e-3);
  CHECK(kv_err < 1e-3);
  // The greedy token may differ only where the top two logits are within the logit error.
  if (b.next != a.next) {
    const float scale = *std::max_element(a.logits.begin(), a.logits.end(), [](float x, float y) {
      return std::abs(x) < std::abs(y);
    });
    CHECK(std::abs(a.logits[a.next] - a.logits[b.next]) <= 2 * logit_err * std::abs(scale));
  }
  // Quantized (the default): prefill quantizes each token's activation and uses decode's
  // row dots, so it differs from quantized teacher forcing only by the tiled attention's
  // summation order (amplified by the 8-bit activation rounding of later layers).
  o.quantized_matvec = true;
  const Run qa = stepwise(ck, o, prompt), qb = batched(ck, o, prompt, 32);
  const double e = rel_err(qb.logits, qa.logits), eq = rel_err(qb.logits, b.logits);
  WARN("SmolLM2 relative logit error: quantized prefill vs quantized teacher forcing " << e
                                                                                      << ", vs float prefill " << eq);
  // 8-bit activation rounding turns summation-order differences into quantization steps, and
  // random prompts have a heavy tail (float above: 50x between median and max over 111
  // seeds). Measured over 16 seeds: e <= 0.042 (median 0.015), eq <= 0.062; the bounds keep a
  // 6x margin; the exact parts are checked bitwise below and in test_quant_matvec.
  CHECK(e < 0.25);
  CHECK(eq < 0.4);
  // Loaded without float projections (the CLI's default): the same quantized run, bit for bit.
  const auto qonly = std::make_shared<const Checkpoint>(load_gguf_checkpoint(kSmolPath, /*float_projections=*/false));
  CHECK_FALSE(qonly->has_float_projections());
  CHECK(qonly->wq(0) == nullptr);
  CHECK(test::bitwise_equal(stepwise(qonly, o, prompt).logits, qa.logits));
  CHECK(test::bitwise_equal(batched(qonly, o, prompt, 32).logits, qb.logits));
}
