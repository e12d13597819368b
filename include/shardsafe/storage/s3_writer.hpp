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

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/impl/s3_writer.ipp"
#endif
