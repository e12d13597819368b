// Tests of storage/s3.hpp and storage/detail/s3_sigv4.hpp: SigV4 against AWS's published
// examples and against botocore (an independent implementation), and a checkpoint saved to and
// loaded from moto_server on 127.0.0.1 (started by the test), with multipart uploads, listing
// across pages, folders, removal, errors and an upload that fails half-way.
#include "shardsafe/storage/s3.hpp"

#include <doctest/doctest.h>

#include <fstream>
#include <mutex>
#include <sstream>
#include <random>

#include "support/checkpoint_fixtures.hpp"
#include "support/servers.hpp"
#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/rotation.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/storage/file.hpp"
#include "shardsafe/storage/text.hpp"
#include "support/test_util.hpp"
#include "support/thread_world.hpp"

using namespace shardsafe;
using testing::expect_error;
using testing::random_bytes;
namespace fs = std::filesystem;

namespace {

const std::string empty_hash = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
const aws_credentials aws_example{"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""};

/// Environment variables set (or unset) for a scope, restored at its end.
struct saved_env {
  std::vector<std::pair<std::string, std::optional<std::string>>> v;
  void set(const char* k, const char* val) {
    const char* old = std::getenv(k);
    v.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
    if (val)
      ::setenv(k, val, 1);
    else
      ::unsetenv(k);
  }
  ~saved_env() {
    for (auto it = v.rbegin(); it != v.rend(); ++it)
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
  }
};

/// moto_server on a free port of 127.0.0.1 (one for the whole binary: moto_shared()), and
/// buckets in it.
struct moto {
  testing::temp_dir dir{"moto"};
  int port = 0;
  std::unique_ptr<testing::child_process> proc;
  moto() {
    proc = testing::start_server(
        port, [](int p) { return std::vector<std::string>{"moto_server", "-H", "127.0.0.1", "-p", std::to_string(p)}; },
        dir.path, std::chrono::seconds(60));
  }
  s3_options options() const {
    s3_options o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(port);
    o.region = "us-east-1";
    o.credentials = aws_credentials{"testing", "testing", "session token"};
    o.http.backoff_initial = std::chrono::milliseconds(10);
    return o;
  }
  /// The bucket `name`, made if it is not there yet (a case runs again for each of its
  /// subcases, on the same shared server; the cases' buckets have names of their own).
  s3_directory bucket(const std::string& name, s3_options o) const {
    s3_directory root("s3://" + name, o);
    try {
      root.create_bucket();
    } catch (const shardsafe::error& e) {
      if (std::string(e.what()).find("BucketAlreadyOwnedByYou") == std::string::npos) throw;
    }
    return root;
  }
};

/// The binary's one moto_server, started by the first case that asks, stopped at exit.
moto& moto_shared() {
  static moto m;
  return m;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// SigV4

TEST_CASE("sigv4: the examples of AWS's S3 documentation (Signature Version 4, header auth)") {
  // "Example: GET Object": a range read of examplebucket/test.txt
  auto r = detail::sigv4_sign("GET", "/test.txt", "",
                              {{"Host", "examplebucket.s3.amazonaws.com"},
                               {"Range", "bytes=0-9"},
                               {"x-amz-content-sha256", empty_hash},
                               {"x-amz-date", "20130524T000000Z"}},
                              empty_hash, aws_example, "us-east-1", "s3", "20130524T000000Z");
  CHECK(r.canonical_request ==
        "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\nx-amz-content-sha256:" + empty_hash +
            "\nx-amz-date:20130524T000000Z\n\nhost;range;x-amz-content-sha256;x-amz-date\n" + empty_hash);
  CHECK(r.string_to_sign ==
        "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
        "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
  CHECK(r.signature == "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  CHECK(r.authorization ==
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  const std::vector<std::pair<std::string, std::string>> h{{"host", "examplebucket.s3.amazonaws.com"},
                                                           {"x-amz-content-sha256", empty_hash},
                                                           {"x-amz-date", "20130524T000000Z"}};
  // "Example: GET Bucket Lifecycle": a query key without a value
  CHECK(detail::sigv4_sign("GET", "/", "lifecycle", h, empty_hash, aws_example, "us-east-1", "s3", "20130524T000000Z")
            .signature == "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");
  // "Example: Get Bucket (List Objects)": query pairs sorted by key
  CHECK(detail::sigv4_sign("GET", "/", "prefix=J&max-keys=2", h, empty_hash, aws_example, "us-east-1", "s3",
                           "20130524T000000Z")
            .signature == "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
}

TEST_CASE(
    "sigv4: the same signatures as botocore's S3SigV4Auth, with a session token and keys with spaces and unicode") {
  // botocore (shipped with the aws CLI) computes the canonical request, string to sign and
  // signature of the same request on its own
  const std::string script = R"(
import json, sys
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
a = json.loads(sys.argv[1])
req = AWSRequest(method=a['method'], url=a['url'], headers=a['headers'], data=b'')
req.context['timestamp'] = a['date']
auth = S3SigV4Auth(Credentials(a['ak'], a['sk'], a['token'] or None), 's3', a['region'])
cr = auth.canonical_request(req)
print(auth.signature(auth.string_to_sign(req, cr), req))
)";
  struct sample {
    std::string method, key, query, token, region, payload;
  };
  const std::vector<sample> samples{
      {"GET", "ckpt/rank_0.safetensors", "", "", "us-east-1", ""},
      {"PUT", "runs/my model/step 100/métadata ü.json", "", "FQoGZXIvYXdzEJr//////////wEaDOy token", "eu-west-3",
       "{\"a\": 1}"},
      {"GET", "", "list-type=2&prefix=" + percent_encode("runs/my model/") + "&delimiter=%2F&max-keys=3", "tok",
       "us-west-2", ""},
      {"POST", "big/rank_1.safetensors", "uploadId=" + percent_encode("a b/c+d=="), "", "ap-south-1", "<x/>"},
      {"HEAD", "πλάκα/文件 name.bin", "", "", "us-east-1", ""},
  };
  for (const bool virt : {false, true})
    for (const auto& s : samples) {
      INFO((virt ? "virtual-hosted " : "path-style ") << s.method << " " << s.key << " ?" << s.query);
      // path-style at a custom endpoint; virtual-hosted at AWS's endpoint, its URL as s3_directory makes it
      const std::string vhost = "bucket.s3." + s.region + ".amazonaws.com";
      std::string path = "/bucket" + (s.key.empty() ? "" : "/" + percent_encode(s.key, true));
      if (virt) {
        s3_options vo;
        vo.region = s.region;
        vo.credentials = aws_example;
        vo.addressing = s3_addressing::virtual_hosted;
        vo.endpoint = "https://s3." + s.region + ".amazonaws.com";
        s3_directory vd("s3://bucket", vo);
        path = "/" + percent_encode(s.key, true);
        if (!s.key.empty()) {  // the URL s3_directory requests the key at
          std::string rest = s.key;
          for (std::size_t slash; (slash = rest.find('/')) != std::string::npos; rest = rest.substr(slash + 1))
            vd = vd.sub(rest.substr(0, slash));
          const url_parts vu = vd.url_of(rest);
          CHECK(vu.host == vhost);
          CHECK(vu.target == path);
        }
      }
      const std::string url = (virt ? "https://" + vhost : std::string("http://127.0.0.1:9000")) + path +
                              (s.query.empty() ? "" : "?" + s.query);
      const std::string date = "20240229T235959Z", hash = detail::sha256_hex(s.payload);
      std::vector<std::pair<std::string, std::string>> headers{{"x-amz-date", date}, {"x-amz-content-sha256", hash}};
      if (!s.token.empty()) headers.emplace_back("x-amz-security-token", s.token);
      const aws_credentials c{"AKIDEXAMPLE", "secret key with / and + and ü", s.token};
      std::string hj;
      for (const auto& [k, v] : headers)
        hj += (hj.empty() ? "" : ",") + testing::json_quoted(k) + ":" + testing::json_quoted(v);
      const std::string json = "{\"method\":" + testing::json_quoted(s.method) +
                               ",\"url\":" + testing::json_quoted(url) + ",\"headers\":{" + hj + "},\"date\":\"" +
                               date + "\",\"ak\":\"" + c.access_key_id +
                               "\",\"sk\":" + testing::json_quoted(c.secret_access_key) +
                               ",\"token\":" + testing::json_quoted(s.token) + ",\"region\":\"" + s.region + "\"}";
      // the test command requires the Python peers (moto_server's Python has botocore)
      const auto py = testing::python("python3", {"-c", script, json});
      if (!py) return;
      auto signed_headers = headers;
      signed_headers.emplace_back("host", virt ? vhost : std::string("127.0.0.1:9000"));
      const auto mine = detail::sigv4_sign(s.method, path, s.query, signed_headers, hash, c, s.region, "s3", date);
      CHECK(mine.signature + "\n" == py->out);
    }
}

TEST_CASE("s3: credentials from the environment and from a credentials file profile") {
  testing::temp_dir t;
  testing::write_file(
      t.path / "credentials",
      "[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = sdefault\n\n"
      "[profile other]\n aws_access_key_id=AKOTHER \naws_secret_access_key = s other\naws_session_token = tok\n");
  const auto c = detail::credentials_from_file(t.path / "credentials", "other");
  REQUIRE(c);
  CHECK(c->access_key_id == "AKOTHER");
  CHECK(c->secret_access_key == "s other");
  CHECK(c->session_token == "tok");
  CHECK(detail::credentials_from_file(t.path / "credentials", "default")->access_key_id == "AKDEFAULT");
  CHECK_FALSE(detail::credentials_from_file(t.path / "credentials", "absent"));
  CHECK_FALSE(detail::credentials_from_file(t.path / "nothing", "default"));
  // through the environment: the variables first, else AWS_PROFILE of AWS_SHARED_CREDENTIALS_FILE
  saved_env env;
  env.set("AWS_ACCESS_KEY_ID", "AKENV");
  env.set("AWS_SECRET_ACCESS_KEY", "senv");
  env.set("AWS_SESSION_TOKEN", "tenv");
  const aws_credentials e = aws_credentials_from_environment();
  CHECK((e.access_key_id == "AKENV" && e.secret_access_key == "senv" && e.session_token == "tenv"));
  env.set("AWS_SECRET_ACCESS_KEY", nullptr);
  expect_error([] { aws_credentials_from_environment(); }, errc::invalid_argument, {"AWS_SECRET_ACCESS_KEY is not"});
  env.set("AWS_ACCESS_KEY_ID", nullptr);
  env.set("AWS_SHARED_CREDENTIALS_FILE", (t.path / "credentials").c_str());
  env.set("AWS_PROFILE", "other");
  CHECK(aws_credentials_from_environment().access_key_id == "AKOTHER");
  CHECK(aws_credentials_from_environment("default").access_key_id == "AKDEFAULT");
  expect_error([] { aws_credentials_from_environment("absent"); }, errc::not_found, {"no AWS credentials", "'absent'"});
}

TEST_CASE(
    "s3: addressing: virtual-hosted for AWS's endpoint and DNS-label buckets, path-style for custom endpoints, as "
    "configured") {
  testing::temp_dir t;
  saved_env env;
  env.set("AWS_ENDPOINT_URL", nullptr);
  env.set("AWS_PROFILE", nullptr);
  env.set("AWS_CONFIG_FILE", (t.path / "config").c_str());
  s3_options o;
  o.credentials = aws_example;
  o.region = "eu-west-1";
  auto url = [&](const std::string& u, const s3_options& x) { return s3_directory(u, x).url_of("rank 0.bin").str(); };
  // no config file: botocore's auto rule
  CHECK(url("s3://my-bucket/run", o) == "https://my-bucket.s3.eu-west-1.amazonaws.com/run/rank%200.bin");
  CHECK(url("s3://my.bucket/run", o) == "https://s3.eu-west-1.amazonaws.com/my.bucket/run/rank%200.bin");  // dots
  CHECK(url("s3://my_bucket/run", o) == "https://s3.eu-west-1.amazonaws.com/my_bucket/run/rank%200.bin");
  CHECK(url("s3://ab/run", o) == "https://s3.eu-west-1.amazonaws.com/ab/run/rank%200.bin");  // too short
  CHECK(s3_directory("s3://my-bucket", o).url_of("x").target == "/x");
  {
    s3_options e = o;
    e.endpoint = "http://127.0.0.1:9000/base";
    CHECK(url("s3://my-bucket/run", e) == "http://127.0.0.1:9000/base/my-bucket/run/rank%200.bin");
    e.addressing = s3_addressing::virtual_hosted;
    CHECK(url("s3://my-bucket/run", e) == "http://my-bucket.127.0.0.1:9000/base/run/rank%200.bin");
    env.set("AWS_ENDPOINT_URL", "http://minio.local:9000");
    CHECK(url("s3://my-bucket/run", o) == "http://minio.local:9000/my-bucket/run/rank%200.bin");
    env.set("AWS_ENDPOINT_URL", nullptr);
    s3_options p = o;
    p.addressing = s3_addressing::path;
    CHECK(url("s3://my-bucket/run", p) == "https://s3.eu-west-1.amazonaws.com/my-bucket/run/rank%200.bin");
    p.addressing = s3_addressing::virtual_hosted;
    expect_error([&] { s3_directory("s3://my.bucket/run", p); }, errc::invalid_argument,
                 {"s3://my.bucket", "virtual-hosted addressing needs a bucket name that is a DNS label"});
  }
  // ~/.aws/config: the profile's s3 addressing_style, as the AWS CLI writes it
  testing::write_file(
      t.path / "config",
      "[default]\nregion = eu-west-1\ns3 =\n    addressing_style = path\n    max_concurrent_requests = 4\n"
      "[profile vh]\ns3 =\n  addressing_style = virtual\n[profile other]\naddressing_style = path\n"
      "[profile bad]\ns3 =\n  addressing_style = sideways\n");
  CHECK(url("s3://my-bucket/run", o) == "https://s3.eu-west-1.amazonaws.com/my-bucket/run/rank%200.bin");
  {
    s3_options v = o;
    v.profile = "vh";
    v.endpoint = "http://localhost:9000";
    CHECK(url("s3://my-bucket/run", v) == "http://my-bucket.localhost:9000/run/rank%200.bin");
    v.addressing = s3_addressing::path;  // the option wins over the file
    CHECK(url("s3://my-bucket/run", v) == "http://localhost:9000/my-bucket/run/rank%200.bin");
    v.addressing = s3_addressing::automatic;
    v.profile = "other";  // addressing_style outside an s3 block: not a setting
    CHECK(url("s3://my-bucket/run", v) == "http://localhost:9000/my-bucket/run/rank%200.bin");
    v.endpoint.clear();
    CHECK(url("s3://my-bucket/run", v) == "https://my-bucket.s3.eu-west-1.amazonaws.com/run/rank%200.bin");
    v.profile = "bad";
    expect_error([&] { s3_directory("s3://my-bucket/run", v); }, errc::invalid_argument,
                 {(t.path / "config").string(), "profile 'bad'", "'sideways' is none of auto, path, virtual"});
    env.set("AWS_PROFILE", "vh");
    v.profile.clear();
    CHECK(url("s3://my-bucket/run", v) == "https://my-bucket.s3.eu-west-1.amazonaws.com/run/rank%200.bin");
  }
}

TEST_CASE("s3: XML error bodies become messages naming the object and S3's code") {
  detail::http_response r;
  r.status = 404;
  r.body =
      "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>The specified key does not "
      "exist.</Message></Error>";
  expect_error([&] { detail::throw_s3_error("s3://b/k", "GET", r); }, errc::not_found,
               {"s3://b/k: GET: NoSuchKey: The specified key does not exist. (HTTP 404)"});
  r.status = 403;
  r.body = "<Error><Code>SignatureDoesNotMatch</Code><Message>a &lt;b&gt; &amp; &#233;</Message></Error>";
  expect_error([&] { detail::throw_s3_error("s3://b/k", "PUT", r); }, errc::io_error,
               {"SignatureDoesNotMatch: a <b> & \xc3\xa9 (HTTP 403)"});
  r.body = "<html>\x01 proxy says no";
  expect_error([&] { detail::throw_s3_error("s3://b/k", "PUT", r); }, errc::io_error,
               {"HTTP 403 with a body that is not an S3 error document: <html>? proxy says no"});
  r.status = 200;
  r.body = "<Error><Code>InternalError</Code></Error>";
  expect_error([&] { detail::check_s3("s3://b/k", "CompleteMultipartUpload", r); }, errc::io_error, {"InternalError"});
}

// ---------------------------------------------------------------------------------------
// moto_server

namespace {

/// w: F32 [1536, 2048] (6 MiB a rank file: 2 parts of 5 MiB) and b: BF16 [1000], saved by
/// 2 ranks in row halves into d; the exceptions of the ranks.
std::vector<std::exception_ptr> save_two_part_checkpoint(const s3_directory& d, const std::string& w,
                                                         const std::string& b) {
  return testing::run_ranks(2, [&](testing::thread_comm& comm) {
    const std::uint64_t r = static_cast<std::uint64_t>(comm.rank());
    std::string wm = w.substr(r * 768 * 2048 * 4, 768 * 2048 * 4), bm = b.substr(r * 1000, 1000);
    std::vector<flat_view> v{{"w",
                              dtype::F32,
                              {1536, 2048},
                              shard_spec(block_spec({768, 2048}, {768 * r, 0})),
                              reinterpret_cast<std::byte*>(wm.data()),
                              wm.size()},
                             {"b",
                              dtype::BF16,
                              {1000},
                              shard_spec(block_spec({500}, {500 * r})),
                              reinterpret_cast<std::byte*>(bm.data()),
                              bm.size()}};
    save(d, std::span<const flat_view>(v), comm);
  });
}

}  // namespace

TEST_CASE("s3: a checkpoint saved by 2 ranks to moto (multipart rank files) loads resharded on 3 ranks, bit-exact") {
  moto& m = moto_shared();
  s3_options o = m.options();
  o.single_put_max = 1 << 20;  // rank files (~6 MiB) go up in 5 MiB parts
  o.part_bytes = 5 << 20;
  m.bucket("ckpts", o);
  const s3_directory d("s3://ckpts/run_1/step_10", o);
  // w: F32 [1536, 2048] saved in row halves; b: BF16 [1000] saved in halves
  const std::string w = random_bytes(1536 * 2048 * 4, 1), b = random_bytes(1000 * 2, 2);
  for (auto& t : save_two_part_checkpoint(d, w, b)) REQUIRE_FALSE(t);
  CHECK(d.list() == std::vector<std::string>{"metadata.json", "rank_0.safetensors", "rank_1.safetensors"});
  CHECK(d.open("rank_0.safetensors").size() > o.part_bytes);
  CHECK(d.pending_uploads().empty());

  const std::uint64_t received0 = d.client().stats().body_bytes;
  std::uint64_t needed = 0;
  for (std::uint64_t r = 0; r < 3; ++r) {
    // 3 ranks by column blocks of w ([0, 683), [683, 1366), [1366, 2048)) and thirds of b
    const std::uint64_t c0 = r * 683, cols = r == 2 ? 2048 - 1366 : 683, b0 = r * 334, bn = r == 2 ? 1000 - 668 : 334;
    std::string wm(1536 * cols * 4, '\x5a'), bm(bn * 2, '\x5a');
    std::vector<flat_view> v{{"w",
                              dtype::F32,
                              {1536, 2048},
                              shard_spec(block_spec({1536, cols}, {0, c0})),
                              reinterpret_cast<std::byte*>(wm.data()),
                              wm.size()},
                             {"b",
                              dtype::BF16,
                              {1000},
                              shard_spec(block_spec({bn}, {b0})),
                              reinterpret_cast<std::byte*>(bm.data()),
                              bm.size()}};
    needed += load(d, std::span<const flat_view>(v)).bytes_needed;
    std::string want_w;
    for (std::uint64_t row = 0; row < 1536; ++row) want_w += w.substr((row * 2048 + c0) * 4, cols * 4);
    CHECK(wm == want_w);
    CHECK(bm == b.substr(b0 * 2, bn * 2));
  }
  MESSAGE("s3 load of 3 reshards from moto: " << d.client().stats().body_bytes - received0
                                              << " body bytes received for " << needed << " needed");
  // saving again over it is refused, as on a disk
  std::string one(4, '\0');
  flat_view again{"x", dtype::F32, {1}, std::nullopt, reinterpret_cast<std::byte*>(one.data()), one.size()};
  auto t2 =
      testing::run_ranks(1, [&](testing::thread_comm& comm) { save(d, std::span<const flat_view>(&again, 1), comm); });
  REQUIRE(t2[0]);
  try {
    std::rethrow_exception(t2[0]);
  } catch (const error& e) {
    CHECK(e.code() == errc::already_exists);
  }
}

TEST_CASE("s3: objects, folders, listing across pages, removal and errors against moto") {
  moto& m = moto_shared();
  s3_options o = m.options();
  o.list_page = 2;
  const s3_directory root = m.bucket("objs", o);
  const s3_directory d = root.sub("top");
  for (int i = 0; i < 7; ++i) write_text(d, "obj " + std::to_string(i) + ".txt", "text " + std::to_string(i));
  write_text(d.sub("inner"), "x.bin", "inner bytes");
  const s3_directory empty = d.sub("empty folder");
  CHECK_FALSE(d.exists("empty folder"));
  empty.make();
  CHECK(d.exists("empty folder"));
  CHECK(empty.list().empty());
  const std::vector<std::string> want{"empty folder", "inner",     "obj 0.txt", "obj 1.txt", "obj 2.txt",
                                      "obj 3.txt",    "obj 4.txt", "obj 5.txt", "obj 6.txt"};
  CHECK(d.list() == want);  // 9 names over pages of 2
  CHECK(root.list() == std::vector<std::string>{"top"});
  CHECK(d.exists("inner"));
  CHECK(d.exists("obj 3.txt"));
  CHECK_FALSE(d.exists("obj 9.txt"));
  CHECK(read_text(d.open("obj 3.txt")) == "text 3");
  CHECK(read_text(d.sub("inner").open("x.bin")) == "inner bytes");
  CHECK(d.open("obj 3.txt").name() == "s3://objs/top/obj 3.txt");
  expect_error([&] { d.open("absent"); }, errc::not_found, {"s3://objs/top/absent"});
  d.remove("inner");
  d.remove("obj 0.txt");
  d.remove("never there");
  CHECK_FALSE(d.exists("inner"));
  CHECK(d.list().size() == want.size() - 2);
  // an empty object, and a writer dropped without commit leaves nothing
  write_text(d, "zero", "");
  CHECK(d.open("zero").size() == 0);
  {
    auto w = d.create("dropped");
  }
  CHECK_FALSE(d.exists("dropped"));
  // a bucket that does not exist: S3's code in the message
  const s3_directory nob("s3://no-such-bucket/p", o);
  expect_error([&] { nob.list(); }, errc::not_found, {"s3://no-such-bucket/p", "ListObjectsV2", "NoSuchBucket"});
}

TEST_CASE("s3: a multipart upload that fails half-way is aborted: no object, no upload left") {
  moto& m = moto_shared();
  s3_options o = m.options();
  o.single_put_max = 1 << 20;
  o.part_bytes = 5 << 20;
  const s3_directory d = m.bucket("fail", o);
  const std::uint64_t size = 23 << 20;  // 5 parts
  std::atomic<int> filled{0};
  auto w = d.create("big.bin");
  expect_error(
      [&] {
        w.write_blocks(
            size,
            [&](std::uint64_t off, std::span<std::byte> dst) {
              if (off >= (std::uint64_t(10) << 20))
                throw error(errc::io_error, "fill failed at " + std::to_string(off));
              std::memset(dst.data(), 7, dst.size());
              ++filled;
            },
            block_write_options{2, false});
      },
      errc::io_error, {"fill failed"});
  CHECK(filled.load() >= 1);
  w.abort();  // a no-op on S3 now
  CHECK_FALSE(d.exists("big.bin"));
  CHECK(d.pending_uploads().empty());

  // and one that succeeds: the bytes are the parts in order
  std::string want(size_t(size), '\0');
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = static_cast<char>((i * 131) >> 7);
  auto ok = d.create("big.bin");
  ok.write_blocks(
      size,
      [&](std::uint64_t off, std::span<std::byte> dst) { std::memcpy(dst.data(), want.data() + off, dst.size()); },
      block_write_options{3, false});
  CHECK(d.pending_uploads() == std::vector<std::string>{"big.bin"});
  CHECK_FALSE(d.exists("big.bin"));  // not visible before commit
  ok.commit();
  CHECK(d.pending_uploads().empty());
  const auto r = d.open("big.bin");
  REQUIRE(r.size() == size);
  std::string got(size_t(size), '\0');
  r.read_into(0, std::as_writable_bytes(std::span(got)));
  CHECK(testing::sha256_hex(got) == testing::sha256_hex(want));
}

TEST_CASE("s3: an object overwritten while a reader has it open is an error, not bytes of two versions") {
  moto& m = moto_shared();
  const s3_directory d = m.bucket("change", m.options());
  const std::string v1 = random_bytes(100'000, 50), v2 = random_bytes(100'000, 51);
  write_text(d, "obj.bin", v1);
  const auto r = d.open("obj.bin");
  REQUIRE(r.validator().etag.size() > 2);
  std::string got(1000, '\0');
  r.read_into(0, std::as_writable_bytes(std::span(got)));
  CHECK(got == v1.substr(0, 1000));
  write_text(d, "obj.bin", v2);
  expect_error([&] { r.read_into(1000, std::as_writable_bytes(std::span(got))); }, errc::io_error,
               {"the object changed while reading", "HTTP 412 to If-Match: " + r.validator().etag});
  d.open("obj.bin").read_into(1000, std::as_writable_bytes(std::span(got)));
  CHECK(got == v2.substr(1000, 1000));
}

TEST_CASE("s3 faults through a proxy: a save and a load under faults are bit-exact; an upload cut off leaves nothing") {
  moto& m = moto_shared();
  s3_options direct = m.options();
  direct.single_put_max = 1 << 20;
  direct.part_bytes = 5 << 20;
  const s3_directory root = m.bucket("faults", direct);
  const std::string w = random_bytes(1536 * 2048 * 4, 60), b = random_bytes(1000 * 2, 61);
  auto via = [&](const testing::fault_proxy& px) {
    s3_options o = direct;
    o.endpoint = "http://127.0.0.1:" + std::to_string(px.port);
    o.http.read_timeout = std::chrono::milliseconds(2000);
    o.http.max_attempts = 10;
    o.http.backoff_initial = std::chrono::milliseconds(5);
    o.http.backoff_max = std::chrono::milliseconds(20);
    o.http.retry_after_max = std::chrono::milliseconds(1500);
    o.http.part_bytes = 256 << 10;  // loads in a few dozen requests
    return o;
  };

  SUBCASE("faults on saving and loading: retried, the bytes exact") {
    int faults = 0;
    for (std::uint64_t seed = 1; seed <= 2; ++seed) {
      CAPTURE(seed);
      testing::fault_proxy px(
          m.port, seed, 0.15,
          {"--faults", "reset,stall,s503,s503_date,s429,drop,truncate,wrong_range,wrong_length", "--stall", "3"});
      const s3_directory d("s3://faults/run/seed" + std::to_string(seed), via(px));
      for (auto& t : save_two_part_checkpoint(d, w, b)) REQUIRE_FALSE(t);
      const std::size_t saved_faults = px.faults().size();
      // rows [400, 1200) of w (from both rank files) and all of b loaded through the proxy
      // (every fault kind but ignore_range), checked against w and b
      std::string wm(800 * 2048 * 4, '\x5a'), bm(2000, '\x5a');
      std::vector<flat_view> v{
          {"w",
           dtype::F32,
           {1536, 2048},
           shard_spec(block_spec({800, 2048}, {400, 0})),
           reinterpret_cast<std::byte*>(wm.data()),
           wm.size()},
          {"b", dtype::BF16, {1000}, std::nullopt, reinterpret_cast<std::byte*>(bm.data()), bm.size()}};
      load(d, std::span<const flat_view>(v));
      CHECK(wm == w.substr(400 * 2048 * 4, 800 * 2048 * 4));
      CHECK(bm == b);
      CHECK(s3_directory(d.name(), direct).pending_uploads().empty());
      faults += static_cast<int>(px.faults().size());
      MESSAGE("seed " << seed << ": " << saved_faults << " faults while saving, " << px.faults().size() - saved_faults
                      << " while loading; " << d.client().stats().retries.load() << " retries");
    }
    CHECK(faults > 0);
  }

  SUBCASE("every UploadPart after the first 2 cut off: the save fails, no metadata.json, no upload left") {
    testing::fault_proxy px(m.port, 1, 0.0, {"--kill-parts-after", "2"});
    s3_options o = via(px);
    o.http.max_attempts = 3;
    const s3_directory d("s3://faults/cut", o);
    const auto thrown = save_two_part_checkpoint(d, w, b);
    bool upload_error = false;  // some rank names the object and the part that failed
    for (const auto& t : thrown) {
      REQUIRE(t);
      try {
        std::rethrow_exception(t);
      } catch (const error& e) {
        const std::string what = e.what();
        if (what.find("s3://faults/cut/rank_") != std::string::npos &&
            what.find(": UploadPart ") != std::string::npos) {
          upload_error = true;
          MESSAGE("the failed upload: " << what);
        }
      }
    }
    CHECK(upload_error);
    CHECK(px.faults().size() >= 3u);  // the third part and its retries
    const s3_directory check("s3://faults/cut", direct);
    CHECK_FALSE(check.exists("metadata.json"));
    CHECK_FALSE(is_complete_checkpoint(check));
    CHECK(check.pending_uploads().empty());
    std::string bm(2000, '\0');
    const flat_view bv{"b", dtype::BF16, {1000}, std::nullopt, reinterpret_cast<std::byte*>(bm.data()), bm.size()};
    try {
      load(check, std::span<const flat_view>(&bv, 1));
      FAIL("a checkpoint without metadata.json loaded");
    } catch (const error& e) {
      CHECK_MESSAGE(std::string(e.what()).find("s3://faults/cut") != std::string::npos, e.what());
    }
  }
}

TEST_CASE("s3: a CompleteMultipartUpload whose answer is lost is accepted when the object has our multipart ETag") {
  moto& m = moto_shared();
  s3_options direct = m.options();
  direct.single_put_max = 1 << 20;
  direct.part_bytes = 5 << 20;
  const s3_directory root = m.bucket("lost", direct);
  auto via = [&](const testing::fault_proxy& px) {
    s3_options o = direct;
    o.endpoint = "http://127.0.0.1:" + std::to_string(px.port);
    o.http.read_timeout = std::chrono::milliseconds(1500);
    o.http.max_attempts = 4;
    o.http.backoff_initial = std::chrono::milliseconds(5);
    return o;
  };
  // the rule against Python's hashlib: md5 of the parts' binary md5s, "-", their count
  const std::string data = random_bytes((11 << 20) + 12345, 90);  // 3 parts of 5 MiB
  testing::write_file(m.dir.path / "data.bin", data);
  const auto py = testing::peer(
      "python3", {"-c",
                  "import hashlib,sys\n"
                  "d=open(sys.argv[1],'rb').read(); p=5<<20\n"
                  "parts=[hashlib.md5(d[i:i+p]) for i in range(0,len(d),p)]\n"
                  "print('\"'+hashlib.md5(b''.join(h.digest() for h in parts)).hexdigest()+'-%d\"'%len(parts))\n"
                  "print(','.join('\"'+h.hexdigest()+'\"' for h in parts))",
                  (m.dir.path / "data.bin").string()});
  REQUIRE_MESSAGE((py.exited && py.code == 0), py.err);
  const std::string py_etag = py.out.substr(0, py.out.find('\n'));
  std::vector<std::string> py_parts;
  {
    std::string rest = py.out.substr(py.out.find('\n') + 1);
    rest.pop_back();
    for (std::size_t at = 0; at <= rest.size();) {
      const std::size_t c = std::min(rest.find(',', at), rest.size());
      py_parts.push_back(rest.substr(at, c - at));
      at = c + 1;
    }
  }
  REQUIRE(py_parts.size() == 3);
  CHECK(detail::multipart_etag(py_parts) == py_etag);
  CHECK_FALSE(detail::multipart_etag({"\"not-an-md5\""}));
  CHECK_FALSE(detail::multipart_etag({}));
  auto write_big = [&](const s3_directory& d, const std::string& name) {
    auto w = d.create(name);
    w.write_blocks(
        data.size(),
        [&](std::uint64_t off, std::span<std::byte> dst) { std::memcpy(dst.data(), data.data() + off, dst.size()); },
        block_write_options{2, false});
    w.commit();
  };
  {  // the multipart ETag moto gives is the one Python computed
    write_big(root, "direct.bin");
    CHECK(root.open("direct.bin").validator().etag == py_etag);
  }

  for (const std::string mode : {"drop", "stall"}) {
    SUBCASE(("the answer to the first Complete " + mode + "ped: the save succeeds, the checkpoint loads bit-exact")
                .c_str()) {
      testing::fault_proxy px(m.port, 1, 0.0, {"--lose-complete", mode, "--stall", "3"});
      const s3_directory d("s3://lost/run-" + mode, via(px));
      const std::string w = random_bytes(1536 * 2048 * 4, 91), b = random_bytes(1000 * 2, 92);
      for (auto& t : save_two_part_checkpoint(d, w, b)) REQUIRE_FALSE(t);
      const auto faults = px.faults();  // the answer lost, the retry told NoSuchUpload
      REQUIRE(faults.size() == 2u);
      CHECK(faults[0].starts_with("lose-" + mode + " POST /lost/run-" + mode + "/rank_"));
      CHECK(faults[1] == "nosuchupload" + faults[0].substr(faults[0].find(' ')));
      const s3_directory check("s3://lost/run-" + mode, direct);
      CHECK(is_complete_checkpoint(check));
      CHECK(check.pending_uploads().empty());
      std::string wm(1536 * 2048 * 4, '\x5a'), bm(2000, '\x5a');
      std::vector<flat_view> v{
          {"w", dtype::F32, {1536, 2048}, std::nullopt, reinterpret_cast<std::byte*>(wm.data()), wm.size()},
          {"b", dtype::BF16, {1000}, std::nullopt, reinterpret_cast<std::byte*>(bm.data()), bm.size()}};
      load(check, std::span<const flat_view>(v));
      CHECK(wm == w);
      CHECK(bm == b);
    }
  }

  SUBCASE("the object found after a lost answer has another ETag: refused, naming the object and the rule") {
    const std::string other = "\"0123456789abcdef0123456789abcdef-3\"";
    testing::fault_proxy px(m.port, 1, 0.0, {"--lose-complete", "drop", "--head-etag", other});
    const s3_directory d("s3://lost/other", via(px));
    expect_error([&] { write_big(d, "big.bin"); }, errc::not_found,
                 {"s3://lost/other/big.bin: CompleteMultipartUpload", "NoSuchUpload",
                  "hex(md5(the parts' binary MD5s))-N", "the object there has ETag " + other, "not our " + py_etag});
    const auto faults = px.faults();
    REQUIRE(faults.size() == 3u);
    CHECK(faults[0].starts_with("lose-drop POST /lost/other/big.bin?uploadId="));
    CHECK(faults[1].starts_with("nosuchupload POST /lost/other/big.bin?uploadId="));
    CHECK(faults[2].starts_with("head-etag HEAD /lost/other/big.bin"));
  }
}

TEST_CASE(
    "s3: virtual-hosted requests to moto (BUCKET.localhost, connected through connect_to): save and load bit-exact") {
  moto& m = moto_shared();
  const s3_options direct = m.options();
  m.bucket("virt", direct);
  s3_options o = direct;
  // port 1 of localhost has nothing listening: every connection goes where the rule says,
  // while Host (and the signature) name virt.localhost:1, which moto routes to the bucket
  o.endpoint = "http://localhost:1";
  o.addressing = s3_addressing::virtual_hosted;
  o.http.connect_to = {{"VIRT.localhost", 1, "127.0.0.1", static_cast<std::uint16_t>(m.port)}};
  const s3_directory d("s3://virt/ckpt", o);
  REQUIRE(d.virtual_hosted());
  CHECK(d.url_of("metadata.json").str() == "http://virt.localhost:1/ckpt/metadata.json");
  testing::save_two_rank_checkpoint(70, d);
  CHECK(d.list() == std::vector<std::string>{"metadata.json", "rank_0.safetensors", "rank_1.safetensors"});
  // the objects are where a path-style client finds them: bucket virt, keys ckpt/...
  const s3_directory p("s3://virt/ckpt", direct);
  CHECK(p.list() == std::vector<std::string>{"metadata.json", "rank_0.safetensors", "rank_1.safetensors"});
  const std::string w = random_bytes(64 * 30 * 4, 70), e = random_bytes(10 * 8 * 2, 71);
  std::string wm(w.size(), '\x5a'), em(e.size(), '\x5a');
  std::vector<flat_view> v{
      {"w", dtype::F32, {64, 30}, std::nullopt, reinterpret_cast<std::byte*>(wm.data()), wm.size()},
      {"e", dtype::BF16, {10, 8}, std::nullopt, reinterpret_cast<std::byte*>(em.data()), em.size()}};
  load(d, std::span<const flat_view>(v));
  CHECK(wm == w);
  CHECK(em == e);
  CHECK(d.client().stats().connections.load() >= 1);
  // without the rule, localhost:1 refuses: the connection went through connect_to
  s3_options n = o;
  n.http.connect_to.clear();
  n.http.max_attempts = 1;
  expect_error([&] { s3_directory("s3://virt/ckpt", n).list(); }, errc::io_error,
               {"s3://virt/ckpt", "virt.localhost:1"});
}

// ---------------------------------------------------------------------------------------
// servers die with the test process

namespace {

/// The processes whose process group is pgid, from /proc (zombies left out: they are gone,
/// waiting for a reaper).
std::vector<pid_t> s3_test_group_members(pid_t pgid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string n = e.path().filename().string();
    if (n.empty() || !std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    std::ifstream f(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const std::size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));  // "S PPID PGRP ..."
    char state = 0;
    long ppid = 0, pgrp = 0;
    if (!(rest >> state >> ppid >> pgrp)) continue;
    if (pgrp == pgid && state != 'Z') out.push_back(static_cast<pid_t>(std::stol(n)));
  }
  return out;
}

/// Whether pid is a process that has not exited (a zombie has).
bool s3_test_alive(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

}  // namespace

// run by the next test case as a child process (this executable again): starts nginx, moto and
// a fault proxy, writes their pids, and kills itself
TEST_CASE("servers: orphan helper (runs only as a child of the next test)" *
          doctest::skip(std::getenv("SHARDSAFE_TEST_ORPHAN_PIDS") == nullptr)) {
  const char* out = std::getenv("SHARDSAFE_TEST_ORPHAN_PIDS");
  testing::nginx_server web;
  moto& m = moto_shared();
  testing::fault_proxy px(m.port, 1, 0.0);
  std::string lines;
  for (const testing::child_process* c : {web.proc.get(), m.proc.get(), px.proc.get()})
    lines += std::to_string(c->pid()) + " " + std::to_string(c->guard_pid()) + "\n";
  testing::write_file(out, lines);
  ::kill(::getpid(), SIGKILL);
}

TEST_CASE("servers: a test process killed with SIGKILL leaves no nginx, moto_server or proxy running") {
  testing::temp_dir t;
  const fs::path pids = t.path / "pids";
  testing::program_result r;
  {
    saved_env env;
    env.set("SHARDSAFE_TEST_ORPHAN_PIDS", pids.c_str());
    r = testing::run_program(fs::read_symlink("/proc/self/exe").string(),
                             {"-tc=servers: orphan helper*", "--no-intro", "--no-version"});
  }
  REQUIRE_MESSAGE(!r.exited, "the helper was to kill itself: ", r.out, r.err);
  CHECK(r.code == -SIGKILL);
  REQUIRE_MESSAGE(fs::exists(pids), r.out, r.err);
  std::vector<pid_t> servers, guards;
  {
    std::istringstream in(testing::slurp(pids));
    for (long s = 0, g = 0; in >> s >> g;) {
      servers.push_back(static_cast<pid_t>(s));
      guards.push_back(static_cast<pid_t>(g));
    }
  }
  REQUIRE(servers.size() == 3u);
  // every server, its guard and everything in the server's process group (nginx's worker) is
  // gone within a few seconds (the guards give SIGTERM 5 s before SIGKILL)
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::vector<pid_t> left;
  do {
    left.clear();
    for (std::size_t i = 0; i < servers.size(); ++i) {
      for (pid_t p : s3_test_group_members(servers[i])) left.push_back(p);
      if (s3_test_alive(servers[i])) left.push_back(servers[i]);
      if (s3_test_alive(guards[i])) left.push_back(guards[i]);
    }
    if (!left.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (!left.empty() && std::chrono::steady_clock::now() < until);
  std::string names;
  for (pid_t p : left)
    names += " " + std::to_string(p) + ":" + testing::slurp("/proc/" + std::to_string(p) + "/cmdline");
  CHECK_MESSAGE(left.empty(), "still running after the test process died:", names);
  for (pid_t p : left) ::kill(p, SIGKILL);  // (a failed check leaves nothing behind either)
}

TEST_CASE("s3: rotation keeps the newest complete checkpoints on S3, as on a local disk") {
  moto& m = moto_shared();
  const s3_directory root = m.bucket("rot", m.options()).sub("run");
  testing::temp_dir local("rot");
  const file_directory lroot(local.path);
  for (const std::uint64_t step : {10, 20, 30, 40})
    testing::save_two_rank_checkpoint(step, root.sub(checkpoint_name(step)), lroot.sub(checkpoint_name(step)));
  // unfinished saves: step 25 (older than the newest complete one) and step 50 (newer)
  for (const std::uint64_t step : {25, 50}) {
    write_text(root.sub(checkpoint_name(step)), "rank_0.safetensors", "partial");
    lroot.sub(checkpoint_name(step)).make();
    write_text(lroot.sub(checkpoint_name(step)), "rank_0.safetensors", "partial");
  }
  const auto entries = list_checkpoints(root), lentries = list_checkpoints(lroot);
  REQUIRE(entries.size() == 6);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    CHECK(entries[i].name == lentries[i].name);
    CHECK(entries[i].complete == lentries[i].complete);
  }
  CHECK(latest_checkpoint(root)->step == 40);
  std::vector<std::vector<std::string>> removed(2), lremoved(2);
  auto thrown = testing::run_ranks(2, [&](testing::thread_comm& c) {
    removed[static_cast<std::size_t>(c.rank())] = rotate_checkpoints(root, 2, c);
    lremoved[static_cast<std::size_t>(c.rank())] = rotate_checkpoints(lroot, 2, c);
  });
  for (auto& t : thrown) REQUIRE_FALSE(t);
  CHECK(removed[0] == std::vector<std::string>{"step25", "step20", "step10"});
  CHECK(removed[1] == removed[0]);
  CHECK(lremoved[0] == removed[0]);
  CHECK(root.list() == std::vector<std::string>{"step30", "step40", "step50"});
  CHECK(root.list() == lroot.list());
  CHECK(root.sub("step10").list().empty());
  CHECK(root.sub("step40").list() ==
        std::vector<std::string>{"metadata.json", "rank_0.safetensors", "rank_1.safetensors"});
  CHECK(root.pending_uploads().empty());
}

TEST_CASE("s3 bad servers: answers that are not S3's are clear errors naming the object and the operation") {
  std::string answer;
  std::mutex m;
  testing::raw_server srv([&](const std::string&) {
    std::lock_guard lock(m);
    return answer;
  });
  auto set = [&](std::string a) {
    std::lock_guard lock(m);
    answer = std::move(a);
  };
  auto reply = [](const std::string& status, const std::string& body) {
    return "HTTP/1.1 " + status + "\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n\r\n" + body;
  };
  s3_options o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(srv.port());
  o.region = "us-east-1";
  o.credentials = aws_credentials{"testing", "testing", ""};
  o.http.max_attempts = 2;
  o.http.backoff_initial = std::chrono::milliseconds(5);
  const s3_directory d("s3://bkt/pre", o);

  set(reply("403 Forbidden", "<html><body>proxy says no</body></html>"));
  expect_error(
      [&] { d.list(); }, errc::io_error,
      {"s3://bkt/pre: ListObjectsV2 of 'pre/': HTTP 403 with a body that is not an S3 error document: <html>"});
  set(reply("500 Internal Server Error", "<Error><Code>Intern"));  // cut short: retried, then judged
  expect_error([&] { d.list(); }, errc::io_error,
               {"s3://bkt/pre", "HTTP 500 with a body that is not an S3 error document"});
  set(reply("404 Not Found", ""));
  expect_error([&] { d.list(); }, errc::not_found, {"s3://bkt/pre", "HTTP 404 (no body)"});
  set(reply("200 OK", "<ListBucketResult><Contents><Key>pre/a"));
  expect_error([&] { d.list(); }, errc::io_error, {"s3://bkt/pre: ListObjectsV2: an unclosed <Contents>"});
  set(reply("200 OK", "<ListBucketResult><Contents><Key>pre/a&bogus;</Key></Contents></ListBucketResult>"));
  expect_error([&] { d.list(); }, errc::io_error, {"s3://bkt/pre: ListObjectsV2: a <Contents> without its key"});
  set(reply("200 OK", "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>"));
  expect_error([&] { d.list(); }, errc::io_error, {"truncated without a NextContinuationToken"});
  set(reply("200 OK", "not xml at all \x01\x02"));  // a 200 from something that is not S3: not an empty listing
  expect_error([&] { d.list(); }, errc::io_error,
               {"s3://bkt/pre: ListObjectsV2: the answer (HTTP 200) is not a ListBucketResult: not xml at all ??"});
  set(reply("200 OK", "<InitiateMultipartUploadResult></InitiateMultipartUploadResult>"));
  {
    s3_options small = o;
    small.single_put_max = 1;
    const s3_directory ds("s3://bkt/pre", small);
    auto wr = ds.create("big.bin");
    expect_error(
        [&] {
          wr.write_blocks(std::uint64_t(6) << 20,
                          [](std::uint64_t, std::span<std::byte> dst) { std::memset(dst.data(), 1, dst.size()); });
        },
        errc::io_error, {"s3://bkt/pre/big.bin: CreateMultipartUpload: no UploadId"});
  }
  set("HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  expect_error([&] { d.open("x.bin"); }, errc::io_error, {"s3://bkt/pre/x.bin: open", "HTTP 403 to HEAD"});
  set("HTTP/1.1 200 OK\r\nContent-Length: 1000000000000000000\r\nConnection: close\r\n\r\n");
  expect_error(
      [&] { d.list(); }, errc::io_error,
      {"s3://bkt/pre", "Content-Length 1000000000000000000 is over the 16777216 bytes this client reads into memory"});
}

// ---------------------------------------------------------------------------------------
// the shardsafe tool on s3:// URLs (docs/FORMAT.md §4), against its run on the same local folder

namespace {

std::string s3_replace_all(std::string s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

std::string object_text(const s3_directory& d, const std::string& name) {
  const auto s = d.open(name);
  std::string out(static_cast<std::size_t>(s.size()), '\0');
  s.read_into(0, std::as_writable_bytes(std::span(out)));
  return out;
}

}  // namespace

TEST_CASE("s3: the tool reads from and writes to moto as it does a local folder" *
          doctest::skip(!testing::have_tool())) {
  moto& m = moto_shared();
  saved_env env;  // the tool process inherits these
  const std::string endpoint = "http://127.0.0.1:" + std::to_string(m.port);
  env.set("AWS_ENDPOINT_URL", endpoint.c_str());
  env.set("AWS_ACCESS_KEY_ID", "testing");
  env.set("AWS_SECRET_ACCESS_KEY", "testing");
  env.set("AWS_SESSION_TOKEN", nullptr);
  env.set("AWS_REGION", "us-east-1");
  env.set("AWS_PROFILE", nullptr);
  const s3_directory root = m.bucket("tool", m.options());
  testing::temp_dir local("tool_s3");
  testing::save_two_rank_checkpoint(21, file_directory(local.path / "ckpt"), root.sub("ckpt"));
  testing::save_two_rank_checkpoint(21, file_directory(local.path / "pair" / "model"), root.sub("pair").sub("model"));
  testing::save_two_rank_checkpoint(21, file_directory(local.path / "pair" / "optim"), root.sub("pair").sub("optim"));
  const auto ts = fixtures::sample_tensors();
  fixtures::make_indexed(file_directory(local.path / "hf"), ts);
  for (const auto& e : fs::directory_iterator(local.path / "hf"))  // the same objects on S3
    write_text(root.sub("hf"), e.path().filename().string(), testing::slurp(e.path()));
  const std::string one = fixtures::file_of(ts.front());

  // inspect, verify and digest print what they print for the local folder
  for (const std::string& f : std::vector<std::string>{"ckpt", "pair", "hf", "hf/" + one})
    for (const std::string cmd : {"inspect", "verify", "digest"}) {
      CAPTURE(f);
      CAPTURE(cmd);
      const std::string lp = (local.path / f).string(), url = "s3://tool/" + f;
      const auto l = testing::run_tool({cmd, lp}), r = testing::run_tool({cmd, url});
      REQUIRE_MESSAGE(l.code == 0, l.err);
      CHECK_MESSAGE(r.code == 0, r.err);
      CHECK(r.out == s3_replace_all(l.out, lp, url));
    }

  // unshard into S3: the object holds the bytes of the local unshard, and digests the same
  for (const std::string f : {"ckpt", "pair"}) {  // (the HF fixture holds an F4 tensor: no unshard)
    CAPTURE(f);
    const fs::path lout = local.path / (f + "_full.safetensors");
    const std::string url = "s3://tool/out/" + f + "_full.safetensors";
    const auto l = testing::run_tool({"unshard", (local.path / f).string(), lout.string()});
    const auto r = testing::run_tool({"unshard", "s3://tool/" + f, url});
    REQUIRE_MESSAGE(l.code == 0, l.err);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(r.out == s3_replace_all(l.out, lout.string(), url));
    CHECK(object_text(root.sub("out"), f + "_full.safetensors") == testing::slurp(lout));
    CHECK(testing::run_tool({"digest", url}).out == testing::run_tool({"digest", lout.string()}).out);
  }

  // to-hf into S3: the same files as the local export, and the prefix must be empty
  for (const std::string f : {"ckpt", "pair"}) {
    CAPTURE(f);
    const fs::path lout = local.path / "exported";
    const std::string url = "s3://tool/exported";
    const auto l = testing::run_tool({"to-hf", (local.path / f).string(), lout.string(), "--max-shard-size", "200"});
    const auto r = testing::run_tool({"to-hf", "s3://tool/" + f, url, "--max-shard-size", "200"});
    REQUIRE_MESSAGE(l.code == 0, l.err);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(r.out == s3_replace_all(l.out, lout.string(), url));
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(lout)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    CHECK(root.sub("exported").list() == names);
    for (const auto& n : names) CHECK_MESSAGE(object_text(root.sub("exported"), n) == testing::slurp(lout / n), n);
    CHECK(testing::run_tool({"digest", url}).out == testing::run_tool({"digest", lout.string()}).out);
    const auto again = testing::run_tool({"to-hf", "s3://tool/" + f, url});
    CHECK(again.code == 1);
    CHECK(again.err.find(url) != std::string::npos);
    CHECK(again.err.find("not empty") != std::string::npos);
    fs::remove_all(lout);
    root.remove("exported");
  }

  // a missing object or prefix: exit 1, one line naming the URL
  for (const std::string url :
       {"s3://tool/absent", "s3://tool/absent.safetensors", "s3://tool/ckpt/absent.safetensors"}) {
    CAPTURE(url);
    const auto r = testing::run_tool({"digest", url});
    CHECK(r.code == 1);
    CHECK(r.out.empty());
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(url) != std::string::npos);
  }
}

TEST_CASE("s3: a listing that is always truncated ends at the operation deadline or the page cap, naming what") {
  // a server that answers every ListObjectsV2 with one key and IsTruncated=true, forever
  int page = 0;
  testing::raw_server srv([&](const std::string& head) {
    ++page;
    const std::string body =
        "<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>true</IsTruncated>"
        "<NextContinuationToken>t" +
        std::to_string(page) +
        "</NextContinuationToken>"
        "<Contents><Key>run/k" +
        std::to_string(page) + "</Key></Contents></ListBucketResult>";
    if (head.starts_with("HEAD ")) return std::string("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
    return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  });
  s3_options o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(srv.port());
  o.region = "us-east-1";
  o.credentials = aws_credentials{"testing", "testing", ""};
  o.addressing = s3_addressing::path;
  o.http.operation_timeout = std::chrono::milliseconds(1500);
  const s3_directory d("s3://bucket/run", o);
  expect_error([&] { d.list(); }, errc::io_error,
               {"ListObjectsV2 of 'run/'", "still truncated after", "refusing to list further"});
  // bounded work: within the deadline and below the page cap
  CHECK(srv.requests() > 1);
  CHECK(srv.requests() <= 10'000);
}
