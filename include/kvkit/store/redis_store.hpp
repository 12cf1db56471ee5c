#pragma once
// RedisBackend: the BlockBackend of a single Redis (or Redis-protocol) server over
// hiredis 0.14's synchronous API. Link kvkit::redis (hiredis); nothing else includes this.
//
// Why it does not stall: every batch is one pipeline (commands written back to back,
// replies read in order), so N keys cost about one round trip plus N * value / bandwidth
// instead of N round trips (the seed's one GET per key). The pipeline is a sliding window
// bounded in commands and bytes in flight, so neither side buffers a whole batch.
// hiredis connects (TCP or a unix socket), authenticates and sets timeouts; the batch
// traffic bypasses it, because hiredis 0.14 copies every argument into its output buffer
// (redisAppendCommandArgv) and every reply value twice (its reader): commands are
// formatted here as RESP, small parts into one buffer and large values referenced in
// place, and sent with a gathering sendmsg (a SET value is never copied in user space);
// replies are parsed here straight from the socket, a large GET value read with readv
// directly into its destination string (what follows it goes to a small side buffer).
// hiredis 0.14 only has per-socket-operation timeouts (SO_RCVTIMEO / SO_SNDTIMEO), so the
// batch deadline is ours: it is checked before each reply, and near the end the socket
// timeout is lowered to the time left, so a batch returns within its deadline plus at
// most one socket timeout even when the server stops answering. A connection that failed
// or timed out mid-pipeline still has replies owed to it, so it is dropped; the next call
// reconnects (AUTH, SELECT, then a PING health check) within its own deadline.
// Batch writes use MSG_NOSIGNAL; hiredis' own writes (AUTH, SELECT, PING) to a closed
// socket would raise SIGPIPE, so connecting sets SIGPIPE to SIG_IGN when it is still
// SIG_DFL (a process-wide setting, as most servers already have it).
// A Redis Cluster node is refused at every connect (RedisOptions::allow_cluster_node,
// ping_and_probe_mode): a single-server client would get MOVED for the keys of every slot
// that other masters serve. A MOVED / ASK reply met anyway (a probe an ACL refused) fails
// only its key, with a status that says MOVED and names redis-cluster://.
// Client memory is bounded independently of the batch: a 256 KiB read buffer, the
// formatted command headers of one window (values are referenced, not copied) and 16
// bytes of bookkeeping per key; the in-flight byte window bounds what the server and the
// kernel buffer on the connection's behalf.

#include <hiredis/hiredis.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvkit/store/block_store.hpp"

