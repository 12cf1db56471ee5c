#!/usr/bin/env bash
# Builds scripts/llamacpp-parity/logits (see logits.cpp) against the project venv's
# llama-cpp-python 0.3.36 (scripts/setup-venv.sh), whose libggml-cpu.so provides the kernels.
#   scripts/llamacpp-parity/build.sh [VENV_DIR] [OUT_BINARY]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${1:-"$repo/../kvkit-venv"}
out=${2:-/tmp/kvkit-llamacpp-parity-logits}
lib=$("$venv/bin/python" -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))")
# -ffp-contract=off: the ggml-order arithmetic written here must not be fused by the compiler.
g++ -std=c++17 -O2 -DNDEBUG -ffp-contract=off -DKVKIT_SOURCE_DIR="\"$repo\"" -DKVKIT_HAS_EIGEN=1 \
    -I"$repo/include" -I"$repo/examples" -isystem /usr/include/eigen3 \
    "$here/logits.cpp" -o "$out" -L"$lib" -lggml-cpu -lggml-base -Wl,-rpath,"$lib" -lpthread
echo "$out"
