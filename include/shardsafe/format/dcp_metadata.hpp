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
// Rules checked here (errc::invalid_metadata, naming the file, the key and the rule):
//   - the pickle is a Metadata whose state_dict_metadata is a dict of str keys, each a
//     TensorStorageMetadata or a BytesStorageMetadata;
//   - a tensor has a torch dtype, a size of non-negative ints whose product fits 64 bits, and
//     chunks whose offsets and sizes have one entry per dimension and lie inside the tensor; a
//     torch dtype shardsafe has no type for (complex128, complex32, the quantized ones) makes the
//     tensor foreign (dcp_item::foreign_dtype): checked all the same, listed, its bytes never
//     read, so that the rest of the folder still reads;
//   - a chunk listed twice (same offsets and sizes) counts once; two chunks at the same offsets
//     with other sizes are an error; a tensor has at most max_dcp_chunks_per_tensor chunks, the
//     `.metadata` max_dcp_chunks in all (and at most max_dcp_metadata_size bytes, its reader
//     max_dcp_metadata_made values);
//   - storage_data maps MetadataIndex to _StorageInfo with a plain relative_path (no '/', '\',
//     "..", NUL, not empty), offset + length within 64 bits and no transform_descriptors (newer
//     torch's compression of stored bytes, not read here); every chunk of every tensor (key
//     and offsets equal) and every bytes item has an entry. Entries that no item uses are ignored.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
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

/// A block of one tensor of a DCP checkpoint, as a data file holds it: the tensor's key and
/// dtype, and where the block lies in the full tensor (what format/dcp_data.hpp reads and
/// format/dcp_writer.hpp writes, each adding where its bytes are).
struct dcp_block {
  std::string key;
  dtype type = dtype::F32;
  shape_t offsets;  ///< where the block starts in the full tensor
  shape_t sizes;    ///< the block's shape
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
  /// A tensor of a torch dtype shardsafe has no type for: its name ("torch.complex128"), and
  /// `type` means nothing. Empty for every other item.
  std::string foreign_dtype;
  std::vector<std::uint64_t> size;
  std::vector<dcp_chunk> chunks;  ///< tensors: in the order torch recorded them
  dcp_storage_info bytes;         ///< bytes items: where the torch.save bytes are
};

/// The most chunks one tensor may have (a world of 65536 ranks each holding one block); more is
/// errc::invalid_metadata, so a hostile `.metadata` cannot make the planner compare millions.
inline constexpr std::size_t max_dcp_chunks_per_tensor = std::size_t(1) << 16;

/// What a `.metadata` may hold in all (docs/FORMAT.md §5), so that every command reads one at
/// the limits within 256 MiB: its pickle at most 24 MiB (a byte of it may stand for an 8-byte
/// slot of a list); at most 2^17 chunks over all its tensors (counted as each tensor's are, a
/// chunk listed twice once); its reader makes at most 3 x 2^20 values (torch pickles a chunk in
/// about 21 of them: 2^17 chunks are 2.75 M, in 17 MB), and they expand to at most 6 x 2^20 as
/// a tree, plus 1 per 8 bytes of pickle (a value the memo shares counted at each place: 5.1 M).
/// A value costs the reader about 50 bytes, a chunk about 1.6 KiB in all; under the old limit of
/// 1 GiB, 15 MB of 120,000 chunks took 210 MiB.
inline constexpr std::size_t max_dcp_chunks = std::size_t(1) << 17;
inline constexpr std::uint64_t max_dcp_metadata_size = std::uint64_t(24) << 20;
inline constexpr std::size_t max_dcp_metadata_made = std::size_t(3) << 20;
inline constexpr std::size_t max_dcp_metadata_values = std::size_t(6) << 20;

/// A parsed `.metadata`: every key, sorted.
struct dcp_metadata {
  std::map<std::string, dcp_item> items;
  /// planner_data: each key's path in the nested state dict torch flattened (('optim',
  /// 'param_groups', 0, 'lr')), tuples of str and int; entries of another shape are left out.
  std::map<std::string, pickle_value> planner_data;
  /// Keys Megatron-Core (0.15 and before, MCoreMetadata's mcore_data) records as reformulated
  /// flattened ranges (nd_reformulated_orig_global_shape): stored in another shape than the
  /// tensor's, which no reader here undoes.
  std::vector<std::string> reformulated;
};

namespace detail {

// The rules of the top of this file, over the pickle read in place (pickle_view).
struct dcp_parse {
  std::string_view what;
  using view = pickle_view;
  using k = pickle_value::kind;

