#!/usr/bin/env bash
# Builds the libFuzzer targets with clang in a separate build directory and runs each one for a
# bounded time. Exits non-zero if a target does not build or any run finds a crash, a sanitizer
# report, an escaped exception, a broken invariant, a timeout or an out-of-memory.
#
#   fuzz/run.sh                  # 60 s per target
#   FUZZ_SECONDS=600 fuzz/run.sh # longer
#   FUZZ_BUILD_DIR=build-fuzz2 FUZZ_JOBS=2 fuzz/run.sh fuzz_metadata   # one target, two workers
#
# Environment: FUZZ_SECONDS (default 60), FUZZ_BUILD_DIR (default build-fuzz, relative to the
# repository root), CXX (default clang++), FUZZ_JOBS (parallel workers per target, default 1),
# FUZZ_PARALLEL (targets run at once, default the cores over FUZZ_JOBS; each target's report
# is printed in order once all have run).
# Findings are written to FUZZ_BUILD_DIR/findings/TARGET/; the growing corpus to
# FUZZ_BUILD_DIR/corpus/TARGET/ (the seeds in fuzz/corpus/ are never modified).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
seconds="${FUZZ_SECONDS:-60}"
build="${FUZZ_BUILD_DIR:-build-fuzz}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
jobs="${FUZZ_JOBS:-1}"
export CXX="${CXX:-clang++}"

targets=("$@")
[ ${#targets[@]} -gt 0 ] ||
  targets=(fuzz_safetensors fuzz_metadata fuzz_hf_index fuzz_pickle fuzz_dcp_metadata fuzz_torch_zip fuzz_remote
           fuzz_torch_legacy fuzz_sidecars fuzz_dcp_write fuzz_deepspeed fuzz_quant fuzz_partial)

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" "$root" -Dfuzz=true -Dtests=false -Dtools=false -Dexamples=false -Dbench=false \
    -Dtorch=disabled -Doptimization=1 -Ddebug=false -Db_ndebug=false
fi
meson compile -C "$build" "${targets[@]/#/fuzz/}"

# max_len per target: a safetensors header plus a little data; JSON documents a bit longer
max_len_of() {
  case "$1" in
    fuzz_safetensors) echo 4096 ;;
    fuzz_metadata) echo 8192 ;;
    fuzz_hf_index) echo 4096 ;;
    fuzz_pickle) echo 4096 ;;
    fuzz_dcp_metadata) echo 8192 ;;
    fuzz_torch_zip) echo 4096 ;;
    fuzz_torch_legacy) echo 4096 ;;
    fuzz_sidecars) echo 2048 ;;
    fuzz_dcp_write) echo 1024 ;;
    fuzz_deepspeed) echo 131072 ;;  # Megatron legacy files: up to 116 KB (the run's args)
    fuzz_quant) echo 65536 ;;       # the FP8 golden's model.safetensors: 42 KB
    fuzz_partial) echo 8192 ;;      # a partial of 16 ranks: about 1 KB
    *) echo 4096 ;;
  esac
}
dict_of() {
  case "$1" in
    fuzz_safetensors | fuzz_quant) echo "$here/safetensors.dict" ;;
    fuzz_pickle | fuzz_dcp_metadata | fuzz_torch_zip | fuzz_torch_legacy | fuzz_deepspeed) echo "$here/pickle.dict" ;;
    fuzz_remote) echo "$here/remote.dict" ;;
    fuzz_dcp_write | fuzz_partial) ;;  # binary input (FuzzedDataProvider, messages): no tokens to splice
    *) echo "$here/json.dict" ;;
  esac
}

# one target's run, its exit status in $build/$t.rc (the report comes after, in order)
run_one() {
  local t="$1" name="${1#fuzz_}" rc
  local corpus="$build/corpus/$t" findings="$build/findings/$t"
  mkdir -p "$corpus" "$findings"
  local args=(-max_total_time="$seconds" -max_len="$(max_len_of "$t")" -timeout=10 -rss_limit_mb=2048
        -malloc_limit_mb=1024 -artifact_prefix="$findings/" -print_final_stats=1)
  local dict; dict="$(dict_of "$t")"
  if [ -n "$dict" ]; then args+=(-dict="$dict"); fi
  if [ "$jobs" -gt 1 ]; then args+=(-fork="$jobs" -ignore_crashes=0); fi
  set +e
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}" \
  UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
    "$build/fuzz/$t" "${args[@]}" "$corpus" "$here/corpus/$name" >"$build/$t.log" 2>&1
  rc=$?
  set -e
  echo "$rc" >"$build/$t.rc"
}

# the targets run side by side, as many at once as there are cores over FUZZ_JOBS (each is
# one process, or FUZZ_JOBS workers): the bounded time is wall-clock, so this divides it
parallel="${FUZZ_PARALLEL:-$(( $(nproc) / jobs ))}"
[ "$parallel" -ge 1 ] || parallel=1
for t in "${targets[@]}"; do
  echo "== $t: ${seconds} s, max_len $(max_len_of "$t")"
  rm -f "$build/$t.rc"
  run_one "$t" &
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
done
wait

status=0
for t in "${targets[@]}"; do
  log="$build/$t.log"
  findings="$build/findings/$t"
  rc="$(cat "$build/$t.rc" 2>/dev/null || echo 1)"
  echo "== $t"
  grep -E "^(stat::|Done |#[0-9]+ +DONE)" "$log" | tail -n 12 || true
  if [ "$rc" -ne 0 ] || ls "$findings" | grep -q .; then
    echo "!! $t failed (exit $rc); see $log and $findings/"
    tail -n 40 "$log"
    status=1
  else
    echo "ok $t"
  fi
done
exit $status
