#!/usr/bin/env bash
# Checkpoints across LibTorch versions (issue 27): a model + AdamW checkpoint saved by a 2-process
# world under one LibTorch resumes in a 3-process world under the other, both ways. The worker is
# torch_tests' "cross_version" scenario (tests/torch/test_cross_version.cpp), started here as
# torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one build per side; the Debian 13
# side runs in the root of scripts/env-debian13.sh.
#
#   tests/torch/cross_version.sh DEBIAN12_TORCH_TESTS DEBIAN13_TORCH_TESTS
#
# Passes when, each way, the state the loading world holds after loading (parameters and AdamW
# state gathered from every rank as raw bytes, step counts, hyper-parameters) is byte for byte the
# state the saving world dumped before saving, and two more steps on each side agree (step counts
# and hyper-parameters equal, floats within 1e-6: the two LibTorch builds round differently in
# the last bit; within one LibTorch, torch_tests checks the steps bit for bit).
set -euo pipefail
cd "$(dirname "$0")/../.."
old="$1" new="$2"
[ -x "$old" ] || { echo "cross_version: $old is not built" >&2; exit 1; }
[ -x "$new" ] || { echo "cross_version: $new is not built" >&2; exit 1; }
tmp="$(mktemp -d /tmp/shardsafe-cross-XXXXXX)"
trap 'rm -rf "$tmp"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# world SIDE N MODE DIR: N ranks of the scenario under SIDE (old: this machine; new: the root);
# fails naming the rank that failed, with its stderr. At most 300 s.
world() {
  local side="$1" n="$2" mode="$3" dir="$4" port
  port="$(free_port)"
  local wargs="$mode"$'\x1f'"$dir"$'\x1f'
  local script='
    exe="$1" n="$2" port="$3" mode="$4" dir="$5" wargs="$6"; pids=()
    for ((r = 0; r < n; r++)); do
      RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
        SHARDSAFE_WORKER=cross_version SHARDSAFE_WORKER_ARGS="$wargs" \
        timeout 300 "$exe" 2>"$dir/$mode.rank$r.err" & pids+=($!)
    done
    rc=0
    for ((r = 0; r < n; r++)); do
      if ! wait "${pids[$r]}"; then echo "rank $r failed:"; cat "$dir/$mode.rank$r.err"; rc=1; fi
    done
    exit $rc'
  if [ "$side" = old ]; then
    bash -c "$script" world "$old" "$n" "$port" "$mode" "$dir" "$wargs"
  else
    scripts/env-debian13.sh run bash -c "$script" world "$new" "$n" "$port" "$mode" "$dir" "$wargs"
  fi
}

check() {  # FROM TO: FROM saves with 2 ranks, TO loads with 3
  local from="$1" to="$2" dir="$tmp/$1-to-$2"
  mkdir -p "$dir"
  world "$from" 2 save "$dir"
  world "$to" 3 load "$dir"
  local v_save v_load
  v_save="$(cat "$dir/save.version")" v_load="$(cat "$dir/load.version")"
  [ "$v_save" != "$v_load" ] || { echo "cross_version: both sides ran LibTorch $v_save" >&2; exit 1; }
  cmp -s "$dir/saved.dump" "$dir/loaded.dump" ||
    { echo "cross_version: LibTorch $v_save -> $v_load: the loaded state differs from the saved one" >&2; exit 1; }
  ! cmp -s "$dir/saved.dump" "$dir/saved_after.dump" || { echo "cross_version: the steps changed nothing" >&2; exit 1; }
  # The steps after the resume run on the other LibTorch, whose arithmetic rounds some results
  # differently in the last bit (measured: about half the elements 1 ulp apart after two steps):
  # step counts and hyper-parameters must be equal, every float within 1e-6 of the largest
  # magnitude (a wrong load, a lost step count or the loading side's learning rate is far outside).
  local after
  after="$(python3 - "$dir/saved_after.dump" "$dir/loaded_after.dump" <<'PY'
import array, sys
a, b = (open(p, "rb").read().split(b"--\n", 1) for p in sys.argv[1:3])
if a[0] != b[0]:
    sys.exit("step counts or hyper-parameters differ after the steps")
x, y = array.array("f", a[1]), array.array("f", b[1])
if len(x) != len(y):
    sys.exit("the states after the steps have different sizes")
scale = max(1.0, max((abs(u) for u in x), default=0.0))
worst, differ = 0.0, 0
for u, v in zip(x, y):
    if u != v:
        differ += 1
        worst = max(worst, abs(u - v))
if worst > 1e-6 * scale:
    sys.exit("after the steps an element differs by %.3g (limit %.3g)" % (worst, 1e-6 * scale))
print("%d of %d floats bit-equal after two more steps, the rest within %.2g" % (len(x) - differ, len(x), worst))
PY
)" || { echo "cross_version: LibTorch $v_save -> $v_load: $after" >&2; exit 1; }
  echo "cross_version: LibTorch $v_save (2 ranks) -> LibTorch $v_load (3 ranks): the loaded state bit for bit the saved one; $after"
}

check new old
check old new
