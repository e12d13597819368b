// shardsafe/format/impl/safetensors.ipp - safetensors.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/safetensors.hpp"

namespace shardsafe {

SHARDSAFE_DECL safetensors_header parse_safetensors_header(std::string_view json, std::uint64_t file_size,
                                                           std::string_view file) {
  safetensors_header h;
  h.file = std::string(file);
  h.header_size = json.size();
  const std::string& f = h.file;

  simdjson::dom::parser parser;
  simdjson::dom::element root = detail::parse_json(parser, json, f + ": header");
  simdjson::dom::object obj;
  if (root.get_object().get(obj)) fail(errc::invalid_header, f + ": header is not a JSON object");

  std::vector<std::string_view> seen;
  seen.reserve(obj.size());
  for (auto field : obj) {
    std::string_view key = field.key;
    seen.push_back(key);
    if (key == "__metadata__") {
      if (field.value.is_null()) continue;  // no metadata, as the safetensors crate reads it (an Option)
      simdjson::dom::object md;
      if (field.value.get_object().get(md))
        fail(errc::invalid_header, f + ": __metadata__ is not an object of strings");
      for (auto kv : md) {
        std::string_view v;
        if (kv.value.get_string().get(v))
          fail(errc::invalid_header, f + ": __metadata__ value of '" + std::string(kv.key) +
                                         "' is not a string (__metadata__ maps strings to strings)");
        if (!h.metadata.emplace(std::string(kv.key), std::string(v)).second)
          fail(errc::invalid_header, f + ": __metadata__ has the key '" + std::string(kv.key) + "' twice");
      }
      h.has_metadata = true;
      continue;
    }
    const std::string ctx = detail::tensor_context(f, key);
    simdjson::dom::object t;
    if (field.value.get_object().get(t)) fail(errc::invalid_header, ctx + ": entry is not an object");

    {
      std::string_view fields[3];
      std::size_t n = 0;
      for (auto f : t)
        for (std::string_view known : {"dtype", "shape", "data_offsets"})
          if (f.key == known) {
            for (std::size_t i = 0; i < n; ++i)
              if (fields[i] == known)
                fail(errc::invalid_header, ctx + ": \"" + std::string(known) + "\" is given twice");
            fields[n++] = known;
          }
    }
    tensor_entry e;
    e.name = std::string(key);
    simdjson::dom::element v;
    if (t["dtype"].get(v)) fail(errc::invalid_header, ctx + ": missing \"dtype\"");
    std::string_view dt;
    if (v.get_string().get(dt)) fail(errc::invalid_header, ctx + ": dtype is not a string");
    e.type = dtype_from_name(dt, ctx);

    if (t["shape"].get(v)) fail(errc::invalid_header, ctx + ": missing \"shape\"");
    e.shape = detail::parse_count_array(v, ctx, "shape", errc::invalid_shape);

    if (t["data_offsets"].get(v)) fail(errc::invalid_header, ctx + ": missing \"data_offsets\"");
    auto offs = detail::parse_count_array(v, ctx, "data_offsets", errc::invalid_offsets);
    if (offs.size() != 2)
      fail(errc::invalid_offsets,
           ctx + ": data_offsets has " + std::to_string(offs.size()) + " numbers, not 2 [BEGIN, END]");
    e.begin = offs[0];
    e.end = offs[1];
    if (e.end < e.begin)
      fail(errc::invalid_offsets,
           ctx + ": data_offsets " + to_string(byte_range{e.begin, e.end}) + " end before they begin");

    auto n = detail::checked_numel(e.shape);
    std::optional<std::uint64_t> bits = n ? detail::checked_mul(*n, bit_size(e.type)) : std::nullopt;
    if (!bits)
      fail(errc::invalid_shape, ctx + ": shape " + to_string(e.shape) + " " + std::string(to_string(e.type)) +
                                    " has a byte size that overflows 64 bits");
    if (*bits % 8 != 0)
      fail(errc::invalid_shape, ctx + ": shape " + to_string(e.shape) + " " + std::string(to_string(e.type)) + " is " +
                                    std::to_string(*bits) + " bits, not a whole number of bytes");
    const std::uint64_t need = *bits / 8;
    if (e.nbytes() != need)
      fail(errc::invalid_offsets, ctx + ": data_offsets " + to_string(byte_range{e.begin, e.end}) + " span " +
                                      std::to_string(e.nbytes()) + " bytes but shape " + to_string(e.shape) + " " +
                                      std::string(to_string(e.type)) + " needs " + std::to_string(need));
    h.tensors.push_back(std::move(e));
  }

  // Duplicate names: simdjson keeps every occurrence of a key.
  std::sort(seen.begin(), seen.end());
  if (auto d = std::adjacent_find(seen.begin(), seen.end()); d != seen.end())
    fail(errc::invalid_header, f + ": name '" + std::string(*d) + "' appears twice in the header");

  // The tensors must tile the data buffer exactly.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const tensor_entry& a, const tensor_entry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  std::uint64_t expected = 0;
  const tensor_entry* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.begin > expected)
      fail(errc::invalid_offsets, detail::tensor_context(f, t.name) + ": data_offsets " +
                                      to_string(byte_range{t.begin, t.end}) + " leave a hole: bytes " +
                                      to_string(byte_range{expected, t.begin}) +
                                      " of the data buffer belong to no tensor");
    if (t.begin < expected)
      fail(errc::invalid_offsets, detail::tensor_context(f, t.name) + ": data_offsets " +
                                      to_string(byte_range{t.begin, t.end}) + " overlap tensor '" +
                                      (prev ? prev->name : std::string()) + "' " +
                                      to_string(byte_range{prev ? prev->begin : 0, expected}));
    expected = t.end;
    prev = &t;
  }
  h.data_size = expected;

  // checked: data_start <= 8 + max_header_size, data_size is bounded by a file offset
  auto total = detail::checked_add(h.data_start(), h.data_size);
  if (!total || *total > file_size)
    fail(errc::truncated, f + ": truncated: the data buffer needs " + std::to_string(h.data_size) +
                              " bytes from offset " + std::to_string(h.data_start()) + " (tensor '" +
                              (prev ? prev->name : std::string()) + "' ends at " + std::to_string(h.data_size) +
                              ") but the file has " + std::to_string(file_size) + " bytes");
  if (*total < file_size)
    fail(errc::truncated, f + ": " + std::to_string(file_size - *total) +
                              " trailing bytes after the last tensor (data ends at file offset " +
                              std::to_string(*total) + ", file has " + std::to_string(file_size) + ")");

  h.index_names();
  detail::require_unique_keys(root, f + ": header");  // after the rules above: "dtype" twice in a tensor, say
  return h;
}

SHARDSAFE_DECL safetensors_header parse_safetensors(std::span<const std::byte> file_bytes, std::string_view file) {
  if (file_bytes.size() < 8)
    fail(errc::truncated, std::string(file) + ": file is " + std::to_string(file_bytes.size()) +
                              " bytes, shorter than the 8-byte header length");
  const std::uint64_t n = check_header_length(decode_header_length(file_bytes.first<8>()), file_bytes.size(), file);
  std::string_view json(reinterpret_cast<const char*>(file_bytes.data()) + 8, n);
  return parse_safetensors_header(json, file_bytes.size(), file);
}

}  // namespace shardsafe
