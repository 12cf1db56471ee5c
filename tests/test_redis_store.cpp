// RedisBackend against real redis-server processes: URL parsing, AUTH, a pipelined batch of
// 2048 values of 16 KiB, BlockStore round trips of every dtype and layout, the longest
// complete prefix after deleting 10% of the keys, and a server paused (SIGSTOP) or killed
// in the middle of a batch: the call returns an error within deadline + one socket
// timeout, and the backend works again once the server is back.
// Uses $KVKIT_REDIS_URL (scripts/test.sh starts one) for the shared-server tests, else a
// private server; the pause/kill tests always start their own. Skips, saying why, when
// no redis-server binary can be found.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kvkit/store/redis_cluster.hpp"
#include "kvkit/store/redis_cluster_store.hpp"
#include "kvkit/store/redis_store.hpp"
#include "redis_cluster.hpp"
#include "redis_server.hpp"
#include "reference.hpp"
#include "test_scale.hpp"

using namespace kvkit;
using namespace kvkit::store;
using Clock = std::chrono::steady_clock;
using kvkit_test::free_port;
using kvkit_test::RedisServer;
using kvkit_test::node_command;
using kvkit_test::RedisCluster;

namespace {

// Whether a test's private server runs; when it does not, says so: the test skips.
bool started(const RedisServer& server) {
  if (!server.running()) WARN("no redis-server: skipped");
  return server.running();
}

// The shared server from $KVKIT_REDIS_URL, else a private one (kept for the process);
// false, after saying so (the test skips), when neither is there.
bool shared_options(RedisOptions* out) {
  if (const char* url = std::getenv("KVKIT_REDIS_URL")) {
    const Status st = parse_redis_url(url, out);
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    *out = kvkit_test::with_test_timeouts(*out);
    return true;
  }
  static std::unique_ptr<RedisServer> own;
  if (!own) own = std::make_unique<RedisServer>();
  if (!started(*own)) return false;
  *out = own->options();
  return true;
}

// The keys of a batch: prefix + "0" + suffix, ..., prefix + (n - 1) + suffix.
std::vector<std::string> numbered_keys(const std::string& prefix, std::size_t n, const std::string& suffix = "") {
  std::vector<std::string> keys(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = prefix + std::to_string(i) + suffix;
  return keys;
}

// `keys` with every `step`-th key from `first` on renamed to one that is absent.
std::vector<std::string> with_absent(std::vector<std::string> keys, std::size_t first, std::size_t step) {
  for (std::size_t i = first; i < keys.size(); i += step) keys[i] += "-absent";
  return keys;
}

// Puts every key: the call and every key must succeed.
void put_all(RedisBackend& b, const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  std::vector<KeyState> states(keys.size(), KeyState::kError);
  const Status st = b.put(keys.data(), values.data(), keys.size(), states.data());
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  for (auto s : states) REQUIRE(s == KeyState::kHit);
}

// One 3-master cluster for the whole binary (starting one costs seconds, more under ASan);
// null, after saying so (the test skips), without redis-server / redis-cli. Tests may move
// slots (the migration test) but leave every slot served.
RedisCluster* shared_cluster() {
  if (!kvkit_test::cluster_tools_found()) {
    WARN("no redis-server or no redis-cli (needed for --cluster create): skipped");
    return nullptr;
  }
  static std::unique_ptr<RedisCluster> cluster;
  if (!cluster) cluster = std::make_unique<RedisCluster>();
  REQUIRE(cluster->ok);
  return cluster.get();
}

std::string unique_ns(std::mt19937_64& rng) {
  return make_namespace("test_redis_store", std::to_string(rng()) + std::to_string(::getpid()));
}

std::vector<std::string> random_values(std::size_t n, std::size_t bytes, std::mt19937_64& rng) {
  std::vector<std::string> v(n, std::string(bytes, '\0'));
  for (auto& s : v)
    for (std::size_t i = 0; i < bytes; i += 8) {
      const std::uint64_t r = rng();
      std::memcpy(&s[i], &r, std::min<std::size_t>(8, bytes - i));
    }
  return v;
}

}  // namespace

TEST_CASE("parse_redis_url", "[redis]") {
  RedisOptions o;
  REQUIRE(parse_redis_url("redis://10.0.0.2:7000", &o).is_ok());
  CHECK(o.host == "10.0.0.2");
  CHECK(o.port == 7000);
  CHECK(o.password.empty());
  REQUIRE(parse_redis_url("redis://alice:s3cret@cache.local:6380/2", &o).is_ok());
  CHECK(o.user == "alice");
  CHECK(o.password == "s3cret");
  CHECK(o.host == "cache.local");
  CHECK(o.port == 6380);
  CHECK(o.db == 2);
  RedisOptions p;
  REQUIRE(parse_redis_url("redis://:pw@h", &p).is_ok());
  CHECK(p.user.empty());
  CHECK(p.password == "pw");
  CHECK(p.port == 6379);
  CHECK_FALSE(parse_redis_url("http://h:1", &p).is_ok());
  CHECK_FALSE(parse_redis_url("redis://h:99999", &p).is_ok());
  CHECK_FALSE(parse_redis_url("redis://h:x1", &p).is_ok());
  CHECK_FALSE(parse_redis_url("redis://", &p).is_ok());
}

TEST_CASE("parse_redis_url: unix sockets", "[redis]") {
  RedisOptions o;
  REQUIRE(parse_redis_url("unix:///run/redis/redis.sock", &o).is_ok());
  CHECK(o.unix_path == "/run/redis/redis.sock");
  CHECK(o.db == 0);
  CHECK(o.password.empty());
  RedisOptions p;
  REQUIRE(parse_redis_url("redis+unix://bob:pw@/tmp/r.sock?db=3", &p).is_ok());
  CHECK(p.unix_path == "/tmp/r.sock");
  CHECK(p.user == "bob");
  CHECK(p.password == "pw");
  CHECK(p.db == 3);
  RedisOptions q;
  REQUIRE(parse_redis_url("unix://:pw@/tmp/r.sock", &q).is_ok());
  CHECK(q.user.empty());
  CHECK(q.password == "pw");
  // A later redis:// URL goes back to TCP.
  REQUIRE(parse_redis_url("redis://h:7", &q).is_ok());
  CHECK(q.unix_path.empty());
  CHECK(q.host == "h");
  RedisOptions bad;
  CHECK_FALSE(parse_redis_url("unix://", &bad).is_ok());
  CHECK_FALSE(parse_redis_url("unix://relative.sock", &bad).is_ok());
  CHECK_FALSE(parse_redis_url("unix:///", &bad).is_ok());
  CHECK_FALSE(parse_redis_url("unix:///tmp/r.sock?db=x", &bad).is_ok());
  CHECK_FALSE(parse_redis_url("unix:///tmp/r.sock?timeout=3", &bad).is_ok());
  CHECK(bad.unix_path.empty());
}

TEST_CASE("detail::is_redirection: MOVED / ASK with their space, nothing else", "[redis]") {
  using kvkit::store::detail::is_redirection;
  using kvkit::store::detail::starts_with;
  CHECK(is_redirection("MOVED 3999 127.0.0.1:6381"));
  CHECK(is_redirection("ASK 3999 127.0.0.1:6381"));
  CHECK(is_redirection("MOVED "));
  // Not redirections: the word alone or longer, lower case, other cluster errors.
  for (const char* e : {"", "MOVED", "ASK", "ASKING", "MOVEDX 1 h:1", "moved 1 h:1", " MOVED 1 h:1",
                        "TRYAGAIN Multiple keys request during rehashing of slot",
                        "CROSSSLOT Keys in request don't hash to the same slot",
                        "CLUSTERDOWN The cluster is down", "ERR unknown command"}) {
    INFO(e);
    CHECK_FALSE(is_redirection(e));
  }
  CHECK(starts_with("TRYAGAIN x", "TRYAGAIN"));
  CHECK(starts_with("ASK", "ASK"));
  CHECK(starts_with("x", ""));
  CHECK_FALSE(starts_with("AS", "ASK"));
  CHECK_FALSE(starts_with("", "A"));
}

TEST_CASE("RedisBackend: pipelined batch of 2048 values of 16 KiB", "[redis]") {
  RedisOptions o;
  if (!shared_options(&o)) return;
  KVKIT_TEST_RNG(rng);
  const std::string ns = unique_ns(rng);
  const std::size_t n = 2048;
  const std::vector<std::string> keys = numbered_keys("kvblock:" + ns + ":0:", n, ":k");
  const auto values = random_values(n, 16384, rng);
  o.max_inflight_bytes = 1u << 20;  // a small window: many refills per batch
  RedisBackend redis(o);
  put_all(redis, keys, values);
  // Every other key absent.
  const std::vector<std::string> probe = with_absent(keys, 1, 2);
  std::vector<KeyState> states(n, KeyState::kError);
  Status st = redis.exists(probe.data(), n, states.data());
  REQUIRE(st.is_ok());
  for (std::size_t i = 0; i < n; ++i)
    REQUIRE(states[i] == (i % 2 == 0 ? KeyState::kHit : KeyState::kMiss));
  std::vector<std::string> got(n);
  st = redis.get(probe.data(), n, got.data(), states.data());
  REQUIRE(st.is_ok());
  for (std::size_t i = 0; i < n; ++i) {
    INFO("key " << i);
    REQUIRE(states[i] == (i % 2 == 0 ? KeyState::kHit : KeyState::kMiss));
    if (i % 2 == 0) REQUIRE(got[i] == values[i]);
  }
  st = redis.get(keys.data(), n, got.data(), states.data());
  REQUIRE(st.is_ok());
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
  // The unpipelined baseline reads the same bytes.
  std::vector<std::string> got1(64);
  REQUIRE(redis.get_unpipelined(keys.data(), 64, got1.data(), states.data()).is_ok());
  for (std::size_t i = 0; i < 64; ++i) REQUIRE(got1[i] == values[i]);
  CHECK(redis.connects() == 1);
  REQUIRE(redis.remove(keys.data(), n).is_ok());
  REQUIRE(redis.exists(keys.data(), n, states.data()).is_ok());
  for (auto s : states) REQUIRE(s == KeyState::kMiss);
}

namespace {

template <class T>
void redis_block_round_trip(BlockBackend& redis, std::mt19937_64& rng, Codec codec,
                            KeyStyle style = KeyStyle::kPlain) {
  for (KVLayout src_layout : {KVLayout::kNHD, KVLayout::kHND})
    for (KVLayout dst_layout : {KVLayout::kNHD, KVLayout::kHND}) {
      CAPTURE(to_string(dtype_of<T>::value), to_string(src_layout), to_string(dst_layout),
              static_cast<int>(codec));
      const std::int32_t blocks = 24, layers = 2, page = 8;
      test::PoolSpec s;
      s.num_kv_heads = 2;
      s.head_dim = 32;
      s.page_size = page;
      s.layout = src_layout;
      s.seq_lens = {blocks * page};
      s.row_padding = 3;
      std::vector<std::unique_ptr<test::RandomPool<T>>> src, dst;
      std::vector<PagedKVView<T>> sv, dv;
      test::PoolSpec d = s;
      d.layout = dst_layout;
      d.row_padding = 0;
      d.spare_pages = 9;
      for (int l = 0; l < layers; ++l) {
        std::mt19937_64 same_table_src(7), same_table_dst(11);
        src.push_back(std::make_unique<test::RandomPool<T>>(s, same_table_src));
        test::fill_uniform(src.back()->k.data(), src.back()->k.size(), rng);
        test::fill_uniform(src.back()->v.data(), src.back()->v.size(), rng);
        dst.push_back(std::make_unique<test::RandomPool<T>>(d, same_table_dst));
        sv.push_back(src.back()->view);
        dv.push_back(dst.back()->view);
      }
      BlockStoreConfig c;
      c.ns = unique_ns(rng);
      c.num_layers = layers;
      c.page_size = page;
      c.num_kv_heads = s.num_kv_heads;
      c.head_dim = s.head_dim;
      c.encode.codec = codec;
      c.blocks_per_batch = 10;
      c.key_style = style;
      BlockStore<T> store(redis, c);
      std::vector<std::int32_t> tokens(static_cast<std::size_t>(blocks * page));
      for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 49152);
      const auto hashes = prefix_block_hashes(tokens.data(), tokens.size(), page);
      REQUIRE(store.save_sequence(hashes.data(), hashes.size(), sv.data(), 0).is_ok());
      REQUIRE(store.match_blocks(hashes.data(), hashes.size()) == hashes.size());
      // Delete 10% of the keys; the match and the load stop at the first incomplete block.
      std::vector<std::string> all;
      for (const auto& h : hashes)
        for (int l = 0; l < layers; ++l)
          for (KVKind k : {KVKind::kKey, KVKind::kValue}) all.push_back(store.key(l, h, k));
      std::vector<std::string> shuffled = all;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      const std::set<std::string> deleted(shuffled.begin(), shuffled.begin() + all.size() / 10);
      const std::vector<std::string> del(deleted.begin(), deleted.end());
      REQUIRE(redis.remove(del.data(), del.size()).is_ok());
      std::size_t expect = 0;
      while (expect < hashes.size()) {
        bool complete = true;
        for (std::size_t j = 0; j < 2 * layers; ++j)
          complete = complete && !deleted.count(all[expect * 2 * layers + j]);
        if (!complete) break;
        ++expect;
      }
      CAPTURE(expect);
      CHECK(store.match_blocks(hashes.data(), hashes.size()) == expect);
      const LoadResult r = store.load_sequence(hashes.data(), hashes.size(), dv.data(), 0);
      CHECK(r.status.is_ok());
      REQUIRE(r.blocks_loaded == expect);
      for (std::size_t b = 0; b < expect; ++b)
        for (int l = 0; l < layers; ++l)
          for (std::int32_t t = 0; t < page; ++t)
            for (std::int32_t h = 0; h < s.num_kv_heads; ++h)
              for (std::int32_t x = 0; x < s.head_dim; ++x) {
                const std::int32_t tok = static_cast<std::int32_t>(b) * page + t;
                REQUIRE(test::same_bits(src[l]->k[src[l]->token_index(0, tok, h, x)],
                                        dst[l]->k[dst[l]->token_index(0, tok, h, x)]));
                REQUIRE(test::same_bits(src[l]->v[src[l]->v_token_index(0, tok, h, x)],
                                        dst[l]->v[dst[l]->v_token_index(0, tok, h, x)]));
              }
      REQUIRE(redis.remove(all.data(), all.size()).is_ok());
    }
}

}  // namespace

