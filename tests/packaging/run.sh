#!/usr/bin/env bash
# Packaging test: installs shardsafe from the source tree into a temporary prefix and builds
# the programs in consumer/ against it, running each build:
#   1. pkg-config:  c++ main.cpp $(pkg-config --cflags --libs shardsafe)
#   2. CMake:       find_package(shardsafe) + target_link_libraries(... shardsafe::shardsafe)
#   3. pkg-config and CMake again after the installed tree was moved elsewhere (the .pc file
#      and the package config find the headers relative to themselves)
#   4. Meson:       shardsafe as a subproject (subprojects/shardsafe -> the source tree),
#                   dependency('shardsafe') served by the subproject's override
#   5. LibTorch:    torch_main.cpp (#include "shardsafe/torch.hpp") with pkg-config
#                   shardsafe-torch and with CMake's shardsafe::torch (find_package(shardsafe
#                   COMPONENTS torch)); skipped with a message when LibTorch is not found
#   6. README.md:   consumer/readme_app.cpp built with the one command line README.md gives for a
#                   program without a build system (its libraries per part), read from README.md
# Every build checks that the installed shardsafe/version.hpp agrees with its package's version.
# Exits non-zero on the first failure, printing the log of the step that failed.
#
#   tests/packaging/run.sh [SRCDIR]    # SRCDIR defaults to the tree holding this script
#
# Environment: KEEP=1 keeps the temporary folder; CXX picks the C++ compiler (default c++).
# A step whose tool (pkg-config, cmake) is missing is skipped with a message; exit 77 (skipped,
# to meson test) when meson itself is missing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "${1:-$here/../..}" && pwd)"
consumer="$src/tests/packaging/consumer"
cxx="${CXX:-c++}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/shardsafe-packaging-XXXXXX")"
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

fail() {
  echo "packaging: FAILED: $*" >&2
  exit 1
}
# run LOGNAME CMD...: runs CMD with its output in $tmp/LOGNAME.log, shown if it fails
run() {
  local log="$tmp/$1.log"
  shift
  if ! "$@" >"$log" 2>&1; then
    echo "packaging: command failed: $*" >&2
    tail -n 60 "$log" >&2
    exit 1
  fi
}

command -v meson >/dev/null || { echo "packaging: meson not found, skipping"; exit 77; }
have() { command -v "$1" >/dev/null || { echo "   $1 not found: skipping this step"; return 1; }; }

echo "== install $src into $tmp/prefix"
# --libdir=lib: without dpkg-architecture (a minimal Debian root) Meson picks lib64, which
# Debian's CMake does not search for packages (README, "Using it from another project")
run setup meson setup "$tmp/build" "$src" --prefix="$tmp/prefix" --libdir=lib \
  -Dtests=false -Dtools=false -Dexamples=false -Dbench=false -Dfuzz=false -Dtorch=auto
run install meson install -C "$tmp/build"
prefix="$tmp/prefix"

# every header of include/ is installed (not include/'s meson.build), with the implementation
# files (impl/*.ipp) its headers include header-only, and nothing but those, the .pc files and
# the CMake package
diff <( (cd "$src/include" && find . -type f \( -name '*.hpp' -o -name '*.ipp' \)) | sort) \
     <(cd "$prefix/include" && find . -type f | sort) >"$tmp/headers.diff" ||
  { cat "$tmp/headers.diff" >&2; fail "installed headers differ from include/"; }
grep -q '^#define SHARDSAFE_VERSION_STRING "[0-9]*\.[0-9]*\.[0-9]*"$' "$prefix/include/shardsafe/version.hpp" ||
  fail "the installed shardsafe/version.hpp has no SHARDSAFE_VERSION_STRING"
