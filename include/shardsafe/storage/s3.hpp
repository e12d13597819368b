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
  static constexpr int max_list_pages = 10'000;                              ///< pages of one listing
  static constexpr std::uint64_t max_list_keys = std::uint64_t(10'000'000);  ///< keys of one listing
  static bool xml_is_true(const std::string& x, const char* tag) {
    auto v = detail::xml_text(x, tag);
    return v && *v == "true";
  }

  std::shared_ptr<const detail::s3_context> ctx_;
  std::string prefix_;
  std::string name_;
};

#if SHARDSAFE_REMOTE_DEFINE
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
  std::uint64_t keys = 0;
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
        if (++keys > max_list_keys)
          throw error(errc::io_error, name_ + ": ListObjectsV2 of '" + pre + "': more than " +
                                          std::to_string(max_list_keys) + " keys; refusing to list further");
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
#endif  // SHARDSAFE_REMOTE_DEFINE

static_assert(ReadableStorage<s3_storage> && BatchReadableStorage<s3_storage> && HintedStorage<s3_storage>);
static_assert(BlockWritableStorage<s3_writer>, "s3_writer writes whole blocks (multipart parts)");
static_assert(WritableDirectory<s3_directory>);

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe
