// libFuzzer target: locate_torch_zip (the storage record of a torch.save archive, as each chunk of
// a torch DCP .distcp file is) on arbitrary bytes, and parse_torch_tensor_pickle on the data.pkl
// it finds. Only shardsafe::error (invalid_metadata) may escape; a record it returns lies inside
// the archive, before the central directory, and is stored.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/format/torch_zip.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const auto z = locate_torch_zip(bytes, "f.distcp");
    FUZZ_CHECK(z.storage.data_offset <= size && z.storage.size <= size - z.storage.data_offset);
    FUZZ_CHECK(z.storage.name.find("/data/") != std::string::npos);
    if (z.pickle) {
      FUZZ_CHECK(z.pickle->data_offset <= size && z.pickle->size <= size - z.pickle->data_offset);
      const auto t = parse_torch_tensor_pickle(bytes.substr(z.pickle->data_offset, z.pickle->size), "f.distcp data.pkl");
      if (t.type) check_torch_zip_tensor(t, z.storage, *t.type, t.size, "f.distcp");
    }
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("f.distcp"));
  }
  return 0;
}
