#!/usr/bin/env bash
# Runs kvkit's CUDA test files (tests/cuda/test_*.cu) on the host, for a machine without a
# GPU: the real headers (include/kvkit/cuda.cuh and kernels/cuda/*.cuh) and the real tests,
# compiled as C++20 against a stand-in CUDA runtime (runtime/cuda_runtime.h explains the
# execution model: blocks in turn, a block's threads as fibers switched at barriers),
# under ASan and UBSan. rewrite.py copies the .cuh / .cu files with their launches
# rewritten into emu::launch calls. (The ASan build of scripts/test.sh runs
# test_cuda_parity this way too: tests/cuda_emulation.cmake.)
#
# Usage: scripts/cuda_emulation/run_tests.sh [test name ...] [-- catch2 arguments]
#   (default: every tests/cuda/test_*.cu; e.g. run_tests.sh test_cuda_parity -- "[attention]")
# Environment: KVKIT_EMU_OUT (build folder, default /tmp/kvkit_cuda_emulation),
#   KVKIT_EMU_TIMEOUT (seconds per test file, default 1800), KVKIT_EMU_SCHEDULE (forward,
#   the default, reverse or random: the order of a grid's blocks and of a block's threads
#   between barriers; each test file runs once per schedule listed, e.g.
#   KVKIT_EMU_SCHEDULE="forward reverse random"), KVKIT_EMU_SEED (random's seed, default 1).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${KVKIT_EMU_OUT:-/tmp/kvkit_cuda_emulation}"
tests=()
while (($#)); do
  if [[ "$1" == "--" ]]; then shift; break; fi
  tests+=("$1"); shift
done
if ((${#tests[@]} == 0)); then
  for f in "$root"/tests/cuda/test_*.cu; do tests+=("$(basename "$f" .cu)"); done
fi

mkdir -p "$out/bin"
python3 "$here/rewrite.py" "$root" "$out/src"

flags=(-std=c++20 -O1 -g -Wno-deprecated -fno-strict-aliasing -fsanitize=address,undefined -fno-sanitize-recover=all
       -D__CUDACC__ -include cuda_runtime.h -I"$here/runtime" -I"$out/src/include" -I"$root/include" -I"$root/tests" -pthread)
[[ -f "$out/bin/test_main.o" ]] || g++ -std=c++20 -O1 -g -fsanitize=address,undefined -c "$root/tests/test_main.cpp" -o "$out/bin/test_main.o"
status=0
for t in "${tests[@]}"; do
  echo "== $t: build"
  g++ "${flags[@]}" -x c++ "$out/src/tests/cuda/$t.cu" -x none "$out/bin/test_main.o" -o "$out/bin/$t"
  for sched in ${KVKIT_EMU_SCHEDULE:-forward}; do
    echo "== $t ($sched): run"
    start=$(date +%s)
    if KVKIT_EMU_SCHEDULE=$sched timeout "${KVKIT_EMU_TIMEOUT:-1800}" "$out/bin/$t" "$@"; then
      echo "== $t ($sched): passed in $(($(date +%s) - start)) s"
    else
      echo "== $t ($sched): FAILED (exit $?) after $(($(date +%s) - start)) s"
      status=1
    fi
  done
done
exit $status
