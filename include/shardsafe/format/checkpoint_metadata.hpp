// shardsafe/format/checkpoint_metadata.hpp - what a sharded checkpoint's metadata.json says, in
// memory (docs/FORMAT.md §2): each tensor's shape, dtype and files (a list of shard specs, or
// the compact grid), the checksums of the tensor data, and shardsafe's own additions.
// format/metadata.hpp reads it from the JSON, format/metadata_writer.hpp writes it.
#pragma once

#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checksum.hpp"
#include "shardsafe/shard/shard_grid.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

/// The name rank R's file has in a sharded checkpoint folder (and in a grid's parts).
inline std::string rank_file_name(std::uint64_t rank) { return "rank_" + std::to_string(rank) + ".safetensors"; }

/// The rank R whose file this is (rank_file_name(R) == name, named back exactly), or nothing.
inline std::optional<std::uint64_t> rank_of_file_name(std::string_view name) {
  std::uint64_t r = 0;
  if (!name.starts_with("rank_") || std::from_chars(name.data() + 5, name.data() + name.size(), r).ec != std::errc() ||
      rank_file_name(r) != name)
    return std::nullopt;
  return r;
}

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
  /// Every file and its shard: `files`, or the grid's parts, listed (O(files) memory; whole-checkpoint
  /// work visits them with for_each_file instead).
  std::vector<std::pair<std::string, shard_spec>> file_specs() const {
    if (!grid) return files;
    return named(expand(*grid, shape));
  }
  /// Calls f(file, spec) for every file and its shard, in file order: `files`, or the grid's
  /// parts in rank order one at a time (nothing listed: whole-checkpoint work on a grid of a
  /// million parts holds one part at a time). Stops early when f returns false (f may return void).
  template <class F>
  void for_each_file(F&& f) const {
    auto call = [&](const std::string& name, const shard_spec& s) {
      if constexpr (std::is_same_v<decltype(f(name, s)), bool>)
        return f(name, s);
      else {
        f(name, s);
        return true;
      }
    };
    if (!grid) {
      for (const auto& [name, s] : files)
        if (!call(name, s)) return;
      return;
    }
    for_each_part(*grid, shape, [&](std::uint64_t r, const shard_spec& s) { return call(rank_file_name(r), s); });
  }
  /// The files that may hold elements of `want` (all of `files`; a grid's by division, without
  /// empty parts), in file order.
  std::vector<std::pair<std::string, shard_spec>> overlapping_files(const shard_spec& want) const {
    if (!grid) return files;
    return named(overlapping(*grid, shape, want));
  }

 private:
  static std::vector<std::pair<std::string, shard_spec>> named(
      std::vector<std::pair<std::uint64_t, shard_spec>> parts) {
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
    const std::optional<std::uint64_t> r = rank_of_file_name(f);
    if (!r) return std::nullopt;
    ranked.emplace_back(*r, s);
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

/// Most block hashes the checksum tables of one checkpoint (metadata.json) may hold together
/// (docs/FORMAT.md §2, "Checksums"): 4 TiB of tensor data in the default 4 MiB blocks. A reader
/// holds every hash it reads and, checking them, a record per block; past this the tables are
/// refused (a sidecar before it is read, by the count its file's header makes).
inline constexpr std::uint64_t max_checksum_hashes = std::uint64_t(1) << 20;

/// Where a rank file's checksum table is kept when checkpoint_checksums::sidecars:
/// rank_R.safetensors -> rank_R.checksums.json (the table alone, as in "files").
inline std::string checksum_sidecar_name(std::string_view rank_file) {
  std::string n(rank_file);
  if (n.ends_with(".safetensors")) n.resize(n.size() - 12);
  return n + ".checksums.json";
}

/// What shardsafe adds under "shardsafe" (all optional when reading).
struct checkpoint_extras {
  std::string writer;                               ///< e.g. "shardsafe 0.1.0"
  std::optional<std::uint64_t> world_size;          ///< ranks that saved
  std::map<std::string, std::uint64_t> file_sizes;  ///< bytes of each rank file
  std::optional<checkpoint_checksums> checksums;    ///< absent in checkpoints saved without them
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

}  // namespace shardsafe
