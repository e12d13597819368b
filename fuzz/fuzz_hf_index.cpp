// libFuzzer target: parse_hf_index on arbitrary bytes. Only shardsafe::error may escape.
// Accepted indexes name plain files only and round-trip through write_hf_index.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardsafe/format/hf_index.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  hf_index idx;
  try {
    idx = parse_hf_index(text, "model.safetensors.index.json");
  } catch (const shardsafe::error&) {
    return 0;
  }
  for (const auto& f : idx.files()) FUZZ_CHECK(is_plain_name(f));
  const std::string again = write_hf_index(idx);
  const hf_index back = parse_hf_index(again, "model.safetensors.index.json (rewritten)");
  FUZZ_CHECK(back.total_size == idx.total_size);
  FUZZ_CHECK(back.metadata == idx.metadata);
  FUZZ_CHECK(back.weight_map == idx.weight_map);
  FUZZ_CHECK(write_hf_index(back) == again);
  return 0;
}
