#!/usr/bin/env bash
# Creates the Python virtual environment for kvkit's tooling: llama-cpp-python (the
# reference the tokenizer fixtures and llama.cpp comparisons are recorded with), numpy and
# matplotlib (the plots of scripts/r1kv-quality-report.py).
# Only scripts under scripts/ use it; building and testing kvkit never need Python.
#
#   scripts/setup-venv.sh [VENV_DIR]      # default: ../kvkit-venv (next to the repository)
#   VENV_DIR/bin/python scripts/record-tokenizer-fixtures.py
#
# llama-cpp-python is installed from its source distribution on PyPI, which compiles
# llama.cpp: expect about 20 minutes on 2 cores (CMAKE_BUILD_PARALLEL_LEVEL sets the job
# count). An existing venv that already has the pinned version is left as it is.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-"$repo/../kvkit-venv"}
llama_version=0.3.36

if [[ -x "$venv/bin/python" ]] &&
   "$venv/bin/python" -c "import llama_cpp, numpy, sys; sys.exit(llama_cpp.__version__ != '$llama_version')" 2>/dev/null; then
  echo "setup-venv: $venv already has llama-cpp-python $llama_version and numpy"
  "$venv/bin/python" -c "import matplotlib" 2>/dev/null || "$venv/bin/python" -m pip install matplotlib
  exit 0
fi

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --upgrade pip
echo "setup-venv: building llama-cpp-python $llama_version from source (about 20 minutes)..."
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  "$venv/bin/python" -m pip install "llama-cpp-python==$llama_version" numpy matplotlib
"$venv/bin/python" -c "import llama_cpp; print('setup-venv: llama-cpp-python', llama_cpp.__version__, 'in $venv')"