TEST_CASE("BlockStore over Redis: every dtype and layout, 10% deleted -> longest complete prefix",
          "[redis][connector]") {
  RedisOptions o;
  if (!shared_options(&o)) return;
  KVKIT_TEST_RNG(rng);
  RedisBackend redis(o);
  for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
    redis_block_round_trip<float>(redis, rng, codec);
    redis_block_round_trip<half_t>(redis, rng, codec);
    redis_block_round_trip<bfloat16_t>(redis, rng, codec);
  }
}

TEST_CASE("RedisBackend: AUTH", "[redis]") {
  RedisServer server("kvkit-pw");
  if (!started(server)) return;
  RedisBackend good(server.options());
  CHECK(good.connect().is_ok());
  RedisOptions bad_pw = server.options();
  bad_pw.password = "wrong";
  RedisBackend bad(bad_pw);
  const std::string key = "k";
  KeyState st = KeyState::kHit;
  const Status s = bad.exists(&key, 1, &st);
  CHECK_FALSE(s.is_ok());
  CHECK(st == KeyState::kError);
  RedisOptions none = server.options();
  none.password.clear();
  RedisBackend anon(none);
  CHECK_FALSE(anon.exists(&key, 1, &st).is_ok());
}

TEST_CASE("RedisBackend: server paused or killed mid-batch -> bounded error, then recovery",
          "[redis][fault]") {
  RedisServer server;
  if (!started(server)) return;
  KVKIT_TEST_RNG(rng);
  const std::size_t n = 2048;
  const std::vector<std::string> keys = numbered_keys("kvblock:fault:0:", n, ":v");
  const auto values = random_values(n, 16384, rng);
  std::vector<KeyState> states(n);
  std::vector<std::string> got(n);
  // Filled through a second connection with a generous deadline: the tested one may have a
  // deadline shorter than 32 MiB of SETs take on a loaded machine (or under ASan).
  auto fill = [&](RedisBackend&) {
    RedisOptions fo = server.options();
    fo.batch_deadline = std::chrono::milliseconds(60000);
    RedisBackend filler(fo);
    REQUIRE(filler.put(keys.data(), values.data(), n, states.data()).is_ok());
  };

  struct Case {
    int op_ms, deadline_ms;
  };
  // A short socket timeout inside a long deadline, and a deadline shorter than the socket
  // timeout (the deadline must win: the socket timeout is lowered to the time left).
  for (Case c : {Case{200, 5000}, Case{5000, 400}}) {
    CAPTURE(c.op_ms, c.deadline_ms);
    RedisOptions o = server.options();
    o.op_timeout = std::chrono::milliseconds(c.op_ms);
    o.batch_deadline = std::chrono::milliseconds(c.deadline_ms);
    o.max_inflight_bytes = 2u << 20;
    bool armed = false, stopped = false;  // armed for the get below only
    o.on_reply = [&](std::size_t done) {
      if (armed && done == 300 && !stopped) {
        server.signal(SIGSTOP);
        stopped = true;
      }
    };
    RedisBackend redis(o);
    fill(redis);
    const double bound_ms = c.deadline_ms + c.op_ms;
    // what the design gives: the stall ends at the first of socket timeout and deadline
    const double bound_with_slack = std::min<double>(c.deadline_ms, c.op_ms) + 500;
    armed = true;
    auto t0 = Clock::now();
    Status st = redis.get(keys.data(), n, got.data(), states.data());
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    INFO(st.to_string() << " after " << ms << " ms");
    REQUIRE(stopped);
    CHECK(st.code() == StatusCode::kTimeout);
    CHECK(ms < bound_ms);
    CHECK(ms < bound_with_slack);
    std::size_t hits = 0;
    while (hits < n && states[hits] == KeyState::kHit) ++hits;
    CHECK(hits >= 300);  // answered before the pause: kept, and bit-exact
    CHECK(hits < n);
    for (std::size_t i = 0; i < hits; ++i) REQUIRE(got[i] == values[i]);
    for (std::size_t i = hits; i < n; ++i) REQUIRE(states[i] == KeyState::kError);
    CHECK_FALSE(redis.connected());
    // Still paused: a new call (reconnect + PING) fails within its bound too.
    o.on_reply = nullptr;
    t0 = Clock::now();
    st = redis.exists(keys.data(), 16, states.data());
    ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    INFO(st.to_string() << " after " << ms << " ms (still paused)");
    CHECK_FALSE(st.is_ok());
    CHECK(ms < bound_ms);
    server.signal(SIGCONT);
    // Back: the next batch reconnects and reads everything.
    stopped = true;  // no more pauses from the hook
    st = redis.get(keys.data(), n, got.data(), states.data());
    INFO(st.to_string());
    REQUIRE(st.is_ok());
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
    CHECK(redis.connects() >= 2);
  }

  SECTION("killed mid-batch") {
    RedisOptions o = server.options();
    o.op_timeout = std::chrono::milliseconds(300);
    o.batch_deadline = std::chrono::milliseconds(3000);
    bool armed = false, killed = false;
    o.on_reply = [&](std::size_t done) {
      if (armed && done == 500 && !killed) {
        server.signal(SIGKILL);
        killed = true;
      }
    };
    RedisBackend redis(o);
    fill(redis);
    armed = true;
    const auto t0 = Clock::now();
    Status st = redis.get(keys.data(), n, got.data(), states.data());
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    INFO(st.to_string() << " after " << ms << " ms");
    REQUIRE(killed);
    CHECK_FALSE(st.is_ok());
    CHECK(ms < 3000 + 300);
    CHECK(states[n - 1] == KeyState::kError);
    CHECK_FALSE(redis.exists(keys.data(), 1, states.data()).is_ok());  // nobody listening
    REQUIRE(server.restart());
    // A fresh server has no data: misses, then a refill and a full read.
    REQUIRE(redis.exists(keys.data(), n, states.data()).is_ok());
    CHECK(states[0] == KeyState::kMiss);
    fill(redis);
    REQUIRE(redis.get(keys.data(), n, got.data(), states.data()).is_ok());
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
  }
}

