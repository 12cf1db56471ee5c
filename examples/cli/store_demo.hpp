#pragma once
// The shared-prefix workload of `kvkit store-demo` (the PikiwiDB seed's demo): requests that
// share a long prefix (>= 256 tokens) and differ in a short suffix, run on a fresh engine per
// run, one request at a time:
//   baseline  no store at all (the reference outputs);
//   cold      a fresh engine with the store, lookups off: each finished request saves its
//             full blocks that the store lacks (save time);
//   warm      a fresh engine on the same store: each request matches and loads its stored
//             prefix through the prefix-page start, then computes only the rest (load time).
// Outputs are compared token by token with the baseline and must be equal.
//
// Why equality is exact (not "up to rounding"): every run prefills a prompt in chunks that
// end at page boundaries (Engine::prefill(id, tokens to the next boundary)), one page per
// pass. Block i's K/V is then always computed by the same pass (its P tokens, attending to
// blocks 0..i-1 read from pages) whether blocks 0..i-1 were computed or loaded, and loaded
// blocks are bit-exact copies of computed ones (checksummed payloads). The last prompt
// token and the generated ones run as engine steps in every run. A run that prefilled the
// whole prompt in one pass would differ from a loaded-prefix run by GEMM rounding (Eigen
// blocks a product by its column count), and greedy decoding can amplify that.
// No CLI11, JSON or hiredis here: the CLI command (cmd_store_demo.hpp) and the tests pick
// the backend.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.hpp"
#include "engine/store_connector.hpp"
#include "engine/tokenizer.hpp"

