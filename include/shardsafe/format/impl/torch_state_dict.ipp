// shardsafe/format/impl/torch_state_dict.ipp - torch_state_dict.hpp's function bodies (core/config.hpp)
#pragma once

#include "shardsafe/format/torch_state_dict.hpp"

namespace shardsafe {
namespace detail {

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
  // an opaque record (pickle_record_classes: a class the caller reads as one) is one value
  auto is_record = [](const pickle_view& v) {
    return v.type() == k::dict && v.size() > 0 && v.key(0).type() == k::string &&
           v.key(0).as_string("") == torch_record_key;
  };
  // a dict of the state dict's own (a tensor's, a storage's, a global's and a record's dicts are not)
  auto is_mapping = [&](const pickle_view& v) {
    return v.type() == k::dict && !is_tensor(v) && !is_storage(v) && !is_marker(v) && !is_record(v);
  };
  // The memo lets one value (a long key, a tensor) stand at many places for a few bytes each:
  // the values flattened and their names' bytes are bounded by the pickle's size (torch writes
  // about 150 bytes a tensor), checked before a name is made.
  // Each is also bounded by what the tool reads within its memory (max_torch_save_items, ...).
  const std::uint64_t max_values = pickle_bytes / 8 + 1024,
                      max_name_bytes = 4 * std::uint64_t(pickle_bytes) + (1 << 20);
  std::uint64_t values = 0, name_bytes = 0, items = 0, contents = 0;
  auto shown = [](const std::string& name) {  // a name in a message: its first 64 bytes (whole characters)
    if (name.size() <= 80) return "'" + name + "'";
    std::size_t cut = 64;
    while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xc0) == 0x80) --cut;
    return "'" + name.substr(0, cut) + "...' (" + std::to_string(name.size()) + " bytes)";
  };
  auto leaf = [&](const std::string& name, bool tensor) {
    if (++values > max_values)
      fail(errc::invalid_metadata, w + ": holds more than " + std::to_string(max_values) + " values (" +
                                       std::to_string(pickle_bytes) +
                                       " bytes of pickle; torch writes about 150 bytes a tensor)");
    items += tensor ? max_torch_save_items / max_torch_save_tensors : 1;
    if (items > max_torch_save_items)
      fail(errc::invalid_metadata,
           w + ": holds more tensors and values than the tool reads from a torch.save file at " + shown(name) + " (" +
               std::to_string(max_torch_save_tensors) + " tensors, or " + std::to_string(max_torch_save_items) +
               " values, a tensor counting as " + std::to_string(max_torch_save_items / max_torch_save_tensors) +
               " values: docs/FORMAT.md §3)");
    name_bytes += name.size();
    if (name_bytes > max_torch_save_name_bytes)
      fail(errc::invalid_metadata, w + ": its flattened names pass " + std::to_string(max_torch_save_name_bytes) +
                                       " bytes, the most read from a torch.save file (docs/FORMAT.md §3), at " +
                                       shown(name));
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
  // (pickle_string_cost), and how many ints, floats, strs and containers it holds, keys among them
  // (all three saturating: shared containers repeat).
  struct traits {
    bool tensor = false, whole = true, foreign = false;
    std::uint64_t bytes = 0, cost = 1, count = 1;
  };
  constexpr std::uint64_t saturated = std::uint64_t(1) << 62;
  std::unordered_map<const void*, traits> seen;
  auto scan = [&](auto& self, const pickle_view& v) -> traits {
    if (is_tensor(v)) return {true, false, false, 0, 1};
    if (is_storage(v) || is_marker(v) || is_record(v)) return {false, true, true, 0, 1};
    if (v.type() == k::string) {
      const std::size_t n = v.as_string("").size();
      return {false, true, false, 5 + n, pickle_string_cost(n)};
    }
    if (v.type() == k::bytes) {  // written as codecs.encode(latin-1 str): up to 2 bytes each, and the call
      const std::size_t n = v.as_bytes_size();
      return {false, true, false, 64 + 2 * std::uint64_t(n), pickle_string_cost(n)};
    }
    if (v.type() != k::dict && !v.is_sequence() && v.type() != k::set) return {false, true, false, 10, 1};
    if (const auto it = seen.find(v.id()); it != seen.end()) return it->second;
    traits t;
    t.whole = v.type() != k::dict;
    t.bytes = (v.type() == k::set ? 40 : 2) + 2 * (v.size() / 1000 + 1);
    for (std::size_t i = 0; i < v.size(); ++i) {
      const pickle_view x = v.type() == k::dict ? v.value(i) : v.item(i);
      const traits c = self(self, x);
      const traits key = v.type() == k::dict ? self(self, v.key(i)) : traits{false, true, false, 0, 0, 0};
      t.tensor |= c.tensor;
      t.foreign |= c.foreign;
      t.bytes = std::min(saturated, t.bytes + c.bytes + key.bytes);
      t.cost = std::min(saturated, t.cost + c.cost + key.cost);
      t.count = std::min(saturated, t.count + c.count + key.count);
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
      leaf(name, true);
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
        else if (key.type() == k::tuple && !scan(scan, key).tensor && scan(scan, key).count <= 16)
          // a small tuple of plain values (Megatron's distrib_optim.pt keys its buffers by a
          // (param dtype, grad dtype) tuple): named by Python's str() of it, "(torch.float32, torch.float32)"
          part = torch_value_repr(key.build(), 256);
        else
          fail(errc::invalid_metadata, w + ": " + where + " has a key of type " + pickle_value::kind_name(key.type()) +
                                           " (keys are str, int, bool, float, None or a small tuple of them)");
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
      leaf(name, false);
      contents = std::min(saturated, contents + t.count);
      if (contents > max_torch_save_value_contents)
        fail(errc::invalid_metadata,
             w + ": value " + shown(name) + " brings the contents of its values past " +
                 std::to_string(max_torch_save_value_contents) +
                 " (ints, floats, strs, containers: at most so many are read from a torch.save file, docs/FORMAT.md "
                 "§3)");
      // written again (to-dcp), a value must read back here: its archive within the 64 MiB of a
      // DCP item (a few KiB of zip headers aside), its values within pickle_loads' bound
      std::string unwritable;
      if (t.foreign)
        unwritable =
            "holds a storage or a torch global (a dtype, a storage class), or an opaque record of a trainer's "
            "class, which shardsafe does not pickle again";
      else if (t.bytes > max_torch_save_pickle - (std::uint64_t(1) << 16) ||
               t.cost > basic_pickle_reader<>::default_max_values)
        unwritable = "shares containers that pickle to over " + std::to_string(t.bytes) + " bytes (" +
                     std::to_string(t.cost) + " values) written out without a memo";
      pickle_value value;
      try {  // a set: Python leaves out equal items, and cannot hash a list, dict or set in it
        value = v.build(built);
      } catch (const error& e) {
        throw error(e.code(), w + ": value '" + name + "': " + e.what());
      }
      out.values.push_back({name, std::move(value), std::move(unwritable)});
      record_path(name);
    }
  };
  walk(walk, root, "");
  return out;
}

}  // namespace detail
}  // namespace shardsafe
