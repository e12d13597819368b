// libFuzzer target: parse_checkpoint_metadata on arbitrary bytes. Only shardsafe::error may
// escape. Accepted metadata must have specs that fit their tensors (cursor runs inside the
// tensor, increasing, summing to local_numel) and must round-trip through the writer.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardsafe/format/metadata.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  checkpoint_metadata md;
  try {
    md = parse_checkpoint_metadata(text, "metadata.json");
  } catch (const shardsafe::error&) {
    return 0;
  }
  for (const auto& [key, tm] : md.tensors) {
    const std::uint64_t n = tm.numel();
    for (const auto& [file, spec] : tm.files) {
      FUZZ_CHECK(spec.local_numel() <= n);
      // walk at most 4096 runs: a spec may have billions
      std::uint64_t prev_end = 0, local = 0;
      int runs = 0;
      bool complete = true;
      for (auto c = spec.cursor(tm.shape); !c.done(); c.next()) {
        if (++runs > 4096) {
          complete = false;
          break;
        }
        const spec_run r = c.run();
        FUZZ_CHECK(r.begin < r.end && r.end <= n);
        FUZZ_CHECK(runs == 1 || r.begin >= prev_end);
        FUZZ_CHECK(r.local == local);
        local += r.end - r.begin;
        prev_end = r.end;
      }
      FUZZ_CHECK(!complete || local == spec.local_numel());
    }
  }
  // what was accepted is written and read back unchanged
  const std::string again = write_checkpoint_metadata(md);
  const checkpoint_metadata back = parse_checkpoint_metadata(again, "metadata.json (rewritten)");
  FUZZ_CHECK(back.tensors.size() == md.tensors.size());
  for (std::size_t i = 0; i < md.tensors.size(); ++i) {
    const auto& [ka, a] = md.tensors[i];
    const auto& [kb, b] = back.tensors[i];
    FUZZ_CHECK(ka == kb && a.shape == b.shape && a.type == b.type && a.is_sharded == b.is_sharded);
    FUZZ_CHECK(a.files.size() == b.files.size());
    for (std::size_t j = 0; j < a.files.size(); ++j) FUZZ_CHECK(a.files[j] == b.files[j]);
  }
  FUZZ_CHECK(back.extras.writer == md.extras.writer && back.extras.world_size == md.extras.world_size &&
             back.extras.file_sizes == md.extras.file_sizes);
  FUZZ_CHECK(back.extras.checksums.has_value() == md.extras.checksums.has_value());
  if (md.extras.checksums)
    FUZZ_CHECK(back.extras.checksums->algorithm == md.extras.checksums->algorithm &&
               back.extras.checksums->block_bytes == md.extras.checksums->block_bytes &&
               back.extras.checksums->files == md.extras.checksums->files);
  FUZZ_CHECK(write_checkpoint_metadata(back) == again);
  return 0;
}
