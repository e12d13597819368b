// shardsafe/storage/text.hpp - read a whole small object (metadata.json, an HF index) from any
// ReadableStorage, refusing one larger than a bound before allocating for it.
#pragma once

#include <cstdint>
#include <span>
#include <string>

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

}  // namespace shardsafe
