#!/usr/bin/env bash
# kvkit's full test run:
#   1. installs dependencies (scripts/install-deps.sh, fast when already present)
#   2. starts a private redis-server on a free loopback port (KVKIT_REDIS_URL for the tests)
#   3. Release build, C++17, CUDA when nvcc exists, in build/; runs every CTest test
#   4. sanitizer build (ASan+UBSan, Debug), C++20, no CUDA, no benchmarks, in build-asan/; runs
#      every test except the packaging ones (label `packaging`, already run in step 3), and
#      two CUDA test files on the host emulation of CUDA (tests/cuda_emulation.cmake)
# Exits non-zero when anything fails; the last line says what passed.
# Environment: KVKIT_BUILD_DIR, KVKIT_ASAN_BUILD_DIR override the two build folders.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVKIT_BUILD_DIR:-"$root/build"}
asan_build=${KVKIT_ASAN_BUILD_DIR:-"$root/build-asan"}
jobs=$(nproc)
start=$SECONDS

bash "$root/scripts/install-deps.sh"

# --- private redis-server ------------------------------------------------------------
redis_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvkit-redis.XXXXXX")
redis_pid=""
cleanup() {
  if [[ -n "$redis_pid" ]] && kill -0 "$redis_pid" 2>/dev/null; then
    kill "$redis_pid" 2>/dev/null || true
    wait "$redis_pid" 2>/dev/null || true
  fi
  rm -rf "$redis_dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

redis_port=""
for attempt in 1 2 3 4 5; do
  port=$(free_port)
  redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
               --dir "$redis_dir" --logfile "$redis_dir/redis.log" --daemonize no &
  redis_pid=$!
  for _ in $(seq 1 50); do
    if ! kill -0 "$redis_pid" 2>/dev/null; then break; fi  # exited: port taken
    if [[ $(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null || true) == PONG ]]; then
      redis_port=$port
      break
    fi
    sleep 0.1
  done
  [[ -n "$redis_port" ]] && break
  kill "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
  redis_pid=""
  echo "test.sh: redis-server did not start on port $port (attempt $attempt)" >&2
done
if [[ -z "$redis_port" ]]; then
  echo "test.sh: FAILED: could not start redis-server" >&2
  cat "$redis_dir/redis.log" >&2 2>/dev/null || true
  exit 1
fi
export KVKIT_REDIS_URL="redis://127.0.0.1:$redis_port"
echo "test.sh: redis-server (pid $redis_pid) at $KVKIT_REDIS_URL"

# --- builds and tests ------------------------------------------------------------------
failed=()
step() {  # step <name> <command...>: runs it, records a failure instead of stopping
  local name=$1
  shift
  echo "test.sh: === $name === (at $((SECONDS - start))s)"
  if ! "$@"; then
    failed+=("$name")
    return 1
  fi
}

if step "release configure" cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_STANDARD=17 -DKVKIT_CUDA=AUTO -DKVKIT_SANITIZE=OFF \
      -DKVKIT_BUILD_TESTS=ON -DKVKIT_BUILD_EXAMPLES=ON -DKVKIT_BUILD_BENCH=ON &&
   step "release build" cmake --build "$build" -j"$jobs"; then
  step "release tests" ctest --test-dir "$build" --output-on-failure -j"$jobs" || true
fi

# Debug (-O0): GCC 12 reports false -Wmaybe-uninitialized errors inside <regex> (Catch2's
# main) when optimising under the sanitizers.
# The sanitizer build sees only the small checkpoint: SmolLM2 (30 layers, 135M weights) runs
# in the Release build above, and at -O0 under ASan it would take most of CI's time. Its
# tests print their "no model file" skip here; the GGUF reader's own tests (synthetic files,
# fuzzing) still run under the sanitizers.
small_models="$asan_build/models-small"
mkdir -p "$small_models"
model_dir=$(grep -E '^KVKIT_MODEL_DIR:PATH=' "$build/CMakeCache.txt" 2>/dev/null | cut -d= -f2- || true)
model_dir=${model_dir:-"$root/../shared/models"}
if [[ -f "$model_dir/stories260K.bin" ]]; then
  ln -sf "$(cd "$model_dir" && pwd)/stories260K.bin" "$small_models/stories260K.bin"
fi
# -g1: line tables for the sanitizers' stack traces, without full debug info (which costs
# about 7 % of the build and is not needed to read a report).
if step "asan configure" cmake -S "$root" -B "$asan_build" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
      -DKVKIT_MODEL_DIR="$small_models" \
      -DCMAKE_CXX_STANDARD=20 -DKVKIT_CUDA=OFF -DKVKIT_SANITIZE=ON \
      -DKVKIT_BUILD_TESTS=ON -DKVKIT_BUILD_EXAMPLES=ON -DKVKIT_BUILD_BENCH=OFF &&
   step "asan build" cmake --build "$asan_build" -j"$jobs"; then
  step "asan tests" ctest --test-dir "$asan_build" --output-on-failure -j"$jobs" \
       --label-exclude packaging || true
fi

elapsed=$((SECONDS - start))
if ((${#failed[@]} > 0)); then
  echo "test.sh: FAILED: $(IFS=,; echo "${failed[*]}") (${elapsed}s)"
  exit 1
fi
echo "test.sh: PASSED: release (C++17, CUDA AUTO) and ASan/UBSan (C++20) builds, all tests (${elapsed}s)"
