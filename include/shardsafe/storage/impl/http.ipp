// shardsafe/storage/impl/http.ipp - http.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/http.hpp"

namespace shardsafe {
namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

SHARDSAFE_DECL remote_object remote_head(http_client& c, url_parts& u, request_signer sign) {
  http_request head;
  head.method = bhttp::verb::head;
  head.url = u;
  const http_response r = c.send(head, sign);
  if (r.status == 404 || r.status == 410)
    throw error(errc::not_found, u.str() + ": no such object (HTTP " + std::to_string(r.status) + " to HEAD)");
  if (r.status < 200 || r.status > 299)
    throw error(errc::io_error, u.str() + ": HTTP " + std::to_string(r.status) + " to HEAD");
  u = r.url;
  remote_object obj;
  if (auto et = r.header("ETag"); et && et->size() >= 2 && et->front() == '"' && et->back() == '"')
    obj.validator.etag = *et;
  else if (auto lm = r.header("Last-Modified"); lm && parse_http_date(*lm))
    obj.validator.last_modified = *lm;
  if (auto cl = r.header("Content-Length")) {
    const auto n = detail::parse_decimal(*cl, 19);
    if (!n) throw error(errc::io_error, u.str() + ": HEAD gave Content-Length '" + *cl + "', not a number");
    obj.size = *n;
    return obj;
  }
  http_request get;
  get.url = u;
  get.headers.emplace_back("Range", "bytes=0-0");
  const http_response g = c.send(get, sign);
  if (g.status == 416) return obj;  // nothing to give: an empty object
  std::uint64_t a = 0, b = 0;
  std::optional<std::uint64_t> total;
  auto cr = g.header("Content-Range");
  if (g.status != 206 || !cr || !parse_content_range(*cr, a, b, total) || !total)
    throw error(errc::io_error,
                u.str() + ": HEAD gave no Content-Length, and a GET of bytes=0-0 no Content-Range total (HTTP " +
                    std::to_string(g.status) + ")");
  obj.size = *total;
  return obj;
}

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
