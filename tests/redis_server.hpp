#pragma once
// A private redis-server for tests and benchmarks: started on a free loopback port and a
// unix socket in /tmp (no persistence), optionally with a password or as a lone
// cluster-enabled node, stopped on destruction. Also find_redis_server() / free_port(). No
// Catch2 here (bench/ uses it too).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kvkit/store/redis_store.hpp"

namespace kvkit_test {

using kvkit::store::RedisBackend;
using kvkit::store::RedisOptions;

inline std::string find_redis_server() {
  const char* path = std::getenv("PATH");
  std::string p = path != nullptr ? path : "/usr/bin:/usr/local/bin";
  std::size_t start = 0;
  while (start <= p.size()) {
    const std::size_t end = std::min(p.find(':', start), p.size());
    const std::string cand = p.substr(start, end - start) + "/redis-server";
    if (::access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  return {};
}

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

inline bool port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

/// Timeouts for tests that are not about timeouts. The library's defaults (500 ms per socket
/// operation, 5 s per batch) suit an engine; on a loaded 2-core CI machine, or under ASan, a
/// descheduled client or server can exceed them while moving 32 MiB, which would fail a
/// test that checks data, not latency. Tests of deadlines set their own values afterwards.
inline RedisOptions with_test_timeouts(RedisOptions o) {
  o.connect_timeout = std::chrono::milliseconds(5000);
  o.op_timeout = std::chrono::milliseconds(10000);
  o.batch_deadline = std::chrono::milliseconds(120000);
  return o;
}

// A private redis-server on a free loopback port (no persistence), stopped on destruction.
class RedisServer {
 public:
  explicit RedisServer(std::string password = {}, bool cluster_enabled = false)
      : password_(std::move(password)), cluster_(cluster_enabled) {
    binary_ = find_redis_server();
    if (binary_.empty()) return;
    for (int attempt = 0; attempt < 8 && pid_ <= 0; ++attempt) {
      port_ = free_port();
      // A cluster node also listens on port + 10000 (the cluster bus).
      if (cluster_ && (port_ > 55535 || !port_free(port_ + 10000))) continue;
      if (!spawn()) stop();
    }
  }
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  bool running() const { return pid_ > 0; }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  void signal(int sig) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  /// Whether the next restart() starts a lone cluster-enabled node (or a plain server).
  void set_cluster_enabled(bool on) { cluster_ = on; }
  /// Kills the server and starts a fresh one on the same port (data is gone).
  bool restart() {
    stop();
    return spawn();
  }
  /// Options reaching this server, with the test timeouts (with_test_timeouts).
  RedisOptions options() const {
    RedisOptions o;
    o.host = "127.0.0.1";
    o.port = port_;
    o.password = password_;
    return with_test_timeouts(o);
  }
  /// The server's unix socket (it listens there too).
  std::string unix_path() const {
    return "/tmp/kvkit-redis-" + std::to_string(::getpid()) + "-" + std::to_string(port_) + ".sock";
  }
  /// options() for the unix socket.
  RedisOptions unix_options() const {
    RedisOptions o = options();
    o.unix_path = unix_path();
    return o;
  }

 private:
  bool spawn() {
    const std::string port = std::to_string(port_);
    std::vector<std::string> args = {binary_, "--port", port, "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", "/tmp", "--daemonize", "no",
                                     "--unixsocket", unix_path(), "--unixsocketperm", "700"};
    if (!password_.empty()) {
      args.push_back("--requirepass");
      args.push_back(password_);
    }
    if (cluster_) {  // a lone cluster node (no slots): enough for CLUSTER KEYSLOT
      args.push_back("--cluster-enabled");
      args.push_back("yes");
      args.push_back("--cluster-config-file");
      args.push_back("kvkit-test-nodes-" + std::to_string(::getpid()) + "-" + port + ".conf");
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) {
        ::dup2(devnull, 1);
        ::dup2(devnull, 2);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(&a[0]);
      argv.push_back(nullptr);
      ::execv(binary_.c_str(), argv.data());
      ::_exit(127);
    }
    if (pid < 0) return false;
    pid_ = pid;
    // Ready when it answers PING (AUTH first when a password is set).
    for (int i = 0; i < 100; ++i) {
      int wstatus = 0;
      if (::waitpid(pid_, &wstatus, WNOHANG) == pid_) {  // exited: port taken?
        pid_ = -1;
        return false;
      }
      RedisOptions o = options();
      o.connect_timeout = std::chrono::milliseconds(200);
      o.batch_deadline = std::chrono::milliseconds(300);
      o.allow_cluster_node = cluster_;  // a cluster node answers the PING all the same
      RedisBackend probe(o);
      if (probe.connect().is_ok()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    int wstatus = 0;
    ::waitpid(pid_, &wstatus, 0);
    pid_ = -1;
    std::remove(unix_path().c_str());  // SIGKILL leaves it behind
    if (cluster_)
      std::remove(("/tmp/kvkit-test-nodes-" + std::to_string(::getpid()) + "-" +
                   std::to_string(port_) + ".conf")
                      .c_str());
  }

  std::string binary_;
  std::string password_;
  bool cluster_ = false;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace kvkit_test
