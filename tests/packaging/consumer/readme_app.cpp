// A torch-free program built with exactly the command line README.md gives for building without
// a build system ("Using it from another project"; tests/packaging/run.sh takes the line from the
// README). It uses what needs each library that line links: a save and a checked load in memory
// (metadata.json through simdjson, the checksums through xxHash) and a rename rule (RE2).
#include "shardsafe/shardsafe.hpp"

#include <cstddef>
#include <cstdio>
#include <span>
#include <vector>

int main() {
  using namespace shardsafe;
  std::vector<float> w = {1.5f, -2.0f, 3.25f, 4.0f, 5.0f, -6.5f};
  const flat_view saved{"layer.weight", dtype::F32, {2, 3}, std::nullopt, reinterpret_cast<std::byte*>(w.data()),
                        w.size() * 4};
  const memory_directory dir;
  single_process comm;
  save(dir, std::span<const flat_view>(&saved, 1), comm);

  std::vector<float> back(6);
  const flat_view loaded{"layer.weight", dtype::F32, {2, 3}, std::nullopt, reinterpret_cast<std::byte*>(back.data()),
                         back.size() * 4};
  load_options lo;
  lo.verify_checksums = true;
  const load_stats st = load(dir, std::span<const flat_view>(&loaded, 1), lo);

  rename_rules rules;
  rules.add("^layer\\.(.*)$=model.\\1");
  const bool ok = back == w && st.checksum_blocks > 0 && rules.apply("layer.weight") == "model.weight";
  std::printf(ok ? "readme app ok\n" : "readme app: FAILED\n");
  return ok ? 0 : 1;
}
