// shardsafe/storage/s3.hpp - the s3 backend: a prefix of a bucket in an S3-compatible store
// (AWS, MinIO, Ceph, R2, moto) as a WritableDirectory. Readers are the http backend's range
// readers with every request signed (AWS Signature Version 4, storage/detail/s3_sigv4.hpp);
// writers are BlockWritableStorage: one PUT for a small object, a multipart upload for a
// large one.
//
// Needs Boost (Asio, Beast) and OpenSSL; not in the umbrella shardsafe.hpp (include it where
// used, with meson's shardsafe_remote_dep; separately compiled, shardsafe-remote-compiled,
// whose unit holds s3 only with SHARDSAFE_HTTP_TLS=1: shardsafe/compiled_remote.hpp). Its
// parts: the settings (storage/s3_options.hpp, plain data), the writer (storage/s3_writer.hpp),
// one signed request and S3's errors (storage/detail/s3_request.hpp), S3's XML
// (storage/detail/s3_xml.hpp), SigV4 (storage/detail/s3_sigv4.hpp); here, the directory.
//
//   s3_directory d("s3://bucket/runs/step_100");        // settings from the AWS environment
//   save(d, views, comm);                                // rank files as multipart uploads
//
// Settings (s3_options), each from the first place that has it: the option, then the
// environment: credentials as aws_credentials_from_environment finds them; region from
// AWS_REGION, AWS_DEFAULT_REGION, else us-east-1; endpoint from AWS_ENDPOINT_URL, else
// https://s3.REGION.amazonaws.com; addressing (s3_options::addressing, else the profile's
// s3 addressing_style in ~/.aws/config): virtual-hosted, https://BUCKET.s3.REGION.amazonaws.com/KEY,
// for AWS's own endpoint and a bucket name that is a DNS label, else path-style,
// ENDPOINT/BUCKET/KEY (any endpoint from the option or AWS_ENDPOINT_URL), as botocore does.
//
// | operation        | requests                                                                    |
// |------------------|-----------------------------------------------------------------------------|
// | d.open(n)        | HEAD KEY for the size, then ranged GETs (http.hpp's reader)                 |
// | d.exists(n)      | HEAD KEY; if 404, ListObjectsV2 of KEY/ with max-keys 1 (a "folder")        |
// | d.list()         | ListObjectsV2 of PREFIX/ with delimiter '/', every page; objects and        |
// |                  | common prefixes, the "PREFIX/" marker left out; sorted                      |
// | d.create(n)      | nothing until write_blocks: a size up to single_put_max is held in memory   |
// |                  | and PUT at commit; a larger one is a multipart upload whose parts (part_bytes|
// |                  | each, upload_threads at once) go up as fill produces them, completed at     |
// |                  | commit; any failure aborts the upload (no parts left behind). When the      |
// |                  | Complete fails (its answer lost, the retry told NoSuchUpload), a HEAD       |
// |                  | accepts the object if it has the multipart ETag of our parts and their size |
// | d.remove(n)      | DELETE KEY, and DELETE of every key under KEY/                              |
// | d.make()         | PUT of an empty "PREFIX/" marker, so an empty folder exists and is listed   |
//
// S3's XML error bodies become messages that name the object, the operation and S3's code:
// "s3://b/k: GET: NoSuchKey: The specified key does not exist. (HTTP 404)"; NoSuchKey and 404
// are errc::not_found, the rest errc::io_error. A body that is not S3's XML is quoted (an
// excerpt, control bytes as '?'), a listing answered by something other than a
// ListBucketResult is an error (not an empty folder), and a failed exchange (connection,
// timeouts, attempts spent, a malformed answer) names the object and operation before the URL.
// Readers check, as http.hpp's do, that the object keeps the ETag it was opened with
// (If-Match on every range read). Object names are plain names (storage/concepts.hpp).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/s3_request.hpp"
#include "shardsafe/storage/detail/s3_xml.hpp"
#include "shardsafe/storage/http.hpp"
#include "shardsafe/storage/s3_options.hpp"
#include "shardsafe/storage/s3_writer.hpp"
#include "shardsafe/storage/url.hpp"

