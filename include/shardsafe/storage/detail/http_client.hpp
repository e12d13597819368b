// shardsafe/storage/detail/http_client.hpp - the HTTP/1.1 client under the http and s3
// backends (Boost.Beast over Boost.Asio; TLS through OpenSSL when SHARDSAFE_HTTP_TLS is 1).
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
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <semaphore>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "shardsafe/storage/detail/asio_config.hpp"  // before any Boost.Asio header

#include <boost/asio/awaitable.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/span_body.hpp>
#include <boost/beast/http/write.hpp>

#ifndef SHARDSAFE_HTTP_TLS
#define SHARDSAFE_HTTP_TLS 0
#endif
#if SHARDSAFE_HTTP_TLS
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/ssl/host_name_verification.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#endif

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/detail/url.hpp"

namespace shardsafe {

/// Where connections for a host go instead of where its name resolves to, as curl's
/// --connect-to HOST:PORT:TO_HOST:TO_PORT: requests keep the URL's host (the Host header, TLS's
/// server name and certificate check, the S3 signature), only the TCP connection goes elsewhere.
/// For pinning an endpoint's address, and for names that do not resolve (BUCKET.localhost).
struct connect_to_rule {
  std::string host;           ///< the URL host this applies to (case-insensitive; IPv6 without brackets)
  std::uint16_t port = 0;     ///< the URL port this applies to; 0: any
  std::string to_host;        ///< where to connect: a name or an address
  std::uint16_t to_port = 0;  ///< 0: the URL's port
};

/// How the remote backends talk HTTP. The defaults suit a data-centre object store.
struct http_options {
  std::chrono::milliseconds connect_timeout{10'000};  ///< TCP connect plus TLS handshake
  std::chrono::milliseconds read_timeout{30'000};     ///< each send, header read, and body read of up to 1 MiB
  unsigned max_attempts = 5;                          ///< tries of one request in all (>= 1)
  std::chrono::milliseconds backoff_initial{200};     ///< first retry waits this, times [0.5, 1) jitter
  std::chrono::milliseconds backoff_max{10'000};      ///< the doubling stops here
  std::chrono::milliseconds retry_after_max{60'000};  ///< a longer Retry-After is cut to this
  /// One request in all (every attempt, backoff and redirect of it) ends within this, or is an
  /// error naming its URL and what was waited for; an S3 listing, all its pages, the same.
  std::chrono::milliseconds operation_timeout{20'000};
  unsigned max_redirects = 5;                         ///< 301/302/303/307/308 followed for GET and HEAD
  unsigned requests_in_flight = 16;                   ///< per client (shared by copies of a directory)
  std::uint64_t part_bytes = std::uint64_t(8) << 20;  ///< read_batch splits longer reads into parts
  std::size_t max_response_body = std::size_t(16) << 20;  ///< bodies read into memory (errors, XML)
  std::string ca_file;        ///< PEM file of CAs to trust (HTTPS); empty: the system's store
  bool verify_peer = true;    ///< check the server's certificate and host name (HTTPS)
  std::vector<connect_to_rule> connect_to;  ///< the first rule that matches a URL's host and port
};

/// Counters of one client, for tests and benchmarks.
struct http_stats {
  std::atomic<std::uint64_t> requests{0};        ///< requests sent (retries included)
  std::atomic<std::uint64_t> body_bytes{0};      ///< response body bytes received
  std::atomic<std::uint64_t> retries{0};         ///< attempts after a failed one
  std::atomic<std::uint64_t> connections{0};     ///< connections opened
};

namespace detail {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;

/// A request as the backends build it; the body is the caller's memory.
struct http_request {
  bhttp::verb method = bhttp::verb::get;
  /// When the request (all its attempts) must be done; set by the first attempt from
  /// http_options::operation_timeout.
  std::chrono::steady_clock::time_point deadline{};
  url_parts url;
  std::vector<std::pair<std::string, std::string>> headers;
  std::span<const std::byte> body;
};

/// A response read whole into memory (bounded by max_response_body).
struct http_response {
  unsigned status = 0;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  url_parts url;  ///< the URL that answered (after redirects)

  std::optional<std::string> header(std::string_view name) const {
    for (const auto& [k, v] : headers)
      if (k.size() == name.size() && std::equal(k.begin(), k.end(), name.begin(), [](char a, char b) {
            return ascii_lower(a) == ascii_lower(b);
          }))
        return v;
    return std::nullopt;
  }
};

/// Beast's string_view (boost::string_view in 1.74) as a std::string_view.
inline std::string_view sv(boost::beast::string_view s) noexcept { return {s.data(), s.size()}; }

/// Signs nothing: the plain HTTP backend's request hook.
struct no_signing {
  void operator()(http_request&) const noexcept {}
};

/// Parses "bytes FIRST-LAST/TOTAL" (TOTAL may be '*'); false if it is not that.
inline bool parse_content_range(std::string_view v, std::uint64_t& first, std::uint64_t& last,
                                std::optional<std::uint64_t>& total) {
  auto number = [](std::string_view& s, std::uint64_t& out) {
    if (s.empty() || s.size() > 19) return false;
    std::size_t i = 0;
    out = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') out = out * 10 + std::uint64_t(s[i++] - '0');
    if (i == 0) return false;
    s.remove_prefix(i);
    return true;
  };
  if (!v.starts_with("bytes ")) return false;
  v.remove_prefix(6);
  if (v.starts_with("*/")) return false;  // unsatisfied-range form
  const std::size_t dash = v.find('-'), slash = v.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || dash > slash) return false;
  std::string_view a = v.substr(0, dash), b = v.substr(dash + 1, slash - dash - 1), t = v.substr(slash + 1);
  if (!number(a, first) || !a.empty() || !number(b, last) || !b.empty() || last < first) return false;
  if (t == "*") {
    total.reset();
    return true;
  }
  std::uint64_t tt = 0;
  if (!number(t, tt) || !t.empty() || last >= tt) return false;
  total = tt;
  return true;
}

/// An HTTP-date (RFC 9110 §5.6.7) as seconds since 1970-01-01 UTC: the IMF-fixdate form
/// "Sun, 06 Nov 1994 08:49:37 GMT", and the obsolete RFC 850 ("Sunday, 06-Nov-94 08:49:37 GMT")
/// and asctime ("Sun Nov  6 08:49:37 1994") forms a recipient must accept; nothing otherwise.
inline std::optional<std::int64_t> parse_http_date(std::string_view v) {
  static constexpr std::string_view months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                                "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  auto num = [](std::string_view s, std::size_t digits, int& out) {
    if (s.size() != digits) return false;
    out = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      out = out * 10 + (c - '0');
    }
    return true;
  };
  auto month = [&](std::string_view m, int& out) {
    for (int i = 0; i < 12; ++i)
      if (m == months[i]) return out = i + 1, true;
    return false;
  };
  auto alpha = [](std::string_view s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); });
  };
  std::vector<std::string_view> w;  // the words, runs of spaces collapsed (asctime pads the day)
  for (std::size_t i = 0; i < v.size();) {
    if (v[i] == ' ') { ++i; continue; }
    const std::size_t j = std::min(v.find(' ', i), v.size());
    w.push_back(v.substr(i, j - i));
    i = j;
  }
  int y = 0, mo = 0, d = 0;
  std::string_view time;
  if (w.size() == 6 && w[0].size() == 4 && w[0][3] == ',' && alpha(w[0].substr(0, 3)) && w[5] == "GMT") {
    if (!num(w[1], 2, d) || !month(w[2], mo) || !num(w[3], 4, y)) return std::nullopt;
    time = w[4];
  } else if (w.size() == 4 && w[0].size() > 1 && w[0].back() == ',' && alpha(w[0].substr(0, w[0].size() - 1)) && w[3] == "GMT") {
    const std::string_view dmy = w[1];  // 06-Nov-94
    if (dmy.size() != 9 || dmy[2] != '-' || dmy[6] != '-' || !num(dmy.substr(0, 2), 2, d) || !month(dmy.substr(3, 3), mo) ||
        !num(dmy.substr(7, 2), 2, y))
      return std::nullopt;
    y += y < 70 ? 2000 : 1900;  // two-digit years: the nearest century past 1970
    time = w[2];
  } else if (w.size() == 5 && w[0].size() == 3 && alpha(w[0])) {
    if (!month(w[1], mo) || !(num(w[2], 1, d) || num(w[2], 2, d)) || !num(w[4], 4, y)) return std::nullopt;
    time = w[3];
  } else {
    return std::nullopt;
  }
  int h = 0, mi = 0, s = 0;
  if (time.size() != 8 || time[2] != ':' || time[5] != ':' || !num(time.substr(0, 2), 2, h) ||
      !num(time.substr(3, 2), 2, mi) || !num(time.substr(6, 2), 2, s) || h > 23 || mi > 59 || s > 60)
    return std::nullopt;
  static constexpr int mdays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  if (y < 1970 || d < 1 || d > mdays[mo - 1] || (mo == 2 && d == 29 && !leap)) return std::nullopt;
  // days from 1970-01-01 to y-mo-d (the civil-from-days algorithm run backwards)
  const std::int64_t yy = y - (mo <= 2), era = yy / 400, yoe = yy - era * 400;
  const std::int64_t doy = (153 * (mo + (mo > 2 ? -3 : 9)) + 2) / 5 + d - 1, doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  const std::int64_t days = era * 146097 + doe - 719468;
  return days * 86400 + h * 3600 + mi * 60 + s;
}

/// Retry-After (RFC 9110 §10.2.3): delta-seconds, or an HTTP-date taken as the wait from now
/// until then (zero for a date already past). Junk gives nothing, and the backoff applies.
inline std::optional<std::chrono::milliseconds> parse_retry_after(
    std::string_view v, std::chrono::system_clock::time_point now = std::chrono::system_clock::now()) {
  if (v.empty()) return std::nullopt;
  if (v[0] >= '0' && v[0] <= '9') {
    if (v.size() > 9) return std::nullopt;
    std::uint64_t s = 0;
    for (char c : v) {
      if (c < '0' || c > '9') return std::nullopt;
      s = s * 10 + std::uint64_t(c - '0');
    }
    return std::chrono::milliseconds(s * 1000);
  }
  const auto at = parse_http_date(v);
  if (!at) return std::nullopt;
  const auto wait = std::chrono::sys_seconds(std::chrono::seconds(*at)) - now;
  return std::max(std::chrono::milliseconds(0), std::chrono::ceil<std::chrono::milliseconds>(wait));
}

/// What a range read checks that the object is still the one that was opened: its strong
/// ETag, sent as If-Match and compared with the ETag of every answer; or, when the server gave
/// none (or a weak one), its Last-Modified, sent as If-Unmodified-Since. Empty: no check.
struct object_validator {
  std::string etag;           ///< a strong ETag, quotes included
  std::string last_modified;  ///< an HTTP-date
  bool empty() const noexcept { return etag.empty() && last_modified.empty(); }
};

/// A coroutine of the client (Asio's awaitable, on a lane's io_context).
template <class T>
using task = net::awaitable<T>;

/// One kept-alive connection, bound to the io_context of the lane that opened it.
struct http_connection {
#if SHARDSAFE_HTTP_TLS
  std::variant<beast::tcp_stream, beast::ssl_stream<beast::tcp_stream>> stream;
  http_connection(net::io_context& ioc, bool tls, net::ssl::context* ctx)
      : stream(tls ? decltype(stream)(std::in_place_index<1>, ioc, *ctx) : decltype(stream)(std::in_place_index<0>, ioc)) {}
#else
  std::variant<beast::tcp_stream> stream;
  http_connection(net::io_context& ioc, bool, void*) : stream(std::in_place_index<0>, ioc) {}
#endif
  /// Beast reads at most min(64 KiB, free capacity) per socket read into this buffer; reserved
  /// up front, or every read of a large body would be a few hundred bytes (one event-loop
  /// round each: loads ran at tens of MB/s before this).
  beast::flat_buffer buffer = [] {
    beast::flat_buffer b;
    b.reserve(std::size_t(256) << 10);
    return b;
  }();
  std::string origin;
  bool reused = false;
  std::chrono::steady_clock::time_point deadline{};  ///< of the request it serves now

