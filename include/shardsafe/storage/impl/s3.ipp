// shardsafe/storage/impl/s3.ipp - s3.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/s3.hpp"

namespace shardsafe {
inline namespace SHARDSAFE_HTTP_ABI {

SHARDSAFE_DECL s3_directory::s3_directory(std::string_view url, s3_options o) {
  const url_parts u = parse_url(url);
  if (u.scheme != "s3")
    throw error(errc::invalid_argument, "'" + std::string(url) + "': an s3_directory takes s3://BUCKET/PREFIX");
  auto ctx = std::make_shared<detail::s3_context>();
  ctx->bucket = u.host;
  ctx->creds = o.credentials ? *o.credentials : aws_credentials_from_environment(o.profile);
  ctx->region = !o.region.empty()
                    ? o.region
                    : detail::env("AWS_REGION").value_or(detail::env("AWS_DEFAULT_REGION").value_or("us-east-1"));
  const std::optional<std::string> custom =
      !o.endpoint.empty() ? std::optional<std::string>(o.endpoint) : detail::env("AWS_ENDPOINT_URL");
  std::string ep = custom.value_or("https://s3." + ctx->region + ".amazonaws.com");
  ctx->endpoint = parse_url(ep);
  if (ctx->endpoint.scheme == "s3")
    throw error(errc::invalid_argument, "'" + ep + "': an S3 endpoint is an http(s):// URL");
  s3_addressing style = o.addressing;
  if (style == s3_addressing::automatic) {
    std::filesystem::path config;
    if (auto f = detail::env("AWS_CONFIG_FILE"))
      config = *f;
    else if (auto h = detail::env("HOME"))
      config = std::filesystem::path(*h) / ".aws" / "config";
    const std::string profile = aws_profile_name(o.profile);
    if (!config.empty()) style = detail::addressing_from_config(config, profile).value_or(style);
  }
  if (style == s3_addressing::automatic)
    style = !custom && s3_virtual_bucket_name(ctx->bucket) ? s3_addressing::virtual_hosted : s3_addressing::path;
  if (style == s3_addressing::virtual_hosted) {
    if (!s3_virtual_bucket_name(ctx->bucket))
      throw error(errc::invalid_argument, "s3://" + ctx->bucket +
                                              ": virtual-hosted addressing needs a bucket name that is a DNS label "
                                              "(3 to 63 of a-z, 0-9, '-'); use path addressing");
    ctx->virtual_hosted = true;
  }
  ctx->client = std::make_shared<detail::http_client>(o.http);
  ctx->opt = std::move(o);
  ctx_ = std::move(ctx);
  prefix_ = std::string(u.path().substr(1));
  while (!prefix_.empty() && prefix_.back() == '/') prefix_.pop_back();
  name_ = ctx_->name_of(prefix_);
  if (prefix_.empty()) name_.pop_back();  // "s3://bucket"
}

SHARDSAFE_DECL bool s3_directory::exists(std::string_view n) const {
  const std::string k = key(n);
  detail::http_request head;
  head.method = detail::bhttp::verb::head;
  head.url = ctx_->url_of(k);
  const auto r = detail::s3_send(ctx_, head, ctx_->name_of(k), "HEAD");
  if (r.status >= 200 && r.status <= 299) return true;
  if (r.status != 404) detail::throw_s3_error(ctx_->name_of(k), "HEAD", r);
  bool any = false;
  list_keys(k + "/", false, 1, [&](std::string_view) {
    any = true;
    return false;
  });
  return any;
}

SHARDSAFE_DECL std::vector<std::string> s3_directory::list() const {
  const std::string pre = prefix_.empty() ? "" : prefix_ + "/";
  std::vector<std::string> out;
  list_keys(pre, true, ctx_->opt.list_page, [&](std::string_view k) {
    std::string_view rest = k.substr(pre.size());
    if (rest.ends_with('/')) rest.remove_suffix(1);
    if (!rest.empty()) out.emplace_back(rest);
    return true;
  });
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

SHARDSAFE_DECL void s3_directory::remove(std::string_view n) const {
  const std::string k = key(n);
  std::vector<std::string> keys{k};
  list_keys(k + "/", false, ctx_->opt.list_page, [&](std::string_view x) {
    keys.emplace_back(x);
    return true;
  });
  detail::parallel_for(keys.size(), ctx_->opt.http.requests_in_flight, [&](std::size_t i) {
    detail::http_request r;
    r.method = detail::bhttp::verb::delete_;
    r.url = ctx_->url_of(keys[i]);
    const auto resp = detail::s3_send(ctx_, r, ctx_->name_of(keys[i]), "DELETE");
    if (resp.status != 404) detail::check_s3(ctx_->name_of(keys[i]), "DELETE", resp);
  });
}

SHARDSAFE_DECL void s3_directory::make() const {
  if (prefix_.empty()) return;
  detail::http_request r;
  r.method = detail::bhttp::verb::put;
  r.url = ctx_->url_of(prefix_ + "/");
  detail::check_s3(name_ + "/", "PUT (folder marker)", detail::s3_send(ctx_, r, name_ + "/", "PUT (folder marker)"));
}

SHARDSAFE_DECL void s3_directory::create_bucket() const {
  detail::http_request r;
  r.method = detail::bhttp::verb::put;
  r.url = ctx_->url_of("");
  std::string body;
  if (ctx_->region != "us-east-1")
    body = "<CreateBucketConfiguration><LocationConstraint>" + ctx_->region +
           "</LocationConstraint></CreateBucketConfiguration>";
  r.body = std::as_bytes(std::span(body));
  detail::check_s3("s3://" + ctx_->bucket, "CreateBucket",
                   detail::s3_send(ctx_, r, "s3://" + ctx_->bucket, "CreateBucket"));
}

SHARDSAFE_DECL std::vector<std::string> s3_directory::pending_uploads() const {
  detail::http_request r;
  r.url = ctx_->url_of("", "uploads=&prefix=" + percent_encode(prefix_));
  const auto resp = detail::s3_send(ctx_, r, name_, "ListMultipartUploads");
  detail::check_s3(name_, "ListMultipartUploads", resp);
  std::vector<std::string> keys;
  for (std::size_t at = 0;;) {
    std::size_t end = 0;
    auto k = detail::xml_text(resp.body, "Key", at, &end);
    if (!k) break;
    keys.push_back(*k);
    at = end;
  }
  return keys;
}

SHARDSAFE_DECL void s3_directory::list_keys(const std::string& pre, bool delimit, unsigned page,
                                            const std::function<bool(std::string_view)>& each) const {
  std::string token;
  // a listing ends within the operation deadline and a bounded number of pages and keys,
  // whatever the server answers (an endless IsTruncated=true)
  const auto deadline = std::chrono::steady_clock::now() + ctx_->opt.http.operation_timeout;
  std::uint64_t keys = 0, key_bytes = 0;
  for (int pages = 0;; ++pages) {
    if (pages >= max_list_pages || std::chrono::steady_clock::now() >= deadline)
      throw error(errc::io_error, name_ + ": ListObjectsV2 of '" + pre + "': still truncated after " +
                                      std::to_string(pages) + " pages and " + std::to_string(keys) +
                                      " keys (limits: " + std::to_string(max_list_pages) +
                                      " pages, http_options::operation_timeout); refusing to list further");
    std::string q = "list-type=2&max-keys=" + std::to_string(page) + "&prefix=" + percent_encode(pre);
    if (delimit) q += "&delimiter=%2F";
    if (!token.empty()) q += "&continuation-token=" + percent_encode(token);
    detail::http_request r;
    r.url = ctx_->url_of("", q);
    const auto resp = detail::s3_send(ctx_, r, name_, "ListObjectsV2 of '" + pre + "'");
    detail::check_s3(name_, "ListObjectsV2 of '" + pre + "'", resp);
    const std::string& x = resp.body;
    if (x.find("<ListBucketResult") == std::string::npos) {  // a 200 from something that is not S3
      std::string e = x.substr(0, 120);
      for (char& c : e)
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
      throw error(errc::io_error, name_ + ": ListObjectsV2: the answer (HTTP " + std::to_string(resp.status) +
                                      ") is not a ListBucketResult: " + (e.empty() ? "(no body)" : e));
    }
    for (const std::string_view tag : {std::string_view("Contents"), std::string_view("CommonPrefixes")}) {
      const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
      for (std::size_t at = x.find(open); at != std::string::npos; at = x.find(open, at)) {
        const std::size_t end = x.find(close, at);
        if (end == std::string::npos) throw error(errc::io_error, name_ + ": ListObjectsV2: an unclosed " + open);
        auto k = detail::xml_text(std::string_view(x).substr(at, end - at), tag == "Contents" ? "Key" : "Prefix");
        if (!k) throw error(errc::io_error, name_ + ": ListObjectsV2: a " + open + " without its key");
        at = end + close.size();
        if (!k->starts_with(pre)) continue;
        key_bytes += k->size();
        if (++keys > max_list_keys || key_bytes > max_list_key_bytes)
          throw error(errc::io_error,
                      name_ + ": ListObjectsV2 of '" + pre + "': more than " +
                          (keys > max_list_keys ? std::to_string(max_list_keys) + " keys"
                                                : std::to_string(max_list_key_bytes) + " bytes of keys") +
                          " (after " + std::to_string(pages + 1) + " pages); refusing to list further");
        if (!each(std::string_view(*k))) return;
      }
    }
    if (xml_is_true(x, "IsTruncated")) {
      auto next = detail::xml_text(x, "NextContinuationToken");
      if (!next || next->empty())
        throw error(errc::io_error, name_ + ": ListObjectsV2: truncated without a NextContinuationToken");
      token = *next;
      if (pages > 1'000'000) throw error(errc::io_error, name_ + ": ListObjectsV2: more than a million pages");
      continue;
    }
    return;
  }
}

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe
