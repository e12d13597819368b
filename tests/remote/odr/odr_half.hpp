// tests/remote/odr/odr_half.hpp - one half of the one-definition-rule check (main.cpp): the
// including file sets SHARDSAFE_HTTP_TLS first, then this opens an https:// object of a port
// where nothing listens and returns the error (built without TLS: "this build has none"; with
// TLS: the connection refused). If the two halves' classes shared a name, the linker would
// keep one definition of each inline function, and one half would answer as the other.
#include <chrono>
#include <string>

#include "shardsafe/storage/http.hpp"

// Separately compiled, a unit that uses the http backend sees the client's declarations only:
// Boost.Asio and Beast's streams and parsers are parsed in the remote unit alone
// (storage/detail/http_client.hpp, http_engine.hpp; remote_odr_compiled builds this so).
#if defined(SHARDSAFE_SEPARATE_COMPILATION) && \
    (defined(BOOST_ASIO_DETAIL_CONFIG_HPP) || defined(BOOST_BEAST_HTTP_PARSER_HPP))
#error \
    "storage/http.hpp brought Boost.Asio or Beast's parser into a separately compiled unit that only calls the client"
#endif

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
