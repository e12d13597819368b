// shardsafe/storage/http.hpp - the http backend: objects behind an HTTP(S) server, read by
// range requests. Read-only: a ReadableDirectory whose readers are ReadableStorage,
// BatchReadableStorage and HintedStorage.
//
// Needs Boost (Asio, Beast) and, for https://, OpenSSL with SHARDSAFE_HTTP_TLS=1 (the
// shardsafe_remote dependency of meson.build sets it when OpenSSL is found; link -lssl
// -lcrypto). Not part of the umbrella shardsafe.hpp: include it where it is used, so that
// every other translation unit compiles without Boost.
//
//   http_directory d("http://127.0.0.1:8080/ckpt/step_100");
//   checkpoint_reader<http_directory> r(d);     // metadata.json, then range reads of rank files
//
// What the client does about keep-alive, timeouts, retries, redirects and responses that
// break the range rules is told at the top of storage/detail/http_client.hpp.
//
// | operation       | request                                                                      |
// |-----------------|------------------------------------------------------------------------------|
// | d.open(n)       | HEAD of DIR/n (redirects followed; the final URL is kept for the reads):     |
// |                 | its Content-Length is size(); a HEAD without one: GET of bytes=0-0 and the   |
// |                 | total of its Content-Range. 404/410: errc::not_found; other codes: io_error. |
// |                 | Its strong ETag (else Last-Modified) is kept: each read sends If-Match (else |
// |                 | If-Unmodified-Since), and a 412 or another ETag is io_error "the object      |
// |                 | changed while reading"                                                       |
// | d.exists(n)     | HEAD of DIR/n: 2xx true, 404/410 false; a folder answered after a redirect   |
// |                 | to DIR/n/ (403 without an index) true; anything else an error                |
// | d.list()        | errc::invalid_argument: HTTP has no listing (name the objects instead)       |
// | d.sub(n)        | DIR/n, nothing sent                                                          |
// | s.read_into     | range GETs of at most part_bytes, in parallel when longer                    |
// | s.read_batch    | every read cut into parts of at most part_bytes, requests_in_flight at once  |
// |                 | small reads close together merged into one request (coalesced_reads)         |
// |                 | (coroutines on at most default_threads() threads: http_client::read_ranges)  |
// | s.read_defaults | gap 256 KiB (a request costs a round trip), requests_in_flight               |
//
// Object names are percent-encoded into the URL path; a URL's query is not carried to its
// children. Directories are cheap to copy and copies share one client (pool and limits).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/http_client.hpp"
#include "shardsafe/storage/http_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {
/// The parts one read is cut into: [off, off + part) pieces of at most part bytes.
inline void split_read(std::uint64_t off, std::span<std::byte> dst, std::uint64_t part,
                       std::vector<read_request>& out) {
  for (std::uint64_t at = 0; at < dst.size(); at += part) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(part, dst.size() - at));
    out.push_back({off + at, dst.subspan(static_cast<std::size_t>(at), n)});
  }
}

/// How read_batch coalesces (tensorstore's kvstore/generic_coalescing_batch_util.h does the
/// same): reads of at most coalesce_read_bytes are fetched as one range request of at most the
/// part size, into a staging buffer, and copied out, where each gap between them is at most
/// coalesce_small_gap_bytes (less than a request costs on any link: its headers and a round
/// trip), or at most coalesce_gap_bytes while the group's gaps stay within
/// coalesce_over_read_percent of the bytes it is read for (the planner's own bound: reads it
/// kept apart on purpose, a resharded column's rows, stay apart). A batch's staging is at most
/// coalesce_staging_bytes at a time (its requests go in rounds). So the many small reads of a
/// load of many small tensors (a torch.save file's storages, each behind an 8-byte size or a
/// zip local header) cost a request per part, not one each; larger reads land in place.
inline constexpr std::uint64_t coalesce_read_bytes = std::uint64_t(1) << 20;
inline constexpr std::uint64_t coalesce_small_gap_bytes = std::uint64_t(4) << 10;
inline constexpr std::uint64_t coalesce_gap_bytes = std::uint64_t(64) << 10;
inline constexpr std::uint64_t coalesce_over_read_percent = 10;
inline constexpr std::uint64_t coalesce_staging_bytes = std::uint64_t(64) << 20;

