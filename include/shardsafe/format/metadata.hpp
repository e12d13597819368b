// shardsafe/format/metadata.hpp - a sharded checkpoint's metadata.json (docs/FORMAT.md §2).
//
// The schema is OLMo-core's:
//   {"tensors": {KEY: {"shape": [...], "is_sharded": bool, "dtype": "F32",
//                      "shard_spec_per_file": {"rank_R.safetensors":
//                          {"flattened_offsets": [[s, e], ...] | null,
//                           "local_shape": [...] | null, "global_offset": [...] | null}}}}}
// plus the older "flattened_offsets_per_file": {file: [s, e] | [[s, e], ...]}, which is read
// and converted, and shardsafe's compact form of a regular sharding (shard/shard_grid.hpp), which
// stands in for shard_spec_per_file:
//   "shardsafe_grid": {"flat": bool, "chunks": [...], "parts": [...], "base": R, "strides": [...]}
// (files rank_R.safetensors; readers that do not know it refuse the tensor, as they should).
// shardsafe's own additions live under a top-level "shardsafe" object that other readers ignore. We write in Python's json.dumps layout (separators, ASCII escapes) so
// files diff cleanly with OLMo-core's.
#pragma once

#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/shard/shard_grid.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"
#include "shardsafe/storage/text.hpp"

namespace shardsafe {

/// The name rank R's file has in a sharded checkpoint folder (and in a grid's parts).
inline std::string rank_file_name(std::uint64_t rank) { return "rank_" + std::to_string(rank) + ".safetensors"; }

/// One tensor of a checkpoint: its full shape and dtype, and which file holds which part:
/// listed in `files`, or (a regular sharding in the compact form) described by `grid`, with
/// `files` empty. file_specs() and overlapping_files() serve both.
struct tensor_metadata {
  shape_t shape;
  dtype type = dtype::F32;
  bool is_sharded = false;
  std::vector<std::pair<std::string, shard_spec>> files;  ///< shard_spec_per_file, in file order
  std::optional<shard_grid> grid;                         ///< the compact form (files empty)

  std::uint64_t numel() const noexcept { return shardsafe::numel(shape); }
  /// Files holding a part of the tensor (empty ones too).
  std::uint64_t file_count() const noexcept { return grid ? grid->part_count() : files.size(); }
  /// Every file and its shard: `files`, or the grid's parts (O(files): for whole-checkpoint work).
  std::vector<std::pair<std::string, shard_spec>> file_specs() const {
    if (!grid) return files;
    return named(expand(*grid, shape));
  }
  /// The files that may hold elements of `want` (all of `files`; a grid's by division, without
  /// empty parts), in file order.
  std::vector<std::pair<std::string, shard_spec>> overlapping_files(const shard_spec& want) const {
    if (!grid) return files;
    return named(overlapping(*grid, shape, want));
  }

