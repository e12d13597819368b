// shardsafe/core/config.hpp - header-only (the default) or separately compiled, as Asio does.
//
// Header-only: include the headers, nothing to build or link; every function is inline. This
// is what a plain checkout gives (`-Iinclude`) and what the pkg-config, CMake and Meson
// packages give by default. SHARDSAFE_HEADER_ONLY is then defined.
//
// Separately compiled: define SHARDSAFE_SEPARATE_COMPILATION for every translation unit of the
// program (a compiler flag), and compile shardsafe/compiled.hpp in exactly one of them (the
// Meson build's shardsafe_compiled library does: the dependency `shardsafe-compiled`). The
// heavy non-template functions (the format parsers and writers, the load planner, description
// merging, the Hugging Face key mapping and plans) are then only declared in the headers and
// compiled once, in that unit, together with the templates most programs share (explicit
// instantiations: checkpoint_reader of the local backends, the saves of a single process);
// the other units neither parse their bodies nor emit them. A program must not mix the two
// modes across its translation units.
//
// A function compiled once is declared once, in its header, with its doc comment:
//
//   SHARDSAFE_DECL result f(args);
//
// and defined in the implementation file of that header, AREA/impl/NAME.ipp beside AREA/NAME.hpp:
//
//   SHARDSAFE_DECL result f(args) { ... }
//
// The header includes its .ipp at its very end, only header-only:
//
//   #if defined(SHARDSAFE_HEADER_ONLY)
//   #include "shardsafe/AREA/impl/NAME.ipp"
//   #endif
//
// SHARDSAFE_DECL is `inline` header-only, and nothing when separately compiled; there, the
// .ipp files are included by the one unit that compiles them: shardsafe/compiled.hpp for the
// core, shardsafe/compiled_remote.hpp for the remote backends (storage/http.hpp,
// storage/s3.hpp: Boost.Beast, OpenSSL), compiled once per value of SHARDSAFE_HTTP_TLS that
// the program uses (the Meson build's shardsafe_remote_compiled library: the dependency
// `shardsafe-remote-compiled`). Each .ipp is in exactly one of the two units' lists, so that
// neither unit defines what the other does (scripts/check_layering.sh checks it).
//
// The shared template instantiations have one list, shardsafe/impl/instantiations.hpp, the only
// place that names the concrete backends they are for (generic headers such as
// checkpoint/saver.hpp or checkpoint/checkpoint_reader.hpp do not include them for it). It
// holds explicit instantiation definitions (`template ...;`) in the unit of
// shardsafe/compiled.hpp, and explicit instantiation declarations (`extern template ...;`) in
// any other separately compiled unit that includes the torch-free umbrella
// shardsafe/shardsafe.hpp, which includes it in that mode: such a unit (a test, the tool, a
// program) does not instantiate checkpoint_reader<file_directory> or the saves again, which is
// where a separately compiled build saves its time: the declarations cost the umbrella's parse
// nothing measurable, and spared a unit that verifies and saves local folders 6 of its 16 s
// at -O1 (bench/HISTORY.md, "Separate compilation, parse time per unit"). A unit that
// includes a single header (checkpoint/loader.hpp) instantiates what it uses itself, as
// header-only units do: correct, only not shared.
#pragma once

#if defined(SHARDSAFE_SEPARATE_COMPILATION)
#define SHARDSAFE_DECL
// simdjson turns on its development checks in a unit built without optimization (no
// __OPTIMIZE__), and they add members to its parsers: a unit at -O0 and the compiled unit built
// optimized would then disagree on the layout of shardsafe's types that hold a simdjson parser.
// Separately compiled, every unit settles them the same way, off, unless the program defines
// SIMDJSON_DEVELOPMENT_CHECKS itself (for all its units; shardsafe's headers include this one
// before <simdjson.h>, and the Meson dependency `shardsafe-compiled` passes it as a flag).
#if !defined(SIMDJSON_DEVELOPMENT_CHECKS)
#define SIMDJSON_DEVELOPMENT_CHECKS 0
#endif
#else
#define SHARDSAFE_HEADER_ONLY 1
#define SHARDSAFE_DECL inline
#endif
