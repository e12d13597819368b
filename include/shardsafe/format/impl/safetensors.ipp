// shardsafe/format/impl/safetensors.ipp - safetensors.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/safetensors.hpp"

namespace shardsafe {

namespace detail {

SHARDSAFE_DECL safetensors_header_reader::safetensors_header_reader(std::string_view file, std::uint64_t header_size) {
  h_.file = std::string(file);
  h_.header_size = header_size;
  // no entry is shorter than 40 bytes ("a":{"dtype":"U8","shape":[],"data_offsets":[0,0]}): the
  // index never grows past this (reserved, not touched: pages cost memory only once written)
  h_.tensors.reserve(static_cast<std::size_t>(std::min(header_size / 40 + 1, max_tensors_per_file)));
}

SHARDSAFE_DECL void safetensors_header_reader::not_json(const std::string& why) const {
  fail(errc::invalid_json, h_.file + ": header: not valid JSON (" + why + ")");
}

SHARDSAFE_DECL void safetensors_header_reader::feed(std::string_view text) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  std::size_t from = 0;  // start of the member's bytes in text not yet copied to member_
  std::size_t i = 0;
  const auto take = [&](std::size_t to) {
    if (member_.size() - 1 + (to - from) > max_header_member_bytes)  // member_ starts with the '{' it is parsed in
      fail(errc::invalid_header, h_.file + ": header: the member at byte " + std::to_string(member_at_) +
                                     " of the JSON (a tensor's entry or __metadata__) passes " +
                                     std::to_string(max_header_member_bytes) + " bytes, the most a reader accepts");
    member_.append(text.data() + from, to - from);
  };
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (where_ == before) {
      if (ws(c)) continue;
      if (c != '{') {
        if (std::string_view("[\"-0123456789tfn").find(c) != std::string_view::npos)
          fail(errc::invalid_header, h_.file + ": header is not a JSON object");
        not_json("the header begins with neither '{' nor a JSON value");
      }
      where_ = inside;
      from = i + 1;
      member_at_ = at_ + i + 1;
      continue;
    }
    if (where_ == after) {
      if (!ws(c)) not_json("content after the header's object, at byte " + std::to_string(at_ + i) + " of the JSON");
      continue;
    }
    if (in_string_) {
      if (escaped_)
        escaped_ = false;
      else if (c == '\\')
        escaped_ = true;
      else if (c == '"')
        in_string_ = false;
      continue;
    }
    switch (c) {
      case '"': in_string_ = true; break;
      case '{':
      case '[':
        // as deep as simdjson's DOM allows (with the top level): refused as it is read, not after
        if (++depth_ + 1 > simdjson::DEFAULT_MAX_DEPTH) not_json(simdjson::error_message(simdjson::DEPTH_ERROR));
        break;
      case '}':
      case ']':
        if (depth_ == 0) {
          if (c == ']') not_json("']' closes the header's object, at byte " + std::to_string(at_ + i) + " of the JSON");
          take(i);
          end_member(true);
          where_ = after;
        } else {
          --depth_;
        }
        break;
      case ',':
        if (depth_ == 0) {
          take(i);
          end_member(false);
          from = i + 1;
          member_at_ = at_ + i + 1;
        }
        break;
      default: break;
    }
  }
  if (where_ == inside) take(text.size());
  at_ += text.size();
}