#if defined(SHARDSAFE_SEPARATE_COMPILATION) && !SHARDSAFE_HTTP_TLS
#error \
    "shardsafe: the s3 backend separately compiled needs SHARDSAFE_HTTP_TLS=1 (the unit of shardsafe/compiled_remote.hpp holds s3 only with TLS); build header-only, or with TLS"
#endif

namespace shardsafe {
inline namespace SHARDSAFE_HTTP_ABI {

using s3_storage = basic_remote_storage<detail::s3_signer>;

/// A prefix of a bucket as a directory (see the table at the top). Cheap to copy; copies,
/// sub-directories, readers and writers share one client and one set of settings.
class s3_directory {
 public:
  using reader_type = s3_storage;
  using writer_type = s3_writer;

  explicit s3_directory(std::string_view url, s3_options o = {});

  std::string_view name() const noexcept { return name_; }
  const std::string& prefix() const noexcept { return prefix_; }
  detail::http_client& client() const noexcept { return *ctx_->client; }
  /// Whether requests are virtual-hosted (BUCKET.HOST/KEY) rather than path-style.
  bool virtual_hosted() const noexcept { return ctx_->virtual_hosted; }
  /// The URL object n is requested at.
  url_parts url_of(std::string_view n) const { return ctx_->url_of(key(n)); }

  reader_type open(std::string_view n) const {
    const std::string k = key(n);
    try {
      return s3_storage(ctx_->client, ctx_->url_of(k), detail::s3_signer{ctx_}, ctx_->name_of(k));
    } catch (const error& e) {
      throw error(e.code(), ctx_->name_of(k) + ": open: " + e.what());
    }
  }
  writer_type create(std::string_view n) const { return s3_writer(ctx_, key(n)); }

  bool exists(std::string_view n) const;

  std::vector<std::string> list() const;

  void remove(std::string_view n) const;

  s3_directory sub(std::string_view n) const {
    s3_directory d = *this;
    d.prefix_ = key(n);
    d.name_ = ctx_->name_of(d.prefix_);
    return d;
  }

  /// Puts the "PREFIX/" marker object (nothing for the bucket itself).
  void make() const;

  /// Creates the bucket (PUT BUCKET; in us-east-1 without a location body), for a first run
  /// against a fresh store.
  void create_bucket() const;

  /// The keys of the multipart uploads in progress under this prefix (ListMultipartUploads):
  /// what a writer killed mid-upload left behind (S3 keeps, and bills, their parts until they
  /// are aborted or a lifecycle rule expires them). A writer that fails aborts its own.
  std::vector<std::string> pending_uploads() const;

 private:
  std::string key(std::string_view n) const {
    if (!is_plain_name(n))
      throw error(errc::invalid_argument, name_ + ": '" + std::string(n) + "' is not a plain object name");
    return prefix_.empty() ? std::string(n) : prefix_ + "/" + std::string(n);
  }

  /// Calls each(key) for the keys (and, with a delimiter, the common prefixes) under pre, page
  /// by page, until each returns false or the listing ends.
  void list_keys(const std::string& pre, bool delimit, unsigned page,
                 const std::function<bool(std::string_view)>& each) const;
  static constexpr int max_list_pages = 10'000;  ///< pages of one listing
  /// Keys of one listing, and their bytes: what a caller holds of a listing stays bounded (10
  /// million keys of 15 MiB pages, held, peaked at 689 MiB before the count refused them).
  static constexpr std::uint64_t max_list_keys = std::uint64_t(1'000'000);
  static constexpr std::uint64_t max_list_key_bytes = std::uint64_t(64) << 20;
  static bool xml_is_true(const std::string& x, const char* tag) {
    auto v = detail::xml_text(x, tag);
    return v && *v == "true";
  }

  std::shared_ptr<const detail::s3_context> ctx_;
  std::string prefix_;
  std::string name_;
};

static_assert(ReadableStorage<s3_storage> && BatchReadableStorage<s3_storage> && HintedStorage<s3_storage>);
static_assert(BlockWritableStorage<s3_writer>, "s3_writer writes whole blocks (multipart parts)");
static_assert(WritableDirectory<s3_directory>);

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/impl/s3.ipp"
#endif
