// shardsafe/storage/s3.hpp - the s3 backend: a prefix of a bucket in an S3-compatible store
// (AWS, MinIO, Ceph, R2, moto) as a WritableDirectory. Readers are the http backend's range
// readers with every request signed (AWS Signature Version 4, storage/detail/s3_sigv4.hpp);
// writers are BlockWritableStorage: one PUT for a small object, a multipart upload for a
// large one.
//
// Needs Boost (Asio, Beast) and OpenSSL; not in the umbrella shardsafe.hpp (include it where
// used, with meson's shardsafe_remote_dep).
//
//   s3_directory d("s3://bucket/runs/step_100");        // settings from the AWS environment
//   save_flat_views(d, views, comm);                     // rank files as multipart uploads
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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/http_client.hpp"
#include "shardsafe/storage/detail/s3_sigv4.hpp"
#include "shardsafe/storage/detail/url.hpp"
#include "shardsafe/storage/http.hpp"

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
  std::string endpoint;                          ///< e.g. "http://127.0.0.1:9000"; empty: see the top
  std::string region;                            ///< empty: see the top
  std::optional<aws_credentials> credentials;    ///< empty: aws_credentials_from_environment(profile)
  std::string profile;                           ///< for ~/.aws/credentials (empty: AWS_PROFILE or default)
  http_options http{};                           ///< timeouts, retries, requests in flight
  std::uint64_t part_bytes = std::uint64_t(16) << 20;      ///< multipart part size (S3: at least 5 MiB)
  std::uint64_t single_put_max = std::uint64_t(16) << 20;  ///< larger objects go up as multipart uploads
  unsigned upload_threads = 8;                   ///< parts uploaded at once per writer
  unsigned list_page = 1000;                     ///< max-keys of one ListObjectsV2 page
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

/// The addressing_style of the `s3 =` block of [profile] (or [profile NAME]) in an AWS config
/// file, as the AWS CLI writes it ("s3 =" then indented "addressing_style = virtual"); nothing
/// when the file, the profile or the setting is absent. An unknown value is an error.
inline std::optional<s3_addressing> addressing_from_config(const std::filesystem::path& file, std::string_view profile) {
  std::ifstream in(file);
  if (!in) return std::nullopt;
  bool in_profile = false, in_s3 = false;
  for (std::string line; std::getline(in, line);) {
    const std::string t = trim_spaces(line);
    if (t.empty() || t[0] == '#' || t[0] == ';') continue;
    const bool indented = line[0] == ' ' || line[0] == '\t';
    if (t.front() == '[') {
      std::string name = trim_spaces(t.substr(1, t.find(']') - 1));
      if (name.starts_with("profile ")) name = trim_spaces(name.substr(8));
      in_profile = name == profile;
      in_s3 = false;
      continue;
    }
    if (!in_profile) continue;
    const std::size_t eq = t.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = trim_spaces(t.substr(0, eq)), v = trim_spaces(t.substr(eq + 1));
    if (!indented) {
      in_s3 = k == "s3" && v.empty();
      continue;
    }
    if (!in_s3 || k != "addressing_style") continue;
    if (v == "auto") return s3_addressing::automatic;
    if (v == "path") return s3_addressing::path;
    if (v == "virtual") return s3_addressing::virtual_hosted;
    throw error(errc::invalid_argument, file.string() + ": profile '" + std::string(profile) + "': s3 addressing_style '" + v +
                                            "' is none of auto, path, virtual");
  }
  return std::nullopt;
}

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
  void operator()(http_request& r) const {
    const std::string date = amz_date_now();
    const std::string hash =
        sha256_hex(std::string_view(reinterpret_cast<const char*>(r.body.data()), r.body.size()));
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
};

