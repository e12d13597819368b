// shardsafe/storage/detail/http_client.hpp - the HTTP/1.1 client under the http and s3
// backends (Boost.Beast over Boost.Asio; TLS through OpenSSL when SHARDSAFE_HTTP_TLS is 1).
// Its settings are storage/http_options.hpp's; its parts: the connections, lanes and request
// slots (storage/detail/http_pool.hpp), one attempt of an exchange (storage/detail/
// http_exchange.hpp), the header fields it parses (storage/detail/http_fields.hpp); here, the
// retries and the blocking calls.
//
// Blocking calls built from Asio coroutines. Every exchange is a coroutine on a lane: an
// io_context with the kept-alive connections bound to it, pooled per origin. A blocking call
// (send, read_range) leases a lane and runs it on the calling thread until its coroutine ends;
// read_ranges (a backend's read_batch) runs its requests as coroutines on a few lanes, one
// thread each (default_threads(): the caller and the shared pool's), not a thread per request:
// on two cores, 16 blocking threads each waiting on its own socket landed a loopback load
// 10-35% slower than two threads serving eight connections each (bench/README.md, remote).
// A socket timeout (connect_timeout, read_timeout) is a real deadline, a retry's backoff is a
// timer (the lane's other requests go on), and no thread blocks on work it did not start. At
// most requests_in_flight requests of one client are on the wire at once, however many
// threads ask; a caller holds its request slots through the retries of its requests.
//
// http_options::connect_to sends a host's connections to another address (curl's
// --connect-to); the request still names the URL's host.
//
// Retries (http_options): connection errors, timeouts, 5xx, 429 and responses that break the
// range rules below are retried up to max_attempts times in all, after an exponential backoff
// with jitter (at least Retry-After when the server sends one, in seconds or as an HTTP-date,
// up to retry_after_max). Every request, its retries, backoffs and redirects included, ends
// within operation_timeout (default 20 s): every socket operation's deadline is cut to it, so
// a server that stalls, sends its header a byte at a time or its body never, or asks to be
// retried past it (`503 Retry-After: 86400`) makes the request an error naming the URL and what
// was waited for. A redirect is followed only to http:// or https:// (never to s3://). A connection taken from the pool that fails before any byte of a
// response arrived is replaced without counting an attempt (the server closed it while idle).
//
// A range read (read_range) lands straight in the caller's memory and is checked before a
// byte is kept: the answer must be 206 whose Content-Range is exactly the bytes asked for and
// whose Content-Length (when sent) is their number; a 200 is taken only when the whole object
// was asked for and Content-Length says so, else the server ignored Range and that is an error
// (errc::io_error, not retried: it would answer the same). A body that ends early is resumed:
// the retry asks only for the bytes still missing. A body longer than announced is an error
// (or, past a Content-Length, leaves a connection that is not reused). A body with a
// Content-Length is read from the socket straight into the caller's memory, past Beast's
// parser; only the bytes that arrived with the header are copied out of the buffer.
//
// With an object_validator (the http and s3 readers pass the ETag or Last-Modified of the
// HEAD that opened the object), every range read sends If-Match (or If-Unmodified-Since); a
// 412, or an answer with another ETag, is errc::io_error "the object changed while reading",
// not retried: bytes of two versions of an object never land in one load.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/http_exchange.hpp"
#include "shardsafe/storage/detail/http_fields.hpp"
#include "shardsafe/storage/detail/http_pool.hpp"
#include "shardsafe/storage/http_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

class http_client {
 public:
  explicit http_client(http_options o = {});
  ~http_client();
  http_client(const http_client&) = delete;
  http_client& operator=(const http_client&) = delete;

  const http_options& options() const noexcept { return opt_; }
  http_stats& stats() noexcept { return stats_; }

  /// Sends req and reads the whole answer into memory, retrying as the top of the file says
  /// and following redirects for GET and HEAD. sign(req) is applied before every attempt.
  /// The caller judges the final status (a 404 comes back as a response, not an error).
  http_response send(http_request req, request_signer sign = {});

  /// Reads bytes [off, off + dst.size()) of the object at url (whose size is total) into dst,
  /// as the top of the file says. errc::not_found for a 404, errc::truncated for a 416; with a
  /// validator, errc::io_error "changed while reading" for a 412 or an answer of another ETag.
  void read_range(const url_parts& url, std::uint64_t off, std::span<std::byte> dst, std::uint64_t total,
                  request_signer sign = {}, const object_validator& validator = {});

  /// read_range of every part, as many at once as there are free request slots (at least one;
  /// at most requests_in_flight): the requests of a batch are coroutines on at most
  /// default_threads() threads (the calling thread and the shared pool's), each thread running
  /// its own lane, so a batch costs no thread per request. The first error stops parts from
  /// starting and is thrown once the parts under way have ended.
  void read_ranges(const url_parts& url, std::span<const read_request> parts, std::uint64_t total,
                   request_signer sign = {}, const object_validator& validator = {});

