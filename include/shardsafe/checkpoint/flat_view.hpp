// shardsafe/checkpoint/flat_view.hpp - one tensor of the caller's state, as raw memory.
//
// A flat view is what the checkpointer reads from when saving and writes into when loading:
// the tensor's key, dtype and full shape, the shard this rank holds (none: the whole tensor,
// not sharded) and the memory of the local elements in row-major order (for a flat spec, the
// ranges one after another; for a block, the block row-major). The torch layer makes these
// from at::Tensor; anything else that owns memory can too.
//
// Replicas. When several ranks hold the same shard of a tensor (the same key and spec: ranks
// that differ only along replicate() dimensions of a device mesh, as in HSDP), each declares
// it in `replica`: exactly one of them is the `writer` and the others are `copy`; the save
// then writes that shard once, from the writer, and checks that every copy has a writer with
// the same spec. mesh_replica_role() gives the role from a mesh and placements (the writer
// choice of shard/mesh.hpp, which spreads writes over the replicas). Two different shards
// that overlap are an error on save; identical shards not declared replicas are each written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/shard/mesh.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

/// Whether other ranks hold the same shard as this view, and which of them writes it.
enum class replica_role : std::uint8_t {
  none,    ///< no other rank holds this shard (or the view is not sharded: written by the lowest rank)
  writer,  ///< one of identical replicas of this shard; this rank writes it
  copy,    ///< one of identical replicas; another rank writes it, this one writes nothing of it
};

constexpr std::string_view to_string(replica_role r) noexcept {
  switch (r) {
    case replica_role::none: return "none";
    case replica_role::writer: return "writer";
    case replica_role::copy: return "copy";
  }
  return "?";
}

/// This rank's role for a tensor laid out on mesh by placements: none when no mesh dimension
/// replicates it, else writer or copy by mesh_replicas(mesh, placements, salt).is_writer().
inline replica_role mesh_replica_role(const device_mesh& mesh, std::span<const placement> placements,
                                      std::uint64_t salt = 0) {
  const replica_info info = mesh_replicas(mesh, placements, salt);
  if (info.replica_count == 1) return replica_role::none;
  return info.is_writer() ? replica_role::writer : replica_role::copy;
}

struct flat_view {
  std::string key;
  dtype type = dtype::F32;
  shape_t full_shape;
  std::optional<shard_spec> spec;             ///< nullopt: this rank holds the whole tensor (not sharded)
  std::byte* data = nullptr;                  ///< local elements
  std::uint64_t nbytes = 0;                   ///< bytes at data
  replica_role replica = replica_role::none;  ///< for a sharded view held by other ranks too

  bool is_sharded() const noexcept { return spec.has_value(); }
  std::uint64_t local_numel() const noexcept { return spec ? spec->local_numel() : numel(full_shape); }
  std::span<std::byte> bytes() const noexcept { return {data, static_cast<std::size_t>(nbytes)}; }

  /// The spec loading and saving use: the given one, or the whole tensor as one flat range.
  shard_spec effective_spec() const {
    if (spec) return *spec;
    return flat_spec{{0, numel(full_shape)}};
  }

  /// Checks the spec against the full shape and the memory against the spec (with
  /// memory_later: data may be null, its bytes supplied by a copy while saving).
  void validate(std::string_view ctx, bool memory_later = false) const {
    const std::string c = std::string(ctx) + ": tensor '" + key + "'";
    require_byte_sized(type, c);
    if (!detail::checked_numel(full_shape))
      fail(errc::invalid_shape, c + ": shape " + to_string(full_shape) + " has more than 2^64 elements");
    if (spec) spec->validate(full_shape, c);
    const auto bytes = detail::checked_mul(local_numel(), std::uint64_t(item_size(type)));
    if (!bytes)
      fail(errc::invalid_shape, c + ": the shard's " + std::to_string(local_numel()) + " " +
                                    std::string(to_string(type)) + " elements have more than 2^64 bytes");
    const std::uint64_t need = *bytes;
    if (nbytes != need)
      fail(errc::invalid_argument, c + ": local memory is " + std::to_string(nbytes) + " bytes but the shard holds " +
                                       std::to_string(local_numel()) + " " + std::string(to_string(type)) +
                                       " elements (" + std::to_string(need) + " bytes)");
    if (need > 0 && data == nullptr && !memory_later) fail(errc::invalid_argument, c + ": no memory given");
  }
};

}  // namespace shardsafe
