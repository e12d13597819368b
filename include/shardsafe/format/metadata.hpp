// shardsafe/format/metadata.hpp - a sharded checkpoint's metadata.json (docs/FORMAT.md §2).
//
// The schema is OLMo-core's:
//   {"tensors": {KEY: {"shape": [...], "is_sharded": bool, "dtype": "F32",
//                      "shard_spec_per_file": {"rank_R.safetensors":
//                          {"flattened_offsets": [[s, e], ...] | null,
//                           "local_shape": [...] | null, "global_offset": [...] | null}}}}}
// plus the older "flattened_offsets_per_file": {file: [s, e] | [[s, e], ...]}, which is read
// and converted. shardsafe's own additions live under a top-level "shardsafe" object that
// other readers ignore. We write in Python's json.dumps layout (separators, ASCII escapes) so
// files diff cleanly with OLMo-core's.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// One tensor of a checkpoint: its full shape and dtype, and which file holds which part.
struct tensor_metadata {
  shape_t shape;
  dtype type = dtype::F32;
  bool is_sharded = false;
  std::vector<std::pair<std::string, shard_spec>> files;  ///< shard_spec_per_file, in file order

  std::uint64_t numel() const noexcept { return shardsafe::numel(shape); }
};

/// The checksums of the tensor data in a checkpoint's files (docs/FORMAT.md §2, "Checksums";
/// detail/checksum.hpp): per file, per tensor of that file, the hash of each block of
/// block_bytes bytes of the tensor's data.
struct checkpoint_checksums {
  std::string algorithm{checksum_algorithm};  ///< "xxh3-64"; others are kept but not checked
  std::uint64_t block_bytes = default_checksum_block_bytes;
  /// file -> tensor -> one hash per block, in order
  std::map<std::string, std::map<std::string, std::vector<std::uint64_t>>> files;
};

/// What shardsafe adds under "shardsafe" (all optional when reading).
struct checkpoint_extras {
  std::string writer;                                  ///< e.g. "shardsafe 0.1.0"
  std::optional<std::uint64_t> world_size;             ///< ranks that saved
  std::map<std::string, std::uint64_t> file_sizes;     ///< bytes of each rank file
  std::optional<checkpoint_checksums> checksums;       ///< absent in checkpoints saved without them
};

struct checkpoint_metadata {
  std::vector<std::pair<std::string, tensor_metadata>> tensors;  ///< in file order
  checkpoint_extras extras;

  const tensor_metadata* find(std::string_view key) const noexcept {
    for (const auto& [k, t] : tensors)
      if (k == key) return &t;
    return nullptr;
  }
};

namespace detail {

inline shard_spec parse_spec_object(simdjson::dom::element e, const std::string& ctx) {
  simdjson::dom::object o;
  if (e.get_object().get(o)) fail(errc::invalid_metadata, ctx + ": shard spec is not an object");
  auto field = [&](std::string_view k) -> std::optional<simdjson::dom::element> {
    simdjson::dom::element v;
    if (o[k].get(v) || v.is_null()) return std::nullopt;
    return v;
  };
  auto fo = field("flattened_offsets");
  auto ls = field("local_shape");
  auto go = field("global_offset");
  if (fo) {
    if (ls || go)
      fail(errc::invalid_metadata, ctx + ": shard spec gives both flattened_offsets and local_shape/global_offset");
    simdjson::dom::array arr;
    if (fo->get_array().get(arr)) fail(errc::invalid_metadata, ctx + ": flattened_offsets is not a list");
    std::vector<element_range> ranges;
    ranges.reserve(arr.size());
    std::size_t i = 0;
    for (auto r : arr) {
      auto pair = parse_count_array(r, ctx, "flattened_offsets[" + std::to_string(i) + "]", errc::invalid_metadata);
      if (pair.size() != 2)
        fail(errc::invalid_metadata, ctx + ": flattened_offsets[" + std::to_string(i) + "] is not a [start, end] pair");
      ranges.push_back({pair[0], pair[1]});
      ++i;
    }
    return flat_spec(std::move(ranges));
  }
  if (ls && go)
    return block_spec(parse_count_array(*ls, ctx, "local_shape", errc::invalid_metadata),
                      parse_count_array(*go, ctx, "global_offset", errc::invalid_metadata));
  fail(errc::invalid_metadata, ctx + ": shard spec has neither flattened_offsets nor local_shape and global_offset");
}

// legacy: [s, e] or [[s, e], ...]
inline shard_spec parse_legacy_offsets(simdjson::dom::element e, const std::string& ctx) {
  simdjson::dom::array arr;
  if (e.get_array().get(arr)) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file entry is not a list");
  std::vector<element_range> ranges;
  bool pairs = arr.size() > 0 && (*arr.begin()).is_array();
  if (!pairs) {
    auto p = parse_count_array(e, ctx, "flattened_offsets_per_file entry", errc::invalid_metadata);
    if (p.size() != 2) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file entry is not [start, end]");
    ranges.push_back({p[0], p[1]});
  } else {
    for (auto r : arr) {
      auto p = parse_count_array(r, ctx, "flattened_offsets_per_file range", errc::invalid_metadata);
      if (p.size() != 2) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file range is not [start, end]");
      ranges.push_back({p[0], p[1]});
    }
  }
  return flat_spec(std::move(ranges));
}

inline void append_counts(std::string& out, std::span<const std::uint64_t> v) {
  out += '[';
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(v[i]);
  }
  out += ']';
}