 private:
  static http_options normalized(http_options o) {
    if (o.max_attempts == 0) o.max_attempts = 1;
    if (o.part_bytes == 0) o.part_bytes = std::uint64_t(8) << 20;
    o.requests_in_flight = std::clamp(o.requests_in_flight, 1u, 1024u);
    return o;
  }

  task<http_response> send_on(http_lane& lane, http_request req, request_signer sign);
  task<void> read_range_on(http_lane& lane, const url_parts& url, std::uint64_t off, std::span<std::byte> dst,
                           std::uint64_t total, request_signer sign, const object_validator& validator);

  /// Runs attempt(req, failure) until it gives an answer, throws, or attempts run out; the
  /// backoff between attempts is a timer on the lane (other requests of the lane go on).
  template <class T, class Attempt, class OnGiveUp>
  task<T> with_retries(http_request& req, Attempt&& attempt, OnGiveUp&& on_give_up) {
    unsigned attempts = 0, free_retries = 0;
    attempt_failure f;
    if (req.deadline == std::chrono::steady_clock::time_point{})
      req.deadline = std::chrono::steady_clock::now() + opt_.operation_timeout;
    const std::string within = "within the operation's " + seconds_of(opt_.operation_timeout) + " (http_options::operation_timeout)";
    for (;;) {
      f = {};
      auto r = co_await attempt(req, f);
      if (r) co_return std::move(*r);
      if (f.next == next_step::stop) throw error(errc::io_error, req.url.str() + ": " + f.why);
      const auto now = std::chrono::steady_clock::now();
      if (now >= req.deadline)
        throw error(errc::io_error, req.url.str() + ": no complete answer " + within + "; waiting for: " + f.why);
      if (f.next == next_step::follow) continue;
      if (f.next == next_step::reconnect && free_retries < 64) {
        ++free_retries;
        continue;
      }
      if (++attempts >= opt_.max_attempts) {
        // a 5xx/429 that persisted: the last answer goes back for the caller to judge
        if (std::optional<T> last = on_give_up()) co_return std::move(*last);
        throw error(errc::io_error, req.url.str() + ": giving up after " + std::to_string(attempts) +
                                        " attempts; last: " + f.why);
      }
      ++stats_.retries;
      const std::chrono::milliseconds pause = backoff(attempts, f.retry_after);
      if (now + pause > req.deadline)
        throw error(errc::io_error, req.url.str() + ": " +
                                        (f.retry_after ? "the server asks to be retried after " + seconds_of(*f.retry_after)
                                                       : "the next retry would come after " + seconds_of(pause)) +
                                        ", past the deadline " + within + "; last: " + f.why);
      net::steady_timer wait(co_await net::this_coro::executor);
      wait.expires_after(pause);
      boost::system::error_code ec;
      co_await wait.async_wait(into(ec));
    }
  }

  std::chrono::milliseconds backoff(unsigned attempt, std::optional<std::chrono::milliseconds> retry_after) const {
    thread_local std::minstd_rand rng(std::random_device{}());
    double ms = double(opt_.backoff_initial.count());
    for (unsigned i = 1; i < attempt && ms < double(opt_.backoff_max.count()); ++i) ms *= 2;
    ms = std::min(ms, double(opt_.backoff_max.count()));
    ms *= 0.5 + 0.5 * std::uniform_real_distribution<double>(0, 1)(rng);
    if (retry_after) ms = std::max(ms, double(std::min(*retry_after, opt_.retry_after_max).count()));
    return std::chrono::milliseconds(static_cast<std::int64_t>(ms));
  }

  /// Whole seconds, for messages.
  static std::string seconds_of(std::chrono::milliseconds d) {
    return std::to_string(d.count() / 1000) + (d.count() % 1000 ? "." + std::to_string(d.count() % 1000 / 100) : "") + " s";
  }

  /// Refuses a redirect that leaves HTTP(S) (`Location: s3://...` is never fetched as HTTP).
  static void require_http_redirect(const url_parts& from, const url_parts& to) {
    if (to.scheme != "http" && to.scheme != "https")
      throw error(errc::io_error, from.str() + ": redirected to " + to.str() + ", which is not http:// or https://; not followed");
  }

  http_options opt_;
  http_stats stats_;
  http_pool pool_;
  http_wire wire_;
};

#if SHARDSAFE_REMOTE_DEFINE
SHARDSAFE_DECL http_client::http_client(http_options o)
    : opt_(normalized(std::move(o))), pool_(opt_, stats_), wire_(pool_, opt_, stats_) {}

SHARDSAFE_DECL http_client::~http_client() = default;

SHARDSAFE_DECL http_response http_client::send(http_request req, request_signer sign) {
  http_pool::slot_guard slot(pool_.slots());
  http_pool::lane_lease lane(pool_);
  return http_pool::run_on(*lane, [&]() -> task<http_response> { co_return co_await send_on(*lane, std::move(req), sign); });
}

