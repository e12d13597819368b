#!/usr/bin/env bash
# The layering rule of the design: only include/shardsafe/torch/ (and the umbrella torch.hpp)
# may include LibTorch. Fails, naming each offending line, when a header under core/ shard/
# format/ storage/ detail/ checkpoint/ dist/ (or the torch-free umbrella) includes torch/,
# <ATen, <torch or <c10.
set -euo pipefail
cd "$(dirname "$0")/../include/shardsafe"
dirs=(core shard format storage detail checkpoint dist)
files=()
for d in "${dirs[@]}"; do [ -d "$d" ] && while IFS= read -r f; do files+=("$f"); done < <(find "$d" -name '*.hpp' | sort); done
[ -f shardsafe.hpp ] && files+=(shardsafe.hpp)
bad=$(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]((ATen|torch|c10)[/.]|shardsafe/torch[/.])' "${files[@]}" || true)
if [ -n "$bad" ]; then
  echo "layering: these torch-free headers include LibTorch or shardsafe/torch/:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "layering: ${#files[@]} torch-free headers include no LibTorch"
