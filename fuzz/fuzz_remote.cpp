// libFuzzer target: the parsers of what remote servers and AWS files say, on arbitrary bytes.
// The first byte picks the parser, the rest is its input: 0 Content-Range, 1 an HTTP-date,
// 2 Retry-After, 3 a URL (and a redirect's Location resolved against it), 4 S3's XML (every
// <Key> of a listing), 5 an unsigned decimal, 6 an AWS INI file's profile. Only shardsafe::error
// may escape, and what each accepts must satisfy its rules (below).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/detail/checked.hpp"
#include "shardsafe/storage/aws.hpp"
#include "shardsafe/storage/detail/http_fields.hpp"
#include "shardsafe/storage/detail/s3_xml.hpp"
#include "shardsafe/storage/url.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

void content_range(std::string_view s) {
  std::uint64_t a = 0, b = 0;
  std::optional<std::uint64_t> t;
  if (!detail::parse_content_range(s, a, b, t)) return;
  FUZZ_CHECK(a <= b);
  if (t) FUZZ_CHECK(b < *t);
  // written back, it reads the same
  const std::string again =
      "bytes " + std::to_string(a) + "-" + std::to_string(b) + "/" + (t ? std::to_string(*t) : "*");
  std::uint64_t a2 = 0, b2 = 0;
  std::optional<std::uint64_t> t2;
  FUZZ_CHECK(detail::parse_content_range(again, a2, b2, t2) && a2 == a && b2 == b && t2 == t);
}

void http_date(std::string_view s) {
  const auto at = detail::parse_http_date(s);
  if (at) FUZZ_CHECK(*at >= 0 && *at < std::int64_t(253402300800));  // 1970 to year 9999
  const auto wait = detail::parse_retry_after(s, std::chrono::system_clock::time_point{});
  if (wait) FUZZ_CHECK(wait->count() >= 0);
}

void url(std::string_view s) {
  url_parts u;
  try {
    u = parse_url(s);
  } catch (const shardsafe::error&) {
    return;
  }
  FUZZ_CHECK(u.scheme == "http" || u.scheme == "https" || u.scheme == "s3");
  FUZZ_CHECK(u.port != 0 && !u.host.empty() && !u.target.empty() && u.target.front() == '/');
  const url_parts v = parse_url(u.str());  // what str() writes, parse_url reads back
  FUZZ_CHECK(v.scheme == u.scheme && v.host == u.host && v.port == u.port && v.target == u.target);
  try {  // a Location resolved against it is a URL of the same rules
    const url_parts to = resolve_location(u, s.substr(s.size() / 2));
    FUZZ_CHECK(to.port != 0 && !to.host.empty() && to.target.front() == '/');
  } catch (const shardsafe::error&) {
  }
}

void xml(std::string_view s) {
  std::size_t at = 0, end = 0, n = 0;
  while (auto k = detail::xml_text(s, "Key", at, &end)) {
    FUZZ_CHECK(end > at && end <= s.size());
    at = end;
    FUZZ_CHECK(++n <= s.size());
  }
}

void decimal(std::string_view s) {
  const auto n = detail::parse_decimal(s);
  if (!n) return;
  // the digits without leading zeros are the number written back
  const std::size_t first = std::min(s.find_first_not_of('0'), s.size() - 1);
  FUZZ_CHECK(std::to_string(*n) == s.substr(first));
}

void aws_ini(std::string_view s) {
  for (const char* profile : {"default", "other"}) {
    const auto settings = aws_profile_settings_of(s, profile);
    if (!settings) continue;
    for (const auto& [k, v] : *settings)  // each a key, no setting spans lines
      FUZZ_CHECK(!k.empty() && k.find('\n') == std::string::npos && v.find('\n') == std::string::npos);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 7) {
      case 0: content_range(text); break;
      case 1:
      case 2: http_date(text); break;
      case 3: url(text); break;
      case 4: xml(text); break;
      case 5: decimal(text); break;
      default: aws_ini(text); break;
    }
  } catch (const shardsafe::error&) {
  }
  return 0;
}
