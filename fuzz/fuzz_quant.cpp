// libFuzzer target: quantized weights and their scales (checkpoint/quant.hpp, dequant_load.hpp;
// docs/FORMAT.md §8). The five goldens of tests/fixtures/quant (FP8 block scales, MXFP4, MXFP8,
// NVFP4, FP8 per channel and per tensor: config.json, model.safetensors and ModelOpt's
// hf_quant_config.json) are loaded into memory
// once; the input's first byte picks one of their files (modulo their count), the rest replaces
// that file. The folder is then opened, every quantized weight found and its scales checked
// (verify's check_quantized), each loaded dequantized into F32 whole and, by a second rank's flat
// range and column block, into BF16, and the shards that keep it quantized asked for. Only
// shardsafe::error may escape; every value written lies in its view (ASan's part).
// With SHARDSAFE_FUZZ_WRITE_SEEDS=DIR set, the target writes one seed per file (its index byte and
// its bytes) into DIR and exits: fuzz/corpus/quant/ was made so.
#include <algorithm>
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
#include "shardsafe/checkpoint/quant.hpp"
#include "shardsafe/storage/memory.hpp"

#include "fuzz_check.hpp"
#include "golden_fixture.hpp"

using namespace shardsafe;

namespace {

const fuzz::golden_fixture& the_fixture() {
  static const fuzz::golden_fixture f = [] {
    fuzz::golden_fixture x;
    const std::filesystem::path root = std::filesystem::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "quant";
    for (const char* name : {"fp8_block", "mxfp4", "mxfp8", "nvfp4", "fp8_channel"}) {
      // the folder's own files (config.json, model.safetensors, hf_quant_config.json), not expected/
      x.add(root / name, false);
    }
    FUZZ_CHECK(x.files.size() >= 11 && x.files.size() <= 64);
    return x;
  }();
  return f;
}

/// Loads view v (elements of dtype t, spec) of weight q dequantized; a failure must be an error.
void load_one(checkpoint_reader<memory_directory>& r, const quantized_tensor& q, dtype t,
              std::optional<shard_spec> spec) {
  const std::uint64_t n = spec ? spec->local_numel() : numel(q.shape);
  if (n > (std::uint64_t(1) << 20)) return;
  std::vector<std::byte> buf(static_cast<std::size_t>(n * item_size(t)));
  const flat_view v{q.name, t, q.shape, std::move(spec), buf.data(), buf.size()};
  load_options o;
  o.convert_dtypes = true;
  load(r, std::span<const flat_view>(&v, 1), o);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  the_fixture().write_seeds_if_asked();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto [g, store] = the_fixture().with_input(data, size);
  try {
    checkpoint_reader<memory_directory> r(memory_directory(store, g->root));
    for (const quantized_tensor& q : check_quantized(r)) {
      FUZZ_CHECK(r.find(q.data) && r.find(q.data)->shape == q.data_shape && !q.shape.empty());
      load_one(r, q, dtype::F32, std::nullopt);
      const std::uint64_t all = numel(q.shape), n = q.shape.back();
      load_one(r, q, dtype::BF16, shard_spec(flat_spec{{all / 3, all - all / 5}}));
      shape_t local = q.shape, off(q.shape.size(), 0);
      off.back() = n / 2 + 1 > n ? n : n / 2 + 1;
      local.back() = n - off.back();
      load_one(r, q, dtype::BF16, shard_spec(block_spec(local, off)));
      try {
        const quantized_shard s = quantized_shard_of(q, block_spec(local, off));
        (void)s;
      } catch (const shardsafe::error&) {
      }
    }
  } catch (const shardsafe::error&) {
  }
  return 0;
}