/// Runs the reads rs (none empty) as read(requests) calls of coalesced requests (see above):
/// each call's requests then copied out to the reads they cover. part: the longest request.
template <class Read>
void coalesced_reads(std::span<const read_request> rs, std::uint64_t part, Read&& read) {
  std::vector<std::size_t> order(rs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return rs[a].offset < rs[b].offset; });
  struct group {
    std::uint64_t offset, end;
    std::size_t first, last;             // order[first, last)
    std::uint64_t gaps = 0, useful = 0;  // bytes between its reads; bytes read for
  };
  std::vector<read_request> round;
  std::vector<std::pair<group, std::vector<std::byte>>> staged;
  std::uint64_t staging = 0;
  auto flush = [&] {
    if (round.empty()) return;
    read(std::span<const read_request>(round));
    for (const auto& [g, buf] : staged)
      for (std::size_t k = g.first; k < g.last; ++k) {
        const read_request& r = rs[order[k]];
        std::memcpy(r.dst.data(), buf.data() + (r.offset - g.offset), r.dst.size());
      }
    round.clear();
    staged.clear();
    staging = 0;
  };
  auto small = [&](const read_request& r) { return r.dst.size() <= std::min(coalesce_read_bytes, part); };
  for (std::size_t k = 0; k < order.size();) {
    const read_request& r = rs[order[k]];
    group g{r.offset, r.offset + r.dst.size(), k, k + 1, 0, r.dst.size()};
    if (small(r))
      for (; g.last < order.size(); ++g.last) {
        const read_request& n = rs[order[g.last]];
        const std::uint64_t end = std::max(g.end, n.offset + n.dst.size());
        if (!small(n) || end - g.offset > part) break;
        const std::uint64_t gap = n.offset > g.end ? n.offset - g.end : 0;
        const bool near = gap <= coalesce_small_gap_bytes ||
                          (gap <= coalesce_gap_bytes &&
                           (g.gaps + gap) * 100 <= (g.useful + n.dst.size()) * coalesce_over_read_percent);
        if (!near) break;
        g.gaps += gap;
        g.useful += n.dst.size();
        g.end = end;
      }
    k = g.last;
    if (g.last - g.first == 1) {
      round.push_back(r);
      continue;
    }
    if (staging + (g.end - g.offset) > coalesce_staging_bytes) flush();
    staging += g.end - g.offset;
    staged.emplace_back(g, std::vector<std::byte>(static_cast<std::size_t>(g.end - g.offset)));
    round.push_back({g.offset, std::span<std::byte>(staged.back().second)});
  }
  flush();
}

/// What the HEAD that opens an object says of it.
struct remote_object {
  std::uint64_t size = 0;
  object_validator validator;  ///< its strong ETag, else its Last-Modified (either may be absent)
};

/// The size of the object at u from HEAD (following redirects; u becomes the URL that answered),
/// or from the Content-Range total of a 1-byte GET when HEAD gives no Content-Length; and its
/// validator, from the ETag (strong ones only: If-Match compares strongly) or Last-Modified.
SHARDSAFE_DECL remote_object remote_head(http_client& c, url_parts& u, request_signer sign = {});
}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail

inline namespace SHARDSAFE_HTTP_ABI {

/// One object on an HTTP(S) server, read by range requests, each request passed through
/// sign (no_signing for plain HTTP; s3.hpp's SigV4 signer). Copies share the client.
template <class Sign>
class basic_remote_storage {
 public:
  /// Opens the object at url: one HEAD for its size (see the table at the top).
  basic_remote_storage(std::shared_ptr<detail::http_client> client, url_parts url, Sign sign = {},
                       std::string name = "")
      : client_(std::move(client)),
        url_(std::move(url)),
        name_(name.empty() ? url_.str() : std::move(name)),
        sign_(std::move(sign)) {
    detail::remote_object o = detail::remote_head(*client_, url_, sign_);
    size_ = o.size;
    validator_ = std::move(o.validator);
  }
  explicit basic_remote_storage(std::string_view url, http_options o = {})
      : basic_remote_storage(std::make_shared<detail::http_client>(std::move(o)), parse_url(url)) {}

  std::uint64_t size() const noexcept { return size_; }
  std::string_view name() const noexcept { return name_; }
  /// The URL the reads go to (after the redirects of the HEAD).
  const url_parts& url() const noexcept { return url_; }
  detail::http_client& client() const noexcept { return *client_; }
  /// The ETag (or Last-Modified) every read checks the object still has (see the table).
  const detail::object_validator& validator() const noexcept { return validator_; }

  void read_into(std::uint64_t off, std::span<std::byte> dst) const {
    if (dst.empty()) return;
    detail::check_read_range(name_, off, dst.size(), size_);
    if (dst.size() <= client_->options().part_bytes) {
      client_->read_range(url_, off, dst, size_, sign_, validator_);
      return;
    }
    const read_request one{off, dst};
    read_batch(std::span<const read_request>(&one, 1));
  }

  void read_batch(std::span<const read_request> rs) const {
    std::vector<read_request> parts;
    for (const auto& r : rs) {
      if (r.dst.empty()) continue;
      detail::check_read_range(name_, r.offset, r.dst.size(), size_);
      detail::split_read(r.offset, r.dst, client_->options().part_bytes, parts);
    }
    detail::coalesced_reads(parts, client_->options().part_bytes, [&](std::span<const read_request> rq) {
      client_->read_ranges(url_, rq, size_, sign_, validator_);
    });
  }

  read_settings read_defaults() const {
    read_settings h;
    h.max_gap_bytes = std::uint64_t(256) << 10;
    h.requests_in_flight = client_->options().requests_in_flight;
    return h;
  }

 private:
  std::shared_ptr<detail::http_client> client_;
  url_parts url_;
  std::string name_;
  Sign sign_;
  std::uint64_t size_ = 0;
  detail::object_validator validator_;
};

using http_storage = basic_remote_storage<detail::no_signing>;

/// A folder URL on an HTTP(S) server as a read-only directory (see the table at the top).
class http_directory {
 public:
  using reader_type = http_storage;

  explicit http_directory(std::string_view url, http_options o = {})
      : http_directory(std::make_shared<detail::http_client>(std::move(o)), parse_url(url)) {}
  http_directory(std::shared_ptr<detail::http_client> client, url_parts url)
      : client_(std::move(client)), url_(std::move(url)), name_(url_.str()) {
    if (url_.scheme != "http" && url_.scheme != "https")
      throw error(errc::invalid_argument, name_ + ": an http_directory takes http:// or https:// URLs");
    while (url_.target.size() > 1 && url_.target.back() == '/') url_.target.pop_back();
    name_ = url_.str();
  }

  std::string_view name() const noexcept { return name_; }
  const url_parts& url() const noexcept { return url_; }
  detail::http_client& client() const noexcept { return *client_; }
  const std::shared_ptr<detail::http_client>& shared_client() const noexcept { return client_; }

  reader_type open(std::string_view n) const { return http_storage(client_, child(n)); }

  bool exists(std::string_view n) const {
    detail::http_request head;
    head.method = detail::bhttp::verb::head;
    head.url = child(n);
    const detail::http_response r = client_->send(head);
    if (r.status >= 200 && r.status <= 299) return true;
    if (r.status == 404 || r.status == 410) return false;
    if (r.status == 403 && r.url.path().ends_with('/') && !head.url.path().ends_with('/')) return true;  // a folder
    throw error(errc::io_error, head.url.str() + ": HTTP " + std::to_string(r.status) + " to HEAD (does it exist?)");
  }

  std::vector<std::string> list() const {
    throw error(errc::invalid_argument, name_ +
                                            ": an HTTP server has no listing of a folder; open the objects by name "
                                            "(metadata.json, model.safetensors.index.json, model.safetensors)");
  }

  http_directory sub(std::string_view n) const { return http_directory(client_, child(n)); }

 private:
  url_parts child(std::string_view n) const {
    if (!is_plain_name(n))
      throw error(errc::invalid_argument, name_ + ": '" + std::string(n) + "' is not a plain object name");
    return url_child(url_, n);
  }
  std::shared_ptr<detail::http_client> client_;
  url_parts url_;
  std::string name_;
};

static_assert(ReadableStorage<http_storage> && BatchReadableStorage<http_storage> && HintedStorage<http_storage>,
              "http_storage reads single ranges and batches, and hints its merging");
static_assert(ReadableDirectory<http_directory>, "http_directory is a read-only directory");

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/impl/http.ipp"
#endif