  beast::tcp_stream& tcp() { return std::visit([](auto& s) -> beast::tcp_stream& { return beast::get_lowest_layer(s); }, stream); }
};

/// An io_context with the idle connections bound to it. One thread at a time runs a lane
/// (a blocking call on the calling thread, or one thread of a batch for the batch's
/// coroutines), so its pool needs no lock.
struct http_lane {
  net::io_context ioc{1};
  std::map<std::string, std::vector<std::unique_ptr<http_connection>>> idle;
};

/// The outcome of one attempt, when it is not a final answer.
struct attempt_failure {
  bool retry = true;                                   ///< worth another attempt
  std::string why;                                     ///< for the final message
  std::optional<std::chrono::milliseconds> retry_after;
  bool before_response = false;                        ///< failed before any response byte arrived
};

class http_client {
 public:
  explicit http_client(http_options o = {})
      : opt_(std::move(o)), slots_(static_cast<std::ptrdiff_t>(std::clamp(opt_.requests_in_flight, 1u, 1024u))) {
    if (opt_.max_attempts == 0) opt_.max_attempts = 1;
    if (opt_.part_bytes == 0) opt_.part_bytes = std::uint64_t(8) << 20;
    opt_.requests_in_flight = std::clamp(opt_.requests_in_flight, 1u, 1024u);
#if SHARDSAFE_HTTP_TLS
    tls_ = std::make_unique<net::ssl::context>(net::ssl::context::tls_client);
    tls_->set_verify_mode(opt_.verify_peer ? net::ssl::verify_peer : net::ssl::verify_none);
    boost::system::error_code ec;
    if (!opt_.ca_file.empty()) {
      tls_->load_verify_file(opt_.ca_file, ec);
      if (ec) throw error(errc::invalid_argument, opt_.ca_file + ": cannot load CA file: " + ec.message());
    } else {
      tls_->set_default_verify_paths(ec);
    }
#endif
  }
  http_client(const http_client&) = delete;
  http_client& operator=(const http_client&) = delete;