namespace kvkit {
namespace store {

/// Connection and flow-control settings of a RedisBackend.
struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string unix_path;  // non-empty: connect to this unix socket (host, port unused)
  std::string user;      // ACL user for AUTH (empty: AUTH <password> only)
  std::string password;  // empty: no AUTH
  int db = 0;            // SELECT when nonzero
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds op_timeout{500};       // per socket read/write (hiredis timeout)
  std::chrono::milliseconds batch_deadline{5000};  // whole get/put/exists/remove call
  std::size_t max_inflight_commands = 512;         // pipeline window, commands
  // Pipeline window in request + expected reply bytes. Small windows keep both ends' buffers
  // in cache (1 MiB measured 1.3-3x faster than 16 MiB on loopback); raise it to the
  // bandwidth-delay product of a long network path.
  std::size_t max_inflight_bytes = 1u << 20;
  std::uint32_t ttl_seconds = 0;                   // SET ... EX ttl when nonzero
  // SO_RCVBUF and SO_SNDBUF of the socket when nonzero (0: the kernel's defaults, which
  // autotune on TCP).
  std::size_t socket_buffer_bytes = 0;
  // false (default): every (re)connect checks that the server is not a Redis Cluster node
  // and fails with kUnsupported, naming redis-cluster://, when it is. true: no check (the
  // per-node connections of RedisClusterBackend, which follows the redirections itself).
  bool allow_cluster_node = false;
  /// Called after each reply of a batch with the number of replies so far (metrics, and
  /// tests that must act at a known point of a batch). Empty: not called.
  std::function<void(std::size_t)> on_reply;
};

namespace detail {
// Two keys in different Redis Cluster slots (15495 and 3300), for the connect-time probe
// whether a server is a cluster node: under kvblock: like the block keys, so an ACL key
// pattern that admits those admits them.
inline constexpr std::string_view kClusterProbeKeyA = "kvblock:cluster-probe:{a}";
inline constexpr std::string_view kClusterProbeKeyB = "kvblock:cluster-probe:{b}";

// Whether `text` begins with `prefix` (std::string_view::starts_with is C++20).
inline bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

/// Whether a Redis error reply's text (without the '-') is a MOVED or ASK redirection,
/// "MOVED 3999 127.0.0.1:6381" / "ASK 3999 127.0.0.1:6381": the key is served by another
/// Redis Cluster node, which only RedisClusterBackend can follow. TRYAGAIN is not one.
inline bool is_redirection(std::string_view text) {
  return starts_with(text, "MOVED ") || starts_with(text, "ASK ");
}

inline void parse_redis_credentials(std::string_view cred, RedisOptions* o) {
  const std::size_t colon = cred.find(':');
  if (colon == std::string_view::npos) {
    o->password = std::string(cred);
  } else {
    o->user = std::string(cred.substr(0, colon));
    o->password = std::string(cred.substr(colon + 1));
  }
}

inline Status parse_redis_db(std::string_view db, std::string_view url, RedisOptions* o) {
  if (db.empty()) return Status::ok();
  KVKIT_CHECK_STATUS(db.size() <= 5 && db.find_first_not_of("0123456789") == db.npos,
                     StatusCode::kInvalidArgument, "redis URL '", url, "' has a bad db");
  o->db = std::stoi(std::string(db));
  return Status::ok();
}
}  // namespace detail

/// Parses redis://[[user]:password@]host[:port][/db], or a unix socket as
/// unix://[[user]:password@]/absolute/path[?db=N] (also spelled redis+unix://), into
/// `out` (other fields kept; unix_path is cleared for redis://). kInvalidArgument for
/// anything else.
inline Status parse_redis_url(std::string_view url, RedisOptions* out) {
  RedisOptions o = *out;
  for (std::string_view unix_scheme :
       {std::string_view("unix://"), std::string_view("redis+unix://")}) {
    if (url.substr(0, unix_scheme.size()) != unix_scheme) continue;
    std::string_view rest = url.substr(unix_scheme.size());
    const std::size_t slash = rest.find('/');
    KVKIT_CHECK_STATUS(slash != std::string_view::npos, StatusCode::kInvalidArgument, "redis URL '",
                       url, "' has no absolute socket path");
    if (slash > 0) {
      KVKIT_CHECK_STATUS(rest[slash - 1] == '@', StatusCode::kInvalidArgument, "redis URL '", url,
                         "': expected [[user]:password@]/path after ", unix_scheme);
      detail::parse_redis_credentials(rest.substr(0, slash - 1), &o);
      rest = rest.substr(slash);
    }
    const std::size_t q = rest.find('?');
    if (q != std::string_view::npos) {
      const std::string_view query = rest.substr(q + 1);
      KVKIT_CHECK_STATUS(query.substr(0, 3) == "db=", StatusCode::kInvalidArgument, "redis URL '",
                         url, "': the only query parameter is db=N");
      KVKIT_CHECK_STATUS(query.size() > 3, StatusCode::kInvalidArgument, "redis URL '", url,
                         "' has a bad db");
      KVKIT_RETURN_IF_ERROR(detail::parse_redis_db(query.substr(3), url, &o));
      rest = rest.substr(0, q);
    }
    KVKIT_CHECK_STATUS(rest.size() > 1, StatusCode::kInvalidArgument, "redis URL '", url,
                       "' has no socket path");
    o.unix_path = std::string(rest);
    *out = std::move(o);
    return Status::ok();
  }
  constexpr std::string_view kScheme = "redis://";
  KVKIT_CHECK_STATUS(url.substr(0, kScheme.size()) == kScheme, StatusCode::kInvalidArgument,
                     "redis URL '", url,
                     "' does not start with redis://, unix:// or redis+unix://");
  std::string_view rest = url.substr(kScheme.size());
  o.unix_path.clear();
  const std::size_t at = rest.rfind('@');
  if (at != std::string_view::npos) {
    detail::parse_redis_credentials(rest.substr(0, at), &o);
    rest = rest.substr(at + 1);
  }
  const std::size_t slash = rest.find('/');
  if (slash != std::string_view::npos) {
    KVKIT_RETURN_IF_ERROR(detail::parse_redis_db(rest.substr(slash + 1), url, &o));
    rest = rest.substr(0, slash);
  }
  const std::size_t colon = rest.rfind(':');
  if (colon != std::string_view::npos) {
    const std::string_view port = rest.substr(colon + 1);
    KVKIT_CHECK_STATUS(!port.empty() && port.size() <= 5 &&
                           port.find_first_not_of("0123456789") == port.npos,
                       StatusCode::kInvalidArgument, "redis URL '", url, "' has a bad port");
    o.port = std::stoi(std::string(port));
    KVKIT_CHECK_STATUS(o.port > 0 && o.port < 65536, StatusCode::kInvalidArgument, "redis URL '",
                       url, "' port out of range");
    rest = rest.substr(0, colon);
  }
  KVKIT_CHECK_STATUS(!rest.empty(), StatusCode::kInvalidArgument, "redis URL '", url,
                     "' has no host");
  o.host = std::string(rest);
  *out = std::move(o);
  return Status::ok();
}

/// BlockBackend over one Redis server (see the file comment). Batches are pipelined GET /
/// SET [EX] / EXISTS / DEL, one per key. Not thread-safe: one per thread. Never throws
/// from its BlockBackend calls.
class RedisBackend final : public BlockBackend {
 public:
  using Clock = std::chrono::steady_clock;

  /// Stores the options; connects lazily on the first call (or connect()). Throws
  /// kvkit::Error for non-positive timeouts or windows.
  explicit RedisBackend(RedisOptions options) : opt_(std::move(options)) {
    KVKIT_CHECK(opt_.connect_timeout.count() > 0 && opt_.op_timeout.count() > 0 &&
                    opt_.batch_deadline.count() > 0,
                "kvkit: RedisOptions timeouts must be > 0 ms (connect ", opt_.connect_timeout.count(),
                ", op ", opt_.op_timeout.count(), ", batch ", opt_.batch_deadline.count(), ")");
    KVKIT_CHECK(opt_.max_inflight_commands > 0 && opt_.max_inflight_bytes > 0,
                "kvkit: RedisOptions in-flight limits must be > 0 (commands ",
                opt_.max_inflight_commands, ", bytes ", opt_.max_inflight_bytes, ")");
  }
  ~RedisBackend() override { drop(); }
  RedisBackend(const RedisBackend&) = delete;
  RedisBackend& operator=(const RedisBackend&) = delete;

