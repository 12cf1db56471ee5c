// `kvkit store-demo` run as a subprocess (KVKIT_CLI_PATH) on stories260K against every kind
// of --store: memory, a private redis-server (redis://) and a private 3-master Redis Cluster
// (redis-cluster://, every node or one as the seed). The stores must give the same numbers
// (blocks saved, hit tokens, prefill tokens avoided, per-request blocks and tokens) with
// outputs equal to the store-free run, delete every key they wrote (without --keep), and put
// a TTL on what --keep leaves. A redis-cluster:// URL that reaches no cluster fails at once,
// naming --store, and so does a node of the cluster given as redis:// (before the model is
// read, telling the user to use redis-cluster://).

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "cli_runner.hpp"
#include "redis_cluster.hpp"
#include "redis_server.hpp"
#include "test_scale.hpp"

using Json = nlohmann::json;
using kvkit::test::CliResult;
using kvkit::test::kStoriesPath;
using kvkit::test::run_cli;
using kvkit::test::run_json;
using kvkit_test::node_command;

namespace {

// The token-id workload: the default 272-token prefix and 4 requests; under the sanitizers
// (an ASan CLI, five runs) 7 prefix pages and 2 requests.
constexpr std::int32_t kPrefix = kvkit::test::scaled(272, 112);
constexpr std::int32_t kRequests = kvkit::test::scaled(4, 2);

Json store_demo(const std::string& store, const std::string& extra = "") {
  return run_json("store-demo --model '" + kStoriesPath + "' --store '" + store + "' --max-tokens 8 --json" +
                  " --prefix-tokens " + std::to_string(kPrefix) + " --requests " + std::to_string(kRequests) + extra);
}

// The numbers every store must reproduce (timings aside).
void check_same_as(const Json& got, const Json& want) {
  for (const char* k : {"blocks_saved", "warm_blocks_saved", "hit_tokens", "prefill_tokens_avoided", "removed_keys",
                        "shared_prefix_tokens", "outputs_match"}) {
    CAPTURE(k);
    CHECK(got.at(k) == want.at(k));
  }
  REQUIRE(got.at("requests").size() == want.at("requests").size());
  for (std::size_t i = 0; i < want.at("requests").size(); ++i) {
    const Json &g = got.at("requests")[i], &w = want.at("requests")[i];
    CAPTURE(i);
    for (const char* k : {"matched_blocks", "loaded_blocks", "cold_saved_blocks", "tokens", "baseline_tokens"}) {
      CAPTURE(k);
      CHECK(g.at(k) == w.at(k));
    }
    CHECK_FALSE(g.contains("load_error"));
  }
}

long long keys_on(int port) { return std::stoll(node_command(port, {"DBSIZE"})); }

}  // namespace