SHARDSAFE_DECL void safetensors_header_reader::end_member(bool closing) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  const bool empty = std::all_of(member_.begin() + 1, member_.end(), ws);
  if (empty) {
    if (closing && !comma_) return;  // {} (with spaces)
    not_json("a member is missing before byte " + std::to_string(member_at_ + member_.size() - 1) + " of the JSON");
  }
  comma_ = !closing;
  member_ += '}';
  const std::string what = h_.file + ": header";
  if (!is_valid_utf8(member_)) fail(errc::invalid_json, what + ": not valid UTF-8");
  member_.reserve(member_.size() + simdjson::SIMDJSON_PADDING);
  simdjson::dom::element root;
  if (auto err = parser_.parse(member_.data(), member_.size(), /*realloc_if_needed=*/false).get(root)) {
    std::string msg = what + ": not valid JSON (" + simdjson::error_message(err) + ")";
    if (err == simdjson::NUMBER_ERROR) {
      std::string w = locate_bad_number(member_);  // "... at byte K of the JSON ...", K in "{member}"
      const std::string_view mark = " at byte ";
      if (const auto p = w.find(mark); p != std::string::npos) {
        const std::size_t q = w.find(' ', p + mark.size());
        const std::uint64_t k = std::stoull(w.substr(p + mark.size(), q - p - mark.size()));
        w.replace(p + mark.size(), q - p - mark.size(), std::to_string(k + member_at_ - 1));
      }
      if (!w.empty()) msg += ": " + w;
    }
    fail(errc::invalid_json, msg);
  }
  simdjson::dom::object obj;
  if (root.get_object().get(obj) || obj.size() != 1) not_json("a member of the header's object is not \"key\": value");
  const auto field = *obj.begin();
  add(field.key, field.value);
  if (!duplicate_) try {
      require_unique_keys(root, what);
    } catch (const error& e) {
      duplicate_ = e;
    }
  ++members_;
  member_.resize(1);
  if (member_.capacity() > (std::size_t(1) << 20)) member_.shrink_to_fit();  // after a large member
}

