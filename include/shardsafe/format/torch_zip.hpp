// shardsafe/format/torch_zip.hpp - the storage record of one torch.save archive (a zip), as each
// chunk of a torch DCP `.distcp` file is (docs/FORMAT.md §5, issue 11).
//
// torch.save writes a zip of `PREFIX/data.pkl` (the pickled tensor), `PREFIX/data/KEY` (the
// storage bytes, stored, not compressed) and `PREFIX/version` (newer torch adds a few more
// records). The storage is found the way a zip reader does: the end-of-central-directory record
// (zip64 too), the central directory, then the record's local header, whose name and extra field
// give where its bytes start. Only the ranges needed are read, through `read_at(offset, n)`, so
// a reader of a large chunk never reads its data to find it.
//
// Rules (errc::invalid_metadata, naming the archive, the record and the rule):
//   - an end-of-central-directory record whose central directory lies inside the archive, with
//     at most 1024 records;
//   - exactly one record named `*/data/*`; it is stored (method 0), not encrypted, its sizes
//     agree, its local header carries the same name, and its bytes end before the central
//     directory; when the caller knows the chunk's bytes, the record holds exactly that many;
//   - data.pkl (read by torch_zip_tensor_info through an allowlist: torch._utils._rebuild_tensor_v2
//     and _v3 (torch 2.x's float8 and wide unsigned types: an UntypedStorage and the dtype),
//     torch.<T>Storage, torch.storage.UntypedStorage, torch.<dtype>, collections.OrderedDict) describes a tensor at storage offset 0,
//     dense (row-major, or its dimensions stored in another order: channels_last, transposed),
//     whose storage is the record.
//
// The zip records are read by format/zip_directory.hpp, data.pkl through
// format/torch_tensor_pickle.hpp's allowlist; this header locates an archive's records
// (locate_torch_zip) and checks its tensor against them (check_torch_zip_tensor).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/dtype.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/format/dcp_unpickler.hpp"
#include "shardsafe/format/pickle_reader.hpp"
#include "shardsafe/format/torch_tensor_pickle.hpp"
#include "shardsafe/format/zip_directory.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The records of a torch.save archive that a reader needs.
struct torch_zip_archive {
  torch_zip_record storage;                ///< PREFIX/data/KEY
  std::optional<torch_zip_record> pickle;  ///< PREFIX/data.pkl, when present and stored
};

/// The expected_size of an archive of a pickled value (a DCP non-tensor item: torch.save(obj)
/// with no tensor), which holds data.pkl and no storage record.
inline constexpr std::uint64_t torch_zip_value = UINT64_MAX;

/// Locates the storage record of a torch.save archive of `length` bytes read through
/// `read_at(offset, n)` (returning a std::string of exactly n bytes at that offset of the
/// archive); `what` names the archive in messages ("ckpt/__0_0.distcp [0, 747)").
/// With `expected_size`, the record must hold exactly that many bytes (numel x item size); with
/// torch_zip_value, the archive must hold a pickled value (no storage record; then only
/// `pickle` is set).
template <class ReadAt>
torch_zip_archive locate_torch_zip(std::uint64_t length, ReadAt&& read_at, std::string_view what,
                                   std::optional<std::uint64_t> expected_size = std::nullopt) {
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, std::string(what) + ": " + rule); };
  const detail::zip_directory dir =
      detail::read_zip_directory(length, read_at, bad, 1024, 1 << 20, "a torch.save archive of one value");
  const std::vector<detail::zip_entry>& all = dir.entries;
  const std::uint64_t cd_at = dir.at;
  auto place = [&](const detail::zip_entry& e) { return detail::place_zip_record(e, cd_at, read_at, bad); };

  torch_zip_archive out;
  std::vector<const detail::zip_entry*> storages;
  for (const auto& e : all) {
    const auto d = e.name.find("/data/");
    if (d == std::string::npos || d == 0 || e.name.find('/', d + 6) != std::string::npos || e.name.size() == d + 6)
      continue;
    storages.push_back(&e);
  }
  if (expected_size == torch_zip_value) {  // a pickled value: PREFIX/data.pkl alone
    if (!storages.empty())
      bad("holds " + std::to_string(storages.size()) + " storage record" + (storages.size() > 1 ? "s" : "") + " ('" +
          storages.front()->name + "'" + (storages.size() > 1 ? ", ..." : "") +
          "): a non-tensor item whose value holds tensors, which only torch can unpickle (torch 1.13 saves a nested "
          "dict, "
          "and torch 2.x one saved with flatten_state_dict=False, as such an item): shardsafe reads tensors from a DCP "
          "folder's tensor entries only; save the state dict flattened");
    const detail::zip_entry* pkl = nullptr;
    for (const auto& e : all)
      if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) {
        if (pkl) bad("holds two pickles, '" + pkl->name + "' and '" + e.name + "'");
        pkl = &e;
      }
    if (!pkl) bad("holds no PREFIX/data.pkl");
    out.pickle = place(*pkl);
    return out;
  }
  if (storages.size() > 1)
    bad("holds two storage records, '" + storages[0]->name + "' and '" + storages[1]->name +
        "' (a DCP chunk holds one tensor)");
  if (storages.empty()) bad("holds no storage record (PREFIX/data/KEY)");
  const detail::zip_entry* storage = storages.front();
  out.storage = place(*storage);
  if (expected_size && out.storage.size != *expected_size)
    bad("record '" + out.storage.name + "' holds " + std::to_string(out.storage.size) + " bytes but the chunk needs " +
        std::to_string(*expected_size));
  const std::string pkl = storage->name.substr(0, storage->name.find("/data/")) + "/data.pkl";
  for (const auto& e : all)
    if (e.name == pkl) out.pickle = place(e);
  return out;
}

