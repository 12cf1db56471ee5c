#pragma once
// `kvkit generate --policy r1kv|snapkv|streaming`: the Compressor policies of
// <kvkit/compressor/> hosted by the example engine (engine/r1kv_policy.hpp).
//
//   --budget B           slots kept per kv head after a compression (required)
//   --buffer U           compress when kv_len >= B + U (default 128, the paper's)
//   --window W           query window and always-kept recent slots (default 8)
//   --kernel K           max-pool width over slot order, odd (default 7)
//   --lambda L           R1KV mix: Z = L*importance - (1-L)*redundancy (default 0.07)
//   --sinks N            StreamingLLM: first slots always kept (default 4)
//   --positional         keep slots in positional order (default: the reference's order)
//   --compress-prompt    also compress right after a prompt longer than B

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "cli/policies.hpp"
#include "engine/r1kv_policy.hpp"

namespace kvkit {
namespace cli {

/// The r1kv / snapkv / streaming family of --policy values.
inline PolicyEntry r1kv_policy_entry() {
  struct Opts {
    std::int32_t budget = 0, buffer = 128, window = 8, kernel = 7, sinks = 4;
    float lambda = 0.07f;
    bool positional = false, compress_prompt = false;
  };
  auto o = std::make_shared<Opts>();
  PolicyEntry e;
  e.names = {"r1kv", "snapkv", "streaming"};
  e.option_names = {"--budget", "--buffer", "--window", "--kernel", "--lambda",
                    "--sinks",  "--positional", "--compress-prompt"};
  e.add_options = [o](CLI::App& g) {
    g.add_option("--budget", o->budget,
                 "r1kv/snapkv/streaming: KV slots kept per head after a compression");
    g.add_option("--buffer", o->buffer,
                 "r1kv/snapkv/streaming: compress when the cache reaches budget + buffer (default 128)");
    g.add_option("--window", o->window,
                 "r1kv/snapkv/streaming: query window, also the recent slots always kept (default 8)");
    g.add_option("--kernel", o->kernel, "r1kv/snapkv: max-pool width over slots, odd (default 7)");
    g.add_option("--lambda", o->lambda,
                 "r1kv: importance weight of the score, 1 - lambda weighs redundancy (default 0.07)");
    g.add_option("--sinks", o->sinks, "streaming: first tokens always kept (default 4)");
    g.add_flag("--positional", o->positional,
               "r1kv/snapkv/streaming: keep slots in positional order (default: reference order)");
    g.add_flag("--compress-prompt", o->compress_prompt,
               "r1kv/snapkv/streaming: also compress to budget right after a prompt longer than budget");
  };
  e.make = [o](const std::string& name, const engine::ModelConfig&,
               const engine::EngineOptions&) -> std::unique_ptr<engine::EnginePolicy> {
    KVKIT_CHECK(o->budget > 0, "kvkit: --policy ", name, " needs --budget B (> --window ", o->window,
                "), got ", o->budget);
    engine::CompressorPolicyOptions po;
    po.params.budget = o->budget;
    po.params.buffer = o->buffer;
    po.params.window = o->window;
    po.params.kernel = o->kernel;
    po.params.lambda = o->lambda;
    po.params.sinks = o->sinks;
    po.params.order = o->positional ? compressor::KeepOrder::kPositional : compressor::KeepOrder::kReference;
    po.compress_prompt = o->compress_prompt;
    if (name == "r1kv") return std::make_unique<engine::R1KVPolicy>(po);
    if (name == "snapkv") return std::make_unique<engine::SnapKVPolicy>(po);
    if (name == "streaming") return std::make_unique<engine::StreamingLLMPolicy>(po);
    fail("kvkit: unknown compressor policy '", name, "'");
  };
  return e;
}

}  // namespace cli
}  // namespace kvkit
