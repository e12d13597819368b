#!/usr/bin/env bash
# The main job of the README: builds the end-to-end demo and the tool, then lives a model's
# whole life: writes a small "pretrained" model as a Hugging Face folder (BF16, indexed),
# imports it into a 2-process world (c10d/Gloo on localhost) with every rank reading only its
# slice, trains with rotating checkpoints, kills it, resumes in a 3-process world, checks the
# resume bit for bit against an uninterrupted run, and exports the last checkpoint to a Hugging
# Face folder that the shardsafe tool verifies and whose values match the trained parameters.
#
#   scripts/demo.sh [train_demo options, e.g. --optim sgd --steps 18 --resume-world 4]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh demo
# a build of its own, of the two programs the demo runs: the tool without the remote backends
# (Boost.Beast doubles its compile time; the demo reads local folders), no tests or benchmarks;
# header-only (two units on two cores: a separately compiled library would be a third)
b=build-demo
[ -f $b/build.ninja ] || meson setup $b -Dremote=disabled -Dtests=false -Dbench=false -Dfuzz=false \
  -Dseparate_compilation=false >/dev/null
meson compile -C $b train_demo shardsafe
run=demo-run
$b/examples/train_demo --dir "$run" "$@"
last=$(ls -d "$run"/checkpoints/step* | sort -V | tail -n 1)
echo
echo "\$ shardsafe verify $last"
$b/tools/shardsafe verify "$last"
echo "\$ shardsafe inspect $last/model"
$b/tools/shardsafe inspect "$last/model"
echo "\$ shardsafe verify $run/hf-export"
$b/tools/shardsafe verify "$run/hf-export"
echo "\$ shardsafe inspect $run/hf-export"
$b/tools/shardsafe inspect "$run/hf-export"
echo "\$ shardsafe to-hf $last $run/hf-export-bf16 --dtype bf16 --max-shard-size 2MB"
rm -rf "$run/hf-export-bf16"
$b/tools/shardsafe to-hf "$last" "$run/hf-export-bf16" --dtype bf16 --max-shard-size 2MB
