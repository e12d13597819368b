// shardsafe/format/torch_state_dict.hpp - a torch.save state dict's pickle (data.pkl, or the
// legacy format's value pickle) made into the tensors and values it holds: read through the
// torch.save allowlist (format/torch_tensor_pickle.hpp's torch_tensor_pickle_policy with
// state_dict), flattened to names as torch.distributed.checkpoint flattens them
// (flatten_torch_state_dict, parse_torch_state_dict_pickle), and each tensor placed in its
// storage's record (index_state_dict_tensors, torch_save_index). The rules are at the top of
// format/torch_save.hpp, which reads whole files (zip and legacy) with these.
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

namespace shardsafe {

/// The largest data.pkl of a state dict read (torch pickles a tensor in about 150 bytes: a
/// million tensors fit).
inline constexpr std::uint64_t max_torch_save_pickle = std::uint64_t(64) << 20;

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
  std::vector<torch_save_value> values;                           ///< the values that are not tensors, in pickle order
  /// Where each tensor and value sits in the nested dict (("model", "layers.0.weight"): dict keys
  /// as str, list indices as int), for those whose path is not just (name,).
  std::map<std::string, pickle_value> paths;
};

namespace detail {

/// The state dict a torch.save pickle's value `root` holds, flattened (rules at the top of
/// format/torch_save.hpp); `pickle_bytes` is the pickle's size (what bounds the values and
/// names), `w` names it.
#if SHARDSAFE_DEFINE
SHARDSAFE_DECL torch_state_dict_pickle flatten_torch_state_dict(pickle_view root, std::size_t pickle_bytes,
                                                                const std::string& w) {
  using k = pickle_value::kind;
  torch_state_dict_pickle out;
  if (root.type() != k::dict)
    fail(errc::invalid_metadata,
         w + ": holds a " + pickle_value::kind_name(root.type()) + ", not a state dict (a dict of tensors)");
  auto is_tensor = [](const pickle_view& v) {
    const auto t = v.find(torch_tensor_key);
    return t && t->find(torch_storage_key).has_value();
  };
  auto is_storage = [](const pickle_view& v) { return v.find(torch_storage_key).has_value(); };
  auto is_marker = [](const pickle_view& v) {
    return v.type() == k::dict && v.size() == 1 && v.find(dcp_unpickle_policy::global_key).has_value();
  };
  // a dict of the state dict's own (a tensor's, a storage's and a global's dicts are not)
  auto is_mapping = [&](const pickle_view& v) {
    return v.type() == k::dict && !is_tensor(v) && !is_storage(v) && !is_marker(v);
  };
  // The memo lets one value (a long key, a tensor) stand at many places for a few bytes each:
  // the values flattened and their names' bytes are bounded by the pickle's size (torch writes
  // about 150 bytes a tensor), checked before a name is made.
  const std::uint64_t max_values = pickle_bytes / 8 + 1024,
                      max_name_bytes = 4 * std::uint64_t(pickle_bytes) + (1 << 20);
  std::uint64_t values = 0, name_bytes = 0;
  auto leaf = [&](const std::string& name) {
    if (++values > max_values)
      fail(errc::invalid_metadata, w + ": holds more than " + std::to_string(max_values) + " values (" +
                                       std::to_string(pickle_bytes) +
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
      if (v.type() == k::list && (c.tensor || is_mapping(x) || (x.type() == k::list && !c.whole))) t.whole = false;
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
        if (key.type() == k::string)
          part = std::string(key.as_string(""));
        else if (key.type() == k::integer)
          part = std::to_string(key.as_int(""));
        else if (key.type() == k::boolean || key.type() == k::none || key.type() == k::real)
          part = pickle_repr(key.build(), 64);  // Python's str() of it, as DCP's path holds: "True", "None", "0.5"
        else
          fail(errc::invalid_metadata, w + ": " + where + " has a key of type " + pickle_value::kind_name(key.type()) +
                                           " (keys are str, int, bool, float or None)");
        if (key.type() == k::integer || key.type() == k::boolean || key.type() == k::real) {
          std::pair<bool, std::int64_t> n{false, 0};
          const double d = key.type() == k::real ? key.as_real("") : 0;
          if (key.type() == k::integer)
            n.second = key.as_int("");
          else if (key.type() == k::boolean)
            n.second = key.as_bool("") ? 1 : 0;
          else if (d == std::trunc(d) && d >= -0x1p63 && d < 0x1p63)
            n.second = static_cast<std::int64_t>(d);
          else
            n = {true, std::bit_cast<std::int64_t>(d)};
          if (d == d && !numbers.insert(n).second)  // NaN equals no key, not even another NaN
            fail(errc::invalid_metadata,
                 w + ": " + where + " has two keys Python holds equal (1, True and 1.0 are one key), the second '" +
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
      if (t.foreign)
        unwritable =
            "holds a storage or a torch global (a dtype, a storage class), which shardsafe does not pickle again";
      else if (t.bytes > max_torch_save_pickle - (std::uint64_t(1) << 16) ||
               t.cost > basic_pickle_reader<>::default_max_values)
        unwritable = "shares containers that pickle to over " + std::to_string(t.bytes) + " bytes (" +
                     std::to_string(t.cost) + " values) written out without a memo";
      out.values.push_back({name, v.build(built), std::move(unwritable)});
      record_path(name);
    }
  };
  walk(walk, root, "");
  return out;
}
#else
SHARDSAFE_DECL torch_state_dict_pickle flatten_torch_state_dict(pickle_view root, std::size_t pickle_bytes,
                                                                const std::string& w);
#endif

/// The reader of a state dict's pickle: the values it may make are bounded by its size; every
/// storage it names is recorded in `storages` (torch_tensor_pickle_policy::storages).
inline basic_pickle_reader<torch_tensor_pickle_policy> state_dict_pickle_reader(
    std::string_view bytes, const std::string& w, bool legacy,
    std::map<std::string, torch_storage_id, std::less<>>& storages) {
  using reader = basic_pickle_reader<torch_tensor_pickle_policy>;
  return reader(bytes, w, torch_tensor_pickle_policy{true, legacy, &storages},
                std::max<std::size_t>(reader::default_max_values, bytes.size()));
}

}  // namespace detail

/// Reads a torch.save data.pkl holding a state dict (rules at the top of format/torch_save.hpp);
/// `what` names it.
inline torch_state_dict_pickle parse_torch_state_dict_pickle(std::string_view bytes, std::string_view what) {
  const std::string w(what);
  std::map<std::string, torch_storage_id, std::less<>> storages;
  auto reader = detail::state_dict_pickle_reader(bytes, w, false, storages);
  torch_state_dict_pickle out =
      reader.run([&](pickle_view root) { return detail::flatten_torch_state_dict(root, bytes.size(), w); });
  out.storages = std::move(storages);
  return out;
}

/// The index of a torch.save file of a state dict and its values that are not tensors.
struct torch_save_index {
  safetensors_header header;                  ///< every tensor, at its absolute offset in the file (of_records)
  std::vector<torch_save_value> values;       ///< the values that are not tensors, by name
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
      tbad("storage of " + std::to_string(t.storage_numel) + " elements is not the " + std::to_string(rec.size) +
           " bytes of '" + rec.name + "'");
    const auto n = detail::checked_numel(t.size);
    if (!n) tbad("size " + to_string(t.size) + " overflows");
    std::vector<std::size_t> order = dense_stored_order(t, *n, tbad);
    const auto at = detail::checked_mul(t.storage_offset, item);
    const auto bytes = detail::checked_mul(*n, item);
    const auto end = at && bytes ? detail::checked_add(*at, *bytes) : std::nullopt;
    if (!end || (*n != 0 && *end > rec.size))
      tbad("elements [" + std::to_string(t.storage_offset) + ", +" + std::to_string(*n) + ") of " +
           std::string(to_string(type)) + " pass the end of its storage '" + rec.name + "' (" +
           std::to_string(rec.size) + " bytes)");
    tensor_entry e;
    e.name = key;
    e.type = type;
    e.shape = t.size;
    e.begin = rec.data_offset + (*n == 0 ? 0 : *at);
    e.end = e.begin + *bytes;
    if (!order.empty()) orders.emplace(key, std::move(order));
    entries.push_back(std::move(e));
  }
  torch_save_index x{safetensors_header::of_records(file, file_size, std::move(entries), std::move(orders)),
                     std::move(sd.values), std::move(sd.paths)};
  // a value's name is no tensor's or other value's either (torch.distributed.checkpoint refuses
  // such a dict: "duplicated flatten key")
  std::sort(x.values.begin(), x.values.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < x.values.size(); ++i)
    if ((i > 0 && x.values[i - 1].name == x.values[i].name) || x.header.find(x.values[i].name))
      fail(errc::invalid_metadata, file + ": the flattened name '" + x.values[i].name + "' is given twice");
  return x;
}

}  // namespace detail

}  // namespace shardsafe
