// shardsafe/checkpoint/description_message.hpp - a rank's description of its views (what
// save_agree.hpp's describe_views gives: the part of checkpoint_metadata a rank holds) as it
// travels to the other ranks, in the one encoding of dist/message.hpp, not as JSON text.
//
// A description is a list of tensors with their files listed, no grid and no extras:
//
//   items(tensors), then per tensor:
//     text(key) counts(shape) count(dtype: its index in all_dtypes) flag(is_sharded)
//     items(files), then per file: text(name) and its shard spec:
//       count(0) items(ranges) then begin, end per range     a flat spec (flattened offsets)
//       count(1) counts(local_shape) counts(global_offset)    a block
//
// Reading checks what the JSON path checked, with errc::comm_error naming the sender: every
// length and count bounded by what is left (memory and time linear in the message), dtypes and
// spec kinds in range, shapes countable in 64 bits (elements and bits), file names plain, each
// spec inside its tensor, no tensor described twice and no file listed twice in a tensor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/dist/message.hpp"
#include "shardsafe/format/metadata.hpp"
#include "shardsafe/shard/shard_spec.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {
namespace detail {

/// The fewest bytes a described tensor takes (key length, shape count, dtype, flag, file count):
/// the bound on how many tensors a message of n bytes may announce.
inline constexpr std::size_t min_described_tensor_bytes = 5 * 8;

/// Writes a shard spec: its kind, then its ranges or its block.
inline void encode_shard_spec(message_writer& m, const shard_spec& s) {
  if (s.is_flat()) {
    const auto& rs = s.flat().ranges();
    m.count(0).count(rs.size());
    for (const auto& r : rs) m.count(r.begin).count(r.end);
  } else {
    m.count(1).counts(s.block().local_shape()).counts(s.block().global_offset());
  }
}

/// Reads what encode_shard_spec wrote (not yet checked against a shape); what names it.
inline shard_spec decode_shard_spec(message_reader& m, const std::string& what) {
  if (m.count(1, what + "'s kind (0 flat, 1 block)") == 0) {
    const std::uint64_t n = m.items(16, "ranges of " + what);
    std::vector<element_range> ranges(static_cast<std::size_t>(n));
    for (auto& r : ranges) {
      r.begin = m.count();
      r.end = m.count();
    }
    return flat_spec(std::move(ranges));
  }
  shape_t local = m.counts();
  shape_t offset = m.counts();
  return block_spec(std::move(local), std::move(offset));
}

/// Appends md, a rank's description, to m. A description lists its files: md with a grid or
/// extras is not one (errc::invalid_argument).
SHARDSAFE_DECL void encode_description(message_writer& m, const checkpoint_metadata& md);

/// Reads a description encode_description wrote from the front of m (which is left at what
/// follows); anything malformed is m.malformed(): errc::comm_error naming the sender.
SHARDSAFE_DECL checkpoint_metadata decode_description(message_reader& m);

/// md as a message of its own.
inline std::string encode_description(const checkpoint_metadata& md) {
  message_writer m;
  encode_description(m, md);
  return std::move(m).str();
}

/// A message holding one description and nothing else; from names the sender ("ckpt (rank 2's
/// plan)").
inline checkpoint_metadata decode_description(std::string_view bytes, std::string from) {
  message_reader m(bytes, std::move(from));
  checkpoint_metadata md = decode_description(m);
  m.finish();
  return md;
}

}  // namespace detail
}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/checkpoint/impl/description_message.ipp"
#endif
