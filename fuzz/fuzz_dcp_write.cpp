// libFuzzer target: the torch DCP writers, round trip. From the input: up to 6 tensors (names of
// any bytes, empty ones, every dtype, 0 to 3 dimensions of 0 to 4, their bytes; some held as two
// flat ranges, which the writer tiles into blocks), up to 4 non-tensor items (nested None, bool,
// int, float, str, list, tuple, dict values) and nested state-dict paths for some keys. Then:
//   1. save_dcp (format/dcp_writer.hpp, dcp_metadata_writer.hpp) writes them into a memory
//      folder, single process. It writes, or refuses with shardsafe::error and no .metadata
//      (the commit mark) in the folder; nothing else.
//   2. What it wrote reads back with the library's DCP reader as what was given: the same
//      tensor names, dtypes, shapes and bytes, items and values, and paths.
//   3. to-dcp's writer (export_to, checkpoint/dcp_export.hpp) copies that folder into another,
//      streaming in chunks of 1 to 16 bytes (refusing only a tensor named "", which it has no
//      name to write under); it reads back the same again, each item's archive byte for byte.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardsafe/checkpoint/dcp_export.hpp"
#include "shardsafe/checkpoint/dcp_save.hpp"
#include "shardsafe/checkpoint/unshard.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/storage/memory.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

struct tensor_in {
  std::string key;
  dtype type;
  shape_t shape;
  std::string bytes;
  std::uint64_t split = 0;  // 0: whole; else two flat ranges [0, split), [split, n)
};

pickle_value value_of(FuzzedDataProvider& in, int depth) {
  const int k = in.ConsumeIntegralInRange<int>(0, depth < 3 ? 7 : 4);
  switch (k) {
    case 0: return pickle_value::none();
    case 1: return pickle_value::boolean(in.ConsumeBool());
    case 2: return pickle_value::integer(in.ConsumeIntegral<std::int64_t>());
    case 3: {
      const auto bits = in.ConsumeIntegral<std::uint64_t>();
      return pickle_value::real(std::bit_cast<double>(bits));
    }
    case 4: return pickle_value::string(in.ConsumeRandomLengthString(12));
    default: {
      const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, 3);
      if (k == 7) {
        std::vector<std::pair<pickle_value, pickle_value>> entries;
        std::set<std::string> seen;
        for (std::size_t i = 0; i < n; ++i) {
          std::string key = in.ConsumeRandomLengthString(8);
          if (!seen.insert(key).second) continue;
          entries.emplace_back(pickle_value::string(std::move(key)), value_of(in, depth + 1));
        }
        return pickle_value::dict(std::move(entries));
      }
      std::vector<pickle_value> items;
      for (std::size_t i = 0; i < n; ++i) items.push_back(value_of(in, depth + 1));
      return k == 5 ? pickle_value::list(std::move(items)) : pickle_value::tuple(std::move(items));
    }
  }
}

pickle_value path_of(FuzzedDataProvider& in) {
  std::vector<pickle_value> parts;
  const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(1, 4);
  for (std::size_t i = 0; i < n; ++i)
    parts.push_back(in.ConsumeBool() ? pickle_value::integer(in.ConsumeIntegralInRange<std::int64_t>(0, 9))
                                     : pickle_value::string(in.ConsumeRandomLengthString(8)));
  return pickle_value::tuple(std::move(parts));
}

