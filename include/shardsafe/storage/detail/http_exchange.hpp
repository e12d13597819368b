// shardsafe/storage/detail/http_exchange.hpp - one attempt of an HTTP exchange on a pooled
// connection (storage/detail/http_pool.hpp): a request written and its answer read whole into
// memory (bounded), or a range GET landing straight in the caller's memory, every rule of a
// range answer checked (the top of storage/detail/http_client.hpp). An attempt that gives no
// final answer says what comes next (next_step); the retries are the engine's
// (storage/detail/http_engine.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/detail/http_fields.hpp"
#include "shardsafe/storage/detail/http_message.hpp"
#include "shardsafe/storage/detail/http_pool.hpp"
#include "shardsafe/storage/http_options.hpp"
#include "shardsafe/storage/url.hpp"

namespace shardsafe {

namespace detail {
inline namespace SHARDSAFE_HTTP_ABI {

/// The attempts of one client: requests and answers on the pool's connections.
class http_wire {
 public:
  http_wire(http_pool& pool, const http_options& opt, http_stats& stats) : pool_(pool), opt_(opt), stats_(stats) {}

  static bool is_redirect(unsigned s) { return s == 301 || s == 302 || s == 303 || s == 307 || s == 308; }
  static std::string excerpt(const std::string& body) {
    if (body.empty()) return "";
    std::string e = body.substr(0, 200);
    for (char& c : e)
      if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    return ": " + e + (body.size() > 200 ? "..." : "");
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
    http_pool::arm(c, opt_.read_timeout + std::chrono::milliseconds(r.body.size() / 1024));  // ~1 MB/s floor
    co_await http_pool::on_stream(c, [&](auto& s) { return bhttp::async_write(s, m, into(ec)); });
    ++stats_.requests;
    if (ec) {
      f = {c.reused ? next_step::reconnect : next_step::retry, "sending the request failed: " + ec.message(),
           std::nullopt};
      co_return false;
    }
    co_return true;
  }

  using parser_t = bhttp::response_parser<bhttp::buffer_body>;

  /// Reads the response header into p; false (with f filled) on a transport or parse error.
  task<bool> read_header(http_connection& c, parser_t& p, attempt_failure& f) {
    boost::system::error_code ec;
    http_pool::arm(c, opt_.read_timeout);
    co_await http_pool::on_stream(c, [&](auto& s) { return bhttp::async_read_header(s, c.buffer, p, into(ec)); });
    if (ec) {
      const bool nothing =
          ec == bhttp::error::end_of_stream || ec == net::error::eof || ec == net::error::connection_reset;
      f = {c.reused && nothing ? next_step::reconnect : next_step::retry,
           "reading the response header failed: " + ec.message(), std::nullopt};
      co_return false;
    }
    if (const unsigned v = p.get().version(); v != 10 && v != 11) {  // Beast takes any digit.digit
      f = {next_step::retry,
           "reading the response header failed: the answer is HTTP/" + std::to_string(v / 10) + "." +
               std::to_string(v % 10) + ", not HTTP/1.x",
           std::nullopt};
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
    http_pool::arm(c, opt_.read_timeout);
    co_await http_pool::on_stream(c, [&](auto& s) { return bhttp::async_read(s, c.buffer, p, into(ec)); });
    if (ec == bhttp::error::need_buffer) ec = {};
    const std::size_t n = cap - p.get().body().size;
    stats_.body_bytes += n;
    co_return n;
  }

  /// Reads exactly n bytes from c's socket into data (no parser, no copy), as far as it can:
  /// returns how many landed, with ec set if that is fewer than n.
  task<std::size_t> read_raw(http_connection& c, std::byte* data, std::size_t n, boost::system::error_code& ec) {
    http_pool::arm(c, opt_.read_timeout);
    // each socket read asks for all that is still missing (asio's default would be 64 KiB)
    auto all_missing = [n](const boost::system::error_code& e, std::size_t done) -> std::size_t {
      return e ? 0 : n - done;
    };
    const std::size_t k = co_await http_pool::on_stream(
        c, [&](auto& s) { return net::async_read(s, net::buffer(data, n), all_missing, into(ec)); });
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
      f = {next_step::stop,
           "Content-Length " + std::to_string(*n) + " is over the " + std::to_string(opt_.max_response_body) +
               " bytes this client reads into memory",
           std::nullopt};
      co_return false;
    }
    while (!p.is_done()) {
      const std::size_t at = out.size();
      if (at >= opt_.max_response_body) {
        f = {next_step::stop, "response body over " + std::to_string(opt_.max_response_body) + " bytes", std::nullopt};
        co_return false;
      }
      const std::size_t cap = std::min<std::size_t>(64 << 10, opt_.max_response_body - at);
      out.resize(at + cap);
      boost::system::error_code ec;
      const std::size_t n = co_await read_body_some(c, p, reinterpret_cast<std::byte*>(out.data() + at), cap, ec);
      out.resize(at + n);
      if (ec) {
        f = {next_step::retry,
             "reading the response body failed after " + std::to_string(out.size()) + " bytes: " + ec.message(),
             std::nullopt};
        co_return false;
      }
    }
    co_return true;
  }

  /// One request and its whole answer; nothing on failure (f says why).
  task<std::optional<http_response>> exchange_whole(http_lane& lane, const http_request& r, attempt_failure& f) {
    auto c = co_await pool_.take(lane, r.url, f, r.deadline);
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
      if (f.next == next_step::stop &&
          (resp.status >= 500 || resp.status == 429)) {  // an error answer too big to read: retry anyway
        f.next = next_step::retry;
        f.why = "HTTP " + std::to_string(resp.status) + " (" + f.why + ")";
      }
      co_return std::nullopt;
    }
    if (p.get().keep_alive()) pool_.give_back(lane, std::move(c));
    co_return resp;
  }

  /// One range GET attempt into dst[got, dst.size()); true when all of dst has landed.
  task<bool> exchange_range(http_lane& lane, const http_request& r, std::uint64_t off, std::span<std::byte> dst,
                            std::uint64_t total, std::uint64_t& got, attempt_failure& f,
                            std::optional<url_parts>& moved, const object_validator& validator) {
    auto c = co_await pool_.take(lane, r.url, f, r.deadline);
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
        f = {next_step::stop, "HTTP " + std::to_string(status) + " without a Location", std::nullopt};
        co_return false;
      }
      moved = resolve_location(r.url, sv(loc->value()));
      co_return false;
    }
    if (status == 404 || status == 410)
      throw error(errc::not_found, r.url.str() + ": no such object (HTTP " + std::to_string(status) + ")");
    if (status == 416)
      throw error(errc::truncated, r.url.str() + ": " + asked +
                                       " not satisfiable (HTTP 416): the object is shorter than " +
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
      f = {next_step::retry, "HTTP " + std::to_string(status) + " for " + asked + excerpt(b), std::nullopt};
      if (auto ra = p.get().find(bhttp::field::retry_after); ra != p.get().end())
        f.retry_after = parse_retry_after(sv(ra->value()));
      co_return false;
    }
    if (status == 200) {
      // only right when the whole object was asked for and the body is exactly it
      const auto n = p.content_length();
      if (!(first == 0 && want == total && n && *n == total)) {
        f = {next_step::stop,
             "the server ignored the Range header (HTTP 200 with the whole body" +
                 (n ? " of " + std::to_string(*n) + " bytes" : std::string()) + ") when asked for " + asked,
             std::nullopt};
        co_return false;
      }
    } else if (status == 206) {
      auto cr = p.get().find(bhttp::field::content_range);
      std::uint64_t a = 0, b = 0;
      std::optional<std::uint64_t> t;
      if (cr == p.get().end() || !parse_content_range(sv(cr->value()), a, b, t)) {
        f = {next_step::retry, "HTTP 206 without a valid Content-Range (asked for " + asked + ")", std::nullopt};
        co_return false;
      }
      if (a != first || b != last || (t && *t != total)) {
        f = {next_step::retry,
             "wrong Content-Range '" + std::string(cr->value()) + "' for " + asked + "/" + std::to_string(total),
             std::nullopt};
        co_return false;
      }
      if (auto n = p.content_length(); n && *n != want) {
        f = {next_step::retry,
             "wrong Content-Length " + std::to_string(*n) + " for " + asked + " (" + std::to_string(want) + " bytes)",
             std::nullopt};
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
          f = {next_step::retry,
               "the body ended after " + std::to_string(got - (first - off)) + " of " + std::to_string(want) +
                   " bytes for " + asked + ": " + ec.message(),
               std::nullopt};
          co_return false;
        }
      }
      // bytes past the body are not the start of a next answer (none was asked for): the
      // connection is not reused
      if (p.get().keep_alive() && c->buffer.size() == 0) pool_.give_back(lane, std::move(c));
      co_return true;
    }
    // a body without Content-Length (chunked, or until the connection closes): through the parser
    // (at most 1 MiB per call, so read_timeout is per MiB)
    while (got < dst.size() && !p.is_done()) {
      boost::system::error_code ec;
      const std::size_t cap = static_cast<std::size_t>(std::min<std::uint64_t>(dst.size() - got, 1 << 20));
      got += co_await read_body_some(*c, p, dst.data() + got, cap, ec);
      if (ec) {
        f = {next_step::retry,
             "the body ended after " + std::to_string(got - (first - off)) + " of " + std::to_string(want) +
                 " bytes for " + asked + ": " + ec.message(),
             std::nullopt};
        co_return false;
      }
    }
    if (!p.is_done()) {  // all of dst landed, the body goes on: more than Content-Length / Content-Range said
      std::byte scratch[1];
      boost::system::error_code ec;
      if (co_await read_body_some(*c, p, scratch, 1, ec) != 0 || !p.is_done()) {
        got = first - off;  // nothing of this answer can be trusted
        f = {next_step::retry,
             "the body for " + asked + " is longer than the " + std::to_string(want) + " bytes announced",
             std::nullopt};
        co_return false;
      }
    }
    if (got < dst.size()) {
      f = {next_step::retry, "the body for " + asked + " ended after " + std::to_string(got - (first - off)) + " bytes",
           std::nullopt};
      co_return false;
    }
    if (p.get().keep_alive()) pool_.give_back(lane, std::move(c));
    co_return true;
  }

 private:
  http_pool& pool_;
  const http_options& opt_;
  http_stats& stats_;
};

}  // namespace SHARDSAFE_HTTP_ABI
}  // namespace detail
}  // namespace shardsafe