/// The same, on an archive held in memory.
inline torch_zip_archive locate_torch_zip(std::string_view archive, std::string_view what,
                                          std::optional<std::uint64_t> expected_size = std::nullopt) {
  return locate_torch_zip(
      archive.size(),
      [&](std::uint64_t off, std::size_t n) { return std::string(archive.substr(static_cast<std::size_t>(off), n)); },
      what, expected_size);
}

/// The order t's dimensions are stored in, outermost first, when it is dense (its elements fill
/// numel consecutive elements of its storage) but not row-major: each dimension's stride is the
/// product of the sizes stored inside it (torch.save keeps a channels_last or transposed
/// tensor's strides). Empty for row-major. Dimensions of size 1 come first in such an order
/// (where they lie does not move a byte). `bad` throws naming the rule.
template <class Bad>
std::vector<std::size_t> dense_stored_order(const torch_zip_tensor& t, std::uint64_t n, Bad&& bad) {
  if (t.stride.size() != t.size.size())
    bad("stride " + to_string(t.stride) + " has another rank than size " + to_string(t.size));
  // the dimensions of size > 1 by decreasing stride (no two are equal in a dense layout), each
  // stride the product of the sizes after it in that order
  std::vector<std::size_t> order, ones;
  for (std::size_t d = 0; d < t.size.size(); ++d) (t.size[d] > 1 ? order : ones).push_back(d);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return t.stride[a] > t.stride[b]; });
  std::uint64_t dense = 1;
  for (std::size_t i = order.size(); n != 0 && i-- > 0;) {
    if (t.stride[order[i]] != dense)
      bad("stride " + to_string(t.stride) + " is not dense for size " + to_string(t.size) +
          " (a tensor read here fills its bytes in some order of its dimensions, each stride the product of the sizes "
          "stored inside it)");
    dense *= t.size[order[i]];
  }
  std::vector<std::size_t> stored;
  if (n != 0 && !std::is_sorted(order.begin(), order.end())) {
    stored = std::move(ones);
    stored.insert(stored.end(), order.begin(), order.end());
  }
  return stored;
}

/// Checks that data.pkl's tensor is the DCP chunk `sizes` of dtype `type` stored whole and dense
/// from the first byte of `storage`: the rules at the top, named in the message. Returns the
/// order its dimensions are stored in, outermost first, when it is not row-major (torch.save
/// keeps a channels_last or transposed tensor's strides: each dimension's stride is then the
/// product of the sizes stored inside it); empty for row-major. Dimensions of size 1 come first
/// in such an order (where they lie does not move a byte).
inline std::vector<std::size_t> check_torch_zip_tensor(const torch_zip_tensor& t, const torch_zip_record& storage,
                                                       dtype type, const std::vector<std::uint64_t>& sizes,
                                                       std::string_view what) {
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, std::string(what) + ": data.pkl: " + rule); };
  if (!storage.name.ends_with("/data/" + t.storage_key))
    bad("tensor's storage '" + t.storage_key + "' is not the record '" + storage.name + "'");
  if (t.type && *t.type != type)
    bad("storage holds " + std::string(to_string(*t.type)) + " but .metadata says " + std::string(to_string(type)));
  if (t.view_type && *t.view_type != type)
    bad("tensor is " + std::string(to_string(*t.view_type)) + " but .metadata says " + std::string(to_string(type)));
  if (t.storage_offset != 0) bad("storage offset " + std::to_string(t.storage_offset) + " is not 0");
  if (t.size != sizes) bad("size " + to_string(t.size) + " is not the chunk's sizes " + to_string(sizes));
  const auto n = detail::checked_numel(t.size);
  if (!n) bad("size " + to_string(t.size) + " overflows");
  std::vector<std::size_t> stored = dense_stored_order(t, *n, bad);
  const std::uint64_t item = t.type ? item_size(*t.type) : 1;
  const auto bytes = detail::checked_mul(t.storage_numel, item);
  if (!bytes || *bytes != storage.size)
    bad("storage of " + std::to_string(t.storage_numel) + " elements is not the " + std::to_string(storage.size) +
        " bytes of '" + storage.name + "'");
  const auto need = detail::checked_mul(*n, item_size(type));
  if (!need || *need != storage.size)
    bad("record '" + storage.name + "' holds " + std::to_string(storage.size) + " bytes, not the chunk's " +
        to_string(sizes) + " " + std::string(to_string(type)));
  return stored;
}

}  // namespace shardsafe
