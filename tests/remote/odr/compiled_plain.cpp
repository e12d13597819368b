// tests/remote/odr/compiled_plain.cpp - in remote_odr_compiled, the separately compiled remote
// layer of the half built without TLS (plain.cpp); the half with TLS links the build's own
// shardsafe_remote_compiled (SHARDSAFE_HTTP_TLS=1).
#undef SHARDSAFE_HTTP_TLS
#define SHARDSAFE_HTTP_TLS 0
#include "shardsafe/compiled_remote.hpp"
