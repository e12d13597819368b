// shardsafe/core/config.hpp - header-only (the default) or separately compiled, as Asio does.
//
// Header-only: include the headers, nothing to build or link; every function is inline. This
// is what a plain checkout gives (`-Iinclude`) and what the pkg-config, CMake and Meson
// packages give by default.
//
// Separately compiled: define SHARDSAFE_SEPARATE_COMPILATION for every translation unit of the
// program (a compiler flag), and compile shardsafe/compiled.hpp in exactly one of them (the
// Meson build's shardsafe_compiled library does: the dependency `shardsafe-compiled`). The
// heavy non-template functions (the format parsers and writers, the load planner, description
// merging, the Hugging Face key mapping and plans) are then only declared in the headers and
// compiled once, in that unit, together with the templates most programs share (explicit
// instantiations: checkpoint_reader of the local backends, the saves of a single process);
// the other units neither parse their bodies into code nor emit them. A program must not mix
// the two modes across its translation units.
//
// A function compiled once reads, in its header:
//
//   #if SHARDSAFE_DEFINE
//   SHARDSAFE_DECL result f(args) { ... }
//   #else
//   SHARDSAFE_DECL result f(args);
//   #endif
//
// SHARDSAFE_DECL is `inline` header-only, and nothing when separately compiled; SHARDSAFE_DEFINE
// is 1 where the definitions are compiled (header-only: everywhere; separately: the one unit
// of shardsafe/compiled.hpp, which defines SHARDSAFE_COMPILING_LIBRARY first).
//
// The remote backends (storage/http.hpp, storage/s3.hpp: Boost.Beast, OpenSSL) are a second
// unit, shardsafe/compiled_remote.hpp, compiled once per value of SHARDSAFE_HTTP_TLS that the
// program uses (the Meson build's shardsafe_remote_compiled library: the dependency
// `shardsafe-remote-compiled`). Their functions compiled once are guarded by
// SHARDSAFE_REMOTE_DEFINE instead, 1 header-only and in that unit (which defines
// SHARDSAFE_COMPILING_REMOTE first), so that neither unit defines what the other does.
#pragma once

#if defined(SHARDSAFE_SEPARATE_COMPILATION)
#define SHARDSAFE_DECL
#if defined(SHARDSAFE_COMPILING_LIBRARY)
#define SHARDSAFE_DEFINE 1
/// An explicit instantiation declaration in the units that use a shared template; its
/// definition in the one compiled unit.
#define SHARDSAFE_EXTERN_TEMPLATE(...) template __VA_ARGS__;
#else
#define SHARDSAFE_DEFINE 0
#define SHARDSAFE_EXTERN_TEMPLATE(...) extern template __VA_ARGS__;
#endif
#if defined(SHARDSAFE_COMPILING_REMOTE)
#define SHARDSAFE_REMOTE_DEFINE 1
#else
#define SHARDSAFE_REMOTE_DEFINE 0
#endif
#else
#define SHARDSAFE_DECL inline
#define SHARDSAFE_DEFINE 1
#define SHARDSAFE_REMOTE_DEFINE 1
#define SHARDSAFE_EXTERN_TEMPLATE(...)
#endif
