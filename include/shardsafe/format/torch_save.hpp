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
//     headers), at most 2^20 records, its central directory at most 256 MiB; one
//     PREFIX/data.pkl, at most 64 MiB; PREFIX/byteorder, when present, says "little"; every
//     tensor's storage is a record PREFIX/data/KEY holding its storage's bytes;
//   - the legacy format: its pickles (protocol 2 as torch writes them by default, or 3 to 5)
//     end within the file's first 64 MiB; the protocol version is 1001; sys_info does not say
//     big-endian; no storage is a view (view_metadata None); the storage list holds at most
//     2^20 distinct str keys, each named in the pickle, and every tensor's storage is listed;
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
//
// Reads: the archive's last KiB and its central directory, the local header of data.pkl, of
// byteorder and of each storage a tensor uses (in the archive's order: one read for a record of
// 64 KiB or more, one 64 KiB window for small ones that lie together), data.pkl. The legacy format: the
// file's first MiB (more while the pickles run on), each storage's size (64 KiB at a time). No
// tensor data.
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
#include "shardsafe/format/torch_zip.hpp"
#include "shardsafe/storage/concepts.hpp"

namespace shardsafe {

/// The largest data.pkl of a state dict read (torch pickles a tensor in about 150 bytes: a
/// million tensors fit).
inline constexpr std::uint64_t max_torch_save_pickle = std::uint64_t(64) << 20;

/// What a torch.save file in the legacy format (torch < 1.6, or
/// _use_new_zipfile_serialization=False) begins with, after PROTO (and, from protocol 4 on, a
/// FRAME): its pickled magic number, LONG1 of 0x1950a86a20f9469cfc6c.
inline constexpr std::string_view torch_save_legacy_magic("\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 12);

/// The bytes of the legacy format's first pickle (the magic number, with PROTO 2 to 5, a FRAME
/// where protocol 4 or 5 writes one, and STOP) when b begins with it, else 0: at most 24 bytes
/// are looked at.
inline std::size_t torch_save_legacy_magic_size(std::string_view b) {
  if (b.size() < 2 || b[0] != '\x80' || b[1] < 2 || b[1] > 5) return 0;
  std::size_t at = 2;
  if (b.size() > at && b[at] == '\x95') at += 9;  // FRAME and its 8-byte length (index_torch_save_legacy checks it)
  if (b.size() < at + torch_save_legacy_magic.size() + 1 || b.substr(at, torch_save_legacy_magic.size()) != torch_save_legacy_magic ||
      b[at + torch_save_legacy_magic.size()] != '.')
    return 0;
  return at + torch_save_legacy_magic.size() + 1;
}

/// A value of a torch.save file that is not a tensor (an epoch counter, an optimizer's
/// hyper-parameters), as torch.distributed.checkpoint would keep it: one value per item.
struct torch_save_value {
  std::string name;    ///< its flattened name
  pickle_value value;  ///< what the pickle holds (a torch global as {"__global__": NAME}, a storage as a sealed dict)
  /// Why it is not pickled again here, or "" when it is (plain data: None, bool, int, float,
  /// str, lists, tuples, dicts): it holds a storage or a torch global (a dtype), or shares
  /// containers that would pickle to over max_torch_save_pickle bytes written out without a memo.
  std::string unwritable;
};

/// What a torch.save state dict's data.pkl holds: its tensors by flattened name, in pickle
/// order, and its other values.
struct torch_state_dict_pickle {
  std::vector<std::pair<std::string, torch_zip_tensor>> tensors;
  std::map<std::string, torch_storage_id, std::less<>> storages;  ///< every storage its persistent ids name, by key
  std::vector<torch_save_value> values;  ///< the values that are not tensors, in pickle order
  /// Where each tensor and value sits in the nested dict (("model", "layers.0.weight"): dict keys
  /// as str, list indices as int), for those whose path is not just (name,).
  std::map<std::string, pickle_value> paths;
};

namespace detail {

/// The state dict a torch.save pickle's value `root` holds, flattened (rules at the top);
/// `pickle_bytes` is the pickle's size (what bounds the values and names), `w` names it.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL torch_state_dict_pickle flatten_torch_state_dict(pickle_view root, std::size_t pickle_bytes, const std::string& w) {
  using k = pickle_value::kind;
  torch_state_dict_pickle out;
  if (root.type() != k::dict)
    fail(errc::invalid_metadata, w + ": holds a " + pickle_value::kind_name(root.type()) + ", not a state dict (a dict of tensors)");
  auto is_tensor = [](const pickle_view& v) {
    const auto t = v.find(torch_tensor_key);
    return t && t->find(torch_storage_key).has_value();
  };
  auto is_storage = [](const pickle_view& v) { return v.find(torch_storage_key).has_value(); };
  auto is_marker = [](const pickle_view& v) {
    return v.type() == k::dict && v.size() == 1 && v.find(dcp_unpickle_policy::global_key).has_value();
  };
  // a dict of the state dict's own (a tensor's, a storage's and a global's dicts are not)
  auto is_mapping = [&](const pickle_view& v) { return v.type() == k::dict && !is_tensor(v) && !is_storage(v) && !is_marker(v); };
  // The memo lets one value (a long key, a tensor) stand at many places for a few bytes each:
  // the values flattened and their names' bytes are bounded by the pickle's size (torch writes
  // about 150 bytes a tensor), checked before a name is made.
  const std::uint64_t max_values = pickle_bytes / 8 + 1024, max_name_bytes = 4 * std::uint64_t(pickle_bytes) + (1 << 20);
  std::uint64_t values = 0, name_bytes = 0;
  auto leaf = [&](const std::string& name) {
    if (++values > max_values)
      fail(errc::invalid_metadata, w + ": holds more than " + std::to_string(max_values) + " values (" + std::to_string(pickle_bytes) +
                                       " bytes of pickle; torch writes about 150 bytes a tensor)");
    name_bytes += name.size();
  };
  auto child = [&](const std::string& name, std::string_view part) {
    if (name_bytes + name.size() + 1 + part.size() > max_name_bytes)
      fail(errc::invalid_metadata, w + ": its flattened names pass " + std::to_string(max_name_bytes) +
                                       " bytes, 4x the pickle's size (one key repeated through the memo?)");
    return name.empty() ? std::string(part) : name + "." + std::string(part);
  };
  // What a container holds, found once per container (the memo shares them): a tensor anywhere
  // in it; whether torch.distributed.checkpoint keeps it as one item (a list is, when none of
  // its items is a tensor, a dict or a list that is not; a tuple always is; a dict never); a
  // storage or a torch global anywhere in it (a value not pickled again here); about how many
  // bytes it pickles to written out without a memo, and how many values a reader bounds it by
  // (pickle_string_cost; both saturating: shared containers repeat).
  struct traits {
    bool tensor = false, whole = true, foreign = false;
    std::uint64_t bytes = 0, cost = 1;
  };
  constexpr std::uint64_t saturated = std::uint64_t(1) << 62;
  std::unordered_map<const void*, traits> seen;
  auto scan = [&](auto& self, const pickle_view& v) -> traits {
    if (is_tensor(v)) return {true, false, false, 0, 1};
    if (is_storage(v) || is_marker(v)) return {false, true, true, 0, 1};
    if (v.type() == k::string) {
      const std::size_t n = v.as_string("").size();
      return {false, true, false, 5 + n, pickle_string_cost(n)};
    }
    if (v.type() != k::dict && !v.is_sequence()) return {false, true, false, 10, 1};
    if (const auto it = seen.find(v.id()); it != seen.end()) return it->second;
    traits t;
    t.whole = v.type() != k::dict;
    t.bytes = 2 + 2 * (v.size() / 1000 + 1);
    for (std::size_t i = 0; i < v.size(); ++i) {
      const pickle_view x = v.type() == k::dict ? v.value(i) : v.item(i);
      const traits c = self(self, x);
      const traits key = v.type() == k::dict ? self(self, v.key(i)) : traits{false, true, false, 0, 0};
      t.tensor |= c.tensor;
      t.foreign |= c.foreign;
      t.bytes = std::min(saturated, t.bytes + c.bytes + key.bytes);
      t.cost = std::min(saturated, t.cost + c.cost + key.cost);
      if (v.type() == k::list && (c.tensor || is_mapping(x) || (x.type() == k::list && !c.whole)))
        t.whole = false;
    }
    return seen[v.id()] = t;
  };
  pickle_view::build_cache built;  // the values' containers, each copied once however many values share it
  std::vector<pickle_value> path;
  auto record_path = [&](const std::string& name) {
    if (path.size() != 1 || path.front().type() != k::string) out.paths.emplace(name, pickle_value::tuple(path));
  };
  auto walk = [&](auto& self, const pickle_view& v, const std::string& name) -> void {
    if (is_tensor(v)) {
      leaf(name);
      out.tensors.emplace_back(name, torch_tensor_of(v.build(), w + ": tensor '" + name + "'"));
      record_path(name);
      return;
    }
    const bool dict = is_mapping(v);
    const traits t = dict ? traits{false, false, false} : scan(scan, v);
    if (dict) {
      const std::string where = name.empty() ? std::string("the state dict") : "'" + name + "'";
      // Python merges keys that compare equal (1, True and 1.0; 0, False, 0.0 and -0.0) into one
      // entry, where their names here differ: such a dict is refused
      std::set<std::pair<bool, std::int64_t>> numbers;  // (not integral, the int or the double's bits)
      for (std::size_t i = 0; i < v.size(); ++i) {
        const pickle_view key = v.key(i);
        std::string part;
        if (key.type() == k::string) part = std::string(key.as_string(""));
        else if (key.type() == k::integer) part = std::to_string(key.as_int(""));
        else if (key.type() == k::boolean || key.type() == k::none || key.type() == k::real)
          part = pickle_repr(key.build(), 64);  // Python's str() of it, as DCP's path holds: "True", "None", "0.5"
        else
          fail(errc::invalid_metadata, w + ": " + where + " has a key of type " + pickle_value::kind_name(key.type()) +
                                           " (keys are str, int, bool, float or None)");
        if (key.type() == k::integer || key.type() == k::boolean || key.type() == k::real) {
          std::pair<bool, std::int64_t> n{false, 0};
          const double d = key.type() == k::real ? key.as_real("") : 0;
          if (key.type() == k::integer) n.second = key.as_int("");
          else if (key.type() == k::boolean) n.second = key.as_bool("") ? 1 : 0;
          else if (d == std::trunc(d) && d >= -0x1p63 && d < 0x1p63) n.second = static_cast<std::int64_t>(d);
          else n = {true, std::bit_cast<std::int64_t>(d)};
          if (d == d && !numbers.insert(n).second)  // NaN equals no key, not even another NaN
            fail(errc::invalid_metadata, w + ": " + where + " has two keys Python holds equal (1, True and 1.0 are one key), the second '" +
                                             part + "': torch.load keeps one entry of them");
        }
        path.push_back(pickle_value::string(part));  // torch.distributed.checkpoint's path holds str(key)
        self(self, v.value(i), child(name, part));
        path.pop_back();
      }
    } else if (v.is_sequence() && (t.tensor || !t.whole)) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        path.push_back(pickle_value::integer(static_cast<std::int64_t>(i)));
        self(self, v.item(i), child(name, std::to_string(i)));
        path.pop_back();
      }
    } else {
      leaf(name);
      // written again (to-dcp), a value must read back here: its archive within the 64 MiB of a
      // DCP item (a few KiB of zip headers aside), its values within pickle_loads' bound
      std::string unwritable;
      if (t.foreign) unwritable = "holds a storage or a torch global (a dtype, a storage class), which shardsafe does not pickle again";
      else if (t.bytes > max_torch_save_pickle - (std::uint64_t(1) << 16) || t.cost > basic_pickle_reader<>::default_max_values)
        unwritable = "shares containers that pickle to over " + std::to_string(t.bytes) + " bytes (" + std::to_string(t.cost) +
                     " values) written out without a memo";
      out.values.push_back({name, v.build(built), std::move(unwritable)});
      record_path(name);
    }
  };
  walk(walk, root, "");
  return out;
}
#else
SHARDSAFE_DECL torch_state_dict_pickle flatten_torch_state_dict(pickle_view root, std::size_t pickle_bytes, const std::string& w);
#endif

/// The reader of a state dict's pickle: the values it may make are bounded by its size; every
/// storage it names is recorded in `storages` (torch_tensor_pickle_policy::storages).
inline basic_pickle_reader<torch_tensor_pickle_policy> state_dict_pickle_reader(std::string_view bytes, const std::string& w, bool legacy,
                                                                                std::map<std::string, torch_storage_id, std::less<>>& storages) {
  using reader = basic_pickle_reader<torch_tensor_pickle_policy>;
  return reader(bytes, w, torch_tensor_pickle_policy{true, legacy, &storages}, std::max<std::size_t>(reader::default_max_values, bytes.size()));
}

}  // namespace detail

/// Reads a torch.save data.pkl holding a state dict (rules at the top); `what` names it.
inline torch_state_dict_pickle parse_torch_state_dict_pickle(std::string_view bytes, std::string_view what) {
  const std::string w(what);
  std::map<std::string, torch_storage_id, std::less<>> storages;
  auto reader = detail::state_dict_pickle_reader(bytes, w, false, storages);
  torch_state_dict_pickle out = reader.run([&](pickle_view root) { return detail::flatten_torch_state_dict(root, bytes.size(), w); });
  out.storages = std::move(storages);
  return out;
}

/// The index of a torch.save file of a state dict and its values that are not tensors.
struct torch_save_index {
  safetensors_header header;             ///< every tensor, at its absolute offset in the file (of_records)
  std::vector<torch_save_value> values;  ///< the values that are not tensors, by name
  std::map<std::string, pickle_value> paths;  ///< torch_state_dict_pickle::paths
};

