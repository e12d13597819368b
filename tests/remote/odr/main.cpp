// tests/remote/odr/main.cpp - issue 29's "the TLS switch cannot break the one-definition rule
// between translation units": plain.cpp (SHARDSAFE_HTTP_TLS=0) and tls.cpp (=1) include the
// same headers into one program, and each must still behave as built. Exit status 0 when both
// do; otherwise what each said.
#include <cstdio>
#include <string>

std::string odr_plain_half();
std::string odr_tls_half();

int main() {
  const std::string plain = odr_plain_half(), tls = odr_tls_half();
  const bool plain_ok = plain.find("this build has none") != std::string::npos;
  const bool tls_ok = tls.find("cannot connect") != std::string::npos && tls.find("has none") == std::string::npos;
  std::printf("built without TLS: %s\n  -> %s\nbuilt with TLS: %s\n  -> %s\n", plain.c_str(),
              plain_ok ? "right" : "WRONG (expected: HTTPS refused, this build has none)", tls.c_str(),
              tls_ok ? "right" : "WRONG (expected: a connection refused)");
  return plain_ok && tls_ok ? 0 : 1;
}
