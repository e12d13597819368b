// shardsafe/storage/s3_options.hpp - the settings of the s3 backend (storage/s3.hpp), plain
// data: no network library. Each setting comes from the first place that has it (the rules
// are at the top of storage/s3.hpp): the option, then the AWS environment (storage/aws.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/aws.hpp"
#include "shardsafe/storage/http_options.hpp"

namespace shardsafe {

/// How a request names the bucket: in the path (ENDPOINT/BUCKET/KEY) or in the host name
/// (BUCKET.ENDPOINT-HOST/KEY, "virtual-hosted style", AWS's default).
enum class s3_addressing {
  automatic,       ///< as botocore's "auto": virtual-hosted for AWS's own endpoint and a bucket
                   ///< name that is a DNS label (see s3_virtual_bucket_name); path-style otherwise
                   ///< and for any endpoint named by the option or AWS_ENDPOINT_URL
  path,            ///< ENDPOINT/BUCKET/KEY
  virtual_hosted,  ///< BUCKET.HOST/KEY of the endpoint's host (http_options::connect_to helps
                   ///< when that name does not resolve)
};

struct s3_options {
  std::string endpoint;                                    ///< e.g. "http://127.0.0.1:9000"; empty: see the top
  std::string region;                                      ///< empty: see the top
  std::optional<aws_credentials> credentials;              ///< empty: aws_credentials_from_environment(profile)
  std::string profile;                                     ///< for ~/.aws/credentials (empty: AWS_PROFILE or default)
  http_options http{};                                     ///< timeouts, retries, requests in flight
  std::uint64_t part_bytes = std::uint64_t(16) << 20;      ///< multipart part size (S3: at least 5 MiB)
  std::uint64_t single_put_max = std::uint64_t(16) << 20;  ///< larger objects go up as multipart uploads
  unsigned upload_threads = 8;                             ///< parts uploaded at once per writer
  unsigned list_page = 1000;                               ///< max-keys of one ListObjectsV2 page
  /// automatic: the profile's `s3 = / addressing_style = auto|path|virtual` of the AWS config
  /// file (AWS_CONFIG_FILE, else ~/.aws/config) when it has one, then the rule of automatic.
  s3_addressing addressing = s3_addressing::automatic;
};

/// Whether bucket can go into a host name as virtual-hosted requests need (botocore's test):
/// 3 to 63 of a-z, 0-9 and '-', starting and ending with a letter or digit. Names with dots
/// are left out (they break the wildcard certificate of HTTPS endpoints).
inline bool s3_virtual_bucket_name(std::string_view bucket) noexcept {
  if (bucket.size() < 3 || bucket.size() > 63) return false;
  auto alnum = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  if (!alnum(bucket.front()) || !alnum(bucket.back())) return false;
  return std::all_of(bucket.begin(), bucket.end(), [&](char c) { return alnum(c) || c == '-'; });
}

namespace detail {

/// The addressing_style of the `s3 =` block of profile `profile` in an AWS config file, as the
/// AWS CLI writes it ("s3 =" then indented "addressing_style = virtual"); nothing when the file,
/// the profile or the setting is absent. An unknown value is an error.
SHARDSAFE_DECL std::optional<s3_addressing> addressing_from_config(const std::filesystem::path& file,
                                                                   std::string_view profile);

}  // namespace detail

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/impl/s3_options.ipp"
#endif
