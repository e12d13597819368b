// libFuzzer target: locate_torch_zip (the storage record of a torch.save archive, as each chunk of
// a torch DCP .distcp file is) on arbitrary bytes, and parse_torch_tensor_pickle on the data.pkl
// it finds, then index_dcp_data_file on the same bytes as a data file; and the same bytes as a
// non-tensor item (torch 2.x: a torch.save archive of a pickled value, read_dcp_object); and
// the same bytes as a torch.save file of a state dict (pytorch_model.bin, index_torch_save_file).
// Only shardsafe::error (invalid_metadata; unsupported_dtype for a state dict's tensor) may
// escape; a record it returns lies inside the archive, before the central directory, and is
// stored; a state dict's tensors lie inside the file; its other values print within the bound
// asked, and each one written again (pickle_dumps, as to-dcp does) reads back as itself.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/format/dcp_data.hpp"
#include "shardsafe/format/pickle_repr.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/format/torch_save.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/storage/memory.hpp"

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
      const auto t =
          parse_torch_tensor_pickle(bytes.substr(z.pickle->data_offset, z.pickle->size), "f.distcp data.pkl");
      if (t.type) {
        check_torch_zip_tensor(t, z.storage, *t.type, t.size, "f.distcp");
        // the same archive indexed as a DCP data file (format/dcp_data.hpp: its cached reads of
        // the archive's ends), as one chunk of the whole file
        const memory_storage st(
            byte_buffer(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size),
            "f.distcp");
        const dcp_data_file f{"f.distcp", false, {{{"k", *t.type, shape_t(t.size.size(), 0), t.size}, 0, size, {}, 0}}};
        const auto h = index_dcp_data_file(st, f);
        FUZZ_CHECK(h.tensors.size() == 1 && h.offset_of(h.tensors[0]) == z.storage.data_offset &&
                   h.tensors[0].nbytes() == z.storage.size);
      }
    }
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("f.distcp"));
  }
  // the same bytes as a non-tensor item (torch 2.x's DCP values: data.pkl alone, a plain value)
  try {
    const auto z = locate_torch_zip(bytes, "f.distcp", torch_zip_value);
    FUZZ_CHECK(z.pickle && z.pickle->data_offset <= size && z.pickle->size <= size - z.pickle->data_offset);
    const memory_storage st(
        byte_buffer(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size),
        "f.distcp");
    (void)read_dcp_object(st, dcp_storage_info{"f.distcp", 0, size}, "'k'");
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("f.distcp"));
  }
  // the same bytes as a torch.save file of a state dict
  try {
    const memory_storage st(
        byte_buffer(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size),
        "f.bin");
    const torch_save_index x = index_torch_save_file(st);
    for (const auto& e : x.header.tensors) {
      FUZZ_CHECK(e.begin <= e.end && e.end <= size);
      FUZZ_CHECK(e.nbytes() == e.numel() * item_size(e.type));
    }
    // a value that is not a tensor: shown in at most the characters asked; one written again
    // (to-dcp) reads back as itself
    for (const auto& v : x.values) {
      FUZZ_CHECK(pickle_repr(v.value, 60).size() <= 60);
      FUZZ_CHECK(torch_value_repr(v.value, 60).size() <= 60);
      if (!v.unwritable.empty()) continue;
      const std::string again = pickle_dumps(v.value);
      // read back as a state dict's values are (bytes and sets are REDUCEs of builtins in protocol 2)
      if (again.size() <= (std::size_t(1) << 16))
        FUZZ_CHECK(pickle_loads(again, "f.bin: again", torch_tensor_pickle_policy{true}) == v.value);
    }
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata || e.code() == errc::unsupported_dtype);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("f.bin"));
  }
  return 0;
}