/// Renders one file's checksum table: {"TENSOR": ["HEX16", ...], ...} (tensors by name).
inline void append_checksum_table(std::string& out, const std::map<std::string, std::vector<std::uint64_t>>& table) {
  out += '{';
  bool first = true;
  for (const auto& [key, hashes] : table) {
    if (!first) out += ", ";
    first = false;
    append_json_string(out, key, /*ascii_only=*/true);
    out += ": [";
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      if (i) out += ", ";
      out += '"' + hex64(hashes[i]) + '"';
    }
    out += ']';
  }
  out += '}';
}

/// Reads what append_checksum_table wrote; ctx names it in messages.
inline std::map<std::string, std::vector<std::uint64_t>> parse_checksum_table(simdjson::dom::element e,
                                                                            const std::string& ctx) {
  simdjson::dom::object o;
  if (e.get_object().get(o)) fail(errc::invalid_metadata, ctx + ": not an object of tensors");
  std::map<std::string, std::vector<std::uint64_t>> table;
  for (auto kv : o) {
    const std::string key(kv.key);
    simdjson::dom::array arr;
    if (kv.value.get_array().get(arr))
      fail(errc::invalid_metadata, ctx + ": tensor '" + key + "': not a list of block hashes");
    std::vector<std::uint64_t> hashes;
    hashes.reserve(arr.size());
    for (auto h : arr) {
      std::string_view t;
      std::optional<std::uint64_t> v;
      if (!h.get_string().get(t)) v = parse_hex64(t);
      if (!v)
        fail(errc::invalid_metadata, ctx + ": tensor '" + key + "': block " + std::to_string(hashes.size()) +
                                         " is not a hash of 16 hex digits");
      hashes.push_back(*v);
    }
    if (!table.emplace(key, std::move(hashes)).second)
      fail(errc::invalid_metadata, ctx + ": tensor '" + key + "' is listed twice");
  }
  return table;
}

/// Reads "shardsafe": {"checksums": ...}; malformed checksums are an error (not ignored: a
/// damaged table must not pass for a checkpoint without one).
inline checkpoint_checksums parse_checksums(simdjson::dom::element e, const std::string& f) {
  const std::string ctx = f + ": shardsafe.checksums";
  simdjson::dom::object o;
  if (e.get_object().get(o)) fail(errc::invalid_metadata, ctx + " is not an object");
  checkpoint_checksums c;
  std::string_view alg;
  if (o["algorithm"].get_string().get(alg)) fail(errc::invalid_metadata, ctx + ": \"algorithm\" is not a string");
  c.algorithm = std::string(alg);
  simdjson::dom::element b;
  std::optional<std::uint64_t> bb;
  if (!o["block_bytes"].get(b)) bb = as_count(b);
  if (!bb || *bb == 0) fail(errc::invalid_metadata, ctx + ": \"block_bytes\" is not a positive count");
  c.block_bytes = *bb;
  simdjson::dom::object files;
  if (o["files"].get_object().get(files)) fail(errc::invalid_metadata, ctx + ": \"files\" is not an object");
  for (auto kv : files) {
    const std::string fname(kv.key);
    if (!is_plain_name(fname))
      fail(errc::invalid_metadata, ctx + ": names '" + fname + "', not a plain file name (no '/', '\\' or '..')");
    if (!c.files.emplace(fname, parse_checksum_table(kv.value, ctx + ": file '" + fname + "'")).second)
      fail(errc::invalid_metadata, ctx + ": file '" + fname + "' is listed twice");
  }
  return c;
}

}  // namespace detail

