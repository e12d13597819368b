#!/usr/bin/env bash
# scripts/device-check.sh - the GPU machine's check, one run (issue 32): builds the whole torch
# suite (tests/torch/, the CUDA cases of test_device.cpp among them) and bench/bench_device.cpp
# against the LibTorch inside Python's torch wheel, compiles every LibTorch example against it,
# writes a ~GIB GiB BF16 checkpoint, runs the CUDA cases, the Python peers and bench_device on
# it, then the rest of the torch suite. Everything it prints is also written under OUT
# (default /tmp/device-check).
#
#   bash scripts/device-check.sh [GIB]        (GIB: the benchmark model's size, default 10)
#
# The wheel ships no Gloo headers, so the suite builds without USE_C10D_GLOO and every world of
# its multi-process tests is a store world (torch/c10d.hpp, c10d_transport::store); GLOO=1 or 0
# forces the choice. PEERS=0 skips the Python peers (PEER_RATES=name=GB/s,... passes rates
# measured before); SUITE=0 skips the suite past its CUDA cases; UNITS="tests/torch/a.cpp ..."
# builds only those units of the suite (with torch_main.cpp; a quick rehearsal); SUITE_ARGS adds
# doctest options to the suite's run (-tc=... to pick cases; split at spaces, so a case's name
# is matched with * where it has a space); BENCH_ARGS adds bench_device options (--threads N,
# --sweep N,N, --slots N, --ranks N, --cold-reps N, ...; --cpu-rehearsal runs its device-free
# part without a GPU); BENCH_LIMIT is its time limit in seconds (default 360: the warm loads, the
# resharded checkpoint it writes into WORK/out and loads, the cold loads from the disk, the
# saves). The suite's torch peer tests run with TORCH_PYTHON (default: the
# python3 on PATH, the wheel's torch; the tests' SHARDSAFE_TORCH_PYTHON). A program that crashes
# is run again under cuda-gdb for a backtrace. Exits non-zero when anything failed.
#
# Needs python3 with torch and safetensors, a C++20 g++, and the torch-free dependencies
# (simdjson, xxHash, RE2, doctest, OpenSSL, CLI11 for the tool) as Debian 12 packages in DEBS (default .devdeps),
# unpacked here into a folder of their own:
#   mkdir -p .devdeps && (cd .devdeps && apt-get download libsimdjson-dev libsimdjson14 \
#     libxxhash-dev libxxhash0 libre2-dev libre2-9 doctest-dev libssl-dev libssl3 libcli11-dev)
# (DEBS=none: the system's own). The GPU machine builds without meson: its Python wheel's
# LibTorch has no pkg-config or system paths, and compiling the units directly is quicker.
# Without a CUDA device (a rehearsal: TORCH_INCLUDE and TORCH_LIBDIR name a CPU LibTorch) it
# builds and runs the same, links no CUDA library, the CUDA cases are counted as skipped and the
# bench says that it measured nothing.
set -u -o pipefail
cd "$(dirname "$0")/.."
GIB=${1:-10}
OUT=${OUT:-/tmp/device-check}
DEBS=${DEBS:-.devdeps}
WORK=${WORK:-$PWD/.device-work}   # on disk: the checkpoint and the saves take ~3 x GIB
mkdir -p "$OUT" "$WORK"
log() { echo "== $(date +%T) $*"; }
# the Python peer of the suite's torch tests: the one with the wheel's torch (torch 2.x)
export SHARDSAFE_TORCH_PYTHON="${TORCH_PYTHON:-$(command -v python3)}"
failed=()   # what went wrong, said again at the end (and the exit status)
exec > >(tee "$OUT/device-check.log") 2>&1

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -c 'import torch, safetensors; print("torch", torch.__version__, "cuda", torch.version.cuda, "safetensors", safetensors.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
nproc; free -g | head -2; df -h /dev/shm "$WORK" | tail -2; ${CXX:-g++} --version | head -1