TEST_CASE("cluster_key_slot matches CLUSTER KEYSLOT on 10k keys", "[redis][cluster]") {
  CHECK(crc16_xmodem("123456789", 9) == 0x31C3);
  CHECK(cluster_hash_part("a{b}c") == "b");
  CHECK(cluster_hash_part("a{}c{d}") == "a{}c{d}");  // empty first tag: whole key
  CHECK(cluster_hash_part("a}b{c") == "a}b{c");
  CHECK(cluster_hash_part("{x}{y}") == "x");
  RedisServer server({}, /*cluster_enabled=*/true);
  if (!started(server)) return;
  KVKIT_TEST_RNG(rng);
  std::vector<std::string> keys;
  const std::string ns = make_namespace("m");
  for (int i = 0; i < 3000; ++i) {
    BlockHash h;
    for (auto& b : h.bytes) b = static_cast<std::uint8_t>(rng());
    const int layer = static_cast<int>(rng() % 64);
    keys.push_back(block_key(ns, layer, h, KVKind::kKey));
    keys.push_back(block_key(ns, layer, h, KVKind::kValue, KeyStyle::kClusterTagged));
    // All keys of a tagged block share the slot of its hash.
    CHECK(cluster_key_slot(block_key(ns, 0, h, KVKind::kKey, KeyStyle::kClusterTagged)) ==
          cluster_key_slot(block_key(ns, 31, h, KVKind::kValue, KeyStyle::kClusterTagged)));
  }
  const char alphabet[] = "ab{}:xyz\x01\xff";
  while (keys.size() < 10000) {  // short random keys over an alphabet rich in braces
    std::string k(1 + rng() % 12, ' ');
    for (auto& c : k) c = alphabet[rng() % (sizeof(alphabet) - 1)];
    keys.push_back(k);
  }
  redisContext* c = redisConnect("127.0.0.1", server.port());
  REQUIRE(c != nullptr);
  REQUIRE(c->err == 0);
  for (const auto& k : keys) {
    const char* argv[3] = {"CLUSTER", "KEYSLOT", k.data()};
    const std::size_t len[3] = {7, 7, k.size()};
    redisAppendCommandArgv(c, 3, argv, len);
  }
  std::size_t mismatches = 0;
  for (const auto& k : keys) {
    void* raw = nullptr;
    REQUIRE(redisGetReply(c, &raw) == REDIS_OK);
    auto* r = static_cast<redisReply*>(raw);
    REQUIRE(r->type == REDIS_REPLY_INTEGER);
    if (r->integer != cluster_key_slot(k)) {
      ++mismatches;
      UNSCOPED_INFO("key '" << k << "': server " << r->integer << ", ours " << cluster_key_slot(k));
    }
    freeReplyObject(r);
  }
  redisFree(c);
  CHECK(mismatches == 0);
}