pc="$(find "$prefix" -name shardsafe.pc -print -quit)"
cfg="$(find "$prefix" -name shardsafeConfig.cmake -print -quit)"
[ -n "$pc" ] || fail "no shardsafe.pc under $prefix"
[ -n "$cfg" ] || fail "no shardsafeConfig.cmake under $prefix"
[ -f "$(dirname "$cfg")/shardsafeConfigVersion.cmake" ] || fail "no shardsafeConfigVersion.cmake next to $cfg"
echo "   $(realpath --relative-to="$prefix" "$pc"), $(realpath --relative-to="$prefix" "$cfg")"
others="$(cd "$prefix" && find . -type f ! -path './include/*' ! -name shardsafe.pc ! -name shardsafe-torch.pc \
  ! -name 'shardsafeConfig*.cmake')"
[ -z "$others" ] || fail "unexpected installed files: $others"

pkgconfig_consumer() {  # NAME PREFIX: builds and runs the consumer with the .pc under PREFIX
  local pcdir flags inc version
  pcdir="$(dirname "$(find "$2" -name shardsafe.pc -print -quit)")"
  flags="$(PKG_CONFIG_PATH="$pcdir" pkg-config --cflags --libs shardsafe)" || fail "$1: pkg-config does not find shardsafe"
  version="$(PKG_CONFIG_PATH="$pcdir" pkg-config --modversion shardsafe)"
  echo "   shardsafe $version: $flags"
  inc="$(printf '%s\n' $flags | sed -n 's/^-I//p' | head -n 1)"
  [ -n "$inc" ] && [ "$(realpath -m "$inc")" = "$(realpath -m "$2/include")" ] ||
    fail "$1: pkg-config --cflags points at '$inc', not $2/include"
  # shellcheck disable=SC2086  # the flags are words
  run "$1-build" "$cxx" "$consumer/main.cpp" $flags "-DSHARDSAFE_EXPECTED_VERSION=\"$version\"" -o "$tmp/consumer-$1"
  run "$1-run" "$tmp/consumer-$1"
  grep -q "consumer ok" "$tmp/$1-run.log" || fail "$1 consumer did not run to the end"
}

echo "== 1. pkg-config"
have_pkgconfig=0
if have pkg-config; then
  have_pkgconfig=1
  pkgconfig_consumer pkgconfig "$prefix"
fi

# The CMake builds use no build type, hence no optimisation flags, as the pkg-config builds: the
# consumers prove that the package compiles, links and runs; optimising them only cost time.
cmake_consumer() {  # NAME PREFIX
  run "$1-configure" cmake -S "$consumer" -B "$tmp/$1" -DCMAKE_PREFIX_PATH="$2" -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_BUILD_TYPE=
  grep -q "from $2/" "$tmp/$1-configure.log" || { cat "$tmp/$1-configure.log" >&2; fail "$1: shardsafe not found under $2"; }
  run "$1-build" cmake --build "$tmp/$1"
  run "$1-run" "$tmp/$1/consumer"
  grep -q "consumer ok" "$tmp/$1-run.log" || fail "$1 consumer did not run to the end"
  local inc
  inc="$(grep -o -- "-isystem [^ ]*\|-I[^ ]*" "$tmp/$1/CMakeFiles/consumer.dir/flags.make" | head -n 1 || true)"
  echo "   built with $inc"
}

echo "== 2. CMake find_package"
have_cmake=0
if have cmake; then
  have_cmake=1
  cmake_consumer cmake "$prefix"
fi

echo "== 3. pkg-config and CMake after moving the installed tree (both find it relative to themselves)"
mkdir -p "$tmp/elsewhere"
mv "$prefix" "$tmp/elsewhere/moved"
moved="$tmp/elsewhere/moved"
if grep -rqF "$prefix" "$moved"/lib*/ --include='*.cmake' --include='*.pc'; then
  fail "the installed package files name the original prefix $prefix"
fi
if [ "$have_pkgconfig" = 1 ]; then
  pkgconfig_consumer pkgconfig-moved "$moved"
fi
if [ "$have_cmake" = 1 ]; then
  cmake_consumer cmake-moved "$moved"
  grep -q -- "$moved/include" "$tmp/cmake-moved/CMakeFiles/consumer.dir/flags.make" ||
    fail "the moved package does not point into $moved/include"
fi

