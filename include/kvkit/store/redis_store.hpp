#pragma once
// RedisBackend: the BlockBackend of a single Redis (or Redis-protocol) server over
// hiredis 0.14's synchronous API. Link kvkit::redis (hiredis); nothing else includes this.
//
// Why it does not stall: every batch is one pipeline (redisAppendCommandArgv, replies
// read in order), so N keys cost about one round trip plus N * value / bandwidth instead
// of N round trips (the seed's one GET per key). The pipeline is a sliding window bounded
// in commands and bytes in flight, so neither side buffers a whole batch. hiredis formats
// and writes the commands; replies are parsed here straight from the socket (256 KiB
// reads, each value copied once into the caller's string; hiredis 0.14's reader reads
// 16 KiB at a time and copies every value twice). hiredis 0.14
// only has per-socket-operation timeouts (SO_RCVTIMEO / SO_SNDTIMEO), so the batch
// deadline is ours: it is checked before each reply, and near the end the socket timeout
// is lowered to the time left, so a batch returns within its deadline plus at most one
// socket timeout even when the server stops answering. A connection that failed or timed
// out mid-pipeline still has replies owed to it, so it is dropped; the next call
// reconnects (AUTH, SELECT, then a PING health check) within its own deadline.
// Writes to a closed socket raise SIGPIPE, so connecting sets SIGPIPE to SIG_IGN when it
// is still SIG_DFL (a process-wide setting, as most servers already have it).

#include <hiredis/hiredis.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
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
  /// Called after each reply of a batch with the number of replies so far (metrics, and
  /// tests that must act at a known point of a batch). Empty: not called.
  std::function<void(std::size_t)> on_reply;
};

