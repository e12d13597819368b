// fuzz/fuzz_check.hpp - the invariant check every fuzz target uses: a broken invariant traps,
// so libFuzzer records the input as a finding (an exception would be one too, but a trap
// cannot be caught by the code under test).
#pragma once

#define FUZZ_CHECK(cond)           \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)
