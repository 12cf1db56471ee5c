#pragma once
// Small drivers of the example engine shared by the engine and CLI tests.

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/engine.hpp"

namespace kvkit {
namespace test {

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

}  // namespace test
}  // namespace kvkit
