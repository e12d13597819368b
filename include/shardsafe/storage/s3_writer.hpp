// shardsafe/storage/s3_writer.hpp - the s3 backend's writer (BlockWritableStorage): one object
// held in memory and PUT, or a multipart upload whose parts go up as they are filled (the
// table at the top of storage/s3.hpp says when, and what a failure leaves).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/s3_request.hpp"

namespace shardsafe {
inline namespace SHARDSAFE_HTTP_ABI {

/// Writes one object: held in memory and PUT, or uploaded in parts (see the table at the top).
/// Move-only; destroyed without commit or abort it aborts quietly.
class s3_writer {
 public:
  s3_writer(std::shared_ptr<const detail::s3_context> ctx, std::string key)
      : ctx_(std::move(ctx)), key_(std::move(key)), name_(ctx_->name_of(key_)) {}
  s3_writer(s3_writer&& o) noexcept
      : ctx_(std::move(o.ctx_)),
        key_(std::move(o.key_)),
        name_(std::move(o.name_)),
        buffer_(std::move(o.buffer_)),
        upload_id_(std::move(o.upload_id_)),
        etags_(std::move(o.etags_)),
        size_(o.size_),
        state_(o.state_) {
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

  template <class Fill>
  void write_blocks(std::uint64_t size, Fill&& fill, const block_write_options& o = {}) {
    require_open();
    if (size <= ctx_->opt.single_put_max) {
      buffer_.assign(static_cast<std::size_t>(size), std::byte{0});
      if (size) fill(0, std::span<std::byte>(buffer_));
      return;
    }
    const std::uint64_t part = std::max({ctx_->opt.part_bytes, std::uint64_t(5) << 20, (size + 9999) / 10000});
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
        if (!etag)
          throw error(errc::io_error, name_ + ": UploadPart " + std::to_string(i + 1) + ": no ETag in the answer");
        etags_[i] = *etag;
      });
    } catch (...) {
      abort_upload_quietly();
      throw;
    }
  }

  void sync() { require_open(); }

  void commit();

  /// Drops what was written and aborts the multipart upload, if any (throws if that fails).
  void abort();

 private:
  enum class state { open, committed, aborted };
  void require_open() const {
    if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": write after commit");
    if (state_ == state::aborted) throw error(errc::invalid_argument, name_ + ": write after abort");
  }
  void abort_upload_quietly() noexcept;
  /// After CompleteMultipartUpload failed with `failure`: returns when a HEAD finds the object
  /// with the multipart ETag of etags_ and size_ bytes (completed, the answer lost), else
  /// throws an error that names the object, the failure and what was found against the rule.
  void check_completed(const error& failure) const;

  detail::http_response send(detail::bhttp::verb m, const std::string& query, std::span<const std::byte> body,
                             std::string_view op) const;

  std::shared_ptr<const detail::s3_context> ctx_;
  std::string key_, name_;
  std::vector<std::byte> buffer_;
  std::string upload_id_;
  std::vector<std::string> etags_;
  std::uint64_t size_ = 0;  ///< of a multipart upload
  state state_ = state::open;
};

#if SHARDSAFE_REMOTE_DEFINE
SHARDSAFE_DECL void s3_writer::commit() {
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

SHARDSAFE_DECL void s3_writer::abort() {
  if (state_ == state::committed) throw error(errc::invalid_argument, name_ + ": abort after commit");
  if (state_ == state::aborted) return;
  state_ = state::aborted;
  buffer_ = {};
  if (!upload_id_.empty()) {
    const std::string id = std::exchange(upload_id_, std::string());
    send(detail::bhttp::verb::delete_, "uploadId=" + percent_encode(id), {}, "AbortMultipartUpload");
  }
}

SHARDSAFE_DECL void s3_writer::abort_upload_quietly() noexcept {
  if (upload_id_.empty()) return;
  try {
    const std::string id = std::exchange(upload_id_, std::string());
    send(detail::bhttp::verb::delete_, "uploadId=" + percent_encode(id), {}, "AbortMultipartUpload");
  } catch (...) {
  }
}

SHARDSAFE_DECL void s3_writer::check_completed(const error& failure) const {
  const std::string rule =
      "the ETag of a multipart upload is \"hex(md5(the parts' binary MD5s))-N\" and its size the sum of the parts";
  const auto want = detail::multipart_etag(etags_);
  if (!want)
    throw error(failure.code(),
                std::string(failure.what()) +
                    " (whether S3 completed the upload cannot be checked: the part ETags are not MD5s, so " + rule +
                    " does not apply)");
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
  throw error(failure.code(),
              std::string(failure.what()) + "; checked whether S3 completed it anyway (" + rule + "): " + found);
}

SHARDSAFE_DECL detail::http_response s3_writer::send(detail::bhttp::verb m, const std::string& query,
                                                     std::span<const std::byte> body, std::string_view op) const {
  detail::http_request r;
  r.method = m;
  r.url = ctx_->url_of(key_, query);
  r.body = body;
  auto resp = detail::s3_send(ctx_, r, name_, op);
  detail::check_s3(name_, op, resp);
  return resp;
}
#endif  // SHARDSAFE_REMOTE_DEFINE

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe
