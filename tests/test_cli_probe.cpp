// `kvkit probe`: the ChannelSelector's importance statistics as JSONL, for every score
// (ema, think, centered). Each update line's top sets must be exactly the top-r of the
// scores printed beside them (ties to the lower dim index, as kvkit/channel/kvchan.hpp
// documents), sizes and ranges must match the model, and the summary line must count the
// updates and heads. Bad values exit non-zero naming the value.

#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "cli_runner.hpp"

using namespace kvkit::test;

namespace {

// The r dims of largest score, ties to the lower index, ascending.
std::vector<std::int32_t> top_r(const std::vector<double>& score, std::size_t r) {
  std::vector<std::int32_t> idx(score.size());
  for (std::size_t d = 0; d < idx.size(); ++d) idx[d] = static_cast<std::int32_t>(d);
  std::stable_sort(idx.begin(), idx.end(), [&](std::int32_t a, std::int32_t b) {
    return score[static_cast<std::size_t>(a)] > score[static_cast<std::size_t>(b)];
  });
  idx.resize(r);
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<std::int32_t> sorted(std::vector<std::int32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("kvkit probe: top sets are the top-r of the printed scores, for every score", "[cli][kvchan]") {
  for (const char* score : {"ema", "think", "centered"}) {
    INFO("score " << score);
    TempDir tmp(std::string("probe_") + score);
    const std::string out = tmp.file("probe.jsonl");
    const CliResult r = run_cli("probe " + model_arg() + "--steps 24 --T-update 8 --N-stable 2 --kvchan-score " +
                                score + " --out '" + out + "'");
    INFO(r.err);
    REQUIRE(r.code == 0);
    std::istringstream lines(slurp(out));
    std::string line;
    std::int64_t update_lines = 0, max_update = 0;
    nlohmann::json summary;
    while (std::getline(lines, line)) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("summary")) {
        summary = j;
        continue;
      }
      ++update_lines;
      max_update = std::max<std::int64_t>(max_update, j.at("update").get<std::int64_t>());
      const auto ks = j.at("k_score").get<std::vector<double>>();
      const auto vs = j.at("v_score").get<std::vector<double>>();
      const auto kt = j.at("k_top").get<std::vector<std::int32_t>>();
      const auto vt = j.at("v_top").get<std::vector<std::int32_t>>();
      REQUIRE(ks.size() == vs.size());
      REQUIRE(j.at("v_ema").size() == ks.size());
      REQUIRE(kt.size() == std::max<std::size_t>(1, ks.size() / 2));  // default r = head_dim / 2
      REQUIRE(vt.size() == std::max<std::size_t>(1, ks.size() / 2));
      REQUIRE(sorted(kt) == top_r(ks, kt.size()));
      REQUIRE(sorted(vt) == top_r(vs, vt.size()));
      for (double x : ks) REQUIRE(x >= 0.0);
      for (double x : vs) REQUIRE(x >= 0.0);
      if (std::string(score) != "centered") REQUIRE(j.at("v_ema").get<std::vector<double>>() == vs);
      const double rk = j.at("retention_k").get<double>(), rv = j.at("retention_v").get<double>();
      REQUIRE((rk >= 0.0 && rk <= 1.0));
      REQUIRE((rv >= 0.0 && rv <= 1.0));
    }
    REQUIRE(!summary.is_null());
    const std::int64_t heads = summary.at("heads").get<std::int64_t>();
    REQUIRE(summary.at("updates").get<std::int64_t>() == max_update);
    REQUIRE(max_update >= 2);  // 24 steps at T_update 8
    REQUIRE(update_lines == max_update * heads);
    REQUIRE(summary.at("stable_heads").get<std::int64_t>() <= heads);
  }
}

TEST_CASE("kvkit probe rejects bad values naming them", "[cli][kvchan]") {
  const CliResult bad_score = run_cli("probe " + model_arg() + "--kvchan-score bogus");
  REQUIRE(bad_score.code != 0);
  REQUIRE_THAT(bad_score.err, Catch::Contains("bogus"));
  const CliResult bad_steps = run_cli("probe " + model_arg() + "--steps 0");
  REQUIRE(bad_steps.code != 0);
  REQUIRE_THAT(bad_steps.err, Catch::Contains("--steps"));
}
