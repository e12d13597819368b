// shardsafe/storage/text.hpp - read a whole small object (metadata.json, an HF index) from any
// ReadableStorage, refusing one larger than a bound before allocating for it; and write one
// into any WritableDirectory, synced and committed.
#pragma once

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

/// The bytes of s as a string; errc::invalid_metadata, naming s, when it holds more than limit.
template <ReadableStorage S>
std::string read_text(const S& s, std::uint64_t limit = max_metadata_size) {
  const std::uint64_t n = s.size();
  if (n > limit)
    fail(errc::invalid_metadata, std::string(s.name()) + ": " + std::to_string(n) + " bytes passes the limit of " +
                                     std::to_string(limit));
  std::string text(static_cast<std::size_t>(n), '\0');
  s.read_into(0, std::as_writable_bytes(std::span(text)));
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
      w.write_blocks(text.size(), [&](std::uint64_t off, std::span<std::byte> dst) {
        std::memcpy(dst.data(), text.data() + off, dst.size());
      }, block_write_options{1, false});
    w.sync();
    w.commit();
  });
}

}  // namespace shardsafe
