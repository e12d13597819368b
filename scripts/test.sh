#!/usr/bin/env bash
# The test command of the README (and of CI): installs what is missing, builds everything,
# runs every test suite (format, shard, storage, tool, c10d worlds, resume, examples,
# packaging), smoke-runs the benchmarks, then the fuzz targets under ASan/UBSan for a bounded time.
#
#   scripts/test.sh                 # all of it
#   FUZZ_SECONDS=0 scripts/test.sh  # without the fuzz runs
#
# Nothing is skipped here: it fails when python3 (with pickle, pickletools and json, for the
# cross-checks against Python) or the shardsafe tool (for the tool's tests) is missing, and
# exports SHARDSAFE_REQUIRE_PYTHON=1 so that the tests fail rather than skip without Python.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
python3 -c 'import json, pickle, pickletools' ||
  { echo "test.sh: python3 with json, pickle and pickletools is needed for the Python cross-checks" >&2; exit 1; }
export SHARDSAFE_REQUIRE_PYTHON=1
scripts/check_layering.sh
# a fresh build without debug information (asserts kept): the LibTorch and Beast translation
# units compile markedly faster without -g on a 2-core machine; CI starts from a fresh clone
[ -f build/build.ninja ] || meson setup build -Ddebug=false -Db_ndebug=false
meson configure build -Dbench=true -Dtools=true
meson compile -C build
[ -x build/tools/shardsafe ] ||
  { echo "test.sh: build/tools/shardsafe was not built; the tool's tests need it" >&2; exit 1; }
meson test -C build --print-errorlogs
# the benchmarks, once each with --quick: a smoke run that they build and work, not a measurement
meson test -C build --benchmark --print-errorlogs
if [ "${FUZZ_SECONDS:-15}" != "0" ]; then
  FUZZ_SECONDS="${FUZZ_SECONDS:-15}" fuzz/run.sh
fi
echo "all tests passed"