T=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
ABI=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
TINC=${TORCH_INCLUDE:-$T/include}
TLIB=${TORCH_LIBDIR:-$T/lib}
DEPS="$WORK/deps"
mkdir -p "$DEPS"
[ "$DEBS" != none ] && for f in "$DEBS"/*.deb; do dpkg -x "$f" "$DEPS"; done
LIBDIR="$DEPS/usr/lib/x86_64-linux-gnu"
CXX=${CXX:-g++}
FLAGS=(-std=c++20 -D_GLIBCXX_USE_CXX11_ABI="$ABI" -Iinclude -I"$DEPS/usr/include"
       -isystem "$TINC/torch/csrc/api/include" -Wno-deprecated-declarations)
[ "$TINC" != /usr/include ] && FLAGS+=(-isystem "$TINC")
GLOO=${GLOO:-$([ -d "$TINC/gloo" ] && echo 1 || echo 0)}
[ "$GLOO" = 1 ] && FLAGS+=(-DUSE_C10D_GLOO=1)
CUDA_LIBS=()
[ -e "$TLIB/libtorch_cuda.so" ] && CUDA_LIBS=(-ltorch_cuda -lc10_cuda)
# libstdc++ first: the wheel's libtorch.so exports std::filesystem functions of its own, and
# a program that binds to them crashes (std::filesystem::remove_all jumps to address 0)
LIBS=(-Wl,--no-as-needed -lstdc++ -Wl,--as-needed -L"$LIBDIR" -Wl,-rpath,"$LIBDIR" -lsimdjson -lxxhash -lre2 -lcrypto
      -L"$TLIB" -Wl,-rpath,"$TLIB" -Wl,--no-as-needed "${CUDA_LIBS[@]}" -Wl,--as-needed -ltorch -ltorch_cpu -lc10 -pthread)
echo "LibTorch $TINC, $TLIB; Gloo headers: $GLOO; CUDA libraries: ${CUDA_LIBS[*]:-none}"

log "build: the torch suite (a unit a job), bench_device, and the checkpoint for the bench, at once"
t0=$(date +%s)
# the shardsafe tool (torch-free; CLI11 from DEBS), for the suite's cases that run it (a case
# that needs it is skipped where it did not build)
TOOL="$WORK/shardsafe"
rm -f "$TOOL"
$CXX "${FLAGS[@]}" -O1 -DSHARDSAFE_TOOL_REMOTE=0 tools/shardsafe.cpp -o "$TOOL" \
  -L"$LIBDIR" -Wl,-rpath,"$LIBDIR" -lsimdjson -lxxhash -lre2 -lcrypto -pthread > "$OUT/build_tool.log" 2>&1 &
p4=$!
TFLAGS=("${FLAGS[@]}" -O1 -Itests -DSHARDSAFE_TOOL="\"$TOOL\"" -DSHARDSAFE_SOURCE_DIR="\"$PWD\"" -DSHARDSAFE_TEST_REMOTE=0)
if [ -n "${UNITS:-}" ]; then read -ra units <<< "tests/torch/torch_main.cpp $UNITS"; else units=(tests/torch/*.cpp); fi
rm -rf "$WORK/obj"
mkdir -p "$WORK/obj"
# compile_unit SRC (the flags travel %q-quoted and are read back by bash's eval): FAILS: SRC if it fails
CC_TEST=$(printf '%q ' "$CXX" "${TFLAGS[@]}")
CC_SYNTAX=$(printf '%q ' "$CXX" "${FLAGS[@]}" -Iexamples -fsyntax-only)
export CC_TEST CC_SYNTAX WORK
compile_unit() {
  local b
  b=$(basename "$1" .cpp)
  eval "$CC_TEST"' -c "$1" -o "$WORK/obj/$b.o"' > "$WORK/obj/$b.log" 2>&1 || echo "FAILS: $1"
}
syntax_unit() {
  eval "$CC_SYNTAX"' "$1"' > "$WORK/syntax_$(basename "$1").log" 2>&1 && echo "compiles: $1" || echo "FAILS: $1"
}
export -f compile_unit syntax_unit
printf '%s\n' "${units[@]}" | xargs -P "$(nproc)" -I{} bash -c 'compile_unit "$1"' _ {} > "$WORK/compile.out" &
p1=$!
$CXX "${FLAGS[@]}" -O2 -DNDEBUG -Ibench bench/bench_device.cpp -o "$WORK/bench_device" "${LIBS[@]}" > "$OUT/build_bench.log" 2>&1 &
p2=$!
rm -rf "$WORK/ckpt"
python3 bench/device_peers.py write "$WORK/ckpt" "$GIB" "${PEERS:-1}" &
p3=$!
wait $p1
cat "$WORK/compile.out"
cat "$WORK"/obj/*.log > "$OUT/build_tests.log"
r1=1
if ! grep -q FAILS "$WORK/compile.out"; then
  $CXX -o "$WORK/torch_tests" "$WORK"/obj/*.o "${LIBS[@]}" >> "$OUT/build_tests.log" 2>&1
  r1=$?
fi
# every LibTorch example and the umbrella header, compiled (not linked) against this LibTorch
echo '#include "shardsafe/torch.hpp"' > "$WORK/umbrella_torch.cpp"
ls examples/*.cpp "$WORK/umbrella_torch.cpp" | xargs -P "$(nproc)" -I{} bash -c 'syntax_unit "$1"' _ {} | tee "$WORK/syntax.out"
grep -q FAILS "$WORK/syntax.out" && failed+=("an example or torch.hpp does not compile (syntax.log)")
for f in "$WORK"/syntax_*.log; do [ -s "$f" ] && { echo "== $f"; head -60 "$f"; }; done > "$OUT/syntax.log"
wait $p4 || { echo "the shardsafe tool did not build: the cases that run it are skipped"; tail -n 20 "$OUT/build_tool.log"; }
wait $p2; r2=$?
wait $p3; r3=$?
log "built in $(( $(date +%s) - t0 )) s: torch_tests rc=$r1, bench_device rc=$r2; checkpoint rc=$r3"
[ $r1 = 0 ] || { failed+=("the torch suite did not build"); grep -m 40 -B2 -A8 'error' "$OUT/build_tests.log"; }
[ $r2 = 0 ] || { failed+=("bench_device did not build"); tail -n 40 "$OUT/build_bench.log"; }
[ $r3 = 0 ] || failed+=("the benchmark's checkpoint was not written")

# run_or_trace SECONDS PROGRAM ARGS...: runs it; if it crashes, again under cuda-gdb for a backtrace
run_or_trace() {
  local limit=$1
  shift
  timeout "$limit" "$@"
  local rc=$?
  if [ $rc -ge 128 ] && [ $rc != 137 ] && command -v cuda-gdb > /dev/null; then
    echo "== crashed (rc $rc): again under cuda-gdb"
    timeout 200 cuda-gdb -q -batch -ex 'set pagination off' -ex run -ex bt -ex 'info threads' \
      -ex 'thread apply all bt 12' --args "$@" 2>&1 | grep -v '^\[New Thread\|^\[Thread .* exited' | tail -150
  fi
  return $rc
}

log "CUDA cases of the torch suite"
# Without a CUDA LibTorch and a device the cases are doctest::skip'ped (test_device.cpp,
# cuda_cases_skipped): counted as skipped, not run. So: the cases exist (counted with
# --no-skip), and on a GPU machine they ran (the summary's "test cases: N" counts those run)
# and none found LibTorch blind to the device ("no CUDA device found"); on a rehearsal without
# a GPU, skipped is what they should be.
[ $r1 = 0 ] && { run_or_trace 200 "$WORK/torch_tests" -tc='cuda:*' | tee "$WORK/cuda.out" || failed+=("the CUDA cases"); }
if [ $r1 = 0 ]; then
  ncuda=$("$WORK/torch_tests" -tc='cuda:*' --no-skip --count 2>&1 | sed -n 's/.*passing the current filters: *\([0-9]*\).*/\1/p')
  if [ "${ncuda:-0}" = 0 ]; then
    failed+=("no CUDA case ran (-tc='cuda:*' matches no case)")
  elif command -v nvidia-smi > /dev/null; then
    grep -q '^\[doctest\] test cases: *[1-9]' "$WORK/cuda.out" ||
      failed+=("no CUDA case ran: all $ncuda skipped, the process saw no CUDA LibTorch or device (is libtorch_cuda linked?)")
    grep -q 'no CUDA device' "$WORK/cuda.out" && failed+=("the CUDA cases found no device (is libtorch_cuda linked?)")
  else
    echo "no GPU here: the $ncuda CUDA cases were skipped"
  fi