/// The text of the first <tag>...</tag> in xml at or after `from`, entities decoded.
inline std::optional<std::string> xml_text(std::string_view xml, std::string_view tag, std::size_t from = 0,
                                           std::size_t* end = nullptr) {
  const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
  const std::size_t a = xml.find(open, from);
  if (a == std::string_view::npos) return std::nullopt;
  const std::size_t b = xml.find(close, a + open.size());
  if (b == std::string_view::npos) return std::nullopt;
  if (end) *end = b + close.size();
  std::string_view raw = xml.substr(a + open.size(), b - a - open.size());
  std::string out;
  for (std::size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '&') {
      out += raw[i];
      continue;
    }
    const std::size_t semi = raw.find(';', i);
    if (semi == std::string_view::npos) return std::nullopt;
    const std::string_view ent = raw.substr(i + 1, semi - i - 1);
    if (ent == "amp") out += '&';
    else if (ent == "lt") out += '<';
    else if (ent == "gt") out += '>';
    else if (ent == "quot") out += '"';
    else if (ent == "apos") out += '\'';
    else if (ent.size() > 1 && ent[0] == '#') {
      unsigned long cp = 0;
      try {
        cp = ent[1] == 'x' ? std::stoul(std::string(ent.substr(2)), nullptr, 16) : std::stoul(std::string(ent.substr(1)));
      } catch (...) {
        return std::nullopt;
      }
      if (cp < 0x80) out += static_cast<char>(cp);
      else if (cp < 0x800) { out += static_cast<char>(0xC0 | (cp >> 6)); out += static_cast<char>(0x80 | (cp & 0x3F)); }
      else if (cp < 0x10000) { out += static_cast<char>(0xE0 | (cp >> 12)); out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)); out += static_cast<char>(0x80 | (cp & 0x3F)); }
      else if (cp < 0x110000) { out += static_cast<char>(0xF0 | (cp >> 18)); out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F)); out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)); out += static_cast<char>(0x80 | (cp & 0x3F)); }
      else return std::nullopt;
    } else {
      return std::nullopt;
    }
    i = semi;
  }
  return out;
}

/// The error an S3 answer stands for: "NAME: OP: Code: Message (HTTP n)", from its XML body
/// (or, when the body is not an S3 error document, the status and an excerpt).
[[noreturn]] inline void throw_s3_error(const std::string& name, std::string_view op, const http_response& r) {
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

/// The ETag S3 gives the object of a completed multipart upload: "hex(md5(concatenation of
/// the binary MD5s of the parts))-N" for N parts, quotes included. Each part's ETag is the MD5
/// of its bytes when the bucket does not encrypt with SSE-KMS (and in moto); nothing when one
/// of part_etags is not a quoted (or bare) 32-digit hex MD5, for then the rule does not apply.
inline std::optional<std::string> multipart_etag(const std::vector<std::string>& part_etags) {
  std::string binary;
  for (std::string_view e : part_etags) {
    if (e.size() == 34 && e.front() == '"' && e.back() == '"') e = e.substr(1, 32);
    if (e.size() != 32) return std::nullopt;
    for (std::size_t i = 0; i < 32; i += 2) {
      auto nibble = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
      };
      const int hi = nibble(e[i]), lo = nibble(e[i + 1]);
      if (hi < 0 || lo < 0) return std::nullopt;
      binary += static_cast<char>(hi * 16 + lo);
    }
  }
  if (part_etags.empty()) return std::nullopt;
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  if (!EVP_Digest(binary.data(), binary.size(), md, &n, EVP_md5(), nullptr))
    throw error(errc::io_error, "MD5 failed (OpenSSL)");
  return "\"" + to_hex(md, n) + "-" + std::to_string(part_etags.size()) + "\"";
}

inline void check_s3(const std::string& name, std::string_view op, const http_response& r) {
  if (r.status < 200 || r.status > 299 || (r.body.find("<Error>") != std::string::npos && xml_text(r.body, "Code")))
    throw_s3_error(name, op, r);  // (CompleteMultipartUpload may fail with 200 and an <Error> body)
}

/// Sends r signed with ctx's credentials; a failure of the exchange itself (connection,
/// timeouts, retries spent, a malformed answer) becomes an error that names the object and
/// the operation before the URL: "s3://b/k: UploadPart 3: http://host/b/k?...: giving up ...".
inline http_response s3_send(const std::shared_ptr<const s3_context>& ctx, const http_request& r, const std::string& name,
                             std::string_view op) {
  try {
    return ctx->client->send(r, s3_signer{ctx});
  } catch (const error& e) {
    throw error(e.code(), name + ": " + std::string(op) + ": " + e.what());
  }
}

}  // namespace detail

using s3_storage = basic_remote_storage<detail::s3_signer>;

/// Writes one object: held in memory and PUT, or uploaded in parts (see the table at the top).
/// Move-only; destroyed without commit or abort it aborts quietly.
class s3_writer {
 public:
  s3_writer(std::shared_ptr<const detail::s3_context> ctx, std::string key)
      : ctx_(std::move(ctx)), key_(std::move(key)), name_(ctx_->name_of(key_)) {}
  s3_writer(s3_writer&& o) noexcept
      : ctx_(std::move(o.ctx_)), key_(std::move(o.key_)), name_(std::move(o.name_)), buffer_(std::move(o.buffer_)),
        upload_id_(std::move(o.upload_id_)), etags_(std::move(o.etags_)), size_(o.size_), state_(o.state_) {
    o.state_ = state::aborted;
    o.upload_id_.clear();
  }
  s3_writer& operator=(s3_writer&&) = delete;
  ~s3_writer() {
    if (state_ == state::open) try {
        abort();
      } catch (...) {
      }
  }

