// shardsafe/storage/http_options.hpp - how the remote backends (storage/http.hpp,
// storage/s3.hpp) talk HTTP, and what their client counts. Plain data: no network library.
// The client that honours them is storage/detail/http_client.hpp (retries, deadlines and
// redirects are described at its top).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

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
  unsigned max_redirects = 5;                             ///< 301/302/303/307/308 followed for GET and HEAD
  unsigned requests_in_flight = 16;                       ///< per client (shared by copies of a directory)
  std::uint64_t part_bytes = std::uint64_t(8) << 20;      ///< read_batch splits longer reads into parts
  std::size_t max_response_body = std::size_t(16) << 20;  ///< bodies read into memory (errors, XML)
  std::string ca_file;                      ///< PEM file of CAs to trust (HTTPS); empty: the system's store
  bool verify_peer = true;                  ///< check the server's certificate and host name (HTTPS)
  std::vector<connect_to_rule> connect_to;  ///< the first rule that matches a URL's host and port
};

/// Counters of one client, for tests and benchmarks.
struct http_stats {
  std::atomic<std::uint64_t> requests{0};     ///< requests sent (retries included)
  std::atomic<std::uint64_t> body_bytes{0};   ///< response body bytes received
  std::atomic<std::uint64_t> retries{0};      ///< attempts after a failed one
  std::atomic<std::uint64_t> connections{0};  ///< connections opened
};

}  // namespace shardsafe
