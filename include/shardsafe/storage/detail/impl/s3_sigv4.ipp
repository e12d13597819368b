// shardsafe/storage/detail/impl/s3_sigv4.ipp - s3_sigv4.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/detail/s3_sigv4.hpp"

namespace shardsafe {
namespace detail {

SHARDSAFE_DECL std::string sha256_hex(std::string_view bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr))
    throw error(errc::io_error, "SHA-256 failed (OpenSSL)");
  return to_hex(md, n);
}

SHARDSAFE_DECL std::string hmac_sha256(std::string_view key, std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(data.data()),
            data.size(), md, &n))
    throw error(errc::io_error, "HMAC-SHA256 failed (OpenSSL)");
  return std::string(reinterpret_cast<const char*>(md), n);
}

SHARDSAFE_DECL sigv4_result sigv4_sign(std::string_view method, std::string_view uri, std::string_view query,
                                       std::vector<std::pair<std::string, std::string>> headers,
                                       std::string_view payload_hash, const aws_credentials& creds,
                                       std::string_view region, std::string_view service, std::string_view amz_date) {
  if (amz_date.size() != 16)
    throw error(errc::invalid_argument, "sigv4: x-amz-date '" + std::string(amz_date) + "' is not YYYYMMDDTHHMMSSZ");
  for (auto& [k, v] : headers) {
    for (char& c : k) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
    v = trim_spaces(v);
  }
  std::sort(headers.begin(), headers.end());
  std::vector<std::string> pairs;
  for (std::size_t at = 0; at <= query.size() && !query.empty();) {
    std::size_t amp = query.find('&', at);
    if (amp == std::string_view::npos) amp = query.size();
    std::string p(query.substr(at, amp - at));
    if (!p.empty()) pairs.push_back(p.find('=') == std::string::npos ? p + "=" : p);
    at = amp + 1;
  }
  std::sort(pairs.begin(), pairs.end(), [](const std::string& a, const std::string& b) {
    const auto ka = std::string_view(a).substr(0, a.find('=')), kb = std::string_view(b).substr(0, b.find('='));
    return ka != kb ? ka < kb : a < b;
  });
  sigv4_result r;
  std::string canonical_headers, signed_headers;
  for (const auto& [k, v] : headers) {
    canonical_headers += k + ":" + v + "\n";
    signed_headers += (signed_headers.empty() ? "" : ";") + k;
  }
  std::string canonical_query;
  for (const auto& p : pairs) canonical_query += (canonical_query.empty() ? "" : "&") + p;
  r.canonical_request = std::string(method) + "\n" + std::string(uri.empty() ? "/" : uri) + "\n" + canonical_query +
                        "\n" + canonical_headers + "\n" + signed_headers + "\n" + std::string(payload_hash);
  const std::string day(amz_date.substr(0, 8));
  const std::string scope = day + "/" + std::string(region) + "/" + std::string(service) + "/aws4_request";
  r.string_to_sign =
      "AWS4-HMAC-SHA256\n" + std::string(amz_date) + "\n" + scope + "\n" + sha256_hex(r.canonical_request);
  std::string key = hmac_sha256("AWS4" + creds.secret_access_key, day);
  key = hmac_sha256(key, region);
  key = hmac_sha256(key, service);
  key = hmac_sha256(key, "aws4_request");
  const std::string sig = hmac_sha256(key, r.string_to_sign);
  r.signature = to_hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size());
  r.authorization = "AWS4-HMAC-SHA256 Credential=" + creds.access_key_id + "/" + scope +
                    ",SignedHeaders=" + signed_headers + ",Signature=" + r.signature;
  return r;
}

SHARDSAFE_DECL std::string amz_date_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[17];
  std::strftime(b, sizeof b, "%Y%m%dT%H%M%SZ", &tm);
  return b;
}

}  // namespace detail
}  // namespace shardsafe