  std::string_view name() const noexcept { return name_; }
  /// The multipart upload in progress ("" when none): for tests.
  const std::string& upload_id() const noexcept { return upload_id_; }

  template <class Fill>
  void write_blocks(std::uint64_t size, Fill&& fill, const block_write_options& o = {}) {
    require_open();
    if (size <= ctx_->opt.single_put_max) {
      buffer_.assign(static_cast<std::size_t>(size), std::byte{0});
      if (size) fill(0, std::span<std::byte>(buffer_));
      return;
    }
    const std::uint64_t part =
        std::max({ctx_->opt.part_bytes, std::uint64_t(5) << 20, (size + 9999) / 10000});
    const std::size_t parts = static_cast<std::size_t>((size + part - 1) / part);
    const auto r = send(detail::bhttp::verb::post, "uploads", {}, "CreateMultipartUpload");
    auto id = detail::xml_text(r.body, "UploadId");
    if (!id || id->empty()) throw error(errc::io_error, name_ + ": CreateMultipartUpload: no UploadId in the answer");
    upload_id_ = *id;
    size_ = size;
    etags_.assign(parts, std::string());
    try {
      detail::parallel_for(parts, o.threads ? o.threads : ctx_->opt.upload_threads, [&](std::size_t i) {
        const std::uint64_t off = i * part, len = std::min(part, size - off);
        std::vector<std::byte> buf(static_cast<std::size_t>(len));
        fill(off, std::span<std::byte>(buf));
        const auto pr = send(detail::bhttp::verb::put,
                             "partNumber=" + std::to_string(i + 1) + "&uploadId=" + percent_encode(upload_id_), buf,
                             "UploadPart " + std::to_string(i + 1));
        auto etag = pr.header("ETag");
        if (!etag) throw error(errc::io_error, name_ + ": UploadPart " + std::to_string(i + 1) + ": no ETag in the answer");
        etags_[i] = *etag;
      });
    } catch (...) {
      abort_upload_quietly();
      throw;
    }
  }

  void sync() { require_open(); }

  void commit() {
    require_open();
    if (!upload_id_.empty()) {
      std::string xml = "<CompleteMultipartUpload>";
      for (std::size_t i = 0; i < etags_.size(); ++i)
        xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags_[i] + "</ETag></Part>";
      xml += "</CompleteMultipartUpload>";
      try {
        send(detail::bhttp::verb::post, "uploadId=" + percent_encode(upload_id_), std::as_bytes(std::span(xml)),
             "CompleteMultipartUpload");
      } catch (const error& e) {
        // S3 may have completed the upload and its answer been lost (a timeout, a dropped
        // connection: moto takes more than 30 s for 1 GiB); the retry then gets NoSuchUpload.
        // The object is ours when it has the multipart ETag of our parts and their size.
        check_completed(e);
      }
      upload_id_.clear();
    } else {
      send(detail::bhttp::verb::put, "", buffer_, "PutObject");
    }
    state_ = state::committed;
    buffer_ = {};
  }

