// fuzz/golden_fixture.hpp - what the targets that fuzz a golden folder share (fuzz_deepspeed,
// fuzz_quant): goldens from the source tree held in memory once, each as a memory_store folder;
// an input whose first byte picks one of their files (modulo their count) and whose rest replaces
// that file; and, with SHARDSAFE_FUZZ_WRITE_SEEDS=DIR set, one seed per file written (its index
// byte and its bytes) before the target exits.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardsafe/storage/memory.hpp"

namespace fuzz {

struct golden_folder {
  std::string root;  // "mem:/ckpt0", the folder opened
  std::shared_ptr<shardsafe::memory_store> store;
};

struct golden_fixture {
  std::vector<golden_folder> goldens;
  std::vector<std::pair<std::size_t, std::string>> files;  // (golden, object key), in a fixed order

  /// Adds the regular files under dir (in name order; those of its subfolders too with
  /// `recursive`) as a golden folder; its index.
  std::size_t add(const std::filesystem::path& dir, bool recursive = true) {
    namespace fs = std::filesystem;
    golden_folder g{"mem:/ckpt" + std::to_string(goldens.size()), std::make_shared<shardsafe::memory_store>()};
    std::vector<fs::path> paths;
    if (recursive) {
      for (const auto& e : fs::recursive_directory_iterator(dir))
        if (e.is_regular_file()) paths.push_back(e.path());
    } else {
      for (const auto& e : fs::directory_iterator(dir))
        if (e.is_regular_file()) paths.push_back(e.path());
    }
    std::sort(paths.begin(), paths.end());
    for (const auto& p : paths) {
      std::ifstream in(p, std::ios::binary);
      const std::string b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const std::string key = g.root + "/" + fs::relative(p, dir).generic_string();
      g.store->objects[key] = std::make_shared<const shardsafe::byte_buffer>(
          reinterpret_cast<const std::byte*>(b.data()), reinterpret_cast<const std::byte*>(b.data()) + b.size());
      files.emplace_back(goldens.size(), key);
    }
    goldens.push_back(std::move(g));
    return goldens.size() - 1;
  }

  /// With SHARDSAFE_FUZZ_WRITE_SEEDS=DIR: one seed per file into DIR, then exit(0).
  void write_seeds_if_asked() const {
    const char* dir = std::getenv("SHARDSAFE_FUZZ_WRITE_SEEDS");
    if (!dir) return;
    for (std::size_t i = 0; i < files.size(); ++i) {
      const auto& [g, key] = files[i];
      const auto& b = *goldens[g].store->objects.at(key);
      std::ofstream out(std::filesystem::path(dir) / ("file" + std::to_string(i)), std::ios::binary);
      out.put(static_cast<char>(i));
      out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    std::exit(0);
  }

  /// The input's golden (its first byte picks the file) with that file replaced by the rest.
  std::pair<const golden_folder*, std::shared_ptr<shardsafe::memory_store>> with_input(const std::uint8_t* data,
                                                                                       std::size_t size) const {
    const auto& [gi, key] = files[data[0] % files.size()];
    auto store = std::make_shared<shardsafe::memory_store>();
    store->objects = goldens[gi].store->objects;  // the other files shared, this one replaced
    store->objects[key] = std::make_shared<const shardsafe::byte_buffer>(
        reinterpret_cast<const std::byte*>(data) + 1, reinterpret_cast<const std::byte*>(data) + size);
    return {&goldens[gi], std::move(store)};
  }
};

}  // namespace fuzz