TEST_CASE("parse_redis_cluster_url", "[redis][cluster]") {
  RedisClusterOptions o;
  REQUIRE(parse_redis_cluster_url("redis-cluster://:pw@h1:7000,h2:7001", &o).is_ok());
  REQUIRE(o.seeds.size() == 2);
  CHECK(o.seeds[0] == std::make_pair(std::string("h1"), 7000));
  CHECK(o.seeds[1] == std::make_pair(std::string("h2"), 7001));
  CHECK(o.node.password == "pw");
  CHECK_FALSE(parse_redis_cluster_url("redis://h:1", &o).is_ok());
  CHECK_FALSE(parse_redis_cluster_url("redis-cluster://", &o).is_ok());
}

TEST_CASE("RedisClusterBackend: 3 masters, routing, BlockStore, live slot migration (ASK, MOVED)",
          "[redis][cluster]") {
  RedisCluster* shared = shared_cluster();
  if (shared == nullptr) return;
  RedisCluster& cluster = *shared;
  KVKIT_TEST_RNG(rng);
  RedisClusterBackend backend(cluster.options());
  REQUIRE(backend.refresh().is_ok());
  CHECK(backend.num_nodes() == 3);
  for (int slot : {0, 5000, 10000, 16383}) CHECK(backend.slot_owner(slot) >= 0);

  // Plain keys land on every node; round trip through per-node pipelines.
  const std::size_t n = 3000;
  std::vector<std::string> keys(n), got(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = "kvblock:c:0:" + std::to_string(rng()) + ":k";
  const auto values = random_values(n, 4096, rng);
  std::vector<KeyState> states(n);
  REQUIRE(backend.put(keys.data(), values.data(), n, states.data()).is_ok());
  REQUIRE(backend.get(keys.data(), n, got.data(), states.data()).is_ok());
  for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
  std::set<int> owners;
  for (const auto& k : keys) owners.insert(backend.slot_owner(cluster_key_slot(k)));
  CHECK(owners.size() == 3);
  CHECK(backend.redirects() == 0);
  REQUIRE(backend.remove(keys.data(), n).is_ok());
  REQUIRE(backend.exists(keys.data(), n, states.data()).is_ok());
  for (auto s : states) REQUIRE(s == KeyState::kMiss);

  // BlockStore with cluster-tagged keys (a block's keys share a slot).
  redis_block_round_trip<half_t>(backend, rng, Codec::kRaw, KeyStyle::kClusterTagged);

  // Live migration of one slot: keys tagged {mig} all live in it.
  const int slot = cluster_key_slot("{mig}");
  const int src_idx = backend.slot_owner(slot);
  REQUIRE(src_idx >= 0);
  int src_port = 0, dst_port = 0;
  // Which server owns the slot: the one that answers GET without MOVED.
  for (auto& s : cluster.servers) {
    const std::string r = node_command(s->port(), {"GET", "{mig}probe"});
    if (r.rfind("MOVED", 0) != 0) src_port = s->port();
  }
  for (auto& s : cluster.servers)
    if (s->port() != src_port) dst_port = s->port();
  REQUIRE(src_port != 0);
  const std::string src_id = node_command(src_port, {"CLUSTER", "MYID"});
  const std::string dst_id = node_command(dst_port, {"CLUSTER", "MYID"});
  const std::size_t m = 200;
  const std::vector<std::string> mkeys = numbered_keys("{mig}:", m);
  std::vector<std::string> mgot(m);
  const auto mvalues = random_values(m, 1000, rng);
  std::vector<KeyState> mstates(m);
  REQUIRE(backend.put(mkeys.data(), mvalues.data(), m, mstates.data()).is_ok());
  const std::string sl = std::to_string(slot);
  REQUIRE(node_command(dst_port, {"CLUSTER", "SETSLOT", sl, "IMPORTING", src_id}) == "OK");
  REQUIRE(node_command(src_port, {"CLUSTER", "SETSLOT", sl, "MIGRATING", dst_id}) == "OK");
  std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", std::to_string(dst_port), "", "0",
                                      "5000", "KEYS"};
  for (std::size_t i = 0; i < m / 2; ++i) migrate.push_back(mkeys[i]);
  REQUIRE(node_command(src_port, migrate) == "OK");
  // Half moved: the source answers ASK for those, the backend follows with ASKING.
  const std::uint64_t before = backend.redirects();
  Status st = backend.get(mkeys.data(), m, mgot.data(), mstates.data());
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  for (std::size_t i = 0; i < m; ++i) REQUIRE(mgot[i] == mvalues[i]);
  CHECK(backend.redirects() - before == m / 2);
  // Finish: move the rest, assign the slot to the target everywhere -> MOVED, map refresh.
  migrate.resize(7);
  for (std::size_t i = m / 2; i < m; ++i) migrate.push_back(mkeys[i]);
  REQUIRE(node_command(src_port, migrate) == "OK");
  for (auto& s : cluster.servers)
    REQUIRE(node_command(s->port(), {"CLUSTER", "SETSLOT", sl, "NODE", dst_id}) == "OK");
  st = backend.get(mkeys.data(), m, mgot.data(), mstates.data());
  INFO(st.to_string());
  REQUIRE(st.is_ok());
  for (std::size_t i = 0; i < m; ++i) REQUIRE(mgot[i] == mvalues[i]);
  CHECK(backend.slot_owner(slot) != src_idx);
  // Settled: no further redirections.
  const std::uint64_t settled = backend.redirects();
  REQUIRE(backend.get(mkeys.data(), m, mgot.data(), mstates.data()).is_ok());
  CHECK(backend.redirects() == settled);
}

namespace {

// A backend of node `port` as an ACL user that may run PING and the @read / @write commands
// on keys matching `key_pattern` only (INFO, of @dangerous, is refused), created now.
RedisOptions acl_user_options(const RedisServer& node, const std::string& user,
                              const std::string& key_pattern) {
  REQUIRE(node_command(node.port(), {"ACL", "SETUSER", user, "reset", "on", ">pw", "~" + key_pattern,
                                     "+@read", "+@write", "+ping"}) == "OK");
  RedisOptions o = node.options();
  o.user = user;
  o.password = "pw";
  return o;
}

// Whether node `port` serves `key` (a node answers MOVED for the keys of other masters).
bool serves(int port, const std::string& key) {
  const std::string r = node_command(port, {"EXISTS", key});
  REQUIRE_FALSE(r.empty());
  return r.rfind("MOVED", 0) != 0;
}

}  // namespace

TEST_CASE("RedisBackend: a Redis Cluster node given as redis:// fails at connect, naming redis-cluster://",
          "[redis][cluster]") {
  // The probe's two keys lie in different slots: a cluster node answers CROSSSLOT.
  CHECK(cluster_key_slot(kvkit::store::detail::kClusterProbeKeyA) !=
        cluster_key_slot(kvkit::store::detail::kClusterProbeKeyB));
  {
    // A plain server works; restarted as a cluster node (the only way a server becomes
    // one), the reconnect of the next call refuses it.
    // On a port whose cluster bus port (+ 10000) is free too, as cluster nodes need.
    std::unique_ptr<RedisServer> server;
    for (int attempt = 0; attempt < 16; ++attempt) {
      server = std::make_unique<RedisServer>();
      if (!server->running() ||
          (server->port() <= 55535 && kvkit_test::port_free(server->port() + 10000)))
        break;
    }
    RedisServer& plain = *server;
    if (!started(plain)) return;
    REQUIRE(plain.port() <= 55535);
    RedisBackend b(plain.options());
    REQUIRE(b.connect().is_ok());
    const std::vector<std::string> keys = numbered_keys("kvblock:nodeurl:", 4);
    const std::vector<std::string> values = {"a", "b", "c", "d"};
    put_all(b, keys, values);
    plain.set_cluster_enabled(true);
    REQUIRE(plain.restart());
    std::vector<std::string> got(keys.size());
    std::vector<KeyState> states(keys.size(), KeyState::kHit);
    Status st = b.get(keys.data(), keys.size(), got.data(), states.data());
    if (st.code() != StatusCode::kUnsupported) {
      // The call that finds the old connection closed fails as an I/O error and drops it.
      CHECK(st.code() == StatusCode::kIoError);
      for (auto s : states) CHECK(s == KeyState::kError);
      std::fill(states.begin(), states.end(), KeyState::kHit);
      st = b.get(keys.data(), keys.size(), got.data(), states.data());
    }
    CAPTURE(st.to_string());
    CHECK(st.code() == StatusCode::kUnsupported);
    CHECK_THAT(st.message(), Catch::Contains("redis://127.0.0.1:" + std::to_string(plain.port()) +
                                             " is a Redis Cluster node"));
    for (auto s : states) CHECK(s == KeyState::kError);
    CHECK(b.connect().code() == StatusCode::kUnsupported);
  }
  RedisCluster* cluster = shared_cluster();
  if (cluster == nullptr) return;
  RedisClusterBackend whole(cluster->options());
  for (const auto& node : cluster->servers) {
    const std::string port = std::to_string(node->port());
    CAPTURE(port);
    RedisBackend b(node->options());
    const Status st = b.connect();
    CAPTURE(st.to_string());
    CHECK(st.code() == StatusCode::kUnsupported);
    CHECK_THAT(st.message(), Catch::Contains("redis://127.0.0.1:" + port +
                                             " is a Redis Cluster node (INFO cluster says cluster_enabled:1)"));
    CHECK_THAT(st.message(), Catch::Contains("use redis-cluster://127.0.0.1:" + port));
    CHECK_FALSE(b.connected());
    // A batch call connects lazily: the same status, every key kError, nothing written.
    const std::vector<std::string> keys = numbered_keys("kvblock:nodeurl:" + port + ":", 16);
    const std::vector<std::string> values(keys.size(), "v");
    std::vector<KeyState> states(keys.size(), KeyState::kHit);
    CHECK(b.put(keys.data(), values.data(), keys.size(), states.data()).code() ==
          StatusCode::kUnsupported);
    for (auto s : states) CHECK(s == KeyState::kError);
    REQUIRE(whole.exists(keys.data(), keys.size(), states.data()).is_ok());
    for (auto s : states) CHECK(s == KeyState::kMiss);
    // RedisClusterBackend's per-node connections skip the check.
    RedisOptions o = node->options();
    o.allow_cluster_node = true;
    RedisBackend node_of_cluster(o);
    CHECK(node_of_cluster.connect().is_ok());
  }
  // A user that may not run INFO (@dangerous) is told all the same, by EXISTS's CROSSSLOT.
  const RedisServer& node = *cluster->servers[0];
  RedisBackend rw(acl_user_options(node, "kvkit-nodeurl-rw", "kvblock:*"));
  const Status st = rw.connect();
  CAPTURE(st.to_string());
  CHECK(st.code() == StatusCode::kUnsupported);
  CHECK_THAT(st.message(), Catch::Contains("is a Redis Cluster node (EXISTS over two slots: CROSSSLOT"));
  CHECK(node_command(node.port(), {"ACL", "DELUSER", "kvkit-nodeurl-rw"}) == "1");
}