  const RedisOptions& options() const { return opt_; }
  /// True while a healthy connection is held.
  bool connected() const { return ctx_ != nullptr && ctx_->err == 0; }
  /// Connections opened so far (reconnects included).
  std::uint64_t connects() const { return connects_; }

  /// (Re)connects if needed and PINGs, within one batch deadline. Every connect (this one,
  /// or the lazy one of a batch call, reconnects included) also checks, in the same round
  /// trip as its PING, that the server is not a Redis Cluster node (unless
  /// allow_cluster_node): on one it fails with kUnsupported, naming the server's redis://
  /// URL and redis-cluster://.
  /// Why a Status and not a kvkit::Error thrown at construction: the constructor does no
  /// I/O (an engine may build the backend before the server is up), whether a server is a
  /// cluster node is found by I/O, like a refused connection or a failed AUTH, which are
  /// Statuses too, and it can change when the server restarts, which only a reconnect
  /// sees (batch calls must not throw). Callers that want to fail at open call connect()
  /// and turn the Status into their own error, as `kvkit store-demo` does.
  Status connect() {
    const Clock::time_point deadline = Clock::now() + opt_.batch_deadline;
    KVKIT_RETURN_IF_ERROR(ensure_connected(deadline));
    return ping_locked(deadline);
  }

  Status get(const std::string* keys, std::size_t n, std::string* values,
             KeyState* states) override {
    return pipeline(
        n, states, values,
        [&](std::size_t i) {
          const char* argv[2] = {"GET", keys[i].data()};
          const std::size_t len[2] = {3, keys[i].size()};
          append_command(2, argv, len);
          return keys[i].size() + 32 + expected_value_bytes_;
        },
        [&](std::size_t i, const Reply& r) {
          if (r.type == '$' && !r.nil) {
            expected_value_bytes_ = values[i].size();
            return KeyState::kHit;
          }
          return r.type == '$' ? KeyState::kMiss : reply_error(r);
        });
  }

  Status put(const std::string* keys, const std::string* values, std::size_t n,
             KeyState* states) override {
    const std::string ttl = std::to_string(opt_.ttl_seconds);
    return pipeline(
        n, states, nullptr,
        [&](std::size_t i) {
          const char* argv[5] = {"SET", keys[i].data(), values[i].data(), "EX", ttl.data()};
          const std::size_t len[5] = {3, keys[i].size(), values[i].size(), 2, ttl.size()};
          append_command(opt_.ttl_seconds != 0 ? 5 : 3, argv, len);
          return keys[i].size() + values[i].size() + 64;
        },
        [&](std::size_t, const Reply& r) {
          return r.type == '+' ? KeyState::kHit : reply_error(r);
        });
  }

  Status exists(const std::string* keys, std::size_t n, KeyState* states) override {
    return pipeline(
        n, states, nullptr,
        [&](std::size_t i) {
          const char* argv[2] = {"EXISTS", keys[i].data()};
          const std::size_t len[2] = {6, keys[i].size()};
          append_command(2, argv, len);
          return keys[i].size() + 32;
        },
        [&](std::size_t, const Reply& r) {
          if (r.type != ':') return reply_error(r);
          return r.integer > 0 ? KeyState::kHit : KeyState::kMiss;
        });
  }

  Status remove(const std::string* keys, std::size_t n) override {
    std::size_t range = n;
    if (index_ != nullptr)
      for (std::size_t i = 0; i < n; ++i) range = std::max(range, index_[i] + 1);
    states_.resize(range);
    return pipeline(
        n, states_.data(), nullptr,
        [&](std::size_t i) {
          const char* argv[2] = {"DEL", keys[i].data()};
          const std::size_t len[2] = {3, keys[i].size()};
          append_command(2, argv, len);
          return keys[i].size() + 32;
        },
        [&](std::size_t, const Reply& r) {
          return r.type == ':' ? KeyState::kHit : reply_error(r);
        });
  }

  /// Runs one call over keys[index[0..m)] only (values, states indexed like keys), with
  /// MOVED / ASK / TRYAGAIN error replies appended to `redirects` as (index, reply text)
  /// instead of failing the batch, and ASKING before every command when `asking`. For
  /// the cluster backend; f is a callable taking this backend and m.
  template <class F>
  Status subset(const std::size_t* index,  // [m] positions in the caller's arrays
                std::size_t m, std::vector<std::pair<std::size_t, std::string>>* redirects,
                bool asking, F&& f) {
    index_ = index;
    redirects_ = redirects;
    asking_ = asking;
    const Status s = f(*this, m);
    index_ = nullptr;
    redirects_ = nullptr;
    asking_ = false;
    return s;
  }

  /// One GET per key, each waiting for its reply (the seed's access pattern): a baseline
  /// for benchmarks only; same deadline and statuses as get().
  Status get_unpipelined(const std::string* keys, std::size_t n, std::string* values,
                         KeyState* states) {
    const std::size_t window = opt_.max_inflight_commands;
    opt_.max_inflight_commands = 1;
    const Status s = get(keys, n, values, states);
    opt_.max_inflight_commands = window;
    return s;
  }

