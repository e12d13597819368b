// tests/support/checkpoint_fixtures.hpp - Hugging Face folders and sharded checkpoints built by hand
// (independently of the library's writers), with the broken variants a verifier must refuse
// and the errc and phrases it must give. Written into any WritableDirectory, so the same
// fixtures serve the library's tests on each backend (test_verify.cpp) and the tool's tests on
// files (test_tool.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "malformed_corpus.hpp"
#include "test_util.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace fixtures {

struct tensor {
  std::string name, dtype;
  std::vector<std::uint64_t> shape;
  std::string bytes;
};

inline std::string shape_text(const std::vector<std::uint64_t>& s, const char* sep) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? sep : "") + std::to_string(s[i]);
  return r + "]";
}

/// A safetensors file laid out by hand: tensors in the given order, header padded to 8.
inline std::string build_file(const std::vector<tensor>& ts) {
  std::string json = "{", data;
  for (const auto& t : ts) {
    if (json.size() > 1) json += ',';
    json += corpus::entry(t.name, t.dtype, shape_text(t.shape, ","),
                          "[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) + "]");
    data += t.bytes;
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');
  return corpus::file_bytes(json, data);
}

inline std::string random_string(std::size_t n, std::mt19937_64& rng) { return testing::random_bytes(n, rng); }

/// Seven tensors of assorted dtypes and shapes, a 0-d, an empty and a sub-byte one among them.
inline std::vector<tensor> sample_tensors() {
  std::mt19937_64 rng(99);
  return {
      {"layer.0.weight", "F32", {3, 4}, random_string(48, rng)},
      {"layer.0.bias", "F32", {4}, random_string(16, rng)},
      {"embed", "BF16", {5, 2}, random_string(20, rng)},
      {"scalar", "I64", {}, random_string(8, rng)},
      {"empty", "F16", {0, 3}, ""},
      {"flags", "BOOL", {3}, std::string("\x01\x00\x01", 3)},
      {"q4", "F4", {4}, random_string(2, rng)},
  };
}

inline std::uint64_t total_bytes(const std::vector<tensor>& ts) {
  std::uint64_t n = 0;
  for (const auto& t : ts) n += t.bytes.size();
  return n;
}

/// Stores bytes as object `name` of dir (created if missing), committed.
template <shardsafe::WritableDirectory D>
void put(const D& dir, std::string_view name, std::string_view bytes) {
  dir.make();
  auto w = dir.create(name);
  w.write_at(0, std::as_bytes(std::span(bytes.data(), bytes.size())));
  w.sync();
  w.commit();
}

// ---------------------------------------------------------------------------------------
// Hugging Face folders: tensors named before "l" go to file1, the others to file2

inline const char* const file1 = "model-00001-of-00002.safetensors";
inline const char* const file2 = "model-00002-of-00002.safetensors";

inline const char* file_of(const tensor& t) { return t.name < "l" ? file1 : file2; }

/// The index text of the folder make_indexed writes, with the weight_map entry of tensor
/// change_name replaced by the JSON value `value` (or dropped when value is empty), `extra`
/// appended inside weight_map, and total_size `size` (0: the correct one).
inline std::string index_text(const std::vector<tensor>& ts, std::string_view change_name = "", std::string value = "",
                              std::string extra = "", std::uint64_t size = 0) {
  std::string map;
  for (const auto& t : ts) {
    std::string v = "\"" + std::string(file_of(t)) + "\"";
    if (t.name == change_name) {
      if (value.empty()) continue;
      v = value;
    }
    map += std::string(map.empty() ? "" : ", ") + "\"" + t.name + "\": " + v;
  }
  return "{\"metadata\": {\"total_size\": " + std::to_string(size ? size : total_bytes(ts)) + "}, \"weight_map\": {" +
         map + extra + "}}";
}

/// An indexed HF folder: tensors split over two files, index text from `index` (or correct).
template <shardsafe::WritableDirectory D>
void make_indexed(const D& dir, const std::vector<tensor>& ts, const std::string& index = "") {
  std::vector<tensor> a, b;
  for (const auto& t : ts) (file_of(t) == file1 ? a : b).push_back(t);
  put(dir, file1, build_file(a));
  put(dir, file2, build_file(b));
  put(dir, "model.safetensors.index.json", index.empty() ? index_text(ts) : index);
}

/// An index that a verifier must refuse, with the error it must give.
struct bad_index {
  std::string what, index;
  shardsafe::errc code;
  std::vector<std::string> phrases;  ///< substrings of the message
};

/// Every way the index of make_indexed(ts) can be wrong that open_hf_folder and the tool catch.
inline std::vector<bad_index> bad_indexes(const std::vector<tensor>& ts) {
  using shardsafe::errc;
  const std::uint64_t total = total_bytes(ts);
  return {
      {"slash",
       index_text(ts, "embed", "\"sub/model-00001-of-00002.safetensors\""),
       errc::invalid_metadata,
       {"tensor 'embed'", "not a plain name"}},
      {"dotdot",
       index_text(ts, "embed", "\"../model-00001-of-00002.safetensors\""),
       errc::invalid_metadata,
       {"tensor 'embed'", "not a plain name"}},
      {"backslash",
       index_text(ts, "embed", "\"a\\\\b.safetensors\""),
       errc::invalid_metadata,
       {"tensor 'embed'", "not a plain name"}},
      {"missing file",
       index_text(ts, "", "", ", \"extra\": \"model-00003-of-00003.safetensors\""),
       errc::not_found,
       {"model-00003-of-00003.safetensors", "missing"}},
      {"listed but absent",
       index_text(ts, "", "", ", \"ghost\": \"model-00001-of-00002.safetensors\""),
       errc::not_found,
       {file1, "tensor 'ghost'", "absent"}},
      {"not listed",
       index_text(ts, "flags", "", "", total - 3),
       errc::invalid_metadata,
       {file1, "tensor 'flags'", "not listed"}},
      {"wrong file",  // (found as file1 is opened, before file2 is: each file is held to the index as it opens)
       index_text(ts, "flags", "\"" + std::string(file2) + "\""),
       errc::invalid_metadata,
       {file1, "tensor 'flags'", "the index places it in " + std::string(file2)}},
      {"not JSON", "{\"weight_map\": ", errc::invalid_json, {"model.safetensors.index.json", "not valid JSON"}},
      {"duplicate tensor",
       index_text(ts, "", "", ", \"embed\": \"" + std::string(file1) + "\""),
       errc::invalid_metadata,
       {"tensor 'embed'", "twice"}},
  };
}

// ---------------------------------------------------------------------------------------
// a sharded checkpoint over two ranks:
// w: F32 [4,3] in row blocks; b: I16 [5] by flattened offsets; c: U8 [2,2,4] in column blocks

struct sharded_sample {
  tensor w, b, c;
  std::string rank0, rank1;

  sharded_sample() {
    std::mt19937_64 rng(5);
    w = {"w", "F32", {4, 3}, random_string(48, rng)};
    b = {"b", "I16", {5}, random_string(10, rng)};
    c = {"c", "U8", {2, 2, 4}, random_string(16, rng)};
    auto cols = [&](std::size_t k0) {  // c[:, :, k0:k0+2], row-major
      std::string s;
      for (std::size_t ij = 0; ij < 4; ++ij) s += c.bytes.substr(ij * 4 + k0, 2);
      return s;
    };
    rank0 = build_file(
        {{"w", "F32", {6}, w.bytes.substr(0, 24)}, {"b", "I16", {2}, b.bytes.substr(0, 4)}, {"c", "U8", {8}, cols(0)}});
    rank1 = build_file(
        {{"w", "F32", {6}, w.bytes.substr(24)}, {"b", "I16", {3}, b.bytes.substr(4)}, {"c", "U8", {8}, cols(2)}});
  }

  /// metadata.json; with complete = false rank 1's block of w is not listed (a hole in w).
  /// `extra` is appended to the top-level object (e.g. a "shardsafe" section).
  static std::string metadata(bool complete, const std::string& extra = "") {
    auto block = [](const char* file, const char* ls, const char* go) {
      return std::string("\"") + file + "\": {\"flattened_offsets\": null, \"local_shape\": " + ls +
             ", \"global_offset\": " + go + "}";
    };
    return std::string("{\"tensors\": {\"w\": {\"shape\": [4, 3], \"is_sharded\": true, \"dtype\": \"F32\", ") +
           "\"shard_spec_per_file\": {" + block("rank_0.safetensors", "[2, 3]", "[0, 0]") +
           (complete ? ", " + block("rank_1.safetensors", "[2, 3]", "[2, 0]") : std::string()) + "}}, " +
           "\"b\": {\"shape\": [5], \"is_sharded\": true, \"dtype\": \"I16\", \"shard_spec_per_file\": {" +
           "\"rank_0.safetensors\": {\"flattened_offsets\": [[0, 2]], \"local_shape\": null, \"global_offset\": "
           "null}, " +
           "\"rank_1.safetensors\": {\"flattened_offsets\": [[2, 5]], \"local_shape\": null, \"global_offset\": "
           "null}}}, " +
           "\"c\": {\"shape\": [2, 2, 4], \"is_sharded\": true, \"dtype\": \"U8\", \"shard_spec_per_file\": {" +
           block("rank_0.safetensors", "[2, 2, 2]", "[0, 0, 0]") + ", " +
           block("rank_1.safetensors", "[2, 2, 2]", "[0, 0, 2]") + "}}}" + extra + "}";
  }

  template <shardsafe::WritableDirectory D>
  void write(const D& dir, bool complete = true) const {
    put(dir, "rank_0.safetensors", rank0);
    put(dir, "rank_1.safetensors", rank1);
    put(dir, "metadata.json", metadata(complete));
  }
};

}  // namespace fixtures
