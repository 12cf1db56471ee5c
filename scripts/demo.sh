#!/usr/bin/env bash
# Builds the `kvkit` CLI (Release) and runs 64 greedy decoding steps through the example
# paged engine: on ../shared/models/stories260K.bin when present, else on a synthetic model.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVKIT_BUILD_DIR:-"$root/build"}

bash "$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" --target kvkit_cli -j"$(nproc)"

model="$(cd "$root/.." && pwd)/shared/models/stories260K.bin"
args=(generate --steps 64)
if [[ -f "$model" ]]; then
  args+=(--model "$model")
else
  echo "demo: $model not found; using the synthetic model"
fi
echo "demo: kvkit ${args[*]}"
"$build/examples/kvkit" "${args[@]}"
