// shardsafe/storage/detail/http_fields.hpp - the HTTP header fields the client reads, parsed
// without any network library (so that they are tested and fuzzed alone): Content-Range,
// HTTP-dates and Retry-After.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "shardsafe/detail/checked.hpp"

namespace shardsafe::detail {

/// Parses "bytes FIRST-LAST/TOTAL" (TOTAL may be '*'); false if it is not that.
inline bool parse_content_range(std::string_view v, std::uint64_t& first, std::uint64_t& last,
                                std::optional<std::uint64_t>& total) {
  auto number = [](std::string_view s, std::uint64_t& out) {
    const auto n = parse_decimal(s, 19);
    if (n) out = *n;
    return n.has_value();
  };
  if (!v.starts_with("bytes ")) return false;
  v.remove_prefix(6);
  if (v.starts_with("*/")) return false;  // unsatisfied-range form
  const std::size_t dash = v.find('-'), slash = v.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || dash > slash) return false;
  std::string_view a = v.substr(0, dash), b = v.substr(dash + 1, slash - dash - 1), t = v.substr(slash + 1);
  if (!number(a, first) || !number(b, last) || last < first) return false;
  if (t == "*") {
    total.reset();
    return true;
  }
  std::uint64_t tt = 0;
  if (!number(t, tt) || last >= tt) return false;
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
    const auto n = s.size() == digits ? parse_decimal(s, digits) : std::nullopt;
    if (n) out = static_cast<int>(*n);
    return n.has_value();
  };
  auto month = [&](std::string_view m, int& out) {
    for (int i = 0; i < 12; ++i)
      if (m == months[i]) return out = i + 1, true;
    return false;
  };
  auto alpha = [](std::string_view s) {
    return !s.empty() &&
           std::all_of(s.begin(), s.end(), [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); });
  };
  std::vector<std::string_view> w;  // the words, runs of spaces collapsed (asctime pads the day)
  for (std::size_t i = 0; i < v.size();) {
    if (v[i] == ' ') {
      ++i;
      continue;
    }
    const std::size_t j = std::min(v.find(' ', i), v.size());
    w.push_back(v.substr(i, j - i));
    i = j;
  }
  int y = 0, mo = 0, d = 0;
  std::string_view time;
  if (w.size() == 6 && w[0].size() == 4 && w[0][3] == ',' && alpha(w[0].substr(0, 3)) && w[5] == "GMT") {
    if (!num(w[1], 2, d) || !month(w[2], mo) || !num(w[3], 4, y)) return std::nullopt;
    time = w[4];
  } else if (w.size() == 4 && w[0].size() > 1 && w[0].back() == ',' && alpha(w[0].substr(0, w[0].size() - 1)) &&
             w[3] == "GMT") {
    const std::string_view dmy = w[1];  // 06-Nov-94
    if (dmy.size() != 9 || dmy[2] != '-' || dmy[6] != '-' || !num(dmy.substr(0, 2), 2, d) ||
        !month(dmy.substr(3, 3), mo) || !num(dmy.substr(7, 2), 2, y))
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
  const std::int64_t doy = (153 * (mo + (mo > 2 ? -3 : 9)) + 2) / 5 + d - 1,
                     doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  const std::int64_t days = era * 146097 + doe - 719468;
  return days * 86400 + h * 3600 + mi * 60 + s;
}

/// Retry-After (RFC 9110 §10.2.3): delta-seconds, or an HTTP-date taken as the wait from now
/// until then (zero for a date already past). Junk gives nothing, and the backoff applies.
inline std::optional<std::chrono::milliseconds> parse_retry_after(
    std::string_view v, std::chrono::system_clock::time_point now = std::chrono::system_clock::now()) {
  if (v.empty()) return std::nullopt;
  if (v[0] >= '0' && v[0] <= '9') {
    const auto s = parse_decimal(v, 9);
    if (!s) return std::nullopt;
    return std::chrono::milliseconds(*s * 1000);
  }
  const auto at = parse_http_date(v);
  if (!at) return std::nullopt;
  // in whole seconds first: a date up to year 9999 in the system clock's nanoseconds would
  // overflow (fuzz_remote found a Retry-After in 5994); the wait is cut to 10^9 s here (and to
  // http_options::retry_after_max where it is used)
  const std::int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::int64_t wait_ms = std::min<std::int64_t>(*at, now_ms / 1000 + 1'000'000'000) * 1000 - now_ms;
  return std::chrono::milliseconds(std::max<std::int64_t>(0, wait_ms));
}

}  // namespace shardsafe::detail
