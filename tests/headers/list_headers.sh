#!/usr/bin/env bash
# list_headers.sh INCLUDE_DIR: every header under INCLUDE_DIR/shardsafe, one a line, as the
# path an #include names (shardsafe/core/dtype.hpp), sorted. tests/headers/meson.build runs it
# when Meson configures, so a header added to include/ is compiled on its own from then on.
# Implementation files (impl/*.ipp: core/config.hpp) are not headers: each is compiled through
# its header (header-only, as here) and in a unit of separate compilation, never on its own.
set -euo pipefail
cd "$1"
find shardsafe -type f -name '*.hpp' | LC_ALL=C sort