 private:
  static timeval to_timeval(std::chrono::microseconds us) {
    if (us.count() < 1000) us = std::chrono::microseconds(1000);  // 0 would mean "forever"
    timeval tv;
    tv.tv_sec = static_cast<decltype(tv.tv_sec)>(us.count() / 1000000);
    tv.tv_usec = static_cast<decltype(tv.tv_usec)>(us.count() % 1000000);
    return tv;
  }

  // host:port or unix:PATH for I/O messages; url() is the pasteable form (scheme, db).
  std::string endpoint() const {
    return opt_.unix_path.empty() ? opt_.host + ":" + std::to_string(opt_.port)
                                  : "unix:" + opt_.unix_path;
  }

  void drop() {
    if (ctx_ != nullptr) redisFree(ctx_);
    ctx_ = nullptr;
    rpos_ = rlen_ = 0;  // unread replies belong to the dropped connection
    clear_output();     // and so do unsent commands
  }

  // One RESP reply of the commands used here (arrays are a protocol error).
  struct Reply {
    char type = 0;             // '$' bulk, '+' status, '-' error, ':' integer
    bool nil = false;          // '$-1'
    std::int64_t integer = 0;  // ':' value
    std::string_view text;     // '+' / '-' line (valid until the next read)
  };

  KeyState reply_error(const Reply& r) {
    if (redirects_ != nullptr && r.type == '-' &&
        (detail::is_redirection(r.text) || detail::starts_with(r.text, "TRYAGAIN"))) {
      redirects_->emplace_back(current_, std::string(r.text));
      return KeyState::kError;
    }
    if (first_error_.empty()) {
      first_error_ = r.type == '-' ? std::string(r.text)
                                   : std::string("unexpected reply type '") + r.type + "'";
      // Not a subset call of RedisClusterBackend: a redirection cannot be followed here.
      if (r.type == '-' && detail::is_redirection(r.text))
        first_error_ += " (" + url() +
                        " answers as a Redis Cluster node, which a single-server RedisBackend "
                        "cannot follow; use redis-cluster://)";
    }
    return KeyState::kError;
  }

  // Lowers (or restores) the socket timeout so a blocking operation ends by `deadline`
  // or after op_timeout, whichever is first. False when the deadline has passed.
  bool arm_timeout(Clock::time_point deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    const std::chrono::microseconds want = std::min<std::chrono::microseconds>(left, opt_.op_timeout);
    // Only touch the socket when the wanted value moves by >1 ms (one setsockopt pair).
    if (armed_.count() < 0 || want < armed_ - std::chrono::milliseconds(1) || want > armed_) {
      if (redisSetTimeout(ctx_, to_timeval(want)) != REDIS_OK) return false;
      armed_ = want;
    }
    return true;
  }

  Status io_failure(const char* what, Clock::time_point deadline) {
    const int err = errno;
    std::string msg = ctx_ != nullptr && ctx_->err != 0 ? ctx_->errstr : "connection lost";
    drop();
    if (err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT || Clock::now() >= deadline)
      return make_status(StatusCode::kTimeout, "redis ", endpoint(), " ", what,
                         ": no answer within the socket timeout or batch deadline (", msg, ")");
    return make_status(StatusCode::kIoError, "redis ", endpoint(), " ", what, ": ",
                       msg);
  }

  // One command, waited for (connect-time AUTH / SELECT / PING).
  Status simple_command(int argc, const char** argv, const std::size_t* len,  // [argc]
                        Clock::time_point deadline, bool expect_pong = false) {
    if (!arm_timeout(deadline)) {
      drop();
      return make_status(StatusCode::kTimeout, "redis ", argv[0], ": batch deadline passed");
    }
    redisAppendCommandArgv(ctx_, argc, argv, len);
    void* raw = nullptr;
    errno = 0;
    if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) return io_failure(argv[0], deadline);
    auto* r = static_cast<redisReply*>(raw);
    Status s;
    if (r->type == REDIS_REPLY_ERROR) {
      s = make_status(StatusCode::kIoError, "redis ", argv[0], " failed: ",
                      std::string(r->str, r->len));
    } else if (expect_pong &&
               !(r->type == REDIS_REPLY_STATUS && std::string_view(r->str, r->len) == "PONG")) {
      s = make_status(StatusCode::kIoError, "redis PING did not answer PONG");
    }
    freeReplyObject(r);
    if (!s.is_ok()) drop();
    return s;
  }

  Status ping_locked(Clock::time_point deadline) {
    const char* argv[1] = {"PING"};
    const std::size_t len[1] = {4};
    return simple_command(1, argv, len, deadline, true);
  }

