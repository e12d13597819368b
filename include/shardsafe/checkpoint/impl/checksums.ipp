// shardsafe/checkpoint/impl/checksums.ipp - checksums.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/checkpoint/checksums.hpp"

namespace shardsafe::detail {

SHARDSAFE_DECL std::string checksum_mismatch_message(std::string_view path, std::string_view holder,
                                                     const tensor_entry& e, std::uint64_t k, std::uint64_t block,
                                                     std::uint64_t stored, std::uint64_t computed,
                                                     const tensor_metadata* tm, const shard_spec* spec) {
  const auto [from, to] = block_span(k, block, e.nbytes());
  const std::uint64_t bits = bit_size(e.type);
  const std::uint64_t first = from * 8 / bits, last = (to * 8 + bits - 1) / bits;  // elements [first, last)
  std::string m = std::string(path) + ": tensor '" + e.name + "': elements [" + std::to_string(first) + ", " +
                  std::to_string(last) + ") of the file's " + std::to_string(e.numel()) + " (data bytes [" +
                  std::to_string(from) + ", " + std::to_string(to) + "), checksum block " + std::to_string(k) + ")";
  if (tm && spec && tm->is_sharded)
    if (auto g = global_index_of(*spec, tm->shape, first))
      m += ", from index " + multi_index_string(tm->shape, *g) + " of the full tensor " + to_string(tm->shape);
  m += ": the bytes hash to " + hex64(computed) + " but " + std::string(holder) + " records " + hex64(stored) + " (" +
       std::string(checksum_algorithm) + "): the file is damaged";
  return m;
}

}  // namespace shardsafe::detail
