// shardsafe/format/dcp_metadata_writer.hpp - torch.distributed.checkpoint's `.metadata` as torch
// 2.x's reader loads it (docs/FORMAT.md §5): a protocol-2 pickle of the classes of
// torch.distributed.checkpoint.metadata, each made as Python's pickler makes a dataclass
// (GLOBAL, empty arguments, NEWOBJ, then BUILD with its fields), except TensorProperties, whose
// state is the 5-tuple its __setstate__ takes:
//
//   Metadata{state_dict_metadata: {key: TensorStorageMetadata | BytesStorageMetadata},
//            planner_data: {key: path tuple}, storage_data: {MetadataIndex: _StorageInfo}}
//   TensorStorageMetadata{properties: TensorProperties((dtype, torch.strided, False,
//                         _MEM_FORMAT_ENCODING(0), False)), size: torch.Size, chunks: [...]}
//   ChunkStorageMetadata{offsets: torch.Size, sizes: torch.Size}
//   MetadataIndex{fqn, offset: torch.Size (tensors; 0-d: Size(())), index} / {fqn, index: None} (bytes)
//   _StorageInfo{relative_path, offset, length}   (torch.distributed.checkpoint.filesystem)
//
// torch's reader finds a chunk's bytes by (fqn, offset); planner_data (each key's path in the
// nested state dict: ('model', 'layers.0.weight'), ('optim', 'param_groups', 0, 'lr')) is what
// torch's format_utils need to rebuild the nesting. No StorageMeta is written (torch's reader
// makes an empty one). Only torch 2.x's module paths are written (torch 1.13 cannot read them).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string_view>
#include <string>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/format/dcp_metadata.hpp"
#include "shardsafe/format/pickle_value.hpp"
#include "shardsafe/format/pickle_writer.hpp"
#include "shardsafe/format/torch_zip_writer.hpp"

namespace shardsafe {

namespace detail {

inline constexpr std::string_view dcp_meta_module = "torch.distributed.checkpoint.metadata";

/// A dataclass instance: GLOBAL cls, (), NEWOBJ; the caller then writes its state and 'b'.
inline void pickle_new(std::string& out, std::string_view module, std::string_view cls) {
  pickle_global(out, module, cls);
  out += ")\x81";  // EMPTY_TUPLE, NEWOBJ
}

inline void pickle_size(std::string& out, const std::vector<std::uint64_t>& v) {
  pickle_global(out, "torch", "Size");
  pickle_int_tuple(out, v);
  out += "\x85R";  // TUPLE1, REDUCE
}

inline void pickle_str(std::string& out, std::string_view s) { pickle_put(out, pickle_value::string(std::string(s))); }

/// Writes n entries of a dict with SETITEMS batches of at most 1000 (as Python's pickler does),
/// `entry(i)` writing key i then value i.
template <class Entry>
void pickle_dict_entries(std::string& out, std::size_t n, Entry&& entry) {
  out += '}';
  for (std::size_t b = 0; b < n; b += 1000) {
    const std::size_t e = std::min(n, b + 1000);
    if (e - b > 1) out += '(';
    for (std::size_t i = b; i < e; ++i) entry(i);
    out += e - b > 1 ? 'u' : 's';
  }
}

inline void pickle_storage_info(std::string& out, const dcp_storage_info& s) {
  pickle_new(out, "torch.distributed.checkpoint.filesystem", "_StorageInfo");
  out += "}(";
  pickle_str(out, "relative_path");
  pickle_str(out, s.relative_path);
  pickle_str(out, "offset");
  pickle_put(out, pickle_value::integer(static_cast<std::int64_t>(s.offset)));
  pickle_str(out, "length");
  pickle_put(out, pickle_value::integer(static_cast<std::int64_t>(s.length)));
  out += "ub";
}

}  // namespace detail

/// The bytes of a `.metadata` describing `md` (rules at the top). `planner_data` gives each key's
/// path tuple; keys it lacks get (key,). Offsets and lengths must fit 63 bits (checked).
SHARDSAFE_DECL std::string write_dcp_metadata(const dcp_metadata& md,
                                              const std::map<std::string, pickle_value>& planner_data = {});
/// The same bytes handed to `sink` in pieces of about 4 MiB, in order, as they are made: a
/// `.metadata` of a million items (hundreds of MB) is never held whole.
SHARDSAFE_DECL void write_dcp_metadata(const dcp_metadata& md, const std::map<std::string, pickle_value>& planner_data,
                                       const std::function<void(std::string_view)>& sink);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/dcp_metadata_writer.ipp"
#endif