  Status ensure_connected(Clock::time_point deadline) {
    if (ctx_ != nullptr && ctx_->err == 0) return Status::ok();
    drop();
    struct sigaction sa {};
    if (sigaction(SIGPIPE, nullptr, &sa) == 0 && sa.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
    KVKIT_CHECK_STATUS(left.count() > 0, StatusCode::kTimeout, "redis ", endpoint(),
                       ": batch deadline passed before connecting");
    const auto ct = std::min<std::chrono::microseconds>(left, opt_.connect_timeout);
    // hiredis sets TCP_NODELAY on TCP connections (small commands must not wait for ACKs).
    ctx_ = opt_.unix_path.empty()
               ? redisConnectWithTimeout(opt_.host.c_str(), opt_.port, to_timeval(ct))
               : redisConnectUnixWithTimeout(opt_.unix_path.c_str(), to_timeval(ct));
    armed_ = std::chrono::microseconds(-1);
    if (ctx_ == nullptr || ctx_->err != 0) {
      const std::string msg = ctx_ != nullptr ? ctx_->errstr : "out of memory";
      drop();
      return make_status(StatusCode::kIoError, "redis connect to ", endpoint(),
                         " failed: ", msg);
    }
    if (opt_.socket_buffer_bytes != 0) {
      const int b = static_cast<int>(std::min<std::size_t>(opt_.socket_buffer_bytes, INT_MAX / 2));
      ::setsockopt(ctx_->fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof(b));
      ::setsockopt(ctx_->fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof(b));
    }
    ++connects_;
    if (!opt_.password.empty()) {
      if (opt_.user.empty()) {
        const char* argv[2] = {"AUTH", opt_.password.data()};
        const std::size_t len[2] = {4, opt_.password.size()};
        KVKIT_RETURN_IF_ERROR(simple_command(2, argv, len, deadline));
      } else {
        const char* argv[3] = {"AUTH", opt_.user.data(), opt_.password.data()};
        const std::size_t len[3] = {4, opt_.user.size(), opt_.password.size()};
        KVKIT_RETURN_IF_ERROR(simple_command(3, argv, len, deadline));
      }
    }
    if (opt_.db != 0) {
      const std::string db = std::to_string(opt_.db);
      const char* argv[2] = {"SELECT", db.data()};
      const std::size_t len[2] = {6, db.size()};
      KVKIT_RETURN_IF_ERROR(simple_command(2, argv, len, deadline));
    }
    return opt_.allow_cluster_node ? ping_locked(deadline) : ping_and_probe_mode(deadline);
  }

  // The URL this backend reaches, without credentials (for messages). Not built from
  // endpoint() (nor it from this): the unix forms differ ("unix:///p?db=N" vs "unix:/p").
  std::string url() const {
    if (!opt_.unix_path.empty())
      return "unix://" + opt_.unix_path + (opt_.db != 0 ? "?db=" + std::to_string(opt_.db) : "");
    return "redis://" + opt_.host + ":" + std::to_string(opt_.port) +
           (opt_.db != 0 ? "/" + std::to_string(opt_.db) : "");
  }

  // The connect-time health check with the cluster-node probe, pipelined (one round trip):
  //   PING                -> PONG;
  //   INFO cluster        -> "cluster_enabled:1" on a cluster node (Redis >= 3.0; O(1), a
  //                          ~30-byte reply). INFO is in the ACL category @dangerous, so a
  //                          user limited to @read / @write gets NOPERM;
  //   EXISTS A B          -> (A, B in different slots) a count on a standalone server, an
  //                          error on a cluster node: CROSSSLOT, or CLUSTERDOWN / MOVED /
  //                          ASK / TRYAGAIN. Needs only EXISTS, which the backend uses
  //                          anyway, so it still answers where INFO is refused.
  // Either one saying "cluster" fails the connect. Both refused (or a Redis-protocol server
  // that knows neither): taken as standalone; a MOVED met later still fails only its key.
  // Via hiredis 0.14's synchronous API (redisAppendCommandArgv x3, then redisGetReply x3;
  // it speaks RESP2 only, where INFO's answer is a plain bulk string), under the batch
  // deadline like the PING alone.
  Status ping_and_probe_mode(Clock::time_point deadline) {
    if (!arm_timeout(deadline)) {
      drop();
      return make_status(StatusCode::kTimeout, "redis PING: batch deadline passed");
    }
    const char* ping[1] = {"PING"};
    const std::size_t ping_len[1] = {4};
    const char* info[2] = {"INFO", "cluster"};
    const std::size_t info_len[2] = {4, 7};
    const char* exists[3] = {"EXISTS", detail::kClusterProbeKeyA.data(), detail::kClusterProbeKeyB.data()};
    const std::size_t exists_len[3] = {6, detail::kClusterProbeKeyA.size(), detail::kClusterProbeKeyB.size()};
    redisAppendCommandArgv(ctx_, 1, ping, ping_len);
    redisAppendCommandArgv(ctx_, 2, info, info_len);
    redisAppendCommandArgv(ctx_, 3, exists, exists_len);
    struct Free {
      void operator()(redisReply* r) const { freeReplyObject(r); }
    };
    std::unique_ptr<redisReply, Free> rep[3];
    for (auto& r : rep) {
      void* raw = nullptr;
      errno = 0;
      if (redisGetReply(ctx_, &raw) != REDIS_OK || raw == nullptr) return io_failure("PING", deadline);
      r.reset(static_cast<redisReply*>(raw));
    }
    Status s;
    auto text = [](const redisReply* r) { return std::string_view(r->str, r->len); };
    if (!(rep[0]->type == REDIS_REPLY_STATUS && text(rep[0].get()) == "PONG")) {
      s = make_status(StatusCode::kIoError, "redis PING did not answer PONG");
    } else {
      std::string evidence;
      if (rep[1]->type == REDIS_REPLY_STRING &&
          text(rep[1].get()).find("cluster_enabled:1") != std::string_view::npos) {
        evidence = "INFO cluster says cluster_enabled:1";
      } else if (rep[2]->type == REDIS_REPLY_ERROR) {
        const std::string_view e = text(rep[2].get());
        // Not is_redirection: any cluster-only error is evidence, matched on the bare word.
        for (std::string_view p : {"CROSSSLOT", "CLUSTERDOWN", "MOVED", "ASK", "TRYAGAIN"})
          if (detail::starts_with(e, p)) evidence = "EXISTS over two slots: " + std::string(e);
      }
      if (!evidence.empty())
        s = make_status(StatusCode::kUnsupported, url(), " is a Redis Cluster node (", evidence,
                        "): a single-server RedisBackend would get MOVED for the keys of every "
                        "slot other masters serve; use ",
                        opt_.unix_path.empty() ? "redis-cluster://" + opt_.host + ":" +
                                                     std::to_string(opt_.port)
                                               : std::string("redis-cluster://HOST:PORT"),
                        " (RedisClusterBackend)");
    }
    if (!s.is_ok()) drop();
    return s;
  }

  // Replies are read straight from the socket (hiredis 0.14's reader reads 16 KiB at a
  // time and copies every value twice): kReadChunk reads into rbuf_ for small replies; a
  // large GET value is read with readv into its destination string (see read_reply), so
  // only the few bytes that arrived with the previous read are copied. Every blocking
  // read is armed with arm_timeout first.
  Status read_some(char* dst, std::size_t cap, std::size_t* got,  // dst: [cap]
                   Clock::time_point deadline) {
    iovec v{dst, cap};
    return read_some(&v, 1, got, deadline);
  }

  Status read_some(iovec* v, int nv, std::size_t* got,  // v: [nv]
                   Clock::time_point deadline) {
    for (;;) {
      if (!arm_timeout(deadline)) {
        drop();
        return make_status(StatusCode::kTimeout, "redis ", endpoint(),
                           ": batch deadline of ", opt_.batch_deadline.count(), " ms passed");
      }
      const ssize_t r =
          nv == 1 ? ::read(ctx_->fd, v[0].iov_base, v[0].iov_len) : ::readv(ctx_->fd, v, nv);
      if (r > 0) {
        *got = static_cast<std::size_t>(r);
        return Status::ok();
      }
      if (r < 0 && errno == EINTR) continue;
      const int err = r == 0 ? 0 : errno;
      drop();
      if (err == EAGAIN || err == EWOULDBLOCK)
        return make_status(StatusCode::kTimeout, "redis ", endpoint(),
                           ": no answer within the socket timeout or batch deadline");
      return make_status(StatusCode::kIoError, "redis ", endpoint(), ": ",
                         err == 0 ? "server closed the connection" : std::strerror(err));
    }
  }

  // Appends at least one byte to rbuf_ (moving the unread tail to the front first).
  Status fill(Clock::time_point deadline) {
    if (rpos_ > 0) {
      std::memmove(&rbuf_[0], rbuf_.data() + rpos_, rlen_ - rpos_);
      rlen_ -= rpos_;
      rpos_ = 0;
    }
    if (rbuf_.size() < kReadChunk) rbuf_.resize(kReadChunk);
    if (rlen_ == rbuf_.size()) rbuf_.resize(2 * rbuf_.size());  // an absurdly long line
    std::size_t got = 0;
    KVKIT_RETURN_IF_ERROR(read_some(&rbuf_[rlen_], rbuf_.size() - rlen_, &got, deadline));
    rlen_ += got;
    return Status::ok();
  }

  Status read_line(std::string_view* line, Clock::time_point deadline) {
    std::size_t scan = rpos_;
    for (;;) {
      for (; scan + 1 < rlen_; ++scan)
        if (rbuf_[scan] == '\r' && rbuf_[scan + 1] == '\n') {
          *line = std::string_view(rbuf_.data() + rpos_, scan - rpos_);
          rpos_ = scan + 2;
          return Status::ok();
        }
      const std::size_t scanned = scan - rpos_;
      KVKIT_RETURN_IF_ERROR(fill(deadline));
      scan = rpos_ + scanned;
    }
  }

  Status protocol_error(const char* what) {
    drop();
    return make_status(StatusCode::kIoError, "redis ", endpoint(),
                       ": protocol error: ", what);
  }

  static bool parse_int(std::string_view s, std::int64_t* out) {
    bool neg = false;
    if (!s.empty() && s[0] == '-') {
      neg = true;
      s.remove_prefix(1);
    }
    if (s.empty() || s.size() > 18) return false;
    std::int64_t v = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      v = v * 10 + (c - '0');
    }
    *out = neg ? -v : v;
    return true;
  }

