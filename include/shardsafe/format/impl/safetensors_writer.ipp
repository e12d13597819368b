// shardsafe/format/impl/safetensors_writer.ipp - safetensors_writer.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/safetensors_writer.hpp"

namespace shardsafe {

SHARDSAFE_DECL safetensors_layout plan_safetensors(std::vector<tensor_entry> tensors,
                                                   const std::map<std::string, std::string>& metadata,
                                                   std::string_view file) {
  safetensors_layout l;
  l.file = std::string(file);
  // what a reader refuses is never written (docs/FORMAT.md §1): a save of more tensors per rank
  // file would commit a checkpoint no reader of this library opens
  std::uint64_t name_bytes = 0;
  for (const auto& t : tensors) name_bytes += t.name.size();
  if (tensors.size() > max_tensors_per_file || name_bytes > max_tensor_name_bytes_per_file)
    fail(errc::invalid_argument,
         l.file + ": " + std::to_string(tensors.size()) + " tensors whose names take " + std::to_string(name_bytes) +
             " bytes in one file, past what a reader accepts (" + std::to_string(max_tensors_per_file) + " tensors, " +
             std::to_string(max_tensor_name_bytes_per_file) +
             " bytes of names: docs/FORMAT.md §1); stack tensors (experts) or split them over more files");
  for (const auto& t : tensors) {
    const std::string ctx = detail::tensor_context(file, t.name);
    if (t.name.empty() || t.name == "__metadata__" || !detail::is_valid_utf8(t.name))
      fail(errc::invalid_argument, ctx + ": not a valid tensor name (must be non-empty UTF-8, not __metadata__)");
    auto n = detail::checked_numel(t.shape);
    auto bits = n ? detail::checked_mul(*n, bit_size(t.type)) : std::nullopt;
    if (!bits || *bits % 8 != 0)
      fail(errc::invalid_shape, ctx + ": shape " + to_string(t.shape) + " " + std::string(to_string(t.type)) +
                                    " is not a whole number of bytes below 2^64");
  }
  for (const auto& [k, v] : metadata)
    if (!detail::is_valid_utf8(k) || !detail::is_valid_utf8(v))
      fail(errc::invalid_argument, l.file + ": __metadata__ entry '" + k + "' is not valid UTF-8");

  std::sort(tensors.begin(), tensors.end(), [](const tensor_entry& a, const tensor_entry& b) {
    if (alignment(a.type) != alignment(b.type)) return alignment(a.type) > alignment(b.type);
    return a.name < b.name;
  });
  {
    std::vector<std::string_view> names;
    for (const auto& t : tensors) names.push_back(t.name);
    std::sort(names.begin(), names.end());
    if (auto d = std::adjacent_find(names.begin(), names.end()); d != names.end())
      fail(errc::invalid_argument, detail::tensor_context(file, *d) + ": name given twice");
  }

  std::uint64_t off = 0;
  for (auto& t : tensors) {
    const std::uint64_t nbytes = numel(t.shape) * bit_size(t.type) / 8;
    auto e = detail::checked_add(off, nbytes);
    if (!e) fail(errc::invalid_shape, l.file + ": total data size overflows 64 bits");
    t.begin = off;
    t.end = *e;
    off = *e;
  }

  std::string json = "{";
  bool first = true;
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!first) json += ',';
      first = false;
      detail::append_json_string(json, k);
      json += ':';
      detail::append_json_string(json, v);
    }
    json += '}';
    first = false;
    if (json.size() - 1 > max_header_member_bytes)  // what a reader refuses is never written (§1)
      fail(errc::invalid_argument, l.file + ": __metadata__ of " + std::to_string(json.size() - 1) +
                                       " bytes of JSON passes the " + std::to_string(max_header_member_bytes) +
                                       " a reader accepts (docs/FORMAT.md §1)");
  }
  for (const auto& t : tensors) {
    if (!first) json += ',';
    first = false;
    detail::append_json_string(json, t.name);
    json += ":{\"dtype\":\"";
    json += to_string(t.type);
    json += "\",\"shape\":[";
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      if (i) json += ',';
      json += std::to_string(t.shape[i]);
    }
    json += "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
  }
  json += '}';
  while ((8 + json.size()) % 8 != 0) json += ' ';
  if (json.size() > max_header_size)
    fail(errc::invalid_argument, l.file + ": header of " + std::to_string(json.size()) +
                                     " bytes passes the safetensors limit of " + std::to_string(max_header_size));

  l.header.resize(8);
  std::uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) l.header[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  l.header += json;
  l.tensors = std::move(tensors);
  l.by_name_.resize(l.tensors.size());
  for (std::size_t i = 0; i < l.by_name_.size(); ++i) l.by_name_[i] = i;
  std::sort(l.by_name_.begin(), l.by_name_.end(),
            [&](std::size_t a, std::size_t b) { return l.tensors[a].name < l.tensors[b].name; });
  return l;
}

}  // namespace shardsafe
