// shardsafe/storage/detail/s3_sigv4.hpp - AWS Signature Version 4 for S3 requests (libcrypto's
// SHA-256 and HMAC). The credentials: storage/aws.hpp.
//
// sigv4_sign follows the AWS reference ("Create a signed AWS API request"):
//   canonical request = METHOD \n URI \n QUERY \n lower(name):trim(value)\n... \n signed;names \n payload hash
//   string to sign    = AWS4-HMAC-SHA256 \n DATE \n SCOPE \n hex(sha256(canonical request))
//   signing key       = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, yyyymmdd), region), service), "aws4_request")
// URI and QUERY are taken as already percent-encoded (S3 names are encoded once, with
// percent_encode of url.hpp, which is AWS's UriEncode); the query's pairs are sorted here.
// Every header handed in is signed. No network, no Boost: tests check it against AWS's
// published example and against botocore.
#pragma once

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"
#include "shardsafe/storage/aws.hpp"

namespace shardsafe {

namespace detail {

/// Lowercase hex SHA-256 of bytes.
SHARDSAFE_DECL std::string sha256_hex(std::string_view bytes);

/// HMAC-SHA256(key, data), raw bytes.
SHARDSAFE_DECL std::string hmac_sha256(std::string_view key, std::string_view data);

/// The pieces of one signature, kept for tests and error messages.
struct sigv4_result {
  std::string canonical_request;
  std::string string_to_sign;
  std::string signature;      ///< lowercase hex
  std::string authorization;  ///< the Authorization header's value
};

/// Signs one request (see the top of the file). amz_date is "YYYYMMDDTHHMMSSZ"; headers are
/// (name, value) pairs, every one of them signed (host and x-amz-date among them).
SHARDSAFE_DECL sigv4_result sigv4_sign(std::string_view method, std::string_view uri, std::string_view query,
                                       std::vector<std::pair<std::string, std::string>> headers,
                                       std::string_view payload_hash, const aws_credentials& creds,
                                       std::string_view region, std::string_view service, std::string_view amz_date);

/// The current UTC time as x-amz-date wants it.
SHARDSAFE_DECL std::string amz_date_now();

}  // namespace detail

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/detail/impl/s3_sigv4.ipp"
#endif
