#pragma once
// RedisClusterBackend: the BlockBackend of a Redis Cluster (masters only), over one
// pipelined RedisBackend per node. Link kvkit::redis.
//
// Routing: a slot map (16384 entries) from CLUSTER SLOTS, keys grouped by the node that
// owns their slot (cluster_key_slot) and sent as one pipelined subset batch per node.
// Redirections are per key: MOVED updates that slot's owner (and re-reads the whole map
// once per call) and retries the key there; ASK retries it once on the named node after
// ASKING; TRYAGAIN retries after a short pause. At most max_redirects rounds per call;
// keys still redirected after that are kError. Each node batch has RedisOptions'
// deadline, so a call takes at most (rounds x nodes) deadlines; deadlines, errors and
// reconnects per node behave as RedisBackend's.

#include <hiredis/hiredis.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kvkit/store/redis_cluster.hpp"
#include "kvkit/store/redis_store.hpp"

namespace kvkit {
namespace store {

/// Seeds and per-node settings of a RedisClusterBackend.
struct RedisClusterOptions {
  std::vector<std::pair<std::string, int>> seeds;  // host, port: any reachable node will do
  RedisOptions node;                               // timeouts, windows, AUTH of every node
  int max_redirects = 5;                           // redirect rounds per call
};

/// Parses redis-cluster://[[user]:password@]host:port[,host:port...] into `out` (seeds
/// replaced, node credentials set). kInvalidArgument otherwise.
inline Status parse_redis_cluster_url(std::string_view url, RedisClusterOptions* out) {
  constexpr std::string_view kScheme = "redis-cluster://";
  KVKIT_CHECK_STATUS(url.substr(0, kScheme.size()) == kScheme, StatusCode::kInvalidArgument,
                     "cluster URL '", url, "' does not start with redis-cluster://");
  std::string_view rest = url.substr(kScheme.size());
  RedisClusterOptions o = *out;
  o.seeds.clear();
  std::string cred;
  const std::size_t at = rest.rfind('@');
  if (at != std::string_view::npos) {
    cred = std::string(rest.substr(0, at)) + "@";
    rest = rest.substr(at + 1);
  }
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view one = rest.substr(0, comma);
    RedisOptions node = o.node;
    KVKIT_RETURN_IF_ERROR(parse_redis_url("redis://" + cred + std::string(one), &node));
    o.node.user = node.user;
    o.node.password = node.password;
    o.seeds.emplace_back(node.host, node.port);
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  KVKIT_CHECK_STATUS(!o.seeds.empty(), StatusCode::kInvalidArgument, "cluster URL '", url,
                     "' names no node");
  *out = std::move(o);
  return Status::ok();
}

/// BlockBackend over a Redis Cluster (see the file comment). Not thread-safe.
class RedisClusterBackend final : public BlockBackend {
 public:
  explicit RedisClusterBackend(RedisClusterOptions options) : opt_(std::move(options)) {
    KVKIT_CHECK(!opt_.seeds.empty(), "kvkit: RedisClusterOptions has no seed node");
    KVKIT_CHECK(opt_.max_redirects >= 0, "kvkit: max_redirects must be >= 0, got ",
                opt_.max_redirects);
    slot_node_.fill(-1);
  }

  /// Reads the slot map (CLUSTER SLOTS) from the first known node that answers.
  Status refresh() {
    std::vector<std::pair<std::string, int>> order;
    for (const auto& n : nodes_) order.emplace_back(n.host, n.port);
    order.insert(order.end(), opt_.seeds.begin(), opt_.seeds.end());
    Status last = make_status(StatusCode::kIoError, "no cluster node answered");
    for (const auto& hp : order) {
      last = refresh_from(hp.first, hp.second);
      if (last.is_ok()) return last;
    }
    return last;
  }

  /// Node index owning `slot` (-1: unknown), and the nodes known so far.
  int slot_owner(int slot) const { return slot_node_[static_cast<std::size_t>(slot)]; }
  std::size_t num_nodes() const { return nodes_.size(); }
  /// Redirections followed so far (MOVED, ASK, TRYAGAIN).
  std::uint64_t redirects() const { return redirects_followed_; }

