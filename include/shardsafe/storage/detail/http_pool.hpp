// shardsafe/storage/detail/http_pool.hpp - the connections of the HTTP client
// (storage/detail/http_client.hpp, whose engine holds the pool: http_engine.hpp): kept-alive
// connections pooled per origin on lanes (an io_context each, run by one thread at a time), the
// request slots that bound the requests of a client on the wire, and the opening of a
// connection (http_options::connect_to, resolve, connect, TLS handshake with the server's name
// checked), each step bounded by its deadline.
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

#include "shardsafe/storage/detail/http_message.hpp"  // SHARDSAFE_HTTP_TLS, SHARDSAFE_HTTP_ABI

#if SHARDSAFE_HTTP_TLS
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/ssl/host_name_verification.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#endif

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/thread_pool.hpp"
#include "shardsafe/storage/http_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

namespace net = boost::asio;
namespace beast = boost::beast;

/// A coroutine of the client (Asio's awaitable, on a lane's io_context).
template <class T>
using task = net::awaitable<T>;

/// One kept-alive connection, bound to the io_context of the lane that opened it.
struct http_connection {
#if SHARDSAFE_HTTP_TLS
  std::variant<beast::tcp_stream, beast::ssl_stream<beast::tcp_stream>> stream;
  http_connection(net::io_context& ioc, bool tls, net::ssl::context* ctx)
      : stream(tls ? decltype(stream)(std::in_place_index<1>, ioc, *ctx)
                   : decltype(stream)(std::in_place_index<0>, ioc)) {}
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

  beast::tcp_stream& tcp() {
    return std::visit([](auto& s) -> beast::tcp_stream& { return beast::get_lowest_layer(s); }, stream);
  }
};

/// An io_context with the idle connections bound to it. One thread at a time runs a lane
/// (a blocking call on the calling thread, or one thread of a batch for the batch's
/// coroutines), so its pool needs no lock.
struct http_lane {
  net::io_context ioc{1};
  std::map<std::string, std::vector<std::unique_ptr<http_connection>>> idle;
};

/// What comes after an attempt that gave no final answer.
enum class next_step {
  retry,      ///< another attempt, after a backoff, counted against max_attempts
  stop,       ///< none: another attempt would fail the same way (the error names why)
  follow,     ///< a redirect: again at once, at the new URL, no attempt used
  reconnect,  ///< a pooled connection the server had closed before answering: again at once
              ///< on a new connection, no attempt used (at most 64 times a request)
};

/// The outcome of one attempt, when it is not a final answer.
struct attempt_failure {
  next_step next = next_step::retry;
  std::string why;  ///< for the final message
  std::optional<std::chrono::milliseconds> retry_after;
};

// Completion token: the error into ec, not thrown (defined before any use: clang wants a deduced
// return type seen first)
inline auto into(boost::system::error_code& ec) { return net::redirect_error(net::use_awaitable, ec); }

/// The lanes, connections and request slots of one client (the top of this header).
class http_pool {
 public:
  /// opt and stats: the client's, outliving the pool (opt.requests_in_flight in [1, 1024]).
  http_pool(const http_options& opt, http_stats& stats)
      : opt_(opt), stats_(stats), slots_(static_cast<std::ptrdiff_t>(opt.requests_in_flight)) {
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
  http_pool(const http_pool&) = delete;
  http_pool& operator=(const http_pool&) = delete;

  /// A lane taken from the pool's free ones (or a new one) for as long as it lives.
  struct lane_lease {
    http_pool* c;
    std::unique_ptr<http_lane> l;
    explicit lane_lease(http_pool& client) : c(&client) {
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

  std::counting_semaphore<1024>& slots() noexcept { return slots_; }

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
      throw error(errc::invalid_argument,
                  u.str() + ": HTTPS needs TLS, and this build has none (SHARDSAFE_HTTP_TLS=0)");
    auto c = std::make_unique<http_connection>(lane.ioc, false, nullptr);
#endif
    c->origin = origin;
    c->deadline = deadline;
    boost::system::error_code ec;
    std::string host = u.host, via;
    std::uint16_t port = u.port;
    for (const auto& rule : opt_.connect_to)
      if (rule.host.size() == u.host.size() &&
          std::equal(rule.host.begin(), rule.host.end(), u.host.begin(),
                     [](char a, char b) { return ascii_lower(a) == ascii_lower(b); }) &&
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
      f = {next_step::retry, "cannot resolve " + host + via + ": " + ec.message(), std::nullopt};
      co_return nullptr;
    }
    arm(*c, opt_.connect_timeout);
    co_await c->tcp().async_connect(endpoints, into(ec));
    if (ec) {
      f = {next_step::retry, "cannot connect to " + u.host_header() + via + ": " + ec.message(), std::nullopt};
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
        f = {cert ? next_step::stop : next_step::retry,
             "TLS handshake with " + u.host_header() + " failed: " + ec.message(), std::nullopt};
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

 private:
  const http_options& opt_;
  http_stats& stats_;
  std::counting_semaphore<1024> slots_;
  std::atomic<unsigned> idle_count_{0};  ///< idle connections over all lanes
  std::mutex lanes_mutex_;
  std::vector<std::unique_ptr<http_lane>> free_lanes_;
#if SHARDSAFE_HTTP_TLS
  std::unique_ptr<net::ssl::context> tls_;
#endif
};

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
