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
#  4. checkpoint/checkpoint_reader.hpp (the loader) stays within 250 lines (issue 29);
#  5. separate compilation as Asio's (core/config.hpp): a function compiled once is declared once
#     in its header (SHARDSAFE_DECL, no body) and defined in the header's AREA/impl/NAME.ipp, which
#     the header includes at its end under SHARDSAFE_HEADER_ONLY and exactly one unit of separate
#     compilation (shardsafe/compiled.hpp or shardsafe/compiled_remote.hpp) includes; no header is
#     guarded by the old DEFINE macros.
# Implementation files (impl/*.ipp) count as their header's folder in every rule: the rules hold
# for the header-only mode (the header includes its .ipp) and the separately compiled one alike.
set -euo pipefail
cd "$(dirname "$0")/../include/shardsafe"
dirs=(core shard format storage detail checkpoint dist impl)
files=()
for d in "${dirs[@]}"; do [ -d "$d" ] && while IFS= read -r f; do files+=("$f"); done < <(find "$d" \( -name '*.hpp' -o -name '*.ipp' \) | sort); done
[ -f shardsafe.hpp ] && files+=(shardsafe.hpp)
bad=$(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]((ATen|torch|c10)[/.]|shardsafe/torch[/.])' "${files[@]}" || true)
if [ -n "$bad" ]; then
  echo "layering: these torch-free headers include LibTorch or shardsafe/torch/:" >&2
  echo "$bad" >&2
  exit 1
fi
echo "layering: ${#files[@]} torch-free headers and implementation files include no LibTorch"

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
done < <(find "${!rank[@]}" \( -name '*.hpp' -o -name '*.ipp' \) 2>/dev/null | sort)
if [ -n "$order_bad" ]; then
  echo "layering: these headers include a folder beside or above their own (order: core < detail < shard, storage, dist < format < checkpoint < torch):" >&2
  printf '%s' "$order_bad" >&2
  exit 1
fi
echo "layering: $checked headers and implementation files (impl/*.ipp: their header's folder) include only their own folder and those below it"

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
# load_plan.hpp and read_executor.hpp; checkpoint_reader.hpp only puts them together
loader_lines=$(wc -l < include/shardsafe/checkpoint/checkpoint_reader.hpp)
if [ "$loader_lines" -gt 250 ]; then
  echo "layering: include/shardsafe/checkpoint/checkpoint_reader.hpp has $loader_lines lines, over 250: move what is not the loader's own into reader.hpp, load_plan.hpp or read_executor.hpp" >&2
  exit 1
fi
echo "layering: checkpoint/checkpoint_reader.hpp has $loader_lines lines (at most 250)"

# no include cycles, counting includes anywhere in a file (an include at the bottom of a header
# closes a cycle as surely as one at the top): issue 52. A header and its implementation file
# (AREA/impl/NAME.ipp of AREA/NAME.hpp) are one node: what either includes, the pair includes
# (header-only, the header includes the .ipp, which includes the header back)
python3 - <<'PY'
import os, re, sys
root = "include"
graph = {}
def node(p):
    m = re.fullmatch(r'(.*/)?impl/([^/]+)\.ipp', p)
    return f"{m.group(1) or ''}{m.group(2)}.hpp" if m and os.path.exists(os.path.join(root, f"{m.group(1) or ''}{m.group(2)}.hpp")) else p
for d, _, fs in os.walk(root):
    for f in fs:
        if f.endswith((".hpp", ".ipp")):
            p = os.path.relpath(os.path.join(d, f), root)
            with open(os.path.join(d, f), encoding="utf-8") as fh:
                incs = [node(m.group(1)) for m in re.finditer(r'^\s*#\s*include\s*"(shardsafe/[^"]+)"', fh.read(), re.M)]
            graph.setdefault(node(p), []).extend(i for i in incs if i != node(p))
state, stack, cycles = {}, [], []
def visit(n):
    state[n] = 1
    stack.append(n)
    for m in graph.get(n, []):
        if m not in graph:
            continue
        if state.get(m) == 1:
            cycles.append(stack[stack.index(m):] + [m])
        elif m not in state:
            visit(m)
    stack.pop()
    state[n] = 2
sys.setrecursionlimit(10000)
for n in sorted(graph):
    if n not in state:
        visit(n)
if cycles:
    print("layering: include cycles (each header on the path includes the next):", file=sys.stderr)
    for c in cycles:
        print("  " + " -> ".join(c), file=sys.stderr)
    sys.exit(1)
print(f"layering: {len(graph)} headers (each with its impl/*.ipp), no include cycle")
PY

