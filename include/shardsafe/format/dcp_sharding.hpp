// shardsafe/format/dcp_sharding.hpp - the sharding record of torch's sharded Hugging Face files
// (docs/FORMAT.md §4: "a folder of torch's sharded HF files").
//
// torch.distributed.checkpoint's Hugging Face writer with save_sharded=True (NeMo Automodel
// uses it) leaves one safetensors file per rank and output file,
// `shard-00001-model-00001-of-00002.safetensors`, ..., each holding the rank's local blocks.
// Each file's `__metadata__` carries:
//   "DCP_SHARDING_INFO": a JSON *string* {FQN: {"saved_offsets": [o0, o1, ...]}, ...} giving
//                        each local block's offset in the full tensor, one per dimension;
//   "DCP_VERSION": "1.0", "format": "pt".
// The full shape is not recorded: it is the maximum of offset + local shape over the files.
//
// Rules checked here (errc::invalid_metadata, naming the file and the tensor):
//   - DCP_SHARDING_INFO is a JSON object of objects, each with "saved_offsets", a list of
//     non-negative integers (other keys are ignored);
//   - every tensor of the file has an entry, and every entry names a tensor of the file;
//   - an entry has one offset per dimension of the tensor, and offset + size fits in 64 bits.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/json.hpp"
#include "shardsafe/format/safetensors.hpp"

namespace shardsafe {

/// The __metadata__ key that marks a torch sharded HF file.
inline constexpr std::string_view dcp_sharding_info_key = "DCP_SHARDING_INFO";

/// Whether a validated header is one of torch's sharded HF files.
inline bool is_dcp_sharded_header(const safetensors_header& h) {
  return h.metadata.count(std::string(dcp_sharding_info_key)) != 0;
}

/// Each tensor's block offset in its full tensor, by name, as one file records it.
using dcp_block_offsets = std::map<std::string, shape_t>;

/// Parses and checks the DCP_SHARDING_INFO of header h (rules at the top). `h.file` names the
/// file in messages. errc::invalid_metadata when the header has no DCP_SHARDING_INFO.
SHARDSAFE_DECL dcp_block_offsets parse_dcp_sharding_info(const safetensors_header& h);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/dcp_sharding.ipp"
#endif
