// libFuzzer target: the trainers' torch.save checkpoints: DeepSpeed's (docs/FORMAT.md §6) read by
// the deepspeed and deepspeed_universal layouts, Megatron-LM's legacy ones (§7) by
// megatron_legacy. Five of the trainers' own goldens (tests/fixtures/peers: a ZeRO-2 tag folder,
// the universal checkpoints of a ZeRO-1 and a ZeRO-3 save, the legacy iteration folders of an
// EP 2 MoE and of a distributed optimizer on TP 2) are loaded into memory once; the input's first byte picks one of their files (modulo their count), the rest
// replaces that file. The folder is then opened as a checkpoint and every tensor of at most
// 1 MiB read whole. Only shardsafe::error may escape; a folder that opens is in the layout the
// untouched golden has, and every tensor it presents is read within its bounds (ASan's part).
// With SHARDSAFE_FUZZ_WRITE_SEEDS=DIR set, the target writes one seed per file (its index byte and
// its bytes) into DIR and exits: fuzz/corpus/deepspeed/ was made so.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/storage/memory.hpp"

#include "fuzz_check.hpp"
#include "golden_fixture.hpp"

using namespace shardsafe;

namespace {

// each golden folder, with the layout its untouched files have
struct fixture {
  fuzz::golden_fixture files;
  std::vector<const layout_info*> layouts;
};

const fixture& the_fixture() {
  static const fixture f = [] {
    fixture x;
    const std::filesystem::path peers = std::filesystem::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "peers";
    const std::pair<const char*, const layout_info*> dirs[] = {
        {"zero2_fp32/ckpt/global_step2", &deepspeed_layout::info},
        {"zero1_bf16/universal/global_step2_universal", &deepspeed_universal_layout::info},
        {"zero3_bf16/universal/global_step2_universal", &deepspeed_universal_layout::info},
        {"mcore_moe_ep2/legacy/iter_0000002", &megatron_legacy_layout::info},
        {"mcore_distopt_tp2_dp2/legacy/iter_0000002", &megatron_legacy_layout::info},
        {"mcore_gpt_bf16_tp2/legacy/iter_0000002", &megatron_legacy_layout::info}};
    for (const auto& [rel, layout] : dirs) {
      x.files.add(peers / rel);
      x.layouts.push_back(layout);
    }
    FUZZ_CHECK(x.files.files.size() > 3 && x.files.files.size() <= 256);
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  the_fixture().files.write_seeds_if_asked();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const fixture& f = the_fixture();
  const auto [g, store] = f.files.with_input(data, size);
  try {
    checkpoint_reader<memory_directory> r(memory_directory(store, g->root));
    FUZZ_CHECK(r.layout() == *f.layouts[static_cast<std::size_t>(g - f.files.goldens.data())]);
    std::vector<std::byte> buf;
    for (const auto& [name, tm] : r.metadata().tensors) {
      const std::uint64_t n = numel(tm.shape) * item_size(tm.type);
      if (n > (1u << 20)) continue;
      buf.assign(static_cast<std::size_t>(n), std::byte{0});
      unshard_tensor(r, name, std::span<std::byte>(buf));
    }
  } catch (const shardsafe::error&) {
  }
  return 0;
}
