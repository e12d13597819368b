// tests/remote/odr/odr_half.hpp - one half of the one-definition-rule check (main.cpp): the
// including file sets SHARDSAFE_HTTP_TLS first, then this opens an https:// object of a port
// where nothing listens and returns the error (built without TLS: "this build has none"; with
// TLS: the connection refused). If the two halves' classes shared a name, the linker would
// keep one definition of each inline function, and one half would answer as the other.
#include <chrono>
#include <string>

#include "shardsafe/storage/http.hpp"

namespace {
std::string open_https_object() {
  shardsafe::http_options o;
  o.max_attempts = 1;
  o.connect_timeout = std::chrono::milliseconds(5000);
  try {
    const shardsafe::http_directory d("https://127.0.0.1:9/odr", o);  // port 9: nothing listens
    d.open("object");
  } catch (const shardsafe::error& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace
