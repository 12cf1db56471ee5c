#pragma once
// A private 3-master Redis Cluster for tests (cluster-enabled RedisServer nodes joined with
// `redis-cli --cluster create`), and node_command() to talk to one node directly. No
// Catch2 here, as in redis_server.hpp.
#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvkit/store/redis_cluster_store.hpp"
#include "redis_server.hpp"

namespace kvkit_test {

/// One command on a node, its reply as text (integers and statuses too); "" on failure.
inline std::string node_command(int port, const std::vector<std::string>& args) {
  redisContext* c = redisConnect("127.0.0.1", port);
  if (c == nullptr || c->err != 0) {
    if (c != nullptr) redisFree(c);
    return {};
  }
  std::vector<const char*> argv;
  std::vector<std::size_t> len;
  for (const auto& a : args) {
    argv.push_back(a.data());
    len.push_back(a.size());
  }
  auto* r = static_cast<redisReply*>(
      redisCommandArgv(c, static_cast<int>(args.size()), argv.data(), len.data()));
  std::string out;
  if (r != nullptr) {
    if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS ||
        r->type == REDIS_REPLY_ERROR)
      out = std::string(r->str, r->len);
    else if (r->type == REDIS_REPLY_INTEGER)
      out = std::to_string(r->integer);
    freeReplyObject(r);
  }
  redisFree(c);
  return out;
}

/// Whether a cluster can be made here: redis-server, and redis-cli for --cluster create.
inline bool cluster_tools_found() {
  return !find_redis_server().empty() && std::system("command -v redis-cli > /dev/null 2>&1") == 0;
}

/// A 3-master Redis Cluster on free loopback ports, joined with redis-cli --cluster create
/// (scripts/redis-cluster.sh does the same for the CLI demo); `ok` once every node reports
/// cluster_state:ok. Stopped on destruction.
struct RedisCluster {
  std::vector<std::unique_ptr<RedisServer>> servers;
  bool ok = false;
  RedisCluster() {
    for (int i = 0; i < 3; ++i) {
      servers.push_back(std::make_unique<RedisServer>(std::string(), true));
      if (!servers.back()->running()) return;
    }
    std::string cmd = "redis-cli --cluster create";
    for (auto& s : servers) cmd += " 127.0.0.1:" + std::to_string(s->port());
    cmd += " --cluster-replicas 0 --cluster-yes > /dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) return;
    for (int i = 0; i < 200; ++i) {  // until every node reports the cluster ok
      bool all = true;
      for (auto& s : servers)
        all = all && node_command(s->port(), {"CLUSTER", "INFO"}).find("cluster_state:ok") !=
                         std::string::npos;
      if (all) {
        ok = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  /// Options with the first node as the seed, and the test timeouts.
  kvkit::store::RedisClusterOptions options() const {
    kvkit::store::RedisClusterOptions o;
    o.seeds.emplace_back("127.0.0.1", servers[0]->port());
    o.node = with_test_timeouts(o.node);
    return o;
  }
  /// redis-cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3 (every node a seed).
  std::string url() const {
    std::string u = "redis-cluster://";
    for (std::size_t i = 0; i < servers.size(); ++i)
      u += (i ? ",127.0.0.1:" : "127.0.0.1:") + std::to_string(servers[i]->port());
    return u;
  }
};

}  // namespace kvkit_test
