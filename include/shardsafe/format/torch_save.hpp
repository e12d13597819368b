// shardsafe/format/torch_save.hpp - the tensors of a torch.save file of a state dict (a Hugging
// Face pytorch_model.bin, a .pt of model.state_dict()), indexed so that they are read in place,
// as a safetensors file's are, and its pickle never run (docs/FORMAT.md §3).
//
// torch.save (zip format, torch >= 1.6) writes a zip of PREFIX/data.pkl, the pickled value, and
// one record PREFIX/data/KEY per storage, stored uncompressed; newer torch adds PREFIX/version,
// PREFIX/byteorder and a few more. A tensor is _rebuild_tensor_v2(storage, offset, size,
// stride, ...) over one of those storages: tensors may share a storage (tied weights) or take
// a slice of it (storage_offset). The index gives each tensor the byte range of the file its
// elements fill, with the order its dimensions are stored in when torch kept a transposed or
// channels_last layout (safetensors_header::stored_order), so the loaders, unshard, verify and
// the exports read it as any other file.
//
// The legacy format (torch < 1.6, or _use_new_zipfile_serialization=False; old Hugging Face
// checkpoints) is a stream: five pickles (the magic number, the protocol version 1001, sys_info,
// the value, the list of storage keys), then each listed storage in turn, an int64 of its
// elements (little-endian) before its bytes. A tensor's storage is the persistent id
// ('storage', type, key, location, numel, None); the storages' places follow from the list, the
// element size of each storage's type and the sizes in the file.
//
// data.pkl goes through the torch.save allowlist (format/torch_zip.hpp's
// torch_tensor_pickle_policy with state_dict: OrderedDict, _rebuild_tensor_v2/_v3,
// _rebuild_parameter, storage classes, dtypes; any other global is refused by name and nothing
// is called). Its value is a dict; a tensor is named by its path through nested dicts, lists
// and tuples, joined with '.' (keys str, int, bool, float or None, as Python's str() writes
// them): {"model": {"w": T}} is "model.w".
//
// Rules (errc::invalid_metadata, naming the file, the tensor and the rule; errc::unsupported_dtype
// for a dtype shardsafe has no type for):
//   - a zip archive: the checks of format/torch_zip.hpp's records (stored, sizes, local
//     headers), at most 2^16 + 1024 records, its central directory at most 256 MiB; one
//     PREFIX/data.pkl, at most 64 MiB; PREFIX/byteorder, when present, says "little";
//     PREFIX/.data/version (else PREFIX/version) holds a format version torch reads (1 to 10); every
//     tensor's storage is a record PREFIX/data/KEY holding its storage's bytes;
//   - the legacy format: its pickles (protocol 2 as torch writes them by default, or 3 to 5)
//     end within the file's first 64 MiB; the protocol version is 1001; sys_info does not say
//     big-endian; no storage is a view (view_metadata None); the storage list holds at most
//     2^16 distinct str keys, each named in the pickle, and every tensor's storage is listed;
//     each storage's size in the file is the elements its persistent id says (of the element
//     size of its type), and its bytes end inside the file;
//   - every persistent id naming one storage key gives it the same type and size, wherever it
//     stands (a tensor's, or one the reader drops): torch makes the storage from the first and
//     views it so at every later use; a zip holds every such storage's record, of its size;
//   - nothing torch applies to a tensor after making it: no SETITEM(S) on a tensor or storage,
//     no _rebuild_tensor metadata (conj, neg) or Parameter state that is not empty; no two
//     records named alike but for case; no FRAME past its pickle's STOP; a legacy file's first
//     512 bytes are no tar header (torch.load would read that format instead);
//   - every tensor is dense (its elements fill numel consecutive elements of the storage, in
//     some order of its dimensions) and lies inside its storage;
//   - flattened names are distinct, and no dict holds two keys Python holds equal (1, True, 1.0);
//     dict keys are str, int, bool, float or None;
// Values that are not tensors (a training checkpoint's epoch, loss, optimizer param_groups,
// scheduler state) are kept as torch.distributed.checkpoint's flatten_state_dict keeps them: a
// dict is walked by str(key); a list by index when an item is a dict, a list so walked, or
// holds a tensor; anything else is one value (a tuple, a list of plain values, a scalar). Each value
// and tensor keeps its path in the nested dict where it is not just (name,). What a caller does
// with the values is its own rule (a Hugging Face folder refuses them; a file read alone lists
// them, and to-dcp writes them again: checkpoint/source.hpp's single_file_source). Tensors are
// found wherever they stand: a tuple holding one, and a list around such a tuple, are walked for
// them here, where DCP would pickle each whole as one item.
// The values flattened are at most one per 8 bytes of pickle (plus 1024), their names' bytes at
// most 4x its size (plus 1 MiB): the memo cannot make one key or tensor stand at a million places.
// What the tool reads within its memory (torch_state_dict.hpp, torch_tensor_pickle.hpp): at most
// 2^16 storages named, 2^18 tensors and values (a tensor counting 4), 4 MiB of their names, 2^19
// ints, floats, strs and containers in the values, 2^21 values made by the pickle's reader in
// all; each refused as the count passes it, before the rest is read.
//
// Reads: the archive's last KiB and its central directory, the local header of data.pkl, of
// byteorder and of each storage a tensor uses (in the archive's order: one read for a record of
// 64 KiB or more, one 64 KiB window for small ones that lie together), data.pkl. The legacy format: the
// file's first MiB (more while the pickles run on), each storage's size (64 KiB at a time). No
// tensor data.
//
// This header indexes a whole file (index_torch_save_file, is_torch_save_file,
// read_torch_save_header) and includes its parts: torch_state_dict.hpp (the state dict's pickle,
// flattened, and its tensors placed in their storages) and torch_save_legacy.hpp (the legacy
// format).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/safetensors.hpp"
#include "shardsafe/format/torch_save_legacy.hpp"
#include "shardsafe/format/torch_state_dict.hpp"
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The format versions of a torch.save archive torch 1.13 to 2.6 read (its PREFIX/version
/// record, or PREFIX/.data/version where present: kMinSupportedFileFormatVersion and
/// kMaxSupportedFileFormatVersion of caffe2/serialize/versions.h); torch refuses others.
inline constexpr std::uint64_t torch_save_min_version = 1;
inline constexpr std::uint64_t torch_save_max_version = 10;

/// The most records a torch.save archive holds: a storage's each (max_torch_save_storages) and
/// room for the few others torch writes (data.pkl, version, byteorder, .data/serialization_id).
inline constexpr std::uint64_t max_torch_save_records = max_torch_save_storages + 1024;

/// Indexes the torch.save file st (rules at the top): every tensor's byte range and layout,
/// reading only the archive's directory, local headers and data.pkl (the legacy format: its
/// pickles and each storage's size). `o`: what a layout reads past the allowlist (opaque records
/// of classes it names) and whether the value is kept (torch_save_read_options).
template <ReadableStorage S>
torch_save_index index_torch_save_file(const S& st, const torch_save_read_options& o = {}) {
  const std::string file(st.name());
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, file + ": " + rule); };
  auto read_at = [&](std::uint64_t off, std::size_t n) { return detail::read_string(st, off, n); };
  if (torch_save_legacy_magic_size(read_at(0, static_cast<std::size_t>(std::min<std::uint64_t>(st.size(), 24)))) != 0)
    return detail::index_torch_save_legacy(st, o);
  // of the records only those torch looks up are kept: PREFIX/data.pkl, the version and
  // byteorder records, the storages' PREFIX/data/KEY (an archive's other records cost no memory)
  auto looked_up = [](std::string_view n) {
    return n.ends_with("/data.pkl") || n.ends_with("/version") || n.ends_with("/byteorder") ||
           n.find("/data/") != std::string_view::npos;
  };
  const detail::zip_directory dir = detail::read_zip_directory(
      st.size(), read_at, bad, max_torch_save_records, std::uint64_t(256) << 20, "a torch.save file", looked_up);
  const detail::zip_entry* pkl = nullptr;
  for (const auto& e : dir.entries)
    if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) {
      if (pkl) bad("holds two pickles, '" + pkl->name + "' and '" + e.name + "' (not a torch.save file)");
      pkl = &e;
    }
  if (!pkl) bad("holds no PREFIX/data.pkl: not a torch.save file (zip format)");
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - 8);  // "PREFIX/"
  // KEY -> record, sorted by KEY (the first record of a KEY named twice): views into dir's names,
  // 24 bytes a record where a map of strings took about 100 (2^20 records, issue 53)
  using keyed = std::pair<std::string_view, const detail::zip_entry*>;
  std::vector<keyed> storages;
  const detail::zip_entry* version = nullptr;  // the record torch reads: .data/version first, else version
  for (const auto& e : dir.entries) {
    if (e.name == prefix + ".data/version" || (e.name == prefix + "version" && !version)) version = &e;
    if (e.name == prefix + "byteorder") {
      const torch_zip_record r = detail::place_zip_record(e, dir.at, read_at, bad);
      const std::string order =
          r.size <= 16 ? read_at(r.data_offset, static_cast<std::size_t>(r.size)) : std::string("?");
      if (order != "little")
        bad("record '" + e.name + "' says the storages are '" + order + "' endian; only little-endian files are read");
    }
    if (e.name.starts_with(prefix + "data/") && e.name.size() > prefix.size() + 5)
      storages.emplace_back(std::string_view(e.name).substr(prefix.size() + 5), &e);
  }
  std::stable_sort(storages.begin(), storages.end(), [](const keyed& a, const keyed& b) { return a.first < b.first; });
  storages.erase(
      std::unique(storages.begin(), storages.end(), [](const keyed& a, const keyed& b) { return a.first == b.first; }),
      storages.end());
  auto storage_record = [&](std::string_view key) -> const detail::zip_entry* {
    const auto it = std::lower_bound(storages.begin(), storages.end(), key,
                                     [](const keyed& a, std::string_view k) { return a.first < k; });
    return it != storages.end() && it->first == key ? it->second : nullptr;
  };
  if (!version) bad("holds no " + prefix + "version record: torch refuses an archive without its format version");
  {
    const torch_zip_record r = detail::place_zip_record(*version, dir.at, read_at, bad);
    const std::string text = r.size <= 24 ? read_at(r.data_offset, static_cast<std::size_t>(r.size)) : std::string();
    std::uint64_t v = 0;
    std::size_t i = 0, digits = 0;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9' && digits < 19; ++i, ++digits)
      v = v * 10 + (text[i] - '0');
    const bool rest_blank = std::all_of(text.begin() + static_cast<std::ptrdiff_t>(i), text.end(),
                                        [](char c) { return c == '\n' || c == '\r' || c == ' '; });
    if (digits == 0 || !rest_blank)
      bad("record '" + version->name + "' does not hold a format version number (" + std::to_string(r.size) +
          " bytes)");
    if (v < torch_save_min_version || v > torch_save_max_version)
      bad("record '" + version->name + "' says format version " + std::to_string(v) + "; torch reads versions " +
          std::to_string(torch_save_min_version) + " to " + std::to_string(torch_save_max_version) +
          " (caffe2/serialize/versions.h) and refuses this one");
  }
  const torch_zip_record p = detail::place_zip_record(*pkl, dir.at, read_at, bad);
  if (p.size > max_torch_save_pickle)
    bad("data.pkl of " + std::to_string(p.size) + " bytes is larger than " + std::to_string(max_torch_save_pickle));
  torch_state_dict_pickle sd =
      parse_torch_state_dict_pickle(read_at(p.data_offset, static_cast<std::size_t>(p.size)), file + ": data.pkl", o);
  // The storages the tensors use, placed in the archive's order through a 64 KiB window: a
  // small record's successor lies in the same window (40,000 storages of 64 bytes: 117 reads in
  // all, not 40,000 requests over HTTP); a large record's header is read alone.
  // (KEY, record) of each storage a persistent id names, sorted by KEY as `storages` is, each
  // record's data offset found once; its name and size are its zip_entry's (place_zip_record)
  struct placed_storage {
    std::string_view key;
    const detail::zip_entry* e;
    std::uint64_t data_offset;
  };
  std::vector<placed_storage> placed;
  for (const auto& id : sd.storages)
    if (const detail::zip_entry* e = storage_record(id.first))
      placed.push_back({std::string_view(e->name).substr(prefix.size() + 5), e, 0});
  {
    std::vector<placed_storage*> by_place(placed.size());
    for (std::size_t i = 0; i < placed.size(); ++i) by_place[i] = &placed[i];
    std::sort(by_place.begin(), by_place.end(),
              [](const placed_storage* a, const placed_storage* b) { return a->e->local < b->e->local; });
    detail::read_window<decltype(read_at)> headers{read_at, {}, 0};
    bool small = false;
    auto header_read = [&](std::uint64_t off, std::size_t n) { return headers(off, n, dir.at, small); };
    for (placed_storage* p : by_place) {
      small = p->e->usize < (64 << 10);
      p->data_offset = detail::place_zip_record(*p->e, dir.at, header_read, bad).data_offset;
    }
  }
  // sd.storages is a map: its keys, and so `placed`, are sorted
  auto placed_at = [&](std::string_view key) -> const placed_storage* {
    const auto it = std::lower_bound(placed.begin(), placed.end(), key,
                                     [](const placed_storage& a, std::string_view k) { return a.key < k; });
    return it != placed.end() && it->key == key ? &*it : nullptr;
  };
  const auto ids = std::move(sd.storages);
  torch_save_index x = detail::index_state_dict_tensors(
      file, st.size(), std::move(sd), [&](const std::string& key, auto& tbad) -> torch_zip_record {
        const placed_storage* pl = placed_at(key);
        if (!pl) tbad("its storage '" + key + "' has no record '" + prefix + "data/" + key + "'");
        return torch_zip_record{pl->e->name, pl->data_offset, pl->e->usize};
      });
  // a persistent id no tensor holds still makes torch load its storage: without its record, or
  // with one of another size, torch.load refuses the file
  for (const auto& [key, id] : ids) {
    const placed_storage* pl = placed_at(key);
    const auto type = torch_tensor_pickle_policy::storage_type_of(id.type);
    const auto bytes = type ? detail::checked_mul(id.numel, *type ? item_size(**type) : 1) : std::nullopt;
    if (!pl || !bytes || *bytes != pl->e->usize)
      bad("storage '" + key + "' (its persistent id at byte " + std::to_string(id.at) +
          " of data.pkl: " + std::to_string(id.numel) + " of " + id.type + ") has " +
          (!pl ? "no record '" + prefix + "data/" + key + "'"
               : "a record of " + std::to_string(pl->e->usize) + " bytes") +
          " (torch.load would refuse the file)");
  }
  return x;
}

/// Whether st begins as a torch.save file does (a zip's first local header, its method bytes
/// not a safetensors header's '{', or the legacy format's pickled magic number): one read of
/// at most 24 bytes.
template <ReadableStorage S>
bool is_torch_save_file(const S& st) {
  if (st.size() < 14) return false;
  const std::string b = detail::read_string(st, 0, static_cast<std::size_t>(std::min<std::uint64_t>(st.size(), 24)));
  return (b.starts_with("PK\x03\x04") && b[8] != '{') || torch_save_legacy_magic_size(b) != 0;
}

/// The index of a torch.save file that holds tensors only (index_torch_save_file), as a Hugging
/// Face folder's pytorch_model.bin does; a value that is not a tensor is refused
/// (errc::invalid_metadata, naming it and how many more there are).
template <ReadableStorage S>
safetensors_header read_torch_save_header(const S& st) {
  torch_save_index x = index_torch_save_file(st);
  if (!x.unread.empty())  // a model's weights are read whole, or not at all
    fail(errc::invalid_metadata, x.header.file + ": tensor '" + x.unread.front().name + "' " +
                                     to_string(x.unread.front().shape) + " " + x.unread.front().why);
  if (!x.values.empty())
    fail(errc::invalid_metadata,
         x.header.file + ": '" + x.values.front().name + "'" +
             (x.values.size() > 1 ? " (and " + std::to_string(x.values.size() - 1) + " more values)" : std::string()) +
             " is not a tensor: a Hugging Face folder's torch.save file holds tensors only (a state dict, "
             "nested dicts and lists of tensors); a training checkpoint with other values is read as a file "
             "of its own");
  return std::move(x.header);
}

}  // namespace shardsafe
