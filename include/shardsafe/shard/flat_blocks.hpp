// shardsafe/shard/flat_blocks.hpp - a flat range of a tensor as the N-D blocks that tile it.
//
// torch.distributed.checkpoint records every piece of a tensor as an N-D block (offsets, sizes);
// a flat shard (FSDP's flattened offsets) is not one in general. A range [begin, end) of the
// row-major flattened tensor is, however, the union of at most 2 * ndim - 1 blocks, each itself a
// contiguous run of the range, in order: a partial innermost row, then partial planes, the
// largest whole blocks, and the same again down to the end. So each block's bytes are a slice of
// the shard's local data, and a flat shard is written as those blocks.
//
// Greedy rule: at each position, the coarsest level k whose unit (the product of the dimensions
// after k) the position is aligned to and fits before `end`; as many units of that level as fit
// without leaving the enclosing unit of level k - 1.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "shardsafe/core/byte_range.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"

namespace shardsafe {

/// An N-D block of a tensor: sizes[d] elements of dimension d from offsets[d].
struct tensor_block {
  shape_t offsets;
  shape_t sizes;
  friend bool operator==(const tensor_block&, const tensor_block&) = default;
};

/// The blocks tiling elements [r.begin, r.end) of a tensor of shape `full`, in order (rules at
/// the top). A 0-d tensor's range [0, 1) is one block with no dimensions; an empty range none.
/// errc::invalid_spec when the range passes the tensor.
inline std::vector<tensor_block> blocks_of_range(std::span<const std::uint64_t> full, element_range r) {
  const auto n = detail::checked_numel(full);
  if (!n || r.begin > r.end || r.end > *n)
    fail(errc::invalid_spec,
         "elements " + to_string(r) + " pass a tensor of shape " + to_string(shape_t(full.begin(), full.end())));
  std::vector<tensor_block> out;
  if (r.begin == r.end) return out;
  const std::size_t nd = full.size();
  if (nd == 0) {
    out.push_back({});
    return out;
  }
  std::vector<std::uint64_t> unit(nd, 1);  // unit[k]: elements of one index of dimension k
  for (std::size_t k = nd - 1; k-- > 0;) unit[k] = unit[k + 1] * full[k + 1];
  std::uint64_t pos = r.begin;
  while (pos < r.end) {
    std::size_t k = 0;
    while (pos % unit[k] != 0 || r.end - pos < unit[k]) ++k;  // ends at nd - 1 at the latest (unit 1)
    const std::uint64_t limit = k == 0 ? r.end : std::min(r.end, (pos / unit[k - 1] + 1) * unit[k - 1]);
    const std::uint64_t count = (limit - pos) / unit[k];
    tensor_block b;
    b.offsets.resize(nd);
    b.sizes.resize(nd);
    for (std::size_t d = 0; d < nd; ++d) {
      b.offsets[d] = (pos / unit[d]) % full[d];
      b.sizes[d] = d < k ? 1 : d == k ? count : full[d];
    }
    out.push_back(std::move(b));
    pos += count * unit[k];
  }
  return out;
}

}  // namespace shardsafe
