// A program that uses an installed (or subproject) shardsafe: it writes a two-tensor
// safetensors file to memory, parses it back and checks every value. Built by run.sh with
// CMake (find_package), with pkg-config, and with Meson (shardsafe as a subproject); each
// defines SHARDSAFE_EXPECTED_VERSION as its package's version, which shardsafe/version.hpp
// must agree with.
#include "shardsafe/format/safetensors_writer.hpp"
#include "shardsafe/storage/memory.hpp"
#include "shardsafe/version.hpp"

#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what);
    ++failures;
  }
}
}  // namespace

int main() {
  using namespace shardsafe;
  const std::vector<float> w = {1.5f, -2.0f, 3.25f, 4.0f, 5.0f, -6.5f};
  const std::vector<std::int64_t> step = {42};
  const tensor_data tensors[] = {
      {"layer.weight", dtype::F32, {2, 3}, std::as_bytes(std::span(w))},
      {"step", dtype::I64, {}, std::as_bytes(std::span(step))},
  };
  memory_writer out("consumer.safetensors");
  write_safetensors(out, std::span(tensors), {{"format", "pt"}});
  const memory_storage file(out.take(), "consumer.safetensors");

  const safetensors_header h = read_safetensors_header(file);
  expect(h.tensors.size() == 2, "two tensors");
  expect(h.data_start() % 8 == 0, "data buffer aligned to 8");
  expect(h.metadata.size() == 1 && h.metadata.at("format") == "pt", "__metadata__");
  const tensor_entry& tw = h.at("layer.weight");
  const tensor_entry& ts = h.at("step");
  expect(tw.type == dtype::F32 && tw.shape == shape_t{2, 3} && tw.nbytes() == 24, "layer.weight entry");
  expect(ts.type == dtype::I64 && ts.shape.empty() && ts.nbytes() == 8, "step entry");

  std::vector<float> w2(6);
  read_elements(file, h, tw, 0, std::as_writable_bytes(std::span(w2)));
  expect(w2 == w, "layer.weight values");
  std::vector<std::int64_t> s2(1);
  read_elements(file, h, ts, 0, std::as_writable_bytes(std::span(s2)));
  expect(s2 == step, "step value");

  // a truncated copy is refused with a shardsafe::error
  auto bytes = file.bytes();
  byte_buffer cut(bytes.begin(), bytes.end() - 1);
  try {
    (void)parse_safetensors(cut, "cut.safetensors");
    expect(false, "truncated file refused");
  } catch (const shardsafe::error& e) {
    expect(e.code() == errc::truncated || e.code() == errc::invalid_offsets || e.code() == errc::invalid_header,
           "truncated file refused with the right code");
  }
#ifdef SHARDSAFE_EXPECTED_VERSION
  expect(library_version == SHARDSAFE_EXPECTED_VERSION, "shardsafe/version.hpp agrees with the package version");
#else
  expect(false, "the build defines SHARDSAFE_EXPECTED_VERSION");
#endif
  if (failures) return 1;
  std::printf("consumer ok (shardsafe %s)\n", SHARDSAFE_VERSION_STRING);
  return 0;
}
