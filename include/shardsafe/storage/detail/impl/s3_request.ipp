// shardsafe/storage/detail/impl/s3_request.ipp - s3_request.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/detail/s3_request.hpp"

namespace shardsafe::detail {
inline namespace SHARDSAFE_HTTP_ABI {

SHARDSAFE_DECL void s3_signer::operator()(http_request& r) const {
  const std::string date = amz_date_now();
  const std::string hash = sha256_hex(std::string_view(reinterpret_cast<const char*>(r.body.data()), r.body.size()));
  r.headers.emplace_back("x-amz-date", date);
  r.headers.emplace_back("x-amz-content-sha256", hash);
  if (!ctx->creds.session_token.empty()) r.headers.emplace_back("x-amz-security-token", ctx->creds.session_token);
  std::vector<std::pair<std::string, std::string>> signed_headers = r.headers;
  signed_headers.emplace_back("host", r.url.host_header());
  const std::size_t q = r.url.target.find('?');
  const auto s = sigv4_sign(std::string(sv(bhttp::to_string(r.method))), r.url.path(),
                            q == std::string::npos ? std::string_view() : std::string_view(r.url.target).substr(q + 1),
                            std::move(signed_headers), hash, ctx->creds, ctx->region, "s3", date);
  r.headers.emplace_back("Authorization", s.authorization);
}

[[noreturn]] SHARDSAFE_DECL void throw_s3_error(const std::string& name, std::string_view op, const http_response& r) {
  const auto code = xml_text(r.body, "Code");
  const auto message = xml_text(r.body, "Message");
  std::string what = name + ": " + std::string(op) + ": ";
  if (code) {
    what += *code + (message ? ": " + *message : std::string()) + " (HTTP " + std::to_string(r.status) + ")";
  } else {
    std::string e = r.body.substr(0, 120);
    for (char& c : e)
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
    what += "HTTP " + std::to_string(r.status) +
            (r.body.empty() ? std::string(" (no body)") : " with a body that is not an S3 error document: " + e);
  }
  const bool missing = (code && (*code == "NoSuchKey" || *code == "NoSuchBucket" || *code == "NoSuchUpload")) ||
                       (!code && r.status == 404);
  throw error(missing ? errc::not_found : errc::io_error, what);
}

SHARDSAFE_DECL void check_s3(const std::string& name, std::string_view op, const http_response& r) {
  if (r.status < 200 || r.status > 299 || (r.body.find("<Error>") != std::string::npos && xml_text(r.body, "Code")))
    throw_s3_error(name, op, r);  // (CompleteMultipartUpload may fail with 200 and an <Error> body)
}

SHARDSAFE_DECL http_response s3_send(const std::shared_ptr<const s3_context>& ctx, const http_request& r,
                                     const std::string& name, std::string_view op) {
  try {
    return ctx->client->send(r, s3_signer{ctx});
  } catch (const error& e) {
    throw error(e.code(), name + ": " + std::string(op) + ": " + e.what());
  }
}

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe::detail