# the layouts are the only place that knows a format (issue 52): outside include/shardsafe/checkpoint/layouts/,
# nothing in include/ or tools/ (every file of the tool: its commands/ too) compares a layout's identity
# (checkpoint_format or save_format values, a layout's info or its address, a layout's id, an enum value
# named after a layout such as the tool's input kinds); code asks a layout's traits or calls its hooks.
# (source.hpp and reader.hpp keep the deprecated checkpoint_format and format() for one release.)
layout_names='(hf|dcp|dcp_sharded_hf|torch_save|safetensors|shardsafe)'
layout_tests=$(grep -rnE 'checkpoint_format::|[a-z_]+_layout::info *[!=]=|[!=]= *&?[a-z_]+_layout::info|&[a-z_]+_layout::info *[!=]=|[!=]= *save_format::|save_format::[a-z_]+ *[!=]=|(\.|->)id *[!=]=|[!=]= *[A-Za-z_.()>-]*(\.|->)id\b|[!=]= *[a-z_]+::'"$layout_names"'\b|\b[a-z_]+::'"$layout_names"' *[!=]=' include tools \
  --include='*.hpp' --include='*.cpp' --include='*.ipp' |
  grep -vE '^include/shardsafe/checkpoint/layouts/|^include/shardsafe/checkpoint/source\.hpp:|^include/shardsafe/checkpoint/reader\.hpp:' || true)
if [ -n "$layout_tests" ]; then
  echo "layering: these lines test which layout a checkpoint has outside checkpoint/layouts/ (ask its traits or hooks):" >&2
  echo "$layout_tests" >&2
  exit 1
fi
echo "layering: no layout identity tested outside checkpoint/layouts/"

# headers and implementation files stay within 450 lines (DESIGN.md: split by job). The ones still
# over it are listed here, each to be split; the list may only shrink, and no other may pass 450.
over_allowed=" "
over=""
while IFS= read -r f; do
  n=$(wc -l < "include/shardsafe/$f")
  if [ "$n" -gt 450 ] && [[ "$over_allowed" != *" $f "* ]]; then over+="  $f: $n lines"$'\n'; fi
done < <(cd include/shardsafe && find . \( -name '*.hpp' -o -name '*.ipp' \) | sed 's|^\./||' | sort)
if [ -n "$over" ]; then
  echo "layering: these headers or implementation files have over 450 lines (split them by job):" >&2
  printf '%s' "$over" >&2
  exit 1
fi
echo "layering: every header and implementation file within 450 lines but the $(wc -w <<<"$over_allowed") still to split"

# separate compilation as Asio's (rule 5 above; core/config.hpp)
python3 scripts/check_separate_compilation.py include

# the tool too (issue 52): main() and its command line in tools/shardsafe.cpp, a header per command
# under tools/commands/, what they share in tools/*.hpp; each file within 450 lines
tool_over=""
tool_files=0
while IFS= read -r f; do
  tool_files=$((tool_files + 1))
  n=$(wc -l < "$f")
  [ "$n" -le 450 ] || tool_over+="  $f: $n lines"$'\n'
done < <(find tools -name '*.hpp' -o -name '*.cpp' | sort)
if [ -n "$tool_over" ]; then
  echo "layering: these files of the tool have over 450 lines (split them by job: a command a header under tools/commands/):" >&2
  printf '%s' "$tool_over" >&2
  exit 1
fi
echo "layering: the tool's $tool_files files within 450 lines"

# the README's Layout section names every folder and header under include/shardsafe (issue 52)
python3 scripts/check_readme_layout.py .

# the code follows .clang-format (clang-format 19, which scripts/deps.sh installs: another
# version lays some lines out differently). Reformat with:
#   clang-format-19 -i $(git ls-files '*.hpp' '*.cpp' '*.h' '*.ipp' | grep -v '^subprojects/')
if ! command -v clang-format-19 >/dev/null; then
  echo "layering: clang-format-19 is missing (scripts/deps.sh installs it)" >&2
  exit 1
fi
mapfile -t sources < <(git ls-files '*.hpp' '*.cpp' '*.h' '*.ipp' | grep -v '^subprojects/'
                       git ls-files --others --exclude-standard '*.hpp' '*.cpp' '*.h' '*.ipp' | grep -v '^subprojects/')
if ! clang-format-19 --dry-run --Werror "${sources[@]}" 2>/tmp/clang-format.$$.log; then
  head -40 /tmp/clang-format.$$.log >&2
  rm -f /tmp/clang-format.$$.log
  echo "layering: these sources do not follow .clang-format (run clang-format-19 -i on them)" >&2
  exit 1
fi
rm -f /tmp/clang-format.$$.log
echo "layering: ${#sources[@]} sources follow .clang-format"
