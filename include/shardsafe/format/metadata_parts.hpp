// shardsafe/format/metadata_parts.hpp - readers of the parts of a metadata.json
// (docs/FORMAT.md §2), On-Demand: a file's shard spec, the compact "shardsafe_grid", the older
// flattened_offsets_per_file entry, and the checksum tables under "shardsafe". Each throws
// errc::invalid_metadata naming the part; format/metadata.hpp reads the whole document with them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/error.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/checkpoint_metadata.hpp"
#include "shardsafe/shard/shard_grid.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

namespace detail {

namespace od = simdjson::ondemand;

// Calls f(key, value) for each field of object `o` (the document was checked whole by json_check,
// so reading fails only on a value of an unexpected type, which f reports).
template <class F>
void for_fields(od::object o, const std::string& ctx, F&& f) {
  for (auto field : o) {
    od::field fl;
    std::string_view k;
    if (std::move(field).get(fl) || field_key(fl, k)) fail(errc::invalid_metadata, ctx + ": unreadable object");
    f(k, fl.value());
  }
}
inline od::object json_object(od::value v, const std::string& what) {
  od::object o;
  if (v.get_object().get(o)) fail(errc::invalid_metadata, what);
  return o;
}
inline bool json_null(od::value& v) {
  bool n = false;
  return !v.is_null().get(n) && n;
}

inline shard_spec parse_spec_object(od::value e, const std::string& ctx) {
  od::object o = json_object(e, ctx + ": shard spec is not an object");
  std::optional<std::vector<element_range>> fo;
  std::optional<std::vector<std::uint64_t>> ls, go;
  for_fields(o, ctx, [&](std::string_view k, od::value v) {
    if (k == "flattened_offsets" && !fo && !json_null(v)) {
      od::array arr;
      if (v.get_array().get(arr)) fail(errc::invalid_metadata, ctx + ": flattened_offsets is not a list");
      fo.emplace();
      for (auto r : arr) {
        const std::string what = "flattened_offsets[" + std::to_string(fo->size()) + "]";
        od::value rv;
        if (std::move(r).get(rv)) fail(errc::invalid_metadata, ctx + ": " + what + " is not a [start, end] pair");
        auto pair = parse_count_array(rv, ctx, what, errc::invalid_metadata);
        if (pair.size() != 2) fail(errc::invalid_metadata, ctx + ": " + what + " is not a [start, end] pair");
        fo->push_back({pair[0], pair[1]});
      }
    } else if (k == "local_shape" && !ls && !json_null(v)) {
      ls = parse_count_array(v, ctx, "local_shape", errc::invalid_metadata);
    } else if (k == "global_offset" && !go && !json_null(v)) {
      go = parse_count_array(v, ctx, "global_offset", errc::invalid_metadata);
    }
  });
  if (fo) {
    if (ls || go)
      fail(errc::invalid_metadata, ctx + ": shard spec gives both flattened_offsets and local_shape/global_offset");
    return flat_spec(std::move(*fo));
  }
  if (ls && go) return block_spec(std::move(*ls), std::move(*go));
  fail(errc::invalid_metadata, ctx + ": shard spec has neither flattened_offsets nor local_shape and global_offset");
}

/// Reads "shardsafe_grid" (validated against the shape later, once the shape is known).
inline shard_grid parse_grid(od::value e, const std::string& ctx) {
  const std::string c = ctx + ": shardsafe_grid";
  od::object o = json_object(e, c + " is not an object");
  shard_grid g;
  bool flat = false, chunks = false, parts = false, strides = false, base = false;
  for_fields(o, c, [&](std::string_view k, od::value v) {
    if (k == "flat" && !flat) {
      if (v.get_bool().get(g.flat)) fail(errc::invalid_metadata, c + ": \"flat\" is not a boolean");
      flat = true;
    } else if (k == "chunks" && !chunks) {
      g.chunks = parse_count_array(v, c, "chunks", errc::invalid_metadata);
      chunks = true;
    } else if (k == "parts" && !parts) {
      g.parts = parse_count_array(v, c, "parts", errc::invalid_metadata);
      parts = true;
    } else if (k == "strides" && !strides) {
      g.strides = parse_count_array(v, c, "strides", errc::invalid_metadata);
      strides = true;
    } else if (k == "base" && !base) {
      const auto b = as_count(v);
      if (!b) fail(errc::invalid_metadata, c + ": \"base\" is not a non-negative integer");
      g.base = *b;
      base = true;
    }
  });
  for (const auto& [have, what] :
       {std::pair{flat, "flat"}, {chunks, "chunks"}, {parts, "parts"}, {strides, "strides"}, {base, "base"}})
    if (!have) fail(errc::invalid_metadata, c + ": missing \"" + std::string(what) + "\"");
  return g;
}

// legacy: [s, e] or [[s, e], ...]
inline shard_spec parse_legacy_offsets(od::value e, const std::string& ctx) {
  od::array arr;
  if (e.get_array().get(arr)) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file entry is not a list");
  std::vector<element_range> ranges;
  std::vector<std::uint64_t> flat;
  bool pairs = false;
  std::size_t i = 0;
  for (auto item : arr) {
    od::value v;
    if (std::move(item).get(v)) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file entry is not a list");
    od::json_type type{};
    if (i == 0 && !v.type().get(type)) pairs = type == od::json_type::array;
    if (pairs) {
      auto p = parse_count_array(v, ctx, "flattened_offsets_per_file range", errc::invalid_metadata);
      if (p.size() != 2) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file range is not [start, end]");
      ranges.push_back({p[0], p[1]});
    } else {
      std::string why = "not a non-negative integer";
      const auto c = as_count(v, &why);
      if (!c)
        fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file entry[" + std::to_string(i) + "] is " + why +
                                         ", not a non-negative integer");
      flat.push_back(*c);
    }
    ++i;
  }
  if (!pairs) {
    if (flat.size() != 2) fail(errc::invalid_metadata, ctx + ": flattened_offsets_per_file entry is not [start, end]");
    ranges.push_back({flat[0], flat[1]});
  }
  return flat_spec(std::move(ranges));
}

