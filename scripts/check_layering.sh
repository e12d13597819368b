#!/usr/bin/env bash
# The layering rule of the design: only include/shardsafe/torch/ (and the umbrella torch.hpp)
# may include LibTorch. Fails, naming each offending line, when a header under core/ shard/
# format/ storage/ detail/ checkpoint/ dist/ (or the torch-free umbrella) includes torch/,
# <ATen, <torch or <c10. And the rule of LibTorch versions: only include/shardsafe/torch/compat.hpp
# tests TORCH_VERSION_* (or SHARDSAFE_TORCH_VERSION) anywhere in the sources.
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

cd ../..
versioned=$(grep -rnE 'TORCH_VERSION' include tests examples bench tools fuzz \
  --include='*.hpp' --include='*.cpp' --include='*.h' --include='*.ipp' | grep -v '^include/shardsafe/torch/compat.hpp:' || true)
if [ -n "$versioned" ]; then
  echo "layering: LibTorch versions are told apart only in include/shardsafe/torch/compat.hpp; these lines test them elsewhere:" >&2
  echo "$versioned" >&2
  exit 1
fi
echo "layering: only torch/compat.hpp tests LibTorch's version"
