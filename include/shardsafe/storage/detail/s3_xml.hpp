// shardsafe/storage/detail/s3_xml.hpp - what the s3 backend reads out of S3's XML answers
// (no XML library: S3's documents are flat, and only named elements are read) and the
// multipart ETag rule. No network library.
#pragma once

#include <openssl/evp.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/hex.hpp"
#include "shardsafe/storage/detail/s3_sigv4.hpp"

namespace shardsafe::detail {

/// The text of the first <tag>...</tag> in xml at or after `from`, entities decoded.
#if SHARDSAFE_REMOTE_DEFINE
SHARDSAFE_DECL std::optional<std::string> xml_text(std::string_view xml, std::string_view tag, std::size_t from = 0,
                                                   std::size_t* end = nullptr) {
  const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
  const std::size_t a = xml.find(open, from);
  if (a == std::string_view::npos) return std::nullopt;
  const std::size_t b = xml.find(close, a + open.size());
  if (b == std::string_view::npos) return std::nullopt;
  if (end) *end = b + close.size();
  std::string_view raw = xml.substr(a + open.size(), b - a - open.size());
  std::string out;
  for (std::size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '&') {
      out += raw[i];
      continue;
    }
    const std::size_t semi = raw.find(';', i);
    if (semi == std::string_view::npos) return std::nullopt;
    const std::string_view ent = raw.substr(i + 1, semi - i - 1);
    if (ent == "amp")
      out += '&';
    else if (ent == "lt")
      out += '<';
    else if (ent == "gt")
      out += '>';
    else if (ent == "quot")
      out += '"';
    else if (ent == "apos")
      out += '\'';
    else if (ent.size() > 1 && ent[0] == '#') {
      unsigned long cp = 0;
      try {
        cp = ent[1] == 'x' ? std::stoul(std::string(ent.substr(2)), nullptr, 16)
                           : std::stoul(std::string(ent.substr(1)));
      } catch (...) {
        return std::nullopt;
      }
      if (cp < 0x80)
        out += static_cast<char>(cp);
      else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else if (cp < 0x110000) {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
      } else
        return std::nullopt;
    } else {
      return std::nullopt;
    }
    i = semi;
  }
  return out;
}
#else
SHARDSAFE_DECL std::optional<std::string> xml_text(std::string_view xml, std::string_view tag, std::size_t from = 0,
                                                   std::size_t* end = nullptr);
#endif

/// The ETag S3 gives the object of a completed multipart upload: "hex(md5(concatenation of
/// the binary MD5s of the parts))-N" for N parts, quotes included. Each part's ETag is the MD5
/// of its bytes when the bucket does not encrypt with SSE-KMS (and in moto); nothing when one
/// of part_etags is not a quoted (or bare) 32-digit hex MD5, for then the rule does not apply.
#if SHARDSAFE_REMOTE_DEFINE
SHARDSAFE_DECL std::optional<std::string> multipart_etag(const std::vector<std::string>& part_etags) {
  std::string binary;
  for (std::string_view e : part_etags) {
    if (e.size() == 34 && e.front() == '"' && e.back() == '"') e = e.substr(1, 32);
    if (e.size() != 32) return std::nullopt;
    for (std::size_t i = 0; i < 32; i += 2) {
      auto nibble = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
      };
      const int hi = nibble(e[i]), lo = nibble(e[i + 1]);
      if (hi < 0 || lo < 0) return std::nullopt;
      binary += static_cast<char>(hi * 16 + lo);
    }
  }
  if (part_etags.empty()) return std::nullopt;
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  if (!EVP_Digest(binary.data(), binary.size(), md, &n, EVP_md5(), nullptr))
    throw error(errc::io_error, "MD5 failed (OpenSSL)");
  return "\"" + to_hex(md, n) + "-" + std::to_string(part_etags.size()) + "\"";
}
#else
SHARDSAFE_DECL std::optional<std::string> multipart_etag(const std::vector<std::string>& part_etags);
#endif

}  // namespace shardsafe::detail