namespace kvkit {
namespace engine {

/// A shared document for text models (written for this demo): ~300 ChatML tokens with
/// SmolLM2's default system message.
inline constexpr const char* kStoreDemoDocument =
    "Field notes from the Alder Creek observatory, autumn season.\n\n"
    "The observatory sits on a granite shelf at 1,840 meters, above the last farms of the "
    "Alder valley. It was built in 1962 by the university's physics department and has two "
    "domes: the east dome holds a 60-centimeter reflector, and the west dome a smaller "
    "solar telescope that students use on weekday mornings. Power comes from a cable laid "
    "along the forestry road, with a diesel generator kept for storms.\n\n"
    "This season the staff was three people. Mirela Costa, the site manager, handled the "
    "schedule and the supply runs to the village of Brenn every Tuesday. Tomas Ilves ran the "
    "reflector at night and logged 41 clear nights between September 2 and November 20. "
    "Ana Ruiz, a graduate student, measured the brightness of 212 variable stars and found "
    "that two of them, catalogued as AC-17 and AC-93, changed period by more than four "
    "percent since the previous survey.\n\n"
    "The main problem of the season was the east dome's rotation motor, which failed on "
    "October 9 and was replaced with a spare shipped from the city; the dome was closed for "
    "six nights. Snow closed the forestry road on November 14, two weeks earlier than last "
    "year, and the final supply run used the cable car from Brenn. The budget for next year "
    "asks for a second spare motor and a new weather station.";

/// The four questions asked about kStoreDemoDocument.
inline const std::vector<std::string>& store_demo_questions() {
  static const std::vector<std::string> q = {
      "How many clear nights did Tomas Ilves log?",
      "Which two variable stars changed period, and by how much?",
      "What happened to the east dome in October?",
      "What does the budget for next year ask for?"};
  return q;
}

/// One request of the workload.
struct DemoRequest {
  std::string label;                 // the question, or "suffix i"
  std::vector<std::int32_t> prompt;  // token ids
};

/// The requests and how many leading tokens they all share.
struct DemoWorkload {
  std::vector<DemoRequest> requests;
  std::int32_t shared_prefix_tokens = 0;
};

/// Longest common prefix of every request's prompt.
inline std::int32_t common_prefix(const std::vector<DemoRequest>& reqs) {
  if (reqs.empty()) return 0;
  std::size_t n = reqs[0].prompt.size();
  for (const DemoRequest& r : reqs) {
    std::size_t i = 0;
    while (i < n && i < r.prompt.size() && r.prompt[i] == reqs[0].prompt[i]) ++i;
    n = i;
  }
  return static_cast<std::int32_t>(n);
}

/// Text workload: the document, then one question per request, as a ChatML user turn with
/// the assistant turn opened.
inline DemoWorkload text_workload(const Tokenizer& tok, const ChatTemplate& tmpl, const std::string& document,
                                  const std::vector<std::string>& questions) {
  DemoWorkload w;
  for (const std::string& q : questions) {
    const std::vector<ChatMessage> msgs = {{"user", document + "\n\nQuestion: " + q}};
    w.requests.push_back({q, tmpl.encode(tok, msgs, /*add_generation_prompt=*/true)});
  }
  w.shared_prefix_tokens = common_prefix(w.requests);
  return w;
}

/// Token-id workload (llama2.c models): BOS + `prefix_len` - 1 pseudo-random ids, then
/// `n` different suffixes of 6 to 17 ids (deterministic for a seed).
inline DemoWorkload token_workload(std::int32_t vocab, std::int32_t prefix_len, std::int32_t n,
                                   std::uint64_t seed = 7) {
  KVKIT_CHECK(vocab > 3 && prefix_len > 0 && n > 0, "kvkit: token_workload vocab ", vocab, " prefix ",
              prefix_len, " requests ", n);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&]() {  // splitmix64
    s += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  auto token = [&]() { return static_cast<std::int32_t>(3 + next() % static_cast<std::uint64_t>(vocab - 3)); };
  std::vector<std::int32_t> prefix = {kBosToken};
  while (static_cast<std::int32_t>(prefix.size()) < prefix_len) prefix.push_back(token());
  DemoWorkload w;
  for (std::int32_t i = 0; i < n; ++i) {
    DemoRequest r{"suffix " + std::to_string(i), prefix};
    const std::int32_t len = 6 + static_cast<std::int32_t>(next() % 12);
    for (std::int32_t j = 0; j < len; ++j) r.prompt.push_back(token());
    w.requests.push_back(std::move(r));
  }
  w.shared_prefix_tokens = common_prefix(w.requests);
  return w;
}

/// Result of one request in one run.
struct DemoRequestResult {
  std::vector<std::int32_t> generated;  // greedy tokens, the stop token excluded
  std::int32_t matched_blocks = 0;
  std::int32_t loaded_blocks = 0;
  std::int32_t prefilled_tokens = 0;    // prompt tokens computed (batched prefill + last step)
  std::int32_t saved_blocks = 0;
  std::string load_error;               // why loading stopped early, if not a plain miss
};

/// Result of one run (one fresh engine).
struct DemoRun {
  std::vector<DemoRequestResult> requests;
  std::int32_t blocks_saved = 0;
  std::int32_t hit_tokens = 0;              // matched blocks x page size
  std::int32_t prefill_tokens_avoided = 0;  // loaded blocks x page size
  double load_ms = 0, save_ms = 0;
  double compute_ms = 0;                    // prefill + decode
};

/// Settings of one run.
struct DemoRunConfig {
  EngineOptions engine;            // page_size, threads, layout; num_pages/max_batch sized here
  std::int32_t max_tokens = 16;    // generated per request
  std::int32_t stop_token = -1;    // ends a request early (end of turn); -1: none
  store::BlockBackend* backend = nullptr;  // null: no store
  StoreConnectorOptions store;     // lookup false: the cold run
};

/// Runs every request of `w` on a fresh engine (one sequence at a time; see the file
/// comment for the prefill chunking). Throws kvkit::Error on engine errors.
inline DemoRun run_demo_workload(std::shared_ptr<const Checkpoint> ckpt, const DemoWorkload& w,
                                 const DemoRunConfig& cfg) {
  EngineOptions eo = cfg.engine;
  eo.max_batch = 1;
  eo.contiguous = false;
  std::size_t longest = 0;
  for (const DemoRequest& r : w.requests) longest = std::max(longest, r.prompt.size());
  const std::int64_t positions = std::min<std::int64_t>(ckpt->config().seq_len,
                                                        static_cast<std::int64_t>(longest) + cfg.max_tokens);
  eo.num_pages = static_cast<std::int32_t>((positions + eo.page_size - 1) / eo.page_size) + 1;
  Engine eng(ckpt, eo);
  std::unique_ptr<StoreConnector> conn;
  if (cfg.backend != nullptr) conn = std::make_unique<StoreConnector>(eng, *cfg.backend, cfg.store);
  const std::int32_t P = eng.options().page_size, seq_len = eng.config().seq_len;
  DemoRun run;
  for (const DemoRequest& req : w.requests) {
    DemoRequestResult rr;
    SeqId id = -1;
    if (conn) {
      const StoreStart s = conn->start(req.prompt);
      id = s.id;
      rr.matched_blocks = s.matched_blocks;
      rr.loaded_blocks = s.loaded_blocks;
      if (!s.load_status.is_ok()) rr.load_error = s.load_status.to_string();
      run.load_ms += s.load_ms;
    } else {
      id = eng.add_sequence(req.prompt);
    }
    run.hit_tokens += rr.matched_blocks * P;
    run.prefill_tokens_avoided += rr.loaded_blocks * P;
    rr.prefilled_tokens = static_cast<std::int32_t>(req.prompt.size()) - eng.position(id);
    const auto t0 = std::chrono::steady_clock::now();
    // Page-aligned prefill passes (one page each), so computed blocks match loaded ones.
    while (eng.prefill(id, P - eng.kv_len(id) % P) > 0) {
    }
    while (eng.tokens(id).size() == req.prompt.size() && eng.position(id) < seq_len) eng.step();
    while (eng.tokens(id).size() > req.prompt.size()) {
      const std::int32_t next = eng.tokens(id).back();
      if (next == cfg.stop_token) break;
      rr.generated.push_back(next);
      if (static_cast<std::int32_t>(rr.generated.size()) >= cfg.max_tokens || eng.position(id) >= seq_len)
        break;
      eng.step();
    }
    run.compute_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (conn) {
      const StoreFinish f = conn->finish(id);
      rr.saved_blocks = f.saved_blocks;
      run.blocks_saved += f.saved_blocks;
      run.save_ms += f.save_ms;
      KVKIT_CHECK(f.status.is_ok(), "kvkit: saving blocks to the store failed: ", f.status.to_string());
    }
    eng.free_sequence(id);
    run.requests.push_back(std::move(rr));
  }
  return run;
}

/// True when both runs generated the same token ids for every request.
inline bool same_outputs(const DemoRun& a, const DemoRun& b) {
  if (a.requests.size() != b.requests.size()) return false;
  for (std::size_t i = 0; i < a.requests.size(); ++i)
    if (a.requests[i].generated != b.requests[i].generated) return false;
  return true;
}

}  // namespace engine
}  // namespace kvkit