  Status get(const std::string* keys, std::size_t n, std::string* values,
             KeyState* states) override {
    return run(keys, n, states, [&](RedisBackend& b, std::size_t m) {
      return b.get(keys, m, values, states);
    });
  }
  Status put(const std::string* keys, const std::string* values, std::size_t n,
             KeyState* states) override {
    return run(keys, n, states, [&](RedisBackend& b, std::size_t m) {
      return b.put(keys, values, m, states);
    });
  }
  Status exists(const std::string* keys, std::size_t n, KeyState* states) override {
    return run(keys, n, states, [&](RedisBackend& b, std::size_t m) {
      return b.exists(keys, m, states);
    });
  }
  Status remove(const std::string* keys, std::size_t n) override {
    del_states_.resize(n);
    return run(keys, n, del_states_.data(), [&](RedisBackend& b, std::size_t m) {
      return b.remove(keys, m);
    });
  }

 private:
  struct Node {
    std::string host;
    int port = 0;
    std::unique_ptr<RedisBackend> backend;
  };

  int node_index(const std::string& host, int port) {
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (nodes_[i].host == host && nodes_[i].port == port) return static_cast<int>(i);
    RedisOptions o = opt_.node;
    o.host = host;
    o.port = port;
    o.unix_path.clear();  // nodes are addressed by the slot map's host:port
    o.allow_cluster_node = true;  // redirections are followed here (subset calls)
    nodes_.push_back(Node{host, port, std::make_unique<RedisBackend>(o)});
    return static_cast<int>(nodes_.size() - 1);
  }

  Status refresh_from(const std::string& host, int port) {
    const auto ms = opt_.node.connect_timeout.count();
    timeval tv{static_cast<decltype(tv.tv_sec)>(ms / 1000),
               static_cast<decltype(tv.tv_usec)>((ms % 1000) * 1000)};
    redisContext* c = redisConnectWithTimeout(host.c_str(), port, tv);
    if (c == nullptr || c->err != 0) {
      const std::string msg = c != nullptr ? c->errstr : "out of memory";
      if (c != nullptr) redisFree(c);
      return make_status(StatusCode::kIoError, "cluster node ", host, ":", port, ": ", msg);
    }
    const auto op = opt_.node.op_timeout.count();
    redisSetTimeout(c, timeval{static_cast<decltype(tv.tv_sec)>(op / 1000),
                               static_cast<decltype(tv.tv_usec)>((op % 1000) * 1000)});
    Status st;
    if (!opt_.node.password.empty()) {
      auto* a = static_cast<redisReply*>(
          opt_.node.user.empty()
              ? redisCommand(c, "AUTH %b", opt_.node.password.data(), opt_.node.password.size())
              : redisCommand(c, "AUTH %b %b", opt_.node.user.data(), opt_.node.user.size(),
                             opt_.node.password.data(), opt_.node.password.size()));
      if (a == nullptr || a->type == REDIS_REPLY_ERROR)
        st = make_status(StatusCode::kIoError, "cluster node ", host, ":", port, ": AUTH failed");
      if (a != nullptr) freeReplyObject(a);
    }
    redisReply* r = st.is_ok() ? static_cast<redisReply*>(redisCommand(c, "CLUSTER SLOTS")) : nullptr;
    if (st.is_ok() && (r == nullptr || r->type != REDIS_REPLY_ARRAY))
      st = make_status(StatusCode::kIoError, "cluster node ", host, ":", port,
                       ": CLUSTER SLOTS failed", r != nullptr && r->type == REDIS_REPLY_ERROR
                                                     ? std::string(": ") + r->str
                                                     : std::string());
    if (st.is_ok()) {
      std::array<int, kClusterSlots> map;
      map.fill(-1);
      for (std::size_t i = 0; i < r->elements && st.is_ok(); ++i) {
        const redisReply* e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
          st = make_status(StatusCode::kIoError, "cluster node ", host, ":", port,
                           ": unexpected CLUSTER SLOTS reply");
          break;
        }
        const long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        std::string node_host(e->element[2]->element[0]->str, e->element[2]->element[0]->len);
        if (node_host.empty() || node_host == "?") node_host = host;  // "same as asked"
        const int idx = node_index(node_host, static_cast<int>(e->element[2]->element[1]->integer));
        for (long long s = std::max(0LL, lo); s <= hi && s < kClusterSlots; ++s)
          map[static_cast<std::size_t>(s)] = idx;
      }
      if (st.is_ok()) slot_node_ = map;
    }
    if (r != nullptr) freeReplyObject(r);
    redisFree(c);
    return st;
  }

