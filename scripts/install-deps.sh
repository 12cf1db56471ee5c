#!/usr/bin/env bash
# Installs what kvkit's build, tests and demo need (Debian/Ubuntu). Idempotent: when every
# package is already installed it returns at once without touching apt.
# CUDA is optional and not installed here; builds use it when /usr/local/cuda/bin/nvcc exists.
set -euo pipefail

packages=(build-essential cmake libeigen3-dev catch2 libbenchmark-dev libhiredis-dev
          redis-server libzstd-dev python3 libcli11-dev nlohmann-json3-dev)

missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  for p in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    [[ "$status" == ii* ]] || missing+=("$p")
  done
else
  echo "install-deps: dpkg-query not found (not Debian/Ubuntu?); install by hand: ${packages[*]}" >&2
  exit 0
fi

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
else
  echo "install-deps: installing ${missing[*]}"
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-deps: need root or sudo" >&2; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "install-deps: CUDA found at /usr/local/cuda (CUDA kernels and parity tests will build)"
else
  echo "install-deps: no /usr/local/cuda/bin/nvcc; building without CUDA"
fi
