// shardsafe/format/impl/dcp_metadata.ipp - dcp_metadata.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/dcp_metadata.hpp"

namespace shardsafe {

SHARDSAFE_DECL dcp_metadata parse_dcp_metadata(std::string_view bytes, std::string_view what) {
  basic_pickle_reader<dcp_unpickle_policy> reader(bytes, std::string(what), dcp_unpickle_policy{},
                                                  max_dcp_metadata_values, max_dcp_metadata_made);
  return reader.run([&](pickle_view root) {
    const detail::dcp_parse p{what};
    using k = pickle_value::kind;
    // torch's Metadata, or Megatron-Core's subclass of it (core 0.15 and before: one more field)
    p.object(root, detail::dcp_parse::class_name(root) == "MCoreMetadata" ? "MCoreMetadata" : "Metadata", "top level");
    auto sdm = root.find("state_dict_metadata");
    if (const auto a = root.find("__args__"); !sdm && a && a->type() == k::tuple && a->size() > 0)
      sdm = a->item(0);  // Metadata made by REDUCE with positional arguments
    if (!sdm || sdm->type() != k::dict) p.bad("Metadata", "state_dict_metadata is not a dict");

    std::vector<detail::dcp_parse::stored> where_stored;
    if (const auto sd = root.find("storage_data"); sd && !sd->is_none()) {
      if (sd->type() != k::dict) p.bad("Metadata", "storage_data is not a dict");
      where_stored = p.storage_data(*sd);
    }

    dcp_metadata out;
    std::size_t chunks = 0;  // of the tensors so far (max_dcp_chunks)
    if (const auto pd = root.find("planner_data"); pd && pd->type() == k::dict)
      for (std::size_t i = 0; i < pd->size(); ++i) {
        const pickle_view key = pd->key(i);
        const pickle_view path = pd->value(i);
        if (key.type() != k::string || path.type() != k::tuple) continue;
        bool plain = true;
        for (std::size_t j = 0; j < path.size(); ++j)
          plain = plain && (path.item(j).type() == k::string || path.item(j).type() == k::integer);
        if (plain) out.planner_data.emplace(std::string(key.as_string("")), path.build());
      }
    if (const auto md = root.find("mcore_data"); md && md->type() == k::dict)
      for (std::size_t i = 0; i < md->size(); ++i)
        if (md->key(i).type() == k::string && md->value(i).type() == k::dict &&
            md->value(i).find("nd_reformulated_orig_global_shape"))
          out.reformulated.emplace_back(md->key(i).as_string(""));
    for (std::size_t i = 0; i < sdm->size(); ++i) {
      if (sdm->key(i).type() != k::string) p.bad("state_dict_metadata", "key " + std::to_string(i) + " is not a str");
      const std::string_view fqn = sdm->key(i).as_string("");
      const std::string at = "'" + detail::shown_name(fqn) + "'";  // built into each chunk's context
      const pickle_view v = sdm->value(i);
      dcp_item item;
      const auto cls = detail::dcp_parse::class_name(v);
      if (cls == "BytesStorageMetadata") {
        item.is_bytes = true;
        const auto* s = detail::dcp_parse::find_stored(detail::dcp_parse::entries_of(where_stored, fqn), std::nullopt);
        if (!s) p.bad(at, "bytes item has no storage_data entry");
        item.bytes = *s;
      } else if (cls == "TensorStorageMetadata") {
        const auto t = p.type_of(p.field(v, "properties", at), at, item.foreign_dtype);
        if (t) item.type = *t;
        item.size = p.ints(p.field(v, "size", at), at + ": size");
        if (!detail::checked_numel(item.size))
          p.bad(at, "size " + to_string(item.size) + " has more elements than 64 bits count");
        if (t && !detail::checked_mul(*detail::checked_numel(item.size), std::uint64_t(bit_size(item.type))))
          p.bad(at, "size " + to_string(item.size) + " " + std::string(to_string(item.type)) +
                        " has more than 2^64 bits of data");
        item.chunks = p.chunks(p.field(v, "chunks", at), fqn, item.size, where_stored, at);
        if ((chunks += item.chunks.size()) > max_dcp_chunks)
          p.bad(at, "with its " + std::to_string(item.chunks.size()) + " chunks, the tensors so far have " +
                        std::to_string(chunks) + ", more than the " + std::to_string(max_dcp_chunks) +
                        " a .metadata may list in all (docs/FORMAT.md §5)");
      } else {
        p.bad(at, cls.empty() ? "is not a storage metadata object"
                              : "is a " + std::string(cls) + ", not a TensorStorageMetadata or BytesStorageMetadata");
      }
      if (!out.items.emplace(std::string(fqn), std::move(item)).second) p.bad(at, "is given twice");
    }
    return out;
  });
}

}  // namespace shardsafe
