// shardsafe/storage/url.hpp - the URLs the remote backends take, parsed and joined
// without any network library: http(s)://HOST[:PORT]/PATH[?QUERY] and s3://BUCKET/PREFIX.
//
// parse_url accepts only what the backends can use and says why it refuses the rest: a scheme
// of http, https or s3; a host name, an IPv4 address or a bracketed IPv6 address; a decimal
// port in [1, 65535]; no user information (credentials belong in options, not in a URL that
// ends up in error messages); no fragment; no spaces or control characters anywhere.
#pragma once

#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/detail/hex.hpp"

namespace shardsafe {

/// A URL taken apart. target is what an HTTP request line names: the path (at least "/")
/// and, when present, "?" and the query.
struct url_parts {
  std::string scheme;  ///< "http", "https" or "s3", lower case
  std::string host;    ///< without brackets for IPv6
  std::uint16_t port = 0;
  std::string target = "/";
  bool explicit_port = false;

  bool tls() const noexcept { return scheme == "https"; }
  /// "host" or "host:port" as a Host header names it (the port only when not the scheme's).
  std::string host_header() const {
    std::string h = host.find(':') != std::string::npos ? "[" + host + "]" : host;
    return explicit_port ? h + ":" + std::to_string(port) : h;
  }
  /// scheme://host[:port]: what connections are pooled by.
  std::string origin() const { return scheme + "://" + host_header(); }
  std::string str() const { return origin() + target; }
  /// The path part of target (before any '?').
  std::string_view path() const noexcept { return std::string_view(target).substr(0, target.find('?')); }
  friend bool operator==(const url_parts&, const url_parts&) = default;
};

namespace detail {
[[noreturn]] inline void bad_url(std::string_view url, const std::string& why) {
  throw error(errc::invalid_argument, "'" + std::string(url) + "': not a usable URL: " + why);
}
inline char ascii_lower(char c) noexcept { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }
inline bool is_unreserved(unsigned char c) noexcept {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
         c == '_' || c == '~';
}
}  // namespace detail

/// Percent-encodes every byte but the unreserved ones (RFC 3986 §2.3), and '/' too unless
/// keep_slash: how object names go into a URL path (and, keeping '/', how S3 signs them).
inline std::string percent_encode(std::string_view s, bool keep_slash = false) {
  std::string r;
  r.reserve(s.size());
  for (unsigned char c : s) {
    if (detail::is_unreserved(c) || (keep_slash && c == '/')) {
      r += static_cast<char>(c);
    } else {
      r += '%';
      detail::append_hex(r, c, 2, /*upper=*/true);
    }
  }
  return r;
}

/// Parses an absolute URL (see the top of this file); throws errc::invalid_argument naming the
/// URL and the rule it breaks.
SHARDSAFE_DECL url_parts parse_url(std::string_view url);

/// The URL of object `name` inside the folder u: u's path with one '/' then name
/// percent-encoded ('/' included); any query of u is dropped.
inline url_parts url_child(const url_parts& u, std::string_view name) {
  url_parts c = u;
  std::string p(u.path());
  if (p.empty() || p.back() != '/') p += '/';
  c.target = p + percent_encode(name);
  return c;
}

/// Where a redirect's Location points, from the URL it answered: an absolute URL, a
/// scheme-relative "//host/path", an absolute path, or a path relative to base's folder.
inline url_parts resolve_location(const url_parts& base, std::string_view location) {
  if (location.find("://") != std::string_view::npos) return parse_url(location);
  if (location.starts_with("//")) return parse_url(base.scheme + ":" + std::string(location));
  if (location.empty()) detail::bad_url(base.str(), "a redirect with an empty Location");
  url_parts r = base;
  if (location.front() == '/') {
    r.target = std::string(location);
  } else {
    const std::string_view p = base.path();
    r.target = std::string(p.substr(0, p.rfind('/') + 1)) + std::string(location);
  }
  for (unsigned char c : r.target)
    if (c <= 0x20 || c == 0x7f) detail::bad_url(location, "a Location with a space or a control character");
  return r;
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/impl/url.ipp"
#endif