TEST_CASE("kvkit store-demo: memory, redis:// and redis-cluster:// give the same blocks, hits and outputs",
          "[cli][store_demo][redis][cluster]") {
  if (!std::filesystem::exists(kStoriesPath)) {
    WARN("skipped: no model file " << kStoriesPath);
    return;
  }
  const Json mem = store_demo("memory");
  CHECK(mem.at("outputs_match") == true);
  CHECK(mem.at("requests").size() == static_cast<std::size_t>(kRequests));
  CHECK(mem.at("shared_prefix_tokens").get<int>() >= kPrefix);
  CHECK(mem.at("blocks_saved").get<int>() > 0);
  CHECK(mem.at("hit_tokens").get<int>() >= mem.at("shared_prefix_tokens").get<int>() / 16 * 16);
  CHECK(mem.at("prefill_tokens_avoided") == mem.at("hit_tokens"));
  CHECK(mem.at("removed_keys").get<int>() > 0);

  if (!kvkit_test::cluster_tools_found()) {
    WARN("skipped the Redis stores: no redis-server or no redis-cli (needed for --cluster create)");
    return;
  }
  kvkit_test::RedisServer server;
  REQUIRE(server.running());
  const std::string redis_url = "redis://127.0.0.1:" + std::to_string(server.port());
  {
    INFO(redis_url);
    check_same_as(store_demo(redis_url), mem);
    CHECK(keys_on(server.port()) == 0);  // every key deleted
  }
  {
    // float16 pages and blocks through the real server: the same blocks and hits, the
    // warm run's outputs equal the float16 store-free run.
    const Json h = store_demo(redis_url, " --kv-dtype float16");
    CHECK(h.at("kv_dtype") == "float16");
    CHECK(h.at("outputs_match") == true);
    CHECK(h.at("blocks_saved") == mem.at("blocks_saved"));
    CHECK(h.at("hit_tokens") == mem.at("hit_tokens"));
    CHECK(keys_on(server.port()) == 0);
  }

  kvkit_test::RedisCluster cluster;
  REQUIRE(cluster.ok);
  {
    INFO(cluster.url());
    check_same_as(store_demo(cluster.url()), mem);
    for (const auto& s : cluster.servers) CHECK(keys_on(s->port()) == 0);
  }
  {
    // One node as the seed (the slot map names the others); --keep: the keys stay, spread
    // over the masters, each with the demo's TTL.
    const std::string one = "redis-cluster://127.0.0.1:" + std::to_string(cluster.servers[1]->port());
    INFO(one);
    const Json kept = store_demo(one, " --keep");
    CHECK(kept.at("removed_keys") == 0);
    CHECK(kept.at("outputs_match") == true);
    CHECK(kept.at("hit_tokens") == mem.at("hit_tokens"));
    long long total = 0;
    int holding = 0;
    for (const auto& s : cluster.servers) {
      const long long n = keys_on(s->port());
      total += n;
      holding += n > 0;
      if (n == 0) continue;
      const std::string key = node_command(s->port(), {"RANDOMKEY"});
      const long long ttl = std::stoll(node_command(s->port(), {"TTL", key}));
      CAPTURE(key, ttl);
      CHECK(ttl > 0);
      CHECK(ttl <= 3600);
    }
    // blocks_saved blocks, each a K and a V key per layer.
    CHECK(total == kept.at("blocks_saved").get<long long>() * 2 * kept.at("layers").get<long long>());
    CHECK(holding >= 2);
  }

  // A cluster node given as redis://: exit 1 before the model is read (a missing model file
  // is not reported), naming --store and redis-cluster://, nothing written.
  long long keys_before = 0;
  for (const auto& s : cluster.servers) keys_before += keys_on(s->port());
  for (const auto& s : cluster.servers) {
    const std::string node = "redis://127.0.0.1:" + std::to_string(s->port());
    CAPTURE(node);
    for (const std::string& model : {kStoriesPath, std::string("/nonexistent/kvkit-model.bin")}) {
      CAPTURE(model);
      const CliResult r = run_cli("store-demo --model '" + model + "' --store '" + node + "' --json");
      CHECK(r.code == 1);
      CHECK_THAT(r.err, Catch::Contains("kvkit: --store " + node + ": " + node + " is a Redis Cluster node"));
      CHECK_THAT(r.err, Catch::Contains("use redis-cluster://127.0.0.1:" + std::to_string(s->port())));
      const Json j = Json::parse(r.out);
      CHECK(j.at("code") == 1);
    }
  }
  long long keys_after = 0;
  for (const auto& s : cluster.servers) keys_after += keys_on(s->port());
  CHECK(keys_after == keys_before);

  // A redis-cluster:// URL that reaches no cluster: exit 1 before any run, naming --store.
  for (const std::string& bad : {"redis-cluster://127.0.0.1:" + std::to_string(server.port()),  // no cluster support
                                 "redis-cluster://127.0.0.1:" + std::to_string(kvkit_test::free_port())}) {
    CAPTURE(bad);
    const CliResult r = run_cli("store-demo --model '" + kStoriesPath + "' --store '" + bad + "' --json");
    CHECK(r.code == 1);
    CHECK_THAT(r.err, Catch::Contains("kvkit: --store " + bad + ": "));
    const Json j = Json::parse(r.out);
    CHECK(j.at("code") == 1);
  }
}

TEST_CASE("kvkit store-demo: --prefix-tokens / --requests size the token-id workload only", "[cli][store_demo]") {
  if (!std::filesystem::exists(kStoriesPath)) {
    WARN("skipped: no model file " << kStoriesPath);
    return;
  }
  const Json small = run_json("store-demo --model '" + kStoriesPath +
                              "' --store memory --max-tokens 4 --prefix-tokens 40 --requests 3 --json");
  CHECK(small.at("outputs_match") == true);
  CHECK(small.at("requests").size() == 3u);
  CHECK(small.at("shared_prefix_tokens").get<int>() >= 40);
  CHECK(small.at("workload") == "common prefix + 3 suffixes (token ids)");
  CHECK(small.at("hit_tokens").get<int>() >= 3 * 32);  // 2 full prefix pages, loaded by every request
  for (const char* bad : {"--prefix-tokens 0", "--requests 0", "--prefix-tokens 100000"}) {
    CAPTURE(bad);
    const CliResult r = run_cli("store-demo --model '" + kStoriesPath + "' --store memory --json " + bad);
    CHECK(r.code == 2);
  }
  if (!std::filesystem::exists(kvkit::test::kSmolPath)) {
    WARN("skipped the GGUF case: no model file " << kvkit::test::kSmolPath);
    return;
  }
  const CliResult r = run_cli("store-demo --model '" + kvkit::test::kSmolPath + "' --store memory --json --requests 2");
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("--requests sizes the token-id workload of llama2.c checkpoints"));
}