  // Reads one reply; a bulk string goes to *dest (or is skipped when dest is null).
  Status read_reply(Reply* out, std::string* dest, Clock::time_point deadline) {
    std::string_view line;
    KVKIT_RETURN_IF_ERROR(read_line(&line, deadline));
    if (line.empty()) return protocol_error("empty reply line");
    Reply r;
    r.type = line[0];
    line.remove_prefix(1);
    switch (r.type) {
      case '+':
      case '-': r.text = line; break;
      case ':':
        if (!parse_int(line, &r.integer)) return protocol_error("bad integer reply");
        break;
      case '$': {
        std::int64_t n = 0;
        if (!parse_int(line, &n) || n < -1) return protocol_error("bad bulk length");
        if (n < 0) {
          r.nil = true;
          break;
        }
        const std::size_t len = static_cast<std::size_t>(n);
        std::size_t copied = 0;
        if (dest != nullptr) dest->resize(len);
        while (copied < len) {
          const std::size_t avail = std::min(len - copied, rlen_ - rpos_);
          if (dest != nullptr && avail > 0) std::memcpy(&(*dest)[copied], rbuf_.data() + rpos_, avail);
          rpos_ += avail;
          copied += avail;
          if (copied == len) break;
          if (dest != nullptr && len - copied >= kInPlaceMin) {
            // rbuf_ is empty here: the rest of the value goes straight to *dest, and what
            // follows it (at most kSideRead bytes) to the front of rbuf_.
            rpos_ = rlen_ = 0;
            if (rbuf_.size() < kReadChunk) rbuf_.resize(kReadChunk);
            iovec v[2] = {{&(*dest)[copied], len - copied}, {&rbuf_[0], kSideRead}};
            std::size_t got = 0;
            KVKIT_RETURN_IF_ERROR(read_some(v, 2, &got, deadline));
            const std::size_t in_dest = std::min(got, len - copied);
            copied += in_dest;
            rlen_ = got - in_dest;
          } else {
            KVKIT_RETURN_IF_ERROR(fill(deadline));
          }
        }
        while (rlen_ - rpos_ < 2) KVKIT_RETURN_IF_ERROR(fill(deadline));
        if (rbuf_[rpos_] != '\r' || rbuf_[rpos_ + 1] != '\n')
          return protocol_error("bulk string not terminated by CRLF");
        rpos_ += 2;
        break;
      }
      default: return protocol_error("unexpected reply type");
    }
    *out = r;
    return Status::ok();
  }