/// Parses and validates metadata.json text. `file` names it in messages. Every shard spec is
/// validated against its tensor's shape, and file names must be plain names.
inline checkpoint_metadata parse_checkpoint_metadata(std::string_view json, std::string_view file) {
  const std::string f(file);
  if (json.size() > max_metadata_size)
    fail(errc::invalid_metadata, f + ": " + std::to_string(json.size()) + " bytes passes the limit of " +
                                     std::to_string(max_metadata_size));
  simdjson::dom::parser parser;
  auto root = detail::parse_json(parser, json, f);
  simdjson::dom::object top;
  if (root.get_object().get(top)) fail(errc::invalid_metadata, f + ": not a JSON object");
  simdjson::dom::object tensors;
  {
    simdjson::dom::element t;
    if (top["tensors"].get(t)) fail(errc::invalid_metadata, f + ": missing \"tensors\"");
    if (t.get_object().get(tensors)) fail(errc::invalid_metadata, f + ": \"tensors\" is not an object");
  }
  checkpoint_metadata md;
  std::vector<std::string_view> keys;
  for (auto field : tensors) {
    const std::string key(field.key);
    keys.push_back(field.key);
    const std::string ctx = f + ": tensor '" + key + "'";
    simdjson::dom::object t;
    if (field.value.get_object().get(t)) fail(errc::invalid_metadata, ctx + ": entry is not an object");
    tensor_metadata tm;
    simdjson::dom::element v;
    if (t["shape"].get(v)) fail(errc::invalid_metadata, ctx + ": missing \"shape\"");
    tm.shape = detail::parse_count_array(v, ctx, "shape", errc::invalid_metadata);
    if (!detail::checked_numel(tm.shape))
      fail(errc::invalid_metadata, ctx + ": shape " + to_string(tm.shape) + " has more than 2^64 elements");
    if (t["dtype"].get(v)) fail(errc::invalid_metadata, ctx + ": missing \"dtype\"");
    std::string_view dt;
    if (v.get_string().get(dt)) fail(errc::invalid_metadata, ctx + ": dtype is not a string");
    tm.type = dtype_from_name(dt, ctx);
    // its bytes must be countable too: every reader sizes and prints them
    if (!detail::checked_mul(*detail::checked_numel(tm.shape), std::uint64_t(bit_size(tm.type))))
      fail(errc::invalid_metadata, ctx + ": shape " + to_string(tm.shape) + " " + std::string(name(tm.type)) +
                                       " has more than 2^64 bits of data");
    if (!t["is_sharded"].get(v)) {
      bool b;
      if (v.get_bool().get(b)) fail(errc::invalid_metadata, ctx + ": is_sharded is not a boolean");
      tm.is_sharded = b;
    }
    simdjson::dom::object per_file;
    bool legacy = false;
    if (!t["shard_spec_per_file"].get(v)) {
      if (v.get_object().get(per_file)) fail(errc::invalid_metadata, ctx + ": shard_spec_per_file is not an object");
    } else if (!t["flattened_offsets_per_file"].get(v)) {
      if (v.get_object().get(per_file))
        fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file is not an object");
      legacy = true;
    } else {
      fail(errc::invalid_metadata, ctx + ": missing \"shard_spec_per_file\"");
    }
    std::vector<std::string_view> names;
    for (auto pf : per_file) {
      const std::string fname(pf.key);
      const std::string fctx = ctx + ": file '" + fname + "'";
      if (!is_plain_name(fname))
        fail(errc::invalid_metadata, fctx + ": not a plain file name (no '/', '\\' or '..')");
      shard_spec s = legacy ? detail::parse_legacy_offsets(pf.value, fctx) : detail::parse_spec_object(pf.value, fctx);
      s.validate(tm.shape, fctx);
      tm.files.emplace_back(fname, std::move(s));
      names.push_back(pf.key);
    }
    std::sort(names.begin(), names.end());
    if (auto d = std::adjacent_find(names.begin(), names.end()); d != names.end())
      fail(errc::invalid_metadata, ctx + ": file '" + std::string(*d) + "' is listed twice");
    // one rule for every reader: a sub-byte dtype (F4, F6) has no element ranges, so it is stored
    // whole, in one file
    if (!is_byte_sized(tm.type) && (tm.files.size() != 1 || tm.files.front().second.local_numel() != tm.numel()))
      fail(errc::unsupported_dtype, ctx + ": sub-byte dtype " + std::string(name(tm.type)) +
                                        " must be stored whole in one file, not as " + std::to_string(tm.files.size()) +
                                        " file(s) holding " + (tm.files.empty() ? std::string("nothing") : "shards"));
    md.tensors.emplace_back(key, std::move(tm));
  }
  std::sort(keys.begin(), keys.end());
  if (auto d = std::adjacent_find(keys.begin(), keys.end()); d != keys.end())
    fail(errc::invalid_metadata, f + ": tensor '" + std::string(*d) + "' is listed twice");

  simdjson::dom::element ex;
  if (!top["shardsafe"].get(ex)) {
    simdjson::dom::object o;
    if (!ex.get_object().get(o)) {  // unknown shapes of this key are ignored, as other readers would
      std::string_view w;
      if (!o["writer"].get_string().get(w)) md.extras.writer = std::string(w);
      simdjson::dom::element ws;
      if (!o["world_size"].get(ws))
        if (auto n = detail::as_count(ws)) md.extras.world_size = *n;
      simdjson::dom::object sizes;
      if (!o["file_sizes"].get_object().get(sizes))
        for (auto kv : sizes) {
          if (!is_plain_name(kv.key))
            fail(errc::invalid_metadata, f + ": shardsafe.file_sizes names '" + std::string(kv.key) +
                                             "', not a plain file name (no '/', '\\' or '..')");
          if (auto n = detail::as_count(kv.value)) md.extras.file_sizes[std::string(kv.key)] = *n;
        }
      simdjson::dom::element cs;
      if (!o["checksums"].get(cs)) md.extras.checksums = detail::parse_checksums(cs, f);
    }
  }
  detail::require_unique_keys(root, f);  // after the rules above (a tensor or a file listed twice)
  return md;
}

