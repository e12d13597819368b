// configured_load - a loader configured at compile time (checkpoint/configured.hpp), without
// LibTorch: the storage backend, the communicator and the per-tensor policy are template
// arguments, so the calls resolve at compile time and a wrong combination does not compile.
//
//   configured_load [DIR]     (default: a folder under the temporary directory)
//
// It saves a small checkpoint (one process), then loads a row block of it through two
// loaders: a strict one that validates NaNs and takes F32 views only, and a lenient one that
// converts the stored BF16 tensor into F32 while copying.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/configured.hpp"
#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/file.hpp"

using namespace shardsafe;

// The configurations, named once. A wrong one is a compile error with a message, e.g.
//   configured_loader<file_directory, single_process, load_policy{.validate_nan = true, .views = only(dtype::I32)}>
// says "load_policy asks for validate_nan, but its views' dtype (load_policy::views) has no NaN".
using checked_loader = configured_loader<file_directory, single_process,
                                         load_policy{.strict = true, .validate_nan = true, .views = only(dtype::F32)}>;
using converting_loader =
    configured_loader<file_directory, single_process,
                      load_policy{.strict = false, .convert_dtypes = true, .views = only(dtype::F32)}>;

int main(int argc, char** argv) {
  if (argc > 1 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    std::printf(
        "configured_load [DIR]: saves a small checkpoint in DIR and loads it through loaders whose\n"
        "backend, communicator and policy are template arguments (checkpoint/configured.hpp).\n");
    return 0;
  }
  const std::filesystem::path dir =
      argc > 1 ? std::filesystem::path(argv[1]) : std::filesystem::temp_directory_path() / "shardsafe-configured-load";
  std::filesystem::remove_all(dir);
  single_process comm;

  // a checkpoint: "w" F32 [4, 8] = 0..31 and "emb" BF16 [3, 2] = 0.5 * i
  std::vector<float> w(32);
  for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(i);
  std::vector<std::uint16_t> emb(6);
  for (int i = 0; i < 6; ++i) {
    const float f = 0.5f * static_cast<float>(i);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    emb[i] = static_cast<std::uint16_t>(bits >> 16);  // exact in BF16
  }
  const std::vector<flat_view> saved{
      {"w", dtype::F32, {4, 8}, std::nullopt, reinterpret_cast<std::byte*>(w.data()), 128},
      {"emb", dtype::BF16, {3, 2}, std::nullopt, reinterpret_cast<std::byte*>(emb.data()), 12}};
  save(file_directory(dir), std::span<const flat_view>(saved), comm);

  // rows 2-3 of "w", strictly, with NaN validation
  checked_loader strict(file_directory(dir), comm);
  std::vector<float> rows(16, -1.f);
  const flat_view part{"w", dtype::F32, {4, 8}, block_spec({2, 8}, {2, 0}), reinterpret_cast<std::byte*>(rows.data()),
                       64};
  const load_stats st = load(strict, std::span<const flat_view>(&part, 1));
  bool ok = st.bytes_needed == 64;
  for (int i = 0; i < 16; ++i) ok = ok && rows[i] == static_cast<float>(16 + i);
  std::printf("strict, NaN-validating, F32-only loader: rows 2-3 of w, %llu bytes read: %s\n",
              static_cast<unsigned long long>(st.bytes_read), ok ? "as saved" : "WRONG");

  // "emb" (BF16 in the file) into F32, and a tensor the checkpoint lacks, leniently
  converting_loader lenient(file_directory(dir), comm);
  std::vector<float> e(6, -1.f), absent(2, 9.f);
  const std::vector<flat_view> views{
      {"emb", dtype::F32, {3, 2}, std::nullopt, reinterpret_cast<std::byte*>(e.data()), 24},
      {"absent", dtype::F32, {2}, std::nullopt, reinterpret_cast<std::byte*>(absent.data()), 8}};
  const load_stats st2 = load(lenient, std::span<const flat_view>(views));
  bool ok2 = st2.missing_keys.size() == 1 && absent[0] == 9.f;
  for (int i = 0; i < 6; ++i) ok2 = ok2 && e[i] == 0.5f * static_cast<float>(i);
  std::printf("lenient, converting loader: emb BF16 -> F32 %s; missing: %s\n", ok2 ? "exact" : "WRONG",
              st2.missing_keys.empty() ? "none" : st2.missing_keys.front().c_str());
  return ok && ok2 ? 0 : 1;
}