  [[noreturn]] void bad(const std::string& where, const std::string& rule) const {
    fail(errc::invalid_metadata, std::string(what) + ": " + where + ": " + rule);
  }
  // The class an object was made as: its first "__class__" entry (a state dict may add another).
  static std::string_view class_name(view v) {
    for (std::size_t i = 0; i < v.size() && v.type() == k::dict; ++i) {
      const view key = v.key(i);
      if (key.type() != k::string || key.as_string("") != dcp_unpickle_policy::class_key) continue;
      const view c = v.value(i);
      if (c.type() != k::string) return {};
      const auto s = c.as_string("");
      const auto dot = s.rfind('.');
      return dot == std::string_view::npos ? s : s.substr(dot + 1);
    }
    return {};
  }
  // The global a marker names ({"__global__": "module.name"}), or "".
  static std::string_view marker_name(view v) {
    if (v.type() != k::dict || v.size() != 1) return {};
    const auto g = v.find(dcp_unpickle_policy::global_key);
    return g && g->type() == k::string ? g->as_string("") : std::string_view();
  }
  view object(view v, std::string_view cls, const std::string& where) const {
    if (class_name(v) != cls) bad(where, "expected a " + std::string(cls) + " object");
    return v;
  }
  view field(view obj, std::string_view name, const std::string& where) const {
    if (const auto f = obj.find(name)) return *f;
    bad(where, "has no field '" + std::string(name) + "'");
  }
  std::uint64_t uint(view v, const std::string& where) const {
    if (v.type() != k::integer || v.as_int("") < 0) bad(where, "expected a non-negative int");
    return static_cast<std::uint64_t>(v.as_int(""));
  }
  std::vector<std::uint64_t> ints(view v, const std::string& where) const {
    if (!v.is_sequence()) bad(where, "expected a torch.Size or a list of ints");
    std::vector<std::uint64_t> out(v.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = uint(v.item(i), where);
    return out;
  }
  /// The dtype of TensorProperties props, or nullopt for a torch dtype shardsafe has no type for
  /// (its name in foreign).
  std::optional<dtype> type_of(view props, const std::string& where, std::string& foreign) const {
    object(props, "TensorProperties", where + ": properties");
    auto d = props.find("dtype");
    if (!d)
      if (const auto st = props.find("__state__"); st && st->type() == k::tuple && st->size() > 0) d = st->item(0);
    if (!d) bad(where, "properties record no dtype");
    const std::string name(marker_name(*d));
    if (!name.starts_with("torch.")) bad(where, "properties.dtype is not a torch dtype");
    const auto t = dcp_torch_dtype(std::string_view(name).substr(6));
    if (!t) bad(where, "properties.dtype '" + name + "' is not a torch dtype");
    if (!*t) foreign = name;
    return *t;
  }
  dcp_storage_info storage(view v, const std::string& where) const {
    object(v, "_StorageInfo", where);
    dcp_storage_info s;
    const view p = field(v, "relative_path", where);
    if (p.type() != k::string) bad(where, "relative_path is not a str");
    s.relative_path = std::string(p.as_string(""));
    const auto& n = s.relative_path;
    if (n.empty() || n == "." || n.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos ||
        n.find("..") != std::string::npos)
      bad(where, "relative_path '" + n + "' is not a plain file name");
    s.offset = uint(field(v, "offset", where), where + ": offset");
    s.length = uint(field(v, "length", where), where + ": length");
    if (!detail::checked_add(s.offset, s.length)) bad(where, "offset + length overflows");
    // newer torch may compress or otherwise transform the stored bytes (StorageInfo.transform_descriptors)
    if (const auto t = v.find("transform_descriptors"); t && !t->is_none()) {
      if (!t->is_sequence()) bad(where, "transform_descriptors is not a list");
      if (t->size() != 0) bad(where, "bytes are transformed (transform_descriptors), which this reader does not undo");
    }
    return s;
  }

  // storage_data: (fqn, offsets or none) -> the _StorageInfo, sorted for lookup (the last entry
  // of a key given twice counts, as in Python's dict); each entry is checked once.
  struct stored {
    std::string_view fqn;
    std::optional<std::vector<std::uint64_t>> offsets;
    dcp_storage_info info;
    bool operator<(const stored& o) const { return std::tie(fqn, offsets) < std::tie(o.fqn, o.offsets); }
  };
  std::vector<stored> storage_data(view sd) const {
    std::vector<stored> out;
    out.reserve(sd.size());
    for (std::size_t i = 0; i < sd.size(); ++i) {
      const view key = sd.key(i);
      const std::string at = "storage_data entry " + std::to_string(i);
      object(key, "MetadataIndex", at);
      const view fqn = field(key, "fqn", at);
      if (fqn.type() != k::string) bad(at, "MetadataIndex.fqn is not a str");
      const std::string named = at + " ('" + detail::shown_name(fqn.as_string("")) + "')";
      stored s{fqn.as_string(""), std::nullopt, storage(sd.value(i), named)};
      if (const auto off = key.find("offset"); off && !off->is_none()) s.offsets = ints(*off, named + ": offset");
      out.push_back(std::move(s));
    }
    std::stable_sort(out.begin(), out.end());
    return out;
  }
  // The entries of key fqn, found once per key: a long name is compared O(log n) times, not
  // once per chunk (a hostile .metadata may list 60,000 chunks under a 1 MB name).
  struct by_fqn {
    bool operator()(const stored& a, std::string_view b) const { return a.fqn < b; }
    bool operator()(std::string_view a, const stored& b) const { return a < b.fqn; }
  };
  static std::span<const stored> entries_of(const std::vector<stored>& s, std::string_view fqn) {
    const auto [lo, hi] = std::equal_range(s.begin(), s.end(), fqn, by_fqn{});
    return {lo, hi};
  }
  // The entry at `offsets` among one key's entries (the last when given twice), or nullptr.
  static const dcp_storage_info* find_stored(std::span<const stored> same_key,
                                             const std::optional<std::vector<std::uint64_t>>& offsets) {
    const auto it = std::upper_bound(same_key.begin(), same_key.end(), offsets,
                                     [](const auto& o, const stored& s) { return o < s.offsets; });
    if (it == same_key.begin() || std::prev(it)->offsets != offsets) return nullptr;
    return &std::prev(it)->info;
  }

  // The chunks of tensor `fqn` (`at` names it) of size `size`, in torch's order, each listed once.
  std::vector<dcp_chunk> chunks(view list, std::string_view fqn, const std::vector<std::uint64_t>& size,
                                const std::vector<stored>& where_stored, const std::string& at) const {
    if (!list.is_sequence()) bad(at, "chunks is not a list");
    std::vector<dcp_chunk> out;
    out.reserve(std::min<std::size_t>(list.size(), max_dcp_chunks_per_tensor + 1));
    const std::span<const stored> mine = entries_of(where_stored, fqn);
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string cat = at + ": chunk " + std::to_string(i);
      const view c = object(list.item(i), "ChunkStorageMetadata", cat);
      dcp_chunk ch;
      ch.offsets = ints(field(c, "offsets", cat), cat + ": offsets");
      ch.sizes = ints(field(c, "sizes", cat), cat + ": sizes");
      if (ch.offsets.size() != size.size() || ch.sizes.size() != size.size())
        bad(cat, "offsets " + to_string(ch.offsets) + " and sizes " + to_string(ch.sizes) +
                     " need one entry per dimension of " + to_string(size));
      for (std::size_t d = 0; d < size.size(); ++d) {
        const auto end = detail::checked_add(ch.offsets[d], ch.sizes[d]);
        if (!end || *end > size[d])
          bad(cat, "offsets " + to_string(ch.offsets) + " + sizes " + to_string(ch.sizes) + " pass the tensor's size " +
                       to_string(size) + " in dimension " + std::to_string(d));
      }
      const auto* s = find_stored(mine, ch.offsets);
      if (!s) bad(cat, "at offsets " + to_string(ch.offsets) + " has no storage_data entry");
      ch.storage = *s;
      out.push_back(std::move(ch));
    }
    // torch finds a chunk's bytes by (fqn, offsets): a chunk listed twice is one chunk; two at the
    // same offsets with other sizes are an error. Sorted positions find them in O(n log n).
    std::vector<std::uint32_t> order(out.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::uint32_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return out[a].offsets < out[b].offsets; });
    std::vector<bool> again(out.size(), false);
    for (std::size_t j = 1; j < order.size(); ++j) {
      const auto& first = out[order[j - 1]];
      const auto& later = out[order[j]];
      if (later.offsets != first.offsets) continue;
      if (later.sizes != first.sizes)
        bad(at + ": chunk " + std::to_string(order[j]), "at offsets " + to_string(later.offsets) + " has sizes " +
                                                            to_string(later.sizes) + ", another chunk there " +
                                                            to_string(first.sizes));
      again[order[j]] = true;
    }
    std::size_t kept = 0;
    for (std::size_t i = 0; i < out.size(); ++i)
      if (!again[i]) {
        if (kept != i) out[kept] = std::move(out[i]);
        ++kept;
      }
    out.resize(kept);
    if (out.size() > max_dcp_chunks_per_tensor)
      bad(at, "has more than " + std::to_string(max_dcp_chunks_per_tensor) + " chunks");
    return out;
  }
};

}  // namespace detail

/// Parses the bytes of a `.metadata` file; `what` names it in messages (rules at the top). The
/// pickle is read in place (no copy of it is built), so memory stays a small multiple of its size.
SHARDSAFE_DECL dcp_metadata parse_dcp_metadata(std::string_view bytes, std::string_view what);

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/format/impl/dcp_metadata.ipp"
#endif