/// Renders metadata.json in Python's json.dumps layout.
inline std::string write_checkpoint_metadata(const checkpoint_metadata& md) {
  std::string out = "{\"tensors\": {";
  bool first = true;
  for (const auto& [key, t] : md.tensors) {
    if (!first) out += ", ";
    first = false;
    detail::append_json_string(out, key, /*ascii_only=*/true);
    out += ": {\"shape\": ";
    detail::append_counts(out, t.shape);
    out += ", \"is_sharded\": ";
    out += t.is_sharded ? "true" : "false";
    out += ", \"dtype\": \"";
    out += name(t.type);
    out += "\", \"shard_spec_per_file\": {";
    bool ff = true;
    for (const auto& [fname, spec] : t.files) {
      if (!ff) out += ", ";
      ff = false;
      detail::append_json_string(out, fname, /*ascii_only=*/true);
      out += ": {\"flattened_offsets\": ";
      if (spec.is_flat()) {
        out += '[';
        const auto& rs = spec.flat().ranges();
        for (std::size_t i = 0; i < rs.size(); ++i) {
          if (i) out += ", ";
          out += '[' + std::to_string(rs[i].begin) + ", " + std::to_string(rs[i].end) + ']';
        }
        out += "], \"local_shape\": null, \"global_offset\": null}";
      } else {
        out += "null, \"local_shape\": ";
        detail::append_counts(out, spec.block().local_shape());
        out += ", \"global_offset\": ";
        detail::append_counts(out, spec.block().global_offset());
        out += '}';
      }
    }
    out += "}}";
  }
  out += '}';
  const auto& x = md.extras;
  if (!x.writer.empty() || x.world_size || !x.file_sizes.empty() || x.checksums) {
    out += ", \"shardsafe\": {";
    bool xf = true;
    auto sep = [&] {
      if (!xf) out += ", ";
      xf = false;
    };
    if (!x.writer.empty()) {
      sep();
      out += "\"writer\": ";
      detail::append_json_string(out, x.writer, /*ascii_only=*/true);
    }
    if (x.world_size) {
      sep();
      out += "\"world_size\": " + std::to_string(*x.world_size);
    }
    if (!x.file_sizes.empty()) {
      sep();
      out += "\"file_sizes\": {";
      bool sf = true;
      for (const auto& [fname, size] : x.file_sizes) {
        if (!sf) out += ", ";
        sf = false;
        detail::append_json_string(out, fname, /*ascii_only=*/true);
        out += ": " + std::to_string(size);
      }
      out += '}';
    }
    if (x.checksums) {
      sep();
      out += "\"checksums\": {\"algorithm\": ";
      detail::append_json_string(out, x.checksums->algorithm, /*ascii_only=*/true);
      out += ", \"block_bytes\": " + std::to_string(x.checksums->block_bytes) + ", \"files\": {";
      bool cf = true;
      for (const auto& [fname, table] : x.checksums->files) {
        if (!cf) out += ", ";
        cf = false;
        detail::append_json_string(out, fname, /*ascii_only=*/true);
        out += ": ";
        detail::append_checksum_table(out, table);
      }
      out += "}}";
    }
    out += '}';
  }
  out += '}';
  return out;
}

/// Reads and validates metadata.json from a storage.
template <ReadableStorage S>
checkpoint_metadata read_checkpoint_metadata(const S& s) {
  return parse_checkpoint_metadata(read_text(s, max_metadata_size, text_kind::json), s.name());
}

}  // namespace shardsafe