/// Reads what append_checksum_table wrote; ctx names it in messages.
/// `counted`: hashes read so far, with those of the checkpoint's other tables (max_checksum_hashes;
/// nullptr: this table's alone).
inline std::map<std::string, std::vector<std::uint64_t>> parse_checksum_table(od::value e, const std::string& ctx,
                                                                              std::uint64_t* counted = nullptr) {
  std::uint64_t own = 0;
  std::uint64_t& count = counted ? *counted : own;
  od::object o = json_object(e, ctx + ": not an object of tensors");
  std::map<std::string, std::vector<std::uint64_t>> table;
  for_fields(o, ctx, [&](std::string_view k, od::value v) {
    const std::string key(k);
    od::array arr;
    if (v.get_array().get(arr))
      fail(errc::invalid_metadata, ctx + ": tensor '" + key + "': not a list of block hashes");
    std::vector<std::uint64_t> hashes;
    for (auto h : arr) {
      std::string_view s;
      std::optional<std::uint64_t> x;
      od::value hv;
      if (!std::move(h).get(hv) && !string_value(hv, s)) x = parse_hex64(s);
      if (!x)
        fail(errc::invalid_metadata, ctx + ": tensor '" + key + "': block " + std::to_string(hashes.size()) +
                                         " is not a hash of 16 hex digits");
      if (++count > max_checksum_hashes)
        fail(errc::invalid_metadata, ctx + ": the checksum tables hold more than " +
                                         std::to_string(max_checksum_hashes) +
                                         " hashes, the most a checkpoint's tables may hold (docs/FORMAT.md §2): save "
                                         "with larger checksum blocks (save_options::checksum_block_bytes)");
      hashes.push_back(*x);
    }
    if (!table.emplace(key, std::move(hashes)).second)
      fail(errc::invalid_metadata, ctx + ": tensor '" + key + "' is listed twice");
  });
  return table;
}

/// Reads "shardsafe": {"checksums": ...}; malformed checksums are an error (not ignored: a
/// damaged table must not pass for a checkpoint without one).
inline checkpoint_checksums parse_checksums(od::value e, const std::string& f) {
  const std::string ctx = f + ": shardsafe.checksums";
  od::object o = json_object(e, ctx + " is not an object");
  checkpoint_checksums c;
  bool alg = false, files = false;
  std::optional<std::uint64_t> bb;
  std::uint64_t hashes = 0;  // of every table (max_checksum_hashes)
  for_fields(o, ctx, [&](std::string_view k, od::value v) {
    if (k == "algorithm" && !alg) {
      std::string_view s;
      if (v.get_string().get(s)) fail(errc::invalid_metadata, ctx + ": \"algorithm\" is not a string");
      c.algorithm = std::string(s);
      alg = true;
    } else if (k == "block_bytes" && !bb) {
      bb = as_count(v);
      if (!bb || *bb == 0) fail(errc::invalid_metadata, ctx + ": \"block_bytes\" is not a positive count");
      c.block_bytes = *bb;
    } else if (k == "sidecars") {
      if (v.get_bool().get(c.sidecars)) fail(errc::invalid_metadata, ctx + ": \"sidecars\" is not a boolean");
    } else if (k == "files" && !files) {
      files = true;
      for_fields(json_object(v, ctx + ": \"files\" is not an object"), ctx, [&](std::string_view fk, od::value tv) {
        const std::string fname(fk);
        if (!is_plain_name(fname))
          fail(errc::invalid_metadata, ctx + ": names '" + fname + "', not a plain file name (no '/', '\\' or '..')");
        if (!c.files.emplace(fname, parse_checksum_table(tv, ctx + ": file '" + fname + "'", &hashes)).second)
          fail(errc::invalid_metadata, ctx + ": file '" + fname + "' is listed twice");
      });
    }
  });
  if (!alg) fail(errc::invalid_metadata, ctx + ": \"algorithm\" is not a string");
  if (!bb) fail(errc::invalid_metadata, ctx + ": \"block_bytes\" is not a positive count");
  if (!files) fail(errc::invalid_metadata, ctx + ": \"files\" is not an object");
  return c;
}

}  // namespace detail

}  // namespace shardsafe
