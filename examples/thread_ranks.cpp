// thread_ranks - several ranks in one process, without LibTorch: a world of threads
// (shardsafe/dist/threads.hpp) saves a sharded checkpoint and a world of another size loads it
// resharded, the way a multi-node job would, to try collective code on one machine.
//
//   thread_ranks [DIR] [--form listed|compact]   (default: a folder under the temporary directory)
//
// Four ranks hold a tensor "w" [10, 6] as FSDP's flat pieces (ceil(60/4) elements each) and save;
// three ranks then load it as row blocks (ceil(10/3) rows each) with checksums checked, and every
// element is compared with the value it was saved with (its index). Prints what each rank read.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/loader.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/threads.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;
using u64 = std::uint64_t;

namespace {

constexpr u64 rows = 10, cols = 6, n = rows * cols;

/// [b, e) of piece r of len elements cut w ways as torch.chunk does.
std::pair<u64, u64> piece(u64 len, u64 w, u64 r) {
  const u64 c = (len + w - 1) / w;
  return {std::min(len, c * r), std::min(len, c * (r + 1))};
}

/// What a thrown exception says ("" for none).
std::string what_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "shardsafe-thread-ranks";
  metadata_form form = metadata_form::automatic;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "thread_ranks [DIR] [--form listed|compact]: 4 thread ranks save a sharded checkpoint in DIR,\n"
          "3 thread ranks load it resharded and check every element (shardsafe/dist/threads.hpp).\n");
      return 0;
    }
    if (a == "--form" && i + 1 < argc) {
      form = std::string_view(argv[++i]) == "compact" ? metadata_form::compact : metadata_form::listed;
    } else {
      dir = a;
    }
  }
  std::filesystem::remove_all(dir);

  // 4 ranks save: rank r holds elements piece(60, 4, r) of "w", whose value is its index
  auto saved = run_ranks(4, [&](thread_comm& comm) {
    const auto [b, e] = piece(n, 4, static_cast<u64>(comm.rank()));
    std::vector<float> mine;
    for (u64 i = b; i < e; ++i) mine.push_back(static_cast<float>(i));
    const flat_view v{"w",
                      dtype::F32,
                      {rows, cols},
                      flat_spec{{b, e}},
                      reinterpret_cast<std::byte*>(mine.data()),
                      mine.size() * sizeof(float)};
    save_options opt;
    opt.metadata = form;
    save(file_directory(dir), std::span<const flat_view>(&v, 1), comm, opt);
  });
  for (std::size_t r = 0; r < saved.size(); ++r)
    if (saved[r]) {
      std::fprintf(stderr, "thread_ranks: rank %zu of the save: %s\n", r, what_of(saved[r]).c_str());
      return 1;
    }

  // 3 ranks load row blocks, each on its own, checksums checked; every element must be its index
  std::vector<std::string> lines(3);
  auto loaded = run_ranks(3, [&](thread_comm& comm) {
    const u64 r = static_cast<u64>(comm.rank());
    const auto [b, e] = piece(rows, 3, r);
    std::vector<float> mine((e - b) * cols, -1.f);
    const flat_view v{"w",
                      dtype::F32,
                      {rows, cols},
                      block_spec({e - b, cols}, {b, 0}),
                      reinterpret_cast<std::byte*>(mine.data()),
                      mine.size() * sizeof(float)};
    load_options lo;
    lo.verify_checksums = true;
    const load_stats st = load(file_directory(dir), std::span<const flat_view>(&v, 1), lo);
    for (u64 i = 0; i < mine.size(); ++i)
      if (mine[i] != static_cast<float>(b * cols + i))
        throw error(errc::invalid_argument, "rank " + std::to_string(r) + ": element " + std::to_string(b * cols + i) +
                                                " loaded as " + std::to_string(mine[i]));
    lines[r] = "rank " + std::to_string(r) + " of 3: rows [" + std::to_string(b) + ", " + std::to_string(e) + "), " +
               std::to_string(st.bytes_read) + " bytes read, " + std::to_string(st.checksum_blocks) +
               " checksum blocks checked";
  });
  for (std::size_t r = 0; r < loaded.size(); ++r)
    if (loaded[r]) {
      std::fprintf(stderr, "thread_ranks: rank %zu of the load: %s\n", r, what_of(loaded[r]).c_str());
      return 1;
    }
  std::printf("saved by 4 thread ranks as flat pieces in %s\n", dir.string().c_str());
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  std::printf("every element as saved\n");
  return 0;
}