TEST_CASE("RedisBackend: MOVED on the single-server path fails only its keys, saying MOVED; "
          "BlockStore: a miss on load, a failed save", "[redis][cluster][connector]") {
  RedisCluster* cluster = shared_cluster();
  if (cluster == nullptr) return;
  KVKIT_TEST_RNG(rng);
  // A user whose keys are kvblock:moved* may not run INFO nor touch the probe's keys: the
  // probe cannot tell, the backend connects as to a plain server and meets MOVED later.
  const RedisServer& node = *cluster->servers[0];
  const std::string ns = "moved" + std::to_string(rng() % 1000000000);
  RedisBackend b(acl_user_options(node, "kvkit-nodeurl-blocks", "kvblock:moved*"));
  REQUIRE(b.connect().is_ok());

  // Raw calls: keys this node serves succeed, the others are kError; the status says MOVED.
  std::vector<std::string> keys;
  std::vector<char> own;
  for (int i = 0; keys.size() < 24 || std::count(own.begin(), own.end(), 1) < 4 ||
                  std::count(own.begin(), own.end(), 0) < 4;
       ++i) {
    keys.push_back("kvblock:" + ns + ":0:" + std::to_string(i) + ":k");
    own.push_back(serves(node.port(), keys.back()) ? 1 : 0);
  }
  const std::size_t n = keys.size();
  const auto values = random_values(n, 3000, rng);  // above the in-place thresholds
  auto check_moved = [&](const Status& st, const std::vector<KeyState>& states, KeyState hit) {
    CAPTURE(st.to_string());
    CHECK(st.code() == StatusCode::kIoError);
    CHECK_THAT(st.message(), Catch::Contains("MOVED"));
    CHECK_THAT(st.message(), Catch::Contains("use redis-cluster://"));
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK(states[i] == (own[i] ? hit : KeyState::kError));
    }
  };
  std::vector<KeyState> states(n, KeyState::kMiss);
  check_moved(b.put(keys.data(), values.data(), n, states.data()), states, KeyState::kHit);
  std::vector<std::string> got(n, "untouched");
  check_moved(b.get(keys.data(), n, got.data(), states.data()), states, KeyState::kHit);
  for (std::size_t i = 0; i < n; ++i) CHECK(got[i] == (own[i] ? values[i] : std::string("untouched")));
  check_moved(b.exists(keys.data(), n, states.data()), states, KeyState::kHit);
  CHECK_THAT(b.remove(keys.data(), n).message(), Catch::Contains("MOVED"));
  REQUIRE(b.exists(keys.data(), n, states.data()).code() == StatusCode::kIoError);
  for (std::size_t i = 0; i < n; ++i) CHECK(states[i] == (own[i] ? KeyState::kMiss : KeyState::kError));
  CHECK(b.connects() == 1);  // the replies were all read: the connection stays

  // BlockStore (cluster-tagged keys: a block's keys share one slot): blocks are saved and
  // loaded up to the first block of another master's slot, whose failure says MOVED.
  const std::int32_t blocks = 6, layers = 2, page = 4;
  test::PoolSpec s;
  s.num_kv_heads = 2;
  s.head_dim = 8;
  s.page_size = page;
  s.seq_lens = {blocks * page};
  std::vector<std::unique_ptr<test::RandomPool<float>>> src, dst;
  std::vector<PagedKVView<float>> sv, dv;
  for (int l = 0; l < layers; ++l) {
    std::mt19937_64 table_src(7), table_dst(11);
    src.push_back(std::make_unique<test::RandomPool<float>>(s, table_src));
    test::fill_uniform(src.back()->k.data(), src.back()->k.size(), rng);
    test::fill_uniform(src.back()->v.data(), src.back()->v.size(), rng);
    dst.push_back(std::make_unique<test::RandomPool<float>>(s, table_dst));
    sv.push_back(src.back()->view);
    dv.push_back(dst.back()->view);
  }
  BlockStoreConfig c;
  c.ns = ns;
  c.num_layers = layers;
  c.page_size = page;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  c.key_style = KeyStyle::kClusterTagged;
  BlockStore<float> store(b, c);
  // Tokens whose leading blocks, at least one but not all, are served by this node.
  std::vector<BlockHash> hashes;
  std::size_t leading = 0;
  while (leading == 0 || leading == static_cast<std::size_t>(blocks)) {
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(blocks * page));
    for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 49152);
    hashes = prefix_block_hashes(tokens.data(), tokens.size(), page);
    leading = 0;
    while (leading < hashes.size() && serves(node.port(), store.key(0, hashes[leading], KVKind::kKey)))
      ++leading;
  }
  CAPTURE(leading);
  std::size_t saved = 99;
  Status st = store.save_sequence(hashes.data(), hashes.size(), sv.data(), 0, &saved);
  CAPTURE(st.to_string());
  CHECK_THAT(st.message(), Catch::Contains("MOVED"));
  CHECK(saved == leading);
  Status mst;
  CHECK(store.match_blocks(hashes.data(), hashes.size(), &mst) == leading);
  CHECK_THAT(mst.message(), Catch::Contains("MOVED"));
  const LoadResult r = store.load_sequence(hashes.data(), hashes.size(), dv.data(), 0);
  CHECK_THAT(r.status.message(), Catch::Contains("MOVED"));
  REQUIRE(r.blocks_loaded == leading);
  for (std::size_t blk = 0; blk < leading; ++blk)
    for (int l = 0; l < layers; ++l)
      for (std::int32_t t = 0; t < page; ++t)
        for (std::int32_t h = 0; h < s.num_kv_heads; ++h)
          for (std::int32_t x = 0; x < s.head_dim; ++x) {
            const std::int32_t tok = static_cast<std::int32_t>(blk) * page + t;
            REQUIRE(test::same_bits(src[l]->k[src[l]->token_index(0, tok, h, x)],
                                    dst[l]->k[dst[l]->token_index(0, tok, h, x)]));
            REQUIRE(test::same_bits(src[l]->v[src[l]->v_token_index(0, tok, h, x)],
                                    dst[l]->v[dst[l]->v_token_index(0, tok, h, x)]));
          }
  std::vector<std::string> all;
  for (const auto& h : hashes)
    for (int l = 0; l < layers; ++l)
      for (KVKind k : {KVKind::kKey, KVKind::kValue}) all.push_back(store.key(l, h, k));
  (void)b.remove(all.data(), all.size());  // this node's; the others were never written
  CHECK(node_command(node.port(), {"ACL", "DELUSER", "kvkit-nodeurl-blocks"}) == "1");
}