  /// Drops what was written and aborts the multipart upload, if any (throws if that fails).
  void abort() {
    if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": abort after commit");
    if (state_ == state::aborted) return;
    state_ = state::aborted;
    buffer_ = {};
    if (!upload_id_.empty()) {
      const std::string id = std::exchange(upload_id_, std::string());
      send(detail::bhttp::verb::delete_, "uploadId=" + percent_encode(id), {}, "AbortMultipartUpload");
    }
  }

 private:
  enum class state { open, committed, aborted };
  void require_open() const {
    if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": write after commit");
    if (state_ == state::aborted) throw error(errc::invalid_argument, name_ + ": write after abort");
  }
  void abort_upload_quietly() noexcept {
    if (upload_id_.empty()) return;
    try {
      const std::string id = std::exchange(upload_id_, std::string());
      send(detail::bhttp::verb::delete_, "uploadId=" + percent_encode(id), {}, "AbortMultipartUpload");
    } catch (...) {
    }
  }
  /// After CompleteMultipartUpload failed with `failure`: returns when a HEAD finds the object
  /// with the multipart ETag of etags_ and size_ bytes (completed, the answer lost), else
  /// throws an error that names the object, the failure and what was found against the rule.
  void check_completed(const error& failure) const {
    const std::string rule =
        "the ETag of a multipart upload is \"hex(md5(the parts' binary MD5s))-N\" and its size the sum of the parts";
    const auto want = detail::multipart_etag(etags_);
    if (!want)
      throw error(failure.code(), std::string(failure.what()) +
                                      " (whether S3 completed the upload cannot be checked: the part ETags are not MD5s, so " +
                                      rule + " does not apply)");
    detail::http_request head;
    head.method = detail::bhttp::verb::head;
    head.url = ctx_->url_of(key_);
    std::string found;
    try {
      const auto r = detail::s3_send(ctx_, head, name_, "HEAD after CompleteMultipartUpload");
      if (r.status >= 200 && r.status <= 299) {
        const auto etag = r.header("ETag");
        const auto length = r.header("Content-Length");
        if (etag && *etag == *want && length && *length == std::to_string(size_)) return;  // completed: ours
        found = "the object there has ETag " + etag.value_or("(none)") + " and " + length.value_or("(unknown)") +
                " bytes, not our " + *want + " and " + std::to_string(size_) + " bytes";
      } else if (r.status == 404) {
        found = "there is no object";
      } else {
        found = "HEAD answered HTTP " + std::to_string(r.status);
      }
    } catch (const error& h) {
      found = std::string("HEAD failed: ") + h.what();
    }
    throw error(failure.code(), std::string(failure.what()) + "; checked whether S3 completed it anyway (" + rule +
                                    "): " + found);
  }

  detail::http_response send(detail::bhttp::verb m, const std::string& query, std::span<const std::byte> body,
                             std::string_view op) const {
    detail::http_request r;
    r.method = m;
    r.url = ctx_->url_of(key_, query);
    r.body = body;
    auto resp = detail::s3_send(ctx_, r, name_, op);
    detail::check_s3(name_, op, resp);
    return resp;
  }

  std::shared_ptr<const detail::s3_context> ctx_;
  std::string key_, name_;
  std::vector<std::byte> buffer_;
  std::string upload_id_;
  std::vector<std::string> etags_;
  std::uint64_t size_ = 0;  ///< of a multipart upload
  state state_ = state::open;
};

/// A prefix of a bucket as a directory (see the table at the top). Cheap to copy; copies,
/// sub-directories, readers and writers share one client and one set of settings.
class s3_directory {
 public:
  using reader_type = s3_storage;
  using writer_type = s3_writer;

