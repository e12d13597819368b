// shardsafe/compiled_remote.hpp - the compiled part of the remote backends in a separately
// compiled shardsafe (core/config.hpp).
//
// A program built with SHARDSAFE_SEPARATE_COMPILATION defined for every translation unit that
// uses storage/http.hpp or storage/s3.hpp compiles, once, a .cpp that holds only
//
//   #include <shardsafe/compiled_remote.hpp>
//
// (with the same flags as the rest, SHARDSAFE_HTTP_TLS included), and links it in beside the
// unit of shardsafe/compiled.hpp; the Meson build's shardsafe_remote_compiled library is that
// unit (dependency `shardsafe-remote-compiled`). It holds the HTTP client (its connections,
// exchanges and retries: the coroutines and the Boost.Asio and Beast code under them), the
// HEAD that opens an object, SigV4 and the S3 requests, errors and XML. With
// SHARDSAFE_HTTP_TLS=1 (the default where OpenSSL is found by the build) it holds the s3
// backend too; with 0, the http backend alone (plain http://). A program whose units use both
// values compiles this unit once per value: the two are apart by their inline namespace
// (http_plain, http_tls), as header-only units are (tests/remote/odr/).
#pragma once

#if !defined(SHARDSAFE_SEPARATE_COMPILATION)
#error \
    "shardsafe/compiled_remote.hpp is the compiled part of a separately compiled shardsafe's remote backends: define SHARDSAFE_SEPARATE_COMPILATION for every translation unit of the program (core/config.hpp)"
#endif

#include "shardsafe/storage/http.hpp"
#if SHARDSAFE_HTTP_TLS
#include "shardsafe/storage/s3.hpp"
#endif

// the bodies of the functions the remote headers declare SHARDSAFE_DECL, one implementation
// file per header (each in this list or in compiled.hpp's, never both)
#include "shardsafe/storage/detail/impl/http_client.ipp"
#include "shardsafe/storage/impl/http.ipp"
#if SHARDSAFE_HTTP_TLS
#include "shardsafe/storage/detail/impl/s3_request.ipp"
#include "shardsafe/storage/detail/impl/s3_sigv4.ipp"
#include "shardsafe/storage/detail/impl/s3_xml.ipp"
#include "shardsafe/storage/impl/s3.ipp"
#include "shardsafe/storage/impl/s3_options.ipp"
#include "shardsafe/storage/impl/s3_writer.ipp"
#endif
