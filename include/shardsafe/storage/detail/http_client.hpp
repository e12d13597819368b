// shardsafe/storage/detail/http_client.hpp - the HTTP/1.1 client under the http and s3
// backends (Boost.Beast over Boost.Asio; TLS through OpenSSL when SHARDSAFE_HTTP_TLS is 1).
// Its settings are storage/http_options.hpp's; what it is handed and gives back, its requests,
// answers and signing hook, storage/detail/http_message.hpp's. Here, its declarations and the
// rules it keeps; what keeps them is storage/detail/http_engine.hpp (the retries and the
// blocking calls), over the connections, lanes and request slots (storage/detail/http_pool.hpp),
// one attempt of an exchange (storage/detail/http_exchange.hpp) and the header fields it parses
// (storage/detail/http_fields.hpp). A separately compiled program's units see the declarations
// only; the remote unit (shardsafe/compiled_remote.hpp) holds the rest.
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
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/detail/http_message.hpp"
#include "shardsafe/storage/http_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

class http_engine;

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

  http_options opt_;
  http_stats stats_;
  std::unique_ptr<http_engine> engine_;  ///< (storage/detail/http_engine.hpp)
};

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/storage/detail/impl/http_client.ipp"
#endif
