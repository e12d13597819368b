// Tests of storage/http.hpp and storage/url.hpp: URL parsing, checkpoints and HF folders
// read from nginx on 127.0.0.1 (started by the test), and a scripted server that breaks the
// range rules: every fault is retried or an error, and the bytes are checked against the
// object itself.
#include "shardsafe/storage/http.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <random>
#include <thread>

#include "support/checkpoint_fixtures.hpp"
#include "support/servers.hpp"
#include "shardsafe/checkpoint/hf/folder.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/storage/detail/http_fields.hpp"
#include "shardsafe/storage/file.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
using testing::expect_error;
using testing::random_bytes;
using testing::temp_dir;
namespace fs = std::filesystem;

namespace {

/// Options that retry quickly, for the fault tests.
http_options quick() {
  http_options o;
  o.backoff_initial = std::chrono::milliseconds(5);
  o.backoff_max = std::chrono::milliseconds(20);
  o.read_timeout = std::chrono::milliseconds(3000);
  o.max_attempts = 4;
  return o;
}

std::string read_string(const http_storage& s, std::uint64_t off, std::size_t n) {
  std::string out(n, '\0');
  s.read_into(off, std::as_writable_bytes(std::span(out)));
  return out;
}

/// n reads of random ranges (at most max_len bytes each) of an object of `size` bytes, each
/// into its own string; check() compares what landed with the object's bytes.
struct scattered_reads {
  std::vector<std::string> outs;
  std::vector<read_request> rs;
  scattered_reads(std::mt19937_64& rng, std::uint64_t size, std::size_t n, std::uint64_t max_len) : outs(n) {
    for (auto& out : outs) {
      const std::uint64_t off = rng() % size, len = rng() % std::min<std::uint64_t>(size - off, max_len) + 1;
      out.assign(len, '\0');
      rs.push_back({off, std::as_writable_bytes(std::span(out))});
    }
  }
  bool check(const std::string& body) const {
    for (std::size_t i = 0; i < outs.size(); ++i)
      if (outs[i] != body.substr(rs[i].offset, outs[i].size())) return false;
    return true;
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// URLs

TEST_CASE("parse_url: the parts, defaults and normal forms") {
  url_parts u = parse_url("http://example.org/a/b.bin?x=1");
  CHECK(u.scheme == "http");
  CHECK(u.host == "example.org");
  CHECK(u.port == 80);
  CHECK_FALSE(u.explicit_port);
  CHECK(u.target == "/a/b.bin?x=1");
  CHECK(u.path() == "/a/b.bin");
  CHECK(u.str() == "http://example.org/a/b.bin?x=1");
  u = parse_url("HTTPS://Host.Example:8443");
  CHECK(u.scheme == "https");
  CHECK(u.host == "host.example");
  CHECK(u.port == 8443);
  CHECK(u.tls());
  CHECK(u.target == "/");
  CHECK(u.host_header() == "host.example:8443");
  u = parse_url("http://[::1]:9000/x");
  CHECK(u.host == "::1");
  CHECK(u.port == 9000);
  CHECK(u.host_header() == "[::1]:9000");
  CHECK(u.origin() == "http://[::1]:9000");
  u = parse_url("http://127.0.0.1?q");
  CHECK(u.target == "/?q");
  u = parse_url("s3://bucket/prefix/step_1");
  CHECK(u.scheme == "s3");
  CHECK(u.host == "bucket");
  CHECK(u.target == "/prefix/step_1");
  CHECK(parse_url("https://h/").port == 443);
}

TEST_CASE("parse_url: refusals name the URL and the rule") {
  using P = std::vector<std::string>;
  auto bad = [](const char* url, const char* why) {
    expect_error([&] { parse_url(url); }, errc::invalid_argument, P{std::string("'") + url + "'", why});
  };
  bad("example.org/a", "no scheme");
  bad("ftp://h/a", "scheme 'ftp'");
  bad("http:///a", "no host");
  bad("http://:80/a", "no host");
  bad("http://user:pw@h/a", "user information");
  bad("http://h:0/", "port '0'");
  bad("http://h:65536/", "port '65536'");
  bad("http://h:8x/", "port '8x'");
  bad("http://h:/", "port ''");
  bad("http://h/a b", "space or a control character");
  bad("http://h/a\nb", "space or a control character");
  bad("http://h/a#frag", "fragment");
  bad("http://[::1/a", "closing ']'");
  bad("http://[zz]/a", "not an IPv6 address");
  bad("http://[B]/a", "not an IPv6 address");  // hex digits without a colon: fuzz_remote's finding
  bad("http://h%41/", "character a host name cannot");
  bad("s3://bucket:9000/x", "names a bucket");
}

TEST_CASE("url_child, percent_encode and resolve_location") {
  const url_parts d = parse_url("http://h:81/ckpt/step_1?sig=abc");
  CHECK(url_child(d, "rank_0.safetensors").str() == "http://h:81/ckpt/step_1/rank_0.safetensors");
  CHECK(url_child(d, "a b+c%/é").target == "/ckpt/step_1/a%20b%2Bc%25%2F%C3%A9");
  CHECK(url_child(parse_url("http://h/"), "x").target == "/x");
  CHECK(percent_encode("a/b c~", true) == "a/b%20c~");
  const url_parts f = parse_url("http://h/a/b/file");
  CHECK(resolve_location(f, "https://o:1/z").str() == "https://o:1/z");
  CHECK(resolve_location(f, "//o/z").str() == "http://o/z");
  CHECK(resolve_location(f, "/z/y").str() == "http://h/z/y");
  CHECK(resolve_location(f, "other").str() == "http://h/a/b/other");
  expect_error([&] { resolve_location(f, "a b"); }, errc::invalid_argument, {"space"});
}

TEST_CASE("parse_content_range and parse_retry_after") {
  std::uint64_t a = 0, b = 0;
  std::optional<std::uint64_t> t;
  CHECK(detail::parse_content_range("bytes 0-9/100", a, b, t));
  CHECK((a == 0 && b == 9 && t == 100u));
  CHECK(detail::parse_content_range("bytes 5-5/*", a, b, t));
  CHECK((a == 5 && b == 5 && !t));
  for (const char* bad : {"bytes 9-0/100", "bytes 0-100/100", "bytes */100", "items 0-1/2", "bytes 0-1", "bytes -1/2",
                          "bytes 0-1/2x", "bytes 99999999999999999999-1/2", "bytes 1-2/ 3"})
    CHECK_MESSAGE(!detail::parse_content_range(bad, a, b, t), bad);
  CHECK(detail::parse_retry_after("3") == std::chrono::milliseconds(3000));
  CHECK(detail::parse_retry_after("0") == std::chrono::milliseconds(0));
  CHECK_FALSE(detail::parse_retry_after(""));
  CHECK_FALSE(detail::parse_retry_after("1.5"));
  CHECK_FALSE(detail::parse_retry_after("-1"));
  CHECK_FALSE(detail::parse_retry_after("soon"));
  // an HTTP-date: the wait from now until then, nothing for a date past
  using ms = std::chrono::milliseconds;
  const auto now =
      std::chrono::sys_seconds(std::chrono::seconds(1445412480));  // 2015-10-21 07:28:00 UTC (Python's calendar.timegm)
  CHECK(detail::parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now) == ms(0));
  CHECK(detail::parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now) == ms(30'000));
  CHECK(detail::parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now + ms(200)) == ms(29'800));
  CHECK(detail::parse_retry_after("Wednesday, 21-Oct-15 07:29:00 GMT", now) == ms(60'000));  // RFC 850
  // a date far ahead (fuzz_remote's finding: the wait in nanoseconds overflowed) is cut to 10^9 s
  CHECK(detail::parse_retry_after("Sun, 06 Nov 5994 08:49:37 GMT", now) == ms(1'000'000'000'000));
  CHECK(detail::parse_retry_after("Wed Oct 21 07:28:05 2015", now) == ms(5000));  // asctime
  CHECK(detail::parse_retry_after("Thu, 22 Oct 2015 07:28:00 GMT", now) == ms(86'400'000));
  CHECK(detail::parse_retry_after("Tue, 20 Oct 2015 07:28:00 GMT", now) == ms(0));  // past
  for (const char* bad :
       {"Wed, 21 Oct 2015 07:28:00 UTC", "Wed, 32 Oct 2015 07:28:00 GMT", "Sun, 29 Feb 2015 07:28:00 GMT",
        "Wed, 21 Okt 2015 07:28:00 GMT", "Wed, 21 Oct 2015 24:00:00 GMT", "Wed, 21 Oct 15 07:28:00 GMT",
        "Wed, 21 Oct 2015 7:28:00 GMT", "Wed 21 Oct 2015 07:28:00 GMT", "21 Oct 2015 07:28:00 GMT"})
    CHECK_MESSAGE(!detail::parse_retry_after(bad, now), bad);
}

TEST_CASE("parse_http_date: the three forms, against Python's email.utils for random instants") {
  CHECK(detail::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT") == 784111777);  // RFC 9110's example
  CHECK(detail::parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT") == 784111777);
  CHECK(detail::parse_http_date("Sun Nov  6 08:49:37 1994") == 784111777);
  CHECK(detail::parse_http_date("Thu, 29 Feb 2024 23:59:59 GMT") == 1709251199);
  CHECK(detail::parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT") == 0);
  const auto py = testing::peer(
      "python3", {"-c",
                  "import random, email.utils\nr = random.Random(7)\nfor _ in range(300):\n"
                  "    t = r.randrange(0, 4102444800)\n    print(t, email.utils.formatdate(t, usegmt=True))"});
  REQUIRE_MESSAGE(py.code == 0, py.err);
  std::istringstream in(py.out);
  int n = 0;
  for (std::string line; std::getline(in, line); ++n) {
    const std::size_t sp = line.find(' ');
    CHECK_MESSAGE(detail::parse_http_date(line.substr(sp + 1)) == std::stoll(line.substr(0, sp)), line);
  }
  CHECK(n == 300);
}

// ---------------------------------------------------------------------------------------
// nginx

namespace {
void http_test_add_header(detail::http_request& r) { r.headers.emplace_back("X-Hook", "function"); }
}  // namespace

TEST_CASE(
    "request_signer calls the hook it refers to, once per call: a function object, a pointer to a function, none") {
  struct counting_hook {
    int* calls;
    void operator()(detail::http_request& r) const { r.headers.emplace_back("X-Hook", std::to_string(++*calls)); }
  };
  int calls = 0;
  const counting_hook hook{&calls};
  const detail::request_signer by_object(hook);
  detail::http_request r;
  by_object(r);
  by_object(r);
  CHECK(calls == 2);  // the object itself, not a copy made when the signer was
  REQUIRE(r.headers.size() == 2);
  CHECK(r.headers[1].second == "2");
  const detail::request_signer by_pointer(&http_test_add_header);  // a prvalue: held by value
  by_pointer(r);
  REQUIRE(r.headers.size() == 3);
  CHECK(r.headers[2] == std::pair<std::string, std::string>("X-Hook", "function"));
  const detail::request_signer by_name(http_test_add_header);
  by_name(r);
  REQUIRE(r.headers.size() == 4);
  CHECK(r.headers[3].second == "function");
  const detail::request_signer none;
  none(r);
  const detail::no_signing nothing;
  const detail::request_signer by_no_signing(nothing);
  by_no_signing(r);
  CHECK(r.headers.size() == 4);
  CHECK(calls == 2);
}

TEST_CASE("http: a sharded checkpoint saved by 2 ranks, loaded from nginx by 3 ranks in another sharding, bit-exact") {
  testing::nginx_site srv;
  // w: F32 [96, 3000] saved in rows halves; e: BF16 [40, 24] saved in column halves
  const std::string w = random_bytes(96 * 3000 * 4, 1), e = random_bytes(40 * 24 * 2, 2);
  const fs::path ckpt = srv.www / "ckpt";
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& comm) {
    const std::uint64_t r = static_cast<std::uint64_t>(comm.rank());
    std::string wm = w.substr(r * 48 * 3000 * 4, 48 * 3000 * 4), em;
    for (std::uint64_t row = 0; row < 40; ++row) em += e.substr((row * 24 + r * 12) * 2, 12 * 2);
    std::vector<flat_view> v{{"w",
                              dtype::F32,
                              {96, 3000},
                              shard_spec(block_spec({48, 3000}, {48 * r, 0})),
                              reinterpret_cast<std::byte*>(wm.data()),
                              wm.size()},
                             {"e",
                              dtype::BF16,
                              {40, 24},
                              shard_spec(block_spec({40, 12}, {0, 12 * r})),
                              reinterpret_cast<std::byte*>(em.data()),
                              em.size()}};
    save(file_directory(ckpt), std::span<const flat_view>(v), comm);
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);

  http_directory remote(srv.url("ckpt"));
  file_directory local(ckpt);
  std::uint64_t needed = 0;
  const std::uint64_t received0 = remote.client().stats().body_bytes;
  for (std::uint64_t r = 0; r < 3; ++r) {
    // 3 ranks: w by column thirds (strided), e by row thirds (40 = 14 + 13 + 13)
    const std::uint64_t e_rows = r == 0 ? 14 : 13, e_first = r == 0 ? 0 : 14 + (r - 1) * 13;
    auto views_into = [&](std::string& wm, std::string& em) {
      wm.assign(96 * 1000 * 4, '\x5a');
      em.assign(e_rows * 24 * 2, '\x5a');
      return std::vector<flat_view>{{"w",
                                     dtype::F32,
                                     {96, 3000},
                                     shard_spec(block_spec({96, 1000}, {0, 1000 * r})),
                                     reinterpret_cast<std::byte*>(wm.data()),
                                     wm.size()},
                                    {"e",
                                     dtype::BF16,
                                     {40, 24},
                                     shard_spec(block_spec({e_rows, 24}, {e_first, 0})),
                                     reinterpret_cast<std::byte*>(em.data()),
                                     em.size()}};
    };
    std::string wh, eh, wf, ef;
    auto vh = views_into(wh, eh);
    auto vf = views_into(wf, ef);
    const load_stats st = load(remote, std::span<const flat_view>(vh));
    load(local, std::span<const flat_view>(vf));
    needed += st.bytes_needed;
    // against the tensors themselves, cut independently
    std::string want_w, want_e = e.substr(e_first * 24 * 2, e_rows * 24 * 2);
    for (std::uint64_t row = 0; row < 96; ++row) want_w += w.substr((row * 3000 + 1000 * r) * 4, 1000 * 4);
    CHECK(wh == want_w);
    CHECK(eh == want_e);
    CHECK(wh == wf);  // and the file backend's load
    CHECK(eh == ef);
  }
  const std::uint64_t received = remote.client().stats().body_bytes - received0;
  MESSAGE("http load of 3 reshards: " << received << " body bytes received for " << needed << " bytes needed, "
                                      << remote.client().stats().requests.load() << " requests");
  CHECK(needed == w.size() + e.size());
  // the tensor bytes, at most 10% of merged gaps, and per load metadata.json and the 64 KiB
  // header probe of each of the 2 rank files (checkpoint/loader.hpp)
  CHECK(received <= needed + needed / 10 + 3 * (2 * 65536 + 4096));
}

TEST_CASE("http: a Hugging Face folder read through nginx holds the fixture's tensors") {
  testing::nginx_site srv;
  const auto ts = fixtures::sample_tensors();
  fixtures::make_indexed(file_directory(srv.www / "hf"), ts);
  const http_directory d(srv.url("hf/"));
  CHECK(d.name() == srv.url("hf"));
  CHECK(is_hf_folder(d));
  const hf_folder<http_directory> h = open_hf_folder(d);
  REQUIRE(h.tensors.size() == ts.size());
  for (const auto& t : ts) {
    const auto at = h.tensors.at(t.name);
    const auto& f = h.files[at.file];
    std::string got(t.bytes.size(), '\0');
    f.storage.read_into(f.header.offset_of(h.entry(at)), std::as_writable_bytes(std::span(got)));
    CHECK_MESSAGE(got == t.bytes, t.name);
    CHECK(f.name == fixtures::file_of(t));
  }
}

TEST_CASE("http_directory: exists, open, sub, list and names against nginx") {
  testing::nginx_site srv;
  fs::create_directories(srv.www / "d" / "inner");
  testing::write_file(srv.www / "d" / "a.bin", "hello");
  testing::write_file(srv.www / "d" / "x y.bin", "spaced");
  testing::write_file(srv.www / "d" / "inner" / "b.bin", "inner!");
  const http_directory d(srv.url("d"));
  CHECK(d.exists("a.bin"));
  CHECK(d.exists("x y.bin"));
  CHECK_FALSE(d.exists("absent"));
  CHECK(d.exists("inner"));  // 301 to inner/, then 403: a folder without an index
  CHECK(read_string(d.open("x y.bin"), 0, 6) == "spaced");
  CHECK(read_string(d.sub("inner").open("b.bin"), 1, 5) == "nner!");
  expect_error([&] { d.open("absent"); }, errc::not_found, {srv.url("d/absent"), "HTTP 404"});
  expect_error([&] { d.list(); }, errc::invalid_argument, {srv.url("d"), "no listing"});
  expect_error([&] { d.open("../etc"); }, errc::invalid_argument, {"not a plain object name"});
  const http_storage s = d.open("a.bin");
  CHECK(s.size() == 5);
  CHECK(s.name() == srv.url("d/a.bin"));
  expect_error([&] { read_string(s, 3, 3); }, errc::truncated, {srv.url("d/a.bin"), "passes the end"});
  CHECK(s.read_defaults().requests_in_flight == 16u);
}

TEST_CASE("http_storage: large reads split into parts read in parallel, and batches") {
  testing::nginx_site srv;
  const std::string body = random_bytes((5 << 20) + 1234, 3);
  testing::write_file(srv.www / "big.bin", body);
  http_options o;
  o.part_bytes = 256 << 10;
  const http_storage s(srv.url("big.bin"), o);
  const auto before = s.client().stats().requests.load();
  CHECK(read_string(s, 77, body.size() - 100) == body.substr(77, body.size() - 100));
  CHECK(s.client().stats().requests - before == (body.size() - 100 + o.part_bytes - 1) / o.part_bytes);
  // a batch of scattered reads
  std::mt19937_64 rng(5);
  scattered_reads b(rng, body.size(), 200, 700'000);
  s.read_batch(b.rs);
  CHECK(b.check(body));
  CHECK(s.client().stats().connections <= 16u + 1u);
}

TEST_CASE("http_storage: a batch's small reads close together are merged into a request per part; large ones not") {
  const std::string body = random_bytes(100'000, 53);
  testing::scripted_server srv(body);
  http_options o = quick();
  o.part_bytes = 10'000;
  const http_storage s(srv.url(), o);
  // 1,000 reads of 10 bytes, 100 bytes apart (a storage's bytes behind a size or a local header),
  // given in another order than the object's (a load's views by name), one of them twice
  std::vector<std::string> outs(1001, std::string(10, '\0'));
  std::vector<read_request> rs;
  for (std::size_t i = 0; i < 1000; ++i) {
    const std::size_t k = (i * 7) % 1000;  // 7 is prime to 1,000: every k once
    rs.push_back({k * 100, std::as_writable_bytes(std::span(outs[i]))});
  }
  rs.push_back({500 * 100 + 5, std::as_writable_bytes(std::span(outs[1000]))});  // overlaps read k = 500
  const int gets = srv.gets();
  s.read_batch(rs);
  for (std::size_t i = 0; i < rs.size(); ++i) REQUIRE(outs[i] == body.substr(rs[i].offset, 10));
  // the reads span [0, 99,910): requests of at most 10,000 bytes, each starting at a read
  CHECK(srv.gets() - gets == 10);
  // a read over the part size is cut into parts of 10,000, 10,000 and 5,000 bytes: the full
  // parts are requests of their own, the last one is small and takes the read beside it along
  std::string big(25'000, '\0'), small(10, '\0');
  const std::vector<read_request> two{{30'000, std::as_writable_bytes(std::span(big))},
                                      {55'000, std::as_writable_bytes(std::span(small))}};
  const int gets2 = srv.gets();
  s.read_batch(two);
  CHECK(big == body.substr(30'000, 25'000));
  CHECK(small == body.substr(55'000, 10));
  CHECK(srv.gets() - gets2 == 3);
}

TEST_CASE("http_storage: batches and single reads from several threads at once share one client's request slots") {
  testing::nginx_site srv;
  const std::string body = random_bytes((3 << 20) + 777, 11);
  testing::write_file(srv.www / "big.bin", body);
  http_options o;
  o.part_bytes = 64 << 10;
  o.requests_in_flight = 5;
  const http_storage s(srv.url("big.bin"), o);
  // 4 threads: two run batches of scattered reads (each read cut into parts, the parts as
  // coroutines on a few lanes), two run single reads, all through copies of one storage
  std::vector<std::string> fails(4);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      const http_storage mine = s;
      std::mt19937_64 rng(100 + t);
      for (int round = 0; round < 6; ++round) {
        scattered_reads b(rng, body.size(), t < 2 ? 40 : 1, 300'000);
        try {
          if (t < 2)
            mine.read_batch(b.rs);
          else
            mine.read_into(b.rs[0].offset, b.rs[0].dst);
        } catch (const std::exception& e) {
          fails[t] = e.what();
          return;
        }
        if (!b.check(body)) fails[t] = "thread " + std::to_string(t) + ": wrong bytes";
      }
    });
  for (auto& t : ts) t.join();
  for (const auto& f : fails) CHECK_MESSAGE(f.empty(), f);
  CHECK(s.client().stats().retries == 0u);
}

// ---------------------------------------------------------------------------------------
// a server that breaks the rules

TEST_CASE("http faults: each one retried with only the missing bytes asked again, or an error; never wrong bytes") {
  const std::string body = random_bytes(100'000, 9);
  testing::scripted_server srv(body);
  using testing::fault;
  auto client = std::make_shared<detail::http_client>(quick());
  const http_storage s(client, parse_url(srv.url()));
  CHECK(s.size() == body.size());

  SUBCASE("a short body then a closed connection: resumed from the first missing byte") {
    srv.script({fault::short_body});
    CHECK(read_string(s, 1000, 50'000) == body.substr(1000, 50'000));
    const auto r = srv.ranges();
    REQUIRE(r.size() == 2);
    CHECK(r[0] == "1000-50999");
    CHECK(r[1] == "26000-50999");  // the first 25000 bytes had landed
  }
  SUBCASE("short bodies in a row: each retry resumes further") {
    srv.script({fault::short_body, fault::short_body, fault::short_body});
    CHECK(read_string(s, 0, 80'000) == body.substr(0, 80'000));
    const auto r = srv.ranges();
    REQUIRE(r.size() == 4);
    CHECK(r[1] == "40000-79999");
    CHECK(r[2] == "60000-79999");
    CHECK(r[3] == "70000-79999");
  }
  SUBCASE("a wrong Content-Range once: retried") {
    srv.script({fault::wrong_content_range});
    CHECK(read_string(s, 10, 5000) == body.substr(10, 5000));
    CHECK(srv.gets() == 2);
  }
  SUBCASE("a wrong Content-Range every time: an error naming the URL and the rule, dst not trusted") {
    srv.script({fault::wrong_content_range, fault::wrong_content_range, fault::wrong_content_range,
                fault::wrong_content_range});
    expect_error([&] { read_string(s, 10, 5000); }, errc::io_error,
                 {srv.url(), "giving up after 4 attempts", "wrong Content-Range 'bytes 11-5010/100000'"});
  }
  SUBCASE("a Content-Length longer than the range: retried") {
    srv.script({fault::long_content_length});
    CHECK(read_string(s, 500, 600) == body.substr(500, 600));
    CHECK(srv.gets() == 2);
  }
  SUBCASE("a server that ignores Range: an error at once (a retry would get the same)") {
    srv.script({fault::ignore_range});
    expect_error([&] { read_string(s, 10, 20); }, errc::io_error,
                 {srv.url(), "ignored the Range header", "HTTP 200", "bytes 10-29"});
    CHECK(srv.gets() == 1);
  }
  SUBCASE("a 200 is right when the whole object was asked for") {
    srv.script({fault::ignore_range});
    CHECK(read_string(s, 0, body.size()) == body);
  }
  SUBCASE("503 with Retry-After: 1 waits a second, then succeeds") {
    srv.script({fault::status_503});
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(read_string(s, 123, 4567) == body.substr(123, 4567));
    CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(950));
    CHECK(srv.gets() == 2);
  }
  SUBCASE("429 twice, then success") {
    srv.script({fault::status_429, fault::status_429});
    CHECK(read_string(s, 99'000, 1000) == body.substr(99'000, 1000));
    CHECK(srv.gets() == 3);
  }
  SUBCASE("429 past max_attempts: an error with the last answer") {
    srv.script({fault::status_429, fault::status_429, fault::status_429, fault::status_429});
    expect_error([&] { read_string(s, 0, 10); }, errc::io_error, {srv.url(), "giving up after 4 attempts", "HTTP 429"});
  }
  SUBCASE("a redirect of a range read is followed, the range kept") {
    srv.script({fault::redirect});
    CHECK(read_string(s, 700, 300) == body.substr(700, 300));
    CHECK(srv.ranges() == std::vector<std::string>{"700-999", "700-999"});
  }
  SUBCASE("a server that stalls past read_timeout: the read is retried on a new connection") {
    http_options o = quick();
    o.read_timeout = std::chrono::milliseconds(200);
    const http_storage fast(std::make_shared<detail::http_client>(o), parse_url(srv.url()));
    srv.script({fault::stall});
    CHECK(read_string(fast, 5, 10) == body.substr(5, 10));
    CHECK(fast.client().stats().retries.load() ==
          1u);  // the read timed out and was retried: it did not wait out the stall
  }
  SUBCASE("a batch under a mix of faults lands every byte") {
    // parts of 2,000 bytes: each read a request of its own (no two merged), the faults spread
    // over them as the script gives them out
    http_options o = quick();
    o.part_bytes = 2000;
    const http_storage each(std::make_shared<detail::http_client>(o), parse_url(srv.url()));
    srv.script({fault::short_body, fault::status_429, fault::wrong_content_range, fault::long_content_length,
                fault::short_body, fault::status_429});
    std::vector<std::string> outs(40);
    std::vector<read_request> rs;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      outs[i].assign(2000, '\0');
      rs.push_back({i * 2400, std::as_writable_bytes(std::span(outs[i]))});
    }
    each.read_batch(rs);
    for (std::size_t i = 0; i < outs.size(); ++i) REQUIRE(outs[i] == body.substr(i * 2400, 2000));
  }
}

TEST_CASE("http: a HEAD without Content-Length: the size from a 1-byte GET's Content-Range") {
  const std::string body = random_bytes(4321, 10);
  testing::scripted_server srv(body, false);
  const http_storage s(srv.url(), quick());
  CHECK(s.size() == body.size());
  CHECK(srv.ranges() == std::vector<std::string>{"0-0"});
  CHECK(read_string(s, 4000, 321) == body.substr(4000, 321));
}

TEST_CASE("http: nothing listening is a clear error after bounded attempts") {
  const int port = testing::free_port();
  http_options o = quick();
  o.max_attempts = 3;
  expect_error([&] { http_storage("http://127.0.0.1:" + std::to_string(port) + "/x", o); }, errc::io_error,
               {"http://127.0.0.1:" + std::to_string(port) + "/x", "giving up after 3 attempts", "cannot connect"});
}

// ---------------------------------------------------------------------------------------
// an object that changes while it is read

TEST_CASE("http: an object replaced between reads is an error naming it, never bytes of two versions") {
  testing::nginx_site srv;
  const std::string v1 = random_bytes(300'000, 30), v2 = random_bytes(300'000, 31);
  testing::write_file(srv.www / "obj.bin", v1);
  const http_storage s(srv.url("obj.bin"), quick());
  REQUIRE(s.validator().etag.size() > 2);  // nginx's strong ETag of the file
  CHECK(read_string(s, 0, 1000) == v1.substr(0, 1000));
  // the same size, a later modification time (nginx's ETag is both): replaced by a rename
  testing::write_file(srv.www / "obj.new", v2);
  fs::last_write_time(srv.www / "obj.new", fs::last_write_time(srv.www / "obj.bin") + std::chrono::hours(1));
  fs::rename(srv.www / "obj.new", srv.www / "obj.bin");
  expect_error([&] { read_string(s, 1000, 5000); }, errc::io_error,
               {srv.url("obj.bin"), "the object changed while reading", "HTTP 412 to If-Match: " + s.validator().etag});
  std::vector<std::string> outs(8, std::string(20'000, '\0'));
  std::vector<read_request> rs;
  for (std::size_t i = 0; i < outs.size(); ++i) rs.push_back({i * 30'000, std::as_writable_bytes(std::span(outs[i]))});
  expect_error([&] { s.read_batch(rs); }, errc::io_error, {"the object changed while reading"});
  CHECK(s.client().stats().retries.load() == 0u);  // not retried: it would answer the same
  // opened again, it reads the new version
  const http_storage again(srv.url("obj.bin"), quick());
  CHECK(again.validator().etag != s.validator().etag);
  CHECK(read_string(again, 1000, 5000) == v2.substr(1000, 5000));
}

TEST_CASE("http: a server that ignores If-Match but answers with another ETag; Last-Modified when there is no ETag") {
  const std::string body = random_bytes(1000, 32);
  auto answer = [&](const std::string& etag_head, const std::string& etag_get, bool lm) {
    return [=](const std::string& head) {
      const std::string v = lm ? "Last-Modified: Wed, 21 Oct 2015 07:28:00 GMT\r\n" : "";
      if (head.starts_with("HEAD ")) return "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n" + etag_head + v + "\r\n";
      if (lm) return std::string("HTTP/1.1 412 Precondition Failed\r\nContent-Length: 0\r\n\r\n");
      return "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-9/1000\r\nContent-Length: 10\r\n" + etag_get +
             "\r\n" + body.substr(0, 10);
    };
  };
  {
    testing::raw_server srv(answer("ETag: \"v1\"\r\n", "ETag: \"v2\"\r\n", false));
    const http_storage s(srv.url(), quick());
    CHECK(s.validator().etag == "\"v1\"");
    expect_error([&] { read_string(s, 0, 10); }, errc::io_error,
                 {srv.url(), "the object changed while reading: ETag \"v1\" when opened, \"v2\" now"});
    const auto heads = srv.heads();
    REQUIRE(heads.size() == 2);
    CHECK(heads[1].find("\r\nIf-Match: \"v1\"") != std::string::npos);
  }
  {
    testing::raw_server srv(answer("ETag: \"v1\"\r\n", "ETag: \"v1\"\r\n", false));
    CHECK(read_string(http_storage(srv.url(), quick()), 0, 10) == body.substr(0, 10));
  }
  {  // a weak ETag is not sent (If-Match compares strongly), Last-Modified is
    testing::raw_server srv(answer("ETag: W/\"v1\"\r\n", "", true));
    const http_storage s(srv.url(), quick());
    CHECK(s.validator().etag.empty());
    CHECK(s.validator().last_modified == "Wed, 21 Oct 2015 07:28:00 GMT");
    expect_error([&] { read_string(s, 0, 10); }, errc::io_error,
                 {srv.url(), "changed while reading: HTTP 412 to If-Unmodified-Since: Wed, 21 Oct 2015 07:28:00 GMT"});
    CHECK(srv.heads().back().find("\r\nIf-Unmodified-Since: Wed, 21 Oct 2015 07:28:00 GMT") != std::string::npos);
    CHECK(srv.heads().back().find("If-Match") == std::string::npos);
  }
}

TEST_CASE(
    "http redirects: max_redirects hops are followed, one more is an error naming the limit; HEAD and range reads "
    "alike") {
  const std::string body = random_bytes(1000, 33);
  // /obj redirects to /hop1, /hop1 to /hop2, ...: /hopN answers once N reaches `hops`.
  // HEADs get absolute Locations, GETs relative ones (both resolved by the client).
  auto chain = [&](int head_hops, int get_hops) {
    return [=](const std::string& head) {
      const std::size_t p = head.find(' ') + 1;
      const std::string path = head.substr(p, head.find(' ', p) - p);
      const int at = path.starts_with("/hop") ? std::stoi(path.substr(4)) : 0;
      const bool is_head = head.starts_with("HEAD ");
      const int hops = is_head ? head_hops : get_hops;
      if (at < hops) {
        const std::string next = "/hop" + std::to_string(at + 1);
        const std::size_t host = head.find("\r\nHost: ") + 8;
        const std::string to = is_head ? "http://" + head.substr(host, head.find("\r\n", host) - host) + next : next;
        return "HTTP/1.1 302 Found\r\nLocation: " + to + "\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      }
      if (is_head) return std::string("HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n");
      return "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 100-199/1000\r\nContent-Length: 100\r\nConnection: "
             "close\r\n\r\n" +
             body.substr(100, 100);
    };
  };
  auto paths = [](testing::raw_server& srv) {
    std::vector<std::string> out;
    for (const std::string& h : srv.heads()) out.push_back(h.substr(0, h.find(" HTTP/1.1")));
    return out;
  };
  http_options o = quick();
  REQUIRE(o.max_redirects == 5u);  // the default
  SUBCASE("HEAD: 5 hops are followed; the object's size comes from the last") {
    testing::raw_server srv(chain(5, 0));
    CHECK(http_storage(srv.url(), o).size() == 1000u);
    CHECK(paths(srv) ==
          std::vector<std::string>{"HEAD /obj", "HEAD /hop1", "HEAD /hop2", "HEAD /hop3", "HEAD /hop4", "HEAD /hop5"});
  }
  SUBCASE("HEAD: a sixth hop is refused after 6 requests, naming the URL asked for and the limit") {
    testing::raw_server srv(chain(6, 0));
    expect_error([&] { http_storage(srv.url(), o); }, errc::io_error,
                 {srv.url() + ": more than 5 redirects (http_options::max_redirects); the last to " + srv.url("hop6")});
    CHECK(srv.requests() == 6);
  }
  SUBCASE("a range read: 5 hops are followed, the range kept on each; a loop is refused at the limit") {
    testing::raw_server srv(chain(0, 6));
    const http_storage s(srv.url(), o);
    expect_error([&] { read_string(s, 100, 100); }, errc::io_error,
                 {srv.url() + ": more than 5 redirects (http_options::max_redirects); the last to " + srv.url("hop6")});
    const auto heads = srv.heads();
    REQUIRE(heads.size() == 1u + 6u);
    for (std::size_t i = 1; i < heads.size(); ++i)
      CHECK(heads[i].find("\r\nRange: bytes=100-199") != std::string::npos);
    o.max_redirects = 6;
    const http_storage more(srv.url(), o);
    CHECK(read_string(more, 100, 100) == body.substr(100, 100));
    CHECK(srv.requests() == 7 + 1 + 7);
  }
  SUBCASE("max_redirects = 0: the first redirect is an error, of a HEAD and of a range read") {
    o.max_redirects = 0;
    {
      testing::raw_server srv(chain(1, 0));
      expect_error(
          [&] { http_storage(srv.url(), o); }, errc::io_error,
          {srv.url() + ": more than 0 redirects (http_options::max_redirects); the last to " + srv.url("hop1")});
      CHECK(srv.requests() == 1);
    }
    testing::raw_server srv(chain(0, 1));
    const http_storage s(srv.url(), o);
    expect_error([&] { read_string(s, 100, 100); }, errc::io_error,
                 {srv.url() + ": more than 0 redirects (http_options::max_redirects); the last to " + srv.url("hop1")});
    CHECK(srv.requests() == 2);
  }
}

// ---------------------------------------------------------------------------------------
// faults injected by a proxy (tests/fault_proxy.py) between the client and nginx

namespace {

/// w: F32 [64, 3000] and e: BF16 [40, 24], saved by 2 ranks (w by row halves, e by column
/// halves) into dir.
void save_resharded_fixture(const fs::path& dir, const std::string& w, const std::string& e) {
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& comm) {
    const std::uint64_t r = static_cast<std::uint64_t>(comm.rank());
    std::string wm = w.substr(r * 32 * 3000 * 4, 32 * 3000 * 4), em;
    for (std::uint64_t row = 0; row < 40; ++row) em += e.substr((row * 24 + r * 12) * 2, 12 * 2);
    std::vector<flat_view> v{{"w",
                              dtype::F32,
                              {64, 3000},
                              shard_spec(block_spec({32, 3000}, {32 * r, 0})),
                              reinterpret_cast<std::byte*>(wm.data()),
                              wm.size()},
                             {"e",
                              dtype::BF16,
                              {40, 24},
                              shard_spec(block_spec({40, 12}, {0, 12 * r})),
                              reinterpret_cast<std::byte*>(em.data()),
                              em.size()}};
    save(file_directory(dir), std::span<const flat_view>(v), comm);
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
}

/// Loads the fixture from d as 3 ranks (w by column thirds, e by row thirds: 14, 13, 13) and
/// checks every byte against w and e cut here; throws what a load throws.
template <ReadableDirectory D>
void load_resharded_fixture(const D& d, const std::string& w, const std::string& e) {
  for (std::uint64_t r = 0; r < 3; ++r) {
    const std::uint64_t e_rows = r == 0 ? 14 : 13, e_first = r == 0 ? 0 : 14 + (r - 1) * 13;
    std::string wm(64 * 1000 * 4, '\x5a'), em(e_rows * 24 * 2, '\x5a');
    std::vector<flat_view> v{{"w",
                              dtype::F32,
                              {64, 3000},
                              shard_spec(block_spec({64, 1000}, {0, 1000 * r})),
                              reinterpret_cast<std::byte*>(wm.data()),
                              wm.size()},
                             {"e",
                              dtype::BF16,
                              {40, 24},
                              shard_spec(block_spec({e_rows, 24}, {e_first, 0})),
                              reinterpret_cast<std::byte*>(em.data()),
                              em.size()}};
    load(d, std::span<const flat_view>(v));
    std::string want_w;
    for (std::uint64_t row = 0; row < 64; ++row) want_w += w.substr((row * 3000 + 1000 * r) * 4, 1000 * 4);
    REQUIRE(wm == want_w);
    REQUIRE(em == e.substr(e_first * 24 * 2, e_rows * 24 * 2));
  }
}

/// Options for loads through the proxy: small parts (many requests), short timeouts, room
/// for several faults in a row on one request.
http_options through_proxy() {
  http_options o = quick();
  o.part_bytes = 32 << 10;
  o.requests_in_flight = 4;
  o.read_timeout = std::chrono::milliseconds(400);
  o.max_attempts = 10;
  o.retry_after_max = std::chrono::milliseconds(1500);
  return o;
}

}  // namespace

TEST_CASE("http faults through a proxy: checkpoint loads on several seeds land bit-exact, or fail with a clear error") {
  testing::nginx_site srv;
  const std::string w = random_bytes(64 * 3000 * 4, 40), e = random_bytes(40 * 24 * 2, 41);
  save_resharded_fixture(srv.www / "ckpt", w, e);
  std::map<std::string, int> kinds;
  int faults = 0;
  auto count = [&](const testing::fault_proxy& px) {
    for (const auto& f : px.faults()) {
      ++kinds[f.substr(0, f.find(' '))];
      ++faults;
    }
  };

  // every fault but ignore_range is retried: with 10 attempts each load completes
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    CAPTURE(seed);
    testing::fault_proxy px(
        srv.port, seed, 0.12,
        {"--faults", "reset,stall,s503,s503_date,s429,drop,truncate,wrong_range,wrong_length", "--stall", "2"});
    const http_directory d(px.url(srv.name + "/ckpt"), through_proxy());
    load_resharded_fixture(d, w, e);
    count(px);
    CHECK(d.client().stats().retries.load() > 0u);
  }
  MESSAGE("retried faults injected over 5 seeds: " << faults);
  for (const char* k :
       {"reset", "stall", "s503", "s503_date", "s429", "drop", "truncate", "wrong_range", "wrong_length"})
    CHECK_MESSAGE(kinds[k] > 0, "no '", k, "' fault was injected: the schedule tests nothing of it");

  // with a server that may ignore Range too, a load either lands every byte or stops with an
  // error naming the object and the rule
  int completed = 0, failed = 0;
  for (std::uint64_t seed = 11; seed <= 14; ++seed) {
    CAPTURE(seed);
    testing::fault_proxy px(srv.port, seed, 0.12, {"--stall", "2"});
    const http_directory d(px.url(srv.name + "/ckpt"), through_proxy());
    try {
      load_resharded_fixture(d, w, e);
      ++completed;
    } catch (const error& x) {
      ++failed;
      const std::string m = x.what();
      CHECK(x.code() == errc::io_error);
      CHECK_MESSAGE(m.find(px.url(srv.name + "/ckpt/")) != std::string::npos, m);
      CHECK_MESSAGE(m.find("ignored the Range header") != std::string::npos, m);
    }
    count(px);
  }
  MESSAGE("all faults, 4 seeds: " << completed << " loads completed bit-exact, " << failed
                                  << " stopped by a server ignoring Range; faults injected in all: " << faults);
  CHECK(kinds["ignore_range"] > 0);
  CHECK(failed > 0);
}

// ---------------------------------------------------------------------------------------
// servers that answer what no server should

TEST_CASE("http bad servers: malformed answers are clear errors after bounded attempts, no size taken on their word") {
  http_options o = quick();
  o.max_attempts = 2;
  auto fixed = [](std::string bytes) { return [bytes](const std::string&) { return bytes; }; };
  struct bad_case {
    const char* what;
    std::string answer;
    const char* rule;
  };
  std::string huge_header = "HTTP/1.1 200 OK\r\n";
  while (huge_header.size() < (1 << 20)) huge_header += "X-Pad: " + std::string(100, 'a') + "\r\n";
  const std::vector<bad_case> cases{
      {"a status code that is not a number", "HTTP/1.1 2OO OK\r\nContent-Length: 0\r\n\r\n",
       "reading the response header failed"},
      {"a version that is not HTTP/1.x", "HTTP/9.9 200 OK\r\nContent-Length: 0\r\n\r\n",
       "reading the response header failed"},
      {"no status line at all", "hello there\r\n\r\n", "reading the response header failed"},
      {"a header without a colon", "HTTP/1.1 200 OK\r\nContent-Length 5\r\n\r\nhello",
       "reading the response header failed"},
      {"a Content-Length that is not a number", "HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n",
       "reading the response header failed"},
      {"a Content-Length past 2^64", "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
       "reading the response header failed"},
      {"two different Content-Lengths", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
       "reading the response header failed"},
      {"a header block of 1 MiB", huge_header + "\r\n", "reading the response header failed"},
      {"nothing, then a close", "", "reading the response header failed"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    testing::raw_server srv(fixed(c.answer));
    expect_error([&] { http_storage(srv.url(), o); }, errc::io_error,
                 {srv.url(), "giving up after 2 attempts", c.rule});
    CHECK(srv.requests() == 2);
  }

  // an absurd Content-Length: a HEAD may state it, but no read takes it for a body
  const std::string absurd = "1000000000000000000";
  {
    testing::raw_server srv([&](const std::string& head) {
      if (head.starts_with("HEAD ")) return "HTTP/1.1 200 OK\r\nContent-Length: " + absurd + "\r\n\r\n";
      return "HTTP/1.1 200 OK\r\nContent-Length: " + absurd + "\r\n\r\nxxxxxxxx";
    });
    const http_storage s(srv.url(), o);
    CHECK(s.size() == 1'000'000'000'000'000'000u);
    expect_error([&] { read_string(s, 0, 100); }, errc::io_error,
                 {srv.url(), "ignored the Range header (HTTP 200 with the whole body of " + absurd + " bytes)"});
    detail::http_request get;
    get.url = parse_url(srv.url());
    expect_error([&] { s.client().send(get); }, errc::io_error,
                 {srv.url(), "Content-Length " + absurd + " is over the 16777216 bytes this client reads into memory"});
  }
  {  // the right Content-Range, an absurd Content-Length: retried, then an error
    testing::raw_server srv([&](const std::string& head) {
      if (head.starts_with("HEAD ")) return std::string("HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n");
      return "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-99/1000\r\nContent-Length: " + absurd +
             "\r\n\r\nxxxx";
    });
    const http_storage s(srv.url(), o);
    expect_error([&] { read_string(s, 0, 100); }, errc::io_error,
                 {srv.url(), "giving up after 2 attempts", "wrong Content-Length " + absurd + " for bytes 0-99"});
  }
  {  // a chunk size past 2^64 and an endless chunked body: refused, not allocated
    testing::raw_server srv(
        fixed("HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffffff\r\nabc"));
    detail::http_client client(o);
    detail::http_request get;
    get.url = parse_url(srv.url());
    expect_error([&] { client.send(get); }, errc::io_error,
                 {srv.url(), "giving up after 2 attempts", "reading the response body failed"});
  }
  {
    std::string endless = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    while (endless.size() < (std::size_t(20) << 20)) endless += "100000\r\n" + std::string(1 << 20, 'z') + "\r\n";
    testing::raw_server srv(fixed(endless));
    detail::http_client client(o);
    detail::http_request get;
    get.url = parse_url(srv.url());
    expect_error([&] { client.send(get); }, errc::io_error, {srv.url(), "response body over 16777216 bytes"});
  }
}

TEST_CASE(
    "http deadlines: a stalled server, an endless Retry-After and a redirect out of HTTP end a request, naming what") {
  http_options o = quick();
  o.max_attempts = 100;  // the deadline, not the attempts, ends these
  o.operation_timeout = std::chrono::milliseconds(1500);
  o.read_timeout = std::chrono::milliseconds(60'000);  // longer than the deadline: the deadline cuts it
  detail::http_request get;
  {  // a server that takes the request and answers nothing for longer than the deadline
    testing::raw_server srv([](const std::string&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      return std::string();
    });
    detail::http_client client(o);
    get.url = parse_url(srv.url());
    expect_error([&] { client.send(get); }, errc::io_error,
                 {srv.url(), "no complete answer within the operation's 1.5 s (http_options::operation_timeout)",
                  "waiting for: reading the response header failed"});
    CHECK(srv.requests() == 1);  // the one attempt the deadline allowed
  }
  {  // 503 with Retry-After: 86400 (a day): given up at once, not waited for
    testing::raw_server srv([](const std::string&) {
      return std::string("HTTP/1.1 503 Busy\r\nRetry-After: 86400\r\nContent-Length: 0\r\n\r\n");
    });
    detail::http_client client(o);
    get = {};
    get.url = parse_url(srv.url());
    expect_error([&] { client.send(get); }, errc::io_error,
                 {srv.url(), "the server asks to be retried after 86400 s, past the deadline", "HTTP 503"});
    CHECK(srv.requests() == 1);
  }
  {  // a redirect to s3:// is not fetched (as HTTP or otherwise)
    testing::raw_server srv([](const std::string& head) {
      if (head.starts_with("HEAD "))
        return std::string("HTTP/1.1 302 Found\r\nLocation: s3://bucket/key\r\nContent-Length: 0\r\n\r\n");
      return std::string("HTTP/1.1 302 Found\r\nLocation: s3://bucket/key\r\nContent-Length: 0\r\n\r\n");
    });
    expect_error([&] { http_storage(srv.url(), o); }, errc::io_error,
                 {srv.url(), "redirected to s3://bucket/key, which is not http:// or https://; not followed"});
    CHECK(srv.requests() == 1);
  }
}

#if SHARDSAFE_HTTP_TLS
TEST_CASE("https: nginx with a test CA: verified with the CA file, refused without it, bytes exact") {
  testing::nginx_site srv(true);
  const std::string body = random_bytes(300'000, 17);
  testing::write_file(srv.www / "obj.bin", body);
  http_options o;
  o.ca_file = srv.ca_file();
  const http_storage s(srv.url("obj.bin"), o);
  CHECK(s.size() == body.size());
  CHECK(read_string(s, 12'345, 200'000) == body.substr(12'345, 200'000));
  std::vector<std::string> outs(20, std::string(5000, '\0'));
  std::vector<read_request> rs;
  for (std::size_t i = 0; i < outs.size(); ++i) rs.push_back({i * 14'000, std::as_writable_bytes(std::span(outs[i]))});
  s.read_batch(rs);
  for (std::size_t i = 0; i < outs.size(); ++i) CHECK(outs[i] == body.substr(i * 14'000, 5000));
  // the system's store does not know the test CA: a certificate error, not retried
  http_options sys = quick();
  expect_error([&] { http_storage(srv.url("obj.bin"), sys); }, errc::io_error,
               {srv.url("obj.bin"), "TLS handshake with 127.0.0.1:" + std::to_string(srv.port) + " failed",
                "certificate verify failed"});
  // a CA file that is not there
  http_options missing;
  missing.ca_file = (srv.server.dir.path / "absent.pem").string();
  expect_error([&] { http_storage(srv.url("obj.bin"), missing); }, errc::invalid_argument,
               {"absent.pem", "cannot load CA file"});
}
#endif

// ---------------------------------------------------------------------------------------
// the shardsafe tool on http:// URLs (docs/FORMAT.md §4), against its run on the same folder

namespace {

bool have_remote_tool() { return SHARDSAFE_HTTP_TLS && testing::have_tool(); }

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

/// inspect, verify and digest of url print what they print for the local path (its name
/// replaced by the URL), and exit 0.
void check_same_output(const std::string& local, const std::string& url) {
  for (const std::string cmd : {"inspect", "verify", "digest"}) {
    CAPTURE(cmd);
    CAPTURE(url);
    const auto l = testing::run_tool({cmd, local}), r = testing::run_tool({cmd, url});
    REQUIRE_MESSAGE(l.code == 0, l.err);
    CHECK_MESSAGE(r.code == 0, r.err);
    CHECK(r.err.empty());
    CHECK(r.out == replace_all(l.out, local, url));
  }
}

}  // namespace

TEST_CASE("http: the tool reads checkpoints, HF folders and files from nginx as from the local folder" *
          doctest::skip(!have_remote_tool())) {
  testing::nginx_site srv;
  testing::save_two_rank_checkpoint(11, file_directory(srv.www / "ckpt"));
  testing::save_two_rank_checkpoint(11, file_directory(srv.www / "pair" / "model"));
  testing::save_two_rank_checkpoint(11, file_directory(srv.www / "pair" / "optim"));
  const auto ts = fixtures::sample_tensors();
  fixtures::make_indexed(file_directory(srv.www / "hf"), ts);
  const std::string one = fixtures::file_of(ts.front());
  for (const std::string& f : std::vector<std::string>{"ckpt", "pair", "hf", "hf/" + one})
    check_same_output((srv.www / f).string(), srv.url(f));

  testing::temp_dir out("tool_http");
  // unshard and to-hf read through HTTP write what they write from the local folder
  for (const std::string f : {"ckpt", "pair"}) {  // (the HF fixture holds an F4 tensor: no unshard)
    CAPTURE(f);
    const auto l =
        testing::run_tool({"unshard", (srv.www / f).string(), (out.path / (f + "_local.safetensors")).string()});
    const auto r = testing::run_tool({"unshard", srv.url(f), (out.path / (f + "_http.safetensors")).string()});
    REQUIRE_MESSAGE(l.code == 0, l.err);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(testing::slurp(out.path / (f + "_http.safetensors")) ==
          testing::slurp(out.path / (f + "_local.safetensors")));
  }
  for (const std::string f : {"ckpt", "pair"}) {
    CAPTURE(f);
    const auto l = testing::run_tool(
        {"to-hf", (srv.www / f).string(), (out.path / "hf_local").string(), "--max-shard-size", "200"});
    const auto r = testing::run_tool({"to-hf", srv.url(f), (out.path / "hf_http").string(), "--max-shard-size", "200"});
    REQUIRE_MESSAGE(l.code == 0, l.err);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    std::size_t files = 0;
    for (const auto& e : fs::directory_iterator(out.path / "hf_local")) {
      ++files;
      CHECK(testing::slurp(out.path / "hf_http" / e.path().filename()) == testing::slurp(e.path()));
    }
    CHECK(files == static_cast<std::size_t>(std::distance(fs::directory_iterator(out.path / "hf_http"), {})));
    fs::remove_all(out.path / "hf_local");
    fs::remove_all(out.path / "hf_http");
  }

  // HTTP is read-only: writing to it is refused before anything is read
  for (const auto& args : {std::vector<std::string>{"unshard", (srv.www / "ckpt").string(), srv.url("x.safetensors")},
                           std::vector<std::string>{"to-hf", (srv.www / "ckpt").string(), srv.url("out")}}) {
    const auto r = testing::run_tool(args);
    CHECK(r.code == 1);
    CHECK(r.out.empty());
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(args[2]) != std::string::npos);
    CHECK(r.err.find("read-only") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(srv.www / "out"));

  // a missing object or folder: exit 1, one line naming the URL
  for (const std::string f : {"absent", "absent.safetensors", "hf/absent.safetensors"}) {
    for (const std::string cmd : {"inspect", "digest"}) {
      CAPTURE(f);
      const auto r = testing::run_tool({cmd, srv.url(f)});
      CHECK(r.code == 1);
      CHECK(r.out.empty());
      CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
      CHECK(r.err.find(srv.url(f)) != std::string::npos);
    }
  }
  // a rank file gone from behind the server: verify names its URL
  fs::remove(srv.www / "ckpt" / "rank_1.safetensors");
  const auto r = testing::run_tool({"verify", srv.url("ckpt")});
  CHECK(r.code == 1);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.find(srv.url("ckpt/rank_1.safetensors")) != std::string::npos);
}

TEST_CASE("http: the tool reads torch DCP folders from nginx as from the local folder" * testing::torch_check() *
          doctest::skip(!have_remote_tool())) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  testing::nginx_site srv;
  const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "dcp_fixture.py";
  const auto pr = testing::peer(testing::torch_python, {script.string(), (srv.www / "dcp").string()});
  REQUIRE_MESSAGE(pr.code == 0, pr.err);
  for (const std::string f : {"ckpt", "ckpt_single"})
    check_same_output((srv.www / "dcp" / f).string(), srv.url("dcp/" + f));
}

TEST_CASE(
    "http: the tool reads pytorch_model.bin folders and files, zip and legacy, from nginx as from the local folder" *
    testing::torch_check() * doctest::skip(!have_remote_tool())) {
  REQUIRE_MESSAGE(testing::have_torch(), "SHARDSAFE_REQUIRE_PYTHON=1 but /usr/bin/python3 cannot import torch");
  testing::nginx_site srv;
  const auto script = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "torch_save_fixture.py";
  const auto pr = testing::peer(testing::torch_python, {script.string(), (srv.www / "bin").string()});
  REQUIRE_MESSAGE(pr.code == 0, pr.err);
  for (const std::string f : {"single", "sharded", "single_legacy", "sharded_legacy", "nested_legacy",
                              "single_legacy/pytorch_model.bin", "sharded_legacy/pytorch_model-00002-of-00002.bin"})
    check_same_output((srv.www / "bin" / f).string(), srv.url("bin/" + f));
}
