// shardsafe/format/impl/dcp_metadata_writer.ipp - dcp_metadata_writer.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/dcp_metadata_writer.hpp"

namespace shardsafe {

SHARDSAFE_DECL std::string write_dcp_metadata(const dcp_metadata& md,
                                              const std::map<std::string, pickle_value>& planner_data) {
  std::string all;
  write_dcp_metadata(md, planner_data, [&](std::string_view piece) { all += piece; });
  return all;
}

SHARDSAFE_DECL void write_dcp_metadata(const dcp_metadata& md, const std::map<std::string, pickle_value>& planner_data,
                                       const std::function<void(std::string_view)>& sink) {
  using namespace detail;
  std::string out = "\x80\x02";
  // each dict entry is appended to out whole; out goes to the sink once it passes 4 MiB
  auto flush = [&](std::size_t above) {
    if (out.size() <= above) return;
    sink(out);
    out.clear();
  };
  pickle_new(out, dcp_meta_module, "Metadata");
  out += "}(";  // its state: three entries, set by one SETITEMS
  // state_dict_metadata
  pickle_str(out, "state_dict_metadata");
  std::vector<const std::pair<const std::string, dcp_item>*> items;
  for (const auto& kv : md.items) items.push_back(&kv);
  pickle_dict_entries(out, items.size(), [&](std::size_t i) {
    flush(std::size_t(4) << 20);
    const auto& [key, item] = *items[i];
    pickle_str(out, key);
    if (item.is_bytes) {
      pickle_new(out, dcp_meta_module, "BytesStorageMetadata");
      return;
    }
    if (!item.foreign_dtype.empty())
      fail(errc::unsupported_dtype,
           "DCP .metadata: tensor '" + key + "': dtype " + item.foreign_dtype + " is not written");
    const std::string_view tname = torch_dtype_name(item.type);
    if (tname.empty())
      fail(errc::unsupported_dtype,
           "DCP .metadata: tensor '" + key + "': torch has no dtype for " + std::string(to_string(item.type)));
    pickle_new(out, dcp_meta_module, "TensorStorageMetadata");
    out += "}(";
    pickle_str(out, "properties");
    pickle_new(out, dcp_meta_module, "TensorProperties");
    out += '(';
    pickle_global(out, "torch", tname);
    pickle_global(out, "torch.serialization", "_get_layout");
    pickle_str(out, "torch.strided");
    out += "\x85R\x89";  // TUPLE1 REDUCE (the layout), requires_grad False
    pickle_global(out, dcp_meta_module, "_MEM_FORMAT_ENCODING");
    out += 'K';  // _MEM_FORMAT_ENCODING(0) (contiguous), pin_memory False, the 5-tuple, BUILD
    out += '\0';
    out += "\x85R\x89tb";
    pickle_str(out, "size");
    pickle_size(out, item.size);
    pickle_str(out, "chunks");
    out += ']';
    for (std::size_t b = 0; b < item.chunks.size(); b += 1000) {
      const std::size_t e = std::min(item.chunks.size(), b + 1000);
      if (e - b > 1) out += '(';
      for (std::size_t c = b; c < e; ++c) {
        pickle_new(out, dcp_meta_module, "ChunkStorageMetadata");
        out += "}(";
        pickle_str(out, "offsets");
        pickle_size(out, item.chunks[c].offsets);
        pickle_str(out, "sizes");
        pickle_size(out, item.chunks[c].sizes);
        out += "ub";
      }
      out += e - b > 1 ? 'e' : 'a';
    }
    out += "ub";
  });
  // planner_data
  pickle_str(out, "planner_data");
  pickle_dict_entries(out, items.size(), [&](std::size_t i) {
    flush(std::size_t(4) << 20);
    const std::string& key = items[i]->first;
    pickle_str(out, key);
    auto it = planner_data.find(key);
    pickle_put(out, it != planner_data.end() ? it->second : pickle_value::tuple({pickle_value::string(key)}));
  });
  // storage_data: one entry per chunk (and per bytes item)
  struct entry {
    const std::string* key;
    const dcp_chunk* chunk;  // nullptr: a bytes item
    const dcp_storage_info* where;
    std::size_t index;
  };
  std::vector<entry> entries;
  for (const auto* kv : items) {
    if (kv->second.is_bytes) {
      entries.push_back({&kv->first, nullptr, &kv->second.bytes, 0});
      continue;
    }
    for (std::size_t c = 0; c < kv->second.chunks.size(); ++c)
      entries.push_back({&kv->first, &kv->second.chunks[c], &kv->second.chunks[c].storage, c});
  }
  for (const auto& e : entries)
    if (e.where->offset > std::uint64_t(INT64_MAX) || e.where->length > std::uint64_t(INT64_MAX))
      fail(errc::invalid_argument, "DCP .metadata: '" + *e.key + "': offset or length past 63 bits");
  pickle_str(out, "storage_data");
  pickle_dict_entries(out, entries.size(), [&](std::size_t i) {
    flush(std::size_t(4) << 20);
    const entry& e = entries[i];
    pickle_new(out, dcp_meta_module, "MetadataIndex");
    out += "}(";
    pickle_str(out, "fqn");
    pickle_str(out, *e.key);
    if (e.chunk) {
      pickle_str(out, "offset");
      pickle_size(out, e.chunk->offsets);
      pickle_str(out, "index");
      pickle_put(out, pickle_value::integer(static_cast<std::int64_t>(e.index)));
    } else {
      pickle_str(out, "index");
      out += 'N';
    }
    out += "ub";
    pickle_storage_info(out, *e.where);
  });
  out += "ub.";
  flush(0);
}

}  // namespace shardsafe