  const http_options& options() const noexcept { return opt_; }
  http_stats& stats() noexcept { return stats_; }

  /// Sends req and reads the whole answer into memory, retrying as the top of the file says
  /// and following redirects for GET and HEAD. sign(req) is applied before every attempt.
  /// The caller judges the final status (a 404 comes back as a response, not an error).
  template <class Sign = no_signing>
  http_response send(http_request req, const Sign& sign = {}) {
    slot_guard slot(slots_);
    lane_lease lane(*this);
    return run_on(*lane, [&]() -> task<http_response> { co_return co_await send_on(*lane, std::move(req), sign); });
  }

  /// Reads bytes [off, off + dst.size()) of the object at url (whose size is total) into dst,
  /// as the top of the file says. errc::not_found for a 404, errc::truncated for a 416; with a
  /// validator, errc::io_error "changed while reading" for a 412 or an answer of another ETag.
  template <class Sign = no_signing>
  void read_range(const url_parts& url, std::uint64_t off, std::span<std::byte> dst, std::uint64_t total,
                  const Sign& sign = {}, const object_validator& validator = {}) {
    if (dst.empty()) return;
    slot_guard slot(slots_);
    lane_lease lane(*this);
    run_on(*lane, [&]() -> task<bool> {
      co_await read_range_on(*lane, url, off, dst, total, sign, validator);
      co_return true;
    });
  }

