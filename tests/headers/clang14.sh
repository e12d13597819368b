#!/usr/bin/env bash
# tests/headers/clang14.sh [CXX] - the README's "clang 14/15 for the core" (Supported
# toolchains), checked with the oldest: every torch-free header (list_headers.sh: the core and
# the remote backends) in one translation unit, and the units of separate compilation
# (shardsafe/compiled.hpp, shardsafe/compiled_remote.hpp), whose explicit instantiations check
# the templates' bodies too; syntax only (-fsyntax-only), the three at once. Each header on its
# own is the headers suite's job (GCC 14); this is about the language clang 14 accepts (it
# cannot capture structured bindings in lambdas, for one). scripts/test.sh's clang leg runs it.
# Needs Boost and OpenSSL's headers (the remote backends). CXX defaults to clang++-14.
set -euo pipefail
cd "$(dirname "$0")/../.."
cxx="${1:-clang++-14}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/shardsafe-clang14-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

for h in $(bash tests/headers/list_headers.sh include); do
  case "$h" in
    shardsafe/torch/* | shardsafe/torch.hpp | shardsafe/compiled.hpp | shardsafe/compiled_remote.hpp) ;;
    *) echo "#include \"$h\"" ;;
  esac
done >"$tmp/headers.cpp"
echo '#include "shardsafe/compiled.hpp"' >"$tmp/compiled.cpp"
echo '#include "shardsafe/compiled_remote.hpp"' >"$tmp/compiled_remote.cpp"

flags=(-std=c++20 -fsyntax-only -Iinclude -DSHARDSAFE_HTTP_TLS=1)
"$cxx" "${flags[@]}" "$tmp/headers.cpp" >"$tmp/headers.log" 2>&1 &
p1=$!
"$cxx" "${flags[@]}" -DSHARDSAFE_SEPARATE_COMPILATION "$tmp/compiled.cpp" >"$tmp/compiled.log" 2>&1 &
p2=$!
"$cxx" "${flags[@]}" -DSHARDSAFE_SEPARATE_COMPILATION "$tmp/compiled_remote.cpp" >"$tmp/compiled_remote.log" 2>&1 &
p3=$!
failed=0
for unit in headers:$p1 compiled:$p2 compiled_remote:$p3; do
  if wait "${unit#*:}"; then
    echo "clang14: ${unit%%:*} compiles with $cxx"
  else
    echo "clang14: FAILED: ${unit%%:*} with $cxx:" >&2
    head -n 40 "$tmp/${unit%%:*}.log" >&2
    failed=1
  fi
done
exit $failed
