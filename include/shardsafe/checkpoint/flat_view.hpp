// shardsafe/checkpoint/flat_view.hpp - one tensor of the caller's state, as raw memory.
//
// A flat view is what the checkpointer reads from when saving and writes into when loading:
// the tensor's key, dtype and full shape, the shard this rank holds (none: the whole tensor,
// not sharded) and the memory of the local elements in row-major order (for a flat spec, the
// ranges one after another; for a block, the block row-major). The torch layer makes these
// from at::Tensor; anything else that owns memory can too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

struct flat_view {
  std::string key;
  dtype type = dtype::F32;
  shape_t full_shape;
  std::optional<shard_spec> spec;  ///< nullopt: this rank holds the whole tensor (not sharded)
  std::byte* data = nullptr;       ///< local elements
  std::uint64_t nbytes = 0;        ///< bytes at data

  bool is_sharded() const noexcept { return spec.has_value(); }
  std::uint64_t local_numel() const noexcept { return spec ? spec->local_numel() : numel(full_shape); }
  std::span<std::byte> bytes() const noexcept { return {data, static_cast<std::size_t>(nbytes)}; }

  /// The spec loading and saving use: the given one, or the whole tensor as one flat range.
  shard_spec effective_spec() const {
    if (spec) return *spec;
    return flat_spec{{0, numel(full_shape)}};
  }

  /// Checks the spec against the full shape and the memory against the spec.
  void validate(std::string_view ctx) const {
    const std::string c = std::string(ctx) + ": tensor '" + key + "'";
    require_byte_sized(type, c);
    if (!detail::checked_numel(full_shape))
      fail(errc::invalid_shape, c + ": shape " + to_string(full_shape) + " has more than 2^64 elements");
    if (spec) spec->validate(full_shape, c);
    const std::uint64_t need = local_numel() * item_size(type);
    if (nbytes != need)
      fail(errc::invalid_argument, c + ": local memory is " + std::to_string(nbytes) + " bytes but the shard holds " +
                                       std::to_string(local_numel()) + " " + std::string(name(type)) +
                                       " elements (" + std::to_string(need) + " bytes)");
    if (need > 0 && data == nullptr) fail(errc::invalid_argument, c + ": no memory given");
  }
};

}  // namespace shardsafe
