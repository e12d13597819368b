// libFuzzer target: the checksum tables a checkpoint records (docs/FORMAT.md §2, "Checksums" and
// "The compact form"), read as verify reads them. A fixed checkpoint is saved once, by the
// library's own save (single process, in memory, blocks of 8 bytes), twice: in the compact form
// (the tables in rank_0.checksums.json, metadata.json saying "sidecars": true) and in the listed
// form (the table in metadata.json's shardsafe.checksums). The input's first byte picks one:
//   even: the rest replaces rank_0.checksums.json (the sidecar reader: read_text, json_document,
//         parse_checksum_table, duplicate keys);
//   odd:  the rest replaces the value of metadata.json's "checksums" (parse_checksums).
// Then verify_checkpoint reads the tables and hashes every block. Only shardsafe::error may
// escape (invalid_metadata, invalid_json or checksum_mismatch), naming the file that holds the
// table. A table that verifies is the one the save wrote (blocks of the same size). A sidecar the
// parser accepts is written again (append_checksum_table) and reads back as itself.
// With SHARDSAFE_FUZZ_WRITE_SEEDS=DIR set, the target writes its seeds (the two tables the save
// wrote, in the input's form) into DIR and exits: fuzz/corpus/sidecars/ was made so.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/checkpoint/saver.hpp"
#include "shardsafe/checkpoint/verify.hpp"
#include "shardsafe/dist/single.hpp"
#include "shardsafe/format/metadata_parts.hpp"
#include "shardsafe/format/metadata_writer.hpp"
#include "shardsafe/storage/memory.hpp"

#include "fuzz_check.hpp"

using namespace shardsafe;

namespace {

using table = std::map<std::string, std::vector<std::uint64_t>>;

struct fixture {
  std::shared_ptr<memory_store> compact, listed;
  std::string sidecar;           // rank_0.checksums.json as saved
  std::string md_head, md_tail;  // listed metadata.json around its "checksums" value
  std::string checksums_value;   // that value as saved
  table saved;                   // rank_0.safetensors' table
  std::uint64_t block_bytes = 8;
};

std::string bytes_of(const std::shared_ptr<memory_store>& s, const std::string& name) {
  const auto& b = *s->objects.at(name);
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

void put(const std::shared_ptr<memory_store>& s, const std::string& name, std::string_view text) {
  s->objects[name] = std::make_shared<const byte_buffer>(reinterpret_cast<const std::byte*>(text.data()),
                                                         reinterpret_cast<const std::byte*>(text.data()) + text.size());
}

// The end of the JSON value starting at text[at] (an object: braces matched outside strings).
std::size_t end_of_object(const std::string& text, std::size_t at) {
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = at; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && --depth == 0) {
      return i + 1;
    }
  }
  std::abort();
}

fixture make_fixture() {
  fixture f;
  // tensors of several sizes: 6 blocks, one short block, none (empty), a scalar, an odd name
  std::vector<std::string> memory = {std::string(48, '\0'), std::string(6, '\0'), std::string(), std::string(8, '\0'),
                                     std::string(4, '\0')};
  for (std::size_t i = 0; i < memory.size(); ++i)
    for (std::size_t j = 0; j < memory[i].size(); ++j) memory[i][j] = static_cast<char>(i * 37 + j * 11 + 1);
  auto view = [&](std::string key, dtype t, shape_t shape, std::size_t m) {
    return flat_view{std::move(key),  t, std::move(shape), std::nullopt, reinterpret_cast<std::byte*>(memory[m].data()),
                     memory[m].size()};
  };
  const std::vector<flat_view> views = {view("w", dtype::F32, {4, 3}, 0), view("b", dtype::BF16, {3}, 1),
                                        view("e", dtype::F32, {0, 2}, 2), view("s", dtype::I64, {}, 3),
                                        view("odd \"name\"\\ \xc3\xa9", dtype::F16, {2}, 4)};
  for (const bool compact : {true, false}) {
    auto store = std::make_shared<memory_store>();
    save_options o;
    o.threads = 1;
    o.checksum_block_bytes = f.block_bytes;
    o.metadata = compact ? metadata_form::compact : metadata_form::listed;
    single_process comm;
    save(memory_directory(store, "mem:/ckpt"), std::span<const flat_view>(views), comm, o);
    (compact ? f.compact : f.listed) = store;
  }
  f.sidecar = bytes_of(f.compact, "mem:/ckpt/rank_0.checksums.json");
  const std::string md = bytes_of(f.listed, "mem:/ckpt/metadata.json");
  const std::string key = "\"checksums\":";
  std::size_t at = md.find(key);
  if (at == std::string::npos) std::abort();
  at = md.find('{', at + key.size());
  const std::size_t end = end_of_object(md, at);
  f.md_head = md.substr(0, at);
  f.md_tail = md.substr(end);
  f.checksums_value = md.substr(at, end - at);
  checkpoint_reader<memory_directory> r(memory_directory(f.compact, "mem:/ckpt"));
  const std::vector<std::string> files{"rank_0.safetensors"};
  f.saved = r.checksums_for(files, 1)->files.at("rank_0.safetensors");
  if (f.saved.size() != views.size() || f.saved.at("w").size() != 6) std::abort();
  return f;
}

