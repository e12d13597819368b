// libFuzzer target: parse_dcp_metadata (torch DCP's .metadata through the allowlist unpickler of
// format/dcp_unpickler.hpp) on arbitrary bytes. Only shardsafe::error may escape, with the code
// invalid_metadata or unsupported_dtype and a message naming the file. What is accepted must
// satisfy the rules of format/dcp_metadata.hpp: chunks inside their tensor, one offset and size per
// dimension, plain relative paths, offset + length within 64 bits.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/dcp_metadata.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

void check_storage(const dcp_storage_info& s) {
  FUZZ_CHECK(!s.relative_path.empty());
  FUZZ_CHECK(s.relative_path.find('/') == std::string::npos);
  FUZZ_CHECK(s.relative_path.find("..") == std::string::npos);
  FUZZ_CHECK(detail::checked_add(s.offset, s.length).has_value());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  dcp_metadata md;
  try {
    md = parse_dcp_metadata(bytes, "ckpt/.metadata");
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata || e.code() == errc::unsupported_dtype);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("ckpt/.metadata: "));
    return 0;
  }
  for (const auto& [fqn, item] : md.items) {
    if (item.is_bytes) {
      check_storage(item.bytes);
      continue;
    }
    FUZZ_CHECK(detail::checked_numel(item.size).has_value());
    for (const auto& c : item.chunks) {
      FUZZ_CHECK(c.offsets.size() == item.size.size() && c.sizes.size() == item.size.size());
      for (std::size_t d = 0; d < item.size.size(); ++d)
        FUZZ_CHECK(c.offsets[d] + c.sizes[d] <= item.size[d] && c.offsets[d] <= item.size[d]);
      check_storage(c.storage);
    }
  }
  return 0;
}
