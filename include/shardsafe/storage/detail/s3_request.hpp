// shardsafe/storage/detail/s3_request.hpp - one S3 request: the URL of a key (path-style or
// virtual-hosted), its signature (storage/detail/s3_sigv4.hpp), and S3's answer turned into
// an error naming the object and the operation (S3's XML error bodies: storage/s3.hpp's top).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/detail/http_client.hpp"
#include "shardsafe/storage/detail/s3_sigv4.hpp"
#include "shardsafe/storage/detail/s3_xml.hpp"
#include "shardsafe/storage/s3_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe::detail {
inline namespace SHARDSAFE_HTTP_ABI {

/// What every request of one s3_directory (and its copies, subs, readers, writers) shares.
struct s3_context {
  aws_credentials creds;
  std::string region;
  url_parts endpoint;  ///< scheme, host, port and a base path ("/" usually)
  std::string bucket;
  s3_options opt;
  std::shared_ptr<http_client> client;
  bool virtual_hosted = false;  ///< BUCKET.HOST/KEY rather than HOST/BUCKET/KEY

  /// The URL of key (path-style or virtual-hosted), with an optional query (already encoded).
  url_parts url_of(std::string_view key, std::string_view query = "") const {
    url_parts u = endpoint;
    std::string base(endpoint.path());
    if (base.empty() || base.back() != '/') base += '/';
    if (virtual_hosted) {
      u.host = bucket + "." + endpoint.host;
      u.target = base + percent_encode(key, true);
    } else {
      u.target = base + percent_encode(bucket) + (key.empty() ? "" : "/" + percent_encode(key, true));
    }
    if (!query.empty()) u.target += "?" + std::string(query);
    return u;
  }
  std::string name_of(std::string_view key) const { return "s3://" + bucket + "/" + std::string(key); }
};

/// Adds x-amz-date, x-amz-content-sha256, the session token and Authorization to a request.
struct s3_signer {
  std::shared_ptr<const s3_context> ctx;
  void operator()(http_request& r) const;
};

/// The error an S3 answer stands for: "NAME: OP: Code: Message (HTTP n)", from its XML body
/// (or, when the body is not an S3 error document, the status and an excerpt).
[[noreturn]] SHARDSAFE_DECL void throw_s3_error(const std::string& name, std::string_view op, const http_response& r);

SHARDSAFE_DECL void check_s3(const std::string& name, std::string_view op, const http_response& r);

/// Sends r signed with ctx's credentials; a failure of the exchange itself (connection,
/// timeouts, retries spent, a malformed answer) becomes an error that names the object and
/// the operation before the URL: "s3://b/k: UploadPart 3: http://host/b/k?...: giving up ...".
SHARDSAFE_DECL http_response s3_send(const std::shared_ptr<const s3_context>& ctx, const http_request& r,
                                     const std::string& name, std::string_view op);

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe::detail

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/detail/impl/s3_request.ipp"
#endif