SHARDSAFE_DECL void safetensors_header_reader::add(std::string_view key, simdjson::dom::element value) {
  safetensors_header& h = h_;
  const std::string& f = h.file;
  if (key == "__metadata__") {
    if (metadata_seen_) fail(errc::invalid_header, f + ": name '__metadata__' appears twice in the header");
    metadata_seen_ = true;
    if (value.is_null()) return;  // no metadata, as the safetensors crate reads it (an Option)
    simdjson::dom::object md;
    if (value.get_object().get(md)) fail(errc::invalid_header, f + ": __metadata__ is not an object of strings");
    for (auto kv : md) {
      std::string_view v;
      if (kv.value.get_string().get(v))
        fail(errc::invalid_header, f + ": __metadata__ value of '" + std::string(kv.key) +
                                       "' is not a string (__metadata__ maps strings to strings)");
      if (!h.metadata.emplace(std::string(kv.key), std::string(v)).second)
        fail(errc::invalid_header, f + ": __metadata__ has the key '" + std::string(kv.key) + "' twice");
    }
    h.has_metadata = true;
    if (!keep_.metadata) h.metadata.clear();  // checked, not kept
    return;
  }
  const std::string ctx = detail::tensor_context(f, key);
  if (h.tensors.size() + dropped_.size() == max_tensors_per_file)
    fail(errc::invalid_header, ctx + ": the header lists more than " + std::to_string(max_tensors_per_file) +
                                   " tensors, the most a reader accepts in one file");
  name_bytes_ += key.size();
  if (name_bytes_ > max_tensor_name_bytes_per_file)
    fail(errc::invalid_header, ctx + ": the names of the header's tensors pass " +
                                   std::to_string(max_tensor_name_bytes_per_file) +
                                   " bytes in all, the most a reader accepts in one file");
  simdjson::dom::object t;
  if (value.get_object().get(t)) fail(errc::invalid_header, ctx + ": entry is not an object");
  {
    std::string_view fields[3];
    std::size_t n = 0;
    for (auto f : t)
      for (std::string_view known : {"dtype", "shape", "data_offsets"})
        if (f.key == known) {
          for (std::size_t i = 0; i < n; ++i)
            if (fields[i] == known) fail(errc::invalid_header, ctx + ": \"" + std::string(known) + "\" is given twice");
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
  if (keep_.tensor && !keep_.tensor(key)) {
    dropped_.push_back({e.begin, e.end, dropped_names_.size(), key.size()});
    dropped_names_ += key;
    return;
  }
  h.tensors.push_back(std::move(e));
}

SHARDSAFE_DECL safetensors_header safetensors_header_reader::finish(std::uint64_t file_size) {
  if (where_ == before) not_json("the header is empty");
  if (where_ == inside) not_json("the header ends inside its object");
  safetensors_header h = std::move(h_);
  const std::string& f = h.file;
  // The tensors, those let go (keep_) too, must have distinct names and tile the data buffer
  // exactly. The kept ones are sorted in data order once, for the index and for the tiling.
  const auto data_order = [](const auto& a, const auto& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  };
  std::sort(h.tensors.begin(), h.tensors.end(), data_order);
  struct ref {
    std::uint64_t begin, end;
    std::string_view name;
  };
  std::vector<ref> all;
  all.reserve(h.tensors.size() + dropped_.size());
  for (const auto& t : h.tensors) all.push_back({t.begin, t.end, t.name});
  if (!dropped_.empty()) {
    for (const auto& d : dropped_)
      all.push_back({d.begin, d.end, std::string_view(dropped_names_).substr(d.at, d.size)});
    std::sort(all.begin(), all.end(), data_order);
  }
  {
    // a name given twice, before what it breaks (an overlap, say)
    std::vector<std::string_view> names;
    names.reserve(all.size());
    for (const auto& r : all) names.push_back(r.name);
    std::sort(names.begin(), names.end());
    if (const auto it = std::adjacent_find(names.begin(), names.end()); it != names.end())
      fail(errc::invalid_header, f + ": name '" + std::string(*it) + "' appears twice in the header");
  }
  std::uint64_t expected = 0;
  const ref* prev = nullptr;
  for (const auto& t : all) {
    if (t.begin > expected)
      fail(errc::invalid_offsets, detail::tensor_context(f, t.name) + ": data_offsets " +
                                      to_string(byte_range{t.begin, t.end}) + " leave a hole: bytes " +
                                      to_string(byte_range{expected, t.begin}) +
                                      " of the data buffer belong to no tensor");
    if (t.begin < expected)
      fail(errc::invalid_offsets, detail::tensor_context(f, t.name) + ": data_offsets " +
                                      to_string(byte_range{t.begin, t.end}) + " overlap tensor '" +
                                      (prev ? std::string(prev->name) : std::string()) + "' " +
                                      to_string(byte_range{prev ? prev->begin : 0, expected}));
    expected = t.end;
    prev = &t;
  }
  h.data_size = expected;

  // checked: data_start <= 8 + max_header_size, data_size is bounded by a file offset
  auto total = detail::checked_add(h.data_start(), h.data_size);
  if (!total || *total > file_size)
    fail(errc::truncated,
         f + ": truncated: the data buffer needs " + std::to_string(h.data_size) + " bytes from offset " +
             std::to_string(h.data_start()) + " (tensor '" + (prev ? std::string(prev->name) : std::string()) +
             "' ends at " + std::to_string(h.data_size) + ") but the file has " + std::to_string(file_size) + " bytes");
  if (*total < file_size)
    fail(errc::truncated, f + ": " + std::to_string(file_size - *total) +
                              " trailing bytes after the last tensor (data ends at file offset " +
                              std::to_string(*total) + ", file has " + std::to_string(file_size) + ")");

  if (duplicate_) throw *duplicate_;  // after the rules above: "dtype" twice in a tensor, say
  all = {};
  dropped_ = {};
  dropped_names_ = {};
  if (keep_.tensor) h.tensors.shrink_to_fit();  // reserved for every entry the header could hold
  h.index_names(/*header=*/true);
  return h;
}

}  // namespace detail

SHARDSAFE_DECL safetensors_header parse_safetensors_header(std::string_view json, std::uint64_t file_size,
                                                           std::string_view file) {
  detail::safetensors_header_reader r(file, json.size());
  r.feed(json);
  return r.finish(file_size);
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
