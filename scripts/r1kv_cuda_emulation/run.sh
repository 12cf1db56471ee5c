#!/usr/bin/env bash
# Runs the CUDA R1KV kernels (include/kvkit/kernels/cuda/r1kv.cuh) on the host, for a
# machine without a GPU: the header is copied next to a fake common.cuh (host stand-ins
# for the few CUDA pieces it uses), its <<<grid, block>>> launches are rewritten into
# emu::launch calls that run every block in turn with one std::thread per CUDA thread and a
# std::barrier for __syncthreads, and the kept lists are compared with the CPU twin
# (exec::Host) on the cases of tests/cuda/test_r1kv_cuda.cu, under ASan and UBSan. This
# checks indexing, barriers and the status contract; not the GPU's own math library
# (expf) or memory model. Usage: scripts/r1kv_cuda_emulation/run.sh [build dir]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-/tmp/r1kv_cuda_emulation}"
mkdir -p "$out/kvkit/kernels/cuda"
cp "$here/fake/kvkit/kernels/cuda/common.cuh" "$out/kvkit/kernels/cuda/common.cuh"
python3 - "$root/include/kvkit/kernels/cuda/r1kv.cuh" "$out/kvkit/kernels/cuda/r1kv.cuh" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
pat = re.compile(r'(cd::[\w<>]+)\s*<<<(.*?),\s*kT,\s*0,\s*stream>>>\((.*?)\);', re.S)
s, n = pat.subn(lambda m: 'emu::launch(%s, kT, [&] { %s(%s); });' % (m.group(2), m.group(1), m.group(3)), s)
assert n > 0 and '<<<' not in s, "launch syntax not rewritten"
open(sys.argv[2], 'w').write(s)
PY
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -I"$out" -I"$root/include" \
    "$here/emulate_r1kv_cuda.cpp" -o "$out/emulate_r1kv_cuda" -pthread
"$out/emulate_r1kv_cuda"
