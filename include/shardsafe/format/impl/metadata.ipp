// shardsafe/format/impl/metadata.ipp - metadata.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/metadata.hpp"

namespace shardsafe {

SHARDSAFE_DECL checkpoint_metadata parse_checkpoint_metadata(std::string_view json, std::string_view file,
                                                             const std::string* owner) {
  namespace od = simdjson::ondemand;
  const std::string f(file);
  if (json.size() > max_checkpoint_metadata_size) detail::metadata_too_large(f, json.size());
  detail::json_document doc(json, f, owner);
  od::object top = detail::json_object(doc.root("not a JSON object"), f + ": not a JSON object");
  checkpoint_metadata md;
  std::vector<std::string_view> keys;
  bool have_tensors = false, have_extras = false;
  std::uint64_t grid_parts = 0;  // of every grid so far (max_grid_parts_total)
  std::uint64_t entries = 0;     // listed shard entries so far (max_listed_metadata_entries)
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
          od::object per_file = detail::json_object(v, ctx + (old ? ": flattened_offsets_per_file is not an object"
                                                                  : ": shard_spec_per_file is not an object"));
          detail::for_fields(per_file, ctx, [&](std::string_view fk, od::value sv) {
            const std::string fname(fk);
            const std::string fctx = ctx + ": file '" + fname + "'";
            if (!is_plain_name(fname))
              fail(errc::invalid_metadata, fctx + ": not a plain file name (no '/', '\\' or '..')");
            if (++entries > max_listed_metadata_entries)
              fail(
                  errc::invalid_metadata,
                  fctx + ": more than " + std::to_string(max_listed_metadata_entries) +
                      " shard entries (files of each tensor) listed, the most a metadata.json may hold (docs/FORMAT.md "
                      "§2): a checkpoint of this many is saved in the compact form (save_options::metadata, "
                      "metadata_form::compact)");
            into.emplace_back(fname,
                              old ? detail::parse_legacy_offsets(sv, fctx) : detail::parse_spec_object(sv, fctx));
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
          fail(errc::invalid_metadata, ctx + ": shape " + to_string(tm.shape) + " " + std::string(to_string(tm.type)) +
                                           " has more than 2^64 bits of data");
        tm.is_sharded = sharded;
        if (!have_specs && !have_legacy && !grid)
          fail(errc::invalid_metadata, ctx + ": missing \"shard_spec_per_file\"");
        if (grid) {
          if (have_specs || have_legacy)
            fail(errc::invalid_metadata, ctx + ": gives both shardsafe_grid and a list of files");
          if (!sharded) fail(errc::invalid_metadata, ctx + ": shardsafe_grid describes a tensor that is not sharded");
          validate(*grid, tm.shape, ctx);
          grid_parts += grid->part_count();
          if (grid_parts > max_grid_parts_total)
            fail(errc::invalid_metadata,
                 ctx + ": the grids so far have more than " + std::to_string(max_grid_parts_total) + " parts together");
          if (!is_byte_sized(tm.type))
            fail(errc::unsupported_dtype, ctx + ": sub-byte dtype " + std::string(to_string(tm.type)) +
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
          fail(errc::unsupported_dtype, ctx + ": sub-byte dtype " + std::string(to_string(tm.type)) +
                                            " must be stored whole in one file, not as " +
                                            std::to_string(tm.files.size()) + " file(s) holding " +
                                            (tm.files.empty() ? std::string("nothing") : "shards"));
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

}  // namespace shardsafe
