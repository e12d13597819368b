// shardsafe/storage/detail/http_message.hpp - what the HTTP client (storage/detail/
// http_client.hpp) and its callers hand each other: a request, a response, the hook that signs
// a request, what a range read checks the object against. Of Boost it takes only Beast's verb
// (and the string_view that comes with it): a separately compiled program's units see these and
// the client's declarations, not Asio or Beast's streams, parsers and coroutines (those are in
// the remote unit alone: shardsafe/compiled_remote.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardsafe/storage/detail/asio_config.hpp"  // before any Boost.Asio header

#include <boost/beast/http/verb.hpp>

#include "shardsafe/storage/url.hpp"

#ifndef SHARDSAFE_HTTP_TLS
#define SHARDSAFE_HTTP_TLS 0
#endif

// The TLS switch names the namespace of the remote layer's classes and functions (an inline
// namespace: code never spells it), so that translation units built with and without TLS
// link into one program with a definition each, not two definitions of one class (which the
// one-definition rule forbids: tests/remote/odr/ links the two).
#if SHARDSAFE_HTTP_TLS
#define SHARDSAFE_HTTP_ABI http_tls
#else
#define SHARDSAFE_HTTP_ABI http_plain
#endif

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

namespace bhttp = boost::beast::http;

/// A request as the backends build it; the body is the caller's memory.
struct http_request {
  bhttp::verb method = bhttp::verb::get;
  /// When the request (all its attempts) must be done; set by the first attempt from
  /// http_options::operation_timeout.
  std::chrono::steady_clock::time_point deadline{};
  url_parts url;
  std::vector<std::pair<std::string, std::string>> headers;
  std::span<const std::byte> body;
};

/// A response read whole into memory (bounded by max_response_body).
struct http_response {
  unsigned status = 0;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  url_parts url;  ///< the URL that answered (after redirects)

  std::optional<std::string> header(std::string_view name) const {
    for (const auto& [k, v] : headers)
      if (k.size() == name.size() &&
          std::equal(k.begin(), k.end(), name.begin(), [](char a, char b) { return ascii_lower(a) == ascii_lower(b); }))
        return v;
    return std::nullopt;
  }
};

/// Beast's string_view (boost::string_view in 1.74) as a std::string_view.
inline std::string_view sv(boost::beast::string_view s) noexcept { return {s.data(), s.size()}; }

/// Signs nothing: the plain HTTP backend's request hook.
struct no_signing {
  void operator()(http_request&) const noexcept {}
};

/// The request hook the client applies before every attempt (no_signing, s3_signer), passed
/// by reference and called through one function pointer: the client's code is one whatever
/// signs (compiled once in a separately compiled program: core/config.hpp), not one copy of
/// its coroutines per hook. Made from a function object it refers to that object, which must
/// outlive the signer (a temporary in the call that takes the signer does); made from a
/// function, it holds the function's address.
class request_signer {
 public:
  request_signer() noexcept = default;                  ///< signs nothing
  request_signer(void (*sign)(http_request&)) noexcept  // NOLINT(google-explicit-constructor)
      : fn_(sign) {}
  template <class Sign>
    requires(std::is_class_v<Sign> && !std::is_same_v<std::remove_cv_t<Sign>, request_signer> &&
             std::is_invocable_v<const Sign&, http_request&>)
  request_signer(const Sign& sign) noexcept  // NOLINT(google-explicit-constructor): a hook is a signer
      : hook_(std::addressof(sign)), call_([](const void* h, http_request& r) { (*static_cast<const Sign*>(h))(r); }) {}
  void operator()(http_request& r) const {
    if (call_)
      call_(hook_, r);
    else if (fn_)
      fn_(r);
  }

 private:
  const void* hook_ = nullptr;
  void (*call_)(const void*, http_request&) = nullptr;
  void (*fn_)(http_request&) = nullptr;
};

/// What a range read checks that the object is still the one that was opened: its strong
/// ETag, sent as If-Match and compared with the ETag of every answer; or, when the server gave
/// none (or a weak one), its Last-Modified, sent as If-Unmodified-Since. Empty: no check.
struct object_validator {
  std::string etag;           ///< a strong ETag, quotes included
  std::string last_modified;  ///< an HTTP-date
  bool empty() const noexcept { return etag.empty() && last_modified.empty(); }
};

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
