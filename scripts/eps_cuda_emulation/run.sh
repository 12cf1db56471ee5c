#!/usr/bin/env bash
# Runs the CUDA EPS kernels (include/kvkit/kernels/cuda/eps.cuh) on the host, for a machine
# without a GPU: the header is copied next to a fake common.cuh (host stand-ins for the few
# CUDA pieces it uses), its <<<grid, block, smem, stream>>> launches are rewritten into
# emu::launch calls that run every block in turn with one std::thread per CUDA thread and a
# std::barrier for __syncthreads, and summaries / page subsets / omitted bounds are compared
# with the CPU Sketcher (bit for bit) on random cases, under ASan and UBSan. This checks the
# kernels' indexing, scans, barriers (a divergent barrier hangs: hence the timeout) and the
# status contract; not the GPU's math library (exp) or memory model.
# Usage: scripts/eps_cuda_emulation/run.sh [build dir]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-/tmp/eps_cuda_emulation}"
mkdir -p "$out/kvkit/kernels/cuda"
cp "$here/fake/kvkit/kernels/cuda/common.cuh" "$out/kvkit/kernels/cuda/common.cuh"
python3 - "$root/include/kvkit/kernels/cuda/eps.cuh" "$out/kvkit/kernels/cuda/eps.cuh" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
def split_top(cfg):
    parts, depth, cur = [], 0, ''
    for ch in cfg:
        if ch in '([': depth += 1
        if ch in ')]': depth -= 1
        if ch == ',' and depth == 0:
            parts.append(cur.strip()); cur = ''
        else:
            cur += ch
    parts.append(cur.strip())
    return parts
pat = re.compile(r'([\w:]+<[^<>]*>)<<<(.*?)>>>\((.*?)\);', re.S)
def rep(m):
    cfg = split_top(m.group(2))
    return 'emu::launch(%s, %s, [&] { %s(%s); });' % (cfg[0], cfg[1], m.group(1), m.group(3))
s, n = pat.subn(rep, s)
assert n == 6 and '<<<' not in s, "launch syntax not rewritten (%d)" % n
old = 'extern __shared__ float qf[];  // [d]'
assert old in s
s = s.replace(old, 'static float qf[1024];  // [d] (dynamic shared memory)')
open(sys.argv[2], 'w').write(s)
PY
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -I"$out" -I"$root/include" -I"$root/tests" \
    "$here/emulate_eps_cuda.cpp" -o "$out/emulate_eps_cuda" -pthread
timeout 900 "$out/emulate_eps_cuda"
