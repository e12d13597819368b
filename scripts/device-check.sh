#!/usr/bin/env bash
# scripts/device-check.sh - the GPU machine's check, one run (issue 32): builds the CUDA tests
# (tests/torch/test_device.cpp) and bench/bench_device.cpp against the LibTorch inside Python's
# torch wheel, checks that every LibTorch-facing test and example compiles against it, runs the
# CUDA tests, writes a ~GIB GiB BF16 checkpoint, and runs the Python peers and bench_device on
# it. Everything it prints is also written under OUT (default /tmp/device-check).
#
#   bash scripts/device-check.sh [GIB]        (GIB: the benchmark model's size, default 10)
#
# PEERS=0 skips the Python peers (PEER_RATES=name=GB/s,... passes rates measured before), and
# SYNTAX=0 the compile-only checks. A program that crashes is run again under cuda-gdb for a
# backtrace.
#
# Needs python3 with torch (CUDA) and safetensors, a C++20 g++, and the torch-free
# dependencies (simdjson, xxHash, RE2, doctest; OpenSSL's headers for the syntax checks) as
# Debian 12 packages in DEBS (default .devdeps), unpacked here into a folder of their own:
#   mkdir -p .devdeps && (cd .devdeps && apt-get download libsimdjson-dev libsimdjson14 \
#     libxxhash-dev libxxhash0 libre2-dev libre2-9 doctest-dev libssl-dev)
# The GPU machine builds without meson: its Python wheel's LibTorch has no pkg-config or
# system paths, and compiling the few units this check needs directly is quicker.
set -u
cd "$(dirname "$0")/.."
GIB=${1:-10}
OUT=${OUT:-/tmp/device-check}
DEBS=${DEBS:-.devdeps}
WORK=${WORK:-$PWD/.device-work}   # on disk: the checkpoint and the saves take ~3 x GIB
mkdir -p "$OUT" "$WORK"
log() { echo "== $(date +%T) $*"; }
exec > >(tee "$OUT/device-check.log") 2>&1

log "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 -c 'import torch, safetensors; print("torch", torch.__version__, "cuda", torch.version.cuda, "safetensors", safetensors.__version__, "device", torch.cuda.get_device_name(0))'
nproc; free -g | head -2; ${CXX:-g++} --version | head -1
python3 -c 'import torch; print("cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI)'

T=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
ABI=$(python3 -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
DEPS="$WORK/deps"
mkdir -p "$DEPS"
for f in "$DEBS"/*.deb; do dpkg -x "$f" "$DEPS"; done
LIBDIR="$DEPS/usr/lib/x86_64-linux-gnu"
CXX=${CXX:-g++}
FLAGS=(-std=c++20 -O2 -g -DNDEBUG -D_GLIBCXX_USE_CXX11_ABI="$ABI" -Iinclude -I"$DEPS/usr/include"
       -isystem "$T/include" -isystem "$T/include/torch/csrc/api/include" -Wno-deprecated-declarations)
[ -d "$T/include/gloo" ] && FLAGS+=(-DUSE_C10D_GLOO=1)
# libstdc++ first: the wheel's libtorch.so exports std::filesystem functions of its own, and
# a program that binds to them crashes (std::filesystem::remove_all jumps to address 0)
LIBS=(-Wl,--no-as-needed -lstdc++ -Wl,--as-needed -L"$LIBDIR" -Wl,-rpath,"$LIBDIR" -lsimdjson -lxxhash -lre2
      -L"$T/lib" -Wl,-rpath,"$T/lib" -Wl,--no-as-needed -ltorch_cuda -lc10_cuda -Wl,--as-needed -ltorch -ltorch_cpu -lc10 -pthread)

log "build (test_device, bench_device) and the checkpoint for the bench, at once"
t0=$(date +%s)
$CXX "${FLAGS[@]}" -Itests tests/support/main.cpp tests/torch/test_device.cpp -o "$WORK/test_device" "${LIBS[@]}" \
  > "$OUT/build_test.log" 2>&1 &
p1=$!
$CXX "${FLAGS[@]}" -Ibench bench/bench_device.cpp -o "$WORK/bench_device" "${LIBS[@]}" > "$OUT/build_bench.log" 2>&1 &
p2=$!
rm -rf "$WORK/ckpt"
python3 bench/device_peers.py write "$WORK/ckpt" "$GIB" "${PEERS:-1}" &
p3=$!
# every LibTorch-facing test unit, example and the umbrella header, compiled (not linked)
# against this LibTorch, 6 at a time beside the builds
echo '#include "shardsafe/torch.hpp"' > "$WORK/umbrella_torch.cpp"
[ "${SYNTAX:-1}" = 1 ] && ls tests/torch/test_*.cpp examples/*.cpp "$WORK/umbrella_torch.cpp" | xargs -P 6 -I{} sh -c \
  "$CXX ${FLAGS[*]} -Itests -Iexamples -DSHARDSAFE_TOOL='\"\"' -DSHARDSAFE_SOURCE_DIR='\"\"' -fsyntax-only {} > '$WORK/syntax_'\$(basename {}).log 2>&1 && echo 'compiles: {}' || echo 'FAILS: {}'"
for f in "$WORK"/syntax_*.log; do [ -s "$f" ] && { echo "== $f"; head -60 "$f"; }; done > "$OUT/syntax.log"
wait $p1; r1=$?
wait $p2; r2=$?
wait $p3; r3=$?
log "built in $(( $(date +%s) - t0 )) s: test_device rc=$r1, bench_device rc=$r2; checkpoint rc=$r3"
tail -n 20 "$OUT/build_test.log" "$OUT/build_bench.log"

# run_or_trace SECONDS PROGRAM ARGS...: runs it; if it crashes, again under cuda-gdb for a backtrace
run_or_trace() {
  local limit=$1
  shift
  timeout "$limit" "$@"
  local rc=$?
  if [ $rc -ge 128 ] && command -v cuda-gdb > /dev/null; then
    echo "== crashed (rc $rc): again under cuda-gdb"
    timeout 300 cuda-gdb -q -batch -ex 'set pagination off' -ex run -ex bt -ex 'info threads' \
      -ex 'thread apply all bt 12' --args "$@" 2>&1 | grep -v '^\[New Thread\|^\[Thread .* exited' | tail -150
  fi
  return $rc
}

log "CUDA tests"
[ $r1 = 0 ] && run_or_trace 300 "$WORK/test_device"

log "peers (a fresh process each)"
peers="${PEER_RATES:-}"
[ "${PEERS:-1}" = 1 ] && for m in st st pt pt_mmap; do
  line=$(timeout 300 python3 bench/device_peers.py $m "$WORK/ckpt" 2>&1 | tail -1)
  echo "$line"
  set -- $line
  [ "${1:-}" = PEER ] && peers="$peers${peers:+,}$2=$3"
done

rm -rf "$WORK/ckpt/pt"   # room for the saves

log "bench_device"
[ $r2 = 0 ] && [ $r3 = 0 ] && run_or_trace 400 "$WORK/bench_device" --dir "$WORK/ckpt/st" --out "$WORK/out" --peers "$peers"
log "done"