SHARDSAFE_DECL void http_client::read_range(const url_parts& url, std::uint64_t off, std::span<std::byte> dst,
                                            std::uint64_t total, request_signer sign, const object_validator& validator) {
  if (dst.empty()) return;
  http_pool::slot_guard slot(pool_.slots());
  http_pool::lane_lease lane(pool_);
  http_pool::run_on(*lane, [&]() -> task<bool> {
    co_await read_range_on(*lane, url, off, dst, total, sign, validator);
    co_return true;
  });
}

SHARDSAFE_DECL void http_client::read_ranges(const url_parts& url, std::span<const read_request> parts, std::uint64_t total,
                                             request_signer sign, const object_validator& validator) {
  const std::size_t n = parts.size();
  if (n == 0) return;
  http_pool::slot_guard slots(pool_.slots());
  const unsigned held = slots.take_free(static_cast<unsigned>(std::min<std::size_t>(n, opt_.requests_in_flight)));
  const unsigned threads = std::min(held, default_threads());
  std::vector<http_pool::lane_lease> lanes;
  lanes.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) lanes.emplace_back(pool_);
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr first_error;
  parallel_for(threads, threads, [&](std::size_t t) {
    http_lane& lane = *lanes[t];
    for (unsigned w = static_cast<unsigned>(t); w < held; w += threads)
      net::co_spawn(
          lane.ioc,
          [&]() -> task<void> {
            for (;;) {
              if (failed.load()) co_return;
              const std::size_t i = next.fetch_add(1);
              if (i >= n) co_return;
              const read_request& part = parts[i];
              co_await read_range_on(lane, url, part.offset, part.dst, total, sign, validator);
            }
          },
          [&](std::exception_ptr e) {
            if (!e) return;
            failed = true;
            std::lock_guard lock(error_mutex);
            if (!first_error) first_error = e;
          });
    lane.ioc.restart();
    lane.ioc.run();
  });
  if (first_error) std::rethrow_exception(first_error);
}

SHARDSAFE_DECL task<http_response> http_client::send_on(http_lane& lane, http_request req, request_signer sign) {
  unsigned redirects = 0;
  std::optional<http_response> last;
  co_return co_await with_retries<http_response>(
      req,
      [&](http_request& r, attempt_failure& f) -> task<std::optional<http_response>> {
        last.reset();
        http_request signed_req = r;
        sign(signed_req);
        std::optional<http_response> resp = co_await wire_.exchange_whole(lane, signed_req, f);
        if (!resp) co_return std::nullopt;
        if (http_wire::is_redirect(resp->status) && (r.method == bhttp::verb::get || r.method == bhttp::verb::head)) {
          auto loc = resp->header("Location");
          if (!loc) co_return resp;
          if (++redirects > opt_.max_redirects)
            throw error(errc::io_error, req.url.str() + ": more than " + std::to_string(opt_.max_redirects) + " redirects");
          const url_parts to = resolve_location(r.url, *loc);
          require_http_redirect(r.url, to);
          r.url = to;
          f = {next_step::follow, "redirect", std::nullopt};
          co_return std::nullopt;
        }
        if (resp->status >= 500 || resp->status == 429) {
          f = {next_step::retry, "HTTP " + std::to_string(resp->status) + http_wire::excerpt(resp->body), std::nullopt};
          if (auto ra = resp->header("Retry-After")) f.retry_after = parse_retry_after(*ra);
          last = std::move(resp);
          co_return std::nullopt;
        }
        co_return resp;
      },
      [&] { return std::move(last); });
}

SHARDSAFE_DECL task<void> http_client::read_range_on(http_lane& lane, const url_parts& url, std::uint64_t off,
                                                     std::span<std::byte> dst, std::uint64_t total, request_signer sign,
                                                     const object_validator& validator) {
  if (dst.empty()) co_return;
  std::uint64_t got = 0;
  http_request req;
  req.method = bhttp::verb::get;
  req.url = url;
  unsigned redirects = 0;
  co_await with_retries<bool>(
      req,
      [&](http_request& r, attempt_failure& f) -> task<std::optional<bool>> {
        http_request a = r;
        a.headers.emplace_back("Range", "bytes=" + std::to_string(off + got) + "-" + std::to_string(off + dst.size() - 1));
        if (!validator.etag.empty()) a.headers.emplace_back("If-Match", validator.etag);
        else if (!validator.last_modified.empty()) a.headers.emplace_back("If-Unmodified-Since", validator.last_modified);
        sign(a);
        std::optional<url_parts> moved;
        const bool done = co_await wire_.exchange_range(lane, a, off, dst, total, got, f, moved, validator);
        if (moved) {
          require_http_redirect(r.url, *moved);
          if (++redirects > opt_.max_redirects)
            throw error(errc::io_error, url.str() + ": more than " + std::to_string(opt_.max_redirects) + " redirects");
          r.url = *moved;
          f = {next_step::follow, "redirect", std::nullopt};
          co_return std::nullopt;
        }
        if (!done) co_return std::nullopt;
        co_return true;
      },
      [] { return std::optional<bool>(); });
}
#endif  // SHARDSAFE_REMOTE_DEFINE

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