  // Output: RESP commands formatted here. Small pieces go to obuf_; an argument of at least
  // kScatterMin bytes (a SET value) is referenced in place as its own segment, so sendmsg
  // sends it from the caller's memory. Segments hold offsets into obuf_ (it may grow while
  // a window is formatted); flush() turns them into iovecs.
  struct Segment {
    const char* ext;  // external bytes, or null: obuf_[off, off + len)
    std::size_t off;
    std::size_t len;
  };

  void clear_output() {
    obuf_.clear();
    segs_.clear();
    own_from_ = 0;
  }

  void close_own_segment() {
    if (obuf_.size() > own_from_)
      segs_.push_back(Segment{nullptr, own_from_, obuf_.size() - own_from_});
    own_from_ = obuf_.size();
  }

  void append_number(char prefix, std::size_t v) {
    char buf[24];
    buf[0] = prefix;
    const auto r = std::to_chars(buf + 1, buf + sizeof(buf) - 2, v);
    char* e = r.ptr;
    *e++ = '\r';
    *e++ = '\n';
    obuf_.append(buf, static_cast<std::size_t>(e - buf));
  }

  // Appends one command (RESP array of bulk strings) to the output.
  void append_command(int argc, const char* const* argv,  // [argc]
                      const std::size_t* len) {           // [argc]
    append_number('*', static_cast<std::size_t>(argc));
    for (int a = 0; a < argc; ++a) {
      append_number('$', len[a]);
      if (len[a] >= kScatterMin) {
        close_own_segment();
        segs_.push_back(Segment{argv[a], 0, len[a]});
      } else {
        obuf_.append(argv[a], len[a]);
      }
      obuf_.append("\r\n", 2);
    }
  }

  // Writes every appended command with a gathering sendmsg (blocking; each call armed with
  // arm_timeout).
  Status flush(Clock::time_point deadline) {
    close_own_segment();
    std::size_t seg = 0, skip = 0;  // first unsent segment, bytes of it already sent
    while (seg < segs_.size()) {
      iov_.clear();
      for (std::size_t k = seg; k < segs_.size() && iov_.size() < kMaxIov; ++k) {
        const Segment& g = segs_[k];
        const char* p = g.ext != nullptr ? g.ext : obuf_.data() + g.off;
        const std::size_t off = k == seg ? skip : 0;
        iov_.push_back(iovec{const_cast<char*>(p + off), g.len - off});
      }
      if (!arm_timeout(deadline)) {
        drop();
        return make_status(StatusCode::kTimeout, "redis ", endpoint(),
                           ": batch deadline passed while writing");
      }
      msghdr msg{};
      msg.msg_iov = iov_.data();
      msg.msg_iovlen = iov_.size();
      const ssize_t w = ::sendmsg(ctx_->fd, &msg, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int err = w == 0 ? EPIPE : errno;
        drop();
        if (err == EAGAIN || err == EWOULDBLOCK)
          return make_status(StatusCode::kTimeout, "redis ", endpoint(),
                             ": write blocked past the socket timeout or batch deadline");
        return make_status(StatusCode::kIoError, "redis ", endpoint(), ": write: ",
                           std::strerror(err));
      }
      std::size_t sent = static_cast<std::size_t>(w);
      while (sent > 0) {
        const std::size_t left = segs_[seg].len - skip;
        if (sent < left) {
          skip += sent;
          sent = 0;
        } else {
          sent -= left;
          ++seg;
          skip = 0;
        }
      }
    }
    clear_output();
    return Status::ok();
  }

