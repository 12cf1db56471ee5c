#!/usr/bin/env python3
"""Copies kvkit's CUDA sources into a folder where the host emulation can compile them
(runtime/cuda_runtime.h): every .cuh under include/ and the files of tests/cuda/, with
each `kernel<<<grid, block[, smem[, stream]]>>>(args);` rewritten into
`emu::launch(grid, block[, smem[, stream]], [=] { kernel(args); });` and each dynamic
`extern __shared__ T name[];` into a static array. Every other header is read from the
source tree (the copies' folder goes first on the include path).

Usage: rewrite.py <kvkit root> <out folder>   (files whose text is unchanged are not
rewritten, so a build does not recompile them)."""
import pathlib
import re
import sys

LAUNCH = re.compile(r'([\w:]+(?:<[^<>]*>)?)\s*<<<(.*?)>>>\((.*?)\);', re.S)
DYN_SHARED = re.compile(r'extern __shared__ (?:__align__\((\d+)\) )?([\w ]+?) (\w+)\[\];')


def rewrite(text, name):
    text, n = LAUNCH.subn(lambda m: 'emu::launch(%s, [=] { %s(%s); });' % (m.group(2), m.group(1), m.group(3)), text)
    text = DYN_SHARED.sub(lambda m: 'alignas(%s) static %s %s[1 << 18];  // dynamic shared memory'
                          % (m.group(1) or '16', m.group(2), m.group(3)), text)
    if '<<<' in text:
        sys.exit('rewrite.py: %s: a launch was not rewritten' % name)
    if 'extern __shared__' in text:
        sys.exit('rewrite.py: %s: dynamic shared memory left' % name)
    return text, n


def main():
    root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    files = sorted(root.glob('include/**/*.cuh')) + sorted(root.glob('tests/cuda/*.cu*'))
    launches = 0
    for src in files:
        text, n = rewrite(src.read_text(), src)
        launches += n
        dst = out / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)
    print('rewrite.py: %d files, %d launches' % (len(files), launches))


if __name__ == '__main__':
    main()