  // Parses "MOVED 3999 127.0.0.1:6381" / "ASK ..." into slot and node index.
  bool parse_redirect(const std::string& text, int* slot, int* node) {
    const std::size_t a = text.find(' ');
    const std::size_t b = a == std::string::npos ? a : text.find(' ', a + 1);
    if (b == std::string::npos) return false;
    const std::string addr = text.substr(b + 1);
    const std::size_t colon = addr.rfind(':');
    if (colon == std::string::npos) return false;
    auto number = [](const std::string& d, int* v) {  // no exceptions: plain digits only
      if (d.empty() || d.size() > 5 || d.find_first_not_of("0123456789") != std::string::npos)
        return false;
      *v = std::atoi(d.c_str());
      return true;
    };
    int port = 0;
    if (!number(text.substr(a + 1, b - a - 1), slot) || !number(addr.substr(colon + 1), &port) ||
        *slot >= kClusterSlots || port <= 0 || port > 65535)
      return false;
    *node = node_index(addr.substr(0, colon), port);
    return true;
  }

  // Runs op over every key, grouped by node, following redirections.
  template <class Op>
  Status run(const std::string* keys, std::size_t n, KeyState* states, Op&& op) {  // [n]
    Status first;
    if (n == 0) return first;
    if (nodes_.empty()) {
      const Status s = refresh();
      if (!s.is_ok()) {
        for (std::size_t i = 0; i < n; ++i) states[i] = KeyState::kError;
        return s;
      }
    }
    // (key index, target node, asking) of this round.
    std::vector<std::pair<std::size_t, int>> todo, ask;
    todo.reserve(n);
    for (std::size_t i = 0; i < n; ++i) todo.emplace_back(i, slot_owner(cluster_key_slot(keys[i])));
    bool refreshed = false;
    for (int round = 0; round <= opt_.max_redirects && (!todo.empty() || !ask.empty()); ++round) {
      std::vector<std::pair<std::size_t, std::string>> redirects;
      for (int pass = 0; pass < 2; ++pass) {
        auto& list = pass == 0 ? todo : ask;
        for (std::size_t nd = 0; nd < nodes_.size(); ++nd) {
          index_.clear();
          for (const auto& t : list)
            if (t.second == static_cast<int>(nd)) index_.push_back(t.first);
          if (index_.empty()) continue;
          const Status s = nodes_[nd].backend->subset(index_.data(), index_.size(), &redirects,
                                                       pass == 1, op);
          if (!s.is_ok() && first.is_ok()) first = s;
        }
        for (const auto& t : list)
          if (t.second < 0) {
            states[t.first] = KeyState::kError;
            if (first.is_ok())
              first = make_status(StatusCode::kIoError, "no cluster node serves the slot of ",
                                  keys[t.first]);
          }
      }
      todo.clear();
      ask.clear();
      for (const auto& r : redirects) {
        ++redirects_followed_;
        int slot = 0, node = -1;
        if (r.second.rfind("TRYAGAIN", 0) == 0) {
          todo.emplace_back(r.first, slot_owner(cluster_key_slot(keys[r.first])));
          continue;
        }
        if (!parse_redirect(r.second, &slot, &node)) {
          if (first.is_ok()) first = make_status(StatusCode::kIoError, "bad redirect: ", r.second);
          continue;
        }
        if (r.second.rfind("MOVED", 0) == 0) {
          if (!refreshed) {  // the map is stale: re-read it once per call
            refreshed = true;
            (void)refresh();
          }
          slot_node_[static_cast<std::size_t>(slot)] = node;
          todo.emplace_back(r.first, node);
        } else {
          ask.emplace_back(r.first, node);
        }
      }
      if (!todo.empty() && round < opt_.max_redirects && todo.size() == redirects.size() &&
          redirects[0].second.rfind("TRYAGAIN", 0) == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!todo.empty() || !ask.empty()) {
      for (const auto& t : todo) states[t.first] = KeyState::kError;
      for (const auto& t : ask) states[t.first] = KeyState::kError;
      if (first.is_ok())
        first = make_status(StatusCode::kIoError, "cluster redirections did not settle after ",
                            opt_.max_redirects, " rounds");
    }
    return first;
  }

  RedisClusterOptions opt_;
  std::vector<Node> nodes_;
  std::array<int, kClusterSlots> slot_node_;
  std::vector<std::size_t> index_;
  std::vector<KeyState> del_states_;
  std::uint64_t redirects_followed_ = 0;
};

}  // namespace store
}  // namespace kvkit
