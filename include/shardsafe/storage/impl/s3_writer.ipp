// shardsafe/storage/impl/s3_writer.ipp - s3_writer.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/s3_writer.hpp"

namespace shardsafe {
inline namespace SHARDSAFE_HTTP_ABI {

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

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe
