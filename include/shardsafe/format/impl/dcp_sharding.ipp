// shardsafe/format/impl/dcp_sharding.ipp - dcp_sharding.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/dcp_sharding.hpp"

namespace shardsafe {

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

}  // namespace shardsafe