const fixture& the_fixture() {
  static const fixture f = make_fixture();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const fixture& f = the_fixture();
  if (const char* dir = std::getenv("SHARDSAFE_FUZZ_WRITE_SEEDS")) {
    std::ofstream(std::string(dir) + "/saved_sidecar", std::ios::binary) << '\0' << f.sidecar;
    std::ofstream(std::string(dir) + "/saved_checksums", std::ios::binary) << '\1' << f.checksums_value;
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const fixture& f = the_fixture();
  const bool in_metadata = data[0] & 1;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // a copy of the saved checkpoint's store with the input in place (the rank file shared)
  auto store = std::make_shared<memory_store>();
  store->objects = (in_metadata ? f.listed : f.compact)->objects;
  if (in_metadata)
    put(store, "mem:/ckpt/metadata.json", f.md_head + std::string(text) + f.md_tail);
  else
    put(store, "mem:/ckpt/rank_0.checksums.json", text);
  const std::string holder = in_metadata ? "metadata.json" : "rank_0.checksums.json";
  try {
    checkpoint_reader<memory_directory> r(memory_directory(store, "mem:/ckpt"));
    verify_options vo;
    vo.threads = 1;
    const checkpoint_report rep = verify_checkpoint(r, vo);
    // verified: the hashes are the save's (blocks of its size), every block checked
    const std::vector<std::string> files{"rank_0.safetensors"};
    const checkpoint_checksums* cs = r.checksums_for(files, 1);
    FUZZ_CHECK(cs && rep.checksums);
    if (cs->block_bytes == f.block_bytes) {
      FUZZ_CHECK(cs->files.at("rank_0.safetensors") == f.saved);
      FUZZ_CHECK(rep.checksum_blocks == 6 + 1 + 0 + 1 + 1);
    }
  } catch (const shardsafe::error& e) {
    const auto c = e.code();
    FUZZ_CHECK(c == errc::invalid_metadata || c == errc::invalid_json || c == errc::checksum_mismatch);
    FUZZ_CHECK(std::string_view(e.what()).find(holder) != std::string_view::npos);
  }
  // the sidecar's parser alone: what it accepts is written again and reads back as itself
  if (!in_metadata) {
    table t;
    try {
      const std::string owned(text);
      detail::json_document doc(owned, "rank_0.checksums.json", &owned);
      t = detail::parse_checksum_table(doc.root("not an object of tensors"), "rank_0.checksums.json");
      doc.require_unique_keys();
    } catch (const shardsafe::error& e) {
      FUZZ_CHECK(std::string_view(e.what()).find("rank_0.checksums.json") != std::string_view::npos);
      return 0;
    }
    std::string again;
    detail::append_checksum_table(again, t);
    detail::json_document doc(again, "again", &again);
    FUZZ_CHECK(detail::parse_checksum_table(doc.root("again"), "again") == t);
  }
  return 0;
}