/// Parses redis://[[user]:password@]host[:port][/db] into `out` (other fields kept).
/// kInvalidArgument for anything else.
inline Status parse_redis_url(std::string_view url, RedisOptions* out) {
  constexpr std::string_view kScheme = "redis://";
  KVKIT_CHECK_STATUS(url.substr(0, kScheme.size()) == kScheme, StatusCode::kInvalidArgument,
                     "redis URL '", url, "' does not start with redis://");
  std::string_view rest = url.substr(kScheme.size());
  RedisOptions o = *out;
  const std::size_t at = rest.rfind('@');
  if (at != std::string_view::npos) {
    const std::string_view cred = rest.substr(0, at);
    const std::size_t colon = cred.find(':');
    if (colon == std::string_view::npos) {
      o.password = std::string(cred);
    } else {
      o.user = std::string(cred.substr(0, colon));
      o.password = std::string(cred.substr(colon + 1));
    }
    rest = rest.substr(at + 1);
  }
  const std::size_t slash = rest.find('/');
  if (slash != std::string_view::npos) {
    const std::string_view db = rest.substr(slash + 1);
    if (!db.empty()) {
      KVKIT_CHECK_STATUS(db.size() <= 5 && db.find_first_not_of("0123456789") == db.npos,
                         StatusCode::kInvalidArgument, "redis URL '", url, "' has a bad db");
      o.db = std::stoi(std::string(db));
    }
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

  /// (Re)connects if needed and PINGs, within one batch deadline.
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
          redisAppendCommandArgv(ctx_, 2, argv, len);
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
          redisAppendCommandArgv(ctx_, opt_.ttl_seconds != 0 ? 5 : 3, argv, len);
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
          redisAppendCommandArgv(ctx_, 2, argv, len);
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
          redisAppendCommandArgv(ctx_, 2, argv, len);
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

  void drop() {
    if (ctx_ != nullptr) redisFree(ctx_);
    ctx_ = nullptr;
    rpos_ = rlen_ = 0;  // unread replies belong to the dropped connection
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
        (r.text.substr(0, 6) == "MOVED " || r.text.substr(0, 4) == "ASK " ||
         r.text.substr(0, 8) == "TRYAGAIN")) {
      redirects_->emplace_back(current_, std::string(r.text));
      return KeyState::kError;
    }
    if (first_error_.empty())
      first_error_ = r.type == '-' ? std::string(r.text)
                                   : std::string("unexpected reply type '") + r.type + "'";
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
      return make_status(StatusCode::kTimeout, "redis ", opt_.host, ":", opt_.port, " ", what,
                         ": no answer within the socket timeout or batch deadline (", msg, ")");
    return make_status(StatusCode::kIoError, "redis ", opt_.host, ":", opt_.port, " ", what, ": ",
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
    KVKIT_CHECK_STATUS(left.count() > 0, StatusCode::kTimeout, "redis ", opt_.host, ":", opt_.port,
                       ": batch deadline passed before connecting");
    const auto ct = std::min<std::chrono::microseconds>(left, opt_.connect_timeout);
    ctx_ = redisConnectWithTimeout(opt_.host.c_str(), opt_.port, to_timeval(ct));
    armed_ = std::chrono::microseconds(-1);
    if (ctx_ == nullptr || ctx_->err != 0) {
      const std::string msg = ctx_ != nullptr ? ctx_->errstr : "out of memory";
      drop();
      return make_status(StatusCode::kIoError, "redis connect to ", opt_.host, ":", opt_.port,
                         " failed: ", msg);
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
    return ping_locked(deadline);
  }

  // Replies are read straight from the socket (hiredis 0.14's reader reads 16 KiB at a
  // time and copies every value twice): big reads into rbuf_, a GET value copied once
  // into its destination string, or read into it directly when it is large. Every
  // blocking read is armed with arm_timeout first.
  Status read_some(char* dst, std::size_t cap, std::size_t* got,  // dst: [cap]
                   Clock::time_point deadline) {
    for (;;) {
      if (!arm_timeout(deadline)) {
        drop();
        return make_status(StatusCode::kTimeout, "redis ", opt_.host, ":", opt_.port,
                           ": batch deadline of ", opt_.batch_deadline.count(), " ms passed");
      }
      const ssize_t r = ::read(ctx_->fd, dst, cap);
      if (r > 0) {
        *got = static_cast<std::size_t>(r);
        return Status::ok();
      }
      if (r < 0 && errno == EINTR) continue;
      const int err = r == 0 ? 0 : errno;
      drop();
      if (err == EAGAIN || err == EWOULDBLOCK)
        return make_status(StatusCode::kTimeout, "redis ", opt_.host, ":", opt_.port,
                           ": no answer within the socket timeout or batch deadline");
      return make_status(StatusCode::kIoError, "redis ", opt_.host, ":", opt_.port, ": ",
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
    return make_status(StatusCode::kIoError, "redis ", opt_.host, ":", opt_.port,
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
          if (dest != nullptr && len - copied >= kReadChunk / 2) {  // large: read in place
            std::size_t got = 0;
            KVKIT_RETURN_IF_ERROR(read_some(&(*dest)[copied], len - copied, &got, deadline));
            copied += got;
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

  // Writes every appended command (blocking, each write armed with arm_timeout).
  Status flush(Clock::time_point deadline) {
    int done = 0;
    while (!done) {
      if (!arm_timeout(deadline)) {
        drop();
        return make_status(StatusCode::kTimeout, "redis ", opt_.host, ":", opt_.port,
                           ": batch deadline passed while writing");
      }
      errno = 0;
      if (redisBufferWrite(ctx_, &done) != REDIS_OK) return io_failure("write", deadline);
    }
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
          // Flushed every kFlushBytes: hiredis moves the unwritten rest of its output
          // buffer to the front after each partial write, so small flushes stay cheap.
          std::size_t unflushed = 0;
          while (next < n && next - done < max_cmds &&
                 (next == done || inflight_bytes + costs_[next - 1] <= max_bytes)) {
            if (asking_) {  // ASK redirection: ASKING must precede the command
              const char* argv[1] = {"ASKING"};
              const std::size_t len[1] = {6};
              redisAppendCommandArgv(ctx_, 1, argv, len);
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
};

}  // namespace store
}  // namespace kvkit