fi

log "peers (a fresh process each)"
peers="${PEER_RATES:-}"
[ "${PEERS:-1}" = 1 ] && [ $r3 = 0 ] && for m in st pt pt_mmap; do
  line=$(timeout 200 python3 bench/device_peers.py $m "$WORK/ckpt" 2>&1 | tail -1)
  echo "$line"
  set -- $line
  [ "${1:-}" = PEER ] && peers="$peers${peers:+,}$2=$3"
done
rm -rf "$WORK/ckpt/pt"   # room for the saves

log "bench_device"
# --out on WORK's disk: the resharded checkpoint and the saves go there (its cold rows evict the
# files of both checkpoints from the page cache, and need a file system that honours that)
[ $r2 = 0 ] && [ $r3 = 0 ] && { run_or_trace "${BENCH_LIMIT:-360}" "$WORK/bench_device" --dir "$WORK/ckpt/st" \
  --out "$WORK/out" --peers "$peers" ${BENCH_ARGS:-} || failed+=("bench_device"); }
rm -rf "$WORK/ckpt" "$WORK/out"

log "the rest of the torch suite (every world a store world unless Gloo's headers were there)"
[ $r1 = 0 ] && [ "${SUITE:-1}" = 1 ] && { (cd "$WORK" && run_or_trace "${SUITE_LIMIT:-240}" "$WORK/torch_tests" -tce='cuda:*' ${SUITE_ARGS:-}) ||
  failed+=("the torch suite"); }
if [ ${#failed[@]} -gt 0 ]; then
  log "done; FAILED: $(IFS=';'; echo "${failed[*]}")"
  exit 1
fi
log "done; everything passed"
