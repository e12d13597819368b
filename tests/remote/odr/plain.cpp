// tests/remote/odr/plain.cpp - the remote layer built without TLS (see odr_half.hpp).
#undef SHARDSAFE_HTTP_TLS
#define SHARDSAFE_HTTP_TLS 0
#include "odr_half.hpp"

std::string odr_plain_half() { return open_https_object(); }
