#pragma once
// Small drivers of the example engine shared by the engine, prefill and CLI tests.

#include <catch2/catch.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.hpp"

namespace kvkit {
namespace test {

/// A checkpoint and the name tests print.
struct NamedModel {
  std::string name;
  std::shared_ptr<const engine::Checkpoint> ckpt;
};

/// The synthetic checkpoint always, and stories260K when KVKIT_MODEL_DIR holds it (a WARN
/// says when it does not): the real-model checks then run on synthetic only.
inline std::vector<NamedModel> synthetic_and_stories() {
  std::vector<NamedModel> m;
  m.push_back({"synthetic", std::make_shared<const engine::Checkpoint>(engine::default_synthetic_checkpoint())});
  const std::string path = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
  if (std::filesystem::exists(path))
    m.push_back({"stories260K", std::make_shared<const engine::Checkpoint>(engine::load_checkpoint(path))});
  else
    WARN("skipped: no model file " << path << " (real-model checks run on synthetic only)");
  return m;
}

/// stories260K when KVKIT_MODEL_DIR holds it, else the synthetic checkpoint of the same
/// shape (a WARN says so); loaded once per test binary. `name` (optional) receives
/// "stories260K" or "synthetic".
inline std::shared_ptr<const engine::Checkpoint> stories_or_synthetic(std::string* name = nullptr) {
  static std::shared_ptr<const engine::Checkpoint> ck;
  static std::string which;
  if (!ck) {
    const std::string path = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
    if (std::filesystem::exists(path)) {
      ck = std::make_shared<const engine::Checkpoint>(engine::load_checkpoint(path));
      which = "stories260K";
    } else {
      WARN("no model file " << path << ": running on the synthetic checkpoint");
      ck = std::make_shared<const engine::Checkpoint>(engine::default_synthetic_checkpoint());
      which = "synthetic";
    }
  }
  if (name != nullptr) *name = which;
  return ck;
}

/// Runs `steps` engine steps for the given prompts (one sequence each, batch = all of
/// them); returns every sequence's tokens.
inline std::vector<std::vector<std::int32_t>> run_engine(
    std::shared_ptr<const engine::Checkpoint> ck, engine::EngineOptions o,
    const std::vector<std::vector<std::int32_t>>& prompts, int steps) {
  o.max_batch = static_cast<std::int32_t>(prompts.size());
  engine::Engine eng(std::move(ck), o);
  std::vector<engine::SeqId> ids;
  for (const auto& p : prompts) ids.push_back(eng.add_sequence(p));
  for (int s = 0; s < steps; ++s) eng.step();
  std::vector<std::vector<std::int32_t>> out;
  for (engine::SeqId id : ids) out.push_back(eng.tokens(id));
  return out;
}

/// `n` uniform random token ids in [0, vocab).
inline std::vector<std::int32_t> random_prompt(std::int32_t n, std::int32_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> d(0, vocab - 1);
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  for (auto& t : p) t = d(rng);
  return p;
}

/// What teacher forcing leaves: the logits of the step that processed the last prompt
/// token, and the tokens then (the prompt plus the greedy token it chose).
struct TeacherForced {
  std::vector<float> logits;         // [vocab]
  std::vector<std::int32_t> tokens;  // [prompt + 1]
};

/// Teacher forcing, the reference of every prefill test: one engine step per prompt token.
inline TeacherForced teacher_forced(std::shared_ptr<const engine::Checkpoint> ck, const engine::EngineOptions& o,
                                    const std::vector<std::int32_t>& prompt) {
  engine::Engine eng(std::move(ck), o);
  const engine::SeqId id = eng.add_sequence(prompt);
  for (std::size_t i = 0; i < prompt.size(); ++i) eng.step();
  return {eng.last_logits(id), eng.tokens(id)};
}

/// One view per layer over the engine's whole K/V pools, with an empty page table: what
/// Prefiller::run takes (it addresses pages by the ids it is given).
inline std::vector<PagedKVView<float>> pool_views(engine::Engine& eng) {
  std::vector<PagedKVView<float>> pools;
  for (int l = 0; l < eng.config().n_layers; ++l)
    pools.push_back(make_csr_view(eng.geometry(), eng.k_pool(l), eng.strides(), eng.v_pool(l), eng.strides(),
                                  CsrPageTable{nullptr, nullptr, nullptr, 0}));
  return pools;
}

}  // namespace test
}  // namespace kvkit
