#!/usr/bin/env bash
# The layering rules of the design, each failing with the offending lines named:
#  1. only include/shardsafe/torch/ (and the umbrella torch.hpp) may include LibTorch: no header
#     under core/ shard/ format/ storage/ detail/ checkpoint/ dist/ (or the torch-free umbrella)
#     includes torch/, <ATen, <torch or <c10;
#  2. the folder order: a header includes its own folder and folders below it, never one beside
#     or above it. Lowest first: core; detail; shard, storage and dist (side by side: none
#     includes another); format; checkpoint; torch;
#  3. LibTorch versions: only include/shardsafe/torch/compat.hpp tests TORCH_VERSION_* (or
#     SHARDSAFE_TORCH_VERSION) anywhere in the sources;
#  4. checkpoint/loader.hpp stays within 250 lines (issue 29).
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

declare -A rank=([core]=0 [detail]=1 [shard]=2 [storage]=2 [dist]=2 [format]=3 [checkpoint]=4 [torch]=5)
order_bad=""
checked=0
while IFS= read -r f; do
  from="${f%%/*}"
  [ -n "${rank[$from]+x}" ] || continue
  checked=$((checked + 1))
  while IFS=: read -r line inc; do
    to="$(sed -E 's/.*shardsafe\/([a-z_]+)\/.*/\1/' <<<"$inc")"
    [ "$to" != "$from" ] && [ -n "${rank[$to]+x}" ] || continue
    if [ "${rank[$to]}" -ge "${rank[$from]}" ]; then
      order_bad+="$f:$line: ${inc#*#} ($to/ is not below $from/)"$'\n'
    fi
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]shardsafe/[a-z_]+/' "$f" || true)
done < <(find "${!rank[@]}" -name '*.hpp' 2>/dev/null | sort)
if [ -n "$order_bad" ]; then
  echo "layering: these headers include a folder beside or above their own (order: core < detail < shard, storage, dist < format < checkpoint < torch):" >&2
  printf '%s' "$order_bad" >&2
  exit 1
fi
echo "layering: $checked headers include only their own folder and those below it"

cd ../..
versioned=$(grep -rnE 'TORCH_VERSION' include tests examples bench tools fuzz \
  --include='*.hpp' --include='*.cpp' --include='*.h' --include='*.ipp' | grep -v '^include/shardsafe/torch/compat.hpp:' || true)
if [ -n "$versioned" ]; then
  echo "layering: LibTorch versions are told apart only in include/shardsafe/torch/compat.hpp; these lines test them elsewhere:" >&2
  echo "$versioned" >&2
  exit 1
fi
echo "layering: only torch/compat.hpp tests LibTorch's version"

# the loader stays a loader (issue 29): reading, planning and executing live in reader.hpp,
# load_plan.hpp and read_executor.hpp; loader.hpp only puts them together
loader_lines=$(wc -l < include/shardsafe/checkpoint/loader.hpp)
if [ "$loader_lines" -gt 250 ]; then
  echo "layering: include/shardsafe/checkpoint/loader.hpp has $loader_lines lines, over 250: move what is not the loader's own into reader.hpp, load_plan.hpp or read_executor.hpp" >&2
  exit 1
fi
echo "layering: checkpoint/loader.hpp has $loader_lines lines (at most 250)"
