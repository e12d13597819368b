// libFuzzer target: torch.save's legacy format (torch < 1.6, or _use_new_zipfile_serialization=
// False; docs/FORMAT.md §3 "The legacy format") on arbitrary bytes held in a memory storage:
// detail::index_torch_save_legacy (its five pickles, the tar-header check, each storage's size
// and bytes in the listed order), and index_torch_save_file, which must send the same bytes to
// it when they begin with the magic number. Only shardsafe::error may escape (invalid_metadata;
// unsupported_dtype for a tensor's dtype), its message naming the file. What is accepted: every
// tensor's bytes lie inside the file, after the pickles' first bytes, nbytes = numel x item
// size, names distinct; both entry points give the same index; each value that is not a tensor
// prints within the bound asked and, written again (pickle_dumps, as to-dcp does), reads back
// as itself. Seeds: fuzz/make_torch_legacy_corpus.py (torch 1.13) and torch 2.6's legacy files.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>

#include "shardsafe/format/pickle_repr.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/format/torch_save_legacy.hpp"
#include "shardsafe/storage/memory.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

bool same(const torch_save_index& a, const torch_save_index& b) {
  if (a.header.tensors.size() != b.header.tensors.size() || a.values.size() != b.values.size()) return false;
  for (std::size_t i = 0; i < a.header.tensors.size(); ++i) {
    const auto &x = a.header.tensors[i], &y = b.header.tensors[i];
    if (x.name != y.name || x.type != y.type || x.shape != y.shape || x.begin != y.begin || x.end != y.end)
      return false;
  }
  for (std::size_t i = 0; i < a.values.size(); ++i)
    if (a.values[i].name != b.values[i].name || !(a.values[i].value == b.values[i].value)) return false;
  return a.paths == b.paths;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const memory_storage st(
      byte_buffer(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size),
      "old.bin");
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  torch_save_index x;
  try {
    x = detail::index_torch_save_legacy(st);
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata || e.code() == errc::unsupported_dtype);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("old.bin: "));
    // index_torch_save_file refuses it too when it reads it as the legacy format
    if (torch_save_legacy_magic_size(bytes.substr(0, 24)) != 0) {
      bool refused = false;
      try {
        (void)index_torch_save_file(st);
      } catch (const shardsafe::error&) {
        refused = true;
      }
      FUZZ_CHECK(refused);
    }
    return 0;
  }
  // accepted: it began with the magic number, and the file-level entry point agrees
  const std::size_t magic = torch_save_legacy_magic_size(bytes.substr(0, 24));
  FUZZ_CHECK(magic != 0);
  FUZZ_CHECK(same(x, index_torch_save_file(st)));
  std::set<std::string_view> names;
  for (const auto& e : x.header.tensors) {
    FUZZ_CHECK(e.begin <= e.end && e.end <= size && e.begin >= magic + 8);
    FUZZ_CHECK(e.nbytes() == e.numel() * item_size(e.type));
    FUZZ_CHECK(names.insert(e.name).second);
  }
  for (const auto& v : x.values) {
    FUZZ_CHECK(names.insert(v.name).second);
    FUZZ_CHECK(pickle_repr(v.value, 60).size() <= 60);
    if (!v.unwritable.empty()) continue;
    const std::string again = pickle_dumps(v.value);
    if (again.size() <= (std::size_t(1) << 16)) FUZZ_CHECK(pickle_loads(again, "old.bin: again") == v.value);
  }
  return 0;
}
