// `kvkit sweep` (examples/cli/cmd_sweep.hpp): one full-cache run, every policy x budget
// teacher-forced from its record. Each run must give exactly the numbers of the separate
// `kvkit generate --policy P --budget B --compare-full --json` run (same engine arithmetic,
// so equality is exact, not within a tolerance), and --free-run exactly the tokens of
// `generate --policy P` without --compare-full.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "cli_runner.hpp"

namespace fs = std::filesystem;
using Json = nlohmann::json;
using namespace kvkit::test;  // cli_runner.hpp: run_cli, run_json, model_arg, kSmolPath

namespace {

const Json& find_run(const Json& sweep, const std::string& policy, int budget) {
  for (const Json& r : sweep.at("runs"))
    if (r.at("policy") == policy && r.at("budget") == budget) return r;
  FAIL("no run " << policy << " " << budget);
  static const Json none;
  return none;
}

// The fields a sweep run shares with `generate --compare-full --json`.
void check_same(const Json& run, const Json& gen) {
  for (const char* k : {"top1_agreement", "mean_kl", "median_kl", "max_kl", "compare_steps", "kv_bytes_final",
                        "full_kv_bytes_final", "compressions", "pages_freed", "tokens_dropped",
                        "deferred_steps"}) {
    CAPTURE(k);
    CHECK(run.at(k).get<double>() == gen.at(k).get<double>());
  }
}

}  // namespace

TEST_CASE("kvkit sweep: the same numbers as separate generate --compare-full runs (stories260K)",
          "[cli][sweep]") {
  // A prompt of several tokens: its steps are teacher-forced and not compared.
  for (const char* prompt : {"1 5 9 13 17"}) {
    CAPTURE(prompt);
    const std::string common = model_arg() + "--prompt '" + prompt + "' --steps 200 ";
    const Json s = run_json("sweep " + common +
                            "--policies r1kv,snapkv,streaming --budgets 32,64,200 --buffer 16 --free-run --json");
    for (const char* pol : {"r1kv", "snapkv", "streaming"}) {
      for (int budget : {32, 64}) {
        CAPTURE(pol, budget);
        const std::string gen = "generate " + common + "--policy " + pol + " --budget " +
                                std::to_string(budget) + " --buffer 16 --json";
        const Json g = run_json(gen + " --compare-full");
        const Json& r = find_run(s, pol, budget);
        check_same(r, g);
        CHECK(r.at("compressions").get<int>() > 0);
        CHECK(r.at("compare_steps") == 196);  // the steps after the 5-token prompt's 4
        CHECK(r.at("top1_agreement").get<double>() < 1.0);  // the comparison is not vacuous
        CHECK(r.at("tokens") == g.at("sequences").at(0).at("tokens"));
        const Json free = run_json(gen);  // its own greedy run
        CHECK(r.at("free").at("tokens") == free.at("sequences").at(0).at("tokens"));
      }
      // 200 positions never reach 200 + 16 cached tokens: the full cache exactly.
      CHECK(find_run(s, pol, 200).contains("skipped"));
    }
    CHECK(s.at("full").at("tokens") ==
          run_json("generate " + common + "--json").at("sequences").at(0).at("tokens"));
  }
}

TEST_CASE("kvkit sweep: SmolLM2 with a shared prefill, as separate generate runs", "[cli][sweep][smollm2]") {
  if (!fs::exists(kSmolPath)) {
    WARN("no model file " << kSmolPath << ": skipped");
    return;
  }
  // A chat prompt of ~40 tokens prefilled once; budget 24 + buffer 8 compresses after the
  // 8-query window fills, then every 8 steps.
  const std::string common = "--model '" + kSmolPath +
                             "' --prompt 'Name three rivers of Europe and one fact about each.' --chat "
                             "--max-tokens 32 --stop-at-eos ";
  const Json s = run_json("sweep " + common + "--policies r1kv --budgets 24 --buffer 8 --free-run");
  const Json& r = find_run(s, "r1kv", 24);
  const std::string gen = "generate " + common + "--policy r1kv --budget 24 --buffer 8 --json";
  const Json g = run_json(gen + " --compare-full");
  check_same(r, g);
  CHECK(r.at("compressions").get<int>() > 0);
  CHECK(s.at("full").at("tokens") == g.at("tokens"));  // teacher forcing: the full cache's answer
  const Json free = run_json(gen);
  CHECK(r.at("free").at("tokens") == free.at("tokens"));
  CHECK(r.at("free").at("text") == free.at("text"));
}

TEST_CASE("kvkit sweep: usage errors", "[cli][sweep]") {
  for (const std::string& args : {std::string("--policies r1kv"), std::string("--budgets 64 --policies h2o"),
                                  std::string("--budgets 8"), std::string("--budgets x1")}) {
    CAPTURE(args);
    const CliResult r = run_cli("sweep " + model_arg() + "--steps 20 " + args);
    CHECK(r.code == 2);
    CHECK(Json::parse(r.out).at("code") == 2);
  }
}