  explicit s3_directory(std::string_view url, s3_options o = {}) {
    const url_parts u = parse_url(url);
    if (u.scheme != "s3") throw error(errc::invalid_argument, "'" + std::string(url) + "': an s3_directory takes s3://BUCKET/PREFIX");
    auto ctx = std::make_shared<detail::s3_context>();
    ctx->bucket = u.host;
    ctx->creds = o.credentials ? *o.credentials : aws_credentials_from_environment(o.profile);
    ctx->region = !o.region.empty() ? o.region
                                    : detail::env("AWS_REGION").value_or(detail::env("AWS_DEFAULT_REGION").value_or("us-east-1"));
    const std::optional<std::string> custom = !o.endpoint.empty() ? std::optional<std::string>(o.endpoint) : detail::env("AWS_ENDPOINT_URL");
    std::string ep = custom.value_or("https://s3." + ctx->region + ".amazonaws.com");
    ctx->endpoint = parse_url(ep);
    if (ctx->endpoint.scheme == "s3") throw error(errc::invalid_argument, "'" + ep + "': an S3 endpoint is an http(s):// URL");
    s3_addressing style = o.addressing;
    if (style == s3_addressing::automatic) {
      std::filesystem::path config;
      if (auto f = detail::env("AWS_CONFIG_FILE")) config = *f;
      else if (auto h = detail::env("HOME")) config = std::filesystem::path(*h) / ".aws" / "config";
      const std::string profile = !o.profile.empty() ? o.profile : detail::env("AWS_PROFILE").value_or("default");
      if (!config.empty()) style = detail::addressing_from_config(config, profile).value_or(style);
    }
    if (style == s3_addressing::automatic) style = !custom && s3_virtual_bucket_name(ctx->bucket) ? s3_addressing::virtual_hosted : s3_addressing::path;
    if (style == s3_addressing::virtual_hosted) {
      if (!s3_virtual_bucket_name(ctx->bucket))
        throw error(errc::invalid_argument, "s3://" + ctx->bucket + ": virtual-hosted addressing needs a bucket name that is a DNS label "
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

  bool exists(std::string_view n) const {
    const std::string k = key(n);
    detail::http_request head;
    head.method = detail::bhttp::verb::head;
    head.url = ctx_->url_of(k);
    const auto r = detail::s3_send(ctx_, head, ctx_->name_of(k), "HEAD");
    if (r.status >= 200 && r.status <= 299) return true;
    if (r.status != 404) detail::throw_s3_error(ctx_->name_of(k), "HEAD", r);
    bool any = false;
    list_keys(k + "/", false, 1, [&](std::string_view) { any = true; return false; });
    return any;
  }

  std::vector<std::string> list() const {
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

  void remove(std::string_view n) const {
    const std::string k = key(n);
    std::vector<std::string> keys{k};
    list_keys(k + "/", false, ctx_->opt.list_page, [&](std::string_view x) { keys.emplace_back(x); return true; });
    detail::parallel_for(keys.size(), ctx_->opt.http.requests_in_flight, [&](std::size_t i) {
      detail::http_request r;
      r.method = detail::bhttp::verb::delete_;
      r.url = ctx_->url_of(keys[i]);
      const auto resp = detail::s3_send(ctx_, r, ctx_->name_of(keys[i]), "DELETE");
      if (resp.status != 404) detail::check_s3(ctx_->name_of(keys[i]), "DELETE", resp);
    });
  }

  s3_directory sub(std::string_view n) const {
    s3_directory d = *this;
    d.prefix_ = key(n);
    d.name_ = ctx_->name_of(d.prefix_);
    return d;
  }

  /// Puts the "PREFIX/" marker object (nothing for the bucket itself).
  void make() const {
    if (prefix_.empty()) return;
    detail::http_request r;
    r.method = detail::bhttp::verb::put;
    r.url = ctx_->url_of(prefix_ + "/");
    detail::check_s3(name_ + "/", "PUT (folder marker)", detail::s3_send(ctx_, r, name_ + "/", "PUT (folder marker)"));
  }

  /// Creates the bucket (PUT BUCKET; in us-east-1 without a location body): for tests and tools.
  void create_bucket() const {
    detail::http_request r;
    r.method = detail::bhttp::verb::put;
    r.url = ctx_->url_of("");
    std::string body;
    if (ctx_->region != "us-east-1")
      body = "<CreateBucketConfiguration><LocationConstraint>" + ctx_->region + "</LocationConstraint></CreateBucketConfiguration>";
    r.body = std::as_bytes(std::span(body));
    detail::check_s3("s3://" + ctx_->bucket, "CreateBucket", detail::s3_send(ctx_, r, "s3://" + ctx_->bucket, "CreateBucket"));
  }

  /// The multipart uploads in progress under this prefix (ListMultipartUploads): for tests.
  std::vector<std::string> pending_uploads() const {
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

 private:
  std::string key(std::string_view n) const {
    if (!is_plain_name(n))
      throw error(errc::invalid_argument, name_ + ": '" + std::string(n) + "' is not a plain object name");
    return prefix_.empty() ? std::string(n) : prefix_ + "/" + std::string(n);
  }

  /// Calls each(key) for the keys (and, with a delimiter, the common prefixes) under pre, page
  /// by page, until each returns false or the listing ends.
  template <class Each>
  void list_keys(const std::string& pre, bool delimit, unsigned page, Each&& each) const {
    std::string token;
    // a listing ends within the operation deadline and a bounded number of pages and keys,
    // whatever the server answers (an endless IsTruncated=true)
    const auto deadline = std::chrono::steady_clock::now() + ctx_->opt.http.operation_timeout;
    std::uint64_t keys = 0;
    for (int pages = 0;; ++pages) {
      if (pages >= max_list_pages || std::chrono::steady_clock::now() >= deadline)
        throw error(errc::io_error, name_ + ": ListObjectsV2 of '" + pre + "': still truncated after " + std::to_string(pages) +
                                        " pages and " + std::to_string(keys) + " keys (limits: " + std::to_string(max_list_pages) +
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
            throw error(errc::io_error, name_ + ": ListObjectsV2 of '" + pre + "': more than " + std::to_string(max_list_keys) +
                                            " keys; refusing to list further");
          if (!each(std::string_view(*k))) return;
        }
      }
      if (xml_is_true(x, "IsTruncated")) {
        auto next = detail::xml_text(x, "NextContinuationToken");
        if (!next || next->empty()) throw error(errc::io_error, name_ + ": ListObjectsV2: truncated without a NextContinuationToken");
        token = *next;
        if (pages > 1'000'000) throw error(errc::io_error, name_ + ": ListObjectsV2: more than a million pages");
        continue;
      }
      return;
    }
  }
  static constexpr int max_list_pages = 10'000;                  ///< pages of one listing
  static constexpr std::uint64_t max_list_keys = std::uint64_t(10'000'000);  ///< keys of one listing
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

}  // namespace shardsafe
