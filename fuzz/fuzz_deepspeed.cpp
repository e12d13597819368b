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

using namespace shardsafe;

namespace {

namespace fs = std::filesystem;

struct golden {
  std::string root;           // "mem:/ckpt0", the folder opened
  const layout_info* layout;  // the layout the untouched folder has
  std::shared_ptr<memory_store> store;
};

struct fixture {
  std::vector<golden> goldens;
  std::vector<std::pair<std::size_t, std::string>> files;  // (golden, object key), in a fixed order
};

const fixture& the_fixture() {
  static const fixture f = [] {
    fixture x;
    const fs::path peers = fs::path(SHARDSAFE_SOURCE_DIR) / "tests" / "fixtures" / "peers";
    const std::pair<const char*, const layout_info*> dirs[] = {
        {"zero2_fp32/ckpt/global_step2", &deepspeed_layout::info},
        {"zero1_bf16/universal/global_step2_universal", &deepspeed_universal_layout::info},
        {"zero3_bf16/universal/global_step2_universal", &deepspeed_universal_layout::info},
        {"mcore_moe_ep2/legacy/iter_0000002", &megatron_legacy_layout::info},
        {"mcore_distopt_tp2_dp2/legacy/iter_0000002", &megatron_legacy_layout::info}};
    for (const auto& [rel, layout] : dirs) {
      golden g{"mem:/ckpt" + std::to_string(x.goldens.size()), layout, std::make_shared<memory_store>()};
      std::vector<fs::path> paths;
      for (const auto& e : fs::recursive_directory_iterator(peers / rel))
        if (e.is_regular_file()) paths.push_back(e.path());
      std::sort(paths.begin(), paths.end());
      for (const auto& p : paths) {
        std::ifstream in(p, std::ios::binary);
        const std::string b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const std::string key = g.root + "/" + fs::relative(p, peers / rel).generic_string();
        g.store->objects[key] = std::make_shared<const byte_buffer>(
            reinterpret_cast<const std::byte*>(b.data()), reinterpret_cast<const std::byte*>(b.data()) + b.size());
        x.files.emplace_back(x.goldens.size(), key);
      }
      x.goldens.push_back(std::move(g));
    }
    FUZZ_CHECK(x.files.size() > 3 && x.files.size() <= 256);
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const fixture& f = the_fixture();
  if (const char* dir = std::getenv("SHARDSAFE_FUZZ_WRITE_SEEDS")) {
    for (std::size_t i = 0; i < f.files.size(); ++i) {
      const auto& [g, key] = f.files[i];
      const auto& b = *f.goldens[g].store->objects.at(key);
      std::ofstream out(fs::path(dir) / ("file" + std::to_string(i)), std::ios::binary);
      out.put(static_cast<char>(i));
      out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const fixture& f = the_fixture();
  const auto& [gi, key] = f.files[data[0] % f.files.size()];
  const golden& g = f.goldens[gi];
  auto store = std::make_shared<memory_store>();
  store->objects = g.store->objects;  // the other files shared, this one replaced
  store->objects[key] = std::make_shared<const byte_buffer>(reinterpret_cast<const std::byte*>(data) + 1,
                                                            reinterpret_cast<const std::byte*>(data) + size);
  try {
    checkpoint_reader<memory_directory> r(memory_directory(store, g.root));
    FUZZ_CHECK(r.layout() == *g.layout);
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
