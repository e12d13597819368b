// shardsafe/storage/detail/http_engine.hpp - the mechanism under the HTTP client (storage/detail/
// http_client.hpp, whose top tells the rules): its pool of connections and lanes
// (storage/detail/http_pool.hpp), the attempts of an exchange (storage/detail/http_exchange.hpp),
// and here the retries, the redirects and the blocking calls that run the coroutines. Only a unit
// that defines the client includes it (header-only, every unit that uses the client; separately
// compiled, the remote unit alone: shardsafe/compiled_remote.hpp), so that the other units of a
// separately compiled program never parse Boost.Asio or Beast's streams and parsers.
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

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/http_exchange.hpp"
#include "shardsafe/storage/detail/http_fields.hpp"
#include "shardsafe/storage/detail/http_message.hpp"
#include "shardsafe/storage/detail/http_pool.hpp"
#include "shardsafe/storage/http_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

/// What an http_client does, behind its declarations: the client holds one, made with the
/// client's (normalized) options and statistics, which outlive it.
class http_engine {
 public:
  http_engine(const http_options& opt, http_stats& stats)
      : opt_(opt), stats_(stats), pool_(opt_, stats_), wire_(pool_, opt_, stats_) {}
  http_engine(const http_engine&) = delete;
  http_engine& operator=(const http_engine&) = delete;

  http_response send(http_request req, request_signer sign);
  void read_range(const url_parts& url, std::uint64_t off, std::span<std::byte> dst, std::uint64_t total,
                  request_signer sign, const object_validator& validator);
  void read_ranges(const url_parts& url, std::span<const read_request> parts, std::uint64_t total, request_signer sign,
                   const object_validator& validator);

 private:
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
    const std::string within =
        "within the operation's " + seconds_of(opt_.operation_timeout) + " (http_options::operation_timeout)";
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
        throw error(errc::io_error,
                    req.url.str() + ": giving up after " + std::to_string(attempts) + " attempts; last: " + f.why);
      }
      ++stats_.retries;
      const std::chrono::milliseconds pause = backoff(attempts, f.retry_after);
      if (now + pause > req.deadline)
        throw error(errc::io_error,
                    req.url.str() + ": " +
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
    return std::to_string(d.count() / 1000) + (d.count() % 1000 ? "." + std::to_string(d.count() % 1000 / 100) : "") +
           " s";
  }

  /// Points the attempt r at the redirect's target `to` and has it made again at once. Refuses a
  /// target outside HTTP(S) (`Location: s3://...` is never fetched as HTTP), then a redirect past
  /// max_redirects, counted in `redirects` over the whole request that began at `origin`.
  void follow_redirect(const url_parts& origin, http_request& r, const url_parts& to, unsigned& redirects,
                       attempt_failure& f) const {
    if (to.scheme != "http" && to.scheme != "https")
      throw error(errc::io_error,
                  r.url.str() + ": redirected to " + to.str() + ", which is not http:// or https://; not followed");
    if (++redirects > opt_.max_redirects)
      throw error(errc::io_error, origin.str() + ": more than " + std::to_string(opt_.max_redirects) +
                                      " redirects (http_options::max_redirects); the last to " + to.str());
    r.url = to;
    f = {next_step::follow, "redirect", std::nullopt};
  }

  const http_options& opt_;
  http_stats& stats_;
  http_pool pool_;
  http_wire wire_;
};

inline http_response http_engine::send(http_request req, request_signer sign) {
  http_pool::slot_guard slot(pool_.slots());
  http_pool::lane_lease lane(pool_);
  return http_pool::run_on(*lane,
                           [&]() -> task<http_response> { co_return co_await send_on(*lane, std::move(req), sign); });
}

inline void http_engine::read_range(const url_parts& url, std::uint64_t off, std::span<std::byte> dst,
                                    std::uint64_t total, request_signer sign, const object_validator& validator) {
  if (dst.empty()) return;
  http_pool::slot_guard slot(pool_.slots());
  http_pool::lane_lease lane(pool_);
  http_pool::run_on(*lane, [&]() -> task<bool> {
    co_await read_range_on(*lane, url, off, dst, total, sign, validator);
    co_return true;
  });
}

inline void http_engine::read_ranges(const url_parts& url, std::span<const read_request> parts, std::uint64_t total,
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

inline task<http_response> http_engine::send_on(http_lane& lane, http_request req, request_signer sign) {
  const url_parts origin = req.url;  // req follows the redirects
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
          follow_redirect(origin, r, resolve_location(r.url, *loc), redirects, f);
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

inline task<void> http_engine::read_range_on(http_lane& lane, const url_parts& url, std::uint64_t off,
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
        a.headers.emplace_back("Range",
                               "bytes=" + std::to_string(off + got) + "-" + std::to_string(off + dst.size() - 1));
        if (!validator.etag.empty())
          a.headers.emplace_back("If-Match", validator.etag);
        else if (!validator.last_modified.empty())
          a.headers.emplace_back("If-Unmodified-Since", validator.last_modified);
        sign(a);
        std::optional<url_parts> moved;
        const bool done = co_await wire_.exchange_range(lane, a, off, dst, total, got, f, moved, validator);
        if (moved) {
          follow_redirect(url, r, *moved, redirects, f);
          co_return std::nullopt;
        }
        if (!done) co_return std::nullopt;
        co_return true;
      },
      [] { return std::optional<bool>(); });
}
}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
