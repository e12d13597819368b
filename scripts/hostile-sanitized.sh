#!/usr/bin/env bash
# The hostile suite (tests/hostile/hostile.py) against the tool built with ASan and UBSan: every
# case's commands run under the sanitizers, and a case fails on any report (a heap overflow, a
# leak, undefined behaviour) whatever the exit code. Not in CI: once per round of hostile-input
# work, by hand (the instrumented tool is 2-3x slower; the whole suite takes about 30 min on 2 cores).
#
#   bash scripts/hostile-sanitized.sh                  # every case
#   bash scripts/hostile-sanitized.sh big_torch_bin    # some cases (hostile.py's names, --list)
#
# Environment: SANITIZED_BUILD_DIR (default build-sanitized, relative to the repository root),
# CXX/CC (default g++/gcc). The build is torch-free (the tool needs no LibTorch) and keeps its
# asserts. hostile.py's limits are widened under SHARDSAFE_HOSTILE_SANITIZED=1 (10x CPU, 16x RSS:
# shadow memory and quarantine), so this run checks the sanitizers' verdict; the plain build
# checks the real limits. SHARDSAFE_HOSTILE_OPEN=1 adds the cases kept out of the default run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SANITIZED_BUILD_DIR:-build-sanitized}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "$root" -Db_sanitize=address,undefined -Db_lundef=false -Dtorch=disabled \
    -Dtests=false -Dexamples=false -Dbench=false -Dtools=true -Doptimization=1 -Ddebug=true -Db_ndebug=false
fi
meson compile -C "$build" tools/shardsafe

export SHARDSAFE_HOSTILE_SANITIZED=1
# UBSan stops at its first report (and so fails the command); ASan reports leaks at exit.
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:abort_on_error=1}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
exec python3 "$root/tests/hostile/hostile.py" "$build/tools/shardsafe" "$@"