namespace detail {

/// The index of a state dict's tensors, each over the storage record storage_of(key, tbad)
/// gives (tbad throws naming the tensor): the rules of a tensor inside its storage.
template <class StorageOf>
torch_save_index index_state_dict_tensors(const std::string& file, std::uint64_t file_size, torch_state_dict_pickle sd,
                                          StorageOf&& storage_of) {
  std::vector<tensor_entry> entries;
  std::map<std::string, std::vector<std::size_t>, std::less<>> orders;
  entries.reserve(sd.tensors.size());
  for (auto& [key, t] : sd.tensors) {
    const std::string ctx = "tensor '" + key + "'";
    auto tbad = [&](const std::string& rule) { fail(errc::invalid_metadata, file + ": " + ctx + ": " + rule); };
    const torch_zip_record& rec = storage_of(t.storage_key, tbad);
    if (!t.type && !t.view_type) tbad("an untyped storage without a dtype");
    const dtype type = t.view_type ? *t.view_type : *t.type;
    const std::uint64_t item = item_size(type);
    const auto storage_bytes = detail::checked_mul(t.storage_numel, t.type ? item_size(*t.type) : 1);
    if (!storage_bytes || *storage_bytes != rec.size)
      tbad("storage of " + std::to_string(t.storage_numel) + " elements is not the " + std::to_string(rec.size) + " bytes of '" + rec.name + "'");
    const auto n = detail::checked_numel(t.size);
    if (!n) tbad("size " + to_string(t.size) + " overflows");
    std::vector<std::size_t> order = dense_stored_order(t, *n, tbad);
    const auto at = detail::checked_mul(t.storage_offset, item);
    const auto bytes = detail::checked_mul(*n, item);
    const auto end = at && bytes ? detail::checked_add(*at, *bytes) : std::nullopt;
    if (!end || (*n != 0 && *end > rec.size))
      tbad("elements [" + std::to_string(t.storage_offset) + ", +" + std::to_string(*n) + ") of " + std::string(name(type)) +
           " pass the end of its storage '" + rec.name + "' (" + std::to_string(rec.size) + " bytes)");
    tensor_entry e;
    e.name = key;
    e.type = type;
    e.shape = t.size;
    e.begin = rec.data_offset + (*n == 0 ? 0 : *at);
    e.end = e.begin + *bytes;
    if (!order.empty()) orders.emplace(key, std::move(order));
    entries.push_back(std::move(e));
  }
  torch_save_index x{safetensors_header::of_records(file, file_size, std::move(entries), std::move(orders)), std::move(sd.values),
                     std::move(sd.paths)};
  // a value's name is no tensor's or other value's either (torch.distributed.checkpoint refuses
  // such a dict: "duplicated flatten key")
  std::sort(x.values.begin(), x.values.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < x.values.size(); ++i)
    if ((i > 0 && x.values[i - 1].name == x.values[i].name) || x.header.find(x.values[i].name))
      fail(errc::invalid_metadata, file + ": the flattened name '" + x.values[i].name + "' is given twice");
  return x;
}

/// Whether Python's tarfile takes b, 512 bytes, as a tar header: its checksum field, read as
/// tarfile reads it, equals the sum of its bytes (unsigned or signed) with that field as spaces.
inline bool passes_tar_checksum(std::string_view b) {
  if (b.size() != 512 || b.find_first_not_of('\0') == std::string_view::npos) return false;
  std::int64_t sum_u = 256, sum_s = 256;
  for (std::size_t i = 0; i < 512; ++i)
    if (i < 148 || i >= 156) {
      sum_u += static_cast<unsigned char>(b[i]);
      sum_s += static_cast<signed char>(b[i]);
    }
  const std::string_view f = b.substr(148, 8);
  std::int64_t n = 0;
  if (f[0] == '\x80' || f[0] == '\xff') {  // base-256
    for (std::size_t i = 1; i < 8; ++i) n = (n << 8) | static_cast<unsigned char>(f[i]);
    if (f[0] == '\xff') n -= std::int64_t(1) << 56;
  } else {  // octal text up to a NUL, blanks around it; int(s, 8) also takes a sign, 0o and _
    std::string_view t = f.substr(0, f.find('\0'));
    while (!t.empty() && std::string_view(" \t\n\r\v\f").find(t.front()) != std::string_view::npos) t.remove_prefix(1);
    while (!t.empty() && std::string_view(" \t\n\r\v\f").find(t.back()) != std::string_view::npos) t.remove_suffix(1);
    bool neg = false;
    if (!t.empty() && (t[0] == '+' || t[0] == '-')) {
      neg = t[0] == '-';
      t.remove_prefix(1);
    }
    if (t.size() >= 2 && t[0] == '0' && (t[1] == 'o' || t[1] == 'O')) t.remove_prefix(2);
    bool digit = false;
    for (const char ch : t) {
      if (ch == '_') continue;
      if (ch < '0' || ch > '7') return false;
      n = n * 8 + (ch - '0');
      digit = true;
    }
    if (!digit && !t.empty()) return false;
    if (neg) n = -n;
  }
  return n == sum_u || n == sum_s;
}

/// The legacy format (rules at the top): five pickles, then each storage in the order the
/// last lists them, an int64 of its elements before its bytes.
template <ReadableStorage S>
torch_save_index index_torch_save_legacy(const S& st) {
  const std::string file(st.name());
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, file + ": " + rule); };
  auto read_at = [&](std::uint64_t off, std::size_t n) { return detail::read_string(st, off, n); };
  // torch.load tries torch < 0.4's tar format first, on a file whose first block tarfile takes
  // as a tar header, and then reads no pickle of this stream
  if (st.size() >= 512 && passes_tar_checksum(read_at(0, 512)))
    bad("its first 512 bytes are also a tar header, which torch.load reads first (the tar format of torch < 0.4): not read here");
  struct pickles {
    torch_state_dict_pickle sd;
    std::vector<std::string> keys;  // the storages, in the order their bytes follow
    std::uint64_t data = 0;         // where the first storage's size is
  };
  // The pickles are read from a window of the file's head, 1 MiB first, 8x larger while they
  // run past its end, up to max_torch_save_pickle.
  const std::uint64_t limit = std::min<std::uint64_t>(st.size(), max_torch_save_pickle);
  auto read_pickles = [&](std::string_view b, bool& ran_out) {
    pickles out;
    std::size_t at = torch_save_legacy_magic_size(b);
    if (at == 0) bad("does not begin with the legacy format's magic number");
    // Python reads a FRAME whole: one longer than the 13 bytes to STOP would hide the start of
    // the next pickle from torch (the reader checks the later pickles' frames itself)
    if (at > 15 && b.substr(3, 8) != std::string_view("\x0d\0\0\0\0\0\0\0", 8))
      bad("the magic number's pickle lies in a FRAME of " + std::to_string(zip_le(b, 3, 8)) + " bytes, not 13 (Python would skip the rest of it)");
    auto next = [&](auto& reader, auto&& f) {
      try {
        auto v = reader.run(f);
        at += reader.consumed();
        return v;
      } catch (const shardsafe::error&) {
        ran_out = reader.ran_out();
        throw;
      }
    };
    auto plain = [&](const char* what) {
      // a value of the storage list's 2^20 keys is the named rule's to refuse
      pickle_reader r(b.substr(at), file + ": " + what, {}, std::size_t(1) << 21);
      return next(r, [](pickle_view v) { return v.build(); });
    };
    const pickle_value version = plain("protocol version");
    if (version != pickle_value::integer(1001))
      bad("protocol version " + (version.type() == pickle_value::kind::integer ? std::to_string(version.as_int("")) : std::string("?")) +
          " is not 1001 (torch.save's legacy format)");
    const pickle_value info = plain("sys_info");
    if (const auto* le = info.find("little_endian"); le && *le == pickle_value::boolean(false))
      bad("was written on a big-endian machine (sys_info little_endian False); only little-endian files are read");
    const std::string w = file + ": state dict";  // "FILE: state dict: pickle <rule>"
    std::map<std::string, torch_storage_id, std::less<>> ids;
    auto reader = state_dict_pickle_reader(b.substr(at), w, true, ids);
    out.sd = next(reader, [&](pickle_view root) { return flatten_torch_state_dict(root, reader.consumed(), w); });
    out.sd.storages = std::move(ids);
    const pickle_value keys = plain("storage keys");
    if (keys.type() != pickle_value::kind::list) bad("its storage keys are a " + std::string(pickle_value::kind_name(keys.type())) + ", not a list");
    const auto& ks = keys.as_sequence("");
    if (ks.size() > (std::size_t(1) << 20)) bad("lists " + std::to_string(ks.size()) + " storages (at most 2^20 are read)");
    for (const auto& k : ks) {
      if (k.type() != pickle_value::kind::string) bad("a storage key is a " + std::string(pickle_value::kind_name(k.type())) + ", not a str");
      out.keys.push_back(k.as_string(""));
    }
    out.data = at;
    return out;
  };
  pickles p;
  for (std::uint64_t window = std::min<std::uint64_t>(limit, std::uint64_t(1) << 20);; window = std::min(limit, window * 8)) {
    const std::string b = read_at(0, static_cast<std::size_t>(window));
    bool ran_out = false;
    try {
      p = read_pickles(b, ran_out);
      break;
    } catch (const shardsafe::error&) {
      if (!ran_out || window == st.size()) throw;
      if (window == limit)
        bad("its pickles run past the first " + std::to_string(limit) + " bytes (at most " + std::to_string(max_torch_save_pickle) +
            " bytes of pickle are read)");
    }
  }
  // each storage's bytes, in the listed order: its elements of the type its first persistent id
  // gives (where it stands: torch reads every listed storage, a tensor's or not)
  std::map<std::string, torch_zip_record, std::less<>> storages;
  read_window<decltype(read_at)> sizes{read_at, {}, 0};  // 64 KiB at a time: small storages lie close together
  std::uint64_t pos = p.data;
  for (const std::string& key : p.keys) {
    const std::string rec = "storage '" + key + "'";
    const auto id = p.sd.storages.find(key);
    if (id == p.sd.storages.end()) bad(rec + " of the storage list is named nowhere in the pickle");
    const auto type = torch_tensor_pickle_policy::storage_type_of(id->second.type);
    if (!type) bad(rec + ": its type '" + id->second.type + "' is not a torch storage class");
    const std::uint64_t item = *type ? item_size(**type) : 1;
    if (st.size() - pos < 8) bad(rec + ": its size at byte " + std::to_string(pos) + " runs past the file's end (truncated?)");
    const std::uint64_t numel = zip_le(sizes(pos, 8, st.size()), 0, 8);
    if (numel != id->second.numel)
      bad(rec + ": the file says " + std::to_string(numel) + " elements at byte " + std::to_string(pos) + " but its persistent id says " +
          std::to_string(id->second.numel));
    const auto bytes = checked_mul(numel, item);
    if (!bytes || *bytes > st.size() - pos - 8)
      bad(rec + ": its " + std::to_string(numel) + " elements at byte " + std::to_string(pos + 8) + " run past the file's end (" +
          std::to_string(st.size()) + " bytes: truncated?)");
    if (!storages.try_emplace(key, torch_zip_record{rec, pos + 8, *bytes}).second) bad(rec + " is listed twice");
    pos += 8 + *bytes;
  }
  return index_state_dict_tensors(file, st.size(), std::move(p.sd), [&](const std::string& key, auto& tbad) -> const torch_zip_record& {
    const auto s = storages.find(key);
    if (s == storages.end()) tbad("its storage '" + key + "' is not in the file's storage list");
    return s->second;
  });
}

}  // namespace detail

/// Indexes the torch.save file st (rules at the top): every tensor's byte range and layout,
/// reading only the archive's directory, local headers and data.pkl (the legacy format: its
/// pickles and each storage's size).
template <ReadableStorage S>
torch_save_index index_torch_save_file(const S& st) {
  const std::string file(st.name());
  auto bad = [&](const std::string& rule) { fail(errc::invalid_metadata, file + ": " + rule); };
  auto read_at = [&](std::uint64_t off, std::size_t n) { return detail::read_string(st, off, n); };
  if (torch_save_legacy_magic_size(read_at(0, static_cast<std::size_t>(std::min<std::uint64_t>(st.size(), 24)))) != 0)
    return detail::index_torch_save_legacy(st);
  const detail::zip_directory dir =
      detail::read_zip_directory(st.size(), read_at, bad, std::uint64_t(1) << 20, std::uint64_t(256) << 20, "a torch.save file");
  const detail::zip_entry* pkl = nullptr;
  for (const auto& e : dir.entries)
    if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) {
      if (pkl) bad("holds two pickles, '" + pkl->name + "' and '" + e.name + "' (not a torch.save file)");
      pkl = &e;
    }
  if (!pkl) bad("holds no PREFIX/data.pkl: not a torch.save file (zip format)");
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - 8);  // "PREFIX/"
  std::map<std::string, const detail::zip_entry*, std::less<>> storages;  // KEY -> record
  for (const auto& e : dir.entries) {
    if (e.name == prefix + "byteorder") {
      const torch_zip_record r = detail::place_zip_record(e, dir.at, read_at, bad);
      const std::string order = r.size <= 16 ? read_at(r.data_offset, static_cast<std::size_t>(r.size)) : std::string("?");
      if (order != "little") bad("record '" + e.name + "' says the storages are '" + order + "' endian; only little-endian files are read");
    }
    if (e.name.starts_with(prefix + "data/") && e.name.size() > prefix.size() + 5)
      storages.emplace(e.name.substr(prefix.size() + 5), &e);
  }
  const torch_zip_record p = detail::place_zip_record(*pkl, dir.at, read_at, bad);
  if (p.size > max_torch_save_pickle)
    bad("data.pkl of " + std::to_string(p.size) + " bytes is larger than " + std::to_string(max_torch_save_pickle));
  torch_state_dict_pickle sd = parse_torch_state_dict_pickle(read_at(p.data_offset, static_cast<std::size_t>(p.size)), file + ": data.pkl");
  // The storages the tensors use, placed in the archive's order through a 64 KiB window: a
  // small record's successor lies in the same window (40,000 storages of 64 bytes: 117 reads in
  // all, not 40,000 requests over HTTP); a large record's header is read alone.
  std::vector<const detail::zip_entry*> used;
  for (const auto& id : sd.storages)
    if (const auto s = storages.find(id.first); s != storages.end()) used.push_back(s->second);
  std::sort(used.begin(), used.end(), [](const detail::zip_entry* a, const detail::zip_entry* b) { return a->local < b->local; });
  detail::read_window<decltype(read_at)> headers{read_at, {}, 0};
  bool small = false;
  auto header_read = [&](std::uint64_t off, std::size_t n) { return headers(off, n, dir.at, small); };
  std::map<std::string_view, torch_zip_record> placed;
  for (const detail::zip_entry* e : used) {
    small = e->usize < (64 << 10);
    placed.emplace(std::string_view(e->name).substr(prefix.size() + 5), detail::place_zip_record(*e, dir.at, header_read, bad));
  }
  const auto ids = std::move(sd.storages);
  torch_save_index x =
      detail::index_state_dict_tensors(file, st.size(), std::move(sd), [&](const std::string& key, auto& tbad) -> const torch_zip_record& {
        const auto pl = placed.find(key);
        if (pl == placed.end()) tbad("its storage '" + key + "' has no record '" + prefix + "data/" + key + "'");
        return pl->second;
      });
  // a persistent id no tensor holds still makes torch load its storage: without its record, or
  // with one of another size, torch.load refuses the file
  for (const auto& [key, id] : ids) {
    const auto pl = placed.find(key);
    const auto type = torch_tensor_pickle_policy::storage_type_of(id.type);
    const auto bytes = type ? detail::checked_mul(id.numel, *type ? item_size(**type) : 1) : std::nullopt;
    if (pl == placed.end() || !bytes || *bytes != pl->second.size)
      bad("storage '" + key + "' (its persistent id at byte " + std::to_string(id.at) + " of data.pkl: " + std::to_string(id.numel) + " of " +
          id.type + ") has " + (pl == placed.end() ? "no record '" + prefix + "data/" + key + "'" : "a record of " + std::to_string(pl->second.size) + " bytes") +
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
  if (!x.values.empty())
    fail(errc::invalid_metadata, x.header.file + ": '" + x.values.front().name + "'" +
                                     (x.values.size() > 1 ? " (and " + std::to_string(x.values.size() - 1) + " more values)" : std::string()) +
                                     " is not a tensor: a Hugging Face folder's torch.save file holds tensors only (a state dict, "
                                     "nested dicts and lists of tensors); a training checkpoint with other values is read as a file "
                                     "of its own");
  return std::move(x.header);
}

}  // namespace shardsafe