  /// read_range of every part (each with .offset and .dst), as many at once as there are free
  /// request slots (at least one; at most requests_in_flight): the requests of a batch are
  /// coroutines on at most default_threads() threads (the calling thread and the shared pool's),
  /// each thread running its own lane, so a batch costs no thread per request. The first error
  /// stops parts from starting and is thrown once the parts under way have ended.
  template <class Sign = no_signing, class Parts>
  void read_ranges(const url_parts& url, const Parts& parts, std::uint64_t total, const Sign& sign = {},
                   const object_validator& validator = {}) {
    const std::size_t n = std::size(parts);
    if (n == 0) return;
    slot_guard slots(slots_);
    const unsigned held = slots.take_free(static_cast<unsigned>(std::min<std::size_t>(n, opt_.requests_in_flight)));
    const unsigned threads = std::min(held, default_threads());
    std::vector<lane_lease> lanes;
    lanes.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) lanes.emplace_back(*this);
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
                const auto& part = parts[i];
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

 private:
  // Completion token: the error into ec, not thrown (defined before any use: clang wants a deduced
  // return type seen first)
  static auto into(boost::system::error_code& ec) { return net::redirect_error(net::use_awaitable, ec); }

  static bool is_redirect(unsigned s) { return s == 301 || s == 302 || s == 303 || s == 307 || s == 308; }
  static std::string excerpt(const std::string& body) {
    if (body.empty()) return "";
    std::string e = body.substr(0, 200);
    for (char& c : e)
      if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    return ": " + e + (body.size() > 200 ? "..." : "");
  }

  // --- lanes -----------------------------------------------------------------------------

  /// A lane taken from the client's free ones (or a new one) for as long as it lives.
  struct lane_lease {
    http_client* c;
    std::unique_ptr<http_lane> l;
    explicit lane_lease(http_client& client) : c(&client) {
      std::lock_guard lock(c->lanes_mutex_);
      if (!c->free_lanes_.empty()) {
        l = std::move(c->free_lanes_.back());
        c->free_lanes_.pop_back();
      } else {
        l = std::make_unique<http_lane>();
      }
    }
    lane_lease(lane_lease&& o) noexcept : c(o.c), l(std::move(o.l)) {}
    lane_lease(const lane_lease&) = delete;
    ~lane_lease() {
      if (!l) return;
      std::lock_guard lock(c->lanes_mutex_);
      c->free_lanes_.push_back(std::move(l));
    }
    http_lane& operator*() const noexcept { return *l; }
  };

  /// Runs the coroutine f() on lane's io_context on the calling thread until it ends; its
  /// value, or its exception rethrown.
  template <class F>
  static auto run_on(http_lane& lane, F&& f) {
    using T = typename decltype(f())::value_type;
    std::exception_ptr ex;
    std::optional<T> out;
    net::co_spawn(lane.ioc, std::forward<F>(f), [&](std::exception_ptr e, T v) {
      ex = e;
      if (!e) out.emplace(std::move(v));
    });
    lane.ioc.restart();
    lane.ioc.run();
    if (ex) std::rethrow_exception(ex);
    return std::move(*out);
  }

  template <class Sign>
  task<http_response> send_on(http_lane& lane, http_request req, const Sign& sign) {
    unsigned redirects = 0;
    std::optional<http_response> last;
    co_return co_await with_retries<http_response>(
        req,
        [&](http_request& r, attempt_failure& f) -> task<std::optional<http_response>> {
          last.reset();
          http_request signed_req = r;
          sign(signed_req);
          std::optional<http_response> resp = co_await exchange_whole(lane, signed_req, f);
          if (!resp) co_return std::nullopt;
          if (is_redirect(resp->status) && (r.method == bhttp::verb::get || r.method == bhttp::verb::head)) {
            auto loc = resp->header("Location");
            if (!loc) co_return resp;
            if (++redirects > opt_.max_redirects)
              throw error(errc::io_error, req.url.str() + ": more than " + std::to_string(opt_.max_redirects) + " redirects");
            const url_parts to = resolve_location(r.url, *loc);
            require_http_redirect(r.url, to);
            r.url = to;
            f = {true, "redirect", std::nullopt, true};
            f.retry_after = std::chrono::milliseconds(-1);  // marks: go again at once, no attempt used
            co_return std::nullopt;
          }
          if (resp->status >= 500 || resp->status == 429) {
            f.retry = true;
            f.why = "HTTP " + std::to_string(resp->status) + excerpt(resp->body);
            if (auto ra = resp->header("Retry-After")) f.retry_after = parse_retry_after(*ra);
            f.before_response = false;
            last = std::move(resp);
            co_return std::nullopt;
          }
          co_return resp;
        },
        [&] { return std::move(last); });
  }