namespace {

// Peak and current resident set of this process, bytes (0 when /proc cannot be read).
std::size_t proc_status_bytes(const char* field) {  // "VmHWM:" or "VmRSS:"
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  std::size_t kb = 0;
  const std::size_t flen = std::strlen(field);
  while (std::fgets(line, sizeof(line), f) != nullptr)
    if (std::strncmp(line, field, flen) == 0) kb = std::strtoull(line + flen, nullptr, 10);
  std::fclose(f);
  return kb * 1024;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); false when not permitted. Free heap
// memory is handed back first (glibc's malloc_trim), so that what a measured call
// allocates shows up as new resident pages instead of reusing pages already counted.
bool reset_peak_rss() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

constexpr bool kAsan = kvkit::test::kSanitized;

}  // namespace

// The RESP writer (gathered sends, values referenced in place) and reader (values read
// with readv into their destinations) at the sizes where their paths switch, over TCP and
// a unix socket, with windows smaller and larger than one value.
TEST_CASE("RedisBackend: value sizes around the scatter / in-place thresholds, TCP and unix socket",
          "[redis]") {
  RedisServer server;
  if (!started(server)) return;
  KVKIT_TEST_RNG(rng);
  const std::vector<std::size_t> sizes = {0,     1,     2,     2047,  2048,   2049,   4095,
                                          4096,  4097,  16383, 16384, 16385,  20481,  65543,
                                          262144, 262157, (1u << 20) + 1, 3u << 20};
  const std::size_t n = 160;
  std::vector<std::string> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t sz = sizes[rng() % sizes.size()];
    values[i] = random_values(1, sz + 8, rng)[0].substr(0, sz);
  }
  for (bool unix_socket : {false, true})
    for (std::size_t window : {std::size_t{1} << 16, std::size_t{1} << 20, std::size_t{16} << 20}) {
      CAPTURE(unix_socket, window);
      RedisOptions o = unix_socket ? server.unix_options() : server.options();
      o.max_inflight_bytes = window;
      o.max_inflight_commands = 1 + rng() % 64;
      RedisBackend redis(o);
      const std::string ns = unique_ns(rng);
      const std::vector<std::string> keys = numbered_keys("sz:" + ns + ":", n);
      put_all(redis, keys, values);
      // Absent keys interleaved; destinations start with stale bytes of other sizes.
      const std::vector<std::string> probe = with_absent(keys, 0, 3);
      std::vector<KeyState> states(n, KeyState::kError);
      std::vector<std::string> got(n);
      for (std::size_t i = 0; i < n; ++i) got[i] = values[(i + 1) % n];
      const Status st = redis.get(probe.data(), n, got.data(), states.data());
      REQUIRE(st.is_ok());
      for (std::size_t i = 0; i < n; ++i) {
        CAPTURE(i, values[i].size());
        REQUIRE(states[i] == (i % 3 == 0 ? KeyState::kMiss : KeyState::kHit));
        if (i % 3 != 0) REQUIRE(got[i] == values[i]);
      }
      REQUIRE(redis.connects() == 1);
      REQUIRE(redis.remove(keys.data(), n).is_ok());
    }
  // SET ... EX: the TTL reaches the server (checked with a plain hiredis connection).
  RedisOptions o = server.unix_options();
  o.ttl_seconds = 1000;
  RedisBackend redis(o);
  const std::string key = "ttl:" + unique_ns(rng);
  const std::string value = random_values(1, 5000, rng)[0];
  KeyState ks = KeyState::kError;
  REQUIRE(redis.put(&key, &value, 1, &ks).is_ok());
  REQUIRE(ks == KeyState::kHit);
  redisContext* c = redisConnectUnix(server.unix_path().c_str());
  REQUIRE(c != nullptr);
  REQUIRE(c->err == 0);
  auto* r = static_cast<redisReply*>(redisCommand(c, "TTL %b", key.data(), key.size()));
  REQUIRE(r != nullptr);
  CHECK(r->type == REDIS_REPLY_INTEGER);
  CHECK(r->integer > 0);
  CHECK(r->integer <= 1000);
  freeReplyObject(r);
  redisFree(c);
}

