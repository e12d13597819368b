#!/usr/bin/env bash
# The test command of the README (and of CI): installs what is missing, builds everything,
# runs every test suite (format, shard, storage, tool, c10d worlds, resume, examples,
# packaging), smoke-runs the benchmarks, then the fuzz targets under ASan/UBSan for a bounded time.
#
#   scripts/test.sh                 # all of it
#   FUZZ_SECONDS=0 scripts/test.sh  # without the fuzz runs
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/check_layering.sh
[ -f build/build.ninja ] || meson setup build
meson configure build -Dbench=true
meson compile -C build
meson test -C build --print-errorlogs
# the benchmarks, once each with --quick: a smoke run that they build and work, not a measurement
meson test -C build --benchmark --print-errorlogs
if [ "${FUZZ_SECONDS:-30}" != "0" ]; then
  FUZZ_SECONDS="${FUZZ_SECONDS:-30}" fuzz/run.sh
fi
echo "all tests passed"
