#!/usr/bin/env bash
# Installs the Debian 12 packages shardsafe builds and tests with (only those missing).
# Everything comes from Debian: LibTorch 1.13 with c10d and Gloo, simdjson, xxHash, Boost, doctest, CLI11,
# OpenSSL, Meson, clang with libFuzzer for the fuzz targets, and Python's torch (python3-torch, the
# real PyTorch peer of the interop tests), iproute2 for the simulated cluster (scripts/cluster.sh).
#
#   scripts/deps.sh        everything the tests need
#   scripts/deps.sh demo   only what scripts/demo.sh builds with (the library, LibTorch, the tool
#                          without the remote backends): a fresh machine is ready sooner
set -euo pipefail
packages=(
  g++ meson ninja-build pkg-config cmake
  libtorch-dev libgloo-dev libsimdjson-dev libxxhash-dev libre2-dev libssl-dev libcli11-dev
)
if [ "${1:-}" != demo ]; then
  packages+=(
    libboost-dev doctest-dev
    clang libclang-rt-14-dev clang-19 clang-format-19 debootstrap
    python3 python3-torch
    nginx-light openssl iproute2
  )
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
# (waits, bounded, for another package manager run holding the lock: scripts/apt.sh)
. "$(dirname "$0")/apt.sh"
apt_get update -q
apt_get install -y -q --no-install-recommends "${missing[@]}"