// What a DCP folder holds, read by the library's reader, is what was given.
void check_read_back(checkpoint_reader<memory_directory>& r, const std::vector<tensor_in>& tensors,
                     const std::vector<dcp_object>& objects, const std::map<std::string, pickle_value>& paths) {
  FUZZ_CHECK(r.layout().id == "dcp");
  FUZZ_CHECK(r.metadata().tensors.size() == tensors.size());
  for (const auto& t : tensors) {
    const tensor_metadata* tm = r.find(t.key);
    FUZZ_CHECK(tm && tm->type == t.type && tm->shape == t.shape);
    std::string back(t.bytes.size(), '\x5a');
    unshard_tensor(r, t.key, std::as_writable_bytes(std::span(back)));
    FUZZ_CHECK(back == t.bytes);
  }
  FUZZ_CHECK(r.non_tensors().size() == objects.size());
  for (const auto& o : objects) FUZZ_CHECK(r.read_object(o.key) == o.value);
  auto check_path = [&](const std::string& key) {
    const pickle_value* p = r.path_in_state_dict(key);
    const auto given = paths.find(key);
    FUZZ_CHECK(p && *p == (given != paths.end() ? given->second : pickle_value::tuple({pickle_value::string(key)})));
  };
  for (const auto& t : tensors) check_path(t.key);
  for (const auto& o : objects) check_path(o.key);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::vector<tensor_in> tensors;
  std::vector<dcp_object> objects;
  std::map<std::string, pickle_value> paths;
  std::set<std::string> keys;  // given once each (two alike are the caller's error, not the format's)
  const std::size_t nt = in.ConsumeIntegralInRange<std::size_t>(0, 6);
  for (std::size_t i = 0; i < nt; ++i) {
    tensor_in t;
    t.key = in.ConsumeRandomLengthString(16);
    const dtype_info& info = all_dtypes[in.ConsumeIntegralInRange<std::size_t>(0, all_dtypes.size() - 1)];
    t.type = info.type;
    const std::size_t nd = in.ConsumeIntegralInRange<std::size_t>(0, 3);
    for (std::size_t d = 0; d < nd; ++d) t.shape.push_back(in.ConsumeIntegralInRange<std::uint64_t>(0, 4));
    const std::uint64_t n = numel(t.shape);
    const std::uint64_t nbytes = (n * info.bits + 7) / 8;
    t.bytes = in.ConsumeBytesAsString(static_cast<std::size_t>(nbytes));
    t.bytes.resize(static_cast<std::size_t>(nbytes), '\0');
    if (n > 1 && in.ConsumeBool()) t.split = in.ConsumeIntegralInRange<std::uint64_t>(1, n - 1);
    if (in.ConsumeBool()) paths[t.key] = path_of(in);
    if (keys.insert(t.key).second) tensors.push_back(std::move(t));
  }
  const std::size_t no = in.ConsumeIntegralInRange<std::size_t>(0, 4);
  for (std::size_t i = 0; i < no; ++i) {
    dcp_object o{in.ConsumeRandomLengthString(16), value_of(in, 0)};
    if (in.ConsumeBool()) paths[o.key] = path_of(in);
    if (keys.insert(o.key).second) objects.push_back(std::move(o));
  }
  for (auto it = paths.begin(); it != paths.end();) it = keys.count(it->first) ? std::next(it) : paths.erase(it);

  // 1. written, or refused with nothing committed
  std::vector<flat_view> views;
  for (auto& t : tensors) {
    flat_view v{t.key, t.type, t.shape, std::nullopt, reinterpret_cast<std::byte*>(t.bytes.data()), t.bytes.size()};
    if (t.split) v.spec = shard_spec(flat_spec{{{0, t.split}, {t.split, numel(t.shape)}}});
    views.push_back(std::move(v));
  }
  auto store = std::make_shared<memory_store>();
  const memory_directory dir(store, "mem:/ckpt");
  try {
    save_options o;
    o.threads = 1;
    o.write_chunk_bytes = 1 + data[0 % (size ? size : 1)] % 64;
    single_process comm;
    save_dcp(dir, std::span<const flat_view>(views), comm, o, std::span<const dcp_object>(objects), paths);
  } catch (const shardsafe::error& e) {
    FUZZ_CHECK(!dir.exists(".metadata"));
    return 0;
  }
  // 2. read back as given
  checkpoint_reader<memory_directory> r(dir);
  check_read_back(r, tensors, objects, paths);

  // 3. to-dcp's writer: the folder copied, read back the same, archives byte for byte
  auto out_store = std::make_shared<memory_store>();
  const memory_directory out(out_store, "mem:/out");
  dcp_export_options eo;
  eo.chunk_bytes = 1 + (size ? data[size - 1] : 0) % 16;
  const unshard_source<memory_directory> src{&r, ""};
  dcp_export_stats st;
  try {
    st = export_to(std::span<const unshard_source<memory_directory>>(&src, 1), out, eo);
  } catch (const shardsafe::error& e) {
    // refused only for a tensor or value named "": no name to write it under
    // (checkpoint/parts.hpp; fuzz/corpus/dcp_write/regress_export_refused_empty_key was refused for rename rules
    // never given)
    FUZZ_CHECK(std::any_of(tensors.begin(), tensors.end(), [](const tensor_in& t) { return t.key.empty(); }) ||
               std::any_of(objects.begin(), objects.end(), [](const dcp_object& o) { return o.key.empty(); }));
    FUZZ_CHECK(!out.exists(".metadata"));
    return 0;
  }
  // every item is written: one keyed "" is refused above, not left out
  // (fuzz/corpus/dcp_write/regress_export_drops_empty_key was exported without it, exit 0)
  FUZZ_CHECK(st.tensors == tensors.size() && st.objects == objects.size());
  checkpoint_reader<memory_directory> r2(out);
  check_read_back(r2, tensors, objects, paths);
  for (const auto& o : objects) FUZZ_CHECK(r2.read_object_archive(o.key) == r.read_object_archive(o.key));
  return 0;
}
