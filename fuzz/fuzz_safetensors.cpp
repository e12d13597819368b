// libFuzzer target: parse_safetensors on arbitrary bytes. Only shardsafe::error may escape the
// parser. When a file is accepted, its header must satisfy docs/FORMAT.md §1 (the tensors tile the
// data buffer, spans match shapes, the file ends where the data ends), every tensor must read
// back through a storage, and writing the same tensors must give a file that parses to them.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/memory.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

// memcmp that allows empty (possibly null) ranges
static bool same(const void* a, const void* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n) == 0; }

static void check_file(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  safetensors_header h;
  try {
    h = parse_safetensors(bytes, "fuzz.safetensors");
  } catch (const shardsafe::error&) {
    return;
  }
  // invariants of an accepted file
  FUZZ_CHECK(h.file_size() == size);
  FUZZ_CHECK(h.header_size <= max_header_size);
  std::uint64_t expected = 0;
  for (const auto& t : h.tensors) {
    FUZZ_CHECK(t.begin == expected);
    FUZZ_CHECK(t.end >= t.begin);
    const std::uint64_t bits = t.numel() * bit_size(t.type);
    FUZZ_CHECK(bits % 8 == 0 && bits / 8 == t.nbytes());
    FUZZ_CHECK(h.find(t.name) != nullptr);
    expected = t.end;
  }
  FUZZ_CHECK(expected == h.data_size);
  FUZZ_CHECK(h.names().size() == h.tensors.size());

  // every tensor reads back from a storage of the same bytes
  const memory_storage s(byte_buffer(bytes.begin(), bytes.end()), "fuzz.safetensors");
  const safetensors_header h2 = read_safetensors_header(s);  // must agree with the span parser
  FUZZ_CHECK(h2.tensors.size() == h.tensors.size() && h2.data_size == h.data_size);
  std::vector<std::byte> buf;
  for (const auto& t : h.tensors) {
    buf.resize(t.nbytes());
    read_tensor(s, h, t, buf);
    FUZZ_CHECK(same(buf.data(), data + h.offset_of(t), buf.size()));
    if (is_byte_sized(t.type) && t.numel() > 0) {
      const std::uint64_t isz = item_size(t.type);
      std::vector<std::byte> one(isz);
      read_elements(s, h, t, t.numel() - 1, one);
      FUZZ_CHECK(same(one.data(), data + h.offset_of(t) + t.nbytes() - isz, isz));
    }
  }

  // writing the same tensors gives a file that parses back to them
  std::vector<tensor_data> td;
  bool writable = true;
  for (const auto& t : h.tensors) {
    writable = writable && !t.name.empty();
    td.push_back({t.name, t.type, t.shape, bytes.subspan(h.offset_of(t), t.nbytes())});
  }
  memory_writer w("fuzz.out.safetensors");
  try {
    write_safetensors(w, std::span<const tensor_data>(td), h.metadata);
  } catch (const shardsafe::error&) {
    FUZZ_CHECK(!writable);  // only a name the writer may not write (the empty one) is refused
    return;
  }
  const byte_buffer out = w.take();
  const safetensors_header back = parse_safetensors(out, "fuzz.out.safetensors");
  FUZZ_CHECK(back.data_start() % 8 == 0);
  FUZZ_CHECK(back.tensors.size() == h.tensors.size());
  FUZZ_CHECK(back.metadata == h.metadata);
  for (const auto& t : h.tensors) {
    const tensor_entry* b = back.find(t.name);
    FUZZ_CHECK(b && b->type == t.type && b->shape == t.shape && b->nbytes() == t.nbytes());
    FUZZ_CHECK(back.offset_of(*b) % alignment(b->type) == 0);
    FUZZ_CHECK(same(out.data() + back.offset_of(*b), data + h.offset_of(t), t.nbytes()));
  }
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // the input as a whole file
  check_file(data, size);
  // and, so that mutations of the JSON need not keep the length prefix in step, the input as
  // a header running to its last '}' followed by data, behind a length prefix made for it
  std::size_t n = size;
  while (n > 0 && data[n - 1] != '}') --n;
  std::vector<std::uint8_t> framed(8 + size);
  for (int i = 0; i < 8; ++i)
    framed[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>((std::uint64_t(n) >> (8 * i)) & 0xff);
  if (size) std::memcpy(framed.data() + 8, data, size);
  check_file(framed.data(), framed.size());
  return 0;
}