  // The sliding-window pipeline: issue(i) appends key i's command and returns its cost in
  // bytes; take(i, reply) turns reply i into a KeyState (a bulk reply was already read
  // into values[i] when values is not null). The window is refilled when half empty, so
  // commands go out in groups (one write each). Keys without a reply end as kError.
  template <class Issue, class Take>
  Status pipeline(std::size_t n, KeyState* states,  // [n]
                  std::string* values,              // [n] or null
                  Issue&& issue, Take&& take) {
    first_error_.clear();
    if (n == 0) return Status::ok();
    // Batch position -> caller's index (subset calls of the cluster backend).
    const std::size_t* const index = index_;
    auto at = [index](std::size_t i) { return index != nullptr ? index[i] : i; };
    const Clock::time_point deadline = Clock::now() + opt_.batch_deadline;
    std::size_t done = 0;
    Status st = ensure_connected(deadline);
    if (st.is_ok()) {
      costs_.resize(n);
      std::size_t next = 0, inflight_bytes = 0;
      const std::size_t max_cmds = opt_.max_inflight_commands, max_bytes = opt_.max_inflight_bytes;
      while (done < n) {
        if (next < n && (next == done || (2 * (next - done) <= max_cmds &&
                                          2 * inflight_bytes <= max_bytes))) {
          // Flushed every kFlushBytes, so the server starts on a window's first commands
          // while the rest are formatted.
          std::size_t unflushed = 0;
          while (next < n && next - done < max_cmds &&
                 (next == done || inflight_bytes + costs_[next - 1] <= max_bytes)) {
            if (asking_) {  // ASK redirection: ASKING must precede the command
              const char* argv[1] = {"ASKING"};
              const std::size_t len[1] = {6};
              append_command(1, argv, len);
            }
            costs_[next] = issue(at(next));
            inflight_bytes += costs_[next];
            unflushed += costs_[next];
            ++next;
            if (unflushed >= kFlushBytes) {
              st = flush(deadline);
              if (!st.is_ok()) break;
              unflushed = 0;
            }
          }
          if (st.is_ok() && unflushed > 0) st = flush(deadline);
          if (!st.is_ok()) break;
        }
        Reply r;
        if (asking_) {
          st = read_reply(&r, nullptr, deadline);
          if (!st.is_ok()) break;
          if (r.type != '+') {
            st = protocol_error("ASKING was refused");
            break;
          }
        }
        const std::size_t k = at(done);
        st = read_reply(&r, values != nullptr ? &values[k] : nullptr, deadline);
        if (!st.is_ok()) break;
        current_ = k;
        states[k] = take(k, r);
        inflight_bytes -= costs_[done];
        ++done;
        if (opt_.on_reply) opt_.on_reply(done);
      }
    }
    for (std::size_t i = done; i < n; ++i) states[at(i)] = KeyState::kError;
    if (st.is_ok() && !first_error_.empty())
      st = make_status(StatusCode::kIoError, "redis error reply: ", first_error_);
    return st;
  }

  static constexpr std::size_t kReadChunk = 256u << 10;
  static constexpr std::size_t kFlushBytes = 256u << 10;
  static constexpr std::size_t kScatterMin = 2048;  // arguments sent from the caller's memory
  static constexpr std::size_t kMaxIov = 512;       // iovecs per writev (IOV_MAX >= 1024)
  // A bulk value with at least this many bytes still to come is read with readv straight
  // into its destination, plus at most kSideRead bytes (the next reply's header and the
  // start of its value) into rbuf_; smaller rests go through rbuf_ in kReadChunk reads.
  // (Side reads of 4 KiB to 256 KiB measured within noise of each other in client CPU per
  // GB: fewer syscalls against fewer copies.)
  static constexpr std::size_t kInPlaceMin = 4096;
  static constexpr std::size_t kSideRead = 16384;

  RedisOptions opt_;
  redisContext* ctx_ = nullptr;
  // Cluster support (set only for one call by Subset): run the batch over keys
  // index_[0..n), record MOVED / ASK / TRYAGAIN replies instead of failing, send ASKING.
  const std::size_t* index_ = nullptr;
  std::vector<std::pair<std::size_t, std::string>>* redirects_ = nullptr;
  bool asking_ = false;
  std::size_t current_ = 0;  // caller index of the reply being taken
  std::chrono::microseconds armed_{-1};  // socket timeout now set; -1: unknown
  std::size_t expected_value_bytes_ = 16384;  // last GET reply's size: the window's estimate
  std::uint64_t connects_ = 0;
  std::string first_error_;
  std::vector<std::size_t> costs_;  // [n] cost of each issued command
  std::vector<KeyState> states_;    // remove()'s scratch
  std::string rbuf_;                // reply bytes read, [rpos_, rlen_) not yet parsed
  std::size_t rpos_ = 0, rlen_ = 0;
  std::string obuf_;                // formatted command bytes of the unsent window
  std::vector<Segment> segs_;       // unsent output, in order
  std::size_t own_from_ = 0;        // obuf_ bytes not yet in a segment start here
  std::vector<iovec> iov_;          // flush()'s scratch
};

}  // namespace store
}  // namespace kvkit
