#!/usr/bin/env bash
# Runs CUDA kernels of kvkit on the host, for a machine without a GPU:
#   r1kv  include/kvkit/kernels/cuda/r1kv.cuh: kept lists against the CPU twin
#         (exec::Host) on the cases of tests/cuda/test_r1kv_cuda.cu
#   eps   include/kvkit/kernels/cuda/eps.cuh: summaries, page subsets and omitted bounds
#         against the CPU Sketcher, bit for bit, on random cases
#   kvchan include/kvkit/kernels/cuda/kvchan_pack.cuh and kvchan_residual.cuh: packed rows,
#         residual codes, scales and unpacked dims bit for bit with the CPU twins, residual
#         attention within float rounding, on the cases of tests/cuda/test_kvchan_residual_cuda.cu
# Each header is copied next to a fake common.cuh (host stand-ins for the few CUDA pieces the
# kernels use), its <<<grid, block, smem, stream>>> launches are rewritten into emu::launch
# calls that run every block in turn with one std::thread per CUDA thread and a
# std::barrier for __syncthreads, and the driver runs under ASan and UBSan. This checks the
# kernels' indexing, scans, barriers (a divergent barrier hangs: hence the timeout) and the
# status contract; not the GPU's math library (expf, exp) or memory model.
# Usage: scripts/cuda_emulation/run.sh r1kv|eps|kvchan [build dir]
set -euo pipefail
kernel="${1:?usage: $0 r1kv|eps|kvchan [build dir]}"
case "$kernel" in
  r1kv | eps) headers="$kernel" ;;
  kvchan) headers="kvchan_pack kvchan_residual" ;;
  *) echo "unknown kernel '$kernel' (r1kv, eps or kvchan)" >&2; exit 2 ;;
esac
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${2:-/tmp/${kernel}_cuda_emulation}"
mkdir -p "$out/kvkit/kernels/cuda"
cp "$here/fake/kvkit/kernels/cuda/common.cuh" "$out/kvkit/kernels/cuda/common.cuh"
for h in $headers; do
python3 - "$root/include/kvkit/kernels/cuda/$h.cuh" "$out/kvkit/kernels/cuda/$h.cuh" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
def split_top(cfg):  # the launch configuration's top-level arguments
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
pat = re.compile(r'([\w:]+(?:<[^<>]*>)?)\s*<<<(.*?)>>>\((.*?)\);', re.S)
def rep(m):
    cfg = split_top(m.group(2))
    return 'emu::launch(%s, %s, [&] { %s(%s); });' % (cfg[0], cfg[1], m.group(1), m.group(3))
s, n = pat.subn(rep, s)
assert n > 0 and '<<<' not in s, "launch syntax not rewritten (%d)" % n
# Dynamic shared memory (eps.cuh's query row) as a static array.
s = s.replace('extern __shared__ __align__(16) unsigned char eps_dyn[];',
              'alignas(16) static unsigned char eps_dyn[1 << 18];  // dynamic shared memory')
assert 'extern __shared__' not in s, "dynamic shared memory left"
open(sys.argv[2], 'w').write(s)
PY
done
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -I"$out" -I"$root/include" -I"$root/tests" \
    "$here/emulate_${kernel}_cuda.cpp" -o "$out/emulate_${kernel}_cuda" -pthread
timeout 900 "$out/emulate_${kernel}_cuda"