TEST_CASE("BlockStore over Redis on a unix socket (redis+unix:// URL)", "[redis][connector]") {
  RedisServer server;
  if (!started(server)) return;
  KVKIT_TEST_RNG(rng);
  RedisOptions o;
  REQUIRE(parse_redis_url("redis+unix://" + server.unix_path(), &o).is_ok());
  RedisBackend redis(o);
  REQUIRE(redis.connect().is_ok());
  redis_block_round_trip<half_t>(redis, rng, Codec::kRaw);
  // A path nobody listens on: an error, not a hang.
  RedisOptions none;
  REQUIRE(parse_redis_url("unix://" + server.unix_path() + ".none", &none).is_ok());
  RedisBackend missing(none);
  CHECK(missing.connect().code() == StatusCode::kIoError);
}

// Client memory: the peak RSS growth of a batch of 2048 x 64 KiB (128 MiB) stays within
// the in-flight window plus a constant of 1 MiB (the 256 KiB read buffer, the headers of
// one window, 16 bytes of bookkeeping per key, hiredis' context), for put and for get into
// destinations that are already resident. Deterministic enough for a bound: nothing else
// allocates meanwhile. A client that buffered the batch (or copied values into an output
// buffer without a bound) would exceed it by about 128 MiB.
TEST_CASE("RedisBackend: client memory bounded by the in-flight window, not the batch", "[redis]") {
  if (kAsan) {
    WARN("ASan build: RSS includes shadow memory and the allocation quarantine: skipped");
    return;
  }
  if (!reset_peak_rss() || proc_status_bytes("VmHWM:") == 0) {
    WARN("cannot reset or read peak RSS (/proc/self/clear_refs, /proc/self/status): skipped");
    return;
  }
  {  // The probe sees a known allocation (so the bounds below can fail).
    REQUIRE(reset_peak_rss());
    const std::size_t rss = proc_status_bytes("VmRSS:");
    std::string block(4u << 20, '\0');
    for (std::size_t i = 0; i < block.size(); i += 4096) block[i] = static_cast<char>(i >> 12);
    const std::size_t seen = proc_status_bytes("VmHWM:") - std::min(rss, proc_status_bytes("VmHWM:"));
    INFO("a 4 MiB allocation raised the peak RSS by " << (seen >> 10) << " KiB");
    REQUIRE(seen >= (3u << 20));
  }
  RedisServer server;
  if (!started(server)) return;
  KVKIT_TEST_RNG(rng);
  const std::size_t n = 2048, size = 65536;
  const auto values = random_values(n, size, rng);
  const std::vector<std::string> keys = numbered_keys("mem:", n);
  std::vector<std::string> got(n, std::string(size, '\x5a'));  // resident before measuring
  std::vector<KeyState> states(n);
  constexpr std::size_t kConstant = 1u << 20;
  for (std::size_t window : {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
    for (bool unix_socket : {false, true}) {
      CAPTURE(window, unix_socket);
      RedisOptions o = unix_socket ? server.unix_options() : server.options();
      o.max_inflight_bytes = window;
      o.batch_deadline = std::chrono::milliseconds(60000);
      o.op_timeout = std::chrono::milliseconds(10000);
      // Fresh backends: their buffers are allocated inside the measured calls.
      RedisBackend redis(o), reader(o);
      REQUIRE(reset_peak_rss());
      const std::size_t rss0 = proc_status_bytes("VmRSS:");
      const Status sp = redis.put(keys.data(), values.data(), n, states.data());
      const std::size_t put_extra = proc_status_bytes("VmHWM:") - std::min(rss0, proc_status_bytes("VmHWM:"));
      INFO(sp.to_string());
      REQUIRE(sp.is_ok());
      REQUIRE(reset_peak_rss());
      const std::size_t rss1 = proc_status_bytes("VmRSS:");
      const Status sg = reader.get(keys.data(), n, got.data(), states.data());
      const std::size_t get_extra = proc_status_bytes("VmHWM:") - std::min(rss1, proc_status_bytes("VmHWM:"));
      INFO(sg.to_string());
      REQUIRE(sg.is_ok());
      for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
      std::printf("client memory, %zu x %zu B (%zu MiB) over %s, window %zu KiB: peak RSS over "
                  "the RSS before: put +%zu KiB, get +%zu KiB\n",
                  n, size, n * size >> 20, unix_socket ? "unix" : "tcp", window >> 10,
                  put_extra >> 10, get_extra >> 10);
      // The documented bound is window + constant; the client holds no reply or command
      // bytes beyond its read buffer, so it does not even grow with the window.
      CHECK(put_extra <= window + kConstant);
      CHECK(get_extra <= window + kConstant);
      CHECK(put_extra <= kConstant);
      CHECK(get_extra <= kConstant);
    }
  }
}

// Not run by default (hidden tag); prints throughput, asserts only correctness:
//   test_redis_store "[.bench]"
// Pipelined get/put vs one GET per key (each waiting for its reply), 2048 values of 16 KiB
// and 64 KiB on one connection, median of 7 runs each, in the same process.
TEST_CASE("RedisBackend throughput: pipelined vs one GET per key", "[.bench][redis]") {
  RedisOptions o;
  if (!shared_options(&o)) return;
  o.batch_deadline = std::chrono::milliseconds(60000);
  RedisBackend redis(o);
  KVKIT_TEST_RNG(rng);
  const std::string ns = unique_ns(rng);
  for (std::size_t size : {std::size_t{16384}, std::size_t{65536}}) {
    const std::size_t n = 2048;
    const std::vector<std::string> keys = numbered_keys("bench:" + ns + ":", n);
    std::vector<std::string> got(n);
    const auto values = random_values(n, size, rng);
    std::vector<KeyState> states(n);
    auto median_s = [&](auto&& call) {
      std::vector<double> t;
      for (int rep = 0; rep < 7; ++rep) {
        const auto t0 = Clock::now();
        const Status s = call();
        t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        REQUIRE(s.is_ok());
      }
      std::sort(t.begin(), t.end());
      return t[3];
    };
    const double put_s = median_s([&] { return redis.put(keys.data(), values.data(), n, states.data()); });
    const double get_s = median_s([&] { return redis.get(keys.data(), n, got.data(), states.data()); });
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
    const double one_s =
        median_s([&] { return redis.get_unpipelined(keys.data(), n, got.data(), states.data()); });
    for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i]);
    const double gb = static_cast<double>(n * size) / 1e9;
    std::printf("redis %zu x %zu B: put %.3f GB/s, get %.3f GB/s, one GET per key %.3f GB/s, "
                "get vs one-per-key %.2fx\n",
                n, size, gb / put_s, gb / get_s, gb / one_s, one_s / get_s);
    REQUIRE(redis.remove(keys.data(), n).is_ok());
  }
}