  template <class Sign>
  task<void> read_range_on(http_lane& lane, const url_parts& url, std::uint64_t off, std::span<std::byte> dst,
                           std::uint64_t total, const Sign& sign, const object_validator& validator) {
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
          const bool done = co_await exchange_range(lane, a, off, dst, total, got, f, moved, validator);
          if (moved) {
            require_http_redirect(r.url, *moved);
            if (++redirects > opt_.max_redirects)
              throw error(errc::io_error, url.str() + ": more than " + std::to_string(opt_.max_redirects) + " redirects");
            r.url = *moved;
            f = {true, "redirect", std::chrono::milliseconds(-1), true};
            co_return std::nullopt;
          }
          if (!done) co_return std::nullopt;
          co_return true;
        },
        [] { return std::optional<bool>(); });
  }

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
      if (!f.retry) throw error(errc::io_error, req.url.str() + ": " + f.why);
      const auto now = std::chrono::steady_clock::now();
      if (now >= req.deadline)
        throw error(errc::io_error, req.url.str() + ": no complete answer " + within + "; waiting for: " + f.why);
      if (f.retry_after && f.retry_after->count() < 0) continue;  // a redirect
      if (f.before_response && f.why.find("[reused]") != std::string::npos && free_retries < 64) {
        ++free_retries;  // a pooled connection the server had closed
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

  // --- connections ---------------------------------------------------------------------

  /// An operation on c's stream (TCP or TLS): op(stream) gives the awaitable to wait for.
  template <class Op>
  static auto on_stream(http_connection& c, Op&& op) {
    return std::visit([&](auto& s) { return op(s); }, c.stream);
  }

  /// Sets c's socket deadline: `d` from now, but never past the request's own deadline.
  static void arm(http_connection& c, std::chrono::steady_clock::duration d) {
    auto at = std::chrono::steady_clock::now() + d;
    if (c.deadline != std::chrono::steady_clock::time_point{} && c.deadline < at) at = c.deadline;
    c.tcp().expires_at(at);
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

  task<std::unique_ptr<http_connection>> take(http_lane& lane, const url_parts& u, attempt_failure& f,
                                              std::chrono::steady_clock::time_point deadline) {
    const std::string origin = u.origin();
    if (auto& v = lane.idle[origin]; !v.empty()) {
      auto c = std::move(v.back());
      v.pop_back();
      --idle_count_;
      c->reused = true;
      c->deadline = deadline;
      co_return c;
    }
#if SHARDSAFE_HTTP_TLS
    auto c = std::make_unique<http_connection>(lane.ioc, u.tls(), tls_.get());
#else
    if (u.tls())
      throw error(errc::invalid_argument, u.str() + ": HTTPS needs TLS, and this build has none (SHARDSAFE_HTTP_TLS=0)");
    auto c = std::make_unique<http_connection>(lane.ioc, false, nullptr);
#endif
    c->origin = origin;
    c->deadline = deadline;
    boost::system::error_code ec;
    std::string host = u.host, via;
    std::uint16_t port = u.port;
    for (const auto& rule : opt_.connect_to)
      if (rule.host.size() == u.host.size() &&
          std::equal(rule.host.begin(), rule.host.end(), u.host.begin(), [](char a, char b) { return ascii_lower(a) == ascii_lower(b); }) &&
          (rule.port == 0 || rule.port == u.port)) {
        host = rule.to_host;
        if (rule.to_port) port = rule.to_port;
        via = " (connect-to " + host + ":" + std::to_string(port) + ")";
        break;
      }
    // resolved on the lane's thread (Asio's asynchronous resolve would start a thread per lane)
    net::ip::tcp::resolver resolver(lane.ioc);
    auto endpoints = resolver.resolve(host, std::to_string(port), ec);
    if (ec) {
      f = {true, "cannot resolve " + host + via + ": " + ec.message(), std::nullopt, true};
      co_return nullptr;
    }
    arm(*c, opt_.connect_timeout);
    co_await c->tcp().async_connect(endpoints, into(ec));
    if (ec) {
      f = {true, "cannot connect to " + u.host_header() + via + ": " + ec.message(), std::nullopt, true};
      co_return nullptr;
    }
    ++stats_.connections;
#if SHARDSAFE_HTTP_TLS
    if (auto* s = std::get_if<1>(&c->stream)) {
      if (!SSL_set_tlsext_host_name(s->native_handle(), u.host.c_str()))
        throw error(errc::io_error, u.str() + ": cannot set the TLS server name");
      if (opt_.verify_peer) s->set_verify_callback(net::ssl::host_name_verification(u.host));
      arm(*c, opt_.connect_timeout);
      co_await s->async_handshake(net::ssl::stream_base::client, into(ec));
      if (ec) {
        // a certificate that does not verify will not verify next time either
        const bool cert = ec.category() == net::error::get_ssl_category();
        f = {!cert, "TLS handshake with " + u.host_header() + " failed: " + ec.message(), std::nullopt, true};
        co_return nullptr;
      }
    }
#endif
    co_return c;
  }

  /// Keeps c for reuse on its lane, unless the client already keeps requests_in_flight idle
  /// connections over all its lanes (then c is closed).
  void give_back(http_lane& lane, std::unique_ptr<http_connection> c) {
    if (idle_count_.fetch_add(1) >= opt_.requests_in_flight) {
      --idle_count_;
      return;
    }
    lane.idle[c->origin].push_back(std::move(c));
  }

  /// Writes the request on c; false (with f filled) on a transport error.
  task<bool> write_request(http_connection& c, const http_request& r, attempt_failure& f) {
    bhttp::request<bhttp::span_body<const char>> m;
    m.method(r.method);
    m.target(r.url.target);
    m.version(11);
    m.set(bhttp::field::host, r.url.host_header());
    m.set(bhttp::field::user_agent, "shardsafe");
    for (const auto& [k, v] : r.headers) m.set(k, v);
    m.body() = std::span<const char>(reinterpret_cast<const char*>(r.body.data()), r.body.size());
    if (!r.body.empty() || r.method == bhttp::verb::put || r.method == bhttp::verb::post)
      m.content_length(r.body.size());
    boost::system::error_code ec;
    arm(c, opt_.read_timeout + std::chrono::milliseconds(r.body.size() / 1024));  // ~1 MB/s floor
    co_await on_stream(c, [&](auto& s) { return bhttp::async_write(s, m, into(ec)); });
    ++stats_.requests;
    if (ec) {
      f = {true, "sending the request failed: " + ec.message() + (c.reused ? " [reused]" : ""), std::nullopt, true};
      co_return false;
    }
    co_return true;
  }

  using parser_t = bhttp::response_parser<bhttp::buffer_body>;

  /// Reads the response header into p; false (with f filled) on a transport or parse error.
  task<bool> read_header(http_connection& c, parser_t& p, attempt_failure& f) {
    boost::system::error_code ec;
    arm(c, opt_.read_timeout);
    co_await on_stream(c, [&](auto& s) { return bhttp::async_read_header(s, c.buffer, p, into(ec)); });
    if (ec) {
      const bool nothing = ec == bhttp::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset;
      f = {true, "reading the response header failed: " + ec.message() + (c.reused && nothing ? " [reused]" : ""),
           std::nullopt, nothing};
      co_return false;
    }
    if (const unsigned v = p.get().version(); v != 10 && v != 11) {  // Beast takes any digit.digit
      f = {true, "reading the response header failed: the answer is HTTP/" + std::to_string(v / 10) + "." +
                     std::to_string(v % 10) + ", not HTTP/1.x", std::nullopt, false};
      co_return false;
    }
    co_return true;
  }

  /// Reads body bytes into [data, data + cap); returns how many landed, with ec set on error.
  task<std::size_t> read_body_some(http_connection& c, parser_t& p, std::byte* data, std::size_t cap,
                             boost::system::error_code& ec) {
    p.get().body().data = data;
    p.get().body().size = cap;
    p.get().body().more = true;
    arm(c, opt_.read_timeout);
    co_await on_stream(c, [&](auto& s) { return bhttp::async_read(s, c.buffer, p, into(ec)); });
    if (ec == bhttp::error::need_buffer) ec = {};
    const std::size_t n = cap - p.get().body().size;
    stats_.body_bytes += n;
    co_return n;
  }

  /// Reads exactly n bytes from c's socket into data (no parser, no copy), as far as it can:
  /// returns how many landed, with ec set if that is fewer than n.
  task<std::size_t> read_raw(http_connection& c, std::byte* data, std::size_t n, boost::system::error_code& ec) {
    arm(c, opt_.read_timeout);
    // each socket read asks for all that is still missing (asio's default would be 64 KiB)
    auto all_missing = [n](const boost::system::error_code& e, std::size_t done) -> std::size_t { return e ? 0 : n - done; };
    const std::size_t k =
        co_await on_stream(c, [&](auto& s) { return net::async_read(s, net::buffer(data, n), all_missing, into(ec)); });
    stats_.body_bytes += k;
    if (!ec && k < n) ec = net::error::eof;
    co_return k;
  }

  static std::vector<std::pair<std::string, std::string>> headers_of(const parser_t& p) {
    std::vector<std::pair<std::string, std::string>> h;
    for (const auto& f : p.get()) h.emplace_back(std::string(f.name_string()), std::string(f.value()));
    return h;
  }

  /// Reads the rest of the body into a string of at most max_response_body bytes.
  task<bool> read_body_string(http_connection& c, parser_t& p, std::string& out, attempt_failure& f) {
    if (auto n = p.content_length(); n && *n > opt_.max_response_body && !p.is_done()) {  // (HEAD: no body)
      f = {false, "Content-Length " + std::to_string(*n) + " is over the " + std::to_string(opt_.max_response_body) +
                      " bytes this client reads into memory", std::nullopt, false};
      co_return false;
    }
    while (!p.is_done()) {
      const std::size_t at = out.size();
      if (at >= opt_.max_response_body) {
        f = {false, "response body over " + std::to_string(opt_.max_response_body) + " bytes", std::nullopt, false};
        co_return false;
      }
      const std::size_t cap = std::min<std::size_t>(64 << 10, opt_.max_response_body - at);
      out.resize(at + cap);
      boost::system::error_code ec;
      const std::size_t n = co_await read_body_some(c, p, reinterpret_cast<std::byte*>(out.data() + at), cap, ec);
      out.resize(at + n);
      if (ec) {
        f = {true, "reading the response body failed after " + std::to_string(out.size()) + " bytes: " + ec.message(),
             std::nullopt, false};
        co_return false;
      }
    }
    co_return true;
  }

  /// One request and its whole answer; nothing on failure (f says why).
  task<std::optional<http_response>> exchange_whole(http_lane& lane, const http_request& r, attempt_failure& f) {
    auto c = co_await take(lane, r.url, f, r.deadline);
    if (!c) co_return std::nullopt;
    if (!co_await write_request(*c, r, f)) co_return std::nullopt;
    parser_t p;
    p.body_limit(std::numeric_limits<std::uint64_t>::max());
    p.header_limit(64 << 10);
    if (r.method == bhttp::verb::head) p.skip(true);
    if (!co_await read_header(*c, p, f)) co_return std::nullopt;
    http_response resp;
    resp.status = p.get().result_int();
    resp.headers = headers_of(p);
    resp.url = r.url;
    if (!co_await read_body_string(*c, p, resp.body, f)) {
      if (!f.retry && (resp.status >= 500 || resp.status == 429)) {  // an error answer too big to read: retry anyway
        f.retry = true;
        f.why = "HTTP " + std::to_string(resp.status) + " (" + f.why + ")";
      }
      co_return std::nullopt;
    }
    if (p.get().keep_alive()) give_back(lane, std::move(c));
    co_return resp;
  }

  /// One range GET attempt into dst[got, dst.size()); true when all of dst has landed.
  task<bool> exchange_range(http_lane& lane, const http_request& r, std::uint64_t off, std::span<std::byte> dst,
                            std::uint64_t total, std::uint64_t& got, attempt_failure& f, std::optional<url_parts>& moved,
                            const object_validator& validator) {
    auto c = co_await take(lane, r.url, f, r.deadline);
    if (!c) co_return false;
    if (!co_await write_request(*c, r, f)) co_return false;
    parser_t p;
    p.body_limit(std::numeric_limits<std::uint64_t>::max());
    p.header_limit(64 << 10);
    if (!co_await read_header(*c, p, f)) co_return false;
    const unsigned status = p.get().result_int();
    const std::uint64_t first = off + got, want = dst.size() - got, last = first + want - 1;
    const std::string asked = "bytes " + std::to_string(first) + "-" + std::to_string(last);
    auto small_body = [&]() -> task<std::string> {
      std::string b;
      attempt_failure ignored;
      co_await read_body_string(*c, p, b, ignored);
      co_return b;
    };
    if (is_redirect(status)) {
      auto loc = p.get().find(bhttp::field::location);
      if (loc == p.get().end()) {
        f = {false, "HTTP " + std::to_string(status) + " without a Location", std::nullopt, false};
        co_return false;
      }
      moved = resolve_location(r.url, sv(loc->value()));
      co_return false;
    }
    if (status == 404 || status == 410)
      throw error(errc::not_found, r.url.str() + ": no such object (HTTP " + std::to_string(status) + ")");
    if (status == 416)
      throw error(errc::truncated, r.url.str() + ": " + asked + " not satisfiable (HTTP 416): the object is shorter than " +
                                       std::to_string(total) + " bytes");
    if (status == 412 && !validator.empty())
      throw error(errc::io_error, r.url.str() + ": the object changed while reading: HTTP 412 to " +
                                      (validator.etag.empty() ? "If-Unmodified-Since: " + validator.last_modified
                                                              : "If-Match: " + validator.etag) +
                                      " (for " + asked + ")");
    if ((status == 200 || status == 206) && !validator.etag.empty())
      if (auto et = p.get().find(bhttp::field::etag); et != p.get().end() && sv(et->value()) != validator.etag)
        throw error(errc::io_error, r.url.str() + ": the object changed while reading: ETag " + validator.etag +
                                        " when opened, " + std::string(sv(et->value())) + " now (for " + asked + ")");
    if (status >= 500 || status == 429) {
      const std::string b = co_await small_body();
      f = {true, "HTTP " + std::to_string(status) + " for " + asked + excerpt(b), std::nullopt, false};
      if (auto ra = p.get().find(bhttp::field::retry_after); ra != p.get().end())
        f.retry_after = parse_retry_after(sv(ra->value()));
      co_return false;
    }
    if (status == 200) {
      // only right when the whole object was asked for and the body is exactly it
      const auto n = p.content_length();
      if (!(first == 0 && want == total && n && *n == total)) {
        f = {false, "the server ignored the Range header (HTTP 200 with the whole body" +
                        (n ? " of " + std::to_string(*n) + " bytes" : std::string()) + ") when asked for " + asked,
             std::nullopt, false};
        co_return false;
      }
    } else if (status == 206) {
      auto cr = p.get().find(bhttp::field::content_range);
      std::uint64_t a = 0, b = 0;
      std::optional<std::uint64_t> t;
      if (cr == p.get().end() || !parse_content_range(sv(cr->value()), a, b, t)) {
        f = {true, "HTTP 206 without a valid Content-Range (asked for " + asked + ")", std::nullopt, false};
        co_return false;
      }
      if (a != first || b != last || (t && *t != total)) {
        f = {true, "wrong Content-Range '" + std::string(cr->value()) + "' for " + asked + "/" + std::to_string(total),
             std::nullopt, false};
        co_return false;
      }
      if (auto n = p.content_length(); n && *n != want) {
        f = {true, "wrong Content-Length " + std::to_string(*n) + " for " + asked + " (" + std::to_string(want) + " bytes)",
             std::nullopt, false};
        co_return false;
      }
    } else {
      const std::string b = co_await small_body();
      throw error(errc::io_error, r.url.str() + ": HTTP " + std::to_string(status) + " for " + asked + excerpt(b));
    }
    if (p.content_length() && !p.chunked()) {
      // the body straight from the socket into dst, past Beast's parser: first the bytes that
      // came with the header (read_header leaves them in the buffer), then reads of at most
      // 1 MiB each (so read_timeout is per MiB). Content-Length is the bytes asked for (checked above).
      const std::size_t pre = std::min<std::size_t>(c->buffer.size(), static_cast<std::size_t>(dst.size() - got));
      net::buffer_copy(net::buffer(dst.data() + got, pre), c->buffer.data());
      c->buffer.consume(pre);
      got += pre;
      stats_.body_bytes += pre;
      while (got < dst.size()) {
        boost::system::error_code ec;
        const std::size_t cap = static_cast<std::size_t>(std::min<std::uint64_t>(dst.size() - got, 1 << 20));
        got += co_await read_raw(*c, dst.data() + got, cap, ec);
        if (ec) {
          f = {true, "the body ended after " + std::to_string(got - (first - off)) + " of " + std::to_string(want) +
                         " bytes for " + asked + ": " + ec.message(), std::nullopt, false};
          co_return false;
        }
      }
      // bytes past the body are not the start of a next answer (none was asked for): the
      // connection is not reused
      if (p.get().keep_alive() && c->buffer.size() == 0) give_back(lane, std::move(c));
      co_return true;
    }
    // a body without Content-Length (chunked, or until the connection closes): through the parser
    // (at most 1 MiB per call, so read_timeout is per MiB)
    while (got < dst.size() && !p.is_done()) {
      boost::system::error_code ec;
      const std::size_t cap = static_cast<std::size_t>(std::min<std::uint64_t>(dst.size() - got, 1 << 20));
      got += co_await read_body_some(*c, p, dst.data() + got, cap, ec);
      if (ec) {
        f = {true, "the body ended after " + std::to_string(got - (first - off)) + " of " + std::to_string(want) +
                       " bytes for " + asked + ": " + ec.message(), std::nullopt, false};
        co_return false;
      }
    }
    if (!p.is_done()) {  // all of dst landed, the body goes on: more than Content-Length / Content-Range said
      std::byte scratch[1];
      boost::system::error_code ec;
      if (co_await read_body_some(*c, p, scratch, 1, ec) != 0 || !p.is_done()) {
        got = first - off;  // nothing of this answer can be trusted
        f = {true, "the body for " + asked + " is longer than the " + std::to_string(want) + " bytes announced",
             std::nullopt, false};
        co_return false;
      }
    }
    if (got < dst.size()) {
      f = {true, "the body for " + asked + " ended after " + std::to_string(got - (first - off)) + " bytes", std::nullopt,
           false};
      co_return false;
    }
    if (p.get().keep_alive()) give_back(lane, std::move(c));
    co_return true;
  }

  /// Request slots held for as long as it lives: one, waited for; take_free() adds those free now.
  struct slot_guard {
    std::counting_semaphore<1024>& s;
    unsigned held = 1;
    explicit slot_guard(std::counting_semaphore<1024>& x) : s(x) { s.acquire(); }
    ~slot_guard() { s.release(held); }
    /// Takes free slots, without waiting, until `want` are held; how many are held.
    unsigned take_free(unsigned want) {
      while (held < want && s.try_acquire()) ++held;
      return held;
    }
  };

  http_options opt_;
  http_stats stats_;
  std::counting_semaphore<1024> slots_;
  std::atomic<unsigned> idle_count_{0};  ///< idle connections over all lanes
  std::mutex lanes_mutex_;
  std::vector<std::unique_ptr<http_lane>> free_lanes_;
#if SHARDSAFE_HTTP_TLS
  std::unique_ptr<net::ssl::context> tls_;
#endif
};

}  // namespace detail
}  // namespace shardsafe
