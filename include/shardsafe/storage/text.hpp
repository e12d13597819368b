// shardsafe/storage/text.hpp - read a whole small object (metadata.json, an HF index) from any
// ReadableStorage, refusing one larger than a bound before allocating for it; and write one
// into any WritableDirectory, synced and committed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// Largest JSON document (metadata.json, model.safetensors.index.json) a reader accepts.
inline constexpr std::uint64_t max_metadata_size = std::uint64_t(1) << 30;

/// What read_text checks as the bytes arrive, before reading more.
enum class text_kind {
  any,     ///< nothing
  json,    ///< a JSON document: no byte below 0x20 but tab, newline and carriage return (JSON allows
           ///< none elsewhere, not even in strings), so a file of NULs is refused at its first chunk
  pickle,  ///< a pickle of protocol 2 or newer: it starts with PROTO (0x80)
};

/// The bytes of s as a string; errc::invalid_metadata, naming s, when it holds more than limit.
/// Read in chunks of 4 MiB, the string growing as bytes arrive (never sized up front from what
/// s.size() claims: a server's HEAD may lie), each chunk checked as `kind` says before the next
/// is read (errc::invalid_json / errc::invalid_metadata naming the byte).
template <ReadableStorage S>
std::string read_text(const S& s, std::uint64_t limit = max_metadata_size, text_kind kind = text_kind::any) {
  const std::uint64_t n = s.size();
  const std::string name(s.name());
  if (n > limit)
    fail(errc::invalid_metadata,
         name + ": " + std::to_string(n) + " bytes passes the limit of " + std::to_string(limit));
  constexpr std::uint64_t chunk = std::uint64_t(4) << 20, padding = 64;
  std::string text;
  for (std::uint64_t at = 0; at < n;) {
    const std::uint64_t len = std::min(chunk, n - at);
    if (text.capacity() < at + len + padding)
      text.reserve(static_cast<std::size_t>(std::max(at + len + padding, 2 * text.capacity())));
    text.resize(static_cast<std::size_t>(at + len));
    s.read_into(at, std::as_writable_bytes(std::span(text)).subspan(static_cast<std::size_t>(at)));
    if (kind == text_kind::pickle && at == 0 && static_cast<unsigned char>(text[0]) != 0x80)
      fail(errc::invalid_metadata, name + ": does not start with a pickle's PROTO opcode (byte 0 is " +
                                       std::to_string(static_cast<unsigned char>(text[0])) + ")");
    if (kind == text_kind::json)
      for (std::uint64_t i = at; i < at + len; ++i) {
        const unsigned char c = static_cast<unsigned char>(text[static_cast<std::size_t>(i)]);
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r')
          fail(errc::invalid_json, name + ": not valid JSON: byte " + std::to_string(i) + " is a control character (" +
                                       std::to_string(c) + "), which JSON allows nowhere");
      }
    at += len;
  }
  if (text.capacity() < text.size() + padding) text.reserve(text.size() + padding);
  return text;
}

/// Writes text as object `name` of dir: one write, sync, commit (the object appears whole under
/// its name, or not at all); the writer is aborted when any step fails.
template <WritableDirectory D>
void write_text(const D& dir, std::string_view name, std::string_view text) {
  auto w = dir.create(name);
  detail::abort_on_failure(w, [&] {
    if constexpr (RandomAccessWritableStorage<typename D::writer_type>)
      w.write_at(0, std::as_bytes(std::span(text)));
    else
      w.write_blocks(
          text.size(),
          [&](std::uint64_t off, std::span<std::byte> dst) { std::memcpy(dst.data(), text.data() + off, dst.size()); },
          block_write_options{1, false});
    w.sync();
    w.commit();
  });
}

}  // namespace shardsafe
