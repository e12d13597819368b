#include "shardsafe/core/dtype.hpp"

#include <doctest/doctest.h>

using namespace shardsafe;

TEST_CASE("every dtype of docs/FORMAT.md has its name and size") {
  // sizes from the safetensors specification, written out independently of the table
  const std::pair<const char*, unsigned> expected[] = {
      {"BOOL", 8}, {"U8", 8},   {"I8", 8},      {"F8_E5M2", 8}, {"F8_E4M3", 8},     {"I16", 16},
      {"U16", 16}, {"F16", 16}, {"BF16", 16},   {"I32", 32},    {"U32", 32},        {"F32", 32},
      {"F64", 64}, {"I64", 64}, {"U64", 64},    {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
      {"C64", 64}, {"F4", 4},   {"F6_E2M3", 6}, {"F6_E3M2", 6}};
  CHECK(all_dtypes.size() == std::size(expected));
  for (auto [n, bits] : expected) {
    auto d = parse_dtype(n);
    REQUIRE_MESSAGE(d, n);
    CHECK(to_string(*d) == n);
    CHECK(bit_size(*d) == bits);
    CHECK(is_byte_sized(*d) == (bits % 8 == 0));
  }
  CHECK_FALSE(parse_dtype("F128"));
  CHECK_FALSE(parse_dtype("f32"));
  CHECK_THROWS_WITH_AS(dtype_from_name("Q7", "x.safetensors: tensor 'w'"),
                       "x.safetensors: tensor 'w': unknown dtype 'Q7'", shardsafe::error);
  CHECK_THROWS_AS(require_byte_sized(dtype::F4, "ctx"), shardsafe::error);
}