 private:
  static std::vector<std::pair<std::string, shard_spec>> named(std::vector<std::pair<std::uint64_t, shard_spec>> parts) {
    std::vector<std::pair<std::string, shard_spec>> out;
    out.reserve(parts.size());
    for (auto& [r, s] : parts) out.emplace_back(rank_file_name(r), std::move(s));
    return out;
  }
};

/// The grid a sharded tensor's listed files are, when they are one and every file is a rank file.
inline std::optional<shard_grid> detect_grid(const tensor_metadata& t) {
  if (t.grid || !t.is_sharded || t.files.size() < 2 || !is_byte_sized(t.type)) return t.grid;
  std::vector<std::pair<std::uint64_t, shard_spec>> ranked;
  ranked.reserve(t.files.size());
  for (const auto& [f, s] : t.files) {
    // the rank whose file name this is: its digits after "rank_", named back exactly
    std::uint64_t r = 0;
    if (f.size() < 5 || std::from_chars(f.data() + 5, f.data() + f.size(), r).ec != std::errc() || rank_file_name(r) != f)
      return std::nullopt;
    ranked.emplace_back(r, s);
  }
  return detect_grid(ranked, t.shape);
}

/// The checksums of the tensor data in a checkpoint's files (docs/FORMAT.md §2, "Checksums";
/// detail/checksum.hpp): per file, per tensor of that file, the hash of each block of
/// block_bytes bytes of the tensor's data.
struct checkpoint_checksums {
  std::string algorithm{checksum_algorithm};  ///< "xxh3-64"; others are kept but not checked
  std::uint64_t block_bytes = default_checksum_block_bytes;
  /// file -> tensor -> one hash per block, in order
  std::map<std::string, std::map<std::string, std::vector<std::uint64_t>>> files;
  /// The tables are kept beside the rank files (checksum_sidecar_name), not in `files`: the
  /// compact form's, so that metadata.json stays O(tensors) (a reader adds what it reads to files).
  bool sidecars = false;
};

/// Where a rank file's checksum table is kept when checkpoint_checksums::sidecars:
/// rank_R.safetensors -> rank_R.checksums.json (the table alone, as in "files").
inline std::string checksum_sidecar_name(std::string_view rank_file) {
  std::string n(rank_file);
  if (n.ends_with(".safetensors")) n.resize(n.size() - 12);
  return n + ".checksums.json";
}

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

namespace od = simdjson::ondemand;

// Calls f(key, value) for each field of object `o` (the document was checked whole by json_check,
// so reading fails only on a value of an unexpected type, which f reports).
template <class F>
void for_fields(od::object o, const std::string& ctx, F&& f) {
  for (auto field : o) {
    od::field fl;
    std::string_view k;
    if (std::move(field).get(fl) || fl.unescaped_key().get(k)) fail(errc::invalid_metadata, ctx + ": unreadable object");
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
  for (const auto& [have, what] : {std::pair{flat, "flat"}, {chunks, "chunks"}, {parts, "parts"}, {strides, "strides"}, {base, "base"}})
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
inline std::map<std::string, std::vector<std::uint64_t>> parse_checksum_table(od::value e, const std::string& ctx) {
  od::object o = json_object(e, ctx + ": not an object of tensors");
  std::map<std::string, std::vector<std::uint64_t>> table;
  for_fields(o, ctx, [&](std::string_view k, od::value v) {
    const std::string key(k);
    od::array arr;
    if (v.get_array().get(arr)) fail(errc::invalid_metadata, ctx + ": tensor '" + key + "': not a list of block hashes");
    std::vector<std::uint64_t> hashes;
    for (auto h : arr) {
      std::string_view s;
      std::optional<std::uint64_t> x;
      if (!h.get_string().get(s)) x = parse_hex64(s);
      if (!x)
        fail(errc::invalid_metadata, ctx + ": tensor '" + key + "': block " + std::to_string(hashes.size()) +
                                         " is not a hash of 16 hex digits");
      hashes.push_back(*x);
    }
    if (!table.emplace(key, std::move(hashes)).second) fail(errc::invalid_metadata, ctx + ": tensor '" + key + "' is listed twice");
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
        if (!c.files.emplace(fname, parse_checksum_table(tv, ctx + ": file '" + fname + "'")).second)
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

/// Parses and validates metadata.json text. `file` names it in messages. Every shard spec is
/// validated against its tensor's shape, and file names must be plain names. The text is read
/// On-Demand (no DOM), twice: checked whole, then read; memory stays near the text's size plus
/// what is returned. `owner`: the string holding `json` when it has 64 spare bytes of capacity
/// (read in place; else the text is copied once).
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL checkpoint_metadata parse_checkpoint_metadata(std::string_view json, std::string_view file,
                                                             const std::string* owner = nullptr) {
  namespace od = simdjson::ondemand;
  const std::string f(file);
  if (json.size() > max_metadata_size)
    fail(errc::invalid_metadata, f + ": " + std::to_string(json.size()) + " bytes passes the limit of " +
                                     std::to_string(max_metadata_size));
  detail::json_document doc(json, f, owner);
  od::object top = detail::json_object(doc.root("not a JSON object"), f + ": not a JSON object");
  checkpoint_metadata md;
  std::vector<std::string_view> keys;
  bool have_tensors = false, have_extras = false;
  std::uint64_t grid_parts = 0;  // of every grid so far (max_grid_parts_total)
  detail::for_fields(top, f, [&](std::string_view topkey, od::value topval) {
    if (topkey == "tensors" && !have_tensors) {
      have_tensors = true;
      od::object tensors = detail::json_object(topval, f + ": \"tensors\" is not an object");
      detail::for_fields(tensors, f, [&](std::string_view k, od::value tv) {
        const std::string key(k);
        keys.push_back(k);
        const std::string ctx = f + ": tensor '" + detail::shown_name(key) + "'";  // built into each file's context
        od::object t = detail::json_object(tv, ctx + ": entry is not an object");
        tensor_metadata tm;
        std::optional<shape_t> shape;
        std::optional<dtype> type;
        bool sharded = false, have_sharded = false, have_specs = false, have_legacy = false;
        std::optional<shard_grid> grid;
        std::vector<std::pair<std::string, shard_spec>> specs, legacy;
        auto read_files = [&](od::value v, bool old, std::vector<std::pair<std::string, shard_spec>>& into) {
          od::object per_file = detail::json_object(
              v, ctx + (old ? ": flattened_offsets_per_file is not an object" : ": shard_spec_per_file is not an object"));
          detail::for_fields(per_file, ctx, [&](std::string_view fk, od::value sv) {
            const std::string fname(fk);
            const std::string fctx = ctx + ": file '" + fname + "'";
            if (!is_plain_name(fname)) fail(errc::invalid_metadata, fctx + ": not a plain file name (no '/', '\\' or '..')");
            into.emplace_back(fname, old ? detail::parse_legacy_offsets(sv, fctx) : detail::parse_spec_object(sv, fctx));
          });
        };
        detail::for_fields(t, ctx, [&](std::string_view fk, od::value v) {
          if (fk == "shape" && !shape) {
            shape = detail::parse_count_array(v, ctx, "shape", errc::invalid_metadata);
          } else if (fk == "dtype" && !type) {
            std::string_view dt;
            if (v.get_string().get(dt)) fail(errc::invalid_metadata, ctx + ": dtype is not a string");
            type = dtype_from_name(dt, ctx);
          } else if (fk == "is_sharded" && !have_sharded) {
            if (v.get_bool().get(sharded)) fail(errc::invalid_metadata, ctx + ": is_sharded is not a boolean");
            have_sharded = true;
          } else if (fk == "shard_spec_per_file" && !have_specs) {
            have_specs = true;
            read_files(v, false, specs);
          } else if (fk == "flattened_offsets_per_file" && !have_legacy) {
            have_legacy = true;
            read_files(v, true, legacy);
          } else if (fk == "shardsafe_grid" && !grid) {
            grid = detail::parse_grid(v, ctx);
          }
        });
        if (!shape) fail(errc::invalid_metadata, ctx + ": missing \"shape\"");
        tm.shape = std::move(*shape);
        if (!detail::checked_numel(tm.shape))
          fail(errc::invalid_metadata, ctx + ": shape " + to_string(tm.shape) + " has more than 2^64 elements");
        if (!type) fail(errc::invalid_metadata, ctx + ": missing \"dtype\"");
        tm.type = *type;
        // its bytes must be countable too: every reader sizes and prints them
        if (!detail::checked_mul(*detail::checked_numel(tm.shape), std::uint64_t(bit_size(tm.type))))
          fail(errc::invalid_metadata, ctx + ": shape " + to_string(tm.shape) + " " + std::string(name(tm.type)) +
                                           " has more than 2^64 bits of data");
        tm.is_sharded = sharded;
        if (!have_specs && !have_legacy && !grid) fail(errc::invalid_metadata, ctx + ": missing \"shard_spec_per_file\"");
        if (grid) {
          if (have_specs || have_legacy)
            fail(errc::invalid_metadata, ctx + ": gives both shardsafe_grid and a list of files");
          if (!sharded) fail(errc::invalid_metadata, ctx + ": shardsafe_grid describes a tensor that is not sharded");
          validate(*grid, tm.shape, ctx);
          grid_parts += grid->part_count();
          if (grid_parts > max_grid_parts_total)
            fail(errc::invalid_metadata, ctx + ": the grids so far have more than " + std::to_string(max_grid_parts_total) +
                                             " parts together");
          if (!is_byte_sized(tm.type))
            fail(errc::unsupported_dtype, ctx + ": sub-byte dtype " + std::string(name(tm.type)) +
                                              " must be stored whole in one file, not as a grid of shards");
          tm.grid = std::move(grid);
          md.tensors.emplace_back(key, std::move(tm));
          return;
        }
        tm.files = std::move(have_specs ? specs : legacy);
        std::vector<std::string_view> names;
        names.reserve(tm.files.size());
        for (const auto& [fname, s] : tm.files) {
          s.validate(tm.shape, ctx + ": file '" + fname + "'");
          names.push_back(fname);
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
      });
    } else if (topkey == "shardsafe" && !have_extras) {
      have_extras = true;
      od::object o;
      if (topval.get_object().get(o)) return;  // unknown shapes of this key are ignored, as other readers would
      bool writer = false, world = false, sizes = false, sums = false;
      detail::for_fields(o, f, [&](std::string_view k, od::value v) {
        if (k == "writer" && !writer) {
          writer = true;
          std::string_view w;
          if (!v.get_string().get(w)) md.extras.writer = std::string(w);
        } else if (k == "world_size" && !world) {
          world = true;
          if (auto n = detail::as_count(v)) md.extras.world_size = *n;
        } else if (k == "file_sizes" && !sizes) {
          sizes = true;
          od::object so;
          if (!v.get_object().get(so))
            detail::for_fields(so, f, [&](std::string_view fk, od::value n) {
              if (!is_plain_name(fk))
                fail(errc::invalid_metadata, f + ": shardsafe.file_sizes names '" + std::string(fk) +
                                                 "', not a plain file name (no '/', '\\' or '..')");
              if (auto c = detail::as_count(n)) md.extras.file_sizes[std::string(fk)] = *c;
            });
        } else if (k == "checksums" && !sums) {
          sums = true;
          md.extras.checksums = detail::parse_checksums(v, f);
        }
      });
    }
  });
  if (!have_tensors) fail(errc::invalid_metadata, f + ": missing \"tensors\"");
  std::sort(keys.begin(), keys.end());
  if (auto d = std::adjacent_find(keys.begin(), keys.end()); d != keys.end())
    fail(errc::invalid_metadata, f + ": tensor '" + std::string(*d) + "' is listed twice");
  doc.require_unique_keys();  // after the rules above (a tensor or a file listed twice)
  return md;
}
#else
SHARDSAFE_DECL checkpoint_metadata parse_checkpoint_metadata(std::string_view json, std::string_view file,
                                                             const std::string* owner = nullptr);
#endif

/// The same, reading `json` in place (read_text leaves the spare capacity simdjson needs).
template <class S>
  requires std::same_as<S, std::string>
checkpoint_metadata parse_checkpoint_metadata(const S& json, std::string_view file) {
  return parse_checkpoint_metadata(std::string_view(json), file, &json);
}

/// Renders metadata.json in Python's json.dumps layout.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL std::string write_checkpoint_metadata(const checkpoint_metadata& md) {
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
    if (t.grid) {
      const shard_grid& g = *t.grid;
      out += "\", \"shardsafe_grid\": {\"flat\": ";
      out += g.flat ? "true" : "false";
      out += ", \"chunks\": ";
      detail::append_counts(out, g.chunks);
      out += ", \"parts\": ";
      detail::append_counts(out, g.parts);
      out += ", \"base\": " + std::to_string(g.base) + ", \"strides\": ";
      detail::append_counts(out, g.strides);
      out += "}}";
      continue;
    }
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
      out += ", \"block_bytes\": " + std::to_string(x.checksums->block_bytes);
      if (x.checksums->sidecars) out += ", \"sidecars\": true";
      out += ", \"files\": {";
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
#else
SHARDSAFE_DECL std::string write_checkpoint_metadata(const checkpoint_metadata& md);
#endif

/// Reads and validates metadata.json from a storage.
template <ReadableStorage S>
checkpoint_metadata read_checkpoint_metadata(const S& s) {
  return parse_checkpoint_metadata(read_text(s, max_metadata_size, text_kind::json), s.name());
}

}  // namespace shardsafe
