// shardsafe/compiled.hpp - the compiled part of a separately compiled shardsafe (core/config.hpp).
//
// A program built with SHARDSAFE_SEPARATE_COMPILATION defined for every translation unit
// compiles, once, a .cpp that holds only
//
//   #include <shardsafe/compiled.hpp>
//
// (with the same flags as the rest), and links it in; the Meson build's shardsafe_compiled
// library is that unit (dependency `shardsafe-compiled`). It holds the definitions of the
// functions the headers only declare in that mode, and the explicit instantiations of the
// shared templates, for everything in the torch-free umbrella shardsafe/shardsafe.hpp. The
// remote backends have a unit of their own (shardsafe/compiled_remote.hpp); the LibTorch parts
// (shardsafe/torch.hpp) stay header-only.
#pragma once

#if !defined(SHARDSAFE_SEPARATE_COMPILATION)
#error \
    "shardsafe/compiled.hpp is the compiled part of a separately compiled shardsafe: define SHARDSAFE_SEPARATE_COMPILATION for every translation unit of the program (core/config.hpp)"
#endif
#if defined(SHARDSAFE_DEFINE)
#error "shardsafe/compiled.hpp must be the first shardsafe header of its translation unit"
#endif
#define SHARDSAFE_COMPILING_LIBRARY 1

#include "shardsafe/shardsafe.hpp"
