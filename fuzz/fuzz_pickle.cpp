// libFuzzer target: pickle_loads on arbitrary bytes. Only shardsafe::error may escape. What is
// accepted must be plain data within the reader's limits, and must round-trip: pickle_dumps of
// it reads back equal (floats compare by their bits, so NaN payloads count) and dumps the same.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardsafe/format/pickle.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

// Depth (the reader refuses deeper than 1000) and value count of v; strings must be UTF-8.
std::size_t check(const pickle_value& v, std::size_t depth) {
  using k = pickle_value::kind;
  FUZZ_CHECK(depth <= 1000);
  std::size_t n = 1;
  switch (v.type()) {
    case k::string: FUZZ_CHECK(detail::is_valid_utf8(v.as_string("fuzz"))); break;
    case k::list:
    case k::tuple:
      for (const auto& x : v.as_sequence("fuzz")) n += check(x, depth + 1);
      break;
    case k::dict:
      for (std::size_t i = 0; i < v.dict_size(); ++i)
        n += check(v.dict_key(i), depth + 1) + check(v.dict_value(i), depth + 1);
      break;
    default: break;
  }
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  pickle_value v;
  try {
    v = pickle_loads(bytes, "param_group0");
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(e.code() == errc::invalid_metadata);
    FUZZ_CHECK(std::string_view(e.what()).starts_with("param_group0: pickle "));
    return 0;
  }
  FUZZ_CHECK(check(v, 0) <= (std::size_t(1) << 22));
  const std::string again = pickle_dumps(v);
  const pickle_value back = pickle_loads(again, "param_group0 (rewritten)");
  FUZZ_CHECK(back == v);
  FUZZ_CHECK(pickle_dumps(back) == again);
  return 0;
}
