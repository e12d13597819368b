#!/usr/bin/env bash
# Writes the trainer goldens of tests/fixtures/peers/ with the trainers themselves as peers:
# DeepSpeed (ZeRO-1/2/3, universal checkpoints) and Megatron-LM (Megatron-Core torch_dist, legacy
# torch format), on CPU with Gloo, inside the Debian 13 root (scripts/env-debian13.sh).
#
#   tests/peers/make_goldens.sh ds DEEPSPEED_SRC [CASES]     CASES: comma list or all (default)
#   tests/peers/make_goldens.sh mcore MEGATRON_SRC [CASES]
#
# DEEPSPEED_SRC / MEGATRON_SRC: a source tree of the trainer (a git checkout or `git archive`
# output; for DeepSpeed the folders deepspeed/, accelerator/, op_builder/ and version.txt are what
# is used, for Megatron-LM megatron/). Neither is installed, built or committed: the tree is put on
# PYTHONPATH. It must lie where the root sees it: under /tmp or inside this checkout (both are
# bound into the root by env-debian13.sh). The commit used goes into each golden's meta.json
# (PEER_DS_COMMIT / PEER_MCORE_COMMIT, else `git rev-parse HEAD` in the tree when it is a checkout).
#
# The goldens were made with DeepSpeed v0.19.5 (cf44300453eb0af79ed84ed8f1cb49d57478bd76) and
# Megatron-LM core_v0.16.1 (55ac7082517c3878ae653c07c09c534b8aed49f6); see tests/peers/README.md.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
env13="$here/scripts/env-debian13.sh"
out="${GOLDENS_OUT:-$here/tests/fixtures/peers}"
kind="${1:?ds or mcore}"; src="$(cd "${2:?trainer source tree}" && pwd)"; cases="${3:-all}"
case "$src" in /tmp/*|"$here"/*) ;; *) echo "make_goldens: $src is not under /tmp or $here: the root cannot see it" >&2; exit 2;; esac
commit() { git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown; }

bash "$env13" make peers
work="$(mktemp -d /tmp/shardsafe-peers.XXXXXX)"
case "$kind" in
  ds)
    # DS_ACCELERATOR=cpu: DeepSpeed's CPU accelerator (Gloo, since oneCCL's bindings are absent);
    # cwd in the source tree: DeepSpeed reads its version from ./version.txt when not installed
    bash "$env13" run env PYTHONPATH="$src" DS_ACCELERATOR=cpu PEER_DS_COMMIT="${PEER_DS_COMMIT:-$(commit)}" \
      bash -c 'cd "$0" && exec python3 "$1" "$2" "$3"' "$src" "$here/tests/peers/ds_peer.py" "$cases" "$work"
    ;;
  mcore)
    bash "$env13" run env PYTHONPATH="$src" PEER_MCORE_COMMIT="${PEER_MCORE_COMMIT:-$(commit)}" \
      python3 "$here/tests/peers/mcore_peer.py" "$cases" "$work"
    ;;
  *) echo "make_goldens: ds or mcore" >&2; exit 2 ;;
esac
# DeepSpeed copies its own zero_to_fp32.py script into every checkpoint folder: not committed here
find "$work" -name zero_to_fp32.py -delete
# the case folders replace the committed ones; logs stay in $work
mkdir -p "$out"
for d in "$work"/*/; do
  n="$(basename "$d")"; rm -rf "${out:?}/$n"; cp -r "$d" "$out/$n"
done
du -sh "$out"/* ; echo "make_goldens: logs in $work"
