#!/usr/bin/env bash
# A local 3-master Redis Cluster for `kvkit store-demo --store redis-cluster://...` (and
# manual tests), built the way the test fixture does it (tests/test_redis_store.cpp):
# cluster-enabled redis-servers on free loopback ports, joined with
# `redis-cli --cluster create ... --cluster-replicas 0`. No persistence.
#
#   scripts/redis-cluster.sh start [DIR]   starts it; prints the URL, redis-cluster://127.0.0.1:P1,...
#   scripts/redis-cluster.sh url [DIR]     prints the URL of a running one
#   scripts/redis-cluster.sh stop [DIR]    stops the servers this script started in DIR, removes its files
#
# DIR (default ${TMPDIR:-/tmp}/kvkit-redis-cluster) holds the nodes' pid, log and
# cluster-config files. Needs redis-server, redis-cli and python3 (free ports).
# Exit codes: 0 ok, 1 failed (the log of the failing node is printed), 2 usage.
set -euo pipefail

cmd=${1:-}
dir=${2:-"${TMPDIR:-/tmp}/kvkit-redis-cluster"}
masters=3

usage() {
  echo "usage: $0 start|url|stop [DIR]" >&2
  exit 2
}

# A free loopback port P whose cluster-bus port P + 10000 is free too.
free_cluster_port() {
  python3 - <<'EOF'
import socket
for _ in range(64):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    if p > 55535:
        continue
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 10000))
    except OSError:
        continue
    finally:
        b.close()
    print(p)
    break
EOF
}

stop_nodes() {
  [[ -d "$dir" ]] || return 0
  local f pid
  for f in "$dir"/node-*.pid; do
    [[ -f "$f" ]] || continue
    pid=$(cat "$f")
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
    fi
  done
  # Only what start wrote: DIR may be a folder of the caller's.
  rm -f "$dir"/node-*.pid "$dir"/node-*.log "$dir"/nodes-*.conf "$dir/url" "$dir/create.log"
  rmdir "$dir" 2>/dev/null || true
}

url_of() {
  [[ -f "$dir/url" ]] || { echo "redis-cluster.sh: no cluster in $dir (run: $0 start)" >&2; exit 1; }
  cat "$dir/url"
}

ping_ok() { [[ $(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null || true) == PONG ]]; }

start_nodes() {
  command -v redis-server > /dev/null || { echo "redis-cluster.sh: no redis-server" >&2; exit 1; }
  command -v redis-cli > /dev/null || { echo "redis-cluster.sh: no redis-cli" >&2; exit 1; }
  if [[ -f "$dir/url" ]]; then
    echo "redis-cluster.sh: $dir already holds a cluster ($(cat "$dir/url")); stop it first" >&2
    exit 1
  fi
  mkdir -p "$dir"
  local ports=() port i attempt
  for ((i = 0; i < masters; ++i)); do
    for attempt in 1 2 3 4 5; do
      port=$(free_cluster_port)
      [[ -n "$port" ]] || continue
      redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
                   --cluster-enabled yes --cluster-config-file "$dir/nodes-$port.conf" \
                   --dir "$dir" --logfile "$dir/node-$port.log" \
                   --pidfile "$dir/node-$port.pid" --daemonize yes > /dev/null
      for _ in $(seq 1 50); do
        ping_ok "$port" && break
        sleep 0.1
      done
      if ping_ok "$port"; then
        ports+=("$port")
        break
      fi
      echo "redis-cluster.sh: node on port $port did not start (attempt $attempt)" >&2
      cat "$dir/node-$port.log" >&2 2>/dev/null || true
      port=""
    done
    if [[ -z "$port" ]]; then
      stop_nodes
      exit 1
    fi
  done
  local addrs=() url="redis-cluster://"
  for port in "${ports[@]}"; do addrs+=("127.0.0.1:$port"); done
  if ! redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes > "$dir/create.log" 2>&1; then
    echo "redis-cluster.sh: redis-cli --cluster create failed:" >&2
    cat "$dir/create.log" >&2
    stop_nodes
    exit 1
  fi
  # Until every node reports the cluster ok (the slot map has reached all of them).
  local ok=""
  for _ in $(seq 1 200); do
    ok=yes
    for port in "${ports[@]}"; do
      redis-cli -h 127.0.0.1 -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || ok=""
    done
    [[ -n "$ok" ]] && break
    sleep 0.05
  done
  if [[ -z "$ok" ]]; then
    echo "redis-cluster.sh: the cluster did not reach cluster_state:ok" >&2
    stop_nodes
    exit 1
  fi
  url+=$(IFS=,; echo "${addrs[*]}")
  echo "$url" > "$dir/url"
  echo "$url"
}

case "$cmd" in
  start) start_nodes ;;
  url) url_of ;;
  stop) stop_nodes ;;
  *) usage ;;
esac
