#!/usr/bin/env bash
# The main job of the README: builds the end-to-end demo and the tool, then trains a small
# model in a 2-process world (c10d/Gloo on localhost) with rotating checkpoints, kills it,
# resumes in a 3-process world, checks the resume bit for bit against an uninterrupted run,
# unshards the last checkpoint to one file and inspects it with the shardsafe tool.
#
#   scripts/demo.sh [train_demo options, e.g. --optim sgd --steps 18 --resume-world 4]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
[ -f build/build.ninja ] || meson setup build
meson compile -C build train_demo shardsafe
run=demo-run
build/examples/train_demo --dir "$run" "$@"
last=$(ls -d "$run"/checkpoints/step* | sort -V | tail -n 1)
echo
echo "\$ shardsafe verify $last"
build/tools/shardsafe verify "$last"
echo "\$ shardsafe inspect $last/model"
build/tools/shardsafe inspect "$last/model"
echo "\$ shardsafe inspect $run/export/model.safetensors"
build/tools/shardsafe inspect "$run/export/model.safetensors"
