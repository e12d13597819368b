// tests/remote/odr/tls.cpp - the remote layer built with TLS (see odr_half.hpp).
#undef SHARDSAFE_HTTP_TLS
#define SHARDSAFE_HTTP_TLS 1
#include "odr_half.hpp"

std::string odr_tls_half() { return open_https_object(); }
