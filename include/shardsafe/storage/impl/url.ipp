// shardsafe/storage/impl/url.ipp - url.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/url.hpp"

namespace shardsafe {

SHARDSAFE_DECL url_parts parse_url(std::string_view url) {
  for (unsigned char c : url)
    if (c <= 0x20 || c == 0x7f) detail::bad_url(url, "it holds a space or a control character");
  const std::size_t colon = url.find("://");
  if (colon == std::string_view::npos || colon == 0)
    detail::bad_url(url, "no scheme (expected http://, https:// or s3://)");
  url_parts u;
  for (char c : url.substr(0, colon)) u.scheme += detail::ascii_lower(c);
  if (u.scheme != "http" && u.scheme != "https" && u.scheme != "s3")
    detail::bad_url(url, "scheme '" + u.scheme + "' is not http, https or s3");
  std::string_view rest = url.substr(colon + 3);
  if (rest.find('#') != std::string_view::npos) detail::bad_url(url, "it has a fragment ('#')");
  const std::size_t end = rest.find_first_of("/?");
  std::string_view authority = rest.substr(0, end);
  std::string_view tail = end == std::string_view::npos ? std::string_view() : rest.substr(end);
  if (authority.find('@') != std::string_view::npos)
    detail::bad_url(url, "it has user information ('@'); pass credentials as options instead");
  if (authority.empty()) detail::bad_url(url, "no host");
  std::string_view port_text;
  if (authority.front() == '[') {
    const std::size_t close = authority.find(']');
    if (close == std::string_view::npos) detail::bad_url(url, "an IPv6 address without its closing ']'");
    u.host = std::string(authority.substr(1, close - 1));
    if (u.host.empty()) detail::bad_url(url, "an empty IPv6 address");
    for (char& c : u.host) {
      if (!(std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.'))
        detail::bad_url(url, "'" + u.host + "' is not an IPv6 address");
      c = detail::ascii_lower(c);  // as host names are: one spelling of each address
    }
    if (u.host.find(':') == std::string::npos)  // (fuzz_remote's finding: "[B]" was taken as an address)
      detail::bad_url(url, "'" + u.host + "' is not an IPv6 address");
    std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') detail::bad_url(url, "text after the IPv6 address that is not ':PORT'");
      port_text = after.substr(1);
      u.explicit_port = true;
    }
  } else {
    const std::size_t pc = authority.rfind(':');
    std::string_view h = authority.substr(0, pc);
    if (pc != std::string_view::npos) {
      port_text = authority.substr(pc + 1);
      u.explicit_port = true;
    }
    if (h.empty()) detail::bad_url(url, "no host");
    for (char c : h) {
      const unsigned char uc = static_cast<unsigned char>(c);
      if (!(std::isalnum(uc) || c == '-' || c == '.' || c == '_'))
        detail::bad_url(url, "host '" + std::string(h) + "' has a character a host name cannot");
      u.host += detail::ascii_lower(c);
    }
  }
  if (u.explicit_port) {
    const auto p = detail::parse_decimal(port_text, 5);
    if (!p || *p == 0 || *p > 65535)
      detail::bad_url(url, "port '" + std::string(port_text) + "' is not a number in [1, 65535]");
    u.port = static_cast<std::uint16_t>(*p);
  } else {
    u.port = u.scheme == "https" ? 443 : 80;
  }
  if (u.scheme == "s3" && u.explicit_port) detail::bad_url(url, "an s3:// URL names a bucket, not a host and port");
  u.target = tail.empty() ? "/" : (tail.front() == '?' ? "/" + std::string(tail) : std::string(tail));
  return u;
}

}  // namespace shardsafe
