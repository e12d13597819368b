// shardsafe/storage/detail/impl/s3_xml.ipp - s3_xml.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/storage/detail/s3_xml.hpp"

namespace shardsafe::detail {

SHARDSAFE_DECL std::optional<std::string> xml_text(std::string_view xml, std::string_view tag, std::size_t from,
                                                   std::size_t* end) {
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

}  // namespace shardsafe::detail
