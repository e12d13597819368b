// shardsafe/format/dcp_metadata.hpp - torch.distributed.checkpoint's `.metadata` file as plain
// C++ structures (docs/FORMAT.md §5, issue 11).
//
// The file is a pickle (protocol 2 to 5) of
//   Metadata(state_dict_metadata: {fqn: TensorStorageMetadata | BytesStorageMetadata},
//            planner_data, storage_data: {MetadataIndex(fqn, offset, index): _StorageInfo}, ...)
// with TensorStorageMetadata(properties=TensorProperties(dtype, ...), size=torch.Size,
// chunks=[ChunkStorageMetadata(offsets, sizes), ...]) and _StorageInfo(relative_path, offset,
// length): the byte range of a data file holding one chunk (a torch.save archive, see
// format/torch_zip.hpp) or one non-tensor item (raw torch.save bytes).
// It is read through the allowlist of format/dcp_unpickler.hpp: no other class, no code.
// Fields this reader does not know (newer torch adds some) are ignored.
//
// Rules checked here (errc::invalid_metadata, naming the file, the key and the rule; an unknown
// dtype is errc::unsupported_dtype):
//   - the pickle is a Metadata whose state_dict_metadata is a dict of str keys, each a
//     TensorStorageMetadata or a BytesStorageMetadata;
//   - a tensor has a known dtype, a size of non-negative ints whose product fits 64 bits, and
//     chunks whose offsets and sizes have one entry per dimension and lie inside the tensor;
//   - a chunk listed twice (same offsets and sizes) counts once; two chunks at the same offsets
//     with other sizes are an error; a tensor has at most max_dcp_chunks_per_tensor chunks;
//   - storage_data maps MetadataIndex to _StorageInfo with a plain relative_path (no '/', '\',
//     "..", NUL, not empty), offset + length within 64 bits and no transform_descriptors (newer
//     torch's compression of stored bytes, not read here); every chunk of every tensor (key
//     and offsets equal) and every bytes item has an entry. Entries that no item uses are ignored.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/dcp_unpickler.hpp"
#include "shardsafe/format/pickle_reader.hpp"

namespace shardsafe {

/// Where one chunk (or one bytes item) is stored: bytes [offset, offset + length) of relative_path.
struct dcp_storage_info {
  std::string relative_path;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  friend bool operator==(const dcp_storage_info&, const dcp_storage_info&) = default;
};

/// An N-D block of a tensor: its offsets and sizes, one per dimension, and where its bytes are.
struct dcp_chunk {
  std::vector<std::uint64_t> offsets;
  std::vector<std::uint64_t> sizes;
  dcp_storage_info storage;
};

/// One key of the state dict: a tensor (type, size, chunks) or a non-tensor item (bytes).
struct dcp_item {
  bool is_bytes = false;
  dtype type = dtype::F32;
  std::vector<std::uint64_t> size;
  std::vector<dcp_chunk> chunks;  ///< tensors: in the order torch recorded them
  dcp_storage_info bytes;         ///< bytes items: where the torch.save bytes are
};

/// The most chunks one tensor may have (a world of 65536 ranks each holding one block); more is
/// errc::invalid_metadata, so a hostile `.metadata` cannot make the planner compare millions.
inline constexpr std::size_t max_dcp_chunks_per_tensor = std::size_t(1) << 16;

/// A parsed `.metadata`: every key, sorted.
struct dcp_metadata {
  std::map<std::string, dcp_item> items;
  /// planner_data: each key's path in the nested state dict torch flattened (('optim',
  /// 'param_groups', 0, 'lr')), tuples of str and int; entries of another shape are left out.
  std::map<std::string, pickle_value> planner_data;
};

namespace detail {

struct dcp_parse {
  std::string_view what;

  [[noreturn]] void bad(const std::string& where, const std::string& rule) const {
    fail(errc::invalid_metadata, std::string(what) + ": " + where + ": " + rule);
  }
  // The class an object was made as: its first "__class__" entry (a state dict may add another).
  static std::string class_name(const pickle_value& v) {
    const pickle_value* c = nullptr;
    for (std::size_t i = 0; i < v.dict_size() && !c; ++i)
      if (v.dict_key(i) == pickle_value::string(std::string(dcp_unpickle_policy::class_key))) c = &v.dict_value(i);
    if (!c || c->type() != pickle_value::kind::string) return {};
    const auto& s = c->as_string("");
    const auto dot = s.rfind('.');
    return dot == std::string::npos ? s : s.substr(dot + 1);
  }
  const pickle_value& object(const pickle_value& v, std::string_view cls, const std::string& where) const {
    if (class_name(v) != cls) bad(where, "expected a " + std::string(cls) + " object");
    return v;
  }
  const pickle_value& field(const pickle_value& obj, std::string_view name, const std::string& where) const {
    if (const auto* f = obj.find(name)) return *f;
    bad(where, "has no field '" + std::string(name) + "'");
  }
  std::uint64_t uint(const pickle_value& v, const std::string& where) const {
    if (v.type() != pickle_value::kind::integer || v.as_int("") < 0) bad(where, "expected a non-negative int");
    return static_cast<std::uint64_t>(v.as_int(""));
  }
  std::vector<std::uint64_t> ints(const pickle_value& v, const std::string& where) const {
    if (v.type() != pickle_value::kind::tuple && v.type() != pickle_value::kind::list)
      bad(where, "expected a torch.Size or a list of ints");
    std::vector<std::uint64_t> out;
    for (const auto& x : v.as_sequence("")) out.push_back(uint(x, where));
    return out;
  }
  dtype type_of(const pickle_value& props, const std::string& where) const {
    object(props, "TensorProperties", where + ": properties");
    const pickle_value* d = props.find("dtype");
    if (!d)
      if (const auto* st = props.find("__state__"); st && (st->type() == pickle_value::kind::tuple) && !st->as_sequence("").empty())
        d = &st->as_sequence("")[0];
    if (!d) bad(where, "properties record no dtype");
    const auto name = dcp_unpickle_policy::marker_name(*d);
    if (!name.starts_with("torch.")) bad(where, "properties.dtype is not a torch dtype");
    const auto t = dcp_torch_dtype(std::string_view(name).substr(6));
    if (!t) bad(where, "properties.dtype '" + name + "' is not a torch dtype");
    if (!*t) fail(errc::unsupported_dtype, std::string(what) + ": " + where + ": dtype " + name + " is not supported");
    return **t;
  }
  dcp_storage_info storage(const pickle_value& v, const std::string& where) const {
    object(v, "_StorageInfo", where);
    dcp_storage_info s;
    const auto& p = field(v, "relative_path", where);
    if (p.type() != pickle_value::kind::string) bad(where, "relative_path is not a str");
    s.relative_path = p.as_string("");
    const auto& n = s.relative_path;
    if (n.empty() || n == "." || n.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos || n.find("..") != std::string::npos)
      bad(where, "relative_path '" + n + "' is not a plain file name");
    s.offset = uint(field(v, "offset", where), where + ": offset");
    s.length = uint(field(v, "length", where), where + ": length");
    if (!detail::checked_add(s.offset, s.length)) bad(where, "offset + length overflows");
    // newer torch may compress or otherwise transform the stored bytes (StorageInfo.transform_descriptors)
    if (const auto* t = v.find("transform_descriptors"); t && !t->is_none()) {
      if (t->type() != pickle_value::kind::list && t->type() != pickle_value::kind::tuple) bad(where, "transform_descriptors is not a list");
      if (!t->as_sequence("").empty()) bad(where, "bytes are transformed (transform_descriptors), which this reader does not undo");
    }
    return s;
  }
};

}  // namespace detail

/// Parses the bytes of a `.metadata` file; `what` names it in messages (rules at the top).
inline dcp_metadata parse_dcp_metadata(std::string_view bytes, std::string_view what) {
  // Values are bounded by the input: each costs a byte or more, memo references a few.
  const std::size_t max_values = std::max<std::size_t>(std::size_t(1) << 20, bytes.size() * 4);
  const pickle_value root = pickle_loads(bytes, what, dcp_unpickle_policy{}, max_values);
  const detail::dcp_parse p{what};
  using k = pickle_value::kind;
  p.object(root, "Metadata", "top level");
  const auto* sdm = root.find("state_dict_metadata");
  if (const auto* a = root.find("__args__"); !sdm && a && a->type() == k::tuple && !a->as_sequence("").empty())
    sdm = &a->as_sequence("")[0];  // Metadata made by REDUCE with positional arguments
  if (!sdm || sdm->type() != k::dict) p.bad("Metadata", "state_dict_metadata is not a dict");

  // storage_data: (fqn, offsets or None) -> where the bytes are
  std::map<std::pair<std::string, std::optional<std::vector<std::uint64_t>>>, dcp_storage_info> where_stored;
  const auto* sd = root.find("storage_data");
  if (sd && !sd->is_none()) {
    if (sd->type() != k::dict) p.bad("Metadata", "storage_data is not a dict");
    for (std::size_t i = 0; i < sd->dict_size(); ++i) {
      const auto& key = sd->dict_key(i);
      const std::string at = "storage_data entry " + std::to_string(i);
      p.object(key, "MetadataIndex", at);
      const auto& fqn = p.field(key, "fqn", at);
      if (fqn.type() != k::string) p.bad(at, "MetadataIndex.fqn is not a str");
      const auto* off = key.find("offset");
      std::optional<std::vector<std::uint64_t>> offsets;
      if (off && !off->is_none()) offsets = p.ints(*off, at + " ('" + fqn.as_string("") + "'): offset");
      where_stored[{fqn.as_string(""), std::move(offsets)}] = p.storage(sd->dict_value(i), at + " ('" + fqn.as_string("") + "')");
    }
  }

  dcp_metadata out;
  if (const auto* pd = root.find("planner_data"); pd && pd->type() == k::dict)
    for (std::size_t i = 0; i < pd->dict_size(); ++i) {
      const auto& key = pd->dict_key(i);
      const auto& path = pd->dict_value(i);
      if (key.type() != k::string || path.type() != k::tuple) continue;
      bool plain = true;
      for (const auto& part : path.as_sequence("")) plain = plain && (part.type() == k::string || part.type() == k::integer);
      if (plain) out.planner_data.emplace(key.as_string(""), path);
    }
  for (std::size_t i = 0; i < sdm->dict_size(); ++i) {
    if (sdm->dict_key(i).type() != k::string) p.bad("state_dict_metadata", "key " + std::to_string(i) + " is not a str");
    const std::string& fqn = sdm->dict_key(i).as_string("");
    const std::string at = "'" + fqn + "'";
    const auto& v = sdm->dict_value(i);
    dcp_item item;
    const auto cls = detail::dcp_parse::class_name(v);
    if (cls == "BytesStorageMetadata") {
      item.is_bytes = true;
      const auto s = where_stored.find({fqn, std::nullopt});
      if (s == where_stored.end()) p.bad(at, "bytes item has no storage_data entry");
      item.bytes = s->second;
    } else if (cls == "TensorStorageMetadata") {
      item.type = p.type_of(p.field(v, "properties", at), at);
      item.size = p.ints(p.field(v, "size", at), at + ": size");
      if (!detail::checked_numel(item.size)) p.bad(at, "size " + to_string(item.size) + " has more elements than 64 bits count");
      if (!detail::checked_mul(*detail::checked_numel(item.size), std::uint64_t(bit_size(item.type))))
        p.bad(at, "size " + to_string(item.size) + " " + std::string(name(item.type)) + " has more than 2^64 bits of data");
      const auto& chunks = p.field(v, "chunks", at);
      std::map<std::vector<std::uint64_t>, std::vector<std::uint64_t>> seen;  // offsets -> sizes
      if (chunks.type() != k::list && chunks.type() != k::tuple) p.bad(at, "chunks is not a list");
      for (const auto& c : chunks.as_sequence("")) {
        const std::string cat = at + ": chunk " + std::to_string(item.chunks.size());
        p.object(c, "ChunkStorageMetadata", cat);
        dcp_chunk ch;
        ch.offsets = p.ints(p.field(c, "offsets", cat), cat + ": offsets");
        ch.sizes = p.ints(p.field(c, "sizes", cat), cat + ": sizes");
        if (ch.offsets.size() != item.size.size() || ch.sizes.size() != item.size.size())
          p.bad(cat, "offsets " + to_string(ch.offsets) + " and sizes " + to_string(ch.sizes) + " need one entry per dimension of " +
                         to_string(item.size));
        for (std::size_t d = 0; d < item.size.size(); ++d) {
          const auto end = detail::checked_add(ch.offsets[d], ch.sizes[d]);
          if (!end || *end > item.size[d])
            p.bad(cat, "offsets " + to_string(ch.offsets) + " + sizes " + to_string(ch.sizes) + " pass the tensor's size " +
                           to_string(item.size) + " in dimension " + std::to_string(d));
        }
        const auto s = where_stored.find({fqn, ch.offsets});
        if (s == where_stored.end()) p.bad(cat, "at offsets " + to_string(ch.offsets) + " has no storage_data entry");
        ch.storage = s->second;
        // torch finds a chunk's bytes by (fqn, offsets): a chunk listed twice is one chunk
        if (auto [at_offsets, fresh] = seen.emplace(ch.offsets, ch.sizes); !fresh) {
          if (at_offsets->second != ch.sizes)
            p.bad(cat, "at offsets " + to_string(ch.offsets) + " has sizes " + to_string(ch.sizes) + ", another chunk there " +
                           to_string(at_offsets->second));
          continue;
        }
        if (item.chunks.size() == max_dcp_chunks_per_tensor)
          p.bad(at, "has more than " + std::to_string(max_dcp_chunks_per_tensor) + " chunks");
        item.chunks.push_back(std::move(ch));
      }
    } else {
      p.bad(at, cls.empty() ? "is not a storage metadata object" : "is a " + cls + ", not a TensorStorageMetadata or BytesStorageMetadata");
    }
    if (!out.items.emplace(fqn, std::move(item)).second) p.bad(at, "is given twice");
  }
  return out;
}

}  // namespace shardsafe
