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
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL dcp_block_offsets parse_dcp_sharding_info(const safetensors_header& h) {
  const std::string& f = h.file;
  auto it = h.metadata.find(std::string(dcp_sharding_info_key));
  if (it == h.metadata.end())
    fail(errc::invalid_metadata, f + ": __metadata__ has no " + std::string(dcp_sharding_info_key));
  const std::string ctx = f + ": __metadata__." + std::string(dcp_sharding_info_key);
  simdjson::dom::parser parser;
  auto root = detail::parse_json(parser, it->second, ctx);
  simdjson::dom::object top;
  if (root.get_object().get(top)) fail(errc::invalid_metadata, ctx + ": not a JSON object");
  dcp_block_offsets out;
  for (auto field : top) {
    const std::string key(field.key);
    const std::string tctx = f + ": tensor '" + key + "': " + std::string(dcp_sharding_info_key);
    simdjson::dom::object o;
    if (field.value.get_object().get(o)) fail(errc::invalid_metadata, tctx + ": entry is not an object");
    simdjson::dom::element v;
    if (o["saved_offsets"].get(v)) fail(errc::invalid_metadata, tctx + ": entry has no \"saved_offsets\"");
    shape_t offs = detail::parse_count_array(v, tctx, "saved_offsets", errc::invalid_metadata);
    const tensor_entry* e = h.find(key);
    if (!e) fail(errc::invalid_metadata, tctx + ": names a tensor the file does not hold");
    if (offs.size() != e->shape.size())
      fail(errc::invalid_metadata, tctx + ": saved_offsets " + to_string(offs) + " has " + std::to_string(offs.size()) +
                                       " entries but the tensor has " + std::to_string(e->shape.size()) +
                                       " dimensions (shape " + to_string(e->shape) + ")");
    for (std::size_t d = 0; d < offs.size(); ++d)
      if (offs[d] > UINT64_MAX - e->shape[d])
        fail(errc::invalid_metadata, tctx + ": saved_offsets[" + std::to_string(d) + "] + size passes 2^64");
    if (!out.emplace(key, std::move(offs)).second) fail(errc::invalid_metadata, tctx + ": listed twice");
  }
  for (const auto& t : h.tensors)
    if (!out.count(t.name))
      fail(errc::invalid_metadata, f + ": tensor '" + t.name + "': not in " + std::string(dcp_sharding_info_key));
  detail::require_unique_keys(root, ctx);  // after the rule above: saved_offsets twice, say
  return out;
}
#else
SHARDSAFE_DECL dcp_block_offsets parse_dcp_sharding_info(const safetensors_header& h);
#endif

}  // namespace shardsafe