echo "== 4. Meson subproject"
mc="$tmp/meson-consumer"
mkdir -p "$mc/subprojects"
cp "$consumer/main.cpp" "$consumer/meson.build" "$mc/"
ln -s "$src" "$mc/subprojects/shardsafe"
run meson-setup meson setup "$mc/build" "$mc" --force-fallback-for=shardsafe
grep -q "Executing subproject shardsafe" "$tmp/meson-setup.log" || fail "meson did not use the subproject"
grep -q "Dependency shardsafe found: YES .*(overridden)" "$tmp/meson-setup.log" ||
  { tail -n 20 "$tmp/meson-setup.log" >&2; fail "dependency('shardsafe') was not served by the subproject"; }
run meson-compile meson compile -C "$mc/build"
run meson-run "$mc/build/consumer"
grep -q "consumer ok" "$tmp/meson-run.log" || fail "meson consumer did not run to the end"
# a subproject builds no tests, tools or install rules of its own
run meson-introspect meson introspect --targets "$mc/build"
if grep -q '"name": "\(core_tests\|shardsafe\)"' "$tmp/meson-introspect.log"; then
  fail "the subproject defined its own tests or tool"
fi

echo "== 5. LibTorch: shardsafe/torch.hpp with pkg-config shardsafe-torch and CMake shardsafe::torch"
torch_pc="$(find "$moved" -name shardsafe-torch.pc -print -quit)"
if [ -z "$torch_pc" ]; then
  echo "   LibTorch was not found when installing (no shardsafe-torch.pc): skipping this step"
else
  if [ "$have_pkgconfig" = 1 ]; then
    flags="$(PKG_CONFIG_PATH="$(dirname "$torch_pc")" pkg-config --cflags --libs shardsafe-torch)" ||
      fail "pkg-config does not find shardsafe-torch"
    echo "   shardsafe-torch: $flags"
    # shellcheck disable=SC2086  # the flags are words
    run torch-pkgconfig-build "$cxx" "$consumer/torch_main.cpp" $flags -o "$tmp/torch-consumer-pkgconfig"
    run torch-pkgconfig-run "$tmp/torch-consumer-pkgconfig"
    grep -q "torch consumer ok" "$tmp/torch-pkgconfig-run.log" || fail "the pkg-config torch consumer did not run to the end"
  fi
  if [ "$have_cmake" = 1 ]; then
    run torch-cmake-configure cmake -S "$consumer" -B "$tmp/torch-cmake" -DCMAKE_PREFIX_PATH="$moved" \
      -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE= -DWITH_TORCH=ON
    run torch-cmake-build cmake --build "$tmp/torch-cmake" --target torch_consumer
    run torch-cmake-run "$tmp/torch-cmake/torch_consumer"
    grep -q "torch consumer ok" "$tmp/torch-cmake-run.log" || fail "the CMake torch consumer did not run to the end"
  fi
fi

echo "== 6. README.md's command line for a program without a build system"
# the one `c++ -std=c++20 ... app.cpp ...` line of README.md ("Using it from another project"),
# with this tree for its checkout and consumer/readme_app.cpp for its program: the libraries it
# names must be all that a torch-free program links
line="$(grep -E '^ *c\+\+ -std=c\+\+20 .* app\.cpp( |$)' "$src/README.md" || true)"
[ -n "$line" ] && [ "$(printf '%s\n' "$line" | wc -l)" = 1 ] ||
  fail "README.md does not give exactly one 'c++ -std=c++20 ... app.cpp ...' line (found: '$line')"
read -ra words <<<"$line"
cmd=()
for w in "${words[@]}"; do
  case "$w" in
    c++) cmd+=("$cxx") ;;
    app.cpp) cmd+=("$consumer/readme_app.cpp") ;;
    shardsafe/include) cmd+=("$src/include") ;;
    -Ishardsafe/include) cmd+=("-I$src/include") ;;
    *) cmd+=("$w") ;;
  esac
done
echo "   ${cmd[*]}"
run readme-build "${cmd[@]}" -o "$tmp/readme-app"
run readme-run "$tmp/readme-app"
grep -q "readme app ok" "$tmp/readme-run.log" || fail "the README's program did not run to the end"

echo "packaging: ok"
