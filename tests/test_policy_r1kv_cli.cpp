// `kvkit generate --policy r1kv|snapkv|streaming --budget B --buffer U [--compare-full]`
// (examples/cli/policy_r1kv.hpp): run the built binary (KVKIT_CLI_PATH) and check the
// JSON: the policy's counters (compressions, pages_freed, tokens_dropped) where the
// cadence makes them exact, the fidelity fields, and the usage errors.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "cli_runner.hpp"

namespace fs = std::filesystem;
using Json = nlohmann::json;
using namespace kvkit::test;  // cli_runner.hpp: run_cli, run_json, model_arg, kSmolPath

TEST_CASE("kvkit generate --policy r1kv --compare-full: counters and fidelity in the JSON", "[cli][r1kv]") {
  // 120 steps, budget 64 + buffer 32: one compression at 96 cached tokens (6 pages -> 4),
  // then 24 more steps: 88 cached (6 pages) against the full cache's 120 (8 pages).
  for (const char* pol : {"r1kv", "snapkv", "streaming"}) {
    CAPTURE(pol);
    const Json j = run_json("generate " + model_arg() + "--prompt 1 --steps 120 --policy " + pol +
                            " --budget 64 --buffer 32 --compare-full --json");
    CHECK(j.at("policy") == pol);
    CHECK(j.at("compressions") == 1);
    CHECK(j.at("pages_freed") == 2);
    CHECK(j.at("tokens_dropped") == 32);
    CHECK(j.at("pages_in_use") == 6);
    CHECK(j.at("kv_bytes_final").get<double>() == 0.75 * j.at("full_kv_bytes_final").get<double>());
    CHECK(j.at("compare_full") == true);
    CHECK(j.at("compare_steps") == 120);  // every step (the prompt is one token)
    const double agree = j.at("top1_agreement"), mean_kl = j.at("mean_kl"), max_kl = j.at("max_kl");
    CHECK(agree > 0.5);  // the 96 steps before the compression agree exactly
    CHECK(agree <= 1.0);
    CHECK(mean_kl >= 0.0);
    CHECK(max_kl >= mean_kl);
  }
}

TEST_CASE("kvkit generate --policy r1kv: a budget never reached is the full cache exactly", "[cli][r1kv]") {
  const Json j = run_json("generate " + model_arg() +
                          "--prompt '1 5 9' --prompt '1 7' --steps 100 --policy r1kv --budget 90 --buffer 16 "
                          "--window 4 --kernel 3 --lambda 0.5 --compare-full --json");
  CHECK(j.at("compressions") == 0);
  CHECK(j.at("top1_agreement") == 1.0);
  CHECK(j.at("mean_kl") == 0.0);
  CHECK(j.at("max_kl") == 0.0);
  CHECK(j.at("kv_bytes_final") == j.at("full_kv_bytes_final"));
}

TEST_CASE("kvkit generate --policy r1kv: usage errors name the value", "[cli][r1kv]") {
  struct Case {
    std::string args, message;
  };
  for (const Case& c : {Case{"--budget 64", "--budget needs --policy r1kv|snapkv|streaming"},
                        Case{"--policy snapkv --lambda 0.5 --buffer 3", "needs --budget B"},
                        Case{"--policy r1kv", "--policy r1kv needs --budget B"},
                        Case{"--policy r1kv --budget 8", "budget must be > window (8), got 8"},
                        Case{"--policy r1kv --budget 32 --kernel 4", "kernel must be odd and >= 1, got 4"},
                        Case{"--policy r1kv --budget 32 --lambda 1.5", "lambda must be in [0, 1], got 1.5"},
                        Case{"--policy streaming --budget 32 --buffer -1", "buffer must be >= 0, got -1"},
                        Case{"--policy r1kv --budget 600", "budget 600 must be below the model's seq_len 512"}}) {
    CAPTURE(c.args);
    const CliResult r = run_cli("generate --steps 8 " + c.args + " --json");
    CHECK(r.code != 0);
    CHECK_THAT(r.err, Catch::Contains(c.message));
  }
}

TEST_CASE("kvkit generate --policy r1kv+eps: two policies in one engine, both counters in the JSON", "[cli][r1kv][eps]") {
  // The compaction schedule is R1KV's alone (one compression at 96 cached tokens, as in
  // the r1kv case above); EPS re-summarises the pages it rewrote and reads a page subset.
  const Json alone = run_json("generate " + model_arg() + "--prompt 1 --steps 120 --policy r1kv --budget 64 "
                              "--buffer 32 --json");
  const Json j = run_json("generate " + model_arg() + "--prompt 1 --steps 120 --policy r1kv+eps --budget 64 "
                          "--buffer 32 --strict --eps 1e-3 --compare-full --json");
  CHECK(j.at("policy") == "r1kv+eps");
  CHECK(j.at("compressions") == 1);
  CHECK(j.at("pages_freed") == 2);
  CHECK(j.at("pages_in_use") == alone.at("pages_in_use"));
  CHECK(j.at("pages_total").get<double>() > 0);
  CHECK(j.at("pages_visited").get<double>() <= j.at("pages_total").get<double>());
  CHECK(j.at("summaries_rebuilt").get<double>() > 0);  // the compacted pages, every layer
  CHECK(j.at("certified_omitted_max").get<double>() <= 1e-3 * (1 + 1e-9));
  // KV bytes: R1KV's pages plus the summaries (a registered pool).
  CHECK(j.at("kv_bytes_final").get<double>() ==
        alone.at("kv_bytes_final").get<double>() + j.at("summary_bytes").get<double>());
  CHECK(j.at("top1_agreement").get<double>() > 0.5);

  struct Case {
    std::string args, message;
  };
  for (const Case& c : {Case{"--policy eps+kvchan", "eps and kvchan both replace the attention call"},
                        Case{"--policy r1kv+streaming --budget 32", "r1kv and streaming both move cached tokens"},
                        Case{"--policy r1kv+eps+r1kv --budget 32", "r1kv is listed twice"},
                        Case{"--policy r1kv+", "'' is not a policy"},
                        Case{"--policy none+eps", "none hosts nothing and cannot be combined"},
                        Case{"--policy r1kv+eps --W 64", "--W needs --policy kvchan"}}) {
    CAPTURE(c.args);
    const CliResult r = run_cli("generate --steps 8 " + c.args + " --json");
    CHECK(r.code == 2);
    CHECK_THAT(r.err, Catch::Contains(c.message));
  }
}

TEST_CASE("kvkit generate --policy r1kv on SmolLM2: prefilled prompt compressed", "[cli][r1kv][smollm2]") {
  if (!fs::exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath);
    return;
  }
  // The ~35-token chat prompt is prefilled (the policy sees no prompt queries), so the
  // first compression waits for a full window of 8 decode steps.
  const Json j = run_json("generate --model '" + kSmolPath +
                          "' --chat --prompt 'Write a Python function that reverses a string.' --max-tokens 16 "
                          "--policy r1kv --budget 24 --buffer 8 --compare-full --json");
  CHECK(j.at("compressions").get<int>() >= 1);
  CHECK(j.at("deferred_steps").get<int>() >= 1);
  CHECK(j.at("pages_freed").get<int>() >= 1);
  CHECK(j.at("compare_steps") == 16);
  CHECK(j.at("top1_agreement").get<double>() > 0.0);
  CHECK(j.at("kv_bytes_final").get<double>() < j.at("full_kv_bytes_final").get<double>());
}
